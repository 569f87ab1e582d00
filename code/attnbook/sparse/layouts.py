"""Sliding and full layers: which layers of a model read a window, how far
back the whole stack reaches, and what one token costs.

A model mixes two kinds of attention layer: a *full* (global) layer reads
every earlier token, a *sliding* (local) layer the last ``window`` of them.
``transformers`` configurations list the kinds in ``layer_types``
("sliding_attention" or "full_attention") and the width in
``sliding_window``; gpt-oss alternates them, Gemma 3 puts five sliding layers
before each full one. From that list:

- :func:`reach`: how many positions back the last layer's output can depend on
  (the perspectives chapter's window theorem: ``L`` sliding layers of width
  ``w`` reach ``L (w - 1)`` positions back; one full layer reaches the whole
  context);
- :func:`cost_per_token`: the cache bytes a sequence of ``n`` tokens holds,
  per token, and the attention flops of the token at position ``n - 1``
  (scores and weighted sum: ``4 d_head`` flops per head per key read), both
  through :mod:`attnbook.latent.cache_size`'s layers.

Chapter 14 (sparse attention) shows :func:`cost_per_token`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import _validate
from ..latent.cache_size import cache_bytes, layers_of

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(config) -> list[str]:
    """The kind of each layer of a ``transformers`` configuration ("sliding"
    or "full"); every layer full when the configuration lists none."""
    types = getattr(config, "layer_types", None) or [FULL] * (
        config.num_hidden_layers
    )
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"unknown layer types {unknown} in layer_types")
    return ["sliding" if t == SLIDING else "full" for t in types]


def reach(kinds, window: int) -> int | None:
    """How many positions back the output of the last layer can depend on.

    kinds: the layers' kinds ("sliding" or "full"); window: the sliding width
    ``w`` (a query reads itself and ``w - 1`` keys before it). Each sliding
    layer moves information ``w - 1`` positions (the perspectives chapter's
    window theorem), so ``L`` of them reach ``L (w - 1)``; a single full layer
    reaches every earlier token: None (unbounded).
    """
    window = _validate.positive_int("window", window)
    kinds = list(kinds)
    if any(k not in ("sliding", "full") for k in kinds):
        raise ValueError(f"kinds must be 'sliding' or 'full'; got {kinds}")
    if "full" in kinds:
        return None
    return len(kinds) * (window - 1)


@dataclass(frozen=True)
class TokenCost:
    """What the token at position ``n - 1`` costs a model: cache bytes per
    token of the whole sequence and attention flops of the token (all
    layers), and the same for a model whose layers are all full."""

    cache_bytes_per_token: float
    flops: int
    full_cache_bytes_per_token: float
    full_flops: int


def cost_per_token(config, n: int, bytes_per_element: float = 2):
    """The :class:`TokenCost` of a ``transformers`` configuration at context
    ``n`` (cache in ``bytes_per_element``, 2 for bf16)."""
    n = _validate.positive_int("n", n)
    layers = layers_of(config)
    d_head = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    per_key = 4 * config.num_attention_heads * d_head
    flops = sum(per_key * layer.positions(n) for layer in layers)
    full = [type(layer)(layer.kind, layer.elements) for layer in layers]
    return TokenCost(
        cache_bytes(layers, n, bytes_per_element) / n,
        flops,
        cache_bytes(full, n, bytes_per_element) / n,
        per_key * n * len(layers),
    )
