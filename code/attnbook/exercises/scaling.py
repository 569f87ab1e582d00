"""Checkers for chapter 3: the scaled scores ``q k^T / sqrt(d_k)`` and the
variance of ``q . k``."""

from __future__ import annotations

import math
import re

import numpy as np

from ..attention import attention_scores
from ..scaling import dot_product_variance, equicorrelated_cov
from ._framework import Case, Mistake, run_checks


def _t(k):
    """``k^T`` over the last two axes, for any batch shape."""
    return np.swapaxes(k, -1, -2)


# --- scaled scores -----------------------------------------------------------

# np.dot's shape error: "shapes (2,4,64) and (64,6,2) not aligned: ..."
_DOT_SHAPES = re.compile(
    r"shapes \(([\d,\s]*)\) and \(([\d,\s]*)\) not aligned"
)


def _is_batched_dot_error(err: Exception) -> bool:
    """Whether ``err`` is np.dot's shape error on an operand with more than two
    axes (np.dot(q, k.T) on a batch); np.dot's error on two matrices is another
    mistake (a missing transpose)."""
    found = (
        _DOT_SHAPES.search(str(err)) if isinstance(err, ValueError) else None
    )
    return found is not None and any(
        len([n for n in shape.split(",") if n.strip()]) > 2
        for shape in found.groups()
    )


SCALED_SCORES_MISTAKES = [
    Mistake(
        "no_scale",
        "the scores are not scaled at all: you return q k^T",
        "divide by sqrt(d_k), the standard deviation of q . k for "
        "unit-variance components",
        lambda q, k: q @ _t(k),
    ),
    Mistake(
        "scale_by_dk",
        "the scores are divided by d_k instead of sqrt(d_k) "
        "(or both q and k were divided by sqrt(d_k))",
        "Var(q . k) = d_k, so the standard deviation to divide by is "
        "sqrt(d_k), applied once",
        lambda q, k: q @ _t(k) / q.shape[-1],
    ),
    Mistake(
        "times_sqrt_dk",
        "the scores are multiplied by sqrt(d_k) instead of divided",
        "the scale shrinks the scores: q @ k^T / np.sqrt(d_k)",
        lambda q, k: q @ _t(k) * np.sqrt(q.shape[-1]),
    ),
    Mistake(
        "precedence",
        "operator precedence: `d_k ** 1/2` is (d_k ** 1) / 2, so `q @ k^T / "
        "d_k ** 1/2` "
        "computes (q k^T / d_k) / 2: you divided by 2 d_k",
        "write np.sqrt(d_k) or d_k ** 0.5",
        lambda q, k: q @ _t(k) / q.shape[-1] / 2,
    ),
    Mistake(
        "precedence_half",
        "operator precedence: `d_k ** 1/2` is (d_k ** 1) / 2, so a scale "
        "computed "
        "first (`scale = d_k ** 1/2`) is d_k / 2, and you divided by d_k / 2",
        "write np.sqrt(d_k) or d_k ** 0.5",
        lambda q, k: q @ _t(k) / (q.shape[-1] / 2),
    ),
    Mistake(
        "sqrt_n_k",
        "the scores are divided by the square root of the number of keys n_k, "
        "not of d_k",
        "d_k is the dimension of each query and key vector, q.shape[-1] (the "
        "number of features, not the number of keys)",
        lambda q, k: q @ _t(k) / np.sqrt(k.shape[-2]),
    ),
    Mistake(
        "sqrt_n_q",
        "the scores are divided by the square root of the number of queries "
        "n_q "
        "(len(q) or q.shape[0] on a matrix), not of d_k",
        "d_k is the last dimension: q.shape[-1]",
        lambda q, k: q @ _t(k) / np.sqrt(q.shape[-2]),
    ),
    Mistake(
        "second_axis",
        "d_k was read as q.shape[1], which is d_k only for a 2-d q: with "
        "leading batch "
        "dimensions it is n_q (or the number of heads), so the batched scores "
        "are divided by the wrong number",
        "d_k is the last dimension, whatever the number of leading ones: "
        "q.shape[-1]",
        lambda q, k: q @ _t(k) / np.sqrt(q.shape[1]),
    ),
    Mistake(
        "transposed",
        "the score matrix is transposed: row i should be query i against "
        "every key",
        "compute q @ k^T, shape (n_q, n_k), not k @ q^T",
        lambda q, k: k @ _t(q) / np.sqrt(q.shape[-1]),
    ),
    Mistake(
        "cosine",
        "each q and k was normalised to unit length (cosine similarity), not "
        "scaled by 1/sqrt(d_k)",
        "the scale is one number for the whole matrix; it keeps the vectors' "
        "lengths in the scores",
        lambda q, k: (
            (q / np.linalg.norm(q, axis=-1, keepdims=True))
            @ _t(k / np.linalg.norm(k, axis=-1, keepdims=True))
        ),
    ),
    Mistake(
        "integer_sqrt",
        "the square root of d_k was rounded to a whole number "
        "(int(np.sqrt(d_k)), "
        "math.isqrt(d_k) or round(d_k ** 0.5)): right only when d_k is a "
        "perfect square, and "
        "sqrt(128) = 11.31, not 11",
        "divide by the real square root, np.sqrt(d_k) or d_k ** 0.5, with no "
        "int(), round() or isqrt",
        lambda q, k: q @ _t(k) / math.isqrt(q.shape[-1]),
    ),
    Mistake(
        "batched_dot",
        "np.dot (or np.inner) on a batch: on arrays with more than two axes "
        "it is not one matrix product per batch entry but pairs every query "
        "with the keys of EVERY batch entry, so np.dot(q, "
        "np.swapaxes(k, -1, -2)) and np.inner(q, k) have shape "
        "(..., n_q, ..., n_k), and np.dot(q, k.T) raises (k.T also reverses "
        "every axis)",
        "np.dot and np.inner are the matrix product only on matrices; the "
        "matrix product that batches over the leading axes is q @ "
        "np.swapaxes(k, -1, -2) (np.matmul), or np.einsum('...qd,...kd->"
        "...qk', q, k)",
        lambda q, k: np.inner(q, k) / np.sqrt(q.shape[-1]),
        raises=_is_batched_dot_error,
    ),
]


