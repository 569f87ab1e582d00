"""Checkers for latent attention and shared caches (chapter 13): which layer
reuses which cache, and the absorbed decoding step of multi-head latent
attention.

The sharing map has one classic mistake in many forms: a layer that reuses a
cache must reuse one of its own attention type (a sliding-window layer's cache
holds only the window), and the last such layer *before* the shared ones. The
absorbed step has the mistakes of the derivation: the scale taken from the
length of the absorbed query instead of the key it stands for, the rotary part
forgotten, left unscaled or scaled apart by sqrt(d_rope), the scores unscaled
or scaled by sqrt(d_nope), one head's W_UK or W_UV used for all, a softmax
that overflows or that subtracts one maximum for all heads instead of each
head's own, and a softmax taken over the heads or over the whole array
instead of over each head's positions. That the absorbed step never forms a
head's keys or values is not checked: only the outputs are compared.
"""

from __future__ import annotations

import operator

import numpy as np

from ._framework import Case, Mistake, as_array, run_checks


# --- the sharing map of Gemma 3n and Gemma 4 ---------------------------------


def _first_shared(layer_types, n_shared: int) -> int:
    return len(layer_types) - n_shared


def _reference_sources(layer_types, n_shared):
    first = _first_shared(layer_types, n_shared)
    last_of = {kind: i for i, kind in enumerate(layer_types[:first])}
    return [
        i if i < first else last_of[kind] for i, kind in enumerate(layer_types)
    ]


def _first_of_type(layer_types, n_shared):
    first = _first_shared(layer_types, n_shared)
    first_of = {}
    for i, kind in enumerate(layer_types[:first]):
        first_of.setdefault(kind, i)
    return [
        i if i < first else first_of[kind]
        for i, kind in enumerate(layer_types)
    ]


def _previous_layer(layer_types, n_shared):
    first = _first_shared(layer_types, n_shared)
    return [i if i < first else first - 1 for i in range(len(layer_types))]


def _nearest_of_type(layer_types, n_shared):
    """Each sharing layer points at the nearest earlier layer of its type,
    sharing or not (a chain)."""
    first = _first_shared(layer_types, n_shared)
    sources = []
    for i, kind in enumerate(layer_types):
        if i < first:
            sources.append(i)
        else:
            sources.append(max(j for j in range(i) if layer_types[j] == kind))
    return sources


def _sliding_to_previous(layer_types, n_shared):
    """Only full-attention layers look up their own type; every sliding one
    reuses the last layer before the sharing ones, whatever its type."""
    first = _first_shared(layer_types, n_shared)
    last_of = {kind: i for i, kind in enumerate(layer_types[:first])}
    return [
        i if i < first else (last_of[kind] if kind == _F else first - 1)
        for i, kind in enumerate(layer_types)
    ]


def _full_to_previous(layer_types, n_shared):
    """The mirror of _sliding_to_previous: every full-attention layer that
    shares reuses the last layer before the sharing ones, whatever its type
    (reader mla-d)."""
    first = _first_shared(layer_types, n_shared)
    last_of = {kind: i for i, kind in enumerate(layer_types[:first])}
    return [
        i if i < first else (last_of[kind] if kind != _F else first - 1)
        for i, kind in enumerate(layer_types)
    ]


def _shifted(shift: int):
    def wrong(layer_types, n_shared):
        return _reference_sources(layer_types, n_shared + shift)

    return wrong


def _shared_point_at_themselves(layer_types, n_shared):
    return list(range(len(layer_types)))


