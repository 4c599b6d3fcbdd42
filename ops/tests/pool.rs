//! Max and average pooling (1-d, 2-d, 3-d; stride, padding, both `count_include_pad` settings) and
//! their gradient against direct float64 loops, their errors, and gradchecks of the rule.

use rustytorch_ops::testing::{assert_close, gradcheck, rand_tensor, tolerance};
use rustytorch_ops::{
    eval_cpu, infer, ConvGeom, DType, HostTensor, Op, OpError, PoolKind, TensorType,
};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

const KINDS: [PoolKind; 3] = [
    PoolKind::Max,
    PoolKind::Avg {
        count_include_pad: true,
    },
    PoolKind::Avg {
        count_include_pad: false,
    },
];

fn ty(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, dims.to_vec())
}

fn geom(stride: &[usize], padding: &[usize]) -> ConvGeom {
    ConvGeom::new(stride.to_vec(), padding.to_vec(), vec![1; stride.len()])
}

/// A pooling case over x [n, c, *ins].
#[derive(Clone, Debug)]
struct Case {
    n: usize,
    c: usize,
    ins: Vec<usize>,
    ks: Vec<usize>,
    stride: Vec<usize>,
    pad: Vec<usize>,
}

impl Case {
    fn op(&self, kind: PoolKind) -> Op {
        Op::Pool {
            kind,
            kernel: self.ks.clone(),
            geom: geom(&self.stride, &self.pad),
        }
    }
    fn grad_op(&self, kind: PoolKind) -> Op {
        Op::PoolGrad {
            kind,
            kernel: self.ks.clone(),
            geom: geom(&self.stride, &self.pad),
        }
    }
    fn x_dims(&self) -> Vec<usize> {
        [vec![self.n, self.c], self.ins.clone()].concat()
    }
    fn outs(&self) -> Vec<usize> {
        (0..self.ins.len())
            .map(|i| (self.ins[i] + 2 * self.pad[i] - self.ks[i]) / self.stride[i] + 1)
            .collect()
    }
    fn out_dims(&self) -> Vec<usize> {
        [vec![self.n, self.c], self.outs()].concat()
    }

    /// For each output element (in order): the flat input indices of its window's in-bounds
    /// elements (row-major window order) and the number of padded positions it covers.
    fn windows(&self) -> Vec<(Vec<usize>, usize)> {
        let s = self.ins.len();
        let outs = self.outs();
        let out_sp: usize = outs.iter().product();
        let in_sp: usize = self.ins.iter().product();
        let k_sp: usize = self.ks.iter().product();
        let mut r = Vec::new();
        for plane in 0..self.n * self.c {
            for op in 0..out_sp {
                let oi = unravel(op, &outs);
                let (mut idx, mut padded) = (Vec::new(), 0);
                'tap: for kp in 0..k_sp {
                    let ki = unravel(kp, &self.ks);
                    let mut xi = vec![0; s];
                    for d in 0..s {
                        let p = (oi[d] * self.stride[d] + ki[d]) as isize - self.pad[d] as isize;
                        if p < 0 || p >= self.ins[d] as isize {
                            padded += 1;
                            continue 'tap;
                        }
                        xi[d] = p as usize;
                    }
                    idx.push(plane * in_sp + ravel(&xi, &self.ins));
                }
                r.push((idx, padded));
            }
        }
        r
    }

    fn reference(&self, kind: PoolKind, x: &[f64]) -> Vec<f64> {
        self.windows()
            .iter()
            .map(|(idx, padded)| match kind {
                PoolKind::Max => idx.iter().map(|&i| x[i]).fold(f64::NEG_INFINITY, f64::max),
                PoolKind::Avg { count_include_pad } => {
                    let s: f64 = idx.iter().map(|&i| x[i]).sum();
                    let n = idx.len() + if count_include_pad { *padded } else { 0 };
                    s / n as f64
                }
            })
            .collect()
    }

    fn reference_grad(&self, kind: PoolKind, x: &[f64], g: &[f64]) -> Vec<f64> {
        let mut dx = vec![0.0; x.len()];
        for ((idx, padded), &go) in self.windows().iter().zip(g) {
            match kind {
                PoolKind::Max => {
                    // The first maximum in window order.
                    let mut best = idx[0];
                    for &i in idx {
                        if x[i] > x[best] {
                            best = i;
                        }
                    }
                    dx[best] += go;
                }
                PoolKind::Avg { count_include_pad } => {
                    let n = idx.len() + if count_include_pad { *padded } else { 0 };
                    for &i in idx {
                        dx[i] += go / n as f64;
                    }
                }
            }
        }
        dx
    }
}

fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut r = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        r[d] = i % dims[d];
        i /= dims[d];
    }
    r
}

fn ravel(idx: &[usize], dims: &[usize]) -> usize {
    idx.iter().zip(dims).fold(0, |a, (&i, &d)| a * d + i)
}

fn case(n: usize, c: usize, ins: &[usize], ks: &[usize], stride: &[usize], pad: &[usize]) -> Case {
    Case {
        n,
        c,
        ins: ins.to_vec(),
        ks: ks.to_vec(),
        stride: stride.to_vec(),
        pad: pad.to_vec(),
    }
}

fn cases() -> Vec<Case> {
    vec![
        case(2, 3, &[11], &[3], &[2], &[1]),
        case(1, 2, &[10], &[4], &[3], &[2]),
        case(2, 2, &[7, 9], &[3, 2], &[2, 1], &[1, 1]),
        case(1, 3, &[6, 5], &[2, 2], &[2, 2], &[0, 0]),
        case(1, 2, &[5, 7], &[5, 3], &[1, 2], &[2, 1]),
        case(2, 2, &[5, 6, 4], &[3, 2, 2], &[2, 2, 1], &[1, 1, 0]),
        case(1, 1, &[3, 4, 5], &[2, 3, 3], &[1, 2, 2], &[1, 0, 1]),
    ]
}

#[test]
fn pool_forward_matches_reference() {
    for (i, c) in cases().iter().enumerate() {
        for kind in KINDS {
            for dtype in FLOATS {
                let x = rand_tensor(&ty(dtype, &c.x_dims()), 10 + i as u64, -1.0, 1.0);
                let want = c.reference(kind, &x.to_f64_vec());
                let got = eval_cpu(&c.op(kind), &[&x]).unwrap();
                assert_eq!(got.dtype(), dtype);
                assert_eq!(got.dims(), &c.out_dims()[..]);
                assert_close(
                    &got.to_f64_vec(),
                    &want,
                    tolerance(dtype),
                    &format!("pool {kind:?} {dtype} {c:?}"),
                );
            }
        }
    }
}

#[test]
fn pool_grad_matches_reference() {
    for (i, c) in cases().iter().enumerate() {
        for kind in KINDS {
            for dtype in FLOATS {
                let x = rand_tensor(&ty(dtype, &c.x_dims()), 20 + i as u64, -1.0, 1.0);
                let g = rand_tensor(&ty(dtype, &c.out_dims()), 30 + i as u64, -1.0, 1.0);
                let want = c.reference_grad(kind, &x.to_f64_vec(), &g.to_f64_vec());
                let got = eval_cpu(&c.grad_op(kind), &[&x, &g]).unwrap();
                assert_eq!(got.dtype(), dtype);
                assert_eq!(got.dims(), &c.x_dims()[..]);
                assert_close(
                    &got.to_f64_vec(),
                    &want,
                    tolerance(dtype),
                    &format!("pool_grad {kind:?} {dtype} {c:?}"),
                );
            }
        }
    }
}

/// Ties go to the first maximum, and padding never wins over negative inputs.
#[test]
fn max_pool_ties_and_padding() {
    let x = HostTensor::from_vec(vec![-3.0f64, -1.0, -1.0, -2.0, -5.0], [1, 1, 5]).unwrap();
    let op = case(1, 1, &[5], &[3], &[2], &[1]).op(PoolKind::Max);
    let y = eval_cpu(&op, &[&x]).unwrap();
    assert_eq!(y.to_vec::<f64>().unwrap(), vec![-1.0, -1.0, -2.0]);
    let Op::Pool { kind, kernel, geom } = op else {
        unreachable!()
    };
    let g = HostTensor::from_vec(vec![1.0f64, 10.0, 100.0], [1, 1, 3]).unwrap();
    let dx = eval_cpu(&Op::PoolGrad { kind, kernel, geom }, &[&x, &g]).unwrap();
    assert_eq!(
        dx.to_vec::<f64>().unwrap(),
        vec![0.0, 11.0, 0.0, 100.0, 0.0]
    );
}

