"""attnbook.distributed.layouts: every layout partitions the sequence, the
causal work is counted right, and the balance theorems hold.

The brute-force reference counts pairs one by one; the theorems are checked
against their closed forms for every small case and by hypothesis beyond.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnbook.distributed.layouts import (
    LAYOUTS,
    causal_work,
    imbalance,
    layout_positions,
    makespan,
    positions_numpy,
    step_work,
    zigzag_spread,
)

sizes = st.integers(min_value=0, max_value=400)
ranks = st.integers(min_value=1, max_value=12)
layouts = st.sampled_from(LAYOUTS)


def brute_work(held):
    """Pairs (query t, key s) with s <= t, t held: counted one by one."""
    return sum(1 for t in held for s in range(int(t) + 1))


@settings(max_examples=200, deadline=None)
@given(sizes, ranks, layouts)
def test_every_layout_partitions_the_sequence(n, p, layout):
    held = layout_positions(n, p, layout)
    assert len(held) == p
    for part in held:
        assert isinstance(part, torch.Tensor)
        assert part.dtype == torch.int64 and part.ndim == 1
        # increasing: each rank's positions in order
        assert bool((part[1:] > part[:-1]).all())
    everything = torch.cat(held).sort().values
    assert torch.equal(everything, torch.arange(n))


@settings(max_examples=200, deadline=None)
@given(sizes, ranks, layouts)
def test_the_sizes_are_those_of_array_split(n, p, layout):
    sizes = [len(x) for x in positions_numpy(n, p, layout)]
    if layout == "zigzag":
        chunks = [len(c) for c in np.array_split(np.arange(n), 2 * p)]
        expected = [chunks[r] + chunks[2 * p - 1 - r] for r in range(p)]
    else:
        expected = [len(c) for c in np.array_split(np.arange(n), p)]
    assert sizes == expected
    # no rank holds more than one token beyond another
    assert max(sizes) - min(sizes) <= 1


def test_the_layouts_by_hand():
    as_lists = {
        layout: [x.tolist() for x in layout_positions(8, 2, layout)]
        for layout in LAYOUTS
    }
    assert as_lists == {
        "contiguous": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "striped": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "zigzag": [[0, 1, 6, 7], [2, 3, 4, 5]],
    }
    # 10 tokens in 6 chunks of 2, 2, 2, 2, 1, 1
    assert [x.tolist() for x in layout_positions(10, 3, "zigzag")] == [
        [0, 1, 9],
        [2, 3, 8],
        [4, 5, 6, 7],
    ]
    # fewer tokens than ranks: the last ranks hold none
    assert [x.tolist() for x in layout_positions(3, 4, "zigzag")] == [
        [0],
        [1],
        [2],
        [],
    ]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 60), st.integers(1, 6), layouts)
def test_causal_work_counts_the_pairs(n, p, layout):
    held = positions_numpy(n, p, layout)
    assert causal_work(n, p, layout) == [brute_work(h) for h in held]
    assert sum(causal_work(n, p, layout)) == n * (n + 1) // 2


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(1, 6), layouts)
def test_step_work_counts_each_visiting_block(n, p, layout):
    held = positions_numpy(n, p, layout)
    work = step_work(n, p, layout)
    for s in range(p):
        for r in range(p):
            keys = set(held[(r - s) % p].tolist())
            brute = sum(1 for t in held[r] for k in keys if k <= t)
            assert work[s, r] == brute
    assert work.sum(axis=0).tolist() == causal_work(n, p, layout)
    assert makespan(n, p, layout) == int(work.max(axis=1).sum())
    assert makespan(n, p, layout) >= math.ceil(n * (n + 1) / (2 * p))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 200), st.integers(1, 12))
def test_zigzag_balances_exactly_when_2p_divides_n(c, p):
    # rank r: chunks r and 2P-1-r of c tokens; c^2 (2P - 1) + c (c + 1)
    n = 2 * p * c
    work = causal_work(n, p, "zigzag")
    assert work == [c * c * (2 * p - 1) + c * (c + 1)] * p
    # and at every ring step: 2c^2 + c at step 0, 2c^2 at every later one
    steps = step_work(n, p, "zigzag")
    assert steps[0].tolist() == [2 * c * c + c] * p
    assert (steps[1:] == 2 * c * c).all()
    # so the ring's time is the perfect share
    assert makespan(n, p, "zigzag") == n * (n + 1) // (2 * p)


def test_zigzag_spread_is_exact_for_every_small_case():
    for p in range(1, 10):
        for n in range(0, 260):
            work = causal_work(n, p, "zigzag")
            assert max(work) - min(work) == zigzag_spread(n, p), (n, p)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.integers(1, 64))
def test_zigzag_spread_is_exact_and_at_most_2n(n, p):
    work = causal_work(n, p, "zigzag")
    assert max(work) - min(work) == zigzag_spread(n, p) <= 2 * n
    if n:
        # relative to the mean: at most 4P / (n + 1)
        mean = n * (n + 1) / (2 * p)
        assert (max(work) - min(work)) / mean <= 4 * p / (n + 1) + 1e-12


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.integers(1, 16))
def test_contiguous_imbalance_formula(c, p):
    # n = P c: rank r does c^2 r + c (c + 1) / 2; the last over the mean is
    # (2cP - c + 1) / (Pc + 1), which tends to 2 - 1/P
    n = p * c
    work = causal_work(n, p, "contiguous")
    assert work == [c * c * r + c * (c + 1) // 2 for r in range(p)]
    ratio = (2 * c * p - c + 1) / (p * c + 1)
    assert imbalance(work) == pytest.approx(ratio, rel=1e-12)
    assert imbalance(work) <= 2 - 1 / p + 1e-12
    # the ring waits for the last rank at every step
    assert makespan(n, p, "contiguous") == max(work)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.integers(1, 16))
def test_striped_imbalance_formula(c, p):
    # n = P c: rank r does c (r + 1) + P c (c - 1) / 2; spread c (P - 1);
    # the last over the mean is P (c + 1) / (P c + 1), which tends to 1
    n = p * c
    work = causal_work(n, p, "striped")
    assert work == [c * (r + 1) + p * c * (c - 1) // 2 for r in range(p)]
    assert max(work) - min(work) == c * (p - 1)
    ratio = p * (c + 1) / (p * c + 1)
    assert imbalance(work) == pytest.approx(ratio, rel=1e-12)
    # each step: c (c + 1) / 2 pairs for a rank whose keys start no later
    # than its queries, c (c - 1) / 2 otherwise; the last rank is the slowest
    assert makespan(n, p, "striped") == p * c * (c + 1) // 2


@settings(max_examples=200, deadline=None)
@given(sizes, ranks)
def test_striped_spread_bound_for_any_n(n, p):
    work = causal_work(n, p, "striped")
    assert max(work) - min(work) <= math.ceil(n / p) * (p - 1)


def test_one_rank_holds_everything():
    for layout in LAYOUTS:
        assert [x.tolist() for x in layout_positions(5, 1, layout)] == [
            [0, 1, 2, 3, 4]
        ]
        assert causal_work(5, 1, layout) == [15]
        assert step_work(5, 1, layout).tolist() == [[15]]
    assert imbalance([0, 0]) == 1.0
    assert layout_positions(0, 3, "zigzag")[2].shape == (0,)


@pytest.mark.parametrize(
    "args, message",
    [
        ((8, 0, "zigzag"), "world_size must be a positive integer"),
        ((8, -2, "striped"), "world_size must be a positive integer"),
        ((-1, 2, "zigzag"), "n must be a non-negative integer"),
        ((8, 2, "ring"), "'contiguous', 'striped', 'zigzag'"),
        ((8.0, 2, "zigzag"), "n must be a non-negative integer"),
        ((8, True, "zigzag"), "world_size must be a positive integer"),
    ],
)
def test_bad_arguments_raise_clear_errors(args, message):
    for fn in (layout_positions, causal_work, step_work, makespan):
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            fn(*args)
