//! Scaled dot-product attention and its gradient.
//!
//! Inputs `q [B,H,Sq,D]`, `k [B,H,Sk,D]`, `v [B,H,Sk,Dv]` of one float dtype, and an optional mask
//! broadcastable to `[B,H,Sq,Sk]` (additive: q's dtype, added to the scores; bool: true = keep).
//! The batch dims `B, H` must match exactly between q, k and v (no broadcasting); the output is
//! `[B,H,Sq,Dv]`. Causal masking is `TopLeft` (query i sees keys j <= i) or `BottomRight`
//! (j <= i + Sk − Sq). A query row whose keys are all masked (causally, by a false bool mask or by
//! −∞ additive values) gives an all-zero output row and contributes zero gradient, never NaN.
//! The mask input gets no gradient.
//!
//! The CPU kernels work one (batch, head) pair at a time, in parallel, in f64 for f64 tensors and
//! in f32 otherwise (the softmax denominators accumulate in f64, pairwise); the gradient recomputes
//! the probabilities.

use crate::norm::{acc_sum, compute_view, from_compute, Real};
use crate::util::{arity, attr_err, dtype_err, shape_err, PAR_THRESHOLD};
use crate::{
    AttnLayout, AttnMask, Causal, DType, HostTensor, Op, Result, Shape, TensorType, Value, VjpCtx,
    ATTN_WRT_PACKED,
};
use rayon::prelude::*;

/// The attributes shared by attention and its gradient.
struct Attrs {
    causal: Causal,
    mask: AttnMask,
    scale: f64,
    wrt: Option<u8>,
    layout: AttnLayout,
}

fn attrs(op: &Op) -> Result<Attrs> {
    match *op {
        Op::Attention {
            causal,
            mask,
            scale,
            layout,
        } => Ok(Attrs {
            causal,
            mask,
            scale: scale.get(),
            wrt: None,
            layout,
        }),
        Op::AttentionGrad {
            causal,
            mask,
            scale,
            wrt,
            layout,
        } => Ok(Attrs {
            causal,
            mask,
            scale: scale.get(),
            wrt: Some(wrt),
            layout,
        }),
        _ => Err(attr_err(op, "not an attention op")),
    }
}

