//! Static statistics of a graph: an estimate of the floating-point operations one run performs.
//!
//! The counts follow the usual conventions (one multiply-add is two FLOPs):
//! - matmul (plain or with an epilogue): `2·M·N·K` per batch element;
//! - convolution: `2·N·O·(C/g)·prod(kernel)·prod(out spatial)`, and the same for its two
//!   gradients;
//! - attention: `2·B·H·Sq·Sk·(D + Dv)` (`4·B·H·Sq·Sk·D` when `Dv = D`); its gradient three such
//!   products;
//! - pooling: one per window element per output;
//! - elementwise ops and reductions: one per element (a fused kernel: one per instruction per
//!   element); softmax, norms and cross entropy a small constant per element;
//! - leaves, movement and indexing: none (they move memory, they do not compute).
//!
//! Only the nodes the graph's outputs and updates need are counted.

use rustytorch_compiler::Graph;
use rustytorch_ops::Op;

/// Estimated FLOPs of one run of `graph` (live nodes only; saturates instead of overflowing).
pub fn flops(graph: &Graph) -> u64 {
    graph
        .live_order()
        .into_iter()
        .map(|id| node_flops(graph, id))
        .fold(0u64, u64::saturating_add)
}

fn numel(dims: &[usize]) -> u64 {
    dims.iter().fold(1u64, |a, &d| a.saturating_mul(d as u64))
}

fn mul(xs: &[u64]) -> u64 {
    xs.iter().fold(1u64, |a, &x| a.saturating_mul(x))
}

/// Estimated FLOPs of one node.
pub fn node_flops(graph: &Graph, id: rustytorch_compiler::NodeId) -> u64 {
    let Ok(node) = graph.node(id) else {
        return 0;
    };
    let out = node.ty.shape.dims();
    let n_out = numel(out);
    let in_dims = |k: usize| -> &[usize] {
        node.inputs
            .get(k)
            .and_then(|&i| graph.node(i).ok())
            .map(|n| n.ty.shape.dims())
            .unwrap_or(&[])
    };
    match &node.op {
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Constant { .. }
        | Op::Full { .. }
        | Op::Iota { .. }
        | Op::RandUniform { .. }
        | Op::RandNormal { .. }
        | Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Expand { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Pad { .. }
        | Op::Gather { .. }
        | Op::IndexSelect { .. } => 0,
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } => n_out,
        // One addition per element per replica: counted as one, the share of this replica.
        Op::AllReduce { .. } => n_out,
        Op::Fused(k) => {
            let work = k
                .instrs
                .iter()
                .filter(|i| !matches!(i.op, Op::Full { .. }))
                .count() as u64;
            n_out.saturating_mul(work)
        }
        Op::Reduce { .. } | Op::ArgReduce { .. } => numel(in_dims(0)),
        // The prologue per input element, the row op as unfused, the epilogue per output element.
        Op::FusedRow(r) => {
            let work = |k: &Option<rustytorch_ops::FusedKernel>| {
                k.as_ref().map_or(0, |k| {
                    k.instrs
                        .iter()
                        .filter(|i| !matches!(i.op, Op::Full { .. }))
                        .count() as u64
                })
            };
            let n_in = r
                .prologue
                .as_ref()
                .map_or_else(|| numel(in_dims(0)), |k| k.out.shape.numel() as u64);
            let per = match &r.core {
                Op::LayerNorm { .. } => 7,
                Op::Softmax { .. } | Op::LogSoftmax { .. } | Op::RmsNorm { .. } => 4,
                _ => 1,
            };
            mul(&[n_in, work(&r.prologue) + per]).saturating_add(mul(&[n_out, work(&r.epilogue)]))
        }
        Op::Matmul { trans_a, .. }
        | Op::MatmulEpilogue { trans_a, .. }
        | Op::MatmulActGrad { trans_a, .. } => {
            let a = in_dims(0);
            let r = a.len();
            let k = match (r, trans_a) {
                (0, _) => 1,
                (1, _) => a[0],
                (_, false) => a[r - 1],
                (_, true) => a[r - 2],
            };
            2u64.saturating_mul(n_out).saturating_mul(k as u64)
        }
        Op::Conv { .. } => {
            // out [N, O, spatial...], w [O, C/g, kernel...]
            let w = in_dims(1);
            let per_out = numel(w.get(1..).unwrap_or(&[]));
            mul(&[2, n_out, per_out])
        }
        Op::ConvGradInput { .. } => {
            // grad_out [N, O, spatial...], w [O, C/g, kernel...]
            let w = in_dims(1);
            mul(&[2, numel(in_dims(0)), numel(w.get(1..).unwrap_or(&[]))])
        }
        Op::ConvGradWeight { weight_shape, .. } => {
            // x, grad_out [N, O, spatial...]; weight [O, C/g, kernel...]
            let w = weight_shape.dims();
            mul(&[2, numel(in_dims(1)), numel(w.get(1..).unwrap_or(&[]))])
        }
        Op::Pool { kernel, .. } => n_out.saturating_mul(numel(kernel)),
        Op::PoolGrad { kernel, .. } => numel(in_dims(1)).saturating_mul(numel(kernel)),
        Op::Attention { .. } => attention_flops(in_dims(0), in_dims(1), in_dims(2)),
        Op::AttentionGrad { .. } => {
            // Recompute the scores, then two more products of the same size.
            let f = attention_flops(in_dims(0), in_dims(1), in_dims(2));
            f.saturating_add(f / 2)
        }
        Op::Softmax { .. } | Op::LogSoftmax { .. } => n_out.saturating_mul(4),
        Op::LayerNorm { .. } => n_out.saturating_mul(7),
        Op::RmsNorm { .. } => n_out.saturating_mul(4),
        Op::ScatterAdd { .. } | Op::IndexAdd { .. } => numel(in_dims(2)),
        Op::CrossEntropy { .. } | Op::CrossEntropyGrad { .. } => {
            numel(in_dims(0)).saturating_mul(4)
        }
        // A multiply-add per nonzero (col_idx [nnz]) per dense column (x [_, n] or b [_, k]).
        Op::CumSum { .. } => n_out,
        // A comparison sort of each lane.
        Op::TopK { axis, .. } => {
            let n = in_dims(0).get(*axis).copied().unwrap_or(1).max(2) as u64;
            let lanes = numel(in_dims(0)) / n.max(1);
            mul(&[lanes, n, 64 - n.leading_zeros() as u64])
        }
        Op::SparseMatmul { .. } | Op::SampledMatmul => {
            let width = in_dims(3).get(1).copied().unwrap_or(1) as u64;
            mul(&[2, numel(in_dims(1)), width])
        }
    }
}

