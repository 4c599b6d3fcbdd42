//! Collectives across CUDA devices through NCCL (cudarc's result and sys layers, the library
//! loaded at run time and checked for presence like the others): device tensors
//! ([`DeviceTensor`]) and a communicator over the devices of one process ([`Collective::new`],
//! `ncclCommInitAll`) or one rank of a multi-process group ([`Collective::from_rank`], from a
//! [`UniqueId`] shared through a file or the environment). Each call enqueues one NCCL operation
//! per local rank on that device's stream, inside one group (one thread drives every device), and
//! returns: the operations are ordered with everything else on those streams (a later
//! [`DeviceTensor::to_host`] sees the result); [`Collective::synchronize`] waits for them.
//!
//! [`NcclRank`] is one rank of such a group, driven by its own thread: the communicator a CUDA
//! session joins ([`crate::Session::join`]) so that its plan's `all_reduce` steps reduce device
//! buffers in place on the session's stream ([`NcclRank::group`] for the devices of one process,
//! [`NcclRank::from_rank`] for one process of many). One thread per rank issuing its own calls is
//! NCCL's "one device per thread" model: no NCCL group is needed, and each communicator is used
//! by one thread at a time (a lock per communicator guards the enqueue).

use super::session::{dtoh, htod};
use super::GpuDevice;
use crate::pool::Block;
use crate::{Communicator, Result, RuntimeError};
use cudarc::nccl::result as nr;
use cudarc::nccl::sys as ns;
use rustytorch_ops::{DType, HostTensor, TensorType};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// A dense tensor in one CUDA device's memory (a block of its memory pool).
pub struct DeviceTensor {
    dev: Arc<GpuDevice>,
    ty: TensorType,
    block: Option<Block>,
}

impl std::fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceTensor({} on cuda:{})", self.ty, self.dev.ordinal)
    }
}

impl Drop for DeviceTensor {
    fn drop(&mut self) {
        if let Some(b) = self.block.take() {
            self.dev.free(b);
        }
    }
}

impl DeviceTensor {
    /// Copies `t` to CUDA device `ordinal`.
    pub fn upload(ordinal: usize, t: &HostTensor) -> Result<DeviceTensor> {
        let out = DeviceTensor::empty(ordinal, t.ty())?;
        htod(out.addr(), t, out.dev.stream.cu_stream())?;
        out.dev.sync()?;
        Ok(out)
    }

    /// A tensor of type `ty` on device `ordinal` (contents undefined).
    pub fn empty(ordinal: usize, ty: TensorType) -> Result<DeviceTensor> {
        let dev = GpuDevice::get(ordinal)?;
        dev.bind()?;
        let block = Some(dev.alloc(ty.size_bytes())?);
        Ok(DeviceTensor { dev, ty, block })
    }

    /// Copies the tensor to the host.
    pub fn to_host(&self) -> Result<HostTensor> {
        self.dev.bind()?;
        let t = dtoh(self.addr(), &self.ty, self.dev.stream.cu_stream())?;
        self.dev.sync()?;
        Ok(t)
    }

    /// The tensor's type.
    pub fn ty(&self) -> &TensorType {
        &self.ty
    }

    /// The device ordinal.
    pub fn device(&self) -> usize {
        self.dev.ordinal
    }

    fn addr(&self) -> u64 {
        self.block.as_ref().map_or(0, |b| b.addr)
    }
}

/// A reduction of a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Mean over the ranks (NCCL's average).
    Mean,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
    /// Product.
    Prod,
}

impl ReduceOp {
    fn nccl(self) -> ns::ncclRedOp_t {
        match self {
            ReduceOp::Sum => ns::ncclRedOp_t::ncclSum,
            ReduceOp::Mean => ns::ncclRedOp_t::ncclAvg,
            ReduceOp::Max => ns::ncclRedOp_t::ncclMax,
            ReduceOp::Min => ns::ncclRedOp_t::ncclMin,
            ReduceOp::Prod => ns::ncclRedOp_t::ncclProd,
        }
    }
}

