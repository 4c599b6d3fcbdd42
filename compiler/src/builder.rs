//! The builder API: lazy [`Tensor`] handles that record ops into a shared graph, so that
//! `x.matmul(&w).add(&b).gelu()` reads like PyTorch but only builds IR.
//!
//! Errors surface where the user made them: an op whose inputs do not fit records a
//! [`CompileError::Build`] carrying the caller's `file:line:column` and the op, shapes and dtypes;
//! the handle it returns is poisoned (later ops on it record nothing new), and the first error is
//! returned by [`GraphBuilder::graph`], [`GraphBuilder::check`] and everything that compiles or
//! saves the graph. This keeps chains free of `?` while never losing an error.

use crate::dims::DimExpr;
use crate::graph::{Graph, Init, NodeId};
use crate::{CompileError, Result};
use rustytorch_ops::{
    normalize_axis, Activation, ArgKind, AttnLayout, AttnMask, BinaryOp, Causal, ConvGeom, DType,
    F64Bits, HostTensor, Op, OpError, PoolKind, ReduceKind, Reduction, Shape, TensorType, UnaryOp,
};
use std::cell::RefCell;
use std::panic::Location;
use std::rc::Rc;

struct Inner {
    graph: RefCell<Graph>,
    error: RefCell<Option<CompileError>>,
    seed: RefCell<u64>,
}

/// Records a graph through [`Tensor`] handles. Cheap to clone (shared).
#[derive(Clone)]
pub struct GraphBuilder {
    inner: Rc<Inner>,
}

/// A lazy tensor: a node of a [`GraphBuilder`]'s graph.
#[derive(Clone)]
pub struct Tensor {
    b: GraphBuilder,
    id: Option<NodeId>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.id {
            Some(id) => write!(f, "Tensor(%{}: {})", id.index(), self.ty_or_unknown()),
            None => write!(f, "Tensor(<error>)"),
        }
    }
}

impl Default for GraphBuilder {
    fn default() -> Self {
        GraphBuilder::new()
    }
}

fn loc(l: &Location<'_>) -> String {
    format!("{}:{}:{}", l.file(), l.line(), l.column())
}

/// Options of a convolution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConvOpts {
    /// Stride per spatial dim (one value is repeated).
    pub stride: Vec<usize>,
    /// Zero padding per spatial dim (one value is repeated).
    pub padding: Vec<usize>,
    /// Dilation per spatial dim (one value is repeated).
    pub dilation: Vec<usize>,
    /// Groups.
    pub groups: usize,
}

impl Default for ConvOpts {
    fn default() -> Self {
        ConvOpts {
            stride: vec![1],
            padding: vec![0],
            dilation: vec![1],
            groups: 1,
        }
    }
}

impl ConvOpts {
    /// Sets the stride.
    pub fn stride(mut self, s: &[usize]) -> Self {
        self.stride = s.to_vec();
        self
    }
    /// Sets the padding.
    pub fn padding(mut self, p: &[usize]) -> Self {
        self.padding = p.to_vec();
        self
    }
    /// Sets the dilation.
    pub fn dilation(mut self, d: &[usize]) -> Self {
        self.dilation = d.to_vec();
        self
    }
    /// Sets the groups.
    pub fn groups(mut self, g: usize) -> Self {
        self.groups = g;
        self
    }
}

fn per_dim(v: &[usize], n: usize) -> Vec<usize> {
    if v.len() == 1 {
        vec![v[0]; n]
    } else {
        v.to_vec()
    }
}

impl GraphBuilder {
    /// A new, empty graph.
    pub fn new() -> GraphBuilder {
        GraphBuilder {
            inner: Rc::new(Inner {
                graph: RefCell::new(Graph::new()),
                error: RefCell::new(None),
                seed: RefCell::new(0x5eed),
            }),
        }
    }

    /// Wraps an existing graph (loaded from a file, say) to extend it.
    pub fn from_graph(graph: Graph) -> GraphBuilder {
        let b = GraphBuilder::new();
        *b.inner.graph.borrow_mut() = graph;
        b
    }

    fn record(&self, e: CompileError) {
        tracing::debug!("graph build error: {e}");
        let mut slot = self.inner.error.borrow_mut();
        if slot.is_none() {
            *slot = Some(e);
        }
    }

    /// Records where a new node was built (for run-time anomaly reports).
    fn located(&self, r: Result<NodeId>, at: &'static Location<'static>) -> Result<NodeId> {
        if let Ok(id) = r {
            self.inner.graph.borrow_mut().set_location(id, at);
        }
        r
    }

    fn wrap(&self, r: Result<NodeId>, at: &Location<'_>) -> Tensor {
        match r {
            Ok(id) => Tensor {
                b: self.clone(),
                id: Some(id),
            },
            Err(e) => {
                let e = match e {
                    CompileError::Op(source) => CompileError::Build {
                        location: loc(at),
                        source,
                    },
                    other => other,
                };
                self.record(e);
                Tensor {
                    b: self.clone(),
                    id: None,
                }
            }
        }
    }

    /// Wraps a node id of this builder's graph as a handle.
    pub fn tensor(&self, id: NodeId) -> Tensor {
        Tensor {
            b: self.clone(),
            id: Some(id),
        }
    }

