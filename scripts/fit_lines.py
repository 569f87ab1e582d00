"""Fit prose and strings into the book's line length, where the formatter
cannot.

`ruff format` breaks code at the line length, but it leaves three things as
they are: docstrings, comments and string literals. This script rewraps those,
so that every line of the package, the tests, the scripts and the notebooks'
code cells fits the book's code column (pyproject.toml, `[tool.ruff]
line-length`; tests/test_book.py checks the column in a browser):

- a docstring paragraph or a block of comment lines with a line too long is
  reflowed, keeping its indentation; list items (``- ``, ``1. ``, ``name: ``)
  start new paragraphs, and lines indented deeper than their paragraph (code,
  tables) are left alone;
- a comment after code that makes its line too long moves to its own line
  above;
- a string literal that runs past the limit inside brackets is split at spaces
  into adjacent literals (Python joins them), never inside an f-string's
  ``{...}``.

Usage: python scripts/fit_lines.py FILE_OR_FOLDER... (.py and .ipynb). Run
`ruff format` before and after it (`make format` does all three).
"""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

# a list item: its continuation lines hang under its text
BULLET = re.compile(r"^(?:[-*+] |\d+[.)] )")
# a field ("q: (..., n_q, d_k) ...", "Returns: ..."): starts a paragraph,
# continued at its indentation
FIELD = re.compile(r"^[A-Za-z_][\w.]*(?:\[[^\]]*\])?(?: \([^)]*\))?: ")
# doctest lines and table rows are kept as they are
VERBATIM = re.compile(r"^(?:>>>|\.\.\. |\|)")
PREFIX = re.compile(r"^([rRbBuUfF]{0,2})('''|\"\"\"|'|\")")


def line_length() -> int:
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    return int(re.search(r"(?m)^line-length\s*=\s*(\d+)", text).group(1))


def reflow(lines: list[str], width: int, marker: str = "") -> list[str]:
    """Rewrap the paragraphs of `lines` (each ``indent + marker + text``) that
    hold a line over `width`.

    A paragraph is a run of lines at the block's base indentation, or a list
    item with its continuation lines; a blank line, a new item, or a line
    indented deeper (code, a table) ends it, and deeper lines are kept as they
    are.
    """
    pattern = re.compile(
        r"^(\s*" + re.escape(marker) + r":?\s*)(.*)$"
        if marker
        else r"^(\s*)(.*)$"
    )
    parsed = [pattern.match(line) for line in lines]
    leads = [len(m.group(1)) for m in parsed if m and m.group(2).strip()]
    base = min(leads) if leads else 0
    out: list[str] = []
    para: list[tuple[str, str]] = []  # (indent + marker, text)
    hang = [0]  # the lead of an item's continuation lines

    def flush():
        if not para:
            return
        lead = para[0][0]
        if any(len(p + t) > width for p, t in para):
            words = " ".join(t.strip() for _, t in para)
            rest = lead + " " * (hang[0] - len(lead)) if hang[0] else lead
            out.extend(
                x.rstrip()
                for x in textwrap.wrap(
                    words,
                    width,
                    initial_indent=lead,
                    subsequent_indent=rest,
                    break_long_words=False,
                    break_on_hyphens=False,
                )
            )
        else:
            out.extend((p + t).rstrip() for p, t in para)
        para.clear()
        hang[0] = 0

    in_fence = False
    for line, m in zip(lines, parsed):
        text = m.group(2) if m else ""
        lead = m.group(1) if m else ""
        if text.startswith("```"):
            in_fence = not in_fence
            flush()
            out.append(line.rstrip())
            continue
        if (
            m is None
            or in_fence
            or not text.strip()
            or re.match(r"^[=~^-]{3,}\s*$", text)
        ):
            flush()
            out.append(line.rstrip())
            continue
        if VERBATIM.match(text):
            flush()
            out.append(line.rstrip())
            continue
        item = BULLET.match(text)
        if len(lead) == base:
            if item or FIELD.match(text) or (para and hang[0]):
                flush()
            para.append((lead, text))
            if item:
                hang[0] = len(lead) + len(item.group(0))
        elif para and hang[0] and len(lead) == hang[0]:
            para.append((lead, text))  # an item's continuation
        else:
            flush()
            out.append(line.rstrip())  # deeper: code or a table, kept
    flush()
    return out


