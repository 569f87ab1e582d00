"""Checkers for chapter 1 (token embeddings): cosine similarity, PPMI and the
backward pass of the lookup."""

from __future__ import annotations

from functools import partial

import numpy as np

from ..embeddings import cosine_similarity, embedding_grad, one_hot, ppmi
from ._framework import (
    Case,
    ExerciseError,
    Mistake,
    peak_memory_with_torch,
    run_checks,
    same,
)

# --- cosine similarity -------------------------------------------------------


def _rows_over(x, norms):
    with np.errstate(all="ignore"):
        return x / norms


def _norm(x, axis=-1, keepdims=True):
    return np.linalg.norm(x, axis=axis, keepdims=keepdims)


def _one_side_guarded_cosine(a, b, guarded, both_zero):
    """The cosines with NaN where the unguarded side's row is zero,
    ``both_zero`` where both rows are."""
    # (m, 1), (1, n)
    zero_a, zero_b = (_norm(a) == 0), (_norm(b) == 0).T
    out = np.where(
        zero_b if guarded == "a" else zero_a, np.nan, cosine_similarity(a, b)
    )
    return np.where(zero_a & zero_b, both_zero, out)


def _no_keepdims_one_side(a, b, side):
    """The cosines with ``keepdims`` forgotten on ``side``'s norms only."""
    a_hat = _rows_over(a, _norm(a, keepdims=side != "a"))
    b_hat = _rows_over(b, _norm(b, keepdims=side != "b"))
    return a_hat @ b_hat.T


def _guarded_rows(x, ord=None):
    """The rows of ``x`` divided by their norms (``ord`` as in np.linalg.norm),
    zero rows left zero."""
    norms = np.linalg.norm(x, ord=ord, axis=-1, keepdims=True)
    return np.divide(
        x, norms, out=np.zeros_like(x, dtype=float), where=norms > 0
    )


def _floored_cosine(a, b, eps):
    """The cosines with every row length clamped to at least ``eps``."""
    return (a / np.maximum(_norm(a), eps)) @ (b / np.maximum(_norm(b), eps)).T


def _eps_added_cosine(a, b, eps):
    """The cosines with ``eps`` added to every row length."""
    return (a / (_norm(a) + eps)) @ (b / (_norm(b) + eps)).T


