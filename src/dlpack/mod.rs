//! DLPack: handing tensors to and from other array libraries (NumPy, PyTorch, JAX, CuPy) without
//! copies.
//!
//! The structs below are `dlpack.h` (DLPack 1.1, with the legacy pre-1.0 `DLManagedTensor`) as
//! `#[repr(C)]` Rust. We keep this small layer rather than depend on the `dlpark` crate: the ABI
//! is a few frozen structs, while what matters here is ownership (a managed tensor keeps an
//! `Arc<HostTensor>` or a device block alive until its deleter runs, on whatever thread) and the
//! CUDA stream hand-over, both of which are ours to get right and to test; `dlpark`'s Python
//! integration would also tie our pyo3 version to its releases.
//!
//! [`DlpackTensor`] owns one managed tensor, versioned or legacy, ours or another library's, and
//! calls its deleter exactly once: when it is dropped, unless [`DlpackTensor::into_raw`] handed
//! it on. Exports ([`DlpackTensor::from_host`], [`DlpackTensor::from_device`]) share the memory
//! they describe; imports ([`DlpackTensor::into_host`]) reuse a tensor this crate exported, view
//! compact, aligned host memory of other libraries in place (a host tensor's [`Buf`] keeps the
//! producer's tensor alive) and copy anything else into a new host tensor, saying why.

use crate::{Error, Executable, Result};
use rustytorch_ops::{with_dtype, Buf, DType, Data, HostElement, HostTensor, TensorType};
use rustytorch_runtime::Device;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

pub mod cuda;

/// The DLPack version these structs follow.
pub const DLPACK_VERSION: DLPackVersion = DLPackVersion { major: 1, minor: 1 };
/// [`DLManagedTensorVersioned::flags`]: the consumer must not write to the memory.
pub const DLPACK_FLAG_BITMASK_READ_ONLY: u64 = 1 << 0;
/// [`DLManagedTensorVersioned::flags`]: the producer copied the data for this exchange.
pub const DLPACK_FLAG_BITMASK_IS_COPIED: u64 = 1 << 1;

/// `DLDeviceType`: where the memory lives (an `int32` in C; kept open, since other libraries may
/// send values this crate does not name).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DLDeviceType(pub i32);

impl DLDeviceType {
    /// `kDLCPU`: host memory.
    pub const CPU: DLDeviceType = DLDeviceType(1);
    /// `kDLCUDA`: CUDA device memory.
    pub const CUDA: DLDeviceType = DLDeviceType(2);
    /// `kDLCUDAHost`: pinned host memory (`cudaMallocHost`).
    pub const CUDA_HOST: DLDeviceType = DLDeviceType(3);
    /// `kDLCUDAManaged`: CUDA managed (unified) memory.
    pub const CUDA_MANAGED: DLDeviceType = DLDeviceType(13);
}

/// `DLDevice`: a device type and its ordinal.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DLDevice {
    /// The device type.
    pub device_type: DLDeviceType,
    /// The ordinal (0 on the host).
    pub device_id: i32,
}

impl DLDevice {
    /// The host.
    pub const CPU: DLDevice = DLDevice {
        device_type: DLDeviceType::CPU,
        device_id: 0,
    };

    /// The DLPack device of a RustyTorch device ([`Device::Auto`] is not a place and has none).
    pub fn of(device: Device) -> Result<DLDevice> {
        match device {
            Device::Cpu => Ok(DLDevice::CPU),
            Device::Cuda(i) => Ok(DLDevice {
                device_type: DLDeviceType::CUDA,
                device_id: i32::try_from(i).map_err(|_| dl_err(format!("cuda:{i}: ordinal")))?,
            }),
            Device::Auto => Err(dl_err("`auto` is not a device memory can live on")),
        }
    }

    /// Whether the host can read the memory directly (host, pinned or managed memory).
    pub fn host_accessible(&self) -> bool {
        matches!(
            self.device_type,
            DLDeviceType::CPU | DLDeviceType::CUDA_HOST | DLDeviceType::CUDA_MANAGED
        )
    }
}

/// `DLDataType`: a type code, its bits and lanes (lanes are 1 for every type exchanged here).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DLDataType {
    /// `kDLInt` 0, `kDLUInt` 1, `kDLFloat` 2, `kDLBfloat` 4, `kDLBool` 6 ...
    pub code: u8,
    /// Bits of one lane.
    pub bits: u8,
    /// Lanes (vector types); 1 for scalars.
    pub lanes: u16,
}

