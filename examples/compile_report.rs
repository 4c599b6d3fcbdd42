//! Compiles GPT-2-style graphs (spelled in primitives) and prints what each pass did and took,
//! the e-graph's stop reason, the recognized ops, and the static memory plan against the sum of
//! all intermediates and against weights + the two largest activations. Single-threaded numbers:
//! run with `RAYON_NUM_THREADS=1`.
//!
//! cargo run --release --example compile_report -- [LAYERS...]

use rustytorch::compiler::passes::{run, Options};
use rustytorch::models::{gpt2, Gpt2Config};
use rustytorch::ops::Op;
use rustytorch::prelude::*;
use std::collections::BTreeMap;
use std::time::Instant;

fn report(name: &str, graph: &Graph) {
    let opts = Options {
        dump: vec![],
        ..Options::default()
    };
    let t = Instant::now();
    let c = run(graph, &opts).expect("compiles");
    let total = t.elapsed().as_secs_f64() * 1e3;
    let o = c.report.optimize.as_ref().expect("optimized");
    let mut ops: BTreeMap<&str, usize> = BTreeMap::new();
    for n in c.graph.live_order() {
        let op = &c.graph.node(n).unwrap().op;
        if !op.is_leaf() {
            *ops.entry(op.name()).or_default() += 1;
        }
    }
    let passes: Vec<String> = c
        .report
        .passes
        .iter()
        .map(|p| format!("{} {:.1} ms", p.name, p.millis))
        .collect();
    println!(
        "## {name}: {} nodes in, {} nodes out",
        graph.len(),
        c.graph.len()
    );
    println!("whole compile {total:.1} ms; {}", passes.join(", "));
    println!(
        "e-graph: {:?} after {} iterations, {} e-nodes, saturation {:.1} ms, extraction {:.1} ms",
        o.stop_reason,
        o.iterations,
        o.egraph_nodes,
        o.saturation_time.as_secs_f64() * 1e3,
        o.extraction_time.as_secs_f64() * 1e3
    );
    let key = [
        "layer_norm",
        "attention",
        "matmul_epilogue",
        "matmul",
        "fused",
    ];
    let counts: Vec<String> = key
        .iter()
        .map(|k| format!("{k} {}", ops.get(k).copied().unwrap_or(0)))
        .collect();
    println!("ops after: {}", counts.join(", "));
    let m = c.report.memory.as_ref().expect("planned");
    let weights: usize = graph.params.iter().map(|p| p.ty.size_bytes()).sum();
    let mut acts: Vec<usize> = c
        .graph
        .live_order()
        .iter()
        .filter(|&&n| {
            !matches!(
                c.graph.node(n).unwrap().op,
                Op::Param { .. } | Op::Input { .. }
            )
        })
        .map(|&n| c.graph.ty(n).size_bytes())
        .collect();
    acts.sort_unstable_by(|a, b| b.cmp(a));
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    println!(
        "memory: plan peak {:.2} GiB, sum of intermediates {:.2} GiB ({:.1}x less); weights {:.2} GiB, two largest activations {:.2} GiB",
        gib(m.arena_bytes),
        gib(m.naive_bytes),
        m.naive_bytes as f64 / m.arena_bytes.max(1) as f64,
        gib(weights),
        gib(acts.iter().take(2).sum())
    );
    println!();
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let layers = if args.is_empty() { vec![12, 48] } else { args };
    for l in layers {
        let cfg = Gpt2Config {
            layers: l,
            ..Gpt2Config::small()
        };
        let g = GraphBuilder::new();
        let (_, h) = gpt2(&g, &cfg);
        g.output("h", &h);
        report(
            &format!("GPT-2 {l} layers forward (batch 8, seq 1024, d 768)"),
            &g.graph().unwrap(),
        );
        if l <= 12 {
            let g = GraphBuilder::new();
            let (_, h) = gpt2(&g, &cfg);
            let loss = h.mean_all();
            g.train_step(&loss, Sgd::new(0.1), &StepOptions::default())
                .unwrap();
            g.output("loss", &loss);
            report(
                &format!("GPT-2 {l} layers forward+backward+SGD"),
                &g.graph().unwrap(),
            );
        }
    }
}
