//! Elementwise and movement kernels: unary/binary/where/cast and fused chains over broadcast,
//! strided operands; permute, expand, slice, concat, pad, reshape; gather, index_select,
//! scatter_add, index_add.
//!
//! Every kernel is one grid-stride loop over the flat index `i` of its output (or, for the
//! accumulating ops, of `src`), with shapes and strides as literals. Operands are read through
//! their broadcast strides after merging the dims that every operand reads contiguously, so a
//! same-shape operand is read at `i` and only the coordinates some operand needs are computed
//! (with 32-bit divisions where the sizes allow). A copy whose source is unit-stride along a dim
//! other than the last (a transposing permute) goes through shared-memory tiles instead.
//!
//! The kernels compute what the CPU kernels of `rustytorch_ops` compute, with the same formulas:
//! - single ops compute in the dtype's compute type (f32 for f16/bf16, rounded once by the store);
//!   signed integer `add`/`sub`/`mul`/`neg` wrap (through unsigned arithmetic), integer division
//!   by zero is 0;
//! - fused kernels follow `fused_cpu`: every value is held in f64 when an input, an instruction or
//!   the output is f64, otherwise in f32 (integers and bools included); integer results are
//!   truncated, wrapped (u8, i32) and 0 when not finite after each unary/binary instruction;
//!   f16/bf16 intermediates are rounded only by explicit casts;
//! - casts follow Rust `as` semantics, and f64 (or i32/i64) to bf16 rounds once, as the CPU does.
//!
//! Known differences from the CPU:
//! - the erf GELU evaluates erfc in f32 for f32/f16/bf16 (CUDA's `erfcf`, within 4 ulp; twice as
//!   fast as f64 on an H200) where the CPU evaluates it in f64 and rounds: f32 results can differ
//!   in the last few bits;
//! - an index outside `0..dim` (negative ones included) is an error on the CPU; a kernel cannot
//!   fail, so gather and index_select write 0 for it and scatter_add and index_add skip it;
//! - scatter_add and index_add add in whatever order the atomics land (floats may differ from
//!   the CPU's sequential sums by rounding); f16/bf16 accumulate in an f32 scratch buffer rounded
//!   once at the end, as on the CPU.

use super::ir::*;
use super::{finish, grid_for, ArgRef, Launch, StepKernels};
use crate::{CodegenError, Result};
use rustytorch_ops::{
    BinaryOp, DType, FusedInstr, FusedKernel, HostTensor, Op, Shape, TensorType, UnaryOp,
};

/// Threads per block of every kernel here.
pub(super) const BLOCK: u32 = 256;
/// The loop variable of the grid-stride loop.
const I: &str = "i";

/// √(2/π), the GELU tanh-form constant (the CPU's value).
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the GELU tanh form.
const GELU_TANH_C: f64 = 0.044715;

// ================================================================================================
// Entry points
// ================================================================================================

/// Lowers an elementwise op (`Unary`, `Binary`, `Where`, `Cast`, `Fused`): one grid-stride kernel
/// over the output, named `ew_*`.
pub fn lower(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<StepKernels> {
    check_types(op, inputs, out)?;
    let n = out.shape.numel();
    if n == 0 {
        return Ok(StepKernels::default());
    }
    let (kernel, grid) = match op {
        Op::Fused(k) => fused_kernel(k, inputs, out)?,
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } => {
            single_kernel(op, inputs, out)?
        }
        _ => return Err(not_mine(op, "an elementwise")),
    };
    Ok(StepKernels {
        launches: vec![Launch::simple(kernel, inputs.len(), grid)],
        scratch_bytes: 0,
    })
}

