//! Packed q, k and v: GPT-2 and most decoders compute q, k and v with one linear layer
//! (`c_attn`, `[B, S, 3·H·D]`) and slice it into three. Each slice is a copy of a third of the
//! activation, and in training the three gradients come back as three zero pads summed into
//! the layer's gradient: another full copy and a sum. Attention reads the heads where they lie
//! instead. After [`crate::attn_layout`] has moved attention to the `[B, S, H, D]` layout, this
//! pass rewrites
//!
//! ```text
//! attention[bshd](reshape(slice₀(p)), reshape(slice₁(p)), reshape(slice₂(p)), [mask])
//!   ⇒ attention[packed](p', p', p', [mask])         p' = reshape(p) : [B, S, 3, H, D]
//! ```
//!
//! (a cast that autocast put on all three operands moves onto `p'`), and the three
//! gradients of such an attention into one `attention_grad[packed]` whose result is
//! `[B, S, 3, H, D]`: dq, dk and dv where q, k and v lie. Each old gradient becomes a slice of
//! that result, and a sum of the three gradients' zero pads back to `[B, S, 3·H·D]` (what
//! autodiff makes of the slices) becomes the packed result itself, so a training step runs the
//! layer's weight and input gradients on it with no copy between.
//!
//! It applies where the target's attention kernels read packed operands: f16 or bf16 after the
//! casts, head sizes that are multiples of 16 up to [`MAX_PACKED_HEAD`] (the CUDA flash
//! kernels' range, which the CUDA lowering checks again).

use crate::graph::{Graph, NodeId};
use crate::plan::through_reshapes;
use crate::Result;
use rustytorch_ops::{AttnLayout, DType, Op, Shape, ATTN_WRT_PACKED};
use std::collections::HashMap;

/// The largest head size packed (the CUDA flash kernels' `MAX_HEAD`).
pub const MAX_PACKED_HEAD: usize = 128;

/// What the pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttnPackedReport {
    /// Attention ops now reading packed q, k and v.
    pub packed: usize,
    /// Attention gradients now one packed op each (three ops before).
    pub gradients: usize,
    /// Sums of the three gradients' pads replaced by the packed gradient.
    pub sums_removed: usize,
}

/// Operand `v` of a `[B, S, H, D]` attention as part `j` of a packed tensor: `v` is
/// `reshape(slice(p))` (or a cast of it) where `p` is `[B, S, 3·H·D]` and the slice takes
/// columns `[j·H·D, (j + 1)·H·D)`. Returns `p`, `j` and the cast.
fn packed_part(g: &Graph, v: NodeId) -> Option<(NodeId, usize, Option<Op>)> {
    let mut n = g.node(v).ok()?;
    let mut cast = None;
    if let Op::Cast { .. } = n.op {
        cast = Some(n.op.clone());
        n = g.node(n.inputs[0]).ok()?;
    }
    let Op::Reshape { shape } = &n.op else {
        return None;
    };
    let &[b, s, h, d] = shape.dims() else {
        return None;
    };
    let sl = g.node(n.inputs[0]).ok()?;
    let Op::Slice {
        starts,
        ends,
        steps,
    } = &sl.op
    else {
        return None;
    };
    let p = sl.inputs[0];
    let width = h * d;
    if g.ty(p).shape.dims() != [b, s, 3 * width]
        || steps.iter().any(|&x| x != 1)
        || starts[..2] != [0, 0]
        || ends[..2] != [b, s]
        || !starts[2].is_multiple_of(width.max(1))
        || ends[2] != starts[2] + width
    {
        return None;
    }
    Some((p, starts[2] / width.max(1), cast))
}

/// Whether the target's kernels take packed operands of this type and head size.
fn packable(dtype: DType, d: usize) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
        && d > 0
        && d.is_multiple_of(16)
        && d <= MAX_PACKED_HEAD
}

/// The packed tensor `p'` (`[B, S, 3, H, D]`, cast as q, k and v were) of an attention's
/// operands, when they are the three parts of one tensor in order.
fn packed_operand(
    g: &mut Graph,
    made: &mut HashMap<(NodeId, Option<Op>), NodeId>,
    node: NodeId,
) -> Result<Option<NodeId>> {
    let n = g.node(node)?.clone();
    let parts: Vec<_> = n.inputs[..3].iter().map(|&v| packed_part(g, v)).collect();
    let Some(Some((p, 0, cast))) = parts.first().cloned() else {
        return Ok(None);
    };
    let in_order = parts.iter().enumerate().all(|(j, x)| {
        x.as_ref()
            .is_some_and(|x| x.0 == p && x.1 == j && x.2 == cast)
    });
    let qd = g.ty(n.inputs[0]).shape.dims().to_vec();
    if !in_order || !packable(g.ty(n.inputs[0]).dtype, qd[3]) {
        return Ok(None);
    }
    if let Some(&x) = made.get(&(p, cast.clone())) {
        return Ok(Some(x));
    }
    let five = g.add(
        Op::Reshape {
            shape: Shape::new([qd[0], qd[1], 3, qd[2], qd[3]]),
        },
        &[p],
    )?;
    let x = match &cast {
        Some(c) => g.add(c.clone(), &[five])?,
        None => five,
    };
    made.insert((p, cast), x);
    Ok(Some(x))
}

