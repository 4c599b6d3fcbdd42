//! (family under construction)

use crate::{HostTensor, Op, OpError, Result, TensorType, Value, VjpCtx};

/// Output type.
pub fn infer(op: &Op, _inputs: &[&TensorType]) -> Result<TensorType> {
    Err(OpError::Runtime { op: op.name(), reason: "not implemented".into() })
}

/// CPU kernel.
pub fn cpu(op: &Op, _inputs: &[&HostTensor], _out: &TensorType) -> Result<HostTensor> {
    Err(OpError::Runtime { op: op.name(), reason: "not implemented".into() })
}

/// Gradient rule.
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    Err(OpError::Runtime { op: cx.op.name(), reason: "not implemented".into() })
}
