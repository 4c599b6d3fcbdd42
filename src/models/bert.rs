//! BERT encoders and sentence embeddings (sentence-transformers' all-MiniLM-L6-v2 and models of
//! the same shape) from a model folder:
//!
//! - `config.json`: the Hugging Face `BertModel` configuration ([`BertConfig`]);
//! - `model.safetensors`: the weights, f32, f16 or bf16, mapped by name onto the graph's
//!   parameters ([`load_weights`]): a missing, extra or mis-shaped tensor is an error naming it;
//! - `tokenizer.json`: the WordPiece tokenizer, read by the `tokenizers` crate;
//! - `sentence_bert_config.json` (optional): `max_seq_length`, the truncation length;
//! - `1_Pooling/config.json` (optional): only mean pooling is supported.
//!
//! The graph is spelled the way the reference (transformers' `BertModel`) computes it —
//! LayerNorm from means and `rsqrt`, softmax from `exp`/`sum`/`div`, attention from matmuls with
//! the additive padding mask `(1 − mask)·min(dtype)`, `gelu(x·Wᵀ + b)` — so the optimizer turns
//! it into `layer_norm`, `attention` and `matmul_epilogue` ops. The sentence embedding is the
//! mean of the token states over the attention mask (the count clamped at 1e-9), divided by its
//! L2 norm (clamped at 1e-12), as sentence-transformers' `Pooling` and `Normalize` modules do.
//!
//! ```no_run
//! use rustytorch::models::bert::SentenceEncoder;
//! use rustytorch::{DType, Device};
//!
//! let mut enc = SentenceEncoder::load("models/all-MiniLM-L6-v2".as_ref(), Device::Cpu, DType::F32)?;
//! let emb = enc.embed(&["A sentence.", "Another one."], 8)?;
//! assert_eq!(emb[0].len(), enc.dim());
//! # Ok::<(), rustytorch::Error>(())
//! ```

use super::{layer_norm_primitives, softmax_primitives};
use crate::{compile_graph, CompileOptions, Error, Executable, Result};
use crate::{DType, Device, GraphBuilder, HostTensor, Init, Tensor, TensorType};
use rustytorch_compiler::Graph;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The fields of a Hugging Face BERT `config.json` that the graph needs.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct BertConfig {
    /// Vocabulary size (rows of the word embedding table).
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Transformer layers.
    pub num_hidden_layers: usize,
    /// Attention heads (`hidden_size` must be a multiple).
    pub num_attention_heads: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: usize,
    /// Longest sequence the position embeddings cover.
    pub max_position_embeddings: usize,
    /// Token-type (segment) vocabulary.
    #[serde(default = "two")]
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// The MLP activation; only `gelu` (the exact erf form) is supported.
    #[serde(default = "default_act")]
    pub hidden_act: String,
}

fn two() -> usize {
    2
}
fn default_eps() -> f64 {
    1e-12
}
fn default_act() -> String {
    "gelu".into()
}

fn file_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::File {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| file_err(path, e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| file_err(path, e.to_string()))
}

impl BertConfig {
    /// Reads and checks a `config.json`.
    pub fn from_file(path: &Path) -> Result<BertConfig> {
        let cfg: BertConfig = read_json(path)?;
        cfg.check().map_err(|reason| file_err(path, reason))?;
        Ok(cfg)
    }

    /// Checks what the graph builder relies on.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.hidden_act != "gelu" {
            return Err(format!(
                "hidden_act `{}` is not supported (only `gelu`, the erf form)",
                self.hidden_act
            ));
        }
        if self.num_attention_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return Err(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.type_vocab_size == 0 || self.vocab_size == 0 || self.max_position_embeddings == 0 {
            return Err(
                "vocab_size, type_vocab_size and max_position_embeddings must be > 0".into(),
            );
        }
        Ok(())
    }

    /// all-MiniLM-L6-v2's configuration (6 layers, width 384, 12 heads, MLP 1536).
    pub fn minilm_l6() -> BertConfig {
        BertConfig {
            vocab_size: 30522,
            hidden_size: 384,
            num_hidden_layers: 6,
            num_attention_heads: 12,
            intermediate_size: 1536,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            hidden_act: "gelu".into(),
        }
    }
}

