//! Scheduling and static memory planning: every intermediate value gets an offset in one arena.
//!
//! - **Schedule**: [`Graph::live_order`], a topological order of the nodes the roots need
//!   (depth-first, so a value tends to be consumed soon after it is made).
//! - **Provided values**: graph inputs, parameters and constants, and the generator leaves
//!   (`Full`, `Iota`, `RandUniform`, `RandNormal`, which codegen evaluates once at lowering time
//!   into constants), are not in the arena: their buffers are provided to the run.
//! - **Aliases**: a `Reshape`, and an `Expand` that only inserts size-1 dims (as many elements
//!   out as in), reads its operand's bytes as they are: it gets no slot and is recorded in
//!   [`MemoryPlan::aliases`] as aliasing its direct operand (itself possibly an alias, or a
//!   provided value). Following aliases down ends at the value's *storage root*: a value with a
//!   slot, or a provided one.
//! - **Lifetimes**: a value is defined at its own step and lives until the step of its last user;
//!   outputs, updates and guards live past the final step (the caller reads them). An arena
//!   storage root and the values aliasing it (transitively) form a group whose bytes live until
//!   the last use of any member, and past the final step when any member is an output, update or
//!   guard: that is the storage root's [`Slot::last`].
//! - **Placement**: in schedule order, each value takes the smallest free block that fits
//!   (best fit; sizes are [`TensorType::size_bytes`] rounded up to [`ALIGN`]), or grows the
//!   arena; after the step, the groups whose lifetime ends there are freed and neighboring free
//!   blocks coalesce. A value is placed before its dying inputs are freed, so a kernel never
//!   writes over what it reads, except:
//! - **Sibling groups**: ops that a backend may compute in one step (the gradients of one
//!   attention with respect to q, k and v: `attention_grad` ops over the same operands that
//!   differ only in `wrt`) are scheduled next to each other at the first one's place (their
//!   operands are all computed by then) and every member's slot is placed at that first step, so
//!   the first step may write all of them ([`MemoryPlan::groups`]). Backends that compute each
//!   member on its own still may: the slots are merely live a step or two earlier.
//!   A second kind of group is a **bias-gradient pair** ([`bias_grad_pair`]): a GEMM and the
//!   `reduce_sum` over every axis but the last of the rows it writes (`matmul_act_grad`, whose
//!   result is the gradient at a biased pre-activation) or of its right operand (a weight
//!   gradient `matmul[trans_a](x, dy)` beside the bias gradient `Σ_rows dy`). The sum is moved
//!   up to run right after the GEMM (its one operand is computed by then), so that a backend may
//!   take it from the GEMM's epilogue (cuBLASLt's `DGELU_BGRAD` and `BGRADA`).
//!   A third kind is a **GELU pair** ([`gelu_aux_pair`]): a biased `matmul_epilogue` whose
//!   result (the pre-activation) is kept, and the tanh GELU of it. The GELU is moved up to run
//!   right after the GEMM, so that a backend may write both from one call (cuBLASLt's
//!   `GELU_AUX_BIAS`: the GELU as D, the pre-activation as the aux output).
//! - **Saved attention statistics**: an `attention` forward whose three gradients form a sibling
//!   group over the same q, k and v (no mask operand; [`saved_forwards`]) keeps its result live
//!   until that group's step, and its slot holds, after the result (at [`stats_offset`]), room
//!   for the softmax statistics (f32, one per query row and head), so that a backend's forward may
//!   write them and its backward read them instead of recomputing the forward
//!   ([`MemoryPlan::saved`]).
//! - **In place**: an elementwise op (`Unary`, `Binary`, `Where`, `Cast`, `Fused`) may write its
//!   result over the bytes of an operand (or of the storage root the operand aliases) whose
//!   whole group dies at this step, that has exactly as many elements and the same element width
//!   (so element `i` of the output overwrites element `i` of the operand, which the kernel read
//!   first), and none of whose members is an output, update or guard. The result records the
//!   storage root in [`Slot::inplace_of`].
//!
//! [`TensorType::size_bytes`]: rustytorch_ops::TensorType::size_bytes

use crate::graph::{Graph, Node, NodeId};
use crate::{CompileError, Result};
use rustytorch_ops::{Activation, Op, ReduceKind, UnaryOp};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

/// Alignment of every arena offset and size, in bytes.
pub const ALIGN: usize = 256;

fn align_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// Where one value lives and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Byte offset in the arena (a multiple of [`ALIGN`]).
    pub offset: usize,
    /// Bytes reserved (the value's size rounded up to [`ALIGN`]).
    pub size: usize,
    /// The step that defines the value.
    pub first: usize,
    /// The last step that reads it; `schedule.len()` (past the final step) for outputs, updates
    /// and guards, which the caller reads after the run.
    pub last: usize,
    /// The operand whose bytes this value overwrites in place, if any.
    pub inplace_of: Option<NodeId>,
}

