"""Results that move with rounding, reported as a distribution over seeds (all
chapters with training runs).

A small training run is a chaotic system: the last bit of one rounding, which
differs between CPUs (AVX-512 or AVX2 kernels, MKL's or OpenBLAS's code paths),
can send it to a different end. One run then proves nothing, and its printed
numbers would not reproduce on a reader's machine. So a chapter runs the
experiment for several seeds, shows the per-seed values as what *this* machine
measured, and states as its checked claim only a verdict that holds with room
to spare:

    accs = over_seeds(lambda seed: train(seed=seed).accuracy, seeds=range(5))
    print(accs)  # per-seed table: varies with the CPU
    print(accs.count_at_least(0.99, margin=0.005))  # the verdict: e.g. 5

``count_at_least`` refuses to count a value that lies within ``margin`` of the
threshold: which side of the line such a value falls on is decided by rounding,
so a verdict built on it is not a result.

Chapters 3, 5, 6, 7, 8 and 12 report their training runs with these tools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from ._validate import int_in_range, positive_int


class TooCloseToCall(ValueError):
    """A seed's value lies within the margin of a verdict's threshold."""


@dataclass(frozen=True)
class SeedDistribution:
    """One measurement over several seeds: ``values[i]`` came from
    ``seeds[i]``."""

    seeds: tuple[int, ...]
    values: np.ndarray  # (n_seeds,) float64

    def __post_init__(self):
        if len(self.seeds) != len(self.values):
            raise ValueError(
                f"{len(self.seeds)} seeds but {len(self.values)} values"
            )
        if len(self.seeds) == 0:
            raise ValueError(
                "a distribution over seeds needs at least one seed"
            )

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def min(self) -> float:
        return float(np.min(self.values))

    @property
    def median(self) -> float:
        return float(np.median(self.values))

    @property
    def max(self) -> float:
        return float(np.max(self.values))

    def count_at_least(self, threshold: float, margin: float = 0.0) -> int:
        """How many seeds reach ``threshold``; raises :class:`TooCloseToCall`
        if any value lies within ``margin`` of it (strictly inside ``(threshold
        - margin, threshold + margin)``, except a value exactly at
        ``threshold``, e.g. an accuracy of 1.0 against 1.0)."""
        near = [
            (s, v)
            for s, v in zip(self.seeds, self.values)
            if v != threshold and abs(v - threshold) < margin
        ]
        if near:
            raise TooCloseToCall(
                f"seed(s) {[s for s, _ in near]} gave "
                f"{[float(v) for _, v in near]}, within {margin} of the "
                f"threshold {threshold}: the verdict would depend on "
                "rounding; choose another threshold"
            )
        return int(np.sum(self.values >= threshold))

    def all_at_least(self, threshold: float, margin: float = 0.0) -> bool:
        return self.count_at_least(threshold, margin) == self.n

    def none_at_least(self, threshold: float, margin: float = 0.0) -> bool:
        return self.count_at_least(threshold, margin) == 0

    def tally_at_least(self, threshold: float, margin: float = 0.0) -> str:
        """``'k/N'``: ``k`` seeds reach ``threshold`` (as
        :meth:`count_at_least`, margin included) out of the ``N`` seeds this
        distribution holds. A verdict printed with it cannot carry a
        denominator other than the number of runs it counts."""
        return f"{self.count_at_least(threshold, margin)}/{self.n}"

    def tally_below(self, threshold: float, margin: float = 0.0) -> str:
        """``'k/N'``: ``k`` seeds stay below ``threshold`` (the complement of
        :meth:`tally_at_least`)."""
        return f"{self.n - self.count_at_least(threshold, margin)}/{self.n}"

    def in_seeds_at_least(self, threshold: float, margin: float = 0.0) -> str:
        """:meth:`tally_at_least` in words, for a verdict's sentence: ``'in
        both seeds'``, ``'in 3 of 5 seeds'`` (:func:`in_seeds`)."""
        return in_seeds(self.count_at_least(threshold, margin), self.n)

    def in_seeds_below(self, threshold: float, margin: float = 0.0) -> str:
        """:meth:`tally_below` in words (:func:`in_seeds`)."""
        return in_seeds(
            self.n - self.count_at_least(threshold, margin), self.n
        )

    def summary(self, fmt: str = ".3f") -> str:
        """``'min 0.270 / median 0.340 / max 0.410 over 5 seeds'``."""
        return (
            f"min {self.min:{fmt}} / median {self.median:{fmt}} / max "
            f"{self.max:{fmt}} over {self.n} seeds"
        )

    def __str__(self) -> str:
        return " ".join(f"{v:.3f}" for v in self.values)


def in_seeds(count: int, n_seeds: int) -> str:
    """How many of ``n_seeds`` seeds a verdict held in, as a sentence says it.

    Two seeds read as a pair, not as a fraction: ``'in both seeds'``, ``'in
    neither seed'``, ``'in 1 of 2 seeds'`` (``'2/2'`` reads as more evidence
    than two samples give). One seed: ``'in the one seed'`` or ``'in no
    seed'``; more: ``'in all 5 seeds'``, ``'in none of the 5 seeds'``, ``'in
    3 of 5 seeds'``. The denominator is always ``n_seeds``, the runs the
    verdict counts.
    """
    n_seeds = positive_int("n_seeds", n_seeds)
    count = int_in_range("count", count, 0, n_seeds)
    if n_seeds == 1:
        return "in the one seed" if count == 1 else "in no seed"
    if n_seeds == 2:
        return {
            0: "in neither seed",
            1: "in 1 of 2 seeds",
            2: "in both seeds",
        }[count]
    if count == n_seeds:
        return f"in all {n_seeds} seeds"
    if count == 0:
        return f"in none of the {n_seeds} seeds"
    return f"in {count} of {n_seeds} seeds"


def over_seeds(
    run: Callable[[int], float], seeds: Iterable[int]
) -> SeedDistribution:
    """Call ``run(seed)`` for each seed and collect the results."""
    seeds = tuple(int(s) for s in seeds)
    return SeedDistribution(
        seeds, np.array([float(run(s)) for s in seeds], dtype=np.float64)
    )


def paired_difference(
    a: SeedDistribution, b: SeedDistribution
) -> SeedDistribution:
    """``a - b`` seed by seed (both measured on the same seeds), e.g. to count
    the seeds where one model recovered more than another:
    ``paired_difference(x, y).count_at_least(0, margin)``."""
    if a.seeds != b.seeds:
        raise ValueError(
            f"the distributions must share their seeds; got {a.seeds} and "
            f"{b.seeds}"
        )
    return SeedDistribution(a.seeds, a.values - b.values)
