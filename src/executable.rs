//! Compiling a graph into an [`Executable`] and running it with host tensors. An executable holds a
//! backend session that owns the parameter and optimizer state on its device; the state persists
//! across runs and can be read, written, saved and loaded.

use crate::{Error, Result};
use rustytorch_codegen::{lower, CodegenError, Plan, Storage};
use rustytorch_compiler::CompileError;
use rustytorch_compiler::{Graph, GraphBuilder, MemoryPlan, Tensor};
use rustytorch_ops::{DType, HostTensor, Op, TensorType};
use rustytorch_runtime::cpu::NonFiniteValue;
use rustytorch_runtime::device::{place, Placement, Workload, COST_MODEL};
use rustytorch_runtime::{
    CpuBackend, Device, MemoryStats, RuntimeError, Session, StepTimes, TransferStats,
};
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// What to do when a gradient is NaN or infinite.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum NonFinitePolicy {
    /// Return [`Error::NonFinite`] naming the parameter (no update applied).
    #[default]
    Error,
    /// Skip the step's updates and report it in [`Outputs::skipped`].
    SkipStep,
}

/// Loss scaling of a training step ([`CompileOptions::loss_scale`]), as PyTorch's `GradScaler`
/// does it: the backward starts from the scale instead of one, so every gradient is computed
/// multiplied by the scale (an f16 gradient that would flush to zero stays representable), and
/// each gradient is multiplied by the reciprocal of the scale, in f32, before the finiteness
/// guards, the norm, clipping and the optimizer read it. The scale is the state scalar
/// `optim.loss_scale` (saved and loaded with the other state; setting it never recompiles).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum LossScale {
    /// [`LossScale::Dynamic`] with its defaults when [`CompileOptions::autocast`] is f16, else
    /// [`LossScale::Off`]: f16 has five exponent bits, so small gradients flush to zero unless
    /// the loss is scaled; bf16 and f32 have f32's range and need no scaling. The environment's
    /// `RUSTYTORCH_LOSS_SCALE` (`off`, `dynamic`, `dynamic:init=N,interval=N`, a number: the
    /// text forms `LossScale` parses from) overrides this default.
    #[default]
    Auto,
    /// No scaling.
    Off,
    /// A fixed scale. A non-finite gradient is handled by [`CompileOptions::nonfinite`].
    Static(f32),
    /// A scale that adapts: a step with a non-finite gradient is skipped (whatever
    /// [`CompileOptions::nonfinite`] says: overflow is how the scale finds its ceiling; with data
    /// parallelism every replica skips, since the guards read averaged gradients) and multiplies
    /// the scale by `backoff`; `interval` consecutive finite steps multiply it by `growth`.
    /// The finite steps are counted in the state scalar `optim.loss_scale.good_steps` and the
    /// skipped ones in `optim.loss_scale.skipped` (see [`Executable::loss_scale`]).
    Dynamic {
        /// The starting scale (PyTorch's default: 65536).
        init: f32,
        /// Growth factor (2).
        growth: f32,
        /// Backoff factor after a non-finite gradient (0.5).
        backoff: f32,
        /// Consecutive finite steps before the scale grows (2000).
        interval: u32,
    },
}

impl LossScale {
    /// Dynamic scaling with PyTorch's defaults: start at 65536, halve after a non-finite
    /// gradient, double after 2000 finite steps.
    pub const DYNAMIC: LossScale = LossScale::Dynamic {
        init: 65536.0,
        growth: 2.0,
        backoff: 0.5,
        interval: 2000,
    };

    /// Checks the factors: a finite positive scale, growth at least 1, backoff in (0, 1],
    /// interval at least 1.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| {
            Err(Error::Compile(CompileError::Invalid(format!(
                "loss scale: {what}"
            ))))
        };
        match *self {
            LossScale::Auto | LossScale::Off => Ok(()),
            LossScale::Static(s) if !(s.is_finite() && s > 0.0) => bad(format!(
                "a static scale must be finite and positive, got {s}"
            )),
            LossScale::Static(_) => Ok(()),
            LossScale::Dynamic {
                init,
                growth,
                backoff,
                interval,
            } => {
                if !(init.is_finite() && init > 0.0) {
                    bad(format!("init must be finite and positive, got {init}"))
                } else if !(growth.is_finite() && growth >= 1.0) {
                    bad(format!(
                        "growth must be finite and at least 1, got {growth}"
                    ))
                } else if !(backoff > 0.0 && backoff <= 1.0) {
                    bad(format!("backoff must be in (0, 1], got {backoff}"))
                } else if interval == 0 {
                    bad("interval must be at least 1".into())
                } else {
                    Ok(())
                }
            }
        }
    }

    /// The scaling to compile with: `Auto` resolved (from `RUSTYTORCH_LOSS_SCALE`, else from
    /// the autocast type), the others checked.
    fn resolve(&self, autocast: Option<DType>) -> Result<LossScale> {
        if *self != LossScale::Auto {
            self.validate()?;
            return Ok(*self);
        }
        if let Ok(v) = std::env::var("RUSTYTORCH_LOSS_SCALE") {
            if !v.trim().is_empty() {
                let parsed: LossScale = v.parse().map_err(|e: Error| {
                    Error::Compile(CompileError::Invalid(format!("RUSTYTORCH_LOSS_SCALE: {e}")))
                })?;
                if parsed != LossScale::Auto {
                    return Ok(parsed);
                }
            }
        }
        Ok(match autocast {
            Some(DType::F16) => LossScale::DYNAMIC,
            _ => LossScale::Off,
        })
    }
}

impl std::str::FromStr for LossScale {
    type Err = Error;

    /// `auto`, `off` (or `none`), a number (a static scale), `dynamic`, or `dynamic:` followed by
    /// comma-separated `init=`, `growth=`, `backoff=`, `interval=` settings that replace the
    /// defaults (`dynamic:init=1024,interval=100`).
    fn from_str(text: &str) -> Result<LossScale> {
        let t = text.trim();
        let bad = |why: String| {
            Err(Error::Compile(CompileError::Invalid(format!(
                "loss scale `{t}`: {why} (expected auto, off, a number, dynamic or \
                 dynamic:init=N,growth=N,backoff=N,interval=N)"
            ))))
        };
        let parsed = match t.to_ascii_lowercase().as_str() {
            "auto" => LossScale::Auto,
            "off" | "none" => LossScale::Off,
            "dynamic" => LossScale::DYNAMIC,
            lower => match lower.strip_prefix("dynamic:") {
                Some(list) => {
                    let LossScale::Dynamic {
                        mut init,
                        mut growth,
                        mut backoff,
                        mut interval,
                    } = LossScale::DYNAMIC
                    else {
                        unreachable!("DYNAMIC is dynamic")
                    };
                    for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
                        let Some((key, value)) = item.split_once('=') else {
                            return bad(format!("`{item}` is not key=value"));
                        };
                        let (key, value) = (key.trim(), value.trim());
                        let number = |v: &str| -> std::result::Result<f32, String> {
                            v.parse::<f32>()
                                .map_err(|_| format!("`{key}`: `{v}` is not a number"))
                        };
                        let r = match key {
                            "init" => number(value).map(|v| init = v),
                            "growth" => number(value).map(|v| growth = v),
                            "backoff" => number(value).map(|v| backoff = v),
                            "interval" => value
                                .parse::<u32>()
                                .map(|v| interval = v)
                                .map_err(|_| format!("`interval`: `{value}` is not a count")),
                            other => Err(format!("unknown setting `{other}`")),
                        };
                        if let Err(why) = r {
                            return bad(why);
                        }
                    }
                    LossScale::Dynamic {
                        init,
                        growth,
                        backoff,
                        interval,
                    }
                }
                None => match lower.parse::<f32>() {
                    Ok(s) => LossScale::Static(s),
                    Err(_) => return bad("not a loss scale".into()),
                },
            },
        };
        parsed.validate()?;
        Ok(parsed)
    }
}

