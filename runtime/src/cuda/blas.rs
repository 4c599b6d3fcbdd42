//! cuBLASLt matmuls through cudarc's result layer: one handle per device, a 32 MiB workspace from
//! the memory pool, and per [`MatmulDesc`] the descriptors and the heuristic's algorithm, made once
//! and cached; [`Blas::tune`] times up to eight of the heuristic's candidates on the step's
//! buffers when a session prepares the step, and keeps the fastest. f32 is computed in exact
//! f32 (`CUBLAS_COMPUTE_32F`) unless TF32 was allowed; f16/bf16 compute in f32; f64 in f64.
//!
//! `LtActivation::DGeluTanh` is the `DGELU` epilogue: the step's operand 2 (the pre-activation,
//! laid out as D) is the aux input, its leading dimension that of D and its batch stride D's; the
//! aux pointer is set before each call, like the bias pointer.
//!
//! A descriptor with `bgrad` also writes a bias gradient through the bias pointer:
//! `DGELU_BGRAD` with the GELU derivative, else `BGRADA` (A summed over the inner dimension).
//! `LtActivation::GeluTanhAux` is `GELU_AUX_BIAS`: the GELU as D and the pre-activation through
//! the aux pointer (the call's second buffer), laid out as D.
//! [`Blas::ready`] tells before the first call whether cuBLASLt has an algorithm for it.

use crate::{Result, RuntimeError};
use cudarc::cublaslt::{result as lt, sys};
use rustytorch_codegen::cuda::matmul::{LtActivation, MatmulDesc};
use rustytorch_ops::DType;
use std::collections::HashMap;
use std::ffi::c_void;

/// Bytes of cuBLASLt workspace (what cuBLASLt itself recommends on Hopper).
pub const WORKSPACE_BYTES: usize = 32 << 20;

struct Prepared {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    /// The heuristic's candidates, best guess first ([`Blas::tune`] times them).
    candidates: Vec<sys::cublasLtMatmulAlgo_t>,
    /// Whether `algo` is the measured fastest of `candidates` (or tuning was skipped).
    tuned: bool,
}

/// Algorithms asked of cuBLASLt's heuristic per descriptor, timed once by [`Blas::tune`].
const CANDIDATES: usize = 8;

/// cuBLASLt state of one device.
pub struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: u64,
    /// Per descriptor (whether TF32 is allowed is fixed for the handle's life).
    cache: HashMap<MatmulDesc, Prepared>,
    tf32: bool,
}

// SAFETY: the handle and descriptors are used only under the device's lock, from one thread at a
// time; cuBLASLt handles may move between threads.
unsafe impl Send for Blas {}

fn err(what: &str, e: impl std::fmt::Debug) -> RuntimeError {
    RuntimeError::Device(format!("cuBLASLt {what}: {e:?}"))
}

fn data_type(d: DType) -> Result<sys::cudaDataType> {
    Ok(match d {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::F64 => sys::cudaDataType::CUDA_R_64F,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        d => {
            return Err(RuntimeError::Invalid(format!(
                "matmul: no cuBLASLt kernel for {d:?}"
            )))
        }
    })
}

