//! The MLP backward through the tanh GELU: the optimizer turns `(dy·W2ᵀ) ⊙ gelu_tanh'(h)` of a
//! real training graph into one `matmul_act_grad` (a census and an IR snapshot), and training the
//! optimized graph gives what training the unoptimized one gives (SGD and AdamW, a few steps).
//! Update the snapshot with `INSTA_UPDATE=always cargo test --test mlp_act_grad`.

use rustytorch::compiler::fuse::describe_groups;
use rustytorch::compiler::passes::{run, Options};
use rustytorch::compiler::text::print;
use rustytorch::prelude::*;

/// `loss = mse(gelu_tanh(x·W1 + b1)·W2 + b2, y)` with its training step; `x` of `x_dims`
/// (`[rows, 16]` or `[batch, seq, 16]`, GPT-2's MLP shape).
fn mlp(x_dims: &[usize], opt: impl Into<rustytorch::Optimizer>) -> (GraphBuilder, Tensor) {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, x_dims.to_vec());
    let mut y_dims = x_dims.to_vec();
    *y_dims.last_mut().unwrap() = 8;
    let y = g.input("y", DType::F32, y_dims);
    let w1 = g.param("w1", [16, 64], Init::kaiming_uniform(16, 1));
    let b1 = g.param("b1", [64], Init::Full(0.1));
    let w2 = g.param("w2", [64, 8], Init::kaiming_uniform(64, 2));
    let b2 = g.param("b2", [8], Init::Full(-0.1));
    let out = x.matmul(&w1).add(&b1).gelu_tanh().matmul(&w2).add(&b2);
    let loss = out.mse_loss(&y);
    g.train_step(&loss, opt, &StepOptions::default()).unwrap();
    (g, loss)
}

fn optimized_text(g: &GraphBuilder, fuse: bool) -> String {
    let graph = g.graph().unwrap();
    let opts = Options {
        fuse,
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

fn count(text: &str, what: &str) -> usize {
    text.matches(what).count()
}

#[test]
fn the_optimizer_forms_one_matmul_act_grad_per_gelu() {
    for dims in [&[32usize, 16][..], &[2, 8, 16]] {
        let (g, _) = mlp(dims, Sgd::new(0.1));
        let text = optimized_text(&g, false);
        assert_eq!(count(&text, "matmul_act_grad["), 1, "{dims:?}\n{text}");
        assert!(
            text.contains("matmul_act_grad[trans_b,act=gelu_tanh]"),
            "dh = dy·W2ᵀ carries its transpose into the op:\n{text}"
        );
        // The derivative's tanh and its products are gone: only the forward's gelu_tanh is left.
        assert_eq!(count(&text, " tanh("), 0, "{dims:?}\n{text}");
        assert_eq!(count(&text, "gelu_tanh("), 1, "{dims:?}\n{text}");
    }
}

#[test]
fn mlp_training_graph_ir() {
    let (g, _) = mlp(&[32, 16], Sgd::new(0.1));
    insta::assert_snapshot!(optimized_text(&g, true));
}

fn data(dims: &[usize]) -> (HostTensor, HostTensor) {
    let n: usize = dims.iter().product();
    let xs = rustytorch::ops::testing::rand_f64(n, 7, -2.0, 2.0);
    let ys = rustytorch::ops::testing::rand_f64(n / 16 * 8, 8, -1.0, 1.0);
    let mut y_dims = dims.to_vec();
    *y_dims.last_mut().unwrap() = 8;
    (
        HostTensor::from_vec(xs.iter().map(|&v| v as f32).collect(), dims.to_vec()).unwrap(),
        HostTensor::from_vec(ys.iter().map(|&v| v as f32).collect(), y_dims).unwrap(),
    )
}

/// Losses and final parameters of `steps` training steps, optimized or not.
fn train(
    dims: &[usize],
    opt: rustytorch::Optimizer,
    optimize: bool,
    steps: usize,
) -> (Vec<f32>, Vec<(String, HostTensor)>) {
    let (g, loss) = mlp(dims, opt);
    let opts = CompileOptions {
        optimize,
        ..Default::default()
    };
    let mut exe = compile_with(&g, &[&loss], Device::Cpu, &opts).unwrap();
    if optimize {
        assert!(exe.optimized_ir().contains("matmul_act_grad["));
    }
    let (x, y) = data(dims);
    let losses = (0..steps)
        .map(|_| {
            let out = exe.run(&[("x", x.clone()), ("y", y.clone())]).unwrap();
            out[0].to_vec::<f32>().unwrap()[0]
        })
        .collect();
    (losses, exe.params().unwrap())
}

#[test]
fn optimized_training_equals_unoptimized() {
    let opts: [rustytorch::Optimizer; 2] = [Sgd::new(0.05).into(), AdamW::new(1e-2).into()];
    for opt in opts {
        for dims in [&[32usize, 16][..], &[2, 8, 16]] {
            let (la, pa) = train(dims, opt.clone(), true, 4);
            let (lb, pb) = train(dims, opt.clone(), false, 4);
            assert!(la[3] < la[0], "the loss decreases: {la:?}");
            for (i, (a, b)) in la.iter().zip(&lb).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "step {i}: {a} vs {b}"
                );
            }
            for ((na, ta), (nb, tb)) in pa.iter().zip(&pb) {
                assert_eq!(na, nb);
                rustytorch::ops::testing::assert_close(
                    &ta.to_f64_vec(),
                    &tb.to_f64_vec(),
                    1e-5,
                    &format!("{opt:?} {dims:?} {na}"),
                );
            }
        }
    }
}

