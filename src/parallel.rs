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
//! Replicas run either all on the host ([`Device::Cpu`], one per entry of the device list; the
//! group is a [`HostGroup`]) or all on CUDA devices, one replica per device: the group is then an
//! NCCL group ([`NcclRank`]), each session runs its `all_reduce` steps through NCCL on its own
//! device buffers, and rank 0's parameters reach the others by an NCCL broadcast.
//!
//! Several processes (one GPU each, on one machine or several) form one group with
//! [`DataParallel::from_env`], from the variables `torchrun` sets (see [`DistEnv`] and
//! `docs/distributed.md`).

use crate::executable::{compile_graph, CompileOptions, Executable, Outputs};
use crate::{Error, Graph, HostTensor, Result};
use rustytorch_ops::Op;
use rustytorch_runtime::cuda::nccl::{NcclRank, UniqueId};
use rustytorch_runtime::{Communicator, Device, HostGroup, RuntimeError};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// Replicas of one training graph that step together (see the module docs).
pub struct DataParallel {
    /// This process's replicas, in rank order.
    replicas: Vec<Executable>,
    ranks: Vec<Arc<dyn Communicator>>,
    /// The group rank of `replicas[0]` (0 unless the group spans several processes).
    first_rank: usize,
    /// Ranks in the group, over every process.
    world: usize,
}

/// Parses a device list such as `cpu,cpu` or `cuda:0,cuda:1` (the runner's `--devices`). The
/// list is all `cpu` or all CUDA devices, each CUDA device at most once.
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
    if !cuda.is_empty() && cuda.len() != devices.len() {
        return Err(invalid(format!(
            "--devices {list}: replicas run all on the cpu or all on CUDA devices, not both"
        )));
    }
    Ok(devices)
}

