//! The textual form of ops, shared by the IR printer/parser, the e-graph's s-expressions and the
//! rule files: `name` or `name[key=value,key,...]`, with no spaces and no parentheses, so that the
//! text is one s-expression symbol.
//!
//! - Attributes are written in a fixed order; the parser accepts any order, rejects unknown and
//!   repeated keys.
//! - Booleans are flags: written by name when true (`matmul[trans_b]`) and omitted when false;
//!   the parser also takes `key=true` / `key=false`.
//! - Integers are decimal (`axis=1`, `ignore_index=-100`).
//! - Lists are `:`-separated, the empty list is the empty string: `axes=1:2`, `perm=0:2:1:3`,
//!   `shape=8:1024:768`, `shape=` (a scalar).
//! - Pairs are `/`-separated inside a list: `pads=0/0:1/2` (before/after per dim).
//! - A tensor type is its dtype followed by its dims: `ty=f32:8:64`, `ty=f32` (a scalar).
//! - Floats use Rust's shortest round-trip form (`0.125`, `1e-5`, `-0.0`), `inf`, `-inf` and `nan`
//!   (the canonical quiet NaN); any other NaN is written as its bits, `0x7ff8000000000001`. The
//!   parser accepts the bits form for any value, so every float round-trips bit for bit.
//! - Enums are lower-case words: `act=none|relu|gelu|gelu_tanh`,
//!   `causal=none|top_left|bottom_right`, `mask=none|additive|bool`,
//!   `reduction=mean|sum|none`, pooling `kind=max|avg` (with the flag `count_include_pad`).
//! - Convolution/pooling geometry is spread over `stride`, `padding` and `dilation` lists, and
//!   the flag `channels_last` marks the channels-last layout (absent: channels-first).
//! - Attention's flag `bshd` marks operands and result laid out `[B,S,H,D]` (absent: `[B,H,S,D]`),
//!   `packed` q, k and v read from one `[B,S,3,H,D]` tensor.
//! - A fused kernel is `fused[n_inputs=N,out=TY,instrs=I;I;...]`, each instruction being
//!   `OP@ARGS@DTYPE` (`mul@0:1@f32`: the op text, its `:`-separated operands and its dtype);
//!   separators inside nested brackets belong to the nested op.
//!
//! Examples: `matmul`, `reduce_sum[axes=1:2,keep]`, `reshape[shape=8:1024:768]`,
//! `input[index=0,ty=f32:8:64]`, `pad[pads=0/0:1/2,value=0.0]`,
//! `attention[causal=top_left,mask=none,scale=0.125]`,
//! `fused[n_inputs=2,out=f32:4,instrs=mul@0:1@f32;exp@2@f32]`.
//!
//! `parse_op(&op.to_string()) == op` holds for every op.

use crate::{
    Activation, ArgKind, AttnLayout, AttnMask, BinaryOp, Causal, ConvGeom, DType, F64Bits,
    FusedInstr, FusedKernel, Layout, Op, OpError, PoolKind, ReduceKind, Reduction, Result,
    RowFusion, Shape, TensorType, UnaryOp,
};
use std::fmt;
use std::str::FromStr;

/// The op's name (without attributes).
pub fn op_name(op: &Op) -> &'static str {
    match op {
        Op::Input { .. } => "input",
        Op::Param { .. } => "param",
        Op::Constant { .. } => "constant",
        Op::Full { .. } => "full",
        Op::Iota { .. } => "iota",
        Op::RandUniform { .. } => "rand_uniform",
        Op::RandNormal { .. } => "rand_normal",
        Op::Unary(u) => unary_name(*u),
        Op::Binary(b) => binary_name(*b),
        Op::Where => "where",
        Op::Cast { .. } => "cast",
        Op::Reduce { kind, .. } => match kind {
            ReduceKind::Sum => "reduce_sum",
            ReduceKind::Mean => "reduce_mean",
            ReduceKind::Max => "reduce_max",
            ReduceKind::Min => "reduce_min",
            ReduceKind::Prod => "reduce_prod",
            ReduceKind::Any => "reduce_any",
            ReduceKind::All => "reduce_all",
        },
        Op::ArgReduce { kind, .. } => match kind {
            ArgKind::ArgMax => "argmax",
            ArgKind::ArgMin => "argmin",
        },
        Op::Matmul { .. } => "matmul",
        Op::MatmulEpilogue { .. } => "matmul_epilogue",
        Op::MatmulActGrad { .. } => "matmul_act_grad",
        Op::Reshape { .. } => "reshape",
        Op::Permute { .. } => "permute",
        Op::Expand { .. } => "expand",
        Op::Slice { .. } => "slice",
        Op::Concat { .. } => "concat",
        Op::Pad { .. } => "pad",
        Op::Softmax { .. } => "softmax",
        Op::LogSoftmax { .. } => "log_softmax",
        Op::LayerNorm { .. } => "layer_norm",
        Op::RmsNorm { .. } => "rms_norm",
        Op::Gather { .. } => "gather",
        Op::ScatterAdd { .. } => "scatter_add",
        Op::IndexSelect { .. } => "index_select",
        Op::IndexAdd { .. } => "index_add",
        Op::Conv { .. } => "conv",
        Op::ConvGradInput { .. } => "conv_grad_input",
        Op::ConvGradWeight { .. } => "conv_grad_weight",
        Op::Pool { .. } => "pool",
        Op::PoolGrad { .. } => "pool_grad",
        Op::Attention { .. } => "attention",
        Op::AttentionGrad { .. } => "attention_grad",
        Op::CrossEntropy { .. } => "cross_entropy",
        Op::CrossEntropyGrad { .. } => "cross_entropy_grad",
        Op::Fused(_) => "fused",
        Op::SparseMatmul { .. } => "sparse_matmul",
        Op::SampledMatmul => "sampled_matmul",
        Op::CumSum { .. } => "cumsum",
        Op::TopK { .. } => "topk",
        Op::AllReduce { .. } => "all_reduce",
        Op::FusedRow(_) => "fused_row",
    }
}

