"""Boolean attention masks. Convention (PyTorch's): True means "may attend".

Chapter 7 (masking) shows :func:`causal_mask` and :func:`sliding_window_mask`; the causal mask
serves every causal model of the book (chapters 6 to 12 use it), and the KV cache (chapter 8)
relies on its placing the queries last.
"""
from __future__ import annotations

import numpy as np

from ._validate import positive_int


def causal_mask(n_q: int, n_k: int | None = None) -> np.ndarray:
    """Causal mask of shape (n_q, n_k).

    The queries are the *last* ``n_q`` of the ``n_k`` positions, so query ``i``
    sits at absolute position ``i + n_k - n_q`` and may attend to every key at or
    before it. With ``n_q == n_k`` this is the lower triangle including the
    diagonal; with ``n_q == 1`` (one new token in KV-cache decoding) it is a row
    of all True. PyTorch's ``is_causal`` instead aligns the queries with the
    *first* ``n_q`` keys (the upper-left triangle).
    """
    n_q, n_k = queries_last("causal_mask", n_q, n_k)
    offset = n_k - n_q
    return np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + offset


def queries_last(name: str, n_q, n_k=None) -> tuple[int, int]:
    """Check that ``n_q`` queries can be the last of ``n_k`` positions (default ``n_k = n_q``)."""
    n_q = positive_int("n_q", n_q)
    n_k = n_q if n_k is None else positive_int("n_k", n_k)
    if n_q > n_k:
        raise ValueError(
            f"{name} needs n_q <= n_k (queries are the last n_q of n_k positions); "
            f"got n_q={n_q}, n_k={n_k}"
        )
    return n_q, n_k


def sliding_window_mask(n: int, window: int) -> np.ndarray:
    """Causal mask (n, n) in which each query sees itself and the ``window - 1`` keys before it."""
    n = positive_int("n", n)
    window = positive_int("window", window)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return (j <= i) & (j > i - window)
