"""Why attention divides by ``sqrt(d_k)``: the statistics of ``q . k`` and
softmax saturation.

Chapter 3 (the scale) uses these functions to check the variance theorem by
Monte Carlo and to measure how sharp (low entropy) and how flat (small
Jacobian) the softmax of random scores becomes as ``d_k`` grows; its exercises
check readers' answers against :func:`dot_product_variance`. The chapter's
training experiment (a one-layer attention model with and without the scale) is
:mod:`attnbook.experiments.recall`.
"""

from __future__ import annotations


import numpy as np

from . import _validate
from .attention import attention_scores
from .softmax import softmax, softmax_jacobian

DISTRIBUTIONS = ("normal", "uniform", "sign")


# --- the statistics of q . k -------------------------------------------------


def sample_components(
    rng: np.random.Generator, shape, dist: str = "normal", sigma: float = 1.0
) -> np.ndarray:
    """Independent entries with mean 0 and standard deviation ``sigma``, of the
    given shape.

    dist: ``"normal"``; ``"uniform"`` on ``[-sqrt(3) sigma, sqrt(3) sigma]``;
    or ``"sign"`` (``+sigma`` or ``-sigma`` with equal chance). All three have
    the same first two moments, which is all the variance theorem uses.
    """
    if dist == "normal":
        return rng.normal(scale=sigma, size=shape)
    if dist == "uniform":
        # the uniform on [-a, a] has variance a^2 / 3
        half_width = np.sqrt(3.0) * sigma
        return rng.uniform(-half_width, half_width, size=shape)
    if dist == "sign":
        return sigma * rng.choice(np.array([-1.0, 1.0]), size=shape)
    raise ValueError(f"dist must be one of {DISTRIBUTIONS}; got {dist!r}")


def equicorrelated_cov(d: int, rho: float, sigma: float = 1.0) -> np.ndarray:
    """``(d, d)`` covariance with variance ``sigma^2`` and correlation ``rho``
    between any two features.

    ``sigma^2 ((1 - rho) I + rho 1 1^T)`` is positive semidefinite only for
    ``-1/(d - 1) <= rho <= 1``; other values raise ``ValueError``.
    """
    d = _validate.positive_int("d", d)
    low = -1.0 / (d - 1) if d > 1 else -np.inf
    if not low <= rho <= 1.0:
        raise ValueError(
            f"rho must lie in [{low:.4g}, 1] for a valid {d} x {d} "
            f"covariance; got {rho}"
        )
    return sigma**2 * ((1.0 - rho) * np.eye(d) + rho * np.ones((d, d)))


def _gaussian_sampler(cov: np.ndarray):
    """A function ``(rng, n) -> (n, d)`` drawing from ``N(0, cov)``.

    Uses the symmetric square root from ``eigh``, which (unlike Cholesky) also
    accepts a singular covariance such as ``rho = 1``.
    """
    eigenvalues, vectors = np.linalg.eigh(cov)
    # root @ root.T == cov
    root = vectors * np.sqrt(np.clip(eigenvalues, 0.0, None))
    return lambda rng, n: rng.standard_normal((n, cov.shape[0])) @ root.T


def _factor_sampler(d_k: int, dist: str, sigma: float, rho: float):
    """A function ``(rng, n) -> (n, d_k)``: components of variance ``sigma^2``,
    correlation ``rho``.

    The correlation comes from one shared factor added to every component,
    ``x_i = sigma (sqrt(1 - rho) z_i + sqrt(rho) z_0)``, which needs no matrix
    product.
    """

    def draw(rng, n):
        x = sample_components(rng, (n, d_k), dist)
        if rho:
            x = np.sqrt(1.0 - rho) * x + np.sqrt(rho) * sample_components(
                rng, (n, 1), dist
            )
        return sigma * x

    return draw


