//! The CPU backend: executes a plan step by step with the ops crate's kernels (each kernel is
//! multi-threaded with rayon and dispatches on dtype once per tensor), freeing every intermediate
//! right after its last use (with the host allocator tuned to reuse those buffers:
//! [`rustytorch_ops::host_alloc`]). Parameters and state stay host tensors owned by the session; a step's
//! updates replace them only when every guard passed.
//!
//! A matmul whose B operand is a parameter or a constant (a weight) multiplies against a copy of
//! B packed once for the f32 kernel ([`rustytorch_ops::matmul::packed`]) instead of packing it on
//! every call; a parameter replaced by an update or [`Session::write_param`] is packed again
//! before the next run.
//!
//! In anomaly mode ([`CpuBackend::prepare_with`]) every step's result is checked for NaN and
//! infinite elements as it is produced, and the run stops at the first one with a
//! [`RuntimeError::NonFinite`]; for a fused kernel, the kernel's instructions are then evaluated
//! one by one to find the first whose value at that element is not finite.

use crate::{
    check_param_type, Backend, Communicator, Device, MemoryStats, Result, RunOutput, RuntimeError,
    Session, StepClock, StepTime, StepTimes, TransferStats,
};
use rustytorch_codegen::{Plan, Source};
use rustytorch_ops::matmul::{self, packed::PackedB};
use rustytorch_ops::{eval_cpu, Data, FusedKernel, HostTensor, Op, TensorType};
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

/// Executes plans on the host.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn prepare(&self, plan: Arc<Plan>, params: Vec<Arc<HostTensor>>) -> Result<Box<dyn Session>> {
        Ok(Box::new(self.prepare_with(plan, params, false)?))
    }
}

impl CpuBackend {
    /// [`Backend::prepare`], with anomaly mode on or off: when on, every step's result is checked
    /// for NaN and infinite elements and a run stops at the first with
    /// [`RuntimeError::NonFinite`].
    pub fn prepare_with(
        &self,
        plan: Arc<Plan>,
        params: Vec<Arc<HostTensor>>,
        anomaly: bool,
    ) -> Result<CpuSession> {
        if params.len() != plan.param_types.len() {
            return Err(RuntimeError::Invalid(format!(
                "the plan has {} parameter and state tensors, {} were given",
                plan.param_types.len(),
                params.len()
            )));
        }
        for (i, p) in params.iter().enumerate() {
            check_param_type(&plan, i, p)?;
        }
        // Kernel outputs are reused heap memory instead of fresh page-faulted mappings.
        rustytorch_ops::host_alloc::tune_for_tensors();
        let mut session = CpuSession {
            packed: vec![None; plan.steps.len()],
            plan,
            params,
            anomaly,
            timing: false,
            times: None,
            group: None,
        };
        session.pack_weights();
        Ok(session)
    }
}

/// The first NaN or infinite value found by anomaly mode.
#[derive(Clone, Debug, PartialEq)]
pub struct NonFiniteValue {
    /// The step that produced it.
    pub step: usize,
    /// The step's op (`fused` for a fused kernel).
    pub op: &'static str,
    /// The type of the step's result.
    pub ty: TensorType,
    /// Row-major index of the first non-finite element of the result.
    pub index: usize,
    /// That element (NaN, inf or -inf).
    pub value: f64,
    /// For a fused kernel: the first instruction whose value at `index` is not finite, and its
    /// op.
    pub instr: Option<(usize, &'static str)>,
}

impl fmt::Display for NonFiniteValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "step {} ({}) produced {} at element {} of its {} result",
            self.step, self.op, self.value, self.index, self.ty
        )?;
        if let Some((j, op)) = self.instr {
            write!(
                f,
                "; inside the kernel it first appears in instruction t{j} ({op})"
            )?;
        }
        Ok(())
    }
}

/// The row-major index and value of the first NaN or infinite element of `t` (None for integer
/// and bool tensors, which have none).
pub fn first_non_finite(t: &HostTensor) -> Option<(usize, f64)> {
    fn find<T: Copy>(
        v: &[T],
        finite: impl Fn(T) -> bool,
        f64_of: impl Fn(T) -> f64,
    ) -> Option<(usize, f64)> {
        v.iter()
            .position(|&x| !finite(x))
            .map(|i| (i, f64_of(v[i])))
    }
    match t.data() {
        Data::F32(v) => find(v, f32::is_finite, f64::from),
        Data::F64(v) => find(v, f64::is_finite, |x| x),
        Data::F16(v) => find(v, |x| x.is_finite(), f64::from),
        Data::BF16(v) => find(v, |x| x.is_finite(), f64::from),
        Data::I8(_)
        | Data::I16(_)
        | Data::I32(_)
        | Data::I64(_)
        | Data::U8(_)
        | Data::U16(_)
        | Data::U32(_)
        | Data::U64(_)
        | Data::Bool(_) => None,
    }
}

