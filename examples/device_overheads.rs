//! Measures what `Device::Auto` weighs: the fixed cost of one run of a one-kernel graph and the
//! host↔device transfer rate of `Executable::run`, by timing `y = 2·x` for inputs of 1 to 16M
//! f32 elements on a device.
//!
//! `cargo run --release --example device_overheads -- [cuda|cpu]`

use rustytorch::prelude::*;
use std::time::Instant;

fn main() -> rustytorch::Result<()> {
    let arg = std::env::args().nth(1).unwrap_or_else(|| "cuda".into());
    let device = Device::parse(&arg).expect("device");
    println!("| elements | bytes in+out | ms/run | GB/s (in+out) |");
    println!("| --- | --- | --- | --- |");
    for n in [1usize, 1 << 10, 1 << 16, 1 << 20, 1 << 22, 1 << 24] {
        let g = GraphBuilder::new();
        let x = g.input("x", DType::F32, [n]);
        let y = x.mul_scalar(2.0);
        let mut exe = compile_with(&g, &[&y], device, &CompileOptions::inference())?;
        let xs = HostTensor::from_vec(vec![1.5f32; n], [n])?;
        exe.run(&[("x", xs.clone())])?;
        let iters = if n >= 1 << 22 { 10 } else { 100 };
        let t = Instant::now();
        for _ in 0..iters {
            exe.run(&[("x", xs.clone())])?;
        }
        let ms = t.elapsed().as_secs_f64() * 1e3 / iters as f64;
        let bytes = 8 * n;
        println!(
            "| {n} | {bytes} | {ms:.4} | {:.2} |",
            bytes as f64 / (ms * 1e-3) / 1e9
        );
    }
    // Per-kernel cost: a chain of k small softmaxes (one kernel each, nothing fuses them).
    println!("\n| kernels | ms/run |");
    println!("| --- | --- |");
    for k in [1usize, 16, 64, 256] {
        let g = GraphBuilder::new();
        let x = g.input("x", DType::F32, [8, 64]);
        let mut y = x.clone();
        for _ in 0..k {
            y = y.softmax(-1);
        }
        let mut exe = compile_with(&g, &[&y], device, &CompileOptions::inference())?;
        let xs = HostTensor::from_vec(vec![0.5f32; 512], [8, 64])?;
        exe.run(&[("x", xs.clone())])?;
        let t = Instant::now();
        for _ in 0..100 {
            exe.run(&[("x", xs.clone())])?;
        }
        let ms = t.elapsed().as_secs_f64() * 1e3 / 100.0;
        println!("| {} | {ms:.4} |", exe.plan().kernel_count());
    }
    // A tiny MLP at batch 1 (launch-bound).
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [1, 64]);
    let w1 = g.param("w1", [64, 128], Init::kaiming_uniform(64, 1));
    let b1 = g.param("b1", [128], Init::zeros());
    let w2 = g.param("w2", [128, 128], Init::kaiming_uniform(128, 2));
    let b2 = g.param("b2", [128], Init::zeros());
    let w3 = g.param("w3", [128, 10], Init::kaiming_uniform(128, 3));
    let y = x
        .matmul(&w1)
        .add(&b1)
        .gelu()
        .matmul(&w2)
        .add(&b2)
        .gelu()
        .matmul(&w3)
        .softmax(-1);
    let mut exe = compile_with(&g, &[&y], device, &CompileOptions::inference())?;
    let xs = HostTensor::from_vec(vec![0.25f32; 64], [1, 64])?;
    exe.run(&[("x", xs.clone())])?;
    let t = Instant::now();
    for _ in 0..1000 {
        exe.run(&[("x", xs.clone())])?;
    }
    let ms = t.elapsed().as_secs_f64();
    println!(
        "\ntiny MLP batch 1: {} kernels, {:.4} ms/run",
        exe.plan().kernel_count(),
        ms
    );
    Ok(())
}
