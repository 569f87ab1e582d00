"""The code is formatted and linted by ruff, at the line length that fits the
book's code column (pyproject.toml; tests/test_book.py checks the column)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")
CHECKED = ["conftest.py", "code", "tests", "scripts", "book"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(RUFF), *args, *CHECKED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_ruff_format_leaves_every_file_as_it_is():
    proc = ruff("format", "--check")
    assert proc.returncode == 0, (
        "run `make format`:\n" + proc.stdout[-4000:] + proc.stderr[-2000:]
    )


def test_ruff_check_finds_nothing():
    proc = ruff("check", "--output-format", "concise")
    assert proc.returncode == 0, (
        "run `make format`, then fix what remains:\n"
        + proc.stdout[-4000:]
        + proc.stderr[-2000:]
    )
