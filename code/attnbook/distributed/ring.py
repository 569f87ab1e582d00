"""Ring attention (Liu et al. 2023): each rank keeps its queries while blocks
of keys and values pass around a ring of ranks; the partial results merge with
chapter 9's merge of softmax states (:func:`attnbook.merge_splits`).

Chapter 11 (attention across devices) shows it. The rank-local steps
(:func:`block_attention`, :func:`ring_forward_step`, :func:`block_backward`)
are pure functions of tensors; :func:`simulate_ring` and
:func:`simulate_ring_backward` run them for every rank in one process, in the
order the ring runs them, and :func:`ring_attention` runs them on
``torch.distributed`` with autograd: run here with gloo on CPU processes. On
GPUs NCCL carries only CUDA tensors, while the length and shape checks
all-gather small CPU tensors, so a process group there needs a CPU backend
beside NCCL (``backend="cpu:gloo,cuda:nccl"``); that path is untested.

Shapes: on each rank q (b, h, n_local, d), k and v (b, n_kv_heads, n_local,
d) with ``n_kv_heads`` dividing ``h`` (grouped-query attention), and
``positions`` (n_local,) int64, the global positions of the rank's tokens.
Ranks may hold different numbers of tokens, none included. With ``causal``,
query position i sees key position j when j <= i, whatever the layout.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..torch_attention import merge_splits, repeat_kv
from .launch import check_same_shapes, gather_lengths


def check_shard(q, k, v, positions) -> tuple[int, int]:
    """Check one rank's shard; return (group size, n_local)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must be (batch, heads, n_local, d); got shape "
                f"{tuple(x.shape)}"
            )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same "
            "batch, heads and length"
        )
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same "
            "batch and length"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same d"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q's heads ({q.shape[1]}) are not divisible by k's heads "
            f"({k.shape[1]})"
        )
    if positions.ndim != 1 or positions.shape[0] != q.shape[2]:
        raise ValueError(
            f"positions {tuple(positions.shape)} must be (n_local,) with "
            f"n_local={q.shape[2]}"
        )
    return q.shape[1] // k.shape[1], q.shape[2]


