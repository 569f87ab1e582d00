"""The chapter-1 checkers reject each classic mistake (written here
independently) and pass the solutions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnbook.exercises._framework import ExerciseError, NotAttemptedError
from attnbook.exercises.embeddings import (
    COSINE_MISTAKES,
    PPMI_MISTAKES,
    check_cosine_similarity,
    check_ppmi,
)

# --- cosine similarity: a reference written with loops, and wrong versions ---


def loop_cosine(a, b, zero_guard=True, transpose=False):
    a, b = np.asarray(a, float), np.asarray(b, float)
    out = np.zeros((len(a), len(b)))
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            nx, ny = (
                math.sqrt(sum(t * t for t in x)),
                math.sqrt(sum(t * t for t in y)),
            )
            dot = float(np.dot(x, y))
            if nx == 0 or ny == 0:
                out[i, j] = 0.0 if zero_guard else math.nan
            else:
                out[i, j] = dot / (nx * ny)
    return out.T if transpose else out


def cos_raw_dot(a, b):
    return np.einsum("id,jd->ij", a, b)


def cos_only_a(a, b):
    return (a / np.sqrt((a**2).sum(axis=1))[:, None]) @ b.T


def cos_only_b(a, b):
    return np.einsum(
        "id,jd->ij", a, b / np.sqrt((b**2).sum(axis=1, keepdims=True))
    )


def cos_columns(a, b):
    return (a / np.sqrt((a**2).sum(axis=0))) @ (
        b / np.sqrt((b**2).sum(axis=0))
    ).T


def cos_no_keepdims(a, b):
    return (a / np.linalg.norm(a, axis=1)) @ (b / np.linalg.norm(b, axis=1)).T


def cos_squared(a, b):
    out = a @ b.T
    for i in range(len(a)):
        for j in range(len(b)):
            out[i, j] /= np.dot(a[i], a[i]) * np.dot(b[j], b[j])
    return out


def cos_distance(a, b):
    return 1.0 - loop_cosine(a, b)


def cos_transposed(a, b):
    return loop_cosine(a, b, transpose=True)


def cos_unguarded(a, b):
    with np.errstate(invalid="ignore"):
        return loop_cosine(a, b, zero_guard=False)


@pytest.mark.parametrize(
    "wrong, key",
    [
        (cos_raw_dot, "raw_dot"),
        (cos_only_a, "only_a"),
        (cos_only_b, "only_b"),
        (cos_columns, "wrong_axis"),
        (cos_no_keepdims, "no_keepdims"),
        (cos_squared, "squared_norms"),
        (cos_distance, "distance"),
        (cos_transposed, "transposed"),
        (cos_unguarded, "zero_row_nan"),
    ],
)
def test_cosine_checker_names_each_mistake(wrong, key):
    with pytest.raises(ExerciseError) as info:
        check_cosine_similarity(wrong)
    assert info.value.mistake == key, str(info.value)
    assert "Hint:" in str(info.value)


def test_every_cosine_mistake_is_tested():
    tested = {
        "raw_dot",
        "only_a",
        "only_b",
        "wrong_axis",
        "no_keepdims",
        "no_keepdims_a_only",
        "no_keepdims_b_only",
        "squared_norms",
        "distance",
        "transposed",
        "zero_row_nan",
        "zero_guard_a_only",
        "zero_guard_b_only",
        "zero_row_one",
        "matrix_norms",
        "l1_norms",
        "centred",
        "norm_floor",
        "eps_added",
        "absolute",
        "clipped_at_zero",
    }
    assert {m.key for m in COSINE_MISTAKES} == tested


def test_cosine_checker_passes_correct_solutions(capsys):
    check_cosine_similarity(loop_cosine)

    def vectorised(a, b):
        an = np.linalg.norm(a, axis=1, keepdims=True)
        bn = np.linalg.norm(b, axis=1, keepdims=True)
        a_hat = np.divide(a, an, out=np.zeros_like(a), where=an > 0)
        b_hat = np.divide(b, bn, out=np.zeros_like(b), where=bn > 0)
        return a_hat @ b_hat.T

    check_cosine_similarity(vectorised)
    assert capsys.readouterr().out.count("Correct: cosine similarity") == 2


def test_cosine_checker_stub_and_unknown_errors():
    def stub(a, b):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_cosine_similarity(stub)
    with pytest.raises(ExerciseError) as info:
        check_cosine_similarity(lambda a, b: loop_cosine(a, b) + 0.01)
    assert info.value.mistake is None and "largest difference" in str(
        info.value
    )


# --- PPMI: a reference written with loops, and wrong versions ---------------


def loop_ppmi(
    counts, log=math.log, clip=True, guard=True, with_total=True, swap=False
):
    counts = np.asarray(counts, float)
    total = counts.sum()
    rows, cols = counts.sum(axis=1), counts.sum(axis=0)
    if swap:
        rows, cols = cols, rows
    out = np.zeros_like(counts)
    for w in range(counts.shape[0]):
        for c in range(counts.shape[1]):
            n = counts[w, c]
            expected = rows[w] * cols[c] / (total if with_total else 1.0)
            if expected == 0:
                out[w, c] = 0.0 if guard else math.nan
            elif n == 0:
                out[w, c] = 0.0 if clip else -math.inf
            else:
                value = log(n / expected)
                out[w, c] = max(value, 0.0) if clip else value
    return out


def ppmi_unclipped(counts):
    return loop_ppmi(counts, clip=False)


def ppmi_nan_rows(counts):
    return loop_ppmi(counts, guard=False)


def ppmi_no_total(counts):
    return loop_ppmi(counts, with_total=False)


def ppmi_log2(counts):
    return loop_ppmi(counts, log=math.log2)


def ppmi_swapped(counts):
    return loop_ppmi(counts, swap=True)


@pytest.mark.parametrize(
    "wrong, key",
    [
        (ppmi_unclipped, "no_clip"),
        (ppmi_nan_rows, "zero_row_nan"),
        (ppmi_no_total, "missing_total"),
        (ppmi_log2, "log2"),
        (ppmi_swapped, "swapped_marginals"),
    ],
)
def test_ppmi_checker_names_each_mistake(wrong, key):
    with pytest.raises(ExerciseError) as info:
        check_ppmi(wrong)
    assert info.value.mistake == key, str(info.value)


def test_every_ppmi_mistake_is_tested():
    assert {m.key for m in PPMI_MISTAKES} == {
        "no_clip",
        "zero_row_nan",
        "missing_total",
        "log2",
        "swapped_marginals",
        "negative_kept",
        "all_zero",
        "rows_guarded_only",
        "columns_guarded_only",
        "row_sums_twice",
        "column_sums_twice",
        "absolute",
        "context_smoothing",
        "add_one",
        "shifted",
        "clipped_above",
        "eps_smoothed",
    }


def test_ppmi_checker_passes_the_loop_reference(capsys):
    check_ppmi(loop_ppmi)
    assert "Correct: PPMI passes all" in capsys.readouterr().out


def test_ppmi_checker_stub():
    def stub(counts):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_ppmi(stub)


# --- the catalogue (run by tests/test_exercises_framework.py) ----------------


def cosine_einsum_float32(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    na, nb = (
        np.sqrt(np.einsum("id,id->i", a, a)),
        np.sqrt(np.einsum("jd,jd->j", b, b)),
    )
    dots = np.einsum("id,jd->ij", a, b)
    with np.errstate(all="ignore"):
        out = dots / np.outer(na, nb)
    # float32 answer
    return np.where(np.outer(na, nb) > 0, out, 0.0).astype(np.float32)


def cosine_in_place(a, b):
    # normalises the caller's arrays
    for x in (a, b):
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        np.divide(x, norms, out=x, where=norms > 0)
    return a @ b.T


def ppmi_vectorised(counts):
    total = counts.sum()
    with np.errstate(all="ignore"):
        pmi = np.log(
            counts * total / np.outer(counts.sum(axis=1), counts.sum(axis=0))
        )
    return np.where(counts > 0, np.maximum(pmi, 0.0), 0.0)


def ppmi_torch(counts):
    import torch

    c = torch.from_numpy(np.asarray(counts, float))
    p = c / c.sum()
    pmi = torch.log(p / (p.sum(1, keepdim=True) * p.sum(0, keepdim=True)))
    return torch.where(c > 0, pmi.clamp(min=0), torch.zeros_like(pmi))


CATALOGUE = {
    "check_cosine_similarity": {
        "right": [loop_cosine, cosine_einsum_float32, cosine_in_place],
        "wrong": [
            (cos_raw_dot, "raw_dot"),
            (cos_only_a, "only_a"),
            (cos_only_b, "only_b"),
            (cos_columns, "wrong_axis"),
            (cos_no_keepdims, "no_keepdims"),
            (cos_squared, "squared_norms"),
            (cos_distance, "distance"),
            (cos_transposed, "transposed"),
            (cos_unguarded, "zero_row_nan"),
        ],
    },
    "check_ppmi": {
        "right": [loop_ppmi, ppmi_vectorised, ppmi_torch],
        "wrong": [
            (ppmi_unclipped, "no_clip"),
            (ppmi_nan_rows, "zero_row_nan"),
            (ppmi_no_total, "missing_total"),
            (ppmi_log2, "log2"),
            (ppmi_swapped, "swapped_marginals"),
        ],
    },
}


# --- from the expert reading of chapter 1 (checker-findings) -----------------


def ppmi_negatives_kept(counts):
    """PMI, with the -inf of unseen pairs set to 0 but the negative values
    kept."""
    c = np.asarray(counts, float)
    with np.errstate(all="ignore"):
        pmi = np.log(c * c.sum() / np.outer(c.sum(1), c.sum(0)))
    return np.nan_to_num(pmi, nan=0.0, neginf=0.0)


def ppmi_of_conditional(counts):
    """log p(c | w) = log(N_wc / N_w), clipped: never positive, so all
    zeros."""
    c = np.asarray(counts, float)
    with np.errstate(all="ignore"):
        return np.maximum(
            np.nan_to_num(
                np.log(c / c.sum(1, keepdims=True)), nan=0.0, neginf=0.0
            ),
            0.0,
        )


def ppmi_all_zeros(counts):
    return np.zeros_like(np.asarray(counts, float))


def ppmi_in_place(counts):
    """Right, and overwrites its input with the result."""
    row, col, total = (
        counts.sum(1, keepdims=True),
        counts.sum(0, keepdims=True),
        counts.sum(),
    )
    seen = counts > 0
    counts *= total
    with np.errstate(all="ignore"):
        counts /= row * col
        np.log(counts, out=counts, where=seen)
    counts[~seen] = 0.0
    np.maximum(counts, 0.0, out=counts)
    return counts


CATALOGUE["check_ppmi"]["wrong"] += [
    (ppmi_negatives_kept, "negative_kept"),
    (ppmi_of_conditional, "all_zero"),
    (ppmi_all_zeros, "all_zero"),
]
CATALOGUE["check_ppmi"]["right"] += [ppmi_in_place]


def test_a_zero_output_is_not_named_as_the_missing_total():
    """Without N the ratio N_wc / (N_w N_c) exceeds 1 on weighted counts below
    1: zeros are another slip."""
    with pytest.raises(ExerciseError) as err:
        check_ppmi(ppmi_all_zeros)
    assert err.value.mistake == "all_zero"


# --- from the second expert reading of chapter 1: zero rows on the other side
# ------------------------------


def cos_guard_a_only(a, b):
    """Guards a's zero rows only: b's zero row still gives 0/0."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    na = np.linalg.norm(a, axis=1, keepdims=True)
    a_hat = np.divide(a, na, out=np.zeros_like(a), where=na > 0)
    with np.errstate(all="ignore"):
        b_hat = b / np.linalg.norm(b, axis=1, keepdims=True)
    return a_hat @ b_hat.T


