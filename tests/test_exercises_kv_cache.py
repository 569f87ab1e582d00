"""The KV-cache decoding-step checker rejects each classic mistake and passes
correct solutions.

The wrong solutions are written here independently of the checker's Mistake
functions, the way a reader might write them: explicit loops over queries,
torch, np.append, masks built by hand.
"""

import numpy as np
import pytest
import torch

import attnbook

from attnbook.exercises import ExerciseError, NotAttemptedError
from attnbook.exercises.kv_cache import check_kv_cache_step


def attend_rows(q, k, v, visible):
    """Loop over query rows; ``visible(i, n_k)`` is how many leading keys query
    i may see."""
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for i in range(q.shape[-2]):
        n = visible(i, k.shape[-2])
        if n == 0:
            continue
        s = np.einsum(
            "...d,...jd->...j", q[..., i, :], k[..., :n, :]
        ) / np.sqrt(q.shape[-1])
        w = np.exp(s - s.max(-1, keepdims=True))
        out[..., i, :] = np.einsum(
            "...j,...jd->...d", w / w.sum(-1, keepdims=True), v[..., :n, :]
        )
    return out


def queries_last(n_q):
    return lambda i, n_k: n_k - n_q + i + 1


def good_loops(q, k_new, v_new, k_cache, v_cache):
    keys = np.append(k_cache, k_new, axis=-2)
    values = np.append(v_cache, v_new, axis=-2)
    return (
        attend_rows(q, keys, values, queries_last(q.shape[-2])),
        keys,
        values,
    )


def good_torch(q, k_new, v_new, k_cache, v_cache):
    q, k_new, v_new, k_cache, v_cache = (
        torch.as_tensor(x) for x in (q, k_new, v_new, k_cache, v_cache)
    )
    keys, values = (
        torch.cat([k_cache, k_new], -2),
        torch.cat([v_cache, v_new], -2),
    )
    t = k_cache.shape[-2]
    mask = torch.ones(q.shape[-2], keys.shape[-2], dtype=torch.bool).tril(
        diagonal=t
    )
    out = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask
    )
    return out, keys, values


def no_append(q, k_new, v_new, k_cache, v_cache):
    return (
        attend_rows(q, k_cache, v_cache, lambda i, n_k: n_k),
        k_cache,
        v_cache,
    )


def attend_then_append(q, k_new, v_new, k_cache, v_cache):
    out = attend_rows(q, k_cache, v_cache, lambda i, n_k: n_k)
    return (
        out,
        np.append(k_cache, k_new, axis=-2),
        np.append(v_cache, v_new, axis=-2),
    )


def attend_new_only(q, k_new, v_new, k_cache, v_cache):
    keys, values = (
        np.append(k_cache, k_new, axis=-2),
        np.append(v_cache, v_new, axis=-2),
    )
    out = attend_rows(q, k_new, v_new, lambda i, n_k: i + 1)
    return out, keys, values


def overwrite(q, k_new, v_new, k_cache, v_cache):
    k_cache, v_cache = k_new.copy(), v_new.copy()
    return (
        attend_rows(q, k_cache, v_cache, lambda i, n_k: i + 1),
        k_cache,
        v_cache,
    )


def is_causal_alignment(q, k_new, v_new, k_cache, v_cache):
    # torch's is_causal=True aligns the triangle at the top left when n_q !=
    # n_k
    q, k_new, v_new, k_cache, v_cache = (
        torch.as_tensor(x) for x in (q, k_new, v_new, k_cache, v_cache)
    )
    keys, values = (
        torch.cat([k_cache, k_new], -2),
        torch.cat([v_cache, v_new], -2),
    )
    out = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, is_causal=True
    )
    return out, keys, values


def unmasked_chunk(q, k_new, v_new, k_cache, v_cache):
    keys, values = (
        np.append(k_cache, k_new, axis=-2),
        np.append(v_cache, v_new, axis=-2),
    )
    return attend_rows(q, keys, values, lambda i, n_k: n_k), keys, values


def new_first(q, k_new, v_new, k_cache, v_cache):
    keys, values = (
        np.append(k_new, k_cache, axis=-2),
        np.append(v_new, v_cache, axis=-2),
    )
    return (
        attend_rows(q, keys, values, queries_last(q.shape[-2])),
        keys,
        values,
    )


def mask_hides_own_key(q, k_new, v_new, k_cache, v_cache):
    # off by one: query i stops one key short of its own position t + i
    keys, values = (
        np.append(k_cache, k_new, axis=-2),
        np.append(v_cache, v_new, axis=-2),
    )
    return (
        attend_rows(q, keys, values, lambda i, n_k: n_k - q.shape[-2] + i),
        keys,
        values,
    )


def tril_diagonal_t_minus_1(q, k_new, v_new, k_cache, v_cache):
    q, k_new, v_new, k_cache, v_cache = (
        torch.as_tensor(x) for x in (q, k_new, v_new, k_cache, v_cache)
    )
    keys, values = (
        torch.cat([k_cache, k_new], -2),
        torch.cat([v_cache, v_new], -2),
    )
    mask = torch.ones(q.shape[-2], keys.shape[-2], dtype=torch.bool).tril(
        diagonal=k_cache.shape[-2] - 1
    )
    out = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask
    )
    return out, keys, values


def scale_by_value_width(q, k_new, v_new, k_cache, v_cache):
    keys, values = (
        np.append(k_cache, k_new, axis=-2),
        np.append(v_cache, v_new, axis=-2),
    )
    scores = q @ np.swapaxes(keys, -1, -2) / np.sqrt(values.shape[-1])
    n_q, n_k = scores.shape[-2:]
    scores = np.where(
        np.tril(np.ones((n_q, n_k), bool), k=n_k - n_q), scores, -np.inf
    )
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ values, keys, values


def no_scale(q, k_new, v_new, k_cache, v_cache):
    q, k_new, v_new, k_cache, v_cache = (
        torch.as_tensor(x) for x in (q, k_new, v_new, k_cache, v_cache)
    )
    keys, values = (
        torch.cat([k_cache, k_new], -2),
        torch.cat([v_cache, v_new], -2),
    )
    mask = torch.ones(q.shape[-2], keys.shape[-2], dtype=torch.bool).tril(
        diagonal=k_cache.shape[-2]
    )
    out = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=1.0
    )
    return out, keys, values


