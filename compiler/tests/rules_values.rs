//! Differential checks of the optimizer's rules on values.
//!
//! Recognition: every primitive spelling a recognition rule accepts is built as a graph and
//! optimized; the rule must fire and the library op appear, and the optimized graph must compute
//! the values of the unoptimized one (both evaluated node by node with the ops crate's CPU
//! kernels) on random inputs of several shapes in f32 and f64 and on the extreme values the op must
//! survive: magnitudes up to ±1e4 and −∞ entries for softmax, −∞ in additive attention masks, ±∞
//! and NaN through GELU and SiLU.
//!
//! Algebra and layout: a table of graphs, one or more per rule, whose inputs are the edge values
//! NaN, ±∞, ±0, negatives, huge and subnormal numbers; each rule must fire on its entry and keep
//! every value (NaN for NaN, the sign of zero), and guarded identities must not fire outside their
//! domain. Both families end with a check that every rule of the family has an entry.
//!
//! The values the optimizer may change on purpose (docs/architecture.md, "What the optimizer may
//! change") are pinned at the end.

use rustytorch_compiler::optimize::rules::{algebra, layout, recognize};
use rustytorch_compiler::optimize::{optimize, OptimizeConfig};
use rustytorch_compiler::{Graph, GraphBuilder, Tensor};
use rustytorch_ops::testing::{assert_close, rand_tensor};
use rustytorch_ops::{eval_cpu, DType, HostTensor, Op, TensorType};
use std::collections::{BTreeSet, HashMap};

// ---------------------------------------------------------------------------------------------
// Evaluation and optimization
// ---------------------------------------------------------------------------------------------

/// Every output of `g`, each node evaluated with the CPU kernels (inputs by index from `feeds`).
fn eval(g: &Graph, feeds: &[HostTensor]) -> Vec<HostTensor> {
    let mut vals: HashMap<_, HostTensor> = HashMap::new();
    for n in g.live_order() {
        let node = g.node(n).unwrap();
        let v = match &node.op {
            Op::Input { index, .. } => feeds[*index as usize].clone(),
            Op::Param { index, .. } => {
                let p = &g.params[*index as usize];
                p.data
                    .clone()
                    .unwrap_or_else(|| p.init.materialize(&p.ty).unwrap())
            }
            Op::Constant { index, .. } => g.constants[*index as usize].clone(),
            op => {
                let ins: Vec<&HostTensor> = node.inputs.iter().map(|i| &vals[i]).collect();
                eval_cpu(op, &ins).unwrap_or_else(|e| panic!("%{} ({op}): {e}", n.index()))
            }
        };
        assert_eq!(v.ty(), node.ty, "%{}", n.index());
        vals.insert(n, v);
    }
    g.outputs.iter().map(|(_, n)| vals[n].clone()).collect()
}

/// The optimized graph, the rules that fired and the op names it holds.
struct Optimized {
    graph: Graph,
    fired: BTreeSet<String>,
    ops: BTreeSet<String>,
}

fn op_names(g: &Graph) -> BTreeSet<String> {
    g.node_ids()
        .into_iter()
        .map(|n| g.node(n).unwrap().op.name().to_string())
        .collect()
}

fn optimized(g: &Graph) -> Optimized {
    let (graph, report) = optimize(g, &OptimizeConfig::default()).unwrap();
    assert!(
        matches!(report.stop_reason, egg::StopReason::Saturated),
        "{:?}",
        report.stop_reason
    );
    let ops = op_names(&graph);
    Optimized {
        graph,
        fired: report.applied.into_iter().map(|(r, _)| r).collect(),
        ops,
    }
}

/// A graph of inputs `x0, x1, ...` typed like `feeds` and the outputs `build` returns.
fn graph_of(
    feeds: &[HostTensor],
    build: &dyn Fn(&GraphBuilder, &[Tensor]) -> Vec<Tensor>,
) -> Graph {
    let gb = GraphBuilder::new();
    let xs: Vec<Tensor> = feeds
        .iter()
        .enumerate()
        .map(|(i, f)| gb.input(&format!("x{i}"), f.dtype(), f.shape().clone()))
        .collect();
    for (i, y) in build(&gb, &xs).iter().enumerate() {
        gb.output(&format!("y{i}"), y);
    }
    gb.graph().unwrap()
}

fn f64s(ts: &[HostTensor]) -> Vec<f64> {
    ts.iter().flat_map(|t| t.to_f64_vec()).collect()
}

fn tensor(dtype: DType, dims: &[usize], vals: &[f64]) -> HostTensor {
    HostTensor::from_f64_slice(&TensorType::new(dtype, dims.to_vec()), vals).unwrap()
}

fn random(dtype: DType, dims: &[usize], seed: u64, lo: f64, hi: f64) -> HostTensor {
    rand_tensor(&TensorType::new(dtype, dims.to_vec()), seed, lo, hi)
}

/// Tolerance of a spelled form against its library op (rounding differs, nothing else).
fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        _ => 2e-5,
    }
}

// ---------------------------------------------------------------------------------------------
// Recognition
// ---------------------------------------------------------------------------------------------

/// Runs spellings through the optimizer and compares values, recording the rules that fired.
#[derive(Default)]
struct Checker {
    /// Only optimize (the coverage check), no evaluation.
    spelling_only: bool,
    fired: BTreeSet<String>,
}

impl Checker {
    /// Builds `build` over `feeds`, asserts that `rule` fired and `op` appears in the optimized
    /// graph (and not in the spelled one), and compares the outputs within `tol`. Returns the
    /// values (spelled, optimized).
    fn check(
        &mut self,
        rule: &str,
        op: &str,
        feeds: &[HostTensor],
        tol: f64,
        build: impl Fn(&GraphBuilder, &[Tensor]) -> Tensor,
    ) -> (Vec<f64>, Vec<f64>) {
        let g = graph_of(feeds, &|gb, xs| vec![build(gb, xs)]);
        // (The transpose folds and the bias fold start from an op of the family already.)
        let from_op = rule.starts_with("matmul-fold")
            || rule.starts_with("conv-")
            || rule == "layer-norm-weight-bias";
        assert!(
            from_op || !op_names(&g).contains(op),
            "{rule}: {op} already spelled"
        );
        let o = optimized(&g);
        let what = format!(
            "{rule} on {:?}",
            feeds.iter().map(|f| f.ty().to_string()).collect::<Vec<_>>()
        );
        assert!(
            o.fired.contains(rule),
            "{what}: did not fire; fired {:?}",
            o.fired
        );
        assert!(o.ops.contains(op), "{what}: no {op} in {:?}", o.ops);
        self.fired.extend(o.fired);
        if self.spelling_only {
            return (Vec::new(), Vec::new());
        }
        let want = f64s(&eval(&g, feeds));
        let got = f64s(&eval(&o.graph, feeds));
        assert_close(&got, &want, tol, &what);
        (want, got)
    }
}

const FLOATS: [DType; 2] = [DType::F32, DType::F64];

/// Values GELU and SiLU must carry through: signs, zeros, saturation, ±∞, NaN.
fn activation_extremes(dtype: DType) -> HostTensor {
    let v = [
        -1e4,
        -80.0,
        -10.0,
        -3.0,
        -0.5,
        -0.0,
        0.0,
        0.5,
        3.0,
        10.0,
        80.0,
        1e4,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        1e-30,
    ];
    tensor(dtype, &[4, 4], &v)
}