/// The name of a unary op.
pub fn unary_name(u: UnaryOp) -> &'static str {
    match u {
        UnaryOp::Neg => "neg",
        UnaryOp::Abs => "abs",
        UnaryOp::Exp => "exp",
        UnaryOp::Log => "log",
        UnaryOp::Sqrt => "sqrt",
        UnaryOp::Rsqrt => "rsqrt",
        UnaryOp::Reciprocal => "reciprocal",
        UnaryOp::Sin => "sin",
        UnaryOp::Cos => "cos",
        UnaryOp::Tanh => "tanh",
        UnaryOp::Sigmoid => "sigmoid",
        UnaryOp::Relu => "relu",
        UnaryOp::GeluErf => "gelu",
        UnaryOp::GeluTanh => "gelu_tanh",
        UnaryOp::Silu => "silu",
        UnaryOp::Sign => "sign",
        UnaryOp::Floor => "floor",
        UnaryOp::Ceil => "ceil",
        UnaryOp::Round => "round",
        UnaryOp::Not => "not",
        UnaryOp::IsNan => "isnan",
        UnaryOp::IsInf => "isinf",
        UnaryOp::IsFinite => "isfinite",
        UnaryOp::Erf => "erf",
    }
}

/// The name of a binary op.
pub fn binary_name(b: BinaryOp) -> &'static str {
    match b {
        BinaryOp::Add => "add",
        BinaryOp::Sub => "sub",
        BinaryOp::Mul => "mul",
        BinaryOp::Div => "div",
        BinaryOp::Pow => "pow",
        BinaryOp::Maximum => "maximum",
        BinaryOp::Minimum => "minimum",
        BinaryOp::Eq => "eq",
        BinaryOp::Ne => "ne",
        BinaryOp::Lt => "lt",
        BinaryOp::Le => "le",
        BinaryOp::Gt => "gt",
        BinaryOp::Ge => "ge",
        BinaryOp::And => "and",
        BinaryOp::Or => "or",
    }
}

/// Every unary op, in declaration order.
pub const UNARY_OPS: [UnaryOp; 24] = [
    UnaryOp::Neg,
    UnaryOp::Abs,
    UnaryOp::Exp,
    UnaryOp::Log,
    UnaryOp::Sqrt,
    UnaryOp::Rsqrt,
    UnaryOp::Reciprocal,
    UnaryOp::Sin,
    UnaryOp::Cos,
    UnaryOp::Tanh,
    UnaryOp::Sigmoid,
    UnaryOp::Relu,
    UnaryOp::GeluErf,
    UnaryOp::GeluTanh,
    UnaryOp::Silu,
    UnaryOp::Sign,
    UnaryOp::Floor,
    UnaryOp::Ceil,
    UnaryOp::Round,
    UnaryOp::Not,
    UnaryOp::IsNan,
    UnaryOp::IsInf,
    UnaryOp::IsFinite,
    UnaryOp::Erf,
];

/// Every binary op, in declaration order.
pub const BINARY_OPS: [BinaryOp; 15] = [
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Div,
    BinaryOp::Pow,
    BinaryOp::Maximum,
    BinaryOp::Minimum,
    BinaryOp::Eq,
    BinaryOp::Ne,
    BinaryOp::Lt,
    BinaryOp::Le,
    BinaryOp::Gt,
    BinaryOp::Ge,
    BinaryOp::And,
    BinaryOp::Or,
];

/// Every reduction kind, in declaration order.
pub const REDUCE_KINDS: [ReduceKind; 7] = [
    ReduceKind::Sum,
    ReduceKind::Mean,
    ReduceKind::Max,
    ReduceKind::Min,
    ReduceKind::Prod,
    ReduceKind::Any,
    ReduceKind::All,
];

/// How deeply fused kernels may nest inside each other's programs in op text.
const MAX_NESTING: usize = 8;

/// A float attribute's text (see the module docs): shortest round-trip decimal, `inf`, `-inf`,
/// `nan`, or the bits in hex for a NaN other than the canonical one.
pub fn format_f64(v: F64Bits) -> String {
    let x = v.get();
    if x.is_nan() {
        if v.0 == f64::NAN.to_bits() {
            "nan".to_string()
        } else {
            format!("0x{:016x}", v.0)
        }
    } else if x == f64::INFINITY {
        "inf".to_string()
    } else if x == f64::NEG_INFINITY {
        "-inf".to_string()
    } else {
        format!("{x:?}")
    }
}

/// Parses a float written by [`format_f64`] (or any decimal Rust float, or `0x` + 16 hex digits
/// of bits).
pub fn parse_f64(s: &str) -> Option<F64Bits> {
    match s {
        "nan" => return Some(F64Bits(f64::NAN.to_bits())),
        "inf" => return Some(F64Bits::new(f64::INFINITY)),
        "-inf" => return Some(F64Bits::new(f64::NEG_INFINITY)),
        _ => {}
    }
    if let Some(hex) = s.strip_prefix("0x") {
        if hex.is_empty() || hex.len() > 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        return u64::from_str_radix(hex, 16).ok().map(F64Bits);
    }
    // Only plain decimal forms: Rust also accepts `NaN`, `infinity` ... which we never print.
    if !s
        .bytes()
        .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'+' | b'e' | b'E'))
    {
        return None;
    }
    s.parse::<f64>().ok().map(F64Bits::new)
}

fn list_text(v: &[usize]) -> String {
    let parts: Vec<String> = v.iter().map(|d| d.to_string()).collect();
    parts.join(":")
}

fn ty_text(ty: &TensorType) -> String {
    let mut s = ty.dtype.name().to_string();
    for d in ty.shape.dims() {
        s.push(':');
        s.push_str(&d.to_string());
    }
    s
}

fn act_text(a: Activation) -> &'static str {
    match a {
        Activation::None => "none",
        Activation::Relu => "relu",
        Activation::GeluErf => "gelu",
        Activation::GeluTanh => "gelu_tanh",
    }
}

fn causal_text(c: Causal) -> &'static str {
    match c {
        Causal::None => "none",
        Causal::TopLeft => "top_left",
        Causal::BottomRight => "bottom_right",
    }
}

fn mask_text(m: AttnMask) -> &'static str {
    match m {
        AttnMask::None => "none",
        AttnMask::Additive => "additive",
        AttnMask::Bool => "bool",
    }
}

fn reduction_text(r: Reduction) -> &'static str {
    match r {
        Reduction::Mean => "mean",
        Reduction::Sum => "sum",
        Reduction::None => "none",
    }
}

