"""The latent cache of multi-head latent attention: one compressed vector and
one rotary key per token, instead of a key and a value per head.

:class:`attnbook.latent.mla.MultiHeadLatentAttention` compresses each token
into a latent ``c_t`` of ``d_latent`` numbers and a rotary key of ``d_rope``
numbers that all heads share; the keys and values of every head are linear
maps of ``c_t``, so ``c_t`` and the rotary key are all a decoder must keep.
:class:`LatentCache` keeps them, preallocated like
:class:`attnbook.kv_cache.KVCache`, and follows
:class:`attnbook.cache_protocol.KVCacheProtocol`: its ``update(latent,
rope_key)`` takes the two in the places of a key and a value.

Chapter 13 (latent attention and shared caches) shows
:meth:`LatentCache.update`.
"""

from __future__ import annotations

import torch

from .. import _validate


def check_latent_update(cache, latent, rope_key) -> None:
    """Raise unless ``latent (batch, n_kv_heads, n_new, d_latent)`` and
    ``rope_key (batch, n_kv_heads, n_new, d_rope)`` fit ``cache``: shapes,
    dtype, and room for ``n_new`` more positions."""
    b, h, max_len, d_latent = cache.latents.shape
    d_rope = cache.rope_keys.shape[3]
    for name, t, d in (
        ("latent", latent, d_latent),
        ("rope_key", rope_key, d_rope),
    ):
        if t.ndim != 4 or tuple(t.shape[:2]) != (b, h) or t.shape[3] != d:
            raise ValueError(
                f"{name} must have shape (batch, n_kv_heads, n_new, "
                f"{'d_latent' if name == 'latent' else 'd_rope'}) = "
                f"({b}, {h}, n_new, {d}) to fit this cache; got "
                f"{tuple(t.shape)}"
            )
        if t.dtype != cache.latents.dtype:
            raise ValueError(
                f"{name} has dtype {t.dtype} but the cache holds "
                f"{cache.latents.dtype}"
            )
    if latent.shape[2] != rope_key.shape[2]:
        raise ValueError(
            "latent and rope_key must hold the same positions; got latent "
            f"{tuple(latent.shape)} and rope_key {tuple(rope_key.shape)}"
        )
    if cache.length + latent.shape[2] > max_len:
        raise ValueError(
            f"latent cache overflow: it holds at most max_len={max_len} "
            f"positions, has {cache.length}, and cannot take "
            f"{latent.shape[2]} more"
        )


class LatentCache:
    """Latents and rotary keys of one latent-attention layer, preallocated for
    ``max_len`` positions.

    ``latents`` is (batch, n_kv_heads, max_len, d_latent) and ``rope_keys``
    (batch, n_kv_heads, max_len, d_rope); ``n_kv_heads`` is 1 for
    multi-head latent attention (one latent serves every head). ``d_rope``
    may be 0 (no rotary key). Meant for inference: :meth:`update` writes in
    place.
    """

    def __init__(
        self,
        batch: int,
        max_len: int,
        d_latent: int,
        d_rope: int,
        n_kv_heads: int = 1,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        shape = tuple(
            _validate.positive_int(name, value)
            for name, value in (
                ("batch", batch),
                ("n_kv_heads", n_kv_heads),
                ("max_len", max_len),
                ("d_latent", d_latent),
            )
        )
        d_rope = _validate.nonnegative_int("d_rope", d_rope)
        # (b, n_kv_heads, max_len, d_latent)
        self.latents = torch.zeros(shape, dtype=dtype, device=device)
        # (b, n_kv_heads, max_len, d_rope)
        self.rope_keys = torch.zeros(
            shape[:3] + (d_rope,), dtype=dtype, device=device
        )
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.latents.shape[2]

    @property
    def d_latent(self) -> int:
        return self.latents.shape[3]

    @property
    def d_rope(self) -> int:
        return self.rope_keys.shape[3]

    @property
    def nbytes(self) -> int:
        """Memory held by the preallocated latents and rotary keys."""
        return self.latents.nbytes + self.rope_keys.nbytes

    def update(self, latent, rope_key):
        """Append new latents and rotary keys; return all of them so far.

        latent: (batch, n_kv_heads, n_new, d_latent); rope_key: (batch,
        n_kv_heads, n_new, d_rope), already rotated to its position. Returns
        ``(latents, rope_keys)`` of the ``length`` positions appended so far.
        """
        check_latent_update(self, latent, rope_key)
        start, end = self.length, self.length + latent.shape[2]
        self.latents[:, :, start:end] = latent
        self.rope_keys[:, :, start:end] = rope_key
        self.length = end
        return self.latents[:, :, :end], self.rope_keys[:, :, :end]

    def positions(self):
        """int64 (length,): the positions held, ``0 .. length - 1``."""
        return torch.arange(self.length, device=self.latents.device)

    def reset(self) -> None:
        """Forget every position (the memory stays allocated)."""
        self.length = 0

    def __repr__(self) -> str:
        b, h, max_len, d_latent = self.latents.shape
        return (
            f"LatentCache(batch={b}, max_len={max_len}, "
            f"d_latent={d_latent}, d_rope={self.d_rope}, n_kv_heads={h}, "
            f"length={self.length}, dtype={self.latents.dtype})"
        )
