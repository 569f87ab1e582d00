"""Checkers for chapter 2: attention scores and cross-attention from token
vectors."""

from __future__ import annotations

import re

import numpy as np

from ..projections import single_head_attention
from ..softmax import softmax
from ._framework import (
    Case,
    ExerciseError,
    Mistake,
    NotAttemptedError,
    as_array,
    changed_inputs,
    difference,
    fresh,
    in_place_note,
    run_checks,
    same,
)


def _first(out):
    """Accept either the output alone or an ``(output, weights)`` pair."""
    return out[0] if isinstance(out, tuple) else out


def _t(a):
    return np.swapaxes(a, -1, -2)


# --- scores S = (x W_Q)(x W_K)^T -------------------------------------------


def _scores(x, w_q, w_k):
    return (x @ w_q) @ _t(x @ w_k)


SCORES_MISTAKES = [
    Mistake(
        "swapped_qk",
        "queries and keys are swapped: your matrix is S transposed",
        "row i must hold query i against every key: (x @ w_q) @ (x @ w_k).T, "
        "not (x @ w_k) @ (x @ w_q).T",
        lambda x, w_q, w_k: (x @ w_k) @ _t(x @ w_q),
    ),
    Mistake(
        "w_q_for_both",
        "w_q is used for the keys too, so your scores are symmetric",
        "the keys are x @ w_k; tying the two matrices makes S = S^T (see the "
        "chapter's theorem)",
        lambda x, w_q, w_k: (x @ w_q) @ _t(x @ w_q),
    ),
    Mistake(
        "w_k_for_both",
        "w_k is used for the queries too, so your scores are symmetric",
        "the queries are x @ w_q; tying the two matrices makes S = S^T (see "
        "the chapter's theorem)",
        lambda x, w_q, w_k: (x @ w_k) @ _t(x @ w_k),
    ),
    Mistake(
        "scaled",
        "your scores are already divided by sqrt(d_k)",
        "this exercise asks for the raw dot products q_i . k_j; the "
        "1/sqrt(d_k) comes later (chapter 3)",
        lambda x, w_q, w_k: _scores(x, w_q, w_k) / np.sqrt(w_q.shape[-1]),
    ),
    Mistake(
        "scaled_by_d_model",
        "your scores are divided by sqrt(d_model), the width of the tokens",
        "this exercise asks for the raw dot products; and when chapter 3 "
        "scales them, the factor is "
        "sqrt(d_k), the width of the queries and keys (w_q.shape[-1]), not of "
        "the tokens",
        lambda x, w_q, w_k: _scores(x, w_q, w_k) / np.sqrt(x.shape[-1]),
    ),
    Mistake(
        "transposed_weights",
        "the weight matrices are applied transposed (x @ w.T)",
        "the book's weights are (d_model, d_k) and project as x @ w; "
        "torch.nn.Linear stores the transpose",
        lambda x, w_q, w_k: (x @ _t(w_q)) @ _t(x @ _t(w_k)),
    ),
    Mistake(
        "features_contracted",
        "you contracted over the tokens (Q^T K, shape (d_k, d_k)) instead of "
        "the features",
        "S_ij = q_i . k_j sums over the d_k features of one query and one "
        "key: Q @ K.T is (n, n)",
        lambda x, w_q, w_k: _t(x @ w_q) @ (x @ w_k),
    ),
    Mistake(
        "softmax_applied",
        "you returned attention weights (softmax of the scores), not the "
        "scores",
        "stop before the softmax: the exercise asks for S itself",
        lambda x, w_q, w_k: softmax(_scores(x, w_q, w_k), axis=-1),
    ),
    Mistake(
        "softmax_over_queries",
        "you applied a softmax down the columns (over the queries, axis 0)",
        "stop before any softmax: the exercise asks for S itself (and "
        "attention's softmax runs along "
        "each row, over the keys, axis=-1)",
        lambda x, w_q, w_k: softmax(_scores(x, w_q, w_k), axis=-2),
    ),
    Mistake(
        "log_softmax",
        "you returned the log of the softmax of the scores (log-softmax), not "
        "the scores",
        "log-softmax subtracts each row's log-sum-exp from the scores; return "
        "S itself, before any softmax",
        lambda x, w_q, w_k: np.log(softmax(_scores(x, w_q, w_k), axis=-1)),
    ),
    Mistake(
        "row_max_subtracted",
        "each row has its maximum subtracted (the softmax's stabilising "
        "shift)",
        "that shift belongs inside a softmax, where it changes nothing; the "
        "scores themselves are unshifted",
        lambda x, w_q, w_k: (
            _scores(x, w_q, w_k)
            - _scores(x, w_q, w_k).max(axis=-1, keepdims=True)
        ),
    ),
    Mistake(
        "divided_by_d_k",
        "your scores are divided by d_k, not left raw",
        "this exercise asks for the raw dot products q_i . k_j; when chapter "
        "3 scales them, the factor "
        "is 1/sqrt(d_k), not 1/d_k",
        lambda x, w_q, w_k: _scores(x, w_q, w_k) / w_q.shape[-1],
    ),
    Mistake(
        "divided_by_d_model",
        "your scores are divided by d_model, the width of the tokens, not "
        "left raw",
        "this exercise asks for the raw dot products q_i . k_j; when chapter "
        "3 scales them, the factor is "
        "1/sqrt(d_k), with d_k the width of the queries and keys "
        "(w_q.shape[-1]), not of the tokens",
        lambda x, w_q, w_k: _scores(x, w_q, w_k) / x.shape[-1],
    ),
    Mistake(
        "divided_by_sqrt_n",
        "your scores are divided by sqrt(n), the square root of the number of "
        "tokens",
        "this exercise asks for the raw dot products; a scale, when there is "
        "one (chapter 3), depends on "
        "the width d_k of the queries and keys, not on how many tokens there "
        "are",
        lambda x, w_q, w_k: _scores(x, w_q, w_k) / np.sqrt(x.shape[-2]),
    ),
    Mistake(
        "symmetrised",
        "your scores are symmetrised, (S + S^T) / 2",
        "S_ij = q_i . k_j and S_ji = q_j . k_i differ: the scores of "
        "attention need not be symmetric",
        lambda x, w_q, w_k: (
            (_scores(x, w_q, w_k) + _t(_scores(x, w_q, w_k))) / 2
        ),
    ),
    Mistake(
        "diagonal_only",
        "only the diagonal is filled: each token's query against its own key",
        "S_ij pairs query i with key j for every i and j: (x @ w_q) @ (x @ "
        "w_k).T fills the whole (n, n) matrix",
        lambda x, w_q, w_k: np.eye(x.shape[-2]) * _scores(x, w_q, w_k),
    ),
    Mistake(
        "cosine_similarity",
        "you returned cosine similarities: the queries and keys are "
        "normalised to length 1",
        "the scores are plain dot products q_i . k_j; their lengths count too",
        lambda x, w_q, w_k: (
            _scores(x, w_q, w_k)
            / np.linalg.norm(x @ w_q, axis=-1)[..., :, None]
            / np.linalg.norm(x @ w_k, axis=-1)[..., None, :]
        ),
    ),
    Mistake(
        "float16",
        "your scores are rounded to float16 (half precision, about 3 "
        "significant digits)",
        "compute and return the scores in the precision of the inputs "
        "(float64 here)",
        lambda x, w_q, w_k: _scores(x, w_q, w_k).astype(np.float16),
    ),
    Mistake(
        "w_q_transposed",
        "w_q is applied transposed (x @ w_q.T); w_k is used the right way",
        "the book's weights are (d_model, d_k) and project as x @ w: the "
        "queries are x @ w_q",
        lambda x, w_q, w_k: (x @ _t(w_q)) @ _t(x @ w_k),
    ),
    Mistake(
        "w_k_transposed",
        "w_k is applied transposed (x @ w_k.T); w_q is used the right way",
        "the book's weights are (d_model, d_k) and project as x @ w: the keys "
        "are x @ w_k",
        lambda x, w_q, w_k: (x @ w_q) @ _t(x @ _t(w_k)),
    ),
]


