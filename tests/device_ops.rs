//! Every op family on CUDA against the CPU kernels (themselves checked against float64
//! references in `ops/tests`), on random inputs: all dtypes each op accepts, broadcasting, odd
//! sizes, rows longer than a block. On CUDA where `RUSTYTORCH_TEST_CUDA=1` (the GPU machine; there
//! a missing GPU fails); elsewhere through the CPU executable, which keeps every case valid.
//!
//! Tolerances, stated once: [`tol`].

use rustytorch::compiler::Graph;
use rustytorch::ops::testing::{assert_close, rand_tensor};
use rustytorch::ops::{
    eval_cpu, Activation, ArgKind, BinaryOp, ConvGeom, F64Bits, Op, ReduceKind, Reduction, UnaryOp,
};
use rustytorch::prelude::*;

#[path = "common/one_op.rs"]
mod one_op;

fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

/// CUDA on the GPU machine; elsewhere the CPU executable path.
fn device() -> Device {
    if cuda() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    }
}

/// Absolute+relative tolerance of a device result against the CPU kernel's, per dtype: both round
/// once per op, but accumulation order and the device's math library differ by a few ulps (f32
/// `expf` is within 2 ulp), so f32 allows 1e-4 and f16/bf16 one or two units of their last place.
fn tol(d: DType) -> f64 {
    match d {
        DType::F64 => 1e-9,
        DType::F32 => 1e-4,
        DType::F16 => 4e-3,
        DType::BF16 => 2e-2,
        _ => 0.0,
    }
}

/// Every dtype the test device computes in (on CUDA, the integer types it refuses with an error
/// naming the op are left out: `codegen::cuda::ir::dtype_supported`).
fn dtypes() -> impl Iterator<Item = DType> {
    DType::ALL
        .into_iter()
        .filter(|&d| !cuda() || rustytorch::codegen::cuda::ir::dtype_supported(d))
}

fn t(d: DType, dims: &[usize]) -> TensorType {
    TensorType::new(d, Shape::new(dims.to_vec()))
}

/// Runs `op` over `inputs` on the test device and with the CPU kernel, and compares.
fn check(what: &str, op: Op, inputs: Vec<HostTensor>) {
    check_scaled(what, op, inputs, false)
}

/// [`check`]; with `scaled`, errors are measured against the output's largest magnitude (at
/// least 1) rather than each element's own: convolutions sum many products, and some of cuDNN's
/// algorithms (Winograd, FFT, split reductions) round partial sums to f16/bf16, so an output near
/// zero after cancellation carries an error of the summands' size, not its own.
fn check_scaled(what: &str, op: Op, inputs: Vec<HostTensor>, scaled: bool) {
    let refs: Vec<&HostTensor> = inputs.iter().collect();
    let want = eval_cpu(&op, &refs).unwrap_or_else(|e| panic!("{what}: cpu: {e}"));
    let want_dtype = want.dtype();
    let got = one_op::run_one_op(&op, &inputs, device()).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(got.ty(), want.ty(), "{what}: type");
    let (mut got, mut want) = (got.to_f64_vec(), want.to_f64_vec());
    if scaled {
        let s = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        for v in got.iter_mut().chain(want.iter_mut()) {
            *v /= s;
        }
    }
    assert_close(&got, &want, tol(want_dtype), &format!("{what} {op:?}"));
}

fn rnd(d: DType, dims: &[usize], seed: u64, lo: f64, hi: f64) -> HostTensor {
    rand_tensor(&t(d, dims), seed, lo, hi)
}

