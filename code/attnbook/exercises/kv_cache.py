"""Checker for one step of KV-cache decoding (chapter 8): append the new keys
and values, then attend.

The reader writes ``decode_step(q, k_new, v_new, k_cache, v_cache)``, numpy in
and out:

- ``q, k_new``: (..., n_new, d_k), ``v_new``: (..., n_new, d_v), for the
  ``n_new`` newest tokens (1 when generating, more for a prompt or a chunk);
- ``k_cache``: (..., p, d_k), ``v_cache``: (..., p, d_v), the ``p`` earlier
  tokens (``p`` may be 0; chapter 8 calls the number of cached tokens p);
- returns ``(out, k_cache, v_cache)``: ``out`` (..., n_new, d_v) is causal
  attention of the new queries over all ``p + n_new`` keys (the queries are the
  *last* ``n_new`` positions), and the caches grown to ``p + n_new`` positions,
  old ones first.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from ..attention import scaled_dot_product_attention
from ..masks import causal_mask
from ._framework import (
    FLOAT_MASK_DESCRIPTION,
    FLOAT_MASK_HINT,
    Case,
    Mistake,
    as_array,
    run_checks,
    same,
)

EXERCISE = "KV-cache decoding step"


def _attend(q, k, v, mask, scale=None):
    return scaled_dot_product_attention(q, k, v, mask=mask, scale=scale)[0]


def _reference(q, k_new, v_new, k_cache, v_cache):
    keys = np.concatenate([k_cache, k_new], axis=-2)
    values = np.concatenate([v_cache, v_new], axis=-2)
    # new queries are the last n_new positions
    mask = causal_mask(q.shape[-2], keys.shape[-2])
    return _attend(q, keys, values, mask), keys, values


def _forgets_to_append(q, k_new, v_new, k_cache, v_cache):
    # attends over the old cache only, and hands the old cache back unchanged
    return _attend(q, k_cache, v_cache, None), k_cache, v_cache


def _appends_after_attending(q, k_new, v_new, k_cache, v_cache):
    # the new tokens are not there yet
    out = _attend(q, k_cache, v_cache, None)
    return (
        out,
        np.concatenate([k_cache, k_new], -2),
        np.concatenate([v_cache, v_new], -2),
    )


def _diagonal_hidden(q, k_new, v_new, k_cache, v_cache):
    _, keys, values = _reference(q, k_new, v_new, k_cache, v_cache)
    p = k_cache.shape[-2]
    # query i sees 0..p+i-1
    mask = np.tril(np.ones((q.shape[-2], keys.shape[-2]), dtype=bool), k=p - 1)
    return _attend(q, keys, values, mask), keys, values


def _scaled_by_d_v(q, k_new, v_new, k_cache, v_cache):
    _, keys, values = _reference(q, k_new, v_new, k_cache, v_cache)
    mask = causal_mask(q.shape[-2], keys.shape[-2])
    return (
        _attend(q, keys, values, mask, scale=1 / np.sqrt(v_new.shape[-1])),
        keys,
        values,
    )


def _scaled_by_d_k(q, k_new, v_new, k_cache, v_cache):
    _, keys, values = _reference(q, k_new, v_new, k_cache, v_cache)
    mask = causal_mask(q.shape[-2], keys.shape[-2])
    return (
        _attend(q, keys, values, mask, scale=1 / q.shape[-1]),
        keys,
        values,
    )


def _unscaled(q, k_new, v_new, k_cache, v_cache):
    _, keys, values = _reference(q, k_new, v_new, k_cache, v_cache)
    return (
        _attend(
            q,
            keys,
            values,
            causal_mask(q.shape[-2], keys.shape[-2]),
            scale=1.0,
        ),
        keys,
        values,
    )


def _attends_to_new_only(q, k_new, v_new, k_cache, v_cache):
    n = q.shape[-2]
    out = _attend(q, k_new, v_new, causal_mask(n, n))
    return (
        out,
        np.concatenate([k_cache, k_new], -2),
        np.concatenate([v_cache, v_new], -2),
    )


def _overwrites(q, k_new, v_new, k_cache, v_cache):
    n = q.shape[-2]
    return _attend(q, k_new, v_new, causal_mask(n, n)), k_new, v_new


def _top_left_causal(q, k_new, v_new, k_cache, v_cache):
    _, keys, values = _reference(q, k_new, v_new, k_cache, v_cache)
    # query i sees keys 0..i
    mask = np.tril(np.ones((q.shape[-2], keys.shape[-2]), dtype=bool))
    return _attend(q, keys, values, mask), keys, values


def _mask_one_too_wide(q, k_new, v_new, k_cache, v_cache):
    _, keys, values = _reference(q, k_new, v_new, k_cache, v_cache)
    p = k_cache.shape[-2]
    # query i sees 0..p+i+1: the next new token too
    mask = np.tril(np.ones((q.shape[-2], keys.shape[-2]), dtype=bool), k=p + 1)
    return _attend(q, keys, values, mask), keys, values


def _softmax_over_queries(shift_axis):
    def commit(q, k_new, v_new, k_cache, v_cache):
        _, keys, values = _reference(q, k_new, v_new, k_cache, v_cache)
        scores = q @ np.swapaxes(keys, -1, -2) / np.sqrt(q.shape[-1])
        scores = np.where(
            causal_mask(q.shape[-2], keys.shape[-2]), scores, -np.inf
        )
        # normalised down each column (over the queries), not along each
        # row; shifted by the max along shift_axis
        weights = np.exp(scores - scores.max(shift_axis, keepdims=True))
        weights = weights / weights.sum(-2, keepdims=True)
        return weights @ values, keys, values

    return commit


def _no_causal_mask(q, k_new, v_new, k_cache, v_cache):
    _, keys, values = _reference(q, k_new, v_new, k_cache, v_cache)
    return _attend(q, keys, values, None), keys, values


def _prepends(q, k_new, v_new, k_cache, v_cache):
    keys, values = (
        np.concatenate([k_new, k_cache], -2),
        np.concatenate([v_new, v_cache], -2),
    )
    return (
        _attend(q, keys, values, causal_mask(q.shape[-2], keys.shape[-2])),
        keys,
        values,
    )


def _float_mask_added(q, k_new, v_new, k_cache, v_cache):
    # a float 0/1 mask handed to torch's scaled_dot_product_attention is ADDED
    # to the scores: +1 where a key may be seen, +0 where it may not, so
    # nothing is masked (one new token: +1 everywhere, which is harmless)
    _, keys, values = _reference(q, k_new, v_new, k_cache, v_cache)
    scores = q @ np.swapaxes(keys, -1, -2) / np.sqrt(q.shape[-1])
    scores = scores + causal_mask(q.shape[-2], keys.shape[-2]).astype(
        scores.dtype
    )
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ values, keys, values


MISTAKES = [
    Mistake(
        "forgets_to_append",
        "the new keys and values are never added to the cache: the new token "
        "attends only to the old ones, and the cache you return has not grown",
        "concatenate k_new after k_cache (and v_new after v_cache) along the "
        "position axis, "
        "attend over the result, and return the grown caches",
        _forgets_to_append,
    ),
    Mistake(
        "appends_after_attending",
        "the cache is extended only after attending, so the new token "
        "cannot see itself (its own key and value are missing from its "
        "attention)",
        "append first, then attend: a token's query must meet its own key",
        _appends_after_attending,
    ),
    Mistake(
        "diagonal_hidden",
        "the cache is right, but the causal mask is off by one: it hides the "
        "diagonal, so each new query misses its own key (query i sees keys "
        "0..p+i-1)",
        "new query i sits at position p + i and may see keys 0..p + i, itself "
        "included: "
        "causal_mask(n_new, p + n_new), or np.tril(..., k=p), not k=p - 1 "
        "(with p = 0 the first "
        "query would see no key at all)",
        _diagonal_hidden,
    ),
    Mistake(
        "scaled_by_d_v",
        "the scores are divided by sqrt(d_v), the width of the values, "
        "instead of "
        "sqrt(d_k), the width of the vectors in the dot product",
        "the scale belongs to the scores q . k, whose variance grows with "
        "d_k: divide by "
        "np.sqrt(q.shape[-1]); d_v only sets the width of the output",
        _scaled_by_d_v,
    ),
    Mistake(
        "scaled_by_d_k",
        "the scores are divided by d_k instead of by its square root",
        "the dot product of two vectors of d_k unit-variance features has "
        "variance d_k, so its standard deviation is sqrt(d_k): divide by "
        "np.sqrt(q.shape[-1])",
        _scaled_by_d_k,
    ),
    Mistake(
        "unscaled",
        "the scores are not divided by sqrt(d_k)",
        "scale the scores q k^T by 1 / sqrt(d_k) before the softmax (the "
        "default of "
        "attnbook.scaled_dot_product_attention)",
        _unscaled,
    ),
    Mistake(
        "attends_to_new_only",
        "the new tokens attend only to each other, not to the cached past",
        "attend over the concatenation of the cache and the new keys/values, "
        "not over k_new alone",
        _attends_to_new_only,
    ),
    Mistake(
        "overwrites",
        "the cache is replaced by the new keys and values instead of extended",
        "the returned cache must hold the p old positions followed by the "
        "n_new new ones",
        _overwrites,
    ),
    Mistake(
        "top_left_causal",
        "the causal mask is aligned at the top left (query i sees keys 0..i): "
        "with a cache the new queries are the LAST n_new of the p + n_new "
        "positions",
        "new query i sits at position p + i and may see keys 0..p + i: use "
        "causal_mask(n_new, p + n_new) "
        "or np.tril(..., k=p); this is also what torch's is_causal gets wrong "
        "when n_q != n_k",
        _top_left_causal,
    ),
    Mistake(
        "no_causal_mask",
        "with several new tokens, each attends to the later new tokens too "
        "(no causal mask)",
        "mask the new queries causally: new query i may not see new keys "
        "after position p + i",
        _no_causal_mask,
    ),
    Mistake(
        "float_mask",
        FLOAT_MASK_DESCRIPTION
        + ": the later new tokens of a chunk stay visible (only the chunk "
        "cases show it; part (b) of the exercise asks why)",
        FLOAT_MASK_HINT + "; or pass attn_mask=torch.ones(n_new, p + n_new, "
        "dtype=torch.bool).tril(p)",
        _float_mask_added,
    ),
    Mistake(
        "mask_one_too_wide",
        "the causal mask is off by one the other way: each new query also "
        "sees the new token after it (query i sees keys 0..p+i+1)",
        "new query i sits at position p + i and may see keys 0..p + i: "
        "causal_mask(n_new, p + n_new), or np.tril(..., k=p), not k=p + 1",
        _mask_one_too_wide,
    ),
    Mistake(
        "softmax_over_queries",
        "the softmax normalises each column of the scores (over the queries) "
        "instead of each row (over the keys): a query's weights do not sum "
        "to 1",
        "each query's weights are a distribution over the keys it sees: take "
        "the max and the sum along the last axis (axis=-1), the keys' axis",
        _softmax_over_queries(-2),
    ),
    Mistake(
        # the same, with the usual shift by each row's max: only the sum is
        # taken along the wrong axis
        "softmax_over_queries",
        "the softmax normalises each column of the scores (over the queries) "
        "instead of each row (over the keys): a query's weights do not sum "
        "to 1",
        "each query's weights are a distribution over the keys it sees: take "
        "the sum along the last axis (axis=-1), the keys' axis",
        _softmax_over_queries(-1),
    ),
    Mistake(
        "prepends",
        "the new keys and values are put before the cached ones",
        "the cache is in time order: old positions first, then the new ones "
        "(np.concatenate([k_cache, k_new]))",
        _prepends,
    ),
]


def cases() -> list[Case]:
    rng = np.random.default_rng(8)

    def step(lead, n_new, p, d_k, d_v):
        shape = lambda n, d: (*lead, n, d)  # noqa: E731
        return (
            rng.normal(size=shape(n_new, d_k)),
            rng.normal(size=shape(n_new, d_k)),
            rng.normal(size=shape(n_new, d_v)),
            rng.normal(size=shape(p, d_k)),
            rng.normal(size=shape(p, d_v)),
        )

    return [
        Case(
            "one new token after a cache of 5 (d_k = d_v = 4)",
            step((), 1, 5, 4, 4),
        ),
        Case(
            "one new token after a cache of 6, 2 heads, d_k = 4, d_v = 3",
            step((2,), 1, 6, 4, 3),
        ),
        Case(
            "a chunk of 3 new tokens after a cache of 4, 2 heads",
            step((2,), 3, 4, 5, 5),
        ),
        Case(
            "the prompt: 4 tokens into an empty cache (p = 0)",
            step((), 4, 0, 3, 3),
        ),
        Case(
            "a chunk of 2 new tokens after a cache of 1, batch 2 x 3 heads",
            step((2, 3), 2, 1, 4, 2),
        ),
    ]


def _unpack(out):
    """The reader's ``(out, k_cache, v_cache)`` as three float arrays, or a
    TypeError saying what is wrong."""
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise TypeError(
            "return a triple (out, k_cache, v_cache); got "
            f"{type(out).__name__}"
            + (
                f" of length {len(out)}"
                if isinstance(out, (tuple, list))
                else ""
            )
        )
    return tuple(as_array(x).astype(np.float64) for x in out)


def _same_step(got, expected) -> bool:
    return all(same(g, e) for g, e in zip(_unpack(got), _unpack(expected)))


def _problem(got, expected, case: Case) -> str:
    """What is wrong, shapes first: a cache of the wrong length says more than
    a wrong output."""
    expected = _unpack(expected)
    p = case.args[3].shape[-2]
    names = ("the output", "the returned k_cache", "the returned v_cache")
    for name, g, e in zip(names, got, expected):
        if g.shape != e.shape:
            if (
                name != "the output"
                and g.shape[:-2] == e.shape[:-2]
                and g.shape[-1] == e.shape[-1]
            ):
                have = g.shape[-2]
                return (
                    f"{name} has {have} position{'' if have == 1 else 's'}; "
                    "after this step it should hold "
                    f"p + n_new = {p} + {e.shape[-2] - p} = {e.shape[-2]}"
                )
            return f"{name} has shape {g.shape}, expected {e.shape}"
    for name, g, e in zip(names, got, expected):
        if not same(g, e):
            return (
                f"{name} differs from the reference (largest difference "
                f"{np.max(np.abs(g - e)):.3g})"
            )
    return "the result differs from the reference"


def check_kv_cache_step(fn) -> None:
    """Check ``fn(q, k_new, v_new, k_cache, v_cache) -> (out, k_cache,
    v_cache)`` (module docstring)."""
    __tracebackhide__ = True
    run_checks(
        EXERCISE,
        fn,
        cases(),
        _reference,
        MISTAKES,
        compare=_same_step,
        postprocess=_unpack,
        describe=_problem,
        hint="append first, then attend over old and new keys with "
        "softmax(q k^T / sqrt(d_k)) and the causal mask causal_mask(n_new, p "
        "+ n_new)",
    )


# --- the hard exercise: a decode step on a ring buffer -----------------------
#
# The reader writes ``ring_step(q, k_new, v_new, k_ring, v_ring, pos)``, numpy
# in and out:
#
# - ``q, k_new``: (..., n_new, d_k), ``v_new``: (..., n_new, d_v), the tokens
#   at positions ``pos .. pos + n_new - 1`` (``n_new`` may exceed the window);
# - ``k_ring``: (..., W, d_k), ``v_ring``: (..., W, d_v), a ring of W slots in
#   which position j lives in slot j % W; before the step it holds positions
#   max(0, pos - W) .. pos - 1, and a slot never written holds anything (NaN
#   here, as memory from np.empty may);
# - returns ``(out, k_ring, v_ring)``: ``out`` (..., n_new, d_v) is
#   sliding-window attention, the query at position i over the keys at
#   positions max(0, i - W + 1) .. i (itself and the W - 1 before it), scaled
#   by 1/sqrt(d_k); the rings after the step (updated in place or new), slot
#   j % W holding position j for the last min(pos + n_new, W) positions.
#
# The checker drives the reader's step over whole sequences (a driver owns the
# rings between steps) and compares every output, and the rings after the last
# step, with sliding-window attention over the whole sequence at once.

RING_EXERCISE = "ring-buffer decoding step"


def _window_attend(q, keys, values, q_pos, k_pos, lo, hi, scale=None):
    """Attention of queries at positions ``q_pos`` over keys at ``k_pos``: the
    query at i sees the keys at i + lo .. i + hi (both ends included; ``hi =
    np.inf``: no upper bound); a query that sees no key gets zeros."""
    visible = (k_pos[None, :] >= q_pos[:, None] + lo) & (
        k_pos[None, :] <= q_pos[:, None] + hi
    )
    return _attend(q, keys, values, visible, scale)


def _ring_core(
    q,
    k_new,
    v_new,
    k_ring,
    v_ring,
    pos,
    *,
    lo_offset=0,
    hi=0,
    write=True,
    write_first=False,
    write_before_held=False,
    write_first_read_last=False,
    chunk_causal=True,
    scale=None,
    nan_while_unfilled=False,
    unclipped=False,
    causal_only=False,
):
    """The right step, and (through its options) the mistakes below: reads
    the positions the ring holds, oldest first, with the new ones after them,
    attends under the window, writes the last min(n_new, W) new positions.

    ``write_first`` writes first and reads every key back from the ring, the
    chunk's own too; ``write_before_held`` writes first, reads the held
    positions back from the ring and the chunk's own keys from ``k_new``;
    ``write_first_read_last`` writes first, then reads back the last W
    positions up to the chunk's end, the chunk's own included;
    ``unclipped`` reads the positions pos - W + 1 .. pos - 1 without clipping
    at 0, negative ones included (slots not yet written), as visible keys;
    ``causal_only`` reads the W - 1 held positions the first new query may see
    (as RollingKVCache.update returns them) and masks by the causal upper
    bound alone."""
    k_ring, v_ring = np.array(k_ring), np.array(v_ring)
    w, n = k_ring.shape[-2], q.shape[-2]
    q_pos = pos + np.arange(n)

    def write_new():
        kept = min(n, w)
        slots = q_pos[n - kept :] % w
        k_ring[..., slots, :] = k_new[..., n - kept :, :]
        v_ring[..., slots, :] = v_new[..., n - kept :, :]

    if write_first:
        write_new()
        # each query gathers its window from the ring, by slot
        out = np.stack(
            [
                _window_attend(
                    q[..., i : i + 1, :],
                    k_ring[..., np.arange(max(0, p - w + 1), p + 1) % w, :],
                    v_ring[..., np.arange(max(0, p - w + 1), p + 1) % w, :],
                    np.array([p]),
                    np.arange(max(0, p - w + 1), p + 1),
                    -(w - 1),
                    0,
                    scale,
                )[..., 0, :]
                for i, p in enumerate(q_pos)
            ],
            axis=-2,
        )
        return out, k_ring, v_ring
    if write_first_read_last:
        write_new()
        # the W positions the ring holds after the write, oldest first
        last = np.arange(max(0, pos + n - w), pos + n)
        out = _window_attend(
            q,
            k_ring[..., last % w, :],
            v_ring[..., last % w, :],
            q_pos,
            last,
            -(w - 1),
            0,
            scale,
        )
        return out, k_ring, v_ring
    if write_before_held:
        write_new()
    if unclipped:
        held = np.arange(pos - w + 1, pos)
    elif causal_only:
        held = np.arange(max(0, pos - w + 1), pos)
    else:
        held = np.arange(max(0, pos - w), pos)
    keys = np.concatenate([k_ring[..., held % w, :], k_new], axis=-2)
    values = np.concatenate([v_ring[..., held % w, :], v_new], axis=-2)
    k_pos = np.concatenate([held, q_pos])
    lo = -np.inf if causal_only else -(w - 1) + lo_offset
    if chunk_causal:
        out = _window_attend(q, keys, values, q_pos, k_pos, lo, hi, scale)
    else:
        # every query of the chunk sees what the first may see, and every new
        # token
        first = np.full(n, pos)
        visible = (k_pos[None, :] >= first[:, None] + lo) & (
            (k_pos[None, :] <= first[:, None]) | (k_pos[None, :] >= pos)
        )
        out = _attend(q, keys, values, visible, scale)
    if nan_while_unfilled and pos < w:
        # the whole ring entered the product: 0 x NaN is NaN
        out = np.full_like(out, np.nan)
    if write and not write_before_held:
        write_new()
    return out, k_ring, v_ring


def _ring_reference_step(q, k_new, v_new, k_ring, v_ring, pos):
    return _ring_core(q, k_new, v_new, k_ring, v_ring, pos)


def _ring_rolled(q, k_new, v_new, k_ring, v_ring, pos):
    """Keeps the ring in time order, the newest position in the last slot
    (np.roll, or concatenate and keep the last W), and reads it so: right
    outputs on a ring it filled itself from empty (in the wrong slots), wrong
    ones on a ring filled in slot order (a run that starts mid-sequence)."""
    w, n = k_ring.shape[-2], q.shape[-2]
    m = min(pos, w)
    keys = np.concatenate([k_ring[..., w - m :, :], k_new], axis=-2)
    values = np.concatenate([v_ring[..., w - m :, :], v_new], axis=-2)
    q_pos = pos + np.arange(n)
    k_pos = np.arange(pos - m, pos + n)
    out = _window_attend(q, keys, values, q_pos, k_pos, -(w - 1), 0)
    rolled_k = np.concatenate([k_ring, k_new], axis=-2)[..., -w:, :]
    rolled_v = np.concatenate([v_ring, v_new], axis=-2)[..., -w:, :]
    return out, rolled_k, rolled_v


def _slice_past_the_end(q, k_new, v_new, k_ring, v_ring, pos):
    """Writes the chunk as one slice from slot pos % W: fails where the chunk
    wraps past the last slot."""
    k_ring, v_ring = np.array(k_ring), np.array(v_ring)
    out, _, _ = _ring_core(q, k_new, v_new, k_ring, v_ring, pos)
    s = pos % k_ring.shape[-2]
    k_ring[..., s : s + q.shape[-2], :] = k_new
    v_ring[..., s : s + q.shape[-2], :] = v_new
    return out, k_ring, v_ring


def _writes_chunk_at_once(q, k_new, v_new, k_ring, v_ring, pos):
    """Right outputs; writes every token of the chunk in one assignment,
    into the rings it was given: a chunk longer than W repeats slots."""
    out, _, _ = _ring_core(q, k_new, v_new, k_ring, v_ring, pos)
    slots = (pos + np.arange(q.shape[-2])) % k_ring.shape[-2]
    k_ring[..., slots, :] = k_new
    v_ring[..., slots, :] = v_new
    return out, k_ring, v_ring


def _is_slice_assignment_error(err: Exception) -> bool:
    """numpy's complaint when a slice cut short at the end of an array is
    assigned a longer block."""
    return isinstance(
        err, ValueError
    ) and "could not broadcast input array" in (str(err))


def _ring_mistake(**options):
    return lambda *args: _ring_core(*args, **options)


def _reads_unwritten_token_by_token(q, k_new, v_new, k_ring, v_ring, pos):
    """Writes each token of the chunk, then attends over the whole ring: at
    position i a slot that no position has reached yet (i + 1 < W) holds NaN,
    which poisons that position's output even under a weight of 0; the rings
    end right."""
    out, k_ring, v_ring = _ring_reference_step(
        q, k_new, v_new, k_ring, v_ring, pos
    )
    out = np.array(out, copy=True)
    unfilled = pos + np.arange(q.shape[-2]) + 1 < k_ring.shape[-2]
    out[..., unfilled, :] = np.nan
    return out, k_ring, v_ring


RING_MISTAKES = [
    Mistake(
        "reads_unwritten_slots",
        "before the ring has filled, your attention also reads slots that no "
        "position was ever written to (they hold NaN here, as memory from "
        "np.empty may): even under a weight of 0 a NaN value poisons the "
        "output, since 0 x NaN = NaN; and replacing the NaN (np.nan_to_num) "
        "without masking those slots lets the query attend to them",
        "read only the slots of positions max(0, pos - W) .. pos - 1 (slot j "
        "% W for each); or attend over the whole ring with the unwritten "
        "slots' scores set to -inf and their values set to 0 first: masking "
        "the scores alone is not enough",
        _ring_mistake(nan_while_unfilled=True),
    ),
    Mistake(
        "reads_unwritten_slots_per_token",
        "token by token, your attention also reads slots that no position "
        "has reached yet (they hold NaN here, as memory from np.empty may): "
        "the output of every position i with i + 1 < W is NaN, since even "
        "under a weight of 0 a NaN value poisons it (0 x NaN = NaN)",
        "after writing token i, read only the slots of positions max(0, i - "
        "W + 1) .. i; or attend over the whole ring with the unwritten slots' "
        "scores set to -inf and their values set to 0 first: masking the "
        "scores alone is not enough",
        _reads_unwritten_token_by_token,
    ),
    Mistake(
        "reads_before_position_0",
        "the positions read from the ring are pos - W + 1 .. pos - 1 without "
        "clipping at 0: before the ring has filled they include negative "
        "positions, whose slots (j % W) no position has been written to yet "
        "(they hold NaN here, as memory from np.empty may), and the window "
        "mask lets the query see them, so its output is NaN",
        "a position below 0 does not exist: read j = max(0, pos - W + 1) .. "
        "pos - 1 (or max(0, pos - W) .. pos - 1), and let the key positions "
        "in the mask start there too",
        _ring_mistake(unclipped=True),
    ),
    Mistake(
        "overwrites_before_reading",
        "you write the new keys and values into the ring before reading it: "
        "in a chunk of several new tokens, a later token overwrites the slot "
        "of a position that an earlier query of the same chunk still needs "
        "(the token at pos + 1 takes the slot of position pos + 1 - W, which "
        "the query at pos still sees)",
        "read the held positions first (or take the chunk's own keys from "
        "k_new, never back from the ring), attend, and write only then; with "
        "one new token per step the order does not matter, which is why only "
        "the chunk cases show it",
        _ring_mistake(write_first=True),
    ),
    Mistake(
        # the same mistake, the chunk's own keys taken from k_new: only the
        # held positions are read back from the overwritten ring
        "overwrites_before_reading",
        "you write the new keys and values into the ring before reading the "
        "positions it held: in a chunk of several new tokens, a later token "
        "overwrites the slot of a position that an earlier query of the same "
        "chunk still needs (the token at pos + 1 takes the slot of position "
        "pos + 1 - W, which the query at pos still sees)",
        "read the held positions first, attend, and write only then; with "
        "one new token per step the order does not matter, which is why only "
        "the chunk cases show it",
        _ring_mistake(write_before_held=True),
    ),
    Mistake(
        # the same mistake, the keys read back after the write as the last W
        # positions up to the chunk's end: an early query of the chunk finds
        # its oldest keys gone
        "overwrites_before_reading",
        "you write the chunk into the ring first and then read back the W "
        "positions it holds, the last W up to the chunk's end: an earlier "
        "query of the same chunk still needs older positions, whose slots the "
        "chunk's later tokens have just overwritten (the query at pos sees "
        "pos - W + 1, whose slot the token at pos + 1 took), so it attends "
        "over fewer keys than its window",
        "read the positions the ring held before the step first, attend, and "
        "write only then; with one new token per step the order does not "
        "matter, which is why only the chunk cases show it",
        _ring_mistake(write_first_read_last=True),
    ),
    Mistake(
        "window_one_too_wide",
        "each query sees W + 1 positions, itself and the W before it: the "
        "window is one too wide (all W held positions plus the new token)",
        "the query at i may see positions i - W + 1 .. i: itself and the W - "
        "1 before it, the definition of the window (position i - W is the "
        "one the new token evicts)",
        _ring_mistake(lo_offset=-1),
    ),
    Mistake(
        "window_one_too_narrow",
        "each query sees only W - 1 positions, itself and the W - 2 before "
        "it: the window is one too narrow",
        "the query at i may see positions i - W + 1 .. i, W of them, "
        "itself included",
        _ring_mistake(lo_offset=1),
    ),
    Mistake(
        "forgets_own_key",
        "each query attends to the W positions before it but not to its own "
        "key (the ring read before the new token was added, and the new key "
        "never joined it)",
        "a query must meet its own key: attend over the W - 1 previous "
        "positions and the new token itself",
        _ring_mistake(lo_offset=-1, hi=-1),
    ),
    Mistake(
        "misses_own_key_sees_w_minus_1",
        "each query attends to the W - 1 positions before it but not to its "
        "own key: its window i - W + 1 .. i - 1 stops one short of itself "
        "(with W = 1 it sees nothing at all)",
        "the query at i sees the keys at i - W + 1 .. i, itself included: "
        "key_pos <= i, not key_pos < i",
        _ring_mistake(hi=-1),
    ),
    Mistake(
        "forgets_to_write",
        "the new keys and values are never written into the ring, so later "
        "steps read stale (or unwritten) slots",
        "after attending, write position j to slot j % W (of a chunk longer "
        "than W, only its last W positions)",
        _ring_mistake(write=False),
    ),
    Mistake(
        "no_mask_in_chunk",
        "with several new tokens, each query of the chunk sees every new "
        "token, the later ones too (no causal mask within the chunk)",
        "mask by position: the query at i sees keys at i - W + 1 .. i only, "
        "new ones included",
        _ring_mistake(chunk_causal=False),
    ),
    Mistake(
        "no_upper_bound_in_chunk",
        "inside a chunk each query sees the keys from its own window start "
        "on (key_pos > i - W) with no upper bound: the later new tokens of "
        "the chunk too, so the window's lower bound stands in for both",
        "the query at i sees the keys at i - W + 1 .. i: bound it on both "
        "sides, (key_pos > i - W) & (key_pos <= i)",
        _ring_mistake(hi=np.inf),
    ),
    Mistake(
        "no_lower_bound_in_chunk",
        "inside a chunk each query sees every key up to itself (the causal "
        "mask, key_pos <= i) with no lower bound: the first new query reads "
        "exactly its window, but a later one of the chunk also sees the "
        "positions that have left its window (the query at pos + r up to r "
        "keys too many); this is what the tiny GPT computes when a chunk goes "
        "through RollingKVCache without its window_mask",
        "the query at i sees the keys at i - W + 1 .. i: bound it on both "
        "sides, (key_pos > i - W) & (key_pos <= i); the causal mask alone is "
        "the window only for a single new token",
        _ring_mistake(causal_only=True),
    ),
    Mistake(
        "repeated_slot_write",
        "one assignment writes a slot more than once: a chunk longer than the "
        "window written at once, slots (pos + np.arange(n_new)) % W, repeats "
        "slots, and numpy does not guarantee which of the values assigned to "
        "a repeated index is kept, so the ring may end up holding an earlier "
        "token of the chunk instead of the last (today's numpy happens to "
        "keep the last, which is why your rings came out right)",
        "write only the last min(n_new, W) tokens of the chunk: last = "
        "np.arange(max(0, n_new - W), n_new), then k_ring[..., (pos + last) "
        "% W, :] = k_new[..., last, :]",
        _writes_chunk_at_once,
    ),
    Mistake(
        "time_ordered_ring",
        "the ring is kept in time order (oldest position first, shifted at "
        "every step, as np.roll or concatenate-and-trim do) instead of "
        "position j in slot j % W. On a ring filled in slot order (the cases "
        "that start mid-sequence) your step reads the wrong positions, so its "
        "outputs are wrong; on a ring it filled itself from empty its outputs "
        "are right, but the slots are not where they should be, and it "
        "copies the whole ring at every step, the cost the ring exists to "
        "avoid",
        "write position j to slot j % W and leave every other slot alone; "
        "attention does not care in which order the keys come, so the ring "
        "never needs reordering",
        _ring_rolled,
    ),
    Mistake(
        "slice_past_the_end",
        "the chunk is written as one slice starting at slot pos % W, which "
        "runs past the last slot when the chunk wraps around the ring "
        "(numpy cuts the slice short, and the assignment fails)",
        "write each position to its own slot, slots = (pos + np.arange(n_new))"
        " % W, then k_ring[..., slots, :] = k_new (of a chunk longer than W, "
        "only its last W positions)",
        _slice_past_the_end,
        raises=_is_slice_assignment_error,
    ),
    Mistake(
        "scaled_by_d_v",
        "the scores are divided by sqrt(d_v), the width of the values, "
        "instead of sqrt(d_k)",
        "divide the scores q . k by np.sqrt(q.shape[-1])",
        lambda q, k_new, v_new, k_ring, v_ring, pos: _ring_core(
            q,
            k_new,
            v_new,
            k_ring,
            v_ring,
            pos,
            scale=1 / np.sqrt(v_new.shape[-1]),
        ),
    ),
]


def _ring_after(k, v, window, n, fill=np.nan):
    """The rings after positions 0 .. n - 1: slot j % W holds position j for
    the last min(n, W) of them; a slot never written holds ``fill`` (NaN, or
    finite garbage)."""
    k_ring = np.full((*k.shape[:-2], window, k.shape[-1]), fill, k.dtype)
    v_ring = np.full((*v.shape[:-2], window, v.shape[-1]), fill, v.dtype)
    held = np.arange(max(0, n - window), n)
    k_ring[..., held % window, :] = k[..., held, :]
    v_ring[..., held % window, :] = v[..., held, :]
    return k_ring, v_ring


# what the slots never written hold in the second pass of a case
GARBAGE = 1.0e3


class _WatchedRing(np.ndarray):
    """A ring as the driver hands it to the reader's step: a numpy array that
    notes, in ``_log``, every assignment through indexing (``ring[idx] =
    value``, ``np.put_along_axis``) that writes one slot more than once with
    different values. numpy leaves unspecified which of those values is kept
    (for advanced assignments "there is in general no guarantee for the
    iteration order"). Views (``.view(np.ndarray)`` too), copies made by its
    methods (``.copy()``, ``.astype``) or by numpy's functions (``np.copy``),
    and the results of arithmetic on it are watched too, and so, while the
    driver runs the reader's step, are its conversions ``np.asarray(ring)``,
    ``np.array(ring)`` (``_conversions_watched``), and ``ring.put`` with a
    flat index given twice; writes through torch, and into a fresh array the
    reader makes (``np.zeros``) and returns, are not."""

    _log = None
    _slots = None
    _name = "the ring"

    def __array_finalize__(self, obj):
        self._log = getattr(obj, "_log", None)
        self._slots = getattr(obj, "_slots", None)
        self._name = getattr(obj, "_name", "the ring")

    def watch(self, result):
        """``result`` watched like this ring when it is a plain numpy array
        of the ring's shape of slots (a copy or a view of it)."""
        if (
            self._log is not None
            and type(result) is np.ndarray
            and result.ndim >= 2
            and result.shape[-2] == self._slots
        ):
            result = result.view(_WatchedRing)
            result._log, result._slots = self._log, self._slots
            result._name = self._name
        return result

    def __array_function__(self, func, types, args, kwargs):
        # np.copy(ring) and the like return a plain array: watch it too
        return self.watch(
            super().__array_function__(func, types, args, kwargs)
        )

    def view(self, *args, **kwargs):
        # ring.view(np.ndarray) is a plain array over the same memory
        return self.watch(super().view(*args, **kwargs))

    def __setitem__(self, index, value):
        if (
            self._log is not None
            and self.ndim >= 2
            and self.shape[-2] == self._slots
        ):
            slot = _repeated_slot(self.shape, index, value, self.dtype)
            if slot is not None:
                self._log.append((self._name, slot))
        super().__setitem__(index, value)

    def put(self, indices, values, mode="raise"):
        # ring.put(flat indices, values): a flat index written twice
        if (
            self._log is not None
            and self.ndim >= 2
            and self.shape[-2] == self._slots
        ):
            flat = np.ravel(np.asarray(indices)) % self.size
            unique, counts = np.unique(flat, return_counts=True)
            if (counts > 1).any():
                twice = int(unique[counts > 1][0])
                slot = int(np.unravel_index(twice, self.shape)[-2])
                self._log.append((self._name, slot))
        super().put(indices, values, mode=mode)


def _repeated_slot(shape, index, value, dtype):
    """The slot (axis -2) of the first entry that ``a[index] = value`` on an
    array of ``shape`` assigns more than once with different values, or None
    (also when the assignment cannot be read: numpy then judges it)."""
    try:
        # which entry of the array each assigned element lands on
        targets = np.arange(int(np.prod(shape))).reshape(shape)[index]
        values = np.broadcast_to(
            np.asarray(value).astype(dtype), np.shape(targets)
        )
    except Exception:
        return None
    targets, values = np.ravel(targets), np.ravel(values)
    order = np.argsort(targets, kind="stable")
    targets, values = targets[order], values[order]
    again = targets[1:] == targets[:-1]
    with np.errstate(invalid="ignore"):
        equal = (values[1:] == values[:-1]) | (
            np.isnan(values[1:]) & np.isnan(values[:-1])
            if values.dtype.kind in "fc"
            else False
        )
    clash = np.nonzero(again & ~equal)[0]
    if clash.size == 0:
        return None
    return int(np.unravel_index(targets[clash[0]], shape)[-2])


# numpy's conversions that return a plain array for an ndarray subclass
# without asking the subclass (they are not dispatched to
# ``__array_function__``)
_CONVERSIONS = ("asarray", "array", "ascontiguousarray", "asfortranarray")


@contextlib.contextmanager
def _conversions_watched():
    """While the reader's step runs, ``np.asarray(k_ring)``, ``np.array(
    k_ring)`` and the like return watched arrays, so that a chunk written
    into them in one assignment is seen as well as one written into the
    ring itself; numpy's own functions are restored afterwards."""
    originals = {name: getattr(np, name) for name in _CONVERSIONS}

    def watching(convert):
        @functools.wraps(convert)
        def converted(a, *args, **kwargs):
            out = convert(a, *args, **kwargs)
            return a.watch(out) if isinstance(a, _WatchedRing) else out

        return converted

    for name, convert in originals.items():
        setattr(np, name, watching(convert))
    try:
        yield
    finally:
        for name, convert in originals.items():
            setattr(np, name, convert)


def _watched(ring, log, window, name):
    ring = np.asarray(ring).view(_WatchedRing)
    ring._log, ring._slots, ring._name = log, window, name
    return ring


class _RingRun(tuple):
    """A driven run's ``(outputs, k_ring, v_ring)``, with ``repeated``: where
    one assignment first wrote a slot more than once (a string), or None."""

    repeated = None


def _ring_run(out, k_ring, v_ring, repeated=None):
    run = _RingRun((out, k_ring, v_ring))
    run.repeated = repeated
    return run


def _drive(step):
    """``step`` run over a whole sequence: the driver owns the rings (filled,
    for the positions before ``start``, as a right step would have left them)
    and passes each chunk, then returns ``(outputs from position start on,
    k_ring, v_ring)`` with the slots never written set to NaN, and with
    ``repeated`` saying where an assignment first wrote a slot twice."""

    def run(q, k, v, window, chunks, start=0):
        __tracebackhide__ = True
        result = one_pass(q, k, v, window, chunks, start, np.nan)
        # again with finite garbage in the slots never written: a step that
        # reads them but hides NaN (np.isnan, np.nan_to_num) is right only
        # while they hold NaN; an output that depends on what they hold is
        # marked NaN, as if they had held NaN and been read
        garbage = one_pass(q, k, v, window, chunks, start, GARBAGE)
        out, other = result[0], garbage[0]
        if out.shape == other.shape:
            moved = ~np.isclose(out, other, rtol=1e-9, atol=1e-12)
            moved &= ~np.isnan(out)
            if moved.any():
                out = out.copy()
                out[moved] = np.nan
                result = _ring_run(out, result[1], result[2], result.repeated)
        return result

    def one_pass(q, k, v, window, chunks, start, fill):
        k_ring, v_ring = _ring_after(k, v, window, start, fill)
        outs, pos, log, repeated = [], start, [], None
        for n in chunks:
            chunk = slice(pos, pos + n)
            args = (
                q[..., chunk, :].copy(),
                k[..., chunk, :].copy(),
                v[..., chunk, :].copy(),
                _watched(k_ring, log, window, "k_ring"),
                _watched(v_ring, log, window, "v_ring"),
                pos,
            )
            with _conversions_watched():
                got = step(*args)
            out, k_ring, v_ring = _ring_triple(got)
            if log and repeated is None:
                name, slot = log[0]
                repeated = (
                    f"slot {slot} of {name}, in the step at pos = {pos} with "
                    f"n_new = {n} on a ring of W = {window}"
                )
            outs.append(out)
            pos += n
        out = np.concatenate(outs, axis=-2).astype(np.float64)
        k_ring, v_ring = (r.astype(np.float64) for r in (k_ring, v_ring))
        # a slot never written may hold anything the reader put there
        unwritten = np.arange(min(pos, window), window)
        for ring in (k_ring, v_ring):
            if ring.shape[-2] == window:
                ring[..., unwritten, :] = np.nan
        return _ring_run(out, k_ring, v_ring, repeated)

    return run


def _ring_triple(got):
    """The reader's ``(out, k_ring, v_ring)`` as arrays of their own dtype, or
    a TypeError saying what is wrong."""
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        raise TypeError(
            "return a triple (out, k_ring, v_ring); got "
            f"{type(got).__name__}"
            + (
                f" of length {len(got)}"
                if isinstance(got, (tuple, list))
                else ""
            )
        )
    return tuple(as_array(x) for x in got)


def _ring_reference(q, k, v, window, chunks, start=0):
    """Sliding-window attention over the whole sequence at once, and the rings
    after it (independent of the step: no ring is read)."""
    n = q.shape[-2]
    out = _attend(
        q.astype(np.float64),
        k.astype(np.float64),
        v.astype(np.float64),
        _sliding_window(n, window),
    )[..., start:, :]
    k_ring, v_ring = _ring_after(
        k.astype(np.float64), v.astype(np.float64), window, n
    )
    return _ring_run(out, k_ring, v_ring)


def _sliding_window(n, window):
    i = np.arange(n)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)


