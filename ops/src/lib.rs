//! RustyTorch's op layer: [`DType`], [`Shape`], [`TensorType`], the closed [`Op`] enum, and for each
//! op family (one file each) its shape/dtype inference, its CPU kernel and its gradient rule.
//!
//! The three entry points dispatch once on the op family: [`infer`], [`eval_cpu`] and [`vjp`].

pub mod buf;
pub mod dtype;
pub mod error;
pub mod grad;
pub mod op;
pub mod rng;
pub mod shape;
pub mod tensor;
#[doc(hidden)]
pub mod testing;
pub mod text;
pub mod util;
pub mod vmath;

pub mod attention;
pub mod attention_cpu;
pub mod collective;
pub mod conv;
pub mod elementwise;
pub mod fused_row;
pub mod host_alloc;
pub mod index;
pub mod init;
pub mod loss;
pub mod matmul;
pub mod movement;
pub mod norm;
pub mod par;
pub mod pool;
pub mod reduce;
pub mod scan;
pub mod sparse;

pub use buf::Buf;
pub use dtype::{DType, Element, HostElement};
pub use error::{fmt_types, OpError, Result};
pub use grad::{GradBuilder, Value, VjpCtx};
pub use half::{bf16, f16};
pub use op::*;
pub use shape::{normalize_axis, Shape, TensorType};
pub use sparse::{spgemm, CooMatrix, CsrMatrix};
pub use tensor::{Data, HostTensor};

/// The output type of `op` applied to inputs of types `inputs`, or a typed error naming the op,
/// the input shapes and dtypes. The op's attributes and the result are checked against the size
/// limits of [`shape`] first and last.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    shape::check_op_limits(op)?;
    let ty = match op {
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Constant { .. }
        | Op::Full { .. }
        | Op::Iota { .. }
        | Op::RandUniform { .. }
        | Op::RandNormal { .. } => init::infer(op, inputs),
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } | Op::Fused(_) => {
            elementwise::infer(op, inputs)
        }
        Op::Reduce { .. } | Op::ArgReduce { .. } => reduce::infer(op, inputs),
        Op::Matmul { .. } | Op::MatmulEpilogue { .. } | Op::MatmulActGrad { .. } => {
            matmul::infer(op, inputs)
        }
        Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Expand { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Pad { .. } => movement::infer(op, inputs),
        Op::Softmax { .. } | Op::LogSoftmax { .. } | Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
            norm::infer(op, inputs)
        }
        Op::Gather { .. }
        | Op::ScatterAdd { .. }
        | Op::IndexSelect { .. }
        | Op::IndexAdd { .. } => index::infer(op, inputs),
        Op::Conv { .. } | Op::ConvGradInput { .. } | Op::ConvGradWeight { .. } => {
            conv::infer(op, inputs)
        }
        Op::Pool { .. } | Op::PoolGrad { .. } => pool::infer(op, inputs),
        Op::Attention { .. } | Op::AttentionGrad { .. } => attention::infer(op, inputs),
        Op::CrossEntropy { .. } | Op::CrossEntropyGrad { .. } => loss::infer(op, inputs),
        Op::SparseMatmul { .. } | Op::SampledMatmul => sparse::infer(op, inputs),
        Op::CumSum { .. } | Op::TopK { .. } => scan::infer(op, inputs),
        Op::AllReduce { .. } => collective::infer(op, inputs),
        Op::FusedRow(_) => fused_row::infer(op, inputs),
    }?;
    shape::check_result_limits(op, inputs, &ty)?;
    Ok(ty)
}

/// Runs `op`'s CPU kernel. Leaves that name graph data (`Input`, `Param`, `Constant`) are supplied
/// by the runtime and are an error here.
pub fn eval_cpu(op: &Op, inputs: &[&HostTensor]) -> Result<HostTensor> {
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let out = infer(op, &refs)?;
    match op {
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Constant { .. }
        | Op::Full { .. }
        | Op::Iota { .. }
        | Op::RandUniform { .. }
        | Op::RandNormal { .. } => init::cpu(op, inputs, &out),
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } | Op::Fused(_) => {
            elementwise::cpu(op, inputs, &out)
        }
        Op::Reduce { .. } | Op::ArgReduce { .. } => reduce::cpu(op, inputs, &out),
        Op::Matmul { .. } | Op::MatmulEpilogue { .. } | Op::MatmulActGrad { .. } => {
            matmul::cpu(op, inputs, &out)
        }
        Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Expand { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Pad { .. } => movement::cpu(op, inputs, &out),
        Op::Softmax { .. } | Op::LogSoftmax { .. } | Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
            norm::cpu(op, inputs, &out)
        }
        Op::Gather { .. }
        | Op::ScatterAdd { .. }
        | Op::IndexSelect { .. }
        | Op::IndexAdd { .. } => index::cpu(op, inputs, &out),
        Op::Conv { .. } | Op::ConvGradInput { .. } | Op::ConvGradWeight { .. } => {
            conv::cpu(op, inputs, &out)
        }
        Op::Pool { .. } | Op::PoolGrad { .. } => pool::cpu(op, inputs, &out),
        Op::Attention { .. } | Op::AttentionGrad { .. } => attention::cpu(op, inputs, &out),
        Op::CrossEntropy { .. } | Op::CrossEntropyGrad { .. } => loss::cpu(op, inputs, &out),
        Op::SparseMatmul { .. } | Op::SampledMatmul => sparse::cpu(op, inputs, &out),
        Op::CumSum { .. } | Op::TopK { .. } => scan::cpu(op, inputs, &out),
        Op::AllReduce { .. } => collective::cpu(op, inputs, &out),
        Op::FusedRow(_) => fused_row::cpu(op, inputs, &out),
    }
}

/// The vector-Jacobian product of `cx.op`: one optional gradient per input (`None` where the input
/// gets no gradient, such as integer indices).
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    match cx.op {
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Constant { .. }
        | Op::Full { .. }
        | Op::Iota { .. }
        | Op::RandUniform { .. }
        | Op::RandNormal { .. } => Ok(vec![]),
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } | Op::Fused(_) => {
            elementwise::vjp(cx)
        }
        Op::Reduce { .. } | Op::ArgReduce { .. } => reduce::vjp(cx),
        Op::Matmul { .. } | Op::MatmulEpilogue { .. } | Op::MatmulActGrad { .. } => matmul::vjp(cx),
        Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Expand { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Pad { .. } => movement::vjp(cx),
        Op::Softmax { .. } | Op::LogSoftmax { .. } | Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
            norm::vjp(cx)
        }
        Op::Gather { .. }
        | Op::ScatterAdd { .. }
        | Op::IndexSelect { .. }
        | Op::IndexAdd { .. } => index::vjp(cx),
        Op::Conv { .. } | Op::ConvGradInput { .. } | Op::ConvGradWeight { .. } => conv::vjp(cx),
        Op::Pool { .. } | Op::PoolGrad { .. } => pool::vjp(cx),
        Op::Attention { .. } | Op::AttentionGrad { .. } => attention::vjp(cx),
        Op::CrossEntropy { .. } | Op::CrossEntropyGrad { .. } => loss::vjp(cx),
        Op::SparseMatmul { .. } | Op::SampledMatmul => sparse::vjp(cx),
        Op::CumSum { .. } | Op::TopK { .. } => scan::vjp(cx),
        Op::AllReduce { .. } => collective::vjp(cx),
        Op::FusedRow(_) => fused_row::vjp(cx),
    }
}
