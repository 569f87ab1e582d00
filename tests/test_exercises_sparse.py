"""The sparse-attention checkers reject each classic mistake and pass correct
solutions.

The wrong solutions are written here independently of the checkers' Mistake
functions, the way a reader might write them: helper functions, torch's
topk, loops, numpy.
"""

import math

import numpy as np
import pytest
import torch

from attnbook.exercises import ExerciseError
from attnbook.exercises.sparse import (
    check_causal_topk,
    check_packed_sliding_mask_mod,
    check_tiled_sparse_attention,
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


def packed_sliding_capped(doc_ids, window):
    """A window capped at 8 keys: right while every window that cuts is
    narrower than 8 (expert reading sp14d: accepted then)."""
    docs = torch.as_tensor(doc_ids)
    width = min(window, 8)

    def mask_mod(b, h, q_idx, kv_idx):
        same = docs[q_idx] == docs[kv_idx]
        return same & (kv_idx <= q_idx) & (q_idx - kv_idx < width)

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


def topk_zero_then_first_slots(scores, k):
    """Wrong: the future set to 0 before torch's topk, then the first
    min(k, t + 1) slots kept; a 0 outranks a negative score and takes a
    slot (reading stud131415)."""
    s = torch.as_tensor(scores)
    n_q, n_k = s.shape
    t = torch.arange(n_k - n_q, n_k)
    future = torch.arange(n_k)[None, :] > t[:, None]
    idx = s.masked_fill(future, 0.0).topk(k, dim=-1).indices
    out = torch.zeros(n_q, n_k, dtype=torch.bool)
    for row in range(n_q):
        out[row, idx[row, : min(k, int(t[row]) + 1)]] = True
    return out


def topk_unmasked_first_slots(scores, k):
    """Wrong: numpy's argsort of the unmasked scores, then the first
    min(k, t + 1) keys kept: the right count, the future's keys among
    them (reading stud131415)."""
    n_q, n_k = scores.shape
    order = np.argsort(-scores, axis=-1)
    out = np.zeros((n_q, n_k), dtype=bool)
    for row in range(n_q):
        t = row + n_k - n_q
        out[row, order[row, : min(k, t + 1)]] = True
    return out


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


# --- block-sparse attention that skips tiles ---------------------------------


def tiles_numpy(q, k, v, mask_mod, tile):
    """Query tiles outside, key tiles inside, numpy float64."""
    q, k, v = q.numpy(), k.numpy(), v.numpy()
    n_q, n_k = len(q), len(k)
    out = np.zeros((n_q, v.shape[1]))
    visited = 0
    for i in range(0, n_q, tile):
        rows = np.arange(i, min(i + tile, n_q))
        m = np.full(len(rows), -np.inf)
        total = np.zeros(len(rows))
        acc = np.zeros((len(rows), v.shape[1]))
        for j in range(0, n_k, tile):
            cols = np.arange(j, min(j + tile, n_k))
            ok = mask_mod(
                0, 0, torch.as_tensor(rows)[:, None], torch.as_tensor(cols)
            ).numpy()
            if not ok.any():
                continue
            visited += 1
            s = q[rows] @ k[cols].T / np.sqrt(q.shape[1])
            if not ok.all():
                s = np.where(ok, s, -np.inf)
            new = np.maximum(m, s.max(axis=1))
            safe = np.where(np.isfinite(new), new, 0.0)
            a = np.exp(m - safe)
            p = np.exp(s - safe[:, None])
            total = a * total + p.sum(axis=1)
            acc = a[:, None] * acc + p @ v[cols]
            m = new
        out[rows] = acc / np.where(total > 0, total, 1.0)[:, None]
    return out, visited


def tiles_torch_keys_outside(q, k, v, mask_mod, tile):
    """Key tiles outside, query tiles inside, in torch float32: one running
    (max, sum, output) per query, merged by log-sum-exp."""
    q, k, v = q.float(), k.float(), v.float()
    n_q, n_k = q.shape[0], k.shape[0]
    lse = torch.full((n_q,), float("-inf"))
    out = torch.zeros(n_q, v.shape[1])
    visited = 0
    for j in range(0, n_k, tile):
        cols = torch.arange(j, min(j + tile, n_k))
        for i in range(0, n_q, tile):
            rows = torch.arange(i, min(i + tile, n_q))
            ok = mask_mod(0, 0, rows[:, None], cols[None, :])
            ok = ok.expand(len(rows), len(cols))
            if not ok.any():
                continue
            visited += 1
            s = (q[rows] @ k[cols].T) / q.shape[1] ** 0.5
            s = s.masked_fill(~ok, float("-inf"))
            tile_lse = torch.logsumexp(s, dim=1)
            w = torch.softmax(s, dim=1).nan_to_num(0.0)
            merged = torch.logaddexp(lse[rows], tile_lse)
            safe = torch.where(torch.isfinite(merged), merged, 0.0)
            out[rows] = (lse[rows] - safe).exp()[:, None] * out[rows] + (
                tile_lse - safe
            ).exp()[:, None] * (w @ v[cols])
            lse[rows] = merged
    return out, visited


def _slipped(q, k, v, mask_mod, tile, slip):
    """A reader's tile loop in torch, with one slip."""
    n_q, n_k = q.shape[0], k.shape[0]
    last_q = n_q // tile * tile if slip == "floor" else n_q
    last_k = n_k // tile * tile if slip in ("floor", "key floor") else n_k
    out = torch.zeros(n_q, v.shape[1], dtype=q.dtype)
    tiles = 0
    for i in range(0, last_q, tile):
        rows = torch.arange(i, min(i + tile, n_q))
        best = torch.full((len(rows),), float("-inf"), dtype=q.dtype)
        denom = torch.zeros(len(rows), dtype=q.dtype)
        acc = torch.zeros(len(rows), v.shape[1], dtype=q.dtype)
        for j in range(0, last_k, tile):
            cols = torch.arange(j, min(j + tile, n_k))
            ok = mask_mod(0, 0, rows[:, None], cols[None, :])
            ok = ok.expand(len(rows), len(cols))
            empty, full = not ok.any(), bool(ok.all())
            if empty and slip != "every tile":
                continue
            if slip == "partial count":
                tiles += 0 if full else 1
            else:
                tiles += 1
            s = q[rows] @ k[cols].T
            if slip == "divided by d":
                s = s / q.shape[1]
            elif slip != "no scale":
                s = s / q.shape[1] ** 0.5
            if slip != "unmasked":
                s = s.masked_fill(~ok, float("-inf"))
            new = torch.maximum(best, s.amax(dim=1))
            if slip == "no guard":
                shift = new
            else:
                shift = torch.where(new.isfinite(), new, 0.0)
            p = (s - shift[:, None]).exp()
            scale = (best - shift).exp()
            if slip == "no rescale":
                scale = torch.ones_like(scale)
            denom = scale * denom + p.sum(dim=1)
            acc = scale[:, None] * acc + p @ v[cols]
            best = new
        if slip == "no guard":
            out[rows] = acc / denom[:, None]
        else:
            out[rows] = acc / denom.clamp(min=1e-300)[:, None]
    return out, tiles


def tiles_partial_unmasked(q, k, v, mask_mod, tile):
    return _slipped(q, k, v, mask_mod, tile, "unmasked")


def tiles_every_tile(q, k, v, mask_mod, tile):
    return _slipped(q, k, v, mask_mod, tile, "every tile")


def tiles_floor(q, k, v, mask_mod, tile):
    return _slipped(q, k, v, mask_mod, tile, "floor")


def tiles_key_floor(q, k, v, mask_mod, tile):
    """Wrong: the key loop stops at the last whole tile, the query loop
    right (reading stud131415)."""
    return _slipped(q, k, v, mask_mod, tile, "key floor")


def tiles_no_guard(q, k, v, mask_mod, tile):
    return _slipped(q, k, v, mask_mod, tile, "no guard")


def tiles_no_rescale(q, k, v, mask_mod, tile):
    return _slipped(q, k, v, mask_mod, tile, "no rescale")


def tiles_count_partial(q, k, v, mask_mod, tile):
    return _slipped(q, k, v, mask_mod, tile, "partial count")


def tiles_whole_mask_first(q, k, v, mask_mod, tile):
    """Right, but the mask of every pair is evaluated at once."""
    n_q, n_k = q.shape[0], k.shape[0]
    whole = mask_mod(0, 0, torch.arange(n_q)[:, None], torch.arange(n_k))

    def lookup(b, h, q_idx, kv_idx):
        return whole[q_idx, kv_idx]

    return _slipped(q, k, v, lookup, tile, None)


def tiles_division_unguarded(q, k, v, mask_mod, tile):
    """Guards the shift of a row still at -inf but divides by its sum
    unguarded, so a query with no key is 0 / 0 (expert reading sp14b: it was
    rejected with only the generic hint)."""
    n_q, n_k, d = q.shape[0], k.shape[0], q.shape[1]
    out, visited = torch.zeros(n_q, v.shape[1], dtype=q.dtype), 0
    for i in range(0, n_q, tile):
        r = torch.arange(i, min(i + tile, n_q))
        m = torch.full((len(r),), -math.inf, dtype=q.dtype)
        ell = torch.zeros(len(r), dtype=q.dtype)
        acc = torch.zeros(len(r), v.shape[1], dtype=q.dtype)
        for j in range(0, n_k, tile):
            c = torch.arange(j, min(j + tile, n_k))
            allowed = mask_mod(0, 0, r[:, None], c[None, :])
            allowed = allowed.expand(len(r), len(c))
            if not allowed.any():
                continue
            visited += 1
            s = (q[r] @ k[c].T) / math.sqrt(d)
            s = s.masked_fill(~allowed, -math.inf)
            m_new = torch.maximum(m, s.amax(1))
            shift = torch.where(torch.isfinite(m_new), m_new, 0.0)
            scale = torch.exp(m - shift)
            p = torch.exp(s - shift[:, None])
            ell = scale * ell + p.sum(1)
            acc = scale[:, None] * acc + p @ v[c]
            m = m_new
        out[r] = acc / ell[:, None]
    return out, visited


def tiles_four_corners(q, k, v, mask_mod, tile):
    """Wrong: a tile is skipped when the mask forbids its four corners, as a
    causal kernel skips the tiles above the diagonal; a document with
    padding on both sides of it inside one tile is lost (expert reading
    sp14c)."""
    n_q, n_k, d = q.shape[0], k.shape[0], q.shape[1]
    out, visited = torch.zeros(n_q, v.shape[1], dtype=q.dtype), 0
    for i in range(0, n_q, tile):
        r = torch.arange(i, min(i + tile, n_q))
        m = torch.full((len(r),), -math.inf, dtype=q.dtype)
        ell = torch.zeros(len(r), dtype=q.dtype)
        acc = torch.zeros(len(r), v.shape[1], dtype=q.dtype)
        for j in range(0, n_k, tile):
            c = torch.arange(j, min(j + tile, n_k))
            rq = torch.stack([r[0], r[0], r[-1], r[-1]])
            ck = torch.stack([c[0], c[-1], c[0], c[-1]])
            if not mask_mod(0, 0, rq, ck).any():
                continue
            visited += 1
            allowed = mask_mod(0, 0, r[:, None], c[None, :])
            allowed = allowed.expand(len(r), len(c))
            s = (q[r] @ k[c].T) / math.sqrt(d)
            s = s.masked_fill(~allowed, -math.inf)
            m_new = torch.maximum(m, s.amax(1))
            shift = torch.where(torch.isfinite(m_new), m_new, 0.0)
            scale = torch.exp(m - shift)
            p = torch.exp(s - shift[:, None])
            ell = scale * ell + p.sum(1)
            acc = scale[:, None] * acc + p @ v[c]
            m = m_new
        out[r] = acc / ell.clamp(min=1e-300)[:, None]
    return out, visited


def tiles_scores_before_the_test(q, k, v, mask_mod, tile):
    """Wrong: every tile's scores computed, then the empty ones thrown away
    (and not counted): output and count right, nothing saved (expert
    reading sp14c)."""
    q, k, v = (np.asarray(x) for x in (q, k, v))
    n_q, n_k, d = q.shape[0], k.shape[0], q.shape[1]
    out, visited = np.zeros((n_q, v.shape[1])), 0
    for i in range(0, n_q, tile):
        rows = np.arange(i, min(i + tile, n_q))
        m = np.full(len(rows), -np.inf)
        ell = np.zeros(len(rows))
        acc = np.zeros((len(rows), v.shape[1]))
        for j in range(0, n_k, tile):
            cols = np.arange(j, min(j + tile, n_k))
            s = q[rows] @ k[cols].T / np.sqrt(d)
            allowed = mask_mod(
                0, 0, torch.as_tensor(rows)[:, None], torch.as_tensor(cols)
            )
            allowed = allowed.expand(len(rows), len(cols)).numpy()
            if not allowed.any():
                continue
            visited += 1
            s = np.where(allowed, s, -np.inf)
            m_new = np.maximum(m, s.max(1))
            shift = np.where(np.isfinite(m_new), m_new, 0.0)
            scale = np.exp(m - shift)
            p = np.exp(s - shift[:, None])
            ell = scale * ell + p.sum(1)
            acc = scale[:, None] * acc + p @ v[cols]
            m = m_new
        out[rows] = acc / np.where(ell > 0, ell, 1.0)[:, None]
    return out, visited


def tiles_all_scored_torch32(q, k, v, mask_mod, tile):
    """Wrong, in torch float32: the scores of every tile computed, the mask
    tested after; only the tiles it allows are merged and counted."""
    q, k, v = q.float(), k.float(), v.float()
    n_q, n_k = q.shape[0], k.shape[0]
    out, visited = torch.zeros(n_q, v.shape[1]), 0
    for i in range(0, n_q, tile):
        r = torch.arange(i, min(i + tile, n_q))
        lse = torch.full((len(r),), -math.inf)
        acc = torch.zeros(len(r), v.shape[1])
        for j in range(0, n_k, tile):
            c = torch.arange(j, min(j + tile, n_k))
            s = torch.einsum("qd,kd->qk", q[r], k[c]) * q.shape[1] ** -0.5
            ok = mask_mod(0, 0, r[:, None], c[None, :]).expand_as(s)
            if not ok.any():
                continue
            visited += 1
            s = s.masked_fill(~ok, -math.inf)
            tile_lse = torch.logsumexp(s, 1)
            new = torch.logaddexp(lse, tile_lse)
            safe = torch.where(torch.isfinite(new), new, 0.0)
            acc = (lse - safe).exp()[:, None] * acc + (
                s - safe[:, None]
            ).exp() @ v[c]
            lse = new
        out[r] = acc
    return out, visited


def tiles_strip_per_query_tile(q, k, v, mask_mod, tile):
    """Wrong: each query tile's mask and scores against every key at once
    (a strip), a masked softmax over it, and the non-empty blocks of the
    strip counted: output and count right, nothing skipped (expert reading
    sp14c)."""
    n_q, n_k, d = q.shape[0], k.shape[0], q.shape[1]
    out, visited = torch.zeros(n_q, v.shape[1], dtype=q.dtype), 0
    keys = torch.arange(n_k)
    for i in range(0, n_q, tile):
        rows = torch.arange(i, min(i + tile, n_q))
        ok = mask_mod(0, 0, rows[:, None], keys[None, :])
        ok = ok.expand(len(rows), n_k)
        for j in range(0, n_k, tile):
            visited += int(ok[:, j : j + tile].any())
        s = (q[rows] @ k.T / d**0.5).masked_fill(~ok, -math.inf)
        out[rows] = torch.softmax(s, -1).nan_to_num(0.0) @ v
    return out, visited


def tiles_scores_per_strip(q, k, v, mask_mod, tile):
    """Wrong: the mask evaluated tile by tile, but the scores of a query tile
    against every key computed at once (a strip) and sliced per tile."""
    q, k, v = q.numpy(), k.numpy(), v.numpy()
    n_q, n_k = len(q), len(k)
    out, visited = np.zeros((n_q, v.shape[1])), 0
    for i in range(0, n_q, tile):
        rows = np.arange(i, min(i + tile, n_q))
        strip = q[rows] @ k.T / np.sqrt(q.shape[1])
        m = np.full(len(rows), -np.inf)
        total = np.zeros(len(rows))
        acc = np.zeros((len(rows), v.shape[1]))
        for j in range(0, n_k, tile):
            cols = np.arange(j, min(j + tile, n_k))
            rt, ct = torch.as_tensor(rows), torch.as_tensor(cols)
            ok = mask_mod(0, 0, rt[:, None], ct[None, :])
            ok = ok.expand(len(rows), len(cols)).numpy()
            if not ok.any():
                continue
            visited += 1
            s = np.where(ok, strip[:, j : j + tile], -np.inf)
            new = np.maximum(m, s.max(axis=1))
            safe = np.where(np.isfinite(new), new, 0.0)
            a = np.exp(m - safe)
            p = np.exp(s - safe[:, None])
            total = a * total + p.sum(axis=1)
            acc = a[:, None] * acc + p @ v[cols]
            m = new
        out[rows] = acc / np.where(total > 0, total, 1.0)[:, None]
    return out, visited


def tiles_without_scale(q, k, v, mask_mod, tile):
    return _slipped(q, k, v, mask_mod, tile, "no scale")


def tiles_divided_by_d(q, k, v, mask_mod, tile):
    return _slipped(q, k, v, mask_mod, tile, "divided by d")


def tiles_exp_of_raw_scores(q, k, v, mask_mod, tile):
    """Tiles classified, skipped and masked right, but no running maximum:
    the exponentials of the raw scores are summed, which is exact until a
    score passes about 709 and exp overflows to inf (expert reading sp14d:
    accepted while every case's scores were of order 10)."""
    n_q, n_k, d = q.shape[0], k.shape[0], q.shape[1]
    out, visited = torch.zeros(n_q, v.shape[1], dtype=q.dtype), 0
    for i in range(0, n_q, tile):
        r = torch.arange(i, min(i + tile, n_q))
        total = torch.zeros(len(r), dtype=q.dtype)
        acc = torch.zeros(len(r), v.shape[1], dtype=q.dtype)
        for j in range(0, n_k, tile):
            c = torch.arange(j, min(j + tile, n_k))
            a = mask_mod(0, 0, r[:, None], c[None, :]).expand(len(r), len(c))
            if not a.any():
                continue
            visited += 1
            s = q[r] @ k[c].T / d**0.5
            if not a.all():
                s = s.masked_fill(~a, float("-inf"))
            p = torch.exp(s)
            total = total + p.sum(1)
            acc = acc + p @ v[c]
        out[r] = acc / torch.where(total > 0, total, 1.0)[:, None]
    return out, visited


def tiles_max_from_zero(q, k, v, mask_mod, tile):
    """The online softmax with its running maximum started at 0, not -inf:
    exact while some allowed score of each row lies above about -745, else
    the row's exponentials underflow to 0 and its output is 0 (expert
    reading sp14e)."""
    n_q, n_k, d = q.shape[0], k.shape[0], q.shape[1]
    out, visited = torch.zeros(n_q, v.shape[1], dtype=q.dtype), 0
    for i in range(0, n_q, tile):
        r = torch.arange(i, min(i + tile, n_q))
        m = torch.zeros(len(r), dtype=q.dtype)
        total = torch.zeros(len(r), dtype=q.dtype)
        acc = torch.zeros(len(r), v.shape[1], dtype=q.dtype)
        for j in range(0, n_k, tile):
            c = torch.arange(j, min(j + tile, n_k))
            a = mask_mod(0, 0, r[:, None], c[None, :]).expand(len(r), len(c))
            if not a.any():
                continue
            visited += 1
            s = q[r] @ k[c].T / d**0.5
            if not a.all():
                s = s.masked_fill(~a, float("-inf"))
            m_new = torch.maximum(m, s.max(1).values)
            p = torch.exp(s - m_new[:, None])
            scale = torch.exp(m - m_new)
            total = scale * total + p.sum(1)
            acc = scale[:, None] * acc + p @ v[c]
            m = m_new
        out[r] = acc / torch.where(total > 0, total, 1.0)[:, None]
    return out, visited


def tiles_meshgrid_float32(q, k, v, mask_mod, tile):
    """Right: NumPy in float32, the mask_mod given each tile's pairs as two
    index grids (np.meshgrid), the tile's scores only after its test."""
    q, k, v = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    n_q, n_k, d = q.shape[0], k.shape[0], q.shape[1]
    out = np.zeros((n_q, v.shape[1]), dtype=np.float32)
    visited = 0
    for i in range(0, n_q, tile):
        rows = np.arange(i, min(i + tile, n_q))
        m = np.full(len(rows), -np.inf, dtype=np.float32)
        ell = np.zeros(len(rows), dtype=np.float32)
        acc = np.zeros((len(rows), v.shape[1]), dtype=np.float32)
        for j in range(0, n_k, tile):
            cols = np.arange(j, min(j + tile, n_k))
            qi, ki = np.meshgrid(rows, cols, indexing="ij")
            ok = np.asarray(
                mask_mod(0, 0, torch.from_numpy(qi), torch.from_numpy(ki))
            )
            if not ok.any():
                continue
            visited += 1
            s = np.where(
                ok, q[rows] @ k[cols].T / np.float32(d) ** 0.5, -np.inf
            )
            m_new = np.maximum(m, s.max(1))
            shift = np.where(np.isfinite(m_new), m_new, 0.0)
            scale = np.exp(m - shift)
            p = np.exp(s - shift[:, None])
            ell = scale * ell + p.sum(1)
            acc = scale[:, None] * acc + p @ v[cols]
            m = m_new
        out[rows] = acc / np.where(ell > 0, ell, 1.0)[:, None]
    return out, visited


def _tiles_classified(name, classify):
    """Right: numpy float64 online softmax, each tile classified as empty,
    full or partial by ``classify(allowed)`` (expert reading sp14f, E3)."""

    def tiles(q, k, v, mask_mod, tile):
        q, k, v = q.numpy(), k.numpy(), v.numpy()
        n_q, n_k = len(q), len(k)
        out = np.zeros((n_q, v.shape[1]))
        visited = 0
        for i in range(0, n_q, tile):
            rows = np.arange(i, min(i + tile, n_q))
            m = np.full(len(rows), -np.inf)
            total = np.zeros(len(rows))
            acc = np.zeros((len(rows), v.shape[1]))
            for j in range(0, n_k, tile):
                cols = np.arange(j, min(j + tile, n_k))
                a = mask_mod(
                    0,
                    0,
                    torch.as_tensor(rows)[:, None],
                    torch.as_tensor(cols)[None, :],
                ).expand(len(rows), len(cols))
                kind = classify(a)
                if kind == "empty":
                    continue
                visited += 1
                s = q[rows] @ k[cols].T / np.sqrt(q.shape[1])
                if kind == "partial":
                    s = np.where(a.numpy(), s, -np.inf)
                new = np.maximum(m, s.max(1))
                safe = np.where(np.isfinite(new), new, 0.0)
                old = np.exp(m - safe)
                p = np.exp(s - safe[:, None])
                total = old * total + p.sum(1)
                acc = old[:, None] * acc + p @ v[cols]
                m = new
            out[rows] = acc / np.where(total > 0, total, 1.0)[:, None]
        return out, visited

    tiles.__name__ = tiles.__qualname__ = name
    return tiles


def _by_fraction(f) -> str:
    return "empty" if f == 0 else "full" if f == 1 else "partial"


def _by_float64_sum(a) -> str:
    s = a.to(torch.float64).sum()
    return "empty" if s == 0 else "full" if s == a.numel() else "partial"


# the mean of the mask tile: a float copy of it, a tile's bytes
tiles_mean_numpy = _tiles_classified(
    "tiles_mean_numpy", lambda a: _by_fraction(a.numpy().mean())
)
tiles_mean_torch = _tiles_classified(
    "tiles_mean_torch", lambda a: _by_fraction(a.float().mean())
)
tiles_float64_mask_sum = _tiles_classified(
    "tiles_float64_mask_sum", _by_float64_sum
)


def tiles_asarray_mean(q, k, v, mask_mod, tile):
    """Right: the inputs turned into arrays by np.asarray, each tile
    classified by the mean of its boolean mask (a float copy of the tile),
    no scores before the test (issue 31, student report s12r14: rejected
    while the checker followed only .numpy() and counted np.asarray's bytes,
    where the mean's float copy weighs as much as a tile of scores)."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    n_q, d = q.shape
    n_k = len(k)
    out, visited = np.zeros((n_q, v.shape[1])), 0
    for i in range(0, n_q, tile):
        rows = np.arange(i, min(i + tile, n_q))
        m = np.full(len(rows), -np.inf)
        tot = np.zeros(len(rows))
        acc = np.zeros((len(rows), v.shape[1]))
        for j in range(0, n_k, tile):
            cols = np.arange(j, min(j + tile, n_k))
            al = mask_mod(
                0, 0, torch.as_tensor(rows)[:, None], torch.as_tensor(cols)
            )
            al = np.broadcast_to(np.asarray(al), (len(rows), len(cols)))
            frac = al.mean()
            if frac == 0:
                continue
            visited += 1
            s = q[rows] @ k[cols].T / math.sqrt(d)
            if frac != 1:
                s = np.where(al, s, -np.inf)
            mn = np.maximum(m, s.max(1))
            sh = np.where(np.isfinite(mn), mn, 0.0)
            r = np.exp(m - sh)
            p = np.exp(s - sh[:, None])
            tot = r * tot + p.sum(1)
            acc = r[:, None] * acc + p @ v[cols]
            m = mn
        out[rows] = acc / np.where(tot > 0, tot, 1.0)[:, None]
    return out, visited


def tiles_scored_from_a_list(q, k, v, mask_mod, tile):
    """Wrong, with keys that leave torch through a list (which the checker
    cannot follow, so that it counts bytes): every tile's scores computed
    before the test."""
    q, k, v = (np.array(x.tolist()) for x in (q, k, v))
    n_q, n_k = len(q), len(k)
    out, visited = np.zeros((n_q, v.shape[1])), 0
    for i in range(0, n_q, tile):
        rows = np.arange(i, min(i + tile, n_q))
        m = np.full(len(rows), -np.inf)
        total = np.zeros(len(rows))
        acc = np.zeros((len(rows), v.shape[1]))
        for j in range(0, n_k, tile):
            cols = np.arange(j, min(j + tile, n_k))
            s = q[rows] @ k[cols].T / np.sqrt(q.shape[1])
            a = mask_mod(
                0, 0, torch.as_tensor(rows)[:, None], torch.as_tensor(cols)
            ).expand(len(rows), len(cols))
            if not a.any():
                continue
            visited += 1
            s = np.where(a.numpy(), s, -np.inf)
            new = np.maximum(m, s.max(1))
            safe = np.where(np.isfinite(new), new, 0.0)
            old = np.exp(m - safe)
            p = np.exp(s - safe[:, None])
            total = old * total + p.sum(1)
            acc = old[:, None] * acc + p @ v[cols]
            m = new
        out[rows] = acc / np.where(total > 0, total, 1.0)[:, None]
    return out, visited


def tiles_scored_then_mean(q, k, v, mask_mod, tile):
    """Wrong, through .numpy(): every tile's scores computed, then the mask
    tile's mean tested, the empty ones thrown away and not counted."""
    q, k, v = q.numpy(), k.numpy(), v.numpy()
    n_q, n_k = len(q), len(k)
    out, visited = np.zeros((n_q, v.shape[1])), 0
    for i in range(0, n_q, tile):
        rows = np.arange(i, min(i + tile, n_q))
        m = np.full(len(rows), -np.inf)
        total = np.zeros(len(rows))
        acc = np.zeros((len(rows), v.shape[1]))
        for j in range(0, n_k, tile):
            cols = np.arange(j, min(j + tile, n_k))
            s = np.einsum("qd,kd->qk", q[rows], k[cols]) / np.sqrt(q.shape[1])
            a = mask_mod(
                0, 0, torch.as_tensor(rows)[:, None], torch.as_tensor(cols)
            ).expand(len(rows), len(cols))
            if a.numpy().mean() == 0:
                continue
            visited += 1
            s = np.where(a.numpy(), s, -np.inf)
            new = np.maximum(m, s.max(1))
            safe = np.where(np.isfinite(new), new, 0.0)
            old = np.exp(m - safe)
            p = np.exp(s - safe[:, None])
            total = old * total + p.sum(1)
            acc = old[:, None] * acc + p @ v[cols]
            m = new
        out[rows] = acc / np.where(total > 0, total, 1.0)[:, None]
    return out, visited


def tiles_gather_then_softmax(q, k, v, mask_mod, tile):
    """Wrong: the tiles classified one at a time, then every non-empty key
    tile of a query tile gathered and one plain softmax taken over them (no
    online softmax): under a causal mask the last query tile holds a strip
    of 64 x 2048 scores (expert reading sp14f, E2)."""
    q, k, v = q.numpy(), k.numpy(), v.numpy()
    n_q, n_k = len(q), len(k)
    out = np.zeros((n_q, v.shape[1]))
    visited = 0
    for i in range(0, n_q, tile):
        rows = np.arange(i, min(i + tile, n_q))
        kept, masks = [], []
        for j in range(0, n_k, tile):
            cols = np.arange(j, min(j + tile, n_k))
            a = mask_mod(
                0, 0, torch.as_tensor(rows)[:, None], torch.as_tensor(cols)
            ).expand(len(rows), len(cols))
            if not a.any():
                continue
            visited += 1
            kept.append(cols)
            masks.append(a.numpy())
        if not kept:
            continue
        cols, a = np.concatenate(kept), np.concatenate(masks, axis=1)
        s = np.where(a, q[rows] @ k[cols].T / np.sqrt(q.shape[1]), -np.inf)
        m = s.max(1)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m[:, None])
        total = p.sum(1)
        out[rows] = (p @ v[cols]) / np.where(total > 0, total, 1.0)[:, None]
    return out, visited


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
            (topk_zero_then_first_slots, "zero_masked"),
            (topk_unmasked_first_slots, "future_selected"),
        ],
    },
    "check_tiled_sparse_attention": {
        "right": [
            tiles_numpy,
            tiles_torch_keys_outside,
            lambda *args: _slipped(*args, None),
            tiles_meshgrid_float32,
            tiles_mean_numpy,
            tiles_mean_torch,
            tiles_float64_mask_sum,
            tiles_asarray_mean,
        ],
        "wrong": [
            (tiles_partial_unmasked, "partial_unmasked"),
            (tiles_every_tile, "empty_visited"),
            (tiles_floor, "ragged_dropped"),
            (tiles_key_floor, "ragged_dropped"),
            (tiles_no_guard, "nan_rows"),
            (tiles_division_unguarded, "nan_rows"),
            (tiles_no_rescale, "not_rescaled"),
            (tiles_count_partial, "partial_count_only"),
            (tiles_whole_mask_first, "dense_mask"),
            (tiles_four_corners, "corners_only"),
            (tiles_without_scale, "wrong_scale"),
            (tiles_divided_by_d, "wrong_scale"),
            (tiles_scores_before_the_test, "empty_scored"),
            (tiles_all_scored_torch32, "empty_scored"),
            (tiles_strip_per_query_tile, "strip"),
            (tiles_scores_per_strip, "strip"),
            (tiles_exp_of_raw_scores, "no_running_max"),
            (tiles_max_from_zero, "running_max_from_zero"),
            (tiles_gather_then_softmax, "strip"),
            (tiles_scored_then_mean, "empty_scored"),
            (tiles_scored_from_a_list, "empty_scored"),
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


def test_a_window_capped_at_8_is_rejected():
    """One case's window (12) is wider than 8 and still cuts its document,
    so a window capped at 8 keys fails (expert reading sp14d: accepted
    while the only wide window exceeded every document)."""
    with pytest.raises(ExerciseError):
        check_packed_sliding_mask_mod(packed_sliding_capped)


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


def test_the_tiled_reference_equals_dense_attention():
    """The checker's reference (the package's block_mask and
    block_sparse_attend) equals dense attention under the whole mask, with a
    fully masked row 0, on every case; and its tile count is the number of
    tiles of the dense mask that hold a True."""
    from attnbook import attend
    from attnbook.exercises.sparse import _reference_tiled, tiled_cases

    for case in tiled_cases():
        q, k, v, mask_mod, tile = case.args
        n_q, n_k = q.shape[0], k.shape[0]
        mask = mask_mod(
            0, 0, torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        ).expand(n_q, n_k)
        out, visited = _reference_tiled(q, k, v, mask_mod, tile)
        dense = attend(q, k, v, mask).numpy()
        assert np.allclose(out, dense, atol=1e-12), case.name
        tiles = sum(
            bool(mask[i : i + tile, j : j + tile].any())
            for i in range(0, n_q, tile)
            for j in range(0, n_k, tile)
        )
        assert visited == tiles, case.name


def test_a_tiled_case_has_scores_whose_exp_overflows():
    """One case's scores pass 709, where exp overflows in float64, so that
    an answer without a running maximum returns NaN there while the
    reference stays finite (issue 31, expert reading sp14d)."""
    from attnbook.exercises.sparse import _reference_tiled, tiled_cases

    large = []
    for case in tiled_cases():
        q, k, v, mask_mod, tile = case.args
        n_q, n_k = q.shape[0], k.shape[0]
        mask = mask_mod(
            0, 0, torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        ).expand(n_q, n_k)
        scores = (q @ k.T / q.shape[1] ** 0.5)[mask]
        if scores.max() > 709.8:
            large.append(case.name)
            assert np.isfinite(_reference_tiled(*case.args)[0]).all()
    assert large


def test_the_tiled_cases_cover_ragged_tiles_and_an_empty_row():
    from attnbook.exercises.sparse import tiled_cases

    cases = tiled_cases()
    assert any(c.args[0].shape[0] % c.args[4] for c in cases)
    assert any(c.args[0].shape[0] != c.args[1].shape[0] for c in cases)
    empty = []
    for c in cases:
        q, k, _, mask_mod, _ = c.args
        mask = mask_mod(
            0, 0, torch.arange(len(q))[:, None], torch.arange(len(k))[None, :]
        )
        empty.append(bool((~mask.any(dim=-1)).any()))
    assert any(empty)


def test_a_right_tiled_answer_stays_far_below_the_memory_bound():
    """The margin of the memory check: a right answer's peak at n = 2048 and
    d = 2 is under two thirds of the bound, 3 n tile bytes, and a strip of
    float64 scores (8 n tile bytes) over twice the bound."""
    from attnbook.exercises._framework import peak_memory_with_torch
    from attnbook.exercises.sparse import (
        WORK_N,
        WORK_TILE,
        _sliding,
        _work_inputs,
    )

    bound = 3 * WORK_N * WORK_TILE
    q, k, v = _work_inputs()
    mask_mod = _sliding(WORK_TILE)
    for fn in (tiles_numpy, tiles_torch_keys_outside):
        _, peak = peak_memory_with_torch(fn, q, k, v, mask_mod, WORK_TILE)
        assert peak < bound * 2 / 3, (fn.__name__, peak)
    _, peak = peak_memory_with_torch(
        tiles_scores_per_strip, q, k, v, mask_mod, WORK_TILE
    )
    assert peak > 2 * bound, peak


def test_the_work_check_separates_skipping_from_scoring_every_tile():
    """The margin of the work check (issue 24, expert reading sp14c): of the
    1024 tiles the mask leaves 63 non-empty; a right answer allocates a tile's
    worth (3 tile^2 bytes) after at most twice as many evaluations of the
    mask_mod, an answer that scores every tile after nearly all of them,
    and the bound is half of them. Counted bytes, not time."""
    from attnbook.exercises.sparse import (
        WORK_N,
        WORK_TILE,
        _sliding,
        _watch_tile_work,
        _work_inputs,
    )

    tiles, needed = (WORK_N // WORK_TILE) ** 2, 2 * (WORK_N // WORK_TILE) - 1
    threshold = 3 * WORK_TILE * WORK_TILE

    def scored(fn):
        pairs, work, _ = _watch_tile_work(
            fn, *_work_inputs(), _sliding(WORK_TILE), WORK_TILE
        )
        assert max(pairs) <= WORK_TILE * WORK_TILE, fn.__name__
        return sum(w >= threshold for w in work[1:])

    for fn in (tiles_numpy, tiles_torch_keys_outside, tiles_meshgrid_float32):
        assert scored(fn) <= 2 * needed < tiles // 2, fn.__name__
    for fn in (tiles_scores_before_the_test, tiles_all_scored_torch32):
        assert scored(fn) >= tiles - 1 > tiles // 2, fn.__name__


def test_a_tiled_case_hides_a_document_from_the_corners():
    """One case has a tile whose four corners the mask forbids but whose
    inside it allows (a document with padding on both sides of it): a loop
    that judges tiles by their corners fails there (issue 24, expert reading
    sp14c)."""
    from attnbook.exercises.sparse import tiled_cases

    hidden = []
    for case in tiled_cases():
        q, k, _, mask_mod, tile = case.args
        n_q, n_k = q.shape[0], k.shape[0]
        mask = mask_mod(
            0, 0, torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        ).expand(n_q, n_k)
        for i in range(0, n_q, tile):
            for j in range(0, n_k, tile):
                block = mask[i : i + tile, j : j + tile]
                corners = block[[0, 0, -1, -1], [0, -1, 0, -1]]
                hidden.append(bool(block.any()) and not corners.any())
    assert any(hidden)


def test_the_work_check_counts_the_scores_of_the_keys():
    """Where the keys stay in torch or leave it by .numpy(), the work check
    counts the scores computed from them, not bytes: a right answer that
    takes the float mean of each mask tile computes scores after the 63
    non-empty tiles' evaluations only, and one that scores every tile after
    nearly all of them, in torch and in numpy (expert reading sp14f, E3)."""
    from attnbook.exercises.sparse import (
        WORK_N,
        WORK_TILE,
        _sliding,
        _watch_tile_work,
        _work_inputs,
    )

    tiles, needed = (WORK_N // WORK_TILE) ** 2, 2 * (WORK_N // WORK_TILE) - 1
    half = WORK_TILE * WORK_TILE // 2

    def scored(fn):
        _, _, scores = _watch_tile_work(
            fn, *_work_inputs(), _sliding(WORK_TILE), WORK_TILE
        )
        assert scores is not None, fn.__name__
        return sum(s >= half for s in scores[1:])

    for fn in (tiles_numpy, tiles_mean_numpy, tiles_mean_torch):
        assert scored(fn) == needed, fn.__name__
    assert scored(tiles_torch_keys_outside) == needed
    # np.asarray(k) is followed as .numpy() is (issue 31, student report
    # s12r14), np.asarray(k, dtype=np.float32) too
    for fn in (tiles_asarray_mean, tiles_meshgrid_float32):
        assert scored(fn) == needed, fn.__name__
    for fn in (
        tiles_scored_then_mean,
        tiles_all_scored_torch32,
        tiles_scores_before_the_test,
    ):
        assert scored(fn) >= tiles - 1, fn.__name__


def test_the_work_check_by_bytes_quotes_the_inputs_dtype():
    """Where the keys leave torch by a route the checker cannot follow, it
    counts bytes: its message gives a tile of scores in the inputs' dtype
    (float64, 32 KiB), and its diagnosis names the float copy of a mask tile
    that bytes cannot tell from scores (issue 31, student report s12r14)."""
    with pytest.raises(ExerciseError) as err:
        check_tiled_sparse_attention(tiles_scored_from_a_list)
    text = str(err.value)
    assert "32.0 KiB in float64" in text and "float32" not in text, text
    assert "float copy of each mask tile" in text, text


def test_the_causal_memory_check_names_a_gathered_strip():
    """Under a window of one tile a query tile has two non-empty key tiles;
    under the causal mask the last has 32, and gathering them for one
    softmax holds a strip (expert reading sp14f, E2)."""
    with pytest.raises(ExerciseError) as err:
        check_tiled_sparse_attention(tiles_gather_then_softmax)
    assert "causal" in str(err.value), str(err.value)
