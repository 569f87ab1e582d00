"""The softmax, attention and causal-mask checkers reject each classic mistake
and pass the reference.

The wrong implementations here are written independently of the checkers' own
Mistake functions, the way a reader might write them.
"""

import importlib.util

import numpy as np
import pytest
import torch

from attnbook.exercises import (
    ExerciseError,
    NotAttemptedError,
    check_attention,
    check_causal_mask,
    check_softmax,
)


# --- softmax -----------------------------------------------------------------


def good_softmax(x):
    z = x - np.max(x, axis=-1, keepdims=True)
    z = np.where(np.isnan(z), -np.inf, z)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def overflowing_softmax(x):
    return np.exp(x) / np.exp(x).sum(axis=-1, keepdims=True)


def column_softmax(x):
    e = np.exp(x - x.max(axis=0, keepdims=True))
    return e / e.sum(axis=0, keepdims=True)


def unnormalised_softmax(x):
    return np.exp(x - x.max(axis=-1, keepdims=True))


def whole_matrix_softmax(x):
    e = np.exp(x - np.max(x))
    return e / np.sum(e)


def float64_overflowing_softmax(x):
    # the book's solution with the shift left out
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def whole_array_max_softmax(x):
    # one maximum for every row: what readers write
    e = np.exp(x - np.max(x))
    return e / e.sum(axis=-1, keepdims=True)


def test_softmax_reference_passes(capsys):
    check_softmax(good_softmax)
    assert "Correct" in capsys.readouterr().out


def test_softmax_torch_passes():
    check_softmax(lambda x: torch.softmax(torch.from_numpy(x), dim=-1))


@pytest.mark.parametrize(
    "wrong, key",
    [
        (overflowing_softmax, "unstable"),
        (float64_overflowing_softmax, "unstable"),
        (column_softmax, "wrong_axis"),
        (unnormalised_softmax, "not_normalised"),
        (whole_matrix_softmax, "global_sum"),
        (whole_array_max_softmax, "global_max"),
    ],
)
def test_softmax_mistakes_are_diagnosed(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_softmax(wrong)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value) and "Hint" in str(err.value)


def test_unknown_softmax_error_is_still_rejected():
    with pytest.raises(ExerciseError) as err:
        check_softmax(lambda x: good_softmax(2 * x))
    assert err.value.mistake is None
    assert "case" in str(err.value)


def test_stub_is_reported_as_not_attempted():
    def stub(x):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_softmax(stub)


def test_crashing_function_reports_its_exception():
    with pytest.raises(ExerciseError, match="ZeroDivisionError"):
        check_softmax(lambda x: 1 / 0)


# --- attention ---------------------------------------------------------------


