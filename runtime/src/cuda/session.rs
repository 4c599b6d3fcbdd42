//! A prepared plan on one CUDA device: every buffer allocated and every kernel argument resolved
//! once; a run copies inputs in, launches, copies outputs and guard flags out, and commits the
//! updates with device-to-device copies when every guard passed.

use super::dnn::{drv, DnnPtrs};
use super::dnn_attention;
use super::dnn_graph::GraphPlan;
use super::sparse::SpmmCall;
use super::GpuDevice;
use crate::device::{DeviceInput, DeviceMemory, DeviceOutput, DeviceRunOutput, IoSlot};
use crate::pool::Block;
use crate::timing::{StepClock, StepTime, StepTimes};
use crate::{
    check_param_type, Communicator, Device, MemoryStats, Result, RunOutput, RuntimeError, Session,
    TransferStats,
};
use cudarc::driver::sys::{self as ds, CUstream};
use cudarc::driver::{result as dr, CudaFunction};
use rustytorch_codegen::cuda::matmul::LtActivation;
use rustytorch_codegen::cuda::{
    lower_plan_on, source, ArgRef, CudaStep, DnnDesc, MatmulDesc, Part, StepKernels, Target,
};
use rustytorch_codegen::{Plan, Source, Storage};
use rustytorch_ops::{DType, Data, HostTensor, TensorType};
use std::sync::Arc;

struct Resolved {
    func: CudaFunction,
    args: Vec<u64>,
    /// The value each argument addresses (None: scratch), so that a run on device inputs can
    /// point the arguments elsewhere.
    vals: Vec<Option<usize>>,
    grid: u32,
    block: u32,
    /// Bytes of dynamic shared memory.
    smem: u32,
    /// The parameters passed as tensor maps over their argument (empty: none).
    maps: Vec<Option<rustytorch_codegen::cuda::ir::TensorMap>>,
    /// The maps encoded over `args`, at the first launch on them (a run re-pointed to other
    /// buffers encodes its own).
    encoded: std::sync::OnceLock<Vec<cudarc::driver::sys::CUtensorMap>>,
}

impl Resolved {
    /// Launches on `stream` with `args` (the resolved ones, or re-pointed).
    ///
    /// # Safety
    ///
    /// `args` address live buffers of the sizes the kernel's parameters need, in its order.
    unsafe fn launch_with(&self, args: &[u64], stream: CUstream) -> Result<()> {
        let dims = (self.grid, self.block, self.smem);
        let fresh;
        let encoded = if self.maps.is_empty() {
            &[][..]
        } else if args == self.args.as_slice() {
            match self.encoded.get() {
                Some(e) => e,
                None => {
                    let _ = self.encoded.set(super::encode_maps(&self.maps, args)?);
                    self.encoded.get().expect("set above")
                }
            }
        } else {
            fresh = super::encode_maps(&self.maps, args)?;
            &fresh
        };
        // SAFETY: the caller's contract; the maps are the kernel's own parameter kinds, encoded
        // over these arguments.
        unsafe { super::launch_params(&self.func, dims, args, &self.maps, encoded, stream) }
            .map_err(|e| RuntimeError::Device(format!("kernel launch failed: {e}")))
    }
}

/// The address of value `v` for this run: `io`'s when the run re-points values (device I/O),
/// else the one resolved at prepare.
fn pick(addr: u64, v: Option<usize>, io: Option<&[u64]>) -> u64 {
    match (io, v) {
        (Some(t), Some(v)) => t[v],
        _ => addr,
    }
}

/// An attention call's pointer: the address resolved at prepare, the value it lies in, and its
/// byte offset into that value (a packed q, k or v, or its gradient; else 0).
type AttnPtr = (u64, Option<usize>, u64);

/// [`pick`] for an [`AttnPtr`]: the offset stays when the run re-points the value.
fn pick_attn(p: AttnPtr, io: Option<&[u64]>) -> u64 {
    match (io, p.1) {
        (Some(t), Some(v)) => t[v] + p.2,
        _ => p.0,
    }
}

/// `at` moved `off` bytes into its value.
fn offset_by((a, v): (u64, Option<usize>), off: u64) -> AttnPtr {
    (a + off, v, off)
}

enum Exec {
    Kernels(Vec<Resolved>),
    Matmul {
        desc: MatmulDesc,
        a: u64,
        b: u64,
        d: u64,
        bias: Option<u64>,
        /// C of an accumulating call.
        c: Option<u64>,
        /// The values of a, b, d, the bias and C.
        vals: [Option<usize>; 5],
        /// The bias gradient's buffer and value of a `bgrad` call.
        bgrad: Option<(u64, Option<usize>)>,
        after: Vec<Resolved>,
    },
    Dnn {
        desc: DnnDesc,
        before: Vec<Resolved>,
        /// Device addresses of x, w, y (convolutions) or of operands 0, 1 and the output
        /// (pooling), and of the bias.
        ptrs: DnnPtrs,
        /// The values of `ptrs`' x, w, y and bias (None: scratch or absent).
        vals: [Option<usize>; 4],
        after: Vec<Resolved>,
        /// Whether the step was prepared with cuDNN's graph API allowed.
        graph: bool,
    },
    Spmm(SpmmCall),
    /// Attention: the cuDNN plan chosen at prepare, or the flash kernel (no plan, or pointers
    /// less aligned than the plan was made for).
    Attention {
        plan: Option<std::sync::Mutex<GraphPlan>>,
        /// q, k, v and the output: addresses and values; then the statistics' address when
        /// the plan writes them for a later gradient step.
        ptrs: Vec<AttnPtr>,
        workspace: u64,
        flash: Vec<Resolved>,
    },
    /// The three gradients of one attention: cuDNN's plans chosen at prepare, or the flash
    /// kernels (no plans, or pointers less aligned than the plans need).
    AttentionGrad {
        plans: Option<Box<std::sync::Mutex<dnn_attention::GradPlans>>>,
        /// q, k, v, dO, dQ, dK and dV: addresses and values; then the forward's O and
        /// statistics when it saved them (address 0 when not).
        ptrs: [AttnPtr; 9],
        workspace: u64,
        flash: Vec<Resolved>,
    },
    /// GEMMs and launches in order (see `Composite`).
    Composite(Vec<ExecPart>),
    /// `all_reduce` from `src` into `dst` (addresses and values) over the joined group, or a
    /// copy when the session runs alone.
    AllReduce {
        mean: bool,
        src: (u64, Option<usize>),
        dst: (u64, Option<usize>),
        ty: TensorType,
    },
    Nothing,
}

/// A resolved part of a composite step.
enum ExecPart {
    /// cuBLASLt's A, B and D addresses and their values.
    Gemm(MatmulDesc, [(u64, Option<usize>); 3]),
    Launch(Resolved),
}

/// Where a sparse op's pattern component comes from: checked at prepare (a constant) or before
/// every run (an input), since cuSPARSE and the kernels read it unchecked.
#[derive(Clone)]
enum PatternPart {
    Const(Arc<HostTensor>),
    Input(usize),
}

/// The pattern of one sparse step, checked like the CPU kernels check it.
#[derive(Clone)]
struct PatternCheck {
    step: usize,
    rows: usize,
    cols: usize,
    row_ptr: PatternPart,
    col_idx: PatternPart,
}

impl PatternCheck {
    /// The check of step `i`'s pattern, or None for a step that is not a sparse op.
    fn of(plan: &Plan, i: usize) -> Result<Option<PatternCheck>> {
        let step = &plan.steps[i];
        let (rows, cols) = match &step.op {
            rustytorch_ops::Op::SparseMatmul { rows, cols, .. } => (*rows, *cols),
            rustytorch_ops::Op::SampledMatmul => (
                plan.types[step.inputs[2]].shape.dims()[0],
                plan.types[step.inputs[3]].shape.dims()[0],
            ),
            _ => return Ok(None),
        };
        let part = |v: usize| match &plan.sources[v] {
            Source::Const(t) => Ok(PatternPart::Const(t.clone())),
            Source::Input(j) => Ok(PatternPart::Input(*j)),
            _ => Err(RuntimeError::Codegen(
                rustytorch_codegen::CodegenError::Unsupported {
                    op: step.op.name(),
                    device: "cuda",
                    reason: "the pattern (row_ptr, col_idx) of a sparse op must be a graph \
                             constant or input on CUDA, where it is checked before use"
                        .into(),
                },
            )),
        };
        Ok(Some(PatternCheck {
            step: i,
            rows,
            cols,
            row_ptr: part(step.inputs[0])?,
            col_idx: part(step.inputs[1])?,
        }))
    }

    /// Whether the check reads run inputs (else it was done at prepare).
    fn reads_inputs(&self) -> bool {
        matches!(self.row_ptr, PatternPart::Input(_))
            || matches!(self.col_idx, PatternPart::Input(_))
    }

    fn run(&self, plan: &Plan, inputs: &[Arc<HostTensor>]) -> Result<()> {
        let get = |p: &PatternPart| match p {
            PatternPart::Const(t) => t.clone(),
            PatternPart::Input(j) => inputs[*j].clone(),
        };
        let (rp, ci) = (get(&self.row_ptr), get(&self.col_idx));
        let op = plan.steps[self.step].op.name();
        let r = match (rp.data(), ci.data()) {
            (Data::I32(a), Data::I32(b)) => {
                rustytorch_ops::sparse::check_csr_pattern(op, self.rows, self.cols, a, b, false)
            }
            (Data::I64(a), Data::I64(b)) => {
                rustytorch_ops::sparse::check_csr_pattern(op, self.rows, self.cols, a, b, false)
            }
            _ => {
                return Err(RuntimeError::Invalid(format!(
                    "step {} ({op}): row_ptr and col_idx must both be i32 or both be i64",
                    self.step
                )))
            }
        };
        r.map_err(|source| RuntimeError::Kernel {
            step: self.step,
            op,
            source,
        })
    }
}

