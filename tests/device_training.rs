//! Training on every device (the CPU here; the CPU and CUDA where `RUSTYTORCH_TEST_CUDA=1`), one
//! test body each: an MLP classifier on the UCI digits reaches the same accuracy on the GPU as on
//! the CPU, its parameters never leave the device between steps (host↔device copies per step are
//! counted), CUDA and CPU parameters agree after the same steps, and a non-finite gradient skips
//! the step on the device.

use rustytorch::prelude::*;
use rustytorch::runtime::device::test_devices;

const BATCH: usize = 64;

fn mlp(device: Device) -> Executable {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [BATCH, 64]);
    let y = g.input("y", DType::I64, [BATCH]);
    let w1 = g.param("fc1.w", [64, 128], Init::kaiming_uniform(64, 1));
    let b1 = g.param("fc1.b", [128], Init::zeros());
    let w2 = g.param("fc2.w", [128, 10], Init::kaiming_uniform(128, 2));
    let b2 = g.param("fc2.b", [10], Init::zeros());
    let logits = x.matmul(&w1).add(&b1).gelu().matmul(&w2).add(&b2);
    let loss = logits.cross_entropy(&y);
    let pred = logits.argmax(-1, false);
    g.output("pred", &pred);
    g.train_step(
        &loss,
        AdamW::new(3e-3).weight_decay(1e-4),
        &StepOptions {
            clip_norm: Some(5.0),
            ..Default::default()
        },
    )
    .unwrap();
    compile(&g, &[&loss, &pred], device).unwrap()
}

fn digits() -> (rustytorch::data::Dataset, rustytorch::data::Dataset) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/data/digits.csv.gz");
    let all = rustytorch::data::load_digits(&path).unwrap();
    all.split(360, 7)
}

fn batch(d: &rustytorch::data::Dataset, s: usize) -> (HostTensor, HostTensor) {
    let idx: Vec<usize> = (s * BATCH..(s + 1) * BATCH).map(|i| i % d.len()).collect();
    let b = d.select(&idx);
    (
        HostTensor::from_vec(b.x, [BATCH, 64]).unwrap(),
        HostTensor::from_vec(b.y, [BATCH]).unwrap(),
    )
}

/// Trains `epochs` over `train` and returns the executable and the accuracy on `test`.
fn train_and_score(device: Device, epochs: usize) -> (Executable, f64) {
    let (train, test) = digits();
    let mut exe = mlp(device);
    let steps = train.len() / BATCH;
    for _ in 0..epochs {
        for s in 0..steps {
            let (x, y) = batch(&train, s);
            exe.run(&[("x", x), ("y", y)]).unwrap();
        }
    }
    // Score with the training executable's predictions (an update per batch is applied too, but
    // the accuracy of the test rows is what is counted, rows read once each).
    let mut right = 0;
    let mut seen = 0;
    let mut infer = {
        let g = GraphBuilder::new();
        let x = g.input("x", DType::F32, [BATCH, 64]);
        let w1 = g.param("fc1.w", [64, 128], Init::zeros());
        let b1 = g.param("fc1.b", [128], Init::zeros());
        let w2 = g.param("fc2.w", [128, 10], Init::zeros());
        let b2 = g.param("fc2.b", [10], Init::zeros());
        let pred = x
            .matmul(&w1)
            .add(&b1)
            .gelu()
            .matmul(&w2)
            .add(&b2)
            .argmax(-1, false);
        compile_with(&g, &[&pred], device, &CompileOptions::inference()).unwrap()
    };
    infer.copy_params_from(&exe).unwrap();
    for s in 0..test.len().div_ceil(BATCH) {
        let (x, y) = batch(&test, s);
        let p = infer.run(&[("x", x)]).unwrap()[0].to_vec::<i64>().unwrap();
        let y = y.to_vec::<i64>().unwrap();
        for i in 0..BATCH {
            if s * BATCH + i < test.len() {
                seen += 1;
                right += (p[i] == y[i]) as usize;
            }
        }
    }
    (exe, right as f64 / seen as f64)
}

#[test]
fn mlp_trains_to_the_same_accuracy_on_every_device() {
    let mut accs = vec![];
    for device in test_devices() {
        let (_, acc) = train_and_score(device, 8);
        println!("{device}: test accuracy {:.2}%", acc * 100.0);
        assert!(acc > 0.93, "{device}: accuracy {acc}");
        accs.push(acc);
    }
    if let [cpu, gpu] = accs[..] {
        assert!((cpu - gpu).abs() < 0.02, "cpu {cpu} vs gpu {gpu}");
    }
}

