"""How much faster the tiny GPT generates with a KV cache than without, measured on this CPU.

Chapter 8 (the KV cache) times greedy generation of several lengths both ways
(:func:`decode_benchmark`) and compares the ratio with the flop count of :mod:`attnbook.decoding`,
and times single decode steps at several cache lengths (:func:`time_decode_steps`).
"""
from __future__ import annotations

import statistics
import timeit
from dataclasses import dataclass

import torch

from .. import _validate
from ..bench import Timing


def time_generation(model, prompt, n_new: int, use_cache: bool, repeats: int = 3) -> Timing:
    """Seconds that ``model.generate`` takes for ``n_new`` greedy tokens after ``prompt`` (batch, n).

    Runs under ``torch.inference_mode()``, as a deployed model would: no autograd bookkeeping.
    """
    repeats = _validate.positive_int("repeats", repeats)

    def generate():
        with torch.inference_mode():
            model.generate(prompt, n_new, temperature=0, use_cache=use_cache)

    seconds = timeit.Timer(generate).repeat(repeat=repeats, number=1)
    return Timing(statistics.median(seconds), min(seconds), max(seconds), repeats, 1)


def time_decode_steps(model, ids, positions, repeats: int = 20) -> dict[int, Timing]:
    """Seconds of one cached decode step with ``p`` tokens already in the cache, for each ``p`` in ``positions``.

    ``ids`` (1, n) holds at least ``max(positions) + 1`` token ids. For each ``p`` its first ``p`` ids fill
    a fresh cache (one prefill, untimed); then the step ``model(ids[:, p:p + 1], cache, start_pos=p)`` is
    timed ``repeats`` times, one call per repeat, under ``torch.inference_mode()``, each cache's ``length``
    set back to ``p`` after every call, so that every repeat does the same work. The positions take
    turns, so that a busy spell of a shared machine hits them alike. A single step is short enough to
    run undisturbed, so its fastest repeat (``Timing.low``) is comparable with the fastest single prefill.
    Returns ``{p: Timing}`` in the order of ``positions``.
    """
    positions = [_validate.positive_int("position", p) for p in positions]
    repeats = _validate.positive_int("repeats", repeats)
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] <= max(positions):
        raise ValueError(f"ids must have shape (1, n) with n > the largest position {max(positions)}; "
                         f"got {tuple(ids.shape)}")

    def step_at(p):
        cache = model.new_kv_cache()
        token = ids[:, p:p + 1]
        with torch.inference_mode():
            model(ids[:, :p], cache)

        def step():
            with torch.inference_mode():
                model(token, cache, start_pos=p)
            for layer in cache:
                layer.length = p
        return step

    steps = {p: step_at(p) for p in positions}
    for step in steps.values():
        step()                                                # warm-up
    seconds = {p: [] for p in positions}
    for _ in range(repeats):
        for p, step in steps.items():
            seconds[p].extend(timeit.Timer(step).repeat(repeat=1, number=1))
    return {p: Timing(statistics.median(t), min(t), max(t), repeats, 1) for p, t in seconds.items()}


@dataclass(frozen=True)
class DecodeSpeed:
    """Generation speed at one length, with and without the cache, measured in one run.

    Speeds and the speedup use the *fastest* repeat of each mode (``Timing.low``): on a
    shared machine the slower repeats also measure whatever else was running.
    """

    n_new: int
    cached: Timing
    uncached: Timing

    @property
    def cached_tokens_per_s(self) -> float:
        return self.n_new / self.cached.low

    @property
    def uncached_tokens_per_s(self) -> float:
        return self.n_new / self.uncached.low

    @property
    def speedup(self) -> float:
        """How many times faster the cache generates (ratio of the fastest times)."""
        return self.uncached.low / self.cached.low


def decode_benchmark(model, prompt, lengths, repeats=3) -> list[DecodeSpeed]:
    """Greedy generation speed with and without the cache at each of ``lengths`` new tokens.

    ``repeats`` is one count for every length or a list, one per length (fewer for the
    long, slow ones). Each length runs once untimed (warm-up, and a check that both
    modes give the same tokens: greedy decoding is deterministic); then the cached and
    uncached runs alternate, so that a slow spell of a shared machine hits both alike.
    """
    lengths = [_validate.positive_int("length", n) for n in lengths]
    counts = [repeats] * len(lengths) if isinstance(repeats, int) else list(repeats)
    if len(counts) != len(lengths):
        raise ValueError(f"repeats needs one count per length ({len(lengths)}); got {len(counts)}")
    results = []
    for n_new, count in zip(lengths, counts):
        with torch.inference_mode():
            with_cache = model.generate(prompt, n_new, temperature=0, use_cache=True)
            without = model.generate(prompt, n_new, temperature=0, use_cache=False)
        if not torch.equal(with_cache, without):
            raise AssertionError(f"cached and uncached greedy decoding disagree at n_new={n_new}")
        times = {True: [], False: []}
        for _ in range(_validate.positive_int("repeats", count)):
            for use_cache in (True, False):
                times[use_cache].append(time_generation(model, prompt, n_new, use_cache, repeats=1).low)
        cached, uncached = (Timing(statistics.median(t), min(t), max(t), len(t), 1)
                            for t in (times[True], times[False]))
        results.append(DecodeSpeed(n_new, cached, uncached))
    return results
