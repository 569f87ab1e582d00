"""The flop counts of attnbook.latent.cost against PyTorch's flop counter run
on the two paths of MultiHeadLatentAttention, and the crossover against the
counts themselves."""

import pytest
import torch

from attnbook.flop_counter import FlopCounterMode
from attnbook.latent.cost import (
    crossover_queries,
    mla_attention_flops,
    mla_decode_bytes,
)
from attnbook.latent.mla import MultiHeadLatentAttention

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIZES = dict(n_heads=3, d_latent=10, d_rope=4, d_nope=6, d_v=5)


def counted(layer, n, n_k, absorbed):
    """Flops FlopCounterMode counts in one attention step of ``layer``."""
    b, h = 1, layer.n_heads
    q_nope = torch.randn(b, h, n, layer.d_nope)
    q_rope = torch.randn(b, h, n, layer.d_rope)
    latent = torch.randn(b, 1, n_k, layer.d_latent)
    k_rope = torch.randn(b, 1, n_k, layer.d_rope)
    step = layer.attend_absorbed if absorbed else layer.attend_decompressed
    with FlopCounterMode(display=False) as counter:
        step(q_nope, q_rope, latent, k_rope)
    return counter.get_total_flops()


@pytest.mark.parametrize("n, n_k", [(1, 7), (4, 9), (9, 9)])
@pytest.mark.parametrize("absorbed", [False, True])
def test_flops_match_torch_flop_counter(n, n_k, absorbed):
    s = SIZES
    layer = MultiHeadLatentAttention(
        d_model=8,
        n_heads=s["n_heads"],
        d_latent=s["d_latent"],
        d_rope=s["d_rope"],
        d_nope=s["d_nope"],
        d_v=s["d_v"],
    )
    with torch.no_grad():
        got = counted(layer, n, n_k, absorbed)
    assert got == mla_attention_flops(n, n_k, absorbed=absorbed, **s)


def test_crossover_is_where_the_counts_meet():
    s = dict(n_heads=128, d_latent=512, d_rope=64, d_nope=128, d_v=128)
    n_k = 4096
    n_star = crossover_queries(n_k, 512, 128, 128)
    below, above = int(n_star), int(n_star) + 1
    assert mla_attention_flops(
        below, n_k, absorbed=True, **s
    ) < mla_attention_flops(below, n_k, absorbed=False, **s)
    assert mla_attention_flops(
        above, n_k, absorbed=True, **s
    ) > mla_attention_flops(above, n_k, absorbed=False, **s)
    # long contexts: d_c (d_nope + d_v) / (2 d_c - d_nope - d_v) = 512/3
    assert crossover_queries(10**9, 512, 128, 128) == pytest.approx(
        512 / 3, rel=1e-6
    )
    assert crossover_queries(5, 4, 6, 6) == float("inf")


def test_decode_bytes_by_hand():
    # DeepSeek-V3, 1000 positions, bf16: the latents once
    assert (
        mla_decode_bytes(1000, 128, 512, 64, 128, 128, True) == 1000 * 576 * 2
    )
    # decompressed: plus 128 heads x (128 + 64 + 128) written and read back
    assert (
        mla_decode_bytes(1000, 128, 512, 64, 128, 128, False)
        == (1000 * 576 + 2 * 1000 * 128 * 320) * 2
    )


def test_decode_bytes_with_weights_and_batch_by_hand():
    # DeepSeek-V3, 32768 positions, bf16. W_UK and W_UV of 128 heads: 128
    # x 512 x (128 + 128) numbers, read once per step whatever the batch
    weights = 128 * 512 * 256 * 2
    assert weights == 32 * 2**20
    cache = 32768 * 576 * 2
    sizes = (32768, 128, 512, 64, 128, 128)
    assert mla_decode_bytes(*sizes, True, include_weights=True) == (
        cache + weights
    )
    # a batch of 8: eight caches, one read of the weights
    assert mla_decode_bytes(*sizes, True, batch=8, include_weights=True) == (
        8 * cache + weights
    )
    assert mla_decode_bytes(*sizes, True, batch=8) == 8 * cache
    # the decompressed path reads the same weights to decompress
    heads = 2 * 32768 * 128 * 320 * 2
    assert mla_decode_bytes(*sizes, False, batch=3, include_weights=True) == (
        3 * (cache + heads) + weights
    )
    # fp8: every number one byte
    assert (
        mla_decode_bytes(
            *sizes, True, bytes_per_element=1, include_weights=True
        )
        == (cache + weights) / 2
    )


def test_decode_intensity_at_batch_one_is_about_half_the_cache_only_one():
    # the reader's hand count: 9.16 GFLOP over 68 MiB at batch 1, about 128
    # flops per byte; the cache alone gives about 243, approached by a large
    # batch
    v3 = dict(n_heads=128, d_latent=512, d_rope=64, d_nope=128, d_v=128)
    flops = mla_attention_flops(1, 32768, absorbed=True, **v3)
    alone = flops / mla_decode_bytes(32768, absorbed=True, **v3)
    batch_1 = flops / mla_decode_bytes(
        32768, absorbed=True, include_weights=True, **v3
    )
    big = (
        1024
        * flops
        / mla_decode_bytes(
            32768, absorbed=True, batch=1024, include_weights=True, **v3
        )
    )
    assert round(alone) == 243 and round(batch_1) == 128
    assert batch_1 < big < alone and alone - big < 1


def test_decode_bytes_rejects_a_bad_batch():
    with pytest.raises(ValueError, match="batch"):
        mla_decode_bytes(10, 2, 4, 2, 3, 3, True, batch=0)