fn accepts(op: &Op, inputs: &[&HostTensor]) -> bool {
    let tys: Vec<TensorType> = inputs.iter().map(|x| x.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    rustytorch::ops::infer(op, &refs).is_ok()
}

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

#[test]
fn unary_ops_all_dtypes() {
    use UnaryOp::*;
    let all = [
        Neg, Abs, Exp, Log, Sqrt, Rsqrt, Reciprocal, Sin, Cos, Tanh, Sigmoid, Relu, GeluErf,
        GeluTanh, Silu, Sign, Floor, Ceil, Round, Not, IsNan, IsInf, IsFinite,
    ];
    for (k, u) in all.into_iter().enumerate() {
        for d in dtypes() {
            let (lo, hi) = match u {
                Log | Sqrt | Rsqrt => (0.05, 4.0),
                Reciprocal => (0.2, 3.0),
                _ => (-4.0, 4.0),
            };
            let x = rnd(d, &[37, 65], 100 + k as u64, lo, hi);
            if !accepts(&Op::Unary(u), &[&x]) {
                continue;
            }
            check(&format!("{u:?} {d:?}"), Op::Unary(u), vec![x]);
        }
    }
}

#[test]
fn binary_ops_broadcast_all_dtypes() {
    use BinaryOp::*;
    let all = [
        Add, Sub, Mul, Div, Pow, Maximum, Minimum, Eq, Ne, Lt, Le, Gt, Ge, And, Or,
    ];
    for (k, b) in all.into_iter().enumerate() {
        for d in dtypes() {
            let (lo, hi) = match (b, d.is_float()) {
                (Pow, true) => (0.1, 2.5),
                (Pow, false) => (-2.0, 4.0),
                _ => (-3.0, 3.0),
            };
            let x = rnd(d, &[3, 1, 5], 7 + k as u64, lo, hi);
            let y = rnd(d, &[4, 5], 99 + k as u64, lo, hi);
            if !accepts(&Op::Binary(b), &[&x, &y]) {
                continue;
            }
            check(&format!("{b:?} {d:?}"), Op::Binary(b), vec![x, y]);
        }
    }
    // A large same-shape case (many blocks, grid-stride loop).
    let x = rnd(DType::F32, &[1000, 1537], 1, -2.0, 2.0);
    let y = rnd(DType::F32, &[1000, 1537], 2, -2.0, 2.0);
    check("add large", Op::Binary(Add), vec![x, y]);
}

#[test]
fn where_and_cast() {
    for d in dtypes() {
        let c = rnd(DType::Bool, &[4, 5], 3, 0.0, 1.0);
        let a = rnd(d, &[3, 4, 5], 4, -3.0, 3.0);
        let b = rnd(d, &[5], 5, -3.0, 3.0);
        check(&format!("where {d:?}"), Op::Where, vec![c, a, b]);
    }
    for from in dtypes() {
        for to in dtypes() {
            let x = rnd(from, &[17, 33], 11, -300.0, 300.0);
            check(&format!("cast {from:?}->{to:?}"), Op::Cast { to }, vec![x]);
        }
    }
}

#[test]
fn reductions() {
    use ReduceKind::*;
    let shapes: [&[usize]; 3] = [&[6, 7, 9], &[3, 2000], &[4097]];
    for kind in [Sum, Mean, Max, Min, Prod, Any, All] {
        for d in dtypes() {
            for (si, dims) in shapes.iter().enumerate() {
                let rank = dims.len();
                let mut axes_sets: Vec<Vec<usize>> = (0..rank).map(|a| vec![a]).collect();
                if rank > 1 {
                    axes_sets.push((0..rank).collect());
                }
                if rank == 3 {
                    axes_sets.push(vec![0, 2]);
                }
                for axes in axes_sets {
                    for keep_dims in [false, true] {
                        let op = Op::Reduce {
                            kind,
                            axes: axes.clone(),
                            keep_dims,
                        };
                        let (lo, hi) = if kind == Prod {
                            (0.8, 1.2)
                        } else {
                            (-2.0, 2.0)
                        };
                        let x = rnd(d, dims, 20 + si as u64, lo, hi);
                        if !accepts(&op, &[&x]) {
                            continue;
                        }
                        check(&format!("{kind:?} {d:?} {dims:?} {axes:?}"), op, vec![x]);
                    }
                }
            }
        }
    }
    for kind in [ArgKind::ArgMax, ArgKind::ArgMin] {
        for d in [DType::F32, DType::F16, DType::I32, DType::I64, DType::U8] {
            for axis in 0..3 {
                let op = Op::ArgReduce {
                    kind,
                    axis,
                    keep_dims: axis == 1,
                };
                let x = rnd(d, &[5, 70, 9], 31, -50.0, 50.0);
                if !accepts(&op, &[&x]) {
                    continue;
                }
                check(&format!("{kind:?} {d:?} axis {axis}"), op, vec![x]);
            }
        }
    }
}

#[test]
fn softmax_and_norms() {
    for d in FLOATS {
        for dims in [&[4usize, 7, 33][..], &[3, 3000], &[65, 5]] {
            for axis in 0..dims.len() {
                let x = rnd(d, dims, 41, -5.0, 5.0);
                let what = format!("{d:?} {dims:?} axis {axis}");
                check(
                    &format!("softmax {what}"),
                    Op::Softmax { axis },
                    vec![x.clone()],
                );
                check(
                    &format!("log_softmax {what}"),
                    Op::LogSoftmax { axis },
                    vec![x],
                );
            }
            let n = *dims.last().unwrap();
            let x = rnd(d, dims, 42, -3.0, 3.0);
            let w = rnd(d, &[n], 43, 0.5, 1.5);
            let b = rnd(d, &[n], 44, -0.5, 0.5);
            let eps = F64Bits::new(1e-5);
            let ln = |weight, bias| Op::LayerNorm { eps, weight, bias };
            check(
                &format!("layer_norm {d:?} {dims:?}"),
                ln(true, true),
                vec![x.clone(), w.clone(), b],
            );
            check(
                &format!("layer_norm plain {d:?} {dims:?}"),
                ln(false, false),
                vec![x.clone()],
            );
            let rms = Op::RmsNorm { eps, weight: true };
            check(&format!("rms_norm {d:?} {dims:?}"), rms, vec![x, w]);
        }
    }
}

#[test]
fn movement() {
    for d in dtypes() {
        let x = rnd(d, &[5, 6, 7], 51, -9.0, 9.0);
        let perm = |p: &[usize]| Op::Permute { perm: p.to_vec() };
        check(&format!("permute {d:?}"), perm(&[2, 0, 1]), vec![x.clone()]);
        check(
            &format!("transpose {d:?}"),
            perm(&[0, 2, 1]),
            vec![x.clone()],
        );
        let slice = Op::Slice {
            starts: vec![1, 0, 2],
            ends: vec![5, 6, 7],
            steps: vec![2, 1, 3],
        };
        check(&format!("slice {d:?}"), slice, vec![x.clone()]);
        let pad = Op::Pad {
            pads: vec![(1, 0), (0, 2), (3, 1)],
            value: F64Bits::new(1.0),
        };
        check(&format!("pad {d:?}"), pad, vec![x.clone()]);
        let reshape = Op::Reshape {
            shape: Shape::new(vec![30, 7]),
        };
        check(&format!("reshape {d:?}"), reshape, vec![x.clone()]);
        let y = rnd(d, &[5, 2, 7], 52, -9.0, 9.0);
        check(&format!("concat {d:?}"), Op::Concat { axis: 1 }, vec![x, y]);
        let e = rnd(d, &[1, 6, 1], 53, -9.0, 9.0);
        let expand = Op::Expand {
            shape: Shape::new(vec![4, 6, 5]),
        };
        check(&format!("expand {d:?}"), expand, vec![e]);
    }
    let big = rnd(DType::F32, &[513, 1031], 54, -1.0, 1.0);
    check(
        "transpose large",
        Op::Permute { perm: vec![1, 0] },
        vec![big],
    );
}

#[test]
fn indexing() {
    for d in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
    ] {
        for id in [DType::I32, DType::I64] {
            let x = rnd(d, &[6, 5], 61, -9.0, 9.0);
            let idx = rnd(id, &[4, 5], 62, 0.0, 6.0);
            let what = format!("{d:?} {id:?}");
            check(
                &format!("gather {what}"),
                Op::Gather { axis: 0 },
                vec![x.clone(), idx],
            );
            let sel = rnd(id, &[9], 63, 0.0, 6.0);
            let op = Op::IndexSelect { axis: 0 };
            check(
                &format!("index_select {what}"),
                op,
                vec![x.clone(), sel.clone()],
            );
            let src = rnd(d, &[9, 5], 64, -9.0, 9.0);
            let op = Op::IndexAdd { axis: 0 };
            check(&format!("index_add {what}"), op, vec![x.clone(), sel, src]);
            let sidx = rnd(id, &[4, 5], 65, 0.0, 6.0);
            let ssrc = rnd(d, &[4, 5], 66, -9.0, 9.0);
            let op = Op::ScatterAdd { axis: 0 };
            check(&format!("scatter_add {what}"), op, vec![x, sidx, ssrc]);
        }
    }
    // An embedding lookup.
    let table = rnd(DType::F32, &[1000, 64], 67, -1.0, 1.0);
    let ids = rnd(DType::I64, &[300], 68, 0.0, 1000.0);
    check("embedding", Op::IndexSelect { axis: 0 }, vec![table, ids]);
}

