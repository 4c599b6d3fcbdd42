//! Reductions against float64 references on seeded random inputs, every dtype, plus empty axes,
//! NaN handling, errors and gradchecks.

use rustytorch_ops::testing::{assert_close, f64_ty, gradcheck, rand_tensor, tolerance};
use rustytorch_ops::{
    eval_cpu, infer, ArgKind, DType, HostTensor, Op, OpError, ReduceKind, Shape, TensorType,
};

fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for k in (0..dims.len()).rev() {
        idx[k] = i % dims[k];
        i /= dims[k];
    }
    idx
}

fn out_dims(dims: &[usize], axes: &[usize], keep: bool) -> Vec<usize> {
    (0..dims.len())
        .filter_map(|i| match (axes.contains(&i), keep) {
            (false, _) => Some(dims[i]),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect()
}

/// Flat output position (of the kept-dims shape) of input element `i`.
fn out_pos(i: usize, dims: &[usize], axes: &[usize]) -> usize {
    let idx = unravel(i, dims);
    let kd = out_dims(dims, axes, true);
    let st = Shape::new(kd).strides();
    (0..dims.len())
        .map(|k| if axes.contains(&k) { 0 } else { idx[k] * st[k] })
        .sum()
}

/// The float64 reference of a reduction (NaN propagating through max/min).
fn reference(x: &[f64], dims: &[usize], axes: &[usize], kind: ReduceKind) -> Vec<f64> {
    let n_out: usize = out_dims(dims, axes, true).iter().product();
    let count: usize = axes.iter().map(|&a| dims[a]).product();
    let init = match kind {
        ReduceKind::Sum | ReduceKind::Mean | ReduceKind::Any => 0.0,
        ReduceKind::Prod | ReduceKind::All => 1.0,
        ReduceKind::Max => f64::NEG_INFINITY,
        ReduceKind::Min => f64::INFINITY,
    };
    let mut acc = vec![init; n_out];
    for (i, &v) in x.iter().enumerate() {
        let a = &mut acc[out_pos(i, dims, axes)];
        *a = match kind {
            ReduceKind::Sum | ReduceKind::Mean => *a + v,
            ReduceKind::Prod => *a * v,
            ReduceKind::Max if a.is_nan() || v.is_nan() => f64::NAN,
            ReduceKind::Min if a.is_nan() || v.is_nan() => f64::NAN,
            ReduceKind::Max => a.max(v),
            ReduceKind::Min => a.min(v),
            ReduceKind::Any => ((*a != 0.0) || (v != 0.0)) as u8 as f64,
            ReduceKind::All => ((*a != 0.0) && (v != 0.0)) as u8 as f64,
        };
    }
    if kind == ReduceKind::Mean {
        acc.iter_mut().for_each(|a| *a /= count as f64);
    }
    acc
}

fn reduce(kind: ReduceKind, axes: &[usize], keep: bool) -> Op {
    Op::Reduce {
        kind,
        axes: axes.to_vec(),
        keep_dims: keep,
    }
}

fn range(dt: DType, kind: ReduceKind) -> (f64, f64) {
    match (dt, kind) {
        // Factors that cannot overflow the dtype.
        (d, ReduceKind::Prod) if d.is_unsigned_int() => (0.0, 2.0),
        (d, _) if d.is_unsigned_int() => (0.0, 50.0),
        (d, ReduceKind::Prod) if d.is_int() => (-1.0, 2.0),
        (d, _) if d.is_int() => (-40.0, 40.0),
        (_, ReduceKind::Prod) => (0.6, 1.4),
        _ => (-2.0, 2.0),
    }
}

fn check_case(dt: DType, kind: ReduceKind, dims: &[usize], axes: &[usize], keep: bool, seed: u64) {
    let (lo, hi) = range(dt, kind);
    let x = rand_tensor(&TensorType::new(dt, dims.to_vec()), seed, lo, hi);
    let op = reduce(kind, axes, keep);
    let y = eval_cpu(&op, &[&x]).unwrap_or_else(|e| panic!("{op:?} {}: {e}", x.ty()));
    assert_eq!(y.dims(), out_dims(dims, axes, keep).as_slice(), "{op:?}");
    assert_eq!(y.dtype(), dt);
    let want = reference(&x.to_f64_vec(), dims, axes, kind);
    // Products of up to 60 factors lose a little more in low precision.
    let tol = match kind {
        ReduceKind::Prod => tolerance(dt) * 4.0,
        _ => tolerance(dt),
    };
    // Integer results wrap to the dtype (accumulated in i64, then truncated).
    let wrap = |f: fn(i64) -> f64| want.iter().map(|&w| f(w as i64)).collect::<Vec<f64>>();
    let want: Vec<f64> = match dt {
        DType::I8 => wrap(|w| w as i8 as f64),
        DType::I16 => wrap(|w| w as i16 as f64),
        DType::I32 => wrap(|w| w as i32 as f64),
        DType::U8 => wrap(|w| w as u8 as f64),
        DType::U16 => wrap(|w| w as u16 as f64),
        DType::U32 => wrap(|w| w as u32 as f64),
        DType::U64 => wrap(|w| w as u64 as f64),
        _ => want,
    };
    assert_close(
        &y.to_f64_vec(),
        &want,
        tol,
        &format!("{op:?} on {}", x.ty()),
    );
}

const CASES: &[(&[usize], &[usize])] = &[
    (&[3, 4, 5], &[1]),
    (&[3, 4, 5], &[0]),
    (&[3, 4, 5], &[2]),
    (&[3, 4, 5], &[0, 2]),
    (&[3, 4, 5], &[1, 2]),
    (&[3, 4, 5], &[0, 1, 2]),
    (&[3, 4, 5], &[]),
    (&[2, 3, 4, 5], &[1, 3]),
    (&[2, 3, 4, 5], &[0, 2, 3]),
    (&[2, 1, 4, 1], &[1, 3]),
    (&[7], &[0]),
    (&[], &[]),
];

#[test]
fn numeric_reductions_every_dtype() {
    let kinds = [
        ReduceKind::Sum,
        ReduceKind::Mean,
        ReduceKind::Max,
        ReduceKind::Min,
        ReduceKind::Prod,
    ];
    let mut seed = 0;
    for dt in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::U16,
        DType::U32,
        DType::U64,
    ] {
        for kind in kinds {
            if kind == ReduceKind::Mean && !dt.is_float() {
                continue;
            }
            for &(dims, axes) in CASES {
                for keep in [false, true] {
                    seed += 1;
                    check_case(dt, kind, dims, axes, keep, seed);
                }
            }
        }
    }
}

#[test]
fn bool_reductions() {
    for kind in [ReduceKind::Any, ReduceKind::All] {
        for &(dims, axes) in CASES {
            for keep in [false, true] {
                check_case(DType::Bool, kind, dims, axes, keep, 9);
            }
        }
    }
    // All-true rows and all-false rows.
    let x = HostTensor::from_vec(vec![true, true, false, false], [2, 2]).unwrap();
    let y = eval_cpu(&reduce(ReduceKind::All, &[1], false), &[&x]).unwrap();
    assert_eq!(y.to_vec::<bool>().unwrap(), vec![true, false]);
    let y = eval_cpu(&reduce(ReduceKind::Any, &[1], false), &[&x]).unwrap();
    assert_eq!(y.to_vec::<bool>().unwrap(), vec![true, false]);
}

#[test]
fn large_reductions_take_the_parallel_paths() {
    for dt in [DType::F32, DType::BF16, DType::I64] {
        for (dims, axes) in [
            (vec![300, 400], vec![1]),
            (vec![300, 400], vec![0]),
            (vec![20, 30, 100], vec![0, 2]),
            (vec![70_000], vec![0]),
        ] {
            for kind in [ReduceKind::Sum, ReduceKind::Max] {
                check_case(dt, kind, &dims, &axes, false, 77);
            }
        }
    }
}

#[test]
fn large_argmax_takes_the_parallel_paths() {
    let dims = [300, 400];
    let x = rand_tensor(&TensorType::new(DType::F32, dims), 8, -2.0, 2.0);
    for axis in [0, 1] {
        for (kind, max) in [(ArgKind::ArgMax, true), (ArgKind::ArgMin, false)] {
            let op = Op::ArgReduce {
                kind,
                axis,
                keep_dims: true,
            };
            let y = eval_cpu(&op, &[&x]).unwrap();
            let want = arg_reference(&x.to_f64_vec(), &dims, axis, max);
            assert_eq!(y.to_f64_vec(), want, "{op:?}");
        }
    }
}

#[test]
fn f32_sum_of_a_million_is_accurate() {
    let n = 1_000_000;
    let x = rand_tensor(&TensorType::new(DType::F32, [n]), 5, 0.0, 1.0);
    let want: f64 = x.to_f64_vec().iter().sum();
    let got = eval_cpu(&reduce(ReduceKind::Sum, &[0], false), &[&x]).unwrap();
    let got = got.to_f64_vec()[0];
    assert!(
        ((got - want) / want).abs() < 1e-6,
        "sum of 1e6: got {got}, want {want}"
    );
    // The strided path: a million rows of one column block.
    let x = rand_tensor(&TensorType::new(DType::F32, [250_000, 4]), 6, 0.0, 1.0);
    let xv = x.to_f64_vec();
    let got = eval_cpu(&reduce(ReduceKind::Sum, &[0], false), &[&x])
        .unwrap()
        .to_f64_vec();
    for c in 0..4 {
        let want: f64 = (0..250_000).map(|r| xv[r * 4 + c]).sum();
        assert!(
            ((got[c] - want) / want).abs() < 1e-6,
            "column {c}: {} vs {want}",
            got[c]
        );
    }
    // f16 inputs accumulate in f32 (a naive f16 sum would stall at 2048).
    let x = rand_tensor(&TensorType::new(DType::F16, [100_000]), 7, 0.0, 1.0);
    let want: f64 = x.to_f64_vec().iter().sum();
    let got = eval_cpu(&reduce(ReduceKind::Mean, &[0], false), &[&x]).unwrap();
    assert!((got.to_f64_vec()[0] - want / 1e5).abs() < 1e-3);
}

#[test]
fn empty_axes() {
    let x = rand_tensor(&TensorType::new(DType::F32, [3, 0, 4]), 1, -1.0, 1.0);
    let sum = eval_cpu(&reduce(ReduceKind::Sum, &[1], false), &[&x]).unwrap();
    assert_eq!(sum.dims(), &[3, 4]);
    assert!(sum.to_f64_vec().iter().all(|&v| v == 0.0));
    let prod = eval_cpu(&reduce(ReduceKind::Prod, &[1], true), &[&x]).unwrap();
    assert_eq!(prod.dims(), &[3, 1, 4]);
    assert!(prod.to_f64_vec().iter().all(|&v| v == 1.0));
    let mean = eval_cpu(&reduce(ReduceKind::Mean, &[0, 1], false), &[&x]).unwrap();
    assert!(mean.to_f64_vec().iter().all(|v| v.is_nan()));
    let any = HostTensor::from_vec(Vec::<bool>::new(), [2, 0]).unwrap();
    let y = eval_cpu(&reduce(ReduceKind::All, &[1], false), &[&any]).unwrap();
    assert_eq!(y.to_vec::<bool>().unwrap(), vec![true, true]);
    // Max and min of nothing are their identities: ∓∞, the dtype's bounds for integers.
    for (kind, want) in [
        (ReduceKind::Max, f64::NEG_INFINITY),
        (ReduceKind::Min, f64::INFINITY),
    ] {
        let y = eval_cpu(&reduce(kind, &[1], true), &[&x]).unwrap();
        assert_eq!(y.dims(), &[3, 1, 4]);
        assert!(y.to_f64_vec().iter().all(|&v| v == want), "{kind:?}");
    }
    let xi = HostTensor::from_vec(Vec::<i32>::new(), [2, 0]).unwrap();
    let y = eval_cpu(&reduce(ReduceKind::Max, &[1], false), &[&xi]).unwrap();
    assert_eq!(y.to_vec::<i32>().unwrap(), vec![i32::MIN; 2]);
    let xu = HostTensor::from_vec(Vec::<u8>::new(), [0, 3]).unwrap();
    let y = eval_cpu(&reduce(ReduceKind::Min, &[0], false), &[&xu]).unwrap();
    assert_eq!(y.to_vec::<u8>().unwrap(), vec![255; 3]);
    let e = eval_cpu(
        &Op::ArgReduce {
            kind: ArgKind::ArgMax,
            axis: 1,
            keep_dims: false,
        },
        &[&x],
    )
    .unwrap_err();
    assert!(matches!(e, OpError::Runtime { .. }), "{e}");
    // Reducing a non-empty axis of an empty tensor gives an empty result.
    let y = eval_cpu(&reduce(ReduceKind::Max, &[0], false), &[&x]).unwrap();
    assert_eq!(y.dims(), &[0, 4]);
}

fn arg_reference(x: &[f64], dims: &[usize], axis: usize, max: bool) -> Vec<f64> {
    let outer: usize = dims[..axis].iter().product();
    let red = dims[axis];
    let inner: usize = dims[axis + 1..].iter().product();
    let mut out = Vec::new();
    for o in 0..outer {
        for i in 0..inner {
            let at = |r: usize| x[(o * red + r) * inner + i];
            let mut best = 0;
            for r in 1..red {
                let (v, b) = (at(r), at(best));
                let better = !b.is_nan() && (v.is_nan() || if max { v > b } else { v < b });
                if better {
                    best = r;
                }
            }
            out.push(best as f64);
        }
    }
    out
}

#[test]
fn argmax_argmin_every_dtype() {
    for dt in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::U16,
        DType::U32,
        DType::U64,
    ] {
        // A small integer range makes ties, which must resolve to the first index.
        let (lo, hi) = if dt.is_float() {
            (-2.0, 2.0)
        } else {
            (0.0, 3.0)
        };
        let dims = [3, 5, 4];
        let x = rand_tensor(&TensorType::new(dt, dims), 3, lo, hi);
        for axis in 0..3 {
            for (kind, max) in [(ArgKind::ArgMax, true), (ArgKind::ArgMin, false)] {
                for keep in [false, true] {
                    let op = Op::ArgReduce {
                        kind,
                        axis,
                        keep_dims: keep,
                    };
                    let y = eval_cpu(&op, &[&x]).unwrap();
                    assert_eq!(y.dtype(), DType::I64);
                    assert_eq!(y.dims(), out_dims(&dims, &[axis], keep).as_slice());
                    let want = arg_reference(&x.to_f64_vec(), &dims, axis, max);
                    assert_eq!(y.to_f64_vec(), want, "{op:?} on {}", x.ty());
                }
            }
        }
    }
}

