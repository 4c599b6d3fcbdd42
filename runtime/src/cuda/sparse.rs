//! cuSPARSE through cudarc's sys layer (cudarc has no safe wrapper for it): the SpMM steps of
//! plans, and sparse matrices on the device ([`DeviceCsr`]) with SpGEMM (`C = A·B`, CSR × CSR →
//! CSR, the result's size known only once cuSPARSE has counted it) and transposition.
//!
//! SpGEMM runs cuSPARSE's multi-phase protocol: work estimation, compute, size query, set
//! pointers, copy. Its buffers come from the memory pool; when they do not fit, the next
//! algorithm is tried (ALG1, then ALG2 and ALG3, which need less memory, ALG3 computing in
//! chunks). cuSPARSE's SpGEMM takes 32-bit indices and f32/f64 values, so other index and value
//! types are converted on the device with generated cast kernels around the call.

use super::session::{dtoh, htod};
use super::GpuDevice;
use crate::pool::Block;
use crate::{Result, RuntimeError};
use cudarc::cusparse::sys as sp;
use cudarc::driver::result as dr;
use cudarc::driver::sys::CUstream;
use rustytorch_codegen::cuda::{ir, lower_step, source, ArgRef, CudaStep, SpmmDesc};
use rustytorch_ops::{
    CooMatrix, CsrMatrix, DType, Data, HostTensor, Op, OpError, Shape, TensorType,
};
use std::ffi::c_void;
use std::sync::Arc;

/// A cuSPARSE status as a runtime error naming the call.
fn check(what: &str, st: sp::cusparseStatus_t) -> Result<()> {
    if st == sp::cusparseStatus_t::CUSPARSE_STATUS_SUCCESS {
        return Ok(());
    }
    // SAFETY: cuSPARSE returns a static NUL-terminated string for every status.
    let msg = unsafe {
        let p = sp::cusparseGetErrorString(st);
        if p.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    Err(RuntimeError::Device(format!(
        "cuSPARSE {what}: {st:?} ({msg})"
    )))
}

fn value_type(d: DType) -> Result<sp::cudaDataType> {
    Ok(match d {
        DType::F32 => sp::cudaDataType::CUDA_R_32F,
        DType::F64 => sp::cudaDataType::CUDA_R_64F,
        DType::F16 => sp::cudaDataType::CUDA_R_16F,
        DType::BF16 => sp::cudaDataType::CUDA_R_16BF,
        d => {
            return Err(RuntimeError::Invalid(format!(
                "cuSPARSE: values of {d} are not supported (f32, f64, f16, bf16)"
            )))
        }
    })
}

fn index_type(d: DType) -> Result<sp::cusparseIndexType_t> {
    Ok(match d {
        DType::I32 => sp::cusparseIndexType_t::CUSPARSE_INDEX_32I,
        DType::I64 => sp::cusparseIndexType_t::CUSPARSE_INDEX_64I,
        d => {
            return Err(RuntimeError::Invalid(format!(
                "cuSPARSE: indices of {d} are not supported (i32, i64)"
            )))
        }
    })
}

/// The scalar cuSPARSE computes in for values of `d`, and 1 and 0 in it (host memory).
enum Scalars {
    F32([f32; 2]),
    F64([f64; 2]),
}

impl Scalars {
    fn of(d: DType) -> Scalars {
        if d == DType::F64 {
            Scalars::F64([1.0, 0.0])
        } else {
            Scalars::F32([1.0, 0.0])
        }
    }
    fn compute(&self) -> sp::cudaDataType {
        match self {
            Scalars::F32(_) => sp::cudaDataType::CUDA_R_32F,
            Scalars::F64(_) => sp::cudaDataType::CUDA_R_64F,
        }
    }
    fn one(&self) -> *const c_void {
        match self {
            Scalars::F32(v) => &v[0] as *const f32 as *const c_void,
            Scalars::F64(v) => &v[0] as *const f64 as *const c_void,
        }
    }
    fn zero(&self) -> *const c_void {
        match self {
            Scalars::F32(v) => &v[1] as *const f32 as *const c_void,
            Scalars::F64(v) => &v[1] as *const f64 as *const c_void,
        }
    }
}

/// A device's cuSPARSE handle.
pub struct Sparse {
    handle: sp::cusparseHandle_t,
}

// SAFETY: the handle is used by one thread at a time (behind the device's mutex) after binding
// the device's context, and destroyed once.
unsafe impl Send for Sparse {}

impl Sparse {
    /// Opens cuSPARSE: a clear error when the library is not installed.
    pub fn new() -> Result<Sparse> {
        // SAFETY: only tries to load the shared library.
        if !unsafe { sp::is_culib_present() } {
            return Err(RuntimeError::Device(
                "cuSPARSE (libcusparse) was not found: install the CUDA toolkit's cuSPARSE \
                 (for example the nvidia-cusparse package) or add its folder to \
                 LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let handle = cudarc::cusparse::result::create()
            .map_err(|e| RuntimeError::Device(format!("cuSPARSE create: {:?}", e.0)))?;
        Ok(Sparse { handle })
    }

    fn on(&self, stream: CUstream) -> Result<sp::cusparseHandle_t> {
        // SAFETY: the handle is live; the stream belongs to the bound context.
        check("set stream", unsafe {
            sp::cusparseSetStream(self.handle, stream as sp::cudaStream_t)
        })?;
        Ok(self.handle)
    }
}

impl Drop for Sparse {
    fn drop(&mut self) {
        // SAFETY: created once in `new`, destroyed once here.
        let _ = unsafe { cudarc::cusparse::result::destroy(self.handle) };
    }
}

/// A CSR matrix descriptor, destroyed on drop.
struct SpMat(sp::cusparseSpMatDescr_t);

impl SpMat {
    /// Describes `rows × cols` with `nnz` entries at the given device addresses.
    #[allow(clippy::too_many_arguments)]
    fn csr(
        rows: usize,
        cols: usize,
        nnz: usize,
        row_ptr: u64,
        col_idx: u64,
        values: u64,
        index: DType,
        dtype: DType,
    ) -> Result<SpMat> {
        let it = index_type(index)?;
        let mut d: sp::cusparseSpMatDescr_t = std::ptr::null_mut();
        // SAFETY: the pointers address live device buffers of the described sizes (or are
        // null with nnz 0); cuSPARSE stores them without reading.
        check("create CSR", unsafe {
            sp::cusparseCreateCsr(
                &mut d,
                rows as i64,
                cols as i64,
                nnz as i64,
                row_ptr as *mut c_void,
                col_idx as *mut c_void,
                values as *mut c_void,
                it,
                it,
                sp::cusparseIndexBase_t::CUSPARSE_INDEX_BASE_ZERO,
                value_type(dtype)?,
            )
        })?;
        Ok(SpMat(d))
    }
}

impl Drop for SpMat {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        let _ = unsafe { sp::cusparseDestroySpMat(self.0) };
    }
}

/// A dense row-major matrix descriptor, destroyed on drop.
struct DnMat(sp::cusparseDnMatDescr_t);

impl DnMat {
    fn row_major(rows: usize, cols: usize, ptr: u64, dtype: DType) -> Result<DnMat> {
        let mut d: sp::cusparseDnMatDescr_t = std::ptr::null_mut();
        // SAFETY: `ptr` addresses a live buffer of rows × cols elements.
        check("create dense matrix", unsafe {
            sp::cusparseCreateDnMat(
                &mut d,
                rows as i64,
                cols as i64,
                cols.max(1) as i64,
                ptr as *mut c_void,
                value_type(dtype)?,
                sp::cusparseOrder_t::CUSPARSE_ORDER_ROW,
            )
        })?;
        Ok(DnMat(d))
    }
}

impl Drop for DnMat {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        let _ = unsafe { sp::cusparseDestroyDnMat(self.0) };
    }
}

/// A prepared SpMM step: descriptors over the step's resolved buffers (made once, at prepare).
pub(crate) struct SpmmCall {
    desc: SpmmDesc,
    a: Option<SpMat>,
    x: Option<DnMat>,
    y: Option<DnMat>,
    out: u64,
    scalars: Scalars,
    /// Workspace bytes cuSPARSE asked for (in the session's scratch).
    pub(crate) buffer: usize,
}

// SAFETY: plain cuSPARSE descriptors owned by one session, used through it one thread at a time.
unsafe impl Send for SpmmCall {}

const SPMM_ALG: sp::cusparseSpMMAlg_t = sp::cusparseSpMMAlg_t::CUSPARSE_SPMM_ALG_DEFAULT;

fn op_a(desc: &SpmmDesc) -> sp::cusparseOperation_t {
    if desc.trans_a {
        sp::cusparseOperation_t::CUSPARSE_OPERATION_TRANSPOSE
    } else {
        sp::cusparseOperation_t::CUSPARSE_OPERATION_NON_TRANSPOSE
    }
}

impl Sparse {
    /// Describes an SpMM over operands `ins` (row_ptr, col_idx, values, x) and result `out`, and
    /// asks cuSPARSE for its workspace size.
    pub(crate) fn prepare_spmm(
        &mut self,
        desc: &SpmmDesc,
        ins: &[u64],
        out: u64,
        stream: CUstream,
    ) -> Result<SpmmCall> {
        let scalars = Scalars::of(desc.dtype);
        let mut call = SpmmCall {
            desc: desc.clone(),
            a: None,
            x: None,
            y: None,
            out,
            scalars,
            buffer: 0,
        };
        if desc.is_empty() {
            return Ok(call);
        }
        let inner = if desc.trans_a { desc.rows } else { desc.cols };
        let a = SpMat::csr(
            desc.rows, desc.cols, desc.nnz, ins[0], ins[1], ins[2], desc.index, desc.dtype,
        )?;
        let x = DnMat::row_major(inner, desc.n, ins[3], desc.dtype)?;
        let y = DnMat::row_major(desc.out_rows(), desc.n, out, desc.dtype)?;
        let h = self.on(stream)?;
        let mut bytes = 0usize;
        // SAFETY: live handle and descriptors; the scalars are host values of the compute type.
        check("SpMM buffer size", unsafe {
            sp::cusparseSpMM_bufferSize(
                h,
                op_a(desc),
                sp::cusparseOperation_t::CUSPARSE_OPERATION_NON_TRANSPOSE,
                call.scalars.one(),
                a.0,
                x.0,
                call.scalars.zero(),
                y.0,
                call.scalars.compute(),
                SPMM_ALG,
                &mut bytes,
            )
        })?;
        call.buffer = bytes;
        call.a = Some(a);
        call.x = Some(x);
        call.y = Some(y);
        Ok(call)
    }

    /// Enqueues a prepared SpMM on `stream` with its workspace at `buffer`.
    pub(crate) fn spmm(&mut self, call: &SpmmCall, buffer: u64, stream: CUstream) -> Result<()> {
        let (Some(a), Some(x), Some(y)) = (&call.a, &call.x, &call.y) else {
            // An empty product: zeros.
            let bytes = call.desc.out_rows() * call.desc.n * call.desc.dtype.size_bytes();
            if bytes > 0 {
                // SAFETY: `out` is the step's live result buffer of `bytes` bytes.
                unsafe { dr::memset_d8_async(call.out, 0, bytes, stream) }
                    .map_err(|e| RuntimeError::Device(format!("clearing a result: {e}")))?;
            }
            return Ok(());
        };
        let h = self.on(stream)?;
        // SAFETY: the descriptors address the session's live buffers, the workspace holds the
        // bytes cuSPARSE asked for, and the call is ordered on `stream`.
        check("SpMM", unsafe {
            sp::cusparseSpMM(
                h,
                op_a(&call.desc),
                sp::cusparseOperation_t::CUSPARSE_OPERATION_NON_TRANSPOSE,
                call.scalars.one(),
                a.0,
                x.0,
                call.scalars.zero(),
                y.0,
                call.scalars.compute(),
                SPMM_ALG,
                buffer as *mut c_void,
            )
        })
    }
}

/// A CSR matrix in device memory: row pointers, column indices (sorted within each row, i32 or
/// i64) and values (f32, f64, f16 or bf16), in buffers from the device's memory pool.
pub struct DeviceCsr {
    dev: Arc<GpuDevice>,
    rows: usize,
    cols: usize,
    nnz: usize,
    index: DType,
    dtype: DType,
    row_ptr: Option<Block>,
    col_idx: Option<Block>,
    values: Option<Block>,
}

impl std::fmt::Debug for DeviceCsr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceCsr({}×{}, nnz {}, {}/{}, cuda:{})",
            self.rows, self.cols, self.nnz, self.index, self.dtype, self.dev.ordinal
        )
    }
}

