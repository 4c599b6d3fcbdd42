//! Convolution (1-d, 2-d, 3-d; strided, padded, dilated, grouped, depthwise) and its two gradient
//! ops against direct float64 loops, their errors, and gradchecks of the rules.

use rustytorch_ops::testing::{assert_close, gradcheck, rand_tensor, tolerance};
use rustytorch_ops::{
    eval_cpu, infer, ConvGeom, DType, HostTensor, Layout, Op, OpError, Shape, TensorType,
};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

fn ty(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, dims.to_vec())
}

/// A convolution case: x [n, c, *ins], w [o, c/groups, *ks].
#[derive(Clone, Debug)]
struct Case {
    n: usize,
    c: usize,
    o: usize,
    groups: usize,
    ins: Vec<usize>,
    ks: Vec<usize>,
    stride: Vec<usize>,
    pad: Vec<usize>,
    dil: Vec<usize>,
    bias: bool,
}

impl Case {
    fn geom(&self) -> ConvGeom {
        ConvGeom::new(self.stride.clone(), self.pad.clone(), self.dil.clone())
    }
    fn op(&self) -> Op {
        Op::Conv {
            geom: self.geom(),
            groups: self.groups,
            bias: self.bias,
            act: rustytorch_ops::Activation::None,
        }
    }
    fn x_dims(&self) -> Vec<usize> {
        [vec![self.n, self.c], self.ins.clone()].concat()
    }
    fn w_dims(&self) -> Vec<usize> {
        [vec![self.o, self.c / self.groups], self.ks.clone()].concat()
    }
    fn outs(&self) -> Vec<usize> {
        (0..self.ins.len())
            .map(|i| {
                (self.ins[i] + 2 * self.pad[i] - self.dil[i] * (self.ks[i] - 1) - 1)
                    / self.stride[i]
                    + 1
            })
            .collect()
    }
    fn out_dims(&self) -> Vec<usize> {
        [vec![self.n, self.o], self.outs()].concat()
    }

