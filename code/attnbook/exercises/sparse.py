"""Checkers for sparse attention (chapter 14): a FlexAttention ``mask_mod``
for a packed, sliding, causal batch, the indexer's causal top-k, and
block-sparse attention that skips tiles (hard).

The mask's mistakes are those of combining three conditions: one left out
(causality, with the window two-sided or one-sided; the document; the window),
the documents compared by their order (``>=``, right only while the labels
increase along the row: one case labels them out of order; or ``<=``, wrong
even then, since under causality every earlier key's label is at most the
query's), the window
one too wide or one too narrow, a query that cannot read itself (``kv_idx <
q_idx``), some or all of the conditions joined by "or", and Python's ``and``,
``or`` or ``if`` where FlexAttention traces tensors (it needs ``&``, ``|``
and ``torch.where``). The top-k's mistakes are
those of forgetting that a query may select only the keys at or before it: the
future not masked before the top-k, masked only after it (a query keeps fewer
than ``k`` keys), the slots of a query with fewer than ``k`` admissible keys
filled with future keys (recognised by its behaviour, whatever order the
reader's sort fills them in), a query that cannot select itself, the smallest
scores taken instead of the largest, every key tied with the k-th score kept
(more than ``k`` keys), every key tied with the (k+1)-th score dropped (fewer
than ``k``), one future key admitted (``s <= t + 1``), and the future masked
with 0 instead of -inf, so that it outranks the negative scores (whatever
order the reader's sort gives the zeros that tie); and the right
selection returned as float or integer 0/1 rather than booleans. On tied scores
any tie-break is right: a selection of ``min(k, t + 1)`` admissible keys none
of which scores below an unselected admissible key is accepted.

The tiled attention's mistakes are those of a tile loop with an online
softmax: partial tiles read unmasked, empty tiles visited (the count wrong),
the last, shorter tile dropped, NaN for a query that may read no key, tiles
merged without rescaling, full tiles left out of the count, the scores not
scaled by 1 / sqrt(d) (or by 1 / d), and tiles judged
empty by their four corners (one case puts a document, with padding on both
sides of it, inside one tile). The work that skipping saves is measured, not
read from the count the reader returns: the mask evaluated on a strip of a
query tile against every key, or on all n x n pairs at once (the sizes the
mask_mod is asked about, and the peak memory), and the empty tiles' scores
computed and thrown away (the scores computed from the keys after each
evaluation of the mask_mod, counted, or where the keys leave torch by a route
the checker cannot follow, the memory allocated: no timing).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ._framework import (
    FLOAT_MASK_DESCRIPTION,
    FLOAT_MASK_HINT,
    INT_MASK_DESCRIPTION,
    INT_MASK_HINT,
    Case,
    Mistake,
    describe_mask,
    run_checks,
    same_mask,
)
from .multihead import ArraysOrTensors

# --- a mask_mod for a packed, sliding, causal batch --------------------------


def _dense(mask_mod, n: int) -> np.ndarray:
    """The (n, n) boolean mask a ``mask_mod`` means, evaluated as
    FlexAttention evaluates it (``create_mask``: traced with vmap)."""

    from ..sparse.flex import dense_mask

    mask = dense_mask(mask_mod, 1, 1, n, n)[0, 0]
    if mask.dtype != torch.bool:
        raise TypeError(
            f"your mask_mod returns {mask.dtype} values; a mask_mod returns "
            "booleans (a comparison, combined with & and |)"
        )
    return mask.numpy()


def _as_dense(factory):
    """A checker's function: ``factory(doc_ids, window)`` builds a mask_mod;
    the result compared is its dense mask."""

    def run(doc_ids, window):
        return _dense(factory(doc_ids, window), len(doc_ids))

    return run


def _reference_packed_sliding(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_ids[q_idx] == doc_ids[kv_idx]
        causal = kv_idx <= q_idx
        near = q_idx - kv_idx < window
        return same & causal & near

    return mask_mod


def _without(condition: str):
    def factory(doc_ids, window):
        def mask_mod(b, h, q_idx, kv_idx):
            parts = {
                "same": doc_ids[q_idx] == doc_ids[kv_idx],
                "causal": kv_idx <= q_idx,
                "near": (q_idx - kv_idx).abs() < window,
            }
            if condition != "causal":
                # causal present: the window is one-sided anyway
                parts["near"] = q_idx - kv_idx < window
            kept = [v for k, v in parts.items() if k != condition]
            return kept[0] & kept[1]

        return mask_mod

    return factory


def _no_causal_one_sided(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_ids[q_idx] == doc_ids[kv_idx]
        return same & (q_idx - kv_idx < window)

    return mask_mod


def _document_order(compare: str):
    """The document condition written as an order: ``>=`` (a key's
    document at or after the query's) or ``<=``. Under causality ``>=``
    equals ``==`` while the labels increase along the row, and crosses
    documents otherwise; ``<=`` always holds for an earlier key while they
    increase, so it crosses documents even then."""

    def factory(doc_ids, window):
        def mask_mod(b, h, q_idx, kv_idx):
            if compare == ">=":
                same = doc_ids[kv_idx] >= doc_ids[q_idx]
            else:
                same = doc_ids[kv_idx] <= doc_ids[q_idx]
            return same & (kv_idx <= q_idx) & (q_idx - kv_idx < window)

        return mask_mod

    return factory


def _starts_by_label(doc_ids, window):
    """Each document's start found as if the labels were 0, 1, 2, ... in
    the order of the row: label j starts after the positions of the labels
    below it (``bincount`` and ``cumsum``)."""
    counts = torch.bincount(doc_ids)
    start = torch.cumsum(counts, 0) - counts

    def mask_mod(b, h, q_idx, kv_idx):
        begins = start[doc_ids[q_idx]]
        return (
            (kv_idx >= begins) & (kv_idx <= q_idx) & (q_idx - kv_idx < window)
        )

    return mask_mod


def _window_plus_one(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_ids[q_idx] == doc_ids[kv_idx]
        return same & (kv_idx <= q_idx) & (q_idx - kv_idx <= window)

    return mask_mod


def _window_minus_one(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_ids[q_idx] == doc_ids[kv_idx]
        return same & (kv_idx <= q_idx) & (q_idx - kv_idx < window - 1)

    return mask_mod


def _self_excluded(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_ids[q_idx] == doc_ids[kv_idx]
        return same & (kv_idx < q_idx) & (q_idx - kv_idx < window)

    return mask_mod


def _or_joined(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        causal = kv_idx <= q_idx
        same = doc_ids[q_idx] == doc_ids[kv_idx]
        return (same & causal) | (causal & (q_idx - kv_idx < window))

    return mask_mod


def _all_or(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_ids[q_idx] == doc_ids[kv_idx]
        return same | (kv_idx <= q_idx) | (q_idx - kv_idx < window)

    return mask_mod


def _python_and(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        return doc_ids[q_idx] == doc_ids[kv_idx] and kv_idx <= q_idx

    return mask_mod


def _is_control_flow_error(err: Exception) -> bool:
    return isinstance(err, RuntimeError) and "control flow" in str(err)


def _is_arity_error(err: Exception) -> bool:
    return isinstance(err, ValueError) and "a mask_mod takes 4" in str(err)


def _three_arguments(doc_ids, window):
    def mask_mod(q_idx, kv_idx, h):
        return kv_idx <= q_idx

    return mask_mod


PACKED_SLIDING_MISTAKES = [
    Mistake(
        "no_causal",
        "the mask is not causal: a query reads the keys after it, within the "
        "window, in its document",
        "add kv_idx <= q_idx: a decoder never reads the future",
        _as_dense(_without("causal")),
    ),
    Mistake(
        "no_causal_one_sided",
        "the mask is not causal: q_idx - kv_idx < window holds for every key "
        "after the query (q_idx - kv_idx is negative), so a query reads the "
        "whole rest of its document",
        "add kv_idx <= q_idx: a decoder never reads the future",
        _as_dense(_no_causal_one_sided),
    ),
    Mistake(
        "crosses_documents",
        "a query reads the end of the document packed before its own: the "
        "document condition is missing",
        "add doc_ids[q_idx] == doc_ids[kv_idx]",
        _as_dense(_without("same")),
    ),
    Mistake(
        "document_order_ge",
        "the documents are compared with >=: doc_ids[kv_idx] >= "
        "doc_ids[q_idx] holds for a key of any document labelled at or after "
        "the query's, so where the labels do not increase along the row a "
        "query reads an earlier document",
        "doc_ids labels the documents, in no particular order: compare them "
        "with ==",
        _as_dense(_document_order(">=")),
    ),
    Mistake(
        "document_order_le",
        "the documents are compared with <=: doc_ids[kv_idx] <= "
        "doc_ids[q_idx] holds for a key of any document labelled at or "
        "before the query's, so a query reads an earlier document",
        "doc_ids labels the documents, in no particular order: compare them "
        "with ==",
        _as_dense(_document_order("<=")),
    ),
    Mistake(
        "starts_by_label",
        "each document's start is computed from its label, as if the labels "
        "ran 0, 1, 2, ... in the order of the row (the positions of the "
        "smaller labels counted before it); where they do not, a document's "
        "start is wrong",
        "compare the documents themselves: doc_ids[q_idx] == doc_ids[kv_idx]",
        _as_dense(_starts_by_label),
    ),
    Mistake(
        "no_window",
        "a query reads its whole document: the window is missing",
        "add q_idx - kv_idx < window (the query and the window - 1 keys "
        "before it)",
        _as_dense(_without("near")),
    ),
    Mistake(
        "window_plus_one",
        "the window holds window + 1 keys: q_idx - kv_idx <= window",
        "a window of w keys, the query's own included, is q_idx - kv_idx < w",
        _as_dense(_window_plus_one),
    ),
    Mistake(
        "window_minus_one",
        "the window holds window - 1 keys: q_idx - kv_idx < window - 1",
        "a window of w keys, the query's own included, is q_idx - kv_idx < w",
        _as_dense(_window_minus_one),
    ),
    Mistake(
        "self_excluded",
        "a query cannot read itself: kv_idx < q_idx leaves out the diagonal",
        "causal attention lets a query read its own key: kv_idx <= q_idx",
        _as_dense(_self_excluded),
    ),
    Mistake(
        "or_joined",
        "the conditions are joined by |: a query reads its whole document, "
        "and the window's keys in the document before",
        "every condition must hold: join them with &",
        _as_dense(_or_joined),
    ),
    Mistake(
        "all_or",
        "every condition is joined by |: a query reads every key of the "
        "row, since kv_idx <= q_idx or q_idx - kv_idx < window holds for "
        "every key",
        "every condition must hold: join them with &",
        _as_dense(_all_or),
    ),
    Mistake(
        "python_and",
        "Python's `and`, `or` or `if` on a tensor: FlexAttention traces the "
        "mask_mod, and asking a tensor for its truth value is "
        "data-dependent control flow",
        "combine the conditions with & (and | for or), in parentheses; "
        "choose with torch.where, not if",
        _as_dense(_python_and),
        raises=_is_control_flow_error,
    ),
    Mistake(
        "wrong_arity",
        "the mask_mod does not take the four arguments (b, h, q_idx, kv_idx)",
        "define mask_mod(b, h, q_idx, kv_idx), even if b and h go unused",
        _as_dense(_three_arguments),
        raises=_is_arity_error,
    ),
]


def packed_sliding_cases() -> list[Case]:

    def docs(*lengths, labels=None):
        if labels is None:
            labels = range(len(lengths))
        return torch.repeat_interleave(
            torch.tensor(labels), torch.tensor(lengths)
        )

    return [
        Case("three documents 5, 9, 6; window 4", (docs(5, 9, 6), 4)),
        Case(
            "one document of 20; window 12 (wide, and it still cuts)",
            (docs(20), 12),
        ),
        Case(
            "documents 2, 7, 3, 8; window 5 (longer than two documents)",
            (docs(2, 7, 3, 8), 5),
        ),
        Case("documents 4, 4, 4; window 1 (itself only)", (docs(4, 4, 4), 1)),
        Case(
            "documents 4, 7, 5 labelled 2, 0, 1 (not in order); window 16 "
            "(wider than all)",
            (docs(4, 7, 5, labels=(2, 0, 1)), 16),
        ),
    ]


def check_packed_sliding_mask_mod(fn) -> None:
    """Check ``fn(doc_ids, window)`` returns a ``mask_mod(b, h, q_idx,
    kv_idx)`` that lets a query read the keys of its own document at or
    before it and fewer than ``window`` positions back; doc_ids: (n,) int
    tensor, the document of each packed position."""
    run_checks(
        "a mask_mod for a packed, sliding, causal batch",
        _as_dense(fn),
        packed_sliding_cases(),
        _as_dense(_reference_packed_sliding),
        PACKED_SLIDING_MISTAKES,
        compare=same_mask,
    )


# --- the indexer's causal top-k ----------------------------------------------


def _future_masked(scores):
    n_q, n_k = scores.shape
    t = np.arange(n_q)[:, None] + (n_k - n_q)
    return np.where(np.arange(n_k)[None, :] <= t, scores, -np.inf)


def _selected(order, n_k, k, counts):
    """A boolean (n_q, n_k) selection: the first ``counts[t]`` of row t's
    ``order`` (at most k)."""
    mask = np.zeros((order.shape[0], n_k), dtype=bool)
    for t, row in enumerate(order):
        mask[t, row[: min(k, counts[t])]] = True
    return mask


def _reference_topk(scores, k):
    n_q, n_k = scores.shape
    masked = _future_masked(scores)
    order = np.argsort(-masked, axis=-1, kind="stable")
    counts = np.arange(n_q) + (n_k - n_q) + 1
    return _selected(order, n_k, k, counts)


def _unmasked(scores, k):
    order = np.argsort(-scores, axis=-1, kind="stable")
    return _selected(order, scores.shape[1], k, [k] * scores.shape[0])


def _masked_after(scores, k):
    n_q, n_k = scores.shape
    chosen = _unmasked(scores, k)
    return chosen & np.isfinite(_future_masked(scores))


def _padded_with_future(scores, k):
    """A sort of the masked scores, every one of the k slots kept: where a
    query has fewer than k admissible keys, the rest are future (-inf) keys,
    here the earliest of them (a stable sort's order). A reader's sort may
    fill them in another order: :class:`_AnyTieBreak` recognises the mistake
    by its behaviour (:func:`_is_padded_with_future`) and gives this
    function's output in its place."""
    order = np.argsort(-_future_masked(scores), axis=-1, kind="stable")
    return _selected(order, scores.shape[1], k, [k] * scores.shape[0])


def _self_excluded_topk(scores, k):
    """A query that cannot select itself: only the keys strictly before it
    are admissible, so query t selects min(k, t) keys."""
    n_q, n_k = scores.shape
    t = np.arange(n_q)[:, None] + (n_k - n_q)
    masked = np.where(np.arange(n_k)[None, :] < t, scores, -np.inf)
    order = np.argsort(-masked, axis=-1, kind="stable")
    return _selected(order, n_k, k, t[:, 0])


def _smallest(scores, k):
    n_q, n_k = scores.shape
    masked = np.where(np.isfinite(_future_masked(scores)), scores, np.inf)
    order = np.argsort(masked, axis=-1, kind="stable")
    counts = np.arange(n_q) + (n_k - n_q) + 1
    return _selected(order, n_k, k, counts)


def _queries_first(scores, k):
    """Causal as if the queries were the first n_q keys (PyTorch's
    is_causal), not the last."""
    n_q, n_k = scores.shape
    allowed = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None]
    masked = np.where(allowed, scores, -np.inf)
    order = np.argsort(-masked, axis=-1, kind="stable")
    return _selected(order, n_k, k, np.arange(n_q) + 1)


def _float_selection(scores, k):
    return _reference_topk(scores, k).astype(np.float64)


def _int_selection(scores, k):
    return _reference_topk(scores, k).astype(np.int64)


def _ties_kept(scores, k):
    """Every admissible key whose score is at least the k-th largest: more
    than k keys where scores tie at the k-th."""
    n_q, n_k = scores.shape
    masked = _future_masked(scores)
    counts = np.arange(n_q) + (n_k - n_q) + 1
    ranked = -np.sort(-masked, axis=-1)
    kth = ranked[np.arange(n_q), np.minimum(k, counts) - 1]
    return np.isfinite(masked) & (masked >= kth[:, None])


def _ties_dropped(scores, k):
    """Every admissible key scoring strictly above the (k+1)-th largest:
    where the k-th and (k+1)-th tie, fewer than k keys."""
    n_q, n_k = scores.shape
    masked = _future_masked(scores)
    counts = np.arange(n_q) + (n_k - n_q) + 1
    ranked = -np.sort(-masked, axis=-1)
    # a query with at most k admissible keys keeps them all
    next_score = np.where(counts > k, ranked[:, min(k, n_k - 1)], -np.inf)
    return np.isfinite(masked) & (masked > next_score[:, None])


def _one_future(scores, k):
    """Causal one position too late: keys s <= t + 1 admissible, so a query
    may select the key just after it."""
    n_q, n_k = scores.shape
    t = np.arange(n_q)[:, None] + (n_k - n_q)
    masked = np.where(np.arange(n_k)[None, :] <= t + 1, scores, -np.inf)
    order = np.argsort(-masked, axis=-1, kind="stable")
    return _selected(order, n_k, k, np.minimum(t[:, 0] + 2, n_k))


def _zero_masked(scores, k):
    """The future set to 0, not -inf, before the top-k, and dropped after:
    a future key outranks every negative score, so a query keeps fewer than
    min(k, t + 1) keys. Where an admissible score is 0 too, this version
    (a stable sort) ranks it before the future's zeros; a reader's sort may
    not: :class:`_AnyTieBreak` recognises the mistake by its behaviour
    (:func:`_is_zero_masked`) and gives this function's output in its
    place."""
    admissible = np.isfinite(_future_masked(scores))
    filled = np.where(admissible, scores, 0.0)
    order = np.argsort(-filled, axis=-1, kind="stable")
    chosen = _selected(order, scores.shape[1], k, [k] * scores.shape[0])
    return chosen & admissible


def _zero_masked_capped(scores, k):
    """The future set to 0, not -inf, before the top-k, and the first
    min(k, t + 1) slots kept: a future key's 0 outranks every negative score
    and takes a slot of query t. Where scores tie with the future's zeros,
    this version ranks the future first (the tie-break that goes wrong
    soonest); :class:`_AnyTieBreak` recognises the mistake under any
    tie-break (:func:`_is_zero_masked_capped`) and gives this function's
    output in its place."""
    n_q, n_k = scores.shape
    admissible = np.isfinite(_future_masked(scores))
    filled = np.where(admissible, scores, 0.0)
    # np.lexsort sorts by its last key first: the score, then admissible
    # (False, the future, first)
    order = np.lexsort((admissible, -filled), axis=-1)
    counts = np.arange(n_q) + (n_k - n_q) + 1
    return _selected(order, n_k, k, counts)


def _unmasked_capped(scores, k):
    """The top-k of the unmasked scores, then the first min(k, t + 1)
    slots kept: the count is right, but the keys are the best of every
    position, the future included."""
    n_q, n_k = scores.shape
    order = np.argsort(-scores, axis=-1, kind="stable")
    counts = np.arange(n_q) + (n_k - n_q) + 1
    return _selected(order, n_k, k, counts)


def _one_fewer(scores, k):
    return (
        _reference_topk(scores, k - 1)
        if k > 1
        else _reference_topk(scores, k) & False
    )


TOPK_MISTAKES = [
    Mistake(
        "future_selected",
        "the future is not masked before the top-k: a query selects keys "
        "after it",
        "set the scores of keys s > t to -inf BEFORE taking the top k",
        _unmasked,
    ),
    Mistake(
        "masked_after",
        "the future is masked after the top-k: a query whose best keys lie "
        "in its future keeps fewer than k keys",
        "mask first, then select: the k best among the admissible keys",
        _masked_after,
    ),
    Mistake(
        "padded_with_future",
        "a query with fewer than k admissible keys fills its k slots with "
        "masked (future) keys",
        "query t (t + 1 keys at or before it) selects min(k, t + 1) keys: "
        "drop the slots whose score is -inf",
        _padded_with_future,
    ),
    Mistake(
        "self_excluded",
        "a query cannot select itself: only the keys strictly before it are "
        "admissible (s < t), so query t selects min(k, t) keys",
        "the query's own key is admissible: mask the keys s > t, not s >= t",
        _self_excluded_topk,
    ),
    Mistake(
        "smallest",
        "the k smallest scores are selected, not the k largest",
        "sort in decreasing order (or take topk's largest)",
        _smallest,
    ),
    Mistake(
        "queries_first",
        "the queries are taken as the FIRST n_q positions: with fewer queries "
        "than keys (decoding), the last query sees only the first n_q keys",
        "the queries are the last n_q of the n_k positions: query i sits at "
        "i + n_k - n_q",
        _queries_first,
    ),
    Mistake(
        "float_selection",
        FLOAT_MASK_DESCRIPTION.replace("the mask", "the selection", 1),
        FLOAT_MASK_HINT,
        _float_selection,
    ),
    Mistake(
        "int_selection",
        INT_MASK_DESCRIPTION.replace("the mask", "the selection", 1),
        INT_MASK_HINT,
        _int_selection,
    ),
    Mistake(
        "one_fewer",
        "k - 1 keys are selected",
        "select k keys (where a query has that many)",
        _one_fewer,
    ),
    Mistake(
        "ties_dropped",
        "fewer than k keys are selected where scores tie: only the keys "
        "scoring strictly above the (k+1)-th largest are kept, so when the "
        "k-th and the (k+1)-th tie, both are dropped",
        "select exactly min(k, t + 1) keys per query, breaking ties any "
        "way (torch.topk or a stable argsort does)",
        _ties_dropped,
    ),
    Mistake(
        "one_future",
        "one future key is admissible: a query selects among the keys s <= "
        "t + 1, the key just after it included",
        "mask every key s > t (tril with diagonal n_k - n_q, not "
        "n_k - n_q + 1)",
        _one_future,
    ),
    Mistake(
        "zero_masked",
        "the future is masked with 0, not -inf: a future key's 0 outranks "
        "every negative score, so a query whose admissible scores are "
        "negative keeps fewer than min(k, t + 1) keys",
        "mask the future with -inf (float('-inf')), so that it ranks below "
        "every real score",
        _zero_masked,
    ),
    Mistake(
        "zero_masked",
        "the future is masked with 0, not -inf, and the first min(k, t + 1) "
        "slots are kept: a future key's 0 outranks every negative score, so "
        "a query selects future keys",
        "mask the future with -inf (float('-inf')), so that it ranks below "
        "every real score; then the first min(k, t + 1) slots are all "
        "admissible",
        _zero_masked_capped,
    ),
    Mistake(
        "future_selected",
        "the top-k is taken over the unmasked scores and its first "
        "min(k, t + 1) slots kept: the count is right, but the keys are the "
        "best of every position, the future's included",
        "set the scores of keys s > t to -inf BEFORE taking the top k; "
        "capping the count afterwards does not remove the future keys",
        _unmasked_capped,
    ),
    Mistake(
        "ties_kept",
        "more than k keys are selected where scores tie: every key whose "
        "score equals the k-th largest is kept",
        "select exactly min(k, t + 1) keys per query, breaking ties any "
        "way (torch.topk or a stable argsort does)",
        _ties_kept,
    ),
]


def topk_cases() -> list[Case]:
    rng = np.random.default_rng(0)
    rising = np.tile(np.arange(8.0), (8, 1))
    return [
        Case(
            "8 queries, 8 keys, k = 3; the future scores highest",
            (rising, 3),
        ),
        Case(
            "10 queries, 10 keys, random scores, k = 4",
            (rng.standard_normal((10, 10)), 4),
        ),
        Case(
            "3 queries, the last 3 of 9 keys (decoding), k = 2",
            (rng.standard_normal((3, 9)), 2),
        ),
        Case(
            "6 queries, 6 keys, k = 6 (every admissible key)",
            (rng.standard_normal((6, 6)), 6),
        ),
        Case(
            "12 queries, 12 keys, k = 1",
            (rng.standard_normal((12, 12)), 1),
        ),
        Case(
            "8 queries, 8 keys, k = 3; scores in {0, 1, 2}, with ties",
            (rng.integers(0, 3, (8, 8)).astype(np.float64), 3),
        ),
    ]


def _as_selection(out):
    out = np.asarray(out.detach().cpu() if hasattr(out, "detach") else out)
    return out


def _is_topk(selection, scores, k) -> bool:
    """Whether the boolean ``selection`` is a causal top-k of ``scores``
    under some tie-break: each query selects ``min(k, t + 1)`` admissible
    keys, and none of them scores below an unselected admissible key."""
    masked = _future_masked(scores)
    admissible = np.isfinite(masked)
    n_q, n_k = scores.shape
    counts = np.arange(n_q) + (n_k - n_q) + 1
    if (selection & ~admissible).any():
        return False
    if not (selection.sum(axis=-1) == np.minimum(k, counts)).all():
        return False
    lowest = np.where(selection, masked, np.inf).min(axis=-1)
    rest = np.where(admissible & ~selection, masked, -np.inf).max(axis=-1)
    return bool((lowest >= rest).all())


def _is_padded_with_future(selection, scores, k) -> bool:
    """Whether the boolean ``selection`` keeps every one of a top-k's slots,
    future keys included: each query selects exactly ``min(k, n_k)`` keys,
    its admissible part is a right causal top-k (:func:`_is_topk`, any
    tie-break), the extra keys all lie in the query's future, and at least
    one query has such extras. Whatever order the reader's sort put the
    future keys in, this is the mistake ``padded_with_future``."""
    admissible = np.isfinite(_future_masked(scores))
    extra = selection & ~admissible
    return (
        bool(extra.any())
        and bool((selection.sum(axis=-1) == min(k, scores.shape[1])).all())
        and _is_topk(selection & admissible, scores, k)
    )


def _is_zero_masked(selection, scores, k) -> bool:
    """Whether the boolean ``selection`` is :func:`_zero_masked`'s under
    some tie-break: no future key selected, and the selected keys with as
    many future keys (scored 0) as the query's ``min(k, n_k)`` slots leave
    over are a top-k of the scores with the future set to 0."""
    admissible = np.isfinite(_future_masked(scores))
    if (selection & ~admissible).any():
        return False
    filled = np.where(admissible, scores, 0.0)
    slots = min(k, scores.shape[1])
    for row, chosen in enumerate(selection):
        n_future = int((~admissible[row]).sum())
        spare = slots - int(chosen.sum())
        if not 0 <= spare <= n_future:
            return False
        # the future's zeros: `spare` of them taken, the rest left out
        lowest = min(filled[row][chosen], default=np.inf)
        highest = max(filled[row][admissible[row] & ~chosen], default=-np.inf)
        if spare:
            lowest = min(lowest, 0.0)
        if spare < n_future:
            highest = max(highest, 0.0)
        if lowest < highest:
            return False
    return True


def _is_zero_masked_capped(selection, scores, k) -> bool:
    """Whether the boolean ``selection`` is :func:`_zero_masked_capped`'s
    under some tie-break: each query selects ``min(k, t + 1)`` keys, a future
    key among them somewhere, and none of them scores below an unselected
    key once the future's scores are set to 0."""
    admissible = np.isfinite(_future_masked(scores))
    if not (selection & ~admissible).any():
        return False
    n_q, n_k = scores.shape
    counts = np.arange(n_q) + (n_k - n_q) + 1
    if not (selection.sum(axis=-1) == np.minimum(k, counts)).all():
        return False
    filled = np.where(admissible, scores, 0.0)
    lowest = np.where(selection, filled, np.inf).min(axis=-1)
    rest = np.where(~selection, filled, -np.inf).max(axis=-1)
    return bool((lowest >= rest).all())


class _AnyTieBreak:
    """The reader's ``fn(scores, k)`` (given numpy arrays, or torch tensors
    where it needs them: :class:`ArraysOrTensors`), whose boolean selection,
    when it is a right top-k under another tie-break than the reference's,
    is replaced by the reference's: where scores tie, any tie-break is
    right. A selection that pads a query's slots with future keys, in any
    order, is replaced by :func:`_padded_with_future`'s, and one that masks
    the future with 0, whatever its sort did with the zeros that tie, by
    :func:`_zero_masked`'s (or, where it kept the first min(k, t + 1)
    slots, :func:`_zero_masked_capped`'s), so that the diagnosis names the
    mistake whatever the reader's sort did with the scores that tie."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.inner = ArraysOrTensors(fn)

    def __call__(self, scores, k):
        before = np.array(scores, copy=True)
        out = self.inner(scores, k)
        got = _as_selection(out)
        if got.dtype == bool and got.shape == before.shape:
            if _is_topk(got, before, k):
                return _reference_topk(before, k)
            if _is_padded_with_future(got, before, k):
                return _padded_with_future(before, k)
            if _is_zero_masked(got, before, k):
                return _zero_masked(before, k)
            if _is_zero_masked_capped(got, before, k):
                return _zero_masked_capped(before, k)
        return out


def check_causal_topk(fn) -> None:
    """Check ``fn(scores, k)`` returns the boolean selection (n_q, n_k): for
    each query (the last n_q of the n_k positions) the ``min(k, t + 1)`` keys
    of largest score among those at or before it, ties broken any way.

    scores: a float64 numpy array (n_q, n_k); a function that fails on arrays
    is given torch tensors instead, where torch is installed
    (:class:`ArraysOrTensors`). The selection may be a numpy array or a torch
    tensor."""
    run_checks(
        "the indexer's causal top-k",
        _AnyTieBreak(fn),
        topk_cases(),
        _reference_topk,
        TOPK_MISTAKES,
        compare=same_mask,
        postprocess=_as_selection,
        describe=describe_mask,
    )


# --- block-sparse attention that skips tiles (hard) --------------------------


def _reference_tiled(q, k, v, mask_mod, tile):
    """The package's answer: :func:`attnbook.sparse.flex.block_mask` lists
    the tiles, :func:`attnbook.sparse.flex.block_sparse_attend` reads them;
    the tiles visited are the partial ones and the full ones."""
    from ..sparse import flex

    n_q, n_k = q.shape[0], k.shape[0]
    blocks = flex.block_mask(mask_mod, None, None, n_q, n_k, tile)
    out = flex.block_sparse_attend(
        q[None, None], k[None, None], v[None, None], blocks, mask_mod
    )[0, 0]
    full = blocks.full_kv_num_blocks
    visited = int(blocks.kv_num_blocks.sum()) + (
        0 if full is None else int(full.sum())
    )
    return out.numpy(), visited


def _tiled(
    q,
    k,
    v,
    mask_mod,
    tile,
    *,
    mask_partial=True,
    skip_empty=True,
    ragged=True,
    ragged_keys=None,
    guard_empty_rows=True,
    guard_division=None,
    rescale=True,
    running_max=True,
    max_from_zero=False,
    count_full=True,
    corners=False,
    score_empty=False,
    scale=None,
):
    """A tile loop with an online softmax (chapter 9), each flag a step that
    a mistake leaves out (``guard_division`` None: as ``guard_empty_rows``;
    ``ragged_keys`` None: as ``ragged``; ``corners``: a tile judged empty by
    its four corners alone; ``score_empty``: every tile's scores computed
    before the test; ``running_max``: False to exponentiate the raw scores,
    with no maximum subtracted; ``max_from_zero``: the running maximum
    started at 0, not -inf; ``scale``: the scores' factor, None for 1 /
    sqrt(d))."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if scale is None:
        scale = 1 / np.sqrt(q.shape[1])
    n_q, n_k = q.shape[0], k.shape[0]
    stop_q = n_q if ragged else n_q - n_q % tile
    ragged_keys = ragged if ragged_keys is None else ragged_keys
    stop_k = n_k if ragged_keys else n_k - n_k % tile
    out = np.zeros((n_q, v.shape[1]))
    visited = 0
    for i in range(0, stop_q, tile):
        rows = np.arange(i, min(i + tile, n_q))
        m = np.full(len(rows), 0.0 if max_from_zero else -np.inf)
        ell = np.zeros(len(rows))
        acc = np.zeros((len(rows), v.shape[1]))
        for j in range(0, stop_k, tile):
            cols = np.arange(j, min(j + tile, n_k))
            if score_empty:
                scores = q[rows] @ k[cols].T * scale
            if corners:
                ends_q = torch.as_tensor(rows[[0, 0, -1, -1]])
                ends_k = torch.as_tensor(cols[[0, -1, 0, -1]])
                if not mask_mod(0, 0, ends_q, ends_k).any():
                    continue
            allowed = mask_mod(
                0, 0, torch.as_tensor(rows)[:, None], torch.as_tensor(cols)
            ).numpy()
            if skip_empty and not allowed.any():
                continue
            visited += 1 if count_full or not allowed.all() else 0
            if score_empty:
                s = scores
            else:
                s = q[rows] @ k[cols].T * scale
            if mask_partial and not allowed.all():
                s = np.where(allowed, s, -np.inf)
            m_new = np.maximum(m, s.max(axis=1))
            if not running_max:
                # exp of the raw scores: exp(-inf) is 0, exp(> 709.78) inf
                p = np.exp(s)
                ell = ell + p.sum(axis=1)
                acc = acc + p @ v[cols]
                continue
            if guard_empty_rows:
                shift = np.where(np.isfinite(m_new), m_new, 0.0)
                p = np.exp(s - shift[:, None])
                old = np.where(np.isfinite(m), np.exp(m - shift), 0.0)
            else:
                p = np.exp(s - m_new[:, None])
                old = np.exp(m - m_new)
            if not rescale:
                old = np.ones_like(old)
            ell = old * ell + p.sum(axis=1)
            acc = old[:, None] * acc + p @ v[cols]
            m = m_new
        if guard_empty_rows if guard_division is None else guard_division:
            out[rows] = acc / np.where(ell > 0, ell, 1.0)[:, None]
        else:
            out[rows] = acc / ell[:, None]
    return out, visited


def _partial_unmasked(q, k, v, mask_mod, tile):
    return _tiled(q, k, v, mask_mod, tile, mask_partial=False)


def _empty_visited(q, k, v, mask_mod, tile):
    return _tiled(q, k, v, mask_mod, tile, skip_empty=False)


def _ragged_dropped(q, k, v, mask_mod, tile):
    return _tiled(q, k, v, mask_mod, tile, ragged=False)


def _ragged_key_tile_dropped(q, k, v, mask_mod, tile):
    return _tiled(q, k, v, mask_mod, tile, ragged_keys=False)


def _nan_rows(q, k, v, mask_mod, tile):
    return _tiled(q, k, v, mask_mod, tile, guard_empty_rows=False)


def _nan_rows_division(q, k, v, mask_mod, tile):
    # the shift guarded, the division not: NaN only in the rows that may read
    # no key at all
    return _tiled(q, k, v, mask_mod, tile, guard_division=False)


def _not_rescaled(q, k, v, mask_mod, tile):
    return _tiled(q, k, v, mask_mod, tile, rescale=False)


def _no_running_max(q, k, v, mask_mod, tile):
    # inf, and inf / inf = NaN, on purpose: no warning
    with np.errstate(over="ignore", invalid="ignore"):
        return _tiled(q, k, v, mask_mod, tile, running_max=False)


def _max_from_zero(q, k, v, mask_mod, tile):
    return _tiled(q, k, v, mask_mod, tile, max_from_zero=True)


def _count_partial_only(q, k, v, mask_mod, tile):
    return _tiled(q, k, v, mask_mod, tile, count_full=False)


def _unscaled(q, k, v, mask_mod, tile):
    return _tiled(q, k, v, mask_mod, tile, scale=1.0)


def _scaled_by_d(q, k, v, mask_mod, tile):
    return _tiled(q, k, v, mask_mod, tile, scale=1 / q.shape[1])


def _corners_only(q, k, v, mask_mod, tile):
    return _tiled(q, k, v, mask_mod, tile, corners=True)


TILED_MISTAKES = [
    Mistake(
        "partial_unmasked",
        "partial tiles are read without their mask: a query reads the "
        "masked keys of every tile it visits",
        "in a tile that is neither empty nor full, set the scores of the "
        "pairs the mask_mod forbids to -inf before the tile's maximum",
        _partial_unmasked,
    ),
    Mistake(
        "empty_visited",
        "empty tiles are visited too: the output is right but the count of "
        "tiles visited is every tile's",
        "evaluate the mask_mod on the tile first and skip it (no scores, no "
        "count) when it allows no pair",
        _empty_visited,
    ),
    Mistake(
        "ragged_dropped",
        "the last, shorter tile is dropped (range(n // tile)): the last "
        "queries get 0 and the last keys are never read",
        "loop over range(0, n, tile) and cut each tile at n "
        "(min(start + tile, n))",
        _ragged_dropped,
    ),
    Mistake(
        "ragged_dropped",
        "the last, shorter key tile is dropped (the key loop stops at "
        "n_k - n_k % tile): the queries are all there, but the last keys are "
        "never read",
        "loop over range(0, n_k, tile) and cut each key tile at n_k "
        "(min(start + tile, n_k))",
        _ragged_key_tile_dropped,
    ),
    Mistake(
        "nan_rows",
        "a query that may read no key gets NaN (0 / 0, or exp(-inf - "
        "(-inf))), where the book's convention gives 0",
        "shift by 0 where the running maximum is still -inf, and divide by "
        "the sum only where it is positive (the output stays 0)",
        _nan_rows,
    ),
    Mistake(
        "nan_rows",
        "a query that may read no key gets NaN: its sums stay 0 and 0 / 0 is "
        "NaN, where the book's convention gives 0",
        "divide by the sum only where it is positive (the output stays 0)",
        _nan_rows_division,
    ),
    Mistake(
        "not_rescaled",
        "the running sum and output are not rescaled when a later tile "
        "raises the maximum: the tiles are mixed with different shifts",
        "when the maximum grows from m to m', multiply the sum and the "
        "accumulated output by exp(m - m') before adding the new tile "
        "(chapter 9's online softmax)",
        _not_rescaled,
    ),
    Mistake(
        "no_running_max",
        "the scores are exponentiated as they are, with no running maximum "
        "subtracted: exp overflows once a score passes about 709 in float64 "
        "(88 in float32), and inf / inf is NaN",
        "keep a running maximum m per query, exponentiate s - m, and rescale "
        "the sum and the output by exp(m - m') when the maximum grows "
        "(chapter 9's online softmax)",
        _no_running_max,
    ),
    Mistake(
        "running_max_from_zero",
        "the running maximum starts at 0 instead of -inf: a row whose every "
        "allowed score lies below about -745 (float64) is shifted by 0, each "
        "exp(s - 0) underflows to 0, and the row's output comes out 0 instead "
        "of the weighted mean of its values",
        "start the running maximum at -inf (np.full(rows, -np.inf)), so that "
        "the first tile's own maximum becomes the shift; guard only a row "
        "that has seen no key yet",
        _max_from_zero,
    ),
    Mistake(
        "partial_count_only",
        "only the partial tiles are counted: the full tiles are read but "
        "not counted",
        "count every tile you read, full and partial",
        _count_partial_only,
    ),
    Mistake(
        "wrong_scale",
        "the scores are not divided by sqrt(d): the softmax is too sharp",
        "scale each tile's scores q k^T by 1 / sqrt(d), d the width of q",
        _unscaled,
    ),
    Mistake(
        "wrong_scale",
        "the scores are divided by d, not sqrt(d): the softmax is too flat",
        "scale each tile's scores q k^T by 1 / sqrt(d), d the width of q",
        _scaled_by_d,
    ),
    Mistake(
        "corners_only",
        "a tile is judged empty by its four corners: where the mask forbids "
        "the corners but allows pairs inside (a document with padding on "
        "both sides of it, within one tile), the tile is skipped",
        "evaluate the mask_mod on every pair of the tile (rows[:, None], "
        "cols[None, :]) and skip it only when none is allowed: the corners "
        "decide only for masks such as causal or a window",
        _corners_only,
    ),
]


def _sliding(window):
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return mask_mod


def _packed_with_padding(doc_ids):
    """Causal within each document; a position labelled -1 (padding)
    reads nothing."""
    doc_ids = torch.as_tensor(doc_ids)

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_ids[q_idx] == doc_ids[kv_idx]
        return same & (kv_idx <= q_idx) & (doc_ids[q_idx] >= 0)

    return mask_mod


def _decoding_causal(n_q, n_k):
    """Causal for the last n_q of n_k positions."""

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + (n_k - n_q)

    return mask_mod


def _every_key(b, h, q_idx, kv_idx):
    # of both indices, so that it is a mask of the tile's shape
    return (kv_idx >= 0) & (q_idx >= 0)


def tiled_cases() -> list[Case]:
    rng = np.random.default_rng(3)

    def qkv(n_q, n_k, d, spread=2.0):
        return tuple(
            torch.as_tensor(rng.normal(scale=spread, size=(n, d)))
            for n in (n_q, n_k, n_k)
        )

    def large_scores(n=37, d=4):
        # queries and keys of spread 20: scores q.k / sqrt(d) of spread
        # about 400, the largest near 1e3; values of spread 1. Then the first
        # tile of queries and keys is set to -30 and +30 in every channel:
        # queries 0-7 score -1800 against every key they may read, so exp
        # underflows unless each row is shifted by its own maximum
        q, k, v = (rng.normal(scale=s, size=(n, d)) for s in (20.0, 20.0, 1.0))
        q[:8], k[:8] = -30.0, 30.0
        return tuple(torch.as_tensor(x) for x in (q, k, v))

    # the third document sits inside the tile of positions 40-47, with
    # padding on both sides of it: the tile's four corners are all masked
    docs = [0] * 11 + [1] * 17 + [-1] * 13 + [2] * 6 + [-1] * 3
    return [
        Case(
            "causal, 37 positions, tiles of 8 (the last one 5 long)",
            (*qkv(37, 37, 4), _sliding(37), 8),
        ),
        Case(
            "a sliding window of 6, 45 positions, tiles of 8",
            (*qkv(45, 45, 3), _sliding(6), 8),
        ),
        Case(
            "packed documents 11, 17 and 6, with 13 of padding (which reads "
            "nothing) before the third and 3 after it: the third lies inside "
            "one tile of 8",
            (*qkv(50, 50, 4), _packed_with_padding(docs), 8),
        ),
        Case(
            "20 queries, the last of 45 keys (decoding), causal, tiles of 16",
            (*qkv(20, 45, 5), _decoding_causal(20, 45), 16),
        ),
        Case(
            "no mask, 30 positions, tiles of 8 (every tile full)",
            (*qkv(30, 30, 4), _every_key, 8),
        ),
        Case(
            "a sliding window of 3, 19 positions, tiles of 16",
            (*qkv(19, 19, 2, spread=4.0), _sliding(3), 16),
        ),
        Case(
            "causal, 37 positions, tiles of 8, scores up to about 1e3 (exp "
            "of such a score overflows, even in float64), and queries 0-7 "
            "scoring -1800 against every key they may read (exp of such a "
            "score underflows to 0)",
            (*large_scores(), _sliding(37), 8),
        ),
    ]


def _as_tiled(out):
    """The reader's ``(output, tiles)`` as ``(float64 array, int)``."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(
            f"return a pair (output, tiles visited); got {type(out).__name__}"
        )
    o, n = out
    o = np.asarray(o.detach().cpu() if hasattr(o, "detach") else o)
    n = n.item() if hasattr(n, "item") else n
    return o.astype(np.float64), int(n)


def _same_tiled(got, expected) -> bool:
    (o, n), (e, m) = got, expected
    return (
        n == m
        and o.shape == e.shape
        and bool(np.allclose(o, e, rtol=1e-4, atol=1e-5, equal_nan=True))
    )


def _describe_tiled(got, expected, case=None) -> str:
    (o, n), (e, m) = got, expected
    parts = []
    if n != m:
        parts.append(f"you visited {n} tiles; the mask needs {m}")
    if o.shape != e.shape:
        parts.append(f"the output's shape is {o.shape}, not {e.shape}")
    elif not np.allclose(o, e, rtol=1e-4, atol=1e-5):
        bad = np.nonzero(~np.isclose(o, e, rtol=1e-4, atol=1e-5).all(-1))[0]
        what = "NaN" if np.isnan(o[bad]).any() else "wrong"
        parts.append(
            f"the output is {what} in {len(bad)} of {len(e)} rows (the "
            f"first: query {bad[0]})"
        )
    return "; ".join(parts) or "the output differs"


# The geometry of the work and memory checks: a sliding window of one tile,
# so that of the (n / tile)^2 tiles the mask leaves 2 n / tile - 1 non-empty
# (63 of 1024); d = 2 keeps the output (n d 8 bytes, 32 KiB) small beside a
# strip of a query tile against every key.
WORK_N, WORK_D, WORK_TILE = 2048, 2, 64


def _work_inputs(n: int = WORK_N, d: int = WORK_D):
    rng = np.random.default_rng(5)
    return tuple(torch.as_tensor(rng.normal(size=(n, d))) for _ in range(3))


def _tensors(x):
    """The tensors in ``x``, a tensor or nested tuples, lists and dicts."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for item in x:
            yield from _tensors(item)
    elif isinstance(x, dict):
        for item in x.values():
            yield from _tensors(item)


def _new_float_bytes(out, inputs) -> int:
    """The bytes of the floating-point tensors in ``out`` that share no
    storage with a tensor of ``inputs`` (views and in-place results left
    out)."""
    try:
        shared = {t.untyped_storage().data_ptr() for t in _tensors(inputs)}
        return sum(
            t.numel() * t.element_size()
            for t in _tensors(out)
            if t.is_floating_point()
            and t.untyped_storage().data_ptr() not in shared
        )
    except (RuntimeError, NotImplementedError):
        # a tensor without a storage (a functorch wrapper): not counted
        return 0


def _index_bytes(*indices) -> int:
    """The bytes of the index arrays (or tensors) a mask_mod is given."""
    return sum(
        int(x.nbytes)
        if isinstance(x, np.ndarray)
        else x.numel() * x.element_size()
        for x in indices
        if isinstance(x, (np.ndarray, torch.Tensor))
    )


# The functions whose result is a product of their inputs: the scores, when
# one input comes from the keys.
PRODUCTS = frozenset(
    {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "einsum", "dot"}
    | {"inner", "tensordot", "mv", "addmm", "baddbmm", "linear"}
)


class _KeyArray(np.ndarray):
    """A NumPy array computed from the keys (``k.numpy()`` under
    :func:`_watch_tile_work`): slicing, indexing and arithmetic keep the
    class, and a product with it (``@``, ``np.dot``, ``np.einsum``) adds the
    elements of its result to the current stretch's count of scores."""

    counter: dict | None = None

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = [
            x.view(np.ndarray) if isinstance(x, _KeyArray) else x
            for x in inputs
        ]
        if "out" in kwargs:
            kwargs["out"] = tuple(
                x.view(np.ndarray) if isinstance(x, _KeyArray) else x
                for x in kwargs["out"]
            )
        out = getattr(ufunc, method)(*plain, **kwargs)
        if ufunc is np.matmul and _KeyArray.counter is not None:
            _KeyArray.counter["scores"] += int(np.size(out))
        if isinstance(out, np.ndarray) and not isinstance(out, _KeyArray):
            return out.view(_KeyArray)
        return out

    def __array_function__(self, func, types, args, kwargs):
        out = super().__array_function__(func, types, args, kwargs)
        if func.__name__ in PRODUCTS and _KeyArray.counter is not None:
            _KeyArray.counter["scores"] += int(np.size(out))
        return out


def _watch_tile_work(fn, q, k, v, mask_mod, tile):
    """Run ``fn(q, k, v, mask_mod, tile)`` with the checker's ``mask_mod``
    wrapped; return ``(pairs, work, scores)``: the number of pairs of each
    call of the mask_mod, and for each stretch of the reader's code between
    two calls (and before the first and after the last) the bytes it
    allocated and the scores it computed (None for every stretch when no
    product of the keys was seen).

    Scores are counted, not guessed: every tensor computed from ``k``
    (indexed, sliced, cast, transposed) is followed, through a
    :class:`torch.overrides.TorchFunctionMode`, and so is the array that
    ``.numpy()``, ``np.asarray`` or ``np.array`` makes of one (a
    :class:`_KeyArray`: ``np.asarray`` would return a plain array, so
    :data:`numpy.asarray` and :data:`numpy.array` are wrapped while ``fn``
    runs); a product of one of them (``@``, ``matmul``, ``einsum``, ``bmm``,
    ``np.dot``) adds the elements of its result. An answer whose keys leave
    torch otherwise (``k.tolist()``) is not followed, and its work is judged
    by bytes: a
    stretch's bytes are the larger of numpy's, :mod:`tracemalloc`'s peak
    above the stretch's start less the bytes of the indices that the call
    ending it was given, and torch's, the floating-point tensors computed
    (views and in-place results left out). The mask_mod's own work is not
    counted. Counted bytes and elements, not time: the same on a busy
    machine."""
    import tracemalloc
    import weakref

    from torch.overrides import TorchFunctionMode

    state = {"inside": False, "start": 0, "torch": 0, "scores": 0}
    pairs, work, scores = [], [], []
    from_keys = {}  # id -> weakref of the tensors computed from k

    def derived(t) -> bool:
        ref = from_keys.get(id(t))
        return ref is not None and ref() is t

    def follow(t) -> None:
        try:
            from_keys[id(t)] = weakref.ref(t)
        except TypeError:
            pass

    def end_stretch(index_bytes):
        _, peak = tracemalloc.get_traced_memory()
        numpy_bytes = peak - state["start"] - index_bytes
        work.append(max(numpy_bytes, state["torch"]))
        scores.append(state["scores"])

    def start_stretch():
        tracemalloc.reset_peak()
        state["start"] = tracemalloc.get_traced_memory()[0]
        state["torch"] = 0
        state["scores"] = 0

    def watched(b, h, q_idx, kv_idx):
        end_stretch(_index_bytes(q_idx, kv_idx))
        state["inside"] = True
        try:
            allowed = mask_mod(b, h, q_idx, kv_idx)
        finally:
            state["inside"] = False
        pairs.append(int(np.prod(getattr(allowed, "shape", ()))))
        start_stretch()
        return allowed

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if state["inside"]:
                return out
            state["torch"] += _new_float_bytes(out, (args, kwargs))
            if not any(derived(t) for t in _tensors((args, kwargs))):
                return out
            name = getattr(func, "__name__", "")
            if name in PRODUCTS:
                state["scores"] += sum(t.numel() for t in _tensors(out))
            if name in ("numpy", "__array__") and isinstance(out, np.ndarray):
                return out.view(_KeyArray)
            for t in _tensors(out):
                follow(t)
            return out

    def keeping_keys(convert):
        # np.asarray(k) asks the tensor for an array (__array__, a
        # _KeyArray above), then returns a plain view of it: keep the class
        @functools.wraps(convert)
        def converted(a, *args, **kwargs):
            out = convert(a, *args, **kwargs)
            from_k = isinstance(a, _KeyArray) or (
                isinstance(a, torch.Tensor) and derived(a)
            )
            if from_k and type(out) is np.ndarray:
                return out.view(_KeyArray)
            return out

        return converted

    conversions = {name: getattr(np, name) for name in ("asarray", "array")}
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    _KeyArray.counter = state
    follow(k)
    try:
        for name, convert in conversions.items():
            setattr(np, name, keeping_keys(convert))
        with Watch():
            start_stretch()
            fn(q, k, v, watched, tile)
            end_stretch(0)
    finally:
        for name, convert in conversions.items():
            setattr(np, name, convert)
        _KeyArray.counter = None
        if not tracing:
            tracemalloc.stop()
    if not any(scores):
        scores = None
    return pairs, work, scores


def _check_tiled_work(fn) -> None:
    """Reject an answer that does the work of the tiles it says it skips,
    measured, not taken from the count it returns: at n = 2048 with a window
    of one tile of 64, where 63 of the 1024 tiles are non-empty.

    - A mask_mod evaluated on more pairs than a tile's at once: a strip of
      a query tile against every key, or the whole n x n mask.
    - Scores computed for the empty tiles: a right answer computes no scores
      between the evaluation of an empty tile's mask and the next
      evaluation; one that scores every tile computes a tile's there. Where
      the scores are counted (:func:`_watch_tile_work`: products of the
      keys, in torch or in the arrays ``.numpy()``, ``np.asarray`` and
      ``np.array`` make of them), an answer that computes half a tile of
      scores (tile^2 / 2) or more after more than half of its evaluations,
      before the next one or its end, is rejected; a right one does so after
      the 63 non-empty tiles'. Where they are not (keys that left torch by
      another route, ``k.tolist()``), bytes stand in for them: 3 tile^2
      bytes or more allocated (a tile of float32 scores takes 4 tile^2), so
      that there a float copy of a mask tile counts as scores, and the
      diagnosis says so (:data:`EMPTY_SCORED_BY_BYTES`)."""
    from ..bench import format_bytes
    from ._framework import ExerciseError, pristine

    __tracebackhide__ = True
    n, tile = WORK_N, WORK_TILE
    inputs = _work_inputs()
    pairs, work, scores = _watch_tile_work(
        fn, *pristine(inputs), _sliding(tile), tile
    )
    case = f"{n} positions, a window of {tile}, tiles of {tile} (work)"
    largest = max(pairs, default=0)
    if largest > tile * tile:
        raise ExerciseError(
            "block-sparse attention that skips tiles",
            case,
            f"your function evaluated the mask_mod on {largest} pairs at "
            f"once, where a tile holds {tile * tile}",
            mistake=DENSE_MISTAKES[0] if largest >= n * n else STRIP_MISTAKE,
        )
    tiles, needed = (n // tile) ** 2, 2 * (n // tile) - 1
    # [0] is the stretch before the first evaluation
    if scores is not None:
        scored = sum(s >= tile * tile // 2 for s in scores[1:])
        what = f"computed {tile * tile // 2} scores or more"
        mistake = EMPTY_SCORED_MISTAKE
    else:
        scored = sum(w >= 3 * tile * tile for w in work[1:])
        dtype = str(inputs[1].dtype).removeprefix("torch.")
        score_tile = format_bytes(inputs[1].element_size() * tile * tile)
        what = (
            f"allocated {format_bytes(3 * tile * tile)} or more (a tile of "
            f"scores takes {score_tile} in {dtype}, the inputs' dtype; your "
            "keys left torch other than by .numpy(), np.asarray or np.array, "
            "so the checker counted bytes, not scores)"
        )
        mistake = EMPTY_SCORED_BY_BYTES
    if scored > tiles // 2:
        raise ExerciseError(
            "block-sparse attention that skips tiles",
            case,
            f"your function evaluated the mask_mod {len(pairs)} times, and "
            f"after {scored} of those evaluations it {what} before the next "
            f"one (or its return); the mask leaves only {needed} of the "
            f"{tiles} tiles non-empty",
            mistake=mistake,
        )


def _check_tiled_memory(fn) -> None:
    """Reject an answer that holds a strip of a query tile against every key,
    or the whole n x n: at n = 2048 and d = 2 with tiles of 64, under a
    window of one tile and then under a causal mask, the peak (tracemalloc
    and torch's profiler, :func:`peak_memory_with_torch`) may not exceed
    three quarters of a strip of float32 scores, 3 n tile bytes (384 KiB).
    A strip of scores takes 512 KiB in float32 and 1 MiB in float64, the
    n x n boolean mask 4 MiB; a right answer holds the output (n d 8 bytes,
    32 KiB), perhaps float32 copies of the inputs, and a few tiles of scores
    (8 tile^2 bytes each, 32 KiB): the book's, 173 KiB. Under the window a
    query tile has at most two non-empty key tiles, so that an answer that
    gathers them all and takes one softmax holds two tiles; under the causal
    mask the last query tile has 32, and the same answer holds a strip."""
    from ..bench import format_bytes
    from ._framework import ExerciseError, peak_memory_with_torch

    __tracebackhide__ = True
    n, tile = WORK_N, WORK_TILE
    q, k, v = _work_inputs()
    for name, mask_mod in (
        (f"a window of {tile}", _sliding(tile)),
        ("causal", _sliding(n)),
    ):
        _, peak = peak_memory_with_torch(fn, q, k, v, mask_mod, tile)
        if peak <= 3 * n * tile:
            continue
        # under the causal mask, an answer that passed the window's check
        # holds what grows with the keys of a query tile: a strip
        dense = name != "causal" and peak >= n * n
        raise ExerciseError(
            "block-sparse attention that skips tiles",
            f"{n} positions, {name}, tiles of {tile} (memory)",
            f"your function's peak memory was {format_bytes(peak)}, where "
            f"one tile's scores take {format_bytes(8 * tile * tile)} and a "
            "strip of a query tile against every key "
            f"{format_bytes(8 * tile * n)}",
            mistake=DENSE_MISTAKES[0] if dense else STRIP_MISTAKE,
        )


def _dense_then_tiled(q, k, v, mask_mod, tile):
    """The whole mask evaluated at once, then tiled: right, but n x n."""
    n_q, n_k = q.shape[0], k.shape[0]
    whole = mask_mod(
        0, 0, torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    ).numpy()

    def from_whole(b, h, q_idx, kv_idx):
        return torch.as_tensor(whole[q_idx.numpy(), kv_idx.numpy()])

    return _tiled(q, k, v, from_whole, tile)


def _strip_then_tiled(q, k, v, mask_mod, tile):
    """The mask of a query tile against every key evaluated at once, then
    cut into tiles: right, but tile x n at a time."""
    n_q, n_k = q.shape[0], k.shape[0]
    strips = {}

    def from_strip(b, h, q_idx, kv_idx):
        start = int(q_idx.min())
        if start not in strips:
            rows = torch.arange(start, min(start + tile, n_q))
            strips[start] = mask_mod(
                0, 0, rows[:, None], torch.arange(n_k)[None, :]
            ).numpy()
        strip = strips[start]
        return torch.as_tensor(strip[q_idx.numpy() - start, kv_idx.numpy()])

    return _tiled(q, k, v, from_strip, tile)


def _empty_scored(q, k, v, mask_mod, tile):
    """Every tile's scores computed before the test; the empty ones thrown
    away and not counted: the output and the count right, nothing saved."""
    return _tiled(q, k, v, mask_mod, tile, score_empty=True)


DENSE_MISTAKES = [
    Mistake(
        "dense_mask",
        "an array of n x n is built (the mask, the scores or their "
        "indices): what skipping tiles saves",
        "evaluate the mask_mod on one tile at a time (mask_mod(0, 0, "
        "rows[:, None], cols[None, :]) for the tile's rows and columns), "
        "never on every pair at once",
        _dense_then_tiled,
    ),
    Mistake(
        "strip",
        "a strip is built at once, a query tile against every key (the "
        "mask_mod evaluated on it, its scores, or the scores of every "
        "non-empty key tile gathered for one softmax): tile x n pairs under "
        "a causal mask, where skipping needs one tile of tile x tile at a "
        "time",
        "loop over the key tiles inside each query tile, evaluate the "
        "mask_mod and the scores of one tile at a time, and merge the tiles "
        "with chapter 9's online softmax (a running maximum, sum and output) "
        "instead of one softmax over them all",
        _strip_then_tiled,
    ),
    Mistake(
        "empty_scored",
        "the scores of every tile are computed, and those of the empty tiles "
        "thrown away after the test: the count of tiles visited is right, "
        "but skipping saves nothing",
        "evaluate the tile's mask first, and compute a tile's scores only "
        "once it has proved non-empty",
        _empty_scored,
    ),
]
STRIP_MISTAKE, EMPTY_SCORED_MISTAKE = DENSE_MISTAKES[1:]
# The same mistake where the checker could only count bytes: it cannot tell a
# tile of scores from a float copy of a mask tile of the same size.
EMPTY_SCORED_BY_BYTES = Mistake(
    "empty_scored",
    "a tile's worth of memory is allocated after nearly every evaluation of "
    "the mask_mod, empty tiles included: either the scores of every tile "
    "are computed and those of the empty tiles thrown away, or a float copy "
    "of each mask tile is made (its .mean(), say), which the checker, "
    "counting bytes, cannot tell from scores",
    "compute a tile's scores only once its mask has proved non-empty; test "
    "the mask with .any() and .all(), which make no float copy; and turn "
    "the keys into an array with .numpy() or np.asarray, so that the "
    "checker counts the scores themselves",
    _empty_scored,
)


def check_tiled_sparse_attention(fn) -> None:
    """Check ``fn(q, k, v, mask_mod, tile)`` returns ``(output, tiles)``:
    attention of the queries q (n_q, d) over the keys k and values v (n_k,
    d) that ``mask_mod(b, h, q_idx, kv_idx)`` allows (the queries at
    positions 0..n_q-1, as FlexAttention numbers them), visiting only the
    (query tile, key tile) pairs of ``tile`` x ``tile`` that the mask does
    not empty, and the number of tiles visited. q, k, v are float64 torch
    tensors; the output may be a tensor or an array (n_q, d); a query that
    may read no key gets 0. The reference is the package's
    :func:`attnbook.sparse.flex.block_mask` and
    :func:`attnbook.sparse.flex.block_sparse_attend`. Then, at n = 2048
    with a window of one tile of 64, the work is measured rather than read
    from the count (:func:`_check_tiled_work`: the mask_mod evaluated on one
    tile at a time, the empty tiles not scored), and the peak memory, there
    and under a causal mask, must stay below three quarters of a strip of
    float32 scores (:func:`_check_tiled_memory`)."""
    run_checks(
        "block-sparse attention that skips tiles",
        fn,
        tiled_cases(),
        _reference_tiled,
        TILED_MISTAKES,
        compare=_same_tiled,
        postprocess=_as_tiled,
        describe=_describe_tiled,
        quiet=True,
    )
    _check_tiled_work(fn)
    _check_tiled_memory(fn)
    print(
        "Correct: block-sparse attention that skips tiles passes all "
        f"{len(tiled_cases())} cases and never holds an n x n array."
    )
