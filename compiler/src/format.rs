//! Graph files (`.rtg`): a fixed header, then a checksummed bincode body holding the graph's
//! nodes in topological order, its tables and (optionally) its parameter data.
//!
//! The layout, the body schema, the validation and the versioning policy are specified in
//! `docs/graph-format.md`. In short:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `b"RTGRAPH\0"` |
//! | 8 | 4 | format version, u32 little-endian ([`VERSION`]) |
//! | 12 | 8 | body length in bytes, u64 little-endian |
//! | 20 | 4 | CRC-32 (IEEE) of the body, u32 little-endian |
//! | 24 | body length | bincode 1.3 body: fixed-width little-endian integers |
//!
//! Loading never trusts the file: the header is checked against the file's size, the body is
//! checksummed, decoded with a byte limit equal to its length (so a hostile length can never
//! allocate more than the file holds), validated table by table, then rebuilt with
//! [`Graph::add`] (which re-infers every type) and [`Graph::verify`]. Every failure is a
//! [`CompileError::Format`] (or [`CompileError::Io`]), never a panic.

use crate::dims::{DimExpr, NamedDim};
use crate::text::dense_order;
use crate::{CompileError, Graph, Init, InputDef, NodeId, ParamDef, Result};
use bincode::Options;
use rustytorch_ops::{bf16, f16, Activation, DType, Data, HostTensor, Op, Shape, TensorType};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// The file's first eight bytes.
pub const MAGIC: [u8; 8] = *b"RTGRAPH\0";
/// The format version this build writes and the newest it reads (2 added named dims, 3 the
/// channels-last layout of convolutions and pooling, 4 attention's `[B,S,H,D]` layout in the
/// same table, 5 the table of convolution activations, 6 the table of accumulating matmuls, 7
/// the table of attention ops reading packed q, k and v).
pub const VERSION: u32 = 7;
/// The first version whose body holds named dims.
const NAMED_DIMS_VERSION: u32 = 2;
/// The first version whose body holds the table of channels-last nodes.
const LAYOUTS_VERSION: u32 = 3;
/// The first version whose layout table may name attention nodes.
const ATTN_LAYOUT_VERSION: u32 = 4;
/// The first version whose body holds the table of convolution activations.
const ACTS_VERSION: u32 = 5;
/// The first version whose body holds the table of accumulating matmuls.
const ACCUMS_VERSION: u32 = 6;
/// The first version whose body holds the table of packed attention ops.
const PACKED_VERSION: u32 = 7;
/// Bytes before the body.
pub const HEADER_LEN: usize = 24;

/// Largest tensor a file may describe (zero dims counted as one): the ops crate's limit, the same
/// for graphs built in code or read from IR text.
const MAX_ELEMENTS: u128 = rustytorch_ops::shape::MAX_ELEMENTS as u128;
/// Largest rank.
const MAX_RANK: usize = rustytorch_ops::shape::MAX_RANK;

/// Where a saved graph keeps its parameters' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamStorage {
    /// Inside the graph file's body.
    Embedded,
    /// In a safetensors file beside the graph file, named `<file name>.safetensors`; the body
    /// records that name. Written only when some parameter has values.
    Safetensors,
    /// No values: parameters keep their initializers only (a parameter whose initializer is
    /// [`Init::Data`] then loads without values).
    InitOnly,
}

// ---------------------------------------------------------------- the body schema

/// The body: everything but the header.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct GraphDef {
    /// Nodes in topological order; a node's id is its position.
    nodes: Vec<NodeDef>,
    inputs: Vec<InputDecl>,
    params: Vec<ParamDecl>,
    constants: Vec<TensorDef>,
    outputs: Vec<(String, u32)>,
    /// (parameter index, node)
    updates: Vec<(u32, u32)>,
    guards: Vec<(String, u32)>,
    /// The safetensors file (a plain file name in the graph file's folder) holding the values of
    /// the parameters marked [`ParamData::Sidecar`].
    sidecar: Option<String>,
    /// Named dims with their default sizes (version 2).
    dims: Vec<DimDecl>,
    /// (node, its shape as dim expressions) for the nodes whose shape depends on named dims
    /// (version 2).
    shapes: Vec<(u32, Vec<DimDef>)>,
    /// The convolution and pooling nodes whose geometry is channels-last, ascending (version 3;
    /// the layout is not part of an op's own encoding, so older files read as channels-first).
    layouts: Vec<u32>,
    /// The convolutions with an activation and that activation, ascending by node (version 5;
    /// the activation is not part of the op's own encoding, so older files read without one).
    acts: Vec<(u32, Activation)>,
    /// The `matmul_epilogue` nodes with an accumulated operand, ascending (version 6; the flag
    /// is not part of the op's own encoding, so older files read without one).
    accums: Vec<u32>,
    /// The attention and attention-gradient nodes reading packed q, k and v, ascending
    /// (version 7; the layout is not part of the op's own encoding).
    packed: Vec<u32>,
}

/// The body of version 6: [`GraphDef`] without the table of packed attention ops.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct GraphDefV6 {
    nodes: Vec<NodeDef>,
    inputs: Vec<InputDecl>,
    params: Vec<ParamDecl>,
    constants: Vec<TensorDef>,
    outputs: Vec<(String, u32)>,
    updates: Vec<(u32, u32)>,
    guards: Vec<(String, u32)>,
    sidecar: Option<String>,
    dims: Vec<DimDecl>,
    shapes: Vec<(u32, Vec<DimDef>)>,
    layouts: Vec<u32>,
    acts: Vec<(u32, Activation)>,
    accums: Vec<u32>,
}

impl From<GraphDefV6> for GraphDef {
    fn from(d: GraphDefV6) -> GraphDef {
        GraphDef {
            nodes: d.nodes,
            inputs: d.inputs,
            params: d.params,
            constants: d.constants,
            outputs: d.outputs,
            updates: d.updates,
            guards: d.guards,
            sidecar: d.sidecar,
            dims: d.dims,
            shapes: d.shapes,
            layouts: d.layouts,
            acts: d.acts,
            accums: d.accums,
            packed: Vec::new(),
        }
    }
}

/// The body of version 5: [`GraphDef`] without the table of accumulating matmuls.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct GraphDefV5 {
    nodes: Vec<NodeDef>,
    inputs: Vec<InputDecl>,
    params: Vec<ParamDecl>,
    constants: Vec<TensorDef>,
    outputs: Vec<(String, u32)>,
    updates: Vec<(u32, u32)>,
    guards: Vec<(String, u32)>,
    sidecar: Option<String>,
    dims: Vec<DimDecl>,
    shapes: Vec<(u32, Vec<DimDef>)>,
    layouts: Vec<u32>,
    acts: Vec<(u32, Activation)>,
}

impl From<GraphDefV5> for GraphDef {
    fn from(d: GraphDefV5) -> GraphDef {
        GraphDef {
            nodes: d.nodes,
            inputs: d.inputs,
            params: d.params,
            constants: d.constants,
            outputs: d.outputs,
            updates: d.updates,
            guards: d.guards,
            sidecar: d.sidecar,
            dims: d.dims,
            shapes: d.shapes,
            layouts: d.layouts,
            acts: d.acts,
            accums: Vec::new(),
            packed: Vec::new(),
        }
    }
}

/// The body of versions 3 and 4: [`GraphDef`] without the table of convolution activations.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct GraphDefV4 {
    nodes: Vec<NodeDef>,
    inputs: Vec<InputDecl>,
    params: Vec<ParamDecl>,
    constants: Vec<TensorDef>,
    outputs: Vec<(String, u32)>,
    updates: Vec<(u32, u32)>,
    guards: Vec<(String, u32)>,
    sidecar: Option<String>,
    dims: Vec<DimDecl>,
    shapes: Vec<(u32, Vec<DimDef>)>,
    layouts: Vec<u32>,
}

impl From<GraphDefV4> for GraphDef {
    fn from(d: GraphDefV4) -> GraphDef {
        GraphDef {
            nodes: d.nodes,
            inputs: d.inputs,
            params: d.params,
            constants: d.constants,
            outputs: d.outputs,
            updates: d.updates,
            guards: d.guards,
            sidecar: d.sidecar,
            dims: d.dims,
            shapes: d.shapes,
            layouts: d.layouts,
            acts: Vec::new(),
            accums: Vec::new(),
            packed: Vec::new(),
        }
    }
}

/// The body of version 1: [`GraphDef`] without named dims.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct GraphDefV1 {
    nodes: Vec<NodeDef>,
    inputs: Vec<InputDecl>,
    params: Vec<ParamDecl>,
    constants: Vec<TensorDef>,
    outputs: Vec<(String, u32)>,
    updates: Vec<(u32, u32)>,
    guards: Vec<(String, u32)>,
    sidecar: Option<String>,
}

