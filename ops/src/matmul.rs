//! Matrix products: `Matmul` and `MatmulEpilogue` (`act(A·B + bias)`).
//!
//! Operands have rank >= 2; the last two dims are the matrix (swapped when `trans_*`), the leading
//! batch dims broadcast (numpy). The CPU kernel calls the `gemm` crate with strides only (a
//! transpose is a stride swap, never a copy): f32 and f64 directly, f16 and bf16 converted to f32,
//! multiplied and rounded once after the epilogue (so the whole op rounds once, as on a GPU with
//! f32 accumulation). Many small matrices run in parallel across the batch; a big matrix uses
//! gemm's own rayon parallelism.
//!
//! The epilogue's activations are evaluated in f64 per element (the exact GELU through the
//! elementwise family's `erfc`), except the exact GELU of f32 results: a vectorized f32 rational
//! erf (about 1e-6 absolute error) where x ≥ −3 and the f64 erfc in the left tail. Its gradient
//! reuses the elementwise family's rule for the activation.

use crate::elementwise::erfc;
use crate::util::{arity, dtype_err, shape_err, PAR_THRESHOLD};
use crate::{
    bf16, f16, Activation, Data, HostTensor, Op, OpError, Result, Shape, TensorType, UnaryOp,
    Value, VjpCtx,
};
use gemm::Parallelism;
use rayon::prelude::*;

/// The geometry of one matmul: matrix sizes and the broadcast batch shape.
struct Geom {
    m: usize,
    n: usize,
    k: usize,
    batch: Shape,
}

fn flags(op: &Op) -> Option<(bool, bool, bool, Activation)> {
    match op {
        Op::Matmul { trans_a, trans_b } => Some((*trans_a, *trans_b, false, Activation::None)),
        Op::MatmulEpilogue {
            trans_a,
            trans_b,
            bias,
            act,
        } => Some((*trans_a, *trans_b, *bias, *act)),
        _ => None,
    }
}

fn geom(op: &Op, inputs: &[&TensorType], ta: bool, tb: bool) -> Result<Geom> {
    let (a, b) = (inputs[0], inputs[1]);
    let (ra, rb) = (a.shape.rank(), b.shape.rank());
    if ra < 2 || rb < 2 {
        return Err(shape_err(
            op,
            inputs,
            format!(
                "operands must have rank >= 2 (got {} and {}); reshape vectors to matrices",
                a.shape, b.shape
            ),
        ));
    }
    let (ad, bd) = (a.shape.dims(), b.shape.dims());
    let (m, ka) = if ta {
        (ad[ra - 1], ad[ra - 2])
    } else {
        (ad[ra - 2], ad[ra - 1])
    };
    let (kb, n) = if tb {
        (bd[rb - 1], bd[rb - 2])
    } else {
        (bd[rb - 2], bd[rb - 1])
    };
    if ka != kb {
        return Err(shape_err(
            op,
            inputs,
            format!(
                "inner dims differ: {} (trans_a={ta}) has {ka}, {} (trans_b={tb}) has {kb}",
                a.shape, b.shape
            ),
        ));
    }
    let (ba, bb) = (Shape::new(&ad[..ra - 2]), Shape::new(&bd[..rb - 2]));
    let batch = Shape::broadcast(&ba, &bb).ok_or_else(|| {
        shape_err(
            op,
            inputs,
            format!("batch dims {ba} and {bb} do not broadcast"),
        )
    })?;
    Ok(Geom { m, n, k: ka, batch })
}