def scale_by_width(q, k_new, v_new, k_cache, v_cache):
    # 1 / d_k for 1 / sqrt(d_k), in a loop over the new queries
    keys = np.concatenate([k_cache, k_new], axis=-2)
    values = np.concatenate([v_cache, v_new], axis=-2)
    n_new, n_k, d_k = q.shape[-2], keys.shape[-2], q.shape[-1]
    rows = []
    for i in range(n_new):
        visible = n_k - n_new + i + 1
        s = (
            q[..., i : i + 1, :] @ np.swapaxes(keys[..., :visible, :], -1, -2)
        ) / d_k
        w = np.exp(s - s.max(-1, keepdims=True))
        rows.append((w / w.sum(-1, keepdims=True)) @ values[..., :visible, :])
    return np.concatenate(rows, axis=-2), keys, values


def mask_sees_next(q, k_new, v_new, k_cache, v_cache):
    # the offset p + 1 where p belongs: each query also sees the next token
    q, k_new, v_new, k_cache, v_cache = (
        torch.as_tensor(x) for x in (q, k_new, v_new, k_cache, v_cache)
    )
    keys = torch.cat([k_cache, k_new], -2)
    values = torch.cat([v_cache, v_new], -2)
    mask = torch.ones(q.shape[-2], keys.shape[-2], dtype=torch.bool).tril(
        diagonal=k_cache.shape[-2] + 1
    )
    out = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask
    )
    return out, keys, values


def softmax_wrong_axis(q, k_new, v_new, k_cache, v_cache):
    # scipy-style softmax with axis=-2 by mistake
    keys = np.append(k_cache, k_new, axis=-2)
    values = np.append(v_cache, v_new, axis=-2)
    n_q, n_k = q.shape[-2], keys.shape[-2]
    s = np.einsum("...qd,...kd->...qk", q, keys) / np.sqrt(q.shape[-1])
    s[..., ~np.tri(n_q, n_k, n_k - n_q, dtype=bool)] = -np.inf
    e = np.exp(s - s.max(axis=-2, keepdims=True))
    return (e / e.sum(axis=-2, keepdims=True)) @ values, keys, values


def softmax_sum_wrong_axis(q, k_new, v_new, k_cache, v_cache):
    # a loop over batch and heads; the row max is right, the sum is not
    keys = np.concatenate([k_cache, k_new], axis=-2)
    values = np.concatenate([v_cache, v_new], axis=-2)
    n_q, n_k = q.shape[-2], keys.shape[-2]
    out = np.empty(q.shape[:-1] + (values.shape[-1],))
    for idx in np.ndindex(q.shape[:-2]):
        s = q[idx] @ keys[idx].T / np.sqrt(q.shape[-1])
        for i in range(n_q):
            s[i, n_k - n_q + i + 1 :] = -np.inf
        e = np.exp(s - s.max(axis=1, keepdims=True))
        out[idx] = (e / e.sum(axis=0, keepdims=True)) @ values[idx]
    return out, keys, values


def float_tril_mask(q, k_new, v_new, k_cache, v_cache):
    # the nanoGPT idiom torch.ones(...).tril(): a float mask, which torch's
    # SDPA adds to the scores
    q, k_new, v_new, k_cache, v_cache = (
        torch.as_tensor(x) for x in (q, k_new, v_new, k_cache, v_cache)
    )
    keys, values = (
        torch.cat([k_cache, k_new], -2),
        torch.cat([v_cache, v_new], -2),
    )
    mask = torch.ones(q.shape[-2], keys.shape[-2], dtype=q.dtype).tril(
        diagonal=k_cache.shape[-2]
    )
    out = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask
    )
    return out, keys, values


def test_correct_solutions_pass(capsys):
    check_kv_cache_step(good_loops)
    check_kv_cache_step(good_torch)
    assert capsys.readouterr().out.count("Correct") == 2


@pytest.mark.parametrize(
    "wrong, key",
    [
        (no_append, "forgets_to_append"),
        (attend_then_append, "appends_after_attending"),
        (attend_new_only, "attends_to_new_only"),
        (overwrite, "overwrites"),
        (is_causal_alignment, "top_left_causal"),
        (unmasked_chunk, "no_causal_mask"),
        (new_first, "prepends"),
        (float_tril_mask, "float_mask"),
        (mask_hides_own_key, "diagonal_hidden"),
        (tril_diagonal_t_minus_1, "diagonal_hidden"),
        (scale_by_value_width, "scaled_by_d_v"),
        (no_scale, "unscaled"),
        (scale_by_width, "scaled_by_d_k"),
        (mask_sees_next, "mask_one_too_wide"),
        (softmax_wrong_axis, "softmax_over_queries"),
        (softmax_sum_wrong_axis, "softmax_over_queries"),
    ],
)
def test_mistakes_are_diagnosed(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_kv_cache_step(wrong)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value) and "Hint" in str(err.value)


def test_forgetting_to_append_is_reported_as_a_cache_that_did_not_grow():
    with pytest.raises(
        ExerciseError, match=r"k_cache has 5 positions; .* 5 \+ 1 = 6"
    ):
        check_kv_cache_step(no_append)


def test_a_float_mask_is_named_and_told_that_torch_adds_it():
    """One new token passes (every score +1 changes nothing); the chunk case
    fails, with the float-mask diagnosis."""
    with pytest.raises(ExerciseError) as err:
        check_kv_cache_step(float_tril_mask)
    assert err.value.mistake == "float_mask" and err.value.case.startswith(
        "a chunk"
    )
    assert "adds a float mask to the scores" in str(
        err.value
    ) and "dtype=torch.bool" in str(err.value)


def test_a_cache_of_one_position_is_not_called_plural():
    with pytest.raises(
        ExerciseError,
        match=r"k_cache has 1 position; .* p \+ n_new = 5 \+ 1 = 6",
    ):
        check_kv_cache_step(overwrite)


def test_a_right_cache_with_a_wrong_output_is_rejected_without_a_diagnosis():
    def output_doubled(*args):
        out, keys, values = good_loops(*args)
        return 2 * out, keys, values

    with pytest.raises(ExerciseError, match="the output differs") as err:
        check_kv_cache_step(output_doubled)
    assert err.value.mistake is None


def test_returning_only_the_output_is_rejected():
    with pytest.raises(ExerciseError, match="triple"):
        check_kv_cache_step(lambda *args: good_loops(*args)[0])