def group_sum(x, n_kv_heads: int):
    """(b, h, n, d) -> (b, n_kv_heads, n, d): the sum over each key/value
    head's group of query heads (the backward of
    :func:`attnbook.repeat_kv`)."""
    b, h, n, d = x.shape
    return x.reshape(b, n_kv_heads, h // n_kv_heads, n, d).sum(dim=2)


def work_dtype(x):
    """The dtype the ring computes and accumulates in: float32 for float16
    and bfloat16 (scores, sums of exponentials and gradient sums need its
    range and precision), the input's own otherwise."""
    return torch.promote_types(x.dtype, torch.float32)


def block_scores(q, k, pos_q, pos_k, causal: bool, scale: float):
    """Scaled scores of q against one block of keys, -inf where causality
    forbids: (b, h, n_q, n_k), in :func:`work_dtype`."""
    work = work_dtype(q)
    k = repeat_kv(k.to(work), q.shape[1] // k.shape[1])
    scores = (q.to(work) @ k.transpose(-2, -1)) * scale
    if causal:
        # (n_q, n_k): key position after query position
        future = pos_k[None, :] > pos_q[:, None]
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def block_attention(q, k, v, pos_q, pos_k, causal=False, scale=None):
    """Attention of q over one block of keys, with its log-sum-exp.

    Returns ``out`` (b, h, n_q, d), normalised over this block alone, and
    ``lse`` (b, h, n_q), both in :func:`work_dtype`. A row with no visible
    key (fully masked, or an empty block) gets lse -inf and output 0, as
    :func:`attnbook.merge_splits` expects.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    # (b, h, n_q, n_k)
    scores = block_scores(q, k, pos_q, pos_k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)  # (b, h, n_q)
    # a row with no key: exp(-inf - 0) = 0, not NaN
    safe = torch.where(torch.isneginf(lse), 0.0, lse)
    p = torch.exp(scores - safe[..., None])
    v = repeat_kv(v.to(p.dtype), q.shape[1] // v.shape[1])
    return p @ v, lse


def ring_forward_step(q, k, v, pos_q, pos_k, out, lse, causal, scale):
    """One rank's step: attend over the visiting block, merge into (out,
    lse)."""
    out_b, lse_b = block_attention(q, k, v, pos_q, pos_k, causal, scale)
    return merge_splits(torch.stack([out, out_b]), torch.stack([lse, lse_b]))


def block_backward(q, k, v, pos_q, pos_k, d_out, lse, delta, causal, scale):
    """One rank's backward step (FlashAttention-2): the gradients that the
    visiting block's scores give.

    ``lse`` is the *final* log-sum-exp of each query row (over all keys) and
    ``delta = rowsum(d_out * out)``, so that ``p = exp(s - lse)`` are the
    final weights of this block's keys. Returns ``(dq, dk, dv)`` in
    :func:`work_dtype`: dq stays on the rank, dk and dv (summed over each
    key/value head's group) travel with the block.
    """
    n_kv_heads = k.shape[1]
    scores = block_scores(q, k, pos_q, pos_k, causal, scale)
    q, k, v, d_out = (x.to(scores.dtype) for x in (q, k, v, d_out))
    safe = torch.where(torch.isneginf(lse), 0.0, lse)
    p = torch.exp(scores - safe[..., None])  # (b, h, n_q, n_k)
    v_rep = repeat_kv(v, q.shape[1] // n_kv_heads)
    dv = group_sum(p.transpose(-2, -1) @ d_out, n_kv_heads)
    dp = d_out @ v_rep.transpose(-2, -1)  # (b, h, n_q, n_k)
    ds = p * (dp - delta[..., None])  # softmax's backward
    dq = (ds @ repeat_kv(k, q.shape[1] // n_kv_heads)) * scale
    dk = group_sum(ds.transpose(-2, -1) @ q, n_kv_heads) * scale
    return dq, dk, dv


def initial_state(q, v):
    """The merge's identity: output 0 and lse -inf for every query (in
    :func:`work_dtype`)."""
    work = work_dtype(q)
    out = q.new_zeros(q.shape[:3] + v.shape[3:], dtype=work)
    lse = q.new_full(q.shape[:3], float("-inf"), dtype=work)
    return out, lse


def simulate_ring(qs, ks, vs, positions, causal=False, scale=None):
    """Ring attention's forward pass, every rank in one process.

    ``qs``, ``ks``, ``vs``, ``positions``: one shard per rank. At step s rank
    r holds the block of rank ``(r - s) mod P``. Returns the lists ``outs``
    and ``lses`` (each rank's output and log-sum-exp).
    """
    world_size = len(qs)
    if scale is None:
        scale = 1.0 / math.sqrt(qs[0].shape[-1])
    states = [initial_state(q, v) for q, v in zip(qs, vs)]
    for step in range(world_size):
        for r in range(world_size):
            j = (r - step) % world_size  # the block visiting rank r
            states[r] = ring_forward_step(
                qs[r], ks[j], vs[j], positions[r], positions[j],
                *states[r], causal, scale,
            )  # fmt: skip
    return [o for o, _ in states], [lse for _, lse in states]


def simulate_ring_backward(
    qs, ks, vs, positions, outs, lses, d_outs, causal=False, scale=None
):
    """Ring attention's backward pass, every rank in one process.

    dk and dv of block j accumulate as the block travels: rank r adds its
    contribution when the block visits it, in the ring's order. Returns the
    lists ``dqs``, ``dks``, ``dvs``.
    """
    world_size = len(qs)
    if scale is None:
        scale = 1.0 / math.sqrt(qs[0].shape[-1])
    deltas = [(do * o).sum(dim=-1) for do, o in zip(d_outs, outs)]
    work = work_dtype(qs[0])
    dqs = [torch.zeros_like(q, dtype=work) for q in qs]
    dks = [torch.zeros_like(k, dtype=work) for k in ks]
    dvs = [torch.zeros_like(v, dtype=work) for v in vs]
    for step in range(world_size):
        for r in range(world_size):
            j = (r - step) % world_size
            dq, dk, dv = block_backward(
                qs[r], ks[j], vs[j], positions[r], positions[j],
                d_outs[r], lses[r], deltas[r], causal, scale,
            )  # fmt: skip
            dqs[r] = dqs[r] + dq
            dks[j] = dks[j] + dk
            dvs[j] = dvs[j] + dv
    return dqs, dks, dvs


def post_ring_transfer(send, recv, group=None, tag=0):
    """Send ``send`` to the next rank and receive ``recv`` from the previous
    one, without waiting: returns the requests."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    if group is not None:
        nxt = dist.get_global_rank(group, nxt)
        prev = dist.get_global_rank(group, prev)
    ops = [dist.P2POp(dist.isend, t, nxt, group, tag) for t in send]
    ops += [dist.P2POp(dist.irecv, t, prev, group, tag) for t in recv]
    return dist.batch_isend_irecv(ops)


def wait_all(requests) -> None:
    for request in requests:
        request.wait()


def empty_block(x, n: int):
    """A receive buffer like x's block, of length n."""
    return x.new_empty(x.shape[:2] + (n,) + x.shape[3:])


def ring_forward(q, k, v, positions, causal, scale, group=None):
    """The forward ring on this rank: returns (out, lse), in
    :func:`work_dtype`.

    At step s the rank first posts the transfer of the block it holds to the
    next rank (and the receive of the next block from the previous one), then
    computes with the block it holds, then waits: the transfer overlaps the
    compute.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    lengths = gather_lengths(q.shape[2], group)
    out, lse = initial_state(q, v)
    block = (k, v, positions)
    for step in range(world_size):
        if step < world_size - 1:
            n_next = lengths[(rank - step - 1) % world_size]
            incoming = tuple(empty_block(x, n_next) for x in block[:2])
            incoming += (positions.new_empty(n_next),)
            requests = post_ring_transfer(block, incoming, group)
        k_b, v_b, pos_b = block
        out, lse = ring_forward_step(
            q, k_b, v_b, positions, pos_b, out, lse, causal, scale
        )
        if step < world_size - 1:
            wait_all(requests)
            block = incoming
    return out, lse


def ring_backward(q, k, v, positions, out, lse, d_out, causal, scale, group):
    """The backward ring on this rank: returns (dq, dk, dv).

    k and v travel as in the forward pass; each block's dk and dv
    accumulators travel one step behind it, and a last transfer brings them
    home to the block's owner.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    lengths = gather_lengths(q.shape[2], group)
    delta = (d_out * out).sum(dim=-1)  # (b, h, n_local)
    work = work_dtype(q)
    dq = torch.zeros_like(q, dtype=work)
    # the accumulators of the block this rank holds
    dk = torch.zeros_like(k, dtype=work)
    dv = torch.zeros_like(v, dtype=work)
    block, grads_in, grad_requests = (k, v, positions), None, []
    for step in range(world_size):
        n_next = lengths[(rank - step - 1) % world_size]
        if step < world_size - 1:
            incoming = tuple(empty_block(x, n_next) for x in block[:2])
            incoming += (positions.new_empty(n_next),)
            requests = post_ring_transfer(block, incoming, group)
        dq_b, dk_b, dv_b = block_backward(
            q, *block[:2], positions, block[2], d_out, lse, delta,
            causal, scale,
        )  # fmt: skip
        dq = dq + dq_b
        wait_all(grad_requests)  # this block's accumulators have arrived
        if grads_in is not None:
            dk, dv = grads_in
        dk, dv = dk + dk_b, dv + dv_b
        if world_size > 1:
            # the next block's accumulators come in as this one's go out
            grads_in = (empty_block(dk, n_next), empty_block(dv, n_next))
            grad_requests = post_ring_transfer((dk, dv), grads_in, group, 1)
        if step < world_size - 1:
            wait_all(requests)
            block = incoming
    wait_all(grad_requests)
    if grads_in is not None:
        dk, dv = grads_in  # this rank's own block, home again
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Ring attention with its ring backward, for ``.backward()``."""

    @staticmethod
    def forward(ctx, q, k, v, positions, causal, scale, group):
        out, lse = ring_forward(q, k, v, positions, causal, scale, group)
        ctx.save_for_backward(q, k, v, positions, out, lse)
        ctx.causal, ctx.scale, ctx.group = causal, scale, group
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, positions, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(
            q, k, v, positions, out, lse, d_out.contiguous(),
            ctx.causal, ctx.scale, ctx.group,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, positions, causal=False, scale=None, group=None):
    """Exact attention over the whole sequence, split over the ranks of
    ``group`` (the default process group if None); differentiable.

    Call it on every rank with that rank's shard. Before the ring starts, the
    ranks compare their shapes and dtypes (a ``ValueError`` on every rank
    names a mismatch). Returns this rank's output (b, h, n_local, d).
    """
    check_shard(q, k, v, positions)
    check_same_shapes(q, k, v, group)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    k, v = k.contiguous(), v.contiguous()
    positions = positions.to(torch.int64).contiguous()
    return RingAttention.apply(q, k, v, positions, causal, scale, group)
