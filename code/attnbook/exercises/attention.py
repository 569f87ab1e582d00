"""Checkers for softmax, attention and the causal mask (chapters 4 and 7)."""

from __future__ import annotations

import re

import numpy as np

from ..attention import scaled_dot_product_attention
from ..masks import causal_mask
from ..softmax import naive_softmax, softmax
from ._framework import (
    FLOAT_MASK_DESCRIPTION,
    FLOAT_MASK_HINT,
    INT_MASK_DESCRIPTION,
    INT_MASK_HINT,
    Case,
    ExerciseError,
    Mistake,
    as_array,
    describe_mask,
    fresh,
    is_broadcast_error,
    pristine,
    run_checks,
    same,
    same_mask,
)

_rng = np.random.default_rng


# --- softmax ---------------------------------------------------------------


def _exp_rows(x):
    """exp(x - each row's maximum), as the book's solution computes it
    (keepdims kept)."""
    return np.exp(x - x.max(-1, keepdims=True))


def _finite_mean(x):
    """Each row's mean over its finite entries (0 for a row with none),
    keepdims kept."""
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    count = finite.sum(-1, keepdims=True)
    return np.where(
        count > 0,
        np.where(finite, x, 0).sum(-1, keepdims=True) / np.maximum(count, 1),
        0.0,
    )


def _finite_min(x):
    """Each row's minimum over its finite entries (inf for a row with none),
    keepdims kept."""
    return np.where(np.isfinite(x), x, np.inf).min(-1, keepdims=True)


def _runner_up(x):
    """Each row's second-largest entry (its only entry in a row of one),
    keepdims kept."""
    return np.sort(x, -1)[..., -2:-1] if x.shape[-1] > 1 else x


def _shifted_by(x, shift, guarded=False):
    """exp(x - shift) divided by its row sums; where ``guarded``, a row whose
    sum is 0 gives zeros instead of 0/0 = NaN (the guard readers add for the
    fully masked rows)."""
    e = np.exp(x - shift)
    if not guarded:
        return e / e.sum(-1, keepdims=True)
    total = e.sum(-1, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1), 0.0)


def _finite_abs_max(x):
    """Each row's largest |x_j| over its finite entries (0 for a row with
    none), keepdims kept."""
    return np.where(np.isfinite(x), np.abs(x), 0).max(-1, keepdims=True)


_SHIFT_NOT_MAX = (
    "each row is shifted by a statistic other than its maximum (its mean, "
    "median, minimum, "
    "runner-up, first entry, ...): on a row whose top score lies further "
    "above that statistic than "
    "exp's range (~709 in float64, ~88 in float32) an exponent overflows, or "
    "on one far below it every "
    "exponent underflows, and the result is NaN (or, behind a guard that "
    "returns zeros where a row sums to 0, a row of zeros that should sum "
    "to 1)"
)
_SHIFT_NOT_MAX_HINT = (
    "only the maximum makes every exponent <= 0 with at least one equal to 0: "
    "the sum is then "
    "between 1 and n, never inf and never 0"
)


def _fill_neg_inf(x, value=-1e9):
    return np.where(np.isneginf(x), value, x)


def _clipped(x, bound):
    e = np.exp(np.clip(x, -bound, bound))
    return e / e.sum(-1, keepdims=True)


def _finite_fill(x, fill, zero_masked_rows=True):
    """-inf replaced by ``fill`` and a stable softmax taken, with the rows
    that were entirely -inf set to zeros (the book's convention) where
    ``zero_masked_rows``."""
    x = np.asarray(x)
    fully_masked = np.all(np.isneginf(x), axis=-1, keepdims=True)
    e = _exp_rows(np.where(np.isneginf(x), fill, x))
    p = e / e.sum(-1, keepdims=True)
    return np.where(fully_masked, 0.0, p) if zero_masked_rows else p


def _floored_exponent(x, floor):
    """The shifted exponent clipped from below at ``-floor``: every weight at
    least exp(-floor) / n, a masked one included."""
    z = np.maximum(x - x.max(-1, keepdims=True), -floor)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _eps_denominator(x, eps):
    e = _exp_rows(x)
    return e / (e.sum(-1, keepdims=True) + eps)


def _nan_hidden(x, where, dtype=None):
    """The unstable formula in ``dtype`` (the input's where None), with
    np.nan_to_num applied to the ``"quotient"`` or to the
    ``"exponentials"``."""
    y = np.asarray(x, dtype=dtype)
    if where == "quotient":
        return np.nan_to_num(np.exp(y) / np.exp(y).sum(-1, keepdims=True))
    e = np.nan_to_num(np.exp(y))
    return e / e.sum(-1, keepdims=True)


def _flushed(x, threshold, renormalise, safe=False):
    """A stable softmax whose weights below ``threshold`` are set to 0, the
    rows renormalised where ``renormalise``; a fully masked row NaN, or zeros
    where ``safe`` (the package's softmax)."""
    if safe:
        p = softmax(x, axis=-1)
    else:
        e = _exp_rows(x)
        p = e / e.sum(-1, keepdims=True)
    p = np.where(p < threshold, 0.0, p)
    return _renormalised(p) if renormalise else p


