"""The Python package with PyTorch (skipped where PyTorch is not installed): CPU tensors in and
out without copies; on CUDA (where PyTorch sees a GPU) device tensors read in place and results
handed to PyTorch without a copy, results against PyTorch, and producers and consumers on
concurrent streams."""

import pathlib

import pytest

torch = pytest.importorskip("torch")

import rustytorch as rt  # noqa: E402

HERE = pathlib.Path(__file__).parent
BLOCK = HERE.parent / "examples" / "attention_block.rtir"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch sees no GPU")


def reference(exe, x):
    import sys

    sys.path.insert(0, str(HERE.parent / "examples"))
    from torch_attention import torch_block

    p = {n: torch.from_dlpack(t).to(x.device) for n, t in exe.params().items()}
    return torch_block(x, p)


def test_cpu_results_are_shared_with_torch():
    exe = rt.load(BLOCK, "cpu")
    x = torch.randn(2, 16, 64)
    y = exe(x=x)
    t = torch.from_dlpack(y)
    assert t.data_ptr() == y.data_ptr
    torch.testing.assert_close(t, reference(exe, x), rtol=1e-4, atol=1e-4)
    # A contiguous CPU tensor is read where PyTorch put it.
    assert exe.copied_inputs == []
    assert rt.from_dlpack(x).data_ptr == x.data_ptr()
    # A non-contiguous torch input is read by its strides.
    xt = torch.randn(64, 16, 2).permute(2, 1, 0)
    torch.testing.assert_close(
        torch.from_dlpack(exe(x=xt)), reference(exe, xt), rtol=1e-4, atol=1e-4
    )


@cuda
def test_cuda_tensors_in_and_out():
    exe = rt.load(BLOCK, "cuda")
    assert exe.device == "cuda:0"
    x = torch.randn(2, 16, 64, device="cuda")
    y = exe(x=x)
    assert y.device == "cuda:0" and y.__dlpack_device__() == (2, 0)
    t = torch.from_dlpack(y)
    assert t.is_cuda and t.data_ptr() == y.data_ptr  # consumed without a copy
    torch.testing.assert_close(t, reference(exe, x), rtol=1e-4, atol=1e-4)
    # The first run is eager: the kernels read x where PyTorch put it (nothing was copied).
    assert exe.copied_inputs == []
    # Each run's result is a block of its own: the next run does not overwrite it.
    x2 = torch.randn(2, 16, 64, device="cuda")
    y2 = exe(x=x2)
    assert y2.data_ptr != y.data_ptr
    torch.testing.assert_close(torch.from_dlpack(y2), reference(exe, x2), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(t, reference(exe, x), rtol=1e-4, atol=1e-4)
    # From the second run a replayed CUDA graph copies x into its captured buffer and the result
    # out of its arena (device-to-device), and says so.
    for name, why in exe.copied_inputs:
        assert name in ("x", "y") and "graph" in why, (name, why)
    # A result fed back as an input is read in place too (eager executable).
    eager = rt.load(BLOCK, "cuda")
    z = eager(x=y)
    assert eager.copied_inputs == []
    assert torch.from_dlpack(z).is_cuda
    # Parameters read and written as CUDA tensors.
    exe.set_param("b2", torch.full((64,), 0.5, device="cuda"))
    b2 = torch.from_dlpack(exe.param("b2"))
    assert b2.is_cuda and torch.all(b2 == 0.5)


@cuda
def test_cuda_results_on_concurrent_streams():
    exe = rt.load(BLOCK, "cuda")
    x = torch.randn(2, 16, 64, device="cuda")
    want = reference(exe, x)
    streams = [torch.cuda.Stream() for _ in range(4)]
    outs = []
    consumer = torch.cuda.Stream()
    for k, s in enumerate(streams):
        with torch.cuda.stream(s):
            # The producer of x is the default stream: order the side stream after it.
            s.wait_stream(torch.cuda.default_stream())
            # A long producer kernel on the side stream: the run must wait for it (an event on
            # this stream, handed over through __dlpack__(stream=...)).
            big = torch.randn(4096, 4096, device="cuda")
            for _ in range(4):
                big = big @ big / 64.0
            xs = x * (k + 1) / (k + 1) + big[0, 0] * 0
            y = exe(x=xs)
        with torch.cuda.stream(consumer):
            # The consumer's stream waits for the result with an event (no device sync).
            outs.append(torch.from_dlpack(y) + 0)
    torch.cuda.synchronize()
    for o in outs:
        torch.testing.assert_close(o, want, rtol=1e-4, atol=1e-4)
