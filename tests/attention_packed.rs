//! Packed q, k and v (`compiler::attn_packed`, `AttnLayout::Packed`): attention reading q, k
//! and v where one linear layer's output holds them, and its one gradient writing dq, dk and
//! dv there.
//!
//! Everywhere: the packed op on the CPU against the `[B, H, S, D]` op on q, k and v sliced out
//! by hand (forward and the three gradients, float64); the pass on a GPT-2 block's training
//! graph (one packed attention, one packed gradient, no slice or pad left, the sum of the
//! gradients' pads gone); that graph training as the unpacked one does on the CPU; the CUDA
//! lowering of the packed ops (flash kernels with the packed strides, cuDNN's description with
//! them, a clear error for what the kernels do not take).
//!
//! On the GPU machine (`RUSTYTORCH_TEST_CUDA=1`): the packed forward and gradient against the
//! float64 reference for f16 and bf16, head sizes 32, 64 and 128, 1, 7, 77, 130, 200 and 1000
//! positions, every causal kind, additive masks with fully masked rows and bool masks, through
//! the flash kernels and through cuDNN; and a bf16 GPT-2 block training on CUDA against the CPU.

use rustytorch::codegen::cuda::{lower_step, with_target, AttnDnnDesc, CudaStep, Target};
use rustytorch::compiler::{passes, Graph};
use rustytorch::models::Gpt2Config;
use rustytorch::ops::testing::{assert_close, rand_tensor};
use rustytorch::ops::{eval_cpu, AttnLayout, AttnMask, Causal, F64Bits, Op, ATTN_WRT_PACKED};
use rustytorch::prelude::*;

#[path = "common/attention_check.rs"]
mod attention_check;
#[path = "common/one_op.rs"]
mod one_op;

fn attn(causal: Causal, mask: AttnMask, layout: AttnLayout) -> Op {
    Op::Attention {
        causal,
        mask,
        scale: F64Bits::new(0.3),
        layout,
    }
}

/// `p [B, S, 3, H, D]`'s part `j` as `[B, H, S, D]`.
fn part_bhsd(p: &HostTensor, j: usize) -> HostTensor {
    let d = p.dims().to_vec();
    let s = eval_cpu(
        &Op::Slice {
            starts: vec![0, 0, j, 0, 0],
            ends: vec![d[0], d[1], j + 1, d[3], d[4]],
            steps: vec![1; 5],
        },
        &[p],
    )
    .unwrap();
    let s = eval_cpu(
        &Op::Reshape {
            shape: Shape::new([d[0], d[1], d[3], d[4]]),
        },
        &[&s],
    )
    .unwrap();
    eval_cpu(
        &Op::Permute {
            perm: vec![0, 2, 1, 3],
        },
        &[&s],
    )
    .unwrap()
}

fn swap(x: &HostTensor) -> HostTensor {
    eval_cpu(
        &Op::Permute {
            perm: vec![0, 2, 1, 3],
        },
        &[x],
    )
    .unwrap()
}

/// The packed op on the CPU (float64) is the `[B, H, S, D]` op on the parts, forward and each
/// gradient at its place in the packed result.
#[test]
fn packed_op_matches_the_parts_on_the_cpu() {
    let (b, s, h, d) = (2, 9, 3, 8);
    let p = rand_tensor(
        &TensorType::new(DType::F64, Shape::new([b, s, 3, h, d])),
        5,
        -1.0,
        1.0,
    );
    let g_out = rand_tensor(
        &TensorType::new(DType::F64, Shape::new([b, s, h, d])),
        6,
        -1.0,
        1.0,
    );
    for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
        let packed = attn(causal, AttnMask::None, AttnLayout::Packed);
        let got = eval_cpu(&packed, &[&p, &p, &p]).unwrap();
        let parts: Vec<HostTensor> = (0..3).map(|j| part_bhsd(&p, j)).collect();
        let plain = attn(causal, AttnMask::None, AttnLayout::Bhsd);
        let want = swap(&eval_cpu(&plain, &[&parts[0], &parts[1], &parts[2]]).unwrap());
        assert_eq!(got.dims(), want.dims());
        assert_close(&got.to_f64_vec(), &want.to_f64_vec(), 1e-12, "forward");
        let grad = packed.attention_grad(ATTN_WRT_PACKED).unwrap();
        let all = eval_cpu(&grad, &[&p, &p, &p, &g_out]).unwrap();
        assert_eq!(all.dims(), &[b, s, 3, h, d]);
        let g_bhsd = swap(&g_out);
        for j in 0..3 {
            let one = plain.attention_grad(j as u8).unwrap();
            let want = eval_cpu(&one, &[&parts[0], &parts[1], &parts[2], &g_bhsd]).unwrap();
            let got = part_bhsd(&all, j);
            assert_close(
                &got.to_f64_vec(),
                &want.to_f64_vec(),
                1e-12,
                &format!("gradient {j} ({causal:?})"),
            );
        }
    }
    // Anything but one [B, S, 3, H, D] tensor is refused at build time, with the reason.
    let q = TensorType::new(DType::F32, Shape::new([2, 9, 3, 8]));
    let e = rustytorch::ops::infer(
        &attn(Causal::None, AttnMask::None, AttnLayout::Packed),
        &[&q, &q, &q],
    )
    .unwrap_err();
    assert!(e.to_string().contains("[B,S,3,H,D]"), "{e}");
}

