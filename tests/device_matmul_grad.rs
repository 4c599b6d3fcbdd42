//! `matmul_act_grad` (`(op(A)·op(B)) ⊙ act'(pre)`) on CUDA against the CPU kernel (itself checked
//! against float64 in `ops/tests/matmul_act_grad.rs`):
//! - everywhere: the CUDA lowering run on the host — the cuBLASLt call through the interpreter's
//!   model of it (`DGELU` with the pre-activation as aux input), the fallback kernel through the
//!   kernel interpreter — for every float dtype and activation, batched, broadcast and transposed
//!   operands, N a multiple of 8 or not; the generated kernels compile with NVRTC where it loads;
//! - on the test device (CUDA where `RUSTYTORCH_TEST_CUDA=1`, else the CPU executable): the op in
//!   a graph for f16/bf16/f32/f64 and the same shapes, and a few training steps of the MLP whose
//!   backward forms the op, against the CPU.

use rustytorch::codegen::cuda::matmul::LtActivation;
use rustytorch::codegen::cuda::{interp, lower_step, source, CudaStep};
use rustytorch::ops::testing::{assert_close, rand_tensor, tolerance};
use rustytorch::ops::{eval_cpu, infer, Activation, Op, Shape, TensorType};
use rustytorch::prelude::*;

#[path = "common/one_op.rs"]
mod one_op;
use rustytorch::runtime::cuda::compile::KernelCompiler;

fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

fn device() -> Device {
    if cuda() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    }
}

const ACTS: [Activation; 3] = [Activation::GeluTanh, Activation::GeluErf, Activation::Relu];
const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// (batch dims of a, of b, m, k, n, trans_a, trans_b): plain, N not a multiple of 8, transposed
/// operands, a strided batch, a broadcast weight (GPT-2's `[B, S, D]·W`), a batch broadcast no
/// single strided call expresses.
const SHAPES: [(&[usize], &[usize], usize, usize, usize, bool, bool); 7] = [
    (&[], &[], 24, 40, 64, false, true),
    (&[], &[], 9, 7, 20, false, false),
    (&[], &[], 16, 24, 32, true, false),
    (&[], &[], 8, 16, 24, true, true),
    (&[3], &[3], 5, 12, 16, false, true),
    (&[2, 4], &[], 6, 16, 40, false, true),
    (&[2, 1], &[3], 4, 8, 16, false, false),
];

fn stored(batch: &[usize], r: usize, c: usize, t: bool) -> Vec<usize> {
    let mut d = batch.to_vec();
    d.extend(if t { [c, r] } else { [r, c] });
    d
}

/// The op and its operands for one case.
fn case(
    dt: DType,
    act: Activation,
    shape: (&[usize], &[usize], usize, usize, usize, bool, bool),
    seed: u64,
) -> (Op, Vec<HostTensor>) {
    let (ba, bb, m, k, n, ta, tb) = shape;
    let a = rand_tensor(&TensorType::new(dt, stored(ba, m, k, ta)), seed, -1.0, 1.0);
    let b = rand_tensor(
        &TensorType::new(dt, stored(bb, k, n, tb)),
        seed + 1,
        -1.0,
        1.0,
    );
    let mut od = Shape::broadcast(&Shape::new(ba), &Shape::new(bb))
        .unwrap()
        .dims()
        .to_vec();
    od.extend([m, n]);
    let pre = rand_tensor(&TensorType::new(dt, od), seed + 2, -3.0, 3.0);
    let op = Op::MatmulActGrad {
        trans_a: ta,
        trans_b: tb,
        act,
    };
    (op, vec![a, b, pre])
}

/// Tolerance of a k-term product against the CPU (different summation orders and roundings).
fn tol(dt: DType, k: usize) -> f64 {
    tolerance(dt) * 2.0 * (k as f64).sqrt()
}

