//! Scaled dot-product attention on CUDA: one kernel, a warp per query row, the softmax computed
//! online (running maximum, rescaled sums) so that the scores never reach memory.
//!
//! The warp's lanes split the row's keys (`j = lane, lane + 32, ...`, up to the causal limit):
//! each lane keeps its own maximum `m`, denominator `s` and output accumulator `o[Dv]` (registers),
//! and for every key computes the score `scale · q·k_j (+ mask)`, then
//! `m' = max(m, score)`, `o = o·e^(m−m') + e^(score−m')·v_j`. At the end the lanes combine their
//! states through shuffles, rescaled to the row's maximum. The query row sits in shared memory
//! (one slot per warp) while the lanes read it.
//!
//! Semantics are the CPU kernel's (`rustytorch_ops::attention`): statistics in f32 (f64 for f64);
//! masked keys (causal, a false bool mask or a −∞ additive mask) weigh nothing; a row whose keys are
//! all masked is zero; a NaN score makes its row NaN. Only the order of additions differs.
//!
//! This is the general kernel, for any head size and mask. Its arithmetic is scalar (no tensor
//! cores): it is what long sequences with large heads should not use once a tensor-core kernel
//! exists for their shape.

use super::ir::{
    add, assign, bin, div, fc, for_, i32c, i64c, if_, let_, lit, load, mul, rem, select, special,
    store, sub, un, var, BinFn, CTy, Expr, Kernel, Param, Special, Stmt, UnFn,
};
use super::{finish, grid_for, ArgRef, Launch, StepKernels};
use crate::{CodegenError, Result};
use rustytorch_ops::{AttnMask, Causal, Op, Shape, TensorType};

/// Threads per block (eight query rows).
const BLOCK: u32 = 256;
const WARP: i64 = 32;
const WARPS: i64 = BLOCK as i64 / WARP;