/// Where an executable's loss scaling stands ([`Executable::loss_scale`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaleStatus {
    /// The scale the next step runs with.
    pub scale: f32,
    /// Whether the scale adapts ([`LossScale::Dynamic`]).
    pub dynamic: bool,
    /// Consecutive finite steps since the scale last changed (0 for a static scale).
    pub good_steps: u64,
    /// Steps skipped for a non-finite gradient under dynamic scaling, over the state's life
    /// (it is saved and loaded with the state).
    pub skipped: u64,
}

/// An executable's loss-scaling state tensors and its backoff factor.
#[derive(Clone, Debug)]
struct LossScaler {
    state: rustytorch_compiler::optim::LossScaleState,
    backoff: f64,
}

/// Compile options.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// Run the e-graph optimizer and fusion (false runs neither).
    pub optimize: bool,
    /// Apply the graph's state updates (training); false compiles an inference executable of the
    /// same graph.
    pub updates: bool,
    /// Non-finite gradient policy (under dynamic loss scaling, a non-finite gradient always
    /// skips the step: see [`LossScale::Dynamic`]).
    pub nonfinite: NonFinitePolicy,
    /// Anomaly mode: check every value every step produces for NaN and infinite elements and
    /// fail the run at the first with [`Error::Anomaly`], naming the op, the step and where the
    /// value was built. Runs on the CPU only. Defaults to on when the environment sets
    /// `RUSTYTORCH_ANOMALY=1`; off, it costs nothing.
    pub anomaly: bool,
    /// For a graph with named dims: how many compiled shapes the executable keeps (at least
    /// one; the least recently used is dropped first). See [`Executable::shape_cache`].
    pub shape_cache: usize,
    /// On a GPU: capture the whole plan as a CUDA graph after its first run and replay it, so a
    /// small model's run is not its launch count times the launch cost (the plan is static:
    /// every buffer and kernel argument is fixed at prepare). On by default; the environment's
    /// `RUSTYTORCH_CUDA_GRAPH=0` turns the default off. Runs with step timing on are eager.
    pub graph_replay: bool,
    /// Mixed precision: run the matmuls, attention and convolutions of an f32 graph in bf16 or
    /// f16 (f32 accumulation), and everything else — norms, softmax, losses, optimizer updates,
    /// the parameters themselves — in f32 (the compiler's `autocast` pass). `None` (the
    /// default; the environment's `RUSTYTORCH_AUTOCAST=bf16|f16` sets it) keeps the graph's
    /// types. With f16, training scales the loss (see [`CompileOptions::loss_scale`]) so that
    /// small gradients do not flush to zero.
    pub autocast: Option<DType>,
    /// Loss scaling of the graph's training step (see [`LossScale`]): by default ([`LossScale::Auto`])
    /// dynamic under f16 autocast and off otherwise. Graphs without a training step ignore it.
    pub loss_scale: LossScale,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            optimize: true,
            updates: true,
            nonfinite: NonFinitePolicy::Error,
            anomaly: std::env::var("RUSTYTORCH_ANOMALY").is_ok_and(|v| v.trim() == "1"),
            shape_cache: 8,
            graph_replay: std::env::var("RUSTYTORCH_CUDA_GRAPH").as_deref() != Ok("0"),
            autocast: match std::env::var("RUSTYTORCH_AUTOCAST").as_deref() {
                Ok("bf16") => Some(DType::BF16),
                Ok("f16") => Some(DType::F16),
                _ => None,
            },
            loss_scale: LossScale::Auto,
        }
    }
}

/// The first NaN or infinite value a run produced in anomaly mode.
#[derive(Clone, Debug, PartialEq)]
pub struct Anomaly {
    /// The plan step that produced it.
    pub step: usize,
    /// The step's op (`fused` for a fused kernel).
    pub op: &'static str,
    /// The type of the step's result.
    pub ty: TensorType,
    /// Row-major index of the first non-finite element.
    pub index: usize,
    /// That element (NaN, inf or -inf).
    pub value: f64,
    /// Where the value was built (`file:line:col` of the builder call), when known: graphs
    /// loaded from files carry no locations, and gradient and optimizer nodes have none.
    pub location: Option<String>,
    /// For a fused kernel: which of its original ops first produced a non-finite value at
    /// that element.
    pub origin: Option<FusedOrigin>,
}

/// The op inside a fused kernel that first produced a non-finite value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedOrigin {
    /// Its instruction index in the kernel (`t{instr}` in the IR).
    pub instr: usize,
    /// Its op.
    pub op: &'static str,
    /// Where the original op was built, when known.
    pub location: Option<String>,
}

impl fmt::Display for Anomaly {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = |l: &Option<String>| match l {
            Some(l) => format!("built at {l}"),
            None => "source location unknown".to_string(),
        };
        write!(
            f,
            "anomaly: step {} ({}, {}) produced {} at element {} of its {} result",
            self.step,
            self.op,
            at(&self.location),
            self.value,
            self.index,
            self.ty
        )?;
        if let Some(o) = &self.origin {
            write!(
                f,
                "; inside the fused kernel it first comes from instruction t{} ({}, {})",
                o.instr,
                o.op,
                at(&o.location)
            )?;
        }
        Ok(())
    }
}

/// Per plan step, the source location of its node and, for a fused kernel, of each instruction.
#[derive(Clone, Debug, Default)]
struct StepSources {
    steps: Vec<(Option<String>, Vec<Option<String>>)>,
}

