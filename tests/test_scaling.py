"""attnbook.scaling: the statistics of q . k and softmax saturation (chapter
3).

Monte Carlo checks use tolerances of several standard errors computed from the
sample size, so that they fail when the estimate is wrong, not when the seed is
unlucky.
"""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import attnbook
from attnbook import scaling


# --- sample_components and sample_dot_products -------------------------------


@pytest.mark.parametrize("dist", scaling.DISTRIBUTIONS)
@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
def test_components_have_mean_zero_and_the_requested_std(dist, sigma):
    m = 200_000
    x = scaling.sample_components(np.random.default_rng(0), (m,), dist, sigma)
    assert abs(x.mean()) < 5 * sigma / np.sqrt(m)
    assert abs(x.var() / sigma**2 - 1) < 5 * np.sqrt(2 / m)


def test_component_supports():
    rng = np.random.default_rng(1)
    assert set(
        np.unique(scaling.sample_components(rng, (1000,), "sign", 2.0))
    ) == {-2.0, 2.0}
    u = scaling.sample_components(rng, (1000,), "uniform", 1.0)
    assert np.all(np.abs(u) <= np.sqrt(3))
    with pytest.raises(ValueError, match="dist must be one of"):
        scaling.sample_components(rng, (3,), "cauchy")


@pytest.mark.parametrize("dist", scaling.DISTRIBUTIONS)
@pytest.mark.parametrize("d_k", [1, 7, 64])
def test_dot_products_have_mean_zero_and_variance_d_k(dist, d_k):
    m = 100_000
    s = scaling.sample_dot_products(d_k, m, np.random.default_rng(d_k), dist)
    assert s.shape == (m,)
    assert abs(s.mean()) < 5 * np.sqrt(d_k / m)
    # Var of (q.k)^2 is at most (2 + 6/d_k) d_k^2 for these three distributions
    # (Gaussian is the worst)
    assert abs(s.var() / d_k - 1) < 5 * np.sqrt(8 / m)


def test_dot_product_variance_scales_with_both_sigmas():
    m, d_k = 100_000, 16
    s = scaling.sample_dot_products(
        d_k, m, np.random.default_rng(2), sigma_q=2.0, sigma_k=0.5
    )
    assert abs(s.var() / (4.0 * 0.25 * d_k) - 1) < 5 * np.sqrt(8 / m)
    s = scaling.sample_dot_products(
        d_k, m, np.random.default_rng(3), sigma_q=3.0, sigma_k=1.0
    )
    assert abs(s.var() / (9.0 * d_k) - 1) < 5 * np.sqrt(8 / m)


def test_sign_components_give_exactly_d_k_by_enumeration():
    # An exact check of the theorem for a non-Gaussian law: all 2^(2 d) sign
    # vectors, d = 3.
    d = 3
    signs = np.array(list(itertools.product([-1.0, 1.0], repeat=2 * d)))
    dots = np.sum(signs[:, :d] * signs[:, d:], axis=1)
    assert dots.mean() == 0.0
    assert np.mean(dots**2) == d


def test_chunking_keeps_the_distribution_and_the_shape():
    # chunk < d_k
    s = scaling.sample_dot_products(
        300, 5_001, np.random.default_rng(4), chunk=100
    )
    assert s.shape == (5_001,) and np.all(np.isfinite(s))
    assert abs(s.var() / 300 - 1) < 5 * np.sqrt(8 / 5_001)


def test_dot_products_with_a_covariance_match_numpy_multivariate_normal():
    rng = np.random.default_rng(5)
    a = rng.normal(size=(6, 6))
    cov = a @ a.T / 6
    m = 100_000
    ours = scaling.sample_dot_products(6, m, np.random.default_rng(6), cov=cov)
    # an independent sampler: numpy's own multivariate normal
    ref_rng = np.random.default_rng(7)
    q = ref_rng.multivariate_normal(np.zeros(6), cov, size=m)
    k = ref_rng.multivariate_normal(np.zeros(6), cov, size=m)
    ref = np.sum(q * k, axis=1)
    expected = np.trace(cov @ cov)
    for s in (ours, ref):
        assert abs(s.var() / expected - 1) < 0.05