def fit_docstrings(src: str, width: int) -> str:
    tree = ast.parse(src)
    lines = src.split("\n")
    spans = []
    for node in ast.walk(tree):
        if isinstance(
            node,
            (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef),
        ):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                spans.append(
                    (
                        body[0].lineno - 1,
                        body[0].end_lineno - 1,
                        body[0].col_offset,
                    )
                )
    for start, end, col in sorted(spans, reverse=True):
        block = lines[start : end + 1]
        if all(len(x) <= width for x in block):
            continue
        indent = " " * col
        first = block[0]
        m = re.match(r"^(\s*[rRuU]?\"\"\")(.*)$", first)
        if not m:
            continue
        opener, rest = m.groups()
        closing_alone = block[-1].strip() == '"""' and len(block) > 1
        body = block[1:-1] if closing_alone else block[1:]
        text_lines = [indent + rest] + body
        tail = '"""'
        if not closing_alone:
            # the closing quotes end the last line: reflow it with their
            # room kept free
            last = text_lines[-1]
            assert last.rstrip().endswith('"""'), (start, last)
            text_lines[-1] = last.rstrip()[:-3] + "\0" * 3
        # the first paragraph's first line carries the opening quotes: reflow
        # it 3 narrower
        wrapped = reflow_first(text_lines, width, len(opener) - len(indent))
        wrapped = [x.replace("\0", "") for x in wrapped]
        wrapped[0] = opener + wrapped[0][len(indent) :]
        if closing_alone:
            wrapped.append(indent + tail)
        elif len(wrapped[-1]) + 3 <= width:
            wrapped[-1] += tail
        else:
            wrapped.append(indent + tail)
        lines[start : end + 1] = wrapped
    return "\n".join(lines)


def reflow_first(text_lines, width, extra):
    """reflow() where the very first line has `extra` characters less room (the
    opening quotes)."""
    pad = "\0" * extra
    text_lines = [
        text_lines[0][: len(text_lines[0]) - len(text_lines[0].lstrip())]
        + pad
        + text_lines[0].lstrip()
    ] + text_lines[1:]
    return reflow(text_lines, width)


def move_inline_comments(src: str, width: int) -> str:
    """A comment after code, on a line over `width`, moves to its own line
    above the code."""
    lines = src.split("\n")
    moves = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        row, col = tok.start
        if (
            tok.type == tokenize.COMMENT
            and lines[row - 1][:col].strip()
            and len(lines[row - 1]) > width
            and not tok.string.startswith(("# noqa", "# type:"))
        ):
            moves.append((row - 1, col))
    for row, col in sorted(moves, reverse=True):
        code = lines[row][:col].rstrip()
        indent = re.match(r"\s*", code).group(0)
        moved = (
            lines[:row] + [indent + lines[row][col:], code] + lines[row + 1 :]
        )
        # not possible after a backslash continuation: the comment then stays
        try:
            ast.parse("\n".join(moved))
        except SyntaxError:
            continue
        lines = moved
    return "\n".join(lines)


def rule(line: str, width: int) -> str:
    """A comment that ends in a rule (``# --- title -----``) is cut to the
    width, when what is cut is only the rule."""
    ruled = re.match(r"^\s*#.*?([-=~#*])\1{7,}\s*$", line.rstrip())
    if ruled and len(line) > width and not line[width - 3 :].strip("-=~#* "):
        return line[:width].rstrip()
    return line


def fit_comments(src: str, width: int) -> str:
    """Reflow each block of comment lines (same column, one after another) that
    has a long line."""
    lines = src.split("\n")
    full = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        row, col = tok.start
        if tok.type == tokenize.COMMENT and not lines[row - 1][:col].strip():
            full.add(row - 1)
    out, i = [], 0
    while i < len(lines):
        if i not in full:
            out.append(lines[i])
            i += 1
            continue
        j = i
        col = len(lines[i]) - len(lines[i].lstrip())
        while j in full and len(lines[j]) - len(lines[j].lstrip()) == col:
            j += 1
        block = [rule(x, width) for x in lines[i:j]]
        if any(len(x) > width for x in block) and not block[
            0
        ].lstrip().startswith("#!"):
            block = reflow(block, width, marker="#")
        out.extend(block)
        i = j
    return "\n".join(out)


def split_points(body: str, is_f: bool) -> list[int]:
    """Indices just after a space where a literal can be cut (outside f-string
    braces)."""
    points, depth, i = [], 0, 0
    while i < len(body):
        c = body[i]
        if (
            is_f
            and c in "{}"
            and body[i : i + 2] in ("{{", "}}")
            and depth == 0
        ):
            i += 2
            continue
        if is_f and c == "{":
            depth += 1
        elif is_f and c == "}":
            depth -= 1
        elif c == " " and depth == 0 and (i == 0 or body[i - 1] != "\\"):
            points.append(i + 1)
        i += 1
    return points


