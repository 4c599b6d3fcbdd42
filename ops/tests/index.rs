//! Gather, scatter_add, index_select and index_add against plain references, with i32 and i64
//! indices, their out-of-range and shape errors, and gradchecks of their rules.

use rustytorch_ops::testing::{assert_close, gradcheck, rand_tensor, tolerance};
use rustytorch_ops::{eval_cpu, infer, DType, HostTensor, Op, OpError, Shape, TensorType};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
const INDEX: [DType; 2] = [DType::I32, DType::I64];

/// The low end of a random range: `lo`, or 1 for the unsigned dtypes (no zeros, no saturation).
fn low(dtype: DType, lo: f64) -> f64 {
    if dtype.is_unsigned_int() {
        1.0
    } else {
        lo
    }
}

fn ty(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, dims.to_vec())
}

fn eval(op: &Op, inputs: &[&HostTensor]) -> HostTensor {
    eval_cpu(op, inputs).unwrap_or_else(|e| panic!("{e}"))
}

/// Row-major coordinates of linear position `p` in `dims`.
fn unravel(mut p: usize, dims: &[usize]) -> Vec<usize> {
    let mut c = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        c[d] = p % dims[d];
        p /= dims[d];
    }
    c
}

/// Linear position of coordinates `c` in `dims`.
fn ravel(c: &[usize], dims: &[usize]) -> usize {
    c.iter().zip(dims).fold(0, |acc, (&ci, &d)| acc * d + ci)
}

/// Random indices in `0..n` of type `dtype` (i32 or i64).
fn rand_index(dtype: DType, dims: &[usize], n: usize, seed: u64) -> HostTensor {
    rand_tensor(&ty(dtype, dims), seed, 0.0, n as f64)
}

fn idx_vals(t: &HostTensor) -> Vec<usize> {
    t.to_f64_vec().iter().map(|&v| v as usize).collect()
}

#[test]
fn gather_every_axis_dtype_and_index_type() {
    let xd = [4, 5, 6];
    // Index dims smaller than x's on the other axes, larger on the gathered one.
    let ids = [[7, 3, 6], [4, 8, 2], [2, 5, 9]];
    for dtype in FLOATS.into_iter().chain(DType::INTS) {
        let x = rand_tensor(&ty(dtype, &xd), 1, low(dtype, -50.0), 50.0);
        let xv = x.to_f64_vec();
        for axis in 0..3 {
            for it in INDEX {
                let id = ids[axis];
                let index = rand_index(it, &id, xd[axis], 2 + axis as u64);
                let iv = idx_vals(&index);
                let y = eval(&Op::Gather { axis }, &[&x, &index]);
                assert_eq!(y.ty(), ty(dtype, &id));
                let want: Vec<f64> = (0..iv.len())
                    .map(|p| {
                        let mut c = unravel(p, &id);
                        c[axis] = iv[p];
                        xv[ravel(&c, &xd)]
                    })
                    .collect();
                // A gather copies: exact in every dtype.
                assert_close(
                    &y.to_f64_vec(),
                    &want,
                    0.0,
                    &format!("gather {dtype} {it} axis {axis}"),
                );
            }
        }
    }
}

#[test]
fn gather_large_parallel() {
    let xd = [300, 200];
    let x = rand_tensor(&ty(DType::F32, &xd), 3, -1.0, 1.0);
    let index = rand_index(DType::I64, &[300, 150], 200, 4);
    let iv = idx_vals(&index);
    let xv = x.to_f64_vec();
    let y = eval(&Op::Gather { axis: 1 }, &[&x, &index]);
    let want: Vec<f64> = (0..iv.len()).map(|p| xv[(p / 150) * 200 + iv[p]]).collect();
    assert_close(&y.to_f64_vec(), &want, 0.0, "gather large");
}

