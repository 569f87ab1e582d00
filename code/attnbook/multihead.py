"""Multi-head attention in torch: several heads attend side by side, each in
its own subspace.

Chapter 5 (multi-head attention) builds this layer and shows
:meth:`MultiHeadAttention.forward`; chapter 8 (the KV cache) shows it again
with a cache; chapter 12 (grouped-query attention) gives it fewer key/value
heads. The tiny GPT (:mod:`attnbook.gpt`) and the MiniLM encoder
(:mod:`attnbook.encoder`) are built from it.

A layer projects the tokens to ``n_heads`` queries and ``n_kv_heads`` keys and
values per token, lets every head attend independently, concatenates the heads
and mixes them with one output projection. ``n_kv_heads == n_heads`` is the
multi-head attention of Vaswani et al. (2017); fewer key/value heads, each
shared by a contiguous group of query heads, is grouped-query attention (GQA),
and a single one is multi-query attention (MQA).

The attention step itself is one method, :meth:`MultiHeadAttention.attention`:
a variant overrides it and inherits the projections, the heads, the masks and
the KV cache (:class:`attnbook.gqa.GroupedQueryAttention` shares key/value
heads without copying them; the chapter-6 models add RoPE or ALiBi). Set
``keep_weights`` (or use :func:`keeping_weights`) and the layer keeps the
attention weights it used, for analysis.

Masks are boolean with ``True`` = may attend. A causal mask places the queries
at the *last* ``n_q`` of the ``n_k`` key positions
(:func:`attnbook.causal_mask`), so the same layer serves a whole prompt and one
new token during KV-cache decoding.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import _validate
from .torch_attention import attend, fused_attention, repeat_kv, with_causal


class MultiHeadAttention(nn.Module):
    """Multi-head (``n_kv_heads=None``), grouped-query or multi-query
    (``n_kv_heads=1``) attention.

    ``d_model`` is split into ``n_heads`` heads of ``d_head = d_model //
    n_heads`` features. With ``use_sdpa=True`` the attention itself runs in
    ``torch.nn.functional.scaled_dot_product_attention`` wherever that gives
    the same result as :func:`attnbook.attend` (everywhere except rows that are
    fully masked). With ``keep_weights = True`` every call stores the attention
    weights it used in ``self.weights`` (batch, n_heads, n, n_k), and always
    runs :func:`attnbook.attend`.
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
        d_model = _validate.positive_int("d_model", d_model)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        # query heads per key/value head
        self.n_rep = _validate.group_size(n_heads, n_kv_heads)
        if d_model % n_heads:
            raise ValueError(
                f"d_model={d_model} is not divisible by n_heads={n_heads}"
            )
        self.d_model, self.n_heads, self.n_kv_heads = (
            d_model,
            n_heads,
            n_kv_heads,
        )
        self.d_head = d_model // n_heads
        self.use_sdpa = use_sdpa
        self.keep_weights, self.weights = False, None
        self.q_proj = nn.Linear(d_model, n_heads * self.d_head, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.d_head, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.d_head, bias=bias)
        self.out_proj = nn.Linear(n_heads * self.d_head, d_model, bias=bias)

    def forward(
        self,
        x,
        context=None,
        mask=None,
        is_causal: bool = False,
        kv_cache=None,
    ):
        """Attend from ``x`` to itself, or to ``context`` (cross-attention).

        x: (batch, n, d_model); context: (batch, m, d_model), default ``x``;
        mask: bool, broadcastable to (batch, n_heads, n, n_k), True = may
        attend, where ``n_k`` is ``m`` plus the positions already in
        ``kv_cache``;
        is_causal: the n queries are the last n of the n_k keys and see none
        after them;
        kv_cache: a :class:`attnbook.KVCache` that the new keys and values are
        appended to. Returns (batch, n, d_model).
        """
        b, n, m = self._check_inputs(x, context)
        source = x if context is None else context
        h, n_kv_heads, d_head = self.n_heads, self.n_kv_heads, self.d_head
        # Split the features into heads, then move heads next to batch: (b,
        # heads, tokens, d_head). (b, h, n, d_head)
        q = self.q_proj(x).view(b, n, h, d_head).transpose(1, 2)
        # (b, n_kv_heads, m, d_head)
        k = self.k_proj(source).view(b, m, n_kv_heads, d_head).transpose(1, 2)
        # (b, n_kv_heads, m, d_head)
        v = self.v_proj(source).view(b, m, n_kv_heads, d_head).transpose(1, 2)
        if kv_cache is not None:
            # (b, n_kv_heads, n_k, d_head)
            k, v = kv_cache.update(k, v)
        mask = self._check_mask(mask, b, n, k.shape[2], x.device)
        # (b, h, n, d_head)
        out, weights = self.attention(q, k, v, mask, is_causal)
        if self.keep_weights:
            # (b, h, n, n_k)
            self.weights = weights.detach()
        # Concatenate the heads again: (b, h, n, d_head) -> (b, n, h * d_head).
        out = out.transpose(1, 2).reshape(b, n, h * d_head)
        # (b, n, d_model)
        return self.out_proj(out)

    def attention(self, q, k, v, mask=None, is_causal: bool = False):
        """The attention step, once the tokens are split into heads: the hook a
        variant overrides.

        q: (b, n_heads, n, d_head); k, v: (b, n_kv_heads, n_k, d_head);
        mask: bool, broadcastable to (b, n_heads, n, n_k), or None;
        is_causal: the queries are the last n of the n_k keys (see
        :func:`attnbook.causal_mask`). Returns ``(out (b, n_heads, n, d_head),
        weights (b, n_heads, n, n_k))``; ``weights`` may be None when the step
        never forms them, but not when ``self.keep_weights`` is set.
        """
        # (b, h, n_k, d_head)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        if self.use_sdpa and not self.keep_weights:
            return fused_attention(q, k, v, mask, is_causal), None
        mask = with_causal(mask, is_causal, q.shape[2], k.shape[2], q.device)
        return attend(q, k, v, mask, return_weights=True)

    def _check_inputs(self, x, context) -> tuple[int, int, int]:
        """Raise unless x is (batch, n, d_model) and context (batch, m,
        d_model); return b, n, m."""
        return check_layer_inputs(x, context, self.d_model)

    def _check_mask(self, mask, batch: int, n_q: int, n_k: int, device):
        """The user's mask as a boolean tensor on ``device``, checked against
        the scores' shape."""
        return check_layer_mask(mask, (batch, self.n_heads, n_q, n_k), device)


