//! Matmul and its epilogue against a float64 triple-loop reference on seeded random inputs: every
//! float dtype, every transpose combination, odd sizes, batched and broadcast batch dims; shape and
//! dtype errors; gradchecks.

use rustytorch_ops::testing::{assert_close, f64_ty, gradcheck, rand_tensor, tolerance};
use rustytorch_ops::{
    eval_cpu, infer, Activation, DType, HostTensor, Op, OpError, Shape, TensorType,
};

fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for k in (0..dims.len()).rev() {
        idx[k] = i % dims[k];
        i /= dims[k];
    }
    idx
}

/// Flat offset of the matrix of batch index `bi` (of `batch`) in an operand with batch dims `own`.
fn batch_offset(bi: &[usize], own: &[usize], mat: usize) -> usize {
    let off = bi.len() - own.len();
    let st = Shape::new(own).strides();
    own.iter()
        .enumerate()
        .map(|(k, &d)| if d == 1 { 0 } else { bi[k + off] * st[k] })
        .sum::<usize>()
        * mat
}

fn gelu_erf(x: f64) -> f64 {
    0.5 * x * (1.0 + rustytorch_ops::elementwise::erf(x / 2f64.sqrt()))
}

fn gelu_tanh(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x.powi(3))).tanh())
}

/// The float64 reference: `act(op(A)·op(B) + bias)` with numpy batch broadcasting.
fn reference(
    a: &HostTensor,
    b: &HostTensor,
    bias: Option<&HostTensor>,
    ta: bool,
    tb: bool,
    act: Activation,
) -> (Vec<usize>, Vec<f64>) {
    let (ad, bd) = (a.dims(), b.dims());
    let (ra, rb) = (ad.len(), bd.len());
    let (m, k) = if ta {
        (ad[ra - 1], ad[ra - 2])
    } else {
        (ad[ra - 2], ad[ra - 1])
    };
    let n = if tb { bd[rb - 2] } else { bd[rb - 1] };
    let batch = Shape::broadcast(&Shape::new(&ad[..ra - 2]), &Shape::new(&bd[..rb - 2])).unwrap();
    let (av, bv) = (a.to_f64_vec(), b.to_f64_vec());
    let cv = bias.map(|c| c.to_f64_vec());
    let mut out = Vec::new();
    for bflat in 0..batch.numel() {
        let bi = unravel(bflat, batch.dims());
        let ao = batch_offset(&bi, &ad[..ra - 2], m * k);
        let bo = batch_offset(&bi, &bd[..rb - 2], k * n);
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for p in 0..k {
                    let x = if ta {
                        av[ao + p * m + i]
                    } else {
                        av[ao + i * k + p]
                    };
                    let y = if tb {
                        bv[bo + j * k + p]
                    } else {
                        bv[bo + p * n + j]
                    };
                    s += x * y;
                }
                if let Some(c) = &cv {
                    s += c[j];
                }
                out.push(match act {
                    Activation::None => s,
                    Activation::Relu => s.max(0.0),
                    Activation::GeluErf => gelu_erf(s),
                    Activation::GeluTanh => gelu_tanh(s),
                });
            }
        }
    }
    let mut dims = batch.dims().to_vec();
    dims.extend([m, n]);
    (dims, out)
}

/// Stored dims of an operand whose (op-applied) matrix is `r × c`.
fn stored(batch: &[usize], r: usize, c: usize, t: bool) -> Vec<usize> {
    let mut d = batch.to_vec();
    if t {
        d.extend([c, r]);
    } else {
        d.extend([r, c]);
    }
    d
}

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