fn nccl_type(d: DType) -> Result<ns::ncclDataType_t> {
    use ns::ncclDataType_t as T;
    Ok(match d {
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::U8 | DType::Bool => T::ncclUint8,
        DType::I8 => T::ncclInt8,
        DType::U32 => T::ncclUint32,
        DType::U64 => T::ncclUint64,
        d => {
            return Err(RuntimeError::Invalid(format!(
                "NCCL has no {d} element type"
            )))
        }
    })
}

fn nerr(what: &str) -> impl Fn(nr::NcclError) -> RuntimeError + '_ {
    move |e| RuntimeError::Device(format!("NCCL {what}: {:?}", e.0))
}

/// Checks that NCCL can be loaded.
fn nccl_present() -> Result<()> {
    // SAFETY: only tries to load the shared library.
    if unsafe { ns::is_culib_present() } {
        Ok(())
    } else {
        Err(RuntimeError::Device(
            "NCCL (libnccl) was not found: install NCCL 2.28 (for example the nvidia-nccl-cu13 \
             package) or add its folder to LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

/// The identifier every process of a multi-process group shares (rank 0 makes it with
/// [`UniqueId::new`] and hands it to the others, as hex text through a file or the environment).
#[derive(Clone, Copy)]
pub struct UniqueId(ns::ncclUniqueId);

impl UniqueId {
    /// A fresh identifier (on rank 0).
    pub fn new() -> Result<UniqueId> {
        nccl_present()?;
        nr::get_uniqueid().map(UniqueId).map_err(nerr("unique id"))
    }

    /// The identifier as 256 hex digits.
    pub fn to_hex(&self) -> String {
        self.0
            .internal
            .iter()
            .map(|&c| format!("{:02x}", c as u8))
            .collect()
    }

    /// Parses [`UniqueId::to_hex`]'s text.
    pub fn from_hex(s: &str) -> Result<UniqueId> {
        let s = s.trim();
        let bad =
            || RuntimeError::Invalid(format!("not an NCCL unique id (256 hex digits): `{s}`"));
        if s.len() != 256 || !s.is_ascii() {
            return Err(bad());
        }
        let mut id = ns::ncclUniqueId { internal: [0; 128] };
        for (i, c) in id.internal.iter_mut().enumerate() {
            *c = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())? as _;
        }
        Ok(UniqueId(id))
    }
}

/// One communicator per local device of a group.
pub struct Collective {
    comms: Vec<ns::ncclComm_t>,
    devs: Vec<Arc<GpuDevice>>,
    /// One lock per communicator, held while a call is enqueued on it (NCCL allows a
    /// communicator on any thread, one at a time); it holds whether the communicator is still
    /// live (false once aborted: the handle is freed and never used again).
    locks: Vec<Mutex<bool>>,
    /// The first local rank's number in the group (0 for a single-process group).
    first_rank: usize,
    world: usize,
    /// Why the group was aborted ([`Communicator::abort`] on one of its [`NcclRank`]s).
    aborted: Mutex<Option<String>>,
}

// SAFETY: the communicators are plain NCCL handles owned by this value and destroyed once, in
// Drop; every call on one happens with its lock held, so no two threads use a communicator at
// the same time (NCCL's rule), and the device handles are shared `GpuDevice`s.
unsafe impl Send for Collective {}
// SAFETY: as above: shared access goes through the per-communicator locks.
unsafe impl Sync for Collective {}

impl std::fmt::Debug for Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ords: Vec<usize> = self.devs.iter().map(|d| d.ordinal).collect();
        write!(
            f,
            "Collective(cuda {ords:?}, ranks {}.. of {})",
            self.first_rank, self.world
        )
    }
}

impl Drop for Collective {
    fn drop(&mut self) {
        let aborted = lock(&self.aborted).is_some();
        for ((c, d), live) in self.comms.iter().zip(&self.devs).zip(&self.locks) {
            if !*lock(live) {
                continue;
            }
            let _ = d.bind();
            if aborted {
                // Peers may be gone or stuck: abort (local, no waiting) instead of destroying.
                // SAFETY: a live communicator, freed once here and never used again.
                let _ = unsafe { nr::comm_abort(*c) };
                continue;
            }
            let _ = d.sync();
            // SAFETY: each communicator was created once and is destroyed once, its stream idle.
            let _ = unsafe { nr::comm_destroy(*c) };
        }
    }
}

impl Collective {
    /// A group over the CUDA devices `ordinals` of this process (rank i = `ordinals[i]`).
    pub fn new(ordinals: &[usize]) -> Result<Collective> {
        if ordinals.is_empty() {
            return Err(RuntimeError::Invalid(
                "a collective needs at least one device".into(),
            ));
        }
        let mut seen = ordinals.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != ordinals.len() {
            return Err(RuntimeError::Invalid(format!(
                "a collective's devices must differ: {ordinals:?}"
            )));
        }
        let devs = ordinals
            .iter()
            .map(|&o| GpuDevice::get(o))
            .collect::<Result<Vec<_>>>()?;
        nccl_present()?;
        let list: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        let mut comms = vec![std::ptr::null_mut(); list.len()];
        // SAFETY: `comms` has room for one communicator per listed device.
        unsafe { nr::comm_init_all(comms.as_mut_ptr(), list.len() as i32, list.as_ptr()) }
            .map_err(nerr("init"))?;
        Ok(Collective {
            locks: comms.iter().map(|_| Mutex::new(true)).collect(),
            comms,
            devs,
            first_rank: 0,
            world: ordinals.len(),
            aborted: Mutex::new(None),
        })
    }

    /// This process's rank `rank` of a group of `world` ranks (one per process), on CUDA device
    /// `ordinal`, joined through `id` (every rank passes the same one; the call returns once all
    /// have joined).
    pub fn from_rank(
        ordinal: usize,
        rank: usize,
        world: usize,
        id: &UniqueId,
    ) -> Result<Collective> {
        if rank >= world {
            return Err(RuntimeError::Invalid(format!(
                "rank {rank} of a group of {world}"
            )));
        }
        let dev = GpuDevice::get(ordinal)?;
        nccl_present()?;
        dev.bind()?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: writes one communicator; the context of `ordinal` is current.
        unsafe { nr::comm_init_rank(&mut comm, world as i32, id.0, rank as i32) }
            .map_err(nerr("init rank"))?;
        Ok(Collective {
            comms: vec![comm],
            devs: vec![dev],
            locks: vec![Mutex::new(true)],
            first_rank: rank,
            world,
            aborted: Mutex::new(None),
        })
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The local ranks' device ordinals.
    pub fn devices(&self) -> Vec<usize> {
        self.devs.iter().map(|d| d.ordinal).collect()
    }

    /// Checks one tensor per local rank, each on its rank's device, all of one dtype.
    fn check(&self, what: &str, ts: &[&DeviceTensor]) -> Result<DType> {
        if ts.len() != self.devs.len() {
            return Err(RuntimeError::Invalid(format!(
                "{what}: {} tensors for {} local ranks",
                ts.len(),
                self.devs.len()
            )));
        }
        for (t, d) in ts.iter().zip(&self.devs) {
            if t.dev.ordinal != d.ordinal {
                return Err(RuntimeError::Invalid(format!(
                    "{what}: {t:?} given for the rank on cuda:{}",
                    d.ordinal
                )));
            }
            if t.ty.dtype != ts[0].ty.dtype {
                return Err(RuntimeError::Invalid(format!(
                    "{what}: {t:?} and {:?} differ in dtype",
                    ts[0]
                )));
            }
        }
        Ok(ts[0].ty.dtype)
    }

    /// Enqueues `call(local rank, communicator, stream)` for every local rank in one NCCL group.
    fn grouped(
        &self,
        what: &str,
        call: impl Fn(
            usize,
            ns::ncclComm_t,
            ns::cudaStream_t,
        ) -> std::result::Result<nr::NcclStatus, nr::NcclError>,
    ) -> Result<()> {
        self.check_live()?;
        let held: Vec<_> = self.locks.iter().map(lock).collect();
        if held.iter().any(|live| !**live) {
            return Err(RuntimeError::Invalid(format!(
                "{what}: a communicator of the group was aborted"
            )));
        }
        nr::group_start().map_err(nerr(what))?;
        let mut first_err = None;
        for (i, (c, d)) in self.comms.iter().zip(&self.devs).enumerate() {
            if let Err(e) = d.bind() {
                first_err.get_or_insert(e);
                continue;
            }
            if let Err(e) = call(i, *c, d.stream.cu_stream() as ns::cudaStream_t) {
                first_err.get_or_insert(nerr(what)(e));
            }
        }
        let end = nr::group_end().map_err(nerr(what));
        if let Some(e) = first_err {
            return Err(e);
        }
        end?;
        Ok(())
    }

    /// An error once the group was aborted.
    fn check_live(&self) -> Result<()> {
        match &*lock(&self.aborted) {
            Some(why) => Err(RuntimeError::Invalid(format!(
                "the data-parallel group was aborted: {why}"
            ))),
            None => Ok(()),
        }
    }

    /// Waits until every operation enqueued on the local devices' streams has finished.
    pub fn synchronize(&self) -> Result<()> {
        for d in &self.devs {
            d.bind()?;
            d.sync()?;
        }
        Ok(())
    }

    /// Reduces `bufs` (one per local rank, equal types) across the group with `op`, in place.
    pub fn all_reduce(&self, bufs: &mut [DeviceTensor], op: ReduceOp) -> Result<()> {
        let refs: Vec<&DeviceTensor> = bufs.iter().collect();
        let dt = self.check("all_reduce", &refs)?;
        same_shapes("all_reduce", &refs)?;
        let (ty, n) = (nccl_type(dt)?, refs[0].ty.shape.numel());
        let ptrs: Vec<u64> = refs.iter().map(|t| t.addr()).collect();
        self.grouped("all_reduce", |i, c, s| {
            // SAFETY: in place over a live buffer of `n` elements of `ty` on this rank's device.
            unsafe {
                nr::all_reduce(
                    ptrs[i] as *const c_void,
                    ptrs[i] as *mut c_void,
                    n,
                    ty,
                    op.nccl(),
                    c,
                    s,
                )
            }
        })
    }

    /// Copies group rank `root`'s tensor into every rank's (one per local rank, equal types).
    pub fn broadcast(&self, bufs: &mut [DeviceTensor], root: usize) -> Result<()> {
        if root >= self.world {
            return Err(RuntimeError::Invalid(format!(
                "broadcast: root {root} of a group of {}",
                self.world
            )));
        }
        let refs: Vec<&DeviceTensor> = bufs.iter().collect();
        let dt = self.check("broadcast", &refs)?;
        same_shapes("broadcast", &refs)?;
        let (ty, n) = (nccl_type(dt)?, refs[0].ty.shape.numel());
        let ptrs: Vec<u64> = refs.iter().map(|t| t.addr()).collect();
        self.grouped("broadcast", |i, c, s| {
            // SAFETY: in place over a live buffer of `n` elements of `ty` on this rank's device.
            unsafe {
                nr::broadcast(
                    ptrs[i] as *const c_void,
                    ptrs[i] as *mut c_void,
                    n,
                    ty,
                    root as i32,
                    c,
                    s,
                )
            }
        })
    }

    /// Rank r's `recv` gets the r-th of `world` equal slices (in row-major order) of the
    /// reduction of every rank's `send`.
    pub fn reduce_scatter(
        &self,
        send: &[DeviceTensor],
        recv: &mut [DeviceTensor],
        op: ReduceOp,
    ) -> Result<()> {
        let (s, r): (Vec<&DeviceTensor>, Vec<&DeviceTensor>) =
            (send.iter().collect(), recv.iter().collect());
        let dt = self.check("reduce_scatter", &s)?;
        self.check("reduce_scatter", &r)?;
        same_shapes("reduce_scatter", &s)?;
        same_shapes("reduce_scatter", &r)?;
        let n = r[0].ty.shape.numel();
        if r[0].ty.dtype != dt || s[0].ty.shape.numel() != n * self.world {
            return Err(RuntimeError::Invalid(format!(
                "reduce_scatter: {:?} does not split into {} slices of {:?}",
                s[0], self.world, r[0]
            )));
        }
        let ty = nccl_type(dt)?;
        let (sp, rp): (Vec<u64>, Vec<u64>) = (
            s.iter().map(|t| t.addr()).collect(),
            r.iter().map(|t| t.addr()).collect(),
        );
        self.grouped("reduce_scatter", |i, c, st| {
            // SAFETY: live buffers of world·n and n elements of `ty` on this rank's device.
            unsafe {
                nr::reduce_scatter(
                    sp[i] as *const c_void,
                    rp[i] as *mut c_void,
                    n,
                    ty,
                    op.nccl(),
                    c,
                    st,
                )
            }
        })
    }

    /// Rank r's `recv` is every rank's `send` concatenated in rank order.
    pub fn all_gather(&self, send: &[DeviceTensor], recv: &mut [DeviceTensor]) -> Result<()> {
        let (s, r): (Vec<&DeviceTensor>, Vec<&DeviceTensor>) =
            (send.iter().collect(), recv.iter().collect());
        let dt = self.check("all_gather", &s)?;
        self.check("all_gather", &r)?;
        same_shapes("all_gather", &s)?;
        same_shapes("all_gather", &r)?;
        let n = s[0].ty.shape.numel();
        if r[0].ty.dtype != dt || r[0].ty.shape.numel() != n * self.world {
            return Err(RuntimeError::Invalid(format!(
                "all_gather: {:?} does not hold {} copies of {:?}",
                r[0], self.world, s[0]
            )));
        }
        let ty = nccl_type(dt)?;
        let (sp, rp): (Vec<u64>, Vec<u64>) = (
            s.iter().map(|t| t.addr()).collect(),
            r.iter().map(|t| t.addr()).collect(),
        );
        self.grouped("all_gather", |i, c, st| {
            // SAFETY: live buffers of n and world·n elements of `ty` on this rank's device.
            unsafe { nr::all_gather(sp[i] as *const c_void, rp[i] as *mut c_void, n, ty, c, st) }
        })
    }
}

fn same_shapes(what: &str, ts: &[&DeviceTensor]) -> Result<()> {
    match ts.iter().find(|t| t.ty.shape != ts[0].ty.shape) {
        Some(t) => Err(RuntimeError::Invalid(format!(
            "{what}: {t:?} and {:?} differ in shape",
            ts[0]
        ))),
        None => Ok(()),
    }
}

/// Locks `m`, taking the value of a poisoned lock (the guarded values are plain flags).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One rank of an NCCL group, on one CUDA device, driven by one thread (see the module docs):
/// the [`Communicator`] a CUDA session joins to run its `all_reduce` steps on device buffers.
///
/// Its host-tensor collectives ([`Communicator::all_reduce`], [`Communicator::broadcast`]) stage
/// the tensor through device memory (for start-up work such as broadcasting the parameters);
/// every rank must call them at the same time, each from its own thread.
pub struct NcclRank {
    group: Arc<Collective>,
    /// This rank's index among the group's local communicators.
    local: usize,
}

impl std::fmt::Debug for NcclRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclRank({} of {} on cuda:{})",
            self.rank(),
            self.group.world,
            self.ordinal()
        )
    }
}

