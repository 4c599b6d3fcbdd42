//! The typed kernel IR: a small tree of expressions and statements that the CUDA C printer
//! ([`super::emit`]) turns into source. Templates build kernels as data; nothing splices source
//! text.
//!
//! Values have a [`CTy`] (their compute type). Buffers are typed by their *storage* element type:
//! a [`Expr::Load`] of an f16/bf16 buffer yields an f32 value and a [`Stmt::Store`] rounds an f32
//! value once to the storage type, so every f16/bf16 kernel computes in f32 as the CPU does.

use rustytorch_ops::DType;

/// A scalar type of the kernel IR (compute types and storage element types).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CTy {
    /// float
    F32,
    /// double
    F64,
    /// Storage only: IEEE half bits in an `unsigned short`; loads give f32.
    F16,
    /// Storage only: bfloat16 bits in an `unsigned short`; loads give f32.
    BF16,
    /// int
    I32,
    /// long long
    I64,
    /// unsigned int
    U32,
    /// unsigned long long
    U64,
    /// unsigned char
    U8,
    /// bool (stored as one byte)
    Bool,
    /// Storage only: signed char (no template computes with it; see [`check_dtypes`]).
    I8,
    /// Storage only: short (no template computes with it; see [`check_dtypes`]).
    I16,
    /// Storage only: unsigned short (no template computes with it; see [`check_dtypes`]).
    U16,
}

impl CTy {
    /// The storage type of a tensor dtype.
    pub fn storage(d: DType) -> CTy {
        match d {
            DType::F32 => CTy::F32,
            DType::F64 => CTy::F64,
            DType::F16 => CTy::F16,
            DType::BF16 => CTy::BF16,
            DType::I32 => CTy::I32,
            DType::I64 => CTy::I64,
            DType::U8 => CTy::U8,
            DType::Bool => CTy::Bool,
            DType::I8 => CTy::I8,
            DType::I16 => CTy::I16,
            DType::U16 => CTy::U16,
            DType::U32 => CTy::U32,
            DType::U64 => CTy::U64,
        }
    }

    /// The type values of a tensor dtype are computed in (f16/bf16 compute in f32).
    pub fn compute(d: DType) -> CTy {
        CTy::storage(d).compute_of()
    }

    /// The compute type of values loaded from storage of this type.
    pub fn compute_of(self) -> CTy {
        match self {
            CTy::F16 | CTy::BF16 => CTy::F32,
            CTy::I8 | CTy::I16 | CTy::U16 => CTy::I32,
            t => t,
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, CTy::F32 | CTy::F64 | CTy::F16 | CTy::BF16)
    }
}

/// Whether CUDA kernels handle tensors of `d`: every dtype but the integers other than i32, i64
/// and u8.
pub fn dtype_supported(d: DType) -> bool {
    !matches!(
        d,
        DType::I8 | DType::I16 | DType::U16 | DType::U32 | DType::U64
    )
}

/// The one check of operand and result dtypes that every CUDA lowering of an op accepting
/// integers runs first (elementwise, movement, indexing, reductions; the other families accept
/// only float tensors and integer indices): i8, i16, u16, u32 and u64 tensors, and fused
/// instructions of those dtypes, are an [`Unsupported`](crate::CodegenError::Unsupported) error
/// naming the op.
pub fn check_dtypes(
    op: &rustytorch_ops::Op,
    inputs: &[&rustytorch_ops::TensorType],
    out: &rustytorch_ops::TensorType,
) -> crate::Result<()> {
    let instrs = match op {
        rustytorch_ops::Op::Fused(k) => &k.instrs[..],
        _ => &[],
    };
    let bad = inputs
        .iter()
        .map(|t| t.dtype)
        .chain([out.dtype])
        .chain(instrs.iter().map(|i| i.dtype))
        .find(|&d| !dtype_supported(d));
    match bad {
        Some(d) => Err(crate::CodegenError::Unsupported {
            op: op.name(),
            device: "cuda",
            reason: format!(
                "{d} tensors have no CUDA kernels yet (i32, i64 and u8 do); cast to one of \
                 those or run this graph with Device::Cpu"
            ),
        }),
        None => Ok(()),
    }
}

