//! Scheduling and static memory planning: plans are valid (no two live values share bytes), pack
//! below one-buffer-per-value, and reuse memory along elementwise chains.

use proptest::prelude::*;
use rustytorch_compiler::fuse::fuse;
use rustytorch_compiler::optim::{AdamW, StepOptions};
use rustytorch_compiler::plan::{plan, MemoryPlan, ALIGN};
use rustytorch_compiler::{Graph, GraphBuilder, Init, Tensor};
use rustytorch_ops::{Causal, DType, Op};

fn checked(g: &Graph) -> MemoryPlan {
    let p = plan(g).unwrap();
    p.check().unwrap_or_else(|e| panic!("{e}\n{p:#}"));
    p.check_uses(g).unwrap_or_else(|e| panic!("{e}\n{p:#}"));
    assert!(p.arena_bytes <= p.naive_bytes, "{p}");
    if p.groups.is_empty() {
        assert_eq!(p.schedule, g.live_order());
    } else {
        // Sibling groups move members next to each other: the same nodes, still topological.
        let mut a = p.schedule.clone();
        let mut b = g.live_order();
        a.sort();
        b.sort();
        assert_eq!(a, b);
        let at: std::collections::HashMap<_, _> = p
            .schedule
            .iter()
            .enumerate()
            .map(|(t, &n)| (n, t))
            .collect();
        for (t, &n) in p.schedule.iter().enumerate() {
            for i in &g.node(n).unwrap().inputs {
                assert!(at[i] < t, "%{} before its operand", n.index());
            }
        }
    }
    // Every computed value has a slot unless it is a reshape-like alias of its operand; provided
    // buffers (leaves, generators included) have neither.
    for &n in &p.schedule {
        let node = g.node(n).unwrap();
        let op = &node.op;
        let provided = matches!(
            op,
            Op::Input { .. }
                | Op::Param { .. }
                | Op::Constant { .. }
                | Op::Full { .. }
                | Op::Iota { .. }
                | Op::RandUniform { .. }
                | Op::RandNormal { .. }
        );
        let alias = match op {
            Op::Reshape { .. } => true,
            Op::Expand { .. } => g.ty(node.inputs[0]).shape.numel() == node.ty.shape.numel(),
            _ => false,
        };
        assert_eq!(
            p.slot(n).is_none(),
            provided || alias,
            "%{} ({})",
            n.index(),
            op.name()
        );
        assert_eq!(
            p.aliases.get(&n),
            alias.then(|| &node.inputs[0]),
            "%{} ({})",
            n.index(),
            op.name()
        );
    }
    // Roots live past the final step.
    let end = p.schedule.len();
    for r in g.roots() {
        if let Some(s) = p.slot(r) {
            assert_eq!(s.last, end);
        }
    }
    p
}

fn mlp() -> (GraphBuilder, Tensor) {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [16, 32]);
    let y = b.input("y", DType::I64, [16]);
    let w1 = b.param("w1", [32, 64], Init::kaiming_uniform(32, 1));
    let b1 = b.param("b1", [64], Init::zeros());
    let w2 = b.param("w2", [64, 10], Init::kaiming_uniform(64, 2));
    let b2 = b.param("b2", [10], Init::zeros());
    let logits = x.linear(&w1, Some(&b1)).gelu().linear(&w2, Some(&b2));
    let loss = logits.cross_entropy(&y);
    b.output("loss", &loss);
    (b, loss)
}

