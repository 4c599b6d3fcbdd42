//! Fusion: groups producer→consumer elementwise ops into [`Op::Fused`] kernels, then fuses those
//! kernels into the inputs and outputs of norms, softmaxes and reductions ([`Op::FusedRow`]). It
//! runs after autodiff and the e-graph's extraction, before scheduling and memory planning.
//!
//! # The rule
//!
//! The pass is greedy, consumers first (reverse topological order). Each elementwise node
//! (`Unary`, `Binary`, `Where`, `Cast`) that no earlier group took becomes the **root** of a new
//! group, and the group grows backwards over its operands. An operand `p` joins the group when:
//!
//! - `p` is itself `Unary`/`Binary`/`Where`/`Cast` and belongs to no other group;
//! - neither `p` nor its operands are 32/64-bit integers (fused kernels compute in f32 or f64,
//!   which do not hold every such integer exactly; the same rule picks roots);
//! - `p` has exactly the root's output shape (every instruction of a kernel runs over the output
//!   shape; a smaller producer, say a bias computation of shape `[n]` feeding `[m, n]`, would be
//!   recomputed per output element, so it stays a kernel input instead);
//! - **every** user of `p` is already in the group (absorbing a value used elsewhere would
//!   duplicate its work or force it to be materialized anyway);
//! - `p` is not an output, an update value or a guard: those stay materialized.
//!
//! One exception to the last-but-one rule, made before the groups are built: a `Cast` used by
//! several elementwise ops of its own shape (none of them a result) is split into one copy per
//! user ([`split_shared_values`]), so that each user's kernel converts the narrow value as it
//! loads it instead of one more kernel writing the wide copy for all of them to read. A cast is
//! the cheapest instruction there is; recomputing it saves a launch and the wide copy's write
//! and reads (a mixed-precision update's `f32(grad)` read by its finiteness guard and by the
//! update itself). The same holds for a binary op of one full-size operand and a small computed
//! one (`x − mean`, `x̂ · rstd` and `g · w` of a LayerNorm and its backward, which autodiff of
//! the primitives makes): each user reads the full-size operand where it would have read the
//! value, so splitting costs no bytes and saves a kernel, its write, and the activation memory a
//! backward would otherwise keep for it. Last, an elementwise value computed from two full-size
//! tensors (through a cone of elementwise ops, with small operands besides) and used by two or
//! three elementwise ops of its shape is recomputed in each: the users read the two tensors
//! (4 or 6 reads) where the value cost 2 reads, a write and a read per user (5 or 6), and a
//! kernel goes. LayerNorm's backward spelled in primitives has one (`g·w·rstd + (x − mean)·c`,
//! read by the row sum after it and by that sum's user): 3 kernels instead of 4.
//!
//! A group therefore has one result, its root; it never creates a cycle (every path out of an
//! interior member goes through the root). Operands that do not join become kernel inputs, which
//! broadcast to the output shape, with two refinements:
//!
//! - a `Full` operand (any shape that broadcasts to the output, so scalars and "small" fills) is
//!   copied into the program as an immediate: a constant is not work, so this duplicates nothing;
//! - an `Expand` operand is read through: the kernel reads the expand's source and broadcasts it
//!   itself. The expand node disappears when every user of it is a member of some group (or
//!   such an expand) and it is not a root; otherwise it stays for its other users.
//!
//! A group of one elementwise op stays the plain op (wrapping it would gain nothing) unless it
//! reads an expand that disappears.
//!
//! Reductions, matmuls, normalizations and every other op stop the growth of a group: they have
//! their own iteration space (a reduction reads each input element once per output), so an
//! elementwise chain that feeds one is a group of its own, and a chain after it starts another.
//!
//! Existing `Fused` nodes are left as they are (the pass is idempotent).
//!
//! # Row kernels: prologues and epilogues
//!
//! After the groups are built, each norm, softmax or reduction (`LayerNorm`, `RmsNorm`,
//! `Softmax`, `LogSoftmax`, or a float `Reduce` other than any/all) — the *core* — absorbs the
//! fused kernels next to it into one [`Op::FusedRow`]:
//!
//! - a **prologue**: the fused kernel that computes the core's input (its operand 0), when the
//!   core is its only user and it is not an output, update or guard. The row kernel evaluates it
//!   per input element as it loads the row, so `layer_norm(x + y)` reads `x` and `y` once and
//!   never writes the sum;
//! - an **epilogue**: the fused kernel that is the core's only user, when it has the core's
//!   result shape (it runs per output element) and the core is not a root. It maps each result
//!   before the store: `layer_norm(x) · 0.5 + z`, `cast(softmax(x))`, `sqrt(mean(x · x))`.
//!
//! A group of one elementwise op is kept as a fused kernel when it will join a row op this way
//! (so that a lone `x + bias` reads through the bias's expand and joins as a prologue). Cores are
//! taken in topological order; a fused kernel between two cores joins the first as its epilogue.
//! The row kernel's node is the epilogue's (its users and output names stay), or the core's.
//!
//! Row kernels have one result. GPT-2's pre-LN `h = x + a; n = layer_norm(h)`, where `h` is also
//! used later, keeps `h` as its own kernel: writing both the sum and the norm from one kernel
//! needs nodes with several results, which the graph IR does not have.
//!
//! # Future work
//!
//! - Groups and row kernels with several outputs (a value used inside and outside could be
//!   written once by the kernel that computes it, instead of splitting the group).
//! - Fusing elementwise consumers into matmul/conv epilogues beyond what the optimizer's
//!   `MatmulEpilogue` recognizes, and producers of a norm's weight and bias.
//! - Reading through `Reshape`/`Permute` of kernel inputs with index math.