/// The graph of a BERT sentence encoder for one batch shape.
pub struct BertGraph {
    /// Token ids, `i64 [batch, seq]` (input `input_ids`).
    pub input_ids: Tensor,
    /// The attention mask, 1 for tokens and 0 for padding, `f32 [batch, seq]` (input
    /// `attention_mask`).
    pub attention_mask: Tensor,
    /// The last layer's token states, `[batch·seq, hidden]` in the model dtype.
    pub hidden: Tensor,
    /// The L2-normalized mean-pooled sentence embeddings, `f32 [batch, hidden]`.
    pub embeddings: Tensor,
}

/// Names of checkpoint tensors that the encoder does not use: the position-id buffer and the
/// pooler head (sentence-transformers pools the token states itself).
pub const UNUSED_TENSORS: &[&str] = &[
    "embeddings.position_ids",
    "pooler.dense.weight",
    "pooler.dense.bias",
];

/// The most negative finite value of a float dtype (the additive mask's fill, as transformers
/// uses `torch.finfo(dtype).min`).
fn dtype_min(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => -65504.0,
        DType::BF16 => -3.3895313892515355e38,
        DType::F64 => f64::MIN,
        _ => f32::MIN as f64,
    }
}

/// `x·Wᵀ + b` with transformers' `nn.Linear` parameters `{name}.weight [out, in]` and
/// `{name}.bias [out]`.
fn linear(g: &GraphBuilder, dtype: DType, name: &str, x: &Tensor, i: usize, o: usize) -> Tensor {
    let w = g.param_typed(
        &format!("{name}.weight"),
        TensorType::new(dtype, [o, i]),
        Init::Normal {
            mean: 0.0,
            std: 0.02,
            seed: g.next_seed(),
        },
        true,
    );
    let b = g.param_typed(
        &format!("{name}.bias"),
        TensorType::new(dtype, [o]),
        Init::zeros(),
        true,
    );
    x.matmul_t(&w, false, true).add(&b)
}

/// transformers' `nn.LayerNorm` with `{name}.weight` and `{name}.bias`, spelled in primitives.
fn layer_norm(
    g: &GraphBuilder,
    dtype: DType,
    name: &str,
    x: &Tensor,
    d: usize,
    eps: f64,
) -> Tensor {
    let w = g.param_typed(
        &format!("{name}.weight"),
        TensorType::new(dtype, [d]),
        Init::ones(),
        true,
    );
    let b = g.param_typed(
        &format!("{name}.bias"),
        TensorType::new(dtype, [d]),
        Init::zeros(),
        true,
    );
    layer_norm_primitives(x, &w, &b, eps)
}

/// One BERT layer over token states `x [batch·seq, hidden]` with the additive mask
/// `[batch, 1, 1, seq]`: self-attention, residual and LayerNorm, the GELU MLP, residual and
/// LayerNorm (post-norm, as BERT).
pub fn bert_layer(
    g: &GraphBuilder,
    cfg: &BertConfig,
    dtype: DType,
    layer: usize,
    (batch, seq): (usize, usize),
    x: &Tensor,
    mask: &Tensor,
) -> Tensor {
    let (d, h) = (cfg.hidden_size, cfg.num_attention_heads);
    let dh = d / h;
    let eps = cfg.layer_norm_eps;
    let p = |n: &str| format!("encoder.layer.{layer}.{n}");
    let heads = |t: Tensor| t.reshape([batch, seq, h, dh]).permute(&[0, 2, 1, 3]);
    let q = heads(linear(g, dtype, &p("attention.self.query"), x, d, d));
    let k = heads(linear(g, dtype, &p("attention.self.key"), x, d, d));
    let v = heads(linear(g, dtype, &p("attention.self.value"), x, d, d));
    // scores = q·kᵀ / √dh + mask; probabilities by softmax; context = P·v.
    let scores = q.matmul(&k.t()).div_scalar((dh as f64).sqrt()).add(mask);
    let ctx = softmax_primitives(&scores)
        .matmul(&v)
        .permute(&[0, 2, 1, 3])
        .reshape([batch * seq, d]);
    let attn = linear(g, dtype, &p("attention.output.dense"), &ctx, d, d);
    let x = layer_norm(
        g,
        dtype,
        &p("attention.output.LayerNorm"),
        &attn.add(x),
        d,
        eps,
    );
    let f = cfg.intermediate_size;
    let hdn = linear(g, dtype, &p("intermediate.dense"), &x, d, f).gelu();
    let out = linear(g, dtype, &p("output.dense"), &hdn, f, d);
    layer_norm(g, dtype, &p("output.LayerNorm"), &out.add(&x), d, eps)
}

