//! The CPU backend: executes a plan step by step with the ops crate's kernels (each kernel is
//! multi-threaded with rayon and dispatches on dtype once per tensor), freeing every intermediate
//! right after its last use. Parameters and state stay host tensors owned by the session; a step's
//! updates replace them only when every guard passed.

use crate::{
    check_param_type, Backend, Device, MemoryStats, Result, RunOutput, RuntimeError, Session,
    TransferStats,
};
use rustytorch_codegen::{Plan, Source};
use rustytorch_ops::{eval_cpu, HostTensor};
use std::sync::Arc;

/// Executes plans on the host.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn prepare(&self, plan: Arc<Plan>, params: Vec<Arc<HostTensor>>) -> Result<Box<dyn Session>> {
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
        Ok(Box::new(CpuSession { plan, params }))
    }
}

/// A plan prepared on the host, owning its parameter and state tensors.
#[derive(Debug)]
pub struct CpuSession {
    plan: Arc<Plan>,
    params: Vec<Arc<HostTensor>>,
}

impl CpuSession {
    /// Executes every step; returns the values the caller reads after the run (outputs, updates,
    /// guards), indexed by value id.
    fn execute(&self, inputs: &[Arc<HostTensor>]) -> Result<Vec<Option<Arc<HostTensor>>>> {
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
        for (s, step) in plan.steps.iter().enumerate() {
            let out = {
                let ins: Vec<&HostTensor> = step
                    .inputs
                    .iter()
                    .map(|&v| vals[v].as_deref().expect("operand computed before use"))
                    .collect();
                let _span = tracing::trace_span!("kernel", step = s, op = step.op.name()).entered();
                eval_cpu(&step.op, &ins).map_err(|source| RuntimeError::Kernel {
                    step: s,
                    op: step.op.name(),
                    source,
                })?
            };
            vals[step.output] = Some(Arc::new(out));
            for &f in &step.frees {
                vals[f] = None;
            }
        }
        Ok(vals)
    }
}

impl Session for CpuSession {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn run(&mut self, inputs: &[Arc<HostTensor>]) -> Result<RunOutput> {
        let vals = self.execute(inputs)?;
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
        self.params[i] = Arc::new(value.clone());
        Ok(())
    }

    fn memory_stats(&self) -> Option<MemoryStats> {
        None
    }

    fn transfers(&self) -> TransferStats {
        TransferStats::default()
    }
}
