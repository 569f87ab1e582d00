"""Scaled dot-product attention in torch: the one attention step every torch
model of the book runs.

Chapter 5 (multi-head attention) shows :func:`attend`; chapter 12
(grouped-query attention) shows :func:`repeat_kv`.
:class:`attnbook.multihead.MultiHeadAttention` calls :func:`attend` (or torch's
fused kernel, :func:`fused_attention`, where that gives the same result), and
every variant in the book plugs into it instead of writing the attention step
again: grouped-query attention (chapter 12), the position schemes RoPE and
ALiBi (chapter 6, through ``bias``), the head analyses (chapters 5 and 13,
through ``return_weights``) and the MiniLM encoder (chapters 1 and 5). The
numpy version of the same formula, for the chapters before torch appears, is
:func:`attnbook.scaled_dot_product_attention`.

Masks are boolean with ``True`` = may attend. A causal mask places the queries
at the *last* ``n_q`` of the ``n_k`` key positions
(:func:`attnbook.causal_mask`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _validate
from .masks import causal_mask


def attend(
    q,
    k,
    v,
    mask=None,
    scale: float | None = None,
    bias=None,
    return_weights: bool = False,
):
    """Scaled dot-product attention in torch, differentiable.

    q: (..., n_q, d_k), k: (..., n_k, d_k), v: (..., n_k, d_v);
    mask: bool, broadcastable to (..., n_q, n_k), True = may attend;
    bias: float, broadcastable to (..., n_q, n_k), added to the scaled scores
    (ALiBi's distance penalty, chapter 6); scale defaults to ``1/sqrt(d_k)``.
    Returns (..., n_q, d_v), and with ``return_weights`` also the weights (...,
    n_q, n_k). A query whose whole row is masked attends to nothing and gets a
    zero output.
    """
    _, _, _, d_k, _ = _validate.attend_inputs(q, k, v, mask, bias)
    if scale is None:
        scale = 1.0 / math.sqrt(d_k)
    # float16 overflows at 65504, which q . k can pass before it is scaled;
    # score in float32.
    work = torch.promote_types(q.dtype, torch.float32)
    # (..., n_q, n_k)
    scores = (q.to(work) @ k.to(work).transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # rows sum to 1
    weights = torch.softmax(scores, dim=-1)
    if mask is not None:
        # softmax of an all -inf row is NaN; zeroing the masked entries makes
        # that row 0, and also keeps NaN out of the backward pass (masked
        # entries get no gradient).
        weights = weights.masked_fill(~mask, 0.0)
    weights = weights.to(v.dtype)
    # (..., n_q, d_v)
    out = weights @ v
    return (out, weights) if return_weights else out


def repeat_kv(x, n_rep: int):
    """Share each key/value head with ``n_rep`` consecutive query heads.

    x: (batch, n_kv_heads, n, d) -> (batch, n_kv_heads * n_rep, n, d), where
    output head ``j`` is input head ``j // n_rep`` (same as
    ``x.repeat_interleave(n_rep, dim=1)``).
    """
    n_rep = _validate.repeat_kv_inputs(x, n_rep)
    if n_rep == 1:
        return x
    b, n_kv_heads, n, d = x.shape
    # expand makes a view without copying; reshape then lays the copies of head
    # j side by side.
    return (
        x[:, :, None]
        .expand(b, n_kv_heads, n_rep, n, d)
        .reshape(b, n_kv_heads * n_rep, n, d)
    )


def with_causal(mask, is_causal: bool, n_q: int, n_k: int, device=None):
    """``mask`` combined with the causal mask of the last ``n_q`` of ``n_k``
    positions; or None.

    mask: bool tensor broadcastable to (..., n_q, n_k), or None. With
    ``is_causal=False`` the mask is returned as it is; one causal query
    (KV-cache decoding) sees every key, so ``is_causal`` with ``n_q == 1`` adds
    nothing.
    """
    if not is_causal or n_q == 1:
        return mask
    # (n_q, n_k)
    causal = torch.from_numpy(causal_mask(n_q, n_k)).to(device)
    return causal if mask is None else mask & causal


def fused_attention(q, k, v, mask=None, is_causal: bool = False):
    """:func:`attend` (default scale) through
    ``torch.nn.functional.scaled_dot_product_attention``.

    q: (b, h, n_q, d), k, v: (b, h, n_k, d); mask as in :func:`attend`;
    ``is_causal`` adds the causal mask of the last ``n_q`` keys. torch's own
    ``is_causal`` aligns the queries with the *first* keys, so it is used only
    where the two agree (``n_q == n_k``). A fully masked row goes to
    :func:`attend`: some torch versions and GPU kernels give NaN there. Finding
    one reads the mask on the host (a GPU sync); under
    :func:`attnbook._validate.skip_sync_checks` the mask is trusted to have
    none.
    """
    n_q, n_k = q.shape[-2], k.shape[-2]
    if is_causal and mask is None and n_q == n_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = with_causal(mask, is_causal, n_q, n_k, q.device)
    if (
        mask is not None
        and _validate.sync_checks_enabled()
        and not bool(mask.any(dim=-1).all())
    ):
        return attend(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def merge_splits(o_part, lse_part):
    """Combine attention over runs of keys into attention over all of them:
    chapter 9's merge of softmax states
    (:func:`attnbook.online_softmax.merge_softmax_states`), for S runs at once.

    o_part: (S, ..., d) the output of each run normalised over that run,
    lse_part: (S, ...) each run's log-sum-exp. A run's state ``(m, l)`` has
    ``lse = m + log l``, so the merge ``l = sum_s l_s exp(m_s - m)`` is ``lse =
    logsumexp_s lse_s``, and the output, which each run normalised by its own
    ``l_s``, is re-weighted by the run's share of the row's mass, ``exp(lse_s -
    lse)``. An empty run (``lse`` -inf, any finite output) has no share; a row
    that no run saw (every ``lse`` -inf) gets output 0 and ``lse`` -inf, as
    :func:`attend` gives a fully masked row. Returns ``(out, lse)``: (..., d)
    and (...). Flash-Decoding (chapter 10), ring attention, attention sinks and
    paged decoding all combine their pieces with it.
    """
    lse = torch.logsumexp(lse_part, dim=0)  # (...)
    # a row no run saw: -inf - 0 keeps its shares at 0
    seen = torch.where(torch.isneginf(lse), 0.0, lse)
    # (S, ...): sums to 1 over the runs (0 if unseen)
    share = torch.exp(lse_part - seen)
    return (share[..., None] * o_part).sum(dim=0), lse
