"""The layers of the package and what each may import (CONTRIBUTING.md, "Where
things go").

``LAYERS`` is the table: every module of ``attnbook`` belongs to the first row
whose patterns match its path (relative to ``code/attnbook/``), and may import
only what its row allows. The rules it holds:
- the numpy modules (the numpy chapters, and the browser, where there is no
  PyTorch) import no torch when they are imported: not directly, and not
  through a torch module of the package;
- only the kernels import Triton;
- the library never imports the exercises or the experiments.
An import inside a function runs when the function is called, not when the
module is imported: the table says which layers a module may import only there
("lazily").

No notebook is executed here; the imports are read from the sources, and one
test imports the numpy modules in a fresh Python to see that torch stays out.
"""

import ast
import fnmatch
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "code" / "attnbook"
MODULES = sorted(PACKAGE.rglob("*.py"))

# The torch modules of the library: they import torch when they are imported
# (model_shapes.py through kv_cache.kv_cache_bytes). flop_counter.py is main's,
# merged after this table was written.
TORCH_MODULES = [
    "decoding.py",
    "delta/chunkwise.py",
    "delta/inputs.py",
    "delta/layer.py",
    "delta/recurrent.py",
    "distributed/launch.py",
    "distributed/ring.py",
    "distributed/ulysses.py",
    "encoder.py",
    "flop_counter.py",
    "gpt.py",
    "gqa.py",
    "heads.py",
    "kv_cache.py",
    "latent/latent_cache.py",
    "latent/mla.py",
    "latent/shared_attention.py",
    "minilm.py",
    "model_shapes.py",
    "multihead.py",
    "quantized_cache.py",
    "serving/engine.py",
    "serving/paged_cache.py",
    "sparse/flex.py",
    "sparse/indexer.py",
    "sparse/sinks.py",
    "torch_attention.py",
]

# (layer, path patterns): a module belongs to the first row that matches it.
LAYERS = [
    # the GPU code; kernel_time.py is the name chapter 9 imports the kernels'
    # time model by (an alias)
    ("kernels", ["kernels/*", "kernel_time.py"]),
    ("exercises", ["exercises/*"]),
    ("experiments", ["experiments/*"]),
    ("torch library", TORCH_MODULES),
    ("numpy library", ["*"]),  # every other module
]
LIBRARY = ("numpy library", "torch library", "kernels")

# layer: (layers of attnbook it may import when it is imported, layers it may
# import inside a function)
MAY_IMPORT = {
    "numpy library": (["numpy library"], ["torch library", "kernels"]),
    "torch library": (["numpy library", "torch library"], ["kernels"]),
    "kernels": (LIBRARY, LIBRARY),
    "exercises": (LIBRARY + ("exercises",), LIBRARY + ("exercises",)),
    "experiments": (LIBRARY + ("experiments",), LIBRARY + ("experiments",)),
}
# third-party packages only some layers may import: package: {layer: where
# ("anywhere" or "lazily")}
RESTRICTED = {
    "torch": {
        "numpy library": "lazily",
        "torch library": "anywhere",
        "kernels": "anywhere",
        "exercises": "anywhere",
        "experiments": "anywhere",
    },
    # the experiments benchmark the kernels on a GPU and name Triton's version
    # chapter 10's kernel exercise checks the reader's loads and stores
    # under Triton's interpreter (exercises/flash_decoding.py)
    "triton": {
        "kernels": "anywhere",
        "experiments": "anywhere",
        "exercises": "lazily",
    },
}


def layer_of(rel: str) -> str:
    for layer, patterns in LAYERS:
        if any(fnmatch.fnmatch(rel, pattern) for pattern in patterns):
            return layer
    raise AssertionError(f"{rel} is in no layer")


def module_file(name: str) -> str | None:
    """``attnbook.x.y`` as a path relative to code/attnbook (``x/y.py`` or
    ``x/y/__init__.py``)."""
    parts = name.split(".")[1:]
    for candidate in (
        Path(*parts).with_suffix(".py") if parts else None,
        Path(*parts, "__init__.py"),
    ):
        if candidate is not None and (PACKAGE / candidate).exists():
            return candidate.as_posix()
    return None


