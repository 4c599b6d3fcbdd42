# torch.sparse (CSR, cuSPARSE underneath) on the sparse rows of benches/gpu.rs: SpGEMM of random
# square f32 matrices (wall time of the product, which waits for the result like ours) and SpMM
# with 256 dense columns (CUDA events): python3 benches/gpu_sparse_peer.py
import time

import torch

dev = "cuda"


def random_csr(n, density, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    nnz = round(density * n * n)
    idx = torch.randint(0, n, (2, nnz), generator=g)
    vals = torch.rand(nnz, generator=g) * 2 - 1
    a = torch.sparse_coo_tensor(idx, vals, (n, n)).coalesce()
    return a.to(dev).to_sparse_csr()


for n, density in [(16384, 1e-3), (65536, 1e-4), (8192, 1e-2)]:
    a, b = random_csr(n, density, 1), random_csr(n, density, 2)
    times = []
    for _ in range(7):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        c = a @ b
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    print(f"torch spgemm f32 n {n} density {density:e}: {times[3]:.4f} ms, nnz(C) {c._nnz() / 1e6:.2f} M")

n, density, cols = 16384, 1e-3, 256
a = random_csr(n, density, 3)
x = torch.rand(n, cols, device=dev)
for _ in range(3):
    y = a @ x
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(20):
    y = a @ x
e.record()
torch.cuda.synchronize()
print(f"torch spmm f32 n {n} density {density:e} x {cols} cols: {s.elapsed_time(e) / 20:.4f} ms")
