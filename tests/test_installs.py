"""The Triton that chapter 10's setup cell installs: the version torch
declares, else the newest."""

from __future__ import annotations

import importlib.metadata
import platform

import pytest

from attnbook.installs import triton_install_note, triton_requirement

# torch 2.11.0's declared requirements on PyPI (a CUDA build), abridged, with
# the Triton line as it stands there
TORCH_2_11 = [
    "filelock",
    "typing-extensions>=4.10.0",
    "sympy>=1.13.3",
    "networkx>=2.5.1",
    "jinja2",
    'nvidia-cuda-runtime-cu12==12.8.90; platform_system == "Linux"',
    'triton==3.6.0; platform_system == "Linux"',
    'optree>=0.13.0; extra == "optree"',
]


def test_the_version_torch_declares(monkeypatch):
    monkeypatch.setattr("platform.system", lambda: "Linux")
    assert triton_requirement(TORCH_2_11) == "triton==3.6.0"


def test_a_marker_for_another_machine_does_not_apply():
    other = [
        line.replace('"Linux"', '"Windows"')
        if line.startswith("triton")
        else line
        for line in TORCH_2_11
    ]
    if platform.system() == "Windows":
        pytest.skip("the marker names this machine")
    assert triton_requirement(other) == "triton"


def test_the_newest_when_torch_declares_none():
    cpu_build = [line for line in TORCH_2_11 if not line.startswith("triton")]
    assert triton_requirement(cpu_build) == "triton"
    assert triton_requirement([]) == "triton"


def test_a_range_is_kept_and_the_name_matched_without_case():
    assert triton_requirement(
        ['Triton>=3.5,<3.7; python_version >= "3.9"']
    ) in ("triton<3.7,>=3.5", "triton>=3.5,<3.7")


def test_the_installed_torch_is_read_by_default():
    declared = [
        line
        for line in importlib.metadata.requires("torch") or []
        if line.lower().startswith("triton")
    ]
    assert triton_requirement() == triton_requirement(declared)


def test_the_note_says_what_which_version_and_how_big():
    note = triton_install_note("triton==3.6.0", torch_version="2.11.0")
    assert (
        "triton==3.6.0" in note
        and "torch 2.11.0 requires" in note
        and "MB" in note
    )
    assert "newest" in triton_install_note(
        "triton", torch_version="2.13.0+cpu"
    )
