# The same LayerNorm + MLP stack as examples/gpu_mlp_stack.rs in PyTorch (eager and torch.compile),
# timed the same way: python3 benches/gpu_mlp_peer.py [f32|bf16] [layers]
import sys, time, torch
dt = {"f32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1] if len(sys.argv) > 1 else "bf16"]
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 12
T, d, h = 8 * 1024, 768, 3072
torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"
x0 = torch.randn(T, d, device=dev, dtype=dt)
ps = [[torch.randn(*s, device=dev, dtype=dt) * 0.02 for s in [(d, h), (h,), (h, d), (d,), (d,), (d,)]] for _ in range(layers)]
def f(x):
    for w1, b1, w2, b2, lw, lb in ps:
        y = torch.nn.functional.layer_norm(x, (d,), lw, lb, 1e-5)
        y = torch.nn.functional.gelu(y @ w1 + b1) @ w2 + b2
        x = x + y
    return x.float().mean()
for name, fn in [("eager", f), ("compile", torch.compile(f))]:
    with torch.no_grad():
        for _ in range(3): fn(x0).item()
        torch.cuda.synchronize(); t = time.time()
        for _ in range(20): fn(x0).item()
        ms = (time.time() - t) * 1e3 / 20
    print(f"torch {name} {dt} layers={layers}: {ms:.3f} ms/run, {4*T*d*h*layers/(ms*1e-3)/1e12:.1f} TFLOP/s")