impl NcclRank {
    /// One rank per device of `ordinals`, all in this process (rank i on `ordinals[i]`), from one
    /// `ncclCommInitAll`. Each rank is then driven by its own thread.
    pub fn group(ordinals: &[usize]) -> Result<Vec<Arc<NcclRank>>> {
        let group = Arc::new(Collective::new(ordinals)?);
        Ok((0..ordinals.len())
            .map(|local| {
                Arc::new(NcclRank {
                    group: group.clone(),
                    local,
                })
            })
            .collect())
    }

    /// Rank `rank` of a group of `world` processes, on device `ordinal`, joined through `id`
    /// (every process passes the same; returns once all have joined).
    pub fn from_rank(
        ordinal: usize,
        rank: usize,
        world: usize,
        id: &UniqueId,
    ) -> Result<Arc<NcclRank>> {
        Ok(Arc::new(NcclRank {
            group: Arc::new(Collective::from_rank(ordinal, rank, world, id)?),
            local: 0,
        }))
    }

    /// The CUDA device ordinal of this rank.
    pub fn ordinal(&self) -> usize {
        self.group.devs[self.local].ordinal
    }

    /// Enqueues `call(communicator, stream)` on this rank's communicator and device stream.
    fn enqueue(
        &self,
        what: &str,
        stream: ns::cudaStream_t,
        call: impl FnOnce(
            ns::ncclComm_t,
            ns::cudaStream_t,
        ) -> std::result::Result<nr::NcclStatus, nr::NcclError>,
    ) -> Result<()> {
        self.group.check_live()?;
        let live = lock(&self.group.locks[self.local]);
        if !*live {
            return Err(RuntimeError::Invalid(format!(
                "{what}: the communicator of rank {} was aborted",
                self.rank()
            )));
        }
        call(self.group.comms[self.local], stream).map_err(nerr(what))?;
        Ok(())
    }