def test_stub_is_not_attempted():
    def stub(q, k_new, v_new, k_cache, v_cache):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_kv_cache_step(stub)


def test_a_mask_hiding_the_diagonal_is_told_apart_from_appending_late():
    """With one new token both leave the token's own key out; the chunk cases
    tell them apart."""
    with pytest.raises(ExerciseError) as err:
        check_kv_cache_step(mask_hides_own_key)
    assert err.value.case.startswith("one new token") and "off by one" in str(
        err.value
    )
    with pytest.raises(ExerciseError) as err:
        check_kv_cache_step(attend_then_append)
    assert err.value.mistake == "appends_after_attending"


def test_a_d_v_scale_gets_a_hint_about_d_k():
    with pytest.raises(ExerciseError, match=r"sqrt\(d_v\)") as err:
        check_kv_cache_step(scale_by_value_width)
    assert "d_k" in str(err.value).split("Hint:")[1]


# --- the catalogue (run by tests/test_exercises_framework.py) ----------------


def good_in_place_float32(q, k_new, v_new, k_cache, v_cache):
    # scales the caller's q: right, and noted
    q *= q.shape[-1] ** -0.5
    keys, values = (
        np.concatenate([k_cache, k_new], -2),
        np.concatenate([v_cache, v_new], -2),
    )
    t, n = k_cache.shape[-2], q.shape[-2]
    s = np.einsum("...id,...jd->...ij", q, keys).astype(np.float32)
    s = np.where(np.tril(np.ones((n, t + n), bool), k=t), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return (
        np.einsum("...ij,...jd->...id", w / w.sum(-1, keepdims=True), values),
        keys,
        values,
    )


# --- the hard exercise: a decoding step on a ring buffer ---------------------
# Written here independently of the checker's Mistake functions: loops over
# queries, slot arithmetic, np.roll, torch.

from attnbook.exercises.kv_cache import check_ring_decode_step  # noqa: E402


def softmax_attend(q, keys, values):
    """One query (..., d_k) over keys (..., m, d_k): (..., d_v); no keys gives
    zeros."""
    if keys.shape[-2] == 0:
        return np.zeros(q.shape[:-1] + values.shape[-1:])
    s = np.einsum("...d,...jd->...j", q, keys) / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("...j,...jd->...d", w / w.sum(-1, keepdims=True), values)


def key_of(j, pos, k_new, ring):
    """The key of position j: from the chunk when j >= pos, else its slot."""
    if j >= pos:
        return k_new[..., j - pos, :]
    return ring[..., j % ring.shape[-2], :]


def window_loop(back, hi=0):
    """A per-query loop: the query at p reads positions p - back(W) .. p + hi
    (from the ring as it was before the step, or from the chunk), then the
    chunk is written slot by slot."""

    def step(q, k_new, v_new, k_ring, v_ring, pos):
        n, out = q.shape[-2], []
        for i in range(n):
            p = pos + i
            js = range(max(0, p - back(k_ring.shape[-2])), p + hi + 1)
            keys = (
                np.stack([key_of(j, pos, k_new, k_ring) for j in js], -2)
                if js
                else k_new[..., :0, :]
            )
            values = (
                np.stack([key_of(j, pos, v_new, v_ring) for j in js], -2)
                if js
                else v_new[..., :0, :]
            )
            out.append(softmax_attend(q[..., i, :], keys, values))
        for i in range(n):
            k_ring[..., (pos + i) % k_ring.shape[-2], :] = k_new[..., i, :]
            v_ring[..., (pos + i) % v_ring.shape[-2], :] = v_new[..., i, :]
        return np.stack(out, -2), k_ring, v_ring

    return step


def ring_good_gather_float32(q, k_new, v_new, k_ring, v_ring, pos):
    # RollingKVCache's way in numpy float32: gather the held positions oldest
    # first, append the chunk, one window mask for all queries, then write
    w, n = k_ring.shape[-2], q.shape[-2]
    held = np.arange(max(0, pos - w + 1), pos)
    keys = np.concatenate([k_ring[..., held % w, :], k_new], -2)
    values = np.concatenate([v_ring[..., held % w, :], v_new], -2)
    k_pos = np.concatenate([held, pos + np.arange(n)])
    q_pos = pos + np.arange(n)[:, None]
    mask = (k_pos <= q_pos) & (k_pos > q_pos - w)
    s = np.einsum("...id,...jd->...ij", q, keys).astype(np.float32)
    s = np.where(mask, s / np.float32(np.sqrt(q.shape[-1])), -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    out = np.einsum("...ij,...jd->...id", e / e.sum(-1, keepdims=True), values)
    for i in range(max(0, n - w), n):
        k_ring[..., (pos + i) % w, :] = k_new[..., i, :]
        v_ring[..., (pos + i) % w, :] = v_new[..., i, :]
    return out.astype(np.float32), k_ring, v_ring


def ring_good_slot_order(q, k_new, v_new, k_ring, v_ring, pos):
    # no gathering: attend over the ring in slot order, each slot's position
    # worked out from pos; slots never written are zeroed before use
    w, n = k_ring.shape[-2], q.shape[-2]
    slots = np.arange(w)
    # the latest position before pos that lives in each slot (negative: none)
    slot_pos = pos - 1 - (pos - 1 - slots) % w
    valid = slot_pos >= 0
    keys = np.concatenate([np.where(valid[:, None], k_ring, 0.0), k_new], -2)
    values = np.concatenate([np.where(valid[:, None], v_ring, 0.0), v_new], -2)
    k_pos = np.concatenate(
        [np.where(valid, slot_pos, -(10**9)), pos + np.arange(n)]
    )
    q_pos = (pos + np.arange(n))[:, None]
    mask = (k_pos <= q_pos) & (k_pos > q_pos - w)
    s = np.where(
        mask, q @ np.swapaxes(keys, -1, -2) / np.sqrt(q.shape[-1]), -np.inf
    )
    e = np.exp(s - s.max(-1, keepdims=True))
    out = (e / e.sum(-1, keepdims=True)) @ values
    last = pos + np.arange(max(0, n - w), n)
    k_ring[..., last % w, :] = k_new[..., last - pos, :]
    v_ring[..., last % w, :] = v_new[..., last - pos, :]
    return out, k_ring, v_ring


def ring_good_torch_token_by_token(q, k_new, v_new, k_ring, v_ring, pos):
    # one token at a time, writing each before its query reads: the slot it
    # takes held position p - W, which no query from p on can see
    q, k_new, v_new = (torch.as_tensor(x) for x in (q, k_new, v_new))
    k_ring, v_ring = (
        torch.as_tensor(k_ring).clone(),
        torch.as_tensor(v_ring).clone(),
    )
    w, outs = k_ring.shape[-2], []
    for i in range(q.shape[-2]):
        p = pos + i
        k_ring[..., p % w, :], v_ring[..., p % w, :] = (
            k_new[..., i, :],
            v_new[..., i, :],
        )
        slots = torch.arange(max(0, p - w + 1), p + 1) % w
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[..., i : i + 1, :],
                k_ring[..., slots, :],
                v_ring[..., slots, :],
            )
        )
    return torch.cat(outs, -2), k_ring, v_ring


