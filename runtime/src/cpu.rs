//! The CPU backend: executes a plan step by step with the ops crate's kernels (each kernel is
//! multi-threaded with rayon and dispatches on dtype once per tensor), freeing every intermediate
//! right after its last use.

use crate::{Backend, Result, RunResult, RuntimeError};
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

    fn run(
        &self,
        plan: &Plan,
        inputs: &[Arc<HostTensor>],
        params: &[Arc<HostTensor>],
    ) -> Result<RunResult> {
        let mut vals: Vec<Option<Arc<HostTensor>>> = Vec::with_capacity(plan.types.len());
        for src in &plan.sources {
            vals.push(match src {
                Source::Input(i) => Some(inputs.get(*i).cloned().ok_or_else(|| {
                    RuntimeError::Invalid(format!("input #{i} was not provided"))
                })?),
                Source::Param(i) => Some(params.get(*i).cloned().ok_or_else(|| {
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
        let get = |v: usize| vals[v].clone().expect("root values are kept");
        Ok(RunResult {
            outputs: plan.outputs.iter().map(|(_, v)| get(*v)).collect(),
            updates: plan.updates.iter().map(|(p, v)| (*p, get(*v))).collect(),
            guards: plan
                .guards
                .iter()
                .map(|(name, v)| {
                    let ok = get(*v).to_f64_vec().iter().all(|&x| x != 0.0);
                    (name.clone(), ok)
                })
                .collect(),
        })
    }
}