def imports(source: str, module: str):
    """``(module imported, on import: bool, line)`` for every import statement
    of a module's source.

    ``module`` is the dotted name of the module (``attnbook.exercises.gqa``),
    which resolves relative imports. ``from package import name`` yields the
    submodule ``package.name`` where there is one. An import inside a function
    (or lambda) runs only when it is called: ``on import`` is False. One under
    ``if TYPE_CHECKING:`` never runs (it serves annotations): it is not listed.
    """
    # the package a relative import starts from
    package = module.rsplit(".", 1)[0]
    found = []

    def visit(node, on_import):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(
                child.test
            ):
                child = ast.Module(body=child.orelse, type_ignores=[])
            here = on_import and not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            if isinstance(child, ast.Import):
                found.extend(
                    (alias.name, here, child.lineno) for alias in child.names
                )
            elif isinstance(child, ast.ImportFrom):
                base = (
                    package.rsplit(".", child.level - 1)[0]
                    if child.level
                    else ""
                )
                target = ".".join(filter(None, [base, child.module or ""]))
                for alias in child.names:
                    sub = f"{target}.{alias.name}"
                    found.append(
                        (
                            sub
                            if target.startswith("attnbook")
                            and module_file(sub)
                            else target,
                            here,
                            child.lineno,
                        )
                    )
            visit(child, here)

    visit(ast.parse(source), True)
    return found


def dotted(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def offences(rel: str, source: str) -> list[str]:
    """What a module at ``rel`` (relative to code/attnbook) imports that its
    layer may not."""
    layer = layer_of(rel)
    eager, lazy = MAY_IMPORT[layer]
    found = []
    for name, on_import, line in imports(source, dotted(PACKAGE / rel)):
        where = "when imported" if on_import else "inside a function"
        top = name.split(".")[0]
        if top == "attnbook":
            target = module_file(name)
            if target is None:
                continue
            other = layer_of(target)
            if other not in (
                eager if on_import else tuple(eager) + tuple(lazy)
            ):
                found.append(
                    f"{rel}:{line} ({layer}) imports {name} ({other}) {where}"
                )
        elif top in RESTRICTED:
            allowed = RESTRICTED[top].get(layer)
            if allowed is None or (allowed == "lazily" and on_import):
                found.append(f"{rel}:{line} ({layer}) imports {top} {where}")
    return found


def test_every_module_imports_only_what_its_layer_may():
    found = [
        o
        for p in MODULES
        for o in offences(p.relative_to(PACKAGE).as_posix(), p.read_text())
    ]
    assert not found, (
        "imports that break the layering (the table LAYERS / MAY_IMPORT / "
        "RESTRICTED in "
        "tests/test_layering.py, and CONTRIBUTING.md):\n  "
        + "\n  ".join(found)
    )


@pytest.mark.parametrize(
    "rel, source, expected",
    [
        # browser.py as it was: the library importing the exercises (for
        # NotAttemptedError)
        (
            "browser.py",
            "from .exercises._framework import NotAttemptedError\n",
            "imports attnbook.exercises._framework",
        ),
        (
            "masks.py",
            "from attnbook import experiments\n",
            "imports attnbook.experiments",
        ),
        ("softmax.py", "import torch\n", "imports torch when imported"),
        (
            "softmax.py",
            "try:\n    import torch.nn as nn\nexcept ImportError:\n    pass\n",
            "imports torch when imported",
        ),
        # a numpy module importing a torch module of the package loads torch
        # too
        (
            "attention.py",
            "from .multihead import MultiHeadAttention\n",
            "imports attnbook.multihead (torch library)",
        ),
        (
            "masks.py",
            "from . import torch_attention\n",
            "imports attnbook.torch_attention (torch library)",
        ),
        (
            "gpt.py",
            "def f():\n    import triton\n",
            "imports triton inside a function",
        ),
        (
            "experiments/leak.py",
            "from ..exercises import check_attention\n",
            "imports attnbook.exercises",
        ),
    ],
)
def test_the_table_catches_each_kind_of_offence(rel, source, expected):
    found = offences(rel, source)
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize(
    "rel, source",
    [
        # torch inside a function
        ("positional.py", "def rope(x):\n    import torch\n"),
        ("kernel_time.py", "from .kernels import time_model\n"),
        (
            "kernels/launch.py",
            "import triton\nimport torch\nfrom ..torch_attention import "
            "attend\n",
        ),
        (
            "kernels/interpreter.py",
            "try:\n    import triton\nexcept ImportError:\n    raise\n",
        ),
        (
            "exercises/gqa.py",
            "import torch\nfrom .. import gqa\nfrom ._framework import Case\n",
        ),
        ("browser.py", "from .verdicts import NotAttemptedError\n"),
        (
            "cache_protocol.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import "
            "torch\n",
        ),
    ],
)
def test_the_table_allows_what_each_layer_may_import(rel, source):
    assert offences(rel, source) == []


def test_the_numpy_modules_load_without_torch():
    """Importing every numpy module of the library (as the browser chapters do)
    leaves torch unloaded."""
    names = [
        dotted(p)
        for p in MODULES
        if layer_of(p.relative_to(PACKAGE).as_posix()) == "numpy library"
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n    importlib.import_module(name)\n"
        "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PYTHONPATH=str(PACKAGE.parent)),
    ).stdout.strip()
    assert out == "[]", f"importing the numpy modules loaded {out}"
