//! The Rust side of the Python overhead measurement (docs/performance.md): the tiny graph of
//! `bench/overhead.py`, compiled for the CPU and called from Rust, in microseconds per call.
//!
//! `cargo run --release --example overhead --manifest-path python/Cargo.toml`

use rustytorch::prelude::*;
use std::sync::Arc;
use std::time::Instant;

/// The same graph as `bench/overhead.py`.
const TINY: &str = "graph {
  %0 = input x : f32[16]
  %1 = param b : f32[16] = full(0.5)
  %2 = add(%0, %1) : f32[16]
  %3 = relu(%2) : f32[16]
  output y = %3
}
";

fn per_call_us(n: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..n / 10 {
        f();
    }
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    t.elapsed().as_secs_f64() * 1e6 / n as f64
}

fn main() -> rustytorch::Result<()> {
    let graph = rustytorch::compiler::text::parse(TINY)?;
    let mut exe = rustytorch::compile_graph(&graph, Device::Cpu, &CompileOptions::default())?;
    let x = HostTensor::from_vec((0..16).map(|i| i as f32 - 8.0).collect::<Vec<f32>>(), [16])?;
    let shared = Arc::new(x.clone());
    let n = 200_000;
    let best = |f: &mut dyn FnMut() -> f64| (0..5).map(|_| f()).fold(f64::INFINITY, f64::min);
    let run_shared = best(&mut || {
        per_call_us(n, || {
            let out = exe.run_shared(&[("x", shared.clone())]).expect("run");
            std::hint::black_box(out);
        })
    });
    let run = best(&mut || {
        per_call_us(n, || {
            let out = exe.run(&[("x", x.clone())]).expect("run");
            std::hint::black_box(out);
        })
    });
    println!("rust run_shared: {run_shared:.3} us/call");
    println!("rust run (copies the input): {run:.3} us/call");
    Ok(())
}
