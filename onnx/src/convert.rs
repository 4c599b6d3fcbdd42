//! ONNX nodes as RustyTorch ops. Values known at import (constants, integer initializers, shapes
//! of statically shaped tensors and everything computed from them) are folded on the host with
//! the ops' CPU kernels, so shape subgraphs (`Shape`, `Gather` of a shape, `Concat`, `Range`,
//! `ConstantOfShape` ...) leave only their result in the graph.

use crate::error::{model_err, ImportError, Result};
use crate::proto::{attribute_proto::AttributeType, AttributeProto, ModelProto, NodeProto};
use crate::tensor::{dtype_from_onnx, tensor_from_proto};
use crate::ImportOptions;
use rustytorch_compiler::dims::DimExpr;
use rustytorch_compiler::{CompileError, Graph, GraphBuilder, Init, NodeId, Tensor};
use rustytorch_ops::{
    eval_cpu, ArgKind, AttnLayout, AttnMask, BinaryOp, Causal, ConvGeom, DType, Data, F64Bits,
    HostTensor, Op, PoolKind, ReduceKind, Shape, TensorType, UnaryOp,
};
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;
use std::rc::Rc;

/// The oldest default-domain opset accepted. Opset 13 onwards is the supported range; older
/// models import where their ops' older forms (attributes that later became inputs, Softmax's
/// 2-D coercion) are handled, which the unknown-attribute check keeps honest.
pub const OPSET_MIN: i64 = 7;
/// The newest default-domain opset accepted.
pub const OPSET_MAX: i64 = 24;

/// The most elements a value built or folded on the host at import may have: a larger result
/// stays a graph node (computed at run time), and an index list that large is an error, so a
/// hostile model cannot make the import allocate without bound.
const FOLD_LIMIT: usize = 1 << 24;

/// Errors when `n` elements would be built at import.
fn check_fold(n: usize, what: &str) -> Result<()> {
    if n > FOLD_LIMIT {
        return why(format!(
            "{what} of {n} elements is too large to build at import (over {FOLD_LIMIT})"
        ));
    }
    Ok(())
}

/// A value during import: known on the host (folded), or a node of the graph.
#[derive(Clone, Debug)]
enum Val {
    Known(Rc<HostTensor>),
    Node(NodeId),
}

fn known(t: HostTensor) -> Val {
    Val::Known(Rc::new(t))
}

/// An error of the node being converted (the caller adds the node's name and op type).
fn why<T>(msg: impl Into<String>) -> Result<T> {
    Err(ImportError::Model(msg.into()))
}

/// The integers of a known integer tensor.
fn ints_of(t: &HostTensor) -> Result<Vec<i64>> {
    Ok(match t.data() {
        Data::I64(v) => v.to_vec(),
        Data::I32(v) => v.iter().map(|&x| x as i64).collect(),
        Data::U8(v) => v.iter().map(|&x| x as i64).collect(),
        other => return why(format!("expected integers, got {}", other.dtype())),
    })
}

/// `axis` (possibly negative) as an index into `rank` dims.
fn norm_axis(axis: i64, rank: usize) -> Result<usize> {
    let r = rank as i64;
    if axis < -r || axis >= r.max(1) {
        return why(format!("axis {axis} is out of range for rank {rank}"));
    }
    Ok(if axis < 0 { axis + r } else { axis } as usize)
}

/// Sorted, unique, non-negative axes.
fn norm_axes(axes: &[i64], rank: usize) -> Result<Vec<usize>> {
    let mut out = axes
        .iter()
        .map(|&a| norm_axis(a, rank))
        .collect::<Result<Vec<_>>>()?;
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// A node's attributes, recording which were read: one left unread is an attribute the
/// importer does not understand, and an error.
struct Attrs<'a> {
    list: &'a [AttributeProto],
    used: RefCell<Vec<bool>>,
}

impl<'a> Attrs<'a> {
    fn new(list: &'a [AttributeProto]) -> Attrs<'a> {
        Attrs {
            list,
            used: RefCell::new(vec![false; list.len()]),
        }
    }

    fn find(&self, name: &str, ty: AttributeType) -> Result<Option<&'a AttributeProto>> {
        let Some(k) = self.list.iter().position(|a| a.name() == name) else {
            return Ok(None);
        };
        self.used.borrow_mut()[k] = true;
        let a = &self.list[k];
        if a.r#type.is_some() && a.r#type() != ty {
            return why(format!(
                "attribute `{name}` is {:?}, expected {:?}",
                a.r#type(),
                ty
            ));
        }
        Ok(Some(a))
    }

    fn int_opt(&self, name: &str) -> Result<Option<i64>> {
        Ok(self.find(name, AttributeType::Int)?.map(|a| a.i()))
    }

    fn int(&self, name: &str, default: i64) -> Result<i64> {
        Ok(self.int_opt(name)?.unwrap_or(default))
    }

    fn ints(&self, name: &str) -> Result<Option<Vec<i64>>> {
        Ok(self
            .find(name, AttributeType::Ints)?
            .map(|a| a.ints.clone()))
    }

    fn float(&self, name: &str, default: f32) -> Result<f32> {
        Ok(self
            .find(name, AttributeType::Float)?
            .map_or(default, |a| a.f()))
    }

    fn floats(&self, name: &str) -> Result<Option<Vec<f32>>> {
        Ok(self
            .find(name, AttributeType::Floats)?
            .map(|a| a.floats.clone()))
    }

    fn string(&self, name: &str, default: &str) -> Result<String> {
        Ok(self
            .find(name, AttributeType::String)?
            .map_or(default.to_string(), |a| {
                String::from_utf8_lossy(a.s()).into_owned()
            }))
    }

    fn tensor(&self, name: &str) -> Result<Option<&'a crate::proto::TensorProto>> {
        Ok(self
            .find(name, AttributeType::Tensor)?
            .and_then(|a| a.t.as_ref()))
    }

    /// The first attribute that was never read.
    fn unread(&self) -> Option<&'a str> {
        let used = self.used.borrow();
        self.list
            .iter()
            .zip(used.iter())
            .find(|(_, &u)| !u)
            .map(|(a, _)| a.name())
    }
}

/// The node being converted: its attributes and input names (`None` for an omitted optional
/// input).
struct Ctx<'a> {
    attrs: Attrs<'a>,
    inputs: Vec<Option<&'a str>>,
    n_outputs: usize,
}

/// Every op type the importer converts (default domain).
pub fn supported_ops() -> &'static [&'static str] {
    &[
        "Abs",
        "Acosh",
        "Add",
        "Asinh",
        "And",
        "ArgMax",
        "ArgMin",
        "Attention",
        "AveragePool",
        "Atanh",
        "BatchNormalization",
        "BlackmanWindow",
        "Cast",
        "CastLike",
        "CenterCropPad",
        "Ceil",
        "Celu",
        "Clip",
        "Concat",
        "Constant",
        "ConstantOfShape",
        "Conv",
        "ConvTranspose",
        "Cos",
        "Cosh",
        "CumSum",
        "DepthToSpace",
        "Div",
        "Dropout",
        "Elu",
        "Einsum",
        "Equal",
        "Erf",
        "Exp",
        "Expand",
        "EyeLike",
        "Flatten",
        "Floor",
        "Gather",
        "GatherElements",
        "GatherND",
        "Gelu",
        "Gemm",
        "GlobalAveragePool",
        "GlobalMaxPool",
        "Greater",
        "GroupNormalization",
        "HammingWindow",
        "HannWindow",
        "GreaterOrEqual",
        "Hardmax",
        "HardSigmoid",
        "HardSwish",
        "Identity",
        "InstanceNormalization",
        "IsInf",
        "IsNaN",
        "LayerNormalization",
        "LeakyRelu",
        "Less",
        "LessOrEqual",
        "Log",
        "LRN",
        "LpNormalization",
        "LpPool",
        "LogSoftmax",
        "MatMul",
        "Max",
        "MaxPool",
        "Mean",
        "MeanVarianceNormalization",
        "Min",
        "Mod",
        "Mish",
        "Mul",
        "Neg",
        "NegativeLogLikelihoodLoss",
        "Not",
        "OneHot",
        "Or",
        "Pad",
        "Pow",
        "PRelu",
        "Range",
        "Reciprocal",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceMax",
        "ReduceMean",
        "ReduceMin",
        "ReduceProd",
        "ReduceSum",
        "ReduceSumSquare",
        "Relu",
        "Reshape",
        "RMSNormalization",
        "Resize",
        "Round",
        "Scatter",
        "ScatterElements",
        "ScatterND",
        "Selu",
        "Shape",
        "Shrink",
        "Sigmoid",
        "Sign",
        "Sin",
        "Sinh",
        "Size",
        "Slice",
        "Softmax",
        "SoftmaxCrossEntropyLoss",
        "SpaceToDepth",
        "Softplus",
        "Softsign",
        "Split",
        "Sqrt",
        "Squeeze",
        "Sub",
        "Sum",
        "Swish",
        "Tan",
        "Tanh",
        "ThresholdedRelu",
        "Tile",
        "TopK",
        "Transpose",
        "Trilu",
        "Unsqueeze",
        "Upsample",
        "Where",
        "Xor",
    ]
}

/// Imports a decoded model.
pub(crate) fn import_model(
    model: &ModelProto,
    base_dir: Option<&Path>,
    opts: &ImportOptions,
) -> Result<Graph> {
    let mut opset = None;
    for o in &model.opset_import {
        if matches!(o.domain(), "" | "ai.onnx") {
            opset = Some(o.version());
        }
    }
    let Some(opset) = opset else {
        return model_err("the model imports no default-domain (ai.onnx) opset");
    };
    if !(OPSET_MIN..=OPSET_MAX).contains(&opset) {
        return model_err(format!(
            "opset {opset} is not supported (ai.onnx opsets {OPSET_MIN} to {OPSET_MAX}; 13 and later are the supported range)"
        ));
    }
    let Some(graph) = &model.graph else {
        return model_err("the model has no graph");
    };
    let mut im = Importer {
        b: GraphBuilder::new(),
        vals: HashMap::new(),
        pending: HashMap::new(),
        opset,
        bound: HashMap::new(),
    };
    for init in &graph.initializer {
        let t = tensor_from_proto(init, base_dir)?;
        let name = init.name().to_string();
        if name.is_empty() {
            return model_err("an initializer has no name");
        }
        // Float tensors are the model's weights: parameters. Integer and bool initializers (shapes,
        // indices, axes) and scalars stay constants, so that what depends on them folds.
        if t.dtype().is_float() && t.numel() > 1 {
            im.pending.insert(name, t);
        } else {
            im.vals.insert(name, known(t));
        }
    }
    if !graph.sparse_initializer.is_empty() {
        return model_err("sparse initializers are not supported");
    }
    for input in &graph.input {
        let name = input.name();
        if im.vals.contains_key(name) || im.pending.contains_key(name) {
            continue; // an initializer listed as an input (older IR versions)
        }
        let (ty, sym) = input_type(input, opts)?;
        if let Some(v) = opts.input_values.get(name) {
            if v.ty() != ty {
                return model_err(format!(
                    "input `{name}`: the value given for import is {}, the model declares {ty}",
                    v.ty()
                ));
            }
            im.bound.insert(name.to_string(), v.clone());
        }
        let id = if opts.fixed_dims || sym.iter().all(Option::is_none) {
            im.b.with_graph(|g| g.add_input(name, ty.clone()))?
        } else {
            // Symbolic dims become the graph's named dims, their defaults the sizes given.
            let mut dims = Vec::with_capacity(sym.len());
            for (k, s) in sym.iter().enumerate() {
                dims.push(match s {
                    Some(p) => {
                        let n = ty.shape.dims()[k];
                        im.b.with_graph(|g| g.declare_dim(p, n))
                            .map_err(|e| ImportError::Model(format!("input `{name}`: {e}")))?
                    }
                    None => DimExpr::fixed(ty.shape.dims()[k]),
                });
            }
            im.b.with_graph(|g| g.add_input_dims(name, ty.dtype, &dims))?
        };
        // An integer input whose value is given is known: what it computes folds (the input
        // stays declared, so a run still takes it).
        let v = match im.bound.get(name) {
            Some(t) if t.dtype().is_int() => known(t.clone()),
            _ => Val::Node(id),
        };
        im.vals.insert(name.to_string(), v);
    }
    for node in &graph.node {
        im.convert(node)?;
    }
    for out in &graph.output {
        let name = out.name();
        let v = im.value(name).map_err(|_| {
            ImportError::Model(format!("output `{name}` is not computed by the graph"))
        })?;
        let id = im.node(&v)?;
        im.b.with_graph(|g| g.add_output(name, id))?;
    }
    let mut g = im.b.graph()?;
    g.remove_dead();
    // The builder records where in Rust each node was made: here the importer, which says
    // nothing about the model.
    g.provenance = Default::default();
    Ok(g)
}

/// A symbolic dim's name as a RustyTorch dim name (letters, digits and `_`, not starting with
/// a digit).
fn dim_name(p: &str) -> String {
    let mut s: String = p
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() || s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert(0, '_');
    }
    s
}

/// The type of a graph input at the sizes the options give its symbolic dims, and each dim's
/// name where it is symbolic.
fn input_type(
    input: &crate::proto::ValueInfoProto,
    opts: &ImportOptions,
) -> Result<(TensorType, Vec<Option<String>>)> {
    use crate::proto::tensor_shape_proto::dimension::Value as Dim;
    use crate::proto::type_proto::Value as Ty;
    let name = input.name();
    let Some(Ty::TensorType(tt)) = input.r#type.as_ref().and_then(|t| t.value.as_ref()) else {
        return model_err(format!(
            "input `{name}`: only tensor inputs are supported (not sequences, maps or optionals)"
        ));
    };
    let dtype = dtype_from_onnx(tt.elem_type())
        .map_err(|e| ImportError::Model(format!("input `{name}`: {e}")))?;
    let Some(shape) = &tt.shape else {
        return model_err(format!("input `{name}`: the model does not give its shape"));
    };
    let mut dims = Vec::with_capacity(shape.dim.len());
    let mut names = Vec::with_capacity(shape.dim.len());
    for (k, d) in shape.dim.iter().enumerate() {
        let mut named = None;
        let n = match &d.value {
            Some(Dim::DimValue(v)) if *v >= 0 => *v as usize,
            Some(Dim::DimValue(v)) => {
                return model_err(format!("input `{name}`: dimension {k} is {v}"))
            }
            Some(Dim::DimParam(p)) => {
                named = Some(dim_name(p));
                let default = if opts.fixed_dims {
                    opts.default_dim
                } else {
                    Some(opts.default_dim.unwrap_or(1))
                };
                match opts.dims.get(p).copied().or(default) {
                    Some(n) => n,
                    None => {
                        return model_err(format!(
                            "input `{name}`: dimension {k} is symbolic (`{p}`); give its size with --dim {p}=N"
                        ))
                    }
                }
            }
            None => {
                return model_err(format!(
                    "input `{name}`: dimension {k} has no size or name; give the input a concrete shape"
                ))
            }
        };
        dims.push(n);
        names.push(named);
    }
    let ty = TensorType::new(dtype, dims);
    ty.shape
        .check_limits()
        .map_err(|e| ImportError::Model(format!("input `{name}`: {e}")))?;
    Ok((ty, names))
}

/// What [`Importer::conv_parts`] reads for a convolution or a transposed convolution.
struct ConvParts {
    x: Val,
    w: Val,
    b: Option<Val>,
    /// x's and w's dims.
    dx: Vec<usize>,
    dw: Vec<usize>,
    /// Spatial rank.
    s: usize,
    groups: usize,
    kernel: Vec<usize>,
    strides: Vec<usize>,
    dilations: Vec<usize>,
}

struct Importer {
    /// The graph being built (through the builder, which derives the named-dim shape of each
    /// node from its operands').
    b: GraphBuilder,
    /// Values by name.
    vals: HashMap<String, Val>,
    /// Float initializers not yet used by a graph node (they become parameters when they are).
    pending: HashMap<String, HostTensor>,
    opset: i64,
    /// Graph inputs' values known at import ([`ImportOptions::input_values`]).
    bound: HashMap<String, HostTensor>,
}

impl Importer {
    fn convert(&mut self, node: &NodeProto) -> Result<()> {
        let op_type = node.op_type();
        let label = || {
            if !node.name().is_empty() {
                node.name().to_string()
            } else {
                node.output.first().cloned().unwrap_or_default()
            }
        };
        let node_err = |reason: String| ImportError::Node {
            node: label(),
            op_type: if matches!(node.domain(), "" | "ai.onnx") {
                op_type.to_string()
            } else {
                format!("{}:{op_type}", node.domain())
            },
            reason,
        };
        if !matches!(node.domain(), "" | "ai.onnx") {
            return Err(node_err(format!(
                "the `{}` domain is not supported (only ai.onnx ops)",
                node.domain()
            )));
        }
        let cx = Ctx {
            attrs: Attrs::new(&node.attribute),
            inputs: node
                .input
                .iter()
                .map(|s| (!s.is_empty()).then_some(s.as_str()))
                .collect(),
            n_outputs: node.output.len(),
        };
        let outs = self.op(op_type, &cx).map_err(|e| match e {
            ImportError::Node { .. } => e,
            other => node_err(other.to_string()),
        })?;
        if let Some(a) = cx.attrs.unread() {
            return Err(node_err(format!("attribute `{a}` is not supported")));
        }
        for (k, name) in node.output.iter().enumerate() {
            if name.is_empty() {
                continue;
            }
            let Some(v) = outs.get(k) else {
                return Err(node_err(format!(
                    "output {k} (`{name}`) is not supported; only the first {} output{} can be imported",
                    outs.len(),
                    if outs.len() == 1 { "" } else { "s" }
                )));
            };
            self.vals.insert(name.clone(), v.clone());
        }
        Ok(())
    }