def _float16_softmax(x):
    y = np.asarray(x, dtype=np.float16)
    e = np.exp(y - y.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


SOFTMAX_MISTAKES = [
    Mistake(
        "unstable",
        "your softmax overflows: exp of a large score is inf, and inf/inf is "
        "NaN",
        "subtract each row's maximum before exponentiating; softmax is "
        "unchanged by the shift",
        naive_softmax,
    ),
    # the same formula computed in float64 (a reader who casts first): it
    # survives the float32 case near 100 that overflows the version above, so
    # that version no longer matches it everywhere
    Mistake(
        "unstable",
        "your softmax overflows: exp of a large score is inf, and inf/inf is "
        "NaN",
        "subtract each row's maximum before exponentiating; softmax is "
        "unchanged by the shift",
        lambda x: naive_softmax(np.asarray(x, dtype=np.float64)),
    ),
    # The same formula in disguise: log-sum-exp with no shift. exp(1000) =
    # inf makes the log-sum-exp inf and every weight of that row exp(-inf) =
    # 0 (a row far below 0 sums to 0 and gets inf), not NaN, so the outputs
    # above do not match it. In the input's dtype and in float64.
    *[
        Mistake(
            "unshifted_logsumexp",
            "your log-sum-exp is log(sum(exp(x))) with no shift, the unstable "
            "formula in disguise: exp of a large score is inf, so the "
            "log-sum-exp is inf and every weight exp(x - inf) is 0 (on a row "
            "far below 0 the sum underflows to 0, log 0 = -inf, and the "
            "weights are inf)",
            "shift inside the log-sum-exp: lse = m + log(sum(exp(x - m))) "
            "with m = x.max(axis=-1, keepdims=True); then exp(x - lse) is "
            "the softmax",
            lambda x, dtype=dtype: (
                lambda y: np.exp(y - np.log(np.exp(y).sum(-1, keepdims=True)))
            )(np.asarray(x, dtype=dtype)),
        )
        for dtype in (None, np.float64)
    ],
    Mistake(
        "wrong_axis",
        "the softmax normalises over the wrong axis (columns instead of rows)",
        "each row (one query's scores) must sum to 1: use axis=-1 with "
        "keepdims=True",
        lambda x: softmax(x, axis=0) if np.ndim(x) > 1 else softmax(x),
    ),
    Mistake(
        "axis_1",
        "the softmax is taken along axis 1, the last axis of a matrix only: "
        "on a batch "
        "(3 or more axes) it normalises each column of every matrix",
        "use axis=-1: the last axis, whatever the number of batch axes in "
        "front of it",
        lambda x: softmax(x, axis=1) if np.ndim(x) > 2 else softmax(x),
    ),
    Mistake(
        "not_normalised",
        "the exponentials are never divided by their sum",
        "divide exp(x - max) by its sum along the last axis",
        lambda x: np.exp(x - x.max(-1, keepdims=True)),
    ),
    Mistake(
        "global_sum",
        "the exponentials are divided by the sum over the whole matrix, not "
        "per row",
        "sum along axis=-1 with keepdims=True",
        lambda x: np.exp(x - x.max()) / np.exp(x - x.max()).sum(),
    ),
    # with and without a guard that returns zeros where a row sums to 0
    *[
        Mistake(
            "global_max",
            "the maximum subtracted is the whole array's, not each row's: a "
            "row far below it underflows to all zeros, and 0/0 is NaN (or, "
            "behind a guard that returns zeros where a row sums to 0, a row "
            "of zeros that should sum to 1)",
            "subtract each row's own maximum: x - x.max(axis=-1, "
            "keepdims=True)",
            lambda x, guarded=guarded: _shifted_by(
                x, np.asarray(x).max(), guarded
            ),
        )
        for guarded in (False, True)
    ],
    # one maximum for every row again, taken from the first row (or, x[0],
    # from the first matrix of a batch)
    *[
        Mistake(
            "first_row_max",
            "every row is shifted by the maximum of the first row (or of the "
            "first matrix of a batch), not by its own: a row far above that "
            "number overflows (inf / inf), one far below it underflows to "
            "all zeros (0 / 0), and the result is NaN (or, behind a guard "
            "that returns zeros where a row sums to 0, a row of zeros that "
            "should sum to 1)",
            "subtract each row's own maximum: x - x.max(axis=-1, "
            "keepdims=True), one number per row",
            lambda x, first=first, guarded=guarded: _shifted_by(
                x, first(x).max(), guarded
            ),
        )
        for guarded in (False, True)
        for first in (
            lambda x: np.reshape(x, (-1, np.shape(x)[-1]))[0],
            lambda x: np.asarray(x)[0],
        )
    ],
    # the other statistics readers shift by, each computed in the input's dtype
    # and in float64
    *[
        Mistake(
            "shift_not_max",
            _SHIFT_NOT_MAX,
            _SHIFT_NOT_MAX_HINT,
            lambda x, stat=stat, dtype=dtype, guarded=guarded: (
                lambda y: _shifted_by(y, stat(y), guarded)
            )(np.asarray(x, dtype=dtype)),
        )
        # with and without a guard that returns zeros where a row sums to 0
        for guarded in (False, True)
        for stat in (
            lambda y: y.min(-1, keepdims=True),
            _finite_min,
            lambda y: y[..., :1],
            lambda y: np.median(y, -1, keepdims=True),
            _runner_up,
            # the largest |x|: equal to the maximum on a row whose largest
            # magnitude is positive, far above it on one that reaches far
            # below 0
            lambda y: np.abs(y).max(-1, keepdims=True),
            # the same over the finite entries only (a masked -inf left out)
            _finite_abs_max,
            # the mean, plain and over the finite entries
            lambda y: y.mean(-1, keepdims=True),
            _finite_mean,
            # the mean with each masked -inf counted as 0 (its sum over the
            # finite entries, divided by the whole row's length)
            lambda y: np.where(np.isfinite(y), y, 0).mean(-1, keepdims=True),
        )
        for dtype in (None, np.float64)
    ],
    Mistake(
        "global_sum",
        "the exponentials are divided by the sum over the whole matrix, not "
        "per row (each "
        "row's maximum is subtracted, but one sum divides them all)",
        "sum along axis=-1 with keepdims=True",
        lambda x: _exp_rows(x) / _exp_rows(x).sum(),
    ),
    Mistake(
        "max_axis_0",
        "the maximum subtracted is each column's (axis 0), while the sum is "
        "each row's: rows "
        "far below their column's maximum underflow, and 0/0 is NaN",
        "take the maximum along the same axis as the sum: x.max(axis=-1, "
        "keepdims=True)",
        lambda x: (
            np.exp(x - x.max(0, keepdims=True))
            / np.exp(x - x.max(0, keepdims=True)).sum(-1, keepdims=True)
        ),
    ),
    # the maximum along axis 1, the last axis of a matrix only, with the sum
    # along -1; with and without a guard that returns zeros where a row sums
    # to 0
    *[
        Mistake(
            "max_axis_1",
            "the maximum subtracted is taken along axis 1, the last axis of "
            "a matrix only: on a batch (3 or more axes) it is each column's "
            "maximum within every matrix, while the sum is each row's, so "
            "the entries of a row are shifted by different amounts and the "
            "weights change",
            "take the maximum along the same axis as the sum: x.max(axis=-1, "
            "keepdims=True), whatever the number of batch axes",
            lambda x, guarded=guarded: _shifted_by(
                x,
                np.asarray(x).max(1 if np.ndim(x) > 2 else -1, keepdims=True),
                guarded,
            ),
        )
        for guarded in (False, True)
    ],
    Mistake(
        "neg_inf_to_zero",
        "the -inf scores (masked entries) were replaced by 0, so the masked "
        "keys get weight",
        "keep -inf as it is: exp(-inf - max) = 0 gives a masked key weight 0; "
        "only a fully masked row needs care",
        lambda x: (
            _exp_rows(np.where(np.isneginf(x), 0.0, x))
            / _exp_rows(np.where(np.isneginf(x), 0.0, x)).sum(
                -1, keepdims=True
            )
        ),
    ),
    Mistake(
        "unshifted_denominator",
        "the numerator is shifted by the row maximum but the denominator is "
        "not: "
        "exp(x - m) / sum exp(x) is softmax times exp(-m)",
        "shift both: e = np.exp(x - m) and divide e by e.sum(axis=-1, "
        "keepdims=True)",
        lambda x: _exp_rows(x) / np.exp(x).sum(-1, keepdims=True),
    ),
    Mistake(
        "max_at_least_zero",
        "each row is shifted by max(its maximum, 0) (a running maximum "
        "started at 0): "
        "a row whose scores are all far below 0 underflows to zeros, and 0/0 "
        "is NaN",
        "start the maximum at -inf, or use x.max(axis=-1, keepdims=True) as "
        "it is, negative or not",
        lambda x: (lambda e: e / e.sum(-1, keepdims=True))(
            np.exp(x - np.maximum(x.max(-1, keepdims=True), 0))
        ),
    ),
    Mistake(
        "no_keepdims",
        "the row sums lost their axis (no keepdims=True), so they divide the "
        "columns, "
        "not the rows: on a square matrix numpy broadcasts them silently, on "
        "any other it raises",
        "e.sum(axis=-1, keepdims=True) has shape (..., n, 1) and divides each "
        "row by its own sum",
        lambda x: _exp_rows(x) / _exp_rows(x).sum(-1),
        raises=is_broadcast_error,
    ),
    Mistake(
        "forgot_keepdims",
        "forgot keepdims: x.max(axis=-1) and e.sum(axis=-1) without "
        "keepdims=True have shape (..., n), not (..., n, 1), so they are "
        "applied to the columns, not the rows: on a square matrix numpy "
        "broadcasts them silently (a row's exponentials can underflow to 0, "
        "and 0/0 is NaN), on any other it raises",
        "pass keepdims=True to both reductions: x.max(axis=-1, "
        "keepdims=True) and e.sum(axis=-1, keepdims=True) have shape (..., "
        "n, 1), one number per row, which broadcasts along that row",
        lambda x: (lambda e: e / e.sum(-1))(np.exp(x - x.max(-1))),
        raises=is_broadcast_error,
    ),
    Mistake(
        "no_keepdims_max",
        "the row maxima lost their axis (no keepdims=True), so they are "
        "subtracted "
        "from the columns, not the rows",
        "x.max(axis=-1, keepdims=True) has shape (..., n, 1): each row minus "
        "its own maximum",
        lambda x: (lambda e: e / e.sum(-1, keepdims=True))(
            np.exp(x - x.max(-1))
        ),
    ),
    # the message names no fill: readers pick many, down to finfo's min
    # (Hugging Face's), which is exact everywhere but on a fully masked row
    *[
        Mistake(
            "masked_row_uniform",
            "a fully masked row (every score -inf) gets the uniform weights "
            "1/n: -inf was replaced by a large negative number such as -1e9 "
            "or np.finfo(np.float64).min, so after the shift every score of "
            "that row is 0. The book's convention is all zeros there (torch "
            "gives NaN; both are accepted): a query that may see no key gets "
            "no weight, not an average of values it must not see",
            "keep -inf as it is (exp(-inf) = 0 masks a key exactly), and "
            "return zeros for a row whose maximum is -inf, e.g. with "
            "np.where(np.isfinite(m), x - m, -np.inf) before exp and 0 where "
            "the sum is 0 (with a fill below every score, set the fully "
            "masked rows to zeros)",
            lambda x, fill=fill: softmax(_fill_neg_inf(x, fill), axis=-1),
        )
        for fill in (-1e9, -1e30, -3.4e38, np.finfo(np.float64).min)
    ],
    Mistake(
        "log_softmax",
        "the log-softmax is returned (x - max - log sum exp(x - max)), not "
        "the weights",
        "exponentiate: the weights are exp(x - m) / sum exp(x - m), positive "
        "and summing to 1 along the "
        "last axis",
        lambda x: (
            x
            - x.max(-1, keepdims=True)
            - np.log(_exp_rows(x).sum(-1, keepdims=True))
        ),
    ),
    Mistake(
        "temperature_2",
        "the scores are divided by 2 before the exponential: that is softmax "
        "at temperature "
        "T = 2, flatter than softmax itself",
        "softmax is exp(x - m) / sum exp(x - m) with no factor on the scores "
        "(temperature T = 1)",
        lambda x: softmax(x / 2, axis=-1),
    ),
    Mistake(
        "float16",
        "the softmax is computed in float16: its 3 significant digits are far "
        "from the float64 "
        "(or float32) answer",
        "compute in the input's own dtype: do not cast to float16 (np.half)",
        _float16_softmax,
    ),
    *[
        Mistake(
            "eps_denominator",
            f"a constant (here {eps:g}) is added to the denominator, so the "
            "weights sum to "
            "less than 1: after the shift by the row maximum the sum is at "
            "least 1 and needs no guard",
            "divide by the sum alone; only a fully masked row has the sum 0, "
            "and it needs its own case "
            "(zeros), not an epsilon",
            lambda x, eps=eps: _eps_denominator(x, eps),
        )
        for eps in (1e-2, 1e-3, 1e-4)
    ],
    # the message names no bound: clipping at any bound below the cases'
    # largest scores gives the same output
    *[
        Mistake(
            "clipped_scores",
            "the scores are clipped at a fixed bound instead of shifted: "
            "every score "
            "beyond the bound is changed, so rows with large scores get wrong "
            "weights",
            "subtract each row's maximum instead: softmax is unchanged by the "
            "shift, and changed by clipping",
            lambda x, bound=bound: _clipped(x, bound),
        )
        for bound in (80, 88, 700)
    ],
]


# A finite stand-in for -inf, with fully masked rows zeroed: the fills readers
# use (and the float16 and float32 limits)
_FILLS = (
    -20.0,
    -30.0,
    -50.0,
    -100.0,
    -1e3,
    -1e4,
    -65504.0,
    -1e9,
    -1e10,
    -1e18,
    -1e30,
    -3.4e38,
)
SOFTMAX_MISTAKES += [
    *[
        Mistake(
            "finite_mask_fill",
            "the masked scores (-inf) were replaced by a finite number: in a "
            "row whose other scores lie far below that number the masked key "
            "gets the weight (all of it when they lie below it by more than "
            "exp's range), and elsewhere it keeps a small weight where the "
            "answer is exactly 0 (and a fully masked row, unless set to "
            "zeros, gets the uniform weights 1/n)",
            "keep -inf as it is: exp(-inf - m) = 0 exactly, whatever the "
            "other scores; only a fully masked row (m = -inf) needs its own "
            "case, e.g. np.where(np.isfinite(m), x - m, -np.inf) before exp",
            lambda x, fill=fill, zero=zero: _finite_fill(x, fill, zero),
        )
        for zero in (True, False)
        for fill in _FILLS
    ],
    # the message names no floor: readers pick many
    *[
        Mistake(
            "floored_exponent",
            "the shifted exponent x - max is clipped from below (np.maximum "
            "or np.clip with a floor such as -14): every weight is then at "
            "least exp(floor) / n, so a masked key (-inf) or a score far "
            "below the maximum keeps a weight where the answer is 0 or far "
            "smaller",
            "do not clip: after the shift every exponent is <= 0, so exp "
            "cannot overflow, and an exponent that underflows to 0 is the "
            "right answer (exp(-inf) = 0 masks a key exactly)",
            lambda x, floor=floor: _floored_exponent(x, floor),
        )
        for floor in (*range(5, 41), 50, 60, 70, 80, 87, 100, 700, 745)
    ],
    # the unstable formula with its NaN repaired after the fact: on the
    # quotient (NaN -> 0) or on the exponentials (inf -> the largest float,
    # so the sum overflows and the weights are 0); in the input's dtype and
    # in float64
    *[
        Mistake(
            "unstable_nan_hidden",
            "your softmax is the unstable formula with its NaN hidden by "
            "np.nan_to_num: exp of a large score is inf and inf/inf is NaN "
            "(or a row far below 0 underflows to 0/0), and nan_to_num turns "
            "that into 0, so such a row gets weights that are 0 (or finite "
            "but wrong) and do not sum to 1",
            "do not repair the NaN afterwards, prevent it: subtract each "
            "row's maximum before exponentiating (every exponent is then <= "
            "0 and the sum between 1 and n); only a fully masked row, whose "
            "maximum is -inf, needs its own case",
            lambda x, where=where, dtype=dtype: _nan_hidden(x, where, dtype),
        )
        for where in ("quotient", "exponentials")
        for dtype in (None, np.float64)
    ],
    # the message names no threshold: readers pick many
    *[
        Mistake(
            "flushed_small_weights",
            "the weights below a threshold (such as 1e-8) were set to 0: "
            "each such weight is then wrong by 100%, and the row no longer "
            "sums to 1; float64 holds weights down to about 1e-308",
            "do not flush: a weight is 0 only where exp underflows (or the "
            "score is -inf), never by a threshold you choose; return "
            "e / e.sum(axis=-1, keepdims=True) as it is",
            lambda x, t=threshold, r=renormalise, safe=safe: _flushed(
                x, t, r, safe
            ),
        )
        for safe in (False, True)
        for renormalise in (False, True)
        for threshold in (
            2e-12,
            1e-11,
            1e-10,
            1e-9,
            1e-8,
            1e-7,
            1e-6,
            1e-5,
            1e-4,
            1e-3,
        )
    ],
]


def softmax_cases() -> list[Case]:
    rng = _rng(0)
    spread = np.array(
        [
            [-1000.0, 2000.0, 1990.0],
            [-3000.0, 1.0, 0.0],
            [-1000.0, -1001.0, -1003.0],
        ]
    )
    batch = rng.normal(scale=3, size=(2, 3, 5))
    # masked entries
    batch[0, 1, [0, 3]] = -np.inf
    # a fully masked row
    batch[1, 2, :] = -np.inf
    # Rows at different levels first: they tell a per-row shift from a global
    # one.
    return [
        Case(
            "rows at very different levels, [[1000, 1001], [0, 1]]",
            (np.array([[1000.0, 1001.0], [0.0, 1.0]]),),
        ),
        Case(
            "rows spanning more than exp's range, [[-1000, 2000, 1990], "
            "[-3000, 1, 0], "
            "[-1000, -1001, -1003]] (the last all negative)",
            (spread,),
        ),
        Case(
            "a 4 x 6 matrix of scores (softmax of each row)",
            (rng.normal(size=(4, 6)),),
        ),
        Case(
            "one float32 row near 100 (float32's exp overflows above 88)",
            ((100 + 5 * rng.normal(size=6)).astype(np.float32),),
        ),
        Case(
            "a batch 2 x 3 x 5 with -inf entries and one fully masked row "
            "(there NaN or zeros are accepted)",
            (batch,),
        ),
        Case("one score per row, shape (3, 1)", (rng.normal(size=(3, 1)),)),
        # Last, so that the verdicts on the cases above stay as they were: a
        # shift by anything but the maximum (median, runner-up) overflows only
        # when the top score is far above all the others.
        Case(
            "one score far above all the others in each row, [[0, 1000, -5], "
            "[2000, 0, 1]]",
            (np.array([[0.0, 1000.0, -5.0], [2000.0, 0.0, 1.0]]),),
        ),
        Case(
            "one float32 row [0, 100, -5], its top score far above the rest",
            (np.array([0.0, 100.0, -5.0], dtype=np.float32),),
        ),
        # Last too. Masked keys in rows whose scores lie far below any
        # finite stand-in for -inf (-30, -100, -1e9): a fill puts the
        # weight on the masked key there. (The batch above has finite scores
        # of order 3, where a fill below about -17 leaks less than 1e-6.)
        Case(
            "masked keys in rows far below 0, [[-1000, -inf, -1001], "
            "[5, -inf, 4], [-2e9, -inf, -2e9 - 256]]",
            # -2e9 and -2e9 - 256 are float32 numbers too: a softmax
            # computed in float32 gets this case right
            (
                np.array(
                    [
                        [-1000.0, -np.inf, -1001.0],
                        [5.0, -np.inf, 4.0],
                        [-2e9, -np.inf, -2e9 - 256],
                    ]
                ),
            ),
        ),
        # Last too. Weights far below 1 that float64 still holds (6.1e-6
        # down to 1.03e-12, just above atol 1e-12): a softmax that flushes
        # the weights below any threshold above 1.03e-12 to 0 (1e-8, 1e-11,
        # 2e-12) is wrong here by more than atol; one below it is within the
        # tolerance. No case above has a float64 weight between about 1e-300
        # and 1e-5.
        Case(
            "small weights that float64 holds, [[0, -12, -25, -26, -27, "
            "-27.6]] (weights 6.1e-6, 1.4e-11, 5.1e-12, 1.9e-12, 1.03e-12)",
            (np.array([[0.0, -12.0, -25.0, -26.0, -27.0, -27.6]]),),
        ),
        # Last too. A fill below -2e9 (-1e10) passes the cases above; here
        # the visible scores lie at -3e10, so every finite fill above that
        # takes the weight. Equal scores, so that a softmax computed in
        # float32 gets the case right; and no lower, so that exp(x - LSE(x))
        # in float64 still does (LSE rounds to a spacing of 4e-6 there). A
        # fill below every score a row holds (np.finfo(float64).min, as
        # Hugging Face uses) is exact and passes.
        Case(
            "a masked key between two visible scores far below 0, "
            "[[-3e10, -inf, -3e10]] (weights 0.5, 0, 0.5)",
            (np.array([[-3e10, -np.inf, -3e10]]),),
        ),
    ]


def _same_softmax(got, expected) -> bool:
    """Agreement, except that a fully masked row (the reference's all-zero row:
    softmax rows otherwise sum to 1) may be all zeros or all NaN, what torch
    gives.

    Two rules are stricter than :func:`same`. Where the reference's weight is
    exactly 0 in any other row (a masked key, -inf, or a score whose weight
    underflows), the answer must be 0 too, up to the smallest normal number
    of the reference's dtype: ``exp(-inf) = 0`` exactly, so a leak there (a
    finite fill for -inf, an exponent clipped from below) is a wrong answer
    however small. And a float64 reference is compared with ``atol =
    1e-12``, not 1e-6 (``rtol = 1e-5`` still admits a softmax computed in
    float32)."""
    try:
        g, e = (
            np.asarray(as_array(got), dtype=np.float64),
            np.asarray(as_array(expected), dtype=np.float64),
        )
    except (TypeError, ValueError):
        return same(got, expected)
    if g.shape != e.shape or e.ndim == 0:
        return False
    expected_dtype = as_array(expected).dtype
    masked = np.all(e == 0, axis=-1)
    if masked.any():
        undefined = np.all(np.isnan(g), axis=-1) | np.all(g == 0, axis=-1)
        if not undefined[masked].all():
            return False
        g, e = g[~masked], e[~masked]
    if expected_dtype.kind == "f":
        tiny = float(np.finfo(expected_dtype).tiny)
        with np.errstate(invalid="ignore"):
            leak = (e == 0) & ~(np.abs(g) <= tiny)
        if leak.any():
            return False
    atol = 1e-12 if expected_dtype == np.float64 else 1e-6
    return same(g, e, atol=atol)


def check_softmax(fn) -> None:
    """Check ``fn(x)`` computes a numerically stable softmax over the last axis
    of ``x``.

    A fully masked row (every score -inf) has no softmax: zeros and NaN are
    both accepted there.
    """
    run_checks(
        "softmax",
        fn,
        softmax_cases(),
        lambda x: softmax(x, axis=-1),
        SOFTMAX_MISTAKES,
        compare=_same_softmax,
        hint="follow eq. ch4-stable-softmax: m = x.max(axis=-1, "
        "keepdims=True), e = np.exp(x - m), e / e.sum(axis=-1, "
        "keepdims=True); then handle the row whose every entry is -inf "
        "(its m is -inf) separately",
    )


# --- scaled dot-product attention ------------------------------------------


def _square_transposed(mask):
    """A square mask with its last two axes swapped (a mask of another shape
    cannot be read transposed without a shape error)."""
    if mask is None or mask.shape[-1] != mask.shape[-2]:
        return mask
    return np.swapaxes(mask, -1, -2)


def _mask_read_transposed(err: Exception) -> bool:
    """Whether ``err`` is numpy's broadcast error between a 2-D mask read
    transposed, (n_k, n_q), and scores of shape (..., n_q, n_k) with n_q !=
    n_k. The checker's first cases have no mask, so a function that reaches
    the masked ones computes scores of the right shape: a 2-D operand whose
    reverse ends another operand's shape is the mask read the wrong way."""
    if not is_broadcast_error(err):
        return False
    text = str(err).split("shapes", 1)[-1]
    shapes = [
        tuple(int(v) for v in re.findall(r"\d+", group))
        for group in re.findall(r"\(([\d,\s]*)\)", text)
    ]
    return any(
        len(a) == 2 and a[0] != a[1] and len(b) >= 2 and b[-2:] == a[::-1]
        for a in shapes
        for b in shapes
    )


def _masked(s, mask, fill=-np.inf):
    """The scores with the masked ones (``mask`` False) set to ``fill``."""
    return s if mask is None else np.where(mask, s, fill)


def _scaled(q, k):
    return q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])


