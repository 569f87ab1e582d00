"""Block tables: where each position of a sequence lives in a paged cache, and
the gather that reads a sequence's keys and values back in order (numpy).

A paged cache stores keys (or values) as ``blocks`` of shape (n_blocks,
block_size, ...): block ``b`` holds ``block_size`` consecutive positions of
whichever sequence owns it. A sequence's *block table* lists its blocks in
order, so position ``p`` lives in block ``table[p // block_size]`` at offset
``p % block_size``. Only the last block of a sequence may be part-filled (the
*ragged* last block); the gather reads ``length`` positions and never the
unfilled tail.

Chapter 15 (serving) shows :func:`slot_indices`, :func:`gather` and
:func:`paged_attention`; :mod:`attnbook.serving.paged_cache` does the same in
torch.
"""

from __future__ import annotations

import numpy as np

from .. import _validate
from ..attention import scaled_dot_product_attention
from ..masks import causal_mask


def check_table(table, length: int, block_size: int, n_blocks: int):
    """``table`` as an int64 array, checked to hold ``length`` positions of
    blocks of ``block_size`` out of ``n_blocks``."""
    length = _validate.nonnegative_int("length", length)
    block_size = _validate.positive_int("block_size", block_size)
    table = np.asarray(table, dtype=np.int64).reshape(-1)
    need = -(-length // block_size)
    if len(table) < need:
        raise ValueError(
            f"a block table of {len(table)} blocks of {block_size} positions "
            f"cannot hold length={length} (needs {need})"
        )
    if len(table) and (table.min() < 0 or table.max() >= n_blocks):
        raise ValueError(
            f"block ids must lie in [0, {n_blocks}); the table holds "
            f"{table.min()}..{table.max()}"
        )
    return table, length, block_size


def slot_indices(table, length: int, block_size: int) -> np.ndarray:
    """int64 (length,): the flat slot ``block * block_size + offset`` of each
    position ``0 .. length - 1`` of the sequence whose block table is
    ``table``."""
    positions = np.arange(length)
    table = np.asarray(table, dtype=np.int64).reshape(-1)
    return table[positions // block_size] * block_size + (
        positions % block_size
    )


def gather(blocks: np.ndarray, table, length: int) -> np.ndarray:
    """The first ``length`` positions of a sequence, in order, read from
    ``blocks`` (n_blocks, block_size, ...) through its block ``table``:
    returns (length, ...)."""
    if blocks.ndim < 2:
        raise ValueError(
            "blocks must have shape (n_blocks, block_size, ...); got "
            f"{blocks.shape}"
        )
    n_blocks, block_size = blocks.shape[:2]
    table, length, block_size = check_table(
        table, length, block_size, n_blocks
    )
    # (n_blocks * block_size, ...): slot b * block_size + o is (b, o)
    flat = blocks.reshape(n_blocks * block_size, *blocks.shape[2:])
    return flat[slot_indices(table, length, block_size)]


def paged_attention(q, key_blocks, value_blocks, table, length: int):
    """Causal attention of the last ``n_q`` positions of a sequence over its
    first ``length``, with keys and values read through its block table.

    q: (n_heads, n_q, d); key_blocks, value_blocks: (n_blocks, block_size,
    n_heads, d). Returns (n_heads, n_q, d), what
    :func:`attnbook.scaled_dot_product_attention` gives over the contiguous
    keys and values.
    """
    # (n_heads, length, d)
    k = np.moveaxis(gather(key_blocks, table, length), 0, -2)
    v = np.moveaxis(gather(value_blocks, table, length), 0, -2)
    out, _ = scaled_dot_product_attention(
        q, k, v, mask=causal_mask(q.shape[-2], length)
    )
    return out
