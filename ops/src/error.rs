//! The ops crate's error type.

use crate::TensorType;

/// Errors of shape/dtype inference, CPU kernels, gradients and op parsing.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OpError {
    /// Input shapes do not fit the op.
    #[error("{op}: incompatible shapes {}: {reason}", fmt_types(.inputs))]
    Shape {
        /// The op.
        op: &'static str,
        /// The input types.
        inputs: Vec<TensorType>,
        /// What does not fit.
        reason: String,
    },
    /// Input dtypes do not fit the op.
    #[error("{op}: unsupported dtypes {}: {reason}", fmt_types(.inputs))]
    DType {
        /// The op.
        op: &'static str,
        /// The input types.
        inputs: Vec<TensorType>,
        /// What does not fit.
        reason: String,
    },
    /// Wrong number of inputs.
    #[error("{op}: expected {expected} inputs, got {got}")]
    Arity {
        /// The op.
        op: &'static str,
        /// How many were expected.
        expected: String,
        /// How many were given.
        got: usize,
    },
    /// An attribute is invalid (bad axis, zero stride ...).
    #[error("{op}: invalid attribute: {reason}")]
    Attribute {
        /// The op.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A kernel failed on its data (index out of range ...).
    #[error("{op}: {reason}")]
    Runtime {
        /// The op.
        op: &'static str,
        /// What happened.
        reason: String,
    },
    /// A gradient was asked for an input that has none.
    #[error("{op}: not differentiable with respect to input {input}: {reason}")]
    NotDifferentiable {
        /// The op.
        op: &'static str,
        /// The input position.
        input: usize,
        /// Why.
        reason: String,
    },
    /// Op text could not be parsed.
    #[error("cannot parse op `{text}`: {reason}")]
    Parse {
        /// The text.
        text: String,
        /// Why.
        reason: String,
    },
}

/// The ops crate's result.
pub type Result<T, E = OpError> = std::result::Result<T, E>;

/// Formats input types as `(f32[2,3], f32[3])`.
pub fn fmt_types(tys: &[TensorType]) -> String {
    let parts: Vec<String> = tys.iter().map(|t| t.to_string()).collect();
    format!("({})", parts.join(", "))
}
