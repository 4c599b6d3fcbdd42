# PyTorch (cuDNN, benchmark mode) on the convolution and pooling rows of benches/gpu.rs, in both
# memory formats, timed with CUDA events: python3 benches/gpu_conv_peer.py
import os
import sys

import torch
import torch.nn.functional as F

torch.backends.cudnn.benchmark = True
dev = "cuda"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import bench  # noqa: E402


def conv(label, xs, ws, dt, fmt, tf32=False):
    torch.backends.cudnn.allow_tf32 = tf32
    f = {4: F.conv2d, 5: F.conv3d, 3: F.conv1d}[len(xs)]
    x = torch.randn(*xs, device=dev, dtype=dt)
    w = torch.randn(*ws, device=dev, dtype=dt)
    if fmt is not None:
        x, w = x.to(memory_format=fmt), w.to(memory_format=fmt)
    x.requires_grad_(); w.requires_grad_()
    flops = 2 * xs[0] * ws[0] * ws[1] * x[0, 0].numel() * w[0, 0].numel()
    with torch.no_grad():
        ms = bench(lambda: f(x, w, padding=1))
    print(f"torch {label} fwd: {ms:.4f} ms, {flops / ms / 1e9:.1f} TFLOP/s")
    g = torch.randn_like(f(x, w, padding=1))
    ms = bench(lambda: torch.autograd.grad(f(x, w, padding=1), (x, w), g))
    print(f"torch {label} fwd+bwd: {ms:.4f} ms, {3 * flops / ms / 1e9:.1f} TFLOP/s")


cl, cl3 = torch.channels_last, torch.channels_last_3d
conv("conv2d 3x3 64c 56x56 b64 f16 NCHW", (64, 64, 56, 56), (64, 64, 3, 3), torch.float16, None)
conv("conv2d 3x3 64c 56x56 b64 f16 NHWC", (64, 64, 56, 56), (64, 64, 3, 3), torch.float16, cl)
conv("conv2d 3x3 64c 56x56 b64 f32 NCHW exact", (64, 64, 56, 56), (64, 64, 3, 3), torch.float32, None)
conv("conv2d 3x3 64c 56x56 b64 f32 NCHW tf32", (64, 64, 56, 56), (64, 64, 3, 3), torch.float32, None, True)
conv("conv1d k3 256c L4096 b32 f16", (32, 256, 4096), (256, 256, 3), torch.float16, None)
conv("conv3d 3x3x3 64c 16x56x56 b8 f16 NCDHW", (8, 64, 16, 56, 56), (64, 64, 3, 3, 3), torch.float16, None)
conv("conv3d 3x3x3 64c 16x56x56 b8 f16 NDHWC", (8, 64, 16, 56, 56), (64, 64, 3, 3, 3), torch.float16, cl3)


def conv_bias_relu(x, w, b):
    return F.relu(F.conv2d(x, w, b, padding=1))


# conv2d + bias + ReLU, f16 channels-last forward (benches/gpu.rs conv_graph_api_rows): eager
# (cuDNN conv with its bias, then a ReLU kernel) and torch.compile (Inductor's choice).
xs, ws = (64, 64, 56, 56), (64, 64, 3, 3)
x = torch.randn(*xs, device=dev, dtype=torch.float16).to(memory_format=cl)
w = torch.randn(*ws, device=dev, dtype=torch.float16).to(memory_format=cl)
b = torch.randn(64, device=dev, dtype=torch.float16)
flops = 2 * xs[0] * ws[0] * ws[1] * xs[2] * xs[3] * ws[2] * ws[3]
compiled = torch.compile(conv_bias_relu)
for name, f in [("eager", conv_bias_relu), ("torch.compile", compiled)]:
    with torch.no_grad():
        ms = bench(lambda: f(x, w, b))
    print(f"torch conv2d+bias+relu 3x3 64c 56x56 b64 f16 NHWC fwd {name}: {ms:.4f} ms, "
          f"{flops / ms / 1e9:.1f} TFLOP/s")

for fmt_name, fmt in [("NCHW", None), ("NHWC", cl)]:
    x = torch.randn(64, 64, 112, 112, device=dev, dtype=torch.float16)
    if fmt is not None:
        x = x.to(memory_format=fmt)
    x.requires_grad_()
    nb = x.numel() * 2 * 1.25
    with torch.no_grad():
        ms = bench(lambda: F.max_pool2d(x, 3, 2, 1))
    print(f"torch max pool 3x3 s2 f16 {fmt_name} fwd: {ms:.4f} ms, {nb / ms / 1e9:.2f} TB/s")
    g = torch.randn_like(F.max_pool2d(x, 3, 2, 1))
    ms = bench(lambda: torch.autograd.grad(F.max_pool2d(x, 3, 2, 1), (x,), g))
    print(f"torch max pool 3x3 s2 f16 {fmt_name} fwd+bwd: {ms:.4f} ms")
    with torch.no_grad():
        ms = bench(lambda: F.avg_pool2d(x, 2))
    print(f"torch avg pool 2x2 f16 {fmt_name} fwd: {ms:.4f} ms, {nb / ms / 1e9:.2f} TB/s")
