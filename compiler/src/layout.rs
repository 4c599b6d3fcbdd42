//! The channels-last layout pass: on a target whose convolution libraries are faster on
//! channels-last tensors (CUDA with f16/bf16 tensor cores), turns whole convolution stacks
//! channels-last, with transposes only where a stack meets the rest of the graph.
//!
//! # The rule
//!
//! 1. **Seeds.** Every channels-first convolution, convolution gradient (and, when the target
//!    says so, pooling and its gradient) that the target's [`ChannelsLast`] accepts (dtype,
//!    spatial rank, one group, channel counts a multiple of its `channel_multiple`).
//! 2. **Growth.** An elementwise op (`Unary`, `Binary`, `Where`, `Cast`) whose result has a
//!    seed's rank joins the region when that does not add transposes: each full-size value that
//!    crosses the region's border costs one transpose (a value used on both sides costs one
//!    whichever side it is on; a broadcast operand such as a bias `[C, 1, 1]` costs nothing, as
//!    it is reshaped to `[C]`, broadcast along the last axis; a user-written `permute` that is
//!    the inverse of the pass's transpose costs nothing, as the two cancel). A reduction whose
//!    kept axes stay in order (the bias gradient `Σ` over all axes but the channels, a loss's
//!    mean) joins as a sink: it reads channels-last values and gives the same result. Growth
//!    repeats until nothing more joins.
//! 3. **Rewrite.** Region ops are rebuilt channels-last (`ConvGeom::layout`, shape attributes
//!    and reduction axes reordered); an operand from outside enters through
//!    `permute[0,2,..,1]`, a value leaving goes out through `permute[0,r-1,1,..]`, and a permute
//!    of a permute becomes one permute, or nothing when they cancel. So an NHWC graph input
//!    permuted to NCHW before the first convolution and permuted back after the last runs with
//!    no transpose at all.
//!
//! The pass runs before the e-graph (a global choice over whole stacks; the e-graph's extraction
//! chooses class by class and would see each transpose pair's cost only locally), so the
//! optimizer and fusion then work on the channels-last graph: the recognizer folds an activation
//! into the convolution before it (`conv[..., act]`, whatever its layout; the rebuilt op keeps its
//! `act`), and a separate bias add and activation fuse into one elementwise kernel as before.

use crate::graph::{Graph, NodeId};
use crate::Result;
use rustytorch_ops::{ConvGeom, DType, Layout, Op, Shape, TensorType};
use std::collections::{HashMap, HashSet};

/// When a target runs convolutions channels-last (a compile option the target decides: off on
/// the CPU, whose kernels are channels-first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelsLast {
    /// Element types whose convolutions run channels-last.
    pub dtypes: Vec<DType>,
    /// Input and output channel counts must be multiples of this (tensor-core tiles).
    pub channel_multiple: usize,
    /// Fewest spatial dims (2: 1-D convolutions stay channels-first).
    pub min_spatial: usize,
    /// Whether pooling may run channels-last too.
    pub pool: bool,
}

/// What [`channels_last`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayoutReport {
    /// Convolution and pooling ops made channels-last.
    pub seeds: usize,
    /// Other ops that run on channels-last values.
    pub grown: usize,
    /// Transposes the rewrite left in the graph.
    pub transposes: usize,
}

/// A node's role in the region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// A convolution or pooling op, rebuilt channels-last.
    Seed,
    /// An elementwise op running on channels-last values.
    Elementwise,
    /// A reduction reading channels-last values; its result is the same in either layout.
    Sink,
}

fn geom_of(op: &Op) -> Option<&ConvGeom> {
    match op {
        Op::Conv { geom, .. }
        | Op::ConvGradInput { geom, .. }
        | Op::ConvGradWeight { geom, .. }
        | Op::Pool { geom, .. }
        | Op::PoolGrad { geom, .. } => Some(geom),
        _ => None,
    }
}

impl ChannelsLast {
    /// Whether node `id` is a seed.
    fn accepts(&self, g: &Graph, id: NodeId) -> bool {
        let Ok(n) = g.node(id) else { return false };
        let Some(geom) = geom_of(&n.op) else {
            return false;
        };
        let x = g.ty(n.inputs[0]);
        let rank = x.shape.rank();
        let mult = self.channel_multiple.max(1);
        let channels_ok = |t: &TensorType| t.shape.dims().get(1).is_some_and(|c| c % mult == 0);
        geom.layout == Layout::ChannelsFirst
            && self.dtypes.contains(&n.ty.dtype)
            && (3..=5).contains(&rank)
            && rank - 2 >= self.min_spatial
            && match &n.op {
                Op::Conv { groups, .. } => *groups == 1 && channels_ok(x) && channels_ok(&n.ty),
                Op::ConvGradInput { groups, .. } => {
                    *groups == 1 && channels_ok(x) && channels_ok(&n.ty)
                }
                Op::ConvGradWeight { groups, .. } => {
                    *groups == 1 && channels_ok(x) && channels_ok(g.ty(n.inputs[1]))
                }
                Op::Pool { .. } | Op::PoolGrad { .. } => self.pool && channels_ok(x),
                _ => false,
            }
    }
}