/// Builds a BERT sentence encoder for `batch` sequences of `seq` tokens with parameters of
/// `dtype` named as transformers names them (`embeddings.word_embeddings.weight`,
/// `encoder.layer.0.attention.self.query.weight`, ...; initialized at random until weights are
/// loaded). Single-segment inputs: every token has token type 0. Pooling and normalization run
/// in f32 whatever the model dtype.
pub fn bert_encoder(
    g: &GraphBuilder,
    cfg: &BertConfig,
    dtype: DType,
    batch: usize,
    seq: usize,
) -> BertGraph {
    let d = cfg.hidden_size;
    let table = |name: &str, rows: usize| {
        g.param_typed(
            name,
            TensorType::new(dtype, [rows, d]),
            Init::Normal {
                mean: 0.0,
                std: 0.02,
                seed: g.next_seed(),
            },
            true,
        )
    };
    let ids = g.input("input_ids", DType::I64, [batch, seq]);
    let mask = g.input("attention_mask", DType::F32, [batch, seq]);
    let words = table("embeddings.word_embeddings.weight", cfg.vocab_size);
    let pos = table(
        "embeddings.position_embeddings.weight",
        cfg.max_position_embeddings,
    );
    let types = table(
        "embeddings.token_type_embeddings.weight",
        cfg.type_vocab_size,
    );
    let emb = words
        .embedding(&ids.reshape([batch * seq]))
        .reshape([batch, seq, d])
        .add(&pos.slice(0, 0, seq, 1))
        .add(&types.slice(0, 0, 1, 1))
        .reshape([batch * seq, d]);
    let mut x = layer_norm(
        g,
        dtype,
        "embeddings.LayerNorm",
        &emb,
        d,
        cfg.layer_norm_eps,
    );
    // transformers' extended mask: (1 − mask)·min(dtype), broadcast over heads and queries.
    let m = if dtype == DType::F32 {
        mask.clone()
    } else {
        mask.cast(dtype)
    };
    let additive = m
        .scalar_like(1.0)
        .sub(&m)
        .mul_scalar(dtype_min(dtype))
        .reshape([batch, 1, 1, seq]);
    for l in 0..cfg.num_hidden_layers {
        x = bert_layer(g, cfg, dtype, l, (batch, seq), &x, &additive);
    }
    let hidden = x.clone();
    let states = if dtype == DType::F32 {
        x
    } else {
        x.cast(DType::F32)
    };
    // Mean pooling over the mask, then L2 normalization (sentence-transformers).
    let summed = states
        .reshape([batch, seq, d])
        .mul(&mask.reshape([batch, seq, 1]))
        .sum(&[1], false);
    let count = mask.sum(&[1], true).maximum_scalar(1e-9);
    let pooled = summed.div(&count);
    let norm = pooled
        .mul(&pooled)
        .sum(&[1], true)
        .sqrt()
        .maximum_scalar(1e-12);
    BertGraph {
        input_ids: ids,
        attention_mask: mask,
        hidden,
        embeddings: pooled.div(&norm),
    }
}

/// Reads a safetensors file (f32, f16, bf16 and integer tensors), names sorted.
pub fn read_safetensors(path: &Path) -> Result<Vec<(String, HostTensor)>> {
    crate::npy::load_safetensors(path)
}

