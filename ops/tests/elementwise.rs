//! Elementwise ops against float64 references computed here: every unary and binary op on every
//! dtype it supports, broadcasting edge cases, typed errors, `where`, casts between every pair of
//! dtypes, fused kernels against the same ops run one by one, and gradchecks.

use rustytorch_ops::testing::{assert_close, f64_ty, gradcheck, rand_tensor, tolerance, vjp_eager};
use rustytorch_ops::{
    bf16, eval_cpu, f16, BinaryOp, DType, F64Bits, FusedInstr, FusedKernel, HostTensor, Op, Shape,
    TensorType, UnaryOp,
};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

fn run(op: &Op, inputs: &[&HostTensor]) -> HostTensor {
    eval_cpu(op, inputs).unwrap_or_else(|e| panic!("{op:?}: {e}"))
}

fn ty(d: DType, dims: &[usize]) -> TensorType {
    TensorType::new(d, Shape::new(dims))
}

fn tensor(d: DType, dims: &[usize], vals: &[f64]) -> HostTensor {
    HostTensor::from_f64_slice(&ty(d, dims), vals).unwrap()
}

/// Index into an input of `in_dims` for flat output element `flat` of `out_dims` (numpy rules).
fn bidx(out_dims: &[usize], in_dims: &[usize], flat: usize) -> usize {
    let r = out_dims.len();
    let off = r - in_dims.len();
    let mut idx = vec![0; r];
    let mut rem = flat;
    for d in (0..r).rev() {
        idx[d] = rem % out_dims[d];
        rem /= out_dims[d];
    }
    let mut k = 0;
    for (d, &n) in in_dims.iter().enumerate() {
        let i = if n == 1 { 0 } else { idx[d + off] };
        k = k * n + i;
    }
    k
}

/// Reference of a broadcast binary function over the f64 values of `a` and `b`.
fn bref(a: &HostTensor, b: &HostTensor, out: &[usize], f: impl Fn(f64, f64) -> f64) -> Vec<f64> {
    let (av, bv) = (a.to_f64_vec(), b.to_f64_vec());
    let n: usize = out.iter().product();
    (0..n)
        .map(|i| f(av[bidx(out, a.dims(), i)], bv[bidx(out, b.dims(), i)]))
        .collect()
}

// ---- float64 references ----

/// erfc by its Taylor series (1 - erf) below 1.5 and by Laplace's continued fraction above.
fn erfc_ref(x: f64) -> f64 {
    if x < 0.0 {
        return 2.0 - erfc_ref(-x);
    }
    if x < 1.5 {
        let mut sum = 0.0;
        let mut term = x; // (-1)^n x^(2n+1) / n!
        for n in 0..200 {
            sum += term / (2 * n + 1) as f64;
            term *= -x * x / (n + 1) as f64;
            if term.abs() < 1e-30 {
                break;
            }
        }
        1.0 - 2.0 / std::f64::consts::PI.sqrt() * sum
    } else {
        // erfc(x) = exp(-x²)/√π · 1/(x + (1/2)/(x + 1/(x + (3/2)/(x + ...))))
        let mut f = x;
        for k in (1..200).rev() {
            f = x + (k as f64 / 2.0) / f;
        }
        (-x * x).exp() / std::f64::consts::PI.sqrt() / f
    }
}

fn erf_ref(x: f64) -> f64 {
    1.0 - erfc_ref(x)
}

fn unary_ref(u: UnaryOp, x: f64) -> f64 {
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    match u {
        UnaryOp::Neg => -x,
        UnaryOp::Abs => x.abs(),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => 1.0 / x.sqrt(),
        UnaryOp::Reciprocal => 1.0 / x,
        UnaryOp::Sin => x.sin(),
        UnaryOp::Cos => x.cos(),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Sigmoid => sig(x),
        UnaryOp::Relu => x.max(0.0),
        UnaryOp::GeluErf => 0.5 * x * erfc_ref(-x / 2f64.sqrt()),
        UnaryOp::GeluTanh => {
            let k = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
        }
        UnaryOp::Silu => x * sig(x),
        UnaryOp::Sign => {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                0.0
            }
        }
        UnaryOp::Floor => x.floor(),
        UnaryOp::Ceil => x.ceil(),
        UnaryOp::Round => x.round_ties_even(),
        UnaryOp::Not => (x == 0.0) as u8 as f64,
        UnaryOp::IsNan => x.is_nan() as u8 as f64,
        UnaryOp::IsInf => x.is_infinite() as u8 as f64,
        UnaryOp::IsFinite => x.is_finite() as u8 as f64,
        UnaryOp::Erf => 1.0 - erfc_ref(x),
    }
}

/// Every float unary op with its input range.
const FLOAT_UNARY: [(UnaryOp, f64, f64); 20] = [
    (UnaryOp::Neg, -3.0, 3.0),
    (UnaryOp::Abs, -3.0, 3.0),
    (UnaryOp::Exp, -3.0, 3.0),
    (UnaryOp::Log, 0.1, 5.0),
    (UnaryOp::Sqrt, 0.1, 5.0),
    (UnaryOp::Rsqrt, 0.1, 5.0),
    (UnaryOp::Reciprocal, 0.2, 5.0),
    (UnaryOp::Sin, -3.0, 3.0),
    (UnaryOp::Cos, -3.0, 3.0),
    (UnaryOp::Tanh, -3.0, 3.0),
    (UnaryOp::Sigmoid, -6.0, 6.0),
    (UnaryOp::Relu, -3.0, 3.0),
    (UnaryOp::GeluErf, -5.0, 5.0),
    (UnaryOp::GeluTanh, -5.0, 5.0),
    (UnaryOp::Silu, -6.0, 6.0),
    (UnaryOp::Sign, -3.0, 3.0),
    (UnaryOp::Floor, -3.0, 3.0),
    (UnaryOp::Ceil, -3.0, 3.0),
    (UnaryOp::Round, -3.0, 3.0),
    (UnaryOp::Erf, -3.0, 3.0),
];

#[test]
fn unary_float_ops_match_f64_reference() {
    for (k, &(u, lo, hi)) in FLOAT_UNARY.iter().enumerate() {
        for d in FLOATS {
            let x = rand_tensor(&ty(d, &[3, 5, 7]), 100 + k as u64, lo, hi);
            let y = run(&Op::Unary(u), &[&x]);
            assert_eq!(y.ty(), x.ty(), "{u:?} {d}");
            let want: Vec<f64> = x.to_f64_vec().iter().map(|&v| unary_ref(u, v)).collect();
            assert_close(&y.to_f64_vec(), &want, tolerance(d), &format!("{u:?} {d}"));
        }
    }
}

#[test]
fn unary_large_tensor_uses_chunks_consistently() {
    // Above the parallel threshold; f16 goes through the f32 scratch path.
    for d in [DType::F32, DType::F16] {
        let x = rand_tensor(&ty(d, &[70_001]), 7, -4.0, 4.0);
        let y = run(&Op::Unary(UnaryOp::GeluErf), &[&x]);
        let want: Vec<f64> = x
            .to_f64_vec()
            .iter()
            .map(|&v| unary_ref(UnaryOp::GeluErf, v))
            .collect();
        assert_close(&y.to_f64_vec(), &want, tolerance(d), "gelu large");
    }
}

#[test]
fn erf_and_erfc_are_accurate() {
    use rustytorch_ops::elementwise::{erf, erfc};
    let xs = rand_tensor(&f64_ty(&[4000]), 4, -9.0, 9.0).to_f64_vec();
    for &x in &xs {
        let (e, c) = (erf(x), erfc(x));
        let (we, wc) = (erf_ref(x), erfc_ref(x));
        assert!(
            (e - we).abs() <= 1e-15 * (1.0 + we.abs()),
            "erf({x}) = {e} want {we}"
        );
        assert!(
            (c - wc).abs() <= 1e-14 * wc.abs(),
            "erfc({x}) = {c} want {wc}"
        );
    }
    assert_eq!(
        (erf(0.0), erf(f64::INFINITY), erf(f64::NEG_INFINITY)),
        (0.0, 1.0, -1.0)
    );
    assert_eq!(
        (erfc(f64::INFINITY), erfc(f64::NEG_INFINITY), erfc(30.0)),
        (0.0, 2.0, 0.0)
    );
    assert!(erf(f64::NAN).is_nan() && erfc(f64::NAN).is_nan());
}

