"""The KV-cache decoding-step checker rejects each classic mistake and passes
correct solutions.

The wrong solutions are written here independently of the checker's Mistake
functions, the way a reader might write them: explicit loops over queries,
torch, np.append, masks built by hand.
"""

import numpy as np
import pytest
import torch

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


CATALOGUE = {
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
        ],
    },
}