    /// Applies any op to handles (the general form behind every method).
    #[track_caller]
    pub fn apply(&self, op: Op, inputs: &[&Tensor]) -> Tensor {
        let at = Location::caller();
        let mut ids = Vec::with_capacity(inputs.len());
        for t in inputs {
            if !Rc::ptr_eq(&t.b.inner, &self.inner) {
                self.record(CompileError::Build {
                    location: loc(at),
                    source: OpError::Runtime {
                        op: op.name(),
                        reason: "operands belong to different graphs".into(),
                    },
                });
                return Tensor {
                    b: self.clone(),
                    id: None,
                };
            }
            match t.id {
                Some(id) => ids.push(id),
                None => {
                    return Tensor {
                        b: self.clone(),
                        id: None,
                    }
                }
            }
        }
        let r = {
            let mut g = self.inner.graph.borrow_mut();
            let r = g.add(op, &ids);
            if let Ok(id) = r {
                g.derive_sym_shape(id);
            }
            r
        };
        let r = self.located(r, at);
        self.wrap(r, at)
    }

    /// Declares the named dim `name` with its default size, the size the graph is built at;
    /// use it in [`GraphBuilder::input_dims`]. An executable of the graph runs at any size
    /// (see [`crate::dims`]). Distinct default sizes for distinct names let reshapes that split
    /// a product of names tell them apart.
    #[track_caller]
    pub fn dim(&self, name: &str, size: usize) -> DimExpr {
        let at = Location::caller();
        let r = self.inner.graph.borrow_mut().declare_dim(name, size);
        match r {
            Ok(d) => d,
            Err(e) => {
                self.wrap(Err(e), at);
                DimExpr::named(name)
            }
        }
    }

    /// A generated leaf (`full`, `iota`) whose shape is given as expressions of named dims, so
    /// that it follows them when the graph runs at other sizes.
    #[track_caller]
    fn leaf_dims(&self, dims: &[DimExpr], op: impl FnOnce(Shape) -> Op) -> Tensor {
        let at = Location::caller();
        let shape = self.inner.graph.borrow().eval_dims(dims);
        let t = match shape {
            Ok(shape) => self.apply(op(shape), &[]),
            Err(e) => return self.wrap(Err(e), at),
        };
        match t.id {
            Some(id) => {
                let r = self
                    .inner
                    .graph
                    .borrow_mut()
                    .set_sym_shape(id, dims.to_vec())
                    .map(|_| id);
                self.wrap(r, at)
            }
            None => t,
        }
    }

    /// A tensor of one value whose dims may be named (`[seq, seq]` for a mask).
    #[track_caller]
    pub fn full_dims(&self, value: f64, dtype: DType, dims: &[DimExpr]) -> Tensor {
        self.leaf_dims(dims, |shape| Op::Full {
            value: F64Bits::new(value),
            ty: TensorType::new(dtype, shape),
        })
    }

    /// Indices along `axis` whose dims may be named.
    #[track_caller]
    pub fn iota_dims(&self, axis: usize, dtype: DType, dims: &[DimExpr]) -> Tensor {
        self.leaf_dims(dims, |shape| Op::Iota {
            axis,
            ty: TensorType::new(dtype, shape),
        })
    }

    /// Declares a named input whose dims may be named: `g.input_dims("x", DType::F32,
    /// &[batch, 1.into(), 8.into(), 8.into()])` with `let batch = g.dim("batch", 16)`.
    #[track_caller]
    pub fn input_dims(&self, name: &str, dtype: DType, dims: &[DimExpr]) -> Tensor {
        let at = Location::caller();
        let r = self
            .inner
            .graph
            .borrow_mut()
            .add_input_dims(name, dtype, dims);
        let r = self.located(r, at);
        self.wrap(r, at)
    }

    /// Declares a named input.
    #[track_caller]
    pub fn input(&self, name: &str, dtype: DType, shape: impl Into<Shape>) -> Tensor {
        let at = Location::caller();
        let r = self
            .inner
            .graph
            .borrow_mut()
            .add_input(name, TensorType::new(dtype, shape));
        let r = self.located(r, at);
        self.wrap(r, at)
    }

    /// Declares a trainable f32 parameter.
    #[track_caller]
    pub fn param(&self, name: &str, shape: impl Into<Shape>, init: Init) -> Tensor {
        self.param_typed(name, TensorType::new(DType::F32, shape), init, true)
    }

    /// Declares a parameter of any type; `trainable: false` makes it persistent state (optimizer
    /// moments, counters) that gradients are never taken for.
    #[track_caller]
    pub fn param_typed(&self, name: &str, ty: TensorType, init: Init, trainable: bool) -> Tensor {
        let at = Location::caller();
        let r = self
            .inner
            .graph
            .borrow_mut()
            .add_param(name, ty, init, trainable);
        let r = self.located(r, at);
        self.wrap(r, at)
    }

    /// A fresh seed for an initializer (deterministic in declaration order).
    pub fn next_seed(&self) -> u64 {
        let mut s = self.inner.seed.borrow_mut();
        *s = rustytorch_ops::rng::mix64(*s);
        *s
    }

