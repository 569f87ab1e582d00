"""Print the pip requirements of `make test-minimum`: attnbook's declared minimum versions.

numpy and matplotlib are pinned to the lower bounds that pyproject.toml declares (``>=X`` becomes
``==X``), so a bound that is not true fails in CI. torch stays at the version of requirements.txt:
here only the local CPU build can be installed (other versions are CUDA builds of gigabytes).
The test tools are pinned as in requirements.txt. Run from the repository root.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

AT_MINIMUM = ("numpy", "matplotlib")
TOOLS = ("torch", "triton", "pytest", "hypothesis", "nbval", "ipykernel", "threadpoolctl")


def pins(path: str = "requirements.txt") -> dict[str, str]:
    """name (lower case) -> the exact pin line of requirements.txt."""
    lines = Path(path).read_text().splitlines()
    return {m.group(1).lower(): line for line in lines if (m := re.match(r"([A-Za-z0-9_.-]+)==", line))}


def minimum_requirements() -> list[str]:
    declared = tomllib.loads(Path("pyproject.toml").read_text())["project"]["dependencies"]
    bounds = dict(re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", d).groups() for d in declared)
    missing = set(AT_MINIMUM) - bounds.keys()
    if missing:
        raise SystemExit(f"pyproject.toml declares no lower bound for {sorted(missing)}")
    exact = pins()
    return [f"{name}=={bounds[name]}" for name in AT_MINIMUM] + [exact[name] for name in TOOLS]


if __name__ == "__main__":
    print("\n".join(minimum_requirements()))