/// A plan prepared on a CUDA device (see the module docs).
pub struct CudaSession {
    dev: Arc<GpuDevice>,
    plan: Arc<Plan>,
    blocks: Vec<Block>,
    /// Device address of every value.
    ptrs: Vec<u64>,
    inputs: Vec<u64>,
    params: Vec<u64>,
    exec: Vec<(usize, Exec)>,
    /// Sparse patterns that arrive as inputs, checked before every run.
    pattern_checks: Vec<PatternCheck>,
    /// The scratch buffer every step shares (the largest any step needs).
    scratch: u64,
    transfers: TransferStats,
    /// Replay a captured CUDA graph after the first run.
    replay: bool,
    graph: Option<Graph>,
    runs: u64,
    replays: u64,
    /// Time every step of the following runs with events (runs are then eager, not replayed).
    step_timing: bool,
    /// One event before the first step and one after each step (created on first use).
    events: Events,
    /// The step times of the last timed run.
    last_times: Option<StepTimes>,
    /// The data-parallel group its `all_reduce` steps reduce over (an NCCL rank on this
    /// device); None: a group of one, where they copy.
    group: Option<Arc<dyn Communicator>>,
    /// With two or more bool-scalar guards: kernels copying them into `guard_bytes`, one byte
    /// each in plan order, so that a run reads them back in one copy.
    guard_gather: Vec<Resolved>,
    guard_bytes: u64,
}

/// Timing events of a session.
struct Events(Vec<ds::CUevent>);

// SAFETY: as for `Graph`: plain driver objects of one session, used through `&mut CudaSession`
// after binding the context, destroyed once.
unsafe impl Send for Events {}

/// A captured CUDA graph of a session's launches and its executable form.
struct Graph {
    graph: ds::CUgraph,
    exec: ds::CUgraphExec,
}

// SAFETY: the handles are plain driver objects owned by one session; they are used only through
// `&mut CudaSession` (one thread at a time), after binding the context, and destroyed once.
unsafe impl Send for Graph {}

/// Copies a host tensor's elements to `dst` on `stream`, straight from its typed storage (f16 and
/// bf16 are their bit patterns, bool one byte 0/1 on both sides); returns the bytes copied.
pub(crate) fn htod(
    dst: u64,
    t: &HostTensor,
    stream: cudarc::driver::sys::CUstream,
) -> Result<usize> {
    fn copy<T>(dst: u64, v: &[T], stream: cudarc::driver::sys::CUstream) -> Result<usize> {
        if v.is_empty() {
            return Ok(0);
        }
        // SAFETY: `dst` is a live pool block sized from this tensor's type, so it holds
        // `size_of_val(v)` bytes; a pageable async copy returns once the source is staged.
        unsafe { dr::memcpy_htod_async(dst, v, stream) }.map_err(drv("copying to the device"))?;
        Ok(std::mem::size_of_val(v))
    }
    match t.data() {
        Data::F32(v) => copy(dst, v, stream),
        Data::F64(v) => copy(dst, v, stream),
        Data::F16(v) => copy(dst, v, stream),
        Data::BF16(v) => copy(dst, v, stream),
        Data::I32(v) => copy(dst, v, stream),
        Data::I64(v) => copy(dst, v, stream),
        Data::U8(v) => copy(dst, v, stream),
        Data::Bool(v) => copy(dst, v, stream),
        Data::I8(v) => copy(dst, v, stream),
        Data::I16(v) => copy(dst, v, stream),
        Data::U16(v) => copy(dst, v, stream),
        Data::U32(v) => copy(dst, v, stream),
        Data::U64(v) => copy(dst, v, stream),
    }
}

