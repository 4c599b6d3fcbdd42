//! RustyTorch's runtime: the [`Backend`] and [`Session`] traits, the [`CpuBackend`] that executes
//! lowered plans with the ops crate's multi-threaded CPU kernels, the CUDA backend, the caching
//! memory pool and device discovery.
//!
//! A backend *prepares* a plan once with the initial parameter and state values and returns a
//! [`Session`] that owns them on its device. Each [`Session::run`] takes inputs, returns outputs
//! and commits the step's updates inside the session when every guard passed; parameters cross to
//! the host only when asked for ([`Session::read_param`], [`Session::write_param`]).

pub mod collective;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod pool;
pub mod timing;

pub use collective::{Communicator, HostGroup, HostRank};
pub use cpu::CpuBackend;
pub use cuda::CudaBackend;
pub use device::{cuda_device_count, cuda_profiler, Device};
pub use pool::MemoryStats;
pub use timing::{StepClock, StepTime, StepTimes};

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
    /// Device memory is exhausted (after the pool released its cache and retried).
    #[error("out of memory on {device}: {detail}")]
    OutOfMemory {
        /// The device.
        device: String,
        /// The request and the pool's state.
        detail: String,
    },
    /// The plan cannot run on this device (an op without an implementation there ...).
    #[error(transparent)]
    Codegen(#[from] rustytorch_codegen::CodegenError),
    /// The plan and the values given do not fit.
    #[error("{0}")]
    Invalid(String),
    /// Anomaly mode: a step produced a NaN or infinite value.
    #[error("{0}")]
    NonFinite(Box<cpu::NonFiniteValue>),
}

/// The runtime crate's result.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// What one run of a session produced.
#[derive(Debug, Clone)]
pub struct RunOutput {
    /// Output values, in the plan's output order, on the host.
    pub outputs: Vec<HostTensor>,
    /// Guard results: (name, passed).
    pub guards: Vec<(String, bool)>,
    /// Whether the step's updates were committed (every guard passed).
    pub committed: bool,
}

/// Counts of copies between host and device memory (zero on the CPU backend).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Host-to-device copies.
    pub htod_copies: u64,
    /// Bytes copied host-to-device.
    pub htod_bytes: u64,
    /// Device-to-host copies.
    pub dtoh_copies: u64,
    /// Bytes copied device-to-host.
    pub dtoh_bytes: u64,
}

/// Something that executes lowered plans.
pub trait Backend: Send + Sync {
    /// A name for messages (`cpu`, `cuda:0`).
    fn name(&self) -> String;
    /// Prepares `plan` with the initial values of its parameters and state (indexed like the
    /// plan's `Source::Param`): compiles what must be compiled, moves the values to the device.
    fn prepare(&self, plan: Arc<Plan>, params: Vec<Arc<HostTensor>>) -> Result<Box<dyn Session>>;
}

/// A prepared plan with its parameters and state resident on a device.
pub trait Session: Send {
    /// The device it runs on.
    fn device(&self) -> Device;
    /// Runs the plan with its inputs (by input index). Commits the updates inside the session
    /// when every guard passed; never otherwise.
    fn run(&mut self, inputs: &[Arc<HostTensor>]) -> Result<RunOutput>;
    /// Runs the plan on inputs in device memory, read in place where the session can, and
    /// returns the outputs in device memory blocks of their own (reserved until dropped);
    /// commits the updates as [`Session::run`] does. Sessions without device memory refuse.
    fn run_device(&mut self, inputs: &[device::DeviceInput]) -> Result<device::DeviceRunOutput> {
        let _ = inputs;
        Err(RuntimeError::Invalid(format!(
            "device inputs need a CUDA session; this one runs on {}",
            self.device()
        )))
    }
    /// A copy of parameter/state tensor `i` on the host.
    fn read_param(&self, i: usize) -> Result<HostTensor>;
    /// Replaces parameter/state tensor `i` (its type must match).
    fn write_param(&mut self, i: usize, value: &HostTensor) -> Result<()>;
    /// Statistics of the device memory pool (None on the host).
    fn memory_stats(&self) -> Option<MemoryStats>;
    /// Host↔device copies so far.
    fn transfers(&self) -> TransferStats;
    /// Runs that replayed a captured CUDA graph instead of launching step by step (0 on the
    /// host).
    fn graph_replays(&self) -> u64 {
        0
    }
    /// Whether runs after the first replay a captured CUDA graph of the whole plan (on by
    /// default where the device supports it; `RUSTYTORCH_CUDA_GRAPH=0` turns the default off).
    /// No effect on the host.
    fn set_graph_replay(&mut self, on: bool) {
        let _ = on;
    }
    /// Device time of the plan's steps, in milliseconds per execution, averaged over `iters`
    /// back-to-back executions on the inputs of the last run: no copies, no commit (a
    /// benchmark hook; call `run` once first).
    fn time_steps(&mut self, iters: usize) -> Result<f64> {
        let _ = iters;
        Err(RuntimeError::Invalid(
            "step timing needs a device session".into(),
        ))
    }
    /// Turns the timing of every step of the following runs on or off (off by default: the
    /// step loop then reads no clock). Returns whether this session can time its steps; one
    /// that cannot ignores the call.
    fn set_step_timing(&mut self, on: bool) -> bool {
        let _ = on;
        false
    }
    /// The step times of the last run made with step timing on, once (a second call returns
    /// None until the next timed run).
    fn take_step_times(&mut self) -> Option<StepTimes> {
        None
    }
    /// Joins a data-parallel group: from now on the plan's `all_reduce` steps exchange their
    /// tensors with the group's other ranks. Sessions that cannot take part refuse.
    fn join(&mut self, group: Arc<dyn Communicator>) -> Result<()> {
        Err(RuntimeError::Invalid(format!(
            "a {} session cannot join a data-parallel group (rank {} of {})",
            self.device(),
            group.rank(),
            group.world()
        )))
    }
}

/// Checks that `value` has the type of the plan's parameter `i` (shared by the backends).
pub fn check_param_type(plan: &Plan, i: usize, value: &HostTensor) -> Result<()> {
    let want = plan
        .param_types
        .get(i)
        .ok_or_else(|| RuntimeError::Invalid(format!("no parameter #{i}")))?;
    if &value.ty() != want {
        return Err(RuntimeError::Invalid(format!(
            "parameter #{i}: expected {want}, got {}",
            value.ty()
        )));
    }
    Ok(())
}
