//! A fast f32 CPU forward kernel for attention, for the many small heads of encoder models
//! (BERT's 32 tokens × 32 dims), in either layout: `[B,H,S,D]`, or `[B,S,H,D]` read in place (a
//! head's rows are then `H·D` apart, so the graph needs no transposes around attention). Per head,
//! `Kᵀ` is transposed once into a scratch buffer, the scores are `q·Kᵀ` and the output `p·V` through
//! the register tile of [`small_gemm`] (row by row without AVX-512), with the vectorized softmax of
//! [`crate::vmath`] between; the head's output rows are written where its layout puts them. The
//! whole head runs compiled for AVX-512 or AVX2+FMA when the CPU has them. Heads run in parallel
//! in blocks when the work is large enough.
//!
//! Semantics are the reference kernel's (`attention::cpu`): causal and mask as there, a query row
//! whose keys are all masked gives zeros, a NaN score makes its row NaN. Accumulation is in f32
//! (the reference accumulates the softmax denominator in f64; both agree to a few f32 ulps,
//! checked in the tests against an f64 reference).

use crate::matmul::packed::small_gemm;
use crate::util::PAR_THRESHOLD;
use crate::vmath;
use crate::{AttnLayout, AttnMask, Causal, Data, HostTensor, Op, Result, Shape, TensorType};

/// The mask as read by the kernel: additive values or keep flags, with broadcast strides over
/// `[B,H,Sq,Sk]`.
enum Mask<'a> {
    None,
    Add(&'a [f32], [usize; 4]),
    Keep(&'a [bool], [usize; 4]),
}

/// One head's geometry.
struct Geo<'a> {
    h: usize,
    sq: usize,
    sk: usize,
    d: usize,
    dv: usize,
    scale: f32,
    causal: Causal,
    mask: Mask<'a>,
    layout: AttnLayout,
}

impl Geo<'_> {
    /// Where head `bh`'s rows of a tensor with `s` rows of `w` elements start, and their stride.
    fn rows(&self, bh: usize, s: usize, w: usize) -> (usize, usize) {
        match self.layout {
            AttnLayout::Bhsd => (bh * s * w, w),
            AttnLayout::Bshd | AttnLayout::Packed => {
                let (b, hh) = (bh / self.h, bh % self.h);
                ((b * s * self.h + hh) * w, self.h * w)
            }
        }
    }
}

/// The forward of `Op::Attention` on f32 tensors (either layout) with this kernel, or `None` when
/// it does not apply (another op, a gradient, another dtype): the caller then runs the reference
/// kernel. `out` is the inferred output type.
pub fn forward_f32(
    op: &Op,
    inputs: &[&HostTensor],
    out: &TensorType,
) -> Result<Option<HostTensor>> {
    let Op::Attention {
        causal,
        mask,
        scale,
        layout,
    } = op
    else {
        return Ok(None);
    };
    let (Data::F32(q), Data::F32(k), Data::F32(v)) =
        (inputs[0].data(), inputs[1].data(), inputs[2].data())
    else {
        return Ok(None);
    };
    let (qd, kd, vd) = (inputs[0].dims(), inputs[1].dims(), inputs[2].dims());
    if qd.len() != 4 || kd.len() != 4 || vd.len() != 4 || out.shape.rank() != 4 {
        return Ok(None);
    }
    // Every dim in the [B,H,S,D] order.
    let (qd, kd, vd) = (layout.to_bhsd(qd), layout.to_bhsd(kd), layout.to_bhsd(vd));
    let (b, h, sq, d) = (qd[0], qd[1], qd[2], qd[3]);
    let (sk, dv) = (kd[2], vd[3]);
    let scores = Shape::new([b, h, sq, sk]);
    let strides = |t: &HostTensor| -> [usize; 4] {
        let s = t.shape().broadcast_strides(&scores);
        [s[0], s[1], s[2], s[3]]
    };
    let mask = match mask {
        AttnMask::None => Mask::None,
        AttnMask::Additive => match inputs[3].data() {
            Data::F32(m) => Mask::Add(m, strides(inputs[3])),
            _ => return Ok(None),
        },
        AttnMask::Bool => Mask::Keep(inputs[3].as_slice::<bool>()?, strides(inputs[3])),
    };
    let geo = Geo {
        h,
        sq,
        sk,
        d,
        dv,
        scale: scale.get() as f32,
        causal: *causal,
        mask,
        layout: *layout,
    };
    let heads = b * h;
    let mut res = vec![0f32; heads * sq * dv];
    if sq * dv > 0 {
        let work = sq * sk * (d + dv);
        // Blocks of heads, one per task: a few tasks per thread (so a core slowed by other work
        // hands its share to the others), each of at least PAR_THRESHOLD work. Every task sets
        // up its scratch buffers once for its whole block.
        let tasks = (4 * crate::par::threads()).clamp(1, heads.max(1));
        let per_task = heads
            .div_ceil(tasks)
            .max(PAR_THRESHOLD.div_ceil(work.max(1)))
            .clamp(1, heads.max(1));
        let o = crate::par::Disjoint::new(&mut res);
        let run = |blk: usize| {
            let heads = blk * per_task..((blk + 1) * per_task).min(heads);
            heads_block(&geo, heads, q, k, v, &o);
        };
        if heads * work >= 2 * PAR_THRESHOLD {
            crate::par::for_each(heads.div_ceil(per_task), run);
        } else {
            run(0);
        }
    }
    HostTensor::from_data(Data::F32(res.into()), out.shape.clone()).map(Some)
}

