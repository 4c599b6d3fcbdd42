# PyTorch on the GPT-2-small rows of `bench-gpu gpt2` (12 blocks, d 768, 12 heads, batch 8 x 1024,
# bf16 weights and activations, SDPA causal attention): forward eager and torch.compile with the
# forward's peak memory, and a training step (forward, backward of the mean square), without and
# with an SGD step.
#   python3 benches/gpu_gpt2_peer.py
import os
import sys

import torch
import torch.nn.functional as F

dev = "cuda"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import bench  # noqa: E402


class Block(torch.nn.Module):
    def __init__(s, d=768, h=12):
        super().__init__()
        s.h = h
        s.ln1 = torch.nn.LayerNorm(d); s.qkv = torch.nn.Linear(d, 3 * d); s.proj = torch.nn.Linear(d, d)
        s.ln2 = torch.nn.LayerNorm(d); s.fc = torch.nn.Linear(d, 4 * d); s.out = torch.nn.Linear(4 * d, d)

    def forward(s, x):
        B, T, C = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(C, -1)
        q, k, v = (t.view(B, T, s.h, C // s.h).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + s.proj(a)
        return x + s.out(F.gelu(s.fc(s.ln2(x)), approximate="tanh"))


model = torch.nn.Sequential(*[Block() for _ in range(12)]).to(dev, torch.bfloat16)
x = torch.randn(8, 1024, 768, device=dev, dtype=torch.bfloat16)
with torch.no_grad():
    print(f"gpt2-small forward bf16 eager: {bench(lambda: model(x)):.3f} ms", flush=True)
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); model(x); torch.cuda.synchronize()
    print(f"gpt2-small forward bf16 eager peak: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB", flush=True)
    mc = torch.compile(model)
    print(f"gpt2-small forward bf16 torch.compile: {bench(lambda: mc(x)):.3f} ms", flush=True)


def step():
    model.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()


print(f"gpt2-small training step (fwd+bwd) bf16 eager: {bench(step, 10):.3f} ms", flush=True)

# The same with the optimizer step our training step includes: SGD over every parameter
# (`foreach`, PyTorch's multi-tensor path; the parameters stay bf16, without f32 masters or
# finiteness checks, so this does less than ours).
opt = torch.optim.SGD(model.parameters(), lr=1e-4, foreach=True)


def step_sgd():
    step()
    opt.step()


print(f"gpt2-small training step (fwd+bwd+SGD foreach) bf16 eager: {bench(step_sgd, 10):.3f} ms", flush=True)

# `python3 benches/gpu_gpt2_peer.py --profile`: the eager fwd+bwd's kernels, summed over 3 steps
# (torch.profiler, CUDA activity), to set beside `bench-gpu gpt2-ncu`'s kernel list.
if "--profile" in sys.argv:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, t = rows.get(e.name, (0, 0.0))
            rows[e.name] = (n + 1, t + e.device_time_total)
    total = sum(t for _, t in rows.values()) / 3
    print(f"eager fwd+bwd kernels: {total / 1000:.3f} ms a step (summed kernel time)")
    for name, (n, t) in sorted(rows.items(), key=lambda r: -r[1][1]):
        print(f"{t / 3000:9.3f} ms {n // 3:5d}x  {name[:150]}")
