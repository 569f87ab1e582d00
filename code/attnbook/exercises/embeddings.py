"""Checkers for chapter 1 (token embeddings): cosine similarity and PPMI."""
from __future__ import annotations

import numpy as np

from ..embeddings import cosine_similarity, ppmi
from ._framework import Case, Mistake, run_checks

# --- cosine similarity -------------------------------------------------------


def _rows_over(x, norms):
    with np.errstate(all="ignore"):
        return x / norms


def _norm(x, axis=-1, keepdims=True):
    return np.linalg.norm(x, axis=axis, keepdims=keepdims)


COSINE_MISTAKES = [
    Mistake("raw_dot", "the rows are never normalised: this is the raw dot product a_i . b_j",
            "divide every row of a and of b by its Euclidean length before multiplying",
            lambda a, b: a @ b.T),
    Mistake("only_a", "only the rows of a are normalised; the lengths of b's rows still scale the result",
            "normalise both sides: cos = a_i . b_j / (|a_i| |b_j|)",
            lambda a, b: _rows_over(a, _norm(a)) @ b.T),
    Mistake("only_b", "only the rows of b are normalised; the lengths of a's rows still scale the result",
            "normalise both sides: cos = a_i . b_j / (|a_i| |b_j|)",
            lambda a, b: a @ _rows_over(b, _norm(b)).T),
    Mistake("wrong_axis", "the norms are taken over the wrong axis (down each column, axis=0)",
            "each row is a vector: take its length with np.linalg.norm(x, axis=1, keepdims=True)",
            lambda a, b: _rows_over(a, _norm(a, axis=0)) @ _rows_over(b, _norm(b, axis=0)).T),
    Mistake("no_keepdims", "the row norms have shape (m,) instead of (m, 1), so they divide the "
            "columns, not the rows (numpy broadcasts them along the last axis)",
            "use keepdims=True (or norms[:, None]) so that each row is divided by its own length",
            lambda a, b: _rows_over(a, _norm(a, keepdims=False)) @ _rows_over(b, _norm(b, keepdims=False)).T),
    Mistake("squared_norms", "the dot product is divided by the squared lengths |a_i|^2 |b_j|^2",
            "divide by the lengths themselves, np.linalg.norm, not by the sums of squares",
            lambda a, b: (a @ b.T) / (np.sum(a * a, axis=1)[:, None] * np.sum(b * b, axis=1)[None, :])),
    Mistake("distance", "this is the cosine *distance* 1 - cos, not the similarity",
            "return the cosine itself: 1 for parallel rows, 0 for orthogonal ones, -1 for opposite ones",
            lambda a, b: 1 - cosine_similarity(a, b)),
    Mistake("transposed", "the result is (n, m): rows of b against rows of a",
            "entry [i, j] compares row i of a with row j of b, so the result is (m, n): a_hat @ b_hat.T",
            lambda a, b: cosine_similarity(b, a)),
    Mistake("zero_row_nan", "a zero row gives 0/0 = NaN; the exercise defines its cosine as 0",
            "guard the division, e.g. np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)",
            lambda a, b: _rows_over(a, _norm(a)) @ _rows_over(b, _norm(b)).T),
]


def cosine_cases() -> list[Case]:
    rng = np.random.default_rng(10)

    def rows(m, d):
        # rows of very different lengths, so normalising one side only is visible
        return rng.normal(size=(m, d)) * rng.uniform(0.2, 5.0, size=(m, 1))

    with_zero = rows(3, 4)
    with_zero[1] = 0.0
    a_same = rows(4, 6)
    b_zero = rows(2, 4)
    b_zero[0] = 0.0
    return [
        # the square case comes first: there a forgotten keepdims broadcasts instead of failing
        Case("square: a and b both (4, 4)", (rows(4, 4), rows(4, 4))),
        Case("a (3, 5) against b (4, 5)", (rows(3, 5), rows(4, 5))),
        Case("a single row each: a (1, 7), b (1, 7)", (rows(1, 7), rows(1, 7))),
        Case("a matrix against itself, (4, 6) (the diagonal is 1)", (a_same, a_same.copy())),
        # zero rows on both sides: a guard on a's norms alone still gives NaN for b's zero row
        Case("a (3, 4) whose second row is zero, against b (2, 4) whose first row is zero", (with_zero, b_zero)),
    ]


def check_cosine_similarity(fn) -> None:
    """Check ``fn(a, b)`` returns the ``(m, n)`` cosines between the rows of ``a (m, d)`` and ``b (n, d)``.

    A zero row has cosine 0 with every row.
    """
    run_checks("cosine similarity", fn, cosine_cases(), lambda a, b: cosine_similarity(a, b),
               COSINE_MISTAKES)


