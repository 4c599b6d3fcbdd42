//! Compiling a graph into an [`Executable`] and running it with host tensors. An executable owns its
//! parameter and optimizer state, which persists across runs and can be saved and loaded.

use crate::{Error, Result};
use rustytorch_codegen::{lower, Plan};
use rustytorch_compiler::{Graph, GraphBuilder, Tensor};
use rustytorch_ops::HostTensor;
use rustytorch_runtime::{Backend, CpuBackend, Device, RuntimeError};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// What to do when a gradient is NaN or infinite.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum NonFinitePolicy {
    /// Return [`Error::NonFinite`] naming the parameter (no update applied).
    #[default]
    Error,
    /// Skip the step's updates and report it in [`Outputs::skipped`].
    SkipStep,
}

/// Compile options.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// Run the e-graph optimizer and fusion.
    pub optimize: bool,
    /// Apply the graph's state updates (training); false compiles an inference executable of the
    /// same graph.
    pub updates: bool,
    /// Non-finite gradient policy.
    pub nonfinite: NonFinitePolicy,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            optimize: true,
            updates: true,
            nonfinite: NonFinitePolicy::Error,
        }
    }
}

impl CompileOptions {
    /// Without state updates (inference).
    pub fn inference() -> CompileOptions {
        CompileOptions {
            updates: false,
            ..CompileOptions::default()
        }
    }
}

/// The outputs of one run, by position or name.
#[derive(Clone, Debug)]
pub struct Outputs {
    names: Vec<String>,
    values: Vec<HostTensor>,
    /// When the step's updates were skipped: the parameter whose gradient was not finite.
    pub skipped: Option<String>,
}

impl Outputs {
    /// The output with this name.
    pub fn get(&self, name: &str) -> Option<&HostTensor> {
        self.names
            .iter()
            .position(|n| n == name)
            .map(|i| &self.values[i])
    }
    /// Names, in order.
    pub fn names(&self) -> &[String] {
        &self.names
    }
    /// Values, in order.
    pub fn into_vec(self) -> Vec<HostTensor> {
        self.values
    }
    /// (name, value) pairs.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &HostTensor)> {
        self.names.iter().map(|s| s.as_str()).zip(&self.values)
    }
    /// Number of outputs.
    pub fn len(&self) -> usize {
        self.values.len()
    }
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
}

impl std::ops::Index<usize> for Outputs {
    type Output = HostTensor;
    fn index(&self, i: usize) -> &HostTensor {
        &self.values[i]
    }
}

/// A compiled graph bound to a device, with its parameter state.
pub struct Executable {
    source: Graph,
    optimized: Graph,
    plan: Plan,
    backend: Box<dyn Backend>,
    params: Vec<Arc<HostTensor>>,
    opts: CompileOptions,
    report: rustytorch_compiler::passes::Report,
}

/// Compiles the graph of `g` computing `outputs` (named as declared with [`GraphBuilder::output`],
/// else `output0`, `output1`, ...), with default options.
pub fn compile(g: &GraphBuilder, outputs: &[&Tensor], device: Device) -> Result<Executable> {
    compile_with(g, outputs, device, &CompileOptions::default())
}

/// [`compile`] with options.
pub fn compile_with(
    g: &GraphBuilder,
    outputs: &[&Tensor],
    device: Device,
    opts: &CompileOptions,
) -> Result<Executable> {
    let mut graph = g.graph()?;
    let declared = std::mem::take(&mut graph.outputs);
    for (i, t) in outputs.iter().enumerate() {
        let id = t.node()?;
        let name = declared
            .iter()
            .find(|(_, n)| *n == id)
            .map(|(s, _)| s.clone())
            .unwrap_or_else(|| format!("output{i}"));
        graph.add_output(&name, id)?;
    }
    compile_graph(&graph, device, opts)
}

/// Compiles a whole graph (its own outputs), e.g. one loaded from a file.
pub fn compile_graph(graph: &Graph, device: Device, opts: &CompileOptions) -> Result<Executable> {
    let backend: Box<dyn Backend> = match device {
        Device::Cpu => Box::new(CpuBackend),
        Device::Cuda(i) => {
            let n = rustytorch_runtime::cuda_device_count()?;
            return Err(RuntimeError::Device(format!(
                "cuda:{i} requested ({n} CUDA devices visible), but this build executes on the CPU only; use Device::Cpu"
            ))
            .into());
        }
    };
    let mut source = graph.clone();
    if !opts.updates {
        source.updates.clear();
        source.guards.clear();
    }
    source.remove_dead();
    let popts = rustytorch_compiler::passes::Options {
        optimize: opts.optimize,
        ..Default::default()
    };
    let compiled = rustytorch_compiler::passes::run(&source, &popts)?;
    let plan = lower(&compiled.graph)?;
    let mut params = Vec::with_capacity(source.params.len());
    for p in &source.params {
        let v = match &p.data {
            Some(d) => d.clone(),
            None => p.init.materialize(&p.ty)?,
        };
        params.push(Arc::new(v));
    }
    Ok(Executable {
        source,
        optimized: compiled.graph,
        plan,
        backend,
        params,
        opts: opts.clone(),
        report: compiled.report,
    })
}