/// A pre-norm transformer block: attention and an MLP, each with a residual.
fn transformer_block() -> GraphBuilder {
    let (bsz, seq, d, heads) = (2, 8, 32, 4);
    let hd = d / heads;
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [bsz, seq, d]);
    let p = |name: &str, dims: &[usize], fan: usize, seed: u64| {
        b.param(name, dims.to_vec(), Init::kaiming_uniform(fan, seed))
    };
    let ln1w = b.param("ln1.w", [d], Init::ones());
    let ln1b = b.param("ln1.b", [d], Init::zeros());
    let wq = p("wq", &[d, d], d, 1);
    let wk = p("wk", &[d, d], d, 2);
    let wv = p("wv", &[d, d], d, 3);
    let wo = p("wo", &[d, d], d, 4);
    let ln2w = b.param("ln2.w", [d], Init::ones());
    let w1 = p("w1", &[d, 4 * d], d, 5);
    let b1 = b.param("b1", [4 * d], Init::zeros());
    let w2 = p("w2", &[4 * d, d], 4 * d, 6);
    let heads_of = |t: Tensor| t.reshape([bsz, seq, heads, hd]).permute(&[0, 2, 1, 3]);
    let h = x.layer_norm(Some(&ln1w), Some(&ln1b), 1e-5);
    let (q, k, v) = (
        heads_of(h.matmul(&wq)),
        heads_of(h.matmul(&wk)),
        heads_of(h.matmul(&wv)),
    );
    let a = q
        .attention(&k, &v, None, Causal::TopLeft, None)
        .permute(&[0, 2, 1, 3])
        .reshape([bsz, seq, d]);
    let x1 = x.add(&a.matmul(&wo));
    let h2 = x1.rms_norm(Some(&ln2w), 1e-5);
    let m = h2.linear(&w1, Some(&b1)).gelu_tanh().matmul(&w2);
    let y = x1.add(&m.mul_scalar(0.5));
    b.output("y", &y);
    b.output("x1", &x1);
    b
}

#[test]
fn mlp_forward_plan() {
    let (b, _) = mlp();
    let g = b.graph().unwrap();
    let p = checked(&g);
    assert!(p.arena_bytes < p.naive_bytes, "{p}");
}

#[test]
fn mlp_training_step_plan_before_and_after_fusion() {
    let (b, loss) = mlp();
    b.train_step(&loss, AdamW::new(1e-3), &StepOptions::default())
        .unwrap();
    let g = b.graph().unwrap();
    assert!(!g.updates.is_empty() && !g.guards.is_empty());
    let p = checked(&g);
    assert!(p.inplace_count() > 0, "{p:#}");
    let (f, _) = fuse(&g).unwrap();
    let pf = checked(&f);
    assert!(pf.naive_bytes < p.naive_bytes, "fused {pf}\nunfused {p}");
    // Updates and guards live past the final step.
    let end = pf.schedule.len();
    for u in f
        .updates
        .iter()
        .map(|u| u.1)
        .chain(f.guards.iter().map(|g| g.1))
    {
        if let Some(s) = pf.slot(u) {
            assert_eq!(s.last, end);
        }
    }
}

#[test]
fn transformer_block_plan() {
    let g = transformer_block().graph().unwrap();
    let p = checked(&g);
    assert!(p.arena_bytes < p.naive_bytes, "{p}");
    let (f, _) = fuse(&g).unwrap();
    checked(&f);
}

#[test]
fn elementwise_chain_runs_in_place() {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [64, 64]);
    let y = x.exp().tanh().sigmoid().neg().abs().mul_scalar(3.0).sin();
    b.output("y", &y);
    let g = b.graph().unwrap();
    let p = checked(&g);
    let one = 64 * 64 * 4;
    // The scalar of mul_scalar is a generator leaf (a provided constant): the chain takes one
    // buffer.
    assert_eq!(p.arena_bytes, one, "{p:#}");
    assert!(p.inplace_count() >= 5, "{p:#}");
    assert!(p.naive_bytes >= 7 * one);
}

#[test]
fn non_elementwise_chain_ping_pongs() {
    // Permutes and softmax copy (reshapes alias their operand): two buffers alternate.
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [16, 32]);
    let y = x
        .permute(&[1, 0])
        .reshape([16, 32])
        .permute(&[1, 0])
        .reshape([512])
        .softmax(0);
    b.output("y", &y);
    let g = b.graph().unwrap();
    let p = checked(&g);
    assert_eq!(p.inplace_count(), 0);
    assert_eq!(p.aliases.len(), 2, "{p:#}");
    assert_eq!(p.slots.len(), 3, "{p:#}");
    assert_eq!(p.arena_bytes, 2 * 16 * 32 * 4, "{p:#}");
}

