//! CUDA lowering: every step of a [`Plan`](crate::Plan) becomes either generated kernels (built as
//! [`ir::Kernel`] data by one template file per op family and printed by [`emit`]) or a library
//! call descriptor ([`MatmulDesc`] for cuBLASLt). Kernels are specialized per shape: sizes and
//! strides are literals of the source, and the only launch arguments are buffer pointers.
//!
//! Nothing here touches a GPU: the runtime compiles the sources with NVRTC and launches them.

pub mod attention;
pub mod attention_cudnn;
pub mod dnn;
pub mod elementwise;
pub mod emit;
pub mod flash;
pub mod fused_row;
pub mod interp;
pub mod ir;
pub mod matmul;
pub mod merge;
pub mod pool;
pub mod reduce;
pub mod rows;
pub mod sparse;

pub use attention_cudnn::AttnDnnDesc;
pub use dnn::{DnnDesc, DnnStep};
pub use matmul::MatmulDesc;
pub use sparse::SpmmDesc;

use crate::{CodegenError, Result};
use ir::Kernel;
use rustytorch_ops::{AttnLayout, Op, TensorType};

/// The GPU generation a lowering targets: most kernels are the same for every GPU, but some
/// have a form that only one generation runs (the flash forward on Hopper's warpgroup MMA).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Target {
    /// Code that every GPU from compute capability 8.0 on runs.
    #[default]
    Portable,
    /// Hopper (compute capability 9.0, kernels built for `sm_90a`).
    Hopper,
}

impl Target {
    /// The target of a device of compute capability `cc`.
    pub fn of(cc: (i32, i32)) -> Target {
        if cc == (9, 0) {
            Target::Hopper
        } else {
            Target::Portable
        }
    }
}

thread_local! {
    // The lowering's target. A thread-local rather than a parameter because the choice reaches
    // a few templates deep below `lower_step`, which tests and tools call directly for the
    // portable code; `with_target` scopes it.
    static TARGET: std::cell::Cell<Target> = const { std::cell::Cell::new(Target::Portable) };
}

/// Runs `f` with `value` in the thread-local `key`, then restores the previous value (also
/// when `f` unwinds).
fn scoped<T: Copy + 'static, R>(
    key: &'static std::thread::LocalKey<std::cell::Cell<T>>,
    value: T,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore<T: Copy + 'static>(&'static std::thread::LocalKey<std::cell::Cell<T>>, T);
    impl<T: Copy + 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            self.0.with(|c| c.set(self.1));
        }
    }
    let _restore = Restore(key, key.with(|c| c.replace(value)));
    f()
}

/// Runs `f` (lowerings) with `target` as the target, then restores the previous one.
pub fn with_target<R>(target: Target, f: impl FnOnce() -> R) -> R {
    scoped(&TARGET, target, f)
}

/// The target of the lowering running on this thread ([`Target::Portable`] outside
/// [`with_target`]).
pub fn target() -> Target {
    TARGET.with(|t| t.get())
}

/// [`lower_plan`] for `target`.
pub fn lower_plan_for(plan: &crate::Plan, target: Target) -> Result<Vec<CudaStep>> {
    with_target(target, || lower_plan(plan))
}

thread_local! {
    // The streaming multiprocessors of the device the lowering is for, where known: kernels
    // that walk their tiles in a loop may size their grid by it (see `sm_count`).
    static SMS: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
}

/// [`lower_plan`] for `target` on a device of `sms` streaming multiprocessors.
pub fn lower_plan_on(plan: &crate::Plan, target: Target, sms: u32) -> Result<Vec<CudaStep>> {
    scoped(&SMS, Some(sms), || lower_plan_for(plan, target))
}

/// The streaming multiprocessors of the device of the lowering running on this thread (set
/// by [`lower_plan_on`]; `None` outside it).
pub fn sm_count() -> Option<u32> {
    SMS.with(|s| s.get())
}

/// Upper bound of blocks in a grid-stride launch (enough to fill any current GPU many times).
pub const MAX_GRID: u64 = 65_535;

