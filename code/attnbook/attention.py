"""Scaled dot-product attention in numpy: ``softmax(q k^T / sqrt(d_k)) v``.

Chapter 4 (softmax) assembles and shows :func:`attention_scores` and
:func:`scaled_dot_product_attention`; chapters 1 to 3 and 5 to 13 call them,
and every faster or cleverer attention in the book is checked against them. The
torch version, for the models, is :func:`attnbook.attend`.
"""

from __future__ import annotations

import numpy as np

from . import _validate
from .softmax import float_dtype, softmax


def attention_scores(q, k, scale: float | None = None) -> np.ndarray:
    """Scaled similarity of every query with every key.

    q: (..., n_q, d_k), k: (..., n_k, d_k) -> (..., n_q, n_k) with entry ``[i,
    j] = scale * (q_i . k_j)``; ``scale`` defaults to ``1/sqrt(d_k)``. The
    scores are at least float32: float16 inputs are scored in float32, where a
    product ``q_i . k_j`` beyond float16's largest number, 65504, does not
    overflow.
    """
    q, k = score_dtype(q, k)
    _validate.attention_shapes(q, k, k)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    scores = q @ np.swapaxes(k, -1, -2)
    return scores * np.asarray(scale, dtype=scores.dtype)


def scaled_dot_product_attention(
    q, k, v, mask=None, scale: float | None = None
):
    """Attention of queries ``q`` over keys ``k`` and values ``v``.

    q: (..., n_q, d_k), k: (..., n_k, d_k), v: (..., n_k, d_v);
    mask: bool, broadcastable to (..., n_q, n_k), True = may attend. Returns
    ``(output (..., n_q, d_v), weights (..., n_q, n_k))``. A query whose whole
    row is masked, or that has no keys at all, gets zero weights and a zero
    output. Both are returned in the inputs' dtype (float16 inputs are scored
    in float32; integer inputs give float64).
    """
    q, k, v, mask = check_attention_inputs(q, k, v, mask)
    scores = attention_scores(q, k, scale)  # (..., n_q, n_k)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    # each row sums to 1 (or is all 0)
    weights = softmax(scores, axis=-1)
    dtype = float_dtype(q, k, v)
    return (weights @ v).astype(dtype, copy=False), weights.astype(
        dtype, copy=False
    )


def score_dtype(*arrays) -> list[np.ndarray]:
    """The arrays as numpy arrays of at least float32 (float16 would overflow
    in ``q . k``)."""
    arrays = [np.asarray(a) for a in arrays]
    dtype = np.result_type(*arrays, np.float32)
    return [a.astype(dtype, copy=False) for a in arrays]


def check_attention_inputs(q, k, v, mask):
    """q, k, v (and the mask) as arrays, after checking their shapes; raises
    naming the shapes at fault."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    batch, n_q, n_k, _, _ = _validate.attention_shapes(q, k, v)
    if mask is not None:
        mask = np.asarray(mask)
        _validate.mask_shape(mask, batch + (n_q, n_k))
    return q, k, v, mask