    /// A constant tensor.
    pub fn constant(&self, value: HostTensor) -> Tensor {
        let id = self.inner.graph.borrow_mut().add_constant(value);
        self.tensor(id)
    }

    /// A rank-0 constant.
    #[track_caller]
    pub fn scalar(&self, value: f64, dtype: DType) -> Tensor {
        self.full(value, TensorType::new(dtype, Shape::scalar()))
    }

    /// A tensor of one value.
    #[track_caller]
    pub fn full(&self, value: f64, ty: TensorType) -> Tensor {
        self.apply(
            Op::Full {
                value: F64Bits::new(value),
                ty,
            },
            &[],
        )
    }

    /// Indices along `axis`.
    #[track_caller]
    pub fn iota(&self, axis: usize, ty: TensorType) -> Tensor {
        self.apply(Op::Iota { axis, ty }, &[])
    }

    /// Seeded uniform random values.
    #[track_caller]
    pub fn rand_uniform(&self, low: f64, high: f64, seed: u64, ty: TensorType) -> Tensor {
        self.apply(
            Op::RandUniform {
                low: low.into(),
                high: high.into(),
                seed,
                ty,
            },
            &[],
        )
    }

    /// Seeded normal random values.
    #[track_caller]
    pub fn rand_normal(&self, mean: f64, std: f64, seed: u64, ty: TensorType) -> Tensor {
        self.apply(
            Op::RandNormal {
                mean: mean.into(),
                std: std.into(),
                seed,
                ty,
            },
            &[],
        )
    }

    /// Concatenation along `axis` (negative counts from the end).
    #[track_caller]
    pub fn concat(&self, parts: &[&Tensor], axis: i64) -> Tensor {
        let rank = parts.first().and_then(|p| p.rank()).unwrap_or(0);
        match normalize_axis(axis, rank) {
            Some(axis) => self.apply(Op::Concat { axis }, parts),
            None => self.bad_axis("concat", axis, rank),
        }
    }

    /// `cond ? a : b`.
    #[track_caller]
    pub fn where_(&self, cond: &Tensor, a: &Tensor, b: &Tensor) -> Tensor {
        self.apply(Op::Where, &[cond, a, b])
    }

    /// Marks a tensor as a named output.
    #[track_caller]
    pub fn output(&self, name: &str, t: &Tensor) {
        let at = Location::caller();
        if let Some(id) = t.id {
            let r = self
                .inner
                .graph
                .borrow_mut()
                .add_output(name, id)
                .map(|_| id);
            self.wrap(r, at);
        }
    }

    /// Records `param ← value` to run after each execution (optimizer updates).
    #[track_caller]
    pub fn update(&self, param: &Tensor, value: &Tensor) {
        let at = Location::caller();
        let (Some(p), Some(v)) = (param.id, value.id) else {
            return;
        };
        let r = (|| {
            let mut g = self.inner.graph.borrow_mut();
            let Op::Param { index, .. } = g.node(p)?.op else {
                return Err(CompileError::Invalid(
                    "update target is not a parameter".into(),
                ));
            };
            if g.ty(p) != g.ty(v) {
                return Err(CompileError::Invalid(format!(
                    "update of a {} parameter with a {} value",
                    g.ty(p),
                    g.ty(v)
                )));
            }
            g.updates.retain(|(i, _)| *i != index);
            g.updates.push((index, v));
            Ok(v)
        })();
        self.wrap(r, at);
    }

    /// The first recorded error, if any.
    pub fn check(&self) -> Result<()> {
        match self.inner.error.borrow().as_ref() {
            None => Ok(()),
            // Build errors keep their variant (location, op error); others are reported as text.
            Some(CompileError::Build { location, source }) => Err(CompileError::Build {
                location: location.clone(),
                source: source.clone(),
            }),
            Some(e) => Err(CompileError::Invalid(e.to_string())),
        }
    }

    /// A copy of the graph, or the first error recorded while building it.
    pub fn graph(&self) -> Result<Graph> {
        self.check()?;
        Ok(self.inner.graph.borrow().clone())
    }

    /// Runs `f` on the graph being built (for passes such as autodiff that extend it).
    pub fn with_graph<R>(&self, f: impl FnOnce(&mut Graph) -> R) -> R {
        f(&mut self.inner.graph.borrow_mut())
    }

    #[track_caller]
    fn bad_axis(&self, op: &'static str, axis: i64, rank: usize) -> Tensor {
        let at = Location::caller();
        self.wrap(
            Err(CompileError::Op(OpError::Attribute {
                op,
                reason: format!("axis {axis} is out of range for rank {rank}"),
            })),
            at,
        )
    }
}