def safe_softmax(x):
    """A softmax whose fully masked rows (every entry -inf) are zeros."""
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0.0))
    total = e.sum(axis=-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def good_attention(q, k, v, mask=None):
    d_k = q.shape[-1]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(d_k)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    return safe_softmax(s) @ v


def good_attention_and_weights(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    w = safe_softmax(s)
    return w @ v, w


def attention_without_scale(q, k, v):
    return good_softmax(q @ k.T) @ v


def attention_divided_by_dk(q, k, v):
    return good_softmax(q @ k.T / q.shape[-1]) @ v


def attention_with_swapped_qk(q, k, v):
    return good_softmax(k @ q.T / np.sqrt(q.shape[-1])) @ v


def attention_softmax_over_queries(q, k, v):
    return column_softmax(q @ k.T / np.sqrt(k.shape[-1])) @ v


def attention_overflowing(q, k, v):
    return overflowing_softmax(q @ k.T / np.sqrt(q.shape[-1])) @ v


def test_attention_reference_passes():
    check_attention(good_attention)


def test_attention_returning_pair_passes():
    check_attention(good_attention_and_weights)


def test_a_pair_whose_weights_are_none_is_refused():
    """(output, None) claims weights it does not hold: refused by name."""
    with pytest.raises(ExerciseError, match=r"pair \(output, None\)"):
        check_attention(
            lambda q, k, v, mask=None: (good_attention(q, k, v, mask), None)
        )


@pytest.mark.parametrize(
    "wrong, key",
    [
        (attention_without_scale, "no_scale"),
        (attention_divided_by_dk, "scale_by_dk"),
        (attention_with_swapped_qk, "swapped_qk"),
        (attention_softmax_over_queries, "wrong_axis"),
        (attention_overflowing, "unstable"),
    ],
)
def test_attention_mistakes_are_diagnosed(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_attention(wrong)
    assert err.value.mistake == key


# --- causal mask -------------------------------------------------------------


def good_mask(n):
    i, j = np.indices((n, n))
    return j <= i


@pytest.mark.parametrize(
    "wrong, key",
    [
        (
            lambda n: np.indices((n, n))[1] < np.indices((n, n))[0],
            "diagonal_hidden",
        ),
        (lambda n: np.indices((n, n))[1] > np.indices((n, n))[0], "inverted"),
        (
            lambda n: np.indices((n, n))[1] >= np.indices((n, n))[0],
            "transposed",
        ),
        (
            lambda n: np.indices((n, n))[1] <= np.indices((n, n))[0] + 1,
            "one_ahead",
        ),
    ],
)
def test_causal_mask_mistakes_are_diagnosed(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_causal_mask(wrong)
    assert err.value.mistake == key


def test_causal_mask_reference_passes_and_integer_masks_are_named():
    check_causal_mask(good_mask)
    # an integer 0/1 mask: attnbook and PyTorch reject it, ~ is bitwise NOT
    with pytest.raises(ExerciseError) as err:
        check_causal_mask(lambda n: np.tril(np.ones((n, n), dtype=int)))
    assert err.value.mistake == "int_mask"
    assert "its pattern is right" in str(err.value)
    check_causal_mask(lambda n: torch.ones(n, n).tril().bool())


def test_a_verdict_renders_in_a_notebook_without_the_checkers_traceback():
    """IPython shows ``_render_traceback_()`` instead of the stack: the
    verdict, and nothing else."""
    with pytest.raises(ExerciseError) as err:
        check_softmax(whole_array_max_softmax)
    shown = err.value._render_traceback_()
    assert shown[0].startswith(
        "ExerciseError: softmax: case"
    ) and "File" not in "\n".join(shown)
    assert any(line.startswith("Diagnosis:") for line in shown) and any(
        line.startswith("Hint:") for line in shown
    )


# --- the catalogue: what students who half-understood chapters 4 and 7 write
# ------------------------------ (run by tests/test_exercises_framework.py,
# which also requires one for every checker)


def softmax_in_place(x):
    """Right, and changes its input: the checker judges the output and says so
    in a note."""
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


def softmax_via_logsumexp(x):
    # float32 stays float32
    x = np.asarray(x)
    m = x.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
    return np.exp(x - lse)


def softmax_mean_shift(x):
    # "any constant works", so the mean
    e = np.exp(x - x.mean(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_min_shift(x):
    e = np.exp(x - x.min(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_sum_without_keepdims(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1)


def softmax_max_without_keepdims(x):
    e = np.exp(x - x.max(axis=-1))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_without_keepdims(x):
    # the most common numpy slip, in both reductions
    e = np.exp(x - x.max(axis=-1))
    return e / e.sum(axis=-1)


def test_forgotten_keepdims_is_named_on_square_and_other_shapes():
    """Silent on a square matrix (wrong values), a broadcast error on any
    other: both verdicts name keepdims."""
    from attnbook.exercises._framework import Case, run_checks
    from attnbook.exercises.attention import SOFTMAX_MISTAKES
    from attnbook.softmax import softmax

    with pytest.raises(ExerciseError) as err:
        check_softmax(softmax_without_keepdims)
    assert err.value.mistake == "forgot_keepdims", str(err.value)
    assert "keepdims=True" in str(err.value)
    for fn in (softmax_without_keepdims, softmax_max_without_keepdims):
        with pytest.raises(ExerciseError) as err:
            run_checks(
                "softmax",
                fn,
                [Case("a 2 x 3 matrix", (np.arange(6.0).reshape(2, 3),))],
                lambda x: softmax(x, axis=-1),
                SOFTMAX_MISTAKES,
            )
        assert "keepdims" in str(err.value), str(err.value)


def softmax_loop_max_from_zero(x):
    out = np.empty_like(x, dtype=float)
    for idx in np.ndindex(x.shape[:-1]):
        # running maximum started at 0
        m = 0.0
        for v in x[idx]:
            m = max(m, v)
        e = np.exp(x[idx] - m)
        out[idx] = e / e.sum()
    return out


def attention_in_place(q, k, v, mask=None):
    # scales the caller's q
    q /= np.sqrt(q.shape[-1])
    s = q @ np.swapaxes(k, -1, -2)
    if mask is not None:
        # broadcast to the scores' whole shape: a mask may have batch axes
        s[~np.broadcast_to(mask, s.shape)] = -np.inf
    return safe_softmax(s) @ v


def attention_einsum_float32(q, k, v, mask=None):
    q, k, v = (np.asarray(t, np.float32) for t in (q, k, v))
    s = np.einsum("...id,...jd->...ij", q, k) / np.float32(
        np.sqrt(q.shape[-1])
    )
    if mask is not None:
        s = np.where(mask, s, np.float32(-np.inf))
    m = s.max(axis=-1, keepdims=True)
    w = np.exp(s - np.where(m == -np.inf, np.float32(0), m))
    w = w / np.maximum(w.sum(axis=-1, keepdims=True), np.float32(1e-30))
    return np.einsum("...ij,...jd->...id", w, v)


CATALOGUE = {
    "check_softmax": {
        "right": [
            good_softmax,
            softmax_in_place,
            softmax_via_logsumexp,
            lambda x: torch.softmax(torch.from_numpy(np.array(x)), dim=-1),
        ],
        "wrong": [
            (overflowing_softmax, "unstable"),
            (column_softmax, "wrong_axis"),
            (unnormalised_softmax, "not_normalised"),
            (whole_matrix_softmax, "global_sum"),
            (whole_array_max_softmax, "global_max"),
            (softmax_mean_shift, "shift_not_max"),
            (softmax_min_shift, "shift_not_max"),
            (softmax_sum_without_keepdims, "no_keepdims"),
            (softmax_max_without_keepdims, "no_keepdims_max"),
            (softmax_loop_max_from_zero, "max_at_least_zero"),
            (softmax_without_keepdims, "forgot_keepdims"),
        ],
    },
    "check_attention": {
        "right": [
            good_attention,
            attention_in_place,
            attention_einsum_float32,
            good_attention_and_weights,
        ],
        "wrong": [
            (attention_without_scale, "no_scale"),
            (attention_divided_by_dk, "scale_by_dk"),
            (attention_with_swapped_qk, "swapped_qk"),
            (attention_softmax_over_queries, "wrong_axis"),
            (attention_overflowing, "unstable"),
            (
                lambda q, k, v: (
                    good_softmax(q @ k.T / np.sqrt(v.shape[1])) @ v
                ),
                "scale_by_sqrt_d_v",
            ),
            (
                lambda q, k, v: good_softmax(q @ k.T / np.sqrt(len(k))) @ v,
                "scale_by_sqrt_n_k",
            ),
            (
                lambda q, k, v: (
                    whole_matrix_softmax(q @ k.T / np.sqrt(q.shape[1])) @ v
                ),
                "global_softmax",
            ),
            (
                lambda q, k, v: (
                    good_softmax(q @ k.T) / np.sqrt(q.shape[1]) @ v
                ),
                "scaled_after_softmax",
            ),
        ],
    },
    "check_causal_mask": {
        "right": [
            good_mask,
            lambda n: torch.ones(n, n).tril().bool(),
            lambda n: np.arange(n)[:, None] >= np.arange(n)[None, :],
        ],
        "wrong": [
            (
                lambda n: np.indices((n, n))[1] < np.indices((n, n))[0],
                "diagonal_hidden",
            ),
            (
                lambda n: np.indices((n, n))[1] > np.indices((n, n))[0],
                "inverted",
            ),
            (
                lambda n: np.indices((n, n))[1] >= np.indices((n, n))[0],
                "transposed",
            ),
            (
                lambda n: np.indices((n, n))[1] <= np.indices((n, n))[0] + 1,
                "one_ahead",
            ),
            (lambda n: np.ones((n, n), dtype=bool), "no_mask"),
            (lambda n: np.eye(n) == 1, "diagonal_only"),
            # additive, and the future
            (lambda n: np.tril(np.full((n, n), -np.inf), k=-1), "transposed"),
        ],
    },
}


def softmax_axis_one(x):
    """Hard-codes axis=1, the last axis of a matrix: wrong on a batch."""
    if x.ndim == 1:
        return softmax_via_logsumexp(x)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


CATALOGUE["check_softmax"]["wrong"].append((softmax_axis_one, "axis_1"))


# --- from the expert readings of chapters 4 and 7 (checker-findings) ---------


def softmax_finite_mean_shift(x):
    """Shifts each row by the mean of its finite entries: right until a row
    spans more than ~1420."""
    finite = np.isfinite(x)
    m = np.where(finite, x, 0).sum(-1, keepdims=True) / np.maximum(
        finite.sum(-1, keepdims=True), 1
    )
    e = np.exp(x - m)
    return e / e.sum(axis=-1, keepdims=True)


def softmax_row_max_whole_sum(x):
    # per-row maximum, but one sum for everything
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum()


def attention_global_max(q, k, v):
    s = q @ k.T / np.sqrt(q.shape[-1])
    # the whole matrix's maximum
    e = np.exp(s - s.max())
    return e / e.sum(axis=-1, keepdims=True) @ v


CATALOGUE["check_softmax"]["wrong"] += [
    (softmax_finite_mean_shift, "shift_not_max"),
    (softmax_row_max_whole_sum, "global_sum"),
]
CATALOGUE["check_attention"]["wrong"] += [(attention_global_max, "global_max")]
CATALOGUE["check_causal_mask"]["wrong"] += [
    # the nanoGPT idiom: float 1.0 / 0.0
    (lambda n: np.tril(np.ones((n, n))), "float_mask"),
    (lambda n: torch.tril(torch.ones(n, n)), "float_mask"),
    # from an additive -1e9 mask, off by one
    (lambda n: np.triu(np.full((n, n), -1e9), k=2) == 0, "one_ahead"),
]
CATALOGUE["check_causal_mask"]["right"] += [
    lambda n: np.triu(np.full((n, n), -1e9), k=1) == 0
]


def test_a_float_causal_mask_is_rejected_because_torch_adds_it():
    with pytest.raises(ExerciseError) as err:
        check_causal_mask(lambda n: np.tril(np.ones((n, n))))
    assert err.value.mistake == "float_mask" and "its pattern is right" in str(
        err.value
    )
    assert "adds a float mask to the scores" in str(err.value)


def test_an_additive_mask_with_a_large_negative_number_is_read_as_additive():
    with pytest.raises(ExerciseError) as err:
        check_causal_mask(lambda n: np.triu(np.full((n, n), -1e9), k=1))
    assert err.value.mistake is None and "your mask is additive" in str(
        err.value
    )
    assert "right as an additive mask" in str(
        err.value
    ) and "mask == 0" in str(err.value)


def softmax_column_max_row_sum(x):
    e = np.exp(x - x.max(axis=0, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_masked_as_zero(x):
    # "-inf breaks exp", so zero it
    x = np.where(np.isneginf(x), 0.0, x)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_shifted_numerator_only(x):
    return np.exp(x - x.max(axis=-1, keepdims=True)) / np.exp(x).sum(
        axis=-1, keepdims=True
    )


CATALOGUE["check_softmax"]["wrong"] += [
    (softmax_column_max_row_sum, "max_axis_0"),
    (softmax_masked_as_zero, "neg_inf_to_zero"),
    (softmax_shifted_numerator_only, "unshifted_denominator"),
]
CATALOGUE["check_attention"]["wrong"] += [
    (lambda q, k, v: (q @ k.T / np.sqrt(q.shape[-1])) @ v, "no_softmax"),
    (
        lambda q, k, v: good_softmax(q @ k.T * np.sqrt(q.shape[-1])) @ v,
        "times_sqrt_dk",
    ),
    (
        lambda q, k, v: good_softmax(q @ k.T / np.sqrt(q.shape[-1])).T @ v,
        "transposed_weights",
    ),
]
CATALOGUE["check_causal_mask"]["wrong"] += [
    (lambda n: np.fliplr(np.tril(np.ones((n, n), dtype=bool))), "flipped"),
    (lambda n: np.tril(np.ones((n, n), dtype=bool), k=2), "two_ahead"),
]


# --- from the second expert reading of chapter 4 (read-s2-ch04) --------------
# Each wrong solution below was accepted, or rejected without a diagnosis or
# with a misleading one, by the checker before this reading.


def softmax_median_shift(x):
    """Accepted before: every case row's top score was within exp's range of
    its median."""
    x = np.asarray(x, dtype=float)
    e = np.exp(x - np.median(x, axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_runner_up_shift(x):
    """Accepted before, like the median shift."""
    if x.shape[-1] == 1:
        return np.ones_like(x)
    e = np.exp(x - np.sort(x, axis=-1)[..., -2:-1])
    return e / e.sum(axis=-1, keepdims=True)


def softmax_first_entry_shift(x):
    e = np.exp(x - x[..., :1])
    return e / e.sum(axis=-1, keepdims=True)


def softmax_finite_min_shift(x):
    """Named before through a chance match with the mean shift, whose
    description it got."""
    m = np.min(np.where(np.isfinite(x), x, np.inf), axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=-1, keepdims=True)


def softmax_mask_as_minus_1e9(x):
    # the "safe" -inf of many codebases
    x = np.where(np.isneginf(x), -1e9, x)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def log_softmax_returned(x):
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def softmax_at_temperature_2(x):
    e = np.exp((x - x.max(axis=-1, keepdims=True)) / 2)
    return e / e.sum(axis=-1, keepdims=True)


def softmax_in_float16(x):
    h = x.astype(np.float16)
    e = np.exp(h - h.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_eps_denominator(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / (e.sum(axis=-1, keepdims=True) + 1e-3)


def softmax_clipped_scores(x):
    # "exp overflows above 88, so clip"
    e = np.exp(np.clip(x, -80, 80))
    return e / e.sum(axis=-1, keepdims=True)


def attention_scaled_by_sqrt_n_q(q, k, v):
    return good_softmax(q @ k.T / np.sqrt(q.shape[0])) @ v


def attention_base_2(q, k, v):
    s = q @ k.T / np.sqrt(q.shape[-1])
    e = 2.0 ** (s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True) @ v


def attention_sqrt_dk_plus_1(q, k, v):
    return good_softmax(q @ k.T / np.sqrt(q.shape[-1] + 1)) @ v


def softmax_copy_in_place_masked_rows(x):
    y = np.array(x, dtype=np.float64, copy=True)
    m = y.max(-1, keepdims=True)
    m[~np.isfinite(m)] = 0
    y -= m
    np.exp(y, out=y)
    with np.errstate(invalid="ignore"):
        y /= y.sum(-1, keepdims=True)
    return y


def softmax_moveaxis(x):
    y = np.moveaxis(np.asarray(x, float), -1, 0)
    e = np.exp(y - y.max(0))
    return np.moveaxis(e / e.sum(0), 0, -1)


def attention_einsum_scipy(q, k, v, mask=None):
    import scipy.special

    s = np.einsum("...qd,...kd->...qk", q, k) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    with np.errstate(invalid="ignore"):
        w = scipy.special.softmax(s, axis=-1)
    # a fully masked row is NaN in scipy: no weight at all
    return np.einsum("...qk,...kd->...qd", np.nan_to_num(w), v)


def attention_torch_sdpa(q, k, v, mask=None):
    t = [torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v)]
    m = None if mask is None else torch.from_numpy(mask)
    return torch.nn.functional.scaled_dot_product_attention(
        *t, attn_mask=m
    ).numpy()


CATALOGUE["check_softmax"]["wrong"] += [
    (softmax_median_shift, "shift_not_max"),
    (softmax_runner_up_shift, "shift_not_max"),
    (softmax_first_entry_shift, "shift_not_max"),
    (softmax_finite_min_shift, "shift_not_max"),
    (softmax_mask_as_minus_1e9, "masked_row_uniform"),
    (log_softmax_returned, "log_softmax"),
    (softmax_at_temperature_2, "temperature_2"),
    (softmax_in_float16, "float16"),
    (softmax_eps_denominator, "eps_denominator"),
    (softmax_clipped_scores, "clipped_scores"),
]
# scipy is no dependency of the book (the minimum environment has none): its
# right answers run where it is installed
HAVE_SCIPY = importlib.util.find_spec("scipy") is not None
CATALOGUE["check_softmax"]["right"] += [
    softmax_copy_in_place_masked_rows,
    softmax_moveaxis,
] + (
    [
        lambda x: np.exp(
            x
            - __import__("scipy.special").special.logsumexp(
                x, axis=-1, keepdims=True
            )
        ),
    ]
    if HAVE_SCIPY
    else []
)
CATALOGUE["check_attention"]["wrong"] += [
    (attention_scaled_by_sqrt_n_q, "scale_by_sqrt_n_q"),
    (attention_base_2, "base_2"),
    (attention_sqrt_dk_plus_1, "scale_by_sqrt_dk_plus_1"),
]
CATALOGUE["check_attention"]["right"] += [
    attention_einsum_scipy
] * HAVE_SCIPY + [
    attention_torch_sdpa,
]


@pytest.mark.parametrize(
    "wrong", [softmax_median_shift, softmax_runner_up_shift]
)
def test_a_shift_by_anything_but_the_max_is_caught_when_the_top_stands_alone(
    wrong,
):
    with pytest.raises(ExerciseError) as err:
        check_softmax(wrong)
    assert err.value.mistake == "shift_not_max"
    assert "one score far above all the others" in str(
        err.value
    ) or "float32 row [0, 100, -5]" in str(err.value)


def test_the_shift_diagnosis_names_no_particular_statistic():
    """It used to say "here the mean of its finite entries" to a reader who
    shifted by the minimum."""
    with pytest.raises(ExerciseError) as err:
        check_softmax(softmax_finite_min_shift)
    assert err.value.mistake == "shift_not_max" and "here the mean" not in str(
        err.value
    )


def test_dividing_by_sqrt_n_q_is_not_called_sqrt_n_k():
    with pytest.raises(ExerciseError) as err:
        check_attention(attention_scaled_by_sqrt_n_q)
    assert (
        err.value.mistake == "scale_by_sqrt_n_q"
        and "number of queries" in str(err.value)
    )


def test_the_minus_1e9_mask_diagnosis_states_the_convention():
    with pytest.raises(ExerciseError) as err:
        check_softmax(softmax_mask_as_minus_1e9)
    assert err.value.mistake == "masked_row_uniform" and "all zeros" in str(
        err.value
    )


# --- from the third expert reading of chapter 7 (s3 reader-ch07) -------------
# The checker rejected this mask before, on its case n = 1, but named no
# mistake ("compare your steps").


def causal_mask_squeezed(n):
    """Built as if for a batch, then squeezed: right for n >= 2, a 0-d array
    for n = 1."""
    i = np.arange(n)
    return np.squeeze(i[None, :] <= i[:, None])


CATALOGUE["check_causal_mask"]["wrong"] += [(causal_mask_squeezed, "squeezed")]


def test_a_mask_wrong_only_for_a_single_position_is_named():
    with pytest.raises(ExerciseError) as err:
        check_causal_mask(causal_mask_squeezed)
    assert (
        err.value.mistake == "squeezed"
        and "n = 1" in str(err.value)
        and "[[True]]" in str(err.value)
    )
    # a squeeze that keeps (n, n)
    check_causal_mask(
        lambda n: np.squeeze(np.tril(np.ones((1, n, n), bool)), axis=0)
    )


@pytest.mark.parametrize("bound", [30, 50, 100])
def test_a_clipped_softmax_is_named_without_a_bound_the_reader_did_not_write(
    bound,
):
    """Clipping at any bound below the cases' largest scores gives one output;
    the diagnosis once quoted the checker's own bound (80 or 700) to a reader
    who had clipped at 30, 50 or 100."""

    def clipped(x):
        e = np.exp(np.clip(x, -bound, bound))
        return e / e.sum(axis=-1, keepdims=True)

    with pytest.raises(ExerciseError) as err:
        check_softmax(clipped)
    assert err.value.mistake == "clipped_scores"
    assert "here to" not in str(err.value) and "+-" not in str(err.value)


# --- from the fourth expert reading of chapter 4 (s4 reader-j-ch04) ----------
# Rejected before with the generic hint only ("compare your steps"): its
# output is 0 (not NaN) where the naive formula overflows, so "unstable" did
# not match.


def softmax_unshifted_logsumexp(x):
    # "log-sum-exp is the stable way", but without the maximum
    lse = np.log(np.sum(np.exp(x), axis=-1, keepdims=True))
    return np.exp(x - lse)


def softmax_unshifted_logsumexp_float64(x):
    x = np.asarray(x, dtype=np.float64)
    return np.exp(x - np.log(np.exp(x).sum(axis=-1, keepdims=True)))


CATALOGUE["check_softmax"]["wrong"] += [
    (softmax_unshifted_logsumexp, "unshifted_logsumexp"),
    (softmax_unshifted_logsumexp_float64, "unshifted_logsumexp"),
]


def softmax_shifted_logsumexp_float32(x):
    """Right: the log-sum-exp with its shift, always in float32, subtracted
    from the shifted scores (exp(y - lse) would round lse, a number as large
    as the maximum, first: 1e-4 off at 2000 in float32)."""
    y = np.asarray(x, dtype=np.float32)
    m = y.max(axis=-1, keepdims=True)
    shifted = y - np.where(np.isfinite(m), m, 0)
    return np.exp(
        shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    )


CATALOGUE["check_softmax"]["right"] += [softmax_shifted_logsumexp_float32]


def test_log_sum_exp_without_the_maximum_is_named_as_the_unstable_formula():
    with pytest.raises(ExerciseError) as err:
        check_softmax(softmax_unshifted_logsumexp)
    assert err.value.mistake == "unshifted_logsumexp"
    assert "in disguise" in str(err.value) and "m + log(sum(exp(x - m)))" in (
        str(err.value)
    )


# --- from the fourth expert reading of chapter 4 (s5 reader-k-ch04) ----------
# The first three wrong solutions passed all eight cases of the checker before
# this reading (C1, C2): its only partly masked rows had finite scores of order
# 3, and its tolerance (atol 1e-6) let a leak of 8e-7 through.


def softmax_masked_filled_with_minus_30(x):
    """C1: -inf replaced by -30, fully masked rows zeroed by hand."""
    y = np.where(np.isneginf(x), -30.0, x)
    e = np.exp(y - y.max(axis=-1, keepdims=True))
    out = e / e.sum(axis=-1, keepdims=True)
    out[np.isneginf(x).all(axis=-1)] = 0.0
    return out


def softmax_masked_filled_with_minus_1e9_loop(x):
    """C1 with the "safe" -1e9 of many codebases, row by row; fully masked
    rows get zeros."""
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx]
        if np.all(np.isneginf(row)):
            continue
        row = np.where(np.isneginf(row), -1e9, row)
        e = np.exp(row - row.max())
        out[idx] = e / e.sum()
    return out


def softmax_exponent_clipped_at_minus_14(x):
    """C2: "exp of a large negative number is useless, clip it"."""
    z = np.maximum(x - x.max(axis=-1, keepdims=True), -14.0)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def softmax_exponent_clipped_both_sides(x):
    z = np.clip(x - np.max(x, axis=-1, keepdims=True), -30, 0)
    return np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)


def softmax_always_float32(x):
    """Right: float32 throughout, on float64 input too (rtol 1e-5 admits
    it)."""
    y = np.asarray(x, dtype=np.float32)
    e = np.exp(y - y.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_divide_where(x):
    """Right: fully masked rows set to zeros with np.divide(where=)."""
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0.0))
    s = e.sum(axis=-1, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


CATALOGUE["check_softmax"]["wrong"] += [
    (softmax_masked_filled_with_minus_30, "finite_mask_fill"),
    (softmax_masked_filled_with_minus_1e9_loop, "finite_mask_fill"),
    (softmax_exponent_clipped_at_minus_14, "floored_exponent"),
    (softmax_exponent_clipped_both_sides, "floored_exponent"),
]
CATALOGUE["check_softmax"]["right"] += [
    softmax_always_float32,
    softmax_divide_where,
]


def test_a_finite_fill_puts_the_weight_on_the_masked_key_of_a_low_row():
    """The case added for C1: on [-1000, -inf, -1001] the -1e9 fill gives
    [0, 1, 0], and the checker says why."""
    with pytest.raises(ExerciseError) as err:
        check_softmax(softmax_masked_filled_with_minus_1e9_loop)
    assert err.value.mistake == "finite_mask_fill"
    assert "masked keys in rows far below 0" in str(err.value)


def test_a_leak_of_8e_7_onto_masked_keys_is_not_within_tolerance():
    """C2: the clipped exponent's error is below the old atol of 1e-6; the
    rule that a zero weight must be zero catches it."""
    x = np.array([[0.0, -np.inf, -np.inf, -np.inf]])
    leak = softmax_exponent_clipped_at_minus_14(x)[0, 1]
    assert 0 < leak < 1e-6
    with pytest.raises(ExerciseError) as err:
        check_softmax(softmax_exponent_clipped_at_minus_14)
    assert err.value.mistake == "floored_exponent"


def test_the_smallest_float64_as_a_fill_is_right_and_accepted(capsys):
    """np.finfo(float64).min as the fill, fully masked rows zeroed: exact
    zeros at -inf wherever a row has a finite score (any above -1.7e308), so
    it is not the finite-fill mistake."""

    def finfo_min_fill(x):
        y = np.where(np.isneginf(x), np.finfo(np.float64).min, x)
        e = np.exp(y - y.max(axis=-1, keepdims=True))
        out = e / e.sum(axis=-1, keepdims=True)
        return np.where(np.isneginf(x).all(-1, keepdims=True), 0.0, out)

    check_softmax(finfo_min_fill)
    assert "Correct" in capsys.readouterr().out


# --- from the student reading of chapters 3 and 4 (issue 31): the exercise
# now takes a batch and a boolean mask ---------------------------------------


def attention_returning_the_weights(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    return safe_softmax(s)


def attention_mask_true_hides(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, -np.inf, s)
    return safe_softmax(s) @ v


def attention_mask_minus_1e9(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -1e9)
    return safe_softmax(s) @ v


def attention_max_trick_nan_rows(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True) @ v


def attention_mask_on_the_weights(q, k, v, mask=None):
    w = safe_softmax(q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]))
    if mask is not None:
        w = w * mask
    return w @ v


def attention_scores_times_mask(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = s * mask
    return safe_softmax(s) @ v


def attention_mask_added(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = s + mask
    return safe_softmax(s) @ v


def attention_loop_over_heads(q, k, v, mask=None):
    # right: one matrix at a time over the leading axes
    out = np.empty(q.shape[:-1] + v.shape[-1:], dtype=np.result_type(q, v))
    n_q, n_k = q.shape[-2], k.shape[-2]
    full = np.ones((n_q, n_k), bool) if mask is None else mask
    # one (n_q, n_k) mask per matrix: a mask may have batch axes
    full = np.broadcast_to(full, q.shape[:-2] + (n_q, n_k))
    for idx in np.ndindex(q.shape[:-2]):
        s = q[idx] @ k[idx].T / np.sqrt(q.shape[-1])
        out[idx] = safe_softmax(np.where(full[idx], s, -np.inf)) @ v[idx]
    return out


CATALOGUE["check_attention"]["wrong"] += [
    (attention_returning_the_weights, "returned_weights"),
    (attention_mask_true_hides, "mask_inverted"),
    (attention_mask_minus_1e9, "masked_row_uniform"),
    (attention_max_trick_nan_rows, "masked_row_nan"),
    (attention_mask_on_the_weights, "mask_after_softmax"),
    (attention_scores_times_mask, "mask_as_zero_score"),
    (attention_mask_added, "mask_added"),
]
CATALOGUE["check_attention"]["right"] += [attention_loop_over_heads]


# --- from the expert reading of chapter 4 (reader s): a mask read as (keys,
# queries), which only a square mask that is not symmetric can show
def attention_mask_read_by_columns(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        if mask.ndim == 2 and mask.shape[0] == mask.shape[1]:
            mask = mask.T
        s = np.where(mask, s, -np.inf)
    return safe_softmax(s) @ v


CATALOGUE["check_attention"]["wrong"] += [
    (attention_mask_read_by_columns, "mask_transposed")
]


# --- from the expert reading of chapter 4 (reader p, E1): the mask applied
# after the softmax and the weights renormalised, which the checker accepted
# (it agrees in exact arithmetic) -------------------------------------------


def attention_mask_after_softmax_renormalised(q, k, v, mask=None):
    w = safe_softmax(q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]))
    if mask is not None:
        w = w * mask
        z = w.sum(axis=-1, keepdims=True)
        w = w / np.where(z == 0, 1, z)
    return w @ v


CATALOGUE["check_attention"]["wrong"] += [
    (
        attention_mask_after_softmax_renormalised,
        "mask_after_softmax_renormalised",
    ),
]


def test_a_renormalised_mask_after_the_softmax_underflows_on_the_last_case():
    with pytest.raises(ExerciseError) as err:
        check_attention(attention_mask_after_softmax_renormalised)
    assert "a masked key with a dominant score" in str(err.value)
    assert "underflow" in str(err.value)


# --- from the expert reading of chapter 7 (E2): integer 0/1 masks ----------


def causal_mask_int_loop(n):
    """0/1 integers filled in a loop: attnbook's attention and PyTorch's SDPA
    reject the dtype, and ~ on it is bitwise NOT."""
    out = np.zeros((n, n), dtype=np.int32)
    for i in range(n):
        out[i, : i + 1] = 1
    return out


CATALOGUE["check_causal_mask"]["wrong"] += [
    (lambda n: np.tril(np.ones((n, n), dtype=int)), "int_mask"),
    (causal_mask_int_loop, "int_mask"),
    (lambda n: torch.ones(n, n, dtype=torch.bool).tril().long(), "int_mask"),
]


def test_an_integer_causal_mask_is_rejected_with_its_reason():
    with pytest.raises(ExerciseError) as err:
        check_causal_mask(causal_mask_int_loop)
    assert err.value.mistake == "int_mask"
    assert "bitwise NOT" in str(err.value) and "astype(bool)" in str(err.value)


# --- from the student reading of chapters 7 and 8 (s12d) ---------------------
# A mask built with a batch axis was rejected with the generic hint.


def causal_mask_for_a_batch(n):
    """Built as the (1, n, n) mask that broadcasts over a batch."""
    i = np.arange(n)
    return (i[None, :] <= i[:, None])[np.newaxis]


CATALOGUE["check_causal_mask"]["wrong"] += [
    (causal_mask_for_a_batch, "batch_axis"),
    (lambda n: torch.ones(n, n).tril().bool().unsqueeze(0), "batch_axis"),
    # batch and heads
    (lambda n: np.tril(np.ones((1, 1, n, n), dtype=bool)), "batch_axis"),
]


def test_a_causal_mask_with_a_batch_axis_is_named():
    with pytest.raises(ExerciseError) as err:
        check_causal_mask(causal_mask_for_a_batch)
    assert err.value.mistake == "batch_axis"
    assert "(1, n, n)" in str(err.value) and "(n, n)" in str(err.value)


# --- from the expert reading of chapter 4 (s6, E1 and section 3) -----------
# E1: check_attention kept only the output of an (output, weights) pair, so
# any weights passed, transposed or not weights at all. Section 3: three
# wrong answers got the generic hint only (no diagnosis).


def attention_pair_transposed_weights(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    w = safe_softmax(s)
    return w @ v, np.swapaxes(w, -1, -2)


def attention_pair_constant_weights(q, k, v, mask=None):
    out, w = good_attention_and_weights(q, k, v, mask)
    return out, np.zeros_like(w) + 123.0


def attention_pair_scores_as_weights(q, k, v, mask=None):
    # "the attention matrix": the scores, returned before the softmax
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    return safe_softmax(scores) @ v, scores


def attention_pair_nan_masked_row(q, k, v, mask=None):
    """Right: the weights NaN on the fully masked query's row (what torch
    gives), the output made 0 there by nan_to_num."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        w = e / e.sum(axis=-1, keepdims=True)
    return np.nan_to_num(w) @ v, w


def attention_pair_float32_cast_back(q, k, v, mask=None):
    """Right: float32 work, output and weights cast back to the inputs'
    dtype."""
    dtype = np.result_type(q, k, v)
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / np.float32(np.sqrt(q.shape[-1]))
    if mask is not None:
        s = np.where(mask, s, np.float32(-np.inf))
    w = safe_softmax(s)
    return (w @ v).astype(dtype), w.astype(dtype)


def softmax_shift_by_largest_magnitude(x):
    # "subtract the largest number in the row", taken as the largest |x|
    m = np.max(np.abs(x), axis=-1, keepdims=True)
    return np.exp(x - m) / np.sum(np.exp(x - m), axis=-1, keepdims=True)


def softmax_naive_nan_to_num(x):
    # "exp overflows to NaN, so clean it up"
    e = np.exp(x)
    return np.nan_to_num(e / e.sum(axis=-1, keepdims=True))


def softmax_naive_exponentials_nan_to_num(x):
    e = np.nan_to_num(np.exp(np.asarray(x, dtype=np.float64)))
    return e / e.sum(axis=-1, keepdims=True)


def attention_scale_precedence_inline(q, k, v, mask=None):
    # d_k**1/2 is d_k / 2: the scores are divided by d_k and then by 2
    s = q @ np.swapaxes(k, -1, -2) / q.shape[-1] ** 1 / 2
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    return safe_softmax(s) @ v


def attention_scale_precedence_variable(q, k, v, mask=None):
    scale = q.shape[-1] ** 1 / 2  # d_k / 2, meant as sqrt(d_k)
    s = q @ np.swapaxes(k, -1, -2) / scale
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    return safe_softmax(s) @ v


CATALOGUE["check_attention"]["wrong"] += [
    (attention_pair_transposed_weights, "weights_transposed"),
    (attention_pair_constant_weights, "weights_not_softmax"),
    (attention_pair_scores_as_weights, "weights_are_scores"),
    (attention_scale_precedence_inline, "scale_precedence"),
    (attention_scale_precedence_variable, "scale_precedence"),
]
CATALOGUE["check_attention"]["right"] += [
    attention_pair_nan_masked_row,
    attention_pair_float32_cast_back,
]
CATALOGUE["check_softmax"]["wrong"] += [
    (softmax_shift_by_largest_magnitude, "shift_not_max"),
    (softmax_naive_nan_to_num, "unstable_nan_hidden"),
    (softmax_naive_exponentials_nan_to_num, "unstable_nan_hidden"),
]


def test_the_weights_of_a_pair_are_checked_and_a_transpose_is_named():
    with pytest.raises(ExerciseError) as err:
        check_attention(attention_pair_transposed_weights)
    assert err.value.mistake == "weights_transposed"
    assert "the output is right" in str(err.value)


def test_a_pair_with_nan_on_the_fully_masked_row_is_accepted(capsys):
    check_attention(attention_pair_nan_masked_row)
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith("the weights it returned included.")
    )


def test_the_output_alone_is_judged_on_the_output(capsys):
    check_attention(good_attention)
    assert capsys.readouterr().out.strip() == (
        "Correct: scaled dot-product attention passes all 9 cases."
    )


# --- from the expert reading of chapter 4 (s6, reader t, E4 and section 3):
# every masked case of check_attention had a 2-D mask, so a mask taken from
# the first batch element only (A-W7) and boolean indexing, which does not
# broadcast (A-W6), passed all six cases; and a softmax shifted by the first
# row's maximum (W7) got the generic hint only.


def attention_mask_of_the_first_sequence(q, k, v, mask=None):
    # "the mask is the same for the whole batch"
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        m = np.asarray(mask)
        if m.ndim > 2:
            m = m[(0,) * (m.ndim - 2)]
        s = np.where(m, s, -np.inf)
    return safe_softmax(s) @ v


def attention_mask_broadcast_to_one_matrix(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(np.broadcast_to(mask, s.shape[-2:]), s, -np.inf)
    return safe_softmax(s) @ v


def attention_boolean_indexing(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s[..., ~mask] = -np.inf
    return safe_softmax(s) @ v


def attention_boolean_indexing_no_ellipsis(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s[~mask] = -np.inf
    return safe_softmax(s) @ v


def attention_torch_boolean_indexing(q, k, v, mask=None):
    q_t, k_t, v_t = (torch.from_numpy(np.asarray(a)) for a in (q, k, v))
    s = q_t @ k_t.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        s[..., ~torch.from_numpy(np.asarray(mask))] = float("-inf")
    return torch.nan_to_num(torch.softmax(s, dim=-1)) @ v_t


def attention_boolean_indexing_broadcast(q, k, v, mask=None):
    """Right: boolean indexing with the mask broadcast to the scores' whole
    shape first."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s[~np.broadcast_to(mask, s.shape)] = -np.inf
    return safe_softmax(s) @ v


def attention_masked_fill_torch(q, k, v, mask=None):
    """Right: torch's masked_fill, which broadcasts the mask, and the rows
    of a query that sees no key set to 0 afterwards."""
    q_t, k_t, v_t = (torch.from_numpy(np.asarray(a)) for a in (q, k, v))
    s = q_t @ k_t.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        s = s.masked_fill(~torch.from_numpy(np.asarray(mask)), float("-inf"))
    return torch.nan_to_num(torch.softmax(s, dim=-1)) @ v_t


def softmax_first_row_max(x):
    # "subtract the max": of the first row, for every row
    m = x.reshape(-1, x.shape[-1])[0].max()
    e = np.exp(x - m)
    return e / e.sum(axis=-1, keepdims=True)


def softmax_first_matrix_max(x):
    m = np.max(x[0])
    return np.exp(x - m) / np.sum(np.exp(x - m), axis=-1, keepdims=True)


CATALOGUE["check_attention"]["wrong"] += [
    (attention_mask_of_the_first_sequence, "mask_not_batched"),
    (attention_mask_broadcast_to_one_matrix, "mask_not_batched"),
    (attention_boolean_indexing, "mask_boolean_index"),
    (attention_boolean_indexing_no_ellipsis, "mask_boolean_index"),
    (attention_torch_boolean_indexing, "mask_boolean_index"),
]
CATALOGUE["check_attention"]["right"] += [
    attention_boolean_indexing_broadcast,
    attention_masked_fill_torch,
]
CATALOGUE["check_softmax"]["wrong"] += [
    (softmax_first_row_max, "first_row_max"),
    (softmax_first_matrix_max, "first_row_max"),
]


def test_a_padding_mask_that_differs_across_the_batch_is_a_case():
    """The padding case's mask (the last but one) has leading axes, differs
    between the two sequences, and hides a key the other sequence may
    see."""
    from attnbook.exercises.attention import attention_cases

    (case,) = [c for c in attention_cases() if "padding mask" in c.name]
    mask = case.kwargs["mask"]
    assert mask.shape == (2, 1, 1, 5) and mask.dtype == bool
    assert not np.array_equal(mask[0], mask[1])
    q, k, v = case.args
    assert q.shape[:2] == (2, 3)


def test_the_first_sequences_mask_is_named_on_the_padding_case():
    with pytest.raises(ExerciseError) as err:
        check_attention(attention_mask_of_the_first_sequence)
    assert "padding mask of shape (2, 1, 1, 5)" in str(err.value)
    assert "not broadcast over the batch" in str(err.value)


def test_boolean_indexing_is_named_by_its_index_error():
    with pytest.raises(ExerciseError) as err:
        check_attention(attention_boolean_indexing)
    assert "IndexError" in str(err.value)
    assert "np.where(mask, s, -np.inf)" in str(err.value)


# --- from the student reading of chapters 3 and 4 (section 5): a mask read
# transposed with .T fails with a shape error on the first masked case, which
# is not square; it is named there too, not only on the causal case ---------


def attention_mask_dot_T(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        # "rows are keys": the mask read as (n_k, n_q)
        s = np.where(mask.T, s, -np.inf)
    return safe_softmax(s) @ v


def attention_mask_swapaxes_weights_pair(q, k, v, mask=None):
    s = np.einsum("...qd,...kd->...qk", q, k) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(np.swapaxes(mask, -1, -2), s, -np.inf)
    w = safe_softmax(s)
    return w @ v, w


@pytest.mark.parametrize(
    "fn", [attention_mask_dot_T, attention_mask_swapaxes_weights_pair]
)
def test_a_transposed_mask_is_named_on_the_non_square_case(fn):
    with pytest.raises(ExerciseError) as err:
        check_attention(fn)
    assert err.value.mistake == "mask_transposed", str(err.value)
    assert "n_q = 3, n_k = 5" in err.value.case
    assert "read transposed" in str(err.value)


def test_other_broadcast_errors_are_not_named_a_transposed_mask():
    """A softmax that lost its keepdims fails with a broadcast error on a
    batch too; that is not the mask."""

    def attention_no_keepdims(q, k, v, mask=None):
        s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
        if mask is not None:
            s = np.where(mask, s, -np.inf)
        e = np.exp(s - s.max(axis=-1))
        return e / e.sum(axis=-1) @ v

    with pytest.raises(ExerciseError) as err:
        check_attention(attention_no_keepdims)
    assert err.value.mistake != "mask_transposed", str(err.value)


CATALOGUE["check_attention"]["wrong"] += [
    (attention_mask_dot_T, "mask_transposed"),
    (attention_mask_swapaxes_weights_pair, "mask_transposed"),
]


# --- from the expert reading of chapter 4 (s7, reader v, E3 and E4): a
# softmax that flushes the weights below 1e-5 to zero, and attention with a
# finite fill for -inf (fully masked rows zeroed), passed every case of the
# old checkers: no float64 softmax case held a weight between about 1e-300
# and 1e-5, and no attention case had a visible score far below 0.


def softmax_flushing_below_1e_8(x):
    """E3: "weights this small are noise"; rows no longer sum to 1."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    return np.where(p < 1e-8, 0, p)


def softmax_flushing_below_1e_5_loop(x):
    """E3 with the largest threshold the old checker let through, row by
    row, with the fully masked rows left as NaN."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        e = np.exp(x[idx] - x[idx].max())
        p = e / e.sum()
        p[p < 1e-5] = 0.0
        out[idx] = p
    return out


def attention_fill_minus_15(q, k, v, mask=None):
    """E4: masked scores -15, queries that see no key given zeros."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is None:
        return safe_softmax(s) @ v
    s = np.where(mask, s, -15.0)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    w = e / e.sum(axis=-1, keepdims=True)
    w = np.where(np.any(mask, axis=-1, keepdims=True), w, 0.0)
    return w @ v


def attention_fill_minus_1e9_pair(q, k, v, mask=None):
    """E4 with the -1e9 of many codebases, returning (output, weights)."""
    s = np.einsum("...qd,...kd->...qk", q, k) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -1e9)
    w = safe_softmax(s)
    if mask is not None:
        seen = np.broadcast_to(mask, s.shape).any(axis=-1, keepdims=True)
        w = w * seen
    return w @ v, w


CATALOGUE["check_softmax"]["wrong"] += [
    (softmax_flushing_below_1e_8, "flushed_small_weights"),
    (softmax_flushing_below_1e_5_loop, "flushed_small_weights"),
]
CATALOGUE["check_attention"]["wrong"] += [
    (attention_fill_minus_15, "finite_mask_fill"),
    (attention_fill_minus_1e9_pair, "finite_mask_fill"),
]


@pytest.mark.parametrize(
    "fn", [softmax_flushing_below_1e_8, softmax_flushing_below_1e_5_loop]
)
def test_flushed_small_weights_are_named_on_the_last_case(fn):
    with pytest.raises(ExerciseError) as err:
        check_softmax(fn)
    assert err.value.mistake == "flushed_small_weights", str(err.value)
    assert "[[0, -12, -25, -26, -27, -27.6]]" in err.value.case


def test_flushing_only_below_float64_atol_is_not_a_mistake(capsys):
    """Zeroing weights below 1e-13 changes no weight by more than the
    float64 atol 1e-12: accepted, as float32 rounding is."""

    def flush_below_1e_13(x):
        return np.where((p := good_softmax(x)) < 1e-13, 0.0, p)

    check_softmax(flush_below_1e_13)
    assert "passes all 11 cases" in capsys.readouterr().out


@pytest.mark.parametrize(
    "fn", [attention_fill_minus_15, attention_fill_minus_1e9_pair]
)
def test_a_finite_mask_fill_is_named_on_a_low_visible_score(fn):
    with pytest.raises(ExerciseError) as err:
        check_attention(fn)
    assert err.value.mistake == "finite_mask_fill", str(err.value)
    assert "a visible key far below 0" in err.value.case


def test_a_fill_below_every_visible_score_is_accepted(capsys):
    """np.finfo(float64).min as the fill, the dead queries zeroed: exact
    zeros at every masked key, so it is right."""

    def attention_finfo_min_fill(q, k, v, mask=None):
        s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
        if mask is None:
            return safe_softmax(s) @ v
        w = safe_softmax(np.where(mask, s, np.finfo(np.float64).min))
        return np.where(np.any(mask, -1, keepdims=True), w, 0.0) @ v

    check_attention(attention_finfo_min_fill)
    assert "passes all 9 cases" in capsys.readouterr().out


def test_returned_weights_must_be_exactly_zero_at_masked_keys():
    """A pair whose output is the reference's but whose weights leak 1e-20
    onto the masked keys is rejected: a masked key's weight is exactly 0."""
    from attnbook.attention import scaled_dot_product_attention

    def attention_leaky_weights(q, k, v, mask=None):
        out, w = scaled_dot_product_attention(q, k, v, mask=mask)
        if mask is not None:
            hidden = ~np.broadcast_to(mask, w.shape)
            w = np.where(hidden & np.any(~hidden, -1, keepdims=True), 1e-20, w)
        return out, w

    with pytest.raises(ExerciseError) as err:
        check_attention(attention_leaky_weights)
    assert err.value.mistake == "weights_not_softmax", str(err.value)


# --- from the fifth expert reading of chapter 4 (s8 reader ch04-x) ----------
# The unstable softmax with a guard against a zero sum (so that a fully masked
# row gives zeros, not NaN) was rejected with the generic hint only: its NaN
# rows differ from the unguarded formula's, so "unstable" did not match.


def attention_unstable_zero_sum_guard(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    with np.errstate(all="ignore"):
        e = np.exp(s)
        z = e.sum(axis=-1, keepdims=True)
        w = np.divide(e, z, out=np.zeros_like(e), where=z > 0)
    return w @ v


def attention_unstable_zero_sum_guard_float64(q, k, v, mask=None):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    return attention_unstable_zero_sum_guard(q, k, v, mask)


CATALOGUE["check_attention"]["wrong"] += [
    (attention_unstable_zero_sum_guard, "unstable"),
    (attention_unstable_zero_sum_guard_float64, "unstable"),
]


def test_guarded_unstable_softmax_is_named():
    with pytest.raises(ExerciseError) as err:
        check_attention(attention_unstable_zero_sum_guard)
    assert err.value.mistake == "unstable"
    assert "zero sum" in str(err.value)


# --- from the sixth expert reading of chapter 4 (s8 reader ch04-y): a fill
# below the lowest visible score of every case (-2e9) passed both checkers
# when the fully masked rows were zeroed, and without the zeroing the
# attention checker gave no diagnosis for a fill below -2e9. The cases now go
# down to -3e10; a fill below every score a row holds (-1e30, finfo's min)
# gives exact zeros there and passes, as the exercise says -----------------


def softmax_low_fill_zeroed(x, fill=-1e10):
    x = np.asarray(x, dtype=np.float64)
    full = np.all(np.isneginf(x), axis=-1, keepdims=True)
    x = np.where(np.isneginf(x), fill, x)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return np.where(full, 0.0, e / e.sum(axis=-1, keepdims=True))


def softmax_fill_1e30_zeroed(x):
    """Exact for every row whose scores lie above -1e30, every case's."""
    return softmax_low_fill_zeroed(x, fill=-1e30)


def softmax_float32_min_fill_zeroed(x):
    """Right on every score float32 holds: the fill is below all of them."""
    return softmax_low_fill_zeroed(x, fill=float(np.finfo(np.float32).min))


def attention_low_fill(q, k, v, mask=None, fill=-1e10, zero_rows=True):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        full = ~np.any(np.broadcast_to(mask, s.shape), axis=-1, keepdims=True)
        s = np.where(mask, s, fill)
    else:
        full = np.zeros(s.shape[:-1] + (1,), bool)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    w = e / e.sum(axis=-1, keepdims=True)
    if zero_rows:
        w = np.where(full, 0.0, w)
    return w @ v


def attention_fill_1e30_zeroed(q, k, v, mask=None):
    return attention_low_fill(q, k, v, mask, fill=-1e30)


def attention_fill_1e30_not_zeroed(q, k, v, mask=None):
    return attention_low_fill(q, k, v, mask, fill=-1e30, zero_rows=False)


def attention_finfo_min_not_zeroed(q, k, v, mask=None):
    return attention_low_fill(
        q, k, v, mask, fill=np.finfo(np.float64).min, zero_rows=False
    )


CATALOGUE["check_softmax"]["wrong"] += [
    (softmax_low_fill_zeroed, "finite_mask_fill"),
]
CATALOGUE["check_softmax"]["right"] += [
    softmax_float32_min_fill_zeroed,
    softmax_fill_1e30_zeroed,
]
CATALOGUE["check_attention"]["right"] += [attention_fill_1e30_zeroed]
CATALOGUE["check_attention"]["wrong"] += [
    (attention_low_fill, "finite_mask_fill"),
    (attention_fill_1e30_not_zeroed, "masked_row_uniform"),
    (attention_finfo_min_not_zeroed, "masked_row_uniform"),
]


# --- from the seventh expert reading of chapter 4 (s8 reader ch04-z): the
# Hugging Face idiom (finfo's min as the fill, no zeroing) was named as a
# fill that takes the weight off far-below scores, which no score lies below


def softmax_finfo_min_fill(x):
    x = np.asarray(x, dtype=np.float64)
    x = np.where(np.isneginf(x), np.finfo(np.float64).min, x)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


CATALOGUE["check_softmax"]["wrong"] += [
    (softmax_finfo_min_fill, "masked_row_uniform"),
]


# --- from the eighth expert reading of chapter 4 (s8 reader ch04-aa): a
# softmax flushing weights below 1e-11 or 1.3e-11 to 0 passed, no case having
# a weight between 1e-12 (the absolute tolerance) and 1.4e-11


def softmax_flush_below_1e_11(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0.0))
    z = e.sum(axis=-1, keepdims=True)
    p = np.divide(e, z, out=np.zeros_like(e), where=z > 0)
    return np.where(p < 1e-11, 0.0, p)


def _flush(threshold):
    def flush(x):
        x = np.asarray(x, dtype=np.float64)
        m = x.max(axis=-1, keepdims=True)
        e = np.exp(x - np.where(np.isfinite(m), m, 0.0))
        z = e.sum(axis=-1, keepdims=True)
        p = np.divide(e, z, out=np.zeros_like(e), where=z > 0)
        return np.where(p < threshold, 0.0, p)

    return flush


CATALOGUE["check_softmax"]["wrong"] += [
    (softmax_flush_below_1e_11, "flushed_small_weights"),
    (_flush(2e-12), "flushed_small_weights"),
]


# --- from the student reading of chapter 7 (issue 31, report 0708) ----------
# a mask cut from a fixed 8 x 8 array passed while every case had n <= 8


def causal_mask_from_fixed_buffer(n):
    """Wrong: the causal mask of an 8-position buffer, cut to n."""
    return np.tril(np.ones((8, 8), bool))[:n, :n]


_BUFFER_1024 = torch.tril(torch.ones(1024, 1024, dtype=torch.bool))


def causal_mask_from_1024_buffer(n):
    """Wrong: a causal mask cut from a 1024-position torch buffer (a usual
    context length), right for every n <= 1024."""
    return _BUFFER_1024[:n, :n]


def test_a_1024_buffer_causal_mask_is_named():
    with pytest.raises(ExerciseError) as err:
        check_causal_mask(causal_mask_from_1024_buffer)
    assert err.value.mistake == "fixed_size"


def test_a_fixed_buffer_causal_mask_is_named():
    with pytest.raises(ExerciseError) as err:
        check_causal_mask(causal_mask_from_fixed_buffer)
    assert err.value.mistake == "fixed_size"
    assert "n = 13" in str(err.value)


CATALOGUE["check_causal_mask"]["wrong"] += [
    (causal_mask_from_fixed_buffer, "fixed_size"),
    (causal_mask_from_1024_buffer, "fixed_size"),
]


# --- from the student reading of chapter 7 (issue 31, report 07) ------------
# a mask cut from a 4096-position buffer, the largest the n = 4100 case
# reaches, got only the generic hint: each power-of-two buffer up to 4096 is
# named now

_BUFFER_4096 = np.tril(np.ones((4096, 4096), bool))


def causal_mask_from_4096_buffer(n):
    """Wrong: the student's causal mask cut from a 4096-position buffer."""
    return _BUFFER_4096[:n, :n]


def causal_mask_from_256_torch_buffer(n):
    """Wrong: cut from a 256-position torch buffer, right for n <= 256."""
    return torch.ones(256, 256, dtype=torch.bool).tril()[:n, :n]


@pytest.mark.parametrize(
    "wrong, size",
    [
        (causal_mask_from_4096_buffer, 4096),
        (causal_mask_from_256_torch_buffer, 256),
    ],
)
def test_every_power_of_two_buffer_causal_mask_is_named(wrong, size):
    with pytest.raises(ExerciseError) as err:
        check_causal_mask(wrong)
    assert err.value.mistake == "fixed_size"
    assert f"({size} x {size})" in str(err.value)


CATALOGUE["check_causal_mask"]["wrong"] += [
    (causal_mask_from_4096_buffer, "fixed_size"),
    (causal_mask_from_256_torch_buffer, "fixed_size"),
]


# --- from the student reading of chapter 4 (s12b): a mean shift that counts ---
# each masked -inf as 0 got only the generic hint.


def softmax_mean_with_masked_as_zero(x):
    x = np.asarray(x, dtype=float)
    mu = np.mean(np.where(np.isfinite(x), x, 0), -1, keepdims=True)
    e = np.exp(x - mu)
    return e / e.sum(-1, keepdims=True)


CATALOGUE["check_softmax"]["wrong"] += [
    (softmax_mean_with_masked_as_zero, "shift_not_max")
]


def test_a_mean_shift_counting_masked_keys_as_zero_is_named():
    with pytest.raises(ExerciseError) as err, np.errstate(all="ignore"):
        check_softmax(softmax_mean_with_masked_as_zero)
    assert err.value.mistake == "shift_not_max", str(err.value)


# --- from the student reading of chapters 3 and 4 (s12r03): a wrong shift ----
# behind a guard that returns zeros where a row sums to 0 (for the fully
# masked rows) got only the generic hint.


def _zero_sum_guarded(e):
    total = e.sum(-1, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1), 0)


def softmax_first_row_max_guarded(x):
    x = np.asarray(x)
    m = x.reshape(-1, x.shape[-1])[0].max()
    return _zero_sum_guarded(np.exp(x - m))


def softmax_finite_mean_shift_guarded(x):
    x = np.asarray(x)
    finite = np.isfinite(x)
    m = np.where(finite, x, 0).sum(-1, keepdims=True) / np.maximum(
        finite.sum(-1, keepdims=True), 1
    )
    return _zero_sum_guarded(np.exp(x - m))


def softmax_finite_abs_max_shift(x):
    x = np.asarray(x)
    m = np.where(np.isfinite(x), np.abs(x), 0).max(-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(-1, keepdims=True)


def softmax_finite_abs_max_shift_guarded(x):
    x = np.asarray(x)
    m = np.where(np.isfinite(x), np.abs(x), 0).max(-1, keepdims=True)
    return _zero_sum_guarded(np.exp(x - m))


def softmax_abs_max_shift_guarded(x):
    x = np.asarray(x)
    return _zero_sum_guarded(np.exp(x - np.abs(x).max(-1, keepdims=True)))


def softmax_finite_global_max_guarded(x):
    x = np.asarray(x)
    finite = np.isfinite(x)
    m = x[finite].max() if finite.any() else 0.0
    return _zero_sum_guarded(np.exp(x - m))


def softmax_max_axis_one(x):
    x = np.asarray(x)
    e = np.exp(x - x.max(1 if x.ndim > 2 else -1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def softmax_max_axis_one_guarded(x):
    x = np.asarray(x)
    return _zero_sum_guarded(
        np.exp(x - x.max(1 if x.ndim > 2 else -1, keepdims=True))
    )


def softmax_median_shift_guarded(x):
    x = np.asarray(x)
    return _zero_sum_guarded(np.exp(x - np.median(x, -1, keepdims=True)))


def softmax_max_guarded(x):
    # right: the max trick, with the fully masked rows' -inf maximum replaced
    # and zeros where a row sums to 0
    x = np.asarray(x)
    m = x.max(-1, keepdims=True)
    return _zero_sum_guarded(np.exp(x - np.where(np.isfinite(m), m, 0)))


CATALOGUE["check_softmax"]["wrong"] += [
    (softmax_first_row_max_guarded, "first_row_max"),
    (softmax_finite_mean_shift_guarded, "shift_not_max"),
    (softmax_finite_abs_max_shift, "shift_not_max"),
    (softmax_finite_abs_max_shift_guarded, "shift_not_max"),
    (softmax_abs_max_shift_guarded, "shift_not_max"),
    (softmax_median_shift_guarded, "shift_not_max"),
    (softmax_finite_global_max_guarded, "global_max"),
    (softmax_max_axis_one, "max_axis_1"),
    (softmax_max_axis_one_guarded, "max_axis_1"),
]
CATALOGUE["check_softmax"]["right"] += [softmax_max_guarded]


def test_a_guarded_wrong_shift_keeps_its_diagnosis_and_says_so():
    with pytest.raises(ExerciseError) as err, np.errstate(all="ignore"):
        check_softmax(softmax_first_row_max_guarded)
    assert err.value.mistake == "first_row_max", str(err.value)
    assert "a row of zeros that should sum to 1" in str(err.value)


# --- from the expert reading of chapter 4 (s12 y04sm, section 3): scores
# clipped to a fixed bound before the softmax, which passed every case while
# no visible score exceeded about 4800 -----------------------------------------


def attention_clipped(bound):
    def attention(q, k, v, mask=None):
        s = np.clip(
            q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]), -bound, bound
        )
        if mask is not None:
            s = np.where(mask, s, -np.inf)
        return safe_softmax(s) @ v

    return attention


def attention_clamped_torch(q, k, v, mask=None):
    q, k, v = (torch.as_tensor(np.asarray(a)) for a in (q, k, v))
    s = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).clamp(-1e4, 1e4)
    if mask is not None:
        s = s.masked_fill(~torch.as_tensor(mask), float("-inf"))
    w = torch.nan_to_num(torch.softmax(s, dim=-1))
    return (w @ v).numpy()


CATALOGUE["check_attention"]["wrong"] += [
    (attention_clipped(bound), "clipped_scores")
    for bound in (100.0, 1000.0, 3000.0, 1e4, 5e4)
] + [(attention_clamped_torch, "clipped_scores")]


def test_scores_clipped_above_every_earlier_score_fail_on_the_last_case():
    with pytest.raises(ExerciseError) as err:
        check_attention(attention_clipped(3000.0))
    assert err.value.mistake == "clipped_scores", str(err.value)
    assert "75000 and 74999" in str(err.value)
