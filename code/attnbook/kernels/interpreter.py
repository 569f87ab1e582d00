"""The one place the kernels import Triton: after choosing, without a CUDA GPU,
its interpreter.

Without a CUDA GPU the kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``), which executes every program with numpy on CPU
tensors: the same kernel code, only slow. Setting that variable is a side
effect on the whole process, so only the modules of :mod:`attnbook.kernels`
that need Triton import this one (through :mod:`attnbook.kernels.device`); the
rest of the package, the resource table and the time model included, never sets
it. Chapter 10 shows :func:`use_interpreter_without_cuda`.
"""

from __future__ import annotations

import os

import torch


def use_interpreter_without_cuda() -> bool:
    """Without a CUDA GPU, ask Triton to interpret its kernels on the CPU.

    Triton consults ``TRITON_INTERPRET`` each time ``@triton.jit`` turns a
    Python function into a kernel: its own library functions (``tl.zeros``,
    ``tl.sum``, ...) when ``triton`` is first imported, the book's kernels when
    :mod:`attnbook.kernels.device` is imported. Both must agree, so the
    variable has to be set before the first ``import triton`` in the process;
    this function runs before ours. ``setdefault`` keeps a value the user set
    on purpose. Returns whether the variable asks for the interpreter.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


use_interpreter_without_cuda()

try:
    import triton
    import triton.language as tl
# pragma: no cover - triton ships with torch's CUDA wheels
except ImportError as err:
    # (attnbook is not on PyPI, so an install hint must name a package that is:
    # triton itself)
    raise ImportError(
        "attnbook.kernels needs Triton: `pip install triton` (Linux). Without "
        "a GPU its "
        "interpreter runs the kernels on the CPU, as on Colab's CPU runtime"
    ) from err

__all__ = ["tl", "triton", "use_interpreter_without_cuda"]