use crate::graph::{Graph, NodeId};
use crate::{CompileError, Result};
use rustytorch_ops::{
    DType, FusedInstr, FusedKernel, Op, ReduceKind, RowFusion, Shape, TensorType,
};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fmt::Write as _;

/// What [`fuse`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FuseReport {
    /// Fused kernels formed.
    pub groups: usize,
    /// Elementwise ops that now run inside a fused kernel (roots included).
    pub ops_absorbed: usize,
    /// `Expand` nodes replaced by the kernels' own broadcasting.
    pub expands_absorbed: usize,
    /// `Full` operands copied into kernels as immediates.
    pub immediates: usize,
    /// Row kernels formed ([`Op::FusedRow`]: a norm, softmax or reduction with a prologue, an
    /// epilogue or both).
    pub rows: usize,
    /// Elementwise kernels fused into a row op's input.
    pub prologues: usize,
    /// Elementwise kernels fused into a row op's output.
    pub epilogues: usize,
    /// Casts and cheap values split into one copy per user ([`split_shared_values`]).
    pub casts_split: usize,
    /// Kernels (live non-leaf nodes) before fusion.
    pub kernels_before: usize,
    /// Kernels (live non-leaf nodes) after fusion.
    pub kernels_after: usize,
}

impl fmt::Display for FuseReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "fuse: {} casts split; {} groups absorbing {} elementwise ops, {} expands and {} \
             immediates; {} row kernels with {} prologues and {} epilogues; kernels {} -> {}",
            self.casts_split,
            self.groups,
            self.ops_absorbed,
            self.expands_absorbed,
            self.immediates,
            self.rows,
            self.prologues,
            self.epilogues,
            self.kernels_before,
            self.kernels_after
        )
    }
}

/// Whether a node may be an instruction of a fused kernel (as a group member): an elementwise op
/// with no integer result or operand wider than 8 bits (fused kernels compute in f32 or f64, which
/// do not hold every product of such integers exactly, nor wrap like them).
fn fusable(graph: &Graph, n: NodeId) -> bool {
    let node = &graph.g[n];
    let wide_int = |d: DType| d.is_int() && d.size_bytes() > 1;
    matches!(
        node.op,
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. }
    ) && !wide_int(node.ty.dtype)
        && !node.inputs.iter().any(|&i| wide_int(graph.g[i].ty.dtype))
}

