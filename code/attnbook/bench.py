"""Measuring time and memory the same way in every chapter.

Timings are noisy, so chapters compare *ratios* measured in the same run, and
report the machine they ran on (:func:`machine`).

Every chapter that reports a time or a peak of memory measures it here
(chapters 1, 4, 5, 8, 9, 12 and 13), and names the machine with
:func:`machine`. Chapter 4 times with :func:`one_blas_thread` and fits its
scaling exponents with :func:`fit_power_law`, which says when a fit is not to
be trusted. Chapter 9 compares its thread counts with :func:`compare_timings`,
which decides only when the fastest runs and the medians agree, and its tile
sizes with :func:`tile_saving_verdict`, which decides only what every round
of the run shows.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import math
import os
import platform
import statistics
import timeit
import tracemalloc
from dataclasses import dataclass

from . import _validate


@dataclass(frozen=True)
class Timing:
    """Repeated runs of one call, in seconds: the fastest (``low``), the median
    and the slowest.

    Compare ``low``: noise from other processes only ever adds time, so the
    fastest repeat is the best estimate of what the call itself costs, and
    ratios of minima are the stablest ratios.
    """

    median: float
    low: float
    high: float
    repeats: int
    loops: int

    def __str__(self) -> str:
        return (
            f"{_fmt_seconds(self.low)} (best of {self.repeats}; median "
            f"{_fmt_seconds(self.median)})"
        )


def _fmt_seconds(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


def time_call(
    fn, *args, repeats: int = 5, min_time: float = 0.05, **kwargs
) -> Timing:
    """Time ``fn(*args, **kwargs)``: loops per repeat chosen so a repeat lasts
    ``min_time``.

    Returns the fastest, median and slowest per-call time over ``repeats``
    repeats (at least 5 for a number the book quotes). The last run of the
    calibration already timed ``loops`` loops, so it counts as the first
    repeat: a call that takes seconds runs ``repeats`` times, not once more.
    """
    repeats = _validate.positive_int("repeats", repeats)
    timer = timeit.Timer(lambda: fn(*args, **kwargs))
    loops, first = _loops_for(timer, min_time)
    per_call = [
        t / loops
        for t in [first] + timer.repeat(repeat=repeats - 1, number=loops)
    ]
    return Timing(
        statistics.median(per_call),
        min(per_call),
        max(per_call),
        repeats,
        loops,
    )


def _loops_for(timer: timeit.Timer, min_time: float) -> tuple[int, float]:
    """Smallest power of two of loops whose total time reaches ``min_time``,
    and that total time."""
    loops = 1
    while (elapsed := timer.timeit(loops)) < min_time and loops < 1_000_000:
        loops *= 2
    return loops, elapsed


def peak_memory(fn, *args, **kwargs) -> tuple[object, int]:
    """Run ``fn`` once; return ``(result, peak bytes allocated during the
    call)``.

    Measured with :mod:`tracemalloc`, which sees numpy's array buffers. The
    peak is relative to what was allocated before the call.
    """
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        result = fn(*args, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak - base


def machine() -> str:
    """One line naming the machine and the versions a measurement depends
    on."""
    import numpy

    cpu = _cpu_name() or platform.machine()
    parts = [
        f"{cpu}, {os.cpu_count()} logical cores",
        f"Python {platform.python_version()}",
        f"numpy {numpy.__version__}",
    ]
    blas = blas_threads()
    if blas is not None:
        parts[-1] += f" (BLAS: {blas} thread{'s' if blas != 1 else ''})"
    try:
        import torch

        threads = torch.get_num_threads()
        parts.append(
            f"torch {torch.__version__} ({threads} "
            f"thread{'s' if threads != 1 else ''}, "
            f"{torch.backends.cpu.get_cpu_capability()} kernels)"
        )
    except ImportError:
        pass
    return "; ".join(parts)


def blas_threads() -> int | None:
    """How many threads numpy's BLAS (the library behind its matrix products)
    may use, as threadpoolctl reports it; None without threadpoolctl or when
    it finds no BLAS.

    Where several BLAS libraries are loaded (numpy's and another package's),
    the largest count. NumPy's elementwise operations always run on one
    thread, whatever this says.
    """
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    import numpy  # noqa: F401  (loads numpy's BLAS, so that it is listed)

    counts = [
        pool["num_threads"]
        for pool in threadpool_info()
        if pool.get("user_api") == "blas"
    ]
    return max(counts) if counts else None


def cpu_caches(
    root: str = "/sys/devices/system/cpu/cpu0/cache",
) -> dict[str, int]:
    """The data and unified cache sizes one core sees, in bytes, read from
    Linux's sysfs: ``{"L1": ..., "L2": ..., "L3": ...}`` (``{}`` where sysfs
    does not say, as on macOS or Windows).

    These are per-cache sizes, not the totals that ``lscpu`` prints (its ``L2
    cache: 1 MiB (2 instances)`` sums the private L2 of two cores);
    ``index*/shared_cpu_list`` says which cores share each one.
    """
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = {}
    for index in sorted(glob.glob(os.path.join(root, "index*"))):
        try:
            with open(os.path.join(index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(index, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(index, "size")) as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not text:
            continue
        size = (
            int(text[:-1]) * units[text[-1]]
            if text[-1] in units
            else int(text)
        )
        sizes[f"L{level}"] = size
    return sizes


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def format_bytes(n: float) -> str:
    """Bytes in binary units: ``format_bytes(3 * 2**20) == '3.0 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