#[test]
fn matmuls() {
    for d in FLOATS {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let a_dims = if ta { [2, 3, 40, 33] } else { [2, 3, 33, 40] };
            let b_dims: &[usize] = if tb { &[3, 24, 40] } else { &[3, 40, 24] };
            let a = rnd(d, &a_dims, 71, -1.0, 1.0);
            let b = rnd(d, b_dims, 72, -1.0, 1.0);
            let op = Op::Matmul {
                trans_a: ta,
                trans_b: tb,
            };
            check(&format!("matmul {d:?} {ta} {tb}"), op, vec![a, b]);
        }
        // A batch broadcast that no single strided call expresses: [2,1] x [1,3].
        let a = rnd(d, &[2, 1, 8, 16], 73, -1.0, 1.0);
        let b = rnd(d, &[1, 3, 16, 8], 74, -1.0, 1.0);
        let op = Op::Matmul {
            trans_a: false,
            trans_b: false,
        };
        check(&format!("matmul broadcast {d:?}"), op, vec![a, b]);
        for act in [
            Activation::None,
            Activation::Relu,
            Activation::GeluTanh,
            Activation::GeluErf,
        ] {
            let x = rnd(d, &[64, 96], 75, -1.0, 1.0);
            let w = rnd(d, &[96, 128], 76, -0.2, 0.2);
            let bias = rnd(d, &[128], 77, -0.5, 0.5);
            let op = Op::MatmulEpilogue {
                trans_a: false,
                trans_b: false,
                bias: true,
                act,
                accumulate: false,
            };
            check(
                &format!("linear {d:?} {act:?}"),
                op,
                vec![x.clone(), w, bias],
            );
            let op = Op::MatmulEpilogue {
                trans_a: false,
                trans_b: true,
                bias: false,
                act,
                accumulate: false,
            };
            let wt = rnd(d, &[128, 96], 78, -0.2, 0.2);
            check(&format!("linear no bias {d:?} {act:?}"), op, vec![x, wt]);
        }
        // An accumulated operand (cuBLASLt's C, beta 1): a residual add with a bias, and a
        // gradient summed into, batched [2,3]·[3] as one strided call and folded [2,64]·W.
        for bias in [false, true] {
            let op = Op::MatmulEpilogue {
                trans_a: false,
                trans_b: !bias,
                bias,
                act: Activation::None,
                accumulate: true,
            };
            let x = rnd(d, &[2, 64, 96], 79, -1.0, 1.0);
            let w = rnd(d, if bias { &[96, 128] } else { &[128, 96] }, 80, -0.2, 0.2);
            let c = rnd(d, &[2, 64, 128], 81, -2.0, 2.0);
            let mut ins = vec![x, w];
            if bias {
                ins.push(rnd(d, &[128], 82, -0.5, 0.5));
            }
            ins.push(c);
            check(&format!("linear accumulate bias={bias} {d:?}"), op, ins);
            let op = Op::MatmulEpilogue {
                trans_a: true,
                trans_b: false,
                bias: false,
                act: Activation::None,
                accumulate: true,
            };
            let a = rnd(d, &[3, 40, 33], 83, -1.0, 1.0);
            let b = rnd(d, &[3, 40, 24], 84, -1.0, 1.0);
            let c = rnd(d, &[3, 33, 24], 85, -2.0, 2.0);
            check(&format!("batched accumulate {d:?}"), op, vec![a, b, c]);
        }
    }
}

