//! Fusion: which ops group into kernels, what must stay materialized, and that fused graphs
//! compute what the unfused graphs compute (CPU, node by node).

use proptest::prelude::*;
use rustytorch_compiler::fuse::{describe_groups, fuse, FuseReport};
use rustytorch_compiler::{Graph, GraphBuilder, NodeId, Tensor};
use rustytorch_ops::testing::{assert_close, rand_tensor};
use rustytorch_ops::{eval_cpu, DType, HostTensor, Op, TensorType};
use std::collections::HashMap;

/// Evaluates `g` on the CPU, one node at a time in schedule order; returns the values of its
/// roots (outputs, updates, guards) in order.
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

/// Random feeds for every input of `g` (seeded, never zeros).
fn feeds(g: &Graph, seed: u64) -> HashMap<String, HostTensor> {
    g.inputs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            (
                d.name.clone(),
                rand_tensor(&d.ty, seed + i as u64, -2.0, 2.0),
            )
        })
        .collect()
}

/// Fuses `g`, checks tables are kept and values agree within `tol`; returns the fused graph.
fn fuse_and_compare(g: &Graph, tol: f64) -> (Graph, FuseReport) {
    let (f, report) = fuse(g).unwrap();
    f.verify().unwrap();
    assert_eq!(f.inputs.len(), g.inputs.len());
    assert_eq!(f.params.len(), g.params.len());
    assert_eq!(f.constants.len(), g.constants.len());
    assert_eq!(
        f.outputs.iter().map(|o| &o.0).collect::<Vec<_>>(),
        g.outputs.iter().map(|o| &o.0).collect::<Vec<_>>()
    );
    assert_eq!(f.updates.len(), g.updates.len());
    assert_eq!(f.guards.len(), g.guards.len());
    for (a, b) in g.outputs.iter().zip(&f.outputs) {
        assert_eq!(g.ty(a.1), f.ty(b.1));
    }
    let fd = feeds(g, 7);
    let want = run(g, &fd);
    let got = run(&f, &fd);
    for (k, (w, o)) in want.iter().zip(&got).enumerate() {
        assert_eq!(w.ty(), o.ty());
        assert_close(
            &o.to_f64_vec(),
            &w.to_f64_vec(),
            tol,
            &format!("output {k}"),
        );
    }
    (f, report)
}

fn count(g: &Graph, pred: impl Fn(&Op) -> bool) -> usize {
    g.live_order()
        .into_iter()
        .filter(|&n| pred(&g.node(n).unwrap().op))
        .count()
}

fn is_fused(op: &Op) -> bool {
    matches!(op, Op::Fused(_))
}

fn kernel(g: &Graph, id: NodeId) -> &rustytorch_ops::FusedKernel {
    match &g.node(id).unwrap().op {
        Op::Fused(k) => k,
        other => panic!("%{} is {}, not a fused kernel", id.index(), other.name()),
    }
}

fn out_node(g: &Graph, name: &str) -> NodeId {
    g.outputs.iter().find(|o| o.0 == name).unwrap().1
}

fn f32_input(b: &GraphBuilder, name: &str, dims: &[usize]) -> Tensor {
    b.input(name, DType::F32, dims.to_vec())
}

#[test]
fn affine_tanh_chain_is_one_kernel() {
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    let w = f32_input(&b, "w", &[4, 8]);
    let bias = f32_input(&b, "b", &[8]);
    let y = x.mul(&w).add(&bias).tanh().mul_scalar(0.5).add_scalar(1.0);
    b.output("y", &y);
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 1e-6);
    assert_eq!(count(&f, |op| !op.is_leaf()), 1, "{}", describe_groups(&f));
    assert_eq!(report.groups, 1);
    assert_eq!(report.ops_absorbed, 5);
    assert_eq!(report.immediates, 2);
    assert_eq!(report.kernels_before, 5);
    assert_eq!(report.kernels_after, 1);
    let k = kernel(&f, out_node(&f, "y"));
    assert_eq!(k.n_inputs, 3);
    assert_eq!(k.instrs.len(), 7);
    insta::assert_snapshot!(describe_groups(&f), @r#"
    %9 = fused -> f32[4,8]
      in0 = %0 "x" (input) : f32[4,8]
      in1 = %1 "w" (input) : f32[4,8]
      in2 = %2 "b" (input) : f32[8]
      t0 = mul(in0, in1) : f32
      t1 = add(t0, in2) : f32
      t2 = tanh(t1) : f32
      t3 = 0.5 : f32
      t4 = mul(t2, t3) : f32
      t5 = 1.0 : f32
      t6 = add(t4, t5) : f32
    "#);
}

