//! The CUDA kernels of fused row ops (a norm, softmax or reduction with an elementwise prologue
//! and epilogue) against the CPU kernel, run through the IR interpreter: the one-pass row kernels
//! (operands of the row's shape, broadcast along the rows or constant along them, dtypes mixed),
//! and the composed form for odd row lengths and reductions; snapshots of a fused kernel's source.

use rustytorch_codegen::cuda::{self, interp, ArgRef, CudaStep, StepKernels};
use rustytorch_ops::testing::{assert_close, rand_tensor, tolerance};
use rustytorch_ops::{
    bf16, eval_cpu, f16, infer, BinaryOp, DType, F64Bits, FusedInstr, FusedKernel, HostTensor, Op,
    ReduceKind, RowFusion, Shape, TensorType, UnaryOp,
};

fn ty(dt: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dt, Shape::new(dims))
}

fn rand(dt: DType, dims: &[usize], seed: u64) -> HostTensor {
    rand_tensor(&ty(dt, dims), seed, -2.0, 2.0)
}

fn ins(op: Op, args: Vec<u32>, dtype: DType) -> FusedInstr {
    FusedInstr { op, args, dtype }
}

fn imm(v: f64, dtype: DType) -> FusedInstr {
    ins(
        Op::Full {
            value: F64Bits::new(v),
            ty: ty(dtype, &[]),
        },
        vec![],
        dtype,
    )
}

fn bin(op: BinaryOp, a: u32, b: u32, dtype: DType) -> FusedInstr {
    ins(Op::Binary(op), vec![a, b], dtype)
}

/// `in0 + in1` over `out`.
fn add2(out: TensorType) -> FusedKernel {
    let d = out.dtype;
    FusedKernel {
        n_inputs: 2,
        instrs: vec![bin(BinaryOp::Add, 0, 1, d)],
        out,
    }
}

/// `in0 · scale + in1` (softmax's scaled scores plus a mask).
fn scale_add(out: TensorType, scale: f64) -> FusedKernel {
    let d = out.dtype;
    FusedKernel {
        n_inputs: 2,
        instrs: vec![
            imm(scale, d),
            bin(BinaryOp::Mul, 0, 2, d),
            bin(BinaryOp::Add, 3, 1, d),
        ],
        out,
    }
}

/// `in0 · 0.5 + in1`.
fn half_add(out: TensorType) -> FusedKernel {
    scale_add(out, 0.5)
}

fn row(core: Op, prologue: Option<FusedKernel>, epilogue: Option<FusedKernel>) -> Op {
    Op::FusedRow(Box::new(RowFusion {
        core,
        prologue,
        epilogue,
    }))
}

fn layer_norm(weight: bool, bias: bool) -> Op {
    Op::LayerNorm {
        eps: F64Bits::new(1e-5),
        weight,
        bias,
    }
}

/// A float tensor as little-endian bytes.
fn bytes(t: &HostTensor) -> Vec<u8> {
    let v = t.to_f64_vec();
    match t.dtype() {
        DType::F64 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F32 => v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
        DType::F16 => v
            .iter()
            .flat_map(|&x| f16::from_f64(x).to_bits().to_le_bytes())
            .collect(),
        DType::BF16 => v
            .iter()
            .flat_map(|&x| bf16::from_f64(x).to_bits().to_le_bytes())
            .collect(),
        d => panic!("no byte view of {d} here"),
    }
}

