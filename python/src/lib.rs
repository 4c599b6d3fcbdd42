//! RustyTorch for Python: compile a graph (a graph file or IR text) for a device and run it on any
//! array that speaks DLPack (NumPy, PyTorch, JAX, CuPy). Results and parameters are
//! `rustytorch.Tensor`s, which those libraries take with `from_dlpack`; errors are
//! `rustytorch.Error` with the Rust message.
//!
//! Copies, stated once: a result on the host is handed out without a copy (every `from_dlpack`
//! of it shares its memory); an input that is a `rustytorch.Tensor` on the host is read in place,
//! and so is a compact, aligned host array of another library (NumPy, PyTorch on the CPU): the
//! host tensor views its memory and holds the producer's capsule until the last view is gone.
//! Strided or misaligned arrays are copied once, which [`Executable::copied_inputs`] reports with
//! the reason. On CUDA, when every input is a compact CUDA array of the executable's device
//! (PyTorch CUDA tensors, results of another run), the kernels read the inputs where they are
//! (the producer hands its stream over to ours with an event) and the results are pool blocks
//! of their own, handed out without a copy and reserved until the consumer's deleter runs; any
//! other input makes the run go through the host. A consumer's stream waits for a result with an
//! event, never a device-wide synchronize.

use pyo3::exceptions::{PyBufferError, PyException, PyKeyError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use rustytorch::dlpack::{
    cuda, DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned, DlpackTensor,
    RawManaged, DLPACK_FLAG_BITMASK_IS_COPIED, DLPACK_VERSION,
};
use rustytorch::{CompileOptions, Device, HostTensor, TensorType};
use std::ffi::{c_void, CStr};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

pyo3::create_exception!(
    _rustytorch,
    Error,
    PyException,
    "An error of RustyTorch; the message is the Rust error's."
);

fn err(e: impl std::fmt::Display) -> PyErr {
    Error::new_err(e.to_string())
}

const VERSIONED: &CStr = c"dltensor_versioned";
const USED_VERSIONED: &CStr = c"used_dltensor_versioned";
const LEGACY: &CStr = c"dltensor";
const USED_LEGACY: &CStr = c"used_dltensor";

/// Releases a DLPack ≥ 1.0 capsule nobody consumed (a consumer renames it first).
unsafe extern "C" fn drop_versioned_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: Python passes a live capsule; `IsValid` sets no error and only an unconsumed
    // capsule still owns its tensor, which is released once, here.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr())
                .cast::<DLManagedTensorVersioned>();
            if let Some(d) = p.as_ref().and_then(|m| m.deleter) {
                d(p);
            }
        }
    }
}

/// Releases a legacy capsule nobody consumed.
unsafe extern "C" fn drop_legacy_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: as in `drop_versioned_capsule`.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr()).cast::<DLManagedTensor>();
            if let Some(d) = p.as_ref().and_then(|m| m.deleter) {
                d(p);
            }
        }
    }
}

