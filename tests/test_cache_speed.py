"""The decode benchmark of chapter 8 (attnbook.experiments.cache_speed): its bookkeeping, not its speed."""
import pytest
import torch

from attnbook.bench import Timing
from attnbook.experiments.cache_speed import DecodeSpeed, decode_benchmark, time_generation
from attnbook.gpt import GPTConfig, TinyGPT

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small_gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    config = dict(vocab_size=13, context_length=32, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16) | overrides
    return TinyGPT(GPTConfig(**config), use_sdpa=False).eval()


def test_decode_benchmark_reports_both_modes():
    model = small_gpt(seed=3)
    prompt = torch.zeros(1, 1, dtype=torch.long)
    rows = decode_benchmark(model, prompt, [4, 8], repeats=[2, 1])
    assert [r.n_new for r in rows] == [4, 8]
    assert [r.cached.repeats for r in rows] == [2, 1]
    for r in rows:
        assert r.cached.low <= r.cached.median <= r.cached.high
        assert r.speedup == pytest.approx(r.uncached.low / r.cached.low)
        assert r.cached_tokens_per_s == pytest.approx(r.n_new / r.cached.low)
    timing = time_generation(model, prompt, 3, use_cache=True, repeats=2)
    assert timing.repeats == 2 and timing.median > 0
    with pytest.raises(ValueError, match="one count per length"):
        decode_benchmark(model, prompt, [4, 8], repeats=[1])


def test_decode_benchmark_refuses_when_the_modes_disagree():
    class Broken:
        def generate(self, prompt, n_new, temperature, use_cache):
            return torch.full((1, n_new), int(use_cache))
    with pytest.raises(AssertionError, match="disagree"):
        decode_benchmark(Broken(), torch.zeros(1, 1, dtype=torch.long), [3])


def test_decode_speed_ratio():
    row = DecodeSpeed(100, Timing(0.6, 0.5, 0.9, 3, 1), Timing(2.2, 2.0, 2.1, 3, 1))   # the fastest runs count
    assert row.speedup == 4.0 and row.cached_tokens_per_s == 200.0 and row.uncached_tokens_per_s == 50.0


def test_time_decode_steps_repeats_the_same_steps_in_turn():
    from attnbook.experiments.cache_speed import time_decode_steps
    model = small_gpt(seed=1)
    ids = torch.randint(0, 13, (1, 12), generator=torch.Generator().manual_seed(0))
    calls = []
    original = model.forward

    def recording(x, kv_cache=None, start_pos=0, **kwargs):
        calls.append((x.shape[1], start_pos, kv_cache[0].length if kv_cache is not None else None))
        return original(x, kv_cache, start_pos, **kwargs)

    model.forward = recording
    timings = time_decode_steps(model, ids, [7, 3], repeats=4)
    assert list(timings) == [7, 3]
    for timing in timings.values():
        assert timing.repeats == 4 and 0 < timing.low <= timing.median <= timing.high
    # a prefill of p tokens for each position, then a warm-up and 4 timed steps of each, taking turns:
    # every step is one token at position p with p cached (the cache's length restored after each)
    assert calls == [(7, 0, 0), (3, 0, 0)] + [(1, 7, 7), (1, 3, 3)] * 5
    with pytest.raises(ValueError, match="largest position 12"):
        time_decode_steps(model, ids, [3, 12])