def sample_dot_products(
    d_k: int,
    n_samples: int,
    rng: np.random.Generator,
    dist: str = "normal",
    sigma_q: float = 1.0,
    sigma_k: float = 1.0,
    rho: float = 0.0,
    cov: np.ndarray | None = None,
    chunk: int = 2**20,
) -> np.ndarray:
    """``n_samples`` draws of ``q . k`` for independent random ``q, k`` of
    dimension ``d_k``.

    By default the ``2 d_k`` components are independent with mean 0 and
    standard deviations ``sigma_q`` and ``sigma_k`` (distribution ``dist``).
    ``rho`` in ``[0, 1]`` correlates the components within ``q`` (and within
    ``k``) with correlation ``rho`` between any two, through a shared factor.
    With ``cov (d_k, d_k)`` instead, ``q`` and ``k`` are both Gaussian ``N(0,
    cov)``. ``q`` and ``k`` are always independent of each other. Returns
    ``(n_samples,)``; works in chunks of about ``chunk`` numbers so that memory
    stays bounded.
    """
    d_k = _validate.positive_int("d_k", d_k)
    n_samples = _validate.positive_int("n_samples", n_samples)
    if not 0.0 <= rho <= 1.0:
        raise ValueError(
            "rho must lie in [0, 1] (a shared factor cannot anti-correlate); "
            f"got {rho}"
        )
    if cov is not None:
        if rho:
            raise ValueError("give either rho or cov, not both")
        cov = np.asarray(cov, dtype=np.float64)
        if cov.shape != (d_k, d_k):
            raise ValueError(
                f"cov must have shape (d_k, d_k) = {(d_k, d_k)}; got "
                f"{cov.shape}"
            )
        draw_q = draw_k = _gaussian_sampler(cov)
    else:
        draw_q = _factor_sampler(d_k, dist, sigma_q, rho)
        draw_k = _factor_sampler(d_k, dist, sigma_k, rho)
    rows = max(1, chunk // d_k)
    out = np.empty(n_samples)
    for start in range(0, n_samples, rows):
        n = min(rows, n_samples - start)
        q, k = draw_q(rng, n), draw_k(rng, n)
        out[start : start + n] = np.einsum("nd,nd->n", q, k)
    return out


def dot_product_variance(cov_q, cov_k) -> float:
    """The variance of ``q . k`` for independent zero-mean ``q, k``:
    ``trace(cov_q @ cov_k)``.

    cov_q, cov_k: ``(d_k, d_k)`` covariance matrices. For independent
    unit-variance components (both identities) this is ``d_k``; for ``sigma^2
    I`` it is ``sigma_q^2 sigma_k^2 d_k``.
    """
    cov_q, cov_k = (
        np.asarray(cov_q, dtype=np.float64),
        np.asarray(cov_k, dtype=np.float64),
    )
    if (
        cov_q.ndim != 2
        or cov_q.shape[0] != cov_q.shape[1]
        or cov_q.shape != cov_k.shape
    ):
        raise ValueError(
            "cov_q and cov_k must be square matrices of one shape (d_k, "
            f"d_k); got {cov_q.shape} and {cov_k.shape}"
        )
    # trace(A B) = sum_ij A_ij B_ji, without forming the product
    return float(np.sum(cov_q * cov_k.T))


def score_std(mu_q, cov_q, mu_k, cov_k) -> np.ndarray:
    """The standard deviation of ``q . k`` for independent ``q`` and ``k``
    with means ``mu_q``, ``mu_k`` and covariances ``cov_q``, ``cov_k``: the
    number to divide the scores by to give them variance 1.

    mu_q, mu_k: ``(..., d_k)``; cov_q, cov_k: ``(..., d_k, d_k)``, with one
    set of leading (e.g. head) dimensions; returns ``(...)``. Writing ``q =
    mu_q + a`` and ``k = mu_k + b``, the four terms of ``q . k`` are
    uncorrelated, and ``Var[q . k] = trace(cov_q cov_k) + mu_q^T cov_k mu_q +
    mu_k^T cov_q mu_k``; the constant ``mu_q . mu_k`` moves the mean only.
    """
    mu_q, mu_k = (np.asarray(m, dtype=np.float64) for m in (mu_q, mu_k))
    cov_q, cov_k = (np.asarray(c, dtype=np.float64) for c in (cov_q, cov_k))
    if (
        mu_q.ndim < 1
        or mu_q.shape != mu_k.shape
        or cov_q.shape != cov_k.shape
        or cov_q.shape != mu_q.shape + mu_q.shape[-1:]
    ):
        raise ValueError(
            "means must have one shape (..., d_k) and covariances (..., d_k, "
            f"d_k); got mu_q {mu_q.shape}, cov_q {cov_q.shape}, mu_k "
            f"{mu_k.shape}, cov_k {cov_k.shape}"
        )
    # trace(cov_q cov_k) = sum_ij (cov_q)_ij (cov_k)_ji, per leading index
    trace = np.einsum("...ij,...ji->...", cov_q, cov_k)
    # mu^T C mu, per leading index
    q_through_k = np.einsum("...i,...ij,...j->...", mu_q, cov_k, mu_q)
    k_through_q = np.einsum("...i,...ij,...j->...", mu_k, cov_q, mu_k)
    return np.sqrt(trace + q_through_k + k_through_q)


# --- softmax saturation ------------------------------------------------------


def _check_probabilities(p: np.ndarray, axis: int) -> None:
    if p.ndim == 0:
        raise ValueError(
            "p must have at least one dimension (..., n); got a scalar"
        )
    if np.any(p < 0) or not np.all(np.isfinite(p)):
        raise ValueError("p must hold probabilities: finite and >= 0")
    total = p.sum(axis=axis)
    tol = 1e-3 if p.dtype == np.float16 else 1e-5
    # an all-zero row is a fully masked query
    ok = np.isclose(total, 1.0, atol=tol) | (total == 0)
    if not np.all(ok):
        bad = total[~ok].ravel()[0]
        raise ValueError(
            f"each slice of p along axis {axis} must sum to 1 (or be all 0); "
            f"one sums to {bad:.6g}"
        )


def softmax_entropy(p, axis: int = -1) -> np.ndarray:
    """Shannon entropy ``-sum_i p_i log p_i`` (in nats) of probability vectors
    along ``axis``.

    p: (..., n) -> (...). ``0 log 0 = 0``, so a one-hot row has entropy 0; the
    uniform row has the maximum, ``log n``. An all-zero row (a fully masked
    query) gets 0.
    """
    p = np.asarray(p)
    if not np.issubdtype(p.dtype, np.floating):
        p = p.astype(np.float64)
    _check_probabilities(p, axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(p), 0.0)
    return -np.sum(terms, axis=axis)


def softmax_jacobian_norm(p, ord: str | int = "fro") -> np.ndarray:
    """Norm of the softmax Jacobian ``diag(p) - p p^T`` at each probability row
    of ``p``.

    p: (..., n) -> (...). ``ord="fro"`` is the Frobenius norm; ``ord=2`` the
    spectral norm (the largest factor by which a change of the scores can be
    amplified). Both are 0 at a one-hot ``p``: a saturated softmax passes no
    gradient back to its scores.
    """
    p = np.asarray(p, dtype=np.float64)
    _check_probabilities(p, -1)
    jac = softmax_jacobian(p)  # (..., n, n)
    if ord == "fro":
        return np.sqrt(np.sum(jac**2, axis=(-2, -1)))
    if ord == 2:
        # the Jacobian is symmetric positive semidefinite: its spectral norm is
        # its largest eigenvalue
        return np.linalg.eigvalsh(jac)[..., -1].clip(min=0.0)
    raise ValueError(f"ord must be 'fro' or 2; got {ord!r}")


def random_attention_weights(
    d_k: int,
    n_keys: int,
    n_queries: int,
    rng: np.random.Generator,
    scale: float | None = None,
    sigma: float = 1.0,
) -> np.ndarray:
    """Softmax weights of random queries over random keys: ``(n_queries,
    n_keys)``.

    Components of ``q`` and ``k`` are independent ``N(0, sigma^2)``. ``scale``
    multiplies the scores ``q k^T`` (``None`` means ``1/sqrt(d_k)``; pass
    ``1.0`` for no scaling).
    """
    d_k = _validate.positive_int("d_k", d_k)
    n_keys = _validate.positive_int("n_keys", n_keys)
    n_queries = _validate.positive_int("n_queries", n_queries)
    q = rng.normal(scale=sigma, size=(n_queries, d_k))
    k = rng.normal(scale=sigma, size=(n_keys, d_k))
    return softmax(attention_scores(q, k, scale), axis=-1)


def saturation_stats(weights) -> dict[str, float]:
    """How saturated softmax rows are, averaged over rows of ``weights (...,
    n)``.

    Returns mean ``entropy`` (nats; uniform = ``log n``), mean ``max_weight``,
    and the mean Frobenius and spectral norms of the softmax Jacobian
    (``jacobian_fro``, ``jacobian_2``).
    """
    weights = np.asarray(weights, dtype=np.float64)
    return {
        "entropy": float(np.mean(softmax_entropy(weights))),
        "max_weight": float(np.mean(weights.max(axis=-1))),
        "jacobian_fro": float(np.mean(softmax_jacobian_norm(weights, "fro"))),
        "jacobian_2": float(np.mean(softmax_jacobian_norm(weights, 2))),
    }