/// Number of live non-leaf nodes (one kernel launch each).
fn count_kernels(graph: &Graph) -> usize {
    graph
        .live_order()
        .into_iter()
        .filter(|&n| !graph.g[n].op.is_leaf())
        .count()
}

/// One group under construction.
struct Group {
    root: NodeId,
    /// Members in topological order (the root last).
    members: Vec<NodeId>,
}

/// Fuses elementwise chains into [`Op::Fused`] kernels (see the module docs for the rule). The
/// result has the same inputs, parameters, constants, outputs, updates and guards; dead nodes
/// are dropped, and the result is verified.
pub fn fuse(graph: &Graph) -> Result<(Graph, FuseReport)> {
    let _span = tracing::debug_span!("fuse").entered();
    let mut out = graph.clone();
    out.remove_dead();
    let mut report = FuseReport {
        kernels_before: count_kernels(graph),
        ..FuseReport::default()
    };
    let roots: HashSet<NodeId> = out.roots().into_iter().collect();
    report.casts_split = split_shared_values(&mut out, &roots)?;
    let order = out.live_order();
    // Groups, consumers first; a single op is a group of one for now.
    let mut assigned: HashSet<NodeId> = HashSet::new();
    let mut groups = Vec::new();
    for &n in order.iter().rev() {
        if assigned.contains(&n) || !fusable(&out, n) {
            continue;
        }
        let g = grow(&out, n, &roots, &assigned);
        assigned.extend(g.members.iter().copied());
        groups.push(g);
    }
    // Expands every user of which is a group member (or such an expand) disappear: each group
    // reads through them. Users come before their operands in reverse order.
    let mut expands: HashSet<NodeId> = HashSet::new();
    let mut expand_order: Vec<NodeId> = Vec::new();
    for &e in order.iter().rev() {
        if matches!(out.g[e].op, Op::Expand { .. })
            && !roots.contains(&e)
            && out
                .users(e)
                .iter()
                .all(|u| assigned.contains(u) || expands.contains(u))
        {
            expands.insert(e);
            expand_order.push(e);
        }
    }
    // A group of one is kept only when it absorbs an expand, or when it will join a row op as
    // its prologue or epilogue.
    groups.retain(|g| {
        g.members.len() > 1
            || out.g[g.root].inputs.iter().any(|i| expands.contains(i))
            || joins_row(&out, g.root, &roots)
    });

    let mut immediates: HashSet<NodeId> = HashSet::new();
    for g in &groups {
        let (kernel, inputs, imms, origins) = build_kernel(&out, g)?;
        // Each instruction keeps the location of the node it was made from; the kernel keeps
        // the root's.
        let locs = origins.iter().map(|&o| out.location(o)).collect();
        out.provenance.fused.insert(g.root, locs);
        report.groups += 1;
        report.ops_absorbed += g.members.len();
        report.immediates += imms.len();
        immediates.extend(imms);
        out.set_inputs(g.root, inputs);
        let node = out
            .node_mut(g.root)
            .ok_or_else(|| CompileError::Invalid("fused root vanished".into()))?;
        node.op = Op::Fused(Box::new(kernel));
        for &m in g.members.iter().filter(|&&m| m != g.root) {
            out.remove_node(m);
        }
    }
    report.expands_absorbed = expand_order.len();
    for e in expand_order {
        if !out.users(e).is_empty() {
            return Err(CompileError::Invalid(format!(
                "fuse: expand %{} is still used after fusion",
                e.index()
            )));
        }
        out.remove_node(e);
    }
    for f in immediates {
        if out.users(f).is_empty() && !roots.contains(&f) {
            out.remove_node(f);
        }
    }
    fuse_rows(&mut out, &roots, &mut report)?;
    report.kernels_after = count_kernels(&out);
    out.verify()?;
    tracing::debug!("{report}");
    Ok((out, report))
}