def _attention_with(scores_fn, weights_fn=softmax):
    def attention(q, k, v, mask=None):
        return weights_fn(_masked(scores_fn(q, k), mask)) @ v

    return attention


def _first_batch_mask(mask):
    """The mask of the first batch element, for the whole batch (a mask of
    one or two axes is returned as it is)."""
    if mask is None or np.ndim(mask) <= 2:
        return mask
    return mask[(0,) * (np.ndim(mask) - 2)]


def _boolean_indexed(q, k, v, mask=None):
    """The masked scores set by boolean indexing, s[..., ~mask] = -inf: right
    for a mask of the shape of the scores' last axes, an IndexError for one
    that must broadcast."""
    s = _scaled(q, k)
    if mask is not None:
        s[..., ~mask] = -np.inf
    return softmax(s) @ v


def is_boolean_index_error(err: Exception) -> bool:
    """Whether ``err`` is numpy's or torch's complaint that a boolean index
    does not fit the array it indexes."""
    text = str(err)
    return isinstance(err, IndexError) and (
        "boolean index did not match" in text
        or ("shape of the mask" in text and "indexed tensor" in text)
    )


def _renormalised(w):
    """Each row of ``w`` divided by its sum (a row summing to 0 stays 0)."""
    z = w.sum(-1, keepdims=True)
    return w / np.where(z == 0, 1, z)