#[test]
fn cross_entropy_and_grad() {
    for d in FLOATS {
        for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
            for c in [10usize, 1500] {
                let logits = rnd(d, &[37, c], 81, -4.0, 4.0);
                let mut tv: Vec<i64> = rnd(DType::I64, &[37], 82, 0.0, c as f64).to_vec().unwrap();
                tv[3] = -100;
                let targets = HostTensor::from_vec(tv, [37]).unwrap();
                let what = format!("{d:?} {reduction:?} {c}");
                let op = Op::CrossEntropy {
                    reduction,
                    ignore_index: -100,
                };
                check(
                    &format!("cross_entropy {what}"),
                    op,
                    vec![logits.clone(), targets.clone()],
                );
                let gshape: &[usize] = if reduction == Reduction::None {
                    &[37]
                } else {
                    &[]
                };
                let g = rnd(d, gshape, 83, 0.5, 1.5);
                let op = Op::CrossEntropyGrad {
                    reduction,
                    ignore_index: -100,
                };
                check(
                    &format!("cross_entropy_grad {what}"),
                    op,
                    vec![logits, targets, g],
                );
            }
        }
    }
}

#[test]
fn ops_without_cuda_kernels_are_clear_errors() {
    if !cuda() {
        return;
    }
    let mut g = Graph::new();
    let x = g.add_input("x", t(DType::F32, &[4, 8])).unwrap();
    let op = Op::CumSum {
        axis: 1,
        exclusive: false,
        reverse: false,
    };
    let y = g.add(op, &[x]).unwrap();
    g.add_output("y", y).unwrap();
    let e = rustytorch::compile_graph(&g, Device::Cuda(0), &CompileOptions::default())
        .err()
        .expect("cumsum has no CUDA kernel yet");
    let msg = e.to_string();
    assert!(msg.contains("cumsum") && msg.contains("cuda"), "{msg}");
}

fn conv_geom(n: usize, stride: usize, pad: usize, dil: usize) -> ConvGeom {
    ConvGeom {
        stride: vec![stride; n],
        padding: vec![pad; n],
        dilation: vec![dil; n],
        layout: Default::default(),
    }
}

/// Convolutions through cuDNN, forward (with and without bias) and both gradients, 1-D, 2-D and
/// 3-D: groups (depthwise included), dilation, stride larger than the window, 1×1 and 7×7 windows,
/// odd and asymmetric spatial sizes, every float dtype.
#[test]
fn convolutions() {
    // (x, w, stride, padding, dilation, groups, bias)
    // Half-precision cases with channel counts that are multiples of 8 run channels-last.
    let cases: [(&[usize], &[usize], usize, usize, usize, usize, bool); 11] = [
        (&[3, 4, 37], &[6, 4, 3], 1, 1, 1, 1, true),
        (&[2, 6, 50], &[6, 2, 5], 2, 2, 3, 3, false),
        (&[2, 3, 17, 13], &[5, 3, 3, 3], 1, 1, 1, 1, true),
        (&[2, 8, 15, 16], &[8, 1, 3, 3], 2, 1, 1, 8, false),
        (&[1, 4, 9, 11], &[6, 4, 1, 1], 1, 0, 1, 1, true),
        (&[2, 3, 20, 18], &[4, 3, 7, 7], 2, 3, 1, 1, false),
        (&[1, 2, 12, 12], &[3, 2, 2, 2], 3, 0, 2, 1, false),
        (&[2, 16, 10, 9], &[32, 16, 3, 3], 1, 1, 1, 1, true),
        (&[2, 3, 6, 7, 8], &[4, 3, 3, 3, 3], 1, 1, 1, 1, true),
        (&[1, 8, 5, 6, 7], &[16, 8, 3, 3, 3], 2, 1, 1, 1, true),
        (&[2, 8, 11, 13], &[8, 8, 3, 3], 2, 2, 2, 1, false),
    ];
    for (k, &(xd, wd, s, p, d, groups, bias)) in cases.iter().enumerate() {
        let geom = conv_geom(xd.len() - 2, s, p, d);
        for (j, dt) in FLOATS.into_iter().enumerate() {
            let seed = 1000 + 10 * k as u64 + j as u64;
            let x = rnd(dt, xd, seed, -1.0, 1.0);
            let w = rnd(dt, wd, seed + 1, -1.0, 1.0);
            let fwd = Op::Conv {
                geom: geom.clone(),
                groups,
                bias,
                act: rustytorch_ops::Activation::None,
            };
            let mut ins = vec![x.clone(), w.clone()];
            if bias {
                ins.push(rnd(dt, &[wd[0]], seed + 2, -1.0, 1.0));
            }
            let what = format!("conv {xd:?} * {wd:?} {dt:?}");
            let y_ty = {
                let tys: Vec<TensorType> = ins.iter().map(|x| x.ty()).collect();
                let refs: Vec<&TensorType> = tys.iter().collect();
                rustytorch::ops::infer(&fwd, &refs).unwrap()
            };
            check_scaled(&what, fwd, ins, true);
            let gy = rand_tensor(&y_ty, seed + 3, -1.0, 1.0);
            let gi = Op::ConvGradInput {
                geom: geom.clone(),
                groups,
                input_shape: Shape::new(xd.to_vec()),
            };
            check_scaled(&format!("{what} grad input"), gi, vec![gy.clone(), w], true);
            let gw = Op::ConvGradWeight {
                geom: geom.clone(),
                groups,
                weight_shape: Shape::new(wd.to_vec()),
            };
            check_scaled(&format!("{what} grad weight"), gw, vec![x, gy], true);
        }
    }
}

