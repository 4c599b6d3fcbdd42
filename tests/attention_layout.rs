//! The attention layout pass (`compiler::attn_layout`): on a transformer written the usual way
//! (heads split by reshape + permute, merged back by permute + reshape) attention and its
//! gradients read and write `[B, S, H, D]` heads in place, with no transpose left around them,
//! also under autocast; and the rewritten graph trains exactly as the original does.

use rustytorch::compiler::passes;
use rustytorch::compiler::text;
use rustytorch::compiler::Graph;
use rustytorch::models::{gpt2_block, Gpt2Config};
use rustytorch::ops::{AttnLayout, Op};
use rustytorch::prelude::*;

const CFG: Gpt2Config = Gpt2Config {
    layers: 2,
    batch: 2,
    seq: 16,
    d_model: 32,
    heads: 4,
};

/// Two pre-norm blocks with an MSE loss; with `train`, the AdamW training step.
fn transformer(train: bool) -> (GraphBuilder, Tensor, Tensor) {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [CFG.batch, CFG.seq, CFG.d_model]);
    let y = g.input("y", DType::F32, [CFG.batch, CFG.seq, CFG.d_model]);
    let mut h = x.clone();
    for l in 0..CFG.layers {
        h = gpt2_block(&g, &CFG, l, &h);
    }
    let loss = h.mse_loss(&y);
    if train {
        g.train_step(&loss, AdamW::new(3e-3), &StepOptions::default())
            .unwrap();
    }
    (g, h, loss)
}

fn inputs() -> Vec<(&'static str, HostTensor)> {
    let ty = TensorType::new(DType::F32, Shape::new([CFG.batch, CFG.seq, CFG.d_model]));
    vec![
        (
            "x",
            rustytorch::ops::testing::rand_tensor(&ty, 21, -1.0, 1.0),
        ),
        (
            "y",
            rustytorch::ops::testing::rand_tensor(&ty, 22, -0.5, 0.5),
        ),
    ]
}

fn with_output(g: &GraphBuilder, name: &str, t: &Tensor) -> Graph {
    let mut graph = g.graph().unwrap();
    graph.add_output(name, t.node().unwrap()).unwrap();
    graph
}

fn run_passes(graph: &Graph, autocast: Option<DType>, on: bool) -> passes::Compiled {
    passes::run(
        graph,
        &passes::Options {
            autocast,
            attention_layout: on,
            dump: vec![],
            ..passes::Options::default()
        },
    )
    .unwrap()
}

/// Live `cast` nodes.
fn casts(g: &Graph) -> usize {
    g.live_order()
        .into_iter()
        .filter(|&id| matches!(g.node(id).unwrap().op, Op::Cast { .. }))
        .count()
}

/// Live `permute` nodes and attention ops in each layout.
fn census(g: &Graph) -> (usize, usize, usize) {
    let (mut permutes, mut bhsd, mut bshd) = (0, 0, 0);
    for id in g.live_order() {
        match &g.node(id).unwrap().op {
            Op::Permute { .. } => permutes += 1,
            Op::Attention { layout, .. } | Op::AttentionGrad { layout, .. } => {
                if *layout == AttnLayout::Bshd {
                    bshd += 1
                } else {
                    bhsd += 1
                }
            }
            _ => {}
        }
    }
    (permutes, bhsd, bshd)
}

