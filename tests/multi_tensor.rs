//! Multi-tensor launches. With `defer_updates` (the CUDA target's default) the memory plan runs
//! the optimizer's per-parameter kernels after the backward, level by level, and the CUDA
//! lowering merges independent single-kernel steps into one launch each (`cuda::merge`).
//! - the deferred tail: updates and guards after every gradient, each level grouped;
//! - merged against unmerged plans run on the host (the interpreter for kernels, the CPU kernels
//!   for library calls): every update and guard bit for bit the same, for SGD with momentum and
//!   AdamW, bf16 parameters with f32 masters and f32 ones, and with a non-finite gradient;
//! - a hand-placed plan: a step that reads a value another member writes, or writes bytes that
//!   a step in between reads, is not merged;
//! - on CUDA (`RUSTYTORCH_TEST_CUDA=1`): merged and unmerged plans bit for bit the same;
//! - on the test device (CUDA, else the CPU): training through merged launches against the CPU.

use rustytorch::codegen::cuda::{interp, lower_plan, lower_step, lower_steps, CudaStep};
use rustytorch::codegen::{lower, Plan, Source, Step, Storage};
use rustytorch::compiler::passes;
use rustytorch::ops::testing::{assert_close, rand_tensor};
use rustytorch::ops::{HostTensor, Op, UnaryOp};
use rustytorch::prelude::*;
use rustytorch::runtime::{Backend, CudaBackend, Session};
use rustytorch::Optimizer;
use std::sync::Arc;

fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

/// A three-layer MLP of parameters of `dt` (one weight big enough that its guard reduces in
/// two stages) with `loss = mse(...)` and a training step of `opt`.
fn mlp(dt: DType, opt: Optimizer) -> (GraphBuilder, Tensor) {
    mlp_with(dt, opt, 48)
}

/// [`mlp`] with a second hidden layer of `h2` units: 64 makes `w2` large enough (40,960
/// elements) for its finiteness guard to reduce in two passes, as `w1`'s does.
fn mlp_with(dt: DType, opt: Optimizer, h2: usize) -> (GraphBuilder, Tensor) {
    let g = GraphBuilder::new();
    let x = g.input("x", dt, vec![16, 96]);
    let y = g.input("y", dt, vec![16, 24]);
    let p = |name: &str, shape: &[usize], seed| {
        g.param_typed(
            name,
            TensorType::new(dt, shape.to_vec()),
            Init::kaiming_uniform(shape[0], seed),
            true,
        )
    };
    let w1 = p("w1", &[96, 640], 1);
    let b1 = p("b1", &[640], 2);
    let w2 = p("w2", &[640, h2], 3);
    let b2 = p("b2", &[h2], 4);
    let w3 = p("w3", &[h2, 24], 5);
    let out = x
        .matmul(&w1)
        .add(&b1)
        .gelu_tanh()
        .matmul(&w2)
        .add(&b2)
        .relu()
        .matmul(&w3);
    let loss = out.mse_loss(&y);
    g.train_step(&loss, opt, &StepOptions::default()).unwrap();
    (g, loss)
}

fn sgd() -> Optimizer {
    Sgd::new(0.05).momentum(0.9).into()
}

fn adamw() -> Optimizer {
    AdamW::new(1e-2).into()
}

/// The graph compiled as the CUDA target compiles it, and its plan.
fn compiled(g: &GraphBuilder, loss: &Tensor) -> (passes::Compiled, Plan) {
    let mut graph = g.graph().unwrap();
    graph.add_output("loss", loss.node().unwrap()).unwrap();
    let opts = passes::Options {
        attention_layout: true,
        attention_layout_grads: true,
        defer_updates: true,
        ..Default::default()
    };
    let c = passes::run(&graph, &opts).unwrap();
    let plan = lower(&c.graph, c.report.memory.as_ref().unwrap()).unwrap();
    (c, plan)
}

/// The plan's inputs (random) and parameters (their initial values, random for the f32 states
/// so that momentum and moments are not zeros).
fn operands(c: &passes::Compiled, plan: &Plan, seed: u64) -> (Vec<HostTensor>, Vec<HostTensor>) {
    let inputs = plan
        .inputs
        .iter()
        .enumerate()
        .map(|(i, (_, ty))| rand_tensor(ty, seed + i as u64, -1.0, 1.0))
        .collect();
    let params = c
        .graph
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            if p.name.starts_with("optim.m.") || p.name.starts_with("optim.momentum.") {
                rand_tensor(&p.ty, 100 + i as u64, -0.01, 0.01)
            } else if p.name.starts_with("optim.v.") {
                rand_tensor(&p.ty, 100 + i as u64, 0.0, 1e-4)
            } else {
                p.init.materialize(&p.ty).unwrap()
            }
        })
        .collect();
    (inputs, params)
}

