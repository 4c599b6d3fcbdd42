//! The e-graph's language: an e-node is an [`Op`] (with its attributes) over child e-classes.
//!
//! The textual form of an e-node's operator is the op text of `rustytorch_ops::text` (`add`,
//! `matmul[trans_b]`, `reduce_sum[axes=2,keep]`, `softmax[axis=3]`,
//! `input[index=0,ty=f32:2:3]`), shared with the IR printer; the rule files and the rule tests
//! write s-expressions over it. For tests, leaves also have a short form: `in0:f32:2:3`
//! (input 0), `p1:f32:8` (parameter 1), `c0:bool:4:4` (constant 0), `0.5:f32` (a `full`; a bare
//! number such as `0.5` is an f32 scalar). Leaves carry their table index and type, so distinct
//! inputs never merge.
//!
//! Patterns may end an op name with `*` (`reduce_max*`, `matmul*`, `permute*`): that matches the
//! op with any attributes (same op kind and arity); rules read the matched attributes back from
//! the e-graph (see `rules::Ctx`). A wildcard never appears in an e-graph, only in patterns.

use egg::{FromOp, Id, Language};
use rustytorch_ops::{
    Activation, ArgKind, AttnMask, Causal, ConvGeom, DType, F64Bits, Op, PoolKind, ReduceKind,
    Reduction, Shape, TensorType,
};
use std::fmt;
/// An e-node: an op with its attributes over child e-classes.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TNode {
    /// The op (for a wildcard, its attributes are placeholders).
    pub op: Op,
    /// Operand e-classes, in order.
    pub children: Vec<Id>,
    /// Pattern-only: match any attributes of this op kind.
    pub(crate) wild: bool,
}

impl TNode {
    /// An e-node.
    pub fn new(op: Op, children: Vec<Id>) -> TNode {
        TNode {
            op,
            children,
            wild: false,
        }
    }
}

/// The op kind a wildcard pattern node matches: the variant and, for unary, binary and
/// reductions, which function it computes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct OpKind(std::mem::Discriminant<Op>, u8);

/// The kind of an op.
pub fn op_kind(op: &Op) -> OpKind {
    let sub = match op {
        Op::Unary(u) => *u as u8,
        Op::Binary(b) => *b as u8,
        Op::Reduce { kind, .. } => *kind as u8,
        Op::ArgReduce { kind, .. } => *kind as u8,
        _ => 0,
    };
    OpKind(std::mem::discriminant(op), sub)
}

impl Language for TNode {
    type Discriminant = OpKind;

    fn discriminant(&self) -> OpKind {
        op_kind(&self.op)
    }

    fn matches(&self, other: &Self) -> bool {
        self.children.len() == other.children.len()
            && if self.wild || other.wild {
                op_kind(&self.op) == op_kind(&other.op)
            } else {
                self.op == other.op
            }
    }

    fn children(&self) -> &[Id] {
        &self.children
    }

    fn children_mut(&mut self) -> &mut [Id] {
        &mut self.children
    }
}

impl fmt::Display for TNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.wild {
            write!(f, "{}*", self.op.name())
        } else {
            write!(f, "{}", self.op)
        }
    }
}

impl FromOp for TNode {
    type Error = String;

    fn from_op(text: &str, children: Vec<Id>) -> Result<TNode, String> {
        let (text, wild) = match text.strip_suffix('*') {
            Some(t) => (t, true),
            None => (text, false),
        };
        let op = if wild {
            placeholder(text).ok_or_else(|| format!("unknown op `{text}*`"))?
        } else {
            parse_leaf(text)?.map_or_else(|| text.parse::<Op>().map_err(|e| e.to_string()), Ok)?
        };
        if op.is_leaf() && !children.is_empty() {
            return Err(format!("`{text}` is a leaf and takes no operands"));
        }
        Ok(TNode { op, children, wild })
    }
}

/// Parses the short leaf forms of the module docs (`None` if `text` is not one).
fn parse_leaf(text: &str) -> Result<Option<Op>, String> {
    let f32_scalar = || TensorType::new(DType::F32, Shape::scalar());
    if let Some(v) = rustytorch_ops::text::parse_f64(text) {
        return Ok(Some(Op::Full {
            value: v,
            ty: f32_scalar(),
        }));
    }
    let Some((head, ty)) = text.split_once(':') else {
        return Ok(None);
    };
    if head.contains('[') {
        return Ok(None);
    }
    let mut parts = ty.split(':');
    let dtype = parts
        .next()
        .and_then(DType::from_name)
        .ok_or_else(|| format!("bad type in `{text}`"))?;
    let dims = parts
        .map(|d| d.parse::<usize>())
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| format!("bad dims in `{text}`"))?;
    let ty = TensorType::new(dtype, dims);
    let index = |p: &str| {
        head[p.len()..]
            .parse::<u32>()
            .map_err(|_| format!("bad leaf `{text}`"))
    };
    let op = if let Some(value) = rustytorch_ops::text::parse_f64(head) {
        Op::Full { value, ty }
    } else if head.starts_with("in") {
        Op::Input {
            index: index("in")?,
            ty,
        }
    } else if head.starts_with('p') {
        Op::Param {
            index: index("p")?,
            ty,
        }
    } else if head.starts_with('c') {
        Op::Constant {
            index: index("c")?,
            ty,
        }
    } else {
        return Err(format!("bad leaf `{text}`"));
    };
    Ok(Some(op))
}

