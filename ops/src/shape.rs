//! Shapes, broadcasting (the one place its rules live), tensor types, and the size limits every
//! tensor and size-like attribute obeys.
//!
//! The limits make shape arithmetic total: a shape within [`MAX_RANK`] and [`MAX_ELEMENTS`]
//! (zero-sized dims counted as one) has strides and byte counts that fit in a `usize`, and an
//! attribute within [`MAX_ATTR`] can be added to or multiplied by a dim without overflowing 64
//! bits. [`crate::infer`] checks every op against [`check_op_limits`] before inferring and every
//! result against [`check_type_limits`] after, so no graph, however it was made (builder, IR text,
//! graph file), describes a tensor the runtime could not even count.

use crate::{DType, Op, OpError, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Largest rank of a tensor, and largest length of a per-dim attribute list.
pub const MAX_RANK: usize = 64;

/// Largest number of elements of one tensor: 2^40 (4 TiB of f32), counting zero-sized dims as one
/// so that the strides of an empty tensor cannot overflow either.
pub const MAX_ELEMENTS: usize = 1 << 40;

/// Largest size-like attribute (axis, stride, padding, dilation, kernel, slice bound, pad,
/// groups): no attribute may exceed the largest tensor.
pub const MAX_ATTR: usize = MAX_ELEMENTS;

/// How deeply ops may nest inside fused kernels' programs.
pub const MAX_FUSED_DEPTH: usize = 4;

/// A concrete tensor shape (row-major; rank 0 is a scalar).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    /// A shape from its dims.
    pub fn new(dims: impl Into<Vec<usize>>) -> Shape {
        Shape(dims.into())
    }

    /// The rank-0 shape.
    pub fn scalar() -> Shape {
        Shape(Vec::new())
    }

    /// The dims.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// Number of dims.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Number of elements (1 for a scalar). Saturates at `usize::MAX` for shapes beyond the
    /// limits, which no inferred type has; use [`Shape::try_numel`] on untrusted shapes.
    pub fn numel(&self) -> usize {
        self.try_numel().unwrap_or(usize::MAX)
    }

    /// Number of elements, or `None` when the product overflows.
    pub fn try_numel(&self) -> Option<usize> {
        self.0.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
    }

    /// Checks the shape against [`MAX_RANK`] and [`MAX_ELEMENTS`] (zero dims counted as one, with
    /// checked arithmetic); returns the number of elements or what is wrong.
    pub fn check_limits(&self) -> std::result::Result<usize, String> {
        if self.rank() > MAX_RANK {
            return Err(format!("rank {} is over {MAX_RANK}", self.rank()));
        }
        let mut extent = 1usize;
        for &d in &self.0 {
            extent = extent
                .checked_mul(d.max(1))
                .filter(|&n| n <= MAX_ELEMENTS)
                .ok_or_else(|| {
                    format!(
                        "{} is too large (over {MAX_ELEMENTS} elements)",
                        short(self)
                    )
                })?;
        }
        Ok(self.numel())
    }

    /// Row-major contiguous strides, in elements (saturating, so shapes beyond the limits give
    /// meaningless strides rather than a panic).
    pub fn strides(&self) -> Vec<usize> {
        let mut s = vec![1usize; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1].saturating_mul(self.0[i + 1]);
        }
        s
    }

    /// Numpy-style broadcast of two shapes, or `None` when they are incompatible.
    pub fn broadcast(a: &Shape, b: &Shape) -> Option<Shape> {
        let r = a.rank().max(b.rank());
        let mut out = vec![0; r];
        for i in 0..r {
            let da = if i + a.rank() >= r {
                a.0[i + a.rank() - r]
            } else {
                1
            };
            let db = if i + b.rank() >= r {
                b.0[i + b.rank() - r]
            } else {
                1
            };
            out[i] = if da == db {
                da
            } else if da == 1 {
                db
            } else if db == 1 {
                da
            } else {
                return None;
            };
        }
        Some(Shape(out))
    }

    /// Whether `self` broadcasts to `target` (numpy rules, one direction).
    pub fn broadcasts_to(&self, target: &Shape) -> bool {
        if self.rank() > target.rank() {
            return false;
        }
        let off = target.rank() - self.rank();
        self.0
            .iter()
            .enumerate()
            .all(|(i, &d)| d == 1 || d == target.0[i + off])
    }

    /// Strides to read `self` as if broadcast to `target`: 0 on broadcast dims.
    /// The caller must have checked [`Shape::broadcasts_to`].
    pub fn broadcast_strides(&self, target: &Shape) -> Vec<usize> {
        let own = self.strides();
        let off = target.rank() - self.rank();
        (0..target.rank())
            .map(|i| {
                if i < off || self.0[i - off] == 1 {
                    0
                } else {
                    own[i - off]
                }
            })
            .collect()
    }

    /// Normalizes a possibly negative axis against this rank.
    pub fn axis(&self, axis: i64) -> Option<usize> {
        normalize_axis(axis, self.rank())
    }
}

