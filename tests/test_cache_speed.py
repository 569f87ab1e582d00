"""The decode benchmark of chapter 8 (attnbook.experiments.cache_speed): its
bookkeeping, not its speed."""

import pytest
import torch

from attnbook.bench import Timing
from attnbook.experiments.cache_speed import (
    DecodeSpeed,
    decode_benchmark,
    time_generation,
)
from attnbook.gpt import GPTConfig, TinyGPT

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
    return TinyGPT(GPTConfig(**config), use_sdpa=False).eval()


def record_calls(model):
    """Wrap model.forward to record each call as (tokens, start_pos, cached
    length or None); returns the list."""
    calls, original = [], model.forward

    def recording(x, kv_cache=None, start_pos=0, **kwargs):
        calls.append(
            (
                x.shape[1],
                start_pos,
                kv_cache[0].length if kv_cache is not None else None,
            )
        )
        return original(x, kv_cache, start_pos, **kwargs)

    model.forward = recording
    return calls


def assert_rounds(calls, each, repeats):
    """``calls`` are ``repeats`` rounds, each of which runs every call of
    ``each`` once, in some order; returns the rounds."""
    assert len(calls) == len(each) * repeats
    rounds = [
        calls[i : i + len(each)] for i in range(0, len(calls), len(each))
    ]
    for one_round in rounds:
        assert sorted(one_round, key=repr) == sorted(each, key=repr)
    return rounds


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
    # the fastest runs count
    row = DecodeSpeed(
        100, Timing(0.6, 0.5, 0.9, 3, 1), Timing(2.2, 2.0, 2.1, 3, 1)
    )
    assert (
        row.speedup == 4.0
        and row.cached_tokens_per_s == 200.0
        and row.uncached_tokens_per_s == 50.0
    )


def test_time_decode_steps_repeats_the_same_steps_in_turn():
    from attnbook.experiments.cache_speed import time_decode_steps

    model = small_gpt(seed=1)
    ids = torch.randint(
        0, 13, (1, 12), generator=torch.Generator().manual_seed(0)
    )
    calls = record_calls(model)
    timings = time_decode_steps(model, ids, [7, 3], repeats=4)
    assert list(timings) == [7, 3]
    for timing in timings.values():
        assert (
            timing.repeats == 4
            and 0 < timing.low <= timing.median <= timing.high
        )
    # a prefill of p tokens for each position, then a warm-up and 4 timed steps
    # of each, taking turns: every step is one token at position p with p
    # cached (the cache's length restored after each)
    assert calls[:4] == [(7, 0, 0), (3, 0, 0), (1, 7, 7), (1, 3, 3)]
    assert_rounds(calls[4:], [(1, 7, 7), (1, 3, 3)], 4)
    with pytest.raises(ValueError, match="largest position 12"):
        time_decode_steps(model, ids, [3, 12])


def test_time_passes_times_uncached_prefixes_in_turn():
    from attnbook.experiments.cache_speed import time_passes

    model = small_gpt(seed=2)
    ids = torch.randint(
        0, 13, (1, 10), generator=torch.Generator().manual_seed(1)
    )
    calls = record_calls(model)
    timings = time_passes(model, ids, [10, 1, 4], repeats=3)
    assert list(timings) == [10, 1, 4]
    for timing in timings.values():
        assert (
            timing.repeats == 3
            and 0 < timing.low <= timing.median <= timing.high
        )
    # a warm-up and 3 timed passes of each length, taking turns, each over a
    # prefix without a cache
    each = [(10, 0, None), (1, 0, None), (4, 0, None)]
    assert calls[:3] == each
    assert_rounds(calls[3:], each, 3)
    with pytest.raises(ValueError, match="longest length 11"):
        time_passes(model, ids, [3, 11])


def test_generation_estimate_sums_the_calls_of_generate():
    from attnbook.experiments.cache_speed import generation_estimate

    # passes cost 1 + n/10 s exactly at the measured lengths 1, 5, 9, so linear
    # in between
    passes = {1: 1.1, 5: 1.5, 9: 1.9}
    # held at 0.2 below p = 2 and at 0.4 above p = 4
    steps = {2: 0.2, 4: 0.4}
    with_cache, recomputing = generation_estimate(
        passes, steps, n_new=8, prompt_len=2
    )
    # recomputing: passes over 2, ..., 9 tokens; with the cache: a pass over 2,
    # then steps at p = 2, ..., 8
    assert recomputing == pytest.approx(sum(1 + n / 10 for n in range(2, 10)))
    assert with_cache == pytest.approx(1.2 + 0.2 + 0.3 + 0.4 * 5)
    # a one-token prompt and a single new token: one pass over the prompt in
    # both modes, no step
    assert generation_estimate(passes, steps, n_new=1) == pytest.approx(
        (1.1, 1.1)
    )
    with pytest.raises(ValueError, match="cover the pass lengths 1 to 10"):
        generation_estimate(passes, steps, n_new=10)


