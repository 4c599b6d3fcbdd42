//! Scaled dot-product attention on CUDA: one kernel, a warp per query row, the softmax computed
//! online (running maximum, rescaled sums) so that the scores never reach memory.
//!
//! The warp's lanes split the head dims (lane `l` holds elements `l, l + 32, ...` of the query
//! row and of the output row, in registers), so that every load of a key or value row is one
//! coalesced access of the warp. For each key up to the causal limit the lanes' partial dot
//! products meet in a butterfly, giving every lane the score `scale · q·k_j (+ mask)`; then
//! `m' = max(m, score)`, `s = s·e^(m−m') + e^(score−m')` and `o = o·e^(m−m') + e^(score−m')·v_j`
//! for the lane's output elements. The row ends with `o / s`.
//!
//! Semantics are the CPU kernel's (`rustytorch_ops::attention`): statistics in f32 (f64 for f64);
//! masked keys (causal, a false bool mask or a −∞ additive mask) weigh nothing; a row whose keys are
//! all masked is zero; a NaN score makes its row NaN. Only the order of additions differs.
//!
//! This is the general kernel, for any head size and mask. Its arithmetic is scalar (no tensor
//! cores). Where the scores fit a memory budget ([`GEMM_SCORES_LIMIT`]), f32/f16/bf16 attention
//! runs instead as two cuBLASLt batched GEMMs on the tensor cores around a generated masked
//! softmax ([`lower_gemm`]): `S = Q·Kᵀ` in f32 into the step's scratch, `P = softmax(scale·S +
//! mask)` per row (causal limits, fully masked rows zero, NaN rows NaN, as above) in the
//! operands' type, `O = P·V`. It writes and reads the scores once, which the tensor cores' speed
//! repays many times over at the sequence lengths that fit (measured in docs/performance.md).

use super::ir::{
    add, assign, bin, div, fc, for_, i32c, i64c, if_, lane_and_warp, let_, lit, load, mul, rem,
    select, store, sub, un, var, warp_row_loop, BinFn, CTy, Expr, Kernel, Param, Stmt, UnFn,
};
use super::matmul::MatmulDesc;
use super::{finish, grid_for, ArgRef, Composite, CudaStep, Launch, Part, StepKernels};
use crate::{CodegenError, Result};
use rustytorch_ops::{AttnLayout, AttnMask, Causal, DType, Op, Shape, TensorType};

/// Threads per block (eight query rows).
const BLOCK: u32 = 256;
const WARP: i64 = 32;
const WARPS: i64 = BLOCK as i64 / WARP;