/// Puts checkpoint tensors into the graph's parameters by name, cast to each parameter's dtype.
/// A leading `bert.` on the checkpoint's names is dropped; tensors named in `unused` are
/// skipped. Every parameter must get a tensor of its shape and every other tensor must have a
/// parameter: otherwise the error lists the missing, extra and mis-shaped tensors and no
/// parameter changes. Returns how many parameters were set.
pub fn load_weights(
    graph: &mut Graph,
    tensors: Vec<(String, HostTensor)>,
    unused: &[&str],
    source: &Path,
) -> Result<usize> {
    let mut by_name: BTreeMap<String, HostTensor> = BTreeMap::new();
    for (name, t) in tensors {
        let name = name
            .strip_prefix("bert.")
            .map(str::to_string)
            .unwrap_or(name);
        by_name.insert(name, t);
    }
    let mut missing = Vec::new();
    let mut misshaped = Vec::new();
    let mut values = Vec::with_capacity(graph.params.len());
    for p in &graph.params {
        match by_name.remove(&p.name) {
            None => missing.push(p.name.clone()),
            Some(t) if t.dims() != p.ty.shape.dims() => misshaped.push(format!(
                "`{}` is {:?} in the file, the model needs {:?}",
                p.name,
                t.dims(),
                p.ty.shape.dims()
            )),
            Some(t) if !t.dtype().is_float() => misshaped.push(format!(
                "`{}` is {:?} in the file, the model needs a float tensor",
                p.name,
                t.dtype()
            )),
            Some(t) => values.push(if t.dtype() == p.ty.dtype {
                t
            } else {
                t.cast(p.ty.dtype)
            }),
        }
    }
    let extra: Vec<String> = by_name
        .into_keys()
        .filter(|n| !unused.contains(&n.as_str()))
        .collect();
    if !(missing.is_empty() && misshaped.is_empty() && extra.is_empty()) {
        let mut parts = Vec::new();
        if !missing.is_empty() {
            parts.push(format!("missing tensors: {}", missing.join(", ")));
        }
        if !misshaped.is_empty() {
            parts.push(format!("mis-shaped tensors: {}", misshaped.join("; ")));
        }
        if !extra.is_empty() {
            parts.push(format!(
                "tensors the model has no parameter for: {}",
                extra.join(", ")
            ));
        }
        return Err(file_err(
            source,
            format!("the weights do not fit the model: {}", parts.join("; ")),
        ));
    }
    let n = values.len();
    for (p, v) in graph.params.iter_mut().zip(values) {
        p.data = Some(v);
    }
    Ok(n)
}

/// Token ids and attention masks of a padded batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence (the batch's longest after truncation).
    pub seq: usize,
    /// `[batch·seq]` token ids.
    pub ids: Vec<i64>,
    /// `[batch·seq]` 1 for tokens, 0 for padding.
    pub mask: Vec<f32>,
}

impl Batch {
    /// The batch padded with `pad_id` (mask 0) to `seq` tokens per sequence; a padded position
    /// takes no attention and no part in the mean, so the embeddings do not change.
    pub fn padded(&self, seq: usize, pad_id: i64) -> Batch {
        if seq <= self.seq {
            return self.clone();
        }
        let mut ids = Vec::with_capacity(self.batch * seq);
        let mut mask = Vec::with_capacity(self.batch * seq);
        for r in 0..self.batch {
            let row = r * self.seq..(r + 1) * self.seq;
            ids.extend_from_slice(&self.ids[row.clone()]);
            ids.resize(ids.len() + seq - self.seq, pad_id);
            mask.extend_from_slice(&self.mask[row]);
            mask.resize(mask.len() + seq - self.seq, 0.0);
        }
        Batch {
            batch: self.batch,
            seq,
            ids,
            mask,
        }
    }
}

/// A `tokenizer.json` tokenizer that pads each batch to its longest sequence and truncates at
/// the model's limit.
pub struct BertTokenizer {
    inner: tokenizers::Tokenizer,
}

impl BertTokenizer {
    /// Reads `tokenizer.json` and sets truncation at `max_len` tokens (special tokens
    /// included) and padding to the batch's longest sequence.
    pub fn from_file(path: &Path, max_len: usize) -> Result<BertTokenizer> {
        let mut inner =
            tokenizers::Tokenizer::from_file(path).map_err(|e| file_err(path, e.to_string()))?;
        let (pad_id, pad_token) = match inner.get_padding() {
            Some(p) => (p.pad_id, p.pad_token.clone()),
            None => (inner.token_to_id("[PAD]").unwrap_or(0), "[PAD]".to_string()),
        };
        inner.with_padding(Some(tokenizers::PaddingParams {
            strategy: tokenizers::PaddingStrategy::BatchLongest,
            pad_id,
            pad_token,
            ..Default::default()
        }));
        inner
            .with_truncation(Some(tokenizers::TruncationParams {
                max_length: max_len,
                ..Default::default()
            }))
            .map_err(|e| file_err(path, e.to_string()))?;
        Ok(BertTokenizer { inner })
    }

