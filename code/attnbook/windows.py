"""Sliding windows: what a stack of windowed layers can see, and attention
sinks.

A sliding-window mask (:func:`attnbook.sliding_window_mask`) lets each query
see only the ``window`` most recent positions, itself included. Information
still travels further through depth: the output of a layer at position ``i``
mixes positions that were themselves mixtures of earlier ones.
:func:`receptive_field` computes exactly which inputs each output can depend on
after ``n_layers`` layers. :func:`sink_window_mask` adds back the first few
positions, the "attention sinks" of Xiao et al. (2024), which StreamingLLM
keeps in the cache forever.

Chapter 7 (masking) shows :func:`receptive_field`, :func:`sink_window_mask` and
:func:`mean_lookback`, and measures where the tiny GPT's heads look with them,
:func:`key_share` and :func:`recent_share`.
"""

from __future__ import annotations

import numpy as np

from ._validate import nonnegative_int, positive_int
from .masks import causal_mask, sliding_window_mask


def receptive_field(mask, n_layers: int) -> np.ndarray:
    """Which inputs each output can depend on after ``n_layers`` layers that
    all use ``mask``.

    mask: bool (n, n), True = may attend. Every layer adds its input back (the
    residual connection), so one layer lets position ``i`` depend on ``j`` when
    ``mask[i, j]`` or ``i == j``; ``n_layers`` layers compose that relation
    with itself: a boolean matrix power. Returns bool (n, n): entry ``[i, j]``
    is True when output ``i`` can depend on input ``j``.
    """
    mask = np.asarray(mask)
    if mask.dtype != bool or mask.ndim != 2 or mask.shape[0] != mask.shape[1]:
        raise ValueError(
            f"mask must be a square boolean matrix (n, n); got {mask.dtype} "
            f"{mask.shape}"
        )
    n_layers = positive_int("n_layers", n_layers)
    step = (mask | np.eye(len(mask), dtype=bool)).astype(np.int64)
    reach = np.eye(len(mask), dtype=np.int64)
    for _ in range(n_layers):
        # clip counts of paths to 0/1: "is there a path"
        reach = np.minimum(reach @ step, 1)
    return reach.astype(bool)


def sink_window_mask(n: int, window: int, n_sinks: int) -> np.ndarray:
    """Sliding window plus the first ``n_sinks`` positions, which every query
    may also see.

    Returns bool (n, n), causal: query ``i`` sees keys ``i - window + 1 .. i``
    and keys ``0 .. n_sinks - 1`` (those at or before ``i``). ``n_sinks = 0``
    is the plain window.
    """
    n_sinks = nonnegative_int("n_sinks", n_sinks)
    sinks = (
        np.zeros((n, n), dtype=bool)
        if n_sinks == 0
        else causal_mask(n) & (np.arange(n) < n_sinks)
    )
    return sliding_window_mask(n, window) | sinks


def key_share(weights, key: int = 0, first_query: int = 0) -> np.ndarray:
    """Average weight that queries ``first_query .. n-1`` give to key position
    ``key``.

    weights: (..., n, n) attention weights (rows = queries). Returns (...,).
    Compare with :func:`uniform_share`, what attention spread evenly over the
    causal prefix would give it.
    """
    w = np.asarray(weights)
    n = w.shape[-1]
    if w.ndim < 2 or w.shape[-2] != n:
        raise ValueError(
            f"weights must be square (..., n, n); got shape {w.shape}"
        )
    if not (0 <= key < n and key <= first_query < n):
        raise ValueError(
            f"need 0 <= key <= first_query < n={n}; got key={key}, "
            f"first_query={first_query}"
        )
    return w[..., first_query:, key].mean(axis=-1)


def _lookback_distances(weights, first_query: int):
    """The rows ``first_query .. n-1`` of square ``weights`` and each entry's
    distance ``i - j``."""
    w = np.asarray(weights)
    n = w.shape[-1]
    if w.ndim < 2 or w.shape[-2] != n:
        raise ValueError(
            f"weights must be square (..., n, n); got shape {w.shape}"
        )
    if not 0 <= first_query < n:
        raise ValueError(
            f"first_query must lie in 0..{n - 1}; got {first_query}"
        )
    i = np.arange(n)
    # (..., m, n), (m, n)
    return w[..., first_query:, :], i[first_query:, None] - i[None, :]


def mean_lookback(weights, first_query: int = 0) -> np.ndarray:
    """How far back queries ``first_query .. n-1`` look on average: the mean
    over ``i`` of ``sum_j weights[..., i, j] (i - j)``.

    weights: (..., n, n) causal attention weights (rows = queries, each summing
    to 1); a weight on a key after its query would count as a negative
    distance. Returns (...,). Uniform causal attention looks back ``i / 2``
    from query ``i``; a head that looks only at itself, 0.
    """
    w, back = _lookback_distances(weights, first_query)
    return (w * back).sum(axis=-1).mean(axis=-1)


def recent_share(weights, last: int, first_query: int = 0) -> np.ndarray:
    """Average weight that queries ``first_query .. n-1`` give to their
    ``last`` most recent keys, ``i - last + 1 .. i`` (the query's own key
    included).

    weights: (..., n, n) attention weights (rows = queries). Returns (...,).
    Uniform causal attention gives query ``i`` a share of ``min(last, i + 1) /
    (i + 1)``.
    """
    last = positive_int("last", last)
    w, back = _lookback_distances(weights, first_query)
    return (w * ((back >= 0) & (back < last))).sum(axis=-1).mean(axis=-1)


def uniform_share(n: int, first_query: int = 0) -> float:
    """The :func:`key_share` of any key ``<= first_query`` under uniform causal
    attention: mean of 1/(i+1)."""
    n = positive_int("n", n)
    if not 0 <= first_query < n:
        raise ValueError(
            f"first_query must lie in 0..{n - 1}; got {first_query}"
        )
    return float(np.mean(1.0 / np.arange(first_query + 1, n + 1)))
