"""The online-softmax checkers reject each classic mistake and pass correct
solutions.

The wrong solutions are written here independently of the checkers' Mistake
functions, the way a reader might write them (loops, Python floats, math.exp
where it is safe).
"""

import math

import numpy as np
import pytest

from attnbook.exercises import ExerciseError, NotAttemptedError
from attnbook.exercises.flash import (
    check_merge_softmax_states,
    check_online_softmax,
)


# --- merging two states ------------------------------------------------------


def merge_good(m_a, l_a, m_b, l_b):
    m = np.maximum(m_a, m_b)
    ref = np.where(m == -np.inf, 0.0, m)
    return m, l_a * np.exp(m_a - ref) + l_b * np.exp(m_b - ref)


def merge_via_logaddexp(m_a, l_a, m_b, l_b):
    """A different correct route: log-sum-exps add with logaddexp; empty states
    map to l = 0."""
    with np.errstate(divide="ignore"):
        lse = np.logaddexp(m_a + np.log(l_a), m_b + np.log(l_b))
    m = np.maximum(m_a, m_b)
    return m, np.where(
        np.isneginf(lse), 0.0, np.exp(lse - np.where(np.isneginf(m), 0.0, m))
    )


def merge_adds_sums(m_a, l_a, m_b, l_b):
    return np.maximum(m_a, m_b), np.add(l_a, l_b)


def merge_rescales_old_only(m_a, l_a, m_b, l_b):
    m = np.maximum(m_a, m_b)
    return m, l_a * np.exp(m_a - m) + l_b


def merge_rescales_new_only(m_a, l_a, m_b, l_b):
    m = np.maximum(m_a, m_b)
    return m, l_a + l_b * np.exp(m_b - m)


def merge_upside_down(m_a, l_a, m_b, l_b):
    m = np.maximum(m_a, m_b)
    return m, l_a / np.exp(m_a - m) + l_b / np.exp(m_b - m)


def merge_keeps_first_max(m_a, l_a, m_b, l_b):
    return m_a, l_a + l_b * np.exp(np.subtract(m_b, m_a))


def merge_without_shift(m_a, l_a, m_b, l_b):
    return np.maximum(m_a, m_b), l_a * np.exp(m_a) + l_b * np.exp(m_b)


def merge_unguarded(m_a, l_a, m_b, l_b):
    m = np.maximum(m_a, m_b)
    return m, l_a * np.exp(m_a - m) + l_b * np.exp(m_b - m)


def test_merge_correct_solutions_pass(capsys):
    check_merge_softmax_states(merge_good)
    check_merge_softmax_states(merge_via_logaddexp)
    assert capsys.readouterr().out.count("Correct") == 2


def merge_returns_stand_in(m_a, l_a, m_b, l_b):
    """Wrong: the guard's finite stand-in is returned as the maximum, so two
    empty states give (0, 0)."""
    ms = np.where(np.isneginf(np.maximum(m_a, m_b)), 0.0, np.maximum(m_a, m_b))
    return ms, l_a * np.exp(m_a - ms) + l_b * np.exp(m_b - ms)


def merge_zero_for_empty(m_a, l_a, m_b, l_b):
    """Wrong: an empty result reported with the maximum 0."""
    m, l = merge_good(m_a, l_a, m_b, l_b)
    return np.where(l == 0, 0.0, m), l


def merge_guarded_rescales_old_only(m_a, l_a, m_b, l_b):
    m = np.maximum(m_a, m_b)
    # the chapter's guard, copied
    m_f = np.where(np.isneginf(m), 0, m)
    return m, l_a * np.exp(m_a - m_f) + l_b


def merge_guarded_keeps_first_max(m_a, l_a, m_b, l_b):
    # the chapter's guard, on the kept maximum
    m_f = np.where(np.isneginf(m_a), 0, m_a)
    return m_a, l_a + l_b * np.exp(m_b - m_f)