def check_layer_inputs(x, context, d_model: int) -> tuple[int, int, int]:
    """Raise unless x is (batch, n, d_model) and context, when given, (batch,
    m, d_model); return ``(batch, n, m)`` (``m = n`` without a context).

    The input check of :class:`MultiHeadAttention` and of the layers built
    beside it from the same pieces (:mod:`attnbook.latent`).
    """
    if x.ndim != 3 or x.shape[-1] != d_model:
        raise ValueError(
            f"x must have shape (batch, n, d_model={d_model}); got "
            f"{tuple(x.shape)}"
        )
    if context is None:
        return x.shape[0], x.shape[1], x.shape[1]
    if (
        context.ndim != 3
        or context.shape[-1] != d_model
        or context.shape[0] != x.shape[0]
    ):
        raise ValueError(
            f"context must have shape (batch={x.shape[0]}, m, "
            f"d_model={d_model}) "
            f"to match x {tuple(x.shape)}; got {tuple(context.shape)}"
        )
    return x.shape[0], x.shape[1], context.shape[1]


def check_layer_mask(mask, scores_shape: tuple[int, ...], device):
    """A user's mask as a boolean tensor on ``device``, checked to broadcast
    to ``scores_shape`` (batch, n_heads, n_q, n_k); None stays None."""
    if mask is None:
        return None
    mask = torch.as_tensor(mask, device=device)
    _validate.mask_shape(mask, scores_shape)
    return mask


@contextlib.contextmanager
def keeping_weights(model):
    """Inside the ``with`` block, every :class:`MultiHeadAttention` in
    ``model`` keeps its weights.

    Yields the layers, in the order of ``model.modules()``; after a forward
    pass, ``layer.weights`` holds the attention weights (batch, n_heads, n,
    n_k) that the layer used. The layers' previous settings are restored (and
    the kept weights dropped) on the way out.
    """
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    saved = [layer.keep_weights for layer in layers]
    for layer in layers:
        layer.keep_weights = True
    try:
        yield layers
    finally:
        for layer, keep in zip(layers, saved):
            layer.keep_weights, layer.weights = keep, None