#[test]
fn single_ops_stay_plain() {
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    b.output("y", &x.exp());
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 0.0);
    assert_eq!(report.groups, 0);
    assert_eq!(count(&f, is_fused), 0);
    assert_eq!(describe_groups(&f), "");
}

#[test]
fn value_used_outside_is_not_absorbed() {
    // u feeds a fusable chain and a reduction: it must be computed once and materialized.
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    let u = x.exp();
    let y = u.tanh().add_scalar(1.0);
    let z = u.sum(&[1], false);
    b.output("y", &y);
    b.output("z", &z);
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 1e-6);
    assert_eq!(report.groups, 1);
    assert_eq!(report.ops_absorbed, 2);
    let u_id = u.id().unwrap();
    assert!(matches!(f.node(u_id).unwrap().op, Op::Unary(_)));
    let yk = out_node(&f, "y");
    assert_eq!(f.node(yk).unwrap().inputs, vec![u_id]);
    assert_eq!(kernel(&f, yk).instrs.len(), 3);
    // exp, the fused tanh+add, the reduction.
    assert_eq!(report.kernels_after, 3);
}

#[test]
fn a_cast_used_by_two_chains_is_one_copy_in_each() {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::BF16, vec![4, 8]);
    let y = f32_input(&b, "y", &[4, 8]);
    let wide = x.cast(DType::F32);
    b.output("a", &wide.mul(&y).tanh());
    b.output("b", &wide.sigmoid().abs());
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 1e-6);
    assert_eq!(report.casts_split, 1);
    // Each chain is one kernel reading the bf16 x itself; no cast kernel is left.
    assert_eq!(report.kernels_after, 2, "{}", describe_groups(&f));
    assert_eq!(count(&f, |op| matches!(op, Op::Cast { .. })), 0);
    let x_id = x.id().unwrap();
    for o in ["a", "b"] {
        let k = out_node(&f, o);
        assert!(f.node(k).unwrap().inputs.contains(&x_id), "{o}");
    }
}

#[test]
fn a_narrowing_cast_split_into_two_kernels_still_rounds() {
    // Each copy rounds to bf16 inside its kernel: the fused graph equals the unfused one to f32
    // precision, far below bf16's rounding step.
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    let narrow = x.mul_scalar(1.7).cast(DType::BF16);
    b.output("a", &narrow.cast(DType::F32).mul_scalar(3.0));
    b.output("b", &narrow.cast(DType::F32).tanh());
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 1e-7);
    assert_eq!(report.casts_split, 1, "{}", describe_groups(&f));
    // The scaled x (used by both copies) is one kernel, each chain with its copy another.
    assert_eq!(report.kernels_after, 3, "{}", describe_groups(&f));
    assert!(describe_groups(&f).matches("cast<bf16>").count() == 2);
}

/// LayerNorm in primitives: `x − mean` feeds the variance's reduction, the normalization and,
/// as a backward would, one more chain. It is recomputed in each user's kernel (reading x and
/// the row means) instead of being written once and read three times.
#[test]
fn a_value_with_a_row_statistic_is_recomputed_in_each_user() {
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 64]);
    let mu = x.mean(&[-1], true);
    let xc = x.sub(&mu);
    let var = xc.mul(&xc).mean(&[-1], true);
    b.output("y", &xc.mul(&var.add_scalar(1e-5).rsqrt()));
    b.output("z", &xc.mul_scalar(3.0).tanh());
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 1e-6);
    assert_eq!(report.casts_split, 1, "{}", describe_groups(&f));
    // No kernel computes x − mean alone: the mean, the variance's row kernel and the two chains.
    assert_eq!(
        count(&f, |op| matches!(
            op,
            Op::Binary(rustytorch_ops::BinaryOp::Sub)
        )),
        0,
        "{}",
        describe_groups(&f)
    );
    assert_eq!(report.kernels_after, 4, "{}", describe_groups(&f));
}

