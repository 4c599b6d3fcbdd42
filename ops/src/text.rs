//! The textual form of ops: `name` or `name[key=value,...]`, shared by the IR printer/parser,
//! the e-graph's s-expressions and the rule files.

use crate::{ArgKind, BinaryOp, Op, ReduceKind, UnaryOp};

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
