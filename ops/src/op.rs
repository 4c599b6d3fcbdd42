//! The closed op set. Every `match` over [`Op`] is exhaustive: adding a variant makes the compiler
//! list each place that must handle it (shape inference, CPU kernel, gradient, text form, codegen).

use crate::{DType, Shape, TensorType};
use serde::{Deserialize, Serialize};

/// An f64 attribute stored as its bits, so that [`Op`] can be `Eq + Hash + Ord` (the e-graph needs it).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct F64Bits(pub u64);

impl F64Bits {
    /// Wraps a float.
    pub fn new(v: f64) -> F64Bits {
        F64Bits(v.to_bits())
    }
    /// The float value.
    pub fn get(self) -> f64 {
        f64::from_bits(self.0)
    }
}

impl std::fmt::Debug for F64Bits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.get())
    }
}

impl From<f64> for F64Bits {
    fn from(v: f64) -> F64Bits {
        F64Bits::new(v)
    }
}

/// Elementwise functions of one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum UnaryOp {
    /// -x
    Neg,
    /// |x|
    Abs,
    /// e^x
    Exp,
    /// ln x
    Log,
    /// √x
    Sqrt,
    /// 1/√x
    Rsqrt,
    /// 1/x
    Reciprocal,
    /// sin x
    Sin,
    /// cos x
    Cos,
    /// tanh x
    Tanh,
    /// 1/(1+e^-x)
    Sigmoid,
    /// max(x, 0)
    Relu,
    /// x·Φ(x) with the exact erf.
    GeluErf,
    /// GELU's tanh approximation.
    GeluTanh,
    /// x·sigmoid(x)
    Silu,
    /// -1, 0 or 1
    Sign,
    /// ⌊x⌋
    Floor,
    /// ⌈x⌉
    Ceil,
    /// Round half to even.
    Round,
    /// Logical not (bool only).
    Not,
    /// x is NaN (bool result).
    IsNan,
    /// x is ±∞ (bool result).
    IsInf,
    /// x is finite (bool result).
    IsFinite,
    /// erf x, the error function.
    Erf,
}

/// Elementwise functions of two tensors, with numpy broadcasting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum BinaryOp {
    /// a + b
    Add,
    /// a - b
    Sub,
    /// a · b
    Mul,
    /// a / b (integer division truncates; division by zero is an error-free 0 for integers)
    Div,
    /// a ^ b
    Pow,
    /// max(a, b) (NaN propagates)
    Maximum,
    /// min(a, b) (NaN propagates)
    Minimum,
    /// a == b (bool result)
    Eq,
    /// a != b (bool result)
    Ne,
    /// a < b (bool result)
    Lt,
    /// a <= b (bool result)
    Le,
    /// a > b (bool result)
    Gt,
    /// a >= b (bool result)
    Ge,
    /// a && b (bool only)
    And,
    /// a || b (bool only)
    Or,
}

impl BinaryOp {
    /// Whether the result is bool (comparisons and logic).
    pub fn is_predicate(self) -> bool {
        matches!(
            self,
            BinaryOp::Eq
                | BinaryOp::Ne
                | BinaryOp::Lt
                | BinaryOp::Le
                | BinaryOp::Gt
                | BinaryOp::Ge
                | BinaryOp::And
                | BinaryOp::Or
        )
    }
}

/// What a [`Op::Reduce`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ReduceKind {
    /// Σ
    Sum,
    /// Σ / n
    Mean,
    /// max (NaN propagates)
    Max,
    /// min (NaN propagates)
    Min,
    /// Π
    Prod,
    /// Any true (bool only).
    Any,
    /// All true (bool only).
    All,
}

/// Which index [`Op::ArgReduce`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ArgKind {
    /// Index of the first maximum.
    ArgMax,
    /// Index of the first minimum.
    ArgMin,
}

/// A pooling function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum PoolKind {
    /// Max over the window (padding never wins).
    Max,
    /// Average over the window.
    Avg {
        /// Whether padded positions count in the divisor (PyTorch's `count_include_pad`).
        count_include_pad: bool,
    },
}

/// Causal masking of attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Causal {
    /// No causal mask.
    None,
    /// Query i sees keys j <= i (PyTorch's `is_causal`).
    TopLeft,
    /// Query i sees keys j <= i + (Sk - Sq) (FlashAttention's; decoding with a KV cache).
    BottomRight,
}

/// Where the heads lie in attention's q, k, v, gradient and result tensors.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub enum AttnLayout {
    /// `[B, H, S, D]`: each head's rows contiguous (PyTorch's SDPA operands).
    #[default]
    Bhsd,
    /// `[B, S, H, D]`: each position's heads contiguous, as a linear layer's output
    /// `[B, S, H·D]` reshaped, so attention reads and writes it without a transpose.
    Bshd,
    /// q, k and v are one `[B, S, 3, H, D]` tensor read in place (q at index 0 of its third
    /// dim, k at 1, v at 2): one linear layer's `[B, S, 3·H·D]` output split into q, k and v
    /// and then into heads, as GPT-2's `c_attn`. The result (and `grad_out`) is `[B, S, H, D]`
    /// as in [`AttnLayout::Bshd`]; the gradient is one op (`wrt` [`ATTN_WRT_PACKED`]) whose
    /// result is `[B, S, 3, H, D]`, dq, dk and dv where q, k and v lie. Self-attention only.
    Packed,
}

/// The `wrt` of the one gradient of a [`AttnLayout::Packed`] attention: with respect to q, k
/// and v at once, in their packed tensor.
pub const ATTN_WRT_PACKED: u8 = 3;

