//! Bias gradients from the GEMM's epilogue. The memory plan pairs the `reduce_sum` of each bias
//! gradient with the GEMM over the same rows (`plan::bias_grad_pair`): the `matmul_act_grad` whose
//! result it sums (cuBLASLt's `DGELU_BGRAD`), or the weight gradient reading the same rows
//! (`BGRADA`); the CUDA lowering makes each pair one cuBLASLt call and the sum's step runs nothing.
//! - everywhere: the pairs of an MLP's training graph; the lowering of each pair; the call run on
//!   the host through the interpreter's model of cuBLASLt against the CPU kernels, f32/f16/bf16;
//! - on the test device (CUDA where `RUSTYTORCH_TEST_CUDA=1`, else the CPU executable): training
//!   the MLP with the epilogue required (`RUSTYTORCH_LT_BGRAD=1`), with the sum's fallback
//!   kernels (`kernel`) and with separate steps (`0`), each against the CPU.

use rustytorch::codegen::cuda::matmul::{
    lower_bias_grad, with_bgrad_mode, BgradMode, LtActivation,
};
use rustytorch::codegen::cuda::{interp, lower_plan, CudaStep};
use rustytorch::compiler::plan::{bias_grad_pair, gelu_aux_pair};
use rustytorch::ops::testing::{assert_close, rand_tensor, tolerance};
use rustytorch::ops::{eval_cpu, infer, Activation, Op, ReduceKind};
use rustytorch::prelude::*;

#[path = "common/gelu_mlp.rs"]
mod gelu_mlp;
use gelu_mlp::{mlp, train_modes_against_cpu, DIMS};

#[test]
fn the_plan_pairs_each_bias_gradient_with_a_gemm() {
    for dims in DIMS {
        let (g, loss) = mlp(dims, DType::F32);
        let exe = compile(&g, &[&loss], Device::Cpu).unwrap();
        let graph = exe.optimized_graph();
        let memory = exe.report().memory.as_ref().unwrap();
        memory.check().unwrap();
        memory.check_uses(graph).unwrap();
        let mut kinds = vec![];
        for members in memory.groups.values() {
            assert_eq!(members.len(), 2, "{dims:?}");
            // The forward's GEMM and GELU are the other pair (tests/gelu_aux_epilogue.rs).
            if gelu_aux_pair(graph, members[0], members[1]).unwrap() {
                continue;
            }
            assert!(bias_grad_pair(graph, members[0], members[1]).unwrap());
            // Back to back, the GEMM first.
            let t = memory
                .schedule
                .iter()
                .position(|&n| n == members[0])
                .unwrap();
            assert_eq!(memory.schedule[t + 1], members[1]);
            kinds.push(graph.node(members[0]).unwrap().op.name());
        }
        kinds.sort();
        assert_eq!(kinds, ["matmul", "matmul_act_grad"], "{dims:?}");
    }
}

#[test]
fn only_a_sum_over_the_rows_is_a_pair() {
    let mut g = rustytorch::compiler::Graph::new();
    let x = g
        .add_input("x", TensorType::new(DType::F32, [16, 4]))
        .unwrap();
    let dy = g
        .add_input("dy", TensorType::new(DType::F32, [16, 8]))
        .unwrap();
    let wgrad = Op::Matmul {
        trans_a: true,
        trans_b: false,
    };
    let w = g.add(wgrad, &[x, dy]).unwrap();
    let sum = |axes: Vec<usize>| Op::Reduce {
        kind: ReduceKind::Sum,
        axes,
        keep_dims: false,
    };
    let rows = g.add(sum(vec![0]), &[dy]).unwrap();
    let cols = g.add(sum(vec![1]), &[dy]).unwrap();
    let of_x = g.add(sum(vec![0]), &[x]).unwrap();
    assert!(bias_grad_pair(&g, w, rows).unwrap());
    assert!(!bias_grad_pair(&g, w, cols).unwrap());
    assert!(!bias_grad_pair(&g, w, of_x).unwrap());
}