/// `2·B·H·Sq·Sk·(D + Dv)` from q [..., Sq, D], k [..., Sk, D], v [..., Sk, Dv].
fn attention_flops(q: &[usize], k: &[usize], v: &[usize]) -> u64 {
    if q.len() < 2 || k.len() < 2 || v.is_empty() {
        return 0;
    }
    let (sq, d) = (q[q.len() - 2] as u64, q[q.len() - 1] as u64);
    let sk = k[k.len() - 2] as u64;
    let dv = v[v.len() - 1] as u64;
    let batch = numel(&q[..q.len() - 2]);
    mul(&[2, batch, sq, sk, d.saturating_add(dv)])
}

/// Formats a count with an SI prefix: `1.23 M`, `45.6 G`.
pub fn si(n: u64) -> String {
    let units = ["", "K", "M", "G", "T", "P", "E"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < units.len() {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} ")
    } else {
        format!("{v:.3} {}", units[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustytorch_compiler::GraphBuilder;
    use rustytorch_ops::DType;

    #[test]
    fn matmul_and_elementwise() {
        let g = GraphBuilder::new();
        let x = g.input("x", DType::F32, [4, 16]);
        let w = g.input("w", DType::F32, [16, 32]);
        let y = x.matmul(&w).relu();
        g.output("y", &y);
        let graph = g.graph().unwrap();
        assert_eq!(flops(&graph), 2 * 4 * 32 * 16 + 4 * 32);
    }

    #[test]
    fn grouped_conv_and_attention() {
        use rustytorch_compiler::ConvOpts;
        use rustytorch_ops::Causal;
        let g = GraphBuilder::new();
        // x [2, 4, 8, 8], w [6, 2, 3, 3] with 2 groups, stride 1 -> out [2, 6, 6, 6].
        let x = g.input("x", DType::F32, [2, 4, 8, 8]);
        let w = g.input("w", DType::F32, [6, 2, 3, 3]);
        let y = x.conv(&w, None, &ConvOpts::default().groups(2));
        g.output("y", &y);
        let graph = g.graph().unwrap();
        assert_eq!(flops(&graph), 2 * 2 * 6 * 2 * 9 * 36);

        let g = GraphBuilder::new();
        let q = g.input("q", DType::F32, [1, 2, 5, 8]);
        let k = g.input("k", DType::F32, [1, 2, 7, 8]);
        let v = g.input("v", DType::F32, [1, 2, 7, 8]);
        let o = q.attention(&k, &v, None, Causal::None, None);
        g.output("o", &o);
        let graph = g.graph().unwrap();
        assert_eq!(flops(&graph), 4 * 2 * 5 * 7 * 8);
    }

    #[test]
    fn si_prefixes() {
        assert_eq!(si(12), "12 ");
        assert_eq!(si(1_234_000), "1.234 M");
    }
}
