//! Recognition of library ops spelled in primitives. Each rule adds the library op to the class of
//! the spelled value through [`Ctx::fuse`], which records the intermediate values it absorbs; the
//! extractor picks it when it is cheaper and never when an absorbed value is used elsewhere.
//!
//! Spellings recognized (after `mul-const-right`/`add-const-right` moved constants right;
//! constants are matched within a tolerance, never bit for bit):
//! - GELU, tanh form: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` with `x³` as `pow(x, 3)`,
//!   `x·x·x` or `x·(x·x)`, the 0.5 applied first or last, either order of the inner sum
//!   → `gelu_tanh`.
//! - GELU, erf form: `0.5·x·(1 + erf(x·(1/√2)))` or `erf(x / √2)`, with the same outer orders
//!   → `gelu`.
//! - SiLU: `x·sigmoid(x)`, `sigmoid(x)·x`, `x / (1 + exp(-x))` → `silu`.
//! - Softmax over any single axis (reductions with `keep_dims`):
//!   `exp(x − max x) / Σ exp(x − max x)`, the same with `· (1/Σ)`, and `exp x / Σ exp x`
//!   → `softmax`; log-softmax: `(x − max x) − log Σ exp(x − max x)`, `x − log Σ exp x` and
//!   `log(softmax x)` → `log_softmax`.
//! - LayerNorm over the last axis: `xc = x − mean x`, variance `mean(xc·xc)` or `mean(xc^2)`,
//!   normalized `xc·rsqrt(var + eps)`, `rsqrt(var + eps)·xc` or `xc / sqrt(var + eps)`
//!   → `layer_norm`; then `·w + b`, `·w`, `w·`, `+ b` fold into its weight and bias.
//! - RMSNorm over the last axis: `x·rsqrt(mean(x·x) + eps)` (also `mean(x^2)`, the factors
//!   swapped, and `x / sqrt(...)`) → `rms_norm`; then `·w` or `w·` fold into its weight.
//! - Matmul epilogues: `matmul(a, b) + bias` and `bias + matmul(a, b)` with a 1-D bias over the
//!   last dim → `matmul_epilogue[bias]`; then `relu`, `gelu` or `gelu_tanh` of that (or of a
//!   plain matmul) → `matmul_epilogue[act=...]`. The transposes of backward graphs (`a·gᵀ`,
//!   `aᵀ·g`) are folded into matmul flags by the layout rules and carried over.
//! - Convolution activations: `relu`, `gelu` or `gelu_tanh` of a convolution without one (with
//!   or without its bias, any layout) → `conv[..., act=...]`; the convolution's own result must
//!   have no other user (the extractor's check of absorbed values).
//! - Matmul through an activation's derivative: `matmul(a, b) · gelu_tanh'(x)`, with the
//!   derivative spelled as the tanh GELU's gradient rule spells it —
//!   `½(1 + t) + x·(1 − t²)·(1 + 3c·x²)·½k`, `t = tanh(x·(1 + c·x²)·k)`, `c = 0.044715`,
//!   `k = √(2/π)` — and the matmul on either side of the product, where `x` has the product's
//!   shape → `matmul_act_grad[act=gelu_tanh](a, b, x)` (the MLP backward `(dy·W2ᵀ) ⊙ gelu'(h)`,
//!   which cuBLASLt runs as one `DGELU` call). Only the tanh GELU has this rule: it is the one
//!   activation whose derivative cuBLASLt applies from the pre-activation (`DRELU` reads a bit
//!   mask the forward would have to write; the erf GELU's derivative is not cuBLASLt's), and
//!   elsewhere the fusion pass already makes the derivative one kernel after the GEMM. A GELU
//!   spelled in primitives (as GPT-2's reference code does) is differentiated primitive by
//!   primitive, so its gradient is a sum over the four uses of `x`, not this product, and is not
//!   recognized.
//! - Attention over `[B,H,S,D]` operands: `matmul(softmax_last(M(S)), v)` with the scores `S`
//!   one of `matmul(q, kᵀ)·c`, `matmul(q, kᵀ) / c`, `matmul(q, kᵀ)` (so `scale` = c, 1/c, 1) and
//!   `M` one of: nothing; `+ mask` (an additive mask of q's dtype → `mask=additive`);
//!   `where(keep, S, fill)` or `where(drop, fill, S)` with `fill` ≤ −1e4 (−∞ included) and a
//!   causal `keep` (→ `causal=top_left`): `iota(rows) >= iota(cols)`, `iota(cols) <= iota(rows)`
//!   (`drop`: `iota(rows) < iota(cols)`, `iota(cols) > iota(rows)`) over the scores' last two
//!   dims, or a bool graph constant that is lower-triangular (`drop`: strictly upper-triangular,
//!   as `torch.triu(ones, 1)` exported to ONNX spells it). A causal top-left mask never masks a
//!   whole row, so the fused op computes exactly the spelled values; with an additive mask that is
//!   −∞ over a whole row the spelled form gives NaN where the fused op gives zeros.

