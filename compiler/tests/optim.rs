//! Optimizer state in the graph, run by a reference evaluator (every node through the ops crate's
//! CPU kernels, updates applied when every guard passes): the step counter is an exact integer,
//! and f16/bf16 parameters train through f32 master copies and f32 moments, matching an f64
//! reference of the optimizer within the parameter dtype's rounding.

use rustytorch_compiler::optim::{AdamW, Optimizer, Sgd, StepOptions};
use rustytorch_compiler::{Graph, GraphBuilder, Init};
use rustytorch_ops::{eval_cpu, DType, HostTensor, Op, TensorType};
use std::collections::HashMap;

/// A graph with its parameter and state values, stepped one run at a time.
struct Trainer {
    g: Graph,
    state: HashMap<String, HostTensor>,
}

impl Trainer {
    fn new(b: &GraphBuilder) -> Trainer {
        let g = b.graph().unwrap();
        g.verify().unwrap();
        let state = g
            .params
            .iter()
            .map(|p| {
                let v = p
                    .data
                    .clone()
                    .unwrap_or_else(|| p.init.materialize(&p.ty).unwrap());
                (p.name.clone(), v)
            })
            .collect();
        Trainer { g, state }
    }

    fn get(&self, name: &str) -> &HostTensor {
        &self.state[name]
    }

    fn set(&mut self, name: &str, v: HostTensor) {
        let old = &self.state[name];
        assert_eq!(old.ty(), v.ty(), "{name}");
        self.state.insert(name.to_string(), v);
    }

    /// One run: evaluates the graph and applies the updates when every guard passes.
    fn step(&mut self, feeds: &[(&str, HostTensor)]) {
        let g = &self.g;
        let mut vals: HashMap<_, HostTensor> = HashMap::new();
        for n in g.live_order() {
            let node = g.node(n).unwrap();
            let v = match &node.op {
                Op::Input { index, .. } => {
                    let name = &g.inputs[*index as usize].name;
                    feeds.iter().find(|f| f.0 == name).unwrap().1.clone()
                }
                Op::Param { index, .. } => self.state[&g.params[*index as usize].name].clone(),
                Op::Constant { index, .. } => g.constants[*index as usize].clone(),
                op => {
                    let ins: Vec<&HostTensor> = node.inputs.iter().map(|i| &vals[i]).collect();
                    eval_cpu(op, &ins).unwrap_or_else(|e| panic!("%{}: {e}", n.index()))
                }
            };
            assert_eq!(v.ty(), node.ty, "%{} ({})", n.index(), node.op.name());
            vals.insert(n, v);
        }
        for (name, n) in &g.guards {
            assert_eq!(vals[n].to_f64_vec(), vec![1.0], "guard {name}");
        }
        for (p, n) in &g.updates {
            let name = &g.params[*p as usize].name;
            self.state.insert(name.clone(), vals[n].clone());
        }
    }
}

/// `loss = Σ w·x` over a parameter `w` of `dtype`: its gradient is `x`, whatever `w` is, so a
/// reference optimizer sees exactly the gradients the graph does.
fn linear_model(dtype: DType, n: usize, opt: impl Into<Optimizer>) -> Trainer {
    let b = GraphBuilder::new();
    let x = b.input("x", dtype, [n]);
    let w = b.param_typed(
        "w",
        TensorType::new(dtype, [n]),
        Init::Uniform {
            low: 0.5,
            high: 2.0,
            seed: 3,
        },
        true,
    );
    let loss = w.mul(&x).sum_all();
    b.output("loss", &loss);
    b.train_step(&loss, opt, &StepOptions::default()).unwrap();
    Trainer::new(&b)
}

/// Gradients for `steps` runs, rounded to `dtype` (returned as f64 and as feeds): random
/// magnitudes, each element keeping one sign (so the weights drift steadily).
fn gradients(dtype: DType, n: usize, steps: usize) -> Vec<(Vec<f64>, HostTensor)> {
    (0..steps)
        .map(|k| {
            let raw = rustytorch_ops::testing::rand_f64(n, 100 + k as u64, 0.25, 1.0);
            let signed = raw
                .iter()
                .enumerate()
                .map(|(i, &v)| if i % 2 == 0 { v as f32 } else { -v as f32 });
            let t = HostTensor::from_vec(signed.collect(), [n])
                .unwrap()
                .cast(dtype);
            (t.to_f64_vec(), t)
        })
        .collect()
}

/// Half a unit in the last place of `v` in a float dtype with `mantissa` stored bits.
fn half_ulp(v: f64, mantissa: i32) -> f64 {
    let e = v.abs().max(f64::MIN_POSITIVE).log2().floor() as i32;
    2f64.powi(e - mantissa - 1)
}

#[test]
fn the_step_counter_is_an_exact_integer_past_2_pow_24() {
    let mut tr = linear_model(DType::F32, 4, AdamW::new(1e-3));
    assert_eq!(tr.get("optim.step").ty().dtype, DType::I64);
    let x = HostTensor::from_vec(vec![1.0f32, -1.0, 0.5, 2.0], [4]).unwrap();
    tr.step(&[("x", x.clone())]);
    assert_eq!(tr.get("optim.step").to_vec::<i64>().unwrap(), vec![1]);
    // f32 stops counting here: 2²⁴ + 1 rounds back to 2²⁴.
    tr.set("optim.step", HostTensor::scalar(16_777_216i64));
    tr.step(&[("x", x)]);
    assert_eq!(
        tr.get("optim.step").to_vec::<i64>().unwrap(),
        vec![16_777_217]
    );
    // The bias corrections at that step are 1 (to f32): the update is finite.
    assert!(tr.get("w").to_f64_vec().iter().all(|v| v.is_finite()));
}

