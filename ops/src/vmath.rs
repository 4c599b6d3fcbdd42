//! Vectorizable f32 math for the CPU kernels: `exp`, the exact (erf) GELU, the tanh GELU, the
//! sigmoid, SiLU and tanh as branch-free straight-line code (selects, no table lookups, no libm
//! calls), so a loop over a slice compiles to SIMD, and slice maps that run that loop compiled for
//! AVX-512 or AVX2+FMA when the CPU has them (runtime detection; a portable build otherwise).
//!
//! Accuracy against f64 (checked in this file's tests on millions of random points): `exp` within
//! 2 ulp; the exact GELU within 1e-6 relative error wherever `Φ(x)` is a normal f32 (x > −13), including
//! the far left tail (it computes `Φ(x)` as `t·exp(−x²/2 + P(t))`, `t = 1/(1 + |x|/(2√2))`, with
//! `x²/2` split into two floats so the exponent keeps its precision); the tanh GELU, sigmoid and
//! SiLU within 2e-6 relative error (they are `x·σ(·)` forms, so the left tail keeps relative
//! accuracy; the tanh GELU's cubic argument adds its own rounding below x = −3, up to 1e-5 relative
//! at x = −8); tanh within 2e-6 relative error.

/// `log2(e)`.
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split in two: `LN2_HI` has trailing zero bits, so `n·LN2_HI` is exact for |n| < 2¹².
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;

/// `2^n` for integer-valued `n` in [−126, 127], through the exponent bits.
#[inline(always)]
fn pow2i(n: i32) -> f32 {
    f32::from_bits((n.wrapping_add(127) as u32) << 23)
}

/// `exp(hi + lo)`, with `lo` added to the reduced argument (so it keeps the bits that `hi + lo`
/// would round away). Overflows to +∞ above ~88.7, underflows through the
/// subnormals to 0 below ~−103.9; NaN stays NaN.
#[inline(always)]
fn exp2parts(hi: f32, lo: f32) -> f32 {
    // Clamped so that n fits two exponent steps of [−126, 127]; the clamp keeps NaN.
    let h = hi.clamp(-110.0, 89.0);
    // Round to nearest through the 1.5·2²³ shifter: n = round((h + lo)·log2 e).
    const SHIFT: f32 = 12_582_912.0;
    let shifted = (h + lo).mul_add(LOG2E, SHIFT);
    let nf = shifted - SHIFT;
    let r = (-nf).mul_add(LN2_HI, h);
    let r = (-nf).mul_add(LN2_LO, r) + lo;
    // exp(r) on |r| <= 0.35 by Taylor to degree 7 (truncation error < 5e-9 relative).
    let mut p: f32 = 1.0 / 5040.0;
    p = p.mul_add(r, 1.0 / 720.0);
    p = p.mul_add(r, 1.0 / 120.0);
    p = p.mul_add(r, 1.0 / 24.0);
    p = p.mul_add(r, 1.0 / 6.0);
    p = p.mul_add(r, 0.5);
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // n from the shifter's low mantissa bits (an `as i32` cast would not vectorize); within
    // [−159, 129], or garbage for a NaN argument, whose p is NaN anyway.
    let n = (shifted.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let n1 = n >> 1;
    p * pow2i(n1) * pow2i(n.wrapping_sub(n1))
}

/// `e^x` to within 2 ulp (NaN stays NaN, +∞ → +∞, −∞ → 0).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    exp2parts(x, 0.0)
}

/// `Φ(x)`, the standard normal CDF, to within 1e-6 relative error for every x whose result is
/// a normal f32 (x > −13; the left tail included).
#[inline(always)]
fn normal_cdf(x: f32) -> f32 {
    // erfc(z) = t·exp(−z² + P(t)) with z = |x|/√2 and t = 1/(1 + z/2); P is a degree-9 fit of
    // ln(erfc(z)·e^{z²}/t) on t ∈ (0, 1] (max error 1.1e-7, 2.9e-7 evaluated in f32).
    const C: [f32; 10] = [
        -1.265_512_2,
        1.000_024,
        0.374_087_72,
        0.096_818_05,
        -0.186_434_8,
        0.279_241_68,
        -1.135_778_8,
        1.489_041_4,
        -0.822_415_05,
        0.170_928_1,
    ];
    // Beyond 20 the tail is below f32's range (Φ is 0 or 1); the clamp keeps ±∞ out of the
    // exact square below and keeps NaN.
    let ax = x.abs().clamp(0.0, 20.0);
    let t = 1.0 / ax.mul_add(0.5 * std::f32::consts::FRAC_1_SQRT_2, 1.0);
    let mut p = C[9];
    for &c in C[..9].iter().rev() {
        p = p.mul_add(t, c);
    }
    // −x²/2 as hi + lo exactly (halving is exact), so the exponent keeps full precision.
    let sq = ax * ax;
    let sq_lo = ax.mul_add(ax, -sq);
    let half_erfc = 0.5 * t * exp2parts(-0.5 * sq, p - 0.5 * sq_lo);
    if x < 0.0 {
        half_erfc
    } else {
        1.0 - half_erfc
    }
}

