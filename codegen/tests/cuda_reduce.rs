//! The CUDA reduction, softmax, normalization and cross-entropy kernels against the CPU kernels,
//! run through the IR interpreter: reduced axes first, middle, last and several, keep_dims, odd and
//! tiny rows, rows long enough for a block per row and for two-stage reductions, every dtype each
//! op accepts; and snapshots of the printed source of canonical kernels.

use rustytorch_codegen::cuda::{self, interp, CudaStep, StepKernels};
use rustytorch_ops::testing::{assert_close, rand_tensor, tolerance};
use rustytorch_ops::{
    eval_cpu, infer, ArgKind, DType, F64Bits, HostTensor, Op, ReduceKind, Reduction, Shape,
    TensorType,
};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
const INTS: [DType; 3] = [DType::I32, DType::I64, DType::U8];

fn ty(dt: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dt, Shape::new(dims))
}

/// A random tensor: floats uniform in [lo, hi), integers in [lo, hi) (u8 from 0), bools random.
fn rand(dt: DType, dims: &[usize], seed: u64, lo: f64, hi: f64) -> HostTensor {
    let lo = if dt == DType::U8 { lo.max(0.0) } else { lo };
    rand_tensor(&ty(dt, dims), seed, lo, hi)
}

/// The lowered kernels of `op` over `inputs`, with the result type.
fn lower(op: &Op, inputs: &[&HostTensor]) -> (StepKernels, TensorType) {
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let out = infer(op, &refs).expect("inference");
    match cuda::lower_step(op, &refs, &out) {
        Ok(CudaStep::Kernels(k)) => (k, out),
        Ok(other) => panic!("{op:?}: expected kernels, got {other:?}"),
        Err(e) => panic!("{op:?} over {tys:?}: {e}"),
    }
}

/// Runs `op` on the interpreter and compares with the CPU kernel within `tol`.
fn check_tol(op: &Op, inputs: &[&HostTensor], tol: f64) -> StepKernels {
    let (step, out) = lower(op, inputs);
    let what = format!(
        "{op:?} over {:?}",
        inputs.iter().map(|t| t.ty()).collect::<Vec<_>>()
    );
    let got = interp::run_step(&step, inputs, &out, None).unwrap_or_else(|e| panic!("{what}: {e}"));
    let want = eval_cpu(op, inputs).unwrap_or_else(|e| panic!("{what}: CPU: {e}"));
    assert_eq!(got.ty(), want.ty(), "{what}");
    assert_close(&got.to_f64_vec(), &want.to_f64_vec(), tol, &what);
    step
}

/// As [`check_tol`] with the result dtype's tolerance (exact for integers and bools).
fn check(op: &Op, inputs: &[&HostTensor]) -> StepKernels {
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let out = infer(op, &refs).expect("inference");
    check_tol(op, inputs, tolerance(out.dtype))
}

fn red(kind: ReduceKind, axes: &[usize], keep_dims: bool) -> Op {
    Op::Reduce {
        kind,
        axes: axes.to_vec(),
        keep_dims,
    }
}

/// Shapes and axes covering each placement: a warp per output, columns (a non-last axis), tiny
/// rows, several axes, all axes, size-1 dims.
const CASES: &[(&[usize], &[usize])] = &[
    (&[7, 33, 5], &[0]),
    (&[7, 33, 5], &[1]),
    (&[7, 33, 5], &[2]),
    (&[7, 33, 5], &[0, 2]),
    (&[7, 33, 5], &[1, 2]),
    (&[7, 33, 5], &[0, 1, 2]),
    (&[4, 3, 6, 5], &[1, 3]),
    (&[40, 3], &[1]),
    (&[3, 41], &[0]),
    (&[1, 9, 1], &[0, 2]),
    (&[1, 9, 1], &[1]),
    (&[6], &[0]),
];

