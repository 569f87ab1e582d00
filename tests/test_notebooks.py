"""Every chapter notebook follows the book's anatomy (design section 4) and is
committed executed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "book").glob("[0-9][0-9]-*.ipynb"))
IDS = [nb.stem for nb in NOTEBOOKS]


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def source(cell) -> str:
    return "".join(cell["source"])


def code_cells(nb):
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def markdown(nb) -> str:
    return "\n".join(
        source(c) for c in nb["cells"] if c["cell_type"] == "markdown"
    )


def repository_url() -> str:
    return yaml.safe_load((ROOT / "_config.yml").read_text())["repository"][
        "url"
    ]


def test_the_toc_lists_every_chapter_and_nothing_missing():
    toc = (ROOT / "_toc.yml").read_text()
    listed = re.findall(r"file:\s*(\S+)", toc)
    for entry in listed:
        assert any(
            (ROOT / f"{entry}{ext}").exists() for ext in ("", ".md", ".ipynb")
        ), entry
    for nb in NOTEBOOKS:
        assert f"book/{nb.stem}" in listed, f"{nb.name} is not in _toc.yml"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_setup_cell_installs_attnbook_from_the_repository(path):
    nb = load(path)
    setup = code_cells(nb)[0]
    assert "hide-cell" in setup["metadata"].get("tags", [])
    text = source(setup)
    assert 'find_spec("attnbook") is None' in text
    assert repository_url() in text, (
        "the setup cell must install from _config.yml's repository url"
    )
    assert "ATTNBOOK_SOURCE" in text
    assert not re.search(r"(numpy|torch)\s*[=<>~]=", text), (
        "never pin numpy or torch in the setup cell"
    )
    assert nb["metadata"]["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_committed_with_outputs_and_no_unexpected_errors(path):
    cells = code_cells(load(path))
    assert sum(bool(c["outputs"]) for c in cells) >= len(cells) // 3, (
        "commit the executed notebook"
    )
    for i, cell in enumerate(cells):
        tags = cell["metadata"].get("tags", [])
        errors = [o for o in cell["outputs"] if o["output_type"] == "error"]
        if "raises-exception" in tags:
            assert errors, (
                f"cell {i} is tagged raises-exception but raised nothing"
            )
        else:
            assert not errors, f"cell {i} raised {errors[0]['ename']}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_chapter_anatomy(path):
    nb = load(path)
    text = markdown(nb)
    assert source(nb["cells"][0]).startswith("# "), (
        "the first cell is the chapter's title"
    )
    headings = re.findall(r"^## (.+)$", text, re.M)
    for required in ("Exercises", "Summary", "Solutions"):
        assert required in headings, f"missing section '## {required}'"
    assert (
        headings.index("Exercises")
        < headings.index("Summary")
        < headings.index("Solutions")
    )
    exercises = re.findall(r"\{exercise\}", text)
    assert len(exercises) >= 3, "at least three exercises"
    solutions = re.findall(r"\{solution(?:-start)?\}", text)
    assert len(solutions) >= len(exercises), "a solution for each exercise"
    checked = [
        c for c in code_cells(nb) if re.search(r"\bcheck_\w+\(", source(c))
    ]
    assert any(
        "raises-exception" in c["metadata"].get("tags", []) for c in checked
    ), "at least one exercise is checked by code on a stub"
    assert "{cite" in text, "cite the primary papers"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_variable_outputs_are_the_only_ignored_ones(path):
    """nbval-ignore-output must hide timings, machine names or per-seed tables,
    not inconvenient results.

    A per-seed table varies with the CPU, so it names the machine it ran on
    (``bench.machine()``); its verdict goes in a checked cell."""
    for cell in code_cells(load(path)):
        if "nbval-ignore-output" in cell["metadata"].get("tags", []):
            text = source(cell)
            assert re.search(
                r"time|bench|machine|device|perf_counter|cuda|gpu", text, re.I
            ), (
                "an ignored output that measures nothing "
                f"variable:\n{text[:300]}"
            )


NEGATIVE_ZERO = re.compile(r"(?<![\w.])-0(\.0*)?(?![\d.]*[1-9])(?![\w.])")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_checked_outputs_show_no_negative_zero(path):
    """-0. and 0. differ only by the sign of a rounding error, which differs
    between CPUs."""
    for i, cell in enumerate(code_cells(load(path))):
        if "nbval-ignore-output" in cell["metadata"].get("tags", []):
            continue
        for out in cell.get("outputs", []):
            text = "".join(out.get("text", "")) + "".join(
                out.get("data", {}).get("text/plain", "")
            )
            assert not NEGATIVE_ZERO.search(text), (
                f"code cell {i} prints a negative zero: {text[:300]}"
            )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_solution_code_is_folded(path):
    """The introduction promises that solutions are folded: after the
    Solutions heading, every code cell's source is folded (hide-input), except
    the one-line calls that show the package's own source."""
    cells = load(path)["cells"]
    start = next(
        (
            i
            for i, c in enumerate(cells)
            if c["cell_type"] == "markdown"
            and re.search(r"^#+ Solutions", source(c), re.M)
        ),
        None,
    )
    assert start is not None, f"{path.name} has no Solutions heading"
    open_cells = [
        source(c).splitlines()[0]
        for c in cells[start:]
        if c["cell_type"] == "code"
        and not source(c).lstrip().startswith("attnbook.show_source")
        and not {"hide-input", "hide-cell"}
        & set(c["metadata"].get("tags", []))
    ]
    assert not open_cells, (
        f"solution code cells shown open in {path.name} (tag them "
        f"hide-input): {open_cells}"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_answer_sources_in_solutions_are_folded(path):
    """After the Solutions heading, a show_source of a function that answers
    an exercise (attnbook.exercises.ANSWERS) is folded: its output too (the
    source), by hide-output or hide-cell, unless the cell lies inside a gated
    solution ({solution-start} ... {solution-end}), which folds it all. The
    PDF prints it (book/_ext/book_latex.py, item 2)."""
    import attnbook.exercises as exercises

    answers = {
        dotted.rpartition(".")[2]
        for names in exercises.ANSWERS.values()
        for dotted in names
    }
    cells = load(path)["cells"]
    start = next(
        i
        for i, c in enumerate(cells)
        if c["cell_type"] == "markdown"
        and re.search(r"^#+ Solutions", source(c), re.M)
    )
    gated, open_cells = False, []
    for i, cell in enumerate(cells[start:], start):
        text = source(cell)
        if cell["cell_type"] == "markdown":
            for mark in re.findall(r"\{solution-(start|end)\}", text):
                gated = mark == "start"
            continue
        shown = set(re.findall(r"show_source\((?:[\w.]*\.)?(\w+)\)", text))
        tags = set(cell["metadata"].get("tags", []))
        if (
            shown & answers
            and not gated
            and not {"hide-output", "hide-cell"} & tags
        ):
            open_cells.append((i, sorted(shown & answers)))
    assert not open_cells, (
        f"{path.name} prints the source of an answer unfolded in its "
        f"Solutions (tag the cells hide-output): {open_cells}"
    )