const SMALL: Gpt2Config = Gpt2Config {
    layers: 1,
    batch: 2,
    seq: 16,
    d_model: 64,
    heads: 4,
};

/// A GPT-2 block of `dt` (q, k and v from one linear layer) with the mean square of what it
/// adds to its input as the loss, trained by SGD.
fn block_graph(cfg: &Gpt2Config, dt: DType) -> Graph {
    let g = GraphBuilder::new();
    let x = g.input("x", dt, [cfg.batch, cfg.seq, cfg.d_model]);
    let h = rustytorch::models::gpt2_block_typed(&g, cfg, 0, &x, dt);
    let r = h.sub(&x);
    let loss = r.mul(&r).mean_all();
    g.train_step(&loss, Sgd::new(2.0), &StepOptions::default())
        .unwrap();
    let mut graph = g.graph().unwrap();
    graph.add_output("loss", loss.node().unwrap()).unwrap();
    graph
}

/// The losses of four training steps of `graph` on the CPU after the CUDA compile passes
/// (`autocast` as given, packing on or off), on input `x`.
fn cpu_losses(graph: &Graph, autocast: Option<DType>, packed: bool, x: &HostTensor) -> Vec<f64> {
    let opts = passes::Options {
        autocast,
        ..cuda_passes(packed)
    };
    let passed = passes::run(graph, &opts).unwrap().graph;
    let run_opts = CompileOptions {
        optimize: false,
        ..CompileOptions::default()
    };
    let mut exe = rustytorch::compile_graph(&passed, Device::Cpu, &run_opts).unwrap();
    (0..4)
        .map(|_| exe.run(&[("x", x.clone())]).unwrap()[0].to_f64_vec()[0])
        .collect()
}

fn cuda_passes(packed: bool) -> passes::Options {
    passes::Options {
        attention_layout: true,
        attention_packed: packed,
        ..passes::Options::default()
    }
}

fn count(g: &Graph, f: impl Fn(&Op) -> bool) -> usize {
    g.live_order()
        .into_iter()
        .filter(|&n| f(&g.node(n).unwrap().op))
        .count()
}

