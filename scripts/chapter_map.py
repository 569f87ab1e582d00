"""Which chapter shows, uses and tests which code: the map in CONTRIBUTING.md,
made from the book.

Reads the code cells of book/*.ipynb: the modules a chapter imports or calls
through ``attnbook.``, and, from the outputs of ``attnbook.show_source``, the
modules whose code it prints ("Defined in `attnbook/x.py` as `name`"). Prints a
Markdown table; ``--write`` puts it into CONTRIBUTING.md between the two
chapter-map markers. ``tests/test_chapter_map.py`` fails when the table there
is not what this script makes, so the map cannot go stale.

    .venv/bin/python scripts/chapter_map.py --write
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOK, CONTRIBUTING = ROOT / "book", ROOT / "CONTRIBUTING.md"
START, END = "<!-- chapter-map:start -->", "<!-- chapter-map:end -->"
#: Tools every chapter uses; listing them in every row would hide the rest.
TOOLS = {
    "attnbook.plotting",
    "attnbook.bench",
    "attnbook.glue",
    "attnbook.seeds",
    "attnbook.source",
}
SHOWN = re.compile(r"Defined in `([\w/]+)\.py` as `([\w.]+)`")


def code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def shown(nb: dict) -> list[tuple[str, str]]:
    """``(module, qualified name)`` of every show_source output of a notebook,
    in order."""
    found = []
    for cell in code_cells(nb):
        for out in cell.get("outputs", []):
            text = "".join(
                out.get("data", {}).get("text/markdown", "")
            ) + "".join(out.get("text", ""))
            found += [
                (path.replace("/", ".").removesuffix(".__init__"), name)
                for path, name in SHOWN.findall(text)
            ]
    return found


def module_of(package: str, name: str) -> str | None:
    """The module that defines ``<package>.<name>`` (a submodule, a function or
    a class), or None."""
    dotted = f"{package}.{name}"
    if importlib.util.find_spec(
        package
    ).submodule_search_locations and importlib.util.find_spec(dotted):
        # a submodule: from attnbook import heads
        return dotted
    obj = getattr(importlib.import_module(package), name, None)
    return getattr(obj, "__module__", None)


def used(nb: dict) -> set[str]:
    """Every attnbook module a notebook's code imports or calls."""
    source = "\n".join("".join(c["source"]) for c in code_cells(nb))
    modules = set()
    imports = re.findall(
        r"^\s*from (attnbook(?:\.\w+)*) import \(([^)]*)\)", source, re.M
    )
    imports += re.findall(
        r"\bfrom (attnbook(?:\.\w+)*) import ([\w, ]+)", source
    )
    for package, names in imports:
        for name in filter(
            None, (n.split(" as ")[0].strip() for n in names.split(","))
        ):
            modules.add(
                module_of(package, name) if _is_package(package) else package
            )
    modules.update(
        module_of("attnbook", name)
        for name in re.findall(r"\battnbook\.(\w+)", source)
    )
    return {
        m
        for m in modules
        if m
        and m.startswith("attnbook.")
        and m not in ("attnbook.experiments", "attnbook.exercises")
    }


def _is_package(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.submodule_search_locations is not None


def tests_for(modules) -> list[str]:
    """tests/test_<last part of the module name>.py (and test_exercises_<x>.py
    for checkers) that exist; for a module of a subpackage,
    test_<subpackage>_<module>.py first (``attnbook.latent.cost``:
    test_latent_cost.py, not test_cost.py, which tests ``attnbook.cost``)."""
    names = []
    for m in modules:
        last = m.rsplit(".", 1)[-1]
        if ".exercises." in m:
            stems = [f"test_exercises_{last}"]
        else:
            inner = m.removeprefix("attnbook.").removeprefix("experiments.")
            stems = [f"test_{inner.replace('.', '_')}", f"test_{last}"]
        found = [s for s in stems if (ROOT / "tests" / f"{s}.py").exists()]
        names += found[:1]
    return sorted(set(names))


def chapter_numbers() -> dict[str, str]:
    """The number of each chapter in the reading order of _toc.yml (its
    numbered parts, counted continuously), by file stem: a chapter keeps its
    file name when later chapters are inserted before it."""
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    stems = [
        chapter["file"].removeprefix("book/")
        for part in toc.get("parts", [])
        if part.get("numbered")
        for chapter in part.get("chapters", [])
    ]
    return {stem: f"{i:02d}" for i, stem in enumerate(stems, 1)}


def short(module: str) -> str:
    return (
        module.removeprefix("attnbook.")
        .removeprefix("experiments.")
        .removeprefix("exercises.")
    )


def rows() -> list[list[str]]:
    table = []
    numbers = chapter_numbers()
    paths = sorted(
        BOOK.glob("[0-9][0-9]-*.ipynb"),
        key=lambda p: numbers.get(p.stem, p.stem[:2]),
    )
    for path in paths:
        nb = json.loads(path.read_text())
        shows = {m for m, _ in shown(nb)}
        uses = used(nb) | shows
        library = {
            m
            for m in uses
            if not m.startswith(
                ("attnbook.experiments.", "attnbook.exercises.")
            )
        }
        experiments = {
            m for m in uses if m.startswith("attnbook.experiments.")
        }
        checkers = {m for m in uses if m.startswith("attnbook.exercises.")}
        also = library - shows - TOOLS

        def cell(ms):
            return (
                ", ".join(
                    f"`{short(m)}`"
                    + (" (shown)" if m in shows and m in experiments else "")
                    for m in sorted(ms)
                )
                or "-"
            )

        table.append(
            [
                numbers.get(path.stem, path.stem[:2]),
                cell(shows - experiments),
                cell(also),
                cell(experiments),
                cell(checkers),
                ", ".join(tests_for(shows | also | experiments | checkers))
                or "-",
            ]
        )
    return table


def markdown() -> str:
    head = [
        "ch",
        "shows the code of",
        "also uses",
        "experiments (`attnbook.experiments`)",
        "checkers (`attnbook.exercises`)",
        "tests (`tests/*.py`)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows()]
    return "\n".join(lines)


def with_table(text: str, table: str) -> str:
    """``text`` (CONTRIBUTING.md) with the table between the markers replaced
    by ``table``."""
    if START not in text or END not in text:
        raise SystemExit(
            f"CONTRIBUTING.md lacks the markers {START} and {END}"
        )
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    return f"{before}{START}\n{table}\n{END}{after}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--write",
        action="store_true",
        help="update the table in CONTRIBUTING.md",
    )
    args = parser.parse_args(argv)
    table = markdown()
    if args.write:
        CONTRIBUTING.write_text(with_table(CONTRIBUTING.read_text(), table))
    else:
        print(table)


if __name__ == "__main__":
    main()
