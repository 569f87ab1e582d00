"""Chapter 3's checkers: the reference passes, every classic mistake is
rejected and named.

The wrong implementations here are written independently of the checkers'
``Mistake`` functions (as a reader would write them), so a test fails if a
diagnosis stops matching.
"""

import math

import numpy as np
import pytest
import torch

from attnbook.exercises import ExerciseError, NotAttemptedError
from attnbook.exercises.scaling import (
    DOT_VARIANCE_MISTAKES,
    SCALED_SCORES_MISTAKES,
    SCORE_STD_MISTAKES,
    check_dot_variance,
    check_scaled_scores,
    check_score_std,
)
from attnbook.scaling import score_std


# --- check_scaled_scores -----------------------------------------------------


def scores_reference(q, k):
    return np.einsum("...id,...jd->...ij", q, k) / math.sqrt(q.shape[-1])


def scores_in_torch(q, k):
    q, k = torch.from_numpy(q), torch.from_numpy(k)
    # returns a tensor: accepted too
    return q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5


def scores_scaling_q_first(q, k):
    # equivalent, so correct
    return (q / np.sqrt(q.shape[-1])) @ np.swapaxes(k, -1, -2)


WRONG_SCORES = {
    "no_scale": lambda q, k: np.einsum("...id,...jd->...ij", q, k),
    "scale_by_dk": lambda q, k: (
        (q / math.sqrt(q.shape[-1]))
        @ np.swapaxes(k / math.sqrt(k.shape[-1]), -1, -2)
    ),
    "times_sqrt_dk": lambda q, k: (
        np.einsum("...id,...jd->...ij", q, k) * q.shape[-1] ** 0.5
    ),
    "precedence": lambda q, k: (
        q @ np.swapaxes(k, -1, -2) / q.shape[-1] ** 1 / 2
    ),
    "precedence_half": lambda q, k: (
        q @ np.swapaxes(k, -1, -2) / (q.shape[-1] ** 1 / 2)
    ),
    "sqrt_n_k": lambda q, k: q @ np.swapaxes(k, -1, -2) / math.sqrt(len(k)),
    "sqrt_n_q": lambda q, k: q @ k.T / math.sqrt(len(q)),
    "second_axis": lambda q, k: (
        q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[1])
    ),
    "transposed": lambda q, k: (
        np.swapaxes(np.einsum("...id,...jd->...ij", q, k), -1, -2)
        / math.sqrt(q.shape[-1])
    ),
    "cosine": lambda q, k: (
        np.einsum("...id,...jd->...ij", q, k)
        / np.outer(np.sqrt((q**2).sum(-1)), np.sqrt((k**2).sum(-1)))
    ),
}


@pytest.mark.parametrize(
    "fn", [scores_reference, scores_in_torch, scores_scaling_q_first]
)
def test_correct_scaled_scores_pass(fn, capsys):
    check_scaled_scores(fn)
    assert (
        "Correct: scaled scores passes all 7 cases." in capsys.readouterr().out
    )


@pytest.mark.parametrize("key", sorted(WRONG_SCORES))
def test_each_scores_mistake_is_rejected_and_named(key):
    with pytest.raises(ExerciseError) as err:
        check_scaled_scores(WRONG_SCORES[key])
    assert err.value.mistake == key, str(err.value)
    assert "Hint:" in str(err.value)


def test_every_scores_mistake_is_covered():
    assert {m.key for m in SCALED_SCORES_MISTAKES} == set(WRONG_SCORES)


def test_scores_stub_and_unrecognised_errors():
    def stub(q, k):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError, match="still the stub"):
        check_scaled_scores(stub)
    # wrong in a way no Mistake describes
    with pytest.raises(ExerciseError) as err:
        check_scaled_scores(lambda q, k: scores_reference(q, k) + 1.0)
    assert err.value.mistake is None and "values differ" in str(err.value)
    # q^T k on matrices: (d_k, d_k)
    with pytest.raises(ExerciseError, match="expected shape"):
        check_scaled_scores(
            lambda q, k: q.T @ k[: len(q)] / math.sqrt(q.shape[-1])
        )


def test_k_dot_T_on_a_batch_is_reported_not_crashed():
    # k.T reverses every axis of a 3-d array; the matmul then fails on the
    # batch case
    with pytest.raises(
        ExerciseError, match="a batch of 2.*your function raised"
    ) as err:
        check_scaled_scores(lambda q, k: q @ k.T / math.sqrt(q.shape[-1]))
    assert "Hint: the shapes do not fit" in str(
        err.value
    ) and "np.swapaxes(k, -1, -2)" in str(err.value)


# --- check_dot_variance ------------------------------------------------------


def variance_by_loops(cq, ck):
    d = len(cq)
    return sum(cq[i][j] * ck[j][i] for i in range(d) for j in range(d))