/// Enough planes to take the parallel path.
#[test]
fn pool_parallel_path_matches_reference() {
    let c = case(4, 16, &[33, 31], &[3, 3], &[2, 2], &[1, 1]);
    for kind in KINDS {
        let x = rand_tensor(&ty(DType::F32, &c.x_dims()), 40, -1.0, 1.0);
        let g = rand_tensor(&ty(DType::F32, &c.out_dims()), 41, -1.0, 1.0);
        let (xv, gv) = (x.to_f64_vec(), g.to_f64_vec());
        let y = eval_cpu(&c.op(kind), &[&x]).unwrap();
        assert_close(
            &y.to_f64_vec(),
            &c.reference(kind, &xv),
            1e-5,
            "parallel pool",
        );
        let dx = eval_cpu(&c.grad_op(kind), &[&x, &g]).unwrap();
        assert_close(
            &dx.to_f64_vec(),
            &c.reference_grad(kind, &xv, &gv),
            1e-5,
            "parallel pool_grad",
        );
    }
}

#[test]
fn pool_gradcheck() {
    let checks = [
        case(2, 2, &[9], &[3], &[2], &[1]),
        case(1, 2, &[5, 6], &[3, 2], &[2, 1], &[1, 1]),
        case(1, 1, &[4, 5, 3], &[2, 3, 2], &[2, 2, 1], &[1, 1, 0]),
    ];
    for (i, c) in checks.iter().enumerate() {
        for kind in KINDS {
            // Random floats: no exact ties, and far enough apart for finite differences.
            let x = rand_tensor(&ty(DType::F64, &c.x_dims()), 50 + i as u64, -1.0, 1.0);
            gradcheck(&c.op(kind), &[x], &[0], 60 + i as u64)
                .unwrap_or_else(|e| panic!("{kind:?} {c:?}: {e}"));
        }
    }
}

#[test]
fn pool_grad_is_not_differentiable() {
    let c = case(1, 1, &[5], &[2], &[1], &[0]);
    let x = rand_tensor(&ty(DType::F64, &c.x_dims()), 70, -1.0, 1.0);
    let g = rand_tensor(&ty(DType::F64, &c.out_dims()), 71, -1.0, 1.0);
    let cot = rand_tensor(&ty(DType::F64, &c.x_dims()), 72, -1.0, 1.0);
    let e = rustytorch_ops::testing::vjp_eager(&c.grad_op(PoolKind::Max), &[x, g], &cot)
        .expect_err("pool_grad has no gradient rule");
    assert!(
        matches!(
            e,
            OpError::NotDifferentiable {
                op: "pool_grad",
                ..
            }
        ),
        "{e:?}"
    );
}

fn err(op: &Op, inputs: &[TensorType]) -> OpError {
    let refs: Vec<&TensorType> = inputs.iter().collect();
    infer(op, &refs).expect_err("inference should fail")
}

