//! An attention forward whose three gradients are computed in the same graph saves its softmax
//! statistics for them: the memory plan keeps O live until the gradients' step with room for
//! the statistics after it (`MemoryPlan::saved`), CUDA runs cuDNN's forward with statistics
//! there, or the flash forward that writes the same, and cuDNN's backward or the flash
//! gradients read O and the statistics instead of recomputing the forward.
//! These tests check the plan and the lowering here, and the values on the test device (CUDA
//! where `RUSTYTORCH_TEST_CUDA=1`, else the CPU executable) against the CPU kernels, in the
//! default mode and with `RUSTYTORCH_ATTENTION=cudnn|flash` set by the caller.

use rustytorch::codegen::cuda::{lower_plan, saved_stats, CudaStep};
use rustytorch::compiler::plan::{stats_bytes, stats_offset};
use rustytorch::compiler::Graph;
use rustytorch::ops::testing::{assert_close, rand_tensor};
use rustytorch::ops::{eval_cpu, AttnLayout, AttnMask, Causal, F64Bits, Op, ATTN_WRT_PACKED};
use rustytorch::prelude::*;

fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

fn t(d: DType, dims: &[usize]) -> TensorType {
    TensorType::new(d, Shape::new(dims.to_vec()))
}

/// q, k, v and dO of `[b, h, sq, sk, d]` in `layout`.
fn operands(
    dt: DType,
    layout: AttnLayout,
    [b, h, sq, sk, d]: [usize; 5],
    seed: u64,
) -> Vec<HostTensor> {
    let dims = |s: usize| layout.from_bhsd([b, h, s, d]);
    vec![
        rand_tensor(&t(dt, &dims(sq)), seed, -1.0, 1.0),
        rand_tensor(&t(dt, &dims(sk)), seed + 1, -1.0, 1.0),
        rand_tensor(&t(dt, &dims(sk)), seed + 2, -1.0, 1.0),
        rand_tensor(&t(dt, &dims(sq)), seed + 3, -1.0, 1.0),
    ]
}

fn attention(causal: Causal, layout: AttnLayout, d: usize) -> Op {
    Op::Attention {
        causal,
        mask: AttnMask::None,
        scale: F64Bits::new(1.0 / (d as f64).sqrt()),
        layout,
    }
}

/// O (output `y`) and the gradients `g0, g1, g2` of the attention over q, k, v (inputs
/// `x0..x2`) with dO (`x3`).
fn graph(op: &Op, ins: &[HostTensor]) -> Graph {
    graph_of(op, ins, &[0, 1, 2])
}

/// O (output `y`) and the gradients `g{wrt}` for each of `wrts`.
fn graph_of(op: &Op, ins: &[HostTensor], wrts: &[u8]) -> Graph {
    let mut g = Graph::new();
    let ids: Vec<_> = ins
        .iter()
        .enumerate()
        .map(|(i, x)| g.add_input(&format!("x{i}"), x.ty()).unwrap())
        .collect();
    let o = g.add(op.clone(), &ids[..3]).unwrap();
    g.add_output("y", o).unwrap();
    for &wrt in wrts {
        let gr = g.add(op.attention_grad(wrt).unwrap(), &ids).unwrap();
        g.add_output(&format!("g{wrt}"), gr).unwrap();
    }
    g
}

/// `got` within `tol` of `want` relative to `want`'s largest magnitude (gradients are long
/// sums, so their rounding scales with the largest).
fn assert_scaled(got: &[f64], want: &[f64], tol: f64, what: &str) {
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-3);
    let err = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        err <= tol * scale,
        "{what}: max error {err:.3e} of {scale:.3e}"
    );
}

fn no_opt() -> CompileOptions {
    CompileOptions {
        optimize: false,
        ..CompileOptions::default()
    }
}

