"""Where a recorded experiment came from: the commit it was trained at.

The trained experiments of chapters 13, 14 and 16 (``cache_pareto``,
``sparse_training``, ``mqar``) run for longer than a notebook may, so a
script writes their results to a data file with their provenance, and the
chapter loads it; :func:`git_commit` is the part of that provenance they
share.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit() -> str | None:
    """The repository's HEAD commit, with ``+dirty`` when the package has
    uncommitted changes; None outside a git checkout."""
    package = Path(__file__).resolve().parent.parent
    try:
        head, dirty = (
            subprocess.run(
                command,
                cwd=package,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            for command in (
                ["git", "rev-parse", "HEAD"],
                ["git", "status", "--porcelain", "--", "."],
            )
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")
