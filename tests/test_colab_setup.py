"""A chapter copied out of the repository installs attnbook by itself, as on a
fresh Colab runtime.

The test builds a wheel of the package, makes a virtual environment that has
the book's dependencies but not attnbook, copies chapter 1 to a folder outside
the repository, and runs it there with ATTNBOOK_SOURCE pointing at the wheel
(the notebook's default source is the GitHub repository, which CI cannot
reach).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "book" / "01-token-embeddings.ipynb"


def run(*args, **kwargs):
    proc = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, **kwargs
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, args))} "
            f"failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # Build from a copy: setuptools writes build/ and *.egg-info next to the
    # sources.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "code",
        source / "code",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
    )
    out = tmp_path_factory.mktemp("wheel")
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--wheel-dir",
        out,
        source,
    )
    (built,) = out.glob("attnbook-*.whl")
    return built


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A venv without attnbook that sees this environment's other packages
    (numpy, torch, ipykernel).

    The packages come in through a .pth line naming our site-packages; .pth
    files *inside* that folder (such as attnbook's editable install) are not
    processed for a folder added that way, so attnbook stays invisible.
    """
    env_dir = tmp_path_factory.mktemp("bare") / "venv"
    # pip too comes from our environment
    run(sys.executable, "-m", "venv", "--without-pip", env_dir)
    python = env_dir / "bin" / "python"
    purelib = run(
        python,
        "-c",
        "import sysconfig; print(sysconfig.get_paths()['purelib'])",
    ).stdout.strip()
    Path(purelib, "book_dependencies.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    return python


def test_copied_chapter_installs_attnbook_and_runs(
    wheel, bare_python, tmp_path
):
    probe = subprocess.run(
        [str(bare_python), "-c", "import attnbook"], capture_output=True
    )
    assert probe.returncode != 0, (
        "the bare environment must start without attnbook"
    )

    notebook = tmp_path / CHAPTER.name
    shutil.copy(CHAPTER, notebook)
    script = textwrap.dedent(f"""
        import nbformat
        from nbclient import NotebookClient
        nb = nbformat.read({str(notebook)!r}, as_version=4)
        NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=False,
                       resources={{"metadata": {{"path": {str(tmp_path)!r}}}}}).execute()
        print("executed", len(nb.cells), "cells")
    """)
    env = {
        **os.environ,
        "ATTNBOOK_SOURCE": str(wheel),
        "PYTHONNOUSERSITE": "1",
        "MPLBACKEND": "Agg",
        "PIP_NO_INDEX": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    env.pop("PYTHONPATH", None)
    run(bare_python, "-c", script, cwd=tmp_path, env=env, timeout=600)

    located = run(
        bare_python, "-c", "import attnbook; print(attnbook.__file__)"
    ).stdout
    assert str(bare_python.parents[1]) in located, (
        f"attnbook was not installed into the bare venv: {located}"
    )


# --- the same setup cells in the browser (JupyterLite's Pyodide kernel) ------

NOTEBOOKS = sorted((ROOT / "book").glob("[0-9][0-9]-*.ipynb"))


def setup_cell(path: Path) -> str:
    import json

    cell = next(
        c
        for c in json.loads(path.read_text())["cells"]
        if c["cell_type"] == "code"
    )
    return "".join(cell["source"])


def install_block(source: str) -> str:
    """The setup cell's first statement that installs attnbook: `if
    importlib.util.find_spec(...) is None:` and its indented body."""
    lines = source.splitlines()
    start = next(
        i
        for i, line in enumerate(lines)
        if line.startswith('if importlib.util.find_spec("attnbook")')
    )
    end = next(
        (
            i
            for i in range(start + 1, len(lines))
            if lines[i] and not lines[i][0].isspace()
        ),
        len(lines),
    )
    return "\n".join(lines[start:end])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_setup_cell_installs_with_piplite_in_the_browser(path, monkeypatch):
    """Under Emscripten (sys.platform == "emscripten") the cell runs no process
    (Pyodide has none) and installs the wheel that the book's site serves with
    piplite, without dependencies (torch has no build there; numpy and
    matplotlib come with Pyodide). tests/test_lite.py runs the real thing in
    Pyodide."""
    import importlib.util

    from IPython.core.inputtransformer2 import TransformerManager

    # as IPython runs it
    block = TransformerManager().transform_cell(
        install_block(setup_cell(path))
    )
    magics = []

    class Shell:
        def run_line_magic(self, name, line):
            magics.append((name, line))

    def no_processes(*args, **kwargs):
        raise OSError("emscripten does not support processes")

    monkeypatch.setattr(sys, "platform", "emscripten")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            None if name == "attnbook" else real_find_spec(name, *a)
        ),
    )
    monkeypatch.setattr(subprocess, "run", no_processes)
    exec(
        block,
        {
            "importlib": importlib,
            "os": os,
            "subprocess": subprocess,
            "sys": sys,
            "get_ipython": Shell,
        },
    )
    # JupyterLite's Pyodide kernel runs %pip with piplite: `await
    # piplite.install(["attnbook"], deps=False)`
    assert magics == [("pip", "install --no-deps attnbook")]


# --- what a setup cell says --------------------------------------------------


def _is_install(node: ast.AST) -> bool:
    """A statement that installs: `subprocess.run([... "pip", "install" ...])`
    or `%pip install ...`."""
    text = ast.unparse(node)
    return isinstance(node, ast.Expr) and (
        "'install'" in text or "'pip', 'install" in text
    )


def _is_print(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "print"
    )


def _bodies(tree: ast.AST):
    for node in ast.walk(tree):
        for field in ("body", "orelse"):
            statements = getattr(node, field, None)
            if isinstance(statements, list):
                yield statements


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_setup_cell_says_what_it_installs(path):
    """Each install is announced by a print just before it, each `if` that may
    install says "nothing to install" in its `else`, and the committed output
    (of a machine that has everything) shows those lines."""
    from IPython.core.inputtransformer2 import TransformerManager

    tree = ast.parse(TransformerManager().transform_cell(setup_cell(path)))
    installs = 0
    for body in _bodies(tree):
        for i, statement in enumerate(body):
            if _is_install(statement):
                installs += 1
                assert i > 0 and _is_print(body[i - 1]), (
                    f"{path.name}: `{ast.unparse(statement)}` is not "
                    "announced by a print just before it"
                )
    # the tests that decide whether to install (`find_spec(...) is None`,
    # `missing_requirements()`)
    guards = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and (
            "find_spec" in ast.unparse(node.test)
            or "missing_requirements" in ast.unparse(node.test)
        )
        and any(_is_install(inner) for inner in ast.walk(node))
    ]
    assert installs and guards, (
        f"{path.name}: no install found in the setup cell"
    )
    for guard in guards:
        says = ast.unparse(guard.orelse[0]) if guard.orelse else ""
        assert _is_print(guard.orelse[0]) and "nothing to install" in says, (
            f"{path.name}: `if {ast.unparse(guard.test)}:` says nothing when "
            "there is nothing to install"
        )

    cell = next(
        c
        for c in json.loads(path.read_text())["cells"]
        if c["cell_type"] == "code"
    )
    printed = "".join("".join(o.get("text", "")) for o in cell["outputs"])
    assert printed.count("nothing to install") == len(guards), (
        f"{path.name}: the committed setup output should say 'nothing to "
        f"install' {len(guards)} times: {printed!r}"
    )
