"""How much faster the tiny GPT generates with a KV cache than without,
measured on this CPU.

Chapter 8 (the KV cache) times greedy generation of several lengths both ways
(:func:`decode_benchmark`) and compares the ratio with the flop count of
:mod:`attnbook.decoding`, and times single decode steps at several cache
lengths (:func:`time_decode_steps`) and single uncached passes at several
lengths (:func:`time_passes`), from which :func:`generation_estimate` sums what
a whole generation would take if none of its calls were slowed by the machine's
other work (on a busy machine, timed by each call's CPU time, ``cpu=True``);
:func:`grows_with_length` flags a run in which they still were.
"""

from __future__ import annotations

import random
import statistics
import time
import timeit
from dataclasses import dataclass

import numpy as np
import torch

from .. import _validate
from ..bench import Timing


def time_generation(
    model, prompt, n_new: int, use_cache: bool, repeats: int = 3
) -> Timing:
    """Seconds that ``model.generate`` takes for ``n_new`` greedy tokens after
    ``prompt`` (batch, n).

    Runs under ``torch.inference_mode()``, as a deployed model would: no
    autograd bookkeeping.
    """
    repeats = _validate.positive_int("repeats", repeats)

    def generate():
        with torch.inference_mode():
            model.generate(prompt, n_new, temperature=0, use_cache=use_cache)

    seconds = timeit.Timer(generate).repeat(repeat=repeats, number=1)
    return Timing(
        statistics.median(seconds), min(seconds), max(seconds), repeats, 1
    )


def time_decode_steps(
    model,
    ids,
    positions,
    repeats: int = 20,
    seed: int = 0,
    cpu: bool = False,
) -> dict[int, Timing]:
    """Seconds of one cached decode step with ``p`` tokens already in the
    cache, for each ``p`` in ``positions``.

    ``ids`` (1, n) holds at least ``max(positions) + 1`` token ids. For each
    ``p`` its first ``p`` ids fill a fresh cache (one prefill, untimed); then
    the step ``model(ids[:, p:p + 1], cache, start_pos=p)`` is timed
    ``repeats`` times, one call per repeat, under ``torch.inference_mode()``,
    each cache's ``length`` set back to ``p`` after every call, so that every
    repeat does the same work. The positions take turns, in an order shuffled
    anew in every round (from ``seed``), so that neither a busy spell of a
    shared machine nor the call that ran just before favours one of them. A
    single step is short enough to run undisturbed, so its fastest repeat
    (``Timing.low``) is comparable with the fastest single prefill. With
    ``cpu=True`` each call is timed by its thread's CPU time (see
    :func:`_in_turns`). Returns ``{p: Timing}`` in the order of ``positions``.
    """
    positions = [_validate.positive_int("position", p) for p in positions]
    repeats = _validate.positive_int("repeats", repeats)
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] <= max(positions):
        raise ValueError(
            "ids must have shape (1, n) with n > the largest position "
            f"{max(positions)}; "
            f"got {tuple(ids.shape)}"
        )
    return _in_turns(
        {p: _decode_step(model, ids, p) for p in positions},
        repeats,
        seed,
        cpu,
    )


def time_passes(
    model,
    ids,
    lengths,
    repeats: int = 20,
    seed: int = 0,
    cpu: bool = False,
) -> dict[int, Timing]:
    """Seconds of one uncached forward pass over the first ``n`` tokens of
    ``ids``, for each ``n`` in ``lengths``.

    This is the pass that step ``n`` of generation without a cache makes
    (``model(ids[:, :n])``, as in ``model.generate(..., use_cache=False)``).
    ``ids`` (1, m) holds at least ``max(lengths)`` token ids. Each pass runs
    once untimed (warm-up), then ``repeats`` times, one call per repeat, under
    ``torch.inference_mode()``, the lengths taking turns as in
    :func:`time_decode_steps`. Returns ``{n: Timing}`` in the order of
    ``lengths``.
    """
    lengths = [_validate.positive_int("length", n) for n in lengths]
    repeats = _validate.positive_int("repeats", repeats)
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < max(lengths):
        raise ValueError(
            "ids must have shape (1, m) with m >= the longest length "
            f"{max(lengths)}; "
            f"got {tuple(ids.shape)}"
        )
    return _in_turns(
        {n: _uncached_pass(model, ids, n) for n in lengths},
        repeats,
        seed,
        cpu,
    )


