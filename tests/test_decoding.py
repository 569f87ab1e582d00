"""Decoding costs: flop counts against torch's flop counter, the concatenating
cache against the preallocated one, and the decoding helpers."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from attnbook.decoding import (
    append_one_by_one,
    forward_bytes,
    forward_flops,
    generation_flops,
    generation_passes,
    generation_seconds,
    greedy_decode,
    recording_attention_outputs,
    roofline_seconds,
    teacher_forced_logits,
)
from attnbook.memory_traffic import GPUS
from attnbook.model_shapes import (
    GPT2_SMALL,
    LLAMA2_7B,
    LLAMA2_70B,
    as_multi_head,
    shape_of,
)
from attnbook.gpt import GPTConfig, TinyGPT
from attnbook.kv_cache import ConcatKVCache, KVCache


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small_gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    config = (
        dict(
            vocab_size=13,
            context_length=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_model=16,
        )
        | overrides
    )
    # use_sdpa=False: attention runs as two matmuls, which torch's flop counter
    # sees
    return TinyGPT(GPTConfig(**config), use_sdpa=False).eval()


def counted(fn):
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


# ---- flops against torch.utils.flop_counter ---------------------------------


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(n_kv_heads=None), dict(n_kv_heads=1, n_layers=3, d_model=24)],
)
@pytest.mark.parametrize(
    "n_past,n_new", [(0, 1), (0, 7), (5, 1), (3, 4), (0, 32)]
)
def test_forward_flops_match_torch_flop_counter(overrides, n_past, n_new):
    model = small_gpt(**overrides)
    cache = model.new_kv_cache()
    if n_past:
        with torch.no_grad():
            model(torch.zeros(1, n_past, dtype=torch.long), cache)
    ids = torch.randint(0, 13, (1, n_new))
    measured = counted(lambda: model(ids, cache, start_pos=n_past))
    assert (
        sum(forward_flops(shape_of(model.config), n_new, n_past).values())
        == measured
    )


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("n_prompt,n_new", [(1, 1), (1, 9), (4, 12), (10, 22)])
def test_generation_flops_match_torch_flop_counter(use_cache, n_prompt, n_new):
    model = small_gpt(seed=1)
    prompt = torch.randint(0, 13, (1, n_prompt))
    measured = counted(
        lambda: model.generate(
            prompt, n_new, temperature=0, use_cache=use_cache
        )
    )
    assert (
        sum(
            generation_flops(
                shape_of(model.config), n_prompt, n_new, use_cache
            ).values()
        )
        == measured
    )


@settings(max_examples=40, deadline=None)
@given(n_prompt=st.integers(1, 50), n_new=st.integers(1, 200))
def test_generation_flops_closed_forms(n_prompt, n_new):
    """Per-token work is paid once per token with the cache, once per token
    *per step* without."""
    s = GPT2_SMALL
    per_token = {
        part: flops
        for part, flops in forward_flops(s, 1).items()
        if part != "attention"
    }
    cached = generation_flops(s, n_prompt, n_new, use_cache=True)
    uncached = generation_flops(s, n_prompt, n_new, use_cache=False)
    # prefill + decode steps
    tokens_processed = n_prompt + n_new - 1
    tokens_reprocessed = sum(n_prompt + i for i in range(n_new))
    for part, flops in per_token.items():
        assert cached[part] == flops * tokens_processed
        assert uncached[part] == flops * tokens_reprocessed
    # attention flops per (query, key)
    width = 4 * s.n_layers * s.n_heads * s.d_head
    assert cached["attention"] == width * (
        n_prompt**2 + sum(n_prompt + i for i in range(1, n_new))
    )
    assert uncached["attention"] == width * sum(
        (n_prompt + i) ** 2 for i in range(n_new)
    )


def test_gqa_shrinks_only_the_key_value_projections():
    mha, gqa = as_multi_head(LLAMA2_70B), LLAMA2_70B
    a, b = forward_flops(mha, 3, 5), forward_flops(gqa, 3, 5)
    assert (
        a["attention"] == b["attention"]
        and a["mlp"] == b["mlp"]
        and a["head"] == b["head"]
    )
    d, hd, L = 8192, 128, 80
    assert a["qkv_out"] - b["qkv_out"] == L * 2 * 3 * 2 * d * (64 - 8) * hd


# ---- the concatenating cache ------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 9, 4), (1, 4, 17, 8)])
def test_concat_cache_holds_what_the_preallocated_one_holds(shape):
    k, v = torch.randn(shape), torch.randn(shape)
    growing, fixed = ConcatKVCache(), KVCache(*shape)
    append_one_by_one(growing, k, v)
    append_one_by_one(fixed, k, v)
    assert growing.length == fixed.length == shape[2]
    torch.testing.assert_close(growing.keys, fixed.keys, rtol=0, atol=0)
    torch.testing.assert_close(growing.values, fixed.values, rtol=0, atol=0)
    assert growing.nbytes == fixed.nbytes  # both full
    # every update writes the whole (one longer) cache: sum over t = 1..T of t
    # positions, keys and values
    per_position = 2 * shape[0] * shape[1] * shape[3] * 4
    assert (
        growing.bytes_copied == per_position * shape[2] * (shape[2] + 1) // 2
    )
    growing.reset()
    assert (
        growing.length == 0
        and growing.bytes_copied == 0
        and growing.nbytes == 0
    )


def test_concat_cache_drives_the_model_like_the_preallocated_one():
    model = small_gpt(seed=2)
    ids = torch.randint(0, 13, (2, 20))
    with torch.no_grad():
        logits = {}
        for name, caches in (
            ("fixed", model.new_kv_cache(batch=2)),
            ("growing", [ConcatKVCache() for _ in range(2)]),
        ):
            steps = [model(ids[:, :5], caches)] + [
                model(ids[:, t : t + 1], caches, start_pos=t)
                for t in range(5, 20)
            ]
            logits[name] = torch.cat(steps, dim=1)
        full = model(ids)
    torch.testing.assert_close(
        logits["growing"], logits["fixed"], rtol=0, atol=0
    )
    torch.testing.assert_close(logits["growing"], full, rtol=1e-5, atol=1e-5)


# ---- decoding helpers -------------------------------------------------------


@pytest.mark.parametrize("n_prompt,n_new", [(1, 1), (1, 15), (5, 20)])
def test_greedy_decode_agrees_with_generate(n_prompt, n_new):
    model = small_gpt(seed=5)
    prompt = torch.randint(0, 13, (2, n_prompt))
    ids, logits = greedy_decode(
        model, prompt, n_new, model.new_kv_cache(batch=2)
    )
    ids_full, logits_full = greedy_decode(model, prompt, n_new)
    assert torch.equal(
        ids, model.generate(prompt, n_new, temperature=0, use_cache=True)
    )
    assert torch.equal(
        ids_full, model.generate(prompt, n_new, temperature=0, use_cache=False)
    )
    assert logits.shape == (2, n_new, 13)
    torch.testing.assert_close(logits, logits_full, rtol=1e-5, atol=1e-5)
    # logits[:, i] came from the prefix before token i
    with torch.no_grad():
        torch.testing.assert_close(
            logits_full,
            model(ids[:, :-1])[:, n_prompt - 1 :],
            rtol=1e-5,
            atol=1e-5,
        )


def test_teacher_forcing_and_recorded_attention_outputs():
    model = small_gpt(seed=6)
    ids = torch.randint(0, 13, (1, 25))
    with torch.no_grad():
        with recording_attention_outputs(model) as full_pass:
            full = model(ids)
        with recording_attention_outputs(model) as step_by_step:
            forced = teacher_forced_logits(
                model, ids, model.new_kv_cache(), n_prompt=4
            )
    torch.testing.assert_close(forced, full, rtol=1e-5, atol=1e-5)
    assert len(full_pass) == 2 and [len(r) for r in full_pass] == [1, 1]
    # the prefill, then 21 single tokens
    assert [len(r) for r in step_by_step] == [22, 22]
    for layer in range(2):
        torch.testing.assert_close(
            torch.cat(step_by_step[layer], 1),
            full_pass[layer][0],
            rtol=1e-5,
            atol=1e-5,
        )
    with torch.no_grad():
        # hooks removed: nothing more is recorded
        model(ids)
    assert [len(r) for r in full_pass] == [1, 1]


# ---- the roofline estimate of time on a GPU ---------------------------------

H100 = next(g for g in GPUS if g.name.startswith("H100"))


def test_h100_figures_are_the_published_ones():
    assert H100.fp16_flops == pytest.approx(
        989.4e12
    ) and H100.hbm_bandwidth == pytest.approx(3.35e12)


def test_roofline_of_one_pass_by_hand():
    """Llama-2-7B in float16: 2 bytes per weight, 2 flops per weight and
    token."""
    N = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 4096 * 32000
    assert LLAMA2_7B.matmul_params() == N
    kv = lambda n: 2 * 32 * n * 32 * 128 * 2  # noqa: E731
    # one token after 100: memory-bound
    decode = (2 * N + kv(101)) / 3.35e12
    assert roofline_seconds(LLAMA2_7B, H100, 1, 100) == pytest.approx(
        decode, rel=1e-9
    )
    # 1000 tokens: compute-bound
    flops = 2 * N * 1000 + 4 * 32 * 32 * 128 * 1000 * 1000
    assert roofline_seconds(LLAMA2_7B, H100, 1000) == pytest.approx(
        flops / 989.4e12, rel=1e-9
    )
    assert forward_bytes(LLAMA2_7B, 1, 100, batch=3) == {
        "weights": 2 * N,
        "kv": 3 * kv(101),
    }


def closed_form_speedup(T, ridge):
    """Per-token work only: step t costs max(1, t / ridge) weight reads without
    a cache, 1 with it."""
    return sum(max(1.0, t / ridge) for t in range(1, T + 1)) / T


@pytest.mark.parametrize(
    "T,expected", [(256, 1.0), (1024, 1.89), (4095, 7.14)]
)
def test_cache_speedup_of_llama2_7b_on_an_h100(T, expected):
    with_cache = generation_seconds(LLAMA2_7B, H100, 1, T, use_cache=True)
    without = generation_seconds(LLAMA2_7B, H100, 1, T, use_cache=False)
    assert without / with_cache == pytest.approx(expected, abs=0.01)
    # the closed form that ignores attention and the cache's reads is within 8%
    # flops per byte = tokens per pass
    ridge = H100.fp16_flops / H100.hbm_bandwidth
    assert without / with_cache == pytest.approx(
        closed_form_speedup(T, ridge), rel=0.08
    )


def test_batching_multiplies_the_recomputation_but_not_the_weight_reads():
    for B in (4, 16):
        weights, kv = 2 * LLAMA2_7B.matmul_params(), LLAMA2_7B.cache_bytes(201)
        # still one read of the weights
        cached = roofline_seconds(LLAMA2_7B, H100, 1, 200, batch=B)
        assert cached == pytest.approx(
            (weights + B * kv) / H100.hbm_bandwidth, rel=1e-9
        )
        assert roofline_seconds(
            LLAMA2_7B, H100, 1000, batch=B
        ) == pytest.approx(
            # compute-bound: B times the flops
            B * roofline_seconds(LLAMA2_7B, H100, 1000),
            rel=1e-9,
        )


def test_generation_passes_are_those_of_generate():
    assert generation_passes(3, 4, use_cache=True) == [
        (3, 0),
        (1, 3),
        (1, 4),
        (1, 5),
    ]
    assert generation_passes(3, 4, use_cache=False) == [
        (3, 0),
        (4, 0),
        (5, 0),
        (6, 0),
    ]


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: roofline_seconds(LLAMA2_7B, H100, 0), "n_new"),
        (lambda: roofline_seconds(LLAMA2_7B, H100, 1, -1), "n_past"),
        (lambda: roofline_seconds(LLAMA2_7B, H100, 1, batch=0), "batch"),
        (lambda: generation_seconds(LLAMA2_7B, H100, 0, 5, True), "n_prompt"),
        (
            lambda: forward_bytes(LLAMA2_7B, 1, bytes_per_element=0),
            "bytes_per_element",
        ),
    ],
)
def test_roofline_rejects_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
