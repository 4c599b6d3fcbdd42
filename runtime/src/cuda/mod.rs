//! The CUDA backend on cudarc 0.19 (`dynamic-loading`: the build never needs CUDA; every library
//! is checked with `is_culib_present()` before first use and its absence is a clear error).
//!
//! One [`GpuDevice`] per ordinal is shared by every session in the process: its context (event
//! tracking off — the runtime orders work itself), one stream, the caching memory pool, the NVRTC
//! compiler with its cubin cache, loaded kernels, and cuBLASLt. A [`CudaSession`] owns, from the
//! pool, one arena for every intermediate value (offsets from the compiler's memory plan), one
//! buffer per input, parameter/state tensor and constant, and a scratch buffer; every kernel
//! argument is therefore resolved once, at prepare time, and a run is: copy inputs in, launch,
//! copy outputs and guard flags out, and commit updates with device-to-device copies.

pub mod blas;
pub mod compile;
pub mod dnn;
mod dnn_attention;
mod dnn_graph;
pub mod nccl;
mod session;
pub mod sparse;

pub use blas::matmul_choices;
pub use dnn_attention::attention_choices;
pub use nccl::{Collective, DeviceTensor, ReduceOp, UniqueId};
pub use session::CudaSession;
pub use sparse::DeviceCsr;

use crate::pool::{Block, Pool, SegmentAllocator, SegmentError};
use crate::{Backend, Result, RuntimeError, Session};
use cudarc::driver::{result as dr, sys as ds, CudaContext, CudaFunction, CudaStream};
use rustytorch_codegen::Plan;
use rustytorch_ops::HostTensor;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Segments straight from the driver (`cuMemAlloc`/`cuMemFree`).
pub struct DriverAllocator {
    ctx: Arc<CudaContext>,
}

impl SegmentAllocator for DriverAllocator {
    fn alloc(&mut self, bytes: usize) -> std::result::Result<u64, SegmentError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| SegmentError::Other(e.to_string()))?;
        // SAFETY: a plain device allocation; the pool owns the pointer until `free`.
        match unsafe { dr::malloc_sync(bytes) } {
            Ok(p) => Ok(p),
            Err(e) if e.0 == ds::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                Err(SegmentError::OutOfMemory)
            }
            Err(e) => Err(SegmentError::Other(e.to_string())),
        }
    }

    fn free(&mut self, addr: u64, _bytes: usize) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `addr` came from `alloc` and the pool frees each segment once, after
        // `synchronize`.
        let _ = unsafe { dr::free_sync(addr) };
    }

    fn synchronize(&mut self) {
        let _ = self.ctx.synchronize();
    }
}

/// A CUDA device as the runtime uses it (shared by all sessions on it).
pub struct GpuDevice {
    /// The device ordinal.
    pub ordinal: usize,
    /// The device's name.
    pub name: String,
    /// Compute capability.
    pub cc: (i32, i32),
    /// Streaming multiprocessors.
    pub sm_count: u32,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) pool: Mutex<Pool<DriverAllocator>>,
    /// The NVRTC compiler and its caches.
    pub compiler: compile::KernelCompiler,
    functions: Mutex<HashMap<String, CudaFunction>>,
    blas: Mutex<Option<(blas::Blas, Block)>>,
    dnn: Mutex<Option<dnn::Dnn>>,
    sparse: Mutex<Option<sparse::Sparse>>,
}

/// Launches `func` over `grid` blocks of `block` threads (with `smem` bytes of dynamic shared
/// memory, see [`GpuDevice::allow_smem`]) on `stream` with device-pointer arguments `args`.
///
/// # Safety
/// `func` must take exactly these pointer parameters, in this order, each addressing a live
/// buffer of the size the kernel reads or writes; the launch copies the values before returning.
pub(crate) unsafe fn launch_pointers(
    func: &CudaFunction,
    grid: u32,
    block: u32,
    smem: u32,
    args: &[u64],
    stream: ds::CUstream,
) -> std::result::Result<(), dr::DriverError> {
    // SAFETY: the caller's contract, with no tensor maps.
    unsafe { launch_params(func, (grid, block, smem), args, &[], &[], stream) }
}