#[test]
fn nan_propagates() {
    let mut v: Vec<f32> = (0..12).map(|i| (i as f32 * 0.37).sin()).collect();
    v[5] = f32::NAN;
    v[7] = f32::NAN;
    let x = HostTensor::from_vec(v.clone(), [3, 4]).unwrap();
    let xv = x.to_f64_vec();
    for kind in [ReduceKind::Max, ReduceKind::Min, ReduceKind::Sum] {
        for axes in [vec![0], vec![1], vec![0, 1]] {
            let y = eval_cpu(&reduce(kind, &axes, false), &[&x]).unwrap();
            let want = reference(&xv, &[3, 4], &axes, kind);
            assert_close(&y.to_f64_vec(), &want, 1e-6, &format!("{kind:?} {axes:?}"));
        }
    }
    for axis in [0, 1] {
        for (kind, max) in [(ArgKind::ArgMax, true), (ArgKind::ArgMin, false)] {
            let op = Op::ArgReduce {
                kind,
                axis,
                keep_dims: false,
            };
            let y = eval_cpu(&op, &[&x]).unwrap();
            assert_eq!(y.to_f64_vec(), arg_reference(&xv, &[3, 4], axis, max));
        }
    }
    // Row 1 holds NaNs at columns 1 and 3: argmax is the first NaN.
    let y = eval_cpu(
        &Op::ArgReduce {
            kind: ArgKind::ArgMax,
            axis: 1,
            keep_dims: false,
        },
        &[&x],
    )
    .unwrap();
    assert_eq!(y.to_vec::<i64>().unwrap()[1], 1);
}