/// Copies `ty`'s elements from `src` into a new host tensor (bool read as bytes, nonzero = true,
/// so no byte pattern can make an invalid `bool`).
pub(crate) fn dtoh(
    src: u64,
    ty: &TensorType,
    stream: cudarc::driver::sys::CUstream,
) -> Result<HostTensor> {
    fn copy<T: Clone + Default>(
        src: u64,
        n: usize,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<Vec<T>> {
        let mut v = vec![T::default(); n];
        if n > 0 {
            // SAFETY: `src` addresses a live buffer of `n` elements of `T`'s size; every bit
            // pattern is a valid `T` for the types used here; a copy to pageable memory
            // completes before it returns.
            unsafe { dr::memcpy_dtoh_async(&mut v, src, stream) }
                .map_err(drv("copying from the device"))?;
        }
        Ok(v)
    }
    let n = ty.shape.numel();
    let data = match ty.dtype {
        DType::F32 => Data::F32(copy(src, n, stream)?.into()),
        DType::F64 => Data::F64(copy(src, n, stream)?.into()),
        DType::F16 => Data::F16(copy(src, n, stream)?.into()),
        DType::BF16 => Data::BF16(copy(src, n, stream)?.into()),
        DType::I32 => Data::I32(copy(src, n, stream)?.into()),
        DType::I64 => Data::I64(copy(src, n, stream)?.into()),
        DType::U8 => Data::U8(copy(src, n, stream)?.into()),
        DType::I8 => Data::I8(copy(src, n, stream)?.into()),
        DType::I16 => Data::I16(copy(src, n, stream)?.into()),
        DType::U16 => Data::U16(copy(src, n, stream)?.into()),
        DType::U32 => Data::U32(copy(src, n, stream)?.into()),
        DType::U64 => Data::U64(copy(src, n, stream)?.into()),
        DType::Bool => Data::Bool(
            copy::<u8>(src, n, stream)?
                .into_iter()
                .map(|b| b != 0)
                .collect(),
        ),
    };
    HostTensor::from_data(data, ty.shape.clone())
        .map_err(|e| RuntimeError::Invalid(format!("device result: {e}")))
}

/// Makes `consumer` wait for the work queued on `producer` so far (an event recorded on
/// `producer`, waited for on `consumer`; nothing when they are the same stream). Never a
/// device-wide synchronize.
///
/// # Safety
///
/// Both must be live streams of the context bound to this thread (1 and 2 name the legacy and
/// per-thread default streams).
pub(crate) unsafe fn stream_wait(consumer: CUstream, producer: CUstream) -> Result<()> {
    if consumer == producer {
        return Ok(());
    }
    let ev = dr::event::create(ds::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        .map_err(drv("creating an event"))?;
    // SAFETY: the event was just created; the streams are live (the caller's contract). An
    // event may be destroyed with a wait pending: the driver releases it after the wait.
    let r = unsafe {
        dr::event::record(ev, producer).and_then(|_| {
            dr::stream::wait_event(consumer, ev, ds::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        })
    };
    // SAFETY: destroyed once, as above.
    let _ = unsafe { dr::event::destroy(ev) };
    r.map_err(drv("ordering the streams"))
}

/// A pool block handed out as a run's output: reserved until the last reference drops (on any
/// thread), then given back ordered after the work its consumers queued on their streams.
struct OutputBlock {
    dev: Arc<GpuDevice>,
    addr: u64,
    block: Option<crate::pool::Block>,
    /// Consumers' streams (`CUstream` integers) to wait for before reuse.
    users: std::sync::Mutex<Vec<u64>>,
}

impl DeviceMemory for OutputBlock {
    fn addr(&self) -> u64 {
        self.addr
    }

    fn used_on(&self, stream: u64) {
        if let Ok(mut u) = self.users.lock() {
            if !u.contains(&stream) {
                u.push(stream);
            }
        }
    }
}

impl Drop for OutputBlock {
    fn drop(&mut self) {
        let Some(b) = self.block.take() else {
            return;
        };
        if self.dev.bind().is_err() {
            // The context is gone: nothing can use the block any more.
            return;
        }
        let ours = self.dev.stream.cu_stream();
        let users = self.users.get_mut().map(std::mem::take).unwrap_or_default();
        for u in users {
            // SAFETY: the context is bound; a consumer's stream named at hand-over is live
            // while it reads the tensor (a failure, e.g. a stream destroyed since, leaves the
            // order as it was).
            let _ = unsafe { stream_wait(ours, u as usize as CUstream) };
        }
        // Stream-ordered: the block's next user is queued on our stream after those waits.
        self.dev.free(b);
    }
}

impl CudaSession {
    /// Prepares `plan` on `dev` with the initial parameter values.
    pub fn new(
        dev: Arc<GpuDevice>,
        plan: Arc<Plan>,
        params: &[Arc<HostTensor>],
    ) -> Result<CudaSession> {
        let _span = tracing::info_span!("cuda_prepare", steps = plan.steps.len()).entered();
        dev.bind()?;
        // Lower first: an op without a CUDA implementation fails before anything is allocated.
        let steps = lower_plan_on(&plan, Target::of(dev.cc), dev.sm_count)?;
        if params.len() != plan.param_types.len() {
            return Err(RuntimeError::Invalid(format!(
                "{} parameter values for {} parameters",
                params.len(),
                plan.param_types.len()
            )));
        }
        let mut s = CudaSession {
            dev: dev.clone(),
            plan: plan.clone(),
            blocks: vec![],
            ptrs: vec![0; plan.types.len()],
            inputs: vec![],
            params: vec![],
            exec: vec![],
            pattern_checks: vec![],
            scratch: 0,
            transfers: TransferStats::default(),
            replay: std::env::var("RUSTYTORCH_CUDA_GRAPH").as_deref() != Ok("0"),
            graph: None,
            runs: 0,
            replays: 0,
            step_timing: false,
            events: Events(Vec::new()),
            last_times: None,
            group: None,
            guard_gather: vec![],
            guard_bytes: 0,
        };
        // Buffers: arena, inputs, parameters, constants, scratch. On error, Drop frees them.
        let arena = s.alloc(plan.arena_bytes)?;
        for (_, ty) in &plan.inputs {
            let b = s.alloc(ty.size_bytes())?;
            s.inputs.push(b);
        }
        for (i, p) in params.iter().enumerate() {
            check_param_type(&plan, i, p)?;
            let b = s.alloc(p.ty().size_bytes())?;
            s.params.push(b);
            s.upload(b, p)?;
        }
        for v in 0..plan.types.len() {
            s.ptrs[v] = match (&plan.sources[v], plan.storage[v]) {
                (Source::Input(i), _) => s.inputs[*i],
                (Source::Param(i), _) => s.params[*i],
                (Source::Const(t), _) => {
                    let b = s.alloc(t.ty().size_bytes())?;
                    s.upload(b, t)?;
                    b
                }
                (Source::Step(_), Storage::Arena { offset, .. }) => arena + offset as u64,
                (Source::Step(_), Storage::Alias(of)) => s.ptrs[of],
                (Source::Step(_), Storage::Provided) => {
                    return Err(RuntimeError::Invalid(format!(
                        "value {v} is computed but has no arena slot"
                    )))
                }
            };
        }
        // cuDNN steps learn their scratch (workspace) once their algorithm is chosen.
        let stream = dev.stream.cu_stream();
        let dnn_graph = super::dnn::graph_enabled();
        let mut scratch_bytes = 0;
        let mut spmm_calls: Vec<Option<SpmmCall>> = Vec::with_capacity(steps.len());
        let attn_choice = rustytorch_codegen::cuda::attention_cudnn::Choice::from_env();
        let mut attn_prep: Vec<Option<dnn_attention::Prepared>> =
            (0..steps.len()).map(|_| None).collect();
        let mut grad_prep: Vec<Option<dnn_attention::GradPlans>> =
            (0..steps.len()).map(|_| None).collect();
        // Per gradient step, the forward's saved O and statistics (value, statistics offset);
        // the forwards (by value) some gradient step reads them from; those whose plans write
        // them.
        let saved_at: Vec<Option<(usize, usize)>> = (0..steps.len())
            .map(|i| rustytorch_codegen::cuda::saved_stats(&plan, &steps, i))
            .collect();
        let read: std::collections::HashSet<usize> =
            saved_at.iter().flatten().map(|&(v, _)| v).collect();
        let mut saving: std::collections::HashSet<usize> = Default::default();
        for (i, st) in steps.iter().enumerate() {
            if let Some(c) = PatternCheck::of(&plan, i)? {
                if c.reads_inputs() {
                    s.pattern_checks.push(c);
                } else {
                    c.run(&plan, &[])?;
                }
            }
            let mut call = None;
            if let CudaStep::Spmm(desc) = st {
                let step = &plan.steps[i];
                let ins: Vec<u64> = step.inputs.iter().map(|&v| s.ptrs[v]).collect();
                let out = s.ptrs[step.output];
                call = Some(dev.with_sparse(|sp| sp.prepare_spmm(desc, &ins, out, stream as _))?);
            }
            let call_bytes = call.as_ref().map_or(0, |c| c.buffer);
            spmm_calls.push(call);
            scratch_bytes = scratch_bytes.max(match st {
                CudaStep::Spmm(_) => call_bytes,
                CudaStep::Composite(c) => c.scratch_bytes,
                CudaStep::Kernels(k) => k.scratch_bytes,
                CudaStep::Matmul { after, bgrad, .. } => {
                    after.scratch_bytes.max(bgrad.scratch_bytes)
                }
                CudaStep::Attention {
                    cudnn,
                    flash,
                    saves,
                } => {
                    use rustytorch_codegen::cuda::attention_cudnn::Choice;
                    dev.ctx.bind_to_thread().map_err(|e| {
                        RuntimeError::Device(format!("binding the CUDA context: {e}"))
                    })?;
                    // A forward whose gradient step reads its statistics runs cuDNN's forward
                    // with statistics; if cuDNN makes none, the gradient recomputes them, or
                    // (`saves`: the flash kernel writes them too) the flash kernel runs.
                    let reads = read.contains(&plan.steps[i].output);
                    if attn_choice != Choice::Flash && (reads || *saves) {
                        match dev.with_dnn(|dn| {
                            dnn_attention::prepare_saving(dn.handle, cudnn, stream as _)
                        }) {
                            Ok(g) => {
                                saving.insert(plan.steps[i].output);
                                let ws = g.workspace;
                                attn_prep[i] = Some(dnn_attention::Prepared {
                                    plans: vec![g],
                                    decided: true,
                                });
                                scratch_bytes = scratch_bytes.max(flash.scratch_bytes.max(ws));
                                continue;
                            }
                            Err(e) if attn_choice == Choice::Cudnn => {
                                return Err(RuntimeError::Device(format!(
                                    "step {i} (attention forward with statistics): {e}"
                                )))
                            }
                            Err(e) if *saves => {
                                tracing::debug!(
                                    "step {i}: the flash kernel writes the statistics: {e}"
                                );
                                attn_prep[i] = Some(dnn_attention::Prepared {
                                    plans: vec![],
                                    decided: true,
                                });
                                scratch_bytes = scratch_bytes.max(flash.scratch_bytes);
                                continue;
                            }
                            Err(e) => tracing::debug!(
                                "step {i}: attention forward without statistics: {e}"
                            ),
                        }
                    }
                    let p = match attn_choice {
                        Choice::Flash => Ok(dnn_attention::Prepared {
                            plans: vec![],
                            decided: true,
                        }),
                        _ => {
                            dev.with_dnn(|dn| dnn_attention::prepare(dn.handle, cudnn, attn_choice))
                        }
                    };
                    let p = match p {
                        Ok(p) => p,
                        Err(e) if attn_choice == Choice::Cudnn => {
                            return Err(RuntimeError::Device(format!("step {i} (attention): {e}")))
                        }
                        Err(e) => {
                            tracing::debug!("step {i}: attention runs the flash kernel: {e}");
                            dnn_attention::Prepared {
                                plans: vec![],
                                decided: true,
                            }
                        }
                    };
                    let ws = p.workspace();
                    attn_prep[i] = Some(p);
                    flash.scratch_bytes.max(ws)
                }
                CudaStep::AttentionGrad { cudnn, flash } => {
                    use rustytorch_codegen::cuda::attention_cudnn::Choice;
                    dev.ctx.bind_to_thread().map_err(|e| {
                        RuntimeError::Device(format!("binding the CUDA context: {e}"))
                    })?;
                    let p = match attn_choice {
                        Choice::Flash => Ok(None),
                        _ => dev.with_dnn(|dn| {
                            dnn_attention::prepare_grad(dn.handle, cudnn, attn_choice, stream as _)
                        }),
                    };
                    let p = match p {
                        Ok(p) => p,
                        Err(e) if attn_choice == Choice::Cudnn => {
                            return Err(RuntimeError::Device(format!(
                                "step {i} (attention gradients): {e}"
                            )))
                        }
                        Err(e) => {
                            tracing::debug!(
                                "step {i}: attention gradients run the flash kernels: {e}"
                            );
                            None
                        }
                    };
                    let ws = p.as_ref().map_or(0, |g| g.workspace());
                    grad_prep[i] = p;
                    flash.scratch_bytes.max(ws)
                }
                CudaStep::Dnn(d) => {
                    // Timing the graph API's plans allocates buffers in the device's context.
                    dev.ctx.bind_to_thread().map_err(|e| {
                        RuntimeError::Device(format!("binding the CUDA context: {e}"))
                    })?;
                    let ws = dev.with_dnn(|dn| dn.prepare(&d.desc, dnn_graph, stream as _))?;
                    // The workspace follows the staging buffers; a step without a workspace
                    // needs the staging alone (0 when it stages nothing).
                    if ws > 0 {
                        d.desc.workspace_offset() + ws
                    } else {
                        d.desc.staging_bytes
                    }
                }
                CudaStep::Alias
                | CudaStep::Sibling
                | CudaStep::Merged(_)
                | CudaStep::AllReduce { .. } => 0,
            });
        }
        let scratch = s.alloc(scratch_bytes)?;
        s.scratch = scratch;

        // Compile (or fetch from the caches) every distinct kernel, in parallel.
        let mut sources = vec![];
        for st in &steps {
            let ks = st.launches();
            for l in ks {
                sources.push((l.kernel.name.clone(), source(&l.kernel)?));
            }
        }
        // The guards' gather kernels come last.
        let gathered = plan.guards.len() > 1
            && plan.guards.iter().all(|(_, v)| {
                plan.types[*v].dtype == DType::Bool && plan.types[*v].shape.numel() == 1
            });
        let gathers: Vec<&[(String, usize)]> = if gathered {
            plan.guards
                .chunks(rustytorch_codegen::cuda::merge::GATHER_MAX)
                .collect()
        } else {
            vec![]
        };
        for chunk in &gathers {
            let k = rustytorch_codegen::cuda::merge::gather_guards(chunk.len())?;
            sources.push((k.name.clone(), source(&k)?));
        }
        let funcs = dev.functions(&sources)?;
        for (f, l) in funcs.iter().zip(steps.iter().flat_map(|st| st.launches())) {
            dev.allow_smem(f, l.kernel.smem)?;
        }
        let mut funcs = funcs.into_iter();
        // Per saving forward, where its statistics go past its result.
        let stats_at: Vec<Option<usize>> = plan
            .steps
            .iter()
            .map(|st| {
                saving
                    .contains(&st.output)
                    .then(|| rustytorch_compiler::plan::stats_offset(&plan.types[st.output]))
            })
            .collect();

        for (i, ((step, st), call)) in plan.steps.iter().zip(steps).zip(spmm_calls).enumerate() {
            let out = s.ptrs[step.output];
            let ins: Vec<u64> = step.inputs.iter().map(|&v| s.ptrs[v]).collect();
            // An argument's address and the value it addresses.
            let at_val = |a: ArgRef| match a {
                ArgRef::Input(j) => (ins[j], Some(step.inputs[j])),
                ArgRef::Output => (out, Some(step.output)),
                ArgRef::Scratch => (scratch, None),
                ArgRef::ScratchAt(off) => (scratch + off as u64, None),
                ArgRef::With(k) => (s.ptrs[step.with[k]], Some(step.with[k])),
                ArgRef::Value(v) => (s.ptrs[v], Some(v)),
            };
            let mut resolve = |k: &StepKernels| -> Vec<Resolved> {
                k.launches
                    .iter()
                    .map(|l| Resolved {
                        func: funcs.next().expect("one function per launch"),
                        args: l.args.iter().map(|a| at_val(*a).0).collect(),
                        vals: l.args.iter().map(|a| at_val(*a).1).collect(),
                        grid: l.grid,
                        block: l.kernel.block,
                        smem: l.kernel.smem,
                        maps: if l.kernel.params.iter().any(|p| p.map.is_some()) {
                            l.kernel.params.iter().map(|p| p.map.clone()).collect()
                        } else {
                            vec![]
                        },
                        encoded: Default::default(),
                    })
                    .collect()
            };
            let e = match st {
                CudaStep::Kernels(k) => Exec::Kernels(resolve(&k)),
                CudaStep::Attention { cudnn, flash, .. } => {
                    let flash = resolve(&flash);
                    let p = attn_prep[i].take().expect("prepared above");
                    let plan = if p.plans.is_empty() {
                        None
                    } else {
                        // Every launch of the flash step (the decoding kernels are two, with
                        // scratch), on the step's own buffers.
                        let run_flash = |st: CUstream| -> Result<()> {
                            for r in &flash {
                                // SAFETY: as in `CudaSession::launch`: the resolved arguments
                                // address the step's buffers, in the kernel's parameter order.
                                unsafe { r.launch_with(&r.args, st) }.map_err(|e| {
                                    RuntimeError::Device(format!("timing the flash kernel: {e}"))
                                })?;
                            }
                            Ok(())
                        };
                        let fl: Option<dnn_attention::FlashRun> =
                            (!flash.is_empty()).then_some(&run_flash);
                        dev.with_dnn(|dn| {
                            dnn_attention::choose(
                                dn.handle,
                                &cudnn,
                                p,
                                attn_choice,
                                fl,
                                stream as _,
                            )
                        })
                        .map_err(|e| RuntimeError::Device(format!("step {i} (attention): {e}")))?
                    };
                    let mut ptrs = vec![
                        offset_by(at_val(ArgRef::Input(0)), cudnn.part_offset(0)),
                        offset_by(at_val(ArgRef::Input(1)), cudnn.part_offset(1)),
                        offset_by(at_val(ArgRef::Input(2)), cudnn.part_offset(2)),
                        offset_by(at_val(ArgRef::Output), 0),
                    ];
                    if let Some(off) = stats_at[i] {
                        ptrs.push((out + off as u64, None, 0));
                    }
                    Exec::Attention {
                        plan: plan.map(std::sync::Mutex::new),
                        ptrs,
                        workspace: scratch,
                        flash,
                    }
                }
                CudaStep::AttentionGrad { cudnn, flash } => {
                    let flash = resolve(&flash);
                    let (o, stats) = match saved_at[i] {
                        Some((v, off)) if saving.contains(&v) => {
                            ((s.ptrs[v], Some(v), 0), (s.ptrs[v] + off as u64, None, 0))
                        }
                        _ => ((0, None, 0), (0, None, 0)),
                    };
                    let part = |j: usize| offset_by(at_val(ArgRef::Input(j)), cudnn.part_offset(j));
                    // Packed dq, dk and dv lie in the one result; else in the step's and its
                    // two siblings'.
                    let grads = if cudnn.layout == rustytorch_ops::AttnLayout::Packed {
                        [0, 1, 2].map(|j| offset_by(at_val(ArgRef::Output), cudnn.part_offset(j)))
                    } else {
                        [ArgRef::Output, ArgRef::With(0), ArgRef::With(1)]
                            .map(|a| offset_by(at_val(a), 0))
                    };
                    let ptrs = [
                        part(0),
                        part(1),
                        part(2),
                        offset_by(at_val(ArgRef::Input(3)), 0),
                        grads[0],
                        grads[1],
                        grads[2],
                        o,
                        stats,
                    ];
                    let plans = match grad_prep[i].take() {
                        Some(g) if !g.decided => {
                            choose_grad(&dev, &cudnn, g, &ptrs, scratch, &flash, stream, i)?
                        }
                        other => other,
                    };
                    Exec::AttentionGrad {
                        plans: plans.map(|p| Box::new(std::sync::Mutex::new(p))),
                        ptrs,
                        workspace: scratch,
                        flash,
                    }
                }
                CudaStep::Matmul {
                    mut desc,
                    after,
                    bgrad,
                } => {
                    let mut after = resolve(&after);
                    let fallback = resolve(&bgrad);
                    // The call's second buffer (the bias gradient, or a GELU pair's
                    // pre-activation) and where D goes (a GELU pair's D is the GELU's value).
                    let mut second = None;
                    let mut d_at = (out, Some(step.output));
                    let gelu_aux = desc.act == LtActivation::GeluTanhAux;
                    // The timing below (paired epilogues, then the algorithm) runs GEMMs here.
                    dev.ctx.bind_to_thread().map_err(|e| {
                        RuntimeError::Device(format!("binding the CUDA context: {e}"))
                    })?;
                    if desc.bgrad || gelu_aux {
                        use rustytorch_codegen::cuda::matmul::BgradMode;
                        let (mode, var, what) = if gelu_aux {
                            (
                                BgradMode::gelu_aux_from_env(),
                                "RUSTYTORCH_LT_GELU_AUX",
                                "GELU pair",
                            )
                        } else {
                            (
                                BgradMode::from_env(),
                                "RUSTYTORCH_LT_BGRAD",
                                "bias gradient",
                            )
                        };
                        let with = at_val(ArgRef::With(0));
                        let (epi_d, epi_second) = if gelu_aux {
                            (with, (out, Some(step.output)))
                        } else {
                            ((out, Some(step.output)), with)
                        };
                        let ready = match mode {
                            BgradMode::Kernel => Err(RuntimeError::Invalid("forced".into())),
                            _ => dev.with_blas(|bl| bl.ready(&desc)),
                        };
                        // In the default mode the epilogue runs where it is the faster of the two.
                        let ready = ready.and_then(|()| {
                            if mode == BgradMode::Epilogue {
                                return Ok(());
                            }
                            let call = PairCall {
                                desc: &desc,
                                a: ins[1],
                                b: ins[0],
                                d: epi_d.0,
                                plain_d: out,
                                bias: desc.reads_operand2().then(|| ins[2]),
                                second: epi_second.0,
                            };
                            match choose_pair(&dev, &call, &after, &fallback, stream)? {
                                true => Ok(()),
                                false => {
                                    Err(RuntimeError::Invalid("the kernels are faster".into()))
                                }
                            }
                        });
                        match ready {
                            Ok(()) => {
                                second = Some(epi_second);
                                d_at = epi_d;
                            }
                            Err(e) if mode == BgradMode::Epilogue => {
                                return Err(RuntimeError::Device(format!(
                                    "step {i} ({}): cuBLASLt's {what} epilogue ({var}=1): {e}",
                                    step.op.name()
                                )))
                            }
                            Err(e) => {
                                // The sibling runs as its own kernels after the GEMM.
                                tracing::debug!("step {i}: {what} in a kernel: {e}");
                                desc = plain_of(&desc);
                                after.extend(fallback);
                            }
                        }
                    }
                    // cuBLASLt's candidates timed once per descriptor, on this step's buffers
                    // (nothing in them is live at prepare).
                    dev.with_blas(|bl| {
                        bl.tune(
                            &desc,
                            ins[1],
                            ins[0],
                            d_at.0,
                            desc.reads_operand2().then(|| ins[2]),
                            second.map(|(x, _)| x),
                            desc.c_operand().map(|k| ins[k]),
                            stream as _,
                        )
                    })
                    .map_err(|e| RuntimeError::Device(format!("step {i} (matmul): {e}")))?;
                    Exec::Matmul {
                        a: ins[1],
                        b: ins[0],
                        d: d_at.0,
                        bias: desc.reads_operand2().then(|| ins[2]),
                        c: desc.c_operand().map(|k| ins[k]),
                        vals: [
                            Some(step.inputs[1]),
                            Some(step.inputs[0]),
                            d_at.1,
                            desc.reads_operand2().then(|| step.inputs[2]),
                            desc.c_operand().map(|k| step.inputs[k]),
                        ],
                        bgrad: second,
                        after,
                        desc,
                    }
                }
                CudaStep::Dnn(d) => {
                    let at = |a: ArgRef| at_val(a).0;
                    let desc = d.desc;
                    let vals = if desc.pool.is_some() {
                        [
                            Some(step.inputs[0]),
                            step.inputs.get(1).copied(),
                            Some(step.output),
                            None,
                        ]
                    } else {
                        [
                            at_val(desc.x_at).1,
                            at_val(desc.w_at).1,
                            at_val(desc.y_at).1,
                            desc.bias.then(|| step.inputs[2]),
                        ]
                    };
                    let ptrs = if desc.pool.is_some() {
                        DnnPtrs {
                            x: ins[0],
                            w: ins.get(1).copied().unwrap_or(0),
                            y: out,
                            bias: 0,
                            workspace: scratch,
                        }
                    } else {
                        DnnPtrs {
                            x: at(desc.x_at),
                            w: at(desc.w_at),
                            y: at(desc.y_at),
                            bias: if desc.bias { ins[2] } else { 0 },
                            workspace: scratch + desc.workspace_offset() as u64,
                        }
                    };
                    Exec::Dnn {
                        before: resolve(&StepKernels {
                            launches: d.before,
                            scratch_bytes: 0,
                        }),
                        after: resolve(&StepKernels {
                            launches: d.after,
                            scratch_bytes: 0,
                        }),
                        ptrs,
                        vals,
                        desc,
                        graph: dnn_graph,
                    }
                }
                CudaStep::Spmm(_) => Exec::Spmm(call.expect("prepared above")),
                CudaStep::Composite(c) => {
                    let mut parts = vec![];
                    for part in c.parts {
                        parts.push(match part {
                            Part::Gemm { desc, a, b, d } => {
                                ExecPart::Gemm(desc, [at_val(a), at_val(b), at_val(d)])
                            }
                            Part::Launch(l) => ExecPart::Launch(
                                resolve(&StepKernels {
                                    launches: vec![l],
                                    scratch_bytes: 0,
                                })
                                .remove(0),
                            ),
                        });
                    }
                    Exec::Composite(parts)
                }
                CudaStep::Alias | CudaStep::Sibling | CudaStep::Merged(_) => Exec::Nothing,
                CudaStep::AllReduce { mean } => Exec::AllReduce {
                    mean,
                    src: at_val(ArgRef::Input(0)),
                    dst: at_val(ArgRef::Output),
                    ty: plan.types[step.output].clone(),
                },
            };
            s.exec.push((i, e));
        }
        if !gathers.is_empty() {
            s.guard_bytes = s.alloc(plan.guards.len())?;
            let mut at = 0;
            for chunk in gathers {
                let mut args: Vec<u64> = chunk.iter().map(|(_, v)| s.ptrs[*v]).collect();
                let mut vals: Vec<Option<usize>> = chunk.iter().map(|(_, v)| Some(*v)).collect();
                args.push(s.guard_bytes + at as u64);
                vals.push(None);
                s.guard_gather.push(Resolved {
                    func: funcs.next().expect("one function per gather"),
                    args,
                    vals,
                    grid: 1,
                    block: 32,
                    smem: 0,
                    maps: vec![],
                    encoded: Default::default(),
                });
                at += chunk.len();
            }
        }
        dev.sync()?;
        Ok(s)
    }

    /// The guards of the run just enqueued on `stream` (its values at `io`'s addresses when
    /// given): gathered into one buffer and copied back once, or one copy each.
    fn read_guards(&mut self, stream: CUstream, io: Option<&[u64]>) -> Result<Vec<(String, bool)>> {
        let plan = self.plan.clone();
        if self.guard_gather.is_empty() {
            let mut guards = Vec::with_capacity(plan.guards.len());
            for (name, v) in &plan.guards {
                let src = io.map_or(self.ptrs[*v], |t| t[*v]);
                let t = dtoh(src, &plan.types[*v], stream)?;
                self.transfers.dtoh_copies += 1;
                self.transfers.dtoh_bytes += plan.types[*v].size_bytes() as u64;
                guards.push((name.clone(), t.to_f64_vec().iter().all(|&x| x != 0.0)));
            }
            return Ok(guards);
        }
        for r in &self.guard_gather {
            let args: Vec<u64> = r
                .args
                .iter()
                .zip(&r.vals)
                .map(|(&a, &v)| pick(a, v, io))
                .collect();
            // SAFETY: the gather kernel takes one pointer per guard (each a live bool scalar of
            // this run) and the gather buffer, which holds a byte per guard.
            unsafe { super::launch_pointers(&r.func, r.grid, r.block, r.smem, &args, stream) }
                .map_err(|e| RuntimeError::Device(format!("gathering the guards: {e}")))?;
        }
        let ty = TensorType::new(DType::Bool, [plan.guards.len()]);
        let t = dtoh(self.guard_bytes, &ty, stream)?;
        self.transfers.dtoh_copies += 1;
        self.transfers.dtoh_bytes += plan.guards.len() as u64;
        Ok(plan
            .guards
            .iter()
            .zip(t.to_f64_vec())
            .map(|((name, _), x)| (name.clone(), x != 0.0))
            .collect())
    }

    fn alloc(&mut self, bytes: usize) -> Result<u64> {
        let b = self.dev.alloc(bytes)?;
        let a = b.addr;
        self.blocks.push(b);
        Ok(a)
    }

    fn upload(&mut self, dst: u64, t: &HostTensor) -> Result<()> {
        let n = htod(dst, t, self.dev.stream.cu_stream())?;
        if n > 0 {
            self.transfers.htod_copies += 1;
            self.transfers.htod_bytes += n as u64;
        }
        Ok(())
    }

    fn download(&mut self, src: u64, ty: &TensorType) -> Result<HostTensor> {
        let t = dtoh(src, ty, self.dev.stream.cu_stream())?;
        let n = ty.size_bytes();
        if n > 0 {
            self.transfers.dtoh_copies += 1;
            self.transfers.dtoh_bytes += n as u64;
        }
        Ok(t)
    }

    /// Enqueues every step of the plan on `stream` (with `io`, the addresses of this run's
    /// values: device inputs and outputs that live elsewhere than the session's buffers).
    fn enqueue(&self, stream: CUstream, io: Option<&[u64]>) -> Result<()> {
        for (i, e) in &self.exec {
            self.enqueue_step(*i, e, stream, io)?;
        }
        Ok(())
    }

    /// Creates the timing events (one before the first step and one after each).
    fn ensure_events(&mut self) -> Result<()> {
        while self.events.0.len() < self.exec.len() + 1 {
            let e = dr::event::create(ds::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(drv("creating an event"))?;
            self.events.0.push(e);
        }
        Ok(())
    }

    /// Enqueues every step with an event recorded before the first and after each one
    /// ([`CudaSession::ensure_events`] first).
    fn enqueue_timed(&self, stream: CUstream, io: Option<&[u64]>) -> Result<()> {
        // SAFETY: the event is live and recorded on this session's stream.
        unsafe { dr::event::record(self.events.0[0], stream) }
            .map_err(drv("recording an event"))?;
        for (k, (i, e)) in self.exec.iter().enumerate() {
            self.enqueue_step(*i, e, stream, io)?;
            // SAFETY: as above.
            unsafe { dr::event::record(self.events.0[k + 1], stream) }
                .map_err(drv("recording an event"))?;
        }
        Ok(())
    }

    /// The step times from the events of the last `enqueue_timed` (the stream has synchronized).
    fn read_step_times(&self, origin: std::time::Instant) -> Result<StepTimes> {
        let ev = &self.events.0;
        let mut steps = Vec::with_capacity(self.exec.len());
        for (k, (i, _)) in self.exec.iter().enumerate() {
            // SAFETY: every event was recorded on the stream, which has synchronized since.
            let (start, dur) = unsafe {
                (
                    dr::event::elapsed(ev[0], ev[k]).map_err(drv("reading an event"))?,
                    dr::event::elapsed(ev[k], ev[k + 1]).map_err(drv("reading an event"))?,
                )
            };
            steps.push(StepTime {
                step: *i,
                start_us: start as f64 * 1e3,
                dur_us: dur as f64 * 1e3,
            });
        }
        Ok(StepTimes {
            clock: StepClock::Device,
            origin,
            steps,
        })
    }

    /// Enqueues one step's library calls and kernels.
    fn enqueue_step(&self, i: usize, e: &Exec, stream: CUstream, io: Option<&[u64]>) -> Result<()> {
        {
            match e {
                Exec::Kernels(ls) => {
                    for l in ls {
                        self.launch(l, i, stream, io)?;
                    }
                }
                Exec::Matmul {
                    desc,
                    a,
                    b,
                    d,
                    bias,
                    c,
                    vals,
                    bgrad,
                    after,
                } => {
                    let (a, b, d) = (
                        pick(*a, vals[0], io),
                        pick(*b, vals[1], io),
                        pick(*d, vals[2], io),
                    );
                    let bias = bias.map(|x| pick(x, vals[3], io));
                    let c = c.map(|x| pick(x, vals[4], io));
                    let bgrad = bgrad.map(|(x, v)| pick(x, v, io));
                    self.dev
                        .with_blas(|bl| bl.run(desc, a, b, d, bias, bgrad, c, stream as _))
                        .map_err(|e| RuntimeError::Device(format!("step {i} (matmul): {e}")))?;
                    for l in after {
                        self.launch(l, i, stream, io)?;
                    }
                }
                Exec::Dnn {
                    desc,
                    before,
                    ptrs,
                    vals,
                    after,
                    graph,
                } => {
                    for l in before {
                        self.launch(l, i, stream, io)?;
                    }
                    let ptrs = DnnPtrs {
                        x: pick(ptrs.x, vals[0], io),
                        w: pick(ptrs.w, vals[1], io),
                        y: pick(ptrs.y, vals[2], io),
                        bias: pick(ptrs.bias, vals[3], io),
                        workspace: ptrs.workspace,
                    };
                    self.dev
                        .with_dnn(|dn| dn.run(desc, *graph, &ptrs, stream as _))
                        .map_err(|e| {
                            RuntimeError::Device(format!("step {i} ({:?}): {e}", desc.kind))
                        })?;
                    for l in after {
                        self.launch(l, i, stream, io)?;
                    }
                }
                Exec::Composite(parts) => {
                    for part in parts {
                        match part {
                            ExecPart::Gemm(desc, [a, b, d]) => self
                                .dev
                                .with_blas(|bl| {
                                    bl.run(
                                        desc,
                                        pick(a.0, a.1, io),
                                        pick(b.0, b.1, io),
                                        pick(d.0, d.1, io),
                                        None,
                                        None,
                                        None,
                                        stream as _,
                                    )
                                })
                                .map_err(|e| {
                                    RuntimeError::Device(format!(
                                        "step {i} ({}): {e}",
                                        self.plan.steps[i].op.name()
                                    ))
                                })?,
                            ExecPart::Launch(l) => self.launch(l, i, stream, io)?,
                        }
                    }
                }
                Exec::Attention {
                    plan,
                    ptrs,
                    workspace,
                    flash,
                } => {
                    let at: Vec<u64> = ptrs.iter().map(|&p| pick_attn(p, io)).collect();
                    match plan {
                        Some(m) if GraphPlan::aligned(&at, *workspace) => {
                            let mut g = m.lock().expect("attention plan lock");
                            self.dev
                                .with_dnn(|dn| {
                                    // SAFETY: the handle is live (under the device's lock) and
                                    // the stream belongs to the device's context.
                                    unsafe {
                                        cudarc::cudnn::result::set_stream(dn.handle, stream as _)
                                    }
                                    .map_err(|e| {
                                        RuntimeError::Device(format!("cuDNN set stream: {e:?}"))
                                    })?;
                                    g.execute(dn.handle, &at, *workspace)
                                })
                                .map_err(|e| {
                                    RuntimeError::Device(format!("step {i} (attention): {e}"))
                                })?;
                        }
                        _ => {
                            for l in flash {
                                self.launch(l, i, stream, io)?;
                            }
                        }
                    }
                }
                Exec::AttentionGrad {
                    plans,
                    ptrs,
                    workspace,
                    flash,
                } => {
                    let at: Vec<u64> = ptrs.iter().map(|&p| pick_attn(p, io)).collect();
                    match plans {
                        Some(m) if GraphPlan::aligned(&at, *workspace) => {
                            let mut g = m.lock().expect("attention gradient plans lock");
                            let gp = grad_ptrs(&at);
                            self.dev
                                .with_dnn(|dn| g.run(dn.handle, &gp, *workspace, stream as _))
                                .map_err(|e| {
                                    RuntimeError::Device(format!(
                                        "step {i} (attention gradients): {e}"
                                    ))
                                })?;
                        }
                        _ => {
                            for l in flash {
                                self.launch(l, i, stream, io)?;
                            }
                        }
                    }
                }
                Exec::Spmm(call) => {
                    self.dev
                        .with_sparse(|sp| sp.spmm(call, self.scratch, stream))
                        .map_err(|e| {
                            RuntimeError::Device(format!("step {i} (sparse_matmul): {e}"))
                        })?;
                }
                Exec::AllReduce { mean, src, dst, ty } => {
                    let (src, dst) = (pick(src.0, src.1, io), pick(dst.0, dst.1, io));
                    match self.group.as_ref().and_then(|g| g.nccl()) {
                        Some(rank) => {
                            // SAFETY: both addresses are live buffers of `ty` on this device (the
                            // operand's and the result's, resolved like a kernel's arguments),
                            // not written by anything else before the stream reaches the
                            // reduction.
                            let r =
                                unsafe { rank.all_reduce_raw(src, dst, ty, *mean, stream as u64) };
                            r.map_err(|e| {
                                RuntimeError::Device(format!("step {i} (all_reduce): {e}"))
                            })?
                        }
                        // A group of one: sum and mean are the operand itself.
                        None => {
                            let n = ty.size_bytes();
                            if src != dst && n > 0 {
                                // SAFETY: both buffers are live and hold `n` bytes of `ty`, and
                                // are distinct slots of the plan (no overlap).
                                unsafe { dr::memcpy_dtod_async(dst, src, n, stream) }
                                    .map_err(drv("all_reduce of one replica"))?;
                            }
                        }
                    }
                }
                Exec::Nothing => {}
            }
        }
        Ok(())
    }

    /// Captures the plan's launches into a CUDA graph on a private stream (nothing runs during
    /// capture; the device's shared stream is untouched). On any failure the session stays eager.
    fn capture(&mut self) {
        self.replay = false; // one attempt
        let captured = (|| -> Result<Option<Graph>> {
            let cs = dr::stream::create(dr::stream::StreamKind::NonBlocking)
                .map_err(drv("creating the capture stream"))?;
            // SAFETY: `cs` is a fresh stream used only here; thread-local capture records the
            // launches this thread enqueues on it without running them.
            let begun = unsafe {
                dr::stream::begin_capture(
                    cs,
                    ds::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
            };
            let enq = begun
                .map_err(drv("beginning capture"))
                .and_then(|_| self.enqueue(cs, None));
            // SAFETY: ends the capture begun above (if it began) on the same stream.
            let ended = unsafe { dr::stream::end_capture(cs) };
            // SAFETY: the stream is idle (capture runs nothing) and destroyed once.
            let _ = unsafe { dr::stream::destroy(cs) };
            enq?;
            let graph = ended.map_err(drv("ending capture"))?;
            if graph.is_null() {
                return Ok(None);
            }
            // SAFETY: `graph` was just captured and is destroyed on failure or in Drop.
            match unsafe { dr::graph::instantiate(graph, ds::CUgraphInstantiate_flags(0)) } {
                Ok(exec) => Ok(Some(Graph { graph, exec })),
                Err(e) => {
                    // SAFETY: `graph` is live and not used again.
                    let _ = unsafe { dr::graph::destroy(graph) };
                    Err(RuntimeError::Device(format!(
                        "instantiating the graph: {e}"
                    )))
                }
            }
        })();
        match captured {
            Ok(g) => self.graph = g,
            Err(e) => tracing::warn!("CUDA graph capture failed, running eagerly: {e}"),
        }
    }

    /// In an NCCL group, waits for the enqueued run while watching the group (an aborted group
    /// ends the wait with an error instead of a rank waiting forever for a failed peer; see
    /// `NcclRank::wait`). Alone, nothing: the copies back wait on the stream.
    fn wait_group(&self, stream: CUstream) -> Result<()> {
        match self.group.as_ref().and_then(|g| g.nccl()) {
            Some(rank) => rank.wait(stream as u64),
            None => Ok(()),
        }
    }

    fn drop_graph(&mut self) {
        if let Some(g) = self.graph.take() {
            let _ = self.dev.sync();
            // SAFETY: the graph and its executable were created once and are not used again.
            unsafe {
                let _ = dr::graph::exec_destroy(g.exec);
                let _ = dr::graph::destroy(g.graph);
            }
        }
    }

    fn launch(
        &self,
        r: &Resolved,
        step: usize,
        stream: CUstream,
        io: Option<&[u64]>,
    ) -> Result<()> {
        let repointed: Vec<u64>;
        let args = match io {
            None => &r.args,
            Some(_) => {
                repointed = r
                    .args
                    .iter()
                    .zip(&r.vals)
                    .map(|(&a, &v)| pick(a, v, io))
                    .collect();
                &repointed
            }
        };
        // SAFETY: the function was compiled from a kernel whose parameters are these device
        // pointers (or tensor maps over them), in this order, each addressing a live buffer of
        // the size its type needs (resolved from the memory plan at prepare time, or for
        // device I/O a caller's buffer or an output block of the value's type).
        unsafe { r.launch_with(args, stream) }.map_err(|e| {
            RuntimeError::Device(format!(
                "step {step} ({}): {e}",
                self.plan.steps[step].op.name()
            ))
        })
    }
}

impl Session for CudaSession {
    fn device(&self) -> Device {
        Device::Cuda(self.dev.ordinal)
    }

    fn run(&mut self, inputs: &[Arc<HostTensor>]) -> Result<RunOutput> {
        let _span = tracing::debug_span!("cuda_run").entered();
        self.dev.bind()?;
        if inputs.len() != self.plan.inputs.len() {
            return Err(RuntimeError::Invalid(format!(
                "{} inputs given, the plan has {}",
                inputs.len(),
                self.plan.inputs.len()
            )));
        }
        for (i, t) in inputs.iter().enumerate() {
            let want = &self.plan.inputs[i].1;
            if &t.ty() != want {
                return Err(RuntimeError::Invalid(format!(
                    "input `{}`: expected {want}, got {}",
                    self.plan.inputs[i].0,
                    t.ty()
                )));
            }
        }
        // Sparse patterns are checked before anything is uploaded.
        for c in &self.pattern_checks {
            c.run(&self.plan, inputs)?;
        }
        for (i, t) in inputs.iter().enumerate() {
            let dst = self.inputs[i];
            self.upload(dst, t)?;
        }
        let stream = self.dev.stream.cu_stream();
        self.runs += 1;
        if self.replay && self.graph.is_none() && self.runs >= 2 && !self.step_timing {
            // The first run was eager (it warmed cuBLASLt's cached algorithms); capture now.
            self.capture();
        }
        let timed_from = self.step_timing.then(std::time::Instant::now);
        match &self.graph {
            _ if timed_from.is_some() => {
                self.ensure_events()?;
                self.enqueue_timed(stream, None)?
            }
            Some(g) => {
                // SAFETY: the executable graph was instantiated from this session's launches,
                // whose buffers stay allocated until the graph is destroyed in Drop.
                unsafe { dr::graph::launch(g.exec, stream) }.map_err(drv("replaying the plan"))?;
                self.replays += 1;
            }
            None => self.enqueue(stream, None)?,
        }
        self.wait_group(stream)?;
        let plan = self.plan.clone();
        let mut outputs = Vec::with_capacity(plan.outputs.len());
        for (_, v) in &plan.outputs {
            outputs.push(self.download(self.ptrs[*v], &plan.types[*v])?);
        }
        let guards = self.read_guards(stream, None)?;
        let committed = guards.iter().all(|(_, ok)| *ok);
        if committed {
            for (p, v) in &plan.updates {
                let (dst, src) = (self.params[*p], self.ptrs[*v]);
                let n = plan.param_types[*p].size_bytes();
                if dst != src && n > 0 {
                    // SAFETY: both buffers are live and hold `n` bytes of the parameter's type;
                    // the copy is ordered after every kernel of this run on the one stream.
                    unsafe { dr::memcpy_dtod_async(dst, src, n, stream) }
                        .map_err(drv("committing an update"))?;
                }
            }
        }
        self.dev.sync()?;
        if let Some(origin) = timed_from {
            self.last_times = Some(self.read_step_times(origin)?);
        }
        Ok(RunOutput {
            outputs,
            guards,
            committed,
        })
    }

    fn run_device(&mut self, inputs: &[DeviceInput]) -> Result<DeviceRunOutput> {
        let _span = tracing::debug_span!("cuda_run_device").entered();
        self.dev.bind()?;
        let plan = self.plan.clone();
        if inputs.len() != plan.inputs.len() {
            return Err(RuntimeError::Invalid(format!(
                "{} inputs given, the plan has {}",
                inputs.len(),
                plan.inputs.len()
            )));
        }
        for (i, d) in inputs.iter().enumerate() {
            let (name, want) = &plan.inputs[i];
            if &d.ty != want {
                return Err(RuntimeError::Invalid(format!(
                    "input `{name}`: expected {want}, got {}",
                    d.ty
                )));
            }
            if d.ordinal != self.dev.ordinal {
                return Err(RuntimeError::Invalid(format!(
                    "input `{name}` is on cuda:{}, the session on cuda:{}",
                    d.ordinal, self.dev.ordinal
                )));
            }
            if d.ptr == 0 && want.size_bytes() > 0 {
                return Err(RuntimeError::Invalid(format!(
                    "input `{name}`: null device address"
                )));
            }
        }
        if !self.pattern_checks.is_empty() {
            return Err(RuntimeError::Invalid(
                "this plan takes a sparse pattern as an input, which is checked on the host \
                 before it reaches the device: run it with host inputs"
                    .into(),
            ));
        }
        let stream = self.dev.stream.cu_stream();
        // The producers' streams hand over to ours: an event each, never a device-wide sync.
        for d in inputs {
            if let Some(p) = d.stream {
                // SAFETY: the context is bound; the caller vouches for its producer stream.
                unsafe { stream_wait(stream, p as usize as CUstream) }?;
            }
        }
        self.runs += 1;
        if self.replay && self.graph.is_none() && self.runs >= 2 && !self.step_timing {
            self.capture();
        }
        let timed_from = self.step_timing.then(std::time::Instant::now);
        if timed_from.is_some() {
            self.ensure_events()?;
        }
        // A replayed graph has the session's buffers baked in: inputs are copied into them and
        // outputs out of the arena. Eager runs point the launches at the caller's memory.
        let replaying = timed_from.is_none() && self.graph.is_some();
        let root = |mut v: usize| {
            while let Storage::Alias(of) = plan.storage[v] {
                v = of;
            }
            v
        };
        // cuSPARSE calls were prepared over fixed buffers: values they touch stay put.
        let mut fixed = std::collections::HashSet::new();
        for (i, e) in &self.exec {
            if matches!(e, Exec::Spmm(_)) {
                let st = &plan.steps[*i];
                for &v in st.inputs.iter().chain([&st.output]) {
                    fixed.insert(root(v));
                }
            }
        }
        let mut table = self.ptrs.clone();
        let mut copies = Vec::new();
        let mut copy_in = Vec::new();
        for (v, src) in plan.sources.iter().enumerate() {
            let Source::Input(i) = src else { continue };
            let d = &inputs[*i];
            if replaying || fixed.contains(&v) {
                copy_in.push((*i, d.ptr));
                copies.push((
                    IoSlot::Input(*i),
                    if replaying {
                        "a replayed CUDA graph reads the buffer it was captured with: copied \
                         device-to-device into it"
                    } else {
                        "a cuSPARSE call prepared over the input buffer reads it: copied \
                         device-to-device into it"
                    }
                    .to_string(),
                ));
            } else {
                table[v] = d.ptr;
            }
        }
        let realias = |table: &mut Vec<u64>| {
            for v in 0..table.len() {
                if let Storage::Alias(of) = plan.storage[v] {
                    table[v] = table[of];
                }
            }
        };
        realias(&mut table);
        // Outputs: each in a block of its own, written there directly when the output is a
        // computed value in the arena; else copied into it after the run.
        let mut blocks = Vec::with_capacity(plan.outputs.len());
        let mut copy_out = Vec::new();
        let mut taken = std::collections::HashSet::new();
        for (k, (_, v)) in plan.outputs.iter().enumerate() {
            let b = self.dev.alloc(plan.types[*v].size_bytes())?;
            let r = root(*v);
            let computed = matches!(plan.sources[r], Source::Step(_))
                && matches!(plan.storage[r], Storage::Arena { .. });
            if !replaying && computed && !fixed.contains(&r) && taken.insert(r) {
                table[r] = b.addr;
            } else {
                copy_out.push((k, *v, b.addr));
                let why = if replaying {
                    "a replayed CUDA graph writes the arena it was captured with"
                } else if !computed {
                    "the output is an input, a parameter or a constant: copied into a block of \
                     its own"
                } else if fixed.contains(&r) {
                    "a cuSPARSE call prepared over the arena writes it"
                } else {
                    "the same value is an earlier output too"
                };
                copies.push((IoSlot::Output(k), why.to_string()));
            }
            blocks.push(b);
        }
        realias(&mut table);
        let give_back = |s: &Self, blocks: Vec<crate::pool::Block>| {
            for b in blocks {
                s.dev.free(b);
            }
        };
        let run = (|| -> Result<(Vec<(String, bool)>, bool)> {
            for (i, src) in &copy_in {
                let n = plan.inputs[*i].1.size_bytes();
                if n > 0 {
                    // SAFETY: both addresses hold `n` bytes of the input's type (the caller's
                    // and the session's buffer); ordered on our stream after the hand-over.
                    unsafe { dr::memcpy_dtod_async(self.inputs[*i], *src, n, stream) }
                        .map_err(drv("copying an input on the device"))?;
                }
            }
            match &self.graph {
                _ if timed_from.is_some() => self.enqueue_timed(stream, Some(&table))?,
                Some(g) if replaying => {
                    // SAFETY: as in `run`.
                    unsafe { dr::graph::launch(g.exec, stream) }
                        .map_err(drv("replaying the plan"))?;
                }
                _ => self.enqueue(stream, Some(&table))?,
            }
            self.wait_group(stream)?;
            for (_, v, dst) in &copy_out {
                let n = plan.types[*v].size_bytes();
                if n > 0 {
                    // SAFETY: the value and the new block both hold `n` bytes; ordered after
                    // the run's launches on the one stream.
                    unsafe { dr::memcpy_dtod_async(*dst, table[*v], n, stream) }
                        .map_err(drv("copying an output on the device"))?;
                }
            }
            let guards = self.read_guards(stream, Some(&table))?;
            let committed = guards.iter().all(|(_, ok)| *ok);
            if committed {
                for (p, v) in &plan.updates {
                    let (dst, src) = (self.params[*p], table[*v]);
                    let n = plan.param_types[*p].size_bytes();
                    if dst != src && n > 0 {
                        // SAFETY: as in `run`.
                        unsafe { dr::memcpy_dtod_async(dst, src, n, stream) }
                            .map_err(drv("committing an update"))?;
                    }
                }
            }
            // The caller's input memory must outlive the kernels that read it.
            self.dev.sync()?;
            Ok((guards, committed))
        })();
        let (guards, committed) = match run {
            Ok(r) => r,
            Err(e) => {
                let _ = self.dev.sync();
                give_back(self, blocks);
                return Err(e);
            }
        };
        if replaying {
            self.replays += 1;
        }
        if let Some(origin) = timed_from {
            self.last_times = Some(self.read_step_times(origin)?);
        }
        let outputs = plan
            .outputs
            .iter()
            .zip(blocks)
            .map(|((_, v), b)| DeviceOutput {
                ty: plan.types[*v].clone(),
                ordinal: self.dev.ordinal,
                stream: stream as usize as u64,
                memory: Arc::new(OutputBlock {
                    dev: self.dev.clone(),
                    addr: b.addr,
                    block: Some(b),
                    users: std::sync::Mutex::new(Vec::new()),
                }),
            })
            .collect();
        Ok(DeviceRunOutput {
            outputs,
            guards,
            committed,
            copies,
        })
    }

    fn set_step_timing(&mut self, on: bool) -> bool {
        self.step_timing = on;
        true
    }

    fn take_step_times(&mut self) -> Option<StepTimes> {
        self.last_times.take()
    }

    fn read_param(&self, i: usize) -> Result<HostTensor> {
        self.dev.bind()?;
        let ty = self
            .plan
            .param_types
            .get(i)
            .ok_or_else(|| RuntimeError::Invalid(format!("no parameter #{i}")))?
            .clone();
        dtoh(self.params[i], &ty, self.dev.stream.cu_stream())
    }

    fn write_param(&mut self, i: usize, value: &HostTensor) -> Result<()> {
        check_param_type(&self.plan, i, value)?;
        self.dev.bind()?;
        let dst = self.params[i];
        self.upload(dst, value)?;
        self.dev.sync()
    }

    fn memory_stats(&self) -> Option<MemoryStats> {
        Some(self.dev.pool.lock().expect("pool lock").stats())
    }

    fn transfers(&self) -> TransferStats {
        self.transfers
    }

    fn graph_replays(&self) -> u64 {
        self.replays
    }

    /// Joins an NCCL group ([`crate::cuda::nccl::NcclRank`] on this session's device): its
    /// `all_reduce` steps then reduce in place over the group. A group of one that is not an
    /// NCCL rank (such as `HostGroup::ranks(1)`) leaves the group: the steps copy again. Runs in
    /// an NCCL group are eager, never a replayed CUDA graph: a captured graph would bake one
    /// communicator's operations into a graph that every rank must then replay in lockstep, and
    /// NCCL advises against capture across devices of one process; the collectives dominate a
    /// data-parallel step's launch overhead anyway.
    fn join(&mut self, group: Arc<dyn Communicator>) -> Result<()> {
        match group.nccl() {
            Some(rank) if rank.ordinal() != self.dev.ordinal => {
                Err(RuntimeError::Invalid(format!(
                    "a session on cuda:{} cannot join NCCL rank {} of {}, which is on cuda:{}",
                    self.dev.ordinal,
                    group.rank(),
                    group.world(),
                    rank.ordinal()
                )))
            }
            Some(_) => {
                self.drop_graph();
                self.replay = false;
                self.group = Some(group);
                Ok(())
            }
            None if group.world() == 1 => {
                if self.group.take().is_some() {
                    self.replay = std::env::var("RUSTYTORCH_CUDA_GRAPH").as_deref() != Ok("0");
                }
                Ok(())
            }
            None => Err(RuntimeError::Invalid(format!(
                "a session on cuda:{} joins an NCCL group (NcclRank); rank {} of a group of {} \
                 on the host cannot reduce device buffers",
                self.dev.ordinal,
                group.rank(),
                group.world()
            ))),
        }
    }

    fn set_graph_replay(&mut self, on: bool) {
        // Runs of a session in an NCCL group stay eager (see `join`).
        let on = on && self.group.is_none();
        self.replay = on && self.graph.is_none();
        if !on {
            self.drop_graph();
        }
    }

    fn time_steps(&mut self, iters: usize) -> Result<f64> {
        self.dev.bind()?;
        let stream = self.dev.stream.cu_stream();
        let ev = || {
            dr::event::create(ds::CUevent_flags::CU_EVENT_DEFAULT).map_err(drv("creating an event"))
        };
        let (start, end) = (ev()?, ev()?);
        let timed = (|| -> Result<f64> {
            // SAFETY: both events and the stream are live; the graph (if any) was captured from
            // this session's launches.
            unsafe { dr::event::record(start, stream) }.map_err(drv("recording an event"))?;
            for _ in 0..iters.max(1) {
                match &self.graph {
                    // SAFETY: as in `run`.
                    Some(g) => unsafe { dr::graph::launch(g.exec, stream) }
                        .map_err(drv("replaying the plan"))?,
                    None => self.enqueue(stream, None)?,
                }
            }
            // SAFETY: as above.
            unsafe { dr::event::record(end, stream) }.map_err(drv("recording an event"))?;
            // SAFETY: `end` was recorded on the stream above.
            unsafe { dr::event::synchronize(end) }.map_err(drv("waiting for an event"))?;
            // SAFETY: both events completed.
            let ms = unsafe { dr::event::elapsed(start, end) }.map_err(drv("reading an event"))?;
            Ok(ms as f64 / iters.max(1) as f64)
        })();
        // SAFETY: the events are destroyed once, after they completed (or were never recorded).
        unsafe {
            let _ = dr::event::destroy(start);
            let _ = dr::event::destroy(end);
        }
        timed
    }
}

impl Drop for CudaSession {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        self.drop_graph();
        for e in self.events.0.drain(..) {
            // SAFETY: each event was created once; the stream has no pending record of it
            // after the last run's synchronize.
            let _ = unsafe { dr::event::destroy(e) };
        }
        // Stream-ordered: work already queued on the stream finishes before any later user of
        // these blocks, which is queued after it.
        for b in self.blocks.drain(..) {
            self.dev.free(b);
        }
    }
}

/// The pointers of an attention-gradient call from the step's q, k, v, dO, dQ, dK, dV addresses.
fn grad_ptrs(at: &[u64]) -> dnn_attention::GradPtrs {
    dnn_attention::GradPtrs {
        q: at[0],
        k: at[1],
        v: at[2],
        dout: at[3],
        dq: at[4],
        dk: at[5],
        dv: at[6],
        o: at.get(7).copied().unwrap_or(0),
        stats: at.get(8).copied().unwrap_or(0),
    }
}

/// The buffers of one GEMM step with a paired epilogue (see [`choose_pair`]).
struct PairCall<'a> {
    desc: &'a MatmulDesc,
    a: u64,
    b: u64,
    /// D of the epilogue's call.
    d: u64,
    /// D of the plain call (the step's output).
    plain_d: u64,
    bias: Option<u64>,
    /// The epilogue's second buffer: the bias gradient, or a GELU pair's pre-activation.
    second: u64,
}

/// `desc` without its paired epilogue: no bias gradient, and a GELU pair's GEMM as the plain
/// biased GEMM of the pre-activation.
fn plain_of(desc: &MatmulDesc) -> MatmulDesc {
    let mut plain = desc.clone();
    plain.bgrad = false;
    if plain.act == LtActivation::GeluTanhAux {
        plain.act = LtActivation::None;
    }
    plain
}

/// Whether the paired value of `call` (a bias gradient, or a GELU pair's GELU) is faster from
/// cuBLASLt's epilogue than from the plain GEMM followed by the sibling's own kernels
/// (`fallback`; `after` runs in both): timed once per descriptor on the step's own buffers at
/// prepare (nothing in them is live yet), the outcome kept for the process. cuBLASLt's epilogue
/// kernels are other kernels than its plain GEMM's, and not always the faster pair.
fn choose_pair(
    dev: &GpuDevice,
    call: &PairCall,
    after: &[Resolved],
    fallback: &[Resolved],
    stream: CUstream,
) -> Result<bool> {
    static CHOICES: std::sync::OnceLock<
        std::sync::Mutex<std::collections::HashMap<MatmulDesc, bool>>,
    > = std::sync::OnceLock::new();
    let choices = CHOICES.get_or_init(Default::default);
    if let Some(&c) = choices.lock().expect("epilogue choices").get(call.desc) {
        return Ok(c);
    }
    let plain = plain_of(call.desc);
    // The two sides' GEMMs: the epilogue's call, and the plain one into the step's output.
    let sides = [
        (call.desc, call.d, Some(call.second)),
        (&plain, call.plain_d, None),
    ];
    let gemm = |(m, d, second): (&MatmulDesc, u64, Option<u64>), tune: bool| -> Result<()> {
        dev.with_blas(|bl| {
            let (a, b, bias, st) = (call.a, call.b, call.bias, stream as _);
            if tune {
                bl.tune(m, a, b, d, bias, second, None, st)
            } else {
                bl.run(m, a, b, d, bias, second, None, st)
            }
        })
    };
    // Each side with its own fastest algorithm.
    for side in sides {
        gemm(side, true)?;
    }
    let launch_all = |ls: &[Resolved]| -> Result<()> {
        for r in ls {
            // SAFETY: as in `CudaSession::launch`: the resolved arguments address the step's
            // buffers, in the kernel's parameter order.
            unsafe { r.launch_with(&r.args, stream) }
                .map_err(|e| RuntimeError::Device(format!("timing the paired epilogue: {e}")))?;
        }
        Ok(())
    };
    let epilogue = || -> Result<()> {
        gemm(sides[0], false)?;
        launch_all(after)
    };
    let separate = || -> Result<()> {
        gemm(sides[1], false)?;
        launch_all(after)?;
        launch_all(fallback)
    };
    // Alternating, best of three each: the first calls also warm the clocks.
    let (mut t_epi, mut t_sep) = (f32::INFINITY, f32::INFINITY);
    for _ in 0..3 {
        t_epi = t_epi.min(super::dnn::time(stream as _, epilogue)?);
        t_sep = t_sep.min(super::dnn::time(stream as _, separate)?);
    }
    let use_epilogue = t_epi <= t_sep;
    super::blas::log_matmul_choice(format!(
        "{}: epilogue {t_epi:.4} ms, GEMM + kernels {t_sep:.4} ms, kept the {}",
        super::blas::describe(call.desc),
        if use_epilogue { "epilogue" } else { "kernels" }
    ));
    tracing::debug!(
        "paired epilogue of {:?}: {t_epi:.4} ms, GEMM + kernels {t_sep:.4} ms",
        call.desc
    );
    choices
        .lock()
        .expect("epilogue choices")
        .insert(call.desc.clone(), use_epilogue);
    Ok(use_epilogue)
}

/// Times cuDNN's attention gradient against the flash kernels on the step's own buffers (at
/// prepare, when nothing in them is live yet; the operands are zeroed first so the timing does
/// not depend on whatever the arena held) and keeps the faster, remembering the outcome per
/// shape. A cuDNN failure in auto mode means the flash kernels (logged).
#[allow(clippy::too_many_arguments)]
fn choose_grad(
    dev: &GpuDevice,
    d: &rustytorch_codegen::cuda::AttnDnnDesc,
    mut g: dnn_attention::GradPlans,
    ptrs: &[AttnPtr; 9],
    scratch: u64,
    flash: &[Resolved],
    stream: CUstream,
    step: usize,
) -> Result<Option<dnn_attention::GradPlans>> {
    let at: Vec<u64> = ptrs.iter().map(|p| p.0).collect();
    if !GraphPlan::aligned(&at, scratch) {
        return Ok(None);
    }
    let elem = d.dtype.size_bytes();
    let sizes = [
        d.b * d.h * d.sq * d.d,
        d.b * d.h * d.sk * d.d,
        d.b * d.h * d.sk * d.d,
        d.b * d.h * d.sq * d.d,
    ];
    for (a, n) in at.iter().zip(sizes) {
        // SAFETY: operand `a` of the step holds `n` elements of `elem` bytes (the op's types);
        // nothing in the arena is live at prepare, and the memset is ordered on `stream`.
        unsafe { cudarc::driver::sys::cuMemsetD8Async(*a, 0, n * elem, stream) }
            .result()
            .map_err(|e| RuntimeError::Device(format!("zeroing for timing: {e}")))?;
    }
    let gp = grad_ptrs(&at);
    let cudnn_ms = dev.with_dnn(|dn| g.time(dn.handle, &gp, scratch, stream as _));
    let flash_ms = super::dnn::time(stream as _, || {
        for r in flash {
            // SAFETY: as in `CudaSession::launch`: the resolved arguments address the step's
            // live buffers, in the kernel's parameter order.
            unsafe { r.launch_with(&r.args, stream) }
                .map_err(|e| RuntimeError::Device(format!("timing the flash gradients: {e}")))?;
        }
        Ok(())
    })?;
    let keep = match cudnn_ms {
        Ok(c) => {
            tracing::debug!(
                "step {step}: attention gradients, cuDNN {c:.4} ms, flash {flash_ms:.4} ms"
            );
            c < flash_ms as f64
        }
        Err(e) => {
            tracing::debug!("step {step}: attention gradients run the flash kernels: {e}");
            false
        }
    };
    let won = keep.then_some(g);
    dnn_attention::remember_grad(d, won.as_ref());
    Ok(won)
}