/// Rewrites attention (and, when `grads`, its gradients) over the three parts of one tensor
/// to read them packed (see the module docs).
pub fn attention_packed(graph: &Graph, grads: bool) -> Result<(Graph, AttnPackedReport)> {
    let mut g = graph.clone();
    let mut report = AttnPackedReport::default();
    let mut made = HashMap::new();
    // One packed gradient per (packed operand, op, mask, dO).
    let mut grad_of: HashMap<(NodeId, Op, Vec<NodeId>), NodeId> = HashMap::new();
    for id in g.topo_order()? {
        let node = g.node(id)?.clone();
        let is_grad = match &node.op {
            Op::Attention {
                layout: AttnLayout::Bshd,
                ..
            } => false,
            Op::AttentionGrad {
                layout: AttnLayout::Bshd,
                wrt: 0..=2,
                ..
            } if grads => true,
            _ => continue,
        };
        let Some(p) = packed_operand(&mut g, &mut made, id)? else {
            continue;
        };
        let mut inputs = vec![p, p, p];
        inputs.extend(&node.inputs[3..]);
        let new = if is_grad {
            let Op::AttentionGrad {
                causal,
                mask,
                scale,
                wrt,
                ..
            } = node.op
            else {
                unreachable!("matched above")
            };
            let op = Op::AttentionGrad {
                causal,
                mask,
                scale,
                wrt: ATTN_WRT_PACKED,
                layout: AttnLayout::Packed,
            };
            let key = (p, op.clone(), node.inputs[3..].to_vec());
            let all = match grad_of.get(&key) {
                Some(&x) => x,
                None => {
                    let x = g.add(op, &inputs)?;
                    if let Some(at) = g.location(id) {
                        g.set_location(x, at);
                    }
                    grad_of.insert(key, x);
                    report.gradients += 1;
                    x
                }
            };
            // This operand's gradient: its part of the packed one.
            let d5 = g.ty(all).shape.dims().to_vec();
            let mut starts = vec![0; 5];
            let mut ends = d5.clone();
            starts[2] = wrt as usize;
            ends[2] = wrt as usize + 1;
            let part = g.add(
                Op::Slice {
                    starts,
                    ends,
                    steps: vec![1; 5],
                },
                &[all],
            )?;
            g.add(
                Op::Reshape {
                    shape: node.ty.shape.clone(),
                },
                &[part],
            )?
        } else {
            let x = g.add(node.op.with_attn_layout(AttnLayout::Packed), &inputs)?;
            if let Some(at) = g.location(id) {
                g.set_location(x, at);
            }
            report.packed += 1;
            x
        };
        g.replace_uses(id, new);
    }
    if report.gradients > 0 {
        report.sums_removed = reassemble(&mut g)?;
    }
    if report.packed + report.gradients > 0 {
        g.remove_dead();
    }
    Ok((g, report))
}