SHARING_MISTAKES = [
    Mistake(
        "first_of_type",
        "a sharing layer reuses the FIRST layer of its type, not the last one "
        "before the sharing layers",
        "keep, for each type, the index of the last layer before "
        "len(layer_types) - n_shared: a dict filled in order does it",
        _first_of_type,
    ),
    Mistake(
        "type_ignored",
        "every sharing layer reuses the last layer before them, whatever its "
        "type: a full-attention layer would read a sliding window's cache",
        "a layer reuses a cache of its own attention type: look up the last "
        "earlier layer whose type equals its own",
        _previous_layer,
    ),
    Mistake(
        "sliding_to_previous",
        "a sliding-window layer that shares reuses the last layer before the "
        "sharing ones whatever its type: when that layer is a full-attention "
        "one, the sliding layer reads a full layer's cache",
        "look up every sharing layer's own type, sliding ones too: the last "
        "layer that makes a cache need not be a sliding one",
        _sliding_to_previous,
    ),
    Mistake(
        "full_to_previous",
        "a full-attention layer that shares reuses the last layer before the "
        "sharing ones whatever its type: when that layer is a sliding-window "
        "one, the full layer reads a window's cache",
        "look up every sharing layer's own type, full ones too: the last "
        "layer that makes a cache need not be a full-attention one",
        _full_to_previous,
    ),
    Mistake(
        "chain",
        "a sharing layer points at the nearest earlier layer of its type even "
        "when that layer shares too: such a layer has no cache of its own",
        "look only at the layers before len(layer_types) - n_shared: they are "
        "the ones that make a cache",
        _nearest_of_type,
    ),
    Mistake(
        "one_too_many",
        "n_shared + 1 layers share: the sharing starts one layer too early",
        "the sharing layers are the last n_shared, from index "
        "len(layer_types) - n_shared on",
        _shifted(1),
    ),
    Mistake(
        "one_too_few",
        "n_shared - 1 layers share: the sharing starts one layer too late",
        "the sharing layers are the last n_shared, from index "
        "len(layer_types) - n_shared on",
        _shifted(-1),
    ),
    Mistake(
        "no_sharing",
        "every layer points at itself: no layer shares",
        "the last n_shared layers reuse an earlier layer's cache",
        _shared_point_at_themselves,
    ),
]

_S, _F = "sliding_attention", "full_attention"


def sharing_cases() -> list[Case]:
    pattern = ([_S] * 5 + [_F]) * 5
    return [
        Case("30 layers, 5:1 sliding:full, the last 20 share", (pattern, 20)),
        Case("30 layers, 5:1, the last 10 share", (pattern, 10)),
        Case(
            "12 layers, 3:1, the last 5 share",
            (([_S] * 3 + [_F]) * 3, 5),
        ),
        Case("8 layers, 3:1, no sharing", (([_S] * 3 + [_F]) * 2, 0)),
        Case(
            "6 layers, alternating, the last 3 share",
            ([_S, _F] * 3, 3),
        ),
        Case(
            "35 layers, 4:1, the last 15 share (Gemma 3n E4B): the last "
            "layer that makes a cache is a full one",
            (([_S] * 4 + [_F]) * 7, 15),
        ),
    ]


class _NotASourceMap:
    """What the reader returned, when it is not a list of layer indices: no
    comparison accepts it, and ``problem`` says why."""

    def __init__(self, problem: str):
        self.problem = problem


def _as_sources(out):
    """The reader's map as a list of Python ints, read once (a generator can
    be read only once); a ``_NotASourceMap`` naming the first entry that is
    not an integer (None, a float) or a return value that is not a
    sequence."""
    try:
        entries = list(out)
    except TypeError:
        return _NotASourceMap(
            f"your function returned {out!r}, not a sequence of layer "
            "indices (one per layer)"
        )
    sources = []
    for i, entry in enumerate(entries):
        try:
            sources.append(operator.index(entry))
        except TypeError:
            what = (
                "None"
                if entry is None
                else f"{entry!r} (a {type(entry).__name__})"
            )
            return _NotASourceMap(
                f"entry {i} of your map is {what}, not a layer "
                "index: every layer, sharing or not, gets the integer index "
                "of the layer whose cache it uses (itself when it makes its "
                "own)"
                + (
                    "; a float is not one, even a whole one: make the "
                    "indices ints (int(), .astype(int))"
                    if isinstance(entry, (float, np.floating))
                    else ""
                )
            )
    return sources


def _same_sources(got, want) -> bool:
    return not isinstance(got, _NotASourceMap) and got == want


def _describe_sources(got, want, case) -> str:
    if isinstance(got, _NotASourceMap):
        return got.problem
    return f"expected {want}, got {got}"


def check_sharing_map(fn) -> None:
    """Check ``fn(layer_types, n_shared)`` returns, for each layer, the layer
    whose cache it attends with: itself for the first ``len(layer_types) -
    n_shared`` layers, and for each of the others the last of those of its
    own type."""
    run_checks(
        "the sharing map",
        fn,
        sharing_cases(),
        _reference_sources,
        SHARING_MISTAKES,
        compare=_same_sources,
        postprocess=_as_sources,
        describe=_describe_sources,
    )


# --- the absorbed decoding step ----------------------------------------------


def _softmax(s):
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


