"""Sparsemax: the point of the probability simplex closest to a score vector.

Chapter 4 (softmax) compares it with softmax: where softmax maximises score
plus entropy, sparsemax maximises score minus half the squared norm, and so
puts exact zeros on low scores (Martins and Astudillo, 2016). No other chapter
uses it; attention in the book stays softmax.
"""

from __future__ import annotations

import operator

import numpy as np

from . import _validate
from .softmax import as_float, stable_shift


def sparsemax(x, axis: int = -1) -> np.ndarray:
    """Sparsemax along ``axis``: ``max(x_i - tau, 0)``, with the threshold
    ``tau`` that makes the entries sum to one; the Euclidean projection of
    ``x`` onto the probability simplex.

    x: (..., n) scores (``n`` along ``axis``); the result has the same shape
    and floating dtype. ``-inf`` (a masked key) gets exactly 0. A slice that is
    empty or entirely ``-inf`` (a fully masked row) gives all zeros, as
    :func:`attnbook.softmax` does. A NaN or ``+inf`` anywhere in a slice makes
    the whole slice NaN: no finite threshold exists.
    """
    x, axis = check_sparsemax_input(x, axis)
    # (..., n): work on the last axis
    z = np.moveaxis(x, axis, -1)
    # shift invariance, as in softmax: with the largest score at 0 the sums
    # below stay small
    z = z - stable_shift(np.max(z, axis=-1, keepdims=True, initial=-np.inf))
    tau = sparsemax_threshold(z)  # (..., 1)
    # -inf - tau = -inf -> 0
    p = np.maximum(z - tau, 0)
    return np.moveaxis(p, -1, axis)


def sparsemax_threshold(z) -> np.ndarray:
    """The threshold ``tau`` of :func:`sparsemax` for each row of ``z (...,
    n)``; returns (..., 1).

    Sort each row in decreasing order, ``z_(1) >= z_(2) >= ...``; the entries
    that stay positive are the ``k`` largest, for the largest ``k`` with ``1 +
    k z_(k) > z_(1) + ... + z_(k)``, and ``tau = (z_(1) + ... + z_(k) - 1) /
    k`` (Martins and Astudillo 2016, Proposition 1). A row with no finite entry
    gets ``tau = inf`` (its weights are all 0); one holding NaN or ``+inf``
    gets NaN.
    """
    # no keys: nothing to weigh
    if z.shape[-1] == 0:
        return np.full(z.shape[:-1] + (1,), np.inf, dtype=z.dtype)
    # decreasing; -inf entries last
    z_sorted = -np.sort(-z, axis=-1)
    k = np.arange(1, z.shape[-1] + 1, dtype=z.dtype)
    # +inf rows: inf - inf, NaN on purpose
    with np.errstate(invalid="ignore"):
        cumulative = np.cumsum(z_sorted, axis=-1)
        # True for k = 1 .. support size
        in_support = 1 + k * z_sorted > cumulative
    # the support is a prefix
    size = np.sum(in_support, axis=-1, keepdims=True)
    total = np.take_along_axis(cumulative, np.maximum(size, 1) - 1, axis=-1)
    with np.errstate(invalid="ignore"):
        tau = np.where(size > 0, (total - 1) / np.maximum(size, 1), np.inf)
    bad = np.any(np.isnan(z) | (z == np.inf), axis=-1, keepdims=True)
    return np.where(bad, np.nan, tau).astype(z.dtype, copy=False)


def sparsemax_jacobian(p) -> np.ndarray:
    """Jacobian of sparsemax at the point whose output is ``p``.

    p: (..., n) sparsemax weights. Returns (..., n, n): ``diag(s) - s s^T /
    |R|``, where ``s`` is 1 on the support ``R`` (the entries with ``p_i > 0``)
    and 0 elsewhere. Rows and columns outside the support are zero: a key with
    zero weight passes no gradient back to its score.
    """
    p = as_float(p)
    _validate.require_rank("p", p, 1, "(..., n)")
    s = (p > 0).astype(p.dtype)
    # (..., 1, 1); 1 avoids 0/0
    size = np.maximum(s.sum(axis=-1, keepdims=True), 1)[..., None]
    return (
        s[..., :, None] * np.eye(p.shape[-1], dtype=p.dtype)
        - s[..., :, None] * s[..., None, :] / size
    )


def check_sparsemax_input(x, axis) -> tuple[np.ndarray, int]:
    """``x`` as a float array and ``axis`` as a non-negative int; raise
    ``ValueError`` unless ``x`` has at least one dimension and ``axis`` is an
    integer that names one of them."""
    x = as_float(x)
    _validate.require_rank("x", x, 1, "(..., n)")
    try:
        axis = operator.index(axis)
    except TypeError:
        raise ValueError(f"axis must be an integer; got {axis!r}") from None
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(
            f"axis {axis} is out of range for x of shape {x.shape} ({x.ndim} "
            "dimensions)"
        )
    return x, axis % x.ndim