COSINE_MISTAKES = [
    Mistake(
        "raw_dot",
        "the rows are never normalised: this is the raw dot product a_i . b_j",
        "divide every row of a and of b by its Euclidean length before "
        "multiplying",
        lambda a, b: a @ b.T,
    ),
    Mistake(
        "only_a",
        "only the rows of a are normalised; the lengths of b's rows still "
        "scale the result",
        "normalise both sides: cos = a_i . b_j / (|a_i| |b_j|)",
        lambda a, b: _rows_over(a, _norm(a)) @ b.T,
    ),
    Mistake(
        "only_b",
        "only the rows of b are normalised; the lengths of a's rows still "
        "scale the result",
        "normalise both sides: cos = a_i . b_j / (|a_i| |b_j|)",
        lambda a, b: a @ _rows_over(b, _norm(b)).T,
    ),
    Mistake(
        "wrong_axis",
        "the norms are taken over the wrong axis (down each column, axis=0)",
        "each row is a vector: take its length with np.linalg.norm(x, axis=1, "
        "keepdims=True)",
        lambda a, b: (
            _rows_over(a, _norm(a, axis=0)) @ _rows_over(b, _norm(b, axis=0)).T
        ),
    ),
    Mistake(
        "no_keepdims",
        "the row norms have shape (m,) instead of (m, 1), so they divide the "
        "columns, not the rows (numpy broadcasts them along the last axis)",
        "use keepdims=True (or norms[:, None]) so that each row is divided by "
        "its own length",
        lambda a, b: (
            _rows_over(a, _norm(a, keepdims=False))
            @ _rows_over(b, _norm(b, keepdims=False)).T
        ),
    ),
    # keepdims forgotten on one side only: on the square case the (m,)
    # norms broadcast along the last axis and divide that side's columns.
    # Dividing the transposed side, b.T (d, n) / (n, 1) norms, gives the
    # same numbers (and fails alike when d != n), so the diagnosis names
    # both causes
    *(
        Mistake(
            f"no_keepdims_{side}_only",
            f"{side}'s row norms divide its columns, not its rows: "
            f"either the row norms of {side} have shape ({dim},) instead of "
            f"({dim}, 1) (numpy broadcasts them along the last axis), or "
            f"you divided the transposed {side}, {side}.T of shape "
            f"(d, {dim}), by the ({dim}, 1) norms; {other}'s rows are "
            "normalised correctly",
            f"divide {side} itself, not {side}.T, by norms of shape "
            f"({dim}, 1): keepdims=True (or norms_{side}[:, None]), as you "
            f"did for {other}; transpose only after normalising",
            partial(_no_keepdims_one_side, side=side),
        )
        for side, other, dim in (("a", "b", "m"), ("b", "a", "n"))
    ),
    Mistake(
        "squared_norms",
        "the dot product is divided by the squared lengths |a_i|^2 |b_j|^2",
        "divide by the lengths themselves, np.linalg.norm, not by the sums of "
        "squares",
        lambda a, b: (
            (a @ b.T)
            / (np.sum(a * a, axis=1)[:, None] * np.sum(b * b, axis=1)[None, :])
        ),
    ),
    Mistake(
        "distance",
        "this is the cosine *distance* 1 - cos, not the similarity",
        "return the cosine itself: 1 for parallel rows, 0 for orthogonal "
        "ones, -1 for opposite ones",
        lambda a, b: 1 - cosine_similarity(a, b),
    ),
    Mistake(
        "transposed",
        "the result is (n, m): rows of b against rows of a",
        "entry [i, j] compares row i of a with row j of b, so the result is "
        "(m, n): a_hat @ b_hat.T",
        lambda a, b: cosine_similarity(b, a),
    ),
    Mistake(
        "zero_row_nan",
        "a zero row gives 0/0 = NaN; the exercise defines its cosine as 0",
        "guard the division, e.g. np.divide(x, norms, out=np.zeros_like(x), "
        "where=norms > 0)",
        lambda a, b: _rows_over(a, _norm(a)) @ _rows_over(b, _norm(b)).T,
    ),
    # a guard on one side only, each in two forms that differ where two zero
    # rows meet: normalised matrices give NaN there (0 times NaN), a loop that
    # tests the guarded side's norm first gives 0
    *(
        Mistake(
            f"zero_guard_{side}_only",
            f"only {side}'s zero rows are guarded: a zero row of {other} "
            "still gives 0/0 = NaN, "
            + (
                "down its whole column"
                if side == "a"
                else "along its whole row"
            ),
            f"guard the division on both sides: {other}'s rows are normalised "
            f"like {side}'s, np.divide({other}, "
            f"norms_{other}, out=np.zeros_like({other}), where=norms_{other} "
            "> 0)",
            partial(
                _one_side_guarded_cosine, guarded=side, both_zero=both_zero
            ),
        )
        for side, other in (("a", "b"), ("b", "a"))
        for both_zero in (np.nan, 0.0)
    ),
    Mistake(
        "zero_row_one",
        "a zero row is given cosine 1 with every row (as np.nan_to_num(cos, "
        "nan=1.0) does); "
        "the exercise defines its cosine as 0: a zero vector has no direction "
        "to share",
        "guard the division so that a zero row stays zero, e.g. np.divide(x, "
        "norms, out=np.zeros_like(x), "
        "where=norms > 0), or replace the NaN by 0",
        lambda a, b: np.where(
            (_norm(a) > 0) & (_norm(b) > 0).T, cosine_similarity(a, b), 1.0
        ),
    ),
    Mistake(
        "matrix_norms",
        "the dot products are divided by the norms of the whole matrices "
        "(np.linalg.norm(a) "
        "with no axis is the Frobenius norm of all of a), not by the length "
        "of each row",
        "each row has its own length: np.linalg.norm(a, axis=1, "
        "keepdims=True), one per row of a, and "
        "the same for b",
        lambda a, b: (a @ b.T) / (np.linalg.norm(a) * np.linalg.norm(b)),
    ),
    Mistake(
        "l1_norms",
        "the rows are divided by their L1 norms (sums of absolute values), "
        "not by their "
        "Euclidean lengths",
        "the cosine divides by the Euclidean length sqrt(sum_k x_k^2): "
        "np.linalg.norm(x, axis=1, "
        "keepdims=True) with its default ord",
        lambda a, b: _guarded_rows(a, ord=1) @ _guarded_rows(b, ord=1).T,
    ),
    # an eps that keeps the norms away from zero, too large beside the short
    # rows of the self-comparison case (1e-6 and 1e-4 long): one Mistake per
    # common eps, as a floor or added
    *(
        Mistake(
            "norm_floor",
            "the row lengths are clamped to a floor, np.maximum(norm, eps) "
            "with an eps too large: a nonzero row shorter than eps is divided "
            "by eps instead of its length, so its cosines shrink towards 0 "
            "(a row 1e-6 long against itself gets (1e-6 / eps)^2, not 1)",
            "a cosine does not depend on the lengths of the rows, however "
            "short; guard only the exact zeros: np.divide(x, norms, "
            "out=np.zeros_like(x), where=norms > 0)",
            partial(_floored_cosine, eps=eps),
        )
        for eps in (1e-2, 1e-3, 1e-4, 1e-5)
    ),
    *(
        Mistake(
            "eps_added",
            "an eps is added to the row lengths, norm + eps: beside a row "
            "only 1e-6 long it is not small, and that row's cosines shrink "
            "by the factor norm / (norm + eps)",
            "a cosine does not depend on the lengths of the rows, however "
            "short; guard only the exact zeros instead of adding eps: "
            "np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)",
            partial(_eps_added_cosine, eps=eps),
        )
        for eps in (1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10)
    ),
    Mistake(
        "absolute",
        "negative cosines are made positive (np.abs(cos)): two opposite "
        "rows get +1, as if they pointed the same way",
        "a cosine lies in [-1, 1] and keeps its sign: -1 for opposite rows; "
        "return a_hat @ b_hat.T as it is, with no np.abs",
        lambda a, b: np.abs(cosine_similarity(a, b)),
    ),
    Mistake(
        "clipped_at_zero",
        "negative cosines are set to 0 (np.clip(cos, 0, 1) or "
        "np.maximum(cos, 0)): rows more than 90 degrees apart get 0, as if "
        "they were orthogonal",
        "a cosine lies in [-1, 1] and keeps its sign; return a_hat @ b_hat.T "
        "as it is (clipping to [-1, 1], against rounding, is harmless; "
        "clipping at 0 is not)",
        lambda a, b: np.maximum(cosine_similarity(a, b), 0.0),
    ),
    Mistake(
        "centred",
        "each row's mean is subtracted before normalising: that is the "
        "Pearson correlation of "
        "the rows, not their cosine",
        "do not centre the rows: the cosine compares the vectors as they are, "
        "a_i . b_j / (|a_i| |b_j|)",
        lambda a, b: cosine_similarity(
            a - a.mean(axis=1, keepdims=True),
            b - b.mean(axis=1, keepdims=True),
        ),
    ),
]