impl Slot {
    fn lifetimes_overlap(&self, o: &Slot) -> bool {
        self.first <= o.last && o.first <= self.last
    }
    fn bytes_overlap(&self, o: &Slot) -> bool {
        self.size > 0
            && o.size > 0
            && self.offset < o.offset + o.size
            && o.offset < self.offset + self.size
    }
}

/// A schedule and the arena placement of every intermediate value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// The nodes in execution order (leaves included).
    pub schedule: Vec<NodeId>,
    /// The arena slot of each computed value (not of provided values, nor of aliases).
    pub slots: BTreeMap<NodeId, Slot>,
    /// Values that share another value's bytes instead of a slot of their own (reshapes, and
    /// expands that only insert size-1 dims): value → the operand it aliases (itself an alias, a
    /// value in the arena or a provided buffer).
    pub aliases: BTreeMap<NodeId, NodeId>,
    /// The arena's size: the peak of the placement.
    pub arena_bytes: usize,
    /// The sum of every computed value's aligned size, aliases included (what one buffer per
    /// value would take).
    pub naive_bytes: usize,
    /// Saved attention statistics (see the module docs): the first step's node of a group of
    /// attention gradients → the `attention` forward whose slot holds its result and, at
    /// [`stats_offset`], the statistics.
    pub saved: BTreeMap<NodeId, NodeId>,
    /// Sibling groups (see the module docs): the member scheduled first → every member in the
    /// group's order (for attention gradients, by `wrt`; for a bias-gradient pair, the GEMM then
    /// the sum), itself included. Each member's slot is
    /// defined at the first member's step.
    pub groups: BTreeMap<NodeId, Vec<NodeId>>,
}

/// Free blocks of the arena below its current top, sorted by offset and coalesced.
#[derive(Default)]
struct FreeList {
    blocks: Vec<(usize, usize)>,
    top: usize,
    peak: usize,
}

impl FreeList {
    /// Best fit: the smallest free block that holds `size` (lowest offset on ties), else the top.
    fn alloc(&mut self, size: usize) -> usize {
        if size == 0 {
            return 0;
        }
        let best = self
            .blocks
            .iter()
            .enumerate()
            .filter(|(_, &(_, s))| s >= size)
            .min_by_key(|(_, &(o, s))| (s, o))
            .map(|(i, _)| i);
        if let Some(i) = best {
            let (o, s) = self.blocks[i];
            if s == size {
                self.blocks.remove(i);
            } else {
                self.blocks[i] = (o + size, s - size);
            }
            return o;
        }
        let o = self.top;
        self.top += size;
        self.peak = self.peak.max(self.top);
        o
    }

    /// Returns a block; neighbors coalesce and a free tail lowers the top.
    fn free(&mut self, offset: usize, size: usize) {
        if size == 0 {
            return;
        }
        let i = self.blocks.partition_point(|&(o, _)| o < offset);
        self.blocks.insert(i, (offset, size));
        if i + 1 < self.blocks.len() && offset + size == self.blocks[i + 1].0 {
            self.blocks[i].1 += self.blocks[i + 1].1;
            self.blocks.remove(i + 1);
        }
        let mut i = i;
        if i > 0 && self.blocks[i - 1].0 + self.blocks[i - 1].1 == offset {
            self.blocks[i - 1].1 += self.blocks[i].1;
            self.blocks.remove(i);
            i -= 1;
        }
        if self.blocks[i].0 + self.blocks[i].1 == self.top {
            self.top = self.blocks[i].0;
            self.blocks.remove(i);
        }
    }
}

/// Whether this leaf's buffer is provided to the run rather than placed in the arena: inputs,
/// parameters, constants and the generator leaves (evaluated into constants when lowering).
fn provided(op: &Op) -> bool {
    op.is_leaf()
}

/// Whether `node` reads its operand's bytes as they are (a reshape, or an expand that only
/// inserts size-1 dims) and so aliases it instead of taking a slot.
fn is_alias(graph: &Graph, node: &Node) -> bool {
    match &node.op {
        Op::Reshape { .. } => node.inputs.len() == 1,
        Op::Expand { .. } => {
            node.inputs.len() == 1
                && graph.ty(node.inputs[0]).shape.numel() == node.ty.shape.numel()
        }
        _ => false,
    }
}

/// The key under which ops may be computed together, and the op's place in its group: the
/// gradients of one attention (`attention_grad` differing only in `wrt`).
fn sibling_key(op: &Op) -> Option<(Op, u8)> {
    match op {
        Op::AttentionGrad { wrt, .. } => {
            let mut key = op.clone();
            if let Op::AttentionGrad { wrt: w, .. } = &mut key {
                *w = 0;
            }
            Some((key, *wrt))
        }
        _ => None,
    }
}

/// Follows reshape aliases (see [`is_alias`]) down from `id` to the value whose bytes it reads.
pub(crate) fn through_reshapes(graph: &Graph, mut id: NodeId) -> Result<NodeId> {
    loop {
        let node = graph.node(id)?;
        match &node.op {
            Op::Reshape { .. } if node.inputs.len() == 1 => id = node.inputs[0],
            _ => return Ok(id),
        }
    }
}

