"""An int8 KV cache: keys and values stored as 8-bit integers with absmax scales.

Absmax quantisation maps a group of numbers ``x`` to integers ``q = round(x / s)``
with one scale ``s = max |x| / 127`` per group, so that the largest entry lands on
+-127; ``q * s`` recovers each entry to within ``s / 2``. Which entries share a scale
is the design choice:

- ``"token"``: one scale per position and head, over its ``head_dim`` features. A new
  token is quantised the moment it arrives.
- ``"channel"``: one scale per feature (channel) and head, over a group of
  ``group_size`` consecutive positions. A feature with large values everywhere (an
  *outlier channel*, common in keys) then gets its own large scale instead of
  inflating the scale, and the error, of every other feature. A group can only be
  quantised once it is complete, so the newest ``< group_size`` positions are kept
  in full precision until then (as KIVI does, Liu et al. 2024).

Chapter 8 measures what such a cache does to the model's output (:func:`compare_caches`). Which
entries land exactly between two integers, and so round up or down, depends on the last bits of the
keys and values, which differ between CPUs; the errors therefore move a little from one machine to
another, and the top-1 choice flips only where two characters were nearly tied. The chapter's
checked claims are phrased so that they do not depend on that (:meth:`CacheComparison.top1_kept`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import _validate
from .decoding import recording_attention_outputs, teacher_forced_logits
from .seeds import TooCloseToCall

GRANULARITIES = ("token", "channel")


def absmax_quantize(x, dim, bits: int = 8):
    """Quantise ``x`` to signed integers with one absmax scale per slice along ``dim``.

    x: float tensor of any shape; dim: the dimension (or tuple of dimensions) whose
    entries share a scale. Returns ``(q, scale)``: ``q`` int8 with the shape of ``x`` and
    values in ``[-qmax, qmax]``, ``qmax = 2**(bits - 1) - 1``; ``scale`` with the dtype of
    ``x`` and size 1 along ``dim``, so that ``q * scale`` broadcasts back to ``x``'s shape.
    An all-zero slice gets scale 1 (its integers are 0, which is exact).
    """
    if not torch.is_floating_point(x):
        raise ValueError(f"x must be a floating-point tensor; got {x.dtype}")
    bits = _validate.positive_int("bits", bits)
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be between 2 and 8 to fit in int8; got {bits}")
    qmax = 2 ** (bits - 1) - 1
    absmax = x.abs().amax(dim=dim, keepdim=True)
    scale = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
    q = torch.round(x / scale).clamp(-qmax, qmax).to(torch.int8)
    return q, scale


def dequantize(q, scale, dtype=None):
    """``q * scale`` as floats: the reconstruction of what :func:`absmax_quantize` stored."""
    return q.to(scale.dtype if dtype is None else dtype) * scale.to(dtype or scale.dtype)


class _Int8Store:
    """One quantised tensor (keys or values) of shape (batch, heads, max_len, head_dim)."""

    def __init__(self, shape, granularity: str, group_size: int, bits: int, dtype, device):
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}; got {granularity!r}")
        b, h, max_len, d = shape
        self.granularity, self.group_size, self.bits, self.dtype = granularity, group_size, bits, dtype
        self.q = torch.zeros(shape, dtype=torch.int8, device=device)
        if granularity == "token":
            self.scale = torch.zeros(b, h, max_len, 1, dtype=dtype, device=device)
        else:
            n_groups = -(-max_len // group_size)
            self.scale = torch.zeros(b, h, n_groups, 1, d, dtype=dtype, device=device)
            self.recent = torch.zeros(b, h, group_size, d, dtype=dtype, device=device)  # full precision
        self.length = 0

    @property
    def nbytes(self) -> int:
        extra = self.recent.nbytes if self.granularity == "channel" else 0
        return self.q.nbytes + self.scale.nbytes + extra

    def append(self, x) -> None:
        """x: (batch, heads, n_new, head_dim)."""
        start, end = self.length, self.length + x.shape[2]
        if self.granularity == "token":
            self.q[:, :, start:end], self.scale[:, :, start:end] = absmax_quantize(x, -1, self.bits)
        else:
            self._append_channel(x, start)
        self.length = end

    def _append_channel(self, x, start: int) -> None:
        g = self.group_size
        for t in range(x.shape[2]):                 # fill the open group; quantise it when complete
            pos = start + t
            self.recent[:, :, pos % g] = x[:, :, t]
            if pos % g == g - 1:
                group = pos // g
                q, scale = absmax_quantize(self.recent, -2, self.bits)     # one scale per channel
                self.q[:, :, group * g:(group + 1) * g], self.scale[:, :, group] = q, scale

    def read(self):
        """Every stored position, dequantised: (batch, heads, length, head_dim)."""
        n = self.length
        if self.granularity == "token":
            return dequantize(self.q[:, :, :n], self.scale[:, :, :n], self.dtype)
        g = self.group_size
        n_full = n // g
        b, h, _, d = self.q.shape
        full = self.q[:, :, :n_full * g].reshape(b, h, n_full, g, d)
        done = dequantize(full, self.scale[:, :, :n_full], self.dtype).reshape(b, h, n_full * g, d)
        return torch.cat([done, self.recent[:, :, :n - n_full * g]], dim=2)


class QuantizedKVCache:
    """A drop-in replacement for :class:`attnbook.KVCache` that stores int8 keys and values.

    ``update(k, v)`` quantises the new keys and values, stores them, and returns every
    key and value so far *dequantised* (dtype ``dtype``), so the attention layer that
    calls it computes with the reconstruction. ``key_granularity`` and
    ``value_granularity`` choose ``"token"`` or ``"channel"`` scales (module docstring);
    ``group_size`` is the number of positions per channel scale.
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 key_granularity: str = "token", value_granularity: str = "token",
                 group_size: int = 32, bits: int = 8, dtype: torch.dtype = torch.float32, device=None):
        shape = tuple(_validate.positive_int(name, value) for name, value in (
            ("batch", batch), ("n_kv_heads", n_kv_heads), ("max_len", max_len), ("head_dim", head_dim)))
        group_size = _validate.positive_int("group_size", group_size)
        bits = _validate.positive_int("bits", bits)
        if not 2 <= bits <= 8:
            raise ValueError(f"bits must be between 2 and 8 to fit in int8; got {bits}")
        self.shape, self.dtype = shape, dtype
        self.keys = _Int8Store(shape, key_granularity, group_size, bits, dtype, device)
        self.values = _Int8Store(shape, value_granularity, group_size, bits, dtype, device)

    @property
    def length(self) -> int:
        return self.keys.length

    @property
    def max_len(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        """Memory held: the int8 tensors, their scales and (channel scales) the open group."""
        return self.keys.nbytes + self.values.nbytes

    def update(self, k, v):
        """Append k, v: (batch, n_kv_heads, n_new, head_dim); return all keys and values, dequantised."""
        self._check(k, v)
        if self.length + k.shape[2] > self.max_len:
            raise ValueError(f"KV cache overflow: it holds at most max_len={self.max_len} positions, "
                             f"has {self.length}, and cannot take {k.shape[2]} more")
        self.keys.append(k)
        self.values.append(v)
        return self.keys.read(), self.values.read()

    def reset(self) -> None:
        self.keys.length = self.values.length = 0

    def _check(self, k, v) -> None:
        b, h, _, d = self.shape
        for name, t in (("k", k), ("v", v)):
            if t.ndim != 4 or tuple(t.shape[:2]) != (b, h) or t.shape[3] != d:
                raise ValueError(f"{name} must have shape (batch, n_kv_heads, n_new, head_dim) = "
                                 f"({b}, {h}, n_new, {d}) to fit this cache; got {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise ValueError(f"{name} has dtype {t.dtype} but the cache holds {self.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)} and v {tuple(v.shape)}")

    def __repr__(self) -> str:
        b, h, max_len, d = self.shape
        return (f"QuantizedKVCache(batch={b}, n_kv_heads={h}, max_len={max_len}, head_dim={d}, "
                f"keys={self.keys.granularity}, values={self.values.granularity}, bits={self.keys.bits}, "
                f"length={self.length})")


def new_quantized_kv_cache(model, batch: int = 1, max_len: int | None = None, **options) -> list[QuantizedKVCache]:
    """One :class:`QuantizedKVCache` per layer of a :class:`attnbook.gpt.TinyGPT`, like its ``new_kv_cache``.

    ``options`` go to :class:`QuantizedKVCache` (granularities, ``group_size``, ``bits``).
    """
    cfg = model.config
    max_len = cfg.block_size if max_len is None else _validate.positive_int("max_len", max_len)
    if max_len > cfg.block_size:
        raise ValueError(f"max_len={max_len} exceeds block_size={cfg.block_size}")
    weight = model.tok_emb.weight
    return [QuantizedKVCache(batch, cfg.kv_heads, max_len, cfg.d_model // cfg.n_heads, dtype=weight.dtype,
                             device=weight.device, **options) for _ in range(cfg.n_layers)]


def int8_kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int, batch: int = 1,
                        scale_bytes: float = 2) -> int | float:
    """Bytes of an int8 KV cache with one scale per token and head (``"token"`` granularity).

    Each of the ``2 * n_layers * batch * seq_len * n_kv_heads`` stored vectors takes
    ``head_dim`` bytes plus one scale of ``scale_bytes`` (2 for a float16 scale).
    """
    counts = [_validate.positive_int(name, value) for name, value in (
        ("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
        ("seq_len", seq_len), ("batch", batch))]
    if isinstance(scale_bytes, bool) or not isinstance(scale_bytes, (int, float)) or scale_bytes < 0:
        raise ValueError(f"scale_bytes must be a non-negative number; got {scale_bytes!r}")
    n_layers, n_kv_heads, head_dim, seq_len, batch = counts
    return 2 * n_layers * batch * seq_len * n_kv_heads * (head_dim + scale_bytes)


# ---- what a cache does to the model's output ----------------------------------------------------

def top2_margin(logits):
    """Largest minus second-largest logit along the last dimension: how far the top-1 choice is from a tie."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def run_with_caches(model, ids, caches, one_pass: bool = True):
    """Logits and each layer's attention output for ``ids`` (batch, n), run through ``caches``.

    ``one_pass``: a single prefill over all of ``ids``; otherwise token by token
    (:func:`attnbook.decoding.teacher_forced_logits`), as generation feeds the cache.
    Returns ``(logits (batch, n, vocab), [attention output (batch, n, d_model) per layer])``.
    """
    with torch.inference_mode(), recording_attention_outputs(model) as recorded:
        logits = model(ids, caches) if one_pass else teacher_forced_logits(model, ids, caches)
    return logits, [torch.cat(r, dim=1) for r in recorded]


@dataclass(frozen=True)
class CacheComparison:
    """A cache's run against the exact cache's run on the same tokens; one row per sequence.

    attention: (batch, n_layers), ``||a - a_exact|| / ||a_exact||`` of each layer's attention output;
    max_dlogit: (batch,), the largest ``|logit - exact logit|``; kl: (batch,), the mean over positions
    of ``KL(p_exact || p)`` in nats; exact_margin: (batch, n), the exact run's :func:`top2_margin`;
    kept_margin: (batch, n), the cache run's logit of the exact top-1 character minus its largest
    other logit: positive where the top-1 choice is kept, negative where it flipped.
    """

    attention: np.ndarray
    max_dlogit: np.ndarray
    kl: np.ndarray
    exact_margin: np.ndarray
    kept_margin: np.ndarray

    @property
    def same_top1(self) -> np.ndarray:
        """(batch, n) bool: the cache's most likely next token is the exact one's."""
        return self.kept_margin > 0

    @property
    def flips(self) -> np.ndarray:
        """(batch,) how many positions changed their top-1 token."""
        return (~self.same_top1).sum(axis=-1)

    def top1_kept(self, min_exact_margin: float, margin: float = 0.0) -> bool:
        """Whether the top-1 token is kept at every position whose exact top-2 margin exceeds
        ``min_exact_margin``. Raises :class:`attnbook.seeds.TooCloseToCall` if at such a position the
        cache's ``kept_margin`` lies within ``margin`` of 0: which way that one goes is rounding."""
        kept = self.kept_margin[self.exact_margin > min_exact_margin]
        near = kept[np.abs(kept) < margin]
        if near.size:
            raise TooCloseToCall(f"{near.size} position(s) with an exact margin above {min_exact_margin} keep "
                                 f"their top-1 by only {near.tolist()}, within {margin} of a flip")
        return bool((kept > 0).all())


def compare_caches(run, exact) -> CacheComparison:
    """Compare two :func:`run_with_caches` results, ``run`` against ``exact`` (same ids)."""
    (logits, attn), (exact_logits, exact_attn) = run, exact
    if logits.shape != exact_logits.shape or len(attn) != len(exact_attn):
        raise ValueError(f"the runs differ in shape: {tuple(logits.shape)} and {tuple(exact_logits.shape)}")
    attention = np.stack([((a - e).flatten(1).norm(dim=1) / e.flatten(1).norm(dim=1)).numpy()
                          for a, e in zip(attn, exact_attn)], axis=1)                    # (batch, layers)
    log_p, log_q = exact_logits.log_softmax(-1), logits.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean(-1)                             # (batch,)
    top = exact_logits.argmax(-1, keepdim=True)                                       # (batch, n, 1)
    chosen = logits.gather(-1, top)[..., 0]
    others = logits.scatter(-1, top, float("-inf")).amax(-1)
    return CacheComparison(
        attention=attention,
        max_dlogit=(logits - exact_logits).abs().flatten(1).amax(1).numpy(),
        kl=kl.numpy(),
        exact_margin=top2_margin(exact_logits).numpy(),
        kept_margin=(chosen - others).numpy())


def first_difference(ids, exact_ids, n_prompt: int) -> np.ndarray:
    """(batch,) index of the first generated token where ``ids`` leaves ``exact_ids`` (both (batch,
    n_prompt + n_new)); ``n_new`` where they agree throughout."""
    same = (ids == exact_ids)[:, n_prompt:]
    n_new = same.shape[1]
    return np.array([int((~row).nonzero()[0]) if not bool(row.all()) else n_new for row in same])
