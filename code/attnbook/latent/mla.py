"""Multi-head latent attention (MLA): keys and values decompressed from one
small latent per token, so that a decoder caches the latent instead of them.

DeepSeek-V2 (DeepSeek-AI 2024) projects each token ``x_t`` down to a latent
``c_t = W_DKV x_t`` of ``d_latent`` numbers (DeepSeek's ``kv_lora_rank``, 512
in DeepSeek-V2 and V3) and gets the keys and values of every head back up from
it: ``k_t^(i) = W_UK^(i) c_t``, ``v_t^(i) = W_UV^(i) c_t``. Because the
up-projections are linear, they can be moved out of the cache: a query scores
``q^(i) . W_UK^(i) c_t = (W_UK^(i)T q^(i)) . c_t`` (the *absorbed* query), and
the weighted sum of values is ``W_UV^(i)`` times the weighted sum of latents.
RoPE would put a rotation that depends on the position between ``W_UK`` and
``c_t`` and break that, so the position goes into a separate *rotary key* of
``d_rope`` numbers (``qk_rope_head_dim``, 64) that all heads share, with a
rotary part of ``d_rope`` numbers in each head's query. The queries may be
compressed too (``q_latent``, DeepSeek's ``q_lora_rank``), which saves weights
and activations in training but nothing in the cache.

:class:`MultiHeadLatentAttention` is a sibling of
:class:`attnbook.multihead.MultiHeadAttention`, built from the same pieces: its
input and mask checks, :func:`attnbook.attend` with the causal mask of
:func:`attnbook.torch_attention.with_causal`, :func:`attnbook.apply_rope`, and
a cache that follows :class:`attnbook.cache_protocol.KVCacheProtocol`
(:class:`attnbook.latent.latent_cache.LatentCache`). It runs either path: the
decompressed one (keys and values of every head formed from the latents, as for
a prompt) or the absorbed one (attention over the latents themselves, as for
one new token). Its weights load from ``transformers``' ``DeepseekV3Attention``
with :func:`from_deepseek`; ``tests/test_latent_mla.py`` checks both against
it.

Chapter 13 (latent attention and shared caches) shows
:meth:`MultiHeadLatentAttention.forward`,
:meth:`MultiHeadLatentAttention.attend_decompressed`, and
:func:`absorbed_attention` in the solution of its exercise.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import _validate
from ..multihead import check_layer_inputs, check_layer_mask
from ..positional import LAYOUTS, apply_rope
from ..torch_attention import attend, with_causal
from .latent_cache import LatentCache


def check_mla_sizes(
    d_model, n_heads, d_latent, d_rope, d_nope, d_v, q_latent
) -> tuple[int, ...]:
    """Raise unless the sizes make a latent-attention layer; return them as
    ints (``d_nope`` and ``d_v`` filled in as ``d_model // n_heads``).

    ``d_latent`` (the latent, ``d_c``) must be positive; ``d_rope`` (the
    rotary key, ``d_R``) non-negative and even, since RoPE turns features in
    pairs; ``q_latent`` None or positive.
    """
    d_model = _validate.positive_int("d_model", d_model)
    n_heads = _validate.positive_int("n_heads", n_heads)
    d_latent = _validate.int_in_range(
        "d_latent (d_c, the latent size)",
        d_latent,
        1,
        bounds="a positive integer",
    )
    d_rope = _validate.nonnegative_int("d_rope", d_rope)
    if d_rope % 2:
        raise ValueError(
            f"d_rope (d_R, the rotary key size) must be even: RoPE rotates "
            f"features in pairs; got d_rope={d_rope}"
        )
    if d_nope is None:
        if d_model % n_heads:
            raise ValueError(
                f"d_model={d_model} is not divisible by n_heads={n_heads}; "
                "give d_nope and d_v"
            )
        d_nope = d_model // n_heads
    d_nope = _validate.positive_int("d_nope", d_nope)
    d_v = d_nope if d_v is None else _validate.positive_int("d_v", d_v)
    if q_latent is not None:
        q_latent = _validate.positive_int("q_latent", q_latent)
    return d_model, n_heads, d_latent, d_rope, d_nope, d_v, q_latent


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention: a key/value latent of ``d_latent``
    numbers per token and a rotary key of ``d_rope`` numbers shared by the
    ``n_heads`` heads.

    Each head scores with a query of ``d_nope + d_rope`` features (the first
    ``d_nope`` against the keys decompressed from the latent, the last
    ``d_rope`` against the rotary key) and reads values of ``d_v`` features.
    ``q_latent`` compresses the queries through a latent of that size (None:
    one query projection). ``latent_norm`` applies RMSNorm to the latents
    (both of them), as DeepSeek-V2 and V3 do. ``rope_layout`` pairs the
    rotary features as :func:`attnbook.apply_rope` does (DeepSeek-V3:
    ``"interleaved"``). Same ``forward`` arguments as
    :class:`attnbook.MultiHeadAttention`; a cache must be a
    :class:`~attnbook.latent.latent_cache.LatentCache`
    (:meth:`new_cache`).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_latent: int,
        d_rope: int = 0,
        d_nope: int | None = None,
        d_v: int | None = None,
        q_latent: int | None = None,
        latent_norm: bool = True,
        rope_base: float = 10000.0,
        rope_layout: str = "half",
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        sizes = check_mla_sizes(
            d_model, n_heads, d_latent, d_rope, d_nope, d_v, q_latent
        )
        if rope_layout not in LAYOUTS:
            raise ValueError(
                f"rope_layout must be one of {LAYOUTS}; got {rope_layout!r}"
            )
        d_model, n_heads, d_latent, d_rope, d_nope, d_v, q_latent = sizes
        self.d_model, self.n_heads = d_model, n_heads
        self.d_latent, self.d_rope, self.d_nope, self.d_v = (
            d_latent,
            d_rope,
            d_nope,
            d_v,
        )
        self.q_latent = q_latent
        self.rope_base, self.rope_layout = float(rope_base), rope_layout
        # the scores are sums over d_nope + d_rope features
        self.scale = 1.0 / math.sqrt(d_nope + d_rope)
        d_query = n_heads * (d_nope + d_rope)
        if q_latent is None:
            self.q_proj = nn.Linear(d_model, d_query, bias=False)
        else:
            self.q_down = nn.Linear(d_model, q_latent, bias=False)
            self.q_norm = (
                nn.RMSNorm(q_latent, eps=norm_eps)
                if latent_norm
                else nn.Identity()
            )
            self.q_up = nn.Linear(q_latent, d_query, bias=False)
        # W_DKV: token -> latent c_t
        self.kv_down = nn.Linear(d_model, d_latent, bias=False)
        self.kv_norm = (
            nn.RMSNorm(d_latent, eps=norm_eps)
            if latent_norm
            else nn.Identity()
        )
        # W_KR: token -> the rotary key shared by every head
        self.k_rope = (
            nn.Linear(d_model, d_rope, bias=False) if d_rope else None
        )
        # W_UK, W_UV: latent -> keys and values of every head
        self.k_up = nn.Linear(d_latent, n_heads * d_nope, bias=False)
        self.v_up = nn.Linear(d_latent, n_heads * d_v, bias=False)
        self.out_proj = nn.Linear(n_heads * d_v, d_model, bias=False)

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None):
        """A :class:`LatentCache` for this layer: ``d_latent + d_rope`` numbers
        per position."""
        weight = self.kv_down.weight
        return LatentCache(
            batch,
            max_len,
            self.d_latent,
            self.d_rope,
            dtype=weight.dtype if dtype is None else dtype,
            device=weight.device if device is None else device,
        )

    def forward(
        self,
        x,
        context=None,
        mask=None,
        is_causal: bool = False,
        kv_cache=None,
        absorb: bool | None = None,
    ):
        """Attend from ``x`` (batch, n, d_model) to itself (or ``context``).

        mask, is_causal: as in :meth:`attnbook.MultiHeadAttention.forward`;
        kv_cache: a :class:`LatentCache` the new latents are appended to; the
        new tokens sit at the positions after those it holds.
        absorb: attend over the latents (True) or over decompressed keys and
        values (False); by default, absorbed for one new token with a cache
        (decoding), decompressed otherwise. Returns (batch, n, d_model).
        """
        b, n, m, start = self.check_forward(x, context, kv_cache)
        source = x if context is None else context
        h, d_nope = self.n_heads, self.d_nope
        # (b, h, n, d_nope + d_rope)
        q = self.queries(x).view(b, n, h, -1).transpose(1, 2)
        q_nope, q_rope = q.split([d_nope, self.d_rope], dim=-1)
        # (b, 1, m, d_latent): c_t, one latent for all heads
        latent = self.kv_norm(self.kv_down(source))[:, None]
        # (b, 1, m, d_rope): the shared rotary key, rotated to its position
        k_rope = self.rotate(self.rope_keys(source)[:, None], start)
        if kv_cache is not None:
            # (b, 1, n_k, d_latent), (b, 1, n_k, d_rope)
            latent, k_rope = kv_cache.update(latent, k_rope)
        q_rope = self.rotate(q_rope, start)
        n_k = latent.shape[2]
        mask = check_layer_mask(mask, (b, h, n, n_k), x.device)
        mask = with_causal(mask, is_causal, n, n_k, x.device)
        if absorb is None:
            absorb = kv_cache is not None and n == 1
        attend_heads = (
            self.attend_absorbed if absorb else self.attend_decompressed
        )
        # (b, h, n, d_v)
        out = attend_heads(q_nope, q_rope, latent, k_rope, mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, h * self.d_v))

    def attend_decompressed(self, q_nope, q_rope, latent, k_rope, mask=None):
        """Attention over keys and values decompressed from the latents.

        q_nope: (b, h, n, d_nope); q_rope: (b, h, n, d_rope); latent: (b, 1,
        n_k, d_latent); k_rope: (b, 1, n_k, d_rope); mask: bool, broadcastable
        to (b, h, n, n_k), or None. Returns (b, h, n, d_v).
        """
        b, _, n_k, _ = latent.shape
        h = self.n_heads
        # W_UK c_t and W_UV c_t for every head: (b, h, n_k, d_nope), (b, h,
        # n_k, d_v)
        k_nope = self.k_up(latent[:, 0]).view(b, n_k, h, -1).transpose(1, 2)
        v = self.v_up(latent[:, 0]).view(b, n_k, h, -1).transpose(1, 2)
        # each head's key: its own decompressed part, the shared rotary part
        k = torch.cat([k_nope, k_rope.expand(b, h, n_k, self.d_rope)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        return attend(q, k, v, mask, scale=self.scale)

    def attend_absorbed(self, q_nope, q_rope, latent, k_rope, mask=None):
        """The same attention over the latents themselves
        (:func:`absorbed_attention` with this layer's W_UK and W_UV).

        Arguments and result as :meth:`attend_decompressed`; no key or value
        of a head is ever formed.
        """
        h, d_latent = self.n_heads, self.d_latent
        # W_UK^(i): (h, d_nope, d_latent); W_UV^(i): (h, d_v, d_latent)
        w_uk = self.k_up.weight.view(h, self.d_nope, d_latent)
        w_uv = self.v_up.weight.view(h, self.d_v, d_latent)
        return absorbed_attention(
            q_nope, q_rope, latent, k_rope, w_uk, w_uv, self.scale, mask
        )

    def queries(self, x):
        """(b, n, d_model) -> (b, n, n_heads * (d_nope + d_rope)), through
        the query latent when there is one."""
        if self.q_latent is None:
            return self.q_proj(x)
        return self.q_up(self.q_norm(self.q_down(x)))

    def rope_keys(self, source):
        """(b, m, d_model) -> the rotary keys before rotation, (b, m,
        d_rope)."""
        if self.k_rope is None:
            return source.new_zeros(source.shape[:2] + (0,))
        return self.k_rope(source)

    def rotate(self, x, start: int):
        """RoPE on x (..., n, d_rope) at positions ``start .. start + n -
        1``."""
        if self.d_rope == 0:
            return x
        positions = torch.arange(start, start + x.shape[-2])
        return apply_rope(
            x, positions, base=self.rope_base, layout=self.rope_layout
        )

    def check_forward(self, x, context, kv_cache) -> tuple[int, int, int, int]:
        """Raise unless x, context and kv_cache fit this layer; return ``(b,
        n, m, start)``, ``start`` being the position of the first new
        token."""
        b, n, m = check_layer_inputs(x, context, self.d_model)
        if context is not None and self.d_rope:
            raise ValueError(
                "a rotary key needs self-attention (query and key positions "
                f"on one axis); got a context with d_rope={self.d_rope}"
            )
        if kv_cache is None:
            return b, n, m, 0
        if not isinstance(kv_cache, LatentCache):
            raise ValueError(
                "MultiHeadLatentAttention caches latents: kv_cache must be a "
                f"LatentCache (see new_cache); got {type(kv_cache).__name__}"
            )
        got = (kv_cache.latents.shape[0], kv_cache.latents.shape[1])
        got += (kv_cache.d_latent, kv_cache.d_rope)
        if got != (b, 1, self.d_latent, self.d_rope):
            raise ValueError(
                "kv_cache must hold (batch, n_kv_heads, d_latent, d_rope) = "
                f"({b}, 1, {self.d_latent}, {self.d_rope}); got {got}"
            )
        return b, n, m, kv_cache.length


def absorbed_attention(
    q_nope, q_rope, latent, k_rope, w_uk, w_uv, scale: float, mask=None
):
    """Latent attention with W_UK absorbed into the queries and W_UV applied
    after the weighted sum: no head's key or value is formed.

    q_nope: (b, h, n, d_nope); q_rope: (b, h, n, d_rope); latent: (b, 1, n_k,
    d_latent); k_rope: (b, 1, n_k, d_rope); w_uk: (h, d_nope, d_latent);
    w_uv: (h, d_v, d_latent); scale: that of the decompressed scores,
    ``1 / sqrt(d_nope + d_rope)``; mask: bool, broadcastable to (b, h, n,
    n_k), or None. Returns (b, h, n, d_v).
    """
    # the absorbed query W_UK^(i)T q^(i): (b, h, n, d_latent)
    q_latent = torch.einsum("bhnd,hdc->bhnc", q_nope, w_uk)
    # one key per position for all heads, [c_t, k_rope_t]: (b, 1, n_k,
    # d_latent + d_rope); the values are the latents themselves
    q = torch.cat([q_latent, q_rope], dim=-1)
    k = torch.cat([latent, k_rope], dim=-1)
    # (b, h, n, d_latent): the weighted sum of latents
    mixed = attend(q, k, latent, mask, scale=scale)
    # W_UV^(i) times it: (b, h, n, d_v)
    return torch.einsum("bhnc,hvc->bhnv", mixed, w_uv)


def from_deepseek(attention) -> MultiHeadLatentAttention:
    """A :class:`MultiHeadLatentAttention` with the weights of a
    ``transformers`` ``DeepseekV3Attention`` (or V2-style module with the same
    attributes).

    DeepSeek's ``kv_a_proj_with_mqa`` holds W_DKV and W_KR stacked (the
    latent's rows first), and ``kv_b_proj`` holds each head's W_UK and W_UV
    stacked per head. Biases (``attention_bias``) and scaled RoPE (a
    ``rope_type`` other than ``"default"``, such as DeepSeek-V3's YaRN) are
    not supported.
    """
    config = attention.config
    if getattr(config, "attention_bias", False):
        raise ValueError("attention_bias=True is not supported")
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            "only rope_type 'default' is supported (a scaled RoPE, such as "
            f"YaRN, changes the frequencies and the scale); got {rope_type!r}"
        )
    h, d_nope, d_v = (
        config.num_attention_heads,
        config.qk_nope_head_dim,
        config.v_head_dim,
    )
    d_latent, d_rope = config.kv_lora_rank, config.qk_rope_head_dim
    weight = attention.kv_a_proj_with_mqa.weight
    layer = MultiHeadLatentAttention(
        config.hidden_size,
        h,
        d_latent,
        d_rope,
        d_nope,
        d_v,
        q_latent=config.q_lora_rank,
        rope_base=config.rope_parameters["rope_theta"],
        rope_layout="interleaved" if config.rope_interleave else "half",
        norm_eps=attention.kv_a_layernorm.variance_epsilon,
    ).to(device=weight.device, dtype=weight.dtype)
    kv_b = attention.kv_b_proj.weight.view(h, d_nope + d_v, d_latent)
    with torch.no_grad():
        if config.q_lora_rank is None:
            layer.q_proj.weight.copy_(attention.q_proj.weight)
        else:
            layer.q_down.weight.copy_(attention.q_a_proj.weight)
            layer.q_norm.weight.copy_(attention.q_a_layernorm.weight)
            layer.q_up.weight.copy_(attention.q_b_proj.weight)
        layer.kv_down.weight.copy_(weight[:d_latent])
        layer.k_rope.weight.copy_(weight[d_latent:])
        layer.kv_norm.weight.copy_(attention.kv_a_layernorm.weight)
        layer.k_up.weight.copy_(kv_b[:, :d_nope].reshape(h * d_nope, -1))
        layer.v_up.weight.copy_(kv_b[:, d_nope:].reshape(h * d_v, -1))
        layer.out_proj.weight.copy_(attention.o_proj.weight)
    return layer