/// Float bytes back to values.
fn values(b: &[u8], d: DType) -> Vec<f64> {
    match d {
        DType::F64 => b
            .chunks(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::F32 => b
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        DType::F16 => b
            .chunks(2)
            .map(|c| f16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f64())
            .collect(),
        DType::BF16 => b
            .chunks(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f64())
            .collect(),
        d => panic!("no byte view of {d} here"),
    }
}

/// Runs a step's launches in the interpreter, binding scratch offsets ([`ArgRef::ScratchAt`]) as
/// the runtime does: each launch sees the scratch from that offset on.
fn run(step: &StepKernels, inputs: &[&HostTensor], out: &TensorType) -> Vec<f64> {
    let mut input_bytes: Vec<Vec<u8>> = inputs.iter().map(|t| bytes(t)).collect();
    let mut y = vec![0xA5u8; out.shape.numel() * out.dtype.size_bytes()];
    let mut scratch = vec![0xA5u8; step.scratch_bytes];
    for l in &step.launches {
        let mut bufs: Vec<Vec<u8>> = l
            .args
            .iter()
            .map(|a| match *a {
                ArgRef::Input(i) => input_bytes[i].clone(),
                ArgRef::Output => y.clone(),
                ArgRef::Scratch => scratch.clone(),
                ArgRef::ScratchAt(o) => scratch[o..].to_vec(),
                ArgRef::With(_) | ArgRef::Value(_) => {
                    panic!("{}: a row step binds its own buffers", l.kernel.name)
                }
            })
            .collect();
        interp::run_launch(&l.kernel, l.grid, &mut bufs)
            .unwrap_or_else(|e| panic!("{}: {e}", l.kernel.name));
        for (a, b) in l.args.iter().zip(bufs) {
            match *a {
                ArgRef::Input(i) => input_bytes[i] = b,
                ArgRef::Output => y = b,
                ArgRef::Scratch => scratch = b,
                ArgRef::ScratchAt(o) => scratch[o..].copy_from_slice(&b),
                ArgRef::With(_) | ArgRef::Value(_) => unreachable!("refused above"),
            }
        }
    }
    values(&y, out.dtype)
}

/// Lowers `op`, checks every kernel prints, runs it in the interpreter and compares with the CPU
/// kernel; returns the step.
fn check(op: &Op, inputs: &[&HostTensor], what: &str) -> StepKernels {
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let out = infer(op, &refs).unwrap_or_else(|e| panic!("{what}: {e}"));
    let step = match cuda::lower_step(op, &refs, &out) {
        Ok(CudaStep::Kernels(k)) => k,
        other => panic!("{what}: {other:?}"),
    };
    for l in &step.launches {
        cuda::source(&l.kernel).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    let got = run(&step, inputs, &out);
    let want = eval_cpu(op, inputs).unwrap_or_else(|e| panic!("{what}: CPU: {e}"));
    // The kernels round where the CPU does; the statistics' order of additions differs.
    assert_close(&got, &want.to_f64_vec(), 2.0 * tolerance(out.dtype), what);
    step
}

/// Whether the step is one fused one-pass row kernel.
fn one_pass(step: &StepKernels) -> bool {
    step.launches.len() == 1 && step.launches[0].kernel.name.starts_with("fused_")
}

const FLOATS: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];

#[test]
fn layer_norm_of_a_sum_is_one_pass() {
    for dt in FLOATS {
        for &(rows, d) in &[(3, 64), (5, 768), (2, 4096), (33, 32)] {
            let x = ty(dt, &[rows, d]);
            let op = row(layer_norm(true, true), Some(add2(x.clone())), None);
            let a = rand(dt, &[rows, d], 1);
            let b = rand(dt, &[rows, d], 2);
            let w = rand(dt, &[d], 3);
            let bias = rand(dt, &[d], 4);
            let step = check(&op, &[&a, &b, &w, &bias], &format!("{dt} {rows}x{d}"));
            assert!(
                one_pass(&step),
                "{dt} {rows}x{d}: {:?}",
                step.launches.len()
            );
        }
    }
}

#[test]
fn softmax_of_scaled_scores_plus_a_broadcast_mask() {
    for dt in [DType::F32, DType::BF16, DType::F16] {
        // Scores [B, H, Sq, Sk] and a mask [B, 1, 1, Sk] (along the rows, per batch).
        let s = ty(dt, &[2, 3, 5, 64]);
        let op = row(
            Op::Softmax { axis: 3 },
            Some(scale_add(s.clone(), 0.125)),
            None,
        );
        let x = rand(dt, &[2, 3, 5, 64], 5);
        let m = rand(dt, &[2, 1, 1, 64], 6);
        let step = check(&op, &[&x, &m], &format!("{dt} mask"));
        assert!(one_pass(&step));
        // A per-row value (constant along each row) and a scalar.
        let op = row(
            Op::LogSoftmax { axis: 3 },
            Some(scale_add(s.clone(), -0.5)),
            None,
        );
        let r = rand(dt, &[2, 3, 5, 1], 7);
        assert!(one_pass(&check(&op, &[&x, &r], &format!("{dt} per row"))));
        let one = rand(dt, &[], 8);
        assert!(one_pass(&check(&op, &[&x, &one], &format!("{dt} scalar"))));
    }
}

#[test]
fn rms_norm_of_a_bias_add_with_an_epilogue() {
    for dt in FLOATS {
        let x = ty(dt, &[7, 256]);
        let op = row(
            Op::RmsNorm {
                eps: F64Bits::new(1e-6),
                weight: true,
            },
            Some(add2(x.clone())),
            Some(half_add(x.clone())),
        );
        let a = rand(dt, &[7, 256], 9);
        let bias = rand(dt, &[256], 10);
        let w = rand(dt, &[256], 11);
        let z = rand(dt, &[7, 256], 12);
        assert!(one_pass(&check(
            &op,
            &[&a, &bias, &w, &z],
            &format!("{dt}")
        )));
    }
}

#[test]
fn epilogues_change_the_dtype() {
    // cast(softmax(x)) to f16 and f32, and layer_norm(x) · 0.5 + z.
    for (from, to) in [
        (DType::F32, DType::F16),
        (DType::BF16, DType::F32),
        (DType::F16, DType::F64),
    ] {
        let cast = FusedKernel {
            n_inputs: 1,
            instrs: vec![ins(Op::Cast { to }, vec![0], to)],
            out: ty(to, &[4, 128]),
        };
        let op = row(Op::Softmax { axis: 1 }, None, Some(cast));
        let a = rand(from, &[4, 128], 13);
        assert!(one_pass(&check(&op, &[&a], &format!("{from} -> {to}"))));
    }
    let x = ty(DType::BF16, &[3, 512]);
    let op = row(layer_norm(false, false), None, Some(half_add(x.clone())));
    let a = rand(DType::BF16, &[3, 512], 14);
    let z = rand(DType::BF16, &[3, 512], 15);
    assert!(one_pass(&check(&op, &[&a, &z], "layer_norm(x) * 0.5 + z")));
}

#[test]
fn odd_rows_and_reductions_run_their_parts_in_one_step() {
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for d in [1usize, 7, 9, 33] {
            let x = ty(dt, &[5, d]);
            let op = row(
                layer_norm(true, false),
                Some(add2(x.clone())),
                Some(half_add(x.clone())),
            );
            let a = rand(dt, &[5, d], 16);
            let b = rand(dt, &[5, d], 17);
            let w = rand(dt, &[d], 18);
            let z = rand(dt, &[5, d], 19);
            let step = check(&op, &[&a, &b, &w, &z], &format!("{dt} d={d}"));
            assert_eq!(step.launches.len(), 3, "{dt} d={d}");
        }
    }
}