def cosine_cases() -> list[Case]:
    rng = np.random.default_rng(10)

    def rows(m, d):
        # rows of very different lengths, so normalising one side only is
        # visible
        return rng.normal(size=(m, d)) * rng.uniform(0.2, 5.0, size=(m, 1))

    with_zero = rows(3, 4)
    with_zero[1] = 0.0
    a_same = rows(4, 6)
    # two rows far shorter than the others (a guard that floors the norms at
    # an eps, np.maximum(norm, 1e-3), shrinks their cosines); a cosine does
    # not depend on length, so the diagonal is still 1
    for i, length in ((1, 1e-6), (3, 1e-4)):
        a_same[i] *= length / np.linalg.norm(a_same[i])
    b_zero = rows(2, 4)
    b_zero[0] = 0.0
    return [
        # the square case comes first: there a forgotten keepdims broadcasts
        # instead of failing
        Case("square: a and b both (4, 4)", (rows(4, 4), rows(4, 4))),
        Case("a (3, 5) against b (4, 5)", (rows(3, 5), rows(4, 5))),
        Case(
            "a single row each: a (1, 7), b (1, 7)", (rows(1, 7), rows(1, 7))
        ),
        Case(
            "a matrix against itself, (4, 6), two of its rows only 1e-6 and "
            "1e-4 long (the diagonal is 1)",
            (a_same, a_same.copy()),
        ),
        # zero rows on both sides: a guard on a's norms alone still gives NaN
        # for b's zero row
        Case(
            "a (3, 4) whose second row is zero, against b (2, 4) whose first "
            "row is zero",
            (with_zero, b_zero),
        ),
    ]


def check_cosine_similarity(fn) -> None:
    """Check ``fn(a, b)`` returns the ``(m, n)`` cosines between the rows of
    ``a (m, d)`` and ``b (n, d)``.

    A zero row has cosine 0 with every row.
    """
    run_checks(
        "cosine similarity",
        fn,
        cosine_cases(),
        lambda a, b: cosine_similarity(a, b),
        COSINE_MISTAKES,
    )


# --- positive pointwise mutual information ----------------------------------


def _expected(counts, row, col):
    return np.outer(row, col) / counts.sum()


def _pmi(counts, expected, log=np.log):
    with np.errstate(all="ignore"):
        return log(counts / expected)


