"""The shapes of published decoders: what sets their flops, their parameters
and their KV cache.

Chapter 8 (the KV cache) counts the flops of generating with and without a
cache for GPT-2 small and Llama 2 (:mod:`attnbook.decoding`), and the memory of
their caches; chapter 12 (grouped-query attention) compares the caches of
models with fewer key/value heads. Both read the one table
:data:`PUBLISHED_MODELS`, taken from each model's published configuration (the
``config.json`` or ``params.json`` released with its weights).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import _validate
from .kv_cache import kv_cache_bytes


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer.

    ``n_kv_heads=None`` means one key/value head per query head (multi-head
    attention); ``mlp_matrices`` is 2 for a GELU MLP (``d -> d_ff -> d``) and 3
    for a gated one (SwiGLU, as in Llama); ``tied_embeddings`` says whether the
    output head reuses the token embedding matrix; ``context_length`` is the
    longest context the model was trained for; ``sliding_window``, when set, is
    the number of positions each query looks back (itself included), so that a
    rolling buffer of that many positions is all the cache must hold;
    ``source`` is the bibliography key of the paper that describes it.
    """

    name: str
    n_layers: int
    n_heads: int
    d_head: int
    d_model: int
    d_ff: int
    vocab_size: int
    context_length: int
    n_kv_heads: int | None = None
    mlp_matrices: int = 2
    tied_embeddings: bool = True
    source: str = ""
    sliding_window: int | None = None

    def __post_init__(self):
        for field in (
            "n_layers",
            "n_heads",
            "d_head",
            "d_model",
            "d_ff",
            "vocab_size",
            "context_length",
            "mlp_matrices",
        ):
            _validate.positive_int(field, getattr(self, field))
        if self.sliding_window is not None:
            _validate.positive_int("sliding_window", self.sliding_window)
        if self.n_kv_heads is None:
            # frozen: set once, here
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        _validate.group_size(self.n_heads, self.n_kv_heads)

    @property
    def kind(self) -> str:
        """ "MHA", "GQA" or "MQA"."""
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"

    def cached_positions(self, context_length: int | None = None) -> int:
        """Positions the cache holds for a sequence of ``context_length``
        tokens (its own by default): all of them, or at most ``sliding_window``
        with a rolling buffer."""
        n = self.context_length if context_length is None else context_length
        return (
            n if self.sliding_window is None else min(n, self.sliding_window)
        )

    def cache_bytes(
        self,
        context_length: int | None = None,
        batch: int = 1,
        bytes_per_element: float = 2,
    ):
        """:func:`attnbook.kv_cache_bytes` for this model, at its own context
        length by default, over the :meth:`cached_positions` (a sliding window
        caps them)."""
        return kv_cache_bytes(
            self.n_layers,
            self.n_kv_heads,
            self.d_head,
            self.cached_positions(context_length),
            batch,
            bytes_per_element,
        )

    def bytes_per_token(self, bytes_per_element: float = 2) -> int | float:
        """Cache bytes that one more token adds: ``2 * n_layers * n_kv_heads *
        d_head * bytes``."""
        return self.cache_bytes(1, 1, bytes_per_element)

    def matmul_params(self) -> int:
        """Weights of the matrix products: the projections, the MLP and the
        output head.

        Biases, layer norms and the (position) embeddings are not counted; the
        output head is, whether or not it shares its matrix with the token
        embedding.
        """
        d, attn_width, kv_width = (
            self.d_model,
            self.n_heads * self.d_head,
            self.n_kv_heads * self.d_head,
        )
        per_layer = (
            2 * d * attn_width
            + 2 * d * kv_width
            + self.mlp_matrices * d * self.d_ff
        )
        return self.n_layers * per_layer + d * self.vocab_size

    def matrix_params(self) -> int:
        """All weight matrices: :meth:`matmul_params` plus the token embedding
        when it is not tied."""
        return self.matmul_params() + (
            0 if self.tied_embeddings else self.vocab_size * self.d_model
        )


def shape_of(config, name: str = "tiny GPT") -> ModelShape:
    """The :class:`ModelShape` of a :class:`attnbook.gpt.GPTConfig` (its MLP is
    4 d_model wide)."""
    return ModelShape(
        name,
        config.n_layers,
        config.n_heads,
        config.d_model // config.n_heads,
        config.d_model,
        4 * config.d_model,
        config.vocab_size,
        config.context_length,
        config.n_kv_heads,
    )


def as_multi_head(shape: ModelShape) -> ModelShape:
    """The same model with one key/value head per query head: what its cache
    would be without GQA."""
    return dataclasses.replace(
        shape, name=f"{shape.name} as MHA", n_kv_heads=None
    )


#: GPT-2 small: Radford et al. (2019). Llama 2: Touvron et al. (2023); its 70B
#: model has 64 query heads sharing 8 key/value heads (grouped-query
#: attention). Mistral-7B and Llama-3-8B: 32 query heads sharing 8;
#: Llama-3-8B's context of 8192 is the April 2024 release's (its model card,
#: and max_position_embeddings in its config.json); the Llama 3 paper, its
#: ``source`` for the shape, describes the July 2024 Llama 3.1 models of the
#: same shape, pre-trained at 8K tokens and then extended to 128K;
#: Mistral-7B's sliding-window attention looks back 4096 positions (Jiang et
#: al. 2023, section 2), so its rolling buffer caches at most 4096. Falcon-7B:
#: 71 query heads of 64 features (hidden size 4544) and one key/value head
#: ("multi_query": true), a GELU MLP of width 4 * 4544 and tied embeddings.
GPT2_SMALL = ModelShape(
    "GPT-2 small",
    n_layers=12,
    n_heads=12,
    d_head=64,
    d_model=768,
    d_ff=3072,
    vocab_size=50257,
    context_length=1024,
    source="radford2019language",
)
LLAMA2_7B = ModelShape(
    "Llama-2-7B",
    n_layers=32,
    n_heads=32,
    d_head=128,
    d_model=4096,
    d_ff=11008,
    vocab_size=32000,
    context_length=4096,
    mlp_matrices=3,
    tied_embeddings=False,
    source="touvron2023llama",
)
LLAMA2_70B = ModelShape(
    "Llama-2-70B",
    n_layers=80,
    n_heads=64,
    n_kv_heads=8,
    d_head=128,
    d_model=8192,
    d_ff=28672,
    vocab_size=32000,
    context_length=4096,
    mlp_matrices=3,
    tied_embeddings=False,
    source="touvron2023llama",
)
MISTRAL_7B = ModelShape(
    "Mistral-7B",
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    d_head=128,
    d_model=4096,
    d_ff=14336,
    vocab_size=32000,
    context_length=8192,
    mlp_matrices=3,
    tied_embeddings=False,
    source="jiang2023mistral",
    sliding_window=4096,
)
LLAMA3_8B = ModelShape(
    "Llama-3-8B",
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    d_head=128,
    d_model=4096,
    d_ff=14336,
    vocab_size=128256,
    context_length=8192,
    mlp_matrices=3,
    tied_embeddings=False,
    source="grattafiori2024llama3",
)
FALCON_7B = ModelShape(
    "Falcon-7B",
    n_layers=32,
    n_heads=71,
    n_kv_heads=1,
    d_head=64,
    d_model=4544,
    d_ff=18176,
    vocab_size=65024,
    context_length=2048,
    source="almazrouei2023falcon",
)

#: Every published shape the book uses.
PUBLISHED_MODELS = (
    GPT2_SMALL,
    LLAMA2_7B,
    LLAMA2_70B,
    MISTRAL_7B,
    LLAMA3_8B,
    FALCON_7B,
)
