"""Checkers for the online softmax (chapter 9): merging two partial states, and
the one-pass recurrence."""

from __future__ import annotations

import numpy as np

from ..online_softmax import SoftmaxState, merge_softmax_states, softmax_state
from ._framework import (
    Case,
    ExerciseError,
    Mistake,
    difference,
    run_checks,
    same,
)

_inf = np.inf


# --- merging two softmax states --------------------------------------------


def _merge_reference(m_a, l_a, m_b, l_b):
    return merge_softmax_states(
        SoftmaxState(np.asarray(m_a, float), np.asarray(l_a, float)),
        SoftmaxState(np.asarray(m_b, float), np.asarray(l_b, float)),
    )


def _as_state(out) -> np.ndarray:
    """The reader's ``(m, l)`` as one float array of shape (2, ...)."""
    if isinstance(out, np.ndarray) and out.ndim >= 1 and len(out) == 2:
        out = tuple(out)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(
            "return the merged state as a pair (m, l); got "
            f"{type(out).__name__}"
        )
    m, l = np.broadcast_arrays(
        np.asarray(out[0], float), np.asarray(out[1], float)
    )
    return np.stack([m, l])


def _same_state(got, expected) -> bool:
    """Sums and maxima agree everywhere, an empty state's maximum included.

    An empty state must be ``(-inf, 0)``: a state ``(0, 0)`` (the finite
    stand-in returned as the maximum) is not empty, since merging it with a
    block whose maximum is far below 0 loses that block's mass: ``(0, 0)`` and
    ``(-800, 1)`` merge to ``(0, e^-800) = (0, 0)``, not ``(-800, 1)``.

    Which finite stand-in a state reports as an empty maximum (0, -1e30,
    ``np.finfo(float).min``) is the reader's choice, so two such states, ``(c,
    0)`` and ``(c', 0)`` with ``c`` and ``c'`` finite, count as the same
    mistake. The reference never returns one (its empty state is ``(-inf, 0)``,
    and every other state has ``l > 0``), so this matches a reader's output
    with a mistake's, never a wrong answer with the reference.
    """
    got, expected = _as_state(got), _as_state(expected)
    if got.shape != expected.shape or np.isnan(got[0]).any():
        return False
    stand_in = _stand_in_empty(got) & _stand_in_empty(expected)
    return same(got[1], expected[1]) and same(
        np.where(stand_in, 0.0, got[0]), np.where(stand_in, 0.0, expected[0])
    )


def _stand_in_empty(state: np.ndarray) -> np.ndarray:
    """Where a stacked state ``(m, l)`` is empty (``l = 0``) but reports a
    finite maximum."""
    return np.isfinite(state[0]) & (state[1] == 0)


def _describe_state(got, expected, case=None) -> str:
    """What differs between two merged states; a wrong shape is named as the
    shape of m and l."""
    got_s, expected_s = _as_state(got), _as_state(expected)
    if got_s.shape != expected_s.shape:
        return (
            f"your m and l have shape {got_s.shape[1:]} (broadcast together), "
            "the inputs' shape is "
            f"{expected_s.shape[1:]}: return one m and one l per state, of "
            "the inputs' shape"
        )
    return difference(got_s, expected_s, case)


def _finite(m):
    """The empty-state guard of the chapter's solution: a finite stand-in (0)
    where ``m`` is -inf."""
    return np.where(np.isneginf(m), 0.0, m)


def _merge_with(rule, guard=True):
    """A merge whose new max is ``max(m_a, m_b)`` and whose sum is ``rule(m_a,
    l_a, m_b, l_b, m)``.

    With ``guard``, ``rule`` sees the chapter's finite stand-in for an empty
    maximum, as a reader who copied the guard but made another mistake would
    write it: such a mistake merges two empty states correctly, so it is named
    when the reader's function does too.
    """

    def merge(m_a, l_a, m_b, l_b):
        m_a, l_a, m_b, l_b = (
            np.asarray(x, float) for x in (m_a, l_a, m_b, l_b)
        )
        m = np.maximum(m_a, m_b)
        return m, rule(m_a, l_a, m_b, l_b, _finite(m) if guard else m)

    return merge


def _merge_min(m_a, l_a, m_b, l_b):
    """The merge with the smaller maximum (guarded like the chapter's)."""
    m_a, l_a, m_b, l_b = (np.asarray(x, float) for x in (m_a, l_a, m_b, l_b))
    m = np.minimum(m_a, m_b)
    shift = _finite(m)
    return m, l_a * np.exp(m_a - shift) + l_b * np.exp(m_b - shift)


def _merge_shift_by_m_a(m_a, l_a, m_b, l_b):
    """Both sums moved to m_a (a finite stand-in where it is -inf), then the
    total to the maximum: exp(m_b - m_a) overflows on maxima far apart."""
    m_a, l_a, m_b, l_b = (np.asarray(x, float) for x in (m_a, l_a, m_b, l_b))
    m = np.maximum(m_a, m_b)
    with np.errstate(over="ignore", invalid="ignore"):
        total = l_a + l_b * np.exp(m_b - _finite(m_a))
        return m, total * np.exp(_finite(m_a) - _finite(m))


def _strict_merge(m_a, l_a, m_b, l_b, keep="a"):
    """Strict comparisons only: where the two maxima are equal (and finite),
    one sum is kept (a's, b's) or neither ("none": l started at zeros and no
    branch writes the tie)."""
    m_a, l_a, m_b, l_b = (np.asarray(x, float) for x in (m_a, l_a, m_b, l_b))
    tie = {"a": l_a, "b": l_b, "none": np.zeros_like(l_a)}[keep]
    with np.errstate(all="ignore"):
        l = np.where(
            m_a > m_b,
            l_a + l_b * np.exp(m_b - m_a),
            np.where(m_b > m_a, l_b + l_a * np.exp(m_a - m_b), tie),
        )
    return np.maximum(m_a, m_b), l


def _max_is_stand_in(m_a, l_a, m_b, l_b):
    """Right sums, but the finite stand-in is returned as the maximum of two
    empty states."""
    m_a, l_a, m_b, l_b = (np.asarray(x, float) for x in (m_a, l_a, m_b, l_b))
    m = _finite(np.maximum(m_a, m_b))
    return m, l_a * np.exp(m_a - m) + l_b * np.exp(m_b - m)


def _merge_returns_lse(m_a, l_a, m_b, l_b):
    """The right merge, but returning the log-sum-exp ``m + log(l)`` (-inf
    for an empty state) in place of ``l``."""
    m, l = _merge_reference(m_a, l_a, m_b, l_b)
    m, l = np.asarray(m, float), np.asarray(l, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1.0)), -np.inf)
    return m, lse


