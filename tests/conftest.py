"""Shared fixtures for the package tests."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from hypothesis import settings
import torch


# Hypothesis fails an example that takes longer than 200 ms by default: under
# load (two test files on two cores, other sessions beside them) an example of
# a few milliseconds has taken 254. No test may fail on time, so no deadline.
settings.register_profile("book", deadline=None)
settings.load_profile("book")

# Triton reads TRITON_INTERPRET when it is first imported, and some tests
# import it indirectly (torch.utils.flop_counter does): without a GPU, set it
# before any of them, so that the kernels of attnbook.kernels run under the
# interpreter on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of small-tensor torch tests: one thread is as fast as two
    for tiny tensors, and does not stall when other processes share the CPU
    (torch's threads spin-wait for each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the headless browser of the page checks (tests/test_book.py,
# tests/test_lite.py) ----------------- One Chromium for the whole session:
# Playwright's sync API cannot start a second instance while the first one's
# event loop runs, so the two modules share this one.

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    return (
        os.environ.get("CHROMIUM")
        or shutil.which("chromium")
        or shutil.which("chromium-browser")
    )


@pytest.fixture(scope="session")
def browser():
    path = chromium_path()
    if path is None:
        message = (
            "Debian's chromium is not installed (apt-get install chromium)"
        )
        if os.environ.get("CI"):
            # in CI a missing browser is a failure, never a skip
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield b
        b.close()