/// `cuda:0, cuda:1` for messages.
fn list_text(devices: &[Device]) -> String {
    devices
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The CUDA ordinals of `devices`, checked against the machine: every device exists (the
/// driver loads and counts enough GPUs) and none is listed twice.
pub fn cuda_ordinals(devices: &[Device]) -> Result<Vec<usize>> {
    let list = list_text(devices);
    let mut ordinals = Vec::with_capacity(devices.len());
    for d in devices {
        match d {
            Device::Cuda(o) if ordinals.contains(o) => {
                return Err(invalid(format!(
                    "data parallelism over {list}: {d} is listed twice"
                )))
            }
            Device::Cuda(o) => ordinals.push(*o),
            d => {
                return Err(invalid(format!(
                    "data parallelism over {list}: replicas run all on the cpu or all on CUDA \
                     devices; {d} is not a CUDA device"
                )))
            }
        }
    }
    let count = rustytorch_runtime::cuda_device_count()
        .map_err(|e| invalid(format!("data parallelism over {list} needs CUDA: {e}")))?;
    if let Some(o) = ordinals.iter().find(|&&o| o >= count) {
        return Err(invalid(format!(
            "data parallelism over {list}: cuda:{o} does not exist (this machine has {count} \
             CUDA device{}: {} asked for, one replica per GPU)",
            if count == 1 { "" } else { "s" },
            devices.len()
        )));
    }
    Ok(ordinals)
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
    ///
    /// The devices are all `cpu` (host replicas) or all CUDA devices, each once (one replica per
    /// GPU, through NCCL). A CUDA list is checked before anything is compiled: a device the
    /// machine lacks, or a missing NCCL library, is an error naming the list.
    pub fn new(graph: &Graph, devices: &[Device], opts: &CompileOptions) -> Result<DataParallel> {
        if devices.is_empty() {
            return Err(invalid("data parallelism needs at least one device".into()));
        }
        check_syncs(graph, devices.len())?;
        if devices.iter().all(|d| matches!(d, Device::Cpu)) {
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
            let world = replicas.len();
            return Ok(DataParallel {
                replicas,
                ranks,
                first_rank: 0,
                world,
            });
        }
        let ordinals = cuda_ordinals(devices)?;
        let ranks: Vec<Arc<dyn Communicator>> = NcclRank::group(&ordinals)
            .map_err(|e| invalid(format!("data parallelism over {}: {e}", list_text(devices))))?
            .into_iter()
            .map(|r| r as Arc<dyn Communicator>)
            .collect();
        DataParallel::on_ranks(graph, &ordinals, ranks, 0, ordinals.len(), opts)
    }

    /// One replica per CUDA device `ordinals[i]` joined to `ranks[i]`, every replica starting
    /// from group rank 0's parameters (an NCCL broadcast).
    fn on_ranks(
        graph: &Graph,
        ordinals: &[usize],
        ranks: Vec<Arc<dyn Communicator>>,
        first_rank: usize,
        world: usize,
        opts: &CompileOptions,
    ) -> Result<DataParallel> {
        let mut replicas = Vec::with_capacity(ordinals.len());
        for (&o, rank) in ordinals.iter().zip(&ranks) {
            let mut exe = compile_graph(graph, Device::Cuda(o), opts)?;
            exe.join_group(rank.clone())?;
            replicas.push(exe);
        }
        let mut dp = DataParallel {
            replicas,
            ranks,
            first_rank,
            world,
        };
        dp.broadcast_params()?;
        Ok(dp)
    }

    /// Runs `body(replica, its communicator)` for every local replica, each on its own thread
    /// (NCCL ranks of one process each need their own thread). A failure aborts the group; the
    /// first failure is returned, naming its rank.
    fn each_replica<T: Send>(
        &mut self,
        body: impl Fn(&mut Executable, &dyn Communicator) -> Result<T> + Sync,
    ) -> Result<Vec<T>> {
        let ranks = &self.ranks;
        let body = &body;
        let results: Vec<Result<T>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .replicas
                .iter_mut()
                .zip(ranks)
                .map(|(exe, rank)| {
                    s.spawn(move || {
                        let r = body(exe, rank.as_ref());
                        if let Err(e) = &r {
                            rank.abort(&format!("replica {} failed: {e}", rank.rank()));
                        }
                        r
                    })
                })
                .collect();
            handles
                .into_iter()
                .zip(ranks)
                .map(|(h, rank)| {
                    h.join().unwrap_or_else(|_| {
                        let r = rank.rank();
                        rank.abort(&format!("replica {r} panicked"));
                        Err(invalid(format!("replica {r} panicked")))
                    })
                })
                .collect()
        });
        // The first failure is the cause; the others' errors are its consequences.
        let mut outs = Vec::with_capacity(results.len());
        let mut cause: Option<(usize, Error, bool)> = None;
        for (i, r) in results.into_iter().enumerate() {
            match r {
                Ok(o) => outs.push(o),
                Err(e) => {
                    let aborted = e.to_string().contains("group was aborted");
                    if cause.as_ref().is_none_or(|c| c.2 && !aborted) {
                        cause = Some((self.first_rank + i, e, aborted));
                    }
                }
            }
        }
        match cause {
            Some((rank, e, _)) => Err(invalid(format!("replica {rank}: {e}"))),
            None => Ok(outs),
        }
    }

    /// Gives every replica group rank 0's parameters and state: an NCCL broadcast for CUDA
    /// replicas (every rank of every process takes part), a copy for host replicas.
    fn broadcast_params(&mut self) -> Result<()> {
        if !self.on_nccl() {
            let (first, rest) = self.replicas.split_at_mut(1);
            for r in rest {
                r.copy_params_from(&first[0])?;
            }
            return Ok(());
        }
        self.each_replica(|exe, rank| {
            for (name, value) in exe.params()? {
                let v = rank.broadcast(&value, 0)?;
                exe.set_param(&name, v)?;
            }
            Ok(())
        })?;
        Ok(())
    }

    /// Whether the replicas are CUDA sessions in an NCCL group.
    fn on_nccl(&self) -> bool {
        self.ranks[0].nccl().is_some()
    }

    /// The number of ranks in the group (over every process; see [`DataParallel::local`]).
    pub fn world(&self) -> usize {
        self.world
    }

    /// The replicas in this process (the group's ranks `first_rank..first_rank + local`).
    pub fn local(&self) -> usize {
        self.replicas.len()
    }

    /// The group rank of this process's first replica (0 unless the group spans processes).
    pub fn first_rank(&self) -> usize {
        self.first_rank
    }

    /// This process's replica `i` (group rank `first_rank + i`).
    pub fn replica(&self, i: usize) -> Option<&Executable> {
        self.replicas.get(i)
    }

    /// One step of every replica: each input (the whole batch, the same in every process) split
    /// along its first dim into [`shard`]s, one per group rank (scalars go to every replica);
    /// this process's replicas take their ranks' shards. Returns each local replica's outputs in
    /// rank order. If a replica fails, the group is aborted (the others stop at their next
    /// exchange) and the first error is returned, naming its rank.
    pub fn run(&mut self, inputs: &[(&str, HostTensor)]) -> Result<Vec<Outputs>> {
        let (world, first) = (self.world, self.first_rank);
        let mut shards: Vec<Vec<(&str, HostTensor)>> = vec![Vec::new(); self.local()];
        for (name, t) in inputs {
            for (i, s) in shards.iter_mut().enumerate() {
                s.push((name, shard(name, t, first + i, world)?));
            }
        }
        self.run_shards(shards)
    }

    /// One step with each local replica's inputs given as they are (`shards[i]` for replica
    /// `i`). On CUDA every replica's inputs must have the same names and types (NCCL reduces
    /// buffers of one size on every rank), checked before any replica starts.
    pub fn run_shards(&mut self, shards: Vec<Vec<(&str, HostTensor)>>) -> Result<Vec<Outputs>> {
        if shards.len() != self.local() {
            return Err(invalid(format!(
                "{} input sets for {} replicas",
                shards.len(),
                self.local()
            )));
        }
        if self.on_nccl() {
            let types = |s: &Vec<(&str, HostTensor)>| -> Vec<(String, String)> {
                s.iter()
                    .map(|(n, t)| (n.to_string(), t.ty().to_string()))
                    .collect()
            };
            let first = types(&shards[0]);
            if let Some((i, s)) = shards.iter().enumerate().find(|(_, s)| types(s) != first) {
                return Err(invalid(format!(
                    "replica {} has inputs {:?}, replica {} {:?}: CUDA replicas take inputs of \
                     the same types",
                    self.first_rank + i,
                    types(s),
                    self.first_rank,
                    first
                )));
            }
        }
        let slots: Vec<std::sync::Mutex<Option<Vec<(&str, HostTensor)>>>> = shards
            .into_iter()
            .map(|s| std::sync::Mutex::new(Some(s)))
            .collect();
        let first_rank = self.first_rank;
        let outs = self.each_replica(|exe, rank| {
            let i = rank.rank() - first_rank;
            let ins = slots[i]
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .unwrap_or_default();
            exe.run(&ins)
        })?;
        // The finiteness guards read averaged gradients, so every replica decides alike; a
        // disagreement would mean the replicas no longer hold the same parameters.
        if let Some(o) = outs.iter().find(|o| o.skipped != outs[0].skipped) {
            return Err(invalid(format!(
                "the replicas disagree on skipping the step ({:?} vs {:?}): their parameters \
                 have diverged",
                outs[0].skipped, o.skipped
            )));
        }
        Ok(outs)
    }

    /// This process's replica `i` on its own: it leaves the group for a group of one, so its
    /// `all_reduce` steps are the identity again (a copy on CUDA) and it runs alone (to
    /// evaluate or save the trained model).
    pub fn into_replica(mut self, i: usize) -> Result<Executable> {
        if i >= self.local() {
            return Err(invalid(format!("no replica {i} among {}", self.local())));
        }
        let mut exe = self.replicas.swap_remove(i);
        let alone: Arc<dyn Communicator> = HostGroup::ranks(1)?.remove(0);
        exe.join_group(alone)?;
        Ok(exe)
    }

    /// Rank 0's value of a parameter or state tensor (every replica holds the same).
    pub fn param(&self, name: &str) -> Option<HostTensor> {
        self.replicas[0].param(name)
    }

    /// Sets a parameter or state tensor on every replica of this process (with several
    /// processes, every process must set the same value).
    pub fn set_param(&mut self, name: &str, value: HostTensor) -> Result<()> {
        for r in &mut self.replicas {
            r.set_param(name, value.clone())?;
        }
        Ok(())
    }

    /// Saves group rank 0's parameters and state (see [`Executable::save_state`]); in the
    /// other processes of a multi-process group, writes nothing.
    pub fn save_state(&self, path: &Path) -> Result<()> {
        if self.first_rank == 0 {
            self.replicas[0].save_state(path)?;
        }
        Ok(())
    }

    /// Loads parameters and state into group rank 0 (see [`Executable::load_state`]) and gives
    /// them to every replica (an NCCL broadcast on CUDA: in a multi-process group, only rank 0's
    /// process reads the file, and every process must call this at the same time). Returns how
    /// many tensors rank 0 loaded (in the other processes: how many it received).
    pub fn load_state(&mut self, path: &Path) -> Result<usize> {
        // A failed load on rank 0 changes nothing and returns before any exchange (in a
        // multi-process group the other processes then wait in the broadcast until their
        // launcher ends them).
        let n = if self.first_rank == 0 {
            self.replicas[0].load_state(path)?
        } else {
            self.replicas[0].params()?.len()
        };
        self.broadcast_params()?;
        Ok(n)
    }

    /// A group of processes, one replica (one GPU) each, from the environment as `torchrun`
    /// sets it (see [`DistEnv`]): this process is rank `RANK` of `WORLD_SIZE` on `cuda:LOCAL_RANK`;
    /// the NCCL unique id comes from `RUSTYTORCH_NCCL_ID` or through the file named by
    /// `RUSTYTORCH_NCCL_ID_FILE` (rank 0 writes it, the others wait for it). Every process
    /// calls this with the same graph; all start from rank 0's parameters.
    pub fn from_env(graph: &Graph, opts: &CompileOptions) -> Result<DataParallel> {
        DataParallel::from_dist_env(graph, &DistEnv::from_env()?, opts)
    }

    /// [`DataParallel::from_env`] with the variables given.
    pub fn from_dist_env(
        graph: &Graph,
        env: &DistEnv,
        opts: &CompileOptions,
    ) -> Result<DataParallel> {
        check_syncs(graph, env.world)?;
        let device = Device::Cuda(env.local_rank);
        let ordinals = cuda_ordinals(&[device])?;
        let id = match &env.id {
            Some(hex) => hex.clone(),
            None => exchange_id(env, || {
                Ok(UniqueId::new()
                    .map_err(|e| invalid(format!("rank 0: {e}")))?
                    .to_hex())
            })?,
        };
        let id = UniqueId::from_hex(&id)?;
        let rank = NcclRank::from_rank(env.local_rank, env.rank, env.world, &id).map_err(|e| {
            invalid(format!(
                "rank {} of {} on {device}: joining the NCCL group: {e}",
                env.rank, env.world
            ))
        })?;
        let rank: Arc<dyn Communicator> = rank;
        DataParallel::on_ranks(graph, &ordinals, vec![rank], env.rank, env.world, opts)
    }
}

