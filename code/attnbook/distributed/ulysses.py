"""DeepSpeed-Ulysses (Jacobs et al. 2023): re-shard from sequence to heads
with one all-to-all, attend over the whole sequence with a share of the
heads, and re-shard back.

Chapter 11 (attention across devices) shows it. On each rank q (b, h,
n_local, d), k and v (b, h_kv, n_local, d) and ``positions`` (n_local,) as in
:mod:`attnbook.distributed.ring`; ranks may hold different numbers of tokens.
The all-to-all is linear, so its backward is the reverse all-to-all
(:class:`SeqToHeads`). The heads, and grouped-query attention's key/value
heads, must be divisible by the number of ranks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..torch_attention import attend, repeat_kv
from .launch import check_same_shapes, gather_lengths
from .ring import check_shard


def check_heads(n_heads: int, n_kv_heads: int, world_size: int) -> None:
    """Raise unless both head counts are divisible by the world size."""
    for name, n in (("heads", n_heads), ("key/value heads", n_kv_heads)):
        if n % world_size:
            raise ValueError(
                f"Ulysses splits the {name} over the ranks: {n} {name} are "
                f"not divisible by world size {world_size} (ring attention "
                "has no such limit)"
            )


def seq_to_heads(x, lengths, group=None):
    """(b, h, n_local, d) sequence shard -> (b, h/P, n, d) head shard.

    Rank r sends its tokens of head group j to rank j and receives every
    rank's tokens of head group r, concatenated in rank order.
    """
    world_size = dist.get_world_size(group)
    b, h, n_local, d = x.shape
    hp = h // world_size
    # (P, b, h/P, n_local, d): the piece for each destination, in order
    send = x.reshape(b, world_size, hp, n_local, d).transpose(0, 1)
    send = send.contiguous().reshape(-1)
    recv = x.new_empty(b * hp * sum(lengths) * d)
    sizes = [b * hp * n * d for n in lengths]
    dist.all_to_all_single(
        recv, send, sizes, [send.numel() // world_size] * world_size, group
    )
    pieces = recv.split(sizes)
    return torch.cat(
        [p.reshape(b, hp, n, d) for p, n in zip(pieces, lengths)], dim=2
    )


def heads_to_seq(y, lengths, group=None):
    """(b, h/P, n, d) head shard -> (b, h, n_local, d) sequence shard: the
    inverse of :func:`seq_to_heads`."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    b, hp, _, d = y.shape
    n_local = lengths[rank]
    send = torch.cat(
        [p.reshape(-1) for p in y.split(lengths, dim=2)]
    ).contiguous()
    recv = y.new_empty(world_size * b * hp * n_local * d)
    sizes = [b * hp * n * d for n in lengths]
    dist.all_to_all_single(
        recv, send, [recv.numel() // world_size] * world_size, sizes, group
    )
    # (P, b, h/P, n_local, d) -> (b, h, n_local, d)
    recv = recv.reshape(world_size, b, hp, n_local, d).transpose(0, 1)
    return recv.reshape(b, world_size * hp, n_local, d)


class SeqToHeads(torch.autograd.Function):
    """:func:`seq_to_heads`, whose backward is :func:`heads_to_seq`."""

    @staticmethod
    def forward(ctx, x, lengths, group):
        ctx.lengths, ctx.group = lengths, group
        return seq_to_heads(x.contiguous(), lengths, group)

    @staticmethod
    def backward(ctx, grad):
        return (
            heads_to_seq(grad.contiguous(), ctx.lengths, ctx.group),
            None,
            None,
        )


class HeadsToSeq(torch.autograd.Function):
    """:func:`heads_to_seq`, whose backward is :func:`seq_to_heads`."""

    @staticmethod
    def forward(ctx, y, lengths, group):
        ctx.lengths, ctx.group = lengths, group
        return heads_to_seq(y.contiguous(), lengths, group)

    @staticmethod
    def backward(ctx, grad):
        return (
            seq_to_heads(grad.contiguous(), ctx.lengths, ctx.group),
            None,
            None,
        )


def gather_positions(positions, lengths, group=None):
    """Every rank's positions, concatenated in rank order (n,)."""
    world_size = dist.get_world_size(group)
    longest = max(lengths)
    padded = positions.new_zeros(longest)
    padded[: positions.shape[0]] = positions
    every = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(every, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(every, lengths)])


def ulysses_attention(
    q, k, v, positions, causal=False, scale=None, group=None
):
    """Exact attention over the whole sequence with the heads split over the
    ranks; differentiable. Call it on every rank with its sequence shard;
    returns this rank's output (b, h, n_local, d)."""
    check_shard(q, k, v, positions)
    check_same_shapes(q, k, v, group)
    world_size = dist.get_world_size(group)
    check_heads(q.shape[1], k.shape[1], world_size)
    lengths = gather_lengths(q.shape[2], group)
    # (n,): the global position of each token of the head shards
    pos = gather_positions(positions.to(torch.int64), lengths, group)
    q_h, k_h, v_h = (SeqToHeads.apply(x, lengths, group) for x in (q, k, v))
    mask = pos[None, :] <= pos[:, None] if causal else None
    group_size = q.shape[1] // k.shape[1]
    out = attend(
        q_h,
        repeat_kv(k_h, group_size),
        repeat_kv(v_h, group_size),
        mask=mask,
        scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
    )
    return HeadsToSeq.apply(out, lengths, group)