/// The bench's graph (bf16, gradients through `autodiff::grad`, a 3-D input like GPT-2's MLP):
/// the op forms, and disabling the rule by name leaves the spelled derivative (what the bench
/// compares against).
#[test]
fn bf16_fwd_bwd_graph_and_the_disabled_rule() {
    let bf = DType::BF16;
    let g = GraphBuilder::new();
    let x = g.input("x", bf, [2, 8, 16]);
    let dy = g.input("dy", bf, [2, 8, 16]);
    let p = |name: &str, dims: &[usize]| {
        g.param_typed(
            name,
            TensorType::new(bf, dims.to_vec()),
            Init::kaiming_uniform(dims[0], 3),
            true,
        )
    };
    let (w1, b1, w2) = (p("w1", &[16, 64]), p("b1", &[64]), p("w2", &[64, 16]));
    let out = x.matmul(&w1).add(&b1).gelu_tanh().matmul(&w2);
    let loss = out.mul(&dy).sum_all();
    let mut graph = g.graph().unwrap();
    let wrt: Vec<_> = [&x, &w1, &b1, &w2]
        .iter()
        .map(|v| v.node().unwrap())
        .collect();
    let grads = rustytorch::compiler::grad(&mut graph, loss.node().unwrap(), &wrt).unwrap();
    for (i, gr) in grads.into_iter().enumerate() {
        graph.add_output(&format!("grad{i}"), gr).unwrap();
    }
    let text = |disabled: Vec<String>| {
        let mut opts = Options {
            fuse: false,
            dump: vec![],
            ..Options::default()
        };
        opts.optimize_config.disabled_rules = disabled;
        print(&run(&graph, &opts).unwrap().graph)
    };
    let on = text(vec![]);
    assert_eq!(
        count(&on, "matmul_act_grad[trans_b,act=gelu_tanh]"),
        1,
        "{on}"
    );
    let off = text(vec!["matmul-dgelu-tanh".into()]);
    assert_eq!(count(&off, "matmul_act_grad["), 0, "{off}");
    assert_eq!(count(&off, " tanh("), 1, "{off}");
}

/// Under bf16 autocast the op is formed on the f32 spelling, then runs in bf16 like the other
/// matmuls (its pre-activation is the forward's bf16 result, read through the folded casts).
#[test]
fn autocast_runs_the_op_in_bf16() {
    let (g, _) = mlp(&[32, 16], Sgd::new(0.1));
    let graph = g.graph().unwrap();
    let opts = Options {
        fuse: false,
        autocast: Some(DType::BF16),
        dump: vec![],
        ..Options::default()
    };
    let text = print(&run(&graph, &opts).unwrap().graph);
    let line = text
        .lines()
        .find(|l| l.contains("matmul_act_grad["))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(line.ends_with(": bf16[32,64]"), "{line}");
}
