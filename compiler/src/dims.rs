//! Named dimensions: a graph may declare sizes by name (`batch`, `seq`) and use them in its input
//! types (`x : f32[batch,1,8,8]`).
//!
//! A graph is always *instantiated*: every node has a concrete type, computed at each named
//! dim's default size, so every pass, printer and kernel sees ordinary shapes. Beside it,
//! [`Dims`] keeps the named dims with their defaults and, for the nodes whose shape depends on
//! them, the shape as expressions of the names ([`DimExpr`]: a constant times a product of
//! names, such as `batch` or `4*batch*seq`). Those expressions are what a graph file and the IR
//! text store, and what [`Graph::specialize`] evaluates: at other sizes it rewrites the inputs'
//! types and the size attributes of the ops that carry one (reshape and expand targets, the
//! types of generators), then re-infers every node, so a shape that does not fit fails in the
//! op that does not accept it.
//!
//! The builder derives the expressions of new nodes itself: reshapes and expands match their
//! target against the operand's dims (a leading or trailing dim of the same size keeps its
//! expression, the rest takes what remains of the element count), and every other op is
//! inferred once more at probe sizes (each name a little larger than its default): a result
//! dim that moves with the probe takes the operand expression that moves the same way.

use crate::graph::{Graph, NodeId};
use crate::{CompileError, Result};
use rustytorch_ops::{infer, DType, Op, Shape, TensorType};
use std::collections::HashMap;
use std::fmt;

/// Most names multiplied in one [`DimExpr`].
pub const MAX_FACTORS: usize = 64;

/// A dimension size: a constant times a product of named dims (`16`, `batch`, `512*batch`,
/// `batch*seq`). Names are kept sorted, with repetition for powers.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DimExpr {
    coeff: usize,
    names: Vec<String>,
}

impl DimExpr {
    /// A fixed size.
    pub fn fixed(n: usize) -> DimExpr {
        DimExpr {
            coeff: n,
            names: Vec::new(),
        }
    }

    /// The named dim `name` (declare it on the graph with a default size before use).
    pub fn named(name: &str) -> DimExpr {
        DimExpr {
            coeff: 1,
            names: vec![name.to_string()],
        }
    }

    /// The size, when it names no dim.
    pub fn as_fixed(&self) -> Option<usize> {
        self.names.is_empty().then_some(self.coeff)
    }

    /// The named dims it multiplies (sorted, repeated for powers).
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The constant factor.
    pub fn coeff(&self) -> usize {
        self.coeff
    }

    /// Whether it is exactly one named dim (`batch`).
    pub fn as_name(&self) -> Option<&str> {
        match (self.coeff, self.names.as_slice()) {
            (1, [n]) => Some(n),
            _ => None,
        }
    }

    /// The product of two expressions.
    pub fn mul(&self, other: &DimExpr) -> DimExpr {
        let mut names = self.names.clone();
        names.extend(other.names.iter().cloned());
        names.sort();
        DimExpr {
            coeff: self.coeff.saturating_mul(other.coeff),
            names,
        }
    }

    /// `self / other` when it divides exactly (as expressions: every name of `other` is in
    /// `self` and the constants divide).
    pub fn div(&self, other: &DimExpr) -> Option<DimExpr> {
        if other.coeff == 0 || !self.coeff.is_multiple_of(other.coeff) {
            return None;
        }
        let mut names = self.names.clone();
        for n in &other.names {
            let k = names.iter().position(|m| m == n)?;
            names.remove(k);
        }
        Some(DimExpr {
            coeff: self.coeff / other.coeff,
            names,
        })
    }

    /// The size for the named sizes `size` gives (None for an unknown name or an overflow).
    pub fn eval(&self, size: &dyn Fn(&str) -> Option<usize>) -> Option<usize> {
        self.names
            .iter()
            .try_fold(self.coeff, |acc, n| acc.checked_mul(size(n)?))
    }