/// `perm` of a permutation of `p1`'s result: `permute(permute(a, p1), p2) = permute(a, p)`.
fn compose(p1: &[usize], p2: &[usize]) -> Vec<usize> {
    p2.iter().map(|&i| p1[i]).collect()
}

fn is_identity(p: &[usize]) -> bool {
    p.iter().enumerate().all(|(i, &d)| i == d)
}

/// Whether `p` moves every non-1 dim of `dims` without changing their order (then permuting is
/// a reshape).
fn keeps_order(dims: &[usize], p: &[usize]) -> bool {
    let moved: Vec<usize> = p.iter().copied().filter(|&a| dims[a] != 1).collect();
    moved.windows(2).all(|w| w[0] < w[1])
}

/// Adds `permute(src, perm)`, folded into `src` when it is a permute itself and dropped when
/// the result is the identity.
fn permute_of(g: &mut Graph, src: NodeId, perm: &[usize]) -> Result<NodeId> {
    let (src, perm) = match &g.node(src)?.op {
        Op::Permute { perm: inner } => (g.node(src)?.inputs[0], compose(inner, perm)),
        _ => (src, perm.to_vec()),
    };
    if is_identity(&perm) {
        return Ok(src);
    }
    g.add(Op::Permute { perm }, &[src])
}

struct Pass<'a> {
    target: &'a ChannelsLast,
    region: HashMap<NodeId, Role>,
    roots: HashSet<NodeId>,
}

impl Pass<'_> {
    /// Whether value `v` (used by a channels-last op) enters for free: a broadcast operand
    /// smaller than `out`, or the inverse of the pass's transpose written by the user.
    fn enters_free(&self, g: &Graph, v: NodeId, out: &Shape) -> bool {
        let t = g.ty(v);
        if t.shape != *out {
            return true;
        }
        matches!(&g.node(v).map(|n| &n.op), Ok(Op::Permute { perm })
            if *perm == Layout::ChannelsLast.to_first(perm.len()))
    }

    /// Whether the full-size value `v` is used outside the region (by an op other than a
    /// permute that cancels the pass's transpose back, or as an output, update or guard).
    fn used_outside(&self, g: &Graph, v: NodeId, assume: Option<NodeId>) -> bool {
        self.roots.contains(&v)
            || g.users(v).into_iter().any(|u| {
                Some(u) != assume
                    && !self.region.contains_key(&u)
                    && !matches!(&g.node(u).map(|n| &n.op), Ok(Op::Permute { perm })
                        if *perm == Layout::ChannelsLast.from_first(perm.len()))
            })
    }

    /// Whether some region op other than `except` reads `v`.
    fn used_inside(&self, g: &Graph, v: NodeId, except: NodeId) -> bool {
        g.users(v)
            .into_iter()
            .any(|u| u != except && self.region.contains_key(&u))
    }

    /// Whether an elementwise node can run channels-last, and whether that saves transposes.
    fn worth_growing(&self, g: &Graph, id: NodeId) -> Option<Role> {
        let n = g.node(id).ok()?;
        let rank = n.ty.shape.rank();
        let producer_role = |v: NodeId| self.region.get(&v).copied();
        match &n.op {
            Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } => {
                if !(3..=5).contains(&rank) {
                    return None;
                }
                let mut touches = false;
                let mut gain = 0i64;
                let mut seen = HashSet::new();
                for &v in &n.inputs {
                    let full = g.ty(v).shape == n.ty.shape;
                    if !full && self.region.contains_key(&v) {
                        // A channels-last value broadcast to a bigger shape: not handled.
                        return None;
                    }
                    if !seen.insert(v) || !full {
                        continue;
                    }
                    match producer_role(v) {
                        Some(Role::Seed | Role::Elementwise) => {
                            touches = true;
                            if !self.used_outside(g, v, Some(id)) {
                                gain += 1;
                            }
                        }
                        _ => {
                            if self.enters_free(g, v, &n.ty.shape) {
                                continue;
                            }
                            if !self.used_inside(g, v, id) {
                                gain -= 1;
                            }
                        }
                    }
                }
                let inside_users = g.users(id).iter().any(|u| self.region.contains_key(u));
                touches |= inside_users;
                let out_if_joined = i64::from(self.used_outside(g, id, None));
                let out_if_not = i64::from(inside_users);
                gain += out_if_not - out_if_joined;
                (touches && gain >= 0).then_some(Role::Elementwise)
            }
            Op::Reduce {
                axes, keep_dims, ..
            } => {
                let x = n.inputs[0];
                if !matches!(producer_role(x), Some(Role::Seed | Role::Elementwise)) {
                    return None;
                }
                let r = g.ty(x).shape.rank();
                let p = Layout::ChannelsLast.from_first(r);
                let kept: Vec<usize> = p.iter().copied().filter(|a| !axes.contains(a)).collect();
                let ordered = kept.windows(2).all(|w| w[0] < w[1]);
                // With keep_dims the result is reshaped back, which needs the order too.
                let _ = keep_dims;
                ordered.then_some(Role::Sink)
            }
            _ => None,
        }
    }
}

