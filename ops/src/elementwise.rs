//! Elementwise ops: `Unary`, `Binary` (numpy broadcasting), `Where`, `Cast` and `Fused` kernels —
//! shape/dtype inference, CPU kernels and gradient rules.
//!
//! Semantics follow PyTorch:
//! - float kernels compute in the native type for f32/f64 and in f32 for f16/bf16 (rounded once
//!   at the end);
//! - integer `add`/`sub`/`mul`/`neg`/`abs`/`pow` wrap on overflow; integer `div` truncates toward
//!   zero and **division by zero yields 0** (no error, no panic); integer `pow` with a negative
//!   exponent yields 0, except for the bases 1 and -1;
//! - `round` rounds half to even, `sign(0) = 0`, `maximum`/`minimum` propagate NaN;
//! - `cast` uses Rust `as` semantics: float to int truncates toward zero and saturates, NaN becomes
//!   0, int to int wraps, anything to bool is `!= 0`, bool to number is 0/1, and f16/bf16 results
//!   are rounded once to nearest even from the exact source value.
//!
//! Kernels dispatch once per tensor on the dtype and once per chunk on the op; the inner loops are
//! monomorphized per function (no per-element dispatch). Large tensors are split in chunks across
//! rayon. f32 (and f16/bf16, computed in f32) `exp`, `tanh`, `sigmoid`, `silu` and both GELUs run
//! through the vectorized forms of [`crate::vmath`] (exp within 2 ulp, the others within a few
//! 1e-6 relative error; see there).

use crate::util::{arity, attr_err, dtype_err, shape_err, PAR_THRESHOLD};
use crate::{
    with_data, with_dtype, BinaryOp, DType, Data, Element, F64Bits, FusedKernel, HostElement,
    HostTensor, Op, OpError, Result, Shape, TensorType, UnaryOp, Value, VjpCtx,
};
use half::{bf16, f16};
use std::fmt::Debug;
use std::ops::{Add, Div, Mul, Neg, Sub};

/// Elements processed per chunk (per rayon task, and per instruction pass of a fused kernel).
const CHUNK: usize = 4096;

// ================================================================================================
// Shape and dtype inference
// ================================================================================================

/// Whether a unary op accepts a dtype.
fn unary_accepts(u: UnaryOp, d: DType) -> bool {
    match u {
        UnaryOp::Exp
        | UnaryOp::Log
        | UnaryOp::Sqrt
        | UnaryOp::Rsqrt
        | UnaryOp::Reciprocal
        | UnaryOp::Sin
        | UnaryOp::Cos
        | UnaryOp::Tanh
        | UnaryOp::Sigmoid
        | UnaryOp::GeluErf
        | UnaryOp::GeluTanh
        | UnaryOp::Silu
        | UnaryOp::Erf => d.is_float(),
        UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round => d.is_float() || d.is_int(),
        UnaryOp::Neg => d.is_float() || d.is_signed_int(),
        UnaryOp::Abs | UnaryOp::Sign | UnaryOp::Relu => d.is_float() || d.is_int(),
        UnaryOp::Not => d == DType::Bool,
        UnaryOp::IsNan | UnaryOp::IsInf | UnaryOp::IsFinite => d.is_float() || d.is_int(),
    }
}

/// What a unary op needs, for error messages.
fn unary_needs(u: UnaryOp) -> &'static str {
    match u {
        UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round => "a float or integer dtype",
        UnaryOp::Neg => "a float or signed integer dtype",
        UnaryOp::Abs | UnaryOp::Sign | UnaryOp::Relu => "a float or integer dtype",
        UnaryOp::Not => "a bool dtype",
        UnaryOp::IsNan | UnaryOp::IsInf | UnaryOp::IsFinite => "a numeric dtype",
        _ => "a float dtype",
    }
}

/// Whether a binary op accepts a (common) dtype.
fn binary_accepts(b: BinaryOp, d: DType) -> bool {
    match b {
        BinaryOp::Add
        | BinaryOp::Sub
        | BinaryOp::Mul
        | BinaryOp::Div
        | BinaryOp::Pow
        | BinaryOp::Maximum
        | BinaryOp::Minimum => d != DType::Bool,
        BinaryOp::Eq | BinaryOp::Ne | BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge => {
            true
        }
        BinaryOp::And | BinaryOp::Or => d == DType::Bool,
    }
}

/// Broadcast shape of several input types, or a shape error naming all of them.
fn broadcast_all(op: &Op, inputs: &[&TensorType]) -> Result<Shape> {
    let mut s = Shape::scalar();
    for t in inputs {
        s = Shape::broadcast(&s, &t.shape).ok_or_else(|| {
            let shapes: Vec<String> = inputs.iter().map(|t| t.shape.to_string()).collect();
            shape_err(
                op,
                inputs,
                format!("shapes {} do not broadcast", shapes.join(" and ")),
            )
        })?;
    }
    Ok(s)
}

/// Output type of an elementwise op.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    match op {
        Op::Unary(u) => {
            arity(op, inputs, 1)?;
            let x = inputs[0];
            if !unary_accepts(*u, x.dtype) {
                return Err(dtype_err(
                    op,
                    inputs,
                    format!("{} needs {}, got {}", op.name(), unary_needs(*u), x.dtype),
                ));
            }
            let dtype = match u {
                UnaryOp::IsNan | UnaryOp::IsInf | UnaryOp::IsFinite => DType::Bool,
                _ => x.dtype,
            };
            Ok(TensorType::new(dtype, x.shape.clone()))
        }
        Op::Binary(b) => {
            arity(op, inputs, 2)?;
            let (x, y) = (inputs[0], inputs[1]);
            if x.dtype != y.dtype {
                return Err(dtype_err(
                    op,
                    inputs,
                    format!(
                        "operand dtypes differ ({} vs {}); there is no implicit promotion, cast one operand",
                        x.dtype, y.dtype
                    ),
                ));
            }
            if !binary_accepts(*b, x.dtype) {
                let need = match b {
                    BinaryOp::And | BinaryOp::Or => "bool operands",
                    _ => "numeric (non-bool) operands",
                };
                return Err(dtype_err(
                    op,
                    inputs,
                    format!("{} needs {need}, got {}", op.name(), x.dtype),
                ));
            }
            let shape = broadcast_all(op, inputs)?;
            let dtype = if b.is_predicate() {
                DType::Bool
            } else {
                x.dtype
            };
            Ok(TensorType::new(dtype, shape))
        }
        Op::Where => {
            arity(op, inputs, 3)?;
            if inputs[0].dtype != DType::Bool {
                return Err(dtype_err(
                    op,
                    inputs,
                    format!("the condition must be bool, got {}", inputs[0].dtype),
                ));
            }
            if inputs[1].dtype != inputs[2].dtype {
                return Err(dtype_err(
                    op,
                    inputs,
                    format!(
                        "the two branches differ in dtype ({} vs {}); cast one",
                        inputs[1].dtype, inputs[2].dtype
                    ),
                ));
            }
            let shape = broadcast_all(op, inputs)?;
            Ok(TensorType::new(inputs[1].dtype, shape))
        }
        Op::Cast { to } => {
            arity(op, inputs, 1)?;
            Ok(TensorType::new(*to, inputs[0].shape.clone()))
        }
        Op::Fused(k) => infer_fused(op, k, inputs),
        _ => Err(OpError::Runtime {
            op: op.name(),
            reason: "not an elementwise op".into(),
        }),
    }
}

/// Validates a fused kernel against its inputs; its output type is `k.out`.
fn infer_fused(op: &Op, k: &FusedKernel, inputs: &[&TensorType]) -> Result<TensorType> {
    arity(op, inputs, k.n_inputs as usize)?;
    for t in inputs {
        if !t.shape.broadcasts_to(&k.out.shape) {
            return Err(shape_err(
                op,
                inputs,
                format!(
                    "input shape {} does not broadcast to the kernel's output shape {}",
                    t.shape, k.out.shape
                ),
            ));
        }
    }
    let last = k
        .instrs
        .last()
        .ok_or_else(|| attr_err(op, "a fused kernel needs at least one instruction"))?;
    if last.dtype != k.out.dtype {
        return Err(attr_err(
            op,
            format!(
                "the last instruction has dtype {} but the kernel's output is {}",
                last.dtype, k.out.dtype
            ),
        ));
    }
    let mut dtypes: Vec<DType> = inputs.iter().map(|t| t.dtype).collect();
    for (j, ins) in k.instrs.iter().enumerate() {
        let n_args = match &ins.op {
            Op::Unary(_) | Op::Cast { .. } => 1,
            Op::Binary(_) => 2,
            Op::Where => 3,
            Op::Full { ty, .. } => {
                if ty.shape.numel() != 1 {
                    return Err(attr_err(
                        op,
                        format!(
                            "instruction {j}: a fused constant must be a scalar, got shape {}",
                            ty.shape
                        ),
                    ));
                }
                0
            }
            other => {
                return Err(attr_err(
                    op,
                    format!(
                        "instruction {j}: `{}` cannot appear in a fused kernel",
                        other.name()
                    ),
                ))
            }
        };
        if ins.args.len() != n_args {
            return Err(attr_err(
                op,
                format!(
                    "instruction {j} ({}) takes {n_args} arguments, got {}",
                    ins.op.name(),
                    ins.args.len()
                ),
            ));
        }
        let avail = dtypes.len();
        let mut arg_tys = Vec::with_capacity(n_args);
        for &a in &ins.args {
            let a = a as usize;
            if a >= avail {
                return Err(attr_err(
                    op,
                    format!(
                        "instruction {j} reads value {a}, but only {avail} are defined before it"
                    ),
                ));
            }
            arg_tys.push(TensorType::new(dtypes[a], Shape::scalar()));
        }
        let refs: Vec<&TensorType> = arg_tys.iter().collect();
        let ty = crate::infer(&ins.op, &refs).map_err(|e| {
            attr_err(
                op,
                format!("instruction {j} ({}) is ill-typed: {e}", ins.op.name()),
            )
        })?;
        if ty.dtype != ins.dtype {
            return Err(attr_err(
                op,
                format!(
                    "instruction {j} ({}) yields {} but is declared {}",
                    ins.op.name(),
                    ty.dtype,
                    ins.dtype
                ),
            ));
        }
        dtypes.push(ins.dtype);
    }
    Ok(k.out.clone())
}