/// Distinct values (`k·37 mod 251` in steps of 1/8, exact in every float dtype), so that a max
/// pool's winner, and so its gradient, is the same whatever order the device compares in.
fn distinct(d: DType, dims: &[usize], seed: u64) -> HostTensor {
    let n: usize = dims.iter().product();
    let vals: Vec<f64> = (0..n)
        .map(|i| ((i as u64 * 37 + seed) % 251) as f64 * 0.125 - 15.0)
        .collect();
    HostTensor::from_f64_slice(&t(d, dims), &vals).unwrap()
}

/// Pooling through cuDNN, forward and backward: max and both averages, 1-D, 2-D and 3-D, with
/// padding and a stride larger than the window, every float dtype.
#[test]
fn pooling() {
    use rustytorch::ops::PoolKind;
    // (x, window, stride, padding)
    let cases: [(&[usize], &[usize], usize, usize); 6] = [
        (&[3, 4, 29], &[3], 2, 1),
        (&[2, 3, 17, 13], &[3, 3], 2, 1),
        (&[2, 5, 16, 16], &[2, 2], 2, 0),
        (&[1, 2, 13, 11], &[2, 3], 4, 1),
        (&[2, 3, 7, 9, 8], &[3, 3, 3], 2, 1),
        (&[2, 64, 14, 14], &[3, 3], 1, 1),
    ];
    let kinds = [
        PoolKind::Max,
        PoolKind::Avg {
            count_include_pad: true,
        },
        PoolKind::Avg {
            count_include_pad: false,
        },
    ];
    for (k, &(xd, window, s, p)) in cases.iter().enumerate() {
        let geom = conv_geom(xd.len() - 2, s, p, 1);
        for kind in kinds {
            for (j, dt) in FLOATS.into_iter().enumerate() {
                let seed = 2000 + 10 * k as u64 + j as u64;
                let x = distinct(dt, xd, seed);
                let fwd = Op::Pool {
                    kind,
                    kernel: window.to_vec(),
                    geom: geom.clone(),
                };
                let y_ty = rustytorch::ops::infer(&fwd, &[&x.ty()]).unwrap();
                let what = format!("pool {kind:?} {xd:?} window {window:?} {dt:?}");
                check(&what, fwd, vec![x.clone()]);
                let gy = rand_tensor(&y_ty, seed + 1, -1.0, 1.0);
                let bwd = Op::PoolGrad {
                    kind,
                    kernel: window.to_vec(),
                    geom: geom.clone(),
                };
                check(&format!("{what} grad"), bwd, vec![x, gy]);
            }
        }
    }
}

/// A fused elementwise chain `tanh(silu(a)·b + 0.5·a)·2` (what the optimizer makes of it) in 16-byte
/// vectors with a scalar tail, every float dtype; f16/bf16 through the hardware approximations.
#[test]
fn fused_chains_in_vectors() {
    use rustytorch::ops::{FusedInstr, FusedKernel};
    let ins = |op: Op, args: &[u32], dtype: DType| FusedInstr {
        op,
        args: args.to_vec(),
        dtype,
    };
    for d in FLOATS {
        for dims in [&[64usize, 4096][..], &[3, 1001]] {
            let full = |v: f64| {
                ins(
                    Op::Full {
                        value: F64Bits::new(v),
                        ty: t(d, &[]),
                    },
                    &[],
                    d,
                )
            };
            let k = FusedKernel {
                n_inputs: 2,
                instrs: vec![
                    ins(Op::Unary(UnaryOp::Silu), &[0], d),
                    ins(Op::Binary(BinaryOp::Mul), &[2, 1], d),
                    full(0.5),
                    ins(Op::Binary(BinaryOp::Mul), &[4, 0], d),
                    ins(Op::Binary(BinaryOp::Add), &[3, 5], d),
                    ins(Op::Unary(UnaryOp::Tanh), &[6], d),
                    full(2.0),
                    ins(Op::Binary(BinaryOp::Mul), &[7, 8], d),
                ],
                out: t(d, dims),
            };
            let a = rnd(d, dims, 71, -6.0, 6.0);
            let b = rnd(d, dims, 72, -3.0, 3.0);
            check(
                &format!("chain {d:?} {dims:?}"),
                Op::Fused(Box::new(k)),
                vec![a, b],
            );
        }
    }
}