def ppmi_guard_rows_only(counts):
    """Sets a zero row to 0, but a context that never occurs (a zero column)
    still gives log(0/0) = NaN."""
    c = np.asarray(counts, float)
    with np.errstate(all="ignore"):
        pmi = np.log(
            c * c.sum() / (c.sum(1, keepdims=True) * c.sum(0, keepdims=True))
        )
    pmi[c.sum(1) == 0] = 0.0
    return np.maximum(pmi, 0.0)


def test_a_guard_on_one_side_only_is_rejected():
    for check, fn in (
        (check_cosine_similarity, cos_guard_a_only),
        (check_ppmi, ppmi_guard_rows_only),
    ):
        with pytest.raises(ExerciseError):
            check(fn)


# --- from the third expert reading of chapter 1: each wrong answer it found
# gets a named diagnosis ---------- Written as a student would, independently
# of the checker's Mistake functions; the correct alternatives the reader tried
# follow, and must still pass.


def cos_guard_b_only(a, b):
    """Guards b's zero rows only, with a loop: a's zero row still gives 0/0."""
    out = np.empty((len(a), len(b)))
    for j, y in enumerate(b):
        ny = math.sqrt(float(y @ y))
        for i, x in enumerate(a):
            with np.errstate(all="ignore"):
                out[i, j] = (
                    0.0 if ny == 0 else float(x @ y) / (np.sqrt(x @ x) * ny)
                )
    return out