    /// Parses `16`, `batch`, `4*batch*seq` (factors joined by `*`; a name starts with an ASCII
    /// letter or `_` and continues with letters, digits and `_`).
    pub fn parse(s: &str) -> std::result::Result<DimExpr, String> {
        let mut e = DimExpr::fixed(1);
        let mut factors = 0;
        for f in s.split('*') {
            let f = f.trim();
            factors += 1;
            if factors > MAX_FACTORS {
                return Err(format!("dimension `{s}` has over {MAX_FACTORS} factors"));
            }
            if let Ok(n) = f.parse::<usize>() {
                e.coeff = e
                    .coeff
                    .checked_mul(n)
                    .ok_or_else(|| format!("dimension `{s}` overflows"))?;
            } else if is_dim_name(f) {
                e.names.push(f.to_string());
            } else {
                return Err(format!("bad dimension `{s}`"));
            }
        }
        e.names.sort();
        Ok(e)
    }
}

impl From<usize> for DimExpr {
    fn from(n: usize) -> DimExpr {
        DimExpr::fixed(n)
    }
}

impl std::ops::Mul for DimExpr {
    type Output = DimExpr;
    fn mul(self, rhs: DimExpr) -> DimExpr {
        DimExpr::mul(&self, &rhs)
    }
}

impl std::ops::Mul<usize> for DimExpr {
    type Output = DimExpr;
    fn mul(self, rhs: usize) -> DimExpr {
        DimExpr::mul(&self, &DimExpr::fixed(rhs))
    }
}

impl fmt::Display for DimExpr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.names.is_empty() {
            return write!(f, "{}", self.coeff);
        }
        if self.coeff != 1 {
            write!(f, "{}*", self.coeff)?;
        }
        write!(f, "{}", self.names.join("*"))
    }
}

/// Whether `s` can name a dim: an ASCII letter or `_`, then letters, digits and `_`.
pub fn is_dim_name(s: &str) -> bool {
    let mut c = s.chars();
    c.next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && c.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && s.len() <= 256
}

/// A type with symbolic dims as text: `f32[batch,1,8,8]`.
pub fn type_text(dtype: DType, dims: &[DimExpr]) -> String {
    let d: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    format!("{dtype}[{}]", d.join(","))
}

/// A named dim and the size the graph is instantiated at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedDim {
    /// The name.
    pub name: String,
    /// The default (example) size: the graph's nodes have the types of this size.
    pub size: usize,
}

/// A graph's named dims and the symbolic shapes of the nodes that depend on them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Dims {
    /// The named dims, in declaration order (the order of [`Graph::specialize`]'s sizes).
    pub named: Vec<NamedDim>,
    /// The shape of each node whose size depends on a named dim (nodes not listed have their
    /// concrete shape at every size).
    pub shapes: HashMap<NodeId, Vec<DimExpr>>,
}

impl Dims {
    /// The default size of a named dim.
    pub fn size(&self, name: &str) -> Option<usize> {
        self.named.iter().find(|d| d.name == name).map(|d| d.size)
    }

    /// Whether the graph declares no named dims.
    pub fn is_empty(&self) -> bool {
        self.named.is_empty()
    }

    /// The default sizes, in declaration order.
    pub fn defaults(&self) -> Vec<usize> {
        self.named.iter().map(|d| d.size).collect()
    }

    /// `batch=5, seq=7` for these sizes (in declaration order).
    pub fn describe(&self, sizes: &[usize]) -> String {
        let parts: Vec<String> = self
            .named
            .iter()
            .zip(sizes)
            .map(|(d, s)| format!("{}={s}", d.name))
            .collect();
        parts.join(", ")
    }
}

/// Sizes to probe a node's shape at: each named dim a distinct prime larger than its default,
/// so every product of names moves.
fn probe_sizes(named: &[NamedDim]) -> Vec<usize> {
    const STEPS: [usize; 12] = [97, 89, 83, 79, 73, 71, 67, 61, 59, 53, 47, 43];
    named
        .iter()
        .enumerate()
        .map(|(k, d)| {
            d.size
                .saturating_add(STEPS.get(k).copied().unwrap_or(101 + k))
        })
        .collect()
}