def _nan_rows_softmax(s):
    """The max trick with no care for a row whose every score is -inf."""
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


ATTENTION_MISTAKES = [
    Mistake(
        "no_scale",
        "the scores are not divided by sqrt(d_k)",
        "scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(d_k): without it "
        "softmax "
        "saturates as d_k "
        "grows (chapter 3)",
        _attention_with(lambda q, k: q @ np.swapaxes(k, -1, -2)),
    ),
    Mistake(
        "scale_by_dk",
        "the scores are divided by d_k instead of sqrt(d_k)",
        "the variance of q.k is d_k, so its standard deviation is sqrt(d_k)",
        _attention_with(lambda q, k: q @ np.swapaxes(k, -1, -2) / q.shape[-1]),
    ),
    Mistake(
        "swapped_qk",
        "q and k are swapped: the score matrix is transposed (keys attend to "
        "queries)",
        "row i of the scores must be query i against every key: q k^T "
        "(q @ np.swapaxes(k, -1, -2) on a batch), not k q^T",
        _attention_with(
            lambda q, k: k @ np.swapaxes(q, -1, -2) / np.sqrt(q.shape[-1])
        ),
    ),
    Mistake(
        "wrong_axis",
        "the softmax normalises over the wrong axis (over queries instead of "
        "keys)",
        "each query's weights over the keys must sum to 1: softmax along the "
        "last axis",
        _attention_with(
            lambda q, k: q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]),
            lambda s: softmax(s, axis=-2),
        ),
    ),
    Mistake(
        "unstable",
        "your softmax overflows on large scores (NaN in the output)",
        "subtract each row's maximum score before exponentiating",
        _attention_with(
            lambda q, k: q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]),
            naive_softmax,
        ),
    ),
    # the same formula with a guard against a zero sum (for the fully masked
    # rows), in the input's dtype and in float64: the overflow stays
    *[
        Mistake(
            "unstable",
            "your softmax exponentiates the scores without subtracting each "
            "row's maximum: a large score overflows to inf, and inf/inf is "
            "NaN in the output (the guard against a zero sum catches only "
            "the fully masked rows, not this)",
            "subtract each row's maximum score before exponentiating (only "
            "where it is finite, so that a fully masked row stays zeros)",
            _attention_with(
                _scaled,
                lambda s, dtype=dtype: _renormalised(
                    np.exp(s if dtype is None else s.astype(dtype))
                ),
            ),
        )
        for dtype in (None, np.float64)
    ],
    Mistake(
        "scale_by_sqrt_d_v",
        "the scores are divided by sqrt(d_v), the width of the values, not "
        "sqrt(d_k)",
        "the scale belongs to the dot products q . k, which have d_k terms: "
        "np.sqrt(q.shape[-1])",
        lambda q, k, v, mask=None: (
            softmax(
                _masked(
                    q @ np.swapaxes(k, -1, -2) / np.sqrt(v.shape[-1]), mask
                )
            )
            @ v
        ),
    ),
    Mistake(
        "scale_by_sqrt_n_k",
        "the scores are divided by sqrt(n_k), the number of keys, not "
        "sqrt(d_k)",
        "d_k is the dimension of each query and key vector, q.shape[-1]; "
        "len(k) counts the keys",
        _attention_with(
            lambda q, k: q @ np.swapaxes(k, -1, -2) / np.sqrt(k.shape[-2])
        ),
    ),
    Mistake(
        "scale_by_sqrt_n_q",
        "the scores are divided by sqrt(n_q), the number of queries, not "
        "sqrt(d_k)",
        "d_k is the dimension of each query and key vector, q.shape[-1]; "
        "q.shape[0] counts the queries",
        _attention_with(
            lambda q, k: q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-2])
        ),
    ),
    Mistake(
        "scale_by_sqrt_dk_plus_1",
        "the scores are divided by sqrt(d_k + 1), not sqrt(d_k)",
        "the variance of q . k is d_k (d_k terms of variance 1): divide by "
        "np.sqrt(q.shape[-1])",
        _attention_with(
            lambda q, k: q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1] + 1)
        ),
    ),
    Mistake(
        "base_2",
        "the exponential is base 2 (2**s or np.exp2) instead of e: 2**s = "
        "e**(s ln 2), a softmax "
        "of the scores times ln 2 ~ 0.69",
        "use np.exp: the softmax of attention is exp(s - max) / sum exp(s - "
        "max)",
        _attention_with(
            lambda q, k: q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]),
            lambda s: (lambda e: e / e.sum(-1, keepdims=True))(
                np.exp2(s - s.max(-1, keepdims=True))
            ),
        ),
    ),
    Mistake(
        "global_softmax",
        "the softmax is taken over the whole score matrix, not over each "
        "query's row",
        "each query's weights over the keys must sum to 1: softmax along the "
        "last axis, per row",
        _attention_with(
            lambda q, k: q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]),
            lambda s: softmax(s.reshape(-1)).reshape(s.shape),
        ),
    ),
    Mistake(
        "global_max",
        "the softmax subtracts the maximum of the whole score matrix, not "
        "each row's own: "
        "a row far below it underflows to all zeros, and 0/0 is NaN",
        "subtract each query's own maximum: s - s.max(axis=-1, keepdims=True)",
        _attention_with(
            lambda q, k: q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]),
            lambda s: (
                np.exp(s - s.max())
                / np.exp(s - s.max()).sum(-1, keepdims=True)
            ),
        ),
    ),
    Mistake(
        "no_softmax",
        "there is no softmax: the scaled scores themselves weight the values",
        "the weights are softmax(q k^T / sqrt(d_k)) along the last axis: "
        "positive, each row summing to 1",
        lambda q, k, v, mask=None: _masked(_scaled(q, k), mask, 0.0) @ v,
    ),
    Mistake(
        "times_sqrt_dk",
        "the scores are multiplied by sqrt(d_k) instead of divided by it",
        "scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(d_k): the scale "
        "shrinks the dot products, "
        "whose variance is d_k",
        _attention_with(
            lambda q, k: q @ np.swapaxes(k, -1, -2) * np.sqrt(q.shape[-1])
        ),
    ),
    Mistake(
        "transposed_weights",
        "the weights are transposed before they multiply v (weights.T @ v): "
        "each "
        "output row mixes the values with one KEY's weights over the queries",
        "out = weights @ v with weights of shape (n_q, n_k): row i of the "
        "output uses row i of the weights",
        lambda q, k, v, mask=None: (
            np.swapaxes(softmax(_masked(_scaled(q, k), mask)), -1, -2) @ v
        ),
    ),
    Mistake(
        "scaled_after_softmax",
        "the weights are divided by sqrt(d_k) after the softmax instead of "
        "the scores before it",
        "the scale goes inside: softmax(q k^T / sqrt(d_k)); after the "
        "softmax it only shrinks the output",
        lambda q, k, v, mask=None: (
            softmax(_masked(q @ np.swapaxes(k, -1, -2), mask))
            / np.sqrt(q.shape[-1])
            @ v
        ),
    ),
    Mistake(
        "returned_weights",
        "you returned the attention weights softmax(q k^T / sqrt(d_k)), "
        "shape (..., n_q, n_k), not the output: the weights still have to "
        "average the values",
        "multiply the weights by v: out = weights @ v, shape (..., n_q, "
        "d_v), one weighted average of the values per query",
        lambda q, k, v, mask=None: softmax(_masked(_scaled(q, k), mask)),
    ),
    Mistake(
        "mask_inverted",
        "the mask is read the wrong way round: True hides a key, where the "
        "book's convention (PyTorch's) is True = may attend",
        "keep the scores where the mask is True: np.where(mask, s, -np.inf)",
        lambda q, k, v, mask=None: (
            softmax(_masked(_scaled(q, k), None if mask is None else ~mask))
            @ v
        ),
    ),
    Mistake(
        "mask_transposed",
        "the mask is read transposed: its rows were taken as keys and its "
        "columns as queries, so with the causal mask each query sees the "
        "future instead of the past, and a mask of shape (n_q, n_k) with n_q "
        "!= n_k, read as (n_k, n_q), does not fit the scores; a mask has "
        "shape (..., n_q, n_k), row i for query i",
        "use the mask as it is given: np.where(mask, s, -np.inf) with s of "
        "shape (..., n_q, n_k)",
        lambda q, k, v, mask=None: (
            softmax(_masked(_scaled(q, k), _square_transposed(mask))) @ v
        ),
        # on a mask that is not square, mask.T no longer fits the scores
        raises=_mask_read_transposed,
    ),
    Mistake(
        "mask_not_batched",
        "the mask is not broadcast over the batch: every batch element got "
        "the mask of the first (or the mask was broadcast to one (n_q, n_k) "
        "matrix), but a mask of shape (..., n_q, n_k) may differ along its "
        "leading axes: a padding mask (B, 1, 1, n_k) hides other keys in "
        "each sequence",
        "use the mask as it is given, np.where(mask, s, -np.inf) with s of "
        "shape (..., n_q, n_k): numpy broadcasts it over the batch and the "
        "heads; broadcast it to s.shape if you must, never to (n_q, n_k), "
        "and do not take its first element",
        lambda q, k, v, mask=None: (
            softmax(_masked(_scaled(q, k), _first_batch_mask(mask))) @ v
        ),
        # np.broadcast_to(mask, (n_q, n_k)): a mask with leading axes
        raises=lambda err: (
            isinstance(err, ValueError)
            and "more dimensions than allowed by the axis remapping"
            in str(err)
        ),
    ),
    Mistake(
        "mask_boolean_index",
        "boolean indexing s[..., ~mask] = -inf does not broadcast: the mask "
        "must have exactly the shape of the axes it indexes, so a mask with "
        "axes of size 1 (a padding mask (B, 1, 1, n_k)) or fewer axes than "
        "the scores (s[~mask] with a 2-D mask on a batch) raises IndexError",
        "use np.where(mask, s, -np.inf), which broadcasts the mask against "
        "the scores (..., n_q, n_k), or index with np.broadcast_to(mask, "
        "s.shape)",
        _boolean_indexed,
        raises=is_boolean_index_error,
    ),
    Mistake(
        "masked_row_nan",
        "a query whose every key is masked gets NaN (its maximum score is "
        "-inf, and -inf - (-inf) is NaN): the book's convention, and what "
        "the package and PyTorch's scaled_dot_product_attention give on "
        "this CPU, is zero weights and a zero output",
        "subtract each row's maximum only where it is finite, e.g. m = "
        "s.max(-1, keepdims=True); np.exp(s - np.where(np.isfinite(m), m, "
        "0)), and divide only where the sum is positive (attnbook.softmax "
        "does both, on a row whose every score is -inf too; a my_softmax "
        "that passed exercise 1 may not, since that exercise accepts NaN on "
        "such a row)",
        _attention_with(_scaled, _nan_rows_softmax),
    ),
    # the message names no fill: readers pick many, down to finfo's min
    *[
        Mistake(
            "masked_row_uniform",
            "a query whose every key is masked gets the plain average of all "
            "the values: the masked scores were set to a finite number (such "
            "as "
            "-1e9) instead of -inf, so after the shift that row's scores are "
            "all 0 and its weights uniform; the answer there is a zero output "
            "(a query that may see no key gets nothing from them)",
            "set the masked scores to -inf (np.where(mask, s, -np.inf)) and "
            "give "
            "a row whose maximum is -inf zero weights, as attnbook.softmax "
            "does",
            lambda q, k, v, mask=None, fill=fill: (
                softmax(_masked(_scaled(q, k), mask, fill)) @ v
            ),
        )
        for fill in (
            -1e4,
            -1e9,
            -1e10,
            -1e30,
            -3.4e38,
            np.finfo(np.float64).min,
        )
    ],
    Mistake(
        "mask_after_softmax",
        "the mask is applied after the softmax (the weights times the "
        "mask), so the remaining weights of a row no longer sum to 1",
        "mask the scores before the softmax: np.where(mask, s, -np.inf), "
        "then softmax, which spreads each row's weight over its visible keys",
        lambda q, k, v, mask=None: (
            softmax(_scaled(q, k)) * (1.0 if mask is None else mask) @ v
        ),
    ),
    Mistake(
        "mask_after_softmax_renormalised",
        "the mask is applied after the softmax and the weights renormalised: "
        "equal in exact arithmetic, but a masked key with a dominant score "
        "makes the visible weights underflow to 0 (0/0 or a 0 output)",
        "set the masked scores to -inf before the softmax: np.where(mask, s, "
        "-np.inf), so the shift is the maximum over the visible keys only",
        lambda q, k, v, mask=None: (
            _renormalised(
                softmax(_scaled(q, k)) * (1.0 if mask is None else mask)
            )
            @ v
        ),
    ),
    Mistake(
        "mask_as_zero_score",
        "the masked scores are set to 0 (the scores times the mask) instead "
        "of -inf: a masked key still gets weight e^0 / sum",
        "a masked key must get weight exactly 0: set its score to -inf, "
        "np.where(mask, s, -np.inf), since exp(-inf) = 0",
        lambda q, k, v, mask=None: (
            softmax(_scaled(q, k) * (1.0 if mask is None else mask)) @ v
        ),
    ),
    Mistake(
        "mask_added",
        "the boolean mask was added to the scores (True counts as 1, False "
        "as 0), which shifts the visible keys' scores by 1 and hides nothing",
        "use the mask to choose, not to add: np.where(mask, s, -np.inf) "
        "(an additive mask holds 0 and -inf, not True and False)",
        lambda q, k, v, mask=None: (
            softmax(_scaled(q, k) + (0.0 if mask is None else mask)) @ v
        ),
    ),
    # s / d_k**1/2 is s / d_k / 2; scale = d_k**1/2, then s / scale, is s
    # divided by d_k / 2
    *[
        Mistake(
            "scale_precedence",
            "the scale is written d_k**1/2, which Python reads as (d_k**1) "
            "/ 2 = d_k / 2 (** binds tighter than /): the scores are "
            "divided by d_k / 2 (by 2 d_k where it ends a chain of "
            "divisions: s / d_k**1/2 is s / d_k / 2), not by sqrt(d_k)",
            "write d_k**0.5 or np.sqrt(d_k); a fractional exponent needs "
            "parentheses, d_k**(1/2)",
            _attention_with(
                lambda q, k, divisor=divisor: (
                    q @ np.swapaxes(k, -1, -2) / divisor(q.shape[-1])
                )
            ),
        )
        for divisor in (lambda d: d / 2, lambda d: 2 * d)
    ],
    # the message names no fill: readers pick many (those above the last
    # case's visible score, about -2.05e9)
    *[
        Mistake(
            "finite_mask_fill",
            "the masked scores were set to a finite number (such as -1e9) "
            "instead of -inf, and the queries whose every key is masked "
            "given zeros: where a query's visible scores lie far below that "
            "number, the masked key gets the weight (all of it when they "
            "lie below it by more than exp's range), and elsewhere it keeps "
            "a small weight where the answer is exactly 0",
            "set the masked scores to -inf, np.where(mask, s, -np.inf): "
            "exp(-inf - m) = 0 exactly, whatever the visible scores; only a "
            "query whose every key is masked (m = -inf) needs its own case",
            lambda q, k, v, mask=None, fill=fill: (
                _finite_fill(_masked(_scaled(q, k), mask), fill) @ v
            ),
        )
        for fill in (-15.0, *_FILLS[:-1])
    ],
    # scores clipped to [-bound, bound] before the mask: the bounds readers
    # pick; every bound from about 4800 (the largest score of the cases
    # before the last) to 74999 gives the same output on the last case
    *[
        Mistake(
            "clipped_scores",
            "the scores are clipped at a fixed bound (np.clip(s, -bound, "
            "bound)) before the softmax: every score beyond the bound becomes "
            "the bound, so scores that differ (by thousands, or by 1 near "
            "75000) get equal weights",
            "do not clip: subtract each row's maximum over the visible keys "
            "instead, which makes every exponent <= 0 and leaves the weights "
            "unchanged, whatever the size of the scores",
            lambda q, k, v, mask=None, bound=bound: (
                softmax(_masked(np.clip(_scaled(q, k), -bound, bound), mask))
                @ v
            ),
        )
        for bound in (100.0, 300.0, 1000.0, 3000.0, 1e4, 65504.0)
    ],
]


