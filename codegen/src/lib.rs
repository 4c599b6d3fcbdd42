//! RustyTorch's codegen: lowers an optimized, fused [`Graph`] into a backend-neutral [`Plan`] — a
//! straight list of kernel steps over dense value ids, with the leaves resolved (inputs, parameters,
//! constants; generator leaves such as `Full`/`Iota`/`Rand*` evaluated once at lowering time) and
//! each value's last use recorded so backends free buffers as soon as possible.

pub mod cuda;

use rustytorch_compiler::{Graph, MemoryPlan, NodeId};
use rustytorch_ops::{eval_cpu, HostTensor, Op, OpError, TensorType};
use std::collections::HashMap;
use std::sync::Arc;

/// Errors of lowering.
#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    /// The graph is not lowerable.
    #[error("codegen: {0}")]
    Invalid(String),
    /// Evaluating a generator leaf failed.
    #[error(transparent)]
    Op(#[from] OpError),
    /// An op has no implementation on a device.
    #[error("{op}: not supported on {device}: {reason}")]
    Unsupported {
        /// The op's name.
        op: &'static str,
        /// The device kind.
        device: &'static str,
        /// Why, and what to do.
        reason: String,
    },
    /// The graph failed verification.
    #[error(transparent)]
    Compile(#[from] rustytorch_compiler::CompileError),
}

/// The codegen crate's result.
pub type Result<T, E = CodegenError> = std::result::Result<T, E>;

/// A dense value id in a [`Plan`].
pub type ValueId = usize;

/// Where a value comes from.
#[derive(Clone, Debug)]
pub enum Source {
    /// The plan's `i`-th input.
    Input(usize),
    /// The `i`-th parameter/state tensor.
    Param(usize),
    /// A tensor known at lowering time (constants and evaluated generator leaves).
    Const(Arc<HostTensor>),
    /// Computed by step `i`.
    Step(usize),
}

/// One kernel launch: `op` over `inputs` into `output`.
#[derive(Clone, Debug)]
pub struct Step {
    /// The kernel's op (a library op, a fused kernel, or a reference op).
    pub op: Op,
    /// Operand values.
    pub inputs: Vec<ValueId>,
    /// Result value.
    pub output: ValueId,
    /// Values whose last use is this step (free them after it).
    pub frees: Vec<ValueId>,
    /// The other members of this step's sibling group when it is the group's first step
    /// ([`MemoryPlan::groups`]: values a backend may compute here, together with `output`), in
    /// the group's order; their bytes are live from this step on. Empty for most steps.
    pub with: Vec<ValueId>,
    /// The group's first step when this step's result is in another step's `with`.
    pub sibling_of: Option<usize>,
    /// For the first step of a group of attention gradients: the attention forward's value
    /// whose slot also holds the softmax statistics ([`MemoryPlan::saved`]), which a backend's
    /// forward may write and this step read.
    pub saved: Option<ValueId>,
}

/// Where a value's bytes live on a device with an arena (from the compiler's memory plan).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    /// A buffer the caller provides (inputs, parameters, constants and generator leaves).
    Provided,
    /// `[offset, offset + size)` of the arena.
    Arena {
        /// Byte offset (a multiple of the plan's alignment).
        offset: usize,
        /// Bytes reserved.
        size: usize,
    },
    /// The same bytes as another value (a reshape of it): no copy is made.
    Alias(ValueId),
}

/// A lowered program.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Type of every value.
    pub types: Vec<TensorType>,
    /// Origin of every value.
    pub sources: Vec<Source>,
    /// Where every value lives (arena offsets from the compiler's memory plan).
    pub storage: Vec<Storage>,
    /// Bytes of the arena that holds every computed value.
    pub arena_bytes: usize,
    /// Types of the parameter/state tensors, by parameter index.
    pub param_types: Vec<TensorType>,
    /// The steps, in execution order.
    pub steps: Vec<Step>,
    /// Named inputs: (name, type), by input index.
    pub inputs: Vec<(String, TensorType)>,
    /// Named outputs: (name, value).
    pub outputs: Vec<(String, ValueId)>,
    /// State updates: (param index, value).
    pub updates: Vec<(usize, ValueId)>,
    /// Guards: (name, bool scalar value).
    pub guards: Vec<(String, ValueId)>,
}

impl Plan {
    /// Number of kernel launches.
    pub fn kernel_count(&self) -> usize {
        self.steps.len()
    }
}