impl Drop for DeviceCsr {
    fn drop(&mut self) {
        for b in [self.row_ptr.take(), self.col_idx.take(), self.values.take()]
            .into_iter()
            .flatten()
        {
            self.dev.free(b);
        }
    }
}

fn addr(b: &Option<Block>) -> u64 {
    b.as_ref().map_or(0, |b| b.addr)
}

impl DeviceCsr {
    /// Copies a host CSR matrix to CUDA device `ordinal`.
    pub fn upload(ordinal: usize, m: &CsrMatrix) -> Result<DeviceCsr> {
        let dev = GpuDevice::get(ordinal)?;
        dev.bind()?;
        let stream = dev.stream.cu_stream();
        let out = DeviceCsr::alloc(
            &dev,
            m.rows(),
            m.cols(),
            m.nnz(),
            m.index_dtype(),
            m.dtype(),
        )?;
        htod(addr(&out.row_ptr), m.row_ptr(), stream)?;
        htod(addr(&out.col_idx), m.col_idx(), stream)?;
        htod(addr(&out.values), m.values(), stream)?;
        dev.sync()?;
        Ok(out)
    }

    /// Buffers for a `rows × cols` matrix of `nnz` entries (contents undefined).
    fn alloc(
        dev: &Arc<GpuDevice>,
        rows: usize,
        cols: usize,
        nnz: usize,
        index: DType,
        dtype: DType,
    ) -> Result<DeviceCsr> {
        let mut m = DeviceCsr {
            dev: dev.clone(),
            rows,
            cols,
            nnz,
            index,
            dtype,
            row_ptr: None,
            col_idx: None,
            values: None,
        };
        m.row_ptr = Some(dev.alloc((rows + 1) * index.size_bytes())?);
        m.col_idx = Some(dev.alloc(nnz * index.size_bytes())?);
        m.values = Some(dev.alloc(nnz * dtype.size_bytes())?);
        Ok(m)
    }

    /// Copies the matrix back to the host (checked like any untrusted CSR data).
    pub fn to_host(&self) -> Result<CsrMatrix> {
        self.dev.bind()?;
        let stream = self.dev.stream.cu_stream();
        let t = |b: &Option<Block>, n: usize, d: DType| {
            dtoh(addr(b), &TensorType::new(d, Shape::new(vec![n])), stream)
        };
        let rp = t(&self.row_ptr, self.rows + 1, self.index)?;
        let ci = t(&self.col_idx, self.nnz, self.index)?;
        let v = t(&self.values, self.nnz, self.dtype)?;
        self.dev.sync()?;
        let bad = |e: OpError| RuntimeError::Invalid(format!("device CSR result: {e}"));
        match CsrMatrix::new(self.rows, self.cols, rp.clone(), ci.clone(), v.clone()) {
            Ok(m) => Ok(m),
            // Unsorted columns within a row: sort through COO (rows expanded from row_ptr).
            Err(_) => {
                let rp64 = rp.to_f64_vec();
                let mut rows = Vec::with_capacity(self.nnz);
                for r in 0..self.rows {
                    for _ in rp64[r] as usize..rp64[r + 1] as usize {
                        rows.push(r as i64);
                    }
                }
                let ri = HostTensor::from_data(Data::I64(rows.into()), Shape::new(vec![self.nnz]))
                    .map_err(bad)?
                    .cast(self.index);
                CooMatrix::new(self.rows, self.cols, ri, ci, v)
                    .and_then(|c| c.to_csr())
                    .map_err(bad)
            }
        }
    }