impl From<GraphDefV1> for GraphDef {
    fn from(d: GraphDefV1) -> GraphDef {
        GraphDef {
            nodes: d.nodes,
            inputs: d.inputs,
            params: d.params,
            constants: d.constants,
            outputs: d.outputs,
            updates: d.updates,
            guards: d.guards,
            sidecar: d.sidecar,
            dims: Vec::new(),
            shapes: Vec::new(),
            layouts: Vec::new(),
            acts: Vec::new(),
            accums: Vec::new(),
            packed: Vec::new(),
        }
    }
}

/// The body of version 2: [`GraphDef`] without the table of channels-last nodes.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct GraphDefV2 {
    nodes: Vec<NodeDef>,
    inputs: Vec<InputDecl>,
    params: Vec<ParamDecl>,
    constants: Vec<TensorDef>,
    outputs: Vec<(String, u32)>,
    updates: Vec<(u32, u32)>,
    guards: Vec<(String, u32)>,
    sidecar: Option<String>,
    dims: Vec<DimDecl>,
    shapes: Vec<(u32, Vec<DimDef>)>,
}

impl From<GraphDefV2> for GraphDef {
    fn from(d: GraphDefV2) -> GraphDef {
        GraphDef {
            nodes: d.nodes,
            inputs: d.inputs,
            params: d.params,
            constants: d.constants,
            outputs: d.outputs,
            updates: d.updates,
            guards: d.guards,
            sidecar: d.sidecar,
            dims: d.dims,
            shapes: d.shapes,
            layouts: Vec::new(),
            acts: Vec::new(),
            accums: Vec::new(),
            packed: Vec::new(),
        }
    }
}

/// The geometry of a convolution or pooling op.
fn geom_mut(op: &mut Op) -> Option<&mut rustytorch_ops::ConvGeom> {
    match op {
        Op::Conv { geom, .. }
        | Op::ConvGradInput { geom, .. }
        | Op::ConvGradWeight { geom, .. }
        | Op::Pool { geom, .. }
        | Op::PoolGrad { geom, .. } => Some(geom),
        _ => None,
    }
}

/// Whether `op` is in the layout the `layouts` table records (channels-last, or attention's
/// `[B,S,H,D]`).
fn in_listed_layout(op: &Op) -> bool {
    match op {
        Op::Attention { layout, .. } | Op::AttentionGrad { layout, .. } => {
            *layout == rustytorch_ops::AttnLayout::Bshd
        }
        op => geom_mut(&mut op.clone())
            .is_some_and(|g| g.layout == rustytorch_ops::Layout::ChannelsLast),
    }
}

/// The node a side table's entry names, checking the entry first: after the entry before it
/// (`prev`; the tables are ascending) and in range.
fn listed_node<'a>(
    nodes: &'a mut [NodeDef],
    table: &str,
    prev: Option<u32>,
    id: u32,
) -> Result<&'a mut NodeDef> {
    if let Some(p) = prev.filter(|&p| p >= id) {
        return Err(fmt_err(format!(
            "{table}: node {id} follows node {p} (the table must be ascending)"
        )));
    }
    let n = nodes.len();
    nodes
        .get_mut(id as usize)
        .ok_or_else(|| fmt_err(format!("{table} names node {id}, but there are {n} nodes")))
}

/// Marks the nodes of the `layouts` table channels-last (attention `[B,S,H,D]`, from version 4),
/// checking the table first: ascending node ids, each a convolution, pooling or (from version
/// 4) attention node.
fn apply_layouts(def: &mut GraphDef, version: u32) -> Result<()> {
    for (k, &id) in def.layouts.iter().enumerate() {
        let prev = k.checked_sub(1).map(|j| def.layouts[j]);
        let node = listed_node(&mut def.nodes, "layouts", prev, id)?;
        let name = node.op.name();
        if let Op::Attention { layout, .. } | Op::AttentionGrad { layout, .. } = &mut node.op {
            if version >= ATTN_LAYOUT_VERSION {
                *layout = rustytorch_ops::AttnLayout::Bshd;
                continue;
            }
        }
        let geom = geom_mut(&mut node.op).ok_or_else(|| {
            fmt_err(format!(
                "layouts names node {id} ({name}), which is not a convolution or pooling{}",
                if version >= ATTN_LAYOUT_VERSION {
                    " or attention"
                } else {
                    ""
                }
            ))
        })?;
        geom.layout = rustytorch_ops::Layout::ChannelsLast;
    }
    Ok(())
}

/// Marks the attention nodes of the `packed` table as reading packed q, k and v, checking it
/// first: ascending node ids, each an attention or attention-gradient node.
fn apply_packed(def: &mut GraphDef) -> Result<()> {
    for (k, &id) in def.packed.iter().enumerate() {
        let prev = k.checked_sub(1).map(|j| def.packed[j]);
        let node = listed_node(&mut def.nodes, "packed", prev, id)?;
        let name = node.op.name();
        match &mut node.op {
            Op::Attention { layout, .. } | Op::AttentionGrad { layout, .. } => {
                *layout = rustytorch_ops::AttnLayout::Packed;
            }
            _ => {
                return Err(fmt_err(format!(
                    "packed names node {id} ({name}), which is not attention"
                )))
            }
        }
    }
    Ok(())
}

/// Marks the matmuls of the `accums` table as accumulating, checking it first: ascending node
/// ids, each a `matmul_epilogue`.
fn apply_accums(def: &mut GraphDef) -> Result<()> {
    for (k, &id) in def.accums.iter().enumerate() {
        let prev = k.checked_sub(1).map(|j| def.accums[j]);
        let node = listed_node(&mut def.nodes, "accums", prev, id)?;
        let name = node.op.name();
        match &mut node.op {
            Op::MatmulEpilogue { accumulate, .. } => *accumulate = true,
            _ => {
                return Err(fmt_err(format!(
                    "accums names node {id} ({name}), which is not a matmul_epilogue"
                )))
            }
        }
    }
    Ok(())
}

/// Sets the activations of the convolutions in the `acts` table, checking it first: ascending
/// node ids, each a convolution, no `None` entries.
fn apply_acts(def: &mut GraphDef) -> Result<()> {
    for (k, &(id, a)) in def.acts.iter().enumerate() {
        let prev = k.checked_sub(1).map(|j| def.acts[j].0);
        let node = listed_node(&mut def.nodes, "acts", prev, id)?;
        let name = node.op.name();
        match &mut node.op {
            Op::Conv { act, .. } if a != Activation::None => *act = a,
            Op::Conv { .. } => {
                return Err(fmt_err(format!(
                    "acts names node {id} with no activation (only activations are listed)"
                )))
            }
            _ => {
                return Err(fmt_err(format!(
                    "acts names node {id} ({name}), which is not a convolution"
                )))
            }
        }
    }
    Ok(())
}

/// A named dim and its default size.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct DimDecl {
    name: String,
    size: u64,
}

/// A dim: `coeff` times the named dims at these indices of [`GraphDef::dims`].
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct DimDef {
    coeff: u64,
    names: Vec<u32>,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct NodeDef {
    op: Op,
    /// Operand node ids, each smaller than this node's id.
    inputs: Vec<u32>,
    /// The stored result type, checked against inference on load.
    ty: TensorType,
    name: Option<String>,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct InputDecl {
    name: String,
    ty: TensorType,
    node: u32,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct ParamDecl {
    name: String,
    ty: TensorType,
    init: InitDef,
    trainable: bool,
    node: u32,
    data: ParamData,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
enum InitDef {
    Full(f64),
    Uniform { low: f64, high: f64, seed: u64 },
    Normal { mean: f64, std: f64, seed: u64 },
    Data,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
enum ParamData {
    /// No values stored.
    None,
    /// Values in the body.
    Embedded(TensorDef),
    /// Values in the safetensors sidecar, under the parameter's name.
    Sidecar,
}

/// A tensor: dtype, dims and its elements as little-endian bytes, row-major.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct TensorDef {
    dtype: DType,
    shape: Vec<u64>,
    bytes: Bytes,
}

/// A byte buffer encoded as one length-prefixed run (not element by element).
#[derive(Debug, Clone, PartialEq)]
struct Bytes(Vec<u8>);

impl Serialize for Bytes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Bytes, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Bytes;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a byte buffer")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> std::result::Result<Bytes, E> {
                Ok(Bytes(v.to_vec()))
            }
            fn visit_byte_buf<E: serde::de::Error>(
                self,
                v: Vec<u8>,
            ) -> std::result::Result<Bytes, E> {
                Ok(Bytes(v))
            }
        }
        d.deserialize_byte_buf(V)
    }
}

fn fmt_err(msg: impl Into<String>) -> CompileError {
    CompileError::Format(msg.into())
}

fn io_err(path: &Path, source: std::io::Error) -> CompileError {
    CompileError::Io {
        path: path.display().to_string(),
        source,
    }
}

// ---------------------------------------------------------------- tensors <-> bytes

