//! CPU benchmark of a MiniLM-shaped BERT encoder (6 layers, width 384, 12 heads, MLP 1536, vocab
//! 30522; random weights): batch 8 × 32 tokens, mean pooling and L2 normalization, through the
//! compiled-graph path. Compare with `python3 ../shared/peers/ort_bert.py` (ONNX Runtime, same
//! shape) in the same run; `RAYON_NUM_THREADS=2` for the 2-thread figure.

#![allow(missing_docs)] // criterion_group! generates undocumented public functions

use criterion::{criterion_group, criterion_main, Criterion};
use rustytorch::models::bert::{bert_encoder, BertConfig};
use rustytorch::prelude::*;

fn encoder(c: &mut Criterion) {
    let (b, s) = (8usize, 32usize);
    let cfg = BertConfig::minilm_l6();
    let g = GraphBuilder::new();
    let m = bert_encoder(&g, &cfg, DType::F32, b, s);
    let mut exe = compile_with(
        &g,
        &[&m.embeddings],
        Device::Cpu,
        &CompileOptions::inference(),
    )
    .unwrap();
    let ids: Vec<i64> = (0..(b * s) as i64).map(|i| i * 7919 % 30522).collect();
    let ids = HostTensor::from_vec(ids, [b, s]).unwrap();
    let mask = HostTensor::from_vec(vec![1f32; b * s], [b, s]).unwrap();
    if std::env::var_os("BERT_PROFILE").is_some() {
        // Where the encoder's time goes, per op (`BERT_PROFILE=1`).
        let opts = rustytorch::profile::ProfileOptions {
            runs: 20,
            warmup: 3,
            group_by: rustytorch::profile::GroupBy::Op,
            limits: None,
        };
        let ins = [("input_ids", ids.clone()), ("attention_mask", mask.clone())];
        println!(
            "{}",
            rustytorch::profile::profile(&mut exe, &ins, &opts).unwrap()
        );
        exe.set_step_timing(false);
    }
    let mut group = c.benchmark_group("bert");
    group.sample_size(20);
    group.bench_function("minilm_l6_encoder_8x32", |bench| {
        bench.iter(|| {
            exe.run(&[("input_ids", ids.clone()), ("attention_mask", mask.clone())])
                .unwrap()
        })
    });
    group.finish();
}

/// The encoder's ops one by one at its shape (256 tokens), through the ops crate's CPU kernels:
/// where the time goes.
fn ops(c: &mut Criterion) {
    use rustytorch::ops::{eval_cpu, Activation, Op};
    let rand = |n: usize, seed: u64| -> Vec<f32> {
        rustytorch::ops::testing::rand_f64(n, seed, -1.0, 1.0)
            .into_iter()
            .map(|v| v as f32)
            .collect()
    };
    let t = |dims: &[usize], seed| {
        HostTensor::from_vec(rand(dims.iter().product(), seed), dims.to_vec()).unwrap()
    };
    let (n, d, f) = (256usize, 384usize, 1536usize);
    let x = t(&[n, d], 1);
    let hdn = t(&[n, f], 2);
    let (w_dd, w_fd, w_df) = (t(&[d, d], 3), t(&[f, d], 4), t(&[d, f], 5));
    let (b_d, b_f) = (t(&[d], 6), t(&[f], 7));
    let epi = |act| Op::MatmulEpilogue {
        trans_a: false,
        trans_b: true,
        bias: true,
        act,
        accumulate: false,
    };
    let q = t(&[8, 12, 32, 32], 8);
    let mask = HostTensor::from_vec(vec![0f32; 8 * 32], [8, 1, 1, 32]).unwrap();
    let cases: Vec<(&str, Op, Vec<&HostTensor>)> = vec![
        (
            "linear_384x384",
            epi(Activation::None),
            vec![&x, &w_dd, &b_d],
        ),
        (
            "linear_384x1536_gelu",
            epi(Activation::GeluErf),
            vec![&x, &w_fd, &b_f],
        ),
        (
            "linear_1536x384",
            epi(Activation::None),
            vec![&hdn, &w_df, &b_d],
        ),
        (
            "attention_8x12x32x32",
            // [B,H,S,D] operands, as the encoder's heads.
            rustytorch::ops::text::parse_op(&format!(
                "attention[causal=none,mask=additive,scale={:?}]",
                1.0 / 32f64.sqrt()
            ))
            .unwrap(),
            vec![&q, &q, &q, &mask],
        ),
        (
            "layer_norm_256x384",
            Op::LayerNorm {
                eps: 1e-12.into(),
                weight: true,
                bias: true,
            },
            vec![&x, &b_d, &b_d],
        ),
    ];
    let mut group = c.benchmark_group("bert_ops");
    group.sample_size(20);
    for (name, op, ins) in &cases {
        group.bench_function(*name, |bench| bench.iter(|| eval_cpu(op, ins).unwrap()));
    }
    // The small-head f32 attention kernel on the same operands.
    let (_, att, ins) = &cases[3];
    let out = rustytorch::ops::TensorType::new(DType::F32, [8, 12, 32, 32]);
    group.bench_function("attention_8x12x32x32_small_heads", |bench| {
        bench.iter(|| {
            rustytorch::ops::attention_cpu::forward_f32(att, ins, &out)
                .unwrap()
                .unwrap()
        })
    });
    group.finish();
}

criterion_group!(benches, encoder, ops);
criterion_main!(benches);
