//! The importer's error type.

use rustytorch_compiler::CompileError;
use rustytorch_ops::OpError;

/// Why an ONNX model could not be imported.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The system's error.
        source: std::io::Error,
    },
    /// The bytes are not an ONNX model (the protobuf does not decode).
    #[error("not a valid ONNX model: {0}")]
    Decode(String),
    /// The model decodes but is not well formed or uses something unsupported outside any node
    /// (an opset, an input's type, an initializer).
    #[error("{0}")]
    Model(String),
    /// One node cannot be imported.
    #[error("node `{node}` ({op_type}): {reason}")]
    Node {
        /// The node's name (or its first output's when it has none).
        node: String,
        /// Its op type, with the domain when that is not the default one.
        op_type: String,
        /// Why.
        reason: String,
    },
    /// A graph operation failed (shape or dtype inference).
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// An op's inference or constant folding failed.
    #[error(transparent)]
    Op(#[from] OpError),
}

/// The importer's result.
pub type Result<T, E = ImportError> = std::result::Result<T, E>;

/// A model-level error.
pub(crate) fn model_err<T>(msg: impl Into<String>) -> Result<T> {
    Err(ImportError::Model(msg.into()))
}