/// What a kernel parameter binds to at launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArgRef {
    /// The step's `i`-th operand.
    Input(usize),
    /// The step's result buffer.
    Output,
    /// The step's scratch buffer (see [`StepKernels::scratch_bytes`]).
    Scratch,
    /// The step's scratch buffer at a byte offset (a multiple of 256).
    ScratchAt(usize),
    /// The result of the `i`-th other member of the step's sibling group
    /// ([`crate::Step::with`]), which the step computes with its own.
    With(usize),
    /// A value of the plan, whichever step computes or reads it (a multi-tensor launch binds
    /// its members' operands and results so; see [`merge`]).
    Value(crate::ValueId),
}

/// One kernel launch of a step.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// The kernel.
    pub kernel: Kernel,
    /// What each of the kernel's parameters binds to, in order.
    pub args: Vec<ArgRef>,
    /// Blocks in the (1-D) grid.
    pub grid: u32,
}

impl Launch {
    /// A launch whose arguments are the operands `0..n_inputs` then the output (the common shape
    /// of a template).
    pub fn simple(kernel: Kernel, n_inputs: usize, grid: u32) -> Launch {
        let mut args: Vec<ArgRef> = (0..n_inputs).map(ArgRef::Input).collect();
        args.push(ArgRef::Output);
        Launch { kernel, args, grid }
    }
}

/// The kernels of one step, launched in order on one stream.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct StepKernels {
    /// Launches in order.
    pub launches: Vec<Launch>,
    /// Bytes of scratch memory the launches need (0 for most ops).
    pub scratch_bytes: usize,
}

impl StepKernels {
    /// One launch of `kernel` over the step's `n_in` operands, then its result.
    pub fn over_operands(kernel: Kernel, n_in: usize, grid: u32) -> StepKernels {
        StepKernels {
            launches: vec![Launch {
                kernel,
                args: (0..n_in)
                    .map(ArgRef::Input)
                    .chain([ArgRef::Output])
                    .collect(),
                grid,
            }],
            scratch_bytes: 0,
        }
    }
}

/// How one plan step runs on CUDA.
#[derive(Clone, Debug, PartialEq)]
pub enum CudaStep {
    /// Generated kernels.
    Kernels(StepKernels),
    /// A cuBLASLt matmul (with its epilogue), optionally followed by kernels over the output
    /// in place (an activation cuBLASLt cannot express exactly, such as the erf GELU).
    Matmul {
        /// The library call.
        desc: MatmulDesc,
        /// Kernels run after it, over the output.
        after: StepKernels,
        /// With `desc.bgrad`, the bias gradient's own kernels over the step's buffers (into
        /// [`ArgRef::With`]`(0)`), which the runtime runs after the GEMM (and `after`) instead
        /// when cuBLASLt has no algorithm for the epilogue; with the `GeluTanhAux` epilogue, the
        /// GELU's own kernels (from the step's output into `With(0)`) in the same role; empty
        /// otherwise.
        bgrad: StepKernels,
    },
    /// A cuDNN convolution or pooling call. Its workspace (and the recomputed forward result a
    /// pooling backward reads) lives in the step's scratch, sized by the runtime once it has
    /// picked the algorithm.
    Dnn(DnnStep),
    /// A cuSPARSE SpMM (its workspace in the step's scratch, sized by the runtime).
    Spmm(SpmmDesc),
    /// Attention forward that runs either cuDNN's fused attention or the flash kernel: the
    /// runtime times both once per shape at prepare (or takes the one `RUSTYTORCH_ATTENTION`
    /// forces) and keeps the faster; cuDNN's workspace lives in the step's scratch.
    Attention {
        /// The cuDNN call.
        cudnn: AttnDnnDesc,
        /// The flash kernel (operands q, k, v, the output).
        flash: StepKernels,
        /// Whether a gradient step reads the statistics the flash kernel writes past the output
        /// ([`flash::lower_saving`]): the runtime then runs either it or cuDNN's forward with
        /// statistics, which writes the same there, never cuDNN's forward without them.
        saves: bool,
    },
    /// The three gradients of one attention (a sibling group, see [`crate::Step::with`]): cuDNN's
    /// SDPA backward (after its forward writes O and the statistics into the workspace) or the
    /// flash kernels, chosen like [`CudaStep::Attention`]; the workspace lives in the step's
    /// scratch.
    AttentionGrad {
        /// The cuDNN calls' description (the forward's).
        cudnn: AttnDnnDesc,
        /// The flash kernels (operands q, k, v, dO; results dQ, then dK and dV as `With`).
        flash: StepKernels,
    },
    /// cuBLASLt GEMMs and generated kernels in order over the operands, the output and the
    /// step's scratch (attention and its gradients as GEMMs).
    Composite(Composite),
    /// Nothing to run: the output aliases its operand's bytes (a reshape placed as an alias by
    /// the memory plan).
    Alias,
    /// Nothing to run: the first step of the result's sibling group computed it (see
    /// [`crate::Step::with`]).
    Sibling,
    /// Nothing to run: the multi-tensor launch of the given (earlier) step computed the result
    /// (see [`merge`]).
    Merged(usize),
    /// `all_reduce` of the operand into the output: an NCCL all-reduce over the group the
    /// session joined (the mean through NCCL's average when `mean`), or a device copy when it
    /// runs alone (a group of one).
    AllReduce {
        /// Divide the sum by the number of ranks.
        mean: bool,
    },
}

