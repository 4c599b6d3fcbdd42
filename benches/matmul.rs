//! CPU benchmarks: f32 GEMM at 512/1024/2048 (GFLOP/s = 2n³ / time) through the compiled-graph
//! path and straight through the kernel, and a small MLP forward. Compare with `python3 benches/numpy_matmul.py` in the same run.

#![allow(missing_docs)] // criterion_group! generates undocumented public functions

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rustytorch::prelude::*;
use std::sync::Arc;

fn rand(n: usize, seed: u64) -> Vec<f32> {
    rustytorch::ops::testing::rand_f64(n, seed, -1.0, 1.0)
        .into_iter()
        .map(|v| v as f32)
        .collect()
}

fn matmul(c: &mut Criterion) {
    let mut group = c.benchmark_group("matmul_f32");
    group.sample_size(10);
    for n in [512usize, 1024, 2048] {
        let g = GraphBuilder::new();
        let a = g.input("a", DType::F32, [n, n]);
        let b = g.input("b", DType::F32, [n, n]);
        let y = a.matmul(&b);
        let mut exe = compile(&g, &[&y], Device::Cpu).unwrap();
        let av = HostTensor::from_vec(rand(n * n, 1), [n, n]).unwrap();
        let bv = HostTensor::from_vec(rand(n * n, 2), [n, n]).unwrap();
        // Shared inputs: the executable reads them in place (`run` would copy each first).
        let ins = [("a", Arc::new(av)), ("b", Arc::new(bv))];
        group.throughput(Throughput::Elements((2 * n * n * n) as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |bench, _| {
            bench.iter(|| exe.run_shared(&ins).unwrap())
        });
    }
    group.finish();
    // The same products straight through the ops crate's kernel (gemm plus the output's
    // allocation): what the compiled-graph path adds is the difference.
    let mut group = c.benchmark_group("matmul_f32_kernel");
    group.sample_size(10);
    let op = rustytorch::ops::Op::Matmul {
        trans_a: false,
        trans_b: false,
    };
    for n in [512usize, 1024, 2048] {
        let av = HostTensor::from_vec(rand(n * n, 1), [n, n]).unwrap();
        let bv = HostTensor::from_vec(rand(n * n, 2), [n, n]).unwrap();
        group.throughput(Throughput::Elements((2 * n * n * n) as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |bench, _| {
            bench.iter(|| rustytorch::ops::eval_cpu(&op, &[&av, &bv]).unwrap())
        });
    }
    group.finish();
}

fn mlp(c: &mut Criterion) {
    let (batch, d_in, hidden, d_out) = (64, 784, 512, 10);
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [batch, d_in]);
    let w1 = g.param("w1", [d_in, hidden], Init::kaiming_uniform(d_in, 1));
    let b1 = g.param("b1", [hidden], Init::zeros());
    let w2 = g.param("w2", [hidden, d_out], Init::kaiming_uniform(hidden, 2));
    let b2 = g.param("b2", [d_out], Init::zeros());
    let y = x
        .matmul(&w1)
        .add(&b1)
        .gelu()
        .matmul(&w2)
        .add(&b2)
        .softmax(-1);
    let mut exe = compile(&g, &[&y], Device::Cpu).unwrap();
    let xv = HostTensor::from_vec(rand(batch * d_in, 3), [batch, d_in]).unwrap();
    c.bench_function("mlp_forward_64x784x512x10", |bench| {
        bench.iter(|| exe.run(&[("x", xv.clone())]).unwrap())
    });
}

criterion_group!(benches, matmul, mlp);
criterion_main!(benches);