/// A literal.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Lit {
    /// A float of the given float type (printed exactly, `inf`/`nan` through intrinsics).
    Float(f64, CTy),
    /// An integer of the given integer type.
    Int(i64, CTy),
    /// true / false
    Bool(bool),
}

/// Built-in thread geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Special {
    /// threadIdx.x
    ThreadIdx,
    /// blockIdx.x
    BlockIdx,
    /// blockDim.x
    BlockDim,
    /// gridDim.x
    GridDim,
}

/// Unary operators and device functions of one argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnFn {
    /// -x
    Neg,
    /// !x
    Not,
    /// fabs / abs
    Abs,
    /// exp
    Exp,
    /// log
    Log,
    /// sqrt
    Sqrt,
    /// 1/sqrt (computed as `1 / sqrt(x)`, correctly rounded sqrt first)
    Rsqrt,
    /// sin
    Sin,
    /// cos
    Cos,
    /// tanh
    Tanh,
    /// erf
    Erf,
    /// erfc (1 - erf, accurate for large arguments)
    Erfc,
    /// `e^x` through the hardware's `ex2.approx` (`__expf`: relative error about 2^-21 near 0,
    /// growing with |x|); f64 values use the exact form.
    ExpApprox,
    /// `tanh x` through `tanh.approx.f32` (relative error below 2^-10.9); f64 values use the exact
    /// form.
    TanhApprox,
    /// `1/x`, correctly rounded (`__frcp_rn`: one reciprocal and a Newton step instead of a
    /// division).
    Recip,
    /// floor
    Floor,
    /// ceil
    Ceil,
    /// round half to even (rint)
    Rint,
    /// isnan
    IsNan,
    /// isinf
    IsInf,
    /// isfinite
    IsFinite,
}

/// Binary operators and device functions of two arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinFn {
    /// +
    Add,
    /// -
    Sub,
    /// *
    Mul,
    /// / (the C operator: integer division truncates; callers guard division by zero)
    Div,
    /// % (C remainder)
    Rem,
    /// <
    Lt,
    /// <=
    Le,
    /// >
    Gt,
    /// >=
    Ge,
    /// ==
    Eq,
    /// !=
    Ne,
    /// &&
    And,
    /// ||
    Or,
    /// pow (floats)
    Pow,
    /// fmax-like with NaN propagation (`rt_max`)
    Max,
    /// fmin-like with NaN propagation (`rt_min`)
    Min,
    /// `__shfl_xor_sync(0xffffffff, a, b)`
    ShflXor,
}

/// An expression; every node's type is known from its parts.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// A local variable or parameter.
    Var(String),
    /// A literal.
    Lit(Lit),
    /// Thread geometry (an unsigned int, used through casts to i64).
    Special(Special),
    /// A unary function.
    Un(UnFn, Box<Expr>),
    /// A binary function.
    Bin(BinFn, Box<Expr>, Box<Expr>),
    /// `c ? a : b`
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
    /// A value conversion to `CTy` (f16/bf16 targets round to that format and return its f32
    /// value, which is how a rounded intermediate is computed).
    Cast(CTy, Box<Expr>),
    /// `buf[index]` of a buffer whose storage type is `elem`, converted to its compute type.
    Load {
        /// The buffer (a kernel parameter or a shared array).
        buf: String,
        /// Its storage element type.
        elem: CTy,
        /// The element index (i64).
        index: Box<Expr>,
    },
}