    // ---- values ----

    /// The value named `name`, turning a float initializer into a parameter on first use.
    fn value(&mut self, name: &str) -> Result<Val> {
        if let Some(v) = self.vals.get(name) {
            return Ok(v.clone());
        }
        if let Some(t) = self.pending.remove(name) {
            let id = self.b.with_graph(|g| -> Result<NodeId> {
                let id = g.add_param(name, t.ty(), Init::Data, true)?;
                let p = g.params.len() - 1;
                g.params[p].data = Some(t);
                Ok(id)
            })?;
            self.vals.insert(name.to_string(), Val::Node(id));
            return Ok(Val::Node(id));
        }
        why(format!(
            "`{name}` is not a graph input, an initializer or an earlier node's output"
        ))
    }

    /// Input `k` (required).
    fn input(&mut self, cx: &Ctx, k: usize) -> Result<Val> {
        match cx.inputs.get(k).copied().flatten() {
            Some(name) => self.value(name),
            None => why(format!("input {k} is required")),
        }
    }

    /// Input `k`, or `None` when omitted.
    fn opt_input(&mut self, cx: &Ctx, k: usize) -> Result<Option<Val>> {
        match cx.inputs.get(k).copied().flatten() {
            Some(name) => self.value(name).map(Some),
            None => Ok(None),
        }
    }

    /// The value of input `k` when it is known at import (a constant, an initializer, or
    /// computed from them); `None` when omitted; an error when it is computed at run time.
    fn static_input(&self, cx: &Ctx, k: usize, what: &str) -> Result<Option<HostTensor>> {
        let Some(name) = cx.inputs.get(k).copied().flatten() else {
            return Ok(None);
        };
        if let Some(t) = self.pending.get(name).or_else(|| self.bound.get(name)) {
            return Ok(Some(t.clone()));
        }
        match self.vals.get(name) {
            Some(Val::Known(t)) => Ok(Some((**t).clone())),
            Some(Val::Node(_)) => why(format!(
                "input {k} ({what}) must be known at import (a constant, computed from shapes, or a graph input whose value is given at import), but `{name}` is computed at run time"
            )),
            None => why(format!("`{name}` is not defined before this node")),
        }
    }

    /// The integers of input `k` when it is known at import.
    fn static_ints(&self, cx: &Ctx, k: usize, what: &str) -> Result<Option<Vec<i64>>> {
        self.static_input(cx, k, what)?
            .map(|t| ints_of(&t))
            .transpose()
    }

    fn ty(&self, v: &Val) -> TensorType {
        match v {
            Val::Known(t) => t.ty(),
            Val::Node(id) => self.b.with_graph(|g| g.ty(*id).clone()),
        }
    }

    fn dims(&self, v: &Val) -> Vec<usize> {
        self.ty(v).shape.dims().to_vec()
    }

    fn dtype(&self, v: &Val) -> DType {
        self.ty(v).dtype
    }

    /// The graph node of a value: a known value becomes a `Full` when all its elements are equal,
    /// otherwise a constant.
    fn node(&mut self, v: &Val) -> Result<NodeId> {
        match v {
            Val::Node(id) => Ok(*id),
            Val::Known(t) => {
                let vals = t.to_f64_vec();
                let uniform = vals
                    .first()
                    .is_some_and(|&f| vals.iter().all(|&x| x.to_bits() == f.to_bits()));
                if uniform && t.dtype() != DType::F64 && t.dtype() != DType::I64 || vals.len() == 1
                {
                    self.add_node(
                        Op::Full {
                            value: F64Bits::new(vals[0]),
                            ty: t.ty(),
                        },
                        &[],
                    )
                } else {
                    Ok(self.b.with_graph(|g| g.add_constant((**t).clone())))
                }
            }
        }
    }

    /// Applies `op`: folded on the host when every operand is known, else a graph node.
    fn emit(&mut self, op: Op, ins: &[&Val]) -> Result<Val> {
        let tys: Vec<TensorType> = ins.iter().map(|v| self.ty(v)).collect();
        let refs: Vec<&TensorType> = tys.iter().collect();
        let small = rustytorch_ops::infer(&op, &refs)?.shape.numel() <= FOLD_LIMIT;
        if small && ins.iter().all(|v| matches!(v, Val::Known(_))) && !ins.is_empty() {
            let ts: Vec<&HostTensor> = ins
                .iter()
                .map(|v| match v {
                    Val::Known(t) => &**t,
                    Val::Node(_) => unreachable!("checked above"),
                })
                .collect();
            return Ok(known(eval_cpu(&op, &ts)?));
        }
        let mut ids = Vec::with_capacity(ins.len());
        for v in ins {
            ids.push(self.node(v)?);
        }
        Ok(Val::Node(self.add_node(op, &ids)?))
    }

    /// Adds a node through the builder (so that its named-dim shape is derived).
    fn add_node(&mut self, op: Op, ids: &[NodeId]) -> Result<NodeId> {
        let ts: Vec<Tensor> = ids.iter().map(|&i| self.b.tensor(i)).collect();
        let refs: Vec<&Tensor> = ts.iter().collect();
        match self.b.apply(op, &refs).id() {
            Some(id) => Ok(id),
            None => Err(match self.b.check() {
                Err(CompileError::Build { source, .. }) => ImportError::Op(source),
                Err(e) => ImportError::Compile(e),
                Ok(()) => ImportError::Model("a node could not be added".into()),
            }),
        }
    }

    /// A tensor of one value: known when small, else a `full` node.
    fn full(&mut self, ty: TensorType, v: f64) -> Result<Val> {
        if ty.shape.numel() <= FOLD_LIMIT {
            return Ok(known(HostTensor::full(&ty, v)));
        }
        let op = Op::Full {
            value: F64Bits::new(v),
            ty,
        };
        Ok(Val::Node(self.add_node(op, &[])?))
    }

    fn scalar(&self, v: f64, dtype: DType) -> Val {
        known(HostTensor::full(
            &TensorType::new(dtype, Shape::scalar()),
            v,
        ))
    }

    fn un(&mut self, u: UnaryOp, x: &Val) -> Result<Val> {
        self.emit(Op::Unary(u), &[x])
    }

    fn bin(&mut self, b: BinaryOp, x: &Val, y: &Val) -> Result<Val> {
        self.emit(Op::Binary(b), &[x, y])
    }

    /// `x op s` with a scalar of x's dtype.
    fn bin_s(&mut self, b: BinaryOp, x: &Val, s: f64) -> Result<Val> {
        let c = self.scalar(s, self.dtype(x));
        self.bin(b, x, &c)
    }

    /// `s op x` with a scalar of x's dtype.
    fn s_bin(&mut self, b: BinaryOp, s: f64, x: &Val) -> Result<Val> {
        let c = self.scalar(s, self.dtype(x));
        self.bin(b, &c, x)
    }

    fn cast(&mut self, x: &Val, to: DType) -> Result<Val> {
        if self.dtype(x) == to {
            return Ok(x.clone());
        }
        self.emit(Op::Cast { to }, &[x])
    }

    fn reshape(&mut self, x: &Val, dims: Vec<usize>) -> Result<Val> {
        if self.dims(x) == dims {
            return Ok(x.clone());
        }
        self.emit(
            Op::Reshape {
                shape: Shape::new(dims),
            },
            &[x],
        )
    }