/// Checks attention `op` over q, k, v [B, H, Sq, D] unmasked, with an additive mask [Sq, Sk]
/// (row 0 fully masked, every fifth key masked, the rest random) and with a bool mask
/// [B, 1, 1, Sk]; returns the two masks.
fn attention_forward_cases(
    what: &str,
    op: &dyn Fn(rustytorch::ops::AttnMask) -> Op,
    [q, k, v]: [&HostTensor; 3],
    seed: u64,
) -> (HostTensor, HostTensor) {
    use rustytorch::ops::AttnMask;
    let (d, b) = (q.dtype(), q.ty().shape.dims()[0]);
    let (sq, sk) = (q.ty().shape.dims()[2], k.ty().shape.dims()[2]);
    let qkv = || vec![q.clone(), k.clone(), v.clone()];
    check(what, op(AttnMask::None), qkv());
    let mut m = rnd(DType::F64, &[sq, sk], seed + 3, -2.0, 1.0).to_f64_vec();
    for (x, mv) in m.iter_mut().enumerate() {
        if x < sk || x % 5 == 0 {
            *mv = f64::NEG_INFINITY;
        }
    }
    let add = HostTensor::from_f64_slice(&t(d, &[sq, sk]), &m).unwrap();
    let keep = rnd(DType::Bool, &[b, 1, 1, sk], seed + 4, 0.0, 1.0);
    for (kind, mask) in [(AttnMask::Additive, &add), (AttnMask::Bool, &keep)] {
        let mut ins = qkv();
        ins.push(mask.clone());
        check(&format!("{what} {kind:?}"), op(kind), ins);
    }
    (add, keep)
}

/// Attention on the device: causal kinds, additive and bool masks (a fully masked row is zero),
/// more keys than a warp has lanes, GPT-2 head sizes, every float dtype.
#[test]
fn attention() {
    use rustytorch::ops::{AttnLayout, AttnMask, Causal};
    for d in FLOATS {
        for (k, &(b, h, sq, sk, hd)) in [(2, 3, 17, 17, 64), (1, 2, 40, 75, 32)].iter().enumerate()
        {
            let seed = 90 + 10 * k as u64;
            let q = rnd(d, &[b, h, sq, hd], seed, -1.0, 1.0);
            let kk = rnd(d, &[b, h, sk, hd], seed + 1, -1.0, 1.0);
            let v = rnd(d, &[b, h, sk, hd], seed + 2, -1.0, 1.0);
            let scale = F64Bits::new(1.0 / (hd as f64).sqrt());
            for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
                let what = format!("attention {d:?} {causal:?} [{b},{h},{sq},{sk},{hd}]");
                let op = |mask| Op::Attention {
                    causal,
                    mask,
                    scale,
                    layout: AttnLayout::Bhsd,
                };
                let (add, _) = attention_forward_cases(&what, &op, [&q, &kk, &v], seed);
                // Gradients with respect to q, k and v, unmasked and with the additive mask.
                let g = rnd(d, &[b, h, sq, hd], seed + 5, -1.0, 1.0);
                for wrt in 0..3u8 {
                    let grad = |mask| Op::AttentionGrad {
                        causal,
                        mask,
                        scale,
                        wrt,
                        layout: AttnLayout::Bhsd,
                    };
                    let ins = vec![q.clone(), kk.clone(), v.clone(), g.clone()];
                    check_scaled(
                        &format!("{what} grad {wrt}"),
                        grad(AttnMask::None),
                        ins,
                        true,
                    );
                    let ins = vec![q.clone(), kk.clone(), v.clone(), add.clone(), g.clone()];
                    check_scaled(
                        &format!("{what} grad {wrt} additive"),
                        grad(AttnMask::Additive),
                        ins,
                        true,
                    );
                }
            }
        }
    }
}

/// Attention reading and writing `[B, S, H, D]` heads in place: the flash kernel with row strides
/// (f16/bf16, head sizes a multiple of 16) and the other paths through transposes in scratch (f32,
/// head size 40), forward and the three gradients, causal kinds, masks, Sq ≠ Sk.
#[test]
fn attention_bshd_layout() {
    use rustytorch::ops::{AttnLayout, AttnMask, Causal};
    let cases: [(DType, usize, usize, usize, usize, usize, usize); 5] = [
        (DType::BF16, 2, 3, 70, 70, 64, 64),
        (DType::F16, 1, 2, 33, 130, 32, 48),
        (DType::BF16, 1, 4, 1, 90, 128, 128),
        (DType::F16, 2, 2, 19, 23, 40, 40),
        (DType::F32, 2, 3, 21, 37, 64, 64),
    ];
    for (n, &(d, b, h, sq, sk, hd, hv)) in cases.iter().enumerate() {
        let seed = 700 + 10 * n as u64;
        let q = rnd(d, &[b, sq, h, hd], seed, -1.0, 1.0);
        let kk = rnd(d, &[b, sk, h, hd], seed + 1, -1.0, 1.0);
        let v = rnd(d, &[b, sk, h, hv], seed + 2, -1.0, 1.0);
        let g = rnd(d, &[b, sq, h, hv], seed + 3, -1.0, 1.0);
        let add = rnd(d, &[sq, sk], seed + 4, -2.0, 1.0);
        let scale = F64Bits::new(1.0 / (hd as f64).sqrt());
        for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
            let what = format!("bshd {d:?} {causal:?} [{b},{h},{sq},{sk},{hd},{hv}]");
            for (mask, extra) in [(AttnMask::None, None), (AttnMask::Additive, Some(&add))] {
                let mut ins = vec![q.clone(), kk.clone(), v.clone()];
                ins.extend(extra.cloned());
                let op = Op::Attention {
                    causal,
                    mask,
                    scale,
                    layout: AttnLayout::Bshd,
                };
                check(&format!("{what} {mask:?}"), op, ins.clone());
                ins.push(g.clone());
                for wrt in 0..3u8 {
                    let grad = Op::AttentionGrad {
                        causal,
                        mask,
                        scale,
                        wrt,
                        layout: AttnLayout::Bshd,
                    };
                    check_scaled(
                        &format!("{what} {mask:?} grad {wrt}"),
                        grad,
                        ins.clone(),
                        true,
                    );
                }
            }
        }
    }
}