    /// A cuSPARSE descriptor over this matrix's buffers.
    fn descriptor(&self) -> Result<SpMat> {
        SpMat::csr(
            self.rows,
            self.cols,
            self.nnz,
            addr(&self.row_ptr),
            addr(&self.col_idx),
            addr(&self.values),
            self.index,
            self.dtype,
        )
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Stored entries.
    pub fn nnz(&self) -> usize {
        self.nnz
    }
    /// Index type.
    pub fn index_dtype(&self) -> DType {
        self.index
    }
    /// Value type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The device ordinal.
    pub fn device(&self) -> usize {
        self.dev.ordinal
    }

    /// This matrix with other index and value types (converted on the device).
    pub fn to_types(&self, index: DType, dtype: DType) -> Result<DeviceCsr> {
        let out = DeviceCsr::alloc(&self.dev, self.rows, self.cols, self.nnz, index, dtype)?;
        let stream = self.dev.stream.cu_stream();
        let dev = &self.dev;
        let (rp, ci, v) = (&self.row_ptr, &self.col_idx, &self.values);
        let n = self.rows + 1;
        cast(
            dev,
            addr(rp),
            self.index,
            addr(&out.row_ptr),
            index,
            n,
            stream,
        )?;
        let n = self.nnz;
        cast(
            dev,
            addr(ci),
            self.index,
            addr(&out.col_idx),
            index,
            n,
            stream,
        )?;
        cast(
            dev,
            addr(v),
            self.dtype,
            addr(&out.values),
            dtype,
            n,
            stream,
        )?;
        Ok(out)
    }

    /// The form cuSPARSE's SpGEMM and conversions take: i32 indices, f32 or f64 values.
    fn compute_form(&self) -> Result<Option<DeviceCsr>> {
        let dt = if self.dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        if self.index == DType::I32 && self.dtype == dt {
            return Ok(None);
        }
        if self.nnz > i32::MAX as usize
            || self.rows >= i32::MAX as usize
            || self.cols >= i32::MAX as usize
        {
            return Err(RuntimeError::Invalid(format!(
                "cuSPARSE SpGEMM takes 32-bit indices: a {}×{} matrix of {} entries does not fit",
                self.rows, self.cols, self.nnz
            )));
        }
        self.to_types(DType::I32, dt).map(Some)
    }

    /// `Aᵀ` on the device (cuSPARSE's CSR → CSC conversion: the CSC of A is the CSR of Aᵀ).
    pub fn transpose(&self) -> Result<DeviceCsr> {
        self.dev.bind()?;
        let conv = self.compute_form()?;
        let a = conv.as_ref().unwrap_or(self);
        let out = DeviceCsr::alloc(&self.dev, self.cols, self.rows, self.nnz, a.index, a.dtype)?;
        let stream = self.dev.stream.cu_stream();
        if self.nnz == 0 || self.rows == 0 || self.cols == 0 {
            zero(&out.row_ptr, (self.cols + 1) * a.index.size_bytes(), stream)?;
        } else {
            let vt = value_type(a.dtype)?;
            let alg = sp::cusparseCsr2CscAlg_t::CUSPARSE_CSR2CSC_ALG1;
            let act = sp::cusparseAction_t::CUSPARSE_ACTION_NUMERIC;
            let base = sp::cusparseIndexBase_t::CUSPARSE_INDEX_BASE_ZERO;
            self.dev.with_sparse(|s| {
                let h = s.on(stream)?;
                let (m, n, nnz) = (a.rows as i32, a.cols as i32, a.nnz as i32);
                // Both calls take the same arguments but the last.
                macro_rules! conv {
                    ($f:ident, $last:expr) => {
                        sp::$f(
                            h,
                            m,
                            n,
                            nnz,
                            addr(&a.values) as *const c_void,
                            addr(&a.row_ptr) as *const i32,
                            addr(&a.col_idx) as *const i32,
                            addr(&out.values) as *mut c_void,
                            addr(&out.row_ptr) as *mut i32,
                            addr(&out.col_idx) as *mut i32,
                            vt,
                            act,
                            base,
                            alg,
                            $last,
                        )
                    };
                }
                let mut bytes = 0usize;
                // SAFETY: every pointer addresses a live buffer of the size the call implies
                // (i32 indices, values of `a.dtype`).
                check("csr2csc buffer size", unsafe {
                    conv!(cusparseCsr2cscEx2_bufferSize, &mut bytes)
                })?;
                let buf = self.dev.alloc(bytes)?;
                // SAFETY: as above, with a workspace of the size asked for.
                let r = check("csr2csc", unsafe {
                    conv!(cusparseCsr2cscEx2, buf.addr as *mut c_void)
                });
                self.dev.free(buf);
                r
            })?;
        }
        let out = if (out.index, out.dtype) != (self.index, self.dtype) {
            out.to_types(self.index, self.dtype)?
        } else {
            out
        };
        self.dev.sync()?;
        Ok(out)
    }

    /// `self · other` (SpGEMM) on the device: a CSR result of the inputs' index and value types.
    /// f16/bf16 values are multiplied in f32 and rounded once.
    pub fn matmul(&self, other: &DeviceCsr) -> Result<DeviceCsr> {
        if self.cols != other.rows
            || self.index != other.index
            || self.dtype != other.dtype
            || self.dev.ordinal != other.dev.ordinal
        {
            return Err(RuntimeError::Invalid(format!(
                "spgemm: {self:?} · {other:?} (columns must equal rows, one index type, one \
                 value type, one device)"
            )));
        }
        let dev = &self.dev;
        dev.bind()?;
        let stream = dev.stream.cu_stream();
        let (m, n) = (self.rows, other.cols);
        if self.nnz == 0 || other.nnz == 0 || m == 0 || n == 0 || self.cols == 0 {
            let out = DeviceCsr::alloc(dev, m, n, 0, self.index, self.dtype)?;
            zero(&out.row_ptr, (m + 1) * self.index.size_bytes(), stream)?;
            dev.sync()?;
            return Ok(out);
        }
        let (ca, cb) = (self.compute_form()?, other.compute_form()?);
        let (a, b) = (ca.as_ref().unwrap_or(self), cb.as_ref().unwrap_or(other));
        let c = dev.with_sparse(|s| s.spgemm(dev, a, b, stream))?;
        let c = if (c.index, c.dtype) != (self.index, self.dtype) {
            c.to_types(self.index, self.dtype)?
        } else {
            c
        };
        dev.sync()?;
        Ok(c)
    }
}

/// Clears `bytes` bytes of a block.
fn zero(b: &Option<Block>, bytes: usize, stream: CUstream) -> Result<()> {
    zero_at(addr(b), bytes, stream)
}

/// Clears `bytes` bytes at `at`, the address of a live block of at least that many bytes.
fn zero_at(at: u64, bytes: usize, stream: CUstream) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's block is live and holds at least `bytes` bytes.
    unsafe { dr::memset_d8_async(at, 0, bytes, stream) }
        .map_err(|e| RuntimeError::Device(format!("clearing a buffer: {e}")))
}

/// Converts `n` elements of `from` at `src` to `to` at `dst` with a generated cast kernel.
fn cast(
    dev: &Arc<GpuDevice>,
    src: u64,
    from: DType,
    dst: u64,
    to: DType,
    n: usize,
    stream: CUstream,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    if from == to {
        // SAFETY: both blocks are live and hold n elements of the type.
        return unsafe { dr::memcpy_dtod_async(dst, src, n * to.size_bytes(), stream) }
            .map_err(|e| RuntimeError::Device(format!("copying on the device: {e}")));
    }
    let shape = Shape::new(vec![n]);
    let (ti, to_ty) = (
        TensorType::new(from, shape.clone()),
        TensorType::new(to, shape),
    );
    let CudaStep::Kernels(k) = lower_step(&Op::Cast { to }, &[&ti], &to_ty)? else {
        return Err(RuntimeError::Invalid("a cast lowered to no kernels".into()));
    };
    let sources = k
        .launches
        .iter()
        .map(|l| Ok((l.kernel.name.clone(), source(&l.kernel)?)))
        .collect::<Result<Vec<_>>>()?;
    let funcs = dev.functions(&sources)?;
    for (l, f) in k.launches.iter().zip(funcs) {
        let args: Vec<u64> = l
            .args
            .iter()
            .map(|a| match a {
                ArgRef::Input(_) => src,
                _ => dst,
            })
            .collect();
        // SAFETY: the cast kernel's parameters are its input and output pointers, both live
        // buffers of n elements of their types.
        unsafe { super::launch_pointers(&f, l.grid, l.kernel.block, l.kernel.smem, &args, stream) }
            .map_err(|e| RuntimeError::Device(format!("cast kernel: {e}")))?;
    }
    Ok(())
}

/// SpGEMM algorithms in the order tried: the fastest first, then the ones that need less memory.
const SPGEMM_ALGS: [sp::cusparseSpGEMMAlg_t; 3] = [
    sp::cusparseSpGEMMAlg_t::CUSPARSE_SPGEMM_ALG1,
    sp::cusparseSpGEMMAlg_t::CUSPARSE_SPGEMM_ALG2,
    sp::cusparseSpGEMMAlg_t::CUSPARSE_SPGEMM_ALG3,
];

/// The fraction of the intermediate products ALG3 processes per chunk.
const ALG3_CHUNK: f32 = 0.2;

/// An SpGEMM descriptor, destroyed on drop.
struct SpGemmDescr(sp::cusparseSpGEMMDescr_t);

impl Drop for SpGemmDescr {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        let _ = unsafe { sp::cusparseSpGEMM_destroyDescr(self.0) };
    }
}

/// Pool blocks returned when dropped.
struct Scratch<'a> {
    dev: &'a GpuDevice,
    blocks: Vec<Block>,
}

