//! cuDNN convolutions and pooling through cudarc's result and sys layers (the safe layer hides its
//! descriptors and has no pooling backward): one handle per device and, per [`DnnDesc`], the
//! descriptors and the algorithm, made once and cached.
//!
//! The algorithm is chosen by measurement (cuDNN's `Find`, as PyTorch's benchmark mode does) the
//! first time a shape is prepared, among those whose workspace fits [`WORKSPACE_LIMIT`], and the
//! math type that algorithm was measured with is set on the descriptor. f32 runs in exact f32
//! (FMA math, no TF32) unless `RUSTYTORCH_ALLOW_TF32=1`; f16/bf16 on tensor cores with f32
//! accumulation; f64 in f64.

use crate::{Result, RuntimeError};
use cudarc::cudnn::{result as dn, sys};
use rustytorch_codegen::cuda::dnn::{DnnDesc, DnnKind, DnnPoolMode};
use rustytorch_ops::DType;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};

/// The largest workspace a convolution algorithm may use.
pub const WORKSPACE_LIMIT: usize = 1 << 30;

#[derive(Clone, Copy)]
enum Algo {
    None,
    Fwd(sys::cudnnConvolutionFwdAlgo_t),
    BwdData(sys::cudnnConvolutionBwdDataAlgo_t),
    BwdFilter(sys::cudnnConvolutionBwdFilterAlgo_t),
}

struct Prepared {
    x: sys::cudnnTensorDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
    w: Option<sys::cudnnFilterDescriptor_t>,
    conv: Option<sys::cudnnConvolutionDescriptor_t>,
    pool: Option<sys::cudnnPoolingDescriptor_t>,
    bias: Option<sys::cudnnTensorDescriptor_t>,
    algo: Algo,
    /// Bytes of scratch the call needs (workspace, or the recomputed forward result).
    scratch: usize,
}

/// cuDNN state of one device.
pub struct Dnn {
    handle: sys::cudnnHandle_t,
    /// Per descriptor (whether TF32 is allowed is fixed for the handle's life).
    cache: HashMap<DnnDesc, Prepared>,
    tf32: bool,
}

// SAFETY: the handle and descriptors are used only under the device's lock, one thread at a time;
// cuDNN handles may move between threads as long as they are not used concurrently.
unsafe impl Send for Dnn {}

fn err(what: &str, e: impl std::fmt::Debug) -> RuntimeError {
    RuntimeError::Device(format!("cuDNN {what}: {e:?}"))
}

fn data_type(d: DType) -> Result<sys::cudnnDataType_t> {
    use sys::cudnnDataType_t as T;
    Ok(match d {
        DType::F32 => T::CUDNN_DATA_FLOAT,
        DType::F64 => T::CUDNN_DATA_DOUBLE,
        DType::F16 => T::CUDNN_DATA_HALF,
        DType::BF16 => T::CUDNN_DATA_BFLOAT16,
        d => {
            return Err(RuntimeError::Invalid(format!(
                "convolution: no cuDNN kernel for {d:?}"
            )))
        }
    })
}

/// Device addresses of one cuDNN call's tensors.
#[derive(Clone, Copy, Debug)]
pub struct DnnPtrs {
    /// A convolution's x (staged or not); pooling's operand 0.
    pub x: u64,
    /// A convolution's filter; a pooling backward's dy.
    pub w: u64,
    /// A convolution's y; pooling's output.
    pub y: u64,
    /// The bias (0 when there is none).
    pub bias: u64,
    /// The workspace (at least [`Dnn::prepare`]'s bytes).
    pub workspace: u64,
}

