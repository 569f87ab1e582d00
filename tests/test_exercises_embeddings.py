"""The chapter-1 checkers reject each classic mistake (written here independently) and pass the solutions."""
from __future__ import annotations

import math

import numpy as np
import pytest

from attnbook.exercises._framework import ExerciseError, NotAttemptedError
from attnbook.exercises.embeddings import COSINE_MISTAKES, PPMI_MISTAKES, check_cosine_similarity, check_ppmi

# --- cosine similarity: a reference written with loops, and wrong versions ---


def loop_cosine(a, b, zero_guard=True, transpose=False):
    a, b = np.asarray(a, float), np.asarray(b, float)
    out = np.zeros((len(a), len(b)))
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            nx, ny = math.sqrt(sum(t * t for t in x)), math.sqrt(sum(t * t for t in y))
            dot = float(np.dot(x, y))
            if nx == 0 or ny == 0:
                out[i, j] = 0.0 if zero_guard else math.nan
            else:
                out[i, j] = dot / (nx * ny)
    return out.T if transpose else out


def cos_raw_dot(a, b):
    return np.einsum("id,jd->ij", a, b)


def cos_only_a(a, b):
    return (a / np.sqrt((a ** 2).sum(axis=1))[:, None]) @ b.T


def cos_only_b(a, b):
    return np.einsum("id,jd->ij", a, b / np.sqrt((b ** 2).sum(axis=1, keepdims=True)))


def cos_columns(a, b):
    return (a / np.sqrt((a ** 2).sum(axis=0))) @ (b / np.sqrt((b ** 2).sum(axis=0))).T


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


@pytest.mark.parametrize("wrong, key", [
    (cos_raw_dot, "raw_dot"), (cos_only_a, "only_a"), (cos_only_b, "only_b"),
    (cos_columns, "wrong_axis"), (cos_no_keepdims, "no_keepdims"), (cos_squared, "squared_norms"),
    (cos_distance, "distance"), (cos_transposed, "transposed"), (cos_unguarded, "zero_row_nan"),
])
def test_cosine_checker_names_each_mistake(wrong, key):
    with pytest.raises(ExerciseError) as info:
        check_cosine_similarity(wrong)
    assert info.value.mistake == key, str(info.value)
    assert "Hint:" in str(info.value)


def test_every_cosine_mistake_is_tested():
    tested = {"raw_dot", "only_a", "only_b", "wrong_axis", "no_keepdims", "squared_norms", "distance",
              "transposed", "zero_row_nan"}
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
    assert info.value.mistake is None and "largest difference" in str(info.value)


# --- PPMI: a reference written with loops, and wrong versions ---------------


def loop_ppmi(counts, log=math.log, clip=True, guard=True, with_total=True, swap=False):
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


@pytest.mark.parametrize("wrong, key", [
    (ppmi_unclipped, "no_clip"), (ppmi_nan_rows, "zero_row_nan"), (ppmi_no_total, "missing_total"),
    (ppmi_log2, "log2"), (ppmi_swapped, "swapped_marginals"),
])
def test_ppmi_checker_names_each_mistake(wrong, key):
    with pytest.raises(ExerciseError) as info:
        check_ppmi(wrong)
    assert info.value.mistake == key, str(info.value)


def test_every_ppmi_mistake_is_tested():
    assert {m.key for m in PPMI_MISTAKES} == {"no_clip", "zero_row_nan", "missing_total", "log2",
                                              "swapped_marginals", "negative_kept", "all_zero"}


def test_ppmi_checker_passes_the_loop_reference(capsys):
    check_ppmi(loop_ppmi)
    assert "Correct: PPMI passes all" in capsys.readouterr().out


def test_ppmi_checker_stub():
    def stub(counts):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_ppmi(stub)


# --- the catalogue (run by tests/test_exercises_framework.py) ---------------------------------------------

