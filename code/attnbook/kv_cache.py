"""The key/value cache: generate one token at a time without recomputing the past.

In a causal decoder the keys and values of earlier tokens never change, so each
layer keeps them and computes only the new token's. The price is memory that
grows linearly with the sequence, counted by :func:`kv_cache_bytes`.
"""
from __future__ import annotations

import torch

from . import _validate


def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int,
                   batch: int = 1, bytes_per_element: float = 2) -> int | float:
    """Bytes that a full KV cache occupies.

    Every layer stores a key and a value (the factor 2) of ``head_dim`` numbers for each
    of ``n_kv_heads`` heads, ``seq_len`` positions and ``batch`` sequences:
    ``2 * n_layers * batch * seq_len * n_kv_heads * head_dim * bytes_per_element``.
    ``bytes_per_element`` is 2 for float16/bfloat16, 4 for float32 (0.5 for 4-bit).
    """
    counts = [_validate.positive_int(name, value) for name, value in (
        ("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
        ("seq_len", seq_len), ("batch", batch))]
    if isinstance(bytes_per_element, bool) or not isinstance(bytes_per_element, (int, float)) \
            or bytes_per_element <= 0:
        raise ValueError(f"bytes_per_element must be a positive number; got {bytes_per_element!r}")
    n_layers, n_kv_heads, head_dim, seq_len, batch = counts
    return 2 * n_layers * batch * seq_len * n_kv_heads * head_dim * bytes_per_element


class KVCache:
    """Keys and values of one attention layer, preallocated for ``max_len`` positions.

    ``keys`` and ``values`` are (batch, n_kv_heads, max_len, head_dim); the first
    ``length`` positions hold the tokens seen so far. A model keeps one cache per layer.
    Meant for inference (under ``torch.no_grad()``): :meth:`update` writes in place.
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device=None):
        shape = tuple(_validate.positive_int(name, value) for name, value in (
            ("batch", batch), ("n_kv_heads", n_kv_heads), ("max_len", max_len), ("head_dim", head_dim)))
        self.keys = torch.zeros(shape, dtype=dtype, device=device)    # (b, h_kv, max_len, d_head)
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # (b, h_kv, max_len, d_head)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Memory held by the preallocated keys and values, filled or not."""
        return self.keys.nbytes + self.values.nbytes

    def update(self, k, v):
        """Append new keys and values; return all of them so far.

        k, v: (batch, n_kv_heads, n_new, head_dim).
        Returns ``(keys, values)``, each (batch, n_kv_heads, length, head_dim), where
        ``length`` (also ``self.length`` afterwards) counts every position appended so far.
        """
        self._check(k, v)
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: it holds at most max_len={self.max_len} positions, "
                             f"has {start}, and cannot take {k.shape[2]} more")
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def reset(self) -> None:
        """Forget every position (the memory stays allocated)."""
        self.length = 0

    def _check(self, k, v) -> None:
        expected = (self.keys.shape[0], self.keys.shape[1], "n_new", self.keys.shape[3])
        for name, t in (("k", k), ("v", v)):
            if t.ndim != 4 or t.shape[:2] != self.keys.shape[:2] or t.shape[3] != self.keys.shape[3]:
                raise ValueError(f"{name} must have shape (batch, n_kv_heads, n_new, head_dim) = "
                                 f"{expected} to fit this cache; got {tuple(t.shape)}")
            if t.dtype != self.keys.dtype:
                raise ValueError(f"{name} has dtype {t.dtype} but the cache holds {self.keys.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)} and v {tuple(v.shape)}")

    def __repr__(self) -> str:
        b, h_kv, max_len, d_head = self.keys.shape
        return (f"KVCache(batch={b}, n_kv_heads={h_kv}, max_len={max_len}, head_dim={d_head}, "
                f"length={self.length}, dtype={self.keys.dtype})")