impl Blas {
    /// Opens cuBLASLt (an error naming the library when it is missing). `workspace` is a device
    /// buffer of [`WORKSPACE_BYTES`].
    pub fn new(workspace: u64) -> Result<Blas> {
        // SAFETY: only checks whether the library can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err(RuntimeError::Device(
                "cuBLASLt (libcublasLt) was not found: install the CUDA toolkit's cuBLAS libraries to run matmuls on CUDA".into(),
            ));
        }
        let handle = lt::create_handle().map_err(|e| err("create", e))?;
        Ok(Blas {
            handle,
            workspace,
            cache: HashMap::new(),
            tf32: std::env::var("RUSTYTORCH_ALLOW_TF32").as_deref() == Ok("1"),
        })
    }

    fn prepare(&mut self, m: &MatmulDesc) -> Result<&Prepared> {
        if !self.cache.contains_key(m) {
            let p = self.make(m)?;
            self.cache.insert(m.clone(), p);
        }
        Ok(&self.cache[m])
    }

    fn make(&self, m: &MatmulDesc) -> Result<Prepared> {
        let ty = data_type(m.dtype)?;
        let (compute, scale) = match m.dtype {
            DType::F64 => (
                sys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
                sys::cudaDataType::CUDA_R_64F,
            ),
            DType::F32 if self.tf32 => (
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
                sys::cudaDataType::CUDA_R_32F,
            ),
            _ => (
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType::CUDA_R_32F,
            ),
        };
        let desc = lt::create_matmul_desc(compute, scale).map_err(|e| err("desc", e))?;
        // cublasOperation_t as the i32 the attribute holds: 0 = N, 1 = T.
        let op = |t: bool| t as i32;
        let set_desc = |attr, v: *const c_void, n: usize| {
            // SAFETY: `desc` is live; `v` points to `n` readable bytes of the attribute's type.
            unsafe { lt::set_matmul_desc_attribute(desc, attr, v, n) }
                .map_err(|e| err("desc attr", e))
        };
        let (ta, tb) = (op(m.trans_a), op(m.trans_b));
        set_desc(
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            &ta as *const _ as *const c_void,
            std::mem::size_of_val(&ta),
        )?;
        set_desc(
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            &tb as *const _ as *const c_void,
            std::mem::size_of_val(&tb),
        )?;
        use sys::cublasLtEpilogue_t as E;
        let epi = match (m.bias, m.act) {
            _ if m.bgrad && m.bias => {
                return Err(RuntimeError::Invalid(
                    "matmul: a bias gradient epilogue with a bias".into(),
                ))
            }
            (false, LtActivation::DGeluTanh) if m.bgrad => E::CUBLASLT_EPILOGUE_DGELU_BGRAD,
            (false, LtActivation::None) if m.bgrad => E::CUBLASLT_EPILOGUE_BGRADA,
            _ if m.bgrad => {
                return Err(RuntimeError::Invalid(format!(
                    "matmul: no bias gradient epilogue with {:?}",
                    m.act
                )))
            }
            (false, LtActivation::None) => E::CUBLASLT_EPILOGUE_DEFAULT,
            (false, LtActivation::Relu) => E::CUBLASLT_EPILOGUE_RELU,
            (false, LtActivation::GeluTanh) => E::CUBLASLT_EPILOGUE_GELU,
            (true, LtActivation::None) => E::CUBLASLT_EPILOGUE_BIAS,
            (true, LtActivation::Relu) => E::CUBLASLT_EPILOGUE_RELU_BIAS,
            (true, LtActivation::GeluTanh) => E::CUBLASLT_EPILOGUE_GELU_BIAS,
            (true, LtActivation::GeluTanhAux) => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            (false, LtActivation::GeluTanhAux) => {
                return Err(RuntimeError::Invalid(
                    "matmul: the GELU pair's epilogue without its bias".into(),
                ))
            }
            (false, LtActivation::DGeluTanh) => E::CUBLASLT_EPILOGUE_DGELU,
            (true, LtActivation::DGeluTanh) => return Err(RuntimeError::Invalid(
                "matmul: a bias with the GELU derivative epilogue (DGELU_BGRAD writes the bias \
                     gradient, it does not add a bias)"
                    .into(),
            )),
        };
        let epi_u32 = epi as u32;
        set_desc(
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
            &epi_u32 as *const u32 as *const c_void,
            4,
        )?;
        // Stored shapes (column-major): A is m×k (k×m when transposed), B is k×n (n×k).
        let (ar, ac) = if m.trans_a { (m.k, m.m) } else { (m.m, m.k) };
        let (br, bc) = if m.trans_b { (m.n, m.k) } else { (m.k, m.n) };
        let dty = data_type(m.out_dtype)?;
        let layout = |ty: sys::cudaDataType,
                      rows: u64,
                      cols: u64,
                      ld: u64,
                      stride: i64|
         -> Result<sys::cublasLtMatrixLayout_t> {
            let l = lt::create_matrix_layout(ty, rows, cols, ld as i64)
                .map_err(|e| err("layout", e))?;
            if m.batch > 1 {
                let count = m.batch as i32;
                // SAFETY: `l` is live; the values are an i32 and an i64 as the attributes require.
                unsafe {
                    lt::set_matrix_layout_attribute(
                        l,
                        sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        &count as *const i32 as *const c_void,
                        4,
                    )
                    .map_err(|e| err("batch count", e))?;
                    lt::set_matrix_layout_attribute(
                        l,
                        sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                        &stride as *const i64 as *const c_void,
                        8,
                    )
                    .map_err(|e| err("batch stride", e))?;
                }
            }
            Ok(l)
        };
        let a = layout(ty, ar, ac, m.lda, m.stride_a)?;
        let b = layout(ty, br, bc, m.ldb, m.stride_b)?;
        let d = layout(dty, m.m, m.n, m.ldd, m.stride_d)?;
        let pref = lt::create_matmul_pref().map_err(|e| err("pref", e))?;
        let ws = WORKSPACE_BYTES as u64;
        // SAFETY: `pref` is live; the value is the u64 the attribute requires.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                8,
            )
        }
        .map_err(|e| err("pref attr", e))?;
        // The bias pointer is part of the heuristic's input: give it an aligned placeholder now,
        // the real pointer before each call.
        if m.bias || m.bgrad {
            let p: u64 = self.workspace;
            set_desc(
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &p as *const u64 as *const c_void,
                8,
            )?;
        }
        if matches!(m.act, LtActivation::DGeluTanh | LtActivation::GeluTanhAux) {
            // The aux input (or output) is laid out as D: same leading dimension, same batch
            // stride.
            let (ld, stride, p) = (m.ldd as i64, m.stride_d, self.workspace);
            set_desc(
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                &ld as *const i64 as *const c_void,
                8,
            )?;
            if m.batch > 1 {
                set_desc(
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE,
                    &stride as *const i64 as *const c_void,
                    8,
                )?;
            }
            set_desc(
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                &p as *const u64 as *const c_void,
                8,
            )?;
        }
        let mut found =
            [std::mem::MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::uninit(); CANDIDATES];
        let mut count = 0i32;
        // SAFETY: every descriptor is live; `found` has room for CANDIDATES results, of which
        // cuBLASLt initializes the first `count`.
        let h = unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                desc,
                a,
                b,
                d,
                d,
                pref,
                CANDIDATES as i32,
                found.as_mut_ptr() as *mut sys::cublasLtMatmulHeuristicResult_t,
                &mut count,
            )
        };
        // SAFETY: `pref` is live and no longer needed.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        let candidates: Vec<sys::cublasLtMatmulAlgo_t> = found
            [..(count.max(0) as usize).min(CANDIDATES)]
            .iter()
            // SAFETY: cuBLASLt initialized the first `count` results.
            .map(|r| unsafe { r.assume_init() })
            .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect();
        if h != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS || candidates.is_empty() {
            return Err(RuntimeError::Device(format!(
                "cuBLASLt found no algorithm for {m:?}: {h:?}"
            )));
        }
        Ok(Prepared {
            desc,
            a,
            b,
            d,
            algo: candidates[0],
            tuned: candidates.len() < 2,
            candidates,
        })
    }

    /// Makes (and caches) the descriptors and algorithm of `m`: an error when cuBLASLt has no
    /// algorithm for it.
    pub(crate) fn ready(&mut self, m: &MatmulDesc) -> Result<()> {
        self.prepare(m).map(|_| ())
    }

    /// Times the heuristic's candidate algorithms for `m` on the step's own buffers (as
    /// [`Blas::run`] takes them; nothing in them may be live, since every candidate writes D and
    /// the bias gradient) and keeps the fastest, once per descriptor; a candidate that fails is
    /// skipped. cuBLASLt's first guess is not always its fastest kernel: its epilogue variants in
    /// particular (`DGELU`, `GELU_AUX_BIAS`) and GEMMs with few output tiles. Must not run during
    /// stream capture. `RUSTYTORCH_LT_TUNE=0` keeps the first guess.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn tune(
        &mut self,
        m: &MatmulDesc,
        a: u64,
        b: u64,
        d: u64,
        bias: Option<u64>,
        bgrad: Option<u64>,
        c: Option<u64>,
        stream: sys::cudaStream_t,
    ) -> Result<()> {
        if self.prepare(m)?.tuned || std::env::var("RUSTYTORCH_LT_TUNE").as_deref() == Ok("0") {
            return Ok(());
        }
        let candidates = self.cache[m].candidates.clone();
        let mut best: Option<(f32, usize)> = None;
        let mut times = vec![];
        for (i, &algo) in candidates.iter().enumerate() {
            self.cache.get_mut(m).expect("prepared").algo = algo;
            let mut call = || self.run(m, a, b, d, bias, bgrad, c, stream);
            // The best of two rounds (the first also warms the clocks).
            let t = super::dnn::time(stream as _, &mut call)
                .and_then(|t0| super::dnn::time(stream as _, &mut call).map(|t1| t0.min(t1)));
            match t {
                Ok(t) => {
                    times.push(format!("{t:.4}"));
                    if best.is_none_or(|(b, _)| t < b) {
                        best = Some((t, i));
                    }
                }
                Err(e) => {
                    times.push("failed".into());
                    tracing::debug!("cuBLASLt candidate {i} of {m:?} failed: {e}");
                }
            }
        }
        let Some((t, i)) = best else {
            return Err(RuntimeError::Device(format!(
                "cuBLASLt: none of the {} algorithms for {m:?} ran",
                candidates.len()
            )));
        };
        tracing::debug!(
            "cuBLASLt {m:?}: candidate {i} of {} ({t:.4} ms)",
            candidates.len()
        );
        log_matmul_choice(format!(
            "{}: candidates (ms) [{}], kept {i}",
            describe(m),
            times.join(", ")
        ));
        let p = self.cache.get_mut(m).expect("prepared");
        p.algo = candidates[i];
        p.tuned = true;
        Ok(())
    }

    /// Runs `m` on `stream` with the step's buffers: `a`/`b` are cuBLASLt's A and B (the op's
    /// operand 1 and 0), `d` the output, `bias` the op's operand 2: the bias, or the aux input of
    /// the `DGeluTanh` epilogue (laid out as D, so each call reads it at D's offset); `bgrad`
    /// the bias gradient's buffer of a `bgrad` descriptor, or the aux output (the
    /// pre-activation, laid out as D) of the `GeluTanhAux` epilogue; `c` the C an accumulating
    /// descriptor adds (laid out as D, read at D's offsets; it may be D itself).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &mut self,
        m: &MatmulDesc,
        a: u64,
        b: u64,
        d: u64,
        bias: Option<u64>,
        bgrad: Option<u64>,
        c: Option<u64>,
        stream: sys::cudaStream_t,
    ) -> Result<()> {
        let (elt, delt) = (m.dtype.size_bytes() as u64, m.out_dtype.size_bytes() as u64);
        let (handle, workspace) = (self.handle, self.workspace);
        let p = self.prepare(m)?;
        let aux = m.act == LtActivation::DGeluTanh;
        let aux_out = m.act == LtActivation::GeluTanhAux;
        if aux && bias.is_none() {
            return Err(RuntimeError::Invalid(
                "matmul: the GELU derivative epilogue needs the pre-activation".into(),
            ));
        }
        if m.accumulate.is_some() != c.is_some() {
            return Err(RuntimeError::Invalid(
                "matmul: an accumulating descriptor needs its C (and only it has one)".into(),
            ));
        }
        if (m.bgrad || aux_out) != bgrad.is_some() {
            return Err(RuntimeError::Invalid(
                "matmul: a bias gradient or GELU pair epilogue needs its second buffer (and only \
                 they have one)"
                    .into(),
            ));
        }
        // The bias pointer carries the bias, or the bias gradient's buffer.
        let bias_ptr = match (m.bgrad, aux) {
            (true, _) => bgrad,
            (false, true) => None,
            (false, false) => bias,
        };
        if let Some(bias) = bias_ptr {
            // SAFETY: `desc` is live; the value is a device pointer (8 bytes).
            unsafe {
                lt::set_matmul_desc_attribute(
                    p.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &bias as *const u64 as *const c_void,
                    8,
                )
            }
            .map_err(|e| err("bias pointer", e))?;
        }
        let (one32, zero32, one64, zero64) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
        let (alpha, beta): (*const c_void, *const c_void) = match (m.dtype, m.accumulate.is_some())
        {
            (DType::F64, false) => (&one64 as *const f64 as _, &zero64 as *const f64 as _),
            (DType::F64, true) => (&one64 as *const f64 as _, &one64 as *const f64 as _),
            (_, false) => (&one32 as *const f32 as _, &zero32 as *const f32 as _),
            (_, true) => (&one32 as *const f32 as _, &one32 as *const f32 as _),
        };
        for &(oa, ob, od) in &m.calls {
            let (pa, pb, pd) = (a + oa * elt, b + ob * elt, d + od * delt);
            let pc = c.map_or(pd, |c| c + od * delt);
            let pre = match (aux, aux_out) {
                (true, _) => bias,
                (false, true) => bgrad,
                (false, false) => None,
            };
            if let Some(pre) = pre {
                let pre = pre + od * delt;
                // SAFETY: `desc` is live; the value is a device pointer (8 bytes).
                unsafe {
                    lt::set_matmul_desc_attribute(
                        p.desc,
                        sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                        &pre as *const u64 as *const c_void,
                        8,
                    )
                }
                .map_err(|e| err("aux pointer", e))?;
            }
            // SAFETY: the descriptors are live; the pointers address device buffers of the sizes
            // the layouts describe (checked by the plan's types); the workspace holds
            // WORKSPACE_BYTES; C has D's layout (and is D, unread, when beta is 0).
            unsafe {
                lt::matmul(
                    handle,
                    p.desc,
                    alpha,
                    beta,
                    pa as *const c_void,
                    p.a,
                    pb as *const c_void,
                    p.b,
                    pc as *const c_void,
                    p.d,
                    pd as *mut c_void,
                    p.d,
                    &p.algo,
                    workspace as *mut c_void,
                    WORKSPACE_BYTES,
                    stream,
                )
            }
            .map_err(|e| err("matmul", e))?;
        }
        Ok(())
    }
}