impl CudaStep {
    /// The generated kernels the step launches, in order (library calls left out).
    pub fn launches(&self) -> Vec<&Launch> {
        match self {
            CudaStep::Kernels(k) => k.launches.iter().collect(),
            CudaStep::Attention { flash, .. } | CudaStep::AttentionGrad { flash, .. } => {
                flash.launches.iter().collect()
            }
            CudaStep::Matmul { after, bgrad, .. } => {
                after.launches.iter().chain(&bgrad.launches).collect()
            }
            CudaStep::Dnn(d) => d.before.iter().chain(&d.after).collect(),
            CudaStep::Composite(c) => c
                .parts
                .iter()
                .filter_map(|p| match p {
                    Part::Launch(l) => Some(l),
                    Part::Gemm { .. } => None,
                })
                .collect(),
            CudaStep::Spmm(_)
            | CudaStep::Alias
            | CudaStep::Sibling
            | CudaStep::Merged(_)
            | CudaStep::AllReduce { .. } => {
                vec![]
            }
        }
    }
}

/// One part of a [`Composite`] step.
#[derive(Clone, Debug, PartialEq)]
pub enum Part {
    /// A cuBLASLt matmul with cuBLASLt's A, B and D at these places (see [`MatmulDesc`]).
    Gemm {
        /// The call.
        desc: MatmulDesc,
        /// cuBLASLt's A (the product's right operand).
        a: ArgRef,
        /// cuBLASLt's B (the product's left operand).
        b: ArgRef,
        /// The result.
        d: ArgRef,
    },
    /// A kernel launch.
    Launch(Launch),
}

/// Library calls and kernels run in order as one step.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Composite {
    /// The parts, in order.
    pub parts: Vec<Part>,
    /// Bytes of scratch the parts share.
    pub scratch_bytes: usize,
}

/// Number of blocks for `n` work items at `per_block` items per block, capped at [`MAX_GRID`]
/// (kernels loop grid-stride past the cap).
pub fn grid_for(n: u64, per_block: u64) -> u32 {
    n.div_ceil(per_block.max(1)).clamp(1, MAX_GRID) as u32
}

/// A stable 64-bit FNV-1a hash (the same on every machine and build, unlike `DefaultHasher`).
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Names a finished kernel `{prefix}_{hash}` from a hash of its printed body, so that identical
/// kernels get identical names (and share a compiled module) and names are stable across runs.
pub fn finish(prefix: &str, mut k: Kernel) -> Result<Kernel> {
    k.name = "kernel".into();
    let text = emit::emit_kernel(&k).map_err(|e| CodegenError::Invalid(e.to_string()))?;
    k.name = format!("{prefix}_{:08x}", stable_hash(text.as_bytes()) as u32);
    Ok(k)
}

