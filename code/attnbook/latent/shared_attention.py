"""The layer of cross-layer attention that reuses an earlier layer's keys and
values.

In cross-layer attention (Brandon et al. 2024) a layer may attend with the
keys and values that an earlier layer, its *source*, computed and cached: it
projects queries of its own and nothing else, and adds nothing to the cache.
:class:`SharedKVAttention` is that layer, a sibling of
:class:`attnbook.MultiHeadAttention` built from the same pieces (its input and
mask checks, :func:`attnbook.attend` or the fused kernel, with the causal mask
of :func:`attnbook.torch_attention.with_causal`). It reads its keys and values
from the source layer's cache through the cache protocol
(:class:`attnbook.cache_protocol.KVCacheProtocol`): an update with no new
position returns what the cache holds. :class:`attnbook.gpt.TinyGPT` builds it
for the layers its ``kv_sources`` marks as sharing
(:mod:`attnbook.latent.sharing` computes such maps).

Chapter 13 (latent attention and shared caches) trains tiny GPTs with it.
"""

from __future__ import annotations

from torch import nn

from .. import _validate
from ..multihead import check_layer_inputs, check_layer_mask
from ..torch_attention import attend, fused_attention, repeat_kv, with_causal


class SharedKVAttention(nn.Module):
    """Attention with the keys and values of an earlier layer: ``n_heads``
    queries of ``d_model // n_heads`` features, over the ``n_kv_heads``
    key/value heads that the source layer's cache holds.

    Same ``forward`` arguments as :class:`attnbook.MultiHeadAttention`, but
    ``kv_cache`` is required: it is the source layer's cache, which already
    holds the new tokens' keys and values when this layer runs.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        bias: bool = False,
        use_sdpa: bool = False,
    ):
        super().__init__()
        # the checks of MultiHeadAttention's constructor
        d_model, n_kv_heads, self.n_rep, self.d_head = _validate.head_layout(
            d_model, n_heads, n_kv_heads
        )
        self.d_model, self.n_heads, self.n_kv_heads = (
            d_model,
            n_heads,
            n_kv_heads,
        )
        self.use_sdpa = use_sdpa
        # queries and output: no key or value projection of its own
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(
        self,
        x,
        context=None,
        mask=None,
        is_causal: bool = False,
        kv_cache=None,
    ):
        """Attend from ``x`` (batch, n, d_model) to the keys and values in the
        source layer's ``kv_cache``; the n queries are its last n positions.
        Returns (batch, n, d_model)."""
        b, n, _ = check_layer_inputs(x, context, self.d_model)
        if context is not None or kv_cache is None:
            raise ValueError(
                "a layer that shares keys and values attends with its source "
                "layer's cache: give kv_cache, and no context"
            )
        h, d_head = self.n_heads, self.d_head
        # (b, h, n, d_head)
        q = self.q_proj(x).view(b, n, h, d_head).transpose(1, 2)
        # an update with no new position: every key and value the source
        # layer's cache holds, (b, n_kv_heads, n_k, d_head)
        none = q.new_zeros(b, self.n_kv_heads, 0, d_head)
        k, v = kv_cache.update(none, none)
        n_k = k.shape[2]
        mask = check_layer_mask(mask, (b, h, n, n_k), x.device)
        # the attention step of MultiHeadAttention.attention
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        if self.use_sdpa:
            out = fused_attention(q, k, v, mask, is_causal)
        else:
            out = attend(
                q, k, v, with_causal(mask, is_causal, n, n_k, x.device)
            )
        return self.out_proj(out.transpose(1, 2).reshape(b, n, h * d_head))