/// Gives each user of a shared cheap value its own copy (see the module docs): a fusable
/// `Cast`, a `Binary` that reads one operand of its own size and otherwise small
/// ones (at most an eighth of its size, read through an `Expand`; at least one of them computed,
/// not a constant), or an elementwise value computed from two full-size tensors with at most
/// three users ([`two_sources`]), that is
/// no result and has two or more users that are all fusable elementwise ops of its shape (so
/// each copy joins its user's kernel). Consumers go first, so a chain of such values (LayerNorm's
/// `x − mean`, then its product with `rstd`) is recomputed whole in each user. Returns the number
/// of values split.
fn split_shared_values(graph: &mut Graph, roots: &HashSet<NodeId>) -> Result<usize> {
    let mut split = 0;
    let mut order = graph.live_order();
    order.reverse();
    for n in order {
        if roots.contains(&n) || !fusable(graph, n) {
            continue;
        }
        let users = graph.users(n);
        let shape = graph.g[n].ty.shape.clone();
        if users.len() < 2
            || !(cheap(graph, n) || (users.len() <= 3 && two_sources(graph, n, roots)))
            || !users
                .iter()
                .all(|&u| fusable(graph, u) && graph.g[u].ty.shape == shape)
        {
            continue;
        }
        let (op, operands) = (graph.g[n].op.clone(), graph.g[n].inputs.clone());
        let sym = graph.dims.shapes.get(&n).cloned();
        let at = graph.location(n);
        // The first user keeps the original; every other one gets a copy.
        for &u in &users[1..] {
            let copy = graph.add(op.clone(), &operands)?;
            if let Some(s) = &sym {
                graph.dims.shapes.insert(copy, s.clone());
            }
            if let Some(at) = at {
                graph.set_location(copy, at);
            }
            let inputs = graph.g[u]
                .inputs
                .iter()
                .map(|&i| if i == n { copy } else { i })
                .collect();
            graph.set_inputs(u, inputs);
        }
        split += 1;
    }
    Ok(split)
}

/// Elements a kernel reads of operand `i`: none of a `Full` (an immediate), the source's of an
/// `Expand` (read through), else its own.
fn read_size(graph: &Graph, i: NodeId) -> usize {
    match &graph.g[i].op {
        Op::Full { .. } => 0,
        Op::Expand { .. } => graph.g[i]
            .inputs
            .first()
            .map_or(0, |&s| graph.g[s].ty.shape.numel()),
        _ => graph.g[i].ty.shape.numel(),
    }
}

/// Whether recomputing `n` in each of its users costs no more reading than materializing it
/// once: a cast, or a binary op with one operand of its own size and the others small (an
/// eighth of its size at most, counted through an `Expand`, or constants; one at least
/// computed). Each user then reads that one operand where it would have read `n`, and `n`'s
/// write is saved.
fn cheap(graph: &Graph, n: NodeId) -> bool {
    let node = &graph.g[n];
    match node.op {
        Op::Cast { .. } => return true,
        Op::Binary(_) => {}
        _ => return false,
    }
    let full = node.ty.shape.numel();
    let sizes: Vec<usize> = node.inputs.iter().map(|&i| read_size(graph, i)).collect();
    // A broadcast operand that is computed (a row statistic, a weight row) marks the pattern
    // this is for; a value made from one operand and constants alone stays shared (computed
    // once, as a group absorbs it when all its users are in the group).
    sizes.iter().filter(|&&k| k == full).count() == 1
        && sizes.iter().all(|&k| k == full || k * 8 <= full)
        && sizes.iter().any(|&k| k > 0 && k < full)
}

