"""The rules that keep the book and the package one text (CONTRIBUTING.md,
"Where the code of each chapter lives"): shown code is the package's code,
shown names are public, the library never imports the experiments, every module
names its chapters, and the chapter map is up to date.

No notebook is executed here: the checks read the committed outputs and the
sources.
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

from attnbook.source import defined_in

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "code" / "attnbook"
NOTEBOOKS = sorted((ROOT / "book").glob("[0-9][0-9]-*.ipynb"))
SHOWN = re.compile(
    r"Defined in `([\w/]+)\.py` as `([\w.]+)`\n\n```python\n(.*?)```", re.S
)
MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


def shown_blocks(path):
    """``(code cell number, module, qualified name, shown source)`` for every
    show_source output."""
    nb = json.loads(path.read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for number, cell in enumerate(cells):
        for out in cell.get("outputs", []):
            text = "".join(out.get("data", {}).get("text/markdown", ""))
            for file, name, source in SHOWN.findall(text):
                yield (
                    number,
                    file.replace("/", ".").removesuffix(".__init__"),
                    name,
                    source,
                )


def resolve(module, qualname):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    # a Triton kernel: the Python function it wraps
    return getattr(obj, "fn", obj)


def fix_command(path):
    nb = f"book/{path.name}"
    return (
        f"make execute NB={nb} && make nbval NB={nb} (then reread the "
        "prose around the cell)"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_every_chapter_shows_code_with_its_origin(path):
    source = "".join(
        "".join(c["source"])
        for c in json.loads(path.read_text())["cells"]
        if c["cell_type"] == "code"
    )
    calls = source.count("show_source(")
    found = list(shown_blocks(path))
    assert len(found) >= calls, (
        f"{path.name} calls show_source {calls} times but {len(found)} "
        "outputs name "
        "their origin: its outputs are older than show_source; "
        f"{fix_command(path)}"
    )


def stale_listings(blocks) -> list[str]:
    """What is out of date in shown blocks ``(cell, module, name, source)``: a
    name that no longer exists, a source that changed, or a "Defined in" line
    that names another file than the one that defines the code now (a function
    moved, and the old module still imports it)."""
    stale = []
    for cell, module, name, shown in blocks:
        try:
            obj = resolve(module, name)
        except (ImportError, AttributeError):
            stale.append(
                f"code cell {cell}: `{module}.{name}` no longer exists"
            )
            continue
        if inspect.getsource(obj) != shown:
            stale.append(
                f"code cell {cell}: `{module}.{name}` has changed since the "
                "chapter showed it"
            )
        path, qualname = defined_in(obj)
        if (
            path.removesuffix(".py")
            .replace("/", ".")
            .removesuffix(".__init__"),
            qualname,
        ) != (module, name):
            stale.append(
                f"code cell {cell}: the chapter says `{name}` is defined in "
                f"`{module}`, "
                f"but it is defined in `{path}` as `{qualname}`"
            )
    return stale


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_shown_code_is_the_package_code(path):
    """A function shown in a chapter is book text: when it changes or moves,
    the chapter must be re-executed."""
    stale = stale_listings(shown_blocks(path))
    assert not stale, (
        f"{path.name}:\n  "
        + "\n  ".join(stale)
        + f"\nfix: {fix_command(path)}"
    )


def test_a_listing_that_names_the_wrong_file_is_stale():
    """The "Defined in" line is checked too: ``causal_mask`` is imported into
    ``attnbook`` (so the old check, which only compared the source, passed),
    but it is defined in ``attnbook/masks.py``."""
    shown = inspect.getsource(resolve("attnbook.masks", "causal_mask"))
    assert stale_listings([(0, "attnbook.masks", "causal_mask", shown)]) == []
    moved = stale_listings([(0, "attnbook", "causal_mask", shown)])
    assert (
        len(moved) == 1
        and "defined in `attnbook/masks.py` as `causal_mask`" in moved[0]
    ), moved


# A few lines of a collapsed listing quoted in the prose, so that the main
# path need not open it (issue 31, student report s12i): a ```python block
# whose first line is "# name (attnbook/module.py), ...".
QUOTED = re.compile(
    r"```python\n# ([\w.]+) \(attnbook/([\w/]+)\.py\)[^\n]*\n(.*?)```", re.S
)


def quoted_blocks(path):
    """``(markdown cell number, module, qualified name, quoted lines)``."""
    nb = json.loads(path.read_text())
    for number, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "markdown":
            for name, file, body in QUOTED.findall("".join(cell["source"])):
                module = "attnbook." + file.replace("/", ".")
                yield number, module, name, body


def misquoted(module, name, body) -> list[str]:
    """The quoted lines that are not the function's, in its order: a line
    "..." (with an optional comment) stands for lines left out, and a line
    that is only a comment is the quote's own."""
    source = [
        line.strip()
        for line in inspect.getsource(resolve(module, name)).splitlines()
    ]
    wrong, at = [], 0
    for line in (line.strip() for line in body.splitlines()):
        if not line or line.startswith(("#", "...")):
            continue
        try:
            at = source.index(line, at) + 1
        except ValueError:
            wrong.append(line)
    return wrong


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_quoted_lines_are_the_package_code(path):
    for cell, module, name, body in quoted_blocks(path):
        wrong = misquoted(module, name, body)
        assert not wrong, (
            f"{path.name}, markdown cell {cell}: lines quoted from "
            f"`{module}.{name}` that are not its lines, in its order: {wrong}"
        )