/// The exact GELU `x·Φ(x)` (see the module docs for its accuracy).
#[inline(always)]
pub fn gelu_erf(x: f32) -> f32 {
    x * normal_cdf(x)
}

/// The logistic function `1/(1 + e^−x)`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// The tanh GELU `½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, computed as `x·σ(2u)`.
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const K: f32 = 2.0 * 0.797_884_6;
    let u = K * x.mul_add(0.044_715 * x * x, x);
    x * sigmoid(u)
}

/// SiLU `x·σ(x)`.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `tanh x`: an odd polynomial near 0 (where `1 − 2/(e^{2x} + 1)` would cancel), that form
/// beyond.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let ax = x.abs();
    // Taylor to x¹¹ on |x| < 0.3 (truncation < 1e-8 relative).
    let x2 = x * x;
    let mut p: f32 = -1382.0 / 155_925.0;
    p = p.mul_add(x2, 62.0 / 2835.0);
    p = p.mul_add(x2, -17.0 / 315.0);
    p = p.mul_add(x2, 2.0 / 15.0);
    p = p.mul_add(x2, -1.0 / 3.0);
    let small = (p * x2).mul_add(x, x);
    let big = 1.0 - 2.0 / (exp(2.0 * ax) + 1.0);
    let big = if x < 0.0 { -big } else { big };
    if ax < 0.3 {
        small
    } else {
        big
    }
}