/// The size attributes of `op` at new operand shapes and, for an op that declares its result's
/// shape, that shape at the new sizes (`result`). A full-range slice of a dim (`0..n` by 1)
/// stays full range. Ops that compute their result from their operands are unchanged.
fn instantiate_op(
    op: &Op,
    old_ins: &[&TensorType],
    new_ins: &[&TensorType],
    result: Option<&Shape>,
) -> Op {
    let with_ty = |ty: &TensorType| match result {
        Some(s) => TensorType::new(ty.dtype, s.clone()),
        None => ty.clone(),
    };
    let with_shape = |shape: &Shape| result.cloned().unwrap_or_else(|| shape.clone());
    match op {
        Op::Input { index, ty } => Op::Input {
            index: *index,
            ty: with_ty(ty),
        },
        Op::Full { value, ty } => Op::Full {
            value: *value,
            ty: with_ty(ty),
        },
        Op::Iota { axis, ty } => Op::Iota {
            axis: *axis,
            ty: with_ty(ty),
        },
        Op::RandUniform {
            low,
            high,
            seed,
            ty,
        } => Op::RandUniform {
            low: *low,
            high: *high,
            seed: *seed,
            ty: with_ty(ty),
        },
        Op::RandNormal {
            mean,
            std,
            seed,
            ty,
        } => Op::RandNormal {
            mean: *mean,
            std: *std,
            seed: *seed,
            ty: with_ty(ty),
        },
        Op::Reshape { shape } => Op::Reshape {
            shape: with_shape(shape),
        },
        Op::Expand { shape } => Op::Expand {
            shape: with_shape(shape),
        },
        Op::ConvGradInput {
            geom,
            groups,
            input_shape,
        } => Op::ConvGradInput {
            geom: geom.clone(),
            groups: *groups,
            input_shape: with_shape(input_shape),
        },
        Op::Slice {
            starts,
            ends,
            steps,
        } => {
            let (Some(old), Some(new)) = (old_ins.first(), new_ins.first()) else {
                return op.clone();
            };
            let ends = ends
                .iter()
                .enumerate()
                .map(|(d, &e)| {
                    let full = starts.get(d) == Some(&0)
                        && steps.get(d) == Some(&1)
                        && old.shape.dims().get(d) == Some(&e);
                    match (full, new.shape.dims().get(d)) {
                        (true, Some(&n)) => n,
                        _ => e,
                    }
                })
                .collect();
            Op::Slice {
                starts: starts.clone(),
                ends,
                steps: steps.clone(),
            }
        }
        // Parameters and constants have fixed types; the rest compute their result's shape
        // from their operands.
        Op::Param { .. }
        | Op::Constant { .. }
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::Where
        | Op::Cast { .. }
        | Op::Reduce { .. }
        | Op::ArgReduce { .. }
        | Op::Matmul { .. }
        | Op::MatmulEpilogue { .. }
        | Op::MatmulActGrad { .. }
        | Op::Permute { .. }
        | Op::Concat { .. }
        | Op::Pad { .. }
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        | Op::Gather { .. }
        | Op::ScatterAdd { .. }
        | Op::IndexSelect { .. }
        | Op::IndexAdd { .. }
        | Op::Conv { .. }
        | Op::ConvGradWeight { .. }
        | Op::Pool { .. }
        | Op::PoolGrad { .. }
        | Op::Attention { .. }
        | Op::AttentionGrad { .. }
        | Op::CrossEntropy { .. }
        | Op::CrossEntropyGrad { .. }
        | Op::Fused(_)
        | Op::SparseMatmul { .. }
        | Op::SampledMatmul
        | Op::CumSum { .. }
        | Op::TopK { .. }
        | Op::AllReduce { .. }
        | Op::FusedRow(_) => op.clone(),
    }
}