@contextlib.contextmanager
def one_blas_thread():
    """Limit numpy's BLAS (the library behind its matrix products) to one
    thread inside the block.

    Yields a line saying what was limited, for the output that reports the
    timings. NumPy's elementwise operations run on one thread, so a fair
    comparison with a matrix product gives the product one thread too; and on a
    machine shared with other programs a multithreaded BLAS can spend most of a
    small product waiting for its threads to be scheduled. Uses threadpoolctl's
    ``threadpool_limits(limits=1, user_api="blas")``; without threadpoolctl
    nothing is limited, and the line says so.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield "not limited (threadpoolctl is not installed)"
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield "1 (threadpoolctl)"


@dataclass(frozen=True)
class PowerLawFit:
    """The exponent ``a`` of ``y ~ x**a``, fitted by least squares in log-log,
    and its local slopes.

    ``local[i]`` is the slope between the points ``i`` and ``i + 1``. The fit
    is ``reliable`` when the local slopes agree within ``max_spread`` (largest
    minus smallest): one disturbed timing bends the two local slopes beside it
    in opposite directions, so it shows up as a spread, where the least-squares
    slope alone would report a wrong exponent without a warning.
    """

    slope: float
    intercept: float
    local: tuple[float, ...]
    max_spread: float

    @property
    def spread(self) -> float:
        return max(self.local) - min(self.local)

    @property
    def reliable(self) -> bool:
        return self.spread <= self.max_spread


def fit_power_law(x, y, max_spread: float = 0.5) -> PowerLawFit:
    """Fit ``y ~ x**a`` over the points given (pass the large sizes only) and
    judge the fit.

    ``x`` and ``y`` are positive and of equal length, at least 3 points (2
    local slopes to compare).
    """
    x, y = [float(v) for v in x], [float(v) for v in y]
    if len(x) != len(y) or len(x) < 3:
        raise ValueError(
            "fit_power_law needs x and y of equal length, at least 3; got "
            f"{len(x)} and {len(y)}"
        )
    if min(x) <= 0 or min(y) <= 0:
        raise ValueError(
            f"fit_power_law needs positive x and y; got x = {x}, y = {y}"
        )
    if len(set(x)) != len(x):
        raise ValueError(f"fit_power_law needs distinct x; got {x}")
    lx, ly = [math.log(v) for v in x], [math.log(v) for v in y]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    slope = sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum(
        (a - mx) ** 2 for a in lx
    )
    local = tuple(
        (ly[i + 1] - ly[i]) / (lx[i + 1] - lx[i]) for i in range(len(lx) - 1)
    )
    return PowerLawFit(slope, my - slope * mx, local, max_spread)


def _slopes_text(fit: PowerLawFit) -> str:
    return ", ".join(f"{s:.2f}" for s in fit.local)


def time_verdict(name, fit, fit_median, sizes) -> str:
    """One sentence on the time fits of one version (``fit`` on the fastest
    runs, ``fit_median`` on the medians, over ``sizes``): an exponent only if
    each fit's local slopes agree within its ``max_spread`` and the two fits
    agree within 0.25; "the model's 2" only if both are within 0.25 of 2,
    "not" only if both are more than 0.5 away.

    When a fit's local slopes disagree, the sentence names that fit and prints
    its local slopes (and says when the other fit's agree), so that the
    reader can check the rejection against the numbers printed.
    """
    where = f"the {name} version's time over n = {sizes[0]}..{sizes[-1]}"
    fits = {"fastest runs": fit, "medians": fit_median}
    failed = [label for label, f in fits.items() if not f.reliable]
    if failed:
        spread = max(fits[label].max_spread for label in failed)
        if len(failed) == 2:
            listed = "; ".join(
                f"{label}: {_slopes_text(fits[label])}" for label in failed
            )
        else:
            listed = _slopes_text(fits[failed[0]])
        if len(failed) == 2:
            which = "the local slopes of both its fits"
        else:
            which = f"the local slopes of its {failed[0]}"
        passed = [label for label in fits if label not in failed]
        others = ""
        if passed:
            other = passed[0]
            others = (
                f" (those of its {other}, {_slopes_text(fits[other])}, agree)"
            )
        return (
            f"for {where}, {which} ({listed}) differ by more than "
            f"{spread}{others}, so this run gives no reliable exponent for it"
        )
    slopes = (
        f"{fit.slope:.2f} (fastest runs), {fit_median.slope:.2f} (medians)"
    )
    if abs(fit.slope - fit_median.slope) > 0.25:
        return (
            f"{where} had fitted slopes {slopes}, more than 0.25 apart, so "
            "this run gives no reliable exponent for it"
        )
    off = max(abs(fit.slope - 2), abs(fit_median.slope - 2))
    near = min(abs(fit.slope - 2), abs(fit_median.slope - 2))
    if off <= 0.25:
        judged = "the model's 2, within 0.25 in both fits"
    elif near > 0.5:
        judged = (
            "not the model's 2 (both fits off by more than 0.5), so at "
            "these sizes more than the count of scores set the time"
        )
    else:
        judged = (
            "between the two bands (within 0.25 of 2 in both fits, or more "
            "than 0.5 from it in both), so this run neither confirms the "
            "model's 2 nor rules it out"
        )
    local = _slopes_text(fit)
    return (
        f"{where} had fitted slopes {slopes}, local slopes ({local}): "
        + judged
    )


def time_fit_label(fit, fit_median) -> str:
    """A plot legend's words for the fit of the fastest runs (the series
    plotted): its slope when both fits are reliable; its slope and why no
    exponent is read when only the medians' local slopes disagree; "no
    reliable slope" when its own local slopes disagree."""
    if not fit.reliable:
        return "no reliable slope"
    if not fit_median.reliable:
        return f"slope {fit.slope:.2f}; medians disagree, no exponent read"
    if abs(fit.slope - fit_median.slope) > 0.25:
        return f"slope {fit.slope:.2f}; medians' slope differs, no exponent"
    return f"slope {fit.slope:.2f}"


