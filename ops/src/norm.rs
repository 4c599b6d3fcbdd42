//! Normalization ops: softmax and log-softmax along an axis, LayerNorm and RMSNorm over the last
//! dim. Kernels run in f64 for f64 tensors and in f32 otherwise (f16/bf16 rounded once at the end),
//! rows in parallel for large tensors. Gradients are written with primitive ops.
//!
//! The softmax of f32 rows along the last axis runs in the vectorized kernel of
//! [`crate::vmath::softmax_rows`] (exp within 2 ulp, the denominator in f64 lanes).
//!
//! Accuracy: every sum accumulates in f64 ([`Real::Acc`]), so long rows lose nothing to
//! accumulation: softmax denominators in blocks summed pairwise ([`acc_sum`]), the norms' mean and
//! variance in 32 lanes along the row ([`row_sum`], vectorized with the rest of the row's loops
//! for AVX-512 or AVX2 when the CPU has them).
//! LayerNorm is two-pass (mean, then the mean of squared deviations), and the normalized value `(x − mean) · rstd` (with weight and bias) is formed in f64 and rounded once.
//!
//! This file also holds the small float-compute helpers ([`Real`], [`acc_sum`], [`compute_view`],
//! [`from_compute`]) that the index, loss and attention kernels share.

use crate::util::{arity, attr_err, dtype_err, shape_err, PAR_THRESHOLD};
use crate::{
    DType, Element, HostElement, HostTensor, Op, ReduceKind, Result, Shape, TensorType, UnaryOp,
    Value, VjpCtx,
};
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::{Add, AddAssign, Div, Mul, Neg, Sub};

/// A float compute type of the CPU kernels (f32 or f64).
pub(crate) trait Real:
    HostElement
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
{
    /// The type sums of `Self` accumulate in: f64 for both f32 and f64.
    type Acc: Real;
    /// 0
    const ZERO: Self;
    /// 1
    const ONE: Self;
    /// -∞
    const NEG_INF: Self;
    /// e^x
    fn exp(self) -> Self;
    /// ln x
    fn ln(self) -> Self;
    /// A count as a float.
    fn from_usize(n: usize) -> Self;
    /// x is NaN.
    fn is_nan(self) -> bool;
    /// Widened to the accumulator (exact).
    fn acc(self) -> Self::Acc;
    /// An accumulator value rounded to `Self`.
    fn from_acc(a: Self::Acc) -> Self;
    /// Softmax of each contiguous row of `n` in place through a vectorized kernel, where this
    /// type has one (returns false otherwise, and changes nothing).
    #[inline(always)]
    fn softmax_rows(_y: &mut [Self], _n: usize) -> bool {
        false
    }
    /// LayerNorm or RMSNorm of each contiguous row of `d` elements of `x` into `y`, compiled for
    /// the widest vector unit the CPU has ([`norm_row`]).
    fn norm_rows(x: &[Self], y: &mut [Self], d: usize, aff: Affine<'_, Self>, eps: f64);
}

/// A norm's optional weight and bias, and whether it is centered (LayerNorm) or not (RMSNorm).
#[derive(Clone, Copy)]
pub(crate) struct Affine<'a, C> {
    w: Option<&'a [C]>,
    b: Option<&'a [C]>,
    centered: bool,
}

macro_rules! real {
    ($t:ty, { $($extra:item)* }) => {
        impl Real for $t {
            $($extra)*
            type Acc = f64;
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INF: Self = <$t>::NEG_INFINITY;
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn from_usize(n: usize) -> Self {
                n as $t
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            #[inline(always)]
            fn acc(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn from_acc(a: f64) -> Self {
                a as $t
            }
        }
    };
}
real!(f32, {
    fn softmax_rows(y: &mut [f32], n: usize) -> bool {
        crate::vmath::softmax_rows(y, n);
        true
    }
    fn norm_rows(x: &[f32], y: &mut [f32], d: usize, aff: Affine<'_, f32>, eps: f64) {
        norm_rows_f32(x, y, d, aff, eps)
    }
});
real!(f64, {
    fn norm_rows(x: &[f64], y: &mut [f64], d: usize, aff: Affine<'_, f64>, eps: f64) {
        norm_rows_f64(x, y, d, aff, eps)
    }
});

crate::vmath::dispatch! {
    /// [`norm_row`] over f32 rows, vectorized.
    fn norm_rows_f32(x: &[f32], y: &mut [f32], d: usize, aff: Affine<'_, f32>, eps: f64) {
        for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
            norm_row(xr, yr, aff, eps);
        }
    }
}

crate::vmath::dispatch! {
    /// [`norm_row`] over f64 rows, vectorized.
    fn norm_rows_f64(x: &[f64], y: &mut [f64], d: usize, aff: Affine<'_, f64>, eps: f64) {
        for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
            norm_row(xr, yr, aff, eps);
        }
    }
}

