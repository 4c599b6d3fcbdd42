//! CUDA column reductions (the unit-stride dim kept: a bias gradient's `sum(dY, axis 0)`,
//! LayerNorm-backward's `sum(dY · xhat, axis 0)`) run through the IR interpreter against float64
//! references computed here and against the CPU kernels: kept extents that take 16-byte
//! vectors, shorter ones and scalars (odd extents), several kept dims, one and two stages, every
//! combination, integer and bool inputs, fused prologues (operands of the input's shape,
//! broadcast along rows or columns, a cast) and epilogues; the placement at GPT-2's sizes and a
//! snapshot of the benchmarked kernels' source.

use rustytorch_codegen::cuda::{self, interp, CudaStep, StepKernels};
use rustytorch_ops::testing::{assert_close, rand_tensor, tolerance};
use rustytorch_ops::{
    eval_cpu, infer, BinaryOp, DType, F64Bits, FusedInstr, FusedKernel, HostTensor, Op, ReduceKind,
    RowFusion, Shape, TensorType,
};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

fn ty(dt: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dt, Shape::new(dims))
}

fn rand(dt: DType, dims: &[usize], seed: u64, lo: f64, hi: f64) -> HostTensor {
    rand_tensor(&ty(dt, dims), seed, lo, hi)
}

fn red(kind: ReduceKind, axes: &[usize], keep_dims: bool) -> Op {
    Op::Reduce {
        kind,
        axes: axes.to_vec(),
        keep_dims,
    }
}

/// `op`'s CUDA kernels over `inputs`, and the result type.
fn lower(op: &Op, inputs: &[TensorType]) -> (StepKernels, TensorType) {
    let refs: Vec<&TensorType> = inputs.iter().collect();
    let out = infer(op, &refs).expect("inference");
    match cuda::lower_step(op, &refs, &out) {
        Ok(CudaStep::Kernels(k)) => (k, out),
        other => panic!("{op:?} over {inputs:?}: {other:?}"),
    }
}

