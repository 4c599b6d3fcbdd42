//! A graph with a named batch dimension: one executable runs batches of any size, compiling each
//! new size once and then reusing the compiled plan. Prints each run's time and the shape
//! cache's counters.
//!
//! cargo run --release --example named_batch

use rustytorch::prelude::*;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // x [batch, 64] -> linear 64x256 + gelu -> linear 256x10 -> softmax, built at batch 16.
    let g = GraphBuilder::new();
    let batch = g.dim("batch", 16);
    let x = g.input_dims("x", DType::F32, &[batch, 64.into()]);
    let w1 = g.param("w1", [64, 256], Init::kaiming_uniform(64, 1));
    let b1 = g.param("b1", [256], Init::zeros());
    let w2 = g.param("w2", [256, 10], Init::kaiming_uniform(256, 2));
    let probs = x.linear(&w1, Some(&b1)).gelu().matmul(&w2).softmax(-1);
    let t0 = Instant::now();
    let mut exe = compile_with(&g, &[&probs], Device::Cpu, &CompileOptions::inference())?;
    println!(
        "compiled at {} in {:.2} ms",
        exe.current_dims(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    for b in [1usize, 5, 16, 1, 5, 16, 64, 64] {
        let xs: Vec<f32> = (0..b * 64).map(|i| ((i as f32) * 0.01).sin()).collect();
        let input = HostTensor::from_vec(xs, [b, 64])?;
        let before = exe.shape_cache().misses;
        let t = Instant::now();
        let out = exe.run(&[("x", input)])?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let what = if exe.shape_cache().misses > before {
            "compiled"
        } else {
            "cached"
        };
        println!("batch {b:>3}: {:?} in {ms:.3} ms ({what})", out[0].dims());
    }
    println!("shape cache: {}", exe.shape_cache());
    Ok(())
}
