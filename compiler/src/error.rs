//! The compiler crate's error type.

use rustytorch_ops::OpError;

/// Errors from building, verifying, transforming, printing, parsing, saving and loading graphs.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// An op was applied to inputs that do not fit it, at a place in the user's program.
    #[error("{location}: {source}")]
    Build {
        /// `file:line:column` of the call that built the op.
        location: String,
        /// What was wrong.
        source: OpError,
    },
    /// An op-level error (inference, kernel, gradient rule).
    #[error(transparent)]
    Op(#[from] OpError),
    /// The graph breaks an invariant (dangling id, cycle, type mismatch ...).
    #[error("invalid graph: {0}")]
    Invalid(String),
    /// A gradient cannot be built.
    #[error("autodiff: {0}")]
    Grad(String),
    /// IR text could not be parsed.
    #[error("IR text line {line}: {reason}")]
    Parse {
        /// 1-based line.
        line: usize,
        /// Why.
        reason: String,
    },
    /// A graph file is malformed or unsupported.
    #[error("graph file: {0}")]
    Format(String),
    /// An I/O error, with the path involved.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// Inputs given to a graph with named dims do not fit its declared dims.
    #[error("input `{input}`: {reason}")]
    Bind {
        /// The input.
        input: String,
        /// What does not fit.
        reason: String,
    },
    /// A graph with named dims does not hold at the sizes it was specialized to.
    #[error("at {at}: {source}")]
    Specialize {
        /// The sizes (`batch=5`).
        at: String,
        /// The op that refused its shapes.
        source: OpError,
    },
    /// An optimizer pass failed.
    #[error("optimizer: {0}")]
    Optimize(String),
}

/// The compiler crate's result.
pub type Result<T, E = CompileError> = std::result::Result<T, E>;
