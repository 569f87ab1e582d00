"""Softmax and its relatives, written to be numerically stable.

The trick throughout is shift invariance: ``softmax(x) == softmax(x - c)`` for
any constant ``c``, so subtracting each row's maximum keeps every exponent
``<= 0`` and nothing overflows.
"""
from __future__ import annotations

import numpy as np


def _row_max(x: np.ndarray, axis: int) -> np.ndarray:
    """Row maxima with ``-inf`` rows (everything masked) replaced by 0.

    Subtracting ``-inf`` would give ``-inf - (-inf) = nan``; subtracting 0 keeps
    the ``-inf`` entries at ``-inf`` so that they exponentiate to exactly 0.
    """
    m = np.max(x, axis=axis, keepdims=True)
    return np.where(np.isneginf(m), 0, m)


def softmax(x, axis: int = -1) -> np.ndarray:
    """Softmax along ``axis``: ``exp(x_i) / sum_j exp(x_j)``.

    x: any shape; the result has the same shape and floating dtype.
    A slice that is entirely ``-inf`` (a fully masked row) gives all zeros, not NaN.
    """
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    e = np.exp(x - _row_max(x, axis))
    total = np.sum(e, axis=axis, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def logsumexp(x, axis: int = -1, keepdims: bool = False) -> np.ndarray:
    """``log(sum(exp(x)))`` along ``axis`` without overflow; ``-inf`` for an all ``-inf`` slice."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    m = _row_max(x, axis)
    with np.errstate(divide="ignore"):  # log(0) = -inf is the right answer for a masked row
        out = m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))
    return out if keepdims else np.squeeze(out, axis=axis)


def log_softmax(x, axis: int = -1) -> np.ndarray:
    """``log(softmax(x))`` computed as ``x - logsumexp(x)``, exact where softmax underflows."""
    x = np.asarray(x)
    return x - logsumexp(x, axis=axis, keepdims=True)


def softmax_jacobian(p) -> np.ndarray:
    """Jacobian of softmax at the point whose output is ``p``.

    p: (..., n) probabilities. Returns (..., n, n) with entries
    ``dp_i/dx_j = p_i (delta_ij - p_j)``, i.e. ``diag(p) - p p^T``.
    """
    p = np.asarray(p)
    return p[..., :, None] * np.eye(p.shape[-1], dtype=p.dtype) - p[..., :, None] * p[..., None, :]


def naive_softmax(x, axis: int = -1) -> np.ndarray:
    """The textbook formula with no max subtraction: overflows for large inputs.

    Kept in the package so the softmax chapter can show the failure; never use it.
    """
    x = np.asarray(x)
    e = np.exp(x)
    return e / np.sum(e, axis=axis, keepdims=True)
