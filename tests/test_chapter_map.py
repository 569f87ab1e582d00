"""The rules that keep the book and the package one text (CONTRIBUTING.md, "Where the code of each
chapter lives"): shown code is the package's code, shown names are public, the library never
imports the experiments, every module names its chapters, and the chapter map is up to date.

No notebook is executed here: the checks read the committed outputs and the sources.
"""
import ast
import importlib
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "code" / "attnbook"
NOTEBOOKS = sorted((ROOT / "book").glob("[0-9][0-9]-*.ipynb"))
SHOWN = re.compile(r"Defined in `([\w/]+)\.py` as `([\w.]+)`\n\n```python\n(.*?)```", re.S)
MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


def shown_blocks(path):
    """``(code cell number, module, qualified name, shown source)`` for every show_source output."""
    nb = json.loads(path.read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for number, cell in enumerate(cells):
        for out in cell.get("outputs", []):
            text = "".join(out.get("data", {}).get("text/markdown", ""))
            for file, name, source in SHOWN.findall(text):
                yield number, file.replace("/", ".").removesuffix(".__init__"), name, source


def resolve(module, qualname):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "fn", obj)          # a Triton kernel: the Python function it wraps


def fix_command(path):
    nb = f"book/{path.name}"
    return f"make execute NB={nb} && make nbval NB={nb} (then reread the prose around the cell)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_every_chapter_shows_code_with_its_origin(path):
    source = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
    calls = source.count("show_source(")
    found = list(shown_blocks(path))
    assert len(found) >= calls, (f"{path.name} calls show_source {calls} times but {len(found)} outputs name "
                                 f"their origin: its outputs are older than show_source; {fix_command(path)}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_shown_code_is_the_package_code(path):
    """A function shown in a chapter is book text: when it changes, the chapter must be re-executed."""
    stale = []
    for cell, module, name, shown in shown_blocks(path):
        try:
            current = inspect.getsource(resolve(module, name))
        except (ImportError, AttributeError):
            stale.append(f"code cell {cell}: `{module}.{name}` no longer exists")
            continue
        if current != shown:
            stale.append(f"code cell {cell}: `{module}.{name}` has changed since the chapter showed it")
    assert not stale, f"{path.name}:\n  " + "\n  ".join(stale) + f"\nfix: {fix_command(path)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_shown_names_are_public(path):
    private = [f"`{module}.{name}` (code cell {cell})" for cell, module, name, _ in shown_blocks(path)
               if any(part.startswith("_") and not part.startswith("__") for part in name.split("."))]
    assert not private, (f"{path.name} shows private names {private}: a name the book shows is public; "
                         "rename it without the leading underscore")


def imports(path):
    """``(module imported from, names)`` of every ``from ... import`` in a module, resolved to attnbook.*"""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, [base, node.module or ""]))
            yield module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []


def test_the_library_never_imports_the_experiments():
    library = [p for p in MODULES if "experiments" not in p.relative_to(PACKAGE).parts]
    offenders = [f"{p.relative_to(ROOT)} imports {module}{' ' + ', '.join(names) if names else ''}"
                 for p in library for module, names in imports(p)
                 if module.startswith("attnbook.experiments")
                 or (module == "attnbook" and "experiments" in names)]
    assert not offenders, ("the library must not depend on one chapter's experiment code "
                           "(attnbook.experiments); move what it needs into the library:\n  " + "\n  ".join(offenders))


def test_no_private_name_is_imported_from_another_module():
    offenders = []
    for p in MODULES:
        for module, names in imports(p):
            if not module.startswith("attnbook"):
                continue
            for name in names:
                is_module = importlib.util.find_spec(f"{module}.{name}") is not None \
                    if importlib.util.find_spec(module).submodule_search_locations else False
                if name.startswith("_") and not is_module:
                    offenders.append(f"{p.relative_to(ROOT)}: from {module} import {name}")
    assert not offenders, ("a name used by another module is public: drop its leading underscore\n  "
                           + "\n  ".join(offenders))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_names_its_chapters(path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert re.search(r"\bchapters? \d|\b(every|no single|any|no) chapter", doc, re.I), (
        f"{path.relative_to(ROOT)}: say in the module docstring which chapter(s) show or use it "
        "(\"Chapter 8 (the KV cache) shows ...\"), or that every chapter / no single chapter does")


def test_the_chapter_map_in_contributing_is_up_to_date():
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "chapter_map.py")], capture_output=True,
                          text=True, check=True, cwd=ROOT).stdout.strip()
    text = (ROOT / "CONTRIBUTING.md").read_text()
    assert "<!-- chapter-map:start -->" in text, "CONTRIBUTING.md has no chapter map"
    current = text.split("<!-- chapter-map:start -->", 1)[1].split("<!-- chapter-map:end -->", 1)[0].strip()
    assert current == made, ("the chapter map in CONTRIBUTING.md is out of date; "
                             "run: .venv/bin/python scripts/chapter_map.py --write")