# --- positive pointwise mutual information ----------------------------------


def _expected(counts, row, col):
    return np.outer(row, col) / counts.sum()


def _pmi(counts, expected, log=np.log):
    with np.errstate(all="ignore"):
        return log(counts / expected)


PPMI_MISTAKES = [
    Mistake("no_clip", "negative PMI values are kept (and never-seen pairs give log 0 = -inf)",
            "PPMI is max(0, PMI): clip with np.maximum(pmi, 0), and give zero counts the value 0",
            lambda n: _pmi(n, _expected(n, n.sum(1), n.sum(0)))),
    Mistake("negative_kept", "negative PMI values are kept (only the never-seen pairs were set to 0)",
            "PPMI is max(0, PMI): clip every negative value to 0 with np.maximum(pmi, 0), not only the -inf "
            "of the zero counts",
            lambda n: np.nan_to_num(_pmi(n, _expected(n, n.sum(1), n.sum(0))), nan=0.0, neginf=0.0, posinf=0.0)),
    Mistake("all_zero", "every entry of your output is 0: the ratio inside your log never exceeds 1, so the clip "
            "at 0 removes everything. log p(c | w) = log(N_wc / N_w) is such a ratio: it is not PMI",
            "PMI compares p(w, c) with p(w) p(c): log(N_wc N / (N_w N_c)), the total N in the numerator; it is "
            "positive for pairs seen together more often than chance",
            lambda n: np.zeros(np.shape(n))),
    Mistake("zero_row_nan", "a word that never occurs (a zero row) gives 0/0 = NaN",
            "guard the division where the count is 0, e.g. np.divide(..., where=counts > 0), and set "
            "those entries to 0",
            lambda n: np.maximum(_pmi(n, _expected(n, n.sum(1), n.sum(0))), 0)),
    Mistake("missing_total", "the counts are not divided by the total N: the ratio is N_wc / (N_w N_c)",
            "p(w, c) p(w)^-1 p(c)^-1 = N_wc N / (N_w N_c): the total N appears once in the numerator",
            lambda n: np.nan_to_num(np.maximum(_pmi(n, np.outer(n.sum(1), n.sum(0))), 0))),
    Mistake("log2", "the logarithm is base 2; the chapter (and this exercise) uses the natural log",
            "use np.log; log2(x) = ln(x) / ln(2) differs by a factor 1.44",
            lambda n: np.nan_to_num(np.maximum(_pmi(n, _expected(n, n.sum(1), n.sum(0)), np.log2), 0))),
    Mistake("swapped_marginals", "the marginals are summed over the wrong axes: p(w) from the column "
            "sums and p(c) from the row sums",
            "p(w) is row w's sum (axis=1) and p(c) is column c's sum (axis=0), each divided by N",
            lambda n: np.nan_to_num(np.maximum(_pmi(n, _expected(n, n.sum(0), n.sum(1))), 0))),
]


def ppmi_cases() -> list[Case]:
    rng = np.random.default_rng(11)
    symmetric = rng.integers(0, 6, size=(4, 4)).astype(float)
    symmetric = symmetric + symmetric.T
    with_unused = rng.integers(0, 5, size=(5, 5)).astype(float)
    with_unused[2] = 0.0
    with_unused[:, 4] = 0.0
    return [
        Case("a symmetric (4, 4) count matrix with some zero counts", (symmetric,)),
        # weighted counts below 1: there the ratio N_wc / (N_w N_c) without the total exceeds 1 for some
        # pairs, so forgetting N gives nonzero values, not the zeros of every ratio that never exceeds 1
        Case("a (5, 5) matrix of weighted counts (fractions below 1, e.g. weighted by distance), not symmetric",
             (rng.integers(1, 9, size=(5, 5)).astype(float) / 100,)),
        Case("a rectangular (3, 6) matrix: 3 words by 6 contexts", (rng.integers(0, 7, size=(3, 6)).astype(float),)),
        # a zero column too: a guard on the row sums alone still gives 0/0 for a context that never occurs
        Case("a (5, 5) matrix whose word 2 never occurs (a zero row) and context 4 neither (a zero column)",
             (with_unused,)),
    ]


def check_ppmi(fn) -> None:
    """Check ``fn(counts)`` returns ``max(0, ln(p(w, c) / (p(w) p(c))))`` for a count matrix ``(V, V_c)``.

    Pairs with count 0 get 0.
    """
    run_checks("PPMI", fn, ppmi_cases(), ppmi, PPMI_MISTAKES)