/// Whether `gemm` and `sum` form a bias-gradient pair (see the module docs): `sum` is a
/// `reduce_sum` over every axis but the last, in its operand's dtype, of either
/// - `gemm` itself, a `matmul_act_grad` (the gradient at a biased pre-activation), or
/// - the right operand of `gemm`, a 2-D weight gradient `matmul[trans_a](x, dy)` whose `dy` is
///   the summed tensor's rows (through reshapes).
pub fn bias_grad_pair(graph: &Graph, gemm: NodeId, sum: NodeId) -> Result<bool> {
    let (g, r) = (graph.node(gemm)?, graph.node(sum)?);
    let Op::Reduce {
        kind: ReduceKind::Sum,
        axes,
        ..
    } = &r.op
    else {
        return Ok(false);
    };
    let Some(&x) = r.inputs.first() else {
        return Ok(false);
    };
    let xt = graph.ty(x);
    let rank = xt.shape.rank();
    if rank < 2 || *axes != (0..rank - 1).collect::<Vec<_>>() || r.ty.dtype != xt.dtype {
        return Ok(false);
    }
    let n = xt.shape.dims()[rank - 1];
    Ok(match &g.op {
        Op::MatmulActGrad { .. } => x == gemm,
        Op::Matmul {
            trans_a: true,
            trans_b: false,
        } if g.inputs.len() == 2 && g.ty.shape.rank() == 2 => {
            let bt = graph.ty(g.inputs[1]);
            bt.shape.rank() == 2
                && bt.shape.dims()[1] == n
                && bt.dtype == xt.dtype
                && through_reshapes(graph, g.inputs[1])? == through_reshapes(graph, x)?
        }
        _ => false,
    })
}

/// The bias-gradient pairs of `schedule` whose sum runs after its GEMM, as (GEMM, sum); a GEMM
/// or a sum is in at most one pair (a `matmul_act_grad` first takes the sum of its own result).
fn bias_grad_pairs(graph: &Graph, schedule: &[NodeId]) -> Result<Vec<(NodeId, NodeId)>> {
    let pos: HashMap<NodeId, usize> = schedule.iter().enumerate().map(|(t, &n)| (n, t)).collect();
    let mut pairs = vec![];
    let mut taken: HashSet<NodeId> = HashSet::new();
    for pass in 0..2 {
        for &r in schedule {
            let node = graph.node(r)?;
            if taken.contains(&r) || !matches!(node.op, Op::Reduce { .. }) {
                continue;
            }
            let Some(&x) = node.inputs.first() else {
                continue;
            };
            let candidates = if pass == 0 {
                vec![x]
            } else {
                // Weight gradients reading x's rows, directly or through reshapes.
                let mut readers = vec![];
                let mut frontier = vec![x];
                while let Some(v) = frontier.pop() {
                    for u in graph.users(v) {
                        match &graph.node(u)?.op {
                            Op::Reshape { .. } => frontier.push(u),
                            Op::Matmul { .. } => readers.push(u),
                            _ => {}
                        }
                    }
                }
                readers
            };
            for g in candidates {
                let is_gemm = matches!(
                    graph.node(g)?.op,
                    Op::MatmulActGrad { .. } | Op::Matmul { .. }
                );
                if !is_gemm || taken.contains(&g) || (pass == 0) != (g == x) {
                    continue;
                }
                let (Some(&tg), Some(&tr)) = (pos.get(&g), pos.get(&r)) else {
                    continue;
                };
                if tg < tr && bias_grad_pair(graph, g, r)? {
                    taken.insert(g);
                    taken.insert(r);
                    pairs.push((g, r));
                    break;
                }
            }
        }
    }
    Ok(pairs)
}

/// Whether `gemm` and `act` form a GELU pair (see the module docs): `act` is the tanh GELU of
/// `gemm`'s result, of its type, and `gemm` a biased `matmul_epilogue` with no activation and no
/// accumulated operand (the pre-activation a training graph keeps for the GELU's gradient).
pub fn gelu_aux_pair(graph: &Graph, gemm: NodeId, act: NodeId) -> Result<bool> {
    let (g, u) = (graph.node(gemm)?, graph.node(act)?);
    Ok(matches!(u.op, Op::Unary(UnaryOp::GeluTanh))
        && u.inputs == [gemm]
        && u.ty == g.ty
        && matches!(
            g.op,
            Op::MatmulEpilogue {
                bias: true,
                act: Activation::None,
                accumulate: false,
                ..
            }
        ))
}

/// The GELU pairs of `schedule`, as (GEMM, GELU).
fn gelu_aux_pairs(graph: &Graph, schedule: &[NodeId]) -> Result<Vec<(NodeId, NodeId)>> {
    let mut pairs = vec![];
    for &u in schedule {
        let node = graph.node(u)?;
        if let (Op::Unary(UnaryOp::GeluTanh), [g]) = (&node.op, node.inputs.as_slice()) {
            if gelu_aux_pair(graph, *g, u)? {
                pairs.push((*g, u));
            }
        }
    }
    Ok(pairs)
}

