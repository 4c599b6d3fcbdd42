//! The Hopper fused flash backward (warpgroup MMA, built for `sm_90a`) against a float64
//! reference of the same inputs: the gradients of one attention computed together in one step
//! (all three, or `dQ` with `dK` or `dV`), f16 and bf16, head sizes 64 and 128, both layouts,
//! Sq = Sk, Sq < Sk, Sq > Sk, one query row, key counts that end inside a block, no causal
//! mask, the top-left and the bottom-right one (rows that see no key), additive masks with a
//! fully masked row, bool masks.
//!
//! On the GPU machine (`RUSTYTORCH_TEST_CUDA=1`, an H200) the session lowers for Hopper;
//! `RUSTYTORCH_ATTENTION=flash`, set here for the whole process, keeps cuDNN's attention out.
//! Elsewhere the device part prints a notice and returns; the lowering check runs everywhere.

use rustytorch::codegen::cuda::{flash, with_target, Target};
use rustytorch::compiler::Graph;
use rustytorch::ops::testing::{assert_close, rand_tensor};
use rustytorch::ops::{eval_cpu, AttnLayout, AttnMask, Causal, F64Bits, Op};
use rustytorch::prelude::*;

fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

fn t(d: DType, dims: &[usize]) -> TensorType {
    TensorType::new(d, Shape::new(dims.to_vec()))
}

/// The gradient ops of an attention, one per `wrt`.
fn grads(causal: Causal, mask: AttnMask, layout: AttnLayout, hd: usize, wrts: &[u8]) -> Vec<Op> {
    wrts.iter()
        .map(|&wrt| Op::AttentionGrad {
            causal,
            mask,
            scale: F64Bits::new(1.0 / (hd as f64).sqrt()),
            wrt,
            layout,
        })
        .collect()
}

/// The lowering for Hopper runs the grouped gradients of equal head sizes 64 and 128 in the
/// warpgroup kernel, and the others (or the portable lowering) in the portable fused kernel.
#[test]
fn hopper_lowering_picks_the_warpgroup_backward() {
    for (hd, hv, hopper) in [
        (64, 64, true),
        (128, 128, true),
        (64, 128, false),
        (48, 48, false),
    ] {
        let ins = [
            t(DType::BF16, &[1, 2, 300, hd]),
            t(DType::BF16, &[1, 2, 200, hd]),
            t(DType::BF16, &[1, 2, 200, hv]),
            t(DType::BF16, &[1, 2, 300, hv]),
        ];
        let refs: Vec<&TensorType> = ins.iter().collect();
        let ops = grads(
            Causal::TopLeft,
            AttnMask::None,
            AttnLayout::Bhsd,
            hd,
            &[0, 1, 2],
        );
        let outs: Vec<TensorType> = ops
            .iter()
            .map(|op| rustytorch::ops::infer(op, &refs).unwrap())
            .collect();
        let lower = |target| {
            with_target(target, || {
                flash::lower_grad_group(
                    &ops.iter().collect::<Vec<_>>(),
                    &refs,
                    &outs.iter().collect::<Vec<_>>(),
                )
            })
            .unwrap()
        };
        let name = lower(Target::Hopper).launches[2].kernel.name.clone();
        assert_eq!(
            name.starts_with("flash_attention_bwd_sm90"),
            hopper,
            "{hd}/{hv}: {name}"
        );
        let portable = lower(Target::Portable).launches[2].kernel.name.clone();
        assert!(portable.starts_with("flash_attention_bwd") && !portable.contains("sm90"));
    }
}

/// The Hopper backward launches a persistent grid (as many blocks as 132 SMs hold, each
/// walking rounds of key tiles) at both head sizes, causal or not.
#[test]
fn hopper_backward_grid_persists() {
    for hd in [64, 128] {
        for causal in [Causal::None, Causal::TopLeft] {
            let ins: Vec<TensorType> = (0..4)
                .map(|_| t(DType::BF16, &[16, 16, 1024, hd]))
                .collect();
            let refs: Vec<&TensorType> = ins.iter().collect();
            let ops = grads(causal, AttnMask::None, AttnLayout::Bhsd, hd, &[0, 1, 2]);
            let outs: Vec<TensorType> = ops
                .iter()
                .map(|op| rustytorch::ops::infer(op, &refs).unwrap())
                .collect();
            let step = with_target(Target::Hopper, || {
                flash::lower_grad_group(
                    &ops.iter().collect::<Vec<_>>(),
                    &refs,
                    &outs.iter().collect::<Vec<_>>(),
                )
            })
            .unwrap();
            let l = &step.launches[2];
            assert!(l.kernel.name.starts_with("flash_attention_bwd_sm90"));
            assert_eq!(l.grid, 132, "head {hd} {causal:?}");
        }
    }
}

