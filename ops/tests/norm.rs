//! Softmax, log-softmax, LayerNorm and RMSNorm against float64 references, their errors, and
//! gradchecks of their rules.

use rustytorch_ops::testing::{assert_close, gradcheck, rand_tensor, tolerance};
use rustytorch_ops::{eval_cpu, infer, DType, HostTensor, Op, OpError, TensorType};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

fn ty(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, dims.to_vec())
}

/// Index of element (o, j, k) of a tensor viewed as [outer, n, inner].
fn at(o: usize, j: usize, k: usize, n: usize, inner: usize) -> usize {
    (o * n + j) * inner + k
}

/// Plain float64 softmax / log-softmax along `axis`.
fn softmax_ref(x: &[f64], dims: &[usize], axis: usize, log: bool) -> Vec<f64> {
    let outer: usize = dims[..axis].iter().product();
    let n = dims[axis];
    let inner: usize = dims[axis + 1..].iter().product();
    let mut y = vec![0.0; x.len()];
    for o in 0..outer {
        for k in 0..inner {
            let m = (0..n)
                .map(|j| x[at(o, j, k, n, inner)])
                .fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = (0..n).map(|j| (x[at(o, j, k, n, inner)] - m).exp()).sum();
            for j in 0..n {
                let v = x[at(o, j, k, n, inner)];
                y[at(o, j, k, n, inner)] = if log {
                    v - m - s.ln()
                } else {
                    (v - m).exp() / s
                };
            }
        }
    }
    y
}

/// Plain float64 LayerNorm (`centered`) or RMSNorm over the last dim.
fn norm_ref(
    x: &[f64],
    d: usize,
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    eps: f64,
    centered: bool,
) -> Vec<f64> {
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks(d) {
        let mean = if centered {
            row.iter().sum::<f64>() / d as f64
        } else {
            0.0
        };
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
        for (k, v) in row.iter().enumerate() {
            let mut r = (v - mean) / (var + eps).sqrt();
            if let Some(w) = w {
                r *= w[k];
            }
            if let Some(b) = b {
                r += b[k];
            }
            y.push(r);
        }
    }
    y
}

