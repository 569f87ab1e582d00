"""attnbook: the code of the textbook *Attention, Derived*.

Every chapter imports this package; the functions here are the ones the
chapters derive, and the ones the tests check against independent references.
The top level is the library (mechanisms, models, tools), which later chapters
build on; the code that exists to produce one chapter's numbers is in
:mod:`attnbook.experiments`, which the library never imports. CONTRIBUTING.md
maps every chapter to the modules whose code it shows.
"""

from .attention import attention_scores, scaled_dot_product_attention
from .flash import flash_attention_numpy
from .masks import causal_mask, sliding_window_mask
from .positional import (
    alibi_bias,
    alibi_slopes,
    apply_rope,
    sinusoidal_positions,
)
from .projections import project_qkv, single_head_attention
from .softmax import log_softmax, logsumexp, softmax, softmax_jacobian
from .source import show_source

__version__ = "0.1.0"


# The torch layer loads on first use, so that the numpy-only chapters never
# wait for torch, and Triton (slow to import, and told to interpret when there
# is no GPU) loads only when asked for.
_LAZY = {
    "KVCache": "kv_cache",
    "kv_cache_bytes": "kv_cache",
    "MultiHeadAttention": "multihead",
    "attend": "torch_attention",
    "repeat_kv": "torch_attention",
    "grouped_query_attention": "gqa",
    "mha_to_gqa": "gqa",
    "load_minilm": "minilm",
    "triton_flash_attention": "kernels",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(
            importlib.import_module(f".{_LAZY[name]}", __name__), name
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "attend",
    "kv_cache_bytes",
    "repeat_kv",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "attention_scores",
    "causal_mask",
    "flash_attention_numpy",
    "grouped_query_attention",
    "load_minilm",
    "log_softmax",
    "logsumexp",
    "mha_to_gqa",
    "project_qkv",
    "scaled_dot_product_attention",
    "show_source",
    "single_head_attention",
    "sinusoidal_positions",
    "sliding_window_mask",
    "softmax",
    "softmax_jacobian",
    "triton_flash_attention",
]