#[test]
fn a_cast_with_a_non_elementwise_user_is_kept() {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::BF16, vec![4, 8]);
    let wide = x.cast(DType::F32);
    b.output("a", &wide.tanh().neg());
    b.output("s", &wide.sum(&[1], false));
    // Read as an output too: a result stays materialized, whoever else reads it.
    let c = b.input("c", DType::BF16, vec![4, 8]);
    let cw = c.cast(DType::F32);
    b.output("cw", &cw);
    b.output("d", &cw.exp().neg());
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 1e-6);
    assert_eq!(report.casts_split, 0, "{}", describe_groups(&f));
    assert_eq!(count(&f, |op| matches!(op, Op::Cast { .. })), 2);
}

#[test]
fn value_used_by_two_chains_splits_into_two_kernels() {
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    let t = x.mul_scalar(2.0).sin();
    b.output("a", &t.tanh().neg());
    b.output("b", &t.sigmoid().abs());
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 1e-6);
    // t's producer chain is its own kernel; each consumer chain another.
    assert_eq!(report.groups, 3);
    assert_eq!(report.kernels_after, 3);
    let t_id = t.id().unwrap();
    assert!(is_fused(&f.node(t_id).unwrap().op));
    for o in ["a", "b"] {
        assert_eq!(f.node(out_node(&f, o)).unwrap().inputs, vec![t_id]);
    }
}

#[test]
fn diamond_inside_a_group_is_absorbed() {
    // a has two users, both in the group: one kernel, a computed once.
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    let a = x.sin();
    let y = a.mul_scalar(2.0).mul(&a.add_scalar(1.0).cos());
    b.output("y", &y);
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 1e-6);
    assert_eq!(report.groups, 1);
    assert_eq!(report.kernels_after, 1);
    let k = kernel(&f, out_node(&f, "y"));
    let sins = k
        .instrs
        .iter()
        .filter(|i| i.op == Op::Unary(rustytorch_ops::UnaryOp::Sin))
        .count();
    assert_eq!(sins, 1);
}

#[test]
fn outputs_updates_and_guards_stay_materialized() {
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    let p = b.param(
        "p",
        [4, 8],
        rustytorch_compiler::Init::Uniform {
            low: -1.0,
            high: 1.0,
            seed: 3,
        },
    );
    let h = x.exp().mul_scalar(0.5);
    b.output("h", &h);
    let y = h.tanh().add_scalar(2.0);
    b.output("y", &y);
    let new_p = p.sub(&y.mul_scalar(0.1)).sin();
    b.update(&p, &new_p);
    let ok = y.sum_all().isfinite().logical_not().logical_not();
    let g = {
        let mut g = b.graph().unwrap();
        g.guards.push(("y finite".into(), ok.id().unwrap()));
        g
    };
    let (f, report) = fuse_and_compare(&g, 1e-6);
    let h_id = out_node(&f, "h");
    let y_id = out_node(&f, "y");
    assert_eq!(h_id, h.id().unwrap());
    assert_eq!(y_id, y.id().unwrap());
    assert_eq!(kernel(&f, h_id).instrs.len(), 3);
    assert_eq!(f.node(y_id).unwrap().inputs, vec![h_id]);
    // The update's chain reads y, never recomputes it.
    let u = f.updates[0].1;
    assert_eq!(u, new_p.id().unwrap());
    assert!(f.node(u).unwrap().inputs.contains(&y_id));
    // The guard's sum takes the chain after it as its epilogue.
    match &f.node(f.guards[0].1).unwrap().op {
        Op::FusedRow(r) => assert!(r.epilogue.as_ref().unwrap().instrs.len() >= 3),
        other => panic!("the guard is {}", other.name()),
    }
    assert_eq!(report.groups, 4);
    assert_eq!((report.rows, report.epilogues), (1, 1));
}

