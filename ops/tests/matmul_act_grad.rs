//! `MatmulActGrad` (`(op(A)·op(B)) ⊙ act'(pre)`) against a float64 reference on seeded random
//! inputs: every float dtype and activation, every transpose combination, batched and broadcast
//! batch dims; agreement with the gradient rule it replaces; shape errors; its own vjp's error.

use rustytorch_ops::testing::{assert_close, rand_tensor, tolerance, vjp_eager};
use rustytorch_ops::{
    eval_cpu, infer, Activation, DType, HostTensor, Op, OpError, Shape, TensorType, UnaryOp,
};

fn dgelu_tanh(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let t = (c * (x + 0.044715 * x.powi(3))).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
}

fn dgelu_erf(x: f64) -> f64 {
    let cdf = 0.5 * (1.0 + rustytorch_ops::elementwise::erf(x / 2f64.sqrt()));
    cdf + x * (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

fn derivative(act: Activation, x: f64) -> f64 {
    match act {
        Activation::None => 1.0,
        Activation::Relu => (x > 0.0) as u8 as f64,
        Activation::GeluErf => dgelu_erf(x),
        Activation::GeluTanh => dgelu_tanh(x),
    }
}

/// The float64 reference over row-major operands with numpy batch broadcasting.
fn reference(
    a: &HostTensor,
    b: &HostTensor,
    pre: &HostTensor,
    ta: bool,
    tb: bool,
    act: Activation,
) -> Vec<f64> {
    let (ad, bd) = (a.dims(), b.dims());
    let (ra, rb) = (ad.len(), bd.len());
    let (m, k) = if ta {
        (ad[ra - 1], ad[ra - 2])
    } else {
        (ad[ra - 2], ad[ra - 1])
    };
    let n = if tb { bd[rb - 2] } else { bd[rb - 1] };
    let (sa, sb) = (Shape::new(&ad[..ra - 2]), Shape::new(&bd[..rb - 2]));
    let batch = Shape::broadcast(&sa, &sb).unwrap();
    let (av, bv, pv) = (a.to_f64_vec(), b.to_f64_vec(), pre.to_f64_vec());
    let offs = |own: &Shape, mat: usize| -> Vec<usize> {
        let st = own.broadcast_strides(&batch);
        (0..batch.numel())
            .map(|mut f| {
                let mut off = 0;
                for d in (0..batch.rank()).rev() {
                    off += (f % batch.dims()[d]) * st[d];
                    f /= batch.dims()[d];
                }
                off * mat
            })
            .collect()
    };
    let (oa, ob) = (offs(&sa, m * k), offs(&sb, k * n));
    let mut out = Vec::with_capacity(batch.numel() * m * n);
    for bi in 0..batch.numel() {
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for l in 0..k {
                    let x = if ta {
                        av[oa[bi] + l * m + i]
                    } else {
                        av[oa[bi] + i * k + l]
                    };
                    let y = if tb {
                        bv[ob[bi] + j * k + l]
                    } else {
                        bv[ob[bi] + l * n + j]
                    };
                    s += x * y;
                }
                let idx = out.len();
                out.push(s * derivative(act, pv[idx]));
            }
        }
    }
    out
}

/// Stored dims of an operand of matrix `r×c` (swapped when transposed) with batch dims `batch`.
fn dims(batch: &[usize], r: usize, c: usize, t: bool) -> Vec<usize> {
    let mut d = batch.to_vec();
    if t {
        d.extend([c, r]);
    } else {
        d.extend([r, c]);
    }
    d
}

#[test]
fn matches_the_f64_reference() {
    let acts = [Activation::Relu, Activation::GeluErf, Activation::GeluTanh];
    // (batch of a, batch of b, m, k, n): odd sizes, a plain matrix, broadcast batches, and one
    // big enough for the parallel path.
    let shapes: [(&[usize], &[usize], usize, usize, usize); 5] = [
        (&[], &[], 7, 5, 9),
        (&[], &[], 64, 48, 520),
        (&[3], &[3], 4, 6, 5),
        (&[2, 1], &[3], 3, 4, 8),
        (&[2], &[], 5, 3, 16),
    ];
    let mut seed = 1;
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for &act in &acts {
            for &(ba, bb, m, k, n) in &shapes {
                for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                    seed += 3;
                    let a = rand_tensor(&TensorType::new(dt, dims(ba, m, k, ta)), seed, -1.0, 1.0);
                    let b = rand_tensor(
                        &TensorType::new(dt, dims(bb, k, n, tb)),
                        seed + 1,
                        -1.0,
                        1.0,
                    );
                    let batch = Shape::broadcast(&Shape::new(ba), &Shape::new(bb)).unwrap();
                    let mut od = batch.dims().to_vec();
                    od.extend([m, n]);
                    let pre = rand_tensor(&TensorType::new(dt, od.clone()), seed + 2, -4.0, 4.0);
                    let op = Op::MatmulActGrad {
                        trans_a: ta,
                        trans_b: tb,
                        act,
                    };
                    let got = eval_cpu(&op, &[&a, &b, &pre]).unwrap();
                    assert_eq!(got.dims(), od.as_slice());
                    assert_eq!(got.dtype(), dt);
                    let want = reference(&a, &b, &pre, ta, tb, act);
                    // k products of values in [-1, 1]: scale the tolerance with the inner dim.
                    let tol = tolerance(dt) * (k as f64).sqrt().max(1.0) * 2.0;
                    assert_close(
                        &got.to_f64_vec(),
                        &want,
                        tol,
                        &format!("{dt} {act:?} {ba:?}x{bb:?} {m}x{k}x{n} ta={ta} tb={tb}"),
                    );
                }
            }
        }
    }
}