/// The channels-last pass (see the module docs); returns the graph and what changed. A graph
/// with no seed is returned as it is.
pub fn channels_last(graph: &Graph, target: &ChannelsLast) -> Result<(Graph, LayoutReport)> {
    let mut g = graph.clone();
    let order = g.topo_order()?;
    let mut pass = Pass {
        target,
        region: HashMap::new(),
        roots: g.roots().into_iter().collect(),
    };
    for &id in &order {
        if pass.target.accepts(&g, id) {
            pass.region.insert(id, Role::Seed);
        }
    }
    let mut report = LayoutReport {
        seeds: pass.region.len(),
        ..Default::default()
    };
    if report.seeds == 0 {
        return Ok((g, report));
    }
    // Growth to a fixed point (only ever adds, so it ends).
    loop {
        let mut changed = false;
        for &id in &order {
            if pass.region.contains_key(&id) {
                continue;
            }
            if let Some(role) = pass.worth_growing(&g, id) {
                pass.region.insert(id, role);
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    report.grown = pass.region.len() - report.seeds;

    // Rewrite: the channels-last version of every region value, in topological order.
    let mut last: HashMap<NodeId, NodeId> = HashMap::new();
    let mut entered: HashMap<NodeId, NodeId> = HashMap::new();
    let mut created: HashSet<NodeId> = HashSet::new();
    for &id in &order {
        let Some(&role) = pass.region.get(&id) else {
            continue;
        };
        let n = g.node(id)?.clone();
        let rank = |v: NodeId, g: &Graph| g.ty(v).shape.rank();
        let mut ins = Vec::with_capacity(n.inputs.len());
        for (k, &v) in n.inputs.iter().enumerate() {
            let is_bias = matches!(n.op, Op::Conv { .. }) && k == 2;
            let full = g.ty(v).shape == n.ty.shape || role != Role::Elementwise;
            let nv = if is_bias {
                v
            } else if let Some(&lv) = last.get(&v) {
                lv
            } else if full {
                match entered.get(&v) {
                    Some(&e) => e,
                    None => {
                        let p = Layout::ChannelsLast.from_first(rank(v, &g));
                        let e = permute_of(&mut g, v, &p)?;
                        created.insert(e);
                        entered.insert(v, e);
                        e
                    }
                }
            } else {
                broadcast_operand(&mut g, v, n.ty.shape.rank(), &mut created)?
            };
            ins.push(nv);
        }
        let new = match role {
            Role::Seed => g.add(last_op(&n.op), &ins)?,
            Role::Elementwise => g.add(n.op.clone(), &ins)?,
            Role::Sink => {
                let Op::Reduce {
                    kind,
                    axes,
                    keep_dims,
                } = &n.op
                else {
                    unreachable!("only reductions are sinks")
                };
                let p = Layout::ChannelsLast.from_first(rank(n.inputs[0], &g));
                let axes: Vec<usize> = (0..p.len()).filter(|&i| axes.contains(&p[i])).collect();
                let r = g.add(
                    Op::Reduce {
                        kind: *kind,
                        axes,
                        keep_dims: *keep_dims,
                    },
                    &ins,
                )?;
                let r = if g.ty(r).shape != n.ty.shape {
                    g.add(
                        Op::Reshape {
                            shape: n.ty.shape.clone(),
                        },
                        &[r],
                    )?
                } else {
                    r
                };
                g.replace_uses(id, r);
                continue;
            }
        };
        if let Some(at) = g.location(id) {
            g.set_location(new, at);
        }
        last.insert(id, new);
    }
    // Values leaving the region: one transpose back each, shared by their outside users.
    for &old in &order {
        let Some(&new) = last.get(&old) else {
            continue;
        };
        let outside: Vec<NodeId> = g
            .users(old)
            .into_iter()
            .filter(|u| !pass.region.contains_key(u))
            .collect();
        if outside.is_empty() && !pass.roots.contains(&old) {
            continue;
        }
        let q = Layout::ChannelsLast.to_first(g.ty(new).shape.rank());
        let back = permute_of(&mut g, new, &q)?;
        created.insert(back);
        g.replace_uses(old, back);
    }
    // A user's permute after a transpose back becomes one permute, or nothing.
    for id in g.topo_order()? {
        let Ok(n) = g.node(id) else { continue };
        if let Op::Permute { perm } = &n.op {
            let src = n.inputs[0];
            if created.contains(&src) && matches!(g.node(src)?.op, Op::Permute { .. }) {
                let perm = perm.clone();
                let folded = permute_of(&mut g, src, &perm)?;
                if folded != id {
                    g.replace_uses(id, folded);
                    created.insert(folded);
                }
            }
        }
    }
    g.remove_dead();
    report.transposes = g
        .node_ids()
        .into_iter()
        .filter(|id| {
            created.contains(id) && matches!(g.node(*id).map(|n| &n.op), Ok(Op::Permute { .. }))
        })
        .count();
    Ok((g, report))
}

/// A broadcast operand `v` of a channels-last elementwise op of `rank`: `v` padded to that rank
/// with leading 1s and permuted channels-last; a reshape when its non-1 dims keep their order
/// (a bias `[C, 1, 1]` becomes `[C]`, broadcast along the last axis).
fn broadcast_operand(
    g: &mut Graph,
    v: NodeId,
    rank: usize,
    created: &mut HashSet<NodeId>,
) -> Result<NodeId> {
    let dims = g.ty(v).shape.dims().to_vec();
    if dims.is_empty() {
        return Ok(v);
    }
    let mut padded = vec![1; rank - dims.len()];
    padded.extend(&dims);
    let p = Layout::ChannelsLast.from_first(rank);
    let moved: Vec<usize> = p.iter().map(|&a| padded[a]).collect();
    if keeps_order(&padded, &p) {
        let lead = moved.iter().take_while(|&&d| d == 1).count();
        let target = Shape::new(moved[lead.min(moved.len() - 1)..].to_vec());
        if target.dims() == dims.as_slice() {
            return Ok(v);
        }
        let r = g.add(Op::Reshape { shape: target }, &[v])?;
        created.insert(r);
        return Ok(r);
    }
    let src = if padded.len() != dims.len() {
        g.add(
            Op::Reshape {
                shape: Shape::new(padded),
            },
            &[v],
        )?
    } else {
        v
    };
    let r = permute_of(g, src, &p)?;
    created.insert(r);
    Ok(r)
}

/// The channels-last version of a seed op: its geometry channels-last and its shape attribute
/// reordered.
fn last_op(op: &Op) -> Op {
    let geom = |g: &ConvGeom| g.clone().with_layout(Layout::ChannelsLast);
    let shape = |s: &Shape| Shape::new(Layout::ChannelsLast.dims_from_first(s.dims()));
    match op {
        Op::Conv {
            geom: g,
            groups,
            bias,
            act,
        } => Op::Conv {
            geom: geom(g),
            groups: *groups,
            bias: *bias,
            act: *act,
        },
        Op::ConvGradInput {
            geom: g,
            groups,
            input_shape,
        } => Op::ConvGradInput {
            geom: geom(g),
            groups: *groups,
            input_shape: shape(input_shape),
        },
        Op::ConvGradWeight {
            geom: g,
            groups,
            weight_shape,
        } => Op::ConvGradWeight {
            geom: geom(g),
            groups: *groups,
            weight_shape: shape(weight_shape),
        },
        Op::Pool {
            kind,
            kernel,
            geom: g,
        } => Op::Pool {
            kind: *kind,
            kernel: kernel.clone(),
            geom: geom(g),
        },
        Op::PoolGrad {
            kind,
            kernel,
            geom: g,
        } => Op::PoolGrad {
            kind: *kind,
            kernel: kernel.clone(),
            geom: geom(g),
        },
        other => other.clone(),
    }
}