#[test]
fn reduce_floats() {
    let kinds = [
        ReduceKind::Sum,
        ReduceKind::Mean,
        ReduceKind::Max,
        ReduceKind::Min,
        ReduceKind::Prod,
    ];
    for (seed, &(dims, axes)) in CASES.iter().enumerate() {
        for dt in FLOATS {
            // Products over [0.5, 1.5) stay well inside the range of every dtype.
            let x = rand(dt, dims, seed as u64, -1.0, 1.0);
            let xp = rand(dt, dims, seed as u64, 0.5, 1.5);
            for kind in kinds {
                let input = if kind == ReduceKind::Prod { &xp } else { &x };
                for keep in [false, true] {
                    check(&red(kind, axes, keep), &[input]);
                }
            }
        }
    }
}

#[test]
fn reduce_ints_and_bools() {
    for (seed, &(dims, axes)) in CASES.iter().enumerate() {
        for dt in INTS {
            let x = rand(dt, dims, 100 + seed as u64, -50.0, 50.0);
            let xp = rand(dt, dims, 100 + seed as u64, -3.0, 4.0);
            for kind in [
                ReduceKind::Sum,
                ReduceKind::Max,
                ReduceKind::Min,
                ReduceKind::Prod,
            ] {
                let input = if kind == ReduceKind::Prod { &xp } else { &x };
                check(&red(kind, axes, seed % 2 == 0), &[input]);
            }
        }
        let b = rand(DType::Bool, dims, 200 + seed as u64, 0.0, 1.0);
        for kind in [ReduceKind::Any, ReduceKind::All] {
            check(&red(kind, axes, seed % 2 == 1), &[&b]);
        }
    }
    // Sums that wrap around the i32 and u8 ranges truncate as the CPU does.
    let big = rand(DType::I32, &[5, 300], 7, 1.0e7, 2.0e9);
    check(&red(ReduceKind::Sum, &[1], false), &[&big]);
    let bytes = rand(DType::U8, &[5, 300], 8, 0.0, 255.0);
    check(&red(ReduceKind::Sum, &[1], false), &[&bytes]);
    // Products that overflow i64 wrap identically in any order.
    let p = rand(DType::I64, &[2, 200], 9, 2.0, 9.0);
    check(&red(ReduceKind::Prod, &[1], false), &[&p]);
    // All over mostly-true rows.
    let mostly: Vec<bool> = (0..60).map(|i| i % 17 != 3).collect();
    let b = HostTensor::from_vec(mostly, [6, 10]).unwrap();
    check(&red(ReduceKind::All, &[1], false), &[&b]);
    check(&red(ReduceKind::Any, &[0], false), &[&b]);
}

#[test]
fn reduce_long_rows() {
    // A block per output (rows longer than 1024, few outputs).
    for dt in FLOATS {
        let x = rand(dt, &[3, 2500], 11, -1.0, 1.0);
        for kind in [ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max] {
            let step = check(&red(kind, &[1], false), &[&x]);
            assert_eq!(step.launches.len(), 1);
        }
    }
    let xi = rand(DType::I64, &[2, 3000], 12, -1000.0, 1000.0);
    check(&red(ReduceKind::Sum, &[1], true), &[&xi]);
    let b = rand(DType::Bool, &[2, 3000], 13, 0.0, 1.0);
    check(&red(ReduceKind::Any, &[1], false), &[&b]);
}