/// Output type.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    let Attrs {
        mask, wrt, layout, ..
    } = attrs(op)?;
    let has_mask = mask != AttnMask::None;
    arity(op, inputs, 3 + has_mask as usize + wrt.is_some() as usize)?;
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    if !q.dtype.is_float() {
        return Err(dtype_err(op, inputs, "q must be a float tensor"));
    }
    if k.dtype != q.dtype || v.dtype != q.dtype {
        return Err(dtype_err(op, inputs, "q, k and v must have one dtype"));
    }
    if layout == AttnLayout::Packed {
        let d = q.shape.dims();
        if d.len() != 5 || d[2] != 3 || k != q || v != q {
            return Err(shape_err(
                op,
                inputs,
                "packed q, k and v must be one [B,S,3,H,D] tensor",
            ));
        }
    } else if q.shape.rank() != 4 || k.shape.rank() != 4 || v.shape.rank() != 4 {
        return Err(shape_err(
            op,
            inputs,
            match layout {
                AttnLayout::Bhsd => "q, k and v must be [B,H,Sq,D], [B,H,Sk,D], [B,H,Sk,Dv]",
                _ => "q, k and v must be [B,Sq,H,D], [B,Sk,H,D], [B,Sk,H,Dv]",
            },
        ));
    }
    let (qd, kd, vd) = (
        layout.to_bhsd(q.shape.dims()),
        layout.to_bhsd(k.shape.dims()),
        layout.to_bhsd(v.shape.dims()),
    );
    if qd[..2] != kd[..2] || qd[..2] != vd[..2] {
        return Err(shape_err(
            op,
            inputs,
            "batch dims B, H must match exactly between q, k and v",
        ));
    }
    if kd[3] != qd[3] {
        return Err(shape_err(
            op,
            inputs,
            "q and k must have the same head dim D",
        ));
    }
    if vd[2] != kd[2] {
        return Err(shape_err(
            op,
            inputs,
            "k and v must have the same length Sk",
        ));
    }
    if has_mask {
        let m = inputs[3];
        let want = match mask {
            AttnMask::Bool => DType::Bool,
            _ => q.dtype,
        };
        if m.dtype != want {
            return Err(dtype_err(
                op,
                inputs,
                format!("the {mask:?} mask must be {want}"),
            ));
        }
        let scores = Shape::new([qd[0], qd[1], qd[2], kd[2]]);
        if !m.shape.broadcasts_to(&scores) {
            return Err(shape_err(
                op,
                inputs,
                format!("the mask must broadcast to the scores' shape {scores}"),
            ));
        }
    }
    let out = TensorType::new(q.dtype, layout.from_bhsd([qd[0], qd[1], qd[2], vd[3]]));
    match wrt {
        None => Ok(out),
        Some(w) => {
            let g = inputs[inputs.len() - 1];
            if g != &out {
                return Err(shape_err(
                    op,
                    inputs,
                    format!("grad_out must be the output's type {out}"),
                ));
            }
            match (w, layout) {
                (ATTN_WRT_PACKED, AttnLayout::Packed) => Ok(q.clone()),
                (_, AttnLayout::Packed) => Err(attr_err(
                    op,
                    format!("a packed attention's gradient has wrt {ATTN_WRT_PACKED}, got {w}"),
                )),
                (0..=2, _) => Ok(inputs[w as usize].clone()),
                _ => Err(attr_err(op, format!("wrt must be 0, 1 or 2, got {w}"))),
            }
        }
    }
}

/// A mask read through its broadcast strides.
enum MaskView<'a, C> {
    None,
    Add(&'a [C], Vec<usize>),
    Bool(&'a [bool], Vec<usize>),
}

/// Everything one head's kernel needs besides its data.
struct Geometry<'a, C> {
    sq: usize,
    sk: usize,
    d: usize,
    dv: usize,
    h: usize,
    scale: C,
    causal: Causal,
    mask: MaskView<'a, C>,
}

impl<C: Real> Geometry<'_, C> {
    /// The probabilities `P [Sq, Sk]` of head `bh` (rows of fully masked queries are zero).
    fn probs(&self, bh: usize, q: &[C], k: &[C]) -> Vec<C> {
        let (sq, sk, d) = (self.sq, self.sk, self.d);
        let (b, h) = (bh / self.h, bh % self.h);
        let mut p = vec![C::ZERO; sq * sk];
        for (i, prow) in p.chunks_mut(sk.max(1)).enumerate().take(sq) {
            let qi = &q[i * d..(i + 1) * d];
            let limit = match self.causal {
                Causal::None => sk as i64,
                Causal::TopLeft => i as i64 + 1,
                Causal::BottomRight => i as i64 + 1 + sk as i64 - sq as i64,
            }
            .clamp(0, sk as i64) as usize;
            let mut m = C::NEG_INF;
            for j in 0..sk {
                let mut s = C::NEG_INF;
                if j < limit {
                    let keep = match &self.mask {
                        MaskView::Bool(mv, st) => mv[b * st[0] + h * st[1] + i * st[2] + j * st[3]],
                        _ => true,
                    };
                    if keep {
                        s = dot(qi, &k[j * d..(j + 1) * d]) * self.scale;
                        if let MaskView::Add(mv, st) = &self.mask {
                            s += mv[b * st[0] + h * st[1] + i * st[2] + j * st[3]];
                        }
                    }
                }
                if s > m || s.is_nan() {
                    m = s;
                }
                prow[j] = s;
            }
            if m == C::NEG_INF {
                // Every key masked: the row stays zero.
                prow.iter_mut().for_each(|x| *x = C::ZERO);
                continue;
            }
            for x in prow.iter_mut() {
                *x = (*x - m).exp();
            }
            let inv = C::from_acc(C::Acc::ONE / acc_sum(prow, &|e: C| e.acc()));
            for x in prow.iter_mut() {
                *x = *x * inv;
            }
        }
        p
    }
}

