"""Queries, keys and values: three linear maps of the token vectors.

The book stores a weight matrix as ``(d_in, d_out)`` so that a projection is
``x @ w`` with the tokens as rows. (``torch.nn.Linear`` stores the transpose,
``(d_out, d_in)``, and computes ``x @ weight.T``.) Chapter 2 (queries, keys and
values) shows :func:`project_qkv` and :func:`single_head_attention`; chapter 5
builds heads from them.
"""

from __future__ import annotations

import numpy as np

from . import _validate
from .attention import scaled_dot_product_attention


def _check_weight(
    name: str, w: np.ndarray, source: str, source_shape: tuple, d_in: int
) -> None:
    """Raise unless ``w`` is a matrix whose rows match the feature size of its
    source."""
    if w.ndim != 2:
        raise ValueError(
            f"{name} must be a matrix (d_in, d_out); got shape "
            f"{tuple(w.shape)}"
        )
    if w.shape[0] == d_in:
        return
    message = (
        f"{name} of shape {tuple(w.shape)} cannot project {source} of shape "
        f"{source_shape}: "
        f"it needs {d_in} rows, one per feature of {source}"
    )
    if w.shape[1] == d_in:
        # The commonest cause: a weight copied from torch.nn.Linear, which
        # stores (d_out, d_in).
        message += (
            "; it may be transposed: the book stores weights as (d_in, "
            "d_out), "
            f"torch.nn.Linear as (d_out, d_in), so {name}.T may be meant"
        )
    raise ValueError(message)


def check_projection_inputs(x, w_q, w_k, w_v, context=None):
    """The inputs of :func:`project_qkv` as arrays, ``(x, source, w_q, w_k,
    w_v)``, after checking their shapes; ``source`` is ``context``, or ``x``
    for self-attention."""
    x, w_q, w_k, w_v = (np.asarray(a) for a in (x, w_q, w_k, w_v))
    source = x if context is None else np.asarray(context)
    source_name = "x" if context is None else "context"
    _validate.require_rank("x", x, 2, "(..., n_q, d_model)")
    _validate.require_rank(source_name, source, 2, "(..., n_k, d_context)")
    _check_weight("w_q", w_q, "x", tuple(x.shape), x.shape[-1])
    _check_weight(
        "w_k", w_k, source_name, tuple(source.shape), source.shape[-1]
    )
    _check_weight(
        "w_v", w_v, source_name, tuple(source.shape), source.shape[-1]
    )
    if w_q.shape[1] != w_k.shape[1]:
        # Scores are dot products q_i . k_j, so both must live in the same
        # d_k-dimensional space.
        raise ValueError(
            f"w_q {tuple(w_q.shape)} and w_k {tuple(w_k.shape)} must give "
            "queries and "
            f"keys the same width d_k (their second dimension)"
        )
    try:
        np.broadcast_shapes(x.shape[:-2], source.shape[:-2])
    except ValueError:
        raise ValueError(
            f"the leading (batch) dimensions of x {tuple(x.shape)} and "
            "context "
            f"{tuple(source.shape)} do not broadcast"
        ) from None
    return x, source, w_q, w_k, w_v


def project_qkv(x, w_q, w_k, w_v, context=None):
    """Queries from ``x``; keys and values from ``context`` (``x`` itself when
    omitted).

    x: (..., n_q, d_model); context: (..., n_k, d_context), default ``x``
    (self-attention);
    w_q: (d_model, d_k), w_k: (d_context, d_k), w_v: (d_context, d_v). Returns
    ``q (..., n_q, d_k)``, ``k (..., n_k, d_k)``, ``v (..., n_k, d_v)``.
    """
    x, source, w_q, w_k, w_v = check_projection_inputs(
        x, w_q, w_k, w_v, context
    )
    return x @ w_q, source @ w_k, source @ w_v


def single_head_attention(
    x, w_q, w_k, w_v, context=None, mask=None, scale=None
):
    """One attention head from token vectors: project, then attend.

    x: (..., n_q, d_model); context: (..., n_k, d_context), default ``x``;
    w_q: (d_model, d_k), w_k: (d_context, d_k), w_v: (d_context, d_v);
    mask: bool, broadcastable to (..., n_q, n_k), True = may attend;
    scale defaults to ``1/sqrt(d_k)``.
    Returns ``(output (..., n_q, d_v), weights (..., n_q, n_k))``.
    """
    q, k, v = project_qkv(x, w_q, w_k, w_v, context=context)
    return scaled_dot_product_attention(q, k, v, mask=mask, scale=scale)
