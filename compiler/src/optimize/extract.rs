//! Extraction: choosing one e-node per needed e-class, under one cost model, with each shared
//! value counted once (a DAG cost, not a tree cost) and without fusions that recompute a value
//! used elsewhere.
//!
//! # The cost model
//!
//! [`CostModel::op_cost`] is the one place that prices an op, in seconds on a nominal device:
//! `launch` per kernel, plus the bytes it reads and writes over `bandwidth`, plus its FLOPs over
//! `flop_rate` (matmul, attention, convolution; elementwise and reductions are memory-bound).
//! Graph leaves, `full`, `reshape` and `expand` are free (constants and views that consumers read
//! directly). Under it a library op beats its primitive spelling because it is one kernel that
//! reads its inputs once: `matmul_epilogue` saves the bias/activation passes over the product,
//! `attention` never writes the `[B,H,Sq,Sk]` scores, `layer_norm`/`rms_norm`/`softmax` replace
//! four to nine kernels.
//!
//! # The algorithm
//!
//! 1. Ranks. Every class holding an original graph node gets the position of its earliest one in
//!    the original topological order; a class made only by rules gets a rank just above its
//!    operands'. A node may be chosen only if all its operands rank below its class, so every
//!    choice is acyclic (rewrites such as `x·1 = x` put cycles in the e-graph).
//! 2. Choice, in rank order: a node costs its own cost plus the cost of each distinct operand
//!    class that is *private*; a *shared* class (used twice or more, or a root) costs 0 there,
//!    since it is computed once anyway. Sharing is first taken from the original graph, then
//!    from the previous round's chosen DAG, until the choice is stable (a few rounds); the round
//!    with the lowest DAG cost (the sum of each chosen class's own cost, once) wins.
//! 3. Fusion check. A fused node records the intermediate classes its match absorbed. If one of
//!    them is also in the chosen DAG (`gelu(h) + h` with `h = x·w + b`), the fused node would
//!    recompute it: that node is refused and the choice is redone.

use super::analysis::EG;
use super::lang::TNode;
use egg::Id;
use rustytorch_ops::{Op, TensorType};
use std::collections::{HashMap, HashSet};

/// Prices ops for extraction (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// Memory bandwidth in bytes per second.
    pub bandwidth: f64,
    /// Arithmetic rate in FLOPs per second.
    pub flop_rate: f64,
    /// Fixed cost of one kernel launch, in seconds.
    pub launch: f64,
}

impl Default for CostModel {
    /// A current datacenter GPU, roughly: 2 TB/s, 50 TFLOP/s, 4 µs per launch.
    fn default() -> Self {
        CostModel {
            bandwidth: 2.0e12,
            flop_rate: 5.0e13,
            launch: 4.0e-6,
        }
    }
}

fn bytes(t: &TensorType) -> f64 {
    t.size_bytes() as f64
}