# Mistakes that are right except on an edge case come first: on a case where
# they are wrong, other mistakes can produce the same NaN.
MERGE_MISTAKES = [
    Mistake(
        "nan_on_empty",
        "merging two empty states gives NaN: exp(-inf - (-inf)) is exp(NaN)",
        "an empty state (a fully masked block) is (m=-inf, l=0); where the "
        "new maximum is -inf, subtract a finite stand-in for it instead, so "
        "that the factors become exp(-inf - stand-in) = 0",
        _merge_with(
            lambda m_a, l_a, m_b, l_b, m: (
                l_a * np.exp(m_a - m) + l_b * np.exp(m_b - m)
            ),
            guard=False,
        ),
    ),
    Mistake(
        "max_is_stand_in",
        "two empty states merge to a finite maximum (a stand-in for -inf, "
        "such as 0, "
        "-1e30 or np.finfo(float).min), not to the empty state (-inf, 0): "
        "merged later with a block whose "
        "maximum is far below it, that block's sum underflows to 0 and its "
        "mass is lost",
        "use the finite stand-in only inside the exponentials; return the "
        "true maximum max(m_a, m_b), "
        "which is -inf for two empty states",
        _max_is_stand_in,
    ),
    Mistake(
        "no_rescale",
        "the two sums are added as they are: each was computed relative to "
        "its own maximum",
        "move both sums to the new maximum m first: l = l_a * exp(m_a - m) + "
        "l_b * exp(m_b - m)",
        _merge_with(lambda m_a, l_a, m_b, l_b, m: l_a + l_b),
    ),
    Mistake(
        "only_a_rescaled",
        "only the first sum is rescaled; the second is wrong whenever b's "
        "maximum is not the larger",
        "both states must be moved to the new maximum; the factor is 1 only "
        "for the state that holds it",
        _merge_with(lambda m_a, l_a, m_b, l_b, m: l_a * np.exp(m_a - m) + l_b),
    ),
    Mistake(
        "only_b_rescaled",
        "only the second sum is rescaled; the first is wrong whenever a's "
        "maximum is not the larger",
        "both states must be moved to the new maximum; the factor is 1 only "
        "for the state that holds it",
        _merge_with(lambda m_a, l_a, m_b, l_b, m: l_a + l_b * np.exp(m_b - m)),
    ),
    Mistake(
        "inverted_factor",
        "the rescaling factor is upside down: exp(m - m_old) instead of "
        "exp(m_old - m)",
        "a sum relative to m_old becomes relative to a larger m by "
        "multiplying by exp(m_old - m) <= 1",
        _merge_with(
            lambda m_a, l_a, m_b, l_b, m: (
                l_a * np.exp(m - m_a) + l_b * np.exp(m - m_b)
            )
        ),
    ),
    Mistake(
        "max_not_updated",
        "the merged maximum stays at the first state's maximum",
        "the new state's maximum is max(m_a, m_b); keeping m_a lets exp(m_b - "
        "m_a) overflow",
        lambda m_a, l_a, m_b, l_b: (
            np.asarray(m_a, float),
            np.asarray(l_a, float)
            + np.asarray(l_b, float)
            * np.exp(np.subtract(m_b, _finite(np.asarray(m_a, float)))),
        ),
    ),
    Mistake(
        "unshifted",
        "the sums are multiplied by exp(m_old) instead of exp(m_old - m): the "
        "maximum was never subtracted",
        "rescale relative to the new maximum, exp(m_a - m) and exp(m_b - m), "
        "so that nothing overflows",
        _merge_with(
            lambda m_a, l_a, m_b, l_b, m: l_a * np.exp(m_a) + l_b * np.exp(m_b)
        ),
    ),
    Mistake(
        "max_at_least_zero",
        "the merged maximum is never below 0 (a maximum started at 0, or "
        "clipped "
        "with max(..., 0)): where both states' scores are negative it is not "
        "their maximum",
        "the merged maximum is exactly max(m_a, m_b), which may be negative "
        "(or -inf for two empty states)",
        lambda m_a, l_a, m_b, l_b: (
            lambda m_a, l_a, m_b, l_b, m: (
                m,
                l_a * np.exp(m_a - m) + l_b * np.exp(m_b - m),
            )
        )(
            *(np.asarray(x, float) for x in (m_a, l_a, m_b, l_b)),
            np.maximum(
                np.maximum(np.asarray(m_a, float), np.asarray(m_b, float)), 0.0
            ),
        ),
    ),
    # the tie may keep a's sum, b's, or neither (l started at zeros): each is
    # the same mistake
    *[
        Mistake(
            "tie_dropped",
            "a state whose maximum equals the other's is dropped: the "
            "branches compare the maxima "
            "strictly (m_a > m_b, m_b > m_a), and where they are equal a sum "
            "is lost (one state's, or both)",
            "when m_a == m_b both sums count: l = l_a + l_b (both factors are "
            "1); the general formula "
            "l_a * exp(m_a - m) + l_b * exp(m_b - m) needs no branches at all",
            lambda *state, keep=keep: _strict_merge(*state, keep=keep),
        )
        for keep in ("a", "b", "none")
    ],
    Mistake(
        "scalar_as_array",
        "scalar states give 1-element arrays (shape (1,)), not scalars: "
        "the inputs were wrapped in arrays of one entry (np.array([m_a]), "
        "np.atleast_1d)",
        "compute on the inputs as they come (np.maximum, np.exp and np.where "
        "keep a scalar's shape ()), or return m[()] and l[()]; only arrays "
        "give arrays",
        lambda *state: tuple(
            np.atleast_1d(np.asarray(x, float))
            for x in _merge_reference(*state)
        ),
    ),
    # issue 31, student report 09: these two got the generic hint
    Mistake(
        "minimum_for_maximum",
        "the merged state takes the smaller maximum, min(m_a, m_b): the sum "
        "of the state with the larger maximum is then scaled by "
        "exp(m_big - m_small) > 1, which overflows when the maxima are far "
        "apart",
        "the merged maximum is the larger one, m = max(m_a, m_b): every "
        "score of the union is at most m, so both factors exp(m_a - m) and "
        "exp(m_b - m) are at most 1",
        _merge_min,
    ),
    Mistake(
        "shift_by_m_a",
        "the sums are moved to m_a first and only then to the maximum m: "
        "l_b * exp(m_b - m_a) overflows to inf when m_b exceeds m_a by more "
        "than about 709, before the second factor could bring it back",
        "move each sum straight to the common maximum: l = l_a * exp(m_a - "
        "m) + l_b * exp(m_b - m), where both exponents are at most 0",
        _merge_shift_by_m_a,
    ),
    Mistake(
        "returns_lse",
        "the second entry is the merged log-sum-exp m + log(l), not the sum l",
        "return l = l_a * exp(m_a - m) + l_b * exp(m_b - m) itself; m + "
        "log(l) is what the forward pass saves for the backward pass, but "
        "the state is the pair (m, l)",
        _merge_returns_lse,
    ),
]


def merge_cases() -> list[Case]:
    rng = np.random.default_rng(9)
    m_a, m_b = rng.normal(scale=3, size=5), rng.normal(scale=3, size=5)
    l_a, l_b = rng.uniform(1, 4, size=5), rng.uniform(1, 4, size=5)
    return [
        Case(
            "5 queries; the larger maximum is sometimes in a, sometimes in b",
            (m_a, l_a, m_b, l_b),
        ),
        Case(
            "scalar states (m_a=1.0, l_a=2.0) and (m_b=3.0, l_b=1.5)",
            (1.0, 2.0, 3.0, 1.5),
        ),
        Case(
            "maxima 1000 apart: exp(1000) overflows",
            (
                np.array([0.0, 1000.0]),
                np.array([2.0, 1.0]),
                np.array([1000.0, 0.0]),
                np.array([1.0, 3.0]),
            ),
        ),
        Case(
            "one state empty (a fully masked block: m=-inf, l=0), the other's "
            "scores all negative",
            (
                np.array([-_inf, -2.0]),
                np.array([0.0, 2.0]),
                np.array([-0.5, -_inf]),
                np.array([1.0, 0.0]),
            ),
        ),
        Case(
            "both states empty",
            (
                np.array([-_inf]),
                np.array([0.0]),
                np.array([-_inf]),
                np.array([0.0]),
            ),
        ),
        Case(
            "equal finite maxima: (1, 2) with (1, 1.5) and (-3, 0.5) with "
            "(-3, 4)",
            (
                np.array([1.0, -3.0]),
                np.array([2.0, 0.5]),
                np.array([1.0, -3.0]),
                np.array([1.5, 4.0]),
            ),
        ),
    ]


def check_merge_softmax_states(fn) -> None:
    """Check ``fn(m_a, l_a, m_b, l_b) -> (m, l)`` merges two softmax states
    (arrays of shape (n,))."""
    run_checks(
        "merge softmax states",
        fn,
        merge_cases(),
        _merge_reference,
        MERGE_MISTAKES,
        compare=_same_state,
        postprocess=_as_state,
        describe=_describe_state,
    )


# --- the one-pass online softmax -------------------------------------------


class ScoreStream:
    """The scores of one row, handed out one at a time and readable ONCE, as a
    row that streams past from memory: iterating a second time yields nothing.
    ``len`` is not available."""

    def __init__(self, scores):
        self._scores = iter(
            [float(s) for s in np.asarray(scores, float).ravel()]
        )

    def __iter__(self):
        return self

    def __next__(self) -> float:
        return next(self._scores)