#[test]
fn reduce_two_stage() {
    // A full reduction of 40000 elements: partials per block into scratch, then a second launch.
    // The f32 sum is checked a little looser than the dtype's tolerance: the CPU sums pairwise
    // and the GPU in a different tree, and the total is small next to the sum of magnitudes
    // (~20000), so a few ulps of the partials show up in the relative error.
    for dt in FLOATS {
        let x = rand(dt, &[200, 200], 21, -1.0, 1.0);
        for kind in [ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Min] {
            let op = red(kind, &[0, 1], false);
            let tol = match dt {
                DType::F32 => 1e-4,
                d => tolerance(d),
            };
            let step = check_tol(&op, &[&x], tol);
            assert_eq!(step.launches.len(), 2, "{op:?} {dt}");
            assert!(step.scratch_bytes > 0);
        }
    }
    let xi = rand(DType::I32, &[200, 200], 22, -100.0, 100.0);
    check(&red(ReduceKind::Sum, &[0, 1], true), &[&xi]);
    check(&red(ReduceKind::Max, &[0, 1], true), &[&xi]);
    let b = rand(DType::Bool, &[200, 200], 23, 0.0, 1.0);
    check(&red(ReduceKind::All, &[0, 1], false), &[&b]);
    check(&red(ReduceKind::Any, &[0, 1], false), &[&b]);
    // Columns: a long non-last axis with few outputs splits too.
    for dt in [DType::F32, DType::F64, DType::BF16, DType::I64] {
        let x = rand(dt, &[5000, 3], 24, -1.0, 1.0);
        for kind in [ReduceKind::Sum, ReduceKind::Max] {
            let op = red(kind, &[0], false);
            let tol = if dt == DType::F32 {
                1e-4
            } else {
                tolerance(dt)
            };
            let step = check_tol(&op, &[&x], tol);
            assert_eq!(step.launches.len(), 2, "{op:?} {dt}");
        }
    }
}

#[test]
fn reduce_edges() {
    // No axes: a copy.
    for dt in [DType::F16, DType::I32] {
        let x = rand(dt, &[3, 4], 31, -5.0, 5.0);
        check(&red(ReduceKind::Sum, &[], false), &[&x]);
        let s = rand(dt, &[], 32, -5.0, 5.0);
        check(&red(ReduceKind::Max, &[], true), &[&s]);
    }
    let b = rand(DType::Bool, &[3, 4], 31, 0.0, 1.0);
    check(&red(ReduceKind::Any, &[], false), &[&b]);
    // Empty reduced axes: sum 0, prod 1, mean NaN, any false, all true.
    let e = rand(DType::F32, &[3, 0, 2], 33, -1.0, 1.0);
    for kind in [ReduceKind::Sum, ReduceKind::Prod, ReduceKind::Mean] {
        check(&red(kind, &[1], false), &[&e]);
    }
    let eb = rand(DType::Bool, &[3, 0], 34, 0.0, 1.0);
    check(&red(ReduceKind::Any, &[1], false), &[&eb]);
    check(&red(ReduceKind::All, &[1], true), &[&eb]);
    // Max (min) of nothing is the identity, −∞ (+∞) or the integer bounds, on both sides (ONNX's
    // definition).
    for kind in [ReduceKind::Max, ReduceKind::Min] {
        check(&red(kind, &[1], false), &[&e]);
        for dt in [DType::I32, DType::I64] {
            check(&red(kind, &[1], true), &[&rand(dt, &[3, 0], 36, 0.0, 9.0)]);
        }
    }
    // An empty output has no launches.
    let op = red(ReduceKind::Sum, &[2], false);
    let z = ty(DType::F32, &[0, 4, 5]);
    let out = infer(&op, &[&z]).unwrap();
    match cuda::lower_step(&op, &[&z], &out).unwrap() {
        CudaStep::Kernels(k) => assert!(k.launches.is_empty()),
        other => panic!("{other:?}"),
    }
    // NaN propagates through max/min and sums.
    let mut v = rand(DType::F32, &[4, 50], 35, -1.0, 1.0).to_f64_vec();
    v[3] = f64::NAN;
    v[120] = f64::NAN;
    v[199] = f64::INFINITY;
    let x = HostTensor::from_f64_slice(&ty(DType::F32, &[4, 50]), &v).unwrap();
    for kind in [ReduceKind::Max, ReduceKind::Min, ReduceKind::Sum] {
        check(&red(kind, &[1], false), &[&x]);
        check(&red(kind, &[0], false), &[&x]);
    }
}

fn arg(kind: ArgKind, axis: usize, keep_dims: bool) -> Op {
    Op::ArgReduce {
        kind,
        axis,
        keep_dims,
    }
}

