"""KVCache and kv_cache_bytes: incremental decoding equals full recomputation;
bytes by count."""

import pytest
import torch

from attnbook.gpt import GPTConfig, TinyGPT
from attnbook.kv_cache import KVCache, RollingKVCache, kv_cache_bytes
from attnbook.masks import sliding_window_mask
from attnbook.multihead import MultiHeadAttention


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- kv_cache_bytes ---------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.float32, torch.float64]
)
@pytest.mark.parametrize(
    "n_layers,n_kv_heads,d_head,context_length,batch",
    [(1, 1, 1, 1, 1), (3, 2, 8, 17, 2), (2, 4, 5, 9, 3)],
)
def test_kv_cache_bytes_counts_a_filled_cache(
    dtype, n_layers, n_kv_heads, d_head, context_length, batch
):
    caches = [
        KVCache(batch, n_kv_heads, context_length, d_head, dtype=dtype)
        for _ in range(n_layers)
    ]
    # fill every position, in two pieces
    for cache in caches:
        first = context_length // 2
        for n_new in (first, context_length - first):
            if n_new:
                k = torch.randn(batch, n_kv_heads, n_new, d_head).to(dtype)
                cache.update(k, k.clone())
        assert cache.length == cache.max_len == context_length
    counted = sum(c.keys.nbytes + c.values.nbytes for c in caches)
    element = torch.finfo(dtype).bits // 8
    assert (
        kv_cache_bytes(
            n_layers,
            n_kv_heads,
            d_head,
            context_length,
            batch,
            bytes_per_element=element,
        )
        == counted
    )
    assert sum(c.nbytes for c in caches) == counted


def test_kv_cache_bytes_of_the_tiny_gpt_cache():
    model = TinyGPT(
        GPTConfig(
            vocab_size=11,
            context_length=20,
            n_layers=3,
            n_heads=4,
            n_kv_heads=2,
            d_model=16,
        )
    )
    caches = model.new_kv_cache(batch=2)
    with torch.no_grad():
        model(torch.zeros(2, 20, dtype=torch.long), caches)
    assert [c.length for c in caches] == [20, 20, 20]
    assert sum(c.nbytes for c in caches) == kv_cache_bytes(
        3, 2, 4, 20, batch=2, bytes_per_element=4
    )


def test_kv_cache_bytes_known_value():
    # Llama-2-7B: 32 layers, 32 kv heads of 128 features; 4096 tokens in
    # float16 take 2 GiB
    assert kv_cache_bytes(32, 32, 128, 4096) == 2 * 2**30
    # grouped-query attention with 8 kv heads (Llama-2-70B: 80 layers) divides
    # by n_heads / 8 = 8
    assert kv_cache_bytes(80, 8, 128, 4096) * 8 == kv_cache_bytes(
        80, 64, 128, 4096
    )
    assert kv_cache_bytes(1, 1, 2, 3, batch=4, bytes_per_element=0.5) == 24


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n_layers=0), "n_layers"),
        (dict(n_kv_heads=-1), "n_kv_heads"),
        (dict(d_head=2.5), "d_head"),
        (dict(context_length=0), "context_length"),
        (dict(batch=0), "batch"),
        (dict(bytes_per_element=0), "bytes_per_element"),
    ],
)
def test_kv_cache_bytes_rejects_bad_input(kwargs, match):
    args = dict(n_layers=2, n_kv_heads=2, d_head=4, context_length=8) | kwargs
    with pytest.raises(ValueError, match=match):
        kv_cache_bytes(**args)


# ---- KVCache ----------------------------------------------------------------


def test_update_returns_everything_appended_so_far():
    cache = KVCache(batch=2, n_kv_heads=3, max_len=10, d_head=4)
    ks, vs = [], []
    for n_new in (4, 1, 1, 3):
        k, v = torch.randn(2, 3, n_new, 4), torch.randn(2, 3, n_new, 4)
        ks.append(k), vs.append(v)
        keys, values = cache.update(k, v)
        torch.testing.assert_close(keys, torch.cat(ks, dim=2), rtol=0, atol=0)
        torch.testing.assert_close(
            values, torch.cat(vs, dim=2), rtol=0, atol=0
        )
        assert cache.length == keys.shape[2] == sum(t.shape[2] for t in ks)
    # preallocated, never reallocated
    assert cache.keys.shape == (2, 3, 10, 4)