WRONG_VARIANCES = {
    "diagonal_only": lambda cq, ck: sum(
        cq[i, i] * ck[i, i] for i in range(len(cq))
    ),
    "trace_product": lambda cq, ck: np.diag(cq).sum() * np.diag(ck).sum(),
    "average_variances": lambda cq, ck: (
        np.mean(np.diag(cq)) * np.mean(np.diag(ck)) * len(cq)
    ),
    "std": lambda cq, ck: math.sqrt(np.einsum("ij,ji->", cq, ck)),
    "frobenius": lambda cq, ck: math.sqrt(
        sum(v * v for v in (cq @ ck).ravel())
    ),
    "sum_of_product": lambda cq, ck: (cq @ ck).sum(),
    "d_k_only": lambda cq, ck: len(cq),
}


@pytest.mark.parametrize(
    "fn",
    [
        variance_by_loops,
        lambda cq, ck: np.trace(cq @ ck),
        # a 0-d tensor
        lambda cq, ck: torch.trace(
            torch.from_numpy(cq) @ torch.from_numpy(ck)
        ),
        lambda cq, ck: np.array([np.sum(cq * ck)]),  # a one-element array
    ],
)
def test_correct_variances_pass(fn, capsys):
    check_dot_variance(fn)
    assert (
        "Correct: variance of q . k passes all 5 cases."
        in capsys.readouterr().out
    )


@pytest.mark.parametrize("key", sorted(WRONG_VARIANCES))
def test_each_variance_mistake_is_rejected_and_named(key):
    with pytest.raises(ExerciseError) as err:
        check_dot_variance(WRONG_VARIANCES[key])
    assert err.value.mistake == key, str(err.value)


def test_every_variance_mistake_is_covered():
    assert {m.key for m in DOT_VARIANCE_MISTAKES} == set(WRONG_VARIANCES)


def test_variance_stub():
    def stub(cq, ck):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_dot_variance(stub)


# --- the catalogue (run by tests/test_exercises_framework.py) ----------------


def scores_in_place(q, k):
    # scales the caller's q: right, and noted
    q /= math.sqrt(q.shape[-1])
    return q @ np.swapaxes(k, -1, -2)


def scores_float32(q, k):
    q, k = np.float32(q), np.float32(k)
    return np.einsum("...id,...jd->...ij", q, k) * np.float32(
        q.shape[-1] ** -0.5
    )


CATALOGUE = {
    "check_scaled_scores": {
        "right": [
            scores_reference,
            scores_in_torch,
            scores_scaling_q_first,
            scores_in_place,
            scores_float32,
        ],
        "wrong": [(WRONG_SCORES[key], key) for key in sorted(WRONG_SCORES)],
    },
    "check_dot_variance": {
        "right": [
            variance_by_loops,
            lambda cq, ck: np.einsum("ij,ji->", cq, ck),
            lambda cq, ck: torch.trace(
                torch.from_numpy(cq) @ torch.from_numpy(ck)
            ),
        ],
        "wrong": [
            (WRONG_VARIANCES[key], key) for key in sorted(WRONG_VARIANCES)
        ],
    },
}


# --- from the expert reading of chapter 3 (checker-findings) -----------------


def variance_of_the_scaled_score(cq, ck):
    # Var(q . k / sqrt(d_k)), not Var(q . k)
    return np.trace(cq @ ck) / cq.shape[0]


def variance_in_place(cq, ck):
    """Right for symmetric covariances (sum_ij Cq_ij Ck_ij = trace(Cq Ck)), and
    changes its input."""
    cq *= ck
    return cq.sum()


def scores_scaled_in_place_and_again(q, k):
    q /= np.sqrt(q.shape[-1])
    # scaled twice: by d_k
    return q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])


# test_every_variance_mistake_is_covered
WRONG_VARIANCES["scaled_variance"] = variance_of_the_scaled_score
CATALOGUE["check_dot_variance"]["wrong"] += [
    (variance_of_the_scaled_score, "scaled_variance")
]
CATALOGUE["check_dot_variance"]["right"] += [variance_in_place]
CATALOGUE["check_scaled_scores"]["wrong"] += [
    (scores_scaled_in_place_and_again, "scale_by_dk")
]


# --- from the second expert reading of chapter 3 -----------------------------


def scores_scale_first_with_precedence_slip(q, k):
    d_k = q.shape[-1]
    # (d_k ** 1) / 2 = d_k / 2, not sqrt(d_k)
    scale = d_k**1 / 2
    return q @ np.swapaxes(k, -1, -2) / scale


def scores_d_k_from_the_second_axis(q, k):
    # d_k on a matrix, n_q on a batch
    return q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[1])


def scores_one_leading_axis_only(q, k):
    # raises on (batch, heads, n, d)
    kt = k.T if k.ndim == 2 else k.transpose(0, 2, 1)
    return q @ kt / np.sqrt(q.shape[-1])


def test_d_k_over_two_is_named_as_precedence():
    with pytest.raises(ExerciseError) as err:
        check_scaled_scores(scores_scale_first_with_precedence_slip)
    assert err.value.mistake == "precedence_half" and "d_k / 2" in str(
        err.value
    )


