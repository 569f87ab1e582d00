"""Checkers for softmax, attention and the causal mask (chapters 4 and 7)."""
from __future__ import annotations

import numpy as np

from ..attention import scaled_dot_product_attention
from ..masks import causal_mask
from ..softmax import naive_softmax, softmax
from ._framework import Case, Mistake, run_checks

_rng = np.random.default_rng


def _first(out):
    """Accept either the output alone or an ``(output, weights)`` pair."""
    return out[0] if isinstance(out, tuple) else out


# --- softmax ---------------------------------------------------------------

SOFTMAX_MISTAKES = [
    Mistake("unstable", "your softmax overflows: exp of a large score is inf, and inf/inf is NaN",
            "subtract each row's maximum before exponentiating; softmax is unchanged by the shift",
            naive_softmax),
    Mistake("wrong_axis", "the softmax normalises over the wrong axis (columns instead of rows)",
            "each row (one query's scores) must sum to 1: use axis=-1 with keepdims=True",
            lambda x: softmax(x, axis=0) if np.ndim(x) > 1 else softmax(x)),
    Mistake("not_normalised", "the exponentials are never divided by their sum",
            "divide exp(x - max) by its sum along the last axis", lambda x: np.exp(x - x.max(-1, keepdims=True))),
    Mistake("global_sum", "the exponentials are divided by the sum over the whole matrix, not per row",
            "sum along axis=-1 with keepdims=True", lambda x: np.exp(x - x.max()) / np.exp(x - x.max()).sum()),
    Mistake("global_max", "the maximum subtracted is the whole array's, not each row's: a row far below "
            "it underflows to all zeros, and 0/0 is NaN",
            "subtract each row's own maximum: x - x.max(axis=-1, keepdims=True)",
            lambda x: np.exp(x - x.max()) / np.exp(x - x.max()).sum(axis=-1, keepdims=True)),
]


def softmax_cases() -> list[Case]:
    rng = _rng(0)
    # Rows at different levels first: they tell a per-row shift from a global one.
    return [
        Case("rows at very different levels, [[1000, 1001], [0, 1]]", (np.array([[1000.0, 1001.0], [0.0, 1.0]]),)),
        Case("one row of 5 scores", (rng.normal(size=5),)),
        Case("a 4 x 6 matrix of scores (softmax of each row)", (rng.normal(size=(4, 6)),)),
        Case("large scores near 1000 (float64 exp overflows above 709)", (1000 + 5 * rng.normal(size=(3, 4)),)),
        Case("a batch 2 x 3 x 5", (rng.normal(scale=3, size=(2, 3, 5)),)),
        Case("masked entries set to -inf", (np.where(np.eye(4, dtype=bool), -np.inf, rng.normal(size=(4, 4))),)),
    ]


def check_softmax(fn) -> None:
    """Check ``fn(x)`` computes a numerically stable softmax over the last axis of ``x``."""
    run_checks("softmax", fn, softmax_cases(), lambda x: softmax(x, axis=-1), SOFTMAX_MISTAKES)


# --- scaled dot-product attention ------------------------------------------

def _attention_with(scores_fn, weights_fn=softmax):
    def attention(q, k, v):
        return weights_fn(scores_fn(q, k)) @ v
    return attention


ATTENTION_MISTAKES = [
    Mistake("no_scale", "the scores are not divided by sqrt(d_k)",
            "scores = q @ k.T / np.sqrt(d_k): without it softmax saturates as d_k grows (chapter 3)",
            _attention_with(lambda q, k: q @ np.swapaxes(k, -1, -2))),
    Mistake("scale_by_dk", "the scores are divided by d_k instead of sqrt(d_k)",
            "the variance of q.k is d_k, so its standard deviation is sqrt(d_k)",
            _attention_with(lambda q, k: q @ np.swapaxes(k, -1, -2) / q.shape[-1])),
    Mistake("swapped_qk", "q and k are swapped: the score matrix is transposed (keys attend to queries)",
            "row i of the scores must be query i against every key: q @ k.T, not k @ q.T",
            _attention_with(lambda q, k: k @ np.swapaxes(q, -1, -2) / np.sqrt(q.shape[-1]))),
    Mistake("wrong_axis", "the softmax normalises over the wrong axis (over queries instead of keys)",
            "each query's weights over the keys must sum to 1: softmax along the last axis",
            _attention_with(lambda q, k: q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]),
                            lambda s: softmax(s, axis=-2))),
    Mistake("unstable", "your softmax overflows on large scores (NaN in the output)",
            "subtract each row's maximum score before exponentiating",
            _attention_with(lambda q, k: q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]), naive_softmax)),
]


def attention_cases() -> list[Case]:
    rng = _rng(1)
    n = lambda *shape, scale=1.0: rng.normal(scale=scale, size=shape)  # noqa: E731
    return [
        Case("self-attention, n = 4, d_k = d_v = 16", (n(4, 16), n(4, 16), n(4, 16))),
        Case("cross-attention, n_q = 3, n_k = 5, d_k = 8, d_v = 6", (n(3, 8), n(5, 8), n(5, 6))),
        Case("a single query and key (n = 1)", (n(1, 8), n(1, 8), n(1, 4))),
        Case("large inputs whose scores reach the thousands", (n(4, 64, scale=40), n(4, 64, scale=40), n(4, 8))),
    ]


def check_attention(fn) -> None:
    """Check ``fn(q, k, v)`` returns ``softmax(q k^T / sqrt(d_k)) v`` (or an ``(output, weights)`` pair)."""
    run_checks("scaled dot-product attention", fn, attention_cases(),
               lambda q, k, v: scaled_dot_product_attention(q, k, v)[0], ATTENTION_MISTAKES,
               postprocess=_first)


# --- the causal mask -------------------------------------------------------

CAUSAL_MISTAKES = [
    Mistake("diagonal_hidden", "the mask is off by one: each position cannot attend to itself",
            "query i may attend to keys 0..i inclusive: np.tril(np.ones((n, n), bool)) keeps the diagonal",
            lambda n: np.tril(np.ones((n, n), bool), k=-1)),
    Mistake("inverted", "True marks the masked positions; the book's convention is True = may attend",
            "negate your mask, or build the lower triangle directly",
            lambda n: ~np.tril(np.ones((n, n), bool))),
    Mistake("transposed", "the mask lets each query see the future (upper triangle) instead of the past",
            "row i is query i; the allowed keys j satisfy j <= i",
            lambda n: np.triu(np.ones((n, n), bool))),
    Mistake("one_ahead", "the mask is off by one the other way: each position also sees the next one",
            "use j <= i, not j <= i + 1", lambda n: np.tril(np.ones((n, n), bool), k=1)),
]


def _as_bool_mask(out):
    out = np.asarray(out)
    if out.dtype != bool and np.isin(out, (0, 1)).all():
        return out.astype(bool)
    return out


def check_causal_mask(fn) -> None:
    """Check ``fn(n)`` returns the (n, n) boolean causal mask, True = may attend."""
    cases = [Case(f"n = {n}", (n,)) for n in (5, 8, 2, 1)]  # informative sizes first
    run_checks("causal mask", fn, cases, lambda n: causal_mask(n), CAUSAL_MISTAKES,
               postprocess=_as_bool_mask)