/// `Σ a·b` in 8 independent lanes (so the loop vectorizes and is not bound by the latency of
/// one running sum), combined pairwise.
#[inline]
fn dot<C: Real>(a: &[C], b: &[C]) -> C {
    let mut l = [C::ZERO; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            l[j] += x[j] * y[j];
        }
    }
    let mut tail = C::ZERO;
    for (&x, &y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])) + tail
}

/// `out [m, n] = a [m, l] · b [l, n]`, accumulated row by row.
fn matmul_nn<C: Real>(a: &[C], b: &[C], out: &mut [C], m: usize, l: usize, n: usize) {
    for i in 0..m {
        let orow = &mut out[i * n..(i + 1) * n];
        for t in 0..l {
            let x = a[i * l + t];
            if x == C::ZERO {
                continue;
            }
            for (o, &y) in orow.iter_mut().zip(&b[t * n..(t + 1) * n]) {
                *o += x * y;
            }
        }
    }
}

/// `out [l, n] = aᵀ · b` for `a [m, l]`, `b [m, n]`.
fn matmul_tn<C: Real>(a: &[C], b: &[C], out: &mut [C], m: usize, l: usize, n: usize) {
    for i in 0..m {
        let brow = &b[i * n..(i + 1) * n];
        for t in 0..l {
            let x = a[i * l + t];
            if x == C::ZERO {
                continue;
            }
            for (o, &y) in out[t * n..(t + 1) * n].iter_mut().zip(brow) {
                *o += x * y;
            }
        }
    }
}