def ring_nan_through_zero_weights(q, k_new, v_new, k_ring, v_ring, pos):
    # masks the scores of unwritten slots, but multiplies the weights by the
    # whole ring: 0 x NaN
    w, n = k_ring.shape[-2], q.shape[-2]
    slot_pos = pos - 1 - (pos - 1 - np.arange(w)) % w
    keys = np.concatenate([k_ring, k_new], -2)
    values = np.concatenate([v_ring, v_new], -2)
    k_pos = np.concatenate([slot_pos, pos + np.arange(n)])
    q_pos = (pos + np.arange(n))[:, None]
    mask = (k_pos >= 0) & (k_pos <= q_pos) & (k_pos > q_pos - w)
    s = np.where(
        mask, q @ np.swapaxes(keys, -1, -2) / np.sqrt(q.shape[-1]), -np.inf
    )
    e = np.exp(s - s.max(-1, keepdims=True))
    out = (e / e.sum(-1, keepdims=True)) @ values
    for i in range(n):
        k_ring[..., (pos + i) % w, :] = k_new[..., i, :]
        v_ring[..., (pos + i) % w, :] = v_new[..., i, :]
    return out, k_ring, v_ring


def ring_write_then_gather(q, k_new, v_new, k_ring, v_ring, pos):
    # right for one token per step; a chunk overwrites what its first queries
    # need
    w, n = k_ring.shape[-2], q.shape[-2]
    for i in range(n):
        k_ring[..., (pos + i) % w, :] = k_new[..., i, :]
        v_ring[..., (pos + i) % w, :] = v_new[..., i, :]
    out = []
    for i in range(n):
        p = pos + i
        slots = [j % w for j in range(max(0, p - w + 1), p + 1)]
        out.append(
            softmax_attend(
                q[..., i, :], k_ring[..., slots, :], v_ring[..., slots, :]
            )
        )
    return np.stack(out, -2), k_ring, v_ring


def ring_write_then_read_held(q, k_new, v_new, k_ring, v_ring, pos):
    # the right gather with the write moved before it: the held positions
    # are read back from the ring after the chunk was written, the chunk's
    # own keys from k_new; a later token of the chunk has overwritten a slot
    # that an earlier query still sees
    w, n = k_ring.shape[-2], q.shape[-2]
    for i in range(n):
        k_ring[..., (pos + i) % w, :] = k_new[..., i, :]
        v_ring[..., (pos + i) % w, :] = v_new[..., i, :]
    out = []
    for i in range(n):
        p = pos + i
        held = [j % w for j in range(max(0, p - w + 1), pos)]
        own = slice(max(0, i - w + 1), i + 1)
        keys = np.concatenate([k_ring[..., held, :], k_new[..., own, :]], -2)
        values = np.concatenate([v_ring[..., held, :], v_new[..., own, :]], -2)
        out.append(softmax_attend(q[..., i, :], keys, values))
    return np.stack(out, -2), k_ring, v_ring


def ring_rolled(q, k_new, v_new, k_ring, v_ring, pos):
    # a deque: the newest position in the last slot, np.roll to make room
    w, n = k_ring.shape[-2], q.shape[-2]
    m = min(pos, w)
    keys = np.concatenate([k_ring[..., w - m :, :], k_new], -2)
    values = np.concatenate([v_ring[..., w - m :, :], v_new], -2)
    out = []
    for i in range(n):
        # query i is keys[m + i]; it sees the w keys up to it
        first = max(0, m + i - w + 1)
        out.append(
            softmax_attend(
                q[..., i, :],
                keys[..., first : m + i + 1, :],
                values[..., first : m + i + 1, :],
            )
        )
    kept = min(n, w)
    k_ring = np.roll(k_ring, -kept, axis=-2)
    v_ring = np.roll(v_ring, -kept, axis=-2)
    k_ring[..., w - kept :, :] = k_new[..., n - kept :, :]
    v_ring[..., w - kept :, :] = v_new[..., n - kept :, :]
    return np.stack(out, -2), k_ring, v_ring


def ring_one_slice(q, k_new, v_new, k_ring, v_ring, pos):
    out, _, _ = ring_good_gather_float32(
        q, k_new, v_new, k_ring.copy(), v_ring.copy(), pos
    )
    s = pos % k_ring.shape[-2]
    k_ring[..., s : s + q.shape[-2], :] = k_new
    v_ring[..., s : s + q.shape[-2], :] = v_new
    return out, k_ring, v_ring


def ring_chunk_unmasked(q, k_new, v_new, k_ring, v_ring, pos):
    # the one-token recipe applied to a chunk: the last W - 1 cached positions
    # and every new token, the same keys for every query
    w = k_ring.shape[-2]
    held = [j % w for j in range(max(0, pos - w + 1), pos)]
    keys = np.concatenate([k_ring[..., held, :], k_new], -2)
    values = np.concatenate([v_ring[..., held, :], v_new], -2)
    out = np.stack(
        [
            softmax_attend(q[..., i, :], keys, values)
            for i in range(q.shape[-2])
        ],
        -2,
    )
    for i in range(q.shape[-2]):
        k_ring[..., (pos + i) % w, :] = k_new[..., i, :]
        v_ring[..., (pos + i) % w, :] = v_new[..., i, :]
    return out, k_ring, v_ring


def ring_scaled_by_value_width(q, k_new, v_new, k_ring, v_ring, pos):
    return ring_good_gather_float32(
        q * np.sqrt(q.shape[-1] / v_new.shape[-1]),
        k_new,
        v_new,
        k_ring,
        v_ring,
        pos,
    )