def scores_cases() -> list[Case]:
    rng = np.random.default_rng(2)
    r = lambda *shape: rng.normal(size=shape)  # noqa: E731
    # The first case has square weights, so that every mistake runs and can be
    # recognised.
    return [
        Case("n = 4 tokens, d_model = d_k = 5", (r(4, 5), r(5, 5), r(5, 5))),
        Case(
            "n = 6 tokens, d_model = 8, d_k = 3", (r(6, 8), r(8, 3), r(8, 3))
        ),
        Case(
            "a single token (n = 1), d_model = 4, d_k = 2",
            (r(1, 4), r(4, 2), r(4, 2)),
        ),
        Case(
            "n = 3 tokens, d_model = 2, d_k = 6 (wider than the tokens)",
            (r(3, 2), r(2, 6), r(2, 6)),
        ),
    ]


def check_attention_scores(fn) -> None:
    """Check ``fn(x, w_q, w_k)`` returns the raw scores ``S = (x w_q)(x
    w_k)^T``, shape ``(n, n)``.

    x: (n, d_model); w_q, w_k: (d_model, d_k). No scaling, no softmax.
    """
    run_checks(
        "attention scores", fn, scores_cases(), _scores, SCORES_MISTAKES
    )


# --- cross-attention output --------------------------------------------------


def _cross(x, context, w_q, w_k, w_v):
    return single_head_attention(x, w_q, w_k, w_v, context=context)[0]


def _attend(q, k, v, scale=True, axis=-1):
    s = q @ _t(k)
    if scale:
        s = s / np.sqrt(q.shape[-1])
    return softmax(s, axis=axis) @ v


CROSS_MISTAKES = [
    Mistake(
        "swapped_sources",
        "the queries come from the context and the keys and values from x",
        "queries ask, so they come from x (the sequence being updated); keys "
        "and values come from the context",
        lambda x, c, w_q, w_k, w_v: _attend(c @ w_q, x @ w_k, x @ w_v),
    ),
    Mistake(
        "self_attention",
        "the keys and values come from x: that is self-attention, not "
        "cross-attention",
        "project the context with w_k and w_v: k = context @ w_k, v = context "
        "@ w_v",
        lambda x, c, w_q, w_k, w_v: _attend(x @ w_q, x @ w_k, x @ w_v),
    ),
    Mistake(
        "values_from_x",
        "the values come from x instead of the context",
        "each weight row has one entry per context token, so the values must "
        "be context @ w_v",
        lambda x, c, w_q, w_k, w_v: _attend(x @ w_q, c @ w_k, x @ w_v),
    ),
    Mistake(
        "swapped_qk",
        "queries and keys are swapped: the score matrix is transposed",
        "scores = q @ k.T with q = x @ w_q and k = context @ w_k; k @ q.T is "
        "the transpose",
        lambda x, c, w_q, w_k, w_v: (
            softmax(_t((x @ w_q) @ _t(c @ w_k)) / np.sqrt(w_q.shape[-1]))
            @ (c @ w_v)
        ),
    ),
    Mistake(
        "no_scale",
        "the scores are not divided by sqrt(d_k)",
        "use softmax(q @ k.T / np.sqrt(d_k)) @ v; chapter 3 explains the "
        "factor",
        lambda x, c, w_q, w_k, w_v: _attend(
            x @ w_q, c @ w_k, c @ w_v, scale=False
        ),
    ),
    Mistake(
        "scale_by_sqrt_d_v",
        "the scores are divided by sqrt(d_v), the width of the values, not "
        "sqrt(d_k)",
        "the scale belongs to the dot products q . k, which have d_k terms: "
        "w_q.shape[-1] or q.shape[-1]",
        lambda x, c, w_q, w_k, w_v: (
            softmax((x @ w_q) @ _t(c @ w_k) / np.sqrt(w_v.shape[-1]))
            @ (c @ w_v)
        ),
    ),
    Mistake(
        "scale_by_sqrt_n_k",
        "the scores are divided by sqrt(n_k), the number of context tokens, "
        "not sqrt(d_k)",
        "d_k is the width of each query and key, q.shape[-1]; len(context) "
        "counts the keys",
        lambda x, c, w_q, w_k, w_v: (
            softmax((x @ w_q) @ _t(c @ w_k) / np.sqrt(len(c))) @ (c @ w_v)
        ),
    ),
    Mistake(
        "scale_by_sqrt_n_q",
        "the scores are divided by sqrt(n_q), the number of queries, not "
        "sqrt(d_k)",
        "d_k is the width of each query and key, q.shape[-1]; q.shape[0] (or "
        "len(x)) counts the queries",
        lambda x, c, w_q, w_k, w_v: (
            softmax((x @ w_q) @ _t(c @ w_k) / np.sqrt(len(x))) @ (c @ w_v)
        ),
    ),
    Mistake(
        "scale_by_d_v",
        "the scores are divided by d_v, the width of the values, not by "
        "sqrt(d_k)",
        "the scale belongs to the dot products q . k, which have d_k terms: "
        "divide by np.sqrt(w_q.shape[-1])",
        lambda x, c, w_q, w_k, w_v: (
            softmax((x @ w_q) @ _t(c @ w_k) / w_v.shape[-1]) @ (c @ w_v)
        ),
    ),
    Mistake(
        "scale_by_sqrt_d_context",
        "the scores are divided by sqrt(d_context), the width of the context "
        "tokens, not sqrt(d_k)",
        "the dot products are between projected queries and keys, d_k "
        "features each: divide by "
        "sqrt(w_q.shape[-1]), not by sqrt(context.shape[-1]) or "
        "sqrt(w_k.shape[0])",
        lambda x, c, w_q, w_k, w_v: (
            softmax((x @ w_q) @ _t(c @ w_k) / np.sqrt(c.shape[-1])) @ (c @ w_v)
        ),
    ),
    Mistake(
        "scale_by_sqrt_d_model",
        "the scores are divided by sqrt(d_model), the width of the tokens, "
        "not sqrt(d_k)",
        "the dot products are between projected queries and keys, d_k "
        "features each: divide by sqrt(d_k)",
        lambda x, c, w_q, w_k, w_v: (
            softmax((x @ w_q) @ _t(c @ w_k) / np.sqrt(x.shape[-1])) @ (c @ w_v)
        ),
    ),
    Mistake(
        "wrong_axis",
        "the softmax normalises over the queries (axis 0) instead of the keys",
        "each query's weights over the context tokens must sum to 1: softmax "
        "along the last axis",
        lambda x, c, w_q, w_k, w_v: _attend(
            x @ w_q, c @ w_k, c @ w_v, axis=-2
        ),
    ),
    Mistake(
        "no_softmax",
        "the scores multiply the values directly, without a softmax",
        "turn each row of scores into weights that are positive and sum to 1 "
        "before multiplying by v",
        lambda x, c, w_q, w_k, w_v: (
            (x @ w_q) @ _t(c @ w_k) / np.sqrt(w_q.shape[-1]) @ (c @ w_v)
        ),
    ),
    Mistake(
        "keys_from_x",
        "the keys come from x instead of the context (the values do come from "
        "the context)",
        "the queries of x are matched against the context's tokens: k = "
        "context @ w_k, like v = context @ w_v",
        lambda x, c, w_q, w_k, w_v: _attend(x @ w_q, x @ w_k, c @ w_v),
    ),
    Mistake(
        "scale_by_d_k",
        "the scores are divided by d_k, not by its square root",
        "divide by np.sqrt(d_k): a dot product of d_k terms has a standard "
        "deviation growing like sqrt(d_k) "
        "(chapter 3)",
        lambda x, c, w_q, w_k, w_v: (
            softmax((x @ w_q) @ _t(c @ w_k) / w_q.shape[-1]) @ (c @ w_v)
        ),
    ),
    Mistake(
        "scale_times_sqrt_d_k",
        "the scores are multiplied by sqrt(d_k) instead of divided by it",
        "the scale makes the scores smaller: q @ k.T / np.sqrt(d_k)",
        lambda x, c, w_q, w_k, w_v: (
            softmax((x @ w_q) @ _t(c @ w_k) * np.sqrt(w_q.shape[-1]))
            @ (c @ w_v)
        ),
    ),
    Mistake(
        "scale_after_softmax",
        "the 1/sqrt(d_k) is applied after the softmax, to the weights",
        "scale the scores, then take the softmax: softmax(q @ k.T / "
        "np.sqrt(d_k)); scaled after it, "
        "the weights no longer sum to 1",
        lambda x, c, w_q, w_k, w_v: (
            softmax((x @ w_q) @ _t(c @ w_k))
            / np.sqrt(w_q.shape[-1])
            @ (c @ w_v)
        ),
    ),
    Mistake(
        "sigmoid",
        "the weights are a sigmoid of the scores, not a softmax",
        "a sigmoid squashes each score on its own; the softmax normalises "
        "each row so its weights sum to 1",
        lambda x, c, w_q, w_k, w_v: (
            (
                1
                / (
                    1
                    + np.exp(-(x @ w_q) @ _t(c @ w_k) / np.sqrt(w_q.shape[-1]))
                )
            )
            @ (c @ w_v)
        ),
    ),
    Mistake(
        "softmax_whole_matrix",
        "one softmax runs over the whole score matrix, so all the weights "
        "together sum to 1",
        "each query has its own distribution over the context tokens: softmax "
        "along the last axis only",
        lambda x, c, w_q, w_k, w_v: (
            (
                softmax(
                    ((x @ w_q) @ _t(c @ w_k) / np.sqrt(w_q.shape[-1])).reshape(
                        -1
                    )
                ).reshape(len(x), len(c))
            )
            @ (c @ w_v)
        ),
    ),
    Mistake(
        "returned_weights",
        "you returned the attention weights A = softmax(q @ k.T / "
        "sqrt(d_k)), shape (n_q, n_k), not the output",
        "the output mixes the values with those weights: return A @ v, with "
        "v = context @ w_v, shape (n_q, d_v); a pair must put the output "
        "first, (A @ v, A)",
        lambda x, c, w_q, w_k, w_v: softmax(
            (x @ w_q) @ _t(c @ w_k) / np.sqrt(w_q.shape[-1])
        ),
    ),
    Mistake(
        "mean_of_values",
        "every output row is the plain mean of the values: the scores play no "
        "part",
        "weight the values by softmax(q @ k.T / np.sqrt(d_k)), one row of "
        "weights per query",
        lambda x, c, w_q, w_k, w_v: np.repeat(
            (c @ w_v).mean(axis=0, keepdims=True), len(x), axis=0
        ),
    ),
]


