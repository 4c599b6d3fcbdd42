# PyTorch's scaled_dot_product_attention (default backend) on the rows of
# `bench-gpu attention-flash-bwd`, bf16, forward and forward+backward (all three gradients; the
# decoding row, one query, forward only), timed with CUDA events, 50 calls each:
#   python3 benches/gpu_attention_quick_peer.py
# RUSTYTORCH_BENCH_ROWS=TEXT|TEXT... keeps the rows whose name contains one TEXT, as the bench
# binary does (for example "D64").
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import bench  # noqa: E402

SHAPES = [(4, 32, 4096, 4096, 128, False), (4, 32, 4096, 4096, 128, True),
          (16, 16, 1024, 1024, 64, False), (16, 16, 1024, 1024, 64, True),
          (4, 32, 4096, 4096, 64, True), (2, 16, 8192, 8192, 128, True),
          (8, 32, 512, 8192, 128, False), (8, 32, 1, 8192, 128, False)]
ROWS = [r for r in os.environ.get("RUSTYTORCH_BENCH_ROWS", "").split("|") if r]
for (B, H, Sq, Sk, D, causal) in SHAPES:
    name = f"B{B} H{H} Sq{Sq} Sk{Sk} D{D} {'causal' if causal else 'full'}"
    if ROWS and not any(r in name for r in ROWS):
        continue
    q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H, Sk, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16)

    def f():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fb():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return torch.autograd.grad(o, (q, k, v), g)
    with torch.no_grad():
        a = bench(f, 50)
    if Sq == 1:
        gb = 2 * B * H * Sk * D * 2 / (a * 1e-3) / 1e9
        print(f"sdpa {name}: fwd {a:.4f} ms ({gb:.0f} GB/s of K and V)", flush=True)
        continue
    b = bench(fb, 50)
    print(f"sdpa {name}: fwd {a:.4f} ms fwd+bwd {b:.4f} ms", flush=True)