fn launches(steps: &[CudaStep]) -> usize {
    steps.iter().map(|s| s.launches().len()).sum()
}

#[test]
fn the_tail_runs_after_the_backward_in_levels() {
    let (g, loss) = mlp_with(DType::BF16, sgd(), 64);
    let (c, plan) = compiled(&g, &loss);
    let graph = &c.graph;
    let memory = c.report.memory.as_ref().unwrap();
    memory.check().unwrap();
    memory.check_uses(graph).unwrap();
    // The last GEMM of the backward comes before every update and guard.
    let at = |n| memory.schedule.iter().position(|&m| m == n).unwrap();
    let last_gemm = memory
        .schedule
        .iter()
        .rposition(|&n| graph.node(n).unwrap().op.name().starts_with("matmul"))
        .unwrap();
    for (_, n) in graph.updates.iter().chain(
        graph
            .guards
            .iter()
            .map(|(_, n)| (0u32, *n))
            .collect::<Vec<_>>()
            .iter(),
    ) {
        if graph.node(*n).unwrap().op.name() == "add" {
            continue; // the step counter reads nothing of the backward
        }
        assert!(at(*n) > last_gemm, "{}", graph.node(*n).unwrap().op.name());
    }
    // Five parameters: their master updates (each storing its bf16 parameter too) and their
    // guards merge (the two-pass guards of the two large weights into two launches).
    let steps = lower_plan(&plan).unwrap();
    let unmerged = lower_steps(&plan).unwrap();
    let merged = steps
        .iter()
        .filter(|s| matches!(s, CudaStep::Merged(_)))
        .count();
    assert!(merged >= 10, "{merged} merged steps");
    // Each parameter's bf16 value is stored by the kernel of its f32 master's update.
    let folded = plan
        .steps
        .iter()
        .zip(&steps)
        .filter(|(s, cs)| matches!(s.op, Op::Cast { .. }) && matches!(cs, CudaStep::Merged(_)))
        .count();
    assert_eq!(folded, 5);
    // A merged step saves its launches (two for a two-pass guard).
    let saved: usize = steps
        .iter()
        .zip(&unmerged)
        .filter(|(s, _)| matches!(s, CudaStep::Merged(_)))
        .map(|(_, u)| u.launches().len())
        .sum();
    assert!(saved > merged, "a two-pass guard merges launch by launch");
    assert_eq!(launches(&unmerged) - launches(&steps), saved);
}

/// Every update and guard of one step, merged against unmerged, on the host.
fn same_step(dt: DType, opt: Optimizer, poison: bool) {
    let (g, loss) = mlp_with(dt, opt, 64);
    let (c, plan) = compiled(&g, &loss);
    let (mut inputs, params) = operands(&c, &plan, 7);
    if poison {
        // An infinite target makes every gradient non-finite.
        let y = plan.inputs.iter().position(|(n, _)| n == "y").unwrap();
        let mut v = inputs[y].to_f64_vec();
        v[3] = f64::INFINITY;
        inputs[y] = HostTensor::from_f64_slice(&plan.inputs[y].1, &v).unwrap();
    }
    let merged_steps = lower_plan(&plan).unwrap();
    assert!(merged_steps
        .iter()
        .any(|s| matches!(s, CudaStep::Merged(_))));
    // Two-pass reductions (the large parameters' guards) merge launch by launch, each member's
    // scratch a region of its own.
    assert!(merged_steps.iter().any(|s| matches!(s,
        CudaStep::Kernels(k) if k.launches.len() == 2
            && k.scratch_bytes > 0
            && k.launches.iter().all(|l| l.kernel.name.starts_with("multi")))));
    let a = interp::run_plan(&plan, &merged_steps, &inputs, &params).unwrap();
    let b = interp::run_plan(&plan, &lower_steps(&plan).unwrap(), &inputs, &params).unwrap();
    let bits = |t: &HostTensor| {
        t.to_f64_vec()
            .iter()
            .map(|x| x.to_bits())
            .collect::<Vec<_>>()
    };
    for (p, v) in &plan.updates {
        let (x, y) = (a[*v].as_ref().unwrap(), b[*v].as_ref().unwrap());
        let (bx, by) = (bits(x), bits(y));
        let first = bx.iter().zip(&by).position(|(u, w)| u != w);
        assert!(
            first.is_none(),
            "{dt} update of parameter {p} (value {v}): element {first:?} differs: {} merged, {} alone",
            x.to_f64_vec()[first.unwrap_or(0)],
            y.to_f64_vec()[first.unwrap_or(0)]
        );
    }
    // Each kernel step of the merged run against its op's CPU kernel over the same operands:
    // guards exactly, other results within the dtype's rounding.
    for (i, st) in plan.steps.iter().enumerate() {
        if !matches!(merged_steps[i], CudaStep::Kernels(_) | CudaStep::Merged(_)) {
            continue;
        }
        let ins: Vec<&HostTensor> = st.inputs.iter().map(|&v| a[v].as_ref().unwrap()).collect();
        let want = rustytorch::ops::eval_cpu(&st.op, &ins)
            .unwrap()
            .to_f64_vec();
        let got = a[st.output].as_ref().unwrap().to_f64_vec();
        if plan.types[st.output].dtype == DType::Bool {
            assert_eq!(got, want, "step {i} ({})", st.op.name());
        } else {
            let scale = want.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
            let tol = if plan.types[st.output].dtype == DType::F32 {
                1e-5
            } else {
                1e-2
            };
            assert_close(
                &got,
                &want,
                tol * scale,
                &format!("step {i} ({})", st.op.name()),
            );
        }
    }
    let mut failed = 0;
    for (name, v) in &plan.guards {
        let (x, y) = (a[*v].as_ref().unwrap(), b[*v].as_ref().unwrap());
        assert_eq!(x.to_f64_vec(), y.to_f64_vec(), "{dt} guard {name}");
        failed += usize::from(x.to_f64_vec() == [0.0]);
    }
    if poison {
        assert!(failed > 0, "an infinite target fails a guard");
    } else {
        assert_eq!(failed, 0);
    }
}