def test_singular_covariance_is_accepted():
    s = scaling.sample_dot_products(
        5, 20_000, np.random.default_rng(8), cov=np.ones((5, 5))
    )
    # rho = 1: q = a 1, k = b 1 with a, b ~ N(0, 1), so q . k = 5 a b and the
    # variance is 25
    assert abs(s.var() / 25 - 1) < 5 * np.sqrt(8 / 20_000)


def test_sample_dot_products_rejects_bad_input():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="d_k must be a positive integer"):
        scaling.sample_dot_products(0, 10, rng)
    with pytest.raises(ValueError, match="n_samples"):
        scaling.sample_dot_products(4, 2.5, rng)
    with pytest.raises(
        ValueError,
        match=r"cov must have shape \(d_k, d_k\) = \(4, 4\); got \(3, 3\)",
    ):
        scaling.sample_dot_products(4, 10, rng, cov=np.eye(3))


# --- dot_product_variance and equicorrelated_cov -----------------------------


def _double_sum(cq, ck):
    """E[(q.k)^2] = sum_ij E[q_i q_j] E[k_i k_j], written as the loops of the
    derivation."""
    d = cq.shape[0]
    return sum(cq[i, j] * ck[i, j] for i in range(d) for j in range(d))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8), st.integers(0, 2**32 - 1))
def test_variance_formula_matches_the_double_sum(d, seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(d, d + 1)), rng.normal(size=(d, 2))
    cq, ck = a @ a.T, b @ b.T
    np.testing.assert_allclose(
        scaling.dot_product_variance(cq, ck), _double_sum(cq, ck), rtol=1e-12
    )


@pytest.mark.parametrize("d", [1, 4, 100])
def test_isotropic_variance_is_sigma_q2_sigma_k2_d(d):
    assert scaling.dot_product_variance(np.eye(d), np.eye(d)) == pytest.approx(
        d
    )
    assert scaling.dot_product_variance(
        4 * np.eye(d), 0.09 * np.eye(d)
    ) == pytest.approx(0.36 * d)


@pytest.mark.parametrize(
    "d, rho", [(2, 0.5), (16, 0.1), (64, -0.01), (10, 1.0)]
)
def test_equicorrelated_variance_closed_form(d, rho):
    cov = scaling.equicorrelated_cov(d, rho)
    assert np.allclose(np.diag(cov), 1.0)
    assert np.allclose(cov[~np.eye(d, dtype=bool)], rho)
    assert np.linalg.eigvalsh(cov).min() > -1e-12
    # trace(C^2) = d (1 - rho^2) + rho^2 d^2, derived by hand from C = (1 -
    # rho) I + rho 1 1^T
    assert scaling.dot_product_variance(cov, cov) == pytest.approx(
        d * (1 - rho**2) + rho**2 * d**2
    )


def test_equicorrelated_rejects_impossible_correlations():
    with pytest.raises(ValueError, match=r"rho must lie in \[-0.25, 1\]"):
        scaling.equicorrelated_cov(5, -0.5)
    with pytest.raises(ValueError, match="rho must lie"):
        scaling.equicorrelated_cov(3, 1.5)
    # any rho: there are no pairs
    assert scaling.equicorrelated_cov(1, -3.0).shape == (1, 1)


def test_dot_product_variance_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"got \(3, 3\) and \(4, 4\)"):
        scaling.dot_product_variance(np.eye(3), np.eye(4))
    with pytest.raises(ValueError, match="square"):
        scaling.dot_product_variance(np.ones((2, 3)), np.ones((2, 3)))


# --- softmax_entropy and softmax_jacobian_norm -------------------------------


def _random_probabilities(rng, shape, spread=3.0):
    return attnbook.softmax(rng.normal(scale=spread, size=shape))