/// Defines `$name(xs, ...)` running `$body` compiled for AVX-512 or AVX2+FMA when the CPU has
/// them (detected at run time), portable otherwise; the body is the same code in every case.
macro_rules! dispatch {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")]
                fn v4($($arg: $ty),*) {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn v3($($arg: $ty),*) {
                    body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has every feature `v4` enables.
                    return unsafe { v4($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has every feature `v3` enables.
                    return unsafe { v3($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use dispatch;

/// A vectorized f32 function [`map`] and [`bias_act`] apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VFn {
    /// The identity.
    Identity,
    /// `max(x, 0)` (NaN kept).
    Relu,
    /// [`exp`].
    Exp,
    /// [`gelu_erf`].
    GeluErf,
    /// [`gelu_tanh`].
    GeluTanh,
    /// [`sigmoid`].
    Sigmoid,
    /// [`silu`].
    Silu,
    /// [`tanh`].
    Tanh,
}

#[inline(always)]
fn relu(x: f32) -> f32 {
    if x < 0.0 {
        0.0
    } else {
        x
    }
}

/// `d[i] = f(x[i])` with `f` one of the vectorized functions.
#[inline(always)]
fn map_with(x: &[f32], d: &mut [f32], f: impl Fn(f32) -> f32) {
    for (o, &v) in d.iter_mut().zip(x) {
        *o = f(v);
    }
}

dispatch! {
    /// `d[i] = f(x[i])` over the common length, vectorized.
    pub fn map(f: VFn, x: &[f32], d: &mut [f32]) {
        match f {
            VFn::Identity => map_with(x, d, |v| v),
            VFn::Relu => map_with(x, d, relu),
            VFn::Exp => map_with(x, d, exp),
            VFn::GeluErf => map_with(x, d, gelu_erf),
            VFn::GeluTanh => map_with(x, d, gelu_tanh),
            VFn::Sigmoid => map_with(x, d, sigmoid),
            VFn::Silu => map_with(x, d, silu),
            VFn::Tanh => map_with(x, d, tanh),
        }
    }
}

#[inline(always)]
fn bias_act_with(y: &mut [f32], bias: Option<&[f32]>, n: usize, f: impl Fn(f32) -> f32) {
    match bias {
        Some(b) => {
            for row in y.chunks_exact_mut(n) {
                for (o, &c) in row.iter_mut().zip(b) {
                    *o = f(*o + c);
                }
            }
        }
        None => y.iter_mut().for_each(|o| *o = f(*o)),
    }
}

dispatch! {
    /// `y[i, j] = f(y[i, j] + bias[j])` in place over rows of `n` (`n > 0`; `bias`, when given,
    /// has `n` elements), vectorized: a matmul's epilogue.
    pub fn bias_act(y: &mut [f32], bias: Option<&[f32]>, n: usize, f: VFn) {
        match f {
            VFn::Identity => bias_act_with(y, bias, n, |v| v),
            VFn::Relu => bias_act_with(y, bias, n, relu),
            VFn::Exp => bias_act_with(y, bias, n, exp),
            VFn::GeluErf => bias_act_with(y, bias, n, gelu_erf),
            VFn::GeluTanh => bias_act_with(y, bias, n, gelu_tanh),
            VFn::Sigmoid => bias_act_with(y, bias, n, sigmoid),
            VFn::Silu => bias_act_with(y, bias, n, silu),
            VFn::Tanh => bias_act_with(y, bias, n, tanh),
        }
    }
}

dispatch! {
    /// Softmax of every row of `n` in place (`n > 0`): `exp(x − max)` vectorized, times the
    /// reciprocal of the row's sum (accumulated in 16 f64 lanes; the product rounded once). As the reference kernel: a NaN
    /// anywhere in a row, or a row of only −∞, makes the whole row NaN.
    pub fn softmax_rows(y: &mut [f32], n: usize) {
        for row in y.chunks_exact_mut(n) {
            softmax_row(row);
        }
    }
}

/// [`softmax_rows`] of one row (inlined into the caller's vectorized context).
#[inline(always)]
pub fn softmax_row(row: &mut [f32]) {
    let mut m = [f32::NEG_INFINITY; 16];
    let chunks = row.chunks_exact(16);
    let mut mx = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for c in chunks {
        for j in 0..16 {
            m[j] = m[j].max(c[j]);
        }
    }
    // The lanes by halves (a tree, not a chain of 16 dependent maxima: short rows are common).
    let mut w = 8;
    while w > 0 {
        for j in 0..w {
            m[j] = m[j].max(m[j + w]);
        }
        w /= 2;
    }
    mx = mx.max(m[0]);
    // f32::max skips NaN; a NaN element then gives exp(NaN) and a NaN sum, so the row is NaN.
    let mut s = [0f64; 16];
    let mut chunks = row.chunks_exact_mut(16);
    for c in &mut chunks {
        for j in 0..16 {
            c[j] = exp(c[j] - mx);
            s[j] += c[j] as f64;
        }
    }
    let mut total = 0f64;
    for v in chunks.into_remainder() {
        *v = exp(*v - mx);
        total += *v as f64;
    }
    let total = ((s[0] + s[8]) + (s[4] + s[12]))
        + ((s[2] + s[10]) + (s[6] + s[14]))
        + (((s[1] + s[9]) + (s[5] + s[13])) + ((s[3] + s[11]) + (s[7] + s[15])))
        + total;
    // The product in f64 rounds once.
    let inv = 1.0 / total;
    row.iter_mut().for_each(|v| *v = (*v as f64 * inv) as f32);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::rand_f64;

    /// Largest relative error of `f` against `want` over `xs`, where the reference is a normal
    /// f32 (at least `floor` in magnitude).
    fn max_rel(xs: &[f32], f: VFn, want: impl Fn(f64) -> f64, floor: f64) -> (f64, f32) {
        let mut ys = vec![0f32; xs.len()];
        map(f, xs, &mut ys);
        let mut worst = (0.0, 0.0);
        for (&x, &y) in xs.iter().zip(&ys) {
            let w = want(x as f64);
            if w.abs() < floor || !w.is_finite() {
                continue;
            }
            let e = (y as f64 - w).abs() / w.abs();
            if e > worst.0 {
                worst = (e, x);
            }
        }
        worst
    }

    fn points(lo: f64, hi: f64, n: usize, seed: u64) -> Vec<f32> {
        rand_f64(n, seed, lo, hi)
            .into_iter()
            .map(|v| v as f32)
            .collect()
    }

    fn gelu_erf64(x: f64) -> f64 {
        0.5 * x * crate::elementwise::erfc(-x * std::f64::consts::FRAC_1_SQRT_2)
    }

    #[test]
    fn exp_within_two_ulp() {
        let xs = points(-87.0, 88.0, 2_000_000, 1);
        let (e, x) = max_rel(&xs, VFn::Exp, f64::exp, f32::MIN_POSITIVE as f64);
        assert!(e < 2.4e-7, "exp: relative error {e} at {x}");
        let xs = points(-1.0, 1.0, 1_000_000, 2);
        let (e, x) = max_rel(&xs, VFn::Exp, f64::exp, 0.0);
        assert!(e < 2.4e-7, "exp: relative error {e} at {x}");
    }

    #[test]
    fn gelu_erf_relative_error_below_1e6() {
        // Φ(x) is subnormal below x = −13: GELU loses relative precision there.
        let floor = 1e-36;
        for (lo, hi, seed) in [(-13.0, 14.0, 3), (-4.0, 4.0, 4), (-1e-3, 1e-3, 5)] {
            let xs = points(lo, hi, 2_000_000, seed);
            let (e, x) = max_rel(&xs, VFn::GeluErf, gelu_erf64, floor);
            assert!(e < 1e-6, "gelu_erf: relative error {e} at {x}");
        }
    }

    #[test]
    fn sigmoid_forms_relative_error() {
        let floor = f32::MIN_POSITIVE as f64;
        let xs = points(-30.0, 30.0, 1_000_000, 6);
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let (e, x) = max_rel(&xs, VFn::Sigmoid, sig, floor);
        assert!(e < 2e-6, "sigmoid: relative error {e} at {x}");
        let (e, x) = max_rel(&xs, VFn::Silu, |x| x * sig(x), floor);
        assert!(e < 2e-6, "silu: relative error {e} at {x}");
        // x·σ(2u) is ½·x·(1 + tanh u) without the cancellation of 1 + tanh u for u ≪ 0.
        let gt = |x: f64| {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            x * sig(2.0 * c * (x + 0.044715 * x * x * x))
        };
        let xs = points(-3.0, 8.0, 1_000_000, 7);
        let (e, x) = max_rel(&xs, VFn::GeluTanh, gt, floor);
        assert!(e < 2e-6, "gelu_tanh: relative error {e} at {x}");
        let xs = points(-8.0, -3.0, 1_000_000, 7);
        let (e, x) = max_rel(&xs, VFn::GeluTanh, gt, floor);
        assert!(e < 1e-5, "gelu_tanh tail: relative error {e} at {x}");
        let xs = points(-10.0, 10.0, 1_000_000, 8);
        let (e, x) = max_rel(&xs, VFn::Tanh, f64::tanh, floor);
        assert!(e < 2e-6, "tanh: relative error {e} at {x}");
        let xs = points(-0.5, 0.5, 1_000_000, 9);
        let (e, x) = max_rel(&xs, VFn::Tanh, f64::tanh, floor);
        assert!(e < 2e-6, "tanh near 0: relative error {e} at {x}");
    }

    #[test]
    fn special_values() {
        let xs = [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            200.0,
            -200.0,
        ];
        let mut ys = [0f32; 7];
        map(VFn::Exp, &xs, &mut ys);
        assert_eq!(ys[..4], [1.0, 1.0, f32::INFINITY, 0.0]);
        assert!(ys[4].is_nan());
        assert_eq!(ys[5..], [f32::INFINITY, 0.0]);
        map(VFn::GeluErf, &xs, &mut ys);
        assert_eq!(ys[..3], [0.0, 0.0, f32::INFINITY]);
        // −∞·Φ(−∞) = −∞·0 is NaN in the f64 reference too.
        assert!(ys[3].is_nan() && ys[4].is_nan());
        assert_eq!(ys[5], 200.0);
        assert_eq!(ys[6], 0.0);
        map(VFn::Tanh, &xs, &mut ys);
        assert_eq!(ys[..4], [0.0, 0.0, 1.0, -1.0]);
        assert!(ys[4].is_nan());
    }

    #[test]
    fn softmax_rows_matches_f64() {
        for n in [1usize, 7, 16, 32, 45] {
            let rows = 5;
            let x = points(-8.0, 8.0, rows * n, 10 + n as u64);
            let mut y = x.clone();
            softmax_rows(&mut y, n);
            for (xr, yr) in x.chunks(n).zip(y.chunks(n)) {
                let m = xr.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
                let s: f64 = xr.iter().map(|&v| (v as f64 - m).exp()).sum();
                for (&v, &p) in xr.iter().zip(yr) {
                    let want = (v as f64 - m).exp() / s;
                    let e = (p as f64 - want).abs() / want;
                    assert!(e < 2e-6, "softmax n={n}: {p} vs {want}");
                }
            }
        }
        let mut y = vec![f32::NEG_INFINITY; 8];
        softmax_rows(&mut y, 4);
        assert!(y.iter().all(|v| v.is_nan()));
        let mut y = vec![0.0, f32::NAN, 1.0, 2.0];
        softmax_rows(&mut y, 4);
        assert!(y.iter().all(|v| v.is_nan()));
    }
}