/// The tensor map `m` over the buffer at `base`, encoded by the driver
/// (`cuTensorMapEncodeTiled`), which checks its sizes, strides and alignment.
pub(crate) fn encode_map(
    m: &rustytorch_codegen::cuda::ir::TensorMap,
    base: u64,
) -> std::result::Result<ds::CUtensorMap, String> {
    use rustytorch_codegen::cuda::ir::CTy;
    let ty = match m.elem {
        CTy::F16 => ds::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        CTy::BF16 => ds::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        e => return Err(format!("tensor map over {e:?} elements")),
    };
    let rank = m.dims.len();
    if !(1..=5).contains(&rank) || m.strides.len() + 1 != rank || m.boxes.len() != rank {
        return Err(format!("tensor map of rank {rank}: {m:?}"));
    }
    let ones = vec![1u32; rank];
    let mut map = ds::CUtensorMap { opaque: [0; 16] };
    let swizzle = if m.swizzle128 {
        ds::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B
    } else {
        ds::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE
    };
    // SAFETY: the arrays hold `rank` sizes and boxes and `rank - 1` strides, as the call reads;
    // `map` is a writable, 64-byte-aligned CUtensorMap. The driver only records the address.
    let r = unsafe {
        ds::cuTensorMapEncodeTiled(
            &mut map,
            ty,
            rank as u32,
            (base + m.offset) as *mut std::ffi::c_void,
            m.dims.as_ptr(),
            m.strides.as_ptr(),
            m.boxes.as_ptr(),
            ones.as_ptr(),
            ds::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            ds::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            ds::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    match r {
        ds::CUresult::CUDA_SUCCESS => Ok(map),
        e => Err(format!("encoding a tensor map ({m:?} at {base:#x}): {e:?}")),
    }
}

/// The tensor maps of the parameters `maps` names (`Some`, index for index with `args`),
/// encoded over their argument's address ([`encode_map`]), in parameter order.
pub(crate) fn encode_maps(
    maps: &[Option<rustytorch_codegen::cuda::ir::TensorMap>],
    args: &[u64],
) -> Result<Vec<ds::CUtensorMap>> {
    maps.iter()
        .zip(args)
        .filter_map(|(m, &a)| m.as_ref().map(|m| encode_map(m, a)))
        .collect::<std::result::Result<_, _>>()
        .map_err(RuntimeError::Device)
}

/// Launches `func` as [`launch_pointers`] does, except that the parameters `maps` names
/// (`Some`, index for index with `args`) are passed as the tensor maps `encoded` holds for
/// them, in order ([`encode_maps`] over the same `args`), instead of as the address.
///
/// # Safety
///
/// As [`launch_pointers`], with the kernel's parameters of the kinds `maps` says.
pub(crate) unsafe fn launch_params(
    func: &CudaFunction,
    (grid, block, smem): (u32, u32, u32),
    args: &[u64],
    maps: &[Option<rustytorch_codegen::cuda::ir::TensorMap>],
    encoded: &[ds::CUtensorMap],
    stream: ds::CUstream,
) -> std::result::Result<(), dr::DriverError> {
    let mut args = args.to_vec();
    let mut encoded = encoded.to_vec();
    let mut next = encoded.iter_mut();
    let mut ptrs: Vec<*mut std::ffi::c_void> = args
        .iter_mut()
        .zip(maps.iter().chain(std::iter::repeat(&None)))
        .map(|(a, m)| match m {
            Some(_) => next.next().expect("one map each") as *mut ds::CUtensorMap as *mut _,
            None => a as *mut u64 as *mut std::ffi::c_void,
        })
        .collect();
    // SAFETY: the caller's contract; `ptrs` points at `args` and `encoded`, alive for the call
    // (the driver copies the parameters when the launch is queued).
    unsafe {
        dr::launch_kernel(
            func.cu_function(),
            (grid, 1, 1),
            (block, 1, 1),
            smem,
            stream,
            &mut ptrs,
        )
    }
}

fn derr(what: &str) -> impl Fn(dr::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::Device(format!("{what}: {e}"))
}

impl GpuDevice {
    /// The shared device for `ordinal` (opened on first use).
    pub fn get(ordinal: usize) -> Result<Arc<GpuDevice>> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<GpuDevice>>>> = OnceLock::new();
        let mut map = DEVICES
            .get_or_init(|| Mutex::new(HashMap::new()))
            .lock()
            .expect("device table lock");
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Arc::new(GpuDevice::open(ordinal)?);
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    fn open(ordinal: usize) -> Result<GpuDevice> {
        let n = crate::cuda_device_count()?;
        if ordinal >= n {
            return Err(RuntimeError::Device(format!(
                "cuda:{ordinal} requested but the driver reports {n} CUDA device(s)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(derr("opening the CUDA context"))?;
        // SAFETY: called before this context allocates anything; the runtime orders its one
        // stream's work itself and never uses cudarc's tracked slices.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(derr("creating a stream"))?;
        let cc = ctx
            .compute_capability()
            .map_err(derr("compute capability"))?;
        let sm_count = ctx
            .attribute(ds::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(derr("SM count"))? as u32;
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let compiler = compile::KernelCompiler::new(cc)?;
        let pool = Pool::new(
            DriverAllocator { ctx: ctx.clone() },
            format!("cuda:{ordinal}"),
        );
        Ok(GpuDevice {
            ordinal,
            name,
            cc,
            sm_count,
            ctx,
            stream,
            pool: Mutex::new(pool),
            compiler,
            functions: Mutex::new(HashMap::new()),
            blas: Mutex::new(None),
            dnn: Mutex::new(None),
            sparse: Mutex::new(None),
        })
    }

    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(derr("binding the context"))
    }

    /// Allocates from the pool on this device's stream.
    pub(crate) fn alloc(&self, bytes: usize) -> Result<Block> {
        self.pool
            .lock()
            .expect("pool lock")
            .alloc(bytes, 0)
            .map_err(|e| match e {
                crate::pool::PoolError::OutOfMemory { .. } => RuntimeError::OutOfMemory {
                    device: format!("cuda:{}", self.ordinal),
                    detail: e.to_string(),
                },
                e => RuntimeError::Device(e.to_string()),
            })
    }

    /// Returns a block to the pool (stream-ordered: later work on the stream may reuse it).
    pub(crate) fn free(&self, b: Block) {
        self.pool.lock().expect("pool lock").free(b);
    }

    /// Loaded functions for `(name, source)` pairs, compiling what no cache holds (in parallel).
    pub(crate) fn functions(&self, kernels: &[(String, String)]) -> Result<Vec<CudaFunction>> {
        let missing: Vec<(String, String)> = {
            let f = self.functions.lock().expect("function table lock");
            let mut seen = std::collections::HashSet::new();
            kernels
                .iter()
                .filter(|(n, _)| !f.contains_key(n) && seen.insert(n.clone()))
                .cloned()
                .collect()
        };
        let cubins = self.compiler.cubins(&missing)?;
        self.bind()?;
        let mut f = self.functions.lock().expect("function table lock");
        for ((name, _), cubin) in missing.iter().zip(cubins) {
            let module = self
                .ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary((*cubin).clone()))
                .map_err(derr("loading a kernel module"))?;
            let func = module
                .load_function(name)
                .map_err(derr("finding a kernel in its module"))?;
            f.insert(name.clone(), func);
        }
        Ok(kernels.iter().map(|(n, _)| f[n].clone()).collect())
    }

    /// Lets `func` take `bytes` of dynamic shared memory at launch: a block gets 48 KiB unless
    /// its function's limit is raised (up to what the device allows, 227 KiB on Hopper).
    pub(crate) fn allow_smem(&self, func: &CudaFunction, bytes: u32) -> Result<()> {
        if bytes <= 48 * 1024 {
            return Ok(());
        }
        // `set_attribute` does not bind the context itself.
        self.bind()?;
        func.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(|e| {
            RuntimeError::Device(format!(
                "a kernel needs {bytes} bytes of shared memory a block, more than this device gives: {e}"
            ))
        })
    }

    /// Runs `body` with this device's cuBLASLt state (opened on first use).
    pub(crate) fn with_blas<T>(
        &self,
        body: impl FnOnce(&mut blas::Blas) -> Result<T>,
    ) -> Result<T> {
        let mut g = self.blas.lock().expect("blas lock");
        if g.is_none() {
            let ws = self.alloc(blas::WORKSPACE_BYTES)?;
            match blas::Blas::new(ws.addr) {
                Ok(b) => *g = Some((b, ws)),
                Err(e) => {
                    self.free(ws);
                    return Err(e);
                }
            }
        }
        body(&mut g.as_mut().expect("opened above").0)
    }

    /// Runs `body` with this device's cuDNN state (opened on first use).
    pub(crate) fn with_dnn<T>(&self, body: impl FnOnce(&mut dnn::Dnn) -> Result<T>) -> Result<T> {
        let mut g = self.dnn.lock().expect("dnn lock");
        if g.is_none() {
            *g = Some(dnn::Dnn::new()?);
        }
        body(g.as_mut().expect("opened above"))
    }

    /// Runs `body` with this device's cuSPARSE handle (opened on first use).
    pub(crate) fn with_sparse<T>(
        &self,
        body: impl FnOnce(&mut sparse::Sparse) -> Result<T>,
    ) -> Result<T> {
        let mut g = self.sparse.lock().expect("sparse lock");
        if g.is_none() {
            *g = Some(sparse::Sparse::new()?);
        }
        body(g.as_mut().expect("opened above"))
    }

    /// Waits for the device's stream.
    pub(crate) fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(derr("synchronizing"))
    }
}

/// Executes plans on one CUDA device.
pub struct CudaBackend {
    dev: Arc<GpuDevice>,
}

impl CudaBackend {
    /// Opens CUDA device `ordinal`: an error when the driver, the device or NVRTC is missing.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        Ok(CudaBackend {
            dev: GpuDevice::get(ordinal)?,
        })
    }

    /// The device.
    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.dev
    }

    /// Statistics of the device's memory pool.
    pub fn memory_stats(&self) -> crate::MemoryStats {
        self.dev.pool.lock().expect("pool lock").stats()
    }

    /// Starts the device pool's peaks over from their current values
    /// ([`crate::pool::Pool::reset_peak_stats`]).
    pub fn reset_peak_memory_stats(&self) {
        self.dev.pool.lock().expect("pool lock").reset_peak_stats();
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:{}", self.dev.ordinal)
    }
    fn prepare(&self, plan: Arc<Plan>, params: Vec<Arc<HostTensor>>) -> Result<Box<dyn Session>> {
        Ok(Box::new(CudaSession::new(self.dev.clone(), plan, &params)?))
    }
}