/// Heads `heads` (a range of `b·H + h` indices): each computed into a scratch block, then its rows
/// written where the layout puts them.
fn heads_block(
    geo: &Geo<'_>,
    heads: std::ops::Range<usize>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &crate::par::Disjoint<'_, f32>,
) {
    let mut kt = vec![0f32; geo.d * geo.sk];
    // Room for the head's whole score matrix (the register-tiled path).
    let mut p = vec![0f32; geo.sq.max(1) * geo.sk];
    let mut oh = vec![0f32; geo.sq * geo.dv];
    for bh in heads {
        head(geo, bh, q, k, v, &mut oh, &mut kt, &mut p);
        let (base, rs) = geo.rows(bh, geo.sq, geo.dv);
        for (i, row) in oh.chunks_exact(geo.dv).enumerate() {
            let at = base + i * rs;
            // SAFETY: row `i` of head `bh` belongs to this head alone in either layout, and each
            // head to one task, so no other task writes these elements.
            unsafe { out.range(at, at + geo.dv) }.copy_from_slice(row);
        }
    }
}

crate::vmath::dispatch! {
    /// Lets the head's loops compile for the widest vector unit the CPU has.
    fn head(
        geo: &Geo<'_>,
        bh: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        o: &mut [f32],
        kt: &mut [f32],
        p: &mut [f32]
    ) {
        head_body(geo, bh, q, k, v, o, kt, p)
    }
}

/// One head: `o [Sq, Dv] = softmax(scale·q·kᵀ + mask) · v`. With AVX-512 both products run
/// through the register-tiled kernel of [`crate::matmul::packed::small_gemm`] over the head's whole
/// score matrix; otherwise row by row.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn head_body(
    geo: &Geo<'_>,
    bh: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &mut [f32],
    kt: &mut [f32],
    p: &mut [f32],
) {
    let Geo {
        sq, sk, d, dv, h, ..
    } = *geo;
    let (b, hh) = (bh / h, bh % h);
    // Each operand's head from its first row to the end of its last (rows `qs`, `ks`, `vs` apart).
    let span = |(base, rs): (usize, usize), rows: usize, w: usize| {
        (base..base + rows.saturating_sub(1) * rs + w, rs)
    };
    let (qr, qs) = span(geo.rows(bh, sq, d), sq, d);
    let (kr, ks) = span(geo.rows(bh, sk, d), sk, d);
    let (vr, vs) = span(geo.rows(bh, sk, dv), sk, dv);
    let (qh, kh, vh) = (&q[qr], &k[kr], &v[vr]);
    for j in 0..sk {
        for t in 0..d {
            kt[t * sk + j] = kh[j * ks + t];
        }
    }
    let scores = &mut p[..sq * sk];
    if sk > 0 && small_gemm(qh, qs, kt, sk, scores, sk, (sq, sk, d)) {
        for (i, row) in scores.chunks_exact_mut(sk).enumerate() {
            if !finish_row(geo, b, hh, i, row) {
                row.iter_mut().for_each(|x| *x = 0.0);
            }
        }
        if small_gemm(scores, sk, vh, vs, o, dv, (sq, dv, sk)) {
            // A row of probabilities is all zeros only where every key was masked: its output
            // is zeros whatever V holds.
            for (orow, prow) in o.chunks_exact_mut(dv.max(1)).zip(scores.chunks_exact(sk)) {
                if prow.iter().all(|&x| x == 0.0) {
                    orow.iter_mut().for_each(|x| *x = 0.0);
                }
            }
            return;
        }
    }
    let p = &mut p[..sk];
    for (i, orow) in o.chunks_exact_mut(dv.max(1)).enumerate().take(sq) {
        p.iter_mut().for_each(|x| *x = 0.0);
        let qi = &qh[i * qs..i * qs + d];
        for (t, &x) in qi.iter().enumerate() {
            for (s, &kv) in p.iter_mut().zip(&kt[t * sk..(t + 1) * sk]) {
                *s = x.mul_add(kv, *s);
            }
        }
        orow.iter_mut().for_each(|x| *x = 0.0);
        if !finish_row(geo, b, hh, i, p) {
            continue;
        }
        for (j, &pj) in p.iter().enumerate() {
            for (y, &x) in orow.iter_mut().zip(&vh[j * vs..j * vs + dv]) {
                *y = pj.mul_add(x, *y);
            }
        }
    }
}