def test_an_empty_state_reported_as_zero_is_not_empty():
    """From an expert reading of chapter 9: returning the stand-in 0 as the
    maximum of two empty states passed. (0, 0) is not the empty state: merged
    with (-800, 1) it loses that block's mass."""
    from attnbook.online_softmax import SoftmaxState, merge_softmax_states

    lost = merge_softmax_states(
        SoftmaxState(np.float64(0.0), np.float64(0.0)),
        SoftmaxState(np.float64(-800.0), np.float64(1.0)),
    )
    # the mass of the second block is gone
    assert float(lost.sum) == 0.0
    for wrong in (merge_returns_stand_in, merge_zero_for_empty):
        with pytest.raises(ExerciseError) as err, np.errstate(all="ignore"):
            check_merge_softmax_states(wrong)
        assert err.value.mistake == "max_is_stand_in"


@pytest.mark.parametrize(
    "wrong, key",
    [
        (merge_adds_sums, "no_rescale"),
        (merge_rescales_old_only, "only_a_rescaled"),
        (merge_rescales_new_only, "only_b_rescaled"),
        (merge_upside_down, "inverted_factor"),
        (merge_keeps_first_max, "max_not_updated"),
        (merge_without_shift, "unshifted"),
        (merge_unguarded, "nan_on_empty"),
        # with the guard, from the expert reading
        (merge_guarded_rescales_old_only, "only_a_rescaled"),
        (merge_guarded_keeps_first_max, "max_not_updated"),
        (merge_returns_stand_in, "max_is_stand_in"),
    ],
)
def test_merge_mistakes_are_diagnosed(wrong, key):
    with pytest.raises(ExerciseError) as err, np.errstate(all="ignore"):
        check_merge_softmax_states(wrong)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value) and "Hint" in str(err.value)


def test_merge_returning_something_else_is_rejected():
    with pytest.raises(ExerciseError, match="pair"):
        check_merge_softmax_states(lambda m_a, l_a, m_b, l_b: l_a + l_b)


def test_merge_stub_is_not_attempted():
    def stub(m_a, l_a, m_b, l_b):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_merge_softmax_states(stub)


# --- the one-pass online softmax (a stream read once; the answer is the state
# (m, l)) --------


def online_good(scores):
    m, l = -math.inf, 0.0
    for xj in scores:
        m_new = max(m, xj)
        if m_new == -math.inf:  # nothing visible yet
            continue
        l = l * math.exp(m - m_new) + math.exp(xj - m_new)
        m = m_new
    return m, l


def online_good_blocks(scores):
    # the same recurrence, a block of 4 scores at a time, with the package's
    # state type
    from attnbook.online_softmax import (
        SoftmaxState,
        merge_softmax_states,
        softmax_state,
    )

    state, block = SoftmaxState(np.float64(-np.inf), np.float64(0.0)), []
    for xj in scores:
        block.append(xj)
        if len(block) == 4:
            state, block = (
                merge_softmax_states(state, softmax_state(np.array(block))),
                [],
            )
    return (
        merge_softmax_states(state, softmax_state(np.array(block)))
        if block
        else state
    )


def online_two_pass(scores):
    m = max(scores)  # first pass
    # second pass: the stream is empty now
    return m, sum(math.exp(xj - m) for xj in scores)


def online_stored(scores):
    # keeps the whole row, then two passes over it
    x = np.fromiter(scores, float)
    m = x.max()
    return m, np.exp(x - (m if np.isfinite(m) else 0.0)).sum()


def online_forgets_rescale(scores):
    m, l = -math.inf, 0.0
    for xj in scores:
        m = max(m, xj)
        if m > -math.inf:
            l += math.exp(xj - m)
    return m, l


def online_upside_down(scores):
    m, l = -math.inf, 0.0
    for xj in scores:
        m_new = max(m, xj)
        if m_new == -math.inf:
            continue
        l = (l * math.exp(m_new - m) if m > -math.inf else 0.0) + math.exp(
            xj - m_new
        )
        m = m_new
    return m, l


def online_fixed_max(scores):
    first, l = None, 0.0
    for xj in scores:
        first = xj if first is None else first
        l += np.exp(xj - first)
    return first, l


def online_fixed_at_first_visible(scores):
    """Wrong: the maximum is fixed at the first finite score (masked scores
    skipped), never updated."""
    first, l = None, 0.0
    for xj in scores:
        if xj == -math.inf:
            continue
        first = xj if first is None else first
        l += np.exp(xj - first)
    return (-math.inf, 0.0) if first is None else (first, l)


def online_unguarded(scores):
    m, l = -np.inf, 0.0
    for xj in scores:
        m_new = max(m, xj)
        l = l * np.exp(m - m_new) + np.exp(xj - m_new)
        m = m_new
    return m, l


