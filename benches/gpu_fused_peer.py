# torch.compile (and eager PyTorch) on the fused norm, softmax and reduction rows of
# `bench-gpu fused`, bf16 32768x4096, and its column reductions (sums over the rows of
# [8192, C], bandwidth as bytes read), timed with triton's do_bench (median); bandwidth counts
# the same bytes as the Rust rows (the inputs read and the output written):
#   python3 benches/gpu_fused_peer.py
import torch
import torch.nn.functional as F
from triton.testing import do_bench

dev = "cuda"
R, C = 32768, 4096
bf = torch.bfloat16
PLANE = R * C * 2


def rnd(*shape):
    return torch.rand(*shape, device=dev, dtype=bf) * 2 - 1


x, y, z = rnd(R, C), rnd(R, C), rnd(R, C)
w, b, bias = rnd(C), rnd(C), rnd(C)
mask = rnd(8, 1, 1, C)
scores = x.view(8, 16, 256, C)

CASES = [
    ("fused layer_norm(x + y)", lambda: F.layer_norm(x + y, (C,), w, b, 1e-5), 3 * PLANE),
    ("fused rms_norm(x + bias)", lambda: F.rms_norm(x + bias, (C,), w, 1e-6), 2 * PLANE),
    ("fused softmax(x * 0.125 + mask)", lambda: torch.softmax(scores * 0.125 + mask, -1), 2 * PLANE),
    ("fused layer_norm(x) * 0.5 + z", lambda: F.layer_norm(x, (C,), eps=1e-5) * 0.5 + z, 3 * PLANE),
    ("fused f32(softmax(x))", lambda: torch.softmax(x, -1).float(), 3 * PLANE),
    ("fused sum(x * y, -1)", lambda: (x * y).sum(-1), 2 * PLANE),
    ("fused sqrt(mean(x * x, -1))", lambda: (x * x).mean(-1, keepdim=True).sqrt(), PLANE),
]

# Column reductions: GPT-2's bias gradients and LayerNorm-backward's gamma sum.
N = 8192
dy768, x768, dy3072, big = rnd(N, 768), rnd(N, 768), rnd(N, 3072), rnd(8 * N, 768)
f768 = dy768.float()
CASES += [
    ("sum(f32(x), 0) bf16 8192x768", lambda: dy768.sum(0, dtype=torch.float32), N * 768 * 2),
    ("sum(f32(x), 0) bf16 8192x3072", lambda: dy3072.sum(0, dtype=torch.float32), N * 3072 * 2),
    ("sum(x, 0) f32 8192x768", lambda: f768.sum(0), N * 768 * 4),
    ("fused sum(dY * x, 0) bf16 8192x768", lambda: (dy768 * x768).sum(0), 2 * N * 768 * 2),
    ("sum(f32(x), 0) bf16 65536x768", lambda: big.sum(0, dtype=torch.float32), 8 * N * 768 * 2),
]

for name, fn, nbytes in CASES:
    compiled = torch.compile(fn)
    compiled()
    for label, f in (("eager", fn), ("compile", compiled)):
        ms = do_bench(f, warmup=50, rep=300, return_mode="median")
        print(f"{name:<36} {label:<8} {ms:8.4f} ms  {nbytes / (ms * 1e-3) / 1e12:6.2f} TB/s", flush=True)