// ================================================================================================
// Scalar math: one definition of each function, used by the tensor kernels and the fused kernels
// ================================================================================================

/// A float compute type (f32 or f64).
pub(crate) trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + Default
    + Debug
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    /// A constant (rounded to this type).
    fn lit(v: f64) -> Self;
    fn to_f64(self) -> f64;
    /// Loads a storage element into this compute type.
    fn load<T: Element>(t: T) -> Self;
    /// Stores into a storage element (`as` semantics, rounding once).
    fn store<T: Element>(self) -> T;
    /// `d = u(x)` through the vectorized f32 forms of [`crate::vmath`] where this type and op
    /// have one (returns false otherwise, and writes nothing).
    #[inline(always)]
    fn vector_unary(_u: UnaryOp, _x: &[Self], _d: &mut [Self]) -> bool {
        false
    }
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn tanh(self) -> Self;
    fn floor(self) -> Self;
    fn ceil(self) -> Self;
    fn round_even(self) -> Self;
    fn abs(self) -> Self;
    fn powf(self, e: Self) -> Self;
    fn erfc(self) -> Self;
    fn erf(self) -> Self;
    fn is_nan(self) -> bool;
    fn is_infinite(self) -> bool;
    fn is_finite(self) -> bool;
    #[inline(always)]
    fn from_bool(b: bool) -> Self {
        if b {
            Self::ONE
        } else {
            Self::ZERO
        }
    }
}