use super::{build, last_axis_keep, single_axis_keep, Ctx, Rw};
use egg::Id;
use rustytorch_ops::{
    Activation, AttnLayout, AttnMask, BinaryOp, Causal, DType, F64Bits, Op, UnaryOp,
};

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// Relative tolerance of matched multiplicative and additive constants (traced constants are
/// rounded to their dtype); exponents are matched exactly.
const RTOL: f64 = 1e-3;

fn is_float(cx: &Ctx<'_>, v: &str) -> bool {
    cx.ty(v).is_some_and(|t| t.dtype.is_float())
}

fn gelu_tanh(cx: &mut Ctx<'_>) -> Option<Id> {
    let ok = is_float(cx, "?x")
        && cx.scalar_near("?half", 0.5, RTOL)
        && cx.scalar_near("?one", 1.0, RTOL)
        && cx.scalar("?three") == Some(3.0)
        && cx.scalar_near("?k", 0.044715, RTOL)
        && cx.scalar_near("?c", SQRT_2_OVER_PI, RTOL);
    if !ok {
        return None;
    }
    let x = cx.id("?x");
    cx.fuse(Op::Unary(UnaryOp::GeluTanh), &[x])
}

/// `0.5·x·(1 + erf(x·?c))` with `?c` near `c` (1/√2 for a product, √2 for a quotient).
fn gelu_erf(cx: &mut Ctx<'_>, c: f64) -> Option<Id> {
    let ok = is_float(cx, "?x")
        && cx.scalar_near("?half", 0.5, RTOL)
        && cx.scalar_near("?one", 1.0, RTOL)
        && cx.scalar_near("?c", c, RTOL);
    if !ok {
        return None;
    }
    let x = cx.id("?x");
    cx.fuse(Op::Unary(UnaryOp::GeluErf), &[x])
}

fn unary(cx: &mut Ctx<'_>, u: UnaryOp, check_one: bool) -> Option<Id> {
    if !is_float(cx, "?x") || (check_one && !cx.scalar_near("?one", 1.0, RTOL)) {
        return None;
    }
    let x = cx.id("?x");
    cx.fuse(Op::Unary(u), &[x])
}

/// The common axis of every matched reduction of the given names (each single-axis, keep_dims).
fn common_axis(cx: &Ctx<'_>, names: &[&str]) -> Option<usize> {
    let mut axis = None;
    for n in names {
        for op in cx.ops(n) {
            let a = single_axis_keep(op)?;
            if axis.is_some_and(|b| b != a) {
                return None;
            }
            axis = Some(a);
        }
    }
    axis
}

fn softmax(cx: &mut Ctx<'_>, log: bool) -> Option<Id> {
    let axis = common_axis(cx, &["reduce_max", "reduce_sum"])?;
    if !is_float(cx, "?x") {
        return None;
    }
    let x = cx.id("?x");
    let op = if log {
        Op::LogSoftmax { axis }
    } else {
        Op::Softmax { axis }
    };
    cx.fuse(op, &[x])
}

