"""How the time of softmax and linear attention grows with the sequence length,
on this CPU.

Chapter 17 (perspectives) runs :func:`time_against_softmax`, fits its exponents
with :func:`attnbook.bench.fit_power_law` and plots it.
"""

from __future__ import annotations

import math

import numpy as np

from .. import _validate
from ..attention import scaled_dot_product_attention
from ..bench import time_call
from ..linear_attention import linear_attention


def time_against_softmax(
    lengths,
    d: int = 64,
    softmax_max_n: int = 4096,
    repeats: int = 5,
    seed: int = 0,
    sweeps: int = 3,
) -> dict[str, list[float]]:
    """Seconds per call of softmax attention and of linear attention, for one
    head in float32.

    For each ``n`` in ``lengths``: q, k, v of shape (n, d) drawn from N(0, 1).
    The three methods, ``scaled_dot_product_attention`` (only for ``n <=
    softmax_max_n``: it forms the n x n weights), :func:`linear_attention` and
    its causal form, are timed in ``sweeps`` interleaved sweeps over all
    lengths and methods, ``repeats`` repeats each time; each entry is the
    fastest of all its ``sweeps * repeats`` repeats (other programs can only
    add time, and a burst of load spoils the repeats of one sweep, not of all).
    Call it inside :func:`attnbook.bench.one_blas_thread` to give every method
    the same single core. Returns ``{"softmax": [...], "linear": [...],
    "linear, causal": [...]}`` in the order of ``lengths``.
    """
    d = _validate.positive_int("d", d)
    sweeps = _validate.positive_int("sweeps", sweeps)
    lengths = [_validate.positive_int("n", n) for n in lengths]
    rng = np.random.default_rng(seed)
    inputs = [
        tuple(rng.standard_normal((n, d), dtype=np.float32) for _ in range(3))
        for n in lengths
    ]
    methods = {
        "softmax": lambda q, k, v: scaled_dot_product_attention(q, k, v),
        "linear": lambda q, k, v: linear_attention(q, k, v),
        "linear, causal": lambda q, k, v: linear_attention(
            q, k, v, causal=True
        ),
    }
    best = {name: [math.inf] * len(lengths) for name in methods}
    for _ in range(sweeps):
        for i, n in enumerate(lengths):
            for name, method in methods.items():
                if name == "softmax" and n > softmax_max_n:
                    continue
                timing = time_call(
                    method, *inputs[i], repeats=repeats, min_time=0.01
                )
                best[name][i] = min(best[name][i], timing.low)
    return {name: [t for t in ts if t < math.inf] for name, ts in best.items()}


def steps_and_bumps(
    per_token, jump: float = 1.5, bump: float = 1.2
) -> list[tuple[str, int]]:
    """The steps, the isolated bumps and the dips of a row of per-token times,
    in order of length: ``("step", i)``, ``("bump", i)`` or ``("dip", i)``
    for indices ``0 < i < len(per_token) - 1``.

    The reference of ``i`` is the last earlier time that is neither a bump nor
    a dip. A *step* at ``i`` is a time more than ``jump`` times its reference
    that stays up: every later time is also more than ``jump`` times that
    reference. A *bump* is a time, not a step, more than ``bump`` times the
    previous time and the next one (and, when the next time is a dip, also
    above the time after that: other programs only add time, so a high time
    before a low one is taken for the disturbed one). A *dip* is a time, not a
    step, that the previous time (its reference, when the previous time is a
    bump) and the next one both exceed more than ``bump`` times. Smaller
    differences, at the level of the noise between runs, are neither: without
    that minimum size a label would appear and vanish from run to run. Bumps
    and dips are disturbed timings (a dip may also be the lowest point of times
    that first fall, then rise): they are left out of the references of later
    times, so that an earlier bump does not hide a step and an earlier dip does
    not fake one; and a time is not a step if any later time falls back to
    ``jump`` times its reference or below, so that a disturbed timing followed
    by the old level is a bump, not a step. A step may still be above both
    neighbours: a time that jumps, then falls back to a level still more than
    ``jump`` times the reference.
    """
    times = [float(t) for t in per_token]
    if any(not math.isfinite(t) or t <= 0 for t in times):
        raise ValueError(
            f"per-token times must be positive and finite, got {times}"
        )
    jump, bump = float(jump), float(bump)
    if not jump > 1:
        raise ValueError(f"jump must be greater than 1, got {jump}")
    if not bump >= 1:
        raise ValueError(f"bump must be at least 1, got {bump}")
    found, disturbed = [], set()
    for i in range(1, len(times) - 1):
        reference = next(
            times[j] for j in range(i - 1, -1, -1) if j not in disturbed
        )
        # a bump just before is left out of a dip's neighbours
        before = reference if ("bump", i - 1) in found else times[i - 1]
        after = times[i + 1]
        if i + 2 < len(times) and bump * after < min(times[i], times[i + 2]):
            # the next time is a dip: compare with the one after it
            after = times[i + 2]
        if times[i] > jump * reference and min(times[i + 1 :]) > (
            jump * reference
        ):
            found.append(("step", i))
        elif times[i] > bump * max(times[i - 1], times[i + 1]) and (
            times[i] > after
        ):
            found.append(("bump", i))
            disturbed.add(i)
        elif bump * times[i] < min(before, times[i + 1]):
            found.append(("dip", i))
            disturbed.add(i)
    return found