impl DLDataType {
    const INT: u8 = 0;
    const UINT: u8 = 1;
    const FLOAT: u8 = 2;
    const BFLOAT: u8 = 4;
    const BOOL: u8 = 6;

    /// The DLPack type of a dtype (bool is `kDLBool` of 8 bits, as NumPy and PyTorch send it).
    pub fn of(dtype: DType) -> DLDataType {
        let (code, bits) = match dtype {
            DType::F32 => (Self::FLOAT, 32),
            DType::F64 => (Self::FLOAT, 64),
            DType::F16 => (Self::FLOAT, 16),
            DType::BF16 => (Self::BFLOAT, 16),
            DType::I32 => (Self::INT, 32),
            DType::I64 => (Self::INT, 64),
            DType::U8 => (Self::UINT, 8),
            DType::Bool => (Self::BOOL, 8),
            DType::I8 => (Self::INT, 8),
            DType::I16 => (Self::INT, 16),
            DType::U16 => (Self::UINT, 16),
            DType::U32 => (Self::UINT, 32),
            DType::U64 => (Self::UINT, 64),
        };
        DLDataType {
            code,
            bits,
            lanes: 1,
        }
    }

    /// The dtype of a DLPack type, when RustyTorch has it.
    pub fn dtype(&self) -> Result<DType> {
        let d = match (self.code, self.bits, self.lanes) {
            (Self::FLOAT, 32, 1) => DType::F32,
            (Self::FLOAT, 64, 1) => DType::F64,
            (Self::FLOAT, 16, 1) => DType::F16,
            (Self::BFLOAT, 16, 1) => DType::BF16,
            (Self::INT, 32, 1) => DType::I32,
            (Self::INT, 64, 1) => DType::I64,
            (Self::UINT, 8, 1) => DType::U8,
            (Self::BOOL, 8, 1) => DType::Bool,
            (Self::INT, 8, 1) => DType::I8,
            (Self::INT, 16, 1) => DType::I16,
            (Self::UINT, 16, 1) => DType::U16,
            (Self::UINT, 32, 1) => DType::U32,
            (Self::UINT, 64, 1) => DType::U64,
            _ => {
                return Err(dl_err(format!(
                    "DLPack type (code {}, {} bits, {} lanes) has no RustyTorch dtype (f32, f64, \
                     f16, bf16, i8, i16, i32, i64, u8, u16, u32, u64 and bool do)",
                    self.code, self.bits, self.lanes
                )))
            }
        };
        Ok(d)
    }
}

/// `DLTensor`: a strided view of memory (not owning it).
#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    /// The base pointer (device address on a device).
    pub data: *mut c_void,
    /// Where the memory lives.
    pub device: DLDevice,
    /// Number of dimensions.
    pub ndim: i32,
    /// The element type.
    pub dtype: DLDataType,
    /// `ndim` extents.
    pub shape: *mut i64,
    /// `ndim` strides in elements, or null for a compact row-major tensor.
    pub strides: *mut i64,
    /// Bytes from `data` to the first element.
    pub byte_offset: u64,
}