/// Whether an elementwise value `n` is computed from exactly two full-size tensors: the leaves
/// of its cone of fusable, same-shape, non-result elementwise nodes (at most [`CONE_MAX`] of
/// them) that have `n`'s size (counted through an `Expand`; constants and small operands such
/// as row statistics and weight rows are not counted). Such a
/// value with two or three users, all elementwise of its shape, costs no more bytes recomputed in
/// each user (each reads the two sources: 4 or 6 reads) than computed once (2 reads, a write,
/// and a read per user: 5 or 6), and saves a kernel: LayerNorm's backward spelled in primitives
/// makes one, `g·w·rstd + (x − mean)·c` read by the row sum after it and by the sum's user.
fn two_sources(graph: &Graph, n: NodeId, roots: &HashSet<NodeId>) -> bool {
    let shape = &graph.g[n].ty.shape;
    let full = shape.numel();
    let (mut cone, mut stack, mut sources) = (HashSet::new(), vec![n], Vec::new());
    while let Some(v) = stack.pop() {
        if !cone.insert(v) {
            continue;
        }
        if cone.len() > CONE_MAX {
            return false;
        }
        for &i in &graph.g[v].inputs {
            let inner = fusable(graph, i) && graph.g[i].ty.shape == *shape && !roots.contains(&i);
            if inner {
                stack.push(i);
            } else if read_size(graph, i) == full && !sources.contains(&i) {
                sources.push(i);
                if sources.len() > 2 {
                    return false;
                }
            }
        }
    }
    sources.len() == 2
}

/// The most elementwise nodes [`two_sources`] recomputes per user.
const CONE_MAX: usize = 24;

/// Whether `c` can be the core of a row kernel: a softmax, log-softmax, norm, or a float
/// reduction (sum, mean, max, min, product) of a float input.
fn row_core(graph: &Graph, c: NodeId) -> bool {
    let node = &graph.g[c];
    let float_in = node
        .inputs
        .first()
        .is_some_and(|&x| graph.g[x].ty.dtype.is_float());
    let kind_ok = match &node.op {
        Op::Reduce { kind, .. } => !matches!(kind, ReduceKind::Any | ReduceKind::All),
        op => RowFusion::is_core(op),
    };
    kind_ok && float_in && node.ty.dtype.is_float()
}

/// Whether the elementwise kernel `x` may become the prologue of the row op `c`: `x` is `c`'s
/// input (and none of its other operands), `c` is its only user, and it is not a result.
fn takes_prologue(graph: &Graph, c: NodeId, x: NodeId, roots: &HashSet<NodeId>) -> bool {
    row_core(graph, c)
        && graph.g[c].inputs.first() == Some(&x)
        && graph.g[c].inputs.iter().filter(|&&i| i == x).count() == 1
        && graph.users(x) == [c]
        && !roots.contains(&x)
}

/// Whether the elementwise kernel `u` may become the epilogue of the row op `c`: `u` is `c`'s
/// only user, has `c`'s shape (it runs per output element of the row op), and `c` is not a
/// result.
fn takes_epilogue(graph: &Graph, c: NodeId, u: NodeId, roots: &HashSet<NodeId>) -> bool {
    row_core(graph, c)
        && graph.users(c) == [u]
        && !roots.contains(&c)
        && graph.g[u].ty.shape == graph.g[c].ty.shape
}

/// Whether the elementwise node `r` will join a row op as its prologue or epilogue (so that a
/// group of one is worth a fused kernel).
fn joins_row(graph: &Graph, r: NodeId, roots: &HashSet<NodeId>) -> bool {
    let users = graph.users(r);
    (users.len() == 1 && takes_prologue(graph, users[0], r, roots))
        || graph.g[r]
            .inputs
            .iter()
            .any(|&c| takes_epilogue(graph, c, r, roots))
}

/// `k` with its input `pos` moved to position 0 (the others keep their order).
fn input_first(k: &FusedKernel, pos: u32) -> FusedKernel {
    let mut k = k.clone();
    let n = k.n_inputs;
    for ins in &mut k.instrs {
        for a in &mut ins.args {
            if *a < n {
                *a = match (*a).cmp(&pos) {
                    std::cmp::Ordering::Less => *a + 1,
                    std::cmp::Ordering::Equal => 0,
                    std::cmp::Ordering::Greater => *a,
                };
            }
        }
    }
    k
}