/// Whether every matched `reduce_mean` reduces exactly the last axis of `?x` with keep_dims.
fn means_over_last(cx: &Ctx<'_>) -> bool {
    let r = cx.rank("?x");
    cx.ops("reduce_mean")
        .into_iter()
        .all(|op| last_axis_keep(op, r).is_some())
        && cx.op("reduce_mean").is_some()
}

fn eps_of(cx: &Ctx<'_>) -> Option<F64Bits> {
    let e = cx.scalar("?eps")?;
    (e >= 0.0 && e.is_finite()).then(|| F64Bits::new(e))
}

fn norm_core(cx: &mut Ctx<'_>, layer: bool) -> Option<Id> {
    if !means_over_last(cx) || !is_float(cx, "?x") {
        return None;
    }
    // Exponents are matched exactly (2 and 3 are exact in every float dtype): `pow(x, 2.001)` is
    // NaN for negative x, which a norm would hide.
    if !cx.ops("pow").is_empty() && cx.scalar("?two") != Some(2.0) {
        return None;
    }
    let eps = eps_of(cx)?;
    let x = cx.id("?x");
    let op = if layer {
        Op::LayerNorm {
            eps,
            weight: false,
            bias: false,
        }
    } else {
        Op::RmsNorm { eps, weight: false }
    };
    cx.fuse(op, &[x])
}

fn norm_affine(cx: &mut Ctx<'_>, weight: bool, bias: bool) -> Option<Id> {
    let x = cx.id("?x");
    let mut ins = vec![x];
    if weight {
        ins.push(cx.id("?w"));
    }
    if bias {
        ins.push(cx.id("?b"));
    }
    let op = match cx.top_norm()? {
        Op::LayerNorm {
            eps,
            weight: false,
            bias: false,
        } => Op::LayerNorm { eps, weight, bias },
        Op::RmsNorm { eps, weight: false } if !bias => Op::RmsNorm { eps, weight },
        _ => return None,
    };
    cx.fuse(op, &ins)
}

impl Ctx<'_> {
    /// The matched plain norm (`layer_norm*` / `rms_norm*` node) of an affine rule.
    fn top_norm(&self) -> Option<Op> {
        self.op("layer_norm")
            .or_else(|| self.op("rms_norm"))
            .cloned()
    }
}

fn matmul_bias(cx: &mut Ctx<'_>) -> Option<Id> {
    let Op::Matmul { trans_a, trans_b } = *cx.op("matmul")? else {
        return None;
    };
    let (a, b, c) = (cx.id("?a"), cx.id("?b"), cx.id("?bias"));
    let op = Op::MatmulEpilogue {
        trans_a,
        trans_b,
        bias: true,
        act: Activation::None,
        accumulate: false,
    };
    cx.fuse(op, &[a, b, c])
}

fn epilogue_act(cx: &mut Ctx<'_>, act: Activation) -> Option<Id> {
    let inner = cx
        .op("matmul_epilogue")
        .or_else(|| cx.op("matmul"))?
        .clone();
    let (a, b) = (cx.id("?a"), cx.id("?b"));
    let (op, ins) = match inner {
        Op::Matmul { trans_a, trans_b } => (
            Op::MatmulEpilogue {
                trans_a,
                trans_b,
                bias: false,
                act,
                accumulate: false,
            },
            vec![a, b],
        ),
        Op::MatmulEpilogue {
            trans_a,
            trans_b,
            bias: true,
            act: Activation::None,
            accumulate: false,
        } => (
            Op::MatmulEpilogue {
                trans_a,
                trans_b,
                bias: true,
                act,
                accumulate: false,
            },
            vec![a, b, cx.id("?c")],
        ),
        _ => return None,
    };
    cx.fuse(op, &ins)
}

/// `act(conv(x, w[, b]))` → `conv[act](x, w[, b])` for a convolution without an activation.
fn conv_act(cx: &mut Ctx<'_>, act: Activation) -> Option<Id> {
    let Op::Conv {
        geom,
        groups,
        bias,
        act: Activation::None,
    } = cx.op("conv")?.clone()
    else {
        return None;
    };
    let mut ins = vec![cx.id("?x"), cx.id("?w")];
    if bias {
        ins.push(cx.id("?b"));
    }
    let op = Op::Conv {
        geom,
        groups,
        bias,
        act,
    };
    cx.fuse(op, &ins)
}