def scaled_scores_cases() -> list[Case]:
    rng = np.random.default_rng(3)
    n = lambda *shape: rng.normal(size=shape)  # noqa: E731
    return [
        Case("n_q = 3, n_k = 5, d_k = 16", (n(3, 16), n(5, 16))),
        Case(
            "a batch of 2: q (2, 4, 64), k (2, 6, 64)",
            (n(2, 4, 64), n(2, 6, 64)),
        ),
        Case("one query, n_k = 7, d_k = 256", (n(1, 256), n(7, 256))),
        Case("d_k = 1 (the scale is 1)", (n(4, 1), n(3, 1))),
        Case("n_q = n_k = d_k = 9", (n(9, 9), n(9, 9))),
        Case(
            "two leading dimensions, (batch, heads): q (2, 3, 4, 16), k (2, "
            "3, 5, 16)",
            (n(2, 3, 4, 16), n(2, 3, 5, 16)),
        ),
        # every d_k above is a perfect square: an integer square root would
        # pass them all
        Case(
            "a batch of 2 with d_k = 128, not a perfect square: q (2, 3, "
            "128), k (2, 4, 128)",
            (n(2, 3, 128), n(2, 4, 128)),
        ),
    ]


def check_scaled_scores(fn) -> None:
    """Check ``fn(q, k)`` returns the scaled scores ``q k^T / sqrt(d_k)``,
    shape ``(..., n_q, n_k)``."""
    run_checks(
        "scaled scores",
        fn,
        scaled_scores_cases(),
        lambda q, k: attention_scores(q, k),
        SCALED_SCORES_MISTAKES,
    )


# --- the variance of q . k for general covariances ---------------------------


def _scalar(out):
    """Accept a Python float, a 0-d array or a one-element array/tensor."""
    if hasattr(out, "detach"):
        out = out.detach().cpu().numpy()
    a = np.asarray(out, dtype=np.float64)
    return a.reshape(()) if a.size == 1 else a


