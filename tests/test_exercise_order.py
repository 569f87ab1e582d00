"""No chapter shows the answer to an exercise before the exercise.

``attnbook.exercises.ANSWERS`` names, for each checker, the package functions
whose source would answer its exercise, or all of it but the last step (the
log-softmax for the softmax). A chapter that shows one of them with
``attnbook.show_source`` before the exercise that asks for it gives the answer
away; the solutions, after the exercise, may show it.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

import attnbook.exercises as exercises

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "book").glob("[0-9][0-9]-*.ipynb"))


def resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_checker_names_the_functions_that_answer_it():
    checkers = {n for n in exercises.__all__ if n.startswith("check_")}
    assert set(exercises.ANSWERS) == checkers
    for checker, answers in exercises.ANSWERS.items():
        for dotted in answers:
            assert callable(resolve(dotted)), (checker, dotted)


def shown_names(source: str) -> list[str]:
    """The last name of each expression passed to show_source in a cell."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython magics
        return re.findall(r"show_source\((?:[\w.]*\.)?(\w+)\)", source)
    names = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            == "show_source"
            and node.args
        ):
            arg = node.args[0]
            names.append(
                arg.attr if isinstance(arg, ast.Attribute) else arg.id
            )
    return names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_no_answer_is_shown_before_its_exercise(path):
    cells = [
        "".join(c["source"]) if c["cell_type"] == "code" else ""
        for c in json.loads(path.read_text())["cells"]
    ]
    shown = [
        (index, name)
        for index, source in enumerate(cells)
        for name in shown_names(source)
    ]
    given_away = []
    for checker, answers in exercises.ANSWERS.items():
        asked = [i for i, s in enumerate(cells) if f"{checker}(" in s]
        if not asked:
            continue
        names = {resolve(dotted).__name__ for dotted in answers}
        given_away += [
            f"cell {index} shows {name}, the answer to {checker} "
            f"(cell {asked[0]})"
            for index, name in shown
            if name in names and index < asked[0]
        ]
    assert not given_away, "\n".join(given_away)


# Sources that are not the answer's function but would give most of an
# exercise away, named by their qualified name as a chapter writes it in
# show_source (a method's bare name, such as ``update``, is shared by every
# cache class). ANSWERS lists no function for the ring step, whose exercise
# works on a ring passed in, in numpy; RollingKVCache.update is the same
# algorithm in torch (issue 31, student report 0708).
NEAR_ANSWERS = {
    "check_ring_decode_step": ("RollingKVCache.update",),
    # chapter 7's other masks hold the causal comparison j <= i that is the
    # whole exercise; the chapter poses it before their listings (issue 31,
    # student report 0708)
    "check_causal_mask": (
        "sliding_window_mask",
        "packed_causal_mask",
        "prefix_lm_mask",
    ),
    # chapter 14's window with sinks holds the window's two conditions, and
    # the merge of split softmax states is most of chapter 15's block-by-block
    # decoding step (issue 31, student report 1314)
    "check_packed_sliding_mask_mod": ("flex.sink_window",),
    "check_paged_decode": ("merge_splits",),
    # merge_splits is the merge kernel's computation in PyTorch, the guard of
    # the row that no run saw included: chapter 10 shows it in the
    # exercise's solution (issue 31, student report 10)
    "check_merge_kernel": ("merge_splits",),
    # the forward kernel's key_range computes the bound end that the
    # key-block count rounds up: chapter 10 shows it in the exercise's
    # solution (issue 31, student report stud10c)
    "check_key_blocks": ("key_range.fn",),
    # MultiHeadAttention.forward is the exercise's projection, split, attend,
    # merge and output projection in torch: chapter 5 shows it in the
    # exercise's solution (issue 31, student report 0506)
    "check_multihead_attention": ("MultiHeadAttention.forward",),
    # broadcasting the queries' group axis against the keys is the no-copy
    # decoding step in numpy but for the lengths' mask: chapter 12 describes
    # it in words and does not show its code (issue 31, student report 1112)
    "check_grouped_decode_step": ("broadcast_gqa",),
    # chapter 6's clipping probe rotates the queries at the end of the keys
    # and takes their scores: the part of the RoPE exercise it calls new
    # (issue 31, student report stud06)
    "check_rope_attention": ("clipped_offset_bias",),
    # chapter 3's recall model computes the exercise's two-dimensional case
    # in its score_table, (q @ k.T) / score_divisor: chapter 3 lists it with
    # the exercise's solution (issue 31, student report stud0304)
    "check_scaled_scores": ("recall.RecallAttention",),
    # stable_shift subtracts only a finite maximum: the one non-obvious part
    # of the stable softmax (a fully masked row); chapter 4 shows it, and the
    # box on rows of -inf, +inf and NaN describes it, after the exercise's
    # solution (issue 31, student report stud0304)
    "check_softmax": ("stable_shift",),
}


def shown_expressions(source: str) -> list[str]:
    """The expression passed to show_source in a cell, as written."""
    return [
        expression.replace(" ", "")
        for expression in re.findall(r"show_source\(\s*([\w.]+)\s*\)", source)
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_no_near_answer_is_shown_before_its_exercise(path):
    cells = [
        "".join(c["source"]) if c["cell_type"] == "code" else ""
        for c in json.loads(path.read_text())["cells"]
    ]
    given_away = []
    for checker, qualified in NEAR_ANSWERS.items():
        asked = [i for i, s in enumerate(cells) if f"{checker}(" in s]
        if not asked:
            continue
        given_away += [
            f"cell {index} shows {expression}, most of the answer to "
            f"{checker} (cell {asked[0]})"
            for index, source in enumerate(cells[: asked[0]])
            for expression in shown_expressions(source)
            if any(
                expression == name or expression.endswith("." + name)
                for name in qualified
            )
        ]
    assert not given_away, "\n".join(given_away)