def online_unshifted(scores):
    m, l = -math.inf, 0.0
    # the textbook sum, one term at a time
    for xj in scores:
        m = max(m, xj)
        l += math.exp(xj) if xj < 710 else math.inf
    return m, l


def test_online_correct_solutions_pass(capsys):
    check_online_softmax(online_good)
    check_online_softmax(online_good_blocks)
    assert capsys.readouterr().out.count("reads a long stream once") == 2


def test_online_stored_scores_are_rejected_by_memory():
    with pytest.raises(ExerciseError, match=r"stored the scores") as err:
        check_online_softmax(online_stored)
    assert "keep only m and l" in str(err.value)


@pytest.mark.parametrize(
    "wrong, key",
    [
        (online_two_pass, "two_pass"),
        (online_forgets_rescale, "no_rescale"),
        (online_upside_down, "inverted_factor"),
        (online_fixed_max, "max_not_updated"),
        # from the expert reading
        (online_fixed_at_first_visible, "max_not_updated"),
        (online_unguarded, "nan_on_masked_start"),
        (online_unshifted, "unshifted"),
    ],
)
def test_online_mistakes_are_diagnosed(wrong, key):
    with pytest.raises(ExerciseError) as err, np.errstate(all="ignore"):
        check_online_softmax(wrong)
    assert err.value.mistake == key


def test_online_unknown_error_is_still_rejected():
    with pytest.raises(ExerciseError) as err:
        check_online_softmax(
            lambda scores: online_good(xj / 2 for xj in scores)
        )
    assert err.value.mistake is None


# --- the catalogue (run by tests/test_exercises_framework.py) ----------------


def merge_in_place(m_a, l_a, m_b, l_b):
    """Right: rescales the caller's l_a and l_b in place."""
    m = np.maximum(m_a, m_b)
    ref = np.where(np.isneginf(m), 0.0, m)
    l_a = np.asarray(l_a)
    l_b = np.asarray(l_b)
    if l_a.ndim:
        l_a *= np.exp(m_a - ref)
        l_b *= np.exp(m_b - ref)
        return m, l_a + l_b
    return m, l_a * np.exp(m_a - ref) + l_b * np.exp(m_b - ref)


def merge_python_loop(m_a, l_a, m_b, l_b):
    """Right: one query at a time with math, as a loop over states would be
    written."""
    ms, ls = [], []
    for ma, la, mb, lb in zip(
        *(np.atleast_1d(np.asarray(x, float)) for x in (m_a, l_a, m_b, l_b))
    ):
        m = max(ma, mb)
        if m == -math.inf:
            ms.append(m), ls.append(0.0)
            continue
        ms.append(m), ls.append(la * math.exp(ma - m) + lb * math.exp(mb - m))
    return np.array(ms).reshape(np.shape(m_a)), np.array(ls).reshape(
        np.shape(m_a)
    )


def merge_max_from_zero(m_a, l_a, m_b, l_b):
    # "a maximum starts at 0"
    m = np.maximum(np.maximum(m_a, m_b), 0.0)
    return m, l_a * np.exp(m_a - m) + l_b * np.exp(m_b - m)


def online_max_from_zero(scores):
    # started at 0 instead of -inf
    m, l = 0.0, 0.0
    for xj in scores:
        m_new = max(m, xj)
        l = l * math.exp(m - m_new) + math.exp(xj - m_new)
        m = m_new
    return m, l


def online_logaddexp(scores):
    """Right, and written differently: the running log-sum-exp, with the
    maximum kept beside it."""
    m, lse = -np.inf, -np.inf
    for xj in scores:
        m, lse = max(m, xj), np.logaddexp(lse, xj)
    return m, (0.0 if m == -np.inf else float(np.exp(lse - m)))