#[allow(clippy::too_many_arguments)]
fn check(
    dt: DType,
    ba: &[usize],
    bb: &[usize],
    (m, k, n): (usize, usize, usize),
    ta: bool,
    tb: bool,
    bias: bool,
    act: Activation,
    seed: u64,
) {
    let a = rand_tensor(&TensorType::new(dt, stored(ba, m, k, ta)), seed, -1.0, 1.0);
    let b = rand_tensor(
        &TensorType::new(dt, stored(bb, k, n, tb)),
        seed + 1,
        -1.0,
        1.0,
    );
    let c = rand_tensor(&TensorType::new(dt, [n]), seed + 2, -1.0, 1.0);
    let op = if bias || act != Activation::None {
        Op::MatmulEpilogue {
            trans_a: ta,
            trans_b: tb,
            bias,
            act,
            accumulate: false,
        }
    } else {
        Op::Matmul {
            trans_a: ta,
            trans_b: tb,
        }
    };
    let ins: Vec<&HostTensor> = if bias { vec![&a, &b, &c] } else { vec![&a, &b] };
    let y = eval_cpu(&op, &ins).unwrap_or_else(|e| panic!("{op:?}: {e}"));
    let (dims, want) = reference(&a, &b, bias.then_some(&c), ta, tb, act);
    assert_eq!(y.dims(), dims.as_slice(), "{op:?}");
    assert_eq!(y.dtype(), dt);
    let tol = tolerance(dt) * (k.max(1) as f64).sqrt();
    assert_close(
        &y.to_f64_vec(),
        &want,
        tol,
        &format!("{op:?} {} x {}", a.ty(), b.ty()),
    );
}

const SIZES: [(usize, usize, usize); 6] = [
    (1, 1, 1),
    (7, 33, 65),
    (65, 7, 33),
    (33, 65, 1),
    (1, 65, 7),
    (4, 0, 3),
];

#[test]
fn two_d_every_dtype_and_transpose() {
    let mut seed = 0;
    for dt in FLOATS {
        for mkn in SIZES {
            for ta in [false, true] {
                for tb in [false, true] {
                    seed += 3;
                    check(dt, &[], &[], mkn, ta, tb, false, Activation::None, seed);
                }
            }
        }
    }
}

#[test]
fn batched_and_broadcast() {
    let mut seed = 100;
    let batches: [(&[usize], &[usize]); 5] = [
        (&[3], &[3]),
        (&[2, 1], &[5]),
        (&[], &[2, 3]),
        (&[4, 1, 2], &[1, 3, 1]),
        (&[1], &[]),
    ];
    for dt in FLOATS {
        for (ba, bb) in batches {
            for ta in [false, true] {
                for tb in [false, true] {
                    seed += 3;
                    check(dt, ba, bb, (3, 7, 5), ta, tb, false, Activation::None, seed);
                }
            }
        }
        // The shapes of the brief: [2,1,3,4] x [5,4,6].
        check(
            dt,
            &[2, 1],
            &[5],
            (3, 4, 6),
            false,
            false,
            false,
            Activation::None,
            7,
        );
    }
}

#[test]
fn large_take_the_parallel_paths() {
    // One big matrix (gemm's own threads) and many small ones (parallel over the batch).
    check(
        DType::F32,
        &[],
        &[],
        (200, 300, 190),
        false,
        true,
        false,
        Activation::None,
        1,
    );
    check(
        DType::BF16,
        &[],
        &[],
        (130, 64, 257),
        true,
        false,
        true,
        Activation::GeluErf,
        2,
    );
    check(
        DType::F64,
        &[256],
        &[256],
        (8, 9, 10),
        false,
        false,
        false,
        Activation::None,
        3,
    );
    check(
        DType::F16,
        &[128],
        &[1],
        (16, 16, 16),
        true,
        true,
        true,
        Activation::Relu,
        4,
    );
}

#[test]
fn epilogue_every_dtype_and_activation() {
    let mut seed = 500;
    for dt in FLOATS {
        for act in [
            Activation::None,
            Activation::Relu,
            Activation::GeluErf,
            Activation::GeluTanh,
        ] {
            for bias in [false, true] {
                for (ta, tb) in [(false, false), (true, true), (false, true)] {
                    seed += 3;
                    check(dt, &[2], &[], (5, 9, 7), ta, tb, bias, act, seed);
                }
            }
        }
    }
}