def attention_cases() -> list[Case]:
    rng = _rng(1)
    n = lambda *shape, scale=1.0: rng.normal(scale=scale, size=shape)  # noqa: E731
    f32 = lambda *shape: n(*shape).astype(np.float32)  # noqa: E731
    # (n_q, n_k) = (3, 5), broadcast over a batch of 2 x 3 heads: query 0
    # sees keys 0, 1, 3; query 1 sees none (its output is 0); query 2 all
    # but key 0
    mask = np.array(
        [
            [True, True, False, True, False],
            [False] * 5,
            [False, True, True, True, True],
        ]
    )
    self_attention = Case(
        "self-attention, n = 4, d_k = d_v = 16",
        (n(4, 16), n(4, 16), n(4, 16)),
    )
    masked = Case(
        "a batch of 2 x 3 heads, n_q = 3, n_k = 5, d_k = 8, d_v = 6, with a "
        "boolean mask of shape (3, 5) (True = may attend); query 1 may see "
        "no key, so its output is 0",
        (n(2, 3, 3, 8), n(2, 3, 5, 8), n(2, 3, 5, 6)),
        {"mask": mask},
    )
    return [
        self_attention,
        Case(
            "float32 inputs, a single query (n_q = 1) over n_k = 7 keys, d_k "
            "= 4, d_v = 3",
            (f32(1, 4), f32(7, 4), f32(7, 3)),
        ),
        Case(
            "large inputs whose scores span more than exp's range (thousands)",
            (n(4, 64, scale=40), n(6, 64, scale=40), n(6, 8)),
        ),
        # after the formula: the mask and the batch (a function without
        # either is judged on the formula first)
        masked,
        # last, so that the verdicts on the cases above stay as they were: a
        # masked key whose scaled score (1600 / sqrt(2) ~ 1131) lies more
        # than 745 above the visible key's, so that exp underflows the
        # visible weight to 0 unless the mask comes before the softmax
        Case(
            "a masked key with a dominant score: n_q = 1, n_k = 2, d_k = 2, "
            "d_v = 1, key 1 (score ~ 1131) masked, key 0 (score 0) visible, "
            "so the output is v[0] = 1",
            (
                np.array([[1.0, 0.0]]),
                np.array([[0.0, 0.0], [1600.0, 0.0]]),
                np.array([[1.0], [5.0]]),
            ),
            {"mask": np.array([[True, False]])},
        ),
        # a square mask that is not symmetric: the only kind on which a mask
        # read transposed (keys by queries) gives another answer
        Case(
            "a batch of 2, n_q = n_k = 4, d_k = 8, d_v = 5, with the causal "
            "mask of shape (4, 4) (query i may see keys 0..i)",
            (n(2, 4, 8), n(2, 4, 8), n(2, 4, 5)),
            {"mask": np.tril(np.ones((4, 4), dtype=bool))},
        ),
        # last too: a mask whose leading axes differ across the batch, as a
        # padding mask's do (one row of real keys per sequence, broadcast
        # over the heads and the queries). A mask taken from the first
        # sequence only, or boolean indexing s[..., ~mask] (which does not
        # broadcast), passes every 2-D mask above.
        Case(
            "a padding mask of shape (2, 1, 1, 5) for a batch of 2 "
            "sequences x 3 heads, n_q = 3, n_k = 5, d_k = 4, d_v = 3: "
            "sequence 0 has 3 real keys, sequence 1 has 4",
            (n(2, 3, 3, 4), n(2, 3, 5, 4), n(2, 3, 5, 3)),
            {"mask": np.arange(5) < np.array([3, 4]).reshape(2, 1, 1, 1)},
        ),
        # last too: a visible score far below 0 (-2.9e9 / sqrt(2) ~
        # -2.05e9, a float32 number too), as in check_softmax's last masked
        # row. A finite stand-in for -inf (-30, -1e9) above it takes the
        # weight off the visible key; with -inf the output is v[0] = 1.
        Case(
            "a visible key far below 0: n_q = 1, n_k = 2, d_k = 2, d_v = 1, "
            "key 0 (score ~ -2.05e9) visible, key 1 (score 0) masked, so "
            "the output is v[0] = 1",
            (
                np.array([[1.0, 0.0]]),
                np.array([[-2.9e9, 0.0], [0.0, 0.0]]),
                np.array([[1.0], [5.0]]),
            ),
            {"mask": np.array([[True, False]])},
        ),
        # last too: visible scores at -3e10 (d_k = 1, so no scale; 1e5 x
        # -3e5 is a float32 number too), as in check_softmax's last case: a
        # fill above that (-1e10) takes the weight; with -inf query 0's
        # output is the mean of v[0] and v[2], 2. Query 1's visible scores,
        # 75000 and 74999 (exact in float32, where the shift by the maximum
        # is exact too), lie above any bound a reader clips the scores to
        # (3000, 1e4, float16's 65504; the scores above reach about 4800):
        # clipped, they become equal and the output 0.5, where it is e / (1
        # + e) = 0.7311.
        Case(
            "visible scores far below 0 and far above: n_q = 2, n_k = 4, "
            "d_k = 1, d_v = 1; query 0 sees scores -3e10 (keys 0 and 2), so "
            "its output is (v[0] + v[2]) / 2 = 2; query 1 sees scores 75000 "
            "and 74999 (keys 0 and 3), so its output is e / (1 + e) = 0.7311",
            (
                np.array([[1e5], [-0.25]]),
                np.array([[-3e5], [0.0], [-3e5], [-299996.0]]),
                np.array([[1.0], [5.0], [3.0], [0.0]]),
            ),
            {
                "mask": np.array(
                    [[True, False, True, False], [True, False, False, True]]
                )
            },
        ),
    ]