/// Whether every launch of the step is a fused reduction kernel (one, or two stages).
fn fused_reduction(step: &StepKernels, launches: usize) -> bool {
    step.launches.len() == launches
        && step
            .launches
            .iter()
            .all(|l| l.kernel.name.starts_with("fused_reduce_"))
}

#[test]
fn reductions_load_through_the_prologue_and_store_through_the_epilogue() {
    for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        // sum(x · y) over the last axis (a warp per row), over the first (columns), and over a
        // long last axis (two stages); sqrt(mean(x · x)) keeping dims; max(x + bias) · 2.
        for &(dims, axes, launches) in &[
            (&[6usize, 33][..], &[1usize][..], 1),
            (&[65, 40][..], &[0][..], 1),
            (&[2, 3, 5][..], &[0, 2][..], 1),
            (&[2, 40000][..], &[1][..], 2),
        ] {
            let x = ty(dt, dims);
            let mul = FusedKernel {
                n_inputs: 2,
                instrs: vec![bin(BinaryOp::Mul, 0, 1, dt)],
                out: x.clone(),
            };
            let sum = Op::Reduce {
                kind: ReduceKind::Sum,
                axes: axes.to_vec(),
                keep_dims: false,
            };
            let a = rand(dt, dims, 20);
            let b = rand(dt, dims, 21);
            let what = format!("{dt} sum(x*y) {dims:?} over {axes:?}");
            let step = check(&row(sum, Some(mul), None), &[&a, &b], &what);
            assert!(fused_reduction(&step, launches), "{what}");
        }
        let x = ty(dt, &[6, 33]);
        let a = rand(dt, &[6, 33], 22);
        let square = FusedKernel {
            n_inputs: 1,
            instrs: vec![bin(BinaryOp::Mul, 0, 0, dt)],
            out: x.clone(),
        };
        let sqrt = FusedKernel {
            n_inputs: 1,
            instrs: vec![ins(Op::Unary(UnaryOp::Sqrt), vec![0], dt)],
            out: ty(dt, &[6, 1]),
        };
        let mean = Op::Reduce {
            kind: ReduceKind::Mean,
            axes: vec![1],
            keep_dims: true,
        };
        let what = format!("{dt} sqrt(mean(x*x))");
        let step = check(&row(mean, Some(square), Some(sqrt)), &[&a], &what);
        assert!(fused_reduction(&step, 1), "{what}");
        // max(x + bias) over the last axis, then · 2 + a per-row value.
        let bias = rand(dt, &[33], 23);
        let per_row = rand(dt, &[6], 24);
        let max = Op::Reduce {
            kind: ReduceKind::Max,
            axes: vec![1],
            keep_dims: false,
        };
        let step = check(
            &row(
                max,
                Some(add2(x.clone())),
                Some(scale_add(ty(dt, &[6]), 2.0)),
            ),
            &[&a, &bias, &per_row],
            &format!("{dt} max(x + b) * 2 + c"),
        );
        assert!(fused_reduction(&step, 1));
    }
}

