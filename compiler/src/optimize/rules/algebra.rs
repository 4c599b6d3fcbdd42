//! Algebraic identities, constant canonicalization and folding, composition of movement ops and
//! casts. Identities that drop an operation require the result to keep the operand's type (an
//! identity that would undo a broadcast, such as `x[3] * ones[2,3]`, does not apply).
//!
//! Domains: every rule here keeps the value of its left side for every input, NaN, ±∞, ±0 and
//! negatives included (up to rounding where an op is replaced by another, such as `x·x·x =>
//! x^3`), which `tests/rules_values.rs` checks on edge values. Where an identity holds only on
//! part of the domain, a guard restricts it:
//! - `x + 0 => x` is wrong for x = −0 (−0 + +0 = +0), so it applies to the constant −0 (and to
//!   integers); `x − 0 => x` applies to +0 (x − (−0) = x + 0).
//! - `exp(log x) => x` is wrong for x < 0 (NaN) and x = −0 (gives +0), so it applies only where x
//!   is known non-negative and never −0 (an `exp`, `sigmoid`, `softmax` or `abs`).
//! - `log(exp x) => x` is not a rule: `exp` overflows (x ≳ 88 in f32, 11 in f16) and underflows
//!   to 0 (log gives −∞), and −0 comes back as +0, so the two sides differ on every dtype.
//! - There is no `x·0 => 0` (∞·0 and NaN·0 are NaN), `x − x => 0` or `x / x => 1`.

use super::{build, build_with, rule, rule_if, rule_if_const, Ctx, Rw, ARITH_BINARY, FLOAT_UNARY};
use egg::Id;
use rustytorch_ops::{eval_cpu, DType, F64Bits, HostTensor, Op, Shape, TensorType, UnaryOp};

/// Whether `to` represents every value of `from` exactly (a cast `from -> to` loses nothing).
pub fn lossless(from: DType, to: DType) -> bool {
    use DType::*;
    from == to
        || matches!(
            (from, to),
            (F16, F32)
                | (F16, F64)
                | (BF16, F32)
                | (BF16, F64)
                | (F32, F64)
                | (I32, I64)
                | (I32, F64)
                | (U8, I32)
                | (U8, I64)
                | (U8, F16)
                | (U8, BF16)
                | (U8, F32)
                | (U8, F64)
                | (Bool, _)
        )
}

fn keeps_type(cx: &Ctx<'_>, v: &str) -> bool {
    cx.ty(v).is_some() && cx.ty(v) == cx.root_ty()
}

fn is_const(cx: &Ctx<'_>, v: &str) -> bool {
    cx.konst(v).is_some()
}

/// Whether `v` is the constant zero that leaves every `x` unchanged under `x + c` (`negative`:
/// −0) or `x − c` (+0); for integer types any zero.
fn zero_with_sign(cx: &Ctx<'_>, v: &str, negative: bool) -> bool {
    let Some(c) = cx.konst(v) else { return false };
    let float = cx.ty(v).is_some_and(|t| t.dtype.is_float());
    c == 0.0 && (!float || c.is_sign_negative() == negative)
}

/// Whether every value of `v`'s class is known to be NaN or >= +0 (never −0): the class holds an
/// `exp`, `sigmoid`, `abs` or `softmax`, or a constant of that kind.
fn non_negative(cx: &Ctx<'_>, v: &str) -> bool {
    if let Some(c) = cx.konst(v) {
        return c.is_nan() || (c >= 0.0 && c.is_sign_positive());
    }
    cx.eg[cx.id(v)].nodes.iter().any(|n| {
        matches!(
            n.op,
            Op::Unary(UnaryOp::Exp | UnaryOp::Sigmoid | UnaryOp::Abs) | Op::Softmax { .. }
        )
    })
}

/// Folds an elementwise op over rank-0 float constants with the CPU kernel (exact kernel
/// semantics, rounding included).
fn fold(cx: &mut Ctx<'_>, vars: &[&str]) -> Option<Id> {
    let op = cx.top().clone();
    let mut ins = Vec::new();
    for v in vars {
        let ty = cx.ty(v)?.clone();
        if ty.shape.rank() != 0 || !ty.dtype.is_float() {
            return None;
        }
        ins.push(HostTensor::full(&ty, cx.konst(v)?));
    }
    let refs: Vec<&HostTensor> = ins.iter().collect();
    let out = eval_cpu(&op, &refs).ok()?;
    let value = *out.to_f64_vec().first()?;
    let ty = out.ty();
    cx.add(
        Op::Full {
            value: F64Bits::new(value),
            ty,
        },
        &[],
    )
}

