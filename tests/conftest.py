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


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of small-tensor torch tests: one thread is as fast as two for tiny tensors, and
    does not stall when other processes share the CPU (torch's threads spin-wait for each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