def _first(out):
    """The output alone, or the output of an ``(output, weights)`` pair. A
    pair whose second element is None is refused: it claims weights it does
    not hold."""
    if isinstance(out, tuple):
        if len(out) == 2 and out[1] is None:
            raise ValueError(
                "your function returned a pair (output, None): return the "
                "output alone, or the pair (output, weights) with the "
                "weights"
            )
        return out[0]
    return out


def _reference_weights(q, k, v, mask=None):
    """The weights softmax(q k^T / sqrt(d_k)) of the package, shape (...,
    n_q, n_k), zeros on a fully masked query's row."""
    return scaled_dot_product_attention(q, k, v, mask=mask)[1]


def _same_weights(got, expected) -> bool:
    """:func:`_same_softmax`: a fully masked query's row may be zeros or NaN
    (what torch gives), and a masked key's weight must be 0. False for what
    is no array of numbers."""
    try:
        return bool(_same_softmax(got, expected))
    except (TypeError, ValueError):
        return False


def _swapped(x):
    """``x`` with its last two axes swapped, or None where it has fewer than
    two (or is no array)."""
    try:
        a = as_array(x)
    except Exception:
        return None
    return np.swapaxes(a, -1, -2) if a.ndim >= 2 else None


# What the weights of a returned (output, weights) pair can get wrong when
# the output is right. Each is recognised by its own test on the reader's
# weights (``matches``); the last matches any weights that are not the
# reference's.
ATTENTION_WEIGHTS_MISTAKES = [
    Mistake(
        "weights_transposed",
        "the output is right, but the weights you returned are transposed: "
        "shape (..., n_k, n_q), row j holding key j's weights over the "
        "queries, where the package returns (..., n_q, n_k), row i holding "
        "query i's weights over the keys, each row summing to 1 (on a "
        "square case the shapes fit and only the values tell)",
        "return the weights that multiplied v, as they are: out = weights "
        "@ v and return (out, weights), without swapaxes or .T",
        lambda q, k, v, mask=None: np.swapaxes(
            _reference_weights(q, k, v, mask), -1, -2
        ),
    ),
    Mistake(
        "weights_are_scores",
        "the output is right, but the weights you returned are the scaled "
        "scores q k^T / sqrt(d_k) (masked at -inf), the input of the "
        "softmax, not its output",
        "return softmax(scores), the array that multiplied v: positive, "
        "each query's row summing to 1 over the keys",
        lambda q, k, v, mask=None: _masked(_scaled(q, k), mask),
    ),
    Mistake(
        "weights_not_softmax",
        "the output is right, but the weights you returned are not "
        "softmax(q k^T / sqrt(d_k)) along the last axis, the weights that "
        "give that output: the package's pair is (output, weights) with "
        "output = weights @ v",
        "return the array that multiplied v, shape (..., n_q, n_k): each "
        "query's row positive (0 at a masked key) and summing to 1 (zeros, "
        "or NaN, for a query whose every key is masked)",
        lambda q, k, v, mask=None: None,
    ),
]