def cross_cases() -> list[Case]:
    rng = np.random.default_rng(3)
    r = lambda *shape: rng.normal(size=shape)  # noqa: E731
    # The first case has n_q = n_k and equal widths, so that every mistake runs
    # and can be recognised.
    return [
        Case(
            "n_q = n_k = 4, d_model = d_context = 6, d_k = 3, d_v = 2",
            (r(4, 6), r(4, 6), r(6, 3), r(6, 3), r(6, 2)),
        ),
        Case(
            "n_q = 3 queries over n_k = 5 context tokens, d_model = d_context "
            "= 6, d_k = 4, d_v = 3",
            (r(3, 6), r(5, 6), r(6, 4), r(6, 4), r(6, 3)),
        ),
        Case(
            "d_model = 6 but d_context = 8, n_q = 2, n_k = 7, d_k = 4, d_v = "
            "5",
            (r(2, 6), r(7, 8), r(6, 4), r(8, 4), r(8, 5)),
        ),
        Case(
            "a single query (n_q = 1) over n_k = 3, d_k = 2, d_v = 4",
            (r(1, 5), r(3, 5), r(5, 2), r(5, 2), r(5, 4)),
        ),
    ]


def check_cross_attention(fn) -> None:
    """Check ``fn(x, context, w_q, w_k, w_v)`` returns cross-attention's
    output, shape ``(n_q, d_v)``.

    x: (n_q, d_model), context: (n_k, d_context), w_q: (d_model, d_k),
    w_k: (d_context, d_k), w_v: (d_context, d_v). The output is
    ``softmax(q k^T / sqrt(d_k)) v`` with ``q = x w_q``, ``k = context w_k``,
    ``v = context w_v``; an ``(output, weights)`` pair is accepted too.
    """
    run_checks(
        "cross-attention",
        fn,
        cross_cases(),
        _cross,
        CROSS_MISTAKES,
        postprocess=_first,
    )


# --- packed sequences: scores and cross-attention without padding -----------
#
# A batch of sequences of different lengths can be stored without padding:
# one after another in a single (T, d) array, with their lengths (the layout
# of variable-length attention kernels). The exercises of chapter 2 ask for the
# scores and the cross-attention output in that layout, which the chapter does
# not show.


def _segments(lengths):
    """The sequence each position belongs to: (T,) ints, from the lengths."""
    return np.repeat(np.arange(len(lengths)), np.asarray(lengths, dtype=int))


def _same_sequence(lengths_q, lengths_k=None):
    """(T_q, T_k) bool: True where query i and key j share a sequence."""
    seg_q = _segments(lengths_q)
    seg_k = seg_q if lengths_k is None else _segments(lengths_k)
    return seg_q[:, None] == seg_k[None, :]