def compare_timings(timing, baseline, margin: float = 0.05):
    """Compare two :class:`Timing` s of the same run on both their fastest
    runs and their medians.

    Returns ``(fastest, median, verdict)``: the ratios ``timing.low /
    baseline.low`` and ``timing.median / baseline.median``, and "faster" when
    both ratios are below ``1 - margin``, "slower" when both are above ``1 +
    margin``, "same" when both lie within ``margin`` of 1, and None when they
    fall in different bands: the fastest runs and the medians disagree, and
    the run does not decide. (The fastest run is the best estimate of a call's
    cost, but one lucky run on a busy machine can make it; the median is what
    a typical run took.)
    """
    if not 0 <= margin < 1:
        raise ValueError(
            f"compare_timings needs 0 <= margin < 1; got {margin}"
        )
    for label, t in (("timing", timing), ("baseline", baseline)):
        if not (t.low > 0 and t.median > 0):
            raise ValueError(
                f"compare_timings needs positive times; {label} has low "
                f"{t.low} and median {t.median}"
            )
    fastest = timing.low / baseline.low
    median = timing.median / baseline.median

    def band(ratio):
        if ratio < 1 - margin:
            return "faster"
        if ratio > 1 + margin:
            return "slower"
        return "same"

    verdict = band(fastest) if band(fastest) == band(median) else None
    return fastest, median, verdict


def _ratio_text(ratio: float, margin: float) -> str:
    """``ratio`` to two decimals, or to as many more (up to five) as it takes
    not to print a threshold ``1 - margin`` or ``1 + margin`` that the ratio
    is not: 1.047 prints as 1.047, not 1.05, against a threshold of 1.05, so
    that the words "on either side of 1.05" can be checked against the
    numbers."""
    for digits in range(2, 6):
        text = f"{ratio:.{digits}f}"
        if all(
            text != f"{t:.{digits}f}" or ratio == t
            for t in (1 - margin, 1 + margin)
        ):
            return text
    return text


def _disagreement(fastest: float, median: float, margin: float) -> str:
    """Words for two ratios in different bands of :func:`compare_timings`:
    the thresholds that lie between them."""
    low, high = min(fastest, median), max(fastest, median)
    between = []
    if low < 1 - margin <= high:  # one faster, the other not
        between.append(f"{1 - margin:.2f}")
    if low <= 1 + margin < high:  # one slower, the other not
        between.append(f"{1 + margin:.2f}")
    return (
        "the two fall on either side of " + " and ".join(between)
        if between
        else "the two disagree"
    )


