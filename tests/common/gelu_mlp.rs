//! The MLP the epilogue tests train (tests/bias_grad_epilogue.rs, gelu_aux_epilogue.rs): a
//! biased GEMM, the tanh GELU, a second biased GEMM and an MSE loss, with its SGD step.
#![allow(dead_code)]

use rustytorch::ops::testing::rand_tensor;
use rustytorch::prelude::*;

/// Whether the tests run on CUDA (`RUSTYTORCH_TEST_CUDA=1`, the GPU machine).
pub fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

/// `loss = mse(gelu_tanh(x·W1 + b1)·W2 + b2, y)` and its SGD step, every tensor of `dt`; `x` of
/// `dims` (`[rows, 64]` or `[batch, seq, 64]`).
pub fn mlp(dims: &[usize], dt: DType) -> (GraphBuilder, Tensor) {
    let g = GraphBuilder::new();
    let x = g.input("x", dt, dims.to_vec());
    let mut yd = dims.to_vec();
    *yd.last_mut().unwrap() = 32;
    let y = g.input("y", dt, yd);
    let p = |name: &str, shape: &[usize], init| {
        g.param_typed(name, TensorType::new(dt, shape.to_vec()), init, true)
    };
    let w1 = p("w1", &[64, 128], Init::kaiming_uniform(64, 1));
    let b1 = p("b1", &[128], Init::Full(0.1));
    let w2 = p("w2", &[128, 32], Init::kaiming_uniform(128, 2));
    let b2 = p("b2", &[32], Init::Full(-0.1));
    let out = x.matmul(&w1).add(&b1).gelu_tanh().matmul(&w2).add(&b2);
    let loss = out.mse_loss(&y);
    g.train_step(&loss, Sgd::new(0.05), &StepOptions::default())
        .unwrap();
    (g, loss)
}

/// The input shapes: rows, and a batch of sequences.
pub const DIMS: [&[usize]; 2] = [&[64, 64], &[2, 32, 64]];

/// Losses and `(b1, b2, w1)` after three SGD steps on `dev`.
pub fn train(dims: &[usize], dt: DType, dev: Device) -> (Vec<f64>, Vec<Vec<f64>>) {
    let (g, loss) = mlp(dims, dt);
    let mut exe = compile(&g, &[&loss], dev).unwrap();
    let mut yd = dims.to_vec();
    *yd.last_mut().unwrap() = 32;
    let xt = rand_tensor(&TensorType::new(dt, dims.to_vec()), 3, -2.0, 2.0);
    let yt = rand_tensor(&TensorType::new(dt, yd), 4, -1.0, 1.0);
    let losses = (0..3)
        .map(|_| exe.run(&[("x", xt.clone()), ("y", yt.clone())]).unwrap()[0].to_f64_vec()[0])
        .collect();
    let params = ["b1", "b2", "w1"]
        .iter()
        .map(|p| exe.param(p).unwrap().to_f64_vec())
        .collect();
    (losses, params)
}

/// Trains the MLP on the test device (CUDA where `RUSTYTORCH_TEST_CUDA=1`, else the CPU) under
/// each value of the environment variable `var` (read when a graph is compiled) and compares the
/// losses and parameters with the CPU's.
pub fn train_modes_against_cpu(var: &str, modes: &[&str]) {
    let dev = if cuda() { Device::Cuda(0) } else { Device::Cpu };
    for mode in modes {
        std::env::set_var(var, mode);
        for dt in [DType::F32, DType::BF16] {
            for dims in DIMS {
                let (lg, pg) = train(dims, dt, dev);
                let (lc, pc) = train(dims, dt, Device::Cpu);
                let tol = if dt == DType::F32 { 1e-4 } else { 3e-2 };
                let what = format!("{var}={mode} {dt} {dims:?} on {dev:?}");
                rustytorch::ops::testing::assert_close(&lg, &lc, tol, &format!("losses, {what}"));
                for (name, (g, c)) in ["b1", "b2", "w1"].iter().zip(pg.iter().zip(&pc)) {
                    rustytorch::ops::testing::assert_close(g, c, tol, &format!("{name}, {what}"));
                }
            }
        }
    }
    std::env::remove_var(var);
}