/// On a block's training graph the pass leaves one packed attention and one packed gradient,
/// and no slice, pad or attention in another layout.
#[test]
fn the_pass_packs_a_gpt2_block() {
    let graph = block_graph(&SMALL, DType::BF16);
    let c = passes::run(&graph, &cuda_passes(true)).unwrap();
    let r = c.report.attention_packed.clone().unwrap();
    assert_eq!((r.packed, r.gradients, r.sums_removed), (1, 1, 1), "{r:?}");
    let g = &c.graph;
    let layout_of = |op: &Op| match op {
        Op::Attention { layout, .. } | Op::AttentionGrad { layout, .. } => Some(*layout),
        _ => None,
    };
    assert_eq!(count(g, |op| layout_of(op) == Some(AttnLayout::Packed)), 2);
    assert_eq!(
        count(g, |op| layout_of(op)
            .is_some_and(|l| l != AttnLayout::Packed)),
        0
    );
    assert_eq!(
        count(g, |op| matches!(op, Op::Slice { .. } | Op::Pad { .. })),
        0,
        "{}",
        rustytorch::compiler::text::print(g)
    );
    // The packed gradient reads the forward's saved statistics, and the layer's bias gradient
    // pairs with its weight gradient (one GEMM with cuBLASLt's BGRADB epilogue).
    let memory = c.report.memory.as_ref().unwrap();
    assert_eq!(memory.saved.len(), 1, "{:?}", memory.saved);
    let gemms: Vec<_> = g
        .live_order()
        .into_iter()
        .filter(|&n| matches!(g.node(n).unwrap().op, Op::Matmul { trans_a: true, .. }))
        .collect();
    let sums: Vec<_> = g
        .live_order()
        .into_iter()
        .filter(|&n| matches!(g.node(n).unwrap().op, Op::Reduce { .. }))
        .filter(|&n| g.ty(n).shape.dims().last() == Some(&192))
        .collect();
    assert_eq!(sums.len(), 1);
    let paired = gemms
        .iter()
        .filter(|&&m| rustytorch::compiler::plan::bias_grad_pair(g, m, sums[0]).unwrap())
        .count();
    assert_eq!(
        paired, 1,
        "the qkv bias gradient pairs with its weight gradient"
    );
    // Off, the slices stay.
    let off = passes::run(&graph, &cuda_passes(false)).unwrap();
    assert!(count(&off.graph, |op| matches!(op, Op::Slice { .. })) >= 3);
    // Under bf16 autocast (an f32 model) too: the gradient's casts to f32 and back to bf16
    // for the layer's GEMMs leave no slice, pad or round trip behind.
    let auto = block_graph(&SMALL, DType::F32);
    let opts = passes::Options {
        autocast: Some(DType::BF16),
        ..cuda_passes(true)
    };
    let c = passes::run(&auto, &opts).unwrap();
    let r = c.report.attention_packed.clone().unwrap();
    assert_eq!((r.packed, r.gradients, r.sums_removed), (1, 1, 1), "{r:?}");
    assert_eq!(
        count(&c.graph, |op| matches!(
            op,
            Op::Slice { .. } | Op::Pad { .. }
        )),
        0
    );
    // ... and it trains as the unpacked graph does.
    let x = rand_tensor(
        &TensorType::new(DType::F32, Shape::new([2, 16, 64])),
        12,
        -1.0,
        1.0,
    );
    let bf16 = Some(DType::BF16);
    let (want, got) = (
        cpu_losses(&auto, bf16, false, &x),
        cpu_losses(&auto, bf16, true, &x),
    );
    assert!(want[3] < want[0], "the loss falls: {want:?}");
    assert_close(
        &got,
        &want,
        1e-6,
        "autocast losses, packed against unpacked",
    );
    // f32 operands are not packed (the kernels that read packed operands are f16/bf16).
    let c = passes::run(&auto, &cuda_passes(true)).unwrap();
    assert_eq!(c.report.attention_packed.unwrap().packed, 0);
}

/// The packed training graph runs on the CPU as the unpacked one does: the same losses over
/// four SGD steps.
#[test]
fn packed_graph_trains_as_the_unpacked_one() {
    let graph = block_graph(&SMALL, DType::BF16);
    let x = rand_tensor(
        &TensorType::new(DType::BF16, Shape::new([2, 16, 64])),
        9,
        -1.0,
        1.0,
    );
    let (want, got) = (
        cpu_losses(&graph, None, false, &x),
        cpu_losses(&graph, None, true, &x),
    );
    assert!(want[3] < want[0], "the loss falls: {want:?}");
    assert_close(&got, &want, 1e-6, "losses, packed against unpacked");
}

fn packed_types(dt: DType, (b, s, h, d): (usize, usize, usize, usize)) -> [TensorType; 2] {
    [
        TensorType::new(dt, Shape::new([b, s, 3, h, d])),
        TensorType::new(dt, Shape::new([b, s, h, d])),
    ]
}

