//! The Hopper flash attention forward (warpgroup MMA, built for `sm_90a`) against a float64
//! reference of the same inputs: f16 and bf16, head sizes 64 and 128 (value heads unlike the
//! query's), Sq = Sk, Sq < Sk, Sq > Sk, Sk smaller than a key tile, no causal mask, the top-left
//! and the bottom-right one (rows that see no key give zeros), additive masks with fully masked
//! rows, bool masks, both layouts; and the three gradients, whose first kernel (the statistics
//! pass) is the same forward.
//!
//! On the GPU machine (`RUSTYTORCH_TEST_CUDA=1`, an H200) the session lowers for Hopper; the
//! variable `RUSTYTORCH_ATTENTION=flash` this test sets (process-wide, so everything runs in one
//! test) keeps cuDNN's attention out. Elsewhere the device part prints a notice and returns; the
//! lowering checks run everywhere.

use rustytorch::codegen::cuda::{lower_step, source, with_target, Target};
use rustytorch::ops::testing::rand_tensor;
use rustytorch::ops::{AttnLayout, AttnMask, Causal, F64Bits, Op};
use rustytorch::prelude::*;

#[path = "common/attention_check.rs"]
mod attention_check;
#[path = "common/one_op.rs"]
mod one_op;
use attention_check::cuda;

/// The device result against the float64 reference of the same inputs, errors relative to the
/// reference's largest magnitude (f16 within 4e-3, bf16 within 2e-2: `P` is rounded to the
/// operands' type before `P·V`, and the result once more).
fn check(what: &str, op: &Op, inputs: &[HostTensor]) {
    attention_check::check_with(what, op, inputs, true);
    eprintln!("ok: {what}");
}

/// `[B, H, S, D]` sizes `(b, h, sq, sk, d, dv)` the Hopper kernel takes.
const SHAPES: [(usize, usize, usize, usize, usize, usize); 6] = [
    (2, 3, 200, 77, 64, 64),
    (1, 2, 1000, 1000, 128, 128),
    (1, 2, 130, 257, 64, 128),
    (1, 1, 300, 1000, 128, 64),
    (1, 2, 1000, 7, 64, 64),
    (2, 1, 65, 129, 128, 128),
];

fn heads(d: DType, layout: AttnLayout, bhsd: [usize; 4], seed: u64) -> HostTensor {
    rand_tensor(&TensorType::new(d, layout.from_bhsd(bhsd)), seed, -1.0, 1.0)
}

/// The forward cases of one shape: unmasked, an additive mask (the first row and every fifth
/// entry −∞) and a bool mask over the keys, each op with its inputs.
fn cases(
    d: DType,
    layout: AttnLayout,
    (b, h, sq, sk, hd, hv): (usize, usize, usize, usize, usize, usize),
    seed: u64,
) -> Vec<(AttnMask, Vec<HostTensor>)> {
    let qkv = vec![
        heads(d, layout, [b, h, sq, hd], seed),
        heads(d, layout, [b, h, sk, hd], seed + 1),
        heads(d, layout, [b, h, sk, hv], seed + 2),
    ];
    let mut m = rand_tensor(
        &TensorType::new(DType::F64, Shape::new(vec![sq, sk])),
        seed + 3,
        -2.0,
        1.0,
    )
    .to_f64_vec();
    for (x, mv) in m.iter_mut().enumerate() {
        if x < sk || x % 5 == 0 {
            *mv = f64::NEG_INFINITY;
        }
    }
    let add =
        HostTensor::from_f64_slice(&TensorType::new(d, Shape::new(vec![sq, sk])), &m).unwrap();
    let keep = rand_tensor(
        &TensorType::new(DType::Bool, Shape::new(vec![b, 1, 1, sk])),
        seed + 4,
        0.0,
        1.0,
    );
    let with = |x: &HostTensor| {
        let mut v = qkv.clone();
        v.push(x.clone());
        v
    };
    vec![
        (AttnMask::None, qkv.clone()),
        (AttnMask::Additive, with(&add)),
        (AttnMask::Bool, with(&keep)),
    ]
}