/// The tensor-core flash kernel (f16/bf16, head sizes that are multiples of 16 up to 128) against
/// the CPU kernel: one query row (decoding), odd and long sequences, fewer or more keys than
/// queries, both causal alignments, additive masks with fully masked rows, bool masks, value
/// head sizes different from the query's.
#[test]
fn flash_attention_shapes() {
    use rustytorch::codegen::cuda::flash;
    use rustytorch::ops::{AttnLayout, AttnMask, Causal};
    let shapes: [(usize, usize, usize, usize, usize, usize); 6] = [
        (2, 3, 1, 300, 64, 64),
        (1, 2, 7, 7, 32, 32),
        (1, 2, 1000, 1000, 128, 128),
        (2, 1, 100, 37, 80, 80),
        (1, 2, 130, 257, 64, 128),
        (1, 1, 65, 64, 16, 48),
    ];
    // `RUSTYTORCH_TEST_SMALL=1` keeps the shapes small enough for compute-sanitizer.
    let small = std::env::var("RUSTYTORCH_TEST_SMALL").as_deref() == Ok("1");
    for d in [DType::F16, DType::BF16] {
        for (n, &(b, h, sq, sk, hd, hv)) in shapes.iter().enumerate() {
            if small && sq * sk > 40_000 {
                continue;
            }
            let seed = 300 + 10 * n as u64;
            let q = rnd(d, &[b, h, sq, hd], seed, -1.0, 1.0);
            let kk = rnd(d, &[b, h, sk, hd], seed + 1, -1.0, 1.0);
            let v = rnd(d, &[b, h, sk, hv], seed + 2, -1.0, 1.0);
            let tys = [q.ty(), kk.ty(), v.ty()];
            let refs: Vec<&TensorType> = tys.iter().collect();
            assert!(
                flash::supported(&refs),
                "flash runs [{b},{h},{sq},{sk},{hd},{hv}]"
            );
            let scale = F64Bits::new(1.0 / (hd as f64).sqrt());
            for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
                let what = format!("flash {d:?} {causal:?} [{b},{h},{sq},{sk},{hd},{hv}]");
                let op = |mask| Op::Attention {
                    causal,
                    mask,
                    scale,
                    layout: AttnLayout::Bhsd,
                };
                let (add, keep) = attention_forward_cases(&what, &op, [&q, &kk, &v], seed);
                // The three gradients through the flash backward (unmasked, additive with a
                // fully masked row, bool), errors relative to the largest magnitude.
                if sq * sk > 100_000 {
                    continue;
                }
                let g = rnd(d, &[b, h, sq, hv], seed + 5, -1.0, 1.0);
                for wrt in 0..3u8 {
                    let grad = |mask| Op::AttentionGrad {
                        causal,
                        mask,
                        scale,
                        wrt,
                        layout: AttnLayout::Bhsd,
                    };
                    for (mask, extra) in [
                        (AttnMask::None, None),
                        (AttnMask::Additive, Some(&add)),
                        (AttnMask::Bool, Some(&keep)),
                    ] {
                        let mut ins = vec![q.clone(), kk.clone(), v.clone()];
                        ins.extend(extra.cloned());
                        ins.push(g.clone());
                        check_scaled(
                            &format!("{what} grad {wrt} {mask:?}"),
                            grad(mask),
                            ins,
                            true,
                        );
                    }
                }
            }
        }
    }
}

/// A reduction over the rows with the elementwise `prologue` (`instrs` over the inputs) fused
/// into its loads, as the fuse pass makes it.
fn column_sum_of(x: TensorType, instrs: Vec<rustytorch::ops::FusedInstr>, inputs: u32) -> Op {
    Op::FusedRow(Box::new(rustytorch::ops::RowFusion {
        core: Op::Reduce {
            kind: ReduceKind::Sum,
            axes: vec![0],
            keep_dims: false,
        },
        prologue: Some(rustytorch::ops::FusedKernel {
            n_inputs: inputs,
            instrs,
            out: x,
        }),
        epilogue: None,
    }))
}

