"""Checkers for chapter 3: the scaled scores ``q k^T / sqrt(d_k)``, the
variance of ``q . k``, and (hard) the standard deviation of ``q . k`` for
queries and keys with means and covariances, per head."""

from __future__ import annotations

import math
import re

import numpy as np

from ..attention import attention_scores
from ..softmax import softmax
from ..scaling import dot_product_variance, equicorrelated_cov, score_std
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


def _is_fixed_axes_einsum_error(err: Exception) -> bool:
    """Whether ``err`` is numpy's or torch's complaint that an einsum's
    subscripts name fewer (or more) axes than an operand has, with no
    ``...``: an einsum written for matrices ('qd,kd->qk') run on a batch."""
    text = str(err)
    return (
        isinstance(err, ValueError)
        and (
            "more dimensions than subscripts given in einstein sum" in text
            or "einstein sum subscripts string contains too many" in text
        )
    ) or (
        isinstance(err, RuntimeError)
        and "einsum()" in text
        and "no ellipsis was given" in text
    )


def _is_fixed_rank_transpose_error(err: Exception) -> bool:
    """Whether ``err`` is numpy's or torch's complaint that a transpose lists
    fewer (or more) axes than the array has: ``k.transpose(0, 1, 3, 2)``,
    written for one number of leading axes, run on another."""
    text = str(err)
    return (
        isinstance(err, ValueError) and "axes don't match array" in text
    ) or (
        isinstance(err, RuntimeError)
        and "permute" in text
        and (
            "does not match the length of the desired ordering" in text
            or "number of dims don't match" in text
        )
    )


