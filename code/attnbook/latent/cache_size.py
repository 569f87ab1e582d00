"""Cache bytes per token for every kind of attention layer, and for published
models read from ``transformers``' configuration classes.

A layer adds to the cache, per token:

- multi-head, grouped-query or multi-query attention: a key and a value of
  ``d_head`` numbers for each of ``n_kv_heads`` heads, ``2 n_kv_heads d_head``
  (:func:`kv_layer`); a sliding-window layer holds at most ``window``
  positions;
- multi-head latent attention: one latent and one rotary key, ``d_latent +
  d_rope`` (:func:`latent_layer`), whatever the number of heads;
- a layer that reuses an earlier layer's cache: nothing (:func:`shared_layer`).

:func:`layers_of` reads the layers of a model from its ``transformers``
configuration (Llama, Qwen3, gpt-oss, DeepSeek-V2/V3, Gemma 3n, Gemma 4).
:data:`PUBLISHED` lists the models chapter 13 compares: where the defaults of
a configuration class are a released model, the class alone; otherwise the
published sizes the defaults lack, with their source.

Chapter 13 (latent attention and shared caches) shows :func:`layers_of` and
:func:`cache_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import _validate
from .sharing import producers, reuse_last_of_type


@dataclass(frozen=True)
class LayerFootprint:
    """What one layer keeps per token: ``elements`` numbers (``kind`` "kv",
    "latent" or "shared"), for at most ``window`` positions when set."""

    kind: str
    elements: int
    window: int | None = None

    def positions(self, n_tokens: int) -> int:
        """Positions held after ``n_tokens`` tokens."""
        return n_tokens if self.window is None else min(n_tokens, self.window)


def kv_layer(n_kv_heads: int, d_head: int, window=None) -> LayerFootprint:
    """A key and a value per key/value head: ``2 * n_kv_heads * d_head``."""
    n_kv_heads = _validate.positive_int("n_kv_heads", n_kv_heads)
    d_head = _validate.positive_int("d_head", d_head)
    if window is not None:
        window = _validate.positive_int("window", window)
    return LayerFootprint("kv", 2 * n_kv_heads * d_head, window)


def latent_layer(d_latent: int, d_rope: int) -> LayerFootprint:
    """A latent and a rotary key shared by every head: ``d_latent +
    d_rope``."""
    d_latent = _validate.positive_int("d_latent", d_latent)
    d_rope = _validate.nonnegative_int("d_rope", d_rope)
    return LayerFootprint("latent", d_latent + d_rope)


def shared_layer() -> LayerFootprint:
    """A layer that attends with an earlier layer's cache: nothing of its
    own."""
    return LayerFootprint("shared", 0)


def cache_bytes(layers, n_tokens: int, bytes_per_element: float = 2) -> float:
    """Bytes of the cache of one sequence of ``n_tokens`` tokens: every
    layer's ``elements`` times the positions it holds, times
    ``bytes_per_element`` (2 in bf16, 1 in fp8)."""
    n_tokens = _validate.positive_int("n_tokens", n_tokens)
    if not bytes_per_element > 0:
        raise ValueError(
            f"bytes_per_element must be positive; got {bytes_per_element!r}"
        )
    held = sum(layer.elements * layer.positions(n_tokens) for layer in layers)
    return held * bytes_per_element


def bytes_per_token(layers, bytes_per_element: float = 2) -> float:
    """Bytes that one token adds to every layer's cache (a sliding-window
    layer's included, until its window is full): :func:`cache_bytes` of one
    token."""
    return cache_bytes(layers, 1, bytes_per_element)


def layers_of(config) -> list[LayerFootprint]:
    """The cache of each layer of a model, from its ``transformers``
    configuration.

    DeepSeek-V2/V3 (``kv_lora_rank``): latent layers. Gemma 3n and Gemma 4:
    the last ``num_kv_shared_layers`` layers are shared (the rule of
    :func:`attnbook.latent.sharing.reuse_last_of_type`), Gemma 4's full
    layers can have their own head size and number of key/value heads
    (``per_layer_config``), and its sliding layers hold ``sliding_window``
    positions. Others (Llama, Qwen3, gpt-oss): keys and values of
    ``num_key_value_heads`` heads of ``head_dim``, windowed on the layers
    whose type is ``"sliding_attention"``.
    """
    n_layers = config.num_hidden_layers
    if getattr(config, "kv_lora_rank", None):
        layer = latent_layer(config.kv_lora_rank, config.qk_rope_head_dim)
        return [layer] * n_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * (
        n_layers
    )
    sources = reuse_last_of_type(
        types, getattr(config, "num_kv_shared_layers", 0) or 0
    )
    makers = set(producers(sources))
    per_layer = getattr(config, "per_layer_config", None)
    layers = []
    for i, kind in enumerate(types):
        if i not in makers:
            layers.append(shared_layer())
            continue
        sizes = per_layer[i] if per_layer is not None else config
        d_head = getattr(sizes, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        window = config.sliding_window if kind == "sliding_attention" else None
        layers.append(kv_layer(sizes.num_key_value_heads, d_head, window))
    return layers


@dataclass(frozen=True)
class PublishedModel:
    """A model to size (a released one, or a layout labelled as not one): its
    ``transformers`` configuration class, the published sizes its defaults
    lack (``overrides``), and ``source``, the bibliography key of the paper
    or model card that gives them. ``library_defaults`` marks a row whose
    sizes are only the defaults of the configuration class as ``transformers``
    ships them, which no paper describes; its ``source`` is then the library's
    key."""

    name: str
    config_class: str
    overrides: tuple = ()
    source: str = ""
    library_defaults: bool = False

    def config(self):
        import transformers

        return getattr(transformers, self.config_class)(**dict(self.overrides))

    def source_label(self) -> str:
        """Where the sizes come from, as chapter 13's table prints it: the
        bibliography key, or for a row of library defaults the configuration
        class and the installed ``transformers`` version."""
        if not self.library_defaults:
            return self.source
        import transformers

        return f"{self.config_class}, transformers {transformers.__version__}"

    def layers(self) -> list[LayerFootprint]:
        return layers_of(self.config())


#: Llama-2-7B, DeepSeek-V3 and gpt-oss-120b are the defaults of their
#: configuration classes (LlamaConfig, DeepseekV3Config, GptOssConfig), which
#: match their papers: Llama 2, Touvron et al. (2023); DeepSeek-V3 (61 layers,
#: kv_lora_rank 512, qk_rope_head_dim 64), DeepSeek-AI (2024),
#: section 4.2; gpt-oss-120b (36 layers alternating full and 128-token banded
#: windows, 8 key/value heads of 64), OpenAI (2025). Llama-3-8B and 70B:
#: Grattafiori et al. (2024), Table 3 (32 and 80 layers, 8 key/value heads of
#: 128). Qwen3-8B: Yang et al. (2025), Table 1 (36 layers, 32 query and 8
#: key/value heads of 128). gpt-oss-20b: 24 layers, the rest as 120b (OpenAI
#: 2025). Gemma 3n E4B and the Gemma-4-style layout: the defaults of
#: transformers' Gemma3nTextConfig and Gemma4TextConfig, as transformers 5.23
#: ships them. The first is the layout its docstring names, Gemma 3n E4B (35
#: layers, 2 key/value heads of 256, window 512, 15 shared layers), not
#: checked here against the released file; the second (30 layers, no
#: shared layer) is no released Gemma 4 checkpoint.
PUBLISHED = (
    PublishedModel("Llama-2-7B", "LlamaConfig", (), "touvron2023llama"),
    PublishedModel(
        "Llama-3-8B",
        "LlamaConfig",
        (("num_key_value_heads", 8),),
        "grattafiori2024llama3",
    ),
    PublishedModel(
        "Llama-3-70B",
        "LlamaConfig",
        (
            ("hidden_size", 8192),
            ("num_hidden_layers", 80),
            ("num_attention_heads", 64),
            ("num_key_value_heads", 8),
        ),
        "grattafiori2024llama3",
    ),
    PublishedModel(
        "Qwen3-8B",
        "Qwen3Config",
        (("num_hidden_layers", 36), ("num_key_value_heads", 8)),
        "yang2025qwen3",
    ),
    PublishedModel("gpt-oss-120b", "GptOssConfig", (), "openai2025gptoss"),
    PublishedModel(
        "gpt-oss-20b",
        "GptOssConfig",
        (("num_hidden_layers", 24),),
        "openai2025gptoss",
    ),
    PublishedModel("DeepSeek-V3", "DeepseekV3Config", (), "deepseekai2024v3"),
    PublishedModel(
        "Gemma 3n E4B (transformers defaults)",
        "Gemma3nTextConfig",
        (),
        "wolf2020transformers",
        library_defaults=True,
    ),
    PublishedModel(
        "Gemma-4-style layout (transformers defaults; not a released "
        "checkpoint)",
        "Gemma4TextConfig",
        (),
        "wolf2020transformers",
        library_defaults=True,
    ),
)