def ring_cases() -> list[Case]:
    rng = np.random.default_rng(18)

    def seq(lead, n, d_k, d_v, window, chunks, start=0, dtype=np.float64):
        assert start + sum(chunks) == n
        q, k = (rng.normal(size=(*lead, n, d_k)).astype(dtype) for _ in "qk")
        v = rng.normal(size=(*lead, n, d_v)).astype(dtype)
        return (q, k, v, window, chunks, start)

    return [
        Case(
            "a full ring of W = 4 slots holding positions 6..9, then one "
            "token "
            "at a time up to position 15 (d_k = 4, d_v = 3)",
            seq((), 16, 4, 3, 4, [1] * 6, start=10),
        ),
        Case(
            "an empty ring of W = 4 (unwritten slots hold NaN), then one "
            "token "
            "at a time, 11 tokens: the ring wraps twice",
            seq((), 11, 3, 3, 4, [1] * 11),
        ),
        Case(
            "W = 1: each token sees only itself, 3 tokens one at a time",
            seq((), 3, 2, 2, 1, [1, 1, 1]),
        ),
        Case(
            "chunks of 2 and 3 tokens wrapping around a ring of W = 5, 2 "
            "heads",
            seq((2,), 13, 4, 2, 5, [2, 3, 3, 3, 2]),
        ),
        Case(
            "a prompt of 6 into an empty ring of W = 4 (a chunk longer than "
            "the window), then 3 single tokens",
            seq((), 9, 3, 4, 4, [6, 1, 1, 1]),
        ),
        Case(
            "float32, batch 2 x 3 heads, a ring of W = 3 holding positions "
            "2..4, then chunks of 2, 4 and 1",
            seq((2, 3), 12, 4, 3, 3, [2, 4, 1], start=5, dtype=np.float32),
        ),
        Case(
            "the ring never fills: W = 8, 5 tokens in chunks of 2, 1 and 2",
            seq((), 5, 3, 3, 8, [2, 1, 2]),
        ),
    ]


