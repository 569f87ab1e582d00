"""Checker for a grouped-query decoding step (chapter 12, the hard exercise).

The reader writes ``grouped_decode_step(q, k_cache, v_cache, lengths)``: one
decoding step of grouped-query attention over a batch of sequences whose
caches are filled to different lengths. ``q`` is ``(B, h, d_k)`` (the new
token's query in each of the h query heads), ``k_cache`` ``(B, h_kv, n, d_k)``
and ``v_cache`` ``(B, h_kv, n, d_v)`` hold ``n`` slots per sequence, of which
sequence ``b`` has written the first ``lengths[b]`` (the new token's own key
and value included, in slot ``lengths[b] - 1``); the slots after them hold
stale numbers left by earlier sequences. Query head ``j`` reads key/value head
``j // g``, ``g = h // h_kv``. The result is ``(B, h, d_v)``.

Besides the values, the checker measures the memory of one large case, twice
(numpy's arrays through :mod:`tracemalloc`; torch's allocations through its
profiler, whatever the answer returns): its peak, and the volume it allocated,
added up line by line (:func:`attnbook.exercises._framework.allocation_volume`
and ``torch_allocation_total``). An answer that copies the keys or values per
query head (``np.repeat``, ``repeat_kv``) allocates ``g`` times the cache and
is rejected, however right its values: a copy alive all at once by its peak,
and one made a group or a head at a time, which stays under the peak's limit,
by its volume. Both are counts of bytes, the same under any load. Numpy only,
so that the browser's exercise notebook can load it.
"""

from __future__ import annotations

import numpy as np

from ._framework import Case, ExerciseError, Mistake, run_checks, same

EXERCISE = "grouped-query decoding step"