/// The CUDA source of a kernel (prelude included), as NVRTC compiles it.
pub fn source(k: &Kernel) -> Result<String> {
    emit::emit(k).map_err(|e| CodegenError::Invalid(e.to_string()))
}

/// The GEMM step of a bias-gradient pair that one cuBLASLt call computes with its sum
/// ([`matmul::lower_bias_grad`]), or of a GELU pair that one call computes with its GELU
/// ([`matmul::lower_gelu_aux`]).
fn lower_pair_step(plan: &crate::Plan, s: &crate::Step) -> Result<Option<CudaStep>> {
    let &[v] = s.with.as_slice() else {
        return Ok(None);
    };
    let crate::Source::Step(j) = plan.sources[v] else {
        return Ok(None);
    };
    let ins = operand_types(plan, s);
    if let Op::MatmulEpilogue { .. } = s.op {
        let act = &plan.steps[j];
        if matmul::BgradMode::gelu_aux_from_env() == matmul::BgradMode::Off
            || act.inputs != [s.output]
        {
            return Ok(None);
        }
        return matmul::lower_gelu_aux(&s.op, &ins, &plan.types[s.output], &act.op, &plan.types[v]);
    }
    if !matches!(s.op, Op::Matmul { .. } | Op::MatmulActGrad { .. })
        || matmul::BgradMode::from_env() == matmul::BgradMode::Off
    {
        return Ok(None);
    }
    let sum = &plan.steps[j];
    if !matches!(sum.op, Op::Reduce { .. }) || sum.inputs.len() != 1 {
        return Ok(None);
    }
    matmul::lower_bias_grad(
        &s.op,
        &ins,
        &plan.types[s.output],
        &sum.op,
        &plan.types[sum.inputs[0]],
        &plan.types[v],
    )
}

/// Lowers every step of a plan for CUDA (in step order), then folds casts into the kernels of
/// their operands and merges independent single-kernel steps into multi-tensor launches
/// ([`merge`]; both off with `RUSTYTORCH_MERGE=0`).
pub fn lower_plan(plan: &crate::Plan) -> Result<Vec<CudaStep>> {
    let mut steps = lower_steps(plan)?;
    if std::env::var("RUSTYTORCH_MERGE").as_deref() != Ok("0") {
        merge::fold_casts(plan, &mut steps)?;
        merge::merge_launches(plan, &mut steps)?;
    }
    Ok(steps)
}

/// The types of step `s`'s operands.
fn operand_types<'a>(plan: &'a crate::Plan, s: &crate::Step) -> Vec<&'a TensorType> {
    s.inputs.iter().map(|&v| &plan.types[v]).collect()
}