impl Scratch<'_> {
    fn alloc(&mut self, bytes: usize) -> Result<u64> {
        let b = self.dev.alloc(bytes)?;
        let a = b.addr;
        self.blocks.push(b);
        Ok(a)
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        for b in self.blocks.drain(..) {
            self.dev.free(b);
        }
    }
}

/// Whether an error means "not enough memory" (then a leaner algorithm is tried).
fn short_of_memory(e: &RuntimeError) -> bool {
    match e {
        RuntimeError::OutOfMemory { .. } => true,
        RuntimeError::Device(m) => {
            m.contains("INSUFFICIENT_RESOURCES") || m.contains("ALLOC_FAILED")
        }
        _ => false,
    }
}

impl Sparse {
    /// `a · b` for matrices in the compute form (i32 indices, f32/f64 values), neither empty.
    fn spgemm(
        &mut self,
        dev: &Arc<GpuDevice>,
        a: &DeviceCsr,
        b: &DeviceCsr,
        stream: CUstream,
    ) -> Result<DeviceCsr> {
        let mut last = None;
        for alg in SPGEMM_ALGS {
            match self.spgemm_with(dev, a, b, alg, stream) {
                Ok(c) => return Ok(c),
                Err(e) if short_of_memory(&e) => {
                    tracing::info!("SpGEMM {alg:?} is short of memory ({e}); trying the next");
                    last = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.expect("at least one algorithm was tried"))
    }

    fn spgemm_with(
        &mut self,
        dev: &Arc<GpuDevice>,
        a: &DeviceCsr,
        b: &DeviceCsr,
        alg: sp::cusparseSpGEMMAlg_t,
        stream: CUstream,
    ) -> Result<DeviceCsr> {
        let h = self.on(stream)?;
        let (m, n) = (a.rows, b.cols);
        let sc = Scalars::of(a.dtype);
        let none = sp::cusparseOperation_t::CUSPARSE_OPERATION_NON_TRANSPOSE;
        let (ma, mb) = (a.descriptor()?, b.descriptor()?);
        // C's row offsets must exist before the work estimation; its other arrays follow the
        // size query.
        let mut c = DeviceCsr {
            dev: dev.clone(),
            rows: m,
            cols: n,
            nnz: 0,
            index: a.index,
            dtype: a.dtype,
            row_ptr: Some(dev.alloc((m + 1) * a.index.size_bytes())?),
            col_idx: None,
            values: None,
        };
        let mc = SpMat::csr(m, n, 0, addr(&c.row_ptr), 0, 0, a.index, a.dtype)?;
        let mut d: sp::cusparseSpGEMMDescr_t = std::ptr::null_mut();
        // SAFETY: writes a fresh descriptor.
        check("SpGEMM descriptor", unsafe {
            sp::cusparseSpGEMM_createDescr(&mut d)
        })?;
        let d = SpGemmDescr(d);
        let mut bufs = Scratch {
            dev,
            blocks: vec![],
        };
        let ct = sc.compute();
        // The phases' calls share their first eleven arguments.
        macro_rules! phase {
            ($f:ident $(, $rest:expr)*) => {
                sp::$f(h, none, none, sc.one(), ma.0, mb.0, sc.zero(), mc.0, ct, alg, d.0 $(, $rest)*)
            };
        }
        let null = std::ptr::null_mut::<c_void>;
        // Each phase: the size query (null buffer), then the call with a buffer of that size.
        // SAFETY (every call below): live handle and descriptors over live buffers; host
        // scalars of the compute type; each buffer holds the bytes the size query returned and
        // stays allocated (in `bufs`) until the copy has been enqueued.
        let mut bs1 = 0usize;
        // SAFETY: see above.
        check("SpGEMM work estimation", unsafe {
            phase!(cusparseSpGEMM_workEstimation, &mut bs1, null())
        })?;
        let b1 = bufs.alloc(bs1)? as *mut c_void;
        // SAFETY: see above.
        check("SpGEMM work estimation", unsafe {
            phase!(cusparseSpGEMM_workEstimation, &mut bs1, b1)
        })?;
        let mut bs2 = 0usize;
        if alg == sp::cusparseSpGEMMAlg_t::CUSPARSE_SPGEMM_ALG1 {
            // SAFETY: see above.
            check("SpGEMM compute", unsafe {
                phase!(cusparseSpGEMM_compute, &mut bs2, null())
            })?;
        } else {
            let mut bs3 = 0usize;
            // SAFETY: see above.
            check("SpGEMM memory estimate", unsafe {
                phase!(
                    cusparseSpGEMM_estimateMemory,
                    ALG3_CHUNK,
                    &mut bs3,
                    null(),
                    std::ptr::null_mut()
                )
            })?;
            let b3 = bufs.alloc(bs3)? as *mut c_void;
            // SAFETY: see above.
            check("SpGEMM memory estimate", unsafe {
                phase!(
                    cusparseSpGEMM_estimateMemory,
                    ALG3_CHUNK,
                    &mut bs3,
                    b3,
                    &mut bs2
                )
            })?;
        }
        let b2 = bufs.alloc(bs2)? as *mut c_void;
        // SAFETY: see above.
        check("SpGEMM compute", unsafe {
            phase!(cusparseSpGEMM_compute, &mut bs2, b2)
        })?;
        let (mut r, mut cc, mut nnz) = (0i64, 0i64, 0i64);
        // SAFETY: see the note before the first phase above.
        check("SpGEMM size", unsafe {
            sp::cusparseSpMatGetSize(mc.0, &mut r, &mut cc, &mut nnz)
        })?;
        let nnz = usize::try_from(nnz)
            .map_err(|_| RuntimeError::Device(format!("cuSPARSE SpGEMM reported {nnz} entries")))?;
        c.nnz = nnz;
        c.col_idx = Some(dev.alloc(nnz * a.index.size_bytes())?);
        c.values = Some(dev.alloc(nnz * a.dtype.size_bytes())?);
        // SAFETY: see the note before the first phase above.
        check("SpGEMM set pointers", unsafe {
            sp::cusparseCsrSetPointers(
                mc.0,
                addr(&c.row_ptr) as *mut c_void,
                addr(&c.col_idx) as *mut c_void,
                addr(&c.values) as *mut c_void,
            )
        })?;
        // SAFETY: see the note before the first phase above.
        check("SpGEMM copy", unsafe { phase!(cusparseSpGEMM_copy) })?;
        // The buffers return to the pool stream-ordered, after the copy.
        drop(bufs);
        Ok(c)
    }
}

// ---- COO matrices on the device ----

/// A COO matrix in device memory: row and column indices (i32 or i64, any order, repeats
/// allowed) and values (f32, f64, f16 or bf16), in buffers from the device's memory pool, like
/// [`DeviceCsr`]. Repeated entries add up when the matrix is compressed ([`DeviceCoo::to_csr`]),
/// as in [`CooMatrix::to_csr`].
pub struct DeviceCoo {
    dev: Arc<GpuDevice>,
    rows: usize,
    cols: usize,
    nnz: usize,
    index: DType,
    dtype: DType,
    row_idx: Option<Block>,
    col_idx: Option<Block>,
    values: Option<Block>,
}

impl std::fmt::Debug for DeviceCoo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceCoo({}×{}, nnz {}, {}/{}, cuda:{})",
            self.rows, self.cols, self.nnz, self.index, self.dtype, self.dev.ordinal
        )
    }
}

impl Drop for DeviceCoo {
    fn drop(&mut self) {
        for b in [self.row_idx.take(), self.col_idx.take(), self.values.take()]
            .into_iter()
            .flatten()
        {
            self.dev.free(b);
        }
    }
}

/// The error for a matrix that cuSPARSE's 32-bit conversions cannot take.
fn too_big_for_i32(what: &str, rows: usize, cols: usize, nnz: usize) -> Option<RuntimeError> {
    let lim = i32::MAX as usize;
    (nnz > lim || rows >= lim || cols >= lim).then(|| {
        RuntimeError::Invalid(format!(
            "{what}: cuSPARSE's conversions take 32-bit indices; a {rows}×{cols} matrix of {nnz} \
             entries does not fit them"
        ))
    })
}

impl DeviceCoo {
    /// Copies a host COO matrix (validated when it was made) to CUDA device `ordinal`, entries
    /// in their order, repeats kept.
    pub fn upload(ordinal: usize, m: &CooMatrix) -> Result<DeviceCoo> {
        let dev = GpuDevice::get(ordinal)?;
        dev.bind()?;
        let stream = dev.stream.cu_stream();
        let (r, c, n) = (m.rows(), m.cols(), m.nnz());
        let out = DeviceCoo::alloc(&dev, r, c, n, m.index_dtype(), m.dtype())?;
        htod(addr(&out.row_idx), m.row_idx(), stream)?;
        htod(addr(&out.col_idx), m.col_idx(), stream)?;
        htod(addr(&out.values), m.values(), stream)?;
        dev.sync()?;
        Ok(out)
    }