#[test]
fn arg_reduce() {
    let shapes: &[(&[usize], usize)] = &[
        (&[7, 33, 5], 0),
        (&[7, 33, 5], 1),
        (&[7, 33, 5], 2),
        (&[40, 3], 1),
        (&[1, 9], 0),
        (&[9], 0),
        (&[2, 2000], 1),
        (&[1500, 3], 0),
    ];
    for (seed, &(dims, axis)) in shapes.iter().enumerate() {
        for kind in [ArgKind::ArgMax, ArgKind::ArgMin] {
            for dt in FLOATS.into_iter().chain(INTS) {
                // Integer values from a small range tie often: the first index must win.
                let x = if dt.is_float() {
                    rand(dt, dims, seed as u64, -1.0, 1.0)
                } else {
                    rand(dt, dims, seed as u64, 0.0, 4.0)
                };
                check(&arg(kind, axis, seed % 2 == 0), &[&x]);
            }
            // bf16 of a narrow range ties too.
            let x = rand(DType::BF16, dims, seed as u64, 1.0, 1.03);
            check(&arg(kind, axis, false), &[&x]);
        }
    }
    // NaN counts as the extreme (its first occurrence), -inf and +inf are ordinary.
    let mut v = rand(DType::F32, &[5, 70], 41, -1.0, 1.0).to_f64_vec();
    for (i, s) in [
        (5, f64::NAN),
        (60, f64::NAN),
        (75, f64::INFINITY),
        (150, f64::NEG_INFINITY),
        (300, f64::NAN),
    ] {
        v[i] = s;
    }
    for i in 210..280 {
        v[i] = f64::NEG_INFINITY;
    }
    let x = HostTensor::from_f64_slice(&ty(DType::F32, &[5, 70]), &v).unwrap();
    for kind in [ArgKind::ArgMax, ArgKind::ArgMin] {
        check(&arg(kind, 1, false), &[&x]);
        check(&arg(kind, 0, false), &[&x]);
    }
}

#[test]
fn softmax_and_log_softmax() {
    let shapes: &[(&[usize], usize)] = &[
        (&[5, 37], 1),
        (&[6, 50, 7], 1),
        (&[40, 9], 0),
        (&[3, 4, 5], 2),
        (&[2, 1], 1),
        (&[2, 1, 3], 1),
        (&[3, 2000], 1),
        (&[1100, 4], 0),
        (&[7], 0),
    ];
    for (seed, &(dims, axis)) in shapes.iter().enumerate() {
        for dt in FLOATS {
            let x = rand(dt, dims, seed as u64, -4.0, 4.0);
            check(&Op::Softmax { axis }, &[&x]);
            check(&Op::LogSoftmax { axis }, &[&x]);
        }
    }
    // A row with NaN gives NaN; -inf entries give zero probability.
    let mut v = rand(DType::F32, &[3, 40], 51, -2.0, 2.0).to_f64_vec();
    v[7] = f64::NAN;
    v[45] = f64::NEG_INFINITY;
    v[90] = f64::INFINITY;
    let x = HostTensor::from_f64_slice(&ty(DType::F32, &[3, 40]), &v).unwrap();
    check(&Op::Softmax { axis: 1 }, &[&x]);
    check(&Op::LogSoftmax { axis: 1 }, &[&x]);
}

#[test]
fn layer_norm_and_rms_norm() {
    let shapes: &[&[usize]] = &[&[6, 40], &[2, 3, 17], &[5, 1], &[3, 1500], &[300, 8], &[9]];
    for (seed, &dims) in shapes.iter().enumerate() {
        let d = *dims.last().unwrap();
        for dt in FLOATS {
            let x = rand(dt, dims, seed as u64, -2.0, 3.0);
            let w = rand(dt, &[d], 100 + seed as u64, 0.5, 1.5);
            let b = rand(dt, &[d], 200 + seed as u64, -1.0, 1.0);
            let eps = F64Bits::new(1e-5);
            for (weight, bias) in [(false, false), (true, false), (false, true), (true, true)] {
                let mut ins = vec![&x];
                if weight {
                    ins.push(&w);
                }
                if bias {
                    ins.push(&b);
                }
                check(&Op::LayerNorm { eps, weight, bias }, &ins);
            }
            check(&Op::RmsNorm { eps, weight: false }, &[&x]);
            check(&Op::RmsNorm { eps, weight: true }, &[&x, &w]);
        }
    }
}

