"""Receptive fields of stacked windowed layers, the sink window mask, and
attention shares."""

import numpy as np
import pytest
import torch

import attnbook
from attnbook.multihead import MultiHeadAttention
from attnbook.windows import (
    key_share,
    mean_lookback,
    receptive_field,
    recent_share,
    sink_window_mask,
    uniform_share,
)


def reach_by_paths(mask, n_layers):
    """Reachability by following edges one layer at a time (sets, no matrix
    products)."""
    n = len(mask)
    out = np.zeros((n, n), bool)
    for i in range(n):
        frontier = {i}
        for _ in range(n_layers):
            frontier = frontier | {
                j for p in frontier for j in range(n) if mask[p, j]
            }
        out[i, sorted(frontier)] = True
    return out


@pytest.mark.parametrize(
    "n, window, layers",
    [(10, 3, 1), (12, 3, 2), (20, 4, 3), (9, 1, 4), (16, 5, 5), (6, 2, 9)],
)
def test_sliding_window_field_is_w_minus_one_times_layers_plus_one(
    n, window, layers
):
    field = receptive_field(attnbook.sliding_window_mask(n, window), layers)
    for i in range(n):
        lowest = max(0, i - (window - 1) * layers)
        assert list(np.flatnonzero(field[i])) == list(range(lowest, i + 1))


def test_random_masks_agree_with_path_following(rng):
    for _ in range(10):
        mask = rng.random((7, 7)) < 0.25
        for layers in (1, 2, 3):
            np.testing.assert_array_equal(
                receptive_field(mask, layers), reach_by_paths(mask, layers)
            )


def test_field_matches_the_jacobian_of_real_attention_layers():
    """Which outputs of a stack of windowed attention layers (with residuals)
    move when an input moves."""
    torch.manual_seed(0)
    n, window, layers = 11, 3, 3
    mask = torch.from_numpy(attnbook.sliding_window_mask(n, window))
    stack = [MultiHeadAttention(4, 2).double() for _ in range(layers)]

    def net(x):
        for layer in stack:
            x = x + layer(x, mask=mask)
        return x

    x = torch.randn(1, n, 4, dtype=torch.float64)
    # (n, 4, n, 4)
    jac = torch.autograd.functional.jacobian(net, x)[0, :, :, 0, :, :]
    # (n_out, n_in)
    depends = jac.abs().sum(dim=(1, 3)) > 0
    np.testing.assert_array_equal(
        depends.numpy(), receptive_field(mask.numpy(), layers)
    )


def test_sink_window_mask_by_entries():
    n, window, sinks = 9, 3, 2
    mask = sink_window_mask(n, window, sinks)
    for i in range(n):
        expected = {
            j
            for j in range(n)
            if (i - window < j <= i) or (j < sinks and j <= i)
        }
        assert set(np.flatnonzero(mask[i])) == expected
    np.testing.assert_array_equal(
        sink_window_mask(n, window, 0), attnbook.sliding_window_mask(n, window)
    )


def test_key_share_of_uniform_attention_is_the_uniform_share():
    n = 12
    uniform = attnbook.causal_mask(n) / np.arange(1, n + 1)[:, None]
    for first in (0, 3, 11):
        assert key_share(uniform, key=0, first_query=first) == pytest.approx(
            uniform_share(n, first)
        )
    weights = np.stack([uniform, np.eye(n)])
    np.testing.assert_allclose(
        key_share(weights, 0, 1), [uniform_share(n, 1), 0.0]
    )


def _lookback_by_loops(w, first_query):
    """Mean over queries i >= first_query of sum_j w[i, j] (i - j), with plain
    loops."""
    n = len(w)
    return np.mean(
        [
            sum(w[i, j] * (i - j) for j in range(n))
            for i in range(first_query, n)
        ]
    )


def _recent_by_loops(w, last, first_query):
    n = len(w)
    return np.mean(
        [
            sum(w[i, j] for j in range(max(0, i - last + 1), i + 1))
            for i in range(first_query, n)
        ]
    )


def test_lookback_and_recent_share_against_loops(rng):
    n = 10
    scores = np.where(
        attnbook.causal_mask(n), rng.normal(size=(3, n, n)), -np.inf
    )
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    # (3, n, n) causal softmax rows
    weights /= weights.sum(-1, keepdims=True)
    for first in (0, 4, 9):
        expected = [_lookback_by_loops(w, first) for w in weights]
        np.testing.assert_allclose(
            mean_lookback(weights, first_query=first), expected, rtol=1e-12
        )
        for last in (1, 3, n + 2):
            expected = [_recent_by_loops(w, last, first) for w in weights]
            np.testing.assert_allclose(
                recent_share(weights, last, first_query=first),
                expected,
                rtol=1e-12,
            )


def test_lookback_and_recent_share_of_uniform_and_self_attention():
    n, first = 12, 5
    uniform = attnbook.causal_mask(n) / np.arange(1, n + 1)[:, None]
    queries = np.arange(first, n)
    assert mean_lookback(uniform, first) == pytest.approx(np.mean(queries / 2))
    assert recent_share(uniform, 3, first) == pytest.approx(
        np.mean(np.minimum(3, queries + 1) / (queries + 1))
    )
    assert (
        mean_lookback(np.eye(n), first) == 0.0
        and recent_share(np.eye(n), 1, first) == 1.0
    )
    # a key after its query is not one of the recent keys
    assert recent_share(np.eye(n, k=1), 3, 0) == 0.0


@pytest.mark.parametrize(
    "call",
    [
        lambda: mean_lookback(np.ones((3, 4))),
        lambda: mean_lookback(np.ones((4, 4)), first_query=4),
        lambda: recent_share(np.ones((4, 4)), 0),
        lambda: recent_share(np.ones((4, 4)), 2, first_query=-1),
        lambda: receptive_field(np.ones((3, 3)), 1),
        lambda: receptive_field(np.ones((3, 4), bool), 1),
        lambda: receptive_field(np.ones((3, 3), bool), 0),
        lambda: sink_window_mask(5, 2, -1),
        lambda: sink_window_mask(5, 0, 1),
        lambda: key_share(np.ones((3, 4)), 0),
        lambda: key_share(np.ones((4, 4)), 2, 1),
        lambda: uniform_share(4, 4),
    ],
)
def test_bad_input(call):
    with pytest.raises(ValueError):
        call()