/// Attribute list under construction: `(key, Some(value))` or `(flag, None)`.
#[derive(Default)]
struct AttrOut(Vec<(&'static str, Option<String>)>);

impl AttrOut {
    fn kv(&mut self, k: &'static str, v: impl ToString) {
        self.0.push((k, Some(v.to_string())));
    }
    fn flag(&mut self, k: &'static str, on: bool) {
        if on {
            self.0.push((k, None));
        }
    }
    fn geom(&mut self, g: &ConvGeom) {
        self.kv("stride", list_text(&g.stride));
        self.kv("padding", list_text(&g.padding));
        self.kv("dilation", list_text(&g.dilation));
        self.flag("channels_last", g.layout == Layout::ChannelsLast);
    }
}

fn attrs_of(op: &Op) -> AttrOut {
    let mut a = AttrOut::default();
    match op {
        Op::Input { index, ty } | Op::Param { index, ty } | Op::Constant { index, ty } => {
            a.kv("index", index);
            a.kv("ty", ty_text(ty));
        }
        Op::Full { value, ty } => {
            a.kv("value", format_f64(*value));
            a.kv("ty", ty_text(ty));
        }
        Op::Iota { axis, ty } => {
            a.kv("axis", axis);
            a.kv("ty", ty_text(ty));
        }
        Op::RandUniform {
            low,
            high,
            seed,
            ty,
        } => {
            a.kv("low", format_f64(*low));
            a.kv("high", format_f64(*high));
            a.kv("seed", seed);
            a.kv("ty", ty_text(ty));
        }
        Op::RandNormal {
            mean,
            std,
            seed,
            ty,
        } => {
            a.kv("mean", format_f64(*mean));
            a.kv("std", format_f64(*std));
            a.kv("seed", seed);
            a.kv("ty", ty_text(ty));
        }
        Op::Unary(_) | Op::Binary(_) | Op::Where => {}
        Op::Cast { to } => a.kv("to", to.name()),
        Op::Reduce {
            kind: _,
            axes,
            keep_dims,
        } => {
            a.kv("axes", list_text(axes));
            a.flag("keep", *keep_dims);
        }
        Op::ArgReduce {
            kind: _,
            axis,
            keep_dims,
        } => {
            a.kv("axis", axis);
            a.flag("keep", *keep_dims);
        }
        Op::Matmul { trans_a, trans_b } => {
            a.flag("trans_a", *trans_a);
            a.flag("trans_b", *trans_b);
        }
        Op::MatmulEpilogue {
            trans_a,
            trans_b,
            bias,
            act,
            accumulate,
        } => {
            a.flag("trans_a", *trans_a);
            a.flag("trans_b", *trans_b);
            a.flag("bias", *bias);
            a.kv("act", act_text(*act));
            a.flag("accumulate", *accumulate);
        }
        Op::MatmulActGrad {
            trans_a,
            trans_b,
            act,
        } => {
            a.flag("trans_a", *trans_a);
            a.flag("trans_b", *trans_b);
            a.kv("act", act_text(*act));
        }
        Op::Reshape { shape } | Op::Expand { shape } => a.kv("shape", list_text(shape.dims())),
        Op::Permute { perm } => a.kv("perm", list_text(perm)),
        Op::Slice {
            starts,
            ends,
            steps,
        } => {
            a.kv("starts", list_text(starts));
            a.kv("ends", list_text(ends));
            a.kv("steps", list_text(steps));
        }
        Op::Concat { axis }
        | Op::Softmax { axis }
        | Op::LogSoftmax { axis }
        | Op::Gather { axis }
        | Op::ScatterAdd { axis }
        | Op::IndexSelect { axis }
        | Op::IndexAdd { axis } => a.kv("axis", axis),
        Op::Pad { pads, value } => {
            let p: Vec<String> = pads.iter().map(|(b, e)| format!("{b}/{e}")).collect();
            a.kv("pads", p.join(":"));
            a.kv("value", format_f64(*value));
        }
        Op::LayerNorm { eps, weight, bias } => {
            a.kv("eps", format_f64(*eps));
            a.flag("weight", *weight);
            a.flag("bias", *bias);
        }
        Op::RmsNorm { eps, weight } => {
            a.kv("eps", format_f64(*eps));
            a.flag("weight", *weight);
        }
        Op::Conv {
            geom,
            groups,
            bias,
            act,
        } => {
            a.geom(geom);
            a.kv("groups", groups);
            a.flag("bias", *bias);
            if *act != Activation::None {
                a.kv("act", act_text(*act));
            }
        }
        Op::ConvGradInput {
            geom,
            groups,
            input_shape,
        } => {
            a.geom(geom);
            a.kv("groups", groups);
            a.kv("input_shape", list_text(input_shape.dims()));
        }
        Op::ConvGradWeight {
            geom,
            groups,
            weight_shape,
        } => {
            a.geom(geom);
            a.kv("groups", groups);
            a.kv("weight_shape", list_text(weight_shape.dims()));
        }
        Op::Pool { kind, kernel, geom } | Op::PoolGrad { kind, kernel, geom } => {
            match kind {
                PoolKind::Max => a.kv("kind", "max"),
                PoolKind::Avg { .. } => a.kv("kind", "avg"),
            }
            a.kv("kernel", list_text(kernel));
            a.geom(geom);
            if let PoolKind::Avg { count_include_pad } = kind {
                a.flag("count_include_pad", *count_include_pad);
            }
        }
        Op::Attention {
            causal,
            mask,
            scale,
            layout,
        } => {
            a.kv("causal", causal_text(*causal));
            a.kv("mask", mask_text(*mask));
            a.kv("scale", format_f64(*scale));
            a.flag("bshd", *layout == AttnLayout::Bshd);
            a.flag("packed", *layout == AttnLayout::Packed);
        }
        Op::AttentionGrad {
            causal,
            mask,
            scale,
            wrt,
            layout,
        } => {
            a.kv("causal", causal_text(*causal));
            a.kv("mask", mask_text(*mask));
            a.kv("scale", format_f64(*scale));
            a.kv("wrt", wrt);
            a.flag("bshd", *layout == AttnLayout::Bshd);
            a.flag("packed", *layout == AttnLayout::Packed);
        }
        Op::CrossEntropy {
            reduction,
            ignore_index,
        }
        | Op::CrossEntropyGrad {
            reduction,
            ignore_index,
        } => {
            a.kv("reduction", reduction_text(*reduction));
            a.kv("ignore_index", ignore_index);
        }
        Op::Fused(k) => {
            a.kv("n_inputs", k.n_inputs);
            a.kv("out", ty_text(&k.out));
            let instrs: Vec<String> = k
                .instrs
                .iter()
                .map(|i| {
                    let args: Vec<String> = i.args.iter().map(|x| x.to_string()).collect();
                    format!("{}@{}@{}", i.op, args.join(":"), i.dtype.name())
                })
                .collect();
            a.kv("instrs", instrs.join(";"));
        }
        Op::SparseMatmul {
            rows,
            cols,
            trans_a,
        } => {
            a.kv("rows", rows);
            a.kv("cols", cols);
            a.flag("trans_a", *trans_a);
        }
        Op::SampledMatmul => {}
        Op::CumSum {
            axis,
            exclusive,
            reverse,
        } => {
            a.kv("axis", axis);
            a.flag("exclusive", *exclusive);
            a.flag("reverse", *reverse);
        }
        Op::TopK { axis, k, largest } => {
            a.kv("axis", axis);
            a.kv("k", k);
            a.flag("largest", *largest);
        }
        Op::AllReduce { mean } => a.flag("mean", *mean),
        Op::FusedRow(r) => {
            a.kv("core", &r.core);
            if let Some(k) = &r.prologue {
                a.kv("prologue", Op::Fused(Box::new(k.clone())));
            }
            if let Some(k) = &r.epilogue {
                a.kv("epilogue", Op::Fused(Box::new(k.clone())));
            }
        }
    }
    a
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(op_name(self))?;
        let attrs = attrs_of(self).0;
        if attrs.is_empty() {
            return Ok(());
        }
        f.write_str("[")?;
        for (i, (k, v)) in attrs.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(k)?;
            if let Some(v) = v {
                write!(f, "={v}")?;
            }
        }
        f.write_str("]")
    }
}