impl CostModel {
    /// The cost of one op producing `out` from operands of types `ins`, in seconds.
    pub fn op_cost(&self, op: &Op, out: &TensorType, ins: &[&TensorType]) -> f64 {
        let io = (ins.iter().map(|t| bytes(t)).sum::<f64>() + bytes(out)) / self.bandwidth;
        let kernel = self.launch + io;
        let dims = |t: &TensorType, i: usize| -> f64 {
            let d = t.shape.dims();
            if i < d.len() {
                d[d.len() - 1 - i] as f64
            } else {
                1.0
            }
        };
        match op {
            Op::Input { .. }
            | Op::Param { .. }
            | Op::Constant { .. }
            | Op::Full { .. }
            | Op::Reshape { .. }
            | Op::Expand { .. } => 0.0,
            Op::Iota { .. } => bytes(out) / self.bandwidth,
            Op::Matmul { trans_a, .. }
            | Op::MatmulEpilogue { trans_a, .. }
            | Op::MatmulActGrad { trans_a, .. } => {
                // out [.., m, n]; k is a's contracted dim.
                let k = if *trans_a {
                    dims(ins[0], 1)
                } else {
                    dims(ins[0], 0)
                };
                let flops = 2.0 * out.shape.numel() as f64 * k;
                kernel + flops / self.flop_rate
            }
            Op::SparseMatmul { .. } | Op::SampledMatmul => {
                // A multiply-add per nonzero of the pattern (col_idx [nnz]) per dense column.
                let flops = 2.0 * dims(ins[1], 0) * dims(ins[3], 0);
                kernel + flops / self.flop_rate
            }
            Op::Attention { .. } | Op::AttentionGrad { .. } => {
                // q [B,H,Sq,D], k [B,H,Sk,D], v [B,H,Sk,Dv]: two products over Sq×Sk.
                let (q, k, v) = (ins[0], ins[1], ins[2]);
                let bh = dims(q, 3) * dims(q, 2);
                let flops = 2.0 * bh * dims(q, 1) * dims(k, 1) * (dims(q, 0) + dims(v, 0));
                let f = if matches!(op, Op::AttentionGrad { .. }) {
                    2.0
                } else {
                    1.0
                };
                kernel + f * flops / self.flop_rate
            }
            Op::Conv { groups, .. } => {
                let w = ins[1];
                let per_out: f64 = w.shape.dims()[1..].iter().product::<usize>() as f64;
                let _ = groups;
                kernel + 2.0 * out.shape.numel() as f64 * per_out / self.flop_rate
            }
            Op::ConvGradInput { .. } | Op::ConvGradWeight { .. } => {
                let big = ins.iter().map(|t| t.shape.numel()).max().unwrap_or(0) as f64;
                kernel + 2.0 * big * 9.0 / self.flop_rate
            }
            Op::RandUniform { .. }
            | Op::RandNormal { .. }
            | Op::Unary(_)
            | Op::Binary(_)
            | Op::Where
            | Op::Cast { .. }
            | Op::Reduce { .. }
            | Op::ArgReduce { .. }
            | Op::CumSum { .. }
            | Op::TopK { .. }
            | Op::AllReduce { .. }
            | Op::FusedRow(_)
            | Op::Permute { .. }
            | Op::Slice { .. }
            | Op::Concat { .. }
            | Op::Pad { .. }
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. }
            | Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
            | Op::Gather { .. }
            | Op::ScatterAdd { .. }
            | Op::IndexSelect { .. }
            | Op::IndexAdd { .. }
            | Op::Pool { .. }
            | Op::PoolGrad { .. }
            | Op::CrossEntropy { .. }
            | Op::CrossEntropyGrad { .. }
            | Op::Fused(_) => kernel,
        }
    }
}

/// The extractor's result.
pub(crate) struct Extraction {
    /// The chosen node of every class the roots need (canonical ids).
    pub choice: HashMap<Id, TNode>,
    /// The DAG cost of the choice (each class once).
    pub cost: f64,
    /// Choice rounds run.
    pub rounds: usize,
    /// Fused nodes refused because they would recompute a value used elsewhere.
    pub refused: usize,
}

type Rank = (u32, u32);
const UNRANKED: Rank = (u32::MAX, u32::MAX);

struct Tables<'a> {
    eg: &'a EG,
    /// Canonical class ids, densely indexed.
    ids: Vec<Id>,
    /// Class id -> dense index.
    index: HashMap<Id, usize>,
    rank: Vec<Rank>,
    /// Own cost per class per node.
    own: Vec<Vec<f64>>,
    /// Per class per node: dense indices of its distinct operand classes.
    kids: Vec<Vec<Vec<usize>>>,
    roots: Vec<usize>,
}

