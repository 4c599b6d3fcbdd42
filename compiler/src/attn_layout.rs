//! Attention in place: a model splits a linear layer's output `[B, S, H·D]` into heads with
//! `reshape [B, S, H, D]` then `permute [0, 2, 1, 3]`, runs attention on `[B, H, S, D]`, and
//! undoes the transpose on the result. Each of those transposes is a full copy of an activation
//! (four per attention forward, four more per gradient), while a kernel that takes its rows'
//! stride reads the heads where they lie. On a target whose attention reads the `[B, S, H, D]`
//! layout ([`rustytorch_ops::AttnLayout::Bshd`]), this pass rewrites
//!
//! ```text
//! attention(permute(q'), permute(k'), permute(v'), [mask])          (each permute [0,2,1,3])
//!   ⇒ permute(attention[bshd](q', k', v', [mask]))
//! ```
//!
//! and the same for `attention_grad` (whose `grad_out` must be transposed too), then cancels
//! the transposes that meet: `permute(permute(x))` is `x` when the two undo each other, also
//! across a `cast` between them (autocast's casts around attention). So a block written the
//! usual way runs its attention with no transpose at all, forward and backward.
//!
//! It applies only when every `[B, H, S, D]` operand is such a transpose (a cast of one counts):
//! otherwise it would trade the copies it removes for copies it adds. The mask keeps its
//! `[B, H, Sq, Sk]` broadcast in both layouts. The pass runs after autocast (which places the
//! casts it looks through) and before fusion (so the casts it moves still fuse).

use crate::graph::{Graph, NodeId};
use crate::Result;
use rustytorch_ops::{AttnLayout, Op};
use std::collections::HashMap;

/// The transpose between `[B, S, H, D]` and `[B, H, S, D]` (its own inverse).
const SWAP: [usize; 4] = [0, 2, 1, 3];

/// What the pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttnLayoutReport {
    /// Attention and attention-gradient ops now in the `[B, S, H, D]` layout.
    pub rewritten: usize,
    /// Transposes removed (each a copy of an activation).
    pub transposes_removed: usize,
}

fn is_swap(op: &Op) -> bool {
    matches!(op, Op::Permute { perm } if perm[..] == SWAP)
}

/// The `[B, S, H, D]` tensor an operand transposes (`permute(x)` or `cast(permute(x))`): the
/// node, and the cast to apply to it.
fn untransposed(g: &Graph, v: NodeId) -> Option<(NodeId, Option<Op>)> {
    let n = g.node(v).ok()?;
    if is_swap(&n.op) {
        return Some((n.inputs[0], None));
    }
    if let Op::Cast { .. } = n.op {
        let inner = g.node(n.inputs[0]).ok()?;
        if is_swap(&inner.op) {
            return Some((inner.inputs[0], Some(n.op.clone())));
        }
    }
    None
}

/// `x` with `cast` applied: one cast node per (tensor, cast), however many ops read it (an
/// attention and its three gradients read the same operands).
fn cast_of(
    g: &mut Graph,
    casts: &mut HashMap<(NodeId, Op), NodeId>,
    x: NodeId,
    cast: Option<Op>,
) -> Result<NodeId> {
    let Some(c) = cast else { return Ok(x) };
    if let Some(&n) = casts.get(&(x, c.clone())) {
        return Ok(n);
    }
    let n = g.add(c.clone(), &[x])?;
    casts.insert((x, c), n);
    Ok(n)
}

/// Rewrites attention over transposed heads into the `[B, S, H, D]` layout (see the module
/// docs); attention gradients too when `grads`.
pub fn attention_layout(graph: &Graph, grads: bool) -> Result<(Graph, AttnLayoutReport)> {
    let mut g = graph.clone();
    let mut report = AttnLayoutReport::default();
    let before = count_swaps(&g);
    let mut casts = HashMap::new();
    for id in g.topo_order()? {
        let node = g.node(id)?.clone();
        let is_grad = match &node.op {
            Op::Attention {
                layout: AttnLayout::Bhsd,
                ..
            } => false,
            Op::AttentionGrad {
                layout: AttnLayout::Bhsd,
                ..
            } if grads => true,
            _ => continue,
        };
        // q, k, v and (for a gradient) grad_out; the mask stays as it is.
        let mut operands = vec![0, 1, 2];
        if is_grad {
            operands.push(node.inputs.len() - 1);
        }
        let found: Vec<Option<(NodeId, Option<Op>)>> = operands
            .iter()
            .map(|&i| untransposed(&g, node.inputs[i]))
            .collect();
        if found.iter().any(Option::is_none) {
            continue;
        }
        let mut inputs = node.inputs.clone();
        for (&i, f) in operands.iter().zip(found) {
            let (x, cast) = f.expect("checked above");
            inputs[i] = cast_of(&mut g, &mut casts, x, cast)?;
        }
        let a = g.add(node.op.with_attn_layout(AttnLayout::Bshd), &inputs)?;
        if let Some(at) = g.location(id) {
            g.set_location(a, at);
        }
        let back = g.add(
            Op::Permute {
                perm: SWAP.to_vec(),
            },
            &[a],
        )?;
        g.replace_uses(id, back);
        report.rewritten += 1;
    }
    if report.rewritten > 0 {
        cancel_transposes(&mut g, &mut casts)?;
        g.remove_dead();
    }
    report.transposes_removed = before.saturating_sub(count_swaps(&g));
    Ok((g, report))
}

/// Live `permute [0,2,1,3]` nodes.
fn count_swaps(g: &Graph) -> usize {
    g.live_order()
        .into_iter()
        .filter(|&n| g.node(n).is_ok_and(|n| is_swap(&n.op)))
        .count()
}

/// `permute(permute(x))` ⇒ `x` and `permute(cast(permute(x)))` ⇒ `cast(x)` for the swap.
fn cancel_transposes(g: &mut Graph, casts: &mut HashMap<(NodeId, Op), NodeId>) -> Result<()> {
    for id in g.topo_order()? {
        let node = g.node(id)?.clone();
        if !is_swap(&node.op) {
            continue;
        }
        let Some((x, cast)) = untransposed(g, node.inputs[0]) else {
            continue;
        };
        let new = cast_of(g, casts, x, cast)?;
        g.replace_uses(id, new);
    }
    Ok(())
}