/// Evaluates a symbolic shape at `sizes` (in the order of `named`).
fn eval_shape(named: &[NamedDim], sizes: &[usize], dims: &[DimExpr]) -> Option<Shape> {
    let size = |n: &str| {
        named
            .iter()
            .position(|d| d.name == n)
            .and_then(|k| sizes.get(k).copied())
    };
    dims.iter()
        .map(|d| d.eval(&size))
        .collect::<Option<Vec<usize>>>()
        .map(Shape::new)
}

fn product(dims: &[DimExpr]) -> DimExpr {
    dims.iter().fold(DimExpr::fixed(1), |a, d| a.mul(d))
}

impl Graph {
    /// Declares the named dim `name` with its default size (the size the graph's nodes are
    /// built at) and returns it as an expression. Declaring it again with the same size is a
    /// no-op; with another size, an error.
    pub fn declare_dim(&mut self, name: &str, size: usize) -> Result<DimExpr> {
        if !is_dim_name(name) {
            return Err(CompileError::Invalid(format!(
                "`{name}` cannot name a dim (letters, digits and `_`, not starting with a digit)"
            )));
        }
        if size == 0 || size > rustytorch_ops::shape::MAX_ATTR {
            return Err(CompileError::Invalid(format!(
                "named dim `{name}`: default size {size} is not in 1..={}",
                rustytorch_ops::shape::MAX_ATTR
            )));
        }
        match self.dims.size(name) {
            Some(s) if s != size => Err(CompileError::Invalid(format!(
                "named dim `{name}` is declared with size {s} and again with size {size}"
            ))),
            Some(_) => Ok(DimExpr::named(name)),
            None => {
                self.dims.named.push(NamedDim {
                    name: name.to_string(),
                    size,
                });
                Ok(DimExpr::named(name))
            }
        }
    }

    /// `dims` at the default sizes (an error names an undeclared dim).
    pub fn eval_dims(&self, dims: &[DimExpr]) -> Result<Shape> {
        eval_shape(&self.dims.named, &self.dims.defaults(), dims).ok_or_else(|| {
            let names: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
            CompileError::Invalid(format!(
                "[{}] names an undeclared dim or overflows",
                names.join(",")
            ))
        })
    }

    /// Whether the graph declares named dims.
    pub fn has_named_dims(&self) -> bool {
        !self.dims.is_empty()
    }

    /// The shape of node `id` as expressions (fixed sizes where it depends on no named dim).
    pub fn sym_shape(&self, id: NodeId) -> Vec<DimExpr> {
        match self.dims.shapes.get(&id) {
            Some(s) => s.clone(),
            None => self
                .node(id)
                .map(|n| n.ty.shape.dims().iter().map(|&d| d.into()).collect())
                .unwrap_or_default(),
        }
    }

    /// The type of node `id` as text, with its named dims (`f32[batch,512]`).
    pub fn sym_type_text(&self, id: NodeId) -> String {
        match (self.dims.shapes.get(&id), self.node(id)) {
            (Some(s), Ok(n)) => type_text(n.ty.dtype, s),
            (None, Ok(n)) => n.ty.to_string(),
            (_, Err(_)) => "?".into(),
        }
    }

    /// Records the symbolic shape of node `id`: it must have the node's rank, name declared
    /// dims only and evaluate to the node's shape at the default sizes. A shape without names
    /// removes the record.
    pub fn set_sym_shape(&mut self, id: NodeId, dims: Vec<DimExpr>) -> Result<()> {
        let node = self.node(id)?;
        let at = eval_shape(&self.dims.named, &self.dims.defaults(), &dims);
        for d in &dims {
            if let Some(n) = d.names().iter().find(|n| self.dims.size(n).is_none()) {
                return Err(CompileError::Invalid(format!(
                    "unknown named dim `{n}` (declare it with a default size first)"
                )));
            }
        }
        if at.as_ref() != Some(&node.ty.shape) {
            return Err(CompileError::Invalid(format!(
                "node %{} ({}) is {} but its named dims give {} at the default sizes",
                id.index(),
                node.op.name(),
                node.ty,
                type_text(node.ty.dtype, &dims)
            )));
        }
        if dims.iter().all(|d| d.as_fixed().is_some()) {
            self.dims.shapes.remove(&id);
        } else {
            self.dims.shapes.insert(id, dims);
        }
        Ok(())
    }