/// A short description of a descriptor for [`matmul_choices`]: sizes, batch, transposes, types
/// and epilogue.
pub(crate) fn describe(m: &MatmulDesc) -> String {
    format!(
        "m{} n{} k{} b{} ta{} tb{} {:?}->{:?} {:?}{}{}{}",
        m.m,
        m.n,
        m.k,
        m.batch,
        m.trans_a as u8,
        m.trans_b as u8,
        m.dtype,
        m.out_dtype,
        m.act,
        if m.bias { " bias" } else { "" },
        if m.bgrad { " bgrad" } else { "" },
        if m.accumulate.is_some() { " acc" } else { "" },
    )
}

/// The choices cuBLASLt timing made in this process, one line each: per descriptor the
/// candidates' milliseconds and the one kept ([`Blas::tune`]), and per paired epilogue its time
/// against the plain GEMM with the sibling's kernels. For profiles and benchmarks.
pub fn matmul_choices() -> Vec<String> {
    choice_log().lock().expect("matmul choices").clone()
}

fn choice_log() -> &'static std::sync::Mutex<Vec<String>> {
    static C: std::sync::OnceLock<std::sync::Mutex<Vec<String>>> = std::sync::OnceLock::new();
    C.get_or_init(Default::default)
}

/// Appends a line to [`matmul_choices`].
pub(crate) fn log_matmul_choice(line: String) {
    choice_log().lock().expect("matmul choices").push(line);
}

impl Drop for Blas {
    fn drop(&mut self) {
        for (_, p) in self.cache.drain() {
            // SAFETY: each descriptor was created once and is destroyed once.
            unsafe {
                let _ = lt::destroy_matrix_layout(p.a);
                let _ = lt::destroy_matrix_layout(p.b);
                let _ = lt::destroy_matrix_layout(p.d);
                let _ = lt::destroy_matmul_desc(p.desc);
            }
        }
        // SAFETY: the handle is destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}