def _state_with(update, guard=True, start=-np.inf):
    """A one-pass state (m, l) whose running sum follows ``update(l, m_old,
    m_new, x_j)``."""

    def state(x):
        m, l = start, 0.0
        for xj in np.asarray(x, float):
            m_new = max(m, xj)
            base = 0.0 if (guard and m_new == -np.inf) else m_new
            l, m = update(l, m, base, xj), m_new
        return m, l

    return state


def _as_pair(out) -> np.ndarray:
    """The reader's (m, l) as a float array of two entries (a SoftmaxState is
    such a pair too)."""
    pair = np.asarray([float(np.asarray(part)) for part in out], float)
    if pair.shape != (2,):
        raise ValueError(f"return the pair (m, l); got {len(pair)} values")
    return pair


def _same_pair(got, expected, rtol: float = 1e-6) -> bool:
    """Equal to a relative 1e-6: float32 accumulators pass (their rounding is
    ~1e-7), a wrong state does not."""
    got, expected = np.asarray(got, float), np.asarray(expected, float)
    return got.shape == expected.shape and bool(
        np.allclose(got, expected, rtol=rtol, atol=0, equal_nan=True)
    )


ONLINE_MISTAKES = [
    Mistake(
        "two_pass",
        "the scores were read twice: the second pass over the stream found "
        "nothing, so the sum is 0",
        "a stream can be read once: update the maximum and the sum in the "
        "same loop, rescaling the sum "
        "by exp(m_old - m_new) whenever the maximum grows",
        lambda x: (float(np.max(x)), 0.0),
    ),
    Mistake(
        "nan_on_masked_start",
        "a row that starts with -inf gives NaN: exp(-inf - (-inf)) is "
        "exp(NaN)",
        "while the maximum is still -inf, rescale with a finite stand-in "
        "(e.g. 0) instead of m",
        _state_with(
            lambda l, m, m_new, xj: l * np.exp(m - m_new) + np.exp(xj - m_new),
            guard=False,
        ),
    ),
    Mistake(
        "no_rescale",
        "the running sum is never rescaled when the maximum grows",
        "before adding exp(x_j - m_new), multiply the old sum by exp(m_old - "
        "m_new)",
        _state_with(lambda l, m, m_new, xj: l + np.exp(xj - m_new)),
    ),
    Mistake(
        "inverted_factor",
        "the running sum is rescaled by exp(m_new - m_old) instead of "
        "exp(m_old - m_new)",
        "the old sum is relative to m_old; relative to a larger m_new it "
        "shrinks by exp(m_old - m_new)",
        _state_with(
            lambda l, m, m_new, xj: (
                l * np.exp(m_new - m if np.isfinite(m) else 0.0)
                + np.exp(xj - m_new)
            )
        ),
    ),
    Mistake(
        "unshifted",
        "no maximum is subtracted: the sum is of exp(x_j), which overflows to "
        "inf past ~710",
        "keep the running maximum m and add exp(x_j - m), rescaling the sum "
        "whenever m grows",
        lambda x: (
            float(np.max(x)),
            float(np.sum(np.exp(np.asarray(x, float)))),
        ),
    ),
    Mistake(
        "max_starts_at_zero",
        "the running maximum starts at 0 instead of -inf: on a row whose "
        "scores are "
        "all negative it stays 0, which is not their maximum",
        "start with m = -inf (and l = 0), the state of an empty row; any "
        "finite start is larger than "
        "some row's maximum",
        _state_with(
            lambda l, m, m_new, xj: l * np.exp(m - m_new) + np.exp(xj - m_new),
            start=0.0,
        ),
    ),
    Mistake(
        "log_of_sum",
        "the second entry is log(l), a log-sum-exp relative to m, instead of "
        "the sum l itself",
        "return l = sum_j exp(x_j - m), not its logarithm; the log-sum-exp of "
        "the row is m + log(l)",
        lambda x: (lambda m, l: (m, float(np.log(l)) if l > 0 else -np.inf))(
            *_reference_state(x)
        ),
    ),
    Mistake(
        "new_term_old_max",
        "each new term is exp(x_j - m_old), relative to the old maximum, "
        "while the "
        "old sum is rescaled to the new one: the two parts of the sum are "
        "relative to different maxima",
        "after the maximum grows, both parts must be relative to m_new: l = l "
        "* exp(m_old - m_new) + "
        "exp(x_j - m_new)",
        _state_with(
            lambda l, m, m_new, xj: (
                l * np.exp(m - m_new)
                + np.exp(xj - (m if np.isfinite(m) else m_new))
            )
        ),
    ),
    Mistake(
        "reset_on_new_max",
        "the running sum restarts at 1 whenever the maximum grows: the mass "
        "of the "
        "scores before the new maximum is dropped instead of rescaled",
        "when the maximum grows, keep the old sum and rescale it: l = l * "
        "exp(m_old - m_new) + 1",
        _state_with(
            lambda l, m, m_new, xj: 1.0 if xj > m else l + np.exp(xj - m_new)
        ),
    ),
    Mistake(
        "sum_overwritten",
        "the running sum is overwritten by the newest term, not "
        "accumulated: l = exp(x_j - m) keeps only the last score's share",
        "add to the rescaled old sum: l = l * exp(m_old - m_new) + "
        "exp(x_j - m_new)",
        _state_with(lambda l, m, m_new, xj: np.exp(xj - m_new)),
    ),
    Mistake(
        "returns_lse",
        "the second entry is the row's log-sum-exp m + log(l), not the sum l",
        "return l = sum_j exp(x_j - m) itself; m + log(l) is what the forward "
        "pass saves for the "
        "backward pass, but the state is the pair (m, l)",
        lambda x: (
            lambda m, l: (m, m + float(np.log(l)) if l > 0 else -np.inf)
        )(*_reference_state(x)),
    ),
    Mistake(
        "max_not_updated",
        "the maximum stays at the first score, so exp(x_j - m) overflows once "
        "x_j exceeds "
        "it by ~710",
        "update m_new = max(m_old, x_j) at every step, and rescale the sum to "
        "it",
        lambda x: _first_score_state(x),
    ),
    # issue 31, student report 0910: a row (or a buffer) kept in float16 to
    # save memory failed on its values with only the generic hint
    Mistake(
        "float16_scores",
        "the state is that of the scores rounded to float16: float16 keeps "
        "about 3 significant digits (a score near 3000 is rounded by up to "
        "1, and even -0.7 moves by 2e-4), so both m and l are off",
        "keep the scores, and any buffer of them, at the precision they come "
        "in (float64 here); to save memory keep fewer of them, not fewer "
        "bits",
        lambda x: _reference_state(
            np.asarray(x, float).astype(np.float16).astype(float)
        ),
    ),
    # issue 31, student report 09: a loop that keeps its state in float16
    # (not only the scores) got the generic hint
    Mistake(
        "float16_arithmetic",
        "the running state is kept and updated in float16: float16 keeps "
        "about 3 significant digits, so each update of m and l rounds, and "
        "the rounding accumulates over the row",
        "keep m and l in float64 (or at least float32, as the kernels' "
        "accumulators are), and the scores at the precision they come in; "
        "the state is two numbers, so precision costs no memory here",
        lambda x: _float16_state(x),
    ),
    # issue 31, student report 09b: a float16 sum beside a float64 maximum
    # got the generic hint
    Mistake(
        "float16_sum",
        "the running sum is kept in float16 (the maximum and the scores are "
        "not): float16 keeps about 3 significant digits, so each addition "
        "to l rounds, and the rounding accumulates over the row",
        "keep l in float64 (or at least float32, as the kernels' "
        "accumulators are), like m; the state is two numbers, so precision "
        "costs no memory here",
        lambda x: _float16_sum_state(x),
    ),
    # issue 31, student report 09: a two-pass answer that stores the row
    # gives NaN on a fully masked row only, and got the generic hint
    Mistake(
        "nan_on_masked_row",
        "a fully masked row gives NaN: its maximum is -inf, and "
        "exp(-inf - (-inf)) is exp(NaN); every other row is right. (If your "
        "function stores the scores to subtract their maximum afterwards, "
        "the memory test rejects it next: a stream is read once, so keep a "
        "running state instead)",
        "while the maximum is still -inf, nothing is visible and the state "
        "is (-inf, 0): skip the update, or subtract a finite stand-in (e.g. "
        "0) instead of m",
        lambda x: _nan_on_masked_row(x),
    ),
    Mistake(
        "tie_dropped",
        "a score equal to the running maximum is dropped: the branches "
        "compare strictly "
        "(x_j < m, x_j > m), so a repeated maximum adds nothing to the sum",
        "a score equal to m adds exp(0) = 1; use x_j <= m (or x_j >= m) in "
        "one branch, or the branch-free "
        "update m_new = max(m, x_j); l = l * exp(m - m_new) + exp(x_j - "
        "m_new)",
        lambda x: _strict_state(x),
    ),
]


