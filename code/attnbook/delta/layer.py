"""A delta-rule layer that takes the place of attention in a block.

:class:`DeltaLayer` is a sibling of :class:`attnbook.MultiHeadAttention`: the
same ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` and the same
``forward`` arguments, but each head keeps a state of ``d_head x d_head``
numbers instead of a growing cache. Queries and keys are normalised to unit
length (the delta rule needs unit keys); the write strength is ``beta =
sigmoid(W_beta x)`` per head and token; the gate, where the form has one, is
``a = exp(logsigmoid(W_a x) / 16)``, GLA's gate with its temperature 16 (Yang
et al. 2024), per head (a number) or per key channel (KDA). The heads run
:func:`attnbook.delta.chunkwise.delta_chunkwise`.

The tiny GPT takes it per layer (``GPTConfig.layer_types``), so that a hybrid
of delta layers and softmax layers is one line of its config. Chapter 16 (the
delta rule) uses it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import _validate
from .chunkwise import delta_chunkwise

# form: (corrects with the delta rule, has beta, gate: None/"head"/"channel")
KINDS = {
    "linear": (False, False, None),
    "decay": (False, False, "head"),
    "delta": (True, True, None),
    "gated_delta": (True, True, "head"),
    "kda": (True, True, "channel"),
}
GATE_TEMPERATURE = 16.0


class DeltaLayer(nn.Module):
    """Causal linear attention of the form ``kind`` (a key of :data:`KINDS`)
    over ``n_heads`` heads of ``d_model // n_heads`` channels.

    forward: x (batch, n, d_model) -> (batch, n, d_model).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        kind: str = "gated_delta",
        chunk_size: int = 16,
    ):
        super().__init__()
        d_model = _validate.positive_int("d_model", d_model)
        n_heads = _validate.positive_int("n_heads", n_heads)
        if d_model % n_heads:
            raise ValueError(
                f"d_model={d_model} is not divisible by n_heads={n_heads}"
            )
        if kind not in KINDS:
            raise ValueError(
                f"kind must be one of {list(KINDS)}; got {kind!r}"
            )
        self.kind, self.n_heads = kind, n_heads
        self.d_head = d_model // n_heads
        self.chunk_size = _validate.positive_int("chunk_size", chunk_size)
        self.delta, has_beta, gate = KINDS[kind]
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        self.beta_proj = nn.Linear(d_model, n_heads) if has_beta else None
        gate_out = {None: 0, "head": n_heads, "channel": d_model}[gate]
        self.gate_proj = nn.Linear(d_model, gate_out) if gate else None

    def heads(self, x):
        """(batch, n, d_model) -> (batch, n_heads, n, d_head)."""
        b, n, _ = x.shape
        return x.view(b, n, self.n_heads, self.d_head).transpose(1, 2)

    def inputs(self, x):
        """The heads' ``(q, k, v, beta, gate)`` for x (batch, n, d_model):
        q, k, v (batch, n_heads, n, d_head), unit q and k; beta (batch,
        n_heads, n) or None; gate (batch, n_heads, n) or (batch, n_heads, n,
        d_head) or None."""
        q = F.normalize(self.heads(self.q_proj(x)), dim=-1)
        k = F.normalize(self.heads(self.k_proj(x)), dim=-1)
        v = self.heads(self.v_proj(x))
        beta = gate = None
        if self.beta_proj is not None:
            beta = torch.sigmoid(self.beta_proj(x)).transpose(1, 2)
        if self.gate_proj is not None:
            log_a = F.logsigmoid(self.gate_proj(x)) / GATE_TEMPERATURE
            if log_a.shape[-1] == self.n_heads:
                gate = log_a.exp().transpose(1, 2)
            else:
                gate = self.heads(log_a.exp())
        return q, k, v, beta, gate

    def forward(
        self, x, context=None, mask=None, is_causal=True, kv_cache=None
    ):
        """x: (batch, n, d_model) -> (batch, n, d_model), causal. The other
        arguments are those of :class:`attnbook.MultiHeadAttention`; a delta
        layer takes none of them (it keeps a state, not a cache)."""
        if context is not None or mask is not None or not is_causal:
            raise ValueError(
                "a DeltaLayer is causal self-attention only: no context, "
                "no mask, is_causal=True"
            )
        if kv_cache is not None:
            raise ValueError(
                "a DeltaLayer keeps a recurrent state, not a KV cache: run "
                "the model without kv_cache (generate(use_cache=False))"
            )
        d_model = self.n_heads * self.d_head
        if x.ndim != 3 or x.shape[-1] != d_model:
            raise ValueError(
                f"x must have shape (batch, n, d_model={d_model}); got "
                f"{tuple(x.shape)}"
            )
        q, k, v, beta, gate = self.inputs(x)
        o, _ = delta_chunkwise(
            q, k, v, beta, gate, self.delta, self.chunk_size
        )
        b, _, n, _ = o.shape
        return self.out_proj(o.transpose(1, 2).reshape(b, n, -1))