/// The algebra rules.
pub fn rules() -> Vec<Rw> {
    let mut r = vec![
        // x * 1 == x.
        rule_if_const("mul-one", "(mul ?x ?c)", &["?c"], "?x", |cx| {
            cx.konst("?c") == Some(1.0) && keeps_type(cx, "?x")
        }),
        // x + (−0) == x (and x + 0 for integers; x + (+0) is +0 for x = −0).
        rule_if_const("add-zero", "(add ?x ?c)", &["?c"], "?x", |cx| {
            zero_with_sign(cx, "?c", true) && keeps_type(cx, "?x")
        }),
        // x − (+0) == x (and x − 0 for integers; x − (−0) is +0 for x = −0).
        rule_if_const("sub-zero", "(sub ?x ?c)", &["?c"], "?x", |cx| {
            zero_with_sign(cx, "?c", false) && keeps_type(cx, "?x")
        }),
        // x / 1 == x.
        rule_if_const("div-one", "(div ?x ?c)", &["?c"], "?x", |cx| {
            cx.konst("?c") == Some(1.0) && keeps_type(cx, "?x")
        }),
        // --x == x.
        rule("neg-neg", "(neg (neg ?x))", "?x"),
        // exp(log x) == x where x is known non-negative and not −0 (see the module docs).
        rule_if("exp-log", "(exp (log ?x))", "?x", |cx| {
            non_negative(cx, "?x")
        }),
        // c * x == x * c for a constant c (constants go right; not blanket commutativity).
        rule_if_const(
            "mul-const-right",
            "(mul ?c ?x)",
            &["?c"],
            "(mul ?x ?c)",
            |cx| is_const(cx, "?c") && !is_const(cx, "?x"),
        ),
        // c + x == x + c for a constant c.
        rule_if_const(
            "add-const-right",
            "(add ?c ?x)",
            &["?c"],
            "(add ?x ?c)",
            |cx| is_const(cx, "?c") && !is_const(cx, "?x"),
        ),
        // x*x*x == x^3 (one kernel instead of two).
        build("cube-to-pow", "(mul (mul ?x ?x) ?x)", cube),
        // x*(x*x) == x^3.
        build("cube-to-pow-rev", "(mul ?x (mul ?x ?x))", cube),
        // permute(permute(x, p), q) == permute(x, p∘q), or x when that is the identity.
        build("permute-compose", "(permute* (permute* ?x))", |cx| {
            let (Op::Permute { perm: outer }, Some(Op::Permute { perm: inner })) =
                (cx.top(), cx.op("permute"))
            else {
                return None;
            };
            let p: Vec<usize> = outer.iter().map(|&i| inner[i]).collect();
            if p.iter().enumerate().all(|(i, &d)| i == d) {
                Some(cx.id("?x"))
            } else {
                let x = cx.id("?x");
                cx.add(Op::Permute { perm: p }, &[x])
            }
        }),
        // reshape(reshape(x)) == reshape(x), or x when the shapes agree.
        build("reshape-compose", "(reshape* (reshape* ?x))", |cx| {
            let shape = cx.root_ty()?.shape.clone();
            let x = cx.id("?x");
            if cx.ty("?x")?.shape == shape {
                Some(x)
            } else {
                cx.add(Op::Reshape { shape }, &[x])
            }
        }),
        // cast(x) to x's own dtype == x.
        build("cast-identity", "(cast* ?x)", |cx| {
            let Op::Cast { to } = cx.top() else {
                return None;
            };
            (cx.ty("?x")?.dtype == *to).then(|| cx.id("?x"))
        }),
        // cast_b(cast_a(x)) == cast_b(x) when x -> a is lossless (f16 -> f32 -> f64 ...), and == x
        // when b is x's dtype.
        build("cast-cast-lossless", "(cast* (cast* ?x))", |cx| {
            let (Op::Cast { to: outer }, Some(Op::Cast { to: inner })) =
                (cx.top().clone(), cx.op("cast").cloned())
            else {
                return None;
            };
            let from = cx.ty("?x")?.dtype;
            if !lossless(from, inner) {
                return None;
            }
            let x = cx.id("?x");
            if outer == from {
                Some(x)
            } else {
                cx.add(Op::Cast { to: outer }, &[x])
            }
        }),
    ];
    for name in FLOAT_UNARY {
        // op(c) == the folded constant, for a rank-0 float constant c.
        r.push(build_with(
            format!("fold-{name}"),
            &format!("({name} ?a)"),
            &["?a"],
            |cx| fold(cx, &["?a"]),
        ));
    }
    for name in ARITH_BINARY {
        // c1 op c2 == the folded constant, for rank-0 float constants.
        r.push(build_with(
            format!("fold-{name}"),
            &format!("({name} ?a ?b)"),
            &["?a", "?b"],
            |cx| fold(cx, &["?a", "?b"]),
        ));
    }
    r
}

fn cube(cx: &mut Ctx<'_>) -> Option<Id> {
    let ty = cx.ty("?x")?.clone();
    if !ty.dtype.is_float() {
        return None;
    }
    let three = cx.add(
        Op::Full {
            value: F64Bits::new(3.0),
            ty: TensorType::new(ty.dtype, Shape::scalar()),
        },
        &[],
    )?;
    let x = cx.id("?x");
    cx.add(Op::Binary(rustytorch_ops::BinaryOp::Pow), &[x, three])
}