impl AttnLayout {
    /// The `[B, H, S, D]` dims of a tensor of `dims` in this layout (rank 4, or rank 5 for a
    /// packed `[B, S, 3, H, D]` operand, whose q, k and v each have the dims returned).
    pub fn to_bhsd(self, dims: &[usize]) -> [usize; 4] {
        match self {
            AttnLayout::Bhsd => [dims[0], dims[1], dims[2], dims[3]],
            AttnLayout::Packed if dims.len() == 5 => [dims[0], dims[3], dims[1], dims[4]],
            AttnLayout::Bshd | AttnLayout::Packed => [dims[0], dims[2], dims[1], dims[3]],
        }
    }

    /// The dims in this layout of a tensor whose `[B, H, S, D]` dims are `bhsd`.
    pub fn from_bhsd(self, bhsd: [usize; 4]) -> [usize; 4] {
        // The two layouts differ by one swap, its own inverse.
        self.to_bhsd(&bhsd)
    }
}

/// The extra mask input of attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum AttnMask {
    /// No mask input.
    None,
    /// A float mask added to the scores, broadcast to [B,H,Sq,Sk].
    Additive,
    /// A bool mask (true = keep), broadcast to [B,H,Sq,Sk].
    Bool,
}

/// Reduction of a loss over its batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Reduction {
    /// Mean over the counted elements.
    Mean,
    /// Sum.
    Sum,
    /// One loss per element.
    None,
}

/// The activation of a matmul epilogue or of a convolution.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub enum Activation {
    /// Identity.
    #[default]
    None,
    /// ReLU.
    Relu,
    /// GELU, erf form.
    GeluErf,
    /// GELU, tanh form.
    GeluTanh,
}

/// Where the channel dim of a convolution's or pooling's tensors lies.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub enum Layout {
    /// `[N, C, *spatial]` (NCW, NCHW, NCDHW); weights `[O, C/groups, *kernel]`.
    #[default]
    ChannelsFirst,
    /// `[N, *spatial, C]` (NWC, NHWC, NDHWC); weights `[O, *kernel, C/groups]`.
    ChannelsLast,
}

impl Layout {
    /// The permutation taking a channels-first tensor of `rank` to this layout
    /// (`[0, 2, .., rank-1, 1]` for channels-last, the identity otherwise).
    pub fn from_first(self, rank: usize) -> Vec<usize> {
        match self {
            Layout::ChannelsFirst => (0..rank).collect(),
            Layout::ChannelsLast if rank < 2 => (0..rank).collect(),
            Layout::ChannelsLast => std::iter::once(0)
                .chain(2..rank)
                .chain(std::iter::once(1))
                .collect(),
        }
    }

    /// The permutation taking a tensor of `rank` in this layout to channels-first
    /// (`[0, rank-1, 1, .., rank-2]` for channels-last).
    pub fn to_first(self, rank: usize) -> Vec<usize> {
        match self {
            Layout::ChannelsFirst => (0..rank).collect(),
            Layout::ChannelsLast if rank < 2 => (0..rank).collect(),
            Layout::ChannelsLast => [0, rank - 1].into_iter().chain(1..rank - 1).collect(),
        }
    }

    /// The axis holding the channels in a tensor of `rank`.
    pub fn channel_axis(self, rank: usize) -> usize {
        match self {
            Layout::ChannelsFirst => 1,
            Layout::ChannelsLast => rank.saturating_sub(1),
        }
    }

    /// `dims` (in this layout) reordered channels-first.
    pub fn dims_to_first(self, dims: &[usize]) -> Vec<usize> {
        self.to_first(dims.len()).iter().map(|&a| dims[a]).collect()
    }

    /// Channels-first `dims` reordered into this layout.
    pub fn dims_from_first(self, dims: &[usize]) -> Vec<usize> {
        self.from_first(dims.len())
            .iter()
            .map(|&a| dims[a])
            .collect()
    }
}

/// Convolution / pooling geometry, one entry per spatial dim, and the tensors' layout.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ConvGeom {
    /// Stride per spatial dim.
    pub stride: Vec<usize>,
    /// Symmetric zero padding per spatial dim.
    pub padding: Vec<usize>,
    /// Dilation per spatial dim.
    pub dilation: Vec<usize>,
    /// The layout of the op's activations and weights (and of its results). Not part of the
    /// serde encoding: graph files from version 3 keep it in a table of their own
    /// (docs/graph-format.md), so older files read as channels-first.
    #[serde(skip)]
    pub layout: Layout,
}

impl ConvGeom {
    /// Channels-first geometry with these strides, paddings and dilations.
    pub fn new(stride: Vec<usize>, padding: Vec<usize>, dilation: Vec<usize>) -> ConvGeom {
        ConvGeom {
            stride,
            padding,
            dilation,
            layout: Layout::ChannelsFirst,
        }
    }

    /// The same geometry in `layout`.
    pub fn with_layout(mut self, layout: Layout) -> ConvGeom {
        self.layout = layout;
        self
    }
}

/// One instruction of a fused elementwise kernel: an elementwise op over earlier values.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FusedInstr {
    /// The elementwise op (`Unary`, `Binary`, `Where`, `Cast` or a scalar `Full`).
    pub op: Op,
    /// Operands: `i < n_inputs` reads kernel input `i`, otherwise instruction `i - n_inputs`.
    pub args: Vec<u32>,
    /// The instruction's result type (its shape is the kernel's output shape).
    pub dtype: DType,
}