def ring_not_written(q, k_new, v_new, k_ring, v_ring, pos):
    out, _, _ = ring_good_gather_float32(
        q, k_new, v_new, k_ring.copy(), v_ring.copy(), pos
    )
    return out, k_ring, v_ring


def ring_window_no_upper_bound(q, k_new, v_new, k_ring, v_ring, pos):
    # the sliding window's lower bound, key_pos > p - W, with the causal
    # upper bound forgotten: in a chunk every query sees the later new
    # tokens too
    w, n = k_ring.shape[-2], q.shape[-2]
    held = np.arange(max(0, pos - w + 1), pos)
    keys = np.concatenate([k_ring[..., held % w, :], k_new], -2)
    values = np.concatenate([v_ring[..., held % w, :], v_new], -2)
    k_pos = np.concatenate([held, pos + np.arange(n)])
    q_pos = (pos + np.arange(n))[:, None]
    s = np.where(
        k_pos > q_pos - w,
        q @ np.swapaxes(keys, -1, -2) / np.sqrt(q.shape[-1]),
        -np.inf,
    )
    e = np.exp(s - s.max(-1, keepdims=True))
    out = (e / e.sum(-1, keepdims=True)) @ values
    for i in range(max(0, n - w), n):
        k_ring[..., (pos + i) % w, :] = k_new[..., i, :]
        v_ring[..., (pos + i) % w, :] = v_new[..., i, :]
    return out, k_ring, v_ring


def ring_writes_chunk_at_once(q, k_new, v_new, k_ring, v_ring, pos):
    # right outputs; the whole chunk written in one assignment, whose slots
    # repeat when the chunk is longer than the window (numpy does not say
    # which value a repeated index keeps)
    out, _, _ = ring_good_gather_float32(
        q, k_new, v_new, k_ring.copy(), v_ring.copy(), pos
    )
    idx = (pos + np.arange(q.shape[-2])) % k_ring.shape[-2]
    k_ring[..., idx, :] = k_new
    v_ring[..., idx, :] = v_new
    return out, k_ring, v_ring


def ring_puts_chunk_along_axis(q, k_new, v_new, k_ring, v_ring, pos):
    # the same write through np.put_along_axis, on new rings (copies)
    out, _, _ = ring_good_gather_float32(
        q, k_new, v_new, k_ring.copy(), v_ring.copy(), pos
    )
    k_ring, v_ring = k_ring.copy(), v_ring.copy()
    idx = ((pos + np.arange(q.shape[-2])) % k_ring.shape[-2])[:, None]
    for ring, new in ((k_ring, k_new), (v_ring, v_new)):
        np.put_along_axis(ring, np.broadcast_to(idx, new.shape), new, axis=-2)
    return out, k_ring, v_ring


def ring_good_duplicates_of_one_value(q, k_new, v_new, k_ring, v_ring, pos):
    # right: the last min(n_new, W) tokens, each written twice, but with the
    # same value, so whichever copy numpy keeps is the same
    out, _, _ = ring_good_gather_float32(
        q, k_new, v_new, k_ring.copy(), v_ring.copy(), pos
    )
    w, n = k_ring.shape[-2], q.shape[-2]
    last = np.repeat(np.arange(max(0, n - w), n), 2)
    k_ring[..., (pos + last) % w, :] = k_new[..., last, :]
    v_ring[..., (pos + last) % w, :] = v_new[..., last, :]
    return out, k_ring, v_ring


