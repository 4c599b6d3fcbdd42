//! The interface gradient rules are written against. Each op family's `vjp` (in its own file)
//! receives a [`VjpCtx`] and emits the ops of its vector-Jacobian product through it; the compiler's
//! autodiff implements [`GradBuilder`] over its graph.

use crate::{
    BinaryOp, DType, F64Bits, Op, OpError, ReduceKind, Result, Shape, TensorType, UnaryOp,
};

/// A value in the graph being built (a node id).
pub type Value = usize;

/// What a gradient rule may do with the graph: read types and add ops.
pub trait GradBuilder {
    /// The type of a value.
    fn ty(&self, v: Value) -> TensorType;
    /// Adds an op over `inputs`, with shape inference; returns its value.
    fn emit(&mut self, op: Op, inputs: &[Value]) -> Result<Value>;
}

/// The arguments of one op's vector-Jacobian product, with helpers for common spellings.
pub struct VjpCtx<'a> {
    /// The graph under construction.
    pub b: &'a mut dyn GradBuilder,
    /// The forward op.
    pub op: &'a Op,
    /// Its inputs.
    pub inputs: &'a [Value],
    /// Its output.
    pub output: Value,
    /// The gradient flowing into its output.
    pub grad: Value,
}

impl VjpCtx<'_> {
    /// Type of a value.
    pub fn ty(&self, v: Value) -> TensorType {
        self.b.ty(v)
    }
    /// Emits an op.
    pub fn emit(&mut self, op: Op, inputs: &[Value]) -> Result<Value> {
        self.b.emit(op, inputs)
    }
    /// A scalar constant of `dtype`.
    pub fn scalar(&mut self, value: f64, dtype: DType) -> Result<Value> {
        self.emit(
            Op::Full {
                value: F64Bits::new(value),
                ty: TensorType::new(dtype, Shape::scalar()),
            },
            &[],
        )
    }
    /// `op(x)`.
    pub fn unary(&mut self, op: UnaryOp, x: Value) -> Result<Value> {
        self.emit(Op::Unary(op), &[x])
    }
    /// `op(a, b)` with broadcasting.
    pub fn binary(&mut self, op: BinaryOp, a: Value, b: Value) -> Result<Value> {
        self.emit(Op::Binary(op), &[a, b])
    }
    /// a + b
    pub fn add(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::Add, a, b)
    }
    /// a - b
    pub fn sub(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::Sub, a, b)
    }
    /// a · b
    pub fn mul(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::Mul, a, b)
    }
    /// a / b
    pub fn div(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::Div, a, b)
    }
    /// a · c for a float constant c (in a's dtype).
    pub fn mul_scalar(&mut self, a: Value, c: f64) -> Result<Value> {
        let d = self.ty(a).dtype;
        let s = self.scalar(c, d)?;
        self.mul(a, s)
    }
    /// Cast to a dtype (no-op when equal).
    pub fn cast(&mut self, x: Value, to: DType) -> Result<Value> {
        if self.ty(x).dtype == to {
            return Ok(x);
        }
        self.emit(Op::Cast { to }, &[x])
    }
    /// Sum over axes.
    pub fn sum(&mut self, x: Value, axes: Vec<usize>, keep_dims: bool) -> Result<Value> {
        if axes.is_empty() {
            return Ok(x);
        }
        self.emit(
            Op::Reduce {
                kind: ReduceKind::Sum,
                axes,
                keep_dims,
            },
            &[x],
        )
    }
    /// Reshape (no-op when the shape is already `shape`).
    pub fn reshape(&mut self, x: Value, shape: Shape) -> Result<Value> {
        if self.ty(x).shape == shape {
            return Ok(x);
        }
        self.emit(Op::Reshape { shape }, &[x])
    }
    /// Broadcast to `shape` (no-op when equal).
    pub fn expand(&mut self, x: Value, shape: Shape) -> Result<Value> {
        if self.ty(x).shape == shape {
            return Ok(x);
        }
        self.emit(Op::Expand { shape }, &[x])
    }
    /// Undoes broadcasting: sums `g` down to `shape` (the shape of the input that was broadcast).
    pub fn sum_to(&mut self, g: Value, shape: &Shape) -> Result<Value> {
        let gs = self.ty(g).shape;
        if &gs == shape {
            return Ok(g);
        }
        let off = gs.rank() - shape.rank();
        let axes: Vec<usize> = (0..gs.rank())
            .filter(|&i| i < off || (shape.dims()[i - off] == 1 && gs.dims()[i] != 1))
            .collect();
        let s = self.sum(g, axes, true)?;
        self.reshape(s, shape.clone())
    }
    /// The error for a non-differentiable input.
    pub fn not_differentiable(&self, input: usize, reason: &str) -> OpError {
        OpError::NotDifferentiable {
            op: self.op.name(),
            input,
            reason: reason.to_string(),
        }
    }
}