impl Tables<'_> {
    fn nodes(&self, c: usize) -> &[TNode] {
        &self.eg[self.ids[c]].nodes
    }

    /// Chooses a node per class under the given sharing and refusals; returns the choice and the
    /// per-class cost.
    fn choose(
        &self,
        order: &[usize],
        shared: &[bool],
        refused: &HashSet<(usize, usize)>,
    ) -> (Vec<usize>, Vec<f64>) {
        let n = self.ids.len();
        let mut total = vec![f64::INFINITY; n];
        let mut choice = vec![usize::MAX; n];
        for &c in order {
            let rc = self.rank[c];
            for (k, kids) in self.kids[c].iter().enumerate() {
                if refused.contains(&(c, k)) {
                    continue;
                }
                let mut cost = self.own[c][k];
                let mut ok = true;
                for &d in kids {
                    if self.rank[d] >= rc || !total[d].is_finite() {
                        ok = false;
                        break;
                    }
                    if !shared[d] {
                        cost += total[d];
                    }
                }
                if ok && cost < total[c] {
                    total[c] = cost;
                    choice[c] = k;
                }
            }
        }
        (choice, total)
    }

    /// The classes the roots reach through the choice, with their number of distinct users.
    fn dag(&self, choice: &[usize]) -> (Vec<bool>, Vec<u32>) {
        let n = self.ids.len();
        let mut reach = vec![false; n];
        let mut users = vec![0u32; n];
        let mut stack: Vec<usize> = Vec::new();
        for &r in &self.roots {
            users[r] += 1;
            if !reach[r] {
                reach[r] = true;
                stack.push(r);
            }
        }
        while let Some(c) = stack.pop() {
            for &d in &self.kids[c][choice[c]] {
                users[d] += 1;
                if !reach[d] {
                    reach[d] = true;
                    stack.push(d);
                }
            }
        }
        (reach, users)
    }
}