    /// Calls `f(x index, w index, out index)` for every multiply-add of the convolution, by
    /// direct loops over every output, channel and kernel tap.
    fn visit(&self, mut f: impl FnMut(usize, usize, usize)) {
        let s = self.ins.len();
        let (cg, og) = (self.c / self.groups, self.o / self.groups);
        let outs = self.outs();
        let out_sp: usize = outs.iter().product();
        let k_sp: usize = self.ks.iter().product();
        let in_sp: usize = self.ins.iter().product();
        for n in 0..self.n {
            for o in 0..self.o {
                let g = o / og;
                for op in 0..out_sp {
                    let oi = unravel(op, &outs);
                    for ci in 0..cg {
                        let c = g * cg + ci;
                        'tap: for kp in 0..k_sp {
                            let ki = unravel(kp, &self.ks);
                            let mut xi = vec![0; s];
                            for d in 0..s {
                                let p = (oi[d] * self.stride[d] + ki[d] * self.dil[d]) as isize
                                    - self.pad[d] as isize;
                                if p < 0 || p >= self.ins[d] as isize {
                                    continue 'tap;
                                }
                                xi[d] = p as usize;
                            }
                            let x_at = (n * self.c + c) * in_sp + ravel(&xi, &self.ins);
                            let w_at = (o * cg + ci) * k_sp + kp;
                            let y_at = (n * self.o + o) * out_sp + op;
                            f(x_at, w_at, y_at);
                        }
                    }
                }
            }
        }
    }

    fn reference(&self, x: &[f64], w: &[f64], b: Option<&[f64]>) -> Vec<f64> {
        let out_sp: usize = self.outs().iter().product();
        let mut y = vec![0.0; self.n * self.o * out_sp];
        if let Some(b) = b {
            for (i, v) in y.iter_mut().enumerate() {
                *v = b[(i / out_sp) % self.o];
            }
        }
        self.visit(|xi, wi, yi| y[yi] += x[xi] * w[wi]);
        y
    }

    fn reference_dx(&self, g: &[f64], w: &[f64]) -> Vec<f64> {
        let mut dx = vec![0.0; self.x_dims().iter().product()];
        self.visit(|xi, wi, yi| dx[xi] += g[yi] * w[wi]);
        dx
    }

    fn reference_dw(&self, x: &[f64], g: &[f64]) -> Vec<f64> {
        let mut dw = vec![0.0; self.w_dims().iter().product()];
        self.visit(|xi, wi, yi| dw[wi] += g[yi] * x[xi]);
        dw
    }

    /// Random inputs x, w, [bias] of `dtype`.
    fn inputs(&self, dtype: DType, seed: u64) -> Vec<HostTensor> {
        let mut v = vec![
            rand_tensor(&ty(dtype, &self.x_dims()), seed, -1.0, 1.0),
            rand_tensor(&ty(dtype, &self.w_dims()), seed + 1, -1.0, 1.0),
        ];
        if self.bias {
            v.push(rand_tensor(&ty(dtype, &[self.o]), seed + 2, -1.0, 1.0));
        }
        v
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

#[allow(clippy::too_many_arguments)]
fn case(
    n: usize,
    c: usize,
    o: usize,
    groups: usize,
    ins: &[usize],
    ks: &[usize],
    stride: &[usize],
    pad: &[usize],
    dil: &[usize],
    bias: bool,
) -> Case {
    Case {
        n,
        c,
        o,
        groups,
        ins: ins.to_vec(),
        ks: ks.to_vec(),
        stride: stride.to_vec(),
        pad: pad.to_vec(),
        dil: dil.to_vec(),
        bias,
    }
}

/// Small cases covering every rank, stride > 1, padding, dilation > 1, groups, depthwise,
/// pointwise, odd sizes, with and without bias.
fn cases() -> Vec<Case> {
    vec![
        // 1-d, grouped, strided, padded, dilated.
        case(2, 4, 6, 2, &[11], &[3], &[2], &[1], &[2], true),
        // 1-d, stride larger than the kernel, no padding.
        case(3, 3, 2, 1, &[13], &[2], &[3], &[0], &[1], false),
        // 2-d, mixed strides and dilations.
        case(
            2,
            3,
            4,
            1,
            &[7, 9],
            &[3, 2],
            &[2, 1],
            &[1, 0],
            &[1, 2],
            true,
        ),
        // 2-d depthwise.
        case(
            1,
            4,
            4,
            4,
            &[6, 5],
            &[3, 3],
            &[1, 2],
            &[1, 1],
            &[1, 1],
            false,
        ),
        // 2-d depthwise with channel multiplier 2.
        case(
            2,
            3,
            6,
            3,
            &[5, 7],
            &[3, 3],
            &[2, 2],
            &[2, 1],
            &[2, 1],
            true,
        ),
        // 2-d pointwise (1×1, stride 1, no padding: no unfold).
        case(
            2,
            5,
            3,
            1,
            &[4, 3],
            &[1, 1],
            &[1, 1],
            &[0, 0],
            &[1, 1],
            true,
        ),
        // 1×1 kernel with stride and padding.
        case(
            1,
            2,
            3,
            1,
            &[5, 5],
            &[1, 1],
            &[2, 2],
            &[1, 1],
            &[1, 1],
            false,
        ),
        // 3-d, grouped, every feature.
        case(
            2,
            4,
            2,
            2,
            &[5, 6, 4],
            &[2, 3, 2],
            &[2, 1, 2],
            &[1, 1, 0],
            &[1, 2, 1],
            true,
        ),
        // 3-d, kernel covering the padded input exactly (one output).
        case(
            1,
            2,
            3,
            1,
            &[3, 2, 3],
            &[3, 4, 5],
            &[1, 1, 1],
            &[0, 1, 1],
            &[1, 1, 1],
            false,
        ),
    ]
}

fn check_forward(c: &Case, dtype: DType, seed: u64) {
    let ins = c.inputs(dtype, seed);
    let f: Vec<Vec<f64>> = ins.iter().map(|t| t.to_f64_vec()).collect();
    let want = c.reference(&f[0], &f[1], f.get(2).map(|v| &v[..]));
    let refs: Vec<&HostTensor> = ins.iter().collect();
    let got = eval_cpu(&c.op(), &refs).unwrap();
    assert_eq!(got.dtype(), dtype);
    assert_eq!(got.dims(), &c.out_dims()[..], "{c:?}");
    assert_close(
        &got.to_f64_vec(),
        &want,
        tolerance(dtype),
        &format!("conv {dtype} {c:?}"),
    );
}

fn check_backward(c: &Case, dtype: DType, seed: u64) {
    let ins = c.inputs(dtype, seed);
    let g = rand_tensor(&ty(dtype, &c.out_dims()), seed + 7, -1.0, 1.0);
    let (x, w, gv) = (ins[0].to_f64_vec(), ins[1].to_f64_vec(), g.to_f64_vec());
    let dx = eval_cpu(
        &Op::ConvGradInput {
            geom: c.geom(),
            groups: c.groups,
            input_shape: c.x_dims().into(),
        },
        &[&g, &ins[1]],
    )
    .unwrap();
    assert_eq!(dx.dtype(), dtype);
    assert_eq!(dx.dims(), &c.x_dims()[..]);
    assert_close(
        &dx.to_f64_vec(),
        &c.reference_dx(&gv, &w),
        tolerance(dtype),
        &format!("conv_grad_input {dtype} {c:?}"),
    );
    let dw = eval_cpu(
        &Op::ConvGradWeight {
            geom: c.geom(),
            groups: c.groups,
            weight_shape: c.w_dims().into(),
        },
        &[&ins[0], &g],
    )
    .unwrap();
    assert_eq!(dw.dtype(), dtype);
    assert_eq!(dw.dims(), &c.w_dims()[..]);
    assert_close(
        &dw.to_f64_vec(),
        &c.reference_dw(&x, &gv),
        tolerance(dtype),
        &format!("conv_grad_weight {dtype} {c:?}"),
    );
}

#[test]
fn conv_forward_matches_reference() {
    for (i, c) in cases().iter().enumerate() {
        for dtype in FLOATS {
            check_forward(c, dtype, 100 + i as u64);
        }
    }
}

#[test]
fn conv_grad_ops_match_reference() {
    for (i, c) in cases().iter().enumerate() {
        for dtype in FLOATS {
            check_backward(c, dtype, 200 + i as u64);
        }
    }
}

/// Sizes large enough to take the parallel paths (over the batch, and inside GEMM for one image).
#[test]
fn conv_parallel_paths_match_reference() {
    let batched = case(
        8,
        8,
        16,
        2,
        &[18, 17],
        &[3, 3],
        &[1, 1],
        &[1, 1],
        &[1, 1],
        true,
    );
    let single = case(
        1,
        16,
        32,
        1,
        &[24, 23],
        &[3, 3],
        &[1, 1],
        &[1, 1],
        &[1, 1],
        false,
    );
    for c in [batched, single] {
        check_forward(&c, DType::F32, 300);
        check_backward(&c, DType::F64, 301);
    }
}

#[test]
fn conv_gradcheck() {
    let checks = [
        case(2, 4, 2, 2, &[9], &[3], &[2], &[1], &[2], true),
        case(
            1,
            2,
            4,
            2,
            &[6, 5],
            &[3, 2],
            &[2, 1],
            &[1, 1],
            &[1, 2],
            true,
        ),
        case(
            2,
            3,
            3,
            3,
            &[5, 4],
            &[3, 3],
            &[2, 2],
            &[1, 1],
            &[1, 1],
            false,
        ),
        case(
            1,
            2,
            2,
            1,
            &[4, 5, 3],
            &[2, 3, 2],
            &[2, 1, 1],
            &[1, 1, 0],
            &[1, 2, 1],
            true,
        ),
    ];
    for (i, c) in checks.iter().enumerate() {
        let ins = c.inputs(DType::F64, 400 + i as u64);
        let all: Vec<usize> = (0..ins.len()).collect();
        gradcheck(&c.op(), &ins, &all, 500 + i as u64).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    }
}

/// The gradient ops are linear in each input; their own rules are checked too.
#[test]
fn conv_grad_ops_gradcheck() {
    let checks = [
        case(2, 4, 2, 2, &[9], &[3], &[2], &[1], &[2], false),
        case(
            1,
            2,
            4,
            2,
            &[6, 5],
            &[3, 2],
            &[2, 1],
            &[1, 1],
            &[1, 2],
            false,
        ),
        case(
            1,
            2,
            2,
            1,
            &[4, 5, 3],
            &[2, 3, 2],
            &[2, 1, 1],
            &[1, 1, 0],
            &[1, 2, 1],
            false,
        ),
    ];
    for (i, c) in checks.iter().enumerate() {
        let ins = c.inputs(DType::F64, 600 + i as u64);
        let g = rand_tensor(&ty(DType::F64, &c.out_dims()), 700 + i as u64, -1.0, 1.0);
        let dx_op = Op::ConvGradInput {
            geom: c.geom(),
            groups: c.groups,
            input_shape: c.x_dims().into(),
        };
        gradcheck(
            &dx_op,
            &[g.clone(), ins[1].clone()],
            &[0, 1],
            800 + i as u64,
        )
        .unwrap_or_else(|e| panic!("{c:?}: {e}"));
        let dw_op = Op::ConvGradWeight {
            geom: c.geom(),
            groups: c.groups,
            weight_shape: c.w_dims().into(),
        };
        gradcheck(&dw_op, &[ins[0].clone(), g], &[0, 1], 900 + i as u64)
            .unwrap_or_else(|e| panic!("{c:?}: {e}"));
    }
}

fn geom(stride: &[usize], padding: &[usize], dilation: &[usize]) -> ConvGeom {
    ConvGeom::new(stride.to_vec(), padding.to_vec(), dilation.to_vec())
}

fn conv2d(groups: usize, bias: bool) -> Op {
    Op::Conv {
        geom: geom(&[1, 1], &[0, 0], &[1, 1]),
        groups,
        bias,
        act: rustytorch_ops::Activation::None,
    }
}

/// Runs inference and returns the error text, asserting it is an error of the expected kind.
fn err_text(op: &Op, inputs: &[TensorType], kind: fn(&OpError) -> bool) -> String {
    let refs: Vec<&TensorType> = inputs.iter().collect();
    let e = infer(op, &refs).expect_err("inference should fail");
    assert!(kind(&e), "unexpected error kind: {e:?}");
    e.to_string()
}

#[test]
fn conv_shape_errors_name_op_and_shapes() {
    let x = ty(DType::F32, &[2, 4, 5, 5]);
    let is_shape = |e: &OpError| matches!(e, OpError::Shape { .. });
    // Kernel larger than the padded input.
    let t = err_text(
        &conv2d(1, false),
        &[x.clone(), ty(DType::F32, &[3, 4, 6, 3])],
        is_shape,
    );
    assert!(
        t.contains("conv") && t.contains("f32[2,4,5,5]") && t.contains("f32[3,4,6,3]"),
        "{t}"
    );
    // Channel mismatch.
    let t = err_text(
        &conv2d(1, false),
        &[x.clone(), ty(DType::F32, &[3, 3, 2, 2])],
        is_shape,
    );
    assert!(t.contains("f32[3,3,2,2]"), "{t}");
    // Groups not dividing the output channels.
    let t = err_text(
        &conv2d(2, false),
        &[x.clone(), ty(DType::F32, &[3, 2, 2, 2])],
        is_shape,
    );
    assert!(t.contains("groups"), "{t}");
    // Groups not dividing the input channels.
    let t = err_text(
        &conv2d(3, false),
        &[x.clone(), ty(DType::F32, &[3, 1, 2, 2])],
        is_shape,
    );
    assert!(t.contains("groups"), "{t}");
    // Weight rank differs from the input's.
    err_text(
        &conv2d(1, false),
        &[x.clone(), ty(DType::F32, &[3, 4, 2])],
        is_shape,
    );
    // Input rank outside 3..=5.
    err_text(
        &Op::Conv {
            geom: geom(&[1], &[0], &[1]),
            groups: 1,
            bias: false,
            act: rustytorch_ops::Activation::None,
        },
        &[ty(DType::F32, &[4, 5]), ty(DType::F32, &[3, 4, 2])],
        is_shape,
    );
    // Bias of the wrong length.
    let t = err_text(
        &conv2d(1, true),
        &[
            x.clone(),
            ty(DType::F32, &[3, 4, 2, 2]),
            ty(DType::F32, &[4]),
        ],
        is_shape,
    );
    assert!(t.contains("bias") && t.contains("f32[4]"), "{t}");
    // Absurd dilation: an error (the attribute limit names it), not an overflow.
    let t = err_text(
        &Op::Conv {
            geom: geom(&[1, 1], &[0, 0], &[usize::MAX, 1]),
            groups: 1,
            bias: false,
            act: rustytorch_ops::Activation::None,
        },
        &[x.clone(), ty(DType::F32, &[3, 4, 2, 2])],
        |e| matches!(e, OpError::Shape { .. } | OpError::Attribute { .. }),
    );
    assert!(t.contains("conv") && t.contains("dilation"), "{t}");
    // Gradient ops: grad_out not matching the convolution's output.
    let t = err_text(
        &Op::ConvGradInput {
            geom: geom(&[1, 1], &[0, 0], &[1, 1]),
            groups: 1,
            input_shape: vec![2, 4, 5, 5].into(),
        },
        &[ty(DType::F32, &[2, 3, 3, 3]), ty(DType::F32, &[3, 4, 2, 2])],
        is_shape,
    );
    assert!(
        t.contains("conv_grad_input") && t.contains("f32[2,3,3,3]"),
        "{t}"
    );
    let t = err_text(
        &Op::ConvGradWeight {
            geom: geom(&[1, 1], &[0, 0], &[1, 1]),
            groups: 1,
            weight_shape: vec![3, 4, 2, 2].into(),
        },
        &[x.clone(), ty(DType::F32, &[2, 3, 5, 5])],
        is_shape,
    );
    assert!(
        t.contains("conv_grad_weight") && t.contains("f32[2,3,5,5]"),
        "{t}"
    );
}

#[test]
fn conv_dtype_errors() {
    let is_dtype = |e: &OpError| matches!(e, OpError::DType { .. });
    let t = err_text(
        &conv2d(1, false),
        &[ty(DType::F32, &[1, 2, 4, 4]), ty(DType::F16, &[2, 2, 2, 2])],
        is_dtype,
    );
    assert!(
        t.contains("conv") && t.contains("f32[1,2,4,4]") && t.contains("f16[2,2,2,2]"),
        "{t}"
    );
    let t = err_text(
        &conv2d(1, false),
        &[ty(DType::I32, &[1, 2, 4, 4]), ty(DType::I32, &[2, 2, 2, 2])],
        is_dtype,
    );
    assert!(t.contains("i32[1,2,4,4]"), "{t}");
    err_text(
        &conv2d(1, true),
        &[
            ty(DType::F64, &[1, 2, 4, 4]),
            ty(DType::F64, &[2, 2, 2, 2]),
            ty(DType::F32, &[2]),
        ],
        is_dtype,
    );
}

#[test]
fn conv_attribute_and_arity_errors() {
    let is_attr = |e: &OpError| matches!(e, OpError::Attribute { .. });
    let ins = [ty(DType::F32, &[1, 2, 4, 4]), ty(DType::F32, &[2, 2, 2, 2])];
    let bad = [
        geom(&[1], &[0, 0], &[1, 1]),
        geom(&[1, 1], &[0, 0, 0], &[1, 1]),
        geom(&[1, 1], &[0, 0], &[1]),
        geom(&[0, 1], &[0, 0], &[1, 1]),
        geom(&[1, 1], &[0, 0], &[1, 0]),
    ];
    for g in bad {
        let t = err_text(
            &Op::Conv {
                geom: g,
                groups: 1,
                bias: false,
                act: rustytorch_ops::Activation::None,
            },
            &ins,
            is_attr,
        );
        assert!(t.contains("conv"), "{t}");
    }
    err_text(&conv2d(0, false), &ins, is_attr);
    let is_arity = |e: &OpError| matches!(e, OpError::Arity { .. });
    err_text(&conv2d(1, true), &ins, is_arity);
    err_text(&conv2d(1, false), &ins[..1], is_arity);
}

// ---------------------------------------------------------------- channels-last

/// `t` (channels-first) with its channels moved last.
fn to_last(t: &HostTensor) -> HostTensor {
    let perm = Layout::ChannelsLast.from_first(t.dims().len());
    eval_cpu(&Op::Permute { perm }, &[t]).unwrap()
}

/// A channels-first float64 reference `v` of shape `dims`, channels moved last.
fn reference_last(v: Vec<f64>, dims: &[usize]) -> Vec<f64> {
    to_last(&HostTensor::from_vec(v, dims.to_vec()).unwrap()).to_f64_vec()
}

fn last_dims(dims: &[usize]) -> Shape {
    Shape::new(Layout::ChannelsLast.dims_from_first(dims))
}

/// The channels-last ops (activations `[N, *spatial, C]`, weights `[O, *kernel, C/groups]`)
/// against the float64 loops, their results reordered channels-last.
#[test]
fn channels_last_conv_ops_match_reference() {
    for (i, c) in cases().iter().enumerate() {
        let geom = c.geom().with_layout(Layout::ChannelsLast);
        for dtype in FLOATS {
            let seed = 1100 + i as u64;
            let ins = c.inputs(dtype, seed);
            let f: Vec<Vec<f64>> = ins.iter().map(|t| t.to_f64_vec()).collect();
            let (x, w) = (to_last(&ins[0]), to_last(&ins[1]));
            let mut args = vec![&x, &w];
            args.extend(ins.get(2));
            let op = Op::Conv {
                geom: geom.clone(),
                groups: c.groups,
                bias: c.bias,
                act: rustytorch_ops::Activation::None,
            };
            let got = eval_cpu(&op, &args).unwrap();
            assert_eq!(got.shape(), &last_dims(&c.out_dims()), "{c:?}");
            let want = c.reference(&f[0], &f[1], f.get(2).map(|v| &v[..]));
            let what = format!("channels-last conv {dtype} {c:?}");
            assert_close(
                &got.to_f64_vec(),
                &reference_last(want, &c.out_dims()),
                tolerance(dtype),
                &what,
            );
            let g = rand_tensor(&ty(dtype, &c.out_dims()), seed + 7, -1.0, 1.0);
            let gv = g.to_f64_vec();
            let g = to_last(&g);
            let dx_op = Op::ConvGradInput {
                geom: geom.clone(),
                groups: c.groups,
                input_shape: last_dims(&c.x_dims()),
            };
            let dx = eval_cpu(&dx_op, &[&g, &w]).unwrap();
            assert_close(
                &dx.to_f64_vec(),
                &reference_last(c.reference_dx(&gv, &f[1]), &c.x_dims()),
                tolerance(dtype),
                &format!("{what} grad input"),
            );
            let dw_op = Op::ConvGradWeight {
                geom: geom.clone(),
                groups: c.groups,
                weight_shape: last_dims(&c.w_dims()),
            };
            let dw = eval_cpu(&dw_op, &[&x, &g]).unwrap();
            assert_close(
                &dw.to_f64_vec(),
                &reference_last(c.reference_dw(&f[0], &gv), &c.w_dims()),
                tolerance(dtype),
                &format!("{what} grad weight"),
            );
        }
    }
}

/// The gradient rules of channels-last convolutions (channels-last gradient ops, the bias
/// summed over every dim but the last) against finite differences.
#[test]
fn channels_last_conv_gradcheck() {
    let checks = [
        case(2, 4, 2, 2, &[9], &[3], &[2], &[1], &[2], true),
        case(
            1,
            2,
            4,
            2,
            &[6, 5],
            &[3, 2],
            &[2, 1],
            &[1, 1],
            &[1, 2],
            true,
        ),
        case(
            1,
            2,
            2,
            1,
            &[4, 5, 3],
            &[2, 3, 2],
            &[2, 1, 1],
            &[1, 1, 0],
            &[1, 2, 1],
            true,
        ),
    ];
    for (i, c) in checks.iter().enumerate() {
        let geom = c.geom().with_layout(Layout::ChannelsLast);
        let ins = c.inputs(DType::F64, 1200 + i as u64);
        let (x, w, b) = (to_last(&ins[0]), to_last(&ins[1]), ins[2].clone());
        let op = Op::Conv {
            geom: geom.clone(),
            groups: c.groups,
            bias: true,
            act: rustytorch_ops::Activation::None,
        };
        gradcheck(&op, &[x.clone(), w.clone(), b], &[0, 1, 2], 1300 + i as u64)
            .unwrap_or_else(|e| panic!("{c:?}: {e}"));
        let g = to_last(&rand_tensor(
            &ty(DType::F64, &c.out_dims()),
            1400 + i as u64,
            -1.0,
            1.0,
        ));
        let dx_op = Op::ConvGradInput {
            geom: geom.clone(),
            groups: c.groups,
            input_shape: x.shape().clone(),
        };
        gradcheck(&dx_op, &[g.clone(), w.clone()], &[0, 1], 1500 + i as u64)
            .unwrap_or_else(|e| panic!("{c:?}: {e}"));
        let dw_op = Op::ConvGradWeight {
            geom,
            groups: c.groups,
            weight_shape: w.shape().clone(),
        };
        gradcheck(&dw_op, &[x, g], &[0, 1], 1600 + i as u64)
            .unwrap_or_else(|e| panic!("{c:?}: {e}"));
    }
}

/// A channels-first operand given to a channels-last op is refused with both shapes named.
#[test]
fn channels_last_shape_errors() {
    let op = Op::Conv {
        geom: geom(&[1, 1], &[0, 0], &[1, 1]).with_layout(Layout::ChannelsLast),
        groups: 1,
        bias: false,
        act: rustytorch_ops::Activation::None,
    };
    // x [1, 5, 5, 4] (NHWC, C = 4), w as OIHW [8, 4, 3, 3]: read as OHWI, C/groups = 3.
    let e = err_text(
        &op,
        &[ty(DType::F32, &[1, 5, 5, 4]), ty(DType::F32, &[8, 4, 3, 3])],
        |e| matches!(e, OpError::Shape { .. }),
    );
    assert!(e.contains("[8,4,3,3]") || e.contains("[8, 4, 3, 3]"), "{e}");
    let ok = infer(
        &op,
        &[
            &ty(DType::F32, &[1, 5, 5, 4]),
            &ty(DType::F32, &[8, 3, 3, 4]),
        ],
    )
    .unwrap();
    assert_eq!(ok.shape.dims(), &[1, 3, 3, 8]);
}

/// `act` in float64.
fn act_ref(act: rustytorch_ops::Activation, x: f64) -> f64 {
    use rustytorch_ops::Activation;
    match act {
        Activation::None => x,
        Activation::Relu => x.max(0.0),
        Activation::GeluErf => 0.5 * x * erfc_ref(-x / std::f64::consts::SQRT_2),
        Activation::GeluTanh => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
        }
    }
}