macro_rules! real_impl {
    ($t:ident, $to:ident, $from:ident, { $($extra:item)* }) => {
        impl Real for $t {
            $($extra)*
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            #[inline(always)]
            fn lit(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn load<T: Element>(t: T) -> Self {
                t.$to()
            }
            #[inline(always)]
            fn store<T: Element>(self) -> T {
                T::$from(self)
            }
            #[inline(always)]
            fn exp(self) -> Self {
                $t::exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                $t::ln(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                $t::sqrt(self)
            }
            #[inline(always)]
            fn sin(self) -> Self {
                $t::sin(self)
            }
            #[inline(always)]
            fn cos(self) -> Self {
                $t::cos(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                $t::tanh(self)
            }
            #[inline(always)]
            fn floor(self) -> Self {
                $t::floor(self)
            }
            #[inline(always)]
            fn ceil(self) -> Self {
                $t::ceil(self)
            }
            #[inline(always)]
            fn round_even(self) -> Self {
                $t::round_ties_even(self)
            }
            #[inline(always)]
            fn abs(self) -> Self {
                $t::abs(self)
            }
            #[inline(always)]
            fn powf(self, e: Self) -> Self {
                $t::powf(self, e)
            }
            #[inline(always)]
            fn erfc(self) -> Self {
                erfc(self as f64) as $t
            }
            #[inline(always)]
            fn erf(self) -> Self {
                erf(self as f64) as $t
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                $t::is_nan(self)
            }
            #[inline(always)]
            fn is_infinite(self) -> bool {
                $t::is_infinite(self)
            }
            #[inline(always)]
            fn is_finite(self) -> bool {
                $t::is_finite(self)
            }
        }
    };
}
real_impl!(f32, to_f32, from_f32, {
    fn vector_unary(u: UnaryOp, x: &[f32], d: &mut [f32]) -> bool {
        use crate::vmath::{map, VFn};
        let f = match u {
            UnaryOp::Exp => VFn::Exp,
            UnaryOp::GeluErf => VFn::GeluErf,
            UnaryOp::GeluTanh => VFn::GeluTanh,
            UnaryOp::Sigmoid => VFn::Sigmoid,
            UnaryOp::Silu => VFn::Silu,
            UnaryOp::Tanh => VFn::Tanh,
            _ => return false,
        };
        map(f, x, d);
        true
    }
});
real_impl!(f64, to_f64, from_f64, {});

/// √(2/π), the GELU tanh-form constant.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the GELU tanh form.
const GELU_TANH_C: f64 = 0.044715;

#[inline(always)]
fn sigmoid<F: Real>(x: F) -> F {
    F::ONE / (F::ONE + (-x).exp())
}
#[inline(always)]
fn relu<F: Real>(x: F) -> F {
    // NaN and -0.0 pass through unchanged.
    if x < F::ZERO {
        F::ZERO
    } else {
        x
    }
}
#[inline(always)]
fn gelu_erf<F: Real>(x: F) -> F {
    // 0.5·x·(1 + erf(x/√2)), written with erfc to keep full relative accuracy for negative x.
    F::lit(0.5) * x * (-x * F::lit(std::f64::consts::FRAC_1_SQRT_2)).erfc()
}
#[inline(always)]
fn gelu_tanh<F: Real>(x: F) -> F {
    let u = F::lit(SQRT_2_OVER_PI) * (x + F::lit(GELU_TANH_C) * x * x * x);
    F::lit(0.5) * x * (F::ONE + u.tanh())
}
#[inline(always)]
fn silu<F: Real>(x: F) -> F {
    x * sigmoid(x)
}
#[inline(always)]
fn sign<F: Real>(x: F) -> F {
    if x > F::ZERO {
        F::ONE
    } else if x < F::ZERO {
        -F::ONE
    } else {
        x // ±0 and NaN
    }
}
#[inline(always)]
fn maximum<F: Real>(a: F, b: F) -> F {
    if a.is_nan() || b.is_nan() {
        a + b
    } else if a > b {
        a
    } else {
        b
    }
}
#[inline(always)]
fn minimum<F: Real>(a: F, b: F) -> F {
    if a.is_nan() || b.is_nan() {
        a + b
    } else if a < b {
        a
    } else {
        b
    }
}

// The error function and its complement, to within about one ulp: a port of FreeBSD's `s_erf.c`
// (as in musl and the `libm` crate).
//
// Copyright (C) 1993 by Sun Microsystems, Inc. All rights reserved. Developed at SunPro, a Sun
// Microsystems, Inc. business. Permission to use, copy, modify, and distribute this software is
// freely granted, provided that this notice is preserved.

/// The published coefficients, digit for digit.
#[allow(clippy::excessive_precision)]
mod erf_coef {
    pub(super) const ERX: f64 = 8.45062911510467529297e-01;
    pub(super) const EFX8: f64 = 1.02703333676410069053e+00;
    pub(super) const PP: [f64; 5] = [
        1.28379167095512558561e-01,
        -3.25042107247001499370e-01,
        -2.84817495755985104766e-02,
        -5.77027029648944159157e-03,
        -2.37630166566501626084e-05,
    ];
    pub(super) const QQ: [f64; 5] = [
        3.97917223959155352819e-01,
        6.50222499887672944485e-02,
        5.08130628187576562776e-03,
        1.32494738004321644526e-04,
        -3.96022827877536812320e-06,
    ];
    pub(super) const PA: [f64; 7] = [
        -2.36211856075265944077e-03,
        4.14856118683748331666e-01,
        -3.72207876035701323847e-01,
        3.18346619901161753674e-01,
        -1.10894694282396677476e-01,
        3.54783043256182359371e-02,
        -2.16637559486879084300e-03,
    ];
    pub(super) const QA: [f64; 6] = [
        1.06420880400844228286e-01,
        5.40397917702171048937e-01,
        7.18286544141962662868e-02,
        1.26171219808761642112e-01,
        1.36370839120290507362e-02,
        1.19844998467991074170e-02,
    ];
    pub(super) const RA: [f64; 8] = [
        -9.86494403484714822705e-03,
        -6.93858572707181764372e-01,
        -1.05586262253232909814e+01,
        -6.23753324503260060396e+01,
        -1.62396669462573470355e+02,
        -1.84605092906711035994e+02,
        -8.12874355063065934246e+01,
        -9.81432934416914548592e+00,
    ];
    pub(super) const SA: [f64; 8] = [
        1.96512716674392571292e+01,
        1.37657754143519042600e+02,
        4.34565877475229228821e+02,
        6.45387271733267880336e+02,
        4.29008140027567833386e+02,
        1.08635005541779435134e+02,
        6.57024977031928170135e+00,
        -6.04244152148580987438e-02,
    ];
    pub(super) const RB: [f64; 7] = [
        -9.86494292470009928597e-03,
        -7.99283237680523006574e-01,
        -1.77579549177547519889e+01,
        -1.60636384855821916062e+02,
        -6.37566443368389627722e+02,
        -1.02509513161107724954e+03,
        -4.83519191608651397019e+02,
    ];
    pub(super) const SB: [f64; 7] = [
        3.03380607434824582924e+01,
        3.25792512996573918826e+02,
        1.53672958608443695994e+03,
        3.19985821950859553908e+03,
        2.55305040643316442583e+03,
        4.74528541206955367215e+02,
        -2.24409524465858183362e+01,
    ];
}
use erf_coef::*;

/// Horner evaluation of `c[0] + z*c[1] + ...`.
fn poly(z: f64, c: &[f64]) -> f64 {
    c.iter().rev().fold(0.0, |acc, &k| acc * z + k)
}

/// (erf(x) - x)/x for |x| < 0.84375.
fn erf_small_ratio(x: f64) -> f64 {
    let z = x * x;
    poly(z, &PP) / (1.0 + z * poly(z, &QQ))
}

/// erf(|x|) - ERX for 0.84375 <= |x| < 1.25.
fn erf_near_one(ax: f64) -> f64 {
    let s = ax - 1.0;
    poly(s, &PA) / (1.0 + s * poly(s, &QA))
}

/// erfc(|x|) for 1.25 <= |x| < 28 (`ix` is the high word of |x|).
fn erfc_tail(ax: f64, ix: u32) -> f64 {
    let s = 1.0 / (ax * ax);
    let (r, big_s) = if ix < 0x4006_db6d {
        (poly(s, &RA), 1.0 + s * poly(s, &SA))
    } else {
        (poly(s, &RB), 1.0 + s * poly(s, &SB))
    };
    let z = f64::from_bits(ax.to_bits() & 0xffff_ffff_0000_0000);
    (-z * z - 0.5625).exp() * ((z - ax) * (z + ax) + r / big_s).exp() / ax
}

/// The error function, to within about one ulp.
pub fn erf(x: f64) -> f64 {
    let hi = (x.to_bits() >> 32) as u32;
    let negative = hi >> 31 != 0;
    let ix = hi & 0x7fff_ffff;
    if x.is_nan() {
        return x;
    }
    if ix < 0x3feb_0000 {
        // |x| < 0.84375
        if ix < 0x3e30_0000 {
            return 0.125 * (8.0 * x + EFX8 * x);
        }
        return x + x * erf_small_ratio(x);
    }
    let ax = x.abs();
    let y = if ix < 0x3ff4_0000 {
        ERX + erf_near_one(ax)
    } else if ix < 0x4018_0000 {
        1.0 - erfc_tail(ax, ix)
    } else {
        1.0 - f64::from_bits(0x0010_0000_0000_0000)
    };
    if negative {
        -y
    } else {
        y
    }
}

/// The complementary error function 1 - erf(x), to within about one ulp (no cancellation for
/// large x).
pub fn erfc(x: f64) -> f64 {
    let hi = (x.to_bits() >> 32) as u32;
    let negative = hi >> 31 != 0;
    let ix = hi & 0x7fff_ffff;
    if x.is_nan() {
        return x;
    }
    if ix < 0x3feb_0000 {
        // |x| < 0.84375
        if ix < 0x3c70_0000 {
            return 1.0 - x;
        }
        let y = erf_small_ratio(x);
        if negative || ix < 0x3fd0_0000 {
            return 1.0 - (x + x * y);
        }
        return 0.5 - (x - 0.5 + x * y);
    }
    let ax = x.abs();
    if ix < 0x3ff4_0000 {
        // 0.84375 <= |x| < 1.25
        let p = erf_near_one(ax);
        return if negative {
            1.0 + ERX + p
        } else {
            1.0 - ERX - p
        };
    }
    if ix < 0x403c_0000 {
        // 1.25 <= |x| < 28
        let t = erfc_tail(ax, ix);
        return if negative { 2.0 - t } else { t };
    }
    if negative {
        2.0
    } else {
        0.0
    }
}

/// An operand of a chunk kernel: a slice as long as the output chunk, or one broadcast value.
#[derive(Clone, Copy)]
enum Operand<'a, T> {
    Slice(&'a [T]),
    Scalar(T),
}

impl<T: Copy> Operand<'_, T> {
    #[inline(always)]
    fn get(&self, i: usize) -> T {
        match self {
            Operand::Slice(s) => s[i],
            Operand::Scalar(v) => *v,
        }
    }
}

/// `d[i] = f(a[i])`.
#[inline(always)]
fn map1<A: Copy, O>(a: Operand<'_, A>, d: &mut [O], f: impl Fn(A) -> O) {
    match a {
        Operand::Slice(a) => {
            for (o, &x) in d.iter_mut().zip(a) {
                *o = f(x);
            }
        }
        Operand::Scalar(x) => {
            for o in d.iter_mut() {
                *o = f(x);
            }
        }
    }
}

/// `d[i] = f(a[i], b[i])`, with loops specialized for scalar operands.
#[inline(always)]
fn map2<A: Copy, B: Copy, O>(
    a: Operand<'_, A>,
    b: Operand<'_, B>,
    d: &mut [O],
    f: impl Fn(A, B) -> O,
) {
    match (a, b) {
        (Operand::Slice(a), Operand::Slice(b)) => {
            for ((o, &x), &y) in d.iter_mut().zip(a).zip(b) {
                *o = f(x, y);
            }
        }
        (Operand::Slice(a), Operand::Scalar(y)) => {
            for (o, &x) in d.iter_mut().zip(a) {
                *o = f(x, y);
            }
        }
        (Operand::Scalar(x), Operand::Slice(b)) => {
            for (o, &y) in d.iter_mut().zip(b) {
                *o = f(x, y);
            }
        }
        (Operand::Scalar(x), Operand::Scalar(y)) => {
            for o in d.iter_mut() {
                *o = f(x, y);
            }
        }
    }
}

/// `d[i] = f(a[i], b[i], c[i])`.
#[inline(always)]
fn map3<A: Copy, B: Copy, C: Copy, O>(
    a: Operand<'_, A>,
    b: Operand<'_, B>,
    c: Operand<'_, C>,
    d: &mut [O],
    f: impl Fn(A, B, C) -> O,
) {
    if let (Operand::Slice(a), Operand::Slice(b), Operand::Slice(c)) = (a, b, c) {
        for (((o, &x), &y), &z) in d.iter_mut().zip(a).zip(b).zip(c) {
            *o = f(x, y, z);
        }
    } else {
        for (i, o) in d.iter_mut().enumerate() {
            *o = f(a.get(i), b.get(i), c.get(i));
        }
    }
}

/// A unary op over a chunk in a float compute type. Predicates (`not`, `isnan`...) yield 0/1.
fn unary_real<F: Real>(u: UnaryOp, x: Operand<'_, F>, d: &mut [F]) {
    if let Operand::Slice(xs) = x {
        if F::vector_unary(u, xs, d) {
            return;
        }
    }
    match u {
        UnaryOp::Neg => map1(x, d, |v: F| -v),
        UnaryOp::Abs => map1(x, d, F::abs),
        UnaryOp::Exp => map1(x, d, F::exp),
        UnaryOp::Log => map1(x, d, F::ln),
        UnaryOp::Sqrt => map1(x, d, F::sqrt),
        UnaryOp::Rsqrt => map1(x, d, |v: F| F::ONE / v.sqrt()),
        UnaryOp::Reciprocal => map1(x, d, |v: F| F::ONE / v),
        UnaryOp::Sin => map1(x, d, F::sin),
        UnaryOp::Cos => map1(x, d, F::cos),
        UnaryOp::Tanh => map1(x, d, F::tanh),
        UnaryOp::Sigmoid => map1(x, d, sigmoid),
        UnaryOp::Relu => map1(x, d, relu),
        UnaryOp::GeluErf => map1(x, d, gelu_erf),
        UnaryOp::GeluTanh => map1(x, d, gelu_tanh),
        UnaryOp::Silu => map1(x, d, silu),
        UnaryOp::Sign => map1(x, d, sign),
        UnaryOp::Floor => map1(x, d, F::floor),
        UnaryOp::Ceil => map1(x, d, F::ceil),
        UnaryOp::Round => map1(x, d, F::round_even),
        UnaryOp::Not => map1(x, d, |v: F| F::from_bool(v == F::ZERO)),
        UnaryOp::IsNan => map1(x, d, |v: F| F::from_bool(v.is_nan())),
        UnaryOp::IsInf => map1(x, d, |v: F| F::from_bool(v.is_infinite())),
        UnaryOp::IsFinite => map1(x, d, |v: F| F::from_bool(v.is_finite())),
        UnaryOp::Erf => map1(x, d, F::erf),
    }
}

/// A binary op over a chunk in a float compute type. Comparisons and logic yield 0/1.
fn binary_real<F: Real>(b: BinaryOp, x: Operand<'_, F>, y: Operand<'_, F>, d: &mut [F]) {
    match b {
        BinaryOp::Add => map2(x, y, d, |p: F, q: F| p + q),
        BinaryOp::Sub => map2(x, y, d, |p: F, q: F| p - q),
        BinaryOp::Mul => map2(x, y, d, |p: F, q: F| p * q),
        BinaryOp::Div => map2(x, y, d, |p: F, q: F| p / q),
        BinaryOp::Pow => map2(x, y, d, F::powf),
        BinaryOp::Maximum => map2(x, y, d, maximum),
        BinaryOp::Minimum => map2(x, y, d, minimum),
        BinaryOp::Eq => map2(x, y, d, |p: F, q: F| F::from_bool(p == q)),
        BinaryOp::Ne => map2(x, y, d, |p: F, q: F| F::from_bool(p != q)),
        BinaryOp::Lt => map2(x, y, d, |p: F, q: F| F::from_bool(p < q)),
        BinaryOp::Le => map2(x, y, d, |p: F, q: F| F::from_bool(p <= q)),
        BinaryOp::Gt => map2(x, y, d, |p: F, q: F| F::from_bool(p > q)),
        BinaryOp::Ge => map2(x, y, d, |p: F, q: F| F::from_bool(p >= q)),
        BinaryOp::And => map2(x, y, d, |p: F, q: F| {
            F::from_bool(p != F::ZERO && q != F::ZERO)
        }),
        BinaryOp::Or => map2(x, y, d, |p: F, q: F| {
            F::from_bool(p != F::ZERO || q != F::ZERO)
        }),
    }
}

/// A comparison over a chunk in a storage type (any dtype).
fn compare<T: PartialOrd + Copy>(
    b: BinaryOp,
    x: Operand<'_, T>,
    y: Operand<'_, T>,
    d: &mut [bool],
) {
    match b {
        BinaryOp::Eq => map2(x, y, d, |p: T, q: T| p == q),
        BinaryOp::Ne => map2(x, y, d, |p: T, q: T| p != q),
        BinaryOp::Lt => map2(x, y, d, |p: T, q: T| p < q),
        BinaryOp::Le => map2(x, y, d, |p: T, q: T| p <= q),
        BinaryOp::Gt => map2(x, y, d, |p: T, q: T| p > q),
        BinaryOp::Ge => map2(x, y, d, |p: T, q: T| p >= q),
        BinaryOp::Add
        | BinaryOp::Sub
        | BinaryOp::Mul
        | BinaryOp::Div
        | BinaryOp::Pow
        | BinaryOp::Maximum
        | BinaryOp::Minimum
        | BinaryOp::And
        | BinaryOp::Or => unreachable!("compare() only receives comparisons"),
    }
}

/// Integer arithmetic (wrapping; division by zero yields 0).
trait Int: Copy + Ord + Default + Send + Sync + 'static {
    fn wadd(self, o: Self) -> Self;
    fn wsub(self, o: Self) -> Self;
    fn wmul(self, o: Self) -> Self;
    fn div0(self, o: Self) -> Self;
    fn ipow(self, e: Self) -> Self;
    fn wneg(self) -> Self;
    fn wabs(self) -> Self;
    fn sign(self) -> Self;
    fn relu(self) -> Self;
}

macro_rules! int_impl {
    ($t:ty, signed: $signed:tt) => {
        impl Int for $t {
            #[inline(always)]
            fn wadd(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            #[inline(always)]
            fn wsub(self, o: Self) -> Self {
                self.wrapping_sub(o)
            }
            #[inline(always)]
            fn wmul(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            #[inline(always)]
            fn div0(self, o: Self) -> Self {
                if o == 0 {
                    0
                } else {
                    self.wrapping_div(o)
                }
            }
            fn ipow(self, e: Self) -> Self {
                if let Some(r) = int_impl!(@negpow $signed, self, e) {
                    return r;
                }
                let (mut base, mut e, mut acc): ($t, $t, $t) = (self, e, 1);
                while e > 0 {
                    if e & 1 == 1 {
                        acc = acc.wrapping_mul(base);
                    }
                    base = base.wrapping_mul(base);
                    e >>= 1;
                }
                acc
            }
            #[inline(always)]
            fn wneg(self) -> Self {
                self.wrapping_neg()
            }
            #[inline(always)]
            fn wabs(self) -> Self {
                int_impl!(@abs $signed, self)
            }
            #[inline(always)]
            fn sign(self) -> Self {
                int_impl!(@sign $signed, self)
            }
            #[inline(always)]
            fn relu(self) -> Self {
                self.max(0)
            }
        }
    };
    // A negative exponent: |base| > 1 gives a fraction that truncates to 0 (base 0 too).
    (@negpow true, $x:expr, $e:expr) => {
        if $e < 0 {
            Some(match $x {
                1 => 1,
                -1 => {
                    if $e & 1 == 0 {
                        1
                    } else {
                        -1
                    }
                }
                _ => 0,
            })
        } else {
            None
        }
    };
    (@negpow false, $x:expr, $e:expr) => {
        None
    };
    (@abs true, $x:expr) => {
        $x.wrapping_abs()
    };
    (@abs false, $x:expr) => {
        $x
    };
    (@sign true, $x:expr) => {
        $x.signum()
    };
    (@sign false, $x:expr) => {
        ($x > 0) as Self
    };
}
int_impl!(i32, signed: true);
int_impl!(i64, signed: true);
int_impl!(u8, signed: false);
int_impl!(i8, signed: true);
int_impl!(i16, signed: true);
int_impl!(u16, signed: false);
int_impl!(u32, signed: false);
int_impl!(u64, signed: false);

// ================================================================================================
// Loading operands and running chunks
// ================================================================================================

/// Conversion between a storage type and a compute type; `direct` borrows without copying when
/// they are the same type.
trait Conv<C>: Copy + Send + Sync + 'static {
    fn conv(self) -> C;
    fn back(c: C) -> Self;
    #[inline(always)]
    fn direct(_s: &[Self]) -> Option<&[C]> {
        None
    }
    #[inline(always)]
    fn direct_mut(_s: &mut [Self]) -> Option<&mut [C]> {
        None
    }
}

impl<T: Copy + Send + Sync + 'static> Conv<T> for T {
    #[inline(always)]
    fn conv(self) -> T {
        self
    }
    #[inline(always)]
    fn back(c: T) -> T {
        c
    }
    #[inline(always)]
    fn direct(s: &[T]) -> Option<&[T]> {
        Some(s)
    }
    #[inline(always)]
    fn direct_mut(s: &mut [T]) -> Option<&mut [T]> {
        Some(s)
    }
}

macro_rules! conv_half {
    ($($t:ty),*) => {$(
        impl Conv<f32> for $t {
            #[inline(always)]
            fn conv(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn back(c: f32) -> Self {
                <$t>::from_f32(c)
            }
        }
    )*};
}
conv_half!(f16, bf16);

/// How one input's elements map onto the output's (row-major) element order.
#[derive(Clone, Debug)]
enum Layout {
    /// One element, broadcast everywhere.
    Scalar,
    /// Same element order as the output.
    Contig,
    /// Broadcast: strides per output dim (0 on broadcast dims).
    Strided(Vec<usize>),
}

impl Layout {
    fn new(shape: &Shape, out: &Shape) -> Layout {
        let n = shape.numel();
        if n == 1 {
            Layout::Scalar
        } else if n == out.numel() {
            Layout::Contig
        } else {
            Layout::Strided(shape.broadcast_strides(out))
        }
    }
}

/// Writes `f(x)` for the output elements `start..start+len` of a broadcast input into `buf`.
fn gather_into<T: Copy, C: Copy>(
    data: &[T],
    layout: &Layout,
    dims: &[usize],
    start: usize,
    len: usize,
    f: impl Fn(T) -> C,
    buf: &mut Vec<C>,
) {
    buf.clear();
    match layout {
        Layout::Scalar => {
            let v = f(data[0]);
            buf.extend((0..len).map(|_| v));
        }
        Layout::Contig => buf.extend(data[start..start + len].iter().map(|&x| f(x))),
        Layout::Strided(strides) => {
            if len == 0 {
                return;
            }
            let r = dims.len();
            let mut idx = vec![0usize; r];
            let mut rem = start;
            for d in (0..r).rev() {
                idx[d] = rem % dims[d];
                rem /= dims[d];
            }
            let mut off: usize = idx.iter().zip(strides).map(|(i, s)| i * s).sum();
            let last = r - 1;
            let (dl, sl) = (dims[last], strides[last]);
            let mut remaining = len;
            loop {
                let run = (dl - idx[last]).min(remaining);
                if sl == 0 {
                    let v = data[off];
                    buf.extend((0..run).map(|_| f(v)));
                } else {
                    buf.extend((0..run).map(|k| f(data[off + k * sl])));
                }
                remaining -= run;
                if remaining == 0 {
                    break;
                }
                // The row is finished: step the outer dims.
                off -= idx[last] * sl;
                idx[last] = 0;
                let mut d = last;
                while d > 0 {
                    d -= 1;
                    idx[d] += 1;
                    off += strides[d];
                    if idx[d] < dims[d] {
                        break;
                    }
                    off -= dims[d] * strides[d];
                    idx[d] = 0;
                }
            }
        }
    }
}

/// A broadcast input of a tensor kernel: its storage and layout relative to the output.
struct Src<'a, T> {
    data: &'a [T],
    layout: Layout,
}

impl<'a, T: Copy> Src<'a, T> {
    fn new(data: &'a [T], shape: &Shape, out: &Shape) -> Self {
        Src {
            data,
            layout: Layout::new(shape, out),
        }
    }

    /// Output elements `start..start+len` as compute type `C`: borrowed when contiguous and of
    /// the compute type, a broadcast scalar, or gathered into `buf`.
    fn operand<'b, C: Copy>(
        &'b self,
        dims: &[usize],
        start: usize,
        len: usize,
        buf: &'b mut Vec<C>,
    ) -> Operand<'b, C>
    where
        T: Conv<C>,
    {
        match &self.layout {
            Layout::Scalar => Operand::Scalar(<T as Conv<C>>::conv(self.data[0])),
            Layout::Contig => match <T as Conv<C>>::direct(&self.data[start..start + len]) {
                Some(s) => Operand::Slice(s),
                None => {
                    gather_into(
                        self.data,
                        &self.layout,
                        dims,
                        start,
                        len,
                        <T as Conv<C>>::conv,
                        buf,
                    );
                    Operand::Slice(buf)
                }
            },
            Layout::Strided(_) => {
                gather_into(
                    self.data,
                    &self.layout,
                    dims,
                    start,
                    len,
                    <T as Conv<C>>::conv,
                    buf,
                );
                Operand::Slice(buf)
            }
        }
    }
}

