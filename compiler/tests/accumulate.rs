//! The accumulate pass: which adds fold into a matmul's accumulated operand, which must not, and
//! that folded graphs compute what the unfolded graphs compute (CPU, node by node, against f64).

use rustytorch_compiler::accumulate::accumulate;
use rustytorch_compiler::{Graph, GraphBuilder, NodeId, Tensor};
use rustytorch_ops::testing::{assert_close, rand_tensor};
use rustytorch_ops::{eval_cpu, Activation, DType, HostTensor, Op};
use std::collections::HashMap;

/// Evaluates `g` on the CPU node by node; returns its outputs in order.
fn run(g: &Graph, feeds: &HashMap<String, HostTensor>) -> Vec<HostTensor> {
    let mut vals: HashMap<NodeId, HostTensor> = HashMap::new();
    for n in g.live_order() {
        let node = g.node(n).unwrap();
        let v = match &node.op {
            Op::Input { index, .. } => feeds[&g.inputs[*index as usize].name].clone(),
            op => {
                let ins: Vec<&HostTensor> = node.inputs.iter().map(|i| &vals[i]).collect();
                eval_cpu(op, &ins).unwrap_or_else(|e| panic!("%{}: {e}", n.index()))
            }
        };
        assert_eq!(v.ty(), node.ty, "%{} ({})", n.index(), node.op.name());
        vals.insert(n, v);
    }
    g.output_nodes().iter().map(|n| vals[n].clone()).collect()
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

/// The inputs cast to f64, for the reference run of the same graph built in f64.
fn widen(f: &HashMap<String, HostTensor>) -> HashMap<String, HostTensor> {
    f.iter()
        .map(|(k, v)| {
            let w = HostTensor::from_vec(v.to_f64_vec(), v.dims().to_vec()).unwrap();
            (k.clone(), w)
        })
        .collect()
}

fn count(g: &Graph, pred: impl Fn(&Op) -> bool) -> usize {
    g.node_ids()
        .into_iter()
        .filter(|&n| pred(&g.node(n).unwrap().op))
        .count()
}

fn accumulating(op: &Op) -> bool {
    matches!(
        op,
        Op::MatmulEpilogue {
            accumulate: true,
            ..
        }
    )
}

fn is_add(op: &Op) -> bool {
    op.name() == "add"
}

/// A residual block `x + (x·W + b)` and a gradient-shaped sum `g1·W1ᵀ + g2·W2ᵀ + g3·W3ᵀ`.
fn residual_and_chain(dt: DType) -> Graph {
    let b = GraphBuilder::new();
    let x = b.input("x", dt, vec![2, 6, 16]);
    let w = b.input("w", dt, vec![16, 16]);
    let bias = b.input("b", dt, vec![16]);
    let y = x.add(&x.matmul(&w).add(&bias));
    b.output("residual", &y);
    let mut sum: Option<Tensor> = None;
    for i in 0..3 {
        let g = b.input(&format!("g{i}"), dt, vec![12, 24]);
        let wi = b.input(&format!("w{i}"), dt, vec![16, 24]);
        let t = g.matmul(&wi.t());
        sum = Some(match sum {
            None => t,
            Some(s) => s.add(&t),
        });
    }
    b.output("chain", &sum.unwrap());
    b.graph().unwrap()
}

/// Folded graphs against the same graph in f64 (and the unfolded one's types), f32/bf16/f64.
#[test]
fn residuals_and_gradient_chains_fold() {
    for dt in [DType::F32, DType::BF16, DType::F64] {
        let g = residual_and_chain(dt);
        let (f, rep) = accumulate(&g).unwrap();
        f.verify().unwrap();
        // The chain's two adds fold. The residual does not: its bias is an `expand` (the
        // optimizer makes it the matmul's epilogue first, next test), and its outer add has the
        // bias add, not a matmul, on its side.
        assert_eq!(rep.folded, 2, "{dt}");
        assert_eq!(count(&f, accumulating), 2);
        assert_eq!(count(&f, |op| matches!(op, Op::Matmul { .. })), 2);
        let fd = feeds(&g, 7);
        let want = run(&residual_and_chain(DType::F64), &widen(&fd));
        let (got, plain) = (run(&f, &fd), run(&g, &fd));
        let tol = match dt {
            DType::BF16 => 2e-2,
            DType::F32 => 1e-5,
            _ => 1e-12,
        };
        for ((g, p), w) in got.iter().zip(&plain).zip(&want) {
            assert_eq!(g.ty(), p.ty());
            assert_close(&g.to_f64_vec(), &w.to_f64_vec(), tol, &format!("{dt}"));
        }
    }
}

/// `x + matmul_epilogue(a, W, b)` (the optimizer's linear layer) folds into one accumulating
/// epilogue with the bias, which reads x as its C.
#[test]
fn a_linear_layer_takes_its_residual() {
    let mut g = Graph::new();
    let ty = |d: &[usize]| rustytorch_ops::TensorType::new(DType::F32, d.to_vec());
    let x = g.add_input("x", ty(&[8, 16])).unwrap();
    let w = g.add_input("w", ty(&[16, 16])).unwrap();
    let b = g.add_input("b", ty(&[16])).unwrap();
    let lin = g
        .add(
            Op::MatmulEpilogue {
                trans_a: false,
                trans_b: false,
                bias: true,
                act: Activation::None,
                accumulate: false,
            },
            &[x, w, b],
        )
        .unwrap();
    let y = g
        .add(Op::Binary(rustytorch_ops::BinaryOp::Add), &[x, lin])
        .unwrap();
    g.add_output("y", y).unwrap();
    let (f, rep) = accumulate(&g).unwrap();
    assert_eq!(rep.folded, 1);
    let node = f.node(f.output_nodes()[0]).unwrap();
    assert!(accumulating(&node.op));
    assert_eq!(node.inputs, vec![x, w, b, x]);
    assert_eq!(count(&f, is_add), 0);
    let fd = feeds(&g, 3);
    assert_close(
        &run(&f, &fd)[0].to_f64_vec(),
        &run(&g, &fd)[0].to_f64_vec(),
        1e-5,
        "linear + residual",
    );
}

/// Nothing folds when the product has another user, is an output, is added to a broadcast, is
/// cast before the add, or carries an activation.
#[test]
fn what_must_not_fold() {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, vec![8, 16]);
    let w = b.input("w", DType::F32, vec![16, 16]);
    let row = b.input("row", DType::F32, vec![1, 16]);
    let h = b.input("h", DType::BF16, vec![8, 16]);
    // Another user.
    let m1 = x.matmul(&w);
    b.output("shared", &m1.add(&x));
    b.output("also", &m1.exp());
    // An output itself.
    let m2 = x.matmul(&w.t());
    b.output("m2", &m2);
    b.output("m2x", &m2.add(&x));
    // Added to a broadcast.
    b.output(
        "bcast",
        &x.matmul(&w).mul_scalar(1.0).add(&row.expand([8, 16])),
    );
    // Cast between the product and the add.
    let hw = b.input("hw", DType::BF16, vec![16, 16]);
    b.output("cast", &h.matmul(&hw).cast(DType::F32).add(&x));
    // An activation epilogue.
    b.output("act", &x.matmul(&w).relu().add(&x));
    let g = b.graph().unwrap();
    let (f, rep) = accumulate(&g).unwrap();
    assert_eq!(rep.folded, 0, "{}", rustytorch_compiler::text::print(&f));
    assert_eq!(count(&f, accumulating), 0);
}
