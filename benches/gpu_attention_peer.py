# PyTorch's scaled_dot_product_attention (default backend choice, and each backend it has) on the
# attention rows of `bench-gpu attention`, bf16, timed with CUDA events:
#   python3 benches/gpu_attention_peer.py [--forward] [--decode]
# (`--forward`: the default backend's forward only, the quick row beside `bench-gpu attention-flash`;
# `--decode`: the one-query-row shape only, beside `bench-gpu attention-decode`)
# TFLOP/s counts 4·B·H·Sq·Sk·D (halved for causal); forward+backward counts 3.5× the forward.
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev = "cuda"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import bench  # noqa: E402


SHAPES = [(4, 32, 4096, 4096, 128, False), (4, 32, 4096, 4096, 128, True),
          (16, 16, 1024, 1024, 64, False), (16, 16, 1024, 1024, 64, True),
          (4, 32, 4096, 4096, 64, True), (2, 16, 8192, 8192, 128, True),
          (8, 32, 512, 8192, 128, False), (8, 32, 1, 8192, 128, False)]


for (B, H, Sq, Sk, D, causal) in SHAPES:
    if "--decode" in sys.argv and Sq != 1:
        continue
    q = torch.randn(B, H, Sq, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(B, H, Sk, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    fl = 4 * B * H * Sq * Sk * D * (0.5 if causal else 1.0)
    tag = f"sdpa bf16 B{B} H{H} Sq{Sq} Sk{Sk} D{D} {'causal' if causal else 'full'}"
    quick = "--forward" in sys.argv
    runs = [("default", None), ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
            ("flash", [SDPBackend.FLASH_ATTENTION])]
    for name, backends in runs[:1] if quick else runs:
        try:
            def f():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if backends is None:
                ms = bench(f)
            else:
                with sdpa_kernel(backends):
                    ms = bench(f)
            print(f"{tag} {name}: {ms * 1e3:.1f} us, {fl / ms / 1e9:.1f} TFLOP/s", flush=True)
            if Sq > 1 and not quick:
                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                g = torch.randn_like(o)

                def fb():
                    o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                    return torch.autograd.grad(o, (qg, kg, vg), g)
                if backends is None:
                    ms = bench(fb)
                else:
                    with sdpa_kernel(backends):
                        ms = bench(fb)
                print(f"{tag} {name} fwd+bwd: {ms * 1e3:.1f} us, {3.5 * fl / ms / 1e9:.1f} TFLOP/s", flush=True)
        except Exception as e:  # a backend that refuses the shape
            print(f"{tag} {name}: unavailable ({str(e).splitlines()[0][:80]})", flush=True)
    del q, k, v
