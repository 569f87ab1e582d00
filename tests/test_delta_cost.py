"""The costs of the delta-rule family (attnbook.delta.cost): flops against a
hand count and against torch's FlopCounterMode run on the package's own
forms; the bytes a decoded token reads against attnbook.kv_cache_bytes."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from attnbook.delta.chunkwise import delta_chunkwise
from attnbook.delta.cost import (
    chunkwise_flops,
    decode_bytes_per_token,
    recurrent_flops,
    softmax_flops,
)
from attnbook.delta.recurrent import delta_recurrence
from attnbook.kv_cache import kv_cache_bytes

D_K, D_V = 4, 3


def inputs(n):
    g = torch.Generator().manual_seed(n)
    q = torch.randn(1, n, D_K, generator=g, dtype=torch.float64)
    k = F.normalize(
        torch.randn(1, n, D_K, generator=g, dtype=torch.float64), dim=-1
    )
    v = torch.randn(1, n, D_V, generator=g, dtype=torch.float64)
    beta = torch.rand(1, n, generator=g, dtype=torch.float64)
    return q, k, v, beta


def test_flop_counts_by_hand():
    # n = 5, d_k = 2, d_v = 3, chunks of 2: chunks of 2, 2 and 1 tokens.
    # A chunk of m: 2 m^2 (2 + 3) + 4 m 6 [no delta] + 2 m^2 2 + m (m - 1) 5
    # + 2 m 6 [delta]: m = 2: 40 + 48 + 16 + 10 + 24 = 138; m = 1: 10 + 24
    # + 4 + 0 + 12 = 50.
    assert chunkwise_flops(5, 2, 3, 2) == 138 + 138 + 50
    assert chunkwise_flops(5, 2, 3, 2, delta=False) == 88 + 88 + 34
    assert recurrent_flops(5, 2, 3) == 5 * 6 * 6
    assert recurrent_flops(5, 2, 3, delta=False) == 5 * 4 * 6
    assert softmax_flops(5, 2, 3) == 2 * 25 * 5
    assert chunkwise_flops(0, 2, 3, 2) == 0
    # one chunk per token: the products of the recurrence, and more
    assert chunkwise_flops(7, 4, 4, 1) > recurrent_flops(7, 4, 4)


@pytest.mark.parametrize("n, chunk", [(12, 4), (13, 5)])
def test_flop_counts_against_torch(n, chunk):
    """FlopCounterMode counts the matrix products (not the triangular solve,
    nor the broadcast outer product of the recurrence's write)."""
    q, k, v, beta = inputs(n)
    with FlopCounterMode(display=False) as counter:
        delta_chunkwise(q, k, v, beta, chunk_size=chunk)
    solve = sum(
        min(chunk, n - s) * (min(chunk, n - s) - 1) * (D_K + D_V)
        for s in range(0, n, chunk)
    )
    assert (
        counter.get_total_flops()
        == chunkwise_flops(n, D_K, D_V, chunk) - solve
    )
    with FlopCounterMode(display=False) as counter:
        delta_recurrence(q, k, v, beta)
    write = 2 * n * D_K * D_V
    assert counter.get_total_flops() == recurrent_flops(n, D_K, D_V) - write


def test_decode_bytes():
    # a state is the same at every context; a cache grows with it and is
    # kv_cache_bytes for one layer
    assert decode_bytes_per_token(10, 4, 8, 8, True) == 4 * 64 * 2
    assert decode_bytes_per_token(10**6, 4, 8, 8, True) == 4 * 64 * 2
    for context in (1, 100, 4096):
        assert decode_bytes_per_token(
            context, 4, 8, 8, recurrent=False, bytes_per_element=2
        ) == kv_cache_bytes(1, 4, 8, context, 1, 2)
    with pytest.raises(ValueError, match="n_heads must be a positive"):
        decode_bytes_per_token(10, 0, 8, 8, True)


def test_decode_bytes_read_and_written():
    # a state is read and written back whole: twice its bytes, here in
    # float32; a cache is read and gains one token's key and value, i.e. a
    # cache one token longer
    assert decode_bytes_per_token(10, 4, 8, 8, True, 4, write=True) == (
        2 * 4 * 64 * 4
    )
    for context in (0, 1, 100):
        assert decode_bytes_per_token(
            context, 4, 8, 8, recurrent=False, write=True
        ) == kv_cache_bytes(1, 4, 8, context + 1, 1, 2)