fn eval(op: &Op, inputs: &[&HostTensor]) -> HostTensor {
    eval_cpu(op, inputs).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn softmax_and_log_softmax_every_axis_and_dtype() {
    let dims = [3, 5, 4];
    for dtype in FLOATS {
        for axis in 0..3 {
            let x = rand_tensor(&ty(dtype, &dims), 11 + axis as u64, -4.0, 4.0);
            let xv = x.to_f64_vec();
            for log in [false, true] {
                let op = if log {
                    Op::LogSoftmax { axis }
                } else {
                    Op::Softmax { axis }
                };
                let y = eval(&op, &[&x]);
                assert_eq!(y.ty(), x.ty());
                let want = softmax_ref(&xv, &dims, axis, log);
                assert_close(
                    &y.to_f64_vec(),
                    &want,
                    tolerance(dtype),
                    &format!("{op:?} {dtype}"),
                );
            }
        }
    }
}

#[test]
fn softmax_large_rows_parallel_and_stable() {
    // Large enough to take the parallel path; big logits check the max subtraction.
    let dims = [64, 700];
    let x = rand_tensor(&ty(DType::F32, &dims), 5, 500.0, 900.0);
    let want = softmax_ref(&x.to_f64_vec(), &dims, 1, false);
    let y = eval(&Op::Softmax { axis: 1 }, &[&x]);
    assert_close(&y.to_f64_vec(), &want, 1e-5, "softmax large");
    let want = softmax_ref(&x.to_f64_vec(), &dims, 1, true);
    let y = eval(&Op::LogSoftmax { axis: 1 }, &[&x]);
    assert_close(&y.to_f64_vec(), &want, 1e-5, "log_softmax large");
}

fn affine(dtype: DType, d: usize, seed: u64) -> HostTensor {
    rand_tensor(&ty(dtype, &[d]), seed, 0.5, 1.5)
}

#[test]
fn layer_norm_with_and_without_affine() {
    let dims = [4, 3, 8];
    let eps = 1e-5;
    for dtype in FLOATS {
        let x = rand_tensor(&ty(dtype, &dims), 21, -3.0, 3.0);
        let w = affine(dtype, 8, 22);
        let b = rand_tensor(&ty(dtype, &[8]), 23, -1.0, 1.0);
        for (weight, bias) in [(false, false), (true, false), (false, true), (true, true)] {
            let op = Op::LayerNorm {
                eps: eps.into(),
                weight,
                bias,
            };
            let mut ins = vec![&x];
            if weight {
                ins.push(&w);
            }
            if bias {
                ins.push(&b);
            }
            let y = eval(&op, &ins);
            let (wv, bv) = (w.to_f64_vec(), b.to_f64_vec());
            let want = norm_ref(
                &x.to_f64_vec(),
                8,
                weight.then_some(&wv[..]),
                bias.then_some(&bv[..]),
                eps,
                true,
            );
            assert_close(
                &y.to_f64_vec(),
                &want,
                tolerance(dtype),
                &format!("{op:?} {dtype}"),
            );
        }
    }
}

#[test]
fn rms_norm_with_and_without_weight() {
    let dims = [5, 16];
    let eps = 1e-6;
    for dtype in FLOATS {
        let x = rand_tensor(&ty(dtype, &dims), 31, -2.0, 2.0);
        let w = affine(dtype, 16, 32);
        for weight in [false, true] {
            let op = Op::RmsNorm {
                eps: eps.into(),
                weight,
            };
            let ins: Vec<&HostTensor> = if weight { vec![&x, &w] } else { vec![&x] };
            let y = eval(&op, &ins);
            let wv = w.to_f64_vec();
            let want = norm_ref(
                &x.to_f64_vec(),
                16,
                weight.then_some(&wv[..]),
                None,
                eps,
                false,
            );
            assert_close(
                &y.to_f64_vec(),
                &want,
                tolerance(dtype),
                &format!("{op:?} {dtype}"),
            );
        }
    }
}

#[test]
fn layer_norm_large_parallel() {
    let dims = [256, 384];
    let x = rand_tensor(&ty(DType::F32, &dims), 41, -3.0, 3.0);
    let op = Op::LayerNorm {
        eps: 1e-5.into(),
        weight: false,
        bias: false,
    };
    let y = eval(&op, &[&x]);
    let want = norm_ref(&x.to_f64_vec(), 384, None, None, 1e-5, true);
    assert_close(&y.to_f64_vec(), &want, 1e-5, "layer_norm large");
}

#[test]
fn errors_name_op_shapes_and_dtypes() {
    let xi = ty(DType::I32, &[2, 3]);
    let e = infer(&Op::Softmax { axis: 1 }, &[&xi]).unwrap_err();
    assert!(matches!(e, OpError::DType { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("softmax") && msg.contains("i32[2,3]"), "{msg}");

    let x = ty(DType::F32, &[2, 3]);
    let e = infer(&Op::LogSoftmax { axis: 2 }, &[&x]).unwrap_err();
    assert!(matches!(e, OpError::Attribute { .. }), "{e}");
    assert!(e.to_string().contains("log_softmax"), "{e}");

    let w = ty(DType::F32, &[4]);
    let op = Op::LayerNorm {
        eps: 1e-5.into(),
        weight: true,
        bias: false,
    };
    let e = infer(&op, &[&x, &w]).unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("layer_norm") && msg.contains("f32[2,3]") && msg.contains("f32[4]"),
        "{msg}"
    );

    let e = infer(&op, &[&x]).unwrap_err();
    assert!(matches!(e, OpError::Arity { .. }), "{e}");

    let wh = ty(DType::F16, &[3]);
    let op = Op::RmsNorm {
        eps: 1e-5.into(),
        weight: true,
    };
    let e = infer(&op, &[&x, &wh]).unwrap_err();
    assert!(matches!(e, OpError::DType { .. }), "{e}");
    assert!(e.to_string().contains("f16[3]"), "{e}");
}

#[test]
fn gradcheck_softmax_and_log_softmax() {
    let x = rand_tensor(&ty(DType::F64, &[2, 4, 3]), 51, -2.0, 2.0);
    for axis in [1, 2] {
        gradcheck(&Op::Softmax { axis }, std::slice::from_ref(&x), &[0], 52).unwrap();
        gradcheck(&Op::LogSoftmax { axis }, std::slice::from_ref(&x), &[0], 53).unwrap();
    }
}

#[test]
fn gradcheck_layer_norm() {
    let x = rand_tensor(&ty(DType::F64, &[3, 2, 5]), 61, -2.0, 2.0);
    let w = affine(DType::F64, 5, 62);
    let b = rand_tensor(&ty(DType::F64, &[5]), 63, -1.0, 1.0);
    for (weight, bias) in [(false, false), (true, false), (false, true), (true, true)] {
        let op = Op::LayerNorm {
            eps: 1e-5.into(),
            weight,
            bias,
        };
        let mut ins = vec![x.clone()];
        if weight {
            ins.push(w.clone());
        }
        if bias {
            ins.push(b.clone());
        }
        let check: Vec<usize> = (0..ins.len()).collect();
        gradcheck(&op, &ins, &check, 64).unwrap();
    }
}

#[test]
fn gradcheck_rms_norm() {
    let x = rand_tensor(&ty(DType::F64, &[4, 6]), 71, -2.0, 2.0);
    let w = affine(DType::F64, 6, 72);
    for weight in [false, true] {
        let op = Op::RmsNorm {
            eps: 1e-6.into(),
            weight,
        };
        let ins = if weight {
            vec![x.clone(), w.clone()]
        } else {
            vec![x.clone()]
        };
        let check: Vec<usize> = (0..ins.len()).collect();
        gradcheck(&op, &ins, &check, 73).unwrap();
    }
}