#[test]
fn non_contiguous_inputs() {
    // A permuted operand (the way a view reaches matmul here) equals the transpose flag.
    let a = rand_tensor(&TensorType::new(DType::F32, [2, 9, 5]), 1, -1.0, 1.0);
    let b = rand_tensor(&TensorType::new(DType::F32, [9, 4]), 2, -1.0, 1.0);
    let at = eval_cpu(
        &Op::Permute {
            perm: vec![0, 2, 1],
        },
        &[&a],
    )
    .unwrap();
    let y = eval_cpu(
        &Op::Matmul {
            trans_a: false,
            trans_b: false,
        },
        &[&at, &b],
    )
    .unwrap();
    let (_, want) = reference(&a, &b, None, true, false, Activation::None);
    assert_close(&y.to_f64_vec(), &want, 1e-5, "permuted lhs");
    // A stepped slice as the rhs.
    let big = rand_tensor(&TensorType::new(DType::F64, [10, 12]), 3, -1.0, 1.0);
    let s = eval_cpu(
        &Op::Slice {
            starts: vec![1, 0],
            ends: vec![10, 12],
            steps: vec![2, 3],
        },
        &[&big],
    )
    .unwrap();
    let x = rand_tensor(&TensorType::new(DType::F64, [3, 5]), 4, -1.0, 1.0);
    let y = eval_cpu(
        &Op::Matmul {
            trans_a: false,
            trans_b: false,
        },
        &[&x, &s],
    )
    .unwrap();
    let (_, want) = reference(&x, &s, None, false, false, Activation::None);
    assert_close(&y.to_f64_vec(), &want, 1e-12, "sliced rhs");
}

fn err(op: &Op, tys: &[TensorType]) -> OpError {
    let refs: Vec<&TensorType> = tys.iter().collect();
    infer(op, &refs).unwrap_err()
}

#[test]
fn errors_name_op_shapes_and_dtypes() {
    let mm = Op::Matmul {
        trans_a: false,
        trans_b: false,
    };
    let t = |d: &[usize]| TensorType::new(DType::F32, d.to_vec());
    let e = err(&mm, &[t(&[2, 3]), t(&[4, 5])]);
    let s = e.to_string();
    assert!(matches!(e, OpError::Shape { .. }), "{s}");
    assert!(
        s.contains("matmul")
            && s.contains("f32[2,3]")
            && s.contains("f32[4,5]")
            && s.contains("inner"),
        "{s}"
    );
    assert!(s.contains('3') && s.contains('4'), "{s}");
    let e = err(&mm, &[t(&[3]), t(&[3, 5])]).to_string();
    assert!(e.contains("rank") && e.contains("f32[3]"), "{e}");
    let e = err(&mm, &[t(&[2, 2, 3]), t(&[3, 3, 5])]).to_string();
    assert!(e.contains("batch") && e.contains("f32[2,2,3]"), "{e}");
    let e = err(
        &mm,
        &[
            TensorType::new(DType::I32, [2, 3]),
            TensorType::new(DType::I32, [3, 2]),
        ],
    );
    assert!(matches!(e, OpError::DType { .. }), "{e}");
    assert!(e.to_string().contains("i32[2,3]"), "{e}");
    let e = err(&mm, &[t(&[2, 3]), TensorType::new(DType::F64, [3, 2])]);
    assert!(matches!(e, OpError::DType { .. }), "{e}");
    assert!(e.to_string().contains("f64[3,2]"), "{e}");
    let ep = Op::MatmulEpilogue {
        trans_a: false,
        trans_b: false,
        bias: true,
        act: Activation::Relu,
        accumulate: false,
    };
    let e = err(&ep, &[t(&[2, 3]), t(&[3, 4]), t(&[3])]).to_string();
    assert!(
        e.contains("matmul_epilogue") && e.contains("bias") && e.contains("f32[3]"),
        "{e}"
    );
    assert!(matches!(
        err(&ep, &[t(&[2, 3]), t(&[3, 4])]),
        OpError::Arity { .. }
    ));
    // The transpose flags decide which dims are inner.
    let ok = infer(
        &Op::Matmul {
            trans_a: true,
            trans_b: true,
        },
        &[&t(&[3, 2]), &t(&[4, 3])],
    )
    .unwrap();
    assert_eq!(ok, t(&[2, 4]));
}

