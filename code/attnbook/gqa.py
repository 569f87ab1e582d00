"""Grouped-query attention: groups of query heads share one key/value head.

With ``n_heads`` query heads and ``n_kv_heads`` key/value heads, query head
``j`` reads key/value head ``j // g``, where ``g = n_heads // n_kv_heads`` is
the group
size: the groups are *contiguous* runs of query heads, the convention of
:func:`attnbook.repeat_kv` and of
``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)``.
``n_kv_heads == n_heads`` is multi-head attention (MHA), ``n_kv_heads == 1``
multi-query attention (MQA, Shazeer 2019), anything between is grouped-query
attention (GQA, Ainslie et al. 2023).

This module computes grouped attention without materialising the repeated keys
and values (:func:`grouped_query_attention`, :class:`GroupedQueryAttention`),
converts a multi-head checkpoint to fewer key/value heads by pooling each
group's projections (:func:`mha_to_gqa`). The shapes of published GQA and MQA
models are in :mod:`attnbook.model_shapes`. Chapter 12 (grouped-query
attention) shows :func:`grouped_query_attention` and :func:`pool_kv_heads`; its
measurements of decoding speed are in :mod:`attnbook.experiments.decode_speed`.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from . import _validate
from ._validate import group_size
from .multihead import MultiHeadAttention
from .torch_attention import attend, with_causal


def kv_head_of(n_heads: int, n_kv_heads: int) -> list[int]:
    """The key/value head that each query head reads: ``[j // g for j in
    range(n_heads)]``."""
    g = group_size(n_heads, n_kv_heads)
    return [j // g for j in range(n_heads)]


# ---- attention that shares key/value heads ----------------------------------


def grouped_query_attention(
    q,
    k,
    v,
    mask=None,
    scale: float | None = None,
    return_weights: bool = False,
):
    """Attention in which each key/value head serves a contiguous group of
    query heads.

    q: (batch, n_heads, n_q, d_k); k: (batch, n_kv_heads, n_k, d_k);
    v: (batch, n_kv_heads, n_k, d_v); mask: bool, broadcastable to (batch,
    n_heads, n_q, n_k), True = may attend; scale defaults to ``1/sqrt(d_k)``.
    Returns (batch, n_heads, n_q, d_v) (and the weights (batch, n_heads, n_q,
    n_k) with ``return_weights``), equal to :func:`attnbook.attend` on
    ``repeat_kv(k, g)`` and ``repeat_kv(v, g)``, but the keys and values are
    never repeated: the ``g`` query heads of a group are stacked into ``g *
    n_q`` rows that attend to their one key/value head.
    """
    b, h, n_kv_heads, g, n_q, n_k, d_k, d_v = grouped_shapes(q, k, v)
    # Group i becomes g * n_q query rows facing key/value head i. For a
    # contiguous q, heads i*g .. i*g + g - 1 are adjacent in memory and this
    # reshape only relabels them (a view). A q transposed from (b, n_q, h,
    # d_k), as projections produce it, is copied here when n_q > 1 (a copy the
    # size of q, never of k or v); with n_q = 1 (decoding) it stays a view. (b,
    # n_kv_heads, g n_q, d_k)
    q_rows = q.reshape(b, n_kv_heads, g * n_q, d_k)
    if mask is not None:
        # (b, n_kv_heads, g n_q, n_k)
        mask = grouped_mask(mask, (b, h, n_q, n_k), n_kv_heads, g)
    out, weights = attend(q_rows, k, v, mask, scale, return_weights=True)
    # (b, h, n_q, d_v)
    out = out.reshape(b, h, n_q, d_v)
    return (out, weights.reshape(b, h, n_q, n_k)) if return_weights else out


def grouped_shapes(q, k, v):
    """Check the shapes of :func:`grouped_query_attention`; return b, h,
    n_kv_heads, g, n_q, n_k, d_k, d_v."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, heads, n, d); got "
                f"{tuple(t.shape)}"
            )
    (b, h, n_q, d_k), (bk, n_kv_heads, n_k, d_kk), (bv, h_v, n_v, d_v) = (
        q.shape,
        k.shape,
        v.shape,
    )
    if (bk, n_kv_heads, n_k) != (bv, h_v, n_v):
        raise ValueError(
            "k and v must agree on (batch, n_kv_heads, n_k); got k "
            f"{tuple(k.shape)} "
            f"and v {tuple(v.shape)}"
        )
    if bk != b or d_kk != d_k:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch "
            "and d_k"
        )
    g = group_size(
        h,
        n_kv_heads,
        f" (the heads of q {tuple(q.shape)} and of k {tuple(k.shape)})",
    )
    return b, h, n_kv_heads, g, n_q, n_k, d_k, d_v


def grouped_mask(mask, scores_shape, n_kv_heads: int, g: int):
    """A mask broadcastable to (b, h, n_q, n_k) as the (b, n_kv_heads, g * n_q,
    n_k) mask of the stacked rows."""
    _validate.mask_shape(mask, scores_shape)
    b, h, n_q, n_k = scores_shape
    # head j -> (group j // g, member j % g)
    mask = mask.expand(b, h, n_q, n_k)
    return mask.reshape(b, n_kv_heads, g * n_q, n_k)