    fn permute(&mut self, x: &Val, perm: Vec<usize>) -> Result<Val> {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(x.clone());
        }
        self.emit(Op::Permute { perm }, &[x])
    }

    fn expand(&mut self, x: &Val, dims: Vec<usize>) -> Result<Val> {
        if self.dims(x) == dims {
            return Ok(x.clone());
        }
        self.emit(
            Op::Expand {
                shape: Shape::new(dims),
            },
            &[x],
        )
    }

    fn reduce(&mut self, kind: ReduceKind, x: &Val, axes: Vec<usize>, keep: bool) -> Result<Val> {
        if axes.is_empty() {
            return Ok(x.clone());
        }
        self.emit(
            Op::Reduce {
                kind,
                axes,
                keep_dims: keep,
            },
            &[x],
        )
    }

    /// `x[..., start..end:step, ...]` along one axis (step >= 1).
    fn slice_axis(
        &mut self,
        x: &Val,
        axis: usize,
        start: usize,
        end: usize,
        step: usize,
    ) -> Result<Val> {
        let d = self.dims(x);
        if start == 0 && end == d[axis] && step == 1 {
            return Ok(x.clone());
        }
        let mut starts = vec![0; d.len()];
        let mut ends = d.clone();
        let mut steps = vec![1; d.len()];
        starts[axis] = start;
        ends[axis] = end;
        steps[axis] = step;
        self.emit(
            Op::Slice {
                starts,
                ends,
                steps,
            },
            &[x],
        )
    }

    /// Rows `index` of x along `axis` (indices known at import).
    fn select(&mut self, x: &Val, axis: usize, index: Vec<i64>) -> Result<Val> {
        let n = index.len();
        let idx = known(HostTensor::from_vec(index, [n])?);
        self.emit(Op::IndexSelect { axis }, &[x, &idx])
    }

    /// Indices made non-negative: `i < 0 ? i + n : i`.
    fn wrap_index(&mut self, idx: &Val, n: usize) -> Result<Val> {
        let zero = self.scalar(0.0, self.dtype(idx));
        let neg = self.bin(BinaryOp::Lt, idx, &zero)?;
        let shifted = self.bin_s(BinaryOp::Add, idx, n as f64)?;
        self.emit(Op::Where, &[&neg, &shifted, idx])
    }

    /// Constant padding of x by `(before, after)` per dim.
    fn pad_const(&mut self, x: &Val, pads: Vec<(usize, usize)>, value: f64) -> Result<Val> {
        if pads.iter().all(|&(a, b)| a == 0 && b == 0) {
            return Ok(x.clone());
        }
        self.emit(
            Op::Pad {
                pads,
                value: F64Bits::new(value),
            },
            &[x],
        )
    }

    // ---- ops ----

    fn op(&mut self, op_type: &str, cx: &Ctx) -> Result<Vec<Val>> {
        let a = &cx.attrs;
        let one = |v: Val| Ok(vec![v]);
        match op_type {
            // ---- elementwise ----
            "Add" | "Sub" | "Mul" | "Div" | "Pow" | "Equal" | "Less" | "LessOrEqual"
            | "Greater" | "GreaterOrEqual" | "And" | "Or" | "Xor" => {
                let x = self.input(cx, 0)?;
                let mut y = self.input(cx, 1)?;
                if op_type == "Pow" {
                    y = self.cast(&y, self.dtype(&x))?;
                }
                let b = match op_type {
                    "Add" => BinaryOp::Add,
                    "Sub" => BinaryOp::Sub,
                    "Mul" => BinaryOp::Mul,
                    "Div" => BinaryOp::Div,
                    "Pow" => BinaryOp::Pow,
                    "Equal" => BinaryOp::Eq,
                    "Less" => BinaryOp::Lt,
                    "LessOrEqual" => BinaryOp::Le,
                    "Greater" => BinaryOp::Gt,
                    "GreaterOrEqual" => BinaryOp::Ge,
                    "And" => BinaryOp::And,
                    "Or" => BinaryOp::Or,
                    _ => BinaryOp::Ne, // Xor of bools
                };
                if op_type == "Xor" && self.dtype(&x) != DType::Bool {
                    return why("Xor needs bool operands");
                }
                one(self.bin(b, &x, &y)?)
            }
            "Max" | "Min" | "Sum" | "Mean" => {
                let b = match op_type {
                    "Max" => BinaryOp::Maximum,
                    "Min" => BinaryOp::Minimum,
                    _ => BinaryOp::Add,
                };
                let n = cx.inputs.len();
                let mut acc = self.input(cx, 0)?;
                for k in 1..n {
                    let y = self.input(cx, k)?;
                    acc = self.bin(b, &acc, &y)?;
                }
                if op_type == "Mean" && n > 1 {
                    acc = self.bin_s(BinaryOp::Div, &acc, n as f64)?;
                }
                one(acc)
            }
            "Neg" | "Abs" | "Exp" | "Log" | "Sqrt" | "Reciprocal" | "Sin" | "Cos" | "Tanh"
            | "Sigmoid" | "Relu" | "Sign" | "Floor" | "Ceil" | "Round" | "Not" | "IsNaN" | "Erf" => {
                let u = match op_type {
                    "Neg" => UnaryOp::Neg,
                    "Abs" => UnaryOp::Abs,
                    "Exp" => UnaryOp::Exp,
                    "Log" => UnaryOp::Log,
                    "Sqrt" => UnaryOp::Sqrt,
                    "Reciprocal" => UnaryOp::Reciprocal,
                    "Sin" => UnaryOp::Sin,
                    "Cos" => UnaryOp::Cos,
                    "Tanh" => UnaryOp::Tanh,
                    "Sigmoid" => UnaryOp::Sigmoid,
                    "Relu" => UnaryOp::Relu,
                    "Sign" => UnaryOp::Sign,
                    "Floor" => UnaryOp::Floor,
                    "Ceil" => UnaryOp::Ceil,
                    "Round" => UnaryOp::Round,
                    "Not" => UnaryOp::Not,
                    "Erf" => UnaryOp::Erf,
                    _ => UnaryOp::IsNan,
                };
                let x = self.input(cx, 0)?;
                one(self.un(u, &x)?)
            }
            "Tan" => {
                let x = self.input(cx, 0)?;
                let s = self.un(UnaryOp::Sin, &x)?;
                let c = self.un(UnaryOp::Cos, &x)?;
                one(self.bin(BinaryOp::Div, &s, &c)?)
            }
            "Sinh" | "Cosh" => {
                // (eˣ ∓ e⁻ˣ) / 2
                let x = self.input(cx, 0)?;
                let e = self.un(UnaryOp::Exp, &x)?;
                let nx = self.un(UnaryOp::Neg, &x)?;
                let en = self.un(UnaryOp::Exp, &nx)?;
                let b = if op_type == "Sinh" { BinaryOp::Sub } else { BinaryOp::Add };
                let t = self.bin(b, &e, &en)?;
                one(self.bin_s(BinaryOp::Mul, &t, 0.5)?)
            }
            "Asinh" | "Acosh" => {
                // ln(x + √(x² ± 1))
                let x = self.input(cx, 0)?;
                let sq = self.bin(BinaryOp::Mul, &x, &x)?;
                let b = if op_type == "Asinh" { BinaryOp::Add } else { BinaryOp::Sub };
                let t = self.bin_s(b, &sq, 1.0)?;
                let r = self.un(UnaryOp::Sqrt, &t)?;
                let t = self.bin(BinaryOp::Add, &x, &r)?;
                one(self.un(UnaryOp::Log, &t)?)
            }
            "Atanh" => {
                // ln((1 + x) / (1 − x)) / 2
                let x = self.input(cx, 0)?;
                let p = self.s_bin(BinaryOp::Add, 1.0, &x)?;
                let m = self.s_bin(BinaryOp::Sub, 1.0, &x)?;
                let q = self.bin(BinaryOp::Div, &p, &m)?;
                let l = self.un(UnaryOp::Log, &q)?;
                one(self.bin_s(BinaryOp::Mul, &l, 0.5)?)
            }
            "Shrink" => {
                let bias = a.float("bias", 0.0)? as f64;
                let lambd = a.float("lambd", 0.5)? as f64;
                let x = self.input(cx, 0)?;
                let lo = self.bin_s(BinaryOp::Lt, &x, -lambd)?;
                let hi = self.bin_s(BinaryOp::Gt, &x, lambd)?;
                let up = self.bin_s(BinaryOp::Add, &x, bias)?;
                let down = self.bin_s(BinaryOp::Sub, &x, bias)?;
                let z = self.scalar(0.0, self.dtype(&x));
                let t = self.emit(Op::Where, &[&hi, &down, &z])?;
                one(self.emit(Op::Where, &[&lo, &up, &t])?)
            }
            "Swish" => {
                let alpha = a.float("alpha", 1.0)? as f64;
                let x = self.input(cx, 0)?;
                let ax = self.bin_s(BinaryOp::Mul, &x, alpha)?;
                let sg = self.un(UnaryOp::Sigmoid, &ax)?;
                one(self.bin(BinaryOp::Mul, &x, &sg)?)
            }
            "EyeLike" => {
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                if d.len() != 2 {
                    return why("input must be 2-D");
                }
                let k = a.int("k", 0)?;
                let dtype = match a.int_opt("dtype")? {
                    Some(c) => dtype_from_onnx(c as i32).map_err(ImportError::Model)?,
                    None => self.dtype(&x),
                };
                check_fold(d[0] * d[1], "EyeLike")?;
                let v: Vec<f64> = (0..d[0] * d[1])
                    .map(|p| ((p % d[1]) as i64 - (p / d[1]) as i64 == k) as u8 as f64)
                    .collect();
                one(known(HostTensor::from_f64_slice(&TensorType::new(dtype, d), &v)?))
            }
            "MeanVarianceNormalization" => {
                let x = self.input(cx, 0)?;
                let r = self.dims(&x).len();
                let axes = a.ints("axes")?.unwrap_or_else(|| vec![0, 2, 3]);
                let axes = norm_axes(&axes, r)?;
                one(self.normalize(&x, axes, 1e-9)?)
            }
            "GroupNormalization" => {
                let eps = a.float("epsilon", 1e-5)? as f64;
                let _ = a.int("stash_type", 1)?;
                let g = a
                    .int_opt("num_groups")?
                    .ok_or_else(|| ImportError::Model("attribute `num_groups` is required".into()))?;
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                if d.len() < 2 || g < 1 || !d[1].is_multiple_of(g as usize) {
                    return why(format!("{g} groups do not divide the channels of {:?}", d));
                }
                let g = g as usize;
                let rest: usize = d[1] / g * d[2..].iter().product::<usize>();
                let t = self.reshape(&x, vec![d[0], g, rest])?;
                let t = self.normalize(&t, vec![2], eps)?;
                let t = self.reshape(&t, d.clone())?;
                // Scale and bias per channel (opset 21) or per group (opset 18).
                let mut cd = vec![1usize; d.len()];
                cd[1] = d[1];
                let affine = |im: &mut Importer, k: usize| -> Result<Val> {
                    let v = im.input(cx, k)?;
                    let n: usize = im.dims(&v).iter().product();
                    if n == g && g != d[1] {
                        let v = im.reshape(&v, vec![g, 1])?;
                        let v = im.expand(&v, vec![g, d[1] / g])?;
                        im.reshape(&v, cd.clone())
                    } else {
                        im.reshape(&v, cd.clone())
                    }
                };
                let sc = affine(self, 1)?;
                let bi = affine(self, 2)?;
                let t = self.bin(BinaryOp::Mul, &t, &sc)?;
                one(self.bin(BinaryOp::Add, &t, &bi)?)
            }
            "CenterCropPad" => {
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                let shape = self
                    .static_ints(cx, 1, "shape")?
                    .ok_or_else(|| ImportError::Model("input 1 (shape) is required".into()))?;
                let axes = match a.ints("axes")? {
                    Some(v) => v.iter().map(|&k| norm_axis(k, d.len())).collect::<Result<Vec<_>>>()?,
                    None => (0..d.len()).collect(),
                };
                if shape.len() != axes.len() || shape.iter().any(|&v| v < 0) {
                    return why(format!("shape {shape:?} does not fit axes {axes:?}"));
                }
                let mut t = x;
                let mut pads = vec![(0usize, 0usize); d.len()];
                for (k, &ax) in axes.iter().enumerate() {
                    let (n, want) = (d[ax], shape[k] as usize);
                    if want < n {
                        let start = (n - want) / 2;
                        t = self.slice_axis(&t, ax, start, start + want, 1)?;
                    } else if want > n {
                        let before = (want - n) / 2;
                        pads[ax] = (before, want - n - before);
                    }
                }
                one(self.pad_const(&t, pads, 0.0)?)
            }
            "HannWindow" | "HammingWindow" | "BlackmanWindow" => {
                let periodic = a.int("periodic", 1)? != 0;
                let dtype = dtype_from_onnx(a.int("output_datatype", 1)? as i32)
                    .map_err(ImportError::Model)?;
                let size = self
                    .static_ints(cx, 0, "size")?
                    .and_then(|v| v.first().copied())
                    .ok_or_else(|| ImportError::Model("input 0 (size) is required".into()))?;
                if size < 0 {
                    return why(format!("size {size}"));
                }
                let n = size as usize;
                check_fold(n, op_type)?;
                let den = if periodic { n as f64 } else { n as f64 - 1.0 };
                let tau = 2.0 * std::f64::consts::PI;
                let v: Vec<f64> = (0..n)
                    .map(|k| {
                        let c = (tau * k as f64 / den).cos();
                        match op_type {
                            "HannWindow" => 0.5 - 0.5 * c,
                            "HammingWindow" => 25.0 / 46.0 - (1.0 - 25.0 / 46.0) * c,
                            _ => 0.42 - 0.5 * c + 0.08 * (2.0 * tau * k as f64 / den).cos(),
                        }
                    })
                    .collect();
                one(known(HostTensor::from_f64_slice(&TensorType::new(dtype, [n]), &v)?))
            }
            "Asin" | "Acos" | "Atan" => why(format!(
                "{op_type} has no RustyTorch op (inverse trigonometric functions are not supported)"
            )),
            "IsInf" => {
                let pos = a.int("detect_positive", 1)? != 0;
                let neg = a.int("detect_negative", 1)? != 0;
                let x = self.input(cx, 0)?;
                let inf = self.un(UnaryOp::IsInf, &x)?;
                let r = match (pos, neg) {
                    (true, true) => inf,
                    (false, false) => {
                        let f = self.scalar(0.0, DType::Bool);
                        self.bin(BinaryOp::And, &inf, &f)?
                    }
                    (p, _) => {
                        let sign = self.bin_s(if p { BinaryOp::Gt } else { BinaryOp::Lt }, &x, 0.0)?;
                        self.bin(BinaryOp::And, &inf, &sign)?
                    }
                };
                one(r)
            }
            "Identity" => one(self.input(cx, 0)?),
            "Dropout" => {
                let _ = a.float("ratio", 0.5)?;
                let _ = a.int("seed", 0)?;
                if let Some(t) = self.static_input(cx, 2, "training_mode")? {
                    if t.to_f64_vec().first().copied().unwrap_or(0.0) != 0.0 {
                        return why("training mode is not supported (inference only)");
                    }
                } else if cx.inputs.get(2).copied().flatten().is_some() {
                    return why("training_mode must be known at import");
                }
                let x = self.input(cx, 0)?;
                let mask = self.full(TensorType::new(DType::Bool, self.dims(&x)), 1.0)?;
                Ok(vec![x, mask])
            }
            "Cast" => {
                let to = a
                    .int_opt("to")?
                    .ok_or_else(|| ImportError::Model("attribute `to` is required".into()))?;
                let _ = a.int("saturate", 1)?;
                let _ = a.string("round_mode", "up")?;
                let to = dtype_from_onnx(to as i32).map_err(ImportError::Model)?;
                let x = self.input(cx, 0)?;
                one(self.cast(&x, to)?)
            }
            "CastLike" => {
                let _ = a.int("saturate", 1)?;
                let _ = a.string("round_mode", "up")?;
                let x = self.input(cx, 0)?;
                let t = self.input(cx, 1)?;
                let to = self.dtype(&t);
                one(self.cast(&x, to)?)
            }
            "Where" => {
                let c = self.input(cx, 0)?;
                let x = self.input(cx, 1)?;
                let y = self.input(cx, 2)?;
                one(self.emit(Op::Where, &[&c, &x, &y])?)
            }
            "Clip" => {
                let mut x = self.input(cx, 0)?;
                let (lo, hi) = if self.opset < 11 {
                    let lo = a.float("min", f32::MIN)? as f64;
                    let hi = a.float("max", f32::MAX)? as f64;
                    (Some(self.scalar(lo, self.dtype(&x))), Some(self.scalar(hi, self.dtype(&x))))
                } else {
                    (self.opt_input(cx, 1)?, self.opt_input(cx, 2)?)
                };
                if let Some(lo) = lo {
                    x = self.bin(BinaryOp::Maximum, &x, &lo)?;
                }
                if let Some(hi) = hi {
                    x = self.bin(BinaryOp::Minimum, &x, &hi)?;
                }
                one(x)
            }
            "LeakyRelu" => {
                let alpha = a.float("alpha", 0.01)? as f64;
                let x = self.input(cx, 0)?;
                let neg = self.bin_s(BinaryOp::Lt, &x, 0.0)?;
                let ax = self.bin_s(BinaryOp::Mul, &x, alpha)?;
                one(self.emit(Op::Where, &[&neg, &ax, &x])?)
            }
            "PRelu" => {
                let x = self.input(cx, 0)?;
                let slope = self.input(cx, 1)?;
                let neg = self.bin_s(BinaryOp::Lt, &x, 0.0)?;
                let ax = self.bin(BinaryOp::Mul, &x, &slope)?;
                let r = self.emit(Op::Where, &[&neg, &ax, &x])?;
                one(r)
            }
            "ThresholdedRelu" => {
                let alpha = a.float("alpha", 1.0)? as f64;
                let x = self.input(cx, 0)?;
                let keep = self.bin_s(BinaryOp::Gt, &x, alpha)?;
                let z = self.scalar(0.0, self.dtype(&x));
                one(self.emit(Op::Where, &[&keep, &x, &z])?)
            }
            "Elu" | "Celu" | "Selu" => {
                let x = self.input(cx, 0)?;
                let (alpha, gamma) = match op_type {
                    "Elu" => (a.float("alpha", 1.0)? as f64, 1.0),
                    "Celu" => (a.float("alpha", 1.0)? as f64, 1.0),
                    _ => (
                        a.float("alpha", 1.673_263_2)? as f64,
                        a.float("gamma", 1.050_701)? as f64,
                    ),
                };
                // Elu: x > 0 ? x : α(eˣ − 1); Celu: α(e^{x/α} − 1); Selu: γ·Elu_α.
                let e_in = if op_type == "Celu" {
                    self.bin_s(BinaryOp::Div, &x, alpha)?
                } else {
                    x.clone()
                };
                let e = self.un(UnaryOp::Exp, &e_in)?;
                let em1 = self.bin_s(BinaryOp::Sub, &e, 1.0)?;
                let neg = self.bin_s(BinaryOp::Mul, &em1, alpha)?;
                let pos = self.bin_s(BinaryOp::Gt, &x, 0.0)?;
                let mut r = self.emit(Op::Where, &[&pos, &x, &neg])?;
                if op_type == "Selu" {
                    r = self.bin_s(BinaryOp::Mul, &r, gamma)?;
                }
                one(r)
            }
            "HardSigmoid" | "HardSwish" => {
                let (alpha, beta) = if op_type == "HardSigmoid" {
                    (a.float("alpha", 0.2)? as f64, a.float("beta", 0.5)? as f64)
                } else {
                    (1.0 / 6.0, 0.5)
                };
                let x = self.input(cx, 0)?;
                let t = self.bin_s(BinaryOp::Mul, &x, alpha)?;
                let t = self.bin_s(BinaryOp::Add, &t, beta)?;
                let t = self.bin_s(BinaryOp::Maximum, &t, 0.0)?;
                let t = self.bin_s(BinaryOp::Minimum, &t, 1.0)?;
                one(if op_type == "HardSwish" {
                    self.bin(BinaryOp::Mul, &x, &t)?
                } else {
                    t
                })
            }
            "Softplus" | "Mish" => {
                // log(1 + eˣ), written as max(x, 0) + log(1 + e^{-|x|}) to stay finite.
                let x = self.input(cx, 0)?;
                let ab = self.un(UnaryOp::Abs, &x)?;
                let na = self.un(UnaryOp::Neg, &ab)?;
                let e = self.un(UnaryOp::Exp, &na)?;
                let e1 = self.bin_s(BinaryOp::Add, &e, 1.0)?;
                let l = self.un(UnaryOp::Log, &e1)?;
                let r = self.un(UnaryOp::Relu, &x)?;
                let sp = self.bin(BinaryOp::Add, &r, &l)?;
                one(if op_type == "Mish" {
                    let t = self.un(UnaryOp::Tanh, &sp)?;
                    self.bin(BinaryOp::Mul, &x, &t)?
                } else {
                    sp
                })
            }
            "Softsign" => {
                let x = self.input(cx, 0)?;
                let ab = self.un(UnaryOp::Abs, &x)?;
                let d = self.bin_s(BinaryOp::Add, &ab, 1.0)?;
                one(self.bin(BinaryOp::Div, &x, &d)?)
            }
            "Gelu" => {
                let approx = a.string("approximate", "none")?;
                let u = match approx.as_str() {
                    "none" => UnaryOp::GeluErf,
                    "tanh" => UnaryOp::GeluTanh,
                    other => return why(format!("approximate `{other}` is not supported")),
                };
                let x = self.input(cx, 0)?;
                one(self.un(u, &x)?)
            }

            // ---- linear algebra ----
            "MatMul" => {
                let x = self.input(cx, 0)?;
                let y = self.input(cx, 1)?;
                one(self.matmul(&x, &y)?)
            }
            "Gemm" => {
                let alpha = a.float("alpha", 1.0)? as f64;
                let beta = a.float("beta", 1.0)? as f64;
                let ta = a.int("transA", 0)? != 0;
                let tb = a.int("transB", 0)? != 0;
                if self.opset < 7 {
                    let _ = a.int("broadcast", 0)?;
                }
                let x = self.input(cx, 0)?;
                let y = self.input(cx, 1)?;
                let mut r = self.emit(
                    Op::Matmul {
                        trans_a: ta,
                        trans_b: tb,
                    },
                    &[&x, &y],
                )?;
                if alpha != 1.0 {
                    r = self.bin_s(BinaryOp::Mul, &r, alpha)?;
                }
                if let Some(c) = self.opt_input(cx, 2)? {
                    let c = if beta != 1.0 {
                        self.bin_s(BinaryOp::Mul, &c, beta)?
                    } else {
                        c
                    };
                    r = self.bin(BinaryOp::Add, &r, &c)?;
                }
                one(r)
            }

            // ---- reductions ----
            "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceProd" | "ReduceL1"
            | "ReduceL2" | "ReduceLogSum" | "ReduceLogSumExp" | "ReduceSumSquare" => {
                self.reduction(op_type, cx).map(|v| vec![v])
            }
            "ArgMax" | "ArgMin" => {
                let x = self.input(cx, 0)?;
                let rank = self.dims(&x).len();
                let axis = norm_axis(a.int("axis", 0)?, rank)?;
                let keep = a.int("keepdims", 1)? != 0;
                let last = a.int("select_last_index", 0)? != 0;
                let kind = if op_type == "ArgMax" {
                    ArgKind::ArgMax
                } else {
                    ArgKind::ArgMin
                };
                let n = self.dims(&x)[axis];
                let src = if last {
                    self.select(&x, axis, (0..n as i64).rev().collect())?
                } else {
                    x
                };
                let mut r = self.emit(
                    Op::ArgReduce {
                        kind,
                        axis,
                        keep_dims: keep,
                    },
                    &[&src],
                )?;
                if last {
                    // Index i of the reversed tensor is n − 1 − i of the original.
                    r = self.s_bin(BinaryOp::Sub, n as f64 - 1.0, &r)?;
                }
                one(r)
            }

            // ---- movement ----
            "Reshape" => {
                let allowzero = a.int("allowzero", 0)? != 0;
                let x = self.input(cx, 0)?;
                let spec = if self.opset < 5 {
                    a.ints("shape")?.unwrap_or_default()
                } else {
                    self.static_ints(cx, 1, "shape")?
                        .ok_or_else(|| ImportError::Model("input 1 (shape) is required".into()))?
                };
                let dims = reshape_dims(&self.dims(&x), &spec, allowzero)?;
                one(self.reshape(&x, dims)?)
            }
            "Flatten" => {
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                let axis = a.int("axis", 1)?;
                let axis = if axis == d.len() as i64 {
                    d.len()
                } else {
                    norm_axis(axis, d.len())?
                };
                let outer: usize = d[..axis].iter().product();
                let inner: usize = d[axis..].iter().product();
                one(self.reshape(&x, vec![outer, inner])?)
            }
            "Squeeze" => {
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                let axes = match a.ints("axes")? {
                    Some(v) => Some(v),
                    None => self.static_ints(cx, 1, "axes")?,
                };
                let axes = match axes {
                    Some(v) => norm_axes(&v, d.len())?,
                    None => (0..d.len()).filter(|&k| d[k] == 1).collect(),
                };
                if let Some(&k) = axes.iter().find(|&&k| d[k] != 1) {
                    return why(format!("cannot squeeze dim {k} of size {}", d[k]));
                }
                let nd: Vec<usize> = (0..d.len())
                    .filter(|k| !axes.contains(k))
                    .map(|k| d[k])
                    .collect();
                one(self.reshape(&x, nd)?)
            }
            "Unsqueeze" => {
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                let axes = match a.ints("axes")? {
                    Some(v) => v,
                    None => self.static_ints(cx, 1, "axes")?
                        .ok_or_else(|| ImportError::Model("input 1 (axes) is required".into()))?,
                };
                let r = d.len() + axes.len();
                let axes = norm_axes(&axes, r)?;
                if axes.len() != r - d.len() {
                    return why("repeated axes");
                }
                let mut it = d.iter();
                let nd: Vec<usize> = (0..r)
                    .map(|k| if axes.contains(&k) { 1 } else { *it.next().unwrap_or(&1) })
                    .collect();
                one(self.reshape(&x, nd)?)
            }
            "Transpose" => {
                let x = self.input(cx, 0)?;
                let r = self.dims(&x).len();
                let perm = match a.ints("perm")? {
                    Some(p) => p
                        .iter()
                        .map(|&v| norm_axis(v, r))
                        .collect::<Result<Vec<_>>>()?,
                    None => (0..r).rev().collect(),
                };
                one(self.permute(&x, perm)?)
            }
            "Concat" => {
                let axis = a
                    .int_opt("axis")?
                    .ok_or_else(|| ImportError::Model("attribute `axis` is required".into()))?;
                let mut parts = Vec::new();
                for k in 0..cx.inputs.len() {
                    if let Some(v) = self.opt_input(cx, k)? {
                        parts.push(v);
                    }
                }
                if parts.is_empty() {
                    return why("no inputs");
                }
                let axis = norm_axis(axis, self.dims(&parts[0]).len())?;
                // Empty parts add nothing (and the op wants each part non-empty along axis).
                let kept: Vec<Val> = parts
                    .iter()
                    .filter(|p| self.dims(p)[axis] > 0)
                    .cloned()
                    .collect();
                let parts = if kept.is_empty() { vec![parts[0].clone()] } else { kept };
                if parts.len() == 1 {
                    return one(parts[0].clone());
                }
                let refs: Vec<&Val> = parts.iter().collect();
                one(self.emit(Op::Concat { axis }, &refs)?)
            }
            "Split" => {
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                let axis = norm_axis(a.int("axis", 0)?, d.len())?;
                let n = d[axis];
                let sizes = match a.ints("split")? {
                    Some(s) => s,
                    None => match self.static_ints(cx, 1, "split")? {
                        Some(s) => s,
                        None => {
                            let k = a.int("num_outputs", cx.n_outputs as i64)?.max(1) as usize;
                            let chunk = n.div_ceil(k);
                            (0..k)
                                .map(|i| (chunk.min(n.saturating_sub(i * chunk))) as i64)
                                .collect()
                        }
                    },
                };
                if sizes.iter().any(|&s| s < 0) || sizes.iter().sum::<i64>() != n as i64 {
                    return why(format!("split sizes {sizes:?} do not add up to dim {axis} of size {n}"));
                }
                let mut outs = Vec::new();
                let mut at = 0usize;
                for &s in &sizes {
                    outs.push(self.slice_axis(&x, axis, at, at + s as usize, 1)?);
                    at += s as usize;
                }
                Ok(outs)
            }
            "Slice" => self.slice(cx).map(|v| vec![v]),
            "Expand" => {
                let x = self.input(cx, 0)?;
                let shape = self
                    .static_ints(cx, 1, "shape")?
                    .ok_or_else(|| ImportError::Model("input 1 (shape) is required".into()))?;
                if shape.iter().any(|&s| s < 0) {
                    return why(format!("negative size in shape {shape:?}"));
                }
                let target = Shape::new(shape.iter().map(|&s| s as usize).collect::<Vec<_>>());
                let Some(out) = Shape::broadcast(&Shape::new(self.dims(&x)), &target) else {
                    return why(format!(
                        "{} does not broadcast with {target}",
                        Shape::new(self.dims(&x))
                    ));
                };
                one(self.expand(&x, out.dims().to_vec())?)
            }
            "Tile" => {
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                let reps = self
                    .static_ints(cx, 1, "repeats")?
                    .ok_or_else(|| ImportError::Model("input 1 (repeats) is required".into()))?;
                if reps.len() != d.len() || reps.iter().any(|&r| r < 0) {
                    return why(format!("repeats {reps:?} do not fit rank {}", d.len()));
                }
                // [d0, d1] → [1, d0, 1, d1] → expand to [r0, d0, r1, d1] → [r0·d0, r1·d1].
                let inter: Vec<usize> = d.iter().flat_map(|&n| [1, n]).collect();
                let big: Vec<usize> = d
                    .iter()
                    .zip(&reps)
                    .flat_map(|(&n, &r)| [r as usize, n])
                    .collect();
                let fin: Vec<usize> = d.iter().zip(&reps).map(|(&n, &r)| n * r as usize).collect();
                let t = self.reshape(&x, inter)?;
                let t = self.expand(&t, big)?;
                one(self.reshape(&t, fin)?)
            }
            "Pad" => self.pad(cx).map(|v| vec![v]),
            "Gather" => {
                let x = self.input(cx, 0)?;
                let idx = self.input(cx, 1)?;
                let d = self.dims(&x);
                let axis = norm_axis(a.int("axis", 0)?, d.len())?;
                let idims = self.dims(&idx);
                let idx = self.wrap_index(&idx, d[axis])?;
                let n: usize = idims.iter().product();
                let flat = self.reshape(&idx, vec![n])?;
                let sel = self.emit(Op::IndexSelect { axis }, &[&x, &flat])?;
                let mut od = d[..axis].to_vec();
                od.extend_from_slice(&idims);
                od.extend_from_slice(&d[axis + 1..]);
                one(self.reshape(&sel, od)?)
            }
            "GatherElements" => {
                let x = self.input(cx, 0)?;
                let idx = self.input(cx, 1)?;
                let d = self.dims(&x);
                let axis = norm_axis(a.int("axis", 0)?, d.len())?;
                let idx = self.wrap_index(&idx, d[axis])?;
                one(self.emit(Op::Gather { axis }, &[&x, &idx])?)
            }
            "Shape" => {
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                let r = d.len() as i64;
                let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
                let start = clamp(a.int("start", 0)?);
                let end = clamp(a.int("end", r)?);
                let v: Vec<i64> = d[start..end.max(start)].iter().map(|&n| n as i64).collect();
                let n = v.len();
                one(known(HostTensor::from_vec(v, [n])?))
            }
            "Size" => {
                let x = self.input(cx, 0)?;
                let n = self.dims(&x).iter().product::<usize>() as i64;
                one(known(HostTensor::scalar(n)))
            }
            "Constant" => {
                let t = if let Some(t) = a.tensor("value")? {
                    tensor_from_proto(t, None)?
                } else if let Some(v) = a.find("value_float", AttributeType::Float)? {
                    HostTensor::scalar(v.f())
                } else if let Some(v) = a.floats("value_floats")? {
                    let n = v.len();
                    HostTensor::from_vec(v, [n])?
                } else if let Some(v) = a.int_opt("value_int")? {
                    HostTensor::scalar(v)
                } else if let Some(v) = a.ints("value_ints")? {
                    let n = v.len();
                    HostTensor::from_vec(v, [n])?
                } else {
                    return why("no supported value attribute (value, value_float(s), value_int(s))");
                };
                one(known(t))
            }
            "ConstantOfShape" => {
                let shape = self
                    .static_ints(cx, 0, "shape")?
                    .ok_or_else(|| ImportError::Model("input 0 (shape) is required".into()))?;
                if shape.iter().any(|&s| s < 0) {
                    return why(format!("negative size in shape {shape:?}"));
                }
                let (dtype, value) = match a.tensor("value")? {
                    Some(t) => {
                        let t = tensor_from_proto(t, None)?;
                        if t.numel() != 1 {
                            return why("value must hold one element");
                        }
                        (t.dtype(), t.to_f64_vec()[0])
                    }
                    None => (DType::F32, 0.0),
                };
                let shape = Shape::new(shape.iter().map(|&s| s as usize).collect::<Vec<_>>());
                shape.check_limits().map_err(ImportError::Model)?;
                one(self.full(TensorType::new(dtype, shape), value)?)
            }
            "Range" => {
                let get = |k: usize, what: &str| -> Result<HostTensor> {
                    self.static_input(cx, k, what)?
                        .ok_or_else(|| ImportError::Model(format!("input {k} ({what}) is required")))
                };
                let (s, l, d) = (get(0, "start")?, get(1, "limit")?, get(2, "delta")?);
                let dtype = s.dtype();
                let (s, l, d) = (s.to_f64_vec()[0], l.to_f64_vec()[0], d.to_f64_vec()[0]);
                if d == 0.0 {
                    return why("delta is 0");
                }
                let n = ((l - s) / d).ceil().max(0.0);
                check_fold(n as usize, "Range")?;
                let v: Vec<f64> = (0..n as usize).map(|i| s + i as f64 * d).collect();
                let ty = TensorType::new(dtype, [v.len()]);
                one(known(HostTensor::from_f64_slice(&ty, &v)?))
            }

            // ---- normalization ----
            "Softmax" | "LogSoftmax" => {
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                let r = d.len();
                let default = if self.opset < 13 { 1 } else { -1 };
                let axis = norm_axis(a.int("axis", default)?, r)?;
                let mk = |axis| {
                    if op_type == "Softmax" {
                        Op::Softmax { axis }
                    } else {
                        Op::LogSoftmax { axis }
                    }
                };
                if self.opset < 13 && axis + 1 != r {
                    // Older opsets coerce to 2-D at `axis` and normalize the trailing block.
                    let outer: usize = d[..axis].iter().product();
                    let inner: usize = d[axis..].iter().product();
                    let t = self.reshape(&x, vec![outer, inner])?;
                    let t = self.emit(mk(1), &[&t])?;
                    return one(self.reshape(&t, d)?);
                }
                one(self.emit(mk(axis), &[&x])?)
            }
            "LayerNormalization" => self.layer_norm(cx),
            "RMSNormalization" => {
                let eps = a.float("epsilon", 1e-5)? as f64;
                let _ = a.int("stash_type", 1)?;
                let x = self.input(cx, 0)?;
                let scale = self.input(cx, 1)?;
                let r = self.dims(&x).len();
                let axis = norm_axis(a.int("axis", -1)?, r)?;
                let last = self.dims(&x)[r - 1];
                if axis + 1 == r && self.dims(&scale) == [last] {
                    let op = Op::RmsNorm {
                        eps: F64Bits::new(eps),
                        weight: true,
                    };
                    return one(self.emit(op, &[&x, &scale])?);
                }
                // x · rsqrt(mean(x²) + ε) over the trailing dims from `axis`, then · scale.
                let sq = self.bin(BinaryOp::Mul, &x, &x)?;
                let m = self.reduce(ReduceKind::Mean, &sq, (axis..r).collect(), true)?;
                let me = self.bin_s(BinaryOp::Add, &m, eps)?;
                let rs = self.un(UnaryOp::Rsqrt, &me)?;
                let y = self.bin(BinaryOp::Mul, &x, &rs)?;
                one(self.bin(BinaryOp::Mul, &y, &scale)?)
            }
            "Attention" => self.attention(cx),
            "Trilu" => {
                // Keep j − i <= k (lower) or j − i >= k (upper) over the last two dims.
                let upper = a.int("upper", 1)? != 0;
                let x = self.input(cx, 0)?;
                let k = self
                    .static_ints(cx, 1, "k")?
                    .and_then(|v| v.first().copied())
                    .unwrap_or(0);
                let d = self.dims(&x);
                if d.len() < 2 {
                    return why("input must have rank 2 or more");
                }
                let (n, m) = (d[d.len() - 2], d[d.len() - 1]);
                check_fold(n * m, "the Trilu mask")?;
                let keep: Vec<bool> = (0..n * m)
                    .map(|p| {
                        let (i, j) = ((p / m) as i64, (p % m) as i64);
                        if upper {
                            j - i >= k
                        } else {
                            j - i <= k
                        }
                    })
                    .collect();
                let keep = known(HostTensor::from_vec(keep, [n, m])?);
                let z = self.scalar(0.0, self.dtype(&x));
                one(self.emit(Op::Where, &[&keep, &x, &z])?)
            }
            "Hardmax" => {
                // One-hot of the first maximum along `axis`.
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                let axis = norm_axis(a.int("axis", -1)?, d.len())?;
                let am = self.emit(
                    Op::ArgReduce {
                        kind: ArgKind::ArgMax,
                        axis,
                        keep_dims: true,
                    },
                    &[&x],
                )?;
                let mut id = vec![1usize; d.len()];
                id[axis] = d[axis];
                check_fold(d[axis], "the Hardmax axis")?;
                let iota = known(HostTensor::from_vec((0..d[axis] as i64).collect::<Vec<_>>(), id)?);
                let hit = self.bin(BinaryOp::Eq, &am, &iota)?;
                one(self.cast(&hit, self.dtype(&x))?)
            }
            "LpNormalization" => {
                // x / ‖x‖ₚ along `axis` (p = 1 or 2).
                let x = self.input(cx, 0)?;
                let axis = norm_axis(a.int("axis", -1)?, self.dims(&x).len())?;
                let p = a.int("p", 2)?;
                let norm = match p {
                    1 => {
                        let t = self.un(UnaryOp::Abs, &x)?;
                        self.reduce(ReduceKind::Sum, &t, vec![axis], true)?
                    }
                    2 => {
                        let t = self.bin(BinaryOp::Mul, &x, &x)?;
                        let t = self.reduce(ReduceKind::Sum, &t, vec![axis], true)?;
                        self.un(UnaryOp::Sqrt, &t)?
                    }
                    other => return why(format!("p = {other} is not supported (1 or 2)")),
                };
                one(self.bin(BinaryOp::Div, &x, &norm)?)
            }
            "NegativeLogLikelihoodLoss" => {
                let x = self.input(cx, 0)?;
                let t = self.input(cx, 1)?;
                let w = self.opt_input(cx, 2)?;
                one(self.nll(cx, &x, &t, w.as_ref())?)
            }
            "SoftmaxCrossEntropyLoss" => {
                let x = self.input(cx, 0)?;
                let t = self.input(cx, 1)?;
                let w = self.opt_input(cx, 2)?;
                let lp = self.emit(Op::LogSoftmax { axis: 1 }, &[&x])?;
                let loss = self.nll(cx, &lp, &t, w.as_ref())?;
                Ok(vec![loss, lp])
            }
            "BatchNormalization" => {
                let eps = a.float("epsilon", 1e-5)? as f64;
                let _ = a.float("momentum", 0.9)?;
                if a.int("training_mode", 0)? != 0 {
                    return why("training_mode=1 is not supported (inference only)");
                }
                if self.opset < 9 {
                    if let Some(s) = a.int_opt("spatial")? {
                        if s != 1 {
                            return why("spatial=0 is not supported");
                        }
                    }
                }
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                let mut shape = vec![1usize; d.len().max(2)];
                shape[1] = d.get(1).copied().unwrap_or(1);
                let mut p = Vec::new();
                for k in 1..5 {
                    let v = self.input(cx, k)?;
                    let v = self.reshape(&v, shape[..d.len().max(1)].to_vec())?;
                    p.push(v);
                }
                // y = x·s + (b − m·s) with s = scale / √(var + ε).
                let ve = self.bin_s(BinaryOp::Add, &p[3], eps)?;
                let sd = self.un(UnaryOp::Sqrt, &ve)?;
                let s = self.bin(BinaryOp::Div, &p[0], &sd)?;
                let ms = self.bin(BinaryOp::Mul, &p[2], &s)?;
                let shift = self.bin(BinaryOp::Sub, &p[1], &ms)?;
                let xs = self.bin(BinaryOp::Mul, &x, &s)?;
                one(self.bin(BinaryOp::Add, &xs, &shift)?)
            }
            "InstanceNormalization" => {
                let eps = a.float("epsilon", 1e-5)? as f64;
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                if d.len() < 3 {
                    return why("input must be N×C×spatial");
                }
                let axes: Vec<usize> = (2..d.len()).collect();
                let mut shape = vec![1usize; d.len()];
                shape[1] = d[1];
                let scale = self.input(cx, 1)?;
                let scale = self.reshape(&scale, shape.clone())?;
                let bias = self.input(cx, 2)?;
                let bias = self.reshape(&bias, shape)?;
                let y = self.normalize(&x, axes, eps)?;
                let y = self.bin(BinaryOp::Mul, &y, &scale)?;
                one(self.bin(BinaryOp::Add, &y, &bias)?)
            }

            // ---- convolution and pooling ----
            "Conv" => self.conv(cx).map(|v| vec![v]),
            "ConvTranspose" => self.conv_transpose(cx).map(|v| vec![v]),
            "DepthToSpace" | "SpaceToDepth" => {
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                let b = a.int("blocksize", 0)?;
                if d.len() != 4 || b < 1 {
                    return why("needs a 4-D input and a positive blocksize");
                }
                let b = b as usize;
                let (n, c, h, w) = (d[0], d[1], d[2], d[3]);
                if op_type == "DepthToSpace" {
                    let crd = a.string("mode", "DCR")? == "CRD";
                    if !c.is_multiple_of(b * b) {
                        return why(format!("{c} channels do not divide by blocksize² {}", b * b));
                    }
                    let c2 = c / (b * b);
                    let (t, perm) = if crd {
                        (self.reshape(&x, vec![n, c2, b, b, h, w])?, vec![0, 1, 4, 2, 5, 3])
                    } else {
                        (self.reshape(&x, vec![n, b, b, c2, h, w])?, vec![0, 3, 4, 1, 5, 2])
                    };
                    let t = self.permute(&t, perm)?;
                    one(self.reshape(&t, vec![n, c2, h * b, w * b])?)
                } else {
                    if !h.is_multiple_of(b) || !w.is_multiple_of(b) {
                        return why(format!("{h}×{w} does not divide by blocksize {b}"));
                    }
                    let t = self.reshape(&x, vec![n, c, h / b, b, w / b, b])?;
                    let t = self.permute(&t, vec![0, 3, 5, 1, 2, 4])?;
                    one(self.reshape(&t, vec![n, c * b * b, h / b, w / b])?)
                }
            }
            "MaxPool" | "AveragePool" => self.pool(op_type, cx),
            "LpPool" => {
                // (Σ over the zero-padded window of |x|^p)^(1/p): an average pool counting the
                // padding, times the window size.
                let x = self.input(cx, 0)?;
                let dx = self.dims(&x);
                if dx.len() < 3 {
                    return why("input must be N×C×spatial");
                }
                let s = dx.len() - 2;
                let kernel: Vec<usize> = a
                    .ints("kernel_shape")?
                    .ok_or_else(|| ImportError::Model("attribute `kernel_shape` is required".into()))?
                    .iter()
                    .map(|&v| v.max(1) as usize)
                    .collect();
                if kernel.len() != s {
                    return why(format!("kernel_shape {kernel:?} does not fit {s} spatial dims"));
                }
                let strides = self.spatial_attr(cx, "strides", s)?;
                let dilations = self.spatial_attr(cx, "dilations", s)?;
                if dilations.iter().any(|&d| d != 1) {
                    return why(format!("dilations {dilations:?} are not supported (only 1)"));
                }
                if a.int("ceil_mode", 0)? != 0 {
                    return why("ceil_mode=1 is not supported");
                }
                let p = a.int("p", 2)?;
                if p < 1 {
                    return why(format!("p = {p}"));
                }
                let pads = self.spatial_pads(cx, &dx[2..], &kernel, &strides, &dilations)?;
                let ab = self.un(UnaryOp::Abs, &x)?;
                let t = self.bin_s(BinaryOp::Pow, &ab, p as f64)?;
                let mut full = vec![(0, 0); 2];
                full.extend_from_slice(&pads);
                let t = self.pad_const(&t, full, 0.0)?;
                let op = Op::Pool {
                    kind: PoolKind::Avg {
                        count_include_pad: true,
                    },
                    kernel: kernel.clone(),
                    geom: ConvGeom {
                        stride: strides,
                        padding: vec![0; s],
                        dilation: vec![1; s],
                        layout: Default::default(),
                    },
                };
                let avg = self.emit(op, &[&t])?;
                let sum = self.bin_s(BinaryOp::Mul, &avg, kernel.iter().product::<usize>() as f64)?;
                one(self.bin_s(BinaryOp::Pow, &sum, 1.0 / p as f64)?)
            }
            "GlobalAveragePool" | "GlobalMaxPool" => {
                let x = self.input(cx, 0)?;
                let r = self.dims(&x).len();
                let kind = if op_type == "GlobalMaxPool" {
                    ReduceKind::Max
                } else {
                    ReduceKind::Mean
                };
                one(self.reduce(kind, &x, (2..r).collect(), true)?)
            }
            "OneHot" => self.one_hot(cx).map(|v| vec![v]),
            "CumSum" => {
                let exclusive = a.int("exclusive", 0)? != 0;
                let reverse = a.int("reverse", 0)? != 0;
                let x = self.input(cx, 0)?;
                let axis = self
                    .static_ints(cx, 1, "axis")?
                    .and_then(|v| v.first().copied())
                    .ok_or_else(|| ImportError::Model("input 1 (axis) is required".into()))?;
                let axis = norm_axis(axis, self.dims(&x).len())?;
                let op = Op::CumSum {
                    axis,
                    exclusive,
                    reverse,
                };
                one(self.emit(op, &[&x])?)
            }
            "TopK" => {
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                let axis = norm_axis(a.int("axis", -1)?, d.len())?;
                let largest = a.int("largest", 1)? != 0;
                // Unsorted results may come in any order: sorted ones are that too.
                let _ = a.int("sorted", 1)?;
                let k = match a.int_opt("k")? {
                    Some(k) => k,
                    None => self
                        .static_ints(cx, 1, "K")?
                        .and_then(|v| v.first().copied())
                        .ok_or_else(|| ImportError::Model("input 1 (K) is required".into()))?,
                };
                if k < 0 || k as usize > d[axis] {
                    return why(format!("k {k} is out of range for dim {axis} of size {}", d[axis]));
                }
                let op = Op::TopK {
                    axis,
                    k: k as usize,
                    largest,
                };
                let idx = self.emit(op, &[&x])?;
                let vals = self.emit(Op::Gather { axis }, &[&x, &idx])?;
                Ok(vec![vals, idx])
            }
            "LRN" => {
                // x / (bias + α/size · Σ x² over `size` neighbouring channels)^β; the channel
                // window sum as an average pool over [N, 1, C, rest] with zero padding.
                let alpha = a.float("alpha", 1e-4)? as f64;
                let beta = a.float("beta", 0.75)? as f64;
                let bias = a.float("bias", 1.0)? as f64;
                let size = a
                    .int_opt("size")?
                    .ok_or_else(|| ImportError::Model("attribute `size` is required".into()))?;
                if size < 1 {
                    return why(format!("size {size}"));
                }
                let size = size as usize;
                let x = self.input(cx, 0)?;
                let d = self.dims(&x);
                if d.len() < 3 {
                    return why("input must be N×C×spatial");
                }
                let rest: usize = d[2..].iter().product();
                let sq = self.bin(BinaryOp::Mul, &x, &x)?;
                let sq = self.reshape(&sq, vec![d[0], 1, d[1], rest])?;
                let lo = (size - 1) / 2;
                let sq = self.pad_const(&sq, vec![(0, 0), (0, 0), (lo, size - 1 - lo), (0, 0)], 0.0)?;
                let pool = Op::Pool {
                    kind: PoolKind::Avg {
                        count_include_pad: true,
                    },
                    kernel: vec![size, 1],
                    geom: ConvGeom {
                        stride: vec![1, 1],
                        padding: vec![0, 0],
                        dilation: vec![1, 1],
                        layout: Default::default(),
                    },
                };
                let avg = self.emit(pool, &[&sq])?;
                let avg = self.reshape(&avg, d)?;
                // α/size · Σ = α · average.
                let t = self.bin_s(BinaryOp::Mul, &avg, alpha)?;
                let t = self.bin_s(BinaryOp::Add, &t, bias)?;
                let t = self.bin_s(BinaryOp::Pow, &t, beta)?;
                one(self.bin(BinaryOp::Div, &x, &t)?)
            }
            "Mod" => self.modulo(cx).map(|v| vec![v]),
            "GatherND" => {
                if a.int("batch_dims", 0)? != 0 {
                    return why("batch_dims other than 0 are not supported");
                }
                let x = self.input(cx, 0)?;
                let idx = self.input(cx, 1)?;
                let (lin, rest) = self.linear_index(&x, &idx)?;
                let d = self.dims(&x);
                let m = d.len() - rest.len();
                let mut flat = vec![d[..m].iter().product::<usize>()];
                flat.extend_from_slice(&rest);
                let xf = self.reshape(&x, flat)?;
                let ld = self.dims(&lin);
                let n: usize = ld.iter().product();
                let l1 = self.reshape(&lin, vec![n])?;
                let sel = self.emit(Op::IndexSelect { axis: 0 }, &[&xf, &l1])?;
                let mut od = ld;
                od.extend_from_slice(&rest);
                one(self.reshape(&sel, od)?)
            }
            "ScatterElements" | "Scatter" => {
                let red = a.string("reduction", "none")?;
                let x = self.input(cx, 0)?;
                let idx = self.input(cx, 1)?;
                let upd = self.input(cx, 2)?;
                let d = self.dims(&x);
                let axis = norm_axis(a.int("axis", 0)?, d.len())?;
                let idx = self.cast(&idx, DType::I64)?;
                let idx = self.wrap_index(&idx, d[axis])?;
                let op = Op::ScatterAdd { axis };
                one(self.scatter(op, &x, &idx, &upd, &red)?)
            }
            "ScatterND" => {
                let red = a.string("reduction", "none")?;
                let x = self.input(cx, 0)?;
                let idx = self.input(cx, 1)?;
                let upd = self.input(cx, 2)?;
                let (lin, rest) = self.linear_index(&x, &idx)?;
                let d = self.dims(&x);
                let m = d.len() - rest.len();
                let mut flat = vec![d[..m].iter().product::<usize>()];
                flat.extend_from_slice(&rest);
                let xf = self.reshape(&x, flat)?;
                let n: usize = self.dims(&lin).iter().product();
                let l1 = self.reshape(&lin, vec![n])?;
                let mut ud = vec![n];
                ud.extend_from_slice(&rest);
                let uf = self.reshape(&upd, ud)?;
                let out = self.scatter(Op::IndexAdd { axis: 0 }, &xf, &l1, &uf, &red)?;
                one(self.reshape(&out, d)?)
            }
            "Einsum" => {
                let eq = a.string("equation", "")?;
                let mut ops = Vec::new();
                for k in 0..cx.inputs.len() {
                    ops.push(self.input(cx, k)?);
                }
                one(self.einsum(&eq, ops)?)
            }
            "Resize" | "Upsample" => self.resize(op_type, cx).map(|v| vec![v]),
            other => why(format!(
                "{other} is not supported by the importer (`rustytorch import --supported-ops` lists what is)"
            )),
        }
    }

    /// OneHot: `where(index == iota, on, off)` with the new axis at `axis`.
    fn one_hot(&mut self, cx: &Ctx) -> Result<Val> {
        let idx = self.input(cx, 0)?;
        let depth = self
            .static_input(cx, 1, "depth")?
            .ok_or_else(|| ImportError::Model("input 1 (depth) is required".into()))?;
        let depth = depth.to_f64_vec().first().copied().unwrap_or(0.0);
        if !(1.0..=1e7).contains(&depth) {
            return why(format!("depth {depth} is out of range"));
        }
        let depth = depth as usize;
        let values = self.input(cx, 2)?;
        if self.dims(&values).iter().product::<usize>() != 2 {
            return why("values must hold two elements (off, on)");
        }
        let idims = self.dims(&idx);
        let r = idims.len() + 1;
        let axis = norm_axis(cx.attrs.int("axis", -1)?, r)?;
        let idx = if self.dtype(&idx).is_float() {
            self.un(UnaryOp::Floor, &idx)?
        } else {
            idx
        };
        let idx = self.cast(&idx, DType::I64)?;
        let idx = self.wrap_index(&idx, depth)?;
        let mut ud = idims.clone();
        ud.insert(axis, 1);
        let u = self.reshape(&idx, ud)?;
        let mut id = vec![1usize; r];
        id[axis] = depth;
        let iota = known(HostTensor::from_vec(
            (0..depth as i64).collect::<Vec<_>>(),
            id,
        )?);
        let hit = self.bin(BinaryOp::Eq, &u, &iota)?;
        let flat = self.reshape(&values, vec![2])?;
        let off = self.slice_axis(&flat, 0, 0, 1, 1)?;
        let off = self.reshape(&off, vec![])?;
        let on = self.slice_axis(&flat, 0, 1, 2, 1)?;
        let on = self.reshape(&on, vec![])?;
        self.emit(Op::Where, &[&hit, &on, &off])
    }

    /// Mod: `fmod=1` takes the dividend's sign (C's fmod), `fmod=0` the divisor's (Python's %,
    /// integers only), both spelled with division.
    fn modulo(&mut self, cx: &Ctx) -> Result<Val> {
        let fmod = cx.attrs.int("fmod", 0)? != 0;
        let x = self.input(cx, 0)?;
        let y = self.input(cx, 1)?;
        let float = self.dtype(&x).is_float();
        if float && !fmod {
            return why("fmod=0 needs integer operands");
        }
        // r = x − y·trunc(x / y) (integer division truncates).
        let q = self.bin(BinaryOp::Div, &x, &y)?;
        let q = if float {
            let neg = self.bin_s(BinaryOp::Lt, &q, 0.0)?;
            let c = self.un(UnaryOp::Ceil, &q)?;
            let f = self.un(UnaryOp::Floor, &q)?;
            self.emit(Op::Where, &[&neg, &c, &f])?
        } else {
            q
        };
        let p = self.bin(BinaryOp::Mul, &y, &q)?;
        let r = self.bin(BinaryOp::Sub, &x, &p)?;
        if fmod {
            return Ok(r);
        }
        // Python's sign: a nonzero remainder whose sign differs from the divisor's gets + y.
        let nz = self.bin_s(BinaryOp::Ne, &r, 0.0)?;
        let rn = self.bin_s(BinaryOp::Lt, &r, 0.0)?;
        let yn = self.bin_s(BinaryOp::Lt, &y, 0.0)?;
        let differ = self.bin(BinaryOp::Ne, &rn, &yn)?;
        let fix = self.bin(BinaryOp::And, &nz, &differ)?;
        let ry = self.bin(BinaryOp::Add, &r, &y)?;
        self.emit(Op::Where, &[&fix, &ry, &r])
    }

    /// The row-major linear index into `x`'s first `m` dims of each `m`-vector of `idx`
    /// (`[..., m]`, negatives wrapped), and `x`'s remaining dims.
    fn linear_index(&mut self, x: &Val, idx: &Val) -> Result<(Val, Vec<usize>)> {
        let d = self.dims(x);
        let id = self.dims(idx);
        let Some(&m) = id.last() else {
            return why("indices must have rank 1 or more");
        };
        if m > d.len() {
            return why(format!("index vectors of length {m} for rank {}", d.len()));
        }
        let idx = self.cast(idx, DType::I64)?;
        let sizes = known(HostTensor::from_vec(
            d[..m].iter().map(|&n| n as i64).collect::<Vec<_>>(),
            [m],
        )?);
        let zero = self.scalar(0.0, DType::I64);
        let neg = self.bin(BinaryOp::Lt, &idx, &zero)?;
        let shifted = self.bin(BinaryOp::Add, &idx, &sizes)?;
        let idx = self.emit(Op::Where, &[&neg, &shifted, &idx])?;
        let strides: Vec<i64> = (0..m)
            .map(|j| d[j + 1..m].iter().product::<usize>() as i64)
            .collect();
        let strides = known(HostTensor::from_vec(strides, [m])?);
        let t = self.bin(BinaryOp::Mul, &idx, &strides)?;
        let r = id.len() - 1;
        let lin = if m == 0 {
            let mut od = id[..r].to_vec();
            if od.is_empty() {
                od = vec![];
            }
            self.full(TensorType::new(DType::I64, od), 0.0)?
        } else {
            self.reduce(ReduceKind::Sum, &t, vec![r], false)?
        };
        Ok((lin, d[m..].to_vec()))
    }

    /// A scatter through an accumulating op (`scatter_add` or `index_add`) over `x`: `add`
    /// accumulates; `none` overwrites the written positions (found by scattering ones).
    fn scatter(&mut self, op: Op, x: &Val, idx: &Val, upd: &Val, reduction: &str) -> Result<Val> {
        match reduction {
            "add" => self.emit(op, &[x, idx, upd]),
            "none" => {
                let xt = self.ty(x);
                let zeros = self.full(xt, 0.0)?;
                let ones = self.full(self.ty(upd), 1.0)?;
                let count = self.emit(op.clone(), &[&zeros, idx, &ones])?;
                let hit = self.bin_s(BinaryOp::Gt, &count, 0.0)?;
                let put = self.emit(op, &[&zeros, idx, upd])?;
                self.emit(Op::Where, &[&hit, &put, x])
            }
            other => why(format!("reduction `{other}` is not supported (none, add)")),
        }
    }

    /// Einsum without ellipses or repeated letters within an operand: operands are contracted
    /// left to right as batched matmuls (permute, reshape, matmul), letters no later operand or
    /// the output needs summed out first.
    fn einsum(&mut self, eq: &str, ops: Vec<Val>) -> Result<Val> {
        let eq: String = eq.chars().filter(|c| !c.is_whitespace()).collect();
        let (lhs, rhs) = match eq.split_once("->") {
            Some((l, r)) => (l.to_string(), Some(r.to_string())),
            None => (eq.clone(), None),
        };
        // An ellipsis stands for the same trailing-aligned dims in every operand: spelled here
        // with letters the equation does not use (sizes must agree; no broadcasting).
        let spare: Vec<char> = ('A'..='Z')
            .chain('a'..='z')
            .filter(|c| !eq.contains(*c))
            .collect();
        let mut n_ell = 0usize;
        let mut terms: Vec<Vec<char>> = Vec::new();
        for (k, t) in lhs.split(',').enumerate() {
            if let Some((pre, post)) = t.split_once("...") {
                let rank = ops.get(k).map_or(0, |v| self.dims(v).len());
                let named = pre.chars().count() + post.chars().count();
                let e = rank.checked_sub(named).ok_or_else(|| {
                    ImportError::Model(format!("term `{t}` does not fit rank {rank}"))
                })?;
                if e > spare.len() {
                    return why("too many dims under the ellipsis");
                }
                n_ell = n_ell.max(e);
                let fill = &spare[spare.len() - e..];
                terms.push(
                    pre.chars()
                        .chain(fill.iter().copied())
                        .chain(post.chars())
                        .collect(),
                );
            } else {
                terms.push(t.chars().collect());
            }
        }
        let ell: Vec<char> = spare[spare.len().saturating_sub(n_ell)..].to_vec();
        let rhs = rhs.map(|r| r.replace("...", &ell.iter().collect::<String>()));
        if terms.len() != ops.len() || ops.is_empty() {
            return why(format!(
                "equation `{eq}` has {} operands, the node {}",
                terms.len(),
                ops.len()
            ));
        }
        let mut size: HashMap<char, usize> = HashMap::new();
        for (t, v) in terms.iter().zip(&ops) {
            let d = self.dims(v);
            if t.len() != d.len() || t.iter().any(|c| !c.is_ascii_alphabetic()) {
                return why(format!(
                    "term `{}` does not fit rank {}",
                    t.iter().collect::<String>(),
                    d.len()
                ));
            }
            for (k, &c) in t.iter().enumerate() {
                if t[..k].contains(&c) {
                    return why(
                        "a letter repeated within one operand (a diagonal) is not supported",
                    );
                }
                if *size.entry(c).or_insert(d[k]) != d[k] {
                    return why(format!("letter `{c}` has sizes {} and {}", size[&c], d[k]));
                }
            }
        }
        let out: Vec<char> = match rhs {
            Some(r) => r.chars().collect(),
            None => {
                let mut once: Vec<char> = size
                    .keys()
                    .copied()
                    .filter(|c| !ell.contains(c))
                    .filter(|c| terms.iter().flatten().filter(|&x| x == c).count() == 1)
                    .collect();
                once.sort_unstable();
                ell.iter().copied().chain(once).collect()
            }
        };
        if let Some(c) = out.iter().find(|c| !size.contains_key(c)) {
            return why(format!("output letter `{c}` is in no operand"));
        }
        let (mut acc, mut al) = (ops[0].clone(), terms[0].clone());
        for k in 0..ops.len() {
            // Letters still needed: the output's and later operands'.
            let later: Vec<char> = terms[k + 1..].iter().flatten().copied().collect();
            let keep = |c: &char| out.contains(c) || later.contains(c);
            if k == 0 {
                if ops.len() == 1 {
                    break;
                }
                continue;
            }
            let (b, bl) = (ops[k].clone(), terms[k].clone());
            // Sum out letters only one side has and nothing later needs.
            let (a2, al2) = self.sum_letters(&acc, &al, |c| keep(c) || bl.contains(c))?;
            let (b2, bl2) = self.sum_letters(&b, &bl, |c| keep(c) || al2.contains(c))?;
            let batch: Vec<char> = al2
                .iter()
                .copied()
                .filter(|c| bl2.contains(c) && keep(c))
                .collect();
            let con: Vec<char> = al2
                .iter()
                .copied()
                .filter(|c| bl2.contains(c) && !keep(c))
                .collect();
            let left: Vec<char> = al2.iter().copied().filter(|c| !bl2.contains(c)).collect();
            let right: Vec<char> = bl2.iter().copied().filter(|c| !al2.contains(c)).collect();
            let pos = |l: &[char], c: char| l.iter().position(|&x| x == c).unwrap_or(0);
            let n = |cs: &[char]| cs.iter().map(|c| size[c]).product::<usize>();
            let pa: Vec<usize> = batch
                .iter()
                .chain(&left)
                .chain(&con)
                .map(|&c| pos(&al2, c))
                .collect();
            let pb: Vec<usize> = batch
                .iter()
                .chain(&con)
                .chain(&right)
                .map(|&c| pos(&bl2, c))
                .collect();
            let a3 = self.permute(&a2, pa)?;
            let a3 = self.reshape(&a3, vec![n(&batch), n(&left), n(&con)])?;
            let b3 = self.permute(&b2, pb)?;
            let b3 = self.reshape(&b3, vec![n(&batch), n(&con), n(&right)])?;
            let m = self.emit(
                Op::Matmul {
                    trans_a: false,
                    trans_b: false,
                },
                &[&a3, &b3],
            )?;
            al = batch.iter().chain(&left).chain(&right).copied().collect();
            let dims: Vec<usize> = al.iter().map(|c| size[c]).collect();
            acc = self.reshape(&m, dims)?;
        }
        let (acc, al) = self.sum_letters(&acc, &al, |c| out.contains(c))?;
        let perm: Vec<usize> = out
            .iter()
            .map(|c| al.iter().position(|x| x == c).unwrap_or(0))
            .collect();
        if perm.len() != al.len() {
            return why("an output letter repeats");
        }
        self.permute(&acc, perm)
    }

    /// Sums `v` (with letters `l`) over the letters that `keep` rejects.
    fn sum_letters(
        &mut self,
        v: &Val,
        l: &[char],
        keep: impl Fn(&char) -> bool,
    ) -> Result<(Val, Vec<char>)> {
        let axes: Vec<usize> = (0..l.len()).filter(|&k| !keep(&l[k])).collect();
        let rest: Vec<char> = l.iter().copied().filter(|c| keep(c)).collect();
        Ok((self.reduce(ReduceKind::Sum, v, axes, false)?, rest))
    }

    /// Resize (and the older Upsample) in `nearest` and `linear` modes, one axis at a time:
    /// nearest is an index select, linear a weighted sum of two selects (weights folded).
    fn resize(&mut self, op_type: &str, cx: &Ctx) -> Result<Val> {
        let a = &cx.attrs;
        let x = self.input(cx, 0)?;
        let d = self.dims(&x);
        let r = d.len();
        let mode = a.string("mode", "nearest")?;
        let (mut cubic_a, mut exclude) = (-0.75, false);
        let mut axes: Option<Vec<usize>> = None;
        let (coord, nearest, scales, sizes) = if op_type == "Upsample" {
            let scales = match a.floats("scales")? {
                Some(s) => Some(s.iter().map(|&v| v as f64).collect::<Vec<_>>()),
                None => self.static_input(cx, 1, "scales")?.map(|t| t.to_f64_vec()),
            };
            ("asymmetric".to_string(), "floor".to_string(), scales, None)
        } else {
            if a.int("antialias", 0)? != 0 {
                return why("antialias=1 is not supported");
            }
            cubic_a = a.float("cubic_coeff_a", -0.75)? as f64;
            exclude = a.int("exclude_outside", 0)? != 0;
            let _ = a.float("extrapolation_value", 0.0)?;
            let policy = a.string("keep_aspect_ratio_policy", "stretch")?;
            if policy != "stretch" {
                return why(format!(
                    "keep_aspect_ratio_policy `{policy}` is not supported"
                ));
            }
            if let Some(v) = a.ints("axes")? {
                let v = v
                    .iter()
                    .map(|&k| norm_axis(k, r))
                    .collect::<Result<Vec<_>>>()?;
                axes = Some(v);
            }
            let scales = self
                .static_input(cx, 2, "scales")?
                .map(|t| t.to_f64_vec())
                .filter(|v| !v.is_empty());
            let sizes = self.static_ints(cx, 3, "sizes")?.filter(|v| !v.is_empty());
            (
                a.string("coordinate_transformation_mode", "half_pixel")?,
                a.string("nearest_mode", "round_prefer_floor")?,
                scales,
                sizes,
            )
        };
        if !matches!(
            mode.as_str(),
            "nearest" | "linear" | "bilinear" | "trilinear" | "cubic"
        ) {
            return why(format!(
                "mode `{mode}` is not supported (nearest, linear, cubic)"
            ));
        }
        let linear = mode != "nearest";
        let cubic = mode == "cubic";
        // Scales or sizes for the listed axes only: the other dims keep their size.
        let (scales, sizes) = match &axes {
            None => (scales, sizes),
            Some(ax) => {
                let spread = |v: &[f64], keep: f64| -> Result<Vec<f64>> {
                    if v.len() != ax.len() {
                        return why("scales or sizes must have one entry per listed axis");
                    }
                    let mut out = vec![keep; r];
                    for (k, &a) in ax.iter().enumerate() {
                        out[a] = v[k];
                    }
                    Ok(out)
                };
                let sc = scales.map(|v| spread(&v, 1.0)).transpose()?;
                let sz = match sizes {
                    Some(v) => {
                        let f: Vec<f64> = v.iter().map(|&x| x as f64).collect();
                        let mut full = spread(&f, 0.0)?;
                        for k in 0..r {
                            if !ax.contains(&k) {
                                full[k] = d[k] as f64;
                            }
                        }
                        Some(full.iter().map(|&x| x as i64).collect::<Vec<_>>())
                    }
                    None => None,
                };
                (sc, sz)
            }
        };
        let (outs, sc): (Vec<usize>, Vec<f64>) = match (&sizes, &scales) {
            (Some(s), _) if s.len() == r => (
                s.iter().map(|&v| v.max(0) as usize).collect(),
                s.iter()
                    .zip(&d)
                    .map(|(&o, &i)| o as f64 / i.max(1) as f64)
                    .collect(),
            ),
            (None, Some(s)) if s.len() == r => (
                s.iter()
                    .zip(&d)
                    .map(|(&f, &i)| (i as f64 * f).floor().max(0.0) as usize)
                    .collect(),
                s.clone(),
            ),
            _ => return why("one of scales or sizes must be given, one entry per dim"),
        };
        let mut t = x;
        for ax in 0..r {
            let (n_in, n_out, s) = (d[ax], outs[ax], sc[ax]);
            if n_out == n_in && s == 1.0 {
                continue;
            }
            check_fold(n_out, "the resized axis")?;
            if n_in == 0 {
                return why(format!("cannot resize dim {ax} from {n_in} to {n_out}"));
            }
            let src = |i: usize| -> Result<f64> {
                let i = i as f64;
                Ok(match coord.as_str() {
                    "half_pixel" => (i + 0.5) / s - 0.5,
                    "half_pixel_symmetric" => {
                        let adjust = n_out as f64 / (s * n_in as f64);
                        let center = n_in as f64 / 2.0;
                        center * (1.0 - adjust) + (i + 0.5) / s - 0.5
                    }
                    "pytorch_half_pixel" => {
                        if n_out > 1 {
                            (i + 0.5) / s - 0.5
                        } else {
                            0.0
                        }
                    }
                    "align_corners" => {
                        // The resized length is in·scale, unrounded (sizes give scale = out/in).
                        let len = n_in as f64 * s;
                        if len <= 1.0 {
                            0.0
                        } else {
                            i * (n_in as f64 - 1.0) / (len - 1.0)
                        }
                    }
                    "asymmetric" => i / s,
                    other => {
                        return why(format!(
                            "coordinate_transformation_mode `{other}` is not supported"
                        ))
                    }
                })
            };
            let last = n_in as i64 - 1;
            if !linear {
                let mut idx = Vec::with_capacity(n_out);
                for i in 0..n_out {
                    let x = src(i)?;
                    let k = match nearest.as_str() {
                        "round_prefer_floor" => {
                            if x.fract() == 0.5 {
                                x.floor()
                            } else {
                                x.round()
                            }
                        }
                        "round_prefer_ceil" => {
                            if x.fract() == 0.5 {
                                x.ceil()
                            } else {
                                x.round()
                            }
                        }
                        "floor" => x.floor(),
                        "ceil" => x.ceil(),
                        other => return why(format!("nearest_mode `{other}` is not supported")),
                    };
                    idx.push((k as i64).clamp(0, last));
                }
                t = self.select(&t, ax, idx)?;
            } else {
                // A weighted sum of taps: two for linear, four for cubic (Keys' kernel with
                // coefficient A; edge taps clamped, or dropped and renormalized with
                // exclude_outside).
                let taps = if cubic { 4 } else { 2 };
                let mut idx = vec![Vec::with_capacity(n_out); taps];
                let mut wts = vec![Vec::with_capacity(n_out); taps];
                let keys = |d: f64| {
                    let (d, a) = (d.abs(), cubic_a);
                    if d <= 1.0 {
                        ((a + 2.0) * d - (a + 3.0)) * d * d + 1.0
                    } else if d < 2.0 {
                        ((a * d - 5.0 * a) * d + 8.0 * a) * d - 4.0 * a
                    } else {
                        0.0
                    }
                };
                for i in 0..n_out {
                    let x = src(i)?;
                    if cubic {
                        let f = x.floor();
                        let fr = x - f;
                        let mut ws: Vec<f64> = (0..4).map(|j| keys(fr + 1.0 - j as f64)).collect();
                        let ps: Vec<i64> = (0..4).map(|j| f as i64 - 1 + j).collect();
                        if exclude {
                            for j in 0..4 {
                                if ps[j] < 0 || ps[j] > last {
                                    ws[j] = 0.0;
                                }
                            }
                            let total: f64 = ws.iter().sum();
                            if total != 0.0 {
                                ws.iter_mut().for_each(|w| *w /= total);
                            }
                        }
                        for j in 0..4 {
                            idx[j].push(ps[j].clamp(0, last));
                            wts[j].push(ws[j]);
                        }
                    } else {
                        let x = x.clamp(0.0, last as f64);
                        let f = x.floor();
                        idx[0].push(f as i64);
                        idx[1].push((f as i64 + 1).min(last));
                        wts[0].push(1.0 - (x - f));
                        wts[1].push(x - f);
                    }
                }
                let dt = self.dtype(&t);
                let mut wd = vec![1usize; r];
                wd[ax] = n_out;
                let wt = TensorType::new(dt, wd);
                let mut acc: Option<Val> = None;
                for j in 0..taps {
                    let w = known(HostTensor::from_f64_slice(&wt, &wts[j])?);
                    let sel = self.select(&t, ax, std::mem::take(&mut idx[j]))?;
                    let p = self.bin(BinaryOp::Mul, &sel, &w)?;
                    acc = Some(match acc {
                        Some(a) => self.bin(BinaryOp::Add, &a, &p)?,
                        None => p,
                    });
                }
                t = acc.expect("at least two taps");
            }
        }
        Ok(t)
    }

    /// Pooling spelled as one strided slice of the padded input per window offset: for dilated
    /// windows, and for max pooling's indices (ONNX's flattened `((n·C + c)·H + h)·W + w`, the
    /// first maximum of each window). Average pooling divides the window sums by the count of
    /// positions each window covers (a mask pooled the same way, folded at import).
    fn pool_by_slices(
        &mut self,
        column_major: bool,
        x: &Val,
        kernel: &[usize],
        strides: &[usize],
        dilations: &[usize],
        all_pads: &[(usize, usize)],
        is_max: bool,
        count_pad: bool,
        pads: &[(usize, usize)],
    ) -> Result<Vec<Val>> {
        let dx = self.dims(x);
        let s = kernel.len();
        let r = dx.len();
        let mut full = vec![(0, 0); 2];
        full.extend_from_slice(all_pads);
        let padded: Vec<usize> = (0..r).map(|k| dx[k] + full[k].0 + full[k].1).collect();
        let outs: Vec<usize> = (0..s)
            .map(|k| (padded[2 + k] - ((kernel[k] - 1) * dilations[k] + 1)) / strides[k] + 1)
            .collect();
        let offsets: Vec<Vec<usize>> = kernel.iter().fold(vec![vec![]], |acc, &kk| {
            acc.into_iter()
                .flat_map(|p| {
                    (0..kk).map(move |i| {
                        let mut q = p.clone();
                        q.push(i);
                        q
                    })
                })
                .collect()
        });
        let window = |im: &mut Importer, v: &Val, off: &[usize]| -> Result<Val> {
            let mut starts = vec![0; r];
            let mut ends = im.dims(v);
            let mut steps = vec![1; r];
            for k in 0..s {
                starts[2 + k] = off[k] * dilations[k];
                ends[2 + k] = starts[2 + k] + (outs[k] - 1) * strides[k] + 1;
                steps[2 + k] = strides[k];
            }
            im.emit(
                Op::Slice {
                    starts,
                    ends,
                    steps,
                },
                &[v],
            )
        };
        if is_max {
            let xp = self.pad_const(x, full.clone(), f64::NEG_INFINITY)?;
            // Each element's flat index, the spatial dims column-major with storage_order=1.
            let n: usize = dx.iter().product();
            let plane: usize = dx[2..].iter().product::<usize>().max(1);
            check_fold(n, "the pooling index map")?;
            let flat: Vec<i64> = (0..n)
                .map(|i| {
                    if !column_major {
                        return i as i64;
                    }
                    let (nc, mut rem) = (i / plane, i % plane);
                    let mut pos = vec![0usize; s];
                    for k in (0..s).rev() {
                        pos[k] = rem % dx[2 + k];
                        rem /= dx[2 + k];
                    }
                    let (mut at, mut stride) = (0usize, 1usize);
                    for k in 0..s {
                        at += pos[k] * stride;
                        stride *= dx[2 + k];
                    }
                    (nc * plane + at) as i64
                })
                .collect();
            let iota = known(HostTensor::from_vec(flat, dx.clone())?);
            let ip = self.pad_const(&iota, full, -1.0)?;
            let mut best = window(self, &xp, &offsets[0])?;
            let mut bidx = window(self, &ip, &offsets[0])?;
            for off in &offsets[1..] {
                let v = window(self, &xp, off)?;
                let i = window(self, &ip, off)?;
                let gt = self.bin(BinaryOp::Gt, &v, &best)?;
                best = self.emit(Op::Where, &[&gt, &v, &best])?;
                bidx = self.emit(Op::Where, &[&gt, &i, &bidx])?;
            }
            return Ok(vec![best, bidx]);
        }
        let dtype = self.dtype(x);
        let xp = self.pad_const(x, full.clone(), 0.0)?;
        let mut mdims = vec![1usize, 1];
        mdims.extend_from_slice(&dx[2..]);
        let ones = self.full(TensorType::new(dtype, mdims), 1.0)?;
        let mut mask_pads = vec![(0, 0); 2];
        if count_pad {
            mask_pads.extend_from_slice(pads);
        } else {
            mask_pads.extend(std::iter::repeat_n((0, 0), s));
        }
        let m = self.pad_const(&ones, mask_pads.clone(), 1.0)?;
        let rest: Vec<(usize, usize)> = full
            .iter()
            .zip(&mask_pads)
            .map(|(&(fb, fe), &(mb, me))| (fb - mb, fe - me))
            .collect();
        let m = self.pad_const(&m, rest, 0.0)?;
        let mut sum = window(self, &xp, &offsets[0])?;
        let mut cnt = window(self, &m, &offsets[0])?;
        for off in &offsets[1..] {
            let v = window(self, &xp, off)?;
            sum = self.bin(BinaryOp::Add, &sum, &v)?;
            let c = window(self, &m, off)?;
            cnt = self.bin(BinaryOp::Add, &cnt, &c)?;
        }
        Ok(vec![self.bin(BinaryOp::Div, &sum, &cnt)?])
    }

    /// ONNX Attention (opset 23) as the fused attention op: 3-D inputs split into heads, fewer
    /// key/value heads repeated for grouped queries, a bool (keep) or additive mask, `is_causal`
    /// as the top-left causal mask. Past keys and values, softcap and the score output are not
    /// supported; the present key and value outputs are the key and value.
    fn attention(&mut self, cx: &Ctx) -> Result<Vec<Val>> {
        let a = &cx.attrs;
        let causal = a.int("is_causal", 0)? != 0;
        let qh = a.int_opt("q_num_heads")?;
        let kvh = a.int_opt("kv_num_heads")?;
        let scale = a.find("scale", AttributeType::Float)?.map(|s| s.f() as f64);
        let softcap = a.float("softcap", 0.0)? as f64;
        let _ = a.int("softmax_precision", 0)?;
        let mode = a.int("qk_matmul_output_mode", 0)?;
        if !(0..=3).contains(&mode) {
            return why(format!("qk_matmul_output_mode {mode}"));
        }
        let want_qk = cx.n_outputs > 3;
        let past = (self.opt_input(cx, 4)?, self.opt_input(cx, 5)?);
        if cx.inputs.get(6).copied().flatten().is_some() {
            return why("nonpad_kv_seqlen is not supported");
        }
        let (q, k, v) = (self.input(cx, 0)?, self.input(cx, 1)?, self.input(cx, 2)?);
        let three = self.dims(&q).len() == 3;
        // [B, S, H·D] → [B, H, S, D].
        let heads = |im: &mut Importer, t: &Val, h: Option<i64>| -> Result<Val> {
            let d = im.dims(t);
            let Some(h) = h.filter(|&h| h > 0 && d[2].is_multiple_of(h as usize)) else {
                return why(
                    "3-D inputs need q_num_heads and kv_num_heads dividing the hidden size",
                );
            };
            let h = h as usize;
            let r = im.reshape(t, vec![d[0], d[1], h, d[2] / h])?;
            im.permute(&r, vec![0, 2, 1, 3])
        };
        let (q4, k4, v4) = if three {
            (
                heads(self, &q, qh)?,
                heads(self, &k, kvh)?,
                heads(self, &v, kvh)?,
            )
        } else {
            (q.clone(), k.clone(), v.clone())
        };
        let (dq, dk) = (self.dims(&q4), self.dims(&k4));
        if dq.len() != 4 || dk.len() != 4 || self.dims(&v4).len() != 4 {
            return why("q, k and v must be 3-D or 4-D");
        }
        // Past keys and values come first along the sequence; the totals are the present ones.
        let (k4, v4, past_len) = match past {
            (None, None) => (k4, v4, 0),
            (Some(pk), Some(pv)) => {
                let n = self.dims(&pk).get(2).copied().unwrap_or(0);
                let k = self.emit(Op::Concat { axis: 2 }, &[&pk, &k4])?;
                let v = self.emit(Op::Concat { axis: 2 }, &[&pv, &v4])?;
                (k, v, n)
            }
            _ => return why("past_key and past_value come together"),
        };
        let total = self.dims(&k4)[2];
        // Grouped queries: each key/value head serves H_q / H_kv consecutive query heads.
        let repeat = |im: &mut Importer, t: &Val| -> Result<Val> {
            let d = im.dims(t);
            if d[1] == dq[1] {
                return Ok(t.clone());
            }
            if d[1] == 0 || !dq[1].is_multiple_of(d[1]) {
                return why(format!(
                    "{} query heads do not group over {} key/value heads",
                    dq[1], d[1]
                ));
            }
            let g = dq[1] / d[1];
            let r = im.reshape(t, vec![d[0], d[1], 1, d[2], d[3]])?;
            let r = im.expand(&r, vec![d[0], d[1], g, d[2], d[3]])?;
            im.reshape(&r, vec![d[0], d[1] * g, d[2], d[3]])
        };
        let (kr, vr) = (repeat(self, &k4)?, repeat(self, &v4)?);
        let mask = self.opt_input(cx, 3)?;
        let kind = match &mask {
            None => AttnMask::None,
            Some(m) if self.dtype(m) == DType::Bool => AttnMask::Bool,
            Some(_) => AttnMask::Additive,
        };
        let scale = scale.unwrap_or(1.0 / (dq[3] as f64).sqrt());
        // Causal: query i sees keys j <= past + i (top-left without a past; bottom-right when
        // the new keys are as many as the queries).
        let causal_kind = match (causal, past_len) {
            (false, _) => Some(Causal::None),
            (true, 0) => Some(Causal::TopLeft),
            (true, p) if total - p == dq[2] => Some(Causal::BottomRight),
            _ => None,
        };
        let (y, qk) = match causal_kind {
            Some(c) if softcap == 0.0 && !want_qk => {
                let op = Op::Attention {
                    causal: c,
                    mask: kind,
                    scale: F64Bits::new(scale),
                    layout: AttnLayout::Bhsd,
                };
                let mut ins = vec![&q4, &kr, &vr];
                if let Some(m) = &mask {
                    ins.push(m);
                }
                (self.emit(op, &ins)?, None)
            }
            _ => {
                // In primitives: scores, + mask and causal bias, softcap, softmax, · v.
                let mm = |tb| Op::Matmul {
                    trans_a: false,
                    trans_b: tb,
                };
                let s0 = self.emit(mm(true), &[&q4, &kr])?;
                let s0 = self.bin_s(BinaryOp::Mul, &s0, scale)?;
                let dt = self.dtype(&q4);
                let mut s1 = s0.clone();
                if let Some(m) = &mask {
                    let bias = if self.dtype(m) == DType::Bool {
                        let z = self.scalar(0.0, dt);
                        let inf = self.scalar(f64::NEG_INFINITY, dt);
                        self.emit(Op::Where, &[m, &z, &inf])?
                    } else {
                        m.clone()
                    };
                    s1 = self.bin(BinaryOp::Add, &s1, &bias)?;
                }
                if causal {
                    let sq = dq[2];
                    check_fold(sq * total, "the causal mask")?;
                    let v: Vec<f64> = (0..sq * total)
                        .map(|p| {
                            let (i, j) = (p / total, p % total);
                            if j > past_len + i {
                                f64::NEG_INFINITY
                            } else {
                                0.0
                            }
                        })
                        .collect();
                    let cm = known(HostTensor::from_f64_slice(
                        &TensorType::new(dt, [sq, total]),
                        &v,
                    )?);
                    s1 = self.bin(BinaryOp::Add, &s1, &cm)?;
                }
                let s2 = if softcap > 0.0 {
                    let t = self.bin_s(BinaryOp::Div, &s1, softcap)?;
                    let t = self.un(UnaryOp::Tanh, &t)?;
                    self.bin_s(BinaryOp::Mul, &t, softcap)?
                } else {
                    s1.clone()
                };
                let p = self.emit(Op::Softmax { axis: 3 }, &[&s2])?;
                let y = self.emit(mm(false), &[&p, &vr])?;
                let qk = match mode {
                    0 => s0,
                    1 => s1,
                    2 => s2,
                    _ => p,
                };
                (y, Some(qk))
            }
        };
        let y = if three {
            let d = self.dims(&y);
            let t = self.permute(&y, vec![0, 2, 1, 3])?;
            self.reshape(&t, vec![d[0], d[2], d[1] * d[3]])?
        } else {
            y
        };
        let mut outs = vec![y, k4, v4];
        if let Some(qk) = qk {
            outs.push(qk);
        }
        Ok(outs)
    }

    /// The negative log-likelihood of log-probabilities `x` `[N, C, d...]` at integer targets
    /// `[N, d...]`, with optional class weights `[C]`, `ignore_index` and `reduction`
    /// (`none`, `sum`, `mean`: the weighted mean over the targets not ignored).
    fn nll(&mut self, cx: &Ctx, x: &Val, t: &Val, w: Option<&Val>) -> Result<Val> {
        let a = &cx.attrs;
        let reduction = a.string("reduction", "mean")?;
        let ignore = a.int_opt("ignore_index")?;
        let dx = self.dims(x);
        if dx.len() < 2 {
            return why("input must be N×C×...");
        }
        let c = dx[1];
        let t = self.cast(t, DType::I64)?;
        let dt = self.dtype(x);
        // Ignored targets point at class 0 and weigh nothing.
        let keep = match ignore {
            Some(i) => Some(self.bin_s(BinaryOp::Ne, &t, i as f64)?),
            None => None,
        };
        let safe = match &keep {
            Some(k) => {
                let z = self.scalar(0.0, DType::I64);
                self.emit(Op::Where, &[k, &t, &z])?
            }
            None => t.clone(),
        };
        let safe = self.wrap_index(&safe, c)?;
        let mut td = self.dims(&safe);
        td.insert(1, 1);
        let t1 = self.reshape(&safe, td)?;
        let picked = self.emit(Op::Gather { axis: 1 }, &[x, &t1])?;
        let picked = self.reshape(&picked, self.dims(&safe))?;
        let mut weight = match w {
            Some(w) => {
                let flat = self.reshape(&safe, vec![self.dims(&safe).iter().product()])?;
                let g = self.emit(Op::IndexSelect { axis: 0 }, &[w, &flat])?;
                self.reshape(&g, self.dims(&safe))?
            }
            None => self.full(TensorType::new(dt, self.dims(&safe)), 1.0)?,
        };
        if let Some(k) = &keep {
            let z = self.scalar(0.0, dt);
            weight = self.emit(Op::Where, &[k, &weight, &z])?;
        }
        let wl = self.bin(BinaryOp::Mul, &picked, &weight)?;
        let loss = self.un(UnaryOp::Neg, &wl)?;
        let all: Vec<usize> = (0..self.dims(&loss).len()).collect();
        match reduction.as_str() {
            "none" => Ok(loss),
            "sum" => self.reduce(ReduceKind::Sum, &loss, all, false),
            "mean" => {
                let s = self.reduce(ReduceKind::Sum, &loss, all.clone(), false)?;
                let n = self.reduce(ReduceKind::Sum, &weight, all, false)?;
                self.bin(BinaryOp::Div, &s, &n)
            }
            other => why(format!("reduction `{other}` is not supported")),
        }
    }

    /// numpy's matmul: 1-D operands get a dim added and removed.
    fn matmul(&mut self, x: &Val, y: &Val) -> Result<Val> {
        let (dx, dy) = (self.dims(x), self.dims(y));
        if dx.is_empty() || dy.is_empty() {
            return why("MatMul operands must have rank 1 or more");
        }
        let x2 = if dx.len() == 1 {
            self.reshape(x, vec![1, dx[0]])?
        } else {
            x.clone()
        };
        let y2 = if dy.len() == 1 {
            self.reshape(y, vec![dy[0], 1])?
        } else {
            y.clone()
        };
        let r = self.emit(
            Op::Matmul {
                trans_a: false,
                trans_b: false,
            },
            &[&x2, &y2],
        )?;
        let mut od = self.dims(&r);
        let n = od.len();
        if dy.len() == 1 {
            od.remove(n - 1);
        }
        if dx.len() == 1 {
            od.remove(n - 2);
        }
        self.reshape(&r, od)
    }

    /// The ONNX reductions (axes from the attribute before opset 18 — 13 for ReduceSum — and
    /// from input 1 after).
    fn reduction(&mut self, op_type: &str, cx: &Ctx) -> Result<Val> {
        let a = &cx.attrs;
        let x = self.input(cx, 0)?;
        let r = self.dims(&x).len();
        let keep = a.int("keepdims", 1)? != 0;
        let noop = a.int("noop_with_empty_axes", 0)? != 0;
        let axes = match a.ints("axes")? {
            Some(v) => Some(v),
            None => self.static_ints(cx, 1, "axes")?,
        };
        let axes = match axes {
            Some(v) if !v.is_empty() => norm_axes(&v, r)?,
            _ if noop => return Ok(x),
            _ => (0..r).collect(),
        };
        let sum = |im: &mut Importer, v: &Val| im.reduce(ReduceKind::Sum, v, axes.clone(), keep);
        Ok(match op_type {
            "ReduceSum" => sum(self, &x)?,
            "ReduceMean" => self.reduce(ReduceKind::Mean, &x, axes, keep)?,
            // Max and min of bools are any and all.
            "ReduceMax" if self.dtype(&x) == DType::Bool => {
                self.reduce(ReduceKind::Any, &x, axes, keep)?
            }
            "ReduceMin" if self.dtype(&x) == DType::Bool => {
                self.reduce(ReduceKind::All, &x, axes, keep)?
            }
            "ReduceMax" => self.reduce(ReduceKind::Max, &x, axes, keep)?,
            "ReduceMin" => self.reduce(ReduceKind::Min, &x, axes, keep)?,
            "ReduceProd" => self.reduce(ReduceKind::Prod, &x, axes, keep)?,
            "ReduceL1" => {
                let t = self.un(UnaryOp::Abs, &x)?;
                sum(self, &t)?
            }
            "ReduceL2" | "ReduceSumSquare" => {
                let t = self.bin(BinaryOp::Mul, &x, &x)?;
                let s = sum(self, &t)?;
                if op_type == "ReduceL2" {
                    let f = self.cast(&s, DType::F64)?;
                    let f = self.un(UnaryOp::Sqrt, &f)?;
                    self.cast(&f, self.dtype(&s))?
                } else {
                    s
                }
            }
            "ReduceLogSum" => {
                let s = sum(self, &x)?;
                self.un(UnaryOp::Log, &s)?
            }
            _ => {
                // log Σ eˣ = m + log Σ e^{x−m} with m the max.
                let m = self.reduce(ReduceKind::Max, &x, axes.clone(), true)?;
                let c = self.bin(BinaryOp::Sub, &x, &m)?;
                let e = self.un(UnaryOp::Exp, &c)?;
                let s = sum(self, &e)?;
                let l = self.un(UnaryOp::Log, &s)?;
                let m = if keep {
                    m
                } else {
                    let dims = self.dims(&l);
                    self.reshape(&m, dims)?
                };
                self.bin(BinaryOp::Add, &l, &m)?
            }
        })
    }

    fn slice(&mut self, cx: &Ctx) -> Result<Val> {
        let a = &cx.attrs;
        let x = self.input(cx, 0)?;
        let d = self.dims(&x);
        let r = d.len();
        let (starts, ends, axes, steps) = if self.opset < 10 {
            (
                a.ints("starts")?.unwrap_or_default(),
                a.ints("ends")?.unwrap_or_default(),
                a.ints("axes")?,
                None,
            )
        } else {
            let need = |v: Option<Vec<i64>>, k: usize| {
                v.ok_or_else(|| ImportError::Model(format!("input {k} is required")))
            };
            (
                need(self.static_ints(cx, 1, "starts")?, 1)?,
                need(self.static_ints(cx, 2, "ends")?, 2)?,
                self.static_ints(cx, 3, "axes")?,
                self.static_ints(cx, 4, "steps")?,
            )
        };
        let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
        let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
        if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
            return why("starts, ends, axes and steps differ in length");
        }
        let mut out = x;
        for k in 0..starts.len() {
            let axis = norm_axis(axes[k], r)?;
            let n = d[axis] as i64;
            let step = steps[k];
            if step == 0 {
                return why("step 0");
            }
            let fix = |v: i64| if v < 0 { v.saturating_add(n) } else { v };
            let (s, e) = (fix(starts[k]), fix(ends[k]));
            if step > 0 {
                let s = s.clamp(0, n) as usize;
                let e = e.clamp(0, n) as usize;
                out = self.slice_axis(&out, axis, s, e.max(s), step as usize)?;
            } else {
                let s = s.clamp(-1, n - 1);
                let e = e.clamp(-1, n - 1);
                let back = step.saturating_neg();
                let count = (s - e).max(0).saturating_add(back - 1) / back;
                check_fold(count as usize, "a reversed slice")?;
                let idx: Vec<i64> = (0..)
                    .map(|i: i64| s.saturating_add(i.saturating_mul(step)))
                    .take_while(|&i| i > e)
                    .take(n as usize)
                    .collect();
                out = self.select(&out, axis, idx)?;
            }
        }
        Ok(out)
    }

    fn pad(&mut self, cx: &Ctx) -> Result<Val> {
        let a = &cx.attrs;
        let x = self.input(cx, 0)?;
        let d = self.dims(&x);
        let r = d.len();
        let mode = a.string("mode", "constant")?;
        let (pads, value, axes) = if self.opset < 11 {
            (
                a.ints("pads")?.unwrap_or_default(),
                a.float("value", 0.0)? as f64,
                None,
            )
        } else {
            let pads = self
                .static_ints(cx, 1, "pads")?
                .ok_or_else(|| ImportError::Model("input 1 (pads) is required".into()))?;
            let value = match self.static_input(cx, 2, "constant_value")? {
                Some(t) => t.to_f64_vec().first().copied().unwrap_or(0.0),
                None => 0.0,
            };
            (pads, value, self.static_ints(cx, 3, "axes")?)
        };
        let axes = match axes {
            Some(v) => v
                .iter()
                .map(|&k| norm_axis(k, r))
                .collect::<Result<Vec<_>>>()?,
            None => (0..r).collect(),
        };
        if pads.len() != 2 * axes.len() {
            return why(format!("{} pads for {} axes", pads.len(), axes.len()));
        }
        let mut before = vec![0i64; r];
        let mut after = vec![0i64; r];
        for (k, &ax) in axes.iter().enumerate() {
            before[ax] = pads[k];
            after[ax] = pads[k + axes.len()];
        }
        // Negative pads crop.
        let mut t = x;
        for ax in 0..r {
            let (b, e) = (before[ax], after[ax]);
            if b < 0 || e < 0 {
                let n = d[ax] as i64;
                let s = (-b).max(0).min(n) as usize;
                let end = (n + e.min(0)).max(s as i64) as usize;
                t = self.slice_axis(&t, ax, s, end, 1)?;
            }
        }
        let before: Vec<usize> = before.iter().map(|&v| v.max(0) as usize).collect();
        let after: Vec<usize> = after.iter().map(|&v| v.max(0) as usize).collect();
        match mode.as_str() {
            "constant" => {
                let pads = before.into_iter().zip(after).collect();
                self.pad_const(&t, pads, value)
            }
            "edge" | "reflect" | "wrap" => {
                // A gather along each padded axis with the source index of every position.
                let cur = self.dims(&t);
                for ax in 0..r {
                    if before[ax] == 0 && after[ax] == 0 {
                        continue;
                    }
                    let n = cur[ax] as i64;
                    if n == 0 || (mode == "reflect" && n == 1) {
                        return why(format!("cannot {mode}-pad dim {ax} of size {n}"));
                    }
                    check_fold(
                        before[ax]
                            .saturating_add(n as usize)
                            .saturating_add(after[ax]),
                        "the padding index",
                    )?;
                    let idx: Vec<i64> = (-(before[ax] as i64)..n + after[ax] as i64)
                        .map(|i| match mode.as_str() {
                            "edge" => i.clamp(0, n - 1),
                            "wrap" => i.rem_euclid(n),
                            _ => {
                                let p = 2 * (n - 1);
                                let m = i.rem_euclid(p);
                                if m < n {
                                    m
                                } else {
                                    p - m
                                }
                            }
                        })
                        .collect();
                    t = self.select(&t, ax, idx)?;
                }
                Ok(t)
            }
            other => why(format!("mode `{other}` is not supported")),
        }
    }

    /// (x − mean) / √(var + ε) over `axes` (population variance), means kept as dims.
    fn normalize(&mut self, x: &Val, axes: Vec<usize>, eps: f64) -> Result<Val> {
        let m = self.reduce(ReduceKind::Mean, x, axes.clone(), true)?;
        let c = self.bin(BinaryOp::Sub, x, &m)?;
        let sq = self.bin(BinaryOp::Mul, &c, &c)?;
        let v = self.reduce(ReduceKind::Mean, &sq, axes, true)?;
        let ve = self.bin_s(BinaryOp::Add, &v, eps)?;
        let rs = self.un(UnaryOp::Rsqrt, &ve)?;
        self.bin(BinaryOp::Mul, &c, &rs)
    }

    fn layer_norm(&mut self, cx: &Ctx) -> Result<Vec<Val>> {
        let a = &cx.attrs;
        let eps = a.float("epsilon", 1e-5)? as f64;
        let _ = a.int("stash_type", 1)?;
        let x = self.input(cx, 0)?;
        let d = self.dims(&x);
        let r = d.len();
        let axis = norm_axis(a.int("axis", -1)?, r)?;
        let scale = self.input(cx, 1)?;
        let bias = self.opt_input(cx, 2)?;
        let last = d[r - 1];
        let fits = |im: &Importer, v: &Val| im.dims(v) == [last];
        if axis + 1 == r
            && cx.n_outputs <= 1
            && fits(self, &scale)
            && bias.as_ref().is_none_or(|b| fits(self, b))
        {
            let op = Op::LayerNorm {
                eps: F64Bits::new(eps),
                weight: true,
                bias: bias.is_some(),
            };
            let mut ins = vec![&x, &scale];
            if let Some(b) = &bias {
                ins.push(b);
            }
            return Ok(vec![self.emit(op, &ins)?]);
        }
        // Over several trailing dims, or with the statistics as outputs: spelled in primitives.
        let axes: Vec<usize> = (axis..r).collect();
        let m = self.reduce(ReduceKind::Mean, &x, axes.clone(), true)?;
        let c = self.bin(BinaryOp::Sub, &x, &m)?;
        let sq = self.bin(BinaryOp::Mul, &c, &c)?;
        let v = self.reduce(ReduceKind::Mean, &sq, axes, true)?;
        let ve = self.bin_s(BinaryOp::Add, &v, eps)?;
        let rs = self.un(UnaryOp::Rsqrt, &ve)?;
        let y = self.bin(BinaryOp::Mul, &c, &rs)?;
        let y = self.bin(BinaryOp::Mul, &y, &scale)?;
        let y = match &bias {
            Some(b) => self.bin(BinaryOp::Add, &y, b)?,
            None => y,
        };
        Ok(vec![y, m, rs])
    }

    /// Explicit `(before, after)` padding per spatial dim from `pads` / `auto_pad`.
    fn spatial_pads(
        &self,
        cx: &Ctx,
        input: &[usize],
        kernel: &[usize],
        strides: &[usize],
        dilations: &[usize],
    ) -> Result<Vec<(usize, usize)>> {
        let a = &cx.attrs;
        let s = input.len();
        let auto = a.string("auto_pad", "NOTSET")?;
        let pads = a.ints("pads")?;
        match auto.as_str() {
            "NOTSET" => {
                let p = pads.unwrap_or_else(|| vec![0; 2 * s]);
                if p.len() != 2 * s || p.iter().any(|&v| v < 0) {
                    return why(format!("pads {p:?} do not fit {s} spatial dims"));
                }
                Ok((0..s).map(|k| (p[k] as usize, p[k + s] as usize)).collect())
            }
            "VALID" => Ok(vec![(0, 0); s]),
            "SAME_UPPER" | "SAME_LOWER" => Ok((0..s)
                .map(|k| {
                    let out = input[k].div_ceil(strides[k]);
                    let span = (kernel[k] - 1) * dilations[k] + 1;
                    let total = ((out.max(1) - 1) * strides[k] + span).saturating_sub(input[k]);
                    let small = total / 2;
                    if auto == "SAME_UPPER" {
                        (small, total - small)
                    } else {
                        (total - small, small)
                    }
                })
                .collect()),
            other => why(format!("auto_pad `{other}` is not supported")),
        }
    }

    /// A positive per-spatial-dim attribute (strides, dilations), default all 1.
    fn spatial_attr(&self, cx: &Ctx, name: &str, s: usize) -> Result<Vec<usize>> {
        let v = cx.attrs.ints(name)?.unwrap_or_else(|| vec![1; s]);
        if v.len() != s || v.iter().any(|&x| x < 1) {
            return why(format!("{name} {v:?} do not fit {s} spatial dims"));
        }
        Ok(v.iter().map(|&x| x as usize).collect())
    }

    /// The operands and attributes a convolution and a transposed convolution share: x, w, the
    /// optional bias, x's dims, the spatial rank, groups, the kernel (checked against
    /// `kernel_shape`), strides and dilations. `what` names the op in errors.
    fn conv_parts(&mut self, cx: &Ctx, what: &str) -> Result<ConvParts> {
        let a = &cx.attrs;
        let x = self.input(cx, 0)?;
        let w = self.input(cx, 1)?;
        let b = self.opt_input(cx, 2)?;
        let (dx, dw) = (self.dims(&x), self.dims(&w));
        if dx.len() < 3 || dx.len() != dw.len() {
            return why(format!(
                "input rank {} and weight rank {} do not fit a {what}",
                dx.len(),
                dw.len()
            ));
        }
        let s = dx.len() - 2;
        let groups = a.int("group", 1)?.max(1) as usize;
        let kernel: Vec<usize> = dw[2..].to_vec();
        if let Some(k) = a.ints("kernel_shape")? {
            if k.iter().map(|&v| v as usize).collect::<Vec<_>>() != kernel {
                return why(format!(
                    "kernel_shape {k:?} differs from the weight's {kernel:?}"
                ));
            }
        }
        let strides = self.spatial_attr(cx, "strides", s)?;
        let dilations = self.spatial_attr(cx, "dilations", s)?;
        Ok(ConvParts {
            x,
            w,
            b,
            dx,
            dw,
            s,
            groups,
            kernel,
            strides,
            dilations,
        })
    }

    fn conv(&mut self, cx: &Ctx) -> Result<Val> {
        let ConvParts {
            x,
            w,
            b,
            dx,
            groups,
            kernel,
            strides,
            dilations,
            ..
        } = self.conv_parts(cx, "convolution")?;
        let pads = self.spatial_pads(cx, &dx[2..], &kernel, &strides, &dilations)?;
        let (xin, padding) = self.symmetric(&x, &pads, 0.0)?;
        let op = Op::Conv {
            geom: ConvGeom {
                stride: strides,
                padding,
                dilation: dilations,
                layout: Default::default(),
            },
            groups,
            bias: b.is_some(),
            act: rustytorch_ops::Activation::None,
        };
        let mut ins = vec![&xin, &w];
        if let Some(b) = &b {
            ins.push(b);
        }
        self.emit(op, &ins)
    }

    /// ConvTranspose as the gradient of a convolution with respect to its input (the ONNX
    /// weight `[C_in, C_out/g, k...]` is that convolution's weight), computed unpadded at full
    /// size (output padding included) and then cropped by the pads.
    fn conv_transpose(&mut self, cx: &Ctx) -> Result<Val> {
        let a = &cx.attrs;
        let ConvParts {
            x,
            w,
            b,
            dx,
            dw,
            s,
            groups,
            kernel,
            strides,
            dilations,
        } = self.conv_parts(cx, "transposed convolution")?;
        let out_pad: Vec<usize> = match a.ints("output_padding")? {
            Some(v) if v.len() == s && v.iter().all(|&p| p >= 0) => {
                v.iter().map(|&p| p as usize).collect()
            }
            Some(v) => {
                return why(format!(
                    "output_padding {v:?} does not fit {s} spatial dims"
                ))
            }
            None => vec![0; s],
        };
        if let Some(k) = out_pad.iter().zip(&strides).position(|(p, st)| p >= st) {
            return why(format!(
                "output_padding {out_pad:?} must be below the strides at dim {k}"
            ));
        }
        // Full size: s·(in − 1) + output_padding + (k − 1)·d + 1.
        let mut full: Vec<usize> = (0..s)
            .map(|k| strides[k] * (dx[2 + k] - 1) + out_pad[k] + (kernel[k] - 1) * dilations[k] + 1)
            .collect();
        let auto = a.string("auto_pad", "NOTSET")?;
        let output_shape = a.ints("output_shape")?;
        let pads_attr = a.ints("pads")?;
        let pads: Vec<(usize, usize)> = if let Some(os) = output_shape {
            let os: Vec<usize> = os[os.len().saturating_sub(s)..]
                .iter()
                .map(|&v| v.max(0) as usize)
                .collect();
            if os.len() != s {
                return why(format!("output_shape {os:?} does not fit {s} spatial dims"));
            }
            // An output larger than the full size grows at the end (a convolution of the larger
            // input still gives `x`'s size while the growth is below the stride).
            for k in 0..s {
                full[k] = full[k].max(os[k]);
            }
            (0..s)
                .map(|k| {
                    let total = full[k] - os[k];
                    if auto == "SAME_LOWER" {
                        (total - total / 2, total / 2)
                    } else {
                        (total / 2, total - total / 2)
                    }
                })
                .collect()
        } else {
            match auto.as_str() {
                "NOTSET" => {
                    let p = pads_attr.unwrap_or_else(|| vec![0; 2 * s]);
                    if p.len() != 2 * s || p.iter().any(|&v| v < 0) {
                        return why(format!("pads {p:?} do not fit {s} spatial dims"));
                    }
                    (0..s).map(|k| (p[k] as usize, p[k + s] as usize)).collect()
                }
                "VALID" => vec![(0, 0); s],
                "SAME_UPPER" | "SAME_LOWER" => (0..s)
                    .map(|k| {
                        let total = full[k].saturating_sub(dx[2 + k] * strides[k]);
                        if auto == "SAME_UPPER" {
                            (total / 2, total - total / 2)
                        } else {
                            (total - total / 2, total / 2)
                        }
                    })
                    .collect(),
                other => return why(format!("auto_pad `{other}` is not supported")),
            }
        };
        let mut input_shape = vec![dx[0], dw[1] * groups];
        input_shape.extend_from_slice(&full);
        let op = Op::ConvGradInput {
            geom: ConvGeom {
                stride: strides,
                padding: vec![0; s],
                dilation: dilations,
                layout: Default::default(),
            },
            groups,
            input_shape: Shape::new(input_shape),
        };
        let mut y = self.emit(op, &[&x, &w])?;
        for k in 0..s {
            let (pb, pe) = pads[k];
            if pb + pe > full[k] {
                return why(format!("pads {pads:?} remove the whole output"));
            }
            y = self.slice_axis(&y, 2 + k, pb, full[k] - pe, 1)?;
        }
        if let Some(b) = b {
            let mut bd = vec![1usize; s + 2];
            bd[1] = dw[1] * groups;
            let b = self.reshape(&b, bd)?;
            y = self.bin(BinaryOp::Add, &y, &b)?;
        }
        Ok(y)
    }

    /// Splits spatial padding into a symmetric part (for the op) and an explicit `Pad` of the
    /// remainder with `fill`.
    fn symmetric(
        &mut self,
        x: &Val,
        pads: &[(usize, usize)],
        fill: f64,
    ) -> Result<(Val, Vec<usize>)> {
        if pads.iter().all(|&(b, e)| b == e) {
            return Ok((x.clone(), pads.iter().map(|p| p.0).collect()));
        }
        let mut all = vec![(0, 0); 2];
        all.extend_from_slice(pads);
        let t = self.pad_const(x, all, fill)?;
        Ok((t, vec![0; pads.len()]))
    }

    fn pool(&mut self, op_type: &str, cx: &Ctx) -> Result<Vec<Val>> {
        let a = &cx.attrs;
        let x = self.input(cx, 0)?;
        let dx = self.dims(&x);
        if dx.len() < 3 {
            return why("input must be N×C×spatial");
        }
        let s = dx.len() - 2;
        let kernel: Vec<usize> = a
            .ints("kernel_shape")?
            .ok_or_else(|| ImportError::Model("attribute `kernel_shape` is required".into()))?
            .iter()
            .map(|&v| v.max(1) as usize)
            .collect();
        if kernel.len() != s {
            return why(format!(
                "kernel_shape {kernel:?} does not fit {s} spatial dims"
            ));
        }
        let strides = self.spatial_attr(cx, "strides", s)?;
        let dilations = self.spatial_attr(cx, "dilations", s)?;
        let ceil = a.int("ceil_mode", 0)? != 0;
        let is_max = op_type == "MaxPool";
        let column_major = is_max && a.int("storage_order", 0)? != 0;
        let count_pad = !is_max && a.int("count_include_pad", 0)? != 0;
        let pads = self.spatial_pads(cx, &dx[2..], &kernel, &strides, &dilations)?;
        // ceil_mode: extra padding at the end so the last (partial) window is computed; a window
        // that would start in the end padding is dropped (ONNX Runtime's and PyTorch's rule).
        let mut extra = vec![0usize; s];
        // The window's extent per spatial dim, dilation included.
        let reach: Vec<usize> = (0..s).map(|k| (kernel[k] - 1) * dilations[k] + 1).collect();
        for k in 0..s {
            let (pb, pe) = pads[k];
            let len = dx[2 + k] + pb + pe;
            if len < reach[k] {
                return why(format!("kernel {kernel:?} is larger than the padded input"));
            }
            if ceil {
                let span = len - reach[k];
                let mut out = span.div_ceil(strides[k]) + 1;
                if (out - 1) * strides[k] >= dx[2 + k] + pb {
                    out -= 1;
                }
                extra[k] = ((out - 1) * strides[k] + reach[k]).saturating_sub(len);
            }
        }
        let geom = |padding: Vec<usize>| ConvGeom {
            stride: strides.clone(),
            padding,
            dilation: vec![1; s],
            layout: Default::default(),
        };
        let all_pads: Vec<(usize, usize)> = pads
            .iter()
            .zip(&extra)
            .map(|(&(b, e), &x)| (b, e + x))
            .collect();
        let want_indices = is_max && cx.n_outputs > 1;
        if column_major && !want_indices {
            return why("storage_order=1 without the indices output is not meaningful");
        }
        if dilations.iter().any(|&d| d != 1) || want_indices {
            return self.pool_by_slices(
                column_major,
                &x,
                &kernel,
                &strides,
                &dilations,
                &all_pads,
                is_max,
                count_pad,
                &pads,
            );
        }
        let wide = all_pads
            .iter()
            .zip(&kernel)
            .any(|(&(b, e), &k)| 2 * b.max(e) > k);
        if is_max {
            let (xin, padding) = if wide {
                let mut full = vec![(0, 0); 2];
                full.extend_from_slice(&all_pads);
                (self.pad_const(&x, full, f64::NEG_INFINITY)?, vec![0; s])
            } else {
                self.symmetric(&x, &all_pads, f64::NEG_INFINITY)?
            };
            let op = Op::Pool {
                kind: PoolKind::Max,
                kernel,
                geom: geom(padding),
            };
            return Ok(vec![self.emit(op, &[&xin])?]);
        }
        let simple = !wide && extra.iter().all(|&e| e == 0) && pads.iter().all(|&(b, e)| b == e);
        if simple {
            let op = Op::Pool {
                kind: PoolKind::Avg {
                    count_include_pad: count_pad,
                },
                kernel,
                geom: geom(pads.iter().map(|p| p.0).collect()),
            };
            return Ok(vec![self.emit(op, &[&x])?]);
        }
        // Uneven padding: the window sums over the zero-padded input divided by the counted
        // positions in each window (a mask pooled the same way, folded at import).
        let dtype = self.dtype(&x);
        let mut full = vec![(0, 0); 2];
        full.extend_from_slice(&all_pads);
        let xp = self.pad_const(&x, full.clone(), 0.0)?;
        let avg = |kernel: Vec<usize>| Op::Pool {
            kind: PoolKind::Avg {
                count_include_pad: true,
            },
            kernel,
            geom: geom(vec![0; s]),
        };
        let sum = self.emit(avg(kernel.clone()), &[&xp])?;
        let mut mdims = vec![1usize, 1];
        mdims.extend_from_slice(&dx[2..]);
        let ones = self.full(TensorType::new(dtype, mdims), 1.0)?;
        let mask_pads: Vec<(usize, usize)> = if count_pad {
            let mut m = vec![(0, 0); 2];
            m.extend_from_slice(&pads);
            m
        } else {
            vec![(0, 0); 2 + s]
        };
        let m = self.pad_const(&ones, mask_pads.clone(), 1.0)?;
        let rest: Vec<(usize, usize)> = full
            .iter()
            .zip(&mask_pads)
            .map(|(&(fb, fe), &(mb, me))| (fb - mb, fe - me))
            .collect();
        let m = self.pad_const(&m, rest, 0.0)?;
        let cnt = self.emit(avg(kernel), &[&m])?;
        Ok(vec![self.bin(BinaryOp::Div, &sum, &cnt)?])
    }
}