def test_a_changed_line_is_a_misquote():
    body = "new_max = tl.maximum(row_max, tl.max(s, axis=1))\n...\n"
    assert misquoted("attnbook.kernels.device", "forward_step", body) == []
    changed = body.replace("axis=1", "axis=0")
    assert misquoted("attnbook.kernels.device", "forward_step", changed)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_shown_names_are_public(path):
    private = [
        f"`{module}.{name}` (code cell {cell})"
        for cell, module, name, _ in shown_blocks(path)
        if any(
            part.startswith("_") and not part.startswith("__")
            for part in name.split(".")
        )
    ]
    assert not private, (
        f"{path.name} shows private names {private}: a name the book shows is "
        "public; "
        "rename it without the leading underscore"
    )


def imports(source: str, path: Path):
    """``(module, [(name, bound as)])`` of every import in a module's source
    (``path`` resolves relative imports to attnbook.*). ``import a.b`` gives
    ``("a", [("", "a")])``: it binds the module ``a``; ``import a.b as c``
    gives ``("a.b", [("", "c")])``."""
    package = ".".join(
        path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    )
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, [base, node.module or ""]))
            yield (
                module,
                [
                    (alias.name, alias.asname or alias.name)
                    for alias in node.names
                ],
            )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                module = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
                yield module, [("", alias.asname or module)]


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    # a name inside a module that is not a package
    except ModuleNotFoundError:
        return False


def private_uses(source: str, path: Path) -> list[str]:
    """Private names of other attnbook modules that the module at ``path``
    uses: ``from attnbook.x import _name``, and ``x._name`` where ``x`` is an
    attnbook module it imported (``from . import x``, ``import attnbook.x as
    x``). A private *module* (``_validate``) may be imported and used
    package-wide."""
    # modules: local name -> the attnbook module bound to it
    found, modules = [], {}
    for module, names in imports(source, path):
        if not module.startswith("attnbook"):
            continue
        for name, bound in names:
            if not name:  # import attnbook[.x as y]
                modules[bound] = module
            elif is_module(f"{module}.{name}"):
                modules[bound] = f"{module}.{name}"
            elif name.startswith("_"):
                found.append(f"from {module} import {name}")
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not is_module(f"{modules[node.value.id]}.{node.attr}")
        ):
            found.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
    return [f"{path.relative_to(ROOT)}: {use}" for use in found]


# Known uses that another change is about to remove (none today). Delete an
# entry once it is gone.
AWAITING: set[str] = set()


def test_no_private_name_of_another_module_is_used():
    found = [use for p in MODULES for use in private_uses(p.read_text(), p)]
    offenders = [
        use for use in found if use.split(" (line")[0] not in AWAITING
    ]
    assert not offenders, (
        "a name used by another module is public: drop its leading "
        "underscore\n  " + "\n  ".join(offenders)
    )
    gone = AWAITING - {use.split(" (line")[0] for use in found}
    assert not gone, (
        "no longer used, delete from AWAITING in tests/test_chapter_map.py: "
        f"{sorted(gone)}"
    )