/// `DLManagedTensor`: the legacy (pre-1.0) managed tensor, still what older consumers take.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    /// The tensor.
    pub dl_tensor: DLTensor,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Releases the tensor; called once by its owner.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `DLPackVersion`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLPackVersion {
    /// Major version: an ABI break.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

/// `DLManagedTensorVersioned` (DLPack ≥ 1.0).
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensorVersioned {
    /// The producer's DLPack version.
    pub version: DLPackVersion,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Releases the tensor; called once by its owner.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    /// `DLPACK_FLAG_BITMASK_*`.
    pub flags: u64,
    /// The tensor.
    pub dl_tensor: DLTensor,
}

fn dl_err(reason: impl Into<String>) -> Error {
    Error::Dlpack(reason.into())
}

/// The raw managed tensor a [`DlpackTensor`] hands on with [`DlpackTensor::into_raw`].
#[derive(Debug)]
pub enum RawManaged {
    /// DLPack ≥ 1.0.
    Versioned(NonNull<DLManagedTensorVersioned>),
    /// The legacy struct.
    Legacy(NonNull<DLManagedTensor>),
}

/// One DLPack managed tensor, owned: dropping it calls the producer's deleter once.
#[derive(Debug)]
pub struct DlpackTensor {
    raw: RawManaged,
}

// SAFETY: DLPack lets the owner of a managed tensor release it from any thread (NumPy's and
// PyTorch's deleters take the interpreter lock themselves; ours only drop `Send` values), and the
// struct is only read through `&self`.
unsafe impl Send for DlpackTensor {}

// SAFETY: `&DlpackTensor` only reads the managed struct, which nobody writes while it is owned.
unsafe impl Sync for DlpackTensor {}

/// A host tensor read from a DLPack tensor, and whether that took a copy.
#[derive(Debug)]
pub struct Imported {
    /// The tensor.
    pub tensor: Arc<HostTensor>,
    /// Why the data was copied (None: the tensor shares the exporter's memory).
    pub copied: Option<String>,
}

/// What an export keeps alive next to its shape and strides.
enum Keep {
    /// A host tensor whose storage the export points into.
    Host(Arc<HostTensor>),
    /// Whatever owns device memory (returns it to its pool when dropped).
    Device(#[allow(dead_code)] Box<dyn Send>),
}

/// An export: the managed struct first, so the struct's address is the holder's.
#[repr(C)]
struct Holder<M> {
    managed: M,
    shape: Vec<i64>,
    strides: Vec<i64>,
    keep: Keep,
}

unsafe extern "C" fn delete_versioned(p: *mut DLManagedTensorVersioned) {
    if p.is_null() {
        return;
    }
    // SAFETY: `p` came from `Box::into_raw` of a `Holder<DLManagedTensorVersioned>` (its first
    // field, `repr(C)`), and DLPack calls the deleter once.
    drop(unsafe { Box::from_raw(p.cast::<Holder<DLManagedTensorVersioned>>()) });
}

unsafe extern "C" fn delete_legacy(p: *mut DLManagedTensor) {
    if p.is_null() {
        return;
    }
    // SAFETY: as in `delete_versioned`, for `Holder<DLManagedTensor>`.
    drop(unsafe { Box::from_raw(p.cast::<Holder<DLManagedTensor>>()) });
}

/// The row-major strides (in elements) of `dims`.
pub fn contiguous_strides(dims: &[usize]) -> Vec<i64> {
    let mut strides = vec![0i64; dims.len()];
    let mut s = 1i64;
    for (d, st) in dims.iter().zip(strides.iter_mut()).rev() {
        *st = s;
        s = s.saturating_mul(*d as i64);
    }
    strides
}

/// The address of a host tensor's first element.
fn host_ptr(t: &HostTensor) -> *mut c_void {
    match t.data() {
        Data::F32(v) => v.as_ptr() as *mut c_void,
        Data::F64(v) => v.as_ptr() as *mut c_void,
        Data::F16(v) => v.as_ptr() as *mut c_void,
        Data::BF16(v) => v.as_ptr() as *mut c_void,
        Data::I32(v) => v.as_ptr() as *mut c_void,
        Data::I64(v) => v.as_ptr() as *mut c_void,
        Data::U8(v) => v.as_ptr() as *mut c_void,
        Data::Bool(v) => v.as_ptr() as *mut c_void,
        Data::I8(v) => v.as_ptr() as *mut c_void,
        Data::I16(v) => v.as_ptr() as *mut c_void,
        Data::U16(v) => v.as_ptr() as *mut c_void,
        Data::U32(v) => v.as_ptr() as *mut c_void,
        Data::U64(v) => v.as_ptr() as *mut c_void,
    }
}

/// The address of a host tensor's first element (what [`DlpackTensor::from_host`] exports).
pub fn host_data_ptr(t: &HostTensor) -> u64 {
    host_ptr(t) as usize as u64
}

/// The bytes of a host tensor's storage (bool as its 0/1 bytes).
pub(crate) fn host_bytes(t: &HostTensor) -> &[u8] {
    let n = t.numel() * t.dtype().size_bytes();
    // SAFETY: the storage is `n` initialized bytes of plain numbers (bool is one byte, 0 or 1)
    // borrowed from `t`.
    unsafe { std::slice::from_raw_parts(host_ptr(t) as *const u8, n) }
}

fn dl_tensor(
    data: *mut c_void,
    device: DLDevice,
    dtype: DType,
    shape: &mut [i64],
    strides: &mut [i64],
) -> DLTensor {
    DLTensor {
        data,
        device,
        ndim: shape.len() as i32,
        dtype: DLDataType::of(dtype),
        shape: shape.as_mut_ptr(),
        strides: strides.as_mut_ptr(),
        byte_offset: 0,
    }
}

impl DlpackTensor {
    fn export(
        data: *mut c_void,
        device: DLDevice,
        ty: &TensorType,
        flags: u64,
        keep: Keep,
        legacy: bool,
    ) -> DlpackTensor {
        let mut shape: Vec<i64> = ty.shape.dims().iter().map(|&d| d as i64).collect();
        let mut strides = contiguous_strides(ty.shape.dims());
        // The vectors' heap buffers do not move when the holder is boxed.
        let t = dl_tensor(data, device, ty.dtype, &mut shape, &mut strides);
        let raw = if legacy {
            let mut h = NonNull::from(Box::leak(Box::new(Holder {
                managed: DLManagedTensor {
                    dl_tensor: t,
                    manager_ctx: std::ptr::null_mut(),
                    deleter: Some(delete_legacy),
                },
                shape,
                strides,
                keep,
            })));
            // SAFETY: `h` is the live holder just leaked; its context names it.
            unsafe { h.as_mut().managed.manager_ctx = h.as_ptr().cast() };
            // The managed struct is the holder's first field (`repr(C)`).
            RawManaged::Legacy(h.cast())
        } else {
            let mut h = NonNull::from(Box::leak(Box::new(Holder {
                managed: DLManagedTensorVersioned {
                    version: DLPACK_VERSION,
                    manager_ctx: std::ptr::null_mut(),
                    deleter: Some(delete_versioned),
                    flags,
                    dl_tensor: t,
                },
                shape,
                strides,
                keep,
            })));
            // SAFETY: as above.
            unsafe { h.as_mut().managed.manager_ctx = h.as_ptr().cast() };
            RawManaged::Versioned(h.cast())
        };
        DlpackTensor { raw }
    }

    /// Exports a host tensor as a DLPack ≥ 1.0 tensor without a copy: the export points into the
    /// tensor's storage and keeps it alive until the consumer's deleter runs. Consumers may
    /// write through it when the storage is the tensor's own; every holder of the `Arc` sees the
    /// change. A view of another library's memory ([`HostTensor::is_foreign`]) is exported
    /// read-only (`DLPACK_FLAG_BITMASK_READ_ONLY`): that memory is never written from here.
    pub fn from_host(t: Arc<HostTensor>) -> DlpackTensor {
        let ty = t.ty();
        let flags = if t.is_foreign() {
            DLPACK_FLAG_BITMASK_READ_ONLY
        } else {
            0
        };
        DlpackTensor::export(
            host_ptr(&t),
            DLDevice::CPU,
            &ty,
            flags,
            Keep::Host(t),
            false,
        )
    }

    /// [`DlpackTensor::from_host`] as the legacy `DLManagedTensor`, for consumers older than
    /// DLPack 1.0.
    pub fn from_host_legacy(t: Arc<HostTensor>) -> DlpackTensor {
        let ty = t.ty();
        DlpackTensor::export(host_ptr(&t), DLDevice::CPU, &ty, 0, Keep::Host(t), true)
    }

    /// Exports `ty`'s elements at device address `ptr` (compact, row-major) on `device`;
    /// `keep` owns the memory (a pool block returns to its pool when `keep` drops, which happens
    /// when the consumer's deleter runs, on whatever thread). `legacy` makes the pre-1.0 struct.
    ///
    /// # Safety
    ///
    /// `ptr` must address `ty.size_bytes()` bytes on `device` that stay valid until `keep` is
    /// dropped, and nothing else may free them while `keep` lives.
    pub unsafe fn from_device(
        ptr: u64,
        ty: &TensorType,
        device: DLDevice,
        keep: Box<dyn Send>,
        flags: u64,
        legacy: bool,
    ) -> DlpackTensor {
        DlpackTensor::export(
            ptr as usize as *mut c_void,
            device,
            ty,
            flags,
            Keep::Device(keep),
            legacy,
        )
    }

    /// Takes ownership of a DLPack ≥ 1.0 managed tensor. A major version other than 1 is
    /// refused (and the tensor released: the version, context and deleter keep their place in
    /// every version).
    ///
    /// # Safety
    ///
    /// `p` must point to a live managed tensor that nobody else will release, valid until its
    /// deleter is called.
    pub unsafe fn from_raw_versioned(p: NonNull<DLManagedTensorVersioned>) -> Result<DlpackTensor> {
        let t = DlpackTensor {
            raw: RawManaged::Versioned(p),
        };
        // SAFETY: the caller hands over a live managed tensor.
        let v = unsafe { p.as_ref() }.version;
        if v.major != DLPACK_VERSION.major {
            return Err(dl_err(format!(
                "DLPack {}.{} tensor: this build reads DLPack {}.x",
                v.major, v.minor, DLPACK_VERSION.major
            )));
        }
        Ok(t)
    }

    /// Takes ownership of a legacy managed tensor.
    ///
    /// # Safety
    ///
    /// As for [`DlpackTensor::from_raw_versioned`].
    pub unsafe fn from_raw_legacy(p: NonNull<DLManagedTensor>) -> DlpackTensor {
        DlpackTensor {
            raw: RawManaged::Legacy(p),
        }
    }

    /// Hands the managed tensor on (to a consumer, which then calls its deleter once).
    pub fn into_raw(self) -> RawManaged {
        let raw = match &self.raw {
            RawManaged::Versioned(p) => RawManaged::Versioned(*p),
            RawManaged::Legacy(p) => RawManaged::Legacy(*p),
        };
        std::mem::forget(self);
        raw
    }

    /// The tensor it describes.
    pub fn tensor(&self) -> &DLTensor {
        match &self.raw {
            // SAFETY: the managed tensor is live while `self` owns it.
            RawManaged::Versioned(p) => unsafe { &p.as_ref().dl_tensor },
            // SAFETY: as above.
            RawManaged::Legacy(p) => unsafe { &p.as_ref().dl_tensor },
        }
    }

    /// The producer's DLPack version (None for the legacy struct).
    pub fn version(&self) -> Option<DLPackVersion> {
        match &self.raw {
            // SAFETY: as in `tensor`.
            RawManaged::Versioned(p) => Some(unsafe { p.as_ref() }.version),
            RawManaged::Legacy(_) => None,
        }
    }

    /// `DLPACK_FLAG_BITMASK_*` (0 for the legacy struct).
    pub fn flags(&self) -> u64 {
        match &self.raw {
            // SAFETY: as in `tensor`.
            RawManaged::Versioned(p) => unsafe { p.as_ref() }.flags,
            RawManaged::Legacy(_) => 0,
        }
    }

    /// Whether the consumer must not write to the memory.
    pub fn is_read_only(&self) -> bool {
        self.flags() & DLPACK_FLAG_BITMASK_READ_ONLY != 0
    }

    /// Where the memory lives.
    pub fn device(&self) -> DLDevice {
        self.tensor().device
    }

    /// The element type.
    pub fn dtype(&self) -> Result<DType> {
        self.tensor().dtype.dtype()
    }

    /// The extents.
    pub fn shape(&self) -> &[i64] {
        let t = self.tensor();
        if t.ndim <= 0 || t.shape.is_null() {
            return &[];
        }
        // SAFETY: DLPack: `shape` points to `ndim` extents, live as long as the tensor.
        unsafe { std::slice::from_raw_parts(t.shape, t.ndim as usize) }
    }

    /// The strides in elements (None: compact row-major).
    pub fn strides(&self) -> Option<&[i64]> {
        let t = self.tensor();
        if t.strides.is_null() {
            return None;
        }
        if t.ndim <= 0 {
            return Some(&[]);
        }
        // SAFETY: DLPack: non-null `strides` points to `ndim` strides, live as long as the
        // tensor.
        Some(unsafe { std::slice::from_raw_parts(t.strides, t.ndim as usize) })
    }

    /// The type as RustyTorch sees it (an error for a dtype it lacks or a negative extent).
    pub fn ty(&self) -> Result<TensorType> {
        let dims = self
            .shape()
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| dl_err(format!("negative extent {d}"))))
            .collect::<Result<Vec<usize>>>()?;
        Ok(TensorType::new(self.dtype()?, dims))
    }

    /// The address of the first element (`data + byte_offset`; a device address on a device).
    pub fn data_ptr(&self) -> u64 {
        let t = self.tensor();
        (t.data as usize as u64).wrapping_add(t.byte_offset)
    }

    /// Whether the elements are compact and row-major (extents of 1 may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let Some(strides) = self.strides() else {
            return true;
        };
        let mut want = 1i64;
        for (&d, &s) in self.shape().iter().zip(strides).rev() {
            if d != 1 && s != want {
                return false;
            }
            want = want.saturating_mul(d);
        }
        true
    }

    /// The host tensor behind a tensor this crate exported from the host, shared (no copy),
    /// when the view still covers it exactly.
    fn own_host(&self) -> Option<Arc<HostTensor>> {
        let holder_keep = match &self.raw {
            RawManaged::Versioned(p) => {
                // SAFETY: as in `tensor`.
                let m = unsafe { p.as_ref() };
                let ours = m.deleter.is_some_and(|d| {
                    std::ptr::fn_addr_eq(d, delete_versioned as unsafe extern "C" fn(_))
                });
                // SAFETY: our deleter means our holder, whose context is the holder itself.
                ours.then(|| unsafe {
                    &(*m.manager_ctx.cast::<Holder<DLManagedTensorVersioned>>()).keep
                })
            }
            RawManaged::Legacy(p) => {
                // SAFETY: as in `tensor`.
                let m = unsafe { p.as_ref() };
                let ours = m.deleter.is_some_and(|d| {
                    std::ptr::fn_addr_eq(d, delete_legacy as unsafe extern "C" fn(_))
                });
                // SAFETY: as above.
                ours.then(|| unsafe { &(*m.manager_ctx.cast::<Holder<DLManagedTensor>>()).keep })
            }
        }?;
        let Keep::Host(t) = holder_keep else {
            return None;
        };
        let same = self.data_ptr() == host_ptr(t) as usize as u64
            && self.ty().ok().as_ref() == Some(&t.ty())
            && self.is_contiguous();
        same.then(|| t.clone())
    }

    /// Copies the elements into a new compact host tensor, reading any strides (negative and
    /// zero too) and `byte_offset`; bool bytes are read as nonzero = true. The memory must be
    /// host-accessible ([`DLDevice::host_accessible`]); device memory is copied by
    /// [`cuda::to_host`].
    pub fn to_host(&self) -> Result<HostTensor> {
        let dev = self.device();
        if !dev.host_accessible() {
            return Err(dl_err(format!(
                "DLPack device type {} (ordinal {}) is not host memory",
                dev.device_type.0, dev.device_id
            )));
        }
        let ty = self.ty()?;
        let n = ty.shape.numel();
        if n == 0 {
            return Ok(HostTensor::zeros(&ty));
        }
        if self.tensor().data.is_null() {
            return Err(dl_err("null data pointer for a non-empty tensor"));
        }
        let strides = match self.strides() {
            Some(s) => s.to_vec(),
            None => contiguous_strides(ty.shape.dims()),
        };
        // SAFETY: the producer guarantees that every element the shape and strides address, from
        // `data_ptr`, is readable host memory while the tensor lives.
        unsafe { gather(self.data_ptr() as usize as *const u8, &ty, &strides) }
    }

    /// Why the elements cannot be viewed in place as a host tensor of `ty` (None: they can):
    /// only compact row-major memory (strides null or the compact ones) at an address aligned
    /// for the element type is viewed, and bool only when every byte is 0 or 1.
    fn view_obstacle(&self, ty: &TensorType) -> Option<String> {
        if ty.shape.numel() == 0 {
            return None;
        }
        if !self.is_contiguous() {
            return Some(format!(
                "strided memory (strides {:?}; compact row-major is {:?}) is copied into a \
                 compact host tensor",
                self.strides().unwrap_or(&[]),
                contiguous_strides(ty.shape.dims())
            ));
        }
        let align = ty.dtype.size_bytes() as u64;
        if !self.data_ptr().is_multiple_of(align) {
            return Some(format!(
                "address {:#x} is not aligned for {} ({align} bytes): copied",
                self.data_ptr(),
                ty.dtype
            ));
        }
        if ty.dtype == DType::Bool {
            // SAFETY: host-accessible, compact memory of `numel` bytes, live while `self` is.
            let bytes = unsafe {
                std::slice::from_raw_parts(self.data_ptr() as usize as *const u8, ty.shape.numel())
            };
            if bytes.iter().any(|&b| b > 1) {
                return Some(
                    "bool bytes other than 0 and 1 are read as nonzero = true: copied".into(),
                );
            }
        }
        None
    }

    /// Views host-accessible memory as a host tensor without a copy (`view_obstacle` must have
    /// found nothing in the way); the tensor keeps `self` alive, so the producer's deleter runs
    /// once, when the last host tensor sharing the memory drops, on whatever thread that is.
    fn view_host(self, ty: TensorType) -> Result<HostTensor> {
        let n = ty.shape.numel();
        if n == 0 {
            return Ok(HostTensor::zeros(&ty));
        }
        let ptr = self.data_ptr() as usize;
        if ptr == 0 {
            return Err(dl_err("null data pointer for a non-empty tensor"));
        }
        let owner: Arc<dyn Send + Sync> = Arc::new(self);
        // SAFETY: the producer guarantees `n` compact elements at `ptr` (checked aligned, bool
        // bytes checked 0 or 1) that stay valid until its deleter runs, which `owner` delays
        // until the last view drops; the view is read-only (`Buf` copies before writing).
        let data = with_dtype!(ty.dtype, T => <T as HostElement>::wrap_buf(unsafe {
            Buf::from_foreign(ptr as *const T, n, owner)
        }));
        Ok(HostTensor::from_data(data, ty.shape)?)
    }

    /// A host tensor with these elements for running an executable, without a copy where the
    /// memory allows: the very tensor when this crate exported it from the host, a view of
    /// host-accessible memory of another library (NumPy, PyTorch on the CPU, pinned or managed
    /// CUDA memory) when it is compact row-major and aligned (the producer's tensor stays alive
    /// until the last view drops), else a copy ([`DlpackTensor::to_host`] for strided or
    /// misaligned host memory, [`cuda::to_host`] for CUDA memory) with the reason in
    /// [`Imported::copied`].
    pub fn into_host(self) -> Result<Imported> {
        if let Some(t) = self.own_host() {
            return Ok(Imported {
                tensor: t,
                copied: None,
            });
        }
        let dev = self.device();
        let (t, why) = if dev.host_accessible() {
            let ty = self.ty()?;
            match self.view_obstacle(&ty) {
                None => {
                    return Ok(Imported {
                        tensor: Arc::new(self.view_host(ty)?),
                        copied: None,
                    })
                }
                Some(why) => (self.to_host()?, why),
            }
        } else if dev.device_type == DLDeviceType::CUDA {
            (
                cuda::to_host(&self)?,
                "sessions take host tensors: CUDA memory is copied through the host".to_string(),
            )
        } else {
            return Err(dl_err(format!(
                "DLPack device type {} (ordinal {}) is neither host memory nor CUDA",
                dev.device_type.0, dev.device_id
            )));
        };
        Ok(Imported {
            tensor: Arc::new(t),
            copied: Some(why),
        })
    }
}