def _softmax(s, axis=-1):
    e = np.exp(s - s.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _reference(q, k, v, lengths):
    """float64, one sequence and one query head at a time, key/value head j //
    g looked up by index, only the written slots sliced out."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    b_size, n_heads, d_k = q.shape
    g = n_heads // k.shape[1]
    out = np.empty((b_size, n_heads, v.shape[-1]))
    for b in range(b_size):
        written = int(lengths[b])
        for j in range(n_heads):
            scores = k[b, j // g, :written] @ q[b, j] / np.sqrt(d_k)
            out[b, j] = _softmax(scores) @ v[b, j // g, :written]
    return out


def _per_head(
    q,
    k,
    v,
    lengths,
    kv_of=lambda j, g, n_kv: j // g,
    scale=lambda d_k, d_v, g: np.sqrt(d_k),
    seen=lambda written, n: written,
    shift_over_all=False,
    shift=True,
    zero_after_softmax=False,
    fill=None,
):
    """A decoding step with one knob turned: which key/value head a query
    head reads, the scale, how many slots it sees, and how the softmax treats
    the stale slots (``fill``: their scores set to that finite number, the
    softmax over all n slots)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    b_size, n_heads, d_k = q.shape
    n_kv, n = k.shape[1], k.shape[2]
    g = n_heads // n_kv
    out = np.empty((b_size, n_heads, v.shape[-1]))
    for b in range(b_size):
        written = int(lengths[b])
        for j in range(n_heads):
            i = kv_of(j, g, n_kv)
            scores = k[b, i] @ q[b, j] / scale(d_k, v.shape[-1], g)
            if zero_after_softmax:
                weights = _softmax(scores)
                weights[written:] = 0.0
                out[b, j] = weights @ v[b, i]
                continue
            if fill is not None:
                scores[written:] = fill
                out[b, j] = _softmax(scores) @ v[b, i]
                continue
            m = seen(written, n)
            if m < 1:
                # nothing left to attend to: 0 / 0
                out[b, j] = np.nan
                continue
            top = scores.max() if shift_over_all else scores[:m].max()
            e = np.exp(scores[:m] - top) if shift else np.exp(scores[:m])
            out[b, j] = e / e.sum() @ v[b, i, :m]
    return out


def _fill_between(q, k, v, lengths, which):
    """A finite fill that some rows' written scores lie above and others
    below: the fill halfway between the ``which``-th and the next of the
    distinct best written scores below -1e4 (highest first), so that the
    rows whose best score lies below it give the stale slots the weights.
    Where there are not that many such scores, the fill is below them all
    and the step is right."""
    q, k = (np.asarray(a, dtype=np.float64) for a in (q, k))
    b_size, n_heads, d_k = q.shape
    g = n_heads // k.shape[1]
    best = []
    for b in range(b_size):
        written = int(lengths[b])
        if written == k.shape[2]:
            continue
        for j in range(n_heads):
            best.append(
                (k[b, j // g, :written] @ q[b, j]).max() / np.sqrt(d_k)
            )
    # distinct to a relative 1e-6, highest first
    low = sorted((s for s in best if s < -1e4), reverse=True)
    levels = [
        s for i, s in enumerate(low) if i == 0 or s < low[i - 1] * (1 + 1e-6)
    ]
    if len(levels) < which + 2:
        return _reference(q, k, v, lengths)
    fill = (levels[which] + levels[which + 1]) / 2
    return _per_head(q, k, v, lengths, fill=fill)


def _grouped(q, k, v, lengths):
    """(B, h_kv, g, n) scores of the grouped layout, stale slots at -inf."""
    q, k = (np.asarray(a, dtype=np.float64) for a in (q, k))
    b_size, n_heads, d_k = q.shape
    n_kv, n = k.shape[1], k.shape[2]
    rows = q.reshape(b_size, n_kv, n_heads // n_kv, d_k)
    scores = np.einsum("bigd,bind->bign", rows, k) / np.sqrt(d_k)
    written = np.arange(n) < np.asarray(lengths)[:, None]
    return np.where(written[:, None, None, :], scores, -np.inf)


def _unshifted_times_mask(q, k, v, lengths):
    scores = _grouped(q, k, v, np.full(len(lengths), k.shape[2]))
    written = np.arange(k.shape[2]) < np.asarray(lengths)[:, None]
    e = np.exp(scores) * written[:, None, None, :]
    out = np.einsum(
        "bign,bine->bige",
        e / e.sum(axis=-1, keepdims=True),
        np.asarray(v, np.float64),
    )
    return out.reshape(q.shape[0], q.shape[1], -1)


def _softmax_over_group(q, k, v, lengths):
    weights = np.nan_to_num(_softmax(_grouped(q, k, v, lengths), axis=2))
    out = np.einsum("bign,bine->bige", weights, np.asarray(v, np.float64))
    return out.reshape(q.shape[0], q.shape[1], -1)


def _softmax_over_group_masked(q, k, v, lengths):
    """The softmax over the group axis after the -inf mask: a stale slot is
    -inf for the whole group, its weights 0 / 0, so every output of a
    sequence with a stale slot is NaN."""
    with np.errstate(invalid="ignore"):
        weights = _softmax(_grouped(q, k, v, lengths), axis=2)
    out = np.einsum("bign,bine->bige", weights, np.asarray(v, np.float64))
    return out.reshape(q.shape[0], q.shape[1], -1)


def _softmax_over_group_unmasked(q, k, v, lengths):
    """The softmax over the group axis with no mask at all: every slot,
    stale or written, gets weights that sum to 1 over the group."""
    scores = _grouped(q, k, v, np.full(len(lengths), k.shape[2]))
    weights = _softmax(scores, axis=2)
    out = np.einsum("bign,bine->bige", weights, np.asarray(v, np.float64))
    return out.reshape(q.shape[0], q.shape[1], -1)


def _softmax_over_group_finite_mask(q, k, v, lengths):
    """The softmax over the group axis after a finite mask (any finite
    fill): a stale slot's score is the same fill for the whole group, so
    each of its g query heads gives it the weight 1 / g."""
    scores = _grouped(q, k, v, np.full(len(lengths), k.shape[2]))
    written = np.arange(k.shape[2]) < np.asarray(lengths)[:, None]
    scores = np.where(written[:, None, None, :], scores, -1e4)
    weights = _softmax(scores, axis=2)
    out = np.einsum("bign,bine->bige", weights, np.asarray(v, np.float64))
    return out.reshape(q.shape[0], q.shape[1], -1)


def _split_g_first(q, k, v, lengths):
    """q split as (B, g, h_kv, d_k) and transposed to (B, h_kv, g, d_k), the
    result (B, h_kv, g, d_v) flattened straight: query head j = m*h_kv + i
    reads key/value head i = j % h_kv, and its output lands at i*g + m."""
    b_size, n_heads, d_k = q.shape
    n_kv = k.shape[1]
    g = n_heads // n_kv
    tiled = _per_head(q, k, v, lengths, kv_of=lambda j, g, n_kv: j % n_kv)
    # the output of query head m*h_kv + i, put at i*g + m
    return (
        tiled.reshape(b_size, g, n_kv, -1)
        .transpose(0, 2, 1, 3)
        .reshape(b_size, n_heads, -1)
    )


def _output_heads_transposed(q, k, v, lengths):
    weights = _softmax(_grouped(q, k, v, lengths))
    out = np.einsum("bign,bine->bige", weights, np.asarray(v, np.float64))
    # (B, g, h_kv, d_v): the heads put back group member first
    return out.transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[1], -1)


ORDER_HINT = (
    "query head j = i*g + m is member m of group i: reshape q (B, h, d_k) to "
    "(B, h_kv, g, d_k), in that order, so that the g rows of group i meet "
    "key/value head i"
)
SLOTS_HINT = (
    "sequence b has written slots 0 .. lengths[b] - 1, the new token's own "
    "key and value in the last of them: mask the slots j >= lengths[b] "
    "(scores -inf before the softmax) or slice them off"
)
SCALE_HINT = (
    "divide the scores by sqrt(d_k), the features of one key: stacking the "
    "g query heads of a group into rows does not change the length of a "
    "row, and d_v plays no part"
)

DECODE_MISTAKES = [
    Mistake(
        "wrong_order",
        "the heads are grouped in the wrong order: query head j reads "
        "key/value head j % h_kv (q reshaped as (B, g, h_kv, d_k)) instead of "
        "j // g",
        ORDER_HINT,
        lambda q, k, v, lengths: _per_head(
            q, k, v, lengths, kv_of=lambda j, g, n_kv: j % n_kv
        ),
    ),
    Mistake(
        "wrong_order_in_and_out",
        "the heads are grouped in the wrong order on the way in and again on "
        "the way out: q was split as (B, g, h_kv, d_k) and transposed to "
        "(B, h_kv, g, d_k), so query head j reads key/value head j % h_kv, "
        "and the (B, h_kv, g, d_v) result was flattened straight, so each "
        "output lands in another head's place",
        ORDER_HINT,
        _split_g_first,
    ),
    Mistake(
        "output_heads_transposed",
        "each query head meets the right key/value head, but the outputs are "
        "put back in the wrong order: the (B, h_kv, g, d_v) result was "
        "transposed to (B, g, h_kv, d_v) before the final reshape",
        "the grouped result (B, h_kv, g, d_v) is already in the order of the "
        "query heads (j = i*g + m): reshape it to (B, h, d_v) directly",
        _output_heads_transposed,
    ),
    Mistake(
        "stale_slots_attended",
        "every one of the n slots is attended to, including the stale ones "
        "after lengths[b] that this sequence never wrote",
        SLOTS_HINT,
        lambda q, k, v, lengths: _per_head(
            q, k, v, lengths, seen=lambda written, n: n
        ),
    ),
    Mistake(
        "newest_slot_dropped",
        "the last written slot (the new token's own key and value) is left "
        "out: only slots 0 .. lengths[b] - 2 are attended to",
        SLOTS_HINT,
        lambda q, k, v, lengths: _per_head(
            q, k, v, lengths, seen=lambda written, n: written - 1
        ),
    ),
    Mistake(
        "one_stale_slot",
        "one slot too many is attended to: slot lengths[b], which this "
        "sequence has not written yet",
        SLOTS_HINT,
        lambda q, k, v, lengths: _per_head(
            q, k, v, lengths, seen=lambda written, n: min(written + 1, n)
        ),
    ),
    Mistake(
        "masked_after_softmax",
        "the stale slots are zeroed after the softmax, which was taken over "
        "all n slots: the weights of the written slots no longer sum to 1",
        "mask before the softmax (scores -inf for the stale slots), so that "
        "it normalises over the written slots only",
        lambda q, k, v, lengths: _per_head(
            q, k, v, lengths, zero_after_softmax=True
        ),
    ),
    Mistake(
        "finite_mask",
        "the stale slots' scores are set to a finite number (such as -1e4) "
        "instead of -inf: where every written score of a row lies below it, "
        "the stale slots take the weights",
        "mask with -inf (np.where(written, scores, -np.inf)), which no score "
        "can fall below, or slice the written slots out; a finite fill only "
        "works while every score stays above it",
        lambda q, k, v, lengths: _per_head(q, k, v, lengths, fill=-1e4),
    ),
    # the same mistake with a fill among the written scores (-3.1e4, say):
    # some rows of a group right, the others on the stale slots
    *(
        Mistake(
            "finite_mask",
            "the stale slots' scores are set to a finite number instead of "
            "-inf, one that some written scores lie below: in the rows "
            "whose written scores all lie below it, the stale slots take the "
            "weights",
            "mask with -inf (np.where(written, scores, -np.inf)), which no "
            "score can fall below, or slice the written slots out; a finite "
            "fill only works while every score stays above it",
            lambda q, k, v, lengths, which=which: _fill_between(
                q, k, v, lengths, which
            ),
        )
        for which in (0, 1)
    ),
    Mistake(
        "softmax_over_group",
        "the softmax runs over the group axis of the (B, h_kv, g, n) scores "
        "instead of over the slots",
        "each query head's weights are a distribution over the slots: "
        "softmax along the last axis (the n slots)",
        _softmax_over_group,
    ),
    Mistake(
        "softmax_over_group",
        "the softmax runs over the group axis of the (B, h_kv, g, n) scores "
        "instead of over the slots; with the stale slots masked to -inf "
        "first, a stale slot is -inf for the whole group, so its weights are "
        "0 / 0 = NaN, and every output of a sequence with a stale slot is NaN",
        "each query head's weights are a distribution over the slots: "
        "softmax along the last axis (the n slots)",
        _softmax_over_group_masked,
    ),
    Mistake(
        "softmax_over_group",
        "the softmax runs over the group axis of the (B, h_kv, g, n) scores "
        "instead of over the slots, and the stale slots are not masked: "
        "every slot, stale or written, gets weights that sum to 1 over the "
        "group's g query heads",
        "each query head's weights are a distribution over the slots: mask "
        "the stale slots with -inf, then softmax along the last axis (the n "
        "slots)",
        _softmax_over_group_unmasked,
    ),
    Mistake(
        "softmax_over_group",
        "the softmax runs over the group axis of the (B, h_kv, g, n) scores "
        "instead of over the slots, after a finite mask (such as -1e4): a "
        "stale slot has the same score in every query head of the group, so "
        "each of them gives it the weight 1 / g",
        "each query head's weights are a distribution over the slots: mask "
        "the stale slots with -inf, then softmax along the last axis (the n "
        "slots)",
        _softmax_over_group_finite_mask,
    ),
    Mistake(
        "max_includes_stale",
        "the stale slots take part in the softmax's arithmetic: shifted by "
        "the maximum over all n slots, stale ones included, every written "
        "slot's exp underflows to 0 where a stale score is far larger (0 / "
        "0); or shifted by the written slots' maximum and masked by "
        "multiplying by 0 after exp, where a stale score far above it "
        "overflows to inf (inf * 0 is NaN); each gives these NaNs",
        "mask first: set the stale scores to -inf, then take the maximum of "
        "the row (over the written slots), subtract it and exponentiate "
        "(exp(-inf) is exactly 0)",
        lambda q, k, v, lengths: _per_head(
            q, k, v, lengths, shift_over_all=True
        ),
    ),
    Mistake(
        "unshifted",
        "the exponentials are not shifted by the row maximum: exp overflows "
        "to inf past ~710, and inf / inf is NaN",
        "subtract each row's maximum (over the written slots) before exp",
        lambda q, k, v, lengths: _per_head(q, k, v, lengths, shift=False),
    ),
    Mistake(
        "unshifted",
        "the exponentials are not shifted by the row maximum: exp overflows "
        "to inf past ~710 (here also on stale slots, where inf times a mask "
        "of 0 is NaN), and inf / inf is NaN",
        "subtract each row's maximum (over the written slots) before exp, "
        "and mask with -inf before it rather than by multiplying after it",
        lambda q, k, v, lengths: _unshifted_times_mask(q, k, v, lengths),
    ),
    Mistake(
        "not_scaled",
        "the scores are not divided by sqrt(d_k)",
        SCALE_HINT,
        lambda q, k, v, lengths: _per_head(
            q, k, v, lengths, scale=lambda d_k, d_v, g: 1.0
        ),
    ),
    Mistake(
        "scaled_by_d_k",
        "the scores are divided by d_k instead of sqrt(d_k)",
        SCALE_HINT,
        lambda q, k, v, lengths: _per_head(
            q, k, v, lengths, scale=lambda d_k, d_v, g: float(d_k)
        ),
    ),
    Mistake(
        "scaled_by_group",
        "the scores are divided by sqrt(g * d_k), as if the g stacked query "
        "heads made one longer vector, instead of sqrt(d_k)",
        SCALE_HINT,
        lambda q, k, v, lengths: _per_head(
            q, k, v, lengths, scale=lambda d_k, d_v, g: np.sqrt(g * d_k)
        ),
    ),
    Mistake(
        "scaled_by_d_v",
        "the scores are divided by sqrt(d_v), the features of a value, "
        "instead of sqrt(d_k)",
        SCALE_HINT,
        lambda q, k, v, lengths: _per_head(
            q, k, v, lengths, scale=lambda d_k, d_v, g: np.sqrt(d_v)
        ),
    ),
]

REPEATED_KV = Mistake(
    "repeated_kv",
    "the values may be right, but the keys or values were copied once per "
    "query head (np.repeat, repeat_kv, a broadcast that materialises), all "
    "at once or one group or head at a time: the step's memory grows with "
    "g, the query heads per key/value head, which is what grouped-query "
    "attention exists to avoid",
    "reshape the queries instead: q (B, h, d_k) -> (B, h_kv, g, d_k) is a "
    "view, and (B, h_kv, g, d_k) against k_cache (B, h_kv, n, d_k) gives "
    "the scores (B, h_kv, g, n) with each cached head read as it is",
    lambda q, k, v, lengths: _reference(q, k, v, lengths),
)


def _cache_copied_twice(q, k, v, lengths):
    """Two float64 copies of the whole cache kept at once, then the grouped
    computation: nothing copied per query head."""
    k_copies = [np.array(k, dtype=np.float64) for _ in range(2)]
    v_copies = [np.array(v, dtype=np.float64) for _ in range(2)]
    scores = _grouped(q, k_copies[1], v_copies[1], lengths)
    weights = _softmax(scores)
    out = np.einsum("bign,bine->bige", weights, v_copies[1])
    return out.reshape(q.shape[0], q.shape[1], -1)


CACHE_COPIES = Mistake(
    "cache_copies",
    "nothing was copied per query head (on the same cache with one query "
    "head per key/value head, g = 1, the memory is about the same), but "
    "the step kept several copies of the whole cache at once, or made "
    "many one after another: with this case's g = 8 they take as much "
    "memory as copying the keys per query head",
    "read k_cache and v_cache as they are (slicing and reshaping are "
    "views), or copy each of them at most once",
    _cache_copied_twice,
)
# the mistakes the memory check names
MEMORY_MISTAKES = [REPEATED_KV, CACHE_COPIES]


def _cache(rng, b_size, n_kv, n, d, lengths, stale_scale=3.0):
    """(B, h_kv, n, d) with standard normal written slots and stale slots of
    another distribution (mean 4, spread ``stale_scale``)."""
    x = rng.normal(size=(b_size, n_kv, n, d))
    for b, written in enumerate(lengths):
        x[b, :, written:] = 4.0 + stale_scale * rng.normal(
            size=(n_kv, n - written, d)
        )
    return x


def _case(
    name,
    seed,
    b_size,
    n_heads,
    n_kv,
    n,
    d_k,
    d_v,
    lengths,
    q_scale=1.0,
    k_stale=3.0,
    dtype=np.float64,
):
    rng = np.random.default_rng(seed)
    q = q_scale * rng.normal(size=(b_size, n_heads, d_k))
    k = _cache(rng, b_size, n_kv, n, d_k, lengths, stale_scale=k_stale)
    v = _cache(rng, b_size, n_kv, n, d_v, lengths)
    return Case(
        name,
        (
            q.astype(dtype),
            k.astype(dtype),
            v.astype(dtype),
            np.array(lengths, dtype=np.int64),
        ),
    )


def _with_sequence_below(case, seed, top):
    """``case`` with one more sequence, of length 1, whose one written key
    points against its group's queries: every written score is ``top`` or
    less, below a finite mask value such as -1e4 (the stale slots' scores
    stay in the thousands). Its stale slots and values are drawn as
    :func:`_cache` draws them."""
    q, k, v, lengths = case.args
    _, n_heads, d_k = q.shape
    n_kv, n = k.shape[1], k.shape[2]
    rng = np.random.default_rng(seed)
    q_new = 1000.0 * rng.normal(size=(1, n_heads, d_k))
    k_new = _cache(rng, 1, n_kv, n, d_k, (1,))
    v_new = _cache(rng, 1, n_kv, n, v.shape[-1], (1,))
    # (n_kv, g, d_k): each group's queries, and the direction of their mean
    rows = q_new[0].reshape(n_kv, n_heads // n_kv, d_k)
    mean = rows.mean(axis=1)
    direction = mean / np.linalg.norm(mean, axis=-1, keepdims=True)
    # (n_kv, g): every query of a group has a positive part along it
    along = np.einsum("igd,id->ig", rows, direction) / np.sqrt(d_k)
    assert (along > 0).all()
    k_new[0, :, 0] = direction * (top / along.min(axis=1))[:, None]
    return Case(
        case.name,
        (
            np.concatenate([q, q_new.astype(q.dtype)]),
            np.concatenate([k, k_new.astype(k.dtype)]),
            np.concatenate([v, v_new.astype(v.dtype)]),
            np.append(lengths, 1),
        ),
    )


def decode_cases() -> list[Case]:
    return [
        _case(
            "8 query heads share 2 key/value heads (g = 4), batch 3, "
            "lengths (2, 6, 9) of n = 9 slots",
            0,
            3,
            8,
            2,
            9,
            4,
            4,
            (2, 6, 9),
        ),
        _case(
            "4 query heads share 2 key/value heads (g = 2), batch 2, "
            "lengths (5, 3) of n = 7",
            1,
            2,
            4,
            2,
            7,
            6,
            6,
            (5, 3),
        ),
        _case(
            "multi-query: 6 query heads share 1 key/value head, d_k = 8, "
            "d_v = 3, lengths (1, 7, 4)",
            2,
            3,
            6,
            1,
            7,
            8,
            3,
            (1, 7, 4),
        ),
        _case(
            "multi-head: 3 query heads, 3 key/value heads (g = 1), "
            "lengths (4, 2) of n = 4",
            3,
            2,
            3,
            3,
            4,
            5,
            5,
            (4, 2),
        ),
        _case(
            "a cache of one slot (n = 1): 4 query heads share 2, batch 2",
            4,
            2,
            4,
            2,
            1,
            4,
            4,
            (1, 1),
        ),
        _case(
            "float32 inputs: 6 query heads share 3 key/value heads, lengths "
            "(3, 8)",
            5,
            2,
            6,
            3,
            8,
            4,
            2,
            (3, 8),
            dtype=np.float32,
        ),
        _with_sequence_below(
            _case(
                "large scores: |q . k| / sqrt(d_k) in the thousands, 4 query "
                "heads share 2, lengths (6, 3, 1), the third sequence's one "
                "written key scoring -3e4 or less in every head",
                6,
                2,
                4,
                2,
                6,
                4,
                4,
                (6, 3),
                q_scale=1000.0,
            ),
            seed=16,
            top=-3e4,
        ),
        _case(
            "stale slots holding huge keys (about 1e4): 4 query heads share "
            "2, lengths (2, 5) of n = 8",
            7,
            2,
            4,
            2,
            8,
            4,
            4,
            (2, 5),
            k_stale=1e4,
        ),
    ]


def _close(got, expected) -> bool:
    return same(got, expected, rtol=1e-4, atol=1e-5)


def check_grouped_decode_step(fn) -> None:
    """Check ``fn(q, k_cache, v_cache, lengths)`` computes one grouped-query
    decoding step: q (B, h, d_k), k_cache (B, h_kv, n, d_k), v_cache (B,
    h_kv, n, d_v), lengths (B,) -> (B, h, d_v), query head j reading
    key/value head j // g over the written slots 0 .. lengths[b] - 1 of its
    sequence; and that it never copies the cache per query head (its peak
    memory on a large case, and all it allocates there, line by line)."""
    __tracebackhide__ = True
    run_checks(
        EXERCISE,
        fn,
        decode_cases(),
        _reference,
        DECODE_MISTAKES,
        compare=_close,
        # its "Correct" line waits for the memory check
        quiet=True,
    )
    _check_decode_memory(fn)
    print(
        f"Correct: the {EXERCISE} passes all {len(decode_cases())} cases; "
        "on a batch of 2 caches of 2 key/value heads, 2048 slots of 64 "
        "features, read by 16 query heads, its peak memory stayed under "
        "half, and all it allocated under three-quarters, of what copying "
        "the keys per query head takes."
    )


# the memory case: B, h, h_kv, n, d
MEMORY_SHAPE = (2, 16, 2, 2048, 64)


# the share of the keys repeated per query head that an answer's peak may
# not reach, and the share that all it allocates, added up line by line, may
# not reach: g copies made one group at a time add up to the whole copy (about
# twice the keys repeated when the values are copied too, 0.9 of it for the
# values of the written slots alone), while the right answers allocate the
# scores, a few times B * h * n numbers, and at most one copy of the cache
# itself kept at a time (a float64 copy of keys and values: a quarter of the
# limit's base with g = 8, so two kept at once reach the peak's limit; what
# does not grow with g is named as copies of the whole cache, not per query
# head, by running the answer again with g = 1 on the same cache)
PEAK_SHARE = 0.5
VOLUME_SHARE = 0.75


def _check_decode_memory(fn):
    """Reject an answer whose peak memory on a large case reaches half of the
    keys repeated per query head, or whose allocations, added up line by line,
    reach three-quarters of them; name a per-query-head copy only where the
    memory grows with g (the same cache read with g = 1 says); return (peak,
    volume, repeated)."""
    from ..bench import format_bytes
    from ._framework import (
        allocation_volume,
        as_array,
        peak_memory_with_torch,
        pristine,
        torch_allocation_total,
        torch_profiler_ready,
    )

    __tracebackhide__ = True
    b_size, n_heads, n_kv, n, d = MEMORY_SHAPE
    case = _case(
        f"memory: batch {b_size}, {n_heads} query heads share {n_kv} "
        f"key/value heads, {n} slots of {d} features",
        8,
        b_size,
        n_heads,
        n_kv,
        n,
        d,
        d,
        (n, n - 300),
    )
    # the reference first, on inputs the reader's function has not touched;
    # the function gets copies (it may change them in place)
    expected = _reference(*case.args)
    k_bytes = case.args[1].nbytes
    cache_bytes = k_bytes + case.args[2].nbytes
    # the same cache read by one query head per key/value head (g = 1): the
    # first query head of each group
    q, k, v, lengths = case.args
    one_per_group = (
        np.ascontiguousarray(q[:, :: n_heads // n_kv]),
        k,
        v,
        lengths,
    )

    def volume_of(args):
        _, total = allocation_volume(fn, *pristine(args))
        if torch_profiler_ready():
            total += torch_allocation_total(fn, *pristine(args))[1]
        return total

    def diagnosis(measure, at_g, at_1):
        """The Mistake and a sentence: does the memory grow with g?"""
        said = (
            f"{measure} {format_bytes(at_g)}, {at_g / cache_bytes:.1f} times "
            f"the cache's keys and values ({format_bytes(cache_bytes)}); "
            f"with g = 1 on the same cache it was {format_bytes(at_1)}"
        )
        # a copy per query head grows by g - 1 copies of what it copies;
        # the scores alone grow by far less than the keys
        return (REPEATED_KV if at_g - at_1 >= k_bytes else CACHE_COPIES), said

    # numpy's arrays, and torch's allocations (which tracemalloc does not
    # see) whatever the answer returns: torch inside, numpy out, too
    out, peak = peak_memory_with_torch(fn, *case.args)
    # the keys copied once per query head, float64
    repeated = b_size * n_heads * n * d * 8
    if peak >= PEAK_SHARE * repeated:
        _, peak_1 = peak_memory_with_torch(fn, *one_per_group)
        mistake, said = diagnosis(
            "your function's peak memory was", peak, peak_1
        )
        raise ExerciseError(
            EXERCISE,
            case.name,
            f"{said}; the keys repeated per query head take "
            f"{format_bytes(repeated)}, and the peak may not reach half of "
            "that",
            mistake=mistake,
        )
    if not _close(as_array(out), expected):
        raise ExerciseError(
            EXERCISE,
            case.name,
            "values differ from the reference on a large case",
        )
    # a copy made a piece at a time stays under the peak's limit: add up
    # what each line allocates (numpy), and every allocation of torch's
    volume = volume_of(case.args)
    if volume >= VOLUME_SHARE * repeated:
        mistake, said = diagnosis(
            "it allocated in all, added up line by line,",
            volume,
            volume_of(one_per_group),
        )
        raise ExerciseError(
            EXERCISE,
            case.name,
            f"your function's peak memory was {format_bytes(peak)}, but "
            f"{said} (a copy made one group or one head at a time adds up "
            "to the whole copy); the keys repeated per query head take "
            f"{format_bytes(repeated)}, and the sum may not reach "
            "three-quarters of that",
            mistake=mistake,
        )
    return peak, volume, repeated
