"""Ring attention's rank-local steps and its single-process simulation
against attnbook.attend over the whole sequence, in float64: any partition of
the positions over the ranks, causal or not, GQA, empty shards."""

import math

import pytest
import torch

from attnbook.distributed import ring
from attnbook.torch_attention import attend, repeat_kv

TOL = 1e-10


def full_reference(q, k, v, d_out, causal):
    """out, dq, dk, dv of plain attention, by autograd."""
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    n = q.shape[2]
    group = q.shape[1] // k.shape[1]
    mask = torch.ones(n, n, dtype=torch.bool).tril() if causal else None
    out = attend(q, repeat_kv(k, group), repeat_kv(v, group), mask=mask)
    out.backward(d_out)
    return out.detach(), q.grad, k.grad, v.grad


def random_partition(n, world_size, g):
    """Positions dealt to ranks at random, in shuffled order, with uneven
    counts (some ranks may get none)."""
    owner = torch.randint(0, world_size, (n,), generator=g)
    perm = torch.randperm(n, generator=g)
    return [perm[owner[perm] == r] for r in range(world_size)]


def simulate(q, k, v, d_out, positions, causal):
    def shards(x):
        return [x[:, :, p] for p in positions]

    qs, ks, vs, dos = map(shards, (q, k, v, d_out))
    outs, lses = ring.simulate_ring(qs, ks, vs, positions, causal)
    dqs, dks, dvs = ring.simulate_ring_backward(
        qs, ks, vs, positions, outs, lses, dos, causal
    )
    wholes = []
    for parts, like in ((outs, q), (dqs, q), (dks, k), (dvs, k)):
        whole = torch.zeros(like.shape, dtype=parts[0].dtype)
        for p, part in zip(positions, parts):
            whole[:, :, p] = part
        wholes.append(whole)
    return wholes


def inputs(seed, b, h, n_kv_heads, n, d):
    g = torch.Generator().manual_seed(seed)

    def draw(heads):
        return torch.randn(b, heads, n, d, generator=g, dtype=torch.float64)

    return draw(h), draw(n_kv_heads), draw(n_kv_heads), draw(h), g


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "world_size, n, h, n_kv_heads", [(1, 5, 2, 2), (2, 7, 4, 2), (3, 10, 4, 1),
                               (4, 13, 4, 4), (4, 2, 2, 1), (5, 0, 2, 2)],
)  # fmt: skip
@pytest.mark.parametrize("seed", [0, 1])
def test_simulation_is_attention(causal, world_size, n, h, n_kv_heads, seed):
    q, k, v, d_out, g = inputs(seed, 2, h, n_kv_heads, n, 6)
    positions = random_partition(n, world_size, g)
    got = simulate(q, k, v, d_out, positions, causal)
    want = full_reference(q, k, v, d_out, causal)
    for name, x, y in zip(["out", "dq", "dk", "dv"], got, want):
        assert x.shape == y.shape
        err = float((x - y).abs().max()) if x.numel() else 0.0
        assert err < TOL, (name, err)


def test_one_rank_is_plain_attention():
    q, k, v, d_out, _ = inputs(3, 1, 4, 2, 9, 8)
    positions = [torch.arange(9)]
    for causal in (False, True):
        got = simulate(q, k, v, d_out, positions, causal)
        want = full_reference(q, k, v, d_out, causal)
        for x, y in zip(got, want):
            assert float((x - y).abs().max()) < TOL


def test_block_attention_empty_and_fully_masked_rows():
    q, k, v, _, _ = inputs(0, 1, 2, 2, 3, 4)
    # every key after every query: every row fully masked
    out, lse = ring.block_attention(
        q, k, v, torch.arange(3), torch.arange(3) + 10, causal=True
    )
    assert torch.isneginf(lse).all() and (out == 0).all()
    # an empty block of keys
    out, lse = ring.block_attention(
        q, k[:, :, :0], v[:, :, :0], torch.arange(3), torch.arange(0)
    )
    assert torch.isneginf(lse).all() and (out == 0).all()
    # a block's lse is the log of its softmax denominator
    out, lse = ring.block_attention(q, k, v, torch.arange(3), torch.arange(3))
    scores = q @ k.transpose(-2, -1) / math.sqrt(4)
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-12)


def test_merge_of_two_blocks_is_attention_over_both():
    q, k, v, _, _ = inputs(5, 1, 2, 2, 6, 4)
    pos = torch.arange(6)
    out, lse = ring.initial_state(q, v)
    for part in (slice(0, 2), slice(2, 6)):
        out, lse = ring.ring_forward_step(
            q, k[:, :, part], v[:, :, part], pos, pos[part], out, lse,
            True, 0.5,
        )  # fmt: skip
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.allclose(out, attend(q, k, v, mask, 0.5), atol=1e-12)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 3, 4), 3), "same d"),
        (((1, 3, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4), 3), "not divisible"),
        (((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 2, 4), 3), "same batch, heads"),
        (((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4), 2), "positions"),
        (((2, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4), 3), "batch and length"),
        (((2, 3, 4), (2, 3, 4), (2, 3, 4), 3), "must be"),
    ],
)
def test_shard_errors(shapes, match):
    *qkv, n = shapes
    q, k, v = (torch.zeros(s) for s in qkv)
    with pytest.raises(ValueError, match=match):
        ring.check_shard(q, k, v, torch.arange(n))


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)]
)
def test_half_precision_accumulates_in_float32(dtype, tol):
    q, k, v, d_out, g = inputs(4, 1, 4, 2, 24, 16)
    positions = random_partition(24, 3, g)
    got = simulate(
        *(x.to(dtype) for x in (q, k, v, d_out)), positions, causal=True
    )
    want = full_reference(
        *(x.to(dtype).double() for x in (q, k, v, d_out)), causal=True
    )
    for x, y in zip(got, want):
        assert x.dtype == torch.promote_types(dtype, torch.float32)
        assert float((x.double() - y).abs().max()) < tol
