//! Trains a GPT-2 language model on bytes of text and prints the loss with a progress bar.
//!
//! cargo run --release --example gpt2_train -- [--device cpu|cuda|cuda:N] [--steps 300]
//!     [--size tiny|small] [--autocast bf16|f16|none] [--text FILE]
//!
//! `--size small` is GPT-2 small (12 layers, d 768, 12 heads, batch 8 × 1024 tokens); `tiny`
//! (2 layers, d 128, 4 heads, batch 8 × 64) trains in seconds on a CPU. The tokens are the text's
//! bytes (a 256-token alphabet), so no tokenizer file is needed. The default text is the license
//! texts the Debian `base-files` package ships in /usr/share/common-licenses (about 250 KB of
//! English), or where that folder is absent a generated corpus (sentences from a small grammar).
//! On CUDA the default is bf16 autocast (f32 master weights, matmuls and attention in bf16).

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use rustytorch::models::{gpt2_lm, Gpt2Config};
use rustytorch::prelude::*;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Device: cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Optimizer steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Model size: tiny or small.
    #[arg(long, default_value = "tiny")]
    size: String,
    /// Mixed precision: bf16, f16 or none (default: bf16 on CUDA, none on the CPU).
    #[arg(long)]
    autocast: Option<String>,
    /// A text file to train on (default: the system's license texts, or a generated corpus).
    #[arg(long)]
    text: Option<std::path::PathBuf>,
    /// Learning rate (AdamW).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
}

/// The training text as bytes.
fn corpus(path: Option<&std::path::Path>) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    if let Some(p) = path {
        return Ok(std::fs::read(p)?);
    }
    let dir = std::path::Path::new("/usr/share/common-licenses");
    let mut text = vec![];
    if let Ok(entries) = std::fs::read_dir(dir) {
        let mut files: Vec<_> = entries.flatten().map(|e| e.path()).collect();
        files.sort();
        for f in files.iter().filter(|f| f.is_file()) {
            text.extend(std::fs::read(f).unwrap_or_default());
        }
    }
    if text.len() >= 64 * 1024 {
        return Ok(text);
    }
    // A generated corpus: sentences from a small grammar, deterministic.
    let (subj, verb, obj) = (
        [
            "the model",
            "a graph",
            "the compiler",
            "each kernel",
            "the runtime",
        ],
        ["fuses", "lowers", "schedules", "checks", "runs"],
        [
            "the matmul",
            "every op",
            "a softmax",
            "the tensors",
            "one plan",
        ],
    );
    let mut state = 7u64;
    let mut next = |n: usize| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as usize % n
    };
    while text.len() < 256 * 1024 {
        let s = format!(
            "{} {} {}. ",
            subj[next(subj.len())],
            verb[next(verb.len())],
            obj[next(obj.len())]
        );
        text.extend(s.bytes());
    }
    Ok(text)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let device = Device::parse(&args.device).ok_or_else(|| {
        format!(
            "--device `{}`: expected cpu, cuda, cuda:N or auto",
            args.device
        )
    })?;
    let cfg = match args.size.as_str() {
        "small" => Gpt2Config::small(),
        "tiny" => Gpt2Config {
            layers: 2,
            batch: 8,
            seq: 64,
            d_model: 128,
            heads: 4,
        },
        other => return Err(format!("--size `{other}`: expected tiny or small").into()),
    };
    let autocast = match args.autocast.as_deref() {
        Some("bf16") => Some(DType::BF16),
        Some("f16") => Some(DType::F16),
        Some("none") => None,
        None if matches!(device, Device::Cuda(_)) => Some(DType::BF16),
        None => None,
        Some(other) => return Err(format!("--autocast `{other}`: bf16, f16 or none").into()),
    };
    let text = corpus(args.text.as_deref())?;
    let (b, s) = (cfg.batch, cfg.seq);
    if text.len() < s + 2 {
        return Err(format!(
            "the text has {} bytes; at least {} needed",
            text.len(),
            s + 2
        )
        .into());
    }
    let g = GraphBuilder::new();
    let lm = gpt2_lm(&g, &cfg, 256);
    g.train_step(
        &lm.loss,
        AdamW::new(args.lr).weight_decay(0.01),
        &StepOptions {
            clip_norm: Some(1.0),
            ..StepOptions::default()
        },
    )?;
    let t0 = Instant::now();
    let opts = CompileOptions {
        autocast,
        ..CompileOptions::default()
    };
    let mut exe = rustytorch::compile_with(&g, &[&lm.loss], device, &opts)?;
    println!(
        "gpt2 {}: {} layers, d {}, {} heads, batch {b} x {s} tokens, {} bytes of text, on {:?}{}, compiled in {:.2} s",
        args.size,
        cfg.layers,
        cfg.d_model,
        cfg.heads,
        text.len(),
        exe.placement().device,
        autocast.map(|d| format!(" ({d:?} autocast)")).unwrap_or_default(),
        t0.elapsed().as_secs_f64()
    );
    // Random windows of the text: inputs are bytes [i, i + s), targets [i + 1, i + s + 1).
    let mut state = 1u64;
    let mut batch = || {
        let (mut ids, mut tg) = (Vec::with_capacity(b * s), Vec::with_capacity(b * s));
        for _ in 0..b {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let i = (state >> 33) as usize % (text.len() - s - 1);
            ids.extend(text[i..i + s].iter().map(|&c| c as i64));
            tg.extend(text[i + 1..i + s + 1].iter().map(|&c| c as i64));
        }
        (
            HostTensor::from_vec(ids, [b, s]).expect("ids"),
            HostTensor::from_vec(tg, [b, s]).expect("targets"),
        )
    };
    let bar = ProgressBar::new(args.steps as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} steps  {msg}  [{elapsed_precise}]",
    )?);
    let (mut first, mut last) = (None, 0.0f64);
    let t0 = Instant::now();
    for step in 0..args.steps {
        let (ids, targets) = batch();
        let out = exe.run(&[("ids", ids), ("targets", targets)])?;
        last = out[0].to_f64_vec()[0];
        first.get_or_insert(last);
        bar.set_message(format!("loss {last:.4}"));
        bar.inc(1);
        if step % 50 == 0 {
            bar.println(format!("step {step:4}  loss {last:.4}"));
        }
    }
    bar.finish();
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "loss {:.4} -> {last:.4} after {} steps; {:.1} ms a step, {:.0} tokens/s",
        first.unwrap_or(f64::NAN),
        args.steps,
        secs * 1e3 / args.steps.max(1) as f64,
        (args.steps * b * s) as f64 / secs
    );
    // f16 autocast trains with dynamic loss scaling (bf16 needs none).
    if let Some(ls) = exe.loss_scale() {
        println!(
            "loss scale {} ({} steps skipped on non-finite gradients)",
            ls.scale, ls.skipped
        );
    }
    Ok(())
}