/// Lowers every step of a plan for CUDA, each on its own (in step order). A step whose result
/// aliases its operand's bytes in the memory plan runs nothing. A sibling group of attention
/// gradients that the flash kernels take is one step at its first member (the others run
/// nothing), as is a bias-gradient or GELU pair that cuBLASLt's epilogue computes; other groups run
/// member by member.
pub fn lower_steps(plan: &crate::Plan) -> Result<Vec<CudaStep>> {
    let grouped = |s: &crate::Step| {
        !s.with.is_empty()
            && matches!(s.op, Op::AttentionGrad { .. })
            && flash::supported(&operand_types(plan, s))
    };
    let mut pairs: Vec<Option<CudaStep>> = Vec::with_capacity(plan.steps.len());
    for s in &plan.steps {
        pairs.push(if s.with.is_empty() {
            None
        } else {
            lower_pair_step(plan, s)?
        });
    }
    let fused: Vec<bool> = pairs.iter().map(Option::is_some).collect();
    let saved = flash_saved(plan);
    plan.steps
        .iter()
        .zip(pairs)
        .map(|(s, pair)| {
            if matches!(plan.storage[s.output], crate::Storage::Alias(_)) {
                return Ok(CudaStep::Alias);
            }
            if let Some(step) = pair {
                return Ok(step);
            }
            if s.sibling_of
                .is_some_and(|f| fused[f] || grouped(&plan.steps[f]))
            {
                return Ok(CudaStep::Sibling);
            }
            let ins = operand_types(plan, s);
            if let (Some(&stats_at), Op::Attention { .. }) = (saved.get(&s.output), &s.op) {
                let out = &plan.types[s.output];
                let flash = flash::lower_saving(&s.op, &ins, out, stats_at)?;
                return attention_step(&s.op, &ins, out, flash, true);
            }
            // Where the forward's flash kernel saves its statistics, the gradients read them.
            let reads = s.saved.and_then(|v| {
                saved.get(&v).map(|&stats_at| flash::Saved {
                    o: ArgRef::Value(v),
                    stats_at,
                })
            });
            if let (
                Some(reads),
                Op::AttentionGrad {
                    layout: AttnLayout::Packed,
                    ..
                },
            ) = (reads, &s.op)
            {
                let out = &plan.types[s.output];
                let flash = flash::lower_grad_saved(&s.op, &ins, out, Some(reads))?;
                let desc = AttnDnnDesc::of_grad(&s.op, &ins, out);
                return grad_step(&s.op, &ins, out, flash, desc);
            }
            if grouped(s) {
                let ops: Vec<&Op> = std::iter::once(&s.op)
                    .chain(s.with.iter().map(|&v| match plan.sources[v] {
                        crate::Source::Step(i) => &plan.steps[i].op,
                        _ => &s.op,
                    }))
                    .collect();
                let outs: Vec<&TensorType> = std::iter::once(s.output)
                    .chain(s.with.iter().copied())
                    .map(|v| &plan.types[v])
                    .collect();
                let flash = flash::lower_grad_group_saved(&ops, &ins, &outs, reads)?;
                let wrts: Vec<u8> = ops
                    .iter()
                    .filter_map(|o| match o {
                        Op::AttentionGrad { wrt, .. } => Some(*wrt),
                        _ => None,
                    })
                    .collect();
                // cuDNN's backward writes all three gradients.
                let desc = (wrts == [0, 1, 2])
                    .then(|| AttnDnnDesc::of_grad(&s.op, &ins, outs[0]))
                    .flatten();
                return grad_step(&s.op, &ins, outs[0], flash, desc);
            }
            lower_step(&s.op, &ins, &plan.types[s.output])
        })
        .collect()
}

/// An attention forward step that cuDNN's fused attention or the flash kernels (`flash`, which
/// with `saves` write the statistics a gradient step reads) run, as
/// [`attention_cudnn::Choice`] and measurement decide.
fn attention_step(
    op: &Op,
    inputs: &[&TensorType],
    out: &TensorType,
    flash: StepKernels,
    saves: bool,
) -> Result<CudaStep> {
    match (
        attention_cudnn::Choice::from_env(),
        AttnDnnDesc::of(op, inputs, out),
    ) {
        (attention_cudnn::Choice::Flash, _) => Ok(CudaStep::Kernels(flash)),
        (_, Some(cudnn)) => Ok(CudaStep::Attention {
            cudnn,
            flash,
            saves,
        }),
        (attention_cudnn::Choice::Cudnn, None) if out.shape.numel() > 0 => {
            attention_cudnn::forced_error(op, inputs)
        }
        _ => Ok(CudaStep::Kernels(flash)),
    }
}

/// An attention gradient step that cuDNN's fused backward (`desc`, when it covers the op) or
/// the flash kernels run, as [`attention_cudnn::Choice`] and measurement decide.
fn grad_step(
    op: &Op,
    ins: &[&TensorType],
    out: &TensorType,
    flash: StepKernels,
    desc: Option<AttnDnnDesc>,
) -> Result<CudaStep> {
    match (attention_cudnn::Choice::from_env(), desc) {
        (attention_cudnn::Choice::Flash, _) => Ok(CudaStep::Kernels(flash)),
        (_, Some(cudnn)) => Ok(CudaStep::AttentionGrad { cudnn, flash }),
        (attention_cudnn::Choice::Cudnn, None) if out.shape.numel() > 0 => {
            attention_cudnn::forced_error(op, ins)
        }
        _ => Ok(CudaStep::Kernels(flash)),
    }
}