/// A fused elementwise kernel: inputs broadcast to the output shape, a straight-line program.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FusedKernel {
    /// Number of kernel inputs.
    pub n_inputs: u32,
    /// The program; the last instruction is the result.
    pub instrs: Vec<FusedInstr>,
    /// Output type.
    pub out: TensorType,
}

/// A fused row kernel ([`Op::FusedRow`]): a normalization, softmax or reduction with elementwise
/// programs fused into its input and its output (see [`crate::fused_row`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RowFusion {
    /// The row op: `Softmax`, `LogSoftmax`, `LayerNorm`, `RmsNorm` or `Reduce`.
    pub core: Op,
    /// Computes the core's input from the kernel's first `n_inputs` operands, per input element;
    /// `None` when operand 0 is the core's input.
    pub prologue: Option<FusedKernel>,
    /// Computes the result from the core's result (its input 0) and the kernel's last
    /// `n_inputs - 1` operands, per output element; `None` when the core's result is the result.
    pub epilogue: Option<FusedKernel>,
}

/// The closed set of tensor operations. Attributes are part of the op (floats as bits, axes
/// normalized to non-negative and sorted), so equal ops compare equal.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Op {
    // ---- leaves ----
    /// The graph's `index`-th input.
    Input {
        /// Position among the graph's inputs.
        index: u32,
        /// Declared type.
        ty: TensorType,
    },
    /// The graph's `index`-th parameter (or optimizer state).
    Param {
        /// Position among the graph's parameters.
        index: u32,
        /// Declared type.
        ty: TensorType,
    },
    /// The graph's `index`-th constant tensor (data held by the graph).
    Constant {
        /// Position among the graph's constants.
        index: u32,
        /// Type.
        ty: TensorType,
    },
    /// A tensor filled with one value (rank 0 for scalars).
    Full {
        /// The value.
        value: F64Bits,
        /// Type.
        ty: TensorType,
    },
    /// Indices 0..n along `axis`, broadcast over the other dims.
    Iota {
        /// The counting axis.
        axis: usize,
        /// Type.
        ty: TensorType,
    },
    /// Seeded uniform random values in [low, high).
    RandUniform {
        /// Lower bound.
        low: F64Bits,
        /// Upper bound.
        high: F64Bits,
        /// Seed.
        seed: u64,
        /// Type.
        ty: TensorType,
    },
    /// Seeded normal random values.
    RandNormal {
        /// Mean.
        mean: F64Bits,
        /// Standard deviation.
        std: F64Bits,
        /// Seed.
        seed: u64,
        /// Type.
        ty: TensorType,
    },

    // ---- elementwise ----
    /// Elementwise function of one tensor.
    Unary(UnaryOp),
    /// Elementwise function of two broadcast tensors.
    Binary(BinaryOp),
    /// `cond ? a : b`, all three broadcast.
    Where,
    /// Conversion to another dtype.
    Cast {
        /// Target dtype.
        to: DType,
    },

    // ---- reductions ----
    /// Reduction over a set of axes.
    Reduce {
        /// What to compute.
        kind: ReduceKind,
        /// Axes (normalized, sorted, unique).
        axes: Vec<usize>,
        /// Keep reduced dims as size 1.
        keep_dims: bool,
    },
    /// Index of the max/min along one axis (i64 result).
    ArgReduce {
        /// Max or min.
        kind: ArgKind,
        /// The axis.
        axis: usize,
        /// Keep the reduced dim as size 1.
        keep_dims: bool,
    },

    // ---- linear algebra ----
    /// Matrix product over the last two dims, batch dims broadcast.
    Matmul {
        /// Use Aᵀ (swap A's last two dims).
        trans_a: bool,
        /// Use Bᵀ.
        trans_b: bool,
    },
    /// `act(A·B + bias + C)` as one library call (cuBLASLt's epilogue shape); inputs a, b,
    /// [bias], [c].
    MatmulEpilogue {
        /// Use Aᵀ.
        trans_a: bool,
        /// Use Bᵀ.
        trans_b: bool,
        /// Whether a 1-D bias over the last dim is the third input.
        bias: bool,
        /// Activation.
        act: Activation,
        /// Whether an operand of the result's type follows the bias, added to the product
        /// before the one rounding (cuBLASLt's C with beta 1: a residual add, or a gradient
        /// summed into); only with no activation. Not part of the serde encoding: graph files
        /// from version 6 keep it in a table of their own, so older files read as `false`.
        #[serde(skip, default)]
        accumulate: bool,
    },

    // ---- movement ----
    /// Same elements, new shape.
    Reshape {
        /// The new shape.
        shape: Shape,
    },
    /// Dim permutation.
    Permute {
        /// `out.dims[i] = in.dims[perm[i]]`.
        perm: Vec<usize>,
    },
    /// Broadcast to a larger shape.
    Expand {
        /// The target shape.
        shape: Shape,
    },
    /// Strided slice of every dim: `start..end` by `step`.
    Slice {
        /// Start per dim.
        starts: Vec<usize>,
        /// End per dim (exclusive).
        ends: Vec<usize>,
        /// Step per dim (>= 1).
        steps: Vec<usize>,
    },
    /// Concatenation along an axis.
    Concat {
        /// The axis.
        axis: usize,
    },
    /// Constant padding: `(before, after)` per dim.
    Pad {
        /// Padding per dim.
        pads: Vec<(usize, usize)>,
        /// The fill value.
        value: F64Bits,
    },

    // ---- normalization ----
    /// Softmax along an axis.
    Softmax {
        /// The axis.
        axis: usize,
    },
    /// Log-softmax along an axis.
    LogSoftmax {
        /// The axis.
        axis: usize,
    },
    /// LayerNorm over the last dim; inputs x, [weight], [bias].
    LayerNorm {
        /// Epsilon.
        eps: F64Bits,
        /// Whether a weight input follows.
        weight: bool,
        /// Whether a bias input follows.
        bias: bool,
    },
    /// RMSNorm over the last dim; inputs x, [weight].
    RmsNorm {
        /// Epsilon.
        eps: F64Bits,
        /// Whether a weight input follows.
        weight: bool,
    },

    // ---- indexing ----
    /// `out[..i..] = x[..index[..i..]..]` along `axis` (torch.gather); inputs x, index.
    Gather {
        /// The axis.
        axis: usize,
    },
    /// Inverse of gather: `out = base; out[..index[i]..] += src[i]`; inputs base, index, src.
    ScatterAdd {
        /// The axis.
        axis: usize,
    },
    /// Rows of `x` picked by a 1-D index along `axis` (embedding is axis 0); inputs x, index.
    IndexSelect {
        /// The axis.
        axis: usize,
    },
    /// Inverse of index_select: `out = base; out[index[i]] += src[i]` along axis; inputs base, index, src.
    IndexAdd {
        /// The axis.
        axis: usize,
    },

    // ---- convolution and pooling ----
    /// N-d convolution (NCW / NCHW / NCDHW, or channels-last by `geom.layout`), inputs x, w,
    /// [bias]; `act(conv(x, w) + bias)`.
    Conv {
        /// Geometry.
        geom: ConvGeom,
        /// Groups.
        groups: usize,
        /// Whether a bias input follows.
        bias: bool,
        /// The activation applied after the bias. Not part of the serde encoding: graph files
        /// from version 5 keep it in a table of their own, so older files read as `None`.
        #[serde(skip, default)]
        act: Activation,
    },
    /// Gradient of a convolution with respect to its input; inputs grad_out, w.
    ConvGradInput {
        /// Geometry.
        geom: ConvGeom,
        /// Groups.
        groups: usize,
        /// The input's shape.
        input_shape: Shape,
    },
    /// Gradient of a convolution with respect to its weight; inputs x, grad_out.
    ConvGradWeight {
        /// Geometry.
        geom: ConvGeom,
        /// Groups.
        groups: usize,
        /// The weight's shape.
        weight_shape: Shape,
    },
    /// N-d pooling over the spatial dims of `[N, C, *spatial]` (or `[N, *spatial, C]`).
    Pool {
        /// Max or average.
        kind: PoolKind,
        /// Window per spatial dim.
        kernel: Vec<usize>,
        /// Stride and padding (dilation 1).
        geom: ConvGeom,
    },
    /// Gradient of pooling; inputs x, grad_out.
    PoolGrad {
        /// Max or average.
        kind: PoolKind,
        /// Window per spatial dim.
        kernel: Vec<usize>,
        /// Stride and padding.
        geom: ConvGeom,
    },

    // ---- attention ----
    /// Scaled dot-product attention, inputs q [B,H,Sq,D], k [B,H,Sk,D], v [B,H,Sk,Dv], [mask]
    /// (or [B,S,H,D] each, by `layout`; the mask is always broadcast to [B,H,Sq,Sk]).
    /// A fully masked row yields zeros.
    Attention {
        /// Causal masking.
        causal: Causal,
        /// The mask input.
        mask: AttnMask,
        /// Score scale (usually 1/√D).
        scale: F64Bits,
        /// The operands' and result's layout. Not part of the serde encoding: graph files from
        /// version 4 keep it in their layout table (docs/graph-format.md).
        #[serde(skip)]
        layout: AttnLayout,
    },
    /// Gradient of attention with respect to input `wrt` (0 = q, 1 = k, 2 = v);
    /// inputs q, k, v, [mask], grad_out.
    AttentionGrad {
        /// Causal masking.
        causal: Causal,
        /// The mask input.
        mask: AttnMask,
        /// Score scale.
        scale: F64Bits,
        /// Which input's gradient.
        wrt: u8,
        /// The operands' and result's layout (see [`Op::Attention`]).
        #[serde(skip)]
        layout: AttnLayout,
    },

    // ---- losses ----
    /// Cross entropy from logits [N,C] and integer targets [N].
    CrossEntropy {
        /// Batch reduction.
        reduction: Reduction,
        /// Targets equal to this are ignored (not counted in the mean).
        ignore_index: i64,
    },
    /// Gradient of cross entropy with respect to the logits; inputs logits, targets, grad_out.
    CrossEntropyGrad {
        /// Batch reduction.
        reduction: Reduction,
        /// Ignored target.
        ignore_index: i64,
    },

    // ---- fused ----
    /// A fused elementwise kernel (made by the fusion pass).
    Fused(#[serde(deserialize_with = "deserialize_fused")] Box<FusedKernel>),

    // ---- sparse ----
    /// Sparse × dense product (SpMM) with a CSR matrix A of `rows` × `cols`; inputs row_ptr
    /// [rows+1] and col_idx [nnz] (i32 or i64, one dtype), values [nnz] and a dense x (float, one
    /// dtype). `A·x` with x [cols, n] gives [rows, n]; with `trans_a`, `Aᵀ·x` with x [rows, n]
    /// gives [cols, n]. Column indices need not be sorted within a row; repeated ones add up.
    SparseMatmul {
        /// A's row count.
        rows: usize,
        /// A's column count.
        cols: usize,
        /// Multiply by Aᵀ.
        trans_a: bool,
    },
    /// Sampled dense × dense product (SDDMM): `(a·bᵀ)` at the nonzeros of a CSR pattern;
    /// inputs row_ptr [m+1], col_idx [nnz], a [m, k], b [n, k]; the result is [nnz] with
    /// `out[e] = Σ_j a[row(e), j] · b[col_idx[e], j]` (the gradient of [`Op::SparseMatmul`]
    /// with respect to A's values).
    SampledMatmul,

    // ---- scans and selection ----
    /// Cumulative sum along `axis` (ONNX's CumSum): `exclusive` leaves each element out of its
    /// own sum, `reverse` sums from the end.
    CumSum {
        /// The axis.
        axis: usize,
        /// Sum of the elements strictly before (after, reversed) each one.
        exclusive: bool,
        /// Sum from the end of the axis.
        reverse: bool,
    },
    /// Indices (i64) of the `k` largest (or smallest) elements along `axis`, in order (NaN above
    /// every number; equal values by index); the values are `gather` of these indices.
    TopK {
        /// The axis.
        axis: usize,
        /// How many.
        k: usize,
        /// The largest (else the smallest).
        largest: bool,
    },

    // ---- collectives ----
    /// The sum (or mean) of the input over the replicas of a data-parallel run (identity in a
    /// run of one replica); see [`crate::collective`].
    AllReduce {
        /// Divide the sum by the number of replicas.
        mean: bool,
    },

    // ---- fused (appended after the collectives: variants keep their file tags) ----
    /// A normalization, softmax or reduction with elementwise producers fused into its input and
    /// elementwise consumers into its output (made by the fusion pass).
    FusedRow(#[serde(deserialize_with = "deserialize_fused_row")] Box<RowFusion>),

    // ---- linear algebra, backward (appended: variants keep their file tags) ----
    /// `(op(A)·op(B)) ⊙ act'(pre)`: a matmul's result taken back through an activation's
    /// derivative at the pre-activation `pre` (the MLP backward's `dh·W2ᵀ` through GELU), one
    /// library call where cuBLASLt has the derivative epilogue (`DGELU`); inputs a, b, pre, with
    /// `pre` of the product's shape and dtype.
    MatmulActGrad {
        /// Use Aᵀ.
        trans_a: bool,
        /// Use Bᵀ.
        trans_b: bool,
        /// The activation whose derivative is applied (never `None`).
        act: Activation,
    },
}

/// How deeply fused kernels may nest inside each other's programs when deserialized.
const MAX_FUSED_NESTING: u32 = 8;

/// Deserializes a fused kernel, refusing kernels nested more than [`MAX_FUSED_NESTING`] deep:
/// a hostile file could otherwise recurse until the stack overflows.
fn deserialize_fused<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Box<FusedKernel>, D::Error> {
    nested(|| FusedKernel::deserialize(d).map(Box::new))
}

/// Runs `f` one fused level deeper, or fails past [`MAX_FUSED_NESTING`] levels.
fn nested<T, E: serde::de::Error>(f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    use std::cell::Cell;
    thread_local!(static DEPTH: Cell<u32> = const { Cell::new(0) });
    struct Guard(u32);
    impl Drop for Guard {
        fn drop(&mut self) {
            DEPTH.with(|c| c.set(self.0));
        }
    }
    let depth = DEPTH.with(|c| c.get());
    if depth >= MAX_FUSED_NESTING {
        return Err(E::custom("fused kernels nested too deeply"));
    }
    let _restore = Guard(depth);
    DEPTH.with(|c| c.set(depth + 1));
    f()
}

/// Deserializes a fused row kernel under the same nesting limit as [`deserialize_fused`] (its
/// core and programs hold ops, which could hold fused kernels in turn).
fn deserialize_fused_row<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Box<RowFusion>, D::Error> {
    nested(|| RowFusion::deserialize(d).map(Box::new))
}

impl Op {
    /// This op with attention's layout set to `layout` (any other op unchanged).
    pub fn with_attn_layout(&self, layout: AttnLayout) -> Op {
        let mut op = self.clone();
        if let Op::Attention { layout: l, .. } | Op::AttentionGrad { layout: l, .. } = &mut op {
            *l = layout;
        }
        op
    }

    /// The gradient of an `attention` op with respect to q (`wrt` 0), k (1) or v (2): the
    /// `attention_grad` op with the same attributes. `None` for any other op.
    pub fn attention_grad(&self, wrt: u8) -> Option<Op> {
        match *self {
            Op::Attention {
                causal,
                mask,
                scale,
                layout,
            } => Some(Op::AttentionGrad {
                causal,
                mask,
                scale,
                wrt,
                layout,
            }),
            _ => None,
        }
    }

    /// The op's family name, as used in error messages and the IR text (`matmul`, `reduce_sum`...).
    pub fn name(&self) -> &'static str {
        crate::text::op_name(self)
    }

    /// Number of [`Op`] variants (a test checks it against the enum; [`Op::samples`] has one
    /// entry per variant).
    pub const VARIANT_COUNT: usize = 46;

    /// The position of this op's variant in the enum (0..[`Op::VARIANT_COUNT`]); the exhaustive
    /// match makes a new variant a compile error here, which the tests that cover every variant
    /// rely on.
    pub fn variant_index(&self) -> usize {
        match self {
            Op::Input { .. } => 0,
            Op::Param { .. } => 1,
            Op::Constant { .. } => 2,
            Op::Full { .. } => 3,
            Op::Iota { .. } => 4,
            Op::RandUniform { .. } => 5,
            Op::RandNormal { .. } => 6,
            Op::Unary(_) => 7,
            Op::Binary(_) => 8,
            Op::Where => 9,
            Op::Cast { .. } => 10,
            Op::Reduce { .. } => 11,
            Op::ArgReduce { .. } => 12,
            Op::Matmul { .. } => 13,
            Op::MatmulEpilogue { .. } => 14,
            Op::Reshape { .. } => 15,
            Op::Permute { .. } => 16,
            Op::Expand { .. } => 17,
            Op::Slice { .. } => 18,
            Op::Concat { .. } => 19,
            Op::Pad { .. } => 20,
            Op::Softmax { .. } => 21,
            Op::LogSoftmax { .. } => 22,
            Op::LayerNorm { .. } => 23,
            Op::RmsNorm { .. } => 24,
            Op::Gather { .. } => 25,
            Op::ScatterAdd { .. } => 26,
            Op::IndexSelect { .. } => 27,
            Op::IndexAdd { .. } => 28,
            Op::Conv { .. } => 29,
            Op::ConvGradInput { .. } => 30,
            Op::ConvGradWeight { .. } => 31,
            Op::Pool { .. } => 32,
            Op::PoolGrad { .. } => 33,
            Op::Attention { .. } => 34,
            Op::AttentionGrad { .. } => 35,
            Op::CrossEntropy { .. } => 36,
            Op::CrossEntropyGrad { .. } => 37,
            Op::Fused(_) => 38,
            Op::SparseMatmul { .. } => 39,
            Op::SampledMatmul => 40,
            Op::CumSum { .. } => 41,
            Op::TopK { .. } => 42,
            Op::AllReduce { .. } => 43,
            Op::FusedRow(_) => 44,
            Op::MatmulActGrad { .. } => 45,
        }
    }

    /// One op of every variant, in declaration order (`samples()[i].0.variant_index() == i`), each
    /// with representative attributes and input types its inference accepts. Integer inputs are
    /// valid indices and targets for any values in {0, 1}, float inputs for any finite values, so
    /// the samples also run on seeded random data; the one exception is a CSR pattern's row
    /// pointers (input 0 of the sparse ops), which must be a valid prefix sum:
    /// [`crate::testing::sample_input`] makes every sample input, that one included.
    ///
    /// This is the one list of every op: the text round trip, the graph-file golden test and the
    /// e-graph's wildcard table all use it. Its length is [`Op::VARIANT_COUNT`], so a variant
    /// added to [`Op::variant_index`] without a sample here does not compile.
    pub fn samples() -> Vec<(Op, Vec<TensorType>)> {
        let t = |dtype: DType, dims: &[usize]| TensorType::new(dtype, dims.to_vec());
        let f32t = |dims: &[usize]| t(DType::F32, dims);
        let f = F64Bits::new;
        let geom2 = ConvGeom::new(vec![1, 2], vec![1, 0], vec![1, 1]);
        let x = f32t(&[2, 3]);
        let all: [(Op, Vec<TensorType>); Op::VARIANT_COUNT] = [
            (
                Op::Input {
                    index: 0,
                    ty: x.clone(),
                },
                vec![],
            ),
            (
                Op::Param {
                    index: 0,
                    ty: f32t(&[3]),
                },
                vec![],
            ),
            (
                Op::Constant {
                    index: 0,
                    ty: t(DType::I64, &[2]),
                },
                vec![],
            ),
            (
                Op::Full {
                    value: f(0.5),
                    ty: f32t(&[2]),
                },
                vec![],
            ),
            (
                Op::Iota {
                    axis: 1,
                    ty: t(DType::I64, &[2, 3]),
                },
                vec![],
            ),
            (
                Op::RandUniform {
                    low: f(-1.0),
                    high: f(1.0),
                    seed: 7,
                    ty: x.clone(),
                },
                vec![],
            ),
            (
                Op::RandNormal {
                    mean: f(0.0),
                    std: f(2.0),
                    seed: 8,
                    ty: t(DType::F64, &[4]),
                },
                vec![],
            ),
            (Op::Unary(UnaryOp::Tanh), vec![x.clone()]),
            (Op::Binary(BinaryOp::Sub), vec![x.clone(), f32t(&[3])]),
            (
                Op::Where,
                vec![t(DType::Bool, &[2, 3]), x.clone(), f32t(&[])],
            ),
            (Op::Cast { to: DType::F16 }, vec![x.clone()]),
            (
                Op::Reduce {
                    kind: ReduceKind::Sum,
                    axes: vec![1],
                    keep_dims: true,
                },
                vec![x.clone()],
            ),
            (
                Op::ArgReduce {
                    kind: ArgKind::ArgMax,
                    axis: 1,
                    keep_dims: false,
                },
                vec![x.clone()],
            ),
            (
                Op::Matmul {
                    trans_a: false,
                    trans_b: true,
                },
                vec![x.clone(), f32t(&[4, 3])],
            ),
            (
                Op::MatmulEpilogue {
                    trans_a: false,
                    trans_b: false,
                    bias: true,
                    act: Activation::GeluErf,
                    accumulate: false,
                },
                vec![x.clone(), f32t(&[3, 4]), f32t(&[4])],
            ),
            (
                Op::Reshape {
                    shape: Shape::new([3, 2]),
                },
                vec![x.clone()],
            ),
            (
                Op::Permute {
                    perm: vec![2, 0, 1],
                },
                vec![f32t(&[2, 3, 4])],
            ),
            (
                Op::Expand {
                    shape: Shape::new([2, 3]),
                },
                vec![f32t(&[1, 3])],
            ),
            (
                Op::Slice {
                    starts: vec![0, 1],
                    ends: vec![2, 3],
                    steps: vec![1, 2],
                },
                vec![x.clone()],
            ),
            (Op::Concat { axis: 0 }, vec![x.clone(), f32t(&[1, 3])]),
            (
                Op::Pad {
                    pads: vec![(0, 0), (1, 2)],
                    value: f(-1.5),
                },
                vec![x.clone()],
            ),
            (Op::Softmax { axis: 1 }, vec![x.clone()]),
            (Op::LogSoftmax { axis: 0 }, vec![x.clone()]),
            (
                Op::LayerNorm {
                    eps: f(1e-5),
                    weight: true,
                    bias: true,
                },
                vec![x.clone(), f32t(&[3]), f32t(&[3])],
            ),
            (
                Op::RmsNorm {
                    eps: f(1e-6),
                    weight: true,
                },
                vec![x.clone(), f32t(&[3])],
            ),
            (
                Op::Gather { axis: 1 },
                vec![x.clone(), t(DType::I64, &[2, 2])],
            ),
            (
                Op::ScatterAdd { axis: 1 },
                vec![x.clone(), t(DType::I64, &[2, 2]), f32t(&[2, 2])],
            ),
            (
                Op::IndexSelect { axis: 0 },
                vec![x.clone(), t(DType::I64, &[2])],
            ),
            (
                Op::IndexAdd { axis: 0 },
                vec![x.clone(), t(DType::I64, &[2]), x.clone()],
            ),
            (
                Op::Conv {
                    geom: geom2.clone(),
                    groups: 1,
                    bias: true,
                    act: Activation::GeluErf,
                },
                vec![f32t(&[1, 2, 4, 5]), f32t(&[3, 2, 3, 3]), f32t(&[3])],
            ),
            (
                // Channels-last, so that every file and text test meets the layout.
                Op::ConvGradInput {
                    geom: geom2.clone().with_layout(Layout::ChannelsLast),
                    groups: 1,
                    input_shape: Shape::new([1, 4, 5, 2]),
                },
                vec![f32t(&[1, 4, 2, 3]), f32t(&[3, 3, 3, 2])],
            ),
            (
                Op::ConvGradWeight {
                    geom: geom2,
                    groups: 1,
                    weight_shape: Shape::new([3, 2, 3, 3]),
                },
                vec![f32t(&[1, 2, 4, 5]), f32t(&[1, 3, 4, 2])],
            ),
            (
                Op::Pool {
                    kind: PoolKind::Max,
                    kernel: vec![2, 2],
                    geom: ConvGeom::new(vec![2, 2], vec![0, 0], vec![1, 1]),
                },
                vec![f32t(&[1, 2, 4, 4])],
            ),
            (
                Op::PoolGrad {
                    kind: PoolKind::Avg {
                        count_include_pad: false,
                    },
                    kernel: vec![3],
                    geom: ConvGeom::new(vec![1], vec![1], vec![1]),
                },
                vec![f32t(&[1, 2, 5]), f32t(&[1, 2, 5])],
            ),
            (
                Op::Attention {
                    causal: Causal::TopLeft,
                    mask: AttnMask::Additive,
                    scale: f(0.5),
                    layout: AttnLayout::Bhsd,
                },
                vec![
                    f32t(&[1, 2, 3, 4]),
                    f32t(&[1, 2, 3, 4]),
                    f32t(&[1, 2, 3, 4]),
                    f32t(&[3, 3]),
                ],
            ),
            (
                Op::AttentionGrad {
                    causal: Causal::BottomRight,
                    mask: AttnMask::None,
                    scale: f(0.5),
                    wrt: 1,
                    layout: AttnLayout::Bhsd,
                },
                vec![
                    f32t(&[1, 1, 2, 4]),
                    f32t(&[1, 1, 3, 4]),
                    f32t(&[1, 1, 3, 4]),
                    f32t(&[1, 1, 2, 4]),
                ],
            ),
            (
                Op::CrossEntropy {
                    reduction: Reduction::Mean,
                    ignore_index: -100,
                },
                vec![f32t(&[3, 4]), t(DType::I64, &[3])],
            ),
            (
                Op::CrossEntropyGrad {
                    reduction: Reduction::Sum,
                    ignore_index: 1,
                },
                vec![f32t(&[3, 4]), t(DType::I64, &[3]), f32t(&[])],
            ),
            (
                Op::Fused(Box::new(FusedKernel {
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
                                ty: f32t(&[]),
                            },
                            args: vec![],
                            dtype: DType::F32,
                        },
                        FusedInstr {
                            op: Op::Binary(BinaryOp::Add),
                            args: vec![2, 3],
                            dtype: DType::F32,
                        },
                        FusedInstr {
                            op: Op::Unary(UnaryOp::Exp),
                            args: vec![4],
                            dtype: DType::F32,
                        },
                    ],
                    out: x.clone(),
                })),
                vec![x.clone(), f32t(&[3])],
            ),
            (
                Op::SparseMatmul {
                    rows: 3,
                    cols: 2,
                    trans_a: false,
                },
                vec![
                    t(DType::I64, &[4]),
                    t(DType::I64, &[4]),
                    f32t(&[4]),
                    f32t(&[2, 3]),
                ],
            ),
            (
                Op::SampledMatmul,
                vec![
                    t(DType::I32, &[4]),
                    t(DType::I32, &[4]),
                    f32t(&[3, 2]),
                    f32t(&[2, 2]),
                ],
            ),
            (
                Op::CumSum {
                    axis: 1,
                    exclusive: false,
                    reverse: true,
                },
                vec![f32t(&[2, 3])],
            ),
            (
                Op::TopK {
                    axis: 1,
                    k: 2,
                    largest: true,
                },
                vec![f32t(&[2, 3])],
            ),
            (Op::AllReduce { mean: true }, vec![f32t(&[2, 3])]),
            (
                // layer_norm(x + y) · 0.5 + z
                Op::FusedRow(Box::new(RowFusion {
                    core: Op::LayerNorm {
                        eps: f(1e-5),
                        weight: true,
                        bias: false,
                    },
                    prologue: Some(FusedKernel {
                        n_inputs: 2,
                        instrs: vec![FusedInstr {
                            op: Op::Binary(BinaryOp::Add),
                            args: vec![0, 1],
                            dtype: DType::F32,
                        }],
                        out: x.clone(),
                    }),
                    epilogue: Some(FusedKernel {
                        n_inputs: 2,
                        instrs: vec![
                            FusedInstr {
                                op: Op::Full {
                                    value: f(0.5),
                                    ty: f32t(&[]),
                                },
                                args: vec![],
                                dtype: DType::F32,
                            },
                            FusedInstr {
                                op: Op::Binary(BinaryOp::Mul),
                                args: vec![0, 2],
                                dtype: DType::F32,
                            },
                            FusedInstr {
                                op: Op::Binary(BinaryOp::Add),
                                args: vec![3, 1],
                                dtype: DType::F32,
                            },
                        ],
                        out: x.clone(),
                    }),
                })),
                vec![x.clone(), f32t(&[3]), f32t(&[3]), x.clone()],
            ),
            (
                Op::MatmulActGrad {
                    trans_a: false,
                    trans_b: true,
                    act: Activation::GeluTanh,
                },
                vec![x.clone(), f32t(&[4, 3]), f32t(&[2, 4])],
            ),
        ];
        all.into()
    }

    /// Whether this op is a leaf (no inputs).
    pub fn is_leaf(&self) -> bool {
        matches!(
            self,
            Op::Input { .. }
                | Op::Param { .. }
                | Op::Constant { .. }
                | Op::Full { .. }
                | Op::Iota { .. }
                | Op::RandUniform { .. }
                | Op::RandNormal { .. }
        )
    }

    /// Whether this op is elementwise over broadcast inputs (fusable into one kernel).
    pub fn is_elementwise(&self) -> bool {
        matches!(
            self,
            Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } | Op::Fused(_)
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::HostTensor;
    use serde::de::{self, Visitor};

    /// A deserializer that records the variant names serde's derive passes for an enum.
    struct VariantNames(&'static [&'static str]);

    impl<'de> de::Deserializer<'de> for &mut VariantNames {
        type Error = de::value::Error;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not an enum"))
        }

        fn deserialize_enum<V: Visitor<'de>>(
            self,
            _name: &'static str,
            variants: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            self.0 = variants;
            Err(de::Error::custom("names recorded"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map struct identifier
            ignored_any
        }
    }

    /// An enum's variant names in declaration order, as its serde derive (and so the graph-file
    /// encoding) numbers them.
    pub(crate) fn declared_variants<T: for<'de> Deserialize<'de>>() -> &'static [&'static str] {
        let mut names = VariantNames(&[]);
        assert!(T::deserialize(&mut names).is_err());
        names.0
    }

    /// The variant name of a value, from its derived `Debug` form.
    pub(crate) fn debug_variant(op: &impl std::fmt::Debug) -> String {
        format!("{op:?}")
            .split([' ', '('])
            .next()
            .unwrap()
            .to_string()
    }

    #[test]
    fn variant_numbering_is_declaration_order() {
        let declared = declared_variants::<Op>();
        assert_eq!(
            declared.len(),
            Op::VARIANT_COUNT,
            "Op::VARIANT_COUNT does not match the enum"
        );
        for (op, _) in Op::samples() {
            assert_eq!(
                declared[op.variant_index()],
                debug_variant(&op),
                "variant_index of {op:?}"
            );
        }
    }

    #[test]
    fn samples_cover_every_variant_in_order() {
        let samples = Op::samples();
        assert_eq!(samples.len(), Op::VARIANT_COUNT);
        for (i, (op, _)) in samples.iter().enumerate() {
            assert_eq!(op.variant_index(), i, "sample {i} is {op:?}");
        }
    }

    #[test]
    fn samples_infer_and_run() {
        for (i, (op, tys)) in Op::samples().into_iter().enumerate() {
            let refs: Vec<&TensorType> = tys.iter().collect();
            let out = crate::infer(&op, &refs).unwrap_or_else(|e| panic!("{op}: {e}"));
            assert!(out.shape.numel() > 0, "{op}: empty output");
            if op.is_leaf() {
                assert!(tys.is_empty(), "{op}: a leaf with inputs");
            }
            if matches!(
                op,
                Op::Input { .. } | Op::Param { .. } | Op::Constant { .. }
            ) {
                continue;
            }
            let inputs: Vec<HostTensor> = (0..tys.len())
                .map(|k| crate::testing::sample_input(&op, &tys, k, (i * 8 + k) as u64))
                .collect();
            let refs: Vec<&HostTensor> = inputs.iter().collect();
            let got = crate::eval_cpu(&op, &refs).unwrap_or_else(|e| panic!("{op}: {e}"));
            assert_eq!(got.ty(), out, "{op}");
        }
    }
}