/// The column reductions of GPT-2's training step at their sizes (the bias gradient's
/// `sum(dY, 0)` in bf16 and f32, to f32 through a cast, and LayerNorm-backward's
/// `sum(dY · xhat, 0)`), besides odd and narrow ones: 16-byte vectors, two stages.
#[test]
fn reductions_over_columns_at_benchmark_sizes() {
    use rustytorch::ops::FusedInstr;
    let sum0 = Op::Reduce {
        kind: ReduceKind::Sum,
        axes: vec![0],
        keep_dims: false,
    };
    for (d, dims) in [
        (DType::BF16, [8192usize, 768]),
        (DType::BF16, [8192, 3072]),
        (DType::F32, [8192, 768]),
        (DType::F16, [8192, 129]),
        (DType::F64, [5000, 40]),
    ] {
        let x = rnd(d, &dims, 61, -2.0, 2.0);
        check(&format!("sum0 {d:?} {dims:?}"), sum0.clone(), vec![x]);
    }
    for kind in [ReduceKind::Max, ReduceKind::Mean] {
        let op = Op::Reduce {
            kind,
            axes: vec![1],
            keep_dims: true,
        };
        let x = rnd(DType::BF16, &[4, 2048, 768], 62, -2.0, 2.0);
        check(&format!("{kind:?} bf16 [4, 2048, 768] axis 1"), op, vec![x]);
    }
    let dims = [8192usize, 768];
    let (f32t, bft) = (t(DType::F32, &dims), t(DType::BF16, &dims));
    let cast = FusedInstr {
        op: Op::Cast { to: DType::F32 },
        args: vec![0],
        dtype: DType::F32,
    };
    let dy = rnd(DType::BF16, &dims, 63, -2.0, 2.0);
    check(
        "sum(f32(dY), 0) bf16 [8192, 768]",
        column_sum_of(f32t, vec![cast], 1),
        vec![dy.clone()],
    );
    let mul = FusedInstr {
        op: Op::Binary(BinaryOp::Mul),
        args: vec![0, 1],
        dtype: DType::BF16,
    };
    let xhat = rnd(DType::BF16, &dims, 64, -2.0, 2.0);
    check(
        "sum(dY * xhat, 0) bf16 [8192, 768]",
        column_sum_of(bft, vec![mul], 2),
        vec![dy, xhat],
    );
}

/// The column-reduction kernels compile with NVRTC for sm_80 and sm_90, on any machine where
/// NVRTC loads (`RUSTYTORCH_TEST_NVRTC=1` makes its absence a failure): every float and integer
/// dtype, vector widths 8, 4, 2 and scalars, one and two stages, fused prologues.
#[test]
fn reductions_over_columns_compile_with_nvrtc() {
    use rustytorch::codegen::cuda::{lower_step, source};
    use rustytorch::runtime::cuda::compile::KernelCompiler;
    let required = std::env::var("RUSTYTORCH_TEST_NVRTC").as_deref() == Ok("1");
    let compilers: Result<Vec<_>, _> = [(8, 0), (9, 0)]
        .into_iter()
        .map(|cc| KernelCompiler::with_dir(cc, None))
        .collect();
    let compilers = match compilers {
        Ok(c) => c,
        Err(e) if required => panic!("RUSTYTORCH_TEST_NVRTC=1 but NVRTC is unavailable: {e}"),
        Err(e) => {
            eprintln!("skipped: {e}");
            return;
        }
    };
    let mut cases: Vec<(Op, Vec<TensorType>)> = vec![];
    for d in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
    ] {
        for dims in [&[8192usize, 768][..], &[300, 13], &[7, 3, 10], &[20, 24]] {
            for kind in [ReduceKind::Sum, ReduceKind::Max, ReduceKind::Prod] {
                cases.push((
                    Op::Reduce {
                        kind,
                        axes: vec![dims.len() - 2],
                        keep_dims: false,
                    },
                    vec![t(d, dims)],
                ));
            }
        }
    }
    for kind in [ReduceKind::Any, ReduceKind::All] {
        let op = Op::Reduce {
            kind,
            axes: vec![0],
            keep_dims: true,
        };
        cases.push((op, vec![t(DType::Bool, &[8192, 768])]));
    }
    let dims = [8192usize, 768];
    for d in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let mul = rustytorch::ops::FusedInstr {
            op: Op::Binary(BinaryOp::Mul),
            args: vec![0, 1],
            dtype: d,
        };
        let x = t(d, &dims);
        cases.push((column_sum_of(x.clone(), vec![mul], 2), vec![x.clone(), x]));
    }
    let cast = rustytorch::ops::FusedInstr {
        op: Op::Cast { to: DType::F32 },
        args: vec![0],
        dtype: DType::F32,
    };
    cases.push((
        column_sum_of(t(DType::F32, &dims), vec![cast], 1),
        vec![t(DType::BF16, &dims)],
    ));
    let mut sources = vec![];
    for (op, ins) in cases {
        let refs: Vec<&TensorType> = ins.iter().collect();
        let out = rustytorch::ops::infer(&op, &refs).unwrap();
        let step = lower_step(&op, &refs, &out).unwrap_or_else(|e| panic!("{op:?}: {e}"));
        for l in step.launches() {
            sources.push((l.kernel.name.clone(), source(&l.kernel).unwrap()));
        }
    }
    sources.sort();
    sources.dedup();
    for c in &compilers {
        c.cubins(&sources)
            .unwrap_or_else(|e| panic!("{}: {e}", c.arch()));
    }
}
