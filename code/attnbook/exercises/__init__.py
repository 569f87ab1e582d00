"""Exercise checkers: ``check_<name>(fn)`` runs the reader's ``fn`` and names
the mistake it sees.

On success a checker prints one line; on failure it raises
:class:`ExerciseError` (an ``AssertionError``) whose message names the failing
case, the diagnosed classic mistake, and a hint.

Every chapter's exercises import their checker from here; the checkers'
mistakes are tested in ``tests/test_exercises_*.py``.
"""

from ._framework import (
    Case,
    ExerciseError,
    Mistake,
    NotAttemptedError,
    run_checks,
)
from .attention import check_attention, check_causal_mask, check_softmax
from .embeddings import check_cosine_similarity, check_ppmi
from .embeddings import check_embedding_grad
from .flash import check_merge_softmax_states, check_online_softmax
from .flash import check_blockwise_attention_backward
from .gqa_decode import check_grouped_decode_step
from .kv_cache import check_kv_cache_step
from .kv_cache import check_ring_decode_step
from .latent import check_absorbed_decode_step, check_sharing_map
from .masking import check_padding_mask
from .multihead import check_strided_to_blocked
from .perspectives import check_chunked_causal_linear_attention
from .masking import check_packed_block_mask
from .perspectives import check_linear_attention, check_nadaraya_watson
from .qkv import (
    check_attention_scores,
    check_cross_attention,
    check_packed_cross_attention,
    check_packed_scores,
)
from .qkv import check_realise_pattern
from .softmax_backward import check_attention_backward
from .relative_positions import check_shaw_attention
from .serving import check_block_slots, check_paged_decode

__all__ = [
    "Case",
    "ExerciseError",
    "Mistake",
    "NotAttemptedError",
    "run_checks",
    "check_alibi_bias",
    "check_absorbed_decode_step",
    "check_attention",
    "check_attention_backward",
    "check_blockwise_attention_backward",
    "check_block_slots",
    "check_attention_scores",
    "check_benchmark_flops",
    "check_causal_mask",
    "check_chunked_causal_linear_attention",
    "check_causal_topk",
    "check_tiled_sparse_attention",
    "check_cosine_similarity",
    "check_cross_attention",
    "check_delta_step_backward",
    "check_dot_variance",
    "check_embedding_grad",
    "check_exact_memory",
    "check_grouped_decode_step",
    "check_key_blocks",
    "check_kv_cache_step",
    "check_linear_attention",
    "check_merge_kernel",
    "check_merge_softmax_states",
    "check_multihead_attention",
    "check_nadaraya_watson",
    "check_online_softmax",
    "check_overlap_tokens",
    "check_packed_block_mask",
    "check_packed_cross_attention",
    "check_packed_sliding_mask_mod",
    "check_packed_scores",
    "check_padding_mask",
    "check_paged_decode",
    "check_pool_kv_heads",
    "check_ppmi",
    "check_realise_pattern",
    "check_ring_decode_step",
    "check_rope_attention",
    "check_scaled_scores",
    "check_score_std",
    "check_shaw_attention",
    "check_share_kv_heads",
    "check_sharing_map",
    "check_softmax",
    "check_split_qkv",
    "check_strided_to_blocked",
    "check_zigzag_positions",
]