#[test]
fn outputs_and_broadcast_operands_are_not_overwritten() {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [8, 64]);
    let a = x.exp();
    b.output("a", &a);
    let r = x.sum(&[1], true).sin();
    let c = a.tanh().add(&r);
    b.output("c", &c);
    let g = b.graph().unwrap();
    let p = checked(&g);
    let a_id = a.id().unwrap();
    for s in p.slots.values() {
        assert_ne!(s.inplace_of, Some(a_id), "{p:#}");
        assert_ne!(s.inplace_of, Some(r.id().unwrap()), "{p:#}");
    }
    // tanh(a) is not in place (a is an output); add writes over tanh(a), not over r ([8,1]).
    let c_slot = p.slot(c.id().unwrap()).unwrap();
    assert_eq!(
        c_slot.inplace_of,
        Some(g.node(c.id().unwrap()).unwrap().inputs[0])
    );
}

#[test]
fn check_rejects_overlapping_values() {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [8, 64]);
    let a = x.exp();
    let c = a.add(&x.sin());
    b.output("c", &c);
    b.output("a", &a);
    let g = b.graph().unwrap();
    let mut p = checked(&g);
    // a and sin(x) are both live when add runs; make them share bytes.
    let s_id = g.node(c.id().unwrap()).unwrap().inputs[1];
    let off = p.slot(a.id().unwrap()).unwrap().offset;
    p.slots.get_mut(&s_id).unwrap().offset = off;
    assert!(p.check().is_err());
    // A forged in-place claim between values that are not a dying operand and its result.
    let mut p = checked(&g);
    let a_slot = *p.slot(a.id().unwrap()).unwrap();
    let cs = p.slots.get_mut(&c.id().unwrap()).unwrap();
    cs.offset = a_slot.offset;
    cs.inplace_of = Some(a.id().unwrap());
    assert!(p.check().is_err());
    // Misaligned and out-of-arena slots.
    let mut p = checked(&g);
    p.slots.get_mut(&s_id).unwrap().offset += 4;
    assert!(p.check().is_err());
    let mut p = checked(&g);
    p.arena_bytes -= ALIGN;
    assert!(p.check().is_err());
}

#[test]
fn display_summarizes() {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [64]);
    b.output("y", &x.exp().neg());
    let p = checked(&b.graph().unwrap());
    let s = p.to_string();
    assert!(
        s.starts_with("memory plan: 3 steps, 2 values (1 in place), 0 aliases, arena 256 bytes"),
        "{s}"
    );
    let long = format!("{p:#}");
    assert!(long.contains("(in place of %1)"), "{long}");
}

// ---- aliases: reshapes share their operand's bytes ----

/// The schedule step of a value.
fn step_of(p: &MemoryPlan, t: &Tensor) -> usize {
    let id = t.id().unwrap();
    p.schedule.iter().position(|&n| n == id).unwrap()
}