impl StepSources {
    /// The plan's steps are the memory plan's schedule without its leaves (as `lower` makes
    /// them); each takes its node's provenance. Empty when the two do not line up.
    fn new(graph: &Graph, memory: &MemoryPlan, plan: &Plan) -> StepSources {
        let text = |l: Option<rustytorch_compiler::graph::SourceLocation>| l.map(|l| l.to_string());
        let mut steps = Vec::with_capacity(plan.steps.len());
        for &n in &memory.schedule {
            let Ok(node) = graph.node(n) else {
                return StepSources::default();
            };
            if matches!(
                node.op,
                Op::Input { .. }
                    | Op::Param { .. }
                    | Op::Constant { .. }
                    | Op::Full { .. }
                    | Op::Iota { .. }
                    | Op::RandUniform { .. }
                    | Op::RandNormal { .. }
            ) {
                continue;
            }
            if plan.steps.get(steps.len()).map(|s| &s.op) != Some(&node.op) {
                return StepSources::default();
            }
            let instrs = graph
                .provenance
                .fused
                .get(&n)
                .map(|v| v.iter().map(|&l| text(l)).collect())
                .unwrap_or_default();
            steps.push((text(graph.location(n)), instrs));
        }
        if steps.len() != plan.steps.len() {
            return StepSources::default();
        }
        StepSources { steps }
    }

    /// The anomaly a session reported, with its sources.
    fn anomaly(&self, v: &NonFiniteValue) -> Anomaly {
        let step = self.steps.get(v.step);
        Anomaly {
            step: v.step,
            op: v.op,
            ty: v.ty.clone(),
            index: v.index,
            value: v.value,
            location: step.and_then(|s| s.0.clone()),
            origin: v.instr.map(|(instr, op)| FusedOrigin {
                instr,
                op,
                location: step.and_then(|s| s.1.get(instr).cloned().flatten()),
            }),
        }
    }
}

impl CompileOptions {
    /// Without state updates (inference).
    pub fn inference() -> CompileOptions {
        CompileOptions {
            updates: false,
            ..CompileOptions::default()
        }
    }
}

/// What [`Executable::run_device`] returns.
#[derive(Debug)]
pub struct DeviceOutputs {
    /// `(name, output)` in output order, each in a device memory block of its own.
    pub outputs: Vec<(String, rustytorch_runtime::device::DeviceOutput)>,
    /// Inputs and outputs copied device-to-device instead of used in place: `(slot, name,
    /// reason)`.
    pub copies: Vec<(rustytorch_runtime::device::IoSlot, String, String)>,
    /// As [`Outputs::skipped`].
    pub skipped: Option<String>,
}

/// The outputs of one run, by position or name.
#[derive(Clone, Debug)]
pub struct Outputs {
    names: Vec<String>,
    values: Vec<HostTensor>,
    /// When the step's updates were skipped: the parameter whose gradient was not finite.
    pub skipped: Option<String>,
}

impl Outputs {
    /// The output with this name.
    pub fn get(&self, name: &str) -> Option<&HostTensor> {
        self.names
            .iter()
            .position(|n| n == name)
            .map(|i| &self.values[i])
    }
    /// Names, in order.
    pub fn names(&self) -> &[String] {
        &self.names
    }
    /// Values, in order.
    pub fn into_vec(self) -> Vec<HostTensor> {
        self.values
    }
    /// (name, value) pairs.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &HostTensor)> {
        self.names.iter().map(|s| s.as_str()).zip(&self.values)
    }
    /// Number of outputs.
    pub fn len(&self) -> usize {
        self.values.len()
    }
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
}

impl std::ops::Index<usize> for Outputs {
    type Output = HostTensor;
    fn index(&self, i: usize) -> &HostTensor {
        &self.values[i]
    }
}

/// A compiled graph bound to a device: the lowered plan and the session that holds its parameter
/// and state tensors.
pub struct Executable {
    source: Graph,
    optimized: Graph,
    plan: Arc<Plan>,
    session: Box<dyn Session>,
    placement: Placement,
    opts: CompileOptions,
    report: rustytorch_compiler::passes::Report,
    /// Sources of the plan's steps, in anomaly mode.
    sources: Option<StepSources>,
    /// Step timing and the Chrome trace.
    observe: Observe,
    /// The other compiled shapes of a graph with named dims.
    shapes: ShapeCache,
    /// The data-parallel group this executable's sessions joined.
    group: Option<Arc<dyn rustytorch_runtime::Communicator>>,
    /// The training step's loss scaling, when it has one.
    loss_scale: Option<LossScaler>,
}

/// The shapes an executable of a graph with named dims has compiled: the current one's plan and
/// session are the executable's own fields; the others wait here, most recently used first.
struct ShapeCache {
    /// The named dims' sizes of the current plan (empty for a graph without named dims).
    current: Vec<usize>,
    others: Vec<Specialization>,
    capacity: usize,
    stats: ShapeCacheStats,
    /// Counts changes of the parameter values; the current session always holds the newest, and
    /// each cached one records the count it holds.
    version: u64,
    /// The parameter values the executable was compiled with (version 0).
    initial: Vec<Arc<HostTensor>>,
}

/// One compiled shape, with its own plan and session.
struct Specialization {
    sizes: Vec<usize>,
    optimized: Graph,
    plan: Arc<Plan>,
    session: Box<dyn Session>,
    report: rustytorch_compiler::passes::Report,
    sources: Option<StepSources>,
    compile: crate::trace::CompileTimes,
    version: u64,
}

/// What an executable's cache of compiled shapes did (graphs with named dims).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShapeCacheStats {
    /// Shapes compiled so far (the first, at the default sizes, included).
    pub compiled: usize,
    /// Compiled shapes held now (the current one included).
    pub cached: usize,
    /// Most shapes held.
    pub capacity: usize,
    /// Runs whose shape was already compiled.
    pub hits: u64,
    /// Runs that compiled a new shape.
    pub misses: u64,
    /// Compiled shapes dropped to stay within the capacity.
    pub evictions: u64,
}

impl fmt::Display for ShapeCacheStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} shapes compiled, {} of at most {} cached, {} hits, {} misses, {} evicted",
            self.compiled, self.cached, self.capacity, self.hits, self.misses, self.evictions
        )
    }
}

/// An executable's step timing and trace.
struct Observe {
    compile: crate::trace::CompileTimes,
    /// Step timing asked for through [`Executable::set_step_timing`].
    timing: bool,
    /// The step times of the last run made with timing on.
    last: Option<StepTimes>,
    trace: Option<crate::trace::Tracer>,
}

/// Compiles the graph of `g` computing `outputs` (named as declared with [`GraphBuilder::output`],
/// else `output0`, `output1`, ...), with default options.
pub fn compile(g: &GraphBuilder, outputs: &[&Tensor], device: Device) -> Result<Executable> {
    compile_with(g, outputs, device, &CompileOptions::default())
}

/// [`compile`] with options.
pub fn compile_with(
    g: &GraphBuilder,
    outputs: &[&Tensor],
    device: Device,
    opts: &CompileOptions,
) -> Result<Executable> {
    let mut graph = g.graph()?;
    let declared = std::mem::take(&mut graph.outputs);
    for (i, t) in outputs.iter().enumerate() {
        let id = t.node()?;
        let name = declared
            .iter()
            .find(|(_, n)| *n == id)
            .map(|(s, _)| s.clone())
            .unwrap_or_else(|| format!("output{i}"));
        graph.add_output(&name, id)?;
    }
    compile_graph(&graph, device, opts)
}

