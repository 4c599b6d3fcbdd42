//! Collectives across CUDA devices through NCCL (cudarc's result and sys layers, the library
//! loaded at run time and checked for presence like the others): device tensors
//! ([`DeviceTensor`]) and a communicator over the devices of one process ([`Collective::new`],
//! `ncclCommInitAll`) or one rank of a multi-process group ([`Collective::from_rank`], from a
//! [`UniqueId`] shared through a file or the environment). Each call enqueues one NCCL operation
//! per local rank on that device's stream, inside one group (one thread drives every device), and
//! returns: the operations are ordered with everything else on those streams (a later
//! [`DeviceTensor::to_host`] sees the result); [`Collective::synchronize`] waits for them.

use super::session::{dtoh, htod};
use super::GpuDevice;
use crate::pool::Block;
use crate::{Result, RuntimeError};
use cudarc::nccl::result as nr;
use cudarc::nccl::sys as ns;
use rustytorch_ops::{DType, HostTensor, TensorType};
use std::ffi::c_void;
use std::sync::Arc;

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
    /// The first local rank's number in the group (0 for a single-process group).
    first_rank: usize,
    world: usize,
}

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
        for (c, d) in self.comms.iter().zip(&self.devs) {
            let _ = d.bind();
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
            comms,
            devs,
            first_rank: 0,
            world: ordinals.len(),
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
            first_rank: rank,
            world,
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