/// The first instruction of fused kernel `k` over `inputs` whose value at element `index` is not
/// finite: each prefix of the program is evaluated as a kernel of its own, so every instruction
/// computes exactly as inside the kernel (only the prefix's last value is rounded to its dtype).
pub fn fused_origin(k: &FusedKernel, inputs: &[&HostTensor], index: usize) -> Option<usize> {
    (0..k.instrs.len()).find(|&j| {
        let ins = &k.instrs[j];
        if !ins.dtype.is_float() {
            return false;
        }
        let prefix = FusedKernel {
            n_inputs: k.n_inputs,
            instrs: k.instrs[..=j].to_vec(),
            out: TensorType::new(ins.dtype, k.out.shape.clone()),
        };
        eval_cpu(&Op::Fused(Box::new(prefix)), inputs)
            .ok()
            .and_then(|v| v.to_f64_vec().get(index).copied())
            .is_some_and(|x| !x.is_finite())
    })
}

/// A plan prepared on the host, owning its parameter and state tensors.
#[derive(Debug)]
pub struct CpuSession {
    plan: Arc<Plan>,
    params: Vec<Arc<HostTensor>>,
    anomaly: bool,
    /// Whether runs measure each step's wall time.
    timing: bool,
    /// The step times of the last timed run, until taken.
    times: Option<StepTimes>,
    /// The data-parallel group whose ranks the `all_reduce` steps exchange with.
    group: Option<Arc<dyn Communicator>>,
    /// Per step: the B operand of a matmul whose B is a parameter or constant, packed for the
    /// f32 kernel.
    packed: Vec<Option<Packed>>,
}

/// A matmul's `trans_b` flag (how its B is packed).
fn trans_b(op: &Op) -> Option<bool> {
    match op {
        Op::Matmul { trans_b, .. } | Op::MatmulEpilogue { trans_b, .. } => Some(*trans_b),
        _ => None,
    }
}

/// A weight packed for the f32 matmul kernel, with the tensor it was packed from.
#[derive(Clone, Debug)]
struct Packed {
    from: Arc<HostTensor>,
    b: Arc<PackedB>,
}

impl CpuSession {
    /// Packs the B operand of every matmul step whose B is a parameter or constant, unless the
    /// packed copy is of the same tensor already (parameters replaced since are packed again).
    fn pack_weights(&mut self) {
        if !matmul::packed::available() {
            return;
        }
        let plan = &*self.plan;
        for (s, step) in plan.steps.iter().enumerate() {
            if !matches!(step.op, Op::Matmul { .. } | Op::MatmulEpilogue { .. }) {
                continue;
            }
            let b = match step.inputs.get(1).map(|&v| &plan.sources[v]) {
                Some(Source::Param(i)) => self.params.get(*i),
                Some(Source::Const(t)) => Some(t),
                _ => None,
            };
            let Some(b) = b else { continue };
            if self.packed[s]
                .as_ref()
                .is_some_and(|p| Arc::ptr_eq(&p.from, b))
            {
                continue;
            }
            // The same tensor with the same flags, packed for an earlier step, is shared.
            let same = (0..s).find_map(|e| {
                let p = self.packed[e].as_ref()?;
                (Arc::ptr_eq(&p.from, b) && trans_b(&plan.steps[e].op) == trans_b(&step.op))
                    .then(|| p.clone())
            });
            self.packed[s] = same.or_else(|| {
                matmul::prepack_b(&step.op, b).map(|pb| Packed {
                    from: b.clone(),
                    b: Arc::new(pb),
                })
            });
        }
    }

