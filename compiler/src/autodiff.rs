//! Reverse-mode automatic differentiation as a graph-to-graph transformation: [`grad`] appends the
//! backward ops to the graph (an ordinary graph that later passes optimize like any other). Each
//! op's rule lives beside the op in the ops crate (`rustytorch_ops::vjp`); this file only walks the
//! graph in reverse topological order, accumulates fan-out gradients, and checks what is asked.

use crate::graph::{Graph, NodeId};
use crate::{CompileError, Result};
use petgraph::stable_graph::NodeIndex;
use rustytorch_ops::{vjp, BinaryOp, F64Bits, GradBuilder, Op, TensorType, Value, VjpCtx};
use std::collections::{HashMap, HashSet};

struct Builder<'a>(&'a mut Graph);

impl GradBuilder for Builder<'_> {
    fn ty(&self, v: Value) -> TensorType {
        self.0.ty(NodeIndex::new(v)).clone()
    }
    fn emit(&mut self, op: Op, inputs: &[Value]) -> rustytorch_ops::Result<Value> {
        let ids: Vec<NodeId> = inputs.iter().map(|&v| NodeIndex::new(v)).collect();
        match self.0.add(op, &ids) {
            Ok(id) => Ok(id.index()),
            Err(CompileError::Op(e)) => Err(e),
            Err(e) => Err(rustytorch_ops::OpError::Runtime {
                op: "grad",
                reason: e.to_string(),
            }),
        }
    }
}

/// Appends to `graph` the gradient of the scalar float `loss` with respect to each of `wrt`
/// (parameters or inputs of float dtype) and returns the gradient nodes, in order. A `wrt` that
/// the loss does not depend on gets a zero gradient.
pub fn grad(graph: &mut Graph, loss: NodeId, wrt: &[NodeId]) -> Result<Vec<NodeId>> {
    let lt = loss_type(graph, loss)?;
    let one = graph.add(
        Op::Full {
            value: F64Bits::new(1.0),
            ty: lt,
        },
        &[],
    )?;
    grad_seeded(graph, loss, wrt, one)
}

/// [`grad`] with the loss's own gradient (the seed of the backward) given as the node `seed`, of
/// the loss's type: every gradient comes out multiplied by the seed's value. A training step
/// seeds with a node that loss scaling can replace (see [`crate::optim::scale_loss`]).
pub fn grad_seeded(
    graph: &mut Graph,
    loss: NodeId,
    wrt: &[NodeId],
    seed: NodeId,
) -> Result<Vec<NodeId>> {
    let lt = loss_type(graph, loss)?;
    let st = &graph.node(seed)?.ty;
    if *st != lt {
        return Err(CompileError::Grad(format!(
            "the seed of the backward must have the loss's type {lt}, got {st}"
        )));
    }
    for &w in wrt {
        let n = graph.node(w)?;
        let what = match &n.op {
            Op::Param { index, .. } => {
                let p = &graph.params[*index as usize];
                if !p.trainable {
                    return Err(CompileError::Grad(format!(
                        "parameter `{}` is not trainable (optimizer state or frozen)",
                        p.name
                    )));
                }
                p.name.clone()
            }
            Op::Input { index, .. } => graph.inputs[*index as usize].name.clone(),
            other => format!("node %{} ({})", w.index(), other.name()),
        };
        if !n.ty.dtype.is_float() {
            return Err(CompileError::Grad(format!(
                "`{what}` has dtype {}: only float tensors have gradients",
                n.ty.dtype
            )));
        }
    }

    // Nodes on a path from some wrt to the loss.
    let order = graph.topo_order()?;
    let mut from_wrt: HashSet<NodeId> = wrt.iter().copied().collect();
    for &n in &order {
        if graph.node(n)?.inputs.iter().any(|i| from_wrt.contains(i)) {
            from_wrt.insert(n);
        }
    }
    let mut to_loss: HashSet<NodeId> = HashSet::from([loss]);
    for &n in order.iter().rev() {
        if to_loss.contains(&n) {
            to_loss.extend(graph.node(n)?.inputs.iter().copied());
        }
    }
    let relevant = |n: &NodeId| from_wrt.contains(n) && to_loss.contains(n);

    let mut grads: HashMap<NodeId, NodeId> = HashMap::from([(loss, seed)]);

    let span = tracing::debug_span!("grad", nodes = order.len());
    let _e = span.enter();
    for &n in order.iter().rev() {
        if !relevant(&n) || wrt.contains(&n) && graph.node(n)?.inputs.is_empty() {
            continue;
        }
        let Some(&g) = grads.get(&n) else { continue };
        let node = graph.node(n)?.clone();
        if node.inputs.is_empty() || !node.inputs.iter().any(&relevant) {
            continue;
        }
        let ins: Vec<Value> = node.inputs.iter().map(|i| i.index()).collect();
        let mut b = Builder(graph);
        let mut cx = VjpCtx {
            b: &mut b,
            op: &node.op,
            inputs: &ins,
            output: n.index(),
            grad: g.index(),
        };
        let gs = vjp(&mut cx).map_err(CompileError::Op)?;
        for (k, gi) in gs.into_iter().enumerate() {
            let input = node.inputs[k];
            let Some(gi) = gi else { continue };
            if !relevant(&input) {
                continue;
            }
            let gi = NodeIndex::new(gi);
            let acc = match grads.get(&input) {
                Some(&prev) => graph.add(Op::Binary(BinaryOp::Add), &[prev, gi])?,
                None => gi,
            };
            grads.insert(input, acc);
        }
    }

    wrt.iter()
        .map(|w| match grads.get(w) {
            Some(&g) => Ok(g),
            None => {
                let ty = graph.ty(*w).clone();
                graph.add(
                    Op::Full {
                        value: F64Bits::new(0.0),
                        ty,
                    },
                    &[],
                )
            }
        })
        .collect()
}

/// The type of `loss`, which must be a float scalar.
fn loss_type(graph: &Graph, loss: NodeId) -> Result<TensorType> {
    let lt = graph.node(loss)?.ty.clone();
    if lt.shape.rank() != 0 || !lt.dtype.is_float() {
        return Err(CompileError::Grad(format!(
            "the loss must be a float scalar, got {lt}"
        )));
    }
    Ok(lt)
}