/// Output type of a matmul, or a typed error naming the op, both shapes and the inner dims.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    let Some((ta, tb, bias, _)) = flags(op) else {
        return Err(OpError::Runtime {
            op: op.name(),
            reason: "not a matmul".into(),
        });
    };
    arity(op, inputs, 2 + bias as usize)?;
    let dt = inputs[0].dtype;
    if inputs.iter().any(|t| t.dtype != dt) || !dt.is_float() {
        return Err(dtype_err(
            op,
            inputs,
            "operands must share one float dtype (f32, f64, f16, bf16)",
        ));
    }
    let g = geom(op, inputs, ta, tb)?;
    if bias {
        let bs = &inputs[2].shape;
        if bs.dims() != [g.n] {
            return Err(shape_err(
                op,
                inputs,
                format!("bias {bs} must be 1-D of the output's last dim {}", g.n),
            ));
        }
    }
    let mut dims = g.batch.dims().to_vec();
    dims.push(g.m);
    dims.push(g.n);
    Ok(TensorType::new(dt, dims))
}

/// Offsets (in elements) of each batch's matrix in an operand with batch dims `own`, broadcast to
/// `batch`, for matrices of `mat` elements.
pub fn batch_offsets(own: &[usize], batch: &Shape, mat: usize) -> Vec<usize> {
    let strides = Shape::new(own).broadcast_strides(batch);
    let nb = batch.numel();
    let mut offs = Vec::with_capacity(nb);
    let mut idx = vec![0usize; batch.rank()];
    for _ in 0..nb {
        offs.push(idx.iter().zip(&strides).map(|(i, s)| i * s).sum::<usize>() * mat);
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < batch.dims()[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    offs
}

/// A float type gemm multiplies.
trait GemmFloat: Copy + Send + Sync + Default + 'static {
    const ONE: Self;
    fn of_f64(v: f64) -> Self;
    fn as_f64(self) -> f64;
    /// The exact GELU of every element of `row`, in place.
    fn gelu_erf_row(row: &mut [Self]) {
        row.iter_mut()
            .for_each(|y| *y = Self::of_f64(gelu_erf(y.as_f64())));
    }
}
impl GemmFloat for f32 {
    const ONE: Self = 1.0;
    fn of_f64(v: f64) -> Self {
        v as f32
    }
    fn as_f64(self) -> f64 {
        self as f64
    }
    fn gelu_erf_row(row: &mut [f32]) {
        gelu_erf_f32_row(row);
    }
}

/// Below this input the f32 GELU takes the f64 `erfc` path: there `1 + erf` cancels, and only
/// erfc keeps the relative accuracy of the left tail.
const GELU_F32_TAIL: f32 = -3.0;

/// erf of an f32 as a rational function `x·P(x²)/Q(x²)` on [−4, 4] and ±1 beyond (Eigen's
/// `generic_fast_erf_float` coefficients; about 4e-7 absolute error evaluated in f32). Straight-line
/// code, so a loop over a row vectorizes.
#[inline(always)]
fn erf_f32(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = x2 * -2.726_142_4e-10 + 2.770_681_5e-8;
    p = x2 * p + -2.101_024e-6;
    p = x2 * p + -5.692_506_2e-5;
    p = x2 * p + -7.349_906_4e-4;
    p = x2 * p + -2.954_6e-3;
    p = x2 * p + -1.609_603_3e-2;
    let mut q = x2 * -1.456_607_15e-5 + -2.133_740_5e-4;
    q = x2 * q + -1.682_827e-3;
    q = x2 * q + -7.373_329_3e-3;
    q = x2 * q + -1.426_473_9e-2;
    x * p / q
}

/// The exact GELU `½·x·(1 + erf(x/√2))` of an f32 row in place: a vectorized pass with
/// [`erf_f32`] (about 1e-6 absolute error) for inputs ≥ [`GELU_F32_TAIL`], then the f64 `erfc`
/// form for the rest (NaN stays NaN). The same operations in every build, with AVX2 where the CPU
/// has it.
fn gelu_erf_f32_row(row: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, the only feature the function enables.
        unsafe { gelu_erf_f32_row_avx2(row) };
        return;
    }
    gelu_erf_f32_body(row);
}

/// [`gelu_erf_f32_body`] compiled for AVX2 (plain multiplies and adds, no FMA contraction, so
/// the values equal the portable build's).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn gelu_erf_f32_row_avx2(row: &mut [f32]) {
    gelu_erf_f32_body(row);
}

#[inline(always)]
fn gelu_erf_f32_body(row: &mut [f32]) {
    for y in row.iter_mut() {
        let x = *y;
        let g = 0.5 * x * (1.0 + erf_f32(x * std::f32::consts::FRAC_1_SQRT_2));
        // GELU ≥ −0.17 > GELU_F32_TAIL, so pass two sees only the inputs this pass kept.
        *y = if x >= GELU_F32_TAIL { g } else { x };
    }
    for y in row.iter_mut() {
        if *y < GELU_F32_TAIL {
            *y = gelu_erf(*y as f64) as f32;
        }
    }
}
impl GemmFloat for f64 {
    const ONE: Self = 1.0;
    fn of_f64(v: f64) -> Self {
        v
    }
    fn as_f64(self) -> f64 {
        self
    }
}

/// Batched `out[b] = op(A[b])·op(B[b])` through gemm; `out` is `[nb, m, n]`.
fn gemm_batched<T: GemmFloat>(
    a: &[T],
    b: &[T],
    a_offs: &[usize],
    b_offs: &[usize],
    g: &Geom,
    ta: bool,
    tb: bool,
) -> Vec<T> {
    let (m, n, k) = (g.m, g.n, g.k);
    let nb = a_offs.len();
    let mut out = vec![T::default(); nb * m * n];
    if m == 0 || n == 0 || k == 0 {
        return out;
    }
    let (a_rs, a_cs) = if ta { (1, m as isize) } else { (k as isize, 1) };
    let (b_rs, b_cs) = if tb { (1, k as isize) } else { (n as isize, 1) };
    let one = |bi: usize, dst: &mut [T], par: Parallelism| {
        let lhs = &a[a_offs[bi]..a_offs[bi] + m * k];
        let rhs = &b[b_offs[bi]..b_offs[bi] + k * n];
        debug_assert_eq!(dst.len(), m * n);
        // SAFETY: `lhs` holds the m×k matrix and `rhs` the k×n matrix with the given strides (every
        // index (i, j) maps inside the slice: i·rs + j·cs < m·k, resp. k·n), `dst` holds m×n
        // row-major, and the three do not overlap (dst is a fresh buffer). `read_dst` is false,
        // so dst := 1·lhs·rhs.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                n as isize,
                false,
                lhs.as_ptr(),
                a_cs,
                a_rs,
                rhs.as_ptr(),
                b_cs,
                b_rs,
                T::default(),
                T::ONE,
                false,
                false,
                false,
                par,
            );
        }
    };
    let work = m * n * k;
    if nb > 1 && work < (1 << 18) && nb * work >= PAR_THRESHOLD {
        out.par_chunks_mut(m * n)
            .enumerate()
            .for_each(|(bi, dst)| one(bi, dst, Parallelism::None));
    } else {
        let par = if work >= PAR_THRESHOLD {
            Parallelism::Rayon(0)
        } else {
            Parallelism::None
        };
        for (bi, dst) in out.chunks_mut(m * n).enumerate() {
            one(bi, dst, par);
        }
    }
    out
}

/// Adds the bias to every row and applies the activation, in place.
fn epilogue<T: GemmFloat>(out: &mut [T], bias: Option<&[T]>, act: Activation, n: usize) {
    if bias.is_none() && act == Activation::None || n == 0 {
        return;
    }
    let f = |row: &mut [T]| {
        if let Some(b) = bias {
            for (y, &c) in row.iter_mut().zip(b) {
                *y = T::of_f64(y.as_f64() + c.as_f64());
            }
        }
        match act {
            Activation::None => {}
            Activation::Relu => row
                .iter_mut()
                .for_each(|y| *y = T::of_f64(relu(y.as_f64()))),
            Activation::GeluErf => T::gelu_erf_row(row),
            Activation::GeluTanh => row
                .iter_mut()
                .for_each(|y| *y = T::of_f64(gelu_tanh(y.as_f64()))),
        }
    };
    if out.len() >= PAR_THRESHOLD {
        out.par_chunks_mut(n).for_each(f);
    } else {
        out.chunks_mut(n).for_each(f);
    }
}