/// Elements summed sequentially (in 8 interleaved lanes) before blocks are combined pairwise.
pub(crate) const SUM_BLOCK: usize = 128;

/// `Σ f(x)` over `xs` in the accumulator `A`: blocks of [`SUM_BLOCK`] in 8 lanes, halves combined
/// recursively, so the rounding error grows with `log n` (and in f64 stays far below an f32 ulp).
pub(crate) fn acc_sum<T: Copy, A: Real>(xs: &[T], f: &impl Fn(T) -> A) -> A {
    if xs.len() <= SUM_BLOCK {
        let mut l = [A::ZERO; 8];
        let mut chunks = xs.chunks_exact(8);
        for c in &mut chunks {
            for j in 0..8 {
                l[j] += f(c[j]);
            }
        }
        let mut tail = A::ZERO;
        for &x in chunks.remainder() {
            tail += f(x);
        }
        return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])) + tail;
    }
    let (lo, hi) = xs.split_at((xs.len() / 2).next_multiple_of(8));
    acc_sum(lo, f) + acc_sum(hi, f)
}

/// The elements of a float tensor in compute type `C`: borrowed when the dtype is `C`, converted
/// once otherwise (f16/bf16 to f32 is exact).
pub(crate) fn compute_view<C: Real>(t: &HostTensor) -> Cow<'_, [C]> {
    match C::view(t.data()) {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(
            crate::with_data!(t.data(), v => v.iter().map(|x| C::from_f64(Element::to_f64(*x))).collect()),
        ),
    }
}

/// A tensor of type `ty` from values computed in `C`, each rounded once to `ty.dtype`.
pub(crate) fn from_compute<C: Real>(v: Vec<C>, ty: &TensorType) -> Result<HostTensor> {
    if ty.dtype == C::DTYPE {
        return HostTensor::from_data(C::wrap(v), ty.shape.clone());
    }
    let data = crate::with_dtype!(ty.dtype, T => <T as HostElement>::wrap(
        v.iter().map(|&c| <T as Element>::from_f64(c.to_f64())).collect()
    ));
    HostTensor::from_data(data, ty.shape.clone())
}

/// Splits `dims` around `axis`: (product before, the axis, product after).
pub(crate) fn split_axis(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    let outer = dims[..axis].iter().product();
    let inner = dims[axis + 1..].iter().product();
    (outer, dims[axis], inner)
}

/// Output type.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    match op {
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            arity(op, inputs, 1)?;
            let x = inputs[0];
            if !x.dtype.is_float() {
                return Err(dtype_err(op, inputs, "input must be a float tensor"));
            }
            if *axis >= x.shape.rank() {
                return Err(attr_err(
                    op,
                    format!("axis {axis} out of range for rank {}", x.shape.rank()),
                ));
            }
            Ok(x.clone())
        }
        Op::LayerNorm { weight, bias, .. } => {
            let n = 1 + *weight as usize + *bias as usize;
            norm_infer(op, inputs, n)
        }
        Op::RmsNorm { weight, .. } => norm_infer(op, inputs, 1 + *weight as usize),
        _ => Err(attr_err(op, "not a normalization op")),
    }
}

/// Inference of LayerNorm / RMSNorm: x float of rank >= 1, each affine input `[last_dim]` of x's dtype.
fn norm_infer(op: &Op, inputs: &[&TensorType], n: usize) -> Result<TensorType> {
    arity(op, inputs, n)?;
    let x = inputs[0];
    if !x.dtype.is_float() {
        return Err(dtype_err(op, inputs, "input must be a float tensor"));
    }
    if x.shape.rank() == 0 {
        return Err(shape_err(op, inputs, "input must have rank >= 1"));
    }
    let d = *x.shape.dims().last().expect("rank >= 1");
    for p in &inputs[1..] {
        if p.dtype != x.dtype {
            return Err(dtype_err(
                op,
                inputs,
                "weight and bias must have the input's dtype",
            ));
        }
        if p.shape.dims() != [d] {
            return Err(shape_err(
                op,
                inputs,
                format!("weight and bias must have shape [{d}] (the last dim)"),
            ));
        }
    }
    Ok(x.clone())
}

