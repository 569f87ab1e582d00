"""Every verdict a notebook prints as 'k/N seeds' (or 'in k/N runs') counts
over the seeds its own code runs: N is re-derived from the notebook's source,
from its ``seeds = range(...)`` definitions (any name ending in ``seeds``).

Chapter 7 once printed '... in 256/256 seeds' and '5/256 seeds': the
denominator was a variable ``n`` that a later cell had rebound to a context
length. Read without executing anything (committed outputs against committed
sources), so it runs in a second. A notebook that prints such a verdict must
define its seeds with ``range``, where this test can find them.
"""

import ast
import json
import re
from pathlib import Path

import pytest

BOOK = Path(__file__).resolve().parent.parent / "book"
NOTEBOOKS = sorted(BOOK.glob("*.ipynb"))

# 'in 5/5 seeds', '5/5 seeds reach', 'in 3/5 runs'; a bare 'k/N' that continues
# a verdict on the same line ('..., and ... in 5/5') is read with the
# seeds-verdict before it.
VERDICT = re.compile(r"(\d+)/(\d+)(?= (?:seeds|runs)\b)")


def range_length(node) -> int | None:
    """len(range(...)) for a ``range`` call with literal arguments, else
    None."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "range"
        and not node.keywords
    ):
        try:
            return len(range(*(ast.literal_eval(a) for a in node.args)))
        except ValueError:
            return None
    return None


def seed_counts(source: str) -> set[int]:
    """Numbers of seeds the code defines with ``range``, under a name that ends
    in ``seeds``: ``seeds = range(5)``, ``SEEDS = range(3)``, ``recall_seeds =
    range(5)``, ``sizes, seeds = (4, 16), range(5)``, and a keyword argument
    ``seeds=range(0, 8)``."""
    counts = set()

    def add(target, value):
        if (
            isinstance(target, ast.Name)
            and target.id.lower().endswith("seeds")
            and range_length(value) is not None
        ):
            counts.add(range_length(value))
        elif (
            isinstance(target, ast.Tuple)
            and isinstance(value, ast.Tuple)
            and len(target.elts) == len(value.elts)
        ):
            for t, v in zip(target.elts, value.elts):
                add(t, v)

    # IPython magics and shell lines are not Python: each becomes a `pass`, as
    # in test_bounds
    tree = ast.parse(
        "\n".join(
            line[: len(line) - len(line.lstrip())] + "pass"
            if line.lstrip().startswith(("%", "!"))
            else line
            for line in source.splitlines()
        )
    )
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                add(target, node.value)
        elif (
            isinstance(node, ast.keyword)
            and node.arg
            and node.arg.endswith("seeds")
        ):
            if range_length(node.value) is not None:
                counts.add(range_length(node.value))
    return counts


def verdicts(notebook: dict) -> list[tuple[int, str, int, int]]:
    """``(cell index, line, k, N)`` for every 'k/N seeds' or 'k/N runs' in the
    committed outputs."""
    found = []
    for i, cell in enumerate(notebook["cells"]):
        for output in cell.get("outputs", []):
            text = "".join(output.get("text", "")) or "".join(
                output.get("data", {}).get("text/plain", "")
            )
            for line in text.splitlines():
                found += [
                    (i, line, int(k), int(n)) for k, n in VERDICT.findall(line)
                ]
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_verdict_denominators_are_the_number_of_seeds_run(path):
    notebook = json.loads(path.read_text())
    found = verdicts(notebook)
    if not found:
        return
    counts = set().union(
        *(
            seed_counts("".join(c["source"]))
            for c in notebook["cells"]
            if c["cell_type"] == "code"
        )
    )
    assert counts, (
        f"{path.name} prints verdicts over seeds but defines no *seeds = "
        "range(...)"
    )
    for i, line, k, n in found:
        assert n in counts, (
            f"{path.name}, cell {i}: {line!r} counts over {n} runs, but the "
            "notebook runs "
            f"{sorted(counts)} seeds"
        )
        assert 0 <= k <= n, f"{path.name}, cell {i}: {line!r}"


def test_the_scan_catches_a_wrong_denominator():
    """The check fails on what chapter 7 printed: seeds = range(5), verdicts
    over 256."""
    notebook = {
        "cells": [
            {
                "cell_type": "code",
                "source": ["seeds = range(5)\n"],
                "outputs": [],
            },
            {
                "cell_type": "code",
                "source": ["print(...)\n"],
                "outputs": [
                    {
                        "output_type": "stream",
                        "name": "stdout",
                        "text": [
                            "mask tril(k=1), training loss below 1 nat in "
                            "256/256 seeds\n",
                            "position 7 worse ... in 5/256 seeds\n",
                        ],
                    }
                ],
            },
        ]
    }
    found = verdicts(notebook)
    assert [(k, n) for _, _, k, n in found] == [(256, 256), (5, 256)]
    source = "".join(notebook["cells"][0]["source"])
    assert seed_counts(source) == {5}
    assert not any(n in seed_counts(source) for *_, n in found)
    assert seed_counts("x = f(seeds=range(0, 8))\nseeds = range(3)") == {8, 3}
    assert seed_counts(
        "sizes, recall_seeds, d = (4, 16), range(5), 16\n%pip install x"
    ) == {5}
    assert seed_counts("seedsman = range(9)\nmy_seeds = [0, 1]") == set()
