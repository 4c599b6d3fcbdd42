"""A PyTorch user runs a RustyTorch-compiled transformer block on CUDA tensors and gets torch
tensors back.

    pip install ./python torch
    python python/examples/torch_attention.py     # on CUDA when PyTorch sees a GPU, else the CPU

The block (examples/attention_block.rtir: LayerNorm, 4-head causal self-attention, a GELU MLP,
residuals) is compiled once for the device; its parameters come out as torch tensors, the same
block written in PyTorch checks the result, and a run on a side stream shows the stream
hand-over (the result's consumer stream waits for RustyTorch's copy with an event).
"""

import pathlib

import torch
import torch.nn.functional as F

import rustytorch as rt


def torch_block(x, p):
    """The same block in PyTorch."""
    n = x.shape[-1]
    h = F.layer_norm(x, (n,), p["ln.w"], p["ln.b"], eps=1e-5)

    def heads(t):
        return t.view(2, 16, 4, 16).transpose(1, 2)

    q, k, v = (heads(h @ p[w]) for w in ("wq", "wk", "wv"))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    x = x + a.transpose(1, 2).reshape(2, 16, n) @ p["wo"]
    h = F.layer_norm(x, (n,), p["ln.w"], p["ln.b"], eps=1e-5)
    return x + F.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    here = pathlib.Path(__file__).parent
    exe = rt.load(here / "attention_block.rtir", device=device)
    print(exe)

    # Parameters as torch tensors on the executable's device; writable the same way.
    exe.set_param("b1", torch.full((256,), 0.01, device=device))
    p = {name: torch.from_dlpack(t) for name, t in exe.params().items()}

    x = torch.randn(2, 16, 64, device=device)
    y = torch.from_dlpack(exe(x=x))  # a torch tensor on `device`
    print(f"y: {tuple(y.shape)} {y.dtype} on {y.device}")
    torch.testing.assert_close(y, torch_block(x, p), rtol=1e-4, atol=1e-4)
    print("matches the PyTorch block")

    if device == "cuda":
        # Consumed on a side stream: torch.from_dlpack names that stream, which waits for the
        # result with an event (no device-wide synchronize).
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            z = torch.from_dlpack(exe(x=x)) * 2
        side.synchronize()
        torch.testing.assert_close(z, 2 * y)
        print("side stream: ok")


if __name__ == "__main__":
    main()
