//! Training in the graph: gradients, global-norm clipping, finiteness guards and optimizer updates
//! (SGD with momentum and weight decay, AdamW) written as ordinary ops whose results are recorded as
//! state updates (`param ← new value`). The learning rate (f32) and the step counter (i64, so it
//! counts exactly past 2²⁴) are state tensors too, so a schedule can change the rate between runs
//! without recompiling; the fusion pass turns each parameter's update into one elementwise kernel.
//!
//! State tensors are non-trainable parameters named `optim.<what>[.<param>]`: `optim.lr`,
//! `optim.step`, `optim.momentum.<param>` (SGD with momentum), `optim.m.<param>` and
//! `optim.v.<param>` (AdamW), and `optim.master.<param>` for f16/bf16 parameters.
//!
//! **Mixed precision.** An f16 or bf16 parameter is updated in f32: its gradient is cast to f32,
//! its moments are f32, and an f32 master copy `optim.master.<param>` holds the value the updates
//! accumulate into (a step smaller than half a bf16 ulp still moves it). Each step writes the new
//! master and the parameter rounded to its dtype. The master starts at zero and, element by
//! element, a master value that no longer rounds to the parameter is replaced by the parameter's
//! value before the update: on the first step, and after the parameter was set or loaded on its
//! own, the parameter is what training continues from.
//!
//! **Loss scaling.** The backward starts from a marked seed node of value one, and every gradient
//! is multiplied by a marked scalar one (in the update's dtype) before anything reads it;
//! [`scale_loss`], at compile time, turns the marks into the state scalar `optim.loss_scale` and
//! its reciprocal, or removes them.
use crate::builder::{GraphBuilder, Tensor};
use crate::graph::{Graph, Init, NodeId};
use crate::{autodiff, CompileError, Result};
use rustytorch_ops::{DType, F64Bits, Op, Shape, TensorType};

/// An optimizer.
#[derive(Clone, Debug, PartialEq)]
pub enum Optimizer {
    /// Stochastic gradient descent.
    Sgd(Sgd),
    /// Adam with decoupled weight decay.
    AdamW(AdamW),
}

/// SGD: `buf ← momentum·buf + g + wd·p; p ← p − lr·buf` (no buffer when momentum is 0).
#[derive(Clone, Debug, PartialEq)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum.
    pub momentum: f64,
    /// L2 weight decay added to the gradient.
    pub weight_decay: f64,
}

impl Sgd {
    /// Plain SGD.
    pub fn new(lr: f64) -> Sgd {
        Sgd {
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
        }
    }
    /// With momentum.
    pub fn momentum(mut self, m: f64) -> Sgd {
        self.momentum = m;
        self
    }
    /// With weight decay.
    pub fn weight_decay(mut self, wd: f64) -> Sgd {
        self.weight_decay = wd;
        self
    }
}

/// AdamW (Loshchilov & Hutter), with PyTorch's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f64,
    /// β1.
    pub beta1: f64,
    /// β2.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl AdamW {
    /// AdamW with β = (0.9, 0.999), ε = 1e-8, weight decay 0.01.
    pub fn new(lr: f64) -> AdamW {
        AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
    /// With weight decay.
    pub fn weight_decay(mut self, wd: f64) -> AdamW {
        self.weight_decay = wd;
        self
    }
}

impl From<Sgd> for Optimizer {
    fn from(s: Sgd) -> Optimizer {
        Optimizer::Sgd(s)
    }
}

impl From<AdamW> for Optimizer {
    fn from(a: AdamW) -> Optimizer {
        Optimizer::AdamW(a)
    }
}

/// Options of a training step.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct StepOptions {
    /// Clip gradients to this global L2 norm.
    pub clip_norm: Option<f64>,
    /// Data parallelism: average the gradients over the replicas (`all_reduce` in buckets)
    /// before anything else reads them.
    pub grad_sync: Option<GradSync>,
}

/// How a data-parallel step averages its gradients: one `all_reduce` (mean) per bucket, a
/// bucket being consecutive gradients of one dtype, taken from the last parameter to the first
/// (the order in which the backward finishes them) and flattened into one vector of at most
/// `bucket_bytes` (a larger gradient is a bucket of its own). Fewer, larger exchanges amortize
/// each collective's fixed cost; smaller ones can start earlier in the backward.
#[derive(Clone, Debug, PartialEq)]
pub struct GradSync {
    /// The largest bucket, in bytes.
    pub bucket_bytes: usize,
}

