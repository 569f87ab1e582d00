"""The paged KV cache in torch: the gather through a block table, attention
over it, and a cache of the protocol of chapter 8 that keeps its positions in
blocks.

:func:`gather` and :func:`paged_attention` are the torch forms of
:mod:`attnbook.serving.block_table`. :func:`paged_decode` computes the same
attention without assembling the keys: each block is attended on its own and
the per-block states (output, log-sum-exp) are combined by
:func:`attnbook.torch_attention.merge_splits`, chapter 9's merge. That is
the way of split-KV kernels (vLLM's v2 PagedAttention kernel merges
partitions of 512 tokens, FlashDecoding chunks of the sequence) taken to its
finest grain, one partition per block; vLLM's v1 kernel (Kwon et al. 2023)
instead normalises the softmax over the whole sequence before it
accumulates the values block by block.

:class:`PagedKVCache` follows :class:`attnbook.cache_protocol.KVCacheProtocol`:
``batch`` sequences, each with its own block table into one pool of blocks,
so that ``model.new_kv_cache(cache_class=PagedKVCache, block_size=4)`` runs
the tiny GPT on it unchanged.

Chapter 15 (serving) shows :func:`gather`, :func:`paged_decode` and
:meth:`PagedKVCache.update`.
"""

from __future__ import annotations

import math

import torch

from .. import _validate
from ..kv_cache import cache_shape, check_update
from ..torch_attention import attend, merge_splits
from ..masks import causal_mask
from .allocator import BlockAllocator, blocks_needed
from .block_table import check_table


