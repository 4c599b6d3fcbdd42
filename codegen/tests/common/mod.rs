//! What the CUDA kernel tests share: lowering an op, printing its kernels' source, running them
//! in the IR interpreter and comparing with the CPU kernel.

use rustytorch_codegen::cuda::{self, interp, CudaStep};
use rustytorch_ops::testing::{assert_close, tolerance};
use rustytorch_ops::{eval_cpu, infer, DType, HostTensor, Op, TensorType};

/// A tensor type.
pub fn ty(dt: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dt, dims.to_vec())
}

/// Lowers `op` for CUDA (it must become generated kernels), prints every kernel, runs them in
/// the interpreter on `inputs` and compares with the CPU kernel at the dtype's tolerance.
pub fn check(op: &Op, inputs: &[&HostTensor], what: &str) {
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let out = infer(op, &refs).unwrap_or_else(|e| panic!("{what}: {e}"));
    let step = match cuda::lower_step(op, &refs, &out) {
        Ok(CudaStep::Kernels(k)) => k,
        other => panic!("{what}: {other:?}"),
    };
    for l in &step.launches {
        cuda::source(&l.kernel).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    let got = interp::run_step(&step, inputs, &out, None).unwrap_or_else(|e| panic!("{what}: {e}"));
    let want = eval_cpu(op, inputs).unwrap_or_else(|e| panic!("{what}: CPU: {e}"));
    assert_close(
        &got.to_f64_vec(),
        &want.to_f64_vec(),
        tolerance(out.dtype),
        what,
    );
}