def test_d_k_from_q_shape_1_is_named():
    # right on every 2-d case, so only a mistake that is right there too can
    # name it
    with pytest.raises(ExerciseError) as err:
        check_scaled_scores(scores_d_k_from_the_second_axis)
    assert err.value.mistake == "second_axis" and "q.shape[-1]" in str(
        err.value
    )


def test_more_than_one_leading_dimension_is_checked():
    with pytest.raises(
        ExerciseError, match="three leading dimensions.*your function raised"
    ) as err:
        check_scaled_scores(scores_one_leading_axis_only)
    assert err.value.mistake == "fixed_rank_transpose", str(err.value)
    q, k = np.ones((2, 3, 4, 16)), np.ones((2, 3, 5, 16))
    # it really fails on a (batch, heads, n, d_k) input
    with pytest.raises(ValueError):
        scores_one_leading_axis_only(q, k)


def scores_with_mT_in_torch(q, k):
    q, k = torch.from_numpy(q).float(), torch.from_numpy(k).float()
    return q @ k.mT / math.sqrt(q.shape[-1])


def test_right_alternatives_still_pass_with_two_leading_dimensions(capsys):
    for fn in (
        scores_reference,
        scores_in_torch,
        scores_scaling_q_first,
        scores_with_mT_in_torch,
        lambda q, k: np.einsum(
            "...id,...jd->...ij", q / np.sqrt(q.shape[-1]), k
        ),
    ):
        check_scaled_scores(fn)
        assert "passes all 7 cases" in capsys.readouterr().out


CATALOGUE["check_scaled_scores"]["wrong"] += [
    (scores_scale_first_with_precedence_slip, "precedence_half"),
    (scores_d_k_from_the_second_axis, "second_axis"),
]
CATALOGUE["check_scaled_scores"]["right"] += [scores_with_mT_in_torch]


# --- from the third expert reading of chapter 3: an integer square root ------
# Every case of the old checker had a perfect-square d_k (16, 64, 256, 1, 9,
# 16), so these passed it.


def scores_int_of_sqrt(q, k):
    return q @ np.swapaxes(k, -1, -2) / int(np.sqrt(q.shape[-1]))


def scores_isqrt(q, k):
    return q @ np.swapaxes(k, -1, -2) / math.isqrt(q.shape[-1])


def scores_rounded_sqrt(q, k):
    return q @ np.swapaxes(k, -1, -2) / round(q.shape[-1] ** 0.5)


@pytest.mark.parametrize(
    "fn", [scores_int_of_sqrt, scores_isqrt, scores_rounded_sqrt]
)
def test_an_integer_square_root_is_rejected_and_named(fn):
    with pytest.raises(ExerciseError) as err:
        check_scaled_scores(fn)
    assert err.value.mistake == "integer_sqrt", str(err.value)
    assert "d_k = 128" in str(err.value) and "Hint:" in str(err.value)


def test_right_answers_pass_the_case_with_d_k_128(capsys):
    for fn in (
        scores_reference,
        scores_in_torch,
        scores_scaling_q_first,
        scores_with_mT_in_torch,
        scores_float32,
        lambda q, k: q @ np.swapaxes(k, -1, -2) * q.shape[-1] ** -0.5,
        lambda q, k: q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1]),
    ):
        check_scaled_scores(fn)
        assert "passes all 7 cases" in capsys.readouterr().out


# test_every_scores_mistake_is_covered
WRONG_SCORES["integer_sqrt"] = scores_isqrt
CATALOGUE["check_scaled_scores"]["wrong"] += [
    (scores_int_of_sqrt, "integer_sqrt"),
    (scores_isqrt, "integer_sqrt"),
    (scores_rounded_sqrt, "integer_sqrt"),
]


# --- from the fourth expert reading of chapter 3: np.dot / np.inner on a -----
# batch. On matrices they are the matrix product; on a batch np.dot and
# np.inner pair every query with the keys of every batch entry (shape
# (..., n_q, ..., n_k)), and np.dot(q, k.T) raises. The old checker rejected
# them with no diagnosis.


def scores_np_dot_swapped(q, k):
    return np.dot(q, np.swapaxes(k, -1, -2)) / np.sqrt(q.shape[-1])


def scores_np_inner(q, k):
    return np.inner(q, k) / math.sqrt(q.shape[-1])


def scores_np_dot_k_dot_T(q, k):
    # raises on a batch: k.T reverses every axis, and np.dot does not batch
    return np.dot(q, k.T) / math.sqrt(q.shape[-1])


def scores_np_tensordot(q, k):
    # contracts the last axes, but pairs every batch entry with every other
    return np.tensordot(q, k, axes=(-1, -1)) / np.sqrt(q.shape[-1])


