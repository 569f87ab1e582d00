"""attnbook: the code of the textbook *Attention, Derived*.

Every chapter imports this package; the functions here are the ones the chapters
derive, and the ones the tests check against independent references.
"""
from .attention import attention_scores, scaled_dot_product_attention
from .flash import flash_attention_numpy
from .masks import causal_mask, sliding_window_mask
from .projections import project_qkv, single_head_attention
from .softmax import log_softmax, logsumexp, softmax, softmax_jacobian
from .source import show_source

__version__ = "0.1.0"


def __getattr__(name):
    # Loaded on first use: importing Triton is slow, and without a GPU it must first be told to
    # interpret (attnbook.triton_flash does that), so `import attnbook` never imports it.
    if name == "triton_flash_attention":
        from .triton_flash import triton_flash_attention

        return triton_flash_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "attention_scores", "causal_mask", "flash_attention_numpy", "log_softmax", "logsumexp", "project_qkv",
    "scaled_dot_product_attention", "show_source", "single_head_attention", "sliding_window_mask",
    "softmax", "softmax_jacobian", "triton_flash_attention",
]
