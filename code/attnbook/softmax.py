"""Softmax and its relatives, written to be numerically stable.

The trick throughout is shift invariance: ``softmax(x) == softmax(x - c)`` for
any constant ``c``, so subtracting each row's maximum keeps every exponent ``<=
0`` and nothing overflows. Chapter 4 (softmax) derives and shows these
functions; chapters 2 and 3 use :func:`softmax` before that, and most later
chapters call it. The online softmax of chapter 9
(:mod:`attnbook.online_softmax`) shifts by :func:`stable_shift` too.
"""

from __future__ import annotations

import numpy as np

from . import _validate


def stable_shift(m) -> np.ndarray:
    """The shift to subtract before ``exp``: the maxima ``m``, with every
    non-finite entry made 0.

    A row that is empty or entirely ``-inf`` (everything masked) has maximum
    ``-inf``, and ``-inf - (-inf)`` would be NaN; subtracting 0 instead keeps
    the ``-inf`` entries at ``-inf``, which exponentiate to exactly 0. A row
    holding ``+inf`` is not shifted either, so its sum is ``inf`` and its
    log-sum-exp ``inf``, as they should be.
    """
    return np.where(np.isfinite(m), m, 0)


def widened(x) -> np.ndarray:
    """``x`` in at least float32, the precision a float16 row is computed in
    before its result is rounded once, as torch's kernels do: a float16 sum
    of more than 65504 terms near 1 would overflow, and one of more than 2048
    stalls (a term below half the sum's spacing is lost)."""
    return x.astype(np.promote_types(x.dtype, np.float32), copy=False)


def softmax(x, axis: int = -1) -> np.ndarray:
    """Softmax along ``axis``: ``exp(x_i) / sum_j exp(x_j)``.

    x: any shape; the result has the same shape and floating dtype (a float16
    row is computed in float32 and rounded once). A slice that is empty or
    entirely ``-inf`` (a fully masked row) gives all zeros, not NaN; a NaN
    anywhere in a slice makes the whole slice NaN, as in torch.
    """
    x = as_float(x)
    xw = widened(x)
    e = np.exp(
        xw
        - stable_shift(np.max(xw, axis=axis, keepdims=True, initial=-np.inf))
    )
    total = np.sum(e, axis=axis, keepdims=True)
    # 0 only for a masked row
    p = np.divide(e, total, out=np.zeros_like(e), where=total != 0)
    return p.astype(x.dtype, copy=False)


def logsumexp(x, axis: int = -1, keepdims: bool = False) -> np.ndarray:
    """``log(sum(exp(x)))`` along ``axis`` without overflow.

    ``-inf`` for an empty or all ``-inf`` slice, ``inf`` for one that holds
    ``inf`` (as torch's).
    """
    x = as_float(x)
    xw = widened(x)
    m = stable_shift(np.max(xw, axis=axis, keepdims=True, initial=-np.inf))
    # log(0) = -inf is the right answer for a masked row
    with np.errstate(divide="ignore"):
        out = m + np.log(np.sum(np.exp(xw - m), axis=axis, keepdims=True))
    out = out.astype(x.dtype, copy=False)
    return out if keepdims else np.squeeze(out, axis=axis)


def log_softmax(x, axis: int = -1) -> np.ndarray:
    """``log(softmax(x))`` as ``(x - m) - log(sum(exp(x - m)))``, ``m`` the
    maximum along ``axis``: accurate where softmax underflows.

    The order matters: the differences ``x - m`` come first, so no rounding
    of a number as large as ``m`` enters the result (``x - logsumexp(x)``
    would round ``m + log(sum)`` first, an error of up to half a unit in the
    last place of that sum, a number within ``log n`` above ``m``: about
    half an ulp of ``max(|m|, |m + log n|)``, not of ``max |x|``; with
    ``m = 0`` the sum is exact, so ``[0, -1e4]`` loses nothing; torch
    subtracts in this order too). A slice
    that is entirely ``-inf`` (a fully masked row) gives NaN, as in torch.
    """
    x = as_float(x)
    xw = widened(x)
    shifted = xw - stable_shift(
        np.max(xw, axis=axis, keepdims=True, initial=-np.inf)
    )
    # log(0) = -inf for a masked row, and -inf - (-inf) is NaN there
    with np.errstate(divide="ignore"):
        log_sum = np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))
    return (shifted - log_sum).astype(x.dtype, copy=False)


def softmax_jacobian(p) -> np.ndarray:
    """Jacobian of softmax at the point whose output is ``p``.

    p: (..., n) probabilities. Returns (..., n, n) with entries
    ``dp_i/dx_j = p_i (delta_ij - p_j)``, i.e. ``diag(p) - p p^T``.
    """
    p = as_float(p)
    _validate.require_rank("p", p, 1, "(..., n)")
    return (
        p[..., :, None] * np.eye(p.shape[-1], dtype=p.dtype)
        - p[..., :, None] * p[..., None, :]
    )


def as_float(x) -> np.ndarray:
    """``x`` as an array of floats: integers and booleans become float64,
    floats keep their dtype."""
    x = np.asarray(x)
    return x.astype(float_dtype(x), copy=False)


def float_dtype(*arrays) -> np.dtype:
    """The dtype that ``arrays`` combine to, or float64 where that is not a
    float (integers, booleans).

    The dtype of a result computed from the arrays: integer inputs never give
    an integer softmax or attention output, which would truncate every weight
    to 0.
    """
    dtype = np.result_type(*arrays)
    return dtype if np.issubdtype(dtype, np.floating) else np.dtype(np.float64)


def naive_softmax(x, axis: int = -1) -> np.ndarray:
    """The textbook formula with no max subtraction: overflows for large
    inputs.

    Kept in the package so the softmax chapter can show the failure; never use
    it.
    """
    x = np.asarray(x)
    e = np.exp(x)
    return e / np.sum(e, axis=axis, keepdims=True)
