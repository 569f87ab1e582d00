"""Kernel smoothing: the Nadaraya-Watson estimator, and how it is attention in
disguise.

Nadaraya (1964) and Watson (1964) estimate a regression function at a point
``x`` by a weighted average of observed responses ``y_i``, each weighted by a
kernel ``K(x, x_i)`` that is large when ``x`` is close to the observed input
``x_i``:

    f(x) = sum_i K(x, x_i) y_i / sum_j K(x, x_j).

With ``K = exp(score)`` the weights are a softmax of the scores, so the
estimator is attention with the query ``x``, the keys ``x_i`` and the values
``y_i``. This module computes the estimator directly from the kernel, without
the attention code, so that the chapter can check the equivalence between two
independent implementations.

Chapter 17 (perspectives) shows :func:`nadaraya_watson` and
:func:`gaussian_kernel_as_attention`.
"""

from __future__ import annotations

import numpy as np

from . import _validate

#: The kernels :func:`log_kernel` knows, with ``h`` the bandwidth.
KERNELS = {
    "gaussian": "exp(-|x - x_i|^2 / (2 h^2))",
    "exp_dot": "exp(x . x_i / h)",
}


def _check_bandwidth(bandwidth) -> float:
    h = float(bandwidth)
    if not np.isfinite(h) or h <= 0:
        raise ValueError(
            f"bandwidth must be a positive finite number; got {bandwidth!r}"
        )
    return h


def _check_shapes(x_query, x_train, y_train=None) -> None:
    """Raise unless x_query (..., n_q, d), x_train (..., n, d) and y_train
    (..., n, d_y) fit."""
    _validate.require_rank("x_query", x_query, 2, "(..., n_q, d)")
    _validate.require_rank("x_train", x_train, 2, "(..., n, d)")
    qs, ts = tuple(x_query.shape), tuple(x_train.shape)
    if qs[-1] != ts[-1]:
        raise ValueError(
            "x_query and x_train must have the same number of features d "
            "(last "
            f"dimension); got x_query {qs} and x_train {ts}"
        )
    leads = [qs[:-2], ts[:-2]]
    if y_train is not None:
        _validate.require_rank("y_train", y_train, 2, "(..., n, d_y)")
        ys = tuple(y_train.shape)
        if ys[-2] != ts[-2]:
            raise ValueError(
                f"y_train needs one row per training input: x_train {ts} has "
                f"{ts[-2]}, y_train {ys} has {ys[-2]}"
            )
        leads.append(ys[:-2])
    try:
        np.broadcast_shapes(*leads)
    except ValueError:
        raise ValueError(
            f"the leading (batch) dimensions of x_query {qs}, x_train {ts}"
            + (
                ""
                if y_train is None
                else f" and y_train {tuple(y_train.shape)}"
            )
            + " do not broadcast"
        ) from None


def log_kernel(
    x_query, x_train, kernel: str = "gaussian", bandwidth: float = 1.0
) -> np.ndarray:
    """``log K(x, x_i)`` for every query point and every training input.

    x_query: (..., n_q, d), x_train: (..., n, d) -> (..., n_q, n).
    ``kernel="gaussian"``: ``-|x - x_i|^2 / (2 h^2)``, from explicit
    differences; ``kernel="exp_dot"``: ``x . x_i / h``, the exponentiated dot
    product of attention (``h = sqrt(d)`` is attention's default scale). ``h``
    is ``bandwidth``.
    """
    x_query, x_train = (
        np.asarray(x_query, dtype=float),
        np.asarray(x_train, dtype=float),
    )
    _check_shapes(x_query, x_train)
    h = _check_bandwidth(bandwidth)
    if kernel == "gaussian":
        # (..., n_q, n, d)
        diff = x_query[..., :, None, :] - x_train[..., None, :, :]
        return -np.sum(diff * diff, axis=-1) / (2 * h * h)
    if kernel == "exp_dot":
        return np.einsum("...md,...nd->...mn", x_query, x_train) / h
    raise ValueError(
        f"unknown kernel {kernel!r}; choose one of {sorted(KERNELS)}"
    )


def nadaraya_watson(
    x_query, x_train, y_train, kernel: str = "gaussian", bandwidth: float = 1.0
):
    """The Nadaraya-Watson estimate at each query point, and the weights it
    used.

    x_query: (..., n_q, d), x_train: (..., n, d), y_train: (..., n, d_y).
    Returns ``(estimate (..., n_q, d_y), weights (..., n_q, n))``, where
    ``weights[..., a, i] = K(x_a, x_i) / sum_j K(x_a, x_j)`` and the estimate
    is ``weights @ y_train``.
    """
    x_query, x_train = (
        np.asarray(x_query, dtype=float),
        np.asarray(x_train, dtype=float),
    )
    y_train = np.asarray(y_train, dtype=float)
    _check_shapes(x_query, x_train, y_train)
    # (..., n_q, n)
    log_k = log_kernel(x_query, x_train, kernel, bandwidth)
    # Every K(x_a, .) of one query may be multiplied by the same factor: it
    # cancels in the ratio. Dividing by the largest keeps the biggest kernel
    # value at 1, so that a small bandwidth cannot make all of them underflow
    # to 0 (and the estimate 0 / 0).
    k = np.exp(log_k - np.max(log_k, axis=-1, keepdims=True))
    weights = k / np.sum(k, axis=-1, keepdims=True)
    return weights @ y_train, weights


def gaussian_kernel_as_attention(x_query, x_train, bandwidth: float = 1.0):
    """Queries, keys and scale with which attention computes the
    Gaussian-kernel estimate.

    x_query: (..., n_q, d), x_train: (..., n, d). Returns ``(q (..., n_q, d +
    1), k (..., n, d + 1), scale)`` with ``q = [x, 1]``, ``k = [x_i, -|x_i|^2 /
    2]`` and ``scale = 1 / h^2``: then ``scale * q . k`` differs from ``-|x -
    x_i|^2 / (2 h^2)`` only by ``-|x|^2 / (2 h^2)``, which is the same for
    every key and cancels in the softmax. So ``scaled_dot_product_attention(q,
    k, y, scale=scale)`` equals :func:`nadaraya_watson` with the Gaussian
    kernel.
    """
    x_query, x_train = (
        np.asarray(x_query, dtype=float),
        np.asarray(x_train, dtype=float),
    )
    _check_shapes(x_query, x_train)
    h = _check_bandwidth(bandwidth)
    ones = np.ones(x_query.shape[:-1] + (1,))
    half_sq_norm = 0.5 * np.sum(x_train * x_train, axis=-1, keepdims=True)
    q = np.concatenate([x_query, ones], axis=-1)
    k = np.concatenate([x_train, -half_sq_norm], axis=-1)
    return q, k, 1.0 / (h * h)