/// A DLPack capsule that owns `t` until a consumer takes it.
fn capsule(py: Python<'_>, t: DlpackTensor) -> PyResult<Bound<'_, PyAny>> {
    let (ptr, name, destructor): (*mut c_void, &CStr, ffi::PyCapsule_Destructor) =
        match t.into_raw() {
            RawManaged::Versioned(p) => (p.as_ptr().cast(), VERSIONED, drop_versioned_capsule),
            RawManaged::Legacy(p) => (p.as_ptr().cast(), LEGACY, drop_legacy_capsule),
        };
    // SAFETY: `ptr` is a live managed tensor whose ownership moves into the capsule; the name is
    // a static string.
    let obj = unsafe { ffi::PyCapsule_New(ptr, name.as_ptr(), Some(destructor)) };
    if obj.is_null() {
        let e = PyErr::fetch(py);
        // SAFETY: no capsule was made, so the tensor is still ours to release, once.
        unsafe {
            if name == VERSIONED {
                if let Ok(t) = DlpackTensor::from_raw_versioned(NonNull::new_unchecked(ptr.cast()))
                {
                    drop(t);
                }
            } else {
                drop(DlpackTensor::from_raw_legacy(NonNull::new_unchecked(
                    ptr.cast(),
                )));
            }
        }
        return Err(e);
    }
    // SAFETY: `PyCapsule_New` returned a new reference.
    Ok(unsafe { Bound::from_owned_ptr(py, obj) })
}

/// Takes the managed tensor out of an object with `__dlpack__` (NumPy, PyTorch, JAX, CuPy ...).
/// A CUDA producer is asked to hand its stream over to the stream our copies use.
fn import(obj: &Bound<'_, PyAny>) -> PyResult<DlpackTensor> {
    let py = obj.py();
    let not_dlpack = || {
        PyTypeError::new_err(format!(
            "expected a rustytorch.Tensor or an array with __dlpack__ (NumPy, PyTorch, JAX, \
             CuPy), got {}",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".into())
        ))
    };
    let dev = obj
        .call_method0(pyo3::intern!(py, "__dlpack_device__"))
        .map_err(|_| not_dlpack())?;
    let (kind, id): (i32, i32) = dev.extract()?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("max_version", (DLPACK_VERSION.major, DLPACK_VERSION.minor))?;
    if kind == DLDeviceType::CUDA.0 {
        let ordinal = usize::try_from(id).map_err(err)?;
        kwargs.set_item("stream", cuda::stream_handle(ordinal).map_err(err)?)?;
    }
    let name = pyo3::intern!(py, "__dlpack__");
    let cap = match obj.call_method(name, (), Some(&kwargs)) {
        Ok(c) => c,
        // A producer older than DLPack 1.0 has no `max_version`: it sends the legacy struct.
        Err(e) if e.is_instance_of::<PyTypeError>(py) => {
            kwargs.del_item("max_version")?;
            obj.call_method(name, (), Some(&kwargs))?
        }
        Err(e) => return Err(e),
    };
    let p = cap.as_ptr();
    // SAFETY: `p` is a live object; the capsule calls check its type and name. Renaming a capsule
    // to `used_…` takes its tensor over (the producer's destructor then leaves it alone), so the
    // tensor is owned exactly once, by the returned `DlpackTensor`.
    unsafe {
        if ffi::PyCapsule_IsValid(p, VERSIONED.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(p, VERSIONED.as_ptr());
            let m = NonNull::new(m.cast::<DLManagedTensorVersioned>())
                .ok_or_else(|| PyErr::fetch(py))?;
            if ffi::PyCapsule_SetName(p, USED_VERSIONED.as_ptr()) != 0 {
                return Err(PyErr::fetch(py));
            }
            DlpackTensor::from_raw_versioned(m).map_err(err)
        } else if ffi::PyCapsule_IsValid(p, LEGACY.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(p, LEGACY.as_ptr());
            let m = NonNull::new(m.cast::<DLManagedTensor>()).ok_or_else(|| PyErr::fetch(py))?;
            if ffi::PyCapsule_SetName(p, USED_LEGACY.as_ptr()) != 0 {
                return Err(PyErr::fetch(py));
            }
            Ok(DlpackTensor::from_raw_legacy(m))
        } else {
            Err(PyTypeError::new_err(
                "__dlpack__ returned no unconsumed DLPack capsule",
            ))
        }
    }
}

/// Where a tensor's elements live.
enum Storage {
    /// Host memory, shared with the executable that made it.
    Host(Arc<HostTensor>),
    /// Device memory owned by an export; each `__dlpack__` shares it.
    Cuda(Arc<cuda::DeviceExport>),
}

/// A tensor made by RustyTorch: a result, a parameter or an import. Pass it to
/// `numpy.from_dlpack`, `torch.from_dlpack`, `jax.dlpack.from_dlpack` or `cupy.from_dlpack`.
#[pyclass(frozen, module = "rustytorch")]
struct Tensor {
    storage: Storage,
    ty: TensorType,
}

impl Tensor {
    fn host(t: Arc<HostTensor>) -> Tensor {
        Tensor {
            ty: t.ty(),
            storage: Storage::Host(t),
        }
    }

    /// A result for `device`: host tensors stay where they are, CUDA results go to device memory.
    fn on(t: HostTensor, device: Device) -> PyResult<Tensor> {
        match device {
            Device::Cuda(i) => Ok(Tensor {
                ty: t.ty(),
                storage: Storage::Cuda(Arc::new(
                    cuda::export_to_device(&t, i, false).map_err(err)?,
                )),
            }),
            Device::Cpu | Device::Auto => Ok(Tensor::host(Arc::new(t))),
        }
    }

    fn dl_device(&self) -> DLDevice {
        match &self.storage {
            Storage::Host(_) => DLDevice::CPU,
            Storage::Cuda(e) => e.tensor.device(),
        }
    }

    /// The elements on the host: shared for a host tensor, copied from a device.
    fn to_host(&self) -> PyResult<(Arc<HostTensor>, Option<String>)> {
        match &self.storage {
            Storage::Host(t) => Ok((t.clone(), None)),
            Storage::Cuda(e) => Ok((
                Arc::new(cuda::to_host(&e.tensor).map_err(err)?),
                Some("device memory is read through the host".into()),
            )),
        }
    }
}

/// The host tensor for an input: shared when it is a host `rustytorch.Tensor` or this module's
/// own export, else copied (with the reason).
fn host_input(obj: &Bound<'_, PyAny>) -> PyResult<(Arc<HostTensor>, Option<String>)> {
    if let Ok(t) = obj.cast::<Tensor>() {
        return t.get().to_host();
    }
    let d = import(obj)?;
    obj.py().detach(move || {
        let im = d.into_host().map_err(err)?;
        Ok((im.tensor, im.copied))
    })
}

#[pymethods]
impl Tensor {
    /// The extents.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.ty.shape.dims())
    }

    /// The dtype's name (`f32`, `f64`, `f16`, `bf16`, `i32`, `i64`, `u8`, `bool`).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.ty.dtype.name()
    }

    /// `cpu` or `cuda:N`.
    #[getter]
    fn device(&self) -> String {
        match &self.storage {
            Storage::Host(_) => "cpu".into(),
            Storage::Cuda(e) => format!("cuda:{}", e.tensor.device().device_id),
        }
    }

    /// The address of the first element (a device address on a device).
    #[getter]
    fn data_ptr(&self) -> u64 {
        match &self.storage {
            Storage::Host(t) => rustytorch::dlpack::host_data_ptr(t),
            Storage::Cuda(e) => e.tensor.data_ptr(),
        }
    }

    /// `(device type, ordinal)` as DLPack numbers them (1: CPU, 2: CUDA).
    fn __dlpack_device__(&self) -> (i32, i32) {
        let d = self.dl_device();
        (d.device_type.0, d.device_id)
    }

    /// A DLPack capsule of this tensor (the array API's protocol): DLPack ≥ 1.0 when the
    /// consumer asks for it with `max_version`, else the legacy struct. The memory is shared;
    /// `copy=True`, or a `dl_device` elsewhere, copies.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let legacy = max_version.is_none_or(|(major, _)| major < 1);
        let here = self.dl_device();
        let target = dl_device.map_or(here, |(t, id)| DLDevice {
            device_type: DLDeviceType(t),
            device_id: id,
        });
        let moves = target != here;
        if (moves || copy == Some(true)) && copy == Some(false) {
            return Err(PyBufferError::new_err(format!(
                "the tensor is on {}; copy=False cannot move it to device ({}, {})",
                self.device(),
                target.device_type.0,
                target.device_id
            )));
        }
        let t = match (&self.storage, target.device_type) {
            (Storage::Host(t), DLDeviceType::CPU) => {
                let t = if copy == Some(true) {
                    Arc::new((**t).clone().into_owned())
                } else {
                    t.clone()
                };
                if legacy {
                    DlpackTensor::from_host_legacy(t)
                } else {
                    DlpackTensor::from_host(t)
                }
            }
            (Storage::Cuda(_), DLDeviceType::CPU) => {
                let (t, _) = self.to_host()?;
                if legacy {
                    DlpackTensor::from_host_legacy(t)
                } else {
                    DlpackTensor::from_host(t)
                }
            }
            (Storage::Cuda(e), DLDeviceType::CUDA) if !moves && copy != Some(true) => {
                let ordinal = usize::try_from(here.device_id).map_err(err)?;
                let consumer = cuda::ConsumerStream::from_arg(stream).map_err(err)?;
                // Binds the device's context to this thread.
                cuda::stream_handle(ordinal).map_err(err)?;
                // SAFETY: the export's stream lives as long as the process's DLPack streams (or
                // its session's device); the consumer vouches for the stream it names.
                unsafe { cuda::hand_over(e.stream, consumer) }.map_err(err)?;
                // A run's output block is reused only after the consumer's queued work.
                e.used_on(consumer);
                // SAFETY: the export owns `ty.size_bytes()` bytes at its address and the new
                // tensor keeps the export alive.
                unsafe {
                    DlpackTensor::from_device(
                        e.tensor.data_ptr(),
                        &self.ty,
                        here,
                        Box::new(e.clone()),
                        DLPACK_FLAG_BITMASK_IS_COPIED,
                        legacy,
                    )
                }
            }
            (_, DLDeviceType::CUDA) => {
                let ordinal = usize::try_from(target.device_id).map_err(err)?;
                let (t, _) = self.to_host()?;
                let e = cuda::export_to_device(&t, ordinal, legacy).map_err(err)?;
                let consumer = cuda::ConsumerStream::from_arg(stream).map_err(err)?;
                // SAFETY: as above; `export_to_device` bound the context.
                unsafe { cuda::hand_over(e.stream, consumer) }.map_err(err)?;
                e.tensor
            }
            (_, other) => {
                return Err(PyBufferError::new_err(format!(
                    "DLPack device type {} is not one RustyTorch exports to (1: CPU, 2: CUDA)",
                    other.0
                )))
            }
        };
        capsule(py, t)
    }

    fn __repr__(&self) -> String {
        format!("rustytorch.Tensor({}, device={})", self.ty, self.device())
    }
}