def cos_guard_a_only_loop(a, b):
    """Guards a's zero rows only, testing a's norm first: 0 where two zero rows
    meet, NaN elsewhere in b's."""
    out = np.empty((len(a), len(b)))
    for i, x in enumerate(a):
        nx = math.sqrt(float(x @ x))
        for j, y in enumerate(b):
            with np.errstate(all="ignore"):
                out[i, j] = (
                    0.0 if nx == 0 else float(x @ y) / (nx * np.sqrt(y @ y))
                )
    return out


def cos_guard_b_only_matrices(a, b):
    """Guards b's zero rows only, on normalised matrices: NaN along a's zero
    row, where b's zero row too."""
    nb = np.linalg.norm(b, axis=1, keepdims=True)
    b_hat = np.divide(b, nb, out=np.zeros_like(b), where=nb > 0)
    with np.errstate(all="ignore"):
        return (a / np.linalg.norm(a, axis=1, keepdims=True)) @ b_hat.T


def cos_zero_rows_one(a, b):
    """Unguarded, then NaN replaced by 1: a zero row gets cosine 1 with
    everything."""
    with np.errstate(all="ignore"):
        cos = (a @ b.T) / np.outer(
            np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
        )
    return np.nan_to_num(cos, nan=1.0)


def cos_frobenius(a, b):
    """np.linalg.norm without an axis: one norm for the whole matrix."""
    return a @ b.T / (np.linalg.norm(a) * np.linalg.norm(b))


def cos_l1(a, b):
    """Rows divided by the sums of their absolute values, zero rows guarded."""

    def unit(x):
        s = np.abs(x).sum(axis=1, keepdims=True)
        return np.divide(x, s, out=np.zeros_like(x), where=s != 0)

    return unit(a) @ unit(b).T


def cos_pearson(a, b):
    """The correlation of the rows: centred, then normalised (np.corrcoef's
    numbers)."""
    out = np.zeros((len(a), len(b)))
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            x0, y0 = x - x.mean(), y - y.mean()
            den = math.sqrt(float(x0 @ x0) * float(y0 @ y0))
            out[i, j] = float(x0 @ y0) / den if den > 0 else 0.0
    return out


def cos_torch_broadcast(a, b):
    """Right: torch's cosine_similarity by broadcasting (m, 1, d) against (1,
    n, d); returns a tensor."""
    import torch

    return torch.nn.functional.cosine_similarity(
        torch.as_tensor(a)[:, None], torch.as_tensor(b)[None], dim=-1
    )


def cos_outer_guard(a, b):
    """Right: all dot products divided by the outer product of the norms,
    guarded where it is 0."""
    den = np.outer(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1))
    return np.divide(a @ b.T, den, out=np.zeros(den.shape), where=den > 0)


def cos_nested_list(a, b):
    """Right, returned as a nested Python list."""
    return [[float(v) for v in row] for row in loop_cosine(a, b)]


def ppmi_guard_columns_only(counts):
    """Sets a context that never occurs to 0, but a zero row still gives
    log(0/0) = NaN."""
    c = np.asarray(counts, float)
    total, rows, cols = c.sum(), c.sum(axis=1), c.sum(axis=0)
    out = np.zeros_like(c)
    for w in range(c.shape[0]):
        for k in range(c.shape[1]):
            if cols[k] == 0:
                continue
            with np.errstate(all="ignore"):
                out[w, k] = max(
                    np.log(c[w, k] * total / (rows[w] * cols[k])), 0.0
                )
    return out


def ppmi_row_sums_for_both(counts):
    """Uses the row sums for p(c) as well (right for the symmetric window
    counts of the chapter only)."""
    c = np.asarray(counts, float)
    p_w = c.sum(axis=1) / c.sum()
    with np.errstate(all="ignore"):
        pmi = np.log((c / c.sum()) / (p_w[:, None] * p_w[None, :]))
    return np.where(c > 0, np.maximum(pmi, 0.0), 0.0)


def ppmi_column_sums_for_both(counts):
    """Uses the column sums for p(w) as well."""
    c = np.asarray(counts, float)
    p_c = c.sum(axis=0) / c.sum()
    with np.errstate(all="ignore"):
        pmi = np.log(c / c.sum()) - np.log(p_c)[:, None] - np.log(p_c)[None, :]
    return np.where(c > 0, np.maximum(pmi, 0.0), 0.0)


def ppmi_absolute(counts):
    """|PMI| for the seen pairs, instead of the positive part."""
    c = np.asarray(counts, float)
    out = np.zeros_like(c)
    seen = c > 0
    expected = np.outer(c.sum(axis=1), c.sum(axis=0)) / c.sum()
    out[seen] = np.abs(np.log(c[seen] / expected[seen]))
    return out


def ppmi_smoothed_contexts(counts, alpha=0.75):
    """Levy et al.'s context-distribution smoothing, p(c) from N_c ** 0.75."""
    c = np.asarray(counts, float)
    p_wc, p_w = c / c.sum(), c.sum(axis=1) / c.sum()
    p_c = c.sum(axis=0) ** alpha / (c.sum(axis=0) ** alpha).sum()
    out = np.zeros_like(c)
    for w, k in zip(*np.nonzero(c)):
        out[w, k] = max(math.log(p_wc[w, k] / (p_w[w] * p_c[k])), 0.0)
    return out


def ppmi_add_one(counts):
    """Add-one smoothing: every count + 1, then PPMI."""
    c = np.asarray(counts, float) + 1.0
    return np.maximum(
        np.log(c * c.sum() / np.outer(c.sum(axis=1), c.sum(axis=0))), 0.0
    )


def ppmi_float32_in_place(counts):
    """Right: in float32, on a copy, with in-place operations."""
    n = np.asarray(counts, np.float32).copy()
    total, rows, cols = (
        n.sum(),
        n.sum(axis=1, keepdims=True),
        n.sum(axis=0, keepdims=True),
    )
    with np.errstate(all="ignore"):
        n *= total
        n /= rows
        n /= cols
        np.log(n, out=n, where=n > 0)
    n[~np.isfinite(n)] = 0.0
    np.maximum(n, 0.0, out=n)
    return n