#[test]
fn reshape_chain_aliases_and_its_storage_outlives_it() {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [16, 32]);
    let a = x.exp();
    let r1 = a.reshape([512]);
    let r2 = r1.reshape([32, 16]);
    // Inserts size-1 dims only: an alias too. A real broadcast is not.
    let r3 = r2.unsqueeze(0).expand([1, 32, 16]);
    let wide = r2.reshape([32, 16, 1]).expand([32, 16, 4]);
    let y = r3.softmax(2);
    b.output("y", &y);
    b.output("w", &wide.sum(&[2], false));
    let g = b.graph().unwrap();
    let p = checked(&g);
    let id = |t: &Tensor| t.id().unwrap();
    assert_eq!(p.aliases.get(&id(&r1)), Some(&id(&a)));
    assert_eq!(p.aliases.get(&id(&r2)), Some(&id(&r1)));
    let unsq = g.node(id(&r3)).unwrap().inputs[0];
    assert_eq!(p.aliases.get(&unsq), Some(&id(&r2)));
    assert_eq!(p.aliases.get(&id(&r3)), Some(&unsq));
    assert_eq!(p.storage_root(id(&r3)), id(&a));
    for v in [&r1, &r2, &r3] {
        assert!(p.slot(id(v)).is_none(), "{p:#}");
    }
    assert!(p.slot(id(&wide)).is_some(), "{p:#}");
    assert!(!p.aliases.contains_key(&id(&wide)));
    // The storage root lives until the last read through any alias, not just its own last use
    // (the reshape right after it).
    let a_slot = p.slot(id(&a)).unwrap();
    let last_read = step_of(&p, &y).max(step_of(&p, &wide));
    assert_eq!(a_slot.last, last_read, "{p:#}");
    assert!(step_of(&p, &r1) < a_slot.last);
    let s = format!("{p:#}");
    assert!(s.contains(&format!("alias of %{}", id(&a).index())), "{s}");
}

#[test]
fn an_alias_read_late_keeps_its_storage_from_being_reused() {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [64, 64]);
    let a = x.exp();
    let r = a.reshape([4096]);
    // Scheduled after r: without the group lifetime, `a` would be dead here (its only reader is
    // the reshape) and sin(x), the same size, would take its bytes while r still reads them.
    let s = x.sin();
    let y = r.add(&s.reshape([4096]));
    b.output("y", &y);
    let g = b.graph().unwrap();
    let p = checked(&g);
    let (ta, tr, ts, ty) = (
        step_of(&p, &a),
        step_of(&p, &r),
        step_of(&p, &s),
        step_of(&p, &y),
    );
    assert!(ta < tr && tr < ts && ts < ty, "{p:#}");
    let a_slot = *p.slot(a.id().unwrap()).unwrap();
    let s_slot = *p.slot(s.id().unwrap()).unwrap();
    assert_eq!(a_slot.last, ty, "{p:#}");
    assert_ne!(s_slot.offset, a_slot.offset, "{p:#}");
    // Both groups die at the add, which writes over one of them in place.
    let y_slot = p.slot(y.id().unwrap()).unwrap();
    assert_eq!(y_slot.inplace_of, Some(a.id().unwrap()), "{p:#}");
    assert_eq!(p.arena_bytes, 2 * 64 * 64 * 4, "{p:#}");
}

#[test]
fn a_reshape_of_an_input_aliases_the_provided_buffer() {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [8, 64]);
    let w = b.param("w", [512], Init::zeros());
    let r = x.reshape([512]);
    let y = r.add(&w).exp();
    b.output("y", &y);
    b.output("r", &r);
    let g = b.graph().unwrap();
    let p = checked(&g);
    let (xi, ri) = (x.id().unwrap(), r.id().unwrap());
    assert_eq!(p.aliases.get(&ri), Some(&xi));
    assert_eq!(p.storage_root(ri), xi);
    assert!(p.slot(xi).is_none() && p.slot(ri).is_none(), "{p:#}");
    // Nothing writes over a provided buffer through its alias: the add takes a fresh buffer
    // (and exp then writes over the add's).
    let sum = g.node(y.id().unwrap()).unwrap().inputs[0];
    assert_eq!(p.slot(sum).unwrap().inplace_of, None, "{p:#}");
    assert_eq!(p.slot(y.id().unwrap()).unwrap().inplace_of, Some(sum));
    assert_eq!(p.arena_bytes, 512 * 4, "{p:#}");
}

