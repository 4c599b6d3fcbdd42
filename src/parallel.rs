//! Data parallelism: one training graph run by several replicas, each on its shard of the batch,
//! their gradients averaged in the graph before the optimizer reads them.
//!
//! The graph is one replica's step, built with [`crate::StepOptions::grad_sync`] so that its
//! gradients pass through `all_reduce` (mean) in buckets ([`crate::compiler::GradSync`]).
//! [`DataParallel`] compiles it once per device, makes every replica start from rank 0's
//! parameters, joins the replicas' sessions into one group, and runs a step by splitting each
//! input along its first dim into one shard per replica, running the replicas on their own
//! threads. Since every replica averages the same gradients and applies the same update, the
//! replicas' parameters stay bitwise equal; since the finiteness guards read averaged gradients,
//! a NaN on one replica makes every replica skip the step.
//!
//! Replicas run on the host ([`Device::Cpu`], one per entry of the device list; the group is a
//! [`HostGroup`]). CUDA devices are refused for now: their sessions do not yet run `all_reduce`
//! steps through NCCL (the collectives themselves exist: `rustytorch_runtime::cuda::nccl`).

use crate::executable::{compile_graph, CompileOptions, Executable, Outputs};
use crate::{Error, Graph, HostTensor, Result};
use rustytorch_ops::Op;
use rustytorch_runtime::{Communicator, Device, HostGroup, RuntimeError};
use std::path::Path;
use std::sync::Arc;

/// Replicas of one training graph that step together (see the module docs).
pub struct DataParallel {
    replicas: Vec<Executable>,
    ranks: Vec<Arc<dyn Communicator>>,
}

/// Parses a device list such as `cpu,cpu` or `cuda:0,cuda:1` (the runner's `--devices`).
pub fn parse_devices(list: &str) -> Result<Vec<Device>> {
    let mut devices = Vec::new();
    for d in list.split(',').map(str::trim) {
        devices.push(Device::parse(d).ok_or_else(|| {
            invalid(format!(
                "--devices {list}: `{d}` is not a device (cpu, cuda, cuda:N)"
            ))
        })?);
    }
    if let Some(d) = devices.iter().find(|d| matches!(d, Device::Auto)) {
        return Err(invalid(format!(
            "--devices {list}: `{d}` is not a device a replica can be placed on"
        )));
    }
    let cuda: Vec<&Device> = devices
        .iter()
        .filter(|d| matches!(d, Device::Cuda(_)))
        .collect();
    for (i, d) in cuda.iter().enumerate() {
        if cuda[..i].contains(d) {
            return Err(invalid(format!("--devices {list}: {d} is listed twice")));
        }
    }
    Ok(devices)
}

fn invalid(msg: String) -> Error {
    Error::Runtime(RuntimeError::Invalid(msg))
}

/// The shard of `t` for `rank` of `world`: rows `[rank·n/world, (rank+1)·n/world)` of its first
/// dim, which `world` must divide (replicas average their gradients with equal weights, which is
/// the full batch's mean only for equal shards). Scalars are replicated.
pub fn shard(name: &str, t: &HostTensor, rank: usize, world: usize) -> Result<HostTensor> {
    let dims = t.shape().dims().to_vec();
    let Some(&n) = dims.first() else {
        return Ok(t.clone());
    };
    if n % world != 0 {
        return Err(invalid(format!(
            "input `{name}`: its first dim ({n}) does not split into {world} equal shards"
        )));
    }
    let rows = n / world;
    let mut starts = vec![0; dims.len()];
    let mut ends = dims.clone();
    starts[0] = rank * rows;
    ends[0] = (rank + 1) * rows;
    let slice = Op::Slice {
        starts,
        ends,
        steps: vec![1; dims.len()],
    };
    Ok(rustytorch_ops::eval_cpu(&slice, &[t])?)
}

impl DataParallel {
    /// Compiles `graph` (one replica's step) for each of `devices` and joins the replicas into a
    /// group; every replica starts from rank 0's parameters.
    pub fn new(graph: &Graph, devices: &[Device], opts: &CompileOptions) -> Result<DataParallel> {
        if devices.is_empty() {
            return Err(invalid("data parallelism needs at least one device".into()));
        }
        if let Some(d) = devices.iter().find(|d| !matches!(d, Device::Cpu)) {
            return Err(invalid(format!(
                "data-parallel replicas run on the cpu for now; {d} sessions do not run \
                 all_reduce steps yet"
            )));
        }
        let syncs = graph
            .topo_order()?
            .into_iter()
            .any(|id| matches!(graph.node(id).map(|n| &n.op), Ok(Op::AllReduce { .. })));
        if devices.len() > 1 && !graph.updates.is_empty() && !syncs {
            return Err(invalid(
                "the graph updates parameters but never averages gradients (no all_reduce): \
                 its replicas would train apart; build the step with StepOptions::grad_sync"
                    .into(),
            ));
        }
        let ranks: Vec<Arc<dyn Communicator>> = HostGroup::ranks(devices.len())?
            .into_iter()
            .map(|r| r as Arc<dyn Communicator>)
            .collect();
        let mut replicas = Vec::with_capacity(devices.len());
        for (&device, rank) in devices.iter().zip(&ranks) {
            let mut exe = compile_graph(graph, device, opts)?;
            exe.join_group(rank.clone())?;
            replicas.push(exe);
        }
        let (first, rest) = replicas.split_at_mut(1);
        for r in rest {
            r.copy_params_from(&first[0])?;
        }
        Ok(DataParallel { replicas, ranks })
    }

