"""The grouped-query decoding step checker (chapter 12's hard exercise)
rejects each classic mistake with its diagnosis and accepts right answers.

The wrong solutions are written here independently of the checker's Mistake
functions, the way a student who half-understood the section might write
them: loops over sequences and heads, einsum over a grouped layout, masks
built with comparisons, np.repeat and torch.
"""

import numpy as np
import pytest
import torch

from attnbook.exercises import (
    ExerciseError,
    NotAttemptedError,
    check_grouped_decode_step,
)
from attnbook.exercises import gqa_decode
from attnbook.exercises._framework import peak_memory_with_torch, pristine


def _softmax_rows(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _written(lengths, n):
    """(B, n) booleans: slot j of sequence b has been written."""
    return np.arange(n)[None, :] < np.asarray(lengths)[:, None]


# --- right answers -----------------------------------------------------------


def decode_by_loops(q, k_cache, v_cache, lengths):
    """Right: for each sequence and key/value head, slice the written slots
    and serve the whole group as g query rows."""
    b_size, n_heads, d_k = q.shape
    n_kv = k_cache.shape[1]
    g = n_heads // n_kv
    out = np.zeros((b_size, n_heads, v_cache.shape[-1]))
    for b in range(b_size):
        keys = k_cache[b, :, : lengths[b]]
        values = v_cache[b, :, : lengths[b]]
        for i in range(n_kv):
            rows = q[b, i * g : (i + 1) * g]  # (g, d_k)
            scores = rows @ keys[i].T / np.sqrt(d_k)  # (g, L)
            out[b, i * g : (i + 1) * g] = _softmax_rows(scores) @ values[i]
    return out


def decode_einsum_float32(q, k_cache, v_cache, lengths):
    """Right: the grouped layout with einsum and a -inf mask, computed in the
    inputs' dtype (float32 stays float32)."""
    b_size, n_heads, d_k = q.shape
    n_kv, n = k_cache.shape[1], k_cache.shape[2]
    grouped = q.reshape(b_size, n_kv, n_heads // n_kv, d_k)
    scores = np.einsum("bhgd,bhnd->bhgn", grouped, k_cache)
    scores = scores / np.sqrt(np.asarray(d_k, dtype=q.dtype))
    mask = _written(lengths, n)[:, None, None, :]
    scores = np.where(mask, scores, -np.inf)
    weights = _softmax_rows(scores)
    out = np.einsum("bhgn,bhne->bhge", weights, v_cache)
    return out.reshape(b_size, n_heads, -1)


def decode_broadcast_matmul(q, k_cache, v_cache, lengths):
    """Right: numpy's matmul broadcasts a stride-0 group axis without copying
    (unlike torch.matmul): (B, H_kv, g, 1, d) @ (B, H_kv, 1, d, n)."""
    b_size, n_heads, d_k = q.shape
    n_kv, n = k_cache.shape[1], k_cache.shape[2]
    g = n_heads // n_kv
    rows = q.reshape(b_size, n_kv, g, 1, d_k)
    scores = (rows @ k_cache[:, :, None].swapaxes(-1, -2))[..., 0, :]
    scores /= np.sqrt(d_k)
    scores[
        ~np.broadcast_to(_written(lengths, n)[:, None, None], scores.shape)
    ] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    out = (weights[..., None, :] @ v_cache[:, :, None])[..., 0, :]
    return out.reshape(b_size, n_heads, -1)


def decode_in_place(q, k_cache, v_cache, lengths):
    """Right, but scales the caller's q in place (the checker notes it)."""
    q /= np.sqrt(q.shape[-1])
    b_size, n_heads, _ = q.shape
    n_kv = k_cache.shape[1]
    out = np.empty((b_size, n_heads, v_cache.shape[-1]))
    for b in range(b_size):
        for j in range(n_heads):
            i = j * n_kv // n_heads
            s = k_cache[b, i, : lengths[b]] @ q[b, j]
            out[b, j] = _softmax_rows(s) @ v_cache[b, i, : lengths[b]]
    return out


def decode_torch_grouped(q, k_cache, v_cache, lengths):
    """Right: torch, the queries viewed as (B, H_kv, g, d), a masked
    softmax."""
    q, k, v = (torch.from_numpy(np.asarray(a)) for a in (q, k_cache, v_cache))
    b_size, n_heads, d_k = q.shape
    n_kv, n = k.shape[1], k.shape[2]
    rows = q.view(b_size, n_kv, n_heads // n_kv, d_k)
    scores = rows @ k.transpose(-1, -2) / d_k**0.5
    mask = torch.arange(n) < torch.as_tensor(lengths)[:, None]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.reshape(b_size, n_heads, -1)


def decode_fill_dtype_min(q, k_cache, v_cache, lengths):
    """Right: the stale scores set to the most negative number of their dtype
    rather than -inf, below any score the cases produce (written scores reach
    -7e4 and no lower), so their exponentials are exactly 0."""
    b_size, n_heads, d_k = q.shape
    n_kv, n = k_cache.shape[1], k_cache.shape[2]
    rows = q.reshape(b_size, n_kv, n_heads // n_kv, d_k)
    scores = np.einsum("bhgd,bhnd->bhgn", rows, k_cache) / np.sqrt(d_k)
    stale = ~_written(lengths, n)[:, None, None]
    scores = np.where(stale, np.finfo(scores.dtype).min, scores)
    out = np.einsum("bhgn,bhne->bhge", _softmax_rows(scores), v_cache)
    return out.reshape(b_size, n_heads, -1)


# --- wrong answers -----------------------------------------------------------


def decode_groups_transposed(q, k_cache, v_cache, lengths):
    """Wrong order: q viewed as (B, g, H_kv, d), so query head j meets
    key/value head j % H_kv."""
    b_size, n_heads, d_k = q.shape
    n_kv, n = k_cache.shape[1], k_cache.shape[2]
    rows = q.reshape(b_size, n_heads // n_kv, n_kv, d_k)
    scores = np.einsum("bghd,bhnd->bhgn", rows, k_cache) / np.sqrt(d_k)
    scores = np.where(_written(lengths, n)[:, None, None], scores, -np.inf)
    out = np.einsum("bhgn,bhne->bghe", _softmax_rows(scores), v_cache)
    return out.reshape(b_size, n_heads, -1)


def decode_tiled(q, k_cache, v_cache, lengths):
    """Wrong order: the cache tiled with np.tile (copies, and in the wrong
    order)."""
    g = q.shape[1] // k_cache.shape[1]
    k = np.tile(k_cache, (1, g, 1, 1))
    v = np.tile(v_cache, (1, g, 1, 1))
    scores = np.einsum("bhd,bhnd->bhn", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(_written(lengths, k.shape[2])[:, None], scores, -np.inf)
    return np.einsum("bhn,bhne->bhe", _softmax_rows(scores), v)


def decode_outputs_swapped(q, k_cache, v_cache, lengths):
    """Right groups, but the result transposed to (B, g, H_kv, d_v) before
    flattening the heads."""
    b_size, n_heads, d_k = q.shape
    n_kv, n = k_cache.shape[1], k_cache.shape[2]
    rows = q.reshape(b_size, n_kv, n_heads // n_kv, d_k)
    scores = np.einsum("bhgd,bhnd->bhgn", rows, k_cache) / np.sqrt(d_k)
    scores = np.where(_written(lengths, n)[:, None, None], scores, -np.inf)
    out = np.einsum("bhgn,bhne->bghe", _softmax_rows(scores), v_cache)
    return out.reshape(b_size, n_heads, -1)


def decode_whole_cache(q, k_cache, v_cache, lengths):
    """Ignores lengths: every slot of the cache is attended to."""
    b_size, n_heads, d_k = q.shape
    g = n_heads // k_cache.shape[1]
    out = np.empty((b_size, n_heads, v_cache.shape[-1]))
    for b in range(b_size):
        for j in range(n_heads):
            s = k_cache[b, j // g] @ q[b, j] / np.sqrt(d_k)
            out[b, j] = _softmax_rows(s) @ v_cache[b, j // g]
    return out


def decode_before_newest(q, k_cache, v_cache, lengths):
    """Masks with arange(n) < lengths - 1, as if the new token's own slot were
    not written yet."""
    return decode_einsum_float32(q, k_cache, v_cache, np.asarray(lengths) - 1)


def decode_through_length(q, k_cache, v_cache, lengths):
    """Masks with arange(n) <= lengths: one stale slot too many."""
    n = k_cache.shape[2]
    return decode_einsum_float32(
        q, k_cache, v_cache, np.minimum(np.asarray(lengths) + 1, n)
    )


def decode_mask_after(q, k_cache, v_cache, lengths):
    """Softmax over all slots, then multiplies the weights by the mask."""
    b_size, n_heads, d_k = q.shape
    n_kv, n = k_cache.shape[1], k_cache.shape[2]
    rows = q.reshape(b_size, n_kv, n_heads // n_kv, d_k)
    scores = np.einsum("bhgd,bhnd->bhgn", rows, k_cache) / np.sqrt(d_k)
    weights = _softmax_rows(scores) * _written(lengths, n)[:, None, None]
    out = np.einsum("bhgn,bhne->bhge", weights, v_cache)
    return out.reshape(b_size, n_heads, -1)


def decode_softmax_axis_2(q, k_cache, v_cache, lengths):
    """The softmax over axis 2 of (B, H_kv, g, L): the group, not the
    slots."""
    b_size, n_heads, d_k = q.shape
    n_kv = k_cache.shape[1]
    g = n_heads // n_kv
    out = np.empty((b_size, n_heads, v_cache.shape[-1]))
    for b in range(b_size):
        L = lengths[b]
        rows = q[b].reshape(n_kv, g, d_k)
        scores = rows @ k_cache[b, :, :L].transpose(0, 2, 1) / np.sqrt(d_k)
        e = np.exp(scores - scores.max(axis=1, keepdims=True))
        weights = e / e.sum(axis=1, keepdims=True)
        out[b] = (weights @ v_cache[b, :, :L]).reshape(n_heads, -1)
    return out


def decode_softmax_group_masked(q, k_cache, v_cache, lengths):
    """The softmax over the group axis of (B, H_kv, g, n), the stale slots
    masked with -inf first: a stale slot's column is -inf for the whole
    group, so its weights are 0 / 0 = NaN, and so is every output of a
    sequence with a stale slot."""
    b_size, n_heads, d_k = q.shape
    n_kv, n = k_cache.shape[1], k_cache.shape[2]
    rows = q.reshape(b_size, n_kv, n_heads // n_kv, d_k)
    scores = np.einsum("bhgd,bhnd->bhgn", rows, k_cache) / np.sqrt(d_k)
    scores = np.where(_written(lengths, n)[:, None, None], scores, -np.inf)
    e = np.exp(scores - scores.max(axis=2, keepdims=True))
    weights = e / e.sum(axis=2, keepdims=True)
    out = np.einsum("bhgn,bhne->bhge", weights, v_cache)
    return out.reshape(b_size, n_heads, -1)


def decode_softmax_group_unmasked(q, k_cache, v_cache, lengths):
    """The softmax over the group axis, in a loop over the groups, with no
    mask at all (student reading s12f): the stale slots take part."""
    b_size, n_heads, d_k = q.shape
    n_kv = k_cache.shape[1]
    g = n_heads // n_kv
    out = np.empty((b_size, n_heads, v_cache.shape[-1]))
    for b in range(b_size):
        for i in range(n_kv):
            rows = q[b, i * g : (i + 1) * g]
            scores = rows @ k_cache[b, i].T / np.sqrt(d_k)
            e = np.exp(scores - scores.max(axis=0))
            out[b, i * g : (i + 1) * g] = e / e.sum(axis=0) @ v_cache[b, i]
    return out


def decode_softmax_group_finite_mask(q, k_cache, v_cache, lengths):
    """The softmax over axis -2 of (B, H_kv, g, n) after a finite mask of
    -1e4 (student reading s12f)."""
    b_size, n_heads, d_k = q.shape
    n_kv, n = k_cache.shape[1], k_cache.shape[2]
    rows = q.reshape(b_size, n_kv, n_heads // n_kv, d_k)
    scores = rows @ np.swapaxes(k_cache, -1, -2) / np.sqrt(d_k)
    scores = np.where(_written(lengths, n)[:, None, None], scores, -1e4)
    e = np.exp(scores - scores.max(axis=-2, keepdims=True))
    weights = e / e.sum(axis=-2, keepdims=True)
    return (weights @ v_cache).reshape(b_size, n_heads, -1)


def decode_split_g_first(q, k_cache, v_cache, lengths):
    """Wrong on the way in and on the way out: q split as (B, g, H_kv, d),
    transposed to (B, H_kv, g, d) to meet the cache, and the result flattened
    straight from (B, H_kv, g, d_v). Query head j = m*H_kv + i reads
    key/value head i = j % H_kv, and its output lands in slot i*g + m."""
    b_size, n_heads, d_k = q.shape
    n_kv, n = k_cache.shape[1], k_cache.shape[2]
    g = n_heads // n_kv
    rows = q.reshape(b_size, g, n_kv, d_k).transpose(0, 2, 1, 3)
    scores = rows @ k_cache.transpose(0, 1, 3, 2) / np.sqrt(d_k)
    mask = _written(lengths, n)[:, None, None]
    weights = _softmax_rows(np.where(mask, scores, -np.inf))
    return (weights @ v_cache).reshape(b_size, n_heads, -1)


def decode_max_before_mask(q, k_cache, v_cache, lengths):
    """Subtracts the maximum over all n slots, then masks."""
    b_size, n_heads, d_k = q.shape
    n_kv, n = k_cache.shape[1], k_cache.shape[2]
    rows = q.reshape(b_size, n_kv, n_heads // n_kv, d_k)
    scores = np.einsum("bhgd,bhnd->bhgn", rows, k_cache) / np.sqrt(d_k)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    e = e * _written(lengths, n)[:, None, None]
    out = np.einsum("bhgn,bhne->bhge", e / e.sum(-1, keepdims=True), v_cache)
    return out.reshape(b_size, n_heads, -1)


def decode_no_max(q, k_cache, v_cache, lengths):
    """exp of the raw scores, masked by multiplication."""
    b_size, n_heads, d_k = q.shape
    n_kv, n = k_cache.shape[1], k_cache.shape[2]
    rows = q.reshape(b_size, n_kv, n_heads // n_kv, d_k)
    scores = np.einsum("bhgd,bhnd->bhgn", rows, k_cache) / np.sqrt(d_k)
    e = np.exp(scores) * _written(lengths, n)[:, None, None]
    out = np.einsum("bhgn,bhne->bhge", e / e.sum(-1, keepdims=True), v_cache)
    return out.reshape(b_size, n_heads, -1)


def _loop_with_scale(scale_of):
    def decode(q, k_cache, v_cache, lengths):
        b_size, n_heads, d_k = q.shape
        g = n_heads // k_cache.shape[1]
        scale = scale_of(d_k, v_cache.shape[-1], g)
        out = np.empty((b_size, n_heads, v_cache.shape[-1]))
        for b in range(b_size):
            for j in range(n_heads):
                s = k_cache[b, j // g, : lengths[b]] @ q[b, j] / scale
                out[b, j] = _softmax_rows(s) @ v_cache[b, j // g, : lengths[b]]
        return out

    return decode


decode_unscaled = _loop_with_scale(lambda d_k, d_v, g: 1.0)
decode_unscaled.__doc__ = "Forgets the 1/sqrt(d_k)."
decode_group_scale = _loop_with_scale(lambda d_k, d_v, g: np.sqrt(g * d_k))
decode_group_scale.__doc__ = "Divides by sqrt(g d_k): the stacked rows' size."
decode_value_scale = _loop_with_scale(lambda d_k, d_v, g: np.sqrt(d_v))
decode_value_scale.__doc__ = "Divides by sqrt of the value features."


def decode_np_repeat(q, k_cache, v_cache, lengths):
    """Right values, but the cache copied per query head with np.repeat."""
    g = q.shape[1] // k_cache.shape[1]
    k = np.repeat(k_cache, g, axis=1)
    v = np.repeat(v_cache, g, axis=1)
    scores = np.einsum("bhd,bhnd->bhn", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(_written(lengths, k.shape[2])[:, None], scores, -np.inf)
    return np.einsum("bhn,bhne->bhe", _softmax_rows(scores), v)


def decode_torch_repeat_interleave(q, k_cache, v_cache, lengths):
    """Right values, but torch's repeat_interleave copies the cache."""
    q, k, v = (torch.from_numpy(np.asarray(a)) for a in (q, k_cache, v_cache))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.einsum("bhd,bhnd->bhn", q, k) / q.shape[-1] ** 0.5
    mask = torch.arange(k.shape[2]) < torch.as_tensor(lengths)[:, None]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhn,bhne->bhe", torch.softmax(scores, -1), v)


def decode_torch_repeat_to_numpy(q, k_cache, v_cache, lengths):
    """Right values, the cache copied per query head with torch's
    repeat_interleave, the result returned as a numpy array (the old checker
    measured torch's memory only for a returned tensor, and accepted it)."""
    q, k, v = (torch.as_tensor(a) for a in (q, k_cache, v_cache))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = torch.einsum("bhd,bhnd->bhn", q, k) / q.shape[-1] ** 0.5
    mask = torch.arange(k.shape[2]) < torch.as_tensor(lengths)[:, None]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    out = torch.einsum("bhn,bhne->bhe", torch.softmax(scores, -1), v)
    return out.numpy()


def decode_torch_broadcast_to_numpy(q, k_cache, v_cache, lengths):
    """Right values, the chapter's broadcasting torch matmul (B, H_kv, g, 1,
    d) @ (B, H_kv, 1, d, n), which copies the keys per query head (unlike
    numpy's), returned as a numpy array (accepted by the old checker)."""
    q, k, v = (torch.as_tensor(a) for a in (q, k_cache, v_cache))
    b_size, n_heads, d_k = q.shape
    n_kv, n = k.shape[1], k.shape[2]
    rows = q.reshape(b_size, n_kv, n_heads // n_kv, 1, d_k)
    scores = (rows @ k[:, :, None].transpose(-2, -1))[..., 0, :] / d_k**0.5
    mask = torch.arange(n) < torch.as_tensor(lengths)[:, None]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    weights = torch.softmax(scores, -1)
    out = (weights[..., None, :] @ v[:, :, None])[..., 0, :]
    return out.reshape(b_size, n_heads, -1).numpy()


def decode_repeat_per_group(q, k_cache, v_cache, lengths):
    """Right values, the cache copied per query head one group at a time
    (expert reading gqa12c, session 10): np.repeat of one key/value head
    for the g query heads of its group, its scores, then the same for the
    values. Each copy is one group's, so the peak stays under the limit; the
    copies add up to g times the cache."""
    b_size, n_heads, d_k = q.shape
    n_kv = k_cache.shape[1]
    g = n_heads // n_kv
    out = np.empty((b_size, n_heads, v_cache.shape[-1]))
    for b in range(b_size):
        L = int(lengths[b])
        for i in range(n_kv):
            rows = q[b, i * g : (i + 1) * g]
            # (g, n, d_k): one copy per query head of the group, dropped
            # as soon as the scores are made
            s = np.einsum(
                "gd,gnd->gn", rows, np.repeat(k_cache[b, i][None], g, 0)
            )
            weights = _softmax_rows(s[:, :L] / np.sqrt(d_k))
            out[b, i * g : (i + 1) * g] = np.einsum(
                "gn,gne->ge", weights, np.repeat(v_cache[b, i, :L][None], g, 0)
            )
    return out


def decode_keys_per_head(q, k_cache, v_cache, lengths):
    """Right values, a loop over query heads that takes a float64 copy
    (astype copies) of its key/value head's written keys and values for each
    query head: g copies of the cache, one head at a time."""
    b_size, n_heads, d_k = q.shape
    g = n_heads // k_cache.shape[1]
    out = np.empty((b_size, n_heads, v_cache.shape[-1]))
    for b in range(b_size):
        for j in range(n_heads):
            keys = k_cache[b, j // g, : lengths[b]].astype(np.float64)
            values = v_cache[b, j // g, : lengths[b]].astype(np.float64)
            out[b, j] = _softmax_rows(keys @ q[b, j] / np.sqrt(d_k)) @ values
    return out


def decode_torch_expand_per_group(q, k_cache, v_cache, lengths):
    """Right values, torch: each group's key/value head expanded to g heads
    and made contiguous (a copy) one group at a time."""
    q, k, v = (torch.as_tensor(a) for a in (q, k_cache, v_cache))
    b_size, n_heads, d_k = q.shape
    n_kv = k.shape[1]
    g = n_heads // n_kv
    out = torch.empty(b_size, n_heads, v.shape[-1], dtype=q.dtype)
    for b in range(b_size):
        L = int(lengths[b])
        for i in range(n_kv):
            keys = k[b, i, :L].expand(g, -1, -1).contiguous()
            values = v[b, i, :L].expand(g, -1, -1).contiguous()
            rows = q[b, i * g : (i + 1) * g, None]  # (g, 1, d_k)
            s = rows @ keys.transpose(1, 2) / d_k**0.5
            out[b, i * g : (i + 1) * g] = (torch.softmax(s, -1) @ values)[:, 0]
    return out.numpy()


def decode_one_copy_of_cache(q, k_cache, v_cache, lengths):
    """Right: one contiguous float64 copy of the keys and of the values
    (np.array copies), then the grouped layout: a copy of the cache, not per
    query head."""
    k = np.array(k_cache, dtype=np.float64)
    v = np.array(v_cache, dtype=np.float64)
    return decode_einsum_float32(q, k, v, lengths)


def decode_two_copies_of_cache(q, k_cache, v_cache, lengths):
    """Right values and no copy per query head, but two float64 copies of
    the keys and of the values kept alive together (expert reading x12gqa):
    at g = 8 they take half of the keys repeated per query head."""
    k = np.array(k_cache, dtype=np.float64)
    v = np.array(v_cache, dtype=np.float64)
    k2, v2 = k.copy(), v.copy()
    return decode_einsum_float32(q, k2, v2, lengths)


def decode_two_copies_in_turn(q, k_cache, v_cache, lengths):
    """Right: two float64 copies of the keys and values, each dropped before
    the next (expert reading x12gqa): never more than one copy at a time."""
    k = np.array(k_cache, dtype=np.float64)
    v = np.array(v_cache, dtype=np.float64)
    k = k * 1.0
    v = v * 1.0
    return decode_einsum_float32(q, k, v, lengths)


def decode_float32_per_sequence(q, k_cache, v_cache, lengths):
    """Right: a loop over sequences, each sequence's written slots copied
    to float32 once, and its groups served as g rows."""
    b_size, n_heads, d_k = q.shape
    n_kv = k_cache.shape[1]
    g = n_heads // n_kv
    out = np.empty((b_size, n_heads, v_cache.shape[-1]))
    for b in range(b_size):
        keys = k_cache[b, :, : lengths[b]].astype(np.float32)
        values = v_cache[b, :, : lengths[b]].astype(np.float32)
        rows = q[b].reshape(n_kv, g, d_k).astype(np.float32)
        s = rows @ keys.transpose(0, 2, 1) / np.sqrt(d_k)
        out[b] = (_softmax_rows(s) @ values).reshape(n_heads, -1)
    return out


def decode_mask_times_exp(q, k_cache, v_cache, lengths):
    """Shifts by the maximum over the written slots, as the chapter says, but
    masks by multiplying the exponentials by 0/1 afterwards (expert reading
    gqa12a, session 9): a stale score far above the written maximum
    overflows to inf, and inf * 0 is NaN."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k_cache, v_cache))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scores = np.einsum("bhd,bhnd->bhn", q, k) / np.sqrt(q.shape[-1])
    written = np.arange(k.shape[2]) < np.asarray(lengths)[:, None]
    top = np.where(written[:, None], scores, -np.inf).max(-1, keepdims=True)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(scores - top) * written[:, None]
        return np.einsum("bhn,bhne->bhe", e / e.sum(-1, keepdims=True), v)


def decode_fill_minus_1000(q, k_cache, v_cache, lengths):
    """Masks with a finite -1000 instead of -inf, one sequence at a time
    (expert reading gqa12b, session 10): where every written score of a row
    lies below -1000, the stale slots take the weights."""
    b_size, n_heads, d_k = q.shape
    n_kv = k_cache.shape[1]
    g = n_heads // n_kv
    out = np.empty((b_size, n_heads, v_cache.shape[-1]))
    for b in range(b_size):
        rows = q[b].reshape(n_kv, g, d_k)
        scores = rows @ k_cache[b].transpose(0, 2, 1) / np.sqrt(d_k)
        scores[:, :, lengths[b] :] = -1000.0
        out[b] = (_softmax_rows(scores) @ v_cache[b]).reshape(n_heads, -1)
    return out


def decode_torch_fill_minus_1e4(q, k_cache, v_cache, lengths):
    """torch's masked_fill with -1e4, a constant chosen to stay finite in
    float16, in place of -inf."""
    q, k, v = (torch.from_numpy(np.asarray(a)) for a in (q, k_cache, v_cache))
    b_size, n_heads, d_k = q.shape
    n_kv, n = k.shape[1], k.shape[2]
    rows = q.view(b_size, n_kv, n_heads // n_kv, d_k)
    scores = rows @ k.transpose(-1, -2) / d_k**0.5
    mask = torch.arange(n) < torch.as_tensor(lengths)[:, None]
    scores = scores.masked_fill(~mask[:, None, None], -1e4)
    out = torch.softmax(scores, dim=-1) @ v
    return out.reshape(b_size, n_heads, -1)


def decode_fill_minus_31000(q, k_cache, v_cache, lengths):
    """Masks with a finite -3.1e4, just below the -3e4 that the exercise
    names (student reading stud1112): the written scores of some heads lie
    below it, those of others above."""
    b_size, n_heads, d_k = q.shape
    n_kv, n = k_cache.shape[1], k_cache.shape[2]
    rows = q.reshape(b_size, n_kv, n_heads // n_kv, d_k)
    scores = np.einsum("bhgd,bhnd->bhgn", rows, k_cache) / np.sqrt(d_k)
    scores = np.where(_written(lengths, n)[:, None, None], scores, -3.1e4)
    out = np.einsum("bhgn,bhne->bhge", _softmax_rows(scores), v_cache)
    return out.reshape(b_size, n_heads, -1)


CATALOGUE = {
    "check_grouped_decode_step": {
        "wrong": [
            (decode_groups_transposed, "wrong_order"),
            (decode_tiled, "wrong_order"),
            (decode_outputs_swapped, "output_heads_transposed"),
            (decode_whole_cache, "stale_slots_attended"),
            (decode_before_newest, "newest_slot_dropped"),
            (decode_through_length, "one_stale_slot"),
            (decode_mask_after, "masked_after_softmax"),
            (decode_fill_minus_1000, "finite_mask"),
            (decode_torch_fill_minus_1e4, "finite_mask"),
            (decode_fill_minus_31000, "finite_mask"),
            (decode_softmax_axis_2, "softmax_over_group"),
            (decode_softmax_group_masked, "softmax_over_group"),
            (decode_softmax_group_unmasked, "softmax_over_group"),
            (decode_softmax_group_finite_mask, "softmax_over_group"),
            (decode_split_g_first, "wrong_order_in_and_out"),
            (decode_max_before_mask, "max_includes_stale"),
            (decode_mask_times_exp, "max_includes_stale"),
            (decode_no_max, "unshifted"),
            (decode_unscaled, "not_scaled"),
            (decode_group_scale, "scaled_by_group"),
            (decode_value_scale, "scaled_by_d_v"),
            (decode_np_repeat, "repeated_kv"),
            (decode_torch_repeat_interleave, "repeated_kv"),
            (decode_torch_repeat_to_numpy, "repeated_kv"),
            (decode_torch_broadcast_to_numpy, "repeated_kv"),
            (decode_repeat_per_group, "repeated_kv"),
            (decode_keys_per_head, "repeated_kv"),
            (decode_torch_expand_per_group, "repeated_kv"),
            (decode_two_copies_of_cache, "cache_copies"),
        ],
        "right": [
            decode_by_loops,
            decode_einsum_float32,
            decode_broadcast_matmul,
            decode_in_place,
            decode_torch_grouped,
            decode_fill_dtype_min,
            decode_one_copy_of_cache,
            decode_float32_per_sequence,
            decode_two_copies_in_turn,
        ],
    }
}


def test_the_stub_is_not_attempted():
    def grouped_decode_step(q, k_cache, v_cache, lengths):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_grouped_decode_step(grouped_decode_step)


def test_the_in_place_answer_gets_a_note(capsys):
    check_grouped_decode_step(decode_in_place)
    out = capsys.readouterr().out
    assert "changed its input `q` in place" in out
    assert out.splitlines()[-1].startswith("Correct:")


def test_the_repeated_cache_fails_on_memory_not_values():
    """np.repeat gives the right values on every small case: only the memory
    check tells it apart, and it names the copies."""
    with pytest.raises(ExerciseError) as err:
        check_grouped_decode_step(decode_np_repeat)
    assert err.value.mistake == "repeated_kv"
    assert err.value.case.startswith("memory")


@pytest.mark.parametrize(
    "copies", [decode_torch_repeat_to_numpy, decode_torch_broadcast_to_numpy]
)
def test_copies_made_in_torch_are_measured_when_numpy_is_returned(copies):
    """torch's allocations are measured whatever the answer returns: copies
    made in torch and returned through .numpy() are named on the memory case
    (the old checker measured torch only for a returned tensor)."""
    with pytest.raises(ExerciseError) as err:
        check_grouped_decode_step(copies)
    assert err.value.mistake == "repeated_kv"
    assert err.value.case.startswith("memory")
    assert "peak memory was 32.0 MiB" in str(err.value)


@pytest.mark.parametrize(
    "copies",
    [
        decode_repeat_per_group,
        decode_keys_per_head,
        decode_torch_expand_per_group,
    ],
)
def test_copies_made_a_piece_at_a_time_are_added_up(copies):
    """A per-query-head copy made one group or one head at a time stays
    under the peak's limit (each piece is one group's), and is rejected by
    the volume it allocates, added up line by line (expert reading gqa12c)."""
    case = gqa_decode._case("m", 8, 2, 16, 2, 2048, 64, 64, (2048, 1748))
    with pytest.raises(ExerciseError) as err:
        check_grouped_decode_step(copies)
    assert err.value.mistake == "repeated_kv"
    assert err.value.case.startswith("memory")
    assert "in all, added up line by line" in str(err.value)
    _, peak = peak_memory_with_torch(copies, *case.args)
    repeated = 2 * 16 * 2048 * 64 * 8
    assert peak < gqa_decode.PEAK_SHARE * repeated


def test_copies_of_the_whole_cache_are_not_called_per_head_copies():
    """Two copies of the whole cache kept at once reach the peak's limit at
    g = 8, but do not grow with g: the checker names them as copies of the
    cache, says how many times the cache the peak was, and does not claim a
    copy per query head (expert reading x12gqa)."""
    with pytest.raises(ExerciseError) as err:
        check_grouped_decode_step(decode_two_copies_of_cache)
    assert err.value.mistake == "cache_copies"
    assert err.value.case.startswith("memory")
    assert "times the cache's keys and values (8.0 MiB)" in str(err.value)
    with pytest.raises(ExerciseError) as err:
        check_grouped_decode_step(gqa_decode.CACHE_COPIES.commit)
    assert err.value.mistake == "cache_copies"


def test_the_volume_is_a_count_that_repeats():
    """The volume is a count of bytes, not a time: load does not move it,
    and two runs differ by at most a few small Python objects (CI once saw
    56 bytes between runs of the same answer), so the verdict cannot flip;
    and it is far apart for a right answer and the copies made group by
    group."""
    from attnbook.exercises._framework import allocation_volume

    case = gqa_decode._case("m", 8, 2, 16, 2, 2048, 64, 64, (2048, 1748))
    repeated = 2 * 16 * 2048 * 64 * 8

    def volume(fn):
        return allocation_volume(fn, *pristine(case.args))[1]

    right = [volume(decode_by_loops) for _ in range(3)]
    wrong = [volume(decode_repeat_per_group) for _ in range(3)]
    # small objects only: far below one 64 KiB excursion
    assert max(right) - min(right) < 4096
    assert max(wrong) - min(wrong) < 4096
    assert max(right) < 0.2 * repeated
    assert min(wrong) > 1.5 * repeated


def test_each_mistake_is_named_as_itself():
    """The checker's own Mistake functions, run as answers, get their own
    diagnosis (no two mistakes shadow each other on the cases)."""
    for mistake in gqa_decode.DECODE_MISTAKES:
        with pytest.raises(ExerciseError) as err, np.errstate(all="ignore"):
            check_grouped_decode_step(mistake.commit)
        assert err.value.mistake == mistake.key, mistake.key


def test_the_reference_is_its_own_answer(capsys):
    check_grouped_decode_step(gqa_decode._reference)
    assert capsys.readouterr().out.startswith("Correct:")


def test_the_cases_have_stale_slots_and_a_full_cache():
    """Every classic trap has a case: ragged lengths with stale slots, a full
    cache, one slot, MHA and MQA, float32, d_v != d_k, large scores."""
    cases = gqa_decode.decode_cases()
    lengths = [c.args[3] for c in cases]
    n_slots = [c.args[1].shape[2] for c in cases]
    assert any((ls < n).any() for ls, n in zip(lengths, n_slots))
    assert any((ls == n).any() for ls, n in zip(lengths, n_slots))
    assert 1 in n_slots
    groups = {c.args[0].shape[1] // c.args[1].shape[1] for c in cases}
    assert 1 in groups and max(groups) >= 4
    assert any(c.args[1].shape[1] == 1 for c in cases)
    assert any(c.args[0].dtype == np.float32 for c in cases)
    assert any(c.args[1].shape[-1] != c.args[2].shape[-1] for c in cases)


def test_a_case_has_every_written_score_below_a_finite_mask():
    """A sequence whose written scores all lie below -1e4 while it has stale
    slots: a finite fill of -1e4 (or -30, or -1000) gives the stale slots the
    weights there, so only -inf (or slicing) passes (expert reading gqa12b)."""
    found = False
    for case in gqa_decode.decode_cases():
        q, k, _, lengths = case.args
        b_size, n_heads, d_k = q.shape
        n_kv, n = k.shape[1], k.shape[2]
        rows = q.reshape(b_size, n_kv, n_heads // n_kv, d_k)
        scores = np.einsum("bigd,bind->bign", rows, k) / np.sqrt(d_k)
        for b, written in enumerate(lengths):
            if written < n and (scores[b, ..., :written] < -1e4).all():
                found = True
    assert found


@pytest.mark.parametrize("fill", [-30.0, -1000.0, -1e4, -3.1e4, -5e4])
def test_a_finite_fill_is_named(fill):
    def decode(q, k_cache, v_cache, lengths):
        b_size, n_heads, d_k = q.shape
        n_kv, n = k_cache.shape[1], k_cache.shape[2]
        rows = q.reshape(b_size, n_kv, n_heads // n_kv, d_k)
        scores = np.einsum("bhgd,bhnd->bhgn", rows, k_cache) / np.sqrt(d_k)
        scores = np.where(_written(lengths, n)[:, None, None], scores, fill)
        out = np.einsum("bhgn,bhne->bhge", _softmax_rows(scores), v_cache)
        return out.reshape(b_size, n_heads, -1)

    with pytest.raises(ExerciseError) as err:
        check_grouped_decode_step(decode)
    assert err.value.mistake == "finite_mask"
    assert err.value.case.startswith("large scores")