/// Reorders `schedule` so that the members of each sibling group (same key, same operands) run
/// back to back, in group order, where the first of them was; returns the groups of two or
/// more, keyed by the member now scheduled first.
fn group_siblings(
    graph: &Graph,
    schedule: Vec<NodeId>,
) -> Result<(Vec<NodeId>, BTreeMap<NodeId, Vec<NodeId>>)> {
    let mut by_key: Vec<((Op, Vec<NodeId>), Vec<(u8, NodeId)>)> = vec![];
    for &n in &schedule {
        let node = graph.node(n)?;
        if let Some((key, place)) = sibling_key(&node.op) {
            let k = (key, node.inputs.clone());
            match by_key.iter_mut().find(|(kk, _)| *kk == k) {
                Some((_, members)) if !members.iter().any(|&(p, _)| p == place) => {
                    members.push((place, n))
                }
                // A duplicate of a member (not merged by the optimizer) stays on its own.
                Some(_) => {}
                None => by_key.push((k, vec![(place, n)])),
            }
        }
    }
    let mut groups = BTreeMap::new();
    let mut member_of: HashMap<NodeId, NodeId> = HashMap::new();
    // A bias-gradient pair runs where its GEMM was: the sum's one operand is computed by then.
    // So does a GELU pair: the GELU's one operand is the GEMM's result.
    let pairs = bias_grad_pairs(graph, &schedule)?
        .into_iter()
        .chain(gelu_aux_pairs(graph, &schedule)?);
    for (g, r) in pairs {
        if member_of.contains_key(&g) || member_of.contains_key(&r) {
            continue;
        }
        member_of.insert(g, g);
        member_of.insert(r, g);
        groups.insert(g, vec![g, r]);
    }
    for (_, mut members) in by_key {
        if members.len() < 2 {
            continue;
        }
        let first = members[0].1;
        members.sort_by_key(|&(p, _)| p);
        let ids: Vec<NodeId> = members.iter().map(|&(_, n)| n).collect();
        for &m in &ids {
            member_of.insert(m, first);
        }
        groups.insert(first, ids);
    }
    if groups.is_empty() {
        return Ok((schedule, groups));
    }
    let mut order = Vec::with_capacity(schedule.len());
    for n in schedule {
        match member_of.get(&n) {
            Some(&first) if first == n => order.extend(groups[&first].iter().copied()),
            Some(_) => {}
            None => order.push(n),
        }
    }
    // The member now scheduled first (the lowest place) keys its group.
    let groups = groups.into_values().map(|ids| (ids[0], ids)).collect();
    Ok((order, groups))
}

/// Bytes of the softmax statistics an `attention` result of type `out` saves: one f32 per query
/// row and head (`out` is `[B, H, Sq, Dv]` or `[B, Sq, H, Dv]`, so its element count over `Dv`).
pub fn stats_bytes(out: &rustytorch_ops::TensorType) -> usize {
    let dims = out.shape.dims();
    match dims.last() {
        Some(&dv) if dv > 0 => out.shape.numel() / dv * 4,
        _ => 0,
    }
}

/// Where the statistics start in a saving forward's slot: past its result, aligned.
pub fn stats_offset(out: &rustytorch_ops::TensorType) -> usize {
    align_up(out.size_bytes())
}

/// The attention forwards whose statistics the group of their gradients reads (see the module
/// docs): group's first node → forward, for each group of all three gradients (`wrt` 0, 1, 2),
/// or packed gradient, without a mask operand whose q, k, v and attributes are a forward's
/// scheduled before it.
pub fn saved_forwards(
    graph: &Graph,
    schedule: &[NodeId],
    groups: &BTreeMap<NodeId, Vec<NodeId>>,
) -> Result<BTreeMap<NodeId, NodeId>> {
    let mut forwards: HashMap<(Op, Vec<NodeId>), NodeId> = HashMap::new();
    let mut saved = BTreeMap::new();
    for &n in schedule {
        let node = graph.node(n)?;
        match &node.op {
            Op::Attention { .. } if node.inputs.len() == 3 => {
                forwards
                    .entry((node.op.clone(), node.inputs.clone()))
                    .or_insert(n);
            }
            // A packed attention's one gradient reads its forward's statistics alone.
            Op::AttentionGrad {
                wrt: rustytorch_ops::ATTN_WRT_PACKED,
                ..
            } if node.inputs.len() == 4 => {
                let fwd = forwards.iter().find_map(|((op, ins), &f)| {
                    (op.attention_grad(rustytorch_ops::ATTN_WRT_PACKED).as_ref() == Some(&node.op)
                        && ins[..] == node.inputs[..3])
                        .then_some(f)
                });
                if let Some(f) = fwd {
                    saved.insert(n, f);
                }
            }
            Op::AttentionGrad { wrt: 0, .. } if node.inputs.len() == 4 => {
                let Some(members) = groups.get(&n) else {
                    continue;
                };
                let wrts: Vec<Option<u8>> = members
                    .iter()
                    .map(|&m| match graph.node(m).map(|x| &x.op) {
                        Ok(Op::AttentionGrad { wrt, .. }) => Some(*wrt),
                        _ => None,
                    })
                    .collect();
                if wrts != [Some(0), Some(1), Some(2)] {
                    continue;
                }
                let fwd = forwards.iter().find_map(|((op, ins), &f)| {
                    (op.attention_grad(0).as_ref() == Some(&node.op) && ins[..] == node.inputs[..3])
                        .then_some(f)
                });
                if let Some(f) = fwd {
                    saved.insert(n, f);
                }
            }
            _ => {}
        }
    }
    Ok(saved)
}

