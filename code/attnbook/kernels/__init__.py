"""The GPU code of the book, as one family (chapter 10): FlashAttention in
Triton.

- :mod:`~attnbook.kernels.device`: the ``@triton.jit`` functions, and the
  constants they read;
- :mod:`~attnbook.kernels.launch`: the launch policy, the configurations each
  kernel may launch with and a :class:`~attnbook.kernels.launch.LaunchPolicy`
  that chooses among them and keeps its choices keyed on what changes them;
- :mod:`~attnbook.kernels.host`: the host functions that validate, launch and
  combine, and the autograd Function (``triton_flash_attention``);
- :mod:`~attnbook.kernels.registry`: the kernels by name, which the resource
  table compiles;
- :mod:`~attnbook.kernels.resources`: what the compiler makes of each kernel
  (chapter 10's table);
- :mod:`~attnbook.kernels.time_model`: how fast they could run on GPUs the book
  has no access to.

Only the modules that need Triton import it (``device``, ``host``, and
``interpreter``, which chooses the interpreter first when there is no CUDA
GPU): the registry, the resource table and the time model import neither Triton
nor the device code, and set no environment variable. The host API is
importable from here, loaded on first use: ``from attnbook.kernels import
triton_flash_attention``.
"""

from __future__ import annotations

_HOST = (
    "triton_flash_attention",
    "flash_forward",
    "flash_backward",
    "flash_decode",
    "interpreted",
)


def __getattr__(name):
    if name in _HOST:
        from . import host

        return getattr(host, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_HOST)