/// Strides of `dims` (given in N, C, spatial order), row-major, or channels-last with `nhwc`.
fn strides(dims: &[i32], nhwc: bool) -> Vec<i32> {
    let mut s = vec![1i32; dims.len()];
    if nhwc && dims.len() > 2 {
        // Memory order N, spatial..., C.
        let c = dims[1];
        let mut acc = c;
        for i in (2..dims.len()).rev() {
            s[i] = acc;
            acc *= dims[i];
        }
        s[1] = 1;
        s[0] = acc;
        return s;
    }
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

fn tensor(
    dt: sys::cudnnDataType_t,
    dims: &[i32],
    nhwc: bool,
) -> Result<sys::cudnnTensorDescriptor_t> {
    let t = dn::create_tensor_descriptor().map_err(|e| err("tensor descriptor", e))?;
    let st = strides(dims, nhwc);
    // SAFETY: `t` is live; `dims` and `st` hold `dims.len()` ints each.
    unsafe { dn::set_tensornd_descriptor(t, dt, dims.len() as c_int, dims.as_ptr(), st.as_ptr()) }
        .map_err(|e| err(&format!("tensor {dims:?}"), e))?;
    Ok(t)
}

/// The scaling factors cuDNN reads: doubles for f64 data, floats otherwise.
enum Scale {
    F32(f32, f32),
    F64(f64, f64),
}

impl Scale {
    fn new(d: DType, alpha: f64, beta: f64) -> Scale {
        if d == DType::F64 {
            Scale::F64(alpha, beta)
        } else {
            Scale::F32(alpha as f32, beta as f32)
        }
    }
    fn ptrs(&self) -> (*const c_void, *const c_void) {
        match self {
            Scale::F32(a, b) => (a as *const f32 as _, b as *const f32 as _),
            Scale::F64(a, b) => (a as *const f64 as _, b as *const f64 as _),
        }
    }
}

impl Dnn {
    /// Opens cuDNN (an error naming the library when it is missing).
    pub fn new() -> Result<Dnn> {
        // SAFETY: only checks whether the library can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err(RuntimeError::Device(
                "cuDNN (libcudnn) was not found: install cuDNN 9 to run convolutions and pooling on CUDA"
                    .into(),
            ));
        }
        let handle = dn::create_handle().map_err(|e| err("create", e))?;
        Ok(Dnn {
            handle,
            cache: HashMap::new(),
            tf32: std::env::var("RUSTYTORCH_ALLOW_TF32").as_deref() == Ok("1"),
        })
    }

    /// The cuDNN version, as `major·10000 + minor·100 + patch`.
    pub fn version() -> usize {
        dn::get_version()
    }

    /// Makes (once) the descriptors and algorithm of `d` and returns the scratch bytes its call
    /// needs. Choosing the algorithm runs cuDNN's benchmark on the device's stream, so this must
    /// not be called during stream capture.
    pub(crate) fn prepare(&mut self, d: &DnnDesc, stream: sys::cudaStream_t) -> Result<usize> {
        if !self.cache.contains_key(d) {
            // SAFETY: the handle is live; the stream belongs to the device's context.
            unsafe { dn::set_stream(self.handle, stream) }.map_err(|e| err("set stream", e))?;
            let mut p = Prepared {
                x: std::ptr::null_mut(),
                y: std::ptr::null_mut(),
                w: None,
                conv: None,
                pool: None,
                bias: None,
                algo: Algo::None,
                scratch: 0,
            };
            let made = self.make(d, &mut p);
            if let Err(e) = made {
                destroy(&p);
                return Err(e);
            }
            self.cache.insert(d.clone(), p);
        }
        Ok(self.cache[d].scratch)
    }

    fn make(&self, d: &DnnDesc, p: &mut Prepared) -> Result<()> {
        let dt = data_type(d.dtype)?;
        p.x = tensor(dt, &d.x, d.nhwc)?;
        p.y = tensor(dt, &d.y, d.nhwc)?;
        let n = d.spatial() as c_int;
        if let Some((mode, window)) = &d.pool {
            let pool = dn::create_pooling_descriptor().map_err(|e| err("pooling descriptor", e))?;
            p.pool = Some(pool);
            use sys::cudnnPoolingMode_t as M;
            let mode = match mode {
                // Deterministic: the gradient of a tie goes to one position, always the same.
                DnnPoolMode::Max => M::CUDNN_POOLING_MAX_DETERMINISTIC,
                DnnPoolMode::AvgIncludePadding => M::CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING,
                DnnPoolMode::AvgExcludePadding => M::CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING,
            };
            // SAFETY: `pool` is live; the three lists hold `n` ints each.
            unsafe {
                dn::set_pooling_descriptor(
                    pool,
                    mode,
                    sys::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN,
                    n,
                    window,
                    &d.pad,
                    &d.stride,
                )
            }
            .map_err(|e| err("pooling descriptor", e))?;
            p.scratch = if d.kind == DnnKind::PoolBackward {
                d.y_bytes()
            } else {
                0
            };
            return Ok(());
        }
        let w = dn::create_filter_descriptor().map_err(|e| err("filter descriptor", e))?;
        p.w = Some(w);
        // SAFETY: `w` is live; `d.w` holds its rank's ints.
        unsafe {
            dn::set_filternd_descriptor(
                w,
                dt,
                if d.nhwc {
                    sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC
                } else {
                    sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW
                },
                d.w.len() as c_int,
                d.w.as_ptr(),
            )
        }
        .map_err(|e| err(&format!("filter {:?}", d.w), e))?;
        let conv =
            dn::create_convolution_descriptor().map_err(|e| err("convolution descriptor", e))?;
        p.conv = Some(conv);
        let compute = if d.dtype == DType::F64 {
            sys::cudnnDataType_t::CUDNN_DATA_DOUBLE
        } else {
            sys::cudnnDataType_t::CUDNN_DATA_FLOAT
        };
        use sys::cudnnMathType_t as Math;
        let math = match d.dtype {
            DType::F16 | DType::BF16 => Math::CUDNN_TENSOR_OP_MATH,
            DType::F32 if !self.tf32 => Math::CUDNN_FMA_MATH,
            _ => Math::CUDNN_DEFAULT_MATH,
        };
        // SAFETY: `conv` is live; the lists hold `n` ints each.
        unsafe {
            dn::set_convolutionnd_descriptor(
                conv,
                n,
                d.pad.as_ptr(),
                d.stride.as_ptr(),
                d.dilation.as_ptr(),
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                compute,
            )
            .map_err(|e| err("convolution descriptor", e))?;
            dn::set_convolution_group_count(conv, d.groups).map_err(|e| err("groups", e))?;
            dn::set_convolution_math_type(conv, math).map_err(|e| err("math type", e))?;
        }
        if d.bias {
            let mut bd = vec![1i32; d.y.len()];
            bd[1] = d.y[1];
            p.bias = Some(tensor(dt, &bd, false)?);
        }
        // Measure the algorithms; keep the fastest that succeeded within the workspace limit.
        const N: usize = 16;
        let mut count: c_int = 0;
        macro_rules! find {
            ($perf:ty, |$r:ident, $c:ident| $call:expr, $wrap:path) => {{
                // SAFETY: a zeroed perf struct is valid (every enum field has a 0 variant).
                let mut perf: [$perf; N] = unsafe { std::mem::zeroed() };
                let ($r, $c) = (perf.as_mut_ptr(), &mut count);
                // SAFETY: every descriptor is live; `perf` holds N results.
                unsafe { $call }
                    .result()
                    .map_err(|e| err("finding an algorithm", e))?;
                let best = perf[..count.clamp(0, N as c_int) as usize]
                    .iter()
                    .filter(|r| {
                        r.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS
                            && r.memory <= WORKSPACE_LIMIT
                    })
                    .min_by(|a, b| a.time.total_cmp(&b.time))
                    .copied();
                let best = best.ok_or_else(|| {
                    RuntimeError::Device(format!(
                        "cuDNN has no algorithm for {d:?} within a {} MiB workspace",
                        WORKSPACE_LIMIT >> 20
                    ))
                })?;
                ($wrap(best.algo), best.memory, best.mathType)
            }};
        }
        let (h, wd) = (self.handle, w);
        let (algo, mem, found_math) = match d.kind {
            DnnKind::ConvForward => find!(
                sys::cudnnConvolutionFwdAlgoPerf_t,
                |r, c| sys::cudnnFindConvolutionForwardAlgorithm(
                    h, p.x, wd, conv, p.y, N as c_int, c, r
                ),
                Algo::Fwd
            ),
            DnnKind::ConvBackwardData => find!(
                sys::cudnnConvolutionBwdDataAlgoPerf_t,
                |r, c| sys::cudnnFindConvolutionBackwardDataAlgorithm(
                    h, wd, p.y, conv, p.x, N as c_int, c, r
                ),
                Algo::BwdData
            ),
            DnnKind::ConvBackwardFilter => find!(
                sys::cudnnConvolutionBwdFilterAlgoPerf_t,
                |r, c| sys::cudnnFindConvolutionBackwardFilterAlgorithm(
                    h, p.x, p.y, conv, wd, N as c_int, c, r
                ),
                Algo::BwdFilter
            ),
            DnnKind::PoolForward | DnnKind::PoolBackward => unreachable!("pooling returned above"),
        };
        // The algorithm was measured with this math type; exact f32 stays on FMA math.
        let math = if math == Math::CUDNN_FMA_MATH {
            math
        } else {
            found_math
        };
        // SAFETY: `conv` is live.
        unsafe { dn::set_convolution_math_type(conv, math) }.map_err(|e| err("math type", e))?;
        p.algo = algo;
        p.scratch = mem;
        Ok(())
    }

    /// Runs `d`, made by [`Dnn::prepare`] beforehand, on `stream` over the tensors at `at`.
    pub(crate) fn run(&self, d: &DnnDesc, at: &DnnPtrs, stream: sys::cudaStream_t) -> Result<()> {
        let p = self.cache.get(d).ok_or_else(|| {
            RuntimeError::Invalid(format!("cuDNN step {:?} was not prepared", d.kind))
        })?;
        let h = self.handle;
        // SAFETY: the handle is live; the stream belongs to the device's context.
        unsafe { dn::set_stream(h, stream) }.map_err(|e| err("set stream", e))?;
        let one_zero = Scale::new(d.dtype, 1.0, 0.0);
        let one_one = Scale::new(d.dtype, 1.0, 1.0);
        let (a, b) = one_zero.ptrs();
        let ptr = |v: u64| v as *const c_void;
        let mptr = |v: u64| v as *mut c_void;
        let (ws, ws_bytes) = (mptr(at.workspace), p.scratch);
        // SAFETY: the descriptors are live and describe the step's buffers, whose sizes the
        // plan's types fix; the scratch holds `p.scratch` bytes; alpha and beta point to scalars
        // of the type cuDNN reads for this data type.
        unsafe {
            match (p.algo, d.kind) {
                (Algo::Fwd(algo), _) => {
                    let (w, conv) = (p.w.expect("filter"), p.conv.expect("conv"));
                    dn::convolution_forward(
                        h,
                        a,
                        p.x,
                        ptr(at.x),
                        w,
                        ptr(at.w),
                        conv,
                        algo,
                        ws,
                        ws_bytes,
                        b,
                        p.y,
                        mptr(at.y),
                    )
                    .map_err(|e| err("convolution forward", e))?;
                    if let Some(bd) = p.bias {
                        let (a1, b1) = one_one.ptrs();
                        sys::cudnnAddTensor(h, a1, bd, ptr(at.bias), b1, p.y, mptr(at.y))
                            .result()
                            .map_err(|e| err("adding the bias", e))?;
                    }
                }
                (Algo::BwdData(algo), _) => {
                    let (w, conv) = (p.w.expect("filter"), p.conv.expect("conv"));
                    dn::convolution_backward_data(
                        h,
                        a,
                        w,
                        ptr(at.w),
                        p.y,
                        ptr(at.y),
                        conv,
                        algo,
                        ws,
                        ws_bytes,
                        b,
                        p.x,
                        mptr(at.x),
                    )
                    .map_err(|e| err("convolution backward data", e))?;
                }
                (Algo::BwdFilter(algo), _) => {
                    let (w, conv) = (p.w.expect("filter"), p.conv.expect("conv"));
                    dn::convolution_backward_filter(
                        h,
                        a,
                        p.x,
                        ptr(at.x),
                        p.y,
                        ptr(at.y),
                        conv,
                        algo,
                        ws,
                        ws_bytes,
                        b,
                        w,
                        mptr(at.w),
                    )
                    .map_err(|e| err("convolution backward filter", e))?;
                }
                (Algo::None, DnnKind::PoolForward) => {
                    dn::pooling_forward(
                        h,
                        p.pool.expect("pool"),
                        a,
                        p.x,
                        ptr(at.x),
                        b,
                        p.y,
                        mptr(at.y),
                    )
                    .map_err(|e| err("pooling forward", e))?;
                }
                (Algo::None, DnnKind::PoolBackward) => {
                    let pool = p.pool.expect("pool");
                    // cuDNN's backward reads the forward result: recompute it into the scratch.
                    dn::pooling_forward(h, pool, a, p.x, ptr(at.x), b, p.y, ws)
                        .map_err(|e| err("pooling forward (for the backward)", e))?;
                    sys::cudnnPoolingBackward(
                        h,
                        pool,
                        a,
                        p.y,
                        ws,
                        p.y,
                        ptr(at.w),
                        p.x,
                        ptr(at.x),
                        b,
                        p.x,
                        mptr(at.y),
                    )
                    .result()
                    .map_err(|e| err("pooling backward", e))?;
                }
                (Algo::None, k) => {
                    return Err(RuntimeError::Invalid(format!(
                        "cuDNN step {k:?} was prepared without an algorithm"
                    )))
                }
            }
        }
        Ok(())
    }
}