/// A tensor's elements as little-endian bytes (bool as one byte 0/1).
pub fn tensor_bytes(t: &HostTensor) -> Vec<u8> {
    fn le<T, const N: usize>(v: &[T], f: impl Fn(&T) -> [u8; N]) -> Vec<u8> {
        let mut out = Vec::with_capacity(v.len() * N);
        for x in v {
            out.extend_from_slice(&f(x));
        }
        out
    }
    match t.data() {
        Data::F32(v) => le(v, |x| x.to_le_bytes()),
        Data::F64(v) => le(v, |x| x.to_le_bytes()),
        Data::F16(v) => le(v, |x| x.to_bits().to_le_bytes()),
        Data::BF16(v) => le(v, |x| x.to_bits().to_le_bytes()),
        Data::I32(v) => le(v, |x| x.to_le_bytes()),
        Data::I64(v) => le(v, |x| x.to_le_bytes()),
        Data::U8(v) => v.to_vec(),
        Data::Bool(v) => v.iter().map(|&b| b as u8).collect(),
        Data::I8(v) => le(v, |x| x.to_le_bytes()),
        Data::I16(v) => le(v, |x| x.to_le_bytes()),
        Data::U16(v) => le(v, |x| x.to_le_bytes()),
        Data::U32(v) => le(v, |x| x.to_le_bytes()),
        Data::U64(v) => le(v, |x| x.to_le_bytes()),
    }
}

fn tensor_def(t: &HostTensor) -> TensorDef {
    TensorDef {
        dtype: t.dtype(),
        shape: t.dims().iter().map(|&d| d as u64).collect(),
        bytes: Bytes(tensor_bytes(t)),
    }
}

/// Checks dims against the size limits; returns them as `usize`.
fn check_dims(dims: &[u64], what: &dyn Fn() -> String) -> Result<Vec<usize>> {
    if dims.len() > MAX_RANK {
        return Err(fmt_err(format!(
            "{}: rank {} is over {MAX_RANK}",
            what(),
            dims.len()
        )));
    }
    let mut n: u128 = 1;
    for &d in dims {
        n = n.saturating_mul(d.max(1) as u128);
        if n > MAX_ELEMENTS {
            return Err(fmt_err(format!("{}: dims {dims:?} are too large", what())));
        }
    }
    Ok(dims.iter().map(|&d| d as usize).collect())
}

fn check_type(ty: &TensorType, what: &dyn Fn() -> String) -> Result<()> {
    ty.shape
        .check_limits()
        .map(|_| ())
        .map_err(|e| fmt_err(format!("{}: {e}", what())))
}

/// A tensor from little-endian bytes, checking the byte count against dtype × shape.
fn tensor_from_bytes(
    dtype: DType,
    dims: &[u64],
    bytes: &[u8],
    what: &dyn Fn() -> String,
) -> Result<HostTensor> {
    let shape = check_dims(dims, what)?;
    let want = shape
        .iter()
        .try_fold(dtype.size_bytes(), |a, &d| a.checked_mul(d))
        .ok_or_else(|| fmt_err(format!("{}: size overflows", what())))?;
    if bytes.len() != want {
        return Err(fmt_err(format!(
            "{}: {} bytes stored for {dtype}{}, which needs {want}",
            what(),
            bytes.len(),
            Shape(shape.clone())
        )));
    }
    fn from<T, const N: usize>(b: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        b.chunks_exact(N)
            .map(|c| f(c.try_into().expect("chunks_exact yields N bytes")))
            .collect()
    }
    let data = match dtype {
        DType::F32 => Data::F32(from(bytes, f32::from_le_bytes).into()),
        DType::F64 => Data::F64(from(bytes, f64::from_le_bytes).into()),
        DType::F16 => Data::F16(from(bytes, |b| f16::from_bits(u16::from_le_bytes(b))).into()),
        DType::BF16 => Data::BF16(from(bytes, |b| bf16::from_bits(u16::from_le_bytes(b))).into()),
        DType::I32 => Data::I32(from(bytes, i32::from_le_bytes).into()),
        DType::I64 => Data::I64(from(bytes, i64::from_le_bytes).into()),
        DType::U8 => Data::U8(bytes.to_vec().into()),
        DType::Bool => {
            if let Some(b) = bytes.iter().find(|&&b| b > 1) {
                return Err(fmt_err(format!("{}: bool byte {b} is not 0 or 1", what())));
            }
            Data::Bool(bytes.iter().map(|&b| b == 1).collect())
        }
        DType::I8 => Data::I8(from(bytes, i8::from_le_bytes).into()),
        DType::I16 => Data::I16(from(bytes, i16::from_le_bytes).into()),
        DType::U16 => Data::U16(from(bytes, u16::from_le_bytes).into()),
        DType::U32 => Data::U32(from(bytes, u32::from_le_bytes).into()),
        DType::U64 => Data::U64(from(bytes, u64::from_le_bytes).into()),
    };
    HostTensor::from_data(data, shape).map_err(|e| fmt_err(format!("{}: {e}", what())))
}

fn st_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::F64 => safetensors::Dtype::F64,
        DType::F16 => safetensors::Dtype::F16,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::I32 => safetensors::Dtype::I32,
        DType::I64 => safetensors::Dtype::I64,
        DType::U8 => safetensors::Dtype::U8,
        DType::Bool => safetensors::Dtype::BOOL,
        DType::I8 => safetensors::Dtype::I8,
        DType::I16 => safetensors::Dtype::I16,
        DType::U16 => safetensors::Dtype::U16,
        DType::U32 => safetensors::Dtype::U32,
        DType::U64 => safetensors::Dtype::U64,
    }
}

