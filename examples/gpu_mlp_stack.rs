//! Times a GPT-2-small-sized stack of LayerNorm + MLP blocks (d=768, hidden 3072, 8×1024 tokens)
//! on a device: kernel count of the plan and wall time per run. The activations enter as a
//! parameter and the output is a scalar, so a run moves no tensor across the bus and the time is
//! the device's.
//!
//! `cargo run --release --example gpu_mlp_stack -- [cuda|cpu] [f32|bf16] [layers]`
//! (`benches/gpu_mlp_peer.py` runs the same stack in PyTorch eager and torch.compile.)

use rustytorch::prelude::*;
use std::time::Instant;

fn main() -> rustytorch::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let device = Device::parse(args.get(1).map(String::as_str).unwrap_or("cuda")).expect("device");
    let dtype = DType::from_name(args.get(2).map(String::as_str).unwrap_or("bf16")).expect("dtype");
    let layers: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(12);
    let (tokens, d, h) = (8 * 1024, 768, 3072);
    let g = GraphBuilder::new();
    let ty = |dims: Vec<usize>| TensorType::new(dtype, Shape::new(dims));
    let mut x = g.param_typed("x", ty(vec![tokens, d]), Init::kaiming_uniform(d, 1), false);
    for l in 0..layers {
        let p = |n: &str, dims: Vec<usize>, fan: usize, seed: u64| {
            g.param_typed(
                &format!("h{l}.{n}"),
                ty(dims),
                Init::kaiming_uniform(fan, seed),
                true,
            )
        };
        let w1 = p("fc.w", vec![d, h], d, 10 + l as u64);
        let b1 = p("fc.b", vec![h], d, 20 + l as u64);
        let w2 = p("proj.w", vec![h, d], h, 30 + l as u64);
        let b2 = p("proj.b", vec![d], h, 40 + l as u64);
        let lw = p("ln.w", vec![d], d, 50 + l as u64);
        let lb = p("ln.b", vec![d], d, 60 + l as u64);
        let y = x.layer_norm(Some(&lw), Some(&lb), 1e-5);
        let y = y.matmul(&w1).add(&b1).gelu().matmul(&w2).add(&b2);
        x = x.add(&y);
    }
    let out = x.cast(DType::F32).mean(&[0, 1], false);
    let t0 = Instant::now();
    let mut exe = compile_with(&g, &[&out], device, &CompileOptions::inference())?;
    let compile_s = t0.elapsed().as_secs_f64();
    let kernels = exe.plan().kernel_count();
    exe.run(&[])?;
    let iters = 20;
    let t = Instant::now();
    for _ in 0..iters {
        exe.run(&[])?;
    }
    let ms = t.elapsed().as_secs_f64() * 1e3 / iters as f64;
    let flops = 2.0 * 2.0 * (tokens * d * h) as f64 * layers as f64;
    println!(
        "{device} {dtype:?} layers={layers}: {kernels} kernels, compile+prepare {compile_s:.2} s, {ms:.3} ms/run, {:.1} TFLOP/s (GEMM flops)",
        flops / (ms * 1e-3) / 1e12
    );
    if let Some(s) = exe.memory_stats() {
        println!("{s}");
    }
    Ok(())
}