/// CPU kernel.
pub fn cpu(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    if out.dtype == DType::F64 {
        cpu_in::<f64>(op, inputs, out)
    } else {
        cpu_in::<f32>(op, inputs, out)
    }
}

fn cpu_in<C: Real>(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    let x = compute_view::<C>(inputs[0]);
    let dims = inputs[0].dims();
    let mut y = vec![C::ZERO; x.len()];
    match op {
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            let log = matches!(op, Op::LogSoftmax { .. });
            let (_, n, inner) = split_axis(dims, *axis);
            let block = n * inner;
            if block > 0 {
                let f = |(xb, yb): (&[C], &mut [C])| {
                    if log || inner != 1 || {
                        yb.copy_from_slice(xb);
                        !C::softmax_rows(yb, n)
                    } {
                        softmax_block(xb, yb, n, inner, log)
                    }
                };
                if x.len() >= PAR_THRESHOLD {
                    x.par_chunks(block).zip(y.par_chunks_mut(block)).for_each(f);
                } else {
                    x.chunks(block).zip(y.chunks_mut(block)).for_each(f);
                }
            }
        }
        Op::LayerNorm { eps, weight, .. } | Op::RmsNorm { eps, weight } => {
            let centered = matches!(op, Op::LayerNorm { .. });
            let has_bias = matches!(op, Op::LayerNorm { bias: true, .. });
            let w = weight.then(|| compute_view::<C>(inputs[1]));
            let b = has_bias.then(|| compute_view::<C>(inputs[1 + *weight as usize]));
            let d = *dims.last().expect("rank >= 1");
            let aff = Affine {
                w: w.as_deref(),
                b: b.as_deref(),
                centered,
            };
            if d > 0 {
                // Blocks of whole rows of about PAR_THRESHOLD elements, one per task.
                let block = d * PAR_THRESHOLD.div_ceil(d).max(1);
                if x.len() >= PAR_THRESHOLD {
                    let out = crate::par::Disjoint::new(&mut y);
                    crate::par::for_each(x.len().div_ceil(block), |t| {
                        let (lo, hi) = (t * block, ((t + 1) * block).min(x.len()));
                        // SAFETY: task `t` alone writes elements `lo..hi` (whole rows).
                        let yb = unsafe { out.range(lo, hi) };
                        C::norm_rows(&x[lo..hi], yb, d, aff, eps.get())
                    });
                } else {
                    C::norm_rows(&x, &mut y, d, aff, eps.get());
                }
            }
        }
        _ => return Err(attr_err(op, "not a normalization op")),
    }
    from_compute(y, out)
}

/// LayerNorm or RMSNorm (`op`, f32) of `n` elements in rows of `d` whose input is produced block
/// by block: `fill(start, block)` writes input elements `start..start + block.len()` (whole
/// rows). The norm's weight and bias are `rest`. The same rows as [`cpu`] on the materialized
/// input, bit for bit, without storing that input (a fused row kernel's prologue).
pub(crate) fn norm_f32_blocks(
    op: &Op,
    rest: &[&HostTensor],
    n: usize,
    d: usize,
    fill: impl Fn(usize, &mut [f32]) + Sync,
) -> Result<Vec<f32>> {
    let (eps, weight, bias, centered) = match op {
        Op::LayerNorm { eps, weight, bias } => (eps.get(), *weight, *bias, true),
        Op::RmsNorm { eps, weight } => (eps.get(), *weight, false, false),
        _ => return Err(attr_err(op, "not a normalization op")),
    };
    if rest.len() != weight as usize + bias as usize {
        return Err(attr_err(
            op,
            "weight and bias operands do not match the attributes",
        ));
    }
    let w = weight.then(|| compute_view::<f32>(rest[0]));
    let b = bias.then(|| compute_view::<f32>(rest[weight as usize]));
    let aff = Affine {
        w: w.as_deref(),
        b: b.as_deref(),
        centered,
    };
    let mut y = vec![0f32; n];
    if d == 0 || n == 0 {
        return Ok(y);
    }
    let block = d * PAR_THRESHOLD.div_ceil(d).max(1);
    let out = crate::par::Disjoint::new(&mut y);
    let run = |t: usize| {
        let (lo, hi) = (t * block, ((t + 1) * block).min(n));
        let mut x = vec![0f32; hi - lo];
        fill(lo, &mut x);
        // SAFETY: block `t` (elements `lo..hi`, whole rows) is written by this task alone.
        f32::norm_rows(&x, unsafe { out.range(lo, hi) }, d, aff, eps);
    };
    if n >= PAR_THRESHOLD {
        crate::par::for_each(n.div_ceil(block), run);
    } else {
        run(0);
    }
    Ok(y)
}