CATALOGUE = {
    "check_merge_softmax_states": {
        "right": [
            merge_good,
            merge_via_logaddexp,
            merge_in_place,
            merge_python_loop,
        ],
        "wrong": [
            (merge_adds_sums, "no_rescale"),
            (merge_rescales_old_only, "only_a_rescaled"),
            (merge_rescales_new_only, "only_b_rescaled"),
            (merge_upside_down, "inverted_factor"),
            (merge_keeps_first_max, "max_not_updated"),
            (merge_without_shift, "unshifted"),
            (merge_unguarded, "nan_on_empty"),
            (merge_max_from_zero, "max_at_least_zero"),
            (merge_returns_stand_in, "max_is_stand_in"),
            (merge_guarded_rescales_old_only, "only_a_rescaled"),
            (merge_guarded_keeps_first_max, "max_not_updated"),
        ],
    },
    "check_online_softmax": {
        "right": [online_good, online_good_blocks, online_logaddexp],
        "wrong": [
            (online_two_pass, "two_pass"),
            (online_forgets_rescale, "no_rescale"),
            (online_upside_down, "inverted_factor"),
            (online_fixed_max, "max_not_updated"),
            (online_unguarded, "nan_on_masked_start"),
            (online_unshifted, "unshifted"),
            (online_max_from_zero, "max_starts_at_zero"),
            (online_fixed_at_first_visible, "max_not_updated"),
        ],
    },
}


def online_log_of_sum(scores):
    m, l = -math.inf, 0.0
    for xj in scores:
        m_new = max(m, xj)
        if m_new == -math.inf:
            continue
        l, m = l * math.exp(m - m_new) + math.exp(xj - m_new), m_new
    # returns the log of the sum
    return m, (math.log(l) if l > 0 else -math.inf)


CATALOGUE["check_online_softmax"]["wrong"].append(
    (online_log_of_sum, "log_of_sum")
)


def test_float32_accumulators_are_accepted_and_a_float32_stored_row_is_not():
    """From an expert reading of chapter 9: the book's algorithm with float32
    accumulators was rejected (the tolerance was 1e-9), and a row stored in
    float32 (400 KB) fitted under the old memory limit."""
    import numpy as np
    import pytest

    from attnbook.exercises import ExerciseError
    from attnbook.exercises.flash import check_online_softmax

    def float32_state(scores):
        m, l = np.float32(-np.inf), np.float32(0.0)
        for x in scores:
            x = np.float32(x)
            m_new = max(m, x)
            if m_new == -np.inf:
                continue
            l = l * np.exp(m - m_new) + np.exp(x - m_new)
            m = m_new
        return m, l

    def stored_float32(scores):
        row = np.fromiter(scores, dtype=np.float32)
        m = row.max()
        return m, np.exp(row - m).sum() if np.isfinite(m) else 0.0

    check_online_softmax(float32_state)
    with pytest.raises(ExerciseError, match="stored the scores"):
        check_online_softmax(stored_float32)


def test_a_row_stored_in_float32_is_rejected_with_its_own_size():
    """From an expert reading of chapter 9 (session 4): the memory check
    rightly rejects a row stored in float32, but its message said the scores
    took "8 bytes or more each" (a float32 score takes 4); it now names
    the peak and the length of the stream, and no size per score."""
    import re

    def stored_float32(scores):
        # the reader's solution: the row kept in float32, then two passes
        row = np.fromiter(scores, dtype=np.float32)
        m = row.max()
        return m, np.exp(row - m).sum() if np.isfinite(m) else 0.0

    with pytest.raises(ExerciseError, match="stored the scores") as err:
        check_online_softmax(stored_float32)
    message = str(err.value)
    assert "8 bytes or more" not in message
    assert re.search(
        r"peak memory was [\d.]+ [KM]iB on a stream of 100,000 scores",
        message,
    ), message
    assert "keep only m and l" in message


# --- from the expert reading of chapter 9, session 3 -------------------------


def merge_returns_huge_negative(m_a, l_a, m_b, l_b):
    """Wrong: the kernels' stand-in -1e30 for -inf, returned as the maximum of
    two empty states."""
    m = np.maximum(np.maximum(m_a, m_b), -1e30)
    return m, l_a * np.exp(m_a - m) + l_b * np.exp(m_b - m)


def merge_returns_finfo_min(m_a, l_a, m_b, l_b):
    """Wrong: np.finfo(float).min as the stand-in, kept as the maximum of two
    empty states."""
    lowest = np.finfo(float).min
    m = np.where(
        np.isneginf(np.maximum(m_a, m_b)), lowest, np.maximum(m_a, m_b)
    )
    return m, l_a * np.exp(m_a - m) + l_b * np.exp(m_b - m)


