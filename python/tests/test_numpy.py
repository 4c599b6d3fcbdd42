"""The Python package with NumPy: results against NumPy, zero copies shown by equal data pointers
(results out, and compact NumPy inputs read in place), every dtype through DLPack (versioned and
legacy capsules), parameters, errors."""

import gc

import numpy as np
import pytest

import rustytorch as rt

MLP = """
graph {
  %0 = input x : f32[4,6]
  %1 = param w : f32[6,3] = uniform(-0.5, 0.5, seed=3)
  %2 = param b : f32[3] = uniform(-0.1, 0.1, seed=4)
  %3 = matmul(%0, %1) : f32[4,3]
  %4 = add(%3, %2) : f32[4,3]
  %5 = relu(%4) : f32[4,3]
  output y = %5
}
"""

TWO_OUTPUTS = """
graph {
  %0 = input a : i64[5]
  %1 = input b : i64[5]
  %2 = add(%0, %1) : i64[5]
  %3 = mul(%0, %1) : i64[5]
  output sum = %2
  output prod = %3
}
"""

# Every dtype NumPy has (bfloat16 is not a NumPy dtype).
DTYPES = {
    "f32": np.float32,
    "f64": np.float64,
    "f16": np.float16,
    "i32": np.int32,
    "i64": np.int64,
    "u8": np.uint8,
    "bool": np.bool_,
}