/// Targets in `0..c`, every third one `ignore` (when `with_ignored`).
fn targets(
    dt: DType,
    n: usize,
    c: usize,
    seed: u64,
    ignore: i64,
    with_ignored: bool,
) -> HostTensor {
    let v: Vec<f64> = rand(DType::I64, &[n], seed, 0.0, c as f64)
        .to_f64_vec()
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            if with_ignored && i % 3 == 1 {
                ignore as f64
            } else {
                t
            }
        })
        .collect();
    HostTensor::from_f64_slice(&ty(dt, &[n]), &v).unwrap()
}

const REDUCTIONS: [Reduction; 3] = [Reduction::None, Reduction::Sum, Reduction::Mean];

#[test]
fn cross_entropy() {
    for (seed, &(n, c)) in [(13, 37), (4, 1500), (40, 3), (1, 1), (2100, 5)]
        .iter()
        .enumerate()
    {
        for dt in FLOATS {
            let x = rand(dt, &[n, c], seed as u64, -3.0, 3.0);
            for (tdt, ignore) in [(DType::I64, -100), (DType::I32, 2)] {
                let t = targets(tdt, n, c, 300 + seed as u64, ignore, true);
                for reduction in REDUCTIONS {
                    let op = Op::CrossEntropy {
                        reduction,
                        ignore_index: ignore,
                    };
                    check(&op, &[&x, &t]);
                }
            }
        }
    }
    // Every target ignored: a mean over nothing is NaN, a sum 0.
    let x = rand(DType::F32, &[4, 6], 61, -1.0, 1.0);
    let t = HostTensor::from_vec(vec![-1i64; 4], [4]).unwrap();
    for reduction in REDUCTIONS {
        check(
            &Op::CrossEntropy {
                reduction,
                ignore_index: -1,
            },
            &[&x, &t],
        );
    }
    // No rows at all.
    let x = rand(DType::F16, &[0, 6], 62, -1.0, 1.0);
    let t = HostTensor::from_vec(Vec::<i64>::new(), [0]).unwrap();
    for reduction in REDUCTIONS {
        check(
            &Op::CrossEntropy {
                reduction,
                ignore_index: -1,
            },
            &[&x, &t],
        );
    }
}

#[test]
fn cross_entropy_out_of_range_target_is_nan() {
    // The CPU reports the bad target; a kernel cannot, so its row's loss is NaN.
    let x = rand(DType::F32, &[3, 5], 71, -1.0, 1.0);
    let t = HostTensor::from_vec(vec![1i64, 5, -1], [3]).unwrap();
    let op = Op::CrossEntropy {
        reduction: Reduction::None,
        ignore_index: -1,
    };
    assert!(eval_cpu(&op, &[&x, &t]).is_err());
    let (step, out) = lower(&op, &[&x, &t]);
    let got = interp::run_step(&step, &[&x, &t], &out, None)
        .unwrap()
        .to_f64_vec();
    assert!(
        got[0].is_finite() && got[1].is_nan() && got[2] == 0.0,
        "{got:?}"
    );
}

#[test]
fn cross_entropy_grad() {
    for (seed, &(n, c)) in [(13, 37), (4, 1500), (40, 3), (1, 1), (2100, 5)]
        .iter()
        .enumerate()
    {
        for dt in FLOATS {
            let x = rand(dt, &[n, c], seed as u64, -3.0, 3.0);
            for (tdt, ignore) in [(DType::I64, -100), (DType::I32, 2)] {
                let t = targets(tdt, n, c, 400 + seed as u64, ignore, true);
                for reduction in REDUCTIONS {
                    let g = if reduction == Reduction::None {
                        rand(dt, &[n], 500 + seed as u64, -1.0, 1.0)
                    } else {
                        rand(dt, &[], 500 + seed as u64, 0.5, 2.0)
                    };
                    let op = Op::CrossEntropyGrad {
                        reduction,
                        ignore_index: ignore,
                    };
                    check(&op, &[&x, &t, &g]);
                }
            }
        }
    }
    // Every target ignored: all-zero gradients, also for the mean.
    let x = rand(DType::F64, &[4, 6], 81, -1.0, 1.0);
    let t = HostTensor::from_vec(vec![-1i32; 4], [4]).unwrap();
    let g = rand(DType::F64, &[], 82, 0.5, 2.0);
    check(
        &Op::CrossEntropyGrad {
            reduction: Reduction::Mean,
            ignore_index: -1,
        },
        &[&x, &t, &g],
    );
}

