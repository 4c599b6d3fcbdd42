//! Gradients of whole graphs in f64 against central finite differences: an MLP with
//! cross-entropy, a small CNN (strided and padded convolutions, max and average pooling, LayerNorm,
//! RMSNorm, a linear head) and a causal transformer block (with the attention op, and with
//! attention spelled in matmuls and a softmax). Each model's gradients are checked as
//! `compiler::grad` produces them and as a training step computes them, with and without the
//! e-graph optimizer, on a seeded subset of every parameter's entries.

use rustytorch::compiler::NodeId;
use rustytorch::ops::testing::{rand_f64, rand_tensor};
use rustytorch::prelude::*;

const F: DType = DType::F64;
/// Finite-difference step.
const H: f64 = 1e-5;
/// Relative tolerance of an analytic gradient against its finite difference.
const RTOL: f64 = 1e-6;
/// Absolute floor of that comparison (the difference quotient's rounding is ~1e-11).
const ATOL: f64 = 1e-9;
/// Entries checked per parameter.
const ENTRIES: usize = 5;
/// The learning rate of the training steps (exact in f32, the dtype of `optim.lr`).
const LR: f64 = 0.125;

/// A model: its graph builder, its scalar loss and the inputs of one batch.
struct Model {
    g: GraphBuilder,
    loss: Tensor,
    inputs: Vec<(&'static str, HostTensor)>,
}

/// A trainable f64 parameter, uniform in ±`scale` (never zero in practice).
fn param(g: &GraphBuilder, name: &str, dims: &[usize], scale: f64) -> Tensor {
    let seed = g.next_seed();
    g.param_typed(
        name,
        TensorType::new(F, dims.to_vec()),
        Init::Uniform {
            low: -scale,
            high: scale,
            seed,
        },
        true,
    )
}

/// A random f64 input of `dims` in [-1, 1) and its value.
fn input(
    g: &GraphBuilder,
    name: &'static str,
    dims: &[usize],
    seed: u64,
) -> (Tensor, (&'static str, HostTensor)) {
    let ty = TensorType::new(F, dims.to_vec());
    let t = g.input(name, F, dims.to_vec());
    (t, (name, rand_tensor(&ty, seed, -1.0, 1.0)))
}

/// Integer class targets in `0..classes`.
fn targets(
    g: &GraphBuilder,
    n: usize,
    classes: usize,
    seed: u64,
) -> (Tensor, (&'static str, HostTensor)) {
    let t = g.input("y", DType::I64, [n]);
    let ys: Vec<i64> = rand_f64(n, seed, 0.0, classes as f64)
        .iter()
        .map(|&v| v as i64)
        .collect();
    (t, ("y", HostTensor::from_vec(ys, [n]).unwrap()))
}

/// Two linear layers with bias, GELU between them, mean cross-entropy.
fn mlp() -> Model {
    let g = GraphBuilder::new();
    let (x, xv) = input(&g, "x", &[8, 6], 11);
    let (y, yv) = targets(&g, 8, 4, 12);
    let w1 = param(&g, "w1", &[6, 16], 0.6);
    let b1 = param(&g, "b1", &[16], 0.3);
    let w2 = param(&g, "w2", &[16, 4], 0.5);
    let b2 = param(&g, "b2", &[4], 0.3);
    let logits = x.linear(&w1, Some(&b1)).gelu().linear(&w2, Some(&b2));
    let loss = logits.cross_entropy(&y);
    Model {
        g,
        loss,
        inputs: vec![xv, yv],
    }
}

/// conv(stride 2, padding 1) → GELU → max pool → conv(padding 1) → average pool → flatten →
/// LayerNorm → linear → GELU → RMSNorm → linear head → mean cross-entropy.
fn cnn() -> Model {
    let g = GraphBuilder::new();
    let (x, xv) = input(&g, "x", &[3, 2, 9, 9], 21);
    let (y, yv) = targets(&g, 3, 5, 22);
    let c1 = param(&g, "conv1.w", &[4, 2, 3, 3], 0.4);
    let c1b = param(&g, "conv1.b", &[4], 0.2);
    let c2 = param(&g, "conv2.w", &[6, 4, 3, 3], 0.3);
    let c2b = param(&g, "conv2.b", &[6], 0.2);
    let lnw = param(&g, "ln.w", &[24], 1.0);
    let lnb = param(&g, "ln.b", &[24], 0.3);
    let f1 = param(&g, "fc1.w", &[24, 12], 0.4);
    let f1b = param(&g, "fc1.b", &[12], 0.2);
    let rmsw = param(&g, "rms.w", &[12], 1.0);
    let head = param(&g, "head.w", &[12, 5], 0.4);
    let headb = param(&g, "head.b", &[5], 0.2);
    let h = x
        .conv(
            &c1,
            Some(&c1b),
            &ConvOpts::default().stride(&[2]).padding(&[1]),
        )
        .gelu(); // [3, 4, 5, 5]
    let h = h.max_pool(&[2], &[1], &[0]); // [3, 4, 4, 4]
    let h = h.conv(&c2, Some(&c2b), &ConvOpts::default().padding(&[1])); // [3, 6, 4, 4]
    let h = h.avg_pool(&[2], &[], &[0], true).flatten(1); // [3, 24]
    let h = h.layer_norm(Some(&lnw), Some(&lnb), 1e-5);
    let h = h.linear(&f1, Some(&f1b)).gelu().rms_norm(Some(&rmsw), 1e-6);
    let loss = h.linear(&head, Some(&headb)).cross_entropy(&y);
    Model {
        g,
        loss,
        inputs: vec![xv, yv],
    }
}

/// A pre-norm transformer block over [B=2, S=5, D=8] with 2 heads and a causal mask: LayerNorm →
/// multi-head attention → residual → LayerNorm → GELU MLP → residual; the loss is the mean
/// squared difference to a random target. `spelled` writes the attention as
/// `softmax(where(causal, q·kᵀ·scale, -1e9))·v` instead of the attention op.
fn transformer(spelled: bool) -> Model {
    let (b, s, d, heads) = (2, 5, 8, 2);
    let dh = d / heads;
    let g = GraphBuilder::new();
    let (x, xv) = input(&g, "x", &[b, s, d], 31);
    let (target, tv) = input(&g, "target", &[b, s, d], 32);
    let ln1w = param(&g, "ln1.w", &[d], 1.0);
    let ln1b = param(&g, "ln1.b", &[d], 0.2);
    let wq = param(&g, "q.w", &[d, d], 0.5);
    let bq = param(&g, "q.b", &[d], 0.2);
    let wk = param(&g, "k.w", &[d, d], 0.5);
    let bk = param(&g, "k.b", &[d], 0.2);
    let wv = param(&g, "v.w", &[d, d], 0.5);
    let bv = param(&g, "v.b", &[d], 0.2);
    let wo = param(&g, "o.w", &[d, d], 0.4);
    let bo = param(&g, "o.b", &[d], 0.2);
    let ln2w = param(&g, "ln2.w", &[d], 1.0);
    let ln2b = param(&g, "ln2.b", &[d], 0.2);
    let wfc = param(&g, "fc.w", &[d, 4 * d], 0.4);
    let bfc = param(&g, "fc.b", &[4 * d], 0.2);
    let wpr = param(&g, "proj.w", &[4 * d, d], 0.2);
    let bpr = param(&g, "proj.b", &[d], 0.2);

    let split = |t: Tensor| t.reshape([b, s, heads, dh]).permute(&[0, 2, 1, 3]);
    let h = x.layer_norm(Some(&ln1w), Some(&ln1b), 1e-5);
    let q = split(h.linear(&wq, Some(&bq)));
    let k = split(h.linear(&wk, Some(&bk)));
    let v = split(h.linear(&wv, Some(&bv)));
    let a = if spelled {
        let scale = 1.0 / (dh as f64).sqrt();
        let scores = q.matmul_t(&k, false, true).mul_scalar(scale);
        let it = TensorType::new(DType::I64, [s, s]);
        let keep = g.iota(0, it.clone()).ge(&g.iota(1, it));
        let masked = g.where_(&keep, &scores, &g.scalar(-1e9, F));
        masked.softmax(-1).matmul(&v)
    } else {
        q.attention(&k, &v, None, Causal::TopLeft, None)
    };
    let a = a.permute(&[0, 2, 1, 3]).reshape([b, s, d]);
    let x1 = x.add(&a.linear(&wo, Some(&bo)));
    let m = x1
        .layer_norm(Some(&ln2w), Some(&ln2b), 1e-5)
        .linear(&wfc, Some(&bfc))
        .gelu()
        .linear(&wpr, Some(&bpr));
    let out = x1.add(&m);
    let loss = out.mse_loss(&target);
    Model {
        g,
        loss,
        inputs: vec![xv, tv],
    }
}

/// Names and nodes of the trainable parameters.
fn trainable(g: &GraphBuilder) -> Vec<(String, NodeId)> {
    g.with_graph(|gr| {
        gr.params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| (p.name.clone(), p.node))
            .collect()
    })
}

fn opts(optimize: bool, updates: bool) -> CompileOptions {
    CompileOptions {
        optimize,
        updates,
        ..CompileOptions::default()
    }
}

/// Up to [`ENTRIES`] distinct seeded indices below `n`.
fn entries(n: usize, seed: u64) -> Vec<usize> {
    if n <= ENTRIES {
        return (0..n).collect();
    }
    let mut out = Vec::new();
    for (k, r) in rand_f64(4 * ENTRIES, seed, 0.0, n as f64)
        .iter()
        .enumerate()
    {
        let i = (*r as usize).min(n - 1);
        if !out.contains(&i) {
            out.push(i);
        }
        if out.len() == ENTRIES || k == 4 * ENTRIES - 1 {
            break;
        }
    }
    out
}

/// Central differences of the loss for the chosen entries of every trainable parameter, evaluated
/// with a loss-only executable: (param, [(entry, dL/dp)]).
fn finite_differences(m: &Model) -> Vec<(String, Vec<(usize, f64)>)> {
    let mut exe = compile_with(&m.g, &[&m.loss], Device::Cpu, &opts(false, false)).unwrap();
    let loss = |exe: &mut Executable| -> f64 { exe.run(&m.inputs).unwrap()[0].to_f64_vec()[0] };
    let base = loss(&mut exe);
    assert!(base.is_finite() && base != 0.0, "loss {base}");
    let mut out = Vec::new();
    for (pi, (name, _)) in trainable(&m.g).into_iter().enumerate() {
        let p0 = exe.param(&name).unwrap();
        let ty = p0.ty();
        let vals = p0.to_f64_vec();
        assert!(vals.iter().all(|&v| v != 0.0), "{name} has a zero entry");
        let mut fd = Vec::new();
        for i in entries(vals.len(), 1000 + pi as u64) {
            let mut at = |delta: f64| {
                let mut v = vals.clone();
                v[i] += delta;
                exe.set_param(&name, HostTensor::from_f64_slice(&ty, &v).unwrap())
                    .unwrap();
                loss(&mut exe)
            };
            let (lp, lm) = (at(H), at(-H));
            fd.push((i, (lp - lm) / (2.0 * H)));
        }
        exe.set_param(&name, p0).unwrap();
        out.push((name, fd));
    }
    out
}

/// Asserts every checked entry of `grads` (by parameter name) matches its finite difference.
fn assert_matches_fd(what: &str, fd: &[(String, Vec<(usize, f64)>)], grads: &[(String, Vec<f64>)]) {
    let mut nonzero = 0;
    for (name, entries) in fd {
        let g = &grads.iter().find(|(n, _)| n == name).unwrap().1;
        for &(i, want) in entries {
            let got = g[i];
            let err = (got - want).abs();
            assert!(
                err <= RTOL * got.abs().max(want.abs()) + ATOL,
                "{what}: d loss / d {name}[{i}]: analytic {got:e}, finite difference {want:e} \
                 (error {err:e})"
            );
            nonzero += (want.abs() > 1e-6) as usize;
        }
    }
    // The comparison must be about something: most checked entries carry a real gradient.
    let total: usize = fd.iter().map(|(_, e)| e.len()).sum();
    assert!(
        2 * nonzero > total,
        "{what}: only {nonzero} of {total} gradients are non-zero"
    );
}

/// The gradients of `compiler::grad` (inference executable, no optimizer updates).
fn graph_grads(m: &Model, optimize: bool) -> Vec<(String, Vec<f64>)> {
    let params = trainable(&m.g);
    let wrt: Vec<NodeId> = params.iter().map(|p| p.1).collect();
    let loss = m.loss.node().unwrap();
    let ids =
        m.g.with_graph(|gr| rustytorch::compiler::grad(gr, loss, &wrt))
            .unwrap();
    let grads: Vec<Tensor> = ids.iter().map(|&id| m.g.tensor(id)).collect();
    let mut outs = vec![&m.loss];
    outs.extend(grads.iter());
    let mut exe = compile_with(&m.g, &outs, Device::Cpu, &opts(optimize, false)).unwrap();
    let out = exe.run(&m.inputs).unwrap().into_vec();
    params
        .into_iter()
        .zip(&out[1..])
        .map(|((n, _), g)| (n, g.to_f64_vec()))
        .collect()
}

/// The gradients a training step (SGD at [`LR`]) computes, read from its outputs; also checks
/// that the step applied `p ← p − lr·g` with exactly those gradients.
fn train_step_grads(make: &dyn Fn() -> Model, optimize: bool) -> Vec<(String, Vec<f64>)> {
    let m = make();
    let step =
        m.g.train_step(&m.loss, Sgd::new(LR), &StepOptions::default())
            .unwrap();
    let mut outs = vec![&m.loss];
    outs.extend(step.grads.iter().map(|(_, t)| t));
    let mut exe = compile_with(&m.g, &outs, Device::Cpu, &opts(optimize, true)).unwrap();
    let before: Vec<Vec<f64>> = step
        .grads
        .iter()
        .map(|(n, _)| exe.param(n).unwrap().to_f64_vec())
        .collect();
    let out = exe.run(&m.inputs).unwrap().into_vec();
    let mut grads = Vec::new();
    for (((name, _), g), p0) in step.grads.iter().zip(&out[1..]).zip(before) {
        let g = g.to_f64_vec();
        let p1 = exe.param(name).unwrap().to_f64_vec();
        for i in 0..g.len() {
            let want = p0[i] - LR * g[i];
            assert!(
                (p1[i] - want).abs() <= 1e-15 * (1.0 + want.abs()),
                "optimize={optimize}: {name}[{i}] updated to {}, want {want}",
                p1[i]
            );
        }
        grads.push((name.clone(), g));
    }
    grads
}

/// Asserts two gradient sets agree to `rtol` everywhere.
fn assert_same(what: &str, a: &[(String, Vec<f64>)], b: &[(String, Vec<f64>)], rtol: f64) {
    assert_eq!(a.len(), b.len(), "{what}");
    for ((na, ga), (nb, gb)) in a.iter().zip(b) {
        assert_eq!(na, nb, "{what}");
        for (i, (&x, &y)) in ga.iter().zip(gb).enumerate() {
            assert!(
                (x - y).abs() <= rtol * x.abs().max(y.abs()) + 1e-14,
                "{what}: {na}[{i}]: {x:e} vs {y:e}"
            );
        }
    }
}

/// The whole check of one model: graph-level gradients (without and with the optimizer) and the
/// training step's gradients (without and with it) against finite differences and each other.
fn check_model(make: &dyn Fn() -> Model) {
    let m = make();
    let fd = finite_differences(&m);
    let plain = graph_grads(&m, false);
    assert_matches_fd("grad", &fd, &plain);
    let optimized = graph_grads(&make(), true);
    assert_matches_fd("grad, optimized", &fd, &optimized);
    let step = train_step_grads(make, false);
    assert_matches_fd("train_step", &fd, &step);
    let step_opt = train_step_grads(make, true);
    assert_matches_fd("train_step, optimized", &fd, &step_opt);
    assert_same("train_step vs grad", &step, &plain, 1e-12);
    assert_same("train_step optimized vs not", &step_opt, &step, 1e-10);
}

#[test]
fn mlp_with_cross_entropy() {
    check_model(&mlp);
}

#[test]
fn cnn_with_pooling_and_norms() {
    check_model(&cnn);
}

#[test]
fn transformer_block_with_the_attention_op() {
    check_model(&|| transformer(false));
}

#[test]
fn transformer_block_with_spelled_attention() {
    check_model(&|| transformer(true));
}

/// The harness itself: a gradient off by one part in 10⁵ in a single entry is caught.
#[test]
fn a_slightly_wrong_gradient_is_caught() {
    let m = mlp();
    let fd = finite_differences(&m);
    let mut grads = graph_grads(&m, false);
    // The checked entry with the largest gradient.
    let (name, i) = fd
        .iter()
        .flat_map(|(n, e)| e.iter().map(move |&(i, v)| (n, i, v.abs())))
        .max_by(|a, b| a.2.total_cmp(&b.2))
        .map(|(n, i, _)| (n.clone(), i))
        .unwrap();
    let g = &mut grads.iter_mut().find(|(n, _)| *n == name).unwrap().1;
    g[i] *= 1.0 + 1e-5;
    let r = std::panic::catch_unwind(|| assert_matches_fd("perturbed", &fd, &grads));
    assert!(
        r.is_err(),
        "a 1e-5 relative error in {name}[{i}] went unnoticed"
    );
}