    /// Declares a named input whose dims may be named (`[batch, 1, 8, 8]`); the names must be
    /// declared ([`Graph::declare_dim`]).
    pub fn add_input_dims(&mut self, name: &str, dtype: DType, dims: &[DimExpr]) -> Result<NodeId> {
        let shape = eval_shape(&self.dims.named, &self.dims.defaults(), dims).ok_or_else(|| {
            CompileError::Invalid(format!(
                "input `{name}`: {} names an undeclared dim",
                type_text(dtype, dims)
            ))
        })?;
        let id = self.add_input(name, TensorType::new(dtype, shape))?;
        self.set_sym_shape(id, dims.to_vec())?;
        Ok(id)
    }

    /// Whether `shape` fits input `index`'s declared dims (rank and fixed sizes; named dims
    /// take any size here, their agreement is [`Graph::bind_dims`]'s).
    pub fn input_fits(&self, index: usize, shape: &Shape) -> bool {
        let Some(d) = self.inputs.get(index) else {
            return false;
        };
        let sym = self.sym_shape(d.node);
        sym.len() == shape.rank()
            && sym
                .iter()
                .zip(shape.dims())
                .all(|(e, &n)| e.as_fixed().is_none_or(|f| f == n))
    }

    /// The sizes of the named dims (in declaration order) that inputs of these shapes give, by
    /// input index. A named dim no input gives keeps its default. Errors name the input: a
    /// wrong rank or fixed size, a named dim given two sizes by two inputs (both named), or a
    /// dim expression that the bound sizes do not produce.
    pub fn bind_dims(&self, given: &[(usize, &Shape)]) -> Result<Vec<usize>> {
        let named = &self.dims.named;
        let mut sizes: Vec<Option<(usize, &str)>> = vec![None; named.len()];
        let bad = |i: usize, reason: String| CompileError::Bind {
            input: self
                .inputs
                .get(i)
                .map(|d| d.name.clone())
                .unwrap_or_default(),
            reason,
        };
        for &(i, shape) in given {
            let d = self
                .inputs
                .get(i)
                .ok_or_else(|| bad(i, "no such input".into()))?;
            let sym = self.sym_shape(d.node);
            let want = || type_text(d.ty.dtype, &sym);
            if sym.len() != shape.rank() {
                return Err(bad(
                    i,
                    format!(
                        "expected {}, got rank {} ({}{shape})",
                        want(),
                        shape.rank(),
                        d.ty.dtype
                    ),
                ));
            }
            for (e, &n) in sym.iter().zip(shape.dims()) {
                if let Some(f) = e.as_fixed() {
                    if f != n {
                        return Err(bad(
                            i,
                            format!("expected {}, got {}{shape}", want(), d.ty.dtype),
                        ));
                    }
                } else if let Some(name) = e.as_name() {
                    let k = named
                        .iter()
                        .position(|x| x.name == name)
                        .ok_or_else(|| bad(i, format!("unknown named dim `{name}`")))?;
                    match sizes[k] {
                        Some((s, other)) if s != n => {
                            return Err(bad(
                                i,
                                format!(
                                    "named dim `{name}` is {n} here but {s} in input `{other}`"
                                ),
                            ))
                        }
                        Some(_) => {}
                        None => sizes[k] = Some((n, d.name.as_str())),
                    }
                }
            }
        }
        let sizes: Vec<usize> = sizes
            .iter()
            .zip(named)
            .map(|(s, d)| s.map_or(d.size, |s| s.0))
            .collect();
        // Products of names must come out as given.
        for &(i, shape) in given {
            let d = &self.inputs[i];
            let sym = self.sym_shape(d.node);
            let at = eval_shape(named, &sizes, &sym);
            if at.as_ref() != Some(shape) {
                let at = at.map_or("an overflow".to_string(), |s| s.to_string());
                return Err(bad(
                    i,
                    format!(
                        "expected {} (= {at} at {}), got {}{shape}",
                        type_text(d.ty.dtype, &sym),
                        self.dims.describe(&sizes),
                        d.ty.dtype
                    ),
                ));
            }
        }
        Ok(sizes)
    }