/// An op of the given name with placeholder attributes (the operator of a wildcard node).
pub fn placeholder(name: &str) -> Option<Op> {
    if let Ok(op) = name.parse::<Op>() {
        return Some(op);
    }
    let ty = TensorType::new(DType::F32, Shape::scalar());
    let f = F64Bits::new(0.0);
    let geom = ConvGeom {
        stride: vec![],
        padding: vec![],
        dilation: vec![],
    };
    let reduce = |kind| Op::Reduce {
        kind,
        axes: vec![],
        keep_dims: false,
    };
    let samples = [
        Op::Input {
            index: 0,
            ty: ty.clone(),
        },
        Op::Param {
            index: 0,
            ty: ty.clone(),
        },
        Op::Constant {
            index: 0,
            ty: ty.clone(),
        },
        Op::Full {
            value: f,
            ty: ty.clone(),
        },
        Op::Iota {
            axis: 0,
            ty: ty.clone(),
        },
        Op::RandUniform {
            low: f,
            high: f,
            seed: 0,
            ty: ty.clone(),
        },
        Op::RandNormal {
            mean: f,
            std: f,
            seed: 0,
            ty: ty.clone(),
        },
        Op::Cast { to: DType::F32 },
        reduce(ReduceKind::Sum),
        reduce(ReduceKind::Mean),
        reduce(ReduceKind::Max),
        reduce(ReduceKind::Min),
        reduce(ReduceKind::Prod),
        reduce(ReduceKind::Any),
        reduce(ReduceKind::All),
        Op::ArgReduce {
            kind: ArgKind::ArgMax,
            axis: 0,
            keep_dims: false,
        },
        Op::ArgReduce {
            kind: ArgKind::ArgMin,
            axis: 0,
            keep_dims: false,
        },
        Op::Matmul {
            trans_a: false,
            trans_b: false,
        },
        Op::MatmulEpilogue {
            trans_a: false,
            trans_b: false,
            bias: false,
            act: Activation::None,
        },
        Op::Reshape {
            shape: Shape::scalar(),
        },
        Op::Permute { perm: vec![] },
        Op::Expand {
            shape: Shape::scalar(),
        },
        Op::Slice {
            starts: vec![],
            ends: vec![],
            steps: vec![],
        },
        Op::Concat { axis: 0 },
        Op::Pad {
            pads: vec![],
            value: f,
        },
        Op::Softmax { axis: 0 },
        Op::LogSoftmax { axis: 0 },
        Op::LayerNorm {
            eps: f,
            weight: false,
            bias: false,
        },
        Op::RmsNorm {
            eps: f,
            weight: false,
        },
        Op::Gather { axis: 0 },
        Op::ScatterAdd { axis: 0 },
        Op::IndexSelect { axis: 0 },
        Op::IndexAdd { axis: 0 },
        Op::Conv {
            geom: geom.clone(),
            groups: 1,
            bias: false,
        },
        Op::ConvGradInput {
            geom: geom.clone(),
            groups: 1,
            input_shape: Shape::scalar(),
        },
        Op::ConvGradWeight {
            geom: geom.clone(),
            groups: 1,
            weight_shape: Shape::scalar(),
        },
        Op::Pool {
            kind: PoolKind::Max,
            kernel: vec![],
            geom: geom.clone(),
        },
        Op::PoolGrad {
            kind: PoolKind::Max,
            kernel: vec![],
            geom,
        },
        Op::Attention {
            causal: Causal::None,
            mask: AttnMask::None,
            scale: f,
        },
        Op::AttentionGrad {
            causal: Causal::None,
            mask: AttnMask::None,
            scale: f,
            wrt: 0,
        },
        Op::CrossEntropy {
            reduction: Reduction::Mean,
            ignore_index: 0,
        },
        Op::CrossEntropyGrad {
            reduction: Reduction::Mean,
            ignore_index: 0,
        },
    ];
    samples.into_iter().find(|op| op.name() == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use egg::RecExpr;

    #[test]
    fn text_round_trips() {
        for t in [
            "(add in0:f32:2:3 0.5)",
            "(softmax[axis=1] (matmul[trans_b] p0:f32:2:3 p1:f32:4:3))",
            "(reduce_sum[axes=1,keep] c0:f32:2:3)",
        ] {
            let e: RecExpr<TNode> = t.parse().unwrap();
            let back: RecExpr<TNode> = e.to_string().parse().unwrap();
            assert_eq!(e, back, "{t} printed as {e}");
        }
        assert!("(reduce_sum in0:f32:2)".parse::<RecExpr<TNode>>().is_err());
        assert!("(reduce_sum* in0:f32:2)".parse::<RecExpr<TNode>>().is_ok());
        assert!("(in0:f32:2 in1:f32:2)".parse::<RecExpr<TNode>>().is_err());
    }
}