/// Compiles a whole graph (its own outputs), e.g. one loaded from a file, and prepares it on
/// `device` ([`Device::Auto`] picks the device from an estimate of the graph's cost; see
/// [`Executable::placement`]).
pub fn compile_graph(graph: &Graph, device: Device, opts: &CompileOptions) -> Result<Executable> {
    let mut source = graph.clone();
    if !opts.updates {
        source.updates.clear();
        source.guards.clear();
    }
    source.remove_dead();
    let loss_scale = scale_loss(&mut source, opts)?;
    if opts.anomaly && !matches!(device, Device::Cpu | Device::Auto) {
        return Err(Error::Runtime(RuntimeError::Device(format!(
            "anomaly mode runs on the cpu for now; compile for the cpu (not {device}) or turn \
             anomaly mode off"
        ))));
    }
    // The graph is built at its named dims' default sizes: compile that shape first.
    let sizes = source.dims.defaults();
    let concrete = source.specialize(&sizes)?;
    let mut params = Vec::with_capacity(source.params.len());
    for p in &source.params {
        let v = match &p.data {
            Some(d) => d.clone(),
            None => p.init.materialize(&p.ty)?,
        };
        params.push(Arc::new(v));
    }
    let (spec, placement) = build(&concrete, sizes.clone(), device, opts, params.clone())?;
    let mut exe = Executable {
        source,
        optimized: spec.optimized,
        plan: spec.plan,
        session: spec.session,
        placement,
        opts: opts.clone(),
        report: spec.report,
        sources: spec.sources,
        observe: Observe {
            compile: spec.compile,
            timing: false,
            last: None,
            trace: None,
        },
        shapes: ShapeCache {
            current: sizes,
            others: Vec::new(),
            capacity: opts.shape_cache.max(1),
            stats: ShapeCacheStats {
                compiled: 1,
                cached: 1,
                capacity: opts.shape_cache.max(1),
                ..ShapeCacheStats::default()
            },
            version: 0,
            initial: params,
        },
        group: None,
        loss_scale,
    };
    if let Some(path) = std::env::var_os("RUSTYTORCH_TRACE").filter(|p| !p.is_empty()) {
        exe.trace_to(Path::new(&path))?;
    }
    Ok(exe)
}

/// Sets up the loss scaling that `opts` asks for in the training step of `source` (see
/// [`rustytorch_compiler::optim::scale_loss`]).
fn scale_loss(source: &mut Graph, opts: &CompileOptions) -> Result<Option<LossScaler>> {
    use rustytorch_compiler::optim::LossScaleSpec;
    let how = opts.loss_scale.resolve(opts.autocast)?;
    // Only a training step has a loss to scale: an inference executable of the same graph
    // (whose outputs may still read gradients) computes them unscaled.
    let how = if source.updates.is_empty() {
        LossScale::Off
    } else {
        how
    };
    let (spec, backoff) = match how {
        LossScale::Auto | LossScale::Off => (None, 1.0),
        LossScale::Static(s) => (
            Some(LossScaleSpec {
                init: f64::from(s),
                growth: None,
            }),
            1.0,
        ),
        LossScale::Dynamic {
            init,
            growth,
            backoff,
            interval,
        } => (
            Some(LossScaleSpec {
                init: f64::from(init),
                growth: Some((f64::from(growth), u64::from(interval))),
            }),
            f64::from(backoff),
        ),
    };
    let state = rustytorch_compiler::optim::scale_loss(source, spec.as_ref())?;
    if source.updates.is_empty() {
        // An exported loss-scaled graph keeps its scale state, which nothing updates here.
        return Ok(None);
    }
    if state.is_none() && spec.is_some() && !source.updates.is_empty() {
        if opts.loss_scale == LossScale::Auto {
            tracing::warn!(
                "the graph's training step has no loss-scaling sites (it was not built by \
                 train_step, or by an older version): training without loss scaling"
            );
        } else {
            return Err(Error::Compile(CompileError::Invalid(format!(
                "loss scale {how:?}: the graph's updates were not built by train_step, so there \
                 is no loss to scale; build the step with GraphBuilder::train_step or compile \
                 with LossScale::Off"
            ))));
        }
    }
    Ok(state.map(|state| LossScaler {
        backoff: if state.counters.is_some() && spec.is_none() {
            // A graph exported with dynamic scaling, compiled without asking for any.
            0.5
        } else {
            backoff
        },
        state,
    }))
}

/// The compile pass options for a graph that runs on `device`, a resolved device (the CPU's for
/// [`Device::Auto`], which is compiled for the CPU first and again for the GPU it picks).
pub(crate) fn pass_options(
    device: Device,
    opts: &CompileOptions,
) -> rustytorch_compiler::passes::Options {
    let cuda = matches!(device, Device::Cuda(_));
    rustytorch_compiler::passes::Options {
        optimize: opts.optimize,
        fuse: opts.optimize,
        // The target decides the layout of convolution stacks (channels-first on the CPU).
        channels_last: cuda.then(rustytorch_codegen::cuda::dnn::channels_last),
        autocast: opts.autocast,
        // Attention reads heads in place ([B,S,H,D]) on both devices: the CUDA kernels forward
        // and backward; on the CPU the f32 forward kernel, while the CPU's gradient kernel would
        // transpose its operands itself, so CPU gradients keep the graph's transposes.
        attention_layout: true,
        attention_layout_grads: cuda,
        // The CUDA kernels read q, k and v sliced from one linear layer's output in place.
        attention_packed: cuda,
        // CUDA launches each level of the optimizer's tail as one multi-tensor kernel.
        defer_updates: cuda,
        ..Default::default()
    }
}

/// A graph compiled and lowered for one device, with when the passes and the lowering ended.
struct Lowered {
    compiled: rustytorch_compiler::passes::Compiled,
    plan: Arc<Plan>,
    passes_done: Instant,
    lowered: Instant,
}

/// Runs the compile passes for `device` (a resolved device) and lowers the result.
fn compile_for(concrete: &Graph, device: Device, opts: &CompileOptions) -> Result<Lowered> {
    let compiled = rustytorch_compiler::passes::run(concrete, &pass_options(device, opts))?;
    let passes_done = Instant::now();
    let memory = compiled.report.memory.as_ref().ok_or_else(|| {
        CodegenError::Invalid("the compile passes produced no memory plan".into())
    })?;
    let plan = Arc::new(lower(&compiled.graph, memory)?);
    Ok(Lowered {
        compiled,
        plan,
        passes_done,
        lowered: Instant::now(),
    })
}