/// One tensor handed to the safetensors writer.
struct StView {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl safetensors::View for StView {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn from_st_dtype(d: safetensors::Dtype) -> Option<DType> {
    Some(match d {
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::F64 => DType::F64,
        safetensors::Dtype::F16 => DType::F16,
        safetensors::Dtype::BF16 => DType::BF16,
        safetensors::Dtype::I32 => DType::I32,
        safetensors::Dtype::I64 => DType::I64,
        safetensors::Dtype::U8 => DType::U8,
        safetensors::Dtype::BOOL => DType::Bool,
        safetensors::Dtype::I8 => DType::I8,
        safetensors::Dtype::I16 => DType::I16,
        safetensors::Dtype::U16 => DType::U16,
        safetensors::Dtype::U32 => DType::U32,
        safetensors::Dtype::U64 => DType::U64,
        _ => return None,
    })
}

/// Named tensors as the bytes of a safetensors file (parameter sidecars and state files).
pub fn safetensors_bytes(tensors: &[(String, HostTensor)]) -> Result<Vec<u8>> {
    let views = tensors.iter().map(|(name, t)| {
        (
            name.as_str(),
            StView {
                dtype: st_dtype(t.dtype()),
                shape: t.dims().to_vec(),
                bytes: tensor_bytes(t),
            },
        )
    });
    safetensors::serialize(views, &None).map_err(|e| fmt_err(format!("writing safetensors: {e}")))
}

/// Every tensor of a safetensors file's bytes, sorted by name; `file` names it in errors. Byte
/// counts are checked against dtype × shape and the size limits of graph files.
pub fn safetensors_tensors(bytes: &[u8], file: &str) -> Result<Vec<(String, HostTensor)>> {
    let st = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| fmt_err(format!("safetensors file `{file}`: {e}")))?;
    let mut out = Vec::new();
    for (name, v) in st.tensors() {
        let what = || format!("safetensors file `{file}`, tensor `{name}`");
        let dtype = from_st_dtype(v.dtype())
            .ok_or_else(|| fmt_err(format!("{}: unsupported dtype {:?}", what(), v.dtype())))?;
        let dims: Vec<u64> = v.shape().iter().map(|&d| d as u64).collect();
        let t = tensor_from_bytes(dtype, &dims, v.data(), &what)?;
        out.push((name, t));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

// ---------------------------------------------------------------- encoding

fn write_options() -> impl Options {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_little_endian()
        .reject_trailing_bytes()
}

/// Encodes the file bytes and, for [`ParamStorage::Safetensors`], the sidecar's bytes.
fn encode(
    graph: &Graph,
    storage: ParamStorage,
    sidecar_name: Option<&str>,
) -> Result<(Vec<u8>, Option<Vec<u8>>)> {
    graph.verify()?;
    let (order, complete) = dense_order(graph);
    if !complete {
        return Err(CompileError::Invalid("the graph has a cycle".into()));
    }
    let dense: HashMap<NodeId, u32> = order
        .iter()
        .enumerate()
        .map(|(k, &id)| (id, k as u32))
        .collect();
    let map = |id: NodeId| {
        dense.get(&id).copied().ok_or_else(|| {
            CompileError::Invalid(format!("reference to missing node %{}", id.index()))
        })
    };
    let mut nodes = Vec::with_capacity(order.len());
    for &id in &order {
        let n = graph.node(id)?;
        nodes.push(NodeDef {
            op: n.op.clone(),
            inputs: n.inputs.iter().map(|&i| map(i)).collect::<Result<_>>()?,
            ty: n.ty.clone(),
            name: n.name.clone(),
        });
    }
    let inputs = graph
        .inputs
        .iter()
        .map(|d| {
            Ok(InputDecl {
                name: d.name.clone(),
                ty: d.ty.clone(),
                node: map(d.node)?,
            })
        })
        .collect::<Result<_>>()?;
    let mut sidecar_tensors = Vec::new();
    let mut params = Vec::with_capacity(graph.params.len());
    for d in &graph.params {
        if let Some(t) = &d.data {
            if t.ty() != d.ty {
                return Err(CompileError::Invalid(format!(
                    "parameter `{}` is {} but its data is {}",
                    d.name,
                    d.ty,
                    t.ty()
                )));
            }
        }
        let data = match (&d.data, storage) {
            (None, _) | (Some(_), ParamStorage::InitOnly) => ParamData::None,
            (Some(t), ParamStorage::Embedded) => ParamData::Embedded(tensor_def(t)),
            (Some(t), ParamStorage::Safetensors) => {
                sidecar_tensors.push((d.name.clone(), t.clone()));
                ParamData::Sidecar
            }
        };
        params.push(ParamDecl {
            name: d.name.clone(),
            ty: d.ty.clone(),
            init: match &d.init {
                Init::Full(v) => InitDef::Full(*v),
                Init::Uniform { low, high, seed } => InitDef::Uniform {
                    low: *low,
                    high: *high,
                    seed: *seed,
                },
                Init::Normal { mean, std, seed } => InitDef::Normal {
                    mean: *mean,
                    std: *std,
                    seed: *seed,
                },
                Init::Data => InitDef::Data,
            },
            trainable: d.trainable,
            node: map(d.node)?,
            data,
        });
    }
    let (sidecar, sidecar_bytes) = if sidecar_tensors.is_empty() {
        (None, None)
    } else {
        let name = sidecar_name.ok_or_else(|| {
            fmt_err("parameters stored in a safetensors file need a path: use `save`")
        })?;
        let bytes = safetensors_bytes(&sidecar_tensors)?;
        (Some(name.to_string()), Some(bytes))
    };
    let def = GraphDef {
        nodes,
        inputs,
        params,
        constants: graph.constants.iter().map(tensor_def).collect(),
        outputs: graph
            .outputs
            .iter()
            .map(|(n, id)| Ok((n.clone(), map(*id)?)))
            .collect::<Result<_>>()?,
        updates: graph
            .updates
            .iter()
            .map(|(p, id)| Ok((*p, map(*id)?)))
            .collect::<Result<_>>()?,
        guards: graph
            .guards
            .iter()
            .map(|(n, id)| Ok((n.clone(), map(*id)?)))
            .collect::<Result<_>>()?,
        sidecar,
        dims: graph
            .dims
            .named
            .iter()
            .map(|d| DimDecl {
                name: d.name.clone(),
                size: d.size as u64,
            })
            .collect(),
        shapes: dim_defs(graph, &map)?,
        layouts: Vec::new(),
        acts: Vec::new(),
        accums: Vec::new(),
        packed: Vec::new(),
    };
    let mut def = def;
    def.layouts = (0..def.nodes.len())
        .filter(|&i| in_listed_layout(&def.nodes[i].op))
        .map(|i| i as u32)
        .collect();
    def.acts = (0..def.nodes.len())
        .filter_map(|i| match def.nodes[i].op {
            Op::Conv { act, .. } if act != Activation::None => Some((i as u32, act)),
            _ => None,
        })
        .collect();
    def.accums = (0..def.nodes.len())
        .filter(|&i| {
            matches!(
                def.nodes[i].op,
                Op::MatmulEpilogue {
                    accumulate: true,
                    ..
                }
            )
        })
        .map(|i| i as u32)
        .collect();
    def.packed = (0..def.nodes.len())
        .filter(|&i| {
            matches!(
                def.nodes[i].op,
                Op::Attention {
                    layout: rustytorch_ops::AttnLayout::Packed,
                    ..
                } | Op::AttentionGrad {
                    layout: rustytorch_ops::AttnLayout::Packed,
                    ..
                }
            )
        })
        .map(|i| i as u32)
        .collect();
    Ok((frame(&def)?, sidecar_bytes))
}

/// The symbolic shapes, by dense node id (sorted), names as indices of the dims table.
fn dim_defs(graph: &Graph, map: &dyn Fn(NodeId) -> Result<u32>) -> Result<Vec<(u32, Vec<DimDef>)>> {
    let index = |n: &str| {
        graph
            .dims
            .named
            .iter()
            .position(|d| d.name == n)
            .map(|k| k as u32)
            .ok_or_else(|| CompileError::Invalid(format!("undeclared named dim `{n}`")))
    };
    let mut out = Vec::with_capacity(graph.dims.shapes.len());
    for (&id, dims) in &graph.dims.shapes {
        let defs = dims
            .iter()
            .map(|d| {
                Ok(DimDef {
                    coeff: d.coeff() as u64,
                    names: d.names().iter().map(|n| index(n)).collect::<Result<_>>()?,
                })
            })
            .collect::<Result<_>>()?;
        out.push((map(id)?, defs));
    }
    out.sort_by_key(|(k, _)| *k);
    Ok(out)
}

/// Header plus encoded body.
fn frame(def: &GraphDef) -> Result<Vec<u8>> {
    let body = write_options()
        .serialize(def)
        .map_err(|e| fmt_err(format!("encoding the body: {e}")))?;
    Ok(frame_body(VERSION, &body))
}

fn frame_body(version: u32, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// Encodes a graph as graph-file bytes ([`ParamStorage::Safetensors`] needs a path: use [`save`]).
pub fn to_bytes(graph: &Graph, params: ParamStorage) -> Result<Vec<u8>> {
    encode(graph, params, None).map(|(b, _)| b)
}

/// Decodes graph-file bytes (a file whose parameters live in a safetensors sidecar needs
/// [`load`]).
pub fn from_bytes(bytes: &[u8]) -> Result<Graph> {
    decode(bytes, &mut |name| {
        Err(fmt_err(format!(
            "parameter values are in the safetensors file `{name}` beside the graph file: use `load`"
        )))
    })
}

/// Saves a graph to `path` (and, for [`ParamStorage::Safetensors`], its parameter values to
/// `<path>.safetensors`).
pub fn save(graph: &Graph, path: &Path, params: ParamStorage) -> Result<()> {
    let file_name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| fmt_err(format!("{}: not a file path", path.display())))?;
    let sidecar_name = format!("{file_name}.safetensors");
    let (bytes, sidecar) = encode(graph, params, Some(&sidecar_name))?;
    if let Some(st) = sidecar {
        let st_path = path.with_file_name(&sidecar_name);
        std::fs::write(&st_path, st).map_err(|e| io_err(&st_path, e))?;
    }
    std::fs::write(path, bytes).map_err(|e| io_err(path, e))
}

/// Loads a graph file (reading its safetensors sidecar when it has one).
pub fn load(path: &Path) -> Result<Graph> {
    let bytes = std::fs::read(path).map_err(|e| io_err(path, e))?;
    decode(&bytes, &mut |name| {
        let p = path.with_file_name(name);
        std::fs::read(&p).map_err(|e| io_err(&p, e))
    })
}

// ---------------------------------------------------------------- decoding

/// Checks the header; returns the body.
fn unframe(bytes: &[u8]) -> Result<&[u8]> {
    let m = bytes.len().min(MAGIC.len());
    if bytes[..m] != MAGIC[..m] {
        return Err(fmt_err("not a RustyTorch graph file (bad magic)"));
    }
    if bytes.len() < HEADER_LEN {
        return Err(fmt_err(format!(
            "truncated: the file has {} bytes, the header alone needs {HEADER_LEN}",
            bytes.len()
        )));
    }
    let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
    let version = u32_at(8);
    if version > VERSION {
        return Err(fmt_err(format!(
            "format version {version} is newer than this build supports ({VERSION})"
        )));
    }
    if version == 0 {
        return Err(fmt_err("format version 0 is not a valid version"));
    }
    let body_len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    let have = (bytes.len() - HEADER_LEN) as u64;
    if body_len > have {
        return Err(fmt_err(format!(
            "truncated: header says {body_len} body bytes, file has {have}"
        )));
    }
    if body_len < have {
        return Err(fmt_err(format!(
            "{} unexpected bytes after the {body_len}-byte body",
            have - body_len
        )));
    }
    let body = &bytes[HEADER_LEN..];
    let crc = u32_at(20);
    let actual = crc32fast::hash(body);
    if crc != actual {
        return Err(fmt_err(format!(
            "checksum mismatch (header {crc:08x}, body {actual:08x}): the file is corrupted"
        )));
    }
    Ok(body)
}

fn decode_body(body: &[u8]) -> Result<GraphDef> {
    write_options()
        .with_limit(body.len() as u64)
        .deserialize(body)
        .map_err(|e| fmt_err(format!("malformed body: {e}")))
}

/// Decodes the body of a file of `version` (an older version through its own schema).
fn decode_versioned(body: &[u8], version: u32) -> Result<GraphDef> {
    if version >= PACKED_VERSION {
        return decode_body(body);
    }
    if version >= ACCUMS_VERSION {
        return write_options()
            .with_limit(body.len() as u64)
            .deserialize::<GraphDefV6>(body)
            .map(GraphDef::from)
            .map_err(|e| fmt_err(format!("malformed body (version {version}): {e}")));
    }
    if version >= ACTS_VERSION {
        return write_options()
            .with_limit(body.len() as u64)
            .deserialize::<GraphDefV5>(body)
            .map(GraphDef::from)
            .map_err(|e| fmt_err(format!("malformed body (version {version}): {e}")));
    }
    if version >= LAYOUTS_VERSION {
        return write_options()
            .with_limit(body.len() as u64)
            .deserialize::<GraphDefV4>(body)
            .map(GraphDef::from)
            .map_err(|e| fmt_err(format!("malformed body (version {version}): {e}")));
    }
    if version >= NAMED_DIMS_VERSION {
        return write_options()
            .with_limit(body.len() as u64)
            .deserialize::<GraphDefV2>(body)
            .map(GraphDef::from)
            .map_err(|e| fmt_err(format!("malformed body (version {version}): {e}")));
    }
    write_options()
        .with_limit(body.len() as u64)
        .deserialize::<GraphDefV1>(body)
        .map(GraphDef::from)
        .map_err(|e| fmt_err(format!("malformed body (version {version}): {e}")))
}

fn decode(bytes: &[u8], sidecar: &mut dyn FnMut(&str) -> Result<Vec<u8>>) -> Result<Graph> {
    let body = unframe(bytes)?;
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    let mut def = decode_versioned(body, version)?;
    apply_layouts(&mut def, version)?;
    apply_acts(&mut def)?;
    apply_accums(&mut def)?;
    apply_packed(&mut def)?;
    validate(&def)?;
    let mut side: HashMap<String, HostTensor> = HashMap::new();
    if def.params.iter().any(|p| p.data == ParamData::Sidecar) {
        let name = def.sidecar.as_deref().unwrap_or_default();
        let raw = sidecar(name)?;
        let st = safetensors::SafeTensors::deserialize(&raw)
            .map_err(|e| fmt_err(format!("safetensors file `{name}`: {e}")))?;
        for p in def.params.iter().filter(|p| p.data == ParamData::Sidecar) {
            let what = || format!("safetensors file `{name}`, tensor `{}`", p.name);
            let v = st
                .tensor(&p.name)
                .map_err(|_| fmt_err(format!("{}: missing", what())))?;
            if v.dtype() != st_dtype(p.ty.dtype) {
                return Err(fmt_err(format!(
                    "{}: dtype {:?}, the parameter is {}",
                    what(),
                    v.dtype(),
                    p.ty
                )));
            }
            if v.shape() != p.ty.shape.dims() {
                return Err(fmt_err(format!(
                    "{}: shape {:?}, the parameter is {}",
                    what(),
                    v.shape(),
                    p.ty
                )));
            }
            let dims: Vec<u64> = v.shape().iter().map(|&d| d as u64).collect();
            let t = tensor_from_bytes(p.ty.dtype, &dims, v.data(), &what)?;
            side.insert(p.name.clone(), t);
        }
    }
    // Inference belongs to the op families; a panic there on hostile attributes must still
    // surface as an error of this file.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rebuild(def, side))).unwrap_or_else(
        |_| {
            Err(fmt_err(
                "an op's shape inference failed on this file's attributes",
            ))
        },
    )
}

/// The checks that must pass before any of the file's values reach the graph or the ops.
fn validate(def: &GraphDef) -> Result<()> {
    let n = def.nodes.len();
    if n > u32::MAX as usize {
        return Err(fmt_err("too many nodes"));
    }
    let node_ref = |what: &dyn Fn() -> String, id: u32| {
        if (id as usize) < n {
            Ok(())
        } else {
            Err(fmt_err(format!(
                "{} names node {id}, but there are {n} nodes",
                what()
            )))
        }
    };
    for (i, t) in def.constants.iter().enumerate() {
        tensor_from_bytes(t.dtype, &t.shape, &t.bytes.0, &|| format!("constant {i}"))?;
    }
    for (i, nd) in def.nodes.iter().enumerate() {
        let what = || format!("node {i} ({})", nd.op.name());
        check_type(&nd.ty, &what)?;
        check_op(&nd.op, &what)?;
        for &k in &nd.inputs {
            if k as usize >= i {
                return Err(fmt_err(format!(
                    "node {i} reads node {k} which is not before it"
                )));
            }
        }
        let leaf_ok = match &nd.op {
            Op::Input { index, ty } => {
                let d = def.inputs.get(*index as usize).ok_or_else(|| {
                    fmt_err(format!(
                        "{} is input #{index}, but the file declares {} inputs",
                        what(),
                        def.inputs.len()
                    ))
                })?;
                d.node as usize == i && d.ty == *ty
            }
            Op::Param { index, ty } => {
                let d = def.params.get(*index as usize).ok_or_else(|| {
                    fmt_err(format!(
                        "{} is parameter #{index}, but the file declares {} parameters",
                        what(),
                        def.params.len()
                    ))
                })?;
                d.node as usize == i && d.ty == *ty
            }
            Op::Constant { index, ty } => {
                let c = def.constants.get(*index as usize).ok_or_else(|| {
                    fmt_err(format!(
                        "{} is constant #{index}, but the file holds {} constants",
                        what(),
                        def.constants.len()
                    ))
                })?;
                c.dtype == ty.dtype
                    && c.shape
                        .iter()
                        .copied()
                        .eq(ty.shape.dims().iter().map(|&d| d as u64))
            }
            _ => true,
        };
        if !leaf_ok {
            return Err(fmt_err(format!(
                "{} does not match the file's tables",
                what()
            )));
        }
    }
    let mut names = HashSet::new();
    for (k, d) in def.inputs.iter().enumerate() {
        let what = || format!("input `{}`", d.name);
        check_type(&d.ty, &what)?;
        node_ref(&what, d.node)?;
        if !matches!(def.nodes[d.node as usize].op, Op::Input { index, .. } if index as usize == k)
        {
            return Err(fmt_err(format!(
                "{} names node {}, which is not input #{k}",
                what(),
                d.node
            )));
        }
        if !names.insert(d.name.as_str()) {
            return Err(fmt_err(format!("input `{}` is declared twice", d.name)));
        }
    }
    names.clear();
    for (k, p) in def.params.iter().enumerate() {
        let what = || format!("parameter `{}`", p.name);
        check_type(&p.ty, &what)?;
        node_ref(&what, p.node)?;
        if !matches!(def.nodes[p.node as usize].op, Op::Param { index, .. } if index as usize == k)
        {
            return Err(fmt_err(format!(
                "{} names node {}, which is not parameter #{k}",
                what(),
                p.node
            )));
        }
        if !names.insert(p.name.as_str()) {
            return Err(fmt_err(format!("parameter `{}` is declared twice", p.name)));
        }
        match &p.data {
            ParamData::None => {}
            ParamData::Embedded(t) => {
                let dims: Vec<u64> = p.ty.shape.dims().iter().map(|&d| d as u64).collect();
                if t.dtype != p.ty.dtype || t.shape != dims {
                    return Err(fmt_err(format!(
                        "{} is {} but its data is not",
                        what(),
                        p.ty
                    )));
                }
                tensor_from_bytes(t.dtype, &t.shape, &t.bytes.0, &what)?;
            }
            ParamData::Sidecar => {
                let name = def.sidecar.as_deref().ok_or_else(|| {
                    fmt_err(format!(
                        "{}: its values are in a safetensors file that the file does not name",
                        what()
                    ))
                })?;
                let plain = !name.is_empty()
                    && name != "."
                    && name != ".."
                    && !name.contains(['/', '\\', '\0'])
                    && Path::new(name).file_name().and_then(|f| f.to_str()) == Some(name);
                if !plain {
                    return Err(fmt_err(format!(
                        "safetensors file name `{name}` is not a plain file name"
                    )));
                }
            }
        }
    }
    names.clear();
    for (name, id) in &def.outputs {
        node_ref(&|| format!("output `{name}`"), *id)?;
        if !names.insert(name.as_str()) {
            return Err(fmt_err(format!("output `{name}` is declared twice")));
        }
    }
    for (p, id) in &def.updates {
        node_ref(&|| format!("update of parameter #{p}"), *id)?;
        if *p as usize >= def.params.len() {
            return Err(fmt_err(format!(
                "update of parameter #{p}, but the file declares {} parameters",
                def.params.len()
            )));
        }
    }
    for (name, id) in &def.guards {
        node_ref(&|| format!("guard `{name}`"), *id)?;
    }
    names.clear();
    for d in &def.dims {
        if !crate::dims::is_dim_name(&d.name) {
            return Err(fmt_err(format!("`{}` cannot name a dim", d.name)));
        }
        if d.size == 0 || d.size > rustytorch_ops::shape::MAX_ATTR as u64 {
            return Err(fmt_err(format!(
                "named dim `{}`: default size {} is out of range",
                d.name, d.size
            )));
        }
        if !names.insert(d.name.as_str()) {
            return Err(fmt_err(format!("named dim `{}` is declared twice", d.name)));
        }
    }
    let mut shaped = HashSet::new();
    for (id, dims) in &def.shapes {
        let what = || format!("the named dims of node {id}");
        node_ref(&what, *id)?;
        if !shaped.insert(*id) {
            return Err(fmt_err(format!("{} are given twice", what())));
        }
        if dims.len() != def.nodes[*id as usize].ty.shape.rank() {
            return Err(fmt_err(format!("{}: not the node's rank", what())));
        }
        for d in dims {
            if d.names.len() > crate::dims::MAX_FACTORS || d.coeff > MAX_ELEMENTS as u64 {
                return Err(fmt_err(format!("{}: a dim is too large", what())));
            }
            if d.names.iter().any(|&k| k as usize >= def.dims.len()) {
                return Err(fmt_err(format!(
                    "{}: a dim names dim #{}, but the file declares {}",
                    what(),
                    d.names.iter().max().copied().unwrap_or(0),
                    def.dims.len()
                )));
            }
        }
    }
    Ok(())
}

/// Bounds every size-like attribute of an op so that inference's arithmetic cannot overflow (the
/// check [`rustytorch_ops::infer`] makes too, here before anything is built).
fn check_op(op: &Op, what: &dyn Fn() -> String) -> Result<()> {
    rustytorch_ops::shape::check_op_limits(op).map_err(|e| fmt_err(format!("{}: {e}", what())))
}

/// Builds the graph from a validated body: every node through [`Graph::add`], then the tables.
fn rebuild(def: GraphDef, mut side: HashMap<String, HostTensor>) -> Result<Graph> {
    let mut g = Graph::new();
    for (i, nd) in def.nodes.into_iter().enumerate() {
        let name = nd.op.name();
        let ins: Vec<NodeId> = nd.inputs.iter().map(|&k| NodeId::new(k as usize)).collect();
        let id = g
            .add(nd.op, &ins)
            .map_err(|e| fmt_err(format!("node {i} ({name}): {e}")))?;
        if id.index() != i {
            return Err(fmt_err(format!(
                "node {i} got id {} while rebuilding",
                id.index()
            )));
        }
        let inferred = g.ty(id);
        if *inferred != nd.ty {
            return Err(fmt_err(format!(
                "node {i} ({name}) is stored as {} but its op infers {inferred}",
                nd.ty
            )));
        }
        if let Some(n) = g.node_mut(id) {
            n.name = nd.name;
        }
    }
    let node = |k: u32| NodeId::new(k as usize);
    g.inputs = def
        .inputs
        .into_iter()
        .map(|d| InputDef {
            name: d.name,
            ty: d.ty,
            node: node(d.node),
        })
        .collect();
    for p in def.params {
        let data = match p.data {
            ParamData::None => None,
            ParamData::Embedded(t) => {
                Some(tensor_from_bytes(t.dtype, &t.shape, &t.bytes.0, &|| {
                    format!("parameter `{}`", p.name)
                })?)
            }
            ParamData::Sidecar => side.remove(&p.name),
        };
        g.params.push(ParamDef {
            init: match p.init {
                InitDef::Full(v) => Init::Full(v),
                InitDef::Uniform { low, high, seed } => Init::Uniform { low, high, seed },
                InitDef::Normal { mean, std, seed } => Init::Normal { mean, std, seed },
                InitDef::Data => Init::Data,
            },
            name: p.name,
            ty: p.ty,
            data,
            trainable: p.trainable,
            node: node(p.node),
        });
    }
    for (i, t) in def.constants.iter().enumerate() {
        g.constants
            .push(tensor_from_bytes(t.dtype, &t.shape, &t.bytes.0, &|| {
                format!("constant {i}")
            })?);
    }
    g.outputs = def.outputs.into_iter().map(|(n, k)| (n, node(k))).collect();
    g.updates = def.updates.into_iter().map(|(p, k)| (p, node(k))).collect();
    g.guards = def.guards.into_iter().map(|(n, k)| (n, node(k))).collect();
    g.dims.named = def
        .dims
        .iter()
        .map(|d| NamedDim {
            name: d.name.clone(),
            size: d.size as usize,
        })
        .collect();
    for (k, dims) in def.shapes {
        let exprs = dims
            .into_iter()
            .map(|d| {
                d.names
                    .iter()
                    .fold(DimExpr::fixed(d.coeff as usize), |e, &n| {
                        e.mul(&DimExpr::named(&def.dims[n as usize].name))
                    })
            })
            .collect();
        g.dims.shapes.insert(node(k), exprs);
    }
    g.verify()
        .map_err(|e| fmt_err(format!("the decoded graph is invalid: {e}")))?;
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustytorch_ops::{BinaryOp, FusedInstr, FusedKernel, ReduceKind};

    /// A small valid graph's body: x, w (embedded data), a constant, mul, add, sum; output and
    /// update.
    fn valid_def() -> GraphDef {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, [2, 3]);
        let x = g.add_input("x", ty.clone()).unwrap();
        let w = g.add_param("w", ty.clone(), Init::Data, true).unwrap();
        g.params[0].data = Some(HostTensor::from_vec(vec![1.0f32; 6], [2, 3]).unwrap());
        let c = g.add_constant(HostTensor::from_vec(vec![true, false, true], [3]).unwrap());
        let m = g.add(Op::Binary(BinaryOp::Mul), &[x, w]).unwrap();
        let cf = g.add(Op::Cast { to: DType::F32 }, &[c]).unwrap();
        let a = g.add(Op::Binary(BinaryOp::Add), &[m, cf]).unwrap();
        let s = g
            .add(
                Op::Reduce {
                    kind: ReduceKind::Sum,
                    axes: vec![1],
                    keep_dims: false,
                },
                &[a],
            )
            .unwrap();
        g.add_output("s", s).unwrap();
        g.updates.push((0, a));
        let bytes = to_bytes(&g, ParamStorage::Embedded).unwrap();
        decode_body(unframe(&bytes).unwrap()).unwrap()
    }