#[test]
fn cuda_lowering_runs_on_the_host_as_the_cpu_kernel() {
    let mut seed = 100;
    for dt in FLOATS {
        for act in ACTS {
            for shape in SHAPES {
                seed += 3;
                let (op, ins) = case(dt, act, shape, seed);
                let tys: Vec<TensorType> = ins.iter().map(|t| t.ty()).collect();
                let refs: Vec<&TensorType> = tys.iter().collect();
                let out = infer(&op, &refs).unwrap();
                let CudaStep::Matmul { desc, after, .. } = lower_step(&op, &refs, &out).unwrap()
                else {
                    panic!("{op}: a matmul step");
                };
                let n = shape.4;
                let one_call = act == Activation::GeluTanh && dt != DType::F64 && n % 8 == 0;
                assert_eq!(
                    desc.act == LtActivation::DGeluTanh,
                    one_call,
                    "{dt} {act:?} n={n}: {desc:?}"
                );
                assert_eq!(
                    after.launches.len(),
                    !one_call as usize,
                    "{dt} {act:?} n={n}"
                );
                assert!(!desc.bias);
                let ins_ref: Vec<&HostTensor> = ins.iter().collect();
                let got = interp::run_matmul_step(&desc, &after, &ins_ref, &out).unwrap();
                let want = eval_cpu(&op, &ins_ref).unwrap();
                assert_close(
                    &got.to_f64_vec(),
                    &want.to_f64_vec(),
                    tol(dt, shape.3),
                    &format!("{dt} {act:?} {shape:?}"),
                );
            }
        }
    }
}

/// The lowering refuses a pre-activation that is not the result's type (inference already does;
/// the lowering does not trust its caller).
#[test]
fn the_lowering_checks_the_pre_activation() {
    let f = |d: &[usize]| TensorType::new(DType::F32, d.to_vec());
    let op = Op::MatmulActGrad {
        trans_a: false,
        trans_b: false,
        act: Activation::GeluTanh,
    };
    let (a, b, out) = (f(&[4, 8]), f(&[8, 16]), f(&[4, 16]));
    let e = lower_step(&op, &[&a, &b, &f(&[16])], &out).unwrap_err();
    assert!(e.to_string().contains("pre-activation"), "{e}");
}

/// The fallback kernels compile with NVRTC for sm_80 and sm_90 (skipped where NVRTC does not load,
/// unless `RUSTYTORCH_TEST_NVRTC=1`).
#[test]
fn act_grad_kernels_compile() {
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
    let mut sources = vec![];
    for dt in FLOATS {
        for act in ACTS {
            // N = 20: the scalar kernel; N = 64 over 24 rows: the vector kernel.
            for shape in [SHAPES[0], SHAPES[1]] {
                let (op, ins) = case(dt, act, shape, 7);
                let tys: Vec<TensorType> = ins.iter().map(|t| t.ty()).collect();
                let refs: Vec<&TensorType> = tys.iter().collect();
                let out = infer(&op, &refs).unwrap();
                let CudaStep::Matmul { after, .. } = lower_step(&op, &refs, &out).unwrap() else {
                    panic!("a matmul step");
                };
                for l in &after.launches {
                    sources.push((l.kernel.name.clone(), source(&l.kernel).unwrap()));
                }
            }
        }
    }
    assert!(sources.len() >= 16, "{} kernels", sources.len());
    for c in &compilers {
        for (name, src) in &sources {
            c.cubin(name, src)
                .unwrap_or_else(|e| panic!("{name}: {e}\n{src}"));
        }
    }
}

/// Runs `op` as a one-node graph on the test device (unoptimized, so the op is what runs).
fn on_device(op: &Op, ins: &[HostTensor]) -> HostTensor {
    one_op::run_one_op(op, ins, device()).unwrap()
}

#[test]
fn device_matches_cpu() {
    let mut seed = 500;
    for dt in FLOATS {
        for act in ACTS {
            for shape in SHAPES {
                seed += 3;
                let (op, ins) = case(dt, act, shape, seed);
                let refs: Vec<&HostTensor> = ins.iter().collect();
                let want = eval_cpu(&op, &refs).unwrap();
                let got = on_device(&op, &ins);
                assert_eq!(got.ty(), want.ty());
                assert_close(
                    &got.to_f64_vec(),
                    &want.to_f64_vec(),
                    tol(dt, shape.3),
                    &format!("{:?} {dt} {act:?} {shape:?}", device()),
                );
            }
        }
    }
}