/// The optimizer's tail of `schedule` moved after everything else, in levels (see the module
/// docs): the elementwise kernels (and row kernels, and the reshapes between them) whose results
/// only state updates and guards read, directly or through other tail nodes. A kernel's level is
/// one more than its highest tail kernel operand's, looking through reshapes; the tail runs level
/// by level, each level's reshapes first, then its kernels grouped by op in schedule order; a
/// narrowing cast of a tail kernel's result follows that kernel directly (so that a backend may
/// store both from one kernel while the bytes the cast's slot takes are still its own). Members
/// of sibling groups (`keep`) stay where they are.
fn defer_tail(graph: &Graph, schedule: Vec<NodeId>, keep: &HashSet<NodeId>) -> Result<Vec<NodeId>> {
    let outputs: HashSet<NodeId> = graph.output_nodes().into_iter().collect();
    let sinks: HashSet<NodeId> = graph
        .updates
        .iter()
        .map(|(_, n)| *n)
        .chain(graph.guards.iter().map(|(_, n)| *n))
        .collect();
    let scheduled: HashSet<NodeId> = schedule.iter().copied().collect();
    let mut tail: HashSet<NodeId> = HashSet::new();
    // Users come after their operands in the schedule: walking it backwards sees them first.
    for &n in schedule.iter().rev() {
        let node = graph.node(n)?;
        let cheap = node.op.is_elementwise()
            || matches!(node.op, Op::Fused(_) | Op::FusedRow(_))
            || is_alias(graph, node);
        if provided(&node.op) || !cheap || keep.contains(&n) || outputs.contains(&n) {
            continue;
        }
        let users: Vec<NodeId> = graph
            .users(n)
            .into_iter()
            .filter(|u| scheduled.contains(u))
            .collect();
        if (sinks.contains(&n) || !users.is_empty()) && users.iter().all(|u| tail.contains(u)) {
            tail.insert(n);
        }
    }
    if tail.is_empty() {
        return Ok(schedule);
    }
    // The level from which each tail value can be read: a kernel's result from the level after
    // its own, a reshape's from its operand's.
    let mut avail: HashMap<NodeId, usize> = HashMap::new();
    let mut order: Vec<NodeId> = Vec::with_capacity(schedule.len());
    // Sort keys: (level, kernel, op, place in the schedule, follower), where a narrowing cast
    // of a tail kernel's result takes its producer's key and follows it.
    type Key = (usize, bool, &'static str, usize, bool);
    let mut key: HashMap<NodeId, Key> = HashMap::new();
    let mut deferred: Vec<(Key, NodeId)> = vec![];
    for (t, &n) in schedule.iter().enumerate() {
        if !tail.contains(&n) {
            order.push(n);
            continue;
        }
        let node = graph.node(n)?;
        let kernel = !is_alias(graph, node);
        let level = node
            .inputs
            .iter()
            .filter_map(|i| avail.get(i).copied())
            .max()
            .unwrap_or(0);
        let producer = match (&node.op, node.inputs.as_slice()) {
            (Op::Cast { to }, &[x]) if to.size_bytes() < graph.ty(x).dtype.size_bytes() => {
                key.get(&x).filter(|k| k.1 && !k.4).copied()
            }
            _ => None,
        };
        let k = match producer {
            Some((l, _, op, at, _)) => {
                avail.insert(n, l + 1);
                (l, true, op, at, true)
            }
            None => {
                avail.insert(n, level + usize::from(kernel));
                (
                    level,
                    kernel,
                    if kernel { node.op.name() } else { "" },
                    t,
                    false,
                )
            }
        };
        key.insert(n, k);
        deferred.push((k, n));
    }
    // Within a level, the reshapes first (their operands are of lower levels), then the kernels
    // grouped by op, each in schedule order (and a folded cast right after its producer).
    deferred.sort();
    order.extend(deferred.into_iter().map(|d| d.1));
    Ok(order)
}

/// Options of [`plan_with`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanOptions {
    /// Move the optimizer's tail after everything else, in levels ([`defer_tail`]), so that a
    /// backend can launch the many small per-parameter kernels of one level as one. Every
    /// gradient then stays live until the tail.
    pub defer_tail: bool,
}