#[test]
fn a_reshape_that_is_an_output_keeps_its_storage_to_the_end() {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [8, 64]);
    let a = x.exp();
    let r = a.reshape([512]);
    b.output("r", &r);
    // a's last own reader; tanh would write over it in place if r were not read after the run.
    let c = a.tanh();
    b.output("c", &c);
    let g = b.graph().unwrap();
    let p = checked(&g);
    let end = p.schedule.len();
    assert_eq!(p.aliases.get(&r.id().unwrap()), a.id().as_ref());
    let a_slot = p.slot(a.id().unwrap()).unwrap();
    assert_eq!(a_slot.last, end, "{p:#}");
    let c_slot = p.slot(c.id().unwrap()).unwrap();
    assert_eq!(c_slot.inplace_of, None, "{p:#}");
    assert_ne!(c_slot.offset, a_slot.offset, "{p:#}");
}

#[test]
fn no_in_place_write_over_storage_an_alias_still_reads() {
    // The alias is made before and after the elementwise op that is its storage's last own
    // reader; either way the op may not write over it.
    for alias_first in [true, false] {
        let b = GraphBuilder::new();
        let x = b.input("x", DType::F32, [64, 64]);
        let a = x.exp();
        let r = a.reshape([64, 64, 1]);
        let c = a.tanh();
        let back = r.reshape([64, 64]);
        let y = if alias_first {
            back.add(&c)
        } else {
            c.add(&back)
        };
        b.output("y", &y);
        let g = b.graph().unwrap();
        let p = checked(&g);
        let (tc, tr) = (step_of(&p, &c), step_of(&p, &r));
        assert_eq!(tc < tr, !alias_first, "{p:#}");
        let a_id = a.id().unwrap();
        let c_slot = p.slot(c.id().unwrap()).unwrap();
        assert_eq!(c_slot.inplace_of, None, "{p:#}");
        assert_ne!(c_slot.offset, p.slot(a_id).unwrap().offset, "{p:#}");
        // At the add both groups die: it runs in place over one of them.
        let y_slot = p.slot(y.id().unwrap()).unwrap();
        assert!(y_slot.inplace_of.is_some(), "{p:#}");
    }
    // Control: with no alias, tanh runs in place over exp.
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [64, 64]);
    let a = x.exp();
    let c = a.tanh();
    b.output("y", &c);
    let p = checked(&b.graph().unwrap());
    assert_eq!(p.slot(c.id().unwrap()).unwrap().inplace_of, a.id(), "{p:#}");
}

#[test]
fn generator_leaves_have_no_slot() {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [4, 8]);
    let ty = rustytorch_ops::TensorType::new(DType::F32, [4, 8]);
    let gens = [
        b.full(2.0, ty.clone()),
        b.iota(1, ty.clone()),
        b.rand_uniform(0.0, 1.0, 7, ty.clone()),
        b.rand_normal(0.0, 1.0, 8, ty),
    ];
    let mut y = x.mul_scalar(0.5);
    for t in &gens {
        y = y.add(t);
    }
    b.output("y", &y);
    b.output("noise", &gens[3]);
    let g = b.graph().unwrap();
    let p = checked(&g);
    for t in &gens {
        assert!(p.slot(t.id().unwrap()).is_none(), "{p:#}");
    }
    // The chain of adds runs in one buffer.
    assert_eq!(p.arena_bytes, ALIGN, "{p:#}");
}

#[test]
fn check_rejects_broken_aliases() {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [8, 64]);
    let a = x.exp();
    let r = a.reshape([512]);
    let y = r.softmax(0);
    b.output("y", &y);
    let g = b.graph().unwrap();
    let good = checked(&g);
    let (ai, ri) = (a.id().unwrap(), r.id().unwrap());
    // An alias with a slot of its own.
    let mut p = good.clone();
    let s = *p.slot(ai).unwrap();
    p.slots.insert(ri, s);
    assert!(p.check().is_err());
    // An alias of a value scheduled after it, and of one not scheduled at all.
    let mut p = good.clone();
    p.aliases.insert(ri, y.id().unwrap());
    assert!(p.check().is_err());
    let mut p = good.clone();
    p.aliases.insert(y.id().unwrap(), ri);
    p.slots.remove(&y.id().unwrap());
    p.aliases.insert(ri, x.id().unwrap());
    assert!(p.check().is_ok());
    p.schedule.retain(|&n| n != x.id().unwrap());
    assert!(p.check().is_err());
    // Storage that dies before its alias is read.
    let mut p = good.clone();
    let t = step_of(&p, &r);
    p.slots.get_mut(&ai).unwrap().last = t;
    assert!(
        p.check().is_ok(),
        "defined while live: only the uses show it"
    );
    assert!(p.check_uses(&g).is_err());
    p.slots.get_mut(&ai).unwrap().last = t - 1;
    assert!(p.check().is_err());
    // A computed value with neither a slot nor an alias.
    let mut p = good;
    p.aliases.remove(&ri);
    assert!(p.check().is_ok());
    assert!(p.check_uses(&g).is_err());
}

