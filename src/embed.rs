//! `rustytorch embed`: sentence embeddings from a sentence-transformers BERT model folder.

use clap::{Args, ValueEnum};
use rustytorch::models::bert::SentenceEncoder;
use rustytorch::{npy, DType, Device, HostTensor};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Arguments of `embed`.
#[derive(Args, Debug)]
pub struct EmbedArgs {
    /// The model folder (config.json, model.safetensors, tokenizer.json), e.g. the one
    /// scripts/fetch_minilm.sh prints.
    #[arg(long)]
    model: PathBuf,
    /// Device: `cpu`, `cuda`, `cuda:N` or `auto`.
    #[arg(short, long, default_value = "cpu")]
    device: String,
    /// The dtype of the weights and matmuls (pooling and the output are f32).
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    dtype: Precision,
    /// Sentences per batch (batched in order of length, each padded to its longest sentence
    /// rounded up to a multiple of 16 tokens).
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Read the sentences from a file, one per line.
    #[arg(long, conflicts_with = "sentences")]
    file: Option<PathBuf>,
    /// Write to this file (`.json` or `.npy`) instead of printing JSON.
    #[arg(short, long)]
    out: Option<PathBuf>,
    /// The sentences.
    sentences: Vec<String>,
}

/// A model dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Precision {
    F32,
    F16,
    Bf16,
}

impl Precision {
    fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::F16 => DType::F16,
            Precision::Bf16 => DType::BF16,
        }
    }
}

/// The JSON document `embed` writes.
fn to_json(model: &str, dim: usize, emb: &[Vec<f32>]) -> String {
    let mut s = String::with_capacity(emb.len() * dim * 12 + 64);
    let model = serde_json::to_string(model).unwrap_or_else(|_| "\"\"".into());
    let _ = write!(s, "{{\"model\":{model},\"dim\":{dim},\"embeddings\":[");
    for (i, e) in emb.iter().enumerate() {
        s.push_str(if i == 0 { "[" } else { ",[" });
        for (j, v) in e.iter().enumerate() {
            if j > 0 {
                s.push(',');
            }
            // Shortest round-trip form of the f32.
            let _ = write!(s, "{v:?}");
        }
        s.push(']');
    }
    s.push_str("]}\n");
    s
}

/// Runs `embed`; the error is the message for the user.
pub fn run(a: EmbedArgs) -> Result<(), String> {
    let device = Device::parse(&a.device).ok_or_else(|| {
        format!(
            "--device `{}`: expected `cpu`, `cuda`, `cuda:N` or `auto`",
            a.device
        )
    })?;
    if a.batch == 0 {
        return Err("--batch must be at least 1".into());
    }
    let sentences: Vec<String> = match &a.file {
        Some(f) => std::fs::read_to_string(f)
            .map_err(|e| format!("{}: {e}", f.display()))?
            .lines()
            .map(str::to_string)
            .collect(),
        None => a.sentences.clone(),
    };
    if sentences.is_empty() {
        return Err("no sentences: give them as arguments or with --file".into());
    }
    let mut enc =
        SentenceEncoder::load(&a.model, device, a.dtype.dtype()).map_err(|e| e.to_string())?;
    let refs: Vec<&str> = sentences.iter().map(String::as_str).collect();
    let emb = enc.embed(&refs, a.batch).map_err(|e| e.to_string())?;
    let name = model_name(&a.model);
    match &a.out {
        None => print!("{}", to_json(&name, enc.dim(), &emb)),
        Some(p) if p.extension().is_some_and(|e| e == "npy") => {
            let flat: Vec<f32> = emb.concat();
            let t =
                HostTensor::from_vec(flat, [emb.len(), enc.dim()]).map_err(|e| e.to_string())?;
            npy::write_npy(p, &t).map_err(|e| e.to_string())?;
        }
        Some(p) if p.extension().is_some_and(|e| e == "json") => {
            std::fs::write(p, to_json(&name, enc.dim(), &emb))
                .map_err(|e| format!("{}: {e}", p.display()))?;
        }
        Some(p) => {
            return Err(format!(
                "--out {}: expected a .json or .npy file",
                p.display()
            ))
        }
    }
    Ok(())
}

/// The model's name: its folder's name.
fn model_name(dir: &Path) -> String {
    dir.canonicalize()
        .ok()
        .as_deref()
        .unwrap_or(dir)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}