/// Fuses elementwise kernels into the inputs and outputs of norms, softmaxes and reductions
/// (see the module docs): each row op, in topological order, takes the fused kernel that
/// computes its input as its prologue and the fused kernel that consumes its result as its
/// epilogue, when [`takes_prologue`] and [`takes_epilogue`] allow.
fn fuse_rows(out: &mut Graph, roots: &HashSet<NodeId>, report: &mut FuseReport) -> Result<()> {
    for c in out.live_order() {
        if out.node(c).is_err() || !row_core(out, c) {
            continue;
        }
        let x = out.g[c].inputs[0];
        let prologue = match &out.g[x].op {
            Op::Fused(k) if takes_prologue(out, c, x, roots) => {
                Some(((**k).clone(), out.g[x].inputs.clone()))
            }
            _ => None,
        };
        let epilogue = match out.users(c)[..] {
            [u] if takes_epilogue(out, c, u, roots) => match &out.g[u].op {
                Op::Fused(k) => {
                    let ins = &out.g[u].inputs;
                    match ins.iter().position(|&i| i == c) {
                        Some(pos) if ins.iter().filter(|&&i| i == c).count() == 1 => {
                            let rest: Vec<NodeId> =
                                ins.iter().copied().filter(|&i| i != c).collect();
                            Some((u, input_first(k, pos as u32), rest))
                        }
                        _ => None,
                    }
                }
                _ => None,
            },
            _ => None,
        };
        if prologue.is_none() && epilogue.is_none() {
            continue;
        }
        let mut inputs = match &prologue {
            Some((_, ins)) => ins.clone(),
            None => vec![x],
        };
        inputs.extend_from_slice(&out.g[c].inputs[1..]);
        let target = match &epilogue {
            Some((u, _, rest)) => {
                inputs.extend_from_slice(rest);
                *u
            }
            None => c,
        };
        let row = RowFusion {
            core: out.g[c].op.clone(),
            prologue: prologue.as_ref().map(|(k, _)| k.clone()),
            epilogue: epilogue.as_ref().map(|(_, k, _)| k.clone()),
        };
        report.rows += 1;
        report.prologues += prologue.is_some() as usize;
        report.epilogues += epilogue.is_some() as usize;
        out.set_inputs(target, inputs);
        out.provenance.fused.remove(&target);
        let node = out
            .node_mut(target)
            .ok_or_else(|| CompileError::Invalid("fused row root vanished".into()))?;
        node.op = Op::FusedRow(Box::new(row));
        if target != c {
            out.remove_node(c);
        }
        if prologue.is_some() {
            out.remove_node(x);
        }
    }
    Ok(())
}

/// Grows the group rooted at `root` (see the module docs).
fn grow(graph: &Graph, root: NodeId, roots: &HashSet<NodeId>, taken: &HashSet<NodeId>) -> Group {
    let shape = &graph.g[root].ty.shape;
    let mut members: HashSet<NodeId> = HashSet::from([root]);
    // Users of a candidate not yet in the group.
    let mut pending: HashMap<NodeId, usize> = HashMap::new();
    let mut work = vec![root];
    while let Some(m) = work.pop() {
        let mut ins = graph.g[m].inputs.clone();
        ins.sort();
        ins.dedup();
        for p in ins {
            if members.contains(&p) {
                continue;
            }
            let left = pending.entry(p).or_insert_with(|| graph.users(p).len());
            *left -= 1;
            let node = &graph.g[p];
            if *left == 0
                && fusable(graph, p)
                && node.ty.shape == *shape
                && !roots.contains(&p)
                && !taken.contains(&p)
            {
                members.insert(p);
                work.push(p);
            }
        }
    }
    Group {
        root,
        members: topo_members(graph, root, &members),
    }
}