/// Runs the compile passes over a graph without named dims, lowers it and prepares it on
/// `device` with `params`; returns it with where it was placed. [`Device::Auto`] is compiled for
/// the CPU and placed by the cost model on that plan; when it picks a GPU, the graph is compiled
/// again with that GPU's passes (channels-last convolution stacks, attention in place) and runs
/// there, or on the CPU plan when the GPU cannot prepare it.
fn build(
    concrete: &Graph,
    sizes: Vec<usize>,
    device: Device,
    opts: &CompileOptions,
    params: Vec<Arc<HostTensor>>,
) -> Result<(Specialization, Placement)> {
    crate::trace::epoch();
    let start = Instant::now();
    let first = if device == Device::Auto {
        Device::Cpu
    } else {
        device
    };
    let mut low = compile_for(concrete, first, opts)?;
    let (placement, session, sources) = if opts.anomaly {
        let session = CpuBackend.prepare_with(low.plan.clone(), params, true)?;
        let placement = Placement {
            requested: device,
            device: Device::Cpu,
            reason: "anomaly mode runs on the cpu".into(),
        };
        let memory = low.compiled.report.memory.as_ref().ok_or_else(|| {
            CodegenError::Invalid("the compile passes produced no memory plan".into())
        })?;
        let sources = StepSources::new(&low.compiled.graph, memory, &low.plan);
        (
            placement,
            Box::new(session) as Box<dyn Session>,
            Some(sources),
        )
    } else if device == Device::Auto {
        let mut placement = place(&workload(&low.compiled.graph, &low.plan), &COST_MODEL);
        let mut on_gpu = None;
        if placement.device != Device::Cpu {
            let gpu = placement.device;
            let tried = compile_for(concrete, gpu, opts).and_then(|l| {
                let session = gpu.backend()?.prepare(l.plan.clone(), params.clone())?;
                Ok((l, session))
            });
            match tried {
                Ok((l, session)) => {
                    tracing::debug!("recompiled for {gpu} with its layout passes");
                    low = l;
                    on_gpu = Some(session);
                }
                Err(e) => {
                    placement.device = Device::Cpu;
                    placement.reason = format!("{}; running on the cpu: {e}", placement.reason);
                }
            }
        }
        let mut session = match on_gpu {
            Some(s) => s,
            None => Device::Cpu.backend()?.prepare(low.plan.clone(), params)?,
        };
        session.set_graph_replay(opts.graph_replay);
        (placement, session, None)
    } else {
        let mut session = device.backend()?.prepare(low.plan.clone(), params)?;
        let placement = Placement {
            requested: device,
            device: session.device(),
            reason: "requested".into(),
        };
        session.set_graph_replay(opts.graph_replay);
        (placement, session, None)
    };
    let Lowered {
        compiled,
        plan,
        passes_done,
        lowered,
    } = low;
    tracing::debug!(placement = %placement, "prepared");
    let compile = crate::trace::CompileTimes {
        start,
        passes_done,
        lowered,
        prepared: Instant::now(),
    };
    let spec = Specialization {
        sizes,
        optimized: compiled.graph,
        plan,
        session,
        report: compiled.report,
        sources,
        compile,
        version: 0,
    };
    Ok((spec, placement))
}

/// What one run of `plan` (lowered from `graph`) does, for the placement cost model: FLOPs from
/// [`crate::stats::flops`], the bytes every kernel reads and writes, the bytes of the inputs and
/// outputs, and the kernels launched (reshapes that alias their operand cost nothing).
pub fn workload(graph: &Graph, plan: &Plan) -> Workload {
    let size = |v: usize| plan.types[v].size_bytes() as u64;
    let mut w = Workload {
        flops: crate::stats::flops(graph),
        ..Workload::default()
    };
    for step in &plan.steps {
        if matches!(plan.storage.get(step.output), Some(Storage::Alias(_))) {
            continue;
        }
        w.kernels += 1;
        w.bytes = step.inputs.iter().map(|&v| size(v)).fold(
            w.bytes.saturating_add(size(step.output)),
            u64::saturating_add,
        );
    }
    w.io_bytes = plan
        .inputs
        .iter()
        .map(|(_, t)| t.size_bytes() as u64)
        .chain(plan.outputs.iter().map(|(_, v)| size(*v)))
        .fold(0, u64::saturating_add);
    w
}

impl Executable {
    /// Runs the graph. `inputs` are matched by name; every graph input must be given with its
    /// declared dtype and shape, where a named dim (`x : f32[batch,1,8,8]`) takes any size that
    /// every input naming it agrees on: the executable compiles each new set of sizes once and
    /// keeps the compiled shapes in a bounded cache ([`Executable::shape_cache`]). The session
    /// applies the state updates unless a guard fails.
    pub fn run(&mut self, inputs: &[(&str, HostTensor)]) -> Result<Outputs> {
        let shared: Vec<(&str, Arc<HostTensor>)> = inputs
            .iter()
            .map(|(n, t)| (*n, Arc::new(t.clone())))
            .collect();
        self.run_shared(&shared)
    }

    /// [`Executable::run`] with shared inputs: the session reads them where they are, without
    /// the copy `run` makes (DLPack imports and Python callers use this).
    pub fn run_shared(&mut self, inputs: &[(&str, Arc<HostTensor>)]) -> Result<Outputs> {
        let mut vals: Vec<Option<Arc<HostTensor>>> = vec![None; self.source.inputs.len()];
        for (name, t) in inputs {
            let i = self.input_index(name)?;
            let want = &self.source.inputs[i].ty;
            let fits = if self.source.has_named_dims() {
                t.dtype() == want.dtype
            } else {
                &t.ty() == want
            };
            if !fits {
                return Err(Error::Input {
                    name: name.to_string(),
                    reason: format!(
                        "expected {}, got {}",
                        self.source.sym_type_text(self.source.inputs[i].node),
                        t.ty()
                    ),
                });
            }
            vals[i] = Some(t.clone());
        }
        let ins = self.require_inputs(vals)?;
        let shapes: Vec<&rustytorch_ops::Shape> = ins.iter().map(|t| t.shape()).collect();
        self.bind_shapes(&shapes)?;
        let start = Instant::now();
        let r = self.session.run(&ins);
        self.observe.last = None;
        if self.observe.timing || self.observe.trace.is_some() {
            self.observe.last = self.session.take_step_times();
        }
        if let Some(t) = &mut self.observe.trace {
            if let Err(e) = t.run(start, Instant::now(), self.observe.last.as_ref(), r.is_ok()) {
                // The trace is a side channel: a failed write stops it, not the run.
                tracing::warn!("{e}; tracing stopped");
                self.observe.trace = None;
                self.session.set_step_timing(self.observe.timing);
            }
        }
        let r = match r {
            Ok(r) => r,
            Err(RuntimeError::NonFinite(v)) => {
                let a = match &self.sources {
                    Some(s) => s.anomaly(&v),
                    None => StepSources::default().anomaly(&v),
                };
                return Err(Error::Anomaly(Box::new(a)));
            }
            Err(e) => return Err(e.into()),
        };
        let skipped = self.settle_guards(&r.guards)?;
        Ok(Outputs {
            names: self.plan.outputs.iter().map(|(n, _)| n.clone()).collect(),
            values: r.outputs,
            skipped,
        })
    }