def _weights_mistake(got, expected, case) -> Mistake:
    """The mistake of :data:`ATTENTION_WEIGHTS_MISTAKES` that ``got``, wrong
    weights on ``case``, commits."""
    transposed, scores, other = ATTENTION_WEIGHTS_MISTAKES
    swapped = _swapped(got)
    if swapped is not None and _same_weights(swapped, expected):
        return transposed
    try:
        if same(got, scores.commit(*case.args, **case.kwargs)):
            return scores
    except (TypeError, ValueError):
        pass
    return other


def _describe_weights(got, expected) -> str:
    """What is wrong with the returned weights: the shape, or the largest
    difference and the row sums."""
    try:
        a = np.asarray(as_array(got), dtype=np.float64)
    except (TypeError, ValueError):
        return (
            "the output is right, but the second element of the pair is "
            f"{type(got).__name__}, not an array of weights"
        )
    e = np.asarray(as_array(expected), dtype=np.float64)
    if a.shape != e.shape:
        return (
            "the output is right, but the weights you returned have shape "
            f"{a.shape}, expected {e.shape} (..., n_q, n_k)"
        )
    with np.errstate(invalid="ignore"):
        gap = np.nanmax(np.abs(a - e)) if a.size else 0.0
        sums = a.sum(-1) if a.ndim else a
    sums = sums[np.isfinite(sums)]
    if sums.size:
        rows = (
            f"; their rows sum to {sums.min():.3g}..{sums.max():.3g}"
            if sums.min() != sums.max()
            else f"; their rows sum to {sums.min():.3g}"
        )
    else:
        rows = ""
    return (
        "the output is right, but the weights you returned differ from the "
        f"reference's (largest difference {gap:.3g}){rows}"
    )