# Checkers whose modules import torch load on first use, so that `import
# attnbook.exercises` stays fast in the numpy-only chapters.
_LAZY = {
    "check_dot_variance": "scaling",
    "check_scaled_scores": "scaling",
    "check_score_std": "scaling",
    "check_key_blocks": "triton_flash",
    "check_benchmark_flops": "triton_flash",
    "check_split_qkv": "multihead",
    "check_multihead_attention": "multihead",
    "check_rope_attention": "positional",
    "check_alibi_bias": "positional",
    "check_merge_kernel": "flash_decoding",
    "check_share_kv_heads": "gqa",
    "check_pool_kv_heads": "gqa",
    # FlexAttention's mask_mod and the top-k reference need torch at import:
    # in the browser these checkers do not load, so the chapter gets no
    # exercise notebook there (scripts/build_lite.py)
    "check_causal_topk": "sparse",
    "check_packed_sliding_mask_mod": "sparse",
    "check_tiled_sparse_attention": "sparse",
    # torch tensors in, like the chapter's package (no browser notebook)
    "check_exact_memory": "delta",
    "check_delta_step_backward": "delta",
    # chapter 11's: numpy, but through attnbook.distributed, whose package
    # also holds the torch.distributed code
    "check_zigzag_positions": "context_parallel",
    "check_overlap_tokens": "context_parallel",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(
            importlib.import_module(f".{_LAZY[name]}", __name__), name
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: For each checker, the package functions whose source would answer its
#: exercise as it stands (copied, with at most names changed), or all but
#: its last step (log_softmax's for the softmax's). A chapter does
#: not show them (``attnbook.show_source``) before the exercise that asks for
#: them; its solution may (tests/test_exercise_order.py). An empty entry: no
#: single function of the package answers the exercise.
ANSWERS: dict[str, tuple[str, ...]] = {
    "check_absorbed_decode_step": ("attnbook.latent.mla.absorbed_attention",),
    # the slopes for a head count that is not a power of two are the hard
    # part of the exercise
    "check_alibi_bias": (
        "attnbook.positional.alibi_bias",
        "attnbook.positional.alibi_slopes",
    ),
    "check_attention": ("attnbook.attention.scaled_dot_product_attention",),
    # the package's backward pass is chapter 9's, blocked and from the saved
    # log-sum-exp: not this exercise's dense one
    "check_attention_backward": (),
    "check_blockwise_attention_backward": (
        "attnbook.flash.flash_attention_backward_numpy",
    ),
    "check_block_slots": (
        "attnbook.serving.block_table.slot_indices",
        "attnbook.serving.paged_cache.slots",
    ),
    "check_attention_scores": (),
    "check_benchmark_flops": ("attnbook.cost.benchmark_flops",),
    "check_causal_mask": ("attnbook.masks.causal_mask",),
    "check_causal_topk": ("attnbook.sparse.indexer.causal_topk",),
    "check_chunked_causal_linear_attention": (
        "attnbook.linear_attention.attention_from_features",
    ),
    "check_cosine_similarity": ("attnbook.embeddings.cosine_similarity",),
    # the package steps forward only; autograd does its backward pass
    "check_delta_step_backward": (),
    # chapter 2 shows single_head_attention, which computes it (the chapter's
    # exercise now asks for the packed layout: check_packed_cross_attention)
    "check_cross_attention": ("attnbook.projections.single_head_attention",),
    "check_dot_variance": ("attnbook.scaling.dot_product_variance",),
    "check_embedding_grad": ("attnbook.embeddings.embedding_grad",),
    "check_exact_memory": (
        "attnbook.experiments.delta_capacity.least_squares_state",
    ),
    # grouped_query_attention takes a mask per query head and torch tensors,
    # but its reshape into one tile per group is the exercise's core: chapter
    # 11 shows it in the solution only
    "check_grouped_decode_step": ("attnbook.gqa.grouped_query_attention",),
    # the host-side twin of the kernel's key_range; the kernel's own helper
    # is a near answer (tests/test_exercise_order.py, NEAR_ANSWERS)
    "check_key_blocks": ("attnbook.kernels.host.key_block_bounds",),
    "check_kv_cache_step": (),
    "check_linear_attention": (
        "attnbook.linear_attention.attention_from_features",
    ),
    # a @triton.jit kernel; no package kernel merges. merge_splits, the same
    # merge in torch, is a near answer: chapter 10 shows it in the solution
    # only (tests/test_exercise_order.py, NEAR_ANSWERS)
    "check_merge_kernel": (),
    "check_merge_softmax_states": (
        "attnbook.online_softmax.merge_softmax_states",
    ),
    # the split and merge without a loop are the exercise; the torch
    # layer's forward does all of it and is shown in the solution only
    # (tests/test_exercise_order.py, NEAR_ANSWERS)
    "check_multihead_attention": (
        "attnbook.heads.split_heads",
        "attnbook.heads.merge_heads",
    ),
    "check_nadaraya_watson": ("attnbook.kernel_smoothing.nadaraya_watson",),
    "check_online_softmax": ("attnbook.online_softmax.online_softmax_state",),
    # overlap_tokens computes the threshold from a link in bytes per second
    # and rounds it up: its source answers the exercise
    "check_overlap_tokens": ("attnbook.distributed.cost.overlap_tokens",),
    # no function of the package classifies the tiles of a mask
    "check_packed_block_mask": (),
    # chapter 2 shows single_head_attention, which takes a mask; the exercise
    # is to build the mask of the packed layout, which no function shows
    "check_packed_cross_attention": (),
    # the package has the document and the window as two mask_mods
    # (attnbook.sparse.flex), not their combination, but together their
    # sources are the answer (and_masks of them passes; issue 31, student
    # report 1314)
    "check_packed_sliding_mask_mod": (
        "attnbook.sparse.flex.sliding_window",
        "attnbook.sparse.flex.document",
    ),
    "check_packed_scores": (),
    # the chapter shows block_sparse_attend before the exercise: it reads a
    # BlockMask that create_block_mask made and attends over each query
    # block's gathered keys at once; the exercise classifies the tiles itself
    # and merges them one by one with an online softmax, which no function
    # of the package does
    "check_tiled_sparse_attention": (),
    # padding_mask is all of it but the query axis (issue 31, student
    # report 07)
    "check_padding_mask": (
        "attnbook.padding.key_padding_mask",
        "attnbook.padding.padding_mask",
    ),
    # paged_attention (gathered, numpy and torch) has the exercise's signature
    # up to the query's shape and passes its checker (issue 31, student
    # report 1314)
    "check_paged_decode": (
        "attnbook.serving.paged_cache.paged_decode",
        "attnbook.serving.paged_cache.paged_attention",
        "attnbook.serving.block_table.paged_attention",
    ),
    "check_pool_kv_heads": ("attnbook.gqa.pool_kv_heads",),
    "check_ppmi": ("attnbook.embeddings.ppmi",),
    "check_realise_pattern": (),
    # chapter 8 shows RollingKVCache.update, which answers most of the ring
    # exercise, only in its solution; it cannot be listed here, since the test
    # matches the last name, and KVCache.update (no answer) is shown earlier
    "check_ring_decode_step": (),
    # the attention step of chapter 6's experiment rotates q and k (at the
    # same positions: the exercise puts the queries at the end of the keys)
    "check_rope_attention": (
        "attnbook.experiments.extrapolation.PositionalAttention",
    ),
    # the package's scores; chapter 3 calls it before the exercise, which
    # asks for the batched case that its RecallAttention.score_table (2-D)
    # does not show
    "check_scaled_scores": ("attnbook.attention.attention_scores",),
    "check_score_std": ("attnbook.scaling.score_std",),
    # no package function computes it; the chapter shows the index
    # (shaw_relative_index), not the attention
    "check_shaw_attention": (),
    # kv_head_of lists the head numbers to index with: all of the answer but
    # the indexing (chapter 12 calls it, and the exercise rules it out; issue
    # 31, student report 1112)
    "check_share_kv_heads": (
        "attnbook.torch_attention.repeat_kv",
        "attnbook.gqa.kv_head_of",
    ),
    "check_sharing_map": ("attnbook.latent.sharing.reuse_last_of_type",),
    # logsumexp and log_softmax shift by the same maximum with the same
    # helper: their source is the answer but for the last division
    "check_softmax": (
        "attnbook.softmax.softmax",
        "attnbook.softmax.logsumexp",
        "attnbook.softmax.log_softmax",
    ),
    # each third is split as split_heads splits
    "check_split_qkv": ("attnbook.heads.split_heads",),
    # no function of the package converts a strided layer's weights
    "check_strided_to_blocked": (),
    "check_zigzag_positions": (
        "attnbook.distributed.layouts.layout_positions",
        "attnbook.distributed.layouts.positions_numpy",
    ),
}
