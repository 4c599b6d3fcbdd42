//! What the convolution device tests share (tests/device_conv_layout.rs, device_conv_act.rs,
//! device_conv_graph.rs): the test device, random operands, and the comparison against the CPU
//! relative to the output's largest magnitude.
#![allow(dead_code)]

use rustytorch::ops::testing::{assert_close, rand_tensor};
use rustytorch::prelude::*;

/// Whether the tests run on CUDA (`RUSTYTORCH_TEST_CUDA=1`, the GPU machine).
pub fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

/// CUDA device 0 on the GPU machine, else the CPU.
pub fn device() -> Device {
    if cuda() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    }
}

/// Tolerance against the output's largest magnitude (at least 1): convolutions sum many products
/// and some cuDNN algorithms round partial sums to the storage type; an activation adds one
/// rounding of its own.
pub fn tol(d: DType) -> f64 {
    match d {
        DType::F32 => 1e-4,
        DType::F16 => 4e-3,
        _ => 2e-2,
    }
}

/// `got` against `want`, both divided by `want`'s largest magnitude (at least 1), within
/// [`tol`].
pub fn scaled_close(got: &[f64], want: &[f64], d: DType, what: &str) {
    let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    let g: Vec<f64> = got.iter().map(|v| v / scale).collect();
    let w: Vec<f64> = want.iter().map(|v| v / scale).collect();
    assert_close(&g, &w, tol(d), what);
}

/// A random tensor of `dims` with values in [-1, 1).
pub fn rnd(d: DType, dims: &[usize], seed: u64) -> HostTensor {
    rand_tensor(
        &TensorType::new(d, Shape::new(dims.to_vec())),
        seed,
        -1.0,
        1.0,
    )
}