impl Default for GradSync {
    /// 25 MiB buckets (what PyTorch's DistributedDataParallel uses by default).
    fn default() -> GradSync {
        GradSync {
            bucket_bytes: 25 << 20,
        }
    }
}

/// The buckets of [`GradSync`] over gradients of these dtypes and byte sizes (in parameter
/// order): lists of gradient indices, the first bucket holding the last gradients.
pub fn grad_buckets(grads: &[(DType, usize)], bucket_bytes: usize) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = vec![];
    let mut open: Option<(DType, usize)> = None;
    for i in (0..grads.len()).rev() {
        let (dt, bytes) = grads[i];
        match (&mut open, buckets.last_mut()) {
            (Some((odt, used)), Some(b)) if *odt == dt && *used + bytes <= bucket_bytes => {
                *used += bytes;
                b.push(i);
            }
            _ => {
                buckets.push(vec![i]);
                open = Some((dt, bytes));
            }
        }
    }
    buckets
}

/// Handles to what a training step computes.
#[derive(Clone, Debug)]
pub struct TrainStep {
    /// Gradient of each trainable parameter as the update uses it (unscaled under loss scaling;
    /// clipped when clipping is on; in f32 for f16 and bf16 parameters), by parameter name.
    pub grads: Vec<(String, Tensor)>,
    /// The global L2 norm of the gradients (before clipping), in f64 when a parameter is f64,
    /// else in f32.
    pub grad_norm: Tensor,
}

/// The name of the node of value one that seeds a training step's backward (the loss's own
/// gradient); loss scaling replaces it with the scale.
pub const LOSS_SCALE_SEED: &str = "optim.loss_scale.seed";
/// The name of the scalar nodes of value one that multiply every gradient of a training step
/// before anything reads it; loss scaling replaces them with the reciprocal of the scale.
pub const LOSS_UNSCALE: &str = "optim.loss_scale.unscale";
/// The f32 state scalar holding the loss scale.
pub const LOSS_SCALE: &str = "optim.loss_scale";
/// The i64 state scalar counting the finite steps since the scale last changed (dynamic
/// scaling).
pub const LOSS_SCALE_GOOD_STEPS: &str = "optim.loss_scale.good_steps";
/// The i64 state scalar counting the steps skipped for a non-finite gradient (dynamic scaling).
pub const LOSS_SCALE_SKIPPED: &str = "optim.loss_scale.skipped";

/// How [`scale_loss`] scales a training step's loss.
#[derive(Clone, Debug, PartialEq)]
pub struct LossScaleSpec {
    /// The scale the state starts at.
    pub init: f64,
    /// Dynamic scaling: after `interval` consecutive finite steps the scale is multiplied by
    /// `factor` (in the graph, as a state update that commits with the step). `None` keeps the
    /// scale where it is.
    pub growth: Option<(f64, u64)>,
}

/// The state tensors [`scale_loss`] gave a training step, as parameter indices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LossScaleState {
    /// `optim.loss_scale` (f32 scalar).
    pub scale: usize,
    /// `optim.loss_scale.good_steps` and `optim.loss_scale.skipped` (i64 scalars), with
    /// dynamic scaling.
    pub counters: Option<(usize, usize)>,
}