/// The CUDA lowering: the flash kernels address the packed operands (three heads' widths
/// between rows, k and v one and two widths in), the gradient is one step whose kernels all
/// write its one result, cuDNN's description strides the same way, and what the kernels do not
/// take is a clear error.
#[test]
fn cuda_lowering_of_packed_attention() {
    let [p, o] = packed_types(DType::BF16, (2, 100, 12, 64));
    let fwd = attn(Causal::TopLeft, AttnMask::None, AttnLayout::Packed);
    let grad = fwd.attention_grad(ATTN_WRT_PACKED).unwrap();
    // The flash kernels of a step, whether cuDNN may run it too or not (the device test of
    // this binary sets `RUSTYTORCH_ATTENTION` while this one may run).
    let flash_of = |step: CudaStep| match step {
        CudaStep::Attention { flash, .. }
        | CudaStep::AttentionGrad { flash, .. }
        | CudaStep::Kernels(flash) => flash,
        other => panic!("{other:?}"),
    };
    let cudnn = AttnDnnDesc::of(&fwd, &[&p, &p, &p], &o).unwrap();
    assert_eq!(cudnn.operand(100).1, [100 * 2304, 64, 2304, 1]);
    assert_eq!(cudnn.dims_strides(100).1, [100 * 768, 64, 768, 1]);
    assert_eq!(cudnn.part_offset(2), 2 * 768 * 2);
    for target in [Target::Hopper, Target::Portable] {
        let flash = flash_of(with_target(target, || lower_step(&fwd, &[&p, &p, &p], &o)).unwrap());
        let kernel = &flash.launches[0].kernel;
        let maps: Vec<_> = kernel
            .params
            .iter()
            .filter_map(|p| p.map.as_ref())
            .collect();
        if maps.is_empty() {
            let src = format!("{kernel:?}");
            // Row stride 3·12·64 and k's offset of one head width 12·64.
            assert!(src.contains("2304"), "packed row stride in {target:?}");
            assert!(src.contains("768LL"), "k's offset in {target:?}");
        } else {
            // The Hopper forward reads q, k and v through tensor maps: the same row stride
            // and offsets, in bytes; it writes the output ([b, s, h, d]) through a fourth.
            assert_eq!(target, Target::Hopper);
            assert_eq!(maps.len(), 4);
            for (part, map) in maps[..3].iter().enumerate() {
                assert_eq!(map.strides[0], 2304 * 2, "packed row stride of map {part}");
                assert_eq!(map.offset, (part * 768 * 2) as u64, "offset of map {part}");
            }
            assert_eq!(maps[3].strides[0], 768 * 2, "the output's row stride");
            assert_eq!(maps[3].offset, 0);
        }
        let flash =
            flash_of(with_target(target, || lower_step(&grad, &[&p, &p, &p, &o], &p)).unwrap());
        // Statistics, zeroing the dQ buffer, the fused backward, rounding dQ: every gradient
        // kernel writes the one result (or the step's scratch).
        assert_eq!(flash.launches.len(), 4);
        if target == Target::Hopper {
            // The fused backward writes dK and dV by bulk tensor copies through maps over the
            // packed result: its row stride, k's and v's offsets.
            let k = &flash.launches[2].kernel;
            for (name, part) in [("okmap", 1), ("ovmap", 2)] {
                let map = k
                    .params
                    .iter()
                    .find(|p| p.name == name)
                    .and_then(|p| p.map.as_ref())
                    .unwrap_or_else(|| panic!("{name} in {}", k.name));
                assert_eq!(map.strides[0], 2304 * 2, "{name}");
                assert_eq!(map.offset, (part * 768 * 2) as u64, "{name}");
            }
        }
        for l in &flash.launches[1..] {
            assert!(!l
                .args
                .iter()
                .any(|a| matches!(a, rustytorch::codegen::cuda::ArgRef::With(_))));
        }
    }
    assert!(AttnDnnDesc::of_grad(&grad, &[&p, &p, &p, &o], &p).is_some());
    // The pass packs the head sizes the flash kernels take, no larger.
    assert_eq!(
        rustytorch::compiler::attn_packed::MAX_PACKED_HEAD,
        rustytorch::codegen::cuda::flash::MAX_HEAD
    );
    // f32, or a head size the kernels do not take: refused with the reason.
    for (dt, d) in [(DType::F32, 64), (DType::BF16, 40)] {
        let [p, o] = packed_types(dt, (1, 10, 2, d));
        let e = lower_step(&fwd, &[&p, &p, &p], &o).unwrap_err();
        assert!(e.to_string().contains("packed"), "{e}");
    }
}

/// `(b, s, h, d)` of the device checks.
const SHAPES: [(usize, usize, usize, usize); 6] = [
    (2, 1, 3, 64),
    (1, 7, 2, 32),
    (2, 200, 3, 64),
    (1, 1000, 2, 128),
    (2, 130, 12, 64),
    (1, 77, 2, 128),
];