#[test]
fn merged_launches_compute_what_each_step_computes() {
    for dt in [DType::BF16, DType::F32] {
        same_step(dt, sgd(), false);
        same_step(dt, adamw(), false);
    }
    same_step(DType::BF16, adamw(), true);
}

/// A plan of f32 steps over `x` (an input of 1024 elements) placed by hand: `(op, operands,
/// arena offset of the result)`; value 0 is `x`, step `i` computes value `i + 1`.
fn hand_plan(steps: &[(UnaryOp, Vec<usize>, usize)]) -> Plan {
    let ty = TensorType::new(DType::F32, [1024]);
    let n = steps.len() + 1;
    let mut plan = Plan {
        types: vec![ty.clone(); n],
        sources: std::iter::once(Source::Input(0))
            .chain((0..steps.len()).map(Source::Step))
            .collect(),
        storage: std::iter::once(Storage::Provided)
            .chain(steps.iter().map(|s| Storage::Arena {
                offset: s.2,
                size: 4096,
            }))
            .collect(),
        arena_bytes: 3 * 4096,
        param_types: vec![],
        steps: vec![],
        inputs: vec![("x".into(), ty.clone())],
        outputs: vec![],
        updates: vec![],
        guards: vec![],
    };
    for (i, (op, ins, _)) in steps.iter().enumerate() {
        plan.steps.push(Step {
            op: Op::Unary(*op),
            inputs: ins.clone(),
            output: i + 1,
            frees: vec![],
            with: vec![],
            sibling_of: None,
            saved: None,
        });
    }
    plan.outputs = (1..n).map(|v| (format!("v{v}"), v)).collect();
    plan
}

#[test]
fn a_dependency_or_a_reused_slot_is_not_merged() {
    use UnaryOp::{Exp, Neg};
    // v1 = -x, v2 = exp x: independent. v3 = -v1 reads v1. v4 = exp x takes v1's bytes, which
    // step 2 reads: moving it before step 2 would overwrite them.
    let plan = hand_plan(&[
        (Neg, vec![0], 0),
        (Exp, vec![0], 4096),
        (Neg, vec![1], 8192),
        (Exp, vec![0], 0),
    ]);
    let steps = lower_plan(&plan).unwrap();
    let kinds: Vec<Option<usize>> = steps
        .iter()
        .map(|s| match s {
            CudaStep::Merged(f) => Some(*f),
            _ => None,
        })
        .collect();
    assert_eq!(kinds, [None, Some(0), None, None]);
    // Each step on its own matches the merged plan's values.
    let x = rand_tensor(&plan.inputs[0].1, 3, -1.0, 1.0);
    let got = interp::run_plan(&plan, &steps, std::slice::from_ref(&x), &[]).unwrap();
    for (i, s) in plan.steps.iter().enumerate() {
        let ins: Vec<&TensorType> = s.inputs.iter().map(|&v| &plan.types[v]).collect();
        assert!(matches!(
            lower_step(&s.op, &ins, &plan.types[s.output]).unwrap(),
            CudaStep::Kernels(_)
        ));
        let operand = got[s.inputs[0]].as_ref().unwrap();
        let want = rustytorch::ops::eval_cpu(&s.op, &[operand]).unwrap();
        assert_close(
            &got[s.output].as_ref().unwrap().to_f64_vec(),
            &want.to_f64_vec(),
            1e-6,
            &format!("step {i}"),
        );
    }
}

