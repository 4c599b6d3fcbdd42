//! RustyTorch's runtime: the [`Backend`] trait, the [`CpuBackend`] that executes lowered plans with
//! the ops crate's multi-threaded CPU kernels, and device discovery.

pub mod cpu;
pub mod device;

pub use cpu::CpuBackend;
pub use device::{cuda_device_count, Device};

use rustytorch_codegen::Plan;
use rustytorch_ops::{HostTensor, OpError};
use std::sync::Arc;

/// Errors of execution.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A kernel failed; names the step and op.
    #[error("step {step} ({op}): {source}")]
    Kernel {
        /// Step index.
        step: usize,
        /// Op name.
        op: &'static str,
        /// The kernel's error.
        source: OpError,
    },
    /// A device or driver problem (library missing, no device ...).
    #[error("device: {0}")]
    Device(String),
    /// The plan and the values given do not fit.
    #[error("{0}")]
    Invalid(String),
}

/// The runtime crate's result.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// What one execution of a plan produced.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// Output values, in the plan's output order.
    pub outputs: Vec<Arc<HostTensor>>,
    /// New values of parameters: (param index, value).
    pub updates: Vec<(usize, Arc<HostTensor>)>,
    /// Guard results: (name, passed).
    pub guards: Vec<(String, bool)>,
}

/// Something that executes lowered plans.
pub trait Backend: Send + Sync {
    /// A name for messages (`cpu`, `cuda:0`).
    fn name(&self) -> String;
    /// Executes `plan` with input and parameter values (indexed like the plan's tables).
    fn run(
        &self,
        plan: &Plan,
        inputs: &[Arc<HostTensor>],
        params: &[Arc<HostTensor>],
    ) -> Result<RunResult>;
}
