"""The online softmax equals the softmax for every way of cutting a row into
blocks."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnbook.online_softmax import (
    SoftmaxState,
    merge_softmax_states,
    online_softmax,
    online_softmax_state,
    softmax_state,
)


def torch_softmax64(x):
    return torch.softmax(
        torch.as_tensor(np.asarray(x, np.float64)), dim=-1
    ).numpy()


def sum_exp_below_max(x):
    """Per row: the max, and sum_j exp(x_j - max), one row at a time in Python
    floats."""
    rows = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
    ms, ls = [], []
    for row in rows:
        m = max(row)
        ms.append(m)
        ls.append(sum(np.exp(v - m) for v in row))
    return np.array(ms).reshape(np.shape(x)[:-1]), np.array(ls).reshape(
        np.shape(x)[:-1]
    )


rows = st.tuples(
    st.integers(1, 4),
    st.integers(1, 40),
    st.integers(0, 2**32 - 1),
    st.floats(0.1, 50),
)


@settings(max_examples=150, deadline=None)
@given(rows, st.integers(1, 45))
def test_online_softmax_equals_softmax_for_any_block_size(shape, block):
    n_rows, n, seed, spread = shape
    x = np.random.default_rng(seed).normal(scale=spread, size=(n_rows, n))
    np.testing.assert_allclose(
        online_softmax(x, block=block),
        torch_softmax64(x),
        rtol=1e-12,
        atol=1e-15,
    )


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 30), st.integers(0, 2**32 - 1), st.data())
def test_state_of_a_row_is_the_merge_of_the_states_of_its_two_parts(
    n, seed, data
):
    x = np.random.default_rng(seed).normal(scale=5, size=(3, n))
    cut = data.draw(st.integers(0, n))  # cut == 0 or n: one part is empty
    merged = merge_softmax_states(
        softmax_state(x[:, :cut]), softmax_state(x[:, cut:])
    )
    m, l = sum_exp_below_max(x)
    np.testing.assert_allclose(merged.max, m, rtol=0, atol=0)
    np.testing.assert_allclose(merged.sum, l, rtol=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 25), st.integers(0, 2**32 - 1), st.data())
def test_merge_in_any_order_over_any_partition(n, seed, data):
    x = np.random.default_rng(seed).normal(scale=3, size=n)
    cuts = sorted(
        data.draw(st.lists(st.integers(1, n - 1), max_size=4, unique=True))
    )
    parts = [softmax_state(p) for p in np.split(x, cuts)]
    order = data.draw(st.permutations(range(len(parts))))
    state = SoftmaxState(np.float64(-np.inf), np.float64(0.0))
    for i in order:
        state = merge_softmax_states(state, parts[i])
    m, l = sum_exp_below_max(x)
    assert state.max == m
    np.testing.assert_allclose(state.sum, l, rtol=1e-12)


def test_per_element_recurrence_by_hand():
    x = np.array([1.0, 3.0, 2.0])
    m, l = online_softmax_state(x, block=1)
    # m: 1 -> 3 -> 3; l: 1 -> 1 * e^(1-3) + 1 -> (e^-2 + 1) + e^(2-3)
    assert m == 3.0
    np.testing.assert_allclose(l, np.exp(-2) + 1 + np.exp(-1), rtol=1e-15)


def test_huge_scores_do_not_overflow():
    x = np.array([[1000.0, 3000.0, 2999.0, -5000.0]])
    got = online_softmax(x, block=1)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, torch_softmax64(x), rtol=1e-12)


def test_masked_entries_and_fully_masked_rows():
    x = np.array([[-np.inf, -np.inf, 0.5, 2.0, -np.inf], [-np.inf] * 5])
    with np.errstate(invalid="raise"):
        got = online_softmax(x, block=2)
        state = online_softmax_state(x, block=2)
    np.testing.assert_allclose(got[0], torch_softmax64(x[0]), rtol=1e-12)
    np.testing.assert_array_equal(got[1], 0)
    assert state.max[1] == -np.inf and state.sum[1] == 0


def test_empty_state_is_the_identity_and_two_empties_stay_empty():
    s = softmax_state(np.array([0.3, -1.2, 4.0]))
    empty = SoftmaxState(np.float64(-np.inf), np.float64(0.0))
    for merged in (
        merge_softmax_states(empty, s),
        merge_softmax_states(s, empty),
    ):
        assert merged.max == s.max and merged.sum == s.sum
    with np.errstate(invalid="raise"):
        both = merge_softmax_states(empty, empty)
    assert both.max == -np.inf and both.sum == 0


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtypes(dtype):
    x = np.random.default_rng(0).normal(size=(2, 9)).astype(dtype)
    got = online_softmax(x, block=4)
    assert got.dtype == np.result_type(dtype, np.float32)
    tol = 1e-6 if dtype != np.float64 else 1e-13
    np.testing.assert_allclose(got, torch_softmax64(x), rtol=tol, atol=tol)


@pytest.mark.parametrize("block", [0, -3, 2.5, True, None])
def test_bad_block_is_a_value_error(block):
    with pytest.raises(ValueError, match="block"):
        online_softmax(np.zeros(4), block=block)