#[test]
fn non_contiguous_inputs() {
    // A permuted and a stepped-slice input (the way views reach a reduction here).
    let x = rand_tensor(&TensorType::new(DType::F32, [4, 5, 6]), 12, -1.0, 1.0);
    let p = eval_cpu(
        &Op::Permute {
            perm: vec![2, 0, 1],
        },
        &[&x],
    )
    .unwrap();
    let s = eval_cpu(
        &Op::Slice {
            starts: vec![1, 0, 1],
            ends: vec![4, 5, 6],
            steps: vec![2, 2, 2],
        },
        &[&x],
    )
    .unwrap();
    for t in [&p, &s] {
        for axes in [vec![0], vec![0, 2], vec![1]] {
            let y = eval_cpu(&reduce(ReduceKind::Sum, &axes, false), &[t]).unwrap();
            let want = reference(&t.to_f64_vec(), t.dims(), &axes, ReduceKind::Sum);
            assert_close(&y.to_f64_vec(), &want, 1e-5, "sum of a view");
        }
    }
}

fn err(op: &Op, ty: TensorType) -> OpError {
    infer(op, &[&ty]).unwrap_err()
}

#[test]
fn errors_name_op_shapes_and_dtypes() {
    let f = TensorType::new(DType::F32, [2, 3]);
    for axes in [vec![1, 0], vec![2], vec![1, 1]] {
        let e = err(&reduce(ReduceKind::Sum, &axes, false), f.clone());
        assert!(matches!(e, OpError::Attribute { .. }), "{e}");
        assert!(e.to_string().contains("reduce_sum"), "{e}");
    }
    let e = err(
        &reduce(ReduceKind::Mean, &[0], false),
        TensorType::new(DType::I32, [2, 3]),
    );
    assert!(matches!(e, OpError::DType { .. }), "{e}");
    assert!(
        e.to_string().contains("reduce_mean") && e.to_string().contains("i32[2,3]"),
        "{e}"
    );
    let e = err(&reduce(ReduceKind::Any, &[0], false), f.clone());
    assert!(
        e.to_string().contains("reduce_any") && e.to_string().contains("f32[2,3]"),
        "{e}"
    );
    let e = err(
        &reduce(ReduceKind::Sum, &[0], false),
        TensorType::new(DType::Bool, [2]),
    );
    assert!(e.to_string().contains("bool[2]"), "{e}");
    let arg = |axis| Op::ArgReduce {
        kind: ArgKind::ArgMax,
        axis,
        keep_dims: false,
    };
    assert!(matches!(err(&arg(2), f.clone()), OpError::Attribute { .. }));
    assert!(matches!(
        err(&arg(0), TensorType::new(DType::Bool, [2])),
        OpError::DType { .. }
    ));
    assert!(infer(&reduce(ReduceKind::Sum, &[0], false), &[&f, &f]).is_err());
}