def test_overflow_is_an_error_and_leaves_the_cache_alone():
    cache = KVCache(1, 1, 5, 2)
    cache.update(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2))
    with pytest.raises(ValueError, match=r"max_len=5.*has 4.*2 more"):
        cache.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2))
    assert cache.length == 4
    # exactly full
    keys, _ = cache.update(
        torch.full((1, 1, 1, 2), 7.0), torch.ones(1, 1, 1, 2)
    )
    assert cache.length == 5 and keys[0, 0, -1, 0] == 7
    cache.reset()
    assert cache.length == 0 and "length=0" in repr(cache)


def test_update_rejects_mismatched_tensors():
    cache = KVCache(2, 2, 8, 4)
    good = torch.zeros(2, 2, 1, 4)
    with pytest.raises(ValueError, match=r"\(2, 3, 1, 4\)"):
        # wrong number of heads
        cache.update(torch.zeros(2, 3, 1, 4), torch.zeros(2, 3, 1, 4))
    with pytest.raises(ValueError, match=r"\(2, 1, 4\)"):
        # wrong rank
        cache.update(torch.zeros(2, 1, 4), good)
    with pytest.raises(ValueError, match="same shape"):
        cache.update(good, torch.zeros(2, 2, 2, 4))
    with pytest.raises(ValueError, match="dtype"):
        cache.update(good.double(), good.double())
    with pytest.raises(ValueError, match="max_len"):
        KVCache(1, 1, 0, 4)


# ---- incremental decoding equals recomputation ------------------------------


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("use_sdpa", [False, True])
@torch.no_grad()
def test_multihead_attention_with_cache_equals_causal_attention(
    n_kv_heads, use_sdpa
):
    torch.manual_seed(n_kv_heads)
    mha = MultiHeadAttention(
        16, 4, n_kv_heads, bias=True, use_sdpa=use_sdpa
    ).double()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    full = mha(x, is_causal=True)
    cache = KVCache(2, n_kv_heads, 12, 4, dtype=torch.float64)
    pieces, start = [], 0
    # a prompt, single tokens, a chunk
    for n_new in (5, 1, 1, 3, 1, 1):
        pieces.append(
            mha(x[:, start : start + n_new], is_causal=True, kv_cache=cache)
        )
        start += n_new
        assert cache.length == start
    torch.testing.assert_close(
        torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-12
    )


def small_gpt(n_kv_heads=None, seed=0, use_sdpa=True):
    torch.manual_seed(seed)
    config = GPTConfig(
        vocab_size=13,
        context_length=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        d_model=24,
    )
    return TinyGPT(config, use_sdpa=use_sdpa).double().eval()


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("use_sdpa", [False, True])
@torch.no_grad()
def test_gpt_logits_with_cache_equal_full_recomputation(n_kv_heads, use_sdpa):
    model = small_gpt(n_kv_heads, use_sdpa=use_sdpa)
    ids = torch.randint(
        0, 13, (2, 20), generator=torch.Generator().manual_seed(1)
    )
    full = model(ids)  # (2, 20, 13)
    cache = model.new_kv_cache(batch=2)
    start = 0
    # ends with the cache partly filled: 20 of 32
    for n_new in (6, 1, 1, 1, 4, 1, 1, 5):
        logits = model(ids[:, start : start + n_new], cache, start_pos=start)
        torch.testing.assert_close(
            logits, full[:, start : start + n_new], rtol=1e-9, atol=1e-10
        )
        start += n_new
    assert [c.length for c in cache] == [20, 20, 20] and cache[0].max_len == 32


