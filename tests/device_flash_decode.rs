//! Split-key decoding (`codegen/src/cuda/flash/decode.rs`): attention of one query row over
//! many keys as two kernels, chunks of keys in parallel and then their combination.
//! - everywhere: the lowering of one query row picks the two kernels on every target, and other
//!   shapes keep the tiled kernels;
//! - on the GPU (`RUSTYTORCH_TEST_CUDA=1`): the result against a float64 reference of the same
//!   inputs over key counts below, at and past a chunk (1, 7, 256, 300, 1000, 8192), head sizes
//!   32/64/128 with `dv ≠ d`, f16 and bf16, both layouts, every causal kind, additive masks
//!   (one that masks every key: the row is zero) and bool masks; the long key sequences also in
//!   chunks of 256 and 1024 keys.

use rustytorch::codegen::cuda::{lower_step, with_target, Target};
use rustytorch::ops::testing::rand_tensor;
use rustytorch::ops::{AttnLayout, AttnMask, Causal, F64Bits, Op};
use rustytorch::prelude::*;

#[path = "common/attention_check.rs"]
mod attention_check;
#[path = "common/one_op.rs"]
mod one_op;
use attention_check::cuda;

fn attention(causal: Causal, mask: AttnMask, layout: AttnLayout, hd: usize) -> Op {
    Op::Attention {
        causal,
        mask,
        scale: F64Bits::new(1.0 / (hd as f64).sqrt()),
        layout,
    }
}

#[test]
fn one_query_row_lowers_to_the_decoding_kernels() {
    for target in [Target::Portable, Target::Hopper] {
        for (sq, hd, decode) in [
            (1, 128, true),
            (1, 32, true),
            (1, 80, false),
            (2, 64, false),
        ] {
            let tys = [
                TensorType::new(DType::BF16, Shape::new(vec![2, 3, sq, hd])),
                TensorType::new(DType::BF16, Shape::new(vec![2, 3, 1000, hd])),
                TensorType::new(DType::BF16, Shape::new(vec![2, 3, 1000, hd])),
            ];
            let refs: Vec<&TensorType> = tys.iter().collect();
            let op = attention(Causal::None, AttnMask::None, AttnLayout::Bhsd, hd);
            let out = rustytorch::ops::infer(&op, &refs).unwrap();
            let step = with_target(target, || lower_step(&op, &refs, &out)).unwrap();
            let names: Vec<&str> = step
                .launches()
                .iter()
                .map(|l| l.kernel.name.as_str())
                .collect();
            let what = format!("{target:?} sq {sq} head {hd}: {names:?}");
            if decode {
                assert_eq!(names.len(), 2, "{what}");
                assert!(names[0].starts_with("flash_decode_split"), "{what}");
                assert!(names[1].starts_with("flash_decode_combine"), "{what}");
            } else {
                assert!(
                    names.iter().all(|n| !n.starts_with("flash_decode")),
                    "{what}"
                );
            }
        }
    }
}

/// (batch, heads, keys, head size, value head size).
const SHAPES: [(usize, usize, usize, usize, usize); 7] = [
    (2, 3, 1, 64, 64),
    (1, 2, 7, 128, 128),
    (2, 2, 256, 64, 32),
    (2, 2, 300, 64, 64),
    (1, 3, 1000, 128, 128),
    (1, 2, 8192, 128, 64),
    (2, 1, 513, 32, 32),
];

#[test]
fn decoding_matches_float64() {
    if !cuda() {
        eprintln!("skipped: RUSTYTORCH_TEST_CUDA is not 1 (no GPU run)");
        return;
    }
    std::env::set_var("RUSTYTORCH_ATTENTION", "flash");
    for (n, &(b, h, sk, hd, hv)) in SHAPES.iter().enumerate() {
        let d = if n % 2 == 0 { DType::BF16 } else { DType::F16 };
        let layout = if n % 3 == 1 {
            AttnLayout::Bshd
        } else {
            AttnLayout::Bhsd
        };
        let seed = 900 + 10 * n as u64;
        let heads = |rows: usize, width: usize, s: u64| {
            let ty = TensorType::new(d, layout.from_bhsd([b, h, rows, width]));
            rand_tensor(&ty, s, -1.0, 1.0)
        };
        let qkv = vec![
            heads(1, hd, seed),
            heads(sk, hd, seed + 1),
            heads(sk, hv, seed + 2),
        ];
        // Additive masks over [1, sk]: random with every fifth key masked, and every key masked.
        let mut m =
            rand_tensor(&TensorType::new(DType::F64, [1, sk]), seed + 3, -2.0, 1.0).to_f64_vec();
        for (x, v) in m.iter_mut().enumerate() {
            if x % 5 == 4 {
                *v = f64::NEG_INFINITY;
            }
        }
        let add = HostTensor::from_f64_slice(&TensorType::new(d, [1, sk]), &m).unwrap();
        let none =
            HostTensor::from_f64_slice(&TensorType::new(d, [1, sk]), &vec![f64::NEG_INFINITY; sk])
                .unwrap();
        let keep = rand_tensor(
            &TensorType::new(DType::Bool, [b, 1, 1, sk]),
            seed + 4,
            0.0,
            1.0,
        );
        let with = |x: &HostTensor| {
            let mut v = qkv.clone();
            v.push(x.clone());
            v
        };
        let cases = [
            (Causal::None, AttnMask::None, qkv.clone(), "no mask"),
            (Causal::TopLeft, AttnMask::None, qkv.clone(), "top-left"),
            (
                Causal::BottomRight,
                AttnMask::None,
                qkv.clone(),
                "bottom-right",
            ),
            (Causal::None, AttnMask::Additive, with(&add), "additive"),
            (
                Causal::BottomRight,
                AttnMask::Additive,
                with(&none),
                "every key masked",
            ),
            (Causal::None, AttnMask::Bool, with(&keep), "bool"),
        ];
        for (causal, mask, ins, label) in cases {
            let what = format!("{d:?} {layout:?} {label} b{b} h{h} sk{sk} d{hd} dv{hv}");
            let op = attention(causal, mask, layout, hd);
            attention_check::check_with(&what, &op, &ins, true);
            eprintln!("ok: {what}");
            // These heads are too few for long chunks: the long keys also run in the chunks
            // that many heads get (read when the graph is compiled).
            if sk >= 1000 && matches!(label, "no mask" | "additive") {
                for chunk in ["256", "1024"] {
                    std::env::set_var("RUSTYTORCH_DECODE_CHUNK", chunk);
                    attention_check::check_with(&format!("{what} chunk {chunk}"), &op, &ins, true);
                    std::env::remove_var("RUSTYTORCH_DECODE_CHUNK");
                    eprintln!("ok: {what} chunk {chunk}");
                }
            }
        }
    }
}
