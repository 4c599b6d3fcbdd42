//! Movement ops against index-by-index references, every dtype, plus errors and gradchecks.

use rustytorch_ops::testing::{f64_ty, gradcheck, rand_tensor};
use rustytorch_ops::{eval_cpu, DType, HostTensor, Op, Shape, TensorType};

fn strides(d: &[usize]) -> Vec<usize> {
    Shape::new(d).strides()
}

/// Multi-index of flat position `i` in `dims`.
fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for k in (0..dims.len()).rev() {
        idx[k] = i % dims[k];
        i /= dims[k];
    }
    idx
}

/// `out[idx] = x[src(idx)]`, or `fill` where `src` gives `None`.
fn reference(
    x: &HostTensor,
    out_dims: &[usize],
    fill: f64,
    src: impl Fn(&[usize]) -> Option<Vec<usize>>,
) -> Vec<f64> {
    let xv = x.to_f64_vec();
    let st = strides(x.dims());
    let n: usize = out_dims.iter().product();
    (0..n)
        .map(|i| match src(&unravel(i, out_dims)) {
            Some(j) => xv[j.iter().zip(&st).map(|(a, b)| a * b).sum::<usize>()],
            None => fill,
        })
        .collect()
}

fn rand(dtype: DType, dims: &[usize], seed: u64) -> HostTensor {
    let (lo, hi) = if dtype.is_unsigned_int() {
        (1.0, 120.0)
    } else {
        (-50.0, 50.0)
    };
    rand_tensor(&TensorType::new(dtype, dims.to_vec()), seed, lo, hi)
}

fn check(op: &Op, x: &HostTensor, out_dims: &[usize], want: &[f64]) {
    let y = eval_cpu(op, &[x]).unwrap_or_else(|e| panic!("{op:?} on {}: {e}", x.ty()));
    assert_eq!(y.dims(), out_dims, "{op:?}");
    assert_eq!(y.dtype(), x.dtype());
    assert_eq!(y.to_f64_vec(), want, "{op:?} on {}", x.ty());
}

#[test]
fn reshape_every_dtype() {
    for (s, dt) in DType::ALL.into_iter().enumerate() {
        let x = rand(dt, &[2, 3, 4], s as u64);
        let op = Op::Reshape {
            shape: Shape::new([4, 6]),
        };
        check(&op, &x, &[4, 6], &x.to_f64_vec());
    }
}

fn permute_case(dims: &[usize], perm: &[usize], dt: DType, seed: u64) {
    let x = rand(dt, dims, seed);
    let od: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    let want = reference(&x, &od, 0.0, |o| {
        let mut j = vec![0; dims.len()];
        for (i, &p) in perm.iter().enumerate() {
            j[p] = o[i];
        }
        Some(j)
    });
    check(
        &Op::Permute {
            perm: perm.to_vec(),
        },
        &x,
        &od,
        &want,
    );
}

#[test]
fn permute_every_dtype_and_layout() {
    for (s, dt) in DType::ALL.into_iter().enumerate() {
        let s = s as u64;
        permute_case(&[2, 3, 4], &[2, 0, 1], dt, s);
        permute_case(&[33, 65], &[1, 0], dt, s + 10);
        permute_case(&[3, 40, 50], &[0, 2, 1], dt, s + 20);
        permute_case(&[2, 3, 4, 5], &[3, 1, 0, 2], dt, s + 30);
        permute_case(&[5, 1, 7], &[1, 2, 0], dt, s + 40);
        permute_case(&[9, 3, 10], &[2, 1, 0], dt, s + 60);
        permute_case(&[2, 9, 4, 3, 11], &[3, 4, 1, 0, 2], dt, s + 70);
        permute_case(&[], &[], dt, s + 50);
    }
    // Large enough for the parallel paths (tiled and row-wise).
    permute_case(&[257, 300], &[1, 0], DType::F32, 7);
    permute_case(&[4, 129, 100], &[2, 0, 1], DType::F64, 8);
    permute_case(&[3, 70, 2, 90], &[0, 3, 2, 1], DType::BF16, 9);
    permute_case(&[40, 5, 300], &[2, 1, 0], DType::I32, 10);
}

#[test]
fn expand_every_dtype() {
    for (s, dt) in DType::ALL.into_iter().enumerate() {
        let x = rand(dt, &[3, 1], s as u64);
        let want = reference(&x, &[2, 3, 4], 0.0, |o| Some(vec![o[1], 0]));
        check(
            &Op::Expand {
                shape: Shape::new([2, 3, 4]),
            },
            &x,
            &[2, 3, 4],
            &want,
        );
        let x = rand(dt, &[], s as u64);
        let want = vec![x.to_f64_vec()[0]; 5];
        check(
            &Op::Expand {
                shape: Shape::new([5]),
            },
            &x,
            &[5],
            &want,
        );
    }
    let x = rand(DType::F16, &[1, 300], 3);
    let want = reference(&x, &[200, 300], 0.0, |o| Some(vec![0, o[1]]));
    check(
        &Op::Expand {
            shape: Shape::new([200, 300]),
        },
        &x,
        &[200, 300],
        &want,
    );
}

