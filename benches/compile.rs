//! Compile-time benchmarks: the whole pipeline (verify → optimize → fuse → plan) and the optimize
//! pass alone, on GPT-2-style graphs spelled in primitives (12 layers forward and backward, 48
//! layers forward; batch 8, seq 1024, d 768 — shapes are types only, nothing is executed).

#![allow(missing_docs)] // criterion_group! generates undocumented public functions

use criterion::{criterion_group, criterion_main, Criterion};
use rustytorch::compiler::optimize::{optimize, OptimizeConfig};
use rustytorch::compiler::passes::{run, Options};
use rustytorch::models::{gpt2, Gpt2Config};
use rustytorch::prelude::*;

fn forward(layers: usize) -> Graph {
    let g = GraphBuilder::new();
    let cfg = Gpt2Config {
        layers,
        ..Gpt2Config::small()
    };
    let (_, h) = gpt2(&g, &cfg);
    g.output("h", &h);
    g.graph().unwrap()
}

fn backward(layers: usize) -> Graph {
    let g = GraphBuilder::new();
    let cfg = Gpt2Config {
        layers,
        ..Gpt2Config::small()
    };
    let (_, h) = gpt2(&g, &cfg);
    let loss = h.mean_all();
    g.train_step(&loss, Sgd::new(0.1), &StepOptions::default())
        .unwrap();
    g.output("loss", &loss);
    g.graph().unwrap()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("compile");
    group.sample_size(10);
    let opts = Options {
        dump: vec![],
        ..Options::default()
    };
    for (name, graph) in [
        ("gpt2_12_forward", forward(12)),
        ("gpt2_12_backward", backward(12)),
        ("gpt2_48_forward", forward(48)),
    ] {
        group.bench_function(format!("{name}/optimize"), |b| {
            b.iter(|| optimize(&graph, &OptimizeConfig::default()).unwrap())
        });
        group.bench_function(format!("{name}/pipeline"), |b| {
            b.iter(|| run(&graph, &opts).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
