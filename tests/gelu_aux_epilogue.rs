//! The forward GEMM and GELU of a training graph as one cuBLASLt call. The memory plan pairs a
//! biased `matmul_epilogue` whose result (the pre-activation, kept for the GELU's gradient) has
//! a tanh GELU with that GELU (`plan::gelu_aux_pair`); the CUDA lowering makes the pair one call
//! with the `GELU_AUX_BIAS` epilogue (the GELU as D, the pre-activation as the aux output) and
//! the GELU's step runs nothing.
//! - everywhere: the pairs of an MLP's training graph; the lowering of each; the call run on the
//!   host through the interpreter's model of cuBLASLt, and its fallback kernels through the
//!   kernel interpreter, against the CPU kernels, f32/f16/bf16;
//! - on the test device (CUDA where `RUSTYTORCH_TEST_CUDA=1`, else the CPU executable): training
//!   the MLP with the epilogue required (`RUSTYTORCH_LT_GELU_AUX=1`), with the GELU's fallback
//!   kernels (`kernel`) and with separate steps (`0`), each against the CPU.

#[path = "common/gelu_mlp.rs"]
mod gelu_mlp;

use gelu_mlp::{mlp, train_modes_against_cpu, DIMS};
use rustytorch::codegen::cuda::matmul::{lower_gelu_aux, LtActivation};
use rustytorch::codegen::cuda::{interp, lower_plan, ArgRef, CudaStep};
use rustytorch::compiler::plan::gelu_aux_pair;
use rustytorch::ops::testing::{assert_close, rand_tensor, tolerance};
use rustytorch::ops::{eval_cpu, infer, Activation, Op, UnaryOp};
use rustytorch::prelude::*;

#[test]
fn the_plan_pairs_the_forward_gemm_with_its_gelu() {
    for dims in DIMS {
        let (g, loss) = mlp(dims, DType::BF16);
        let exe = compile(&g, &[&loss], Device::Cpu).unwrap();
        let graph = exe.optimized_graph();
        let memory = exe.report().memory.as_ref().unwrap();
        memory.check().unwrap();
        memory.check_uses(graph).unwrap();
        let pairs: Vec<_> = memory
            .groups
            .values()
            .filter(|m| m.len() == 2 && gelu_aux_pair(graph, m[0], m[1]).unwrap())
            .collect();
        assert_eq!(pairs.len(), 1, "{dims:?}");
        let (gemm, act) = (pairs[0][0], pairs[0][1]);
        let t = memory.schedule.iter().position(|&n| n == gemm).unwrap();
        assert_eq!(
            memory.schedule[t + 1],
            act,
            "{dims:?}: the GELU right after its GEMM"
        );
        // The pre-activation is kept for the backward: the GELU is not its only user.
        assert!(graph.users(gemm).len() > 1, "{dims:?}");
    }
}

#[test]
fn only_the_gelu_of_a_biased_gemm_is_a_pair() {
    let mut g = rustytorch::compiler::Graph::new();
    let ty = |d: &[usize]| TensorType::new(DType::F32, d.to_vec());
    let x = g.add_input("x", ty(&[16, 8])).unwrap();
    let w = g.add_input("w", ty(&[8, 4])).unwrap();
    let b = g.add_input("b", ty(&[4])).unwrap();
    let epi = |bias: bool, act: Activation| Op::MatmulEpilogue {
        trans_a: false,
        trans_b: false,
        bias,
        act,
        accumulate: false,
    };
    let biased = g.add(epi(true, Activation::None), &[x, w, b]).unwrap();
    let unbiased = g.add(epi(false, Activation::None), &[x, w]).unwrap();
    let relu_in = g.add(epi(true, Activation::Relu), &[x, w, b]).unwrap();
    let gelu =
        |g: &mut rustytorch::compiler::Graph, v| g.add(Op::Unary(UnaryOp::GeluTanh), &[v]).unwrap();
    let (a, u, r) = (
        gelu(&mut g, biased),
        gelu(&mut g, unbiased),
        gelu(&mut g, relu_in),
    );
    let erf = g.add(Op::Unary(UnaryOp::GeluErf), &[biased]).unwrap();
    assert!(gelu_aux_pair(&g, biased, a).unwrap());
    assert!(!gelu_aux_pair(&g, unbiased, u).unwrap(), "no bias");
    assert!(
        !gelu_aux_pair(&g, relu_in, r).unwrap(),
        "an activation already"
    );
    assert!(!gelu_aux_pair(&g, biased, erf).unwrap(), "the erf GELU");
    assert!(!gelu_aux_pair(&g, biased, u).unwrap(), "not its operand");
}

