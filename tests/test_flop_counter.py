"""attnbook.flop_counter imports torch's FlopCounterMode without the Triton
warning that a CUDA build of torch logs where Triton is missing (Colab's CPU
runtime), and the counter still counts."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

# A CPU build of torch (this machine's) never logs the warning: pretend to be a
# CUDA build, and make `import triton` fail (a None in sys.modules does that),
# as on Colab's CPU runtime.
PRETEND_COLAB_CPU = """
import sys
sys.modules["triton"] = None
import torch
torch.version.cuda = "12.8"
"""


def stderr_of(import_line: str) -> str:
    code = (
        textwrap.dedent(PRETEND_COLAB_CPU)
        + import_line
        + "\nprint(FlopCounterMode.__name__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "FlopCounterMode"
    return proc.stderr


def test_torch_itself_warns_there():
    """The control: without attnbook.flop_counter the warning appears, so the
    next test can fail."""
    assert "triton not found" in stderr_of(
        "from torch.utils.flop_counter import FlopCounterMode"
    )


def test_attnbook_import_is_silent_there():
    assert stderr_of("from attnbook.flop_counter import FlopCounterMode") == ""


def test_the_logger_is_left_as_it_was():
    code = (
        "import logging\nlogger = "
        "logging.getLogger('torch.utils.flop_counter')\n"
        "before = list(logger.filters)\nimport "
        "attnbook.flop_counter\nprint(logger.filters == before)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.stdout.strip() == "True", proc.stderr


def test_it_is_torchs_counter_and_counts():
    from attnbook.flop_counter import FlopCounterMode
    from torch.utils import flop_counter

    assert FlopCounterMode is flop_counter.FlopCounterMode
    a, b = torch.ones(3, 4), torch.ones(4, 5)
    with FlopCounterMode(display=False) as counter:
        a @ b
    assert counter.get_total_flops() == 2 * 3 * 4 * 5