def scores_np_dot_per_matrix(q, k):
    # right: one np.dot per matrix of the batch
    d_k = q.shape[-1]
    qs = q.reshape(-1, *q.shape[-2:])
    ks = k.reshape(-1, *k.shape[-2:])
    out = np.stack([np.dot(a, b.T) for a, b in zip(qs, ks)])
    return out.reshape(*q.shape[:-1], k.shape[-2]) / np.sqrt(d_k)


@pytest.mark.parametrize(
    "fn",
    [
        scores_np_dot_swapped,
        scores_np_inner,
        scores_np_dot_k_dot_T,
        scores_np_tensordot,
    ],
)
def test_np_dot_or_inner_on_a_batch_is_named(fn):
    with pytest.raises(ExerciseError) as err:
        check_scaled_scores(fn)
    assert err.value.mistake == "batched_dot", str(err.value)
    assert "a batch of 2" in str(err.value)
    assert "Hint:" in str(err.value) and "np.swapaxes(k, -1, -2)" in str(
        err.value
    )


def test_np_dot_without_transpose_on_matrices_is_not_batched_dot():
    # np.dot's shape error on two matrices is a missing transpose, not this
    with pytest.raises(ExerciseError) as err:
        check_scaled_scores(lambda q, k: np.dot(q, k) / np.sqrt(q.shape[-1]))
    assert err.value.mistake is None and "not aligned" in str(err.value)


def test_np_dot_and_np_inner_where_right_still_pass(capsys):
    for fn in (
        scores_np_dot_per_matrix,
        scores_reference,
        scores_in_torch,
    ):
        check_scaled_scores(fn)
        assert "passes all 7 cases" in capsys.readouterr().out


# test_every_scores_mistake_is_covered
WRONG_SCORES["batched_dot"] = scores_np_inner
CATALOGUE["check_scaled_scores"]["wrong"] += [
    (scores_np_dot_swapped, "batched_dot"),
    (scores_np_inner, "batched_dot"),
    (scores_np_dot_k_dot_T, "batched_dot"),
    (scores_np_tensordot, "batched_dot"),
]
CATALOGUE["check_scaled_scores"]["right"] += [scores_np_dot_per_matrix]


# --- from the third expert reading of chapter 3 ------------------------------


def scores_d_k_from_k_shape_1(q, k):
    # d_k on a 2-d k; n_k (or the heads) on a batch
    d_k = k.shape[1]
    return q @ np.swapaxes(k, -1, -2) / d_k**0.5


def scores_softmax_by_hand(q, k):
    # went one step too far: the attention weights
    s = np.einsum("...qd,...kd->...qk", q, k) / np.sqrt(q.shape[-1])
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


WRONG_SCORES["k_second_axis"] = scores_d_k_from_k_shape_1
WRONG_SCORES["softmax_weights"] = scores_softmax_by_hand
CATALOGUE["check_scaled_scores"]["wrong"] += [
    (scores_d_k_from_k_shape_1, "k_second_axis"),
    (scores_softmax_by_hand, "softmax_weights"),
]


def test_k_shape_1_and_softmax_weights_are_named():
    for fn, key, words in (
        (scores_d_k_from_k_shape_1, "k_second_axis", "k.shape[1]"),
        (scores_softmax_by_hand, "softmax_weights", "softmax weights"),
    ):
        with pytest.raises(ExerciseError) as err:
            check_scaled_scores(fn)
        assert err.value.mistake == key and words in str(err.value)


# --- check_score_std (hard): queries and keys with means ---------------------


def std_by_loops(mu_q, cov_q, mu_k, cov_k):
    """Per head, with explicit loops over the components: right."""
    mu_q, cov_q, mu_k, cov_k = (
        np.asarray(x, dtype=np.float64) for x in (mu_q, cov_q, mu_k, cov_k)
    )
    lead = mu_q.shape[:-1]
    d = mu_q.shape[-1]
    out = np.empty(lead)
    for idx in np.ndindex(*lead):
        mq, cq, mk, ck = mu_q[idx], cov_q[idx], mu_k[idx], cov_k[idx]
        var = 0.0
        for i in range(d):
            for j in range(d):
                var += cq[i, j] * ck[j, i]
                var += mq[i] * ck[i, j] * mq[j] + mk[i] * cq[i, j] * mk[j]
        out[idx] = math.sqrt(var)
    return out


def std_in_torch(mu_q, cov_q, mu_k, cov_k):
    """float32 torch, a tensor returned: right."""
    mq, cq, mk, ck = (
        torch.from_numpy(np.asarray(x, dtype=np.float32))
        for x in (mu_q, cov_q, mu_k, cov_k)
    )
    trace = (cq * ck.mT).sum((-2, -1))
    var = (
        trace
        + (mq[..., None, :] @ ck @ mq[..., :, None])[..., 0, 0]
        + (mk[..., None, :] @ cq @ mk[..., :, None])[..., 0, 0]
    )
    return var.sqrt()