/// max(x, 0), NaN kept.
fn relu(x: f64) -> f64 {
    if x < 0.0 {
        0.0
    } else {
        x
    }
}

/// GELU, exact form x·Φ(x) = ½·x·erfc(-x/√2) (erfc keeps the left tail accurate).
fn gelu_erf(x: f64) -> f64 {
    0.5 * x * erfc(-x * std::f64::consts::FRAC_1_SQRT_2)
}

/// GELU, tanh approximation.
fn gelu_tanh(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

/// Runs a matmul on the CPU; `out` is the inferred output type.
pub fn cpu(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    let Some((ta, tb, has_bias, act)) = flags(op) else {
        return Err(OpError::Runtime {
            op: op.name(),
            reason: "not a matmul".into(),
        });
    };
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let g = geom(op, &refs, ta, tb)?;
    let (a, b) = (inputs[0], inputs[1]);
    let a_offs = batch_offsets(&a.dims()[..a.dims().len() - 2], &g.batch, g.m * g.k);
    let b_offs = batch_offsets(&b.dims()[..b.dims().len() - 2], &g.batch, g.k * g.n);
    let bias = has_bias.then(|| inputs[2]);
    let mismatch = || dtype_err(op, &refs, "operands must share one float dtype");
    let run32 = |a: &[f32], b: &[f32], bias: Option<Vec<f32>>| {
        let mut y = gemm_batched(a, b, &a_offs, &b_offs, &g, ta, tb);
        epilogue(&mut y, bias.as_deref(), act, g.n);
        y
    };
    let data = match (a.data(), b.data()) {
        (Data::F32(x), Data::F32(w)) => {
            let bias = bias.map(|t| t.to_vec::<f32>()).transpose()?;
            Data::F32(run32(x, w, bias).into())
        }
        (Data::F64(x), Data::F64(w)) => {
            let bias = bias.map(|t| t.to_vec::<f64>()).transpose()?;
            let mut y = gemm_batched(x, w, &a_offs, &b_offs, &g, ta, tb);
            epilogue(&mut y, bias.as_deref(), act, g.n);
            Data::F64(y.into())
        }
        (Data::F16(x), Data::F16(w)) => {
            let up = |v: &[f16]| v.par_iter().map(|h| h.to_f32()).collect::<Vec<f32>>();
            let bias = bias.map(|t| t.as_slice::<f16>().map(up)).transpose()?;
            let y = run32(&up(x), &up(w), bias);
            Data::F16(y.par_iter().map(|&v| f16::from_f32(v)).collect())
        }
        (Data::BF16(x), Data::BF16(w)) => {
            let up = |v: &[bf16]| v.par_iter().map(|h| h.to_f32()).collect::<Vec<f32>>();
            let bias = bias.map(|t| t.as_slice::<bf16>().map(up)).transpose()?;
            let y = run32(&up(x), &up(w), bias);
            Data::BF16(y.par_iter().map(|&v| bf16::from_f32(v)).collect())
        }
        _ => return Err(mismatch()),
    };
    HostTensor::from_data(data, out.shape.clone())
}

/// `(dA, dB)` of `op(A)·op(B)` for the output gradient `g`, with the transpose flags chosen so
/// that no explicit permute is needed, summed down to the operands' (broadcast) shapes.
fn matmul_grads(
    cx: &mut VjpCtx<'_>,
    a: Value,
    b: Value,
    ta: bool,
    tb: bool,
    g: Value,
) -> Result<(Value, Value)> {
    let mm = |trans_a, trans_b| Op::Matmul { trans_a, trans_b };
    // dA: with A stored [M,K]: G·op(B)ᵀ; stored [K,M]: op(B)·Gᵀ.
    let da = match (ta, tb) {
        (false, false) => cx.emit(mm(false, true), &[g, b])?,
        (false, true) => cx.emit(mm(false, false), &[g, b])?,
        (true, false) => cx.emit(mm(false, true), &[b, g])?,
        (true, true) => cx.emit(mm(true, true), &[b, g])?,
    };
    // dB: with B stored [K,N]: op(A)ᵀ·G; stored [N,K]: Gᵀ·op(A).
    let db = match (ta, tb) {
        (false, false) => cx.emit(mm(true, false), &[a, g])?,
        (true, false) => cx.emit(mm(false, false), &[a, g])?,
        (false, true) => cx.emit(mm(true, false), &[g, a])?,
        (true, true) => cx.emit(mm(true, true), &[g, a])?,
    };
    let (sa, sb) = (cx.ty(a).shape, cx.ty(b).shape);
    Ok((cx.sum_to(da, &sa)?, cx.sum_to(db, &sb)?))
}

/// Gradient rule: `dA = g·Bᵀ`, `dB = Aᵀ·g` (through the transpose flags), summed over broadcast
/// batch dims. For the epilogue, `g` first goes back through the activation (the elementwise
/// family's rule for it, applied to the recomputed pre-activation) and the bias gets the sum of
/// that over every dim but the last.
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    let Some((ta, tb, has_bias, act)) = flags(cx.op) else {
        return Err(OpError::Runtime {
            op: cx.op.name(),
            reason: "not a matmul".into(),
        });
    };
    let (a, b) = (cx.inputs[0], cx.inputs[1]);
    let mut g = cx.grad;
    let unary = match act {
        Activation::None => None,
        Activation::Relu => Some(UnaryOp::Relu),
        Activation::GeluErf => Some(UnaryOp::GeluErf),
        Activation::GeluTanh => Some(UnaryOp::GeluTanh),
    };
    if let Some(u) = unary {
        let mut pre = cx.emit(
            Op::Matmul {
                trans_a: ta,
                trans_b: tb,
            },
            &[a, b],
        )?;
        if has_bias {
            pre = cx.add(pre, cx.inputs[2])?;
        }
        let act_op = Op::Unary(u);
        let ins = [pre];
        let mut sub = VjpCtx {
            b: &mut *cx.b,
            op: &act_op,
            inputs: &ins,
            output: cx.output,
            grad: g,
        };
        g = crate::vjp(&mut sub)?
            .into_iter()
            .next()
            .flatten()
            .ok_or_else(|| cx.not_differentiable(0, "activation has no gradient"))?;
    }
    let (da, db) = matmul_grads(cx, a, b, ta, tb, g)?;
    let mut out = vec![Some(da), Some(db)];
    if has_bias {
        let r = cx.ty(g).shape.rank();
        let dbias = cx.sum(g, (0..r - 1).collect(), false)?;
        out.push(Some(dbias));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The f32 GELU against the f64 erfc form over [−10, 10] (both sides of the tail cut), at
    /// ±0, ±∞ and NaN.
    #[test]
    fn gelu_erf_f32_matches_f64() {
        let mut xs: Vec<f32> = (-20_000..=20_000).map(|i| i as f32 * 5e-4).collect();
        xs.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -3.0,
            -2.999_999_8,
        ]);
        let mut ys = xs.clone();
        gelu_erf_f32_row(&mut ys);
        for (&x, &y) in xs.iter().zip(&ys) {
            let want = gelu_erf(x as f64);
            if want.is_nan() {
                assert!(y.is_nan(), "gelu({x}) = {y}, want NaN");
                continue;
            }
            let err = (y as f64 - want).abs();
            let tol = if x < GELU_F32_TAIL {
                1e-6 * want.abs() // the tail keeps relative accuracy
            } else {
                2e-6 * (1.0 + want.abs())
            };
            assert!(
                err <= tol || y as f64 == want,
                "gelu({x}) = {y}, want {want}"
            );
        }
    }
}
