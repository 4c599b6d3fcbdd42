//! Snapshots of the optimized, fused IR of canonical graphs (insta). A reader of each snapshot sees
//! what the optimizer recognized and which ops were fused into which kernel; a refactor that
//! changes no behaviour changes no snapshot. Update with `INSTA_UPDATE=always cargo test --test
//! snapshots` and review the diff.

use rustytorch::compiler::fuse::describe_groups;
use rustytorch::compiler::passes::{run, Options};
use rustytorch::compiler::text::print;
use rustytorch::models::{
    causal_attention_primitives, gelu_tanh_primitives, gpt2_block, layer_norm_primitives,
    rms_norm_primitives, softmax_primitives, Gpt2Config,
};
use rustytorch::prelude::*;

fn optimized(g: &GraphBuilder) -> String {
    let graph = g.graph().unwrap();
    let opts = Options {
        dump: vec![],
        ..Options::default()
    };
    let c = run(&graph, &opts).unwrap();
    let r = c.report.optimize.as_ref().unwrap();
    format!(
        "# stop reason: {:?}\n{}\n# fused kernels\n{}",
        r.stop_reason,
        print(&c.graph),
        describe_groups(&c.graph)
    )
}

fn small() -> Gpt2Config {
    Gpt2Config {
        layers: 1,
        batch: 2,
        seq: 8,
        d_model: 16,
        heads: 2,
    }
}

#[test]
fn mlp_block() {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [4, 16]);
    let w1 = g.param("w1", [16, 32], Init::kaiming_uniform(16, 1));
    let b1 = g.param("b1", [32], Init::zeros());
    let w2 = g.param("w2", [32, 8], Init::kaiming_uniform(32, 2));
    let b2 = g.param("b2", [8], Init::zeros());
    let h = gelu_tanh_primitives(&x.matmul(&w1).add(&b1));
    g.output("y", &h.matmul(&w2).add(&b2).relu());
    insta::assert_snapshot!(optimized(&g));
}

#[test]
fn gpt2_block_forward() {
    let g = GraphBuilder::new();
    let cfg = small();
    let x = g.input("x", DType::F32, [cfg.batch, cfg.seq, cfg.d_model]);
    g.output("h", &gpt2_block(&g, &cfg, 0, &x));
    insta::assert_snapshot!(optimized(&g));
}

#[test]
fn gpt2_block_backward() {
    let g = GraphBuilder::new();
    let cfg = small();
    let x = g.input("x", DType::F32, [cfg.batch, cfg.seq, cfg.d_model]);
    let loss = gpt2_block(&g, &cfg, 0, &x).mean_all();
    g.train_step(&loss, Sgd::new(0.1), &StepOptions::default())
        .unwrap();
    g.output("loss", &loss);
    insta::assert_snapshot!(optimized(&g));
}

#[test]
fn conv_block() {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [2, 3, 8, 8]);
    let w = g.param("w", [8, 3, 3, 3], Init::kaiming_uniform(27, 1));
    let b = g.param("b", [8], Init::zeros());
    let y = x
        .conv(&w, Some(&b), &ConvOpts::default().padding(&[1]))
        .relu()
        .max_pool(&[2], &[2], &[0]);
    g.output("y", &y);
    insta::assert_snapshot!(optimized(&g));
}

#[test]
fn norms_and_softmax_in_primitives() {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [4, 16]);
    let w = g.param("w", [16], Init::ones());
    let b = g.param("b", [16], Init::zeros());
    g.output("ln", &layer_norm_primitives(&x, &w, &b, 1e-5));
    g.output("rms", &rms_norm_primitives(&x, &w, 1e-6));
    g.output("sm", &softmax_primitives(&x));
    let e = x.exp();
    g.output("sm_nomax", &e.div(&e.sum(&[-1], true)));
    insta::assert_snapshot!(optimized(&g));
}

#[test]
fn attention_in_primitives() {
    let g = GraphBuilder::new();
    let q = g.input("q", DType::F32, [2, 2, 8, 4]);
    let k = g.input("k", DType::F32, [2, 2, 8, 4]);
    let v = g.input("v", DType::F32, [2, 2, 8, 4]);
    g.output("causal", &causal_attention_primitives(&q, &k, &v));
    let plain = softmax_primitives(&q.matmul(&k.t()).mul_scalar(0.5)).matmul(&v);
    g.output("plain", &plain);
    insta::assert_snapshot!(optimized(&g));
}