/// Relative tolerance of the derivative's constants for values of `dtype` (bf16 rounds them to
/// 8 significant bits).
fn rtol_for(dtype: DType) -> f64 {
    if dtype == DType::BF16 {
        4e-3
    } else {
        RTOL
    }
}

/// `matmul(a, b) · gelu_tanh'(x)` with the derivative's constants checked.
fn matmul_dgelu_tanh(cx: &mut Ctx<'_>) -> Option<Id> {
    let Op::Matmul { trans_a, trans_b } = *cx.op("matmul")? else {
        return None;
    };
    let xt = cx.ty("?x")?;
    if !xt.dtype.is_float() || Some(xt) != cx.root_ty() {
        return None;
    }
    let tol = rtol_for(xt.dtype);
    let c = 0.044715;
    let ones = ["?one1", "?one2", "?one3", "?one4"];
    let ok = ones.iter().all(|v| cx.scalar_near(v, 1.0, tol))
        && cx.scalar_near("?c", c, tol)
        && cx.scalar_near("?c3", 3.0 * c, tol)
        && cx.scalar_near("?k", SQRT_2_OVER_PI, tol)
        && cx.scalar_near("?half", 0.5, tol)
        && cx.scalar_near("?halfk", 0.5 * SQRT_2_OVER_PI, tol);
    if !ok {
        return None;
    }
    let op = Op::MatmulActGrad {
        trans_a,
        trans_b,
        act: Activation::GeluTanh,
    };
    let ins = [cx.id("?a"), cx.id("?b"), cx.id("?x")];
    cx.fuse(op, &ins)
}

/// The rank of the iota in class `c` counting along `axis` of a rank-`rank` tensor.
fn has_iota(cx: &Ctx<'_>, c: Id, axis: usize, rank: usize) -> bool {
    cx.eg[c]
        .nodes
        .iter()
        .any(|n| matches!(&n.op, Op::Iota { axis: a, ty } if *a == axis && ty.shape.rank() == rank))
}

/// Whether variable `v` is a causal mask over scores with `sq` rows and `sk` columns: `keep` (true
/// where column <= row) or, with `keep == false`, its complement (true where column > row).
fn causal_mask(cx: &Ctx<'_>, v: &str, keep: bool, sq: usize, sk: usize) -> bool {
    let Some(t) = cx.ty(v) else { return false };
    let r = t.shape.rank();
    if t.dtype != DType::Bool || r < 2 || t.shape.dims()[r - 2..] != [sq, sk] {
        return false;
    }
    let id = cx.id(v);
    cx.eg[id].nodes.iter().any(|n| match &n.op {
        Op::Constant { index, .. } => {
            let set = if keep {
                &cx.eg.analysis.causal_constants
            } else {
                &cx.eg.analysis.causal_drop_constants
            };
            set.contains(index)
        }
        Op::Binary(b) => {
            let (l, rr) = (n.children[0], n.children[1]);
            let row = |c| has_iota(cx, c, r - 2, r);
            let col = |c| has_iota(cx, c, r - 1, r);
            match (keep, b) {
                (true, BinaryOp::Ge) | (false, BinaryOp::Lt) => row(l) && col(rr),
                (true, BinaryOp::Le) | (false, BinaryOp::Gt) => col(l) && row(rr),
                _ => false,
            }
        }
        _ => false,
    })
}

#[derive(Clone, Copy)]
enum Scale {
    Mul,
    Div,
    One,
}

#[derive(Clone, Copy)]
enum Mask {
    None,
    Add,
    Keep,
    Drop,
}