/// CPU kernel. The f32 forward reads either layout in place; otherwise the `[B,S,H,D]` layout
/// runs as `[B,H,S,D]` between two transposes.
pub fn cpu(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    let a = attrs(op)?;
    // f32 forward attention of many small heads has a kernel of its own.
    if let Some(r) = crate::attention_cpu::forward_f32(op, inputs, out)? {
        return Ok(r);
    }
    if a.layout == AttnLayout::Packed {
        return cpu_packed(op, inputs, out, a.wrt.is_some());
    }
    if a.layout == AttnLayout::Bshd {
        let swap = || Op::Permute {
            perm: vec![0, 2, 1, 3],
        };
        let has_mask = a.mask != AttnMask::None;
        let moved = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if has_mask && i == 3 {
                    Ok((*t).clone())
                } else {
                    crate::eval_cpu(&swap(), &[t])
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&HostTensor> = moved.iter().collect();
        let bhsd = TensorType::new(out.dtype, AttnLayout::Bshd.to_bhsd(out.shape.dims()));
        let r = cpu(&op.with_attn_layout(AttnLayout::Bhsd), &refs, &bhsd)?;
        return crate::eval_cpu(&swap(), &[&r]);
    }
    if out.dtype == DType::F64 {
        cpu_in::<f64>(op, inputs, out)
    } else {
        cpu_in::<f32>(op, inputs, out)
    }
}

/// The packed layout on the CPU: q, k and v sliced out of their `[B,S,3,H,D]` tensor, the
/// `[B,S,H,D]` kernel, and for the gradient its three results concatenated where q, k and v lie.
fn cpu_packed(op: &Op, inputs: &[&HostTensor], out: &TensorType, grad: bool) -> Result<HostTensor> {
    let pd = inputs[0].dims().to_vec();
    let part = |j: usize| -> Result<HostTensor> {
        let mut starts = vec![0; 5];
        let mut ends = pd.clone();
        starts[2] = j;
        ends[2] = j + 1;
        let s = crate::eval_cpu(
            &Op::Slice {
                starts,
                ends,
                steps: vec![1; 5],
            },
            &[inputs[0]],
        )?;
        crate::eval_cpu(
            &Op::Reshape {
                shape: Shape::new([pd[0], pd[1], pd[3], pd[4]]),
            },
            &[&s],
        )
    };
    let (q, k, v) = (part(0)?, part(1)?, part(2)?);
    let mut args = vec![&q, &k, &v];
    args.extend(&inputs[3..]);
    let bshd = op.with_attn_layout(AttnLayout::Bshd);
    let one = TensorType::new(out.dtype, Shape::new([pd[0], pd[1], pd[3], pd[4]]));
    if !grad {
        return cpu(&bshd, &args, &one);
    }
    let part_ty = TensorType::new(out.dtype, Shape::new([pd[0], pd[1], 1, pd[3], pd[4]]));
    let grads = (0..3u8)
        .map(|w| {
            let Op::AttentionGrad {
                causal,
                mask,
                scale,
                ..
            } = *op
            else {
                return Err(attr_err(op, "not an attention gradient"));
            };
            let g = Op::AttentionGrad {
                causal,
                mask,
                scale,
                wrt: w,
                layout: AttnLayout::Bshd,
            };
            let r = cpu(&g, &args, &one)?;
            crate::eval_cpu(
                &Op::Reshape {
                    shape: part_ty.shape.clone(),
                },
                &[&r],
            )
        })
        .collect::<Result<Vec<_>>>()?;
    crate::eval_cpu(&Op::Concat { axis: 2 }, &grads.iter().collect::<Vec<_>>())
}

fn cpu_in<C: Real>(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    let Attrs {
        causal,
        mask,
        scale,
        wrt,
        ..
    } = attrs(op)?;
    let qd = inputs[0].dims();
    let (bsz, h, sq, d) = (qd[0], qd[1], qd[2], qd[3]);
    let (sk, dv) = (inputs[1].dims()[2], inputs[2].dims()[3]);
    let scores = Shape::new([bsz, h, sq, sk]);
    let add_mask;
    let mask = match mask {
        AttnMask::None => MaskView::None,
        AttnMask::Additive => {
            add_mask = compute_view::<C>(inputs[3]);
            MaskView::Add(&add_mask, inputs[3].shape().broadcast_strides(&scores))
        }
        AttnMask::Bool => MaskView::Bool(
            inputs[3].as_slice::<bool>()?,
            inputs[3].shape().broadcast_strides(&scores),
        ),
    };
    let geo = Geometry {
        sq,
        sk,
        d,
        dv,
        h,
        scale: C::from_f64(scale),
        causal,
        mask,
    };
    let q = compute_view::<C>(inputs[0]);
    let k = compute_view::<C>(inputs[1]);
    let v = compute_view::<C>(inputs[2]);
    let heads = bsz * h;
    let par = heads > 1 && heads * sq * sk * (d + dv) >= PAR_THRESHOLD;
    let mut res = vec![C::ZERO; out.shape.numel()];
    let chunk = res.len().checked_div(heads).unwrap_or(0);
    if chunk == 0 {
        return from_compute(res, out);
    }
    let (q, k, v) = (&q[..], &k[..], &v[..]);
    match wrt {
        None => {
            let head = |(bh, o): (usize, &mut [C])| {
                let p = geo.probs(bh, &q[bh * sq * d..], &k[bh * sk * d..]);
                matmul_nn(&p, &v[bh * sk * dv..(bh + 1) * sk * dv], o, sq, sk, dv);
            };
            if par {
                res.par_chunks_mut(chunk).enumerate().for_each(head);
            } else {
                res.chunks_mut(chunk).enumerate().for_each(head);
            }
        }
        Some(w) => {
            let g = compute_view::<C>(inputs[inputs.len() - 1]);
            let g = &g[..];
            let head = |(bh, o): (usize, &mut [C])| {
                let qh = &q[bh * sq * d..(bh + 1) * sq * d];
                let kh = &k[bh * sk * d..(bh + 1) * sk * d];
                let vh = &v[bh * sk * dv..(bh + 1) * sk * dv];
                let gh = &g[bh * sq * dv..(bh + 1) * sq * dv];
                let p = geo.probs(bh, qh, kh);
                attention_grad_head(&geo, w, &p, qh, kh, vh, gh, o);
            };
            if par {
                res.par_chunks_mut(chunk).enumerate().for_each(head);
            } else {
                res.chunks_mut(chunk).enumerate().for_each(head);
            }
        }
    }
    from_compute(res, out)
}

/// One head's gradient with respect to input `wrt`, written into `o`.
fn attention_grad_head<C: Real>(
    geo: &Geometry<'_, C>,
    wrt: u8,
    p: &[C],
    q: &[C],
    k: &[C],
    v: &[C],
    g: &[C],
    o: &mut [C],
) {
    let (sq, sk, d, dv) = (geo.sq, geo.sk, geo.d, geo.dv);
    if wrt == 2 {
        // dV = Pᵀ · dO
        matmul_tn(p, g, o, sq, sk, dv);
        return;
    }
    // dP = dO · Vᵀ, dS = P ∘ (dP − rowsum(P ∘ dP)), the last term being rowsum(dO ∘ O).
    let mut ds = vec![C::ZERO; sq * sk];
    for i in 0..sq {
        let gi = &g[i * dv..(i + 1) * dv];
        let prow = &p[i * sk..(i + 1) * sk];
        let drow = &mut ds[i * sk..(i + 1) * sk];
        let mut rs = C::ZERO;
        for j in 0..sk {
            if prow[j] == C::ZERO {
                continue;
            }
            let mut dot = C::ZERO;
            for (&a, &b) in gi.iter().zip(&v[j * dv..(j + 1) * dv]) {
                dot += a * b;
            }
            drow[j] = dot;
            rs += prow[j] * dot;
        }
        for j in 0..sk {
            drow[j] = prow[j] * (drow[j] - rs) * geo.scale;
        }
    }
    if wrt == 0 {
        // dQ = scale · dS · K
        matmul_nn(&ds, k, o, sq, sk, d);
    } else {
        // dK = scale · dSᵀ · Q
        matmul_tn(&ds, q, o, sq, sk, d);
    }
}

/// Gradient rule: q, k and v each get an [`Op::AttentionGrad`] node; the mask gets none. The
/// gradient op itself has no gradient (second order is not supported).
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    let op = cx.op.clone();
    match op {
        Op::Attention {
            layout: AttnLayout::Packed,
            mask,
            ..
        } => {
            // q, k and v are one tensor: its whole gradient comes through the first operand.
            let mut args: Vec<Value> = cx.inputs.to_vec();
            args.push(cx.grad);
            let grad = op.attention_grad(ATTN_WRT_PACKED).expect("an attention op");
            let mut out = vec![Some(cx.emit(grad, &args)?), None, None];
            if mask != AttnMask::None {
                out.push(None);
            }
            Ok(out)
        }
        Op::Attention { mask, .. } => {
            let mut args: Vec<Value> = cx.inputs.to_vec();
            args.push(cx.grad);
            let mut out = Vec::with_capacity(cx.inputs.len());
            for wrt in 0..3u8 {
                let grad = op.attention_grad(wrt).expect("an attention op");
                out.push(Some(cx.emit(grad, &args)?));
            }
            if mask != AttnMask::None {
                out.push(None);
            }
            Ok(out)
        }
        Op::AttentionGrad { wrt, .. } => Err(cx.not_differentiable(
            wrt as usize,
            "second-order gradients of attention are not supported",
        )),
        op => Err(attr_err(&op, "not an attention op")),
    }
}