    /// Buffers for a `rows × cols` matrix of `nnz` entries (contents undefined).
    fn alloc(
        dev: &Arc<GpuDevice>,
        rows: usize,
        cols: usize,
        nnz: usize,
        index: DType,
        dtype: DType,
    ) -> Result<DeviceCoo> {
        let mut m = DeviceCoo {
            dev: dev.clone(),
            rows,
            cols,
            nnz,
            index,
            dtype,
            row_idx: None,
            col_idx: None,
            values: None,
        };
        m.row_idx = Some(dev.alloc(nnz * index.size_bytes())?);
        m.col_idx = Some(dev.alloc(nnz * index.size_bytes())?);
        m.values = Some(dev.alloc(nnz * dtype.size_bytes())?);
        Ok(m)
    }

    /// Copies the matrix back to the host (checked like any untrusted COO data).
    pub fn to_host(&self) -> Result<CooMatrix> {
        self.dev.bind()?;
        let stream = self.dev.stream.cu_stream();
        let t = |b: &Option<Block>, d: DType| {
            dtoh(
                addr(b),
                &TensorType::new(d, Shape::new(vec![self.nnz])),
                stream,
            )
        };
        let ri = t(&self.row_idx, self.index)?;
        let ci = t(&self.col_idx, self.index)?;
        let v = t(&self.values, self.dtype)?;
        self.dev.sync()?;
        CooMatrix::new(self.rows, self.cols, ri, ci, v)
            .map_err(|e| RuntimeError::Invalid(format!("device COO matrix: {e}")))
    }

    /// This matrix with other index and value types (converted on the device).
    pub fn to_types(&self, index: DType, dtype: DType) -> Result<DeviceCoo> {
        index_type(index)?;
        value_type(dtype)?;
        self.dev.bind()?;
        let out = DeviceCoo::alloc(&self.dev, self.rows, self.cols, self.nnz, index, dtype)?;
        let (dev, n, stream) = (&self.dev, self.nnz, self.dev.stream.cu_stream());
        let (ri, ci, v) = (&self.row_idx, &self.col_idx, &self.values);
        cast(
            dev,
            addr(ri),
            self.index,
            addr(&out.row_idx),
            index,
            n,
            stream,
        )?;
        cast(
            dev,
            addr(ci),
            self.index,
            addr(&out.col_idx),
            index,
            n,
            stream,
        )?;
        cast(
            dev,
            addr(v),
            self.dtype,
            addr(&out.values),
            dtype,
            n,
            stream,
        )?;
        dev.sync()?;
        Ok(out)
    }

    /// The transpose (row and column indices swapped, copied on the device).
    pub fn transpose(&self) -> Result<DeviceCoo> {
        self.dev.bind()?;
        let (dev, n, stream) = (&self.dev, self.nnz, self.dev.stream.cu_stream());
        let out = DeviceCoo::alloc(dev, self.cols, self.rows, n, self.index, self.dtype)?;
        let (i, d) = (self.index, self.dtype);
        cast(
            dev,
            addr(&self.col_idx),
            i,
            addr(&out.row_idx),
            i,
            n,
            stream,
        )?;
        cast(
            dev,
            addr(&self.row_idx),
            i,
            addr(&out.col_idx),
            i,
            n,
            stream,
        )?;
        cast(dev, addr(&self.values), d, addr(&out.values), d, n, stream)?;
        dev.sync()?;
        Ok(out)
    }

    /// The CSR form, computed on the device: entries sorted by row, then column, repeated
    /// entries summed (in f64, rounded once to the value type, as [`CooMatrix::to_csr`] does);
    /// the index and value types stay.
    ///
    /// cuSPARSE sorts (`cusparseXcoosortByRow`, then `cusparseXcsrsort` within each row: the
    /// first orders rows only, so the columns of a row are put in order by the second, which
    /// carries the permutation along) and compresses the rows (`cusparseXcoo2csr`); these calls
    /// take 32-bit indices only, so i64 indices are narrowed around them by cast kernels, and a
    /// matrix whose sizes need 64 bits is an error. A sort written here would work on i64 too,
    /// but an efficient GPU radix sort is a project of its own and every matrix cuSPARSE's
    /// SpGEMM takes fits 32 bits anyway. Repeats are merged by generated kernels: a scan of the
    /// run heads (entries whose position differs from their predecessor's) gives each distinct
    /// entry its place, and each place sums its run's values in sorted order.
    pub fn to_csr(&self) -> Result<DeviceCsr> {
        let dev = &self.dev;
        dev.bind()?;
        let stream = dev.stream.cu_stream();
        let (m, n, nnz) = (self.rows, self.cols, self.nnz);
        if nnz == 0 {
            let out = DeviceCsr::alloc(dev, m, n, 0, self.index, self.dtype)?;
            zero(&out.row_ptr, (m + 1) * self.index.size_bytes(), stream)?;
            dev.sync()?;
            return Ok(out);
        }
        if let Some(e) = too_big_for_i32("COO → CSR", m, n, nnz) {
            return Err(e);
        }
        let mut s = Scratch {
            dev,
            blocks: vec![],
        };
        let i32b = DType::I32.size_bytes();
        // 32-bit copies of the indices (sorted in place), and the permutations of both sorts.
        let (r32, c32, by_row, in_row) = (
            s.alloc(nnz * i32b)?,
            s.alloc(nnz * i32b)?,
            s.alloc(nnz * i32b)?,
            s.alloc(nnz * i32b)?,
        );
        cast(
            dev,
            addr(&self.row_idx),
            self.index,
            r32,
            DType::I32,
            nnz,
            stream,
        )?;
        cast(
            dev,
            addr(&self.col_idx),
            self.index,
            c32,
            DType::I32,
            nnz,
            stream,
        )?;
        let rp_sorted = s.alloc((m + 1) * i32b)?;
        dev.with_sparse(|sparse| {
            sort_coo(
                dev,
                sparse,
                m,
                n,
                nnz,
                (r32, c32, by_row, in_row, rp_sorted),
                stream,
            )
        })?;
        // Merge the repeats.
        let plan = merge_plan(nnz, self.dtype, MERGE_BLOCKS)?;
        let partial = s.alloc((plan.blocks as usize + 1) * 8)?;
        let start = s.alloc(nnz * 8)?;
        let out_r = s.alloc(nnz * i32b)?;
        let mut c = DeviceCsr {
            dev: dev.clone(),
            rows: m,
            cols: n,
            nnz: 0,
            index: DType::I32,
            dtype: self.dtype,
            row_ptr: Some(dev.alloc((m + 1) * i32b)?),
            col_idx: Some(dev.alloc(nnz * i32b)?),
            values: Some(dev.alloc(nnz * self.dtype.size_bytes())?),
        };
        let vals = addr(&self.values);
        let (out_c, out_v) = (addr(&c.col_idx), addr(&c.values));
        let launches: [(&ir::Kernel, u32, Vec<u64>); 4] = [
            (&plan.heads, plan.blocks, vec![r32, c32, partial]),
            (&plan.offsets, 1, vec![partial]),
            (
                &plan.merge,
                plan.blocks,
                vec![r32, c32, partial, out_r, out_c, start],
            ),
            (
                &plan.sum,
                plan.sum_grid,
                vec![start, by_row, in_row, vals, partial, out_v],
            ),
        ];
        let sources = launches
            .iter()
            .map(|(k, _, _)| Ok((k.name.clone(), source(k)?)))
            .collect::<Result<Vec<_>>>()?;
        let funcs = dev.functions(&sources)?;
        for ((k, grid, args), f) in launches.iter().zip(funcs) {
            // SAFETY: each kernel's parameters are exactly these buffers, in order, each live
            // and sized as the kernel reads or writes it (nnz entries, the plan's block count
            // plus one partial sums, m + 1 row offsets).
            unsafe { super::launch_pointers(&f, *grid, k.block, k.smem, args, stream) }
                .map_err(|e| RuntimeError::Device(format!("COO merge kernel: {e}")))?;
        }
        let total = dtoh(
            partial + plan.blocks as u64 * 8,
            &TensorType::new(DType::I64, Shape::new(vec![1])),
            stream,
        )?;
        dev.sync()?;
        let total = total.to_f64_vec()[0] as usize;
        if total == 0 || total > nnz {
            return Err(RuntimeError::Device(format!(
                "COO → CSR: the merge counted {total} distinct entries of {nnz}"
            )));
        }
        c.nnz = total;
        dev.with_sparse(|sparse| {
            let h = sparse.on(stream)?;
            // SAFETY: `out_r` holds `total` sorted row indices below m; the row offsets hold
            // m + 1 entries.
            check("coo2csr", unsafe {
                sp::cusparseXcoo2csr(
                    h,
                    out_r as *const i32,
                    total as i32,
                    m as i32,
                    addr(&c.row_ptr) as *mut i32,
                    sp::cusparseIndexBase_t::CUSPARSE_INDEX_BASE_ZERO,
                )
            })
        })?;
        let c = if c.index != self.index {
            c.to_types(self.index, self.dtype)?
        } else {
            c
        };
        drop(s);
        dev.sync()?;
        Ok(c)
    }

