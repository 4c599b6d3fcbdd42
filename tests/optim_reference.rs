//! The optimizers against their published update rules, step by step in f64: SGD with momentum and
//! weight decay (PyTorch's `torch.optim.SGD`, dampening 0, no Nesterov), AdamW (PyTorch's
//! `torch.optim.AdamW`), and global-norm clipping (`torch.nn.utils.clip_grad_norm_`). The model is
//! a least-squares linear layer whose gradient is known in closed form, so the references never
//! read a gradient from the graph; the graph's gradient outputs are checked against it too.
//!
//! The learning rate is the f32 state tensor `optim.lr`, so every rate here is exact in f32; every
//! other coefficient is used at full f64 precision.

use rustytorch::ops::testing::rand_f64;
use rustytorch::prelude::*;

const F: DType = DType::F64;
const STEPS: usize = 5;
/// Relative tolerance of the parameters against the reference.
const RTOL: f64 = 1e-12;
/// Batch size, inputs and outputs of the linear model.
const N: usize = 6;
const I: usize = 4;
const O: usize = 3;

/// Parameters of the model: `w` [I, O] and `b` [O], row-major.
#[derive(Clone, Debug)]
struct Params {
    w: Vec<f64>,
    b: Vec<f64>,
}

impl Params {
    fn flat(&self) -> Vec<f64> {
        self.w.iter().chain(&self.b).copied().collect()
    }
    fn from_flat(v: &[f64]) -> Params {
        Params {
            w: v[..I * O].to_vec(),
            b: v[I * O..].to_vec(),
        }
    }
}

/// One batch: `x` [N, I], `y` [N, O].
struct Batch {
    x: Vec<f64>,
    y: Vec<f64>,
}

fn batch(step: usize) -> Batch {
    Batch {
        x: rand_f64(N * I, 100 + step as u64, -1.0, 1.0),
        y: rand_f64(N * O, 200 + step as u64, -2.0, 2.0),
    }
}

/// `loss = ½ Σ (x·w + b − y)²`; its gradient is `(xᵀr, Σ_rows r)` with `r = x·w + b − y`.
fn closed_form_grad(p: &Params, d: &Batch) -> Params {
    let mut r = [0.0; N * O];
    for n in 0..N {
        for o in 0..O {
            let mut s = p.b[o] - d.y[n * O + o];
            for i in 0..I {
                s += d.x[n * I + i] * p.w[i * O + o];
            }
            r[n * O + o] = s;
        }
    }
    let mut gw = vec![0.0; I * O];
    let mut gb = vec![0.0; O];
    for n in 0..N {
        for o in 0..O {
            gb[o] += r[n * O + o];
            for i in 0..I {
                gw[i * O + o] += d.x[n * I + i] * r[n * O + o];
            }
        }
    }
    Params { w: gw, b: gb }
}

/// The least-squares model with a training step; outputs `[loss, grad w, grad b, grad norm]`.
fn model(opt: impl Into<rustytorch::Optimizer>, clip_norm: Option<f64>) -> Executable {
    let g = GraphBuilder::new();
    let x = g.input("x", F, [N, I]);
    let y = g.input("y", F, [N, O]);
    let init = |seed| Init::Uniform {
        low: -1.0,
        high: 1.0,
        seed,
    };
    let w = g.param_typed("w", TensorType::new(F, [I, O]), init(1), true);
    let b = g.param_typed("b", TensorType::new(F, [O]), init(2), true);
    let r = x.matmul(&w).add(&b).sub(&y);
    let loss = r.mul(&r).sum_all().mul_scalar(0.5);
    let step = g
        .train_step(
            &loss,
            opt,
            &StepOptions {
                clip_norm,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(step.grads[0].0, "w");
    assert_eq!(step.grads[1].0, "b");
    let outs = [&loss, &step.grads[0].1, &step.grads[1].1, &step.grad_norm];
    compile(&g, &outs, Device::Cpu).unwrap()
}

fn params_of(exe: &Executable) -> Params {
    Params {
        w: exe.param("w").unwrap().to_f64_vec(),
        b: exe.param("b").unwrap().to_f64_vec(),
    }
}

fn run(exe: &mut Executable, d: &Batch) -> Vec<HostTensor> {
    let x = HostTensor::from_vec(d.x.clone(), [N, I]).unwrap();
    let y = HostTensor::from_vec(d.y.clone(), [N, O]).unwrap();
    exe.run(&[("x", x), ("y", y)]).unwrap().into_vec()
}

fn assert_close(what: &str, got: &[f64], want: &[f64], rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    // Relative to the vector's scale, so that an entry near zero is not held to 1e-12 of itself.
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= rtol * scale.max(b.abs()),
            "{what}: element {i}: got {a:e}, want {b:e} (error {:e}, tolerance {rtol:e})",
            (a - b).abs()
        );
    }
}

/// `torch.nn.utils.clip_grad_norm_`: the global L2 norm over every gradient, and the gradients
/// scaled by `max_norm / (norm + 1e-6)` when that is below one (PyTorch multiplies by the factor
/// clamped to one, which leaves them unchanged otherwise).
fn clip_grad_norm(g: &[f64], max_norm: f64) -> (Vec<f64>, f64) {
    let norm = g.iter().map(|v| v * v).sum::<f64>().sqrt();
    let coef = (max_norm / (norm + 1e-6)).min(1.0);
    (g.iter().map(|v| v * coef).collect(), norm)
}

/// An optimizer written as its published update rule over flat f64 vectors.
trait Reference {
    /// One step at step number `t` (from 1) with gradient `g`.
    fn step(&mut self, p: &mut [f64], g: &[f64], t: i32);
}

