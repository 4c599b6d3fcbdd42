"""NumPy (OpenBLAS) f32 GEMM GFLOP/s at 512/1024/2048: the peer of benches/matmul.rs."""
import time
import numpy as np

for n in (512, 1024, 2048):
    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (n, n)).astype(np.float32)
    b = rng.uniform(-1, 1, (n, n)).astype(np.float32)
    a @ b
    reps = max(3, int(2e10 / (2 * n**3)))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = min(best, (time.perf_counter() - t) / reps)
    print(f"numpy f32 matmul {n}: {best * 1e3:.3f} ms, {2 * n**3 / best / 1e9:.1f} GFLOP/s")
