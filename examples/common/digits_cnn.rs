// The digits CNN shared by the `digits` example and the training test.
use rustytorch::prelude::*;

/// Builds the classifier for `batch` 8×8 images, a fixed size or a named dim
/// (`g.dim("batch", 16)`: the executable then runs any batch size); returns (images input,
/// logits). Parameters are named, so executables of different batch sizes can exchange them.
pub fn digits_cnn(g: &GraphBuilder, batch: impl Into<DimExpr>) -> (Tensor, Tensor) {
    let batch = batch.into();
    let x = g.input_dims(
        "x",
        DType::F32,
        &[batch.clone(), 1.into(), 8.into(), 8.into()],
    );
    let c1 = g.param("conv1.w", [16, 1, 3, 3], Init::kaiming_uniform(9, 11));
    let b1 = g.param("conv1.b", [16], Init::kaiming_uniform(9, 12));
    let c2 = g.param("conv2.w", [32, 16, 3, 3], Init::kaiming_uniform(144, 13));
    let b2 = g.param("conv2.b", [32], Init::kaiming_uniform(144, 14));
    let w3 = g.param("fc1.w", [512, 64], Init::kaiming_uniform(512, 15));
    let b3 = g.param("fc1.b", [64], Init::kaiming_uniform(512, 16));
    let w4 = g.param("fc2.w", [64, 10], Init::kaiming_uniform(64, 17));
    let b4 = g.param("fc2.b", [10], Init::kaiming_uniform(64, 18));
    let same = ConvOpts::default().padding(&[1]);
    let h = x.conv(&c1, Some(&b1), &same).relu();
    let h = h.conv(&c2, Some(&b2), &same).relu();
    let h = h.max_pool(&[2], &[2], &[0]); // [B, 32, 4, 4]
    let h = h.reshape_dims(&[batch, 512.into()]); // flatten, following the batch
    let h = h.matmul(&w3).add(&b3).gelu();
    let logits = h.matmul(&w4).add(&b4);
    (x, logits)
}

/// One batch of images and labels as host tensors.
#[allow(dead_code)]
pub fn batch_tensors(d: &rustytorch::data::Dataset, idx: &[usize]) -> (HostTensor, HostTensor) {
    let b = d.select(idx);
    let n = idx.len();
    (
        HostTensor::from_vec(b.x, [n, 1, 8, 8]).expect("sizes match"),
        HostTensor::from_vec(b.y, [n]).expect("sizes match"),
    )
}

/// Data augmentation: each image moved by up to one pixel in each direction (zero fill), the
/// shift drawn from a seeded stream so training is reproducible.
#[allow(dead_code)]
pub fn shift_augment(x: &HostTensor, seed: u64) -> rustytorch::Result<HostTensor> {
    let v = x.to_vec::<f32>()?;
    let mut out = vec![0.0f32; v.len()];
    for (i, (img, o)) in v.chunks(64).zip(out.chunks_mut(64)).enumerate() {
        let r = |k: u64| (rustytorch::ops::rng::uniform01(seed, 2 * i as u64 + k) * 3.0) as i64 - 1;
        let (dy, dx) = (r(0), r(1));
        for y in 0..8i64 {
            for x in 0..8i64 {
                let (sy, sx) = (y - dy, x - dx);
                if (0..8).contains(&sy) && (0..8).contains(&sx) {
                    o[(y * 8 + x) as usize] = img[(sy * 8 + sx) as usize];
                }
            }
        }
    }
    Ok(HostTensor::from_vec(out, x.dims().to_vec())?)
}

/// Trains on the CPU for `epochs` and returns (train executable, final mean loss of the last
/// epoch). Calls `progress(epoch, step, loss)` after every step.
#[allow(dead_code)]
pub fn train_digits(
    train: &rustytorch::data::Dataset,
    batch: usize,
    epochs: usize,
    progress: impl FnMut(usize, usize, f32),
) -> rustytorch::Result<(Executable, f32)> {
    train_digits_on(Device::Cpu, train, batch, epochs, progress)
}

/// The training graph of the classifier for `rows` images a step (cross entropy, AdamW), its
/// gradients averaged over data-parallel replicas when `sync` is set; returns the loss.
#[allow(dead_code)]
fn train_graph(g: &GraphBuilder, rows: usize, sync: bool) -> rustytorch::Result<Tensor> {
    let (_, logits) = digits_cnn(g, rows);
    let y = g.input("y", DType::I64, [rows]);
    let loss = logits.cross_entropy(&y);
    g.output("loss", &loss);
    let opts = StepOptions {
        grad_sync: sync.then(rustytorch::compiler::GradSync::default),
        ..Default::default()
    };
    g.train_step(&loss, AdamW::new(2e-3).weight_decay(1e-4), &opts)?;
    Ok(loss)
}