#[test]
fn low_precision_parameters_keep_f32_masters_and_moments() {
    for (dtype, momentum) in [(DType::BF16, 0.0), (DType::F16, 0.9)] {
        for opt in [
            Optimizer::from(AdamW::new(1e-3)),
            Sgd::new(1e-2).momentum(momentum).into(),
        ] {
            let tr = linear_model(dtype, 4, opt.clone());
            let ty = |name: &str| tr.get(name).ty();
            assert_eq!(ty("w"), TensorType::new(dtype, [4]), "{opt:?}");
            assert_eq!(ty("optim.master.w"), TensorType::new(DType::F32, [4]));
            let moments: &[&str] = match &opt {
                Optimizer::AdamW(_) => &["optim.m.w", "optim.v.w"],
                Optimizer::Sgd(s) if s.momentum != 0.0 => &["optim.momentum.w"],
                Optimizer::Sgd(_) => &[],
            };
            for m in moments {
                assert_eq!(ty(m), TensorType::new(DType::F32, [4]), "{m}");
            }
            let state = tr.g.params.iter().filter(|p| !p.trainable).count();
            // lr, step, the master and the moments.
            assert_eq!(state, 3 + moments.len(), "{opt:?}");
        }
    }
    // An f32 parameter has no master.
    let tr = linear_model(DType::F32, 4, AdamW::new(1e-3));
    assert!(!tr.state.contains_key("optim.master.w"));
    assert_eq!(tr.get("optim.m.w").ty().dtype, DType::F32);
}

/// AdamW in f64, the same formula as the graph's.
struct RefAdamW {
    a: AdamW,
    p: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
    t: i32,
}

impl RefAdamW {
    fn step(&mut self, g: &[f64]) {
        let a = &self.a;
        self.t += 1;
        let bc1 = 1.0 - a.beta1.powi(self.t);
        let bc2 = 1.0 - a.beta2.powi(self.t);
        for i in 0..self.p.len() {
            self.m[i] = a.beta1 * self.m[i] + (1.0 - a.beta1) * g[i];
            self.v[i] = a.beta2 * self.v[i] + (1.0 - a.beta2) * g[i] * g[i];
            let denom = (self.v[i] / bc2).sqrt() + a.eps;
            self.p[i] =
                self.p[i] * (1.0 - a.lr * a.weight_decay) - self.m[i] / denom * (a.lr / bc1);
        }
    }
}

#[test]
fn low_precision_adamw_matches_an_f64_reference() {
    let n = 16;
    let steps = 30;
    // Each step moves a weight by about lr, well under half a bf16 ulp (2⁻⁸ near 1): without the
    // master the parameter would never move.
    for (dtype, mantissa) in [(DType::BF16, 7), (DType::F16, 10)] {
        let opt = AdamW::new(1e-3);
        let mut tr = linear_model(dtype, n, opt.clone());
        let p0 = tr.get("w").to_f64_vec();
        let mut r = RefAdamW {
            a: opt,
            p: p0.clone(),
            m: vec![0.0; n],
            v: vec![0.0; n],
            t: 0,
        };
        for (g, x) in gradients(dtype, n, steps) {
            tr.step(&[("x", x)]);
            r.step(&g);
        }
        let master = tr.get("optim.master.w").to_f64_vec();
        let w = tr.get("w");
        assert_eq!(w.ty().dtype, dtype);
        // The parameter is the master rounded to its dtype.
        assert_eq!(
            w.to_f64_vec(),
            tr.get("optim.master.w").cast(dtype).to_f64_vec()
        );
        let w = w.to_f64_vec();
        for i in 0..n {
            let want = r.p[i];
            assert!(
                (master[i] - want).abs() < 1e-5,
                "{dtype:?} master[{i}] = {} vs {want}",
                master[i]
            );
            assert!(
                (w[i] - want).abs() <= half_ulp(want, mantissa) + 1e-5,
                "{dtype:?} w[{i}] = {} vs {want}",
                w[i]
            );
            assert!((p0[i] - want).abs() > 0.01, "the reference moved");
        }
        assert_eq!(
            tr.get("optim.step").to_vec::<i64>().unwrap(),
            vec![steps as i64]
        );
        // The moments are the reference's, in f32.
        let m = tr.get("optim.m.w").to_f64_vec();
        for i in 0..n {
            assert!((m[i] - r.m[i]).abs() < 1e-5, "m[{i}]");
        }
    }
}

#[test]
fn a_parameter_set_on_its_own_replaces_its_master() {
    let n = 8;
    let opt = Sgd::new(1e-3);
    let mut tr = linear_model(DType::BF16, n, opt);
    let grads = gradients(DType::BF16, n, 3);
    for (_, x) in &grads[..2] {
        tr.step(&[("x", x.clone())]);
    }
    // Set the weights to 3.0 (a value the master does not round to): training continues from 3.
    let three = HostTensor::from_vec(vec![3.0f32; n], [n])
        .unwrap()
        .cast(DType::BF16);
    tr.set("w", three);
    let (g, x) = &grads[2];
    tr.step(&[("x", x.clone())]);
    let master = tr.get("optim.master.w").to_f64_vec();
    for i in 0..n {
        let want = 3.0 - 1e-3 * g[i];
        assert!(
            (master[i] - want).abs() < 1e-6,
            "master[{i}] = {}",
            master[i]
        );
    }
}