    /// Waits until `stream` (this rank's device's, its context current) has finished its work,
    /// watching the group meanwhile: once a rank of this process aborted the group
    /// ([`Communicator::abort`]), this rank's communicator is aborted too, which ends an NCCL
    /// collective it waits in (a peer that failed before reaching it would otherwise leave it
    /// waiting forever), and the wait returns the abort's error.
    pub fn wait(&self, stream: u64) -> Result<()> {
        use cudarc::driver::sys as ds;
        let start = std::time::Instant::now();
        loop {
            // SAFETY: the caller's stream is live on the current context; a query only reads.
            match unsafe { ds::cuStreamQuery(stream as ds::CUstream) } {
                ds::CUresult::CUDA_SUCCESS => return Ok(()),
                ds::CUresult::CUDA_ERROR_NOT_READY => {}
                e => {
                    return Err(RuntimeError::Device(format!(
                        "rank {}: waiting for cuda:{}: {e:?}",
                        self.rank(),
                        self.ordinal()
                    )))
                }
            }
            if let Err(e) = self.group.check_live() {
                self.abort_comm();
                // The aborted collective ends; let the stream drain before its buffers are
                // reused.
                // SAFETY: as above.
                let _ = unsafe { ds::cuStreamSynchronize(stream as ds::CUstream) };
                return Err(e);
            }
            // Spin briefly (a collective usually ends within microseconds), then poll gently.
            if start.elapsed() < std::time::Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }

    /// Aborts this rank's communicator (once): NCCL ends its pending operations and frees it.
    fn abort_comm(&self) {
        let mut live = lock(&self.group.locks[self.local]);
        if *live {
            // SAFETY: a live communicator, used by no other thread while its lock is held, and
            // never used again (marked dead).
            let _ = unsafe { nr::comm_abort(self.group.comms[self.local]) };
            *live = false;
        }
    }

    /// Enqueues the all-reduce of `ty.numel()` elements of type `ty` from device address `send`
    /// into `recv` (the same address for in place) on `stream`, a stream of this rank's device
    /// whose context is current. With `mean`, NCCL's average (`ncclAvg`: for floating-point
    /// types the inputs are scaled by 1/world and summed, one pass, and every rank receives the
    /// same bits); else the sum.
    ///
    /// # Safety
    /// `send` and `recv` must address live device memory of `ty.size_bytes()` bytes on this
    /// rank's device, left untouched by other work until the operation completes on `stream`.
    pub unsafe fn all_reduce_raw(
        &self,
        send: u64,
        recv: u64,
        ty: &TensorType,
        mean: bool,
        stream: u64,
    ) -> Result<()> {
        let dt = nccl_type(ty.dtype)?;
        let op = if mean { ReduceOp::Mean } else { ReduceOp::Sum };
        let n = ty.shape.numel();
        self.enqueue("all_reduce", stream as ns::cudaStream_t, |c, s| {
            // SAFETY: the caller guarantees both buffers (see the function's contract).
            unsafe {
                nr::all_reduce(
                    send as *const c_void,
                    recv as *mut c_void,
                    n,
                    dt,
                    op.nccl(),
                    c,
                    s,
                )
            }
        })
    }

    /// `t` staged on this rank's device, `op` run over it in place, and the result read back.
    fn staged(
        &self,
        t: &HostTensor,
        what: &str,
        op: impl FnOnce(ns::ncclComm_t, ns::cudaStream_t, u64, usize, ns::ncclDataType_t) -> NcclCall,
    ) -> Result<HostTensor> {
        self.group.check_live()?;
        let dt = nccl_type(t.dtype())?;
        let buf = DeviceTensor::upload(self.ordinal(), t)?;
        let dev = &self.group.devs[self.local];
        let (addr, n) = (buf.addr(), t.ty().shape.numel());
        let stream = dev.stream.cu_stream();
        self.enqueue(what, stream as ns::cudaStream_t, |c, s| {
            op(c, s, addr, n, dt)
        })?;
        self.wait(stream as u64)?;
        buf.to_host()
    }
}

/// The result of one raw NCCL call.
type NcclCall = std::result::Result<nr::NcclStatus, nr::NcclError>;

impl Communicator for NcclRank {
    fn rank(&self) -> usize {
        self.group.first_rank + self.local
    }