DOT_VARIANCE_MISTAKES = [
    Mistake(
        "diagonal_only",
        "only the diagonals were used: sum_i Cq_ii Ck_ii ignores correlated "
        "features",
        "expand E[(q . k)^2] = sum_ij E[q_i q_j] E[k_i k_j]: the off-diagonal "
        "terms count too",
        lambda cq, ck: float(np.sum(np.diag(cq) * np.diag(ck))),
    ),
    Mistake(
        "trace_product",
        "you multiplied the traces: trace(Cq) trace(Ck)",
        "the answer is the trace of the product, trace(Cq @ Ck), not the "
        "product of traces",
        lambda cq, ck: float(np.trace(cq) * np.trace(ck)),
    ),
    Mistake(
        "average_variances",
        "you used sigma_q^2 sigma_k^2 d_k with the average variances, "
        "i.e. trace(Cq) trace(Ck) / d_k",
        "that formula holds only for isotropic covariances; use trace(Cq @ "
        "Ck)",
        lambda cq, ck: float(np.trace(cq) * np.trace(ck) / cq.shape[0]),
    ),
    Mistake(
        "std",
        "you returned the standard deviation, the square root of the variance",
        "drop the square root",
        lambda cq, ck: float(np.sqrt(np.trace(cq @ ck))),
    ),
    Mistake(
        "frobenius",
        "you returned the Frobenius norm of Cq @ Ck, sqrt(sum of its squared "
        "entries)",
        "the variance is a sum of diagonal entries, trace(Cq @ Ck), with no "
        "squares and no square root",
        lambda cq, ck: float(np.linalg.norm(cq @ ck)),
    ),
    Mistake(
        "sum_of_product",
        "you summed every entry of Cq @ Ck instead of its diagonal",
        "E[(q . k)^2] = sum_ij Cq_ij Ck_ji = trace(Cq @ Ck)",
        lambda cq, ck: float(np.sum(cq @ ck)),
    ),
    Mistake(
        "scaled_variance",
        "you returned trace(Cq Ck) / d_k, the variance of the SCALED score q "
        ". k / sqrt(d_k)",
        "the exercise asks for Var(q . k) itself, before any scaling: "
        "trace(Cq @ Ck); dividing by d_k is "
        "what the 1/sqrt(d_k) scale then does to it",
        lambda cq, ck: float(np.trace(cq @ ck)) / cq.shape[0],
    ),
    Mistake(
        "d_k_only",
        "you returned d_k, the answer for unit-variance independent "
        "components only",
        "the covariances change the answer: trace(Cq @ Ck)",
        lambda cq, ck: float(cq.shape[0]),
    ),
]


def _rescale(corr, stds):
    """The covariance ``diag(stds) corr diag(stds)``: correlations ``corr``,
    standard deviations ``stds``."""
    stds = np.asarray(stds)
    return stds[:, None] * corr * stds[None, :]


def dot_variance_cases() -> list[Case]:
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(4, 4)), rng.normal(size=(4, 6))
    # General covariances first: identities give the same number for several
    # mistakes.
    return [
        Case(
            "general covariances Cq = A A^T, Ck = B B^T, d_k = 4",
            (a @ a.T, b @ b.T / 6),
        ),
        Case(
            "independent unit-variance components, d_k = 8",
            (np.eye(8), np.eye(8)),
        ),
        Case(
            "sigma_q = 3, sigma_k = 0.5, independent components, d_k = 6",
            (9 * np.eye(6), 0.25 * np.eye(6)),
        ),
        Case(
            "correlated features (correlation 0.3 between any two) with "
            "unequal variances, d_k = 5",
            (
                _rescale(
                    equicorrelated_cov(5, 0.3), [1.0, 2.0, 0.5, 1.5, 1.0]
                ),
                _rescale(
                    equicorrelated_cov(5, 0.3), [2.0, 1.0, 1.0, 0.5, 1.0]
                ),
            ),
        ),
        Case("d_k = 1", (np.array([[2.0]]), np.array([[5.0]]))),
    ]


def check_dot_variance(fn) -> None:
    """Check ``fn(cov_q, cov_k)`` returns ``Var(q . k)`` for independent
    zero-mean ``q``, ``k``."""
    run_checks(
        "variance of q . k",
        fn,
        dot_variance_cases(),
        dot_product_variance,
        DOT_VARIANCE_MISTAKES,
        postprocess=_scalar,
    )