PPMI_MISTAKES = [
    Mistake(
        "clipped_above",
        "the values were clipped to [0, 1]: PPMI has no upper bound (the "
        "normalised PMI, NPMI, lies in [-1, 1], but this is not it)",
        "PPMI is max(0, PMI), clipped below only: np.maximum(pmi, 0), not "
        "np.clip(pmi, 0, 1); a pair seen together e times more often than "
        "chance has PPMI 1, and more often, more",
        lambda n: np.minimum(ppmi(n), 1.0),
    ),
    Mistake(
        "no_clip",
        "negative PMI values are kept (and never-seen pairs give log 0 = "
        "-inf)",
        "PPMI is max(0, PMI): clip with np.maximum(pmi, 0), and give zero "
        "counts the value 0",
        lambda n: _pmi(n, _expected(n, n.sum(1), n.sum(0))),
    ),
    Mistake(
        "negative_kept",
        "negative PMI values are kept (only the never-seen pairs were set to "
        "0)",
        "PPMI is max(0, PMI): clip every negative value to 0 with "
        "np.maximum(pmi, 0), not only the -inf "
        "of the zero counts",
        lambda n: np.nan_to_num(
            _pmi(n, _expected(n, n.sum(1), n.sum(0))),
            nan=0.0,
            neginf=0.0,
            posinf=0.0,
        ),
    ),
    Mistake(
        "all_zero",
        "every entry of your output is 0: whatever you clip at 0 never "
        "exceeds 0 here. Either the "
        "ratio inside your log never exceeds 1 (log p(c | w) = log(N_wc / "
        "N_w) is such a ratio: it is not "
        "PMI), or you subtracted a shift such as log k (the shifted PPMI, "
        "SPPMI, of Levy & Goldberg 2014) "
        "larger than every PMI of these small matrices",
        "PMI compares p(w, c) with p(w) p(c): log(N_wc N / (N_w N_c)), the "
        "total N in the numerator; it is "
        "positive for pairs seen together more often than chance. The "
        "exercise asks for max(0, PMI), unshifted",
        lambda n: np.zeros(np.shape(n)),
    ),
    # a total N counted half gives the same numbers as a shift by log 2:
    # log(N_wc (N / 2) / (N_w N_c)) = PMI - log 2
    Mistake(
        "shifted",
        "your PMI is shifted down by log 2 before the clip, for one of two "
        "causes: either you subtracted log k with k = 2 (max(0, PMI - log "
        "k) is the shifted PPMI, SPPMI, of Levy & Goldberg 2014), or your "
        "total N is half what it should be (each pair of a symmetric "
        "matrix counted once instead of twice, or N / 2), since "
        "log(N_wc (N / 2) / (N_w N_c)) = PMI - log 2",
        "the exercise asks for the unshifted PPMI, max(0, PMI), with N the "
        "sum of every entry of the matrix, counts.sum(): leave out any "
        "- log k, and do not halve the total",
        lambda n: np.maximum(
            np.nan_to_num(
                _pmi(n, _expected(n, n.sum(1), n.sum(0))),
                nan=0.0,
                neginf=0.0,
                posinf=0.0,
            )
            - np.log(2),
            0.0,
        ),
    ),
    Mistake(
        "zero_row_nan",
        "a word that never occurs (a zero row) gives 0/0 = NaN",
        "guard the division where the count is 0, e.g. np.divide(..., "
        "where=counts > 0), and set "
        "those entries to 0",
        lambda n: np.maximum(_pmi(n, _expected(n, n.sum(1), n.sum(0))), 0),
    ),
    Mistake(
        "missing_total",
        "the counts are not divided by the total N: the ratio is N_wc / (N_w "
        "N_c)",
        "p(w, c) p(w)^-1 p(c)^-1 = N_wc N / (N_w N_c): the total N appears "
        "once in the numerator",
        lambda n: np.nan_to_num(
            np.maximum(_pmi(n, np.outer(n.sum(1), n.sum(0))), 0)
        ),
    ),
    Mistake(
        "log2",
        "the logarithm is base 2; the chapter (and this exercise) uses the "
        "natural log",
        "use np.log; log2(x) = ln(x) / ln(2) differs by a factor 1.44",
        lambda n: np.nan_to_num(
            np.maximum(_pmi(n, _expected(n, n.sum(1), n.sum(0)), np.log2), 0)
        ),
    ),
    Mistake(
        "swapped_marginals",
        "the marginals are summed over the wrong axes: p(w) from the column "
        "sums and p(c) from the row sums",
        "p(w) is row w's sum (axis=1) and p(c) is column c's sum (axis=0), "
        "each divided by N",
        lambda n: np.nan_to_num(
            np.maximum(_pmi(n, _expected(n, n.sum(0), n.sum(1))), 0)
        ),
    ),
    Mistake(
        "rows_guarded_only",
        "a word that never occurs (a zero row) is set to 0, but a context "
        "that never "
        "occurs (a zero column) still gives 0/0 = NaN",
        "guard by the count of each pair, not by the row sums: every pair "
        "with N_wc = 0 gets 0, which "
        "covers zero rows and zero columns alike (np.where(counts > 0, ..., "
        "0.0))",
        lambda n: _one_side_guarded(n, axis=1),
    ),
    Mistake(
        "columns_guarded_only",
        "a context that never occurs (a zero column) is set to 0, but a word "
        "that "
        "never occurs (a zero row) still gives 0/0 = NaN",
        "guard by the count of each pair, not by the column sums: every pair "
        "with N_wc = 0 gets 0, which "
        "covers zero rows and zero columns alike (np.where(counts > 0, ..., "
        "0.0))",
        lambda n: _one_side_guarded(n, axis=0),
    ),
    Mistake(
        "row_sums_twice",
        "row sums for both marginals: p(c) is taken from the row sums too "
        "(row c's sum instead of column c's), which is right only for a "
        "symmetric matrix",
        "p(c) comes from the column sums, counts.sum(axis=0); they equal the "
        "row sums only for a symmetric "
        "matrix (a window's word-word counts), not for a general "
        "word-by-context matrix",
        lambda n: _positive_where_seen(
            n, _pmi(n, _expected(n, n.sum(1), _same_side(n, axis=1)))
        ),
    ),
    Mistake(
        "column_sums_twice",
        "p(w) is taken from the column sums too (column w's sum instead of "
        "row "
        "w's), which is right only for a symmetric matrix",
        "p(w) comes from the row sums, counts.sum(axis=1); they equal the "
        "column sums only for a symmetric "
        "matrix (a window's word-word counts), not for a general "
        "word-by-context matrix",
        lambda n: _positive_where_seen(
            n, _pmi(n, _expected(n, _same_side(n, axis=0), n.sum(0)))
        ),
    ),
    Mistake(
        "absolute",
        "negative PMI values are made positive (|PMI|) instead of being set "
        "to 0",
        "PPMI keeps only the positive part, max(0, PMI): a pair seen less "
        "often than chance gets 0, not "
        "its distance below chance",
        lambda n: _positive_where_seen(
            n, np.abs(_pmi(n, _expected(n, n.sum(1), n.sum(0))))
        ),
    ),
    Mistake(
        "context_smoothing",
        "the context probabilities are smoothed, p(c) proportional to "
        "N_c^0.75 (the "
        "context-distribution smoothing of word2vec and Levy et al. 2015): a "
        "useful variant, but not the "
        "PPMI this exercise defines",
        "use the plain marginals p(w) = N_w / N and p(c) = N_c / N, with no "
        "exponent",
        lambda n: _positive_where_seen(
            n,
            _pmi(
                n / n.sum(), np.outer(n.sum(1) / n.sum(), _smoothed(n.sum(0)))
            ),
        ),
    ),
    Mistake(
        "add_one",
        "1 is added to every count before the PMI (add-one smoothing): that "
        "changes every value, "
        "and pairs never seen get a PPMI of their own",
        "use the counts as they are; a pair that never occurs (N_wc = 0) gets "
        "0",
        lambda n: ppmi(n + 1.0),
    ),
    # a small constant added to every count to keep the log away from 0:
    # harmless where a word and its context occur, but a word that never
    # occurs then has eps for every count, and its row's PMI is
    # log(N / (V_c N_c)), or log(N / (V V_c eps)) where a context never
    # occurs either. One Mistake per common eps
    *(
        Mistake(
            "eps_smoothed",
            "a small eps is added to every count (to avoid log 0): for a "
            "word that never occurs (a zero row) the eps's are all its "
            "counts, so its PMI with a context c becomes log(N / (V_c "
            "N_c)), positive for every context rarer than average, and "
            "where it meets a context that never occurs, log(N / (V V_c "
            "eps)), huge; the answer is 0 for both (a context that never "
            "occurs likewise)",
            "use the counts as they are and guard only the zero counts: "
            "compute the log where counts > 0 (np.divide or np.log with "
            "where=counts > 0) and give every other pair 0",
            partial(lambda n, eps: ppmi(n + eps), eps=eps),
        )
        for eps in (1e-12, 1e-10, 1e-9, 1e-8, 1e-6)
    ),
]


