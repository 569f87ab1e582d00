"""softmax, logsumexp, log_softmax and the Jacobian against torch (float64) and
by their properties."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

import attnbook
from attnbook.softmax import log_softmax, logsumexp, naive_softmax, softmax

finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False)
matrices = arrays(
    np.float64,
    array_shapes(min_dims=1, max_dims=3, max_side=7),
    elements=finite,
)


@settings(max_examples=200, deadline=None)
@given(matrices)
def test_matches_torch_float64(x):
    expected = torch.softmax(torch.from_numpy(x), dim=-1).numpy()
    np.testing.assert_allclose(
        attnbook.softmax(x), expected, rtol=1e-12, atol=1e-15
    )


@settings(max_examples=100, deadline=None)
@given(matrices, st.floats(-1e3, 1e3))
def test_shift_invariance_and_normalisation(x, c):
    p = attnbook.softmax(x)
    assert np.all(p >= 0)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(
        attnbook.softmax(x + c), p, rtol=1e-9, atol=1e-12
    )


@pytest.mark.parametrize("axis", [0, 1, -1, -2])
def test_axis_matches_torch(axis, rng):
    x = rng.normal(size=(3, 4, 5))
    expected = torch.softmax(torch.from_numpy(x), dim=axis).numpy()
    np.testing.assert_allclose(
        attnbook.softmax(x, axis=axis), expected, rtol=1e-12
    )


def test_fully_masked_row_gives_zeros_not_nan():
    x = np.array([[0.0, 1.0, -np.inf], [-np.inf, -np.inf, -np.inf]])
    p = attnbook.softmax(x)
    np.testing.assert_array_equal(p[1], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(
        p[0],
        torch.softmax(
            torch.tensor([0.0, 1.0, -np.inf], dtype=torch.float64), 0
        ),
    )


@pytest.mark.parametrize(
    "dtype, big",
    [(np.float16, 20.0), (np.float32, 200.0), (np.float64, 1000.0)],
)
def test_no_overflow_where_the_naive_formula_overflows(dtype, big):
    x = np.array([big, big - 1, big - 2], dtype=dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        # the failure the stable version avoids
        assert np.isnan(naive_softmax(x)).any()
    p = attnbook.softmax(x)
    assert p.dtype == dtype
    expected = torch.softmax(
        torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64), 0
    ).numpy()
    np.testing.assert_allclose(
        p.astype(np.float64),
        expected,
        rtol=2e-3 if dtype == np.float16 else 1e-6,
    )


def test_integer_input_is_promoted():
    np.testing.assert_allclose(attnbook.softmax(np.array([0, 0])), [0.5, 0.5])


@settings(max_examples=100, deadline=None)
@given(matrices)
def test_logsumexp_and_log_softmax_match_torch(x):
    t = torch.from_numpy(x)
    np.testing.assert_allclose(
        attnbook.logsumexp(x),
        torch.logsumexp(t, -1).numpy(),
        rtol=1e-12,
        atol=1e-12,
    )
    np.testing.assert_allclose(
        attnbook.log_softmax(x),
        torch.log_softmax(t, -1).numpy(),
        rtol=1e-9,
        atol=1e-9,
    )


@pytest.mark.parametrize(
    "dtype, big, atol", [(np.float32, 1e4, 1e-6), (np.float64, 1e10, 1e-14)]
)
def test_log_softmax_subtracts_the_maximum_before_the_log_sum(
    dtype, big, atol
):
    """(x - m) - log(sum exp(x - m)), not x - (m + log(sum)): rounding m +
    log(sum) first puts an error of half an ulp of m into every entry (3.8e-4
    in float32 at 1e4, 1.6e-7 in float64 at 1e10; torch's order avoids it)."""
    x = np.array([big, big - 1, big - 2], dtype=dtype)
    # the differences from the maximum are exact, so the exact answer is
    # log_softmax([0, -1, -2]), here in float64
    d = np.array([0.0, -1.0, -2.0])
    expected = d - np.log(np.sum(np.exp(d)))
    got = attnbook.log_softmax(x)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), expected, atol=atol)


def test_log_softmax_of_a_masked_row_and_of_a_plus_inf_row():
    x = np.array([[-np.inf, -np.inf, -np.inf], [np.inf, 0.0, -np.inf]])
    with np.errstate(invalid="ignore"):
        out = attnbook.log_softmax(x)
    # no distribution: NaN, as in torch
    assert np.isnan(out[0]).all()
    np.testing.assert_array_equal(out[1], [np.nan, -np.inf, -np.inf])


def test_logsumexp_keepdims_and_masked_row():
    x = np.array([[1.0, 2.0], [-np.inf, -np.inf]])
    out = attnbook.logsumexp(x, keepdims=True)
    assert out.shape == (2, 1)
    assert out[1, 0] == -np.inf
    np.testing.assert_allclose(out[0, 0], np.log(np.e + np.e**2))


def test_jacobian_matches_autograd(rng):
    x = rng.normal(size=(2, 5))
    jac = attnbook.softmax_jacobian(attnbook.softmax(x))
    for b in range(2):
        expected = torch.autograd.functional.jacobian(
            lambda t: torch.softmax(t, -1), torch.from_numpy(x[b])
        )
        np.testing.assert_allclose(
            jac[b], expected.numpy(), rtol=1e-10, atol=1e-14
        )


def test_jacobian_rows_sum_to_zero(rng):
    jac = attnbook.softmax_jacobian(attnbook.softmax(rng.normal(size=6)))
    # shift invariance: J 1 = 0
    np.testing.assert_allclose(jac.sum(axis=0), 0, atol=1e-15)
    np.testing.assert_allclose(jac, jac.T)


def test_a_long_float16_row_is_summed_in_float32():
    """Reader ch04-bb: 70000 equal float16 scores summed in float16 overflow
    to inf (65504 is float16's largest number), and the weights came out as
    zeros, the log-sum-exp as inf."""
    x = np.zeros(70_000, dtype=np.float16)
    p = softmax(x)
    assert p.dtype == np.float16
    # 1/70000 is a float16 subnormal, spaced 6e-8: 0.5% apart
    np.testing.assert_allclose(p.astype(np.float64), 1 / 70_000, rtol=5e-3)
    assert logsumexp(x).dtype == np.float16
    np.testing.assert_allclose(float(logsumexp(x)), np.log(70_000), rtol=1e-3)
    np.testing.assert_allclose(
        log_softmax(x).astype(np.float64), -np.log(70_000), rtol=1e-3
    )


def test_a_float16_row_is_rounded_once():
    """Reader ch04-cc: the shift and the exponentials ran in float16 before
    the float32 sum, so a weight carried several roundings (up to 5.6 times
    float16's unit roundoff); computed in float32 and rounded once, each
    weight is the correctly rounded float32 softmax."""
    x = np.random.default_rng(0).normal(size=(2000, 8)).astype(np.float16)
    once = softmax(x.astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(softmax(x), once)
    np.testing.assert_array_equal(
        log_softmax(x), log_softmax(x.astype(np.float32)).astype(np.float16)
    )