/// A compiled graph: parameters and optimizer state stay in it between runs.
#[pyclass(module = "rustytorch")]
struct Executable {
    /// One run at a time: a call from another thread waits (without the interpreter lock).
    exe: Mutex<rustytorch::Executable>,
    /// Inputs of the last run that were copied, with the reason.
    copied: Mutex<Vec<(String, String)>>,
}

fn poisoned<T>(_: T) -> PyErr {
    err("a run panicked earlier: the executable is unusable")
}

impl Executable {
    fn exe(&self) -> PyResult<MutexGuard<'_, rustytorch::Executable>> {
        self.exe.lock().map_err(poisoned)
    }

    fn compile(
        graph: rustytorch::Graph,
        device: &str,
        optimize: bool,
        updates: bool,
    ) -> PyResult<Self> {
        let device = Device::parse(device).ok_or_else(|| {
            err(format!(
                "unknown device `{device}` (cpu, cuda, cuda:N or auto)"
            ))
        })?;
        let opts = CompileOptions {
            optimize,
            updates,
            ..CompileOptions::default()
        };
        let exe = rustytorch::compile_graph(&graph, device, &opts).map_err(err)?;
        Ok(Executable {
            exe: Mutex::new(exe),
            copied: Mutex::new(Vec::new()),
        })
    }

    /// Runs a CUDA executable on CUDA inputs in place, when every input is a compact CUDA
    /// array of its device; None when some input is not (the caller goes through the host).
    fn run_on_device(
        &self,
        py: Python<'_>,
        inputs: &[(String, Bound<'_, PyAny>)],
    ) -> PyResult<Option<Vec<(String, Tensor)>>> {
        let Device::Cuda(ordinal) = self.exe()?.device() else {
            return Ok(None);
        };
        let mut tensors = Vec::with_capacity(inputs.len());
        for (name, obj) in inputs {
            let d = match obj.cast::<Tensor>() {
                Ok(t) => match &t.get().storage {
                    Storage::Cuda(e) => {
                        // Our stream waits for the stream that wrote the result.
                        cuda::stream_handle(ordinal).map_err(err)?;
                        let ours = cuda::ConsumerStream::Handle(
                            cuda::stream_handle(ordinal).map_err(err)?,
                        );
                        // SAFETY: both streams are live in the bound context.
                        unsafe { cuda::hand_over(e.stream, ours) }.map_err(err)?;
                        // SAFETY: the export's memory holds the tensor and the new tensor keeps
                        // the export alive.
                        unsafe {
                            DlpackTensor::from_device(
                                e.tensor.data_ptr(),
                                &t.get().ty,
                                e.tensor.device(),
                                Box::new(e.clone()),
                                0,
                                false,
                            )
                        }
                    }
                    Storage::Host(_) => return Ok(None),
                },
                Err(_) => {
                    let dev = obj.call_method0(pyo3::intern!(py, "__dlpack_device__"));
                    let Ok((kind, id)) = dev.and_then(|d| d.extract::<(i32, i32)>()) else {
                        return Ok(None);
                    };
                    if kind != DLDeviceType::CUDA.0 || usize::try_from(id).ok() != Some(ordinal) {
                        return Ok(None);
                    }
                    import(obj)?
                }
            };
            if cuda::device_input(&d, ordinal).map_err(err)?.is_err() {
                return Ok(None);
            }
            tensors.push((name.clone(), d));
        }
        let r = py.detach(|| {
            let refs: Vec<(&str, &DlpackTensor)> =
                tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
            let mut exe = self.exe()?;
            let r = exe.run_dlpack_cuda(&refs).map_err(err)?;
            *self.copied.lock().map_err(poisoned)? = r.copied;
            Ok::<_, PyErr>(r.outputs)
        })?;
        Ok(Some(
            r.into_iter()
                .map(|(n, e)| {
                    let ty = e.tensor.ty().map_err(err)?;
                    Ok((
                        n,
                        Tensor {
                            ty,
                            storage: Storage::Cuda(Arc::new(e)),
                        },
                    ))
                })
                .collect::<PyResult<Vec<_>>>()?,
        ))
    }

    /// Runs with `(name, object)` inputs; results in output order.
    fn run_named(
        &self,
        py: Python<'_>,
        inputs: Vec<(String, Bound<'_, PyAny>)>,
    ) -> PyResult<Vec<(String, Tensor)>> {
        if !inputs.is_empty() {
            if let Some(out) = self.run_on_device(py, &inputs)? {
                return Ok(out);
            }
        }
        let mut copied = Vec::new();
        let mut shared = Vec::with_capacity(inputs.len());
        for (name, obj) in &inputs {
            let (t, why) = host_input(obj)?;
            if let Some(why) = why {
                copied.push((name.clone(), why));
            }
            shared.push((name.as_str(), t));
        }
        let (out, device) = py.detach(|| {
            let mut exe = self.exe()?;
            let out = exe.run_shared(&shared).map_err(err)?;
            *self.copied.lock().map_err(poisoned)? = copied;
            Ok::<_, PyErr>((out, exe.device()))
        })?;
        let names = out.names().to_vec();
        names
            .into_iter()
            .zip(out.into_vec())
            .map(|(n, t)| Ok((n, Tensor::on(t, device)?)))
            .collect()
    }
}

#[pymethods]
impl Executable {
    /// Runs the graph with inputs by name; returns the results by name.
    #[pyo3(signature = (**inputs))]
    fn run<'py>(
        &self,
        py: Python<'py>,
        inputs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let named = match inputs {
            Some(d) => d
                .iter()
                .map(|(k, v)| Ok((k.extract::<String>()?, v)))
                .collect::<PyResult<Vec<_>>>()?,
            None => Vec::new(),
        };
        let out = PyDict::new(py);
        for (n, t) in self.run_named(py, named)? {
            out.set_item(n, Py::new(py, t)?)?;
        }
        Ok(out)
    }

    /// Runs the graph with inputs in the graph's order (or by name); returns the one result, or
    /// a tuple of them in output order.
    #[pyo3(signature = (*args, **kwargs))]
    fn __call__<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        let names: Vec<String> = self
            .exe()?
            .input_types()
            .iter()
            .map(|(n, _)| n.to_string())
            .collect();
        if args.len() > names.len() {
            return Err(PyTypeError::new_err(format!(
                "{} inputs given, the graph has {} ({})",
                args.len(),
                names.len(),
                names.join(", ")
            )));
        }
        let mut named: Vec<(String, Bound<'py, PyAny>)> =
            names.into_iter().zip(args.iter()).collect();
        if let Some(kw) = kwargs {
            for (k, v) in kw.iter() {
                named.push((k.extract()?, v));
            }
        }
        let mut out = self.run_named(py, named)?;
        if out.len() == 1 {
            return Ok(Py::new(py, out.remove(0).1)?.into_any());
        }
        let items = out
            .into_iter()
            .map(|(_, t)| Py::new(py, t))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(PyTuple::new(py, items)?.into_any().unbind())
    }

    /// The inputs: `(name, dtype, shape)` in order.
    #[getter]
    fn inputs(&self) -> PyResult<Vec<(String, &'static str, Vec<usize>)>> {
        Ok(spec(self.exe()?.input_types()))
    }

    /// The result names, in order.
    #[getter]
    fn outputs(&self) -> PyResult<Vec<String>> {
        Ok(self
            .exe()?
            .plan()
            .outputs
            .iter()
            .map(|(n, _)| n.clone())
            .collect())
    }

    /// The parameter and state tensors: `(name, dtype, shape)` in order.
    #[getter]
    fn parameters(&self) -> PyResult<Vec<(String, &'static str, Vec<usize>)>> {
        Ok(spec(self.exe()?.param_types()))
    }

    /// `cpu` or `cuda:N`.
    #[getter]
    fn device(&self) -> PyResult<String> {
        Ok(self.exe()?.device_name())
    }

    /// What the last run copied instead of using in place: `(name, reason)` for inputs, and on
    /// CUDA also for outputs (a replayed CUDA graph copies into and out of its own buffers).
    #[getter]
    fn copied_inputs(&self) -> PyResult<Vec<(String, String)>> {
        Ok(self.copied.lock().map_err(poisoned)?.clone())
    }

    /// A parameter's current value (a copy of the session's, on its device).
    fn param(&self, name: &str) -> PyResult<Tensor> {
        let exe = self.exe()?;
        if !exe.param_types().iter().any(|(n, _)| *n == name) {
            return Err(PyKeyError::new_err(format!("no parameter `{name}`")));
        }
        let t = exe
            .param(name)
            .ok_or_else(|| err(format!("parameter `{name}` could not be read")))?;
        Tensor::on(t, exe.device())
    }

    /// Every parameter and state tensor by name.
    fn params<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let exe = self.exe()?;
        let device = exe.device();
        for (n, t) in exe.params().map_err(err)? {
            out.set_item(n, Py::new(py, Tensor::on(t, device)?)?)?;
        }
        Ok(out)
    }

    /// Replaces a parameter's value with any DLPack array (or `rustytorch.Tensor`) of its type.
    fn set_param(&self, name: &str, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let (t, _) = host_input(value)?;
        self.exe()?
            .set_param(name, Arc::unwrap_or_clone(t))
            .map_err(err)
    }

    /// The optimized, fused graph as IR text.
    fn optimized_ir(&self) -> PyResult<String> {
        Ok(self.exe()?.optimized_ir())
    }

    fn __repr__(&self) -> PyResult<String> {
        let exe = self.exe()?;
        let outputs: Vec<&str> = exe.plan().outputs.iter().map(|(n, _)| n.as_str()).collect();
        Ok(format!(
            "rustytorch.Executable(device={}, inputs={:?}, outputs={:?})",
            exe.device_name(),
            exe.input_types()
                .iter()
                .map(|(n, t)| format!("{n}: {t}"))
                .collect::<Vec<_>>(),
            outputs
        ))
    }
}