def _positive_where_seen(counts, values):
    """``max(0, values)`` where the count is positive, 0 where it is 0 (NaN and
    inf never reach the output)."""
    with np.errstate(invalid="ignore"):
        return np.where(
            counts > 0,
            np.maximum(
                np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0), 0.0
            ),
            0.0,
        )


def _same_side(counts, axis):
    """The sums along ``axis`` used for BOTH marginals where the matrix is
    square (the mistake); on a rectangular matrix, where they could not be,
    the right sums for the other marginal, as an answer that writes the
    mistake only for the square (possibly symmetric) case gives."""
    if counts.shape[0] == counts.shape[1]:
        return counts.sum(axis)
    return counts.sum(1 - axis)


def _smoothed(context_counts, alpha=0.75):
    """Context probabilities from counts raised to ``alpha``, normalised to sum
    to 1."""
    weights = context_counts**alpha
    return weights / weights.sum()


def _one_side_guarded(counts, axis):
    """PPMI with no guard but for the zero rows (``axis=1``) or the zero
    columns (``axis=0``), set to 0."""
    out = np.maximum(
        _pmi(counts, _expected(counts, counts.sum(1), counts.sum(0))), 0
    )
    unused = counts.sum(axis=axis) == 0
    if axis == 1:
        out[unused] = 0.0
    else:
        out[:, unused] = 0.0
    return out


def ppmi_cases() -> list[Case]:
    rng = np.random.default_rng(11)
    symmetric = rng.integers(0, 6, size=(4, 4)).astype(float)
    symmetric = symmetric + symmetric.T
    with_unused = rng.integers(0, 5, size=(5, 5)).astype(float)
    with_unused[2] = 0.0
    with_unused[:, 4] = 0.0
    return [
        Case(
            "a symmetric (4, 4) count matrix with some zero counts",
            (symmetric,),
        ),
        # weighted counts below 1: there the ratio N_wc / (N_w N_c) without the
        # total exceeds 1 for some pairs, so forgetting N gives nonzero values,
        # not the zeros of every ratio that never exceeds 1
        Case(
            "a (5, 5) matrix of weighted counts (fractions below 1, e.g. "
            "weighted by distance), not symmetric",
            (rng.integers(1, 9, size=(5, 5)).astype(float) / 100,),
        ),
        Case(
            "a rectangular (3, 6) matrix: 3 words by 6 contexts",
            (rng.integers(0, 7, size=(3, 6)).astype(float),),
        ),
        # a zero column too: a guard on the row sums alone still gives 0/0 for
        # a context that never occurs
        Case(
            "a (5, 5) matrix whose word 2 never occurs (a zero row) and "
            "context 4 neither (a zero column)",
            (with_unused,),
        ),
        # strongly associated pairs (a heavy diagonal): six PPMI values
        # above 1, as in the chapter's own matrix (PPMI[bank, fee] = 1.35),
        # so an answer clipped to [0, 1] is caught (reader ch01-w)
        Case(
            "a (6, 6) matrix of strongly associated pairs (a heavy "
            "diagonal), one pair never seen: PPMI values above 1",
            (_associated_counts(),),
        ),
    ]