def ppmi_log_probabilities(counts):
    """Right: log p(w, c) - log p(w) - log p(c), kept where the count is
    positive."""
    p = np.asarray(counts, float) / np.sum(counts)
    with np.errstate(all="ignore"):
        pmi = (
            np.log(p)
            - np.log(p.sum(axis=1, keepdims=True))
            - np.log(p.sum(axis=0, keepdims=True))
        )
    return np.where(p > 0, np.maximum(pmi, 0.0), 0.0)


def ppmi_nan_to_num_after_clip(counts):
    """Right: no guard until the end, where NaN (0/0) and the clipped -inf
    become 0."""
    with np.errstate(all="ignore"):
        pmi = np.log(
            counts
            * counts.sum()
            / np.outer(counts.sum(axis=1), counts.sum(axis=0))
        )
    return np.nan_to_num(np.maximum(pmi, 0.0))


def ppmi_row_sums_for_both_when_square(counts):
    """The student reading's variant: the row sums for both marginals when
    the matrix is square (as the chapter's symmetric counts are), the column
    sums only for a rectangular one."""
    c = np.asarray(counts, float)
    out = np.zeros_like(c)
    seen = c > 0
    rows = c.sum(axis=1)
    cols = rows if c.shape[0] == c.shape[1] else c.sum(axis=0)
    expected = np.outer(rows, cols)
    out[seen] = np.maximum(np.log(c[seen] * c.sum() / expected[seen]), 0.0)
    return out


THIRD_READING_WRONG = {
    check_cosine_similarity: [
        (cos_guard_a_only, "zero_guard_a_only"),
        (cos_guard_a_only_loop, "zero_guard_a_only"),
        (cos_guard_b_only, "zero_guard_b_only"),
        (cos_guard_b_only_matrices, "zero_guard_b_only"),
        (cos_zero_rows_one, "zero_row_one"),
        (cos_frobenius, "matrix_norms"),
        (cos_l1, "l1_norms"),
        (cos_pearson, "centred"),
    ],
    check_ppmi: [
        (ppmi_guard_rows_only, "rows_guarded_only"),
        (ppmi_guard_columns_only, "columns_guarded_only"),
        (ppmi_row_sums_for_both, "row_sums_twice"),
        (ppmi_row_sums_for_both_when_square, "row_sums_twice"),
        (ppmi_column_sums_for_both, "column_sums_twice"),
        (ppmi_absolute, "absolute"),
        (ppmi_smoothed_contexts, "context_smoothing"),
        (ppmi_add_one, "add_one"),
    ],
}
THIRD_READING_RIGHT = {
    check_cosine_similarity: [
        cos_torch_broadcast,
        cos_outer_guard,
        cos_nested_list,
    ],
    check_ppmi: [
        ppmi_float32_in_place,
        ppmi_log_probabilities,
        ppmi_nan_to_num_after_clip,
    ],
}


@pytest.mark.parametrize(
    "check, wrong, key",
    [
        pytest.param(check, wrong, key, id=wrong.__name__)
        for check, pairs in THIRD_READING_WRONG.items()
        for wrong, key in pairs
    ],
)
def test_each_wrong_answer_of_the_third_reading_is_named(check, wrong, key):
    with pytest.raises(ExerciseError) as info, np.errstate(all="ignore"):
        check(wrong)
    assert info.value.mistake == key, str(info.value)
    assert "Diagnosis:" in str(info.value) and "Hint:" in str(info.value)


@pytest.mark.parametrize(
    "check, right",
    [
        pytest.param(check, right, id=right.__name__)
        for check, fns in THIRD_READING_RIGHT.items()
        for right in fns
    ],
)
def test_the_right_answers_of_the_third_reading_pass(check, right, capsys):
    check(right)
    assert capsys.readouterr().out.splitlines()[-1].startswith("Correct:")


for _check, _name in (
    (check_cosine_similarity, "check_cosine_similarity"),
    (check_ppmi, "check_ppmi"),
):
    CATALOGUE[_name]["wrong"] += THIRD_READING_WRONG[_check]
    CATALOGUE[_name]["right"] += THIRD_READING_RIGHT[_check]


# --- from the fourth expert reading of chapter 1: the shifted PPMI (SPPMI) of
# Levy & Goldberg 2014 ----------


def sppmi(counts, k):
    """max(0, PMI - log k), written the way the word2vec literature writes it,
    with a loop over the entries."""
    counts = np.asarray(counts, dtype=float)
    total, rows, cols = counts.sum(), counts.sum(axis=1), counts.sum(axis=0)
    out = np.zeros_like(counts)
    for w in range(counts.shape[0]):
        for c in range(counts.shape[1]):
            if counts[w, c] > 0:
                out[w, c] = max(
                    0.0,
                    math.log(counts[w, c] * total / (rows[w] * cols[c]))
                    - math.log(k),
                )
    return out


def test_a_shift_by_log_2_is_named_sppmi():
    with pytest.raises(ExerciseError) as info:
        check_ppmi(lambda counts: sppmi(counts, 2))
    assert info.value.mistake == "shifted", str(info.value)


def test_a_shift_that_zeroes_everything_names_the_shift_among_the_causes():
    """log 5 is above every PMI of the cases: the output is all zero, and the
    diagnosis names both causes."""
    with pytest.raises(ExerciseError) as info:
        check_ppmi(lambda counts: sppmi(counts, 5))
    assert info.value.mistake == "all_zero" and "SPPMI" in str(info.value), (
        str(info.value)
    )


CATALOGUE["check_ppmi"]["wrong"] += [
    (lambda counts: sppmi(counts, 2), "shifted")
]


# --- the backward pass of the lookup (the hard exercise): wrong solutions as a
# student who half-understood equation ch1-embedding-grad writes them ---------

from attnbook.exercises.embeddings import (  # noqa: E402
    EMBEDDING_GRAD_MISTAKES,
    ONE_HOT_MISTAKE,
    check_embedding_grad,
)


def grad_fancy_index(ids, grad_out, vocab_size):
    """grad[ids] += g: the repeats overwrite each other."""
    d = grad_out.shape[-1]
    grad = np.zeros((vocab_size, d))
    grad[ids.reshape(-1)] += grad_out.reshape(-1, d)
    return grad