#[test]
fn the_plan_saves_the_statistics_for_the_gradients() {
    for (dt, d, saved) in [
        (DType::BF16, 64, true),
        (DType::F16, 128, true),
        (DType::F32, 64, false),
    ] {
        let op = attention(Causal::TopLeft, AttnLayout::Bshd, d);
        let ins = operands(dt, AttnLayout::Bshd, [2, 3, 40, 56, d], 1);
        let g = graph(&op, &ins);
        let exe = rustytorch::compile_graph(&g, Device::Cpu, &no_opt()).unwrap();
        let mem = exe.report().memory.as_ref().unwrap();
        mem.check().unwrap();
        mem.check_uses(exe.optimized_graph()).unwrap();
        // The plan saves for every float type; CUDA takes it where cuDNN's attention does.
        assert_eq!(mem.saved.len(), 1, "{dt}");
        let (&grads, &fwd) = mem.saved.iter().next().unwrap();
        let o_ty = exe.optimized_graph().ty(fwd).clone();
        let slot = mem.slot(fwd).unwrap();
        assert!(slot.size >= stats_offset(&o_ty) + stats_bytes(&o_ty));
        assert_eq!(stats_bytes(&o_ty), 2 * 3 * 40 * 4);
        let t_grads = mem.schedule.iter().position(|&n| n == grads).unwrap();
        assert!(slot.last >= t_grads, "O lives until the gradients' step");

        let plan = exe.plan();
        let steps = lower_plan(plan).unwrap();
        let grad_steps: Vec<usize> = (0..steps.len())
            .filter(|&i| matches!(steps[i], CudaStep::AttentionGrad { .. }))
            .collect();
        let fwd_steps: Vec<usize> = (0..steps.len())
            .filter(|&i| matches!(steps[i], CudaStep::Attention { .. }))
            .collect();
        // The flash forward writes the statistics too, and the flash gradients read them: their
        // first kernel derives `rowsum(dO ∘ O)` instead of recomputing the forward.
        if saved {
            let first = |i: usize| steps[i].launches()[0].kernel.name.clone();
            let v = plan.steps.iter().find_map(|s| s.saved).unwrap();
            let rustytorch::codegen::Source::Step(fi) = plan.sources[v] else {
                panic!("the forward is a step")
            };
            let gi = plan.steps.iter().position(|s| s.saved.is_some()).unwrap();
            assert!(
                first(fi).starts_with("flash_attention_saving"),
                "{}",
                first(fi)
            );
            assert!(
                first(gi).starts_with("flash_attention_delta"),
                "{}",
                first(gi)
            );
        }
        // Forcing the flash kernels (`RUSTYTORCH_ATTENTION=flash`) leaves cuDNN out: no saving
        // by cuDNN.
        let flash = std::env::var("RUSTYTORCH_ATTENTION").as_deref() == Ok("flash");
        if !saved || flash {
            assert!(grad_steps
                .iter()
                .all(|&i| saved_stats(plan, &steps, i).is_none()));
            continue;
        }
        assert_eq!((grad_steps.len(), fwd_steps.len()), (1, 1), "{dt}");
        let (v, off) = saved_stats(plan, &steps, grad_steps[0]).unwrap();
        assert_eq!(plan.steps[fwd_steps[0]].output, v);
        assert_eq!(off, stats_offset(&o_ty));
    }
}

#[test]
fn a_partial_group_saves_nothing() {
    let op = attention(Causal::None, AttnLayout::Bhsd, 64);
    let ins = operands(DType::BF16, AttnLayout::Bhsd, [1, 2, 16, 16, 64], 5);
    // Only dQ and dK: the group lacks dV, which cuDNN's backward writes with them.
    let g = graph_of(&op, &ins, &[0, 1]);
    let mem = rustytorch::compiler::plan::plan(&g).unwrap();
    assert!(mem.saved.is_empty());
    assert_eq!(mem.groups.len(), 1);
}

/// The forward and the gradients on the test device against the CPU kernels (each in f64).
#[test]
fn saved_statistics_give_the_cpu_gradients() {
    let dev = if cuda() { Device::Cuda(0) } else { Device::Cpu };
    let mut seed = 100;
    for (dt, tol) in [(DType::BF16, 2e-2), (DType::F16, 5e-3)] {
        for layout in [AttnLayout::Bshd, AttnLayout::Bhsd] {
            for (shape, causal) in [
                ([2, 4, 128, 128, 64], Causal::None),
                ([2, 4, 96, 160, 64], Causal::TopLeft),
                ([1, 8, 70, 130, 128], Causal::BottomRight),
                ([2, 2, 256, 256, 128], Causal::TopLeft),
                // Head sizes whose rows take a power of two of lanes above `D / 8` in the
                // statistics kernel (16 for 80, 8 for 48), and 2 lanes for 16.
                ([2, 3, 50, 70, 80], Causal::None),
                ([1, 2, 33, 40, 48], Causal::TopLeft),
                ([2, 2, 17, 9, 16], Causal::BottomRight),
            ] {
                seed += 10;
                let d = shape[4];
                let op = attention(causal, layout, d);
                let g = graph(&op, &operands(dt, layout, shape, seed));
                let what = format!("{dt} {layout:?} {shape:?} {causal:?} on {dev:?}");
                eprintln!("compiling: {what}");
                let mut exe = rustytorch::compile_graph(&g, dev, &no_opt()).unwrap();
                let names = ["x0", "x1", "x2", "x3"];
                // Twice, on other operands: the second run reads the statistics its own forward
                // wrote, not the first run's.
                for run in 0..2 {
                    let ins = operands(dt, layout, shape, seed + 5 * run);
                    let args: Vec<(&str, HostTensor)> =
                        names.iter().copied().zip(ins.iter().cloned()).collect();
                    let out = exe.run(&args).unwrap();
                    let refs: Vec<&HostTensor> = ins.iter().collect();
                    let o = eval_cpu(&op, &refs[..3]).unwrap();
                    assert_close(
                        &out[0].to_f64_vec(),
                        &o.to_f64_vec(),
                        tol,
                        &format!("y {what}"),
                    );
                    for wrt in 0..3u8 {
                        let want = eval_cpu(&op.attention_grad(wrt).unwrap(), &refs).unwrap();
                        let got = out[1 + wrt as usize].to_f64_vec();
                        let w = want.to_f64_vec();
                        assert_scaled(&got, &w, tol, &format!("run {run} g{wrt} {what}"));
                    }
                }
                eprintln!("ok: {what}");
            }
        }
    }
}