/// Score row `i` of head (`b`, `hh`) to probabilities in place: scale, mask, causal limit,
/// softmax. `false` (the row left as it is) when every key is masked and no score is NaN: the
/// output row is then zeros.
#[inline(always)]
fn finish_row(geo: &Geo<'_>, b: usize, hh: usize, i: usize, p: &mut [f32]) -> bool {
    let (sq, sk) = (geo.sq, geo.sk);
    let limit = match geo.causal {
        Causal::None => sk as i64,
        Causal::TopLeft => i as i64 + 1,
        Causal::BottomRight => i as i64 + 1 + sk as i64 - sq as i64,
    }
    .clamp(0, sk as i64) as usize;
    p.iter_mut().for_each(|s| *s *= geo.scale);
    match &geo.mask {
        Mask::None => {}
        Mask::Add(m, st) => {
            let base = b * st[0] + hh * st[1] + i * st[2];
            if st[3] == 1 {
                for (s, &a) in p.iter_mut().zip(&m[base..base + sk]) {
                    *s += a;
                }
            } else {
                for (j, s) in p.iter_mut().enumerate() {
                    *s += m[base + j * st[3]];
                }
            }
        }
        Mask::Keep(m, st) => {
            let base = b * st[0] + hh * st[1] + i * st[2];
            for (j, s) in p.iter_mut().enumerate() {
                if !m[base + j * st[3]] {
                    *s = f32::NEG_INFINITY;
                }
            }
        }
    }
    p[limit..].iter_mut().for_each(|s| *s = f32::NEG_INFINITY);
    // Every key masked (all −∞, no NaN): the row stays zeros. Stops at the first key kept.
    if p.iter().all(|&s| s == f32::NEG_INFINITY) {
        return false;
    }
    vmath::softmax_row(p);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{rand_f64, swap_heads as swap};
    use crate::{eval_cpu, DType};

    /// `Op::Attention` in the `[B,H,S,D]` layout, through the op's textual form.
    fn attention(causal: Causal, mask: AttnMask, scale: f64) -> Op {
        let c = match causal {
            Causal::None => "none",
            Causal::TopLeft => "top_left",
            Causal::BottomRight => "bottom_right",
        };
        let m = match mask {
            AttnMask::None => "none",
            AttnMask::Additive => "additive",
            AttnMask::Bool => "bool",
        };
        crate::text::parse_op(&format!("attention[causal={c},mask={m},scale={scale:?}]")).unwrap()
    }

    fn t(dims: &[usize], seed: u64) -> HostTensor {
        let n = dims.iter().product();
        let v: Vec<f32> = rand_f64(n, seed, -2.0, 2.0)
            .into_iter()
            .map(|x| x as f32)
            .collect();
        HostTensor::from_vec(v, dims.to_vec()).unwrap()
    }

    /// f64 attention of one head set, straight from the definition.
    fn reference(
        q: &[f64],
        k: &[f64],
        v: &[f64],
        dims: (usize, usize, usize, usize, usize),
        scale: f64,
        keep: &dyn Fn(usize, usize, usize) -> Option<f64>,
    ) -> Vec<f64> {
        let (heads, sq, sk, d, dv) = dims;
        let mut out = vec![0.0; heads * sq * dv];
        for bh in 0..heads {
            for i in 0..sq {
                let s: Vec<Option<f64>> = (0..sk)
                    .map(|j| {
                        keep(bh, i, j).map(|add| {
                            (0..d)
                                .map(|t| q[(bh * sq + i) * d + t] * k[(bh * sk + j) * d + t])
                                .sum::<f64>()
                                * scale
                                + add
                        })
                    })
                    .collect();
                let m = s.iter().flatten().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                if m == f64::NEG_INFINITY {
                    continue;
                }
                let e: Vec<f64> = s.iter().map(|x| x.map_or(0.0, |x| (x - m).exp())).collect();
                let z: f64 = e.iter().sum();
                for j in 0..sk {
                    for c in 0..dv {
                        out[(bh * sq + i) * dv + c] += e[j] / z * v[(bh * sk + j) * dv + c];
                    }
                }
            }
        }
        out
    }

    fn close(got: &HostTensor, want: &[f64]) {
        let g = got.to_vec::<f32>().unwrap();
        assert_eq!(g.len(), want.len());
        for (i, (&a, &w)) in g.iter().zip(want).enumerate() {
            assert!(
                (a as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "element {i}: {a} vs {w}"
            );
        }
    }

    #[test]
    fn matches_f64_with_additive_mask_and_causal() {
        let (b, h, sq, sk, d, dv) = (2, 3, 5, 7, 6, 4);
        let (q, k, v) = (
            t(&[b, h, sq, d], 1),
            t(&[b, h, sk, d], 2),
            t(&[b, h, sk, dv], 3),
        );
        let mask = t(&[b, 1, 1, sk], 4);
        let scale = 0.4;
        let (q64, k64, v64, m64) = (
            q.to_f64_vec(),
            k.to_f64_vec(),
            v.to_f64_vec(),
            mask.to_f64_vec(),
        );
        for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
            let op = attention(causal, AttnMask::Additive, scale);
            let out = TensorType::new(DType::F32, [b, h, sq, dv]);
            let got = forward_f32(&op, &[&q, &k, &v, &mask], &out)
                .unwrap()
                .unwrap();
            let keep = |bh: usize, i: usize, j: usize| {
                let lim = match causal {
                    Causal::None => sk,
                    Causal::TopLeft => i + 1,
                    Causal::BottomRight => i + 1 + sk - sq,
                };
                (j < lim).then(|| m64[(bh / h) * sk + j])
            };
            let want = reference(&q64, &k64, &v64, (b * h, sq, sk, d, dv), scale, &keep);
            close(&got, &want);
            // And the reference kernel agrees.
            close(&eval_cpu(&op, &[&q, &k, &v, &mask]).unwrap(), &want);
        }
    }

    #[test]
    fn bool_mask_and_fully_masked_rows() {
        let (b, h, sq, sk, d) = (1, 2, 4, 33, 32);
        let (q, k, v) = (
            t(&[b, h, sq, d], 5),
            t(&[b, h, sk, d], 6),
            t(&[b, h, sk, d], 7),
        );
        // Row 1 of every head sees no key; the others see every third key.
        let keepv: Vec<bool> = (0..sq * sk).map(|x| x / sk != 1 && x % 3 == 0).collect();
        let mask = HostTensor::from_vec(keepv.clone(), [1, 1, sq, sk]).unwrap();
        let op = attention(Causal::None, AttnMask::Bool, 0.2);
        let out = TensorType::new(DType::F32, [b, h, sq, d]);
        let got = forward_f32(&op, &[&q, &k, &v, &mask], &out)
            .unwrap()
            .unwrap();
        let keep = |_: usize, i: usize, j: usize| keepv[i * sk + j].then_some(0.0);
        let want = reference(
            &q.to_f64_vec(),
            &k.to_f64_vec(),
            &v.to_f64_vec(),
            (b * h, sq, sk, d, d),
            0.2,
            &keep,
        );
        close(&got, &want);
        let g = got.to_vec::<f32>().unwrap();
        assert!(g[d..2 * d].iter().all(|&x| x == 0.0));
    }

    #[test]
    fn many_heads_in_parallel_blocks() {
        // BERT's shape: 8 × 12 heads of 32 × 32, with a [B,1,1,S] additive mask.
        let (b, h, s, d) = (8, 12, 32, 32);
        let (q, k, v) = (
            t(&[b, h, s, d], 8),
            t(&[b, h, s, d], 9),
            t(&[b, h, s, d], 10),
        );
        let mask = t(&[b, 1, 1, s], 11);
        let op = attention(Causal::None, AttnMask::Additive, 1.0 / 32f64.sqrt());
        let out = TensorType::new(DType::F32, [b, h, s, d]);
        let got = forward_f32(&op, &[&q, &k, &v, &mask], &out)
            .unwrap()
            .unwrap();
        let m64 = mask.to_f64_vec();
        let keep = |bh: usize, _: usize, j: usize| Some(m64[(bh / h) * s + j]);
        let want = reference(
            &q.to_f64_vec(),
            &k.to_f64_vec(),
            &v.to_f64_vec(),
            (b * h, s, s, d, d),
            1.0 / 32f64.sqrt(),
            &keep,
        );
        close(&got, &want);
    }

    #[test]
    fn heads_read_in_place_match_the_transposed_layout() {
        // Sq ≠ Sk and D ≠ Dv; BERT-sized batch so the heads run in parallel blocks too.
        for (b, h, sq, sk, d, dv) in [(2, 3, 5, 7, 6, 4), (8, 12, 32, 40, 32, 24)] {
            let (q, k, v) = (
                t(&[b, h, sq, d], 21),
                t(&[b, h, sk, d], 22),
                t(&[b, h, sk, dv], 23),
            );
            let mask = t(&[b, 1, 1, sk], 24);
            let bool_mask = HostTensor::from_vec(
                (0..sq * sk).map(|x| x % 5 != 2).collect::<Vec<bool>>(),
                [1, 1, sq, sk],
            )
            .unwrap();
            for (kind, m) in [
                (AttnMask::None, None),
                (AttnMask::Additive, Some(&mask)),
                (AttnMask::Bool, Some(&bool_mask)),
            ] {
                for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
                    let op = attention(causal, kind, 0.3);
                    let mut ins = vec![&q, &k, &v];
                    ins.extend(m);
                    let want = forward_f32(&op, &ins, &TensorType::new(DType::F32, [b, h, sq, dv]))
                        .unwrap()
                        .unwrap();
                    let (qs, ks, vs) = (swap(&q), swap(&k), swap(&v));
                    let mut ins = vec![&qs, &ks, &vs];
                    ins.extend(m);
                    let bshd = op.with_attn_layout(AttnLayout::Bshd);
                    let out = TensorType::new(DType::F32, [b, sq, h, dv]);
                    let got = forward_f32(&bshd, &ins, &out).unwrap().unwrap();
                    // The same arithmetic on the same rows: equal bit for bit.
                    assert_eq!(
                        got.to_vec::<f32>().unwrap(),
                        swap(&want).to_vec::<f32>().unwrap(),
                        "{causal:?} {kind:?} {:?}",
                        (b, h, sq, sk, d, dv)
                    );
                    // The op's CPU kernel takes the same path.
                    assert_eq!(
                        eval_cpu(&bshd, &ins).unwrap().to_vec::<f32>().unwrap(),
                        got.to_vec::<f32>().unwrap()
                    );
                }
            }
        }
    }

    #[test]
    fn other_dtypes_and_ops_are_left_to_the_reference() {
        let q = HostTensor::from_vec(vec![1.0f64; 8], [1, 1, 2, 4]).unwrap();
        let op = attention(Causal::None, AttnMask::None, 1.0);
        let out = TensorType::new(DType::F64, [1, 1, 2, 4]);
        assert!(forward_f32(&op, &[&q, &q, &q], &out).unwrap().is_none());
        let relu = Op::Unary(crate::UnaryOp::Relu);
        assert!(forward_f32(&relu, &[&q, &q, &q], &out).unwrap().is_none());
    }
}