    /// The id that pads sequences.
    pub fn pad_id(&self) -> i64 {
        self.inner.get_padding().map_or(0, |p| p.pad_id as i64)
    }

    /// Tokenizes one batch (special tokens added).
    pub fn encode(&self, sentences: &[&str]) -> Result<Batch> {
        let enc = self
            .inner
            .encode_batch(sentences.to_vec(), true)
            .map_err(|e| Error::Input {
                name: "sentences".into(),
                reason: format!("tokenization failed: {e}"),
            })?;
        let seq = enc.first().map_or(0, |e| e.get_ids().len());
        let mut ids = Vec::with_capacity(enc.len() * seq);
        let mut mask = Vec::with_capacity(enc.len() * seq);
        for e in &enc {
            debug_assert_eq!(e.get_ids().len(), seq);
            ids.extend(e.get_ids().iter().map(|&i| i as i64));
            mask.extend(e.get_attention_mask().iter().map(|&m| m as f32));
        }
        Ok(Batch {
            batch: enc.len(),
            seq,
            ids,
            mask,
        })
    }
}

/// The files of a model folder.
#[derive(Clone, Debug)]
pub struct ModelFiles {
    /// `config.json`.
    pub config: PathBuf,
    /// `model.safetensors`.
    pub weights: PathBuf,
    /// `tokenizer.json`.
    pub tokenizer: PathBuf,
}

impl ModelFiles {
    /// The files of `dir`; an error naming the first missing one.
    pub fn in_dir(dir: &Path) -> Result<ModelFiles> {
        let f = ModelFiles {
            config: dir.join("config.json"),
            weights: dir.join("model.safetensors"),
            tokenizer: dir.join("tokenizer.json"),
        };
        for p in [&f.config, &f.weights, &f.tokenizer] {
            if !p.is_file() {
                return Err(file_err(
                    p,
                    "not found: a model folder holds config.json, model.safetensors and \
                     tokenizer.json (scripts/fetch_minilm.sh fetches all-MiniLM-L6-v2)",
                ));
            }
        }
        Ok(f)
    }
}

#[derive(Deserialize)]
struct SbertConfig {
    max_seq_length: Option<usize>,
}

#[derive(Deserialize)]
struct PoolingConfig {
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default = "yes")]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
}

fn yes() -> bool {
    true
}

/// Sequence lengths of [`SentenceEncoder::embed`]'s batches are padded to multiples of this.
pub const SEQ_BUCKET: usize = 16;

/// A sentence-transformers BERT model ready to embed sentences: the tokenizer, the weights, and
/// one compiled executable per batch shape (compiled on first use).
pub struct SentenceEncoder {
    cfg: BertConfig,
    tokenizer: BertTokenizer,
    weights: Vec<(String, HostTensor)>,
    weights_path: PathBuf,
    device: Device,
    dtype: DType,
    max_len: usize,
    compiled: HashMap<(usize, usize), Executable>,
}