/// A training step of `x → linear → gelu_tanh → linear → mse` whose backward forms the op
/// (`dims` of x: [rows, 64] or [batch, seq, 64]), on the test device against the CPU.
#[test]
fn mlp_training_on_device_matches_cpu() {
    for dims in [vec![64usize, 64], vec![2, 32, 64]] {
        let run = |dev: Device| {
            let g = GraphBuilder::new();
            let x = g.input("x", DType::F32, dims.clone());
            let mut yd = dims.clone();
            *yd.last_mut().unwrap() = 32;
            let y = g.input("y", DType::F32, yd.clone());
            let w1 = g.param("w1", [64, 128], Init::kaiming_uniform(64, 1));
            let b1 = g.param("b1", [128], Init::Full(0.1));
            let w2 = g.param("w2", [128, 32], Init::kaiming_uniform(128, 2));
            let out = x.matmul(&w1).add(&b1).gelu_tanh().matmul(&w2);
            let loss = out.mse_loss(&y);
            g.train_step(&loss, Sgd::new(0.05), &StepOptions::default())
                .unwrap();
            let mut exe = compile(&g, &[&loss], dev).unwrap();
            assert!(
                exe.optimized_ir()
                    .contains("matmul_act_grad[trans_b,act=gelu_tanh]"),
                "{}",
                exe.optimized_ir()
            );
            let n: usize = dims.iter().product();
            let xs = rustytorch::ops::testing::rand_f64(n, 3, -2.0, 2.0);
            let ys = rustytorch::ops::testing::rand_f64(n / 2, 4, -1.0, 1.0);
            let xt =
                HostTensor::from_vec(xs.iter().map(|&v| v as f32).collect(), dims.clone()).unwrap();
            let yt = HostTensor::from_vec(ys.iter().map(|&v| v as f32).collect(), yd).unwrap();
            let losses: Vec<f64> = (0..3)
                .map(|_| {
                    exe.run(&[("x", xt.clone()), ("y", yt.clone())]).unwrap()[0].to_f64_vec()[0]
                })
                .collect();
            (losses, exe.param("w1").unwrap().to_f64_vec())
        };
        let (lg, wg) = run(device());
        let (lc, wc) = run(Device::Cpu);
        assert_close(&lg, &lc, 1e-4, &format!("losses {dims:?}"));
        assert_close(&wg, &wc, 1e-4, &format!("w1 {dims:?}"));
    }
}

/// The forward epilogues' lowering run on the host as well: cuBLASLt's bias/ReLU/tanh-GELU
/// through the interpreter's model of the call, the erf GELU (and every f64 epilogue) through the
/// generated bias + activation kernel after it, against the CPU kernel.
#[test]
fn forward_epilogues_run_on_the_host_as_the_cpu_kernel() {
    let mut seed = 500;
    for dt in FLOATS {
        for act in [Activation::None, ACTS[0], ACTS[1], ACTS[2]] {
            for bias in [false, true] {
                // N a multiple of 8 (vector epilogue kernel) and not (one element a thread).
                for (m, k, n) in [(24, 40, 64), (9, 7, 20)] {
                    seed += 3;
                    let a = rand_tensor(&TensorType::new(dt, vec![m, k]), seed, -1.0, 1.0);
                    let b = rand_tensor(&TensorType::new(dt, vec![k, n]), seed + 1, -1.0, 1.0);
                    let c = rand_tensor(&TensorType::new(dt, vec![n]), seed + 2, -1.0, 1.0);
                    let op = Op::MatmulEpilogue {
                        trans_a: false,
                        trans_b: false,
                        bias,
                        act,
                        accumulate: false,
                    };
                    let mut ins = vec![a, b];
                    if bias {
                        ins.push(c);
                    }
                    let tys: Vec<TensorType> = ins.iter().map(|t| t.ty()).collect();
                    let refs: Vec<&TensorType> = tys.iter().collect();
                    let out = infer(&op, &refs).unwrap();
                    let CudaStep::Matmul { desc, after, .. } =
                        lower_step(&op, &refs, &out).unwrap()
                    else {
                        panic!("{op}: a matmul step");
                    };
                    let kernel = dt == DType::F64 && (bias || act != Activation::None)
                        || act == Activation::GeluErf;
                    assert_eq!(after.launches.len(), kernel as usize, "{dt} {op}");
                    let ins_ref: Vec<&HostTensor> = ins.iter().collect();
                    let got = interp::run_matmul_step(&desc, &after, &ins_ref, &out).unwrap();
                    let want = eval_cpu(&op, &ins_ref).unwrap();
                    assert_close(
                        &got.to_f64_vec(),
                        &want.to_f64_vec(),
                        tol(dt, k),
                        &format!("{dt} {op} [{m}, {k}, {n}]"),
                    );
                }
            }
        }
    }
}