/// Lowers a movement or indexing op: one strided-read kernel per output element (permute,
/// expand, slice, reshape as a contiguous copy, concat, pad, gather, index_select), or a copy of
/// `base` then atomic adds of `src` (scatter_add, index_add).
pub fn lower_movement(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<StepKernels> {
    check_types(op, inputs, out)?;
    let n = out.shape.numel();
    if n == 0 {
        return Ok(StepKernels::default());
    }
    let x = inputs[0];
    let kernel = match op {
        Op::Reshape { .. } => {
            return strided_copy("reshape", x.dtype, &out.shape, 0, &out.shape.strides());
        }
        Op::Permute { perm } => {
            let st = x.shape.strides();
            let strides: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
            return strided_copy("permute", x.dtype, &out.shape, 0, &strides);
        }
        Op::Expand { shape } => {
            let strides = x.shape.broadcast_strides(shape);
            return strided_copy("expand", x.dtype, &out.shape, 0, &strides);
        }
        Op::Slice { starts, steps, .. } => {
            let st = x.shape.strides();
            let offset: usize = starts.iter().zip(&st).map(|(s, t)| s * t).sum();
            let strides: Vec<usize> = steps.iter().zip(&st).map(|(s, t)| s * t).collect();
            return strided_copy("slice", x.dtype, &out.shape, offset, &strides);
        }
        Op::Concat { axis } => concat_kernel(inputs, *axis, out)?,
        Op::Pad { pads, value } => pad_kernel(x, pads, value.get(), out)?,
        Op::Gather { axis } => gather_kernel(x, inputs[1], *axis, out)?,
        Op::IndexSelect { axis } => index_select_kernel(x, inputs[1], *axis, out)?,
        Op::ScatterAdd { .. } | Op::IndexAdd { .. } => return accumulate(op, inputs, out),
        _ => return Err(not_mine(op, "a movement or indexing")),
    };
    Ok(one_launch(kernel, inputs.len(), n))
}

/// Checks that `out` is what the op infers from `inputs`.
fn check_types(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<()> {
    super::ir::check_dtypes(op, inputs, out)?;
    let t = rustytorch_ops::infer(op, inputs)?;
    if &t != out {
        return Err(CodegenError::Invalid(format!(
            "{}: the step's output type {out} differs from the inferred {t}",
            op.name()
        )));
    }
    Ok(())
}

fn not_mine(op: &Op, what: &str) -> CodegenError {
    CodegenError::Invalid(format!("{} is not {what} op", op.name()))
}

fn ill_typed(what: String) -> CodegenError {
    CodegenError::Invalid(format!("elementwise lowering: {what}"))
}

/// A launch of `kernel` over `n` elements with the operands `0..n_inputs` then the output.
fn one_launch(kernel: Kernel, n_inputs: usize, n: usize) -> StepKernels {
    StepKernels {
        launches: vec![Launch::simple(kernel, n_inputs, grid(n))],
        scratch_bytes: 0,
    }
}

pub(super) fn grid(n: usize) -> u32 {
    grid_for(n as u64, BLOCK as u64)
}

// ================================================================================================
// Building blocks
// ================================================================================================

/// The statements of a loop body under construction, with fresh names for bound values.
pub(super) struct Body {
    stmts: Vec<Stmt>,
    next: usize,
    /// Whether f32 `exp`, `tanh` and sigmoid's reciprocal take the hardware approximations
    /// (kernels whose result is f16/bf16; see [`approximate`]).
    fast: bool,
    /// The prefix of fresh names.
    tag: String,
}

impl Body {
    pub(super) fn new() -> Body {
        Body {
            stmts: vec![],
            next: 0,
            fast: false,
            tag: "v".into(),
        }
    }

    fn with_fast(fast: bool) -> Body {
        Body {
            fast,
            ..Body::new()
        }
    }

    /// Binds `e` to a fresh local of type `ty` (variables and literals are returned as they are),
    /// so that a value used several times is computed once.
    fn bind(&mut self, ty: CTy, e: Expr) -> Expr {
        if matches!(e, Expr::Var(_) | Expr::Lit(_)) {
            return e;
        }
        let name = format!("{}{}", self.tag, self.next);
        self.next += 1;
        self.named(&name, ty, e)
    }

    /// Binds `e` to the local `name`.
    pub(super) fn named(&mut self, name: &str, ty: CTy, e: Expr) -> Expr {
        self.stmts.push(let_(name, ty, e));
        var(name)
    }

    pub(super) fn push(&mut self, s: Stmt) {
        self.stmts.push(s);
    }
}

/// A buffer parameter of storage dtype `d`.
pub(super) fn param(name: &str, d: DType, writes: bool) -> Param {
    Param {
        name: name.into(),
        elem: CTy::storage(d),
        writes,
        map: None,
    }
}

/// A finished kernel: a grid-stride loop over `0..n` whose body `build` writes, given the loop
/// variable.
pub(super) fn grid_kernel(
    prefix: &str,
    params: Vec<Param>,
    n: usize,
    build: impl FnOnce(&mut Body, Expr) -> Result<()>,
) -> Result<Kernel> {
    let mut b = Body::new();
    build(&mut b, var(I))?;
    let k = Kernel {
        name: String::new(),
        params,
        block: BLOCK,
        smem: 0,
        body: vec![grid_stride(I, n as i64, b.stmts)],
    };
    finish(prefix, k)
}

/// `e` converted from type `from` to `to` (no conversion when they agree).
fn conv(e: Expr, from: CTy, to: CTy) -> Expr {
    if from == to {
        e
    } else {
        cast(to, e)
    }
}

fn gt(a: Expr, b: Expr) -> Expr {
    bin(BinFn::Gt, a, b)
}
fn ge(a: Expr, b: Expr) -> Expr {
    bin(BinFn::Ge, a, b)
}
fn eq(a: Expr, b: Expr) -> Expr {
    bin(BinFn::Eq, a, b)
}
fn ne(a: Expr, b: Expr) -> Expr {
    bin(BinFn::Ne, a, b)
}
fn and(a: Expr, b: Expr) -> Expr {
    bin(BinFn::And, a, b)
}

/// `Σ e·s + base` over i64 terms (multiplications by 1 left out).
pub(super) fn linear(terms: Vec<(Expr, i64)>, base: i64) -> Expr {
    let mut acc: Option<Expr> = None;
    for (e, s) in terms {
        let t = if s == 1 { e } else { mul(e, i64c(s)) };
        acc = Some(match acc {
            Some(a) => add(a, t),
            None => t,
        });
    }
    match acc {
        Some(a) if base > 0 => add(a, i64c(base)),
        Some(a) if base < 0 => sub(a, i64c(-base)),
        Some(a) => a,
        None => i64c(base),
    }
}

/// Coordinates of a flat row-major index over `dims`, each bound to a local `c{k}` on first use.
pub(super) struct Coords {
    dims: Vec<usize>,
    flat: Expr,
    bound: Vec<Option<Expr>>,
}

impl Coords {
    pub(super) fn new(dims: &[usize], flat: Expr) -> Coords {
        Coords {
            dims: dims.to_vec(),
            flat,
            bound: vec![None; dims.len()],
        }
    }

    /// Coordinate `k` (an i64): `(flat / Π dims[k+1..]) % dims[k]` (the flat index is below
    /// Π dims, so dim 0 needs no remainder). The division is 32-bit when Π dims fits: a 64-bit
    /// division by a constant costs several times more on a GPU.
    pub(super) fn get(&mut self, b: &mut Body, k: usize) -> Expr {
        if let Some(e) = &self.bound[k] {
            return e.clone();
        }
        let inner: usize = self.dims[k + 1..].iter().product();
        let e = if inner == 1 && k == 0 {
            self.flat.clone()
        } else {
            let narrow = self.dims.iter().product::<usize>() <= u32::MAX as usize;
            let (ty, mut e) = if narrow {
                (CTy::U32, cast(CTy::U32, self.flat.clone()))
            } else {
                (CTy::I64, self.flat.clone())
            };
            let c = |v: usize| Expr::Lit(Lit::Int(v as i64, ty));
            if inner != 1 {
                e = div(e, c(inner));
            }
            if k != 0 {
                e = rem(e, c(self.dims[k]));
            }
            b.named(&format!("c{k}"), CTy::I64, conv(e, ty, CTy::I64))
        };
        self.bound[k] = Some(e.clone());
        e
    }
}

/// Drops size-1 dims and merges neighbours that every operand reads contiguously
/// (`s[k] == s[k+1]·dims[k+1]` for each operand's strides `s`; the output is contiguous).
fn coalesce(dims: &[usize], strides: &[Vec<usize>]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let mut d: Vec<usize> = vec![];
    let mut s: Vec<Vec<usize>> = vec![vec![]; strides.len()];
    for k in 0..dims.len() {
        let n = dims[k];
        if n == 1 {
            continue;
        }
        let merge = !d.is_empty()
            && strides
                .iter()
                .zip(&s)
                .all(|(st, acc)| acc.last() == Some(&(st[k] * n)));
        if merge {
            *d.last_mut().expect("nonempty") *= n;
            for (st, acc) in strides.iter().zip(s.iter_mut()) {
                *acc.last_mut().expect("nonempty") = st[k];
            }
        } else {
            d.push(n);
            for (st, acc) in strides.iter().zip(s.iter_mut()) {
                acc.push(st[k]);
            }
        }
    }
    (d, s)
}

/// The element index of each operand (given by its strides over `dims`, plus a base offset) at
/// the flat output index `flat`: the flat index itself for a contiguous operand, the base for
/// one broadcast everywhere, otherwise a sum over the coordinates it depends on.
fn strided_indices(
    b: &mut Body,
    dims: &[usize],
    strides: &[Vec<usize>],
    bases: &[usize],
    flat: &Expr,
) -> Vec<Expr> {
    let (dims, strides) = coalesce(dims, strides);
    let contig = Shape::new(dims.clone()).strides();
    let mut coords = Coords::new(&dims, flat.clone());
    strides
        .iter()
        .zip(bases)
        .map(|(s, &base)| {
            if *s == contig && base == 0 {
                return flat.clone();
            }
            let terms = s
                .iter()
                .enumerate()
                .filter(|(_, &st)| st != 0)
                .map(|(k, &st)| (coords.get(b, k), st as i64))
                .collect();
            linear(terms, base as i64)
        })
        .collect()
}

/// The value a `Full` of `dtype` holds for `v`, as f64 (converted with `as` semantics, rounded
/// once for f16/bf16), computed on the host as the CPU does.
fn dtype_value(dtype: DType, v: f64) -> f64 {
    HostTensor::full(&TensorType::new(dtype, Shape::scalar()), v).to_f64_vec()[0]
}

/// An f64 value rounded once to bf16, as an f32: `cvt` rounds f64→f32→bf16, which rounds twice
/// when the f32 lands exactly on a bf16 midpoint; then the neighbour on the side of the exact
/// value is taken (the CPU rounds to odd first, with the same result).
fn bf16_of_f64(b: &mut Body, x: Expr) -> Expr {
    let x = b.bind(CTy::F64, x);
    let f = b.bind(CTy::F32, cast(CTy::F32, x.clone()));
    let r = b.bind(CTy::F32, cast(CTy::BF16, f.clone()));
    // The other bf16 neighbour when `f` is a midpoint (exact in f32 then).
    let r2 = b.bind(CTy::F32, add(f.clone(), sub(f.clone(), r.clone())));
    let f64_of_f = cast(CTy::F64, f);
    let midpoint = and(
        and(
            ne(f64_of_f.clone(), x.clone()),
            un(UnFn::IsFinite, r.clone()),
        ),
        and(
            ne(r2.clone(), r.clone()),
            eq(cast(CTy::BF16, r2.clone()), r2.clone()),
        ),
    );
    let toward_x = select(
        gt(x, f64_of_f),
        bin(BinFn::Max, r.clone(), r2.clone()),
        bin(BinFn::Min, r.clone(), r2),
    );
    select(midpoint, toward_x, r)
}

// ================================================================================================
// Elementwise formulas (the CPU's, in a float compute type `t`)
// ================================================================================================

/// Whether an elementwise kernel storing `out` computes f32 `exp`, `tanh` and reciprocals with
/// the hardware approximations: when the result is f16 or bf16, whose rounding (a relative 2^-11
/// or 2^-8) is at least the approximations' error (`ex2.approx` about 2^-21 near 0, `tanh.approx`
/// 2^-10.9, a correctly rounded reciprocal), so the stored values are those of the exact functions
/// but for an occasional last-bit difference. This is what keeps chains of transcendental
/// functions on 16-bit data at memory speed instead of arithmetic speed; f32 and f64 results use
/// the exact functions.
fn approximate(out: DType) -> bool {
    matches!(out, DType::F16 | DType::BF16)
}

/// `e^x` (approximate when `b.fast` and `t` is f32).
fn exp(b: &Body, x: Expr, t: CTy) -> Expr {
    let f = if b.fast && t == CTy::F32 {
        UnFn::ExpApprox
    } else {
        UnFn::Exp
    };
    un(f, x)
}

/// `tanh x` (approximate when `b.fast` and `t` is f32).
fn tanh(b: &Body, x: Expr, t: CTy) -> Expr {
    let f = if b.fast && t == CTy::F32 {
        UnFn::TanhApprox
    } else {
        UnFn::Tanh
    };
    un(f, x)
}

/// `1 / (1 + e^-x)`.
fn sigmoid(b: &Body, x: Expr, t: CTy) -> Expr {
    let d = add(lit(1.0, t), exp(b, un(UnFn::Neg, x), t));
    if b.fast && t == CTy::F32 {
        un(UnFn::Recip, d)
    } else {
        div(lit(1.0, t), d)
    }
}

/// A float unary op on `x` of float type `t`: a value of type `t`, or bool for the predicates.
fn real_unary(b: &mut Body, u: UnaryOp, x: Expr, t: CTy) -> Result<Expr> {
    let (zero, one) = (lit(0.0, t), lit(1.0, t));
    Ok(match u {
        UnaryOp::Neg => un(UnFn::Neg, x),
        UnaryOp::Abs => un(UnFn::Abs, x),
        UnaryOp::Exp => exp(b, x, t),
        UnaryOp::Log => un(UnFn::Log, x),
        UnaryOp::Sqrt => un(UnFn::Sqrt, x),
        UnaryOp::Rsqrt => un(UnFn::Rsqrt, x),
        UnaryOp::Reciprocal => div(one, x),
        UnaryOp::Sin => un(UnFn::Sin, x),
        UnaryOp::Cos => un(UnFn::Cos, x),
        UnaryOp::Tanh => tanh(b, x, t),
        UnaryOp::Floor => un(UnFn::Floor, x),
        UnaryOp::Ceil => un(UnFn::Ceil, x),
        UnaryOp::Round => un(UnFn::Rint, x),
        UnaryOp::Sigmoid => sigmoid(b, x, t),
        UnaryOp::Relu => {
            // NaN and -0.0 pass through.
            let x = b.bind(t, x);
            select(lt(x.clone(), zero.clone()), zero, x)
        }
        UnaryOp::GeluErf => {
            // 0.5·x·erfc(-x/√2), erfc in the compute type.
            let x = b.bind(t, x);
            let z = mul(
                un(UnFn::Neg, x.clone()),
                lit(std::f64::consts::FRAC_1_SQRT_2, t),
            );
            mul(mul(lit(0.5, t), x), un(UnFn::Erfc, z))
        }
        UnaryOp::GeluTanh => {
            let x = b.bind(t, x);
            let cube = mul(
                mul(mul(lit(GELU_TANH_C, t), x.clone()), x.clone()),
                x.clone(),
            );
            let u = mul(lit(SQRT_2_OVER_PI, t), add(x.clone(), cube));
            mul(mul(lit(0.5, t), x), add(one, tanh(b, u, t)))
        }
        UnaryOp::Silu => {
            let x = b.bind(t, x);
            mul(x.clone(), sigmoid(b, x, t))
        }
        UnaryOp::Sign => {
            // ±0 and NaN pass through.
            let x = b.bind(t, x);
            select(
                gt(x.clone(), zero.clone()),
                one,
                select(lt(x.clone(), zero), lit(-1.0, t), x),
            )
        }
        UnaryOp::IsNan => un(UnFn::IsNan, x),
        UnaryOp::IsInf => un(UnFn::IsInf, x),
        UnaryOp::IsFinite => un(UnFn::IsFinite, x),
        UnaryOp::Erf => un(UnFn::Erf, x),
        UnaryOp::Not => return Err(ill_typed("`not` of a float".into())),
    })
}

/// A float binary op: a value of the operands' type, or bool for comparisons.
fn real_binary(op: BinaryOp, x: Expr, y: Expr) -> Result<Expr> {
    let f = match op {
        BinaryOp::Add => BinFn::Add,
        BinaryOp::Sub => BinFn::Sub,
        BinaryOp::Mul => BinFn::Mul,
        BinaryOp::Div => BinFn::Div,
        BinaryOp::Pow => BinFn::Pow,
        BinaryOp::Maximum => BinFn::Max,
        BinaryOp::Minimum => BinFn::Min,
        BinaryOp::Eq => BinFn::Eq,
        BinaryOp::Ne => BinFn::Ne,
        BinaryOp::Lt => BinFn::Lt,
        BinaryOp::Le => BinFn::Le,
        BinaryOp::Gt => BinFn::Gt,
        BinaryOp::Ge => BinFn::Ge,
        BinaryOp::And | BinaryOp::Or => {
            return Err(ill_typed(format!("{op:?} of floats")));
        }
    };
    Ok(bin(f, x, y))
}

// ================================================================================================
// Single ops: values in their dtype's compute type
// ================================================================================================

/// The unsigned type signed/u8 wrapping arithmetic goes through.
fn wrap_ty(t: CTy) -> CTy {
    if t == CTy::I64 {
        CTy::U64
    } else {
        CTy::U32
    }
}

/// A unary op on `x` of dtype `dt`, in its compute type.
fn native_unary(b: &mut Body, u: UnaryOp, dt: DType, x: Expr) -> Result<Expr> {
    let t = CTy::compute(dt);
    if dt.is_float() {
        return real_unary(b, u, x, t);
    }
    if dt == DType::Bool {
        return match u {
            UnaryOp::Not => Ok(un(UnFn::Not, x)),
            _ => Err(ill_typed(format!("{u:?} of bool"))),
        };
    }
    let (zero, one) = (lit(0.0, t), lit(1.0, t));
    let signed = dt != DType::U8;
    Ok(match u {
        UnaryOp::Neg => cast(t, un(UnFn::Neg, cast(wrap_ty(t), x))),
        UnaryOp::Abs => un(UnFn::Abs, x),
        UnaryOp::Sign if signed => {
            let x = b.bind(t, x);
            select(
                gt(x.clone(), zero.clone()),
                one,
                select(lt(x, zero.clone()), lit(-1.0, t), zero),
            )
        }
        UnaryOp::Sign => select(gt(x, zero.clone()), one, zero),
        UnaryOp::Relu if signed => {
            let x = b.bind(t, x);
            select(lt(x.clone(), zero.clone()), zero, x)
        }
        UnaryOp::Relu | UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round => x,
        UnaryOp::IsNan | UnaryOp::IsInf => bc(false),
        UnaryOp::IsFinite => bc(true),
        _ => return Err(ill_typed(format!("{u:?} of {dt}"))),
    })
}

/// A binary op on `x`, `y` of dtype `dt`, in its compute type.
fn native_binary(op: BinaryOp, dt: DType, x: Expr, y: Expr) -> Result<Expr> {
    if dt.is_float() {
        return real_binary(op, x, y);
    }
    let t = CTy::compute(dt);
    let w = wrap_ty(t);
    let wrapping = |f: BinFn, x: Expr, y: Expr| cast(t, bin(f, cast(w, x), cast(w, y)));
    Ok(match op {
        BinaryOp::And => bin(BinFn::And, x, y),
        BinaryOp::Or => bin(BinFn::Or, x, y),
        _ if op.is_predicate() => real_binary(op, x, y)?,
        _ if dt == DType::Bool => return Err(ill_typed(format!("{op:?} of bools"))),
        BinaryOp::Add => wrapping(BinFn::Add, x, y),
        BinaryOp::Sub => wrapping(BinFn::Sub, x, y),
        BinaryOp::Mul => wrapping(BinFn::Mul, x, y),
        // Division by zero is 0 (the prelude's `rt_idiv`); u8 divides as unsigned int.
        BinaryOp::Div if dt == DType::U8 => wrapping(BinFn::Div, x, y),
        BinaryOp::Div => bin(BinFn::Div, x, y),
        BinaryOp::Pow => bin(BinFn::Pow, x, y),
        BinaryOp::Maximum => bin(BinFn::Max, x, y),
        BinaryOp::Minimum => bin(BinFn::Min, x, y),
        _ => unreachable!("predicates are handled above"),
    })
}

/// A cast of `x` (compute type of `from`) to `to`: the value the store converts, with Rust `as`
/// semantics (the emitter's conversions); f64 and 32/64-bit integers round once to bf16.
fn native_cast(b: &mut Body, from: DType, to: DType, x: Expr) -> Expr {
    match (from, to) {
        (DType::F64 | DType::I32 | DType::I64, DType::BF16) => {
            let x = conv(x, CTy::compute(from), CTy::F64);
            bf16_of_f64(b, x)
        }
        _ => x,
    }
}

/// The kernel of one `Unary`, `Binary`, `Where` or `Cast`, and its grid.
fn single_kernel(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<(Kernel, u32)> {
    let mut params: Vec<Param> = inputs
        .iter()
        .enumerate()
        .map(|(k, t)| param(&format!("in{k}"), t.dtype, false))
        .collect();
    params.push(param("out", out.dtype, true));
    ew_kernel(params, inputs, out, |b, args| {
        let a = |k: usize| args[k].clone();
        Ok(match op {
            Op::Unary(u) => native_unary(b, *u, inputs[0].dtype, a(0))?,
            Op::Binary(o) => native_binary(*o, inputs[0].dtype, a(0), a(1))?,
            Op::Where => select(a(0), a(1), a(2)),
            Op::Cast { to } => native_cast(b, inputs[0].dtype, *to, a(0)),
            _ => return Err(not_mine(op, "a single elementwise")),
        })
    })
}

/// Bytes every thread of a vectorized elementwise kernel moves per operand access.
const VECTOR_BYTES: usize = 16;

/// How the vectorized form of an elementwise kernel reads one operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Read {
    /// The output's shape: `w` neighbours at the output's index, in one access.
    Vector,
    /// One element, loaded once before the loop.
    Once,
    /// Broadcast, unit stride along the last dim (a bias row): `w` neighbours in one access at
    /// its own index of the vector's first element.
    Row,
    /// Broadcast, stride 0 along the last dim (a per-row statistic): one element per vector, at
    /// its own index of the vector's first element, shared by the `w` lanes.
    Splat,
}

/// The elements per thread of the vectorized form of an elementwise kernel over `out`, and how
/// each operand is read, when it has one: there are at least [`BLOCK`] vectors, and every
/// operand has the output's shape, one element, or broadcasts with a last dim that is the
/// output's or 1. Broadcast operands need the output's last dim to be a multiple of the width,
/// so that the `w` lanes of a vector share every other coordinate (then a row operand's index of
/// the first lane is a multiple of `w`, which keeps its access aligned). The widest element type
/// read or written in vectors sets the width so that its accesses are 16 bytes (narrower types
/// move 8, 4 or 2 bytes per access).
fn vector_width(inputs: &[&TensorType], out: &TensorType) -> Option<(usize, Vec<Read>)> {
    let n = out.shape.numel();
    let last = out.shape.dims().last().copied().unwrap_or(1);
    let mut widest = CTy::storage(out.dtype);
    let mut reads = Vec::with_capacity(inputs.len());
    for t in inputs {
        let read = if t.shape == out.shape {
            Read::Vector
        } else if t.shape.numel() == 1 {
            Read::Once
        } else {
            match t.shape.broadcast_strides(&out.shape).last() {
                Some(1) => Read::Row,
                Some(0) => Read::Splat,
                _ => return None,
            }
        };
        if matches!(read, Read::Vector | Read::Row)
            && elem_bytes(CTy::storage(t.dtype)) > elem_bytes(widest)
        {
            widest = CTy::storage(t.dtype);
        }
        reads.push(read);
    }
    let w = VECTOR_BYTES / elem_bytes(widest);
    let broadcast = reads.iter().any(|r| matches!(r, Read::Row | Read::Splat));
    if broadcast && !last.is_multiple_of(w) {
        return None;
    }
    (w > 1 && n / w >= BLOCK as usize).then_some((w, reads))
}

/// An elementwise kernel over the contiguous `out`: the operands are loaded (as their storage's
/// compute type) and `compute` makes the value stored at each element. The vectorized form
/// ([`vector_width`]) loads `w` neighbouring elements of each same-shape or row operand in one
/// access (a per-row operand once per vector), computes the `w` values and stores them in one
/// access, with a scalar loop over the last `n mod w` elements; otherwise one grid-stride loop
/// reads each operand through its broadcast strides. Returns the kernel and its grid.
fn ew_kernel(
    params: Vec<Param>,
    inputs: &[&TensorType],
    out: &TensorType,
    compute: impl Fn(&mut Body, &[Expr]) -> Result<Expr>,
) -> Result<(Kernel, u32)> {
    let n = out.shape.numel();
    let elem_out = CTy::storage(out.dtype);
    let fast = approximate(out.dtype);
    let scalar_body = |b: &mut Body, i: &Expr| -> Result<()> {
        let idx = broadcast_indices(b, inputs, &out.shape, i);
        let args: Vec<Expr> = inputs
            .iter()
            .zip(idx)
            .enumerate()
            .map(|(k, (t, ix))| {
                let l = load(&format!("in{k}"), CTy::storage(t.dtype), ix);
                b.named(&format!("a{k}"), CTy::compute(t.dtype), l)
            })
            .collect();
        let value = compute(b, &args)?;
        b.push(store("out", elem_out, i.clone(), value));
        Ok(())
    };
    let Some((w, reads)) = vector_width(inputs, out) else {
        let mut b = Body::with_fast(fast);
        scalar_body(&mut b, &var(I))?;
        let k = Kernel {
            name: String::new(),
            params,
            block: BLOCK,
            smem: 0,
            body: vec![grid_stride(I, n as i64, b.stmts)],
        };
        return Ok((finish("ew", k)?, grid(n)));
    };
    let vectors = n / w;
    let mut body = Vec::new();
    // One-element operands, loaded once.
    let mut b = Body::with_fast(fast);
    let scalars: Vec<Option<Expr>> = inputs
        .iter()
        .zip(&reads)
        .enumerate()
        .map(|(k, (t, r))| {
            (*r == Read::Once).then(|| {
                let l = load(&format!("in{k}"), CTy::storage(t.dtype), i64c(0));
                b.named(&format!("s{k}"), CTy::compute(t.dtype), l)
            })
        })
        .collect();
    body.append(&mut b.stmts);
    let mut b = Body::with_fast(fast);
    let i = b.named("i", CTy::I64, mul(var("j"), i64c(w as i64)));
    // Broadcast operands' indices at the vector's first element (its lanes differ only in the
    // last coordinate).
    let broadcast: Vec<usize> = (0..inputs.len())
        .filter(|&k| matches!(reads[k], Read::Row | Read::Splat))
        .collect();
    let sub: Vec<&TensorType> = broadcast.iter().map(|&k| inputs[k]).collect();
    let mut at: Vec<Option<Expr>> = vec![None; inputs.len()];
    for (&k, ix) in broadcast
        .iter()
        .zip(broadcast_indices(&mut b, &sub, &out.shape, &i))
    {
        at[k] = Some(ix);
    }
    let mut lanes: Vec<Vec<Expr>> = vec![Vec::with_capacity(inputs.len()); w];
    for (k, t) in inputs.iter().enumerate() {
        let storage = CTy::storage(t.dtype);
        match reads[k] {
            Read::Once => {
                let s = scalars[k].clone().expect("loaded once");
                lanes.iter_mut().for_each(|l| l.push(s.clone()));
            }
            Read::Splat => {
                let ix = at[k].clone().expect("broadcast index");
                let l = load(&format!("in{k}"), storage, ix);
                let s = b.named(&format!("a{k}"), CTy::compute(t.dtype), l);
                lanes.iter_mut().for_each(|l| l.push(s.clone()));
            }
            Read::Vector | Read::Row => {
                let ix = if reads[k] == Read::Row {
                    at[k].clone().expect("broadcast index")
                } else {
                    i.clone()
                };
                let names: Vec<String> = (0..w).map(|l| format!("a{k}_{l}")).collect();
                b.push(load_vec(&format!("in{k}"), storage, ix, names.clone()));
                for (lane, name) in lanes.iter_mut().zip(&names) {
                    lane.push(var(name));
                }
            }
        }
    }
    let mut values = Vec::with_capacity(w);
    for args in &lanes {
        let v = compute(&mut b, args)?;
        values.push(b.bind(elem_out.compute_of(), v));
    }
    b.push(store_vec("out", elem_out, i, values));
    body.push(grid_stride("j", vectors as i64, b.stmts));
    if !n.is_multiple_of(w) {
        // Only same-shape and one-element operands here: broadcast ones make `n` a multiple of
        // `w` (see `vector_width`).
        let mut t = Body::with_fast(fast);
        let i = var(I);
        let tail_args: Vec<Expr> = inputs
            .iter()
            .enumerate()
            .map(|(k, tt)| match &scalars[k] {
                Some(s) => s.clone(),
                None => {
                    let l = load(&format!("in{k}"), CTy::storage(tt.dtype), i.clone());
                    t.named(&format!("a{k}"), CTy::compute(tt.dtype), l)
                }
            })
            .collect();
        let value = compute(&mut t, &tail_args)?;
        t.push(store("out", elem_out, i, value));
        body.push(for_(
            I,
            add(global_thread(), i64c((vectors * w) as i64)),
            i64c(n as i64),
            mul(special(Special::BlockDim), special(Special::GridDim)),
            t.stmts,
        ));
    }
    let k = Kernel {
        name: String::new(),
        params,
        block: BLOCK,
        smem: 0,
        body,
    };
    Ok((finish("ew", k)?, grid(vectors)))
}

/// Element indices of broadcast operands at the flat output index `flat`.
fn broadcast_indices(b: &mut Body, inputs: &[&TensorType], out: &Shape, flat: &Expr) -> Vec<Expr> {
    let strides: Vec<Vec<usize>> = inputs
        .iter()
        .map(|t| t.shape.broadcast_strides(out))
        .collect();
    strided_indices(b, out.dims(), &strides, &vec![0; inputs.len()], flat)
}

// ================================================================================================
// Fused kernels: every value in one float compute type `c`
// ================================================================================================

/// A fused unary instruction (predicates as 0/1 in `c`).
fn fused_unary(b: &mut Body, u: UnaryOp, x: Expr, c: CTy) -> Result<Expr> {
    Ok(match u {
        UnaryOp::Not => cast(c, eq(x, lit(0.0, c))),
        UnaryOp::IsNan | UnaryOp::IsInf | UnaryOp::IsFinite => cast(c, real_unary(b, u, x, c)?),
        _ => real_unary(b, u, x, c)?,
    })
}

/// A fused binary instruction (comparisons and logic as 0/1 in `c`).
fn fused_binary(op: BinaryOp, x: Expr, y: Expr, c: CTy) -> Result<Expr> {
    let zero = lit(0.0, c);
    Ok(match op {
        BinaryOp::And => cast(c, and(ne(x, zero.clone()), ne(y, zero))),
        BinaryOp::Or => cast(c, bin(BinFn::Or, ne(x, zero.clone()), ne(y, zero))),
        _ if op.is_predicate() => cast(c, real_binary(op, x, y)?),
        _ => real_binary(op, x, y)?,
    })
}

/// A fused cast from `from` to `to` of `x` held in `c`: the cast's value, held in `c`.
fn fused_cast(b: &mut Body, from: DType, to: DType, x: Expr, c: CTy) -> Expr {
    let int_src = !from.is_float();
    let back = |e: Expr, t: CTy| conv(e, t, c);
    match to {
        DType::F32 => back(conv(x, c, CTy::F32), CTy::F32),
        DType::F64 => x,
        DType::F16 => back(cast(CTy::F16, x), CTy::F32),
        DType::BF16 if c == CTy::F64 => back(bf16_of_f64(b, x), CTy::F32),
        DType::BF16 => back(cast(CTy::BF16, x), CTy::F32),
        DType::I32 if int_src => back(cast(CTy::I32, cast(CTy::I64, x)), CTy::I32),
        DType::I32 => back(cast(CTy::I32, x), CTy::I32),
        DType::I64 => back(cast(CTy::I64, x), CTy::I64),
        DType::U8 if int_src => back(cast(CTy::U8, cast(CTy::I64, x)), CTy::U8),
        DType::U8 => back(cast(CTy::U8, x), CTy::U8),
        DType::Bool => cast(c, ne(x, lit(0.0, c))),
        // Not reached: `check_dtypes` rejects these dtypes before any kernel is built.
        DType::I8 | DType::I16 | DType::U16 | DType::U32 | DType::U64 => {
            let t = CTy::storage(to);
            let v = if int_src {
                cast(t, cast(CTy::I64, x))
            } else {
                cast(t, x)
            };
            back(v, t.compute_of())
        }
    }
}

/// Integer semantics for an integer result `v` computed in `c`: truncation toward zero, 0 when
/// not finite, wrapping for u8 and i32 (exact in f32: the remainders and the ±2³² corrections are
/// exact).
fn fix_int(b: &mut Body, dt: DType, v: Expr, c: CTy) -> Expr {
    let v = b.bind(c, v);
    let zero = lit(0.0, c);
    let t = b.bind(
        c,
        select(
            lt(v.clone(), zero.clone()),
            un(UnFn::Ceil, v.clone()),
            un(UnFn::Floor, v),
        ),
    );
    let t = b.bind(c, select(un(UnFn::IsFinite, t.clone()), t, zero.clone()));
    match dt {
        DType::U8 => {
            let r = b.bind(c, rem(t, lit(256.0, c)));
            select(lt(r.clone(), zero), add(r.clone(), lit(256.0, c)), r)
        }
        DType::I32 => {
            let two32 = lit(4_294_967_296.0, c);
            let w = b.bind(c, rem(t, two32.clone()));
            select(
                ge(w.clone(), lit(2_147_483_648.0, c)),
                sub(w.clone(), two32.clone()),
                select(
                    lt(w.clone(), lit(-2_147_483_648.0, c)),
                    add(w.clone(), two32),
                    w,
                ),
            )
        }
        _ => t,
    }
}

/// One fused instruction over the values so far (`vals`, of dtypes `dtypes`), held in `c`.
fn fused_instr(
    b: &mut Body,
    ins: &FusedInstr,
    vals: &[Expr],
    dtypes: &[DType],
    c: CTy,
) -> Result<Expr> {
    let arg = |k: usize| -> Result<Expr> {
        ins.args
            .get(k)
            .and_then(|&a| vals.get(a as usize))
            .cloned()
            .ok_or_else(|| ill_typed(format!("fused instruction argument {k} is undefined")))
    };
    let v = match &ins.op {
        Op::Unary(u) => fused_unary(b, *u, arg(0)?, c)?,
        Op::Binary(o) => fused_binary(*o, arg(0)?, arg(1)?, c)?,
        Op::Where => select(ne(arg(0)?, lit(0.0, c)), arg(1)?, arg(2)?),
        Op::Cast { to } => {
            let x = arg(0)?;
            fused_cast(b, dtypes[ins.args[0] as usize], *to, x, c)
        }
        Op::Full { value, .. } => lit(dtype_value(ins.dtype, value.get()), c),
        other => {
            return Err(ill_typed(format!(
                "`{}` cannot appear in a fused kernel",
                other.name()
            )))
        }
    };
    Ok(
        if ins.dtype.is_int() && matches!(ins.op, Op::Unary(_) | Op::Binary(_)) {
            fix_int(b, ins.dtype, v, c)
        } else {
            v
        },
    )
}

/// The compute type of fused program `k` over inputs of dtypes `inputs`: f64 when any value is
/// f64, else f32.
pub(super) fn program_compute(k: &FusedKernel, inputs: &[DType]) -> CTy {
    let wide = k.out.dtype == DType::F64
        || k.instrs.iter().any(|i| i.dtype == DType::F64)
        || inputs.contains(&DType::F64);
    if wide {
        CTy::F64
    } else {
        CTy::F32
    }
}

/// The value of fused program `k` at one element, as fused kernels compute it: `args` are its
/// inputs' values (compute-type expressions of dtypes `dtypes`); the result is an expression of
/// the compute type [`program_compute`], before rounding to `k.out`'s dtype. Statements binding
/// intermediates (fresh names starting with `tag`) are appended to `stmts`.
pub(super) fn program_value(
    stmts: &mut Vec<Stmt>,
    tag: &str,
    k: &FusedKernel,
    args: &[Expr],
    dtypes: &[DType],
) -> Result<Expr> {
    let c = program_compute(k, dtypes);
    let mut b = Body {
        tag: tag.to_string(),
        ..Body::with_fast(approximate(k.out.dtype))
    };
    let mut vals: Vec<Expr> = Vec::with_capacity(args.len() + k.instrs.len());
    for (a, &d) in args.iter().zip(dtypes) {
        let from = CTy::storage(d).compute_of();
        vals.push(b.bind(c, conv(a.clone(), from, c)));
    }
    let mut all: Vec<DType> = dtypes.to_vec();
    for ins in &k.instrs {
        let v = fused_instr(&mut b, ins, &vals, &all, c)?;
        vals.push(b.bind(c, v));
        all.push(ins.dtype);
    }
    let last = vals
        .pop()
        .ok_or_else(|| ill_typed("a fused kernel without instructions".into()))?;
    let last = if k.out.dtype == DType::BF16 && c == CTy::F64 {
        bf16_of_f64(&mut b, last)
    } else {
        last
    };
    stmts.append(&mut b.stmts);
    Ok(last)
}

/// The kernel of a fused elementwise chain.
fn fused_kernel(
    k: &FusedKernel,
    inputs: &[&TensorType],
    out: &TensorType,
) -> Result<(Kernel, u32)> {
    let wide = out.dtype == DType::F64
        || k.instrs.iter().any(|i| i.dtype == DType::F64)
        || inputs.iter().any(|t| t.dtype == DType::F64);
    let c = if wide { CTy::F64 } else { CTy::F32 };
    let n_in = inputs.len();
    let mut used = vec![false; n_in];
    for ins in &k.instrs {
        for &a in &ins.args {
            if let Some(u) = used.get_mut(a as usize) {
                *u = true;
            }
        }
    }
    let mut params: Vec<Param> = inputs
        .iter()
        .enumerate()
        .map(|(j, t)| param(&format!("in{j}"), t.dtype, false))
        .collect();
    params.push(param("out", out.dtype, true));
    ew_kernel(params, inputs, out, |b, loaded| {
        let mut vals: Vec<Expr> = Vec::with_capacity(n_in + k.instrs.len());
        for (j, (t, l)) in inputs.iter().zip(loaded).enumerate() {
            if !used[j] {
                vals.push(lit(0.0, c));
                continue;
            }
            let s = CTy::storage(t.dtype);
            vals.push(b.bind(c, conv(l.clone(), s.compute_of(), c)));
        }
        let mut dtypes: Vec<DType> = inputs.iter().map(|t| t.dtype).collect();
        for ins in &k.instrs {
            let v = fused_instr(b, ins, &vals, &dtypes, c)?;
            vals.push(b.bind(c, v));
            dtypes.push(ins.dtype);
        }
        let last = vals
            .pop()
            .ok_or_else(|| ill_typed("a fused kernel without instructions".into()))?;
        Ok(if out.dtype == DType::BF16 && c == CTy::F64 {
            bf16_of_f64(b, last)
        } else {
            last
        })
    })
}

// ================================================================================================
// Movement
// ================================================================================================

/// `out[i] = x[offset + Σ coord_k·strides_k]` over the contiguous output of shape `out`: one
/// grid-stride loop, or a tiled transpose when the source's unit-stride dim is not the last.
fn strided_copy(
    prefix: &str,
    dt: DType,
    out: &Shape,
    offset: usize,
    strides: &[usize],
) -> Result<StepKernels> {
    let (d, st) = coalesce(out.dims(), &[strides.to_vec()]);
    if let Some(step) = tiled_transpose(prefix, dt, &d, &st[0], offset) {
        return step;
    }
    let params = vec![param("x", dt, false), param("out", dt, true)];
    let s = CTy::storage(dt);
    let kernel = grid_kernel(prefix, params, out.numel(), |b, i| {
        let idx = strided_indices(b, out.dims(), &[strides.to_vec()], &[offset], &i);
        let ix = idx.into_iter().next().expect("one operand");
        b.push(store("out", s, i, load("x", s, ix)));
        Ok(())
    })?;
    Ok(one_launch(kernel, 1, out.numel()))
}

/// Tile edge of the shared-memory transpose (a block of 256 threads moves a tile in 4 rounds of
/// 32 × 8).
const TILE: usize = 32;

/// A strided copy over coalesced output dims `d` whose source strides `s` are 1 along some dim
/// `j` before the last and larger along the last: a transpose through shared-memory tiles of
/// (dim `j`) × (last dim), so that the reads (consecutive threads along `j`) and the writes
/// (along the last dim) are both coalesced. `None` when the copy is not of that form or too
/// narrow to gain.
fn tiled_transpose(
    prefix: &str,
    dt: DType,
    d: &[usize],
    s: &[usize],
    offset: usize,
) -> Option<Result<StepKernels>> {
    let r = d.len();
    if r < 2 || s[r - 1] <= 1 || d[r - 1] < 8 {
        return None;
    }
    let j = (0..r - 1).find(|&j| s[j] == 1 && d[j] >= 8)?;
    let (rows, cols, col_stride) = (d[j], d[r - 1], s[r - 1]);
    let ostr = Shape::new(d.to_vec()).strides();
    // Tiles: every index of the other dims × row tiles × column tiles.
    let others: Vec<usize> = (0..r - 1).filter(|&k| k != j).collect();
    let mut tile_dims: Vec<usize> = others.iter().map(|&k| d[k]).collect();
    tile_dims.push(rows.div_ceil(TILE));
    tile_dims.push(cols.div_ceil(TILE));
    let n_tiles: usize = tile_dims.iter().product();
    let st = CTy::storage(dt);
    let pitch = (TILE + 1) as i64;
    let tile = i64c(TILE as i64);
    let mut b = Body::new();
    let mut coords = Coords::new(&tile_dims, var("t"));
    let mut src_terms = vec![];
    let mut dst_terms = vec![];
    for (q, &k) in others.iter().enumerate() {
        let c = coords.get(&mut b, q);
        if s[k] != 0 {
            src_terms.push((c.clone(), s[k] as i64));
        }
        dst_terms.push((c, ostr[k] as i64));
    }
    let src = b.bind(CTy::I64, linear(src_terms, offset as i64));
    let dst = b.bind(CTy::I64, linear(dst_terms, 0));
    let rt = coords.get(&mut b, others.len());
    let r0 = b.named("r0", CTy::I64, mul(rt, tile.clone()));
    let ct = coords.get(&mut b, others.len() + 1);
    let q0 = b.named("q0", CTy::I64, mul(ct, tile.clone()));
    let inside = || {
        and(
            lt(var("row"), i64c(rows as i64)),
            lt(var("col"), i64c(cols as i64)),
        )
    };
    // Four rounds of 8 rows of threads cover a tile.
    let rounds = |body: Vec<Stmt>| {
        let step = i64c((BLOCK as usize / TILE) as i64);
        for_("k", var("ty"), tile.clone(), step, body)
    };
    // Reads: consecutive threads along `j` (unit stride); tile[col][row].
    let from = linear(
        vec![(src, 1), (var("row"), 1), (var("col"), col_stride as i64)],
        0,
    );
    b.push(rounds(vec![
        let_("row", CTy::I64, add(r0.clone(), var("tx"))),
        let_("col", CTy::I64, add(q0.clone(), var("k"))),
        if_(
            inside(),
            vec![store(
                "tile",
                st,
                add(mul(var("k"), i64c(pitch)), var("tx")),
                load("x", st, from),
            )],
        ),
    ]));
    b.push(Stmt::SyncThreads);
    // Writes: consecutive threads along the last dim (contiguous in the output).
    let to = linear(
        vec![(dst, 1), (var("row"), ostr[j] as i64), (var("col"), 1)],
        0,
    );
    b.push(rounds(vec![
        let_("row", CTy::I64, add(r0, var("k"))),
        let_("col", CTy::I64, add(q0, var("tx"))),
        if_(
            inside(),
            vec![store(
                "out",
                st,
                to,
                load("tile", st, add(mul(var("tx"), i64c(pitch)), var("k"))),
            )],
        ),
    ]));
    // The next tile overwrites the shared array.
    b.push(Stmt::SyncThreads);
    let k = Kernel {
        name: String::new(),
        params: vec![param("x", dt, false), param("out", dt, true)],
        block: BLOCK,
        smem: 0,
        body: vec![
            Stmt::Shared {
                name: "tile".into(),
                elem: st,
                len: (TILE * (TILE + 1)) as u32,
            },
            let_(
                "tx",
                CTy::I64,
                rem(special(Special::ThreadIdx), tile.clone()),
            ),
            let_("ty", CTy::I64, div(special(Special::ThreadIdx), tile)),
            for_(
                "t",
                special(Special::BlockIdx),
                i64c(n_tiles as i64),
                special(Special::GridDim),
                b.stmts,
            ),
        ],
    };
    Some(finish(prefix, k).map(|kernel| StepKernels {
        launches: vec![Launch::simple(kernel, 1, grid_for(n_tiles as u64, 1))],
        scratch_bytes: 0,
    }))
}

/// Concatenation along `axis`: the output is `[outer, total·inner]`; the position along the axis
/// picks the input.
fn concat_kernel(inputs: &[&TensorType], axis: usize, out: &TensorType) -> Result<Kernel> {
    let dt = out.dtype;
    let s = CTy::storage(dt);
    let od = out.shape.dims();
    let inner: usize = od[axis + 1..].iter().product();
    let outer: usize = od[..axis].iter().product();
    let row = od[axis] * inner;
    let mut params: Vec<Param> = (0..inputs.len())
        .map(|k| param(&format!("in{k}"), dt, false))
        .collect();
    params.push(param("out", dt, true));
    grid_kernel("concat", params, out.shape.numel(), |b, i| {
        // (outer, position in the row) coordinates.
        let (o, r) = if outer > 1 {
            let mut coords = Coords::new(&[outer, row], i.clone());
            (coords.get(b, 0), coords.get(b, 1))
        } else {
            (i64c(0), i.clone())
        };
        // Inputs that contribute, with their first position along the axis.
        let mut at = 0;
        let mut parts: Vec<(usize, usize, usize)> = vec![];
        for (k, t) in inputs.iter().enumerate() {
            let n = t.shape.dims()[axis];
            if n > 0 {
                parts.push((k, at, n));
            }
            at += n;
        }
        // out[i] = in_k[o·n_k·inner + r - at_k·inner], selected by `r < (at_k + n_k)·inner`.
        let mut chain: Vec<Stmt> = vec![];
        for (idx, &(k, at, n)) in parts.iter().enumerate().rev() {
            let mut terms = vec![(r.clone(), 1)];
            if outer > 1 {
                terms.push((o.clone(), (n * inner) as i64));
            }
            let src = linear(terms, -((at * inner) as i64));
            let st = store("out", s, i.clone(), load(&format!("in{k}"), s, src));
            chain = if idx + 1 == parts.len() {
                vec![st]
            } else {
                vec![Stmt::If {
                    cond: lt(r.clone(), i64c(((at + n) * inner) as i64)),
                    then: vec![st],
                    els: chain,
                }]
            };
        }
        b.stmts.extend(chain);
        Ok(())
    })
}

/// Constant padding: an output element inside the input's box reads it, the others get `value`
/// (converted to the dtype once, on the host).
fn pad_kernel(
    x: &TensorType,
    pads: &[(usize, usize)],
    value: f64,
    out: &TensorType,
) -> Result<Kernel> {
    let dt = out.dtype;
    let s = CTy::storage(dt);
    let fill = lit(dtype_value(dt, value), CTy::compute(dt));
    // (output size, input size, padding before) per dim; size-1 unpadded dims dropped and unpadded
    // dims merged into the dim before them.
    let mut dims: Vec<(usize, usize, usize)> = vec![];
    for (&d, &(bef, aft)) in x.shape.dims().iter().zip(pads) {
        let unpadded = bef == 0 && aft == 0;
        if unpadded && d == 1 {
            continue;
        }
        match dims.last_mut() {
            Some(last) if unpadded => {
                last.0 *= d;
                last.1 *= d;
                last.2 *= d;
            }
            _ => dims.push((bef + d + aft, d, bef)),
        }
    }
    let params = vec![param("x", dt, false), param("out", dt, true)];
    grid_kernel("pad", params, out.shape.numel(), |b, i| {
        if x.shape.numel() == 0 {
            b.push(store("out", s, i, fill));
            return Ok(());
        }
        let od: Vec<usize> = dims.iter().map(|d| d.0).collect();
        let in_strides = Shape::new(dims.iter().map(|d| d.1).collect::<Vec<_>>()).strides();
        let mut coords = Coords::new(&od, i.clone());
        let mut inside: Option<Expr> = None;
        let mut terms = vec![];
        let mut base = 0i64;
        for (k, &(o, d, bef)) in dims.iter().enumerate() {
            let ck = coords.get(b, k);
            if o != d {
                let mut cond = lt(ck.clone(), i64c((bef + d) as i64));
                if bef > 0 {
                    cond = and(ge(ck.clone(), i64c(bef as i64)), cond);
                }
                inside = Some(match inside {
                    Some(c) => and(c, cond),
                    None => cond,
                });
            }
            terms.push((ck, in_strides[k] as i64));
            base -= (bef * in_strides[k]) as i64;
        }
        let copy = store("out", s, i.clone(), load("x", s, linear(terms, base)));
        match inside {
            Some(cond) => b.push(Stmt::If {
                cond,
                then: vec![copy],
                els: vec![store("out", s, i, fill)],
            }),
            None => b.push(copy),
        }
        Ok(())
    })
}

// ================================================================================================
// Indexing
// ================================================================================================

/// An index element (i32 or i64) as i64, bound to the local `j`.
fn index_value(b: &mut Body, index: &TensorType, at: Expr) -> Expr {
    let s = CTy::storage(index.dtype);
    b.named("j", CTy::I64, conv(load("index", s, at), s, CTy::I64))
}

/// `0 <= j < n`.
fn in_range(j: &Expr, n: usize) -> Expr {
    and(ge(j.clone(), i64c(0)), lt(j.clone(), i64c(n as i64)))
}

/// torch.gather: `out[p] = x[p with p[axis] = index[p]]`; 0 for an index outside `0..dim`.
fn gather_kernel(
    x: &TensorType,
    index: &TensorType,
    axis: usize,
    out: &TensorType,
) -> Result<Kernel> {
    let dt = x.dtype;
    let s = CTy::storage(dt);
    let xs = x.shape.strides();
    let n = x.shape.dims()[axis];
    let params = vec![
        param("x", dt, false),
        param("index", index.dtype, false),
        param("out", dt, true),
    ];
    grid_kernel("gather", params, out.shape.numel(), |b, i| {
        let j = index_value(b, index, i.clone());
        let id = index.shape.dims();
        let mut coords = Coords::new(id, i.clone());
        let mut terms: Vec<(Expr, i64)> = (0..id.len())
            .filter(|&d| d != axis && id[d] > 1)
            .map(|d| (coords.get(b, d), xs[d] as i64))
            .collect();
        terms.push((j.clone(), xs[axis] as i64));
        b.push(Stmt::If {
            cond: in_range(&j, n),
            then: vec![store("out", s, i.clone(), load("x", s, linear(terms, 0)))],
            els: vec![store("out", s, i, lit(0.0, CTy::compute(dt)))],
        });
        Ok(())
    })
}

/// index_select: `out[o, m, j] = x[o, index[m], j]` around `axis`; 0 for an index outside
/// `0..dim`.
fn index_select_kernel(
    x: &TensorType,
    index: &TensorType,
    axis: usize,
    out: &TensorType,
) -> Result<Kernel> {
    let dt = x.dtype;
    let s = CTy::storage(dt);
    let xd = x.shape.dims();
    let (n, inner) = (xd[axis], xd[axis + 1..].iter().product::<usize>());
    let m = index.shape.dims()[0];
    let params = vec![
        param("x", dt, false),
        param("index", index.dtype, false),
        param("out", dt, true),
    ];
    grid_kernel("index_select", params, out.shape.numel(), |b, i| {
        // Output coordinates (outer, m, inner).
        let mut coords = Coords::new(&[out.shape.numel() / (m * inner), m, inner], i.clone());
        let at = coords.get(b, 1);
        let j = index_value(b, index, at);
        let mut terms = vec![];
        if out.shape.numel() > m * inner {
            terms.push((coords.get(b, 0), (n * inner) as i64));
        }
        terms.push((j.clone(), inner as i64));
        if inner > 1 {
            terms.push((coords.get(b, 2), 1));
        }
        b.push(Stmt::If {
            cond: in_range(&j, n),
            then: vec![store("out", s, i.clone(), load("x", s, linear(terms, 0)))],
            els: vec![store("out", s, i, lit(0.0, CTy::compute(dt)))],
        });
        Ok(())
    })
}

/// scatter_add / index_add: copy `base` into the accumulator, atomically add every `src` element
/// at its target (indices outside `0..dim` are skipped). f16/bf16 accumulate in an f32 scratch
/// buffer, copied into the output (rounding once) by a third launch.
fn accumulate(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<StepKernels> {
    let (base, index, src) = (inputs[0], inputs[1], inputs[2]);
    let dt = out.dtype;
    let scratch = matches!(dt, DType::F16 | DType::BF16);
    let (acc_dt, acc_arg) = if scratch {
        (DType::F32, ArgRef::Scratch)
    } else {
        (dt, ArgRef::Output)
    };
    let n = out.shape.numel();
    let copy = |from: DType, to: DType| -> Result<Kernel> {
        let params = vec![param("x", from, false), param("out", to, true)];
        grid_kernel("copy", params, n, |b, i| {
            let v = load("x", CTy::storage(from), i.clone());
            b.push(store("out", CTy::storage(to), i, v));
            Ok(())
        })
    };
    let mut launches = vec![Launch {
        kernel: copy(dt, acc_dt)?,
        args: vec![ArgRef::Input(0), acc_arg],
        grid: grid(n),
    }];
    let m = src.shape.numel();
    if m > 0 {
        let bd = base.shape.dims();
        let bs = base.shape.strides();
        let params = vec![
            param("index", index.dtype, false),
            param("src", src.dtype, false),
            param("out", acc_dt, true),
        ];
        let s = CTy::storage(src.dtype);
        let a = CTy::storage(acc_dt);
        let (prefix, axis) = match op {
            Op::ScatterAdd { axis } => ("scatter_add", *axis),
            Op::IndexAdd { axis } => ("index_add", *axis),
            _ => return Err(not_mine(op, "an accumulating indexing")),
        };
        let is_scatter = matches!(op, Op::ScatterAdd { .. });
        let kernel = grid_kernel(prefix, params, m, |b, p| {
            let nax = bd[axis];
            let (j, terms) = if is_scatter {
                // Coordinates over the index's (= src's) shape; the index is read at `p`.
                let j = index_value(b, index, p.clone());
                let id = index.shape.dims();
                let mut coords = Coords::new(id, p.clone());
                let mut terms: Vec<(Expr, i64)> = (0..id.len())
                    .filter(|&d| d != axis && id[d] > 1)
                    .map(|d| (coords.get(b, d), bs[d] as i64))
                    .collect();
                terms.push((j.clone(), bs[axis] as i64));
                (j, terms)
            } else {
                // src is base with dim `axis` = len(index): coordinates (outer, m, inner).
                let inner: usize = bd[axis + 1..].iter().product();
                let mi = index.shape.dims()[0];
                let mut coords = Coords::new(&[m / (mi * inner), mi, inner], p.clone());
                let at = coords.get(b, 1);
                let j = index_value(b, index, at);
                let mut terms = vec![];
                if m > mi * inner {
                    terms.push((coords.get(b, 0), (nax * inner) as i64));
                }
                terms.push((j.clone(), inner as i64));
                if inner > 1 {
                    terms.push((coords.get(b, 2), 1));
                }
                (j, terms)
            };
            b.push(if_(
                in_range(&j, nax),
                vec![Stmt::AtomicAdd {
                    buf: "out".into(),
                    elem: a,
                    index: linear(terms, 0),
                    value: conv(load("src", s, p), s.compute_of(), a.compute_of()),
                }],
            ));
            Ok(())
        })?;
        launches.push(Launch {
            kernel,
            args: vec![ArgRef::Input(1), ArgRef::Input(2), acc_arg],
            grid: grid(m),
        });
    }
    if scratch {
        launches.push(Launch {
            kernel: copy(acc_dt, dt)?,
            args: vec![ArgRef::Scratch, ArgRef::Output],
            grid: grid(n),
        });
    }
    Ok(StepKernels {
        launches,
        scratch_bytes: if scratch { n * 4 } else { 0 },
    })
}