@pytest.mark.parametrize("shape", [(1,), (5,), (3, 7), (2, 3, 4)])
def test_entropy_matches_torch_categorical(shape, rng):
    p = _random_probabilities(rng, shape)
    expected = (
        torch.distributions.Categorical(probs=torch.from_numpy(p))
        .entropy()
        .numpy()
    )
    np.testing.assert_allclose(
        scaling.softmax_entropy(p), expected, rtol=1e-10, atol=1e-14
    )


@settings(max_examples=100, deadline=None)
@given(arrays(np.float64, st.integers(1, 12), elements=st.floats(-50, 50)))
def test_entropy_lies_between_zero_and_log_n(x):
    h = scaling.softmax_entropy(attnbook.softmax(x))
    assert -1e-12 <= h <= np.log(x.size) + 1e-12


def test_entropy_extremes():
    n = 8
    assert scaling.softmax_entropy(np.full(n, 1 / n)) == pytest.approx(
        np.log(n)
    )
    assert scaling.softmax_entropy(np.eye(n)).tolist() == [0.0] * n
    # integers are promoted
    assert scaling.softmax_entropy(np.array([0, 1, 0])) == 0.0
    # fully masked rows
    assert scaling.softmax_entropy(np.zeros((2, 3))).tolist() == [0.0, 0.0]
    np.testing.assert_allclose(
        scaling.softmax_entropy(np.full((4, 2), 0.5), axis=-1), np.log(2)
    )
    np.testing.assert_allclose(
        scaling.softmax_entropy(np.full((2, 4), 0.5), axis=0), np.log(2)
    )


def test_entropy_in_float32_and_float16():
    p = _random_probabilities(np.random.default_rng(9), (4, 6))
    ref = scaling.softmax_entropy(p)
    np.testing.assert_allclose(
        scaling.softmax_entropy(p.astype(np.float32)), ref, rtol=1e-5
    )
    np.testing.assert_allclose(
        scaling.softmax_entropy(p.astype(np.float16)),
        ref,
        rtol=5e-3,
        atol=5e-3,
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.array([0.5, 0.6]), "sum to 1"),
        (np.array([1.5, -0.5]), ">= 0"),
        (np.array([np.nan, 1.0]), "finite"),
        (np.float64(1.0), "at least one dimension"),
    ],
)
def test_entropy_rejects_non_probabilities(bad, message):
    with pytest.raises(ValueError, match=message):
        scaling.softmax_entropy(bad)


def _torch_jacobians(x):
    """Jacobians of softmax at the score rows x (n_rows, n), by autograd."""
    return torch.stack(
        [
            torch.autograd.functional.jacobian(
                lambda r: torch.softmax(r, 0), row
            )
            for row in torch.from_numpy(x)
        ]
    )


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_jacobian_norms_match_autograd(n, rng):
    x = rng.normal(scale=2.0, size=(6, n))
    jac = _torch_jacobians(x)
    p = attnbook.softmax(x)
    np.testing.assert_allclose(
        scaling.softmax_jacobian_norm(p, "fro"),
        torch.linalg.matrix_norm(jac, "fro").numpy(),
        rtol=1e-10,
        atol=1e-14,
    )
    np.testing.assert_allclose(
        scaling.softmax_jacobian_norm(p, 2),
        torch.linalg.matrix_norm(jac, 2).numpy(),
        rtol=1e-8,
        atol=1e-14,
    )


def test_jacobian_norm_closed_forms():
    n = 10
    uniform = np.full(n, 1 / n)
    # J = (I - 1 1^T / n) / n: a projection divided by n
    assert scaling.softmax_jacobian_norm(uniform, "fro") == pytest.approx(
        np.sqrt(n - 1) / n
    )
    assert scaling.softmax_jacobian_norm(uniform, 2) == pytest.approx(1 / n)
    assert scaling.softmax_jacobian_norm(
        np.array([0.5, 0.5]), 2
    ) == pytest.approx(0.5)
    np.testing.assert_array_equal(
        scaling.softmax_jacobian_norm(np.eye(4), "fro"), 0.0
    )
    with pytest.raises(ValueError, match="ord must be 'fro' or 2"):
        scaling.softmax_jacobian_norm(uniform, 1)