/// Runs `op` in the interpreter; checks it against `want` (a float64 reference, rounded to the
/// result's dtype as the last step rounds it) within `tol`, and against the CPU kernel; returns
/// the step. Every kernel must print.
fn check(op: &Op, inputs: &[&HostTensor], want: &[f64], tol: f64, what: &str) -> StepKernels {
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let (step, out) = lower(op, &tys);
    for l in &step.launches {
        cuda::source(&l.kernel).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    let got = interp::run_step(&step, inputs, &out, None)
        .unwrap_or_else(|e| panic!("{what}: {e}"))
        .to_f64_vec();
    let want = HostTensor::from_f64_slice(&out, want)
        .expect("reference")
        .to_f64_vec();
    assert_close(&got, &want, tol, &format!("{what} (f64 reference)"));
    let cpu = eval_cpu(op, inputs).unwrap_or_else(|e| panic!("{what}: CPU: {e}"));
    assert_close(&got, &cpu.to_f64_vec(), tol, &format!("{what} (CPU)"));
    step
}

/// The float64 reduction of `v` (row-major over `dims`) over `axes`, in the kept dims' order.
fn reference(kind: ReduceKind, v: &[f64], dims: &[usize], axes: &[usize]) -> Vec<f64> {
    let kept: Vec<usize> = (0..dims.len()).filter(|a| !axes.contains(a)).collect();
    let outputs: usize = kept.iter().map(|&a| dims[a]).product();
    let n: usize = axes.iter().map(|&a| dims[a]).product();
    let init = match kind {
        ReduceKind::Sum | ReduceKind::Mean | ReduceKind::Any => 0.0,
        ReduceKind::Prod | ReduceKind::All => 1.0,
        ReduceKind::Max => f64::NEG_INFINITY,
        ReduceKind::Min => f64::INFINITY,
    };
    let mut acc = vec![init; outputs];
    for (flat, &x) in v.iter().enumerate() {
        // The element's index per dim, then its output's flat index over the kept dims.
        let mut rest = flat;
        let mut idx = vec![0; dims.len()];
        for a in (0..dims.len()).rev() {
            idx[a] = rest % dims[a];
            rest /= dims[a];
        }
        let o = kept.iter().fold(0, |o, &a| o * dims[a] + idx[a]);
        let r = &mut acc[o];
        *r = match kind {
            ReduceKind::Sum | ReduceKind::Mean => *r + x,
            ReduceKind::Prod => *r * x,
            // NaN propagates through max and min.
            _ if x.is_nan() || r.is_nan() => f64::NAN,
            ReduceKind::Max | ReduceKind::Any => r.max(x),
            ReduceKind::Min | ReduceKind::All => r.min(x),
        };
    }
    if kind == ReduceKind::Mean {
        for r in &mut acc {
            *r /= n as f64;
        }
    }
    acc
}

/// Whether the step's first kernel reads its input in vector accesses.
fn vector_loads(step: &StepKernels) -> bool {
    cuda::source(&step.launches[0].kernel)
        .unwrap()
        .contains("reinterpret_cast<const rt_vec")
}

/// (shape, reduced axes, whether the kept extent takes vectors) over the placements: vectors
/// with few and many columns, a kept extent of three vectors of f32 and one of bf16, odd extents
/// (scalars), an extent of 10 (vectors of 2), several kept dims (the columns with a batch dim
/// outside), one and two stages.
const CASES: &[(&[usize], &[usize], bool)] = &[
    (&[300, 40], &[0], true),
    (&[1000, 24], &[0], true),
    (&[7, 3, 16], &[1], true),
    (&[7, 3, 16], &[0], true),
    (&[50, 13], &[0], false),
    (&[40, 129], &[0], false),
    (&[3000, 40], &[0], true),
    (&[4, 600, 24], &[1], true),
    (&[2, 9, 6, 10], &[1, 2], true),
];

#[test]
fn column_reductions_of_floats() {
    let kinds = [
        ReduceKind::Sum,
        ReduceKind::Mean,
        ReduceKind::Max,
        ReduceKind::Min,
        ReduceKind::Prod,
    ];
    for (seed, &(dims, axes, vectors)) in CASES.iter().enumerate() {
        for dt in FLOATS {
            // Products over [0.9, 1.1) stay inside every dtype's range over 3000 rows.
            let x = rand(dt, dims, seed as u64, -2.0, 2.0);
            let xp = rand(dt, dims, seed as u64, 0.9, 1.1);
            for kind in kinds {
                let input = if kind == ReduceKind::Prod { &xp } else { &x };
                let want = reference(kind, &input.to_f64_vec(), dims, axes);
                // Long f32 sums cancel to small totals: a few ulps of the partials show.
                let tol = match dt {
                    DType::F32 => 1e-4,
                    d => tolerance(d),
                };
                for keep in [false, true] {
                    let op = red(kind, axes, keep);
                    let what = format!("{kind:?} {dt} {dims:?} over {axes:?} keep {keep}");
                    let step = check(&op, &[input], &want, tol, &what);
                    // f64 takes vectors of 2 wherever f32 takes 4.
                    assert_eq!(vector_loads(&step), vectors, "{what}");
                }
            }
        }
    }
}

#[test]
fn column_reductions_of_ints_and_bools() {
    for (seed, &(dims, axes, _)) in CASES.iter().enumerate() {
        for dt in [DType::I32, DType::I64, DType::U8] {
            let x = rand(dt, dims, 50 + seed as u64, 1.0, 60.0);
            for kind in [ReduceKind::Sum, ReduceKind::Max, ReduceKind::Min] {
                let want = reference(kind, &x.to_f64_vec(), dims, axes);
                // u8 sums wrap: the CPU kernel is the reference for those.
                let want = if dt == DType::U8 && kind == ReduceKind::Sum {
                    eval_cpu(&red(kind, axes, false), &[&x])
                        .unwrap()
                        .to_f64_vec()
                } else {
                    want
                };
                let what = format!("{kind:?} {dt} {dims:?} over {axes:?}");
                check(&red(kind, axes, seed % 2 == 0), &[&x], &want, 0.0, &what);
            }
        }
        let b = rand(DType::Bool, dims, 80 + seed as u64, 0.0, 1.0);
        for kind in [ReduceKind::Any, ReduceKind::All] {
            let want = reference(kind, &b.to_f64_vec(), dims, axes);
            let what = format!("{kind:?} bool {dims:?} over {axes:?}");
            check(&red(kind, axes, false), &[&b], &want, 0.0, &what);
        }
    }
    // Columns that are all true but for one element, and all false but for one.
    let mut v = vec![true; 300 * 40];
    v[7 * 40 + 5] = false;
    let b = HostTensor::from_vec(v.clone(), [300, 40]).unwrap();
    let want: Vec<f64> = (0..40).map(|c| if c == 5 { 0.0 } else { 1.0 }).collect();
    check(&red(ReduceKind::All, &[0], false), &[&b], &want, 0.0, "all");
    let nv: Vec<bool> = v.iter().map(|x| !x).collect();
    let b = HostTensor::from_vec(nv, [300, 40]).unwrap();
    let want: Vec<f64> = (0..40).map(|c| if c == 5 { 1.0 } else { 0.0 }).collect();
    check(&red(ReduceKind::Any, &[0], false), &[&b], &want, 0.0, "any");
}

#[test]
fn column_reductions_propagate_nan_and_infinities() {
    let dims = [500usize, 40];
    let mut v = rand(DType::F32, &dims, 91, -1.0, 1.0).to_f64_vec();
    v[3 * 40 + 1] = f64::NAN;
    v[400 * 40 + 2] = f64::INFINITY;
    v[499 * 40 + 39] = f64::NEG_INFINITY;
    let x = HostTensor::from_f64_slice(&ty(DType::F32, &dims), &v).unwrap();
    for kind in [ReduceKind::Sum, ReduceKind::Max, ReduceKind::Min] {
        let want = reference(kind, &v, &dims, &[0]);
        let what = format!("{kind:?} with NaN and infinities");
        check(&red(kind, &[0], false), &[&x], &want, 1e-4, &what);
    }
}

fn ins(op: Op, args: Vec<u32>, dtype: DType) -> FusedInstr {
    FusedInstr { op, args, dtype }
}

/// `in0 · in1` over `out`.
fn mul2(out: TensorType) -> FusedKernel {
    let d = out.dtype;
    FusedKernel {
        n_inputs: 2,
        instrs: vec![ins(Op::Binary(BinaryOp::Mul), vec![0, 1], d)],
        out,
    }
}

fn row(core: Op, prologue: Option<FusedKernel>, epilogue: Option<FusedKernel>) -> Op {
    Op::FusedRow(Box::new(RowFusion {
        core,
        prologue,
        epilogue,
    }))
}

/// `v` rounded to `dt`.
fn rounded(dt: DType, dims: &[usize], v: &[f64]) -> Vec<f64> {
    HostTensor::from_f64_slice(&ty(dt, dims), v)
        .unwrap()
        .to_f64_vec()
}

/// The values of `t` broadcast to `dims`, row-major.
fn broadcast(t: &HostTensor, dims: &[usize]) -> Vec<f64> {
    let v = t.to_f64_vec();
    let strides = t.ty().shape.broadcast_strides(&Shape::new(dims));
    let n: usize = dims.iter().product();
    (0..n)
        .map(|flat| {
            let mut rest = flat;
            let mut at = 0;
            for a in (0..dims.len()).rev() {
                at += (rest % dims[a]) * strides[a];
                rest /= dims[a];
            }
            v[at]
        })
        .collect()
}

/// Whether every launch of the step is a fused reduction kernel.
fn fused(step: &StepKernels) -> bool {
    step.launches
        .iter()
        .all(|l| l.kernel.name.starts_with("fused_reduce_"))
}

#[test]
fn column_sums_of_products() {
    // sum(dY · x) over the rows (LayerNorm-backward's gamma gradient), with dY · x rounded to
    // the dtype as the unfused graph stores it; and with the second operand broadcast along the
    // rows ([C]), along the columns ([R, 1]), and constant along runs shorter than a vector.
    for (seed, &(dims, axes, vectors)) in CASES.iter().enumerate() {
        for dt in FLOATS {
            let x = ty(dt, dims);
            let a = rand(dt, dims, 10 + seed as u64, -2.0, 2.0);
            let b = rand(dt, dims, 20 + seed as u64, -2.0, 2.0);
            let prod: Vec<f64> = (a.to_f64_vec().iter().zip(b.to_f64_vec()))
                .map(|(p, q)| p * q)
                .collect();
            let want = reference(ReduceKind::Sum, &rounded(dt, dims, &prod), dims, axes);
            let tol = match dt {
                DType::F32 => 1e-4,
                d => 2.0 * tolerance(d),
            };
            let op = row(red(ReduceKind::Sum, axes, false), Some(mul2(x)), None);
            let what = format!("{dt} sum(dY * x) {dims:?} over {axes:?}");
            let step = check(&op, &[&a, &b], &want, tol, &what);
            assert!(fused(&step), "{what}");
            assert_eq!(vector_loads(&step), vectors, "{what}");
        }
    }
    for dt in FLOATS {
        for (k, (dims, other)) in [
            (vec![300usize, 40], vec![40usize]),
            (vec![300, 40], vec![300, 1]),
            (vec![200, 8, 3], vec![8, 1]),
            (vec![3000, 24], vec![24]),
        ]
        .into_iter()
        .enumerate()
        {
            let x = ty(dt, &dims);
            let a = rand(dt, &dims, 30 + k as u64, -2.0, 2.0);
            let b = rand(dt, &other, 40 + k as u64, -2.0, 2.0);
            let bb = broadcast(&b, &dims);
            let prod: Vec<f64> = a.to_f64_vec().iter().zip(bb).map(|(p, q)| p * q).collect();
            let want = reference(ReduceKind::Sum, &rounded(dt, &dims, &prod), &dims, &[0]);
            let tol = match dt {
                DType::F32 => 1e-4,
                d => 2.0 * tolerance(d),
            };
            let op = row(red(ReduceKind::Sum, &[0], false), Some(mul2(x)), None);
            let what = format!("{dt} sum(dY * b) {dims:?} with b {other:?}");
            let step = check(&op, &[&a, &b], &want, tol, &what);
            assert!(fused(&step), "{what}");
            assert!(vector_loads(&step), "{what}");
        }
    }
}

#[test]
fn column_sums_through_a_cast_and_an_epilogue() {
    // sum(f32(x)) of a bf16 or f16 tensor: the bias gradient in f32, reading 8 elements a thread.
    for dt in [DType::BF16, DType::F16] {
        for dims in [[3000usize, 40], [64, 24]] {
            let a = rand(dt, &dims, 60, -2.0, 2.0);
            let cast = FusedKernel {
                n_inputs: 1,
                instrs: vec![ins(Op::Cast { to: DType::F32 }, vec![0], DType::F32)],
                out: ty(DType::F32, &dims),
            };
            let op = row(red(ReduceKind::Sum, &[0], false), Some(cast), None);
            let want = reference(ReduceKind::Sum, &a.to_f64_vec(), &dims, &[0]);
            let what = format!("sum(f32({dt})) {dims:?}");
            let step = check(&op, &[&a], &want, 1e-4, &what);
            let src = cuda::source(&step.launches[0].kernel).unwrap();
            assert!(src.contains("rt_vec<rt_"), "{what}: {src}");
        }
    }
    // mean(dY · x) · 2 + c over the rows, c per column: the epilogue at the last stage's stores.
    for dt in FLOATS {
        for dims in [[3000usize, 24], [30, 24]] {
            let c = dims[1];
            let x = ty(dt, &dims);
            let a = rand(dt, &dims, 70, -2.0, 2.0);
            let b = rand(dt, &dims, 71, -2.0, 2.0);
            let bias = rand(dt, &[c], 72, -1.0, 1.0);
            let epi = FusedKernel {
                n_inputs: 2,
                instrs: vec![
                    ins(
                        Op::Full {
                            value: F64Bits::new(2.0),
                            ty: ty(dt, &[]),
                        },
                        vec![],
                        dt,
                    ),
                    ins(Op::Binary(BinaryOp::Mul), vec![0, 2], dt),
                    ins(Op::Binary(BinaryOp::Add), vec![3, 1], dt),
                ],
                out: ty(dt, &[c]),
            };
            let op = row(red(ReduceKind::Mean, &[0], false), Some(mul2(x)), Some(epi));
            let prod: Vec<f64> = (a.to_f64_vec().iter().zip(b.to_f64_vec()))
                .map(|(p, q)| p * q)
                .collect();
            let mean = reference(ReduceKind::Mean, &rounded(dt, &dims, &prod), &dims, &[0]);
            let mean = rounded(dt, &[c], &mean);
            let twice = rounded(dt, &[c], &mean.iter().map(|m| 2.0 * m).collect::<Vec<_>>());
            let want: Vec<f64> = twice
                .iter()
                .zip(bias.to_f64_vec())
                .map(|(t, q)| t + q)
                .collect();
            let tol = match dt {
                DType::F32 => 1e-4,
                d => 2.0 * tolerance(d),
            };
            let what = format!("{dt} mean(dY * x) * 2 + c {dims:?}");
            let step = check(&op, &[&a, &b, &bias], &want, tol, &what);
            assert!(fused(&step), "{what}");
        }
    }
}

#[test]
fn column_placement_at_gpt2_sizes() {
    // bf16 [8192, 768] is 3 blocks of 256 columns (32 lanes of 8) times 128 chunks of 64 rows
    // (8 warps, 8 rows each), then 6 blocks of 128 f32 partial columns; [8192, 3072] 12 blocks
    // of columns times 43 chunks of 192 rows; f32 [8192, 768] 6 blocks times 64 chunks of 128.
    let sum = red(ReduceKind::Sum, &[0], false);
    let grids = |step: &StepKernels| step.launches.iter().map(|l| l.grid).collect::<Vec<_>>();
    let (step, _) = lower(&sum, &[ty(DType::BF16, &[8192, 768])]);
    assert_eq!(grids(&step), [384, 6]);
    assert_eq!(step.scratch_bytes, 128 * 768 * 4);
    let (step, _) = lower(&sum, &[ty(DType::BF16, &[8192, 3072])]);
    assert_eq!(grids(&step), [516, 24]);
    let (step, _) = lower(&sum, &[ty(DType::F32, &[8192, 768])]);
    assert_eq!(grids(&step), [384, 6]);
    // Enough columns fill the GPU in one stage.
    let (step, _) = lower(&sum, &[ty(DType::BF16, &[64, 131072])]);
    assert_eq!(grids(&step), [512]);
}

/// The benchmarked column reductions: the bias gradient `sum(f32(dY), axis 0)` and the gamma
/// gradient `sum(dY · xhat, axis 0)` of bf16 [8192, 768].
#[test]
fn snapshot_bf16_column_sums_8192x768() {
    let x = ty(DType::BF16, &[8192, 768]);
    let cast = FusedKernel {
        n_inputs: 1,
        instrs: vec![ins(Op::Cast { to: DType::F32 }, vec![0], DType::F32)],
        out: ty(DType::F32, &[8192, 768]),
    };
    let sum = red(ReduceKind::Sum, &[0], false);
    let mut src = String::new();
    for (op, ins) in [
        (row(sum.clone(), Some(cast), None), vec![x.clone()]),
        (row(sum, Some(mul2(x.clone())), None), vec![x.clone(), x]),
    ] {
        let (step, _) = lower(&op, &ins);
        for l in &step.launches {
            src.push_str(&format!(
                "// grid {} args {:?}\n{}\n",
                l.grid,
                l.args,
                cuda::source(&l.kernel).unwrap()
            ));
        }
    }
    insta::assert_snapshot!(src);
}
