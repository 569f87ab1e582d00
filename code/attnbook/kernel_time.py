"""The name chapter 9 imports chapter 10's time model by: this module is
:mod:`attnbook.kernels.time_model`.

The time model belongs to the kernels' family (:mod:`attnbook.kernels`), and
imports neither Triton nor the device code. ``from attnbook import
kernel_time`` gives the same module object.
"""

import sys

from .kernels import time_model

sys.modules[__name__] = time_model