#[test]
fn fused_layer_norm_kernel_source() {
    let x = ty(DType::BF16, &[4, 64]);
    let op = row(layer_norm(true, true), Some(add2(x.clone())), None);
    let w = ty(DType::BF16, &[64]);
    let out = x.clone();
    let step = match cuda::lower_step(&op, &[&x, &x, &w, &w], &out).unwrap() {
        CudaStep::Kernels(k) => k,
        other => panic!("{other:?}"),
    };
    assert_eq!(step.launches.len(), 1);
    insta::assert_snapshot!(cuda::source(&step.launches[0].kernel).unwrap());
}

#[test]
fn fused_sum_of_products_kernel_source() {
    let x = ty(DType::BF16, &[8, 64]);
    let mul = FusedKernel {
        n_inputs: 2,
        instrs: vec![bin(BinaryOp::Mul, 0, 1, DType::BF16)],
        out: x.clone(),
    };
    let sum = Op::Reduce {
        kind: ReduceKind::Sum,
        axes: vec![1],
        keep_dims: false,
    };
    let op = row(sum, Some(mul), None);
    let out = ty(DType::BF16, &[8]);
    let step = match cuda::lower_step(&op, &[&x, &x], &out).unwrap() {
        CudaStep::Kernels(k) => k,
        other => panic!("{other:?}"),
    };
    assert_eq!(step.launches.len(), 1);
    insta::assert_snapshot!(cuda::source(&step.launches[0].kernel).unwrap());
}

#[test]
fn reductions_over_whole_vectors_are_one_pass() {
    // sum(x · y), and max(x + bias) · 2 + c with c per row (broadcast over the leading dim),
    // over a last axis of whole 16-byte vectors: the one-pass row kernel, kept dims or not.
    for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let d = 96 * (16 / dt.size_bytes());
        let dims = [2usize, 3, d];
        let x = ty(dt, &dims);
        let mul = FusedKernel {
            n_inputs: 2,
            instrs: vec![bin(BinaryOp::Mul, 0, 1, dt)],
            out: x.clone(),
        };
        let a = rand(dt, &dims, 30);
        let b = rand(dt, &dims, 31);
        for keep_dims in [false, true] {
            let sum = Op::Reduce {
                kind: ReduceKind::Sum,
                axes: vec![2],
                keep_dims,
            };
            let what = format!("{dt} sum(x*y) keep {keep_dims}");
            let step = check(&row(sum, Some(mul.clone()), None), &[&a, &b], &what);
            assert!(fused_reduction(&step, 1), "{what}");
            assert!(step.launches[0].kernel.name.contains("_rows_"), "{what}");
            let bias = rand(dt, &[d], 32);
            let (out, per_row) = if keep_dims {
                (ty(dt, &[2, 3, 1]), rand(dt, &[3, 1], 33))
            } else {
                (ty(dt, &[2, 3]), rand(dt, &[3], 33))
            };
            let max = Op::Reduce {
                kind: ReduceKind::Max,
                axes: vec![2],
                keep_dims,
            };
            let what = format!("{dt} max(x + b) * 2 + c keep {keep_dims}");
            let step = check(
                &row(max, Some(add2(x.clone())), Some(scale_add(out, 2.0))),
                &[&a, &bias, &per_row],
                &what,
            );
            assert!(fused_reduction(&step, 1), "{what}");
            assert!(step.launches[0].kernel.name.contains("_rows_"), "{what}");
        }
    }
}