def std_in_place(mu_q, cov_q, mu_k, cov_k):
    """Right, and overwrites cov_q (noted, not failed)."""
    mean_terms = np.einsum("...i,...ij,...j->...", mu_q, cov_k, mu_q)
    mean_terms += np.einsum("...i,...ij,...j->...", mu_k, cov_q, mu_k)
    cov_q *= np.swapaxes(cov_k, -1, -2)
    return np.sqrt(cov_q.sum((-2, -1)) + mean_terms)


def std_zero_mean_only(mu_q, cov_q, mu_k, cov_k):
    # the chapter's trace(Cq Ck), the means forgotten
    return np.sqrt(np.einsum("...ij,...ji->...", cov_q, cov_k))


def std_root_mean_square(mu_q, cov_q, mu_k, cov_k):
    # E[(q . k)^2]: the mean of the score kept in
    second = (
        np.einsum("...ij,...ji->...", cov_q, cov_k)
        + np.einsum("...i,...ij,...j->...", mu_q, cov_k, mu_q)
        + np.einsum("...i,...ij,...j->...", mu_k, cov_q, mu_k)
        + np.sum(mu_q * mu_k, axis=-1) ** 2
    )
    return np.sqrt(second)


def std_means_own_covariance(mu_q, cov_q, mu_k, cov_k):
    # "the spread of q's mean is measured by q's covariance"
    var = (cov_q * np.swapaxes(cov_k, -1, -2)).sum((-2, -1))
    var = var + (mu_q * (cov_q @ mu_q[..., None])[..., 0]).sum(-1)
    var = var + (mu_k * (cov_k @ mu_k[..., None])[..., 0]).sum(-1)
    return np.sqrt(var)


def std_query_mean_only(mu_q, cov_q, mu_k, cov_k):
    # thought only the query's mean moves the score against varying keys
    var = np.einsum("...ij,...ji->...", cov_q, cov_k)
    var = var + np.einsum("...i,...ij,...j->...", mu_q, cov_k, mu_q)
    return np.sqrt(var)


def std_key_mean_only(mu_q, cov_q, mu_k, cov_k):
    # thought only the key's mean moves the score against varying queries
    var = np.einsum("...ij,...ji->...", cov_q, cov_k)
    var = var + np.einsum("...i,...ij,...j->...", mu_k, cov_q, mu_k)
    return np.sqrt(var)


def std_traces_multiplied(mu_q, cov_q, mu_k, cov_k):
    tq = np.diagonal(cov_q, axis1=-2, axis2=-1).sum(-1)
    tk = np.diagonal(cov_k, axis1=-2, axis2=-1).sum(-1)
    var = (
        tq * tk
        + np.einsum("...i,...ij,...j->...", mu_q, cov_k, mu_q)
        + np.einsum("...i,...ij,...j->...", mu_k, cov_q, mu_k)
    )
    return np.sqrt(var)


def std_with_d_k(mu_q, cov_q, mu_k, cov_k):
    # remembered "Var = d_k" for the zero-mean part
    d_k = mu_q.shape[-1]
    return np.sqrt(
        d_k
        + np.einsum("...i,...ij,...j->...", mu_q, cov_k, mu_q)
        + np.einsum("...i,...ij,...j->...", mu_k, cov_q, mu_k)
    )


def std_no_square_root(mu_q, cov_q, mu_k, cov_k):
    return (
        np.einsum("...ij,...ji->...", cov_q, cov_k)
        + np.einsum("...i,...ij,...j->...", mu_q, cov_k, mu_q)
        + np.einsum("...i,...ij,...j->...", mu_k, cov_q, mu_k)
    )


def std_with_np_trace(mu_q, cov_q, mu_k, cov_k):
    # np.trace on a stack: the diagonal over axes 0 and 1, one per column
    mean_terms = np.sum(mu_q * (mu_q[..., None, :] @ cov_k)[..., 0, :], -1)
    mean_terms += np.sum(mu_k * (mu_k[..., None, :] @ cov_q)[..., 0, :], -1)
    return np.sqrt(np.trace(cov_q @ cov_k) + mean_terms)


def std_as_python_float(mu_q, cov_q, mu_k, cov_k):
    # one number to return, as for the one-head case: float() of the sum
    var = (
        np.einsum("...ij,...ji->...", cov_q, cov_k)
        + np.einsum("...i,...ij,...j->...", mu_q, cov_k, mu_q)
        + np.einsum("...i,...ij,...j->...", mu_k, cov_q, mu_k)
    )
    return float(np.sqrt(var).sum())


def std_of_the_whole_stack(mu_q, cov_q, mu_k, cov_k):
    # the variances of all heads added up, then one square root
    var = (
        np.einsum("...ij,...ji->...", cov_q, cov_k)
        + np.einsum("...i,...ij,...j->...", mu_q, cov_k, mu_q)
        + np.einsum("...i,...ij,...j->...", mu_k, cov_q, mu_k)
    )
    return np.sqrt(var.sum())


