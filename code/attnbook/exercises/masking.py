"""Checkers for the masking chapter (chapter 7): the padding mask of a batch.

The causal-mask checker, :func:`attnbook.exercises.check_causal_mask`, lives in
``exercises/attention.py``.
"""

from __future__ import annotations

import numpy as np

from ..padding import key_padding_mask
from ._framework import (
    FLOAT_MASK_DESCRIPTION,
    FLOAT_MASK_HINT,
    Case,
    Mistake,
    describe_mask,
    run_checks,
    same_mask,
)


def _grid(lengths, n):
    """Query index i (1, n, 1), key index j (1, 1, n) and lengths L (batch, 1,
    1)."""
    i, j = np.arange(n)[None, :, None], np.arange(n)[None, None, :]
    return i, j, np.asarray(lengths)[:, None, None]


def _full(mask, lengths, n):
    return np.broadcast_to(mask, (len(lengths), n, n)).copy()


def _reference(lengths, n):
    return _full(key_padding_mask(lengths, n), lengths, n)


def _commit(rule):
    def mistake(lengths, n):
        i, j, L = _grid(lengths, n)
        return _full(rule(i, j, L, n), lengths, n)

    return mistake


PADDING_MISTAKES = [
    Mistake(
        "queries_masked",
        "the mask hides padding *queries* (rows) instead of padding *keys* "
        "(columns)",
        "entry [b, i, j] decides whether query i may look at key j: it "
        "depends on whether key j is a "
        "real token, j < lengths[b], not on i",
        _commit(lambda i, j, L, n: i < L),
    ),
    Mistake(
        "inverted",
        "True marks the padding; the book's convention is True = may attend",
        "negate your mask: real keys (j < lengths[b]) must be True",
        _commit(lambda i, j, L, n: j >= L),
    ),
    Mistake(
        "pad_visible",
        "off by one: the first padding key is still visible (j <= length)",
        "sequence b has real tokens at positions 0 .. lengths[b] - 1, so use "
        "j < lengths[b]",
        _commit(lambda i, j, L, n: j <= L),
    ),
    Mistake(
        "last_token_hidden",
        "off by one: the last real token is hidden (j < length - 1)",
        "sequence b has real tokens at positions 0 .. lengths[b] - 1, so use "
        "j < lengths[b]",
        _commit(lambda i, j, L, n: j < L - 1),
    ),
    Mistake(
        "queries_and_keys",
        "padding queries are masked too, so their rows are fully masked",
        "mask only the keys: a padding query may attend to the real keys (its "
        "output is ignored), "
        "and a fully masked row gives NaN in many implementations",
        _commit(lambda i, j, L, n: (i < L) & (j < L)),
    ),
    Mistake(
        "key_mask_2d",
        "the mask has shape (batch, n), one entry per key, without the query "
        "axis: it "
        "does not broadcast to (batch, n_q, n_k), or broadcasts along the "
        "wrong axes",
        "add the query axis: real[:, None, :] has shape (batch, 1, n) and "
        "broadcasts over the queries",
        lambda lengths, n: _broadcast_or_raw(
            np.arange(n)[None, :] < np.asarray(lengths)[:, None], lengths, n
        ),
    ),
    Mistake(
        "causal_too",
        "the mask is causal as well as key-padding (j <= i and j < "
        "lengths[b]): this exercise "
        "asks for the padding mask alone",
        "combine the two where a decoder needs both (causal_mask(n) & "
        "padding_mask); here return only "
        "j < lengths[b], for every query i",
        _commit(lambda i, j, L, n: (j <= i) & (j < L)),
    ),
    Mistake(
        "one_length",
        "every sequence got the same length (the first one's): the mask "
        "ignores "
        "lengths[b] for the other sequences",
        "compare the key index with each sequence's own length: lengths[:, "
        "None, None] broadcasts over b",
        _commit(lambda i, j, L, n: j < L.flat[0]),
    ),
    Mistake(
        "head_axis",
        "the mask has the head axis, shape (batch, 1, 1, n): the layout that "
        "broadcasts over "
        "(batch, heads, n_q, n_k) scores, but this exercise has no head axis",
        "return (batch, n, n) or (batch, 1, n): drop the head axis (mask[:, "
        "0]); add it back, "
        "mask[:, None], where the mask meets scores with a head axis",
        lambda lengths, n: (
            np.arange(n)[None, :] < np.asarray(lengths)[:, None]
        )[:, None, None, :],
    ),
    Mistake(
        "float_mask",
        FLOAT_MASK_DESCRIPTION,
        FLOAT_MASK_HINT,
        lambda lengths, n: _reference(lengths, n).astype(np.float64),
    ),
    Mistake(
        "left_padding",
        "the padding is assumed at the start of each sequence (left padding)",
        "in this exercise the real tokens come first: positions 0 .. "
        "lengths[b] - 1",
        _commit(lambda i, j, L, n: j >= n - L),
    ),
]


def padding_mask_cases() -> list[Case]:
    return [
        Case("lengths [3, 5, 1], n = 5", (np.array([3, 5, 1]), 5)),
        Case(
            "lengths [2, 4], n = 6 (every sequence padded)",
            (np.array([2, 4]), 6),
        ),
        Case("lengths [4], n = 4 (no padding)", (np.array([4]), 4)),
        Case("lengths [1, 1, 2, 7], n = 7", (np.array([1, 1, 2, 7]), 7)),
    ]


def _broadcast_or_raw(out, lengths, n):
    """``out`` broadcast to (batch, n, n) where it can be, else as it is (what
    the checker compares)."""
    try:
        return _full(out, lengths, n)
    except ValueError:
        return out


def _as_full_bool(fn):
    """Accept any mask that broadcasts to (batch, n, n), and 0/1 integers for
    booleans (not floats)."""

    def wrapped(lengths, n):
        out = fn(np.array(lengths), n)
        if hasattr(out, "detach"):  # a torch tensor
            out = out.detach().cpu().numpy()
        out = np.asarray(out)
        if out.dtype.kind in "iu" and out.size and np.isin(out, (0, 1)).all():
            # 0/1 integers; a float mask stays float (same_mask rejects it)
            out = out.astype(bool)
        try:
            return _full(out, lengths, n)
        except ValueError:
            # a shape that does not broadcast: reported as a shape error
            return out

    return wrapped


def check_padding_mask(fn) -> None:
    """Check ``fn(lengths, n)`` returns the self-attention mask of a
    right-padded batch.

    lengths: int array (batch,); n: the padded length. The answer is bool
    (batch, n, n), or anything that broadcasts to it (e.g. (batch, 1, n)), with
    entry [b, i, j] True exactly when key j is a real token of sequence b (``j
    < lengths[b]``). 0/1 integers are accepted as booleans, a float mask of 1.0
    and 0.0 is not: PyTorch's ``scaled_dot_product_attention`` would add it to
    the scores instead of masking them.
    """
    run_checks(
        "padding mask",
        _as_full_bool(fn),
        padding_mask_cases(),
        _reference,
        PADDING_MISTAKES,
        compare=same_mask,
        describe=describe_mask,
    )