#[test]
fn gradchecks() {
    for ta in [false, true] {
        for tb in [false, true] {
            let a = rand_tensor(&f64_ty(&stored(&[], 3, 4, ta)), 1, -1.0, 1.0);
            let b = rand_tensor(&f64_ty(&stored(&[], 4, 2, tb)), 2, -1.0, 1.0);
            let op = Op::Matmul {
                trans_a: ta,
                trans_b: tb,
            };
            gradcheck(&op, &[a, b], &[0, 1], 3).unwrap_or_else(|e| panic!("{op:?}: {e}"));
            // Broadcast batch dims: [2,1,3,4] x [3,4,2] (summed back over the broadcast).
            let a = rand_tensor(&f64_ty(&stored(&[2, 1], 3, 4, ta)), 4, -1.0, 1.0);
            let b = rand_tensor(&f64_ty(&stored(&[3], 4, 2, tb)), 5, -1.0, 1.0);
            gradcheck(&op, &[a, b], &[0, 1], 6).unwrap_or_else(|e| panic!("{op:?} batched: {e}"));
        }
    }
    for act in [
        Activation::None,
        Activation::Relu,
        Activation::GeluErf,
        Activation::GeluTanh,
    ] {
        for (ta, tb) in [(false, false), (true, true)] {
            let op = Op::MatmulEpilogue {
                trans_a: ta,
                trans_b: tb,
                bias: true,
                act,
                accumulate: false,
            };
            let a = rand_tensor(&f64_ty(&stored(&[2], 3, 4, ta)), 7, -1.0, 1.0);
            let b = rand_tensor(&f64_ty(&stored(&[], 4, 5, tb)), 8, -1.0, 1.0);
            let c = rand_tensor(&f64_ty(&[5]), 9, -1.0, 1.0);
            gradcheck(&op, &[a, b, c], &[0, 1, 2], 10).unwrap_or_else(|e| panic!("{op:?}: {e}"));
        }
        let op = Op::MatmulEpilogue {
            trans_a: false,
            trans_b: true,
            bias: false,
            act,
            accumulate: false,
        };
        let a = rand_tensor(&f64_ty(&[3, 4]), 11, -1.0, 1.0);
        let b = rand_tensor(&f64_ty(&[2, 5, 4]), 12, -1.0, 1.0);
        gradcheck(&op, &[a, b], &[0, 1], 13).unwrap_or_else(|e| panic!("{op:?}: {e}"));
    }
}

#[test]
fn empty_operands() {
    let a = rand_tensor(&TensorType::new(DType::F32, [0, 3]), 1, -1.0, 1.0);
    let b = rand_tensor(&TensorType::new(DType::F32, [3, 4]), 2, -1.0, 1.0);
    let mm = Op::Matmul {
        trans_a: false,
        trans_b: false,
    };
    assert_eq!(eval_cpu(&mm, &[&a, &b]).unwrap().dims(), &[0, 4]);
    let a = rand_tensor(&TensorType::new(DType::F32, [0, 2, 3]), 1, -1.0, 1.0);
    assert_eq!(eval_cpu(&mm, &[&a, &b]).unwrap().dims(), &[0, 2, 4]);
}