impl FromStr for Op {
    type Err = OpError;

    fn from_str(s: &str) -> Result<Op> {
        parse_op(s)
    }
}

/// Parses op text (see the module docs); errors are [`OpError::Parse`] naming the text.
pub fn parse_op(text: &str) -> Result<Op> {
    parse_nested(text, 0).map_err(|reason| OpError::Parse {
        text: text.to_string(),
        reason,
    })
}

/// Splits at `sep` outside brackets; errors on unbalanced brackets.
fn split_top(s: &str, sep: char) -> std::result::Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| "unbalanced `]`".to_string())?
            }
            c if c == sep && depth == 0 => {
                parts.push(&s[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("unbalanced `[`".into());
    }
    parts.push(&s[start..]);
    Ok(parts)
}

/// Parsed attributes, consumed by the variant constructors; leftovers are unknown keys.
struct Attrs<'a> {
    kv: Vec<(&'a str, Option<&'a str>, bool)>,
}

type PResult<T> = std::result::Result<T, String>;

impl<'a> Attrs<'a> {
    /// Whether `key` is present and not yet consumed (for optional attributes).
    fn has(&self, key: &str) -> bool {
        self.kv.iter().any(|(k, _, used)| *k == key && !*used)
    }
    fn take(&mut self, key: &str) -> Option<Option<&'a str>> {
        self.kv
            .iter_mut()
            .find(|(k, _, used)| *k == key && !*used)
            .map(|e| {
                e.2 = true;
                e.1
            })
    }
    fn raw(&mut self, key: &str) -> PResult<&'a str> {
        match self.take(key) {
            Some(Some(v)) => Ok(v),
            Some(None) => Err(format!("attribute `{key}` needs a value")),
            None => Err(format!("missing attribute `{key}`")),
        }
    }
    fn val<T>(&mut self, key: &str, what: &str, f: impl FnOnce(&str) -> Option<T>) -> PResult<T> {
        let v = self.raw(key)?;
        f(v).ok_or_else(|| format!("attribute `{key}`: `{v}` is not {what}"))
    }
    fn flag(&mut self, key: &str) -> PResult<bool> {
        match self.take(key) {
            None | Some(Some("false")) => Ok(false),
            Some(None) | Some(Some("true")) => Ok(true),
            Some(Some(v)) => Err(format!("flag `{key}`: `{v}` is not true or false")),
        }
    }
    fn usize(&mut self, key: &str) -> PResult<usize> {
        self.val(key, "an unsigned integer", |v| v.parse().ok())
    }
    fn u32(&mut self, key: &str) -> PResult<u32> {
        self.val(key, "a 32-bit unsigned integer", |v| v.parse().ok())
    }
    fn u64(&mut self, key: &str) -> PResult<u64> {
        self.val(key, "a 64-bit unsigned integer", |v| v.parse().ok())
    }
    fn f64(&mut self, key: &str) -> PResult<F64Bits> {
        self.val(key, "a float", parse_f64)
    }
    fn list(&mut self, key: &str) -> PResult<Vec<usize>> {
        self.val(key, "a `:`-separated list of unsigned integers", parse_list)
    }
    fn shape(&mut self, key: &str) -> PResult<Shape> {
        self.list(key).map(Shape)
    }
    fn ty(&mut self, key: &str) -> PResult<TensorType> {
        self.val(key, "a tensor type such as f32:8:64", parse_ty)
    }
    fn dtype(&mut self, key: &str) -> PResult<DType> {
        self.val(key, "a dtype", DType::from_name)
    }
    fn geom(&mut self) -> PResult<ConvGeom> {
        let g = ConvGeom::new(
            self.list("stride")?,
            self.list("padding")?,
            self.list("dilation")?,
        );
        Ok(if self.flag("channels_last")? {
            g.with_layout(Layout::ChannelsLast)
        } else {
            g
        })
    }
    fn attn_layout(&mut self) -> PResult<AttnLayout> {
        Ok(match (self.flag("bshd")?, self.flag("packed")?) {
            (true, true) => return Err("flags `bshd` and `packed` exclude each other".into()),
            (true, false) => AttnLayout::Bshd,
            (false, true) => AttnLayout::Packed,
            (false, false) => AttnLayout::Bhsd,
        })
    }
    fn finish(&self) -> PResult<()> {
        match self.kv.iter().find(|e| !e.2) {
            Some((k, _, _)) => Err(format!("unknown or repeated attribute `{k}`")),
            None => Ok(()),
        }
    }
}

fn parse_list(v: &str) -> Option<Vec<usize>> {
    if v.is_empty() {
        return Some(Vec::new());
    }
    v.split(':').map(|d| d.parse().ok()).collect()
}

fn parse_ty(v: &str) -> Option<TensorType> {
    let mut parts = v.split(':');
    let dtype = DType::from_name(parts.next()?)?;
    let dims: Option<Vec<usize>> = parts.map(|d| d.parse().ok()).collect();
    Some(TensorType::new(dtype, dims?))
}