def grad_first_occurrence(ids, grad_out, vocab_size):
    """One contribution per distinct token, from its first position."""
    flat = ids.reshape(-1).tolist()
    g = grad_out.reshape(len(flat), -1)
    grad = np.zeros((vocab_size, g.shape[1]))
    for v in set(flat):
        grad[v] = g[flat.index(v)]
    return grad


def grad_averaged(ids, grad_out, vocab_size):
    flat = ids.ravel()
    g = grad_out.reshape(flat.size, -1)
    grad = np.zeros((vocab_size, g.shape[1]))
    for v in np.unique(flat):
        grad[v] = g[flat == v].mean(axis=0)
    return grad


def grad_transposed(ids, grad_out, vocab_size):
    flat = ids.ravel()
    g = grad_out.reshape(flat.size, -1)
    return g.T @ np.eye(vocab_size)[flat]


def grad_per_sentence(ids, grad_out, vocab_size):
    """The chapter's H^T G with einsum, batch axes kept."""
    h = np.eye(vocab_size)[ids]
    return np.einsum("...nv,...nd->...vd", h, grad_out)


def grad_loop_over_sentences(ids, grad_out, vocab_size):
    grad = np.zeros((vocab_size, grad_out.shape[-1]))
    for i, v in enumerate(ids):
        grad[v] += grad_out[i]
    return grad


def grad_rows_from_ids(ids, grad_out, vocab_size):
    """Sizes the table from the ids it was given."""
    grad = np.zeros((int(ids.max()) + 1, grad_out.shape[-1]))
    np.add.at(grad, ids, grad_out)
    return grad


def grad_table_one_row_short(ids, grad_out, vocab_size):
    """Allocates vocab_size - 1 rows (reading s6-u: it was named as sized
    from the ids, which give the same rows on the first case)."""
    d = grad_out.shape[-1]
    grad = np.zeros((vocab_size - 1, d), dtype=grad_out.dtype)
    flat = ids.reshape(-1)
    keep = flat < vocab_size - 1
    np.add.at(grad, flat[keep], grad_out.reshape(-1, d)[keep])
    return grad


def grad_bincount_unflattened(ids, grad_out, vocab_size):
    return np.stack(
        [
            np.bincount(ids, weights=grad_out[..., k], minlength=vocab_size)
            for k in range(grad_out.shape[-1])
        ],
        axis=1,
    )


def grad_descent_step(ids, grad_out, vocab_size):
    """The update -dL/dE instead of the gradient."""
    grad = np.zeros((vocab_size, grad_out.shape[-1]))
    np.subtract.at(grad, ids, grad_out)
    return grad


def grad_product_reshaped_by_count(ids, grad_out, vocab_size):
    """Right but on no tokens: reshape(0, -1) cannot infer the width."""
    flat = ids.reshape(-1)
    return np.eye(vocab_size)[flat].T @ grad_out.reshape(flat.size, -1)


def grad_torch_reshaped_by_count(ids, grad_out, vocab_size):
    """torch's index_add_, right but on no tokens (reshape(0, -1))."""
    import torch

    flat = torch.as_tensor(np.asarray(ids).reshape(-1), dtype=torch.long)
    g = torch.as_tensor(np.asarray(grad_out)).reshape(flat.numel(), -1)
    return torch.zeros(vocab_size, g.shape[1], dtype=g.dtype).index_add_(
        0, flat, g
    )


# right solutions, none of them the book's np.add.at


def grad_one_hot_product(ids, grad_out, vocab_size):
    flat = ids.reshape(-1)
    return np.eye(vocab_size)[flat].T @ grad_out.reshape(
        -1, grad_out.shape[-1]
    )


def grad_bincount(ids, grad_out, vocab_size):
    flat = ids.reshape(-1)
    g = grad_out.reshape(-1, grad_out.shape[-1])
    return np.stack(
        [
            np.bincount(flat, weights=g[:, k], minlength=vocab_size)
            for k in range(g.shape[1])
        ],
        axis=1,
    )


def grad_torch_index_add_float32(ids, grad_out, vocab_size):
    import torch

    flat = torch.as_tensor(np.asarray(ids).reshape(-1), dtype=torch.long)
    g = torch.as_tensor(np.asarray(grad_out), dtype=torch.float32)
    g = g.reshape(-1, g.shape[-1])
    return torch.zeros(vocab_size, g.shape[1]).index_add_(0, flat, g)


def grad_torch_one_hot(ids, grad_out, vocab_size):
    """H^T G with torch's one_hot: right values, H built."""
    import torch

    flat = torch.as_tensor(np.asarray(ids).reshape(-1), dtype=torch.long)
    g = torch.as_tensor(np.asarray(grad_out))
    h = torch.nn.functional.one_hot(flat, vocab_size).to(g.dtype)
    return h.T @ g.reshape(-1, g.shape[-1])


def grad_torch_one_hot_to_numpy(ids, grad_out, vocab_size):
    """H^T G in torch (H in float32), returned as a numpy array: the old
    checker measured torch's memory only for a returned tensor, and accepted
    it (issue 24)."""
    import torch

    flat = torch.as_tensor(np.asarray(ids).reshape(-1), dtype=torch.long)
    g = torch.as_tensor(np.asarray(grad_out, np.float32))
    h = torch.zeros(len(flat), vocab_size)
    h[torch.arange(len(flat)), flat] = 1.0
    return (h.T @ g.reshape(-1, g.shape[-1])).numpy()


def grad_boolean_one_hot(ids, grad_out, vocab_size):
    """H as booleans (1 byte an entry), then H^T G: still H."""
    flat = ids.reshape(-1)
    h = flat[:, None] == np.arange(vocab_size)
    return h.T.astype(float) @ grad_out.reshape(-1, grad_out.shape[-1])


def grad_torch_index_add(ids, grad_out, vocab_size):
    """torch's index_add_ in float64, no H."""
    import torch

    flat = torch.as_tensor(np.asarray(ids).reshape(-1), dtype=torch.long)
    g = torch.as_tensor(np.asarray(grad_out, dtype=np.float64))
    g = g.reshape(-1, g.shape[-1])
    return torch.zeros(vocab_size, g.shape[1], dtype=g.dtype).index_add_(
        0, flat, g
    )


def grad_add_at(ids, grad_out, vocab_size):
    """The book's answer, np.add.at."""
    grad = np.zeros((vocab_size, grad_out.shape[-1]))
    np.add.at(grad, ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1]))
    return grad


