//! Cross entropy and its gradient against float64 references, with every reduction and
//! `ignore_index`, their errors, and gradchecks of the rule.

use rustytorch_ops::testing::{assert_close, gradcheck, rand_tensor, tolerance, vjp_eager};
use rustytorch_ops::{eval_cpu, infer, DType, HostTensor, Op, OpError, Reduction, TensorType};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
const REDUCTIONS: [Reduction; 3] = [Reduction::Mean, Reduction::Sum, Reduction::None];
const IGNORE: i64 = -100;

fn ty(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, dims.to_vec())
}

fn eval(op: &Op, inputs: &[&HostTensor]) -> HostTensor {
    eval_cpu(op, inputs).unwrap_or_else(|e| panic!("{e}"))
}

/// Targets with rows 1 and 4 ignored.
fn targets(dtype: DType, n: usize, c: usize) -> HostTensor {
    let vals: Vec<f64> = (0..n)
        .map(|r| {
            if r == 1 || r == 4 {
                IGNORE as f64
            } else {
                ((r * 7 + 3) % c) as f64
            }
        })
        .collect();
    HostTensor::from_f64_slice(&ty(dtype, &[n]), &vals).unwrap()
}

/// Per-row float64 losses (0 for ignored rows) and the count of counted rows.
fn ce_ref(x: &[f64], t: &[f64], c: usize) -> (Vec<f64>, usize) {
    let mut count = 0;
    let losses = t
        .iter()
        .enumerate()
        .map(|(r, &ti)| {
            if ti as i64 == IGNORE {
                return 0.0;
            }
            count += 1;
            let row = &x[r * c..(r + 1) * c];
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            lse - row[ti as usize]
        })
        .collect();
    (losses, count)
}

fn reduce_ref(losses: &[f64], count: usize, reduction: Reduction) -> Vec<f64> {
    match reduction {
        Reduction::None => losses.to_vec(),
        Reduction::Sum => vec![losses.iter().sum()],
        Reduction::Mean => vec![losses.iter().sum::<f64>() / count as f64],
    }
}

#[test]
fn cross_entropy_every_reduction_dtype_and_target_type() {
    let (n, c) = (6, 7);
    for dtype in FLOATS {
        let x = rand_tensor(&ty(dtype, &[n, c]), 1, -3.0, 3.0);
        for tt in [DType::I32, DType::I64] {
            let t = targets(tt, n, c);
            let (losses, count) = ce_ref(&x.to_f64_vec(), &t.to_f64_vec(), c);
            assert_eq!(count, 4);
            for reduction in REDUCTIONS {
                let op = Op::CrossEntropy {
                    reduction,
                    ignore_index: IGNORE,
                };
                let y = eval(&op, &[&x, &t]);
                let want = reduce_ref(&losses, count, reduction);
                let dims: &[usize] = if reduction == Reduction::None {
                    &[n]
                } else {
                    &[]
                };
                assert_eq!(y.ty(), ty(dtype, dims));
                assert_close(
                    &y.to_f64_vec(),
                    &want,
                    tolerance(dtype),
                    &format!("{op:?} {dtype} {tt}"),
                );
            }
        }
    }
}

#[test]
fn cross_entropy_all_ignored_mean_is_nan() {
    let x = rand_tensor(&ty(DType::F32, &[2, 3]), 2, -1.0, 1.0);
    let t = HostTensor::from_vec(vec![-100i64, -100], [2]).unwrap();
    let mean = Op::CrossEntropy {
        reduction: Reduction::Mean,
        ignore_index: -100,
    };
    assert!(eval(&mean, &[&x, &t]).to_f64_vec()[0].is_nan());
    let sum = Op::CrossEntropy {
        reduction: Reduction::Sum,
        ignore_index: -100,
    };
    assert_eq!(eval(&sum, &[&x, &t]).to_f64_vec(), vec![0.0]);
}

#[test]
fn cross_entropy_large_logits_stable_and_parallel() {
    let (n, c) = (128, 300);
    let x = rand_tensor(&ty(DType::F32, &[n, c]), 3, 800.0, 1000.0);
    let t =
        HostTensor::from_vec((0..n as i64).map(|r| (r * 13) % c as i64).collect(), [n]).unwrap();
    let (losses, _) = ce_ref(&x.to_f64_vec(), &t.to_f64_vec(), c);
    let op = Op::CrossEntropy {
        reduction: Reduction::None,
        ignore_index: IGNORE,
    };
    // Losses are O(1) differences of O(1000) logits: f32 rounding of the logits dominates.
    assert_close(
        &eval(&op, &[&x, &t]).to_f64_vec(),
        &losses,
        1e-4,
        "ce large",
    );
}

