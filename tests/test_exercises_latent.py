"""The latent-attention checkers reject each classic mistake and pass correct
solutions.

The wrong solutions are written here independently of the checkers' Mistake
functions, the way a reader might write them: loops, dictionaries, index
searches, torch instead of numpy.
"""

import numpy as np
import pytest
import torch

from attnbook.exercises import ExerciseError, NotAttemptedError
from attnbook.exercises.latent import (
    _decode_reference,
    check_absorbed_decode_step,
    check_sharing_map,
    decode_cases,
)

# --- the sharing map ---------------------------------------------------------


def sharing_by_search(layer_types, n_shared):
    """Correct: search backwards from the first sharing layer."""
    first = len(layer_types) - n_shared
    sources = list(range(first))
    for i in range(first, len(layer_types)):
        j = first - 1
        while layer_types[j] != layer_types[i]:
            j -= 1
        sources.append(j)
    return sources


def sharing_numpy(layer_types, n_shared):
    """Correct, in numpy: the last index of each type among the makers."""
    types = np.array(layer_types)
    first = len(types) - n_shared
    out = np.arange(len(types))
    for i in range(first, len(types)):
        out[i] = np.flatnonzero(types[:first] == types[i])[-1]
    return out


def sharing_first_of_type(layer_types, n_shared):
    first = len(layer_types) - n_shared
    return list(range(first)) + [
        layer_types.index(layer_types[i])
        for i in range(first, len(layer_types))
    ]


def sharing_ignores_type(layer_types, n_shared):
    first = len(layer_types) - n_shared
    return [min(i, first - 1) for i in range(len(layer_types))]


def sharing_chain(layer_types, n_shared):
    first = len(layer_types) - n_shared
    last = {}
    sources = []
    for i, kind in enumerate(layer_types):
        sources.append(i if i < first else last[kind])
        last[kind] = i
    return sources


def sharing_starts_early(layer_types, n_shared):
    first = len(layer_types) - n_shared - 1
    last = {kind: i for i, kind in enumerate(layer_types[:first])}
    return [i if i < first else last[k] for i, k in enumerate(layer_types)]


def sharing_starts_late(layer_types, n_shared):
    first = len(layer_types) - n_shared + 1
    last = {kind: i for i, kind in enumerate(layer_types[:first])}
    return [i if i < first else last[k] for i, k in enumerate(layer_types)]


def sharing_none(layer_types, n_shared):
    return list(range(len(layer_types)))


def sharing_tuple(layer_types, n_shared):
    """Correct, as a tuple filled backwards: a dict keeps each type's last
    maker."""
    first = len(layer_types) - n_shared
    last = {}
    for i in range(first):
        last[layer_types[i]] = i
    return tuple(
        i if i < first else last[layer_types[i]]
        for i in range(len(layer_types))
    )


def sharing_torch(layer_types, n_shared):
    """Correct, as a torch tensor of int64."""
    return torch.as_tensor(sharing_by_search(layer_types, n_shared))


def sharing_generator(layer_types, n_shared):
    """Correct, as a generator."""
    first = len(layer_types) - n_shared
    for i, kind in enumerate(layer_types):
        if i < first:
            yield i
        else:
            yield max(j for j in range(first) if layer_types[j] == kind)


def sharing_sliding_to_previous(layer_types, n_shared):
    """Full layers look up their type; sliding ones take the layer just before
    the sharing ones (right only when that layer is a sliding one)."""
    first = len(layer_types) - n_shared
    sources = []
    for i, kind in enumerate(layer_types):
        if i < first:
            sources.append(i)
        elif kind == "full_attention":
            sources.append(
                max(j for j in range(first) if layer_types[j] == kind)
            )
        else:
            sources.append(first - 1)
    return sources


def sharing_generator_first_of_type(layer_types, n_shared):
    """A generator with the first-of-type slip: read once by the checker."""
    first = len(layer_types) - n_shared
    seen = {}
    for i, kind in enumerate(layer_types):
        if i < first:
            seen.setdefault(kind, i)
            yield i
        else:
            yield seen[kind]


