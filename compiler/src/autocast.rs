//! Mixed precision: the autocast pass runs the tensor-core ops of an f32 graph in bf16 or f16
//! and keeps everything else in f32, as `torch.autocast` does.
//!
//! # The rule
//!
//! Every matmul (plain, with its epilogue, or through an activation's derivative), attention and
//! attention gradient, convolution and convolution gradient whose result is f32 takes its float operands through a `cast` to the
//! low-precision type, runs there (f32 accumulation stays inside the kernels: cuBLASLt's compute
//! type, the flash kernel's f32 statistics), and its result goes back to f32 through a `cast`.
//! Normalizations, softmax, reductions, losses, elementwise ops and optimizer updates are left
//! in f32: their statistics and sums need the range and precision, and they are memory-bound,
//! so the tensor cores have nothing to offer them.
//!
//! Parameters stay f32 (the optimizer updates f32 master weights); a weight is cast once per run
//! however many ops read it (one cast node per value and type). A cast of a value that is itself
//! a widening cast of a low-precision value reads that value directly (`bf16 → f32 → bf16` is
//! exact), so chained tensor-core ops do not round-trip through f32. Fusion, which runs after
//! this pass, merges the remaining casts into the elementwise kernels around them.
//!
//! The pass runs after autodiff (on the whole training graph: the backward's matmuls and
//! attention gradients are rewritten like the forward's) and after the e-graph (whose patterns
//! — attention, matmul+bias+GELU — are spelled in f32 and must be recognized before the casts
//! come between their parts).
//!
//! f16 has a narrow range: with f16, gradients may overflow or flush to zero unless the loss is
//! scaled (the finiteness guards then skip a step with an infinite gradient); bf16 has f32's
//! range and needs no scaling.

use crate::graph::{Graph, NodeId};
use crate::{CompileError, Result};
use rustytorch_ops::{DType, Op};
use std::collections::HashMap;

/// What [`autocast`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AutocastReport {
    /// Ops now running in the low-precision type.
    pub ops: usize,
    /// Cast nodes added (operands and results).
    pub casts: usize,
}

/// Whether `op` runs on the tensor cores (and so in the low-precision type under autocast).
fn tensor_core_op(op: &Op) -> bool {
    matches!(
        op,
        Op::Matmul { .. }
            | Op::MatmulEpilogue { .. }
            | Op::MatmulActGrad { .. }
            | Op::Attention { .. }
            | Op::AttentionGrad { .. }
            | Op::Conv { .. }
            | Op::ConvGradInput { .. }
            | Op::ConvGradWeight { .. }
    )
}

/// Rewrites `graph`'s tensor-core ops to run in `to` (bf16 or f16); see the module docs.
pub fn autocast(graph: &Graph, to: DType) -> Result<(Graph, AutocastReport)> {
    if !matches!(to, DType::BF16 | DType::F16) {
        return Err(CompileError::Invalid(format!(
            "autocast runs in bf16 or f16, not {to:?}"
        )));
    }
    let mut g = graph.clone();
    let mut report = AutocastReport::default();
    // (value, type) -> its cast.
    let mut casts: HashMap<(NodeId, DType), NodeId> = HashMap::new();
    for id in graph.live_order() {
        // Operands as rewritten so far (a rewritten producer is read through its cast).
        let node = g.node(id)?.clone();
        if !tensor_core_op(&node.op) || g.ty(id).dtype != DType::F32 {
            continue;
        }
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for &x in &node.inputs {
            if g.ty(x).dtype != DType::F32 {
                // Bool masks and the like keep their type.
                inputs.push(x);
                continue;
            }
            let low = match casts.get(&(x, to)) {
                Some(&c) => c,
                None => {
                    // A widening cast of a `to` value: read the value itself.
                    let src = g.node(x)?;
                    let c = match (&src.op, src.inputs.first()) {
                        (Op::Cast { to: DType::F32 }, Some(&y)) if g.ty(y).dtype == to => y,
                        _ => {
                            report.casts += 1;
                            g.add(Op::Cast { to }, &[x])?
                        }
                    };
                    casts.insert((x, to), c);
                    c
                }
            };
            inputs.push(low);
        }
        let low = g.add(node.op.clone(), &inputs)?;
        let back = g.add(Op::Cast { to: DType::F32 }, &[low])?;
        if let Some(at) = graph.location(id) {
            g.set_location(low, at);
            g.set_location(back, at);
        }
        g.replace_uses(id, back);
        report.ops += 1;
        report.casts += 1;
    }
    g.remove_dead();
    Ok((g, report))
}