class GroupedQueryAttention(MultiHeadAttention):
    """:class:`attnbook.MultiHeadAttention` whose attention step is
    :func:`grouped_query_attention`.

    Same parameters, same arguments, same results; the difference is that the
    keys and values (those in a KV cache included) are never repeated to
    ``n_heads``. ``use_sdpa`` has no effect: the attention always runs in
    :func:`grouped_query_attention`.
    """

    def attention(self, q, k, v, mask=None, is_causal: bool = False):
        """q: (b, n_heads, n, d_head); k, v: (b, n_kv_heads, n_k, d_head) ->
        (out, weights)."""
        mask = with_causal(mask, is_causal, q.shape[2], k.shape[2], q.device)
        return grouped_query_attention(q, k, v, mask, return_weights=True)


def with_grouped_attention(model):
    """A copy of ``model`` whose :class:`MultiHeadAttention` layers are
    :class:`GroupedQueryAttention`.

    The weights are copied unchanged, so the copy computes the same function.
    """
    model = copy.deepcopy(model)
    for module in model.modules():
        if type(module) is MultiHeadAttention:
            # same attributes; only forward differs
            module.__class__ = GroupedQueryAttention
    return model


# ---- converting a multi-head checkpoint -------------------------------------

POOLING_METHODS = ("mean", "first")


def pool_kv_heads(weight, n_heads: int, n_kv_heads: int, method: str = "mean"):
    """Pool the per-head rows of a key or value projection into ``n_kv_heads``
    heads.

    weight: (n_heads * d_head, ...) (an ``nn.Linear`` weight or bias, rows
    grouped by head).
    Returns (n_kv_heads * d_head, ...): for key/value head ``i``, the mean
    (``method="mean"``) of the rows of heads ``i*g .. i*g + g - 1``, or those
    of head ``i*g`` alone (``"first"``).
    """
    g = group_size(n_heads, n_kv_heads)
    if method not in POOLING_METHODS:
        raise ValueError(
            f"method must be one of {POOLING_METHODS}; got {method!r}"
        )
    if weight.shape[0] % n_heads:
        raise ValueError(
            f"weight has {weight.shape[0]} rows, not a multiple of "
            f"n_heads={n_heads}"
        )
    d_head = weight.shape[0] // n_heads
    # (n_kv_heads, g, d_head, ...)
    heads = weight.reshape(n_kv_heads, g, d_head, *weight.shape[1:])
    pooled = heads.mean(dim=1) if method == "mean" else heads[:, 0]
    return pooled.reshape(n_kv_heads * d_head, *weight.shape[1:])


def mha_to_gqa(model_or_attention, n_kv_heads: int, method: str = "mean"):
    """Convert multi-head attention to ``n_kv_heads`` key/value heads (Ainslie
    et al. 2023).

    Takes a :class:`attnbook.MultiHeadAttention` or a model containing them (a
    :class:`attnbook.gpt.TinyGPT`, whose config is updated) and returns a
    converted copy; the input is left unchanged. Each group's key and value
    projections are pooled with :func:`pool_kv_heads`; queries and the output
    projection are kept.
    """
    n_kv_heads = _validate.positive_int("n_kv_heads", n_kv_heads)
    converted = copy.deepcopy(model_or_attention)
    layers = [
        m for m in converted.modules() if isinstance(m, MultiHeadAttention)
    ]
    if not layers:
        raise ValueError(
            f"{type(model_or_attention).__name__} contains no "
            "MultiHeadAttention layer"
        )
    for attn in layers:
        _convert_layer(attn, n_kv_heads, method)
    config = getattr(converted, "config", None)
    if config is not None and hasattr(config, "n_kv_heads"):
        converted.config = dataclasses.replace(config, n_kv_heads=n_kv_heads)
    return converted


def _convert_layer(
    attn: MultiHeadAttention, n_kv_heads: int, method: str
) -> None:
    if attn.n_kv_heads != attn.n_heads:
        raise ValueError(
            f"the layer already has {attn.n_kv_heads} key/value heads for "
            f"{attn.n_heads} "
            "query heads; convert a multi-head checkpoint"
        )
    group_size(attn.n_heads, n_kv_heads)
    for name in ("k_proj", "v_proj"):
        old = getattr(attn, name)
        new = nn.Linear(
            old.in_features,
            n_kv_heads * attn.d_head,
            bias=old.bias is not None,
            device=old.weight.device,
            dtype=old.weight.dtype,
        )
        with torch.no_grad():
            new.weight.copy_(
                pool_kv_heads(old.weight, attn.n_heads, n_kv_heads, method)
            )
            if old.bias is not None:
                new.bias.copy_(
                    pool_kv_heads(old.bias, attn.n_heads, n_kv_heads, method)
                )
        setattr(attn, name, new)
    attn.n_kv_heads, attn.n_rep = n_kv_heads, attn.n_heads // n_kv_heads