fn parse_pads(v: &str) -> Option<Vec<(usize, usize)>> {
    if v.is_empty() {
        return Some(Vec::new());
    }
    v.split(':')
        .map(|p| {
            let (b, e) = p.split_once('/')?;
            Some((b.parse().ok()?, e.parse().ok()?))
        })
        .collect()
}

fn parse_enum<T: Copy>(v: &str, table: &[(&str, T)]) -> Option<T> {
    table.iter().find(|(n, _)| *n == v).map(|(_, t)| *t)
}

const ACTS: [(&str, Activation); 4] = [
    ("none", Activation::None),
    ("relu", Activation::Relu),
    ("gelu", Activation::GeluErf),
    ("gelu_tanh", Activation::GeluTanh),
];
const CAUSALS: [(&str, Causal); 3] = [
    ("none", Causal::None),
    ("top_left", Causal::TopLeft),
    ("bottom_right", Causal::BottomRight),
];
const MASKS: [(&str, AttnMask); 3] = [
    ("none", AttnMask::None),
    ("additive", AttnMask::Additive),
    ("bool", AttnMask::Bool),
];
const REDUCTIONS: [(&str, Reduction); 3] = [
    ("mean", Reduction::Mean),
    ("sum", Reduction::Sum),
    ("none", Reduction::None),
];

fn parse_instr(text: &str, depth: usize) -> PResult<FusedInstr> {
    let parts = split_top(text, '@')?;
    let [op, args, dtype] = parts[..] else {
        return Err(format!("fused instruction `{text}` is not OP@ARGS@DTYPE"));
    };
    let op = parse_nested(op, depth + 1).map_err(|e| format!("fused instruction `{text}`: {e}"))?;
    let args = if args.is_empty() {
        Vec::new()
    } else {
        args.split(':')
            .map(|a| a.parse::<u32>().ok())
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| format!("fused instruction `{text}`: bad operands `{args}`"))?
    };
    let dtype = DType::from_name(dtype)
        .ok_or_else(|| format!("fused instruction `{text}`: bad dtype `{dtype}`"))?;
    Ok(FusedInstr { op, args, dtype })
}