def _associated_counts() -> np.ndarray:
    counts = np.diag([5.0, 4, 6, 3, 2, 7]) + 1
    counts[0, 5] = 0.0
    return counts


def check_ppmi(fn) -> None:
    """Check ``fn(counts)`` returns ``max(0, ln(p(w, c) / (p(w) p(c))))`` for a
    count matrix ``(V, V_c)``.

    Pairs with count 0 get 0.
    """
    run_checks("PPMI", fn, ppmi_cases(), ppmi, PPMI_MISTAKES)


# --- the backward pass of the lookup ----------------------------------------


def _flat(ids, grad_out):
    """ids as (N,) and grad_out as (N, d): the positions of every sentence in
    one list."""
    ids, grad_out = np.asarray(ids), np.asarray(grad_out, dtype=float)
    return ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1])


def _last_write_wins(ids, grad_out, vocab_size):
    """Each row set to the gradient of the last position that holds its
    token, as ``grad[ids] += g`` does: numpy's fancy-index assignment writes
    each repeated index once; its documentation does not promise which value
    wins, and in practice the last does."""
    flat_ids, g = _flat(ids, grad_out)
    grad = np.zeros((vocab_size, g.shape[1]))
    for v, row in zip(flat_ids, g):
        grad[v] = row
    return grad


def _first_only(ids, grad_out, vocab_size):
    """Each row set to the gradient of the first position that holds its
    token."""
    flat_ids, g = _flat(ids, grad_out)
    grad = np.zeros((vocab_size, g.shape[1]))
    tokens, first = np.unique(flat_ids, return_index=True)
    grad[tokens] = g[first]
    return grad


def _mean_of_repeats(ids, grad_out, vocab_size):
    flat_ids, g = _flat(ids, grad_out)
    total = embedding_grad(flat_ids, g, vocab_size)
    count = np.bincount(flat_ids, minlength=vocab_size)[:, None]
    return total / np.maximum(count, 1)


def _per_sentence(ids, grad_out, vocab_size):
    """H^T G for each sentence of the batch, not summed over the batch: shape
    ``ids.shape[:-1] + (V, d)`` (for one sentence, the right answer)."""
    h = one_hot(ids, vocab_size)  # (..., n, V)
    return np.swapaxes(h, -1, -2) @ np.asarray(grad_out, dtype=float)


def _loop_over_first_axis(ids, grad_out, vocab_size):
    """``for i, v in enumerate(ids): grad[v] += g[i]`` on a batch: ``v`` is a
    whole sentence, so each step is a fancy-index ``+=`` (repeats within a
    sentence keep the last), summed over the sentences."""
    ids, grad_out = np.asarray(ids), np.asarray(grad_out, dtype=float)
    grad = np.zeros((vocab_size, grad_out.shape[-1]))
    for v, g in zip(ids, grad_out):
        grad[v] += g
    return grad


def _rows_up_to_largest_id(ids, grad_out, vocab_size):
    flat_ids, g = _flat(ids, grad_out)
    return embedding_grad(flat_ids, g, vocab_size)[: flat_ids.max() + 1]


def _rows_one_short(ids, grad_out, vocab_size):
    flat_ids, g = _flat(ids, grad_out)
    return embedding_grad(flat_ids, g, vocab_size)[: vocab_size - 1]


def _raises(ids, grad_out, vocab_size):
    """A mistake recognised by the error it raises, not by an output."""
    raise RuntimeError("recognised by its exception")


def _too_deep(err: Exception) -> bool:
    return isinstance(err, ValueError) and "object too deep" in str(err)


def _empty_reshape(err: Exception) -> bool:
    """numpy's and torch's refusal to infer a -1 axis from 0 entries."""
    text = str(err)
    return (
        "cannot reshape array of size 0" in text and "newaxis" in text
    ) or ("cannot reshape tensor of 0 elements" in text)