def grad_python_lists(ids, grad_out, vocab_size):
    """A loop over the positions, returning a list of lists."""
    d = grad_out.shape[-1]
    rows = [[0.0] * d for _ in range(vocab_size)]
    for v, g in zip(ids.reshape(-1), grad_out.reshape(-1, d)):
        for k in range(d):
            rows[int(v)][k] += float(g[k])
    return rows


def grad_sorted_segments(ids, grad_out, vocab_size):
    """Sort the positions by token and add up each run (np.add.reduceat)."""
    flat = ids.reshape(-1)
    g = grad_out.reshape(-1, grad_out.shape[-1])
    grad = np.zeros((vocab_size, g.shape[1]))
    if flat.size == 0:
        return grad
    order = np.argsort(flat, kind="stable")
    tokens, starts = np.unique(flat[order], return_index=True)
    grad[tokens] = np.add.reduceat(g[order], starts, axis=0)
    return grad


EMBEDDING_GRAD_WRONG = [
    (grad_fancy_index, "fancy_index_add"),
    (grad_first_occurrence, "distinct_once"),
    (grad_averaged, "mean_of_repeats"),
    (grad_transposed, "transposed"),
    (grad_per_sentence, "per_sentence"),
    (grad_loop_over_sentences, "loop_over_first_axis"),
    (grad_rows_from_ids, "rows_up_to_largest_id"),
    (grad_table_one_row_short, "rows_one_short"),
    (grad_bincount_unflattened, "not_flattened"),
    (grad_descent_step, "negated"),
    (grad_product_reshaped_by_count, "empty_reshape"),
    (grad_torch_reshaped_by_count, "empty_reshape"),
    # right values through the one-hot H (the chapter's H^T G): rejected by
    # the memory case, whatever builds H
    (grad_one_hot_product, "one_hot_matrix"),
    (grad_torch_one_hot, "one_hot_matrix"),
    (grad_torch_one_hot_to_numpy, "one_hot_matrix"),
    (grad_boolean_one_hot, "one_hot_matrix"),
]
CATALOGUE["check_embedding_grad"] = {
    "right": [
        grad_add_at,
        grad_bincount,
        grad_torch_index_add_float32,
        grad_torch_index_add,
        grad_python_lists,
        grad_sorted_segments,
    ],
    "wrong": EMBEDDING_GRAD_WRONG,
}


def test_every_embedding_grad_mistake_is_in_the_catalogue():
    """Each of the checker's mistakes has a wrong solution of its own."""
    assert {m.key for m in EMBEDDING_GRAD_MISTAKES} | {
        ONE_HOT_MISTAKE.key
    } == {key for _, key in EMBEDDING_GRAD_WRONG}


def test_the_memory_case_leaves_a_wide_margin():
    """H, even as booleans, is 2x the threshold; a right answer peaks far
    below it (the memory check cannot flake)."""
    from attnbook.bench import peak_memory
    from attnbook.exercises.embeddings import MEMORY_LIMIT, _memory_case

    case = _memory_case()
    ids = case.args[0]
    assert ids.size * case.args[2] >= 2 * MEMORY_LIMIT
    for right in (grad_add_at, grad_bincount, grad_sorted_segments):
        _, peak = peak_memory(right, *case.args)
        assert peak < MEMORY_LIMIT / 4, (right.__name__, peak)


@pytest.mark.parametrize(
    "wrong, key",
    EMBEDDING_GRAD_WRONG,
    ids=[k for _, k in EMBEDDING_GRAD_WRONG],
)
def test_embedding_grad_checker_names_each_mistake(wrong, key):
    with pytest.raises(ExerciseError) as info:
        check_embedding_grad(wrong)
    assert info.value.mistake == key, str(info.value)
    assert "Hint:" in str(info.value)


def test_embedding_grad_checker_passes_right_solutions(capsys):
    for solution in CATALOGUE["check_embedding_grad"]["right"]:
        check_embedding_grad(solution)
    out = capsys.readouterr().out
    assert out.count("Correct: embedding gradient") == 6


def test_embedding_grad_checker_stub_and_unknown_errors():
    def stub(ids, grad_out, vocab_size):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_embedding_grad(stub)
    with pytest.raises(ExerciseError) as info:
        check_embedding_grad(
            lambda ids, g, v: grad_one_hot_product(ids, g, v) * 2
        )
    assert info.value.mistake is None


# --- from the expert reading ch01-s: keepdims forgotten on one side only, and
# the hint of the buffered `grad[ids] += g` ----------------------------------


def cos_no_keepdims_on_a(a, b):
    """keepdims remembered for b, forgotten for a."""
    a_hat = a / np.linalg.norm(a, axis=1)
    nb = np.linalg.norm(b, axis=1, keepdims=True)
    b_hat = np.divide(b, nb, out=np.zeros_like(b), where=nb > 0)
    return a_hat @ b_hat.T


def cos_no_keepdims_on_b(a, b):
    """a's rows divided by (m, 1) lengths, b's by (n,) sums of squares."""
    a_hat = a / np.sqrt((a * a).sum(axis=1))[:, None]
    b_hat = b / np.sqrt((b * b).sum(axis=1))
    return np.einsum("id,jd->ij", a_hat, b_hat)


def cos_mixed_keepdims_styles(a, b):
    """Right: keepdims on one side, [:, None] on the other."""
    na = np.linalg.norm(a, axis=1, keepdims=True)
    nb = np.linalg.norm(b, axis=1)[:, None]
    a_hat = np.where(na > 0, a / np.where(na > 0, na, 1.0), 0.0)
    b_hat = np.where(nb > 0, b / np.where(nb > 0, nb, 1.0), 0.0)
    return a_hat @ b_hat.T


@pytest.mark.parametrize(
    "wrong, key",
    [
        (cos_no_keepdims_on_a, "no_keepdims_a_only"),
        (cos_no_keepdims_on_b, "no_keepdims_b_only"),
    ],
)
def test_keepdims_forgotten_on_one_side_is_named(wrong, key):
    with pytest.raises(ExerciseError) as info, np.errstate(all="ignore"):
        check_cosine_similarity(wrong)
    assert info.value.mistake == key, str(info.value)
    # the diagnosis names the side at fault, not a generic difference
    side = key.split("_")[2]
    assert f"row norms of {side}" in str(info.value)