/// A statement.
#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    /// `ty name = init;`
    Let {
        /// Variable name.
        name: String,
        /// Its type.
        ty: CTy,
        /// Initial value.
        init: Expr,
    },
    /// `name = value;`
    Assign {
        /// Variable name.
        name: String,
        /// New value.
        value: Expr,
    },
    /// `buf[index] = value` with the value converted to the buffer's storage type.
    Store {
        /// The buffer.
        buf: String,
        /// Its storage element type.
        elem: CTy,
        /// Element index (i64).
        index: Expr,
        /// The value (compute type).
        value: Expr,
    },
    /// Loads `names.len()` consecutive elements `buf[index..]` in one vector access and declares
    /// each as a variable of the element's compute type. `index` must be a multiple of the count
    /// (a power of two, at most 16 bytes in all) and the buffer aligned to 16 bytes, which every
    /// arena slot and pool block is.
    LoadVec {
        /// The buffer.
        buf: String,
        /// Its storage element type.
        elem: CTy,
        /// Element index of the first element (i64).
        index: Expr,
        /// The variables declared, one per element.
        names: Vec<String>,
    },
    /// Stores `values` to consecutive elements `buf[index..]` in one vector access (the
    /// alignment rules of [`Stmt::LoadVec`]); each value is rounded to the storage type once.
    StoreVec {
        /// The buffer.
        buf: String,
        /// Its storage element type.
        elem: CTy,
        /// Element index of the first element (i64).
        index: Expr,
        /// The values (compute type), one per element.
        values: Vec<Expr>,
    },
    /// An atomic `buf[index] += value` (any storage type; sub-word types through compare-and-swap).
    AtomicAdd {
        /// The buffer.
        buf: String,
        /// Its storage element type.
        elem: CTy,
        /// Element index (i64).
        index: Expr,
        /// The value (compute type).
        value: Expr,
    },
    /// `for (long long var = start; var < end; var += step) { body }`
    For {
        /// Loop variable (i64).
        var: String,
        /// First value.
        start: Expr,
        /// Exclusive bound.
        end: Expr,
        /// Increment.
        step: Expr,
        /// Body.
        body: Vec<Stmt>,
    },
    /// `if (cond) { then } else { els }`
    If {
        /// Condition.
        cond: Expr,
        /// Then branch.
        then: Vec<Stmt>,
        /// Else branch (may be empty).
        els: Vec<Stmt>,
    },
    /// `__shared__ ty name[len];` (a block-shared array, read with `Load` and written with `Store`
    /// of the same element type).
    Shared {
        /// Array name.
        name: String,
        /// Element type.
        elem: CTy,
        /// Length.
        len: u32,
    },
    /// `__syncthreads();`
    SyncThreads,
    /// `return;`
    Return,
    /// CUDA C copied into the body as written, for what the IR does not spell: tensor-core
    /// fragments, `ldmatrix`/`cp.async`/`mma` inline PTX. The printer copies it; the interpreter
    /// refuses it, so a kernel that uses it is checked on the GPU (and compiled by NVRTC in the
    /// tests where NVRTC is present), not on the CPU.
    Verbatim(String),
}

/// A kernel parameter: a pointer to a buffer of `elem` storage type, or (`map`) a tensor map
/// over the buffer its argument addresses.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Param {
    /// The parameter's name in the source.
    pub name: String,
    /// Storage element type.
    pub elem: CTy,
    /// Whether the kernel writes through it.
    pub writes: bool,
    /// Passed as a tensor map (`const __grid_constant__ RtTensorMap`, the 128 opaque bytes the
    /// tensor memory accelerator's bulk copies read) instead of a pointer: the runtime encodes
    /// it at launch from the argument's address.
    pub map: Option<TensorMap>,
}