/// Refuses a training graph that several replicas would run without averaging its gradients.
fn check_syncs(graph: &Graph, world: usize) -> Result<()> {
    let syncs = graph
        .topo_order()?
        .into_iter()
        .any(|id| matches!(graph.node(id).map(|n| &n.op), Ok(Op::AllReduce { .. })));
    if world > 1 && !graph.updates.is_empty() && !syncs {
        return Err(invalid(
            "the graph updates parameters but never averages gradients (no all_reduce): \
             its replicas would train apart; build the step with StepOptions::grad_sync"
                .into(),
        ));
    }
    Ok(())
}

/// The variables that place this process in a multi-process group, as `torchrun` sets them.
#[derive(Clone, Debug, PartialEq)]
pub struct DistEnv {
    /// `RANK`: this process's rank in the group.
    pub rank: usize,
    /// `WORLD_SIZE`: processes in the group.
    pub world: usize,
    /// `LOCAL_RANK`: the CUDA device ordinal of this process (its rank among the processes of
    /// its machine).
    pub local_rank: usize,
    /// `RUSTYTORCH_NCCL_ID`: the NCCL unique id as hex text, when given directly.
    pub id: Option<String>,
    /// `RUSTYTORCH_NCCL_ID_FILE`: the file through which rank 0 hands the unique id to the
    /// others (on a file system every machine sees).
    pub id_file: Option<PathBuf>,
    /// `RUSTYTORCH_NCCL_ID_TIMEOUT` (seconds, default 300): how long the other ranks wait for
    /// rank 0's file.
    pub timeout: Duration,
}