    /// Runs on inputs in device memory by name, read in place by the kernels where the session
    /// can (a replayed CUDA graph or a cuSPARSE call copies device-to-device into its bound
    /// buffer, which the result reports); outputs come back in device memory blocks of their own
    /// that stay reserved until dropped. The session waits for each input's producer stream with
    /// an event. Only a CUDA executable takes device inputs.
    pub fn run_device(
        &mut self,
        inputs: &[(&str, rustytorch_runtime::device::DeviceInput)],
    ) -> Result<DeviceOutputs> {
        let mut vals = vec![None; self.source.inputs.len()];
        for (name, d) in inputs {
            vals[self.input_index(name)?] = Some(d.clone());
        }
        let ins = self.require_inputs(vals)?;
        let shapes: Vec<&rustytorch_ops::Shape> = ins.iter().map(|d| &d.ty.shape).collect();
        self.bind_shapes(&shapes)?;
        let r = self.session.run_device(&ins)?;
        let skipped = self.settle_guards(&r.guards)?;
        let copies = r
            .copies
            .into_iter()
            .map(|(slot, why)| {
                let name = match slot {
                    rustytorch_runtime::device::IoSlot::Input(i) => self.plan.inputs[i].0.clone(),
                    rustytorch_runtime::device::IoSlot::Output(i) => self.plan.outputs[i].0.clone(),
                };
                (slot, name, why)
            })
            .collect();
        Ok(DeviceOutputs {
            outputs: self
                .plan
                .outputs
                .iter()
                .map(|(n, _)| n.clone())
                .zip(r.outputs)
                .collect(),
            copies,
            skipped,
        })
    }

    /// The position of the graph input called `name`.
    fn input_index(&self, name: &str) -> Result<usize> {
        self.source
            .inputs
            .iter()
            .position(|d| d.name == name)
            .ok_or_else(|| {
                let known: Vec<&str> = self.source.inputs.iter().map(|d| d.name.as_str()).collect();
                Error::Input {
                    name: name.to_string(),
                    reason: format!("the graph has no such input (inputs: {})", known.join(", ")),
                }
            })
    }

    /// The inputs in graph order from one slot per graph input, each of them required.
    fn require_inputs<T>(&self, vals: Vec<Option<T>>) -> Result<Vec<T>> {
        let mut ins = Vec::with_capacity(vals.len());
        for (i, v) in vals.into_iter().enumerate() {
            let d = &self.source.inputs[i];
            ins.push(v.ok_or_else(|| Error::Input {
                name: d.name.clone(),
                reason: format!("missing (expected {})", self.source.sym_type_text(d.node)),
            })?);
        }
        Ok(ins)
    }

    /// For a graph with named dims: binds their sizes from the inputs' shapes (in graph order)
    /// and makes the plan of those sizes current.
    fn bind_shapes(&mut self, shapes: &[&rustytorch_ops::Shape]) -> Result<()> {
        if !self.source.has_named_dims() {
            return Ok(());
        }
        let given: Vec<(usize, &rustytorch_ops::Shape)> =
            shapes.iter().copied().enumerate().collect();
        let sizes = self.source.bind_dims(&given).map_err(|e| match e {
            CompileError::Bind { input, reason } => Error::Input {
                name: input,
                reason,
            },
            e => e.into(),
        })?;
        self.specialize_to(sizes)
    }

    /// A run's guards under the non-finite policy: the parameter whose step was skipped, or the
    /// error; a committed update makes the session's parameters the newest version. (The
    /// session has already refused to commit when a guard failed.)
    fn settle_guards(&mut self, guards: &[(String, bool)]) -> Result<Option<String>> {
        let failed = guards
            .iter()
            .find(|(_, ok)| !ok)
            .map(|(n, _)| n.strip_prefix("grad:").unwrap_or(n).to_string());
        let dynamic = self
            .loss_scale
            .as_ref()
            .is_some_and(|l| l.state.counters.is_some());
        let skipped = match (failed, self.opts.nonfinite) {
            (Some(p), _) if dynamic => {
                self.back_off()?;
                Some(p)
            }
            (Some(p), NonFinitePolicy::Error) => return Err(Error::NonFinite { param: p }),
            (Some(p), NonFinitePolicy::SkipStep) => Some(p),
            (None, _) => None,
        };
        if skipped.is_none() && !self.source.updates.is_empty() {
            self.shapes.version += 1;
        }
        Ok(skipped)
    }

    /// After a step skipped under dynamic loss scaling: multiplies the scale by the backoff
    /// factor (staying a positive normal f32), restarts the count of finite steps and counts the
    /// skip. The step committed nothing, so this is the only change to the state.
    fn back_off(&mut self) -> Result<()> {
        let Some(LossScaler {
            state:
                rustytorch_compiler::optim::LossScaleState {
                    scale,
                    counters: Some((good, skipped)),
                },
            backoff,
        }) = self.loss_scale.clone()
        else {
            return Ok(());
        };
        let s = first_f64(&self.session.read_param(scale)?)?;
        let n = first_f64(&self.session.read_param(skipped)?)?;
        let lowered = ((s * backoff) as f32).max(f32::MIN_POSITIVE);
        self.session
            .write_param(scale, &HostTensor::scalar(lowered))?;
        self.session.write_param(good, &HostTensor::scalar(0i64))?;
        self.session
            .write_param(skipped, &HostTensor::scalar(n as i64 + 1))?;
        self.shapes.version += 1;
        tracing::debug!(
            scale = lowered,
            "non-finite gradient: step skipped, loss scale lowered"
        );
        Ok(())
    }

    /// The training step's loss scale and its counters (read from the device), or `None` when
    /// it runs without loss scaling (see [`CompileOptions::loss_scale`]).
    pub fn loss_scale(&self) -> Option<LossScaleStatus> {
        let l = self.loss_scale.as_ref()?;
        let read = |i: usize| {
            self.session
                .read_param(i)
                .ok()
                .and_then(|t| first_f64(&t).ok())
        };
        let (good_steps, skipped) = match l.state.counters {
            Some((g, s)) => (read(g)? as u64, read(s)? as u64),
            None => (0, 0),
        };
        Some(LossScaleStatus {
            scale: read(l.state.scale)? as f32,
            dynamic: l.state.counters.is_some(),
            good_steps,
            skipped,
        })
    }