/// The dims of an ONNX Reshape: 0 copies the input's dim (unless `allowzero`), −1 is inferred.
fn reshape_dims(input: &[usize], spec: &[i64], allowzero: bool) -> Result<Vec<usize>> {
    let total: usize = input.iter().product();
    let mut dims = Vec::with_capacity(spec.len());
    let mut infer = None;
    for (k, &s) in spec.iter().enumerate() {
        match s {
            -1 if infer.is_none() => {
                infer = Some(k);
                dims.push(1);
            }
            0 if !allowzero => match input.get(k) {
                Some(&n) => dims.push(n),
                None => return why(format!("shape {spec:?}: 0 at {k} has no input dim to copy")),
            },
            s if s >= 0 => dims.push(s as usize),
            _ => return why(format!("invalid shape {spec:?}")),
        }
    }
    if let Some(k) = infer {
        let rest: usize = dims.iter().product();
        if rest == 0 || !total.is_multiple_of(rest) {
            return why(format!("shape {spec:?} does not fit {total} elements"));
        }
        dims[k] = total / rest;
    }
    if dims.iter().product::<usize>() != total {
        return why(format!(
            "shape {spec:?} does not fit {} ({total} elements)",
            Shape::new(input.to_vec())
        ));
    }
    Ok(dims)
}