def _absorbed(
    q_nope,
    q_rope,
    latents,
    rope_keys,
    w_uk,
    w_uv,
    scale_dim=None,
    rope=True,
    heads_uk=None,
    stable=True,
    global_max=False,
    rope_scaled=True,
    heads_uv=None,
    softmax_axis=-1,
    rope_apart=False,
):
    """The reference and its mistakes: one decoding step of MLA, in numpy.

    q_nope (h, d_nope), q_rope (h, d_rope), latents (n, d_c), rope_keys (n,
    d_rope), w_uk (h, d_nope, d_c), w_uv (h, d_v, d_c) -> (h, d_v).
    ``softmax_axis``: -1 (each head over its positions), 0 (over the heads)
    or None (over the whole (h, n) array). ``rope_apart``: the rotary part
    divided by sqrt(d_rope) on its own, the latent part by the scale.
    """
    d_nope, d_rope = q_nope.shape[-1], q_rope.shape[-1]
    w_k = w_uk if heads_uk is None else heads_uk(w_uk)
    # (h, d_c): W_UK^(i)T q^(i)
    q_latent = np.einsum("hd,hdc->hc", q_nope, w_k)
    scores = q_latent @ latents.T
    rope_scores = q_rope @ rope_keys.T
    if rope and rope_scaled and not rope_apart:
        scores = scores + rope_scores
    d_c = latents.shape[-1]
    dim = (
        d_nope + d_rope
        if scale_dim is None
        else scale_dim(d_nope, d_rope, d_c)
    )
    scores = scores / np.sqrt(dim)
    if rope and not rope_scaled:
        scores = scores + rope_scores
    if rope and rope_apart:
        scores = scores + rope_scores / np.sqrt(d_rope)
    if softmax_axis != -1:
        e = np.exp(scores - scores.max(axis=softmax_axis, keepdims=True))
        weights = e / e.sum(axis=softmax_axis, keepdims=True)
    elif global_max:
        e = np.exp(scores - scores.max())
        weights = e / e.sum(axis=-1, keepdims=True)
    elif stable:
        weights = _softmax(scores)
    else:
        e = np.exp(scores)
        weights = e / e.sum(axis=-1, keepdims=True)
    w_v = w_uv if heads_uv is None else heads_uv(w_uv)
    # (h, d_c): the weighted sum of latents, then W_UV^(i): (h, d_v)
    return np.einsum("hc,hvc->hv", weights @ latents, w_v)