def sharing_none_for_own(layer_types, n_shared):
    """None for a layer that makes its own cache."""
    first = len(layer_types) - n_shared
    last = {kind: i for i, kind in enumerate(layer_types[:first])}
    return [None if i < first else last[k] for i, k in enumerate(layer_types)]


def sharing_half_off(layer_types, n_shared):
    """Floats, the sharing layers' sources off by 0.5 (int() would truncate
    them to the right answer)."""
    first = len(layer_types) - n_shared
    last = {kind: i for i, kind in enumerate(layer_types[:first])}
    return [
        float(i) if i < first else last[k] + 0.5
        for i, k in enumerate(layer_types)
    ]


SHARING_RIGHT = [
    sharing_by_search,
    sharing_numpy,
    sharing_tuple,
    sharing_torch,
    sharing_generator,
]


@pytest.mark.parametrize("fn", SHARING_RIGHT)
def test_sharing_correct_solutions_pass(fn, capsys):
    check_sharing_map(fn)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "fn, key",
    [
        (sharing_first_of_type, "first_of_type"),
        (sharing_ignores_type, "type_ignored"),
        (sharing_sliding_to_previous, "sliding_to_previous"),
        (sharing_chain, "chain"),
        (sharing_starts_early, "one_too_many"),
        (sharing_starts_late, "one_too_few"),
        (sharing_none, "no_sharing"),
        (sharing_generator_first_of_type, "first_of_type"),
    ],
)
def test_sharing_mistakes_are_diagnosed(fn, key):
    with pytest.raises(ExerciseError) as err:
        check_sharing_map(fn)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value)


def test_sharing_cases_include_a_full_last_maker():
    """A case whose last cache-making layer is a full-attention one (Gemma
    3n E4B's layout): there the sliding sharers' source is not the layer just
    before the sharing ones."""
    from attnbook.exercises.latent import sharing_cases

    assert any(
        case.args[0][len(case.args[0]) - case.args[1] - 1] == "full_attention"
        for case in sharing_cases()
        if case.args[1] > 0
    )


def test_sharing_generator_is_reported_with_what_it_yielded():
    with pytest.raises(ExerciseError) as err:
        check_sharing_map(sharing_generator_first_of_type)
    assert "got []" not in str(err.value)
    assert "got [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 5" in str(err.value)


@pytest.mark.parametrize(
    "fn, named",
    [
        (sharing_none_for_own, "entry 0 of your map is None"),
        (sharing_half_off, "entry 0 of your map is 0.0 (a float)"),
    ],
)
def test_sharing_non_integer_entries_are_named(fn, named):
    """None or a float where a layer index belongs: a verdict naming the
    entry (not a crash, and not int()'s truncation accepting 9.5 as 9)."""
    with pytest.raises(ExerciseError) as err:
        check_sharing_map(fn)
    assert named in str(err.value)
    assert "not a layer index" in str(err.value)


def test_sharing_non_sequence_is_named():
    with pytest.raises(ExerciseError) as err:
        check_sharing_map(lambda layer_types, n_shared: 3)
    assert "not a sequence of layer indices" in str(err.value)


def test_sharing_stub_is_not_attempted():
    def stub(layer_types, n_shared):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_sharing_map(stub)


# --- the absorbed decoding step ----------------------------------------------


