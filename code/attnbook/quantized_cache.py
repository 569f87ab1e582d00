"""An int8 KV cache: keys and values stored as 8-bit integers with absmax
scales.

Absmax quantisation maps a group of numbers ``x`` to integers ``q = round(x /
s)`` with one scale ``s = max |x| / 127`` per group, so that the largest entry
lands on +-127; ``q * s`` recovers each entry to within ``s / 2``. Which
entries share a scale is the design choice:

- ``"token"``: one scale per position and head, over its ``d_head`` features. A
  new token is quantised the moment it arrives.
- ``"channel"``: one scale per feature (channel) and head, over a group of
  ``group_size`` consecutive positions. A feature with large values everywhere
  (an *outlier channel*, common in keys) then gets its own large scale instead
  of inflating the scale, and the error, of every other feature. A group can
  only be quantised once it is complete, so the newest ``< group_size``
  positions are kept in full precision until then (as KIVI does, Liu et al.
  2024).

Chapter 8 (the KV cache) shows :func:`absmax_quantize` and :class:`Int8Store`,
and measures what such a cache does to the model's output with
:mod:`attnbook.experiments.cache_quality`.
"""

from __future__ import annotations

import torch

from . import _validate
from .kv_cache import cache_shape, check_update, stored_vectors

GRANULARITIES = ("token", "channel")


def absmax_quantize(x, dim, bits: int = 8):
    """Quantise ``x`` to signed integers with one absmax scale per slice along
    ``dim``.

    x: float tensor of any shape; dim: the dimension (or tuple of dimensions)
    whose entries share a scale. Returns ``(q, scale)``: ``q`` int8 with the
    shape of ``x`` and values in ``[-qmax, qmax]``, ``qmax = 2**(bits - 1) -
    1``; ``scale`` with the dtype of ``x`` and size 1 along ``dim``, so that
    ``q * scale`` broadcasts back to ``x``'s shape. An all-zero slice gets
    scale 1 (its integers are 0, which is exact).
    """
    if not torch.is_floating_point(x):
        raise ValueError(f"x must be a floating-point tensor; got {x.dtype}")
    bits = check_bits(bits)
    qmax = 2 ** (bits - 1) - 1
    absmax = x.abs().amax(dim=dim, keepdim=True)
    scale = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
    q = torch.round(x / scale).clamp(-qmax, qmax).to(torch.int8)
    return q, scale


def check_bits(bits) -> int:
    """``bits`` as an int, or a ValueError unless it is between 2 and 8 (what
    int8 can hold)."""
    bits = _validate.positive_int("bits", bits)
    if not 2 <= bits <= 8:
        raise ValueError(
            f"bits must be between 2 and 8 to fit in int8; got {bits}"
        )
    return bits


def dequantize(q, scale, dtype=None):
    """``q * scale`` as floats: the reconstruction of what
    :func:`absmax_quantize` stored."""
    return q.to(scale.dtype if dtype is None else dtype) * scale.to(
        dtype or scale.dtype
    )