/// The attention forwards whose flash kernels save their statistics (value → the statistics'
/// byte offset past the result): those a group of all three gradients reads (`Step::saved`,
/// set by the memory plan for groups without a mask operand, and a packed attention's one
/// gradient step), whose slot is in the arena (with room after O) and whose forward and
/// gradients the flash kernels take.
fn flash_saved(plan: &crate::Plan) -> std::collections::HashMap<crate::ValueId, usize> {
    let flash_ins = |s: &crate::Step| flash::supported(&operand_types(plan, s));
    plan.steps
        .iter()
        .filter_map(|g| {
            let v = g.saved?;
            let crate::Source::Step(f) = plan.sources[v] else {
                return None;
            };
            let fw = &plan.steps[f];
            (matches!(plan.storage[v], crate::Storage::Arena { .. })
                && matches!(fw.op, Op::Attention { .. })
                && matches!(g.op, Op::AttentionGrad { .. })
                && flash_ins(fw)
                && flash_ins(g))
            .then(|| (v, rustytorch_compiler::plan::stats_offset(&plan.types[v])))
        })
        .collect()
}

/// The saved statistics of step `i` of `plan` (lowered as `steps`), a group of attention
/// gradients run by cuDNN or the flash kernels ([`CudaStep::AttentionGrad`]) whose forward
/// (`Step::saved`) runs cuDNN's fused attention ([`CudaStep::Attention`]) of the same
/// description: the forward's value, whose buffer holds its result O and, at the returned byte
/// offset, the statistics a cuDNN forward with statistics writes there. `None` otherwise: the
/// gradient then recomputes the forward.
pub fn saved_stats(plan: &crate::Plan, steps: &[CudaStep], i: usize) -> Option<(usize, usize)> {
    let v = plan.steps.get(i)?.saved?;
    let crate::Source::Step(f) = plan.sources[v] else {
        return None;
    };
    // O's slot in the arena (256-byte aligned) has room for the statistics after it; they stay
    // there when a run hands O to a caller's buffer (an output), which both steps then address.
    // The forward and the gradients read the same q, k and v, so when their alignment keeps
    // cuDNN's forward from running (it then runs the flash kernel, which writes no statistics)
    // it keeps cuDNN's backward from running too (the flash gradients recompute them).
    if !matches!(plan.storage[v], crate::Storage::Arena { .. }) {
        return None;
    }
    match (steps.get(i)?, steps.get(f)?) {
        (CudaStep::AttentionGrad { cudnn: g, .. }, CudaStep::Attention { cudnn: fw, .. })
            if g == fw =>
        {
            Some((v, rustytorch_compiler::plan::stats_offset(&plan.types[v])))
        }
        _ => None,
    }
}

/// Whether pooling runs through cuDNN instead of the generated kernels.
fn cudnn_pooling() -> bool {
    std::env::var("RUSTYTORCH_CUDNN_POOLING").as_deref() == Ok("1")
}