/// Softmax (or log-softmax) of a `[n, inner]` block along its first dim, max-subtracted; the
/// denominators accumulate in f64 (pairwise along a contiguous row, in blocks of [`SUM_BLOCK`]
/// rows along a strided one).
fn softmax_block<C: Real>(x: &[C], y: &mut [C], n: usize, inner: usize, log: bool) {
    debug_assert_eq!(x.len(), n * inner);
    let mut m = vec![C::NEG_INF; inner];
    for row in x.chunks(inner) {
        for (mk, &v) in m.iter_mut().zip(row) {
            if v > *mk || v.is_nan() {
                *mk = v;
            }
        }
    }
    for (xr, yr) in x.chunks(inner).zip(y.chunks_mut(inner)) {
        for k in 0..inner {
            yr[k] = (xr[k] - m[k]).exp();
        }
    }
    let s: Vec<C::Acc> = if inner == 1 {
        vec![acc_sum(y, &|e: C| e.acc())]
    } else {
        let mut s = vec![C::Acc::ZERO; inner];
        let mut part = vec![C::Acc::ZERO; inner];
        for blk in y.chunks(inner * SUM_BLOCK) {
            part.fill(C::Acc::ZERO);
            for yr in blk.chunks(inner) {
                for (p, &e) in part.iter_mut().zip(yr) {
                    *p += e.acc();
                }
            }
            for (t, &p) in s.iter_mut().zip(&part) {
                *t += p;
            }
        }
        s
    };
    if log {
        let ls: Vec<C::Acc> = s.iter().map(|&v| v.ln()).collect();
        for (xr, yr) in x.chunks(inner).zip(y.chunks_mut(inner)) {
            for k in 0..inner {
                yr[k] = C::from_acc((xr[k] - m[k]).acc() - ls[k]);
            }
        }
    } else {
        let inv: Vec<C> = s.iter().map(|&v| C::from_acc(C::Acc::ONE / v)).collect();
        for yr in y.chunks_mut(inner) {
            for k in 0..inner {
                yr[k] = yr[k] * inv[k];
            }
        }
    }
}

/// `Σ f(x)` over a row in f64, inlined into the caller's vectorized context: four accumulators of
/// 8 lanes along the row, combined as a tree at the end (in f64 the rounding error stays far
/// below an f32 ulp for any row length).
#[inline(always)]
fn row_sum<T: Copy>(xs: &[T], f: impl Fn(T) -> f64) -> f64 {
    let (mut a, mut b, mut c, mut d) = ([0f64; 8], [0f64; 8], [0f64; 8], [0f64; 8]);
    let mut chunks = xs.chunks_exact(32);
    for x in &mut chunks {
        for j in 0..8 {
            a[j] += f(x[j]);
            b[j] += f(x[8 + j]);
            c[j] += f(x[16 + j]);
            d[j] += f(x[24 + j]);
        }
    }
    let mut tail = 0.0;
    for &x in chunks.remainder() {
        tail += f(x);
    }
    let mut s = [0f64; 8];
    for j in 0..8 {
        s[j] = (a[j] + b[j]) + (c[j] + d[j]);
    }
    ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7])) + tail
}

/// One row of LayerNorm (`centered`) or RMSNorm, with optional weight and bias; sums in f64.
#[inline(always)]
fn norm_row<C: Real>(x: &[C], y: &mut [C], aff: Affine<'_, C>, eps: f64) {
    let n = x.len() as f64;
    let mean = if aff.centered {
        row_sum(x, |v: C| v.acc().to_f64()) / n
    } else {
        0.0
    };
    let var = row_sum(x, |v: C| {
        let c = v.acc().to_f64() - mean;
        c * c
    }) / n;
    let rstd = 1.0 / (var + eps).sqrt();
    match (aff.w, aff.b) {
        (Some(w), Some(b)) => {
            for ((yk, &v), (&wk, &bk)) in y.iter_mut().zip(x).zip(w.iter().zip(b)) {
                let r = (v.acc().to_f64() - mean) * rstd * wk.acc().to_f64() + bk.acc().to_f64();
                *yk = C::from_f64(r);
            }
        }
        (w, b) => {
            for (k, (yk, &v)) in y.iter_mut().zip(x).enumerate() {
                let mut r = (v.acc().to_f64() - mean) * rstd;
                if let Some(w) = w {
                    r *= w[k].acc().to_f64();
                }
                if let Some(b) = b {
                    r += b[k].acc().to_f64();
                }
                *yk = C::from_f64(r);
            }
        }
    }
}