def sample(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def mlp_reference(x, w, b):
    return np.maximum(x.astype(np.float64) @ w.astype(np.float64) + b, 0.0)


@pytest.fixture
def mlp():
    return rt.compile_ir(MLP, "cpu")


def test_mlp_matches_numpy(mlp):
    w = np.from_dlpack(mlp.param("w"))
    b = np.from_dlpack(mlp.param("b"))
    x = sample(np.float32, (4, 6), 1)
    y = np.from_dlpack(mlp(x=x))
    assert y.shape == (4, 3) and y.dtype == np.float32
    want = mlp_reference(x, w, b)
    assert (want > 0).any() and (want == 0).any()
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    # Positional inputs and run() by name give the same.
    np.testing.assert_array_equal(np.from_dlpack(mlp(x)), y)
    np.testing.assert_array_equal(np.from_dlpack(mlp.run(x=x)["y"]), y)


def test_strided_inputs_are_read_by_their_strides(mlp):
    w = np.from_dlpack(mlp.param("w"))
    b = np.from_dlpack(mlp.param("b"))
    big = sample(np.float32, (12, 8), 2)
    x = big[::3, 7:1:-1]  # rows every third, columns reversed: not contiguous
    assert not x.flags.c_contiguous
    np.testing.assert_allclose(
        np.from_dlpack(mlp(x=x)), mlp_reference(x, w, b), rtol=1e-5, atol=1e-6
    )
    x_t = np.ascontiguousarray(sample(np.float32, (6, 4), 3)).T  # a transpose
    np.testing.assert_allclose(
        np.from_dlpack(mlp(x=x_t)), mlp_reference(x_t, w, b), rtol=1e-5, atol=1e-6
    )


def test_results_are_shared_not_copied(mlp):
    y = mlp(x=sample(np.float32, (4, 6), 4))
    a = np.from_dlpack(y)
    b = np.from_dlpack(y)
    assert a.ctypes.data == y.data_ptr == b.ctypes.data
    assert a.flags.writeable
    a[0, 0] = 42.0
    assert b[0, 0] == 42.0
    # The arrays keep the memory alive after the tensor is gone.
    del y
    gc.collect()
    assert b[0, 0] == 42.0


IDENTITY = """
graph {
  %0 = input x : f32[4,6]
  %1 = reshape[shape=24](%0) : f32[24]
  output x = %0
  output flat = %1
}
"""


def test_numpy_inputs_are_read_in_place(mlp):
    w = np.from_dlpack(mlp.param("w"))
    b = np.from_dlpack(mlp.param("b"))
    x = sample(np.float32, (4, 6), 5)
    want = mlp_reference(x, w, b)
    y = mlp(x=x)
    assert mlp.copied_inputs == []
    np.testing.assert_allclose(np.from_dlpack(y), want, rtol=1e-5, atol=1e-6)
    # A tensor made from the array views the array's own memory.
    t = rt.from_dlpack(x)
    assert t.data_ptr == x.ctypes.data
    # A graph that hands its input back shows the session read it where NumPy put it.
    exe = rt.compile_ir(IDENTITY, optimize=False)
    same, flat = exe(x)
    assert exe.copied_inputs == []
    assert same.data_ptr == x.ctypes.data and flat.data_ptr == x.ctypes.data
    np.testing.assert_array_equal(np.from_dlpack(flat), x.reshape(24))
    # Exported back, a view of NumPy's memory is read-only: nothing writes into it through us.
    back = np.from_dlpack(t)
    assert back.ctypes.data == x.ctypes.data and not back.flags.writeable
    # The view keeps NumPy's memory alive after the array is gone.
    keep = x.copy()
    del x, back, same, flat
    gc.collect()
    np.testing.assert_array_equal(np.from_dlpack(t), keep)
    np.testing.assert_allclose(np.from_dlpack(mlp(x=t)), want, rtol=1e-5, atol=1e-6)


def test_strided_and_misaligned_inputs_are_copied_and_reported(mlp):
    w = np.from_dlpack(mlp.param("w"))
    b = np.from_dlpack(mlp.param("b"))
    x = sample(np.float32, (8, 6), 20)[::2]
    y = mlp(x=x)
    assert [name for name, _ in mlp.copied_inputs] == ["x"]
    assert "strided" in mlp.copied_inputs[0][1]
    np.testing.assert_allclose(np.from_dlpack(y), mlp_reference(x, w, b), rtol=1e-5, atol=1e-6)
    # float32 elements one byte into a buffer: not aligned for f32.
    raw = np.zeros(4 * 24 + 1, np.uint8)
    x = raw[1:].view(np.float32).reshape(4, 6)
    x[...] = sample(np.float32, (4, 6), 21)
    assert not x.flags.aligned
    y = mlp(x=x)
    assert "not aligned" in mlp.copied_inputs[0][1]
    np.testing.assert_allclose(np.from_dlpack(y), mlp_reference(x, w, b), rtol=1e-5, atol=1e-6)


def test_staged_inputs_are_not_copied(mlp):
    w = np.from_dlpack(mlp.param("w"))
    b = np.from_dlpack(mlp.param("b"))
    buf = rt.zeros("f32", [4, 6])
    view = np.from_dlpack(buf)
    assert view.ctypes.data == buf.data_ptr
    for seed in (6, 7):
        x = sample(np.float32, (4, 6), seed)
        view[...] = x  # fill RustyTorch's memory in place
        y = mlp(x=buf)
        assert mlp.copied_inputs == []
        np.testing.assert_allclose(np.from_dlpack(y), mlp_reference(x, w, b), rtol=1e-5, atol=1e-6)
    # A result fed back as an input is not copied either.
    staged = rt.from_dlpack(sample(np.float32, (4, 6), 8))
    assert rt.from_dlpack(staged).data_ptr == staged.data_ptr
    mlp(x=staged)
    assert mlp.copied_inputs == []


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_round_trips(name):
    dtype = DTYPES[name]
    for shape in [(3, 5), (0,), (2, 0, 3), ()]:
        x = sample(dtype, shape, 9)
        t = rt.from_dlpack(x)
        assert t.dtype == name and t.shape == shape and t.device == "cpu"
        if x.size:
            assert t.data_ptr == x.ctypes.data  # viewed, not copied
        back = np.from_dlpack(t)
        assert back.dtype == dtype and back.shape == shape
        np.testing.assert_array_equal(back, x)
        if x.size:
            assert back.ctypes.data == t.data_ptr
    # Strided views: negative, zero (broadcast) and non-unit strides.
    base = sample(dtype, (6, 7), 10)
    for view in [base[::-1, ::2], np.broadcast_to(base[0], (4, 7)), base.T]:
        np.testing.assert_array_equal(np.from_dlpack(rt.from_dlpack(view)), view)


def test_legacy_and_versioned_capsules(mlp):
    y = mlp(x=sample(np.float32, (4, 6), 11))
    assert '"dltensor"' in repr(y.__dlpack__())
    assert '"dltensor_versioned"' in repr(y.__dlpack__(max_version=(1, 0)))
    assert '"dltensor"' in repr(y.__dlpack__(max_version=(0, 8)))
    assert y.__dlpack_device__() == (1, 0)
    # Capsules nobody consumed release their tensors (nothing leaks or crashes).
    for _ in range(1000):
        y.__dlpack__(max_version=(1, 1))
        y.__dlpack__()
    gc.collect()
    # copy=True copies; a device elsewhere is refused without a copy.
    c = np.from_dlpack(y, copy=True)
    assert c.ctypes.data != y.data_ptr
    np.testing.assert_array_equal(c, np.from_dlpack(y))
    with pytest.raises(BufferError):
        y.__dlpack__(max_version=(1, 1), dl_device=(2, 0), copy=False)


def test_parameters_read_and_write_through_dlpack(mlp):
    x = sample(np.float32, (4, 6), 12)
    w = sample(np.float32, (6, 3), 13)
    b = sample(np.float32, (3,), 14)
    assert [p[0] for p in mlp.parameters] == ["w", "b"]
    assert mlp.parameters[0] == ("w", "f32", [6, 3])
    mlp.set_param("w", w)
    mlp.set_param("b", rt.from_dlpack(b))
    np.testing.assert_array_equal(np.from_dlpack(mlp.param("w")), w)
    np.testing.assert_array_equal(np.from_dlpack(mlp.params()["b"]), b)
    np.testing.assert_allclose(
        np.from_dlpack(mlp(x=x)), mlp_reference(x, w, b), rtol=1e-5, atol=1e-6
    )
    # A parameter read is a copy: writing to it changes nothing inside.
    p = np.from_dlpack(mlp.param("w"))
    p[...] = 0
    np.testing.assert_array_equal(np.from_dlpack(mlp.param("w")), w)


def test_several_outputs_and_integers():
    exe = rt.compile_ir(TWO_OUTPUTS)
    a = sample(np.int64, (5,), 15)
    b = sample(np.int64, (5,), 16)
    s, p = exe(a, b)
    np.testing.assert_array_equal(np.from_dlpack(s), a + b)
    np.testing.assert_array_equal(np.from_dlpack(p), a * b)
    assert exe.outputs == ["sum", "prod"]
    assert [i[0] for i in exe.inputs] == ["a", "b"]


def test_errors_carry_the_rust_message(mlp, tmp_path):
    with pytest.raises(rt.Error, match=r"expected f32\[4,6\], got f64\[4,6\]"):
        mlp(x=np.zeros((4, 6)))
    with pytest.raises(rt.Error, match="missing"):
        mlp.run()
    with pytest.raises(rt.Error, match="no such input"):
        mlp(x=np.zeros((4, 6), np.float32), z=np.zeros(1))
    with pytest.raises(TypeError, match="__dlpack__"):
        mlp(x=[[1.0] * 6] * 4)
    with pytest.raises(KeyError):
        mlp.param("nope")
    with pytest.raises(rt.Error, match="expected f32\\[6,3\\]"):
        mlp.set_param("w", np.zeros((3, 6), np.float32))
    with pytest.raises(rt.Error):
        rt.compile_ir("graph {\n  %0 = frobnicate() : f32[1]\n}\n")
    with pytest.raises(rt.Error, match="unknown device"):
        rt.compile_ir(MLP, "tpu")
    with pytest.raises(rt.Error, match="nope.rtg"):
        rt.load(tmp_path / "nope.rtg")
    assert issubclass(rt.Error, Exception)


def test_load_ir_text_files(tmp_path):
    path = tmp_path / "mlp.rtir"
    path.write_text(MLP)
    exe = rt.load(path, "cpu", optimize=False)
    assert exe.device == "cpu"
    x = sample(np.float32, (4, 6), 17)
    w = np.from_dlpack(exe.param("w"))
    b = np.from_dlpack(exe.param("b"))
    np.testing.assert_allclose(np.from_dlpack(exe(x)), mlp_reference(x, w, b), rtol=1e-5, atol=1e-6)
    assert "matmul" in exe.optimized_ir()


def test_attention_block_matches_numpy():
    """The transformer block of examples/torch_attention.py, against NumPy in float64."""
    import math
    import pathlib

    exe = rt.load(pathlib.Path(__file__).parent.parent / "examples" / "attention_block.rtir")
    p = {n: np.from_dlpack(t).astype(np.float64) for n, t in exe.params().items()}
    x = sample(np.float32, (2, 16, 64), 18)

    def layer_norm(h):
        mu = h.mean(-1, keepdims=True)
        var = h.var(-1, keepdims=True)
        return (h - mu) / np.sqrt(var + 1e-5) * p["ln.w"] + p["ln.b"]

    def heads(t):
        return t.reshape(2, 16, 4, 16).transpose(0, 2, 1, 3)

    h = layer_norm(x.astype(np.float64))
    q, k, v = (heads(h @ p[w]) for w in ("wq", "wk", "wv"))
    s = q @ k.transpose(0, 1, 3, 2) * 0.25
    s = np.where(np.tril(np.ones((16, 16), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a = (a / a.sum(-1, keepdims=True)) @ v
    r = x + a.transpose(0, 2, 1, 3).reshape(2, 16, 64) @ p["wo"]
    u = layer_norm(r) @ p["w1"] + p["b1"]
    gelu = 0.5 * u * (1 + np.vectorize(math.erf)(u / math.sqrt(2)))
    want = r + gelu @ p["w2"] + p["b2"]
    np.testing.assert_allclose(np.from_dlpack(exe(x=x)), want, rtol=1e-4, atol=1e-4)


class LegacyProducer:
    """An array whose ``__dlpack__`` predates DLPack 1.0 (no ``max_version``)."""

    def __init__(self, inner):
        self.inner = inner

    def __dlpack__(self, stream=None):
        return self.inner.__dlpack__()

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()


def test_legacy_producers_and_consumers(mlp):
    x = sample(np.float32, (4, 6), 19)
    w = np.from_dlpack(mlp.param("w"))
    b = np.from_dlpack(mlp.param("b"))
    # An input from a legacy producer (NumPy's legacy capsule).
    y = mlp(x=LegacyProducer(x))
    np.testing.assert_allclose(np.from_dlpack(y), mlp_reference(x, w, b), rtol=1e-5, atol=1e-6)
    # A legacy consumer: NumPy falls back to the legacy capsule, still without a copy.
    a = np.from_dlpack(LegacyProducer(y))
    assert a.ctypes.data == y.data_ptr
    np.testing.assert_array_equal(a, np.from_dlpack(y))


def test_runs_from_several_threads(mlp):
    import threading

    w = np.from_dlpack(mlp.param("w"))
    b = np.from_dlpack(mlp.param("b"))
    xs = [sample(np.float32, (4, 6), 100 + k) for k in range(8)]
    results = [None] * len(xs)

    def work(k):
        for _ in range(50):
            results[k] = np.from_dlpack(mlp(x=xs[k]))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for x, y in zip(xs, results):
        np.testing.assert_allclose(y, mlp_reference(x, w, b), rtol=1e-5, atol=1e-6)