fn scatter_ref(
    base: &[f64],
    bd: &[usize],
    iv: &[usize],
    id: &[usize],
    src: &[f64],
    axis: usize,
) -> Vec<f64> {
    let mut out = base.to_vec();
    for p in 0..iv.len() {
        let mut c = unravel(p, id);
        c[axis] = iv[p];
        out[ravel(&c, bd)] += src[p];
    }
    out
}

#[test]
fn scatter_add_every_axis_dtype_and_index_type() {
    let bd = [4, 5, 6];
    let ids = [[7, 3, 6], [4, 8, 2], [2, 5, 9]];
    for dtype in FLOATS.into_iter().chain([DType::I32, DType::I64]) {
        let base = rand_tensor(&ty(dtype, &bd), 5, -20.0, 20.0);
        for axis in 0..3 {
            for it in INDEX {
                let id = ids[axis];
                let index = rand_index(it, &id, bd[axis], 6 + axis as u64);
                let src = rand_tensor(&ty(dtype, &id), 7, -20.0, 20.0);
                let y = eval(&Op::ScatterAdd { axis }, &[&base, &index, &src]);
                assert_eq!(y.ty(), base.ty());
                let want = scatter_ref(
                    &base.to_f64_vec(),
                    &bd,
                    &idx_vals(&index),
                    &id,
                    &src.to_f64_vec(),
                    axis,
                );
                // Sums of up to a few terms of magnitude 20, rounded once.
                assert_close(
                    &y.to_f64_vec(),
                    &want,
                    tolerance(dtype),
                    &format!("scatter_add {dtype} {it} axis {axis}"),
                );
            }
        }
    }
}

#[test]
fn index_select_and_embedding() {
    let xd = [6, 4, 5];
    for dtype in FLOATS.into_iter().chain(DType::INTS).chain([DType::Bool]) {
        let x = rand_tensor(&ty(dtype, &xd), 8, low(dtype, -10.0), 10.0);
        let xv = x.to_f64_vec();
        for axis in 0..3 {
            for it in INDEX {
                let index = rand_index(it, &[9], xd[axis], 9 + axis as u64);
                let iv = idx_vals(&index);
                let y = eval(&Op::IndexSelect { axis }, &[&x, &index]);
                let mut od = xd.to_vec();
                od[axis] = 9;
                assert_eq!(y.ty(), ty(dtype, &od));
                let want: Vec<f64> = (0..y.numel())
                    .map(|p| {
                        let mut c = unravel(p, &od);
                        c[axis] = iv[c[axis]];
                        xv[ravel(&c, &xd)]
                    })
                    .collect();
                assert_close(
                    &y.to_f64_vec(),
                    &want,
                    0.0,
                    &format!("index_select {dtype} {it} axis {axis}"),
                );
            }
        }
    }
    // Embedding: a [V, D] table, token ids [T].
    let table = rand_tensor(&ty(DType::F32, &[50, 8]), 10, -1.0, 1.0);
    let ids = HostTensor::from_vec(vec![3i64, 49, 0, 3], [4]).unwrap();
    let y = eval(&Op::IndexSelect { axis: 0 }, &[&table, &ids]);
    let tv = table.to_f64_vec();
    let want: Vec<f64> = [3, 49, 0, 3]
        .iter()
        .flat_map(|&r| tv[r * 8..r * 8 + 8].to_vec())
        .collect();
    assert_close(&y.to_f64_vec(), &want, 0.0, "embedding");
}

#[test]
fn index_add_every_axis_dtype_and_index_type() {
    let bd = [5, 4, 6];
    for dtype in FLOATS.into_iter().chain([DType::I32]) {
        let base = rand_tensor(&ty(dtype, &bd), 11, -20.0, 20.0);
        for axis in 0..3 {
            for it in INDEX {
                let index = rand_index(it, &[7], bd[axis], 12 + axis as u64);
                let iv = idx_vals(&index);
                let mut sd = bd.to_vec();
                sd[axis] = 7;
                let src = rand_tensor(&ty(dtype, &sd), 13, -20.0, 20.0);
                let sv = src.to_f64_vec();
                let y = eval(&Op::IndexAdd { axis }, &[&base, &index, &src]);
                let mut want = base.to_f64_vec();
                for p in 0..sv.len() {
                    let mut c = unravel(p, &sd);
                    c[axis] = iv[c[axis]];
                    want[ravel(&c, &bd)] += sv[p];
                }
                assert_close(
                    &y.to_f64_vec(),
                    &want,
                    tolerance(dtype),
                    &format!("index_add {dtype} {it} axis {axis}"),
                );
            }
        }
    }
}