/// `[B, H, Sq, Sk, D]` shapes.
const SHAPES: [[usize; 5]; 7] = [
    [2, 3, 200, 77, 64],
    [1, 2, 1000, 1000, 128],
    [1, 2, 130, 257, 64],
    [2, 1, 65, 129, 128],
    [1, 2, 300, 1000, 128],
    [1, 2, 1, 90, 64],
    [1, 1, 700, 300, 64],
];

#[test]
fn hopper_fused_backward_matches_float64() {
    if !cuda() {
        eprintln!("skipped: RUSTYTORCH_TEST_CUDA is not 1 (no GPU run)");
        return;
    }
    std::env::set_var("RUSTYTORCH_ATTENTION", "flash");
    let small = std::env::var("RUSTYTORCH_TEST_SMALL").as_deref() == Ok("1");
    let kinds = [
        (Causal::None, AttnMask::None),
        (Causal::None, AttnMask::Additive),
        (Causal::None, AttnMask::Bool),
        (Causal::TopLeft, AttnMask::None),
        (Causal::BottomRight, AttnMask::None),
        (Causal::BottomRight, AttnMask::Additive),
    ];
    let mut n = 0u64;
    for (s, &[b, h, sq, sk, hd]) in SHAPES.iter().enumerate() {
        if small && sq * sk > 40_000 {
            continue;
        }
        for &(causal, mask) in &kinds {
            n += 1;
            let d = if n.is_multiple_of(2) {
                DType::BF16
            } else {
                DType::F16
            };
            let layout = if n % 3 == 1 {
                AttnLayout::Bshd
            } else {
                AttnLayout::Bhsd
            };
            let wrts: &[u8] = match n % 4 {
                1 => &[0, 2],
                3 => &[0, 1],
                _ => &[0, 1, 2],
            };
            let seed = 900 + 10 * n;
            let dims = |s: usize| layout.from_bhsd([b, h, s, hd]);
            let mut inputs = vec![
                rand_tensor(&t(d, &dims(sq)), seed, -1.0, 1.0),
                rand_tensor(&t(d, &dims(sk)), seed + 1, -1.0, 1.0),
                rand_tensor(&t(d, &dims(sk)), seed + 2, -1.0, 1.0),
            ];
            match mask {
                AttnMask::None => {}
                AttnMask::Additive => {
                    // Row 0 fully masked, every fifth entry masked, the rest random.
                    let mut m =
                        rand_tensor(&t(DType::F64, &[sq, sk]), seed + 3, -2.0, 1.0).to_f64_vec();
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
            inputs.push(rand_tensor(&t(d, &dims(sq)), seed + 4, -1.0, 1.0));
            let ops = grads(causal, mask, layout, hd, wrts);
            let what = format!(
                "{d:?} {layout:?} {causal:?} {mask:?} {:?} {wrts:?}",
                SHAPES[s]
            );
            let mut g = Graph::new();
            let ids: Vec<_> = inputs
                .iter()
                .enumerate()
                .map(|(i, x)| g.add_input(&format!("x{i}"), x.ty()).unwrap())
                .collect();
            for (k, op) in ops.iter().enumerate() {
                let y = g.add(op.clone(), &ids).unwrap();
                g.add_output(&format!("g{k}"), y).unwrap();
            }
            let opts = CompileOptions {
                optimize: false,
                ..CompileOptions::default()
            };
            let mut exe = rustytorch::compile_graph(&g, Device::Cuda(0), &opts)
                .unwrap_or_else(|e| panic!("{what}: compile: {e}"));
            let names: Vec<String> = (0..inputs.len()).map(|i| format!("x{i}")).collect();
            let args: Vec<(&str, HostTensor)> = names
                .iter()
                .zip(&inputs)
                .map(|(n, x)| (n.as_str(), x.clone()))
                .collect();
            let got = exe
                .run(&args)
                .unwrap_or_else(|e| panic!("{what}: run: {e}"))
                .into_vec();
            let wide: Vec<HostTensor> = inputs
                .iter()
                .map(|x| {
                    if x.dtype() == DType::Bool {
                        x.clone()
                    } else {
                        x.cast(DType::F64)
                    }
                })
                .collect();
            let refs: Vec<&HostTensor> = wide.iter().collect();
            for (op, got) in ops.iter().zip(got) {
                let want = eval_cpu(op, &refs).unwrap();
                assert_eq!(got.shape(), want.shape(), "{what}");
                let (mut got, mut want) = (got.to_f64_vec(), want.to_f64_vec());
                // Errors relative to the result's largest magnitude (at least 1): gradients
                // sum many products.
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