def _float16_state(x) -> tuple[float, float]:
    """The one-pass state with m, l and every score in float16 (masked
    scores skipped)."""
    m, l = np.float16(-np.inf), np.float16(0.0)
    for xj in np.asarray(x, float).astype(np.float16):
        if xj == -np.inf:
            continue
        m_new = max(m, xj)
        l = np.float16(l * np.exp(m - m_new) + np.exp(xj - m_new))
        m = m_new
    return float(m), float(l)


def _float16_sum_state(x) -> tuple[float, float]:
    """The one-pass state with the sum rounded to float16 after each update,
    the maximum and the scores in float64 (masked scores skipped)."""
    m, l = -np.inf, np.float16(0.0)
    for xj in np.asarray(x, float):
        if xj == -np.inf:
            continue
        m_new = max(m, xj)
        l = np.float16(float(l) * np.exp(m - m_new) + np.exp(xj - m_new))
        m = m_new
    return float(m), float(l)


def _nan_on_masked_row(x) -> tuple[float, float]:
    """The right state, but NaN for a fully masked row (a shift by a maximum
    that is -inf, unguarded)."""
    m, l = _reference_state(x)
    return (m, float("nan")) if m == -np.inf else (m, l)


def _strict_state(x) -> tuple[float, float]:
    """Strict comparisons only: a score equal to the running maximum falls in
    neither branch and is dropped."""
    m, l = -np.inf, 0.0
    for xj in np.asarray(x, float):
        if xj < m:
            l += float(np.exp(xj - m))
        elif xj > m:
            l, m = l * float(np.exp(m - xj)) + 1.0, float(xj)
    return m, l


def _first_score_state(x) -> tuple[float, float]:
    """The state with the maximum fixed at the first visible (finite) score; a
    reader who skips the leading masked scores writes it so, and on rows that
    start visible it is fixing it at x[0]."""
    x = np.asarray(x, float)
    visible = x[np.isfinite(x)]
    if visible.size == 0:
        return -np.inf, 0.0
    return float(visible[0]), float(np.sum(np.exp(visible - visible[0])))


def online_cases() -> list[Case]:
    # seed 12: the maximum is the fifth score, not the last, so that a sum
    # restarted at each new maximum keeps the terms after it, and a sum
    # overwritten by the newest term is not 1
    rng = np.random.default_rng(12)
    return [
        Case(
            "a row of 8 scores, its maximum in the middle",
            (rng.normal(scale=2, size=8),),
        ),
        Case("a single negative score, -0.7", (np.array([-0.7]),)),
        Case(
            "a fully masked row (every score -inf): the state (-inf, 0)",
            (np.array([-_inf, -_inf, -_inf]),),
        ),
        Case(
            "scores growing to 3000 (exp overflows past ~710)",
            (np.array([0.0, 800.0, 1600.0, 2400.0, 3000.0]),),
        ),
        Case(
            "a row that starts with masked scores (-inf)",
            (np.array([-_inf, -_inf, 0.3, 1.2, -_inf, 0.8]),),
        ),
        Case(
            "a row whose maximum 2.0 occurs three times",
            (np.array([0.5, 2.0, 2.0, -1.0, 2.0]),),
        ),
    ]


def _reference_state(x) -> tuple[float, float]:
    state = softmax_state(np.asarray(x, float))
    return float(state.max), float(state.sum)


def check_online_softmax(fn) -> None:
    """Check ``fn(scores)`` returns the softmax state ``(m, l)`` of a row read
    ONCE.

    ``scores`` is a :class:`ScoreStream`: an iterator over the row that can be
    read only once. The answer is ``m = max_j x_j`` and ``l = sum_j exp(x_j -
    m)`` (``(-inf, 0)`` for a fully masked row). On a long row the checker also
    measures memory: storing the scores (a list or an array) to read them again
    is a second pass in disguise.
    """
    __tracebackhide__ = True
    run_checks(
        "online softmax",
        lambda x: fn(ScoreStream(x)),
        online_cases(),
        _reference_state,
        ONLINE_MISTAKES,
        compare=_same_pair,
        postprocess=_as_pair,
        # its "Correct" line waits for the memory check
        quiet=True,
    )
    _check_one_pass_memory(fn)
    print(
        f"Correct: online softmax passes all {len(online_cases())} cases and "
        "reads a long stream once, "
        "in constant memory."
    )


def _check_one_pass_memory(
    fn, short: int = 25_000, long: int = 100_000
) -> None:
    """Reject an answer whose memory grows with the stream: a one-pass state
    needs O(1) memory, and so does a buffer of a fixed number of scores merged
    into it (of any size up to the short stream); a stored row needs O(n).

    The peak is measured (by tracemalloc, which is deterministic, and, where
    torch is imported, by torch's profiler, whatever the answer returns:
    :func:`peak_memory_with_torch`) on a stream of ``short`` and of ``long``
    scores; the answer is rejected when the peak grew by more than one byte
    per extra score. A stored row grows by 2 bytes per score in float16, 8 as
    a float64 array or a list."""
    from ..bench import format_bytes
    from ._framework import peak_memory_with_torch

    __tracebackhide__ = True
    peaks = []
    for n in (short, long):
        x = np.random.default_rng(11).normal(scale=3, size=n)
        # a stream is read once: one for each of the two measurements, built
        # before measuring (the row is the checker's)
        streams = iter([ScoreStream(x), ScoreStream(x)])
        out, peak = peak_memory_with_torch(lambda: fn(next(streams)))
        peaks.append(peak)
    case = f"streams of {short:,} and {long:,} scores (memory)"
    if peaks[1] - peaks[0] > long - short:
        raise ExerciseError(
            "online softmax",
            case,
            f"your function's peak memory was {format_bytes(peaks[1])} on a "
            f"stream of {long:,} scores, against "
            f"{format_bytes(peaks[0])} on a stream of {short:,}: it grew "
            "with the stream, where a state of two numbers does not (nor a "
            "buffer of a fixed number of scores, up to "
            f"{short:,}): it stored the scores, so that it could read them "
            "twice (or kept more of them than the short stream holds)",
            hint="keep only m and l: the loop that reads each score must "
            "update both at once",
        )
    # a float32 running sum of 100,000 terms drifts by up to ~1e-4 relative;
    # every wrong state is far off
    if not _same_pair(_as_pair(out), np.array(_reference_state(x)), rtol=1e-3):
        raise ExerciseError(
            "online softmax",
            f"a stream of {long:,} scores",
            "the state differs from the reference on a long row",
        )


# --- the backward pass from the saved log-sum-exp (hard) -------------------


def _causal_visible(
    n_q: int, n_k: int, cols: slice, top_left=False, strict=False
):
    """(n_q, len(cols)) booleans: query i sees key j when j <= i + n_k - n_q
    (the book's convention); ``top_left``: j <= i, the slip for n_q != n_k;
    ``strict``: j < i + n_k - n_q, the off-by-one that hides each query's own
    key."""
    offset = 0 if top_left else n_k - n_q
    i = np.arange(n_q)[:, None]
    j = np.arange(n_k)[cols][None, :]
    return j < i + offset if strict else j <= i + offset


