//! Layout rules: transposes folded into matmul operands (the `trans_a`/`trans_b` flags), movement
//! ops that do nothing, and broadcasts pushed past elementwise ops so that the op runs on the
//! smaller tensor.

use super::{build, Ctx, Rw, ARITH_BINARY, FLOAT_UNARY};
use egg::Id;
use rustytorch_ops::{Op, ReduceKind, Shape};

/// Whether `perm` swaps the last two dims and keeps the others.
pub fn swaps_last_two(perm: &[usize]) -> bool {
    let r = perm.len();
    r >= 2
        && perm[r - 2] == r - 1
        && perm[r - 1] == r - 2
        && perm[..r - 2].iter().enumerate().all(|(i, &d)| i == d)
}

fn fold_trans(cx: &mut Ctx<'_>, which: usize) -> Option<Id> {
    let Op::Permute { perm } = cx.op("permute")? else {
        return None;
    };
    if !swaps_last_two(perm) {
        return None;
    }
    let Op::Matmul { trans_a, trans_b } = *cx.top() else {
        return None;
    };
    let op = if which == 0 {
        Op::Matmul {
            trans_a: !trans_a,
            trans_b,
        }
    } else {
        Op::Matmul {
            trans_a,
            trans_b: !trans_b,
        }
    };
    let (a, b) = (cx.id("?a"), cx.id("?b"));
    cx.add(op, &[a, b])
}

/// `op(...)` over the given operands, then expanded to the matched shape, if `op` then runs on
/// fewer elements.
fn push_expand(cx: &mut Ctx<'_>, vars: &[&str]) -> Option<Id> {
    let out: Shape = cx.root_ty()?.shape.clone();
    let op = cx.top().clone();
    let ids: Vec<Id> = vars.iter().map(|v| cx.id(v)).collect();
    let s = cx.infer(&op, &ids)?.shape;
    if s.numel() >= out.numel() || !s.broadcasts_to(&out) {
        return None;
    }
    let small = cx.add(op, &ids)?;
    cx.add(Op::Expand { shape: out }, &[small])
}

/// `reduce_sum` over every batch axis of `matmul[trans_a](a, b)` (a `[..., K, M]`, b `[..., K, N]`
/// with the same batch dims) is one matmul over the batch's rows stacked:
/// `matmul[trans_a](reshape(a, [B·K, M]), reshape(b, [B·K, N]))` (the reshapes of contiguous
/// operands cost nothing). This is a weight's gradient in a batched linear layer: the GEMM then
/// runs with the whole batch as its inner dimension instead of one product per batch element
/// and a reduction of their `[B, M, N]` results.
fn batch_sum_matmul(cx: &mut Ctx<'_>) -> Option<Id> {
    let Op::Reduce {
        kind: ReduceKind::Sum,
        axes,
        ..
    } = cx.top().clone()
    else {
        return None;
    };
    let Op::Matmul {
        trans_a: true,
        trans_b: false,
    } = *cx.op("matmul")?
    else {
        return None;
    };
    let (at, bt) = (cx.ty("?a")?.clone(), cx.ty("?b")?.clone());
    let (ad, bd) = (at.shape.dims(), bt.shape.dims());
    let r = ad.len();
    if r < 3 || bd.len() != r || ad[..r - 1] != bd[..r - 1] || !at.dtype.is_float() {
        return None;
    }
    if axes != (0..r - 2).collect::<Vec<_>>() {
        return None;
    }
    let rows: usize = ad[..r - 1].iter().product();
    let out = cx.root_ty()?.clone();
    let a = cx.add(
        Op::Reshape {
            shape: Shape::new([rows, ad[r - 1]]),
        },
        &[cx.id("?a")],
    )?;
    let b = cx.add(
        Op::Reshape {
            shape: Shape::new([rows, bd[r - 1]]),
        },
        &[cx.id("?b")],
    )?;
    let m = cx.add(
        Op::Matmul {
            trans_a: true,
            trans_b: false,
        },
        &[a, b],
    )?;
    cx.add(Op::Reshape { shape: out.shape }, &[m])
}

/// The layout rules.
pub fn rules() -> Vec<Rw> {
    let mut r = vec![
        // Σ_batch matmul[trans_a](a, b) == matmul[trans_a] over the stacked rows.
        build(
            "matmul-batch-sum",
            "(reduce_sum* (matmul* ?a ?b))",
            batch_sum_matmul,
        ),
        // matmul(transpose(a), b) == matmul[trans_a](a, b).
        build("matmul-fold-trans-a", "(matmul* (permute* ?a) ?b)", |cx| {
            fold_trans(cx, 0)
        }),
        // matmul(a, transpose(b)) == matmul[trans_b](a, b).
        build("matmul-fold-trans-b", "(matmul* ?a (permute* ?b))", |cx| {
            fold_trans(cx, 1)
        }),
        // permute(x, identity) == x.
        build("permute-identity", "(permute* ?x)", |cx| {
            let Op::Permute { perm } = cx.top() else {
                return None;
            };
            perm.iter()
                .enumerate()
                .all(|(i, &d)| i == d)
                .then(|| cx.id("?x"))
        }),
        // reshape(x) to x's own shape == x.
        build("reshape-identity", "(reshape* ?x)", |cx| {
            (cx.ty("?x")?.shape == cx.root_ty()?.shape).then(|| cx.id("?x"))
        }),
        // expand(x) to x's own shape == x.
        build("expand-identity", "(expand* ?x)", |cx| {
            (cx.ty("?x")?.shape == cx.root_ty()?.shape).then(|| cx.id("?x"))
        }),
    ];
    for name in FLOAT_UNARY.iter().chain(&["cast*"]) {
        let base = name.trim_end_matches('*');
        // f(expand(x)) == expand(f(x)).
        r.push(build(
            format!("expand-past-{base}"),
            &format!("({name} (expand* ?x))"),
            |cx| push_expand(cx, &["?x"]),
        ));
    }
    for name in ARITH_BINARY {
        // expand(x) op expand(y) == expand(x op y) when that is smaller.
        r.push(build(
            format!("expand-past-{name}"),
            &format!("({name} (expand* ?x) (expand* ?y))"),
            |cx| push_expand(cx, &["?x", "?y"]),
        ));
        // expand(x) op y == expand(x op y) when that is smaller.
        r.push(build(
            format!("expand-past-{name}-left"),
            &format!("({name} (expand* ?x) ?y)"),
            |cx| push_expand(cx, &["?x", "?y"]),
        ));
        // x op expand(y) == expand(x op y) when that is smaller.
        r.push(build(
            format!("expand-past-{name}-right"),
            &format!("({name} ?x (expand* ?y))"),
            |cx| push_expand(cx, &["?x", "?y"]),
        ));
    }
    r
}
