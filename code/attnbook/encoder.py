"""A BERT-style transformer encoder, built around the book's
:class:`MultiHeadAttention`.

Two modules make the whole network of BERT (Devlin et al. 2019) and of its
smaller relatives such as MiniLM:

- :class:`EncoderEmbeddings`: each token's input vector is the sum of three
  learned vectors, for the token, for its position and for its segment ("token
  type"), normalised with a LayerNorm;
- :class:`EncoderLayer`: self-attention over every token (no causal mask: an
  encoder reads the whole sentence at once) and a two-layer GELU MLP, each
  added to its input and followed by a LayerNorm ("post-LayerNorm", as in
  Vaswani et al. 2017).

Padding is a boolean ``padding_mask`` of shape (batch, n), True = a real token;
padded positions are hidden as *keys* from every query, so they never change a
real token. Chapter 5 (multi-head attention) shows :class:`EncoderLayer`;
:mod:`attnbook.minilm` loads a real checkpoint into these modules (chapters 1
and 5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate
from .multihead import MultiHeadAttention


class EncoderEmbeddings(nn.Module):
    """BERT's input layer: LayerNorm(token + position + token-type embedding).

    ids: (batch, n) int64 -> (batch, n, d_model). Positions are 0, 1, ..., n -
    1 and must stay below ``context_length``; ``token_type_ids`` default to 0
    (a single segment).
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        context_length: int,
        n_token_types: int = 2,
        eps: float = 1e-12,
    ):
        super().__init__()
        self.tokens = nn.Embedding(
            _validate.positive_int("vocab_size", vocab_size), d_model
        )
        self.positions = nn.Embedding(
            _validate.positive_int("context_length", context_length), d_model
        )
        self.token_types = nn.Embedding(
            _validate.positive_int("n_token_types", n_token_types), d_model
        )
        self.norm = nn.LayerNorm(d_model, eps=eps)

    def forward(self, ids, token_type_ids=None):
        if ids.ndim != 2:
            raise ValueError(
                f"ids must have shape (batch, n); got {tuple(ids.shape)}"
            )
        n = ids.shape[1]
        if n > self.positions.num_embeddings:
            raise ValueError(
                f"{n} tokens, but the model has position vectors for at most "
                f"{self.positions.num_embeddings}"
            )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(ids)
        elif token_type_ids.shape != ids.shape:
            raise ValueError(
                f"token_type_ids {tuple(token_type_ids.shape)} must have the "
                "shape of ids "
                f"{tuple(ids.shape)}"
            )
        # (n,), broadcast over batch
        positions = torch.arange(n, device=ids.device)
        x = (
            self.tokens(ids)
            + self.positions(positions)
            + self.token_types(token_type_ids)
        )
        # (batch, n, d_model)
        return self.norm(x)


class EncoderLayer(nn.Module):
    """One post-LayerNorm encoder block (BERT):

        h   = LayerNorm(x + MultiHeadAttention(x))
        out = LayerNorm(h + W_2 GELU(W_1 h + b_1) + b_2)

    x: (batch, n, d_model) -> (batch, n, d_model); padding_mask: bool (batch,
    n), True = a real token. Every projection has a bias, as in BERT; the MLP
    is ``d_ff`` wide.
    """

    def __init__(
        self, d_model: int, n_heads: int, d_ff: int, eps: float = 1e-12
    ):
        super().__init__()
        self.attn = MultiHeadAttention(d_model, n_heads, bias=True)
        self.attn_norm = nn.LayerNorm(d_model, eps=eps)
        self.ff_in = nn.Linear(d_model, _validate.positive_int("d_ff", d_ff))
        self.ff_out = nn.Linear(d_ff, d_model)
        self.ff_norm = nn.LayerNorm(d_model, eps=eps)

    def forward(self, x, padding_mask=None):
        mask = None
        if padding_mask is not None:
            if padding_mask.shape != x.shape[:2]:
                raise ValueError(
                    "padding_mask must have shape (batch, n) = "
                    f"{tuple(x.shape[:2])}; "
                    f"got {tuple(padding_mask.shape)}"
                )
            # the same keys are hidden from every head and every query: (batch,
            # 1, 1, n)
            mask = padding_mask[:, None, None, :]
        x = self.attn_norm(x + self.attn(x, mask=mask))
        # BERT's GELU is the exact one, x * Phi(x), not the tanh approximation
        return self.ff_norm(x + self.ff_out(F.gelu(self.ff_in(x))))
