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
use rustytorch_codegen::cuda::{lower_step, source, ArgRef, CudaStep, SpmmDesc};
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
                let ri = HostTensor::from_data(Data::I64(rows), Shape::new(vec![self.nnz]))
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
        cast(
            &self.dev,
            &self.row_ptr,
            self.index,
            &out.row_ptr,
            index,
            self.rows + 1,
            stream,
        )?;
        cast(
            &self.dev,
            &self.col_idx,
            self.index,
            &out.col_idx,
            index,
            self.nnz,
            stream,
        )?;
        cast(
            &self.dev,
            &self.values,
            self.dtype,
            &out.values,
            dtype,
            self.nnz,
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
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the block is live and holds at least `bytes` bytes.
    unsafe { dr::memset_d8_async(addr(b), 0, bytes, stream) }
        .map_err(|e| RuntimeError::Device(format!("clearing a buffer: {e}")))
}

/// Converts `n` elements of `from` in `src` to `to` in `dst` with a generated cast kernel.
fn cast(
    dev: &Arc<GpuDevice>,
    src: &Option<Block>,
    from: DType,
    dst: &Option<Block>,
    to: DType,
    n: usize,
    stream: CUstream,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    if from == to {
        // SAFETY: both blocks are live and hold n elements of the type.
        return unsafe { dr::memcpy_dtod_async(addr(dst), addr(src), n * to.size_bytes(), stream) }
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
                ArgRef::Input(_) => addr(src),
                _ => addr(dst),
            })
            .collect();
        // SAFETY: the cast kernel's parameters are its input and output pointers, both live
        // buffers of n elements of their types.
        unsafe { super::launch_pointers(&f, l.grid, l.kernel.block, &args, stream) }
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