#[test]
fn pool_errors_name_op_shapes_and_dtypes() {
    let max2 = |k: &[usize], s: &[usize], p: &[usize], d: &[usize]| Op::Pool {
        kind: PoolKind::Max,
        kernel: k.to_vec(),
        geom: ConvGeom::new(s.to_vec(), p.to_vec(), d.to_vec()),
    };
    let x = ty(DType::F32, &[1, 2, 4, 4]);
    // Attributes: dilation, lengths, zero stride or kernel, padding over half the kernel.
    for op in [
        max2(&[2, 2], &[1, 1], &[0, 0], &[1, 2]),
        max2(&[2], &[1, 1], &[0, 0], &[1, 1]),
        max2(&[2, 2], &[1], &[0, 0], &[1, 1]),
        max2(&[2, 2], &[0, 1], &[0, 0], &[1, 1]),
        max2(&[0, 2], &[1, 1], &[0, 0], &[1, 1]),
        max2(&[3, 2], &[1, 1], &[2, 0], &[1, 1]),
    ] {
        let e = err(&op, std::slice::from_ref(&x));
        assert!(matches!(e, OpError::Attribute { .. }), "{e:?}");
        assert!(e.to_string().contains("pool"), "{e}");
    }
    // Shapes: window larger than the padded input, wrong rank, grad of the wrong shape.
    let op = max2(&[5, 2], &[1, 1], &[0, 0], &[1, 1]);
    let e = err(&op, std::slice::from_ref(&x));
    assert!(matches!(e, OpError::Shape { .. }), "{e:?}");
    assert!(
        e.to_string().contains("pool") && e.to_string().contains("f32[1,2,4,4]"),
        "{e}"
    );
    let e = err(&max2(&[2], &[1], &[0], &[1]), &[ty(DType::F32, &[4, 4])]);
    assert!(matches!(e, OpError::Shape { .. }), "{e:?}");
    let grad = Op::PoolGrad {
        kind: PoolKind::Max,
        kernel: vec![2, 2],
        geom: geom(&[2, 2], &[0, 0]),
    };
    let e = err(&grad, &[x.clone(), ty(DType::F32, &[1, 2, 3, 3])]);
    assert!(matches!(e, OpError::Shape { .. }), "{e:?}");
    assert!(
        e.to_string().contains("pool_grad") && e.to_string().contains("f32[1,2,3,3]"),
        "{e}"
    );
    // Dtypes: integers, mixed.
    let op = max2(&[2, 2], &[1, 1], &[0, 0], &[1, 1]);
    let e = err(&op, &[ty(DType::I64, &[1, 2, 4, 4])]);
    assert!(
        matches!(e, OpError::DType { .. }) && e.to_string().contains("i64[1,2,4,4]"),
        "{e}"
    );
    let e = err(&grad, &[x.clone(), ty(DType::F64, &[1, 2, 2, 2])]);
    assert!(matches!(e, OpError::DType { .. }), "{e:?}");
    // Arity.
    let e = err(&op, &[x.clone(), x.clone()]);
    assert!(matches!(e, OpError::Arity { .. }), "{e:?}");
}

/// `t` (channels-first) with its channels moved last.
fn to_last(t: &HostTensor) -> HostTensor {
    let perm = rustytorch_ops::Layout::ChannelsLast.from_first(t.dims().len());
    eval_cpu(&Op::Permute { perm }, &[t]).unwrap()
}

/// `op` with its geometry channels-last.
fn last(op: Op) -> Op {
    let l = rustytorch_ops::Layout::ChannelsLast;
    match op {
        Op::Pool { kind, kernel, geom } => Op::Pool {
            kind,
            kernel,
            geom: geom.with_layout(l),
        },
        Op::PoolGrad { kind, kernel, geom } => Op::PoolGrad {
            kind,
            kernel,
            geom: geom.with_layout(l),
        },
        other => other,
    }
}

/// Channels-last pooling (`[N, *spatial, C]`) and its gradient against the float64 loops, and
/// the gradient rule against finite differences.
#[test]
fn channels_last_pool_matches_reference() {
    for (i, c) in cases().iter().enumerate() {
        for kind in KINDS {
            for dtype in FLOATS {
                let x = rand_tensor(&ty(dtype, &c.x_dims()), 80 + i as u64, -1.0, 1.0);
                let g = rand_tensor(&ty(dtype, &c.out_dims()), 90 + i as u64, -1.0, 1.0);
                let (xv, gv) = (x.to_f64_vec(), g.to_f64_vec());
                let want = HostTensor::from_vec(c.reference(kind, &xv), c.out_dims()).unwrap();
                let (xl, gl) = (to_last(&x), to_last(&g));
                let got = eval_cpu(&last(c.op(kind)), &[&xl]).unwrap();
                assert_eq!(got.shape(), to_last(&want).shape());
                assert_close(
                    &got.to_f64_vec(),
                    &to_last(&want).to_f64_vec(),
                    tolerance(dtype),
                    &format!("channels-last pool {kind:?} {dtype} {c:?}"),
                );
                let want_dx =
                    HostTensor::from_vec(c.reference_grad(kind, &xv, &gv), c.x_dims()).unwrap();
                let dx = eval_cpu(&last(c.grad_op(kind)), &[&xl, &gl]).unwrap();
                assert_close(
                    &dx.to_f64_vec(),
                    &to_last(&want_dx).to_f64_vec(),
                    tolerance(dtype),
                    &format!("channels-last pool_grad {kind:?} {dtype} {c:?}"),
                );
            }
            let x = rand_tensor(&ty(DType::F64, &c.x_dims()), 95 + i as u64, -1.0, 1.0);
            gradcheck(&last(c.op(kind)), &[to_last(&x)], &[0], 97 + i as u64)
                .unwrap_or_else(|e| panic!("channels-last {kind:?} {c:?}: {e}"));
        }
    }
}
