//! Devices and their discovery. The CUDA driver is loaded dynamically (cudarc `dynamic-loading`),
//! so the build never needs CUDA and a machine without it gets a clear error, never a crash.

use crate::{Result, RuntimeError};

/// Where a graph runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// The host CPU (multi-threaded).
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
}

impl Device {
    /// The best device available. The CUDA execution backend is not part of this build yet, so
    /// this is the CPU; [`cuda_device_count`] reports what the driver sees.
    pub fn best() -> Device {
        Device::Cpu
    }

    /// Parses `cpu`, `cuda` or `cuda:N`.
    pub fn parse(s: &str) -> Option<Device> {
        match s {
            "cpu" => Some(Device::Cpu),
            "cuda" | "gpu" => Some(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
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