/// `torch.optim.SGD` (dampening 0, nesterov off): `d = g + wd·p`; with momentum `b = d` on the
/// first step and `b = μ·b + d` after, `d = b`; `p ← p − lr·d`.
struct SgdRef {
    o: Sgd,
    buf: Option<Vec<f64>>,
}

impl Reference for SgdRef {
    fn step(&mut self, p: &mut [f64], g: &[f64], _t: i32) {
        let mut d: Vec<f64> = g
            .iter()
            .zip(p.iter())
            .map(|(g, p)| g + self.o.weight_decay * p)
            .collect();
        if self.o.momentum != 0.0 {
            let b = match self.buf.take() {
                None => d.clone(),
                Some(b) => b
                    .iter()
                    .zip(&d)
                    .map(|(b, d)| self.o.momentum * b + d)
                    .collect(),
            };
            d = b.clone();
            self.buf = Some(b);
        }
        for (p, d) in p.iter_mut().zip(&d) {
            *p -= self.o.lr * d;
        }
    }
}

/// `torch.optim.AdamW`: `p ← p·(1 − lr·wd)`; `m ← β1·m + (1−β1)·g`; `v ← β2·v + (1−β2)·g²`;
/// `p ← p − lr/(1−β1ᵗ) · m / (√v / √(1−β2ᵗ) + ε)`.
struct AdamWRef {
    o: AdamW,
    m: Vec<f64>,
    v: Vec<f64>,
}

impl Reference for AdamWRef {
    fn step(&mut self, p: &mut [f64], g: &[f64], t: i32) {
        let o = &self.o;
        let bc1 = 1.0 - o.beta1.powi(t);
        let bc2_sqrt = (1.0 - o.beta2.powi(t)).sqrt();
        let step_size = o.lr / bc1;
        for i in 0..p.len() {
            p[i] *= 1.0 - o.lr * o.weight_decay;
            self.m[i] = o.beta1 * self.m[i] + (1.0 - o.beta1) * g[i];
            self.v[i] = o.beta2 * self.v[i] + (1.0 - o.beta2) * g[i] * g[i];
            let denom = self.v[i].sqrt() / bc2_sqrt + o.eps;
            p[i] -= step_size * self.m[i] / denom;
        }
    }
}

fn reference(opt: &rustytorch::Optimizer) -> Box<dyn Reference> {
    let n = I * O + O;
    match opt {
        rustytorch::Optimizer::Sgd(o) => Box::new(SgdRef {
            o: o.clone(),
            buf: None,
        }),
        rustytorch::Optimizer::AdamW(o) => Box::new(AdamWRef {
            o: o.clone(),
            m: vec![0.0; n],
            v: vec![0.0; n],
        }),
    }
}

/// Runs [`STEPS`] steps of the graph and of the reference from the same start, comparing the
/// gradients, the gradient norm and the parameters after every step. Returns how many steps
/// clipped.
fn compare(opt: rustytorch::Optimizer, clip_norm: Option<f64>) -> usize {
    let mut exe = model(opt.clone(), clip_norm);
    let mut reference = reference(&opt);
    let mut p = params_of(&exe).flat();
    let mut clipped = 0;
    for t in 1..=STEPS {
        let d = batch(t);
        let raw = closed_form_grad(&Params::from_flat(&p), &d).flat();
        let (g, norm) = match clip_norm {
            Some(max) => clip_grad_norm(&raw, max),
            None => (raw.clone(), raw.iter().map(|v| v * v).sum::<f64>().sqrt()),
        };
        clipped += (g != raw) as usize;
        let out = run(&mut exe, &d);
        let what = |x: &str| format!("{opt:?}, clip {clip_norm:?}, step {t}: {x}");
        let graph_g: Vec<f64> = out[1]
            .to_f64_vec()
            .into_iter()
            .chain(out[2].to_f64_vec())
            .collect();
        assert_close(&what("gradient"), &graph_g, &g, RTOL);
        assert_close(&what("gradient norm"), &out[3].to_f64_vec(), &[norm], RTOL);
        reference.step(&mut p, &g, t as i32);
        assert_close(&what("parameters"), &params_of(&exe).flat(), &p, RTOL);
    }
    assert_eq!(
        exe.param("optim.step").unwrap().to_vec::<i64>().unwrap(),
        vec![STEPS as i64]
    );
    clipped
}

#[test]
fn sgd_matches_pytorch() {
    for opt in [
        Sgd::new(0.0625),
        Sgd::new(0.0625).weight_decay(0.1),
        Sgd::new(0.03125).momentum(0.9),
        Sgd::new(0.03125).momentum(0.9).weight_decay(0.05),
    ] {
        compare(opt.into(), None);
    }
}

#[test]
fn adamw_matches_pytorch() {
    for opt in [
        AdamW::new(0.015625),
        AdamW::new(0.03125).weight_decay(0.1),
        // β and ε far from the defaults: a wrong bias correction or ε inside the square root
        // shows at once.
        AdamW {
            lr: 0.0625,
            beta1: 0.5,
            beta2: 0.75,
            eps: 0.05,
            weight_decay: 0.2,
        },
    ] {
        compare(opt.into(), None);
    }
}

#[test]
fn global_norm_clipping_matches_pytorch() {
    // The gradients' norm is about 10 here: a bound of 1 clips every step, 1e3 none.
    assert_eq!(
        compare(Sgd::new(0.0625).momentum(0.9).into(), Some(1.0)),
        STEPS
    );
    assert_eq!(compare(AdamW::new(0.03125).into(), Some(1.0)), STEPS);
    assert_eq!(compare(Sgd::new(0.0625).into(), Some(1e3)), 0);
}
