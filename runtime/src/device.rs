//! Devices, their discovery and automatic placement. The CUDA driver is loaded dynamically
//! (cudarc `dynamic-loading`), so the build never needs CUDA and a machine without it gets a clear
//! error, never a crash.

use crate::{Backend, CpuBackend, CudaBackend, Result, RuntimeError};
use rustytorch_ops::TensorType;
use std::sync::Arc;

/// Where a graph runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// The host CPU (multi-threaded).
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
    /// Chosen at compile time from an estimate of the graph's cost (see [`place`]): the CPU when
    /// the graph is too small for a GPU to win, else `cuda:0` when a usable GPU exists.
    Auto,
}

impl Device {
    /// The best device available: `cuda:0` when the driver reports a device and the CUDA backend
    /// opens it, else the CPU.
    pub fn best() -> Device {
        if cuda_device_count().is_ok_and(|n| n >= 1) && CudaBackend::new(0).is_ok() {
            Device::Cuda(0)
        } else {
            Device::Cpu
        }
    }

    /// Parses `cpu`, `cuda`, `cuda:N` or `auto`.
    pub fn parse(s: &str) -> Option<Device> {
        match s {
            "cpu" => Some(Device::Cpu),
            "cuda" | "gpu" => Some(Device::Cuda(0)),
            "auto" => Some(Device::Auto),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda),
        }
    }

    /// The backend that executes on this device: the CPU backend, or the CUDA backend opened on
    /// the device (an error naming the problem when the driver or the device is missing).
    /// [`Device::Auto`] must be resolved to a device first.
    pub fn backend(self) -> Result<Box<dyn Backend>> {
        match self {
            Device::Cpu => Ok(Box::new(CpuBackend)),
            Device::Cuda(i) => Ok(Box::new(CudaBackend::new(i).map_err(|e| match e {
                RuntimeError::Device(m) if !m.starts_with(&format!("cuda:{i}")) => {
                    RuntimeError::Device(format!("cuda:{i} is not usable: {m}"))
                }
                other => other,
            })?)),
            Device::Auto => Err(RuntimeError::Invalid(
                "`auto` is chosen when a graph is compiled; it has no backend of its own".into(),
            )),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Auto => f.write_str("auto"),
        }
    }
}

/// A tensor in device memory given to a run without a copy ([`crate::Session::run_device`]):
/// compact row-major elements of `ty` at `ptr` on CUDA device `ordinal`, written by work on the
/// producer's stream `stream`.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceInput {
    /// Device address of the first element.
    pub ptr: u64,
    /// The elements' type and shape.
    pub ty: TensorType,
    /// The device the memory is on.
    pub ordinal: usize,
    /// The producer's stream (`CUstream` as an integer; 1 the legacy default stream, 2 the
    /// per-thread default stream): the run waits for an event recorded on it, never for the
    /// whole device. None: already ordered before the session's stream.
    pub stream: Option<u64>,
}

/// Memory that stays reserved until dropped (a pool block returned to its pool on drop, on any
/// thread).
pub trait DeviceMemory: Send + Sync {
    /// Device address of the first byte.
    fn addr(&self) -> u64;
    /// Orders the memory's reuse after the work queued so far on `stream` (a consumer's stream,
    /// as a `CUstream` integer), before it is given back.
    fn used_on(&self, stream: u64);
}

/// A result left in device memory: a block of its own that the next run does not overwrite.
pub struct DeviceOutput {
    /// The elements' type and shape.
    pub ty: TensorType,
    /// The device.
    pub ordinal: usize,
    /// The stream that wrote it (`CUstream` as an integer): a consumer waits on it.
    pub stream: u64,
    /// The memory; dropping the last reference gives it back.
    pub memory: Arc<dyn DeviceMemory>,
}

impl std::fmt::Debug for DeviceOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceOutput({} at {:#x} on cuda:{})",
            self.ty,
            self.memory.addr(),
            self.ordinal
        )
    }
}