def _fixed_rank_t(k):
    """``k^T`` by a transpose written out for matrices, one leading axis and
    two leading axes: what a reader who lists the axes by hand writes."""
    if k.ndim == 2:
        return k.T
    if k.ndim == 3:
        return k.transpose(0, 2, 1)
    return k.transpose(0, 1, 3, 2)


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
        "k_second_axis",
        "d_k was read as k.shape[1], which is d_k only for a 2-d k: with "
        "leading batch dimensions it is n_k (or the number of heads), so the "
        "batched scores are divided by the wrong number",
        "d_k is the last dimension of q and k, whatever the number of leading "
        "ones: q.shape[-1]",
        lambda q, k: q @ _t(k) / np.sqrt(k.shape[1]),
    ),
    Mistake(
        "softmax_weights",
        "you returned the softmax weights, not the scores: each row sums to 1",
        "the exercise stops before the softmax: return q @ k^T / sqrt(d_k) "
        "itself",
        lambda q, k: softmax(q @ _t(k) / np.sqrt(q.shape[-1]), axis=-1),
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
        "np.dot, np.inner or np.tensordot on a batch: on arrays with more "
        "than two axes none of them is one matrix product per batch entry; "
        "each pairs every query with the keys of EVERY batch entry, so "
        "np.dot(q, np.swapaxes(k, -1, -2)), np.inner(q, k) and np.tensordot("
        "q, k, axes=(-1, -1)) have shape (..., n_q, ..., n_k), and np.dot(q, "
        "k.T) raises (k.T also reverses every axis)",
        "np.dot, np.inner and np.tensordot are the matrix product only on "
        "matrices; the "
        "matrix product that batches over the leading axes is q @ "
        "np.swapaxes(k, -1, -2) (np.matmul), or np.einsum('...qd,...kd->"
        "...qk', q, k)",
        lambda q, k: np.inner(q, k) / np.sqrt(q.shape[-1]),
        raises=_is_batched_dot_error,
    ),
    Mistake(
        "einsum_without_ellipsis",
        "the einsum names one subscript per axis of a matrix "
        "('qd,kd->qk'), so it refuses an operand with more axes (a batch, "
        "or batch and heads): einsum needs '...' to stand for the leading "
        "axes",
        "write np.einsum('...qd,...kd->...qk', q, k) / np.sqrt(d_k): '...' "
        "matches any number of leading axes, none included",
        lambda q, k: np.einsum("qd,kd->qk", q, k) / np.sqrt(q.shape[-1]),
        raises=_is_fixed_axes_einsum_error,
    ),
    Mistake(
        "fixed_rank_transpose",
        "k^T was written with its axes listed by hand (k.transpose(0, 2, 1), "
        "k.transpose(0, 1, 3, 2), a permute), one branch per number of "
        "leading axes: it refuses a stack with more leading axes than the "
        "branches foresaw, and the exercise allows any number",
        "swap only the last two axes, whatever comes before them: "
        "np.swapaxes(k, -1, -2) (in torch, k.transpose(-1, -2) or k.mT)",
        lambda q, k: q @ _fixed_rank_t(k) / np.sqrt(q.shape[-1]),
        raises=_is_fixed_rank_transpose_error,
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
        # three leading axes, so that a transpose written out for up to two
        # (k.transpose(0, 1, 3, 2)) does not pass
        Case(
            "three leading dimensions (any number is allowed): q (2, 2, 3, "
            "4, 16), k (2, 2, 3, 5, 16)",
            (n(2, 2, 3, 4, 16), n(2, 2, 3, 5, 16)),
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
        hint="swap the last two axes of k (not k.T on a batch), multiply, "
        "and divide by the square root of d_k = q.shape[-1]; the result has "
        "shape (..., n_q, n_k): row i is query i against every key",
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
    Mistake(
        "frobenius_product",
        "you multiplied the Frobenius norms, ||Cq||_F ||Ck||_F: by "
        "Cauchy-Schwarz an upper bound of sum_ij Cq_ij Ck_ij = trace(Cq @ "
        "Ck), equal to it only when Cq and Ck are proportional",
        "expand E[(q . k)^2] = sum_ij E[q_i q_j] E[k_i k_j] = sum_ij Cq_ij "
        "Ck_ji: one product of matching entries, summed, with no norms",
        lambda cq, ck: float(np.linalg.norm(cq) * np.linalg.norm(ck)),
    ),
    Mistake(
        "determinant",
        "you returned a determinant (of Cq @ Ck, or the product of the two "
        "determinants), the 'generalised variance' of a random vector, not "
        "the variance of the number q . k",
        "q . k is one number: expand E[(q . k)^2] = sum_ij E[q_i q_j] E[k_i "
        "k_j], which gives trace(Cq @ Ck)",
        lambda cq, ck: float(np.linalg.det(cq) * np.linalg.det(ck)),
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
        hint="redo the proof of the theorem with the cross terms kept: "
        "E[(q . k)^2] = sum_ij E[q_i q_j] E[k_i k_j], where E[q_i q_j] is "
        "an entry of Cq; return the exact variance, one number computed "
        "from Cq and Ck (not its square root, and not an estimate from "
        "sampled q and k, which is off by its sampling error)",
    )


# --- (hard) the scale for queries and keys with means ------------------------


def _quad(mu, cov):
    """``mu^T cov mu`` per leading index (a reader's slip may pass either
    covariance)."""
    return np.einsum("...i,...ij,...j->...", mu, cov, mu)


def _trace(cq, ck):
    return np.einsum("...ij,...ji->...", cq, ck)


def _std(mq, cq, mk, ck):
    """The right standard deviation, per head."""
    return np.sqrt(_trace(cq, ck) + _quad(mq, ck) + _quad(mk, cq))


SCORE_STD_MISTAKES = [
    Mistake(
        "means_ignored",
        "the means were ignored: you returned sqrt(trace(Cq Ck)), the answer "
        "for zero-mean q and k",
        "write q = mu_q + a, k = mu_k + b and expand q . k: the cross terms "
        "mu_q . b and a . mu_k have variances mu_q^T Ck mu_q and mu_k^T Cq "
        "mu_k",
        lambda mq, cq, mk, ck: np.sqrt(_trace(cq, ck)),
    ),
    Mistake(
        "second_moment",
        "you returned sqrt(E[(q . k)^2]), which includes the squared mean "
        "(mu_q . mu_k)^2: a root mean square, not a standard deviation",
        "the constant mu_q . mu_k shifts every score and has no variance: "
        "leave (mu_q . mu_k)^2 out",
        lambda mq, cq, mk, ck: np.sqrt(
            _trace(cq, ck)
            + _quad(mq, ck)
            + _quad(mk, cq)
            + np.einsum("...i,...i->...", mq, mk) ** 2
        ),
    ),
    Mistake(
        "means_with_own_covariance",
        "each mean was paired with its own covariance (mu_q^T Cq mu_q + "
        "mu_k^T Ck mu_k)",
        "the term mu_q . b varies through the KEY's noise b: its variance is "
        "mu_q^T Ck mu_q (and a . mu_k gives mu_k^T Cq mu_k)",
        lambda mq, cq, mk, ck: np.sqrt(
            _trace(cq, ck) + _quad(mq, cq) + _quad(mk, ck)
        ),
    ),
    Mistake(
        "one_mean_term",
        "the key's mean term mu_k^T Cq mu_k is missing: only the query's, "
        "mu_q^T Ck mu_q, is there",
        "both q and k have means: q . k has the cross terms mu_q . b AND a . "
        "mu_k, and a . mu_k (the key's mean against the query's variation a) "
        "has variance mu_k^T Cq mu_k",
        lambda mq, cq, mk, ck: np.sqrt(_trace(cq, ck) + _quad(mq, ck)),
    ),
    # the same slip with the other mean kept (reader ch03-v)
    Mistake(
        "one_mean_term",
        "the query's mean term mu_q^T Ck mu_q is missing: only the key's, "
        "mu_k^T Cq mu_k, is there",
        "both q and k have means: q . k has the cross terms mu_q . b AND a . "
        "mu_k, and mu_q . b (the query's mean against the key's variation b) "
        "has variance mu_q^T Ck mu_q",
        lambda mq, cq, mk, ck: np.sqrt(_trace(cq, ck) + _quad(mk, cq)),
    ),
    Mistake(
        "trace_product",
        "you multiplied the traces, trace(Cq) trace(Ck), instead of taking "
        "the trace of the product",
        "E[(a . b)^2] = sum_ij E[a_i a_j] E[b_i b_j] = trace(Cq Ck)",
        lambda mq, cq, mk, ck: np.sqrt(
            np.trace(cq, axis1=-2, axis2=-1) * np.trace(ck, axis1=-2, axis2=-1)
            + _quad(mq, ck)
            + _quad(mk, cq)
        ),
    ),
    Mistake(
        "d_k_for_trace",
        "the trace term was replaced by d_k, its value for identity "
        "covariances only",
        "with general covariances the zero-mean part is trace(Cq Ck)",
        lambda mq, cq, mk, ck: np.sqrt(
            mq.shape[-1] + _quad(mq, ck) + _quad(mk, cq)
        ),
    ),
    Mistake(
        "variance",
        "you returned the variance of q . k, not its standard deviation",
        "the scores are divided by the standard deviation: take the square "
        "root",
        lambda mq, cq, mk, ck: _trace(cq, ck) + _quad(mq, ck) + _quad(mk, cq),
    ),
    Mistake(
        "trace_over_batch",
        "np.trace on a stack of matrices of shape (h, d, d) takes the "
        "diagonal over the FIRST two axes (the entries whose head index "
        "equals their row index) and sums along it: one number per column, "
        "shape (d,), not one per head",
        "take each head's trace over the last two axes: np.trace(a, "
        "axis1=-2, axis2=-1), or np.einsum('...ij,...ji->...', Cq, Ck)",
        lambda mq, cq, mk, ck: np.sqrt(
            np.trace(cq @ ck) + _quad(mq, ck) + _quad(mk, cq)
        ),
    ),
    # mu @ C @ mu on stacks (reader ch03-z): right for one head, and on a
    # stack of h heads matmul broadcasts the whole (h, d) stack of means as
    # one matrix against every head's covariance; the same with mu.T last
    *[
        Mistake(
            "batched_quadratic_form",
            "mu @ C @ mu on a stack of heads: with mu of shape (h, d), "
            "`mu @ C` multiplies the whole stack of means, taken as one "
            "(h, d) matrix, by every head's C, shape (h, h, d), and the "
            "second product gives shape (h, h, h), not one number per head "
            "(for one head, a vector mu, the same code is right)",
            "pair each head's mean with its own covariance: np.einsum("
            "'...i,...ij,...j->...', mu_q, Ck, mu_q), or "
            "(mu_q[..., None, :] @ Ck @ mu_q[..., :, None])[..., 0, 0]",
            quad,
        )
        for quad in (
            lambda mq, cq, mk, ck: np.sqrt(
                _trace(cq, ck) + mq @ ck @ mq + mk @ cq @ mk
            ),
            lambda mq, cq, mk, ck: np.sqrt(
                _trace(cq, ck) + mq @ ck @ mq.T + mk @ cq @ mk.T
            ),
        )
    ],
    # both one-head habits at once on a stack (student report stud0304):
    # np.trace(Cq @ Ck) and mu @ C @ mu; the result has shape (h, h, h)
    *[
        Mistake(
            "trace_and_quadratic_over_batch",
            "two one-head formulas on a stack of heads: np.trace(Cq @ Ck) "
            "takes the diagonal over the FIRST two axes (shape (d,), not one "
            "number per head), and mu @ C @ mu multiplies the whole (h, d) "
            "stack of means by every head's C, giving shape (h, h, h)",
            "reduce per head over the last axes only: np.einsum("
            "'...ij,...ji->...', Cq, Ck) for the trace and np.einsum("
            "'...i,...ij,...j->...', mu_q, Ck, mu_q) for each quadratic form",
            both,
        )
        for both in (
            lambda mq, cq, mk, ck: np.sqrt(
                np.trace(cq @ ck) + mq @ ck @ mq + mk @ cq @ mk
            ),
            lambda mq, cq, mk, ck: np.sqrt(
                np.trace(cq @ ck) + mq @ ck @ mq.T + mk @ cq @ mk.T
            ),
        )
    ],
    # one number for the whole stack: the ways readers reduce over the heads
    *[
        Mistake(
            "scalar",
            "you returned one number for the whole stack of heads (summed or "
            "averaged over them, or a Python float): the exercise asks for "
            "one standard deviation per head, shape (...), the leading "
            "dimensions of the means",
            "keep the leading head dimensions: reduce over the last axis (or "
            "the last two) only, e.g. np.einsum('...ij,...ji->...', Cq, Ck) "
            "has one entry per head, and do not sum or call float() at the "
            "end",
            reduce,
        )
        for reduce in (
            lambda mq, cq, mk, ck: np.sum(_std(mq, cq, mk, ck)),
            lambda mq, cq, mk, ck: np.mean(_std(mq, cq, mk, ck)),
            lambda mq, cq, mk, ck: np.sqrt(np.sum(_std(mq, cq, mk, ck) ** 2)),
        )
    ],
]


def _spd(rng, *shape):
    """Random covariances ``A A^T / d`` (well away from identity), shape
    ``shape + (d, d)``, d = shape[-1]."""
    a = rng.normal(size=shape + (shape[-1],))
    return a @ np.swapaxes(a, -1, -2) / shape[-1] + 0.2 * np.eye(shape[-1])


def score_std_cases() -> list[Case]:
    rng = np.random.default_rng(31)
    return [
        Case(
            "one head, d_k = 5: general covariances, both means nonzero",
            (
                rng.normal(size=5),
                _spd(rng, 5),
                rng.normal(size=5),
                _spd(rng, 5),
            ),
        ),
        # 4 heads of d_k = 4: np.trace over the first two axes still has the
        # shape (4,)
        Case(
            "4 heads, d_k = 4: mu (4, 4), cov (4, 4, 4)",
            (
                rng.normal(size=(4, 4)),
                _spd(rng, 4, 4),
                rng.normal(size=(4, 4)),
                _spd(rng, 4, 4),
            ),
        ),
        Case(
            "3 heads, d_k = 6, float32 inputs",
            tuple(
                x.astype(np.float32)
                for x in (
                    rng.normal(size=(3, 6)),
                    _spd(rng, 3, 6),
                    rng.normal(size=(3, 6)),
                    _spd(rng, 3, 6),
                )
            ),
        ),
        Case(
            "2 x 3 heads (batch, heads), d_k = 8",
            (
                rng.normal(size=(2, 3, 8)),
                _spd(rng, 2, 3, 8),
                rng.normal(size=(2, 3, 8)),
                _spd(rng, 2, 3, 8),
            ),
        ),
        Case(
            "zero means, identity covariances, d_k = 16 (sqrt(d_k) = 4)",
            (np.zeros(16), np.eye(16), np.zeros(16), np.eye(16)),
        ),
        Case(
            "d_k = 1",
            (
                np.array([2.0]),
                np.array([[0.5]]),
                np.array([-1.0]),
                np.array([[3.0]]),
            ),
        ),
    ]


def check_score_std(fn) -> None:
    """Check ``fn(mu_q, cov_q, mu_k, cov_k)`` returns the standard deviation
    of ``q . k`` per leading index, shape ``(...)``."""
    run_checks(
        "the scale for queries and keys with means",
        fn,
        score_std_cases(),
        score_std,
        SCORE_STD_MISTAKES,
        hint="expand q . k with q = mu_q + a, k = mu_k + b, and add the "
        "variances of the terms that vary",
    )