def test_mixed_keepdims_styles_pass(capsys):
    check_cosine_similarity(cos_mixed_keepdims_styles)
    assert capsys.readouterr().out.startswith("Correct:")


CATALOGUE["check_cosine_similarity"]["wrong"] += [
    (cos_no_keepdims_on_a, "no_keepdims_a_only"),
    (cos_no_keepdims_on_b, "no_keepdims_b_only"),
]
CATALOGUE["check_cosine_similarity"]["right"] += [cos_mixed_keepdims_styles]


def test_the_buffered_add_hint_never_recommends_h_transpose_g():
    """The exercise forbids building H, and the memory case rejects H^T G:
    the hint that the trap `grad[ids] += g` meets must not send the reader
    there, and what it does recommend must pass."""
    with pytest.raises(ExerciseError) as info:
        check_embedding_grad(grad_fancy_index)
    assert info.value.mistake == "fancy_index_add"
    message = str(info.value)
    hint = message[message.index("Hint:") :]
    assert "take the product H^T G" not in hint
    assert "one-hot rows" not in hint
    assert "np.add.at" in hint and "not the product H^T G" in hint
    # the hint names the method, not the answer's line (student reading
    # ch0102: one wrong try handed over np.add.at(grad, ids.reshape(-1), ...))
    for mistake in [*EMBEDDING_GRAD_MISTAKES, ONE_HOT_MISTAKE]:
        assert "np.add.at(" not in mistake.hint, mistake.key
    # no hint of the checker recommends H^T G as the thing to compute
    for mistake in EMBEDDING_GRAD_MISTAKES:
        assert "H^T G itself" not in mistake.hint, mistake.key
        assert "take the product H^T G" not in mistake.hint, mistake.key


# --- from the expert reading ch01-t: a total counted half, and the
# transposed b divided by its (n, 1) norms ----------------------------------


def ppmi_half_total(counts):
    """Each unordered pair counted once: the total is half the matrix's sum
    (a symmetric matrix counts each pair twice)."""
    counts = np.asarray(counts, dtype=float)
    total = counts.sum() / 2
    expected = np.outer(counts.sum(axis=1), counts.sum(axis=0)) / total
    with np.errstate(all="ignore"):
        pmi = np.log(counts / expected)
    return np.where(counts > 0, np.maximum(pmi, 0.0), 0.0)


def cos_divides_transposed_b(a, b):
    """keepdims on both sides, but b.T (d, n) divided by the (n, 1)
    norms."""
    na = np.linalg.norm(a, axis=1, keepdims=True)
    nb = np.linalg.norm(b, axis=1, keepdims=True)
    return (a / na) @ (b.T / nb)


def test_a_halved_total_is_named_among_the_causes_of_the_shift():
    """Same numbers as SPPMI with k = 2: the diagnosis and the hint name the
    total counted half too, not only a - log k the student never wrote."""
    with pytest.raises(ExerciseError) as info, np.errstate(all="ignore"):
        check_ppmi(ppmi_half_total)
    assert info.value.mistake == "shifted", str(info.value)
    message = str(info.value)
    diagnosis = message[: message.index("Hint:")]
    hint = message[message.index("Hint:") :]
    assert "SPPMI" in diagnosis and "half" in diagnosis, message
    assert "log k" in hint and "halve the total" in hint, message


def test_dividing_the_transposed_b_is_named():
    with pytest.raises(ExerciseError) as info, np.errstate(all="ignore"):
        check_cosine_similarity(cos_divides_transposed_b)
    assert info.value.mistake == "no_keepdims_b_only", str(info.value)
    message = str(info.value)
    diagnosis = message[: message.index("Hint:")]
    assert "transposed b" in diagnosis and "row norms of b" in diagnosis
    assert "not b.T" in message[message.index("Hint:") :], message


CATALOGUE["check_ppmi"]["wrong"] += [(ppmi_half_total, "shifted")]
CATALOGUE["check_cosine_similarity"]["wrong"] += [
    (cos_divides_transposed_b, "no_keepdims_b_only")
]


# --- from reader ch01-w: PPMI clipped to [0, 1] was accepted ----------------


def ppmi_clipped_to_one(counts):
    """PPMI clipped to [0, 1], the habitual np.clip(x, 0, 1)."""
    return np.clip(loop_ppmi(counts), 0.0, 1.0)


def ppmi_only_above_one(counts):
    """Keeps only PMI values of 1 or more."""
    with np.errstate(all="ignore"):
        pmi = np.asarray(loop_ppmi(counts, clip=False))
    return np.where(pmi >= 1.0, pmi, 0.0)


CATALOGUE["check_ppmi"]["wrong"] += [
    (ppmi_clipped_to_one, "clipped_above"),
]


def test_ppmi_clipped_to_one_is_rejected_and_named():
    with pytest.raises(ExerciseError) as err:
        check_ppmi(ppmi_clipped_to_one)
    assert err.value.mistake == "clipped_above"


def test_ppmi_kept_only_above_one_is_not_called_all_zero():
    """Reader ch01-w, E2: no case had PPMI of 1 or more, so this answer was
    all zeros and named all_zero, blaming causes the reader did not have."""
    with pytest.raises(ExerciseError) as err:
        check_ppmi(ppmi_only_above_one)
    assert err.value.mistake != "all_zero"


# --- from the expert reading ch01c: a norm clamped to a floor was accepted
# (every row was 0.2 to 5 long) ----------------------------------------------


def cos_clamped_norms(a, b):
    """The reader's: norms clamped at 1e-3 to avoid dividing by zero."""
    na = np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-3)
    nb = np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-3)
    return (a / na) @ (b / nb).T


def cos_clipped_norms_einsum(a, b):
    """Sums of squares clipped below at 1e-8 (lengths at 1e-4), in einsum."""
    na = np.sqrt(np.clip(np.einsum("id,id->i", a, a), 1e-8, None))
    nb = np.sqrt(np.clip(np.einsum("jd,jd->j", b, b), 1e-8, None))
    return np.einsum("id,jd->ij", a, b) / np.outer(na, nb)


def cos_eps_added(a, b):
    """norm + 1e-8, the habitual guard."""
    a_hat = a / (np.linalg.norm(a, axis=1, keepdims=True) + 1e-8)
    b_hat = b / (np.linalg.norm(b, axis=1, keepdims=True) + 1e-8)
    return a_hat @ b_hat.T