def _blocked_backward(
    q,
    k,
    v,
    out,
    lse,
    d_out,
    causal=False,
    block_k=64,
    *,
    delta="rows",
    probs="lse",
    mask="book",
    scale_in="all",
    ragged=True,
    dq_accumulates=True,
    early_break=False,
):
    """The backward pass over blocks of keys, all queries at once, in float64;
    the keywords commit one mistake each (the defaults are right).

    delta: "rows" D = rowsum(dO * O), "none" (forgotten), "tile" (rowsum of P
    * dP over the tile only); probs: "lse" exp(S - L), "tile" (the tile's own
    softmax), "tile_unmasked" (the tile's own softmax of the unmasked
    scores, then the mask), "unshifted" exp(S) / exp(L); mask: "book",
    "none", "top_left",
    "strict" (j < i + n_k - n_q); scale_in: "all", "not_s" (scores not scaled),
    "not_ds" (dQ and dK without it), "not_dk", "not_dq"; ragged: False drops
    a last, shorter key block; dq_accumulates: False overwrites dQ with each
    block's share; early_break: True ends a causal loop at a key block that
    starts at the last key, n_k - 1 (``j0 >= n_k - 1`` where the break belongs
    at ``j0 > n_k - 1``).
    """
    q, k, v, out, lse, d_out = (
        np.asarray(x, np.float64) for x in (q, k, v, out, lse, d_out)
    )
    n_q, n_k, d_k = q.shape[-2], k.shape[-2], q.shape[-1]
    tau = 1.0 / np.sqrt(d_k)
    kt = np.swapaxes(k, -1, -2)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    d_rows = np.sum(d_out * out, axis=-1, keepdims=True)
    stop = n_k if ragged else n_k - n_k % block_k
    for j0 in range(0, stop, block_k):
        if causal and early_break and j0 >= n_k - 1:
            break
        cols = slice(j0, min(j0 + block_k, n_k))
        s = (1.0 if scale_in == "not_s" else tau) * (q @ kt[..., cols])
        visible = None
        if causal and mask != "none":
            visible = _causal_visible(
                n_q, n_k, cols, mask == "top_left", mask == "strict"
            )
            if probs != "tile_unmasked":
                s = np.where(visible, s, -np.inf)
        if probs == "tile_unmasked":
            e = np.exp(s - np.max(s, axis=-1, keepdims=True))
            p = e / np.sum(e, axis=-1, keepdims=True)
            if visible is not None:
                p = np.where(visible, p, 0.0)
        elif probs == "lse":
            p = np.exp(s - lse[..., None])
        elif probs == "unshifted":
            p = np.exp(s) / np.exp(lse[..., None])
        else:  # the tile's own softmax
            m = np.max(s, axis=-1, keepdims=True)
            e = np.exp(s - np.where(np.isneginf(m), 0.0, m))
            total = np.sum(e, axis=-1, keepdims=True)
            p = e / np.where(total == 0, 1.0, total)
        dp = d_out @ np.swapaxes(v[..., cols, :], -1, -2)
        if delta == "rows":
            ds = p * (dp - d_rows)
        elif delta == "none":
            ds = p * dp
        else:
            ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
        dv[..., cols, :] += np.swapaxes(p, -1, -2) @ d_out
        g_q = (1.0 if scale_in in ("not_ds", "not_dq") else tau) * (
            ds @ k[..., cols, :]
        )
        if dq_accumulates:
            dq += g_q
        else:
            dq = g_q
        dk[..., cols, :] += (
            1.0 if scale_in in ("not_ds", "not_dk") else tau
        ) * (np.swapaxes(ds, -1, -2) @ q)
    return dq, dk, dv


def _backward_reference(q, k, v, out, lse, d_out, causal=False, block_k=64):
    """The gradients from the dense formulas in float64 (the whole n_q x n_k
    matrix at once; block_k is not used): tests/test_exercises_flash.py
    checks them against PyTorch's autograd."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    n_q, n_k, d_k = q.shape[-2], k.shape[-2], q.shape[-1]
    tau = 1.0 / np.sqrt(d_k)
    s = tau * (q @ np.swapaxes(k, -1, -2))
    if causal:
        s = np.where(_causal_visible(n_q, n_k, slice(None)), s, -np.inf)
    p = np.exp(s - np.max(s, axis=-1, keepdims=True))
    p /= np.sum(p, axis=-1, keepdims=True)
    o = p @ v
    dp = d_out @ np.swapaxes(v, -1, -2)
    ds = p * (dp - np.sum(d_out * o, axis=-1, keepdims=True))
    return (
        tau * (ds @ k),
        tau * (np.swapaxes(ds, -1, -2) @ q),
        np.swapaxes(p, -1, -2) @ d_out,
    )


def _as_grads(out) -> tuple:
    """The reader's ``(dq, dk, dv)`` as three float64 arrays."""
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise TypeError(
            "return the three gradients (dq, dk, dv); got "
            f"{type(out).__name__}"
        )
    from ._framework import as_array

    return tuple(as_array(g).astype(np.float64) for g in out)


def _same_grads(got, expected) -> bool:
    """All three gradients agree to 1e-4 relative (float32 inputs' rounding
    is ~1e-6; every mistake is off by far more)."""
    return all(same(g, e, rtol=1e-4, atol=1e-5) for g, e in zip(got, expected))


def _describe_grads(got, expected, case=None) -> str:
    """Which of dq, dk, dv are wrong, and how."""
    parts = []
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        if g.shape != e.shape:
            parts.append(f"{name} has shape {g.shape}, expected {e.shape}")
        elif not same(g, e, rtol=1e-4, atol=1e-5):
            parts.append(f"{name}: {difference(g, e, case)}")
    right = [
        name
        for name, g, e in zip(("dq", "dk", "dv"), got, expected)
        if g.shape == e.shape and same(g, e, rtol=1e-4, atol=1e-5)
    ]
    if right:
        parts.append(f"{' and '.join(right)} right")
    return "; ".join(parts)


def _backward_with(**flags):
    return lambda *args, **kwargs: _blocked_backward(*args, **kwargs, **flags)