@torch.no_grad()
def test_gpt_cache_needs_matching_start_pos():
    model = small_gpt()
    cache = model.new_kv_cache()
    model(torch.zeros(1, 4, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"start_pos=3.*\[4\]"):
        model(torch.zeros(1, 1, dtype=torch.long), cache, start_pos=3)
    with pytest.raises(ValueError, match="one KVCache per layer"):
        model(torch.zeros(1, 1, dtype=torch.long), cache[:2], start_pos=4)


@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_greedy_generation_is_the_same_with_and_without_cache(n_kv_heads):
    model = small_gpt(n_kv_heads, seed=3)
    prompt = torch.randint(
        0, 13, (3, 5), generator=torch.Generator().manual_seed(2)
    )
    with_cache = model.generate(prompt, 25, temperature=0, use_cache=True)
    without = model.generate(prompt, 25, temperature=0, use_cache=False)
    assert with_cache.shape == (3, 30)
    assert torch.equal(with_cache, without)
    assert torch.equal(with_cache[:, :5], prompt)


# ---- the rolling buffer of sliding-window attention -------------------------


@pytest.mark.parametrize("window", [1, 3, 5, 32])
@pytest.mark.parametrize(
    "chunks", [[1] * 20, [7] + [1] * 13, [3, 8, 1, 1, 4, 3], [20]]
)
@pytest.mark.parametrize("use_sdpa", [False, True])
@torch.no_grad()
def test_rolling_cache_decodes_like_a_sliding_window_mask(
    window, chunks, use_sdpa
):
    """A ring of `window` slots, fed in any chunks, gives the logits of full
    recomputation under sliding_window_mask(n, window) (the model's learned
    positions are the absolute ones)."""
    model = small_gpt(n_kv_heads=2, use_sdpa=use_sdpa)
    ids = torch.randint(
        0, 13, (2, 20), generator=torch.Generator().manual_seed(4)
    )
    full = model(ids, mask=torch.from_numpy(sliding_window_mask(20, window)))
    caches = model.new_kv_cache(
        batch=2, cache_class=RollingKVCache, window=window
    )
    pieces, start = [], 0
    for n_new in chunks:
        mask = caches[0].window_mask(n_new)
        assert mask.shape == (n_new, min(start, window - 1) + n_new)
        pieces.append(
            model(
                ids[:, start : start + n_new],
                caches,
                start_pos=start,
                mask=mask,
            )
        )
        start += n_new
    torch.testing.assert_close(
        torch.cat(pieces, dim=1), full, rtol=1e-9, atol=1e-10
    )
    assert caches[0].length == 20 and caches[0].keys.shape[2] == window


@torch.no_grad()
def test_rolling_cache_holds_the_last_window_positions_in_its_slots():
    cache = RollingKVCache(1, 1, 10, 2, window=3)
    # entry = its position
    positions = torch.arange(8.0).view(1, 1, 8, 1).expand(1, 1, 8, 2)
    keys, _ = cache.update(positions[:, :, :5], positions[:, :, :5])
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]
    # slot p % 3 holds position p
    assert sorted(cache.keys[0, 0, :, 0].tolist()) == [2, 3, 4]
    keys, values = cache.update(positions[:, :, 5:6], positions[:, :, 5:6])
    assert keys[0, 0, :, 0].tolist() == [3, 4, 5] and torch.equal(keys, values)
    assert cache.window_mask(1).all() and cache.window_mask(1).shape == (1, 3)
    assert cache.window_mask(2).tolist() == [
        [True, True, True, False],
        [False, True, True, True],
    ]
    # a chunk: 2 earlier + 2 new
    keys, _ = cache.update(positions[:, :, 6:8], positions[:, :, 6:8])
    assert keys[0, 0, :, 0].tolist() == [4, 5, 6, 7]
    assert sorted(cache.keys[0, 0, :, 0].tolist()) == [5, 6, 7]
    assert cache.nbytes == 2 * 3 * 2 * 4 and cache.length == 8
    assert "window=3" in repr(cache)
    cache.reset()
    assert (
        cache.length == 0
        and cache.update(positions[:, :, :1], positions[:, :, :1])[0].shape[2]
        == 1
    )


@torch.no_grad()
def test_rolling_cache_decodes_one_token_at_a_time_without_a_mask():
    model = small_gpt()
    ids = torch.randint(
        0, 13, (1, 16), generator=torch.Generator().manual_seed(5)
    )
    full = model(ids, mask=torch.from_numpy(sliding_window_mask(16, 4)))
    caches = model.new_kv_cache(cache_class=RollingKVCache, window=4)
    steps = torch.cat(
        [model(ids[:, t : t + 1], caches, start_pos=t) for t in range(16)],
        dim=1,
    )
    torch.testing.assert_close(steps, full, rtol=1e-9, atol=1e-10)


def test_rolling_cache_rejects_bad_input():
    with pytest.raises(ValueError, match="window"):
        RollingKVCache(1, 1, 8, 2, window=0)
    cache = RollingKVCache(1, 1, 4, 2, window=2)
    cache.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    with pytest.raises(ValueError, match="max_len=4"):
        cache.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    with pytest.raises(ValueError, match="shape"):
        cache.update(torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2))
    with pytest.raises(ValueError, match="n_new"):
        cache.window_mask(0)