def piece(prefix: str, quote: str, body: str) -> str:
    if "f" in prefix.lower() and not re.search(
        r"(?<!\{)\{(?!\{)", body.replace("{{", "")
    ):
        prefix = prefix.replace("f", "").replace("F", "")
        body = body.replace("{{", "{").replace("}}", "}")
    return f"{prefix}{quote}{body}{quote}"


def fit_strings(src: str, width: int) -> str:
    lines = src.split("\n")
    tokens = list(tokenize.generate_tokens(io.StringIO(src).readline))
    depth, edits = 0, []
    for tok in tokens:
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        if tok.type != tokenize.STRING or tok.start[0] != tok.end[0]:
            continue
        rest = lines[tok.end[0] - 1][tok.end[1] :]
        if depth == 0 and not re.match(r"^\s*(#.*)?$", rest):
            # outside brackets, only a string that ends its line is wrapped
            continue
        row, col = tok.start
        line = lines[row - 1]
        if len(line) <= width:
            continue
        m = PREFIX.match(tok.string)
        prefix, quote = m.groups()
        if len(quote) == 3:
            continue
        body = tok.string[len(prefix) + 1 : -1]
        is_f = "f" in prefix.lower()
        after = line[tok.end[1] :]
        room = width - col - len(prefix) - 2
        pieces, startp = [], 0
        points = split_points(body, is_f) + [len(body)]
        while startp < len(body):
            last_room = room - len(after.rstrip())
            fits = [p for p in points if p > startp and p - startp <= room]
            end = (
                fits[-1]
                if fits
                else next((p for p in points if p > startp), len(body))
            )
            if end == len(body) and end - startp > last_room and len(fits) > 1:
                end = fits[-2]
            pieces.append(body[startp:end])
            startp = end
        if len(pieces) < 2:
            continue
        indent = " " * col
        if depth == 0:  # in parentheses, the pieces make one expression
            outer = " " * (len(line) - len(line.lstrip()))
            new = [line[:col] + "("]
            new += [outer + "    " + piece(prefix, quote, p) for p in pieces]
            new.append(outer + ")" + after)
        else:
            new = [line[:col] + piece(prefix, quote, pieces[0])]
            new += [indent + piece(prefix, quote, p) for p in pieces[1:]]
            new[-1] += after
        edits.append((row - 1, new))
    for row, new in sorted(edits, reverse=True):
        lines[row : row + 1] = new
    return "\n".join(lines)


MAGIC = re.compile(r"(?m)^(\s*)([%!].*)$")


def fit_source(src: str, width: int, steps, cell: bool = False) -> str:
    """Apply `steps` to one file or cell; an IPython magic line is masked as a
    call meanwhile."""
    magics = []

    def mask(m):
        magics.append(m.group(2))
        return f"{m.group(1)}__magic_{len(magics) - 1}__()"

    if cell:
        src = MAGIC.sub(mask, src)
    try:
        ast.parse(src)
    except SyntaxError:
        return unmask(src, magics)
    for step in steps:
        new = step(src, width)
        ast.parse(new)  # never hand back code that does not parse
        src = new
    return unmask(src, magics)


def unmask(src, magics):
    return re.sub(
        r"__magic_(\d+)__\(\)", lambda m: magics[int(m.group(1))], src
    )


def fit_file(path: Path, width: int, steps) -> bool:
    if path.suffix == ".ipynb":
        nb = json.loads(path.read_text())
        changed = False
        for cell in nb["cells"]:
            if cell["cell_type"] != "code":
                continue
            src = "".join(cell["source"])
            new = fit_source(src, width, steps, cell=True)
            if new != src:
                cell["source"] = new.splitlines(keepends=True)
                changed = True
        if changed:
            path.write_text(
                json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
            )
        return changed
    src = path.read_text()
    new = fit_source(src, width, steps)
    if new != src:
        path.write_text(new)
    return new != src


def ruff_format(paths: list[str]) -> None:
    ruff = Path(sys.executable).with_name("ruff")
    subprocess.run([str(ruff), "format", "--quiet", *paths], check=True)


def main(args: list[str]) -> None:
    width = line_length()
    files = []
    for arg in args:
        p = Path(arg)
        files += (
            sorted(p.rglob("*.py")) + sorted(p.rglob("*.ipynb"))
            if p.is_dir()
            else [p]
        )
    files = [
        f for f in files if not {".ipynb_checkpoints", "_build"} & set(f.parts)
    ]
    for f in files:
        fit_file(f, width, [move_inline_comments])
    ruff_format(args)
    for f in files:
        if fit_file(f, width, [fit_docstrings, fit_comments, fit_strings]):
            print(f"fitted {f}")
    ruff_format(args)


if __name__ == "__main__":
    main(sys.argv[1:])