    /// Executes every step; returns the values the caller reads after the run (outputs, updates,
    /// guards), indexed by value id, and with step timing on, each step's wall time.
    #[allow(clippy::type_complexity)]
    fn execute(
        &self,
        inputs: &[Arc<HostTensor>],
    ) -> Result<(Vec<Option<Arc<HostTensor>>>, Option<StepTimes>)> {
        let origin = Instant::now();
        let plan = &*self.plan;
        if inputs.len() != plan.inputs.len() {
            return Err(RuntimeError::Invalid(format!(
                "the plan has {} inputs, {} were given",
                plan.inputs.len(),
                inputs.len()
            )));
        }
        for (t, (name, want)) in inputs.iter().zip(&plan.inputs) {
            if &t.ty() != want {
                return Err(RuntimeError::Invalid(format!(
                    "input `{name}`: expected {want}, got {}",
                    t.ty()
                )));
            }
        }
        let mut vals: Vec<Option<Arc<HostTensor>>> = Vec::with_capacity(plan.types.len());
        for src in &plan.sources {
            vals.push(match src {
                Source::Input(i) => Some(inputs[*i].clone()),
                Source::Param(i) => Some(self.params.get(*i).cloned().ok_or_else(|| {
                    RuntimeError::Invalid(format!("parameter #{i} was not provided"))
                })?),
                Source::Const(t) => Some(t.clone()),
                Source::Step(_) => None,
            });
        }
        let mut times = self.timing.then(|| Vec::with_capacity(plan.steps.len()));
        for (s, step) in plan.steps.iter().enumerate() {
            let start = times.as_ref().map(|_| Instant::now());
            let out = {
                let ins: Vec<&HostTensor> = step
                    .inputs
                    .iter()
                    .map(|&v| vals[v].as_deref().expect("operand computed before use"))
                    .collect();
                let _span = tracing::trace_span!("kernel", step = s, op = step.op.name()).entered();
                let prepacked = self.packed[s].as_ref().and_then(|p| {
                    matmul::cpu_prepacked(&step.op, &ins, &plan.types[step.output], &p.b)
                });
                let out = match (&step.op, &self.group) {
                    (Op::AllReduce { mean }, Some(group)) => group.all_reduce(ins[0], *mean)?,
                    // A reshape is a view: it shares its operand's storage.
                    (Op::Reshape { .. }, _) => HostTensor::reshaped_shared(
                        vals[step.inputs[0]]
                            .as_ref()
                            .expect("operand computed before use"),
                        plan.types[step.output].shape.clone(),
                    )
                    .map_err(|source| RuntimeError::Kernel {
                        step: s,
                        op: step.op.name(),
                        source,
                    })?,
                    _ if prepacked.is_some() => {
                        prepacked
                            .expect("checked")
                            .map_err(|source| RuntimeError::Kernel {
                                step: s,
                                op: step.op.name(),
                                source,
                            })?
                    }
                    _ => eval_cpu(&step.op, &ins).map_err(|source| RuntimeError::Kernel {
                        step: s,
                        op: step.op.name(),
                        source,
                    })?,
                };
                if self.anomaly {
                    if let Some((index, value)) = first_non_finite(&out) {
                        let instr = match &step.op {
                            Op::Fused(k) => {
                                fused_origin(k, &ins, index).map(|j| (j, k.instrs[j].op.name()))
                            }
                            _ => None,
                        };
                        return Err(RuntimeError::NonFinite(Box::new(NonFiniteValue {
                            step: s,
                            op: step.op.name(),
                            ty: out.ty(),
                            index,
                            value,
                            instr,
                        })));
                    }
                }
                out
            };
            vals[step.output] = Some(Arc::new(out));
            for &f in &step.frees {
                vals[f] = None;
            }
            if let (Some(times), Some(start)) = (times.as_mut(), start) {
                // Frees are part of the step: dropping a large buffer costs time too.
                times.push(StepTime {
                    step: s,
                    start_us: start.duration_since(origin).as_secs_f64() * 1e6,
                    dur_us: start.elapsed().as_secs_f64() * 1e6,
                });
            }
        }
        let times = times.map(|steps| StepTimes {
            clock: StepClock::Host,
            origin,
            steps,
        });
        Ok((vals, times))
    }
}

impl Session for CpuSession {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn run(&mut self, inputs: &[Arc<HostTensor>]) -> Result<RunOutput> {
        self.times = None;
        self.pack_weights();
        let (vals, times) = self.execute(inputs)?;
        self.times = times;
        let get = |v: usize| vals[v].clone().expect("root values are kept");
        let guards: Vec<(String, bool)> = self
            .plan
            .guards
            .iter()
            .map(|(name, v)| {
                let ok = get(*v).to_f64_vec().iter().all(|&x| x != 0.0);
                (name.clone(), ok)
            })
            .collect();
        let committed = guards.iter().all(|(_, ok)| *ok);
        if committed {
            for (p, v) in &self.plan.updates {
                self.params[*p] = get(*v);
            }
        }
        let outputs: Vec<Arc<HostTensor>> =
            self.plan.outputs.iter().map(|(_, v)| get(*v)).collect();
        // Without the intermediates, an output nothing else holds moves out without a copy.
        drop(vals);
        Ok(RunOutput {
            outputs: outputs.into_iter().map(Arc::unwrap_or_clone).collect(),
            guards,
            committed,
        })
    }

    fn read_param(&self, i: usize) -> Result<HostTensor> {
        self.params
            .get(i)
            .map(|t| (**t).clone())
            .ok_or_else(|| RuntimeError::Invalid(format!("no parameter #{i}")))
    }

    fn write_param(&mut self, i: usize, value: &HostTensor) -> Result<()> {
        check_param_type(&self.plan, i, value)?;
        // The session keeps storage of its own, never a view of another library's memory.
        self.params[i] = Arc::new(value.clone().into_owned());
        Ok(())
    }

    fn memory_stats(&self) -> Option<MemoryStats> {
        None
    }

    fn transfers(&self) -> TransferStats {
        TransferStats::default()
    }

    fn set_step_timing(&mut self, on: bool) -> bool {
        self.timing = on;
        if !on {
            self.times = None;
        }
        true
    }

    fn take_step_times(&mut self) -> Option<StepTimes> {
        self.times.take()
    }

    fn join(&mut self, group: Arc<dyn Communicator>) -> Result<()> {
        self.group = Some(group);
        Ok(())
    }
}