    /// The graph at other sizes of its named dims (`sizes` in declaration order): inputs and
    /// the ops that declare their result's shape take their symbolic shapes at those sizes,
    /// every node is re-inferred, and the result is a graph without named dims (parameters,
    /// constants, names and provenance are kept). A shape that no longer fits fails with the
    /// op's error, naming its shapes.
    pub fn specialize(&self, sizes: &[usize]) -> Result<Graph> {
        let named = &self.dims.named;
        if sizes.len() != named.len() {
            return Err(CompileError::Invalid(format!(
                "{} sizes for {} named dims",
                sizes.len(),
                named.len()
            )));
        }
        let mut out = self.clone();
        out.dims = Dims::default();
        if sizes == self.dims.defaults().as_slice() {
            return Ok(out);
        }
        let at = self.dims.describe(sizes);
        for p in &self.params {
            if self.dims.shapes.contains_key(&p.node) {
                return Err(CompileError::Invalid(format!(
                    "parameter `{}` has a named dim; parameters must have fixed shapes",
                    p.name
                )));
            }
        }
        for id in self.topo_order()? {
            let node = &self.g[id];
            let result = match self.dims.shapes.get(&id) {
                Some(s) => Some(eval_shape(named, sizes, s).ok_or_else(|| {
                    CompileError::Invalid(format!(
                        "at {at}: the shape of node %{} ({}) overflows",
                        id.index(),
                        node.op.name()
                    ))
                })?),
                None => None,
            };
            let old: Vec<&TensorType> = node.inputs.iter().map(|&i| &self.g[i].ty).collect();
            let new: Vec<&TensorType> = node.inputs.iter().map(|&i| &out.g[i].ty).collect();
            let op = instantiate_op(&node.op, &old, &new, result.as_ref());
            let ty = infer(&op, &new).map_err(|source| CompileError::Specialize {
                at: at.clone(),
                source,
            })?;
            let n = &mut out.g[id];
            n.op = op;
            n.ty = ty;
        }
        for d in &mut out.inputs {
            d.ty = out.g[d.node].ty.clone();
        }
        Ok(out)
    }

    /// Derives the symbolic shape of node `id`, just added over operands whose symbolic shapes
    /// are known (see the module docs); leaves the node without one when its shape does not
    /// follow the named dims in a way the rules can see.
    pub(crate) fn derive_sym_shape(&mut self, id: NodeId) {
        let Ok(node) = self.node(id) else { return };
        if node.inputs.is_empty() || self.dims.is_empty() {
            return;
        }
        let ins: Vec<Vec<DimExpr>> = node.inputs.iter().map(|&i| self.sym_shape(i)).collect();
        if !ins.iter().flatten().any(|d| d.as_fixed().is_none()) {
            return;
        }
        let out = node.ty.shape.dims().to_vec();
        let derived = match &node.op {
            Op::Reshape { .. } => {
                reshape_dims(&ins[0], &self.g[node.inputs[0]].ty.shape, &out, &|n| {
                    self.dims.size(n)
                })
            }
            Op::Expand { .. } => Some(expand_dims(&ins[0], &self.g[node.inputs[0]].ty.shape, &out)),
            _ => self.probe_dims(id, &ins),
        };
        match derived {
            Some(d) => {
                if let Err(e) = self.set_sym_shape(id, d) {
                    tracing::debug!("named dims of node %{}: {e}", id.index());
                }
            }
            None => tracing::debug!(
                "node %{} ({}): its shape does not follow the named dims visibly; it stays fixed",
                id.index(),
                node.op.name()
            ),
        }
    }