    /// A convolution with an activation, read back; then the `acts` table spoiled three ways.
    #[test]
    fn the_acts_table_is_checked() {
        let mut g = Graph::new();
        let x = g
            .add_input("x", TensorType::new(DType::F32, [1, 2, 5]))
            .unwrap();
        let w = g
            .add_input("w", TensorType::new(DType::F32, [3, 2, 3]))
            .unwrap();
        let geom = rustytorch_ops::ConvGeom::new(vec![1], vec![1], vec![1]);
        let conv = |act| Op::Conv {
            geom: geom.clone(),
            groups: 1,
            bias: false,
            act,
        };
        let y = g.add(conv(Activation::GeluTanh), &[x, w]).unwrap();
        let z = g.add(conv(Activation::None), &[x, w]).unwrap();
        g.add_output("y", y).unwrap();
        g.add_output("z", z).unwrap();
        let bytes = to_bytes(&g, ParamStorage::Embedded).unwrap();
        let def = decode_body(unframe(&bytes).unwrap()).unwrap();
        assert_eq!(def.acts, vec![(2, Activation::GeluTanh)]);
        let back = from_bytes(&bytes).unwrap();
        let ops: Vec<Op> = back
            .topo_order()
            .unwrap()
            .into_iter()
            .map(|id| back.node(id).unwrap().op.clone())
            .collect();
        assert!(ops.contains(&conv(Activation::GeluTanh)) && ops.contains(&conv(Activation::None)));
        let mut d = def.clone();
        d.acts = vec![(0, Activation::Relu)];
        assert!(load_err(&d).contains("which is not a convolution"));
        let mut d = def.clone();
        d.acts = vec![(3, Activation::None)];
        assert!(load_err(&d).contains("no activation"));
        let mut d = def.clone();
        d.acts = vec![(3, Activation::Relu), (2, Activation::Relu)];
        assert!(load_err(&d).contains("must be ascending"));
        let mut d = def;
        d.acts = vec![(9, Activation::Relu)];
        assert!(load_err(&d).contains("acts names node 9"));
    }