/// The lowering for Hopper runs these shapes in the warpgroup-MMA kernel (and its statistics
/// form for the gradients); the portable lowering does not.
#[test]
fn hopper_lowering_picks_the_warpgroup_kernel() {
    for &(b, h, sq, sk, hd, hv) in &SHAPES {
        for layout in [AttnLayout::Bhsd, AttnLayout::Bshd] {
            let tys = [
                TensorType::new(DType::BF16, layout.from_bhsd([b, h, sq, hd])),
                TensorType::new(DType::BF16, layout.from_bhsd([b, h, sk, hd])),
                TensorType::new(DType::BF16, layout.from_bhsd([b, h, sk, hv])),
                TensorType::new(DType::BF16, layout.from_bhsd([b, h, sq, hv])),
            ];
            let refs: Vec<&TensorType> = tys.iter().collect();
            let fwd = Op::Attention {
                causal: Causal::TopLeft,
                mask: AttnMask::None,
                scale: F64Bits::new(0.1),
                layout,
            };
            let out = rustytorch::ops::infer(&fwd, &refs[..3]).unwrap();
            let name = |t: Target, op: &Op, ins: &[&TensorType], out: &TensorType| {
                let step = with_target(t, || lower_step(op, ins, out)).unwrap();
                step.launches()[0].kernel.name.clone()
            };
            assert!(
                name(Target::Hopper, &fwd, &refs[..3], &out).starts_with("flash_attention_sm90")
            );
            // The warp-specialized kernel: a producer and two consumer warpgroups (three at
            // head size 64, but for causal attention over at most 1024 query rows).
            let step = with_target(Target::Hopper, || lower_step(&fwd, &refs[..3], &out)).unwrap();
            let consumers = if hd.max(hv) <= 64 && sq > 1024 { 3 } else { 2 };
            assert_eq!(step.launches()[0].kernel.block, 128 * (1 + consumers));
            assert!(!name(Target::Portable, &fwd, &refs[..3], &out).contains("sm90"));
            let grad = Op::AttentionGrad {
                causal: Causal::TopLeft,
                mask: AttnMask::None,
                scale: F64Bits::new(0.1),
                wrt: 1,
                layout,
            };
            let gout = rustytorch::ops::infer(&grad, &refs).unwrap();
            assert!(
                name(Target::Hopper, &grad, &refs, &gout).starts_with("flash_attention_stats_sm90")
            );
        }
    }
    // Too few query rows for a warpgroup tile, or a head size it does not take: the portable
    // kernel.
    for (sq, hd) in [(64, 64), (1, 128), (300, 80), (300, 32)] {
        let tys = [
            TensorType::new(DType::F16, Shape::new(vec![1, 2, sq, hd])),
            TensorType::new(DType::F16, Shape::new(vec![1, 2, 100, hd])),
            TensorType::new(DType::F16, Shape::new(vec![1, 2, 100, hd])),
        ];
        let refs: Vec<&TensorType> = tys.iter().collect();
        let op = Op::Attention {
            causal: Causal::None,
            mask: AttnMask::None,
            scale: F64Bits::new(0.1),
            layout: AttnLayout::Bhsd,
        };
        let out = rustytorch::ops::infer(&op, &refs).unwrap();
        let step = with_target(Target::Hopper, || lower_step(&op, &refs, &out)).unwrap();
        let k = &step.launches()[0].kernel;
        assert!(!k.name.contains("sm90"), "sq {sq} head {hd}: {}", k.name);
    }
}

/// The grids the Hopper forward launches: persistent (as many blocks as 132 SMs hold, taking
/// their tiles at run time at head size 64, walking rounds of tiles at 128) but for causal
/// attention at head size 128, which launches one block a tile (its 128-row query tiles'
/// uneven costs the hardware balances better as SMs free up).
#[test]
fn hopper_forward_grids_persist_but_for_causal_head_128() {
    let (b, h, s) = (16, 16, 1024);
    for hd in [64, 128] {
        for causal in [Causal::None, Causal::TopLeft] {
            let tys: Vec<TensorType> = (0..3)
                .map(|_| TensorType::new(DType::BF16, Shape::new(vec![b, h, s, hd])))
                .collect();
            let refs: Vec<&TensorType> = tys.iter().collect();
            let fwd = Op::Attention {
                causal,
                mask: AttnMask::None,
                scale: F64Bits::new(0.1),
                layout: AttnLayout::Bhsd,
            };
            let out = rustytorch::ops::infer(&fwd, &refs).unwrap();
            let step = with_target(Target::Hopper, || lower_step(&fwd, &refs, &out)).unwrap();
            let l = &step.launches()[0];
            let what = format!("head {hd} {causal:?}");
            let src = source(&l.kernel).unwrap();
            let queued = src.contains("atomicAdd(&rt_queue[0], 1ull)");
            assert_eq!(queued, hd == 64, "{what}");
            if hd == 128 && causal != Causal::None {
                assert_eq!(l.grid as usize, b * h * s.div_ceil(128), "{what}");
                assert!(!src.contains("++round_)"), "{what}");
            } else {
                assert_eq!(l.grid, 132, "{what}");
                // A fixed walk goes by rounds; tiles taken at run time need none.
                assert_eq!(src.contains("++round_)"), !queued, "{what}");
            }
        }
    }
}

