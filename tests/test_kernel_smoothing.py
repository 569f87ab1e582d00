"""The Nadaraya-Watson estimator against loops, against torch's attention, and
its limits."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnbook
from attnbook.kernel_smoothing import (
    gaussian_kernel_as_attention,
    log_kernel,
    nadaraya_watson,
)


def loop_estimate(x_query, x_train, y_train, h, kernel="gaussian"):
    """The textbook formula, one query and one training point at a time (2-D
    inputs only)."""
    out = np.zeros((len(x_query), y_train.shape[1]))
    for a, x in enumerate(x_query):
        if kernel == "gaussian":
            logs = [-math.fsum((x - xi) ** 2) / (2 * h * h) for xi in x_train]
        else:
            logs = [math.fsum(x * xi) / h for xi in x_train]
        top = max(logs)
        ks = [math.exp(s - top) for s in logs]
        total = math.fsum(ks)
        for kv, yi in zip(ks, y_train):
            out[a] += kv / total * yi
    return out


@st.composite
def problems(draw):
    m, n, d, d_y = (draw(st.integers(1, 9)) for _ in range(4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    h = draw(st.sampled_from([0.05, 0.3, 1.0, 2.5, 40.0]))
    return (
        rng.normal(size=(m, d)),
        rng.normal(size=(n, d)),
        rng.normal(size=(n, d_y)),
        h,
    )


@settings(max_examples=120, deadline=None)
@given(problems(), st.sampled_from(["gaussian", "exp_dot"]))
def test_matches_the_formula_computed_with_loops(problem, kernel):
    x_query, x_train, y_train, h = problem
    est, weights = nadaraya_watson(
        x_query, x_train, y_train, kernel=kernel, bandwidth=h
    )
    np.testing.assert_allclose(
        est,
        loop_estimate(x_query, x_train, y_train, h, kernel),
        rtol=1e-9,
        atol=1e-11,
    )
    assert weights.shape == (len(x_query), len(x_train))
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-12)
    assert (weights >= 0).all()


@settings(max_examples=80, deadline=None)
@given(problems())
def test_gaussian_kernel_is_attention_with_one_extra_feature(problem):
    x_query, x_train, y_train, h = problem
    q, k, scale = gaussian_kernel_as_attention(x_query, x_train, bandwidth=h)
    assert q.shape == (len(x_query), x_query.shape[1] + 1) and k.shape == (
        len(x_train),
        x_train.shape[1] + 1,
    )
    torch_out = F.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, y_train)), scale=scale
    )
    est, _ = nadaraya_watson(x_query, x_train, y_train, bandwidth=h)
    np.testing.assert_allclose(torch_out.numpy(), est, rtol=1e-8, atol=1e-10)


@settings(max_examples=60, deadline=None)
@given(problems())
def test_exp_dot_kernel_with_bandwidth_sqrt_d_is_scaled_dot_product_attention(
    problem,
):
    x_query, x_train, y_train, _ = problem
    d = x_query.shape[1]
    est, weights = nadaraya_watson(
        x_query, x_train, y_train, kernel="exp_dot", bandwidth=math.sqrt(d)
    )
    expected = F.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (x_query, x_train, y_train))
    )
    np.testing.assert_allclose(est, expected.numpy(), rtol=1e-9, atol=1e-11)
    _, attn_weights = attnbook.scaled_dot_product_attention(
        x_query, x_train, y_train
    )
    np.testing.assert_allclose(weights, attn_weights, rtol=1e-9, atol=1e-12)


def test_batched_inputs_broadcast_like_attention(rng):
    x_query, x_train, y_train = (
        rng.normal(size=(2, 1, 4, 3)),
        rng.normal(size=(3, 6, 3)),
        rng.normal(size=(6, 2)),
    )
    est, weights = nadaraya_watson(x_query, x_train, y_train, bandwidth=0.7)
    assert est.shape == (2, 3, 4, 2) and weights.shape == (2, 3, 4, 6)
    for a in range(2):
        for b in range(3):
            np.testing.assert_allclose(
                est[a, b],
                loop_estimate(x_query[a, 0], x_train[b], y_train, 0.7),
                rtol=1e-9,
                atol=1e-12,
            )


def test_log_kernel_values(rng):
    x, xt = rng.normal(size=(3, 2)), rng.normal(size=(4, 2))
    expected = -np.array([[np.sum((a - b) ** 2) for b in xt] for a in x]) / (
        2 * 0.5**2
    )
    np.testing.assert_allclose(
        log_kernel(x, xt, "gaussian", 0.5), expected, rtol=1e-12
    )
    np.testing.assert_allclose(
        log_kernel(x, xt, "exp_dot", 2.0), x @ xt.T / 2.0, rtol=1e-12
    )


def test_bandwidth_limits_nearest_neighbour_and_global_mean(rng):
    x_train = rng.uniform(0, 1, size=(12, 1))
    y_train = rng.normal(size=(12, 1))
    x_query = rng.uniform(0, 1, size=(7, 1))
    tiny, _ = nadaraya_watson(x_query, x_train, y_train, bandwidth=1e-4)
    nearest = np.argmin(np.abs(x_query - x_train.T), axis=1)
    # and no 0/0 NaN
    np.testing.assert_allclose(tiny[:, 0], y_train[nearest, 0], atol=1e-12)
    huge, _ = nadaraya_watson(x_query, x_train, y_train, bandwidth=1e4)
    np.testing.assert_allclose(huge[:, 0], y_train.mean(), atol=1e-6)


def test_estimate_is_a_weighted_average_of_the_responses(rng):
    x_train, y_train = rng.normal(size=(20, 2)), rng.normal(size=(20, 1))
    est, _ = nadaraya_watson(
        rng.normal(size=(50, 2)) * 3, x_train, y_train, bandwidth=0.4
    )
    assert (est >= y_train.min() - 1e-12).all() and (
        est <= y_train.max() + 1e-12
    ).all()


@pytest.mark.parametrize(
    "args, match",
    [
        (
            (np.zeros((3, 2)), np.zeros((4, 3)), np.zeros((4, 1))),
            "same number of features",
        ),
        (
            (np.zeros((3, 2)), np.zeros((4, 2)), np.zeros((5, 1))),
            "one row per training input",
        ),
        (
            (np.zeros(3), np.zeros((4, 1)), np.zeros((4, 1))),
            "x_query must have at least 2",
        ),
        (
            (np.zeros((3, 1)), np.zeros((4, 1)), np.zeros(4)),
            "y_train must have at least 2",
        ),
        (
            (np.zeros((2, 3, 1)), np.zeros((3, 4, 1)), np.zeros((4, 1))),
            "do not broadcast",
        ),
    ],
)
def test_bad_shapes_raise(args, match):
    with pytest.raises(ValueError, match=match):
        nadaraya_watson(*args)


@pytest.mark.parametrize("h", [0, -1.0, float("nan"), float("inf")])
def test_bad_bandwidth_raises(h):
    with pytest.raises(ValueError, match="bandwidth"):
        nadaraya_watson(
            np.zeros((2, 1)), np.zeros((3, 1)), np.zeros((3, 1)), bandwidth=h
        )
    with pytest.raises(ValueError, match="bandwidth"):
        gaussian_kernel_as_attention(
            np.zeros((2, 1)), np.zeros((3, 1)), bandwidth=h
        )


def test_unknown_kernel_raises():
    with pytest.raises(ValueError, match="unknown kernel"):
        log_kernel(np.zeros((2, 1)), np.zeros((3, 1)), kernel="epanechnikov")