/// How the runtime encodes a tensor map (`cuTensorMapEncodeTiled`) over a buffer of 2-byte
/// elements (`elem`, f16 or bf16): a tiled view of up to five dims, innermost first.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorMap {
    /// Element type (f16 or bf16).
    pub elem: CTy,
    /// Bytes from the buffer's start to the view's first element (a multiple of 16).
    pub offset: u64,
    /// Elements per dim, innermost first (the innermost contiguous).
    pub dims: Vec<u64>,
    /// Bytes between consecutive indices of dims 1.. (multiples of 16).
    pub strides: Vec<u64>,
    /// The box one copy moves, elements per dim (each at most 256; the innermost 64 with
    /// the 128-byte swizzle).
    pub boxes: Vec<u32>,
    /// Whether the copy writes shared memory in the 128-byte swizzle (16-byte chunk `c` of
    /// a 128-byte row `r` at chunk `c ^ (r mod 8)`) rather than densely.
    pub swizzle128: bool,
}

/// A kernel: an `extern "C" __global__` function over pointer parameters. Shapes and strides
/// are compile-time constants of the body (kernels are specialized per shape).
#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    /// The kernel's name (deterministic; see [`super::kernel_name`]).
    pub name: String,
    /// Pointer parameters, in launch order.
    pub params: Vec<Param>,
    /// Threads per block (baked into `__launch_bounds__`).
    pub block: u32,
    /// Bytes of dynamic shared memory a block needs (0 for most kernels; the runtime raises the
    /// function's limit when it passes the 48 KiB a block gets by default).
    pub smem: u32,
    /// The body.
    pub body: Vec<Stmt>,
}

// ---- builders: short constructors so templates read like the code they make ----

