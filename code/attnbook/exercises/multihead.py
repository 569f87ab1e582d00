"""Checkers for chapter 5: splitting a packed q/k/v projection into heads, and
multi-head attention.

Weights are in the book's layout, ``(d_in, d_out)``, so a projection is ``x @
w``. Both checkers accept numpy arrays or torch tensors as results. The split
checker passes numpy arrays, and a function that fails on them but runs on
torch tensors (a torch-native answer, ``qkv.chunk(3, dim=-1)``) gets the same
cases as tensors, where torch is installed.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np

from ..attention import scaled_dot_product_attention
from ..masks import causal_mask
from ..softmax import softmax
from ._framework import (
    Case,
    Mistake,
    as_array,
    difference,
    run_checks,
    same,
)


def _t(a):
    return np.swapaxes(a, -1, -2)


class Unusable:
    """A reader's return value of the wrong kind (a pair where one array was
    asked for, two tensors where three were), in place of the value the
    checker compares: :func:`compare` finds it equal only to an
    :class:`Unusable` of the same ``kind`` (so that a Mistake that returns the
    same wrong kind is named), and the verdict states ``message``, instead of
    a traceback from inside the checker or "your function raised" about an
    error the checker raised."""

    def __init__(self, kind: str, message: str):
        self.kind, self.message = kind, message


def compare(got, expected) -> bool:
    """:func:`same`, except that an :class:`Unusable` equals only an
    :class:`Unusable` of its kind."""
    if isinstance(got, Unusable) or isinstance(expected, Unusable):
        return (
            isinstance(got, Unusable)
            and isinstance(expected, Unusable)
            and got.kind == expected.kind
        )
    return same(got, expected)


def _shapes(parts) -> str:
    """'(2, 5, 12) and (2, 3, 5, 5)': the shapes of a tuple's parts."""
    shapes = [str(tuple(np.shape(as_array(p)))) for p in parts]
    return ", ".join(shapes[:-1]) + " and " + shapes[-1]


# The references cut and join heads with their own reshapes rather than
# attnbook.heads' split_heads and
# merge_heads: they stay independent of the code the exercises are about, and
# this module stays free of torch (attnbook.heads imports it), so that its
# checkers also run in the browser.


