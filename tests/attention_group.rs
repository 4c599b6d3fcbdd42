//! The gradients of one attention with respect to q, k and v form a sibling group: the memory
//! plan schedules them back to back with their slots live from the first, and CUDA computes them
//! in one step (the statistics pass once, then `dQ` with `dK` and/or `dV` in one fused kernel, or
//! `dK` and `dV` in one kernel when `dQ` is not asked for). These tests check the plan and the lowering here, and the values on the test device:
//! CUDA where `RUSTYTORCH_TEST_CUDA=1` (the GPU machine), else the CPU executable.

use rustytorch::codegen::cuda::{flash, lower_plan, ArgRef, CudaStep};
use rustytorch::compiler::{plan, Graph};
use rustytorch::ops::testing::{assert_close, rand_tensor};
use rustytorch::ops::{eval_cpu, AttnLayout, AttnMask, Causal, F64Bits, Op};
use rustytorch::prelude::*;

fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

/// Whether `RUSTYTORCH_TEST_SMALL=1` asks for a short run (under compute-sanitizer).
fn small() -> bool {
    std::env::var("RUSTYTORCH_TEST_SMALL").as_deref() == Ok("1")
}

/// Whether `RUSTYTORCH_ATTENTION=cudnn` forces cuDNN's attention.
fn forced_cudnn() -> bool {
    std::env::var("RUSTYTORCH_ATTENTION").as_deref() == Ok("cudnn")
}

fn device() -> Device {
    if cuda() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    }
}

fn t(d: DType, dims: &[usize]) -> TensorType {
    TensorType::new(d, Shape::new(dims.to_vec()))
}

/// One case: q, k, v, the mask (if any) and dO, with the ops of the gradients asked for.
struct Case {
    inputs: Vec<HostTensor>,
    ops: Vec<Op>,
}

#[allow(clippy::too_many_arguments)]
fn case(
    d: DType,
    layout: AttnLayout,
    [b, h, sq, sk, hd, hv]: [usize; 6],
    causal: Causal,
    mask: AttnMask,
    wrts: &[u8],
    seed: u64,
) -> Case {
    let dims = |s: usize, w: usize| layout.from_bhsd([b, h, s, w]);
    let mut inputs = vec![
        rand_tensor(&t(d, &dims(sq, hd)), seed, -1.0, 1.0),
        rand_tensor(&t(d, &dims(sk, hd)), seed + 1, -1.0, 1.0),
        rand_tensor(&t(d, &dims(sk, hv)), seed + 2, -1.0, 1.0),
    ];
    match mask {
        AttnMask::None => {}
        AttnMask::Additive => {
            // Row 0 fully masked, every fifth key masked, the rest random.
            let mut m = rand_tensor(&t(DType::F64, &[sq, sk]), seed + 3, -2.0, 1.0).to_f64_vec();
            for (x, v) in m.iter_mut().enumerate() {
                if x < sk || x % 5 == 0 {
                    *v = f64::NEG_INFINITY;
                }
            }
            inputs.push(HostTensor::from_f64_slice(&t(d, &[sq, sk]), &m).unwrap());
        }
        AttnMask::Bool => inputs.push(rand_tensor(
            &t(DType::Bool, &[b, 1, 1, sk]),
            seed + 3,
            0.0,
            1.0,
        )),
    }
    inputs.push(rand_tensor(&t(d, &dims(sq, hv)), seed + 4, -1.0, 1.0));
    let ops = wrts
        .iter()
        .map(|&wrt| Op::AttentionGrad {
            causal,
            mask,
            scale: F64Bits::new(1.0 / (hd as f64).sqrt()),
            wrt,
            layout,
        })
        .collect();
    Case { inputs, ops }
}

/// The graph computing every gradient of `c` as an output `g{wrt}`.
fn graph(c: &Case) -> Graph {
    let mut g = Graph::new();
    let ids: Vec<_> = c
        .inputs
        .iter()
        .enumerate()
        .map(|(i, x)| g.add_input(&format!("x{i}"), x.ty()).unwrap())
        .collect();
    for (k, op) in c.ops.iter().enumerate() {
        let y = g.add(op.clone(), &ids).unwrap();
        g.add_output(&format!("g{k}"), y).unwrap();
    }
    g
}

fn no_opt() -> CompileOptions {
    CompileOptions {
        optimize: false,
        ..CompileOptions::default()
    }
}