def slots(table, length: int, block_size: int, device=None) -> torch.Tensor:
    """int64 (length,): the flat slot ``table[p // block_size] * block_size +
    p % block_size`` of each position ``p < length``."""
    p = torch.arange(length, device=device)
    table = torch.as_tensor(table, dtype=torch.int64, device=device)
    return table[p // block_size] * block_size + p % block_size


def gather(blocks: torch.Tensor, table, length: int) -> torch.Tensor:
    """The first ``length`` positions of a sequence, in order, from ``blocks``
    (n_blocks, block_size, ...) through its block ``table``: (length, ...)."""
    if blocks.ndim < 2:
        raise ValueError(
            "blocks must have shape (n_blocks, block_size, ...); got "
            f"{tuple(blocks.shape)}"
        )
    n_blocks, block_size = blocks.shape[:2]
    table, length, _ = check_table(table, length, block_size, n_blocks)
    flat = blocks.reshape(n_blocks * block_size, *blocks.shape[2:])
    return flat[slots(table, length, block_size, blocks.device)]


def paged_attention(q, key_blocks, value_blocks, table, length: int):
    """Causal attention of the last ``n_q`` of ``length`` positions, keys and
    values gathered through ``table``. q: (n_heads, n_q, d); key_blocks,
    value_blocks: (n_blocks, block_size, n_heads, d). Returns (n_heads, n_q,
    d)."""
    # (n_heads, length, d)
    k = gather(key_blocks, table, length).movedim(0, -2)
    v = gather(value_blocks, table, length).movedim(0, -2)
    n_q = q.shape[-2]
    _validate.queries_fit("paged_attention", n_q, length)
    mask = torch.as_tensor(causal_mask(n_q, length), device=q.device)
    return attend(q, k, v, mask)


def paged_decode(q, key_blocks, value_blocks, table, length: int):
    """One new query per head over ``length`` cached positions, block by
    block: q (n_heads, 1, d) -> (n_heads, 1, d).

    Each block of the table is attended on its own (its unfilled tail
    masked), giving an output normalised over that block and the block's
    log-sum-exp; :func:`merge_splits` combines the blocks into attention over
    all ``length`` positions.
    """
    n_blocks, block_size = key_blocks.shape[:2]
    table, length, _ = check_table(table, length, block_size, n_blocks)
    if length == 0 or q.ndim != 3 or q.shape[1] != 1:
        raise ValueError(
            "paged_decode takes q of shape (n_heads, 1, d) and length >= 1; "
            f"got q {tuple(q.shape)}, length={length}"
        )
    used = torch.as_tensor(table[: blocks_needed(length, block_size)])
    # (S, block_size, n_heads, d) -> (S, n_heads, block_size, d)
    k = key_blocks[used].movedim(2, 1)
    v = value_blocks[used].movedim(2, 1)
    # (S, 1, 1, block_size): the positions of each block below length
    filled = (
        torch.arange(len(used) * block_size).view(len(used), 1, 1, -1) < length
    )
    # (S, n_heads, 1, block_size)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~filled, float("-inf"))
    # (S, n_heads, 1): every block holds at least one position
    lse = torch.logsumexp(scores, dim=-1)
    # an unfilled slot may hold anything, NaN included: 0 * NaN is NaN
    v = v.masked_fill(~filled.transpose(-2, -1), 0.0)
    o = torch.softmax(scores, dim=-1) @ v
    out, _ = merge_splits(o, lse)
    return out


class PagedKVCache:
    """Keys and values of one attention layer for ``batch`` sequences, kept in
    blocks of ``block_size`` positions.

    ``key_blocks`` and ``value_blocks`` are (n_blocks, block_size,
    n_kv_heads, d_head), one pool for the whole batch, with ``batch *
    ceil(max_len / block_size)`` blocks; ``tables[i]`` lists the blocks of
    sequence ``i`` in order, and a block is taken from the allocator only
    when a sequence reaches it. The sequences advance together (one
    ``length``), as in :class:`attnbook.kv_cache.KVCache`.
    """

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        d_head: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        self.shape = cache_shape(batch, n_kv_heads, max_len, d_head)
        self.block_size = _validate.positive_int("block_size", block_size)
        n_blocks = batch * blocks_needed(max_len, block_size)
        self.allocator = BlockAllocator(n_blocks)
        pool = (n_blocks, block_size, n_kv_heads, d_head)
        self.key_blocks = torch.zeros(pool, dtype=dtype, device=device)
        self.value_blocks = torch.zeros(pool, dtype=dtype, device=device)
        self.tables = [[] for _ in range(batch)]
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        """Memory of the pool, its free blocks included."""
        return self.key_blocks.nbytes + self.value_blocks.nbytes

    def update(self, k, v):
        """Append k, v (batch, n_kv_heads, n_new, d_head): write them into
        each sequence's blocks (taking new blocks as needed), then gather
        every position back through the tables. Returns (keys, values), each
        (batch, n_kv_heads, length, d_head)."""
        check_update(self.shape, self.key_blocks.dtype, self.length, k, v)
        end = self.length + k.shape[2]
        for table in self.tables:
            while len(table) * self.block_size < end:
                table.append(self.allocator.allocate())
        size = self.block_size
        # (batch, n_new): where each new position goes
        new = torch.stack(
            [slots(t, end, size, k.device)[self.length :] for t in self.tables]
        )
        flat_k = self.key_blocks.view(-1, *self.key_blocks.shape[2:])
        flat_v = self.value_blocks.view(-1, *self.value_blocks.shape[2:])
        # (batch, n_new, n_kv_heads, d_head)
        flat_k[new] = k.transpose(1, 2)
        flat_v[new] = v.transpose(1, 2)
        self.length = end
        keys = torch.stack(
            [gather(self.key_blocks, t, end) for t in self.tables]
        )
        values = torch.stack(
            [gather(self.value_blocks, t, end) for t in self.tables]
        )
        # (batch, length, n_kv_heads, d) -> (batch, n_kv_heads, length, d)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def positions(self) -> torch.Tensor:
        """int64 (length,): ``0 .. length - 1``, all held."""
        return torch.arange(self.length, device=self.key_blocks.device)

    def reset(self) -> None:
        """Return every block to the free list; ``length`` 0."""
        for table in self.tables:
            for block in table:
                self.allocator.free(block)
            table.clear()
        self.length = 0

    def __repr__(self) -> str:
        b, h, max_len, d = self.shape
        return (
            f"PagedKVCache(batch={b}, n_kv_heads={h}, max_len={max_len}, "
            f"d_head={d}, block_size={self.block_size}, "
            f"length={self.length}, free blocks={self.allocator.n_free})"
        )