# how threads can fail to help (the mechanism, not a measurement)
_WHY_THREADS_MAY_NOT_HELP = (
    " (a second thread gains only while a logical CPU is free for it, and "
    "only during numpy's array operations: the Python work around each call "
    "holds the interpreter lock, one thread at a time)"
)


def threads_verdict(flash, flash_one, workers: int, margin=0.05) -> str:
    """Chapter 9's sentence on what the default worker threads did to the
    tiled version's time: ``flash`` is its :class:`Timing` with ``workers``
    threads, ``flash_one`` with one.

    It says the threads saved time (or made it slower) only when the fastest
    runs and the medians agree on it beyond ``margin``
    (:func:`compare_timings`); when they disagree, that the run does not
    decide.
    """
    if workers == 1:
        return "its default is one thread on this machine"
    fastest, median, verdict = compare_timings(flash, flash_one, margin)
    took = (
        f"with its default {workers} threads it took "
        f"{_ratio_text(fastest, margin)} times its one-thread time in their "
        f"fastest runs and {_ratio_text(median, margin)} times in their "
        "medians"
    )
    low, high = f"{1 - margin:.2f}", f"{1 + margin:.2f}"
    if verdict == "faster":
        return (
            f"{took}, both below {low}, so on this machine the extra threads "
            "saved time"
        )
    if verdict == "slower":
        return (
            f"{took}, both above {high}, so on this machine the extra "
            "threads made it slower" + _WHY_THREADS_MAY_NOT_HELP
        )
    if verdict == "same":
        return (
            f"{took}, both between {low} and {high}, so on this machine the "
            f"extra threads changed its time by less than {margin * 100:.0f} %"
            + _WHY_THREADS_MAY_NOT_HELP
        )
    return (
        f"{took}; {_disagreement(fastest, median, margin)}, so this run does "
        "not decide what the extra threads did to its time"
    )


def one_thread_verdict(
    naive, flash, flash_one, workers: int, margin=0.05
) -> str:
    """Chapter 9's sentence on where the tiled version's gain over naive
    attention came from: ``naive``, ``flash`` (the tiled version with its
    default ``workers`` threads) and ``flash_one`` (with one thread) are
    :class:`Timing` s of the same run.

    Each comparison with naive attention counts only when the fastest runs
    and the medians agree beyond ``margin`` (:func:`compare_timings`);
    otherwise the sentence says that the run does not decide. A one-thread
    gain is not attributed to a measured cause: the sentence names the likely
    one, which this measurement does not isolate.
    """
    if workers == 1:
        return (
            "its default is one thread on this machine, so the two runs "
            "differ only by timing noise"
        )
    d_fast, d_med, default = compare_timings(flash, naive, margin)
    o_fast, o_med, one = compare_timings(flash_one, naive, margin)
    low, high = f"{1 - margin:.2f}", f"{1 + margin:.2f}"
    on_one = (
        f"on one thread it took {_ratio_text(o_fast, margin)} times naive "
        "attention's time in their fastest runs and "
        f"{_ratio_text(o_med, margin)} times in their medians"
    )
    if one == "faster":
        return (
            f"{on_one}, both below {low}, so on this machine it did not need "
            "extra threads to gain time; the likely cause, which this "
            "measurement does not isolate, is how the two use memory (small "
            "tiles reused in cache, against naive attention's half-gigabyte "
            "intermediates allocated afresh and streamed through main memory)"
        )
    if one is None:
        return (
            f"{on_one}; {_disagreement(o_fast, o_med, margin)}, so this run "
            "does not decide how its one-thread time compares with naive "
            "attention's"
        )
    if default is None:
        return (
            f"with its default {workers} threads it took "
            f"{_ratio_text(d_fast, margin)} times naive attention's time in "
            f"their fastest runs and {_ratio_text(d_med, margin)} times in "
            "their medians; "
            f"{_disagreement(d_fast, d_med, margin)}, so "
            "this run does not decide whether it gained time over naive "
            "attention"
        )
    if default == "faster":
        side = (
            f"both between {low} and {high}, about as fast as naive attention"
            if one == "same"
            else f"both above {high}, slower than naive attention"
        )
        return (
            f"{on_one}, {side}, so on this machine what it gained over naive "
            "attention came from its extra threads"
        )
    return (
        f"it was not faster than naive attention by {margin * 100:.0f} % or "
        "more "
        "with either thread count, in its fastest runs or its medians "
        f"({_ratio_text(d_fast, margin)} and {_ratio_text(d_med, margin)} "
        f"times naive attention's with {workers} threads, "
        f"{_ratio_text(o_fast, margin)} and {_ratio_text(o_med, margin)} "
        "with one), so on "
        "this machine and run it gained no time over naive attention"
    )