#[test]
fn gradchecks() {
    let dims = [3, 4, 5];
    let x = rand_tensor(&f64_ty(&dims), 21, -1.0, 1.0);
    for kind in [
        ReduceKind::Sum,
        ReduceKind::Mean,
        ReduceKind::Max,
        ReduceKind::Min,
        ReduceKind::Prod,
    ] {
        for axes in [vec![1], vec![0, 2], vec![0, 1, 2], vec![]] {
            for keep in [false, true] {
                let op = reduce(kind, &axes, keep);
                gradcheck(&op, std::slice::from_ref(&x), &[0], 22)
                    .unwrap_or_else(|e| panic!("{op:?}: {e}"));
            }
        }
    }
    // Products with one and with two zeros in a group.
    let mut v = rand_tensor(&f64_ty(&[3, 4]), 23, 0.5, 1.5).to_f64_vec();
    v[1] = 0.0;
    v[8] = 0.0;
    v[10] = 0.0;
    let x = HostTensor::from_vec(v, [3, 4]).unwrap();
    for axes in [vec![0], vec![1], vec![0, 1]] {
        gradcheck(
            &reduce(ReduceKind::Prod, &axes, false),
            std::slice::from_ref(&x),
            &[0],
            24,
        )
        .unwrap_or_else(|e| panic!("prod {axes:?} with zeros: {e}"));
    }
}