/// The op equals what it replaces: the matmul's result through the activation's gradient rule.
#[test]
fn equals_the_matmul_then_the_activation_gradient_rule() {
    for (act, u) in [
        (Activation::GeluTanh, UnaryOp::GeluTanh),
        (Activation::GeluErf, UnaryOp::GeluErf),
        (Activation::Relu, UnaryOp::Relu),
    ] {
        let t = |d: &[usize]| TensorType::new(DType::F64, d.to_vec());
        let a = rand_tensor(&t(&[6, 5]), 11, -1.0, 1.0);
        let b = rand_tensor(&t(&[7, 5]), 12, -1.0, 1.0);
        let pre = rand_tensor(&t(&[6, 7]), 13, -3.0, 3.0);
        let mm = Op::Matmul {
            trans_a: false,
            trans_b: true,
        };
        let g = eval_cpu(&mm, &[&a, &b]).unwrap();
        // vjp of act at `pre` with cotangent g: g ⊙ act'(pre).
        let want = vjp_eager(&Op::Unary(u), std::slice::from_ref(&pre), &g).unwrap()[0]
            .clone()
            .unwrap();
        let op = Op::MatmulActGrad {
            trans_a: false,
            trans_b: true,
            act,
        };
        let got = eval_cpu(&op, &[&a, &b, &pre]).unwrap();
        assert_close(
            &got.to_f64_vec(),
            &want.to_f64_vec(),
            1e-12,
            &format!("{act:?}"),
        );
    }
}

#[test]
fn bad_shapes_and_types_are_errors() {
    let f = |d: &[usize]| TensorType::new(DType::F32, d.to_vec());
    let op = |act| Op::MatmulActGrad {
        trans_a: false,
        trans_b: false,
        act,
    };
    let gelu = op(Activation::GeluTanh);
    // The pre-activation must have the product's shape (no broadcasting).
    let e = infer(&gelu, &[&f(&[4, 3]), &f(&[3, 5]), &f(&[1, 5])]).unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    assert!(e.to_string().contains("pre-activation"), "{e}");
    // Inner dims.
    let e = infer(&gelu, &[&f(&[4, 3]), &f(&[2, 5]), &f(&[4, 5])]).unwrap_err();
    assert!(e.to_string().contains("inner dims"), "{e}");
    // Arity.
    assert!(infer(&gelu, &[&f(&[4, 3]), &f(&[3, 5])]).is_err());
    // One dtype.
    let h = TensorType::new(DType::F16, vec![4, 5]);
    assert!(infer(&gelu, &[&f(&[4, 3]), &f(&[3, 5]), &h]).is_err());
    // No derivative of "none".
    let e = infer(
        &op(Activation::None),
        &[&f(&[4, 3]), &f(&[3, 5]), &f(&[4, 5])],
    )
    .unwrap_err();
    assert!(e.to_string().contains("act=none"), "{e}");
    // The CPU kernel reports the same error instead of panicking on a short `pre`.
    let a = rand_tensor(&f(&[4, 3]), 1, -1.0, 1.0);
    let b = rand_tensor(&f(&[3, 5]), 2, -1.0, 1.0);
    let p = rand_tensor(&f(&[5]), 3, -1.0, 1.0);
    assert!(eval_cpu(&gelu, &[&a, &b, &p]).is_err());
}

#[test]
fn its_gradient_is_a_clear_error() {
    let f = |d: &[usize]| TensorType::new(DType::F64, d.to_vec());
    let a = rand_tensor(&f(&[4, 3]), 1, -1.0, 1.0);
    let b = rand_tensor(&f(&[3, 5]), 2, -1.0, 1.0);
    let p = rand_tensor(&f(&[4, 5]), 3, -1.0, 1.0);
    let g = rand_tensor(&f(&[4, 5]), 4, -1.0, 1.0);
    let op = Op::MatmulActGrad {
        trans_a: false,
        trans_b: false,
        act: Activation::GeluTanh,
    };
    let e = vjp_eager(&op, &[a, b, p], &g).unwrap_err();
    assert!(matches!(e, OpError::NotDifferentiable { .. }), "{e}");
    assert!(e.to_string().contains("second derivative"), "{e}");
}

/// ReLU's derivative selects, as its gradient rule `where(x > 0, g, 0)` does: a non-finite
/// product where `pre <= 0` gives 0, where `pre > 0` it passes through.
#[test]
fn relu_selects_like_its_gradient_rule() {
    for dt in [DType::F32, DType::F64, DType::BF16] {
        let a = HostTensor::from_vec(vec![f64::INFINITY, 1.0], [2, 1])
            .unwrap()
            .cast(dt);
        let b = HostTensor::from_vec(vec![1.0, -2.0], [1, 2])
            .unwrap()
            .cast(dt);
        let pre = HostTensor::from_vec(vec![-1.0, 0.5, 0.0, 3.0], [2, 2])
            .unwrap()
            .cast(dt);
        let op = Op::MatmulActGrad {
            trans_a: false,
            trans_b: false,
            act: Activation::Relu,
        };
        let got = eval_cpu(&op, &[&a, &b, &pre]).unwrap().to_f64_vec();
        assert_eq!(got[0], 0.0, "{dt}");
        assert_eq!(got[1], f64::NEG_INFINITY, "{dt}");
        assert_eq!(&got[2..], &[0.0, -2.0], "{dt}");
    }
}
