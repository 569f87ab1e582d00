"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): a cheap "lightning
indexer" scores every earlier key for each query, and the main attention
reads only the top ``k`` of them.

The indexer's score of key ``s`` for query ``t`` is

    I[t, s] = sum_j omega[t, j] ReLU(q[t, j] . k[s]),

over ``H_I`` small indexer heads ``j`` that share one key ``k[s]``, with a
per-query, per-head weight ``omega[t, j]`` (:func:`indexer_scores`; DeepSeek
writes ``w``, which the book keeps for a window's width). Selection
must respect causality: a query may select only keys ``s <= t``, and a query
with fewer than ``k`` such keys selects them all (:func:`causal_topk`).
:func:`sparse_attention` is then attention restricted to the selected keys,
through :func:`attnbook.attend` with the selection as a mask.

:class:`LightningIndexer` holds the indexer's own projections as
``transformers``' ``DeepseekV32Indexer`` does (a query from the attention's
query latent, one key from the token through a LayerNorm, RoPE on the first
``d_rope`` features, head weights from the token), so that the two can share
weights.

Chapter 14 (sparse attention) shows :func:`indexer_scores` and, in a
solution, :func:`causal_topk`.
"""

from __future__ import annotations

import torch
from torch import nn

from .._validate import int_in_range
from ..positional import apply_rope
from ..torch_attention import attend


def indexer_scores(q, k, omega, scale: float = 1.0):
    """The lightning indexer's scores.

    q: (b, n_q, H_I, d) one query per indexer head; k: (b, n_k, d) one key per
    position, shared by the heads; omega: (b, n_q, H_I) the heads' weights;
    ``scale`` multiplies ``q . k`` before the ReLU. Returns (b, n_q, n_k):
    ``I[t, s] = sum_j omega[t, j] ReLU(scale q[t, j] . k[s])``. No mask: see
    :func:`causal_topk`.
    """
    if q.ndim != 4 or k.ndim != 3 or omega.ndim != 3:
        raise ValueError(
            "need q (b, n_q, H_I, d), k (b, n_k, d), omega (b, n_q, H_I); "
            "got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(omega.shape)}"
        )
    b, n_q, heads, d = q.shape
    if k.shape[0] != b or k.shape[2] != d or omega.shape != (b, n_q, heads):
        raise ValueError(
            f"shapes do not agree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"omega {tuple(omega.shape)}"
        )
    # (b, n_q, H_I, n_k)
    per_head = torch.relu(scale * torch.einsum("bthd,bsd->bths", q, k))
    return torch.einsum("bth,bths->bts", omega, per_head)


def causal_topk(scores, k: int, offset: int | None = None):
    """The top ``k`` keys of each query among those it may see.

    scores: (..., n_q, n_k) indexer scores; the queries are the last ``n_q`` of
    the ``n_k`` positions (``offset = n_k - n_q`` by default), so query ``t``
    may select keys ``s <= t + offset``. Returns ``(indices, valid)``, both
    (..., n_q, k) (``k`` may not exceed ``n_k``: a ValueError): ``indices`` the
    selected keys in decreasing score, ``valid`` False where a query has fewer
    than ``k`` keys to choose from (those slots hold an index that must not be
    read). Masking the future *before* the top-k is what keeps a query from
    selecting it.
    """
    n_q, n_k = scores.shape[-2], scores.shape[-1]
    k = int_in_range("k", k, 1, n_k, bounds=f"an integer in [1, n_k={n_k}]")
    offset = n_k - n_q if offset is None else offset
    if offset < 0:
        raise ValueError(
            f"offset must be >= 0 (queries among the keys); got {offset}"
        )
    t = torch.arange(n_q, device=scores.device)[:, None] + offset
    allowed = torch.arange(n_k, device=scores.device)[None, :] <= t
    masked = scores.masked_fill(~allowed, float("-inf"))
    top = masked.topk(int(k), dim=-1)
    # a slot is real when the query had that many keys to choose from
    rank = torch.arange(int(k), device=scores.device)
    valid = (rank < (t + 1).clamp(max=n_k)).expand_as(top.indices)
    return top.indices, valid


def selection_mask(indices, valid, n_k: int):
    """The selected keys as a boolean mask (..., n_q, n_k), True = read."""
    # the slots that are not real go to one extra column, dropped after
    mask = torch.zeros(
        *indices.shape[:-1], n_k + 1, dtype=torch.bool, device=indices.device
    )
    spare = torch.full_like(indices, n_k)
    return mask.scatter(-1, torch.where(valid, indices, spare), True)[
        ..., :n_k
    ]


def sparse_attention(q, k, v, indices, valid, scale=None):
    """Attention of each query over its selected keys only.

    q: (b, h, n_q, d), k, v: (b, h, n_k, d); indices, valid: (b, n_q, k) from
    :func:`causal_topk`, shared by the heads (DSA selects per token, not per
    head). Equal to :func:`attnbook.attend` with :func:`selection_mask` (each
    query reads ``k`` keys: ``O(n_q k d)`` work where the keys are gathered).
    """
    mask = selection_mask(indices, valid, k.shape[-2])[:, None]
    return attend(q, k, v, mask, scale=scale)


class LightningIndexer(nn.Module):
    """DSA's indexer with its own projections, as in ``transformers``'
    ``DeepseekV32Indexer``.

    ``wq_b`` maps the attention's query latent (``d_q_latent``) to ``n_heads``
    indexer queries of ``d_head``; ``wk`` and a LayerNorm map the token to one
    key; RoPE (half layout) rotates the first ``d_rope`` features of both;
    ``weights_proj`` gives each head a weight, scaled by ``n_heads ** -0.5``;
    ``q . k`` is scaled by ``d_head ** -0.5``.
    """

    def __init__(
        self,
        d_model: int,
        d_q_latent: int,
        n_heads: int,
        d_head: int,
        d_rope: int,
        rope_base: float = 10000.0,
    ):
        super().__init__()
        if not 0 <= d_rope <= d_head or d_rope % 2:
            raise ValueError(
                f"d_rope must be even and in [0, d_head={d_head}]; got "
                f"{d_rope}"
            )
        self.n_heads, self.d_head, self.d_rope = n_heads, d_head, d_rope
        self.rope_base = rope_base
        self.wq_b = nn.Linear(d_q_latent, n_heads * d_head, bias=False)
        self.wk = nn.Linear(d_model, d_head, bias=False)
        self.k_norm = nn.LayerNorm(d_head, eps=1e-6)
        self.weights_proj = nn.Linear(d_model, n_heads, bias=False)

    def _rotate(self, x, positions):
        """RoPE on the first ``d_rope`` features of ``x (..., n, d_head)``."""
        if self.d_rope == 0:
            return x
        rot = apply_rope(x[..., : self.d_rope], positions, self.rope_base)
        return torch.cat([rot, x[..., self.d_rope :]], dim=-1)

    def forward(self, x, q_latent):
        """x: (b, n, d_model), q_latent: (b, n, d_q_latent). Returns the
        scores (b, n, n), unmasked (:func:`causal_topk` masks them)."""
        b, n, _ = x.shape
        positions = torch.arange(n, device=x.device)
        q = self.wq_b(q_latent).view(b, n, self.n_heads, self.d_head)
        # rotate per head: (b, H_I, n, d) then back
        q = self._rotate(q.transpose(1, 2), positions).transpose(1, 2)
        k = self._rotate(self.k_norm(self.wk(x)), positions)
        w = self.weights_proj(x) * self.n_heads**-0.5
        return indexer_scores(q, k, w, scale=self.d_head**-0.5)
