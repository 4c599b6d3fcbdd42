//! The CUDA memory pool and kernel cache on the device (where `RUSTYTORCH_TEST_CUDA=1`):
//! out-of-memory is a clean error after which the same process keeps running graphs; the pool's
//! statistics are reachable from an executable; a corrupt cached cubin is recompiled, never
//! loaded.

use rustytorch::prelude::*;
use rustytorch::runtime::cuda::compile::KernelCompiler;
use rustytorch::runtime::cuda::GpuDevice;

fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

fn small_graph() -> (GraphBuilder, Tensor) {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [256, 256]);
    let w = g.param("w", [256, 256], Init::kaiming_uniform(256, 3));
    let y = x.matmul(&w).relu().sum(&[1], false);
    (g, y)
}

#[test]
fn out_of_memory_is_an_error_and_the_device_stays_usable() {
    if !cuda() {
        return;
    }
    let (g, y) = small_graph();
    let mut exe = compile(&g, &[&y], Device::Cuda(0)).unwrap();
    let mut cpu = compile(&g, &[&y], Device::Cpu).unwrap();
    let x = rustytorch::ops::testing::rand_tensor(
        &TensorType::new(DType::F32, [256, 256]),
        5,
        -1.0,
        1.0,
    );
    let want = cpu.run(&[("x", x.clone())]).unwrap()[0].to_f64_vec();
    let before = exe.run(&[("x", x.clone())]).unwrap()[0].to_f64_vec();
    rustytorch::ops::testing::assert_close(&before, &want, 1e-4, "before an OOM");

    // 64 Gi elements of f32 = 256 GiB: more than any current card holds.
    let big = GraphBuilder::new();
    let bx = big.input("x", DType::F32, [1 << 18, 1 << 18]);
    let by = bx.mul_scalar(2.0);
    let e = compile(&big, &[&by], Device::Cuda(0))
        .err()
        .expect("a 256 GiB input cannot be placed");
    let msg = e.to_string();
    println!("{msg}");
    assert!(msg.contains("out of memory"), "{msg}");

    // The session prepared before the failure still runs, and new ones can be made.
    let after = exe.run(&[("x", x.clone())]).unwrap()[0].to_f64_vec();
    rustytorch::ops::testing::assert_close(&after, &want, 1e-4, "same session after an OOM");
    let mut again = compile(&g, &[&y], Device::Cuda(0)).unwrap();
    let fresh = again.run(&[("x", x)]).unwrap()[0].to_f64_vec();
    rustytorch::ops::testing::assert_close(&fresh, &want, 1e-4, "new session after an OOM");
    let stats = exe.memory_stats().expect("the CUDA pool has statistics");
    println!("{stats}");
    assert!(stats.num_ooms >= 1);
    assert!(stats.num_alloc_retries >= 1);
    assert!(stats.reserved_bytes.current >= stats.allocated_bytes.current);
}

#[test]
fn kernels_compile_once_and_a_corrupt_cache_entry_is_recompiled() {
    if !cuda() {
        return;
    }
    let dev = GpuDevice::get(0).unwrap();
    let dir = std::env::temp_dir().join(format!("rt-kcache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let src = format!(
        "{}extern \"C\" __global__ void probe_kernel(float* x) {{ x[threadIdx.x] += 1.0f; }}\n",
        rustytorch::codegen::cuda::emit::PRELUDE
    );
    let c1 = KernelCompiler::with_dir(dev.cc, Some(dir.clone())).unwrap();
    let a = c1.cubin("probe_kernel", &src).unwrap();
    let _ = c1.cubin("probe_kernel", &src).unwrap();
    assert_eq!(
        *c1.counters.lock().unwrap(),
        (1, 1, 0),
        "one compile, one memory hit"
    );
    let path = c1.cache_path(&src).unwrap();
    assert!(path.exists());
    // A fresh compiler reads it from disk.
    let c2 = KernelCompiler::with_dir(dev.cc, Some(dir.clone())).unwrap();
    assert_eq!(*c2.cubin("probe_kernel", &src).unwrap(), *a);
    assert_eq!(*c2.counters.lock().unwrap(), (0, 0, 1));
    // Corrupt one byte of the cubin: the next compiler recompiles and rewrites it.
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let c3 = KernelCompiler::with_dir(dev.cc, Some(dir.clone())).unwrap();
    assert_eq!(*c3.cubin("probe_kernel", &src).unwrap(), *a);
    assert_eq!(*c3.counters.lock().unwrap(), (1, 0, 0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_same_graph_prepared_twice_reuses_its_kernels() {
    if !cuda() {
        return;
    }
    let (g, y) = small_graph();
    let dev = GpuDevice::get(0).unwrap();
    let _a = compile(&g, &[&y], Device::Cuda(0)).unwrap();
    let before = *dev.compiler.counters.lock().unwrap();
    let _b = compile(&g, &[&y], Device::Cuda(0)).unwrap();
    let after = *dev.compiler.counters.lock().unwrap();
    assert_eq!(before.0, after.0, "no NVRTC compile the second time");
}