impl DistEnv {
    /// From this process's environment.
    pub fn from_env() -> Result<DistEnv> {
        DistEnv::parse(|k| std::env::var(k).ok())
    }

    /// From the variables `get` returns (the environment, or a map in tests).
    pub fn parse(get: impl Fn(&str) -> Option<String>) -> Result<DistEnv> {
        let number = |k: &str| -> Result<usize> {
            let v = get(k).ok_or_else(|| {
                invalid(format!(
                    "{k} is not set: a multi-process group needs RANK, WORLD_SIZE and \
                     LOCAL_RANK (torchrun sets them), and RUSTYTORCH_NCCL_ID_FILE or \
                     RUSTYTORCH_NCCL_ID"
                ))
            })?;
            v.trim()
                .parse::<usize>()
                .map_err(|_| invalid(format!("{k}={v}: expected a non-negative integer")))
        };
        let (rank, world, local_rank) = (
            number("RANK")?,
            number("WORLD_SIZE")?,
            number("LOCAL_RANK")?,
        );
        if world == 0 || rank >= world {
            return Err(invalid(format!(
                "RANK={rank} with WORLD_SIZE={world}: the rank must be below the world size"
            )));
        }
        let id = get("RUSTYTORCH_NCCL_ID").filter(|s| !s.trim().is_empty());
        if let Some(hex) = &id {
            UniqueId::from_hex(hex)?;
        }
        let id_file = get("RUSTYTORCH_NCCL_ID_FILE")
            .filter(|s| !s.trim().is_empty())
            .map(PathBuf::from);
        if id.is_none() && id_file.is_none() && world > 1 {
            return Err(invalid(format!(
                "rank {rank} of {world}: set RUSTYTORCH_NCCL_ID_FILE to a path every process \
                 can read (rank 0 writes the NCCL unique id there), or RUSTYTORCH_NCCL_ID to \
                 the id itself"
            )));
        }
        let timeout = match get("RUSTYTORCH_NCCL_ID_TIMEOUT") {
            None => Duration::from_secs(300),
            Some(v) => Duration::from_secs_f64(
                v.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s > 0.0)
                    .ok_or_else(|| {
                        invalid(format!(
                            "RUSTYTORCH_NCCL_ID_TIMEOUT={v}: expected a positive number of seconds"
                        ))
                    })?,
            ),
        };
        Ok(DistEnv {
            rank,
            world,
            local_rank,
            id,
            id_file,
            timeout,
        })
    }
}