def time_generation_calls(
    model,
    ids,
    lengths,
    positions,
    repeats: int = 20,
    seed: int = 0,
    cpu: bool = False,
) -> tuple[dict[int, Timing], dict[int, Timing]]:
    """The passes of :func:`time_passes` and the steps of
    :func:`time_decode_steps`, all taking turns.

    Returns ``(passes, steps)``: ``{n: Timing}`` for a pass without a cache
    over ``n`` tokens and ``{p: Timing}`` for a decode step with ``p`` tokens
    cached. Because every call takes its turn in the same loop, a busy spell of
    a shared machine hits the passes and the steps alike, so that their ratios
    (the estimate of :func:`generation_estimate`) are not skewed by when each
    was timed. The order of the calls is shuffled anew in every round (from
    ``seed``): in a fixed order the same step would always run right after the
    longest pass, which slows it. With ``cpu=True`` each call is timed by its
    thread's CPU time (see :func:`_in_turns`).
    """
    lengths = [_validate.positive_int("length", n) for n in lengths]
    positions = [_validate.positive_int("position", p) for p in positions]
    repeats = _validate.positive_int("repeats", repeats)
    _check_ids(ids, max(max(lengths), max(positions) + 1))
    calls = {("pass", n): _uncached_pass(model, ids, n) for n in lengths}
    calls |= {("step", p): _decode_step(model, ids, p) for p in positions}
    timings = _in_turns(calls, repeats, seed, cpu)
    return (
        {n: timings["pass", n] for n in lengths},
        {p: timings["step", p] for p in positions},
    )


def _check_ids(ids, needed: int):
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < needed:
        raise ValueError(
            f"ids must have shape (1, m) with m >= {needed} (the longest "
            "pass, or the largest "
            f"position + 1); got {tuple(ids.shape)}"
        )


def _uncached_pass(model, ids, n):
    """A call that runs ``model(ids[:, :n])`` without a cache, as generation
    without a cache does."""
    prefix = ids[:, :n]

    def run():
        with torch.inference_mode():
            model(prefix)

    return run


def _decode_step(model, ids, p):
    """A call that runs one decode step at position ``p`` after a prefill of
    ``p`` tokens (done here, once).

    The cache's length is set back to ``p`` after every call, so that every
    call does the same work.
    """
    cache = model.new_kv_cache()
    token = ids[:, p : p + 1]
    with torch.inference_mode():
        model(ids[:, :p], cache)

    def step():
        with torch.inference_mode():
            model(token, cache, start_pos=p)
        for layer in cache:
            layer.length = p

    return step


def _in_turns(
    calls: dict, repeats: int, seed: int = 0, cpu: bool = False
) -> dict:
    """Run each call once untimed (warm-up), then ``repeats`` rounds in which
    every call runs once, timed, in an order shuffled anew in every round.

    A call can run slower right after another one (a long pass leaves other
    data in the CPU's caches); in a fixed order the same call would always
    follow the same one, and its fastest time would carry that bias. The
    shuffle (``random.Random(seed)``, so that a run can be repeated) gives
    every call rounds after different neighbours.

    ``cpu=False`` times each call by the wall clock (``time.perf_counter``);
    ``cpu=True`` by the CPU time of the calling thread (``time.thread_time``),
    which leaves out the moments in which the operating system ran another
    program on the core (on a busy machine a call of a few milliseconds can be
    interrupted in every one of its repeats, so that even the fastest repeat
    includes other programs' work). That is the whole call's time only
    when torch runs its operations on the calling thread, so ``cpu=True``
    requires ``torch.get_num_threads() == 1``.
    """
    if cpu and torch.get_num_threads() != 1:
        raise ValueError(
            "cpu=True times the calling thread only, so torch must run on "
            f"one thread; it runs on {torch.get_num_threads()} "
            "(torch.set_num_threads(1))"
        )
    clock = time.thread_time if cpu else time.perf_counter
    for call in calls.values():
        call()  # warm-up
    seconds = {key: [] for key in calls}
    order = list(calls)
    shuffler = random.Random(seed)
    for _ in range(repeats):
        shuffler.shuffle(order)
        for key in order:
            seconds[key].extend(
                timeit.Timer(calls[key], timer=clock).repeat(
                    repeat=1, number=1
                )
            )
    return {
        key: Timing(statistics.median(t), min(t), max(t), repeats, 1)
        for key, t in seconds.items()
    }


def grows_with_length(
    seconds: dict[int, float], tolerance: float = 0.9
) -> bool:
    """True when the times in ``seconds`` (``{length: seconds}``, e.g. the
    fastest passes of :func:`time_generation_calls`) do not fall as the
    length grows: each, in order of length, is at least ``tolerance`` times
    the one before it.

    A longer pass does more of the same work, so on an undisturbed machine
    its fastest time is never much shorter; a time that falls marks a
    fastest time that the machine's other work still slowed, and a run whose
    estimate should not be trusted.
    """
    if not 0 < tolerance <= 1:
        raise ValueError(f"tolerance must be in (0, 1]; got {tolerance}")
    times = [seconds[n] for n in sorted(seconds)]
    return all(
        later >= tolerance * earlier
        for earlier, later in zip(times, times[1:])
    )


