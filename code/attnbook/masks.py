"""Boolean attention masks. Convention (PyTorch's): True means "may attend".

Chapter 7 (masking) shows :func:`causal_mask` and :func:`sliding_window_mask`,
and the masks of packed documents (:func:`packed_causal_mask`) and of prefix
language models (:func:`prefix_lm_mask`); the causal mask serves every causal
model of the book (chapters 6 to 13 use it), and the KV cache (chapter 8)
relies on its placing the queries last.
"""

from __future__ import annotations

import numpy as np

from ._validate import int_in_range, positive_int, queries_last


def causal_mask(n_q: int, n_k: int | None = None) -> np.ndarray:
    """Causal mask of shape (n_q, n_k).

    The queries are the *last* ``n_q`` of the ``n_k`` positions, so query ``i``
    sits at absolute position ``i + n_k - n_q`` and may attend to every key at
    or before it. With ``n_q == n_k`` this is the lower triangle including the
    diagonal; with ``n_q == 1`` (one new token in KV-cache decoding) it is a
    row of all True. PyTorch's ``is_causal`` instead aligns the queries with
    the *first* ``n_q`` keys (the upper-left triangle).
    """
    n_q, n_k = queries_last("causal_mask", n_q, n_k)
    offset = n_k - n_q
    return np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + offset


def sliding_window_mask(n: int, window: int) -> np.ndarray:
    """Causal mask (n, n) in which each query sees itself and the ``window -
    1`` keys before it."""
    n = positive_int("n", n)
    window = positive_int("window", window)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return (j <= i) & (j > i - window)


def packed_causal_mask(lengths) -> np.ndarray:
    """Causal attention within each of several documents packed into one row,
    none across them.

    lengths: the documents' lengths, in the order they are packed. Returns bool
    (n, n) with n = sum(lengths): block-diagonal, each block a causal mask.
    Training on packed rows avoids padding; without this mask a document would
    attend to the end of the one before it.
    """
    lengths = [
        positive_int("each document length", n)
        for n in np.atleast_1d(lengths).tolist()
    ]
    # (n,) which document each position is in
    document = np.repeat(np.arange(len(lengths)), lengths)
    i, j = np.arange(len(document))[:, None], np.arange(len(document))[None, :]
    return (document[:, None] == document[None, :]) & (j <= i)


def prefix_lm_mask(n: int, prefix: int) -> np.ndarray:
    """A prefix language model's mask (n, n): the first ``prefix`` positions
    see one another in both directions, every later position sees everything
    before it and itself (causal).

    The prefix (a prompt, an input to condition on) is read bidirectionally, as
    an encoder would; the continuation is generated causally, as a decoder
    would.
    """
    n = positive_int("n", n)
    prefix = int_in_range(
        "prefix", prefix, 0, n, bounds=f"an integer in [0, n={n}]"
    )
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return (j <= i) | (j < prefix)