def _one_too_long(lengths):
    """The pattern of blocks sliced with an inclusive end: block b covers
    offsets[b] to offsets[b + 1] included, and a later block overwrites the
    positions it shares with an earlier one."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total = int(offsets[-1])
    owner = np.full((total, total), -1)
    for b in range(len(lengths)):
        block = slice(int(offsets[b]), int(offsets[b + 1]) + 1)
        owner[block, block] = b
    return owner >= 0


def _split_at_lengths(lengths):
    """The positions of each piece that ``np.split`` makes when given the
    lengths, which it reads as split *indices*: for lengths [3, 2] the pieces
    are positions [0, 1, 2], [] and [2, 3, 4]."""
    total = int(np.sum(lengths))
    return np.split(np.arange(total), np.asarray(lengths, dtype=int))


def _split_blocks(lengths):
    """(T, T) bool: the union of the diagonal blocks of those pieces."""
    total = int(np.sum(lengths))
    inside = np.zeros((total, total), dtype=bool)
    for rows in _split_at_lengths(lengths):
        inside[np.ix_(rows, rows)] = True
    return inside


def _without_first(lengths):
    """(T, T) bool: the blocks of offsets taken as ``np.cumsum(lengths)``,
    without the leading 0: the blocks run from one cumulative sum to the next,
    so the first sequence gets none."""
    return _same_sequence(lengths) & (_segments(lengths) != 0)[:, None]


class _FiniteFill:
    """What a mistake returns to say: the scores, with *any* finite number at
    or below -1e4 (-1e9, ``np.finfo(float).min``) where ``blocked`` is True.
    :func:`_packed_compare` reads it."""

    def __init__(self, scores, blocked):
        self.scores, self.blocked = scores, blocked


def _packed_compare(got, expected) -> bool:
    """:func:`same`, except against a :class:`_FiniteFill`: then the blocked
    entries must be finite and at most -1e4, the others equal the scores."""
    if not isinstance(expected, _FiniteFill):
        return same(got, expected)
    a = as_array(got)
    if a.shape != expected.scores.shape or a.dtype.kind != "f":
        return False
    a = a.astype(np.float64)
    stand_in = a[expected.blocked]
    return bool(
        np.all(np.isfinite(stand_in))
        and np.all(stand_in <= -1e4)
        and same(a[~expected.blocked], expected.scores[~expected.blocked])
    )


def _describe_packed(got, expected, case=None) -> str:
    """:func:`difference`, which also says what the output holds where the
    answer is -inf: NaN, or a finite stand-in."""
    a, e = as_array(got), as_array(expected)
    if a.shape == e.shape and a.dtype.kind == "f" and e.dtype.kind == "f":
        a, e = a.astype(np.float64), e.astype(np.float64)
        minus_inf = np.isneginf(e)
        rest_right = same(a[~minus_inf], e[~minus_inf])
        if minus_inf.any() and rest_right:
            if np.isnan(a[minus_inf]).any():
                return (
                    "your output holds NaN where the answer is -inf (between "
                    "tokens of different sequences); the scores within each "
                    "sequence are right"
                )
            if np.isfinite(a[minus_inf]).all():
                largest = float(a[minus_inf].max())
                return (
                    "your output holds finite numbers (the largest "
                    f"{largest:.3g}) where the answer is -inf (between tokens "
                    "of different sequences); the scores within each "
                    "sequence are right"
                )
    return difference(got, expected, case)


PACKED_HINT = (
    "print your output for lengths [3, 2] and compare it with the "
    "block-diagonal pattern: a 3 x 3 block of scores, then a 2 x 2 one, "
    "-inf everywhere else. Sequence b is x[offsets[b]:offsets[b + 1]] with "
    "offsets = [0, l_0, l_0 + l_1, ...] (note the leading 0)"
)
PACKED_CROSS_HINT = (
    "print your attention weights for the failing case above: each query's "
    "row must be 0 outside its own "
    "context sequence and sum to 1. Query sequence b is "
    "x[q_offsets[b]:q_offsets[b + 1]] and its context "
    "context[k_offsets[b]:k_offsets[b + 1]], with offsets = [0, l_0, "
    "l_0 + l_1, ...] (note the leading 0)"
)


def _packed_scores(x, lengths, w_q, w_k):
    return np.where(_same_sequence(lengths), _scores(x, w_q, w_k), -np.inf)


PACKED_SCORES_MISTAKES = [
    Mistake(
        "no_blocks",
        "every token is scored against every token of the pack, across "
        "sequences: the lengths play no part",
        "tokens of different sequences must not meet: set S[i, j] = -inf "
        "when tokens i and j belong to different sequences",
        lambda x, lengths, w_q, w_k: _scores(x, w_q, w_k),
    ),
    Mistake(
        "zeros_outside",
        "the scores between different sequences are 0, not -inf",
        "a score of 0 still gets a weight exp(0) > 0 in the softmax; -inf "
        "gets exactly 0 (np.full((T, T), -np.inf), then fill the blocks)",
        lambda x, lengths, w_q, w_k: np.where(
            _same_sequence(lengths), _scores(x, w_q, w_k), 0.0
        ),
    ),
    Mistake(
        "blocks_one_too_long",
        "each sequence's block takes one token too many: the first token of "
        "the next sequence is scored against it (an end included in the "
        "slice)",
        "sequence b is x[offsets[b]:offsets[b + 1]], the end excluded, with "
        "offsets = [0, l_0, l_0 + l_1, ...]",
        lambda x, lengths, w_q, w_k: np.where(
            _one_too_long(lengths), _scores(x, w_q, w_k), -np.inf
        ),
    ),
    Mistake(
        "causal",
        "within a sequence, a token is not scored against the tokens after "
        "it (a causal mask)",
        "the exercise asks for every pair of tokens of the same sequence; "
        "hiding the later ones is the causal mask, a later chapter's subject",
        lambda x, lengths, w_q, w_k: np.where(
            _same_sequence(lengths) & np.tri(len(x), dtype=bool),
            _scores(x, w_q, w_k),
            -np.inf,
        ),
    ),
    Mistake(
        "swapped_qk",
        "queries and keys are swapped: your matrix is S transposed",
        "row i must hold query i against the keys: (q @ k.T)[i, j] = q_i . "
        "k_j with q = x @ w_q, not k @ q.T",
        lambda x, lengths, w_q, w_k: np.where(
            _same_sequence(lengths), _t(_scores(x, w_q, w_k)), -np.inf
        ),
    ),
    Mistake(
        "w_q_for_both",
        "w_q is used for the keys too, so your scores are symmetric",
        "the keys are x @ w_k; tying the two matrices makes S = S^T (see the "
        "chapter's theorem)",
        lambda x, lengths, w_q, w_k: np.where(
            _same_sequence(lengths), _scores(x, w_q, w_q), -np.inf
        ),
    ),
    Mistake(
        "scaled",
        "your scores are already divided by sqrt(d_k)",
        "this exercise asks for the raw dot products q_i . k_j; the "
        "1/sqrt(d_k) comes later (chapter 3)",
        lambda x, lengths, w_q, w_k: (
            _packed_scores(x, lengths, w_q, w_k) / np.sqrt(w_q.shape[-1])
        ),
    ),
    Mistake(
        "softmax_applied",
        "you returned attention weights (softmax of the scores, 0 between "
        "sequences), not the scores",
        "stop before the softmax: the exercise asks for S itself, with -inf "
        "between sequences",
        lambda x, lengths, w_q, w_k: softmax(
            _packed_scores(x, lengths, w_q, w_k), axis=-1
        ),
    ),
    Mistake(
        "finite_fill",
        "between sequences your scores hold a large negative number (such as "
        "-1e9 or np.finfo(float).min), a finite stand-in for -inf",
        "in float64 a softmax gives -1e9 a weight of exactly 0 too, but the "
        "exercise asks for -inf: it is exact in every dtype (-1e9 overflows "
        "float16, and a row of stand-ins only still gets weights), it is "
        "what np.where(same_sequence, S, -np.inf) gives, and a mask that "
        "hides a whole row stays visible as -inf",
        lambda x, lengths, w_q, w_k: _FiniteFill(
            _packed_scores(x, lengths, w_q, w_k), ~_same_sequence(lengths)
        ),
    ),
    Mistake(
        "nan_fill",
        "between sequences your scores hold NaN (np.nan as the fill), not "
        "-inf",
        "a NaN is not a score that the softmax can drive to 0: exp(NaN) is "
        "NaN, and one NaN in a row makes the whole row's weights NaN; fill "
        "with -np.inf, whose exp is exactly 0: np.where(same_sequence, S, "
        "-np.inf)",
        lambda x, lengths, w_q, w_k: np.where(
            _same_sequence(lengths), _scores(x, w_q, w_k), np.nan
        ),
    ),
    Mistake(
        "split_with_sizes",
        "the sequences are cut with np.split(x, lengths), which reads the "
        "lengths as split *indices*: for lengths [3, 2] it cuts at 3 and "
        "at 2, giving x[:3], an empty piece and x[2:]",
        "np.split wants the positions where a piece starts: "
        "np.split(x, np.cumsum(lengths)[:-1]); torch.split, by contrast, "
        "takes the sizes",
        lambda x, lengths, w_q, w_k: np.where(
            _split_blocks(lengths), _scores(x, w_q, w_k), -np.inf
        ),
    ),
    Mistake(
        "offsets_without_zero",
        "the offsets are np.cumsum(lengths) without the leading 0: the "
        "blocks run from one end to the next, so the first sequence has no "
        "scores (all -inf)",
        "sequence b runs from offsets[b] to offsets[b + 1] with offsets = "
        "[0, l_0, l_0 + l_1, ...]: np.concatenate([[0], np.cumsum(lengths)])",
        lambda x, lengths, w_q, w_k: np.where(
            _without_first(lengths), _scores(x, w_q, w_k), -np.inf
        ),
    ),
    Mistake(
        "scaled_by_d_model",
        "your scores are divided by sqrt(d_model), the width of the tokens",
        "this exercise asks for the raw dot products; and when chapter 3 "
        "scales them, the factor is sqrt(d_k), the width of the queries and "
        "keys (w_q.shape[-1]), not of the tokens",
        lambda x, lengths, w_q, w_k: (
            _packed_scores(x, lengths, w_q, w_k) / np.sqrt(x.shape[-1])
        ),
    ),
    Mistake(
        "boundary_in_previous_sequence",
        "the first token of each sequence after the first is counted in the "
        "sequence before it (a sequence index from np.searchsorted(ends, "
        "positions) with side='left': position ends[b] is the START of "
        "sequence b + 1, not the end of sequence b)",
        "position p belongs to the sequence b with offsets[b] <= p < "
        "offsets[b + 1]: np.searchsorted(np.cumsum(lengths), positions, "
        "side='right'), or np.repeat(np.arange(len(lengths)), lengths)",
        lambda x, lengths, w_q, w_k: np.where(
            _boundary_in_previous(lengths), _scores(x, w_q, w_k), -np.inf
        ),
    ),
]


def _boundary_in_previous(lengths):
    """(T, T) bool: the blocks of a sequence index found with
    np.searchsorted(np.cumsum(lengths), positions, side='left'), which puts
    the first token of each later sequence into the sequence before it."""
    ends = np.cumsum(lengths)
    seg = np.searchsorted(ends, np.arange(int(ends[-1])), side="left")
    return seg[:, None] == seg[None, :]


def packed_scores_cases() -> list[Case]:
    rng = np.random.default_rng(4)
    r = lambda *shape: rng.normal(size=shape)  # noqa: E731
    # The first case has square weights, so that every mistake runs.
    return [
        Case(
            "two sequences of lengths 3 and 2, d_model = d_k = 4",
            (r(5, 4), [3, 2], r(4, 4), r(4, 4)),
        ),
        Case(
            "three sequences of lengths 2, 4 and 1, d_model = 6, d_k = 3",
            (r(7, 6), [2, 4, 1], r(6, 3), r(6, 3)),
        ),
        Case(
            "four sequences of lengths 1, 3, 1 and 2, d_model = 5, d_k = 2",
            (r(7, 5), [1, 3, 1, 2], r(5, 2), r(5, 2)),
        ),
        Case(
            "a single sequence of length 4 (nothing packed), d_model = 3, "
            "d_k = 5",
            (r(4, 3), [4], r(3, 5), r(3, 5)),
        ),
    ]


def check_packed_scores(fn) -> None:
    """Check ``fn(x, lengths, w_q, w_k)`` returns the raw scores of a packed
    batch, shape ``(T, T)``.

    x: (T, d_model), the sequences one after another without padding;
    lengths: their lengths, summing to T; w_q, w_k: (d_model, d_k).
    ``S[i, j] = q_i . k_j`` when tokens i and j belong to the same
    sequence, ``-inf`` otherwise. No scaling, no softmax.
    """
    run_checks(
        "packed scores",
        fn,
        packed_scores_cases(),
        _packed_scores,
        PACKED_SCORES_MISTAKES,
        compare=_packed_compare,
        describe=_describe_packed,
        hint=PACKED_HINT,
    )


def _masked_attend(q, k, v, allowed, scale=True, axis=-1, fill=-np.inf):
    s = q @ _t(k)
    if scale:
        s = s / np.sqrt(q.shape[-1])
    return softmax(np.where(allowed, s, fill), axis=axis) @ v


def _packed_cross(x, context, x_lengths, context_lengths, w_q, w_k, w_v):
    return _masked_attend(
        x @ w_q,
        context @ w_k,
        context @ w_v,
        _same_sequence(x_lengths, context_lengths),
    )


PACKED_CROSS_MISTAKES = [
    Mistake(
        "no_blocks",
        "every query attends to the whole packed context, the other "
        "sequences' context tokens included",
        "query sequence b may attend only to context sequence b: mask the "
        "other scores with -inf before the softmax (or attend block by "
        "block)",
        lambda x, c, lx, lc, w_q, w_k, w_v: _masked_attend(
            x @ w_q, c @ w_k, c @ w_v, True
        ),
    ),
    Mistake(
        "zeros_outside",
        "the scores between different sequences are set to 0, not -inf, "
        "before the softmax",
        "a score of 0 still gets a weight exp(0) > 0; -inf gets exactly 0",
        lambda x, c, lx, lc, w_q, w_k, w_v: _masked_attend(
            x @ w_q, c @ w_k, c @ w_v, _same_sequence(lx, lc), fill=0.0
        ),
    ),
    Mistake(
        "swapped_sources",
        "the queries come from the context and the keys and values from x",
        "queries ask, so they come from x (the sequences being updated); "
        "keys and values come from the context",
        lambda x, c, lx, lc, w_q, w_k, w_v: _masked_attend(
            c @ w_q, x @ w_k, x @ w_v, _same_sequence(lc, lx)
        ),
    ),
    Mistake(
        "self_attention",
        "the keys and values come from x: that is self-attention within each "
        "sequence, not cross-attention",
        "project the context with w_k and w_v: k = context @ w_k, v = context "
        "@ w_v, and pair query sequence b with context sequence b",
        lambda x, c, lx, lc, w_q, w_k, w_v: _masked_attend(
            x @ w_q, x @ w_k, x @ w_v, _same_sequence(lx)
        ),
    ),
    Mistake(
        "no_scale",
        "the scores are not divided by sqrt(d_k)",
        "use softmax(q @ k.T / np.sqrt(d_k)) @ v; chapter 3 explains the "
        "factor",
        lambda x, c, lx, lc, w_q, w_k, w_v: _masked_attend(
            x @ w_q, c @ w_k, c @ w_v, _same_sequence(lx, lc), scale=False
        ),
    ),
    Mistake(
        "wrong_axis",
        "the softmax normalises over the queries (axis 0) instead of the keys",
        "each query's weights over its context tokens must sum to 1: softmax "
        "along the last axis",
        lambda x, c, lx, lc, w_q, w_k, w_v: _masked_attend(
            x @ w_q, c @ w_k, c @ w_v, _same_sequence(lx, lc), axis=-2
        ),
    ),
    Mistake(
        "returned_weights",
        "you returned the attention weights, shape (T_q, T_k), not the output",
        "the output mixes the values with those weights: return A @ v, shape "
        "(T_q, d_v); a pair must put the output first, (A @ v, A)",
        lambda x, c, lx, lc, w_q, w_k, w_v: softmax(
            np.where(
                _same_sequence(lx, lc),
                (x @ w_q) @ _t(c @ w_k) / np.sqrt(w_q.shape[-1]),
                -np.inf,
            ),
            axis=-1,
        ),
    ),
    Mistake(
        "mask_after_softmax",
        "the softmax runs over the whole packed context and the other "
        "sequences' weights are zeroed afterwards, so each row of weights "
        "sums to less than 1",
        "mask the scores with -inf before the softmax (or renormalise each "
        "row after zeroing): a query's weights over its own context "
        "sequence must sum to 1",
        lambda x, c, lx, lc, w_q, w_k, w_v: (
            (
                softmax((x @ w_q) @ _t(c @ w_k) / np.sqrt(w_q.shape[-1]))
                * _same_sequence(lx, lc)
            )
            @ (c @ w_v)
        ),
    ),
    Mistake(
        "split_with_sizes",
        "the sequences are cut with np.split(..., lengths), which reads the "
        "lengths as split *indices*: for lengths [3, 1] it cuts at 3 and at "
        "1, giving x[:3], an empty piece and x[1:]",
        "np.split wants the positions where a piece starts: "
        "np.split(x, np.cumsum(x_lengths)[:-1]), and the same for the "
        "context; torch.split, by contrast, takes the sizes",
        lambda x, c, lx, lc, w_q, w_k, w_v: _split_cross(
            x, c, lx, lc, w_q, w_k, w_v
        ),
    ),
    Mistake(
        "context_offsets_from_x_lengths",
        "the context is cut with the offsets of the QUERIES (from x_lengths): "
        "context sequence b is taken as context[x_offsets[b]:x_offsets[b + "
        "1]], which is right only when each context sequence has the length "
        "of its query sequence",
        "cut the context with its own offsets, k_offsets = [0, c_0, c_0 + "
        "c_1, ...] from context_lengths: query sequence b is "
        "x[q_offsets[b]:q_offsets[b + 1]] and its context is "
        "context[k_offsets[b]:k_offsets[b + 1]]",
        lambda x, c, lx, lc, w_q, w_k, w_v: _context_offsets_from_x(
            x, c, lx, lc, w_q, w_k, w_v
        ),
    ),
    Mistake(
        "inverted_mask",
        "your mask is inverted: each query attends to every context token "
        "EXCEPT those of its own sequence. True marked the pairs to block, "
        "as in PyTorch's nn.MultiheadAttention (where True means may NOT "
        "attend)",
        "in this book, as in PyTorch's scaled_dot_product_attention, a "
        "boolean mask is True where a query MAY attend: True where the "
        "query's sequence index equals the key's (==, not !=), or invert "
        "your mask with ~mask",
        lambda x, c, lx, lc, w_q, w_k, w_v: _masked_attend(
            x @ w_q, c @ w_k, c @ w_v, ~_same_sequence(lx, lc)
        ),
    ),
    Mistake(
        "blocks_one_too_long",
        "each query sequence's context block takes one token too many: the "
        "first token of the next context sequence is attended to as well "
        "(an end included in the slice)",
        "context sequence b is context[k_offsets[b]:k_offsets[b + 1]], the "
        "end excluded, with k_offsets = [0, c_0, c_0 + c_1, ...] from "
        "context_lengths",
        lambda x, c, lx, lc, w_q, w_k, w_v: _masked_attend(
            x @ w_q, c @ w_k, c @ w_v, _context_one_too_long(lx, lc)
        ),
    ),
    Mistake(
        "scale_by_sqrt_d_v",
        "the scores are divided by sqrt(d_v), the width of the values, not "
        "sqrt(d_k)",
        "the scale belongs to the dot products q . k, which have d_k terms: "
        "w_q.shape[-1] or q.shape[-1]",
        lambda x, c, lx, lc, w_q, w_k, w_v: _masked_attend(
            (x @ w_q) * np.sqrt(w_q.shape[-1] / w_v.shape[-1]),
            c @ w_k,
            c @ w_v,
            _same_sequence(lx, lc),
        ),
    ),
    Mistake(
        "key_segments_from_x_lengths",
        "the keys' sequence index is built from x_lengths, the QUERY "
        "lengths: the mask compares each query's sequence with a 'key "
        "sequence' of T_q entries, so it has shape (T_q, T_q), not (T_q, "
        "T_k), and pairs the wrong tokens wherever the lengths differ",
        "the keys are context tokens: take their sequence index from "
        "context_lengths, np.repeat(np.arange(B), context_lengths), and "
        "only the queries' from x_lengths; the mask is then (T_q, T_k), "
        "like the scores",
        lambda x, c, lx, lc, w_q, w_k, w_v: _masked_attend(
            x @ w_q, c @ w_k, c @ w_v, _same_sequence(lx, lx)
        ),
        raises=lambda err: _square_against_wide(err),
    ),
]


def _square_against_wide(err: Exception) -> bool:
    """Whether ``err`` is numpy's complaint that a square (a, a) array and an
    (a, b) one, b != a, do not broadcast, or that an (a, a) boolean mask does
    not index an (a, b) array: a mask built with the query lengths on both
    sides, used on the (T_q, T_k) scores."""
    text = str(err)
    if isinstance(err, ValueError) and "could not be broadcast" in text:
        shapes = [
            tuple(int(v) for v in pair)
            for pair in re.findall(r"\((\d+),\s*(\d+)\)", text)
        ]
        squares = {a for a, b in shapes if a == b}
        return any(a in squares and b != a for a, b in shapes)
    if isinstance(err, IndexError) and "boolean index did not match" in text:
        # numpy 2's wording, then numpy 1's
        found = re.search(
            r"axis 1; size of axis is (\d+) but size of corresponding "
            r"boolean axis is (\d+)",
            text,
        ) or re.search(
            r"dimension 1; dimension is (\d+) but corresponding boolean "
            r"dimension is (\d+)",
            text,
        )
        return bool(found) and found.group(1) != found.group(2)
    return False


def _context_one_too_long(lengths_q, lengths_k):
    """(T_q, T_k) bool: query sequence b may attend to its context sliced
    with an inclusive end, context[k_offsets[b]:k_offsets[b + 1] + 1], so the
    first token of the next context sequence too."""
    offsets = np.concatenate([[0], np.cumsum(lengths_k)]).astype(int)
    seg_q = _segments(lengths_q)
    allowed = np.zeros((len(seg_q), int(offsets[-1])), dtype=bool)
    for b in range(len(lengths_k)):
        allowed[seg_q == b, offsets[b] : offsets[b + 1] + 1] = True
    return allowed


def _context_offsets_from_x(x, c, lx, lc, w_q, w_k, w_v):
    """Cross-attention in which context sequence b is cut with the QUERY
    offsets: context[x_offsets[b]:x_offsets[b + 1]], the context lengths
    unused (a query whose slice is empty gets NaN)."""
    seg_q = _segments(lx)
    # context position j "belongs" to query sequence seg_q[j] (none past T_q)
    seg_k = np.full(len(c), -1)
    shared = min(len(c), len(seg_q))
    seg_k[:shared] = seg_q[:shared]
    return _masked_attend(
        x @ w_q, c @ w_k, c @ w_v, seg_q[:, None] == seg_k[None, :]
    )


def _split_cross(x, c, lx, lc, w_q, w_k, w_v):
    """Cross-attention pair by pair over the pieces np.split makes when given
    the lengths (read as split indices); empty query pieces give no rows."""
    rows = []
    for xb, cb in zip(
        np.split(x, np.asarray(lx, dtype=int)),
        np.split(c, np.asarray(lc, dtype=int)),
    ):
        if len(xb) == 0:
            continue
        if len(cb) == 0:
            rows.append(np.full((len(xb), w_v.shape[-1]), np.nan))
            continue
        rows.append(_attend(xb @ w_q, cb @ w_k, cb @ w_v))
    return np.concatenate(rows)


def packed_cross_cases() -> list[Case]:
    rng = np.random.default_rng(5)
    r = lambda *shape: rng.normal(size=shape)  # noqa: E731
    # The first case has the same lengths and widths on both sides, so that
    # every mistake runs.
    return [
        Case(
            "queries of lengths 3 and 1 over contexts of lengths 3 and 1, "
            "d_model = d_context = 6, d_k = 3, d_v = 2",
            (r(4, 6), r(4, 6), [3, 1], [3, 1], r(6, 3), r(6, 3), r(6, 2)),
        ),
        Case(
            "queries of lengths 2 and 3 over contexts of lengths 4 and 3, "
            "d_model = d_context = 6, d_k = 4, d_v = 3",
            (r(5, 6), r(7, 6), [2, 3], [4, 3], r(6, 4), r(6, 4), r(6, 3)),
        ),
        Case(
            "one query in each of three sequences, over contexts of lengths "
            "1, 2 and 3, d_model = 6, d_context = 8, d_k = 4, d_v = 5",
            (
                r(3, 6),
                r(6, 8),
                [1, 1, 1],
                [1, 2, 3],
                r(6, 4),
                r(8, 4),
                r(8, 5),
            ),
        ),
        Case(
            "a single pair (nothing packed): 2 queries over 3 context "
            "tokens, d_k = 2, d_v = 4",
            (r(2, 5), r(3, 5), [2], [3], r(5, 2), r(5, 2), r(5, 4)),
        ),
    ]


def check_packed_cross_attention(fn) -> None:
    """Check ``fn(x, context, x_lengths, context_lengths, w_q, w_k, w_v)``
    returns the cross-attention output of a packed batch, shape
    ``(T_q, d_v)``.

    x: (T_q, d_model) and context: (T_k, d_context), sequences one after
    another without padding; x_lengths and context_lengths: their lengths
    (as many of each; query sequence b reads context sequence b);
    w_q: (d_model, d_k), w_k: (d_context, d_k), w_v: (d_context, d_v).
    Within each pair, ``softmax(q k^T / sqrt(d_k)) v``; an ``(output,
    weights)`` pair is accepted too.
    """
    run_checks(
        "packed cross-attention",
        fn,
        packed_cross_cases(),
        _packed_cross,
        PACKED_CROSS_MISTAKES,
        postprocess=_first,
        hint=PACKED_CROSS_HINT,
    )


# --- realise a given attention pattern (hard) --------------------------------
#
# Given token vectors x (n, d_model) with linearly independent rows and a
# target map pi (query i should attend to key pi[i]), the reader returns
# w_q, w_k (d_model, d_k), d_k of their choice, such that
# softmax((x w_q)(x w_k)^T / sqrt(d_k)) puts weight >= 0.9 on (i, pi[i]) for
# every i. Many answers are right, so the checker tests the property, and
# names a mistake by what the reader's weights do.

PATTERN_WEIGHT = 0.9
# an answer whose weight is exactly 0.9 in exact arithmetic (a gap of exactly
# sqrt(d_k) ln(9 (n - 1))) computes to 0.8999999999999998: it meets the bound,
# and falls short only by rounding. The tolerance follows the precision of the
# inputs: in float32 (tokens given, or weights returned) the same answer
# rounds to a few 1e-8 short, so float32 gets 1e-6
PATTERN_TOLERANCE = 1e-9
PATTERN_TOLERANCE_FLOAT32 = 1e-6


def _pattern_tolerance(*arrays) -> float:
    """PATTERN_TOLERANCE, or PATTERN_TOLERANCE_FLOAT32 when any of
    ``arrays`` (the tokens, the reader's weights) is a float narrower than
    float64."""
    for a in arrays:
        dtype = as_array(a).dtype
        if np.issubdtype(dtype, np.floating) and dtype.itemsize < 8:
            return PATTERN_TOLERANCE_FLOAT32
    return PATTERN_TOLERANCE


def _pattern_tokens(rng, n, d_model, shared=3.0):
    """(n, d_model) token vectors with linearly independent rows that share a
    common direction, as trained embeddings do: far from orthonormal, so that
    x.T is no stand-in for a pseudo-inverse."""
    return shared * rng.normal(size=d_model) + rng.normal(size=(n, d_model))


def _orthonormal_like(x):
    """(n, d_model) rows that are orthonormal and span the rows of ``x``."""
    q, _ = np.linalg.qr(np.asarray(x, dtype=np.float64).T)
    return q.T.astype(np.asarray(x).dtype)


def _pattern_weights(x, w_q, w_k, scale=True):
    """softmax((x w_q)(x w_k)^T / sqrt(d_k)) in float64, (n, n)."""
    x, w_q, w_k = (as_array(a).astype(np.float64) for a in (x, w_q, w_k))
    s = (x @ w_q) @ (x @ w_k).T
    if scale:
        s = s / np.sqrt(w_q.shape[-1])
    return softmax(s, axis=-1)


def _realises(weights, pi, tolerance=PATTERN_TOLERANCE) -> bool:
    rows = np.arange(len(pi))
    on_target = weights[rows, np.asarray(pi)]
    return bool(np.all(on_target >= PATTERN_WEIGHT - tolerance))


def _argmax_right(weights, pi) -> bool:
    """Whether each row's largest weight is on pi[i] alone."""
    rows, pi = np.arange(len(pi)), np.asarray(pi)
    target = weights[rows, pi]
    others = weights.copy()
    others[rows, pi] = -np.inf
    return bool(np.all(target > others.max(axis=-1)))


def _pattern_pinv(x, pi, gap_scale=True, transposed=False):
    """The construction through the pseudo-inverse: Q = gap * I, K = P^T."""
    n = len(pi)
    target = np.eye(n)[np.asarray(pi)]  # (n, n): row i one-hot at pi[i]
    if transposed:
        target = target.T
    x_pinv = np.linalg.pinv(np.asarray(x, dtype=np.float64))
    gap = np.log(PATTERN_WEIGHT / (1 - PATTERN_WEIGHT) * max(n - 1, 1)) + 1
    if gap_scale:
        gap *= np.sqrt(n)  # d_k = n
    return gap * x_pinv, x_pinv @ target.T


def _pattern_tied(x, pi):
    # the closest tied answer: W = X^+ V sqrt(max(lambda, 0)) from the
    # symmetric part of the target scores
    n = len(pi)
    target = 10.0 * np.sqrt(n) * np.eye(n)[np.asarray(pi)]
    lam, vec = np.linalg.eigh((target + target.T) / 2)
    w = np.linalg.pinv(x) @ vec * np.sqrt(np.clip(lam, 0, None))
    return w, w


def _pattern_transpose_for_pinv(x, pi):
    n = len(pi)
    target = np.eye(n)[np.asarray(pi)]
    gap = np.sqrt(n) * (np.log(9 * max(n - 1, 1)) + 1)
    return gap * x.T, x.T @ target.T


REALISE_MISTAKES = [
    Mistake(
        "tied_weights",
        "your W_Q W_K^T is symmetric positive semidefinite, as for tied "
        "weights (W_K = W_Q, or a positive multiple of it), and such weights "
        "cannot realise this pattern: W_Q W_K^T = R R^T, so with u_i = x_i "
        "R the scores u_i . u_j are a Gram matrix, and by Cauchy-Schwarz "
        "u_i . u_j <= max(|u_i|^2, |u_j|^2): of two tokens that should "
        "attend to each other one scores itself at least as high as the "
        "other (the chapter's tied-weights theorem)",
        "untie them: the scores X W_Q W_K^T X^T can be any matrix (rank <= "
        "d_k) only when W_Q and W_K differ. Choose the queries and keys you "
        "want first (e.g. Q = c I, K = P^T, with P the one-hot target "
        "pattern), then solve X W = Q and X W = K for the weights",
        _pattern_tied,
    ),
    Mistake(
        "transposed_pattern",
        "your weights realise the transposed pattern: query pi[i] attends "
        "to key i (swapping your W_Q and W_K would pass)",
        "row i of the scores is query i against every key: S = Q K^T must "
        "have its large entry at (i, pi[i]); np.eye(n)[pi] has row i "
        "one-hot at pi[i], np.eye(n)[:, pi] is its transpose",
        lambda x, pi: _pattern_pinv(x, pi, transposed=True),
    ),
    Mistake(
        "transpose_for_pseudo_inverse",
        "you used x.T where x's pseudo-inverse belongs: your weights "
        "realise the pattern for tokens with orthogonal rows, and work "
        "only when x @ x.T is (close to) diagonal, not for these tokens, "
        "whose rows share a common direction",
        "to make X W equal a chosen Q, take W = X^+ Q with X^+ = "
        "np.linalg.pinv(x) (shape (d_model, n)): X X^+ = I_n because the "
        "rows of X are linearly independent; X X^T is not I",
        _pattern_transpose_for_pinv,
    ),
    Mistake(
        "too_weak_after_scale",
        "your scores pick key pi[i] in every row, and would give it weight "
        ">= 0.9 before the 1/sqrt(d_k) scale, but not after it: the scaled "
        "gap (the raw gap divided by sqrt(d_k)) falls short of the "
        "ln(9 (n - 1)) it must reach: either the gap was not multiplied "
        "by sqrt(d_k), or it was and falls just below the bound",
        "the weights are softmax(S / sqrt(d_k)), with d_k = w_q.shape[1]: "
        "row i needs S[i, pi[i]] above each other score of the row by "
        "sqrt(d_k) ln(9 (n - 1)) (then e^g / (e^g + n - 1) >= 0.9); a raw "
        "gap that is not multiplied by sqrt(d_k), or is fixed in advance "
        "and does not grow with n, or falls just below the bound, fails",
        lambda x, pi: _pattern_pinv(x, pi, gap_scale=False),
    ),
    Mistake(
        "margin_too_small",
        "your scores pick key pi[i] in every row, but by too small a "
        "margin: its weight stays below 0.9 even without the 1/sqrt(d_k) "
        "scale",
        "with n keys, the target needs a scaled score gap g with e^g / "
        "(e^g + n - 1) >= 0.9, that is g >= ln(9 (n - 1)): the gap must "
        "grow with n, and be multiplied by sqrt(d_k) to survive the scale",
        lambda x, pi: (
            lambda w: (w[0] / (np.log(9 * max(len(pi) - 1, 1)) + 1) * 2, w[1])
        )(_pattern_pinv(x, pi, gap_scale=False)),
    ),
    Mistake(
        "transposed_weights",
        "your weights have shape (d_k, d_model), the transpose of what the "
        "exercise asks for (the layout of torch.nn.Linear's weight)",
        "the book's weights project as x @ w: return arrays of shape "
        "(d_model, d_k), e.g. w.T",
        lambda x, pi: tuple(w.T for w in _pattern_pinv(x, pi)),
    ),
    Mistake(
        "returned_q_and_k",
        "you returned queries and keys (n rows, one per token), not the "
        "weight matrices (d_model rows) that make them",
        "the exercise asks for W_Q, W_K with X W_Q = Q and X W_K = K: "
        "W = np.linalg.pinv(x) @ Q, shape (d_model, d_k)",
        lambda x, pi: tuple(
            np.asarray(x, dtype=np.float64) @ w for w in _pattern_pinv(x, pi)
        ),
    ),
    Mistake(
        "wrong_shapes",
        "your W_Q and W_K do not both have shape (d_model, d_k) with one d_k",
        "return two arrays of shape (x.shape[1], d_k): the queries and keys "
        "must share their width d_k to have dot products",
        lambda x, pi: (
            _pattern_pinv(x, pi)[0],
            _pattern_pinv(x, pi)[1][:, 1:],
        ),
    ),
]

_PATTERN_MISTAKE = {m.key: m for m in REALISE_MISTAKES}


def realise_pattern_cases() -> list[Case]:
    rng = np.random.default_rng(24)
    return [
        Case(
            "n = 3 tokens, d_model = 5; tokens 0 and 1 swap (pi = [1, 0, 2])",
            (_pattern_tokens(rng, 3, 5), [1, 0, 2]),
        ),
        Case(
            "n = 4 tokens, d_model = 6; not a permutation (pi = [2, 2, 0, "
            "1]): two queries read one key",
            (_pattern_tokens(rng, 4, 6), [2, 2, 0, 1]),
        ),
        Case(
            "a single token (n = 1), d_model = 3 (pi = [0])",
            (_pattern_tokens(rng, 1, 3), [0]),
        ),
        Case(
            "n = d_model = 5, float32 tokens; a cycle (pi = [1, 2, 3, 4, 0])",
            (_pattern_tokens(rng, 5, 5).astype(np.float32), [1, 2, 3, 4, 0]),
        ),
        Case(
            "n = 40 tokens, d_model = 48; a random permutation",
            (
                _pattern_tokens(rng, 40, 48),
                [int(j) for j in rng.permutation(40)],
            ),
        ),
    ]


def _pattern_pair(out):
    """The reader's (w_q, w_k) as float64 arrays; raise ValueError if it is
    not a pair of 2-D arrays."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError(
            "return a pair (w_q, w_k), got "
            f"{type(out).__name__}"
            + (f" of length {len(out)}" if hasattr(out, "__len__") else "")
        )
    w_q, w_k = (as_array(w).astype(np.float64) for w in out)
    if w_q.ndim != 2 or w_k.ndim != 2:
        raise ValueError(
            f"w_q and w_k must be matrices, got shapes {w_q.shape} and "
            f"{w_k.shape}"
        )
    return w_q, w_k


def _gram_form(w_q, w_k) -> bool:
    """Whether W_Q W_K^T is symmetric positive semidefinite (W_K a positive
    multiple of W_Q, for one): the scores are then a Gram matrix."""
    if w_q.shape != w_k.shape:
        return False
    m = w_q @ w_k.T
    size = max(float(np.abs(m).max()), 1e-300)
    if not np.allclose(m, m.T, rtol=0, atol=1e-9 * size):
        return False
    return bool(np.linalg.eigvalsh((m + m.T) / 2).min() >= -1e-9 * size)


def _row_coefficients(x, w):
    """M with x.T @ M the part of ``w`` in the row space of ``x``: M = (x
    x^T)^-1 x w, (n, d_k). An answer that uses x.T for the pseudo-inverse
    has w = x.T @ M with M the queries (or keys) it meant, whatever x."""
    x = np.asarray(x, dtype=np.float64)
    return np.linalg.solve(x @ x.T, x @ w)


def _same_coefficients(x, w, probe_x, probe_w) -> bool:
    """Whether ``w`` (on x) and ``probe_w`` (on orthonormal rows probe_x
    spanning the same space) combine the rows with one set of coefficients,
    as x.T @ M and probe_x.T @ M do."""
    if w.shape != probe_w.shape:
        return False
    got = _row_coefficients(x, w)
    meant = np.asarray(probe_x, dtype=np.float64) @ probe_w
    size = max(float(np.abs(meant).max()), 1e-300)
    return bool(np.allclose(got, meant, rtol=0, atol=1e-3 * size))


def _diagnose_pattern(fn, case, w_q, w_k, weights, tolerance):
    """The mistake the reader's weights show on ``case``, or None."""
    x, pi = case.args
    n, d_model = np.shape(x)
    if np.allclose(w_q, w_k, rtol=1e-6, atol=1e-9) or _gram_form(w_q, w_k):
        return _PATTERN_MISTAKE["tied_weights"]
    if _realises(_pattern_weights(x, w_k, w_q), pi, tolerance):
        return _PATTERN_MISTAKE["transposed_pattern"]
    # run the reader's function on tokens with orthonormal rows spanning the
    # same space: an answer right there, wrong here, and built on x as x.T
    # @ M with the same M as there, treats x.T as x^+
    probe = Case(case.name, (_orthonormal_like(x), list(pi)))
    try:
        with np.errstate(all="ignore"):
            out = fn(*fresh(probe).args)
            pair = _pattern_pair(out)
            probe_tolerance = _pattern_tolerance(probe.args[0], *out)
            transpose_used = (
                pair[0].shape[0] == d_model
                and _realises(
                    _pattern_weights(probe.args[0], *pair),
                    pi,
                    probe_tolerance,
                )
                and _same_coefficients(x, w_q, probe.args[0], pair[0])
                and _same_coefficients(x, w_k, probe.args[0], pair[1])
            )
    except Exception:
        transpose_used = False
    if transpose_used:
        return _PATTERN_MISTAKE["transpose_for_pseudo_inverse"]
    if _argmax_right(weights, pi):
        if _realises(
            _pattern_weights(x, w_q, w_k, scale=False), pi, tolerance
        ):
            return _PATTERN_MISTAKE["too_weak_after_scale"]
        return _PATTERN_MISTAKE["margin_too_small"]
    return None


def _shape_mistake(x, pi, w_q, w_k, tolerance=PATTERN_TOLERANCE):
    """The mistake a pair of the wrong shapes shows, and what is wrong."""
    n, d_model = np.shape(x)
    problem = (
        f"expected w_q and w_k of shape (d_model, d_k) = ({d_model}, d_k), "
        f"one d_k for both; got {w_q.shape} and {w_k.shape}"
    )
    if (
        w_q.shape == w_k.shape
        and w_q.shape[1] == d_model
        and w_q.shape[0] != d_model
        and _realises(_pattern_weights(x, w_q.T, w_k.T), pi, tolerance)
    ):
        return _PATTERN_MISTAKE["transposed_weights"], problem
    if (
        w_q.shape[0] == n != d_model
        and w_q.shape[1] == w_k.shape[1]
        and w_k.shape[0] == n
    ):
        return _PATTERN_MISTAKE["returned_q_and_k"], problem
    return _PATTERN_MISTAKE["wrong_shapes"], problem


def check_realise_pattern(fn) -> None:
    """Check ``fn(x, pi)`` returns ``(w_q, w_k)``, each ``(d_model, d_k)``
    with one ``d_k`` of the reader's choice, such that ``softmax((x w_q)(x
    w_k)^T / sqrt(d_k))`` puts weight >= 0.9 on ``(i, pi[i])`` for every
    query i (to within 1e-9, or 1e-6 when the tokens or the returned
    weights are float32, so that an answer exactly at the bound passes
    despite rounding).

    x: (n, d_model), n <= d_model, rows linearly independent (not
    orthonormal); pi: n ints in [0, n). Many answers are right, so the
    checker tests that property, computed in float64 from the returned
    weights, and names a mistake by what those weights do.
    """
    __tracebackhide__ = True
    exercise = "realise a pattern"
    cases = realise_pattern_cases()
    noted = False
    for case in cases:
        x, pi = case.args
        given = fresh(case)
        try:
            with np.errstate(all="ignore"):
                out = fn(*given.args)
            w_q, w_k = _pattern_pair(out)
            tolerance = _pattern_tolerance(x, *out)
        except NotImplementedError:
            raise NotAttemptedError(
                exercise,
                case.name,
                "the function is still the stub",
                hint="replace `raise NotImplementedError` with your code",
            ) from None
        except Exception as err:
            raise ExerciseError(
                exercise,
                case.name,
                f"your function raised {type(err).__name__}: {err}",
                hint="return a pair (w_q, w_k) of arrays of shape "
                "(d_model, d_k)",
            ) from err
        if not noted:
            changed = changed_inputs(fn, case, given)
            if changed:
                print(in_place_note(exercise, case, changed))
                noted = True
        n, d_model = np.shape(x)
        if (
            w_q.shape[0] != d_model
            or w_k.shape[0] != d_model
            or w_q.shape[1] != w_k.shape[1]
        ):
            mistake, problem = _shape_mistake(x, pi, w_q, w_k, tolerance)
            raise ExerciseError(exercise, case.name, problem, mistake=mistake)
        if not (np.all(np.isfinite(w_q)) and np.all(np.isfinite(w_k))):
            raise ExerciseError(
                exercise,
                case.name,
                "your weights hold NaN or inf",
                hint="build them from finite numbers: np.linalg.pinv(x) "
                "times a finite gap",
            )
        with np.errstate(all="ignore"):
            weights = _pattern_weights(x, w_q, w_k)
        if _realises(weights, pi, tolerance):
            continue
        rows = np.arange(n)
        on_target = weights[rows, np.asarray(pi)]
        worst = int(np.argmin(on_target))
        # enough digits that a weight just under 0.9 does not print as 0.9
        worst_weight = float(on_target[worst])
        shortfall = PATTERN_WEIGHT - worst_weight
        n_short = int(np.sum(on_target < PATTERN_WEIGHT - tolerance))
        problem = (
            f"query {worst} puts weight {worst_weight:.6f} on key "
            f"{pi[worst]}, {shortfall:.1e} short of the {PATTERN_WEIGHT} "
            f"asked; {n_short} of {n} queries fall short"
        )
        mistake = _diagnose_pattern(fn, case, w_q, w_k, weights, tolerance)
        raise ExerciseError(
            exercise,
            case.name,
            problem,
            mistake=mistake,
            hint=None
            if mistake
            else "choose the queries and keys first (Q = c I and K = P^T "
            "give S = c P), then solve X W = Q, X W = K for the weights; "
            "print softmax(S / sqrt(d_k)) for the first case and look at "
            "row i, column pi[i]",
        )
    print(f"Correct: {exercise} passes all {len(cases)} cases.")