#[test]
fn parameters_stay_on_the_device_between_steps() {
    for device in test_devices() {
        let (train, _) = digits();
        let mut exe = mlp(device);
        let (x, y) = batch(&train, 0);
        exe.run(&[("x", x.clone()), ("y", y.clone())]).unwrap();
        let before = exe.transfers();
        let n = 5;
        for _ in 0..n {
            exe.run(&[("x", x.clone()), ("y", y.clone())]).unwrap();
        }
        let d = exe.transfers();
        let per_step_htod = (d.htod_copies - before.htod_copies) / n;
        let per_step_dtoh = (d.dtoh_copies - before.dtoh_copies) / n;
        let per_step_bytes =
            (d.htod_bytes - before.htod_bytes) / n + (d.dtoh_bytes - before.dtoh_bytes) / n;
        println!(
            "{device}: per step {per_step_htod} htod, {per_step_dtoh} dtoh, {per_step_bytes} bytes"
        );
        if let Device::Cuda(_) = device {
            // Inputs x and y in; the two outputs and the guards out, the guards (one per
            // trainable parameter) gathered into one copy.
            assert_eq!(per_step_htod, 2, "{device}");
            let guards = exe.plan().guards.len() as u64;
            assert!(guards > 1);
            assert_eq!(per_step_dtoh, 3, "{device}");
            let param_bytes: u64 = exe
                .plan()
                .param_types
                .iter()
                .map(|t| t.size_bytes() as u64)
                .sum();
            assert!(
                per_step_bytes < param_bytes / 4,
                "{per_step_bytes} bytes per step for {param_bytes} bytes of state"
            );
        } else {
            assert_eq!(d, before);
        }
    }
}

#[test]
fn cuda_and_cpu_parameters_agree_after_training_steps() {
    let devices = test_devices();
    if devices.len() < 2 {
        return;
    }
    let (train, _) = digits();
    let mut exes: Vec<Executable> = devices.iter().map(|&d| mlp(d)).collect();
    for s in 0..10 {
        let (x, y) = batch(&train, s);
        for exe in &mut exes {
            exe.run(&[("x", x.clone()), ("y", y.clone())]).unwrap();
        }
    }
    for name in ["fc1.w", "fc1.b", "fc2.w", "fc2.b"] {
        let a = exes[0].param(name).unwrap().to_f64_vec();
        let b = exes[1].param(name).unwrap().to_f64_vec();
        rustytorch::ops::testing::assert_close(&b, &a, 2e-3, name);
    }
}

#[test]
fn nonfinite_gradient_skips_the_step_on_the_device() {
    for device in test_devices() {
        let g = GraphBuilder::new();
        let x = g.input("x", DType::F32, [3]);
        let good = g.param("good", [3], Init::Full(0.5));
        let bad = g.param("bad", [3], Init::Full(-1.0));
        let loss = x.mul(&good).add(&bad.sqrt()).sum(&[0], false);
        g.train_step(&loss, Sgd::new(0.1), &StepOptions::default())
            .unwrap();
        let opts = CompileOptions {
            nonfinite: NonFinitePolicy::SkipStep,
            ..CompileOptions::default()
        };
        let mut exe = compile_with(&g, &[&loss], device, &opts).unwrap();
        let out = exe
            .run(&[(
                "x",
                HostTensor::from_vec(vec![1.0f32, 2.0, 3.0], [3]).unwrap(),
            )])
            .unwrap();
        assert_eq!(out.skipped.as_deref(), Some("bad"), "{device}");
        assert_eq!(
            exe.param("good").unwrap().to_vec::<f32>().unwrap(),
            vec![0.5; 3],
            "{device}"
        );
    }
}

