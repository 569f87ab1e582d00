"""SharedKVAttention, the layer of cross-layer attention that attends with an
earlier layer's keys and values: against a multi-head layer attending to the
source layer's input, over the caches it reads, and its errors."""

import pytest
import torch

from attnbook.kv_cache import ConcatKVCache, KVCache
from attnbook.latent.shared_attention import SharedKVAttention
from attnbook.multihead import MultiHeadAttention

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("use_sdpa", [False, True])
@pytest.mark.parametrize("cache_class", [KVCache, ConcatKVCache])
def test_it_attends_with_the_keys_its_source_cached(
    n_kv_heads, use_sdpa, cache_class
):
    """The source layer caches keys and values of its input s; the sharing
    layer's output on x is that of a multi-head layer with the sharing
    layer's query and output projections and the source's key and value
    projections, attending causally from x to s."""
    torch.manual_seed(n_kv_heads)
    source = MultiHeadAttention(16, 4, n_kv_heads).double()
    shared = SharedKVAttention(16, 4, n_kv_heads, use_sdpa=use_sdpa).double()
    s = torch.randn(2, 7, 16, dtype=torch.float64)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    mask = torch.rand(2, 4, 7, 7) > 0.3
    cache = (
        KVCache(2, n_kv_heads, 9, 4, dtype=torch.float64)
        if cache_class is KVCache
        else ConcatKVCache()
    )
    source(s, is_causal=True, kv_cache=cache)
    out = shared(x, mask=mask, is_causal=True, kv_cache=cache)
    ref = MultiHeadAttention(16, 4, n_kv_heads).double()
    ref.q_proj, ref.out_proj = shared.q_proj, shared.out_proj
    ref.k_proj, ref.v_proj = source.k_proj, source.v_proj
    expected = ref(x, context=s, mask=mask, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    # it reads the cache and adds nothing to it
    assert cache.length == 7
    assert not hasattr(shared, "k_proj") and not hasattr(shared, "v_proj")


def test_it_needs_its_sources_cache_and_no_context():
    layer = SharedKVAttention(16, 4, 2)
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="give kv_cache"):
        layer(x)
    with pytest.raises(ValueError, match="give kv_cache"):
        layer(x, context=x, kv_cache=KVCache(1, 2, 4, 4))
    with pytest.raises(ValueError, match="divisible"):
        SharedKVAttention(15, 4)
    with pytest.raises(ValueError, match="n_kv_heads"):
        SharedKVAttention(16, 4, 3)
    with pytest.raises(ValueError, match="x must have shape"):
        layer(torch.randn(1, 3, 8), kv_cache=KVCache(1, 2, 4, 4))