/// `A·B + bias + C` (an accumulated operand) against the f64 reference plus C, every float
/// dtype, with and without a bias, batched (the packed and the gemm paths): C is added before
/// the one rounding, so half types stay within their own tolerance of the exact sum.
#[test]
fn accumulated_operand_every_dtype() {
    let mut seed = 900;
    for dt in FLOATS {
        for bias in [false, true] {
            for (ta, tb) in [(false, false), (true, false), (false, true)] {
                for (batch, m, k, n) in [(&[][..], 5, 9, 7), (&[3][..], 33, 70, 20)] {
                    seed += 4;
                    let a = rand_tensor(
                        &TensorType::new(dt, stored(batch, m, k, ta)),
                        seed,
                        -1.0,
                        1.0,
                    );
                    let b = rand_tensor(
                        &TensorType::new(dt, stored(&[], k, n, tb)),
                        seed + 1,
                        -1.0,
                        1.0,
                    );
                    let bv = rand_tensor(&TensorType::new(dt, [n]), seed + 2, -1.0, 1.0);
                    let mut cdims = batch.to_vec();
                    cdims.extend([m, n]);
                    let c = rand_tensor(&TensorType::new(dt, cdims), seed + 3, -4.0, 4.0);
                    let op = Op::MatmulEpilogue {
                        trans_a: ta,
                        trans_b: tb,
                        bias,
                        act: Activation::None,
                        accumulate: true,
                    };
                    let ins: Vec<&HostTensor> = if bias {
                        vec![&a, &b, &bv, &c]
                    } else {
                        vec![&a, &b, &c]
                    };
                    let y = eval_cpu(&op, &ins).unwrap_or_else(|e| panic!("{op:?}: {e}"));
                    let (dims, mut want) =
                        reference(&a, &b, bias.then_some(&bv), ta, tb, Activation::None);
                    for (w, cv) in want.iter_mut().zip(c.to_f64_vec()) {
                        *w += cv;
                    }
                    assert_eq!(y.dims(), dims.as_slice());
                    let tol = tolerance(dt) * (k as f64).sqrt() * 4.0;
                    assert_close(&y.to_f64_vec(), &want, tol, &format!("{op:?} {dt}"));
                }
            }
        }
    }
}

/// The gradient of the accumulated operand is the result's; A, B and the bias get the plain
/// epilogue's gradients.
#[test]
fn accumulated_operand_gradcheck() {
    for bias in [false, true] {
        let op = Op::MatmulEpilogue {
            trans_a: false,
            trans_b: true,
            bias,
            act: Activation::None,
            accumulate: true,
        };
        let a = rand_tensor(&f64_ty(&[2, 3, 4]), 21, -1.0, 1.0);
        let b = rand_tensor(&f64_ty(&[5, 4]), 22, -1.0, 1.0);
        let bv = rand_tensor(&f64_ty(&[5]), 23, -1.0, 1.0);
        let c = rand_tensor(&f64_ty(&[2, 3, 5]), 24, -1.0, 1.0);
        let (ins, wrt) = if bias {
            (vec![a, b, bv, c], vec![0, 1, 2, 3])
        } else {
            (vec![a, b, c], vec![0, 1, 2])
        };
        gradcheck(&op, &ins, &wrt, 25).unwrap_or_else(|e| panic!("{op:?}: {e}"));
    }
}

/// An accumulated operand must have the product's shape and dtype, comes after the bias, and
/// only with no activation.
#[test]
fn accumulated_operand_errors() {
    let t = |d: &[usize]| TensorType::new(DType::F32, d.to_vec());
    let op = |act| Op::MatmulEpilogue {
        trans_a: false,
        trans_b: false,
        bias: false,
        act,
        accumulate: true,
    };
    let e = err(&op(Activation::None), &[t(&[2, 3]), t(&[3, 4]), t(&[4])]).to_string();
    assert!(
        e.contains("matmul_epilogue") && e.contains("accumulated") && e.contains("f32[4]"),
        "{e}"
    );
    let e = err(&op(Activation::Relu), &[t(&[2, 3]), t(&[3, 4]), t(&[2, 4])]).to_string();
    assert!(e.contains("act=none"), "{e}");
    let e = err(
        &op(Activation::None),
        &[t(&[2, 3]), t(&[3, 4]), TensorType::new(DType::F64, [2, 4])],
    );
    assert!(matches!(e, OpError::DType { .. }), "{e}");
    assert!(matches!(
        err(&op(Activation::None), &[t(&[2, 3]), t(&[3, 4])]),
        OpError::Arity { .. }
    ));
}