def _check_weights(fn, cases) -> bool:
    """Where ``fn`` returns an ``(output, weights)`` pair, check its weights
    on every case; False where it returns the output alone. Runs after the
    outputs passed."""
    __tracebackhide__ = True
    for case in cases:
        expected = _reference_weights(
            *pristine(case.args), **pristine(case.kwargs)
        )
        given = fresh(case)
        with np.errstate(all="ignore"):
            out = fn(*given.args, **given.kwargs)
        if not isinstance(out, tuple) or len(out) != 2:
            return False
        if _same_weights(out[1], expected):
            continue
        raise ExerciseError(
            _ATTENTION,
            case.name,
            _describe_weights(out[1], expected),
            mistake=_weights_mistake(out[1], expected, case),
        )
    return True


_ATTENTION = "scaled dot-product attention"


def check_attention(fn) -> None:
    """Check ``fn(q, k, v, mask=None)`` returns ``softmax(q k^T / sqrt(d_k))
    v`` over a batch, with masked scores set to -inf and a zero output for a
    query whose every key is masked (or an ``(output, weights)`` pair, whose
    weights are then checked too: zeros or NaN on a fully masked query's
    row).

    q: (..., n_q, d_k), k: (..., n_k, d_k), v: (..., n_k, d_v); mask: bool,
    broadcastable to (..., n_q, n_k), True = may attend.
    """
    __tracebackhide__ = True
    cases = attention_cases()
    run_checks(
        _ATTENTION,
        fn,
        cases,
        lambda q, k, v, mask=None: scaled_dot_product_attention(
            q, k, v, mask=mask
        )[0],
        ATTENTION_MISTAKES,
        postprocess=_first,
        hint="out = softmax(s) @ v with s = q @ swapaxes(k, -1, -2) / "
        "sqrt(d_k), the masked scores set to -inf, and the softmax along the "
        "last axis (the keys); check the shapes: scores (..., n_q, n_k), "
        "output (..., n_q, d_v)",
        quiet=True,
    )
    pair = _check_weights(fn, cases)
    weights = ", the weights it returned included" if pair else ""
    print(f"Correct: {_ATTENTION} passes all {len(cases)} cases{weights}.")


# --- the causal mask -------------------------------------------------------

CAUSAL_MISTAKES = [
    Mistake(
        "diagonal_hidden",
        "the mask is off by one: each position cannot attend to itself",
        "query i may attend to keys 0..i inclusive: the diagonal (j = i), "
        "each position's own key, stays visible",
        lambda n: np.tril(np.ones((n, n), bool), k=-1),
    ),
    Mistake(
        "inverted",
        "True marks the masked positions; the book's convention is True = may "
        "attend",
        "negate your mask, or build the lower triangle directly",
        lambda n: ~np.tril(np.ones((n, n), bool)),
    ),
    Mistake(
        "transposed",
        "the mask lets each query see the future (upper triangle) instead of "
        "the past",
        "row i is query i; the allowed keys j satisfy j <= i",
        lambda n: np.triu(np.ones((n, n), bool)),
    ),
    Mistake(
        "one_ahead",
        "the mask is off by one the other way: each position also sees the "
        "next one",
        "use j <= i, not j <= i + 1",
        lambda n: np.tril(np.ones((n, n), bool), k=1),
    ),
    Mistake(
        "no_mask",
        "every entry is True: nothing is hidden, so each position sees the "
        "future",
        "query i may see only the keys j <= i: itself and its past",
        lambda n: np.ones((n, n), bool),
    ),
    Mistake(
        "flipped",
        "the mask is flipped left to right: the anti-diagonal triangle, not "
        "the lower one",
        "row i may see keys j <= i, counted from the left (key 0), with no "
        "flip",
        lambda n: np.fliplr(np.tril(np.ones((n, n), bool))),
    ),
    Mistake(
        "two_ahead",
        "the mask is off by two: each position also sees the next two",
        "use j <= i, not j <= i + 2: a position sees itself and its past, "
        "nothing after it",
        lambda n: np.tril(np.ones((n, n), bool), k=2),
    ),
    Mistake(
        "diagonal_only",
        "only the diagonal is True: each position sees itself and nothing "
        "before it",
        "query i may attend to every key j <= i, not only to j = i",
        lambda n: np.eye(n, dtype=bool),
    ),
]


CAUSAL_MISTAKES.append(
    Mistake(
        "float_mask",
        FLOAT_MASK_DESCRIPTION,
        FLOAT_MASK_HINT,
        lambda n: np.tril(np.ones((n, n))),
    )
)
CAUSAL_MISTAKES.append(
    Mistake(
        "int_mask",
        INT_MASK_DESCRIPTION,
        INT_MASK_HINT,
        lambda n: np.tril(np.ones((n, n), np.int64)),
    )
)
CAUSAL_MISTAKES.append(
    Mistake(
        "fixed_size",
        "the mask is cut from an array of a fixed size (8 x 8): right for n "
        "<= 8, but for a longer sequence it keeps the fixed array's shape and "
        "misses the later positions",
        "build the mask from n itself, np.arange(n) for the query and the key "
        "indices, so that it is (n, n) for every n",
        lambda n: np.tril(np.ones((8, 8), bool))[:n, :n],
    )
)
CAUSAL_MISTAKES.append(
    Mistake(
        "fixed_size",
        "the mask is cut from an array of a fixed size (1024 x 1024, a usual "
        "context length): right for n <= 1024, but for a longer sequence it "
        "keeps the fixed array's shape and misses the later positions",
        "build the mask from n itself, np.arange(n) for the query and the key "
        "indices, so that it is (n, n) for every n",
        lambda n: np.tril(np.ones((1024, 1024), bool))[:n, :n],
    )
)
# the other power-of-two buffers the n = 4100 case reaches (a larger one
# escapes any finite list of cases; issue 31, student report 07 met 4096)
for _size in (16, 32, 64, 128, 256, 512, 2048, 4096):
    CAUSAL_MISTAKES.append(
        Mistake(
            "fixed_size",
            f"the mask is cut from an array of a fixed size ({_size} x "
            f"{_size}): right for n <= {_size}, but for a longer sequence it "
            "keeps the fixed array's shape and misses the later positions",
            "build the mask from n itself, np.arange(n) for the query and "
            "the key indices, so that it is (n, n) for every n",
            lambda n, size=_size: np.tril(np.ones((size, size), bool))[:n, :n],
        )
    )
CAUSAL_MISTAKES.append(
    Mistake(
        "squeezed",
        "the mask is right for n >= 2 but loses its shape for a single "
        "position: squeezed, "
        "the (1, 1) mask of n = 1 becomes a 0-d array",
        "return an (n, n) array for every n, with no squeeze(): for n = 1 the "
        "one query sees its own key, [[True]]",
        lambda n: np.tril(np.ones((n, n), bool)).squeeze(),
    )
)
# a mask built for a batch (and heads): right values, extra leading axes of
# size 1 (issue 31, student report s12d met (1, n, n))
for _lead, _shape in (((1,), "(1, n, n)"), ((1, 1), "(1, 1, n, n)")):
    CAUSAL_MISTAKES.append(
        Mistake(
            "batch_axis",
            "the mask's values are right, but it has leading axes of size 1 "
            f"that the exercise does not ask for: shape {_shape}, as if for a "
            "batch, instead of (n, n)",
            "return the (n, n) mask itself, one row per query and one column "
            "per key, without [None] or unsqueeze: the attention that uses it "
            "broadcasts it over a batch and heads",
            lambda n, lead=_lead: np.tril(np.ones((n, n), bool)).reshape(
                lead + (n, n)
            ),
        )
    )


def check_causal_mask(fn) -> None:
    """Check ``fn(n)`` returns the (n, n) boolean causal mask, True = may
    attend.

    The mask must be boolean. A float mask of 1.0 and 0.0 is rejected:
    PyTorch's ``scaled_dot_product_attention`` would add it to the scores
    instead of masking them. So is an integer 0/1 mask: attnbook's attention
    and PyTorch reject it, and ``~`` on it is bitwise NOT.
    """
    # informative sizes first; 13 beyond a small fixed buffer, 4100 beyond
    # the power-of-two buffers up to 4096 (a larger buffer escapes any
    # finite list of cases)
    cases = [Case(f"n = {n}", (n,)) for n in (5, 13, 4100, 1)]
    run_checks(
        "causal mask",
        fn,
        cases,
        lambda n: causal_mask(n),
        CAUSAL_MISTAKES,
        postprocess=as_array,
        compare=same_mask,
        describe=describe_mask,
    )