/// The members in topological order (post-order from the root over member operands).
fn topo_members(graph: &Graph, root: NodeId, members: &HashSet<NodeId>) -> Vec<NodeId> {
    let mut order = Vec::with_capacity(members.len());
    let mut seen = HashSet::from([root]);
    let mut stack = vec![(root, 0usize)];
    while let Some((n, k)) = stack.pop() {
        let ins = &graph.g[n].inputs;
        if k < ins.len() {
            stack.push((n, k + 1));
            let c = ins[k];
            if members.contains(&c) && seen.insert(c) {
                stack.push((c, 0));
            }
        } else {
            order.push(n);
        }
    }
    order
}

/// Follows `Expand`s from `n` to the value the kernel reads (which broadcasts to `out` itself).
fn read_through(graph: &Graph, mut n: NodeId, out: &Shape) -> NodeId {
    while let Op::Expand { .. } = graph.g[n].op {
        let src = graph.g[n].inputs[0];
        if !graph.g[src].ty.shape.broadcasts_to(out) {
            break;
        }
        n = src;
    }
    n
}

/// The kernel of a group, its input nodes, the `Full` nodes it copied as immediates, and the node
/// each instruction was made from.
#[allow(clippy::type_complexity)]
fn build_kernel(
    graph: &Graph,
    g: &Group,
) -> Result<(FusedKernel, Vec<NodeId>, Vec<NodeId>, Vec<NodeId>)> {
    let out_ty = graph.g[g.root].ty.clone();
    let members: HashSet<NodeId> = g.members.iter().copied().collect();
    let is_imm = |p: NodeId| match &graph.g[p].op {
        Op::Full { ty, .. } => ty.shape.broadcasts_to(&out_ty.shape),
        _ => false,
    };
    // What a member's operand reads: itself if a member, else through expands, an immediate
    // `Full` or a kernel input.
    let source = |p: NodeId| {
        if members.contains(&p) {
            p
        } else {
            read_through(graph, p, &out_ty.shape)
        }
    };
    // Kernel inputs, in first-use order.
    let mut inputs: Vec<NodeId> = Vec::new();
    let mut input_ix: HashMap<NodeId, u32> = HashMap::new();
    for &m in &g.members {
        for &p in &graph.g[m].inputs {
            let src = source(p);
            if members.contains(&src) || is_imm(src) {
                continue;
            }
            if let std::collections::hash_map::Entry::Vacant(v) = input_ix.entry(src) {
                v.insert(inputs.len() as u32);
                inputs.push(src);
            }
        }
    }
    let n_in = inputs.len() as u32;
    let mut instrs: Vec<FusedInstr> = Vec::new();
    // Member and immediate nodes → their instruction's value index.
    let mut value: HashMap<NodeId, u32> = HashMap::new();
    let mut imms: Vec<NodeId> = Vec::new();
    let mut origins: Vec<NodeId> = Vec::new();
    for &m in &g.members {
        let mut args = Vec::with_capacity(graph.g[m].inputs.len());
        for &p in &graph.g[m].inputs {
            let src = source(p);
            let a = if let Some(&v) = value.get(&src) {
                v
            } else if let (true, Op::Full { value: x, ty }) = (is_imm(src), &graph.g[src].op) {
                instrs.push(FusedInstr {
                    op: Op::Full {
                        value: *x,
                        ty: TensorType::new(ty.dtype, Shape::scalar()),
                    },
                    args: vec![],
                    dtype: ty.dtype,
                });
                origins.push(src);
                let v = n_in + instrs.len() as u32 - 1;
                value.insert(src, v);
                imms.push(src);
                v
            } else {
                *input_ix.get(&src).ok_or_else(|| {
                    CompileError::Invalid(format!(
                        "fuse: operand %{} of %{} is neither a member nor an input",
                        p.index(),
                        m.index()
                    ))
                })?
            };
            args.push(a);
        }
        instrs.push(FusedInstr {
            op: graph.g[m].op.clone(),
            args,
            dtype: graph.g[m].ty.dtype,
        });
        origins.push(m);
        value.insert(m, n_in + instrs.len() as u32 - 1);
    }
    let kernel = FusedKernel {
        n_inputs: n_in,
        instrs,
        out: out_ty,
    };
    Ok((kernel, inputs, imms, origins))
}