EMBEDDING_GRAD_MISTAKES = [
    Mistake(
        "fancy_index_add",
        "a token that occurs more than once gets the gradient of only one of "
        "its positions (in practice the last): `grad[ids] += g` is a "
        "fancy-index "
        "assignment, which reads grad[ids], adds g, and writes each repeated "
        "row once, so the repeats overwrite each other instead of adding up",
        "you need an unbuffered add, in which every occurrence of a row "
        "adds: numpy's np.add.at does that (read its documentation), as "
        "does np.bincount with weights, one column at a time, or torch's "
        "index_add_; flatten the batch axes first; not the product H^T G, "
        "whose one-hot H the exercise rules out",
        _last_write_wins,
    ),
    Mistake(
        "distinct_once",
        "each distinct token gets the gradient of its first position only: "
        "the positions that repeat a token are dropped",
        "row v of the gradient is the SUM over every position i with "
        "t_i = v of G[i] (equation ch1-embedding-grad): a token that occurs "
        "twice collects two contributions",
        _first_only,
    ),
    Mistake(
        "mean_of_repeats",
        "the gradients of a repeated token are averaged, not summed",
        "the loss depends on the row once per occurrence, so the "
        "contributions add: sum them, do not divide by the count",
        _mean_of_repeats,
    ),
    Mistake(
        "negated",
        "the sign is flipped: this is the step of gradient descent, -dL/dE, "
        "not the gradient",
        "return the gradient itself (the value of H^T G, computed without "
        "H); the optimiser subtracts it (times the learning rate)",
        lambda ids, grad_out, vocab_size: (
            -embedding_grad(ids, grad_out, vocab_size)
        ),
    ),
    Mistake(
        "transposed",
        "the result is (d, V), G^T H, the transpose of the gradient",
        "the gradient has the shape of the table E, (V, d): H^T G, with H "
        "the (N, V) one-hot rows and G the (N, d) output gradients",
        lambda ids, grad_out, vocab_size: (
            embedding_grad(ids, grad_out, vocab_size).T
        ),
    ),
    Mistake(
        "per_sentence",
        "the gradient is computed for each sentence of the batch separately "
        "and never summed over the batch: the result has a (V, d) block per "
        "sentence",
        "the table is shared by every sentence, so its gradient sums over "
        "every position of every sentence: flatten ids to (N,) and grad_out "
        "to (N, d) first (ids.reshape(-1), grad_out.reshape(-1, d)), or sum "
        "the blocks over the batch axes",
        _per_sentence,
    ),
    Mistake(
        "loop_over_first_axis",
        "on a batch, the loop `for i, v in enumerate(ids)` runs over the "
        "sentences, not the tokens: each `v` is a whole sentence of ids, so "
        "`grad[v] += g[i]` is a fancy-index assignment that keeps only the "
        "last of the repeats within a sentence",
        "flatten the batch axes first, ids.reshape(-1) and grad_out.reshape("
        "-1, d), so that the loop runs over single tokens (or use "
        "np.add.at, which takes ids of any shape)",
        _loop_over_first_axis,
    ),
    # before rows_up_to_largest_id: on the first two cases the largest id is
    # vocab_size - 2, so the two give the same rows there, and the third case
    # (every id present) tells them apart
    Mistake(
        "rows_one_short",
        "the result has vocab_size - 1 rows: an off-by-one in the "
        "allocation, such as np.zeros((vocab_size - 1, d))",
        "the gradient has one row per entry of the vocabulary, ids 0 to "
        "vocab_size - 1: np.zeros((vocab_size, d))",
        _rows_one_short,
    ),
    Mistake(
        "rows_up_to_largest_id",
        "the result has ids.max() + 1 rows, not vocab_size: the rows of "
        "tokens beyond the largest id in the batch are missing",
        "the gradient has one row per entry of the vocabulary, (vocab_size, "
        "d), and a row whose token is absent from the batch is 0",
        _rows_up_to_largest_id,
    ),
    Mistake(
        "not_flattened",
        "np.bincount (like a one-dimensional loop) takes a 1-D array of ids; "
        "on a batch of ids of shape (B, n) it fails",
        "flatten the batch axes first: ids.reshape(-1) and grad_out.reshape("
        "-1, d); the table is shared, so every position of every sentence "
        "adds into it",
        _raises,
        raises=_too_deep,
    ),
    Mistake(
        "empty_reshape",
        "with no tokens, grad_out.reshape(N, -1) (N = ids.size = 0) cannot "
        "infer its -1 axis: any width times 0 rows holds 0 entries",
        "let the -1 stand for the axis whose size is unknown, and give the "
        "width, which never is: grad_out.reshape(-1, grad_out.shape[-1]); "
        "with no tokens the gradient is all zeros",
        _raises,
        raises=_empty_reshape,
    ),
]


def embedding_grad_cases() -> list[Case]:
    rng = np.random.default_rng(12)

    def grads(shape, d, dtype=np.float64):
        return rng.normal(size=(*shape, d)).astype(dtype)

    # the largest id of the vocabulary is absent from each of the first
    # cases, and every case but the single token repeats tokens
    return [
        Case(
            "one sentence: ids (7,) = [2, 0, 2, 4, 2, 1, 0] (token 2 three "
            "times, 0 twice; 3 and 5 absent), V = 6, d = 3",
            (np.array([2, 0, 2, 4, 2, 1, 0]), grads((7,), 3), 6),
        ),
        Case(
            "a batch: ids (2, 5), V = 9, d = 4, tokens repeated within and "
            "across the sentences",
            (
                np.array([[3, 1, 3, 0, 7], [1, 1, 5, 3, 2]]),
                grads((2, 5), 4),
                9,
            ),
        ),
        Case(
            "a batch of int32 ids (3, 4) with float32 grad_out, V = 5, d = 2",
            (
                np.array(
                    [[0, 2, 2, 1], [4, 0, 2, 4], [1, 1, 1, 0]], dtype=np.int32
                ),
                grads((3, 4), 2, np.float32),
                5,
            ),
        ),
        Case(
            "a batch of batches: ids (2, 2, 3), V = 4, d = 3",
            (
                np.array([[[0, 1, 0], [2, 0, 1]], [[1, 1, 2], [0, 2, 2]]]),
                grads((2, 2, 3), 3),
                4,
            ),
        ),
        Case(
            "a single token: ids (1,) = [3], V = 4, d = 2",
            (np.array([3]), grads((1,), 2), 4),
        ),
        Case(
            "no tokens at all: ids (0,), grad_out (0, 3), V = 4 (the "
            "gradient is all zeros)",
            (np.zeros(0, dtype=np.int64), grads((0,), 3), 4),
        ),
    ]