/// Gradient rule.
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    let x = cx.inputs[0];
    let g = cx.grad;
    match cx.op.clone() {
        Op::Softmax { axis } => {
            // dx = y · (g − Σ g·y)
            let y = cx.output;
            let gy = cx.mul(g, y)?;
            let s = cx.sum(gy, vec![axis], true)?;
            let d = cx.sub(g, s)?;
            Ok(vec![Some(cx.mul(y, d)?)])
        }
        Op::LogSoftmax { axis } => {
            // dx = g − softmax · Σ g
            let y = cx.output;
            let p = cx.unary(UnaryOp::Exp, y)?;
            let s = cx.sum(g, vec![axis], true)?;
            let ps = cx.mul(p, s)?;
            Ok(vec![Some(cx.sub(g, ps)?)])
        }
        Op::LayerNorm { eps, weight, bias } => {
            let (xhat, rstd) = normalized(cx, x, eps.get(), true)?;
            let gy = if weight { cx.mul(g, cx.inputs[1])? } else { g };
            // dx = rstd · (gy − mean(gy) − x̂ · mean(gy · x̂))
            let axis = cx.ty(x).shape.rank() - 1;
            let m1 = mean_last(cx, gy, axis)?;
            let gx = cx.mul(gy, xhat)?;
            let m2 = mean_last(cx, gx, axis)?;
            let t = cx.mul(xhat, m2)?;
            let d = cx.sub(gy, m1)?;
            let d = cx.sub(d, t)?;
            let dx = cx.mul(rstd, d)?;
            let mut out = vec![Some(dx)];
            if weight {
                out.push(Some(affine_grad(cx, g, Some(xhat), cx.inputs[1])?));
            }
            if bias {
                let b = cx.inputs[1 + weight as usize];
                out.push(Some(affine_grad(cx, g, None, b)?));
            }
            Ok(out)
        }
        Op::RmsNorm { eps, weight } => {
            let (xhat, rstd) = normalized(cx, x, eps.get(), false)?;
            let gy = if weight { cx.mul(g, cx.inputs[1])? } else { g };
            // dx = rstd · (gy − x̂ · mean(gy · x̂))
            let axis = cx.ty(x).shape.rank() - 1;
            let gx = cx.mul(gy, xhat)?;
            let m2 = mean_last(cx, gx, axis)?;
            let t = cx.mul(xhat, m2)?;
            let d = cx.sub(gy, t)?;
            let dx = cx.mul(rstd, d)?;
            let mut out = vec![Some(dx)];
            if weight {
                out.push(Some(affine_grad(cx, g, Some(xhat), cx.inputs[1])?));
            }
            Ok(out)
        }
        op => Err(attr_err(&op, "not a normalization op")),
    }
}

/// Mean over `axis`, keeping it as size 1.
fn mean_last(cx: &mut VjpCtx<'_>, v: Value, axis: usize) -> Result<Value> {
    cx.emit(
        Op::Reduce {
            kind: ReduceKind::Mean,
            axes: vec![axis],
            keep_dims: true,
        },
        &[v],
    )
}

/// Recomputes `(x̂, rstd)` of LayerNorm (`centered`) or RMSNorm from `x`; rstd keeps the last dim as 1.
fn normalized(cx: &mut VjpCtx<'_>, x: Value, eps: f64, centered: bool) -> Result<(Value, Value)> {
    let ty = cx.ty(x);
    let axis = ty.shape.rank() - 1;
    let xc = if centered {
        let m = mean_last(cx, x, axis)?;
        cx.sub(x, m)?
    } else {
        x
    };
    let sq = cx.mul(xc, xc)?;
    let var = mean_last(cx, sq, axis)?;
    let e = cx.scalar(eps, ty.dtype)?;
    let ve = cx.add(var, e)?;
    let rstd = cx.unary(UnaryOp::Rsqrt, ve)?;
    let xhat = cx.mul(xc, rstd)?;
    Ok((xhat, rstd))
}

/// Gradient of a weight (`g · x̂`) or bias (`g`) of shape `[d]`: summed over every leading dim.
fn affine_grad(cx: &mut VjpCtx<'_>, g: Value, xhat: Option<Value>, param: Value) -> Result<Value> {
    let v = match xhat {
        Some(xh) => cx.mul(g, xh)?,
        None => g,
    };
    let shape: Shape = cx.ty(param).shape;
    cx.sum_to(v, &shape)
}
