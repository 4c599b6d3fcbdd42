//! The channels-last pass: convolution stacks (conv → bias → ReLU → pool → conv …) made
//! channels-last with transposes only at their borders, a user's NHWC permutes cancelled, the
//! training graph included; values against the untouched graph on random inputs, and insta
//! snapshots of the IR after the pass and after the whole pipeline.

use rustytorch_compiler::layout::{channels_last, ChannelsLast};
use rustytorch_compiler::passes::{self, Options};
use rustytorch_compiler::{grad, text, ConvOpts, Graph, GraphBuilder, Init, NodeId, Tensor};
use rustytorch_ops::testing::{assert_close, rand_tensor};
use rustytorch_ops::{eval_cpu, DType, HostTensor, Layout, Op};
use std::collections::HashMap;

/// f32 is accepted here so that the CPU checks the values (a GPU target accepts f16/bf16).
fn target(pool: bool) -> ChannelsLast {
    ChannelsLast {
        dtypes: vec![DType::F32, DType::F16, DType::BF16],
        channel_multiple: 8,
        min_spatial: 2,
        pool,
    }
}

fn run(g: &Graph, feeds: &HashMap<String, HostTensor>) -> Vec<HostTensor> {
    let mut vals: HashMap<NodeId, HostTensor> = HashMap::new();
    for n in g.live_order() {
        let node = g.node(n).unwrap();
        let v = match &node.op {
            Op::Input { index, .. } => feeds[&g.inputs[*index as usize].name].clone(),
            Op::Param { index, .. } => {
                let p = &g.params[*index as usize];
                p.data
                    .clone()
                    .unwrap_or_else(|| p.init.materialize(&p.ty).unwrap())
            }
            Op::Constant { index, .. } => g.constants[*index as usize].clone(),
            op => {
                let ins: Vec<&HostTensor> = node.inputs.iter().map(|i| &vals[i]).collect();
                eval_cpu(op, &ins).unwrap_or_else(|e| panic!("%{}: {e}", n.index()))
            }
        };
        assert_eq!(v.ty(), node.ty, "%{} ({})", n.index(), node.op.name());
        vals.insert(n, v);
    }
    g.roots().iter().map(|n| vals[n].clone()).collect()
}

fn feeds(g: &Graph, seed: u64) -> HashMap<String, HostTensor> {
    g.inputs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            (
                d.name.clone(),
                rand_tensor(&d.ty, seed + i as u64, -1.0, 1.0),
            )
        })
        .collect()
}

fn same_values(a: &Graph, b: &Graph, tol: f64) {
    let f = feeds(a, 17);
    let (ra, rb) = (run(a, &f), run(b, &f));
    assert_eq!(ra.len(), rb.len());
    for (k, (x, y)) in ra.iter().zip(&rb).enumerate() {
        assert_eq!(x.ty(), y.ty(), "root {k}");
        assert_close(&y.to_f64_vec(), &x.to_f64_vec(), tol, &format!("root {k}"));
    }
}

fn count(g: &Graph, f: impl Fn(&Op) -> bool) -> usize {
    g.node_ids()
        .into_iter()
        .filter(|&id| f(&g.node(id).unwrap().op))
        .count()
}

fn permutes(g: &Graph) -> usize {
    count(g, |op| matches!(op, Op::Permute { .. }))
}

fn channels_last_convs(g: &Graph) -> usize {
    count(g, |op| {
        matches!(op, Op::Conv { geom, .. } | Op::ConvGradInput { geom, .. }
            | Op::ConvGradWeight { geom, .. } | Op::Pool { geom, .. } | Op::PoolGrad { geom, .. }
            if geom.layout == Layout::ChannelsLast)
    })
}

fn conv_opts() -> ConvOpts {
    ConvOpts {
        padding: vec![1],
        ..Default::default()
    }
}

/// A `[c, c, 3, 3]` weight: a parameter of that shape, or with `ohwi` one stored
/// `[c, 3, 3, c]` (as PyTorch's channels-last weights are) permuted to it.
fn weight(b: &GraphBuilder, name: &str, c: usize, seed: u64, ohwi: bool) -> Tensor {
    let init = Init::kaiming_uniform(c * 9, seed);
    if ohwi {
        b.param(name, [c, 3, 3, c], init).permute(&[0, 3, 1, 2])
    } else {
        b.param(name, [c, c, 3, 3], init)
    }
}

/// conv(+bias as an add of `[C, 1, 1]`) → ReLU, twice, a max pool between.
fn stack(b: &GraphBuilder, x: &Tensor, c: usize) -> Tensor {
    stack_with(b, x, c, false)
}

fn stack_with(b: &GraphBuilder, x: &Tensor, c: usize, ohwi: bool) -> Tensor {
    let w1 = weight(b, "w1", c, 1, ohwi);
    let b1 = b.param("b1", [c, 1, 1], Init::kaiming_uniform(c, 2));
    let w2 = weight(b, "w2", c, 3, ohwi);
    let b2 = b.param("b2", [c], Init::kaiming_uniform(c, 4));
    let h = x.conv(&w1, None, &conv_opts()).add(&b1).relu();
    let h = h.max_pool(&[2, 2], &[], &[0, 0]);
    h.conv(&w2, Some(&b2), &conv_opts()).relu()
}