/// erfc in float64: its Taylor series (1 - erf) below 1.5, Laplace's continued fraction above.
fn erfc_ref(x: f64) -> f64 {
    if x < 0.0 {
        return 2.0 - erfc_ref(-x);
    }
    if x < 1.5 {
        let (mut sum, mut term) = (0.0, x);
        for n in 0..200 {
            sum += term / (2 * n + 1) as f64;
            term *= -x * x / (n + 1) as f64;
        }
        1.0 - 2.0 / std::f64::consts::PI.sqrt() * sum
    } else {
        let mut f = x;
        for k in (1..200).rev() {
            f = x + (k as f64 / 2.0) / f;
        }
        (-x * x).exp() / std::f64::consts::PI.sqrt() / f
    }
}

const ACTS: [rustytorch_ops::Activation; 3] = [
    rustytorch_ops::Activation::Relu,
    rustytorch_ops::Activation::GeluErf,
    rustytorch_ops::Activation::GeluTanh,
];

/// A convolution with an activation (both layouts) against the float64 loops followed by the
/// activation in float64.
#[test]
fn conv_act_matches_reference() {
    for (i, c) in cases().iter().enumerate() {
        for (j, act) in ACTS.into_iter().enumerate() {
            for dtype in FLOATS {
                let seed = 1500 + 10 * i as u64 + j as u64;
                let ins = c.inputs(dtype, seed);
                let f: Vec<Vec<f64>> = ins.iter().map(|t| t.to_f64_vec()).collect();
                let want: Vec<f64> = c
                    .reference(&f[0], &f[1], f.get(2).map(|v| &v[..]))
                    .into_iter()
                    .map(|v| act_ref(act, v))
                    .collect();
                // The activation really changes the values (the test can fail).
                assert!(want
                    .iter()
                    .zip(&c.reference(&f[0], &f[1], f.get(2).map(|v| &v[..])))
                    .any(|(a, b)| a != b));
                let op = Op::Conv {
                    geom: c.geom(),
                    groups: c.groups,
                    bias: c.bias,
                    act,
                };
                let refs: Vec<&HostTensor> = ins.iter().collect();
                let got = eval_cpu(&op, &refs).unwrap();
                let what = format!("conv[{act:?}] {dtype} {c:?}");
                assert_close(&got.to_f64_vec(), &want, tolerance(dtype), &what);
                // Channels-last.
                let (x, w) = (to_last(&ins[0]), to_last(&ins[1]));
                let mut args = vec![&x, &w];
                args.extend(ins.get(2));
                let op = Op::Conv {
                    geom: c.geom().with_layout(Layout::ChannelsLast),
                    groups: c.groups,
                    bias: c.bias,
                    act,
                };
                let got = eval_cpu(&op, &args).unwrap();
                assert_close(
                    &got.to_f64_vec(),
                    &reference_last(want, &c.out_dims()),
                    tolerance(dtype),
                    &format!("channels-last {what}"),
                );
            }
        }
    }
}

