"""The online softmax: a row's normaliser computed in one pass, block by block.

A softmax needs two numbers per row before it can produce any output: the
maximum ``m`` (for stability) and the sum ``l = sum_j exp(x_j - m)``. Both can
be built up piece by piece. A *state* ``(m, l)`` summarises the entries seen so
far; two states merge by moving both sums to the larger maximum:

    m = max(m_a, m_b),   l = l_a * exp(m_a - m) + l_b * exp(m_b - m).

An empty piece (or one that is fully masked, all ``-inf``) has the state
``(-inf, 0)``, the identity of the merge. This is the recurrence of Milakov and
Gimelshein (2018); FlashAttention applies it to tiles of the score matrix.
Chapter 9 (FlashAttention) shows :func:`merge_softmax_states` and
:func:`online_softmax_state`, and builds :mod:`attnbook.flash` on them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._validate import positive_int
from .softmax import stable_shift


class SoftmaxState(NamedTuple):
    """Running statistics of a row: ``max`` of its entries, ``sum`` of ``exp(x
    - max)``.

    Both have the row's leading shape ``(...)``. A row with nothing in it yet
    is ``(-inf, 0)``.
    """

    max: np.ndarray
    sum: np.ndarray


def softmax_state(x, axis: int = -1) -> SoftmaxState:
    """The state of one block of entries: x (..., n) -> max and sum of shape
    (...)."""
    x = np.asarray(x, dtype=np.result_type(np.asarray(x).dtype, np.float32))
    m = np.max(x, axis=axis, initial=-np.inf)
    l = np.sum(np.exp(x - np.expand_dims(stable_shift(m), axis)), axis=axis)
    return SoftmaxState(m, l)


def merge_softmax_states(a: SoftmaxState, b: SoftmaxState) -> SoftmaxState:
    """The state of the union of two blocks, from the blocks' states alone.

    Each sum is rescaled from its own maximum to the new one; the factor
    ``exp(m_old - m_new) <= 1``, so nothing overflows.
    """
    m = np.maximum(a.max, b.max)
    # both empty: keep -inf - 0 = -inf, whose exp is an exact 0
    m_safe = stable_shift(m)
    l = a.sum * np.exp(a.max - m_safe) + b.sum * np.exp(b.max - m_safe)
    return SoftmaxState(m, l)


def online_softmax_state(x, block: int = 1) -> SoftmaxState:
    """One left-to-right pass over the last axis of ``x (..., n)``, ``block``
    entries at a time.

    With ``block=1`` this is the per-element recurrence ``m_j = max(m_{j-1},
    x_j)``, ``l_j = l_{j-1} exp(m_{j-1} - m_j) + exp(x_j - m_j)``.
    """
    x = np.asarray(x)
    block = positive_int("block", block)
    dtype = np.result_type(x.dtype, np.float32)
    state = SoftmaxState(
        np.full(x.shape[:-1], -np.inf, dtype), np.zeros(x.shape[:-1], dtype)
    )
    for start in range(0, x.shape[-1], block):
        state = merge_softmax_states(
            state, softmax_state(x[..., start : start + block])
        )
    return state


def online_softmax(x, block: int = 1) -> np.ndarray:
    """Softmax over the last axis, its normaliser found by
    :func:`online_softmax_state`.

    x: (..., n) -> (..., n). A fully masked row (all ``-inf``) gives zeros; a
    row holding a NaN gives NaNs, as :func:`attnbook.softmax` does.
    """
    x = np.asarray(x)
    m, l = online_softmax_state(x, block)
    e = np.exp(x - stable_shift(m)[..., None])
    return np.divide(
        e, l[..., None], out=np.zeros_like(e), where=l[..., None] != 0
    )
