"""The sparse-attention checkers reject each classic mistake and pass correct
solutions.

The wrong solutions are written here independently of the checkers' Mistake
functions, the way a reader might write them: helper functions, torch's
topk, loops, numpy.
"""

import numpy as np
import pytest
import torch

from attnbook.exercises import ExerciseError
from attnbook.exercises.sparse import (
    check_causal_topk,
    check_packed_sliding_mask_mod,
)

# --- the packed, sliding, causal mask_mod ------------------------------------


def packed_sliding(doc_ids, window):
    """Correct: three named conditions."""

    def mask_mod(b, h, q_idx, kv_idx):
        same_doc = doc_ids[q_idx] == doc_ids[kv_idx]
        past = kv_idx <= q_idx
        recent = kv_idx > q_idx - window
        return same_doc & past & recent

    return mask_mod


def packed_sliding_composed(doc_ids, window):
    """Correct: torch's and_masks over two mask_mods."""
    from torch.nn.attention.flex_attention import and_masks

    def document(b, h, q_idx, kv_idx):
        return doc_ids[q_idx] == doc_ids[kv_idx]

    def sliding(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        return (distance >= 0) & (distance < window)

    return and_masks(document, sliding)


def packed_sliding_run_starts(doc_ids, window):
    """Correct, whatever the labels: each position's document starts where
    the run of its label began (the last change of doc_ids at or before
    it)."""
    n = len(doc_ids)
    change = torch.ones(n, dtype=torch.bool)
    change[1:] = doc_ids[1:] != doc_ids[:-1]
    positions = torch.arange(n)
    start = torch.cummax(torch.where(change, positions, 0), dim=0).values

    def mask_mod(b, h, q_idx, kv_idx):
        lower = torch.maximum(start[q_idx], q_idx - window + 1)
        return (kv_idx >= lower) & (kv_idx <= q_idx)

    return mask_mod


def packed_sliding_later_document(doc_ids, window):
    """Wrong where the labels do not increase: "a key of the same or a later
    document" read as >=, equal to == while documents are numbered in
    order."""

    def mask_mod(b, h, q_idx, kv_idx):
        not_earlier = doc_ids[kv_idx] >= doc_ids[q_idx]
        return not_earlier & (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return mask_mod


def packed_sliding_earlier_document(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        near = kv_idx > q_idx - window
        return causal & near & (doc_ids[q_idx] >= doc_ids[kv_idx])

    return mask_mod


def packed_sliding_offsets(doc_ids, window):
    """Wrong where the labels do not run 0, 1, 2, ... along the row: each
    document's offset from the lengths of the documents labelled before
    it."""
    lengths = torch.bincount(doc_ids)
    offsets = torch.cat(
        [torch.zeros(1, dtype=lengths.dtype), lengths.cumsum(0)]
    )

    def mask_mod(b, h, q_idx, kv_idx):
        first = offsets[doc_ids[q_idx]]
        return (
            (kv_idx >= first) & (kv_idx <= q_idx) & (kv_idx > q_idx - window)
        )

    return mask_mod


def packed_sliding_no_causal(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        close = (q_idx - kv_idx).abs() < window
        return (doc_ids[q_idx] == doc_ids[kv_idx]) & close

    return mask_mod


def packed_sliding_forgets_the_past_bound(doc_ids, window):
    """Causality simply left out: the window's one-sided bound admits every
    later key of the document."""

    def mask_mod(b, h, q_idx, kv_idx):
        in_document = doc_ids[kv_idx] == doc_ids[q_idx]
        return in_document & (kv_idx > q_idx - window)

    return mask_mod


def packed_sliding_across(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - window)

    return mask_mod


def packed_sliding_whole_document(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_ids[q_idx] == doc_ids[kv_idx]) & (kv_idx <= q_idx)

    return mask_mod


def packed_sliding_wide(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_ids[q_idx] == doc_ids[kv_idx]
        return same & (kv_idx <= q_idx) & (kv_idx >= q_idx - window)

    return mask_mod


def packed_sliding_narrow(doc_ids, window):
    """The window one too narrow: the bound written from the key's side,
    one off."""

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_ids[q_idx] == doc_ids[kv_idx]
        return same & (kv_idx <= q_idx) & (kv_idx > q_idx - window + 1)

    return mask_mod


def packed_sliding_strict(doc_ids, window):
    """Strict causality: a query that cannot read itself."""

    def mask_mod(b, h, q_idx, kv_idx):
        in_document = doc_ids[q_idx] == doc_ids[kv_idx]
        return in_document & (kv_idx < q_idx) & (kv_idx > q_idx - window)

    return mask_mod


def packed_sliding_or(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        past = kv_idx <= q_idx
        return past & (
            (doc_ids[q_idx] == doc_ids[kv_idx]) | (kv_idx > q_idx - window)
        )

    return mask_mod


def packed_sliding_all_or(doc_ids, window):
    """The three conditions, each right, joined by | throughout."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (
            (doc_ids[q_idx] == doc_ids[kv_idx])
            | (kv_idx <= q_idx)
            | (q_idx - kv_idx < window)
        )

    return mask_mod


def packed_sliding_python_if(doc_ids, window):
    """A Python if on a tensor: the window tested by branching."""

    def mask_mod(b, h, q_idx, kv_idx):
        if q_idx - kv_idx >= window:
            return q_idx < 0
        return (doc_ids[q_idx] == doc_ids[kv_idx]) & (kv_idx <= q_idx)

    return mask_mod


def packed_sliding_python_and(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        return (
            doc_ids[q_idx] == doc_ids[kv_idx]
            and kv_idx <= q_idx
            and q_idx - kv_idx < window
        )

    return mask_mod


def packed_sliding_two_args(doc_ids, window):
    def mask_mod(q_idx, kv_idx):
        return kv_idx <= q_idx

    return mask_mod


# --- the causal top-k --------------------------------------------------------


def topk_torch(scores, k):
    """Correct, with torch.topk and a validity mask."""
    s = torch.as_tensor(scores)
    n_q, n_k = s.shape
    t = torch.arange(n_q)[:, None] + (n_k - n_q)
    allowed = torch.arange(n_k)[None, :] <= t
    top = s.masked_fill(~allowed, float("-inf")).topk(k, dim=-1)
    keep = torch.isfinite(top.values)
    out = torch.zeros(n_q, n_k, dtype=torch.bool)
    for row in range(n_q):
        out[row, top.indices[row][keep[row]]] = True
    return out


def topk_loop(scores, k):
    """Correct, in plain loops over the admissible keys of each query."""
    n_q, n_k = scores.shape
    out = np.zeros((n_q, n_k), dtype=bool)
    for i in range(n_q):
        position = i + n_k - n_q
        ranked = sorted(range(position + 1), key=lambda s: -scores[i, s])
        out[i, ranked[:k]] = True
    return out


def topk_unmasked(scores, k):
    idx = np.argsort(scores, axis=-1)[:, ::-1][:, :k]
    out = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(out, idx, True, axis=-1)
    return out


def topk_mask_after(scores, k):
    n_q, n_k = scores.shape
    return topk_unmasked(scores, k) & np.tri(n_q, n_k, n_k - n_q, dtype=bool)


def topk_keeps_padding(scores, k):
    s = torch.as_tensor(scores)
    n_q, n_k = s.shape
    allowed = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
    idx = s.masked_fill(~allowed, float("-inf")).topk(k, dim=-1).indices
    return torch.zeros(n_q, n_k, dtype=torch.bool).scatter(-1, idx, True)


def topk_numpy_stable_padding(scores, k):
    """numpy's stable argsort over the masked scores, all k slots kept: the
    spare slots of an early query get the earliest future keys."""
    n_q, n_k = scores.shape
    future = ~np.tri(n_q, n_k, n_k - n_q, dtype=bool)
    masked = np.where(future, -np.inf, scores)
    best = np.argsort(-masked, axis=-1, kind="stable")[:, :k]
    out = np.zeros((n_q, n_k), dtype=bool)
    np.put_along_axis(out, best, True, axis=-1)
    return out


def topk_torch_sort_padding(scores, k):
    """torch.sort(stable=True) over scores filled with finfo's min, all k
    slots kept."""
    s = torch.as_tensor(scores)
    n_q, n_k = s.shape
    allowed = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
    filled = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
    order = filled.sort(dim=-1, descending=True, stable=True).indices
    out = torch.zeros(n_q, n_k, dtype=torch.bool)
    return out.scatter(-1, order[:, :k], True)


def topk_reversed_argsort_padding(scores, k):
    """An ascending argsort read backwards, all k slots kept: the spare
    slots get the LATEST future keys, an order no fixed fill matches."""
    n_q, n_k = scores.shape
    masked = np.where(np.tri(n_q, n_k, n_k - n_q, dtype=bool), scores, -1e9)
    best = np.argsort(masked, axis=-1)[:, ::-1][:, :k]
    out = np.zeros((n_q, n_k), dtype=bool)
    np.put_along_axis(out, best, True, axis=-1)
    return out


def topk_strict(scores, k):
    """Strict causality: a query that cannot select itself."""
    s = torch.as_tensor(scores)
    n_q, n_k = s.shape
    before = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q - 1)
    top = s.masked_fill(~before, float("-inf")).topk(k, dim=-1)
    keep = torch.isfinite(top.values)
    out = torch.zeros(n_q, n_k, dtype=torch.bool)
    return out.scatter(-1, top.indices, keep) | out


def topk_numpy_argsort(scores, k):
    """Correct: a stable numpy argsort over the masked scores, keeping the
    min(k, t + 1) admissible slots."""
    n_q, n_k = scores.shape
    allowed = np.tri(n_q, n_k, n_k - n_q, dtype=bool)
    order = np.argsort(-np.where(allowed, scores, -np.inf), kind="stable")
    counts = np.minimum(k, allowed.sum(axis=-1))
    out = np.zeros((n_q, n_k), dtype=bool)
    for row in range(n_q):
        out[row, order[row, : counts[row]]] = True
    return out


def topk_smallest(scores, k):
    n_q, n_k = scores.shape
    out = np.zeros((n_q, n_k), dtype=bool)
    for i in range(n_q):
        position = i + n_k - n_q
        ranked = sorted(range(position + 1), key=lambda s: scores[i, s])
        out[i, ranked[:k]] = True
    return out


def topk_queries_first(scores, k):
    n_q, n_k = scores.shape
    out = np.zeros((n_q, n_k), dtype=bool)
    for i in range(n_q):
        ranked = sorted(range(i + 1), key=lambda s: -scores[i, s])
        out[i, ranked[:k]] = True
    return out


def topk_float(scores, k):
    """The right pattern, as a float 0/1 tensor."""
    s = torch.as_tensor(scores)
    n_q, n_k = s.shape
    allowed = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
    top = s.masked_fill(~allowed, float("-inf")).topk(k, dim=-1)
    out = torch.zeros(n_q, n_k, dtype=torch.float64)
    out.scatter_(-1, top.indices, torch.isfinite(top.values).double())
    return out


def topk_int(scores, k):
    """The right pattern, as an int32 array built in a loop."""
    n_q, n_k = scores.shape
    out = np.zeros((n_q, n_k), dtype=np.int32)
    for i in range(n_q):
        last = i + n_k - n_q
        best = np.argsort(-scores[i, : last + 1])[:k]
        out[i, best] = 1
    return out


def topk_scores_as_tensor(scores, k):
    """Correct, idiomatic torch on the scores as given: fails on a numpy
    array (no masked_fill), so the checker passes a tensor."""
    n_q, n_k = scores.shape
    t = torch.arange(n_q)[:, None] + (n_k - n_q)
    future = torch.arange(n_k)[None, :] > t
    top = scores.masked_fill(future, float("-inf")).topk(k, dim=-1)
    keep = torch.isfinite(top.values)
    out = torch.zeros(n_q, n_k, dtype=torch.bool)
    return out.scatter(-1, top.indices, keep) | out


def topk_latest_on_ties(scores, k):
    """Correct, breaking ties toward the LATER key (the reference breaks
    them toward the earlier one)."""
    n_q, n_k = scores.shape
    out = np.zeros((n_q, n_k), dtype=bool)
    for i in range(n_q):
        position = i + n_k - n_q
        ranked = sorted(range(position + 1), key=lambda s: (-scores[i, s], -s))
        out[i, ranked[:k]] = True
    return out


def topk_strictly_above_next(scores, k):
    """Wrong on ties: keeps the keys scoring strictly above the (k+1)-th
    largest admissible score, so fewer than k where the k-th and (k+1)-th
    tie."""
    n_q, n_k = scores.shape
    out = np.zeros((n_q, n_k), dtype=bool)
    for i in range(n_q):
        row = scores[i, : i + n_k - n_q + 1]
        if row.size <= k:
            out[i, : row.size] = True
        else:
            out[i, : row.size] = row > np.sort(row)[::-1][k]
    return out


def topk_diagonal_off_by_one(scores, k):
    """Wrong: tril's diagonal one too high, so each query may select the key
    just after it."""
    s = torch.as_tensor(scores)
    n_q, n_k = s.shape
    allowed = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q + 1)
    top = s.masked_fill(~allowed, float("-inf")).topk(k, dim=-1)
    out = torch.zeros(n_q, n_k, dtype=torch.bool)
    return out.scatter(-1, top.indices, torch.isfinite(top.values))


def topk_masked_with_zero(scores, k):
    """Wrong: the future multiplied away (set to 0) before torch's topk, then
    dropped; a 0 outranks a negative score."""
    s = torch.as_tensor(scores)
    n_q, n_k = s.shape
    allowed = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
    idx = (s * allowed).topk(k, dim=-1).indices
    chosen = torch.zeros(n_q, n_k, dtype=torch.bool).scatter(-1, idx, True)
    return chosen & allowed


def topk_numpy_zero_fill(scores, k):
    """Wrong: np.where(..., scores, 0) before numpy's (unstable) argsort."""
    n_q, n_k = scores.shape
    allowed = np.tri(n_q, n_k, n_k - n_q, dtype=bool)
    best = np.argsort(np.where(allowed, scores, 0.0), axis=-1)[:, ::-1][:, :k]
    out = np.zeros((n_q, n_k), dtype=bool)
    np.put_along_axis(out, best, True, axis=-1)
    return out & allowed


def topk_threshold(scores, k):
    """Wrong on ties: keeps every admissible key scoring at least the k-th
    largest, so more than k keys where scores tie."""
    n_q, n_k = scores.shape
    out = np.zeros((n_q, n_k), dtype=bool)
    for i in range(n_q):
        row = scores[i, : i + n_k - n_q + 1]
        kth = np.sort(row)[::-1][min(k, row.size) - 1]
        out[i, : row.size] = row >= kth
    return out


CATALOGUE = {
    "check_packed_sliding_mask_mod": {
        "right": [
            packed_sliding,
            packed_sliding_composed,
            packed_sliding_run_starts,
        ],
        "wrong": [
            (packed_sliding_no_causal, "no_causal"),
            (packed_sliding_forgets_the_past_bound, "no_causal_one_sided"),
            (packed_sliding_across, "crosses_documents"),
            (packed_sliding_later_document, "document_order_ge"),
            (packed_sliding_earlier_document, "document_order_le"),
            (packed_sliding_offsets, "starts_by_label"),
            (packed_sliding_whole_document, "no_window"),
            (packed_sliding_wide, "window_plus_one"),
            (packed_sliding_narrow, "window_minus_one"),
            (packed_sliding_strict, "self_excluded"),
            (packed_sliding_or, "or_joined"),
            (packed_sliding_all_or, "all_or"),
            (packed_sliding_python_and, "python_and"),
            (packed_sliding_python_if, "python_and"),
            (packed_sliding_two_args, "wrong_arity"),
        ],
    },
    "check_causal_topk": {
        "right": [
            topk_torch,
            topk_loop,
            topk_scores_as_tensor,
            topk_latest_on_ties,
            topk_numpy_argsort,
        ],
        "wrong": [
            (topk_unmasked, "future_selected"),
            (topk_mask_after, "masked_after"),
            (topk_keeps_padding, "padded_with_future"),
            (topk_numpy_stable_padding, "padded_with_future"),
            (topk_torch_sort_padding, "padded_with_future"),
            (topk_reversed_argsort_padding, "padded_with_future"),
            (topk_strict, "self_excluded"),
            (topk_smallest, "smallest"),
            (topk_queries_first, "queries_first"),
            (topk_float, "float_selection"),
            (topk_int, "int_selection"),
            (topk_threshold, "ties_kept"),
            (topk_strictly_above_next, "ties_dropped"),
            (topk_diagonal_off_by_one, "one_future"),
            (topk_masked_with_zero, "zero_masked"),
            (topk_numpy_zero_fill, "zero_masked"),
        ],
    },
}
# The catalogue's solutions are run by tests/test_exercises_framework.py, which
# checks every right one accepted and every wrong one named, for every checker.


def test_a_python_if_is_named_in_the_diagnosis():
    """An if on a tensor is control flow too; the diagnosis names it, not
    only `and`."""
    with pytest.raises(ExerciseError) as err:
        check_packed_sliding_mask_mod(packed_sliding_python_if)
    assert "`if`" in str(err.value), str(err.value)


def test_a_selection_in_the_wrong_dtype_says_its_pattern_is_right():
    for fn, dtype in ((topk_float, "float (float64)"), (topk_int, "int32")):
        with pytest.raises(ExerciseError) as err:
            check_causal_topk(fn)
        text = str(err.value)
        assert dtype in text and "pattern is right" in text, text
        assert "largest difference" not in text


def test_the_last_topk_case_has_ties_at_the_kth_score():
    """The tie case tells a top-k from a threshold at the k-th score."""
    from attnbook.exercises.sparse import _reference_topk, topk_cases

    scores, k = topk_cases()[-1].args
    assert not np.array_equal(
        topk_threshold(scores, k), _reference_topk(scores, k)
    )
    assert not np.array_equal(
        topk_latest_on_ties(scores, k), _reference_topk(scores, k)
    )


def test_a_packed_case_labels_its_documents_out_of_order():
    """Under causality, comparing the labels with >= equals == while they
    increase along the row; one case's do not, so that the checker tells
    them apart."""
    from attnbook.exercises.sparse import packed_sliding_cases

    labels = [case.args[0] for case in packed_sliding_cases()]
    assert any((doc[1:] < doc[:-1]).any() for doc in labels)


def test_the_topk_cases_keep_k_within_the_keys():
    """The exercise promises 1 <= k <= n_k, as the package's causal_topk
    requires: no case of the checker passes another k (issue 31, student
    report 1314)."""
    from attnbook.exercises.sparse import topk_cases

    for case in topk_cases():
        scores, k = case.args
        assert 1 <= k <= scores.shape[-1], case.name
