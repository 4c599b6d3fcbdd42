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
use rustytorch_ops::text::REDUCE_KINDS;
use rustytorch_ops::{ArgKind, DType, Op, Shape, TensorType};
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

/// An op of the given name with placeholder attributes (the operator of a wildcard node): the
/// op itself when the name parses without attributes, else the sample of its variant from
/// [`Op::samples`], with the reduction or arg kind the name selects. Only the op kind of a
/// wildcard is ever compared, so the sample's attributes never matter.
pub fn placeholder(name: &str) -> Option<Op> {
    if let Ok(op) = name.parse::<Op>() {
        return Some(op);
    }
    Op::samples()
        .into_iter()
        .flat_map(|(op, _)| match op {
            Op::Reduce {
                axes, keep_dims, ..
            } => REDUCE_KINDS
                .map(|kind| Op::Reduce {
                    kind,
                    axes: axes.clone(),
                    keep_dims,
                })
                .to_vec(),
            Op::ArgReduce {
                axis, keep_dims, ..
            } => [ArgKind::ArgMax, ArgKind::ArgMin]
                .map(|kind| Op::ArgReduce {
                    kind,
                    axis,
                    keep_dims,
                })
                .to_vec(),
            op => vec![op],
        })
        .find(|op| op.name() == name)
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

    #[test]
    fn every_op_name_has_a_wildcard() {
        use rustytorch_ops::text::{BINARY_OPS, UNARY_OPS};
        let mut ops: Vec<Op> = Op::samples().into_iter().map(|(op, _)| op).collect();
        ops.extend(UNARY_OPS.map(Op::Unary));
        ops.extend(BINARY_OPS.map(Op::Binary));
        ops.extend(REDUCE_KINDS.map(|kind| Op::Reduce {
            kind,
            axes: vec![0],
            keep_dims: false,
        }));
        ops.extend(
            [ArgKind::ArgMax, ArgKind::ArgMin].map(|kind| Op::ArgReduce {
                kind,
                axis: 0,
                keep_dims: false,
            }),
        );
        for op in ops {
            let name = op.name();
            let wild = placeholder(name).unwrap_or_else(|| panic!("no wildcard for `{name}`"));
            assert_eq!(wild.name(), name);
            assert_eq!(op_kind(&wild), op_kind(&op), "{name}");
            let pattern = if op.is_leaf() {
                format!("{name}*")
            } else {
                format!("({name}* ?x)")
            };
            pattern
                .parse::<egg::Pattern<TNode>>()
                .unwrap_or_else(|e| panic!("{pattern}: {e}"));
        }
        assert!(placeholder("nosuchop").is_none());
    }
}