    /// An accumulating matmul, read back; then the `accums` table spoiled three ways; a version
    /// 5 body reads with no accumulating matmuls.
    #[test]
    fn the_accums_table_is_checked() {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, [4, 4]);
        let a = g.add_input("a", ty.clone()).unwrap();
        let b = g.add_input("b", ty.clone()).unwrap();
        let c = g.add_input("c", ty).unwrap();
        let mm = |accumulate| Op::MatmulEpilogue {
            trans_a: false,
            trans_b: true,
            bias: false,
            act: Activation::None,
            accumulate,
        };
        let y = g.add(mm(true), &[a, b, c]).unwrap();
        let z = g.add(mm(false), &[a, b]).unwrap();
        g.add_output("y", y).unwrap();
        g.add_output("z", z).unwrap();
        let bytes = to_bytes(&g, ParamStorage::Embedded).unwrap();
        let def = decode_body(unframe(&bytes).unwrap()).unwrap();
        assert_eq!(def.accums, vec![3]);
        let back = from_bytes(&bytes).unwrap();
        assert_eq!(back.node(back.output_nodes()[0]).unwrap().op, mm(true));
        assert_eq!(back.node(back.output_nodes()[1]).unwrap().op, mm(false));
        let mut d = def.clone();
        d.accums = vec![0];
        assert!(load_err(&d).contains("which is not a matmul_epilogue"));
        let mut d = def.clone();
        d.accums = vec![4, 3];
        assert!(load_err(&d).contains("must be ascending"));
        let mut d = def.clone();
        d.accums = vec![9];
        assert!(load_err(&d).contains("accums names node 9"));
        // Without the table the accumulating node has one operand too many for its op.
        let mut d = def;
        d.accums.clear();
        assert!(from_bytes(&frame(&d).unwrap()).is_err());
    }