#[test]
fn placements() {
    // The grid tells the placement apart: 8 rows per block (a warp each), a block per row, or
    // columns of a non-last axis (32 vectors of outputs a block, 8 rows at a time; 128 f32
    // outputs when the kept extent takes 16-byte vectors).
    let grid = |op: &Op, dims: &[usize]| {
        let x = rand(DType::F32, dims, 1, -1.0, 1.0);
        let (step, _) = lower(op, &[&x]);
        step.launches.iter().map(|l| l.grid).collect::<Vec<_>>()
    };
    let sum = |axes: &[usize]| red(ReduceKind::Sum, axes, false);
    assert_eq!(grid(&sum(&[1]), &[40, 3]), [5]);
    assert_eq!(grid(&sum(&[1]), &[3, 2500]), [3]);
    assert_eq!(grid(&sum(&[0]), &[7, 100]), [1]);
    assert_eq!(grid(&sum(&[0]), &[7, 1000]), [8]);
    assert_eq!(grid(&sum(&[0, 1]), &[200, 200]), [5, 1]);
    // Three scalar columns: 4 lanes a row and 64 rows at a time, 5 chunks of 1024 rows (8
    // groups of 64 rows 8 times), then one block for the partials.
    assert_eq!(grid(&sum(&[0]), &[5000, 3]), [5, 1]);
    assert_eq!(grid(&Op::Softmax { axis: 1 }, &[6, 50, 7]), [2]);
    assert_eq!(grid(&Op::Softmax { axis: 1 }, &[3, 2000]), [3]);
    // Last-axis rows that fit in registers: a block of 128 threads per row of 500 vectors.
    assert_eq!(grid(&Op::Softmax { axis: 1 }, &[3000, 2000]), [3000]);
    // A non-last axis: 32 columns per block.
    assert_eq!(grid(&Op::Softmax { axis: 0 }, &[2000, 3000]), [94]);
}

#[test]
fn kernel_names() {
    let x = rand(DType::F32, &[4, 8], 91, -1.0, 1.0);
    let name = |op: &Op, ins: &[&HostTensor]| lower(op, ins).0.launches[0].kernel.name.clone();
    let cases = [
        (red(ReduceKind::Sum, &[1], false), "reduce_sum_"),
        (red(ReduceKind::Mean, &[0], false), "reduce_mean_"),
        (arg(ArgKind::ArgMax, 1, false), "argmax_"),
        (arg(ArgKind::ArgMin, 0, false), "argmin_"),
        (Op::Softmax { axis: 1 }, "softmax_"),
        (Op::LogSoftmax { axis: 0 }, "log_softmax_"),
        (
            Op::RmsNorm {
                eps: F64Bits::new(1e-6),
                weight: false,
            },
            "rms_norm_",
        ),
    ];
    for (op, prefix) in cases {
        let n = name(&op, &[&x]);
        assert!(n.starts_with(prefix), "{op:?}: {n}");
    }
    // Identical kernels share a name; different shapes do not.
    let y = rand(DType::F32, &[4, 9], 92, -1.0, 1.0);
    let sm = Op::Softmax { axis: 1 };
    assert_eq!(name(&sm, &[&x]), name(&sm, &[&x.clone()]));
    assert_ne!(name(&sm, &[&x]), name(&sm, &[&y]));
}

