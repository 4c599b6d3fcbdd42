"""The Python side of the overhead measurement (docs/performance.md): a call of a tiny compiled
graph from Python, in microseconds, against `examples/overhead.rs` calling it from Rust.

    maturin develop --release --manifest-path python/Cargo.toml
    python python/bench/overhead.py
"""

import timeit

import numpy as np

import rustytorch as rt

TINY = """
graph {
  %0 = input x : f32[16]
  %1 = param b : f32[16] = full(0.5)
  %2 = add(%0, %1) : f32[16]
  %3 = relu(%2) : f32[16]
  output y = %3
}
"""


def per_call_us(stmt, number=100_000, repeat=5):
    stmt()
    return min(timeit.repeat(stmt, number=number, repeat=repeat)) / number * 1e6


def main():
    exe = rt.compile_ir(TINY, "cpu")
    x = np.arange(16, dtype=np.float32) - 8
    staged = rt.from_dlpack(x)
    want = np.maximum(x + 0.5, 0)
    np.testing.assert_array_equal(np.from_dlpack(exe(x=x)), want)
    rows = [
        ("exe(x=staged rustytorch.Tensor)", lambda: exe(x=staged)),
        ("exe(x=numpy array)", lambda: exe(x=x)),
        ("np.from_dlpack(exe(x=numpy array))", lambda: np.from_dlpack(exe(x=x))),
        ("exe.run(x=numpy array)", lambda: exe.run(x=x)),
    ]
    for name, f in rows:
        print(f"python {name}: {per_call_us(f):.3f} us/call")


if __name__ == "__main__":
    main()