// ---- property: random DAGs of elementwise and reduce ops always get valid plans ----

#[derive(Clone, Debug)]
enum Step {
    Unary(usize),
    Binary(usize, usize),
    Reduce(usize),
    Cast(usize),
    Reshape(usize),
    View(usize, u8),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        any::<usize>().prop_map(Step::Unary),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Step::Binary(a, b)),
        any::<usize>().prop_map(Step::Reduce),
        any::<usize>().prop_map(Step::Cast),
        any::<usize>().prop_map(Step::Reshape),
        (any::<usize>(), 0u8..3).prop_map(|(a, k)| Step::View(a, k)),
    ]
}

fn random_graph(steps: &[Step], outs: &[usize], dims: (usize, usize)) -> Graph {
    let b = GraphBuilder::new();
    let (m, n) = dims;
    let mut vals = vec![
        b.input("x", DType::F32, [m, n]),
        b.input("y", DType::F32, [m, n]),
    ];
    let pick = |vals: &Vec<Tensor>, i: usize| vals[i % vals.len()].clone();
    for s in steps {
        let v = match *s {
            Step::Unary(a) => pick(&vals, a).tanh(),
            Step::Binary(a, c) => pick(&vals, a).mul(&pick(&vals, c)),
            Step::Reduce(a) => {
                let t = pick(&vals, a);
                if t.dims()[1] == 1 {
                    t.sin()
                } else {
                    t.sum(&[1], true)
                }
            }
            Step::Cast(a) => pick(&vals, a).cast(DType::F16).cast(DType::F32),
            Step::Reshape(a) => {
                let t = pick(&vals, a);
                let d = t.dims();
                t.reshape(d).exp()
            }
            // Aliases of any value, kept for later steps and outputs to read.
            Step::View(a, k) => {
                let t = pick(&vals, a);
                let d = t.dims();
                match k {
                    0 => t.reshape(d.clone()),
                    1 => t.reshape([d[0] * d[1]]).reshape(d.clone()),
                    _ => t.unsqueeze(0).expand([1, d[0], d[1]]).reshape(d.clone()),
                }
            }
        };
        vals.push(v);
    }
    b.output("last", vals.last().unwrap());
    for (k, &o) in outs.iter().enumerate() {
        b.output(&format!("o{k}"), &vals[2 + o % (vals.len() - 2)]);
    }
    b.graph().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_dags_get_valid_plans(
        steps in prop::collection::vec(step(), 1..40),
        outs in prop::collection::vec(any::<usize>(), 0..4),
        dims in (1usize..40, 1usize..40),
    ) {
        let g = random_graph(&steps, &outs, dims);
        let p = plan(&g).unwrap();
        prop_assert!(p.check().is_ok(), "{:?}\n{:#}", p.check(), p);
        prop_assert!(p.check_uses(&g).is_ok(), "{:?}\n{:#}", p.check_uses(&g), p);
        prop_assert!(p.arena_bytes <= p.naive_bytes);
        let (f, _) = fuse(&g).unwrap();
        let pf = plan(&f).unwrap();
        prop_assert!(pf.check().is_ok(), "{:?}\n{:#}", pf.check(), pf);
        prop_assert!(pf.check_uses(&f).is_ok(), "{:?}\n{:#}", pf.check_uses(&f), pf);
    }
}