/// Lowers one op with operand types `inputs` and result type `out` for CUDA. Cumsum and topk have
/// no CUDA implementation yet: they are an error naming the op.
pub fn lower_step(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<CudaStep> {
    let unsupported = || {
        Err(CodegenError::Unsupported {
            op: op.name(),
            device: "cuda",
            reason: "it has no CUDA implementation yet; run this graph with Device::Cpu".into(),
        })
    };
    match op {
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Constant { .. }
        | Op::Full { .. }
        | Op::Iota { .. }
        | Op::RandUniform { .. }
        | Op::RandNormal { .. } => Err(CodegenError::Invalid(format!(
            "leaf `{}` is not a step",
            op.name()
        ))),
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } | Op::Fused(_) => {
            elementwise::lower(op, inputs, out).map(CudaStep::Kernels)
        }
        Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Expand { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Pad { .. }
        | Op::Gather { .. }
        | Op::ScatterAdd { .. }
        | Op::IndexSelect { .. }
        | Op::IndexAdd { .. } => {
            elementwise::lower_movement(op, inputs, out).map(CudaStep::Kernels)
        }
        Op::Reduce { .. }
        | Op::ArgReduce { .. }
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        | Op::CrossEntropy { .. }
        | Op::CrossEntropyGrad { .. } => reduce::lower(op, inputs, out).map(CudaStep::Kernels),
        Op::FusedRow(_) => fused_row::lower(op, inputs, out).map(CudaStep::Kernels),
        Op::Matmul { .. } | Op::MatmulEpilogue { .. } | Op::MatmulActGrad { .. } => {
            matmul::lower(op, inputs, out)
        }
        Op::Conv { .. } | Op::ConvGradInput { .. } | Op::ConvGradWeight { .. } => {
            dnn::lower_step(op, inputs, out).map(CudaStep::Dnn)
        }
        // Generated kernels by default (faster than cuDNN's pooling on the H200, see
        // docs/performance.md); `RUSTYTORCH_CUDNN_POOLING=1` selects cuDNN's for comparison.
        Op::Pool { .. } | Op::PoolGrad { .. } if cudnn_pooling() => {
            dnn::lower_step(op, inputs, out).map(CudaStep::Dnn)
        }
        Op::Pool { .. } | Op::PoolGrad { .. } => {
            pool::lower(op, inputs, out).map(CudaStep::Kernels)
        }
        Op::Attention {
            layout: AttnLayout::Bshd,
            ..
        }
        | Op::AttentionGrad {
            layout: AttnLayout::Bshd,
            ..
        } if !flash::supported(inputs) => attention::lower_bshd(op, inputs, out),
        // The compiler packs q, k and v only where the flash kernels run (see
        // `rustytorch_compiler::attn_packed`).
        Op::Attention {
            layout: AttnLayout::Packed,
            ..
        }
        | Op::AttentionGrad {
            layout: AttnLayout::Packed,
            ..
        } if !flash::supported(inputs) => Err(CodegenError::Unsupported {
            op: op.name(),
            device: "cuda",
            reason: format!(
                "packed q, k and v run on the flash kernels only (f16/bf16, head sizes that \
                 are multiples of 16 up to {}); got {}",
                flash::MAX_HEAD,
                inputs[0]
            ),
        }),
        // A packed attention's one gradient (dq, dk and dv in one tensor).
        Op::AttentionGrad {
            layout: AttnLayout::Packed,
            ..
        } => {
            let flash = flash::lower_grad(op, inputs, out)?;
            grad_step(
                op,
                inputs,
                out,
                flash,
                AttnDnnDesc::of_grad(op, inputs, out),
            )
        }
        Op::AttentionGrad { .. } if flash::supported(inputs) => {
            flash::lower_grad(op, inputs, out).map(CudaStep::Kernels)
        }
        Op::AttentionGrad { .. } if attention::gemm_path(inputs) => {
            attention::lower_grad_gemm(op, inputs, out)
        }
        Op::AttentionGrad { .. } => attention::lower_grad(op, inputs, out).map(CudaStep::Kernels),
        Op::CumSum { .. } | Op::TopK { .. } => unsupported(),
        Op::Attention { .. } if flash::supported(inputs) => {
            let flash = flash::lower(op, inputs, out)?;
            attention_step(op, inputs, out, flash, false)
        }
        Op::Attention { .. } if attention::gemm_path(inputs) => {
            attention::lower_gemm(op, inputs, out)
        }
        Op::Attention { .. } => attention::lower(op, inputs, out).map(CudaStep::Kernels),
        Op::SparseMatmul { .. } => sparse::lower_spmm(op, inputs, out).map(CudaStep::Spmm),
        Op::SampledMatmul => sparse::lower_sddmm(op, inputs, out).map(CudaStep::Kernels),
        // The runtime runs it through the session's communicator (shape and dtype were
        // checked by the op's inference: a floating-point tensor, the output of its type).
        Op::AllReduce { mean } if inputs.len() == 1 && inputs[0] == out => {
            Ok(CudaStep::AllReduce { mean: *mean })
        }
        Op::AllReduce { .. } => Err(CodegenError::Invalid(format!(
            "all_reduce: operands {inputs:?} for a result of type {out}"
        ))),
    }
}
