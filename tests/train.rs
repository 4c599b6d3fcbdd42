//! Training end to end: a two-layer network's loss decreases under SGD and AdamW, a GPT-2
//! language model learns bytes (f32 and bf16 autocast), non-finite
//! gradients are detected and named (error and skip-step policies), optimizer state persists
//! across runs and through safetensors, the step counter counts exactly past 2²⁴, bf16 and f16
//! parameters train through f32 masters like an f64 reference of AdamW, and a short digits
//! training learns, alone and on two host replicas.

#[path = "../examples/common/digits_cnn.rs"]
mod digits_cnn;

use rustytorch::prelude::*;
use rustytorch::Error;

fn two_layer(opt: impl Into<rustytorch::Optimizer>) -> (Executable, HostTensor, HostTensor) {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [16, 4]);
    let y = g.input("y", DType::I64, [16]);
    let w1 = g.param("w1", [4, 32], Init::kaiming_uniform(4, 1));
    let b1 = g.param("b1", [32], Init::zeros());
    let w2 = g.param("w2", [32, 3], Init::kaiming_uniform(32, 2));
    let loss = x.matmul(&w1).add(&b1).relu().matmul(&w2).cross_entropy(&y);
    g.train_step(&loss, opt, &StepOptions::default()).unwrap();
    let exe = compile(&g, &[&loss], Device::Cpu).unwrap();
    // A learnable rule: the class is the index of the largest of the first three features.
    let xs = rustytorch::ops::testing::rand_f64(64, 5, -1.0, 1.0);
    let ys: Vec<i64> = xs
        .chunks(4)
        .map(|r| (0..3).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap() as i64)
        .collect();
    let xt = HostTensor::from_vec(xs.iter().map(|&v| v as f32).collect(), [16, 4]).unwrap();
    (exe, xt, HostTensor::from_vec(ys, [16]).unwrap())
}

fn losses(exe: &mut Executable, x: &HostTensor, y: &HostTensor, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let out = exe.run(&[("x", x.clone()), ("y", y.clone())]).unwrap();
            out[0].to_vec::<f32>().unwrap()[0]
        })
        .collect()
}

#[test]
fn sgd_and_adamw_decrease_the_loss() {
    for opt in [
        rustytorch::Optimizer::from(Sgd::new(0.1).momentum(0.9)),
        AdamW::new(1e-2).into(),
    ] {
        let (mut exe, x, y) = two_layer(opt.clone());
        let l = losses(&mut exe, &x, &y, 60);
        assert!(
            l[59] < 0.5 * l[0],
            "{opt:?}: loss went from {} to {}",
            l[0],
            l[59]
        );
        assert_eq!(
            exe.param("optim.step").unwrap().to_vec::<i64>().unwrap(),
            vec![60]
        );
    }
}