/// How much older than this process's wait a unique-id file may be and still be taken (older
/// files are left over from an earlier run).
const ID_FILE_SLACK: Duration = Duration::from_secs(120);

/// The group's unique id as hex text: rank 0 makes it with `make` and writes it to the id file
/// (atomically: a temporary file renamed over it); the other ranks poll the file until it holds
/// an id written since they started waiting (less [`ID_FILE_SLACK`]), up to the timeout.
/// A world of one makes its id without a file.
pub fn exchange_id(env: &DistEnv, make: impl FnOnce() -> Result<String>) -> Result<String> {
    if env.world == 1 && env.id_file.is_none() {
        return make();
    }
    let path = env.id_file.as_ref().ok_or_else(|| {
        invalid(format!(
            "rank {}: RUSTYTORCH_NCCL_ID_FILE is not set",
            env.rank
        ))
    })?;
    let io = |what: &str, e: std::io::Error| {
        invalid(format!("rank {}: {what} {}: {e}", env.rank, path.display()))
    };
    if env.rank == 0 {
        let hex = make()?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, format!("{hex}\n")).map_err(|e| io("writing", e))?;
        std::fs::rename(&tmp, path).map_err(|e| io("renaming a temporary file to", e))?;
        return Ok(hex);
    }
    let since = SystemTime::now()
        .checked_sub(ID_FILE_SLACK)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let start = std::time::Instant::now();
    loop {
        let fresh = std::fs::metadata(path)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t >= since);
        if fresh {
            if let Ok(text) = std::fs::read_to_string(path) {
                let hex = text.trim().to_string();
                if UniqueId::from_hex(&hex).is_ok() {
                    return Ok(hex);
                }
            }
        }
        if start.elapsed() >= env.timeout {
            return Err(invalid(format!(
                "rank {} of {}: no NCCL unique id appeared in {} within {:.0} s; is rank 0 \
                 running, with the same RUSTYTORCH_NCCL_ID_FILE on a file system both see?",
                env.rank,
                env.world,
                path.display(),
                env.timeout.as_secs_f64()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