def split_heads(x, n_heads):
    """(..., n, d_model) -> (..., n_heads, n, d_head): each token's features
    cut into heads, then the head axis moved in front of the tokens."""
    *lead, n, d_model = np.shape(x)
    return np.swapaxes(
        np.reshape(x, (*lead, n, n_heads, d_model // n_heads)), -3, -2
    )


def merge_heads(x):
    """(..., n_heads, n, d_head) -> (..., n, n_heads * d_head), the inverse of
    :func:`split_heads`."""
    *lead, h, n, d_head = np.shape(x)
    return np.reshape(np.swapaxes(x, -3, -2), (*lead, n, h * d_head))


# --- splitting a packed projection into heads --------------------------------


def _split_qkv(qkv, n_heads):
    """Reference: q, k, v are the three thirds of the features; each is split
    into heads.

    Returns them stacked, (3, batch, n_heads, n, d_head), the form the checker
    compares.
    """
    q, k, v = np.split(np.asarray(qkv), 3, axis=-1)
    return np.stack([split_heads(t, n_heads) for t in (q, k, v)])


def _thirds(qkv):
    return np.split(np.asarray(qkv), 3, axis=-1)


def _stack(out):
    """The reader returns (q, k, v); the checker compares them stacked. A
    return value that is not three tensors of one shape becomes an
    :class:`Unusable` that says what it is."""
    if inspect.isgenerator(out):
        # q, k, v = fn(...) unpacks a generator as well as a tuple
        out = tuple(out)
    if not isinstance(out, (tuple, list)):
        return Unusable(
            "not a tuple",
            f"your function returned one {type(out).__name__} of shape "
            f"{tuple(np.shape(as_array(out)))}, not the three tensors "
            "(q, k, v)",
        )
    if len(out) != 3:
        return Unusable(
            f"{len(out)} tensors",
            f"your function returned a {type(out).__name__} of {len(out)}; "
            "return the three tensors (q, k, v)",
        )
    parts = [as_array(t) for t in out]
    shapes = {p.shape for p in parts}
    if len(shapes) != 1:
        return Unusable(
            "shapes differ",
            "q, k and v should have one shape; got "
            f"{[p.shape for p in parts]}",
        )
    return np.stack(parts)


def _no_transpose(qkv, h):
    b, n, three_d = qkv.shape
    return np.stack(
        [t.reshape(b, h, n, three_d // 3 // h) for t in _thirds(qkv)]
    )


def _no_swap(qkv, h):
    b, n, three_d = qkv.shape
    # step 1 alone: the heads cut, but left behind the tokens
    return np.stack(
        [t.reshape(b, n, h, three_d // 3 // h) for t in _thirds(qkv)]
    )


def _heads_strided(qkv, h):
    b, n, three_d = qkv.shape
    d_head = three_d // 3 // h
    # features cut as (d_head, h): head r gets features r, r + h, r + 2h, ...
    return np.stack(
        [
            t.reshape(b, n, d_head, h).transpose(0, 3, 1, 2)
            for t in _thirds(qkv)
        ]
    )


def _interleaved(qkv, h):
    b, n, three_d = qkv.shape
    # the packed axis read as (h, 3, d_head): q, k, v taken from inside each
    # head's block
    x = qkv.reshape(b, n, h, 3, three_d // 3 // h).transpose(3, 0, 2, 1, 4)
    return np.stack([x[0], x[1], x[2]])


def _packed_last(qkv, h):
    b, n, three_d = qkv.shape
    # the packed axis read as (d_model, 3): q, k, v interleaved feature by
    # feature
    x = qkv.reshape(b, n, three_d // 3, 3)
    return np.stack([split_heads(x[..., i], h) for i in range(3)])


def _tokens_last(qkv, h):
    b, n, three_d = qkv.shape
    return np.stack(
        [
            t.reshape(b, n, h, three_d // 3 // h).transpose(0, 2, 3, 1)
            for t in _thirds(qkv)
        ]
    )


def _order(*which):
    """q, k, v split correctly into heads but returned in another order
    (``which`` indexes q, k, v)."""

    def split(qkv, h):
        parts = _split_qkv(qkv, h)
        return np.stack([parts[i] for i in which])

    return split


def _split_tokens(qkv, h):
    b, n, three_d = qkv.shape
    # q, k, v cut out of the token axis instead of the feature axis
    return np.stack(
        [
            split_heads(t, h)
            for t in np.split(qkv.reshape(b, 3 * n, three_d // 3), 3, axis=1)
        ]
    )


SPLIT_QKV_MISTAKES = [
    Mistake(
        "no_transpose",
        "each of q, k, v was reshaped straight to (batch, n_heads, n, "
        "d_head), "
        "without a transpose: every 'token' of a head is a run of features "
        "from several tokens",
        "reshape to (batch, n, n_heads, d_head) first, then swap the token "
        "and head axes "
        "(.transpose(0, 2, 1, 3) in numpy, .transpose(1, 2) in torch)",
        _no_transpose,
    ),
    Mistake(
        "no_swap",
        "each of q, k, v was reshaped to (batch, n, n_heads, d_head) and "
        "returned so: the features are cut into heads, but the head axis "
        "still comes after the token axis",
        "finish the split by swapping the token and head axes, (batch, n, "
        "n_heads, d_head) -> (batch, n_heads, n, d_head): .transpose(0, 2, "
        "1, 3) in numpy, .transpose(1, 2) in torch",
        _no_swap,
    ),
    Mistake(
        "heads_strided",
        "the features were cut as (d_head, n_heads): head r got features r, r "
        "+ h, "
        "r + 2h, ... instead of one contiguous block",
        "head r owns the contiguous features r * d_head ... (r + 1) * d_head "
        "- 1: reshape the feature "
        "axis as (n_heads, d_head), heads first",
        _heads_strided,
    ),
    Mistake(
        "interleaved",
        "the packed axis was read as (n_heads, 3, d_head): q, k and v taken "
        "from inside "
        "each head's block. That is a real layout (GPT-NeoX and BLOOM pack "
        "their fused projection "
        "that way), but not this exercise's",
        "here the packed features are [all of q | all of k | all of v], as in "
        "GPT-2: split them into "
        "three thirds first, then each third into heads. Which packing a "
        "checkpoint uses is a fact "
        "about the checkpoint; reading one layout as the other scrambles "
        "every head",
        _interleaved,
    ),
    Mistake(
        "packed_last",
        "the packed axis was read as (d_model, 3): q, k and v taken as every "
        "third feature, interleaved feature by feature (in the notation of "
        "the einops library's rearrange, '(d three)' where '(three d)' was "
        "meant)",
        "the packed features are [all of q | all of k | all of v]: the "
        "three comes first, (3, d_model), so q is the first third, "
        "qkv[..., :d_model], not qkv[..., 0::3]",
        _packed_last,
    ),
    Mistake(
        "tokens_last",
        "the axes are (batch, n_heads, d_head, n): tokens and features are "
        "swapped",
        "after reshaping to (batch, n, n_heads, d_head), swap only axes 1 and "
        "2",
        _tokens_last,
    ),
    Mistake(
        "split_tokens",
        "q, k and v were cut out of the token axis, not the feature axis",
        "the three thirds of the *last* axis are q, k and v: np.split(qkv, 3, "
        "axis=-1)",
        _split_tokens,
    ),
    Mistake(
        "order_kqv",
        "q and k are swapped: the function returns (k, q, v)",
        "the packed features are [q | k | v], as in GPT-2: the first third is "
        "q, the second k, the third v; "
        "return them in that order",
        _order(1, 0, 2),
    ),
    Mistake(
        "order_qvk",
        "k and v are swapped: the function returns (q, v, k)",
        "the packed features are [q | k | v], as in GPT-2: the second third "
        "is k and the last v; return "
        "(q, k, v) in that order",
        _order(0, 2, 1),
    ),
    Mistake(
        "two_returned",
        "the function returned two tensors, not three: one of q, k, v (most "
        "often v) is missing",
        "return all three, each split into heads: return q, k, v",
        lambda qkv, h: _stack(tuple(_split_qkv(qkv, h)[:2])),
    ),
]


def split_qkv_cases() -> list[Case]:
    rng = np.random.default_rng(5)
    r = lambda *shape: rng.normal(size=shape)  # noqa: E731
    # The first case has distinct n, n_heads and d_head, so that every mistake
    # gives its own answer.
    return [
        Case(
            "batch 2, n = 5 tokens, d_model = 12, n_heads = 3 (d_head = 4)",
            (r(2, 5, 36), 3),
        ),
        Case(
            "batch 1, n = 4, d_model = 8, n_heads = 2 (d_head = 4)",
            (r(1, 4, 24), 2),
        ),
        Case(
            "a single token: batch 3, n = 1, d_model = 6, n_heads = 2",
            (r(3, 1, 18), 2),
        ),
        Case(
            "one feature per head: n = 3, d_model = 4, n_heads = 4",
            (r(2, 3, 12), 4),
        ),
        Case("one head: n = 6, d_model = 5, n_heads = 1", (r(1, 6, 15), 1)),
    ]


def _split_problem(got, expected, case) -> str:
    """What is wrong with the reader's (q, k, v), in the shapes the exercise
    asks for."""
    if isinstance(got, Unusable):
        return got.message
    if got.shape != expected.shape:
        b, n, _ = case.args[0].shape
        return (
            "each of q, k, v should have shape (batch, n_heads, n, d_head) = "
            f"{expected.shape[1:]} "
            f"(batch {b}, n {n}); yours have {got.shape[1:]}"
        )
    return difference(got, expected)


class ArraysOrTensors:
    """The reader's ``fn(qkv, n_heads)``, given numpy arrays, or torch tensors
    where it needs them.

    The exercise allows numpy or torch. On its first call the wrapper passes
    the numpy array; if ``fn`` raises (``'numpy.ndarray' object has no
    attribute 'chunk'``) and torch is importable, it calls ``fn`` again on the
    same values as a tensor (``torch.from_numpy``, which shares the array's
    memory, so that a change in place is still seen), and from then on always
    passes tensors. When the tensor fails too, or torch is missing (the
    browser), the error on the array stands.
    """

    def __init__(self, fn):
        # the reader's signature, for the in-place note
        functools.update_wrapper(self, fn)
        # None: not yet known which the function takes
        self.fn, self.tensors = fn, None

    def __call__(self, qkv, n_heads):
        if self.tensors:
            return self.fn(_torch().from_numpy(qkv), n_heads)
        if self.tensors is False:
            return self.fn(qkv, n_heads)
        before = np.array(qkv, copy=True)
        try:
            out = self.fn(qkv, n_heads)
        except NotImplementedError:
            raise
        except Exception as on_array:
            torch = _torch()
            if torch is None:
                raise
            # undo anything the failed call changed
            qkv[...] = before
            try:
                out = self.fn(torch.from_numpy(qkv), n_heads)
            except Exception:
                raise on_array from None
            self.tensors = True
            return out
        self.tensors = False
        return out


def _torch():
    """The torch module, or None where it is not installed (the browser)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def check_split_qkv(fn) -> None:
    """Check ``fn(qkv, n_heads)`` splits a packed projection into per-head q,
    k, v.

    qkv: (batch, n, 3 * d_model), the concatenation ``[x @ w_q | x @ w_k | x @
    w_v]`` along the features (what one fused linear layer computes), a float64
    numpy array; a function that fails on arrays is given torch tensors
    instead, where torch is installed (:class:`ArraysOrTensors`). Returns ``(q,
    k, v)``, each (batch, n_heads, n, d_head) with head ``r`` holding the
    features ``r * d_head .. (r + 1) * d_head - 1`` of its third, as numpy
    arrays or torch tensors.
    """
    run_checks(
        "split packed q, k, v into heads",
        ArraysOrTensors(fn),
        split_qkv_cases(),
        _split_qkv,
        SPLIT_QKV_MISTAKES,
        postprocess=_stack,
        describe=_split_problem,
        compare=compare,
    )


# --- multi-head attention ----------------------------------------------------


def _mha(x, w_q, w_k, w_v, w_o, n_heads):
    """Reference: split, attend per head, merge, project."""
    # (b, h, n, d_head)
    q, k, v = (split_heads(x @ w, n_heads) for w in (w_q, w_k, w_v))
    heads, _ = scaled_dot_product_attention(q, k, v)
    return merge_heads(heads) @ w_o


def _attend(q, k, v, scale, axis=-1):
    return softmax(q @ _t(k) * scale, axis=axis) @ v


def _split(t, h):
    b, n, d = t.shape
    return t.reshape(b, n, h, d // h).transpose(0, 2, 1, 3)


def _merge(t):
    b, h, n, d = t.shape
    return t.transpose(0, 2, 1, 3).reshape(b, n, h * d)


def _variant(
    split=_split,
    merge=_merge,
    scale=None,
    axis=-1,
    out=True,
    transpose_w=False,
    causal=False,
    transpose_w_o=False,
    keys_with_w_q=False,
    values_with_w_q=False,
    scores_transposed=False,
):
    def mha(x, w_q, w_k, w_v, w_o, h):
        if transpose_w:
            w_q, w_k, w_v, w_o = (w.T for w in (w_q, w_k, w_v, w_o))
        if transpose_w_o:
            w_o = w_o.T
        if keys_with_w_q:
            w_k = w_q
        if values_with_w_q:
            w_v = w_q
        q, k, v = (split(x @ w, h) for w in (w_q, w_k, w_v))
        s = 1 / np.sqrt(q.shape[-1]) if scale is None else scale(x, h)
        if causal:
            n = q.shape[-2]
            concat = merge(
                scaled_dot_product_attention(
                    q, k, v, mask=causal_mask(n), scale=s
                )[0]
            )
        elif scores_transposed:
            # scores k q^T: entry (j, i) where q_i . k_j belongs at (i, j)
            concat = merge(softmax(k @ _t(q) * s, axis=axis) @ v)
        else:
            concat = merge(_attend(q, k, v, s, axis))
        return concat @ w_o if out else concat

    return mha


def _plain_split(t, h):
    b, n, d = t.shape
    return t.reshape(b, h, n, d // h)


def _plain_merge(t):
    b, h, n, d = t.shape
    return t.reshape(b, n, h * d)


def _strided_split(t, h):
    b, n, d = t.shape
    return t.reshape(b, n, d // h, h).transpose(0, 3, 1, 2)


def _strided_merge(t):
    b, h, n, d = t.shape
    return t.transpose(0, 2, 3, 1).reshape(b, n, d * h)


MHA_MISTAKES = [
    Mistake(
        "one_head",
        "the features were never split: this is one head of width d_model",
        "split q, k and v into n_heads heads of d_model // n_heads features "
        "and attend in each",
        _variant(
            split=lambda t, h: t[:, None],
            scale=lambda x, h: 1 / np.sqrt(x.shape[-1]),
        ),
    ),
    Mistake(
        "scale_d_model",
        "the scores were divided by sqrt(d_model) instead of sqrt(d_head)",
        "each head's dot products have d_head terms, so divide by "
        "sqrt(d_model // n_heads)",
        _variant(scale=lambda x, h: 1 / np.sqrt(x.shape[-1])),
    ),
    Mistake(
        "no_scale",
        "the scores were not scaled: 1/sqrt(d_head) is missing",
        "each head computes softmax(q_r k_r^T / sqrt(d_head)) v_r; without "
        "the scale its softmax "
        "saturates as d_head grows (chapter 3)",
        _variant(scale=lambda x, h: 1.0),
    ),
    Mistake(
        "causal_mask",
        "a causal mask was applied: each token sees only itself and earlier "
        "tokens",
        "this exercise is plain self-attention, every token seeing every "
        "token; the causal mask "
        "belongs to decoders (chapter 7)",
        _variant(causal=True),
    ),
    Mistake(
        "no_transpose",
        "the heads were split and merged by reshape alone, without transposes",
        "split: reshape to (batch, n, n_heads, d_head), then swap axes 1 and "
        "2; merge: swap them back, "
        "then reshape",
        _variant(split=_plain_split, merge=_plain_merge),
    ),
    Mistake(
        "merge_no_transpose",
        "the heads are split correctly but merged by a reshape alone",
        "swap the head and token axes back, (batch, n_heads, n, d_head) -> "
        "(batch, n, n_heads, d_head), "
        "before the reshape to (batch, n, d_model)",
        _variant(merge=_plain_merge),
    ),
    Mistake(
        "split_no_transpose",
        "the heads were split by a reshape alone, straight to (batch, "
        "n_heads, n, "
        "d_head), though the merge is right",
        "split: reshape to (batch, n, n_heads, d_head), then swap axes 1 and "
        "2",
        _variant(split=_plain_split),
    ),
    Mistake(
        "heads_strided",
        "head r got the strided features r, r + h, r + 2h, ... (a (d_head, "
        "n_heads) split)",
        "with weights laid out like everyone else's, head r owns a contiguous "
        "block of d_head features",
        _variant(split=_strided_split, merge=_strided_merge),
    ),
    Mistake(
        "no_out_proj",
        "the concatenated heads are returned without the output projection "
        "w_o",
        "finish with concat @ w_o: it mixes the heads back into the model's "
        "d_model features",
        _variant(out=False),
    ),
    Mistake(
        "wrong_axis",
        "the softmax normalises over the queries instead of the keys",
        "each query's weights over the keys must sum to 1: softmax along the "
        "last axis",
        _variant(axis=-2),
    ),
    Mistake(
        "transposed_weights",
        "the weights were applied transposed (x @ w.T, torch.nn.Linear's "
        "layout)",
        "the book's weights are (d_in, d_out) and project as x @ w",
        _variant(transpose_w=True),
    ),
    Mistake(
        "scale_d_head",
        "the scores were divided by d_head instead of sqrt(d_head)",
        "the variance of a dot product of d_head unit-variance terms is "
        "d_head, so its standard deviation, "
        "the scale, is sqrt(d_head) (chapter 3)",
        _variant(scale=lambda x, h: 1 / (x.shape[-1] // h)),
    ),
    Mistake(
        "scale_sqrt_heads",
        "the scores were divided by sqrt(n_heads) instead of sqrt(d_head)",
        "the scale depends on how many terms each dot product has, d_head = "
        "d_model // n_heads, not on the "
        "number of heads",
        _variant(scale=lambda x, h: 1 / np.sqrt(h)),
    ),
    Mistake(
        "w_o_transposed",
        "the output projection was applied transposed (concat @ w_o.T); q, k "
        "and v are right",
        "w_o is (d_model, d_model) in the book's (d_in, d_out) layout, like "
        "the others: finish with concat @ w_o",
        _variant(transpose_w_o=True),
    ),
    Mistake(
        "softmax_heads",
        "the softmax normalises over the heads axis instead of the keys",
        "scores are (batch, n_heads, n, n): each query's weights over the "
        "keys, the last axis, must sum to 1",
        _variant(axis=-3),
    ),
    Mistake(
        "keys_with_w_q",
        "the keys were projected with w_q: k = x @ w_q, so every score is q_i "
        ". q_j",
        "project the keys with their own matrix: k = x @ w_k",
        _variant(keys_with_w_q=True),
    ),
    Mistake(
        "values_with_w_q",
        "the values were projected with w_q: v = x @ w_q, so each head "
        "averages queries instead of values",
        "project the values with their own matrix: v = x @ w_v",
        _variant(values_with_w_q=True),
    ),
    Mistake(
        "scores_transposed",
        "the scores were computed as k q^T: row i holds k_i . q_j, the "
        "scores of every query against key i, and its softmax normalises "
        "over the queries",
        "score as q k^T, shape (batch, n_heads, n_queries, n_keys): row i "
        "holds query i against every key, and the softmax along the last "
        "axis normalises over the keys",
        _variant(scores_transposed=True),
    ),
    Mistake(
        "strided_merge",
        "the heads are split correctly but merged strided, as (d_head, "
        "n_heads): slot a of head r went back to feature a * n_heads + r "
        "instead of r * d_head + a",
        "the merge must undo the split: swap the head and token axes back, "
        "(batch, n_heads, n, d_head) -> (batch, n, n_heads, d_head), then "
        "reshape to (batch, n, d_model), so that each head's output fills "
        "one contiguous block",
        _variant(merge=_strided_merge),
    ),
    Mistake(
        "strided_split",
        "the heads were split strided, as (d_head, n_heads), but merged with "
        "the standard "
        "(n_heads, d_head) merge: head r got features r, r + h, r + 2h, ... "
        "and its output went back to "
        "the block r * d_head ... (r + 1) * d_head - 1",
        "split each of q, k, v by reshaping to (batch, n, n_heads, d_head) "
        "and swapping axes 1 and 2; the merge "
        "must be its exact inverse",
        _variant(split=_strided_split),
    ),
]


def mha_cases() -> list[Case]:
    rng = np.random.default_rng(6)
    r = lambda *shape: rng.normal(size=shape)  # noqa: E731

    def case(name, b, n, d, h):
        return Case(
            name,
            (
                r(b, n, d),
                r(d, d) / np.sqrt(d),
                r(d, d) / np.sqrt(d),
                r(d, d) / np.sqrt(d),
                r(d, d) / np.sqrt(d),
                h,
            ),
        )

    # The first case has n != n_heads != d_head, so that every mistake gives
    # its own answer.
    return [
        case(
            "batch 2, n = 5 tokens, d_model = 12, n_heads = 3 (d_head = 4)",
            2,
            5,
            12,
            3,
        ),
        case("batch 1, n = 4, d_model = 8, n_heads = 2", 1, 4, 8, 2),
        case("a single token: n = 1, d_model = 6, n_heads = 3", 2, 1, 6, 3),
        case(
            "one feature per head: n = 3, d_model = 4, n_heads = 4", 1, 3, 4, 4
        ),
        case("one head: n = 5, d_model = 6, n_heads = 1", 1, 5, 6, 1),
    ]


def _only_output(out):
    """The reader's output; a tuple or list of arrays of different shapes (an
    ``(output, weights)`` pair, as ``scaled_dot_product_attention`` returns)
    becomes an :class:`Unusable`. A list of same-shape arrays (one output per
    sequence of the batch) is stacked."""
    if not isinstance(out, (tuple, list)):
        return out
    parts = [as_array(p) for p in out]
    if parts and len({p.shape for p in parts}) == 1:
        return np.stack(parts)
    return Unusable(
        f"a {type(out).__name__} of {len(parts)}",
        f"your function returned a {type(out).__name__} of {len(parts)} "
        + (f"(shapes {_shapes(parts)}) " if len(parts) > 1 else "")
        + "where one array was expected: return only the output, shape "
        "(batch, n, d_model)",
    )


def _mha_with_weights(x, w_q, w_k, w_v, w_o, n_heads):
    q, k, v = (split_heads(x @ w, n_heads) for w in (w_q, w_k, w_v))
    heads, weights = scaled_dot_product_attention(q, k, v)
    return merge_heads(heads) @ w_o, weights


MHA_MISTAKES.append(
    Mistake(
        "returns_weights",
        "the function returns a pair, (output, weights), as "
        "attnbook.scaled_dot_product_attention and attend(..., "
        "return_weights=True) do",
        "return only the output, shape (batch, n, d_model): keep the first "
        "of the attention step's pair (out, _ = ...)",
        lambda *args: _only_output(_mha_with_weights(*args)),
    )
)


def _mha_problem(got, expected, case) -> str:
    if isinstance(got, Unusable):
        return got.message
    return difference(got, expected, case)


def check_multihead_attention(fn) -> None:
    """Check ``fn(x, w_q, w_k, w_v, w_o, n_heads)`` computes multi-head
    self-attention, no loop needed.

    x: (batch, n, d_model); w_q, w_k, w_v, w_o: (d_model, d_model) in the
    book's layout (project with ``x @ w``). Returns (batch, n, d_model):
    ``concat(head_1, ..., head_h) @ w_o`` with ``head_r = softmax(q_r k_r^T /
    sqrt(d_head)) v_r``.
    """
    run_checks(
        "multi-head attention",
        fn,
        mha_cases(),
        _mha,
        MHA_MISTAKES,
        compare=compare,
        postprocess=_only_output,
        describe=_mha_problem,
    )


# --- loading a strided layer's weights into the blocked layer ----------------


def _strided_layer(x, w_q, w_k, w_v, w_o, n_heads):
    """The strided layer: head r owns features r, r + h, r + 2h, ... of each
    projection, and its output goes back to those features before w_o."""
    q, k, v = (_strided_split(x @ w, n_heads) for w in (w_q, w_k, w_v))
    heads, _ = scaled_dot_product_attention(q, k, v)
    return _strided_merge(heads) @ w_o


def _probe(d_model, n_heads):
    """The tokens on which both layers are compared: (2, 6, d_model), fixed
    per case."""
    rng = np.random.default_rng(1000 + 31 * d_model + n_heads)
    return rng.normal(size=(2, 6, d_model))


def _blocked_output(weights, d_model, n_heads):
    """The blocked layer (the book's, contiguous heads) with the reader's four
    weights, on the probe tokens; an :class:`Unusable` when they are not four
    (d_model, d_model) matrices."""
    if not isinstance(weights, (tuple, list)) or len(weights) != 4:
        what = (
            f"a {type(weights).__name__} of {len(weights)}"
            if isinstance(weights, (tuple, list))
            else f"one {type(weights).__name__}"
        )
        return Unusable(
            "not four",
            f"your function returned {what}; return the four matrices "
            "(w_q, w_k, w_v, w_o) of the blocked layer",
        )
    parts = [as_array(w).astype(np.float64) for w in weights]
    if any(p.shape != (d_model, d_model) for p in parts):
        return Unusable(
            "shapes",
            "each of the four matrices should have shape (d_model, d_model) "
            f"= {(d_model, d_model)}; yours have "
            f"{[p.shape for p in parts]}",
        )
    return _mha(_probe(d_model, n_heads), *parts, n_heads)


class AsBlockedLayer:
    """``fn(w_q, w_k, w_v, w_o, n_heads)``, which returns four weights, as the
    output of the blocked layer with those weights on the probe tokens: the
    checker compares what the layers compute, not the weights, so that every
    set of weights that computes the strided layer's function passes (there
    are many: heads in another order, the slots of a head permuted)."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.fn = fn
        # the weights returned for each (d_model, n_heads), for the diagnosis
        self.returned = {}

    def __call__(self, w_q, w_k, w_v, w_o, n_heads):
        d_model = np.shape(w_q)[0]
        out = self.fn(w_q, w_k, w_v, w_o, n_heads)
        self.returned[d_model, n_heads] = out
        return _blocked_output(out, d_model, n_heads)


def _strided_reference(w_q, w_k, w_v, w_o, n_heads):
    d_model = w_q.shape[0]
    return _strided_layer(
        _probe(d_model, n_heads), w_q, w_k, w_v, w_o, n_heads
    )


def _to_blocked(qkv_cols, o_rows, qkv=(True, True, True)):
    """A conversion that takes column s of each of W_Q, W_K, W_V (those
    flagged in ``qkv``) from column ``qkv_cols[s]`` and row s of W_O from row
    ``o_rows[s]`` (``None``: left as it is). The right one takes both from
    ``pi(s)``, ``pi(r d_head + a) = a h + r``."""

    def convert(w_q, w_k, w_v, w_o, h):
        cols, rows = qkv_cols(w_q.shape[0], h), o_rows
        out = [
            w[:, cols] if flag else w for w, flag in zip((w_q, w_k, w_v), qkv)
        ]
        out.append(w_o if rows is None else w_o[rows(w_o.shape[0], h)])
        return tuple(out)

    return AsBlockedLayer(convert)


def _pi(d, h):
    """pi[r * d_head + a] = a * h + r: the strided feature that slot a of
    head r holds."""
    return np.arange(d).reshape(d // h, h).T.ravel()


def _pi_inverse(d, h):
    return np.argsort(_pi(d, h))


STRIDED_MISTAKES = [
    Mistake(
        "unchanged",
        "the weights were returned as they are: the blocked layer gives head "
        "r the contiguous features r d_head ... (r + 1) d_head - 1, which in "
        "the strided layer belong to several heads",
        "head r of the strided layer owns features r, r + h, r + 2h, ...: "
        "move them into the block r d_head ... (r + 1) d_head - 1 of each "
        "of W_Q, W_K, W_V, and move W_O's rows the same way",
        AsBlockedLayer(lambda w_q, w_k, w_v, w_o, h: (w_q, w_k, w_v, w_o)),
    ),
    Mistake(
        "inverse_permutation",
        "the permutation is the inverse of the right one: column a h + r "
        "was filled from column r d_head + a, where column r d_head + a "
        "must be filled from column a h + r",
        "write the rule as 'new column s comes from old column pi(s)', with s "
        "= r d_head + a the slot in the blocked layer and pi(s) = a h + r; "
        "then W[:, pi] is the blocked W (with n_heads = d_head the two "
        "readings coincide, so try d_model = 12, n_heads = 3)",
        _to_blocked(_pi_inverse, _pi_inverse),
    ),
    Mistake(
        "w_o_unchanged",
        "W_Q, W_K and W_V are right, but W_O was left as it is: each head's "
        "output now reaches W_O through the rows of other features",
        "the merge puts slot a of head r at position r d_head + a, where the "
        "strided layer's W_O read it from row a h + r: permute W_O's rows "
        "with the same pi, W_O[pi]",
        _to_blocked(_pi, None),
    ),
    Mistake(
        "w_o_columns",
        "W_O's columns were permuted instead of its rows: W_O maps the "
        "concatenated heads (its rows) to the model's features (its "
        "columns), and only the heads were relabelled",
        "permute the rows, W_O[pi, :]; its columns, the layer's output "
        "features, stay where they are",
        AsBlockedLayer(
            lambda w_q, w_k, w_v, w_o, h: (
                w_q[:, _pi(len(w_q), h)],
                w_k[:, _pi(len(w_q), h)],
                w_v[:, _pi(len(w_q), h)],
                w_o[:, _pi(len(w_q), h)],
            )
        ),
    ),
    Mistake(
        "w_o_inverse",
        "W_Q, W_K, W_V are right, but W_O's rows were permuted with the "
        "inverse permutation (P W_O where P^T W_O is needed)",
        "row s of the blocked W_O must be row pi(s) of the strided one, the "
        "same rule as for the columns of W_Q: W_O[pi]",
        _to_blocked(_pi, _pi_inverse),
    ),
    Mistake(
        "qk_only",
        "only W_Q and W_K were permuted: the scores of every head are right, "
        "but each head averages the values of other features, and W_O reads "
        "them from the wrong rows",
        "a head is its queries, keys *and* values: permute the columns of "
        "W_V as well, and the rows of W_O",
        _to_blocked(_pi, None, qkv=(True, True, False)),
    ),
    Mistake(
        "wrong_side",
        "the permutation was applied on the wrong side: the rows of W_Q, "
        "W_K, W_V (the input features) and the columns of W_O (the output "
        "features) were permuted, where the heads live in the columns of "
        "W_Q, W_K, W_V and the rows of W_O",
        "the input and output features of the layer are not relabelled; "
        "permute W_Q, W_K, W_V's columns and W_O's rows",
        AsBlockedLayer(
            lambda w_q, w_k, w_v, w_o, h: (
                w_q[_pi(len(w_q), h)],
                w_k[_pi(len(w_q), h)],
                w_v[_pi(len(w_q), h)],
                w_o[:, _pi(len(w_q), h)],
            )
        ),
    ),
]


def strided_cases() -> list[Case]:
    rng = np.random.default_rng(7)

    def case(name, d, h):
        weights = tuple(rng.normal(size=(d, d)) / np.sqrt(d) for _ in range(4))
        return Case(name, (*weights, h))

    # The first case has d_head != n_heads, both above 1, so that the
    # permutation is not its own inverse and every mistake gives its own
    # answer.
    return [
        case("d_model = 12, n_heads = 3 (d_head = 4)", 12, 3),
        case("d_model = 12, n_heads = 4 (d_head = 3)", 12, 4),
        case("d_model = 10, n_heads = 2 (d_head = 5)", 10, 2),
        case("d_model = 16, n_heads = 4 (d_head = 4)", 16, 4),
        case("one head: d_model = 6, n_heads = 1", 6, 1),
        case("one feature per head: d_model = 5, n_heads = 5", 5, 5),
    ]


def _head_products(weights, cols):
    """Each head's W_Q^(r) W_K^(r)T (its scores' matrix) and W_V^(r) W_O^(r)
    (what it adds to the output), head r owning the features ``cols[r]``."""
    w_q, w_k, w_v, w_o = (as_array(w).astype(np.float64) for w in weights)
    return [(w_q[:, c] @ w_k[:, c].T, w_v[:, c] @ w_o[c]) for c in cols]


def _which_heads_differ(returned, case) -> str:
    """Which of the blocked layer's heads, with the reader's weights, compute
    no strided head's scores or output (empty if none can be said)."""
    w_q, w_k, w_v, w_o, h = case.args
    d = len(w_q)
    if returned is None or isinstance(
        _blocked_output(returned, d, h), Unusable
    ):
        return ""
    d_head = d // h
    strided = _head_products(
        (w_q, w_k, w_v, w_o), [np.arange(r, d, h) for r in range(h)]
    )
    blocked = _head_products(
        returned, [np.arange(r * d_head, (r + 1) * d_head) for r in range(h)]
    )

    def close(a, b):
        return np.allclose(a, b, rtol=1e-5, atol=1e-8)

    scores = [
        r
        for r, (qk, _) in enumerate(blocked)
        if not any(close(qk, s_qk) for s_qk, _ in strided)
    ]
    outputs = [
        r
        for r, (_, ov) in enumerate(blocked)
        if not any(close(ov, s_ov) for _, s_ov in strided)
    ]
    if scores:
        return (
            f"Head(s) {scores} of the blocked layer score with a matrix "
            "W_Q^(r) W_K^(r)T that is no strided head's: each head's queries "
            "and keys must come from one strided head, slot for slot in the "
            "same order, and a change to W_Q (a scaling, say) must be undone "
            "in W_K."
        )
    if outputs:
        return (
            f"Head(s) {outputs} of the blocked layer score like a strided "
            "head, but their W_V^(r) W_O^(r), what a head adds to the output, "
            "is no strided head's: W_V's columns and W_O's rows must move "
            "together, slot for slot, and a change to W_V must be undone in "
            "W_O."
        )
    pairs = [
        r
        for r, (qk, ov) in enumerate(blocked)
        if not any(
            close(qk, s_qk) and close(ov, s_ov) for s_qk, s_ov in strided
        )
    ]
    if pairs:
        return (
            f"Head(s) {pairs} of the blocked layer score like one strided "
            "head and add to the output what another adds: a head's queries, "
            "keys, values and W_O rows must all come from the same strided "
            "head."
        )
    return ""


def _strided_problem(got, expected, case, returned=None) -> str:
    if isinstance(got, Unusable):
        return got.message
    return (
        "the blocked layer with your weights computes something other than "
        "the strided layer on the same tokens: "
        + difference(got, expected, case)
        + (
            f". {heads}"
            if (heads := _which_heads_differ(returned, case))
            else ""
        )
    )


STRIDED_HINT = (
    "the blocked layer computes the strided one's function when each of its "
    "heads is one strided head: check, head by head, that W_Q^(r) W_K^(r)T "
    "(the scores) and W_V^(r) W_O^(r) (the output) equal those of one "
    "strided head, the same head for both"
)


def check_strided_to_blocked(fn) -> None:
    """Check ``fn(w_q, w_k, w_v, w_o, n_heads)`` converts the weights of a
    strided multi-head layer into those of the blocked one.

    The strided layer's head ``r`` owns features ``r, r + h, r + 2h, ...`` of
    each projection (its split reshapes the features as ``(d_head, h)``) and
    merges with the matching inverse; the blocked layer is the book's (head
    ``r`` owns ``r * d_head .. (r + 1) * d_head - 1``). All weights are
    ``(d_model, d_model)`` float64 numpy arrays in the book's ``(d_in,
    d_out)`` layout. ``fn`` returns the four weights ``(w_q, w_k, w_v, w_o)``
    for which the blocked layer computes the strided layer's function; the
    checker compares the two layers' outputs on fixed random tokens (2
    sequences of 6), so any such weights pass.
    """
    layer = AsBlockedLayer(fn)

    def describe(got, expected, case):
        w_q, *_, n_heads = case.args
        returned = layer.returned.get((len(w_q), n_heads))
        return _strided_problem(got, expected, case, returned)

    run_checks(
        "strided weights to the blocked layout",
        layer,
        strided_cases(),
        _strided_reference,
        STRIDED_MISTAKES,
        compare=compare,
        describe=describe,
        hint=STRIDED_HINT,
    )