/// An NHWC input permuted to NCHW before the stack and back after it, the weights stored
/// channels-last and permuted too.
fn nhwc_graph(c: usize) -> Graph {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [2, 8, 6, c]);
    let y = stack_with(&b, &x.permute(&[0, 3, 1, 2]), c, true).permute(&[0, 2, 3, 1]);
    b.output("y", &y);
    b.graph().unwrap()
}

#[test]
fn an_nhwc_stack_runs_without_a_transpose() {
    let g = nhwc_graph(8);
    assert_eq!(permutes(&g), 4);
    let (out, rep) = channels_last(&g, &target(true)).unwrap();
    out.verify().unwrap();
    assert_eq!(permutes(&out), 0, "{}", text::print(&out));
    assert_eq!((rep.seeds, rep.transposes), (3, 0));
    assert_eq!(channels_last_convs(&out), 3);
    same_values(&g, &out, 1e-5);
    insta::assert_snapshot!("nhwc_stack_after_layout", text::print(&out));
}

/// Without channels-last pooling the pool stays channels-first, between two transposes.
#[test]
fn pooling_stays_channels_first_when_the_target_says_so() {
    let g = nhwc_graph(8);
    let (out, rep) = channels_last(&g, &target(false)).unwrap();
    assert_eq!((rep.seeds, rep.transposes), (2, 2));
    assert_eq!(permutes(&out), 2);
    same_values(&g, &out, 1e-5);
}

/// An NCHW graph gets one transpose in and one out; channel counts that are not multiples of
/// the target's, and dtypes it does not list, are left alone.
#[test]
fn channels_first_graphs_get_transposes_at_the_borders_only() {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [2, 8, 8, 6]);
    let y = stack(&b, &x, 8);
    b.output("y", &y);
    let g = b.graph().unwrap();
    let (out, rep) = channels_last(&g, &target(true)).unwrap();
    // x in, y out, and the two weights in.
    assert_eq!((rep.seeds, rep.transposes), (3, 4));
    same_values(&g, &out, 1e-5);

    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [2, 6, 8, 6]);
    b.output("y", &stack(&b, &x, 6));
    let g = b.graph().unwrap();
    let (out, rep) = channels_last(&g, &target(true)).unwrap();
    assert_eq!(rep.seeds, 0);
    assert_eq!(text::print(&out), text::print(&g));
    let mut f64_only = target(true);
    f64_only.dtypes = vec![DType::F64];
    assert_eq!(channels_last(&g, &f64_only).unwrap().1.seeds, 0);
}

/// The training graph: every gradient convolution channels-last, the gradients (of the NCHW
/// parameters) equal to the untouched graph's.
#[test]
fn gradients_of_a_channels_last_stack() {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [2, 8, 6, 8]);
    let y = stack(&b, &x.permute(&[0, 3, 1, 2]), 8).permute(&[0, 2, 3, 1]);
    let loss = y.mul(&y).mean(&[0, 1, 2, 3], false);
    b.output("loss", &loss);
    let mut g = b.graph().unwrap();
    let loss_id = g.outputs[0].1;
    let params: Vec<NodeId> = g.params.iter().map(|p| p.node).collect();
    let grads = grad(&mut g, loss_id, &params).unwrap();
    for (k, d) in grads.into_iter().enumerate() {
        g.add_output(&format!("d{k}"), d).unwrap();
    }
    g.verify().unwrap();
    let (out, rep) = channels_last(&g, &target(true)).unwrap();
    out.verify().unwrap();
    // Forward 2 convs + 1 pool, backward 2 input gradients (the first conv's is dead code
    // without an input gradient), 2 weight gradients, 1 pool gradient.
    assert!(channels_last_convs(&out) >= 6, "{}", text::print(&out));
    assert_eq!(
        count(
            &out,
            |op| matches!(op, Op::Conv { geom, .. } | Op::ConvGradInput { geom, .. }
            | Op::ConvGradWeight { geom, .. } if geom.layout == Layout::ChannelsFirst)
        ),
        0
    );
    // What remains: the weights in (two), the weight gradients out (two).
    assert_eq!(rep.transposes, 4, "{}", text::print(&out));
    same_values(&g, &out, 1e-4);
}

/// The whole pipeline with the option on: the pass shows in the optimized IR, and the bias add
/// and ReLU after each channels-last convolution are one fused kernel.
#[test]
fn the_pipeline_runs_the_pass_when_asked() {
    let g = nhwc_graph(8);
    let opts = Options {
        channels_last: Some(target(true)),
        dump: vec![],
        ..Default::default()
    };
    let c = passes::run(&g, &opts).unwrap();
    assert!(c.report.passes.iter().any(|p| p.name == "layout"));
    assert_eq!(permutes(&c.graph), 0);
    same_values(&g, &c.graph, 1e-5);
    insta::assert_snapshot!("nhwc_stack_pipeline", text::print(&c.graph));
    let off = passes::run(
        &g,
        &Options {
            dump: vec![],
            ..Default::default()
        },
    )
    .unwrap();
    assert!(off.report.passes.iter().all(|p| p.name != "layout"));
    assert_eq!(channels_last_convs(&off.graph), 0);
}