/// What a run on device inputs returns.
#[derive(Debug)]
pub struct DeviceRunOutput {
    /// Outputs in plan order, in device memory.
    pub outputs: Vec<DeviceOutput>,
    /// `(name, passed)` per guard, as in [`crate::RunOutput`].
    pub guards: Vec<(String, bool)>,
    /// Whether the updates were committed.
    pub committed: bool,
    /// Inputs and outputs that were copied device-to-device rather than read or written in
    /// place, with the reason.
    pub copies: Vec<(IoSlot, String)>,
}

/// An input or output of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoSlot {
    /// Input `i` of the plan.
    Input(usize),
    /// Output `i` of the plan.
    Output(usize),
}

/// The number of CUDA devices the driver reports; an error when the driver library is absent or
/// fails to initialize.
pub fn cuda_device_count() -> Result<usize> {
    // SAFETY: only probes whether the driver shared library can be loaded; no CUDA call is made
    // when it cannot.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(RuntimeError::Device(
            "the CUDA driver library (libcuda) was not found on this machine".into(),
        ));
    }
    cudarc::driver::result::init()
        .map_err(|e| RuntimeError::Device(format!("CUDA driver init failed: {e}")))?;
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| RuntimeError::Device(format!("cannot count CUDA devices: {e}")))?;
    Ok(n.max(0) as usize)
}

/// Starts (`on`) or stops the CUDA profiler's collection for the calling thread's current
/// context: what `ncu --profile-from-start off` waits for, so that a tool times only the launches
/// in between. An error when no context is current or the driver refuses.
pub fn cuda_profiler(on: bool) -> Result<()> {
    // SAFETY: both calls take no arguments and only flip the driver's collection state; the
    // driver reports a missing context as an error code, which is returned.
    let r = unsafe {
        if on {
            cudarc::driver::sys::cuProfilerStart()
        } else {
            cudarc::driver::sys::cuProfilerStop()
        }
    };
    r.result()
        .map_err(|e| RuntimeError::Device(format!("CUDA profiler start/stop failed: {e}")))
}

/// The devices tests run on: the CPU, and `cuda:0` too when the environment variable
/// `RUSTYTORCH_TEST_CUDA` is `1`. A test that gets `cuda:0` must use it and fail when it is not
/// usable, never skip it.
pub fn test_devices() -> Vec<Device> {
    if std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1") {
        vec![Device::Cpu, Device::Cuda(0)]
    } else {
        vec![Device::Cpu]
    }
}

/// The figures of the placement cost model.
///
/// Measured 2026-11-30 (`docs/performance.md`, "Device placement"): the GPU figures on an H200
/// with `cargo run --release --example device_overheads -- cuda` and `--example gpu_mlp_stack`,
/// the CPU figures on a 2-core machine (CPU GEMM bench, `device_overheads -- cpu`). A machine with
/// more cores moves the threshold toward the GPU; the decision and its estimate are printed by
/// `rustytorch inspect`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Seconds of a GPU run's fixed cost (launch, synchronize, read back a few bytes).
    pub run_s: f64,
    /// Seconds to launch one GPU kernel.
    pub launch_s: f64,
    /// Host↔device bandwidth (bytes/s) for the inputs and outputs of a run.
    pub link_bytes_per_s: f64,
    /// CPU arithmetic throughput (FLOP/s).
    pub cpu_flops_per_s: f64,
    /// CPU memory bandwidth (bytes/s).
    pub cpu_bytes_per_s: f64,
    /// GPU arithmetic throughput (FLOP/s).
    pub gpu_flops_per_s: f64,
    /// GPU memory bandwidth (bytes/s).
    pub gpu_bytes_per_s: f64,
}