fn spec(v: Vec<(&str, &TensorType)>) -> Vec<(String, &'static str, Vec<usize>)> {
    v.into_iter()
        .map(|(n, t)| (n.to_string(), t.dtype.name(), t.shape.dims().to_vec()))
        .collect()
}

/// Loads a graph file (`.rtg`, or IR text in `.rtir`/`.txt`) and compiles it for `device`.
#[pyfunction]
#[pyo3(signature = (path, device="cpu", *, optimize=true, updates=true))]
fn load(path: PathBuf, device: &str, optimize: bool, updates: bool) -> PyResult<Executable> {
    let text = matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("rtir" | "txt")
    );
    let graph = if text {
        let s =
            std::fs::read_to_string(&path).map_err(|e| err(format!("{}: {e}", path.display())))?;
        rustytorch::compiler::text::parse(&s).map_err(err)?
    } else {
        rustytorch::compiler::format::load(&path).map_err(err)?
    };
    Executable::compile(graph, device, optimize, updates)
}

/// Compiles a graph written as IR text for `device`.
#[pyfunction]
#[pyo3(signature = (text, device="cpu", *, optimize=true, updates=true))]
fn compile_ir(text: &str, device: &str, optimize: bool, updates: bool) -> PyResult<Executable> {
    let graph = rustytorch::compiler::text::parse(text).map_err(err)?;
    Executable::compile(graph, device, optimize, updates)
}

/// A host tensor with the elements of any DLPack array: shared when it is RustyTorch's own or
/// compact, aligned host memory of another library (a view that keeps the array alive), else
/// copied once (staging a strided or device array this way makes later runs copy nothing).
#[pyfunction]
fn from_dlpack(obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let (t, _) = host_input(obj)?;
    Ok(Tensor::host(t))
}

/// A zero host tensor of `dtype` and `shape` (to fill through `numpy.from_dlpack` and pass as
/// an input without a copy).
#[pyfunction]
fn zeros(dtype: &str, shape: Vec<usize>) -> PyResult<Tensor> {
    let d = rustytorch::DType::from_name(dtype)
        .ok_or_else(|| err(format!("unknown dtype `{dtype}`")))?;
    Ok(Tensor::host(Arc::new(HostTensor::zeros(&TensorType::new(
        d, shape,
    )))))
}

#[pymodule]
fn _rustytorch(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("Error", m.py().get_type::<Error>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<Tensor>()?;
    m.add_class::<Executable>()?;
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(compile_ir, m)?)?;
    m.add_function(wrap_pyfunction!(from_dlpack, m)?)?;
    m.add_function(wrap_pyfunction!(zeros, m)?)?;
    Ok(())
}
