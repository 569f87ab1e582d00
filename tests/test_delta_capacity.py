"""The associative-memory experiment (attnbook.experiments.delta_capacity):
its pairs, writes and reads against closed forms."""

import pytest
import torch

from attnbook.experiments.delta_capacity import (
    least_squares_state,
    random_pairs,
    recall_accuracy,
    recall_error,
    write_pairs,
)


def test_pairs_are_unit_and_orthogonal_keys_are_orthonormal():
    keys, values = random_pairs(6, 8, 5, seed=0, orthogonal=True, batch=2)
    assert keys.shape == (2, 6, 8) and values.shape == (2, 6, 5)
    gram = keys @ keys.transpose(-1, -2)
    torch.testing.assert_close(
        gram,
        torch.eye(6, dtype=gram.dtype).expand(2, 6, 6),
        rtol=0,
        atol=1e-13,
    )
    torch.testing.assert_close(
        values.norm(dim=-1), torch.ones(2, 6, dtype=values.dtype)
    )
    with pytest.raises(ValueError, match="at most d_k=8 keys"):
        random_pairs(9, 8, 5, seed=0, orthogonal=True)


def test_the_additive_state_is_the_sum_of_outer_products():
    keys, values = random_pairs(7, 8, 5, seed=1, batch=3)
    state = write_pairs(keys, values, "linear")
    torch.testing.assert_close(
        state, keys.transpose(-1, -2) @ values, rtol=0, atol=1e-13
    )
    decayed = write_pairs(keys, values, "decay", gate=0.5)
    weights = 0.5 ** torch.arange(6, -1, -1, dtype=torch.float64)
    torch.testing.assert_close(
        decayed,
        keys.transpose(-1, -2) @ (weights[:, None] * values),
        rtol=0,
        atol=1e-13,
    )


def test_orthonormal_keys_recall_exactly_and_random_keys_interfere():
    keys, values = random_pairs(8, 8, 8, seed=2, orthogonal=True)
    assert (
        recall_error(keys, values, write_pairs(keys, values, "linear")) < 1e-25
    )
    assert recall_accuracy(8, 8, 8, "linear", seed=2, orthogonal=True) == 1
    keys, values = random_pairs(8, 8, 8, seed=2)
    assert (
        recall_error(keys, values, write_pairs(keys, values, "linear")) > 0.1
    )


def test_least_squares_state_and_delta_passes():
    keys, values = random_pairs(5, 8, 4, seed=3)
    exact = least_squares_state(keys, values)
    assert recall_error(keys, values, exact) < 1e-25
    # many passes of the delta rule from zero approach the least-norm state
    many = write_pairs(keys, values, "delta", passes=200)
    torch.testing.assert_close(many, exact, rtol=0, atol=1e-8)
    once = write_pairs(keys, values, "delta")
    assert recall_error(keys, values, once) > 1e-3


def test_bad_rule_and_passes():
    keys, values = random_pairs(3, 4, 4, seed=0)
    with pytest.raises(ValueError, match="rule must be one of"):
        write_pairs(keys, values, "mamba")
    with pytest.raises(ValueError, match="passes must be a positive"):
        write_pairs(keys, values, "delta", passes=0)