#[test]
fn siblings_are_one_step_on_cuda() {
    let shape = [2, 3, 70, 45, 64, 64];
    for (wrts, hd, launches) in [
        // dQ with dK and/or dV: statistics, zeroing the f32 dQ buffer, the fused kernel,
        // rounding dQ; dK and dV alone: statistics and their joint kernel.
        (&[0u8, 1, 2][..], 64, 4),
        (&[0, 1, 2], 128, 4),
        (&[1, 2], 64, 2),
        (&[0, 2], 32, 4),
        (&[2, 0, 1], 64, 4),
    ] {
        let mut sh = shape;
        sh[4] = hd;
        sh[5] = hd;
        let c = case(
            DType::BF16,
            AttnLayout::Bshd,
            sh,
            Causal::TopLeft,
            AttnMask::None,
            wrts,
            1,
        );
        let g = graph(&c);
        let mem = plan::plan(&g).unwrap();
        mem.check().unwrap();
        mem.check_uses(&g).unwrap();
        assert_eq!(mem.groups.len(), 1, "{wrts:?}");
        let exe = rustytorch::compile_graph(&g, Device::Cpu, &no_opt()).unwrap();
        let p = exe.plan();
        let firsts: Vec<_> = p.steps.iter().filter(|s| !s.with.is_empty()).collect();
        assert_eq!(firsts.len(), 1);
        assert_eq!(firsts[0].with.len(), wrts.len() - 1);
        let steps = lower_plan(p).unwrap();
        let siblings = steps
            .iter()
            .filter(|s| matches!(s, CudaStep::Sibling))
            .count();
        assert_eq!(siblings, wrts.len() - 1, "{wrts:?}");
        let grouped: Vec<_> = steps
            .iter()
            .filter(|s| !matches!(s, CudaStep::Sibling))
            .collect();
        assert_eq!(grouped.len(), 1);
        let ls = grouped[0].launches();
        assert_eq!(ls.len(), launches, "{wrts:?} head {hd}");
        assert!(ls[0].kernel.name.starts_with("flash_attention_stats"));
        // Every result is written exactly once (besides the step's scratch).
        let mut written: Vec<ArgRef> = ls[1..]
            .iter()
            .flat_map(|l| {
                l.kernel
                    .params
                    .iter()
                    .zip(&l.args)
                    .filter(|(p, a)| p.writes && !matches!(a, ArgRef::ScratchAt(_)))
                    .map(|(_, a)| *a)
            })
            .collect();
        written.sort_by_key(|a| format!("{a:?}"));
        let mut want = vec![ArgRef::Output];
        want.extend((0..wrts.len() - 1).map(ArgRef::With));
        want.sort_by_key(|a| format!("{a:?}"));
        assert_eq!(written, want, "{wrts:?}");
    }
    // f32 attention takes other paths: its gradients stay one step each.
    let c = case(
        DType::F32,
        AttnLayout::Bhsd,
        [1, 2, 9, 9, 16, 16],
        Causal::None,
        AttnMask::None,
        &[0, 1, 2],
        2,
    );
    let exe = rustytorch::compile_graph(&graph(&c), Device::Cpu, &no_opt()).unwrap();
    let steps = lower_plan(exe.plan()).unwrap();
    assert!(!steps.iter().any(|s| matches!(s, CudaStep::Sibling)));
    let tys: Vec<TensorType> = c.inputs[..3].iter().map(|x| x.ty()).collect();
    assert!(!flash::supported(&tys.iter().collect::<Vec<_>>()));
}

#[test]
fn training_graphs_group_their_attention_gradients() {
    // Two GPT-2 blocks trained with AdamW, through the passes a CUDA compile runs (bf16
    // autocast, attention reading its heads in place): autodiff makes the three gradients of
    // each attention and the plan groups them.
    use rustytorch::compiler::passes;
    use rustytorch::models::{gpt2_block, Gpt2Config};
    let cfg = Gpt2Config {
        layers: 2,
        batch: 2,
        seq: 64,
        d_model: 128,
        heads: 2,
    };
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [cfg.batch, cfg.seq, cfg.d_model]);
    let y = g.input("y", DType::F32, [cfg.batch, cfg.seq, cfg.d_model]);
    let mut h = x.clone();
    for l in 0..cfg.layers {
        h = gpt2_block(&g, &cfg, l, &h);
    }
    g.train_step(&h.mse_loss(&y), AdamW::new(1e-3), &StepOptions::default())
        .unwrap();
    let done = passes::run(
        &g.graph().unwrap(),
        &passes::Options {
            autocast: Some(DType::BF16),
            attention_layout: true,
            dump: vec![],
            ..passes::Options::default()
        },
    )
    .unwrap();
    let mem = plan::plan(&done.graph).unwrap();
    mem.check().unwrap();
    mem.check_uses(&done.graph).unwrap();
    assert_eq!(mem.groups.len(), cfg.layers);
    assert!(mem.groups.values().all(|m| m.len() == 3));
    let p = rustytorch::codegen::lower(&done.graph, &mem).unwrap();
    let steps = lower_plan(&p).unwrap();
    let siblings = steps
        .iter()
        .filter(|s| matches!(s, CudaStep::Sibling))
        .count();
    assert_eq!(siblings, 2 * cfg.layers);
}

