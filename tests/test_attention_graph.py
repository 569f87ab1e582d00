"""Attention rollout, reachability through stacked masks, and the graph
drawing."""

import functools

import matplotlib
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

matplotlib.use("Agg")

import attnbook  # noqa: E402
from attnbook.attention_graph import (
    attention_rollout,
    check_row_stochastic,
    draw_attention_graph,  # noqa: E402
    reachable,
)


def random_weights(rng, shape, mask=None):
    scores = rng.normal(scale=2, size=shape)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    return attnbook.softmax(scores)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 9),
    st.integers(0, 2**32 - 1),
    st.sampled_from([0.0, 0.3, 0.5, 1.0]),
)
def test_rollout_is_the_product_of_the_mixed_matrices(
    n_layers, n, seed, residual
):
    a = random_weights(np.random.default_rng(seed), (n_layers, 2, n, n))
    mixed = [(1 - residual) * w + residual * np.eye(n) for w in a]
    for b in range(2):
        expected = functools.reduce(
            lambda acc, m: m @ acc, [m[b] for m in mixed]
        )
        np.testing.assert_allclose(
            attention_rollout(a, residual)[b], expected, rtol=1e-12, atol=1e-14
        )
    cumulative = attention_rollout(a, residual, cumulative=True)
    assert cumulative.shape == (n_layers, 2, n, n)
    np.testing.assert_allclose(cumulative[-1], attention_rollout(a, residual))
    np.testing.assert_allclose(cumulative[0], mixed[0])


def test_rollout_of_causal_weights_is_row_stochastic_and_lower_triangular(rng):
    n = 7
    a = random_weights(rng, (4, n, n), attnbook.causal_mask(n))
    r = attention_rollout(a)
    np.testing.assert_allclose(r.sum(-1), 1.0)
    assert np.all(np.triu(r, 1) == 0)
    # the first token only ever sees itself
    np.testing.assert_allclose(r[0], np.eye(n)[0])


def test_rollout_limits(rng):
    a = random_weights(rng, (3, 5, 5))
    np.testing.assert_allclose(attention_rollout(a, residual=1.0), np.eye(5))
    np.testing.assert_allclose(
        attention_rollout(a, residual=0.0), a[2] @ a[1] @ a[0]
    )


@pytest.mark.parametrize(
    "n, window, layers",
    [(12, 3, 1), (12, 3, 2), (20, 4, 3), (9, 1, 4), (10, 10, 2)],
)
def test_stacked_sliding_windows_reach_layers_times_window_minus_one_back(
    rng, n, window, layers
):
    mask = attnbook.sliding_window_mask(n, window)
    reach = reachable(mask, layers)
    i, j = np.indices((n, n))
    np.testing.assert_array_equal(
        reach, (j <= i) & (i - j <= layers * (window - 1))
    )
    product = attention_rollout(
        random_weights(rng, (layers, n, n), mask), residual=0.0
    )
    np.testing.assert_array_equal(product > 0, reach)


def test_check_row_stochastic_errors():
    with pytest.raises(ValueError, match="square"):
        check_row_stochastic(np.ones((2, 3)) / 3)
    with pytest.raises(ValueError, match="non-negative"):
        check_row_stochastic(np.array([[1.5, -0.5], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="sum to 1"):
        check_row_stochastic(np.ones((2, 2)))
    with pytest.raises(ValueError, match="n_layers"):
        attention_rollout(np.eye(3))
    with pytest.raises(ValueError, match="residual"):
        attention_rollout(np.eye(3)[None], residual=1.5)


def test_reachable_errors():
    with pytest.raises(ValueError, match="boolean"):
        reachable(np.eye(3), 2)
    with pytest.raises(ValueError, match="itself"):
        reachable(np.tril(np.ones((3, 3), bool), -1), 2)
    with pytest.raises(ValueError, match="n_layers"):
        reachable(np.eye(3, dtype=bool), 0)


def test_draw_attention_graph_draws_one_arc_per_edge_above_threshold(rng):
    import matplotlib.pyplot as plt

    a = random_weights(rng, (6, 6), attnbook.causal_mask(6))
    fig, ax = plt.subplots()
    draw_attention_graph(ax, a, labels=list("abcdef"), threshold=0.2)
    edges = sum(
        1 for i in range(6) for j in range(6) if i != j and a[i, j] >= 0.2
    )
    assert len(ax.lines) == edges
    for line in ax.lines:  # causal: every arc lies above the line of tokens
        assert np.all(line.get_ydata() >= -1e-12)
    plt.close(fig)