    /// A packed attention and its gradient, read back; then the `packed` table spoiled.
    #[test]
    fn the_packed_table_is_checked() {
        use rustytorch_ops::{AttnLayout, AttnMask, Causal, F64Bits, ATTN_WRT_PACKED};
        let mut g = Graph::new();
        let p = g
            .add_input("p", TensorType::new(DType::BF16, [2, 5, 3, 2, 16]))
            .unwrap();
        let d = g
            .add_input("d", TensorType::new(DType::BF16, [2, 5, 2, 16]))
            .unwrap();
        let fwd = Op::Attention {
            causal: Causal::TopLeft,
            mask: AttnMask::None,
            scale: F64Bits::new(0.25),
            layout: AttnLayout::Packed,
        };
        let grad = fwd.attention_grad(ATTN_WRT_PACKED).unwrap();
        let y = g.add(fwd.clone(), &[p, p, p]).unwrap();
        let dp = g.add(grad.clone(), &[p, p, p, d]).unwrap();
        g.add_output("y", y).unwrap();
        g.add_output("dp", dp).unwrap();
        let bytes = to_bytes(&g, ParamStorage::Embedded).unwrap();
        let def = decode_body(unframe(&bytes).unwrap()).unwrap();
        assert_eq!(def.packed, vec![2, 3]);
        let back = from_bytes(&bytes).unwrap();
        assert_eq!(back.node(back.output_nodes()[0]).unwrap().op, fwd);
        assert_eq!(back.node(back.output_nodes()[1]).unwrap().op, grad);
        let mut d = def.clone();
        d.packed = vec![0];
        assert!(load_err(&d).contains("which is not attention"));
        let mut d = def.clone();
        d.packed = vec![3, 2];
        assert!(load_err(&d).contains("must be ascending"));
        // Without the table the packed operands do not fit the op.
        let mut d = def;
        d.packed.clear();
        assert!(from_bytes(&frame(&d).unwrap()).is_err());
    }

    fn load_err(def: &GraphDef) -> String {
        match from_bytes(&frame(def).unwrap()) {
            Err(CompileError::Format(m)) => m,
            other => panic!("expected a format error, got {other:?}"),
        }
    }

    fn body_err(body: &[u8]) -> String {
        match from_bytes(&frame_body(VERSION, body)) {
            Err(CompileError::Format(m)) => m,
            other => panic!("expected a format error, got {other:?}"),
        }
    }

    fn node_of(def: &GraphDef, pred: impl Fn(&Op) -> bool) -> usize {
        def.nodes.iter().position(|n| pred(&n.op)).unwrap()
    }

    /// A body with the named dim `b` (default 2): x : f32[b,3], exp(x).
    fn named_def() -> GraphDef {
        let mut g = Graph::new();
        let b = g.declare_dim("b", 2).unwrap();
        let x = g
            .add_input_dims("x", DType::F32, &[b.clone(), DimExpr::fixed(3)])
            .unwrap();
        let y = g
            .add(Op::Unary(rustytorch_ops::UnaryOp::Exp), &[x])
            .unwrap();
        g.set_sym_shape(y, vec![b, DimExpr::fixed(3)]).unwrap();
        g.add_output("y", y).unwrap();
        let bytes = to_bytes(&g, ParamStorage::Embedded).unwrap();
        decode_body(unframe(&bytes).unwrap()).unwrap()
    }

    #[test]
    fn bad_named_dims_are_refused() {
        let def = named_def();
        assert_eq!(def.dims.len(), 1);
        assert_eq!(def.shapes.len(), 2);
        let g = from_bytes(&frame(&def).unwrap()).unwrap();
        assert_eq!(g.dims.named[0].size, 2);
        let mut d = named_def();
        d.shapes[0].1[0].names = vec![5];
        assert!(load_err(&d).contains("names dim #5"), "{}", load_err(&d));
        let mut d = named_def();
        d.shapes[0].1.pop();
        assert!(load_err(&d).contains("not the node's rank"));
        let mut d = named_def();
        d.shapes[1].0 = 99;
        assert!(load_err(&d).contains("names node 99"));
        let mut d = named_def();
        d.shapes.push(d.shapes[0].clone());
        assert!(load_err(&d).contains("given twice"));
        let mut d = named_def();
        d.shapes[1].1[0].coeff = 2;
        assert!(
            load_err(&d).contains("at the default sizes"),
            "{}",
            load_err(&d)
        );
        let mut d = named_def();
        d.dims[0].size = 0;
        assert!(load_err(&d).contains("out of range"));
        let mut d = named_def();
        d.dims[0].name = "1b".into();
        assert!(load_err(&d).contains("cannot name a dim"));
        let mut d = named_def();
        d.dims.push(d.dims[0].clone());
        assert!(load_err(&d).contains("declared twice"));
        let mut d = named_def();
        d.shapes[0].1[0].names = vec![0; 65];
        assert!(load_err(&d).contains("too large"));
        // A version-1 body cannot carry them: read as version 1, the new tables are trailing
        // bytes.
        let body = write_options().serialize(&named_def()).unwrap();
        let m = match from_bytes(&frame_body(1, &body)) {
            Err(CompileError::Format(m)) => m,
            other => panic!("expected a format error, got {other:?}"),
        };
        assert!(m.starts_with("malformed body (version 1)"), "{m}");
    }

    #[test]
    fn the_valid_body_loads() {
        let def = valid_def();
        let g = from_bytes(&frame(&def).unwrap()).unwrap();
        assert_eq!(g.len(), def.nodes.len());
    }

    #[test]
    fn a_node_reading_a_later_node_is_refused() {
        let mut def = valid_def();
        let k = node_of(&def, |op| matches!(op, Op::Binary(BinaryOp::Mul)));
        let last = def.nodes.len() - 1;
        def.nodes[k].inputs[0] = last as u32;
        assert_eq!(
            load_err(&def),
            format!("node {k} reads node {last} which is not before it")
        );
        def.nodes[k].inputs[0] = k as u32;
        assert_eq!(
            load_err(&def),
            format!("node {k} reads node {k} which is not before it")
        );
        def.nodes[k].inputs[0] = u32::MAX;
        assert!(load_err(&def).contains("is not before it"));
    }

    #[test]
    fn dangling_table_entries_are_refused() {
        let mut def = valid_def();
        def.outputs[0].1 = 99;
        assert!(load_err(&def).contains("output `s` names node 99"));
        let mut def = valid_def();
        def.updates[0].0 = 7;
        assert!(load_err(&def).contains("update of parameter #7"));
        let mut def = valid_def();
        def.guards.push(("g".into(), 1000));
        assert!(load_err(&def).contains("guard `g` names node 1000"));
        let mut def = valid_def();
        def.inputs[0].node = 500;
        assert_eq!(
            load_err(&def),
            "node 0 (input) does not match the file's tables"
        );
        let mut def = valid_def();
        let k = node_of(&def, |op| matches!(op, Op::Reduce { .. }));
        def.inputs[0].node = k as u32;
        assert_eq!(
            load_err(&def),
            "node 0 (input) does not match the file's tables"
        );
        let mut def = valid_def();
        def.params[0].node = 0;
        assert_eq!(
            load_err(&def),
            "node 1 (param) does not match the file's tables"
        );
    }