def softmax(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def decode_by_heads(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    """Correct: one head at a time, absorbed."""
    d = q_nope.shape[1] + q_rope.shape[1]
    out = []
    for i in range(q_nope.shape[0]):
        q_latent = w_uk[i].T @ q_nope[i]
        s = (latents @ q_latent + rope_keys @ q_rope[i]) / np.sqrt(d)
        out.append(w_uv[i] @ (softmax(s) @ latents))
    return np.stack(out)


def decode_torch(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    """Correct, in torch: one key per position [c, k_rope], the absorbed
    query [W_UK^T q_nope, q_rope], float64 throughout."""
    t = [
        torch.as_tensor(a, dtype=torch.float64)
        for a in (q_nope, q_rope, latents, rope_keys, w_uk, w_uv)
    ]
    q_nope, q_rope, latents, rope_keys, w_uk, w_uv = t
    q = torch.cat([torch.einsum("hd,hdc->hc", q_nope, w_uk), q_rope], -1)
    k = torch.cat([latents, rope_keys], -1)
    scale = (q_nope.shape[1] + q_rope.shape[1]) ** -0.5
    weights = torch.softmax(q @ k.T * scale, dim=-1)
    return torch.einsum("hc,hvc->hv", weights @ latents, w_uv).numpy()


def decode_decompressed(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    """Correct too: decompress every head's keys and values first (the
    exercise asks for the absorbed step, but the outputs are the same)."""
    keys = np.einsum("nc,hdc->hnd", latents, w_uk)
    values = np.einsum("nc,hvc->hnv", latents, w_uv)
    d = q_nope.shape[1] + q_rope.shape[1]
    s = np.einsum("hd,hnd->hn", q_nope, keys) + q_rope @ rope_keys.T
    return np.einsum("hn,hnv->hv", softmax(s / np.sqrt(d)), values)


def decode_latent_scale(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    q_latent = np.einsum("hd,hdc->hc", q_nope, w_uk)
    q = np.concatenate([q_latent, q_rope], axis=1)
    k = np.concatenate([latents, rope_keys], axis=1)
    w = softmax(q @ k.T / np.sqrt(q.shape[1]))
    return np.einsum("hc,hvc->hv", w @ latents, w_uv)


def decode_no_rope(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    d = q_nope.shape[1] + q_rope.shape[1]
    q_latent = np.einsum("hd,hdc->hc", q_nope, w_uk)
    w = softmax(q_latent @ latents.T / np.sqrt(d))
    return np.einsum("hc,hvc->hv", w @ latents, w_uv)


def decode_nope_scale(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    out = []
    for i in range(q_nope.shape[0]):
        s = latents @ (w_uk[i].T @ q_nope[i]) + rope_keys @ q_rope[i]
        out.append(w_uv[i] @ (softmax(s / np.sqrt(q_nope.shape[1])) @ latents))
    return np.stack(out)


def decode_unscaled(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    s = (
        np.einsum("hd,hdc,nc->hn", q_nope, w_uk, latents)
        + q_rope @ rope_keys.T
    )
    return np.einsum("hc,hvc->hv", softmax(s) @ latents, w_uv)


def decode_head_zero(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    d = q_nope.shape[1] + q_rope.shape[1]
    q_latent = q_nope @ w_uk[0]
    s = (q_latent @ latents.T + q_rope @ rope_keys.T) / np.sqrt(d)
    return np.einsum("hc,hvc->hv", softmax(s) @ latents, w_uv)


def decode_naive_softmax(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    d = q_nope.shape[1] + q_rope.shape[1]
    s = (
        np.einsum("hd,hdc,nc->hn", q_nope, w_uk, latents)
        + q_rope @ rope_keys.T
    )
    e = np.exp(s / np.sqrt(d))
    return np.einsum(
        "hc,hvc->hv", (e / e.sum(1, keepdims=True)) @ latents, w_uv
    )


def decode_global_max(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    """Wrong: the softmax subtracts the maximum over all heads."""
    d = q_nope.shape[1] + q_rope.shape[1]
    s = (
        np.einsum("hd,hdc,nc->hn", q_nope, w_uk, latents)
        + q_rope @ rope_keys.T
    ) / np.sqrt(d)
    e = np.exp(s - s.max())
    return np.einsum(
        "hc,hvc->hv", (e / e.sum(1, keepdims=True)) @ latents, w_uv
    )


def decode_rope_unscaled(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    """Wrong: the rotary part is added after the latent part is scaled."""
    d = q_nope.shape[1] + q_rope.shape[1]
    q_latent = np.einsum("hd,hdc->hc", q_nope, w_uk)
    s = q_latent @ latents.T / np.sqrt(d) + q_rope @ rope_keys.T
    return np.einsum("hc,hvc->hv", softmax(s) @ latents, w_uv)


def decode_rope_scaled_apart(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    """Wrong: each part scaled by its own length, the latent part by
    sqrt(d_nope + d_rope), the rotary part by sqrt(d_rope)."""
    d_rope = q_rope.shape[1]
    d = q_nope.shape[1] + d_rope
    out = []
    for i in range(q_nope.shape[0]):
        qt = w_uk[i].T @ q_nope[i]
        s = latents @ qt / np.sqrt(d) + rope_keys @ q_rope[i] / np.sqrt(d_rope)
        out.append(w_uv[i] @ (softmax(s) @ latents))
    return np.stack(out)


def decode_head_zero_uv(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    """Wrong: every head's weighted latent goes through head 0's W_UV."""
    d = q_nope.shape[1] + q_rope.shape[1]
    out = []
    for i in range(q_nope.shape[0]):
        s = latents @ (w_uk[i].T @ q_nope[i]) + rope_keys @ q_rope[i]
        out.append(w_uv[0] @ (softmax(s / np.sqrt(d)) @ latents))
    return np.stack(out)


def decode_softmax_over_heads(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    """Wrong: the softmax normalises each position over the heads."""
    d = q_nope.shape[1] + q_rope.shape[1]
    s = (
        np.einsum("hd,hdc,nc->hn", q_nope, w_uk, latents)
        + q_rope @ rope_keys.T
    ) / np.sqrt(d)
    e = np.exp(s - s.max(axis=0))
    w = e / e.sum(axis=0)
    return np.einsum("hc,hvc->hv", w @ latents, w_uv)


def decode_softmax_over_all(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    """Wrong, in torch: one softmax over every score of every head."""
    t = [
        torch.as_tensor(a, dtype=torch.float64)
        for a in (q_nope, q_rope, latents, rope_keys, w_uk, w_uv)
    ]
    q_nope, q_rope, latents, rope_keys, w_uk, w_uv = t
    d = q_nope.shape[1] + q_rope.shape[1]
    q_latent = torch.einsum("hd,hdc->hc", q_nope, w_uk)
    s = (q_latent @ latents.T + q_rope @ rope_keys.T) / d**0.5
    w = torch.softmax(s.flatten(), dim=0).reshape(s.shape)
    return torch.einsum("hc,hvc->hv", w @ latents, w_uv).numpy()


def _largest_scores(case):
    """Each head's largest scaled score, in float64: (h,)."""
    q_nope, q_rope, latents, rope_keys, w_uk, _ = (
        np.asarray(a, dtype=np.float64) for a in case.args
    )
    s = (
        np.einsum("hd,hdc,nc->hn", q_nope, w_uk, latents)
        + q_rope @ rope_keys.T
    )
    return s.max(axis=1) / np.sqrt(q_nope.shape[1] + q_rope.shape[1])


def test_decode_large_case_overflows_exp_in_every_head():
    """exp overflows float64 above 709.78: every head of the large case must
    pass 720, so that the unstable softmax fails on each head, not by luck on
    one; and its name gives the real values."""
    (case,) = [c for c in decode_cases() if c.name.startswith("large")]
    largest = _largest_scores(case)
    assert np.all(largest > 720)
    for value in np.sort(largest):
        assert f"{value:.0f}" in case.name


def test_decode_heads_far_apart_case_underflows_the_lower_head():
    """exp underflows float64 below about -745: head 1's weights vanish when
    head 0's maximum is subtracted, so a global maximum gives 0 / 0."""
    (case,) = [c for c in decode_cases() if c.name.startswith("heads far")]
    largest = _largest_scores(case)
    assert largest[0] - largest[1] > 2 * 745
    assert f"{largest[0]:.0f}" in case.name
    assert np.all(np.isfinite(_decode_reference(*case.args)))


def test_decode_reference_is_float64_on_float32_inputs():
    """The reference computes in float64 even from float32 arrays."""
    (case,) = [c for c in decode_cases() if c.name.startswith("float32")]
    assert all(a.dtype == np.float32 for a in case.args)
    as64 = [a.astype(np.float64) for a in case.args]
    np.testing.assert_array_equal(
        _decode_reference(*case.args), _decode_reference(*as64)
    )


@pytest.mark.parametrize(
    "fn", [decode_by_heads, decode_torch, decode_decompressed]
)
def test_decode_correct_solutions_pass(fn, capsys):
    check_absorbed_decode_step(fn)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "fn, key",
    [
        (decode_latent_scale, "latent_scale"),
        (decode_no_rope, "no_rope"),
        (decode_nope_scale, "nope_scale"),
        (decode_unscaled, "no_scale"),
        (decode_head_zero, "one_head_matrices"),
        (decode_naive_softmax, "unstable_softmax"),
        (decode_global_max, "global_max"),
        (decode_rope_unscaled, "rope_unscaled"),
        (decode_rope_scaled_apart, "rope_scaled_apart"),
        (decode_head_zero_uv, "one_head_uv"),
        (decode_softmax_over_heads, "softmax_over_heads"),
        (decode_softmax_over_all, "softmax_over_all"),
    ],
)
def test_decode_mistakes_are_diagnosed(fn, key):
    with pytest.raises(ExerciseError) as err:
        check_absorbed_decode_step(fn)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value)


def test_decode_stub_is_not_attempted():
    def stub(*args):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_absorbed_decode_step(stub)


def test_decode_unknown_mistake_gets_no_diagnosis():
    with pytest.raises(ExerciseError) as err:
        check_absorbed_decode_step(lambda *a: 2 * decode_by_heads(*a))
    assert err.value.mistake is None


CATALOGUE = {
    "check_sharing_map": {
        "right": SHARING_RIGHT,
        "wrong": [
            (sharing_first_of_type, "first_of_type"),
            (sharing_ignores_type, "type_ignored"),
            (sharing_sliding_to_previous, "sliding_to_previous"),
            (sharing_chain, "chain"),
            (sharing_starts_early, "one_too_many"),
            (sharing_starts_late, "one_too_few"),
            (sharing_none, "no_sharing"),
            (sharing_generator_first_of_type, "first_of_type"),
        ],
    },
    "check_absorbed_decode_step": {
        "right": [decode_by_heads, decode_torch, decode_decompressed],
        "wrong": [
            (decode_latent_scale, "latent_scale"),
            (decode_no_rope, "no_rope"),
            (decode_nope_scale, "nope_scale"),
            (decode_unscaled, "no_scale"),
            (decode_head_zero, "one_head_matrices"),
            (decode_naive_softmax, "unstable_softmax"),
            (decode_global_max, "global_max"),
            (decode_rope_unscaled, "rope_unscaled"),
            (decode_rope_scaled_apart, "rope_scaled_apart"),
            (decode_rope_scaled_apart, "rope_scaled_apart"),
            (decode_head_zero_uv, "one_head_uv"),
            (decode_softmax_over_heads, "softmax_over_heads"),
            (decode_softmax_over_all, "softmax_over_all"),
        ],
    },
}


def sharing_full_to_previous(layer_types, n_shared):
    """Sliding layers look up their type; full ones take the layer just
    before the sharing ones (reader mla-d: the mirror of
    sliding_to_previous, named since it is a partial 'type ignored')."""
    first = len(layer_types) - n_shared
    out = []
    for i, kind in enumerate(layer_types):
        if i < first:
            out.append(i)
        elif kind == "full_attention":
            out.append(first - 1)
        else:
            out.append(max(j for j in range(first) if layer_types[j] == kind))
    return out


CATALOGUE["check_sharing_map"]["wrong"].append(
    (sharing_full_to_previous, "full_to_previous")
)


def test_full_layers_taking_the_previous_layer_are_named():
    with pytest.raises(ExerciseError) as err:
        check_sharing_map(sharing_full_to_previous)
    assert err.value.mistake == "full_to_previous"