def test_generation_estimate_matches_the_calls_that_generate_makes():
    """Count the calls of model.generate both ways; with unit times per call
    the estimate counts them."""
    from attnbook.experiments.cache_speed import generation_estimate

    model = small_gpt(seed=4)
    calls = {True: [], False: []}
    original = model.forward
    prompt = torch.zeros(1, 3, dtype=torch.long)
    for use_cache in (True, False):

        def recording(x, kv_cache=None, start_pos=0, **kwargs):
            calls[use_cache].append(
                (x.shape[1], kv_cache[0].length if kv_cache is not None else 0)
            )
            return original(x, kv_cache, start_pos, **kwargs)

        model.forward = recording
        model.generate(prompt, 6, temperature=0, use_cache=use_cache)
    # a pass over n tokens costs n, a step with p cached costs 100 + p: the
    # estimate must equal the sum of the calls
    passes = {n: float(n) for n in range(1, 20)}
    steps = {p: 100.0 + p for p in range(0, 20)}
    with_cache, recomputing = generation_estimate(
        passes, steps, n_new=6, prompt_len=3
    )
    assert recomputing == sum(n for n, _ in calls[False])
    assert with_cache == sum(
        n if p == 0 else 100.0 + p for n, p in calls[True]
    )


def test_time_generation_calls_interleaves_passes_and_steps():
    from attnbook.experiments.cache_speed import time_generation_calls

    model = small_gpt(seed=5)
    ids = torch.randint(
        0, 13, (1, 9), generator=torch.Generator().manual_seed(2)
    )
    calls = record_calls(model)
    passes, steps = time_generation_calls(
        model, ids, [9, 2], [5, 1], repeats=3
    )
    assert list(passes) == [9, 2] and list(steps) == [5, 1]
    for timing in list(passes.values()) + list(steps.values()):
        assert (
            timing.repeats == 3
            and 0 < timing.low <= timing.median <= timing.high
        )
    # the steps' prefills (untimed) first, then a warm-up and 3 timed rounds in
    # which every call takes its turn
    each = [(9, 0, None), (2, 0, None), (1, 5, 5), (1, 1, 1)]
    assert calls[:6] == [(5, 0, 0), (1, 0, 0)] + each
    assert_rounds(calls[6:], each, 3)
    # a step at position 8 reads 9 ids: enough
    time_generation_calls(model, ids, [3], [8], repeats=1)
    with pytest.raises(ValueError, match="m >= 10"):
        time_generation_calls(model, ids, [3], [9], repeats=1)
    with pytest.raises(ValueError, match="m >= 10"):
        time_generation_calls(model, ids, [10], [1], repeats=1)


def test_time_generation_calls_shuffles_the_order_of_every_round():
    """In a fixed order the first step of every round ran right after the
    longest pass (which slows it): each call must follow different calls in
    different rounds, in an order that a seed repeats."""
    from attnbook.experiments.cache_speed import time_generation_calls

    model = small_gpt(seed=6)
    ids = torch.randint(
        0, 13, (1, 9), generator=torch.Generator().manual_seed(3)
    )
    each = [(9, 0, None), (2, 0, None), (1, 5, 5), (1, 1, 1)]

    def rounds(seed):
        calls = record_calls(model)
        time_generation_calls(model, ids, [9, 2], [5, 1], 12, seed=seed)
        model.forward = type(model).forward.__get__(model)
        # after the steps' prefills and the warm-up, in the given order
        assert calls[:6] == [(5, 0, 0), (1, 0, 0)] + each
        return assert_rounds(calls[6:], each, 12)

    first = rounds(seed=0)
    timed = [call for one_round in first for call in one_round]
    before = {call: set() for call in each}
    for previous, call in zip(timed, timed[1:]):
        before[call].add(previous)
    # every call runs after at least two different calls, and no step
    # always after the longest pass
    assert all(len(calls) >= 2 for calls in before.values())
    assert before[1, 5, 5] != {(9, 0, None)}
    assert before[1, 1, 1] != {(9, 0, None)}
    # the rounds are not all in one order; a seed repeats its orders, another
    # seed gives others
    assert len({tuple(one_round) for one_round in first}) > 1
    assert rounds(seed=0) == first
    assert rounds(seed=1) != first


def test_grows_with_length_flags_a_pass_time_that_falls():
    from attnbook.experiments.cache_speed import grows_with_length

    # in order of length, whatever the order of the dict
    assert grows_with_length({256: 7.0, 1: 1.0, 128: 4.0})
    # a fall within the tolerance passes, a larger one fails (the disturbed
    # run of chapter 8: 11.94 ms at 128 tokens, 6.94 ms at 224)
    assert grows_with_length({1: 1.0, 2: 0.95, 3: 2.0})
    assert not grows_with_length({128: 11.94, 224: 6.94, 256: 17.99})
    assert not grows_with_length({1: 1.0, 2: 0.8}, tolerance=0.9)
    assert grows_with_length({1: 1.0, 2: 0.8}, tolerance=0.8)
    assert grows_with_length({5: 1.0})
    with pytest.raises(ValueError, match="tolerance must be in"):
        grows_with_length({1: 1.0}, tolerance=0)


def test_cpu_time_leaves_out_the_time_the_thread_waits():
    """With cpu=True a call is timed by its thread's CPU time: a call that
    sleeps 20 ms (as if the operating system ran another program meanwhile)
    takes 20 ms of wall time and almost no CPU time."""
    import time

    from attnbook.experiments.cache_speed import time_passes

    class Sleeper:
        def __call__(self, x, *args, **kwargs):
            time.sleep(0.02)

    ids = torch.zeros(1, 3, dtype=torch.long)
    wall = time_passes(Sleeper(), ids, [2, 3], repeats=2)
    cpu = time_passes(Sleeper(), ids, [2, 3], repeats=2, cpu=True)
    assert all(timing.low >= 0.02 for timing in wall.values())
    assert all(timing.high < 0.01 for timing in cpu.values())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(ValueError, match="it runs on 2"):
            time_passes(Sleeper(), ids, [2], repeats=1, cpu=True)
    finally:
        torch.set_num_threads(threads)
