"""Shared fixtures for the package tests."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported, and some tests import it indirectly
# (torch.utils.flop_counter does): without a GPU, set it before any of them, so that the kernels
# of attnbook.triton_flash run under the interpreter on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