def cos_exact_zeros_replaced(a, b):
    """Right: a zero norm replaced by 1 (a zero row stays zero), no eps."""
    na = np.linalg.norm(a, axis=1, keepdims=True)
    nb = np.linalg.norm(b, axis=1, keepdims=True)
    na[na == 0] = 1.0
    nb[nb == 0] = 1.0
    return (a / na) @ (b / nb).T


def cos_float32_exact_guard(a, b):
    """Right: in float32 throughout, zero norms guarded with np.where."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    na = np.sqrt((a * a).sum(axis=1, keepdims=True))
    nb = np.sqrt((b * b).sum(axis=1, keepdims=True))
    a_hat = np.where(na > 0, a / np.where(na > 0, na, 1), 0)
    b_hat = np.where(nb > 0, b / np.where(nb > 0, nb, 1), 0)
    return a_hat @ b_hat.T


def cos_torch_normalize(a, b):
    """Right: torch's F.normalize, whose eps (1e-12) is far below every
    nonzero length here."""
    import torch

    f = torch.nn.functional.normalize
    return f(torch.as_tensor(a), dim=1) @ f(torch.as_tensor(b), dim=1).T


FLOOR_WRONG = [
    (cos_clamped_norms, "norm_floor"),
    (cos_clipped_norms_einsum, "norm_floor"),
    (cos_eps_added, "eps_added"),
]
FLOOR_RIGHT = [
    cos_exact_zeros_replaced,
    cos_float32_exact_guard,
    cos_torch_normalize,
]
CATALOGUE["check_cosine_similarity"]["wrong"] += FLOOR_WRONG
CATALOGUE["check_cosine_similarity"]["right"] += FLOOR_RIGHT


@pytest.mark.parametrize(
    "wrong, key", FLOOR_WRONG, ids=[w.__name__ for w, _ in FLOOR_WRONG]
)
def test_a_norm_kept_from_zero_by_a_large_eps_is_named(wrong, key):
    with pytest.raises(ExerciseError) as info, np.errstate(all="ignore"):
        check_cosine_similarity(wrong)
    assert info.value.mistake == key, str(info.value)
    message = str(info.value)
    assert "1e-6" in message and "where=norms > 0" in message, message


@pytest.mark.parametrize("right", FLOOR_RIGHT, ids=lambda f: f.__name__)
def test_guards_of_exact_zeros_only_pass(right, capsys):
    check_cosine_similarity(right)
    assert capsys.readouterr().out.startswith(
        "Correct: cosine similarity passes all 5 cases."
    )


def test_the_short_rows_leave_the_first_case_and_the_count():
    """The chapter's committed outputs name the first case (the stub's
    verdict) and the number of cases (the solution's success line)."""
    from attnbook.exercises.embeddings import cosine_cases

    cases = cosine_cases()
    assert len(cases) == 5
    assert cases[0].name == "square: a and b both (4, 4)"
    lengths = np.linalg.norm(cases[3].args[0], axis=1)
    assert lengths.min() <= 1e-6 * (1 + 1e-12)


# --- from the student reading s12a -------------------------------------------


def cos_abs_loop(a, b):
    """The sign dropped: |a_i . b_j| / (|a_i| |b_j|), in a loop, zero rows
    guarded."""
    out = np.zeros((len(a), len(b)))
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            nx, ny = np.sqrt(x @ x), np.sqrt(y @ y)
            if nx > 0 and ny > 0:
                out[i, j] = abs(x @ y) / (nx * ny)
    return out


def cos_clipped_einsum(a, b):
    """Clipped to [0, 1] "to keep it a similarity", in einsum."""
    na = np.sqrt(np.einsum("id,id->i", a, a))
    nb = np.sqrt(np.einsum("jd,jd->j", b, b))
    den = np.outer(na, nb)
    cos = np.divide(
        np.einsum("id,jd->ij", a, b),
        den,
        out=np.zeros_like(den),
        where=den > 0,
    )
    return np.clip(cos, 0.0, 1.0)


def cos_clipped_to_plus_minus_one(a, b):
    """Right: clipped to [-1, 1], against rounding only."""
    na = np.linalg.norm(a, axis=1, keepdims=True)
    nb = np.linalg.norm(b, axis=1, keepdims=True)
    a_hat = np.divide(a, na, out=np.zeros_like(a), where=na > 0)
    b_hat = np.divide(b, nb, out=np.zeros_like(b), where=nb > 0)
    return np.clip(a_hat @ b_hat.T, -1.0, 1.0)


def ppmi_tiny_constant(counts):
    """The log kept away from 0 by 1e-12 added to every count."""
    n = np.asarray(counts, float) + 1e-12
    total = n.sum()
    rows, cols = n.sum(axis=1), n.sum(axis=0)
    return np.maximum(0.0, np.log(n * total / np.outer(rows, cols)))


def ppmi_tiny_constant_probabilities(counts):
    """The same smoothing on the joint probabilities, 1e-10 added to each
    count, in float64."""
    n = np.asarray(counts, float)
    p = (n + 1e-10) / (n + 1e-10).sum()
    pw = p.sum(axis=1, keepdims=True)
    pc = p.sum(axis=0, keepdims=True)
    return np.clip(np.log(p / (pw * pc)), 0.0, None)


STUDENT_S12A_WRONG = {
    "check_cosine_similarity": [
        (cos_abs_loop, "absolute"),
        (cos_clipped_einsum, "clipped_at_zero"),
    ],
    "check_ppmi": [
        (ppmi_tiny_constant, "eps_smoothed"),
        (ppmi_tiny_constant_probabilities, "eps_smoothed"),
    ],
}
for _name, _wrong in STUDENT_S12A_WRONG.items():
    CATALOGUE[_name]["wrong"] += _wrong
CATALOGUE["check_cosine_similarity"]["right"] += [
    cos_clipped_to_plus_minus_one
]


@pytest.mark.parametrize(
    "check, wrong, key",
    [
        (check_cosine_similarity, wrong, key)
        for wrong, key in STUDENT_S12A_WRONG["check_cosine_similarity"]
    ]
    + [
        (check_ppmi, wrong, key)
        for wrong, key in STUDENT_S12A_WRONG["check_ppmi"]
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_a_dropped_sign_and_a_smoothed_count_are_named(check, wrong, key):
    with pytest.raises(ExerciseError) as info, np.errstate(all="ignore"):
        check(wrong)
    assert info.value.mistake == key, str(info.value)
    assert "compare your steps" not in str(info.value)