fn slice_case(dims: &[usize], starts: &[usize], ends: &[usize], steps: &[usize], dt: DType) {
    let x = rand(dt, dims, 11);
    let od: Vec<usize> = (0..dims.len())
        .map(|k| (ends[k] - starts[k]).div_ceil(steps[k]))
        .collect();
    let want = reference(&x, &od, 0.0, |o| {
        Some((0..o.len()).map(|k| starts[k] + o[k] * steps[k]).collect())
    });
    let op = Op::Slice {
        starts: starts.to_vec(),
        ends: ends.to_vec(),
        steps: steps.to_vec(),
    };
    check(&op, &x, &od, &want);
}

#[test]
fn slice_every_dtype() {
    for dt in DType::ALL {
        slice_case(&[5, 6, 7], &[1, 0, 2], &[4, 6, 7], &[1, 1, 1], dt);
        slice_case(&[5, 6, 7], &[0, 1, 2], &[5, 6, 7], &[2, 3, 2], dt);
        slice_case(&[4, 9], &[2, 3], &[2, 9], &[1, 4], dt);
    }
    slice_case(&[300, 301], &[3, 5], &[299, 300], &[1, 1], DType::F32);
    slice_case(&[300, 301], &[3, 5], &[299, 300], &[2, 3], DType::I64);
}

#[test]
fn concat_every_dtype() {
    for (s, dt) in DType::ALL.into_iter().enumerate() {
        let s = s as u64;
        for axis in 0..3 {
            let mut d1 = vec![2, 3, 4];
            let mut d2 = vec![2, 3, 4];
            let mut d3 = vec![2, 3, 4];
            d1[axis] = 1;
            d2[axis] = 5;
            d3[axis] = 2;
            let xs = [rand(dt, &d1, s), rand(dt, &d2, s + 1), rand(dt, &d3, s + 2)];
            let mut od = vec![2, 3, 4];
            od[axis] = 8;
            let y = eval_cpu(&Op::Concat { axis }, &[&xs[0], &xs[1], &xs[2]]).unwrap();
            assert_eq!(y.dims(), od.as_slice());
            let yv = y.to_f64_vec();
            for (i, &got) in yv.iter().enumerate() {
                let mut o = unravel(i, &od);
                let mut which = 0;
                while o[axis] >= xs[which].dims()[axis] {
                    o[axis] -= xs[which].dims()[axis];
                    which += 1;
                }
                let st = strides(xs[which].dims());
                let j: usize = o.iter().zip(&st).map(|(a, b)| a * b).sum();
                assert_eq!(
                    got,
                    xs[which].to_f64_vec()[j],
                    "concat axis {axis} {dt} at {i}"
                );
            }
        }
    }
}

fn pad_case(dims: &[usize], pads: &[(usize, usize)], value: f64, dt: DType) {
    let x = rand(dt, dims, 5);
    let od: Vec<usize> = dims
        .iter()
        .zip(pads)
        .map(|(&d, &(b, a))| b + d + a)
        .collect();
    let fill = TensorType::new(dt, Shape::scalar());
    let fill = HostTensor::full(&fill, value).to_f64_vec()[0];
    let want = reference(&x, &od, fill, |o| {
        let mut j = Vec::with_capacity(o.len());
        for k in 0..o.len() {
            let (b, d) = (pads[k].0, dims[k]);
            if o[k] < b || o[k] >= b + d {
                return None;
            }
            j.push(o[k] - b);
        }
        Some(j)
    });
    let op = Op::Pad {
        pads: pads.to_vec(),
        value: value.into(),
    };
    check(&op, &x, &od, &want);
}

#[test]
fn pad_every_dtype() {
    for dt in DType::ALL {
        pad_case(&[2, 3], &[(1, 2), (0, 3)], 7.0, dt);
        pad_case(&[2, 3, 4], &[(0, 0), (2, 1), (1, 1)], -1.5, dt);
        pad_case(&[3], &[(0, 0)], 0.0, dt);
    }
    pad_case(&[200, 200], &[(3, 4), (5, 6)], 2.5, DType::F32);
}