    /// The number of replicas.
    pub fn world(&self) -> usize {
        self.replicas.len()
    }

    /// Replica `rank`'s executable.
    pub fn replica(&self, rank: usize) -> Option<&Executable> {
        self.replicas.get(rank)
    }

    /// One step of every replica: each input split along its first dim into [`shard`]s, one per
    /// replica (scalars go to every replica). Returns each replica's outputs in rank order. If a
    /// replica fails, the group is aborted (the others stop at their next exchange) and the
    /// first error is returned, naming its rank.
    pub fn run(&mut self, inputs: &[(&str, HostTensor)]) -> Result<Vec<Outputs>> {
        let world = self.world();
        let mut shards: Vec<Vec<(&str, HostTensor)>> = vec![Vec::new(); world];
        for (name, t) in inputs {
            for (rank, s) in shards.iter_mut().enumerate() {
                s.push((name, shard(name, t, rank, world)?));
            }
        }
        self.run_shards(shards)
    }

    /// One step with each replica's inputs given as they are (`shards[rank]`).
    pub fn run_shards(&mut self, shards: Vec<Vec<(&str, HostTensor)>>) -> Result<Vec<Outputs>> {
        if shards.len() != self.world() {
            return Err(invalid(format!(
                "{} input sets for {} replicas",
                shards.len(),
                self.world()
            )));
        }
        let ranks = &self.ranks;
        let results: Vec<Result<Outputs>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .replicas
                .iter_mut()
                .zip(shards)
                .enumerate()
                .map(|(rank, (exe, ins))| {
                    s.spawn(move || {
                        let r = exe.run(&ins);
                        if let Err(e) = &r {
                            ranks[rank].abort(&format!("replica {rank} failed: {e}"));
                        }
                        r
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| {
                    h.join().unwrap_or_else(|_| {
                        ranks[rank].abort(&format!("replica {rank} panicked"));
                        Err(invalid(format!("replica {rank} panicked")))
                    })
                })
                .collect()
        });
        // The first failure is the cause; the others' errors are its consequences.
        let mut outs = Vec::with_capacity(results.len());
        let mut cause: Option<(usize, Error, bool)> = None;
        for (rank, r) in results.into_iter().enumerate() {
            match r {
                Ok(o) => outs.push(o),
                Err(e) => {
                    let aborted = e.to_string().contains("group was aborted");
                    if cause.as_ref().is_none_or(|c| c.2 && !aborted) {
                        cause = Some((rank, e, aborted));
                    }
                }
            }
        }
        match cause {
            Some((rank, e, _)) => Err(invalid(format!("replica {rank}: {e}"))),
            None => Ok(outs),
        }
    }

    /// Replica `rank`'s executable on its own: it leaves the group for a group of one, so its
    /// `all_reduce` steps are the identity again and it runs alone (to evaluate or save the
    /// trained model).
    pub fn into_replica(mut self, rank: usize) -> Result<Executable> {
        if rank >= self.world() {
            return Err(invalid(format!("no replica {rank} among {}", self.world())));
        }
        let mut exe = self.replicas.swap_remove(rank);
        let alone: Arc<dyn Communicator> = HostGroup::ranks(1)?.remove(0);
        exe.join_group(alone)?;
        Ok(exe)
    }

    /// Rank 0's value of a parameter or state tensor (every replica holds the same).
    pub fn param(&self, name: &str) -> Option<HostTensor> {
        self.replicas[0].param(name)
    }

    /// Sets a parameter or state tensor on every replica.
    pub fn set_param(&mut self, name: &str, value: HostTensor) -> Result<()> {
        for r in &mut self.replicas {
            r.set_param(name, value.clone())?;
        }
        Ok(())
    }

    /// Saves rank 0's parameters and state (see [`Executable::save_state`]).
    pub fn save_state(&self, path: &Path) -> Result<()> {
        self.replicas[0].save_state(path)
    }

    /// Loads parameters and state into every replica (see [`Executable::load_state`]).
    pub fn load_state(&mut self, path: &Path) -> Result<usize> {
        let mut n = 0;
        for r in &mut self.replicas {
            n = r.load_state(path)?;
        }
        Ok(n)
    }
}