/// Lowers `Attention` (inputs q, k, v and the mask when it has one).
pub fn lower(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<StepKernels> {
    let Some((causal, mask, scale, _)) = checked(op, inputs, out)? else {
        return Ok(StepKernels::default());
    };
    let p = Problem::new(mask, inputs);
    if tiled(inputs) {
        return lower_tiled(causal, mask, scale, p, inputs.len());
    }
    let Problem {
        bsz,
        heads,
        sq,
        d,
        sk,
        dv,
        e,
        ct,
        params,
        mask_strides,
    } = p;
    let rows = (bsz * heads * sq) as i64;
    let neg_inf = || fc(f64::NEG_INFINITY, ct);

    // This lane's share of a row of the head dims: elements `lane + 32·r`.
    let (rq, ro) = (d.div_ceil(WARP as usize), dv.div_ceil(WARP as usize));
    let col = |r: usize| add(var("lane"), i64c(r as i64 * WARP));
    let guard = |r: usize, n: usize, s: Vec<Stmt>| -> Vec<Stmt> {
        if (r + 1) * WARP as usize <= n {
            s
        } else {
            vec![if_(bin(BinFn::Lt, col(r), i64c(n as i64)), s)]
        }
    };
    let mut body = vec![
        let_("i", CTy::I64, rem(var("row"), i64c(sq as i64))),
        let_("bh", CTy::I64, div(var("row"), i64c(sq as i64))),
        let_("kb", CTy::I64, mul(var("bh"), i64c((sk * d) as i64))),
        let_("vb", CTy::I64, mul(var("bh"), i64c((sk * dv) as i64))),
    ];
    // The query row, spread over the lanes.
    for r in 0..rq {
        let qn = format!("q{r}");
        body.push(let_(&qn, ct, lit(0.0, ct)));
        let l = load("q", e, add(mul(var("row"), i64c(d as i64)), col(r)));
        body.extend(guard(r, d, vec![assign(&qn, to_ct(l, e, ct))]));
    }
    // The keys this row sees.
    body.push(let_("jend", CTy::I64, key_limit(causal, var("i"), sq, sk)));
    body.push(let_("m", ct, neg_inf()));
    body.push(let_("s", ct, lit(0.0, ct)));
    for r in 0..ro {
        body.push(let_(&format!("o{r}"), ct, lit(0.0, ct)));
    }
    // One key: the lanes' partial dot products, summed by a butterfly (every lane holds the
    // score), then the online update of the lane's output elements.
    let mut key = vec![let_("dot", ct, lit(0.0, ct))];
    for r in 0..rq {
        let kl = load(
            "k",
            e,
            add(add(var("kb"), mul(var("j"), i64c(d as i64))), col(r)),
        );
        let upd = assign(
            "dot",
            add(var("dot"), mul(var(&format!("q{r}")), to_ct(kl, e, ct))),
        );
        key.extend(guard(r, d, vec![upd]));
    }
    for off in [16, 8, 4, 2, 1] {
        key.push(assign(
            "dot",
            add(var("dot"), bin(BinFn::ShflXor, var("dot"), i32c(off))),
        ));
    }
    key.push(let_("sc", ct, mul(var("dot"), fc(scale, ct))));
    key.extend(apply_mask(mask, mask_strides.as_deref(), heads, e, ct));
    // A masked key (−∞) weighs nothing; anything else, NaN included, updates the state.
    let mut upd = online_update(ct);
    for r in 0..ro {
        let o = format!("o{r}");
        let vl = load(
            "v",
            e,
            add(add(var("vb"), mul(var("j"), i64c(dv as i64))), col(r)),
        );
        upd.push(assign(&o, mul(var(&o), var("alpha"))));
        upd.extend(guard(
            r,
            dv,
            vec![assign(&o, add(var(&o), mul(var("p"), to_ct(vl, e, ct))))],
        ));
    }
    upd.push(assign("m", var("mn")));
    key.push(if_(bin(BinFn::Ne, var("sc"), neg_inf()), upd));
    body.push(for_("j", i64c(0), var("jend"), i64c(1), key));
    body.push(inverse_sum(ct));
    for r in 0..ro {
        let st = store(
            "out",
            e,
            add(mul(var("row"), i64c(dv as i64)), col(r)),
            mul(var(&format!("o{r}")), var("inv")),
        );
        body.extend(guard(r, dv, vec![st]));
    }

    let mut all = lane_and_warp();
    all.push(warp_row_loop(rows, WARPS, body));

    let kernel = finish(
        "attention",
        Kernel {
            name: String::new(),
            params,
            block: BLOCK,
            smem: 0,
            body: all,
        },
    )?;
    Ok(StepKernels::over_operands(
        kernel,
        inputs.len(),
        grid_for(rows as u64, WARPS as u64),
    ))
}

/// The attributes of `Attention` or `AttentionGrad` (`wrt` is 0 for the forward) once `out` is
/// checked against the inferred type; `None` for an empty result (nothing to launch).
fn checked(
    op: &Op,
    inputs: &[&TensorType],
    out: &TensorType,
) -> Result<Option<(Causal, AttnMask, f64, u8)>> {
    let (causal, mask, scale, wrt) = match op {
        Op::Attention {
            layout: AttnLayout::Bshd,
            ..
        }
        | Op::AttentionGrad {
            layout: AttnLayout::Bshd,
            ..
        } => {
            return Err(CodegenError::Invalid(format!(
                "{}: the [B,S,H,D] layout lowers through `lower_bshd`",
                op.name()
            )))
        }
        Op::Attention {
            causal,
            mask,
            scale,
            ..
        } => (*causal, *mask, scale.get(), 0),
        Op::AttentionGrad {
            causal,
            mask,
            scale,
            wrt,
            ..
        } => (*causal, *mask, scale.get(), *wrt),
        _ => {
            return Err(CodegenError::Invalid(format!(
                "{} is not attention",
                op.name()
            )))
        }
    };
    check_result(op, inputs, out)?;
    Ok((out.shape.numel() > 0).then_some((causal, mask, scale, wrt)))
}

/// Checks `out` against the type inferred for `op` over `inputs`.
pub(super) fn check_result(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<()> {
    let want = rustytorch_ops::infer(op, inputs)?;
    if &want != out {
        return Err(CodegenError::Invalid(format!(
            "{}: result type {out} does not match the inferred {want}",
            op.name()
        )));
    }
    Ok(())
}

/// Lowers attention (or a gradient) in the `[B,S,H,D]` layout for the implementations that read
/// `[B,H,S,D]` only (the flash kernel reads both): its q, k, v (and dO) are transposed into the
/// step's scratch, the `[B,H,S,D]` op runs there, and its result is transposed into the output.
/// The inner step's own scratch comes first, so its offsets stay as they are.
pub fn lower_bshd(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<CudaStep> {
    let inner = op.with_attn_layout(AttnLayout::Bhsd);
    let has_mask = match op {
        Op::Attention { mask, .. } | Op::AttentionGrad { mask, .. } => *mask != AttnMask::None,
        _ => {
            return Err(CodegenError::Invalid(format!(
                "{} is not attention",
                op.name()
            )))
        }
    };
    check_result(op, inputs, out)?;
    let swap = |t: &TensorType| TensorType::new(t.dtype, AttnLayout::Bshd.to_bhsd(t.shape.dims()));
    let moved: Vec<bool> = (0..inputs.len()).map(|i| !(has_mask && i == 3)).collect();
    let bhsd: Vec<TensorType> = inputs
        .iter()
        .zip(&moved)
        .map(|(t, &m)| if m { swap(t) } else { (*t).clone() })
        .collect();
    let bhsd_refs: Vec<&TensorType> = bhsd.iter().collect();
    let inner_out = swap(out);
    let (inner_parts, inner_scratch) = match super::lower_step(&inner, &bhsd_refs, &inner_out)? {
        CudaStep::Kernels(k) => (
            k.launches.into_iter().map(Part::Launch).collect::<Vec<_>>(),
            k.scratch_bytes,
        ),
        CudaStep::Composite(c) => (c.parts, c.scratch_bytes),
        other => {
            return Err(CodegenError::Invalid(format!(
                "attention: unexpected lowering {other:?}"
            )))
        }
    };
    // Scratch: the inner step's, then each transposed operand, then the inner result.
    let mut at = inner_scratch.next_multiple_of(256);
    let mut place = |t: &TensorType| {
        let here = at;
        at += (t.shape.numel() * t.dtype.size_bytes()).next_multiple_of(256);
        here
    };
    let slots: Vec<Option<usize>> = bhsd
        .iter()
        .zip(&moved)
        .map(|(t, &m)| m.then(|| place(t)))
        .collect();
    let out_at = place(&inner_out);
    let perm = Op::Permute {
        perm: vec![0, 2, 1, 3],
    };
    let transpose = |from: &TensorType, to: &TensorType, src: ArgRef, dst: ArgRef| {
        let k = super::elementwise::lower_movement(&perm, &[from], to)?;
        Ok::<_, CodegenError>(k.launches.into_iter().map(move |mut l| {
            for a in &mut l.args {
                *a = match *a {
                    ArgRef::Input(_) => src,
                    ArgRef::Output => dst,
                    other => other,
                };
            }
            Part::Launch(l)
        }))
    };
    let mut parts = Vec::new();
    for (i, slot) in slots.iter().enumerate() {
        if let Some(off) = slot {
            parts.extend(transpose(
                inputs[i],
                &bhsd[i],
                ArgRef::Input(i),
                ArgRef::ScratchAt(*off),
            )?);
        }
    }
    let remap = |a: ArgRef| match a {
        ArgRef::Input(i) => slots[i].map_or(ArgRef::Input(i), ArgRef::ScratchAt),
        ArgRef::Output => ArgRef::ScratchAt(out_at),
        other => other,
    };
    for p in inner_parts {
        parts.push(match p {
            Part::Launch(mut l) => {
                l.args = l.args.into_iter().map(remap).collect();
                Part::Launch(l)
            }
            Part::Gemm { desc, a, b, d } => Part::Gemm {
                desc,
                a: remap(a),
                b: remap(b),
                d: remap(d),
            },
        });
    }
    parts.extend(transpose(
        &inner_out,
        out,
        ArgRef::ScratchAt(out_at),
        ArgRef::Output,
    )?);
    Ok(CudaStep::Composite(Composite {
        parts,
        scratch_bytes: at,
    }))
}

/// Sizes, types and kernel parameters of one attention op.
struct Problem {
    bsz: usize,
    heads: usize,
    sq: usize,
    d: usize,
    sk: usize,
    dv: usize,
    /// Storage and compute types.
    e: CTy,
    ct: CTy,
    /// q, k, v, [mask], out.
    params: Vec<Param>,
    /// The mask's strides broadcast to [B, H, Sq, Sk].
    mask_strides: Option<Vec<usize>>,
}

impl Problem {
    fn new(mask: AttnMask, inputs: &[&TensorType]) -> Problem {
        let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
        let (qd, kd, vd) = (q.shape.dims(), k.shape.dims(), v.shape.dims());
        let (bsz, heads, sq, d) = (qd[0], qd[1], qd[2], qd[3]);
        let (sk, dv) = (kd[2], vd[3]);
        let e = CTy::storage(q.dtype);
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
        Problem {
            bsz,
            heads,
            sq,
            d,
            sk,
            dv,
            e,
            ct: e.compute_of(),
            params,
            mask_strides,
        }
    }
}

/// Threads (query rows) per block of the tiled kernel.
const TROWS: u32 = 128;
/// Keys per shared-memory tile of the tiled kernel (half for f64, so that the key and value tiles
/// fit the 48 KiB of static shared memory).
fn key_tile(ct: CTy) -> i64 {
    if ct == CTy::F64 {
        32
    } else {
        64
    }
}
/// The largest head size the tiled kernel keeps in registers.
const TILED_MAX_HEAD: usize = 64;

/// Whether the tiled kernel runs this shape: enough query rows per head to fill its blocks, and
/// heads small enough for a thread to hold its query and output rows in registers.
fn tiled(inputs: &[&TensorType]) -> bool {
    let (qd, vd) = (inputs[0].shape.dims(), inputs[2].shape.dims());
    qd[2] >= 32 && qd[3] <= TILED_MAX_HEAD && vd[3] <= TILED_MAX_HEAD
}

/// The tiled kernel: a thread per query row (its query and output rows in registers), a block of
/// [`TROWS`] consecutive rows of one head walking the keys in tiles of [`key_tile`] that the block
/// stages in shared memory, so that each key and value element is read from memory once per
/// block rather than once per row, and scores need no shuffles. Same online softmax and
/// semantics as the warp kernel.
fn lower_tiled(
    causal: Causal,
    mask: AttnMask,
    scale: f64,
    p: Problem,
    n_inputs: usize,
) -> Result<StepKernels> {
    let Problem {
        bsz,
        heads,
        sq,
        d,
        sk,
        dv,
        e,
        ct,
        params,
        mask_strides,
    } = p;
    let ktile = key_tile(ct);
    let t = TROWS as i64;
    let tiles_q = (sq as i64 + t - 1) / t;
    let blocks = (bsz * heads) as i64 * tiles_q;

    let tid = || super::ir::special(super::ir::Special::ThreadIdx);
    let mut body = vec![
        let_("bh", CTy::I64, div(var("blk"), i64c(tiles_q))),
        let_("i0", CTy::I64, mul(rem(var("blk"), i64c(tiles_q)), i64c(t))),
        let_("i", CTy::I64, add(var("i0"), tid())),
        let_("ok", CTy::Bool, bin(BinFn::Lt, var("i"), i64c(sq as i64))),
        let_(
            "row",
            CTy::I64,
            add(mul(var("bh"), i64c(sq as i64)), var("i")),
        ),
        let_("kb", CTy::I64, mul(var("bh"), i64c((sk * d) as i64))),
        let_("vb", CTy::I64, mul(var("bh"), i64c((sk * dv) as i64))),
    ];
    for r in 0..d {
        let qn = format!("q{r}");
        body.push(let_(&qn, ct, lit(0.0, ct)));
        let l = load("q", e, add(mul(var("row"), i64c(d as i64)), i64c(r as i64)));
        body.push(if_(var("ok"), vec![assign(&qn, to_ct(l, e, ct))]));
    }
    body.push(let_(
        "jend",
        CTy::I64,
        select(var("ok"), key_limit(causal, var("i"), sq, sk), i64c(0)),
    ));
    // The block's last row sees the most keys.
    let last = bin(BinFn::Min, add(var("i0"), i64c(t - 1)), i64c(sq as i64 - 1));
    body.push(let_("bend", CTy::I64, key_limit(causal, last, sq, sk)));
    body.push(let_("m", ct, fc(f64::NEG_INFINITY, ct)));
    body.push(let_("s", ct, lit(0.0, ct)));
    for r in 0..dv {
        body.push(let_(&format!("o{r}"), ct, lit(0.0, ct)));
    }
    // One tile: stage keys and values, then each row walks them.
    let stage = |sh: &str, src: &str, base: &str, w: usize| {
        for_(
            "x",
            tid(),
            i64c(ktile * w as i64),
            i64c(t),
            vec![
                let_(
                    "jj",
                    CTy::I64,
                    add(var("j0"), div(var("x"), i64c(w as i64))),
                ),
                Stmt::If {
                    cond: bin(BinFn::Lt, var("jj"), i64c(sk as i64)),
                    then: vec![store(
                        sh,
                        ct,
                        var("x"),
                        to_ct(
                            load(
                                src,
                                e,
                                add(
                                    add(var(base), mul(var("jj"), i64c(w as i64))),
                                    rem(var("x"), i64c(w as i64)),
                                ),
                            ),
                            e,
                            ct,
                        ),
                    )],
                    els: vec![store(sh, ct, var("x"), lit(0.0, ct))],
                },
            ],
        )
    };
    let mut key = vec![let_("dot", ct, lit(0.0, ct))];
    for r in 0..d {
        let kl = load(
            "ks",
            ct,
            add(mul(var("kk"), i64c(d as i64)), i64c(r as i64)),
        );
        key.push(assign(
            "dot",
            add(var("dot"), mul(var(&format!("q{r}")), kl)),
        ));
    }
    key.push(let_("sc", ct, mul(var("dot"), fc(scale, ct))));
    key.extend(apply_mask(mask, mask_strides.as_deref(), heads, e, ct));
    let mut upd = online_update(ct);
    for r in 0..dv {
        let o = format!("o{r}");
        let vl = load(
            "vs",
            ct,
            add(mul(var("kk"), i64c(dv as i64)), i64c(r as i64)),
        );
        upd.push(assign(
            &o,
            add(mul(var(&o), var("alpha")), mul(var("p"), vl)),
        ));
    }
    upd.push(assign("m", var("mn")));
    key.push(if_(
        bin(BinFn::Ne, var("sc"), fc(f64::NEG_INFINITY, ct)),
        upd,
    ));
    let walk = vec![
        let_("j", CTy::I64, add(var("j0"), var("kk"))),
        if_(bin(BinFn::Lt, var("j"), var("jend")), key),
    ];
    body.push(for_(
        "j0",
        i64c(0),
        var("bend"),
        i64c(ktile),
        vec![
            stage("ks", "k", "kb", d),
            stage("vs", "v", "vb", dv),
            Stmt::SyncThreads,
            for_("kk", i64c(0), i64c(ktile), i64c(1), walk),
            Stmt::SyncThreads,
        ],
    ));
    body.push(inverse_sum(ct));
    let stores: Vec<Stmt> = (0..dv)
        .map(|r| {
            store(
                "out",
                e,
                add(mul(var("row"), i64c(dv as i64)), i64c(r as i64)),
                mul(var(&format!("o{r}")), var("inv")),
            )
        })
        .collect();
    body.push(if_(var("ok"), stores));

    let all = vec![
        Stmt::Shared {
            name: "ks".into(),
            elem: ct,
            len: (ktile as usize * d) as u32,
        },
        Stmt::Shared {
            name: "vs".into(),
            elem: ct,
            len: (ktile as usize * dv) as u32,
        },
        for_(
            "blk",
            super::ir::special(super::ir::Special::BlockIdx),
            i64c(blocks),
            super::ir::special(super::ir::Special::GridDim),
            body,
        ),
    ];
    let kernel = finish(
        "attention_tiled",
        Kernel {
            name: String::new(),
            params,
            block: TROWS,
            smem: 0,
            body: all,
        },
    )?;
    Ok(StepKernels::over_operands(
        kernel,
        n_inputs,
        grid_for(blocks as u64, 1),
    ))
}

/// The end of the keys query row `i` sees.
fn key_limit(causal: Causal, i: Expr, sq: usize, sk: usize) -> Expr {
    match causal {
        Causal::None => i64c(sk as i64),
        Causal::TopLeft => bin(BinFn::Min, add(i, i64c(1)), i64c(sk as i64)),
        Causal::BottomRight => bin(
            BinFn::Max,
            bin(
                BinFn::Min,
                add(i, i64c(1 + sk as i64 - sq as i64)),
                i64c(sk as i64),
            ),
            i64c(0),
        ),
    }
}

/// Statements applying the mask to the score `sc` of query `i`, key `j` of head `bh`.
fn apply_mask(
    mask: AttnMask,
    strides: Option<&[usize]>,
    heads: usize,
    e: CTy,
    ct: CTy,
) -> Vec<Stmt> {
    let at = |st: &[usize]| {
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
    match (mask, strides) {
        (AttnMask::Additive, Some(st)) => vec![assign(
            "sc",
            add(var("sc"), to_ct(load("mask", e, at(st)), e, ct)),
        )],
        (AttnMask::Bool, Some(st)) => vec![assign(
            "sc",
            select(
                load("mask", CTy::Bool, at(st)),
                var("sc"),
                fc(f64::NEG_INFINITY, ct),
            ),
        )],
        _ => vec![],
    }
}

/// The online softmax step for score `sc`: new maximum `mn`, the old state's factor `alpha`,
/// this key's weight `p`, and the running sum `s` (the caller rescales its outputs by `alpha`,
/// adds `p·v`, then sets `m = mn`).
fn online_update(ct: CTy) -> Vec<Stmt> {
    vec![
        let_("mn", ct, bin(BinFn::Max, var("m"), var("sc"))),
        let_("alpha", ct, un(UnFn::Exp, sub(var("m"), var("mn")))),
        let_("p", ct, un(UnFn::Exp, sub(var("sc"), var("mn")))),
        assign("s", add(mul(var("s"), var("alpha")), var("p"))),
    ]
}

/// `inv = 1/s`, or 0 for a row whose keys were all masked (a zero row).
fn inverse_sum(ct: CTy) -> Stmt {
    let_(
        "inv",
        ct,
        select(
            bin(BinFn::Eq, var("m"), fc(f64::NEG_INFINITY, ct)),
            lit(0.0, ct),
            div(lit(1.0, ct), var("s")),
        ),
    )
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
        map: None,
    }
}

/// Lowers `AttentionGrad` (inputs q, k, v, the mask when it has one, and the output's gradient)
/// to two kernels, a thread per row each, recomputing the probabilities as the CPU kernel does:
///
/// 1. per query row `i`, over its visible keys with the online softmax: the maximum `m_i`, the
///    sum `l_i = Σ e^(s_ij − m_i)` and `D_i = Σ_j P_ij (dO_i·v_j)` (= `dO_i·O_i`), into scratch;
/// 2. for `wrt` = q, per query row: `dQ_i = scale · Σ_j P_ij (dO_i·v_j − D_i) k_j`; for k, per key
///    row: `dK_j = scale · Σ_i P_ij (dO_i·v_j − D_i) q_i`; for v, per key row:
///    `dV_j = Σ_i P_ij dO_i`, each over the queries that see key `j`.
///
/// A fully masked query row has `l = 0` and contributes nothing. Scalar arithmetic, statistics in
/// f32 (f64 for f64); correct for any shape, not tuned.
pub fn lower_grad(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<StepKernels> {
    let Some((causal, mask, scale, wrt)) = checked(op, inputs, out)? else {
        return Ok(StepKernels::default());
    };
    let fwd = Problem::new(mask, inputs);
    let (bsz, heads, sq, d, sk, dv, e, ct) = (
        fwd.bsz, fwd.heads, fwd.sq, fwd.d, fwd.sk, fwd.dv, fwd.e, fwd.ct,
    );
    let n_in = inputs.len();
    // Parameters: q, k, v, [mask], g, stats (scratch), [out].
    let mut params: Vec<Param> = fwd.params[..fwd.params.len() - 1].to_vec();
    params.push(param("g", e, false));
    params.push(param("st", ct, false));
    let stats_params = {
        let mut p = params.clone();
        p.last_mut().expect("stats").writes = true;
        p
    };
    params.push(param("out", e, true));
    let tid_rows = |rows: usize, body: Vec<Stmt>| super::ir::grid_stride("r", rows as i64, body);
    let inf = || fc(f64::NEG_INFINITY, ct);
    // Named row vectors: `{name}{t}` = buf[base + t] for t < n.
    let row = |name: &str, buf: &str, base: Expr, n: usize| -> Vec<Stmt> {
        (0..n)
            .map(|t| {
                let l = load(buf, e, add(base.clone(), i64c(t as i64)));
                let_(&format!("{name}{t}"), ct, to_ct(l, e, ct))
            })
            .collect()
    };
    let dot = |a: &str, buf: &str, base: Expr, n: usize| -> Expr {
        (0..n)
            .map(|t| {
                let l = load(buf, e, add(base.clone(), i64c(t as i64)));
                mul(var(&format!("{a}{t}")), to_ct(l, e, ct))
            })
            .reduce(add)
            .unwrap_or_else(|| lit(0.0, ct))
    };
    let score = |qdot: Expr| -> Vec<Stmt> {
        let mut s = vec![let_("sc", ct, mul(qdot, fc(scale, ct)))];
        s.extend(apply_mask(mask, fwd.mask_strides.as_deref(), heads, e, ct));
        s
    };

    // 1. Statistics per query row.
    let mut st = vec![
        let_("bh", CTy::I64, div(var("r"), i64c(sq as i64))),
        let_("i", CTy::I64, rem(var("r"), i64c(sq as i64))),
    ];
    st.extend(row("q", "q", mul(var("r"), i64c(d as i64)), d));
    st.extend(row("go", "g", mul(var("r"), i64c(dv as i64)), dv));
    st.push(let_("jend", CTy::I64, key_limit(causal, var("i"), sq, sk)));
    st.push(let_("m", ct, inf()));
    st.push(let_("s", ct, lit(0.0, ct)));
    st.push(let_("dacc", ct, lit(0.0, ct)));
    let kbase = add(
        mul(var("bh"), i64c((sk * d) as i64)),
        mul(var("j"), i64c(d as i64)),
    );
    let vbase = add(
        mul(var("bh"), i64c((sk * dv) as i64)),
        mul(var("j"), i64c(dv as i64)),
    );
    let mut key = score(dot("q", "k", kbase.clone(), d));
    let mut upd = online_update(ct);
    upd.push(assign(
        "dacc",
        add(
            mul(var("dacc"), var("alpha")),
            mul(var("p"), dot("go", "v", vbase.clone(), dv)),
        ),
    ));
    upd.push(assign("m", var("mn")));
    key.push(if_(bin(BinFn::Ne, var("sc"), inf()), upd));
    st.push(for_("j", i64c(0), var("jend"), i64c(1), key));
    let full = bin(BinFn::Eq, var("m"), inf());
    st.push(store("st", ct, mul(var("r"), i64c(3)), var("m")));
    st.push(store(
        "st",
        ct,
        add(mul(var("r"), i64c(3)), i64c(1)),
        select(full.clone(), lit(0.0, ct), var("s")),
    ));
    st.push(store(
        "st",
        ct,
        add(mul(var("r"), i64c(3)), i64c(2)),
        select(full, lit(0.0, ct), div(var("dacc"), var("s"))),
    ));
    let rows_q = bsz * heads * sq;
    let stats = finish(
        "attention_grad_stats",
        Kernel {
            name: String::new(),
            params: stats_params,
            block: TROWS,
            smem: 0,
            body: vec![tid_rows(rows_q, st)],
        },
    )?;

    // 2. The gradient.
    // P_ij from the saved statistics of query row `qr`: 0 for a fully masked row.
    let prob = |qr: Expr| -> Vec<Stmt> {
        vec![
            let_("mi", ct, load("st", ct, mul(qr.clone(), i64c(3)))),
            let_(
                "li",
                ct,
                load("st", ct, add(mul(qr.clone(), i64c(3)), i64c(1))),
            ),
            let_("di", ct, load("st", ct, add(mul(qr, i64c(3)), i64c(2)))),
            let_(
                "pij",
                ct,
                select(
                    bin(BinFn::Eq, var("li"), lit(0.0, ct)),
                    lit(0.0, ct),
                    div(un(UnFn::Exp, sub(var("sc"), var("mi"))), var("li")),
                ),
            ),
        ]
    };
    let accs = |n: usize| -> Vec<Stmt> {
        (0..n)
            .map(|t| let_(&format!("a{t}"), ct, lit(0.0, ct)))
            .collect()
    };
    let axpy = |coef: Expr, buf: &str, base: Expr, n: usize| -> Vec<Stmt> {
        let mut s = vec![let_("cf", ct, coef)];
        for t in 0..n {
            let a = format!("a{t}");
            let l = load(buf, e, add(base.clone(), i64c(t as i64)));
            s.push(assign(&a, add(var(&a), mul(var("cf"), to_ct(l, e, ct)))));
        }
        s
    };
    let (rows, width, body) = if wrt == 0 {
        let mut b = vec![
            let_("bh", CTy::I64, div(var("r"), i64c(sq as i64))),
            let_("i", CTy::I64, rem(var("r"), i64c(sq as i64))),
        ];
        b.extend(row("q", "q", mul(var("r"), i64c(d as i64)), d));
        b.extend(row("go", "g", mul(var("r"), i64c(dv as i64)), dv));
        b.extend(accs(d));
        b.push(let_("jend", CTy::I64, key_limit(causal, var("i"), sq, sk)));
        let mut key = score(dot("q", "k", kbase.clone(), d));
        let mut inner = prob(var("r"));
        inner.extend(axpy(
            mul(
                var("pij"),
                sub(dot("go", "v", vbase.clone(), dv), var("di")),
            ),
            "k",
            kbase.clone(),
            d,
        ));
        key.push(if_(bin(BinFn::Ne, var("sc"), inf()), inner));
        b.push(for_("j", i64c(0), var("jend"), i64c(1), key));
        (rows_q, d, b)
    } else {
        // A thread per key row `j` of head `bh`, over the queries `i` that see it.
        let mut b = vec![
            let_("bh", CTy::I64, div(var("r"), i64c(sk as i64))),
            let_("j", CTy::I64, rem(var("r"), i64c(sk as i64))),
        ];
        b.extend(row("kk", "k", mul(var("r"), i64c(d as i64)), d));
        if wrt == 1 {
            b.extend(row("vv", "v", mul(var("r"), i64c(dv as i64)), dv));
        }
        let n = if wrt == 1 { d } else { dv };
        b.extend(accs(n));
        let qrow = add(mul(var("bh"), i64c(sq as i64)), var("i"));
        let qbase = mul(qrow.clone(), i64c(d as i64));
        let gbase = mul(qrow.clone(), i64c(dv as i64));
        let mut q_loop = score(dot("kk", "q", qbase.clone(), d));
        let mut inner = prob(qrow);
        if wrt == 1 {
            inner.extend(axpy(
                mul(var("pij"), sub(dot("vv", "g", gbase, dv), var("di"))),
                "q",
                qbase,
                d,
            ));
        } else {
            inner.extend(axpy(var("pij"), "g", gbase, dv));
        }
        q_loop.push(if_(bin(BinFn::Ne, var("sc"), inf()), inner));
        let visible = bin(BinFn::Lt, var("j"), key_limit(causal, var("i"), sq, sk));
        b.push(for_(
            "i",
            i64c(0),
            i64c(sq as i64),
            i64c(1),
            vec![if_(visible, q_loop)],
        ));
        (bsz * heads * sk, n, b)
    };
    let mut body = body;
    let factor = if wrt == 2 { 1.0 } else { scale };
    for t in 0..width {
        body.push(store(
            "out",
            e,
            add(mul(var("r"), i64c(width as i64)), i64c(t as i64)),
            mul(var(&format!("a{t}")), fc(factor, ct)),
        ));
    }
    let main = finish(
        "attention_grad",
        Kernel {
            name: String::new(),
            params,
            block: TROWS,
            smem: 0,
            body: vec![tid_rows(rows, body)],
        },
    )?;
    let mut args: Vec<ArgRef> = (0..n_in).map(ArgRef::Input).collect();
    args.push(ArgRef::Scratch);
    let mut main_args = args.clone();
    main_args.push(ArgRef::Output);
    Ok(StepKernels {
        launches: vec![
            Launch {
                kernel: stats,
                args,
                grid: grid_for(rows_q as u64, TROWS as u64),
            },
            Launch {
                kernel: main,
                args: main_args,
                grid: grid_for(rows as u64, TROWS as u64),
            },
        ],
        scratch_bytes: rows_q * 3 * super::ir::elem_bytes(ct),
    })
}

/// Bytes of scratch (the f32 scores and the probabilities) up to which attention runs as GEMMs.
pub const GEMM_SCORES_LIMIT: usize = 1 << 30;

/// The scratch bytes the GEMM path of `Attention` over `inputs` needs: `(P's offset, total)`.
fn gemm_scratch(inputs: &[&TensorType]) -> (usize, usize) {
    let (qd, kd) = (inputs[0].shape.dims(), inputs[1].shape.dims());
    let scores = qd[0] * qd[1] * qd[2] * kd[2];
    let p_at = (scores * 4).next_multiple_of(256);
    (p_at, p_at + scores * inputs[0].dtype.size_bytes())
}

/// Whether `Attention` over `inputs` runs as GEMMs: f32/f16/bf16 operands whose scores and
/// probabilities fit [`GEMM_SCORES_LIMIT`]; `RUSTYTORCH_ATTENTION=kernel` keeps the single kernel.
pub fn gemm_path(inputs: &[&TensorType]) -> bool {
    matches!(inputs[0].dtype, DType::F32 | DType::F16 | DType::BF16)
        && gemm_scratch(inputs).1 <= GEMM_SCORES_LIMIT
        && std::env::var("RUSTYTORCH_ATTENTION").as_deref() != Ok("kernel")
}

/// The cuBLASLt call of the batched product `a·b` (with the given transposes) of operand types
/// `a`, `b` into `o`.
fn gemm(
    trans_a: bool,
    trans_b: bool,
    a: &TensorType,
    b: &TensorType,
    o: &TensorType,
) -> Result<MatmulDesc> {
    let op = Op::Matmul { trans_a, trans_b };
    match super::matmul::lower(&op, &[a, b], o)? {
        CudaStep::Matmul { desc, after, .. } if after.launches.is_empty() => Ok(desc),
        other => Err(CodegenError::Invalid(format!(
            "attention: unexpected matmul lowering {other:?}"
        ))),
    }
}

/// The first parts of both GEMM forms: `S = Q·Kᵀ` (f32, scratch at 0), then the masked softmax
/// writing `P` (the operands' type) at `p_at`. Returns the parts, `p_at` and the scratch size.
fn scores_and_probabilities(
    causal: Causal,
    mask: AttnMask,
    scale: f64,
    inputs: &[&TensorType],
) -> Result<(Vec<Part>, usize, usize)> {
    let p = Problem::new(mask, inputs);
    let (bh, dt) = (p.bsz * p.heads, inputs[0].dtype);
    let t = |dims: [usize; 3]| TensorType::new(dt, dims);
    let mut qk = gemm(
        false,
        true,
        &t([bh, p.sq, p.d]),
        &t([bh, p.sk, p.d]),
        &t([bh, p.sq, p.sk]),
    )?;
    qk.out_dtype = DType::F32;
    let (p_at, scratch_bytes) = gemm_scratch(inputs);
    let kernel = gemm_softmax_kernel(causal, mask, scale, inputs)?;
    let mut args = vec![ArgRef::ScratchAt(0)];
    if mask != AttnMask::None {
        args.push(ArgRef::Input(3));
    }
    args.push(ArgRef::ScratchAt(p_at));
    let rows = (bh * p.sq) as u64;
    let parts = vec![
        Part::Gemm {
            desc: qk,
            a: ArgRef::Input(1),
            b: ArgRef::Input(0),
            d: ArgRef::ScratchAt(0),
        },
        Part::Launch(Launch {
            kernel,
            args,
            grid: grid_for(rows, WARPS as u64),
        }),
    ];
    Ok((parts, p_at, scratch_bytes))
}

/// Lowers `Attention` to its GEMM form: `S = Q·Kᵀ` in f32 into the scratch, the masked softmax
/// into `P`, `O = P·V` (an empty result runs nothing).
pub fn lower_gemm(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<CudaStep> {
    let Some((causal, mask, scale, _)) = checked(op, inputs, out)? else {
        return Ok(CudaStep::Kernels(StepKernels::default()));
    };
    let p = Problem::new(mask, inputs);
    let (bh, dt) = (p.bsz * p.heads, inputs[0].dtype);
    let t = |dims: [usize; 3]| TensorType::new(dt, dims);
    let (mut parts, p_at, scratch_bytes) = scores_and_probabilities(causal, mask, scale, inputs)?;
    parts.push(Part::Gemm {
        desc: gemm(
            false,
            false,
            &t([bh, p.sq, p.sk]),
            &t([bh, p.sk, p.dv]),
            &t([bh, p.sq, p.dv]),
        )?,
        a: ArgRef::Input(2),
        b: ArgRef::ScratchAt(p_at),
        d: ArgRef::Output,
    });
    Ok(CudaStep::Composite(Composite {
        parts,
        scratch_bytes,
    }))
}

/// Lowers `AttentionGrad` (operands q, k, v, [mask], dO) to its GEMM form, recomputing `P` as
/// the forward does: for v, `dV = Pᵀ·dO`; for q and k, `dP = dO·Vᵀ` (f32, over the scores),
/// `dS = P∘(dP − rowsum(P∘dP))·scale` in place of `P` ([`grad_softmax_kernel`]), then
/// `dQ = dS·K` or `dK = dSᵀ·Q`. A fully masked row has `P = 0`, so it contributes nothing.
pub fn lower_grad_gemm(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<CudaStep> {
    let Some((causal, mask, scale, wrt)) = checked(op, inputs, out)? else {
        return Ok(CudaStep::Kernels(StepKernels::default()));
    };
    let p = Problem::new(mask, inputs);
    let (bh, dt) = (p.bsz * p.heads, inputs[0].dtype);
    let t = |dims: [usize; 3]| TensorType::new(dt, dims);
    let g = ArgRef::Input(inputs.len() - 1);
    let (mut parts, p_at, scratch_bytes) = scores_and_probabilities(causal, mask, scale, inputs)?;
    let probs = t([bh, p.sq, p.sk]);
    if wrt == 2 {
        parts.push(Part::Gemm {
            desc: gemm(
                true,
                false,
                &probs,
                &t([bh, p.sq, p.dv]),
                &t([bh, p.sk, p.dv]),
            )?,
            a: g,
            b: ArgRef::ScratchAt(p_at),
            d: ArgRef::Output,
        });
    } else {
        let mut dp = gemm(
            false,
            true,
            &t([bh, p.sq, p.dv]),
            &t([bh, p.sk, p.dv]),
            &probs,
        )?;
        dp.out_dtype = DType::F32;
        parts.push(Part::Gemm {
            desc: dp,
            a: ArgRef::Input(2),
            b: g,
            d: ArgRef::ScratchAt(0),
        });
        parts.push(Part::Launch(Launch {
            kernel: grad_softmax_kernel(scale, inputs)?,
            args: vec![ArgRef::ScratchAt(0), ArgRef::ScratchAt(p_at)],
            grid: grid_for((bh * p.sq) as u64, WARPS as u64),
        }));
        let (desc, a) = if wrt == 0 {
            (
                gemm(
                    false,
                    false,
                    &probs,
                    &t([bh, p.sk, p.d]),
                    &t([bh, p.sq, p.d]),
                )?,
                ArgRef::Input(1),
            )
        } else {
            (
                gemm(
                    true,
                    false,
                    &probs,
                    &t([bh, p.sq, p.d]),
                    &t([bh, p.sk, p.d]),
                )?,
                ArgRef::Input(0),
            )
        };
        parts.push(Part::Gemm {
            desc,
            a,
            b: ArgRef::ScratchAt(p_at),
            d: ArgRef::Output,
        });
    }
    Ok(CudaStep::Composite(Composite {
        parts,
        scratch_bytes,
    }))
}

/// The softmax's backward of the GEMM path: a warp per query row reads `dp` (f32) and the
/// probabilities `p`, and overwrites `p` with `dS = P∘(dP − Σ_j P_j dP_j)·scale` in the
/// operands' type. Parameters: `dp`, `p`.
pub fn grad_softmax_kernel(scale: f64, inputs: &[&TensorType]) -> Result<Kernel> {
    let pr = Problem::new(AttnMask::None, inputs);
    let (e, ct) = (pr.e, CTy::F32);
    let (sq, sk) = (pr.sq, pr.sk);
    let rows = (pr.bsz * pr.heads * sq) as i64;
    let lanes = |body: Vec<Stmt>| for_("j", var("lane"), i64c(sk as i64), i64c(WARP), body);
    let at = || add(var("sb"), var("j"));
    let mut body = vec![
        let_("sb", CTy::I64, mul(var("row"), i64c(sk as i64))),
        let_("dd", ct, lit(0.0, ct)),
        lanes(vec![assign(
            "dd",
            add(
                var("dd"),
                mul(to_ct(load("p", e, at()), e, ct), load("dp", CTy::F32, at())),
            ),
        )]),
    ];
    for off in [16, 8, 4, 2, 1] {
        let o = format!("do{off}");
        body.push(let_(&o, ct, bin(BinFn::ShflXor, var("dd"), i32c(off))));
        body.push(assign("dd", add(var("dd"), var(&o))));
    }
    body.push(lanes(vec![
        let_("pj", ct, to_ct(load("p", e, at()), e, ct)),
        store(
            "p",
            e,
            at(),
            mul(
                mul(var("pj"), sub(load("dp", CTy::F32, at()), var("dd"))),
                fc(scale, ct),
            ),
        ),
    ]));
    let params = vec![param("dp", CTy::F32, false), param("p", e, true)];
    let mut all = lane_and_warp();
    all.push(warp_row_loop(rows, WARPS, body));
    finish(
        "attn_softmax_grad",
        Kernel {
            name: String::new(),
            params,
            block: BLOCK,
            smem: 0,
            body: all,
        },
    )
}

/// The softmax of the GEMM path: a warp per query row reads the row's f32 scores `s`, applies
/// `scale`, the mask and the causal limit, and writes the probabilities `p` in the operands' type
/// (zeros past the causal limit and for a fully masked row; NaN for a row with a NaN score).
/// Parameters: `s`, [`mask`], `p`.
pub fn gemm_softmax_kernel(
    causal: Causal,
    mask: AttnMask,
    scale: f64,
    inputs: &[&TensorType],
) -> Result<Kernel> {
    let pr = Problem::new(mask, inputs);
    let (e, ct) = (pr.e, CTy::F32);
    let (sq, sk) = (pr.sq, pr.sk);
    let rows = (pr.bsz * pr.heads * sq) as i64;
    let neg_inf = || fc(f64::NEG_INFINITY, ct);
    // The score of key `j` in `sc`: scaled, masked.
    let score = || {
        let mut v = vec![let_(
            "sc",
            ct,
            mul(load("s", CTy::F32, add(var("sb"), var("j"))), fc(scale, ct)),
        )];
        v.extend(apply_mask(
            mask,
            pr.mask_strides.as_deref(),
            pr.heads,
            e,
            ct,
        ));
        v
    };
    // NaN sticks: a NaN score (or maximum) wins.
    let nan_max = |a: Expr, b: Expr| {
        select(
            bin(
                BinFn::Or,
                un(UnFn::IsNan, b.clone()),
                bin(BinFn::Gt, b.clone(), a.clone()),
            ),
            b,
            a,
        )
    };
    let lanes = |body: Vec<Stmt>, end: Expr| for_("j", var("lane"), end, i64c(WARP), body);
    let mut body = vec![
        let_("i", CTy::I64, rem(var("row"), i64c(sq as i64))),
        let_("bh", CTy::I64, div(var("row"), i64c(sq as i64))),
        let_("sb", CTy::I64, mul(var("row"), i64c(sk as i64))),
        let_("jend", CTy::I64, key_limit(causal, var("i"), sq, sk)),
        let_("m", ct, neg_inf()),
    ];
    let mut pass1 = score();
    pass1.push(assign("m", nan_max(var("m"), var("sc"))));
    body.push(lanes(pass1, var("jend")));
    // The lanes' maxima meet in a butterfly (the shuffle is taken by every lane, before the
    // select that reads it).
    for off in [16, 8, 4, 2, 1] {
        let o = format!("mo{off}");
        body.push(let_(&o, ct, bin(BinFn::ShflXor, var("m"), i32c(off))));
        body.push(assign("m", nan_max(var("m"), var(&o))));
    }
    // A fully masked row: every probability is zero.
    body.push(let_("dead", CTy::Bool, bin(BinFn::Eq, var("m"), neg_inf())));
    body.push(let_("sum", ct, lit(0.0, ct)));
    let mut pass2 = score();
    pass2.push(assign(
        "sum",
        add(var("sum"), un(UnFn::Exp, sub(var("sc"), var("m")))),
    ));
    body.push(if_(
        un(UnFn::Not, var("dead")),
        vec![lanes(pass2, var("jend"))],
    ));
    for off in [16, 8, 4, 2, 1] {
        body.push(assign(
            "sum",
            add(var("sum"), bin(BinFn::ShflXor, var("sum"), i32c(off))),
        ));
    }
    body.push(let_(
        "inv",
        ct,
        select(var("dead"), lit(0.0, ct), div(lit(1.0, ct), var("sum"))),
    ));
    let mut pass3 = score();
    let prob = select(
        bin(
            BinFn::Or,
            var("dead"),
            bin(BinFn::Ge, var("j"), var("jend")),
        ),
        lit(0.0, ct),
        mul(un(UnFn::Exp, sub(var("sc"), var("m"))), var("inv")),
    );
    pass3.push(store("p", e, add(var("sb"), var("j")), prob));
    body.push(lanes(pass3, i64c(sk as i64)));

    let mut params = vec![param("s", CTy::F32, false)];
    if mask != AttnMask::None {
        params.push(param("mask", CTy::storage(inputs[3].dtype), false));
    }
    params.push(param("p", e, true));
    let mut all = lane_and_warp();
    all.push(warp_row_loop(rows, WARPS, body));
    finish(
        "attn_softmax",
        Kernel {
            name: String::new(),
            params,
            block: BLOCK,
            smem: 0,
            body: all,
        },
    )
}