def online_new_term_old_max(scores):
    """Wrong: the old sum is rescaled to the new maximum, but the new term is
    taken against the old one."""
    m, l = -math.inf, 0.0
    for xj in scores:
        # first visible score starts the state
        if m == -math.inf:
            if xj != -math.inf:
                m, l = xj, 1.0
            continue
        m_new = max(m, xj)
        with np.errstate(over="ignore"):
            # should be xj - m_new
            l = l * math.exp(m - m_new) + float(np.exp(xj - m))
        m = m_new
    return m, l


def online_reset_on_new_max(scores):
    """Wrong: a new maximum starts the sum again at 1, dropping the earlier
    scores' mass."""
    m, l = -math.inf, 0.0
    for xj in scores:
        if xj > m:
            m, l = xj, 1.0
        elif xj != -math.inf:
            l += math.exp(xj - m)
    return m, l


def online_returns_lse(scores):
    """Wrong: returns the log-sum-exp m + log(l) as the second entry."""
    m, l = -math.inf, 0.0
    for xj in scores:
        m_new = max(m, xj)
        if m_new == -math.inf:
            continue
        l, m = l * math.exp(m - m_new) + math.exp(xj - m_new), m_new
    return m, (m + math.log(l) if l > 0 else -math.inf)


NEW_WRONG = {
    "check_merge_softmax_states": [
        (merge_returns_huge_negative, "max_is_stand_in"),
        (merge_returns_finfo_min, "max_is_stand_in"),
    ],
    "check_online_softmax": [
        (online_new_term_old_max, "new_term_old_max"),
        (online_reset_on_new_max, "reset_on_new_max"),
        (online_returns_lse, "returns_lse"),
    ],
}
for _name, _wrong in NEW_WRONG.items():
    CATALOGUE[_name]["wrong"].extend(_wrong)


@pytest.mark.parametrize("wrong, key", NEW_WRONG["check_merge_softmax_states"])
def test_merge_any_finite_stand_in_is_named(wrong, key):
    """Any finite stand-in returned as an empty maximum is named, not only 0
    (the old checker gave -1e30 and np.finfo(float).min the generic hint)."""
    with pytest.raises(ExerciseError) as err, np.errstate(all="ignore"):
        check_merge_softmax_states(wrong)
    assert err.value.mistake == key


@pytest.mark.parametrize("wrong, key", NEW_WRONG["check_online_softmax"])
def test_online_new_mistakes_are_named(wrong, key):
    with pytest.raises(ExerciseError) as err, np.errstate(all="ignore"):
        check_online_softmax(wrong)
    assert err.value.mistake == key


def test_merge_wrong_shape_names_m_and_l():
    """A loop that returns shape (1,) for scalar states: the message names the
    shape of m and l, not of the stacked pair (the old message said "expected
    shape (2,), got (2, 1)")."""

    def merge_always_1d(m_a, l_a, m_b, l_b):
        m_a, l_a, m_b, l_b = (
            np.atleast_1d(np.asarray(x, float)) for x in (m_a, l_a, m_b, l_b)
        )
        return merge_good(m_a, l_a, m_b, l_b)

    with pytest.raises(ExerciseError) as err:
        check_merge_softmax_states(merge_always_1d)
    assert "your m and l have shape (1,)" in str(
        err.value
    ) and "the inputs' shape is ()" in str(err.value)
    assert "(2, 1)" not in str(err.value)


# --- from the fourth expert reading of chapter 9, session 3: tied maxima -----


def merge_strict_branches(m_a, l_a, m_b, l_b):
    """Wrong (the reader's): strict comparisons only, so where m_a == m_b b's
    sum is dropped."""
    l = np.where(
        m_a > m_b,
        l_a + l_b * np.exp(m_b - m_a),
        np.where(m_b > m_a, l_b + l_a * np.exp(m_a - m_b), l_a),
    )
    return np.maximum(m_a, m_b), l


def merge_branches_with_ties(m_a, l_a, m_b, l_b):
    """Right: the same branches, with the tie sent to the first one (>=), and
    two empty states kept empty."""
    m_a, l_a, m_b, l_b = (np.asarray(x, float) for x in (m_a, l_a, m_b, l_b))
    with np.errstate(invalid="ignore", over="ignore"):
        l = np.where(
            m_a >= m_b,
            l_a + l_b * np.exp(np.where(np.isneginf(m_a), 0.0, m_b - m_a)),
            l_b + l_a * np.exp(m_a - m_b),
        )
    l = np.where(np.isneginf(np.maximum(m_a, m_b)), 0.0, l)
    return np.maximum(m_a, m_b), l


