"""The key/value cache: generate one token at a time without recomputing the
past.

In a causal decoder the keys and values of earlier tokens never change, so each
layer keeps them and computes only the new token's. The price is memory that
grows linearly with the sequence, counted by :func:`kv_cache_bytes`.

A model with sliding-window attention (each token sees itself and the ``window
- 1`` before it) never reads a key older than the window, so
:class:`RollingKVCache` keeps only ``window`` positions and overwrites the
oldest, the rolling buffer of Mistral 7B (Jiang et al. 2023).

:class:`ConcatKVCache` grows by ``torch.cat`` instead of writing into
preallocated memory: the simplest cache, and the one chapter 8 measures the
preallocated one against.

Chapter 8 (the KV cache) shows :meth:`KVCache.update`,
:meth:`RollingKVCache.update`, :meth:`ConcatKVCache.update` and
:func:`kv_cache_bytes`; chapter 12 (grouped-query attention) sizes caches with
fewer key/value heads. The int8 cache of chapter 8,
:class:`attnbook.quantized_cache.QuantizedKVCache`, shares this module's
checks. Every cache follows :class:`attnbook.cache_protocol.KVCacheProtocol`.
"""

from __future__ import annotations

import torch

from . import _validate
from .masks import sliding_window_mask


def kv_cache_bytes(
    n_layers: int,
    n_kv_heads: int,
    d_head: int,
    context_length: int,
    batch: int = 1,
    bytes_per_element: float = 2,
) -> int | float:
    """Bytes that a full KV cache occupies.

    Every layer stores a key and a value (the factor 2) of ``d_head`` numbers
    for each of ``n_kv_heads`` heads, ``context_length`` positions and
    ``batch`` sequences: ``2 * n_layers * batch * context_length * n_kv_heads *
    d_head * bytes_per_element``. ``bytes_per_element`` is 2 for
    float16/bfloat16, 4 for float32 (0.5 for 4-bit).
    """
    vectors = stored_vectors(n_layers, n_kv_heads, context_length, batch)
    if (
        isinstance(bytes_per_element, bool)
        or not isinstance(bytes_per_element, (int, float))
        or bytes_per_element <= 0
    ):
        raise ValueError(
            "bytes_per_element must be a positive number; got "
            f"{bytes_per_element!r}"
        )
    return (
        vectors * _validate.positive_int("d_head", d_head) * bytes_per_element
    )


def stored_vectors(
    n_layers: int, n_kv_heads: int, context_length: int, batch: int = 1
) -> int:
    """How many key and value vectors a full cache holds: ``2 * n_layers *
    batch * context_length * n_kv_heads``."""
    counts = [
        _validate.positive_int(name, value)
        for name, value in (
            ("n_layers", n_layers),
            ("n_kv_heads", n_kv_heads),
            ("context_length", context_length),
            ("batch", batch),
        )
    ]
    n_layers, n_kv_heads, context_length, batch = counts
    return 2 * n_layers * batch * context_length * n_kv_heads


def cache_shape(
    batch: int, n_kv_heads: int, max_len: int, d_head: int
) -> tuple[int, int, int, int]:
    """``(batch, n_kv_heads, max_len, d_head)``, each checked to be a positive
    integer."""
    return tuple(
        _validate.positive_int(name, value)
        for name, value in (
            ("batch", batch),
            ("n_kv_heads", n_kv_heads),
            ("max_len", max_len),
            ("d_head", d_head),
        )
    )


def check_update(shape, dtype, length: int, k, v) -> None:
    """Raise unless ``k, v`` (batch, n_kv_heads, n_new, d_head) fit a cache of
    ``shape`` holding ``length`` positions of ``dtype``: the shapes, the dtype,
    and room for ``n_new`` more."""
    b, h, max_len, d = shape
    for name, t in (("k", k), ("v", v)):
        if t.ndim != 4 or tuple(t.shape[:2]) != (b, h) or t.shape[3] != d:
            raise ValueError(
                f"{name} must have shape (batch, n_kv_heads, n_new, d_head) = "
                f"({b}, {h}, n_new, {d}) to fit this cache; got "
                f"{tuple(t.shape)}"
            )
        if t.dtype != dtype:
            raise ValueError(
                f"{name} has dtype {t.dtype} but the cache holds {dtype}"
            )
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape; got k {tuple(k.shape)} and v "
            f"{tuple(v.shape)}"
        )
    if length + k.shape[2] > max_len:
        raise ValueError(
            f"KV cache overflow: it holds at most max_len={max_len} "
            "positions, "
            f"has {length}, and cannot take {k.shape[2]} more"
        )