    fn world(&self) -> usize {
        self.group.world
    }

    fn all_reduce(&self, t: &HostTensor, mean: bool) -> Result<HostTensor> {
        crate::collective::check_all_reduce(t)?;
        let op = if mean { ReduceOp::Mean } else { ReduceOp::Sum };
        self.staged(t, "all_reduce", |c, s, addr, n, dt| {
            // SAFETY: in place over the staging buffer of `n` elements of `dt`, freed only
            // after the stream synchronized (in `to_host`).
            unsafe {
                nr::all_reduce(
                    addr as *const c_void,
                    addr as *mut c_void,
                    n,
                    dt,
                    op.nccl(),
                    c,
                    s,
                )
            }
        })
    }

    fn broadcast(&self, t: &HostTensor, root: usize) -> Result<HostTensor> {
        crate::collective::check_root(root, self.group.world)?;
        self.staged(t, "broadcast", |c, s, addr, n, dt| {
            // SAFETY: in place over the staging buffer of `n` elements of `dt`, freed only
            // after the stream synchronized (in `to_host`).
            unsafe {
                nr::broadcast(
                    addr as *const c_void,
                    addr as *mut c_void,
                    n,
                    dt,
                    root as i32,
                    c,
                    s,
                )
            }
        })
    }

    /// Marks the group failed and aborts this rank's communicator (ending an NCCL collective
    /// it left pending): later collectives of every local rank return an error without calling
    /// NCCL, and a rank waiting in one ([`NcclRank::wait`]) aborts its own communicator to end
    /// it. Ranks in other processes are not told (their launcher ends them).
    fn abort(&self, why: &str) {
        lock(&self.group.aborted).get_or_insert_with(|| why.to_string());
        self.abort_comm();
    }

    fn nccl(&self) -> Option<&NcclRank> {
        Some(self)
    }
}