    /// The matrix as a dense row-major tensor on the host, made on the device (through
    /// [`DeviceCoo::to_csr`], so repeated entries add up).
    pub fn to_dense(&self) -> Result<HostTensor> {
        self.to_csr()?.to_dense()
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Stored entries (repeats included).
    pub fn nnz(&self) -> usize {
        self.nnz
    }
    /// Index type.
    pub fn index_dtype(&self) -> DType {
        self.index
    }
    /// Value type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The device ordinal.
    pub fn device(&self) -> usize {
        self.dev.ordinal
    }
}

/// Sorts the 32-bit COO indices `(rows, cols)` of `nnz` entries by row, then column, in place:
/// entry e of the result was entry `in_row[e]` after the sort by rows, which was entry
/// `by_row[in_row[e]]` of the input (the two permutations are kept apart rather than relying on
/// `csrsort` to compose a permutation it is given); `rp` (m + 1 entries) receives the row
/// offsets of the sorted entries.
fn sort_coo(
    dev: &GpuDevice,
    s: &mut Sparse,
    m: usize,
    n: usize,
    nnz: usize,
    (rows, cols, by_row, in_row, rp): (u64, u64, u64, u64, u64),
    stream: CUstream,
) -> Result<()> {
    let h = s.on(stream)?;
    let (mi, ni, nz) = (m as i32, n as i32, nnz as i32);
    let (r, c) = (rows as *mut i32, cols as *mut i32);
    let (p1, p2) = (by_row as *mut i32, in_row as *mut i32);
    let mut bufs = Scratch {
        dev,
        blocks: vec![],
    };
    // Every call below: live handle; `rows`, `cols`, `by_row` and `in_row` hold nnz i32 each,
    // `rp` m + 1;
    // each workspace holds the bytes its size query returned and returns to the pool
    // stream-ordered, after the calls.
    // SAFETY: see above.
    check("identity permutation", unsafe {
        sp::cusparseCreateIdentityPermutation(h, nz, p1)
    })?;
    let mut bytes = 0usize;
    // SAFETY: see above.
    check("coosort buffer size", unsafe {
        sp::cusparseXcoosort_bufferSizeExt(h, mi, ni, nz, r, c, &mut bytes)
    })?;
    let b = bufs.alloc(bytes.max(1))? as *mut c_void;
    // SAFETY: see above.
    check("coosortByRow", unsafe {
        sp::cusparseXcoosortByRow(h, mi, ni, nz, r, c, p1, b)
    })?;
    // SAFETY: see above.
    check("coo2csr", unsafe {
        sp::cusparseXcoo2csr(
            h,
            r,
            nz,
            mi,
            rp as *mut i32,
            sp::cusparseIndexBase_t::CUSPARSE_INDEX_BASE_ZERO,
        )
    })?;
    let mut bytes = 0usize;
    // SAFETY: see above.
    check("csrsort buffer size", unsafe {
        sp::cusparseXcsrsort_bufferSizeExt(h, mi, ni, nz, rp as *const i32, c, &mut bytes)
    })?;
    let b = bufs.alloc(bytes.max(1))? as *mut c_void;
    let descr = MatDescr::new()?;
    // SAFETY: see above.
    check("identity permutation", unsafe {
        sp::cusparseCreateIdentityPermutation(h, nz, p2)
    })?;
    // SAFETY: see above; the descriptor is a general zero-based matrix.
    check("csrsort", unsafe {
        sp::cusparseXcsrsort(h, mi, ni, nz, descr.0, rp as *const i32, c, p2, b)
    })
}

/// A legacy matrix descriptor (general, zero-based), destroyed on drop.
struct MatDescr(sp::cusparseMatDescr_t);

impl MatDescr {
    fn new() -> Result<MatDescr> {
        let mut d: sp::cusparseMatDescr_t = std::ptr::null_mut();
        // SAFETY: writes a fresh descriptor (general, zero-based by default).
        check("matrix descriptor", unsafe {
            sp::cusparseCreateMatDescr(&mut d)
        })?;
        Ok(MatDescr(d))
    }
}

impl Drop for MatDescr {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        let _ = unsafe { sp::cusparseDestroyMatDescr(self.0) };
    }
}

impl DeviceCsr {
    /// The same entries in coordinate form (row-major order), computed on the device: cuSPARSE's
    /// `cusparseXcsr2coo` expands the row offsets (32-bit; i64 offsets are narrowed around it,
    /// and a matrix whose sizes need 64 bits is an error); column indices and values are copied.
    pub fn to_coo(&self) -> Result<DeviceCoo> {
        let dev = &self.dev;
        dev.bind()?;
        let stream = dev.stream.cu_stream();
        let (m, n, nnz) = (self.rows, self.cols, self.nnz);
        let out = DeviceCoo::alloc(dev, m, n, nnz, self.index, self.dtype)?;
        if nnz > 0 {
            if let Some(e) = too_big_for_i32("CSR → COO", m, n, nnz) {
                return Err(e);
            }
            let mut s = Scratch {
                dev,
                blocks: vec![],
            };
            let i32b = DType::I32.size_bytes();
            let (rp32, r32) = if self.index == DType::I32 {
                (addr(&self.row_ptr), addr(&out.row_idx))
            } else {
                let rp32 = s.alloc((m + 1) * i32b)?;
                cast(
                    dev,
                    addr(&self.row_ptr),
                    self.index,
                    rp32,
                    DType::I32,
                    m + 1,
                    stream,
                )?;
                (rp32, s.alloc(nnz * i32b)?)
            };
            dev.with_sparse(|sparse| {
                let h = sparse.on(stream)?;
                // SAFETY: `rp32` holds m + 1 valid i32 row offsets ending at nnz, `r32` nnz i32.
                check("csr2coo", unsafe {
                    sp::cusparseXcsr2coo(
                        h,
                        rp32 as *const i32,
                        nnz as i32,
                        m as i32,
                        r32 as *mut i32,
                        sp::cusparseIndexBase_t::CUSPARSE_INDEX_BASE_ZERO,
                    )
                })
            })?;
            if self.index != DType::I32 {
                cast(
                    dev,
                    r32,
                    DType::I32,
                    addr(&out.row_idx),
                    self.index,
                    nnz,
                    stream,
                )?;
            }
            let (i, d) = (self.index, self.dtype);
            cast(
                dev,
                addr(&self.col_idx),
                i,
                addr(&out.col_idx),
                i,
                nnz,
                stream,
            )?;
            cast(
                dev,
                addr(&self.values),
                d,
                addr(&out.values),
                d,
                nnz,
                stream,
            )?;
            drop(s);
        }
        dev.sync()?;
        Ok(out)
    }

    /// The matrix as a dense row-major tensor on the host, made on the device
    /// (`cusparseSparseToDense`, any index and value type).
    pub fn to_dense(&self) -> Result<HostTensor> {
        let dev = &self.dev;
        dev.bind()?;
        let stream = dev.stream.cu_stream();
        let (m, n) = (self.rows, self.cols);
        let bytes = m
            .checked_mul(n)
            .and_then(|e| e.checked_mul(self.dtype.size_bytes()))
            .ok_or_else(|| {
                RuntimeError::Invalid(format!("{self:?} is too large for a dense tensor"))
            })?;
        let mut s = Scratch {
            dev,
            blocks: vec![],
        };
        let out = s.alloc(bytes)?;
        zero_at(out, bytes, stream)?;
        if self.nnz > 0 && m > 0 && n > 0 {
            let a = self.descriptor()?;
            let y = DnMat::row_major(m, n, out, self.dtype)?;
            let alg = sp::cusparseSparseToDenseAlg_t::CUSPARSE_SPARSETODENSE_ALG_DEFAULT;
            dev.with_sparse(|sparse| {
                let h = sparse.on(stream)?;
                let mut ws = 0usize;
                // SAFETY: live handle and descriptors over live buffers.
                check("sparse to dense buffer size", unsafe {
                    sp::cusparseSparseToDense_bufferSize(h, a.0, y.0, alg, &mut ws)
                })?;
                let w = s.alloc(ws.max(1))?;
                // SAFETY: as above, with a workspace of the size asked for.
                check("sparse to dense", unsafe {
                    sp::cusparseSparseToDense(h, a.0, y.0, alg, w as *mut c_void)
                })
            })?;
        }
        let t = dtoh(
            out,
            &TensorType::new(self.dtype, Shape::new(vec![m, n])),
            stream,
        )?;
        dev.sync()?;
        Ok(t)
    }
}