/// Runs `body(scratch, start, out_chunk)` over chunks of `out`, across rayon for large tensors.
fn for_chunks<O: Send, S>(
    out: &mut [O],
    init: impl Fn() -> S + Sync + Send,
    body: impl Fn(&mut S, usize, &mut [O]) + Sync + Send,
) {
    if out.len() >= PAR_THRESHOLD {
        // A few tasks per thread, each a run of whole chunks with its own scratch state.
        let chunks = out.len().div_ceil(CHUNK);
        let tasks = (4 * crate::par::threads()).min(chunks);
        let per = chunks.div_ceil(tasks);
        let len = out.len();
        let out = crate::par::Disjoint::new(out);
        crate::par::for_each(chunks.div_ceil(per), |t| {
            let mut s = init();
            for i in t * per..((t + 1) * per).min(chunks) {
                let (lo, hi) = (i * CHUNK, ((i + 1) * CHUNK).min(len));
                // SAFETY: chunk `i` (elements `lo..hi`) belongs to task `t` alone.
                let c = unsafe { out.range(lo, hi) };
                body(&mut s, lo, c);
            }
        });
    } else {
        let mut s = init();
        for (i, c) in out.chunks_mut(CHUNK).enumerate() {
            body(&mut s, i * CHUNK, c);
        }
    }
}