#[test]
fn empty_tensors() {
    let x = rand(DType::F32, &[0, 3], 1);
    check(&Op::Permute { perm: vec![1, 0] }, &x, &[3, 0], &[]);
    check(
        &Op::Pad {
            pads: vec![(1, 0), (0, 0)],
            value: 4.0.into(),
        },
        &x,
        &[1, 3],
        &[4.0; 3],
    );
    let x = rand(DType::F32, &[4, 3], 1);
    check(
        &Op::Slice {
            starts: vec![2, 0],
            ends: vec![2, 3],
            steps: vec![1, 1],
        },
        &x,
        &[0, 3],
        &[],
    );
}

fn err_text(op: &Op, tys: &[TensorType]) -> String {
    let refs: Vec<&TensorType> = tys.iter().collect();
    rustytorch_ops::infer(op, &refs).unwrap_err().to_string()
}

#[test]
fn shape_errors_name_op_and_types() {
    let t = |d: &[usize]| TensorType::new(DType::F32, d.to_vec());
    let e = err_text(
        &Op::Reshape {
            shape: Shape::new([5]),
        },
        &[t(&[2, 3])],
    );
    assert!(
        e.contains("reshape") && e.contains("f32[2,3]") && e.contains("[5]"),
        "{e}"
    );
    let e = err_text(&Op::Permute { perm: vec![0, 0] }, &[t(&[2, 3])]);
    assert!(e.contains("permute") && e.contains("f32[2,3]"), "{e}");
    let e = err_text(
        &Op::Expand {
            shape: Shape::new([4, 3]),
        },
        &[t(&[2, 3])],
    );
    assert!(
        e.contains("expand") && e.contains("f32[2,3]") && e.contains("[4,3]"),
        "{e}"
    );
    for (s, en, st) in [(0, 4, 1), (2, 1, 1), (0, 2, 0)] {
        let e = err_text(
            &Op::Slice {
                starts: vec![0, s],
                ends: vec![2, en],
                steps: vec![1, st],
            },
            &[t(&[2, 3])],
        );
        assert!(e.contains("slice") && e.contains("f32[2,3]"), "{e}");
    }
    let e = err_text(
        &Op::Slice {
            starts: vec![0],
            ends: vec![2],
            steps: vec![1],
        },
        &[t(&[2, 3])],
    );
    assert!(e.contains("slice"), "{e}");
    let e = err_text(&Op::Concat { axis: 1 }, &[t(&[2, 3]), t(&[3, 3])]);
    assert!(
        e.contains("concat") && e.contains("f32[2,3]") && e.contains("f32[3,3]"),
        "{e}"
    );
    let e = err_text(
        &Op::Concat { axis: 0 },
        &[t(&[2, 3]), TensorType::new(DType::F64, vec![2, 3])],
    );
    assert!(e.contains("concat") && e.contains("f64[2,3]"), "{e}");
    assert!(rustytorch_ops::infer(&Op::Concat { axis: 0 }, &[]).is_err());
    let e = err_text(
        &Op::Pad {
            pads: vec![(1, 1)],
            value: 0.0.into(),
        },
        &[t(&[2, 3])],
    );
    assert!(e.contains("pad"), "{e}");
}

#[test]
fn gradchecks() {
    let x = rand_tensor(&f64_ty(&[2, 3, 4]), 1, -1.0, 1.0);
    let ops = [
        Op::Reshape {
            shape: Shape::new([6, 4]),
        },
        Op::Permute {
            perm: vec![2, 0, 1],
        },
        Op::Slice {
            starts: vec![0, 1, 1],
            ends: vec![2, 3, 4],
            steps: vec![1, 1, 1],
        },
        Op::Slice {
            starts: vec![1, 0, 0],
            ends: vec![2, 3, 4],
            steps: vec![1, 2, 3],
        },
        Op::Slice {
            starts: vec![0, 1, 1],
            ends: vec![2, 3, 3],
            steps: vec![2, 5, 1],
        },
        Op::Pad {
            pads: vec![(1, 0), (0, 2), (1, 1)],
            value: 3.0.into(),
        },
        Op::Expand {
            shape: Shape::new([3, 2, 3, 4]),
        },
    ];
    for op in &ops {
        gradcheck(op, std::slice::from_ref(&x), &[0], 3).unwrap_or_else(|e| panic!("{op:?}: {e}"));
    }
    let b = rand_tensor(&f64_ty(&[3, 1]), 2, -1.0, 1.0);
    gradcheck(
        &Op::Expand {
            shape: Shape::new([2, 3, 4]),
        },
        &[b],
        &[0],
        4,
    )
    .unwrap();
    let ins = [
        rand_tensor(&f64_ty(&[2, 1, 4]), 5, -1.0, 1.0),
        rand_tensor(&f64_ty(&[2, 3, 4]), 6, -1.0, 1.0),
    ];
    gradcheck(&Op::Concat { axis: 1 }, &ins, &[0, 1], 7).unwrap();
}