// ---- merging the repeats of a sorted COO matrix (generated kernels) ----

/// Threads per block of the merge kernels.
const MERGE_BLOCK: u32 = 256;
/// The most blocks of the per-block kernels (the offsets kernel scans one partial sum per
/// block with one block of this many threads).
const MERGE_BLOCKS: usize = 1024;

/// The kernels that merge the repeats of `n` COO entries sorted by row, then column: `heads`
/// counts the run heads of each block's chunk, `offsets` scans those counts (exclusive, the
/// total after them), `merge` writes each head's row, column and position in the sorted order
/// at its place, `sum` adds up each place's run of values in f64 (found through the two sorts'
/// permutations, see [`sort_coo`]) and rounds once.
struct MergePlan {
    /// Blocks of `heads` and `merge`.
    blocks: u32,
    heads: ir::Kernel,
    offsets: ir::Kernel,
    merge: ir::Kernel,
    /// Blocks of `sum`.
    sum_grid: u32,
    sum: ir::Kernel,
}

/// The merge plan for `n` entries (at least one) of values of `dtype`, with at most
/// `max_blocks` blocks (a power of two; [`MERGE_BLOCKS`] on the device, fewer in tests so that a
/// chunk spans several tiles).
fn merge_plan(n: usize, dtype: DType, max_blocks: usize) -> Result<MergePlan> {
    use ir::{
        add, bin, for_, i64c, if_, lit, load, mul, select, special, store, sub, var, BinFn, CTy,
        Expr, Kernel, Param, Special, Stmt,
    };
    let t = MERGE_BLOCK as usize;
    // Each block's chunk: a whole number of tiles of t entries.
    let per = n.div_ceil(max_blocks).div_ceil(t) * t;
    let blocks = n.div_ceil(per);
    let (ni, per_i, ti, bi) = (n as i64, per as i64, t as i64, blocks as i64);
    let p = |name: &str, elem: CTy, writes: bool| Param {
        name: name.into(),
        elem,
        writes,
        map: None,
    };
    let tid = || special(Special::ThreadIdx);
    let bid = || special(Special::BlockIdx);
    let min = |a: Expr, b: Expr| bin(BinFn::Min, a, b);
    let eq = |a: Expr, b: Expr| bin(BinFn::Eq, a, b);
    let sync = || Stmt::SyncThreads;
    let shared = |len: usize| Stmt::Shared {
        name: "s".into(),
        elem: CTy::I64,
        len: len as u32,
    };
    let sh = |i: Expr| load("s", CTy::I64, i);
    // Whether entry k (in 0..n) starts a run: the first entry, or another row or column than
    // its predecessor's.
    let head = |k: Expr| {
        let prev = select(
            bin(BinFn::Gt, k.clone(), i64c(0)),
            sub(k.clone(), i64c(1)),
            i64c(0),
        );
        let differs = |buf: &str| {
            bin(
                BinFn::Ne,
                load(buf, CTy::I32, k.clone()),
                load(buf, CTy::I32, prev.clone()),
            )
        };
        bin(
            BinFn::Or,
            eq(k.clone(), i64c(0)),
            bin(BinFn::Or, differs("r"), differs("c")),
        )
    };
    let chunk = || {
        vec![
            ir::let_("lo", CTy::I64, mul(bid(), i64c(per_i))),
            ir::let_("hi", CTy::I64, min(add(var("lo"), i64c(per_i)), i64c(ni))),
        ]
    };
    // An inclusive scan of s[0..len] by the block's `len` threads (Hillis–Steele).
    let scan = |len: usize| {
        let mut out = vec![];
        let mut off = 1;
        while off < len {
            let o = off as i64;
            let has = bin(BinFn::Ge, tid(), i64c(o));
            let name = format!("v{off}");
            out.push(ir::let_(
                &name,
                CTy::I64,
                select(
                    has.clone(),
                    sh(select(has, sub(tid(), i64c(o)), i64c(0))),
                    i64c(0),
                ),
            ));
            out.push(sync());
            out.push(store("s", CTy::I64, tid(), add(sh(tid()), var(&name))));
            out.push(sync());
            off *= 2;
        }
        out
    };
    let finish = |prefix: &str, k: Kernel| {
        rustytorch_codegen::cuda::finish(prefix, k).map_err(RuntimeError::from)
    };

    // heads: partial[b] = run heads in block b's chunk.
    let mut body = vec![shared(t)];
    body.extend(chunk());
    body.push(ir::let_("acc", CTy::I64, i64c(0)));
    body.push(for_(
        "k",
        add(var("lo"), tid()),
        var("hi"),
        i64c(ti),
        vec![ir::assign(
            "acc",
            add(var("acc"), select(head(var("k")), i64c(1), i64c(0))),
        )],
    ));
    body.push(store("s", CTy::I64, tid(), var("acc")));
    body.push(sync());
    let mut off = t / 2;
    while off > 0 {
        let o = off as i64;
        body.push(if_(
            ir::lt(tid(), i64c(o)),
            vec![store(
                "s",
                CTy::I64,
                tid(),
                add(sh(tid()), sh(add(tid(), i64c(o)))),
            )],
        ));
        body.push(sync());
        off /= 2;
    }
    body.push(if_(
        eq(tid(), i64c(0)),
        vec![store("partial", CTy::I64, bid(), sh(i64c(0)))],
    ));
    let heads = finish(
        "coo_heads",
        Kernel {
            name: String::new(),
            params: vec![
                p("r", CTy::I32, false),
                p("c", CTy::I32, false),
                p("partial", CTy::I64, true),
            ],
            block: MERGE_BLOCK,
            smem: 0,
            body,
        },
    )?;

    // offsets: one block scans the partial sums into exclusive offsets, the total after them.
    let mut body = vec![
        shared(max_blocks),
        ir::let_(
            "x",
            CTy::I64,
            select(
                ir::lt(tid(), i64c(bi)),
                load("partial", CTy::I64, min(tid(), i64c(bi - 1))),
                i64c(0),
            ),
        ),
        store("s", CTy::I64, tid(), var("x")),
        sync(),
    ];
    body.extend(scan(max_blocks));
    body.push(if_(
        ir::lt(tid(), i64c(bi)),
        vec![store("partial", CTy::I64, tid(), sub(sh(tid()), var("x")))],
    ));
    body.push(if_(
        eq(tid(), i64c(bi - 1)),
        vec![store("partial", CTy::I64, i64c(bi), sh(tid()))],
    ));
    let offsets = finish(
        "coo_offsets",
        Kernel {
            name: String::new(),
            params: vec![p("partial", CTy::I64, true)],
            block: max_blocks as u32,
            smem: 0,
            body,
        },
    )?;

    // merge: tile by tile, a block scan of the head flags places each head.
    let mut body = vec![shared(t)];
    body.extend(chunk());
    body.push(ir::let_("base", CTy::I64, load("partial", CTy::I64, bid())));
    let mut tile = vec![
        ir::let_("k", CTy::I64, add(var("tile"), tid())),
        ir::let_("kk", CTy::I64, min(var("k"), i64c(ni - 1))),
        ir::let_(
            "f",
            CTy::I64,
            select(
                bin(BinFn::And, ir::lt(var("k"), var("hi")), head(var("kk"))),
                i64c(1),
                i64c(0),
            ),
        ),
        store("s", CTy::I64, tid(), var("f")),
        sync(),
    ];
    tile.extend(scan(t));
    tile.push(if_(
        eq(var("f"), i64c(1)),
        vec![
            ir::let_("pos", CTy::I64, sub(add(var("base"), sh(tid())), i64c(1))),
            store(
                "out_r",
                CTy::I32,
                var("pos"),
                load("r", CTy::I32, var("kk")),
            ),
            store(
                "out_c",
                CTy::I32,
                var("pos"),
                load("c", CTy::I32, var("kk")),
            ),
            store("start", CTy::I64, var("pos"), var("kk")),
        ],
    ));
    tile.push(ir::assign("base", add(var("base"), sh(i64c(ti - 1)))));
    tile.push(sync());
    body.push(for_("tile", var("lo"), var("hi"), i64c(ti), tile));
    let merge = finish(
        "coo_merge",
        Kernel {
            name: String::new(),
            params: vec![
                p("r", CTy::I32, false),
                p("c", CTy::I32, false),
                p("partial", CTy::I64, false),
                p("out_r", CTy::I32, true),
                p("out_c", CTy::I32, true),
                p("start", CTy::I64, true),
            ],
            block: MERGE_BLOCK,
            smem: 0,
            body,
        },
    )?;

    // sum: place i adds the values of sorted entries start[i] .. start[i + 1] (n after the
    // last place) in f64, read through both sorts' permutations, and rounds once.
    let el = CTy::storage(dtype);
    let value = |e: Expr| {
        let j = ir::cast(CTy::I64, load("in_row", CTy::I32, e));
        let src = ir::cast(CTy::I64, load("by_row", CTy::I32, j));
        ir::cast(CTy::F64, load("vals", el, src))
    };
    let rounded = if el == CTy::BF16 {
        ir::cast(CTy::BF16, var("acc"))
    } else {
        var("acc")
    };
    let body = vec![
        ir::let_("total", CTy::I64, load("partial", CTy::I64, i64c(bi))),
        ir::grid_stride(
            "i",
            ni,
            vec![if_(
                ir::lt(var("i"), var("total")),
                vec![
                    ir::let_("e0", CTy::I64, load("start", CTy::I64, var("i"))),
                    ir::let_(
                        "e1",
                        CTy::I64,
                        select(
                            ir::lt(add(var("i"), i64c(1)), var("total")),
                            load("start", CTy::I64, min(add(var("i"), i64c(1)), i64c(ni - 1))),
                            i64c(ni),
                        ),
                    ),
                    ir::let_("acc", CTy::F64, lit(0.0, CTy::F64)),
                    for_(
                        "e",
                        var("e0"),
                        var("e1"),
                        i64c(1),
                        vec![ir::assign("acc", add(var("acc"), value(var("e"))))],
                    ),
                    store("out_v", el, var("i"), rounded),
                ],
            )],
        ),
    ];
    let sum = finish(
        "coo_sum",
        Kernel {
            name: String::new(),
            params: vec![
                p("start", CTy::I64, false),
                p("by_row", CTy::I32, false),
                p("in_row", CTy::I32, false),
                p("vals", el, false),
                p("partial", CTy::I64, false),
                p("out_v", el, true),
            ],
            block: MERGE_BLOCK,
            smem: 0,
            body,
        },
    )?;
    Ok(MergePlan {
        blocks: blocks as u32,
        heads,
        offsets,
        merge,
        sum_grid: rustytorch_codegen::cuda::grid_for(n as u64, t as u64),
        sum,
    })
}

