//! cuDNN convolutions and pooling through cudarc's result and sys layers (the safe layer hides its
//! descriptors and has no pooling backward): one handle per device and, per [`DnnDesc`], the
//! descriptors and the algorithm, made once and cached.
//!
//! The algorithm is chosen by measurement (cuDNN's `Find`, as PyTorch's benchmark mode does) the
//! first time a shape is prepared, among those whose workspace fits [`WORKSPACE_LIMIT`], and the
//! math type that algorithm was measured with is set on the descriptor. f32 runs in exact f32
//! (FMA math, no TF32) unless `RUSTYTORCH_ALLOW_TF32=1`; f16/bf16 on tensor cores with f32
//! accumulation; f64 in f64.
//!
//! Convolution forward in f16, bf16 and f32 also goes through cuDNN's graph API
//! ([`super::dnn_graph`]): the plans of the engine configurations its heuristics propose are
//! timed on scratch buffers of the step's sizes against the legacy algorithm (with the legacy bias
//! add and activation when the step has them), and the fastest is kept, so the graph path never
//! makes a step slower. With a bias or an activation ([`DnnDesc::act`]) the graph holds them as
//! pointwise nodes after the convolution, which cuDNN's runtime-fusion engines run in the
//! convolution's epilogue. `RUSTYTORCH_CUDNN_GRAPH=0` (read when a step is prepared) keeps the
//! legacy path alone. The legacy path applies ReLU with `cudnnActivationForward`; it has no GELU,
//! so a GELU step with no graph engine is refused (see [`fused_act_supported`]).

use super::dnn_graph::{self, GraphPlan};
use crate::{Result, RuntimeError};
use cudarc::cudnn::{result as dn, sys};
use cudarc::driver::{result as dr, sys as ds};
use rustytorch_codegen::cuda::dnn::{DnnDesc, DnnKind, DnnPoolMode};
use rustytorch_codegen::CodegenError;
use rustytorch_ops::{Activation, DType};
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The largest workspace a convolution algorithm may use.
pub const WORKSPACE_LIMIT: usize = 1 << 30;

/// Graph-API plans timed per convolution (the first ones the heuristics rank).
const MAX_PLANS: usize = 12;
/// Untimed runs before the timed ones, and timed runs, per candidate.
const WARMUP_RUNS: usize = 2;
const TIMED_RUNS: usize = 5;

/// Whether convolution forward may use cuDNN's graph API (`RUSTYTORCH_CUDNN_GRAPH=0` turns it
/// off, for A/B measurement); read when a step is prepared.
pub fn graph_enabled() -> bool {
    std::env::var("RUSTYTORCH_CUDNN_GRAPH").as_deref() != Ok("0")
}

/// How many convolution steps (since the process started) had graph-API plans timed against the
/// legacy calls, and how many of them kept a graph plan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Steps whose graph plans were timed.
    pub timed: usize,
    /// Of those, the steps that kept a graph plan.
    pub graph_won: usize,
}

static TIMED: AtomicUsize = AtomicUsize::new(0);
static GRAPH_WON: AtomicUsize = AtomicUsize::new(0);

/// The counts of [`GraphStats`] so far.
pub fn graph_stats() -> GraphStats {
    GraphStats {
        timed: TIMED.load(Ordering::Relaxed),
        graph_won: GRAPH_WON.load(Ordering::Relaxed),
    }
}

/// Whether every CUDA convolution forward step can apply activation `act` after its bias (on any
/// cuDNN, with or without a graph engine for the fused pattern). A lowering should leave `act` on a
/// [`DnnDesc`] only when this holds, and emit its own activation kernel after the step otherwise:
/// GELU is applied by cuDNN only through graph engines, which a given shape may lack.
pub fn fused_act_supported(act: Activation) -> bool {
    matches!(act, Activation::None | Activation::Relu)
}

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
    /// The legacy activation applied after the bias (ReLU).
    act: Option<sys::cudnnActivationDescriptor_t>,
    /// Whether the legacy calls compute the whole step (false for an activation they lack).
    legacy_ok: bool,
    algo: Algo,
    /// The graph-API plan, when it measured faster than the legacy calls.
    graph: Option<GraphPlan>,
    /// Bytes of scratch the call needs (workspace, or the recomputed forward result).
    scratch: usize,
}

