//! Small helpers shared by the op families' inference and kernels.

use crate::{Op, OpError, Result, TensorType};

/// Checks the input count.
pub fn arity(op: &Op, inputs: &[&TensorType], n: usize) -> Result<()> {
    if inputs.len() != n {
        return Err(OpError::Arity {
            op: op.name(),
            expected: n.to_string(),
            got: inputs.len(),
        });
    }
    Ok(())
}

/// Owned copies of input types, for error values.
pub fn owned(inputs: &[&TensorType]) -> Vec<TensorType> {
    inputs.iter().map(|t| (*t).clone()).collect()
}

/// A shape error naming the op and the input types.
pub fn shape_err(op: &Op, inputs: &[&TensorType], reason: impl Into<String>) -> OpError {
    OpError::Shape {
        op: op.name(),
        inputs: owned(inputs),
        reason: reason.into(),
    }
}

/// A dtype error naming the op and the input types.
pub fn dtype_err(op: &Op, inputs: &[&TensorType], reason: impl Into<String>) -> OpError {
    OpError::DType {
        op: op.name(),
        inputs: owned(inputs),
        reason: reason.into(),
    }
}

/// An attribute error naming the op.
pub fn attr_err(op: &Op, reason: impl Into<String>) -> OpError {
    OpError::Attribute {
        op: op.name(),
        reason: reason.into(),
    }
}

/// Minimum number of elements before a kernel splits work across threads.
pub const PAR_THRESHOLD: usize = 1 << 15;