/// Schedules the live nodes of `graph` and places every intermediate value in one arena (see
/// the module docs).
pub fn plan(graph: &Graph) -> Result<MemoryPlan> {
    plan_with(graph, PlanOptions::default())
}

/// [`plan`] with options.
pub fn plan_with(graph: &Graph, opts: PlanOptions) -> Result<MemoryPlan> {
    let _span = tracing::debug_span!("plan").entered();
    let (mut schedule, by_first) = group_siblings(graph, graph.live_order())?;
    if opts.defer_tail {
        let keep: HashSet<NodeId> = by_first.values().flatten().copied().collect();
        schedule = defer_tail(graph, schedule, &keep)?;
    }
    // Roots are read after the final step (by the caller).
    let end = schedule.len();
    let roots: HashSet<NodeId> = graph.roots().into_iter().collect();
    let mut last: HashMap<NodeId, usize> = HashMap::new();
    for (t, &n) in schedule.iter().enumerate() {
        last.entry(n).or_insert(t);
        for &i in &graph.node(n)?.inputs {
            let l = last.entry(i).or_insert(t);
            *l = (*l).max(t);
        }
    }
    for r in &roots {
        last.insert(*r, end);
    }
    // A saving forward's result lives until the step of its gradients.
    let saved = saved_forwards(graph, &schedule, &by_first)?;
    let saving: HashSet<NodeId> = saved.values().copied().collect();
    for (t, &n) in schedule.iter().enumerate() {
        if let Some(f) = saved.get(&n) {
            let l = last.entry(*f).or_insert(t);
            *l = (*l).max(t);
        }
    }

    // Aliases, each value's storage root, and each group's lifetime (by storage root).
    let mut aliases: BTreeMap<NodeId, NodeId> = BTreeMap::new();
    let mut storage: HashMap<NodeId, NodeId> = HashMap::new();
    for &n in &schedule {
        let node = graph.node(n)?;
        let root = if !provided(&node.op) && is_alias(graph, node) {
            let of = node.inputs[0];
            aliases.insert(n, of);
            storage[&of]
        } else {
            n
        };
        storage.insert(n, root);
    }
    let mut group_last: HashMap<NodeId, usize> = HashMap::new();
    for &n in &schedule {
        let l = group_last.entry(storage[&n]).or_insert(0);
        *l = (*l).max(last[&n]);
    }
    // Groups with a member that the caller reads after the run.
    let pinned: HashSet<NodeId> = roots.iter().map(|r| storage[r]).collect();

    let mut free = FreeList::default();
    let mut slots: BTreeMap<NodeId, Slot> = BTreeMap::new();
    let mut naive = 0;
    for (t, &n) in schedule.iter().enumerate() {
        let node = graph.node(n)?;
        if provided(&node.op) {
            continue;
        }
        let size = if saving.contains(&n) {
            stats_offset(&node.ty) + align_up(stats_bytes(&node.ty))
        } else {
            align_up(node.ty.size_bytes())
        };
        naive += size;
        // Storage roots in the arena whose whole group dies at this step.
        let mut dying: Vec<NodeId> = node
            .inputs
            .iter()
            .map(|i| storage[i])
            .filter(|s| slots.contains_key(s) && group_last[s] == t)
            .collect();
        dying.sort();
        dying.dedup();
        let mut donor = None;
        if slots.contains_key(&n) {
            // A sibling, placed at its group's first step.
        } else if !aliases.contains_key(&n) {
            if node.op.is_elementwise() && size > 0 {
                // An alias has its storage root's element count and dtype.
                donor = dying.iter().copied().find(|&d| {
                    let dt = graph.ty(d);
                    !pinned.contains(&d)
                        && dt.shape.numel() == node.ty.shape.numel()
                        && dt.dtype.size_bytes() == node.ty.dtype.size_bytes()
                });
            }
            let offset = match donor {
                Some(d) => slots[&d].offset,
                None => free.alloc(size),
            };
            slots.insert(
                n,
                Slot {
                    offset,
                    size,
                    first: t,
                    last: group_last[&n].max(t),
                    inplace_of: donor,
                },
            );
            for &m in by_first.get(&n).into_iter().flatten().filter(|&&m| m != n) {
                let size = align_up(graph.ty(m).size_bytes());
                let offset = free.alloc(size);
                slots.insert(
                    m,
                    Slot {
                        offset,
                        size,
                        first: t,
                        last: group_last[&m].max(t),
                        inplace_of: None,
                    },
                );
            }
        }
        for d in dying {
            if Some(d) != donor {
                let s = slots[&d];
                free.free(s.offset, s.size);
            }
        }
        if let Some(s) = slots.get(&n) {
            if s.last <= t && !pinned.contains(&n) {
                free.free(s.offset, s.size);
            }
        }
    }
    let plan = MemoryPlan {
        schedule,
        slots,
        aliases,
        arena_bytes: free.peak,
        naive_bytes: naive,
        saved,
        groups: by_first,
    };
    tracing::debug!("{plan}");
    Ok(plan)
}

