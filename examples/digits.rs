//! Trains a small CNN on the UCI handwritten digits (8×8 images), reports test accuracy, saves the
//! trained classifier as a graph file with its weights, and prints the runner command that
//! classifies images with it.
//!
//! cargo run --release --example digits -- [EPOCHS] [OUT_DIR] [--device cpu|cuda|cuda:N|auto]
//!     [--devices cpu,cpu | --devices cuda:0,cuda:1]   (data-parallel: one replica per device)
//!     [--from-env]   (one process of a multi-process group: RANK, WORLD_SIZE, LOCAL_RANK and
//!                     RUSTYTORCH_NCCL_ID_FILE as in docs/distributed.md; rank 0 reports and saves)

#[path = "common/digits_cnn.rs"]
mod digits_cnn;

use digits_cnn::{
    accuracy, batch_tensors, digits_cnn, train_digits_from_env, train_digits_on,
    train_digits_parallel,
};
use indicatif::{ProgressBar, ProgressStyle};
use rustytorch::compiler::format::{save, ParamStorage};
use rustytorch::prelude::*;
use std::path::PathBuf;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Positional EPOCHS and OUT_DIR, and `--device D` / `--devices LIST` (or `=`) anywhere.
    let mut args: Vec<String> = Vec::new();
    let mut device = Device::Cpu;
    let mut devices: Option<Vec<Device>> = None;
    let mut from_env = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        if a == "--from-env" {
            from_env = true;
            continue;
        }
        if let Some(rest) = a.strip_prefix("--devices") {
            let list = match rest.strip_prefix('=') {
                Some(v) => v.to_string(),
                None if rest.is_empty() => it.next().ok_or("--devices needs a list")?,
                None => return Err(format!("unknown option `{a}`").into()),
            };
            devices = Some(rustytorch::parallel::parse_devices(&list)?);
            continue;
        }
        let value = match a.strip_prefix("--device") {
            Some("") => it.next().ok_or("--device needs a value")?,
            Some(v) if v.starts_with('=') => v[1..].to_string(),
            _ => {
                args.push(a);
                continue;
            }
        };
        device = Device::parse(&value).ok_or_else(|| {
            format!("--device `{value}`: expected `cpu`, `cuda`, `cuda:N` or `auto`")
        })?;
    }
    let epochs: usize = args.first().map(|s| s.parse()).transpose()?.unwrap_or(20);
    let out_dir = PathBuf::from(
        args.get(1)
            .cloned()
            .unwrap_or_else(|| "target/digits".into()),
    );
    std::fs::create_dir_all(&out_dir)?;

    let data_path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/data/digits.csv.gz");
    let data = rustytorch::data::load_digits(&data_path)?;
    let (train, test) = data.split(360, 42);
    println!(
        "digits: {} train / {} test images (8x8), {} epochs, device {device}",
        train.len(),
        test.len(),
        epochs
    );

    let batch = 32;
    let steps = train.len() / batch;
    let bar = ProgressBar::new((epochs * steps) as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")?
            .progress_chars("=> "),
    );
    let t0 = Instant::now();
    let mut ema = None::<f32>;
    let progress = |epoch: usize, _: usize, loss: f32| {
        let e = ema.map_or(loss, |m| 0.95 * m + 0.05 * loss);
        ema = Some(e);
        bar.set_message(format!("epoch {} loss {e:.4}", epoch + 1));
        bar.inc(1);
    };
    let (exe, last_loss) = match &devices {
        _ if from_env => {
            let (exe, rank, last) = train_digits_from_env(&train, batch, epochs, progress)?;
            if rank != 0 {
                bar.finish();
                println!("rank {rank}: last-epoch loss of its shards {last:.4}");
                return Ok(());
            }
            (exe, last)
        }
        Some(list) => {
            println!("data-parallel over {} replicas", list.len());
            train_digits_parallel(list, &train, batch, epochs, progress)?
        }
        None => train_digits_on(device, &train, batch, epochs, progress)?,
    };
    bar.finish();
    if device == Device::Auto {
        println!("placement: {}", exe.placement());
    }
    let train_secs = t0.elapsed().as_secs_f64();
    let train_acc = accuracy(&exe, &train, 256)?;
    let test_acc = accuracy(&exe, &test, 256)?;
    println!(
        "trained in {train_secs:.1} s: last-epoch loss {last_loss:.4}, train accuracy {:.2}%, test accuracy {:.2}%",
        100.0 * train_acc,
        100.0 * test_acc
    );

    // The classifier as a graph file with a named batch (any number of images in, built at 16),
    // class and probabilities out.
    let n = 16;
    let g = GraphBuilder::new();
    let (_, logits) = digits_cnn(&g, g.dim("batch", n));
    g.output("class", &logits.argmax(-1, false));
    g.output("probs", &logits.softmax(-1));
    let mut classify = compile_graph(&g.graph()?, Device::Cpu, &CompileOptions::inference())?;
    classify.copy_params_from(&exe)?;
    let model = out_dir.join("digits.rtg");
    save(&classify.export_graph()?, &model, ParamStorage::Embedded)?;
    let idx: Vec<usize> = (0..n).collect();
    let (xb, _) = batch_tensors(&test, &idx);
    let sample = out_dir.join("digits_sample.npy");
    rustytorch::npy::write_npy(&sample, &xb)?;
    println!("labels of the sample: {:?}", &test.y[..n]);
    println!("saved {} and {}", model.display(), sample.display());
    println!(
        "classify with: cargo run --release --bin rustytorch -- run {} --input x={} --out {}",
        model.display(),
        sample.display(),
        out_dir.display()
    );
    Ok(())
}