fn attention(cx: &mut Ctx<'_>, scale: Scale, mask: Mask) -> Option<Id> {
    // Post-order: the scores matmul(q, k) comes before the output matmul(p, v).
    let mm: Vec<Op> = cx.ops("matmul").into_iter().cloned().collect();
    let [inner, outer] = <[Op; 2]>::try_from(mm).ok()?;
    if inner
        != (Op::Matmul {
            trans_a: false,
            trans_b: true,
        })
        || outer
            != (Op::Matmul {
                trans_a: false,
                trans_b: false,
            })
    {
        return None;
    }
    if cx.rank("?q") != 4 || cx.op("softmax")? != &(Op::Softmax { axis: 3 }) {
        return None;
    }
    let s = match scale {
        Scale::Mul => cx.scalar("?scale")?,
        Scale::Div => 1.0 / cx.scalar("?scale")?,
        Scale::One => 1.0,
    };
    if !s.is_finite() || s == 0.0 {
        return None;
    }
    let (sq, sk) = (cx.ty("?q")?.shape.dims()[2], cx.ty("?k")?.shape.dims()[2]);
    let fill_ok = |cx: &Ctx<'_>| cx.konst("?fill").is_some_and(|f| f <= -1e4);
    let (q, k, v) = (cx.id("?q"), cx.id("?k"), cx.id("?v"));
    let (causal, kind, ins) = match mask {
        Mask::None => (Causal::None, AttnMask::None, vec![q, k, v]),
        Mask::Add => (
            Causal::None,
            AttnMask::Additive,
            vec![q, k, v, cx.id("?mask")],
        ),
        Mask::Keep if fill_ok(cx) && causal_mask(cx, "?keep", true, sq, sk) => {
            (Causal::TopLeft, AttnMask::None, vec![q, k, v])
        }
        Mask::Drop if fill_ok(cx) && causal_mask(cx, "?drop", false, sq, sk) => {
            (Causal::TopLeft, AttnMask::None, vec![q, k, v])
        }
        _ => return None,
    };
    let op = Op::Attention {
        causal,
        mask: kind,
        scale: F64Bits::new(s),
        layout: AttnLayout::Bhsd,
    };
    cx.fuse(op, &ins)
}

