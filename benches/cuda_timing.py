# Timing with CUDA events for the PyTorch peer scripts: warm-up calls, then the mean time of
# `iters` back-to-back calls in milliseconds. Keep this file beside the script that imports it.
import torch


def bench(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters
