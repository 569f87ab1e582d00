"""PyTorch's flop counter, ``FlopCounterMode``, imported without its warning
about Triton.

``torch.utils.flop_counter`` logs "triton not found; flop counting will not
work for triton kernels", with the path of the file, when a CUDA (or ROCm, XPU)
build of torch is imported on a machine without
Triton: Colab's CPU runtime is such a machine. The chapters count the flops of
torch's own matrix products, never of Triton kernels, so that line tells their
reader nothing. Importing ``FlopCounterMode`` from here drops that one message,
during the import only; every other message of that logger, and the counter
itself, are left as they are. Chapters 4, 5 and 8 import it.
"""

from __future__ import annotations

import logging

__all__ = ["FlopCounterMode"]

_TRITON_MISSING = "triton not found; flop counting"


class _DropTritonMissing(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_TRITON_MISSING)


_logger = logging.getLogger("torch.utils.flop_counter")
_filter = _DropTritonMissing()
_logger.addFilter(_filter)
try:
    from torch.utils.flop_counter import FlopCounterMode
finally:
    _logger.removeFilter(_filter)