/// The recognition rules.
pub fn rules() -> Vec<Rw> {
    let mut r = Vec::new();

    // GELU (tanh form).
    let inners = [
        ("sum-x-first", "(mul (add ?x (mul (pow ?x ?three) ?k)) ?c)"),
        ("sum-x-last", "(mul (add (mul (pow ?x ?three) ?k) ?x) ?c)"),
    ];
    let outers = [
        ("half-first", "(mul (mul ?x ?half) (add (tanh INNER) ?one))"),
        ("half-last", "(mul (mul ?x (add (tanh INNER) ?one)) ?half)"),
        ("half-inner", "(mul ?x (mul (add (tanh INNER) ?one) ?half))"),
        ("tanh-first", "(mul (add (tanh INNER) ?one) (mul ?x ?half))"),
    ];
    for (on, o) in outers {
        for (inn, i) in inners {
            // 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) == gelu_tanh(x).
            r.push(build(
                format!("gelu-tanh/{on}/{inn}"),
                &o.replace("INNER", i),
                gelu_tanh,
            ));
        }
    }

    // GELU (erf form): the same outer orders around `erf(x·(1/√2))` or `erf(x / √2)`.
    let erf_inners = [
        ("mul", "(mul ?x ?c)", std::f64::consts::FRAC_1_SQRT_2),
        ("div", "(div ?x ?c)", std::f64::consts::SQRT_2),
    ];
    for (on, o) in outers {
        for (inn, i, c) in erf_inners {
            // 0.5·x·(1 + erf(x/√2)) == gelu(x).
            r.push(build(
                format!("gelu-erf/{on}/{inn}"),
                &o.replace("tanh INNER", &format!("erf {i}")),
                move |cx| gelu_erf(cx, c),
            ));
        }
    }

    // SiLU.
    r.push(build("silu", "(mul ?x (sigmoid ?x))", |cx| {
        unary(cx, UnaryOp::Silu, false)
    }));
    r.push(build("silu-rev", "(mul (sigmoid ?x) ?x)", |cx| {
        unary(cx, UnaryOp::Silu, false)
    }));
    r.push(build(
        "silu-div",
        "(div ?x (add (exp (neg ?x)) ?one))",
        |cx| unary(cx, UnaryOp::Silu, true),
    ));

    // Softmax and log-softmax.
    let e = "(exp (sub ?x (reduce_max* ?x)))";
    r.push(build(
        "softmax",
        &format!("(div {e} (reduce_sum* {e}))"),
        |cx| softmax(cx, false),
    ));
    r.push(build(
        "softmax-recip",
        &format!("(mul {e} (reciprocal (reduce_sum* {e})))"),
        |cx| softmax(cx, false),
    ));
    r.push(build(
        "softmax-no-max",
        "(div (exp ?x) (reduce_sum* (exp ?x)))",
        |cx| softmax(cx, false),
    ));
    r.push(build(
        "log-softmax",
        &format!("(sub (sub ?x (reduce_max* ?x)) (log (reduce_sum* {e})))"),
        |cx| softmax(cx, true),
    ));
    r.push(build(
        "log-softmax-no-max",
        "(sub ?x (log (reduce_sum* (exp ?x))))",
        |cx| softmax(cx, true),
    ));
    r.push(build("log-of-softmax", "(log (softmax* ?x))", |cx| {
        let Op::Softmax { axis } = *cx.op("softmax")? else {
            return None;
        };
        let x = cx.id("?x");
        cx.fuse(Op::LogSoftmax { axis }, &[x])
    }));

    // LayerNorm and RMSNorm.
    let xc = "(sub ?x (reduce_mean* ?x))";
    let vars = [
        (
            "sq-mul",
            format!("(reduce_mean* (mul {xc} {xc}))"),
            "(reduce_mean* (mul ?x ?x))",
        ),
        (
            "sq-pow",
            format!("(reduce_mean* (pow {xc} ?two))"),
            "(reduce_mean* (pow ?x ?two))",
        ),
    ];
    for (vn, ln_var, rms_var) in &vars {
        let forms = [
            ("mul-rsqrt", "(mul X (rsqrt (add VAR ?eps)))"),
            ("rsqrt-mul", "(mul (rsqrt (add VAR ?eps)) X)"),
            ("div-sqrt", "(div X (sqrt (add VAR ?eps)))"),
        ];
        for (fname, f) in forms {
            // (x − mean x)·rsqrt(mean((x − mean x)²) + eps) == layer_norm(x).
            let ln = f.replace("VAR", ln_var).replace('X', xc);
            r.push(build(format!("layer-norm/{vn}/{fname}"), &ln, |cx| {
                norm_core(cx, true)
            }));
            // x·rsqrt(mean(x²) + eps) == rms_norm(x).
            let rms = f.replace("VAR", rms_var).replace('X', "?x");
            r.push(build(format!("rms-norm/{vn}/{fname}"), &rms, |cx| {
                norm_core(cx, false)
            }));
        }
    }
    r.push(build(
        "layer-norm-affine",
        "(add (mul (layer_norm* ?x) ?w) ?b)",
        |cx| norm_affine(cx, true, true),
    ));
    r.push(build(
        "layer-norm-weight",
        "(mul (layer_norm* ?x) ?w)",
        |cx| norm_affine(cx, true, false),
    ));
    r.push(build(
        "layer-norm-weight-rev",
        "(mul ?w (layer_norm* ?x))",
        |cx| norm_affine(cx, true, false),
    ));
    r.push(build(
        "layer-norm-bias",
        "(add (layer_norm* ?x) ?b)",
        |cx| norm_affine(cx, false, true),
    ));
    r.push(build(
        "layer-norm-weight-bias",
        "(add (layer_norm* ?x ?w) ?b)",
        |cx| {
            let Op::LayerNorm {
                eps,
                weight: true,
                bias: false,
            } = *cx.op("layer_norm")?
            else {
                return None;
            };
            let ins = [cx.id("?x"), cx.id("?w"), cx.id("?b")];
            cx.fuse(
                Op::LayerNorm {
                    eps,
                    weight: true,
                    bias: true,
                },
                &ins,
            )
        },
    ));
    r.push(build("rms-norm-weight", "(mul (rms_norm* ?x) ?w)", |cx| {
        norm_affine(cx, true, false)
    }));
    r.push(build(
        "rms-norm-weight-rev",
        "(mul ?w (rms_norm* ?x))",
        |cx| norm_affine(cx, true, false),
    ));

    // Matmul epilogues.
    r.push(build(
        "matmul-bias",
        "(add (matmul* ?a ?b) ?bias)",
        matmul_bias,
    ));
    r.push(build(
        "matmul-bias-rev",
        "(add ?bias (matmul* ?a ?b))",
        matmul_bias,
    ));
    for (name, act) in [
        ("relu", Activation::Relu),
        ("gelu", Activation::GeluErf),
        ("gelu_tanh", Activation::GeluTanh),
    ] {
        // act(matmul(a, b) + bias) == matmul_epilogue[bias, act](a, b, bias).
        r.push(build(
            format!("epilogue-bias-{name}"),
            &format!("({name} (matmul_epilogue* ?a ?b ?c))"),
            move |cx| epilogue_act(cx, act),
        ));
        // act(matmul(a, b)) == matmul_epilogue[act](a, b).
        r.push(build(
            format!("epilogue-{name}"),
            &format!("({name} (matmul* ?a ?b))"),
            move |cx| epilogue_act(cx, act),
        ));
    }

    // Convolution activations.
    for (name, act) in [
        ("relu", Activation::Relu),
        ("gelu", Activation::GeluErf),
        ("gelu_tanh", Activation::GeluTanh),
    ] {
        // act(conv[bias](x, w, b)) == conv[bias, act](x, w, b).
        r.push(build(
            format!("conv-bias-{name}"),
            &format!("({name} (conv* ?x ?w ?b))"),
            move |cx| conv_act(cx, act),
        ));
        // act(conv(x, w)) == conv[act](x, w).
        r.push(build(
            format!("conv-{name}"),
            &format!("({name} (conv* ?x ?w))"),
            move |cx| conv_act(cx, act),
        ));
    }

    // Matmul through the tanh GELU's derivative, as its gradient rule spells it (constants right).
    let t = "(tanh (mul (mul ?x (add (mul (mul ?x ?x) ?c) ?one1)) ?k))";
    let d = format!(
        "(add (mul (add {t} ?one2) ?half) \
         (mul (mul (mul ?x (sub ?one3 (mul {t} {t}))) (add (mul (mul ?x ?x) ?c3) ?one4)) ?halfk))"
    );
    // matmul(a, b) · gelu_tanh'(x) == matmul_act_grad[act=gelu_tanh](a, b, x).
    r.push(build(
        "matmul-dgelu-tanh",
        &format!("(mul (matmul* ?a ?b) {d})"),
        matmul_dgelu_tanh,
    ));
    // gelu_tanh'(x) · matmul(a, b) == matmul_act_grad[act=gelu_tanh](a, b, x).
    r.push(build(
        "matmul-dgelu-tanh-rev",
        &format!("(mul {d} (matmul* ?a ?b))"),
        matmul_dgelu_tanh,
    ));

    // Attention.
    let scores = [
        ("mul", "(mul (matmul* ?q ?k) ?scale)", Scale::Mul),
        ("div", "(div (matmul* ?q ?k) ?scale)", Scale::Div),
        ("unscaled", "(matmul* ?q ?k)", Scale::One),
    ];
    let masks = [
        ("plain", "S", Mask::None),
        ("additive", "(add S ?mask)", Mask::Add),
        ("causal", "(where ?keep S ?fill)", Mask::Keep),
        ("causal-drop", "(where ?drop ?fill S)", Mask::Drop),
    ];
    for (sn, s, scale) in scores {
        for (mn, m, mask) in masks {
            // matmul(softmax(mask(scale·q·kᵀ)), v) == attention(q, k, v).
            let lhs = format!("(matmul* (softmax* {}) ?v)", m.replace('S', s));
            r.push(build(format!("attention/{sn}/{mn}"), &lhs, move |cx| {
                attention(cx, scale, mask)
            }));
        }
    }
    r
}