def ring_token_by_token_masked_nan(q, k_new, v_new, k_ring, v_ring, pos):
    # a reader's answer (student reading s12t07): each token written, then
    # its scores over the whole ring, the unwritten slots masked to -inf,
    # but their NaN values still multiplied by 0
    w = k_ring.shape[-2]
    k_ring, v_ring, outs = np.array(k_ring), np.array(v_ring), []
    for t in range(q.shape[-2]):
        i = pos + t
        k_ring[..., i % w, :] = k_new[..., t, :]
        v_ring[..., i % w, :] = v_new[..., t, :]
        seen = np.arange(w) < min(i + 1, w)
        s = q[..., t : t + 1, :] @ np.swapaxes(k_ring, -1, -2)
        s = np.where(seen, s / np.sqrt(q.shape[-1]), -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        outs.append((p / p.sum(-1, keepdims=True)) @ v_ring)
    return np.concatenate(outs, -2), k_ring, v_ring


RING_WRONG = [
    (ring_token_by_token_masked_nan, "reads_unwritten_slots_per_token"),
    (ring_nan_through_zero_weights, "reads_unwritten_slots"),
    (ring_write_then_gather, "overwrites_before_reading"),
    (ring_write_then_read_held, "overwrites_before_reading"),
    # the W held positions and the new token: the W + 1 of Mistral's paper
    (window_loop(lambda w: w), "window_one_too_wide"),
    (window_loop(lambda w: w - 2), "window_one_too_narrow"),
    # the ring as it was, without the new token
    (window_loop(lambda w: w, hi=-1), "forgets_own_key"),
    # the W - 1 before it, without itself
    (window_loop(lambda w: w - 1, hi=-1), "misses_own_key_sees_w_minus_1"),
    (ring_window_no_upper_bound, "no_upper_bound_in_chunk"),
    (ring_writes_chunk_at_once, "repeated_slot_write"),
    (ring_puts_chunk_along_axis, "repeated_slot_write"),
    (ring_rolled, "time_ordered_ring"),
    (ring_one_slice, "slice_past_the_end"),
    (ring_chunk_unmasked, "no_mask_in_chunk"),
    (ring_scaled_by_value_width, "scaled_by_d_v"),
    (ring_not_written, "forgets_to_write"),
]


def test_ring_right_solutions_pass_quietly(capsys):
    """In place or not, float32 or torch: accepted, with no in-place note (the
    checker owns the rings it passes)."""
    for good in (
        ring_good_gather_float32,
        ring_good_slot_order,
        ring_good_torch_token_by_token,
        ring_good_duplicates_of_one_value,
    ):
        check_ring_decode_step(good)
    out = capsys.readouterr().out
    assert out.count("Correct") == 4 and "Note" not in out


def test_a_slot_written_twice_in_one_assignment_is_named_with_its_step():
    """numpy keeps the last value today, so outputs and rings are right: the
    verdict says so and names the slot and the step."""
    with pytest.raises(ExerciseError) as err:
        check_ring_decode_step(ring_writes_chunk_at_once)
    first = str(err.value).splitlines()[0]
    assert err.value.case.startswith("a prompt of 6")
    assert "the outputs are right" in first
    assert "slot 0 of k_ring, in the step at pos = 0 with n_new = 6" in first


def test_the_watched_ring_notes_only_clashing_repeated_writes():
    from attnbook.exercises.kv_cache import _watched

    log = []
    ring = _watched(np.zeros((2, 4, 3)), log, 4, "k_ring")
    ring[..., [1, 2], :] = 1.0  # distinct slots
    ring[..., [3, 3], :] = 2.0  # repeated, one value
    ring[0, :, 0] = np.arange(4.0)  # basic indexing
    assert log == []
    ring[..., [1, 2, 1], :] = np.arange(9.0).reshape(3, 3)
    assert log == [("k_ring", 1)]
    view = ring[1]
    view[np.array([0, -4])] = np.ones((2, 3)) * [[1], [2]]
    assert log[-1] == ("k_ring", 0)
    # what it notes, it still writes
    assert np.array_equal(np.asarray(ring)[1, 2], [3.0, 4.0, 5.0])


@pytest.mark.parametrize("wrong, key", RING_WRONG)
def test_ring_mistakes_are_diagnosed(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_ring_decode_step(wrong)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value) and "Hint" in str(err.value)


def test_ring_output_only_is_rejected_asking_for_the_triple():
    with pytest.raises(ExerciseError, match="triple"):
        check_ring_decode_step(
            lambda *args: ring_good_gather_float32(*args)[0]
        )


def test_ring_stub_is_not_attempted():
    def stub(q, k_new, v_new, k_ring, v_ring, pos):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_ring_decode_step(stub)


def test_a_ring_that_grows_is_told_it_keeps_w_slots():
    def grows(q, k_new, v_new, k_ring, v_ring, pos):
        out, _, _ = ring_good_gather_float32(
            q, k_new, v_new, k_ring.copy(), v_ring.copy(), pos
        )
        return (
            out,
            np.concatenate([k_ring, k_new], -2),
            np.concatenate([v_ring, v_new], -2),
        )

    with pytest.raises(ExerciseError, match=r"keeps W = \d+ slots"):
        check_ring_decode_step(grows)


def test_the_time_ordered_ring_is_not_told_its_outputs_are_right():
    """Started mid-sequence, on a ring filled in slot order, a time-ordered
    step reads the wrong positions: the diagnosis under the line that reports
    wrong outputs must not call them right."""
    with pytest.raises(ExerciseError) as err:
        check_ring_decode_step(ring_rolled)
    text = str(err.value)
    assert err.value.mistake == "time_ordered_ring"
    # the first case starts at position 10, its ring filled in slot order
    assert "holding positions 6..9" in text
    assert "first that differs" in text
    assert "your outputs are right" not in text
    assert "reads the wrong positions, so its outputs are wrong" in text


def test_the_time_ordered_ring_is_right_from_an_empty_ring():
    """What the diagnosis says of the other situation: from an empty ring the
    time-ordered step's outputs are right and only its slots are wrong."""
    from attnbook.exercises.kv_cache import (
        _drive,
        _ring_reference,
        ring_cases,
    )

    case = ring_cases()[1]
    assert case.args[-1] == 0
    got = _drive(ring_rolled)(*case.args)
    want = _ring_reference(*case.args)
    assert np.allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
    assert not np.allclose(got[1], want[1], equal_nan=True)


def test_a_nan_output_is_reported_without_a_largest_difference():
    """NaN where the output is wrong, right elsewhere: no tiny 'largest
    difference' beside the NaN."""
    with pytest.raises(ExerciseError) as err:
        check_ring_decode_step(ring_nan_through_zero_weights)
    text = str(err.value).splitlines()[0]
    assert "NaN at 4 positions, the first 0" in text
    assert "largest difference" not in text


def test_wrong_numbers_beside_nan_are_labelled_as_such():
    from attnbook.exercises.kv_cache import _ring_problem, ring_cases

    case = ring_cases()[1]
    want = np.zeros((11, 3))
    out = want.copy()
    out[2] = np.nan
    out[5, 1] = 0.5
    rings = (np.zeros((4, 3)), np.zeros((4, 3)))
    text = _ring_problem((out, *rings), (want, *rings), case)
    assert text == (
        "the output of position 2 is the first that differs from "
        "sliding-window attention (NaN at 1 position, the first 2; among "
        "the outputs that are not NaN, largest difference 0.5)"
    )


def test_the_reference_is_sliding_window_attention_over_the_sequence():
    """The checker's reference against the package's mask and attention on a
    sequence longer than 2W (float64)."""
    from attnbook.exercises.kv_cache import _ring_reference

    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(13, 4)) for _ in range(3))
    out, k_ring, v_ring = _ring_reference(q, k, v, 5, [13])
    want, _ = attnbook.scaled_dot_product_attention(
        q, k, v, mask=attnbook.sliding_window_mask(13, 5)
    )
    assert np.allclose(out, want, rtol=0, atol=1e-12)
    assert np.array_equal(k_ring[np.arange(8, 13) % 5], k[8:13])


# the catalogues of both checkers (run by tests/test_exercises_framework.py)
CATALOGUE = {
    "check_ring_decode_step": {
        "right": [
            ring_good_gather_float32,
            ring_good_slot_order,
            ring_good_torch_token_by_token,
            ring_good_duplicates_of_one_value,
        ],
        "wrong": RING_WRONG,
    },
    "check_kv_cache_step": {
        "right": [good_loops, good_torch, good_in_place_float32],
        "wrong": [
            (no_append, "forgets_to_append"),
            (attend_then_append, "appends_after_attending"),
            (attend_new_only, "attends_to_new_only"),
            (overwrite, "overwrites"),
            (is_causal_alignment, "top_left_causal"),
            (unmasked_chunk, "no_causal_mask"),
            (new_first, "prepends"),
            (float_tril_mask, "float_mask"),
            (mask_hides_own_key, "diagonal_hidden"),
            (tril_diagonal_t_minus_1, "diagonal_hidden"),
            (scale_by_value_width, "scaled_by_d_v"),
            (no_scale, "unscaled"),
            (scale_by_width, "scaled_by_d_k"),
            (mask_sees_next, "mask_one_too_wide"),
            (softmax_wrong_axis, "softmax_over_queries"),
            (softmax_sum_wrong_axis, "softmax_over_queries"),
        ],
    },
}


