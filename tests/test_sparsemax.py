"""sparsemax against two independent references (bisection on the threshold,
and brute force over every support), by the optimality condition of a
projection, and at the edges (masks, NaN, axes)."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from attnbook.sparsemax import (
    sparsemax,
    sparsemax_jacobian,
    sparsemax_threshold,
)

finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)
matrices = arrays(
    np.float64,
    array_shapes(min_dims=1, max_dims=3, max_side=7),
    elements=finite,
)


def bisection_reference(x):
    """Sparsemax of each row of ``x (..., n)`` by bisection on tau: sum(max(x -
    tau, 0)) = 1 is a decreasing function of tau, 1 or more at tau = max(x) - 1
    and 0 at tau = max(x)."""
    x = np.asarray(x, dtype=np.float64)
    lo = x.max(axis=-1, keepdims=True) - 1
    hi = x.max(axis=-1, keepdims=True)
    for _ in range(200):
        mid = (lo + hi) / 2
        too_low = np.maximum(x - mid, 0).sum(axis=-1, keepdims=True) > 1
        lo, hi = np.where(too_low, mid, lo), np.where(too_low, hi, mid)
    return np.maximum(x - (lo + hi) / 2, 0)


def brute_force_reference(x):
    """Try every support S: tau = (sum x_S - 1) / |S| is right iff x_i > tau
    exactly on S."""
    x = np.asarray(x, dtype=np.float64)
    found = []
    for size in range(1, len(x) + 1):
        for support in itertools.combinations(range(len(x)), size):
            tau = (x[list(support)].sum() - 1) / size
            outside = [i for i in range(len(x)) if i not in support]
            if np.all(x[list(support)] > tau) and np.all(x[outside] <= tau):
                found.append(np.maximum(x - tau, 0))
    assert len(found) == 1, (
        f"the projection is unique, but {len(found)} supports fit {x}"
    )
    return found[0]


@settings(max_examples=200, deadline=None)
@given(matrices)
def test_matches_bisection(x):
    p = sparsemax(x)
    np.testing.assert_allclose(p, bisection_reference(x), atol=1e-9)
    assert np.all(p >= 0)
    np.testing.assert_allclose(p.sum(axis=-1), 1.0, rtol=1e-12)


@pytest.mark.parametrize(
    "x",
    [
        [0.0],
        [1.0, 0.8, 0.5],
        [1.0, 0.8],
        [3.0, 1.0, 0.1],
        [0.2, 0.2, 0.2, -0.5],
        [2.0, 2.0, 1.5, -1.0, 0.0, 1.9],
        [-4.0, -4.2, -3.9, -10.0],
    ],
)
def test_matches_brute_force_over_supports(x):
    np.testing.assert_allclose(
        sparsemax(np.array(x)), brute_force_reference(x), atol=1e-12
    )


@settings(max_examples=100, deadline=None)
@given(arrays(np.float64, st.integers(1, 8), elements=finite))
def test_is_the_euclidean_projection(x):
    """p is the closest point of the simplex to x iff <x - p, q - p> <= 0 for
    every q in the simplex; the left side is linear in q, so checking the
    vertices q = e_j suffices."""
    p = sparsemax(x)
    residual = x - p
    assert np.max(residual) <= residual @ p + 1e-9 * (1 + np.abs(x).max())


@settings(max_examples=100, deadline=None)
@given(matrices, st.floats(-1e3, 1e3))
def test_shift_invariance(x, c):
    np.testing.assert_allclose(sparsemax(x + c), sparsemax(x), atol=1e-8)


def test_not_scale_invariant_and_exact_zeros():
    x = np.array([1.0, 0.8, 0.5, -2.0])
    p = sparsemax(x)
    # exactly zero, not merely small
    assert p[3] == 0.0
    assert np.all(p[:3] > 0)
    np.testing.assert_allclose(p, [17 / 30, 11 / 30, 2 / 30, 0.0], atol=1e-12)
    # doubling drops a key
    np.testing.assert_allclose(
        sparsemax(2 * x), [0.7, 0.3, 0.0, 0.0], atol=1e-12
    )
    # gap >= 1: one-hot
    np.testing.assert_array_equal(
        sparsemax(np.array([5.0, 3.0, 2.5])), [1.0, 0.0, 0.0]
    )


def test_masked_entries_get_zero_and_the_rest_is_the_unmasked_sparsemax(rng):
    x = rng.normal(size=(4, 6))
    mask = rng.random((4, 6)) < 0.5
    # every row keeps a key
    mask[:, 0] = True
    p = sparsemax(np.where(mask, x, -np.inf))
    for row in range(4):
        assert np.all(p[row][~mask[row]] == 0.0)
        np.testing.assert_allclose(
            p[row][mask[row]],
            bisection_reference(x[row][mask[row]]),
            atol=1e-9,
        )


def test_fully_masked_and_empty_rows_give_zeros():
    x = np.array([[0.0, 1.0, -np.inf], [-np.inf, -np.inf, -np.inf]])
    p = sparsemax(x)
    np.testing.assert_array_equal(p[1], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(p[0], [0.0, 1.0, 0.0])
    assert sparsemax(np.zeros((2, 0))).shape == (2, 0)


def test_nan_or_plus_inf_makes_only_its_own_row_nan():
    x = np.array([[0.0, np.nan, 1.0], [0.0, np.inf, 1.0], [0.0, 0.5, 1.0]])
    p = sparsemax(x)
    assert np.all(np.isnan(p[:2]))
    np.testing.assert_allclose(p[2], bisection_reference(x[2]))
    assert np.isnan(sparsemax_threshold(x[:2])).all()


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2, -3])
def test_axis_and_leading_dimensions(axis, rng):
    x = rng.normal(size=(3, 4, 5))
    expected = np.moveaxis(
        bisection_reference(np.moveaxis(x, axis, -1)), -1, axis
    )
    np.testing.assert_allclose(sparsemax(x, axis=axis), expected, atol=1e-9)


@pytest.mark.parametrize(
    "dtype, tol", [(np.float16, 2e-2), (np.float32, 1e-5), (np.float64, 1e-12)]
)
def test_dtype_is_kept(dtype, tol, rng):
    x = rng.normal(size=(5, 7))
    p = sparsemax(x.astype(dtype))
    assert p.dtype == dtype
    np.testing.assert_allclose(
        p.astype(np.float64), bisection_reference(x.astype(dtype)), atol=tol
    )


def test_integer_input_is_promoted():
    p = sparsemax(np.array([2, 2, 1]))
    assert p.dtype == np.float64
    np.testing.assert_array_equal(p, [0.5, 0.5, 0.0])


@pytest.mark.parametrize(
    "x, axis, message",
    [
        (
            np.float64(1.0),
            -1,
            r"x must have at least 1 dimensions \(\.\.\., n\); got shape \(\)",
        ),
        (
            np.zeros((2, 3)),
            2,
            r"axis 2 is out of range for x of shape \(2, 3\)",
        ),
        (
            np.zeros((2, 3)),
            -3,
            r"axis -3 is out of range for x of shape \(2, 3\)",
        ),
        (np.zeros((2, 3)), 1.0, r"axis must be an integer; got 1\.0"),
    ],
)
def test_bad_input_raises_value_error_naming_it(x, axis, message):
    with pytest.raises(ValueError, match=message):
        sparsemax(x, axis=axis)


def test_jacobian_matches_finite_differences_of_the_reference(rng):
    """Away from the kinks (no x_i within h of tau) the reference is linear, so
    central differences are exact up to rounding."""
    for _ in range(20):
        x = rng.normal(size=6)
        tau = sparsemax_threshold(x)[0]
        if np.min(np.abs(x - tau)) < 1e-3:
            continue
        h = 1e-6
        fd = np.stack(
            [
                (
                    bisection_reference(x + h * e)
                    - bisection_reference(x - h * e)
                )
                / (2 * h)
                for e in np.eye(6)
            ],
            axis=1,
        )
        np.testing.assert_allclose(
            sparsemax_jacobian(sparsemax(x)), fd, atol=1e-6
        )


def test_jacobian_batch_shape_and_zero_rows():
    p = sparsemax(np.array([[1.0, 0.8, 0.5, -2.0], [3.0, 0.0, 0.0, 0.0]]))
    J = sparsemax_jacobian(p)
    assert J.shape == (2, 4, 4)
    np.testing.assert_array_equal(J[0, 3], 0.0)
    np.testing.assert_array_equal(J[0, :, 3], 0.0)
    # one-hot: the single-entry support is constant
    np.testing.assert_array_equal(J[1], 0.0)
    np.testing.assert_allclose(J @ np.ones(4), 0.0, atol=1e-15)
    with pytest.raises(ValueError, match=r"p must have at least 1 dimensions"):
        sparsemax_jacobian(np.float64(0.5))


def test_large_equal_scores_are_shifted_before_summing():
    """Without the shift by the maximum, the running sums of seven scores near
    819 carry rounding errors of about 1e-12 into the weights; with it the
    weights are 1/7 to the last bit or two."""
    p = sparsemax(np.full(7, 819.44450006))
    np.testing.assert_allclose(p, 1 / 7, rtol=1e-15)
