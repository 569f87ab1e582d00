"""`make test` sets up the Debian packages it needs, or says in one command
how, before anything runs.

scripts/system_packages.sh is run with a PATH of stand-ins, so that each case
(everything present, something missing for a user who may not install it) is
real without touching the machine's packages.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "system_packages.sh"


def stand_ins(folder: Path, commands: dict[str, str]) -> dict[str, str]:
    """An environment whose PATH holds only `folder`, with one script per
    command."""
    folder.mkdir()
    for name, body in commands.items():
        path = folder / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return {"PATH": str(folder), "HOME": os.environ.get("HOME", "/tmp")}


def run(env, *args):
    bash = "/bin/bash" if Path("/bin/bash").exists() else "/usr/bin/bash"
    return subprocess.run(
        [bash, str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_nothing_to_do_when_everything_is_there(tmp_path):
    env = stand_ins(
        tmp_path / "bin",
        {
            "chromium": "",
            "xelatex": "",
            "latexmk": "",
            "kpsewhich": "",
            "apt-get": "echo apt-get must not run >&2; exit 9",
        },
    )
    done = run(env)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""


def test_a_user_who_may_not_install_gets_the_command_and_a_failure(tmp_path):
    # sudo asks a password
    env = stand_ins(
        tmp_path / "bin",
        {
            "id": "echo 1000",
            "sudo": "exit 1",
            "apt-get": "echo apt-get must not run >&2; exit 9",
        },
    )
    done = run(env)
    assert done.returncode == 1
    assert "apt-get must not run" not in done.stderr
    line = next(
        line for line in done.stderr.splitlines() if "apt-get update" in line
    )
    assert re.search(r"sudo apt-get install -y chromium( |$)", line)
    assert re.search(
        r"--no-install-recommends texlive-latex-recommended .*texlive-xetex "
        r"latexmk",
        line,
    )
    assert "fonts-freefont-otf" in line


def test_only_what_is_missing_is_asked_for(tmp_path):
    env = stand_ins(tmp_path / "bin", {"id": "echo 1000", "chromium": ""})
    done = run(env)
    assert done.returncode == 1
    assert "chromium" not in done.stderr.replace("texlive", "")
    assert "texlive-xetex" in done.stderr
    assert run(env, "--check").stdout.startswith(
        "missing Debian packages: texlive-latex-recommended"
    )


def test_make_test_checks_the_packages_before_anything_else():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: system \$\(READY\)$", makefile, re.M)
    assert re.search(
        r"^system:\n\tbash scripts/system_packages.sh$", makefile, re.M
    )
    ci = (ROOT / ".ci" / "run").read_text()
    assert "apt-get" not in ci, ".ci/run calls only the README's commands"
    assert re.findall(r"^make \S+", ci, re.M) == [
        "make test",
        "make test-minimum",
    ]
