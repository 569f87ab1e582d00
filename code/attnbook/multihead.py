"""Multi-head attention in torch: several heads attend side by side, each in its own subspace.

A layer projects the tokens to ``n_heads`` queries and ``n_kv_heads`` keys and
values per token, lets every head attend independently, concatenates the heads
and mixes them with one output projection. ``n_kv_heads == n_heads`` is the
multi-head attention of Vaswani et al. (2017); fewer key/value heads, each shared
by a contiguous group of query heads, is grouped-query attention (GQA), and a
single one is multi-query attention (MQA).

Masks are boolean with ``True`` = may attend. A causal mask places the queries at
the *last* ``n_q`` of the ``n_k`` key positions (:func:`attnbook.causal_mask`), so
the same layer serves a whole prompt and one new token during KV-cache decoding.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate
from .masks import causal_mask


def attend(q, k, v, mask=None, scale: float | None = None):
    """Scaled dot-product attention in torch, differentiable.

    q: (..., n_q, d_k), k: (..., n_k, d_k), v: (..., n_k, d_v);
    mask: bool, broadcastable to (..., n_q, n_k), True = may attend;
    scale defaults to ``1/sqrt(d_k)``. Returns (..., n_q, d_v).
    A query whose whole row is masked attends to nothing and gets a zero output.
    """
    batch, n_q, n_k, d_k, _ = _validate.attention_shapes(q, k, v)
    if scale is None:
        scale = 1.0 / math.sqrt(d_k)
    scores = (q @ k.transpose(-2, -1)) * scale                 # (..., n_q, n_k)
    if mask is not None:
        _validate.mask_shape(mask, batch + (n_q, n_k))
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)                    # (..., n_q, n_k), rows sum to 1
    if mask is not None:
        # softmax of an all -inf row is NaN; zeroing the masked entries makes that row 0,
        # and also keeps NaN out of the backward pass (masked entries get no gradient).
        weights = weights.masked_fill(~mask, 0.0)
    return weights @ v                                          # (..., n_q, d_v)


def repeat_kv(x, n_rep: int):
    """Share each key/value head with ``n_rep`` consecutive query heads.

    x: (batch, n_kv_heads, n, d) -> (batch, n_kv_heads * n_rep, n, d), where output
    head ``j`` is input head ``j // n_rep`` (same as ``x.repeat_interleave(n_rep, dim=1)``).
    """
    if x.ndim != 4:
        raise ValueError(f"repeat_kv expects x of shape (batch, n_kv_heads, n, d); got {tuple(x.shape)}")
    n_rep = _validate.positive_int("n_rep", n_rep)
    if n_rep == 1:
        return x
    b, h_kv, n, d = x.shape
    # expand makes a view without copying; reshape then lays the copies of head j side by side.
    return x[:, :, None].expand(b, h_kv, n_rep, n, d).reshape(b, h_kv * n_rep, n, d)


class MultiHeadAttention(nn.Module):
    """Multi-head (``n_kv_heads=None``), grouped-query or multi-query (``n_kv_heads=1``) attention.

    ``d_model`` is split into ``n_heads`` heads of ``d_head = d_model // n_heads``
    features. With ``use_sdpa=True`` the attention itself runs in
    ``torch.nn.functional.scaled_dot_product_attention`` wherever that gives the same
    result as :func:`attend` (everywhere except rows that are fully masked).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 bias: bool = False, use_sdpa: bool = False):
        super().__init__()
        d_model = _validate.positive_int("d_model", d_model)
        n_heads = _validate.positive_int("n_heads", n_heads)
        n_kv_heads = n_heads if n_kv_heads is None else _validate.positive_int("n_kv_heads", n_kv_heads)
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}: "
                             "each key/value head must serve the same number of query heads")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.d_head = d_model // n_heads
        self.n_rep = n_heads // n_kv_heads          # query heads per key/value head
        self.use_sdpa = use_sdpa
        self.q_proj = nn.Linear(d_model, n_heads * self.d_head, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.d_head, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.d_head, bias=bias)
        self.out_proj = nn.Linear(n_heads * self.d_head, d_model, bias=bias)

    def forward(self, x, context=None, mask=None, is_causal: bool = False, kv_cache=None):
        """Attend from ``x`` to itself, or to ``context`` (cross-attention).

        x: (batch, n, d_model); context: (batch, m, d_model), default ``x``;
        mask: bool, broadcastable to (batch, n_heads, n, n_k), True = may attend,
        where ``n_k`` is ``m`` plus the positions already in ``kv_cache``;
        is_causal: the n queries are the last n of the n_k keys and see none after them;
        kv_cache: a :class:`attnbook.KVCache` that the new keys and values are appended to.
        Returns (batch, n, d_model).
        """
        b, n, m = self._check_inputs(x, context)
        source = x if context is None else context
        h, h_kv, d_head = self.n_heads, self.n_kv_heads, self.d_head
        # Split the features into heads, then move heads next to batch: (b, heads, tokens, d_head).
        q = self.q_proj(x).view(b, n, h, d_head).transpose(1, 2)            # (b, h, n, d_head)
        k = self.k_proj(source).view(b, m, h_kv, d_head).transpose(1, 2)    # (b, h_kv, m, d_head)
        v = self.v_proj(source).view(b, m, h_kv, d_head).transpose(1, 2)    # (b, h_kv, m, d_head)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)                                    # (b, h_kv, n_k, d_head)
        n_k = k.shape[2]
        square_causal = is_causal and mask is None and n == n_k
        mask = self._full_mask(mask, is_causal, n, n_k, x.device, b)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)           # (b, h, n_k, d_head)
        if self.use_sdpa:
            out = self._sdpa(q, k, v, mask, square_causal)
        else:
            out = attend(q, k, v, mask)                                     # (b, h, n, d_head)
        # Concatenate the heads again: (b, h, n, d_head) -> (b, n, h * d_head).
        out = out.transpose(1, 2).reshape(b, n, h * d_head)
        return self.out_proj(out)                                           # (b, n, d_model)

    def _check_inputs(self, x, context) -> tuple[int, int, int]:
        """Raise unless x is (batch, n, d_model) and context (batch, m, d_model); return b, n, m."""
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (batch, n, d_model={self.d_model}); got {tuple(x.shape)}")
        if context is None:
            return x.shape[0], x.shape[1], x.shape[1]
        if context.ndim != 3 or context.shape[-1] != self.d_model or context.shape[0] != x.shape[0]:
            raise ValueError(f"context must have shape (batch={x.shape[0]}, m, d_model={self.d_model}) "
                             f"to match x {tuple(x.shape)}; got {tuple(context.shape)}")
        return x.shape[0], x.shape[1], context.shape[1]

    def _full_mask(self, mask, is_causal: bool, n_q: int, n_k: int, device, batch: int):
        """The user's mask (checked), combined with the causal mask when ``is_causal``; or None."""
        if mask is not None:
            mask = torch.as_tensor(mask, device=device)
            _validate.mask_shape(mask, (batch, self.n_heads, n_q, n_k))
        if is_causal and n_q == 1 and mask is None:
            return None  # one new token (KV-cache decoding) sees every key: no mask to build
        if is_causal:
            causal = torch.from_numpy(causal_mask(n_q, n_k)).to(device)     # (n_q, n_k)
            mask = causal if mask is None else mask & causal
        return mask

    @staticmethod
    def _sdpa(q, k, v, mask, square_causal: bool):
        """torch's fused attention where it equals :func:`attend`; :func:`attend` elsewhere."""
        if square_causal:
            # with n_q == n_k torch's is_causal is the same lower triangle, and lets it skip work
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if mask is not None and not bool(mask.any(dim=-1).all()):
            return attend(q, k, v, mask)       # a fully masked row: NaN in older torch and some GPU kernels
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