# what a ratio of the tile-size savings says, by its band (chapter 9)
_SAVING_WORDS = {
    "above": (
        "more than either cost of the model gives: the time per score itself "
        "fell as the tiles grew, or other load disturbed the run"
    ),
    "below": (
        "less than either cost of the model gives: the time per score fell "
        "mostly in the first doubling, or larger tiles paid for something "
        "else (a working set outgrowing a cache), or other load disturbed the "
        "run"
    ),
    "between": (
        "between the two models' 0.25 and 0.5; this is consistent with a mix "
        "of the fixed cost per call and the cost that grows with the side, "
        "but also with the fixed cost per call plus a time per score that "
        "falls as the tiles grow (numpy's reductions and small BLAS products "
        "run faster on larger arrays), so this ratio alone does not say which "
        "cost made up the saving"
    ),
}


def saving_band(ratio: float, margin: float = 0.05) -> str:
    """Where a ratio of the second doubling's saving to the first's lies
    against the two-cost model's 0.25 and 0.5: "below", "between", "above",
    or "margin" within ``margin`` of either bound, where timing noise could
    put it on the other side."""
    if abs(ratio - 0.25) <= margin or abs(ratio - 0.5) <= margin:
        return "margin"
    if 0.25 < ratio < 0.5:
        return "between"
    return "above" if ratio > 0.5 else "below"


def saving_ratios(rounds, sides=(16, 32, 64)) -> list[float | None]:
    """For each round (a dict from the tile's side to its time in that
    round), the time the second doubling of the side saved over the time the
    first saved; None for a round in which the first doubling saved no time
    (there is no ratio to read)."""
    small, middle, large = sides
    ratios = []
    for times in rounds:
        first = times[small] - times[middle]
        second = times[middle] - times[large]
        ratios.append(second / first if first > 0 else None)
    return ratios


def tile_saving_verdict(rounds, sides=(16, 32, 64), margin=0.05) -> str:
    """Chapter 9's sentence on what doubling the tile's side twice saved,
    from every round of a run: ``rounds`` holds, for each round, a dict from
    the tile's side to its time in that round (the sides timed in turn, so
    that a burst of load falls on all of them alike).

    A band of the ratio (:func:`saving_band`) is stated only when every
    round's first doubling saved time and every round's ratio lies in that
    band, outside ``margin`` of the bounds; otherwise the sentence says what
    the rounds showed and that the run does not decide.
    """
    if not rounds:
        raise ValueError("tile_saving_verdict needs at least one round")
    small, middle, _ = sides
    ratios = saving_ratios(rounds, sides)
    n = len(rounds)
    every = "the one round" if n == 1 else f"all {n} rounds"
    no_saving = sum(r is None for r in ratios)
    if no_saving == n:
        return (
            f"in {every} the {middle} x {middle} tiles took no less time "
            f"than the {small} x {small} ones, so in this run the first "
            "doubling saved no time and there is no ratio to read"
        )
    if no_saving:
        return (
            f"in {no_saving} of the {n} rounds the {middle} x {middle} tiles "
            f"took no less time than the {small} x {small} ones, and in the "
            "others they took less, so the rounds disagree on whether the "
            "first doubling saved time at all, and this run does not decide "
            "what the ratio is"
        )
    ratio = "the ratio of the second doubling's saving to the first's"
    span = (
        f"{ratio} was {ratios[0]:.2f}"
        if n == 1
        else f"{ratio} ran from {min(ratios):.2f} to {max(ratios):.2f}"
    )
    over = "in the one round" if n == 1 else f"over the {n} rounds"
    bands = [saving_band(r, margin) for r in ratios]
    if len(set(bands)) == 1 and bands[0] != "margin":
        return f"in {every} {span}: " + _SAVING_WORDS[bands[0]]
    near = bands.count("margin")
    if near:
        return (
            f"{over} {span}, and in {near} of {n} it lies "
            f"within {margin:.2f} of one of the model's bounds, 0.25 and 0.5, "
            "where timing noise could put it on either side, so this run does "
            "not decide what the ratio says"
        )
    return (
        f"{over} {span}, falling in different bands (below "
        "0.25, between 0.25 and 0.5, above 0.5), so this run does not decide "
        "what the ratio says"
    )