#[test]
fn reductions_split_groups() {
    // A softmax-like spelling: the chain before the reduction joins it as its prologue; the
    // chain after it (reading both x and the reduced value, of x's shape) is a second kernel.
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    let s = x.mul_scalar(2.0).sin().sum(&[1], true);
    let y = x.sub(&s).exp().neg();
    b.output("y", &y);
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 1e-5);
    assert_eq!(report.groups, 2);
    assert_eq!((report.rows, report.prologues, report.epilogues), (1, 1, 0));
    assert_eq!((report.kernels_before, report.kernels_after), (6, 2));
    let rn = f.node(s.id().unwrap()).unwrap();
    assert!(matches!(&rn.op, Op::FusedRow(r) if matches!(r.core, Op::Reduce { .. })));
    assert_eq!(rn.inputs, vec![x.id().unwrap()]);
    let yid = out_node(&f, "y");
    assert_eq!(
        f.node(yid).unwrap().inputs,
        vec![x.id().unwrap(), s.id().unwrap()]
    );
    insta::assert_snapshot!(describe_groups(&f), @r#"
    %4 = fused_row -> f32[4,1]
      in0 = %0 "x" (input) : f32[4,8]
      p0 = 2.0 : f32
      p1 = mul(in0, p0) : f32
      p2 = sin(p1) : f32
      row = reduce_sum[axes=1,keep](p2)
    %7 = fused -> f32[4,8]
      in0 = %0 "x" (input) : f32[4,8]
      in1 = %4 (fused_row) : f32[4,1]
      t0 = sub(in0, in1) : f32
      t1 = exp(t0) : f32
      t2 = neg(t1) : f32
    "#);
}

#[test]
fn expand_of_an_input_is_absorbed_as_broadcast() {
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    let bias = f32_input(&b, "b", &[8]);
    let be = bias.expand([4, 8]);
    let y = x.add(&be).relu().mul(&x);
    b.output("y", &y);
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 1e-6);
    assert_eq!(report.expands_absorbed, 1);
    assert_eq!(count(&f, |op| matches!(op, Op::Expand { .. })), 0);
    let yid = out_node(&f, "y");
    assert_eq!(
        f.node(yid).unwrap().inputs,
        vec![x.id().unwrap(), bias.id().unwrap()]
    );
    assert_eq!(report.kernels_after, 1);
}

#[test]
fn expand_used_elsewhere_is_read_through_but_kept() {
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    let bias = f32_input(&b, "b", &[4, 1]);
    let be = bias.expand([4, 8]);
    b.output("y", &x.add(&be).relu().neg());
    b.output("e", &be);
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 1e-6);
    assert_eq!(report.expands_absorbed, 0);
    let yid = out_node(&f, "y");
    assert_eq!(
        f.node(yid).unwrap().inputs,
        vec![x.id().unwrap(), bias.id().unwrap()]
    );
    assert!(matches!(
        f.node(out_node(&f, "e")).unwrap().op,
        Op::Expand { .. }
    ));
}

#[test]
fn single_op_over_an_expand_is_wrapped() {
    // One add plus the expand it absorbs: one kernel instead of two.
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    let bias = f32_input(&b, "b", &[8]);
    b.output("y", &x.add(&bias.expand([4, 8])));
    let g = b.graph().unwrap();
    let (_, report) = fuse_and_compare(&g, 0.0);
    assert_eq!(report.groups, 1);
    assert_eq!((report.kernels_before, report.kernels_after), (2, 1));
}

#[test]
fn smaller_producers_are_not_recomputed_per_element() {
    // The [8] bias computation would run 4 times per element inside a [4,8] kernel.
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    let bias = f32_input(&b, "b", &[8]);
    let bb = bias.sin().mul_scalar(3.0);
    b.output("y", &x.add(&bb).tanh());
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 1e-6);
    assert_eq!(report.groups, 2);
    let yid = out_node(&f, "y");
    assert_eq!(f.node(yid).unwrap().inputs[1], bb.id().unwrap());
    assert_eq!(kernel(&f, bb.id().unwrap()).out.shape.dims(), &[8]);
}

#[test]
fn mixed_dtypes_where_and_casts() {
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[3, 5]);
    let y = f32_input(&b, "y", &[3, 5]);
    let c = x.gt(&y);
    let m = b.where_(&c, &x.cast(DType::F64).sin().cast(DType::F32), &y.neg());
    let h = m.cast(DType::F16).mul_scalar(0.25).cast(DType::F32).add(&x);
    b.output("h", &h);
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 2e-3);
    assert_eq!(report.groups, 1);
    assert_eq!(report.kernels_after, 1, "{}", describe_groups(&f));
}