#[test]
fn no_gradient_for_indices_and_bools() {
    use rustytorch_ops::testing::vjp_eager;
    let x = rand_tensor(&f64_ty(&[3, 4]), 1, -1.0, 1.0);
    let op = Op::ArgReduce {
        kind: ArgKind::ArgMax,
        axis: 1,
        keep_dims: false,
    };
    let cot = HostTensor::zeros(&TensorType::new(DType::I64, [3]));
    assert_eq!(vjp_eager(&op, &[x], &cot).unwrap(), vec![None]);
    let b = HostTensor::from_vec(vec![true, false], [2]).unwrap();
    let cot = HostTensor::from_vec(vec![true], Shape::scalar()).unwrap();
    let g = vjp_eager(&reduce(ReduceKind::Any, &[0], false), &[b], &cot).unwrap();
    assert_eq!(g, vec![None]);
}

#[test]
fn u64_reductions_over_the_whole_range() {
    // Values above 2^63 compare and add as unsigned (max/min exact, sums wrap modulo 2^64).
    let v = vec![u64::MAX, 1 << 63, 5, (1 << 63) - 1, u64::MAX - 2, 7];
    let x = HostTensor::from_vec(v.clone(), [2, 3]).unwrap();
    let run = |kind| {
        eval_cpu(&reduce(kind, &[1], false), &[&x])
            .unwrap()
            .to_vec::<u64>()
            .unwrap()
    };
    assert_eq!(run(ReduceKind::Max), vec![u64::MAX, u64::MAX - 2]);
    assert_eq!(run(ReduceKind::Min), vec![5, 7]);
    let sum = |r: &[u64]| r.iter().fold(0u64, |a, &b| a.wrapping_add(b));
    assert_eq!(run(ReduceKind::Sum), vec![sum(&v[..3]), sum(&v[3..])]);
    let arg = Op::ArgReduce {
        kind: ArgKind::ArgMax,
        axis: 1,
        keep_dims: false,
    };
    let a = eval_cpu(&arg, &[&x]).unwrap().to_vec::<i64>().unwrap();
    assert_eq!(a, vec![0, 1]);
}