# --- from the student reading of chapter 8 (issue 31, report 0708) ----------
# reading pos - W + 1 .. pos - 1 without max(0, .) got NaN and the generic hint


def ring_unclipped_window(q, k_new, v_new, k_ring, v_ring, pos):
    """Wrong: the held positions read from pos - W + 1 without clipping at
    0, and the window mask built over them."""
    w, n = k_ring.shape[-2], q.shape[-2]
    lo = pos - w + 1
    old = np.arange(lo, pos)
    k = np.concatenate([k_ring[..., old % w, :], k_new], -2)
    v = np.concatenate([v_ring[..., old % w, :], v_new], -2)
    kp = np.arange(lo, pos + n)[None, :]
    qp = np.arange(pos, pos + n)[:, None]
    out, _ = attnbook.scaled_dot_product_attention(
        q, k, v, mask=(kp <= qp) & (kp > qp - w)
    )
    m = min(n, w)
    new = np.arange(pos + n - m, pos + n)
    k_ring[..., new % w, :] = k_new[..., n - m :, :]
    v_ring[..., new % w, :] = v_new[..., n - m :, :]
    return out, k_ring, v_ring


def test_reading_before_position_0_is_named():
    with pytest.raises(ExerciseError) as err:
        check_ring_decode_step(ring_unclipped_window)
    assert err.value.mistake == "reads_before_position_0"


CATALOGUE["check_ring_decode_step"]["wrong"] += [
    (ring_unclipped_window, "reads_before_position_0"),
]


# --- from the expert reading of chapter 8 (report kv08d, E1) ----------------
# a chunk longer than W written in one assignment into np.asarray(k_ring) (a
# view of the ring's memory) or np.copy(k_ring) (a new array) passed: the
# watch lived only in the ring's class, which both conversions drop


def ring_chunk_at_once_into_asarray(q, k_new, v_new, k_ring, v_ring, pos):
    """Wrong: right outputs; the whole chunk written in one assignment into
    np.asarray of the rings, whose slots repeat when n_new > W."""
    out, _, _ = ring_good_gather_float32(
        q, k_new, v_new, k_ring.copy(), v_ring.copy(), pos
    )
    k_ring, v_ring = np.asarray(k_ring), np.asarray(v_ring)
    slots = (pos + np.arange(q.shape[-2])) % k_ring.shape[-2]
    k_ring[..., slots, :] = k_new
    v_ring[..., slots, :] = v_new
    return out, k_ring, v_ring


def ring_chunk_at_once_into_np_copy(q, k_new, v_new, k_ring, v_ring, pos):
    """Wrong: the same write into np.copy of the rings."""
    out, _, _ = ring_good_gather_float32(
        q, k_new, v_new, k_ring.copy(), v_ring.copy(), pos
    )
    k_ring, v_ring = np.copy(k_ring), np.copy(v_ring)
    slots = (pos + np.arange(q.shape[-2])) % k_ring.shape[-2]
    k_ring[..., slots, :] = k_new
    v_ring[..., slots, :] = v_new
    return out, k_ring, v_ring


def ring_chunk_at_once_into_plain_view(q, k_new, v_new, k_ring, v_ring, pos):
    """Wrong: the same write into np.array of one ring and a plain
    ndarray view of the other."""
    out, _, _ = ring_good_gather_float32(
        q, k_new, v_new, k_ring.copy(), v_ring.copy(), pos
    )
    k_ring, v_ring = np.array(k_ring), v_ring.view(np.ndarray)
    slots = (pos + np.arange(q.shape[-2])) % k_ring.shape[-2]
    k_ring[..., slots, :] = k_new
    v_ring[..., slots, :] = v_new
    return out, k_ring, v_ring


def ring_good_last_w_into_asarray(q, k_new, v_new, k_ring, v_ring, pos):
    """Right: only the last min(n_new, W) tokens, written in one assignment
    into np.asarray of the rings (the rings' own memory)."""
    out, _, _ = ring_good_gather_float32(
        q, k_new, v_new, k_ring.copy(), v_ring.copy(), pos
    )
    k_ring, v_ring = np.asarray(k_ring), np.asarray(v_ring)
    w, n = k_ring.shape[-2], q.shape[-2]
    last = np.arange(max(0, n - w), n)
    k_ring[..., (pos + last) % w, :] = k_new[..., last, :]
    v_ring[..., (pos + last) % w, :] = v_new[..., last, :]
    return out, k_ring, v_ring


@pytest.mark.parametrize(
    "wrong",
    [
        ring_chunk_at_once_into_asarray,
        ring_chunk_at_once_into_np_copy,
        ring_chunk_at_once_into_plain_view,
    ],
)
def test_a_chunk_written_at_once_through_a_conversion_is_named(wrong):
    with pytest.raises(ExerciseError) as err:
        check_ring_decode_step(wrong)
    assert err.value.mistake == "repeated_slot_write"
    assert err.value.case.startswith("a prompt of 6")
    assert "slot 0 of k_ring" in str(err.value).splitlines()[0]


def test_numpy_conversions_are_restored_after_the_check(capsys):
    before = (np.asarray, np.array, np.ascontiguousarray, np.asfortranarray)
    check_ring_decode_step(ring_good_last_w_into_asarray)
    with pytest.raises(ExerciseError):
        check_ring_decode_step(ring_chunk_at_once_into_asarray)
    after = (np.asarray, np.array, np.ascontiguousarray, np.asfortranarray)
    assert after == before
    assert "Correct" in capsys.readouterr().out


CATALOGUE["check_ring_decode_step"]["wrong"] += [
    (ring_chunk_at_once_into_asarray, "repeated_slot_write"),
    (ring_chunk_at_once_into_np_copy, "repeated_slot_write"),
    (ring_chunk_at_once_into_plain_view, "repeated_slot_write"),
]
CATALOGUE["check_ring_decode_step"]["right"] += [
    ring_good_last_w_into_asarray,
]


# --- from expert reading kv08e: unwritten slots hidden by np.isnan, and a
# chunk written with ndarray.put


