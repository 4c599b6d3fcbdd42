//! DLPack on CUDA: the array API's stream hand-over (an event recorded on the producer's stream
//! that the consumer's stream waits for, never a device-wide synchronize), copies of CUDA tensors
//! to the host, and exports of host tensors into device memory.
//!
//! The array API's `__dlpack__(stream=...)` names the *consumer's* stream: `None` or 1 is the
//! legacy default stream, 2 the per-thread default stream, a larger value a stream handle, -1
//! "do not synchronize", and 0 is disallowed. The producer makes that stream wait for the work
//! that wrote the tensor ([`hand_over`]). This module keeps one stream per device for its own
//! copies; it names that stream when it imports ([`stream_handle`]).
//!
//! Device I/O: [`Executable::run_dlpack_cuda`] runs a CUDA executable on CUDA tensors read in
//! place (the session waits for [`stream_handle`]'s stream, which the producer handed over to)
//! and returns its outputs as exports of pool blocks of their own, reserved until the
//! consumer's deleter runs on whatever thread; [`DeviceExport::used_on`] orders a block's reuse
//! after a consumer's stream.

use super::{dl_err, DLDevice, DLDeviceType, DlpackTensor};
pub use crate::executable::DeviceOutputs;
use crate::{Executable, Result};
use cudarc::driver::{result as dr, sys as ds, CudaContext, CudaSlice, CudaStream};
use rustytorch_ops::{HostTensor, TensorType};
pub use rustytorch_runtime::device::{DeviceInput, DeviceMemory, DeviceOutput, IoSlot};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The stream a consumer names in `__dlpack__(stream=...)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConsumerStream {
    /// `None` or 1: the legacy default stream.
    Legacy,
    /// 2: the per-thread default stream.
    PerThread,
    /// A stream handle (`cudaStream_t`).
    Handle(u64),
    /// -1: the consumer orders the work itself; nothing to do.
    NoSync,
}

impl ConsumerStream {
    /// Reads the `stream` argument of `__dlpack__` for a CUDA tensor.
    pub fn from_arg(stream: Option<i64>) -> Result<ConsumerStream> {
        match stream {
            None | Some(1) => Ok(ConsumerStream::Legacy),
            Some(2) => Ok(ConsumerStream::PerThread),
            Some(-1) => Ok(ConsumerStream::NoSync),
            Some(0) => Err(dl_err(
                "stream 0 is ambiguous on CUDA: pass 1 (legacy default), 2 (per-thread default) \
                 or a stream handle",
            )),
            Some(s) if s > 2 => Ok(ConsumerStream::Handle(s as u64)),
            Some(s) => Err(dl_err(format!("stream {s} is not a CUDA stream"))),
        }
    }

    /// The driver's stream handle (None for [`ConsumerStream::NoSync`]).
    pub fn raw(self) -> Option<ds::CUstream> {
        match self {
            ConsumerStream::Legacy => Some(1usize as ds::CUstream),
            ConsumerStream::PerThread => Some(2usize as ds::CUstream),
            ConsumerStream::Handle(h) => Some(h as usize as ds::CUstream),
            ConsumerStream::NoSync => None,
        }
    }
}

/// A device's context and the stream DLPack copies use.
struct DlStream {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

fn cuda_err(what: &'static str) -> impl Fn(dr::DriverError) -> crate::Error {
    move |e| dl_err(format!("{what}: {e}"))
}

/// The DLPack stream of device `ordinal` (opened on first use), bound to this thread.
fn device_stream(ordinal: usize) -> Result<Arc<DlStream>> {
    static STREAMS: OnceLock<Mutex<HashMap<usize, Arc<DlStream>>>> = OnceLock::new();
    let s = {
        let mut map = STREAMS
            .get_or_init(|| Mutex::new(HashMap::new()))
            .lock()
            .expect("stream table lock");
        match map.get(&ordinal) {
            Some(s) => s.clone(),
            None => {
                let n = rustytorch_runtime::cuda_device_count()?;
                if ordinal >= n {
                    return Err(dl_err(format!(
                        "cuda:{ordinal} requested but the driver reports {n} CUDA device(s)"
                    )));
                }
                let ctx = CudaContext::new(ordinal).map_err(cuda_err("opening the context"))?;
                let stream = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
                let s = Arc::new(DlStream { ctx, stream });
                map.insert(ordinal, s.clone());
                s
            }
        }
    };
    s.ctx
        .bind_to_thread()
        .map_err(cuda_err("binding the context"))?;
    Ok(s)
}

/// The handle of the stream this module copies on for device `ordinal`: the value to pass as
/// `stream` to a producer's `__dlpack__` before [`to_host`].
pub fn stream_handle(ordinal: usize) -> Result<u64> {
    Ok(device_stream(ordinal)?.stream.cu_stream() as usize as u64)
}

/// Makes `consumer` wait for the work queued on `producer` so far: an event recorded on
/// `producer` and waited for on `consumer` (nothing when they are the same stream or the consumer
/// asked for no synchronization).
///
/// # Safety
///
/// `producer` and a [`ConsumerStream::Handle`] must be live streams of the context bound to this
/// thread (a consumer's `__dlpack__(stream=...)` vouches for its handle).
pub unsafe fn hand_over(producer: u64, consumer: ConsumerStream) -> Result<()> {
    let producer = producer as usize as ds::CUstream;
    let Some(c) = consumer.raw() else {
        return Ok(());
    };
    if c == producer {
        return Ok(());
    }
    let ev = dr::event::create(ds::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        .map_err(cuda_err("creating an event"))?;
    // SAFETY: the event was just created and the streams are live in the bound context (the
    // caller's contract); destroying an event with a pending wait is allowed, the
    // driver releases it when the wait is done.
    let r = unsafe {
        dr::event::record(ev, producer).and_then(|_| {
            dr::stream::wait_event(c, ev, ds::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        })
    };
    // SAFETY: as above; the event is destroyed once.
    let _ = unsafe { dr::event::destroy(ev) };
    r.map_err(cuda_err("handing the stream over"))
}

/// Copies a CUDA tensor to a new compact host tensor on this module's stream, reading any
/// strides: the span of memory the view covers is copied, then gathered on the host. The
/// producer must have handed over to [`stream_handle`]'s stream (for Python objects: it was
/// asked with that `stream`).
pub fn to_host(t: &DlpackTensor) -> Result<HostTensor> {
    let dev = t.device();
    if dev.device_type != DLDeviceType::CUDA {
        return t.to_host();
    }
    let ty = t.ty()?;
    let n = ty.shape.numel();
    if n == 0 {
        return Ok(HostTensor::zeros(&ty));
    }
    let strides = match t.strides() {
        Some(s) => s.to_vec(),
        None => super::contiguous_strides(ty.shape.dims()),
    };
    let (lo, hi) = span(ty.shape.dims(), &strides);
    let size = ty.dtype.size_bytes() as i64;
    let bytes = ((hi - lo + 1) * size) as usize;
    let s = device_stream(usize::try_from(dev.device_id).unwrap_or(usize::MAX))?;
    let mut buf = vec![0u8; bytes];
    let src = t.data_ptr().wrapping_add_signed(lo * size);
    // SAFETY: the producer guarantees the view's elements are live device memory; the span
    // [lo, hi] is exactly the elements the view addresses. The copy is ordered on our stream,
    // which the producer made wait for its writes, and completes before the synchronize.
    unsafe { dr::memcpy_dtoh_async(&mut buf, src, s.stream.cu_stream()) }
        .map_err(cuda_err("copying to the host"))?;
    s.stream.synchronize().map_err(cuda_err("synchronizing"))?;
    // SAFETY: `buf` holds the span; element offsets relative to its start are `-lo` plus the
    // in-range index times the strides, all within `[0, hi - lo]`.
    unsafe { super::gather(buf.as_ptr().offset((-lo * size) as isize), &ty, &strides) }
}

/// The lowest and highest element offsets a view of `dims` with `strides` addresses (`dims` has
/// no zero extent).
fn span(dims: &[usize], strides: &[i64]) -> (i64, i64) {
    dims.iter().zip(strides).fold((0, 0), |(lo, hi), (&d, &s)| {
        let far = (d as i64 - 1) * s;
        (lo + far.min(0), hi + far.max(0))
    })
}

/// Device memory an export owns: freed (stream-ordered, from any thread) when it drops.
struct DeviceKeep {
    _slice: CudaSlice<u8>,
    _stream: Arc<DlStream>,
}

/// A host tensor copied into new memory on CUDA device `ordinal` and exported as `kDLCUDA`
/// (flagged as a copy). The memory is freed when the consumer's deleter runs. The copy is queued
/// on this module's stream; a consumer orders itself after it with [`hand_over`] from
/// [`DeviceExport::stream`].
pub fn export_to_device(t: &HostTensor, ordinal: usize, legacy: bool) -> Result<DeviceExport> {
    let s = device_stream(ordinal)?;
    let bytes = super::host_bytes(t);
    let slice = if bytes.is_empty() {
        s.stream.alloc_zeros::<u8>(1)
    } else {
        s.stream.clone_htod(bytes)
    }
    .map_err(cuda_err("copying to the device"))?;
    // The host staging buffer must outlive the queued copy: wait for it on our stream only.
    s.stream.synchronize().map_err(cuda_err("synchronizing"))?;
    let ptr = {
        let (p, _sync) = cudarc::driver::DevicePtr::device_ptr(&slice, &s.stream);
        p
    };
    let stream = s.stream.cu_stream() as usize as u64;
    let device = DLDevice::of(rustytorch_runtime::Device::Cuda(ordinal))?;
    let keep = DeviceKeep {
        _slice: slice,
        _stream: s,
    };
    let ty: TensorType = t.ty();
    // SAFETY: `ptr` addresses `ty.size_bytes()` bytes (one at least) owned by `keep`'s slice,
    // which frees them only when dropped.
    let tensor = unsafe {
        DlpackTensor::from_device(
            ptr,
            &ty,
            device,
            Box::new(keep),
            super::DLPACK_FLAG_BITMASK_IS_COPIED,
            legacy,
        )
    };
    Ok(DeviceExport {
        tensor,
        stream,
        memory: None,
    })
}

/// A tensor exported into device memory and the stream its data was written on.
pub struct DeviceExport {
    /// The export.
    pub tensor: DlpackTensor,
    /// The stream (`CUstream` as an integer) that wrote it: hand it over to the consumer's.
    pub stream: u64,
    /// The pool block of a run's output (None for a copy made by [`export_to_device`]).
    pub memory: Option<Arc<dyn DeviceMemory>>,
}

impl std::fmt::Debug for DeviceExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceExport")
            .field("tensor", &self.tensor)
            .field("stream", &self.stream)
            .finish()
    }
}

impl DeviceExport {
    /// A run's output, exported without a copy: the export keeps the pool block reserved until
    /// the consumer's deleter runs (on any thread). `legacy` makes the pre-1.0 struct.
    pub fn of_output(out: &DeviceOutput, legacy: bool) -> Result<DeviceExport> {
        let device = DLDevice::of(rustytorch_runtime::Device::Cuda(out.ordinal))?;
        let memory = out.memory.clone();
        // SAFETY: the block holds `out.ty.size_bytes()` bytes at its address, reserved while
        // `memory` (a clone moves into the export) lives.
        let tensor = unsafe {
            DlpackTensor::from_device(
                memory.addr(),
                &out.ty,
                device,
                Box::new(KeepBlock(memory.clone())),
                0,
                legacy,
            )
        };
        Ok(DeviceExport {
            tensor,
            stream: out.stream,
            memory: Some(memory),
        })
    }

    /// Orders the memory's reuse after the work queued so far on a consumer's stream (called
    /// when a consumer names its stream in `__dlpack__`; nothing for a copy this module owns).
    pub fn used_on(&self, consumer: ConsumerStream) {
        if let (Some(m), Some(s)) = (&self.memory, consumer.raw()) {
            m.used_on(s as usize as u64);
        }
    }
}

/// Keeps a run's output block reserved inside an export.
struct KeepBlock(#[allow(dead_code)] Arc<dyn DeviceMemory>);

/// How a DLPack tensor can be given to a CUDA run in place: a compact CUDA tensor on device
/// `ordinal` (its producer handed over to [`stream_handle`]'s stream), or why not.
pub fn device_input(
    t: &DlpackTensor,
    ordinal: usize,
) -> Result<std::result::Result<DeviceInput, String>> {
    let dev = t.device();
    if dev.device_type != DLDeviceType::CUDA {
        return Ok(Err(format!(
            "DLPack device type {} is not CUDA memory",
            dev.device_type.0
        )));
    }
    if usize::try_from(dev.device_id).ok() != Some(ordinal) {
        return Ok(Err(format!(
            "on cuda:{}, the executable on cuda:{ordinal}",
            dev.device_id
        )));
    }
    let ty = t.ty()?;
    if !t.is_contiguous() {
        return Ok(Err("strided CUDA memory is copied through the host".into()));
    }
    if !t.data_ptr().is_multiple_of(ty.dtype.size_bytes() as u64) {
        return Ok(Err(format!(
            "device address {:#x} is not aligned for {}",
            t.data_ptr(),
            ty.dtype
        )));
    }
    Ok(Ok(DeviceInput {
        ptr: t.data_ptr(),
        ty,
        ordinal,
        stream: Some(stream_handle(ordinal)?),
    }))
}

/// What [`Executable::run_dlpack_cuda`] returns.
#[derive(Debug)]
pub struct CudaRun {
    /// `(name, export)` in output order: pool blocks of their own, handed over.
    pub outputs: Vec<(String, DeviceExport)>,
    /// Inputs and outputs copied device-to-device instead of used in place: `(name, reason)`.
    pub copied: Vec<(String, String)>,
    /// As [`crate::Outputs::skipped`].
    pub skipped: Option<String>,
}

impl Executable {
    /// Runs a CUDA executable on compact CUDA DLPack tensors of its device, read in place by
    /// the kernels (the producers must have handed over to [`stream_handle`]'s stream, as
    /// `__dlpack__(stream=stream_handle(..))` does), and exports the outputs without a copy:
    /// each run's outputs are pool blocks of their own, reserved until the consumer's deleter
    /// runs. An input that cannot be read in place is an error naming it and the reason
    /// ([`Executable::run_dlpack`] copies such inputs through the host instead).
    pub fn run_dlpack_cuda(&mut self, inputs: &[(&str, &DlpackTensor)]) -> Result<CudaRun> {
        let crate::Device::Cuda(ordinal) = self.device() else {
            return Err(dl_err(format!(
                "device inputs need a CUDA executable; this one runs on {}",
                self.device_name()
            )));
        };
        let mut ins = Vec::with_capacity(inputs.len());
        for (name, t) in inputs {
            match device_input(t, ordinal)? {
                Ok(d) => ins.push((*name, d)),
                Err(why) => {
                    return Err(crate::Error::Input {
                        name: name.to_string(),
                        reason: format!("cannot be read in place on cuda:{ordinal}: {why}"),
                    })
                }
            }
        }
        let r = self.run_device(&ins)?;
        let outputs = r
            .outputs
            .iter()
            .map(|(n, o)| Ok((n.clone(), DeviceExport::of_output(o, false)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(CudaRun {
            outputs,
            copied: r.copies.into_iter().map(|(_, n, why)| (n, why)).collect(),
            skipped: r.skipped,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_arguments_follow_the_array_api() {
        assert_eq!(
            ConsumerStream::from_arg(None).unwrap(),
            ConsumerStream::Legacy
        );
        assert_eq!(
            ConsumerStream::from_arg(Some(1)).unwrap(),
            ConsumerStream::Legacy
        );
        assert_eq!(
            ConsumerStream::from_arg(Some(2)).unwrap(),
            ConsumerStream::PerThread
        );
        assert_eq!(
            ConsumerStream::from_arg(Some(-1)).unwrap(),
            ConsumerStream::NoSync
        );
        assert_eq!(
            ConsumerStream::from_arg(Some(0x7f00_1234)).unwrap(),
            ConsumerStream::Handle(0x7f00_1234)
        );
        assert!(ConsumerStream::from_arg(Some(0)).is_err());
        assert!(ConsumerStream::from_arg(Some(-7)).is_err());
        assert_eq!(ConsumerStream::Legacy.raw(), Some(1usize as ds::CUstream));
        assert_eq!(ConsumerStream::NoSync.raw(), None);
        // No synchronization asked: nothing touches the driver (this runs without CUDA).
        // SAFETY: with no synchronization asked, no stream is touched.
        unsafe { hand_over(0, ConsumerStream::NoSync) }.unwrap();
    }

    #[test]
    fn span_covers_negative_and_zero_strides() {
        assert_eq!(span(&[2, 3], &[3, 1]), (0, 5));
        assert_eq!(span(&[2, 3], &[-3, 1]), (-3, 2));
        assert_eq!(span(&[4, 3], &[0, 1]), (0, 2));
        assert_eq!(span(&[], &[]), (0, 0));
    }
}
