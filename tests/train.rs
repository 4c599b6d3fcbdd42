//! Training end to end: a two-layer network's loss decreases under SGD and AdamW, non-finite
//! gradients are detected and named (error and skip-step policies), optimizer state persists
//! across runs and through safetensors, and a short digits training learns.

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
            exe.param("optim.step").unwrap().to_vec::<f32>().unwrap(),
            vec![60.0]
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
        exe.param("optim.step").unwrap().to_vec::<f32>().unwrap(),
        vec![0.0]
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