/// A linear layer over [B, S, D] (a broadcast weight, rows stored back to back) is one GEMM over
/// B·S rows, not a batch of B; a transposed A or a batched weight keeps the batch.
#[test]
fn a_broadcast_weight_folds_the_batch_into_the_rows() {
    let f = |d: &[usize]| TensorType::new(DType::BF16, d.to_vec());
    let desc = |op: &Op, a: TensorType, b: TensorType| {
        let out = infer(op, &[&a, &b]).unwrap();
        match lower_step(op, &[&a, &b], &out).unwrap() {
            CudaStep::Matmul { desc, .. } => (desc.batch, desc.n, desc.calls.len()),
            other => panic!("{other:?}"),
        }
    };
    let mm = |trans_a| Op::Matmul {
        trans_a,
        trans_b: false,
    };
    assert_eq!(desc(&mm(false), f(&[8, 16, 32]), f(&[32, 24])), (1, 128, 1));
    assert_eq!(desc(&mm(true), f(&[8, 32, 16]), f(&[32, 24])), (8, 16, 1));
    assert_eq!(
        desc(&mm(false), f(&[8, 16, 32]), f(&[8, 32, 24])),
        (8, 16, 1)
    );
}

/// An accumulating `matmul_epilogue` (`A·B + bias + C`) lowered for CUDA and run on the host
/// through the interpreter's model of cuBLASLt (C read from the op's last operand, also where
/// the bias runs in a kernel after the GEMM, as for f64), against the CPU kernel; every float
/// dtype, with and without a bias, a folded `[B,S,D]·W` and a strided batch.
#[test]
fn accumulating_lowering_runs_on_the_host_as_the_cpu_kernel() {
    let mut seed = 700;
    for dt in FLOATS {
        for bias in [false, true] {
            for (a_dims, b_dims, c_dims, ta) in [
                (&[2, 9, 16][..], &[16, 24][..], &[2, 9, 24][..], false),
                (&[3, 16, 9][..], &[3, 16, 24][..], &[3, 9, 24][..], true),
            ] {
                seed += 5;
                let t = |d: &[usize], s: u64| {
                    rand_tensor(&TensorType::new(dt, d.to_vec()), s, -1.0, 1.0)
                };
                let mut ins = vec![t(a_dims, seed), t(b_dims, seed + 1)];
                if bias {
                    ins.push(t(&[24], seed + 2));
                }
                ins.push(t(c_dims, seed + 3));
                let op = Op::MatmulEpilogue {
                    trans_a: ta,
                    trans_b: false,
                    bias,
                    act: Activation::None,
                    accumulate: true,
                };
                let tys: Vec<TensorType> = ins.iter().map(|t| t.ty()).collect();
                let refs: Vec<&TensorType> = tys.iter().collect();
                let out = infer(&op, &refs).unwrap();
                let CudaStep::Matmul { desc, after, .. } = lower_step(&op, &refs, &out).unwrap()
                else {
                    panic!("{op}: a matmul step");
                };
                assert_eq!(
                    desc.c_operand(),
                    Some(2 + bias as usize),
                    "{dt} bias={bias}"
                );
                let ins_ref: Vec<&HostTensor> = ins.iter().collect();
                let got = interp::run_matmul_step(&desc, &after, &ins_ref, &out).unwrap();
                let want = eval_cpu(&op, &ins_ref).unwrap();
                assert_close(
                    &got.to_f64_vec(),
                    &want.to_f64_vec(),
                    tol(dt, 16),
                    &format!("{dt} bias={bias} ta={ta}"),
                );
            }
        }
    }
}