#[test]
fn gelu_is_accurate_in_f64() {
    let xs = rand_tensor(&f64_ty(&[2000]), 3, -7.0, 7.0).to_f64_vec();
    let x = tensor(DType::F64, &[2000], &xs);
    let y = run(&Op::Unary(UnaryOp::GeluErf), &[&x]).to_f64_vec();
    for (i, &v) in xs.iter().enumerate() {
        let want = unary_ref(UnaryOp::GeluErf, v);
        assert!(
            (y[i] - want).abs() <= 1e-14 * (1.0 + want.abs()),
            "gelu({v}) = {} want {want}",
            y[i]
        );
    }
}

#[test]
fn unary_special_values() {
    let x = tensor(
        DType::F32,
        &[8],
        &[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.0, -0.0],
    );
    let r = run(&Op::Unary(UnaryOp::Round), &[&x]).to_f64_vec();
    assert_eq!(r, vec![0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 0.0, -0.0]);
    let s = run(&Op::Unary(UnaryOp::Sign), &[&x]).to_f64_vec();
    assert_eq!(s, vec![1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 0.0, 0.0]);
    let big = tensor(DType::F32, &[3], &[-100.0, 100.0, f64::NAN]);
    let sg = run(&Op::Unary(UnaryOp::Sigmoid), &[&big]).to_f64_vec();
    assert_eq!(&sg[..2], &[0.0, 1.0]);
    assert!(sg[2].is_nan());
    let rl = run(&Op::Unary(UnaryOp::Relu), &[&big]).to_f64_vec();
    assert_eq!(&rl[..2], &[0.0, 100.0]);
    assert!(rl[2].is_nan());
}

#[test]
fn unary_int_ops() {
    let ops = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Sign,
        UnaryOp::Relu,
        UnaryOp::Floor,
        UnaryOp::Ceil,
        UnaryOp::Round,
    ];
    for d in [DType::I32, DType::I64, DType::U8] {
        let (lo, hi) = if d == DType::U8 {
            (0.0, 250.0)
        } else {
            (-50.0, 50.0)
        };
        let x = rand_tensor(&ty(d, &[4, 9]), 5, lo, hi);
        for u in ops {
            if u == UnaryOp::Neg && d == DType::U8 {
                continue;
            }
            let y = run(&Op::Unary(u), &[&x]);
            assert_eq!(y.dtype(), d);
            let want: Vec<f64> = x.to_f64_vec().iter().map(|&v| unary_ref(u, v)).collect();
            assert_eq!(y.to_f64_vec(), want, "{u:?} {d}");
        }
    }
    // Wrapping: -i32::MIN and |i32::MIN| stay i32::MIN.
    let m = HostTensor::from_vec(vec![i32::MIN, 7], [2]).unwrap();
    assert_eq!(
        run(&Op::Unary(UnaryOp::Neg), &[&m])
            .to_vec::<i32>()
            .unwrap(),
        vec![i32::MIN, -7]
    );
    assert_eq!(
        run(&Op::Unary(UnaryOp::Abs), &[&m])
            .to_vec::<i32>()
            .unwrap(),
        vec![i32::MIN, 7]
    );
}

#[test]
fn predicates_and_not() {
    let vals = [1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.0, 3.5];
    for d in FLOATS {
        let x = tensor(d, &[6], &vals);
        for u in [UnaryOp::IsNan, UnaryOp::IsInf, UnaryOp::IsFinite] {
            let y = run(&Op::Unary(u), &[&x]);
            assert_eq!(y.dtype(), DType::Bool);
            let want: Vec<f64> = vals.iter().map(|&v| unary_ref(u, v)).collect();
            assert_eq!(y.to_f64_vec(), want, "{u:?} {d}");
        }
    }
    for d in [DType::I32, DType::I64, DType::U8] {
        let x = rand_tensor(&ty(d, &[5]), 1, 0.0, 100.0);
        assert_eq!(
            run(&Op::Unary(UnaryOp::IsNan), &[&x])
                .to_vec::<bool>()
                .unwrap(),
            vec![false; 5]
        );
        assert_eq!(
            run(&Op::Unary(UnaryOp::IsInf), &[&x])
                .to_vec::<bool>()
                .unwrap(),
            vec![false; 5]
        );
        assert_eq!(
            run(&Op::Unary(UnaryOp::IsFinite), &[&x])
                .to_vec::<bool>()
                .unwrap(),
            vec![true; 5]
        );
    }
    let b = rand_tensor(&ty(DType::Bool, &[2, 17]), 9, 0.0, 1.0);
    let nb = run(&Op::Unary(UnaryOp::Not), &[&b]);
    let want: Vec<f64> = b
        .to_f64_vec()
        .iter()
        .map(|&v| unary_ref(UnaryOp::Not, v))
        .collect();
    assert_eq!(nb.to_f64_vec(), want);
}

fn binary_ref(b: BinaryOp, x: f64, y: f64) -> f64 {
    match b {
        BinaryOp::Add => x + y,
        BinaryOp::Sub => x - y,
        BinaryOp::Mul => x * y,
        BinaryOp::Div => x / y,
        BinaryOp::Pow => x.powf(y),
        BinaryOp::Maximum => x.max(y),
        BinaryOp::Minimum => x.min(y),
        BinaryOp::Eq => (x == y) as u8 as f64,
        BinaryOp::Ne => (x != y) as u8 as f64,
        BinaryOp::Lt => (x < y) as u8 as f64,
        BinaryOp::Le => (x <= y) as u8 as f64,
        BinaryOp::Gt => (x > y) as u8 as f64,
        BinaryOp::Ge => (x >= y) as u8 as f64,
        BinaryOp::And => (x != 0.0 && y != 0.0) as u8 as f64,
        BinaryOp::Or => (x != 0.0 || y != 0.0) as u8 as f64,
    }
}

const ARITH: [BinaryOp; 7] = [
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Div,
    BinaryOp::Pow,
    BinaryOp::Maximum,
    BinaryOp::Minimum,
];
const CMP: [BinaryOp; 6] = [
    BinaryOp::Eq,
    BinaryOp::Ne,
    BinaryOp::Lt,
    BinaryOp::Le,
    BinaryOp::Gt,
    BinaryOp::Ge,
];

#[test]
fn binary_float_ops_broadcast_match_reference() {
    let (sa, sb, so) = ([4, 1, 5], [3, 1], [4, 3, 5]);
    for (k, &b) in ARITH.iter().enumerate() {
        for d in FLOATS {
            let (alo, ahi, blo, bhi) = match b {
                BinaryOp::Pow => (0.5, 2.0, -2.0, 2.0),
                BinaryOp::Div => (-3.0, 3.0, 0.5, 2.0),
                _ => (-3.0, 3.0, -3.0, 3.0),
            };
            let x = rand_tensor(&ty(d, &sa), 10 + k as u64, alo, ahi);
            let y = rand_tensor(&ty(d, &sb), 20 + k as u64, blo, bhi);
            let z = run(&Op::Binary(b), &[&x, &y]);
            assert_eq!(z.ty(), ty(d, &so), "{b:?} {d}");
            let want = bref(&x, &y, &so, |p, q| binary_ref(b, p, q));
            assert_close(&z.to_f64_vec(), &want, tolerance(d), &format!("{b:?} {d}"));
            // Swapped operand order exercises the other broadcast side.
            let z2 = run(&Op::Binary(b), &[&y, &x]);
            if b != BinaryOp::Pow && b != BinaryOp::Div {
                let want2 = bref(&y, &x, &so, |p, q| binary_ref(b, p, q));
                assert_close(
                    &z2.to_f64_vec(),
                    &want2,
                    tolerance(d),
                    &format!("{b:?} {d} swapped"),
                );
            }
        }
    }
}