#[test]
fn hopper_flash_forward_and_gradients_match_float64() {
    if !cuda() {
        eprintln!("skipped: RUSTYTORCH_TEST_CUDA is not 1 (no GPU run)");
        return;
    }
    std::env::set_var("RUSTYTORCH_ATTENTION", "flash");
    // `RUSTYTORCH_TEST_SMALL=1` keeps the shapes small enough for compute-sanitizer.
    let small = std::env::var("RUSTYTORCH_TEST_SMALL").as_deref() == Ok("1");
    // Every case compiles kernels of its own (NVRTC takes about a second for each), so the
    // element types and layouts take turns over the shapes, and the masks and causal kinds are
    // those that change the kernel's edges: unmasked in every causal kind, both masks without
    // causality, and an additive mask with the bottom-right one.
    let kinds = [
        (Causal::None, AttnMask::None),
        (Causal::None, AttnMask::Additive),
        (Causal::None, AttnMask::Bool),
        (Causal::TopLeft, AttnMask::None),
        (Causal::BottomRight, AttnMask::None),
        (Causal::BottomRight, AttnMask::Additive),
    ];
    for (n, &shape) in SHAPES.iter().enumerate() {
        let (b, h, sq, sk, hd, hv) = shape;
        if small && sq * sk > 40_000 {
            continue;
        }
        let d = if n % 2 == 0 { DType::BF16 } else { DType::F16 };
        let layout = if n % 3 == 1 {
            AttnLayout::Bshd
        } else {
            AttnLayout::Bhsd
        };
        let seed = 700 + 10 * n as u64;
        let scale = F64Bits::new(1.0 / (hd as f64).sqrt());
        let all = cases(d, layout, shape, seed);
        for &(causal, mask) in &kinds {
            let ins = &all.iter().find(|(m, _)| *m == mask).expect("mask case").1;
            let what =
                format!("{d:?} {layout:?} {causal:?} {mask:?} [{b},{h},{sq},{sk},{hd},{hv}]");
            let op = Op::Attention {
                causal,
                mask,
                scale,
                layout,
            };
            check(&what, &op, ins);
            // Sections of four heads in the tile order: with six (batch, head) pairs the last
            // section holds two.
            if b * h == 6 && causal == Causal::TopLeft && mask == AttnMask::None {
                std::env::set_var("RUSTYTORCH_HOPPER_SECTION_HEADS", "4");
                check(&format!("{what} sections of 4 heads"), &op, ins);
                std::env::remove_var("RUSTYTORCH_HOPPER_SECTION_HEADS");
            }
            // The gradients (their statistics pass is this kernel) where the float64
            // reference stays quick.
            if sq * sk > 60_000 || (causal, mask) != (Causal::TopLeft, AttnMask::None) {
                continue;
            }
            let mut gins = ins.clone();
            gins.push(heads(d, layout, [b, h, sq, hv], seed + 5));
            for wrt in 0..3u8 {
                let grad = Op::AttentionGrad {
                    causal,
                    mask,
                    scale,
                    wrt,
                    layout,
                };
                check(&format!("{what} grad {wrt}"), &grad, &gins);
            }
        }
    }
    // Scales that are not positive: the scores' maxima are taken after scaling on every tile
    // (a negative scale turns the raw maximum into the scaled minimum).
    for (n, scale) in [(0usize, -0.125), (2, -0.3), (0, 0.0)] {
        let shape = SHAPES[n];
        let (b, h, sq, sk, hd, hv) = shape;
        let all = cases(DType::BF16, AttnLayout::Bhsd, shape, 900 + n as u64);
        for causal in [Causal::None, Causal::TopLeft] {
            let op = Op::Attention {
                causal,
                mask: AttnMask::None,
                scale: F64Bits::new(scale),
                layout: AttnLayout::Bhsd,
            };
            check(
                &format!("BF16 scale {scale} {causal:?} [{b},{h},{sq},{sk},{hd},{hv}]"),
                &op,
                &all[0].1,
            );
        }
    }
}
