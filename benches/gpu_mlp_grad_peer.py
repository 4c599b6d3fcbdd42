# PyTorch on the MLP-block forward+backward rows of benches/gpu.rs (`bench-gpu mlp-grad`):
# bf16 x [8192, 768] -> linear 3072 -> GELU (tanh) -> linear 768, the backward from a given dy,
# gradients of x and of every parameter; eager and torch.compile, timed with CUDA events:
# python3 benches/gpu_mlp_grad_peer.py
import os
import sys

import torch
import torch.nn.functional as F

dev = "cuda"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import bench  # noqa: E402

t, d, h = 8192, 768, 3072
dt = torch.bfloat16
x = torch.randn(t, d, device=dev, dtype=dt, requires_grad=True)
dy = torch.randn(t, d, device=dev, dtype=dt)
w1 = (torch.randn(h, d, device=dev, dtype=dt) * d ** -0.5).requires_grad_()
b1 = torch.zeros(h, device=dev, dtype=dt, requires_grad=True)
w2 = (torch.randn(d, h, device=dev, dtype=dt) * h ** -0.5).requires_grad_()
b2 = torch.zeros(d, device=dev, dtype=dt, requires_grad=True)


def block(x):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def fwd_bwd(f):
    return torch.autograd.grad(f(x), (x, w1, b1, w2, b2), dy)


# Forward 2 GEMMs, backward 4 (dx, dW1, dh, dW2), each 2*t*d*h FLOPs.
flops = 6 * 2 * t * d * h
compiled = torch.compile(block)
for name, f in [("eager", block), ("torch.compile", compiled)]:
    ms = bench(lambda: fwd_bwd(f))
    print(f"torch mlp block fwd+bwd bf16 {name}: {ms:.4f} ms, {flops / ms / 1e9:.1f} TFLOP/s")