/// Forward and training graphs, f32 and under bf16 autocast (casts between the transposes and
/// attention): every attention op moves to `[B, S, H, D]` and every transpose disappears.
#[test]
fn transposes_around_attention_disappear() {
    let (g, h, _) = transformer(false);
    let fwd = with_output(&g, "h", &h);
    let (tg, _, loss) = transformer(true);
    let train = with_output(&tg, "loss", &loss);
    for (what, graph, ops) in [("forward", &fwd, 2), ("training", &train, 8)] {
        for autocast in [None, Some(DType::BF16)] {
            let off = run_passes(graph, autocast, false);
            let (p_off, bhsd_off, _) = census(&off.graph);
            assert_eq!(bhsd_off, ops, "{what} {autocast:?}: attention ops");
            assert!(
                p_off >= 4 * CFG.layers,
                "{what} {autocast:?}: {p_off} permutes before"
            );
            let on = run_passes(graph, autocast, true);
            let r = on.report.attention_layout.clone().unwrap();
            assert_eq!(r.rewritten, ops, "{what} {autocast:?}");
            assert_eq!(census(&on.graph), (0, 0, ops), "{what} {autocast:?}");
            assert_eq!(r.transposes_removed, p_off, "{what} {autocast:?}");
            // The casts move below the transposes without multiplying (one per operand
            // however many attention ops read it).
            assert_eq!(
                casts(&on.graph),
                casts(&off.graph),
                "{what} {autocast:?}: casts"
            );
        }
    }
}

/// With gradients left in `[B, H, S, D]` (the CPU target's choice), the forward reads its heads
/// in place: an inference graph loses every transpose, a training graph keeps the gradients' and
/// still loses the forward's merge of the heads.
#[test]
fn forward_only_rewrite_leaves_gradients_transposed() {
    let (g, h, _) = transformer(false);
    let fwd = with_output(&g, "h", &h);
    let (tg, _, loss) = transformer(true);
    let train = with_output(&tg, "loss", &loss);
    let forward_only = |graph: &Graph| {
        passes::run(
            graph,
            &passes::Options {
                attention_layout: true,
                attention_layout_grads: false,
                dump: vec![],
                ..passes::Options::default()
            },
        )
        .unwrap()
    };
    let on = forward_only(&fwd);
    assert_eq!(census(&on.graph), (0, 0, CFG.layers));
    let off = run_passes(&train, None, false);
    let on = forward_only(&train);
    let (p_off, _, _) = census(&off.graph);
    let (p_on, bhsd, bshd) = census(&on.graph);
    assert_eq!((bhsd, bshd), (3 * CFG.layers, CFG.layers));
    assert!(
        p_on < p_off,
        "{p_on} permutes with the forward rewritten, {p_off} without"
    );
}

/// The optimized IR of one block's forward with the pass on, as the CUDA target compiles it.
#[test]
fn gpt2_block_ir_in_place() {
    let g = GraphBuilder::new();
    let cfg = Gpt2Config { layers: 1, ..CFG };
    let x = g.input("x", DType::BF16, [cfg.batch, cfg.seq, cfg.d_model]);
    let h = rustytorch::models::gpt2_block_typed(&g, &cfg, 0, &x, DType::BF16);
    let graph = with_output(&g, "h", &h);
    insta::assert_snapshot!(
        "gpt2_block_attention_in_place",
        text::print(&run_passes(&graph, None, true).graph)
    );
}

/// Forward values and five AdamW steps of the rewritten training graph against the original:
/// the same losses to rounding (only the order of the CPU's transposes differs, which is none).
#[test]
fn rewritten_graph_trains_the_same() {
    let losses = |on: bool| {
        let (g, _, loss) = transformer(true);
        let graph = with_output(&g, "loss", &loss);
        let passed = run_passes(&graph, None, on).graph;
        let opts = CompileOptions {
            optimize: false,
            ..CompileOptions::default()
        };
        let mut exe = rustytorch::compile_graph(&passed, Device::Cpu, &opts).unwrap();
        (0..5)
            .map(|_| exe.run(&inputs()).unwrap()[0].to_f64_vec()[0])
            .collect::<Vec<f64>>()
    };
    let (want, got) = (losses(false), losses(true));
    for (k, (a, b)) in want.iter().zip(&got).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs(),
            "step {k}: {b} with the pass, {a} without"
        );
    }
    assert!(want[4] < want[0], "it trains: {want:?}");
}
