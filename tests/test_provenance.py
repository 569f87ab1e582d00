"""attnbook.experiments.provenance: the commit a recorded experiment names."""

import re
import subprocess

import pytest

from attnbook.experiments import provenance


def test_git_commit_is_the_checkouts_head():
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=provenance.__file__.rsplit("/", 1)[0],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    commit = provenance.git_commit()
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", commit), commit
    assert commit.split("+")[0] == head


def test_git_commit_is_none_without_git(monkeypatch):
    def no_git(*args, **kwargs):
        raise OSError("git is not installed")

    monkeypatch.setattr(provenance.subprocess, "run", no_git)
    assert provenance.git_commit() is None