def std_with_batched_matmul(mu_q, cov_q, mu_k, cov_k):
    # mu @ C @ mu.T, right for one head; on a stack mu_q @ cov_k broadcasts
    # the whole (h, d) stack of means as one matrix
    trace = np.einsum("...ij,...ji->...", cov_q, cov_k)
    return np.sqrt(trace + mu_q @ cov_k @ mu_q.T + mu_k @ cov_q @ mu_k.T)


def std_with_both_one_head_formulas(mu_q, cov_q, mu_k, cov_k):
    # student report stud0304: the one-head code, np.trace and mu @ C @ mu,
    # run on a stack of heads
    return np.sqrt(
        np.trace(cov_q @ cov_k) + mu_q @ cov_k @ mu_q + mu_k @ cov_q @ mu_k
    )


def std_with_batched_matmul_in_torch(mu_q, cov_q, mu_k, cov_k):
    # the same slip in torch, without the transpose
    mq, cq, mk, ck = (
        torch.from_numpy(np.asarray(x, dtype=np.float64))
        for x in (mu_q, cov_q, mu_k, cov_k)
    )
    trace = torch.diagonal(cq @ ck, dim1=-2, dim2=-1).sum(-1)
    return torch.sqrt(trace + mq @ ck @ mq + mk @ cq @ mk)


def test_score_std_reference_against_monte_carlo():
    """The package's formula against a float64 Monte Carlo estimate, with a
    margin of 5 standard errors of the sample variance."""
    rng = np.random.default_rng(0)
    d = 6
    a, b = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    cq, ck = a @ a.T / d, b @ b.T / d
    mq, mk = rng.normal(size=d), rng.normal(size=d)
    m = 400_000
    q = rng.multivariate_normal(mq, cq, size=m)
    k = rng.multivariate_normal(mk, ck, size=m)
    s = np.einsum("nd,nd->n", q, k)
    centred = s - s.mean()
    se = np.std(centred**2) / math.sqrt(m)
    predicted = score_std(mq, cq, mk, ck) ** 2
    assert abs(s.var() - predicted) < 5 * se
    # the means matter here: the zero-mean formula is far off
    assert abs(s.var() - np.trace(cq @ ck)) > 20 * se


def test_score_std_shapes_and_errors():
    rng = np.random.default_rng(1)
    mu = rng.normal(size=(2, 3, 4))
    cov = np.broadcast_to(np.eye(4), (2, 3, 4, 4))
    assert score_std(mu, cov, mu, cov).shape == (2, 3)
    assert score_std(np.zeros(9), np.eye(9), np.zeros(9), np.eye(9)) == 3.0
    with pytest.raises(ValueError, match=r"mu_q \(4,\), cov_q \(3, 3\)"):
        score_std(np.zeros(4), np.eye(3), np.zeros(4), np.eye(3))


@pytest.mark.parametrize("fn", [std_by_loops, std_in_torch, std_in_place])
def test_right_score_stds_pass(fn, capsys):
    check_score_std(fn)
    assert "passes all 6 cases" in capsys.readouterr().out


WRONG_STDS = {
    "means_ignored": std_zero_mean_only,
    "second_moment": std_root_mean_square,
    "means_with_own_covariance": std_means_own_covariance,
    "one_mean_term": std_query_mean_only,
    "trace_product": std_traces_multiplied,
    "d_k_for_trace": std_with_d_k,
    "variance": std_no_square_root,
    "trace_over_batch": std_with_np_trace,
    "scalar": std_as_python_float,
    "batched_quadratic_form": std_with_batched_matmul,
    "trace_and_quadratic_over_batch": std_with_both_one_head_formulas,
}


@pytest.mark.parametrize("key", sorted(WRONG_STDS))
def test_each_score_std_mistake_is_rejected_and_named(key):
    with pytest.raises(ExerciseError) as err:
        check_score_std(WRONG_STDS[key])
    assert err.value.mistake == key, str(err.value)
    assert "Hint:" in str(err.value)


def test_keeping_only_the_key_mean_term_is_named_too():
    """Reader ch03-v: the diagnosis names either mean term alone, so a
    solution that keeps mu_k^T Cq mu_k (not mu_q^T Ck mu_q) is named."""
    with pytest.raises(ExerciseError) as err:
        check_score_std(std_key_mean_only)
    assert err.value.mistake == "one_mean_term", str(err.value)


@pytest.mark.parametrize(
    "fn, missing, present",
    [
        (std_query_mean_only, "mu_k^T Cq mu_k", "mu_q^T Ck mu_q"),
        (std_key_mean_only, "mu_q^T Ck mu_q", "mu_k^T Cq mu_k"),
    ],
)
def test_one_mean_term_names_the_term_that_is_missing(fn, missing, present):
    """Student ch03/04 (section 5): the diagnosis of one missing mean term
    says which one is missing, not both candidates."""
    with pytest.raises(ExerciseError) as err:
        check_score_std(fn)
    assert err.value.mistake == "one_mean_term", str(err.value)
    message = str(err.value)
    assert f"mean term {missing} is missing" in message, message
    assert f"mean term {present} is missing" not in message, message