    /// Infers node `id` again with its operands at probe sizes; each result dim that moves is
    /// matched to an operand dim expression that moves the same way.
    fn probe_dims(&self, id: NodeId, ins: &[Vec<DimExpr>]) -> Option<Vec<DimExpr>> {
        let node = &self.g[id];
        let named = &self.dims.named;
        let probe = probe_sizes(named);
        let probe_tys: Vec<TensorType> = node
            .inputs
            .iter()
            .zip(ins)
            .map(|(&i, s)| {
                Some(TensorType::new(
                    self.g[i].ty.dtype,
                    eval_shape(named, &probe, s)?,
                ))
            })
            .collect::<Option<_>>()?;
        let old: Vec<&TensorType> = node.inputs.iter().map(|&i| &self.g[i].ty).collect();
        let new: Vec<&TensorType> = probe_tys.iter().collect();
        let op = instantiate_op(&node.op, &old, &new, None);
        let at_probe = infer(&op, &new).ok()?;
        if at_probe.shape.rank() != node.ty.shape.rank() {
            return None;
        }
        let defaults = self.dims.defaults();
        let mut candidates: Vec<&DimExpr> = ins
            .iter()
            .flatten()
            .filter(|d| d.as_fixed().is_none())
            .collect();
        candidates.sort();
        candidates.dedup();
        node.ty
            .shape
            .dims()
            .iter()
            .zip(at_probe.shape.dims())
            .map(|(&d, &p)| {
                if d == p {
                    return Some(DimExpr::fixed(d));
                }
                // An operand dim, or a multiple of one (a concatenation of equal parts).
                let at = |sizes: &[usize], e: &DimExpr| {
                    eval_shape(named, sizes, std::slice::from_ref(e)).map(|s| s.dims()[0])
                };
                candidates.iter().find_map(|c| {
                    let v = at(&defaults, c).filter(|&v| v > 0 && d.is_multiple_of(v))?;
                    let e = c.mul(&DimExpr::fixed(d / v));
                    (at(&probe, &e) == Some(p)).then_some(e)
                })
            })
            .collect()
    }

    /// Checks the named dims: unique valid names with sizes in range, symbolic shapes only for
    /// existing nodes other than parameters and constants, each of its node's rank, naming
    /// declared dims and giving the node's shape at the default sizes.
    pub(crate) fn verify_dims(&self) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for d in &self.dims.named {
            if !is_dim_name(&d.name) {
                return Err(CompileError::Invalid(format!(
                    "`{}` cannot name a dim",
                    d.name
                )));
            }
            if !seen.insert(d.name.as_str()) {
                return Err(CompileError::Invalid(format!(
                    "named dim `{}` declared twice",
                    d.name
                )));
            }
            if d.size == 0 || d.size > rustytorch_ops::shape::MAX_ATTR {
                return Err(CompileError::Invalid(format!(
                    "named dim `{}`: default size {} is out of range",
                    d.name, d.size
                )));
            }
        }
        let defaults = self.dims.defaults();
        for (&id, dims) in &self.dims.shapes {
            let node = self.node(id).map_err(|_| {
                CompileError::Invalid(format!(
                    "named dims recorded for missing node %{}",
                    id.index()
                ))
            })?;
            if matches!(node.op, Op::Param { .. } | Op::Constant { .. }) {
                return Err(CompileError::Invalid(format!(
                    "{} %{} has named dims ({}); parameters and constants have fixed shapes",
                    node.op.name(),
                    id.index(),
                    type_text(node.ty.dtype, dims)
                )));
            }
            for d in dims {
                if d.names().len() > MAX_FACTORS {
                    return Err(CompileError::Invalid(format!(
                        "node %{}: a dim of over {MAX_FACTORS} factors",
                        id.index()
                    )));
                }
                if let Some(n) = d.names().iter().find(|n| self.dims.size(n).is_none()) {
                    return Err(CompileError::Invalid(format!(
                        "node %{} names the undeclared dim `{n}`",
                        id.index()
                    )));
                }
            }
            if eval_shape(&self.dims.named, &defaults, dims).as_ref() != Some(&node.ty.shape) {
                return Err(CompileError::Invalid(format!(
                    "node %{} ({}) is {} but its named dims give {} at the default sizes",
                    id.index(),
                    node.op.name(),
                    node.ty,
                    type_text(node.ty.dtype, dims)
                )));
            }
        }
        Ok(())
    }
}

