"""Every chapter opens with its reading time and prerequisites, and marks its
optional depth as such (issue 31; the form is in CONTRIBUTING.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "book").glob("[0-9][0-9]-*.ipynb"))
BOX = re.compile(
    r"^(:::|```)\{admonition\} Reading time and prerequisites\n"
    r"(?::class: tip\n)(?P<body>.*?)^\1\s*$",
    re.M | re.S,
)


def markdown(path: Path) -> list[str]:
    cells = json.loads(path.read_text())["cells"]
    return [
        "".join(c["source"]) for c in cells if c["cell_type"] == "markdown"
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_the_first_cell_gives_reading_time_and_prerequisites(path):
    box = BOX.search(markdown(path)[0])
    assert box, f"{path.name}: no reading-time box in its first cell"
    body = box.group("body")
    for part in ("**Main path:**", "**Prerequisites:**"):
        assert part in body, f"{path.name}: the box lacks {part}"
    minutes = [int(m) for m in re.findall(r"about (\d+) minutes", body)]
    # issue 31: about 90 minutes; a stated main path over 100 means the
    # chapter needs more of its optional depth moved off it
    limit = 100
    assert minutes and 0 < minutes[0] <= limit, (
        f"{path.name}: the main path should read in about 90 minutes "
        f"(the box says {minutes})"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_going_deeper_boxes_are_collapsed(path):
    opened = [
        m.group(0)
        for cell in markdown(path)
        for m in re.finditer(
            r"^(?::::*|```+)\{admonition\} Going deeper.*\n(?!:class: "
            r"dropdown)",
            cell,
            re.M,
        )
    ]
    assert not opened, (
        f"{path.name}: Going deeper boxes not collapsed: {opened}"
    )