/// Computes an output chunk in compute type `D`: directly into `dst` when it is of type `D`,
/// otherwise through `buf`, rounding once.
#[inline(always)]
fn store_with<O: Conv<D>, D: Copy + Default>(
    dst: &mut [O],
    buf: &mut Vec<D>,
    compute: impl FnOnce(&mut [D]),
) {
    match <O as Conv<D>>::direct_mut(dst) {
        Some(d) => compute(d),
        None => {
            buf.clear();
            buf.resize(dst.len(), D::default());
            compute(buf);
            for (o, &v) in dst.iter_mut().zip(buf.iter()) {
                *o = <O as Conv<D>>::back(v);
            }
        }
    }
}

/// A one-input kernel: storage `T` computed in `C`, result computed in `D` stored as `O`.
fn unary_tensor<T, C, O, D>(
    x: &[T],
    kernel: impl Fn(Operand<'_, C>, &mut [D]) + Sync + Send,
) -> Vec<O>
where
    T: Conv<C>,
    C: Copy + Send,
    O: Conv<D> + Default,
    D: Copy + Default + Send,
{
    let mut out = vec![O::default(); x.len()];
    for_chunks(
        &mut out,
        || (Vec::<C>::new(), Vec::<D>::new()),
        |(bi, bo), s, dst| {
            let src = &x[s..s + dst.len()];
            let xin: &[C] = match <T as Conv<C>>::direct(src) {
                Some(v) => v,
                None => {
                    bi.clear();
                    bi.extend(src.iter().map(|&v| <T as Conv<C>>::conv(v)));
                    bi
                }
            };
            store_with(dst, bo, |d| kernel(Operand::Slice(xin), d));
        },
    );
    out
}

/// A two-input broadcast kernel: storage `T` computed in `C`, result computed in `D` stored as `O`.
fn binary_tensor<T, C, O, D>(
    a: Src<'_, T>,
    b: Src<'_, T>,
    out_shape: &Shape,
    kernel: impl Fn(Operand<'_, C>, Operand<'_, C>, &mut [D]) + Sync + Send,
) -> Vec<O>
where
    T: Conv<C>,
    C: Copy + Send,
    O: Conv<D> + Default,
    D: Copy + Default + Send,
{
    let dims = out_shape.dims();
    let mut out = vec![O::default(); out_shape.numel()];
    for_chunks(
        &mut out,
        || (Vec::<C>::new(), Vec::<C>::new(), Vec::<D>::new()),
        |(ba, bb, bo), s, dst| {
            let len = dst.len();
            let oa = a.operand(dims, s, len, ba);
            let ob = b.operand(dims, s, len, bb);
            store_with(dst, bo, |d| kernel(oa, ob, d));
        },
    );
    out
}

// ================================================================================================
// CPU kernels
// ================================================================================================

/// CPU kernel of an elementwise op.
pub fn cpu(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let n = match op {
        Op::Unary(_) | Op::Cast { .. } => 1,
        Op::Binary(_) => 2,
        Op::Where => 3,
        Op::Fused(k) => k.n_inputs as usize,
        _ => {
            return Err(OpError::Runtime {
                op: op.name(),
                reason: "not an elementwise op".into(),
            })
        }
    };
    arity(op, &refs, n)?;
    let data = match op {
        Op::Unary(u) => unary_cpu(op, *u, inputs[0])?,
        Op::Binary(b) => binary_cpu(op, *b, inputs[0], inputs[1], &out.shape)?,
        Op::Where => where_cpu(op, inputs, &out.shape)?,
        Op::Cast { to } => cast_cpu(inputs[0], *to),
        Op::Fused(k) => fused_cpu(k, inputs, out),
        _ => unreachable!("checked above"),
    };
    HostTensor::from_data(data, out.shape.clone())
}

fn unsupported(op: &Op, inputs: &[&HostTensor]) -> OpError {
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    dtype_err(op, &refs, "unsupported dtype for this op")
}

fn unary_cpu(op: &Op, u: UnaryOp, x: &HostTensor) -> Result<Data> {
    if !unary_accepts(u, x.dtype()) {
        return Err(unsupported(op, &[x]));
    }
    if matches!(u, UnaryOp::IsNan | UnaryOp::IsInf | UnaryOp::IsFinite) {
        return Ok(Data::Bool(
            with_data!(x.data(), v => predicate_tensor(u, &v[..]).into()),
        ));
    }
    let kf32 = |a: Operand<'_, f32>, d: &mut [f32]| unary_real(u, a, d);
    Ok(match x.data() {
        Data::F32(v) => Data::F32(unary_tensor::<f32, f32, f32, f32>(v, kf32).into()),
        Data::F64(v) => {
            Data::F64(unary_tensor::<f64, f64, f64, f64>(v, |a, d| unary_real(u, a, d)).into())
        }
        Data::F16(v) => Data::F16(unary_tensor::<f16, f32, f16, f32>(v, kf32).into()),
        Data::BF16(v) => Data::BF16(unary_tensor::<bf16, f32, bf16, f32>(v, kf32).into()),
        Data::I32(v) => Data::I32(int_unary(u, v).into()),
        Data::I64(v) => Data::I64(int_unary(u, v).into()),
        Data::U8(v) => Data::U8(int_unary(u, v).into()),
        Data::I8(v) => Data::I8(int_unary(u, v).into()),
        Data::I16(v) => Data::I16(int_unary(u, v).into()),
        Data::U16(v) => Data::U16(int_unary(u, v).into()),
        Data::U32(v) => Data::U32(int_unary(u, v).into()),
        Data::U64(v) => Data::U64(int_unary(u, v).into()),
        Data::Bool(v) => Data::Bool(
            unary_tensor::<bool, bool, bool, bool>(v, |a, d| map1(a, d, |b: bool| !b)).into(),
        ),
    })
}

/// `isnan` / `isinf` / `isfinite` for any storage type (integers are always finite).
fn predicate_tensor<T: Element>(u: UnaryOp, v: &[T]) -> Vec<bool> {
    let k = |a: Operand<'_, T>, d: &mut [bool]| match u {
        UnaryOp::IsNan => map1(a, d, |x: T| x.to_f64().is_nan()),
        UnaryOp::IsInf => map1(a, d, |x: T| x.to_f64().is_infinite()),
        _ => map1(a, d, |x: T| x.to_f64().is_finite()),
    };
    unary_tensor::<T, T, bool, bool>(v, k)
}

/// Integer unary ops (the dtype was validated: neg/abs/sign/relu/floor/ceil/round).
fn int_unary<I: Int>(u: UnaryOp, v: &[I]) -> Vec<I> {
    let k = |a: Operand<'_, I>, d: &mut [I]| match u {
        UnaryOp::Neg => map1(a, d, I::wneg),
        UnaryOp::Abs => map1(a, d, I::wabs),
        UnaryOp::Sign => map1(a, d, I::sign),
        UnaryOp::Relu => map1(a, d, I::relu),
        // floor/ceil/round are the identity on integers
        _ => map1(a, d, |x: I| x),
    };
    unary_tensor::<I, I, I, I>(v, k)
}

fn binary_cpu(op: &Op, b: BinaryOp, x: &HostTensor, y: &HostTensor, out: &Shape) -> Result<Data> {
    if x.dtype() != y.dtype() || !binary_accepts(b, x.dtype()) {
        return Err(unsupported(op, &[x, y]));
    }
    let (xs, ys) = (x.shape(), y.shape());
    match b {
        BinaryOp::And | BinaryOp::Or => {
            let (p, q) = (x.as_slice::<bool>()?, y.as_slice::<bool>()?);
            let and = b == BinaryOp::And;
            let v = binary_tensor::<bool, bool, bool, bool>(
                Src::new(p, xs, out),
                Src::new(q, ys, out),
                out,
                |a, c, d| {
                    if and {
                        map2(a, c, d, |s: bool, t: bool| s && t)
                    } else {
                        map2(a, c, d, |s: bool, t: bool| s || t)
                    }
                },
            );
            return Ok(Data::Bool(v.into()));
        }
        _ if b.is_predicate() => {
            return Ok(Data::Bool(
                with_data!(x.data(), v => compare_tensor(b, &v[..], xs, y, out)?.into()),
            ));
        }
        _ => {}
    }
    let kf32 = |p: Operand<'_, f32>, q: Operand<'_, f32>, d: &mut [f32]| binary_real(b, p, q, d);
    Ok(match x.data() {
        Data::F32(v) => Data::F32(
            (binary_tensor::<f32, f32, f32, f32>(
                Src::new(v, xs, out),
                Src::new(y.as_slice()?, ys, out),
                out,
                kf32,
            ))
            .into(),
        ),
        Data::F64(v) => Data::F64(
            (binary_tensor::<f64, f64, f64, f64>(
                Src::new(v, xs, out),
                Src::new(y.as_slice()?, ys, out),
                out,
                |p, q, d| binary_real(b, p, q, d),
            ))
            .into(),
        ),
        Data::F16(v) => Data::F16(
            (binary_tensor::<f16, f32, f16, f32>(
                Src::new(v, xs, out),
                Src::new(y.as_slice()?, ys, out),
                out,
                kf32,
            ))
            .into(),
        ),
        Data::BF16(v) => Data::BF16(
            (binary_tensor::<bf16, f32, bf16, f32>(
                Src::new(v, xs, out),
                Src::new(y.as_slice()?, ys, out),
                out,
                kf32,
            ))
            .into(),
        ),
        Data::I32(v) => Data::I32(
            int_binary(
                b,
                Src::new(v, xs, out),
                Src::new(y.as_slice()?, ys, out),
                out,
            )
            .into(),
        ),
        Data::I64(v) => Data::I64(
            int_binary(
                b,
                Src::new(v, xs, out),
                Src::new(y.as_slice()?, ys, out),
                out,
            )
            .into(),
        ),
        Data::U8(v) => Data::U8(
            int_binary(
                b,
                Src::new(v, xs, out),
                Src::new(y.as_slice()?, ys, out),
                out,
            )
            .into(),
        ),
        Data::I8(v) => Data::I8(
            int_binary(
                b,
                Src::new(v, xs, out),
                Src::new(y.as_slice()?, ys, out),
                out,
            )
            .into(),
        ),
        Data::I16(v) => Data::I16(
            int_binary(
                b,
                Src::new(v, xs, out),
                Src::new(y.as_slice()?, ys, out),
                out,
            )
            .into(),
        ),
        Data::U16(v) => Data::U16(
            int_binary(
                b,
                Src::new(v, xs, out),
                Src::new(y.as_slice()?, ys, out),
                out,
            )
            .into(),
        ),
        Data::U32(v) => Data::U32(
            int_binary(
                b,
                Src::new(v, xs, out),
                Src::new(y.as_slice()?, ys, out),
                out,
            )
            .into(),
        ),
        Data::U64(v) => Data::U64(
            int_binary(
                b,
                Src::new(v, xs, out),
                Src::new(y.as_slice()?, ys, out),
                out,
            )
            .into(),
        ),
        Data::Bool(_) => return Err(unsupported(op, &[x, y])),
    })
}

