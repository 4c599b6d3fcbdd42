//! Matrix products: `Matmul`, `MatmulEpilogue` (`act(A·B + bias + C)`) and `MatmulActGrad`
//! (`(A·B) ⊙ act'(pre)`, a matmul's result taken back through an activation's derivative).
//!
//! Operands have rank >= 2; the last two dims are the matrix (swapped when `trans_*`), the leading
//! batch dims broadcast (numpy). f32 (and f16 and bf16, converted to f32, multiplied and rounded
//! once after the epilogue, so the whole op rounds once as on a GPU with f32 accumulation) runs
//! through the packed-B AVX-512 kernel of [`packed`] with the bias and activation in its store
//! (B packed per call here, or once by a session through [`prepack_b`] and [`cpu_prepacked`]).
//! f64, and f32 on CPUs without AVX-512, call the `gemm` crate with strides only (a transpose is
//! a stride swap, never a copy). Many small matrices run in parallel across the batch; a big
//! matrix splits its own work over the pool.
//!
//! The epilogue (bias and activation) of f32 results runs in one vectorized pass with the f32
//! forms of [`crate::vmath`] (the exact GELU within 1e-6 relative error); other dtypes evaluate
//! it in f64 per element (the exact GELU through the elementwise family's `erfc`). Its gradient
//! reuses the elementwise family's rule for the activation. An accumulated operand `C` (the
//! result's type, no activation) is added to the f32 (f64) result before it is rounded, as
//! cuBLASLt adds `beta·C` before its one rounding; its gradient is the result's.
//!
//! `MatmulActGrad` multiplies the product by the activation's derivative at `pre` (an operand of
//! the product's shape) in the same pass: f32 (and f16/bf16 through f32) vectorized, f64 per
//! element. It exists because the backward of `linear → GELU` spells `(dy·W2ᵀ) ⊙ gelu'(pre)`,
//! which cuBLASLt computes in one call (`DGELU`); the optimizer forms it from that spelling. Its
//! gradient with respect to A and B is the matmul's with `g ⊙ act'(pre)`; with respect to `pre`
//! it would need the activation's second derivative and is an error.

use crate::elementwise::erfc;
use crate::util::{arity, dtype_err, shape_err, PAR_THRESHOLD};
use crate::vmath::{self, VFn};
use crate::{
    bf16, f16, Activation, Data, HostTensor, Op, OpError, Result, Shape, TensorType, UnaryOp,
    Value, VjpCtx,
};
use gemm::Parallelism;
use packed::{AView, PackedB};
use rayon::prelude::*;

pub mod packed;

/// The geometry of one matmul: matrix sizes and the broadcast batch shape.
struct Geom {
    m: usize,
    n: usize,
    k: usize,
    batch: Shape,
}

fn flags(op: &Op) -> Option<(bool, bool, bool, Activation)> {
    match op {
        Op::MatmulActGrad {
            trans_a, trans_b, ..
        } => Some((*trans_a, *trans_b, false, Activation::None)),
        Op::Matmul { trans_a, trans_b } => Some((*trans_a, *trans_b, false, Activation::None)),
        Op::MatmulEpilogue {
            trans_a,
            trans_b,
            bias,
            act,
            ..
        } => Some((*trans_a, *trans_b, *bias, *act)),
        _ => None,
    }
}