/// The activation's gradient goes through the recomputed pre-activation, then the convolution.
#[test]
fn conv_act_gradcheck() {
    let checks = [
        case(2, 4, 2, 2, &[9], &[3], &[2], &[1], &[2], true),
        case(
            1,
            2,
            4,
            1,
            &[6, 5],
            &[3, 2],
            &[2, 1],
            &[1, 1],
            &[1, 2],
            true,
        ),
        case(
            1,
            2,
            2,
            1,
            &[4, 5, 3],
            &[2, 3, 2],
            &[2, 1, 1],
            &[1, 1, 0],
            &[1, 2, 1],
            false,
        ),
    ];
    for (i, c) in checks.iter().enumerate() {
        for (j, act) in ACTS.into_iter().enumerate() {
            for layout in [Layout::ChannelsFirst, Layout::ChannelsLast] {
                let mut ins = c.inputs(DType::F64, 2000 + 10 * i as u64 + j as u64);
                if layout == Layout::ChannelsLast {
                    ins[0] = to_last(&ins[0]);
                    ins[1] = to_last(&ins[1]);
                }
                let op = Op::Conv {
                    geom: c.geom().with_layout(layout),
                    groups: c.groups,
                    bias: c.bias,
                    act,
                };
                let all: Vec<usize> = (0..ins.len()).collect();
                gradcheck(&op, &ins, &all, 2100 + i as u64)
                    .unwrap_or_else(|e| panic!("{act:?} {layout:?} {c:?}: {e}"));
            }
        }
    }
}
