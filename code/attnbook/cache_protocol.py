"""The interface of a KV cache: what an attention layer and a model may ask of
the cache they are given.

:class:`attnbook.MultiHeadAttention` takes one cache (``kv_cache=``) and the
tiny GPT (:class:`attnbook.gpt.TinyGPT`) one per layer; they call ``update``
and read ``length``, and the caches of chapter 8
(:class:`attnbook.kv_cache.KVCache`, :class:`attnbook.kv_cache.RollingKVCache`,
:class:`attnbook.kv_cache.ConcatKVCache`,
:class:`attnbook.quantized_cache.QuantizedKVCache`) answer the rest: how much
they hold and may hold, what it costs in memory, and which positions they hold.
:class:`KVCacheProtocol` writes that down once. A new cache (paged, latent, one
that evicts) follows
it: ``tests/test_cache_protocol.py`` finds every cache class of the package and
checks each against it.

No single chapter shows this module; chapter 8 (the KV cache) builds the caches
that follow it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

# annotations only: the protocol itself needs no torch
if TYPE_CHECKING:
    import torch


@runtime_checkable
class KVCacheProtocol(Protocol):
    """Keys and values of one attention layer, kept from one forward pass to
    the next.

    Positions are counted from the first one the cache was given (or the last
    :meth:`reset`): ``0, 1, ..., length - 1``. Keys and values are (batch,
    n_kv_heads, positions, d_head). A cache is built the way
    :meth:`attnbook.gpt.TinyGPT.new_kv_cache` builds one, with those of
    ``batch, n_kv_heads, max_len, d_head, dtype, device`` that it needs, by
    name, and its own options; ``isinstance(cache, KVCacheProtocol)`` checks
    that the members below exist.
    """

    @property
    def length(self) -> int:
        """How many positions have been appended, those the cache has since
        dropped included."""

    @property
    def max_len(self) -> int | None:
        """Capacity: how many positions :meth:`update` accepts in all before it
        refuses with a ``ValueError`` (and stays as it was); None for a cache
        without a limit."""

    @property
    def nbytes(self) -> int:
        """Bytes of memory the cache holds now: every tensor it keeps, filled
        or not."""

    def update(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (batch, n_kv_heads, n_new, d_head), positions ``length
        .. length + n_new - 1``.

        Returns the keys and values the new queries attend to, each (batch,
        n_kv_heads, n_k, d_head) in order of position, the ``n_new`` new ones
        last (a lossy cache returns its reconstruction). After an update of one
        position, they are exactly the positions of :meth:`positions`.
        """

    def positions(self) -> torch.Tensor:
        """int64 (n_held,), increasing: the positions whose keys and values the
        cache holds now; the newest, ``length - 1``, is always among them."""

    def reset(self) -> None:
        """Forget every position: ``length`` 0, no positions held."""