/// One instruction in readable form (`mul(in0, t1)`, `cast<f16>(t0)`, `0.5`): kernel input `a`
/// named by `input(a)`, instruction `j` by `{tag}{j}`.
fn instr_text(
    k: &FusedKernel,
    ins: &FusedInstr,
    tag: char,
    input: &dyn Fn(u32) -> String,
) -> String {
    let arg = |a: u32| {
        if a < k.n_inputs {
            input(a)
        } else {
            format!("{tag}{}", a - k.n_inputs)
        }
    };
    let args: Vec<String> = ins.args.iter().map(|&a| arg(a)).collect();
    match &ins.op {
        Op::Full { value, .. } => format!("{:?}", value.get()),
        Op::Cast { to } => format!("cast<{to}>({})", args.join(", ")),
        op => format!("{}({})", op.name(), args.join(", ")),
    }
}

/// A node's name as ` "name"`, or nothing.
fn name_text(graph: &Graph, n: NodeId) -> String {
    graph.g[n]
        .name
        .as_deref()
        .map(|x| format!(" \"{x}\""))
        .unwrap_or_default()
}

/// Lists each fused kernel of `graph` (in schedule order) with its inputs and program, one
/// instruction a line, so that a reader (or a snapshot) sees which ops were fused. A row kernel
/// ([`Op::FusedRow`]) lists its prologue (`p*`, over the kernel inputs), its core (reading `x`,
/// the prologue's result) and its epilogue (`e*`, reading `row`, the core's result).
pub fn describe_groups(graph: &Graph) -> String {
    let mut s = String::new();
    for n in graph.live_order() {
        let node = &graph.g[n];
        let (kind, out) = match &node.op {
            Op::Fused(k) => ("fused", &k.out),
            Op::FusedRow(_) => ("fused_row", &node.ty),
            _ => continue,
        };
        let _ = writeln!(s, "%{}{} = {kind} -> {out}", n.index(), name_text(graph, n));
        for (i, &p) in node.inputs.iter().enumerate() {
            let pn = &graph.g[p];
            let _ = writeln!(
                s,
                "  in{i} = %{}{} ({}) : {}",
                p.index(),
                name_text(graph, p),
                pn.op.name(),
                pn.ty
            );
        }
        match &node.op {
            Op::Fused(k) => {
                for (j, ins) in k.instrs.iter().enumerate() {
                    let t = instr_text(k, ins, 't', &|a| format!("in{a}"));
                    let _ = writeln!(s, "  t{j} = {t} : {}", ins.dtype);
                }
            }
            Op::FusedRow(r) => describe_row(&mut s, r),
            _ => {}
        }
    }
    s
}

/// The prologue, core and epilogue lines of a row kernel.
fn describe_row(s: &mut String, r: &RowFusion) {
    let program = |s: &mut String, k: &FusedKernel, tag: char, input: &dyn Fn(u32) -> String| {
        for (j, ins) in k.instrs.iter().enumerate() {
            let t = instr_text(k, ins, tag, input);
            let _ = writeln!(s, "  {tag}{j} = {t} : {}", ins.dtype);
        }
    };
    let x = match &r.prologue {
        Some(k) => {
            program(s, k, 'p', &|a| format!("in{a}"));
            format!("p{}", k.instrs.len() - 1)
        }
        None => "in0".to_string(),
    };
    let p = r.prologue_inputs();
    let mut args = vec![x];
    args.extend((1..r.core_arity()).map(|i| format!("in{}", p + i - 1)));
    let _ = writeln!(s, "  row = {}({})", r.core, args.join(", "));
    if let Some(k) = &r.epilogue {
        let base = p + r.core_arity() - 1;
        program(s, k, 'e', &|a| {
            if a == 0 {
                "row".to_string()
            } else {
                format!("in{}", base + a as usize - 1)
            }
        });
    }
}