def online_strict_branches(scores):
    """Wrong (the reader's): a score equal to the running maximum falls in
    neither branch."""
    m, l = -math.inf, 0.0
    for x in scores:
        if x < m:
            l += math.exp(x - m)
        elif x > m:
            l = l * math.exp(m - x) + 1.0
            m = x
    return m, l


def online_branches_with_ties(scores):
    """Right: the same branches with <=, so a repeated maximum adds exp(0) =
    1."""
    m, l = -math.inf, 0.0
    for x in scores:
        if x == -math.inf:
            continue
        if x <= m:
            l += math.exp(x - m)
        else:
            l = l * math.exp(m - x) + 1.0
            m = x
    return m, l


def merge_strict_keeps_b(m_a, l_a, m_b, l_b):
    """Wrong (fifth reading): if/elif/else, the else (the tie) keeps only b's
    sum."""
    m_a, l_a, m_b, l_b = (np.asarray(x, float) for x in (m_a, l_a, m_b, l_b))
    m, l = np.maximum(m_a, m_b), l_b.copy()
    bigger_a, bigger_b = m_a > m_b, m_b > m_a
    l[bigger_a] = (l_a + l_b * np.exp(m_b - m_a))[bigger_a]
    l[bigger_b] = (l_b + l_a * np.exp(m_a - m_b))[bigger_b]
    return m, l


def merge_strict_from_zeros(m_a, l_a, m_b, l_b):
    """Wrong (fifth reading): l starts at zeros and neither strict branch
    writes the tie, so it stays 0."""
    m_a, l_a, m_b, l_b = (np.asarray(x, float) for x in (m_a, l_a, m_b, l_b))
    l = np.zeros(np.broadcast(m_a, m_b).shape)
    with np.errstate(all="ignore"):
        l = np.where(m_a > m_b, l_a + l_b * np.exp(m_b - m_a), l)
        l = np.where(m_b > m_a, l_b + l_a * np.exp(m_a - m_b), l)
    return np.maximum(m_a, m_b), l


TIE_WRONG = {
    "check_merge_softmax_states": [
        (merge_strict_branches, "tie_dropped"),
        (merge_strict_keeps_b, "tie_dropped"),
        (merge_strict_from_zeros, "tie_dropped"),
    ],
    "check_online_softmax": [(online_strict_branches, "tie_dropped")],
}
for _name, _wrong in TIE_WRONG.items():
    CATALOGUE[_name]["wrong"].extend(_wrong)
CATALOGUE["check_merge_softmax_states"]["right"].append(
    merge_branches_with_ties
)
CATALOGUE["check_online_softmax"]["right"].append(online_branches_with_ties)


def test_strict_branches_wrong_on_ties():
    """The two wrong answers really are wrong: a tie loses one state's (or one
    score's) mass."""
    # the answer is (1, 2)
    assert online_strict_branches(iter([1.0, 1.0])) == (1.0, 1.0)
    m, l = merge_strict_branches(
        np.float64(1.0), np.float64(1.0), np.float64(1.0), np.float64(1.0)
    )
    # the answer is (1, 2)
    assert (float(m), float(l)) == (1.0, 1.0)


@pytest.mark.parametrize(
    "check, wrong, key",
    [
        (check_merge_softmax_states, merge_strict_branches, "tie_dropped"),
        (check_merge_softmax_states, merge_strict_keeps_b, "tie_dropped"),
        (check_merge_softmax_states, merge_strict_from_zeros, "tie_dropped"),
        (check_online_softmax, online_strict_branches, "tie_dropped"),
    ],
)
def test_tied_maxima_dropped_are_named(check, wrong, key):
    """Both checkers accepted these (no case had two equal finite maxima); now
    they are rejected, named."""
    with pytest.raises(ExerciseError) as err, np.errstate(all="ignore"):
        check(wrong)
    assert err.value.mistake == key
    assert "equal" in str(err.value)


def test_branches_with_ties_pass(capsys):
    check_merge_softmax_states(merge_branches_with_ties)
    check_online_softmax(online_branches_with_ties)
    assert capsys.readouterr().out.count("Correct") == 2