def _backward_tau_from_d_v(q, k, v, out, lse, d_out, causal=False, block_k=64):
    """The scale taken from the values' width, tau = 1/sqrt(d_v), in the
    recomputed scores and in dQ and dK; P from the saved lse (dense)."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    n_q, n_k = q.shape[-2], k.shape[-2]
    tau = 1.0 / np.sqrt(v.shape[-1])
    s = tau * (q @ np.swapaxes(k, -1, -2))
    if causal:
        s = np.where(_causal_visible(n_q, n_k, slice(None)), s, -np.inf)
    p = np.exp(s - np.asarray(lse, np.float64)[..., None])
    dp = d_out @ np.swapaxes(v, -1, -2)
    ds = p * (dp - np.sum(d_out * np.asarray(out), axis=-1, keepdims=True))
    return (
        tau * (ds @ k),
        tau * (np.swapaxes(ds, -1, -2) @ q),
        np.swapaxes(p, -1, -2) @ d_out,
    )


BACKWARD_MISTAKES = [
    # right except where exp(S) overflows: first, so that NaN is named
    Mistake(
        "unshifted",
        "P is recomputed as exp(S) / exp(L): where the scores pass ~710, "
        "exp(S) and exp(L) overflow to inf, and inf / inf is NaN",
        "recompute P = exp(S - L) in one exponential: S - L <= 0, so it "
        "never overflows",
        _backward_with(probs="unshifted"),
    ),
    Mistake(
        "delta_forgotten",
        "dS = P * dP: the softmax's correction D = rowsum(dO * O) is missing",
        "through the softmax, dS = P * (dP - D), with D_i = sum_c dO_ic O_ic "
        "computed once, before the loop",
        _backward_with(delta="none"),
    ),
    Mistake(
        "delta_per_tile",
        "D is summed over the tile's keys only (rowsum(P * dP) of the "
        "tile): the correction runs over the whole row, all n_k keys",
        "use D = rowsum(dO * O), which equals the sum over the whole row "
        "(the chapter's theorem) and needs no other tile",
        _backward_with(delta="tile"),
    ),
    Mistake(
        "tile_softmax",
        "each tile's P is its own softmax (normalised over the tile's "
        "keys), not the row's: the tiles' weights do not share one "
        "normaliser",
        "recompute the row's weights from the saved log-sum-exp: P = exp(S "
        "- L), with L = m + log(l) of the whole row",
        _backward_with(probs="tile"),
    ),
    Mistake(
        "scores_unscaled",
        "the recomputed scores are Q K^T, without the scale 1/sqrt(d_k) of "
        "the forward pass, so exp(S - L) is not P",
        "recompute S = Q K^T / sqrt(d_k), exactly as the forward pass did",
        _backward_with(scale_in="not_s"),
    ),
    Mistake(
        "ds_unscaled",
        "dQ and dK lack the factor 1/sqrt(d_k): S = tau Q K^T, so dQ = tau "
        "dS K and dK = tau dS^T Q",
        "multiply both dS K and dS^T Q by tau = 1/sqrt(d_k)",
        _backward_with(scale_in="not_ds"),
    ),
    Mistake(
        "dk_unscaled",
        "dK lacks the factor 1/sqrt(d_k) (dQ has it): dK = tau dS^T Q",
        "the scale enters S through both Q and K: dK = tau dS^T Q, as dQ = "
        "tau dS K",
        _backward_with(scale_in="not_dk"),
    ),
    Mistake(
        "dq_unscaled",
        "dQ lacks the factor 1/sqrt(d_k) (dK has it): dQ = tau dS K",
        "the scale enters S through both Q and K: dQ = tau dS K, as dK = "
        "tau dS^T Q",
        _backward_with(scale_in="not_dq"),
    ),
    Mistake(
        "mask_forgotten",
        "the causal mask is not applied when P is recomputed: the future "
        "keys get weight exp(S - L) > 0 and gradient",
        "mask the recomputed scores as the forward pass did (S = -inf where "
        "key j > i + n_k - n_q), so that exp(S - L) = 0 there",
        _backward_with(mask="none"),
    ),
    Mistake(
        "mask_top_left",
        "the causal mask is aligned at the top left (key j <= query i): the "
        "book's convention puts the n_q queries at the last n_q of the n_k "
        "positions",
        "query i sees key j when j <= i + (n_k - n_q)",
        _backward_with(mask="top_left"),
    ),
    Mistake(
        "mask_off_by_one",
        "the causal mask is off by one (key j < i + n_k - n_q): each query "
        "no longer sees its own position's key",
        "query i sees key j when j <= i + (n_k - n_q): its own key included",
        _backward_with(mask="strict"),
    ),
    Mistake(
        "ragged_block_dropped",
        "the last key block, shorter than block_k, is skipped: its keys get "
        "no dK, dV and give dQ nothing",
        "loop for j0 in range(0, n_k, block_k) with cols = slice(j0, min(j0 "
        "+ block_k, n_k))",
        _backward_with(ragged=False),
    ),
    # issue 31, student report 09b: these two got the generic hint
    Mistake(
        "tile_softmax_masked_after",
        "each tile's P is its own softmax, taken over all the tile's keys "
        "and masked only afterwards: the weights neither share the row's "
        "normaliser nor leave out the hidden keys when normalising",
        "recompute the row's weights from the saved log-sum-exp, P = exp(S "
        "- L), with the masked scores set to -inf first, so that exp(S - L) "
        "= 0 there",
        _backward_with(probs="tile_unmasked"),
    ),
    Mistake(
        "causal_break_early",
        "the causal loop stops one key too early: it breaks at a key block "
        "that starts at the last key (j0 >= n_k - 1), which the last query "
        "sees, so that key gets no dK, dV and gives dQ nothing",
        "break only past the last key any query sees: the last query, n_q - "
        "1, sees keys up to n_q - 1 + (n_k - n_q) = n_k - 1, so stop when j0 "
        "> n_k - 1 (with all queries in each tile, no block is skipped)",
        _backward_with(early_break=True),
    ),
    Mistake(
        "dq_overwritten",
        "dQ is overwritten by each key block's share (dq = ...): it keeps "
        "the last block's only",
        "dQ sums over all key blocks: start from zeros and add, dq += tau * "
        "dS @ K_j",
        _backward_with(dq_accumulates=False),
    ),
    Mistake(
        "tau_from_d_v",
        "the scale is 1/sqrt(d_v), the values' width: the scores were "
        "scaled by 1/sqrt(d_k), the width of the queries and keys they "
        "compare",
        "take tau = 1/sqrt(q.shape[-1]) (d_k), in the recomputed S and in "
        "dQ and dK; d_v differs from d_k in some cases",
        _backward_tau_from_d_v,
    ),
]


def _backward_case(
    name,
    lead,
    n_q,
    n_k,
    d_k,
    d_v,
    block_k,
    causal,
    seed,
    dtype=np.float64,
    score_scale=1.0,
):
    """A case: random q, k, v, d_out, and the forward pass's out and lse
    (computed in float64 by the package's flash_attention_numpy)."""
    from ..flash import flash_attention_numpy

    rng = np.random.default_rng(seed)
    q = score_scale * rng.normal(size=lead + (n_q, d_k))
    k, v = (
        rng.normal(size=lead + (n_k, d_k)),
        rng.normal(size=lead + (n_k, d_v)),
    )
    d_out = rng.normal(size=lead + (n_q, d_v))
    out, lse = flash_attention_numpy(q, k, v, causal=causal, return_lse=True)
    args = tuple(x.astype(dtype) for x in (q, k, v, out, lse, d_out))
    return Case(name, args, {"causal": causal, "block_k": block_k})


def backward_cases() -> list[Case]:
    return [
        _backward_case(
            "12 queries and 12 keys, d = 4, blocks of 5 keys (the last "
            "holds 2)",
            (),
            12,
            12,
            4,
            4,
            5,
            False,
            20,
        ),
        _backward_case(
            "causal, 5 queries at the end of 13 keys, d_k = 6, d_v = 3, "
            "blocks of 4 keys",
            (),
            5,
            13,
            6,
            3,
            4,
            True,
            21,
        ),
        _backward_case(
            "batched (2, 3, 9, 8), causal, n_q = n_k = 9, blocks of 4",
            (2, 3),
            9,
            9,
            8,
            8,
            4,
            True,
            22,
        ),
        _backward_case(
            "float32 inputs, 16 queries, 20 keys, d = 8, blocks of 8",
            (),
            16,
            20,
            8,
            8,
            8,
            False,
            23,
            dtype=np.float32,
        ),
        _backward_case(
            "a single query (n_q = 1) over 7 keys, causal, blocks of 3",
            (),
            1,
            7,
            4,
            4,
            3,
            True,
            24,
        ),
        _backward_case(
            "causal, scores in the hundreds (exp overflows past ~710), 6 "
            "queries, 10 keys, blocks of 4",
            (),
            6,
            10,
            4,
            4,
            4,
            True,
            25,
            score_scale=300.0,
        ),
    ]


def check_blockwise_attention_backward(fn) -> None:
    """Check ``fn(q, k, v, out, lse, d_out, causal=False, block_k=64)``
    returns ``(dq, dk, dv)``, the gradients of attention computed over blocks
    of ``block_k`` keys from the saved log-sum-exp ``lse``.

    The reference is the dense formula in float64. The checker then calls
    ``fn`` once more with ``lse`` raised by log 2: P = exp(S - L) halves, and
    so does dV = P^T dO; an answer that does not recompute P from ``lse``
    returns the same dV, and is rejected; this on a case without the causal
    mask and on a causal one. Last, on inputs of n = 256, 512 and 1024, with
    and without the causal mask, it measures memory (numpy's arrays with
    tracemalloc, torch's allocations with its profiler when torch is loaded):
    from n = 512 to 1024 an n_q x n_k float array grows 4x, a pass over key
    blocks about 2x; and the part of the peak that grows as n_q n_k must be
    under 1/16 byte (half a bit) per query-key pair (a boolean mask of the
    whole score matrix: 1 byte; a bit-packed one: 1/8 byte). Its peak must also
    grow from block_k = 16 to 256 (64 queries, 1024 keys): the values are the
    same for every block size, so only the memory shows an answer whose blocks
    ignore block_k. And at n_q = block_k = 256 its peak may grow from n_k =
    1024 to 4096 by at most 2 block_k bytes a key: tiles of a block of queries
    with all n_k keys grow by 4 to 8 block_k bytes a key, tiles of block_k keys
    not at all.
    """
    __tracebackhide__ = True
    run_checks(
        "attention backward",
        fn,
        backward_cases(),
        _backward_reference,
        BACKWARD_MISTAKES,
        compare=_same_grads,
        postprocess=_as_grads,
        describe=_describe_grads,
        quiet=True,
    )
    _check_backward_uses_lse(fn)
    _check_backward_memory(fn)
    _check_backward_follows_block_k(fn)
    _check_backward_tiles_follow_keys(fn)
    print(
        f"Correct: attention backward passes all {len(backward_cases())} "
        "cases; its dV halved when lse was raised by log 2 (P is recomputed "
        "from lse), without and with the causal mask; and, without and with "
        "it, its peak memory grew at most 3x from n = 512 to 1024 (an n x n "
        "float array: 4x), with no part growing as n_q n_k (a bit-packed n x "
        "n mask: 1/8 byte per query-key pair); and it grew with block_k (its "
        "tiles follow block_k) but not with n_k beyond dK and dV at a fixed "
        "block_k (its tiles are blocks of keys, not of queries)."
    )


LSE_IGNORED = Mistake(
    "lse_ignored",
    "P is not recomputed from the saved log-sum-exp (lse is not used): "
    "with every lse raised by log 2, P = exp(S - L) and dV = P^T dO halve, "
    "but your dV did not change",
    "recompute each tile of P as exp(S - L) from the lse the forward pass "
    "saved, rather than normalising the scores again",
    _backward_reference,
)

DENSE_MATRIX = Mistake(
    "dense_matrix",
    "your function holds an array of n_q x n_k entries (its memory grows 4x "
    "when n doubles), where a pass over blocks of keys holds n_q x block_k "
    "at a time (about 2x)",
    "loop over the key blocks: recompute each tile's S and P, add its share "
    "to dQ, dK, dV, and keep no tile after its block",
    _backward_reference,
)

SQUARE_ARRAY = Mistake(
    "square_array",
    "part of your function's memory grows as n_q n_k, the bytes per "
    "query-key pair measured above: a boolean mask of the whole score "
    "matrix takes 1 byte per pair, a bit-packed one 1/8, probability tiles "
    "kept for every block 4 (float32) or 8 (float64), where a pass over "
    "blocks of keys holds n_q x block_k at a time",
    "build each tile's causal mask from the tile's own keys (key j is "
    "visible to query i when j <= i + n_k - n_q), not by slicing a mask of "
    "the whole score matrix, packed or not, and keep no tile after its "
    "block",
    _backward_reference,
)


BLOCK_K_IGNORED = Mistake(
    "block_k_ignored",
    "your function's peak memory is the same with block_k = 16 and with "
    "block_k = 256: its tiles do not follow block_k (blocks of a fixed "
    "size, whatever the argument says)",
    "take the keys in blocks of block_k: for j0 in range(0, n_k, block_k) "
    "with cols = slice(j0, min(j0 + block_k, n_k)), and compute each tile "
    "of S, P, dP and dS on those columns at once",
    _backward_reference,
)

QUERY_BLOCKS = Mistake(
    "query_blocks",
    "your function's memory grows with n_k at fixed n_q and block_k by more "
    "than 2 bytes a key for each of the block_k queries: its tiles hold all "
    "n_k "
    "keys for a block of queries (blocks of queries, all keys at once), "
    "where a pass over blocks of keys holds n_q x block_k whatever n_k, and "
    "only dK and dV (n_k x d) grow with n_k",
    "make the keys the blocks: for each block of block_k keys compute the "
    "tile of S, P, dP and dS for all queries (or for blocks of them), add "
    "its share to dQ and write its rows of dK and dV; D = rowsum(dO * O) "
    "from out needs no pass over a whole row of keys",
    _backward_reference,
)


# what the checker names after the values: the cost mistakes
BACKWARD_COST_MISTAKES = [
    LSE_IGNORED,
    DENSE_MATRIX,
    SQUARE_ARRAY,
    BLOCK_K_IGNORED,
    QUERY_BLOCKS,
]


def _check_backward_uses_lse(fn) -> None:
    """Reject an answer whose dV does not change when lse is raised by log 2:
    P = exp(S - L) from the saved lse halves, and with it dV = P^T dO (dQ and
    dK halve too when D comes from dO and O); an answer that normalises the
    scores itself returns the same dV."""
    from ._framework import pristine

    __tracebackhide__ = True
    # a case without the mask and a batched causal one: an answer may take
    # another path when causal=True
    for case in (backward_cases()[0], backward_cases()[2]):
        q, k, v, out, lse, d_out = case.args
        expected = _backward_reference(*case.args, **case.kwargs)
        shifted = (q, k, v, out, lse + np.log(2.0), d_out)
        got = _as_grads(fn(*pristine(shifted), **case.kwargs))
        dv, dv_expected = got[2], expected[2]
        if dv.shape == dv_expected.shape and same(
            dv, dv_expected, rtol=1e-4, atol=1e-5
        ):
            raise ExerciseError(
                "attention backward",
                f"{case.name}, with lse raised by log 2",
                "dV is the same as with the true lse, where P = exp(S - L) "
                "and dV = P^T dO halve",
                mistake=LSE_IGNORED,
            )


# the most bytes per query-key pair that the part of a backward pass's peak
# growing as n_q n_k may take: half a bit, half of a bit-packed mask of the
# whole score matrix (1/8 byte); the right answers of the catalogue in
# tests/test_exercises_flash.py measure under 0.001 one size up from the
# smallest
SQUARE_LIMIT = 1 / 16


def _square_part(peaks, n: int) -> float:
    """The bytes per (query, key) pair of a peak a + b m + c m^2 measured at
    m = n, 2n and 4n: the second difference P(4n) - 3 P(2n) + 2 P(n) is
    6 c n^2."""
    return (peaks[2] - 3 * peaks[1] + 2 * peaks[0]) / (6 * n**2)


def _check_backward_memory(fn, block_k: int = 64) -> tuple[float, str]:
    """Reject a backward pass that holds an array of n_q x n_k entries, with
    and without the causal mask (n_q = n_k = n).

    Two tests on the peaks at n = 256, 512 and 1024. The growth from 512 to
    1024 is about 2 for key blocks, 4 for a dense float array; the threshold is
    3. A boolean n x n mask (1 byte per entry) next to float tiles can stay
    under it, so the peak is also split as a + b n + c n^2: the second
    difference P(4n) - 3 P(2n) + 2 P(n) = 6 c n^2 gives c, the bytes per
    (query, key) pair, 0 for key blocks, 1/8 for a mask packed into bits
    (np.packbits), 1 for a boolean mask, 8 for float64; the threshold is
    SQUARE_LIMIT, 1/16 (half a bit), and an estimate over it is confirmed on n
    = 512, 1024 and 2048 before the answer is rejected (a right answer's peak
    can sit a constant above its line at n = 256 alone, which the second
    difference doubles: the expert reader's in-place float32 einsum answer read
    0.7 bytes per pair there and 0.0 one size up). The peak is tracemalloc's
    (numpy's arrays) or, when torch is loaded, the largest allocation torch's
    profiler saw, whichever is larger. Returns the largest growth from 512 to
    1024 and the words for what was measured."""

    from ..bench import format_bytes
    from ._framework import peak_memory_with_torch, torch_profiler_ready

    __tracebackhide__ = True
    # an answer can use torch only if torch has been imported
    with_torch = torch_profiler_ready()
    sizes = (256, 512, 1024, 2048)

    def peak_at(n, causal):
        # random arrays of the right shapes: only the memory is judged here,
        # so no forward pass is needed to make out and lse
        rng = np.random.default_rng(26)
        args = [rng.normal(size=(n, 16)) for _ in range(5)]
        args.insert(4, rng.normal(size=n) + 3.0)  # lse, one per query
        kwargs = {"causal": causal, "block_k": block_k}
        _, peak = peak_memory_with_torch(fn, *args, **kwargs)
        return max(peak, 1)

    growths = []
    for causal in (False, True):
        peaks = [peak_at(n, causal) for n in sizes[:3]]
        mask = "causal, " if causal else ""
        growth = peaks[2] / peaks[1]
        if growth > 3:
            raise ExerciseError(
                "attention backward",
                f"{mask}n_q = n_k = 512 and 1024, d = 16, blocks of 64 keys "
                "(memory)",
                f"your function's peak memory grew {growth:.1f}x, from "
                f"{format_bytes(peaks[1])} to {format_bytes(peaks[2])}, when "
                "n doubled",
                mistake=DENSE_MATRIX,
            )
        per_pair = _square_part(peaks, sizes[0])
        if per_pair > SQUARE_LIMIT:
            # confirmed on the sizes one step up before rejecting: a bump of
            # the peak at the smallest size alone (allocator noise, a
            # constant excess) is read as twice itself by the second
            # difference; an n_q x n_k array gives the same c on both
            peaks.append(peak_at(sizes[3], causal))
            per_pair = _square_part(peaks[1:], sizes[1])
        if per_pair > SQUARE_LIMIT:
            listed = ", ".join(format_bytes(p) for p in peaks)
            raise ExerciseError(
                "attention backward",
                f"{mask}n_q = n_k = 256, 512, 1024 and 2048, d = 16, blocks "
                "of 64 keys (memory)",
                f"your function's peak memory ({listed}) has a part that "
                f"grows as n_q n_k, {per_pair:.2f} bytes per query-key pair "
                "(from n = 512, 1024 and 2048; from 256, 512 and 1024 too)",
                mistake=SQUARE_ARRAY,
            )
        growths.append(growth)
    seen = (
        "numpy's arrays by tracemalloc, torch's allocations by its profiler"
        if with_torch
        else "numpy's arrays, by tracemalloc"
    )
    return max(growths), seen


def _peak_parts(fn, args, kwargs) -> tuple[int, int]:
    """(tracemalloc's peak, the largest allocation torch's profiler saw) of
    ``fn(*args, **kwargs)`` on fresh copies; the second is 0 when torch is
    not loaded (an answer cannot use it then)."""
    from ..bench import peak_memory
    from ._framework import (
        largest_torch_allocation,
        pristine,
        torch_profiler_ready,
    )

    _, peak = peak_memory(fn, *pristine(args), **pristine(kwargs))
    largest = 0
    if torch_profiler_ready():
        _, largest = largest_torch_allocation(
            fn, *pristine(args), **pristine(kwargs)
        )
    return peak, largest


# the two block sizes of the block_k test, and its input: few queries, many
# keys, so that the arrays that do not depend on the block (dQ, D and their
# temporaries, n_q x d) stay small next to one tile row of 256 keys
BLOCK_K_PROBE = (16, 256)
BLOCK_K_PROBE_SHAPE = (64, 1024, 8)  # n_q, n_k, d


def _check_backward_follows_block_k(fn) -> tuple[int, int]:
    """Reject a backward pass whose tiles do not follow ``block_k``.

    Its values cannot tell: the gradients are the same for every block size.
    Its memory can: a tile of ``block_k`` keys holds at least one row of
    them, in float32 at least 4 bytes a key, so from block_k = 16 to 256 the
    peak grows by at least 4 x 240 = 960 bytes (by about n_q x 240 x 8 bytes
    for each float64 tile of all n_q queries). An answer that always uses
    blocks of one fixed size has the same peak at both. The peaks are
    tracemalloc's and, when torch is loaded, the largest allocation torch's
    profiler saw, each compared between the two block sizes on its own: an
    answer whose tiles live in torch and whose results are copied to numpy
    (``.astype``) has a tracemalloc peak set by those copies, larger than
    its tiles, so the larger of the two would hide the tiles' growth.
    Returns the two peaks of the measure that grew more."""
    from ..bench import format_bytes

    __tracebackhide__ = True
    n_q, n_k, d = BLOCK_K_PROBE_SHAPE
    rng = np.random.default_rng(27)
    q, out, d_out = (rng.normal(size=(n_q, d)) for _ in range(3))
    k, v = (rng.normal(size=(n_k, d)) for _ in range(2))
    lse = rng.normal(size=n_q) + 3.0
    args = (q, k, v, out, lse, d_out)
    parts = [
        _peak_parts(fn, args, {"causal": False, "block_k": block_k})
        for block_k in BLOCK_K_PROBE
    ]
    # (tracemalloc's peaks, torch's largest allocations), each at 16 and 256
    measures = list(zip(*parts))
    # a measure that saw nothing at either size (torch's, for an answer in
    # numpy) is left out, so that the message quotes what the answer used
    measures = [pair for pair in measures if max(pair) > 0] or measures
    peaks = max(measures, key=lambda pair: pair[1] - pair[0])
    low, high = BLOCK_K_PROBE
    least_growth = 4 * (high - low)
    if peaks[1] - peaks[0] < least_growth:
        raise ExerciseError(
            "attention backward",
            f"n_q = {n_q}, n_k = {n_k}, d = {d}, block_k = {low} and "
            f"{high} (memory)",
            f"your function's peak memory was {format_bytes(peaks[0])} with "
            f"block_k = {low} and {format_bytes(peaks[1])} with block_k = "
            f"{high}; a tile of {high} keys holds at least one row of them, "
            f"{least_growth} bytes more in float32",
            mistake=BLOCK_K_IGNORED,
        )
    return peaks[0], peaks[1]


# the key-block test: n_q = block_k queries, d = 4, and two numbers of keys
KEYS_PROBE_SHAPE = (256, 4)  # n_q = block_k, d
KEYS_PROBE = (1024, 4096)  # n_k


def _check_backward_tiles_follow_keys(fn) -> float:
    """Reject a backward pass whose tiles are blocks of queries with all the
    keys at once (the expert reader's W6: right gradients, tiles of block_k
    x n_k, which follow block_k and grow as n, so the tests above pass it).

    With n_q = block_k = 256 and d = 4, a pass over blocks of keys holds a
    tile of 256 x 256 whatever n_k; from n_k = 1024 to 4096 only the n_k x d
    arrays grow (dK and dV, 64 bytes a key, a few hundred with copies). A
    tile of block_k queries and all n_k keys grows by block_k entries a key,
    1 KiB in float32, 2 KiB in float64. The threshold is half a float32 row,
    2 block_k bytes a key, on tracemalloc's peak and on torch's largest
    allocation each (:func:`_peak_parts`). Returns the larger growth, in
    bytes a key."""
    from ..bench import format_bytes

    __tracebackhide__ = True
    n_q, d = KEYS_PROBE_SHAPE
    block_k = n_q
    measured = []
    for n_k in KEYS_PROBE:
        rng = np.random.default_rng(28)
        q, out, d_out = (rng.normal(size=(n_q, d)) for _ in range(3))
        k, v = (rng.normal(size=(n_k, d)) for _ in range(2))
        lse = rng.normal(size=n_q) + 3.0
        args = (q, k, v, out, lse, d_out)
        kwargs = {"causal": False, "block_k": block_k}
        measured.append(_peak_parts(fn, args, kwargs))
    few, many = KEYS_PROBE
    # per measure (tracemalloc's, torch's): its peaks at few and many keys
    peaks = max(zip(*measured), key=lambda pair: pair[1] - pair[0])
    per_key = (peaks[1] - peaks[0]) / (many - few)
    if per_key > 2 * block_k:
        raise ExerciseError(
            "attention backward",
            f"n_q = {n_q}, n_k = {few} and {many}, d = {d}, block_k = "
            f"{block_k} (memory)",
            f"your function's peak memory grew from {format_bytes(peaks[0])} "
            f"to {format_bytes(peaks[1])}, {per_key:.0f} bytes for each "
            f"extra key, where a tile of {block_k} keys does not grow with "
            f"n_k (half a float32 row of {block_k} queries: "
            f"{2 * block_k} bytes a key)",
            mistake=QUERY_BLOCKS,
        )
    return per_key