/// The device's packed forward and gradient against float64, through the flash kernels and
/// through cuDNN (where it covers the case), and a bf16 block's training against the CPU.
#[test]
fn packed_attention_on_the_device() {
    if !attention_check::cuda() {
        eprintln!("RUSTYTORCH_TEST_CUDA is not 1: the device checks are skipped");
        return;
    }
    let mut n = 0;
    for mode in ["flash", "cudnn"] {
        std::env::set_var("RUSTYTORCH_ATTENTION", mode);
        for dt in [DType::F16, DType::BF16] {
            for (k, &(b, s, h, d)) in SHAPES.iter().enumerate() {
                let [pt, ot] = packed_types(dt, (b, s, h, d));
                let p = rand_tensor(&pt, 40 + k as u64, -1.0, 1.0);
                let g_out = rand_tensor(&ot, 50 + k as u64, -1.0, 1.0);
                let mut m = rand_tensor(
                    &TensorType::new(DType::F64, Shape::new([s, s])),
                    60 + k as u64,
                    -2.0,
                    1.0,
                )
                .to_f64_vec();
                for (x, mv) in m.iter_mut().enumerate() {
                    if x < s || x % 5 == 0 {
                        *mv = f64::NEG_INFINITY;
                    }
                }
                let add = HostTensor::from_f64_slice(&TensorType::new(dt, Shape::new([s, s])), &m)
                    .unwrap();
                let keep = rand_tensor(
                    &TensorType::new(DType::Bool, Shape::new([b, 1, 1, s])),
                    70 + k as u64,
                    0.0,
                    1.0,
                );
                let masks: Vec<(AttnMask, Option<&HostTensor>)> = vec![
                    (AttnMask::None, None),
                    (AttnMask::Additive, Some(&add)),
                    (AttnMask::Bool, Some(&keep)),
                ];
                // Every causal kind and mask kind on every shape, in four cases (each case
                // compiles its own kernels).
                let cases = [
                    (Causal::None, 0),
                    (Causal::TopLeft, 0),
                    (Causal::BottomRight, 1),
                    (Causal::TopLeft, 2),
                ];
                for (causal, m) in cases {
                    let (mask, mv) = &masks[m];
                    // cuDNN takes no mask operand (its run covers unmasked cases) and times
                    // its plans at each compile: a few shapes are enough for its strides.
                    if mode == "cudnn" && (*mask != AttnMask::None || k % 2 == 1) {
                        continue;
                    }
                    let op = attn(causal, *mask, AttnLayout::Packed);
                    let mut ins = vec![p.clone(), p.clone(), p.clone()];
                    ins.extend(mv.cloned());
                    let what = format!("{mode} {dt} {:?} {causal:?} {mask:?}", (b, s, h, d));
                    attention_check::check_with(&format!("{what} forward"), &op, &ins, false);
                    n += 1;
                    // cuDNN's backward refuses one query over one key.
                    if mode == "cudnn" && s == 1 {
                        continue;
                    }
                    ins.push(g_out.clone());
                    let grad = op.attention_grad(ATTN_WRT_PACKED).unwrap();
                    attention_check::check_with(&format!("{what} gradient"), &grad, &ins, true);
                    n += 1;
                    eprintln!("ok: {what}");
                }
            }
        }
    }
    std::env::remove_var("RUSTYTORCH_ATTENTION");
    eprintln!("{n} packed checks against float64");

    // A bf16 block trained on CUDA (packed) and on the CPU: the same losses within bf16's
    // rounding over four steps.
    let cfg = Gpt2Config {
        seq: 128,
        d_model: 128,
        heads: 2,
        ..SMALL
    };
    let graph = block_graph(&cfg, DType::BF16);
    let x = rand_tensor(
        &TensorType::new(DType::BF16, Shape::new([2, 128, 128])),
        11,
        -1.0,
        1.0,
    );
    let losses = |device: Device| {
        let mut exe =
            rustytorch::compile_graph(&graph, device, &CompileOptions::default()).unwrap();
        (0..4)
            .map(|_| exe.run(&[("x", x.clone())]).unwrap()[0].to_f64_vec()[0])
            .collect::<Vec<f64>>()
    };
    let (cpu, gpu) = (losses(Device::Cpu), losses(Device::Cuda(0)));
    eprintln!("losses: cpu {cpu:?}, cuda {gpu:?}");
    assert_close(&gpu, &cpu, 2e-2, "block losses, CUDA against the CPU");
}