/// A variable.
pub fn var(n: &str) -> Expr {
    Expr::Var(n.to_string())
}
/// An i64 literal.
pub fn i64c(v: i64) -> Expr {
    Expr::Lit(Lit::Int(v, CTy::I64))
}
/// An i32 literal.
pub fn i32c(v: i64) -> Expr {
    Expr::Lit(Lit::Int(v, CTy::I32))
}
/// A float literal of type `ty` (f32 or f64).
pub fn fc(v: f64, ty: CTy) -> Expr {
    Expr::Lit(Lit::Float(v, ty))
}
/// A bool literal.
pub fn bc(v: bool) -> Expr {
    Expr::Lit(Lit::Bool(v))
}
/// A literal of compute type `ty` with value `v` (floats, ints and bool).
pub fn lit(v: f64, ty: CTy) -> Expr {
    match ty {
        CTy::F32 | CTy::F64 => fc(v, ty),
        CTy::F16 | CTy::BF16 => fc(v, CTy::F32),
        CTy::Bool => bc(v != 0.0),
        t => Expr::Lit(Lit::Int(v as i64, t)),
    }
}
/// `a op b`
pub fn bin(op: BinFn, a: Expr, b: Expr) -> Expr {
    Expr::Bin(op, Box::new(a), Box::new(b))
}
/// `f(a)`
pub fn un(op: UnFn, a: Expr) -> Expr {
    Expr::Un(op, Box::new(a))
}
/// `a + b`
pub fn add(a: Expr, b: Expr) -> Expr {
    bin(BinFn::Add, a, b)
}
/// `a - b`
pub fn sub(a: Expr, b: Expr) -> Expr {
    bin(BinFn::Sub, a, b)
}
/// `a * b`
pub fn mul(a: Expr, b: Expr) -> Expr {
    bin(BinFn::Mul, a, b)
}
/// `a / b`
pub fn div(a: Expr, b: Expr) -> Expr {
    bin(BinFn::Div, a, b)
}
/// `a % b`
pub fn rem(a: Expr, b: Expr) -> Expr {
    bin(BinFn::Rem, a, b)
}
/// `a < b`
pub fn lt(a: Expr, b: Expr) -> Expr {
    bin(BinFn::Lt, a, b)
}
/// `c ? a : b`
pub fn select(c: Expr, a: Expr, b: Expr) -> Expr {
    Expr::Select(Box::new(c), Box::new(a), Box::new(b))
}
/// A conversion.
pub fn cast(ty: CTy, e: Expr) -> Expr {
    Expr::Cast(ty, Box::new(e))
}
/// `buf[index]`
pub fn load(buf: &str, elem: CTy, index: Expr) -> Expr {
    Expr::Load {
        buf: buf.to_string(),
        elem,
        index: Box::new(index),
    }
}
/// Thread geometry as i64.
pub fn special(s: Special) -> Expr {
    cast(CTy::I64, Expr::Special(s))
}
/// `ty name = init;`
pub fn let_(name: &str, ty: CTy, init: Expr) -> Stmt {
    Stmt::Let {
        name: name.to_string(),
        ty,
        init,
    }
}
/// `name = value;`
pub fn assign(name: &str, value: Expr) -> Stmt {
    Stmt::Assign {
        name: name.to_string(),
        value,
    }
}
/// A vector load of `names.len()` elements into the variables `names`.
pub fn load_vec(buf: &str, elem: CTy, index: Expr, names: Vec<String>) -> Stmt {
    Stmt::LoadVec {
        buf: buf.to_string(),
        elem,
        index,
        names,
    }
}
/// A vector store of `values` to consecutive elements.
pub fn store_vec(buf: &str, elem: CTy, index: Expr, values: Vec<Expr>) -> Stmt {
    Stmt::StoreVec {
        buf: buf.to_string(),
        elem,
        index,
        values,
    }
}
/// Bytes of one element of storage type `t`.
pub fn elem_bytes(t: CTy) -> usize {
    match t {
        CTy::F64 | CTy::I64 | CTy::U64 => 8,
        CTy::F32 | CTy::I32 | CTy::U32 => 4,
        CTy::F16 | CTy::BF16 | CTy::I16 | CTy::U16 => 2,
        CTy::U8 | CTy::I8 | CTy::Bool => 1,
    }
}
/// `buf[index] = value;`
pub fn store(buf: &str, elem: CTy, index: Expr, value: Expr) -> Stmt {
    Stmt::Store {
        buf: buf.to_string(),
        elem,
        index,
        value,
    }
}
/// A counted loop.
pub fn for_(var: &str, start: Expr, end: Expr, step: Expr, body: Vec<Stmt>) -> Stmt {
    Stmt::For {
        var: var.to_string(),
        start,
        end,
        step,
        body,
    }
}
/// `if (cond) { then }`
pub fn if_(cond: Expr, then: Vec<Stmt>) -> Stmt {
    Stmt::If {
        cond,
        then,
        els: vec![],
    }
}
/// The global thread index `blockIdx.x * blockDim.x + threadIdx.x` as i64.
pub fn global_thread() -> Expr {
    add(
        mul(special(Special::BlockIdx), special(Special::BlockDim)),
        special(Special::ThreadIdx),
    )
}
/// `lane = threadIdx.x % 32; wid = threadIdx.x / 32` (both i64).
pub fn lane_and_warp() -> Vec<Stmt> {
    let tid = || special(Special::ThreadIdx);
    vec![
        let_("lane", CTy::I64, rem(tid(), i64c(32))),
        let_("wid", CTy::I64, div(tid(), i64c(32))),
    ]
}
/// A loop giving each warp of the grid its rows: `row` from `blockIdx.x·warps + wid` below
/// `rows`, in steps of the grid's warps (`warps` per block; needs [`lane_and_warp`]).
pub fn warp_row_loop(rows: i64, warps: i64, body: Vec<Stmt>) -> Stmt {
    for_(
        "row",
        add(mul(special(Special::BlockIdx), i64c(warps)), var("wid")),
        i64c(rows),
        mul(special(Special::GridDim), i64c(warps)),
        body,
    )
}
/// A grid-stride loop over `0..n`: `for (var = global thread; var < n; var += blockDim*gridDim)`.
pub fn grid_stride(var: &str, n: i64, body: Vec<Stmt>) -> Stmt {
    for_(
        var,
        global_thread(),
        i64c(n),
        mul(special(Special::BlockDim), special(Special::GridDim)),
        body,
    )
}