#[test]
fn half_precision_chains_agree_within_their_tolerance() {
    // Fused kernels round once at the end, the unfused ops after each op: the two agree within
    // the dtype's tolerance.
    for dt in [DType::F16, DType::BF16] {
        let b = GraphBuilder::new();
        let x = b.input("x", dt, [6, 10]);
        let w = b.input("w", dt, [10]);
        b.output("y", &x.mul(&w).sigmoid().add_scalar(0.5));
        let g = b.graph().unwrap();
        let (f, report) = fuse_and_compare(&g, 2.0 * rustytorch_ops::testing::tolerance(dt));
        assert_eq!(report.groups, 1);
        assert_eq!(f.ty(out_node(&f, "y")).dtype, dt);
    }
}

#[test]
fn fusion_is_idempotent() {
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    let s = x.sin().cos().sum(&[1], true);
    b.output("y", &x.sub(&s).exp().neg());
    let g = b.graph().unwrap();
    let (f, _) = fuse(&g).unwrap();
    let (f2, r2) = fuse(&f).unwrap();
    assert_eq!(r2.groups, 0);
    assert_eq!(describe_groups(&f), describe_groups(&f2));
}

#[test]
fn mlp_forward_fuses_bias_and_activation() {
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[8, 16]);
    let w1 = b.param(
        "w1",
        [16, 32],
        rustytorch_compiler::Init::kaiming_uniform(16, 1),
    );
    let b1 = b.param(
        "b1",
        [32],
        rustytorch_compiler::Init::kaiming_uniform(16, 2),
    );
    let w2 = b.param(
        "w2",
        [32, 4],
        rustytorch_compiler::Init::kaiming_uniform(32, 3),
    );
    let h = x.linear(&w1, Some(&b1)).gelu_tanh();
    let y = h.matmul(&w2).sigmoid().mul_scalar(2.0);
    b.output("y", &y);
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 1e-5);
    assert_eq!(report.groups, 2);
    assert_eq!(count(&f, |op| matches!(op, Op::Matmul { .. })), 2);
    assert_eq!(report.kernels_after, 4);
}

#[test]
fn adamw_training_step_fuses_to_the_same_updates() {
    use rustytorch_compiler::optim::{AdamW, StepOptions};
    use rustytorch_compiler::Init;
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[8, 12]);
    let y = b.input("y", DType::I64, [8]);
    let w1 = b.param("w1", [12, 16], Init::kaiming_uniform(12, 1));
    let b1 = b.param("b1", [16], Init::kaiming_uniform(12, 2));
    let w2 = b.param("w2", [16, 5], Init::kaiming_uniform(16, 3));
    let logits = x.linear(&w1, Some(&b1)).gelu().matmul(&w2);
    let loss = logits.cross_entropy(&y);
    b.output("loss", &loss);
    let opts = StepOptions {
        clip_norm: Some(0.5),
        ..Default::default()
    };
    b.train_step(&loss, AdamW::new(1e-2).weight_decay(0.1), &opts)
        .unwrap();
    let g = b.graph().unwrap();
    let (f, report) = fuse(&g).unwrap();
    assert!(report.groups >= 6, "{report}");
    assert!(report.kernels_after < report.kernels_before, "{report}");
    let mut fd = feeds(&g, 11);
    // Class targets in 0..5 (the random feed would give out-of-range values).
    fd.insert(
        "y".into(),
        HostTensor::from_vec(vec![0i64, 4, 2, 1, 3, 3, 0, 2], [8]).unwrap(),
    );
    let want = run(&g, &fd);
    let got = run(&f, &fd);
    assert_eq!(want.len(), 1 + g.updates.len() + g.guards.len());
    for (k, (w, o)) in want.iter().zip(&got).enumerate() {
        assert_eq!(w.ty(), o.ty());
        assert_close(&o.to_f64_vec(), &w.to_f64_vec(), 1e-5, &format!("root {k}"));
    }
    // The parameters really move.
    let p0 = g.params[0].init.materialize(&g.params[0].ty).unwrap();
    let u0 = g.updates.iter().position(|u| u.0 == 0).unwrap();
    assert_ne!(want[1 + u0].to_f64_vec(), p0.to_f64_vec());
    eprintln!("{report}");
}