/// Lowers `Attention` (inputs q, k, v and the mask when it has one).
pub fn lower(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<StepKernels> {
    let Op::Attention {
        causal,
        mask,
        scale,
    } = op
    else {
        return Err(CodegenError::Invalid(format!(
            "{} is not attention",
            op.name()
        )));
    };
    let want = rustytorch_ops::infer(op, inputs)?;
    if &want != out {
        return Err(CodegenError::Invalid(format!(
            "attention: result type {out} does not match the inferred {want}"
        )));
    }
    if out.shape.numel() == 0 {
        return Ok(StepKernels::default());
    }
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    let (qd, kd, vd) = (q.shape.dims(), k.shape.dims(), v.shape.dims());
    let (bsz, heads, sq, d) = (qd[0], qd[1], qd[2], qd[3]);
    let (sk, dv) = (kd[2], vd[3]);
    let rows = (bsz * heads * sq) as i64;
    let e = CTy::storage(q.dtype);
    let ct = e.compute_of();
    let neg_inf = || fc(f64::NEG_INFINITY, ct);

    let mut params = vec![
        param("q", e, false),
        param("k", e, false),
        param("v", e, false),
    ];
    let mask_strides = match mask {
        AttnMask::None => None,
        AttnMask::Additive | AttnMask::Bool => {
            let m = inputs[3];
            params.push(param("mask", CTy::storage(m.dtype), false));
            Some(m.shape.broadcast_strides(&Shape::new([bsz, heads, sq, sk])))
        }
    };
    params.push(param("out", e, true));

    let mut body = vec![
        let_(
            "act",
            CTy::Bool,
            bin(BinFn::Lt, add(var("rb"), var("wid")), i64c(rows)),
        ),
        let_(
            "row",
            CTy::I64,
            bin(BinFn::Min, add(var("rb"), var("wid")), i64c(rows - 1)),
        ),
        let_("i", CTy::I64, rem(var("row"), i64c(sq as i64))),
        let_("bh", CTy::I64, div(var("row"), i64c(sq as i64))),
        let_("kb", CTy::I64, mul(var("bh"), i64c((sk * d) as i64))),
        let_("vb", CTy::I64, mul(var("bh"), i64c((sk * dv) as i64))),
    ];
    // The query row into this warp's slot.
    body.push(for_(
        "t",
        var("lane"),
        i64c(d as i64),
        i64c(WARP),
        vec![store(
            "qs",
            ct,
            add(mul(var("wid"), i64c(d as i64)), var("t")),
            to_ct(
                load("q", e, add(mul(var("row"), i64c(d as i64)), var("t"))),
                e,
                ct,
            ),
        )],
    ));
    body.push(Stmt::SyncThreads);
    // The keys this row sees.
    let limit = match causal {
        Causal::None => i64c(sk as i64),
        Causal::TopLeft => bin(BinFn::Min, add(var("i"), i64c(1)), i64c(sk as i64)),
        Causal::BottomRight => bin(
            BinFn::Max,
            bin(
                BinFn::Min,
                add(var("i"), i64c(1 + sk as i64 - sq as i64)),
                i64c(sk as i64),
            ),
            i64c(0),
        ),
    };
    body.push(let_("jend", CTy::I64, limit));
    body.push(let_("m", ct, neg_inf()));
    body.push(let_("s", ct, lit(0.0, ct)));
    for c in 0..dv {
        body.push(let_(&format!("o{c}"), ct, lit(0.0, ct)));
    }
    // One key: its score, then the online update.
    let mut key = vec![let_("dot", ct, lit(0.0, ct))];
    key.push(for_(
        "t",
        i64c(0),
        i64c(d as i64),
        i64c(1),
        vec![assign(
            "dot",
            add(
                var("dot"),
                mul(
                    load("qs", ct, add(mul(var("wid"), i64c(d as i64)), var("t"))),
                    to_ct(
                        load(
                            "k",
                            e,
                            add(add(var("kb"), mul(var("j"), i64c(d as i64))), var("t")),
                        ),
                        e,
                        ct,
                    ),
                ),
            ),
        )],
    ));
    key.push(let_("sc", ct, mul(var("dot"), fc(scale.get(), ct))));
    let mask_at = |st: &[usize]| {
        let terms = [
            (div(var("bh"), i64c(heads as i64)), st[0]),
            (rem(var("bh"), i64c(heads as i64)), st[1]),
            (var("i"), st[2]),
            (var("j"), st[3]),
        ];
        terms
            .into_iter()
            .filter(|(_, s)| *s != 0)
            .map(|(x, s)| if s == 1 { x } else { mul(x, i64c(s as i64)) })
            .reduce(add)
            .unwrap_or_else(|| i64c(0))
    };
    match (mask, &mask_strides) {
        (AttnMask::Additive, Some(st)) => key.push(assign(
            "sc",
            add(var("sc"), to_ct(load("mask", e, mask_at(st)), e, ct)),
        )),
        (AttnMask::Bool, Some(st)) => key.push(assign(
            "sc",
            select(load("mask", CTy::Bool, mask_at(st)), var("sc"), neg_inf()),
        )),
        _ => {}
    }
    // A masked key (−∞) weighs nothing; anything else, NaN included, updates the state.
    let mut upd = vec![
        let_("mn", ct, bin(BinFn::Max, var("m"), var("sc"))),
        let_("alpha", ct, un(UnFn::Exp, sub(var("m"), var("mn")))),
        let_("p", ct, un(UnFn::Exp, sub(var("sc"), var("mn")))),
        assign("s", add(mul(var("s"), var("alpha")), var("p"))),
    ];
    for c in 0..dv {
        let o = format!("o{c}");
        let vj = to_ct(
            load(
                "v",
                e,
                add(
                    add(var("vb"), mul(var("j"), i64c(dv as i64))),
                    i64c(c as i64),
                ),
            ),
            e,
            ct,
        );
        upd.push(assign(
            &o,
            add(mul(var(&o), var("alpha")), mul(var("p"), vj)),
        ));
    }
    upd.push(assign("m", var("mn")));
    key.push(if_(bin(BinFn::Ne, var("sc"), neg_inf()), upd));
    body.push(for_("j", var("lane"), var("jend"), i64c(WARP), key));
    // The lanes' states at the row's maximum.
    body.push(let_("mr", ct, var("m")));
    for off in [16, 8, 4, 2, 1] {
        body.push(assign(
            "mr",
            bin(
                BinFn::Max,
                var("mr"),
                bin(BinFn::ShflXor, var("mr"), i32c(off)),
            ),
        ));
    }
    body.push(let_(
        "f",
        ct,
        select(
            bin(BinFn::Eq, var("m"), neg_inf()),
            lit(0.0, ct),
            un(UnFn::Exp, sub(var("m"), var("mr"))),
        ),
    ));
    let mut names = vec!["s".to_string()];
    names.extend((0..dv).map(|c| format!("o{c}")));
    for n in &names {
        body.push(assign(n, mul(var(n), var("f"))));
        for off in [16, 8, 4, 2, 1] {
            body.push(assign(
                n,
                add(var(n), bin(BinFn::ShflXor, var(n), i32c(off))),
            ));
        }
    }
    // Every key masked: a zero row.
    body.push(let_(
        "inv",
        ct,
        select(
            bin(BinFn::Eq, var("mr"), neg_inf()),
            lit(0.0, ct),
            div(lit(1.0, ct), var("s")),
        ),
    ));
    let mut stores = Vec::new();
    for c in 0..dv {
        stores.push(if_(
            bin(BinFn::Eq, var("lane"), i64c(c as i64 % WARP)),
            vec![store(
                "out",
                e,
                add(mul(var("row"), i64c(dv as i64)), i64c(c as i64)),
                mul(var(&format!("o{c}")), var("inv")),
            )],
        ));
    }
    body.push(if_(var("act"), stores));
    // The slots are rewritten by the next rows only after every warp has read them.
    body.push(Stmt::SyncThreads);

    let tid = || special(Special::ThreadIdx);
    let all = vec![
        Stmt::Shared {
            name: "qs".into(),
            elem: ct,
            len: (WARPS as usize * d.max(1)) as u32,
        },
        let_("lane", CTy::I64, rem(tid(), i64c(WARP))),
        let_("wid", CTy::I64, div(tid(), i64c(WARP))),
        for_(
            "rb",
            mul(special(Special::BlockIdx), i64c(WARPS)),
            i64c(rows),
            mul(special(Special::GridDim), i64c(WARPS)),
            body,
        ),
    ];
    let kernel = finish(
        "attention",
        Kernel {
            name: String::new(),
            params,
            block: BLOCK,
            body: all,
        },
    )?;
    let n_in = inputs.len();
    Ok(StepKernels {
        launches: vec![Launch {
            kernel,
            args: (0..n_in)
                .map(ArgRef::Input)
                .chain([ArgRef::Output])
                .collect(),
            grid: grid_for(rows as u64, WARPS as u64),
        }],
        scratch_bytes: 0,
    })
}

fn to_ct(x: Expr, e: CTy, ct: CTy) -> Expr {
    if e.compute_of() == ct {
        x
    } else {
        super::ir::cast(ct, x)
    }
}

fn param(name: &str, elem: CTy, writes: bool) -> Param {
    Param {
        name: name.into(),
        elem,
        writes,
    }
}