impl MemoryPlan {
    /// The slot of a value (None for provided buffers and nodes not scheduled).
    pub fn slot(&self, id: NodeId) -> Option<&Slot> {
        self.slots.get(&id)
    }

    /// Number of values written in place over an operand.
    pub fn inplace_count(&self) -> usize {
        self.slots
            .values()
            .filter(|s| s.inplace_of.is_some())
            .count()
    }

    /// The value whose bytes `id` reads: `id` itself unless it is an alias, else the end of its
    /// alias chain (a value with a slot, or a provided one).
    pub fn storage_root(&self, id: NodeId) -> NodeId {
        let mut r = id;
        // A valid plan's chains are acyclic; the bound only keeps a forged one from looping.
        for _ in 0..=self.aliases.len() {
            match self.aliases.get(&r) {
                Some(&of) => r = of,
                None => break,
            }
        }
        r
    }

    /// Checks the plan: aligned slots inside the arena, in-place pairs that share exactly one
    /// step and the same bytes, no two other values whose lifetimes overlap sharing a byte, and
    /// aliases that have no slot, alias a value scheduled before them and are defined while their
    /// storage root's bytes are live. [`MemoryPlan::check_uses`] also checks the lifetimes
    /// against the graph's uses.
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(CompileError::Invalid(format!("memory plan: {m}")));
        let step: HashMap<NodeId, usize> = self
            .schedule
            .iter()
            .enumerate()
            .map(|(t, &n)| (n, t))
            .collect();
        for (&a, &of) in &self.aliases {
            if self.slots.contains_key(&a) {
                return bad(format!("alias %{} has a slot of its own", a.index()));
            }
            let (Some(&ta), Some(&tof)) = (step.get(&a), step.get(&of)) else {
                return bad(format!(
                    "alias %{} of %{} is not scheduled with its operand",
                    a.index(),
                    of.index()
                ));
            };
            if tof >= ta {
                return bad(format!(
                    "alias %{} (step {ta}) is scheduled before %{} (step {tof}), which it aliases",
                    a.index(),
                    of.index()
                ));
            }
            let root = self.storage_root(a);
            if let Some(rs) = self.slots.get(&root) {
                if !(rs.first < ta && ta <= rs.last) {
                    return bad(format!(
                        "alias %{} (step {ta}) outlives its storage %{} (steps {}..={})",
                        a.index(),
                        root.index(),
                        rs.first,
                        rs.last
                    ));
                }
            }
        }
        for (id, s) in &self.slots {
            if s.offset % ALIGN != 0 || s.size % ALIGN != 0 {
                return bad(format!(
                    "%{} at {}+{} is not aligned",
                    id.index(),
                    s.offset,
                    s.size
                ));
            }
            if s.offset + s.size > self.arena_bytes {
                return bad(format!(
                    "%{} at {}+{} lies outside the {}-byte arena",
                    id.index(),
                    s.offset,
                    s.size,
                    self.arena_bytes
                ));
            }
            if s.first > s.last {
                return bad(format!("%{} dies before it is defined", id.index()));
            }
            if let Some(d) = s.inplace_of {
                let Some(ds) = self.slots.get(&d) else {
                    return bad(format!(
                        "%{} is in place of unplanned %{}",
                        id.index(),
                        d.index()
                    ));
                };
                if ds.offset != s.offset || ds.size != s.size || ds.last != s.first {
                    return bad(format!(
                        "%{} is in place of %{} but they do not share bytes at one step",
                        id.index(),
                        d.index()
                    ));
                }
            }
        }
        let all: Vec<(&NodeId, &Slot)> = self.slots.iter().collect();
        for (k, &(a, sa)) in all.iter().enumerate() {
            for &(b, sb) in &all[k + 1..] {
                if !sa.lifetimes_overlap(sb) || !sa.bytes_overlap(sb) {
                    continue;
                }
                let pair = (sa.inplace_of == Some(*b) && sa.first == sb.last)
                    || (sb.inplace_of == Some(*a) && sb.first == sa.last);
                if !pair {
                    return bad(format!(
                        "%{} ({}+{}, steps {}..={}) and %{} ({}+{}, steps {}..={}) overlap",
                        a.index(),
                        sa.offset,
                        sa.size,
                        sa.first,
                        sa.last,
                        b.index(),
                        sb.offset,
                        sb.size,
                        sb.first,
                        sb.last
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks the plan against the graph it was made for: every scheduled computed value has
    /// either a slot or an alias, provided values have neither, and every value's bytes (its
    /// slot, or its storage root's slot for an alias) are live from its definition through every
    /// step that reads it, and past the final step for outputs, updates and guards.
    pub fn check_uses(&self, graph: &Graph) -> Result<()> {
        let bad = |m: String| Err(CompileError::Invalid(format!("memory plan: {m}")));
        let end = self.schedule.len();
        // The step of each sibling's group (its first member's), where its slot begins; the
        // members must be scheduled back to back with identical operands.
        let mut group_step: HashMap<NodeId, usize> = HashMap::new();
        for (first, members) in &self.groups {
            let Some(t0) = self.schedule.iter().position(|n| n == first) else {
                return bad(format!("group of %{} is not scheduled", first.index()));
            };
            let ops = graph.node(*first)?.inputs.clone();
            let pair = members.len() == 2
                && (bias_grad_pair(graph, members[0], members[1])?
                    || gelu_aux_pair(graph, members[0], members[1])?);
            for (k, &m) in members.iter().enumerate() {
                if self.schedule.get(t0 + k) != Some(&m) || !(pair || graph.node(m)?.inputs == ops)
                {
                    return bad(format!(
                        "group of %{}: %{} is not scheduled with it over the same operands",
                        first.index(),
                        m.index()
                    ));
                }
                group_step.insert(m, t0);
            }
        }
        let live = |v: NodeId, t: usize| -> Result<()> {
            let root = self.storage_root(v);
            match self.slots.get(&root) {
                Some(s) if s.first <= t && t <= s.last => Ok(()),
                Some(s) => bad(format!(
                    "%{} is read at step {t} but its storage %{} lives in steps {}..={}",
                    v.index(),
                    root.index(),
                    s.first,
                    s.last
                )),
                None => Ok(()),
            }
        };
        for (t, &n) in self.schedule.iter().enumerate() {
            let node = graph.node(n)?;
            let placed = self.slots.contains_key(&n) || self.aliases.contains_key(&n);
            if placed == provided(&node.op) {
                return bad(format!(
                    "%{} ({}) {}",
                    n.index(),
                    node.op.name(),
                    if placed {
                        "is provided but placed in the arena"
                    } else {
                        "is computed but has neither a slot nor an alias"
                    }
                ));
            }
            if let Some(s) = self.slots.get(&n) {
                if s.first != t && group_step.get(&n) != Some(&s.first) {
                    return bad(format!(
                        "%{} is defined at step {t}, its slot at step {}",
                        n.index(),
                        s.first
                    ));
                }
            }
            live(n, t)?;
            for &i in &node.inputs {
                live(i, t)?;
            }
        }
        for r in graph.roots() {
            live(r, end)?;
        }
        Ok(())
    }
}

/// A one-line summary; the alternate form (`{:#}`) adds one line per value in schedule order.
impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let saved = if self.naive_bytes == 0 {
            0.0
        } else {
            100.0 * (1.0 - self.arena_bytes as f64 / self.naive_bytes as f64)
        };
        write!(
            f,
            "memory plan: {} steps, {} values ({} in place), {} aliases, arena {} bytes, naive {} bytes ({:.0}% saved)",
            self.schedule.len(),
            self.slots.len(),
            self.inplace_count(),
            self.aliases.len(),
            self.arena_bytes,
            self.naive_bytes,
            saved
        )?;
        if f.alternate() {
            for n in &self.schedule {
                if let Some(s) = self.slots.get(n) {
                    write!(
                        f,
                        "\n  %{:<4} @{:>8} +{:<8} steps {}..={}",
                        n.index(),
                        s.offset,
                        s.size,
                        s.first,
                        s.last
                    )?;
                    if let Some(d) = s.inplace_of {
                        write!(f, " (in place of %{})", d.index())?;
                    }
                } else if let Some(of) = self.aliases.get(n) {
                    write!(
                        f,
                        "\n  %{:<4} alias of %{} (bytes of %{})",
                        n.index(),
                        of.index(),
                        self.storage_root(*n).index()
                    )?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::FreeList;

    #[test]
    fn best_fit_takes_the_smallest_block_that_fits() {
        let mut f = FreeList::default();
        let a = f.alloc(1024);
        let b = f.alloc(256);
        let c = f.alloc(512);
        let d = f.alloc(256);
        assert_eq!((a, b, c, d), (0, 1024, 1280, 1792));
        f.free(a, 1024);
        f.free(c, 512);
        // 512 fits both holes: the 512 one is taken, the 1024 one stays whole.
        assert_eq!(f.alloc(512), c);
        assert_eq!(f.alloc(1024), a);
        assert_eq!(f.peak, 2048);
    }

    #[test]
    fn neighbors_coalesce_and_a_free_tail_lowers_the_top() {
        let mut f = FreeList::default();
        let a = f.alloc(256);
        let b = f.alloc(256);
        let c = f.alloc(256);
        let d = f.alloc(256);
        f.free(a, 256);
        f.free(c, 256);
        f.free(b, 256);
        assert_eq!(f.blocks, vec![(0, 768)]);
        // 768 bytes fit in the coalesced hole rather than growing the arena.
        assert_eq!(f.alloc(768), 0);
        f.free(0, 768);
        f.free(d, 256);
        assert!(f.blocks.is_empty());
        assert_eq!((f.top, f.peak), (0, 1024));
        // Zero-size values take no bytes.
        assert_eq!(f.alloc(0), 0);
        assert_eq!(f.top, 0);
    }
}
