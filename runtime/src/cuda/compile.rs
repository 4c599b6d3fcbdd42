//! NVRTC compilation of generated kernels into cubin, with a cache in memory and on disk.
//!
//! The disk cache lives in `$RUSTYTORCH_KERNEL_CACHE` or `~/.cache/rustytorch/kernels`; an entry is
//! keyed by a hash of the source, the GPU architecture and the NVRTC version, and holds a header
//! (magic, length, CRC32 of the cubin). An entry that fails the check is recompiled and rewritten,
//! never loaded. Distinct kernels of one plan compile in parallel (NVRTC programs are
//! independent; each thread creates and destroys its own).

use crate::{Result, RuntimeError};
use cudarc::nvrtc::{result as nr, sys as ns};
use rayon::prelude::*;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

const MAGIC: &[u8; 8] = b"RTCUBIN1";

/// A compiler for one GPU architecture, with its caches.
pub struct KernelCompiler {
    arch: String,
    nvrtc_version: (i32, i32),
    dir: Option<PathBuf>,
    memory: Mutex<HashMap<u64, std::sync::Arc<Vec<u8>>>>,
    /// Compiles and cache hits so far: (nvrtc compiles, memory hits, disk hits).
    pub counters: Mutex<(u64, u64, u64)>,
}

/// The default disk cache directory.
pub fn cache_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("RUSTYTORCH_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/rustytorch/kernels"))
}

/// The architecture kernels are built for on a device of compute capability `cc`: `sm_90a` on
/// Hopper, whose architecture-specific instructions (warpgroup MMA) some kernels use (a cubin
/// for `sm_90a` runs on compute capability 9.0 exactly, which is the device it is built for);
/// `sm_XY` elsewhere.
pub fn arch_of(cc: (i32, i32)) -> String {
    match rustytorch_codegen::cuda::Target::of(cc) {
        rustytorch_codegen::cuda::Target::Hopper => "sm_90a".into(),
        rustytorch_codegen::cuda::Target::Portable => format!("sm_{}{}", cc.0, cc.1),
    }
}

