//! Sums folded into matmuls: `add(c, matmul(a, b))` becomes one `matmul_epilogue` that adds `c`
//! before its one rounding (`accumulate`; cuBLASLt's C with beta 1, an f32 add in the CPU's
//! store), so no kernel reads the product back to add it.
//!
//! Two places in a transformer step have this shape: the residual adds of the forward
//! (`x + proj(attn)`, `x + mlp(x)`: the GEMM writes the residual stream directly), and the
//! gradients summed over several matmuls of one input (`dA = dq·Wqᵀ + dk·Wkᵀ + dv·Wvᵀ`: a chain
//! of GEMMs, each adding the one before, instead of three GEMMs and a three-operand kernel).
//!
//! A side of an `add` folds when it is a `matmul` or a `matmul_epilogue` with no activation and
//! no accumulated operand yet, the `add` is its only user and it is not a root (output, update or
//! guard), and both operands have the add's type (no broadcast, no cast between). The other
//! operand must not be an `expand`: as C it would be materialized at full size, where a kernel
//! reads it through its broadcast. When both sides fold, the later node accumulates onto the
//! earlier, so a chain `(m1 + m2) + m3` becomes `m3 += (m2 += m1)`. The `add` node itself
//! becomes the matmul (its id, users and names stay); the old matmul is then dead.
//!
//! The pass runs after autocast and the attention layout (their rewrites see plain matmuls) and
//! before fusion (which would otherwise take the add into an elementwise kernel).

use crate::graph::{Graph, NodeId};
use crate::Result;
use rustytorch_ops::{Activation, BinaryOp, Op};
use std::collections::HashSet;

/// What [`accumulate`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AccumulateReport {
    /// Adds folded into the matmul of one of their operands.
    pub folded: usize,
}

/// The matmul's flags `(trans_a, trans_b, bias)` when `op` can take an accumulated operand.
fn foldable(op: &Op) -> Option<(bool, bool, bool)> {
    match op {
        Op::Matmul { trans_a, trans_b } => Some((*trans_a, *trans_b, false)),
        Op::MatmulEpilogue {
            trans_a,
            trans_b,
            bias,
            act: Activation::None,
            accumulate: false,
        } => Some((*trans_a, *trans_b, *bias)),
        _ => None,
    }
}

/// Folds each eligible `add` into the matmul of one of its operands (see the module docs).
pub fn accumulate(g: &Graph) -> Result<(Graph, AccumulateReport)> {
    let mut out = g.clone();
    let mut report = AccumulateReport::default();
    let roots: HashSet<NodeId> = out.roots().into_iter().collect();
    for id in out.topo_order()? {
        let node = out.node(id)?;
        if node.op != Op::Binary(BinaryOp::Add) || node.inputs.len() != 2 {
            continue;
        }
        let (p, q) = (node.inputs[0], node.inputs[1]);
        if p == q {
            continue;
        }
        let ty = node.ty.clone();
        let eligible = |side: NodeId, other: NodeId| -> Result<Option<(bool, bool, bool)>> {
            let s = out.node(side)?;
            let Some(flags) = foldable(&s.op) else {
                return Ok(None);
            };
            let o = out.node(other)?;
            let ok = s.ty == ty
                && o.ty == ty
                && !matches!(o.op, Op::Expand { .. })
                && !roots.contains(&side)
                && out.users(side) == [id];
            Ok(ok.then_some(flags))
        };
        // The later operand accumulates onto the earlier one.
        let (late, early) = if p.index() > q.index() {
            (p, q)
        } else {
            (q, p)
        };
        let pick = match eligible(late, early)? {
            Some(f) => Some((late, early, f)),
            None => eligible(early, late)?.map(|f| (early, late, f)),
        };
        let Some((side, other, (trans_a, trans_b, bias))) = pick else {
            continue;
        };
        let mut inputs = out.node(side)?.inputs.clone();
        inputs.push(other);
        out.node_mut(id).expect("the add exists").op = Op::MatmulEpilogue {
            trans_a,
            trans_b,
            bias,
            act: Activation::None,
            accumulate: true,
        };
        out.set_inputs(id, inputs);
        report.folded += 1;
    }
    out.remove_dead();
    Ok((out, report))
}