/// Lowers a verified graph into a plan (the CPU and every backend share this form), placing every
/// computed value where the compiler's memory plan of the same graph put it.
pub fn lower(graph: &Graph, memory: &MemoryPlan) -> Result<Plan> {
    let _span = tracing::debug_span!("lower", nodes = graph.len()).entered();
    let order = memory.schedule.clone();
    let mut ids: HashMap<NodeId, ValueId> = HashMap::new();
    let mut plan = Plan {
        types: vec![],
        sources: vec![],
        storage: vec![],
        arena_bytes: memory.arena_bytes,
        param_types: graph.params.iter().map(|p| p.ty.clone()).collect(),
        steps: vec![],
        inputs: graph
            .inputs
            .iter()
            .map(|i| (i.name.clone(), i.ty.clone()))
            .collect(),
        outputs: vec![],
        updates: vec![],
        guards: vec![],
    };
    for n in order {
        let node = graph.node(n)?;
        let src = match &node.op {
            Op::Input { index, .. } => Source::Input(*index as usize),
            Op::Param { index, .. } => Source::Param(*index as usize),
            Op::Constant { index, .. } => Source::Const(Arc::new(
                graph
                    .constants
                    .get(*index as usize)
                    .cloned()
                    .ok_or_else(|| CodegenError::Invalid(format!("missing constant #{index}")))?,
            )),
            Op::Full { .. } | Op::Iota { .. } | Op::RandUniform { .. } | Op::RandNormal { .. } => {
                Source::Const(Arc::new(eval_cpu(&node.op, &[])?))
            }
            _ => {
                let inputs = node.inputs.iter().map(|i| ids[i]).collect();
                plan.steps.push(Step {
                    op: node.op.clone(),
                    inputs,
                    output: plan.types.len(),
                    frees: vec![],
                    with: vec![],
                    sibling_of: None,
                    saved: None,
                });
                Source::Step(plan.steps.len() - 1)
            }
        };
        let storage = match (&src, memory.aliases.get(&n), memory.slot(n)) {
            (Source::Step(_), Some(of), _) => Storage::Alias(*ids.get(of).ok_or_else(|| {
                CodegenError::Invalid(format!("memory plan: {n:?} aliases an unscheduled value"))
            })?),
            (Source::Step(_), None, Some(slot)) => Storage::Arena {
                offset: slot.offset,
                size: slot.size,
            },
            (Source::Step(_), None, None) => {
                return Err(CodegenError::Invalid(format!(
                    "memory plan: computed value {n:?} ({}) has no slot",
                    node.op.name()
                )))
            }
            _ => Storage::Provided,
        };
        ids.insert(n, plan.types.len());
        plan.types.push(node.ty.clone());
        plan.sources.push(src);
        plan.storage.push(storage);
    }
    for (first, members) in &memory.groups {
        let Source::Step(s0) = plan.sources[ids[first]] else {
            return Err(CodegenError::Invalid(format!(
                "memory plan: group of {first:?} does not start at a step"
            )));
        };
        for m in &members[1..] {
            let v = ids[m];
            let Source::Step(s) = plan.sources[v] else {
                return Err(CodegenError::Invalid(format!(
                    "memory plan: group member {m:?} is not a step"
                )));
            };
            plan.steps[s0].with.push(v);
            plan.steps[s].sibling_of = Some(s0);
        }
    }
    for (grads, fwd) in &memory.saved {
        let (Source::Step(s0), Source::Step(_)) =
            (&plan.sources[ids[grads]], &plan.sources[ids[fwd]])
        else {
            return Err(CodegenError::Invalid(format!(
                "memory plan: saved statistics of {fwd:?} for {grads:?} are not steps"
            )));
        };
        plan.steps[*s0].saved = Some(ids[fwd]);
    }
    plan.outputs = graph
        .outputs
        .iter()
        .map(|(name, n)| (name.clone(), ids[n]))
        .collect();
    plan.updates = graph
        .updates
        .iter()
        .map(|(p, n)| (*p as usize, ids[n]))
        .collect();
    plan.guards = graph
        .guards
        .iter()
        .map(|(name, n)| (name.clone(), ids[n]))
        .collect();

    // Last uses: a computed value is freed after its last reader unless a root keeps it.
    let mut keep = vec![false; plan.types.len()];
    for &v in plan
        .outputs
        .iter()
        .map(|(_, v)| v)
        .chain(plan.updates.iter().map(|(_, v)| v))
        .chain(plan.guards.iter().map(|(_, v)| v))
    {
        keep[v] = true;
    }
    let mut last: HashMap<ValueId, usize> = HashMap::new();
    for (s, step) in plan.steps.iter().enumerate() {
        for &v in &step.inputs {
            last.insert(v, s);
        }
    }
    for (v, s) in last {
        if !keep[v] && matches!(plan.sources[v], Source::Step(_)) {
            plan.steps[s].frees.push(v);
        }
    }
    for s in &mut plan.steps {
        s.frees.sort_unstable();
    }
    Ok(plan)
}