// ---- property: random DAGs compute the same values fused and unfused ----

#[derive(Clone, Debug)]
enum Step {
    Unary(u8, usize),
    Binary(u8, usize, usize),
    Scalar(u8, usize, i8),
    Reduce(bool, usize),
    Where(usize, usize, usize),
    Cast(usize),
    Expand(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u8..7, any::<usize>()).prop_map(|(k, a)| Step::Unary(k, a)),
        (0u8..4, any::<usize>(), any::<usize>()).prop_map(|(k, a, b)| Step::Binary(k, a, b)),
        (0u8..3, any::<usize>(), -4i8..4).prop_map(|(k, a, c)| Step::Scalar(k, a, c)),
        (any::<bool>(), any::<usize>()).prop_map(|(m, a)| Step::Reduce(m, a)),
        (any::<usize>(), any::<usize>(), any::<usize>()).prop_map(|(c, a, b)| Step::Where(c, a, b)),
        any::<usize>().prop_map(Step::Cast),
        any::<usize>().prop_map(Step::Expand),
    ]
}

/// Builds a random f32 DAG over [4,6] and [4,1] values; `outs` picks extra outputs.
fn random_graph(steps: &[Step], outs: &[usize]) -> Graph {
    use rustytorch_ops::{BinaryOp, UnaryOp};
    let b = GraphBuilder::new();
    let mut vals = vec![f32_input(&b, "x", &[4, 6]), f32_input(&b, "y", &[4, 6])];
    vals.push(f32_input(&b, "r", &[4, 1]));
    let pick = |vals: &Vec<Tensor>, i: usize| vals[i % vals.len()].clone();
    for s in steps {
        let v = match *s {
            Step::Unary(k, a) => {
                let u = [
                    UnaryOp::Sin,
                    UnaryOp::Tanh,
                    UnaryOp::Sigmoid,
                    UnaryOp::Neg,
                    UnaryOp::Abs,
                    UnaryOp::Relu,
                    UnaryOp::Cos,
                ][k as usize];
                b.apply(Op::Unary(u), &[&pick(&vals, a)])
            }
            Step::Binary(k, a, c) => {
                let o = [
                    BinaryOp::Add,
                    BinaryOp::Sub,
                    BinaryOp::Mul,
                    BinaryOp::Maximum,
                ][k as usize];
                b.apply(Op::Binary(o), &[&pick(&vals, a), &pick(&vals, c)])
            }
            Step::Scalar(k, a, c) => {
                let t = pick(&vals, a);
                let c = c as f64 * 0.25;
                match k {
                    0 => t.add_scalar(c),
                    1 => t.mul_scalar(c),
                    _ => t.minimum_scalar(c),
                }
            }
            Step::Reduce(max, a) => {
                let t = pick(&vals, a);
                if t.dims() == [4, 1] {
                    t.neg()
                } else if max {
                    t.max(&[1], true)
                } else {
                    t.mean(&[1], true)
                }
            }
            Step::Where(c, a, d) => {
                let (x, y) = (pick(&vals, a), pick(&vals, d));
                b.where_(&pick(&vals, c).gt(&x), &x, &y)
            }
            Step::Cast(a) => pick(&vals, a).cast(DType::F16).cast(DType::F32),
            Step::Expand(a) => pick(&vals, a).expand([4, 6]),
        };
        vals.push(v);
    }
    b.output("last", vals.last().unwrap());
    for (k, &o) in outs.iter().enumerate() {
        b.output(&format!("o{k}"), &vals[3 + o % (vals.len() - 3)]);
    }
    b.graph().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_dags_fuse_to_the_same_values(
        steps in prop::collection::vec(step(), 1..24),
        outs in prop::collection::vec(any::<usize>(), 0..3),
    ) {
        let g = random_graph(&steps, &outs);
        let (f, report) = fuse_and_compare(&g, 1e-5);
        prop_assert!(report.kernels_after <= report.kernels_before);
        // Every fused kernel's instructions run over its output shape, and no root was absorbed.
        for r in f.roots() {
            prop_assert!(f.node(r).is_ok());
        }
        let (_, again) = fuse(&f).unwrap();
        prop_assert_eq!(again.groups, 0);
    }
}