def _window_attention(q, keys, values, mask):
    s = q @ np.swapaxes(keys, -1, -2) / np.sqrt(q.shape[-1])
    s = np.where(mask, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ values


def ring_masked_by_isnan(q, k_new, v_new, k_ring, v_ring, pos):
    """Wrong: attends over every slot and hides the never-written ones by
    np.isnan, not by their positions: right only while they hold NaN."""
    w, n = k_ring.shape[-2], q.shape[-2]
    s = np.arange(w)
    slot_pos = pos - 1 - ((pos - 1 - s) % w)
    written = ~np.isnan(k_ring).any(-1)
    keys = np.concatenate([np.nan_to_num(k_ring), k_new], -2)
    values = np.concatenate([np.nan_to_num(v_ring), v_new], -2)
    kp = np.concatenate([slot_pos, pos + np.arange(n)])
    qp = pos + np.arange(n)[:, None]
    valid = np.concatenate(
        [written, np.ones(written.shape[:-1] + (n,), bool)], -1
    )
    out = _window_attention(
        q, keys, values, valid[..., None, :] & (kp <= qp) & (kp > qp - w)
    )
    last = np.arange(max(0, n - w), n)
    k_ring[..., (pos + last) % w, :] = k_new[..., last, :]
    v_ring[..., (pos + last) % w, :] = v_new[..., last, :]
    return out, k_ring, v_ring


def ring_chunk_by_put(q, k_new, v_new, k_ring, v_ring, pos):
    """Wrong: every new token written with ndarray.put in one call, into the
    rings passed in: a chunk longer than W writes some slots twice."""
    w, n = k_ring.shape[-2], q.shape[-2]
    held = np.arange(max(0, pos - w + 1), pos)
    keys = np.concatenate([k_ring[..., held % w, :], k_new], -2)
    values = np.concatenate([v_ring[..., held % w, :], v_new], -2)
    kp = np.concatenate([held, pos + np.arange(n)])
    qp = pos + np.arange(n)[:, None]
    out = _window_attention(q, keys, values, (kp <= qp) & (kp > qp - w))
    for ring, new in ((k_ring, k_new), (v_ring, v_new)):
        flat = np.arange(ring.size).reshape(ring.shape)
        ring.put(flat[..., (pos + np.arange(n)) % w, :].ravel(), new.ravel())
    return out, k_ring, v_ring


def test_unwritten_slots_hidden_by_isnan_are_caught_by_finite_garbage():
    with pytest.raises(ExerciseError):
        check_ring_decode_step(ring_masked_by_isnan)


CATALOGUE["check_ring_decode_step"]["wrong"] += [
    (ring_chunk_by_put, "repeated_slot_write"),
]


# --- from the student reading of chapter 8 (issue 31, report stud08b) -------
# writing the whole chunk first, then reading the last W positions back from
# the ring, was rejected with no diagnosis, only the generic hint


def ring_write_chunk_then_read_last_w(q, k_new, v_new, k_ring, v_ring, pos):
    """Wrong: the chunk's last min(n, W) tokens written first, then the W
    positions up to the chunk's end read back from the ring and masked by
    position; an early query of a chunk has lost its oldest keys."""
    w, n = k_ring.shape[-2], q.shape[-2]
    last = np.arange(max(pos, pos + n - w), pos + n)
    k_ring[..., last % w, :] = k_new[..., last - pos, :]
    v_ring[..., last % w, :] = v_new[..., last - pos, :]
    kp = np.arange(max(0, pos + n - w), pos + n)
    qp = pos + np.arange(n)
    allowed = (kp[None] <= qp[:, None]) & (kp[None] > qp[:, None] - w)
    s = q @ np.swapaxes(k_ring[..., kp % w, :], -1, -2) / np.sqrt(q.shape[-1])
    s = np.where(allowed, s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return (
        (e / e.sum(-1, keepdims=True)) @ v_ring[..., kp % w, :],
        k_ring,
        v_ring,
    )


def test_writing_the_chunk_then_reading_the_last_w_is_named():
    with pytest.raises(ExerciseError) as err:
        check_ring_decode_step(ring_write_chunk_then_read_last_w)
    assert err.value.mistake == "overwrites_before_reading"
    assert "last W up to the chunk's end" in str(err.value)


def test_the_ring_checkers_generic_hint_does_not_spell_out_the_algorithm():
    def off_by_noise(q, k_new, v_new, k_ring, v_ring, pos):
        out, k_ring, v_ring = ring_good_gather_float32(
            q, k_new, v_new, k_ring, v_ring, pos
        )
        return out * 1.1, k_ring, v_ring

    with pytest.raises(ExerciseError) as err:
        check_ring_decode_step(off_by_noise)
    assert err.value.mistake is None
    assert "then write the new positions" not in str(err.value)
    assert "first and the last query of a chunk" in str(err.value)


CATALOGUE["check_ring_decode_step"]["wrong"] += [
    (ring_write_chunk_then_read_last_w, "overwrites_before_reading"),
]


# --- from the expert reading of chapter 8 (report y08kv): the causal mask
# alone inside a chunk, over the W - 1 held positions (what the tiny GPT
# computes when a chunk goes through RollingKVCache without its window_mask),
# was rejected with the generic hint only


def ring_causal_only_in_chunk(q, k_new, v_new, k_ring, v_ring, pos):
    """Wrong: the W - 1 positions the first new query may see, then the
    chunk, under the causal mask with no lower bound; written token by
    token."""
    w, n = k_ring.shape[-2], q.shape[-2]
    held = np.arange(max(0, pos - w + 1), pos)
    keys = np.concatenate([k_ring[..., held % w, :], k_new], -2)
    values = np.concatenate([v_ring[..., held % w, :], v_new], -2)
    kp = np.concatenate([held, pos + np.arange(n)])
    qp = pos + np.arange(n)[:, None]
    out = _window_attention(q, keys, values, kp <= qp)
    for r in range(n):
        k_ring[..., (pos + r) % w, :] = k_new[..., r, :]
        v_ring[..., (pos + r) % w, :] = v_new[..., r, :]
    return out, k_ring, v_ring


def test_the_causal_mask_alone_in_a_chunk_is_named():
    with pytest.raises(ExerciseError) as err:
        check_ring_decode_step(ring_causal_only_in_chunk)
    assert err.value.mistake == "no_lower_bound_in_chunk"
    assert "window_mask" in str(err.value)


CATALOGUE["check_ring_decode_step"]["wrong"] += [
    (ring_causal_only_in_chunk, "no_lower_bound_in_chunk"),
]