class Int8Store:
    """One quantised tensor (keys or values) of shape (batch, heads, max_len,
    d_head)."""

    def __init__(
        self,
        shape,
        granularity: str,
        group_size: int,
        bits: int,
        dtype,
        device,
    ):
        if granularity not in GRANULARITIES:
            raise ValueError(
                f"granularity must be one of {GRANULARITIES}; got "
                f"{granularity!r}"
            )
        b, h, max_len, d = shape
        self.granularity, self.group_size, self.bits, self.dtype = (
            granularity,
            group_size,
            bits,
            dtype,
        )
        self.q = torch.zeros(shape, dtype=torch.int8, device=device)
        if granularity == "token":
            self.scale = torch.zeros(
                b, h, max_len, 1, dtype=dtype, device=device
            )
        else:
            n_groups = -(-max_len // group_size)
            self.scale = torch.zeros(
                b, h, n_groups, 1, d, dtype=dtype, device=device
            )
            # full precision
            self.recent = torch.zeros(
                b, h, group_size, d, dtype=dtype, device=device
            )
        self.length = 0

    @property
    def nbytes(self) -> int:
        extra = self.recent.nbytes if self.granularity == "channel" else 0
        return self.q.nbytes + self.scale.nbytes + extra

    def append(self, x) -> None:
        """x: (batch, heads, n_new, d_head)."""
        start, end = self.length, self.length + x.shape[2]
        if self.granularity == "token":
            self.q[:, :, start:end], self.scale[:, :, start:end] = (
                absmax_quantize(x, -1, self.bits)
            )
        else:
            self._append_channel(x, start)
        self.length = end

    def _append_channel(self, x, start: int) -> None:
        g = self.group_size
        # fill the open group; quantise it when complete
        for t in range(x.shape[2]):
            pos = start + t
            self.recent[:, :, pos % g] = x[:, :, t]
            if pos % g == g - 1:
                group = pos // g
                # one scale per channel
                q, scale = absmax_quantize(self.recent, -2, self.bits)
                (
                    self.q[:, :, group * g : (group + 1) * g],
                    self.scale[:, :, group],
                ) = q, scale

    def read(self):
        """Every stored position, dequantised: (batch, heads, length,
        d_head)."""
        n = self.length
        if self.granularity == "token":
            return dequantize(
                self.q[:, :, :n], self.scale[:, :, :n], self.dtype
            )
        g = self.group_size
        n_full = n // g
        b, h, _, d = self.q.shape
        full = self.q[:, :, : n_full * g].reshape(b, h, n_full, g, d)
        done = dequantize(full, self.scale[:, :, :n_full], self.dtype).reshape(
            b, h, n_full * g, d
        )
        return torch.cat([done, self.recent[:, :, : n - n_full * g]], dim=2)


class QuantizedKVCache:
    """A drop-in replacement for :class:`attnbook.KVCache` that stores int8
    keys and values.

    ``update(k, v)`` quantises the new keys and values, stores them, and
    returns every key and value so far *dequantised* (dtype ``dtype``), so the
    attention layer that calls it computes with the reconstruction.
    ``key_granularity`` and ``value_granularity`` choose ``"token"`` or
    ``"channel"`` scales (module docstring); ``group_size`` is the number of
    positions per channel scale.
    """

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        d_head: int,
        key_granularity: str = "token",
        value_granularity: str = "token",
        group_size: int = 32,
        bits: int = 8,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        shape = cache_shape(batch, n_kv_heads, max_len, d_head)
        group_size = _validate.positive_int("group_size", group_size)
        bits = check_bits(bits)
        self.shape, self.dtype = shape, dtype
        self.keys = Int8Store(
            shape, key_granularity, group_size, bits, dtype, device
        )
        self.values = Int8Store(
            shape, value_granularity, group_size, bits, dtype, device
        )

    @property
    def length(self) -> int:
        return self.keys.length

    @property
    def max_len(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        """Memory held: the int8 tensors, their scales and (channel scales) the
        open group."""
        return self.keys.nbytes + self.values.nbytes

    def update(self, k, v):
        """Append k, v: (batch, n_kv_heads, n_new, d_head); return all keys and
        values, dequantised."""
        check_update(self.shape, self.dtype, self.length, k, v)
        self.keys.append(k)
        self.values.append(v)
        return self.keys.read(), self.values.read()

    def positions(self):
        """int64 (length,): the positions held, ``0 .. length - 1``, as
        :meth:`update` returns them."""
        return torch.arange(self.length, device=self.keys.q.device)

    def reset(self) -> None:
        self.keys.length = self.values.length = 0

    def __repr__(self) -> str:
        b, h, max_len, d = self.shape
        return (
            f"QuantizedKVCache(batch={b}, n_kv_heads={h}, max_len={max_len}, "
            f"d_head={d}, "
            f"keys={self.keys.granularity}, values={self.values.granularity}, "
            f"bits={self.keys.bits}, "
            f"length={self.length})"
        )


def new_quantized_kv_cache(
    model, batch: int = 1, max_len: int | None = None, **options
) -> list[QuantizedKVCache]:
    """One :class:`QuantizedKVCache` per layer of a
    :class:`attnbook.gpt.TinyGPT`, like its ``new_kv_cache``.

    ``options`` go to :class:`QuantizedKVCache` (granularities, ``group_size``,
    ``bits``).
    """
    return model.new_kv_cache(
        batch, max_len, cache_class=QuantizedKVCache, **options
    )


def int8_kv_cache_bytes(
    n_layers: int,
    n_kv_heads: int,
    d_head: int,
    context_length: int,
    batch: int = 1,
    scale_bytes: float = 2,
) -> int | float:
    """Bytes of an int8 KV cache with one scale per token and head (``"token"``
    granularity).

    Each of the ``2 * n_layers * batch * context_length * n_kv_heads`` stored
    vectors takes ``d_head`` bytes plus one scale of ``scale_bytes`` (2 for a
    float16 scale).
    """
    vectors = stored_vectors(n_layers, n_kv_heads, context_length, batch)
    if (
        isinstance(scale_bytes, bool)
        or not isinstance(scale_bytes, (int, float))
        or scale_bytes < 0
    ):
        raise ValueError(
            f"scale_bytes must be a non-negative number; got {scale_bytes!r}"
        )
    return vectors * (_validate.positive_int("d_head", d_head) + scale_bytes)
