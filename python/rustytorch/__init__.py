"""RustyTorch: run graphs compiled by RustyTorch on NumPy, PyTorch, JAX and CuPy arrays.

Load a graph file (or IR text), compile it for a device, and call it with any object that has
``__dlpack__``; results are :class:`Tensor` objects that ``numpy.from_dlpack``,
``torch.from_dlpack`` and the other libraries take without a copy::

    import numpy as np
    import rustytorch as rt

    exe = rt.load("mlp.rtg", device="cpu")
    y = np.from_dlpack(exe(x=np.ones((32, 64), dtype=np.float32)))
"""

from ._rustytorch import (
    Error,
    Executable,
    Tensor,
    __version__,
    compile_ir,
    from_dlpack,
    load,
    zeros,
)

__all__ = [
    "Error",
    "Executable",
    "Tensor",
    "__version__",
    "compile_ir",
    "from_dlpack",
    "load",
    "zeros",
]