/// The log of NVRTC program `prog` (empty when it cannot be read).
///
/// # Safety
/// `prog` must be a live program.
unsafe fn program_log(prog: ns::nvrtcProgram) -> String {
    // SAFETY: the caller's contract; the log is NUL-terminated.
    unsafe { nr::get_program_log(prog) }
        .map(|l| {
            let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default()
}

fn fnv(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl KernelCompiler {
    /// A compiler for compute capability `(major, minor)`; an error when NVRTC is missing.
    pub fn new(cc: (i32, i32)) -> Result<KernelCompiler> {
        Self::with_dir(cc, cache_dir())
    }

    /// [`KernelCompiler::new`] with its disk cache in `dir` (None: memory only).
    pub fn with_dir(cc: (i32, i32), dir: Option<PathBuf>) -> Result<KernelCompiler> {
        // SAFETY: only checks whether the NVRTC shared library can be loaded.
        if !unsafe { ns::is_culib_present() } {
            return Err(RuntimeError::Device(
                "NVRTC (libnvrtc) was not found: install the CUDA toolkit's runtime compiler library to run on CUDA".into(),
            ));
        }
        let (mut major, mut minor) = (0, 0);
        // SAFETY: writes two ints.
        unsafe { ns::nvrtcVersion(&mut major, &mut minor) }
            .result()
            .map_err(|e| RuntimeError::Device(format!("nvrtcVersion: {e:?}")))?;
        Ok(KernelCompiler {
            arch: arch_of(cc),
            nvrtc_version: (major, minor),
            dir,
            memory: Mutex::new(HashMap::new()),
            counters: Mutex::new((0, 0, 0)),
        })
    }

    /// The cache file of a source (whether or not it exists yet).
    pub fn cache_path(&self, src: &str) -> Option<PathBuf> {
        self.path(self.key(src))
    }

    /// The target architecture (`sm_90a`, `sm_80`).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    fn key(&self, src: &str) -> u64 {
        let h = fnv(src.as_bytes(), 0xcbf2_9ce4_8422_2325);
        let h = fnv(self.arch.as_bytes(), h);
        fnv(
            format!("nvrtc{}.{}", self.nvrtc_version.0, self.nvrtc_version.1).as_bytes(),
            h,
        )
    }

    fn path(&self, key: u64) -> Option<PathBuf> {
        self.dir
            .as_ref()
            .map(|d| d.join(format!("{key:016x}.cubin")))
    }

    fn read_disk(&self, key: u64) -> Option<Vec<u8>> {
        let bytes = std::fs::read(self.path(key)?).ok()?;
        if bytes.len() < 16 || &bytes[..8] != MAGIC {
            return None;
        }
        let len = u32::from_le_bytes(bytes[8..12].try_into().ok()?) as usize;
        let crc = u32::from_le_bytes(bytes[12..16].try_into().ok()?);
        let body = &bytes[16..];
        (body.len() == len && crc32fast::hash(body) == crc).then(|| body.to_vec())
    }

    fn write_disk(&self, key: u64, cubin: &[u8]) {
        let Some(path) = self.path(key) else { return };
        if let Some(d) = path.parent() {
            let _ = std::fs::create_dir_all(d);
        }
        let mut bytes = Vec::with_capacity(cubin.len() + 16);
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&(cubin.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&crc32fast::hash(cubin).to_le_bytes());
        bytes.extend_from_slice(cubin);
        // Write then rename, so a reader never sees half a file.
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &bytes).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }

    /// The cubin of `src` (from memory, disk, or NVRTC).
    pub fn cubin(&self, name: &str, src: &str) -> Result<std::sync::Arc<Vec<u8>>> {
        let key = self.key(src);
        if let Some(c) = self.memory.lock().expect("cache lock").get(&key) {
            self.counters.lock().expect("lock").1 += 1;
            return Ok(c.clone());
        }
        let cubin = match self.read_disk(key) {
            Some(c) => {
                self.counters.lock().expect("lock").2 += 1;
                c
            }
            None => {
                let c = self.nvrtc(name, src)?;
                self.counters.lock().expect("lock").0 += 1;
                self.write_disk(key, &c);
                c
            }
        };
        let c = std::sync::Arc::new(cubin);
        self.memory
            .lock()
            .expect("cache lock")
            .insert(key, c.clone());
        Ok(c)
    }

    /// Compiles many kernels in parallel; results in the order given.
    pub fn cubins(&self, kernels: &[(String, String)]) -> Result<Vec<std::sync::Arc<Vec<u8>>>> {
        kernels
            .par_iter()
            .map(|(name, src)| self.cubin(name, src))
            .collect()
    }

    fn nvrtc(&self, name: &str, src: &str) -> Result<Vec<u8>> {
        // `RUSTYTORCH_NVRTC_VERBOSE=1` prints the assembler's report of each kernel compiled
        // (registers, spills, serialized warpgroup MMAs) to standard error.
        let verbose = std::env::var("RUSTYTORCH_NVRTC_VERBOSE").as_deref() == Ok("1");
        let (cubin, log) = self.compile(name, src, verbose)?;
        if verbose {
            eprintln!("nvrtc {name}:\n{log}");
        }
        Ok(cubin)
    }

    /// The assembler's report on `src` (ptxas `-v`: registers, spills, and notes such as
    /// C7512, warpgroup MMAs serialized for lack of registers), compiled afresh and not cached.
    pub fn assembler_report(&self, name: &str, src: &str) -> Result<String> {
        self.compile(name, src, true).map(|(_, log)| log)
    }

    /// The cubin of `src` and, where `report`, NVRTC's log with the assembler's report.
    fn compile(&self, name: &str, src: &str, report: bool) -> Result<(Vec<u8>, String)> {
        let _span = tracing::debug_span!("nvrtc", kernel = name).entered();
        let csrc = std::ffi::CString::new(src)
            .map_err(|_| RuntimeError::Invalid(format!("kernel {name}: NUL in source")))?;
        let cname = std::ffi::CString::new(format!("{name}.cu"))
            .map_err(|_| RuntimeError::Invalid(format!("kernel {name}: bad name")))?;
        let prog = nr::create_program(&csrc, Some(&cname))
            .map_err(|e| RuntimeError::Device(format!("nvrtc create {name}: {e:?}")))?;
        let mut opts = vec![
            format!("--gpu-architecture={}", self.arch),
            "--std=c++17".to_string(),
            "-default-device".to_string(),
            "-lineinfo".to_string(),
        ];
        if report {
            opts.push("--ptxas-options=-v".to_string());
        }
        // SAFETY: `prog` is a live program; the options are valid C strings.
        let compiled = unsafe { nr::compile_program(prog, &opts) };
        let result = match compiled {
            Err(e) => {
                // SAFETY: `prog` is live.
                let log = unsafe { program_log(prog) };
                let numbered: String = src
                    .lines()
                    .enumerate()
                    .map(|(i, l)| format!("{:4} {l}\n", i + 1))
                    .collect();
                Err(RuntimeError::Device(format!(
                    "NVRTC failed to compile kernel {name} ({e:?}):\n{log}\n{numbered}"
                )))
            }
            Ok(()) => {
                let log = if report {
                    // SAFETY: `prog` is live.
                    unsafe { program_log(prog) }
                } else {
                    String::new()
                };
                let mut n = 0usize;
                // SAFETY: `prog` compiled; writes one usize.
                unsafe { ns::nvrtcGetCUBINSize(prog, &mut n) }
                    .result()
                    .map_err(|e| RuntimeError::Device(format!("nvrtcGetCUBINSize {name}: {e:?}")))
                    .and_then(|_| {
                        let mut cubin = vec![0u8; n];
                        // SAFETY: `cubin` has the size NVRTC reported.
                        unsafe { ns::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }
                            .result()
                            .map_err(|e| {
                                RuntimeError::Device(format!("nvrtcGetCUBIN {name}: {e:?}"))
                            })?;
                        Ok((cubin, log))
                    })
            }
        };
        // SAFETY: `prog` is live and destroyed exactly once.
        let _ = unsafe { nr::destroy_program(prog) };
        result
    }
}