fn compare_tensor<T: HostElement>(
    b: BinaryOp,
    v: &[T],
    xs: &Shape,
    y: &HostTensor,
    out: &Shape,
) -> Result<Vec<bool>> {
    let w = y.as_slice::<T>()?;
    Ok(binary_tensor::<T, T, bool, bool>(
        Src::new(v, xs, out),
        Src::new(w, y.shape(), out),
        out,
        |p, q, d| compare(b, p, q, d),
    ))
}

/// Integer arithmetic (the op was validated to be arithmetic).
fn int_binary<I: Int>(b: BinaryOp, x: Src<'_, I>, y: Src<'_, I>, out: &Shape) -> Vec<I> {
    binary_tensor::<I, I, I, I>(x, y, out, |p, q, d| match b {
        BinaryOp::Add => map2(p, q, d, I::wadd),
        BinaryOp::Sub => map2(p, q, d, I::wsub),
        BinaryOp::Mul => map2(p, q, d, I::wmul),
        BinaryOp::Div => map2(p, q, d, I::div0),
        BinaryOp::Pow => map2(p, q, d, I::ipow),
        BinaryOp::Maximum => map2(p, q, d, std::cmp::max),
        BinaryOp::Minimum => map2(p, q, d, std::cmp::min),
        BinaryOp::Eq
        | BinaryOp::Ne
        | BinaryOp::Lt
        | BinaryOp::Le
        | BinaryOp::Gt
        | BinaryOp::Ge
        | BinaryOp::And
        | BinaryOp::Or => unreachable!("predicates use the comparison kernel"),
    })
}

fn where_cpu(op: &Op, inputs: &[&HostTensor], out: &Shape) -> Result<Data> {
    let (c, a, b) = (inputs[0], inputs[1], inputs[2]);
    if c.dtype() != DType::Bool || a.dtype() != b.dtype() {
        return Err(unsupported(op, inputs));
    }
    let cond = Src::new(c.as_slice::<bool>()?, c.shape(), out);
    Ok(
        with_data!(a.data(), v => HostElement::wrap(where_tensor(&cond, Src::new(&v[..], a.shape(), out), b, out)?)),
    )
}

fn where_tensor<T: HostElement>(
    cond: &Src<'_, bool>,
    a: Src<'_, T>,
    b: &HostTensor,
    out: &Shape,
) -> Result<Vec<T>> {
    let b = Src::new(b.as_slice::<T>()?, b.shape(), out);
    let dims = out.dims();
    let mut o = vec![T::default(); out.numel()];
    for_chunks(
        &mut o,
        || (Vec::<bool>::new(), Vec::<T>::new(), Vec::<T>::new()),
        |(bc, ba, bb), s, dst| {
            let len = dst.len();
            let oc = cond.operand(dims, s, len, bc);
            let oa = a.operand(dims, s, len, ba);
            let ob = b.operand(dims, s, len, bb);
            map3(oc, oa, ob, dst, |c: bool, x: T, y: T| if c { x } else { y });
        },
    );
    Ok(o)
}

// ---- cast ----

/// A source element widened losslessly (floats to f64, integers and bool to i128).
enum Wide {
    F(f64),
    I(i128),
}

/// Casting with Rust `as` semantics between every pair of dtypes.
trait CastElem: Element {
    fn wide(self) -> Wide;
    fn from_float(v: f64) -> Self;
    fn from_int(v: i128) -> Self;
    #[inline(always)]
    fn cast_from<S: CastElem>(s: S) -> Self {
        match s.wide() {
            Wide::F(f) => Self::from_float(f),
            Wide::I(i) => Self::from_int(i),
        }
    }
}

/// Rounds f64 to f32 with round-to-odd, so that a second rounding to f16/bf16 is correct.
fn f64_to_f32_odd(x: f64) -> f32 {
    let f = x as f32;
    if !x.is_finite() || f.is_infinite() || f as f64 == x || f.to_bits() & 1 == 1 {
        return f;
    }
    // Inexact with an even last bit: step one ulp toward x (in magnitude).
    let bits = f.to_bits();
    let toward = if (f as f64).abs() > x.abs() {
        bits - 1
    } else {
        bits + 1
    };
    f32::from_bits(toward)
}

/// An integer as an f32 that rounds correctly to f16/bf16 (sticky bit kept below 24 bits).
fn int_to_f32_sticky(v: i128) -> f32 {
    let m = v.unsigned_abs();
    let bits = 128 - m.leading_zeros();
    let r = if bits <= 24 {
        m as f32
    } else {
        let shift = bits - 24;
        let kept = (m >> shift) | ((m & ((1u128 << shift) - 1)) != 0) as u128;
        kept as f32 * (shift as f32).exp2()
    };
    if v < 0 {
        -r
    } else {
        r
    }
}

/// f64 to f16, rounded once to nearest even.
fn f64_to_f16(x: f64) -> f16 {
    f16::from_f32(f64_to_f32_odd(x))
}

/// f64 to bf16, rounded once to nearest even.
fn f64_to_bf16(x: f64) -> bf16 {
    bf16::from_f32(f64_to_f32_odd(x))
}

macro_rules! cast_float {
    ($t:ty, $from_f:expr, $from_i:expr) => {
        impl CastElem for $t {
            #[inline(always)]
            fn wide(self) -> Wide {
                Wide::F(Element::to_f64(self))
            }
            #[inline(always)]
            fn from_float(v: f64) -> Self {
                $from_f(v)
            }
            #[inline(always)]
            fn from_int(v: i128) -> Self {
                $from_i(v)
            }
        }
    };
}
cast_float!(f32, |v: f64| v as f32, |v: i128| v as f32);
cast_float!(f64, |v: f64| v, |v: i128| v as f64);
cast_float!(f16, f64_to_f16, |v: i128| f16::from_f32(int_to_f32_sticky(
    v
)));
cast_float!(bf16, f64_to_bf16, |v: i128| bf16::from_f32(
    int_to_f32_sticky(v)
));