#[test]
fn cross_entropy_grad_matches_reference() {
    let (n, c) = (6, 5);
    for dtype in FLOATS {
        let x = rand_tensor(&ty(dtype, &[n, c]), 4, -3.0, 3.0);
        let xv = x.to_f64_vec();
        let t = targets(DType::I64, n, c);
        let tv = t.to_f64_vec();
        for reduction in REDUCTIONS {
            let gdims: &[usize] = if reduction == Reduction::None {
                &[n]
            } else {
                &[]
            };
            let g = rand_tensor(&ty(dtype, gdims), 5, 0.5, 2.0);
            let gv = g.to_f64_vec();
            let op = Op::CrossEntropyGrad {
                reduction,
                ignore_index: IGNORE,
            };
            let d = eval(&op, &[&x, &t, &g]);
            assert_eq!(d.ty(), x.ty());
            let mut want = vec![0.0; n * c];
            for r in 0..n {
                if tv[r] as i64 == IGNORE {
                    continue;
                }
                let gr = match reduction {
                    Reduction::None => gv[r],
                    Reduction::Sum => gv[0],
                    Reduction::Mean => gv[0] / 4.0,
                };
                let row = &xv[r * c..(r + 1) * c];
                let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
                for k in 0..c {
                    let onehot = if k == tv[r] as usize { 1.0 } else { 0.0 };
                    want[r * c + k] = ((row[k] - m).exp() / s - onehot) * gr;
                }
            }
            assert_close(
                &d.to_f64_vec(),
                &want,
                tolerance(dtype),
                &format!("{op:?} {dtype}"),
            );
        }
    }
}

#[test]
fn errors() {
    let x = rand_tensor(&ty(DType::F32, &[3, 4]), 6, -1.0, 1.0);
    let op = Op::CrossEntropy {
        reduction: Reduction::Mean,
        ignore_index: IGNORE,
    };
    for bad in [4i64, -1] {
        let t = HostTensor::from_vec(vec![0i64, bad, 2], [3]).unwrap();
        let e = eval_cpu(&op, &[&x, &t]).unwrap_err();
        assert!(matches!(e, OpError::Runtime { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("cross_entropy") && msg.contains(&format!("target {bad}")),
            "{msg}"
        );
        let g = HostTensor::scalar(1.0f32);
        let grad = Op::CrossEntropyGrad {
            reduction: Reduction::Mean,
            ignore_index: IGNORE,
        };
        let e = eval_cpu(&grad, &[&x, &t, &g]).unwrap_err();
        assert!(matches!(e, OpError::Runtime { .. }), "{e}");
    }
    // An ignore_index inside the class range is ignored, not an error.
    let op0 = Op::CrossEntropy {
        reduction: Reduction::Sum,
        ignore_index: 0,
    };
    let t = HostTensor::from_vec(vec![0i64, 0, 0], [3]).unwrap();
    assert_eq!(eval(&op0, &[&x, &t]).to_f64_vec(), vec![0.0]);

    let e = infer(&op, &[&ty(DType::F32, &[3, 4]), &ty(DType::F32, &[3])]).unwrap_err();
    assert!(matches!(e, OpError::DType { .. }), "{e}");
    assert!(
        e.to_string().contains("f32[3,4]") && e.to_string().contains("f32[3]"),
        "{e}"
    );
    let e = infer(&op, &[&ty(DType::F32, &[3, 4]), &ty(DType::I64, &[4])]).unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    assert!(
        e.to_string().contains("cross_entropy") && e.to_string().contains("i64[4]"),
        "{e}"
    );
    let e = infer(&op, &[&ty(DType::F32, &[3, 4, 2]), &ty(DType::I64, &[3])]).unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    let grad = Op::CrossEntropyGrad {
        reduction: Reduction::None,
        ignore_index: IGNORE,
    };
    let e = infer(
        &grad,
        &[
            &ty(DType::F32, &[3, 4]),
            &ty(DType::I64, &[3]),
            &ty(DType::F32, &[]),
        ],
    )
    .unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
}

#[test]
fn gradcheck_cross_entropy() {
    let x = rand_tensor(&ty(DType::F64, &[6, 5]), 7, -2.0, 2.0);
    let t = targets(DType::I64, 6, 5);
    for reduction in REDUCTIONS {
        let op = Op::CrossEntropy {
            reduction,
            ignore_index: IGNORE,
        };
        gradcheck(&op, &[x.clone(), t.clone()], &[0], 8).unwrap();
    }
    let t32 = targets(DType::I32, 6, 5);
    let op = Op::CrossEntropy {
        reduction: Reduction::Sum,
        ignore_index: IGNORE,
    };
    gradcheck(&op, &[x.clone(), t32.clone()], &[0], 9).unwrap();
    // Targets get no gradient.
    let g = vjp_eager(&op, &[x.clone(), t32.clone()], &HostTensor::scalar(1.0f64)).unwrap();
    assert!(g[0].is_some() && g[1].is_none());
}

#[test]
fn second_order_is_an_error() {
    let x = rand_tensor(&ty(DType::F64, &[2, 3]), 10, -1.0, 1.0);
    let t = HostTensor::from_vec(vec![1i64, 2], [2]).unwrap();
    let op = Op::CrossEntropyGrad {
        reduction: Reduction::Sum,
        ignore_index: IGNORE,
    };
    let g = HostTensor::scalar(1.0f64);
    let cot = rand_tensor(&ty(DType::F64, &[2, 3]), 11, -1.0, 1.0);
    let e = vjp_eager(&op, &[x, t, g], &cot).unwrap_err();
    assert!(matches!(e, OpError::NotDifferentiable { .. }), "{e}");
}
