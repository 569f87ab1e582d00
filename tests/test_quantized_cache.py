"""The int8 KV cache: absmax quantisation against a float64 numpy reference,
its error bound, the cache's contents by granularity, its bytes, and the tiny
GPT running on it."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnbook.gpt import GPTConfig, TinyGPT
from attnbook.kv_cache import KVCache
from attnbook.quantized_cache import (
    QuantizedKVCache,
    absmax_quantize,
    dequantize,
    int8_kv_cache_bytes,
    new_quantized_kv_cache,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def numpy_absmax(x, axis, bits=8):
    """Independent float64 reference: scale each slice so that its largest
    magnitude is qmax."""
    x = np.asarray(x, dtype=np.float64)
    qmax = 2 ** (bits - 1) - 1
    peak = np.max(np.abs(x), axis=axis, keepdims=True)
    scale = np.where(peak == 0, 1.0, peak / qmax)
    return np.clip(np.rint(x / scale), -qmax, qmax), scale


# ---- absmax_quantize --------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize(
    "shape,dim",
    [
        ((5, 7), -1),
        ((5, 7), 0),
        ((2, 3, 4, 6), (-2,)),
        ((2, 3, 4, 6), (1, 3)),
        ((1,), -1),
    ],
)
def test_absmax_matches_numpy_reference(shape, dim, bits):
    x = (
        torch.randn(
            shape,
            dtype=torch.float64,
            generator=torch.Generator().manual_seed(len(shape) + bits),
        )
        * 3
    )
    q, scale = absmax_quantize(x, dim, bits)
    q_ref, scale_ref = numpy_absmax(
        x.numpy(), dim if isinstance(dim, int) else tuple(dim), bits
    )
    assert q.dtype == torch.int8 and q.shape == x.shape
    np.testing.assert_array_equal(q.numpy(), q_ref)
    np.testing.assert_allclose(scale.numpy(), scale_ref, rtol=1e-15)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 40),
    magnitude=st.floats(1e-3, 1e3),
    bits=st.integers(2, 8),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_error_is_at_most_half_a_step(
    rows, cols, magnitude, bits, seed, dtype
):
    x = (
        torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
        * magnitude
    ).to(dtype)
    q, scale = absmax_quantize(x, -1, bits)
    qmax = 2 ** (bits - 1) - 1
    # the largest entry of each row hits qmax
    assert int(q.abs().max()) == qmax
    assert bool((q.abs().amax(-1) == qmax).all())
    err = (dequantize(q, scale) - x).abs()
    eps = torch.finfo(dtype).eps
    assert bool((err <= scale / 2 * (1 + 8 * eps) + 4 * eps * x.abs()).all())


def test_zero_slices_are_exact_and_float16_works():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]], dtype=torch.float16)
    q, scale = absmax_quantize(x, -1)
    assert (
        scale.dtype == torch.float16
        and q[0].tolist() == [0, 0, 0]
        and q[1].tolist() == [64, -127, 32]
    )
    torch.testing.assert_close(dequantize(q, scale)[0], x[0], rtol=0, atol=0)
    assert dequantize(q, scale, torch.float32).dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(x=torch.ones(3, dtype=torch.int32)), "floating-point"),
        (dict(bits=1), "bits"),
        (dict(bits=9), "bits"),
        (dict(bits=2.5), "bits"),
    ],
)
def test_absmax_rejects_bad_input(kwargs, match):
    args = dict(x=torch.ones(3), dim=-1) | kwargs
    with pytest.raises(ValueError, match=match):
        absmax_quantize(**args)


# ---- the cache --------------------------------------------------------------


def fill(cache, k, v, chunks):
    """Append k, v in pieces of the given sizes; return the last (keys,
    values)."""
    start = 0
    for n in chunks:
        out = cache.update(
            k[:, :, start : start + n], v[:, :, start : start + n]
        )
        start += n
    assert start == k.shape[2]
    return out


@pytest.mark.parametrize("chunks", [[11], [1] * 11, [4, 1, 6], [3, 8]])
def test_token_scales_quantise_each_vector_on_arrival(chunks):
    k, v = torch.randn(2, 3, 11, 8), torch.randn(2, 3, 11, 8) * 5
    keys, values = fill(QuantizedKVCache(2, 3, 16, 8), k, v, chunks)
    for x, got in ((k, keys), (v, values)):
        q_ref, scale_ref = numpy_absmax(x.numpy(), -1)
        np.testing.assert_allclose(
            got.numpy(), q_ref * scale_ref, rtol=1e-6, atol=1e-7
        )


@pytest.mark.parametrize("chunks", [[21], [1] * 21, [5, 3, 13], [8, 8, 5]])
def test_channel_scales_cover_complete_groups_and_keep_the_rest(chunks):
    group = 8
    k, v = torch.randn(1, 2, 21, 4), torch.randn(1, 2, 21, 4)
    # an outlier channel
    k[..., 2] *= 30
    cache = QuantizedKVCache(
        1,
        2,
        24,
        4,
        key_granularity="channel",
        value_granularity="channel",
        group_size=group,
    )
    keys, values = fill(cache, k, v, chunks)
    for x, got in ((k, keys), (v, values)):
        # two complete groups of 8
        for g in range(2):
            block = x[:, :, g * group : (g + 1) * group].numpy()
            # one scale per channel
            q_ref, scale_ref = numpy_absmax(block, -2)
            np.testing.assert_allclose(
                got[:, :, g * group : (g + 1) * group].numpy(),
                q_ref * scale_ref,
                rtol=1e-6,
                atol=1e-6,
            )
        # open group: exact
        torch.testing.assert_close(
            got[:, :, 16:], x[:, :, 16:], rtol=0, atol=0
        )
    assert cache.length == 21


def test_channel_scales_beat_token_scales_on_an_outlier_channel():
    torch.manual_seed(0)
    k = torch.randn(1, 1, 64, 16)
    # one channel large at every position
    k[..., 5] += 40
    errors = {}
    for granularity in ("token", "channel"):
        cache = QuantizedKVCache(
            1, 1, 64, 16, key_granularity=granularity, group_size=16
        )
        keys, _ = cache.update(k, k)
        errors[granularity] = float(
            (keys - k)[..., torch.arange(16) != 5].abs().mean()
        )
    assert errors["channel"] * 5 < errors["token"]


def test_bytes_and_errors():
    # float32 scales, token granularity
    cache = QuantizedKVCache(2, 3, 10, 8)
    assert cache.nbytes == int8_kv_cache_bytes(
        1, 3, 8, 10, batch=2, scale_bytes=4
    )
    # 8 float32 -> 8 int8 + 1 scale
    assert cache.nbytes * 32 == KVCache(2, 3, 10, 8).nbytes * (8 + 4)
    channel = QuantizedKVCache(
        1, 1, 10, 8, key_granularity="channel", group_size=4
    )
    # keys: 80 int8 + 3 groups x 8 channel scales + an open group of 4 x 8
    # floats; values: 80 + 10 scales
    assert channel.nbytes == (80 + 3 * 8 * 4 + 4 * 8 * 4) + (80 + 10 * 4)
    assert int8_kv_cache_bytes(32, 32, 128, 4096) == 2 * 32 * 4096 * 32 * 130
    cache.update(torch.zeros(2, 3, 9, 8), torch.zeros(2, 3, 9, 8))
    with pytest.raises(ValueError, match=r"max_len=10.*has 9.*2 more"):
        cache.update(torch.zeros(2, 3, 2, 8), torch.zeros(2, 3, 2, 8))
    with pytest.raises(ValueError, match=r"k must have shape"):
        cache.update(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8))
    with pytest.raises(ValueError, match="dtype"):
        cache.update(
            torch.zeros(2, 3, 1, 8, dtype=torch.float64),
            torch.zeros(2, 3, 1, 8, dtype=torch.float64),
        )
    with pytest.raises(ValueError, match="same shape"):
        cache.update(torch.zeros(2, 3, 1, 8), torch.zeros(2, 3, 2, 8))
    with pytest.raises(ValueError, match="granularity"):
        QuantizedKVCache(1, 1, 4, 4, key_granularity="head")
    with pytest.raises(ValueError, match="bits"):
        QuantizedKVCache(1, 1, 4, 4, bits=16)
    with pytest.raises(ValueError, match="context_length"):
        int8_kv_cache_bytes(1, 1, 1, 0)
    cache.reset()
    assert cache.length == 0
    assert "QuantizedKVCache(batch=2" in repr(cache)


# ---- inside the model -------------------------------------------------------


def decode(model, ids, caches, n_prompt):
    steps = [model(ids[:, :n_prompt], caches)]
    steps += [
        model(ids[:, t : t + 1], caches, start_pos=t)
        for t in range(n_prompt, ids.shape[1])
    ]
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize(
    "options", [{}, dict(key_granularity="channel", group_size=8)]
)
def test_the_model_runs_on_the_quantised_cache(options):
    torch.manual_seed(4)
    model = TinyGPT(
        GPTConfig(
            vocab_size=19,
            context_length=40,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_model=32,
        )
    ).eval()
    ids = torch.randint(0, 19, (2, 40))
    with torch.no_grad():
        exact = model(ids)
        errors = {}
        for bits in (8, 4):
            caches = new_quantized_kv_cache(
                model, batch=2, bits=bits, **options
            )
            assert len(caches) == 2 and caches[0].shape == (2, 2, 40, 8)
            errors[bits] = float(
                (decode(model, ids, caches, 6) - exact).abs().max()
            )
    assert 0 < errors[8] < 0.05 and errors[8] < errors[4]
    with pytest.raises(ValueError, match="context_length"):
        new_quantized_kv_cache(model, max_len=41)