/// Whether `op` is a `MatmulEpilogue` with an accumulated operand (after the bias).
fn accumulates(op: &Op) -> bool {
    matches!(
        op,
        Op::MatmulEpilogue {
            accumulate: true,
            ..
        }
    )
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
    let grad_act = match op {
        Op::MatmulActGrad { act, .. } => Some(*act),
        _ => None,
    };
    let acc = accumulates(op);
    arity(
        op,
        inputs,
        2 + (bias || grad_act.is_some()) as usize + acc as usize,
    )?;
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
    if acc {
        if flags(op).is_some_and(|f| f.3 != Activation::None) {
            return Err(shape_err(
                op,
                inputs,
                "an accumulated operand is added only with act=none".to_string(),
            ));
        }
        let cs = &inputs[2 + bias as usize].shape;
        if cs.dims() != dims.as_slice() {
            return Err(shape_err(
                op,
                inputs,
                format!(
                    "accumulated operand {cs} must have the product's shape {}",
                    Shape::new(dims.clone())
                ),
            ));
        }
    }
    if let Some(act) = grad_act {
        if act == Activation::None {
            return Err(shape_err(
                op,
                inputs,
                "act=none has no derivative to apply: use matmul".to_string(),
            ));
        }
        let ps = &inputs[2].shape;
        if ps.dims() != dims.as_slice() {
            return Err(shape_err(
                op,
                inputs,
                format!(
                    "pre-activation {ps} must have the product's shape {}",
                    Shape::new(dims.clone())
                ),
            ));
        }
    }
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
    fn add(self, o: Self) -> Self;
    /// `act(y + bias)` over rows of `n` in place, evaluated in f64 per element.
    fn bias_act_rows(rows: &mut [Self], bias: Option<&[Self]>, act: Activation, n: usize) {
        for row in rows.chunks_mut(n) {
            if let Some(b) = bias {
                for (y, &c) in row.iter_mut().zip(b) {
                    *y = Self::of_f64(y.as_f64() + c.as_f64());
                }
            }
            let f = match act {
                Activation::None => continue,
                Activation::Relu => relu,
                Activation::GeluErf => gelu_erf,
                Activation::GeluTanh => gelu_tanh,
            };
            row.iter_mut()
                .for_each(|y| *y = Self::of_f64(f(y.as_f64())));
        }
    }
    /// `y ⊙ act'(pre)` in place, evaluated in f64 per element (ReLU's as a select, so a
    /// non-finite `y` where `pre <= 0` gives 0, as its gradient rule does).
    fn act_grad(y: &mut [Self], pre: &[Self], act: Activation) {
        let d = match act {
            Activation::None => return,
            Activation::Relu => {
                for (y, &x) in y.iter_mut().zip(pre) {
                    if x.as_f64() <= 0.0 || x.as_f64().is_nan() {
                        *y = Self::of_f64(0.0);
                    }
                }
                return;
            }
            Activation::GeluErf => dgelu_erf,
            Activation::GeluTanh => dgelu_tanh,
        };
        for (y, &x) in y.iter_mut().zip(pre) {
            *y = Self::of_f64(y.as_f64() * d(x.as_f64()));
        }
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
    fn add(self, o: Self) -> Self {
        self + o
    }
    /// The vectorized f32 forms ([`crate::vmath`]): one pass, the bias added in f32.
    fn bias_act_rows(rows: &mut [f32], bias: Option<&[f32]>, act: Activation, n: usize) {
        let f = match act {
            Activation::None => VFn::Identity,
            Activation::Relu => VFn::Relu,
            Activation::GeluErf => VFn::GeluErf,
            Activation::GeluTanh => VFn::GeluTanh,
        };
        vmath::bias_act(rows, bias, n, f);
    }
    /// Vectorized (ReLU, tanh GELU), or per element in f64 (erf GELU).
    fn act_grad(y: &mut [f32], pre: &[f32], act: Activation) {
        match act {
            Activation::None => {}
            Activation::Relu => act_grad32(y, pre, false),
            Activation::GeluTanh => act_grad32(y, pre, true),
            Activation::GeluErf => {
                for (y, &x) in y.iter_mut().zip(pre) {
                    *y = (*y as f64 * dgelu_erf(x as f64)) as f32;
                }
            }
        }
    }
}

/// The tanh GELU's derivative in f32. With `s = σ(2u)`, `u = √(2/π)·(x + 0.044715·x³)`, the GELU
/// is `x·s`, so its derivative is `s + x·s·(1 − s)·2u'`.
#[inline(always)]
fn dgelu_tanh32(x: f32) -> f32 {
    const K: f32 = 2.0 * 0.797_884_6;
    const C: f32 = 0.044_715;
    let x2 = x * x;
    let s = vmath::sigmoid(K * x.mul_add(C * x2, x));
    let du = K * (3.0 * C).mul_add(x2, 1.0);
    (x * du * (1.0 - s)).mul_add(s, s)
}

vmath::dispatch! {
    /// `y ⊙ act'(pre)` in place for ReLU (`gelu == false`, derivative 1 where `pre > 0`, else 0)
    /// or the tanh GELU, vectorized.
    fn act_grad32(y: &mut [f32], pre: &[f32], gelu: bool) {
        if gelu {
            for (y, &x) in y.iter_mut().zip(pre) {
                *y *= dgelu_tanh32(x);
            }
        } else {
            for (y, &x) in y.iter_mut().zip(pre) {
                *y = if x > 0.0 { *y } else { 0.0 };
            }
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
    fn add(self, o: Self) -> Self {
        self + o
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

/// The activation as the vectorized f32 function.
fn vfn(act: Activation) -> VFn {
    match act {
        Activation::None => VFn::Identity,
        Activation::Relu => VFn::Relu,
        Activation::GeluErf => VFn::GeluErf,
        Activation::GeluTanh => VFn::GeluTanh,
    }
}

/// Batched f32 `act(op(A[b])·op(B[b]) + bias)` through the packed-B kernel ([`packed`]), B
/// packed once when every batch shares it; `None` when the kernel does not run on this CPU.
#[allow(clippy::too_many_arguments)]
fn packed_f32(
    a: &[f32],
    b: &[f32],
    a_offs: &[usize],
    b_offs: &[usize],
    g: &Geom,
    ta: bool,
    tb: bool,
    bias: Option<&[f32]>,
    act: Activation,
) -> Option<Vec<f32>> {
    if !packed::available() {
        return None;
    }
    let (m, n, k) = (g.m, g.n, g.k);
    let pack = |off: usize| {
        let (rs, cs) = if tb { (1, k) } else { (n, 1) };
        PackedB::new(&b[off..off + k * n], k, n, rs, cs)
    };
    let shared = b_offs.windows(2).all(|w| w[0] == w[1]);
    let one_b = if shared && !b_offs.is_empty() {
        Some(pack(b_offs[0])?)
    } else {
        None
    };
    let mut out = vec![0f32; a_offs.len() * m * n];
    let one = |bi: usize, dst: &mut [f32], parallel: bool| -> bool {
        let (rs, cs) = if ta { (1, m) } else { (k, 1) };
        let av = AView {
            a: &a[a_offs[bi]..a_offs[bi] + m * k],
            m,
            rs,
            cs,
        };
        match &one_b {
            Some(pb) => packed::gemm_f32(av, pb, bias, vfn(act), dst, parallel),
            None => pack(b_offs[bi])
                .is_some_and(|pb| packed::gemm_f32(av, &pb, bias, vfn(act), dst, parallel)),
        }
    };
    if m * n == 0 {
        return Some(out);
    }
    let work = m * n * k;
    let ok = if a_offs.len() > 1 && work < (1 << 18) && a_offs.len() * work >= PAR_THRESHOLD {
        out.par_chunks_mut(m * n)
            .enumerate()
            .all(|(bi, dst)| one(bi, dst, false))
    } else {
        let par = work >= PAR_THRESHOLD;
        out.chunks_mut(m * n)
            .enumerate()
            .all(|(bi, dst)| one(bi, dst, par))
    };
    ok.then_some(out)
}

/// `act(A·B + bias)` for an f32 matmul (`Matmul` or `MatmulEpilogue`, no batch dims on B) whose
/// B was packed ahead ([`PackedB`], e.g. a parameter packed once by a session). `None` when the
/// op or operands do not fit this path (then [`cpu`] computes it); `Some(Err)` for bad operands.
pub fn cpu_prepacked(
    op: &Op,
    inputs: &[&HostTensor],
    out: &TensorType,
    b: &PackedB,
) -> Option<Result<HostTensor>> {
    let (ta, tb, has_bias, act) = flags(op)?;
    if matches!(op, Op::MatmulActGrad { .. }) || out.dtype != crate::DType::F32 {
        return None;
    }
    let acc = if accumulates(op) {
        match inputs
            .get(2 + has_bias as usize)
            .map(|t| t.as_slice::<f32>())
        {
            Some(Ok(c)) => Some(c),
            _ => return None,
        }
    } else {
        None
    };
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let g = match geom(op, &refs, ta, tb) {
        Ok(g) => g,
        Err(e) => return Some(Err(e)),
    };
    if inputs[1].dims().len() != 2 || g.k != b.k() || g.n != b.n() || !packed::available() {
        return None;
    }
    let (Data::F32(x), bias) = (inputs[0].data(), has_bias.then(|| inputs[2])) else {
        return None;
    };
    let bias = match bias.map(|t| t.as_slice::<f32>()).transpose() {
        Ok(v) => v,
        Err(e) => return Some(Err(e)),
    };
    let a_offs = batch_offsets(
        &inputs[0].dims()[..inputs[0].dims().len() - 2],
        &g.batch,
        g.m * g.k,
    );
    let (m, n, k) = (g.m, g.n, g.k);
    let (rs, cs) = if ta { (1, m) } else { (k, 1) };
    let mut y = vec![0f32; a_offs.len() * m * n];
    let ok = m * n == 0
        || y.chunks_mut(m * n).zip(&a_offs).all(|(dst, &off)| {
            let av = AView {
                a: &x[off..off + m * k],
                m,
                rs,
                cs,
            };
            packed::gemm_f32(av, b, bias, vfn(act), dst, m * n * k >= PAR_THRESHOLD)
        });
    if !ok {
        return None;
    }
    if let Some(c) = acc {
        if c.len() != y.len() {
            return None;
        }
        add_into(&mut y, c);
    }
    Some(HostTensor::from_data(
        Data::F32(y.into()),
        out.shape.clone(),
    ))
}

/// Packs a 2-D f32 B operand of `op` (a matmul) for [`cpu_prepacked`]; `None` for other ops,
/// dtypes or ranks.
pub fn prepack_b(op: &Op, b: &HostTensor) -> Option<PackedB> {
    let (_, tb, _, _) = flags(op)?;
    if matches!(op, Op::MatmulActGrad { .. }) || b.dims().len() != 2 {
        return None;
    }
    let Data::F32(v) = b.data() else {
        return None;
    };
    let (r, c) = (b.dims()[0], b.dims()[1]);
    // op(B) is k×n: B stored [k, n], or [n, k] when transposed.
    if tb {
        PackedB::new(v, c, r, 1, c)
    } else {
        PackedB::new(v, r, c, c, 1)
    }
}

/// Adds the bias to every row and applies the activation, in place (blocks of rows in parallel
/// when the tensor is big).
fn epilogue<T: GemmFloat>(out: &mut [T], bias: Option<&[T]>, act: Activation, n: usize) {
    if bias.is_none() && act == Activation::None || n == 0 {
        return;
    }
    // Blocks of about 16k elements: enough work per task, small enough to stay in L2.
    let rows = (EPILOGUE_BLOCK / n).max(1);
    if out.len() >= PAR_THRESHOLD {
        out.par_chunks_mut(rows * n)
            .for_each(|blk| T::bias_act_rows(blk, bias, act, n));
    } else {
        T::bias_act_rows(out, bias, act, n);
    }
}

/// Elements per parallel task of the epilogue.
const EPILOGUE_BLOCK: usize = 1 << 14;

/// max(x, 0), NaN kept.
pub(crate) fn relu(x: f64) -> f64 {
    if x < 0.0 {
        0.0
    } else {
        x
    }
}

/// GELU, exact form x·Φ(x) = ½·x·erfc(-x/√2) (erfc keeps the left tail accurate).
pub(crate) fn gelu_erf(x: f64) -> f64 {
    0.5 * x * erfc(-x * std::f64::consts::FRAC_1_SQRT_2)
}

/// GELU, tanh approximation.
pub(crate) fn gelu_tanh(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

/// The exact GELU's derivative `Φ(x) + x·φ(x)`.
fn dgelu_erf(x: f64) -> f64 {
    let cdf = 0.5 * erfc(-x * std::f64::consts::FRAC_1_SQRT_2);
    let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
    cdf + x * pdf
}

/// The tanh GELU's derivative `½(1 + t) + ½x(1 − t²)·√(2/π)(1 + 3·0.044715·x²)`.
fn dgelu_tanh(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let t = (c * (x + 0.044715 * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
}

/// `y ⊙ act'(pre)` in place (blocks in parallel when the tensor is big).
fn act_grad<T: GemmFloat>(y: &mut [T], pre: &[T], act: Activation) {
    if y.len() >= PAR_THRESHOLD {
        y.par_chunks_mut(EPILOGUE_BLOCK)
            .zip(pre.par_chunks(EPILOGUE_BLOCK))
            .for_each(|(y, p)| T::act_grad(y, p, act));
    } else {
        T::act_grad(y, pre, act);
    }
}

/// `y += c` elementwise (blocks in parallel when the tensor is big).
fn add_into<T: GemmFloat>(y: &mut [T], c: &[T]) {
    let add = |y: &mut [T], c: &[T]| {
        for (y, &c) in y.iter_mut().zip(c) {
            *y = T::add(*y, c);
        }
    };
    if y.len() >= PAR_THRESHOLD {
        y.par_chunks_mut(EPILOGUE_BLOCK)
            .zip(c.par_chunks(EPILOGUE_BLOCK))
            .for_each(|(y, c)| add(y, c));
    } else {
        add(y, c);
    }
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
    // MatmulActGrad: the pre-activation (checked to have the product's shape) and its activation.
    let grad = match op {
        Op::MatmulActGrad { act, .. } => {
            infer(op, &refs)?;
            Some((inputs[2], *act))
        }
        _ => None,
    };
    // The accumulated operand (checked to have the product's shape), added before rounding.
    let acc = if accumulates(op) {
        infer(op, &refs)?;
        Some(inputs[2 + has_bias as usize])
    } else {
        None
    };
    let run32 = |a: &[f32],
                 b: &[f32],
                 bias: Option<Vec<f32>>,
                 pre: Option<Vec<f32>>,
                 c: Option<Vec<f32>>| {
        let mut y = match packed_f32(a, b, &a_offs, &b_offs, &g, ta, tb, bias.as_deref(), act) {
            Some(y) => y,
            None => {
                let mut y = gemm_batched(a, b, &a_offs, &b_offs, &g, ta, tb);
                epilogue(&mut y, bias.as_deref(), act, g.n);
                y
            }
        };
        if let (Some(pre), Some((_, ga))) = (pre, grad) {
            act_grad(&mut y, &pre, ga);
        }
        if let Some(c) = c {
            add_into(&mut y, &c);
        }
        y
    };
    let pre = grad.map(|(t, _)| t);
    let data = match (a.data(), b.data()) {
        (Data::F32(x), Data::F32(w)) => {
            let bias = bias.map(|t| t.to_vec::<f32>()).transpose()?;
            let pre = pre.map(|t| t.to_vec::<f32>()).transpose()?;
            let c = acc.map(|t| t.to_vec::<f32>()).transpose()?;
            Data::F32(run32(x, w, bias, pre, c).into())
        }
        (Data::F64(x), Data::F64(w)) => {
            let bias = bias.map(|t| t.to_vec::<f64>()).transpose()?;
            let mut y = gemm_batched(x, w, &a_offs, &b_offs, &g, ta, tb);
            epilogue(&mut y, bias.as_deref(), act, g.n);
            if let Some((p, ga)) = grad {
                act_grad(&mut y, p.as_slice::<f64>()?, ga);
            }
            if let Some(c) = acc {
                add_into(&mut y, c.as_slice::<f64>()?);
            }
            Data::F64(y.into())
        }
        (Data::F16(x), Data::F16(w)) => {
            let up = |v: &[f16]| v.par_iter().map(|h| h.to_f32()).collect::<Vec<f32>>();
            let bias = bias.map(|t| t.as_slice::<f16>().map(up)).transpose()?;
            let pre = pre.map(|t| t.as_slice::<f16>().map(up)).transpose()?;
            let c = acc.map(|t| t.as_slice::<f16>().map(up)).transpose()?;
            let y = run32(&up(x), &up(w), bias, pre, c);
            Data::F16(y.par_iter().map(|&v| f16::from_f32(v)).collect())
        }
        (Data::BF16(x), Data::BF16(w)) => {
            let up = |v: &[bf16]| v.par_iter().map(|h| h.to_f32()).collect::<Vec<f32>>();
            let bias = bias.map(|t| t.as_slice::<bf16>().map(up)).transpose()?;
            let pre = pre.map(|t| t.as_slice::<bf16>().map(up)).transpose()?;
            let c = acc.map(|t| t.as_slice::<bf16>().map(up)).transpose()?;
            let y = run32(&up(x), &up(w), bias, pre, c);
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
    // dB: with B stored [K,N]: op(A)ᵀ·G; stored [N,K]: Gᵀ·op(A). A 2-D B broadcast over A's
    // batch (a linear layer's weight) takes one product over the batch's rows stacked rather
    // than one per batch element summed afterwards.
    let (ra, rb) = (cx.ty(a).shape.rank(), cx.ty(b).shape.rank());
    if !ta && rb == 2 && ra >= 3 {
        let (ad, gd) = (cx.ty(a).shape, cx.ty(g).shape);
        let rows: usize = ad.dims()[..ra - 1].iter().product();
        let flat = |cx: &mut VjpCtx<'_>, v: Value, cols: usize| {
            cx.emit(
                Op::Reshape {
                    shape: Shape::new([rows, cols]),
                },
                &[v],
            )
        };
        let a2 = flat(cx, a, ad.dims()[ra - 1])?;
        let g2 = flat(cx, g, gd.dims()[gd.rank() - 1])?;
        let db = if tb {
            cx.emit(mm(true, false), &[g2, a2])?
        } else {
            cx.emit(mm(true, false), &[a2, g2])?
        };
        let sa = cx.ty(a).shape;
        return Ok((cx.sum_to(da, &sa)?, db));
    }
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
    if let Op::MatmulActGrad { .. } = cx.op {
        return act_grad_vjp(cx);
    }
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
    if accumulates(cx.op) {
        out.push(Some(g));
    }
    Ok(out)
}

/// Gradient of `MatmulActGrad`: an error. A and B would get the matmul's gradients of
/// `g ⊙ act'(pre)`, but `pre` needs the activation's second derivative, which no rule spells; the
/// op is formed by the optimizer after differentiation, so a graph reaches here only when built
/// with it by hand.
fn act_grad_vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    Err(cx.not_differentiable(
        2,
        "the gradient through the pre-activation needs the activation's second derivative; \
         differentiate the graph before it is optimized (spell the op as matmul then the \
         activation's gradient)",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The f32 epilogue (bias + each activation) against the f64 one on random rows.
    #[test]
    fn f32_epilogue_matches_f64() {
        let n = 37;
        let x = crate::testing::rand_f64(n * 50, 1, -12.0, 12.0);
        let bias = crate::testing::rand_f64(n, 2, -1.0, 1.0);
        for act in [
            Activation::None,
            Activation::Relu,
            Activation::GeluErf,
            Activation::GeluTanh,
        ] {
            let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
            let b32: Vec<f32> = bias.iter().map(|&v| v as f32).collect();
            let mut y = x32.clone();
            epilogue(&mut y, Some(&b32), act, n);
            let mut want: Vec<f64> = x32.iter().map(|&v| v as f64).collect();
            let b64: Vec<f64> = b32.iter().map(|&v| v as f64).collect();
            epilogue(&mut want, Some(&b64), act, n);
            for (i, (&g, &w)) in y.iter().zip(&want).enumerate() {
                let tol = 2e-6 * w.abs() + 1e-6 * (b64[i % n].abs() + x[i].abs());
                assert!(
                    (g as f64 - w).abs() <= tol,
                    "{act:?}: element {i}: {g} vs {w}"
                );
            }
        }
    }
}
