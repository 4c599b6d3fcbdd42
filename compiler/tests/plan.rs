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
    assert!(p.arena_bytes <= p.naive_bytes, "{p}");
    assert_eq!(p.schedule, g.live_order());
    // Every computed value has a slot; provided buffers do not.
    for &n in &p.schedule {
        let op = &g.node(n).unwrap().op;
        let provided = matches!(
            op,
            Op::Input { .. } | Op::Param { .. } | Op::Constant { .. }
        );
        assert_eq!(
            p.slot(n).is_none(),
            provided,
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
    // The scalar of mul_scalar takes one aligned slot beside the chain.
    assert!(p.arena_bytes <= 2 * one, "{p:#}");
    assert_eq!(p.arena_bytes, one + ALIGN, "{p:#}");
    assert!(p.inplace_count() >= 5, "{p:#}");
    assert!(p.naive_bytes >= 7 * one);
}

#[test]
fn non_elementwise_chain_ping_pongs() {
    // Reshapes and permutes never alias: two buffers alternate.
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
        s.starts_with("memory plan: 3 steps, 2 values (1 in place), arena 256 bytes"),
        "{s}"
    );
    let long = format!("{p:#}");
    assert!(long.contains("(in place of %1)"), "{long}");
}

// ---- property: random DAGs of elementwise and reduce ops always get valid plans ----

#[derive(Clone, Debug)]
enum Step {
    Unary(usize),
    Binary(usize, usize),
    Reduce(usize),
    Cast(usize),
    Reshape(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        any::<usize>().prop_map(Step::Unary),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Step::Binary(a, b)),
        any::<usize>().prop_map(Step::Reduce),
        any::<usize>().prop_map(Step::Cast),
        any::<usize>().prop_map(Step::Reshape),
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
        prop_assert!(p.arena_bytes <= p.naive_bytes);
        let (f, _) = fuse(&g).unwrap();
        let pf = plan(&f).unwrap();
        prop_assert!(pf.check().is_ok(), "{:?}\n{:#}", pf.check(), pf);
    }
}