/// Loss scaling of the training steps that [`GraphBuilder::train_step`] built into `graph`.
///
/// With a spec: the backward's seed becomes the state scalar `optim.loss_scale` (so every
/// gradient comes out multiplied by the scale, which keeps small f16 gradients from flushing to
/// zero), and every gradient is multiplied by its reciprocal, in f32 or the parameter's wider
/// dtype, before the guards, the norm, clipping and the update read it. The scale is a value,
/// not a constant: changing it never recompiles. With growth, the graph also counts finite
/// steps in `optim.loss_scale.good_steps` and grows the scale when the count reaches the
/// interval; backing off after a skipped step is the caller's (a skipped step commits nothing).
///
/// Without a spec, the marks are removed and the graph computes what it did before they were
/// added. A graph that already has an `optim.loss_scale` state (exported from a loss-scaled
/// executable) keeps its scaling. Returns the state, or `None` when the graph has no scaled
/// training step.
pub fn scale_loss(
    graph: &mut Graph,
    spec: Option<&LossScaleSpec>,
) -> Result<Option<LossScaleState>> {
    let index = |g: &Graph, name: &str| g.params.iter().position(|p| p.name == name);
    if let Some(scale) = index(graph, LOSS_SCALE) {
        let counters = index(graph, LOSS_SCALE_GOOD_STEPS).zip(index(graph, LOSS_SCALE_SKIPPED));
        return Ok(Some(LossScaleState { scale, counters }));
    }
    let marked = |g: &Graph, name: &str| -> Vec<NodeId> {
        g.node_ids()
            .into_iter()
            .filter(|&n| g.node(n).is_ok_and(|d| d.name.as_deref() == Some(name)))
            .collect()
    };
    let seeds = marked(graph, LOSS_SCALE_SEED);
    let unscales = marked(graph, LOSS_UNSCALE);
    let Some(spec) = spec else {
        // x · 1 → x, for every gradient.
        for u in unscales {
            for m in graph.users(u) {
                let g = graph
                    .node(m)?
                    .inputs
                    .iter()
                    .copied()
                    .find(|&i| i != u)
                    .unwrap_or(u);
                graph.replace_uses(m, g);
            }
        }
        graph.remove_dead();
        return Ok(None);
    };
    if seeds.is_empty() {
        return Ok(None);
    }
    if !(spec.init.is_finite() && spec.init > 0.0) {
        return Err(CompileError::Invalid(format!(
            "the initial loss scale must be finite and positive, got {}",
            spec.init
        )));
    }
    let b = GraphBuilder::from_graph(std::mem::take(graph));
    let scale = scalar_state(&b, LOSS_SCALE, DType::F32, spec.init);
    let in_dtype = |dt: DType| {
        if dt == DType::F32 {
            scale.clone()
        } else {
            scale.cast(dt)
        }
    };
    let mut swaps = Vec::new();
    for s in seeds {
        swaps.push((s, in_dtype(b.with_graph(|g| g.ty(s).dtype)).node()?));
    }
    for u in unscales {
        let dt = b.with_graph(|g| g.ty(u).dtype);
        swaps.push((u, in_dtype(dt).reciprocal().node()?));
    }
    b.with_graph(|g| {
        for &(old, new) in &swaps {
            g.replace_uses(old, new);
        }
    });
    let mut counters = None;
    if let Some((factor, interval)) = spec.growth {
        let good = scalar_state(&b, LOSS_SCALE_GOOD_STEPS, DType::I64, 0.0);
        // Counted by the caller, between runs.
        scalar_state(&b, LOSS_SCALE_SKIPPED, DType::I64, 0.0);
        let good1 = good.add_scalar(1.0);
        let grow = good1.ge_scalar(interval as f64);
        // Capped at f32's largest value: an infinite scale could never back off again.
        let grown = scale.mul_scalar(factor).minimum_scalar(f64::from(f32::MAX));
        b.update(&scale, &b.where_(&grow, &grown, &scale));
        b.update(&good, &b.where_(&grow, &b.scalar(0.0, DType::I64), &good1));
        counters = Some((
            b.with_graph(|g| index(g, LOSS_SCALE_GOOD_STEPS)),
            b.with_graph(|g| index(g, LOSS_SCALE_SKIPPED)),
        ));
    }
    *graph = b.graph()?;
    graph.remove_dead();
    let missing = || CompileError::Invalid("loss scaling lost its state tensors".into());
    Ok(Some(LossScaleState {
        scale: index(graph, LOSS_SCALE).ok_or_else(missing)?,
        counters: match counters {
            Some((Some(g), Some(s))) => Some((g, s)),
            Some(_) => return Err(missing()),
            None => None,
        },
    }))
}

fn scalar_state(b: &GraphBuilder, name: &str, dtype: DType, value: f64) -> Tensor {
    b.param_typed(
        name,
        TensorType::new(dtype, Shape::scalar()),
        Init::Full(value),
        false,
    )
}