/// A leaf of a gradient sum as part `j` of a packed gradient `G` (`[B, S, 3, H, D]`):
/// `pad(reshape…(slice(G)))`, zeros around the part's columns of `[B, S, 3·H·D]`, possibly with
/// a widening cast among the reshapes (autocast's f32 gradient of a bf16 attention). Returns `G`,
/// `j` and whether the leaf is cast.
fn padded_part(g: &Graph, leaf: NodeId) -> Option<(NodeId, usize, bool)> {
    let n = g.node(leaf).ok()?;
    let Op::Pad { pads, value } = &n.op else {
        return None;
    };
    if value.get() != 0.0 {
        return None;
    }
    let mut x = through_reshapes(g, n.inputs[0]).ok()?;
    let mut cast = false;
    if let Op::Cast { .. } = g.node(x).ok()?.op {
        cast = true;
        x = through_reshapes(g, g.node(x).ok()?.inputs[0]).ok()?;
    }
    let sl = g.node(x).ok()?;
    let Op::Slice { starts, ends, .. } = &sl.op else {
        return None;
    };
    let all = sl.inputs[0];
    let an = g.node(all).ok()?;
    if !matches!(
        an.op,
        Op::AttentionGrad {
            layout: AttnLayout::Packed,
            ..
        }
    ) {
        return None;
    }
    if cast && !widens(an.ty.dtype, n.ty.dtype) {
        return None;
    }
    let d5 = an.ty.shape.dims();
    let j = starts[2];
    let width = d5[3] * d5[4];
    let want_pads = [(0, 0), (0, 0), (j * width, (2 - j) * width)];
    let want_slice = starts
        .iter()
        .enumerate()
        .all(|(i, &s)| if i == 2 { s == j } else { s == 0 })
        && ends
            .iter()
            .enumerate()
            .all(|(i, &e)| if i == 2 { e == j + 1 } else { e == d5[i] });
    (n.ty.shape.dims() == [d5[0], d5[1], 3 * width] && pads[..] == want_pads && want_slice)
        .then_some((all, j, cast))
}

/// Whether every `from` value converts to `to` and back unchanged (f16/bf16 to f32 or f64, f32
/// to f64).
fn widens(from: DType, to: DType) -> bool {
    matches!(
        (from, to),
        (DType::F16 | DType::BF16, DType::F32 | DType::F64) | (DType::F32, DType::F64)
    )
}

/// Points the readers of `wide` (a widening cast of `narrow`, or reshapes of it) that cast it
/// back to `narrow`'s type at `narrow` itself (reshaped): the round trip is exact.
fn narrow_back(g: &mut Graph, wide: NodeId, narrow: NodeId) -> Result<()> {
    let dtype = g.ty(narrow).dtype;
    let mut frontier = vec![wide];
    while let Some(v) = frontier.pop() {
        for u in g.users(v) {
            let un = g.node(u)?.clone();
            match un.op {
                Op::Reshape { .. } => frontier.push(u),
                Op::Cast { to } if to == dtype => {
                    let r = g.add(
                        Op::Reshape {
                            shape: un.ty.shape.clone(),
                        },
                        &[narrow],
                    )?;
                    g.replace_uses(u, r);
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// Replaces each sum of the three padded parts of one packed gradient (plus any other terms)
/// by the packed gradient reshaped (plus those terms). Returns how many sums it replaced.
fn reassemble(g: &mut Graph) -> Result<usize> {
    let roots = g.roots();
    let mut replaced = 0;
    for id in g.topo_order()? {
        let node = g.node(id)?.clone();
        if !matches!(node.op, Op::Binary(rustytorch_ops::BinaryOp::Add)) {
            continue;
        }
        // The sum's terms: nested adds of its type that only it reads.
        let mut leaves = vec![];
        let mut stack = node.inputs.clone();
        while let Some(x) = stack.pop() {
            let n = g.node(x)?;
            let inner = matches!(n.op, Op::Binary(rustytorch_ops::BinaryOp::Add))
                && n.ty == node.ty
                && g.users(x).len() == 1
                && !roots.contains(&x);
            if inner {
                stack.extend(n.inputs.iter().copied());
            } else {
                leaves.push(x);
            }
        }
        if leaves.iter().any(|&l| g.ty(l) != &node.ty) {
            continue;
        }
        let parts: Vec<Option<(NodeId, usize, bool)>> =
            leaves.iter().map(|&l| padded_part(g, l)).collect();
        let Some((all, _, cast)) = parts.iter().flatten().copied().next() else {
            continue;
        };
        let mine: Vec<usize> = (0..leaves.len())
            .filter(|&i| parts[i].is_some_and(|x| x.0 == all && x.2 == cast))
            .collect();
        let mut js: Vec<usize> = mine.iter().map(|&i| parts[i].expect("kept").1).collect();
        js.sort();
        if js != [0, 1, 2] {
            continue;
        }
        let base = g.add(
            Op::Reshape {
                shape: node.ty.shape.clone(),
            },
            &[all],
        )?;
        let wide = if cast {
            g.add(Op::Cast { to: node.ty.dtype }, &[base])?
        } else {
            base
        };
        let mut sum = wide;
        for (i, &l) in leaves.iter().enumerate() {
            if !mine.contains(&i) {
                sum = g.add(node.op.clone(), &[sum, l])?;
            }
        }
        g.replace_uses(id, sum);
        if cast && sum == wide {
            // Autocast's casts back to the attention's type read the packed gradient itself.
            narrow_back(g, wide, base)?;
        }
        replaced += 1;
    }
    Ok(replaced)
}