fn activation_inputs(dtype: DType) -> Vec<HostTensor> {
    vec![
        random(dtype, &[3, 8], 11, -4.0, 4.0),
        random(dtype, &[2, 3, 5], 12, -8.0, 8.0),
        activation_extremes(dtype),
    ]
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

/// GELU (tanh form) in primitives: `outer` and `inner` index the rule's spellings (see
/// recognize.rs), `cube` picks `pow(x,3)`, `x·x·x` or `x·(x·x)`, `left` writes every constant on
/// the left.
fn gelu_tanh_spelled(
    x: &Tensor,
    outer: usize,
    inner: usize,
    cube: usize,
    left: bool,
    k: f64,
) -> Tensor {
    let c = |v: f64, t: &Tensor| {
        if left {
            t.scalar_like(v).mul(t)
        } else {
            t.mul_scalar(v)
        }
    };
    let x3 = match cube {
        0 => x.pow_scalar(3.0),
        1 => x.mul(x).mul(x),
        _ => x.mul(&x.mul(x)),
    };
    let kx3 = c(k, &x3);
    let sum = if inner == 0 { x.add(&kx3) } else { kx3.add(x) };
    let t = c(SQRT_2_OVER_PI, &sum).tanh();
    let t1 = if left {
        t.scalar_like(1.0).add(&t)
    } else {
        t.add_scalar(1.0)
    };
    match outer {
        0 => c(0.5, x).mul(&t1),
        1 => c(0.5, &x.mul(&t1)),
        2 => x.mul(&c(0.5, &t1)),
        _ => t1.mul(&c(0.5, x)),
    }
}

const GELU_OUTERS: [&str; 4] = ["half-first", "half-last", "half-inner", "tanh-first"];
const GELU_INNERS: [&str; 2] = ["sum-x-first", "sum-x-last"];

fn gelu_cases(ck: &mut Checker) {
    for dtype in FLOATS {
        for (i, feed) in activation_inputs(dtype).into_iter().enumerate() {
            for (o, on) in GELU_OUTERS.iter().enumerate() {
                for (n, inn) in GELU_INNERS.iter().enumerate() {
                    let (cube, left) = ((o + n + i) % 3, (o + i) % 2 == 1);
                    ck.check(
                        &format!("gelu-tanh/{on}/{inn}"),
                        "gelu_tanh",
                        std::slice::from_ref(&feed),
                        tol(dtype),
                        |_, x| gelu_tanh_spelled(&x[0], o, n, cube, left, 0.044715),
                    );
                }
            }
        }
    }
}

#[test]
fn gelu_tanh_spellings_keep_values() {
    gelu_cases(&mut Checker::default());
}

/// GELU (erf form) in primitives: `outer` indexes the rule's outer spellings, `div` writes
/// `erf(x / √2)` instead of `erf(x·(1/√2))`, `left` writes every constant on the left.
fn gelu_erf_spelled(x: &Tensor, outer: usize, div: bool, left: bool) -> Tensor {
    let c = |v: f64, t: &Tensor| {
        if left {
            t.scalar_like(v).mul(t)
        } else {
            t.mul_scalar(v)
        }
    };
    let arg = if div {
        x.div_scalar(std::f64::consts::SQRT_2)
    } else {
        c(std::f64::consts::FRAC_1_SQRT_2, x)
    };
    let e = arg.erf();
    let e1 = if left {
        e.scalar_like(1.0).add(&e)
    } else {
        e.add_scalar(1.0)
    };
    match outer {
        0 => c(0.5, x).mul(&e1),
        1 => c(0.5, &x.mul(&e1)),
        2 => x.mul(&c(0.5, &e1)),
        _ => e1.mul(&c(0.5, x)),
    }
}

fn gelu_erf_cases(ck: &mut Checker) {
    for dtype in FLOATS {
        for (i, feed) in activation_inputs(dtype).into_iter().enumerate() {
            for (o, on) in GELU_OUTERS.iter().enumerate() {
                for (div, inn) in [(false, "mul"), (true, "div")] {
                    let left = (o + i) % 2 == 1;
                    ck.check(
                        &format!("gelu-erf/{on}/{inn}"),
                        "gelu",
                        std::slice::from_ref(&feed),
                        tol(dtype),
                        |_, x| gelu_erf_spelled(&x[0], o, div, left),
                    );
                }
            }
        }
    }
}

#[test]
fn gelu_erf_spellings_keep_values() {
    gelu_erf_cases(&mut Checker::default());
}

fn silu_cases(ck: &mut Checker) {
    for dtype in FLOATS {
        for feed in activation_inputs(dtype) {
            let f = std::slice::from_ref(&feed);
            let t = tol(dtype);
            ck.check("silu", "silu", f, t, |_, x| x[0].mul(&x[0].sigmoid()));
            ck.check("silu-rev", "silu", f, t, |_, x| x[0].sigmoid().mul(&x[0]));
            ck.check("silu-div", "silu", f, t, |_, x| {
                x[0].div(&x[0].neg().exp().add_scalar(1.0))
            });
            ck.check("silu-div", "silu", f, t, |_, x| {
                x[0].div(&x[0].scalar_like(1.0).add(&x[0].neg().exp()))
            });
        }
    }
}

#[test]
fn silu_spellings_keep_values() {
    silu_cases(&mut Checker::default());
}

/// Softmax-family spellings over axis `a`, by rule name.
fn softmax_spelled(rule: &str, x: &Tensor, a: i64) -> Tensor {
    let stable = || x.sub(&x.max(&[a], true));
    match rule {
        "softmax" => {
            let e = stable().exp();
            e.div(&e.sum(&[a], true))
        }
        "softmax-recip" => {
            let e = stable().exp();
            e.mul(&e.sum(&[a], true).reciprocal())
        }
        "softmax-no-max" => x.exp().div(&x.exp().sum(&[a], true)),
        "log-softmax" => {
            let m = stable();
            m.sub(&m.exp().sum(&[a], true).log())
        }
        "log-softmax-no-max" => x.sub(&x.exp().sum(&[a], true).log()),
        "log-of-softmax" => x.softmax(a).log(),
        _ => unreachable!("{rule}"),
    }
}

/// Rows of large magnitudes with −∞ entries, a row of equal values, and a row all −∞ (NaN either
/// way: there is no finite maximum to subtract).
fn softmax_extremes(dtype: DType) -> HostTensor {
    let ninf = f64::NEG_INFINITY;
    #[rustfmt::skip]
    let v = [
        1e4, -1e4, 9990.0, 0.0, -80.0, 80.0,
        -1e4, -9999.5, -1e4, ninf, -9998.0, -1e4,
        80.0, 79.0, -80.0, ninf, ninf, 85.0,
        7.0, 7.0, 7.0, 7.0, 7.0, 7.0,
        ninf, ninf, ninf, ninf, ninf, ninf,
    ];
    tensor(dtype, &[5, 6], &v)
}

fn softmax_cases(ck: &mut Checker) {
    let rules = [
        ("softmax", "softmax", true),
        ("softmax-recip", "softmax", true),
        ("softmax-no-max", "softmax", false),
        ("log-softmax", "log_softmax", true),
        ("log-softmax-no-max", "log_softmax", false),
        ("log-of-softmax", "log_softmax", false),
    ];
    for dtype in FLOATS {
        let mut feeds = vec![
            (random(dtype, &[4, 7], 21, -3.0, 3.0), 1),
            (random(dtype, &[4, 7], 22, -3.0, 3.0), 0),
            (random(dtype, &[2, 3, 5], 23, -5.0, 5.0), 1),
            (random(dtype, &[2, 3, 5], 24, -5.0, 5.0), 2),
        ];
        let extremes = [(softmax_extremes(dtype), 1)];
        for (rule, op, stable) in rules {
            if stable {
                feeds.extend(extremes.iter().cloned());
            }
            for (feed, axis) in &feeds {
                ck.check(rule, op, std::slice::from_ref(feed), tol(dtype), |_, x| {
                    softmax_spelled(rule, &x[0], *axis)
                });
            }
            feeds.truncate(4);
        }
    }
}

#[test]
fn softmax_spellings_keep_values() {
    softmax_cases(&mut Checker::default());
}

/// LayerNorm (`layer`) or RMSNorm in primitives over the last axis: `var` is `sq-mul` or
/// `sq-pow`, `form` one of `mul-rsqrt`, `rsqrt-mul`, `div-sqrt`.
fn norm_spelled(x: &Tensor, layer: bool, var: &str, form: &str, eps: f64) -> Tensor {
    let xc = if layer {
        x.sub(&x.mean(&[-1], true))
    } else {
        x.clone()
    };
    let sq = if var == "sq-mul" {
        xc.mul(&xc)
    } else {
        xc.pow_scalar(2.0)
    };
    let v = sq.mean(&[-1], true).add_scalar(eps);
    match form {
        "mul-rsqrt" => xc.mul(&v.rsqrt()),
        "rsqrt-mul" => v.rsqrt().mul(&xc),
        _ => xc.div(&v.sqrt()),
    }
}

fn norm_inputs(dtype: DType) -> Vec<HostTensor> {
    let mut big = random(dtype, &[3, 8], 33, -1e4, 1e4).to_f64_vec();
    big[8..16].fill(-42.0); // a constant row: zero variance
    vec![
        random(dtype, &[3, 8], 31, -2.0, 2.0),
        random(dtype, &[2, 3, 16], 32, -5.0, 3.0),
        tensor(dtype, &[3, 8], &big),
        random(dtype, &[4, 1], 34, -2.0, 2.0),
    ]
}

fn norm_cases(ck: &mut Checker) {
    for dtype in FLOATS {
        for feed in norm_inputs(dtype) {
            let f = std::slice::from_ref(&feed);
            let t = tol(dtype);
            for var in ["sq-mul", "sq-pow"] {
                for form in ["mul-rsqrt", "rsqrt-mul", "div-sqrt"] {
                    ck.check(
                        &format!("layer-norm/{var}/{form}"),
                        "layer_norm",
                        f,
                        t,
                        |_, x| norm_spelled(&x[0], true, var, form, 1e-5),
                    );
                    ck.check(
                        &format!("rms-norm/{var}/{form}"),
                        "rms_norm",
                        f,
                        t,
                        |_, x| norm_spelled(&x[0], false, var, form, 1e-6),
                    );
                }
            }
            // The affine folds, with a weight and a bias over the last dim.
            let n = *feed.dims().last().unwrap();
            let w = random(dtype, &[n], 35, -2.0, 2.0);
            let b = random(dtype, &[n], 36, -1.0, 1.0);
            let fwb = [feed.clone(), w, b];
            let ln = |x: &Tensor| norm_spelled(x, true, "sq-mul", "mul-rsqrt", 1e-5);
            let rms = |x: &Tensor| norm_spelled(x, false, "sq-mul", "mul-rsqrt", 1e-6);
            ck.check("layer-norm-affine", "layer_norm", &fwb, t, |_, x| {
                ln(&x[0]).mul(&x[1]).add(&x[2])
            });
            ck.check("layer-norm-weight", "layer_norm", &fwb[..2], t, |_, x| {
                ln(&x[0]).mul(&x[1])
            });
            ck.check("layer-norm-weight-rev", "layer_norm", &fwb, t, |_, x| {
                x[1].mul(&ln(&x[0]))
            });
            ck.check("layer-norm-bias", "layer_norm", &fwb, t, |_, x| {
                ln(&x[0]).add(&x[2])
            });
            ck.check("layer-norm-weight-bias", "layer_norm", &fwb, t, |_, x| {
                x[0].layer_norm(Some(&x[1]), None, 1e-5).add(&x[2])
            });
            ck.check("rms-norm-weight", "rms_norm", &fwb, t, |_, x| {
                rms(&x[0]).mul(&x[1])
            });
            ck.check("rms-norm-weight-rev", "rms_norm", &fwb, t, |_, x| {
                x[1].mul(&rms(&x[0]))
            });
        }
    }
}

#[test]
fn norm_spellings_keep_values() {
    norm_cases(&mut Checker::default());
}

fn epilogue_cases(ck: &mut Checker) {
    for dtype in FLOATS {
        let t = tol(dtype);
        let shapes: [(&[usize], usize, usize); 3] =
            [(&[4, 8], 8, 16), (&[2, 3, 5], 5, 7), (&[1, 1], 1, 3)];
        for (s, (adims, k, n)) in shapes.into_iter().enumerate() {
            let seed = 40 + 4 * s as u64;
            let mut a = random(dtype, adims, seed, -3.0, 3.0);
            if s == 0 {
                // Large magnitudes, an infinity and a zero row go through the epilogue unchanged.
                let mut v = a.to_f64_vec();
                v[0] = f64::INFINITY;
                v[9] = 1e4;
                v[16..24].fill(0.0);
                a = tensor(dtype, adims, &v);
            }
            let w = random(dtype, &[k, n], seed + 1, -1.0, 1.0);
            let b = random(dtype, &[n], seed + 2, -1.0, 1.0);
            let f = [a.clone(), w.clone(), b.clone()];
            let mm = |x: &[Tensor]| x[0].matmul(&x[1]);
            let ep = "matmul_epilogue";
            ck.check("matmul-bias", ep, &f, t, |_, x| mm(x).add(&x[2]));
            ck.check("matmul-bias-rev", ep, &f, t, |_, x| x[2].add(&mm(x)));
            ck.check("epilogue-bias-relu", ep, &f, t, |_, x| {
                mm(x).add(&x[2]).relu()
            });
            ck.check("epilogue-bias-gelu", ep, &f, t, |_, x| {
                mm(x).add(&x[2]).gelu()
            });
            ck.check("epilogue-bias-gelu_tanh", ep, &f, t, |_, x| {
                mm(x).add(&x[2]).gelu_tanh()
            });
            ck.check("epilogue-bias-gelu_tanh", ep, &f, t, |_, x| {
                gelu_tanh_spelled(&mm(x).add(&x[2]), 0, 0, 0, false, 0.044715)
            });
            let f2 = [a.clone(), w.clone()];
            ck.check("epilogue-relu", ep, &f2, t, |_, x| mm(x).relu());
            ck.check("epilogue-gelu", ep, &f2, t, |_, x| mm(x).gelu());
            ck.check("epilogue-gelu_tanh", ep, &f2, t, |_, x| mm(x).gelu_tanh());
            // Transposed operands fold into the matmul's flags (layout rules) and carry over.
            let rank = adims.len();
            if rank == 2 {
                let at = HostTensor::from_f64_slice(
                    &TensorType::new(dtype, vec![adims[1], adims[0]]),
                    &transpose2(&a.to_f64_vec(), adims[0], adims[1]),
                )
                .unwrap();
                let ft = [at, w.clone(), b.clone()];
                ck.check("matmul-fold-trans-a", "matmul", &ft[..2], t, |_, x| {
                    x[0].t().matmul(&x[1])
                });
                ck.check("matmul-fold-trans-a", ep, &ft, t, |_, x| {
                    x[0].t().matmul(&x[1]).add(&x[2]).relu()
                });
            }
            let wt = HostTensor::from_f64_slice(
                &TensorType::new(dtype, vec![n, k]),
                &transpose2(&w.to_f64_vec(), k, n),
            )
            .unwrap();
            let fw = [a.clone(), wt, b.clone()];
            ck.check("matmul-fold-trans-b", "matmul", &fw[..2], t, |_, x| {
                x[0].matmul(&x[1].t())
            });
            ck.check("matmul-fold-trans-b", ep, &fw, t, |_, x| {
                x[0].matmul(&x[1].t()).add(&x[2]).gelu()
            });
        }
        // Batched transposes of both operands.
        let a = random(dtype, &[2, 5, 3], 60, -2.0, 2.0);
        let w = random(dtype, &[2, 4, 5], 61, -2.0, 2.0);
        ck.check(
            "matmul-fold-trans-a",
            "matmul",
            &[a.clone(), w.clone()],
            t,
            |_, x| x[0].transpose(-2, -1).matmul(&x[1].transpose(-2, -1)),
        );
        ck.check("matmul-fold-trans-b", "matmul", &[a, w], t, |_, x| {
            x[0].transpose(-2, -1).matmul(&x[1].transpose(-2, -1))
        });
        // The MLP backward: (dy·W2ᵀ) ⊙ gelu_tanh'(pre), the derivative as autodiff spells it.
        let dy = random(dtype, &[4, 8], 62, -2.0, 2.0);
        let w2 = random(dtype, &[16, 8], 63, -1.0, 1.0);
        let pre = random(dtype, &[4, 16], 64, -3.0, 3.0);
        let f = [dy, w2, pre];
        ck.check("matmul-dgelu-tanh", "matmul_act_grad", &f, t, |_, x| {
            x[0].matmul(&x[1].t()).mul(&dgelu_tanh_spelled(&x[2]))
        });
        ck.check("matmul-dgelu-tanh-rev", "matmul_act_grad", &f, t, |_, x| {
            dgelu_tanh_spelled(&x[2]).mul(&x[0].matmul(&x[1].t()))
        });
    }
}

/// `gelu_tanh'(x)` as the elementwise family's gradient rule spells it:
/// `0.5(1 + t) + 0.5k·x(1 − t²)(1 + 3c·x²)`, `t = tanh(k·x(1 + c·x²))`.
fn dgelu_tanh_spelled(x: &Tensor) -> Tensor {
    let one = || x.scalar_like(1.0);
    let x2 = x.mul(x);
    let inner = one().add(&x2.mul_scalar(0.044715));
    let t = x.mul(&inner).mul_scalar(SQRT_2_OVER_PI).tanh();
    let a = one().add(&t).mul_scalar(0.5);
    let sech2 = one().sub(&t.mul(&t));
    let p = one().add(&x2.mul_scalar(3.0 * 0.044715));
    let b = x.mul(&sech2).mul(&p).mul_scalar(0.5 * SQRT_2_OVER_PI);
    a.add(&b)
}

fn transpose2(v: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    (0..rows * cols)
        .map(|i| v[(i % rows) * cols + i / rows])
        .collect()
}

#[test]
fn matmul_epilogue_and_transpose_spellings_keep_values() {
    epilogue_cases(&mut Checker::default());
}

/// Attention shapes: (batch, heads, query length, key length, head dim).
const ATTN_SHAPES: [(usize, usize, usize, usize, usize); 3] =
    [(1, 2, 4, 4, 8), (2, 1, 3, 5, 4), (1, 1, 5, 3, 3)];

/// Attention spelled in primitives: scores by `scale` (`mul`, `div`, `unscaled`), masked by
/// `mask` (`plain`, `additive`, `causal` with `ge`/`le` keep masks or a constant, `causal-drop`
/// with `lt`/`gt` drop masks or a constant), the softmax spelled when `spelled_softmax`.
fn attention_spelled(
    gb: &GraphBuilder,
    x: &[Tensor],
    scale: &str,
    mask: &str,
    variant: usize,
    fill: f64,
    spelled_softmax: bool,
) -> Tensor {
    let (q, k, v) = (&x[0], &x[1], &x[2]);
    let d = *q.dims().last().unwrap() as f64;
    let raw = q.matmul(&k.transpose(-2, -1));
    let s = match scale {
        "mul" => raw.mul_scalar(1.0 / d.sqrt()),
        "div" => raw.div_scalar(d.sqrt()),
        _ => raw,
    };
    let (sq, sk) = (q.dims()[2], k.dims()[2]);
    let ity = TensorType::new(DType::I64, vec![sq, sk]);
    let (row, col) = (gb.iota(0, ity.clone()), gb.iota(1, ity));
    let fill_t = s.scalar_like(fill);
    let m = match mask {
        "plain" => s,
        "additive" => s.add(&x[3]),
        "causal" => {
            let keep = match variant % 3 {
                0 => row.ge(&col),
                1 => col.le(&row),
                _ => {
                    let vals: Vec<f64> = (0..sq * sk)
                        .map(|i| ((i % sk) <= (i / sk)) as u8 as f64)
                        .collect();
                    gb.constant(tensor(DType::Bool, &[sq, sk], &vals))
                }
            };
            gb.where_(&keep, &s, &fill_t)
        }
        _ => {
            let drop = match variant % 3 {
                0 => row.lt(&col),
                1 => col.gt(&row),
                _ => {
                    // Strictly upper-triangular, as `torch.triu(ones, 1)` exports.
                    let vals: Vec<f64> = (0..sq * sk)
                        .map(|i| ((i % sk) > (i / sk)) as u8 as f64)
                        .collect();
                    gb.constant(tensor(DType::Bool, &[sq, sk], &vals))
                }
            };
            gb.where_(&drop, &fill_t, &s)
        }
    };
    let p = if spelled_softmax {
        softmax_spelled("softmax", &m, -1)
    } else {
        m.softmax(-1)
    };
    p.matmul(v)
}

/// An additive mask `[1, 1, Sq, Sk]` of zeros, small values and −∞ that leaves every row at least
/// one finite entry.
fn additive_mask(dtype: DType, sq: usize, sk: usize, seed: u64) -> HostTensor {
    let mut v = random(dtype, &[sq * sk], seed, -2.0, 0.5).to_f64_vec();
    for (i, x) in v.iter_mut().enumerate() {
        let (r, c) = (i / sk, i % sk);
        if c != r % sk && (r + c) % 3 == 0 {
            *x = f64::NEG_INFINITY;
        }
    }
    tensor(dtype, &[1, 1, sq, sk], &v)
}

fn attention_cases(ck: &mut Checker) {
    let fills = [f64::NEG_INFINITY, -1e9, -1e4];
    let mut variant = 0;
    for dtype in FLOATS {
        for (s, &(b, h, sq, sk, d)) in ATTN_SHAPES.iter().enumerate() {
            for (range, big) in [(1.0, false), (30.0, true)] {
                let seed = 70 + 10 * s as u64 + big as u64 * 5;
                let q = random(dtype, &[b, h, sq, d], seed, -range, range);
                let k = random(dtype, &[b, h, sk, d], seed + 1, -range, range);
                let v = random(dtype, &[b, h, sk, d], seed + 2, -1.0, 1.0);
                let m = additive_mask(dtype, sq, sk, seed + 3);
                for scale in ["mul", "div", "unscaled"] {
                    for mask in ["plain", "additive", "causal", "causal-drop"] {
                        variant += 1;
                        let fill = fills[variant % 3];
                        let feeds = if mask == "additive" {
                            vec![q.clone(), k.clone(), v.clone(), m.clone()]
                        } else {
                            vec![q.clone(), k.clone(), v.clone()]
                        };
                        let spelled = variant % 4 == 0;
                        ck.check(
                            &format!("attention/{scale}/{mask}"),
                            "attention",
                            &feeds,
                            tol(dtype),
                            |gb, x| attention_spelled(gb, x, scale, mask, variant, fill, spelled),
                        );
                    }
                }
            }
        }
    }
}

/// Convolution activations, 1-D (grouped, strided) and 2-D, with and without the bias.
fn conv_cases(ck: &mut Checker) {
    use rustytorch_compiler::ConvOpts;
    for dtype in FLOATS {
        let t = tol(dtype);
        let cases: [(&[usize], &[usize], usize, usize); 2] = [
            (&[2, 4, 9], &[6, 2, 3], 2, 2),
            (&[1, 3, 6, 5], &[4, 3, 3, 2], 1, 1),
        ];
        for (s, (xd, wd, groups, stride)) in cases.into_iter().enumerate() {
            let seed = 90 + 4 * s as u64;
            let x = random(dtype, xd, seed, -2.0, 2.0);
            let w = random(dtype, wd, seed + 1, -1.0, 1.0);
            let b = random(dtype, &[wd[0]], seed + 2, -1.0, 1.0);
            let opts = ConvOpts {
                stride: vec![stride],
                padding: vec![1],
                groups,
                ..Default::default()
            };
            let f = [x.clone(), w.clone(), b];
            let o = opts.clone();
            let cb = move |x: &[Tensor]| x[0].conv(&x[1], Some(&x[2]), &o);
            ck.check("conv-bias-relu", "conv", &f, t, |_, x| cb(x).relu());
            ck.check("conv-bias-gelu", "conv", &f, t, |_, x| cb(x).gelu());
            ck.check("conv-bias-gelu_tanh", "conv", &f, t, |_, x| {
                cb(x).gelu_tanh()
            });
            let f2 = [x, w];
            let c = move |x: &[Tensor]| x[0].conv(&x[1], None, &opts);
            ck.check("conv-relu", "conv", &f2, t, |_, x| c(x).relu());
            ck.check("conv-gelu", "conv", &f2, t, |_, x| c(x).gelu());
            ck.check("conv-gelu_tanh", "conv", &f2, t, |_, x| {
                gelu_tanh_spelled(&c(x), 0, 0, 0, false, 0.044715)
            });
        }
    }
}

#[test]
fn conv_spellings_keep_values() {
    conv_cases(&mut Checker::default());
}

#[test]
fn attention_spellings_keep_values() {
    attention_cases(&mut Checker::default());
}

/// Every recognition rule (and the matmul transpose folds) has a spelling above that fires it.
#[test]
fn every_recognition_rule_is_checked_on_values() {
    let mut ck = Checker {
        spelling_only: true,
        ..Default::default()
    };
    gelu_cases(&mut ck);
    gelu_erf_cases(&mut ck);
    silu_cases(&mut ck);
    softmax_cases(&mut ck);
    norm_cases(&mut ck);
    epilogue_cases(&mut ck);
    conv_cases(&mut ck);
    attention_cases(&mut ck);
    let missing: Vec<String> = recognize::rules()
        .iter()
        .map(|r| r.name.to_string())
        .chain(["matmul-fold-trans-a".into(), "matmul-fold-trans-b".into()])
        .filter(|n| !ck.fired.contains(n))
        .collect();
    assert!(
        missing.is_empty(),
        "recognition rules without a value check: {missing:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Algebra and layout on edge values
// ---------------------------------------------------------------------------------------------

/// Edge values of a float dtype: NaN, ±∞, ±0, ±1, negatives, values where `exp` overflows or
/// underflows, the largest finite values and subnormals.
fn edges(dtype: DType) -> Vec<f64> {
    let (huge, tiny) = match dtype {
        DType::F64 => (1.5e308, 4e-310),
        _ => (3e38, 1e-40),
    };
    vec![
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.0,
        -0.0,
        1.0,
        -1.0,
        0.5,
        -2.5,
        3.0,
        huge,
        -huge,
        tiny,
        -tiny,
        89.0,
        -104.0,
        710.0,
        -750.0,
        1e4,
        -1e4,
    ]
}

/// Integer edge values (no i32::MIN: negating it overflows in any spelling).
fn int_edges() -> Vec<f64> {
    vec![
        0.0,
        1.0,
        -1.0,
        7.0,
        -7.0,
        2147483647.0,
        -2147483647.0,
        65536.0,
        -3.0,
        12.0,
    ]
}

/// Whether `got` is `want`: NaN for NaN, the same infinity, the same signed zero, else within
/// `rtol` relative (0: exactly).
fn same(got: f64, want: f64, rtol: f64) -> bool {
    if want.is_nan() {
        return got.is_nan();
    }
    if want.is_infinite() || want == 0.0 {
        return got == want && got.is_sign_negative() == want.is_sign_negative();
    }
    got == want || (got - want).abs() <= rtol * want.abs()
}

/// One row of the table: the rule expected to fire (`None`: the graph must keep its values with
/// no rule of the family changing it), the graph builder over the inputs, the dtype and a relative
/// tolerance (0 for identities, a few ulps where an op is replaced by another).
struct Entry {
    rule: Option<String>,
    dtype: DType,
    rtol: f64,
    build: Box<dyn Fn(&GraphBuilder, &[Tensor]) -> Vec<Tensor>>,
    /// Input shapes (each filled with the edge values, cycled and shifted per input).
    shapes: Vec<Vec<usize>>,
}

fn entry(
    rule: Option<&str>,
    dtype: DType,
    shapes: &[&[usize]],
    build: impl Fn(&GraphBuilder, &[Tensor]) -> Vec<Tensor> + 'static,
) -> Entry {
    Entry {
        rule: rule.map(str::to_string),
        dtype,
        rtol: 0.0,
        build: Box::new(build),
        shapes: shapes.iter().map(|s| s.to_vec()).collect(),
    }
}

fn one(t: Tensor) -> Vec<Tensor> {
    vec![t]
}

fn apply(x: &Tensor, op: Op) -> Tensor {
    x.builder().apply(op, &[x])
}

/// Inputs of `e`: edge values cycled to fill each shape, input `i` shifted by `7·i` so binary ops
/// meet every kind of pair.
fn edge_feeds(e: &Entry) -> Vec<HostTensor> {
    let base = if e.dtype.is_float() {
        edges(e.dtype)
    } else {
        int_edges()
    };
    e.shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n: usize = s.iter().product();
            let v: Vec<f64> = (0..n).map(|j| base[(j + 7 * i) % base.len()]).collect();
            tensor(e.dtype, s, &v)
        })
        .collect()
}

const V: &[usize] = &[20];

fn algebra_table() -> Vec<Entry> {
    let mut t = Vec::new();
    for dtype in FLOATS {
        let d = dtype;
        t.push(entry(Some("mul-one"), d, &[V], |_, x| {
            one(x[0].mul_scalar(1.0))
        }));
        t.push(entry(Some("add-zero"), d, &[V], |_, x| {
            one(x[0].add_scalar(-0.0))
        }));
        t.push(entry(Some("sub-zero"), d, &[V], |_, x| {
            one(x[0].sub_scalar(0.0))
        }));
        t.push(entry(Some("div-one"), d, &[V], |_, x| {
            one(x[0].div_scalar(1.0))
        }));
        t.push(entry(Some("neg-neg"), d, &[V], |_, x| {
            one(x[0].neg().neg())
        }));
        // exp(log x) rounds in two steps where x is large (log x ≈ 88 in f32 has an ulp of 8e-6).
        let exp_log_rtol = if d == DType::F32 { 2e-5 } else { 1e-12 };
        for build in [
            |x: &Tensor| x.exp().log().exp(),
            |x: &Tensor| x.abs().log().exp(),
            |x: &Tensor| x.sigmoid().log().exp(),
        ] {
            let mut e = entry(Some("exp-log"), d, &[V], move |_, x| one(build(&x[0])));
            e.rtol = exp_log_rtol;
            t.push(e);
        }
        t.push(entry(Some("mul-const-right"), d, &[V], |_, x| {
            one(x[0].scalar_like(-2.0).mul(&x[0]))
        }));
        t.push(entry(Some("add-const-right"), d, &[V], |_, x| {
            one(x[0].scalar_like(3.0).add(&x[0]))
        }));
        let mut c = entry(Some("cube-to-pow"), d, &[V], |_, x| {
            one(x[0].mul(&x[0]).mul(&x[0]))
        });
        c.rtol = 4.0 * f32::EPSILON as f64;
        t.push(c);
        let mut c = entry(Some("cube-to-pow-rev"), d, &[V], |_, x| {
            one(x[0].mul(&x[0].mul(&x[0])))
        });
        c.rtol = 4.0 * f32::EPSILON as f64;
        t.push(c);
        t.push(entry(Some("permute-compose"), d, &[&[2, 5, 2]], |_, x| {
            one(x[0].permute(&[2, 0, 1]).permute(&[2, 0, 1]))
        }));
        t.push(entry(Some("permute-compose"), d, &[&[2, 5, 2]], |_, x| {
            one(x[0].permute(&[1, 2, 0]).permute(&[2, 0, 1]))
        }));
        t.push(entry(Some("reshape-compose"), d, &[V], |_, x| {
            one(x[0].reshape(vec![4, 5]).reshape(vec![2, 10]))
        }));
        t.push(entry(Some("reshape-compose"), d, &[V], |_, x| {
            one(x[0].reshape(vec![4, 5]).reshape(vec![20]))
        }));
        t.push(entry(Some("cast-identity"), d, &[V], move |_, x| {
            one(apply(&x[0], Op::Cast { to: d }))
        }));
        t.push(entry(Some("permute-identity"), d, &[&[4, 5]], |_, x| {
            one(apply(&x[0], Op::Permute { perm: vec![0, 1] }))
        }));
        t.push(entry(Some("reshape-identity"), d, &[&[4, 5]], |_, x| {
            one(apply(
                &x[0],
                Op::Reshape {
                    shape: vec![4, 5].into(),
                },
            ))
        }));
        t.push(entry(Some("expand-identity"), d, &[&[4, 5]], |_, x| {
            one(apply(
                &x[0],
                Op::Expand {
                    shape: vec![4, 5].into(),
                },
            ))
        }));
        // Matmuls with transposed operands (no huge values: the sums' order may differ).
        let mut m = entry(
            Some("matmul-fold-trans-b"),
            d,
            &[&[3, 4], &[5, 4]],
            |_, x| {
                one(x[0]
                    .minimum_scalar(1e4)
                    .matmul(&x[1].maximum_scalar(-1e4).t()))
            },
        );
        m.rtol = 1e-5;
        t.push(m);
        let mut m = entry(
            Some("matmul-fold-trans-a"),
            d,
            &[&[4, 3], &[4, 5]],
            |_, x| {
                one(x[0]
                    .minimum_scalar(1e4)
                    .t()
                    .matmul(&x[1].maximum_scalar(-1e4)))
            },
        );
        m.rtol = 1e-5;
        t.push(m);
        // A batched weight gradient: Σ_b x_bᵀ·y_b as one matmul over the stacked rows.
        for keep in [false, true] {
            let mut m = entry(
                Some("matmul-batch-sum"),
                d,
                &[&[2, 3, 4, 3], &[2, 3, 4, 5]],
                move |_, x| {
                    one(x[0]
                        .minimum_scalar(1e4)
                        .transpose(-1, -2)
                        .matmul(&x[1].maximum_scalar(-1e4))
                        .sum(&[0, 1], keep))
                },
            );
            m.rtol = 1e-5;
            t.push(m);
        }
        // Broadcasts pushed past elementwise ops.
        for (name, u) in UNARY {
            let u = *u;
            t.push(entry(
                Some(&format!("expand-past-{name}")),
                d,
                &[&[1, 20]],
                move |_, x| one(apply(&x[0].expand(vec![3, 20]), Op::Unary(u))),
            ));
        }
        let to = if d == DType::F32 {
            DType::F64
        } else {
            DType::F32
        };
        t.push(entry(
            Some("expand-past-cast"),
            d,
            &[&[1, 20]],
            move |_, x| one(x[0].expand(vec![3, 20]).cast(to)),
        ));
        for (name, b) in BINARY {
            let b = *b;
            let bin = move |x: &Tensor, y: &Tensor| x.builder().apply(Op::Binary(b), &[x, y]);
            t.push(entry(
                Some(&format!("expand-past-{name}")),
                d,
                &[&[1, 20], &[1, 20]],
                move |_, x| one(bin(&x[0].expand(vec![3, 20]), &x[1].expand(vec![3, 20]))),
            ));
            t.push(entry(
                Some(&format!("expand-past-{name}-left")),
                d,
                &[&[1, 20], &[1, 20]],
                move |_, x| one(bin(&x[0].expand(vec![3, 20]), &x[1])),
            ));
            t.push(entry(
                Some(&format!("expand-past-{name}-right")),
                d,
                &[&[1, 20], &[20]],
                move |_, x| one(bin(&x[0], &x[1].expand(vec![3, 20]))),
            ));
        }
        // Guarded identities outside their domain, and identities that are not rules: the
        // values must stay those of the spelled graph.
        t.push(entry(None, d, &[V], |_, x| one(x[0].add_scalar(0.0))));
        t.push(entry(None, d, &[V], |_, x| {
            one(x[0].scalar_like(0.0).add(&x[0]))
        }));
        t.push(entry(None, d, &[V], |_, x| one(x[0].sub_scalar(-0.0))));
        t.push(entry(None, d, &[V], |_, x| one(x[0].log().exp())));
        t.push(entry(None, d, &[V], |_, x| one(x[0].sqrt().log().exp())));
        t.push(entry(None, d, &[V], |_, x| one(x[0].exp().log())));
        t.push(entry(None, d, &[V], |_, x| one(x[0].tanh().exp().log())));
        t.push(entry(None, d, &[V], |_, x| one(x[0].mul_scalar(0.0))));
        t.push(entry(None, d, &[V], |_, x| one(x[0].sub(&x[0]))));
        t.push(entry(None, d, &[V], |_, x| one(x[0].div(&x[0]))));
        t.push(entry(None, d, &[V], |_, x| {
            one(x[0].mul(&x[0].reciprocal()))
        }));
        t.push(entry(None, d, &[V], |_, x| {
            one(x[0].sqrt().mul(&x[0].sqrt()))
        }));
        t.push(entry(None, d, &[V], |_, x| one(x[0].abs().neg().abs())));
    }
    // Casts through a lossless type: the same value, whatever the final dtype does with it.
    for (from, mid, to) in [
        (DType::F32, DType::F64, DType::I32),
        (DType::F32, DType::F64, DType::F16),
        (DType::F32, DType::F64, DType::F32),
        (DType::F16, DType::F32, DType::BF16),
        (DType::I32, DType::I64, DType::F32),
        (DType::I32, DType::F64, DType::I32),
    ] {
        t.push(entry(
            Some("cast-cast-lossless"),
            from,
            &[V],
            move |_, x| one(x[0].cast(mid).cast(to)),
        ));
    }
    t.push(entry(None, DType::F32, &[V], |_, x| {
        one(x[0].cast(DType::F16).cast(DType::F32))
    }));
    // Integers: zeros of either sign are the same integer.
    let i = DType::I32;
    t.push(entry(Some("mul-one"), i, &[V], |_, x| {
        one(x[0].mul_scalar(1.0))
    }));
    t.push(entry(Some("add-zero"), i, &[V], |_, x| {
        one(x[0].add_scalar(0.0))
    }));
    t.push(entry(Some("sub-zero"), i, &[V], |_, x| {
        one(x[0].sub_scalar(0.0))
    }));
    t.push(entry(Some("div-one"), i, &[V], |_, x| {
        one(x[0].div_scalar(1.0))
    }));
    t.push(entry(Some("neg-neg"), i, &[V], |_, x| {
        one(x[0].neg().neg())
    }));
    t
}

const UNARY: &[(&str, rustytorch_ops::UnaryOp)] = {
    use rustytorch_ops::UnaryOp::*;
    &[
        ("neg", Neg),
        ("abs", Abs),
        ("exp", Exp),
        ("log", Log),
        ("sqrt", Sqrt),
        ("rsqrt", Rsqrt),
        ("reciprocal", Reciprocal),
        ("sin", Sin),
        ("cos", Cos),
        ("tanh", Tanh),
        ("sigmoid", Sigmoid),
        ("relu", Relu),
        ("gelu", GeluErf),
        ("gelu_tanh", GeluTanh),
        ("silu", Silu),
        ("erf", Erf),
    ]
};

const BINARY: &[(&str, rustytorch_ops::BinaryOp)] = {
    use rustytorch_ops::BinaryOp::*;
    &[
        ("add", Add),
        ("sub", Sub),
        ("mul", Mul),
        ("div", Div),
        ("pow", Pow),
        ("maximum", Maximum),
        ("minimum", Minimum),
    ]
};

/// Runs one table entry; returns the rules that fired.
fn run_entry(e: &Entry) -> BTreeSet<String> {
    let feeds = edge_feeds(e);
    let g = graph_of(&feeds, &*e.build);
    let o = optimized(&g);
    let what = format!(
        "{} ({:?}): {}",
        e.rule.as_deref().unwrap_or("no rule"),
        e.dtype,
        rustytorch_compiler::text::print(&g)
    );
    if let Some(r) = &e.rule {
        assert!(
            o.fired.contains(r),
            "{what}: did not fire; fired {:?}",
            o.fired
        );
    }
    let want = f64s(&eval(&g, &feeds));
    let got = f64s(&eval(&o.graph, &feeds));
    assert_eq!(got.len(), want.len(), "{what}");
    for (j, (&a, &b)) in got.iter().zip(&want).enumerate() {
        assert!(
            same(a, b, e.rtol),
            "{what}: element {j}: optimized {a:e}, spelled {b:e} (inputs {:?})",
            feeds.iter().map(|f| f.to_f64_vec()).collect::<Vec<_>>()
        );
    }
    o.fired
}

#[test]
fn algebra_and_layout_rules_keep_edge_values() {
    for e in algebra_table() {
        run_entry(&e);
    }
}

/// Constant folding evaluates with the CPU kernel: every unary and binary fold over rank-0
/// constants gives the kernel's value bit for bit on edge values (one graph per op and dtype,
/// one output per constant or pair).
#[test]
fn folds_keep_edge_values() {
    for dtype in FLOATS {
        let ev = edges(dtype);
        for (name, u) in UNARY {
            let u = *u;
            let vals = ev.clone();
            let e = Entry {
                rule: Some(format!("fold-{name}")),
                dtype,
                rtol: 0.0,
                build: Box::new(move |gb, _| {
                    vals.iter()
                        .map(|&c| apply(&gb.scalar(c, dtype), Op::Unary(u)))
                        .collect()
                }),
                shapes: vec![],
            };
            run_entry(&e);
        }
        for (name, b) in BINARY {
            let b = *b;
            let vals = ev.clone();
            let e = Entry {
                rule: Some(format!("fold-{name}")),
                dtype,
                rtol: 0.0,
                build: Box::new(move |gb, _| {
                    let mut out = Vec::new();
                    for &p in &vals {
                        for &q in vals.iter().step_by(3) {
                            let (p, q) = (gb.scalar(p, dtype), gb.scalar(q, dtype));
                            out.push(gb.apply(Op::Binary(b), &[&p, &q]));
                        }
                    }
                    out
                }),
                shapes: vec![],
            };
            run_entry(&e);
        }
    }
}

/// Every algebra and layout rule has a row in the table (the folds have theirs above).
#[test]
fn every_algebra_and_layout_rule_is_in_the_table() {
    let mut named: BTreeSet<String> = algebra_table().into_iter().filter_map(|e| e.rule).collect();
    for (n, _) in UNARY {
        named.insert(format!("fold-{n}"));
    }
    for (n, _) in BINARY {
        named.insert(format!("fold-{n}"));
    }
    let missing: Vec<String> = algebra::rules()
        .into_iter()
        .chain(layout::rules())
        .map(|r| r.name.to_string())
        .filter(|n| !named.contains(n))
        .collect();
    assert!(
        missing.is_empty(),
        "rules without an edge-value check: {missing:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Values the optimizer changes on purpose (docs/architecture.md, "What the optimizer may change")
// ---------------------------------------------------------------------------------------------

/// Outputs (spelled, optimized) of one graph, with the op the optimizer must have made.
fn before_after(
    feeds: &[HostTensor],
    op: &str,
    build: impl Fn(&GraphBuilder, &[Tensor]) -> Tensor,
) -> (Vec<f64>, Vec<f64>) {
    let g = graph_of(feeds, &|gb, xs| vec![build(gb, xs)]);
    let o = optimized(&g);
    assert!(o.ops.contains(op), "no {op} in {:?}", o.ops);
    (f64s(&eval(&g, feeds)), f64s(&eval(&o.graph, feeds)))
}

/// A query row whose keys are all masked by an additive −∞ mask: NaN spelled in primitives (the
/// row's maximum is −∞), zeros from the fused attention. The other rows agree.
#[test]
fn fully_masked_attention_row_becomes_zeros() {
    for dtype in FLOATS {
        let (b, h, sq, sk, d) = (1, 2, 3, 4, 5);
        let q = random(dtype, &[b, h, sq, d], 1, -1.0, 1.0);
        let k = random(dtype, &[b, h, sk, d], 2, -1.0, 1.0);
        let v = random(dtype, &[b, h, sk, d], 3, -1.0, 1.0);
        let mut mv = vec![0.0; sq * sk];
        mv[sk..2 * sk].fill(f64::NEG_INFINITY); // query row 1 sees no key
        mv[2 * sk] = f64::NEG_INFINITY;
        let mask = tensor(dtype, &[1, 1, sq, sk], &mv);
        let (spelled, fused) = before_after(&[q, k, v, mask], "attention", |gb, x| {
            attention_spelled(gb, x, "mul", "additive", 0, 0.0, false)
        });
        for (i, (&s, &f)) in spelled.iter().zip(&fused).enumerate() {
            let row = (i / d) % sq;
            if row == 1 {
                assert!(s.is_nan() && f == 0.0, "{dtype:?} element {i}: {s} -> {f}");
            } else {
                assert!(
                    (s - f).abs() <= tol(dtype) * (1.0 + s.abs()),
                    "{dtype:?} element {i}: {s} vs {f}"
                );
            }
        }
    }
}

/// `exp x / Σ exp x` and `x − log Σ exp x` overflow where `exp x` does (f32: x ≳ 88); the fused
/// op subtracts the maximum first and stays finite. `log(softmax x)` underflows to −∞ where the
/// fused log-softmax keeps the finite value.
#[test]
fn unstable_softmax_spellings_become_stable() {
    let x = tensor(DType::F32, &[2, 3], &[100.0, 99.0, 0.0, 1.0, -200.0, 0.5]);
    let feeds = [x];
    let (s, f) = before_after(&feeds, "softmax", |_, x| {
        softmax_spelled("softmax-no-max", &x[0], 1)
    });
    assert!(s[..3].iter().any(|v| v.is_nan()), "{s:?}");
    assert!(f.iter().all(|v| v.is_finite()), "{f:?}");
    assert!(
        (f[0] - 1.0 / (1.0 + (-1f64).exp() + (-100f64).exp())).abs() < 1e-6,
        "{f:?}"
    );
    let (s, f) = before_after(&feeds, "log_softmax", |_, x| {
        softmax_spelled("log-softmax-no-max", &x[0], 1)
    });
    assert!(s[..3].iter().all(|v| !v.is_finite()), "{s:?}");
    assert!(
        (f[2] + 100.0 + (1.0 + (-1f64).exp()).ln()).abs() < 1e-4,
        "{f:?}"
    );
    let (s, f) = before_after(&feeds, "log_softmax", |_, x| {
        softmax_spelled("log-of-softmax", &x[0], 1)
    });
    assert_eq!(s[4], f64::NEG_INFINITY, "{s:?}");
    assert!(
        (f[4] + 201.0 + (1.0 + (-0.5f64).exp()).ln() - 0.0).abs() < 1e-3,
        "{f:?}"
    );
}

/// A causal `where` fill of −1e4 counts as −∞: where the unmasked scores are far below the fill
/// (here about −5e4), the spelled form puts the weight on the masked keys and the fused attention
/// does not.
#[test]
fn causal_fill_counts_as_minus_infinity() {
    let (b, h, s, d) = (1, 1, 3, 2);
    let q = tensor(
        DType::F32,
        &[b, h, s, d],
        &[100.0, 100.0, 100.0, 100.0, 100.0, 100.0],
    );
    let k = tensor(
        DType::F32,
        &[b, h, s, d],
        &[-250.0, -250.0, -250.0, -250.0, -250.0, -250.0],
    );
    let v = tensor(DType::F32, &[b, h, s, d], &[1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
    let (spelled, fused) = before_after(&[q, k, v], "attention", |gb, x| {
        attention_spelled(gb, x, "unscaled", "causal", 0, -1e4, false)
    });
    // Row 0 sees key 0 only: value 1 fused; spelled, the two masked keys (-1e4) win.
    assert!((fused[0] - 1.0).abs() < 1e-6, "{fused:?}");
    assert!((spelled[0] - 2.5).abs() < 1e-3, "{spelled:?}");
}

/// A recognized constant is matched within a relative 1e-3 (traced constants are rounded to
/// their dtype): the fused op uses the exact constant, so a spelled GELU with a rounded 0.0447
/// gives slightly different values; a constant further off is not recognized.
#[test]
fn recognized_constants_are_matched_within_a_tolerance() {
    let x = random(DType::F64, &[4, 8], 5, -4.0, 4.0);
    let (s, f) = before_after(std::slice::from_ref(&x), "gelu_tanh", |_, x| {
        gelu_tanh_spelled(&x[0], 0, 0, 0, false, 0.0447)
    });
    let diff = s
        .iter()
        .zip(&f)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(diff > 1e-9 && diff < 1e-3, "{diff}");
    let g = graph_of(std::slice::from_ref(&x), &|_, x| {
        vec![gelu_tanh_spelled(&x[0], 0, 0, 0, false, 0.05)]
    });
    assert!(!optimized(&g).ops.contains("gelu_tanh"));
}

/// SiLU's 1 has the same tolerance: `x / (1.0005 + exp(−x))` is taken for `x / (1 + exp(−x))`,
/// giving the library op's slightly different values; a constant further off is not recognized.
#[test]
fn silu_ones_are_matched_within_a_tolerance() {
    let x = random(DType::F64, &[4, 8], 6, -4.0, 4.0);
    let feeds = std::slice::from_ref(&x);
    let silu = |one: f64| {
        move |_: &GraphBuilder, x: &[Tensor]| x[0].div(&x[0].neg().exp().add_scalar(one))
    };
    let (s, f) = before_after(feeds, "silu", silu(1.0005));
    let d = s
        .iter()
        .zip(&f)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(d > 1e-9 && d < 1e-2, "silu: {d}");
    let g = graph_of(feeds, &|gb, x| vec![silu(1.01)(gb, x)]);
    assert!(!optimized(&g).ops.contains("silu"));
}

/// Exponents are matched exactly: `pow(x, 2.001)` and `pow(x, 3.001)` are NaN for negative x, and
/// a norm or GELU recognized from them would turn those NaNs into numbers.
#[test]
fn exponents_are_matched_exactly() {
    let x = random(DType::F64, &[4, 8], 7, -4.0, 4.0);
    let feeds = std::slice::from_ref(&x);
    for (layer, name) in [(true, "layer_norm"), (false, "rms_norm")] {
        let spelled = |p: f64| {
            move |_: &GraphBuilder, x: &[Tensor]| {
                let xc = if layer {
                    x[0].sub(&x[0].mean(&[-1], true))
                } else {
                    x[0].clone()
                };
                let v = xc.pow_scalar(p).mean(&[-1], true).add_scalar(1e-5);
                vec![xc.mul(&v.rsqrt())]
            }
        };
        assert!(optimized(&graph_of(feeds, &spelled(2.0)))
            .ops
            .contains(name));
        assert!(!optimized(&graph_of(feeds, &spelled(2.001)))
            .ops
            .contains(name));
    }
    let gelu = |p: f64| {
        move |_: &GraphBuilder, x: &[Tensor]| {
            let x = &x[0];
            let inner = x.add(&x.pow_scalar(p).mul_scalar(0.044715));
            vec![x
                .mul_scalar(0.5)
                .mul(&inner.mul_scalar(SQRT_2_OVER_PI).tanh().add_scalar(1.0))]
        }
    };
    assert!(optimized(&graph_of(feeds, &gelu(3.0)))
        .ops
        .contains("gelu_tanh"));
    assert!(!optimized(&graph_of(feeds, &gelu(3.001)))
        .ops
        .contains("gelu_tanh"));
}