class KVCache:
    """Keys and values of one attention layer, preallocated for ``max_len``
    positions.

    ``keys`` and ``values`` are (batch, n_kv_heads, max_len, d_head); the first
    ``length`` positions hold the tokens seen so far. A model keeps one cache
    per layer. Meant for inference (under ``torch.no_grad()``): :meth:`update`
    writes in place.
    """

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        d_head: int,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        shape = cache_shape(batch, n_kv_heads, max_len, d_head)
        # (b, n_kv_heads, max_len, d_head)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        # (b, n_kv_heads, max_len, d_head)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
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

        k, v: (batch, n_kv_heads, n_new, d_head). Returns ``(keys, values)``,
        each (batch, n_kv_heads, length, d_head), where ``length`` (also
        ``self.length`` afterwards) counts every position appended so far.
        """
        check_update(self.keys.shape, self.keys.dtype, self.length, k, v)
        start, end = self.length, self.length + k.shape[2]
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def positions(self):
        """int64 (length,): the positions held, ``0 .. length - 1``, as
        :meth:`update` returns them."""
        return torch.arange(self.length, device=self.keys.device)

    def reset(self) -> None:
        """Forget every position (the memory stays allocated)."""
        self.length = 0

    def __repr__(self) -> str:
        b, n_kv_heads, max_len, d_head = self.keys.shape
        return (
            f"KVCache(batch={b}, n_kv_heads={n_kv_heads}, max_len={max_len}, "
            f"d_head={d_head}, "
            f"length={self.length}, dtype={self.keys.dtype})"
        )


class RollingKVCache:
    """Keys and values of one layer for sliding-window attention: a ring of
    ``window`` slots.

    Position ``p`` (counted from the first token, as in :class:`KVCache`) lives
    in slot ``p % window``, so once the ring is full each new position
    overwrites the one that has just left every later query's window.
    ``length`` counts all positions seen (at most ``max_len``); memory is
    ``window`` positions whatever the length. Same constructor and ``update``
    as :class:`KVCache` plus ``window``, so ``model.new_kv_cache(cache_class=
    RollingKVCache, window=w)`` plugs it in. One new token per step needs no
    mask; a chunk of several needs :meth:`window_mask`, which the caller
    passes to the model (``model(ids, caches, start_pos,
    mask=caches[0].window_mask(n))``): the model applies only the causal mask,
    which would let the chunk's later queries see the oldest positions
    returned, outside their windows.
    """

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        d_head: int,
        window: int,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        self.shape = cache_shape(batch, n_kv_heads, max_len, d_head)
        ring = (
            batch,
            n_kv_heads,
            _validate.positive_int("window", window),
            d_head,
        )
        # (b, n_kv_heads, window, d_head)
        self.keys = torch.zeros(ring, dtype=dtype, device=device)
        # (b, n_kv_heads, window, d_head)
        self.values = torch.zeros(ring, dtype=dtype, device=device)
        self.length = 0

    @property
    def window(self) -> int:
        return self.keys.shape[2]

    @property
    def max_len(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        """Memory held by the ring: ``window`` positions, however many were
        seen."""
        return self.keys.nbytes + self.values.nbytes

    def update(self, k, v):
        """Store new keys and values; return the earlier ones still in a
        window, then the new ones.

        k, v: (batch, n_kv_heads, n_new, d_head). Returns ``(keys, values)``,
        each (batch, n_kv_heads, m + n_new, d_head) in time order, where ``m =
        min(length, window - 1)`` counts the earlier positions the first new
        query may see (``length`` before the call). With ``n_new = 1`` that is
        exactly the new token's window: itself and the ``window - 1`` before
        it.
        """
        check_update(self.shape, self.keys.dtype, self.length, k, v)
        start, n_new, w = self.length, k.shape[2], self.window
        # slots, oldest first
        held = (
            torch.arange(start - min(start, w - 1), start, device=k.device) % w
        )
        keys = torch.cat([self.keys[:, :, held], k], dim=2)
        values = torch.cat([self.values[:, :, held], v], dim=2)
        # of a long chunk, only the last w stay
        kept = min(n_new, w)
        slots = (
            torch.arange(start + n_new - kept, start + n_new, device=k.device)
            % w
        )
        self.keys[:, :, slots] = k[:, :, n_new - kept :]
        self.values[:, :, slots] = v[:, :, n_new - kept :]
        self.length = start + n_new
        return keys, values

    def window_mask(self, n_new: int):
        """Bool (n_new, min(length, window - 1) + n_new), True = may attend:
        the sliding window of the next :meth:`update`'s ``n_new`` queries over
        the keys it will return (call it before)."""
        n_new = _validate.positive_int("n_new", n_new)
        n_k = min(self.length, self.window - 1) + n_new
        return sliding_window_mask(n_k, self.window)[-n_new:]

    def positions(self):
        """int64 (min(length, window),): the positions in the ring, oldest
        first: the last ``window`` seen."""
        return torch.arange(
            self.length - min(self.length, self.window),
            self.length,
            device=self.keys.device,
        )

    def reset(self) -> None:
        """Forget every position (the memory stays allocated)."""
        self.length = 0

    def __repr__(self) -> str:
        b, n_kv_heads, _, d_head = self.shape
        return (
            f"RollingKVCache(batch={b}, n_kv_heads={n_kv_heads}, "
            f"window={self.window}, d_head={d_head}, "
            f"length={self.length}, max_len={self.max_len}, "
            f"dtype={self.keys.dtype})"
        )


class ConcatKVCache:
    """A KV cache that grows by ``torch.cat``: what :class:`KVCache` avoids.

    It follows the same protocol as :class:`KVCache`
    (:class:`attnbook.cache_protocol.KVCacheProtocol`), so a model can use
    either; it has no capacity (``max_len`` is None) and holds exactly the
    positions stored. Each update allocates a new tensor one step longer and
    copies the whole cache into it; ``bytes_copied`` counts the bytes written
    by those copies.
    """

    # no capacity: it grows for as long as memory lasts
    max_len = None

    def __init__(self):
        self.keys = self.values = None
        self.bytes_copied = 0

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Memory held by the keys and values (exactly the positions stored, no
        spare room)."""
        return (
            0 if self.keys is None else self.keys.nbytes + self.values.nbytes
        )

    def update(self, k, v):
        """Append k, v: (batch, n_kv_heads, n_new, d_head); return all keys and
        values so far."""
        if self.keys is None:
            self.keys, self.values = k.clone(), v.clone()
        else:
            # a new tensor: every old position is copied
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
        self.bytes_copied += self.keys.nbytes + self.values.nbytes
        return self.keys, self.values

    def positions(self):
        """int64 (length,): the positions held, ``0 .. length - 1``, as
        :meth:`update` returns them."""
        return torch.arange(
            self.length, device=None if self.keys is None else self.keys.device
        )

    def reset(self) -> None:
        self.keys = self.values = None
        self.bytes_copied = 0