fn parse_nested(text: &str, depth: usize) -> PResult<Op> {
    if depth > MAX_NESTING {
        return Err(format!("fused kernels nested deeper than {MAX_NESTING}"));
    }
    let (name, inner) = match text.find('[') {
        Some(i) => {
            let inner = text[i..]
                .strip_prefix('[')
                .and_then(|s| s.strip_suffix(']'))
                .ok_or("attributes must end with `]`")?;
            (&text[..i], Some(inner))
        }
        None => (text, None),
    };
    if name.is_empty() {
        return Err("empty op name".into());
    }
    let mut kv = Vec::new();
    if let Some(inner) = inner {
        // The bracket opened after the name must be the one closed at the end.
        if split_top(inner, ',').is_err() {
            return Err("unbalanced brackets in the attributes".into());
        }
        if !inner.is_empty() {
            for a in split_top(inner, ',')? {
                let (k, v) = match a.split_once('=') {
                    Some((k, v)) => (k, Some(v)),
                    None => (a, None),
                };
                if k.is_empty() || !k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
                    return Err(format!("bad attribute `{a}`"));
                }
                kv.push((k, v, false));
            }
        }
    }
    let mut a = Attrs { kv };
    let op = if let Some(u) = UNARY_OPS.into_iter().find(|u| unary_name(*u) == name) {
        Op::Unary(u)
    } else if let Some(b) = BINARY_OPS.into_iter().find(|b| binary_name(*b) == name) {
        Op::Binary(b)
    } else if let Some(kind) = name
        .strip_prefix("reduce_")
        .and_then(|k| REDUCE_KINDS.into_iter().find(|r| reduce_suffix(*r) == k))
    {
        Op::Reduce {
            kind,
            axes: a.list("axes")?,
            keep_dims: a.flag("keep")?,
        }
    } else {
        match name {
            "input" => Op::Input {
                index: a.u32("index")?,
                ty: a.ty("ty")?,
            },
            "param" => Op::Param {
                index: a.u32("index")?,
                ty: a.ty("ty")?,
            },
            "constant" => Op::Constant {
                index: a.u32("index")?,
                ty: a.ty("ty")?,
            },
            "full" => Op::Full {
                value: a.f64("value")?,
                ty: a.ty("ty")?,
            },
            "iota" => Op::Iota {
                axis: a.usize("axis")?,
                ty: a.ty("ty")?,
            },
            "rand_uniform" => Op::RandUniform {
                low: a.f64("low")?,
                high: a.f64("high")?,
                seed: a.u64("seed")?,
                ty: a.ty("ty")?,
            },
            "rand_normal" => Op::RandNormal {
                mean: a.f64("mean")?,
                std: a.f64("std")?,
                seed: a.u64("seed")?,
                ty: a.ty("ty")?,
            },
            "where" => Op::Where,
            "cast" => Op::Cast { to: a.dtype("to")? },
            "argmax" | "argmin" => Op::ArgReduce {
                kind: if name == "argmax" {
                    ArgKind::ArgMax
                } else {
                    ArgKind::ArgMin
                },
                axis: a.usize("axis")?,
                keep_dims: a.flag("keep")?,
            },
            "matmul" => Op::Matmul {
                trans_a: a.flag("trans_a")?,
                trans_b: a.flag("trans_b")?,
            },
            "matmul_epilogue" => Op::MatmulEpilogue {
                trans_a: a.flag("trans_a")?,
                trans_b: a.flag("trans_b")?,
                bias: a.flag("bias")?,
                act: a.val("act", "an activation", |v| parse_enum(v, &ACTS))?,
                accumulate: a.flag("accumulate")?,
            },
            "matmul_act_grad" => Op::MatmulActGrad {
                trans_a: a.flag("trans_a")?,
                trans_b: a.flag("trans_b")?,
                act: a.val("act", "an activation", |v| parse_enum(v, &ACTS))?,
            },
            "reshape" => Op::Reshape {
                shape: a.shape("shape")?,
            },
            "permute" => Op::Permute {
                perm: a.list("perm")?,
            },
            "expand" => Op::Expand {
                shape: a.shape("shape")?,
            },
            "slice" => Op::Slice {
                starts: a.list("starts")?,
                ends: a.list("ends")?,
                steps: a.list("steps")?,
            },
            "concat" => Op::Concat {
                axis: a.usize("axis")?,
            },
            "pad" => Op::Pad {
                pads: a.val("pads", "a list of before/after pairs", parse_pads)?,
                value: a.f64("value")?,
            },
            "softmax" => Op::Softmax {
                axis: a.usize("axis")?,
            },
            "log_softmax" => Op::LogSoftmax {
                axis: a.usize("axis")?,
            },
            "layer_norm" => Op::LayerNorm {
                eps: a.f64("eps")?,
                weight: a.flag("weight")?,
                bias: a.flag("bias")?,
            },
            "rms_norm" => Op::RmsNorm {
                eps: a.f64("eps")?,
                weight: a.flag("weight")?,
            },
            "gather" => Op::Gather {
                axis: a.usize("axis")?,
            },
            "scatter_add" => Op::ScatterAdd {
                axis: a.usize("axis")?,
            },
            "index_select" => Op::IndexSelect {
                axis: a.usize("axis")?,
            },
            "index_add" => Op::IndexAdd {
                axis: a.usize("axis")?,
            },
            "conv" => Op::Conv {
                geom: a.geom()?,
                groups: a.usize("groups")?,
                bias: a.flag("bias")?,
                // Optional: a convolution without an activation prints none.
                act: if a.has("act") {
                    a.val("act", "an activation", |v| parse_enum(v, &ACTS))?
                } else {
                    Activation::None
                },
            },
            "conv_grad_input" => Op::ConvGradInput {
                geom: a.geom()?,
                groups: a.usize("groups")?,
                input_shape: a.shape("input_shape")?,
            },
            "conv_grad_weight" => Op::ConvGradWeight {
                geom: a.geom()?,
                groups: a.usize("groups")?,
                weight_shape: a.shape("weight_shape")?,
            },
            "pool" | "pool_grad" => {
                let kind = match a.raw("kind")? {
                    "max" => PoolKind::Max,
                    "avg" => PoolKind::Avg {
                        count_include_pad: a.flag("count_include_pad")?,
                    },
                    other => return Err(format!("attribute `kind`: `{other}` is not max or avg")),
                };
                let kernel = a.list("kernel")?;
                let geom = a.geom()?;
                if name == "pool" {
                    Op::Pool { kind, kernel, geom }
                } else {
                    Op::PoolGrad { kind, kernel, geom }
                }
            }
            "attention" => Op::Attention {
                causal: a.val("causal", "a causal mode", |v| parse_enum(v, &CAUSALS))?,
                mask: a.val("mask", "a mask kind", |v| parse_enum(v, &MASKS))?,
                scale: a.f64("scale")?,
                layout: a.attn_layout()?,
            },
            "attention_grad" => Op::AttentionGrad {
                causal: a.val("causal", "a causal mode", |v| parse_enum(v, &CAUSALS))?,
                mask: a.val("mask", "a mask kind", |v| parse_enum(v, &MASKS))?,
                scale: a.f64("scale")?,
                wrt: a.val("wrt", "0, 1 or 2", |v| v.parse::<u8>().ok())?,
                layout: a.attn_layout()?,
            },
            "cross_entropy" => Op::CrossEntropy {
                reduction: a.val("reduction", "a reduction", |v| parse_enum(v, &REDUCTIONS))?,
                ignore_index: a.val("ignore_index", "an integer", |v| v.parse::<i64>().ok())?,
            },
            "cross_entropy_grad" => Op::CrossEntropyGrad {
                reduction: a.val("reduction", "a reduction", |v| parse_enum(v, &REDUCTIONS))?,
                ignore_index: a.val("ignore_index", "an integer", |v| v.parse::<i64>().ok())?,
            },
            "fused" => {
                let n_inputs = a.u32("n_inputs")?;
                let out = a.ty("out")?;
                let text = a.raw("instrs")?;
                let instrs = if text.is_empty() {
                    Vec::new()
                } else {
                    split_top(text, ';')?
                        .into_iter()
                        .map(|i| parse_instr(i, depth))
                        .collect::<PResult<Vec<_>>>()?
                };
                Op::Fused(Box::new(FusedKernel {
                    n_inputs,
                    instrs,
                    out,
                }))
            }
            "sparse_matmul" => Op::SparseMatmul {
                rows: a.usize("rows")?,
                cols: a.usize("cols")?,
                trans_a: a.flag("trans_a")?,
            },
            "sampled_matmul" => Op::SampledMatmul,
            "cumsum" => Op::CumSum {
                axis: a.usize("axis")?,
                exclusive: a.flag("exclusive")?,
                reverse: a.flag("reverse")?,
            },
            "topk" => Op::TopK {
                axis: a.usize("axis")?,
                k: a.usize("k")?,
                largest: a.flag("largest")?,
            },
            "all_reduce" => Op::AllReduce {
                mean: a.flag("mean")?,
            },
            "fused_row" => {
                let core = parse_nested(a.raw("core")?, depth + 1)?;
                let mut part = |key: &str| -> PResult<Option<FusedKernel>> {
                    match a.take(key) {
                        None => Ok(None),
                        Some(None) => Err(format!("attribute `{key}` needs a value")),
                        Some(Some(v)) => match parse_nested(v, depth + 1)? {
                            Op::Fused(k) => Ok(Some(*k)),
                            other => Err(format!("`{key}` must be a fused kernel, got `{other}`")),
                        },
                    }
                };
                let prologue = part("prologue")?;
                let epilogue = part("epilogue")?;
                Op::FusedRow(Box::new(RowFusion {
                    core,
                    prologue,
                    epilogue,
                }))
            }
            _ => return Err(format!("unknown op `{name}`")),
        }
    };
    a.finish()?;
    Ok(op)
}