@pytest.mark.parametrize(
    "source, expected",
    [
        # the old test read only `from ... import _name`; these two attribute
        # uses passed it
        (
            "from . import softmax\nsoftmax._hidden\n",
            ["softmax._hidden (line 2)"],
        ),
        ("import attnbook.masks as m\nm._x()\n", ["m._x (line 2)"]),
        ("from .flash import _check\n", ["from attnbook.flash import _check"]),
        # allowed: a private module, a dunder, a private name of an object that
        # is not a module
        (
            "from . import _validate\nimport "
            "attnbook\n_validate.positive_int\nattnbook._validate\n",
            [],
        ),
        ("from .softmax import softmax\nsoftmax.__name__\nsoftmax._x\n", []),
    ],
)
def test_private_attribute_access_is_caught(source, expected):
    found = [
        use.split(": ", 1)[1]
        for use in private_uses(source, PACKAGE / "probe.py")
    ]
    assert found == expected


# the number of key/value heads is called n_kv_heads
OLD_KV_NAMES = {"h_kv", "kv_heads"}
# Files that keep an old name until /work/scratch/rename_kv_heads.sh renames it
# after the branches of issue 32 are merged (they belong to the other
# branches); the script deletes these lines.
KV_AWAITING = set([])


def names_used(source: str) -> set[str]:
    """Every identifier a piece of Python binds or reads: names, arguments,
    attributes, keywords. Strings and comments do not count: a printed label
    "h_kv = 2" is the math symbol."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        for field in ("id", "arg", "attr", "name"):
            value = getattr(node, field, None)
            if isinstance(value, str):
                found.add(value)
    return found


def code_of(path: Path) -> list[str]:
    """A Python file's source, or a notebook's code cells (their IPython magics
    replaced by ``pass``)."""
    if path.suffix == ".py":
        return [path.read_text()]
    cells = [
        c
        for c in json.loads(path.read_text())["cells"]
        if c["cell_type"] == "code"
    ]
    # an IPython magic: a statement that does nothing
    magic = re.compile(r"^(\s*)[%!].*$", re.M)
    return [magic.sub(r"\1pass", "".join(c["source"])) for c in cells]


def test_one_name_for_the_number_of_key_value_heads():
    files = (
        MODULES
        + sorted((ROOT / "tests").glob("*.py"))
        + sorted((ROOT / "scripts").glob("*.py"))
        + NOTEBOOKS
    )
    found = {
        p.relative_to(ROOT).as_posix(): sorted(
            set.union(*map(names_used, code_of(p)), set()) & OLD_KV_NAMES
        )
        for p in files
        if p.name != Path(__file__).name
    }
    found = {rel: names for rel, names in found.items() if names}
    extra = {
        rel: names for rel, names in found.items() if rel not in KV_AWAITING
    }
    assert not extra, (
        f"call the number of key/value heads n_kv_heads, not {extra}"
    )
    assert set(found) == KV_AWAITING, (
        f"delete from KV_AWAITING: {sorted(KV_AWAITING - set(found))}"
    )


def test_an_old_name_is_found_in_code_not_in_strings():
    assert names_used("b, h_kv, n, d = x.shape\n") & OLD_KV_NAMES == {"h_kv"}
    assert names_used("print(m.kv_heads)\n") & OLD_KV_NAMES == {"kv_heads"}
    assert names_used("def f(w, h, h_kv=1):\n    pass\n") & OLD_KV_NAMES == {
        "h_kv"
    }
    assert (
        names_used("print(f'h_kv = {n}')  # (b, h_kv, n, d)\n") & OLD_KV_NAMES
        == set()
    )


@pytest.mark.parametrize(
    "path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_every_module_names_its_chapters(path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    # a chapter named by its number, or by its title ("the perspectives
    # chapter"), which does not change when a chapter is inserted before it
    assert re.search(
        r"\bchapters?\s+\d|\b(every|no\s+single|any|no)\s+chapter"
        r"|\bthe\s+[a-z-]+\s+chapter\b",
        doc,
        re.I,
    ), (
        f"{path.relative_to(ROOT)}: say in the module docstring which "
        "chapter(s) show or use it "
        '("Chapter 8 (the KV cache) shows ..."), or that every chapter / no '
        "single chapter does"
    )


def test_the_chapter_map_in_contributing_is_up_to_date():
    made = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "chapter_map.py")],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.strip()
    text = (ROOT / "CONTRIBUTING.md").read_text()
    assert "<!-- chapter-map:start -->" in text, (
        "CONTRIBUTING.md has no chapter map"
    )
    current = (
        text.split("<!-- chapter-map:start -->", 1)[1]
        .split("<!-- chapter-map:end -->", 1)[0]
        .strip()
    )
    assert current == made, (
        "the chapter map in CONTRIBUTING.md is out of date; "
        "run: .venv/bin/python scripts/chapter_map.py --write"
    )
