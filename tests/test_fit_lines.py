"""scripts/fit_lines.py: what the formatter leaves long is rewrapped, and the
code means what it meant (its syntax tree is unchanged)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location(
    "fit_lines", ROOT / "scripts" / "fit_lines.py"
)
fit_lines = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fit_lines)

WIDTH = 40
POST = [
    fit_lines.fit_docstrings,
    fit_lines.fit_comments,
    fit_lines.fit_strings,
]


def fit(src: str) -> str:
    src = fit_lines.fit_source(src, WIDTH, [fit_lines.move_inline_comments])
    return fit_lines.fit_source(src, WIDTH, POST)


def same_meaning(a: str, b: str) -> bool:
    """Equal syntax trees, docstrings compared word by word."""

    def norm(src):
        tree = ast.parse(src)
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (
                isinstance(body, list)
                and body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                body[0].value.value = " ".join(body[0].value.value.split())
        return ast.dump(tree)

    return norm(a) == norm(b)


def test_a_long_docstring_paragraph_is_reflowed_and_a_field_starts_a_new_one():
    src = (
        "def f(q):\n"
        '    """Attention of the queries against every key in the cache.\n'
        "\n"
        "    q: (..., n_q, d_k), the queries of this step, one per token\n"
        '    Returns (..., n_q, d_v)."""\n'
    )
    out = fit(src)
    assert same_meaning(src, out)
    assert all(len(line) <= WIDTH for line in out.splitlines()), out
    lines = out.splitlines()
    assert any(line.strip().startswith("q: (...") for line in lines)
    assert out.rstrip().endswith('"""')


def test_code_indented_in_a_docstring_is_kept_as_it_is():
    code = "        out = softmax(q @ k.T / sqrt(d)) @ v  # one long line"
    src = (
        "def f():\n"
        '    """A function whose docstring shows code, indented:\n'
        "\n"
        f"{code}\n"
        '    """\n'
    )
    assert code in fit(src).splitlines()


def test_a_comment_block_is_reflowed_and_a_list_item_hangs():
    src = (
        "# the reasons, which this comment lists at some length:\n"
        "# - the first reason, which is long enough to wrap here\n"
        "x = 1\n"
    )
    out = fit(src).splitlines()
    assert all(len(line) <= WIDTH for line in out), out
    item = next(i for i, line in enumerate(out) if line.startswith("# - "))
    assert out[item + 1].startswith("#   "), out


def test_an_inline_comment_on_a_long_line_moves_above_it():
    src = "total = first + second  # the sum of both halves\n"
    out = fit(src).splitlines()
    assert (
        out[0].startswith("# the sum") and out[-1] == "total = first + second"
    )


def test_a_long_string_is_split_at_spaces_never_inside_braces():
    src = (
        "print(\n"
        '    f"the value {value:.3f} was {what_it_was!r} at step {i}"\n'
        ")\n"
    )
    out = fit(src)
    assert same_meaning(src, out)
    pieces = [line.strip() for line in out.splitlines()[1:-1]]
    assert len(pieces) > 1
    for piece in pieces:  # every piece is a whole literal
        ast.parse(piece)


def test_a_string_ending_a_statement_is_wrapped_in_parentheses():
    src = 'message = "a sentence long enough to need two lines here"\n'
    out = fit(src)
    assert same_meaning(src, out)
    assert out.splitlines()[0] == "message = ("


@pytest.mark.parametrize(
    "src",
    [
        "x = 1\n%timeit f(x)\n",  # an IPython magic in a notebook cell
        "y = (1 +\n     2)  # a comment after a continued line\n",
    ],
)
def test_cells_with_magics_and_continued_lines_keep_their_meaning(src):
    out = fit_lines.fit_source(src, WIDTH, POST, cell=True)
    assert "%timeit f(x)" in out or out == src