#[test]
fn index_add_large_parallel() {
    let bd = [64, 40, 32];
    let base = rand_tensor(&ty(DType::F64, &bd), 14, -1.0, 1.0);
    let index = rand_index(DType::I32, &[50], 40, 15);
    let iv = idx_vals(&index);
    let sd = [64, 50, 32];
    let src = rand_tensor(&ty(DType::F64, &sd), 16, -1.0, 1.0);
    let sv = src.to_f64_vec();
    let y = eval(&Op::IndexAdd { axis: 1 }, &[&base, &index, &src]);
    let mut want = base.to_f64_vec();
    for p in 0..sv.len() {
        let mut c = unravel(p, &sd);
        c[1] = iv[c[1]];
        want[ravel(&c, &bd)] += sv[p];
    }
    assert_close(&y.to_f64_vec(), &want, 1e-12, "index_add large");
}

fn expect_runtime(e: OpError, op: &str, value: &str, size: &str) {
    match &e {
        OpError::Runtime { .. } => {}
        _ => panic!("expected a runtime error, got {e}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains(op) && msg.contains(value) && msg.contains(size),
        "{msg} should name {op}, {value} and {size}"
    );
}

#[test]
fn out_of_range_indices_are_errors() {
    let x = rand_tensor(&ty(DType::F32, &[3, 4]), 17, -1.0, 1.0);
    for it in INDEX {
        let bad_hi =
            HostTensor::from_f64_slice(&ty(it, &[3, 2]), &[0.0, 1.0, 2.0, 4.0, 3.0, 0.0]).unwrap();
        let bad_lo =
            HostTensor::from_f64_slice(&ty(it, &[3, 2]), &[0.0, 1.0, -1.0, 3.0, 3.0, 0.0]).unwrap();
        let e = eval_cpu(&Op::Gather { axis: 1 }, &[&x, &bad_hi]).unwrap_err();
        expect_runtime(e, "gather", "index 4", "size 4");
        let e = eval_cpu(&Op::Gather { axis: 1 }, &[&x, &bad_lo]).unwrap_err();
        expect_runtime(e, "gather", "index -1", "size 4");
        let src = rand_tensor(&ty(DType::F32, &[3, 2]), 18, -1.0, 1.0);
        let e = eval_cpu(&Op::ScatterAdd { axis: 1 }, &[&x, &bad_hi, &src]).unwrap_err();
        expect_runtime(e, "scatter_add", "index 4", "size 4");

        let bad1 = HostTensor::from_f64_slice(&ty(it, &[2]), &[1.0, 3.0]).unwrap();
        let e = eval_cpu(&Op::IndexSelect { axis: 0 }, &[&x, &bad1]).unwrap_err();
        expect_runtime(e, "index_select", "index 3", "dim 0 of size 3");
        let neg = HostTensor::from_f64_slice(&ty(it, &[2]), &[-2.0, 0.0]).unwrap();
        let src = rand_tensor(&ty(DType::F32, &[2, 4]), 19, -1.0, 1.0);
        let e = eval_cpu(&Op::IndexAdd { axis: 0 }, &[&x, &neg, &src]).unwrap_err();
        expect_runtime(e, "index_add", "index -2", "dim 0 of size 3");
    }
}

#[test]
fn shape_and_dtype_errors() {
    let x = ty(DType::F32, &[3, 4]);
    let fidx = ty(DType::F32, &[3, 4]);
    let e = infer(&Op::Gather { axis: 0 }, &[&x, &fidx]).unwrap_err();
    assert!(matches!(e, OpError::DType { .. }), "{e}");
    assert!(
        e.to_string().contains("gather") && e.to_string().contains("f32[3,4]"),
        "{e}"
    );

    let big = ty(DType::I64, &[3, 5]);
    let e = infer(&Op::Gather { axis: 0 }, &[&x, &big]).unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    assert!(e.to_string().contains("i64[3,5]"), "{e}");

    let e = infer(&Op::Gather { axis: 2 }, &[&x, &ty(DType::I64, &[3, 4])]).unwrap_err();
    assert!(matches!(e, OpError::Attribute { .. }), "{e}");

    let i2 = ty(DType::I32, &[2, 2]);
    let e = infer(&Op::IndexSelect { axis: 0 }, &[&x, &i2]).unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    assert!(e.to_string().contains("index_select"), "{e}");

    let i1 = ty(DType::I32, &[2]);
    let e = infer(
        &Op::IndexAdd { axis: 0 },
        &[&x, &i1, &ty(DType::F32, &[3, 4])],
    )
    .unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    let e = infer(
        &Op::IndexAdd { axis: 0 },
        &[&x, &i1, &ty(DType::F64, &[2, 4])],
    )
    .unwrap_err();
    assert!(matches!(e, OpError::DType { .. }), "{e}");

    let e = infer(
        &Op::ScatterAdd { axis: 0 },
        &[&x, &i2, &ty(DType::F32, &[2, 3])],
    )
    .unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    let b = ty(DType::Bool, &[3, 4]);
    let e = infer(
        &Op::ScatterAdd { axis: 0 },
        &[&b, &i2, &ty(DType::Bool, &[2, 2])],
    )
    .unwrap_err();
    assert!(matches!(e, OpError::DType { .. }), "{e}");
    assert_eq!(
        infer(
            &Op::ScatterAdd { axis: 1 },
            &[&x, &i2, &ty(DType::F32, &[2, 2])]
        )
        .unwrap(),
        x
    );
    assert_eq!(
        infer(&Op::IndexSelect { axis: 1 }, &[&x, &i1])
            .unwrap()
            .shape,
        Shape::new([3, 2])
    );
}

#[test]
fn gradcheck_index_ops() {
    let f = |dims: &[usize], seed| rand_tensor(&ty(DType::F64, dims), seed, -1.0, 1.0);
    // Repeated indices so that gradients accumulate.
    let gidx = HostTensor::from_vec(vec![0i64, 2, 2, 1, 0, 0, 3, 1, 1], [3, 3]).unwrap();
    gradcheck(
        &Op::Gather { axis: 1 },
        &[f(&[3, 4], 20), gidx.clone()],
        &[0],
        21,
    )
    .unwrap();
    let gidx0 = HostTensor::from_vec(vec![0i32, 2, 2, 1, 0, 0], [2, 3]).unwrap();
    gradcheck(
        &Op::Gather { axis: 0 },
        &[f(&[3, 4], 22), gidx0.clone()],
        &[0],
        23,
    )
    .unwrap();
    gradcheck(
        &Op::ScatterAdd { axis: 1 },
        &[f(&[3, 4], 24), gidx, f(&[3, 3], 25)],
        &[0, 2],
        26,
    )
    .unwrap();
    let sidx = HostTensor::from_vec(vec![2i64, 0, 2, 1, 2], [5]).unwrap();
    gradcheck(
        &Op::IndexSelect { axis: 0 },
        &[f(&[3, 4], 27), sidx.clone()],
        &[0],
        28,
    )
    .unwrap();
    gradcheck(
        &Op::IndexSelect { axis: 1 },
        &[f(&[2, 3, 2], 29), sidx.clone()],
        &[0],
        30,
    )
    .unwrap();
    gradcheck(
        &Op::IndexAdd { axis: 1 },
        &[f(&[2, 3, 2], 31), sidx, f(&[2, 5, 2], 32)],
        &[0, 2],
        33,
    )
    .unwrap();
}