macro_rules! unary_methods {
    ($($(#[$m:meta])* $name:ident => $op:ident),* $(,)?) => {
        $( $(#[$m])* #[track_caller] pub fn $name(&self) -> Tensor { self.b.apply(Op::Unary(UnaryOp::$op), &[self]) } )*
    };
}

macro_rules! binary_methods {
    ($($(#[$m:meta])* $name:ident, $sname:ident => $op:ident),* $(,)?) => {
        $(
            $(#[$m])* #[track_caller] pub fn $name(&self, other: &Tensor) -> Tensor {
                self.b.apply(Op::Binary(BinaryOp::$op), &[self, other])
            }
            /// The same with a scalar right-hand side (in this tensor's dtype).
            #[track_caller] pub fn $sname(&self, other: f64) -> Tensor {
                let s = self.scalar_like(other);
                self.b.apply(Op::Binary(BinaryOp::$op), &[self, &s])
            }
        )*
    };
}

impl Tensor {
    /// The builder this tensor belongs to.
    pub fn builder(&self) -> &GraphBuilder {
        &self.b
    }

    /// The node id (None when an earlier error poisoned this handle).
    pub fn id(&self) -> Option<NodeId> {
        self.id
    }

    /// The node id, or the first recorded build error.
    pub fn node(&self) -> Result<NodeId> {
        match self.id {
            Some(id) => Ok(id),
            None => {
                self.b.check()?;
                Err(CompileError::Invalid("tensor has no node".into()))
            }
        }
    }

    /// The type (None when poisoned).
    pub fn ty(&self) -> Option<TensorType> {
        self.id.map(|id| self.b.inner.graph.borrow().ty(id).clone())
    }

    fn ty_or_unknown(&self) -> String {
        self.ty()
            .map(|t| t.to_string())
            .unwrap_or_else(|| "?".into())
    }

    /// The shape (None when poisoned).
    pub fn shape(&self) -> Option<Shape> {
        self.ty().map(|t| t.shape)
    }

    /// The dims (empty when poisoned).
    pub fn dims(&self) -> Vec<usize> {
        self.shape().map(|s| s.0).unwrap_or_default()
    }

    /// The dims as expressions of the graph's named dims (`[batch, 512]`; fixed sizes where
    /// the shape does not depend on them; empty when poisoned).
    pub fn sym_dims(&self) -> Vec<DimExpr> {
        match self.id {
            Some(id) => self.b.inner.graph.borrow().sym_shape(id),
            None => Vec::new(),
        }
    }

    /// The result of a shape op built at the default sizes of `dims`, with `dims` recorded as
    /// its symbolic shape.
    #[track_caller]
    fn sym_shaped(&self, dims: &[DimExpr], op: impl FnOnce(Shape) -> Op) -> Tensor {
        let at = Location::caller();
        let shape = self.b.inner.graph.borrow().eval_dims(dims);
        let t = match shape {
            Ok(shape) => self.b.apply(op(shape), &[self]),
            Err(e) => self.b.wrap(Err(e), at),
        };
        if let Some(id) = t.id {
            let r = self
                .b
                .inner
                .graph
                .borrow_mut()
                .set_sym_shape(id, dims.to_vec())
                .map(|_| id);
            return self.b.wrap(r, at);
        }
        t
    }

    /// Reshape to dims given as expressions of named dims (`[batch, 512.into()]`), so the
    /// reshape follows the named dims when the graph runs at other sizes.
    #[track_caller]
    pub fn reshape_dims(&self, dims: &[DimExpr]) -> Tensor {
        self.sym_shaped(dims, |shape| Op::Reshape { shape })
    }

    /// Broadcast to dims given as expressions of named dims.
    #[track_caller]
    pub fn expand_dims(&self, dims: &[DimExpr]) -> Tensor {
        self.sym_shaped(dims, |shape| Op::Expand { shape })
    }

    /// The dtype (None when poisoned).
    pub fn dtype(&self) -> Option<DType> {
        self.ty().map(|t| t.dtype)
    }

    /// The rank (None when poisoned).
    pub fn rank(&self) -> Option<usize> {
        self.shape().map(|s| s.rank())
    }

    /// A rank-0 constant of this tensor's dtype.
    #[track_caller]
    pub fn scalar_like(&self, v: f64) -> Tensor {
        self.b.scalar(v, self.dtype().unwrap_or(DType::F32))
    }

    fn axes(&self, axes: &[i64]) -> std::result::Result<Vec<usize>, (i64, usize)> {
        let rank = self.rank().unwrap_or(0);
        let mut out = Vec::with_capacity(axes.len());
        for &a in axes {
            out.push(normalize_axis(a, rank).ok_or((a, rank))?);
        }
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    unary_methods! {
        /// -x
        neg => Neg,
        /// |x|
        abs => Abs,
        /// e^x
        exp => Exp,
        /// ln x
        log => Log,
        /// √x
        sqrt => Sqrt,
        /// 1/√x
        rsqrt => Rsqrt,
        /// 1/x
        reciprocal => Reciprocal,
        /// sin x
        sin => Sin,
        /// cos x
        cos => Cos,
        /// tanh x
        tanh => Tanh,
        /// logistic sigmoid
        sigmoid => Sigmoid,
        /// max(x, 0)
        relu => Relu,
        /// GELU (exact erf form)
        gelu => GeluErf,
        /// GELU (tanh approximation)
        gelu_tanh => GeluTanh,
        /// x·sigmoid(x)
        silu => Silu,
        /// sign
        sign => Sign,
        /// floor
        floor => Floor,
        /// ceil
        ceil => Ceil,
        /// round half to even
        round => Round,
        /// logical not
        logical_not => Not,
        /// is NaN
        isnan => IsNan,
        /// is ±∞
        isinf => IsInf,
        /// is finite
        isfinite => IsFinite,
        /// the error function
        erf => Erf,
    }

    binary_methods! {
        /// a + b (broadcast)
        add, add_scalar => Add,
        /// a - b (broadcast)
        sub, sub_scalar => Sub,
        /// a · b (broadcast)
        mul, mul_scalar => Mul,
        /// a / b (broadcast)
        div, div_scalar => Div,
        /// a ^ b (broadcast)
        pow, pow_scalar => Pow,
        /// max(a, b)
        maximum, maximum_scalar => Maximum,
        /// min(a, b)
        minimum, minimum_scalar => Minimum,
        /// a == b
        eq, eq_scalar => Eq,
        /// a != b
        ne, ne_scalar => Ne,
        /// a < b
        lt, lt_scalar => Lt,
        /// a <= b
        le, le_scalar => Le,
        /// a > b
        gt, gt_scalar => Gt,
        /// a >= b
        ge, ge_scalar => Ge,
    }

    /// Logical and.
    #[track_caller]
    pub fn logical_and(&self, other: &Tensor) -> Tensor {
        self.b.apply(Op::Binary(BinaryOp::And), &[self, other])
    }

    /// Logical or.
    #[track_caller]
    pub fn logical_or(&self, other: &Tensor) -> Tensor {
        self.b.apply(Op::Binary(BinaryOp::Or), &[self, other])
    }

    /// Conversion to another dtype.
    #[track_caller]
    pub fn cast(&self, to: DType) -> Tensor {
        self.b.apply(Op::Cast { to }, &[self])
    }

    #[track_caller]
    fn reduce(&self, kind: ReduceKind, axes: &[i64], keep_dims: bool) -> Tensor {
        match self.axes(axes) {
            Ok(axes) => self.b.apply(
                Op::Reduce {
                    kind,
                    axes,
                    keep_dims,
                },
                &[self],
            ),
            Err((a, r)) => self.b.bad_axis("reduce", a, r),
        }
    }

    fn all_axes(&self) -> Vec<i64> {
        (0..self.rank().unwrap_or(0) as i64).collect()
    }

    /// Sum over axes.
    #[track_caller]
    pub fn sum(&self, axes: &[i64], keep_dims: bool) -> Tensor {
        self.reduce(ReduceKind::Sum, axes, keep_dims)
    }
    /// Mean over axes.
    #[track_caller]
    pub fn mean(&self, axes: &[i64], keep_dims: bool) -> Tensor {
        self.reduce(ReduceKind::Mean, axes, keep_dims)
    }
    /// Max over axes.
    #[track_caller]
    pub fn max(&self, axes: &[i64], keep_dims: bool) -> Tensor {
        self.reduce(ReduceKind::Max, axes, keep_dims)
    }
    /// Min over axes.
    #[track_caller]
    pub fn min(&self, axes: &[i64], keep_dims: bool) -> Tensor {
        self.reduce(ReduceKind::Min, axes, keep_dims)
    }
    /// Product over axes.
    #[track_caller]
    pub fn prod(&self, axes: &[i64], keep_dims: bool) -> Tensor {
        self.reduce(ReduceKind::Prod, axes, keep_dims)
    }
    /// Any true over axes (bool).
    #[track_caller]
    pub fn any(&self, axes: &[i64], keep_dims: bool) -> Tensor {
        self.reduce(ReduceKind::Any, axes, keep_dims)
    }
    /// All true over axes (bool).
    #[track_caller]
    pub fn all(&self, axes: &[i64], keep_dims: bool) -> Tensor {
        self.reduce(ReduceKind::All, axes, keep_dims)
    }
    /// Sum of every element (rank 0).
    #[track_caller]
    pub fn sum_all(&self) -> Tensor {
        self.reduce(ReduceKind::Sum, &self.all_axes(), false)
    }
    /// Mean of every element (rank 0).
    #[track_caller]
    pub fn mean_all(&self) -> Tensor {
        self.reduce(ReduceKind::Mean, &self.all_axes(), false)
    }

    #[track_caller]
    fn arg(&self, kind: ArgKind, axis: i64, keep_dims: bool) -> Tensor {
        let rank = self.rank().unwrap_or(0);
        match normalize_axis(axis, rank) {
            Some(axis) => self.b.apply(
                Op::ArgReduce {
                    kind,
                    axis,
                    keep_dims,
                },
                &[self],
            ),
            None => self.b.bad_axis("argreduce", axis, rank),
        }
    }
    /// Index of the first maximum along an axis (i64).
    #[track_caller]
    pub fn argmax(&self, axis: i64, keep_dims: bool) -> Tensor {
        self.arg(ArgKind::ArgMax, axis, keep_dims)
    }
    /// Index of the first minimum along an axis (i64).
    #[track_caller]
    pub fn argmin(&self, axis: i64, keep_dims: bool) -> Tensor {
        self.arg(ArgKind::ArgMin, axis, keep_dims)
    }

    /// Cumulative sum along an axis; `exclusive` leaves each element out of its own sum,
    /// `reverse` sums from the end.
    #[track_caller]
    pub fn cumsum(&self, axis: i64, exclusive: bool, reverse: bool) -> Tensor {
        let rank = self.rank().unwrap_or(0);
        match normalize_axis(axis, rank) {
            Some(axis) => self.b.apply(
                Op::CumSum {
                    axis,
                    exclusive,
                    reverse,
                },
                &[self],
            ),
            None => self.b.bad_axis("cumsum", axis, rank),
        }
    }

    /// The sum (`mean`: the mean) of this tensor over the replicas of a data-parallel run; the
    /// tensor itself in a run of one replica.
    #[track_caller]
    pub fn all_reduce(&self, mean: bool) -> Tensor {
        self.b.apply(Op::AllReduce { mean }, &[self])
    }

    /// The `k` largest (or smallest) elements along an axis, in order, and their indices (i64):
    /// `(values, indices)`, the values a `gather` of the indices (so they carry a gradient).
    #[track_caller]
    pub fn topk(&self, k: usize, axis: i64, largest: bool) -> (Tensor, Tensor) {
        let rank = self.rank().unwrap_or(0);
        let Some(axis) = normalize_axis(axis, rank) else {
            let bad = self.b.bad_axis("topk", axis, rank);
            return (bad.clone(), bad);
        };
        let idx = self.b.apply(Op::TopK { axis, k, largest }, &[self]);
        (self.gather(axis, &idx), idx)
    }

    /// Whether any element is NaN (bool scalar).
    #[track_caller]
    pub fn has_nan(&self) -> Tensor {
        let m = self.isnan();
        m.reduce(ReduceKind::Any, &self.all_axes(), false)
    }
    /// Whether any element is ±∞ (bool scalar).
    #[track_caller]
    pub fn has_inf(&self) -> Tensor {
        let m = self.isinf();
        m.reduce(ReduceKind::Any, &self.all_axes(), false)
    }
    /// Whether every element is finite (bool scalar).
    #[track_caller]
    pub fn all_finite(&self) -> Tensor {
        match self.ty() {
            // `max |x|` is NaN when an element is NaN (the max propagates NaN) and +inf when
            // one is infinite: one float reduction, which fusion makes one kernel with its
            // `abs` and `isfinite`, instead of a bool tensor reduced by `all`.
            Some(t) if t.dtype.is_float() && t.shape.numel() > 0 => {
                self.abs().max(&self.all_axes(), false).isfinite()
            }
            _ => self
                .isfinite()
                .reduce(ReduceKind::All, &self.all_axes(), false),
        }
    }

    /// Matrix product (numpy semantics: 1-D operands are promoted and the added dim removed;
    /// batch dims broadcast).
    #[track_caller]
    pub fn matmul(&self, other: &Tensor) -> Tensor {
        let (ra, rb) = (self.rank().unwrap_or(2), other.rank().unwrap_or(2));
        let a = if ra == 1 {
            self.unsqueeze(0)
        } else {
            self.clone()
        };
        let b = if rb == 1 {
            other.unsqueeze(-1)
        } else {
            other.clone()
        };
        let mut y = self.b.apply(
            Op::Matmul {
                trans_a: false,
                trans_b: false,
            },
            &[&a, &b],
        );
        if ra == 1 {
            y = y.squeeze(-2);
        }
        if rb == 1 {
            y = y.squeeze(-1);
        }
        y
    }

    /// Matrix product with transposed operands (rank >= 2).
    #[track_caller]
    pub fn matmul_t(&self, other: &Tensor, trans_a: bool, trans_b: bool) -> Tensor {
        self.b
            .apply(Op::Matmul { trans_a, trans_b }, &[self, other])
    }

    /// `x·w + b` (a linear layer with `w` as [in, out]).
    #[track_caller]
    pub fn linear(&self, w: &Tensor, b: Option<&Tensor>) -> Tensor {
        let y = self.matmul(w);
        match b {
            Some(b) => y.add(b),
            None => y,
        }
    }

    /// `act(a·b + bias)` as one fused op.
    #[track_caller]
    pub fn matmul_epilogue(
        &self,
        other: &Tensor,
        bias: Option<&Tensor>,
        act: Activation,
    ) -> Tensor {
        let mut ins = vec![self, other];
        if let Some(b) = bias {
            ins.push(b);
        }
        self.b.apply(
            Op::MatmulEpilogue {
                trans_a: false,
                trans_b: false,
                bias: bias.is_some(),
                act,
                accumulate: false,
            },
            &ins,
        )
    }

    /// Same elements, new shape (one dim may be `usize::MAX` to infer it... use [`Tensor::reshape_infer`]).
    #[track_caller]
    pub fn reshape(&self, shape: impl Into<Shape>) -> Tensor {
        self.b.apply(
            Op::Reshape {
                shape: shape.into(),
            },
            &[self],
        )
    }

    /// Reshape with one dim given as -1 and inferred.
    #[track_caller]
    pub fn reshape_infer(&self, dims: &[i64]) -> Tensor {
        let n = self.shape().map(|s| s.numel()).unwrap_or(0);
        let known: usize = dims
            .iter()
            .filter(|&&d| d >= 0)
            .map(|&d| d as usize)
            .product();
        let shape: Vec<usize> = dims
            .iter()
            .map(|&d| {
                if d < 0 {
                    n.checked_div(known).unwrap_or(0)
                } else {
                    d as usize
                }
            })
            .collect();
        self.reshape(shape)
    }

    /// Dim permutation.
    #[track_caller]
    pub fn permute(&self, perm: &[usize]) -> Tensor {
        self.b.apply(
            Op::Permute {
                perm: perm.to_vec(),
            },
            &[self],
        )
    }

    /// Swaps two dims (negative counts from the end).
    #[track_caller]
    pub fn transpose(&self, a: i64, b: i64) -> Tensor {
        let rank = self.rank().unwrap_or(0);
        match (normalize_axis(a, rank), normalize_axis(b, rank)) {
            (Some(a), Some(b)) => {
                let mut p: Vec<usize> = (0..rank).collect();
                p.swap(a, b);
                self.permute(&p)
            }
            _ => self.b.bad_axis("transpose", a.min(b), rank),
        }
    }

    /// Swaps the last two dims.
    #[track_caller]
    pub fn t(&self) -> Tensor {
        self.transpose(-2, -1)
    }

    /// Broadcast to a larger shape.
    #[track_caller]
    pub fn expand(&self, shape: impl Into<Shape>) -> Tensor {
        self.b.apply(
            Op::Expand {
                shape: shape.into(),
            },
            &[self],
        )
    }

    /// Slice of one axis: `start..end` by `step` (ends clamp to the dim).
    #[track_caller]
    pub fn slice(&self, axis: i64, start: usize, end: usize, step: usize) -> Tensor {
        let dims = self.dims();
        match normalize_axis(axis, dims.len()) {
            Some(ax) => {
                let mut starts = vec![0; dims.len()];
                let mut ends = dims.clone();
                let mut steps = vec![1; dims.len()];
                starts[ax] = start;
                ends[ax] = end.min(dims[ax]);
                steps[ax] = step;
                self.b.apply(
                    Op::Slice {
                        starts,
                        ends,
                        steps,
                    },
                    &[self],
                )
            }
            None => self.b.bad_axis("slice", axis, dims.len()),
        }
    }

    /// Constant padding, `(before, after)` per dim.
    #[track_caller]
    pub fn pad(&self, pads: &[(usize, usize)], value: f64) -> Tensor {
        self.b.apply(
            Op::Pad {
                pads: pads.to_vec(),
                value: value.into(),
            },
            &[self],
        )
    }

    /// Removes a size-1 dim.
    #[track_caller]
    pub fn squeeze(&self, axis: i64) -> Tensor {
        let mut dims = self.dims();
        match normalize_axis(axis, dims.len()) {
            Some(a) if dims[a] == 1 => {
                dims.remove(a);
                self.reshape(dims)
            }
            _ => self.b.bad_axis("squeeze", axis, dims.len()),
        }
    }

    /// Inserts a size-1 dim (axis in 0..=rank; negative counts from the end).
    #[track_caller]
    pub fn unsqueeze(&self, axis: i64) -> Tensor {
        let mut dims = self.dims();
        match normalize_axis(axis, dims.len() + 1) {
            Some(a) => {
                dims.insert(a, 1);
                self.reshape(dims)
            }
            None => self.b.bad_axis("unsqueeze", axis, dims.len()),
        }
    }

    /// Flattens dims `start..` into one.
    #[track_caller]
    pub fn flatten(&self, start: usize) -> Tensor {
        let dims = self.dims();
        let mut d: Vec<usize> = dims[..start.min(dims.len())].to_vec();
        d.push(dims[start.min(dims.len())..].iter().product());
        self.reshape(d)
    }

    /// Softmax along an axis.
    #[track_caller]
    pub fn softmax(&self, axis: i64) -> Tensor {
        let rank = self.rank().unwrap_or(0);
        match normalize_axis(axis, rank) {
            Some(axis) => self.b.apply(Op::Softmax { axis }, &[self]),
            None => self.b.bad_axis("softmax", axis, rank),
        }
    }

    /// Log-softmax along an axis.
    #[track_caller]
    pub fn log_softmax(&self, axis: i64) -> Tensor {
        let rank = self.rank().unwrap_or(0);
        match normalize_axis(axis, rank) {
            Some(axis) => self.b.apply(Op::LogSoftmax { axis }, &[self]),
            None => self.b.bad_axis("log_softmax", axis, rank),
        }
    }

    /// LayerNorm over the last dim.
    #[track_caller]
    pub fn layer_norm(&self, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f64) -> Tensor {
        let mut ins = vec![self];
        ins.extend(weight);
        ins.extend(bias);
        self.b.apply(
            Op::LayerNorm {
                eps: eps.into(),
                weight: weight.is_some(),
                bias: bias.is_some(),
            },
            &ins,
        )
    }

    /// RMSNorm over the last dim.
    #[track_caller]
    pub fn rms_norm(&self, weight: Option<&Tensor>, eps: f64) -> Tensor {
        let mut ins = vec![self];
        ins.extend(weight);
        self.b.apply(
            Op::RmsNorm {
                eps: eps.into(),
                weight: weight.is_some(),
            },
            &ins,
        )
    }

    /// torch.gather along an axis.
    #[track_caller]
    pub fn gather(&self, axis: usize, index: &Tensor) -> Tensor {
        self.b.apply(Op::Gather { axis }, &[self, index])
    }

    /// Rows picked by a 1-D index along an axis.
    #[track_caller]
    pub fn index_select(&self, axis: usize, index: &Tensor) -> Tensor {
        self.b.apply(Op::IndexSelect { axis }, &[self, index])
    }

    /// Embedding lookup: `self` is a [V, D] table, `ids` integer indices of any shape;
    /// the result has shape ids.shape + [D].
    #[track_caller]
    pub fn embedding(&self, ids: &Tensor) -> Tensor {
        let mut shape = ids.dims();
        let flat = ids.reshape([shape.iter().product::<usize>()]);
        let rows = self.index_select(0, &flat);
        shape.push(self.dims().last().copied().unwrap_or(0));
        rows.reshape(shape)
    }

    /// N-d convolution (rank 3, 4 or 5 input: NCW, NCHW, NCDHW).
    #[track_caller]
    pub fn conv(&self, w: &Tensor, bias: Option<&Tensor>, opts: &ConvOpts) -> Tensor {
        let n = self.rank().unwrap_or(3).saturating_sub(2);
        let geom = ConvGeom {
            stride: per_dim(&opts.stride, n),
            padding: per_dim(&opts.padding, n),
            dilation: per_dim(&opts.dilation, n),
            layout: Default::default(),
        };
        let mut ins = vec![self, w];
        ins.extend(bias);
        self.b.apply(
            Op::Conv {
                geom,
                groups: opts.groups,
                bias: bias.is_some(),
                act: Activation::None,
            },
            &ins,
        )
    }

    #[track_caller]
    fn pool(
        &self,
        kind: PoolKind,
        kernel: &[usize],
        stride: &[usize],
        padding: &[usize],
    ) -> Tensor {
        let n = self.rank().unwrap_or(3).saturating_sub(2);
        let kernel = per_dim(kernel, n);
        let geom = ConvGeom {
            stride: per_dim(if stride.is_empty() { &kernel } else { stride }, n),
            padding: per_dim(padding, n),
            dilation: vec![1; n],
            layout: Default::default(),
        };
        self.b.apply(Op::Pool { kind, kernel, geom }, &[self])
    }

    /// Max pooling (stride defaults to the kernel when empty).
    #[track_caller]
    pub fn max_pool(&self, kernel: &[usize], stride: &[usize], padding: &[usize]) -> Tensor {
        self.pool(PoolKind::Max, kernel, stride, padding)
    }

    /// Average pooling (stride defaults to the kernel when empty).
    #[track_caller]
    pub fn avg_pool(
        &self,
        kernel: &[usize],
        stride: &[usize],
        padding: &[usize],
        count_include_pad: bool,
    ) -> Tensor {
        self.pool(PoolKind::Avg { count_include_pad }, kernel, stride, padding)
    }

    /// Scaled dot-product attention with `self` as q [B,H,Sq,D]; `scale` defaults to 1/√D.
    #[track_caller]
    pub fn attention(
        &self,
        k: &Tensor,
        v: &Tensor,
        mask: Option<(&Tensor, AttnMask)>,
        causal: Causal,
        scale: Option<f64>,
    ) -> Tensor {
        let d = self.dims().last().copied().unwrap_or(1).max(1);
        let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
        let mut ins = vec![self, k, v];
        let kind = match mask {
            Some((m, kind)) => {
                ins.push(m);
                kind
            }
            None => AttnMask::None,
        };
        self.b.apply(
            Op::Attention {
                causal,
                mask: kind,
                scale: scale.into(),
                layout: AttnLayout::Bhsd,
            },
            &ins,
        )
    }

    /// Mean cross entropy of logits [N, C] against integer targets [N].
    #[track_caller]
    pub fn cross_entropy(&self, targets: &Tensor) -> Tensor {
        self.cross_entropy_with(targets, Reduction::Mean, -100)
    }

    /// Cross entropy with a reduction and an ignored target value.
    #[track_caller]
    pub fn cross_entropy_with(
        &self,
        targets: &Tensor,
        reduction: Reduction,
        ignore_index: i64,
    ) -> Tensor {
        self.b.apply(
            Op::CrossEntropy {
                reduction,
                ignore_index,
            },
            &[self, targets],
        )
    }

    /// Mean squared error against a target of the same shape.
    #[track_caller]
    pub fn mse_loss(&self, target: &Tensor) -> Tensor {
        let d = self.sub(target);
        d.mul(&d).mean_all()
    }
}

macro_rules! operator {
    ($tr:ident, $m:ident, $f:ident, $fs:ident) => {
        impl std::ops::$tr<&Tensor> for &Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $m(self, rhs: &Tensor) -> Tensor {
                self.$f(rhs)
            }
        }
        impl std::ops::$tr<f64> for &Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $m(self, rhs: f64) -> Tensor {
                self.$fs(rhs)
            }
        }
    };
}
operator!(Add, add, add, add_scalar);
operator!(Sub, sub, sub, sub_scalar);
operator!(Mul, mul, mul, mul_scalar);
operator!(Div, div, div, div_scalar);

impl std::ops::Neg for &Tensor {
    type Output = Tensor;
    #[track_caller]
    fn neg(self) -> Tensor {
        Tensor::neg(self)
    }
}
