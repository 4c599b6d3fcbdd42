//! Shapes, broadcasting (the one place its rules live) and tensor types.

use crate::DType;
use serde::{Deserialize, Serialize};
use std::fmt;

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

    /// Number of elements (1 for a scalar).
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }

    /// Row-major contiguous strides, in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut s = vec![1usize; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1] * self.0[i + 1];
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

    /// Bytes of a contiguous tensor of this type.
    pub fn size_bytes(&self) -> usize {
        self.shape.numel() * self.dtype.size_bytes()
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