macro_rules! cast_int {
    ($($t:ty),*) => {$(
        impl CastElem for $t {
            #[inline(always)]
            fn wide(self) -> Wide {
                Wide::I(self as i128)
            }
            #[inline(always)]
            fn from_float(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn from_int(v: i128) -> Self {
                v as $t
            }
        }
    )*};
}
cast_int!(i32, i64, u8, i8, i16, u16, u32, u64);

impl CastElem for bool {
    #[inline(always)]
    fn wide(self) -> Wide {
        Wide::I(self as i128)
    }
    #[inline(always)]
    fn from_float(v: f64) -> Self {
        v != 0.0
    }
    #[inline(always)]
    fn from_int(v: i128) -> Self {
        v != 0
    }
}

fn cast_vec<S: CastElem, D: CastElem>(src: &[S]) -> Vec<D> {
    let mut out = vec![D::default(); src.len()];
    for_chunks(
        &mut out,
        || (),
        |_, s, dst| {
            for (o, &x) in dst.iter_mut().zip(&src[s..]) {
                *o = D::cast_from(x);
            }
        },
    );
    out
}

/// The `cast` kernel: `x`'s elements converted to `to`.
pub(crate) fn cast_cpu(x: &HostTensor, to: DType) -> Data {
    if x.dtype() == to {
        return x.data().clone();
    }
    with_data!(x.data(), v => with_dtype!(to, D => <D as HostElement>::wrap(cast_vec::<_, D>(&v[..]))))
}

// ---- fused kernels ----

/// A value of a fused kernel: a constant for the whole kernel, or a per-chunk buffer.
#[derive(Clone, Copy)]
enum Slot<C> {
    Const(C),
    Buf,
}

/// Cast semantics in a float compute type: the value a `cast` to `to` produces, represented in `C`.
fn cast_real<F: Real>(from: DType, to: DType, x: Operand<'_, F>, d: &mut [F]) {
    let int_src = !from.is_float();
    // To an integer: an integer source wraps (through i128, which holds every integer value), a
    // float source truncates and saturates.
    macro_rules! int_cast {
        ($t:ty) => {
            if int_src {
                map1(x, d, |v: F| F::lit(v.to_f64() as i128 as $t as f64))
            } else {
                map1(x, d, |v: F| F::lit(v.to_f64() as $t as f64))
            }
        };
    }
    match to {
        DType::F32 => map1(x, d, |v: F| F::lit(v.to_f64() as f32 as f64)),
        DType::F64 => map1(x, d, |v: F| v),
        DType::F16 => map1(x, d, |v: F| F::lit(f64_to_f16(v.to_f64()).to_f64())),
        DType::BF16 => map1(x, d, |v: F| F::lit(f64_to_bf16(v.to_f64()).to_f64())),
        DType::Bool => map1(x, d, |v: F| F::from_bool(v != F::ZERO)),
        DType::I8 => int_cast!(i8),
        DType::I16 => int_cast!(i16),
        DType::I32 => int_cast!(i32),
        DType::I64 => int_cast!(i64),
        DType::U8 => int_cast!(u8),
        DType::U16 => int_cast!(u16),
        DType::U32 => int_cast!(u32),
        DType::U64 => int_cast!(u64),
    }
}

/// Brings integer results computed in floats back to integer semantics: truncation toward zero,
/// 0 for non-finite results (division by zero), wrapping for the integers narrower than 64 bits.
fn fix_int<F: Real>(dtype: DType, d: &mut [F]) {
    let bits = 8 * dtype.size_bytes() as i32;
    let signed = dtype.is_signed_int();
    let fix = |v: F| -> F {
        let t = v.to_f64().trunc();
        let t = if t.is_finite() { t } else { 0.0 };
        F::lit(if bits < 64 {
            let m = 2f64.powi(bits);
            let w = t.rem_euclid(m);
            if signed && w >= m / 2.0 {
                w - m
            } else {
                w
            }
        } else {
            t
        })
    };
    for v in d.iter_mut() {
        *v = fix(*v);
    }
}

/// Evaluates one fused instruction over a chunk.
fn eval_instr<F: Real>(
    op: &Op,
    dtype: DType,
    arg0_dtype: DType,
    args: &[Operand<'_, F>],
    d: &mut [F],
) {
    match op {
        Op::Unary(u) => unary_real(*u, args[0], d),
        Op::Binary(b) => binary_real(*b, args[0], args[1], d),
        Op::Where => map3(args[0], args[1], args[2], d, |c: F, a: F, b: F| {
            if c != F::ZERO {
                a
            } else {
                b
            }
        }),
        Op::Cast { to } => cast_real(arg0_dtype, *to, args[0], d),
        Op::Full { value, .. } => {
            let v = with_dtype!(dtype, T => Element::to_f64(<T as Element>::from_f64(value.get())));
            d.fill(F::lit(v));
        }
        _ => unreachable!("fused instructions are validated by inference"),
    }
    if dtype.is_int() && matches!(op, Op::Unary(_) | Op::Binary(_)) {
        fix_int(dtype, d);
    }
}

/// Evaluates a fused kernel. Instructions compute in f64 when the output, an input or an
/// instruction is f64, otherwise in f32. Bool and integer intermediates are held in that compute
/// type (exact while |v| < 2^24 in f32, 2^53 in f64); integer results are brought back to integer
/// semantics after each instruction (truncation, wrapping for u8/i32, 0 for division by zero), as
/// unfused. f16/bf16 intermediates are not rounded between instructions: only explicit casts and
/// the final store round.
fn fused_cpu(k: &FusedKernel, inputs: &[&HostTensor], out: &TensorType) -> Data {
    let wide = out.dtype == DType::F64
        || k.instrs.iter().any(|i| i.dtype == DType::F64)
        || inputs.iter().any(|t| t.dtype() == DType::F64);
    if wide {
        fused_run::<f64>(k, inputs, out)
    } else {
        fused_run::<f32>(k, inputs, out)
    }
}

/// A fused kernel prepared to run in compute type `C` over ranges of its output's elements: the
/// inputs' broadcast layouts, and every value (input or instruction) either a constant — an
/// input of one element, or an instruction whose arguments all are, folded here once — or a
/// buffer the range computes.
struct FusedEval<'a, C> {
    k: &'a FusedKernel,
    inputs: &'a [&'a HostTensor],
    dims: &'a [usize],
    layouts: Vec<Layout>,
    slots: Vec<Slot<C>>,
    dtypes: Vec<DType>,
}

impl<'a, C: Real> FusedEval<'a, C> {
    fn new(k: &'a FusedKernel, inputs: &'a [&'a HostTensor], out: &'a TensorType) -> Self {
        let layouts: Vec<Layout> = inputs
            .iter()
            .map(|t| Layout::new(t.shape(), &out.shape))
            .collect();
        let mut slots: Vec<Slot<C>> = layouts
            .iter()
            .zip(inputs)
            .map(|(l, t)| match l {
                Layout::Scalar => Slot::Const(with_data!(t.data(), v => C::load(v[0]))),
                _ => Slot::Buf,
            })
            .collect();
        let mut dtypes: Vec<DType> = inputs.iter().map(|t| t.dtype()).collect();
        for ins in &k.instrs {
            let consts: Option<Vec<C>> = ins
                .args
                .iter()
                .map(|&a| match slots[a as usize] {
                    Slot::Const(c) => Some(c),
                    Slot::Buf => None,
                })
                .collect();
            let slot = match consts {
                Some(cs) => {
                    let args: Vec<Operand<'_, C>> = cs.into_iter().map(Operand::Scalar).collect();
                    let a0 = ins.args.first().map_or(ins.dtype, |&a| dtypes[a as usize]);
                    let mut r = [C::ZERO];
                    eval_instr(&ins.op, ins.dtype, a0, &args, &mut r);
                    Slot::Const(r[0])
                }
                None => Slot::Buf,
            };
            slots.push(slot);
            dtypes.push(ins.dtype);
        }
        FusedEval {
            k,
            inputs,
            dims: out.shape.dims(),
            layouts,
            slots,
            dtypes,
        }
    }

    /// The result's value when it is a constant.
    fn constant(&self) -> Option<C> {
        match self.slots[self.slots.len() - 1] {
            Slot::Const(c) => Some(c),
            Slot::Buf => None,
        }
    }

    /// Scratch buffers for [`FusedEval::range`], one per value.
    fn scratch(&self) -> Vec<Vec<C>> {
        vec![Vec::with_capacity(CHUNK); self.slots.len()]
    }

    /// Output elements `s..s + dst.len()` into `dst`, each rounded once to `T`: loads each
    /// broadcast input, runs each instruction as one tight loop over the range, stores the last.
    fn range<T: Element>(&self, bufs: &mut [Vec<C>], s: usize, dst: &mut [T]) {
        let (len, n_in, slots) = (dst.len(), self.inputs.len(), &self.slots);
        for i in 0..n_in {
            if let Slot::Buf = slots[i] {
                with_data!(self.inputs[i].data(), v => gather_into(v, &self.layouts[i], self.dims, s, len, C::load, &mut bufs[i]));
            }
        }
        for (j, ins) in self.k.instrs.iter().enumerate() {
            let id = n_in + j;
            if let Slot::Const(_) = slots[id] {
                continue;
            }
            let (before, rest) = bufs.split_at_mut(id);
            let d = &mut rest[0];
            d.clear();
            d.resize(len, C::ZERO);
            let args: Vec<Operand<'_, C>> = ins
                .args
                .iter()
                .map(|&a| match slots[a as usize] {
                    Slot::Const(c) => Operand::Scalar(c),
                    Slot::Buf => Operand::Slice(&before[a as usize][..len]),
                })
                .collect();
            let a0 = ins
                .args
                .first()
                .map_or(ins.dtype, |&a| self.dtypes[a as usize]);
            eval_instr(&ins.op, ins.dtype, a0, &args, d);
        }
        for (o, &c) in dst.iter_mut().zip(&bufs[slots.len() - 1]) {
            *o = c.store::<T>();
        }
    }
}

/// Runs a fused kernel in compute type `C` ([`FusedEval`]), in parallel chunks.
fn fused_run<C: Real>(k: &FusedKernel, inputs: &[&HostTensor], out: &TensorType) -> Data {
    let eval = FusedEval::<C>::new(k, inputs, out);
    let n = out.shape.numel();
    with_dtype!(out.dtype, T => {
        let mut o = vec![<T as Default>::default(); n];
        match eval.constant() {
            Some(c) => o.fill(c.store::<T>()),
            None => for_chunks(&mut o, || eval.scratch(), |bufs, s, dst| eval.range(bufs, s, dst)),
        }
        <T as HostElement>::wrap(o)
    })
}

/// An f32 fused kernel (every input, instruction and the result f32) evaluated over ranges of
/// its output: `f(start, dst)` fills elements `start..start + dst.len()`, as the whole kernel
/// would. `None` for other kernels. For callers that consume the result in blocks (the fused
/// row kernels' prologues) without materializing it.
pub fn fused_f32_ranges<'a>(
    k: &'a FusedKernel,
    inputs: &'a [&'a HostTensor],
    out: &'a TensorType,
) -> Option<impl Fn(usize, &mut [f32]) + Sync + 'a> {
    let all_f32 = out.dtype == DType::F32
        && k.instrs.iter().all(|i| i.dtype == DType::F32)
        && inputs.iter().all(|t| t.dtype() == DType::F32);
    if !all_f32 {
        return None;
    }
    let eval = FusedEval::<f32>::new(k, inputs, out);
    Some(move |s: usize, dst: &mut [f32]| {
        if let Some(c) = eval.constant() {
            dst.fill(c);
            return;
        }
        let mut bufs = eval.scratch();
        for (i, c) in dst.chunks_mut(CHUNK).enumerate() {
            eval.range(&mut bufs, s + i * CHUNK, c);
        }
    })
}

// ================================================================================================
// Gradient rules
// ================================================================================================

/// Gradient rule of an elementwise op. Integer and bool inputs get `None`; broadcasting is undone
/// with `sum_to`. `maximum`/`minimum` split the gradient evenly (0.5 each) on ties.
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    let op = cx.op;
    match op {
        Op::Unary(u) => unary_vjp(cx, *u),
        Op::Binary(b) => binary_vjp(cx, *b),
        Op::Where => {
            let (c, a, b) = (cx.inputs[0], cx.inputs[1], cx.inputs[2]);
            let (at, bt) = (cx.ty(a), cx.ty(b));
            if !at.dtype.is_float() {
                return Ok(vec![None, None, None]);
            }
            let g = cx.grad;
            let zero = cx.scalar(0.0, at.dtype)?;
            let ga = cx.emit(Op::Where, &[c, g, zero])?;
            let gb = cx.emit(Op::Where, &[c, zero, g])?;
            let ga = cx.sum_to(ga, &at.shape)?;
            let gb = cx.sum_to(gb, &bt.shape)?;
            Ok(vec![None, Some(ga), Some(gb)])
        }
        Op::Cast { to } => {
            let x = cx.inputs[0];
            let xt = cx.ty(x);
            if !xt.dtype.is_float() || !to.is_float() {
                return Ok(vec![None]);
            }
            let g = cx.grad;
            Ok(vec![Some(cx.cast(g, xt.dtype)?)])
        }
        Op::Fused(_) => Err(cx.not_differentiable(
            0,
            "fused kernels are built after differentiation; differentiate the unfused graph",
        )),
        _ => Err(OpError::Runtime {
            op: op.name(),
            reason: "not an elementwise op".into(),
        }),
    }
}

