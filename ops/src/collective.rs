//! `all_reduce`: the sum (or mean) of a tensor over the replicas of a data-parallel run.
//!
//! To the compiler the op is an identity with a side channel: its value on one replica is the
//! reduction of the same value on every replica. A run without replicas (a plain executable) is
//! a group of one, where sum and mean are the input itself, which is what [`cpu`] computes; a
//! session that belongs to a group performs the exchange itself (`rustytorch_runtime`'s
//! communicators) instead of calling this kernel.

use crate::grad::{Value, VjpCtx};
use crate::{HostTensor, Op, OpError, Result, TensorType};

/// The output type: the input's (floating-point tensors only: integer sums over replicas would
/// overflow silently, and a mean of integers is not an integer).
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    let [x] = inputs else {
        return Err(OpError::Arity {
            op: op.name(),
            expected: "1".into(),
            got: inputs.len(),
        });
    };
    if !x.dtype.is_float() {
        return Err(OpError::DType {
            op: op.name(),
            inputs: vec![(*x).clone()],
            reason: "all_reduce takes floating-point tensors".into(),
        });
    }
    Ok((*x).clone())
}

/// The reduction over a group of one replica: the input.
pub fn cpu(_op: &Op, inputs: &[&HostTensor], _out: &TensorType) -> Result<HostTensor> {
    Ok(inputs[0].clone())
}

/// Every replica's output depends on every replica's input through the same sum, so the
/// gradient of each input is the same reduction of the output gradients.
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    let g = cx.grad;
    Ok(vec![Some(cx.emit(cx.op.clone(), &[g])?)])
}