def _decode_reference(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
    """The reference, in float64 whatever the case's dtype."""
    arrays = (q_nope, q_rope, latents, rope_keys, w_uk, w_uv)
    return _absorbed(*(np.asarray(a, dtype=np.float64) for a in arrays))


def _mistake(**wrong):
    def commit(q_nope, q_rope, latents, rope_keys, w_uk, w_uv):
        return _absorbed(
            q_nope, q_rope, latents, rope_keys, w_uk, w_uv, **wrong
        )

    return commit


DECODE_MISTAKES = [
    Mistake(
        "latent_scale",
        "the scores are divided by sqrt(d_c + d_rope), the length of the "
        "absorbed query, instead of sqrt(d_nope + d_rope), that of the "
        "query and key the score stands for",
        "absorption rewrites the same score q . k: its scale is the "
        "decompressed one, 1 / sqrt(d_nope + d_rope)",
        _mistake(scale_dim=lambda d_nope, d_rope, d_c: d_c + d_rope),
    ),
    Mistake(
        "no_rope",
        "the rotary part of the score (q_rope . rope_key) is left out",
        "each score is the latent part plus the rotary part: add q_rope @ "
        "rope_keys.T before the softmax",
        _mistake(rope=False),
    ),
    Mistake(
        "nope_scale",
        "the scores are divided by sqrt(d_nope), leaving out the d_rope "
        "rotary features of each query and key",
        "the score is a sum over d_nope + d_rope features: divide by "
        "sqrt(d_nope + d_rope)",
        _mistake(scale_dim=lambda d_nope, d_rope, d_c: d_nope),
    ),
    Mistake(
        "no_scale",
        "the scores are not scaled at all",
        "divide the scores by sqrt(d_nope + d_rope), as for the decompressed "
        "query and key",
        _mistake(scale_dim=lambda d_nope, d_rope, d_c: 1),
    ),
    Mistake(
        "one_head_matrices",
        "every head's query is absorbed with head 0's W_UK",
        "each head has its own W_UK^(i): contract q_nope[i] with w_uk[i] "
        "(np.einsum('hd,hdc->hc', q_nope, w_uk))",
        _mistake(heads_uk=lambda w: np.broadcast_to(w[:1], w.shape)),
    ),
    Mistake(
        "unstable_softmax",
        "the softmax overflows: its exponentials are taken without "
        "subtracting the row's maximum",
        "subtract each row's maximum score before np.exp",
        _mistake(stable=False),
    ),
    Mistake(
        "global_max",
        "the softmax subtracts one maximum, over all heads, instead of each "
        "head's own: a head whose scores lie far below another's underflows "
        "to 0 / 0",
        "subtract each row's maximum (s.max(axis=-1, keepdims=True)), not "
        "s.max()",
        _mistake(global_max=True),
    ),
    Mistake(
        "rope_unscaled",
        "only the latent part of the score is scaled: the rotary part "
        "(q_rope . rope_key) is added after the division",
        "the scale divides the whole score, latent part plus rotary part: add "
        "the two, then divide by sqrt(d_nope + d_rope)",
        _mistake(rope_scaled=False),
    ),
    Mistake(
        "rope_scaled_apart",
        "the rotary part of the score is divided by sqrt(d_rope) on its own, "
        "the latent part by sqrt(d_nope + d_rope): the two parts are one dot "
        "product of d_nope + d_rope features, scaled once",
        "add the latent part and the rotary part, then divide the sum by "
        "sqrt(d_nope + d_rope)",
        _mistake(rope_apart=True),
    ),
    Mistake(
        "one_head_uv",
        "every head's weighted latent is mapped back with head 0's W_UV",
        "each head has its own W_UV^(i): contract head i's weighted latent "
        "with w_uv[i] (np.einsum('hc,hvc->hv', ..., w_uv))",
        _mistake(heads_uv=lambda w: np.broadcast_to(w[:1], w.shape)),
    ),
    Mistake(
        "softmax_over_heads",
        "the softmax runs over the heads (axis 0), not over each head's "
        "cached positions: the weights of a position sum to 1 across heads",
        "each head's weights over the n positions sum to 1: take the softmax "
        "along the last axis of the (h, n) scores (axis=-1)",
        _mistake(softmax_axis=0),
    ),
    Mistake(
        "softmax_over_all",
        "the softmax runs over the whole (h, n) array: all the weights of all "
        "heads together sum to 1",
        "each head has its own softmax: normalise along the last axis of the "
        "(h, n) scores (axis=-1, keepdims=True), not over the whole array",
        _mistake(softmax_axis=None),
    ),
]


def decode_cases() -> list[Case]:
    def case(seed, h, n, d_c, d_rope, d_nope, d_v, size=1.0, dtype=None):
        g = np.random.default_rng(seed)
        # one scale for all heads, or one per head
        size = np.reshape(np.asarray(size, dtype=np.float64), (-1, 1))
        arrays = (
            g.normal(size=(h, d_nope)) * size,
            g.normal(size=(h, d_rope)) * size,
            g.normal(size=(n, d_c)),
            g.normal(size=(n, d_rope)),
            g.normal(size=(h, d_nope, d_c)) / np.sqrt(d_c),
            g.normal(size=(h, d_v, d_c)) / np.sqrt(d_c),
        )
        return tuple(a.astype(dtype) if dtype else a for a in arrays)

    return [
        Case(
            "h = 3 heads, n = 7 positions, d_c = 8, d_rope = 4, d_nope = 6, "
            "d_v = 5",
            case(0, 3, 7, 8, 4, 6, 5),
        ),
        Case(
            "h = 4, n = 5, d_c = 12, d_rope = 2, d_nope = 3, d_v = 3",
            case(1, 4, 5, 12, 2, 3, 3),
        ),
        Case("a single cached position (n = 1)", case(2, 2, 1, 6, 4, 4, 2)),
        Case(
            "large scores: each head's largest is 871, 1161 or 1425 "
            "(queries scaled by 800)",
            case(3, 3, 6, 8, 4, 6, 5, size=800.0),
        ),
        Case(
            "heads far apart: head 0's largest score is 3528, head 1's 0.8 "
            "(head 0's queries scaled by 1000)",
            case(6, 2, 6, 8, 4, 6, 5, size=[1000.0, 1.0]),
        ),
        Case(
            "float32 inputs, h = 2, n = 9, d_c = 16, d_rope = 8",
            case(4, 2, 9, 16, 8, 4, 4, dtype=np.float32),
        ),
    ]


def check_absorbed_decode_step(fn) -> None:
    """Check ``fn(q_nope, q_rope, latents, rope_keys, w_uk, w_uv)`` returns
    the attention outputs (h, d_v) of one new token over the cached latents,
    W_UK absorbed into the query and W_UV applied after the weighted sum."""
    run_checks(
        "the absorbed decoding step",
        fn,
        decode_cases(),
        _decode_reference,
        DECODE_MISTAKES,
        compare=lambda got, want: _close(got, want),
    )


def _close(got, want) -> bool:
    got, want = as_array(got), as_array(want)
    return got.shape == want.shape and bool(
        np.allclose(
            got.astype(np.float64), want, rtol=1e-4, atol=1e-5, equal_nan=True
        )
    )