def test_trace_over_batch_message_says_what_np_trace_computes():
    """The diagnosis describes np.trace on a stack correctly: the diagonal
    over the first two axes (head index = row index), summed, one number per
    column; not a sum over those two axes."""
    rng = np.random.default_rng(2)
    stack = rng.normal(size=(3, 5, 5))
    by_column = np.trace(stack)
    assert by_column.shape == (5,)
    np.testing.assert_allclose(
        by_column, sum(stack[i, i, :] for i in range(3))
    )
    assert not np.allclose(by_column, stack.sum(axis=(0, 1)))
    with pytest.raises(ExerciseError) as err:
        check_score_std(std_with_np_trace)
    message = str(err.value)
    assert "diagonal over the FIRST two axes" in message
    assert "one number per column" in message
    assert "sums over the FIRST two axes" not in message


def test_batched_quadratic_form_is_named_in_numpy_and_torch():
    """Reader ch03-z: mu @ C @ mu on a stack of heads got only a shape
    message and the generic hint; it is named, with the per-head einsum."""
    for fn in (std_with_batched_matmul, std_with_batched_matmul_in_torch):
        with pytest.raises(ExerciseError) as err:
            check_score_std(fn)
        assert err.value.mistake == "batched_quadratic_form", str(err.value)
        message = str(err.value)
        assert "'...i,...ij,...j->...'" in message, message
        assert "(h, h, h)" in message, message


def test_every_score_std_mistake_is_covered():
    assert {m.key for m in SCORE_STD_MISTAKES} == set(WRONG_STDS)


def test_score_std_stub():
    def stub(mu_q, cov_q, mu_k, cov_k):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError, match="still the stub"):
        check_score_std(stub)


CATALOGUE["check_score_std"] = {
    "right": [std_by_loops, std_in_torch, std_in_place],
    "wrong": [(WRONG_STDS[key], key) for key in sorted(WRONG_STDS)],
}
CATALOGUE["check_score_std"]["wrong"] += [(std_of_the_whole_stack, "scalar")]
CATALOGUE["check_score_std"]["wrong"] += [(std_key_mean_only, "one_mean_term")]
CATALOGUE["check_score_std"]["wrong"] += [
    (std_with_batched_matmul_in_torch, "batched_quadratic_form")
]


# --- from the student reading of chapters 3 and 4 (s7, section 5): an einsum
# written for matrices failed on the batch with numpy's error and no hint --


def scores_einsum_for_matrices(q, k):
    return np.einsum("qd,kd->qk", q, k) / np.sqrt(q.shape[-1])


def scores_einsum_for_a_batch(q, k):
    # written for (batch, n, d): refuses the matrices of the first case
    return np.einsum("bqd,bkd->bqk", q, k) / np.sqrt(q.shape[-1])


def scores_einsum_for_matrices_in_torch(q, k):
    q, k = torch.from_numpy(q), torch.from_numpy(k)
    return torch.einsum("qd,kd->qk", q, k) / q.shape[-1] ** 0.5


WRONG_SCORES["einsum_without_ellipsis"] = scores_einsum_for_matrices
CATALOGUE["check_scaled_scores"]["wrong"] += [
    (scores_einsum_for_matrices, "einsum_without_ellipsis"),
    (scores_einsum_for_a_batch, "einsum_without_ellipsis"),
    (scores_einsum_for_matrices_in_torch, "einsum_without_ellipsis"),
]


@pytest.mark.parametrize(
    "fn",
    [
        scores_einsum_for_matrices,
        scores_einsum_for_a_batch,
        scores_einsum_for_matrices_in_torch,
    ],
)
def test_an_einsum_without_ellipsis_is_named_with_a_hint(fn):
    with pytest.raises(ExerciseError) as err:
        check_scaled_scores(fn)
    assert err.value.mistake == "einsum_without_ellipsis", str(err.value)
    assert "'...qd,...kd->...qk'" in str(err.value)


def test_both_one_head_formulas_on_a_stack_are_named():
    """Student report stud0304: np.trace(Cq @ Ck) with mu @ C @ mu on a
    stack of heads got only a shape message and the generic hint."""
    with pytest.raises(ExerciseError) as err:
        check_score_std(std_with_both_one_head_formulas)
    message = str(err.value)
    assert err.value.mistake == "trace_and_quadratic_over_batch", message
    assert "np.trace" in message and "(h, h, h)" in message, message


# --- from the student reading of chapter 3 (s12b): a transpose written out ---
# for up to two leading axes. The old checker's deepest case had two leading
# axes (4-d), so this passed although the exercise allows any number.


def scores_up_to_four_dimensions(q, k):
    kt = (
        k.transpose(0, 2, 1)
        if k.ndim == 3
        else (k.T if k.ndim == 2 else k.transpose(0, 1, 3, 2))
    )
    return q @ kt / np.sqrt(q.shape[-1])


