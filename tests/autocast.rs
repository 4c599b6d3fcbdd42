//! Mixed precision through the compiler's autocast pass: the IR it produces (snapshots), the
//! forward of a small transformer in bf16 and f16 against f32, and bf16 training of that
//! transformer tracking the f32 run's loss curve.

use rustytorch::compiler::passes;
use rustytorch::compiler::text;
use rustytorch::models::{gpt2_block, Gpt2Config};
use rustytorch::prelude::*;

/// A two-block pre-norm transformer over x [2, 16, 32] (4 heads) with a mean-squared-error loss
/// against y, and its training step under AdamW.
fn transformer() -> (GraphBuilder, Tensor, Tensor) {
    let cfg = Gpt2Config {
        layers: 2,
        batch: 2,
        seq: 16,
        d_model: 32,
        heads: 4,
    };
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [cfg.batch, cfg.seq, cfg.d_model]);
    let y = g.input("y", DType::F32, [cfg.batch, cfg.seq, cfg.d_model]);
    let mut h = x.clone();
    for l in 0..cfg.layers {
        h = gpt2_block(&g, &cfg, l, &h);
    }
    let loss = h.mse_loss(&y);
    (g, h, loss)
}

fn inputs() -> Vec<(&'static str, HostTensor)> {
    let ty = TensorType::new(DType::F32, Shape::new([2usize, 16, 32]));
    vec![
        (
            "x",
            rustytorch::ops::testing::rand_tensor(&ty, 11, -1.0, 1.0),
        ),
        (
            "y",
            rustytorch::ops::testing::rand_tensor(&ty, 12, -0.5, 0.5),
        ),
    ]
}

fn opts(autocast: Option<DType>, updates: bool) -> CompileOptions {
    CompileOptions {
        autocast,
        updates,
        ..CompileOptions::default()
    }
}

/// The optimized IR of one matmul + bias + GELU layer, an attention and a LayerNorm under bf16
/// autocast: the matmul and the attention read bf16 casts of their f32 operands (the weight's
/// cast shared by its users) and their results widen back to f32; the norm stays f32.
#[test]
fn autocast_ir() {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [8, 16]);
    let w = g.param("w", [16, 32], Init::kaiming_uniform(16, 1));
    let b = g.param("b", [32], Init::zeros());
    let lw = g.param("ln.w", [32], Init::ones());
    let h = x.matmul(&w).add(&b).gelu_tanh();
    let n = h.layer_norm(Some(&lw), None, 1e-5);
    let q = g.input("q", DType::F32, [1, 2, 8, 16]);
    let a = rustytorch::models::causal_attention_primitives(&q, &q, &q);
    let mut graph = g.graph().unwrap();
    graph.add_output("n", n.node().unwrap()).unwrap();
    graph.add_output("a", a.node().unwrap()).unwrap();
    let popts = passes::Options {
        autocast: Some(DType::BF16),
        fuse: false,
        dump: vec![],
        ..passes::Options::default()
    };
    let compiled = passes::run(&graph, &popts).unwrap();
    let r = compiled.report.autocast.clone().unwrap();
    assert_eq!(r.ops, 2, "the matmul epilogue and the attention");
    insta::assert_snapshot!("autocast_bf16_ir", text::print(&compiled.graph));
    // With fusion, the widening casts join the elementwise kernels that read them.
    let fused = passes::run(
        &graph,
        &passes::Options {
            autocast: Some(DType::BF16),
            dump: vec![],
            ..passes::Options::default()
        },
    )
    .unwrap();
    insta::assert_snapshot!("autocast_bf16_fused_ir", text::print(&fused.graph));
}

/// The forward of the transformer under bf16 and f16 autocast against f32: the same values
/// within the low type's rounding (errors relative to the largest magnitude).
#[test]
fn autocast_forward_matches_f32() {
    let (g, h, _) = transformer();
    let run = |autocast| {
        let mut exe =
            rustytorch::compile_with(&g, &[&h], Device::Cpu, &opts(autocast, false)).unwrap();
        exe.run(&inputs()).unwrap()[0].to_f64_vec()
    };
    let want = run(None);
    let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    for (low, tol) in [(DType::BF16, 3e-2), (DType::F16, 4e-3)] {
        let got = run(Some(low));
        assert_eq!(got.len(), want.len());
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs() / scale)
            .fold(0.0f64, f64::max);
        assert!(worst <= tol, "{low:?}: worst error {worst:.2e} > {tol:.0e}");
        assert!(worst > 0.0, "{low:?}: the autocast run computed in f32");
    }
}

/// bf16 training tracks f32: 40 AdamW steps of the transformer on one batch from the same
/// initial parameters; every step's loss within 5% (relative) of the f32 run's, and both fall.
#[test]
fn bf16_training_tracks_f32() {
    let curve = |autocast| {
        let (g, _, loss) = transformer();
        g.train_step(&loss, AdamW::new(3e-3), &StepOptions::default())
            .unwrap();
        let mut exe =
            rustytorch::compile_with(&g, &[&loss], Device::Cpu, &opts(autocast, true)).unwrap();
        (0..40)
            .map(|_| exe.run(&inputs()).unwrap()[0].to_f64_vec()[0])
            .collect::<Vec<f64>>()
    };
    let (f32s, bf16s) = (curve(None), curve(Some(DType::BF16)));
    for (k, (a, b)) in f32s.iter().zip(&bf16s).enumerate() {
        assert!(
            (a - b).abs() <= 0.05 * a.abs(),
            "step {k}: bf16 loss {b} vs f32 {a}"
        );
    }
    assert!(f32s[39] < 0.5 * f32s[0], "f32 learns: {f32s:?}");
    assert!(bf16s[39] < 0.5 * bf16s[0], "bf16 learns: {bf16s:?}");
    assert_ne!(f32s, bf16s, "the bf16 run computed in f32");
}
