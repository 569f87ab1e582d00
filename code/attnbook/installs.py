"""What a chapter's setup cell installs on a fresh runtime, chosen to match
what is already there.

Chapter 10 needs Triton, which Colab's CPU runtime lacks. A torch wheel built
for CUDA declares the Triton it was built with (torch 2.11: ``triton==3.6.0``),
and the newest Triton need not work with it; so the setup cell installs the
version that the installed torch declares, and the newest only where torch
declares none (its CPU builds). A Triton wheel is a large download, and the
cell says so first. Chapter 10's setup cell uses it.
"""

from __future__ import annotations

import importlib.metadata

# matplotlib depends on packaging: always installed
from packaging.requirements import Requirement

# The Linux x86-64 wheels of Triton 3.x weigh about 150 to 300 MB (PyPI's file
# lists; 3.9.0's is 286 MB).
TRITON_DOWNLOAD = "about 150 to 300 MB"


def triton_requirement(torch_requires: list[str] | None = None) -> str:
    """The pip requirement for the Triton that goes with the installed torch.

    ``torch_requires``: torch's declared requirements, as
    ``importlib.metadata.requires("torch")`` gives them (the default), e.g.
    ``['filelock', 'triton==3.6.0; platform_system == "Linux"', ...]``. Returns
    the Triton entry that applies to this machine without its marker
    (``"triton==3.6.0"``), or ``"triton"`` (the newest) when there is none."""
    if torch_requires is None:
        torch_requires = importlib.metadata.requires("torch") or []
    for line in torch_requires:
        requirement = Requirement(line)
        if requirement.name.lower() != "triton":
            continue
        if requirement.marker is not None and not requirement.marker.evaluate(
            {"extra": ""}
        ):
            continue
        return f"triton{requirement.specifier}"
    return "triton"


def triton_install_note(
    requirement: str, torch_version: str | None = None
) -> str:
    """The one line a setup cell prints before it installs ``requirement``
    (from ``triton_requirement``)."""
    if torch_version is None:
        torch_version = importlib.metadata.version("torch")
    why = (
        f"the version torch {torch_version} requires"
        if requirement != "triton"
        else f"the newest: torch {torch_version} names no version"
    )
    return f"Installing {requirement} ({why}), a download of {TRITON_DOWNLOAD}"
