//! What the attention device tests share (tests/device_attention_cudnn.rs,
//! device_flash_hopper.rs): the test device switch, a one-op graph run on CUDA, and the
//! comparison against a float64 reference of the same inputs.
#![allow(dead_code)]

use rustytorch::ops::testing::assert_close;
use rustytorch::ops::{eval_cpu, Op};
use rustytorch::prelude::*;

/// Whether the tests run on CUDA (`RUSTYTORCH_TEST_CUDA=1`, the GPU machine).
pub fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

/// The tolerances of `tests/device_ops.rs` for f16/bf16 (against a float64 reference of the same
/// inputs; `P` is rounded to the operands' type before `P·V`, as in every flash kernel).
pub fn tol(d: DType) -> f64 {
    match d {
        DType::F16 => 4e-3,
        _ => 2e-2,
    }
}

/// Runs `op` over `inputs` as a one-op graph on CUDA; the error of compiling or running it.
/// (Its includer also includes `common/one_op.rs` as `one_op`.)
pub fn run(op: &Op, inputs: &[HostTensor]) -> Result<HostTensor, String> {
    crate::one_op::run_one_op(op, inputs, Device::Cuda(0))
}

/// The device result against the float64 reference of the same inputs (bool masks as they
/// are); with `scaled`, errors relative to the reference's largest magnitude (at least 1), as
/// for gradients, which sum many products.
pub fn check_with(what: &str, op: &Op, inputs: &[HostTensor], scaled: bool) {
    let wide: Vec<HostTensor> = inputs
        .iter()
        .map(|x| {
            if x.dtype() == DType::Bool {
                x.clone()
            } else {
                x.cast(DType::F64)
            }
        })
        .collect();
    let refs: Vec<&HostTensor> = wide.iter().collect();
    let want = eval_cpu(op, &refs).unwrap_or_else(|e| panic!("{what}: f64 reference: {e}"));
    let got = run(op, inputs).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(got.dtype(), inputs[0].dtype(), "{what}: dtype");
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let (mut got, mut want) = (got.to_f64_vec(), want.to_f64_vec());
    if scaled {
        let s = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        for v in got.iter_mut().chain(want.iter_mut()) {
            *v /= s;
        }
    }
    assert_close(
        &got,
        &want,
        tol(inputs[0].dtype()),
        &format!("{what} {op:?}"),
    );
}
