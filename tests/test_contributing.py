"""CONTRIBUTING.md's section "Where a variant plugs in": it names the four
seams, and what it names exists (so that a rename in the package, or in the
tests that find new variants, shows up here)."""

import importlib
import re
from pathlib import Path

import pytest

import attnbook

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(attnbook.__file__).resolve().parent
TEXT = (ROOT / "CONTRIBUTING.md").read_text()
SECTION = (
    TEXT.split("## Where a variant plugs in\n", 1)[-1].split("\n## ", 1)[0]
    if "## Where a variant plugs in\n" in TEXT
    else ""
)


def test_the_four_seams_are_written_down():
    assert SECTION, "CONTRIBUTING.md has no section 'Where a variant plugs in'"
    seams = re.findall(r"^- \*\*(.+?)\*\*", SECTION, re.M)
    assert [s.split(":")[0] for s in seams] == [
        "The `attention` hook",
        "A sibling layer",
        "The cache protocol",
        "The kernels",
    ]


@pytest.mark.parametrize(
    "dotted",
    sorted(set(re.findall(r"`(attnbook(?:\.\w+)+)`", SECTION))) or ["(none)"],
)
def test_the_names_it_gives_exist(dotted):
    parts = dotted.split(".")
    # the longest importable prefix is the module
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
            break
        except ModuleNotFoundError:
            continue
    # attnbook.cache_protocol . KVCacheProtocol
    for name in parts[split:]:
        obj = getattr(obj, name)


def test_the_files_it_names_exist():
    tests = re.findall(r"`(tests/\w+\.py)`", SECTION)
    modules = re.findall(r"`(\w+\.py)`", SECTION)
    assert tests and modules
    assert [t for t in tests if not (ROOT / t).exists()] == []
    assert [m for m in modules if not (PACKAGE / m).exists()] == []
    for test, table in (
        ("tests/test_torch_attention.py", "LAYER_ARGUMENTS"),
        ("tests/test_cache_protocol.py", "EXAMPLES"),
    ):
        assert (
            f"`{table}`" in SECTION
            and f"\n{table} = " in (ROOT / test).read_text()
        )