#[test]
fn bf16_parameters_train_with_f32_master_weights_on_every_device() {
    let (train, _) = digits();
    let mut results = vec![];
    for device in test_devices() {
        let g = GraphBuilder::new();
        let x = g.input("x", DType::BF16, [BATCH, 64]);
        let y = g.input("y", DType::I64, [BATCH]);
        let ty = |dims: Vec<usize>| TensorType::new(DType::BF16, Shape::new(dims));
        let w1 = g.param_typed(
            "fc1.w",
            ty(vec![64, 64]),
            Init::kaiming_uniform(64, 1),
            true,
        );
        let w2 = g.param_typed(
            "fc2.w",
            ty(vec![64, 10]),
            Init::kaiming_uniform(64, 2),
            true,
        );
        let loss = x
            .matmul(&w1)
            .gelu()
            .matmul(&w2)
            .cast(DType::F32)
            .cross_entropy(&y);
        g.train_step(&loss, AdamW::new(1e-3), &StepOptions::default())
            .unwrap();
        let mut exe = compile(&g, &[&loss], device).unwrap();
        let first = exe.param("fc1.w").unwrap().to_f64_vec();
        let mut losses = vec![];
        for s in 0..20 {
            let (xb, yb) = batch(&train, s);
            let out = exe.run(&[("x", xb.cast(DType::BF16)), ("y", yb)]).unwrap();
            losses.push(out[0].to_f64_vec()[0]);
        }
        let w = exe.param("fc1.w").unwrap();
        assert_eq!(w.dtype(), DType::BF16);
        let moved = w
            .to_f64_vec()
            .iter()
            .zip(&first)
            .filter(|(a, b)| a != b)
            .count();
        // Steps of 1e-3 are below half a bf16 ulp for most weights: without the f32 master they
        // would never move.
        assert!(
            moved > first.len() / 2,
            "{device}: only {moved} weights moved"
        );
        assert!(losses[19] < losses[0], "{device}: {losses:?}");
        let step = exe.param("optim.step").unwrap();
        assert_eq!(step.dtype(), DType::I64);
        assert_eq!(step.to_vec::<i64>().unwrap(), vec![20]);
        results.push(w.to_f64_vec());
    }
    if let [cpu, gpu] = &results[..] {
        // The f32 masters agree closely; the bf16 copies may differ by one rounding step.
        rustytorch::ops::testing::assert_close(gpu, cpu, 2e-2, "bf16 fc1.w cuda vs cpu");
    }
}

/// A causal self-attention block trained on every device from the same start: after the same
/// steps its parameters agree (on the GPU machine, the attention gradient's kernels against the
/// CPU kernel through whole training steps).
#[test]
fn attention_block_trains_alike_on_cuda_and_cpu() {
    let devices = test_devices();
    let (b, s, d, h) = (4, 24, 32, 4);
    let build = |device: Device| {
        let g = GraphBuilder::new();
        let x = g.input("x", DType::F32, [b, s, d]);
        let y = g.input("y", DType::F32, [b, s, d]);
        let wq = g.param("wq", [d, d], Init::kaiming_uniform(d, 11));
        let wk = g.param("wk", [d, d], Init::kaiming_uniform(d, 12));
        let wv = g.param("wv", [d, d], Init::kaiming_uniform(d, 13));
        let wo = g.param("wo", [d, d], Init::kaiming_uniform(d, 14));
        let heads = |t: &Tensor| t.reshape([b, s, h, d / h]).permute(&[0, 2, 1, 3]);
        let (q, k, v) = (
            heads(&x.matmul(&wq)),
            heads(&x.matmul(&wk)),
            heads(&x.matmul(&wv)),
        );
        let a = q
            .attention(&k, &v, None, Causal::TopLeft, None)
            .permute(&[0, 2, 1, 3])
            .reshape([b, s, d]);
        let out = x.add(&a.matmul(&wo));
        let loss = out.sub(&y).mul(&out.sub(&y)).mean_all();
        g.train_step(&loss, AdamW::new(1e-2), &StepOptions::default())
            .unwrap();
        compile(&g, &[&loss], device).unwrap()
    };
    let mut exes: Vec<Executable> = devices.iter().map(|&dv| build(dv)).collect();
    let ty = TensorType::new(DType::F32, Shape::new(vec![b, s, d]));
    for step in 0..5 {
        let x = rustytorch::ops::testing::rand_tensor(&ty, 100 + step, -1.0, 1.0);
        let y = rustytorch::ops::testing::rand_tensor(&ty, 200 + step, -1.0, 1.0);
        for exe in &mut exes {
            exe.run(&[("x", x.clone()), ("y", y.clone())]).unwrap();
        }
    }
    for name in ["wq", "wk", "wv", "wo"] {
        let a = exes[0].param(name).unwrap().to_f64_vec();
        for other in &exes[1..] {
            let c = other.param(name).unwrap().to_f64_vec();
            rustytorch::ops::testing::assert_close(&c, &a, 2e-3, name);
        }
    }
}