/// Exports a value for `device`: a host tensor as it is (no copy), a value of a CUDA executable
/// copied into device memory on that device ([`cuda::export_to_device`]).
pub fn export_for(t: HostTensor, device: Device, legacy: bool) -> Result<DlpackTensor> {
    match device {
        Device::Cuda(i) => Ok(cuda::export_to_device(&t, i, legacy)?.tensor),
        Device::Cpu | Device::Auto => {
            let t = Arc::new(t);
            Ok(if legacy {
                DlpackTensor::from_host_legacy(t)
            } else {
                DlpackTensor::from_host(t)
            })
        }
    }
}

/// What [`Executable::run_dlpack`] returns.
#[derive(Debug)]
pub struct DlpackOutputs {
    /// `(name, tensor)` in output order, exported by [`export_for`] the executable's device.
    pub outputs: Vec<(String, DlpackTensor)>,
    /// Inputs that were copied: `(name, reason)`.
    pub copied: Vec<(String, String)>,
    /// As [`crate::Outputs::skipped`].
    pub skipped: Option<String>,
}

impl Executable {
    /// Runs on DLPack inputs by name and exports the results as DLPack ≥ 1.0 tensors for the
    /// executable's device. A CUDA executable whose inputs are all compact CUDA tensors of its
    /// device reads them in place and hands its outputs over in pool blocks of their own
    /// ([`Executable::run_dlpack_cuda`]); otherwise inputs become host tensors
    /// ([`DlpackTensor::into_host`]: host memory viewed in place where its layout allows, the
    /// rest copied) and results on CUDA are copied into device memory. Copies are reported.
    pub fn run_dlpack(&mut self, inputs: Vec<(&str, DlpackTensor)>) -> Result<DlpackOutputs> {
        if let Device::Cuda(ordinal) = self.device() {
            let mut in_place = true;
            for (_, t) in &inputs {
                in_place &= cuda::device_input(t, ordinal)?.is_ok();
            }
            if in_place && !inputs.is_empty() {
                let refs: Vec<(&str, &DlpackTensor)> =
                    inputs.iter().map(|(n, t)| (*n, t)).collect();
                let r = self.run_dlpack_cuda(&refs)?;
                return Ok(DlpackOutputs {
                    outputs: r.outputs.into_iter().map(|(n, e)| (n, e.tensor)).collect(),
                    copied: r.copied,
                    skipped: r.skipped,
                });
            }
        }
        let mut copied = Vec::new();
        let mut shared = Vec::with_capacity(inputs.len());
        for (name, t) in inputs {
            let im = t.into_host()?;
            if let Some(why) = im.copied {
                copied.push((name.to_string(), why));
            }
            shared.push((name, im.tensor));
        }
        let out = self.run_shared(&shared)?;
        let device = self.device();
        let skipped = out.skipped.clone();
        let names = out.names().to_vec();
        let outputs = names
            .into_iter()
            .zip(out.into_vec())
            .map(|(n, t)| Ok((n, export_for(t, device, false)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(DlpackOutputs {
            outputs,
            copied,
            skipped,
        })
    }

    /// A parameter or state tensor as a DLPack ≥ 1.0 tensor on the executable's device (a copy
    /// of the session's current value).
    pub fn param_dlpack(&self, name: &str) -> Result<DlpackTensor> {
        if !self.param_types().iter().any(|(n, _)| *n == name) {
            return Err(Error::Input {
                name: name.into(),
                reason: "no such parameter".into(),
            });
        }
        let t = self.param(name).ok_or_else(|| Error::Input {
            name: name.into(),
            reason: "the device could not copy it back".into(),
        })?;
        export_for(t, self.device(), false)
    }

    /// Replaces a parameter or state tensor with a DLPack tensor's elements (its type must
    /// match; the session keeps a copy of its own, never a view of the producer's memory).
    pub fn set_param_dlpack(&mut self, name: &str, value: DlpackTensor) -> Result<()> {
        let t = value.into_host()?.tensor;
        self.set_param(name, Arc::unwrap_or_clone(t).into_owned())
    }
}

impl Drop for DlpackTensor {
    fn drop(&mut self) {
        match self.raw {
            RawManaged::Versioned(p) => {
                // SAFETY: `self` owns the live managed tensor; its deleter runs once, here.
                if let Some(d) = unsafe { p.as_ref() }.deleter {
                    // SAFETY: as above.
                    unsafe { d(p.as_ptr()) }
                }
            }
            RawManaged::Legacy(p) => {
                // SAFETY: as above.
                if let Some(d) = unsafe { p.as_ref() }.deleter {
                    // SAFETY: as above.
                    unsafe { d(p.as_ptr()) }
                }
            }
        }
    }
}

/// Copies the strided elements of `ty` from `base` into a compact host tensor.
///
/// # Safety
///
/// Every element `base + Σ idx[d]·strides[d]·size` for in-range indices must be readable.
pub(crate) unsafe fn gather(
    base: *const u8,
    ty: &TensorType,
    strides: &[i64],
) -> Result<HostTensor> {
    fn typed<T: HostElement>(
        base: *const u8,
        dims: &[usize],
        strides: &[i64],
        read: impl Fn(*const u8) -> T,
    ) -> Data {
        let n: usize = dims.iter().product();
        let size = std::mem::size_of::<T>() as isize;
        let contiguous = strides == contiguous_strides(dims).as_slice();
        let mut out = Vec::with_capacity(n);
        if contiguous {
            for i in 0..n as isize {
                // SAFETY: the caller's contract covers these elements.
                out.push(read(unsafe { base.offset(i * size) }));
            }
            return T::wrap(out);
        }
        let mut idx = vec![0usize; dims.len()];
        let mut off = 0isize;
        for _ in 0..n {
            // SAFETY: `off` is the offset of the current in-range index.
            out.push(read(unsafe { base.offset(off * size) }));
            for d in (0..dims.len()).rev() {
                idx[d] += 1;
                off += strides[d] as isize;
                if idx[d] < dims[d] {
                    break;
                }
                off -= strides[d] as isize * dims[d] as isize;
                idx[d] = 0;
            }
        }
        T::wrap(out)
    }
    fn rd<T: Copy>(p: *const u8) -> T {
        // SAFETY: callers pass a readable element address; the read is unaligned-safe and `T`
        // is a plain number type for which every bit pattern is valid.
        unsafe { p.cast::<T>().read_unaligned() }
    }
    let dims = ty.shape.dims();
    let data = match ty.dtype {
        DType::F32 => typed(base, dims, strides, rd::<f32>),
        DType::F64 => typed(base, dims, strides, rd::<f64>),
        DType::F16 => typed(base, dims, strides, rd::<half::f16>),
        DType::BF16 => typed(base, dims, strides, rd::<half::bf16>),
        DType::I32 => typed(base, dims, strides, rd::<i32>),
        DType::I64 => typed(base, dims, strides, rd::<i64>),
        DType::U8 => typed(base, dims, strides, rd::<u8>),
        DType::Bool => typed(base, dims, strides, |p| rd::<u8>(p) != 0),
        DType::I8 => typed(base, dims, strides, rd::<i8>),
        DType::I16 => typed(base, dims, strides, rd::<i16>),
        DType::U16 => typed(base, dims, strides, rd::<u16>),
        DType::U32 => typed(base, dims, strides, rd::<u32>),
        DType::U64 => typed(base, dims, strides, rd::<u64>),
    };
    Ok(HostTensor::from_data(data, ty.shape.clone())?)
}
