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