#[cfg(test)]
mod tests {
    //! The merge kernels in the kernel-IR interpreter against the host's merge of sorted
    //! entries (the device tests in `tests/device_sparse.rs` run the whole conversion).
    use super::*;
    use rustytorch_codegen::cuda::interp::run_launch;
    use rustytorch_ops::{bf16, f16};

    fn le<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
        v.iter().flat_map(|&x| f(x)).collect()
    }

    fn i32s(b: &[u8]) -> Vec<i32> {
        b.chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    /// Encodes f64 values in `dtype` (already representable) and decodes them back.
    fn encode(d: DType, v: &[f64]) -> Vec<u8> {
        match d {
            DType::F64 => le(v, f64::to_le_bytes),
            DType::F32 => le(v, |x| (x as f32).to_le_bytes()),
            DType::F16 => le(v, |x| f16::from_f64(x).to_bits().to_le_bytes()),
            _ => le(v, |x| bf16::from_f64(x).to_bits().to_le_bytes()),
        }
    }

    fn decode(d: DType, b: &[u8]) -> Vec<f64> {
        match d {
            DType::F64 => b
                .chunks(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            DType::F32 => b
                .chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect(),
            DType::F16 => b
                .chunks(2)
                .map(|c| f16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f64())
                .collect(),
            _ => b
                .chunks(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f64())
                .collect(),
        }
    }

    fn round(d: DType, x: f64) -> f64 {
        decode(d, &encode(d, &[x]))[0]
    }

    /// Runs one launch over the named buffers, in the kernel's parameter order.
    fn launch(k: &ir::Kernel, grid: u32, bufs: &mut Vec<(&str, Vec<u8>)>) {
        let mut args: Vec<Vec<u8>> = k
            .params
            .iter()
            .map(|p| {
                let b = bufs.iter_mut().find(|(n, _)| *n == p.name).unwrap();
                std::mem::take(&mut b.1)
            })
            .collect();
        run_launch(k, grid, &mut args).unwrap_or_else(|e| panic!("{}: {e}", k.name));
        for (p, a) in k.params.iter().zip(args) {
            bufs.iter_mut().find(|(n, _)| *n == p.name).unwrap().1 = a;
        }
    }

    #[test]
    fn merge_kernels_sum_runs_like_the_host() {
        let mut state = 12345u64;
        let mut next = |m: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % m
        };
        // (entries, rows, cols, blocks at most): one entry; a chunk of one tile; chunks of
        // several tiles; heavy repetition (few distinct positions).
        let cases = [
            (1, 3, 3, 4),
            (200, 5, 7, 4),
            (2500, 40, 30, 4),
            (900, 2, 3, 2),
        ];
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            for &(n, rows, cols, max_blocks) in &cases {
                // Entries sorted by (row, column), stably: perm holds their source positions.
                let mut e: Vec<(i32, i32, i32)> = (0..n)
                    .map(|p| (next(rows) as i32, next(cols) as i32, p as i32))
                    .collect();
                let vals: Vec<f64> = (0..n)
                    .map(|_| round(dtype, (next(2001) as f64 - 1000.0) / 997.0))
                    .collect();
                e.sort_by_key(|&(r, c, _)| (r, c));
                let r: Vec<i32> = e.iter().map(|x| x.0).collect();
                let c: Vec<i32> = e.iter().map(|x| x.1).collect();
                let perm: Vec<i32> = e.iter().map(|x| x.2).collect();
                // Split it in two as the device's two sorts do: by_row[in_row[e]] = perm[e],
                // in_row a shuffle.
                let mut in_row: Vec<i32> = (0..n as i32).collect();
                for k in (1..n).rev() {
                    in_row.swap(k, next(k as u64 + 1) as usize);
                }
                let mut by_row = vec![0i32; n];
                for k in 0..n {
                    by_row[in_row[k] as usize] = perm[k];
                }
                // The host's merge: runs summed in f64 in sorted order, rounded once.
                let mut want: Vec<(i32, i32, f64)> = vec![];
                for &(rr, cc, p) in &e {
                    match want.last_mut() {
                        Some(w) if (w.0, w.1) == (rr, cc) => w.2 += vals[p as usize],
                        _ => want.push((rr, cc, vals[p as usize])),
                    }
                }
                let plan = merge_plan(n, dtype, max_blocks).unwrap();
                let poison = |bytes: usize| vec![0xA5u8; bytes];
                let vb = dtype.size_bytes();
                let mut bufs = vec![
                    ("r", le(&r, i32::to_le_bytes)),
                    ("c", le(&c, i32::to_le_bytes)),
                    ("by_row", le(&by_row, i32::to_le_bytes)),
                    ("in_row", le(&in_row, i32::to_le_bytes)),
                    ("vals", encode(dtype, &vals)),
                    ("partial", poison((plan.blocks as usize + 1) * 8)),
                    ("start", poison(n * 8)),
                    ("out_r", poison(n * 4)),
                    ("out_c", poison(n * 4)),
                    ("out_v", poison(n * vb)),
                ];
                launch(&plan.heads, plan.blocks, &mut bufs);
                launch(&plan.offsets, 1, &mut bufs);
                launch(&plan.merge, plan.blocks, &mut bufs);
                launch(&plan.sum, plan.sum_grid, &mut bufs);
                let get = |name: &str| bufs.iter().find(|(b, _)| *b == name).unwrap().1.clone();
                let partial = get("partial");
                let total = i64::from_le_bytes(partial[partial.len() - 8..].try_into().unwrap());
                let what = format!("{n} entries, {dtype}");
                assert_eq!(total as usize, want.len(), "{what}: distinct entries");
                let k = want.len();
                let wr: Vec<i32> = want.iter().map(|w| w.0).collect();
                let wc: Vec<i32> = want.iter().map(|w| w.1).collect();
                let wv: Vec<f64> = want.iter().map(|w| round(dtype, w.2)).collect();
                assert_eq!(i32s(&get("out_r")[..k * 4]), wr, "{what}: rows");
                assert_eq!(i32s(&get("out_c")[..k * 4]), wc, "{what}: columns");
                assert_eq!(decode(dtype, &get("out_v")[..k * vb]), wv, "{what}: values");
            }
        }
    }
}
