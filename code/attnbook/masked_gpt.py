"""Run a :class:`attnbook.gpt.TinyGPT` under any attention mask, and look at its weights.

``TinyGPT.forward`` always applies the causal mask. The masking chapter needs the
same network with other masks: none at all (the causal leak), a sliding window, a
window that keeps the first tokens (attention sinks). :func:`forward_with_mask`
runs the model's own modules in the model's own order with the mask given;
with ``mask=causal_mask(n)`` it computes what ``model(ids)`` computes (the tests check it).
"""
from __future__ import annotations

import math

import torch

from . import _validate
from .multihead import MultiHeadAttention, repeat_kv


def _as_mask(mask, device):
    """None, or a boolean tensor on ``device`` (numpy masks accepted)."""
    if mask is None:
        return None
    mask = torch.as_tensor(mask, device=device)
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be boolean (True = may attend); got {mask.dtype}")
    return mask


def attention_weights(attn: MultiHeadAttention, x, mask=None):
    """The softmax weights a :class:`MultiHeadAttention` layer uses on input ``x``.

    x: (batch, n, d_model), the layer's input (self-attention, no cache);
    mask: bool broadcastable to (batch, n_heads, n, n), True = may attend, or None.
    Returns (batch, n_heads, n, n); a fully masked row is all zeros, as in ``attend``.
    """
    b, n, _ = x.shape
    h, h_kv, d = attn.n_heads, attn.n_kv_heads, attn.d_head
    q = attn.q_proj(x).view(b, n, h, d).transpose(1, 2)                     # (b, h, n, d)
    k = repeat_kv(attn.k_proj(x).view(b, n, h_kv, d).transpose(1, 2), attn.n_rep)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)                      # (b, h, n, n)
    if mask is not None:
        _validate.mask_shape(mask, (b, h, n, n))
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights if mask is None else weights.masked_fill(~mask, 0.0)    # NaN rows -> 0


def forward_with_mask(model, ids, mask=None, return_weights: bool = False):
    """``model(ids)`` with ``mask`` in every layer instead of the causal mask.

    model: a TinyGPT; ids: (batch, n) int64 token ids at positions 0..n-1;
    mask: bool broadcastable to (batch, n_heads, n, n), True = may attend (a numpy
    array or a tensor); ``None`` means no mask at all: every position sees every other.
    Returns logits (batch, n, vocab_size), and with ``return_weights=True`` also a
    tensor (n_layers, batch, n_heads, n, n) of every layer's attention weights.
    """
    if ids.ndim != 2 or ids.dtype != torch.long:
        raise ValueError(f"ids must be an int64 tensor (batch, n); got {ids.dtype} {tuple(ids.shape)}")
    n = ids.shape[1]
    if n > model.config.block_size:
        raise ValueError(f"{n} positions do not fit block_size={model.config.block_size}")
    mask = _as_mask(mask, ids.device)
    positions = torch.arange(n, device=ids.device)
    x = model.tok_emb(ids) + model.pos_emb(positions)                      # (batch, n, d_model)
    weights = []
    for block in model.blocks:            # the order of TinyGPT's Block.forward
        h = block.ln_1(x)
        if return_weights:
            weights.append(attention_weights(block.attn, h, mask))
        x = x + block.attn(h, mask=mask)
        x = x + block.mlp(block.ln_2(x))
    logits = model.head(model.ln_f(x))                                     # (batch, n, vocab_size)
    return (logits, torch.stack(weights)) if return_weights else logits