fn unary_vjp(cx: &mut VjpCtx<'_>, u: UnaryOp) -> Result<Vec<Option<Value>>> {
    let (x, y, g) = (cx.inputs[0], cx.output, cx.grad);
    let xt = cx.ty(x);
    let dt = xt.dtype;
    if !dt.is_float() {
        return Ok(vec![None]);
    }
    let gx = match u {
        UnaryOp::Neg => cx.unary(UnaryOp::Neg, g)?,
        UnaryOp::Abs => {
            let s = cx.unary(UnaryOp::Sign, x)?;
            cx.mul(g, s)?
        }
        UnaryOp::Exp => cx.mul(g, y)?,
        UnaryOp::Log => cx.div(g, x)?,
        UnaryOp::Sqrt => {
            let y2 = cx.mul_scalar(y, 2.0)?;
            cx.div(g, y2)?
        }
        UnaryOp::Rsqrt => {
            let y2 = cx.mul(y, y)?;
            let y3 = cx.mul(y2, y)?;
            let t = cx.mul_scalar(y3, -0.5)?;
            cx.mul(g, t)?
        }
        UnaryOp::Reciprocal => {
            let y2 = cx.mul(y, y)?;
            let t = cx.mul_scalar(y2, -1.0)?;
            cx.mul(g, t)?
        }
        UnaryOp::Sin => {
            let c = cx.unary(UnaryOp::Cos, x)?;
            cx.mul(g, c)?
        }
        UnaryOp::Cos => {
            let s = cx.unary(UnaryOp::Sin, x)?;
            let t = cx.mul(g, s)?;
            cx.unary(UnaryOp::Neg, t)?
        }
        UnaryOp::Tanh => {
            let y2 = cx.mul(y, y)?;
            let one = cx.scalar(1.0, dt)?;
            let t = cx.sub(one, y2)?;
            cx.mul(g, t)?
        }
        UnaryOp::Sigmoid => {
            let one = cx.scalar(1.0, dt)?;
            let t = cx.sub(one, y)?;
            let t = cx.mul(y, t)?;
            cx.mul(g, t)?
        }
        UnaryOp::Relu => {
            let zero = cx.scalar(0.0, dt)?;
            let pos = cx.binary(BinaryOp::Gt, x, zero)?;
            cx.emit(Op::Where, &[pos, g, zero])?
        }
        UnaryOp::GeluErf => {
            // d/dx x·Φ(x) = Φ(x) + x·φ(x); Φ(x) = gelu(x)/x (0.5 at x = 0).
            let zero = cx.scalar(0.0, dt)?;
            let one = cx.scalar(1.0, dt)?;
            let half = cx.scalar(0.5, dt)?;
            let is0 = cx.binary(BinaryOp::Eq, x, zero)?;
            let xs = cx.emit(Op::Where, &[is0, one, x])?;
            let ratio = cx.div(y, xs)?;
            let cdf = cx.emit(Op::Where, &[is0, half, ratio])?;
            let x2 = cx.mul(x, x)?;
            let e = cx.mul_scalar(x2, -0.5)?;
            let e = cx.unary(UnaryOp::Exp, e)?;
            let pdf = cx.mul_scalar(e, 1.0 / (2.0 * std::f64::consts::PI).sqrt())?;
            let xp = cx.mul(x, pdf)?;
            let d = cx.add(cdf, xp)?;
            cx.mul(g, d)?
        }
        UnaryOp::GeluTanh => {
            // y = 0.5x(1+t), t = tanh(k(x + c·x³));
            // y' = 0.5(1+t) + 0.5x(1-t²)·k(1 + 3c·x²)
            let one = cx.scalar(1.0, dt)?;
            let x2 = cx.mul(x, x)?;
            let cx2 = cx.mul_scalar(x2, GELU_TANH_C)?;
            let inner = cx.add(one, cx2)?;
            let u0 = cx.mul(x, inner)?;
            let uu = cx.mul_scalar(u0, SQRT_2_OVER_PI)?;
            let t = cx.unary(UnaryOp::Tanh, uu)?;
            let a = cx.add(one, t)?;
            let a = cx.mul_scalar(a, 0.5)?;
            let t2 = cx.mul(t, t)?;
            let sech2 = cx.sub(one, t2)?;
            let p = cx.mul_scalar(x2, 3.0 * GELU_TANH_C)?;
            let p = cx.add(one, p)?;
            let b = cx.mul(x, sech2)?;
            let b = cx.mul(b, p)?;
            let b = cx.mul_scalar(b, 0.5 * SQRT_2_OVER_PI)?;
            let d = cx.add(a, b)?;
            cx.mul(g, d)?
        }
        UnaryOp::Silu => {
            // d/dx x·s(x) = s(1 + x(1-s))
            let s = cx.unary(UnaryOp::Sigmoid, x)?;
            let one = cx.scalar(1.0, dt)?;
            let t = cx.sub(one, s)?;
            let t = cx.mul(x, t)?;
            let t = cx.add(one, t)?;
            let d = cx.mul(s, t)?;
            cx.mul(g, d)?
        }
        UnaryOp::Erf => {
            // d/dx erf x = 2/√π · e^(−x²)
            let x2 = cx.mul(x, x)?;
            let n = cx.unary(UnaryOp::Neg, x2)?;
            let e = cx.unary(UnaryOp::Exp, n)?;
            let d = cx.mul_scalar(e, std::f64::consts::FRAC_2_SQRT_PI)?;
            cx.mul(g, d)?
        }
        UnaryOp::Sign | UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round => cx.emit(
            Op::Full {
                value: F64Bits::new(0.0),
                ty: xt,
            },
            &[],
        )?,
        UnaryOp::Not | UnaryOp::IsNan | UnaryOp::IsInf | UnaryOp::IsFinite => {
            return Ok(vec![None])
        }
    };
    Ok(vec![Some(gx)])
}

fn binary_vjp(cx: &mut VjpCtx<'_>, op: BinaryOp) -> Result<Vec<Option<Value>>> {
    let (a, b, y, g) = (cx.inputs[0], cx.inputs[1], cx.output, cx.grad);
    let (at, bt) = (cx.ty(a), cx.ty(b));
    let dt = at.dtype;
    if !dt.is_float() || op.is_predicate() {
        return Ok(vec![None, None]);
    }
    let (ga, gb) = match op {
        BinaryOp::Add => (g, g),
        BinaryOp::Sub => (g, cx.unary(UnaryOp::Neg, g)?),
        BinaryOp::Mul => (cx.mul(g, b)?, cx.mul(g, a)?),
        BinaryOp::Div => {
            // d/da = g/b; d/db = -g·a/b² = -(g/b)·y
            let ga = cx.div(g, b)?;
            let t = cx.mul(ga, y)?;
            (ga, cx.unary(UnaryOp::Neg, t)?)
        }
        BinaryOp::Pow => {
            // d/da = g·b·a^(b-1) (0 where b = 0); d/db = g·a^b·ln a (0 where a = 0 and b >= 0)
            let zero = cx.scalar(0.0, dt)?;
            let one = cx.scalar(1.0, dt)?;
            let bm1 = cx.sub(b, one)?;
            let p = cx.binary(BinaryOp::Pow, a, bm1)?;
            let t = cx.mul(b, p)?;
            let ga = cx.mul(g, t)?;
            let b0 = cx.binary(BinaryOp::Eq, b, zero)?;
            let ga = cx.emit(Op::Where, &[b0, zero, ga])?;
            let la = cx.unary(UnaryOp::Log, a)?;
            let t = cx.mul(y, la)?;
            let gb = cx.mul(g, t)?;
            let a0 = cx.binary(BinaryOp::Eq, a, zero)?;
            let bnn = cx.binary(BinaryOp::Ge, b, zero)?;
            let m = cx.binary(BinaryOp::And, a0, bnn)?;
            let gb = cx.emit(Op::Where, &[m, zero, gb])?;
            (ga, gb)
        }
        BinaryOp::Maximum | BinaryOp::Minimum => {
            let (win_a, win_b) = if op == BinaryOp::Maximum {
                (BinaryOp::Gt, BinaryOp::Lt)
            } else {
                (BinaryOp::Lt, BinaryOp::Gt)
            };
            let tie = cx.binary(BinaryOp::Eq, a, b)?;
            let tie = cx.cast(tie, dt)?;
            let tie = cx.mul_scalar(tie, 0.5)?;
            let wa = cx.binary(win_a, a, b)?;
            let wa = cx.cast(wa, dt)?;
            let wa = cx.add(wa, tie)?;
            let wb = cx.binary(win_b, a, b)?;
            let wb = cx.cast(wb, dt)?;
            let wb = cx.add(wb, tie)?;
            (cx.mul(g, wa)?, cx.mul(g, wb)?)
        }
        BinaryOp::Eq
        | BinaryOp::Ne
        | BinaryOp::Lt
        | BinaryOp::Le
        | BinaryOp::Gt
        | BinaryOp::Ge
        | BinaryOp::And
        | BinaryOp::Or => return Ok(vec![None, None]),
    };
    let ga = cx.sum_to(ga, &at.shape)?;
    let gb = cx.sum_to(gb, &bt.shape)?;
    Ok(vec![Some(ga), Some(gb)])
}
