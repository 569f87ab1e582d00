"""Learned attention sinks: a per-head logit that enters the softmax's
denominator and nothing else (gpt-oss, OpenAI 2025).

Head ``i`` has one learned number, its sink logit ``beta_i``. Its weights over
the keys are

    a_s = exp(z_s) / (exp(beta_i) + sum_r exp(z_r)),

so they sum to ``sigmoid(logsumexp(z) - beta_i)``, less than one: the head may
give part of its attention to "nothing". The sink is a key whose score is
always ``beta_i`` and whose value is zero; :func:`sink_attention` runs it
exactly so, through :func:`attnbook.attend`, and :func:`sink_scale` is the
closed
form: the output is plain attention's output times that sum, the merge
(:func:`attnbook.torch_attention.merge_splits`) of the keys' state with an
empty run whose log-sum-exp is ``beta_i``.

:class:`SinkAttention` is :class:`attnbook.MultiHeadAttention` with sinks, and
optionally a sliding window and RoPE, on the ``attention`` hook: gpt-oss's
attention layer (:func:`from_gpt_oss` copies one from ``transformers``).

Chapter 14 (sparse attention) shows :func:`sink_attention`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validate import positive_int
from ..masks import sliding_window_mask
from ..multihead import MultiHeadAttention
from ..positional import apply_rope
from ..torch_attention import attend, repeat_kv, with_causal


def _check_sinks(sinks, q):
    """``sinks`` as a tensor of one logit per head of ``q (b, h, n, d)``."""
    sinks = torch.as_tensor(sinks, dtype=q.dtype, device=q.device)
    if sinks.ndim != 1 or sinks.shape[0] != q.shape[-3]:
        raise ValueError(
            f"sinks must hold one logit per head, shape ({q.shape[-3]},); "
            f"got {tuple(sinks.shape)}"
        )
    return sinks


def sink_attention(
    q, k, v, sinks, mask=None, scale=None, return_weights: bool = False
):
    """Attention with one sink logit per head in the softmax's denominator.

    q: (b, h, n_q, d), k: (b, h, n_k, d), v: (b, h, n_k, d_v);
    sinks: (h,) the heads' sink logits, ``beta_i`` for head ``i``; mask: bool,
    broadcastable to (b, h, n_q, n_k), True = may attend. The sink is one more
    key with score ``beta_i`` (a zero key and the bias ``beta_i``) and value
    zero, always visible; the weights returned are those of the real keys (b,
    h, n_q, n_k) and sum to ``sigmoid(logsumexp(z) - beta_i)`` per row
    (:func:`sink_scale`), ``z`` the scaled scores. Returns (b, h, n_q, d_v)
    (and the weights).
    """
    sinks = _check_sinks(sinks, q)
    b, h, n_q, _ = q.shape
    n_k = k.shape[-2]
    # the sink key: zero, so its score is the bias alone
    k_s = torch.cat([k, k.new_zeros(*k.shape[:-2], 1, k.shape[-1])], dim=-2)
    v_s = torch.cat([v, v.new_zeros(*v.shape[:-2], 1, v.shape[-1])], dim=-2)
    # (1, h, 1, n_k + 1): 0 on the real keys, beta_i on the sink
    bias = torch.cat([sinks.new_zeros(h, n_k), sinks[:, None]], dim=-1)[
        None, :, None, :
    ]
    if mask is not None:
        mask = torch.as_tensor(mask, device=q.device)
        full = mask.expand(*mask.shape[:-2], n_q, n_k)
        sees_sink = full.new_ones(*full.shape[:-1], 1)
        mask = torch.cat([full, sees_sink], dim=-1)
    out, weights = attend(
        q, k_s, v_s, mask, scale=scale, bias=bias, return_weights=True
    )
    return (out, weights[..., :n_k]) if return_weights else out


def sink_scale(scores, sinks, mask=None):
    """The share of each row's attention that the keys keep.

    scores: (b, h, n_q, n_k) the scaled scores ``z``; sinks: (h,);
    mask as in :func:`sink_attention`. Returns (b, h, n_q):
    ``sigmoid(logsumexp(z) - beta_i)``; a fully masked row keeps 0.
    """
    if mask is not None:
        scores = scores.masked_fill(~torch.as_tensor(mask), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.sigmoid(lse - sinks[:, None])


class SinkAttention(MultiHeadAttention):
    """Multi-head (or grouped-query) attention with a learned sink per head,
    and optionally a sliding window of ``window`` keys and RoPE.

    ``window`` (None: every earlier key) and ``rope_base`` (None: no RoPE;
    RoPE in the half layout, at positions ``0 .. n_k - 1`` of the keys, the
    queries being the last ``n`` of them) change only the attention step.
    The sinks start at zero.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        window: int | None = None,
        rope_base: float | None = None,
        bias: bool = False,
    ):
        super().__init__(d_model, n_heads, n_kv_heads, bias=bias)
        if window is not None:
            window = positive_int("window", window)
        self.window, self.rope_base = window, rope_base
        self.sinks = nn.Parameter(torch.zeros(n_heads))

    def attention(self, q, k, v, mask=None, is_causal: bool = False):
        """The hook: RoPE, the window, then :func:`sink_attention`."""
        n_q, n_k = q.shape[2], k.shape[2]
        if self.rope_base is not None:
            positions = torch.arange(n_k, device=q.device)
            q = apply_rope(q, positions[n_k - n_q :], self.rope_base)
            k = apply_rope(k, positions, self.rope_base)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        mask = with_causal(mask, is_causal, n_q, n_k, q.device)
        if self.window is not None:
            # the last n_q rows of the window over all n_k positions
            window = torch.from_numpy(
                sliding_window_mask(n_k, self.window)[n_k - n_q :]
            ).to(q.device)
            mask = window if mask is None else mask & window
        return sink_attention(
            q,
            k,
            v,
            self.sinks,
            mask,
            scale=1 / math.sqrt(self.d_head),
            return_weights=True,
        )


def from_gpt_oss(reference) -> SinkAttention:
    """A :class:`SinkAttention` with the weights of a ``transformers``
    ``GptOssAttention`` (its window when the layer is a sliding one).

    Its RoPE must be the default one (``rope_type`` "default"; gpt-oss ships
    YaRN, which rescales the frequencies) and its projections without bias
    or with (both copied)."""
    config = reference.config
    rope = config.rope_parameters
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"only the default RoPE is supported; got rope_type="
            f"{rope.get('rope_type')!r}"
        )
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        raise ValueError(
            f"head_dim * num_attention_heads = {config.head_dim} * "
            f"{config.num_attention_heads} must equal hidden_size="
            f"{config.hidden_size}"
        )
    layer = SinkAttention(
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        window=reference.sliding_window,
        rope_base=rope["rope_theta"],
        bias=config.attention_bias,
    ).to(reference.q_proj.weight.dtype)
    pairs = [
        (layer.q_proj, reference.q_proj),
        (layer.k_proj, reference.k_proj),
        (layer.v_proj, reference.v_proj),
        (layer.out_proj, reference.o_proj),
    ]
    with torch.no_grad():
        for ours, theirs in pairs:
            ours.weight.copy_(theirs.weight)
            if ours.bias is not None:
                ours.bias.copy_(theirs.bias)
        layer.sinks.copy_(reference.sinks)
    return layer