#[test]
fn the_cuda_lowering_makes_the_pair_one_call() {
    for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        for dims in DIMS {
            let (g, loss) = mlp(dims, dt);
            let exe = compile(&g, &[&loss], Device::Cpu).unwrap();
            let plan = exe.plan();
            let steps = lower_plan(plan).unwrap();
            let mut found = 0;
            for (s, st) in plan.steps.iter().zip(&steps) {
                let CudaStep::Matmul { desc, bgrad, .. } = st else {
                    continue;
                };
                if desc.act != LtActivation::GeluTanhAux {
                    continue;
                }
                found += 1;
                assert!(desc.bias && !desc.bgrad, "{dt} {dims:?}");
                assert_eq!(s.with.len(), 1);
                // The fallback: the GELU's kernels from the step's output into its value.
                assert!(!bgrad.launches.is_empty(), "the fallback kernels");
                for l in &bgrad.launches {
                    assert!(l.args.contains(&ArgRef::Output) && l.args.contains(&ArgRef::With(0)));
                }
                let gelu_step = plan
                    .steps
                    .iter()
                    .position(|t| t.output == s.with[0])
                    .unwrap();
                assert!(
                    matches!(steps[gelu_step], CudaStep::Sibling),
                    "{dt} {dims:?}"
                );
            }
            // cuBLASLt's f64 GEMMs take no epilogue.
            let want = usize::from(dt != DType::F64);
            assert_eq!(found, want, "{dt} {dims:?}");
        }
    }
}

#[test]
fn the_epilogue_writes_the_gelu_and_the_pre_activation_as_the_cpu_does() {
    let mut seed = 1300;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for rows in [&[24][..], &[2, 12]] {
            seed += 10;
            let mut xd = rows.to_vec();
            xd.push(32);
            let gemm = Op::MatmulEpilogue {
                trans_a: false,
                trans_b: false,
                bias: true,
                act: Activation::None,
                accumulate: false,
            };
            let ins = [
                rand_tensor(&TensorType::new(dt, xd), seed, -1.0, 1.0),
                rand_tensor(&TensorType::new(dt, [32, 64]), seed + 1, -1.0, 1.0),
                rand_tensor(&TensorType::new(dt, [64]), seed + 2, -1.0, 1.0),
            ];
            let refs: Vec<&HostTensor> = ins.iter().collect();
            let want_pre = eval_cpu(&gemm, &refs).unwrap();
            let act = Op::Unary(UnaryOp::GeluTanh);
            let want = eval_cpu(&act, &[&want_pre]).unwrap();
            let tys: Vec<TensorType> = ins.iter().map(|t| t.ty()).collect();
            let ty_refs: Vec<&TensorType> = tys.iter().collect();
            let out = infer(&gemm, &ty_refs).unwrap();
            let step = lower_gelu_aux(&gemm, &ty_refs, &out, &act, &out)
                .unwrap()
                .unwrap_or_else(|| panic!("{dt} {rows:?}: no epilogue"));
            let CudaStep::Matmul { desc, after, bgrad } = step else {
                panic!("not a matmul: {step:?}");
            };
            let (got, got_pre) =
                interp::run_matmul_bgrad(&desc, &after, &refs, &out, None).unwrap();
            let what = format!("{dt} {rows:?}");
            // The epilogue takes the GELU of the unrounded sum, the CPU of the rounded one.
            let tol = tolerance(dt) * 2.0 * 32f64.sqrt();
            assert_close(
                &got.to_f64_vec(),
                &want.to_f64_vec(),
                tol,
                &format!("GELU, {what}"),
            );
            let got_pre = got_pre.expect("the pre-activation");
            assert_close(
                &got_pre.to_f64_vec(),
                &want_pre.to_f64_vec(),
                tol,
                &format!("pre-activation, {what}"),
            );
            // The fallback kernels: the GELU of the step's output into the pair's value (bound
            // here as the GELU's own operand and result).
            let mut fallback = bgrad.clone();
            for l in &mut fallback.launches {
                for a in &mut l.args {
                    *a = match *a {
                        ArgRef::Output => ArgRef::Input(0),
                        ArgRef::With(0) => ArgRef::Output,
                        other => other,
                    };
                }
            }
            let fell = interp::run_step(&fallback, &[&got_pre], &out, None).unwrap();
            assert_close(
                &fell.to_f64_vec(),
                &want.to_f64_vec(),
                tol,
                &format!("fallback, {what}"),
            );
        }
    }
}

/// The environment variable is read when a graph is compiled, so the modes run one after the
/// other in this one test.
#[test]
fn training_with_the_gelu_pair_on_device_matches_cpu() {
    train_modes_against_cpu("RUSTYTORCH_LT_GELU_AUX", &["1", "kernel", "0"]);
}
