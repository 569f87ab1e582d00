"""Padding masks: attention over a batch of sequences of unequal lengths.

A batch is a rectangular array, so shorter sequences are filled up to the
longest with padding positions. Padding must not change the result for the real
tokens: no real query may attend to a padding *key*. Convention (PyTorch's):
True means "may attend". ``side="right"`` puts the real tokens first and the
padding after them (the usual layout for training and encoders);
``side="left"`` puts the padding first (the usual layout for batched
generation, where every sequence must end at the same column).

Chapter 7 (masking) shows :func:`padding_mask`, :func:`key_padding_mask` and
:func:`padded_causal_mask`.
"""

from __future__ import annotations

import numpy as np

from ._validate import positive_int
from .masks import causal_mask

_SIDES = ("right", "left")


def _check_lengths(lengths, n: int) -> np.ndarray:
    """``lengths`` as a 1-D int array with every entry in ``0..n``, or a
    ValueError."""
    n = positive_int("n", n)
    arr = np.asarray(lengths)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(
            "lengths must be a non-empty 1-D sequence (one length per "
            "sequence); "
            f"got shape {arr.shape}"
        )
    if not (
        np.issubdtype(arr.dtype, np.integer)
        or (arr.dtype.kind == "f" and np.all(arr == np.round(arr)))
    ):
        raise ValueError(f"lengths must be integers; got {arr.tolist()}")
    arr = arr.astype(np.int64)
    if arr.min() < 0 or arr.max() > n:
        raise ValueError(
            f"every length must lie in 0..n={n} (n is the padded length); got "
            f"{arr.tolist()}"
        )
    return arr


def padding_mask(lengths, n: int, side: str = "right") -> np.ndarray:
    """Which positions of a padded batch hold real tokens.

    lengths: (batch,) ints in ``0..n``; n: the padded length. Returns bool
    (batch, n): ``True`` at the ``lengths[b]`` real tokens of sequence ``b``,
    ``False`` at its padding (at the end for ``side="right"``, at the start for
    ``"left"``).
    """
    lengths = _check_lengths(lengths, n)
    if side not in _SIDES:
        raise ValueError(f"side must be 'right' or 'left'; got {side!r}")
    j = np.arange(n)[None, :]
    if side == "right":
        return j < lengths[:, None]
    return j >= n - lengths[:, None]


def key_padding_mask(
    lengths, n_k: int, side: str = "right", head_axis: bool = False
) -> np.ndarray:
    """Attention mask that hides padding *keys* from every query.

    Returns bool (batch, 1, n_k), which broadcasts to scores (batch, n_q, n_k);
    with ``head_axis=True`` it is (batch, 1, 1, n_k), for scores (batch, heads,
    n_q, n_k). Padding queries still attend to the real keys, so no row is
    fully masked (unless a sequence has length 0); their outputs are
    meaningless and are ignored downstream.
    """
    # (batch, 1, n_k)
    mask = padding_mask(lengths, n_k, side)[:, None, :]
    return mask[:, None] if head_axis else mask


def query_padding_mask(
    lengths, n_q: int, side: str = "right", head_axis: bool = False
) -> np.ndarray:
    """Mask that is False on the rows of padding *queries*: bool (batch, n_q,
    1).

    With ``head_axis=True``: (batch, 1, n_q, 1). Combined with a key padding
    mask (``&``) it leaves every padding row fully masked; used alone it hides
    nothing that matters, because a real query's row is entirely True. Useful
    to zero the outputs of padding positions, rarely as an attention mask.
    """
    # (batch, n_q, 1)
    mask = padding_mask(lengths, n_q, side)[:, :, None]
    return mask[:, None] if head_axis else mask


def padded_causal_mask(
    lengths, n: int, side: str = "right", head_axis: bool = False
) -> np.ndarray:
    """Causal self-attention mask for a padded batch: causal AND key padding.

    Returns bool (batch, n, n), or (batch, 1, n, n) with ``head_axis=True``.
    With ``side="left"`` the padding queries at the start see only padding
    keys: their rows are fully masked (see :func:`fully_masked_rows`).
    """
    # (batch, n, n)
    mask = causal_mask(n)[None] & key_padding_mask(lengths, n, side)
    return mask[:, None] if head_axis else mask


def fully_masked_rows(mask) -> np.ndarray:
    """Queries that may attend to no key at all: mask (..., n_q, n_k) -> bool
    (..., n_q)."""
    mask = np.asarray(mask)
    if mask.dtype != bool or mask.ndim < 2:
        raise ValueError(
            f"mask must be a boolean array (..., n_q, n_k); got {mask.dtype} "
            f"{mask.shape}"
        )
    return ~mask.any(axis=-1)


def pad_sequences(
    sequences, n: int | None = None, side: str = "right", value: float = 0.0
):
    """Stack sequences of unequal lengths into one padded array.

    sequences: a list of arrays ``(length_b, *features)`` sharing ``features``;
    n: the padded length, default the longest length. Returns ``(padded (batch,
    n, *features), lengths (batch,))``; padding holds ``value``.
    """
    seqs = [np.asarray(s) for s in sequences]
    if not seqs:
        raise ValueError("pad_sequences needs at least one sequence")
    features = {s.shape[1:] for s in seqs}
    if any(s.ndim == 0 for s in seqs) or len(features) != 1:
        raise ValueError(
            "sequences must be arrays (length, *features) with the same "
            "features; "
            f"got shapes {[s.shape for s in seqs]}"
        )
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    n = int(lengths.max()) if n is None else n
    # validates n and the lengths
    real = padding_mask(lengths, n, side)
    dtype = np.result_type(*seqs, np.asarray(value))
    out = np.full((len(seqs), n, *features.pop()), value, dtype=dtype)
    for b, s in enumerate(seqs):
        out[b, real[b]] = s
    return out, lengths
