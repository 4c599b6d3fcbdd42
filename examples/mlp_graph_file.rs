//! Builds a small MLP, saves it as a graph file with its parameters embedded, writes a sample
//! input beside it, and prints the command that runs it with the `rustytorch` runner.
//!
//! ```text
//! cargo run --example mlp_graph_file -- target/mlp.rtg
//! cargo run --release --bin rustytorch -- run target/mlp.rtg --input x=target/mlp_x.npy --out target/mlp_out
//! ```

use rustytorch::compiler::format::{self, ParamStorage};
use rustytorch::prelude::*;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "target/mlp.rtg".into()),
    );

    // x [batch, 16] -> linear 16x32 + gelu -> linear 32x10 -> softmax; the batch is a named dim
    // (built at 4), so the saved graph runs any number of rows.
    let g = GraphBuilder::new();
    let batch = g.dim("batch", 4);
    let x = g.input_dims("x", DType::F32, &[batch, 16.into()]);
    let w1 = g.param("w1", [16, 32], Init::kaiming_uniform(16, 1));
    let b1 = g.param("b1", [32], Init::kaiming_uniform(16, 2));
    let w2 = g.param("w2", [32, 10], Init::kaiming_uniform(32, 3));
    let b2 = g.param("b2", [10], Init::kaiming_uniform(32, 4));
    let probs = x
        .linear(&w1, Some(&b1))
        .gelu()
        .linear(&w2, Some(&b2))
        .softmax(-1);
    g.output("probs", &probs);

    // Embed the initial values, as a trained model would carry its weights.
    let mut graph = g.graph()?;
    for p in &mut graph.params {
        p.data = Some(p.init.materialize(&p.ty)?);
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    format::save(&graph, &path, ParamStorage::Embedded)?;

    // A sample input: a smooth, non-constant pattern.
    let xs: Vec<f32> = (0..4 * 16).map(|i| ((i as f32) * 0.37).sin()).collect();
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("mlp");
    let x_path = path.with_file_name(format!("{stem}_x.npy"));
    rustytorch::npy::write_npy(&x_path, &HostTensor::from_vec(xs, [4, 16])?)?;

    println!(
        "saved {} ({} parameters) and {}",
        path.display(),
        graph.param_count(),
        x_path.display()
    );
    let out_dir = path.with_file_name(format!("{stem}_out"));
    println!("run it with:");
    println!(
        "  cargo run --release --bin rustytorch -- run {} --input x={} --out {}",
        path.display(),
        x_path.display(),
        out_dir.display()
    );
    Ok(())
}