/// Normalizes a possibly negative axis against `rank`.
pub fn normalize_axis(axis: i64, rank: usize) -> Option<usize> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    (0..r).contains(&a).then_some(a as usize)
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(d: [usize; N]) -> Shape {
        Shape(d.to_vec())
    }
}

impl From<Vec<usize>> for Shape {
    fn from(d: Vec<usize>) -> Shape {
        Shape(d)
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Shape {
        Shape(d.to_vec())
    }
}

/// A tensor's dtype and shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Shape,
}

impl TensorType {
    /// A tensor type.
    pub fn new(dtype: DType, shape: impl Into<Shape>) -> TensorType {
        TensorType {
            dtype,
            shape: shape.into(),
        }
    }

    /// Bytes of a contiguous tensor of this type (saturating; exact within the limits).
    pub fn size_bytes(&self) -> usize {
        self.shape.numel().saturating_mul(self.dtype.size_bytes())
    }

    /// Bytes of a contiguous tensor of this type, or `None` when the count overflows.
    pub fn try_size_bytes(&self) -> Option<usize> {
        self.shape.try_numel()?.checked_mul(self.dtype.size_bytes())
    }
}

/// Checks a type that `op` declares or produces against the size limits; the error names the op.
pub fn check_type_limits(op: &Op, ty: &TensorType) -> Result<()> {
    ty.shape
        .check_limits()
        .map(|_| ())
        .map_err(|e| OpError::Attribute {
            op: op.name(),
            reason: format!("type {}: {e}", ty.dtype),
        })
}

/// Checks the result type of `op` over `inputs` against the size limits.
pub fn check_result_limits(op: &Op, inputs: &[&TensorType], ty: &TensorType) -> Result<()> {
    ty.shape
        .check_limits()
        .map(|_| ())
        .map_err(|e| OpError::Shape {
            op: op.name(),
            inputs: inputs.iter().map(|t| (*t).clone()).collect(),
            reason: format!("the result {}: {e}", ty.dtype),
        })
}

/// A shape for messages: at most eight dims, then an ellipsis and the rank.
fn short(s: &Shape) -> String {
    if s.rank() <= 8 {
        return s.to_string();
    }
    let head: Vec<String> = s.0[..8].iter().map(|d| d.to_string()).collect();
    format!("[{},...] (rank {})", head.join(","), s.rank())
}

/// Checks every size-like attribute of `op` (lists of at most [`MAX_RANK`] entries, values at
/// most [`MAX_ATTR`]) and every shape it carries (within [`MAX_RANK`] and [`MAX_ELEMENTS`]), so
/// that inference's arithmetic stays in range; fused programs are checked instruction by
/// instruction, at most [`MAX_FUSED_DEPTH`] deep.
pub fn check_op_limits(op: &Op) -> Result<()> {
    check_op_at(op, op, 0)
}

