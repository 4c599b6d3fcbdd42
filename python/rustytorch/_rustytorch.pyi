"""Type stubs of the RustyTorch extension module."""

from os import PathLike
from typing import Any, Optional, Union

__version__: str

class Error(Exception):
    """An error of RustyTorch; the message is the Rust error's."""

class Tensor:
    """A tensor made by RustyTorch (a result, a parameter or an import).

    Pass it to ``numpy.from_dlpack``, ``torch.from_dlpack``, ``jax.dlpack.from_dlpack`` or
    ``cupy.from_dlpack``: host tensors are shared, not copied.
    """

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str:
        """``f32``, ``f64``, ``f16``, ``bf16``, ``i32``, ``i64``, ``u8`` or ``bool``."""
    @property
    def device(self) -> str:
        """``cpu`` or ``cuda:N``."""
    @property
    def data_ptr(self) -> int:
        """The address of the first element (a device address on a device)."""
    def __dlpack__(
        self,
        *,
        stream: Optional[int] = None,
        max_version: Optional[tuple[int, int]] = None,
        dl_device: Optional[tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """A DLPack capsule (versioned when ``max_version`` allows it, else legacy)."""
    def __dlpack_device__(self) -> tuple[int, int]: ...

class Executable:
    """A compiled graph; parameters and optimizer state persist between runs."""

    def run(self, **inputs: Any) -> dict[str, Tensor]:
        """Runs with inputs by name (any ``__dlpack__`` object); returns results by name."""
    def __call__(self, *args: Any, **kwargs: Any) -> Union[Tensor, tuple[Tensor, ...]]:
        """Runs with inputs in the graph's order or by name; one result, or a tuple."""
    @property
    def inputs(self) -> list[tuple[str, str, list[int]]]:
        """``(name, dtype, shape)`` of each input, in order."""
    @property
    def outputs(self) -> list[str]: ...
    @property
    def parameters(self) -> list[tuple[str, str, list[int]]]:
        """``(name, dtype, shape)`` of each parameter and state tensor."""
    @property
    def device(self) -> str: ...
    @property
    def copied_inputs(self) -> list[tuple[str, str]]:
        """What the last run copied instead of using in place, with the reason: inputs, and on
        CUDA also outputs (a replayed CUDA graph copies into and out of its own buffers)."""
    def param(self, name: str) -> Tensor:
        """A copy of a parameter's current value, on the executable's device."""
    def params(self) -> dict[str, Tensor]: ...
    def set_param(self, name: str, value: Any) -> None:
        """Replaces a parameter with any ``__dlpack__`` object of its type."""
    def optimized_ir(self) -> str: ...

def load(
    path: Union[str, PathLike[str]],
    device: str = "cpu",
    *,
    optimize: bool = True,
    updates: bool = True,
) -> Executable:
    """Loads a graph file (``.rtg``; IR text in ``.rtir``/``.txt``) and compiles it.

    ``device``: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``. ``updates=False`` compiles a graph
    with a training step as inference only.
    """

def compile_ir(
    text: str, device: str = "cpu", *, optimize: bool = True, updates: bool = True
) -> Executable:
    """Compiles a graph written as IR text."""

def from_dlpack(obj: Any) -> Tensor:
    """A host tensor with the elements of any DLPack array (shared when RustyTorch made it)."""

def zeros(dtype: str, shape: list[int]) -> Tensor:
    """A zero host tensor, to fill through ``numpy.from_dlpack`` and pass without a copy."""