impl SentenceEncoder {
    /// Loads a model folder for `device` with parameters and matmuls in `dtype` (f32, f16 or
    /// bf16; the embeddings are f32 either way). The truncation length is
    /// `sentence_bert_config.json`'s `max_seq_length` when present, else the position limit.
    pub fn load(dir: &Path, device: Device, dtype: DType) -> Result<SentenceEncoder> {
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::Input {
                name: "dtype".into(),
                reason: format!("expected f32, f16 or bf16, got {dtype:?}"),
            });
        }
        let files = ModelFiles::in_dir(dir)?;
        let cfg = BertConfig::from_file(&files.config)?;
        let pooling = dir.join("1_Pooling").join("config.json");
        if pooling.is_file() {
            let p: PoolingConfig = read_json(&pooling)?;
            if !p.pooling_mode_mean_tokens
                || p.pooling_mode_cls_token
                || p.pooling_mode_max_tokens
                || p.pooling_mode_mean_sqrt_len_tokens
            {
                return Err(file_err(&pooling, "only mean pooling is supported"));
            }
        }
        let sbert = dir.join("sentence_bert_config.json");
        let max_len = if sbert.is_file() {
            read_json::<SbertConfig>(&sbert)?.max_seq_length
        } else {
            None
        }
        .unwrap_or(cfg.max_position_embeddings)
        .min(cfg.max_position_embeddings);
        let tokenizer = BertTokenizer::from_file(&files.tokenizer, max_len)?;
        let weights = read_safetensors(&files.weights)?;
        // Check the names and shapes once, on a one-token graph.
        let mut probe = Self::graph(&cfg, dtype, 1, 1)?;
        load_weights(&mut probe, weights.clone(), UNUSED_TENSORS, &files.weights)?;
        Ok(SentenceEncoder {
            cfg,
            tokenizer,
            weights,
            weights_path: files.weights,
            device,
            dtype,
            max_len,
            compiled: HashMap::new(),
        })
    }

    fn graph(cfg: &BertConfig, dtype: DType, batch: usize, seq: usize) -> Result<Graph> {
        let g = GraphBuilder::new();
        let m = bert_encoder(&g, cfg, dtype, batch, seq);
        g.output("embeddings", &m.embeddings);
        Ok(g.graph()?)
    }

    /// The embedding width.
    pub fn dim(&self) -> usize {
        self.cfg.hidden_size
    }

    /// The model configuration.
    pub fn config(&self) -> &BertConfig {
        &self.cfg
    }

    /// The truncation length in tokens.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &BertTokenizer {
        &self.tokenizer
    }

    /// The executable for one batch shape, compiled with the weights on first use.
    pub fn executable(&mut self, batch: usize, seq: usize) -> Result<&mut Executable> {
        if !self.compiled.contains_key(&(batch, seq)) {
            let mut graph = Self::graph(&self.cfg, self.dtype, batch, seq)?;
            load_weights(
                &mut graph,
                self.weights.clone(),
                UNUSED_TENSORS,
                &self.weights_path,
            )?;
            let exe = compile_graph(&graph, self.device, &CompileOptions::inference())?;
            self.compiled.insert((batch, seq), exe);
        }
        Ok(self
            .compiled
            .get_mut(&(batch, seq))
            .expect("compiled above"))
    }

    /// Embeds one tokenized batch: `[batch][hidden]`.
    pub fn embed_batch(&mut self, b: &Batch) -> Result<Vec<Vec<f32>>> {
        let d = self.dim();
        let ids = HostTensor::from_vec(b.ids.clone(), [b.batch, b.seq])?;
        let mask = HostTensor::from_vec(b.mask.clone(), [b.batch, b.seq])?;
        let exe = self.executable(b.batch, b.seq)?;
        let out = exe.run(&[("input_ids", ids), ("attention_mask", mask)])?;
        let v = out.into_vec().remove(0).to_vec::<f32>()?;
        Ok(v.chunks(d).map(<[f32]>::to_vec).collect())
    }

    /// Embeds sentences in batches of at most `batch`: one unit-length vector of
    /// [`SentenceEncoder::dim`] floats per sentence, in order.
    ///
    /// As sentence-transformers does, the sentences are batched in order of length so that a
    /// batch pads little; each batch is padded further to a multiple of [`SEQ_BUCKET`] tokens so
    /// that batches share compiled shapes (a shape compiles once per encoder).
    pub fn embed(&mut self, sentences: &[&str], batch: usize) -> Result<Vec<Vec<f32>>> {
        let mut order: Vec<usize> = (0..sentences.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(sentences[i].chars().count()));
        let mut out = vec![Vec::new(); sentences.len()];
        let pad = self.tokenizer.pad_id();
        for idx in order.chunks(batch.max(1)) {
            let chunk: Vec<&str> = idx.iter().map(|&i| sentences[i]).collect();
            let b = self.tokenizer.encode(&chunk)?;
            let seq = b
                .seq
                .next_multiple_of(SEQ_BUCKET)
                .min(self.max_len.max(b.seq));
            for (&i, e) in idx.iter().zip(self.embed_batch(&b.padded(seq, pad))?) {
                out[i] = e;
            }
        }
        Ok(out)
    }
}