fn check_op_at(top: &Op, op: &Op, depth: usize) -> Result<()> {
    let err = |reason: String| OpError::Attribute {
        op: top.name(),
        reason,
    };
    let ints = |what: &str, v: &[usize]| -> Result<()> {
        if v.len() > MAX_RANK {
            return Err(err(format!(
                "{what} has {} entries, over {MAX_RANK}",
                v.len()
            )));
        }
        match v.iter().find(|&&x| x > MAX_ATTR) {
            Some(x) => Err(err(format!(
                "{what} value {x} is too large (over {MAX_ATTR})"
            ))),
            None => Ok(()),
        }
    };
    let geom = |g: &crate::ConvGeom| -> Result<()> {
        ints("stride", &g.stride)?;
        ints("padding", &g.padding)?;
        ints("dilation", &g.dilation)
    };
    let shape = |s: &Shape| {
        s.check_limits()
            .map(|_| ())
            .map_err(|e| err(format!("shape attribute {}: {e}", short(s))))
    };
    match op {
        Op::Input { ty, .. }
        | Op::Param { ty, .. }
        | Op::Constant { ty, .. }
        | Op::Full { ty, .. }
        | Op::RandUniform { ty, .. }
        | Op::RandNormal { ty, .. } => check_type_limits(top, ty),
        Op::Iota { axis, ty } => {
            ints("axis", &[*axis])?;
            check_type_limits(top, ty)
        }
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } | Op::Matmul { .. } => Ok(()),
        Op::MatmulEpilogue { .. } | Op::Attention { .. } | Op::AttentionGrad { .. } => Ok(()),
        Op::MatmulActGrad { .. } => Ok(()),
        Op::CrossEntropy { .. } | Op::CrossEntropyGrad { .. } => Ok(()),
        Op::SampledMatmul | Op::AllReduce { .. } => Ok(()),
        Op::SparseMatmul { rows, cols, .. } => ints("rows/cols", &[*rows, *cols]),
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => Ok(()),
        Op::Reduce { axes, .. } => ints("axes", axes),
        Op::Permute { perm } => ints("perm", perm),
        Op::TopK { axis, k, .. } => ints("axis/k", &[*axis, *k]),
        Op::ArgReduce { axis, .. }
        | Op::CumSum { axis, .. }
        | Op::Concat { axis }
        | Op::Softmax { axis }
        | Op::LogSoftmax { axis }
        | Op::Gather { axis }
        | Op::ScatterAdd { axis }
        | Op::IndexSelect { axis }
        | Op::IndexAdd { axis } => ints("axis", &[*axis]),
        Op::Reshape { shape: s } | Op::Expand { shape: s } => shape(s),
        Op::Slice {
            starts,
            ends,
            steps,
        } => {
            ints("starts", starts)?;
            ints("ends", ends)?;
            ints("steps", steps)
        }
        Op::Pad { pads, .. } => {
            if pads.len() > MAX_RANK {
                return Err(err(format!(
                    "pads has {} entries, over {MAX_RANK}",
                    pads.len()
                )));
            }
            let flat: Vec<usize> = pads.iter().flat_map(|&(a, b)| [a, b]).collect();
            ints("pads", &flat)
        }
        Op::Conv {
            geom: g, groups, ..
        } => {
            geom(g)?;
            ints("groups", &[*groups])
        }
        Op::ConvGradInput {
            geom: g,
            groups,
            input_shape: s,
        }
        | Op::ConvGradWeight {
            geom: g,
            groups,
            weight_shape: s,
        } => {
            geom(g)?;
            ints("groups", &[*groups])?;
            shape(s)
        }
        Op::Pool {
            kernel, geom: g, ..
        }
        | Op::PoolGrad {
            kernel, geom: g, ..
        } => {
            ints("kernel", kernel)?;
            geom(g)
        }
        Op::Fused(k) => {
            if depth >= MAX_FUSED_DEPTH {
                return Err(err("fused kernels nested too deeply".into()));
            }
            check_type_limits(top, &k.out)?;
            if k.instrs.len() > MAX_ATTR {
                return Err(err(format!("{} instructions are too many", k.instrs.len())));
            }
            for ins in &k.instrs {
                check_op_at(top, &ins.op, depth + 1)?;
            }
            Ok(())
        }
        Op::FusedRow(r) => {
            if depth >= MAX_FUSED_DEPTH {
                return Err(err("fused kernels nested too deeply".into()));
            }
            check_op_at(top, &r.core, depth + 1)?;
            for k in r.prologue.iter().chain(&r.epilogue) {
                check_op_at(top, &Op::Fused(Box::new(k.clone())), depth + 1)?;
            }
            Ok(())
        }
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_rules() {
        let s = |d: &[usize]| Shape(d.to_vec());
        assert_eq!(Shape::broadcast(&s(&[3, 1]), &s(&[4])), Some(s(&[3, 4])));
        assert_eq!(Shape::broadcast(&s(&[]), &s(&[2, 3])), Some(s(&[2, 3])));
        assert_eq!(Shape::broadcast(&s(&[0, 1]), &s(&[1, 5])), Some(s(&[0, 5])));
        assert_eq!(Shape::broadcast(&s(&[2, 3]), &s(&[3, 2])), None);
        assert_eq!(s(&[3, 1]).broadcast_strides(&s(&[2, 3, 4])), vec![0, 1, 0]);
        assert!(!s(&[2]).broadcasts_to(&s(&[3])));
    }
}