/// cuDNN state of one device.
pub struct Dnn {
    pub(crate) handle: sys::cudnnHandle_t,
    /// Per descriptor and whether the graph API may be used (whether TF32 is allowed is fixed
    /// for the handle's life).
    cache: HashMap<(DnnDesc, bool), Prepared>,
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
pub(crate) fn strides(dims: &[i32], nhwc: bool) -> Vec<i32> {
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
    /// needs; `graph` lets a convolution forward use the graph API ([`graph_enabled`]), and
    /// [`Dnn::run`] must be given the same. Choosing the algorithm runs cuDNN's benchmark on the
    /// device's stream (on scratch buffers of its own), so this must not be called during stream
    /// capture.
    pub(crate) fn prepare(
        &mut self,
        d: &DnnDesc,
        graph: bool,
        stream: sys::cudaStream_t,
    ) -> Result<usize> {
        let key = (d.clone(), graph);
        if !self.cache.contains_key(&key) {
            // SAFETY: the handle is live; the stream belongs to the device's context.
            unsafe { dn::set_stream(self.handle, stream) }.map_err(|e| err("set stream", e))?;
            let mut p = Prepared {
                x: std::ptr::null_mut(),
                y: std::ptr::null_mut(),
                w: None,
                conv: None,
                pool: None,
                bias: None,
                act: None,
                legacy_ok: true,
                algo: Algo::None,
                graph: None,
                scratch: 0,
            };
            let made = self.make(d, &mut p).and_then(|()| {
                if graph && dnn_graph::covers(d) {
                    self.choose_graph(d, &mut p, stream)
                } else {
                    Ok(())
                }
            });
            let made = made.and_then(|()| {
                if p.legacy_ok || p.graph.is_some() {
                    Ok(())
                } else {
                    Err(RuntimeError::Codegen(CodegenError::Unsupported {
                        op: "conv",
                        device: "cuda",
                        reason: format!(
                            "cuDNN applies {:?} after a convolution only through a graph engine, \
                             and none takes {d:?}: apply the activation in a kernel after the step",
                            d.act
                        ),
                    }))
                }
            });
            if let Err(e) = made {
                destroy(&p);
                return Err(e);
            }
            self.cache.insert(key.clone(), p);
        }
        Ok(self.cache[&key].scratch)
    }

    /// Times the graph-API plans of `d` against the legacy calls chosen by [`Dnn::make`] on
    /// scratch buffers of the step's sizes, and keeps the fastest in `p`. A failure of the graph
    /// path leaves the legacy calls in place.
    fn choose_graph(&self, d: &DnnDesc, p: &mut Prepared, stream: sys::cudaStream_t) -> Result<()> {
        let plans = match dnn_graph::plans(self.handle, d, self.tf32, MAX_PLANS) {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!("cuDNN graph API refused {d:?}: {e}");
                vec![]
            }
        };
        if plans.is_empty() {
            return Ok(());
        }
        match self.time_candidates(d, p, plans, stream) {
            Ok(()) => Ok(()),
            Err(e) if p.legacy_ok => {
                tracing::debug!("cuDNN graph plans of {d:?} could not be timed: {e}");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    fn time_candidates(
        &self,
        d: &DnnDesc,
        p: &mut Prepared,
        mut plans: Vec<GraphPlan>,
        stream: sys::cudaStream_t,
    ) -> Result<()> {
        let el = d.dtype.size_bytes();
        let count = |v: &[i32]| v.iter().map(|&x| x as usize).product::<usize>();
        let ws = plans
            .iter()
            .map(|g| g.workspace)
            .max()
            .unwrap_or(0)
            .max(p.scratch);
        let bias_bytes = if d.bias { d.y[1] as usize * el } else { 0 };
        let bufs = Buffers::new(
            &[
                count(&d.x) * el,
                count(&d.w) * el,
                count(&d.y) * el,
                bias_bytes,
                ws,
            ],
            d.dtype,
            stream as ds::CUstream,
        )?;
        let [x, w, y, bias, workspace] = [0, 1, 2, 3, 4].map(|i| bufs.ptrs[i]);
        let at = DnnPtrs {
            x,
            w,
            y,
            bias,
            workspace,
        };
        let mut ptrs = vec![x, w, y];
        if d.bias {
            ptrs.push(bias);
        }
        let cu = stream as ds::CUstream;
        let legacy = if p.legacy_ok {
            time(cu, || legacy_forward(self.handle, d, p, &at)).ok()
        } else {
            None
        };
        let mut best: Option<(usize, f32)> = None;
        for (i, g) in plans.iter_mut().enumerate() {
            match time(cu, || g.execute(self.handle, &ptrs, workspace)) {
                Ok(t) if best.is_none_or(|(_, b)| t < b) => best = Some((i, t)),
                Ok(_) => {}
                Err(e) => tracing::trace!("cuDNN engine {} failed on {d:?}: {e}", g.engine),
            }
        }
        let Some((i, t)) = best else {
            return Err(RuntimeError::Device(format!(
                "cuDNN: no graph plan of {d:?} ran"
            )));
        };
        let g = plans.swap_remove(i);
        TIMED.fetch_add(1, Ordering::Relaxed);
        if legacy.is_none_or(|l| t < l) {
            GRAPH_WON.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                "cuDNN {d:?}: graph engine {} ({t:.4} ms) over legacy {:?} ({legacy:?} ms)",
                g.engine,
                algo_name(p.algo)
            );
            // The legacy calls stay for pointers less aligned than the plan was made for.
            p.scratch = p.scratch.max(g.workspace);
            p.graph = Some(g);
        } else {
            tracing::debug!(
                "cuDNN {d:?}: legacy {:?} ({legacy:?} ms) over graph engine {} ({t:.4} ms)",
                algo_name(p.algo),
                g.engine
            );
        }
        Ok(())
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
        if d.kind == DnnKind::ConvForward {
            match d.act {
                Activation::None => {}
                Activation::Relu => {
                    let a = dn::create_activation_descriptor()
                        .map_err(|e| err("activation descriptor", e))?;
                    p.act = Some(a);
                    // SAFETY: `a` is live.
                    unsafe {
                        dn::set_activation_descriptor(
                            a,
                            sys::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU,
                            sys::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN,
                            0.0,
                        )
                    }
                    .map_err(|e| err("activation descriptor", e))?;
                }
                Activation::GeluErf | Activation::GeluTanh => p.legacy_ok = false,
            }
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

    /// Runs `d`, made by [`Dnn::prepare`] beforehand with the same `graph`, on `stream` over the
    /// tensors at `at`.
    pub(crate) fn run(
        &mut self,
        d: &DnnDesc,
        graph: bool,
        at: &DnnPtrs,
        stream: sys::cudaStream_t,
    ) -> Result<()> {
        let h = self.handle;
        let p = self.cache.get_mut(&(d.clone(), graph)).ok_or_else(|| {
            RuntimeError::Invalid(format!("cuDNN step {:?} was not prepared", d.kind))
        })?;
        // SAFETY: the handle is live; the stream belongs to the device's context.
        unsafe { dn::set_stream(h, stream) }.map_err(|e| err("set stream", e))?;
        if let Some(g) = &mut p.graph {
            let mut ptrs = vec![at.x, at.w, at.y];
            if d.bias {
                ptrs.push(at.bias);
            }
            if GraphPlan::aligned(&ptrs, at.workspace) {
                return g.execute(h, &ptrs, at.workspace);
            }
        }
        let p = &*p;
        if !p.legacy_ok {
            return Err(RuntimeError::Invalid(format!(
                "cuDNN step {:?}: the tensors are not {}-byte aligned, which the graph plan of its \
                 activation needs",
                d.kind,
                dnn_graph::ALIGNMENT
            )));
        }
        let one_zero = Scale::new(d.dtype, 1.0, 0.0);
        let (a, b) = one_zero.ptrs();
        let ptr = |v: u64| v as *const c_void;
        let mptr = |v: u64| v as *mut c_void;
        let (ws, ws_bytes) = (mptr(at.workspace), p.scratch);
        // SAFETY: the descriptors are live and describe the step's buffers, whose sizes the
        // plan's types fix; the scratch holds `p.scratch` bytes; alpha and beta point to scalars
        // of the type cuDNN reads for this data type.
        unsafe {
            match (p.algo, d.kind) {
                (Algo::Fwd(_), _) => legacy_forward(h, d, p, at)?,
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

/// The legacy convolution forward of `p`, then its bias add and activation.
fn legacy_forward(h: sys::cudnnHandle_t, d: &DnnDesc, p: &Prepared, at: &DnnPtrs) -> Result<()> {
    let Algo::Fwd(algo) = p.algo else {
        return Err(RuntimeError::Invalid(
            "cuDNN convolution forward was prepared without an algorithm".into(),
        ));
    };
    let (w, conv) = match (p.w, p.conv) {
        (Some(w), Some(c)) => (w, c),
        _ => {
            return Err(RuntimeError::Invalid(
                "cuDNN convolution forward was prepared without its descriptors".into(),
            ))
        }
    };
    let one_zero = Scale::new(d.dtype, 1.0, 0.0);
    let one_one = Scale::new(d.dtype, 1.0, 1.0);
    let (a, b) = one_zero.ptrs();
    let ptr = |v: u64| v as *const c_void;
    let mptr = |v: u64| v as *mut c_void;
    // SAFETY: the descriptors are live and describe the step's buffers at `at`, whose sizes the
    // plan's types fix; the workspace holds at least `p.scratch` bytes; alpha and beta point to
    // scalars of the type cuDNN reads for this data type; the activation runs in place, which
    // cuDNN allows.
    unsafe {
        dn::convolution_forward(
            h,
            a,
            p.x,
            ptr(at.x),
            w,
            ptr(at.w),
            conv,
            algo,
            mptr(at.workspace),
            p.scratch,
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
        if let Some(act) = p.act {
            dn::activation_forward(h, act, a, p.y, ptr(at.y), b, p.y, mptr(at.y))
                .map_err(|e| err("activation", e))?;
        }
    }
    Ok(())
}

fn algo_name(a: Algo) -> String {
    match a {
        Algo::None => "none".into(),
        Algo::Fwd(x) => format!("{x:?}"),
        Algo::BwdData(x) => format!("{x:?}"),
        Algo::BwdFilter(x) => format!("{x:?}"),
    }
}

/// Device buffers for timing candidates (freed when dropped), filled with ones of the data type
/// so that the timed kernels read finite values.
pub(crate) struct Buffers {
    pub(crate) ptrs: Vec<u64>,
}

impl Buffers {
    pub(crate) fn new(bytes: &[usize], dtype: DType, stream: ds::CUstream) -> Result<Buffers> {
        let mut b = Buffers { ptrs: vec![] };
        // 1.0 in f16 and bf16; each f32 becomes 0x3F803F80 (about 1.004).
        let pattern: u16 = if dtype == DType::F16 { 0x3C00 } else { 0x3F80 };
        for &n in bytes {
            // SAFETY: a plain allocation in the current context (the device's, bound by the
            // session that prepares the step); freed once in Drop.
            let p = unsafe { dr::malloc_sync(n.max(256)) }
                .map_err(|e| RuntimeError::Device(format!("timing buffers ({n} bytes): {e}")))?;
            b.ptrs.push(p);
            // SAFETY: `p` holds at least `n` bytes; the fill is ordered on `stream` before the
            // timed calls.
            unsafe { ds::cuMemsetD16Async(p, pattern, n / 2, stream) }
                .result()
                .map_err(|e| RuntimeError::Device(format!("filling timing buffers: {e}")))?;
        }
        Ok(b)
    }
}

impl Drop for Buffers {
    fn drop(&mut self) {
        for &p in &self.ptrs {
            // SAFETY: each pointer came from malloc_sync and is freed once; cuMemFree waits for
            // the work that uses it.
            let _ = unsafe { dr::free_sync(p) };
        }
    }
}

/// A timing event, destroyed when dropped.
struct Event(ds::CUevent);

impl Event {
    fn new() -> Result<Event> {
        dr::event::create(ds::CUevent_flags::CU_EVENT_DEFAULT)
            .map(Event)
            .map_err(|e| RuntimeError::Device(format!("timing event: {e}")))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event was created in `Event::new` and is destroyed once.
        let _ = unsafe { dr::event::destroy(self.0) };
    }
}

/// Milliseconds per call of `f` on `stream`: after a few untimed calls, the mean of a few timed
/// ones between two events.
pub(crate) fn time(stream: ds::CUstream, mut f: impl FnMut() -> Result<()>) -> Result<f32> {
    for _ in 0..WARMUP_RUNS {
        f()?;
    }
    let (start, end) = (Event::new()?, Event::new()?);
    let ev = |e: dr::DriverError| RuntimeError::Device(format!("timing: {e}"));
    // SAFETY: the events are live and `stream` belongs to the current context.
    unsafe { dr::event::record(start.0, stream) }.map_err(ev)?;
    for _ in 0..TIMED_RUNS {
        f()?;
    }
    // SAFETY: as above; `synchronize` waits for the recorded work.
    let ms = unsafe {
        dr::event::record(end.0, stream).map_err(ev)?;
        dr::event::synchronize(end.0).map_err(ev)?;
        dr::event::elapsed(start.0, end.0).map_err(ev)?
    };
    Ok(ms / TIMED_RUNS as f32)
}

/// A driver error as the runtime's, naming what failed.
pub(crate) fn drv(what: &'static str) -> impl Fn(dr::DriverError) -> RuntimeError {
    move |e| RuntimeError::Device(format!("{what}: {e}"))
}

/// Milliseconds per call of `f` as a CUDA graph replays it: one untimed call, then
/// `TIMED_RUNS` calls captured on a private stream into one graph, replayed once untimed and
/// once between two events. Only device time counts: a call's host work (the per-call setup of
/// a cuDNN plan, which for some of its kernels outlasts the kernel) is left out, as it is when
/// the plan runs in a replayed step. `f` enqueues on the stream it is given (a cuDNN caller
/// points its handle there first and back after). `None` when the call cannot be captured.
pub(crate) fn time_replayed(mut f: impl FnMut(ds::CUstream) -> Result<()>) -> Result<Option<f32>> {
    let cs = dr::stream::create(dr::stream::StreamKind::NonBlocking)
        .map_err(drv("creating the timing stream"))?;
    let timed = (|| -> Result<Option<f32>> {
        // Outside capture first: a kernel's module loads on its first launch.
        f(cs)?;
        // SAFETY: `cs` is a fresh stream of the current context.
        unsafe { dr::stream::synchronize(cs) }.map_err(drv("timing warm-up"))?;
        // SAFETY: `cs` is used only here; thread-local capture records what this thread
        // enqueues on it without running it.
        unsafe {
            dr::stream::begin_capture(
                cs,
                ds::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(drv("beginning capture"))?;
        let enq = (0..TIMED_RUNS).try_for_each(|_| f(cs));
        // SAFETY: ends the capture begun above on the same stream.
        let ended = unsafe { dr::stream::end_capture(cs) };
        if enq.is_err() {
            if let Ok(g) = ended {
                if !g.is_null() {
                    // SAFETY: the captured graph is not used again.
                    let _ = unsafe { dr::graph::destroy(g) };
                }
            }
            return Ok(None);
        }
        let graph = match ended {
            Ok(g) if !g.is_null() => g,
            _ => return Ok(None),
        };
        // SAFETY: `graph` was just captured; it and its instance are destroyed below.
        let exec = match unsafe { dr::graph::instantiate(graph, ds::CUgraphInstantiate_flags(0)) } {
            Ok(e) => e,
            Err(_) => {
                // SAFETY: as above.
                let _ = unsafe { dr::graph::destroy(graph) };
                return Ok(None);
            }
        };
        let (start, end) = (Event::new()?, Event::new()?);
        // SAFETY: the instance's buffers are the caller's, live for this call; the events are
        // live; `synchronize` waits for the recorded work before the graph is destroyed.
        let ms = unsafe {
            let run = || -> std::result::Result<f32, dr::DriverError> {
                dr::graph::launch(exec, cs)?;
                dr::event::record(start.0, cs)?;
                dr::graph::launch(exec, cs)?;
                dr::event::record(end.0, cs)?;
                dr::event::synchronize(end.0)?;
                dr::event::elapsed(start.0, end.0)
            };
            let ms = run();
            let _ = dr::stream::synchronize(cs);
            let _ = dr::graph::exec_destroy(exec);
            let _ = dr::graph::destroy(graph);
            ms
        }
        .map_err(drv("timing a replayed call"))?;
        Ok(Some(ms / TIMED_RUNS as f32))
    })();
    // SAFETY: the stream is idle (synchronized above or never used) and destroyed once.
    let _ = unsafe { dr::stream::destroy(cs) };
    timed
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
        if let Some(a) = p.act {
            let _ = sys::cudnnDestroyActivationDescriptor(a);
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