/// The cost model [`Device::Auto`] decides with (estimates; see [`CostModel`]).
pub const COST_MODEL: CostModel = CostModel {
    // 14 µs for a one-kernel run; (0.914 − 0.018) ms / 255 kernels ≈ 3.5 µs per extra kernel.
    run_s: 14e-6,
    launch_s: 3.5e-6,
    // Inputs in and outputs out through `Executable::run` (host copies included): 1.0–1.5 GB/s.
    link_bytes_per_s: 1.3e9,
    // The CPU GEMM bench: 55–64 GFLOP/s; elementwise through `run`: about 1 GB/s.
    cpu_flops_per_s: 55e9,
    cpu_bytes_per_s: 1e9,
    // f32 GEMMs (exact f32) sustain about 42 TFLOP/s; bf16 347 TFLOP/s; copies 4.2 TB/s.
    gpu_flops_per_s: 40e12,
    gpu_bytes_per_s: 3e12,
};

/// What one run of a plan does, as the cost model sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Workload {
    /// Floating-point operations (an estimate).
    pub flops: u64,
    /// Bytes the kernels read and write.
    pub bytes: u64,
    /// Bytes of the inputs and outputs (they cross the host↔device link on a GPU).
    pub io_bytes: u64,
    /// Kernels launched.
    pub kernels: u64,
}

impl CostModel {
    /// Estimated seconds of one run on the CPU: the slower of arithmetic and memory traffic.
    pub fn cpu_seconds(&self, w: &Workload) -> f64 {
        (w.flops as f64 / self.cpu_flops_per_s).max(w.bytes as f64 / self.cpu_bytes_per_s)
    }

    /// Estimated seconds of one run on a GPU: kernel launches, the inputs and outputs over the
    /// link, and the slower of arithmetic and memory traffic (parameters stay on the device).
    pub fn gpu_seconds(&self, w: &Workload) -> f64 {
        self.run_s
            + w.kernels as f64 * self.launch_s
            + w.io_bytes as f64 / self.link_bytes_per_s
            + (w.flops as f64 / self.gpu_flops_per_s).max(w.bytes as f64 / self.gpu_bytes_per_s)
    }
}

/// Where a graph was placed and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    /// The device asked for.
    pub requested: Device,
    /// The device the graph runs on.
    pub device: Device,
    /// Why (the estimate for [`Device::Auto`]).
    pub reason: String,
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.device, self.reason)
    }
}

/// Formats seconds as `12.3 µs`, `4.56 ms` or `1.23 s`.
fn secs(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.1} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// The device [`Device::Auto`] prefers for `w` under `model`, with the estimate as the reason:
/// `cuda:0` when its estimated time is below the CPU's, else the CPU. Whether a GPU is usable is
/// the caller's to check (this function probes nothing).
pub fn place(w: &Workload, model: &CostModel) -> Placement {
    let cpu = model.cpu_seconds(w);
    let gpu = model.gpu_seconds(w);
    let device = if gpu < cpu {
        Device::Cuda(0)
    } else {
        Device::Cpu
    };
    let reason = format!(
        "auto: estimated {} on the cpu vs {} on cuda:0; {} FLOPs, {} bytes moved, {} kernels, {} bytes in/out",
        secs(cpu),
        secs(gpu),
        w.flops,
        w.bytes,
        w.kernels,
        w.io_bytes
    );
    Placement {
        requested: Device::Auto,
        device,
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_work_stays_on_the_cpu_large_work_goes_to_the_gpu() {
        let tiny = Workload {
            flops: 1_000,
            bytes: 4_000,
            io_bytes: 1_000,
            kernels: 4,
        };
        let p = place(&tiny, &COST_MODEL);
        assert_eq!(p.device, Device::Cpu, "{p}");
        assert!(p.reason.starts_with("auto: estimated"), "{p}");
        // A 4096³ matmul: 137 GFLOP, about 2.7 s on the CPU and a few ms on a GPU.
        let big = Workload {
            flops: 2 * 4096 * 4096 * 4096,
            bytes: 3 * 4096 * 4096 * 4,
            io_bytes: 3 * 4096 * 4096 * 4,
            kernels: 1,
        };
        assert_eq!(place(&big, &COST_MODEL).device, Device::Cuda(0));
    }
}