#[test]
fn state_round_trips_through_safetensors() {
    let (mut a, x, y) = two_layer(AdamW::new(1e-2));
    losses(&mut a, &x, &y, 5);
    let dir = std::env::temp_dir().join(format!("rt-state-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("state.safetensors");
    a.save_state(&path).unwrap();
    let (mut b, _, _) = two_layer(AdamW::new(1e-2));
    let n = b.load_state(&path).unwrap();
    assert_eq!(n, a.params().unwrap().len());
    // Same state, same next step.
    assert_eq!(losses(&mut a, &x, &y, 3), losses(&mut b, &x, &y, 3));
}

#[test]
fn the_step_counter_counts_past_2_pow_24() {
    let (mut exe, x, y) = two_layer(AdamW::new(1e-2));
    losses(&mut exe, &x, &y, 1);
    // An f32 counter would stop here: 2²⁴ + 1 rounds back to 2²⁴.
    exe.set_param("optim.step", HostTensor::scalar(16_777_216i64))
        .unwrap();
    let l = losses(&mut exe, &x, &y, 1);
    assert!(l[0].is_finite());
    assert_eq!(
        exe.param("optim.step").unwrap().to_vec::<i64>().unwrap(),
        vec![16_777_217]
    );
    // An f32 value is refused: the counter is an integer.
    assert!(exe
        .set_param("optim.step", HostTensor::scalar(1.0f32))
        .is_err());
}

/// `loss = Σ w·x` with `w` of `dtype`: the gradient is `x`, so an f64 reference of the optimizer
/// can be fed exactly the gradients the graph sees.
fn linear_model(dtype: DType, n: usize, opt: AdamW) -> Executable {
    let g = GraphBuilder::new();
    let x = g.input("x", dtype, [n]);
    let w = g.param_typed(
        "w",
        TensorType::new(dtype, [n]),
        Init::Uniform {
            low: 0.5,
            high: 2.0,
            seed: 7,
        },
        true,
    );
    let loss = w.mul(&x).sum_all();
    g.train_step(&loss, opt, &StepOptions::default()).unwrap();
    compile(&g, &[&loss], Device::Cpu).unwrap()
}

/// Gradients of random magnitude, each element keeping its sign (so the weights drift), rounded
/// to `dtype`.
fn drifting_grads(dtype: DType, n: usize, steps: usize) -> Vec<HostTensor> {
    (0..steps)
        .map(|k| {
            let raw = rustytorch::ops::testing::rand_f64(n, 40 + k as u64, 0.25, 1.0);
            let v: Vec<f32> = raw
                .iter()
                .enumerate()
                .map(|(i, &v)| if i % 2 == 0 { v as f32 } else { -v as f32 })
                .collect();
            HostTensor::from_vec(v, [n]).unwrap().cast(dtype)
        })
        .collect()
}

/// AdamW in f64 over the given gradients, from `p`.
fn adamw_reference(a: &AdamW, mut p: Vec<f64>, grads: &[HostTensor]) -> Vec<f64> {
    let n = p.len();
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    for (t, g) in grads.iter().enumerate() {
        let g = g.to_f64_vec();
        let t = t as i32 + 1;
        let (bc1, bc2) = (1.0 - a.beta1.powi(t), 1.0 - a.beta2.powi(t));
        for i in 0..n {
            m[i] = a.beta1 * m[i] + (1.0 - a.beta1) * g[i];
            v[i] = a.beta2 * v[i] + (1.0 - a.beta2) * g[i] * g[i];
            let denom = (v[i] / bc2).sqrt() + a.eps;
            p[i] = p[i] * (1.0 - a.lr * a.weight_decay) - m[i] / denom * (a.lr / bc1);
        }
    }
    p
}

#[test]
fn half_precision_parameters_train_like_an_f64_reference() {
    let n = 32;
    let steps = 25;
    // Steps of about lr = 1e-3 are under half an ulp of bf16 and f16 weights near 1: only the
    // f32 master accumulates them.
    for (dtype, mantissa) in [(DType::BF16, 7), (DType::F16, 10)] {
        let opt = AdamW::new(1e-3);
        let mut exe = linear_model(dtype, n, opt.clone());
        let p0 = exe.param("w").unwrap().to_f64_vec();
        let grads = drifting_grads(dtype, n, steps);
        for x in &grads {
            exe.run(&[("x", x.clone())]).unwrap();
        }
        let want = adamw_reference(&opt, p0.clone(), &grads);
        let master = exe.param("optim.master.w").unwrap();
        assert_eq!(master.dtype(), DType::F32);
        for name in ["optim.m.w", "optim.v.w"] {
            assert_eq!(exe.param(name).unwrap().dtype(), DType::F32, "{name}");
        }
        let w = exe.param("w").unwrap();
        assert_eq!(w.dtype(), dtype);
        assert_eq!(w.to_f64_vec(), master.cast(dtype).to_f64_vec());
        let (w, master) = (w.to_f64_vec(), master.to_f64_vec());
        for i in 0..n {
            let r = want[i];
            assert!((p0[i] - r).abs() > 0.01, "the reference moves");
            assert!(
                (master[i] - r).abs() < 1e-5,
                "{dtype:?} master[{i}] = {} vs {r}",
                master[i]
            );
            // Within half an ulp of the dtype (and the master's f32 error).
            let half_ulp = 2f64.powi(r.abs().log2().floor() as i32 - mantissa - 1);
            assert!(
                (w[i] - r).abs() <= half_ulp + 1e-5,
                "{dtype:?} w[{i}] = {} vs {r}",
                w[i]
            );
        }
    }
}

#[test]
fn half_precision_state_round_trips_through_safetensors() {
    let grads = drifting_grads(DType::BF16, 8, 6);
    let mut a = linear_model(DType::BF16, 8, AdamW::new(1e-3));
    for x in &grads[..3] {
        a.run(&[("x", x.clone())]).unwrap();
    }
    let dir = std::env::temp_dir().join(format!("rt-bf16-state-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("state.safetensors");
    a.save_state(&path).unwrap();
    let mut b = linear_model(DType::BF16, 8, AdamW::new(1e-3));
    assert_eq!(b.load_state(&path).unwrap(), a.params().unwrap().len());
    for x in &grads[3..] {
        a.run(&[("x", x.clone())]).unwrap();
        b.run(&[("x", x.clone())]).unwrap();
    }
    for name in [
        "w",
        "optim.master.w",
        "optim.m.w",
        "optim.v.w",
        "optim.step",
    ] {
        assert_eq!(
            a.param(name).unwrap().to_f64_vec(),
            b.param(name).unwrap().to_f64_vec(),
            "{name}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

fn nan_graph(policy: NonFinitePolicy) -> Executable {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [3]);
    let good = g.param("good", [3], Init::Full(0.5));
    // sqrt of a negative parameter: its gradient is NaN, the other parameter's is finite.
    let bad = g.param("bad", [3], Init::Full(-1.0));
    let loss = x.mul(&good).sum_all().add(&bad.sqrt().sum_all());
    g.train_step(&loss, Sgd::new(0.1), &StepOptions::default())
        .unwrap();
    let opts = CompileOptions {
        nonfinite: policy,
        ..Default::default()
    };
    compile_with(&g, &[&loss], Device::Cpu, &opts).unwrap()
}

#[test]
fn nan_gradients_are_detected_and_named() {
    let x = HostTensor::from_vec(vec![1.0f32, 2.0, 3.0], [3]).unwrap();
    let mut exe = nan_graph(NonFinitePolicy::Error);
    match exe.run(&[("x", x.clone())]) {
        Err(Error::NonFinite { param }) => assert_eq!(param, "bad"),
        other => panic!("expected a non-finite gradient error, got {other:?}"),
    }
    assert_eq!(
        exe.param("good").unwrap().to_vec::<f32>().unwrap(),
        vec![0.5; 3]
    );

    let mut exe = nan_graph(NonFinitePolicy::SkipStep);
    let out = exe.run(&[("x", x)]).unwrap();
    assert_eq!(out.skipped.as_deref(), Some("bad"));
    assert_eq!(
        exe.param("good").unwrap().to_vec::<f32>().unwrap(),
        vec![0.5; 3]
    );
    assert_eq!(
        exe.param("optim.step").unwrap().to_vec::<i64>().unwrap(),
        vec![0]
    );
}

#[test]
fn gradient_clipping_bounds_the_update() {
    let g = GraphBuilder::new();
    let w = g.param("w", [4], Init::Full(0.0));
    let x = g.input("x", DType::F32, [4]);
    let loss = w.mul(&x).sum_all();
    let step = g
        .train_step(
            &loss,
            Sgd::new(1.0),
            &StepOptions {
                clip_norm: Some(1.0),
                ..Default::default()
            },
        )
        .unwrap();
    let mut exe = compile(&g, &[&loss, &step.grad_norm], Device::Cpu).unwrap();
    let xs = HostTensor::from_vec(vec![30.0f32, 40.0, 0.0, 0.0], [4]).unwrap();
    let out = exe.run(&[("x", xs)]).unwrap();
    assert!((out[1].to_vec::<f32>().unwrap()[0] - 50.0).abs() < 1e-3);
    let w1 = exe.param("w").unwrap().to_vec::<f32>().unwrap();
    // Gradient (30, 40, 0, 0) clipped to norm 1 → step (0.6, 0.8, 0, 0).
    for (a, b) in w1.iter().zip([-0.6f32, -0.8, 0.0, 0.0]) {
        assert!((a - b).abs() < 1e-4, "{w1:?}");
    }
}

#[test]
fn digits_cnn_learns() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/data/digits.csv.gz");
    let data = rustytorch::data::load_digits(&path).unwrap();
    let (train, test) = data.split(360, 42);
    let (exe, _) = digits_cnn::train_digits(&train, 32, 2, |_, _, _| {}).unwrap();
    let acc = digits_cnn::accuracy(&exe, &test, 120).unwrap();
    assert!(acc > 0.85, "test accuracy after 2 epochs: {acc}");
}

#[test]
fn digits_cnn_trains_the_same_on_two_host_replicas() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/data/digits.csv.gz");
    let data = rustytorch::data::load_digits(&path).unwrap();
    let (train, test) = data.split(360, 42);
    let (one, l1) = digits_cnn::train_digits_on(Device::Cpu, &train, 32, 2, |_, _, _| {}).unwrap();
    let (two, l2) =
        digits_cnn::train_digits_parallel(&[Device::Cpu, Device::Cpu], &train, 32, 2, |_, _, _| {})
            .unwrap();
    // The replicas' GEMMs over half batches accumulate in another order than the full batch's
    // (how much depends on the GEMM kernels' blocking), and two epochs of AdamW carry that
    // rounding forward: equal within 1e-3, where a wrong average would be off by far more.
    assert!(
        (l1 - l2).abs() <= 1e-3 * l1.abs(),
        "epoch loss {l1} vs {l2}"
    );
    // AdamW's normalized steps turn those rounding differences into parameter differences of a
    // few steps' size (its learning rate is 2e-3; measured up to 5.7e-3 with the AVX-512 GEMM,
    // while each side alone is deterministic to the bit); a replica training on the wrong shard
    // would be off by the weights' own scale.
    let mut worst = 0.0f64;
    for (name, _) in one.param_types() {
        let (a, b) = (one.param(name).unwrap(), two.param(name).unwrap());
        for (x, y) in a.to_f64_vec().iter().zip(b.to_f64_vec()) {
            worst = worst.max((x - y).abs());
        }
    }
    assert!(worst <= 1e-2, "parameters differ by up to {worst}");
    // The replica taken out of the group runs alone, to the single device's accuracy.
    let acc = digits_cnn::accuracy(&two, &test, 120).unwrap();
    let alone = digits_cnn::accuracy(&one, &test, 120).unwrap();
    assert!(acc > 0.85, "test accuracy after 2 epochs: {acc}");
    assert!((acc - alone).abs() <= 0.02, "{acc} vs {alone}");
}

/// The GPT-2 language model builder learns a repeated sentence byte by byte, in f32 and under
/// bf16 autocast (tied embeddings, position embeddings, causal attention, the LM head).
#[test]
fn gpt2_lm_learns_bytes() {
    use rustytorch::models::{gpt2_lm, Gpt2Config};
    let cfg = Gpt2Config {
        layers: 1,
        batch: 4,
        seq: 16,
        d_model: 32,
        heads: 2,
    };
    let text = b"the compiler fuses every op into one kernel. ".repeat(8);
    let window = |i: usize| -> Vec<i64> { text[i..i + 16].iter().map(|&c| c as i64).collect() };
    let (mut ids, mut tg) = (vec![], vec![]);
    for k in 0..4 {
        ids.extend(window(7 * k));
        tg.extend(window(7 * k + 1));
    }
    let ids = HostTensor::from_vec(ids, [4, 16]).unwrap();
    let tg = HostTensor::from_vec(tg, [4, 16]).unwrap();
    for autocast in [None, Some(DType::BF16)] {
        let g = GraphBuilder::new();
        let lm = gpt2_lm(&g, &cfg, 256);
        g.train_step(&lm.loss, AdamW::new(1e-2), &StepOptions::default())
            .unwrap();
        let opts = CompileOptions {
            autocast,
            ..CompileOptions::default()
        };
        let mut exe = rustytorch::compile_with(&g, &[&lm.loss], Device::Cpu, &opts).unwrap();
        let losses: Vec<f64> = (0..60)
            .map(|_| {
                let out = exe
                    .run(&[("ids", ids.clone()), ("targets", tg.clone())])
                    .unwrap();
                out[0].to_f64_vec()[0]
            })
            .collect();
        assert!(
            (losses[0] - 256f64.ln()).abs() < 0.2,
            "{autocast:?}: starts near ln 256: {}",
            losses[0]
        );
        assert!(
            losses[59] < 0.25 * losses[0],
            "{autocast:?}: learns: {losses:?}"
        );
    }
}