/// The dtype a parameter's update computes in: f32 for the 16-bit float types, else its own.
fn compute_dtype(dt: DType) -> DType {
    match dt {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

impl GraphBuilder {
    /// A node of value one and type `ty` named `name` (a site that [`scale_loss`] rewrites).
    fn marked_one(&self, name: &str, ty: TensorType) -> Result<NodeId> {
        self.with_graph(|g| {
            let id = g.add(
                Op::Full {
                    value: F64Bits::new(1.0),
                    ty,
                },
                &[],
            )?;
            if let Some(n) = g.node_mut(id) {
                n.name = Some(name.to_string());
            }
            Ok(id)
        })
    }

    /// The gradients averaged over the replicas in the buckets of `sync` (see [`GradSync`]).
    /// Everything after this reads averaged gradients, so the finiteness guards, the norm and
    /// the updates agree on every replica: a NaN on one replica is a NaN in every average, and
    /// every replica skips the step.
    fn average_over_replicas(&self, grads: Vec<Tensor>, sync: &GradSync) -> Result<Vec<Tensor>> {
        let mut sizes = Vec::with_capacity(grads.len());
        for g in &grads {
            let ty = g
                .ty()
                .ok_or_else(|| CompileError::Grad("a gradient has no type".into()))?;
            sizes.push((ty.dtype, ty.size_bytes()));
        }
        let mut out: Vec<Option<Tensor>> = vec![None; grads.len()];
        for bucket in grad_buckets(&sizes, sync.bucket_bytes) {
            if let [i] = bucket[..] {
                out[i] = Some(grads[i].all_reduce(true));
                continue;
            }
            let flat: Vec<Tensor> = bucket
                .iter()
                .map(|&i| {
                    let n = grads[i].shape().map(|s| s.numel()).unwrap_or(0);
                    grads[i].reshape([n])
                })
                .collect();
            let parts: Vec<&Tensor> = flat.iter().collect();
            let averaged = self.concat(&parts, 0).all_reduce(true);
            let mut at = 0;
            for &i in &bucket {
                let shape = grads[i].shape().unwrap_or_else(Shape::scalar);
                let n = shape.numel();
                out[i] = Some(averaged.slice(0, at, at + n, 1).reshape(shape));
                at += n;
            }
        }
        Ok(out
            .into_iter()
            .map(|g| g.expect("every gradient is in a bucket"))
            .collect())
    }

    /// Adds to the graph the gradients of `loss` for every trainable parameter, a finiteness guard
    /// per gradient (named `grad:<param>`; a run whose gradients are not finite applies no update
    /// and reports the parameter), optional global-norm clipping, and the optimizer's updates.
    pub fn train_step(
        &self,
        loss: &Tensor,
        opt: impl Into<Optimizer>,
        opts: &StepOptions,
    ) -> Result<TrainStep> {
        let opt = opt.into();
        let loss_id = loss.node()?;
        self.check()?;
        let params: Vec<(String, crate::NodeId, TensorType)> = self.with_graph(|g| {
            g.params
                .iter()
                .filter(|p| p.trainable)
                .map(|p| (p.name.clone(), p.node, p.ty.clone()))
                .collect()
        });
        if params.is_empty() {
            return Err(CompileError::Grad(
                "the graph has no trainable parameters".into(),
            ));
        }
        let wrt: Vec<crate::NodeId> = params.iter().map(|p| p.1).collect();
        // The backward's seed and each gradient's unscaling are marked nodes of value one that
        // compile-time loss scaling replaces (see `scale_loss`).
        let loss_ty = loss
            .ty()
            .ok_or_else(|| CompileError::Grad("the loss has no type".into()))?;
        let seed = self.marked_one(LOSS_SCALE_SEED, loss_ty)?;
        let gids = self.with_graph(|g| autodiff::grad_seeded(g, loss_id, &wrt, seed))?;
        let mut grads: Vec<Tensor> = gids.iter().map(|&id| self.tensor(id)).collect();
        if let Some(sync) = &opts.grad_sync {
            grads = self.average_over_replicas(grads, sync)?;
        }
        // In the compute dtype (f32 for 16-bit parameters) and unscaled: everything after this
        // (guards, norm, clipping, updates) reads gradients in the loss's own units.
        let mut unscale: Vec<(DType, Tensor)> = Vec::new();
        let mut unscaled = Vec::with_capacity(grads.len());
        for (g, (_, _, ty)) in grads.into_iter().zip(&params) {
            let ct = compute_dtype(ty.dtype);
            let g = if ct != ty.dtype { g.cast(ct) } else { g };
            let u = match unscale.iter().find(|(d, _)| *d == ct) {
                Some((_, u)) => u.clone(),
                None => {
                    let id = self.marked_one(LOSS_UNSCALE, TensorType::new(ct, Shape::scalar()))?;
                    let u = self.tensor(id);
                    unscale.push((ct, u.clone()));
                    u
                }
            };
            unscaled.push(g.mul(&u));
        }
        let grads = unscaled;

        // The dtype of the shared scalars (global norm, clipping scale, bias corrections): f64
        // when a parameter is f64, so that f64 training is not rounded to f32 anywhere but in
        // the learning rate (an f32 state tensor); else f32.
        let wide = if params.iter().any(|p| p.2.dtype == DType::F64) {
            DType::F64
        } else {
            DType::F32
        };
        // Global norm and per-parameter finiteness guards.
        let mut sq: Option<Tensor> = None;
        for (g, (name, _, _)) in grads.iter().zip(&params) {
            let ok = g.all_finite();
            let gid = ok.node()?;
            self.with_graph(|gr| gr.guards.push((format!("grad:{name}"), gid)));
            let s = g.cast(wide).mul(&g.cast(wide)).sum_all();
            sq = Some(match sq {
                Some(a) => a.add(&s),
                None => s,
            });
        }
        let grad_norm = sq.expect("at least one parameter").sqrt();
        let scale = opts.clip_norm.map(|max| {
            grad_norm
                .add_scalar(1e-6)
                .reciprocal()
                .mul_scalar(max)
                .minimum_scalar(1.0)
        });

        let lr = scalar_state(self, "optim.lr", DType::F32, lr_of(&opt));
        let t = scalar_state(self, "optim.step", DType::I64, 0.0);
        let t1 = t.add_scalar(1.0);
        self.update(&t, &t1);
        // AdamW's bias corrections 1 − βᵗ as scalars of the wide dtype (the same for every
        // parameter), and the learning rate in that dtype.
        let lr_wide = if wide == DType::F32 {
            lr.clone()
        } else {
            lr.cast(wide)
        };
        let bias_corrections = match &opt {
            Optimizer::AdamW(a) => {
                let tf = t1.cast(wide);
                let bc = |beta: f64| self.scalar(beta, wide).pow(&tf).neg().add_scalar(1.0);
                Some((bc(a.beta1), bc(a.beta2)))
            }
            Optimizer::Sgd(_) => None,
        };

        let mut out = Vec::new();
        for (g, (name, pid, ty)) in grads.into_iter().zip(params) {
            let p = self.tensor(pid);
            let dt = ty.dtype;
            let ct = compute_dtype(dt);
            let cty = TensorType::new(ct, ty.shape.clone());
            let state = |what: &str| {
                self.param_typed(
                    &format!("optim.{what}.{name}"),
                    cty.clone(),
                    Init::zeros(),
                    false,
                )
            };
            let g = match &scale {
                Some(s) => g.mul(&s.cast(ct)),
                None => g,
            };
            // The value the update starts from, in the compute dtype: the parameter itself, or
            // the f32 master where it still rounds to the parameter (see the module docs).
            let (w, master) = if ct != dt {
                let master = state("master");
                let pc = p.cast(ct);
                let w = self.where_(&master.cast(dt).eq(&p), &master, &pc);
                (w, Some(master))
            } else {
                (p.clone(), None)
            };
            let lr_p = lr.cast(ct);
            let new_w = match &opt {
                Optimizer::Sgd(s) => {
                    let mut d = g.clone();
                    if s.weight_decay != 0.0 {
                        d = d.add(&w.mul_scalar(s.weight_decay));
                    }
                    if s.momentum != 0.0 {
                        let buf = state("momentum");
                        let nb = buf.mul_scalar(s.momentum).add(&d);
                        self.update(&buf, &nb);
                        d = nb;
                    }
                    w.sub(&d.mul(&lr_p))
                }
                Optimizer::AdamW(a) => {
                    let (bc1, bc2) = bias_corrections.as_ref().expect("AdamW");
                    let m = state("m");
                    let v = state("v");
                    let m1 = m.mul_scalar(a.beta1).add(&g.mul_scalar(1.0 - a.beta1));
                    let v1 = v
                        .mul_scalar(a.beta2)
                        .add(&g.mul(&g).mul_scalar(1.0 - a.beta2));
                    self.update(&m, &m1);
                    self.update(&v, &v1);
                    let step_size = lr_wide.div(bc1).cast(ct);
                    let denom = v1.div(&bc2.cast(ct)).sqrt().add_scalar(a.eps);
                    let decayed = w.mul(&lr_p.mul_scalar(a.weight_decay).neg().add_scalar(1.0));
                    decayed.sub(&m1.div(&denom).mul(&step_size))
                }
            };
            match master {
                Some(master) => {
                    self.update(&master, &new_w);
                    self.update(&p, &new_w.cast(dt));
                }
                None => self.update(&p, &new_w),
            }
            out.push((name, g));
        }
        self.check()?;
        Ok(TrainStep {
            grads: out,
            grad_norm,
        })
    }
}

fn lr_of(opt: &Optimizer) -> f64 {
    match opt {
        Optimizer::Sgd(s) => s.lr,
        Optimizer::AdamW(a) => a.lr,
    }
}