fn destroy(p: &Prepared) {
    // SAFETY: each descriptor was created once (or is null/None) and is destroyed once.
    unsafe {
        for t in [p.x, p.y].into_iter().chain(p.bias) {
            if !t.is_null() {
                let _ = dn::destroy_tensor_descriptor(t);
            }
        }
        if let Some(w) = p.w {
            let _ = dn::destroy_filter_descriptor(w);
        }
        if let Some(c) = p.conv {
            let _ = dn::destroy_convolution_descriptor(c);
        }
        if let Some(pl) = p.pool {
            let _ = sys::cudnnDestroyPoolingDescriptor(pl);
        }
    }
}

impl Drop for Dnn {
    fn drop(&mut self) {
        for (_, p) in self.cache.drain() {
            destroy(&p);
        }
        // SAFETY: the handle is destroyed once.
        let _ = unsafe { dn::destroy_handle(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::strides;

    #[test]
    fn contiguous_and_channels_last_strides() {
        assert_eq!(strides(&[2, 3, 4, 5], false), vec![60, 20, 5, 1]);
        assert_eq!(strides(&[2, 3, 1, 4, 5], false), vec![60, 20, 20, 5, 1]);
        // N, C, H, W stored as N, H, W, C.
        assert_eq!(strides(&[2, 3, 4, 5], true), vec![60, 1, 15, 3]);
        assert_eq!(strides(&[2, 3, 2, 4, 5], true), vec![120, 1, 60, 15, 3]);
    }
}
