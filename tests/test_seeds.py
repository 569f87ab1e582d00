"""attnbook.seeds: distributions over seeds and verdicts that refuse to be
decided by rounding."""

import numpy as np
import pytest

from attnbook.seeds import (
    SeedDistribution,
    TooCloseToCall,
    in_seeds,
    over_seeds,
    paired_difference,
)


def test_over_seeds_calls_each_seed_in_order():
    d = over_seeds(lambda s: s * 0.25, range(5))
    assert d.seeds == (0, 1, 2, 3, 4)
    np.testing.assert_array_equal(d.values, [0.0, 0.25, 0.5, 0.75, 1.0])
    assert (d.min, d.median, d.max, d.n) == (0.0, 0.5, 1.0, 5)
    assert d.summary(".2f") == "min 0.00 / median 0.50 / max 1.00 over 5 seeds"


def test_count_at_least_counts_and_respects_exact_hits():
    d = SeedDistribution((0, 1, 2, 3), np.array([1.0, 0.5, 0.99, 0.2]))
    assert d.count_at_least(0.99) == 2  # 0.99 itself counts
    # exactly at the threshold is not "too close"
    assert d.count_at_least(1.0, margin=0.005) == 1
    assert not d.all_at_least(0.6, margin=0.05)
    assert SeedDistribution((0,), np.array([0.1])).none_at_least(
        0.6, margin=0.05
    )


def test_a_value_near_the_threshold_is_too_close_to_call():
    d = SeedDistribution((0, 1, 2), np.array([1.0, 0.987, 0.3]))
    with pytest.raises(
        TooCloseToCall, match=r"seed\(s\) \[1\].*0\.987.*0\.99"
    ):
        d.count_at_least(0.99, margin=0.005)
    assert d.count_at_least(0.99, margin=0.002) == 1


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="2 seeds but 3 values"):
        SeedDistribution((0, 1), np.zeros(3))
    with pytest.raises(ValueError, match="at least one seed"):
        over_seeds(lambda s: 0.0, [])


def test_paired_difference():
    a = SeedDistribution((0, 1, 2), np.array([0.5, 0.4, 0.9]))
    b = SeedDistribution((0, 1, 2), np.array([0.2, 0.5, 0.1]))
    d = paired_difference(a, b)
    assert d.seeds == (0, 1, 2) and np.allclose(d.values, [0.3, -0.1, 0.8])
    assert d.count_at_least(0.0, margin=0.05) == 2
    with pytest.raises(ValueError, match="share their seeds"):
        paired_difference(a, SeedDistribution((0, 1, 3), b.values))


def test_tallies_take_their_denominator_from_the_runs_they_count():
    # The denominator is the number of seeds the distribution holds, whatever
    # else is in scope: chapter 7 once printed '5/256 seeds' from a variable n
    # rebound to a context length.
    for n_seeds in (1, 3, 5, 8):
        d = over_seeds(lambda s: float(s), range(n_seeds))
        assert d.tally_at_least(1.0, margin=0.5) == f"{n_seeds - 1}/{n_seeds}"
        assert d.tally_below(1.0, margin=0.5) == f"1/{n_seeds}"
    d = SeedDistribution((0, 1, 2, 3), np.array([1.0, 0.5, 0.99, 0.2]))
    assert d.tally_at_least(0.99) == "2/4" and d.tally_below(0.99) == "2/4"
    with pytest.raises(TooCloseToCall):  # the margin still applies
        d.tally_below(0.98, margin=0.02)


def test_in_seeds_words_a_count_of_two_as_a_pair():
    # expert reading ch11-y: "2/2 seeds" reads as more evidence than two
    # samples give; two seeds are "both" or "neither"
    assert in_seeds(2, 2) == "in both seeds"
    assert in_seeds(0, 2) == "in neither seed"
    assert in_seeds(1, 2) == "in 1 of 2 seeds"
    assert in_seeds(1, 1) == "in the one seed"
    assert in_seeds(0, 1) == "in no seed"
    assert in_seeds(5, 5) == "in all 5 seeds"
    assert in_seeds(0, 5) == "in none of the 5 seeds"
    assert in_seeds(3, 5) == "in 3 of 5 seeds"
    assert in_seeds(np.int64(2), 2) == "in both seeds"
    for count, n_seeds in ((3, 2), (-1, 2), (0, 0), (1.0, 2), (True, 2)):
        with pytest.raises(ValueError, match="count|n_seeds"):
            in_seeds(count, n_seeds)


def test_verdicts_in_words_count_like_the_tallies():
    d = SeedDistribution((0, 1), np.array([0.5, 0.7]))
    assert d.in_seeds_at_least(0.4, margin=0.05) == "in both seeds"
    assert d.in_seeds_below(0.4, margin=0.05) == "in neither seed"
    assert d.in_seeds_at_least(0.6, margin=0.05) == "in 1 of 2 seeds"
    with pytest.raises(TooCloseToCall):  # the margin still applies
        d.in_seeds_at_least(0.52, margin=0.05)
    three = SeedDistribution((0, 1, 2), np.array([1.0, 0.5, 0.2]))
    assert three.in_seeds_below(0.6) == "in 2 of 3 seeds"
