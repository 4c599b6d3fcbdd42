//! The e-graph analysis: each e-class's [`TensorType`] (from the ops crate's inference) and, for
//! uniform constants (`full`), their value. Merging two classes of different types means a rule is
//! unsound; the conflict is recorded and `optimize` fails with it (and debug builds assert).
//!
//! The analysis also carries what the rules and the extractor share: the fused e-nodes the
//! recognition rules added with the intermediate values each one absorbs, and which graph
//! constants hold a causal (lower-triangular) bool mask.

use super::lang::TNode;
use egg::{Analysis, DidMerge, EGraph, Id};
use rustytorch_ops::{infer, Op, TensorType};
use std::collections::HashSet;

/// The e-graph type of the optimizer.
pub type EG = EGraph<TNode, TensorAnalysis>;

/// Per-class facts.
#[derive(Clone, Debug, PartialEq)]
pub struct Data {
    /// The class's type (`None` only if inference failed, which the rules never let happen).
    pub ty: Option<TensorType>,
    /// The value of a uniform constant (`full` of any shape).
    pub konst: Option<f64>,
}

/// The analysis state (see the module docs).
#[derive(Default, Debug)]
pub struct TensorAnalysis {
    /// Type conflicts found while merging classes (each one a rule bug).
    pub conflicts: Vec<String>,
    /// Fused e-nodes added by recognition rules, with the classes of the intermediate values each
    /// one computes internally (ids as they were when added; canonicalize with `find`).
    pub fusions: Vec<(TNode, Vec<Id>)>,
    /// Indices of graph constants that are causal masks: bool, lower-triangular over the last two
    /// dims (true where column <= row), the same for every leading index.
    pub causal_constants: HashSet<u32>,
    /// Indices of graph constants that are the complement: true exactly where column > row (the
    /// positions a causal mask drops, as `torch.triu(ones, 1)` spells them).
    pub causal_drop_constants: HashSet<u32>,
}

impl Analysis<TNode> for TensorAnalysis {
    type Data = Data;

    fn make(egraph: &mut EG, enode: &TNode) -> Data {
        let konst = match &enode.op {
            Op::Full { value, .. } => Some(value.get()),
            _ => None,
        };
        let mut tys = Vec::with_capacity(enode.children.len());
        for &c in &enode.children {
            match &egraph[c].data.ty {
                Some(t) => tys.push(t),
                None => return Data { ty: None, konst },
            }
        }
        Data {
            ty: infer(&enode.op, &tys).ok(),
            konst,
        }
    }

    fn merge(&mut self, a: &mut Data, b: Data) -> DidMerge {
        let mut changed_a = false;
        let mut changed_b = false;
        match (&a.ty, b.ty) {
            (Some(ta), Some(tb)) => {
                if *ta != tb {
                    self.conflicts.push(format!(
                        "a rule merged a value of type {ta} with one of type {tb}"
                    ));
                }
            }
            (None, Some(tb)) => {
                a.ty = Some(tb);
                changed_a = true;
            }
            (Some(_), None) => changed_b = true,
            (None, None) => {}
        }
        match (a.konst, b.konst) {
            (None, Some(v)) => {
                a.konst = Some(v);
                changed_a = true;
            }
            (Some(_), None) => changed_b = true,
            _ => {}
        }
        DidMerge(changed_a, changed_b)
    }
}