fn reduce_suffix(k: ReduceKind) -> &'static str {
    match k {
        ReduceKind::Sum => "sum",
        ReduceKind::Mean => "mean",
        ReduceKind::Max => "max",
        ReduceKind::Min => "min",
        ReduceKind::Prod => "prod",
        ReduceKind::Any => "any",
        ReduceKind::All => "all",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ty(dtype: DType, dims: &[usize]) -> TensorType {
        TensorType::new(dtype, dims.to_vec())
    }

    fn geom() -> ConvGeom {
        ConvGeom::new(vec![1, 2], vec![0, 3], vec![2, 1])
    }

    /// Every variant's sample, then more attribute values: odd floats, every unary, binary,
    /// cast, reduction, activation, mask and reduction kind, and nested fused kernels.
    fn samples() -> Vec<Op> {
        let f = F64Bits::new;
        let mut ops: Vec<Op> = Op::samples().into_iter().map(|(op, _)| op).collect();
        ops.extend([
            Op::Input {
                index: 0,
                ty: ty(DType::F32, &[8, 64]),
            },
            Op::Param {
                index: 3,
                ty: ty(DType::BF16, &[]),
            },
            Op::Constant {
                index: 4_000_000_000,
                ty: ty(DType::Bool, &[0, 1]),
            },
            Op::Full {
                value: f(0.1),
                ty: ty(DType::F64, &[]),
            },
            Op::Full {
                value: f(-0.0),
                ty: ty(DType::F16, &[2]),
            },
            Op::Full {
                value: f(f64::NAN),
                ty: ty(DType::F32, &[]),
            },
            Op::Full {
                value: F64Bits(0xfff8_0000_0000_0001),
                ty: ty(DType::F32, &[]),
            },
            Op::Full {
                value: f(f64::INFINITY),
                ty: ty(DType::F32, &[]),
            },
            Op::Full {
                value: f(f64::NEG_INFINITY),
                ty: ty(DType::F32, &[]),
            },
            Op::Full {
                value: f(5e-324),
                ty: ty(DType::F32, &[]),
            },
            Op::Full {
                value: f(1.7976931348623157e308),
                ty: ty(DType::I64, &[3]),
            },
            Op::Iota {
                axis: 1,
                ty: ty(DType::I64, &[2, 5]),
            },
            Op::RandUniform {
                low: f(-0.125),
                high: f(0.125),
                seed: u64::MAX,
                ty: ty(DType::F32, &[3, 3]),
            },
            Op::RandNormal {
                mean: f(0.0),
                std: f(0.02),
                seed: 7,
                ty: ty(DType::F16, &[4]),
            },
        ]);
        ops.extend(UNARY_OPS.map(Op::Unary));
        ops.extend(BINARY_OPS.map(Op::Binary));
        ops.extend(DType::ALL.map(|to| Op::Cast { to }));
        for (i, kind) in REDUCE_KINDS.into_iter().enumerate() {
            ops.push(Op::Reduce {
                kind,
                axes: (0..i).collect(),
                keep_dims: i % 2 == 0,
            });
        }
        for kind in [ArgKind::ArgMax, ArgKind::ArgMin] {
            for keep_dims in [false, true] {
                ops.push(Op::ArgReduce {
                    kind,
                    axis: 2,
                    keep_dims,
                });
            }
        }
        for (trans_a, trans_b) in [(false, false), (true, false), (false, true), (true, true)] {
            ops.push(Op::Matmul { trans_a, trans_b });
        }
        for (_, act) in ACTS {
            ops.push(Op::MatmulEpilogue {
                trans_a: false,
                trans_b: true,
                bias: act != Activation::Relu,
                act,
                accumulate: false,
            });
        }
        for bias in [false, true] {
            ops.push(Op::MatmulEpilogue {
                trans_a: false,
                trans_b: bias,
                bias,
                act: Activation::None,
                accumulate: true,
            });
        }
        for act in [Activation::Relu, Activation::GeluErf, Activation::GeluTanh] {
            ops.push(Op::MatmulActGrad {
                trans_a: act == Activation::Relu,
                trans_b: act != Activation::GeluErf,
                act,
            });
        }
        ops.extend([
            Op::Reshape {
                shape: Shape::new([8, 1024, 768]),
            },
            Op::Reshape {
                shape: Shape::scalar(),
            },
            Op::Permute {
                perm: vec![0, 2, 1, 3],
            },
            Op::Expand {
                shape: Shape::new([4, 1]),
            },
            Op::Slice {
                starts: vec![0, 1],
                ends: vec![4, 9],
                steps: vec![1, 3],
            },
            Op::Concat { axis: 0 },
            Op::Pad {
                pads: vec![(0, 0), (1, 2)],
                value: f(-1.5),
            },
            Op::Pad {
                pads: vec![],
                value: f(f64::NAN),
            },
            Op::Softmax { axis: 3 },
            Op::LogSoftmax { axis: 1 },
            Op::LayerNorm {
                eps: f(1e-5),
                weight: true,
                bias: false,
            },
            Op::LayerNorm {
                eps: f(1e-12),
                weight: false,
                bias: true,
            },
            Op::RmsNorm {
                eps: f(1e-6),
                weight: true,
            },
            Op::Gather { axis: 1 },
            Op::ScatterAdd { axis: 0 },
            Op::IndexSelect { axis: 0 },
            Op::IndexAdd { axis: 2 },
            Op::Conv {
                geom: geom(),
                groups: 2,
                bias: true,
                act: Activation::None,
            },
            Op::Conv {
                geom: geom(),
                groups: 1,
                bias: false,
                act: Activation::Relu,
            },
            Op::ConvGradInput {
                geom: geom(),
                groups: 1,
                input_shape: Shape::new([2, 3, 8, 8]),
            },
            Op::ConvGradWeight {
                geom: geom(),
                groups: 1,
                weight_shape: Shape::new([4, 3, 3, 3]),
            },
            Op::Pool {
                kind: PoolKind::Max,
                kernel: vec![2, 2],
                geom: geom(),
            },
            Op::Pool {
                kind: PoolKind::Avg {
                    count_include_pad: true,
                },
                kernel: vec![3],
                geom: ConvGeom::new(vec![1], vec![1], vec![1]),
            },
            Op::PoolGrad {
                kind: PoolKind::Avg {
                    count_include_pad: false,
                },
                kernel: vec![2, 2],
                geom: geom(),
            },
        ]);
        for (_, causal) in CAUSALS {
            for (_, mask) in MASKS {
                for layout in [AttnLayout::Bhsd, AttnLayout::Bshd] {
                    ops.push(Op::Attention {
                        causal,
                        mask,
                        scale: f(0.125),
                        layout,
                    });
                }
            }
        }
        for wrt in 0..3 {
            for layout in [AttnLayout::Bhsd, AttnLayout::Bshd] {
                ops.push(Op::AttentionGrad {
                    causal: Causal::BottomRight,
                    mask: AttnMask::Additive,
                    scale: f(1.0 / 3.0),
                    wrt,
                    layout,
                });
            }
        }
        ops.push(Op::Attention {
            causal: Causal::TopLeft,
            mask: AttnMask::None,
            scale: f(0.125),
            layout: AttnLayout::Packed,
        });
        ops.push(Op::AttentionGrad {
            causal: Causal::TopLeft,
            mask: AttnMask::Bool,
            scale: f(0.125),
            wrt: crate::ATTN_WRT_PACKED,
            layout: AttnLayout::Packed,
        });
        for (_, reduction) in REDUCTIONS {
            ops.push(Op::CrossEntropy {
                reduction,
                ignore_index: -100,
            });
            ops.push(Op::CrossEntropyGrad {
                reduction,
                ignore_index: i64::MIN,
            });
        }
        let inner = FusedKernel {
            n_inputs: 1,
            instrs: vec![FusedInstr {
                op: Op::Unary(UnaryOp::Exp),
                args: vec![0],
                dtype: DType::F32,
            }],
            out: ty(DType::F32, &[4]),
        };
        ops.push(Op::Fused(Box::new(FusedKernel {
            n_inputs: 2,
            instrs: vec![
                FusedInstr {
                    op: Op::Binary(BinaryOp::Mul),
                    args: vec![0, 1],
                    dtype: DType::F32,
                },
                FusedInstr {
                    op: Op::Full {
                        value: f(0.5),
                        ty: ty(DType::F32, &[]),
                    },
                    args: vec![],
                    dtype: DType::F32,
                },
                FusedInstr {
                    op: Op::Cast { to: DType::BF16 },
                    args: vec![2],
                    dtype: DType::BF16,
                },
                FusedInstr {
                    op: Op::Fused(Box::new(inner)),
                    args: vec![3],
                    dtype: DType::F32,
                },
            ],
            out: ty(DType::BF16, &[8, 64]),
        })));
        ops.push(Op::FusedRow(Box::new(RowFusion {
            core: Op::Reduce {
                kind: ReduceKind::Mean,
                axes: vec![1],
                keep_dims: true,
            },
            prologue: None,
            epilogue: Some(FusedKernel {
                n_inputs: 1,
                instrs: vec![FusedInstr {
                    op: Op::Unary(UnaryOp::Sqrt),
                    args: vec![0],
                    dtype: DType::F32,
                }],
                out: ty(DType::F32, &[8, 1]),
            }),
        })));
        for trans_a in [false, true] {
            ops.push(Op::SparseMatmul {
                rows: 0,
                cols: usize::MAX,
                trans_a,
            });
        }
        ops.push(Op::Fused(Box::new(FusedKernel {
            n_inputs: 0,
            instrs: vec![],
            out: ty(DType::F32, &[]),
        })));
        ops
    }

    #[test]
    fn every_op_round_trips() {
        for op in &samples() {
            let text = op.to_string();
            assert!(
                !text.contains([' ', '(', ')', '{', '}', '%']),
                "`{text}` is not one s-expression symbol"
            );
            let back: Op = text.parse().unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(&back, op, "{text}");
            assert_eq!(back.to_string(), text);
        }
    }

    #[test]
    fn the_lists_of_every_kind_are_complete_and_in_order() {
        use crate::op::tests::{debug_variant, declared_variants};
        fn check<T: std::fmt::Debug + for<'de> serde::Deserialize<'de>>(list: &[T]) {
            let names: Vec<String> = list.iter().map(debug_variant).collect();
            assert_eq!(
                names,
                declared_variants::<T>(),
                "{}",
                std::any::type_name::<T>()
            );
        }
        check(&UNARY_OPS);
        check(&BINARY_OPS);
        check(&REDUCE_KINDS);
        check(&DType::ALL);
    }

    #[test]
    fn examples_read_as_documented() {
        let cases = [
            (
                "reduce_sum[axes=1:2,keep]",
                Op::Reduce {
                    kind: ReduceKind::Sum,
                    axes: vec![1, 2],
                    keep_dims: true,
                },
            ),
            (
                "reshape[shape=8:1024:768]",
                Op::Reshape {
                    shape: Shape::new([8, 1024, 768]),
                },
            ),
            (
                "input[index=0,ty=f32:8:64]",
                Op::Input {
                    index: 0,
                    ty: ty(DType::F32, &[8, 64]),
                },
            ),
            (
                "matmul[trans_b]",
                Op::Matmul {
                    trans_a: false,
                    trans_b: true,
                },
            ),
            (
                "pad[pads=0/0:1/2,value=0.0]",
                Op::Pad {
                    pads: vec![(0, 0), (1, 2)],
                    value: F64Bits::new(0.0),
                },
            ),
        ];
        for (text, op) in cases {
            assert_eq!(op.to_string(), text);
            assert_eq!(parse_op(text).unwrap(), op);
        }
        // Other spellings the parser accepts.
        let m = Op::Matmul {
            trans_a: true,
            trans_b: false,
        };
        assert_eq!(parse_op("matmul[trans_b=false,trans_a=true]").unwrap(), m);
        assert_eq!(parse_op("matmul[]").unwrap().to_string(), "matmul");
        assert_eq!(
            parse_op("full[value=0x3ff0000000000000,ty=f32]").unwrap(),
            Op::Full {
                value: F64Bits::new(1.0),
                ty: ty(DType::F32, &[])
            }
        );
    }

    #[test]
    fn parse_errors_name_the_text() {
        for bad in [
            "",
            "nosuchop",
            "matmul[",
            "matmul]",
            "matmul[trans_c]",
            "matmul[trans_a,trans_a]",
            "matmul[trans_a=yes]",
            "reduce_sum",
            "reduce_sum[axes=1:x]",
            "reduce_sum[axes=1][x]",
            "softmax[axis=-1]",
            "input[index=0,ty=f31:2]",
            "input[index=0]",
            "cast[to]",
            "pad[pads=1:2,value=0.0]",
            "full[value=NaN,ty=f32]",
            "full[value=0x,ty=f32]",
            "pool[kind=max,kernel=2,stride=1,padding=0,dilation=1,count_include_pad]",
            "attention[causal=left,mask=none,scale=1.0]",
            "attention_grad[causal=none,mask=none,scale=1.0,wrt=256]",
            "fused[n_inputs=1,out=f32,instrs=exp@0]",
            "fused[n_inputs=1,out=f32,instrs=exp@x@f32]",
            "fused[n_inputs=1,out=f32,instrs=nope@0@f32]",
            "add[x=1]",
            "Add",
            "add ",
        ] {
            match parse_op(bad) {
                Err(OpError::Parse { text, reason }) => {
                    assert_eq!(text, bad);
                    assert!(!reason.is_empty());
                }
                other => panic!("`{bad}` gave {other:?}"),
            }
        }
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        let mut text = "exp".to_string();
        for _ in 0..1000 {
            text = format!("fused[n_inputs=1,out=f32,instrs={text}@0@f32]");
        }
        assert!(parse_op(&text).is_err());
    }
}