    /// Makes the plan compiled for these sizes of the named dims current: a cached one, or a new
    /// one compiled from the source graph at those sizes (parameters are shared: a session
    /// made current takes the newest values).
    fn specialize_to(&mut self, sizes: Vec<usize>) -> Result<()> {
        if sizes == self.shapes.current {
            self.shapes.stats.hits += 1;
            return Ok(());
        }
        let at = self.source.dims.describe(&sizes);
        if !self.source.updates.is_empty() {
            return Err(Error::Input {
                name: self.source.inputs.first().map(|d| d.name.clone()).unwrap_or_default(),
                reason: format!(
                    "a graph that updates its parameters (a training step) runs at the sizes it \
                     was built at ({}), not {at}: build the training step at the size to train with",
                    self.source.dims.describe(&self.shapes.current)
                ),
            });
        }
        let mut spec = match self.shapes.others.iter().position(|s| s.sizes == sizes) {
            Some(k) => {
                self.shapes.stats.hits += 1;
                tracing::debug!(dims = %at, "shape cache hit");
                self.shapes.others.remove(k)
            }
            None => {
                self.shapes.stats.misses += 1;
                let t0 = Instant::now();
                let graph = self.source.specialize(&sizes)?;
                let params = if self.shapes.version == 0 {
                    self.shapes.initial.clone()
                } else {
                    (0..self.source.params.len())
                        .map(|i| self.session.read_param(i).map(Arc::new))
                        .collect::<std::result::Result<_, _>>()?
                };
                let (mut spec, _) =
                    build(&graph, sizes, self.session.device(), &self.opts, params)?;
                if let Some(group) = &self.group {
                    spec.session.join(group.clone())?;
                }
                spec.version = self.shapes.version;
                self.shapes.stats.compiled += 1;
                tracing::info!(
                    dims = %at,
                    millis = t0.elapsed().as_secs_f64() * 1e3,
                    compiled = self.shapes.stats.compiled,
                    "compiled a new shape"
                );
                spec
            }
        };
        if spec.version != self.shapes.version {
            for i in 0..self.source.params.len() {
                let v = self.session.read_param(i)?;
                spec.session.write_param(i, &v)?;
            }
            spec.version = self.shapes.version;
        }
        std::mem::swap(&mut self.shapes.current, &mut spec.sizes);
        std::mem::swap(&mut self.optimized, &mut spec.optimized);
        std::mem::swap(&mut self.plan, &mut spec.plan);
        std::mem::swap(&mut self.session, &mut spec.session);
        std::mem::swap(&mut self.report, &mut spec.report);
        std::mem::swap(&mut self.sources, &mut spec.sources);
        std::mem::swap(&mut self.observe.compile, &mut spec.compile);
        // The session set aside holds the newest values.
        spec.version = self.shapes.version;
        self.shapes.others.insert(0, spec);
        while self.shapes.others.len() >= self.shapes.capacity {
            if let Some(old) = self.shapes.others.pop() {
                self.shapes.stats.evictions += 1;
                tracing::debug!(dims = %self.source.dims.describe(&old.sizes), "shape cache evicted");
            }
        }
        self.session
            .set_step_timing(self.observe.timing || self.observe.trace.is_some());
        if self.observe.trace.is_some() {
            let steps = self.step_infos();
            if let Some(t) = &mut self.observe.trace {
                t.set_steps(steps);
            }
        }
        Ok(())
    }

    /// What the cache of compiled shapes did (a graph without named dims has one shape).
    pub fn shape_cache(&self) -> ShapeCacheStats {
        ShapeCacheStats {
            cached: 1 + self.shapes.others.len(),
            ..self.shapes.stats.clone()
        }
    }

    /// The sizes of the named dims the current plan was compiled for (`batch=5`; empty for a
    /// graph without named dims).
    pub fn current_dims(&self) -> String {
        self.source.dims.describe(&self.shapes.current)
    }

    /// The source graph (with its named dims), as compiled.
    pub fn source_graph(&self) -> &Graph {
        &self.source
    }

    /// Writes a Chrome trace (the Trace Event Format that Perfetto and chrome://tracing open)
    /// of this executable to `path`: its compile passes now, and every following run with each
    /// plan step named by its op and source location, its bytes and FLOPs (see
    /// [`crate::trace`]). Executables tracing to one path in a process share the file; it is
    /// valid JSON after every run. `RUSTYTORCH_TRACE=FILE.json` does this for every executable.
    pub fn trace_to(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let steps = self.step_infos();
        let outputs: Vec<&str> = self.plan.outputs.iter().map(|(n, _)| n.as_str()).collect();
        let title = format!(
            "rustytorch on {}: {} steps, outputs {}",
            self.session.device(),
            steps.len(),
            outputs.join(", ")
        );
        let tracer = crate::trace::Tracer::start(
            path.as_ref(),
            &title,
            steps,
            &self.observe.compile,
            &self.report,
        )?;
        self.session.set_step_timing(true);
        self.observe.trace = Some(tracer);
        Ok(())
    }

    /// Stops writing the trace started by [`Executable::trace_to`].
    pub fn stop_trace(&mut self) {
        self.observe.trace = None;
        self.session.set_step_timing(self.observe.timing);
    }

    /// Turns the timing of every plan step of the following runs on or off (read them with
    /// [`Executable::step_times`]). Returns whether the device's session times steps (the CPU
    /// does; a session that does not ignores the call).
    pub fn set_step_timing(&mut self, on: bool) -> bool {
        self.observe.timing = on;
        self.session
            .set_step_timing(on || self.observe.trace.is_some())
    }

    /// The step times of the last run, when step timing (or a trace) was on.
    pub fn step_times(&self) -> Option<&StepTimes> {
        self.observe.last.as_ref()
    }

    /// What each plan step does: op, source location, output type, bytes moved and FLOPs.
    pub fn step_infos(&self) -> Vec<crate::trace::StepInfo> {
        crate::trace::step_infos(&self.optimized, self.report.memory.as_ref(), &self.plan)
    }

    /// The report of the static memory plan: its peak and the largest values live then.
    pub fn memory_report(&self) -> Option<rustytorch_compiler::inspect::memory::MemoryReport> {
        self.report
            .memory
            .as_ref()
            .map(|m| rustytorch_compiler::inspect::memory::memory_report(&self.optimized, m))
    }

    /// The device time of the plan's steps in milliseconds per execution, averaged over
    /// `iters` back-to-back executions on the last run's inputs (device sessions only; call
    /// `run` first).
    pub fn time_steps(&mut self, iters: usize) -> Result<f64> {
        Ok(self.session.time_steps(iters)?)
    }

    /// Joins a data-parallel group: the `all_reduce` steps of every compiled shape, now and
    /// later, exchange with the group's other ranks (see [`crate::parallel::DataParallel`]).
    pub fn join_group(&mut self, group: Arc<dyn rustytorch_runtime::Communicator>) -> Result<()> {
        self.session.join(group.clone())?;
        for s in &mut self.shapes.others {
            s.session.join(group.clone())?;
        }
        self.group = Some(group);
        Ok(())
    }