/// Extracts the cheapest acyclic choice for `roots` (see the module docs). `original` lists the
/// e-nodes of the input graph (canonical), in its topological order.
pub(crate) fn extract(
    eg: &EG,
    roots: &[Id],
    original: &[TNode],
    model: &CostModel,
) -> Result<Extraction, String> {
    // Dense tables.
    let ids: Vec<Id> = eg.classes().map(|c| c.id).collect();
    let index: HashMap<Id, usize> = ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let ix = |id: Id| index[&eg.find(id)];
    let n = ids.len();
    let mut own = Vec::with_capacity(n);
    let mut kids = Vec::with_capacity(n);
    for &id in &ids {
        let class = &eg[id];
        let mut o = Vec::with_capacity(class.nodes.len());
        let mut k = Vec::with_capacity(class.nodes.len());
        for node in &class.nodes {
            let out = class.data.ty.as_ref();
            let ins: Option<Vec<&TensorType>> = node
                .children
                .iter()
                .map(|&c| eg[c].data.ty.as_ref())
                .collect();
            o.push(match (out, ins) {
                (Some(out), Some(ins)) => model.op_cost(&node.op, out, &ins),
                _ => f64::INFINITY,
            });
            let mut ks: Vec<usize> = Vec::with_capacity(node.children.len());
            for &c in &node.children {
                let d = ix(c);
                if !ks.contains(&d) {
                    ks.push(d);
                }
            }
            k.push(ks);
        }
        own.push(o);
        kids.push(k);
    }

    // Ranks: original classes by their earliest original node, the others just above their
    // operands.
    let mut rank = vec![UNRANKED; n];
    let mut orig_users = vec![0u32; n];
    for (pos, node) in original.iter().enumerate() {
        let Some(c) = eg.lookup(node.clone()) else {
            return Err(format!("original node {node} is missing from the e-graph"));
        };
        let c = index[&c];
        rank[c] = rank[c].min((pos as u32, 0));
        let mut seen: Vec<usize> = Vec::new();
        for &ch in &node.children {
            let d = ix(ch);
            if !seen.contains(&d) {
                seen.push(d);
                orig_users[d] += 1;
            }
        }
    }
    let fixed: Vec<bool> = rank.iter().map(|r| *r != UNRANKED).collect();
    for _pass in 0..n.max(1) {
        let mut changed = false;
        for c in 0..n {
            if fixed[c] {
                continue;
            }
            for ks in &kids[c] {
                let mut m: Rank = (0, 0);
                let mut ok = true;
                for &d in ks {
                    if d == c || rank[d] == UNRANKED {
                        ok = false;
                        break;
                    }
                    m = m.max(rank[d]);
                }
                if ok {
                    let cand = if ks.is_empty() {
                        (0, 0)
                    } else {
                        (m.0, m.1 + 1)
                    };
                    if cand < rank[c] {
                        rank[c] = cand;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    let mut order: Vec<usize> = (0..n).filter(|&c| rank[c] != UNRANKED).collect();
    order.sort_by_key(|&c| rank[c]);

    let root_ix: Vec<usize> = roots.iter().map(|&r| ix(r)).collect();
    let t = Tables {
        eg,
        ids,
        index,
        rank,
        own,
        kids,
        roots: root_ix.clone(),
    };

    // Fused nodes and what they absorb; original nodes are never refused.
    let orig_set: HashSet<&TNode> = original.iter().collect();
    let mut fused: HashMap<TNode, Vec<usize>> = HashMap::new();
    for (node, absorbed) in &eg.analysis.fusions {
        let node = TNode::new(
            node.op.clone(),
            node.children.iter().map(|&c| eg.find(c)).collect(),
        );
        if orig_set.contains(&node) {
            continue;
        }
        let e = fused.entry(node).or_default();
        for &a in absorbed {
            let a = t.index[&eg.find(a)];
            if !e.contains(&a) {
                e.push(a);
            }
        }
    }

    let mut shared: Vec<bool> = orig_users.iter().map(|&u| u >= 2).collect();
    for &r in &root_ix {
        shared[r] = true;
    }
    let mut is_root = vec![false; n];
    for &r in &root_ix {
        is_root[r] = true;
    }
    let mut refused: HashSet<(usize, usize)> = HashSet::new();
    let mut best: Option<(Vec<usize>, Vec<bool>, f64)> = None;
    let mut rounds = 0;
    let mut clean_rounds = 0;
    const MAX_ROUNDS: usize = 8;
    let max_iters = MAX_ROUNDS + fused.len() + 1;
    for it in 0..=max_iters {
        if it == max_iters {
            // Last resort: no fusion at all (always valid).
            for c in 0..n {
                for (k, node) in t.nodes(c).iter().enumerate() {
                    if fused.contains_key(node) {
                        refused.insert((c, k));
                    }
                }
            }
        }
        let (choice, total) = t.choose(&order, &shared, &refused);
        for &r in &t.roots {
            if !total[r].is_finite() {
                return Err(format!("no acyclic choice for root class {}", t.ids[r]));
            }
        }
        rounds += 1;
        let (reach, users) = t.dag(&choice);
        // Fusion check.
        let mut violations = Vec::new();
        for c in 0..n {
            if !reach[c] {
                continue;
            }
            let k = choice[c];
            if let Some(absorbed) = fused.get(&t.nodes(c)[k]) {
                if absorbed
                    .iter()
                    .any(|&a| a != c && reach[a] && !t.kids[c][k].contains(&a))
                {
                    violations.push((c, k));
                }
            }
        }
        let next: Vec<bool> = (0..n).map(|c| users[c] >= 2 || is_root[c]).collect();
        if !violations.is_empty() {
            refused.extend(violations);
            shared = next;
            continue;
        }
        let cost: f64 = (0..n)
            .filter(|&c| reach[c])
            .map(|c| t.own[c][choice[c]])
            .sum();
        clean_rounds += 1;
        if best.as_ref().is_none_or(|b| cost < b.2) {
            best = Some((choice, reach, cost));
        }
        if next == shared || clean_rounds >= MAX_ROUNDS {
            break;
        }
        shared = next;
    }
    let (choice, reach, cost) = best.ok_or("extraction found no valid choice")?;
    let map = (0..n)
        .filter(|&c| reach[c])
        .map(|c| (t.ids[c], t.nodes(c)[choice[c]].clone()))
        .collect();
    Ok(Extraction {
        choice: map,
        cost,
        rounds,
        refused: refused.len(),
    })
}
