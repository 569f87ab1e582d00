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
        + ": the later new tokens of a chunk stay visible (with one "
        "new token every score gets +1, which changes nothing, so only the "
        "chunk cases show it)",
        FLOAT_MASK_HINT + "; or pass attn_mask=torch.ones(n_new, p + n_new, "
        "dtype=torch.bool).tril(p)",
        _float_mask_added,
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