    /// The graph's inputs: name and type, in order (named dims at their default sizes; see
    /// [`Graph::sym_type_text`] on [`Executable::source_graph`] for the names).
    pub fn input_types(&self) -> Vec<(&str, &TensorType)> {
        self.source
            .inputs
            .iter()
            .map(|d| (d.name.as_str(), &d.ty))
            .collect()
    }

    /// The graph's parameter and state tensors: name and type, in order.
    pub fn param_types(&self) -> Vec<(&str, &TensorType)> {
        self.source
            .params
            .iter()
            .map(|d| (d.name.as_str(), &d.ty))
            .collect()
    }

    /// The optimized, fused graph as IR text.
    pub fn optimized_ir(&self) -> String {
        rustytorch_compiler::text::print(&self.optimized)
    }

    /// The optimized graph.
    pub fn optimized_graph(&self) -> &Graph {
        &self.optimized
    }

    /// The lowered plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// What each compile pass did and how long it took.
    pub fn report(&self) -> &rustytorch_compiler::passes::Report {
        &self.report
    }

    /// The device the graph runs on.
    pub fn device(&self) -> Device {
        self.session.device()
    }

    /// The device's name (`cpu`, `cuda:0`).
    pub fn device_name(&self) -> String {
        self.session.device().to_string()
    }

    /// Where the graph was placed and why (for [`Device::Auto`], the cost estimate).
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// How many runs replayed a captured CUDA graph (see [`CompileOptions::graph_replay`]; 0 on
    /// the CPU).
    pub fn graph_replays(&self) -> u64 {
        self.session.graph_replays()
    }

    /// Statistics of the device memory pool (None on the CPU, which has none).
    pub fn memory_stats(&self) -> Option<MemoryStats> {
        self.session.memory_stats()
    }

    /// Host↔device copies so far (zero on the CPU).
    pub fn transfers(&self) -> TransferStats {
        self.session.transfers()
    }

    fn param_index(&self, name: &str) -> Result<usize> {
        self.source
            .params
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| Error::Input {
                name: name.into(),
                reason: "no such parameter".into(),
            })
    }

    /// A copy of the current value of a parameter or state tensor; None when the graph has no
    /// such parameter (or the device could not copy it back).
    pub fn param(&self, name: &str) -> Option<HostTensor> {
        let i = self.source.params.iter().position(|p| p.name == name)?;
        self.session.read_param(i).ok()
    }

    /// Every parameter and state tensor by name (copies from the device).
    pub fn params(&self) -> Result<Vec<(String, HostTensor)>> {
        self.source
            .params
            .iter()
            .enumerate()
            .map(|(i, d)| Ok((d.name.clone(), self.session.read_param(i)?)))
            .collect()
    }

    /// Sets a parameter or state tensor (type must match).
    pub fn set_param(&mut self, name: &str, value: HostTensor) -> Result<()> {
        let i = self.param_index(name)?;
        let want = &self.source.params[i].ty;
        if &value.ty() != want {
            return Err(Error::Input {
                name: name.into(),
                reason: format!("expected {want}, got {}", value.ty()),
            });
        }
        self.session.write_param(i, &value)?;
        self.shapes.version += 1;
        Ok(())
    }

    /// Copies every parameter that `other` has under the same name and type (e.g. from a training
    /// executable into an inference one, on any devices). Returns how many were copied.
    pub fn copy_params_from(&mut self, other: &Executable) -> Result<usize> {
        let mut n = 0;
        for (i, d) in self.source.params.iter().enumerate() {
            let Some(j) = other.source.params.iter().position(|p| p.name == d.name) else {
                continue;
            };
            if other.source.params[j].ty == d.ty {
                let v = other.session.read_param(j)?;
                self.session.write_param(i, &v)?;
                self.shapes.version += 1;
                n += 1;
            }
        }
        Ok(n)
    }

    /// The source graph with the current parameter values embedded (to save a trained model).
    pub fn export_graph(&self) -> Result<Graph> {
        let mut g = self.source.clone();
        for (i, d) in g.params.iter_mut().enumerate() {
            d.data = Some(self.session.read_param(i)?);
        }
        Ok(g)
    }

    /// Saves every parameter and state tensor to a safetensors file.
    pub fn save_state(&self, path: &Path) -> Result<()> {
        crate::npy::save_safetensors(path, &self.params()?)
    }

    /// Loads parameters and state saved by [`Executable::save_state`]. All or nothing: every
    /// tensor of the file must match a parameter's name and type, else the error names the first
    /// that does not and no parameter changes. Returns how many were loaded.
    pub fn load_state(&mut self, path: &Path) -> Result<usize> {
        let tensors = crate::npy::load_safetensors(path)?;
        let bad = |reason: String| Error::File {
            path: path.display().to_string(),
            reason: format!("{reason}; nothing was loaded"),
        };
        let mut indexed = Vec::with_capacity(tensors.len());
        for (name, t) in tensors {
            let Some(i) = self.source.params.iter().position(|p| p.name == name) else {
                return Err(bad(format!(
                    "tensor `{name}`: the graph has no such parameter"
                )));
            };
            let want = &self.source.params[i].ty;
            if &t.ty() != want {
                return Err(bad(format!(
                    "tensor `{name}`: expected {want}, got {}",
                    t.ty()
                )));
            }
            indexed.push((i, t));
        }
        let n = indexed.len();
        for (i, t) in indexed {
            self.session.write_param(i, &t)?;
        }
        self.shapes.version += 1;
        Ok(n)
    }
}

/// The first element of a tensor as f64.
fn first_f64(t: &HostTensor) -> Result<f64> {
    t.to_f64_vec().first().copied().ok_or_else(|| {
        Error::Compile(CompileError::Invalid(format!(
            "expected a scalar state tensor, got {}",
            t.ty()
        )))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A graph placed on CUDA (asked for, or resolved from `Auto`) gets CUDA's layout passes;
    /// the CPU, and `Auto`'s first compile (for the CPU), get channels-first convolutions and
    /// in-place heads for the attention forward only.
    #[test]
    fn pass_options_follow_the_resolved_device() {
        let opts = CompileOptions::default();
        for gpu in [Device::Cuda(0), Device::Cuda(1)] {
            let o = pass_options(gpu, &opts);
            assert_eq!(
                o.channels_last,
                Some(rustytorch_codegen::cuda::dnn::channels_last())
            );
            assert!(o.attention_layout && o.attention_layout_grads && o.optimize && o.fuse);
        }
        for other in [Device::Cpu, Device::Auto] {
            let o = pass_options(other, &opts);
            assert!(o.channels_last.is_none(), "{other}");
            assert!(o.attention_layout && !o.attention_layout_grads, "{other}");
        }
        let o = pass_options(
            Device::Cuda(0),
            &CompileOptions {
                optimize: false,
                ..CompileOptions::default()
            },
        );
        assert!(!o.optimize && !o.fuse && o.channels_last.is_some());
    }
}