def generation_estimate(
    pass_seconds: dict[int, float],
    step_seconds: dict[int, float],
    n_new: int,
    prompt_len: int = 1,
) -> tuple[float, float]:
    """Seconds of greedy generation of ``n_new`` tokens after a
    ``prompt_len``-token prompt, summed from single calls.

    Returns ``(with_cache, recomputing)``, the sums over the calls that
    ``model.generate`` makes: recomputing, one pass over ``n`` tokens for ``n =
    prompt_len, ..., prompt_len + n_new - 1``; with the cache, one pass over
    the prompt and then ``n_new - 1`` decode steps with ``p = prompt_len, ...,
    prompt_len + n_new - 2`` tokens cached (the last new token is returned,
    never fed back). ``pass_seconds`` maps a pass length to its time (e.g. the
    fastest of :func:`time_passes`), and must cover every length needed; times
    between the measured lengths are interpolated linearly. ``step_seconds``
    maps a cache length ``p`` to the time of a step (e.g. from
    :func:`time_decode_steps`), interpolated linearly and held constant beyond
    the measured lengths.
    """
    n_new = _validate.positive_int("n_new", n_new)
    prompt_len = _validate.positive_int("prompt_len", prompt_len)
    needed = (prompt_len, prompt_len + n_new - 1)
    if not pass_seconds or not step_seconds:
        raise ValueError(
            "pass_seconds and step_seconds need at least one measured length "
            "each"
        )
    if min(pass_seconds) > needed[0] or max(pass_seconds) < needed[1]:
        raise ValueError(
            f"pass_seconds must cover the pass lengths {needed[0]} to "
            f"{needed[1]}; "
            f"measured {min(pass_seconds)} to {max(pass_seconds)}"
        )
    pass_n, pass_t = zip(*sorted(pass_seconds.items()))
    step_p, step_t = zip(*sorted(step_seconds.items()))
    passes = np.arange(needed[0], needed[1] + 1)
    steps = np.arange(prompt_len, prompt_len + n_new - 1)
    recomputing = float(np.interp(passes, pass_n, pass_t).sum())
    with_cache = float(
        np.interp(prompt_len, pass_n, pass_t)
        + np.interp(steps, step_p, step_t).sum()
    )
    return with_cache, recomputing


@dataclass(frozen=True)
class DecodeSpeed:
    """Generation speed at one length, with and without the cache, measured in
    one run.

    Speeds and the speedup use the *fastest* repeat of each mode
    (``Timing.low``): on a shared machine the slower repeats also measure
    whatever else was running.
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
        """How many times faster the cache generates (ratio of the fastest
        times)."""
        return self.uncached.low / self.cached.low


def decode_benchmark(model, prompt, lengths, repeats=3) -> list[DecodeSpeed]:
    """Greedy generation speed with and without the cache at each of
    ``lengths`` new tokens.

    ``repeats`` is one count for every length or a list, one per length (fewer
    for the long, slow ones). Each length runs once untimed (warm-up, and a
    check that both modes give the same tokens: greedy decoding is
    deterministic); then the cached and uncached runs alternate, so that a slow
    spell of a shared machine hits both alike.
    """
    lengths = [_validate.positive_int("length", n) for n in lengths]
    counts = (
        [repeats] * len(lengths) if isinstance(repeats, int) else list(repeats)
    )
    if len(counts) != len(lengths):
        raise ValueError(
            f"repeats needs one count per length ({len(lengths)}); got "
            f"{len(counts)}"
        )
    results = []
    for n_new, count in zip(lengths, counts):
        with torch.inference_mode():
            with_cache = model.generate(
                prompt, n_new, temperature=0, use_cache=True
            )
            without = model.generate(
                prompt, n_new, temperature=0, use_cache=False
            )
        if not torch.equal(with_cache, without):
            raise AssertionError(
                "cached and uncached greedy decoding disagree at "
                f"n_new={n_new}"
            )
        times = {True: [], False: []}
        for _ in range(_validate.positive_int("repeats", count)):
            for use_cache in (True, False):
                times[use_cache].append(
                    time_generation(
                        model, prompt, n_new, use_cache, repeats=1
                    ).low
                )
        cached, uncached = (
            Timing(statistics.median(t), min(t), max(t), len(t), 1)
            for t in (times[True], times[False])
        )
        results.append(DecodeSpeed(n_new, cached, uncached))
    return results
