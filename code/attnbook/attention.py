"""Scaled dot-product attention in numpy: ``softmax(q k^T / sqrt(d_k)) v``."""
from __future__ import annotations

import numpy as np

from . import _validate
from .softmax import softmax


def attention_scores(q, k, scale: float | None = None) -> np.ndarray:
    """Scaled similarity of every query with every key.

    q: (..., n_q, d_k), k: (..., n_k, d_k) -> (..., n_q, n_k) with entry
    ``[i, j] = scale * (q_i . k_j)``; ``scale`` defaults to ``1/sqrt(d_k)``.
    """
    q, k = np.asarray(q), np.asarray(k)
    _validate.attention_shapes(q, k, k)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    scores = q @ np.swapaxes(k, -1, -2)
    return scores * np.asarray(scale, dtype=scores.dtype)


def scaled_dot_product_attention(q, k, v, mask=None, scale: float | None = None):
    """Attention of queries ``q`` over keys ``k`` and values ``v``.

    q: (..., n_q, d_k), k: (..., n_k, d_k), v: (..., n_k, d_v);
    mask: bool, broadcastable to (..., n_q, n_k), True = may attend.
    Returns ``(output (..., n_q, d_v), weights (..., n_q, n_k))``.
    A query whose whole row is masked gets zero weights and a zero output.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    batch, n_q, n_k, _, _ = _validate.attention_shapes(q, k, v)
    scores = attention_scores(q, k, scale)                    # (..., n_q, n_k)
    if mask is not None:
        mask = np.asarray(mask)
        _validate.mask_shape(mask, batch + (n_q, n_k))
        scores = np.where(mask, scores, -np.inf)
    weights = softmax(scores, axis=-1)                        # each row sums to 1 (or is all 0)
    return weights @ v, weights
