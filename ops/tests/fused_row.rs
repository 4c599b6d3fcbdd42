//! The fused row op's CPU kernel: the prologue, the core and the epilogue in turn equal the three
//! unfused kernels bit for bit, and agree with a float64 evaluation of the same formula on random
//! inputs (f32/f16/bf16, odd row lengths); malformed fused row ops are errors naming the op.

use rustytorch_ops::testing::{assert_close, rand_tensor, tolerance};
use rustytorch_ops::{
    eval_cpu, infer, BinaryOp, DType, F64Bits, FusedInstr, FusedKernel, HostTensor, Op, OpError,
    ReduceKind, RowFusion, Shape, TensorType, UnaryOp,
};

fn ty(dt: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dt, Shape::new(dims))
}

fn bin(op: BinaryOp, a: u32, b: u32, dtype: DType) -> FusedInstr {
    FusedInstr {
        op: Op::Binary(op),
        args: vec![a, b],
        dtype,
    }
}

/// `in0 + in1` over `out`.
fn add2(out: TensorType) -> FusedKernel {
    FusedKernel {
        n_inputs: 2,
        instrs: vec![bin(BinaryOp::Add, 0, 1, out.dtype)],
        out,
    }
}

/// `exp(in0) · in1`, reading the core's result as input 0.
fn exp_mul(out: TensorType) -> FusedKernel {
    let d = out.dtype;
    FusedKernel {
        n_inputs: 2,
        instrs: vec![
            FusedInstr {
                op: Op::Unary(UnaryOp::Exp),
                args: vec![0],
                dtype: d,
            },
            bin(BinaryOp::Mul, 2, 1, d),
        ],
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

fn layer_norm() -> Op {
    Op::LayerNorm {
        eps: F64Bits::new(1e-5),
        weight: true,
        bias: false,
    }
}

fn bits(t: &HostTensor) -> Vec<u64> {
    t.to_f64_vec().iter().map(|v| v.to_bits()).collect()
}

/// `exp(layer_norm(a + b) · w) · z` in f64, row by row.
fn reference(a: &[f64], b: &[f64], w: &[f64], z: &[f64], d: usize) -> Vec<f64> {
    let mut out = vec![];
    for r in 0..a.len() / d {
        let x: Vec<f64> = (0..d).map(|k| a[r * d + k] + b[r * d + k]).collect();
        let mean = x.iter().sum::<f64>() / d as f64;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
        let rstd = 1.0 / (var + 1e-5).sqrt();
        for k in 0..d {
            out.push(((x[k] - mean) * rstd * w[k]).exp() * z[r * d + k]);
        }
    }
    out
}

#[test]
fn the_parts_in_turn_are_the_unfused_kernels() {
    for dt in [DType::F32, DType::F16, DType::BF16] {
        for d in [1usize, 7, 64, 129] {
            let x = ty(dt, &[5, d]);
            let a = rand_tensor(&x, 1, -2.0, 2.0);
            let b = rand_tensor(&x, 2, -2.0, 2.0);
            let w = rand_tensor(&ty(dt, &[d]), 3, -1.0, 1.0);
            let z = rand_tensor(&x, 4, -2.0, 2.0);
            let op = row(
                layer_norm(),
                Some(add2(x.clone())),
                Some(exp_mul(x.clone())),
            );
            let got = eval_cpu(&op, &[&a, &b, &w, &z]).unwrap();
            let s = eval_cpu(&Op::Fused(Box::new(add2(x.clone()))), &[&a, &b]).unwrap();
            let n = eval_cpu(&layer_norm(), &[&s, &w]).unwrap();
            let want = eval_cpu(&Op::Fused(Box::new(exp_mul(x.clone()))), &[&n, &z]).unwrap();
            assert_eq!(got.ty(), want.ty());
            assert_eq!(bits(&got), bits(&want), "{dt} d={d}");
            // Against f64: the unfused graph rounds the sum and the norm to the dtype.
            let r = reference(
                &a.to_f64_vec(),
                &b.to_f64_vec(),
                &w.to_f64_vec(),
                &z.to_f64_vec(),
                d,
            );
            let tol = if dt == DType::F32 {
                1e-4
            } else {
                8.0 * tolerance(dt)
            };
            assert_close(&got.to_f64_vec(), &r, tol, &format!("{dt} d={d} vs f64"));
        }
    }
}

#[test]
fn a_reduction_core_keeps_its_result_shape() {
    let x = ty(DType::F32, &[4, 9]);
    let a = rand_tensor(&x, 5, -2.0, 2.0);
    let b = rand_tensor(&x, 6, -2.0, 2.0);
    let sum = Op::Reduce {
        kind: ReduceKind::Sum,
        axes: vec![1],
        keep_dims: false,
    };
    let mul = FusedKernel {
        n_inputs: 2,
        instrs: vec![bin(BinaryOp::Mul, 0, 1, DType::F32)],
        out: x.clone(),
    };
    let got = eval_cpu(&row(sum, Some(mul), None), &[&a, &b]).unwrap();
    assert_eq!(got.ty(), ty(DType::F32, &[4]));
    let (av, bv) = (a.to_f64_vec(), b.to_f64_vec());
    let want: Vec<f64> = (0..4)
        .map(|r| (0..9).map(|k| av[r * 9 + k] * bv[r * 9 + k]).sum())
        .collect();
    assert_close(&got.to_f64_vec(), &want, 1e-5, "sum(x*y)");
}

#[test]
fn malformed_fused_rows_are_errors() {
    let x = ty(DType::F32, &[4, 8]);
    let w = ty(DType::F32, &[8]);
    let err = |op: &Op, ins: &[&TensorType]| -> OpError { infer(op, ins).unwrap_err() };
    // Not a row op as the core.
    let e = err(&row(Op::Binary(BinaryOp::Add), None, None), &[&x]);
    assert!(e.to_string().contains("cannot be the core"), "{e}");
    // Too few operands (the norm's weight is missing).
    let e = err(&row(layer_norm(), Some(add2(x.clone())), None), &[&x, &x]);
    assert!(matches!(e, OpError::Arity { .. }), "{e}");
    // An epilogue of another shape than the core's result.
    let wide = FusedKernel {
        n_inputs: 1,
        instrs: vec![FusedInstr {
            op: Op::Unary(UnaryOp::Neg),
            args: vec![0],
            dtype: DType::F32,
        }],
        out: ty(DType::F32, &[2, 4, 8]),
    };
    let e = err(&row(layer_norm(), None, Some(wide)), &[&x, &w]);
    assert!(e.to_string().contains("shape"), "{e}");
    // An epilogue that does not read the core's result.
    let none = FusedKernel {
        n_inputs: 0,
        instrs: vec![],
        out: x.clone(),
    };
    let e = err(&row(layer_norm(), None, Some(none)), &[&x, &w]);
    assert!(e.to_string().contains("input 0"), "{e}");
    // A prologue whose result the core does not accept (an integer for a norm).
    let to_int = FusedKernel {
        n_inputs: 1,
        instrs: vec![FusedInstr {
            op: Op::Cast { to: DType::I32 },
            args: vec![0],
            dtype: DType::I32,
        }],
        out: ty(DType::I32, &[4, 8]),
    };
    assert!(infer(&row(layer_norm(), Some(to_int), None), &[&x, &w]).is_err());
    // And the kernel refuses wrong operands instead of panicking.
    let a = rand_tensor(&x, 7, -1.0, 1.0);
    assert!(eval_cpu(&row(layer_norm(), None, None), &[&a]).is_err());
}

#[test]
fn fused_rows_are_not_differentiated() {
    let x = ty(DType::F64, &[2, 3]);
    let w = ty(DType::F64, &[3]);
    let op = row(layer_norm(), Some(add2(x.clone())), None);
    let a = rand_tensor(&x, 8, -1.0, 1.0);
    let b = rand_tensor(&x, 9, -1.0, 1.0);
    let wt = rand_tensor(&w, 10, -1.0, 1.0);
    let y = eval_cpu(&op, &[&a, &b, &wt]).unwrap();
    let e = rustytorch_ops::testing::vjp_eager(&op, &[a, b, wt], &y).unwrap_err();
    assert!(e.to_string().contains("after differentiation"), "{e}");
}