/// On CUDA only: three steps of a plan with merged launches and of the same plan with every
/// step on its own (`RUSTYTORCH_MERGE=0` while it is prepared), every parameter and state bit
/// for bit the same: the merged kernels run the same arithmetic in the same order.
#[test]
fn merged_launches_match_unmerged_ones_on_the_device_bit_for_bit() {
    if !cuda() {
        return;
    }
    let backend = CudaBackend::new(0).unwrap();
    for (dt, opt) in [(DType::BF16, adamw()), (DType::F32, sgd())] {
        let (g, loss) = mlp_with(dt, opt, 64);
        let (c, plan) = compiled(&g, &loss);
        let plan = Arc::new(plan);
        let (inputs, params) = operands(&c, &plan, 5);
        let inputs: Vec<Arc<HostTensor>> = inputs.into_iter().map(Arc::new).collect();
        let params: Vec<Arc<HostTensor>> = params.into_iter().map(Arc::new).collect();
        let run = |merge: bool| -> Vec<HostTensor> {
            // Read once, while the plan is lowered; either setting computes the same values.
            if merge {
                std::env::remove_var("RUSTYTORCH_MERGE");
            } else {
                std::env::set_var("RUSTYTORCH_MERGE", "0");
            }
            let s = backend.prepare(plan.clone(), params.clone());
            std::env::remove_var("RUSTYTORCH_MERGE");
            let mut s: Box<dyn Session> = s.unwrap();
            for _ in 0..3 {
                assert!(s.run(&inputs).unwrap().committed);
            }
            (0..plan.param_types.len())
                .map(|i| s.read_param(i).unwrap())
                .collect()
        };
        let (a, b) = (run(true), run(false));
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            let bits = |t: &HostTensor| {
                t.to_f64_vec()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>()
            };
            assert!(
                bits(x) == bits(y),
                "{dt}: parameter {} differs",
                c.graph.params[i].name
            );
        }
    }
}

/// Training through merged launches on the test device against the CPU (SGD for bf16: AdamW's
/// normalized step turns a gradient element rounded to the other sign of zero into a full step
/// the other way, which no tolerance on the parameters bounds).
#[test]
fn training_through_merged_launches_matches_the_cpu() {
    let device = if cuda() { Device::Cuda(0) } else { Device::Cpu };
    for (dt, opt) in [(DType::BF16, sgd()), (DType::F32, adamw())] {
        let (g, loss) = mlp(dt, opt.clone());
        let mut cpu = compile(&g, &[&loss], Device::Cpu).unwrap();
        let mut dev = compile(&g, &[&loss], device).unwrap();
        let x = rand_tensor(&TensorType::new(dt, [16, 96]), 11, -1.0, 1.0);
        let y = rand_tensor(&TensorType::new(dt, [16, 24]), 12, -1.0, 1.0);
        for _ in 0..3 {
            let feed = [("x", x.clone()), ("y", y.clone())];
            let a = cpu.run(&feed).unwrap();
            let b = dev.run(&feed).unwrap();
            assert!(a.skipped.is_none() && b.skipped.is_none());
        }
        let tol = if dt == DType::BF16 { 2e-2 } else { 1e-4 };
        for name in ["w1", "b1", "w2", "b2", "w3"] {
            let (p, q) = (cpu.param(name).unwrap(), dev.param(name).unwrap());
            assert_close(
                &q.to_f64_vec(),
                &p.to_f64_vec(),
                tol,
                &format!("{dt} {name}"),
            );
        }
    }
}

/// The kernel that gathers a run's guards into one buffer (read back in one copy), through the
/// interpreter: byte `i` is guard `i`.
#[test]
fn the_guards_gather_into_one_buffer() {
    use rustytorch::codegen::cuda::merge::{gather_guards, GATHER_MAX};
    for n in [2, 7, GATHER_MAX] {
        let k = gather_guards(n).unwrap();
        let want: Vec<u8> = (0..n).map(|i| u8::from(i % 3 != 1)).collect();
        let mut bufs: Vec<Vec<u8>> = want.iter().map(|&b| vec![b]).collect();
        bufs.push(vec![0xA5; n]);
        interp::run_launch(&k, 1, &mut bufs).unwrap();
        assert_eq!(bufs[n], want, "{n} guards");
    }
    assert!(gather_guards(GATHER_MAX + 1).is_err());
    assert!(gather_guards(0).is_err());
}