#[test]
fn maximum_minimum_propagate_nan() {
    for d in FLOATS {
        let x = tensor(d, &[3], &[f64::NAN, 1.0, 2.0]);
        let y = tensor(d, &[3], &[1.0, f64::NAN, 3.0]);
        for b in [BinaryOp::Maximum, BinaryOp::Minimum] {
            let z = run(&Op::Binary(b), &[&x, &y]).to_f64_vec();
            assert!(z[0].is_nan() && z[1].is_nan(), "{b:?} {d}: {z:?}");
            assert_eq!(z[2], if b == BinaryOp::Maximum { 3.0 } else { 2.0 });
        }
    }
}

fn int_ref(b: BinaryOp, d: DType, x: i64, y: i64) -> i64 {
    let r = match b {
        BinaryOp::Add => x.wrapping_add(y),
        BinaryOp::Sub => x.wrapping_sub(y),
        BinaryOp::Mul => x.wrapping_mul(y),
        BinaryOp::Div => {
            if y == 0 {
                0
            } else {
                x / y
            }
        }
        BinaryOp::Pow => {
            if y < 0 {
                match x {
                    1 => 1,
                    -1 => {
                        if y % 2 == 0 {
                            1
                        } else {
                            -1
                        }
                    }
                    _ => 0,
                }
            } else {
                (0..y).fold(1i64, |acc, _| acc.wrapping_mul(x))
            }
        }
        BinaryOp::Maximum => x.max(y),
        BinaryOp::Minimum => x.min(y),
        _ => unreachable!(),
    };
    match d {
        DType::I32 => r as i32 as i64,
        DType::U8 => r as u8 as i64,
        _ => r,
    }
}

#[test]
fn binary_int_ops_match_reference() {
    let (sa, sb, so) = ([2, 3, 4], [4], [2, 3, 4]);
    for d in [DType::I32, DType::I64, DType::U8] {
        for (k, &b) in ARITH.iter().enumerate() {
            let (alo, ahi, blo, bhi) = match (b, d) {
                (BinaryOp::Pow, DType::U8) => (0.0, 6.0, 0.0, 4.0),
                (BinaryOp::Pow, _) => (-3.0, 6.0, -2.0, 5.0),
                (_, DType::U8) => (0.0, 250.0, 0.0, 20.0),
                _ => (-100.0, 100.0, -5.0, 5.0),
            };
            let x = rand_tensor(&ty(d, &sa), 30 + k as u64, alo, ahi);
            let y = rand_tensor(&ty(d, &sb), 40 + k as u64, blo, bhi);
            let z = run(&Op::Binary(b), &[&x, &y]);
            assert_eq!(z.ty(), ty(d, &so));
            let want = bref(&x, &y, &so, |p, q| int_ref(b, d, p as i64, q as i64) as f64);
            assert_eq!(z.to_f64_vec(), want, "{b:?} {d}");
        }
    }
}

#[test]
fn int_wrapping_and_division_by_zero() {
    let a = HostTensor::from_vec(vec![200u8, 7], [2]).unwrap();
    let b = HostTensor::from_vec(vec![100u8, 0], [2]).unwrap();
    assert_eq!(
        run(&Op::Binary(BinaryOp::Add), &[&a, &b])
            .to_vec::<u8>()
            .unwrap(),
        vec![44, 7]
    );
    assert_eq!(
        run(&Op::Binary(BinaryOp::Div), &[&a, &b])
            .to_vec::<u8>()
            .unwrap(),
        vec![2, 0]
    );
    let a = HostTensor::from_vec(vec![i64::MIN, -7, 7, i64::MAX], [4]).unwrap();
    let b = HostTensor::from_vec(vec![-1i64, 2, 0, 1], [4]).unwrap();
    assert_eq!(
        run(&Op::Binary(BinaryOp::Div), &[&a, &b])
            .to_vec::<i64>()
            .unwrap(),
        vec![i64::MIN, -3, 0, i64::MAX]
    );
    let m = HostTensor::from_vec(vec![i32::MAX], [1]).unwrap();
    let one = HostTensor::scalar(1i32);
    assert_eq!(
        run(&Op::Binary(BinaryOp::Add), &[&m, &one])
            .to_vec::<i32>()
            .unwrap(),
        vec![i32::MIN]
    );
    let base = HostTensor::from_vec(vec![2i32, -1, -1, 1, 0, 3], [6]).unwrap();
    let exp = HostTensor::from_vec(vec![-1i32, -3, -2, -5, -1, 4], [6]).unwrap();
    assert_eq!(
        run(&Op::Binary(BinaryOp::Pow), &[&base, &exp])
            .to_vec::<i32>()
            .unwrap(),
        vec![0, -1, 1, 1, 0, 81]
    );
}

#[test]
fn comparisons_every_dtype() {
    let (sa, sb, so) = ([3, 1, 4], [2, 1], [3, 2, 4]);
    for d in rustytorch_ops::DType::ALL {
        // Small integer-valued ranges make ties likely.
        let x = rand_tensor(&ty(d, &sa), 50, -3.0, 3.0);
        let y = rand_tensor(&ty(d, &sb), 51, -3.0, 3.0);
        let (x, y) = if d.is_float() {
            (
                run(&Op::Unary(UnaryOp::Round), &[&x]),
                run(&Op::Unary(UnaryOp::Round), &[&y]),
            )
        } else {
            (x, y)
        };
        for b in CMP {
            let z = run(&Op::Binary(b), &[&x, &y]);
            assert_eq!(z.ty(), ty(DType::Bool, &so));
            let want = bref(&x, &y, &so, |p, q| binary_ref(b, p, q));
            assert_eq!(z.to_f64_vec(), want, "{b:?} {d}");
        }
    }
    // NaN compares unequal to everything.
    let n = tensor(DType::F32, &[2], &[f64::NAN, 1.0]);
    let eq = run(&Op::Binary(BinaryOp::Eq), &[&n, &n])
        .to_vec::<bool>()
        .unwrap();
    let ne = run(&Op::Binary(BinaryOp::Ne), &[&n, &n])
        .to_vec::<bool>()
        .unwrap();
    assert_eq!((eq, ne), (vec![false, true], vec![true, false]));
}

#[test]
fn logic_ops() {
    let x = rand_tensor(&ty(DType::Bool, &[5, 1]), 60, 0.0, 1.0);
    let y = rand_tensor(&ty(DType::Bool, &[1, 6]), 61, 0.0, 1.0);
    for b in [BinaryOp::And, BinaryOp::Or] {
        let z = run(&Op::Binary(b), &[&x, &y]);
        assert_eq!(z.ty(), ty(DType::Bool, &[5, 6]));
        assert_eq!(
            z.to_f64_vec(),
            bref(&x, &y, &[5, 6], |p, q| binary_ref(b, p, q)),
            "{b:?}"
        );
    }
}

#[test]
fn broadcasting_edge_cases() {
    let cases: [(&[usize], &[usize], &[usize]); 9] = [
        (&[3, 1], &[1, 4], &[3, 4]),
        (&[2, 3, 4], &[4], &[2, 3, 4]),
        (&[2, 3, 4], &[3, 1], &[2, 3, 4]),
        (&[], &[2, 3], &[2, 3]),
        (&[2, 3], &[], &[2, 3]),
        (&[1, 1], &[3, 4], &[3, 4]),
        (&[0, 3], &[1, 3], &[0, 3]),
        (&[2, 0], &[2, 1], &[2, 0]),
        (&[5, 1, 0], &[4, 1], &[5, 4, 0]),
    ];
    for (sa, sb, so) in cases {
        for d in [DType::F32, DType::BF16, DType::I64] {
            let x = rand_tensor(&ty(d, sa), 70, -5.0, 5.0);
            let y = rand_tensor(&ty(d, sb), 71, -5.0, 5.0);
            let z = run(&Op::Binary(BinaryOp::Sub), &[&x, &y]);
            assert_eq!(z.ty(), ty(d, so), "{sa:?} - {sb:?}");
            let want = bref(&x, &y, so, |p, q| p - q);
            assert_close(
                &z.to_f64_vec(),
                &want,
                tolerance(d),
                &format!("{sa:?} - {sb:?} {d}"),
            );
        }
    }
}