/// The epochs of training: each a fresh seeded order of `train` in batches of `batch` images
/// (shift-augmented), `step` running one batch and returning its mean loss. Returns the last
/// epoch's mean loss.
#[allow(dead_code)]
fn train_epochs(
    train: &rustytorch::data::Dataset,
    batch: usize,
    epochs: usize,
    mut progress: impl FnMut(usize, usize, f32),
    mut step: impl FnMut(HostTensor, HostTensor) -> rustytorch::Result<f32>,
) -> rustytorch::Result<f32> {
    let steps = train.len() / batch;
    let mut last = 0.0;
    for epoch in 0..epochs {
        // A fresh seeded order each epoch.
        let (shuffled, _) = train.split(0, 1000 + epoch as u64);
        let mut sum = 0.0;
        for s in 0..steps {
            let idx: Vec<usize> = (s * batch..(s + 1) * batch).collect();
            let (xb, yb) = batch_tensors(&shuffled, &idx);
            let xb = shift_augment(&xb, (epoch * steps + s) as u64)?;
            let l = step(xb, yb)?;
            sum += l;
            progress(epoch, s, l);
        }
        last = sum / steps as f32;
    }
    Ok(last)
}

/// [`train_digits`] on `device`.
#[allow(dead_code)]
pub fn train_digits_on(
    device: Device,
    train: &rustytorch::data::Dataset,
    batch: usize,
    epochs: usize,
    progress: impl FnMut(usize, usize, f32),
) -> rustytorch::Result<(Executable, f32)> {
    let g = GraphBuilder::new();
    let loss = train_graph(&g, batch, false)?;
    let mut exe = compile(&g, &[&loss], device)?;
    let last = train_epochs(train, batch, epochs, progress, |xb, yb| {
        let out = exe.run(&[("x", xb), ("y", yb)])?;
        Ok(out[0].to_vec::<f32>()?[0])
    })?;
    Ok((exe, last))
}

/// [`train_digits_on`] data-parallel: one replica per device, each on an equal share of every
/// batch of `batch` images, gradients averaged over the replicas before the update (the same
/// training as one device on the whole batch). Returns the first replica on its own.
#[allow(dead_code)]
pub fn train_digits_parallel(
    devices: &[Device],
    train: &rustytorch::data::Dataset,
    batch: usize,
    epochs: usize,
    progress: impl FnMut(usize, usize, f32),
) -> rustytorch::Result<(Executable, f32)> {
    let world = devices.len().max(1);
    let g = GraphBuilder::new();
    train_graph(&g, batch / world, true)?;
    let mut dp =
        rustytorch::parallel::DataParallel::new(&g.graph()?, devices, &CompileOptions::default())?;
    let last = train_epochs(train, batch, epochs, progress, |xb, yb| {
        let outs = dp.run(&[("x", xb), ("y", yb)])?;
        // The whole batch's mean loss: the mean of the equal shards' means.
        let mut l = 0.0;
        for o in &outs {
            l += o[0].to_vec::<f32>()?[0] / outs.len() as f32;
        }
        Ok(l)
    })?;
    Ok((dp.into_replica(0)?, last))
}

/// [`train_digits_parallel`] as one process of a multi-process group described by the
/// environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `RUSTYTORCH_NCCL_ID_FILE`: see
/// `DataParallel::from_env`): every process reads the same batches and trains its rank's share
/// on `cuda:LOCAL_RANK`. Returns this process's replica on its own, its rank, and the mean loss
/// of its shards in the last epoch.
#[allow(dead_code)]
pub fn train_digits_from_env(
    train: &rustytorch::data::Dataset,
    batch: usize,
    epochs: usize,
    progress: impl FnMut(usize, usize, f32),
) -> rustytorch::Result<(Executable, usize, f32)> {
    let env = rustytorch::parallel::DistEnv::from_env()?;
    let g = GraphBuilder::new();
    train_graph(&g, batch / env.world, true)?;
    let mut dp = rustytorch::parallel::DataParallel::from_dist_env(
        &g.graph()?,
        &env,
        &CompileOptions::default(),
    )?;
    let last = train_epochs(train, batch, epochs, progress, |xb, yb| {
        let outs = dp.run(&[("x", xb), ("y", yb)])?;
        Ok(outs[0][0].to_vec::<f32>()?[0])
    })?;
    Ok((dp.into_replica(0)?, env.rank, last))
}

/// Accuracy of the trained parameters of `trained` on `test` (evaluated on the device `trained`
/// runs on, in batches of `batch`, the last partial batch padded).
#[allow(dead_code)]
pub fn accuracy(
    trained: &Executable,
    test: &rustytorch::data::Dataset,
    batch: usize,
) -> rustytorch::Result<f64> {
    let g = GraphBuilder::new();
    let (_, logits) = digits_cnn(&g, batch);
    let pred = logits.argmax(-1, false);
    let mut eval = compile_with(&g, &[&pred], trained.device(), &CompileOptions::inference())?;
    eval.copy_params_from(trained)?;
    let mut correct = 0;
    let mut start = 0;
    while start < test.len() {
        let idx: Vec<usize> = (start..start + batch)
            .map(|i| i.min(test.len() - 1))
            .collect();
        let (xb, _) = batch_tensors(test, &idx);
        let p = eval.run(&[("x", xb)])?[0].to_vec::<i64>()?;
        for (k, &i) in idx.iter().enumerate() {
            if start + k < test.len() && p[k] == test.y[i] {
                correct += 1;
            }
        }
        start += batch;
    }
    Ok(correct as f64 / test.len() as f64)
}