impl Executable {
    /// Runs the graph. `inputs` are matched by name; every graph input must be given with its
    /// declared dtype and shape. Applies the state updates unless a guard fails.
    pub fn run(&mut self, inputs: &[(&str, HostTensor)]) -> Result<Outputs> {
        let mut vals: Vec<Option<Arc<HostTensor>>> = vec![None; self.source.inputs.len()];
        for (name, t) in inputs {
            let Some(i) = self.source.inputs.iter().position(|d| d.name == *name) else {
                let known: Vec<&str> = self.source.inputs.iter().map(|d| d.name.as_str()).collect();
                return Err(Error::Input {
                    name: name.to_string(),
                    reason: format!("the graph has no such input (inputs: {})", known.join(", ")),
                });
            };
            let want = &self.source.inputs[i].ty;
            if &t.ty() != want {
                return Err(Error::Input {
                    name: name.to_string(),
                    reason: format!("expected {want}, got {}", t.ty()),
                });
            }
            vals[i] = Some(Arc::new(t.clone()));
        }
        let mut ins = Vec::with_capacity(vals.len());
        for (i, v) in vals.into_iter().enumerate() {
            let d = &self.source.inputs[i];
            ins.push(v.ok_or_else(|| Error::Input {
                name: d.name.clone(),
                reason: format!("missing (expected {})", d.ty),
            })?);
        }
        let r = self.backend.run(&self.plan, &ins, &self.params)?;
        let failed = r
            .guards
            .iter()
            .find(|(_, ok)| !ok)
            .map(|(n, _)| n.strip_prefix("grad:").unwrap_or(n).to_string());
        let skipped = match (&failed, self.opts.nonfinite) {
            (Some(p), NonFinitePolicy::Error) => return Err(Error::NonFinite { param: p.clone() }),
            (Some(p), NonFinitePolicy::SkipStep) => Some(p.clone()),
            (None, _) => {
                for (p, v) in r.updates {
                    self.params[p] = v;
                }
                None
            }
        };
        Ok(Outputs {
            names: self.plan.outputs.iter().map(|(n, _)| n.clone()).collect(),
            values: r.outputs.into_iter().map(Arc::unwrap_or_clone).collect(),
            skipped,
        })
    }

    /// The optimized, fused graph as IR text.
    pub fn optimized_ir(&self) -> String {
        rustytorch_compiler::text::print(&self.optimized)
    }

    /// The optimized graph.
    pub fn optimized_graph(&self) -> &Graph {
        &self.optimized
    }

    /// The lowered plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// What each compile pass did and how long it took.
    pub fn report(&self) -> &rustytorch_compiler::passes::Report {
        &self.report
    }

    /// The backend's name.
    pub fn device_name(&self) -> String {
        self.backend.name()
    }

    /// The current value of a parameter or state tensor.
    pub fn param(&self, name: &str) -> Option<&HostTensor> {
        let i = self.source.params.iter().position(|p| p.name == name)?;
        Some(&self.params[i])
    }

    /// Every parameter and state tensor by name.
    pub fn params(&self) -> Vec<(String, HostTensor)> {
        self.source
            .params
            .iter()
            .zip(&self.params)
            .map(|(d, v)| (d.name.clone(), (**v).clone()))
            .collect()
    }

    /// Sets a parameter or state tensor (type must match).
    pub fn set_param(&mut self, name: &str, value: HostTensor) -> Result<()> {
        let i = self
            .source
            .params
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| Error::Input {
                name: name.into(),
                reason: "no such parameter".into(),
            })?;
        let want = &self.source.params[i].ty;
        if &value.ty() != want {
            return Err(Error::Input {
                name: name.into(),
                reason: format!("expected {want}, got {}", value.ty()),
            });
        }
        self.params[i] = Arc::new(value);
        Ok(())
    }

    /// Copies every parameter that `other` has under the same name and type (e.g. from a training
    /// executable into an inference one). Returns how many were copied.
    pub fn copy_params_from(&mut self, other: &Executable) -> usize {
        let theirs: HashMap<&str, &Arc<HostTensor>> = other
            .source
            .params
            .iter()
            .map(|p| p.name.as_str())
            .zip(&other.params)
            .collect();
        let mut n = 0;
        for (d, v) in self.source.params.iter().zip(self.params.iter_mut()) {
            if let Some(t) = theirs.get(d.name.as_str()) {
                if t.ty() == d.ty {
                    *v = (*t).clone();
                    n += 1;
                }
            }
        }
        n
    }

    /// The source graph with the current parameter values embedded (to save a trained model).
    pub fn export_graph(&self) -> Graph {
        let mut g = self.source.clone();
        for (d, v) in g.params.iter_mut().zip(&self.params) {
            d.data = Some((**v).clone());
        }
        g
    }

    /// Saves every parameter and state tensor to a safetensors file.
    pub fn save_state(&self, path: &Path) -> Result<()> {
        crate::npy::save_safetensors(path, &self.params())
    }

    /// Loads parameters and state saved by [`Executable::save_state`]; every tensor of the file
    /// must match a parameter's name and type. Returns how many were loaded.
    pub fn load_state(&mut self, path: &Path) -> Result<usize> {
        let tensors = crate::npy::load_safetensors(path)?;
        let n = tensors.len();
        for (name, t) in tensors {
            self.set_param(&name, t)?;
        }
        Ok(n)
    }
}
