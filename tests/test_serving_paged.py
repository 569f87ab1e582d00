"""attnbook.serving: the allocator, the gather through a block table (numpy
and torch) and the paged cache, against contiguous references in float64."""

import numpy as np
import pytest
import torch

from attnbook.attention import scaled_dot_product_attention
from attnbook.decoding import greedy_decode
from attnbook.gpt import GPTConfig, TinyGPT
from attnbook.masks import causal_mask
from attnbook.serving import block_table, paged_cache
from attnbook.serving.allocator import BlockAllocator, OutOfBlocks
from attnbook.serving.fragmentation import request_mix, token_fraction
from attnbook.serving.paged_cache import PagedKVCache

H, D = 2, 3
# (length, block_size): lengths 0 and 1, block size 1, a block larger than
# the sequence, ragged and exact last blocks
CASES = [(0, 4), (1, 1), (1, 8), (5, 1), (5, 16), (7, 3), (9, 3), (12, 4)]
CASES += [
    (int(n), int(b))
    for n, b in zip(
        np.random.default_rng(0).integers(0, 40, 12),
        np.random.default_rng(1).integers(1, 9, 12),
    )
]


def scattered(length, block_size, seed):
    """Contiguous keys (length, H, D), and the same keys in a pool of blocks
    at random places, with its block table; unfilled slots hold NaN, so a read
    of one shows."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((length, H, D))
    n_used = -(-length // block_size)
    n_blocks = n_used + 3
    table = rng.permutation(n_blocks)[:n_used]
    blocks = np.full((n_blocks, block_size, H, D), np.nan)
    for p in range(length):
        blocks[table[p // block_size], p % block_size] = keys[p]
    return keys, blocks, table


@pytest.mark.parametrize("length, block_size", CASES)
def test_gather_equals_the_contiguous_keys(length, block_size):
    keys, blocks, table = scattered(length, block_size, length + block_size)
    np.testing.assert_array_equal(
        block_table.gather(blocks, table, length), keys
    )
    got = paged_cache.gather(torch.from_numpy(blocks), table, length)
    np.testing.assert_array_equal(got.numpy(), keys)


@pytest.mark.parametrize("length, block_size", [c for c in CASES if c[0]])
def test_paged_attention_equals_contiguous_attention(length, block_size):
    keys, k_blocks, table = scattered(length, block_size, 1)
    values, v_blocks, _ = scattered(length, block_size, 1)
    # same table: the values' pool reuses the keys' random layout
    values = np.random.default_rng(2).standard_normal(values.shape)
    for p in range(length):
        v_blocks[table[p // block_size], p % block_size] = values[p]
    n_q = min(3, length)
    q = np.random.default_rng(3).standard_normal((H, n_q, D))
    # (H, length, D)
    k, v = keys.transpose(1, 0, 2), values.transpose(1, 0, 2)
    want, _ = scaled_dot_product_attention(
        q, k, v, mask=causal_mask(n_q, length)
    )
    got = block_table.paged_attention(q, k_blocks, v_blocks, table, length)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    t = [torch.from_numpy(x) for x in (q, k_blocks, v_blocks)]
    got_torch = paged_cache.paged_attention(*t, table, length)
    np.testing.assert_allclose(got_torch.numpy(), want, rtol=1e-12, atol=1e-12)
    # one query, block by block, merged
    decoded = paged_cache.paged_decode(t[0][:, -1:], *t[1:], table, length)
    np.testing.assert_allclose(
        decoded.numpy(), want[:, -1:], rtol=1e-12, atol=1e-12
    )


def test_gather_refuses_a_table_too_short():
    blocks = np.zeros((4, 2, H, D))
    with pytest.raises(ValueError, match="needs 3"):
        block_table.gather(blocks, [0, 1], 5)
    with pytest.raises(ValueError, match="block ids"):
        block_table.gather(blocks, [0, 7], 3)


def test_allocator_counts_shares_and_copies_on_write():
    a = BlockAllocator(3)
    b0 = a.allocate()
    assert a.share(b0) == b0 and a.ref_counts[b0] == 2
    # a shared block is copied before a write
    fresh, copied = a.copy_on_write(b0)
    assert copied and fresh != b0 and a.ref_counts == [1, 1, 0]
    # the last holder writes in place
    assert a.copy_on_write(b0) == (b0, False)
    a.allocate()
    with pytest.raises(OutOfBlocks):
        a.allocate()
    assert a.free(b0) and a.n_free == 1
    with pytest.raises(ValueError, match="double free"):
        a.free(b0)
    with pytest.raises(ValueError, match="block"):
        a.free(3)


def test_the_free_list_is_first_in_first_out():
    a = BlockAllocator(4)
    taken = [a.allocate() for _ in range(4)]
    for b in (2, 0):
        a.free(taken[b])
    assert [a.allocate(), a.allocate()] == [2, 0]


def model(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    cfg = GPTConfig(
        vocab_size=11, context_length=32, n_layers=2, n_heads=2, d_model=8
    )
    return TinyGPT(cfg).to(dtype).eval()


@pytest.mark.parametrize("block_size", [1, 3, 64])
def test_the_tiny_gpt_decodes_the_same_through_the_paged_cache(block_size):
    m = model()
    prompt = torch.randint(
        0, 11, (2, 5), generator=torch.Generator().manual_seed(0)
    )
    want, want_logits = greedy_decode(m, prompt, 9, m.new_kv_cache(2))
    caches = m.new_kv_cache(2, cache_class=PagedKVCache, block_size=block_size)
    got, logits = greedy_decode(m, prompt, 9, caches)
    assert torch.equal(got, want)
    torch.testing.assert_close(logits, want_logits, rtol=1e-12, atol=1e-12)
    # blocks are taken as the sequences reach them
    assert caches[0].allocator.n_blocks - caches[0].allocator.n_free == (
        2 * -(-(5 + 9 - 1) // block_size)
    )
    caches[0].reset()
    assert caches[0].allocator.n_free == caches[0].allocator.n_blocks


def test_paged_memory_holds_nearly_only_tokens():
    prompt, output = request_mix(300, 161, 338, 2048, seed=0)
    assert (prompt + output <= 2048).all() and prompt.min() >= 1
    fractions = {
        policy: token_fraction(prompt, output, policy)
        for policy in ("max", "pow2", "oracle")
    }
    paged = [
        token_fraction(prompt, output, "paged", block_size=b)
        for b in (1, 16, 256)
    ]
    assert paged[0] == 1.0
    assert fractions["max"] < fractions["pow2"] < fractions["oracle"]
    assert fractions["oracle"] < paged[2] < paged[1] < paged[0]
    # one request by hand: p=3, o=2 holds 3 then 4 positions
    assert token_fraction([3], [2], "max", max_len=8) == 7 / 16
    assert token_fraction([3], [2], "paged", block_size=2) == 7 / 8
    # Orca (Pow2): the output rounded up to a power of two, plus the prompt
    assert token_fraction([3], [2], "pow2") == 7 / 10
    assert token_fraction([3], [2], "oracle") == 7 / 8


def test_pow2_rounds_the_output_not_the_final_length():
    # the vLLM paper's example: 25 output tokens reserve 32 positions for
    # the output, the prompt added (not the next power of two of 124)
    used = 25 * 100 + 25 * 24 // 2
    assert token_fraction([100], [25], "pow2") == used / (25 * (100 + 32))
    # capped at the context: 2000 + 64 > 2048
    used = 40 * 2000 + 40 * 39 // 2
    assert token_fraction([2000], [40], "pow2") == used / (40 * 2048)