# The memory case: the one-hot matrix H of its ids, (N, V), is far larger
# than the answer, (V, d): 2,000 x 20,000 entries (320 MB in float64, 40 MB
# even as booleans) against 20,000 x 4 (640 kB). An answer that never builds
# H peaks at a few MB; the threshold is half of the boolean H.
MEMORY_VOCAB, MEMORY_IDS_SHAPE, MEMORY_WIDTH = 20_000, (4, 500), 4
MEMORY_LIMIT = MEMORY_VOCAB * int(np.prod(MEMORY_IDS_SHAPE)) // 2

ONE_HOT_MISTAKE = Mistake(
    "one_hot_matrix",
    "the values are right, but your function builds the one-hot matrix H "
    "(one row of vocab_size entries per token): the product H^T G of the "
    "chapter's check, which is what the lookup exists to avoid",
    "add each row of grad_out into the row of the gradient that its token "
    "selects, without H: an unbuffered add, such as numpy's np.add.at "
    "(so that repeated tokens add up), np.bincount with weights per "
    "column, or torch's index_add_",
    lambda ids, grad_out, vocab_size: embedding_grad(
        ids, grad_out, vocab_size
    ),
)


# the mistakes the memory case names (the values cases never see them)
EMBEDDING_GRAD_COST_MISTAKES = [ONE_HOT_MISTAKE]


def _memory_case() -> Case:
    rng = np.random.default_rng(13)
    ids = rng.integers(0, MEMORY_VOCAB, size=MEMORY_IDS_SHAPE)
    grad_out = rng.normal(size=(*MEMORY_IDS_SHAPE, MEMORY_WIDTH))
    n_ids = int(np.prod(MEMORY_IDS_SHAPE))
    return Case(
        f"a batch of {n_ids:,} ids {MEMORY_IDS_SHAPE}, V = "
        f"{MEMORY_VOCAB:,}, d = {MEMORY_WIDTH} (memory: the one-hot H "
        f"would hold {n_ids * MEMORY_VOCAB:,} entries, the answer "
        f"{MEMORY_VOCAB * MEMORY_WIDTH:,})",
        (ids, grad_out, MEMORY_VOCAB),
    )


def _check_embedding_grad_memory(fn) -> None:
    """Reject an answer whose peak memory on :func:`_memory_case` is that of
    the one-hot matrix; check its values there too."""
    from ..bench import format_bytes

    __tracebackhide__ = True
    case = _memory_case()
    try:
        with np.errstate(all="ignore"):
            # numpy's arrays, and torch's allocations whatever the answer
            # returns
            out, peak = peak_memory_with_torch(fn, *case.args)
    except MemoryError:
        # only H can exhaust the memory here (the answer is 640 kB)
        peak = None
    if peak is None or peak >= MEMORY_LIMIT:
        measured = (
            "ran out of memory"
            if peak is None
            else f"peaked at {format_bytes(peak)}"
        )
        raise ExerciseError(
            "embedding gradient",
            case.name,
            f"your function {measured}, against "
            f"{format_bytes(MEMORY_VOCAB * MEMORY_WIDTH * 8)} for the answer",
            mistake=ONE_HOT_MISTAKE,
        )
    expected = embedding_grad(*case.args)
    if not same(out, expected):
        raise ExerciseError(
            "embedding gradient",
            case.name,
            "values differ from the reference on a large vocabulary",
            hint="row v is the sum of grad_out over the positions that hold "
            "v; every other row is 0",
        )


def check_embedding_grad(fn) -> None:
    """Check ``fn(ids, grad_out, vocab_size)`` returns the gradient of the loss
    with respect to the embedding table, ``(vocab_size, d)``, for ``ids`` of
    any shape ``S`` and ``grad_out`` of shape ``S + (d,)``: row ``v`` is the
    sum of ``grad_out`` over the positions that hold ``v``.

    Besides the values, the checker measures the memory of one large case
    (:func:`_memory_case`): an answer whose peak reaches half of the one-hot
    matrix ``H`` as booleans, so one that builds the whole ``H`` (the product
    ``H^T G``, right values at the cost the lookup avoids), is rejected. A
    product computed block by block over small chunks of ids stays below the
    threshold and is not detected. The measurement uses :mod:`tracemalloc` for
    numpy and, where torch is imported, torch's profiler, whatever the answer
    returns, as :func:`check_linear_attention` does.
    """
    __tracebackhide__ = True
    cases = embedding_grad_cases()
    run_checks(
        "embedding gradient",
        fn,
        cases,
        embedding_grad,
        EMBEDDING_GRAD_MISTAKES,
        # its "Correct" line waits for the memory check
        quiet=True,
    )
    _check_embedding_grad_memory(fn)
    print(
        f"Correct: embedding gradient passes all {len(cases)} cases, and on "
        f"V = {MEMORY_VOCAB:,} with {int(np.prod(MEMORY_IDS_SHAPE)):,} ids "
        "it never needed the memory of the one-hot matrix H."
    )
