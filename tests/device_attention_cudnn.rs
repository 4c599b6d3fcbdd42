//! Attention forward through cuDNN's fused attention on CUDA (`RUSTYTORCH_ATTENTION=cudnn`
//! forces it; a shape it cannot take is an error) against a float64 reference of the same
//! inputs: f16 and bf16, head sizes 32, 64, 80 and 128, Sq = Sk, Sq < Sk and Sq = 1, no causal
//! mask, the top-left and the bottom-right one, both layouts, two scales. Then the default (auto) mode, which times
//! cuDNN against the flash kernel and keeps the faster, over the same shapes; and the shapes the
//! cuDNN path leaves to the flash kernel (an additive mask, a bottom-right causal mask) are an
//! error when cuDNN is forced and equal to the reference in auto mode.
//!
//! Runs where `RUSTYTORCH_TEST_CUDA=1` (the GPU machine); elsewhere it prints a notice and
//! returns. The variable it sets is process-wide, so everything runs in one test, in order.

use rustytorch::ops::testing::rand_tensor;
use rustytorch::ops::{AttnLayout, AttnMask, Causal, F64Bits, Op};
use rustytorch::prelude::*;

#[path = "common/attention_check.rs"]
mod attention_check;
#[path = "common/one_op.rs"]
mod one_op;
use attention_check::{cuda, run};

/// The device result against the float64 reference of the same inputs.
fn check(what: &str, op: &Op, inputs: &[HostTensor]) {
    attention_check::check_with(what, op, inputs, false)
}

/// q, k, v of `[B, H, S, D]` sizes in `layout`, uniform in [-1, 1] (never all zero).
fn qkv(
    d: DType,
    layout: AttnLayout,
    (b, h, sq, sk, hd): (usize, usize, usize, usize, usize),
    seed: u64,
) -> Vec<HostTensor> {
    let t = |s: usize| TensorType::new(d, layout.from_bhsd([b, h, s, hd]));
    vec![
        rand_tensor(&t(sq), seed, -1.0, 1.0),
        rand_tensor(&t(sk), seed + 1, -1.0, 1.0),
        rand_tensor(&t(sk), seed + 2, -1.0, 1.0),
    ]
}

fn attention(causal: Causal, mask: AttnMask, scale: f64, layout: AttnLayout) -> Op {
    Op::Attention {
        causal,
        mask,
        scale: F64Bits::new(scale),
        layout,
    }
}

/// Every covered case (dtype, head size, shape, causal kind, layout, scale), each layout and
/// causal kind meeting each shape across the head sizes.
fn cases(head_sizes: &[usize]) -> Vec<(String, Op, Vec<HostTensor>)> {
    let mut out = vec![];
    let mut seed = 500;
    for d in [DType::BF16, DType::F16] {
        for &hd in head_sizes {
            let shapes = [(2, 3, 70, 70, hd), (1, 2, 33, 130, hd), (2, 4, 1, 77, hd)];
            for (si, &shape) in shapes.iter().enumerate() {
                for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
                    let layout = if (si + causal as usize + hd / 16).is_multiple_of(2) {
                        AttnLayout::Bhsd
                    } else {
                        AttnLayout::Bshd
                    };
                    let scale = if si == 1 {
                        0.3
                    } else {
                        1.0 / (hd as f64).sqrt()
                    };
                    seed += 3;
                    out.push((
                        format!("{d:?} D{hd} {shape:?} {causal:?} {layout:?} scale {scale}"),
                        attention(causal, AttnMask::None, scale, layout),
                        qkv(d, layout, shape, seed),
                    ));
                }
            }
        }
    }
    out
}

/// The shapes the cuDNN path leaves to the flash kernel: an additive mask (row 0 fully masked,
/// every fifth key masked) and a bottom-right causal mask with more queries than keys (rows
/// fully masked, which the op defines as zeros).
fn flash_only() -> Vec<(String, Op, Vec<HostTensor>)> {
    let (d, l) = (DType::BF16, AttnLayout::Bhsd);
    let (sq, sk) = (40, 24);
    let mut masked = qkv(d, l, (1, 2, sq, sk, 64), 900);
    let mut m = rand_tensor(&TensorType::new(DType::F64, [sq, sk]), 903, -2.0, 1.0).to_f64_vec();
    for (x, mv) in m.iter_mut().enumerate() {
        if x < sk || x % 5 == 0 {
            *mv = f64::NEG_INFINITY;
        }
    }
    masked.push(HostTensor::from_f64_slice(&TensorType::new(d, [sq, sk]), &m).unwrap());
    vec![
        (
            "additive mask".into(),
            attention(Causal::None, AttnMask::Additive, 0.125, l),
            masked,
        ),
        (
            "bottom-right causal".into(),
            attention(Causal::BottomRight, AttnMask::None, 0.125, l),
            qkv(d, l, (1, 2, sq, sk, 64), 910),
        ),
    ]
}

#[test]
fn cudnn_attention_forced_and_auto() {
    if !cuda() {
        eprintln!("device_attention_cudnn: skipped (set RUSTYTORCH_TEST_CUDA=1 on a GPU machine)");
        return;
    }
    // Forced: every covered case through cuDNN.
    std::env::set_var("RUSTYTORCH_ATTENTION", "cudnn");
    for (what, op, ins) in cases(&[32, 64, 80, 128]) {
        check(&format!("cudnn {what}"), &op, &ins);
    }
    for (what, op, ins) in flash_only() {
        let e = run(&op, &ins).expect_err(&what);
        assert!(e.contains("RUSTYTORCH_ATTENTION=cudnn"), "{what}: {e}");
    }
    // Auto: the faster of cuDNN and the flash kernel, per shape.
    std::env::remove_var("RUSTYTORCH_ATTENTION");
    for (what, op, ins) in cases(&[64, 128]).into_iter().chain(flash_only()) {
        check(&format!("auto {what}"), &op, &ins);
    }
    // Forced flash over the same covered shapes (the reference the bench compares against).
    std::env::set_var("RUSTYTORCH_ATTENTION", "flash");
    for (what, op, ins) in cases(&[64]) {
        check(&format!("flash {what}"), &op, &ins);
    }
    std::env::remove_var("RUSTYTORCH_ATTENTION");
}