fn snapshot_source(op: &Op, ins: &[TensorType]) -> String {
    let refs: Vec<&TensorType> = ins.iter().collect();
    let out = infer(op, &refs).unwrap();
    let step = match cuda::lower_step(op, &refs, &out).unwrap() {
        CudaStep::Kernels(k) => k,
        other => panic!("{other:?}"),
    };
    step.launches
        .iter()
        .map(|l| {
            format!(
                "// grid {} args {:?}\n{}",
                l.grid,
                l.args,
                cuda::source(&l.kernel).unwrap()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn snapshot_softmax_f32_last_dim() {
    let src = snapshot_source(&Op::Softmax { axis: 1 }, &[ty(DType::F32, &[64, 100])]);
    insta::assert_snapshot!(src);
}

#[test]
fn snapshot_layer_norm_bf16_affine() {
    let op = Op::LayerNorm {
        eps: F64Bits::new(1e-5),
        weight: true,
        bias: true,
    };
    let d = ty(DType::BF16, &[768]);
    let src = snapshot_source(&op, &[ty(DType::BF16, &[16, 768]), d.clone(), d]);
    insta::assert_snapshot!(src);
}

#[test]
fn snapshot_reduce_sum_middle_axis() {
    let op = red(ReduceKind::Sum, &[1], false);
    let src = snapshot_source(&op, &[ty(DType::F32, &[8, 300, 64])]);
    insta::assert_snapshot!(src);
}

/// The one-pass row kernels (softmax, log-softmax, LayerNorm, RMSNorm over a last axis held in
/// registers): every float dtype, rows of one vector to 1024 vectors a row, partial last vectors
/// of a thread, row counts that leave a block's warps idle, against the CPU.
#[test]
fn one_pass_row_kernels() {
    let eps = F64Bits::new(1e-5);
    for dt in FLOATS {
        let w = 16 / dt.size_bytes();
        // (vectors per row, rows): one vector; 3 a thread exactly; 4 a thread with the last
        // partial; 128 threads with a partial third vector; 256 threads exactly.
        for (k, &(nv, count)) in [(1, 3), (96, 5), (100, 2), (300, 3), (1024, 1)]
            .iter()
            .enumerate()
        {
            let d = nv * w;
            let seed = 7 * k as u64;
            let x = rand(dt, &[count, d], seed, -4.0, 4.0);
            let wt = rand(dt, &[d], seed + 1, 0.5, 1.5);
            let b = rand(dt, &[d], seed + 2, -1.0, 1.0);
            let mut cases: Vec<(Op, Vec<&HostTensor>)> = vec![
                (Op::Softmax { axis: 1 }, vec![&x]),
                (Op::LogSoftmax { axis: 1 }, vec![&x]),
                (Op::RmsNorm { eps, weight: false }, vec![&x]),
                (Op::RmsNorm { eps, weight: true }, vec![&x, &wt]),
            ];
            for (weight, bias) in [(false, false), (true, false), (false, true), (true, true)] {
                let mut ins = vec![&x];
                if weight {
                    ins.push(&wt);
                }
                if bias {
                    ins.push(&b);
                }
                cases.push((Op::LayerNorm { eps, weight, bias }, ins));
            }
            for (op, ins) in &cases {
                let step = check(op, ins);
                let name = &step.launches[0].kernel.name;
                assert!(
                    name.contains("_rows_"),
                    "{op:?} {dt} [{count}, {d}]: {name}"
                );
            }
        }
    }
    // Edge values through the one-pass softmax: NaN rows, -inf entries, +inf, magnitudes of 1e4,
    // a row of only -inf (NaN both ways).
    let (count, d) = (5, 96 * 4);
    let mut v = rand(DType::F32, &[count, d], 61, -2.0, 2.0).to_f64_vec();
    v[7] = f64::NAN;
    v[d + 3] = f64::NEG_INFINITY;
    v[d + 200] = f64::NEG_INFINITY;
    v[2 * d + 9] = f64::INFINITY;
    for x in &mut v[3 * d..4 * d] {
        *x *= 1e4;
    }
    for x in &mut v[4 * d..] {
        *x = f64::NEG_INFINITY;
    }
    let x = HostTensor::from_f64_slice(&ty(DType::F32, &[count, d]), &v).unwrap();
    for op in [Op::Softmax { axis: 1 }, Op::LogSoftmax { axis: 1 }] {
        let step = check(&op, &[&x]);
        assert!(step.launches[0].kernel.name.contains("_rows_"));
    }
    // Rows whose length is not a whole number of vectors, or too long for the registers, keep
    // the general kernels.
    for dims in [[4usize, 4 * 97 + 1], [2, 4 * 4 * 1024 + 4]] {
        let x = rand(DType::F32, &dims, 71, -2.0, 2.0);
        let step = check(&Op::Softmax { axis: 1 }, &[&x]);
        assert!(!step.launches[0].kernel.name.contains("_rows_"));
    }
}

/// The benchmarked RMSNorm and softmax: bf16 rows of 4096, 128 threads a row holding four
/// 16-byte vectors each.
#[test]
fn snapshot_bf16_rows_4096() {
    let x = ty(DType::BF16, &[32768, 4096]);
    let op = Op::RmsNorm {
        eps: F64Bits::new(1e-6),
        weight: true,
    };
    let src = snapshot_source(&op, &[x.clone(), ty(DType::BF16, &[4096])]);
    insta::assert_snapshot!("rms_norm_bf16_4096", src);
    let src = snapshot_source(&Op::Softmax { axis: 1 }, &[x]);
    insta::assert_snapshot!("softmax_bf16_4096", src);
}

#[test]
fn one_pass_reductions() {
    // Float sums, means, maxima and minima over a contiguous last axis whose rows fit in
    // registers read each row once in 16-byte vectors (the row kernels); kept dims or not.
    for dt in FLOATS {
        let w = 16 / dt.size_bytes();
        for (k, &(nv, count)) in [(1, 3), (96, 5), (100, 2), (300, 3), (1024, 1)]
            .iter()
            .enumerate()
        {
            let d = nv * w;
            let x = rand(dt, &[count, 2, d], 40 + k as u64, -2.0, 2.0);
            for kind in [
                ReduceKind::Sum,
                ReduceKind::Mean,
                ReduceKind::Max,
                ReduceKind::Min,
            ] {
                for keep in [false, true] {
                    let op = red(kind, &[2], keep);
                    // Long f32 sums cancel: a few ulps of the partials show up relative to the
                    // small total, as in the two-stage test.
                    let tol = if dt == DType::F32 {
                        1e-4
                    } else {
                        tolerance(dt)
                    };
                    let step = check_tol(&op, &[&x], tol);
                    let name = &step.launches[0].kernel.name;
                    assert!(
                        name.contains("_rows_"),
                        "{op:?} {dt} [{count}, {d}]: {name}"
                    );
                }
            }
        }
    }
    // NaN and infinities propagate as in the general kernels.
    let d = 4 * 50;
    let mut v = rand(DType::F32, &[4, d], 45, -1.0, 1.0).to_f64_vec();
    v[3] = f64::NAN;
    v[d + 7] = f64::INFINITY;
    v[2 * d + 9] = f64::NEG_INFINITY;
    let x = HostTensor::from_f64_slice(&ty(DType::F32, &[4, d]), &v).unwrap();
    for kind in [
        ReduceKind::Max,
        ReduceKind::Min,
        ReduceKind::Sum,
        ReduceKind::Mean,
    ] {
        let step = check(&red(kind, &[1], false), &[&x]);
        assert!(step.launches[0].kernel.name.contains("_rows_"));
    }
    // Products, integers and rows that are not whole vectors keep the general kernels.
    let x = rand(DType::F32, &[4, 4 * 97 + 1], 46, -1.0, 1.0);
    let step = check(&red(ReduceKind::Sum, &[1], false), &[&x]);
    assert!(!step.launches[0].kernel.name.contains("_rows_"));
    let x = rand(DType::F32, &[4, 64], 47, 0.5, 1.5);
    let step = check(&red(ReduceKind::Prod, &[1], false), &[&x]);
    assert!(!step.launches[0].kernel.name.contains("_rows_"));
}