    #[test]
    fn leaves_must_agree_with_the_tables() {
        let mut def = valid_def();
        let k = node_of(&def, |op| matches!(op, Op::Input { .. }));
        def.nodes[k].op = Op::Input {
            index: 3,
            ty: def.nodes[k].ty.clone(),
        };
        assert!(load_err(&def).contains("is input #3, but the file declares 1 inputs"));
        let mut def = valid_def();
        let k = node_of(&def, |op| matches!(op, Op::Constant { .. }));
        def.nodes[k].op = Op::Constant {
            index: 0,
            ty: TensorType::new(DType::Bool, [4]),
        };
        def.nodes[k].ty = TensorType::new(DType::Bool, [4]);
        assert!(load_err(&def).contains("does not match the file's tables"));
        let mut def = valid_def();
        def.inputs[0].ty = TensorType::new(DType::F64, [2, 3]);
        assert!(load_err(&def).contains("does not match the file's tables"));
        let mut def = valid_def();
        def.inputs.push(def.inputs[0].clone());
        assert!(load_err(&def).contains("not input #1"));
    }

    #[test]
    fn stored_types_must_match_inference() {
        let mut def = valid_def();
        let k = node_of(&def, |op| matches!(op, Op::Reduce { .. }));
        def.nodes[k].ty = TensorType::new(DType::F32, [3]);
        let m = load_err(&def);
        assert!(
            m.contains("is stored as f32[3] but its op infers f32[2]"),
            "{m}"
        );
        let mut def = valid_def();
        let k = node_of(&def, |op| matches!(op, Op::Reduce { .. }));
        def.nodes[k].op = Op::Reduce {
            kind: ReduceKind::Sum,
            axes: vec![5],
            keep_dims: false,
        };
        let m = load_err(&def);
        assert!(m.starts_with(&format!("node {k} (reduce_sum)")), "{m}");
    }

    #[test]
    fn tensor_bytes_must_match_dtype_and_shape() {
        let mut def = valid_def();
        def.constants[0].bytes.0.pop();
        assert!(load_err(&def).contains("2 bytes stored for bool[3], which needs 3"));
        let mut def = valid_def();
        def.constants[0].bytes.0[1] = 7;
        assert!(load_err(&def).contains("bool byte 7"));
        let mut def = valid_def();
        def.constants[0].shape = vec![1 << 40, 1 << 40, 0];
        assert!(load_err(&def).contains("too large"));
        let mut def = valid_def();
        def.constants[0].shape = vec![1; 65];
        assert!(load_err(&def).contains("rank 65"));
        let mut def = valid_def();
        if let ParamData::Embedded(t) = &mut def.params[0].data {
            t.bytes.0.extend([0; 4]);
        }
        assert!(load_err(&def).contains("28 bytes stored for f32[2,3], which needs 24"));
        let mut def = valid_def();
        if let ParamData::Embedded(t) = &mut def.params[0].data {
            t.shape = vec![3, 2];
        }
        assert!(load_err(&def).contains("its data is not"));
    }

    #[test]
    fn huge_sizes_in_types_and_attributes_are_refused() {
        let mut def = valid_def();
        let k = node_of(&def, |op| matches!(op, Op::Reduce { .. }));
        def.nodes[k].ty = TensorType::new(DType::F32, [usize::MAX, usize::MAX]);
        assert!(load_err(&def).contains("too large"));
        let mut def = valid_def();
        def.nodes[k].op = Op::Reduce {
            kind: ReduceKind::Sum,
            axes: vec![usize::MAX],
            keep_dims: false,
        };
        assert!(load_err(&def).contains("too large"));
        let mut def = valid_def();
        def.nodes.push(NodeDef {
            op: Op::Reshape {
                shape: Shape::new([usize::MAX, 2, 0]),
            },
            inputs: vec![0],
            ty: TensorType::new(DType::F32, [0]),
            name: None,
        });
        assert!(load_err(&def).contains("too large"));
    }

    #[test]
    fn duplicate_names_and_odd_sidecars_are_refused() {
        let mut def = valid_def();
        def.outputs.push(def.outputs[0].clone());
        assert!(load_err(&def).contains("output `s` is declared twice"));
        let mut def = valid_def();
        def.params[0].data = ParamData::Sidecar;
        assert!(load_err(&def).contains("does not name"));
        for name in ["../evil", "/etc/passwd", "a/b", "..", "", "x\\y"] {
            def.sidecar = Some(name.into());
            assert!(load_err(&def).contains("not a plain file name"), "{name}");
        }
    }

    #[test]
    fn hostile_lengths_fail_without_allocating() {
        // Every vec length u64::MAX: the limit stops bincode long before any allocation.
        assert!(body_err(&[0xff; 8]).starts_with("malformed body"));
        let mut body = vec![0u8; 8]; // no nodes
        body.extend(1u64.to_le_bytes()); // one input...
        body.extend((1u64 << 40).to_le_bytes()); // ...whose name is 1 TiB long
        body.extend([b'x'; 16]);
        assert!(body_err(&body).starts_with("malformed body"));
        // A constant claiming 2^60 bytes of data.
        let mut def = valid_def();
        def.constants[0].bytes.0.clear();
        let mut body = write_options().serialize(&def).unwrap();
        let marker = (0u64).to_le_bytes(); // the empty byte run's length ...
        let at = body.windows(8).rposition(|w| w == marker).unwrap();
        body[at..at + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
        let _ = body_err(&body); // an error of some kind, never an allocation of 2^60 bytes
    }

    #[test]
    fn an_out_of_range_op_tag_is_refused() {
        let def = valid_def();
        let mut body = write_options().serialize(&def).unwrap();
        // The body starts with the node count (u64), then node 0's op tag (u32).
        body[8..12].copy_from_slice(&200u32.to_le_bytes());
        let m = body_err(&body);
        assert!(m.starts_with("malformed body") && m.contains("200"), "{m}");
        let mut body = write_options().serialize(&def).unwrap();
        body.push(0);
        assert!(body_err(&body).starts_with("malformed body"));
    }

    /// The encoding of `op` wrapped `depth` times in single-instruction fused kernels, spelled out
    /// byte by byte (building it as a value would itself recurse that deep).
    fn nested_fused_bytes(depth: usize) -> Vec<u8> {
        let tag = |op: &Op| write_options().serialize(op).unwrap()[..4].to_vec();
        let fused_tag = tag(&Op::Fused(Box::new(FusedKernel {
            n_inputs: 0,
            instrs: vec![],
            out: TensorType::new(DType::F32, Shape::scalar()),
        })));
        let mut out = Vec::new();
        for _ in 0..depth {
            out.extend(&fused_tag);
            out.extend(1u32.to_le_bytes()); // n_inputs
            out.extend(1u64.to_le_bytes()); // one instruction
        }
        out.extend(tag(&Op::Where));
        for _ in 0..depth {
            out.extend(0u64.to_le_bytes()); // args: none
            out.extend([0u8; 4]); // dtype f32
            out.extend([0u8; 4]); // out: f32 ...
            out.extend(0u64.to_le_bytes()); // ... of rank 0
        }
        out
    }

    fn body_with_op(op_bytes: &[u8]) -> Vec<u8> {
        let mut body = 1u64.to_le_bytes().to_vec(); // one node
        body.extend(op_bytes);
        body.extend(0u64.to_le_bytes()); // no inputs
        body.extend([0u8; 4]); // ty f32 ...
        body.extend(0u64.to_le_bytes()); // ... rank 0
        body.push(0); // no name
        body.extend([0u8; 8 * 6]); // six empty tables
        body.push(0); // no sidecar
                      // No named dims, symbolic shapes, layouts, activations, accumulating matmuls or packed
                      // attention.
        body.extend([0u8; 8 * 6]);
        body
    }

    #[test]
    fn the_hand_spelled_fused_encoding_matches_serde() {
        let inner = Op::Fused(Box::new(FusedKernel {
            n_inputs: 1,
            instrs: vec![FusedInstr {
                op: Op::Where,
                args: vec![],
                dtype: DType::F32,
            }],
            out: TensorType::new(DType::F32, Shape::scalar()),
        }));
        let outer = Op::Fused(Box::new(FusedKernel {
            n_inputs: 1,
            instrs: vec![FusedInstr {
                op: inner,
                args: vec![],
                dtype: DType::F32,
            }],
            out: TensorType::new(DType::F32, Shape::scalar()),
        }));
        assert_eq!(
            write_options().serialize(&outer).unwrap(),
            nested_fused_bytes(2)
        );
        // Shallow nesting decodes (then fails inference: `where` needs three operands).
        let m = body_err(&body_with_op(&nested_fused_bytes(2)));
        assert!(m.starts_with("node 0 (fused)"), "{m}");
    }

    #[test]
    fn deeply_nested_fused_kernels_are_refused_without_overflowing_the_stack() {
        for depth in [9, 100, 200_000] {
            let m = body_err(&body_with_op(&nested_fused_bytes(depth)));
            assert!(m.contains("nested too deeply"), "{depth}: {m}");
        }
        // Depth within the deserializer's bound but over the validator's.
        let m = body_err(&body_with_op(&nested_fused_bytes(7)));
        assert!(m.contains("nested too deeply"), "{m}");
    }
}