#[test]
fn the_cuda_lowering_takes_each_sum_into_its_gemm() {
    for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        for dims in DIMS {
            let (g, loss) = mlp(dims, dt);
            let exe = compile(&g, &[&loss], Device::Cpu).unwrap();
            let plan = exe.plan();
            // By default each member runs on its own.
            let apart = with_bgrad_mode(BgradMode::Off, || lower_plan(plan)).unwrap();
            assert!(!apart
                .iter()
                .any(|s| matches!(s, CudaStep::Matmul { desc, .. } if desc.bgrad)));
            let steps = with_bgrad_mode(BgradMode::Auto, || lower_plan(plan)).unwrap();
            let mut acts = vec![];
            for (s, st) in plan.steps.iter().zip(&steps) {
                if let CudaStep::Matmul { desc, bgrad, .. } = st {
                    if desc.bgrad {
                        acts.push(desc.act);
                        assert_eq!(s.with.len(), 1);
                        assert!(!bgrad.launches.is_empty(), "the fallback kernels");
                    }
                }
            }
            let siblings = steps
                .iter()
                .filter(|s| matches!(s, CudaStep::Sibling))
                .count();
            if dt == DType::F64 {
                // cuBLASLt's f64 GEMMs take no epilogue: the sums run on their own.
                assert!(acts.is_empty() && siblings == 0, "{dt} {dims:?}");
                continue;
            }
            acts.sort_by_key(|a| *a == LtActivation::DGeluTanh);
            assert_eq!(
                acts,
                [LtActivation::None, LtActivation::DGeluTanh],
                "{dt} {dims:?}"
            );
            // The two sums, and the GELU of the forward's GEMM (tests/gelu_aux_epilogue.rs).
            assert_eq!(siblings, 3, "{dt} {dims:?}");
        }
    }
}

/// Runs the pair (`gemm` over `ins`, then the sum of `sum_of` over every axis but the last) on
/// the host through the lowering and checks the GEMM's result and the sum against the CPU's.
fn check_pair(gemm: &Op, ins: &[HostTensor], sum_of: Option<usize>, dt: DType, k: usize) {
    let refs: Vec<&HostTensor> = ins.iter().collect();
    let want = eval_cpu(gemm, &refs).unwrap();
    let summed = match sum_of {
        None => want.clone(),
        Some(i) => ins[i].clone(),
    };
    let rank = summed.shape().rank();
    let sum = Op::Reduce {
        kind: ReduceKind::Sum,
        axes: (0..rank - 1).collect(),
        keep_dims: true,
    };
    let want_sum = eval_cpu(&sum, &[&summed]).unwrap();
    let tys: Vec<TensorType> = ins.iter().map(|t| t.ty()).collect();
    let ty_refs: Vec<&TensorType> = tys.iter().collect();
    let out = infer(gemm, &ty_refs).unwrap();
    let step = lower_bias_grad(gemm, &ty_refs, &out, &sum, &summed.ty(), &want_sum.ty())
        .unwrap()
        .unwrap_or_else(|| panic!("{gemm:?} {dt}: no epilogue"));
    let CudaStep::Matmul { desc, after, .. } = step else {
        panic!("not a matmul: {step:?}");
    };
    assert!(desc.bgrad);
    let (got, got_sum) =
        interp::run_matmul_bgrad(&desc, &after, &refs, &out, Some(&want_sum.ty())).unwrap();
    let what = format!("{gemm:?} {dt} {:?}", ins[0].shape());
    let tol = tolerance(dt) * 2.0 * (k as f64).sqrt();
    assert_close(&got.to_f64_vec(), &want.to_f64_vec(), tol, &what);
    let rows = summed.shape().numel() / summed.shape().dims()[rank - 1];
    assert_close(
        &got_sum.unwrap().to_f64_vec(),
        &want_sum.to_f64_vec(),
        tol * (rows as f64).sqrt(),
        &format!("sum of {what}"),
    );
}

#[test]
fn the_epilogue_sums_as_the_cpu_does() {
    let mut seed = 900;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for batch in [&[][..], &[2]] {
            let ty = |d: &[usize]| {
                let mut v = batch.to_vec();
                v.extend_from_slice(d);
                TensorType::new(dt, v)
            };
            seed += 10;
            // dpre = (dy·W2ᵀ) ⊙ gelu_tanh'(pre), its bias gradient Σ_rows dpre.
            let mag = Op::MatmulActGrad {
                trans_a: false,
                trans_b: true,
                act: Activation::GeluTanh,
            };
            let ins = vec![
                rand_tensor(&ty(&[24, 32]), seed, -1.0, 1.0),
                rand_tensor(&TensorType::new(dt, [64, 32]), seed + 1, -1.0, 1.0),
                rand_tensor(&ty(&[24, 64]), seed + 2, -2.0, 2.0),
            ];
            check_pair(&mag, &ins, None, dt, 32);
        }
        // dW = xᵀ·dy over the stacked rows, its bias gradient Σ_rows dy.
        seed += 10;
        let wgrad = Op::Matmul {
            trans_a: true,
            trans_b: false,
        };
        let ins = vec![
            rand_tensor(&TensorType::new(dt, [48, 64]), seed, -1.0, 1.0),
            rand_tensor(&TensorType::new(dt, [48, 32]), seed + 1, -1.0, 1.0),
        ];
        check_pair(&wgrad, &ins, Some(1), dt, 48);
    }
}

/// The environment variable is read when a graph is compiled, so the modes run one after the
/// other in this one test.
#[test]
fn training_with_bias_gradients_on_device_matches_cpu() {
    train_modes_against_cpu("RUSTYTORCH_LT_BGRAD", &["1", "kernel", "auto", "0"]);
}