# --- random_attention_weights and saturation_stats ---------------------------


def test_random_weights_are_softmax_rows_and_default_to_the_sqrt_scale():
    w = scaling.random_attention_weights(32, 5, 7, np.random.default_rng(10))
    assert w.shape == (7, 5)
    np.testing.assert_allclose(w.sum(-1), 1.0)
    w_explicit = scaling.random_attention_weights(
        32, 5, 7, np.random.default_rng(10), scale=1 / np.sqrt(32)
    )
    np.testing.assert_allclose(w, w_explicit, rtol=1e-12)
    # the same q, k drawn directly: an independent recomputation with torch
    rng = np.random.default_rng(10)
    q, k = (
        torch.from_numpy(rng.normal(size=(7, 32))),
        torch.from_numpy(rng.normal(size=(5, 32))),
    )
    np.testing.assert_allclose(
        w, torch.softmax(q @ k.T / 32**0.5, -1).numpy(), rtol=1e-10
    )
    with pytest.raises(ValueError, match="n_keys"):
        scaling.random_attention_weights(4, 0, 3, rng)


def test_without_the_scale_entropy_falls_with_d_k_and_with_it_stays_put():
    n, rows = 16, 2000
    scaled, unscaled = [], []
    for d_k in (4, 64, 1024):
        rng = np.random.default_rng(d_k)
        scaled.append(
            scaling.saturation_stats(
                scaling.random_attention_weights(d_k, n, rows, rng)
            )
        )
        unscaled.append(
            scaling.saturation_stats(
                scaling.random_attention_weights(d_k, n, rows, rng, scale=1.0)
            )
        )
    h_scaled = [s["entropy"] for s in scaled]
    h_unscaled = [s["entropy"] for s in unscaled]
    assert max(h_scaled) - min(h_scaled) < 0.05 and max(h_scaled) < np.log(n)
    assert (
        h_unscaled[0] > h_unscaled[1] > h_unscaled[2] and h_unscaled[2] < 0.2
    )
    j_unscaled = [s["jacobian_fro"] for s in unscaled]
    assert j_unscaled[0] > j_unscaled[1] > j_unscaled[2]
    assert all(0 < s["max_weight"] <= 1 for s in scaled + unscaled)


@pytest.mark.parametrize("dist", scaling.DISTRIBUTIONS)
@pytest.mark.parametrize("d_k, rho", [(8, 0.3), (64, 0.05), (5, 1.0)])
def test_shared_factor_correlation_gives_the_equicorrelated_variance(
    dist, d_k, rho
):
    m = 100_000
    s = scaling.sample_dot_products(
        d_k, m, np.random.default_rng(d_k), dist, rho=rho
    )
    expected = scaling.dot_product_variance(
        scaling.equicorrelated_cov(d_k, rho),
        scaling.equicorrelated_cov(d_k, rho),
    )
    # the fourth moment of a sum dominated by a shared factor is larger: allow
    # 10 standard errors of a Gaussian-product variance estimate
    assert abs(s.var() / expected - 1) < 10 * np.sqrt(8 / m)


def test_shared_factor_covariance_matches_numpy():
    rng = np.random.default_rng(11)
    q = scaling._factor_sampler(6, "uniform", 2.0, 0.4)(rng, 200_000)
    np.testing.assert_allclose(
        np.cov(q.T), scaling.equicorrelated_cov(6, 0.4, sigma=2.0), atol=0.05
    )


def test_rho_is_validated():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"rho must lie in \[0, 1\]"):
        scaling.sample_dot_products(4, 10, rng, rho=-0.1)
    with pytest.raises(ValueError, match="either rho or cov"):
        scaling.sample_dot_products(4, 10, rng, rho=0.1, cov=np.eye(4))
