"""Rank collapse: the residual from rank one, Dobrushin's coefficient, and
stacks of attention layers."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnbook
from attnbook.experiments.rank_collapse import (
    attention_stack,
    ergodicity_coefficient,
    random_attention_layers,
    rank_one_residual,
    token_diameter,
)


def test_rank_one_residual_against_the_centring_projection(rng):
    x = rng.normal(size=(3, 7, 5))
    n = x.shape[-2]
    centre = np.eye(n) - np.ones((n, n)) / n
    for b in range(3):
        expected = np.linalg.norm(centre @ x[b]) / np.linalg.norm(x[b])
        np.testing.assert_allclose(
            rank_one_residual(x)[b], expected, rtol=1e-12
        )
    np.testing.assert_allclose(
        rank_one_residual(10 * x), rank_one_residual(x), rtol=1e-12
    )
    same_rows = np.tile(rng.normal(size=(1, 5)), (6, 1))
    assert rank_one_residual(same_rows) < 1e-15
    assert rank_one_residual(np.zeros((3, 2))) == 0.0


def test_token_diameter_against_loops(rng):
    x = rng.normal(size=(6, 3))
    expected = max(np.linalg.norm(a - b) for a in x for b in x)
    np.testing.assert_allclose(token_diameter(x), expected, rtol=1e-12)


def test_ergodicity_coefficient_extremes(rng):
    assert ergodicity_coefficient(np.full((5, 5), 0.2)) < 1e-15
    np.testing.assert_allclose(ergodicity_coefficient(np.eye(4)), 1.0)
    a = attnbook.softmax(rng.normal(size=(2, 6, 6)))
    tau = ergodicity_coefficient(a)
    assert tau.shape == (2,) and np.all((0 <= tau) & (tau <= 1))
    brute = max(
        0.5 * np.abs(a[0, i] - a[0, j]).sum()
        for i in range(6)
        for j in range(6)
    )
    np.testing.assert_allclose(tau[0], brute, rtol=1e-12)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(2, 12),
    st.integers(1, 6),
    st.integers(0, 2**32 - 1),
    st.sampled_from([0.1, 1.0, 5.0]),
)
def test_one_averaging_step_shrinks_the_diameter_by_tau(
    n, d, seed, temperature
):
    rng = np.random.default_rng(seed)
    a = attnbook.softmax(rng.normal(scale=temperature, size=(n, n)))
    x = rng.normal(size=(n, d))
    assert (
        token_diameter(a @ x)
        <= ergodicity_coefficient(a) * token_diameter(x) + 1e-12
    )


def test_attention_stack_matches_a_torch_loop(rng):
    x = rng.normal(size=(2, 9, 8))
    layers = random_attention_layers(3, 8, seed=5)
    for skip in (False, True):
        states = attention_stack(x, layers, skip=skip)
        assert states.shape == (4, 2, 9, 8)
        t = torch.from_numpy(x)
        for l, (w_q, w_k, w_v) in enumerate(layers):
            w_q, w_k, w_v = (torch.from_numpy(w) for w in (w_q, w_k, w_v))
            y = torch.nn.functional.scaled_dot_product_attention(
                t @ w_q, t @ w_k, t @ w_v
            )
            t = t + y if skip else y
            np.testing.assert_allclose(
                states[l + 1], t.numpy(), rtol=1e-10, atol=1e-12
            )


def test_uniform_attention_collapses_in_one_layer(rng):
    x = rng.normal(size=(10, 6))
    layers = random_attention_layers(1, 6, seed=0, qk_std=0.0)
    states = attention_stack(x, layers, skip=False)
    assert rank_one_residual(states[1]) < 1e-14


def test_without_skip_the_tokens_collapse_and_with_skip_they_do_not(rng):
    x = rng.normal(size=(16, 32))
    layers = random_attention_layers(6, 32, seed=1, v_std=0.5)
    assert rank_one_residual(attention_stack(x, layers, skip=False)[-1]) < 1e-8
    assert rank_one_residual(attention_stack(x, layers, skip=True)[-1]) > 0.3


def test_bad_input_raises():
    with pytest.raises(ValueError, match="x must have at least 2"):
        rank_one_residual(np.ones(3))
    with pytest.raises(ValueError, match="layer 0"):
        attention_stack(
            np.ones((4, 3)), [(np.eye(3), np.eye(3), np.eye(4))], skip=True
        )
    with pytest.raises(ValueError, match="sum to 1"):
        ergodicity_coefficient(np.ones((3, 3)))
    with pytest.raises(ValueError, match="n_layers"):
        random_attention_layers(0, 3)