def _same_ring_run(got, expected) -> bool:
    """The same outputs and rings, and a slot written twice in one assignment
    in both runs or in neither."""
    twice = [getattr(r, "repeated", None) is not None for r in (got, expected)]
    return twice[0] == twice[1] and all(
        same(g, e) for g, e in zip(got, expected)
    )


def _positions(flags):
    """The positions (axis -2) at which any entry of ``flags`` is True."""
    return np.nonzero(flags.reshape(-1, *flags.shape[-2:]).any((0, 2)))[0]


def _ring_problem(got, expected, case: Case) -> str:
    """What is wrong: the rings' shapes first, then the outputs (from which
    position on), then the rings' contents."""
    _, _, _, window, chunks, start = case.args
    names = ("the returned k_ring", "the returned v_ring")
    for name, g, e in zip(names, got[1:], expected[1:]):
        if g.shape != e.shape:
            return (
                f"{name} has shape {g.shape}, expected {e.shape}: the ring "
                f"keeps W = {window} slots however long the text (position j "
                "in slot j % W)"
            )
    out, want = got[0], expected[0]
    if out.shape != want.shape:
        return f"the outputs have shape {out.shape}, expected {want.shape}"
    with np.errstate(invalid="ignore"):
        bad = ~np.isclose(out, want, rtol=1e-5, atol=1e-6)
    if bad.any():
        first = int(_positions(bad)[0])
        nan = np.isnan(out)
        # a largest difference only over the entries that are numbers, and
        # named so: next to NaN an unlabelled tiny maximum would mislead
        wrong_numbers = bad & ~nan
        details = []
        if nan.any():
            nan_at = _positions(nan)
            details.append(
                f"NaN at {len(nan_at)} position"
                f"{'' if len(nan_at) == 1 else 's'}, the first "
                f"{start + int(nan_at[0])}"
            )
        if wrong_numbers.any():
            largest = float(np.abs(out - want)[wrong_numbers].max())
            label = "among the outputs that are not NaN, " if nan.any() else ""
            details.append(f"{label}largest difference {largest:.3g}")
        return (
            f"the output of position {start + first} is the first that "
            "differs from sliding-window attention ("
            + "; ".join(details)
            + ")"
        )
    if getattr(got, "repeated", None) is not None:
        return (
            "the outputs are right, but one assignment wrote a slot more "
            f"than once with different values ({got.repeated}): which value "
            "numpy keeps is not specified"
        )
    return (
        "the outputs are right, but after the last step the ring's slots do "
        "not hold what they should: slot j % W holds position j, for the "
        f"last min(n, W = {window}) positions"
    )


def check_ring_decode_step(fn) -> None:
    """Check ``fn(q, k_new, v_new, k_ring, v_ring, pos) -> (out, k_ring,
    v_ring)``, a decoding step on a ring of W slots (the comments above
    ``RING_EXERCISE``)."""
    __tracebackhide__ = True
    run_checks(
        RING_EXERCISE,
        _drive(fn),
        ring_cases(),
        _ring_reference,
        [
            Mistake(m.key, m.description, m.hint, _drive(m.commit), m.raises)
            for m in RING_MISTAKES
        ],
        compare=_same_ring_run,
        describe=_ring_problem,
        hint="take the first and the last query of a chunk: list the "
        "positions each must see (its window), and for each say where its "
        "key is when the query reads it, in a slot of the ring (which "
        "position does that slot hold at that moment?) or only in k_new",
    )