/// A packed attention (q, k and v in one `[B, S, 3, H, D]` tensor) and its one gradient step:
/// the plan keeps O with room for the statistics, the flash forward saves them and the flash
/// gradient reads them (its first kernel derives `rowsum(dO ∘ O)`), and on the test device the
/// forward and the gradient match the CPU kernels (in f64), over two runs on other operands.
#[test]
fn packed_gradient_reads_the_saved_statistics() {
    let dev = if cuda() { Device::Cuda(0) } else { Device::Cpu };
    for (dt, tol, (b, s, h, d), causal) in [
        (DType::BF16, 2e-2, (2, 200, 3, 64), Causal::TopLeft),
        (DType::F16, 5e-3, (1, 77, 2, 128), Causal::None),
        (DType::BF16, 2e-2, (1, 1000, 2, 128), Causal::TopLeft),
    ] {
        let op = attention(causal, AttnLayout::Packed, d);
        let grad = op.attention_grad(ATTN_WRT_PACKED).unwrap();
        let pt = t(dt, &[b, s, 3, h, d]);
        let ot = t(dt, &[b, s, h, d]);
        let mut g = Graph::new();
        let p = g.add_input("p", pt.clone()).unwrap();
        let dy = g.add_input("dy", ot.clone()).unwrap();
        let y = g.add(op.clone(), &[p, p, p]).unwrap();
        g.add_output("y", y).unwrap();
        let gp = g.add(grad.clone(), &[p, p, p, dy]).unwrap();
        g.add_output("gp", gp).unwrap();
        let what = format!("{dt} {:?} {causal:?} on {dev:?}", (b, s, h, d));
        let mut exe = rustytorch::compile_graph(&g, dev, &no_opt()).unwrap();
        let mem = exe.report().memory.as_ref().unwrap();
        assert_eq!(
            mem.saved.len(),
            1,
            "{what}: the plan saves O for the gradient"
        );
        let plan = exe.plan();
        let steps = lower_plan(plan).unwrap();
        let gi = plan.steps.iter().position(|s| s.saved.is_some()).unwrap();
        let kernels = match &steps[gi] {
            CudaStep::AttentionGrad { flash, .. } | CudaStep::Kernels(flash) => flash,
            other => panic!("{what}: {other:?}"),
        };
        let first = &kernels.launches[0].kernel.name;
        assert!(
            first.starts_with("flash_attention_delta"),
            "{what}: {first}"
        );
        for run in 0..2u64 {
            let pv = rand_tensor(&pt, 300 + run, -1.0, 1.0);
            let dyv = rand_tensor(&ot, 400 + run, -1.0, 1.0);
            let out = exe.run(&[("p", pv.clone()), ("dy", dyv.clone())]).unwrap();
            let ins = [pv.cast(DType::F64), dyv.cast(DType::F64)];
            let refs = [&ins[0], &ins[0], &ins[0], &ins[1]];
            let o = eval_cpu(&op, &refs[..3]).unwrap();
            assert_close(
                &out[0].to_f64_vec(),
                &o.to_f64_vec(),
                tol,
                &format!("y {what}"),
            );
            let want = eval_cpu(&grad, &refs).unwrap().to_f64_vec();
            assert_scaled(
                &out[1].to_f64_vec(),
                &want,
                tol,
                &format!("run {run} {what}"),
            );
        }
        eprintln!("ok: {what}");
    }
}