/// The symbolic target of a reshape of an operand of dims `src` (concrete `src_shape`) to
/// `target`: leading and trailing target dims equal to the operand's keep their expressions,
/// and the dims between share what remains of the element count (one dim takes all of it;
/// several take the names whose default sizes divide them, in order).
pub(crate) fn reshape_dims(
    src: &[DimExpr],
    src_shape: &Shape,
    target: &[usize],
    size: &dyn Fn(&str) -> Option<usize>,
) -> Option<Vec<DimExpr>> {
    let numel = product(src);
    if numel.as_fixed().is_some() {
        return Some(target.iter().map(|&d| d.into()).collect());
    }
    let sd = src_shape.dims();
    let mut p = 0;
    while p < target.len() && p < sd.len() && target[p] == sd[p] {
        p += 1;
    }
    let mut s = 0;
    while s < target.len() - p
        && s < sd.len() - p.min(sd.len())
        && target[target.len() - 1 - s] == sd[sd.len() - 1 - s]
    {
        s += 1;
    }
    let mut out: Vec<Option<DimExpr>> = vec![None; target.len()];
    for k in 0..p {
        out[k] = Some(src[k].clone());
    }
    for k in 0..s {
        out[target.len() - 1 - k] = Some(src[sd.len() - 1 - k].clone());
    }
    let known = product(&out.iter().flatten().cloned().collect::<Vec<_>>());
    let rest = numel.div(&known)?;
    let middle: Vec<usize> = (p..target.len() - s).collect();
    match middle.as_slice() {
        [] => (rest.as_fixed() == Some(1)).then_some(())?,
        [k] => out[*k] = Some(rest),
        _ => {
            // Names go, in order, to the first dims their default sizes divide; two names of
            // one default size could go either way, so they are not guessed.
            let mut names = rest.names().to_vec();
            let distinct = |a: &String, b: &String| a == b || size(a) != size(b);
            if names.iter().any(|a| names.iter().any(|b| !distinct(a, b))) {
                return None;
            }
            let mut shared = DimExpr::fixed(1);
            for &k in &middle {
                let mut e = DimExpr::fixed(1);
                let mut left = target[k];
                names.retain(|n| match size(n) {
                    Some(z) if z > 0 && left.is_multiple_of(z) => {
                        left /= z;
                        e = e.mul(&DimExpr::named(n));
                        false
                    }
                    _ => true,
                });
                e = e.mul(&DimExpr::fixed(left));
                shared = shared.mul(&e);
                out[k] = Some(e);
            }
            if !names.is_empty() || shared != rest {
                return None;
            }
        }
    }
    out.into_iter().collect()
}

/// The symbolic target of an expand: each target dim equal to the aligned operand dim keeps
/// its expression; new and broadcast dims are fixed.
pub(crate) fn expand_dims(src: &[DimExpr], src_shape: &Shape, target: &[usize]) -> Vec<DimExpr> {
    let off = target.len().saturating_sub(src.len());
    target
        .iter()
        .enumerate()
        .map(|(k, &t)| match k.checked_sub(off) {
            Some(j) if src_shape.dims().get(j) == Some(&t) => src[j].clone(),
            _ => t.into(),
        })
        .collect()
}