def cosine_einsum_float32(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    na, nb = np.sqrt(np.einsum("id,id->i", a, a)), np.sqrt(np.einsum("jd,jd->j", b, b))
    dots = np.einsum("id,jd->ij", a, b)
    with np.errstate(all="ignore"):
        out = dots / np.outer(na, nb)
    return np.where(np.outer(na, nb) > 0, out, 0.0).astype(np.float32)   # float32 answer


def cosine_in_place(a, b):
    for x in (a, b):                                        # normalises the caller's arrays
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        np.divide(x, norms, out=x, where=norms > 0)
    return a @ b.T


def ppmi_vectorised(counts):
    total = counts.sum()
    with np.errstate(all="ignore"):
        pmi = np.log(counts * total / np.outer(counts.sum(axis=1), counts.sum(axis=0)))
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
        "wrong": [(cos_raw_dot, "raw_dot"), (cos_only_a, "only_a"), (cos_only_b, "only_b"),
                  (cos_columns, "wrong_axis"), (cos_no_keepdims, "no_keepdims"), (cos_squared, "squared_norms"),
                  (cos_distance, "distance"), (cos_transposed, "transposed"), (cos_unguarded, "zero_row_nan")],
    },
    "check_ppmi": {
        "right": [loop_ppmi, ppmi_vectorised, ppmi_torch],
        "wrong": [(ppmi_unclipped, "no_clip"), (ppmi_nan_rows, "zero_row_nan"), (ppmi_no_total, "missing_total"),
                  (ppmi_log2, "log2"), (ppmi_swapped, "swapped_marginals")],
    },
}


# --- from the expert reading of chapter 1 (checker-findings) -----------------------------------------------

def ppmi_negatives_kept(counts):
    """PMI, with the -inf of unseen pairs set to 0 but the negative values kept."""
    c = np.asarray(counts, float)
    with np.errstate(all="ignore"):
        pmi = np.log(c * c.sum() / np.outer(c.sum(1), c.sum(0)))
    return np.nan_to_num(pmi, nan=0.0, neginf=0.0)


def ppmi_of_conditional(counts):
    """log p(c | w) = log(N_wc / N_w), clipped: never positive, so all zeros."""
    c = np.asarray(counts, float)
    with np.errstate(all="ignore"):
        return np.maximum(np.nan_to_num(np.log(c / c.sum(1, keepdims=True)), nan=0.0, neginf=0.0), 0.0)


def ppmi_all_zeros(counts):
    return np.zeros_like(np.asarray(counts, float))


def ppmi_in_place(counts):
    """Right, and overwrites its input with the result."""
    row, col, total = counts.sum(1, keepdims=True), counts.sum(0, keepdims=True), counts.sum()
    seen = counts > 0
    counts *= total
    with np.errstate(all="ignore"):
        counts /= row * col
        np.log(counts, out=counts, where=seen)
    counts[~seen] = 0.0
    np.maximum(counts, 0.0, out=counts)
    return counts


CATALOGUE["check_ppmi"]["wrong"] += [(ppmi_negatives_kept, "negative_kept"), (ppmi_of_conditional, "all_zero"),
                                     (ppmi_all_zeros, "all_zero")]
CATALOGUE["check_ppmi"]["right"] += [ppmi_in_place]


def test_a_zero_output_is_not_named_as_the_missing_total():
    """Without N the ratio N_wc / (N_w N_c) exceeds 1 on weighted counts below 1: zeros are another slip."""
    with pytest.raises(ExerciseError) as err:
        check_ppmi(ppmi_all_zeros)
    assert err.value.mistake == "all_zero"


# --- from the second expert reading of chapter 1: zero rows on the other side ------------------------------

def cos_guard_a_only(a, b):
    """Guards a's zero rows only: b's zero row still gives 0/0."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    na = np.linalg.norm(a, axis=1, keepdims=True)
    a_hat = np.divide(a, na, out=np.zeros_like(a), where=na > 0)
    with np.errstate(all="ignore"):
        b_hat = b / np.linalg.norm(b, axis=1, keepdims=True)
    return a_hat @ b_hat.T


def ppmi_guard_rows_only(counts):
    """Sets a zero row to 0, but a context that never occurs (a zero column) still gives log(0/0) = NaN."""
    c = np.asarray(counts, float)
    with np.errstate(all="ignore"):
        pmi = np.log(c * c.sum() / (c.sum(1, keepdims=True) * c.sum(0, keepdims=True)))
    pmi[c.sum(1) == 0] = 0.0
    return np.maximum(pmi, 0.0)


def test_a_guard_on_one_side_only_is_rejected():
    for check, fn in ((check_cosine_similarity, cos_guard_a_only), (check_ppmi, ppmi_guard_rows_only)):
        with pytest.raises(ExerciseError):
            check(fn)