/// The grouped gradients on the test device against each op's CPU kernel: both layouts, causal
/// kinds, masks (a fully masked row), Sq ≠ Sk, head sizes with and without the joint dK/dV
/// kernel, f16 and bf16, errors relative to each result's largest magnitude.
#[test]
fn grouped_gradients_match_each_op() {
    let shapes: [[usize; 6]; 7] = [
        [2, 3, 70, 70, 64, 64],
        [1, 2, 33, 130, 32, 48],
        [1, 2, 100, 37, 128, 128],
        [2, 2, 1, 90, 64, 64],
        // Several query and key tiles of the fused kernel (eight warps at head sizes that are
        // multiples of 32, four at 48), Sq ≠ Sk both ways.
        [1, 2, 1000, 1000, 128, 128],
        [2, 1, 300, 513, 64, 128],
        [1, 2, 257, 199, 48, 48],
    ];
    let mut n = 0;
    for d in [DType::BF16, DType::F16] {
        for (s, &shape) in shapes.iter().enumerate() {
            for layout in [AttnLayout::Bhsd, AttnLayout::Bshd] {
                for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
                    for mask in [AttnMask::None, AttnMask::Additive, AttnMask::Bool] {
                        // Keep the CPU run short: every combination of the first four shapes on
                        // CUDA and a quarter of the larger ones, a sample of the first four here;
                        // `RUSTYTORCH_TEST_SMALL=1` (for compute-sanitizer) one shape, a sample.
                        n += 1;
                        if (!cuda() || small()) && (n % 7 != 0 || s > 3)
                            || small() && s > 0
                            || s > 3 && n % 4 != 0
                        {
                            continue;
                        }
                        // With cuDNN forced, only what its backward covers compiles.
                        let [_, _, sq, sk, hd, hv] = shape;
                        if forced_cudnn()
                            && (mask != AttnMask::None
                                || hd != hv
                                || !matches!(hd, 64 | 128)
                                || (causal == Causal::BottomRight && sq > sk))
                        {
                            continue;
                        }
                        let wrts: &[u8] = match s {
                            1 => &[1, 2],
                            5 => &[0, 2],
                            6 => &[0, 1],
                            _ => &[0, 1, 2],
                        };
                        let seed = 100 + n as u64 * 10;
                        let c = case(d, layout, shape, causal, mask, wrts, seed);
                        let what =
                            format!("{d:?} {layout:?} {shape:?} {causal:?} {mask:?} {wrts:?}");
                        let g = graph(&c);
                        let mut exe = rustytorch::compile_graph(&g, device(), &no_opt())
                            .unwrap_or_else(|e| panic!("{what}: compile: {e}"));
                        let names: Vec<String> =
                            (0..c.inputs.len()).map(|i| format!("x{i}")).collect();
                        let args: Vec<(&str, HostTensor)> = names
                            .iter()
                            .zip(&c.inputs)
                            .map(|(n, x)| (n.as_str(), x.clone()))
                            .collect();
                        let got = exe
                            .run(&args)
                            .unwrap_or_else(|e| panic!("{what}: run: {e}"))
                            .into_vec();
                        let refs: Vec<&HostTensor> = c.inputs.iter().collect();
                        for (op, got) in c.ops.iter().zip(got) {
                            let want = eval_cpu(op, &refs).unwrap();
                            assert_eq!(got.ty(), want.ty(), "{what}");
                            let (mut got, mut want) = (got.to_f64_vec(), want.to_f64_vec());
                            let m = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
                            for v in got.iter_mut().chain(want.iter_mut()) {
                                *v /= m;
                            }
                            let tol = if d == DType::BF16 { 2e-2 } else { 4e-3 };
                            assert_close(&got, &want, tol, &format!("{what} {op:?}"));
                        }
                        eprintln!("ok: {what}");
                    }
                }
            }
        }
    }
}
