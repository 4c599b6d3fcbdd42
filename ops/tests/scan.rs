//! Cumulative sums and top-k against float64 references on seeded random inputs, every dtype and
//! flag, plus ties, NaN, errors and the gradient of cumsum (and of top-k's gathered values).

use rustytorch_ops::testing::{assert_close, f64_ty, gradcheck, rand_tensor, tolerance};
use rustytorch_ops::{eval_cpu, infer, DType, HostTensor, Op, TensorType};

/// The reference cumulative sum of `x` (dims `dims`) along `axis`, in f64.
fn cumsum_ref(x: &[f64], dims: &[usize], axis: usize, exclusive: bool, reverse: bool) -> Vec<f64> {
    let outer: usize = dims[..axis].iter().product();
    let n = dims[axis];
    let inner: usize = dims[axis + 1..].iter().product();
    let mut out = vec![0.0; x.len()];
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| (o * n + j) * inner + i;
            for j in 0..n {
                let range: Vec<usize> = if reverse {
                    (j + exclusive as usize..n).collect()
                } else {
                    (0..j + 1 - exclusive as usize).collect()
                };
                out[at(j)] = range.iter().map(|&m| x[at(m)]).sum();
            }
        }
    }
    out
}

#[test]
fn cumsum_matches_f64_every_dtype_and_flag() {
    let dims = [3, 5, 4];
    for dtype in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
    ] {
        let (lo, hi) = if dtype == DType::U8 {
            (0.0, 9.0)
        } else {
            (-4.0, 4.0)
        };
        let x = rand_tensor(&TensorType::new(dtype, dims), 3, lo, hi);
        for axis in 0..3 {
            for (exclusive, reverse) in [(false, false), (true, false), (false, true), (true, true)]
            {
                let op = Op::CumSum {
                    axis,
                    exclusive,
                    reverse,
                };
                let y = eval_cpu(&op, &[&x]).unwrap();
                assert_eq!(y.ty(), x.ty());
                let want = cumsum_ref(&x.to_f64_vec(), &dims, axis, exclusive, reverse);
                // Rounded once at the end: a float dtype's tolerance scaled by the sums' size.
                let tol = tolerance(dtype) * 8.0;
                assert_close(&y.to_f64_vec(), &want, tol, &format!("{op} {dtype}"));
            }
        }
    }
}

#[test]
fn cumsum_gradient() {
    for (exclusive, reverse) in [(false, false), (true, false), (false, true), (true, true)] {
        let x = rand_tensor(&f64_ty(&[3, 4, 2]), 11, -1.0, 1.0);
        let op = Op::CumSum {
            axis: 1,
            exclusive,
            reverse,
        };
        gradcheck(&op, &[x], &[0], 12).unwrap_or_else(|e| panic!("{op}: {e}"));
    }
}

/// Reference top-k indices along the last axis of `[rows, n]`.
fn topk_ref(x: &[f64], n: usize, k: usize, largest: bool) -> Vec<i64> {
    let mut out = Vec::new();
    for row in x.chunks(n) {
        let mut idx: Vec<usize> = (0..n).collect();
        idx.sort_by(|&a, &b| {
            let (p, q) = (row[a], row[b]);
            let ord = match (p.is_nan(), q.is_nan()) {
                (true, true) => std::cmp::Ordering::Equal,
                (true, false) => std::cmp::Ordering::Greater,
                (false, true) => std::cmp::Ordering::Less,
                _ => p.partial_cmp(&q).unwrap(),
            };
            (if largest { ord.reverse() } else { ord }).then(a.cmp(&b))
        });
        out.extend(idx[..k].iter().map(|&i| i as i64));
    }
    out
}

#[test]
fn topk_matches_a_sort_every_dtype() {
    for dtype in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
    ] {
        // Integers drawn from a small range give ties, broken by index.
        let x = rand_tensor(&TensorType::new(dtype, [4, 7]), 5, 0.0, 6.0);
        for (k, largest) in [(1, true), (3, true), (7, false), (0, false)] {
            let op = Op::TopK {
                axis: 1,
                k,
                largest,
            };
            let y = eval_cpu(&op, &[&x]).unwrap();
            assert_eq!(y.dims(), &[4, k]);
            let want = topk_ref(&x.to_f64_vec(), 7, k, largest);
            assert_eq!(y.to_vec::<i64>().unwrap(), want, "{op} {dtype}");
        }
    }
    // Along a middle axis, and NaN above every number.
    let x = HostTensor::from_vec(vec![1.0f32, f32::NAN, 3.0, -1.0, 2.0, 2.0], [1, 3, 2]).unwrap();
    let op = Op::TopK {
        axis: 1,
        k: 2,
        largest: true,
    };
    let y = eval_cpu(&op, &[&x]).unwrap();
    // Columns: [1, 3, 2] → 1 (3.0), 2 (2.0); [NaN, -1, 2] → 0 (NaN), 2 (2.0).
    assert_eq!(y.to_vec::<i64>().unwrap(), vec![1, 0, 2, 2]);
}

#[test]
fn topk_values_gradient_through_gather() {
    // The values are gather(x, topk(x)); away from ties the gradient is that of the gather.
    let x = rand_tensor(&f64_ty(&[3, 6]), 21, -1.0, 1.0);
    let op = Op::TopK {
        axis: 1,
        k: 2,
        largest: true,
    };
    let idx = eval_cpu(&op, &[&x]).unwrap();
    gradcheck(&Op::Gather { axis: 1 }, &[x, idx], &[0], 22).unwrap();
}

#[test]
fn errors_name_the_op() {
    let x = TensorType::new(DType::F32, [2, 3]);
    let e = infer(
        &Op::TopK {
            axis: 1,
            k: 4,
            largest: true,
        },
        &[&x],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("topk") && e.contains("k 4"), "{e}");
    let e = infer(
        &Op::CumSum {
            axis: 2,
            exclusive: false,
            reverse: false,
        },
        &[&x],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("cumsum") && e.contains("axis 2"), "{e}");
    let b = TensorType::new(DType::Bool, [2]);
    let e = infer(
        &Op::CumSum {
            axis: 0,
            exclusive: false,
            reverse: false,
        },
        &[&b],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("numeric"), "{e}");
}