#[test]
fn wide_integer_chains_stay_exact() {
    // 64-bit integers are beyond f32's (and f64's) exact range: fusing them would round.
    let b = GraphBuilder::new();
    let x = b.input("x", DType::I64, [5]);
    let big = b.scalar(((1i64 << 40) + 1) as f64, DType::I64);
    let y = x.mul(&big).add(&x).sub(&big);
    let z = y.gt(&x).logical_not();
    b.output("y", &y);
    b.output("z", &z);
    let g = b.graph().unwrap();
    let (f, report) = fuse(&g).unwrap();
    assert_eq!(report.groups, 0);
    let fd: HashMap<String, HostTensor> = [(
        "x".to_string(),
        HostTensor::from_vec(vec![3i64, -7, 123456789, 1 << 30, 5], [5]).unwrap(),
    )]
    .into();
    let want = run(&g, &fd);
    let got = run(&f, &fd);
    assert_eq!(
        want[0].to_vec::<i64>().unwrap(),
        got[0].to_vec::<i64>().unwrap()
    );
    assert_eq!(want[1].to_f64_vec(), got[1].to_f64_vec());
}

#[test]
fn expanded_fill_becomes_an_immediate() {
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    let half = b
        .full(0.5, TensorType::new(DType::F32, [1, 8]))
        .expand([4, 8]);
    b.output("y", &x.mul(&half).exp());
    let g = b.graph().unwrap();
    let (f, report) = fuse_and_compare(&g, 1e-6);
    assert_eq!((report.expands_absorbed, report.immediates), (1, 1));
    let yid = out_node(&f, "y");
    assert_eq!(f.node(yid).unwrap().inputs, vec![x.id().unwrap()]);
    // Only the input and the kernel are left.
    assert_eq!(f.live_order().len(), 2);
}

#[test]
fn row_ops_take_prologues_and_epilogues() {
    // layer_norm(x + y) · 0.5 + z: the sum is the norm's prologue, the affine its epilogue.
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    let y = f32_input(&b, "y", &[4, 8]);
    let z = f32_input(&b, "z", &[4, 8]);
    let out = x
        .add(&y)
        .layer_norm(None, None, 1e-5)
        .mul_scalar(0.5)
        .add(&z);
    b.output("out", &out);
    let (f, report) = fuse_and_compare(&b.graph().unwrap(), 1e-6);
    assert_eq!((report.rows, report.prologues, report.epilogues), (1, 1, 1));
    assert_eq!(report.kernels_after, 1);
    let id = out_node(&f, "out");
    assert_eq!(
        id,
        out.id().unwrap(),
        "the epilogue's node keeps the output"
    );
    assert_eq!(
        f.node(id).unwrap().inputs,
        vec![x.id().unwrap(), y.id().unwrap(), z.id().unwrap()]
    );
}

#[test]
fn row_ops_leave_shared_and_broadcast_neighbours() {
    // The sum is also an output (GPT-2's pre-LN residual), and the consumer of the reduction
    // broadcasts it back to the rows (not of its shape): neither joins.
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    let a = f32_input(&b, "a", &[4, 8]);
    let h = x.add(&a);
    b.output("h", &h);
    let n = h.rms_norm(None, 1e-6);
    b.output("n", &n);
    let m = x.sum(&[1], true);
    b.output("centered", &x.sub(&m).exp());
    let (f, report) = fuse_and_compare(&b.graph().unwrap(), 1e-6);
    assert_eq!(report.rows, 0, "{}", describe_groups(&f));
    // A kernel between two row ops joins the first as its epilogue, not the second as its
    // prologue: softmax(softmax(x) · 2).
    let b = GraphBuilder::new();
    let x = f32_input(&b, "x", &[4, 8]);
    b.output("s", &x.softmax(-1).mul_scalar(2.0).softmax(-1));
    let (f, report) = fuse_and_compare(&b.graph().unwrap(), 1e-6);
    assert_eq!((report.rows, report.prologues, report.epilogues), (1, 0, 1));
    assert_eq!(count(&f, |op| matches!(op, Op::FusedRow(_))), 1);
    assert_eq!(count(&f, |op| matches!(op, Op::Softmax { .. })), 1);
}