#[test]
fn large_broadcasts_cross_chunk_boundaries() {
    // Rows of 257 do not align with the kernel's chunks; above the parallel threshold.
    let cases: [(&[usize], &[usize]); 3] = [
        (&[300, 257], &[257]),
        (&[300, 1], &[1, 257]),
        (&[300, 257], &[300, 1]),
    ];
    for (sa, sb) in cases {
        for d in [DType::F32, DType::F16] {
            let x = rand_tensor(&ty(d, sa), 80, -2.0, 2.0);
            let y = rand_tensor(&ty(d, sb), 81, -2.0, 2.0);
            let z = run(&Op::Binary(BinaryOp::Mul), &[&x, &y]);
            assert_eq!(z.dims(), &[300, 257]);
            let want = bref(&x, &y, &[300, 257], |p, q| p * q);
            assert_close(
                &z.to_f64_vec(),
                &want,
                tolerance(d),
                &format!("{sa:?} * {sb:?} {d}"),
            );
        }
    }
}

#[test]
fn errors_name_op_shapes_and_dtypes() {
    let e = rustytorch_ops::infer(
        &Op::Binary(BinaryOp::Add),
        &[&ty(DType::F32, &[2, 3]), &ty(DType::F64, &[2, 3])],
    )
    .unwrap_err()
    .to_string();
    for s in ["add", "f32[2,3]", "f64[2,3]", "promotion"] {
        assert!(e.contains(s), "{e:?} lacks {s}");
    }
    let e = rustytorch_ops::infer(
        &Op::Binary(BinaryOp::Mul),
        &[&ty(DType::F32, &[2, 3]), &ty(DType::F32, &[4])],
    )
    .unwrap_err()
    .to_string();
    for s in ["mul", "f32[2,3]", "f32[4]", "broadcast"] {
        assert!(e.contains(s), "{e:?} lacks {s}");
    }
    let e = rustytorch_ops::infer(&Op::Unary(UnaryOp::Exp), &[&ty(DType::I32, &[3])])
        .unwrap_err()
        .to_string();
    for s in ["exp", "i32[3]", "float"] {
        assert!(e.contains(s), "{e:?} lacks {s}");
    }
    let e = rustytorch_ops::infer(&Op::Unary(UnaryOp::Neg), &[&ty(DType::U8, &[3])])
        .unwrap_err()
        .to_string();
    assert!(e.contains("neg") && e.contains("u8[3]"), "{e}");
    let e = rustytorch_ops::infer(
        &Op::Binary(BinaryOp::Add),
        &[&ty(DType::Bool, &[2]), &ty(DType::Bool, &[2])],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("add") && e.contains("bool[2]"), "{e}");
    let e = rustytorch_ops::infer(
        &Op::Binary(BinaryOp::And),
        &[&ty(DType::F32, &[2]), &ty(DType::F32, &[2])],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("and") && e.contains("f32[2]") && e.contains("bool"),
        "{e}"
    );
    let e = rustytorch_ops::infer(&Op::Unary(UnaryOp::Not), &[&ty(DType::F32, &[2])])
        .unwrap_err()
        .to_string();
    assert!(e.contains("not") && e.contains("f32[2]"), "{e}");
    let e = rustytorch_ops::infer(
        &Op::Where,
        &[
            &ty(DType::F32, &[2]),
            &ty(DType::F32, &[2]),
            &ty(DType::F32, &[2]),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("where") && e.contains("condition") && e.contains("f32[2]"),
        "{e}"
    );
    let e = rustytorch_ops::infer(
        &Op::Where,
        &[
            &ty(DType::Bool, &[2]),
            &ty(DType::F32, &[2]),
            &ty(DType::F16, &[2]),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("where") && e.contains("f32[2]") && e.contains("f16[2]"),
        "{e}"
    );
    let e = rustytorch_ops::infer(
        &Op::Where,
        &[
            &ty(DType::Bool, &[3]),
            &ty(DType::F32, &[2]),
            &ty(DType::F32, &[2]),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("where") && e.contains("bool[3]") && e.contains("f32[2]"),
        "{e}"
    );
    let e = rustytorch_ops::infer(&Op::Unary(UnaryOp::Exp), &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("exp") && e.contains("expected 1"), "{e}");
    // The kernels validate too (no panic on mismatched tensors).
    let a = tensor(DType::F32, &[2], &[1.0, 2.0]);
    let b = tensor(DType::F64, &[2], &[1.0, 2.0]);
    assert!(eval_cpu(&Op::Binary(BinaryOp::Add), &[&a, &b]).is_err());
    assert!(rustytorch_ops::elementwise::cpu(
        &Op::Binary(BinaryOp::Add),
        &[&a],
        &ty(DType::F32, &[2])
    )
    .is_err());
}

#[test]
fn where_selects_with_broadcasting() {
    for d in [DType::F32, DType::F16, DType::I64, DType::Bool, DType::U8] {
        let c = rand_tensor(&ty(DType::Bool, &[3, 1]), 90, 0.0, 1.0);
        let a = rand_tensor(&ty(d, &[1, 4]), 91, -9.0, 9.0);
        let b = rand_tensor(&ty(d, &[]), 92, 1.0, 9.0);
        let z = run(&Op::Where, &[&c, &a, &b]);
        assert_eq!(z.ty(), ty(d, &[3, 4]));
        let (cv, av, bv) = (c.to_f64_vec(), a.to_f64_vec(), b.to_f64_vec());
        let want: Vec<f64> = (0..12)
            .map(|i| {
                if cv[bidx(&[3, 4], &[3, 1], i)] != 0.0 {
                    av[bidx(&[3, 4], &[1, 4], i)]
                } else {
                    bv[0]
                }
            })
            .collect();
        assert_eq!(z.to_f64_vec(), want, "{d}");
    }
    // Large, same-shape path.
    let c = rand_tensor(&ty(DType::Bool, &[50_000]), 93, 0.0, 1.0);
    let a = rand_tensor(&ty(DType::F32, &[50_000]), 94, -1.0, 1.0);
    let b = rand_tensor(&ty(DType::F32, &[50_000]), 95, -1.0, 1.0);
    let z = run(&Op::Where, &[&c, &a, &b]).to_f64_vec();
    let (cv, av, bv) = (c.to_f64_vec(), a.to_f64_vec(), b.to_f64_vec());
    for i in 0..50_000 {
        assert_eq!(z[i], if cv[i] != 0.0 { av[i] } else { bv[i] });
    }
}

// ---- the integer dtypes at every width, against i128 ----

/// `r` wrapped to the range of integer dtype `d` (two's complement at its width).
fn wrap(d: DType, r: i128) -> i128 {
    let m = 1i128 << (8 * d.size_bytes());
    let w = r.rem_euclid(m);
    if d.is_signed_int() && w >= m / 2 {
        w - m
    } else {
        w
    }
}

/// `n` seeded random values of integer dtype `d` over its whole range (random bit patterns),
/// none zero.
fn rand_int_vals(d: DType, n: usize, seed: u64) -> Vec<i128> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491_4f6c_dd1d;
    (0..n)
        .map(|_| {
            // splitmix64
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            match wrap(d, z as i128) {
                0 => 1,
                v => v,
            }
        })
        .collect()
}

fn int_tensor(d: DType, dims: &[usize], v: &[i128]) -> HostTensor {
    macro_rules! mk {
        ($t:ty) => {
            HostTensor::from_vec(
                v.iter().map(|&x| x as $t).collect::<Vec<$t>>(),
                dims.to_vec(),
            )
            .unwrap()
        };
    }
    match d {
        DType::I8 => mk!(i8),
        DType::I16 => mk!(i16),
        DType::I32 => mk!(i32),
        DType::I64 => mk!(i64),
        DType::U8 => mk!(u8),
        DType::U16 => mk!(u16),
        DType::U32 => mk!(u32),
        DType::U64 => mk!(u64),
        other => panic!("{other} is not an integer dtype"),
    }
}

/// The exact values of an integer or bool tensor.
fn int_vals(t: &HostTensor) -> Vec<i128> {
    use rustytorch_ops::Data;
    fn all<T: Copy>(v: &[T], f: impl Fn(T) -> i128) -> Vec<i128> {
        v.iter().map(|&x| f(x)).collect()
    }
    match t.data() {
        Data::I8(v) => all(v, i128::from),
        Data::I16(v) => all(v, i128::from),
        Data::I32(v) => all(v, i128::from),
        Data::I64(v) => all(v, i128::from),
        Data::U8(v) => all(v, i128::from),
        Data::U16(v) => all(v, i128::from),
        Data::U32(v) => all(v, i128::from),
        Data::U64(v) => all(v, i128::from),
        Data::Bool(v) => all(v, i128::from),
        other => panic!("{} is not an integer dtype", other.dtype()),
    }
}

/// The integer semantics of the arithmetic ops, in i128 then wrapped to `d`.
fn int_ref_wide(b: BinaryOp, d: DType, x: i128, y: i128) -> i128 {
    let r = match b {
        BinaryOp::Add => x + y,
        BinaryOp::Sub => x - y,
        BinaryOp::Mul => x.wrapping_mul(y),
        // Truncation toward zero; division by zero gives 0; MIN / -1 wraps to MIN.
        BinaryOp::Div if y == 0 => 0,
        BinaryOp::Div => x / y,
        BinaryOp::Pow if y < 0 => match x {
            1 => 1,
            -1 => 1 - 2 * (y & 1),
            _ => 0,
        },
        BinaryOp::Pow => (0..y).fold(1i128, |acc, _| wrap(d, acc.wrapping_mul(x))),
        BinaryOp::Maximum => x.max(y),
        BinaryOp::Minimum => x.min(y),
        BinaryOp::Eq => (x == y) as i128,
        BinaryOp::Ne => (x != y) as i128,
        BinaryOp::Lt => (x < y) as i128,
        BinaryOp::Le => (x <= y) as i128,
        BinaryOp::Gt => (x > y) as i128,
        BinaryOp::Ge => (x >= y) as i128,
        BinaryOp::And | BinaryOp::Or => unreachable!("bool only"),
    };
    if b.is_predicate() {
        r
    } else {
        wrap(d, r)
    }
}

#[test]
fn integer_binary_ops_at_every_width_match_i128() {
    // Broadcast shapes; whole-range values, so sums, products and quotients overflow and wrap.
    let (sa, sb, so) = ([3, 1, 40], [5, 40], [3, 5, 40]);
    let (na, nb) = (120, 200);
    for (k, d) in DType::INTS.into_iter().enumerate() {
        let seed = 100 + 10 * k as u64;
        let mut xv = rand_int_vals(d, na, seed);
        let mut yv = rand_int_vals(d, nb, seed + 1);
        // Division by zero, MIN / -1, ties for the comparisons and for maximum/minimum.
        yv[3] = 0;
        yv[17] = 0;
        if d.is_signed_int() {
            let min = -(1i128 << (8 * d.size_bytes() - 1));
            xv[5] = min;
            yv[5] = -1;
        }
        for i in (0..40).step_by(4) {
            yv[i] = xv[i];
        }
        let (x, y) = (int_tensor(d, &sa, &xv), int_tensor(d, &sb, &yv));
        for b in ARITH.into_iter().chain(CMP) {
            // Pow with small exponents (negative ones for the signed types).
            let (y, yv) = if b == BinaryOp::Pow {
                let lo = if d.is_signed_int() { -2 } else { 0 };
                let e: Vec<i128> = (0..nb as i128).map(|i| lo + i % 7).collect();
                (int_tensor(d, &sb, &e), e)
            } else {
                (y.clone(), yv.clone())
            };
            let z = run(&Op::Binary(b), &[&x, &y]);
            let out_dtype = if b.is_predicate() { DType::Bool } else { d };
            assert_eq!(z.ty(), ty(out_dtype, &so), "{b:?} {d}");
            let got = int_vals(&z);
            for (i, &g) in got.iter().enumerate() {
                let (p, q) = (xv[bidx(&so, &sa, i)], yv[bidx(&so, &sb, i)]);
                let want = int_ref_wide(b, d, p, q);
                assert_eq!(g, want, "{b:?} {d}: {p} and {q}");
            }
        }
    }
}

#[test]
fn integer_unary_ops_and_where_at_every_width() {
    for (k, d) in DType::INTS.into_iter().enumerate() {
        let mut xv = rand_int_vals(d, 64, 300 + k as u64);
        if d.is_signed_int() {
            xv[0] = -(1i128 << (8 * d.size_bytes() - 1));
        }
        let x = int_tensor(d, &[64], &xv);
        let mut ops = vec![
            UnaryOp::Abs,
            UnaryOp::Sign,
            UnaryOp::Relu,
            UnaryOp::Floor,
            UnaryOp::Round,
        ];
        if d.is_signed_int() {
            ops.push(UnaryOp::Neg);
        }
        for u in ops {
            let got = int_vals(&run(&Op::Unary(u), &[&x]));
            let want: Vec<i128> = xv
                .iter()
                .map(|&v| {
                    wrap(
                        d,
                        match u {
                            UnaryOp::Abs => v.abs(),
                            UnaryOp::Sign => v.signum(),
                            UnaryOp::Relu => v.max(0),
                            UnaryOp::Neg => -v,
                            _ => v,
                        },
                    )
                })
                .collect();
            assert_eq!(got, want, "{u:?} {d}");
        }
        // where(c, a, b) with a broadcast scalar branch.
        let c = rand_tensor(&ty(DType::Bool, &[64]), 310 + k as u64, 0.0, 1.0);
        let bv = rand_int_vals(d, 1, 320 + k as u64);
        let b = int_tensor(d, &[], &bv);
        let got = int_vals(&run(&Op::Where, &[&c, &x, &b]));
        let cv = c.to_vec::<bool>().unwrap();
        let want: Vec<i128> = (0..64).map(|i| if cv[i] { xv[i] } else { bv[0] }).collect();
        assert_eq!(got, want, "where {d}");
    }
}

#[test]
fn integer_casts_between_every_width_are_exact() {
    // Integer to integer wraps (Rust `as`), integer to f32/f64 rounds once to nearest, integer to
    // bool is `!= 0`; values over the whole range of each source type.
    for (k, from) in DType::INTS.into_iter().enumerate() {
        let mut v = rand_int_vals(from, 300, 500 + k as u64);
        v.extend([0, 1, 127, 128, 255, 256, 65_535, 65_536].map(|x| wrap(from, x)));
        if from.is_signed_int() {
            v.extend([-1, -128, -129, -32_769]);
            v.iter_mut().for_each(|x| *x = wrap(from, *x));
        }
        let src = int_tensor(from, &[v.len()], &v);
        for to in DType::INTS.into_iter().chain([DType::Bool]) {
            let got = int_vals(&run(&Op::Cast { to }, &[&src]));
            let want: Vec<i128> = v
                .iter()
                .map(|&x| {
                    if to == DType::Bool {
                        (x != 0) as i128
                    } else {
                        wrap(to, x)
                    }
                })
                .collect();
            assert_eq!(got, want, "cast {from} -> {to}");
            // The host-side conversion is the same kernel.
            assert_eq!(
                src.cast(to),
                run(&Op::Cast { to }, &[&src]),
                "{from} -> {to}"
            );
        }
        let f64s = run(&Op::Cast { to: DType::F64 }, &[&src])
            .to_vec::<f64>()
            .unwrap();
        let f32s = run(&Op::Cast { to: DType::F32 }, &[&src])
            .to_vec::<f32>()
            .unwrap();
        for (i, &x) in v.iter().enumerate() {
            assert_eq!(f64s[i], x as f64, "{from} -> f64: {x}");
            assert_eq!(f32s[i], x as f32, "{from} -> f32: {x}");
        }
        // Back from the float: truncation and saturation (exact where the float holds the value).
        let back = run(
            &Op::Cast { to: from },
            &[&run(&Op::Cast { to: DType::F64 }, &[&src])],
        );
        for (i, g) in int_vals(&back).into_iter().enumerate() {
            let f = f64s[i];
            let want = match from {
                DType::I64 => f as i64 as i128,
                DType::U64 => f as u64 as i128,
                _ => v[i],
            };
            assert_eq!(g, want, "{from} -> f64 -> {from}");
        }
    }
}

#[test]
fn ops_without_integer_kernels_are_dtype_errors_naming_the_op() {
    for d in [DType::I8, DType::I16, DType::U16, DType::U32, DType::U64] {
        let x = ty(d, &[2, 3]);
        let cases: Vec<(Op, Vec<TensorType>, &str)> = vec![
            (Op::Unary(UnaryOp::Exp), vec![x.clone()], "exp"),
            (Op::Unary(UnaryOp::Sqrt), vec![x.clone()], "sqrt"),
            (Op::Binary(BinaryOp::And), vec![x.clone(), x.clone()], "and"),
            (
                Op::Binary(BinaryOp::Add),
                vec![x.clone(), ty(DType::I32, &[2, 3])],
                "add",
            ),
        ];
        for (op, tys, name) in cases {
            let refs: Vec<&TensorType> = tys.iter().collect();
            let e = rustytorch_ops::infer(&op, &refs).unwrap_err().to_string();
            assert!(e.contains(name) && e.contains(&x.to_string()), "{e}");
            let ins: Vec<HostTensor> = tys.iter().map(|t| rand_tensor(t, 1, 1.0, 9.0)).collect();
            let ins: Vec<&HostTensor> = ins.iter().collect();
            let e = eval_cpu(&op, &ins).unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        }
        if d.is_unsigned_int() {
            let e = rustytorch_ops::infer(&Op::Unary(UnaryOp::Neg), &[&x])
                .unwrap_err()
                .to_string();
            assert!(e.contains("neg") && e.contains("signed"), "{e}");
        }
    }
}

// ---- casts ----

/// Correct round-to-nearest-even of `v` to a 16-bit float, checked against its neighbours.
fn ref_round16(v: f64, bits: impl Fn(f64) -> u16, from_bits: impl Fn(u16) -> f64, max: f64) -> f64 {
    if v.is_nan() || v.is_infinite() {
        return v;
    }
    let prev_max = from_bits(bits(max) - 1);
    let overflow = max + (max - prev_max) / 2.0;
    if v.abs() >= overflow {
        return f64::INFINITY.copysign(v);
    }
    let r = from_bits(bits(v)); // a candidate near v
    let rb = bits(r);
    let mut best = r;
    for c in [rb.wrapping_sub(1), rb, rb.wrapping_add(1)] {
        let cv = from_bits(c);
        if !cv.is_finite() {
            continue;
        }
        let (dc, db) = ((cv - v).abs(), (best - v).abs());
        if dc < db || (dc == db && bits(cv) & 1 == 0 && bits(best) & 1 == 1) {
            best = cv;
        }
    }
    best
}

fn ref_f16(v: f64) -> f64 {
    ref_round16(
        v,
        |x| f16::from_f64(x).to_bits(),
        |b| f16::from_bits(b).to_f64(),
        65504.0,
    )
}

fn ref_bf16(v: f64) -> f64 {
    ref_round16(
        v,
        |x| bf16::from_f64(x).to_bits(),
        |b| bf16::from_bits(b).to_f64(),
        bf16::MAX.to_f64(),
    )
}

fn cast_ref(from: DType, to: DType, v: f64) -> f64 {
    let int_src = !from.is_float();
    // Integer sources wrap (Rust `as` between integers), float sources truncate and saturate.
    macro_rules! int {
        ($t:ty) => {
            if int_src {
                v as i128 as $t as f64
            } else {
                v as $t as f64
            }
        };
    }
    match to {
        DType::F32 => v as f32 as f64,
        DType::F64 => v,
        DType::F16 => ref_f16(v),
        DType::BF16 => ref_bf16(v),
        DType::I8 => int!(i8),
        DType::I16 => int!(i16),
        DType::I32 => int!(i32),
        DType::I64 => int!(i64),
        DType::U8 => int!(u8),
        DType::U16 => int!(u16),
        DType::U32 => int!(u32),
        DType::U64 => int!(u64),
        DType::Bool => (v != 0.0) as u8 as f64,
    }
}

#[test]
fn cast_every_pair_of_dtypes() {
    let specials = [
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.5,
        2.5,
        -0.7,
        -2.5,
        1e10,
        -1e10,
        300.0,
        -129.0,
        0.0,
    ];
    for from in DType::ALL {
        let (lo, hi) = if from == DType::U8 {
            (0.0, 256.0)
        } else {
            (-400.0, 400.0)
        };
        let mut x = rand_tensor(&ty(from, &[200]), 99, lo, hi).to_f64_vec();
        if from.is_float() {
            x.extend_from_slice(&specials);
        } else if from != DType::Bool {
            x.extend_from_slice(&[0.0, 255.0, 256.0, 300.0, 127.0, 128.0, -1.0, -129.0].map(
                |v: f64| {
                    if from == DType::U8 {
                        v.clamp(0.0, 255.0)
                    } else {
                        v
                    }
                },
            ));
        }
        let src = tensor(from, &[x.len()], &x);
        let xv = src.to_f64_vec();
        for to in DType::ALL {
            let y = run(&Op::Cast { to }, &[&src]);
            assert_eq!(y.ty(), ty(to, &[x.len()]));
            let got = y.to_f64_vec();
            for (i, &v) in xv.iter().enumerate() {
                let want = cast_ref(from, to, v);
                assert!(
                    got[i] == want || (got[i].is_nan() && want.is_nan()),
                    "cast {from} -> {to}: {v} gave {} want {want}",
                    got[i]
                );
            }
        }
    }
}

#[test]
fn casts_to_half_round_once() {
    // f64 values just above a tie of the 16-bit format: rounding through f32 first would land on
    // the tie and round to even (down); the correct result rounds up.
    let x = tensor(
        DType::F64,
        &[2],
        &[
            1.0 + 2f64.powi(-8) + 2f64.powi(-40),
            1.0 + 2f64.powi(-11) + 2f64.powi(-40),
        ],
    );
    let b = run(&Op::Cast { to: DType::BF16 }, &[&x]).to_f64_vec();
    assert_eq!(b[0], 1.0 + 2f64.powi(-7));
    let h = run(&Op::Cast { to: DType::F16 }, &[&x]).to_f64_vec();
    assert_eq!(h[1], 1.0 + 2f64.powi(-10));
    let big = (1i64 << 40) + (1i64 << 32) + 1;
    let i = HostTensor::from_vec(vec![big, -big], [2]).unwrap();
    let b = run(&Op::Cast { to: DType::BF16 }, &[&i]).to_f64_vec();
    let want = ((1i64 << 40) + (1i64 << 33)) as f64;
    assert_eq!(b, vec![want, -want]);
    let f = run(&Op::Cast { to: DType::F32 }, &[&i])
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(f, vec![big as f32, -big as f32]);
}

// ---- fused kernels ----

fn instr(op: Op, args: &[u32], dtype: DType) -> FusedInstr {
    FusedInstr {
        op,
        args: args.to_vec(),
        dtype,
    }
}

fn scalar_full(v: f64, d: DType) -> Op {
    Op::Full {
        value: F64Bits::new(v),
        ty: ty(d, &[]),
    }
}

#[test]
fn fused_kernel_matches_ops_one_by_one() {
    for (dims, seed) in [(vec![4usize, 300], 1u64), (vec![200, 300], 2)] {
        let rows = dims[0];
        let x = rand_tensor(&ty(DType::F32, &dims), seed, -3.0, 3.0);
        let w = rand_tensor(&ty(DType::F32, &[300]), seed + 10, -2.0, 2.0);
        let b = rand_tensor(&ty(DType::F32, &[]), seed + 20, -1.0, 1.0);
        let m = rand_tensor(&ty(DType::Bool, &[rows, 1]), seed + 30, 0.0, 1.0);
        let k = FusedKernel {
            n_inputs: 4,
            instrs: vec![
                instr(Op::Binary(BinaryOp::Mul), &[0, 1], DType::F32), // 4
                instr(Op::Binary(BinaryOp::Add), &[4, 2], DType::F32), // 5
                instr(Op::Unary(UnaryOp::GeluErf), &[5], DType::F32),  // 6
                instr(scalar_full(0.25, DType::F32), &[], DType::F32), // 7
                instr(Op::Where, &[3, 6, 7], DType::F32),              // 8
                instr(Op::Binary(BinaryOp::Maximum), &[8, 5], DType::F32), // 9
                instr(Op::Cast { to: DType::F16 }, &[9], DType::F16),  // 10
            ],
            out: ty(DType::F16, &dims),
        };
        let fused = run(&Op::Fused(Box::new(k)), &[&x, &w, &b, &m]);
        let v4 = run(&Op::Binary(BinaryOp::Mul), &[&x, &w]);
        let v5 = run(&Op::Binary(BinaryOp::Add), &[&v4, &b]);
        let v6 = run(&Op::Unary(UnaryOp::GeluErf), &[&v5]);
        let c = HostTensor::scalar(0.25f32);
        let v8 = run(&Op::Where, &[&m, &v6, &c]);
        let v9 = run(&Op::Binary(BinaryOp::Maximum), &[&v8, &v5]);
        let v10 = run(&Op::Cast { to: DType::F16 }, &[&v9]);
        assert_eq!(fused.ty(), v10.ty());
        assert_close(
            &fused.to_f64_vec(),
            &v10.to_f64_vec(),
            0.0,
            "fused f32 chain",
        );
    }
}

#[test]
fn fused_integer_and_f64_kernels() {
    // i32 division (truncating, by zero gives 0), a comparison, casts, and f64 compute.
    let a = rand_tensor(&ty(DType::I32, &[3, 50]), 5, -100.0, 100.0);
    let b = rand_tensor(&ty(DType::I32, &[50]), 6, -4.0, 4.0);
    let x = rand_tensor(&ty(DType::F64, &[3, 1]), 7, -2.0, 2.0);
    let k = FusedKernel {
        n_inputs: 3,
        instrs: vec![
            instr(Op::Binary(BinaryOp::Div), &[0, 1], DType::I32), // 3
            instr(Op::Cast { to: DType::F64 }, &[3], DType::F64),  // 4
            instr(Op::Binary(BinaryOp::Mul), &[4, 2], DType::F64), // 5
            instr(Op::Unary(UnaryOp::Exp), &[2], DType::F64),      // 6
            instr(Op::Binary(BinaryOp::Gt), &[5, 6], DType::Bool), // 7
            instr(Op::Where, &[7, 5, 6], DType::F64),              // 8
            instr(Op::Binary(BinaryOp::Add), &[8, 4], DType::F64), // 9
        ],
        out: ty(DType::F64, &[3, 50]),
    };
    let fused = run(&Op::Fused(Box::new(k)), &[&a, &b, &x]);
    let v3 = run(&Op::Binary(BinaryOp::Div), &[&a, &b]);
    let v4 = run(&Op::Cast { to: DType::F64 }, &[&v3]);
    let v5 = run(&Op::Binary(BinaryOp::Mul), &[&v4, &x]);
    let v6 = run(&Op::Unary(UnaryOp::Exp), &[&x]);
    let v7 = run(&Op::Binary(BinaryOp::Gt), &[&v5, &v6]);
    let v8 = run(&Op::Where, &[&v7, &v5, &v6]);
    let v9 = run(&Op::Binary(BinaryOp::Add), &[&v8, &v4]);
    assert_close(
        &fused.to_f64_vec(),
        &v9.to_f64_vec(),
        1e-15,
        "fused int/f64",
    );

    // u8 arithmetic wraps inside a fused kernel as it does unfused; float->u8 cast saturates.
    let p = HostTensor::from_vec(vec![200u8, 10, 255], [3]).unwrap();
    let q = HostTensor::from_vec(vec![100u8, 20, 255], [3]).unwrap();
    let f = HostTensor::from_vec(vec![300.5f32, -3.0, 7.9], [3]).unwrap();
    let k = FusedKernel {
        n_inputs: 3,
        instrs: vec![
            instr(Op::Binary(BinaryOp::Add), &[0, 1], DType::U8), // 3
            instr(Op::Cast { to: DType::U8 }, &[2], DType::U8),   // 4
            instr(Op::Binary(BinaryOp::Maximum), &[3, 4], DType::U8), // 5
        ],
        out: ty(DType::U8, &[3]),
    };
    let fused = run(&Op::Fused(Box::new(k)), &[&p, &q, &f]);
    let s = run(&Op::Binary(BinaryOp::Add), &[&p, &q]);
    let c = run(&Op::Cast { to: DType::U8 }, &[&f]);
    let want = run(&Op::Binary(BinaryOp::Maximum), &[&s, &c]);
    assert_eq!(fused, want);
    assert_eq!(fused.to_vec::<u8>().unwrap(), vec![255, 30, 254]);
}

#[test]
fn fused_constant_kernel_and_scalar_inputs() {
    // Every value is constant: folded once, then broadcast to the output.
    let s = HostTensor::scalar(2.0f32);
    let k = FusedKernel {
        n_inputs: 1,
        instrs: vec![
            instr(scalar_full(3.0, DType::F32), &[], DType::F32),
            instr(Op::Binary(BinaryOp::Pow), &[0, 1], DType::F32),
            instr(Op::Unary(UnaryOp::Sqrt), &[2], DType::F32),
        ],
        out: ty(DType::F32, &[2, 3]),
    };
    let y = run(&Op::Fused(Box::new(k)), &[&s]);
    assert_close(&y.to_f64_vec(), &[8f64.sqrt(); 6], 1e-6, "constant kernel");
}

#[test]
fn fused_kernel_validation() {
    let good = FusedKernel {
        n_inputs: 1,
        instrs: vec![instr(Op::Unary(UnaryOp::Exp), &[0], DType::F32)],
        out: ty(DType::F32, &[4]),
    };
    let t = ty(DType::F32, &[4]);
    assert_eq!(
        rustytorch_ops::infer(&Op::Fused(Box::new(good.clone())), &[&t]).unwrap(),
        t
    );
    assert!(rustytorch_ops::infer(&Op::Fused(Box::new(good.clone())), &[&t, &t]).is_err());
    let bad_shape =
        rustytorch_ops::infer(&Op::Fused(Box::new(good.clone())), &[&ty(DType::F32, &[3])])
            .unwrap_err();
    assert!(bad_shape.to_string().contains("f32[3]"), "{bad_shape}");
    let mut k = good.clone();
    k.instrs[0].args = vec![1];
    assert!(rustytorch_ops::infer(&Op::Fused(Box::new(k)), &[&t]).is_err());
    let mut k = good.clone();
    k.instrs[0].dtype = DType::F64;
    assert!(rustytorch_ops::infer(&Op::Fused(Box::new(k)), &[&t]).is_err());
    let ill = FusedKernel {
        n_inputs: 1,
        instrs: vec![instr(Op::Unary(UnaryOp::Exp), &[0], DType::I32)],
        out: ty(DType::I32, &[4]),
    };
    let e = rustytorch_ops::infer(&Op::Fused(Box::new(ill)), &[&ty(DType::I32, &[4])]).unwrap_err();
    assert!(e.to_string().contains("exp"), "{e}");
    let empty = FusedKernel {
        n_inputs: 1,
        instrs: vec![],
        out: t.clone(),
    };
    assert!(rustytorch_ops::infer(&Op::Fused(Box::new(empty)), &[&t]).is_err());
    let foreign = FusedKernel {
        n_inputs: 1,
        instrs: vec![instr(Op::Softmax { axis: 0 }, &[0], DType::F32)],
        out: t.clone(),
    };
    assert!(rustytorch_ops::infer(&Op::Fused(Box::new(foreign)), &[&t]).is_err());
    // No gradient rule: fusion runs after differentiation.
    let x = rand_tensor(&t, 1, -1.0, 1.0);
    assert!(vjp_eager(&Op::Fused(Box::new(good)), std::slice::from_ref(&x), &x).is_err());
}

// ---- gradients ----

const DIFFERENTIABLE_UNARY: [(UnaryOp, f64, f64); 20] = FLOAT_UNARY;

#[test]
fn gradcheck_unary() {
    for (k, &(u, lo, hi)) in DIFFERENTIABLE_UNARY.iter().enumerate() {
        let x = rand_tensor(&f64_ty(&[2, 3, 4]), 200 + k as u64, lo, hi);
        gradcheck(&Op::Unary(u), &[x], &[0], 300 + k as u64)
            .unwrap_or_else(|e| panic!("{u:?}: {e}"));
    }
    // gelu's gradient at exactly 0 (the Φ = gelu/x form has a special case there).
    let z = tensor(DType::F64, &[3], &[0.0, 1e-300, -2.0]);
    let g = tensor(DType::F64, &[3], &[1.0, 1.0, 1.0]);
    let gx = vjp_eager(&Op::Unary(UnaryOp::GeluErf), &[z], &g).unwrap()[0]
        .clone()
        .unwrap()
        .to_f64_vec();
    let phi = |x: f64| (-x * x / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
    let want = [
        0.5,
        0.5,
        0.5 * (1.0 + erf_ref(-2.0 / 2f64.sqrt())) - 2.0 * phi(-2.0),
    ];
    assert_close(&gx, &want, 1e-12, "gelu'(0)");
}

#[test]
fn unary_gradients_in_f32_agree_with_f64() {
    for (k, &(u, lo, hi)) in DIFFERENTIABLE_UNARY.iter().enumerate() {
        let x64 = rand_tensor(&f64_ty(&[5, 3]), 400 + k as u64, lo, hi);
        let g64 = rand_tensor(&f64_ty(&[5, 3]), 500 + k as u64, -1.0, 1.0);
        let (x32, g32) = (x64.cast(DType::F32), g64.cast(DType::F32));
        let want = vjp_eager(
            &Op::Unary(u),
            &[x32.cast(DType::F64)],
            &g32.cast(DType::F64),
        )
        .unwrap()[0]
            .clone()
            .unwrap();
        let got = vjp_eager(&Op::Unary(u), &[x32], &g32).unwrap()[0]
            .clone()
            .unwrap();
        assert_eq!(got.dtype(), DType::F32, "{u:?}");
        assert_close(
            &got.to_f64_vec(),
            &want.to_f64_vec(),
            1e-4,
            &format!("{u:?} f32 gradient"),
        );
    }
}

#[test]
fn gradcheck_binary_with_broadcasting() {
    for (k, &b) in ARITH.iter().enumerate() {
        let (alo, ahi, blo, bhi) = match b {
            BinaryOp::Pow => (0.5, 2.0, -2.0, 2.0),
            BinaryOp::Div => (-2.0, 2.0, 0.5, 2.0),
            _ => (-2.0, 2.0, -2.0, 2.0),
        };
        let x = rand_tensor(&f64_ty(&[3, 1, 4]), 600 + k as u64, alo, ahi);
        let y = rand_tensor(&f64_ty(&[2, 1]), 700 + k as u64, blo, bhi);
        gradcheck(
            &Op::Binary(b),
            &[x.clone(), y.clone()],
            &[0, 1],
            800 + k as u64,
        )
        .unwrap_or_else(|e| panic!("{b:?}: {e}"));
        // A scalar operand.
        let s = rand_tensor(&f64_ty(&[]), 900 + k as u64, blo, bhi);
        gradcheck(&Op::Binary(b), &[x, s], &[0, 1], 1000 + k as u64)
            .unwrap_or_else(|e| panic!("{b:?} scalar: {e}"));
    }
}

#[test]
fn gradient_special_cases() {
    let g = tensor(DType::F64, &[3], &[1.0, 1.0, 1.0]);
    // maximum/minimum split ties evenly.
    let a = tensor(DType::F64, &[3], &[1.0, 2.0, 3.0]);
    let b = tensor(DType::F64, &[3], &[1.0, 5.0, 0.0]);
    let gs = vjp_eager(&Op::Binary(BinaryOp::Maximum), &[a.clone(), b.clone()], &g).unwrap();
    assert_eq!(gs[0].as_ref().unwrap().to_f64_vec(), vec![0.5, 0.0, 1.0]);
    assert_eq!(gs[1].as_ref().unwrap().to_f64_vec(), vec![0.5, 1.0, 0.0]);
    let gs = vjp_eager(&Op::Binary(BinaryOp::Minimum), &[a, b], &g).unwrap();
    assert_eq!(gs[0].as_ref().unwrap().to_f64_vec(), vec![0.5, 1.0, 0.0]);
    // Comparisons, logic and predicates have no gradient; integer inputs neither.
    let x = tensor(DType::F64, &[3], &[1.0, 2.0, 3.0]);
    let gb = tensor(DType::Bool, &[3], &[1.0, 0.0, 1.0]);
    assert_eq!(
        vjp_eager(&Op::Binary(BinaryOp::Lt), &[x.clone(), x.clone()], &gb).unwrap(),
        vec![None, None]
    );
    assert_eq!(
        vjp_eager(&Op::Unary(UnaryOp::IsNan), std::slice::from_ref(&x), &gb).unwrap(),
        vec![None]
    );
    let i = tensor(DType::I64, &[3], &[1.0, 2.0, 3.0]);
    assert_eq!(
        vjp_eager(&Op::Binary(BinaryOp::Mul), &[i.clone(), i.clone()], &i).unwrap(),
        vec![None, None]
    );
    assert_eq!(
        vjp_eager(&Op::Unary(UnaryOp::Abs), std::slice::from_ref(&i), &i).unwrap(),
        vec![None]
    );
    // Zero-gradient ops emit zeros of the input's type.
    let gz = vjp_eager(&Op::Unary(UnaryOp::Floor), std::slice::from_ref(&x), &g).unwrap()[0]
        .clone()
        .unwrap();
    assert_eq!(gz, HostTensor::zeros(&x.ty()));
    // pow: no NaN from 0^b·ln 0 when b >= 0, and d/da = 0 where b = 0.
    let a = tensor(DType::F64, &[2], &[0.0, 0.0]);
    let b = tensor(DType::F64, &[2], &[2.0, 0.0]);
    let gs = vjp_eager(
        &Op::Binary(BinaryOp::Pow),
        &[a, b],
        &tensor(DType::F64, &[2], &[1.0, 1.0]),
    )
    .unwrap();
    assert_eq!(gs[0].as_ref().unwrap().to_f64_vec(), vec![0.0, 0.0]);
    assert_eq!(gs[1].as_ref().unwrap().to_f64_vec(), vec![0.0, 0.0]);
}

#[test]
fn gradcheck_where_and_cast() {
    let c = rand_tensor(&ty(DType::Bool, &[3, 1]), 1, 0.0, 1.0);
    let a = rand_tensor(&f64_ty(&[1, 4]), 2, -1.0, 1.0);
    let b = rand_tensor(&f64_ty(&[3, 4]), 3, -1.0, 1.0);
    gradcheck(&Op::Where, &[c.clone(), a.clone(), b.clone()], &[1, 2], 4).unwrap();
    let gs = vjp_eager(&Op::Where, &[c, a, b.clone()], &b).unwrap();
    assert!(gs[0].is_none());
    // cast: the gradient is cast back to the input's dtype.
    let x = rand_tensor(&ty(DType::F32, &[2, 3]), 5, -1.0, 1.0);
    let g = rand_tensor(&f64_ty(&[2, 3]), 6, -1.0, 1.0);
    let gx = vjp_eager(&Op::Cast { to: DType::F64 }, std::slice::from_ref(&x), &g).unwrap()[0]
        .clone()
        .unwrap();
    assert_eq!(gx, g.cast(DType::F32));
    let xi = rand_tensor(&ty(DType::I32, &[2, 3]), 7, -5.0, 5.0);
    assert_eq!(
        vjp_eager(&Op::Cast { to: DType::F64 }, &[xi], &g).unwrap(),
        vec![None]
    );
    gradcheck(
        &Op::Cast { to: DType::F64 },
        std::slice::from_ref(&g),
        &[0],
        8,
    )
    .unwrap();
}