def scores_up_to_four_dimensions_in_torch(q, k):
    q, k = torch.from_numpy(q), torch.from_numpy(k)
    if k.dim() == 2:
        kt = k.T
    elif k.dim() == 3:
        kt = k.permute(0, 2, 1)
    else:
        kt = k.permute(0, 1, 3, 2)
    return q @ kt / math.sqrt(q.shape[-1])


def scores_any_leading_axes_by_reshape(q, k):
    # right: fold every leading axis into one, then unfold
    lead = q.shape[:-2]
    qs = q.reshape(-1, *q.shape[-2:])
    ks = k.reshape(-1, *k.shape[-2:])
    out = qs @ ks.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    return out.reshape(*lead, q.shape[-2], k.shape[-2])


WRONG_SCORES["fixed_rank_transpose"] = scores_up_to_four_dimensions
CATALOGUE["check_scaled_scores"]["wrong"] += [
    (scores_up_to_four_dimensions, "fixed_rank_transpose"),
    (scores_up_to_four_dimensions_in_torch, "fixed_rank_transpose"),
    (scores_one_leading_axis_only, "fixed_rank_transpose"),
]
CATALOGUE["check_scaled_scores"]["right"] += [
    scores_any_leading_axes_by_reshape
]


@pytest.mark.parametrize(
    "fn", [scores_up_to_four_dimensions, scores_up_to_four_dimensions_in_torch]
)
def test_a_transpose_written_for_up_to_two_leading_axes_is_named(fn):
    with pytest.raises(ExerciseError) as err:
        check_scaled_scores(fn)
    assert err.value.mistake == "fixed_rank_transpose", str(err.value)
    assert "three leading dimensions" in str(err.value)
    assert "np.swapaxes(k, -1, -2)" in str(err.value)
    # it is right on the 4-d stack the old checker stopped at
    q, k = np.ones((2, 3, 4, 16)), np.ones((2, 3, 5, 16))
    assert np.allclose(fn(q, k), scores_reference(q, k))


def test_a_stack_of_three_leading_axes_passes_right_answers(capsys):
    for fn in (
        scores_reference,
        scores_in_torch,
        scores_any_leading_axes_by_reshape,
        scores_np_dot_per_matrix,
    ):
        check_scaled_scores(fn)
        assert "passes all 7 cases" in capsys.readouterr().out


# --- from the student reading of chapter 3 (s12b): two covariance answers ----
# that got only the generic hint.


def variance_product_of_frobenius_norms(cq, ck):
    return np.linalg.norm(cq) * np.linalg.norm(ck)


def variance_determinant(cq, ck):
    return np.linalg.det(np.asarray(cq) @ np.asarray(ck))


WRONG_VARIANCES["frobenius_product"] = variance_product_of_frobenius_norms
WRONG_VARIANCES["determinant"] = variance_determinant
CATALOGUE["check_dot_variance"]["wrong"] += [
    (variance_product_of_frobenius_norms, "frobenius_product"),
    (variance_determinant, "determinant"),
]


@pytest.mark.parametrize(
    "fn, key",
    [
        (variance_product_of_frobenius_norms, "frobenius_product"),
        (variance_determinant, "determinant"),
        # the reader's other spellings
        (
            lambda cq, ck: math.sqrt((cq**2).sum() * (ck**2).sum()),
            "frobenius_product",
        ),
        (lambda cq, ck: np.linalg.det(cq) * np.linalg.det(ck), "determinant"),
    ],
)
def test_frobenius_product_and_determinant_are_named(fn, key):
    with pytest.raises(ExerciseError) as err:
        check_dot_variance(fn)
    assert err.value.mistake == key, str(err.value)


def test_right_variances_still_pass_with_the_new_mistakes(capsys):
    for fn in (
        variance_by_loops,
        lambda cq, ck: np.einsum("ij,ji->", cq, ck),
        lambda cq, ck: (np.asarray(cq) * np.asarray(ck)).sum(),
    ):
        check_dot_variance(fn)
        assert capsys.readouterr().out.startswith("Correct:")


# --- from the student reading s12t03: a Monte Carlo estimate of Var[q . k] --
# (sampled q and k) is off by its sampling error; no Mistake can commit it
# (its value is random), so the generic hint says the exercise wants the exact
# formula, not only "not its square root".


def variance_by_sampling(cov_q, cov_k):
    rng = np.random.default_rng(0)
    q = rng.multivariate_normal(np.zeros(len(cov_q)), cov_q, size=200_000)
    k = rng.multivariate_normal(np.zeros(len(cov_k)), cov_k, size=200_000)
    return float(np.var(np.sum(q * k, axis=1)))


def test_a_sampled_estimate_gets_the_exact_formula_hint():
    with pytest.raises(ExerciseError) as err:
        check_dot_variance(variance_by_sampling)
    assert err.value.mistake is None, str(err.value)
    assert "not an estimate from sampled q and k" in str(err.value)
