"""Checkers for chapter 6: attention with RoPE, and the ALiBi bias.

``check_rope_attention`` imports torch; load it from this module
(``from attnbook.exercises.positional import check_rope_attention``).
"""

from __future__ import annotations

import numpy as np
import torch

from ..positional import alibi_bias, alibi_slopes, apply_rope
from ..torch_attention import attend
from ._framework import Case, Mistake, as_array, run_checks

_rng = np.random.default_rng


def _first(out):
    """Accept either the output alone or an ``(output, weights)`` pair."""
    return out[0] if isinstance(out, tuple) else out


# --- attention with RoPE on queries and keys ---------------------------------


def _rope_with(x, base=10000.0, sign=1.0, exponent=2.0, positions=None):
    """Half-layout RoPE with a sign on the angle and an exponent ``e`` in
    ``base ** (-e i / d)``."""
    d = x.shape[-1]
    freqs = base ** (-exponent * np.arange(d // 2) / d)
    return apply_rope(x, positions=positions, frequencies=sign * freqs)


def query_positions(q, k, shift=0):
    """The queries' positions: the last ``n_q`` of the ``n_k`` key positions
    ``0 .. n_k - 1`` (plus ``shift``)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    return torch.arange(n_k - n_q + shift, n_k + shift)


def _rope_q(q, k, **kw):
    """The queries rotated at their positions, the end of the keys'."""
    return _rope_with(q, positions=query_positions(q, k), **kw)


def rope_attention(q, k, v):
    """The reference: ``softmax(R(q) R(k)^T / sqrt(d_k)) v``, half layout,
    keys at positions ``0 .. n_k - 1`` and the queries the last ``n_q`` of
    them, no mask."""
    return attend(_rope_q(q, k), apply_rope(k), v)


ROPE_MISTAKES = [
    Mistake(
        "rope_on_values",
        "RoPE was applied to the values as well as to the queries and keys",
        "rotate q and k only: the rotation is there to make the scores q.k "
        "depend on m - n; "
        "rotating v makes what each key hands on depend on its absolute "
        "position",
        lambda q, k, v: attend(_rope_q(q, k), apply_rope(k), apply_rope(v)),
    ),
    Mistake(
        "q_only",
        "RoPE was applied to the queries but not to the keys",
        "rotate both: q_m . k_n depends on m - n only when q is turned by "
        "m*theta and k by n*theta",
        lambda q, k, v: attend(_rope_q(q, k), k, v),
    ),
    Mistake(
        "k_only",
        "RoPE was applied to the keys but not to the queries",
        "rotate both q and k, each by its own position",
        lambda q, k, v: attend(q, apply_rope(k), v),
    ),
    Mistake(
        "no_rope",
        "no rotation at all: this is plain attention, blind to position",
        "apply attnbook.positional.apply_rope (or your own rotation) to q and "
        "k before the scores",
        lambda q, k, v: attend(q, k, v),
    ),
    Mistake(
        "rope_on_output",
        "the rotation was applied to the attention output instead of to q and "
        "k",
        "rotate q and k before computing the scores; the output is not "
        "rotated",
        lambda q, k, v: _rope_q(attend(q, k, v), k),
    ),
    Mistake(
        "interleaved_layout",
        "the pairs are (2i, 2i+1) (interleaved layout); this exercise uses "
        "the half "
        "layout, pairs (i, i + d/2)",
        "use layout='half': pair i is feature i with feature i + d/2. A "
        "checkpoint cares which one you use",
        lambda q, k, v: attend(
            apply_rope(
                q, positions=query_positions(q, k), layout="interleaved"
            ),
            apply_rope(k, layout="interleaved"),
            v,
        ),
    ),
    Mistake(
        "reversed_rotation",
        "each pair is rotated by -m*theta instead of +m*theta (a sign error "
        "in the sines, "
        "or positions counted backwards, n_k - 1 .. 0, for both q and k: "
        "the two give the same scores)",
        "the first half becomes x1*cos - x2*sin and the second x1*sin + "
        "x2*cos, with the keys at positions 0, 1, ..., n_k - 1 and the "
        "queries at the last n_q of them",
        lambda q, k, v: attend(
            _rope_q(q, k, sign=-1.0), _rope_with(k, sign=-1.0), v
        ),
    ),
    Mistake(
        "frequency_exponent",
        "the frequencies are base**(-i/d) instead of base**(-2i/d)",
        "pair i (i = 0 .. d/2 - 1) turns at base**(-2i/d) radians per "
        "position",
        lambda q, k, v: attend(
            _rope_q(q, k, exponent=1.0), _rope_with(k, exponent=1.0), v
        ),
    ),
    Mistake(
        "opposite_rotations",
        "the keys are rotated the opposite way (by -n*theta): the scores then "
        "depend on m + n, the absolute positions, instead of on m - n",
        "rotate q and k the same way, each by its own position: R(m) q . R(n) "
        "k = q . R(n - m) k",
        lambda q, k, v: attend(_rope_q(q, k), _rope_with(k, sign=-1.0), v),
    ),
    Mistake(
        "key_positions_shifted",
        "the keys are rotated at positions 1 .. n_k instead of 0 .. n_k - 1: "
        "every score sees the distance off by one",
        "rotate the keys at 0 .. n_k - 1 and the queries at n_k - n_q .. n_k "
        "- 1 (or shift both alike: only m - n matters, so one shift for both "
        "is harmless, a shift of one of them is not)",
        lambda q, k, v: attend(
            _rope_q(q, k),
            apply_rope(k, positions=torch.arange(1, k.shape[-2] + 1)),
            v,
        ),
    ),
    Mistake(
        "key_positions_reversed",
        "the keys are rotated at positions n_k - 1 .. 0, in reverse order",
        "key n sits at position n: rotate the keys at positions 0, 1, ..., "
        "n_k - 1, in that order, and the queries at n_k - n_q .. n_k - 1",
        lambda q, k, v: attend(
            _rope_q(q, k),
            apply_rope(k, positions=torch.arange(k.shape[-2] - 1, -1, -1)),
            v,
        ),
    ),
    Mistake(
        "queries_from_zero",
        "the queries were rotated at positions 0 .. n_q - 1, as if they began "
        "the sequence; they are the last n_q of the n_k positions",
        "rotate the keys at 0 .. n_k - 1 and the queries at n_k - n_q .. n_k "
        "- 1 (apply_rope's positions argument), so that each score sees the "
        "true distance between its query and key",
        lambda q, k, v: attend(apply_rope(q), apply_rope(k), v),
    ),
    Mistake(
        "query_positions_shifted",
        "the queries are rotated one position too far, at n_k - n_q + 1 .. "
        "n_k instead of n_k - n_q .. n_k - 1: every score sees the distance "
        "off by one",
        "rotate query m and key n at their own positions, both counted from 0 "
        "(or both from 1: only m - n matters, so one shift for both is "
        "harmless, a shift of one of them is not)",
        lambda q, k, v: attend(
            apply_rope(q, positions=query_positions(q, k, shift=1)),
            apply_rope(k),
            v,
        ),
    ),
    Mistake(
        "scale_d_v",
        "the scores are divided by sqrt(d_v) instead of sqrt(d_k)",
        "the scale belongs to the dot products q.k, which have d_k terms: "
        "divide by sqrt(q.shape[-1]), whatever the width of the values",
        lambda q, k, v: attend(
            _rope_q(q, k), apply_rope(k), v, scale=v.shape[-1] ** -0.5
        ),
    ),
    Mistake(
        "no_scale",
        "the scores are not divided by sqrt(d_k)",
        "RoPE preserves lengths, so the scaling of chapter 3 is still needed",
        lambda q, k, v: attend(_rope_q(q, k), apply_rope(k), v, scale=1.0),
    ),
    Mistake(
        "causal_mask",
        "a causal mask was applied: query m attends only to keys n <= m",
        "this exercise asks for no mask: every query attends to all n_k keys "
        "(a model would add the causal mask separately; here only the "
        "rotation is asked for)",
        lambda q, k, v: attend(
            _rope_q(q, k),
            apply_rope(k),
            v,
            mask=query_positions(q, k)[:, None]
            >= torch.arange(k.shape[-2])[None, :],
        ),
    ),
]

#: Given when no mistake of ROPE_MISTAKES matches: the exercise's conventions,
#: one by one.
ROPE_HINT = (
    "check each convention of the exercise in turn: base 10000, so that pair "
    "i turns at theta_i = 10000**(-2i/d_k) radians per position; the half "
    "layout (pair i is feature i with feature i + d_k/2); key n rotated by "
    "n*theta_i for n = 0 .. n_k - 1 and query m by m*theta_i for m = n_k - "
    "n_q .. n_k - 1; the values not rotated; no mask; the scores divided by "
    "sqrt(d_k)"
)


def rope_attention_cases() -> list[Case]:
    rng = _rng(6)

    def t(*shape, scale=1.0):
        return torch.from_numpy(rng.normal(scale=scale, size=shape))

    return [
        Case(
            "n = 6 positions, d_k = d_v = 8",
            (t(6, 8, scale=1.5), t(6, 8, scale=1.5), t(6, 8)),
        ),
        Case(
            "a batch of 2 sequences, n = 5, d_k = d_v = 16",
            (t(2, 5, 16, scale=1.5), t(2, 5, 16, scale=1.5), t(2, 5, 16)),
        ),
        Case(
            "d_v = 6 differs from d_k = 4, 3 queries at the end of 7 keys",
            (t(3, 4, scale=2.0), t(7, 4, scale=2.0), t(7, 6)),
        ),
        Case(
            "a single query at the end of 6 keys (one decoding step)",
            (t(1, 8, scale=1.5), t(6, 8, scale=1.5), t(6, 8)),
        ),
    ]


def check_rope_attention(fn) -> None:
    """Check ``fn(q, k, v)`` = attention with RoPE (half layout, base 10000) on
    ``q`` and ``k``.

    q: torch float64 ``(..., n_q, d_k)``; k: ``(..., n_k, d_k)``; v: ``(...,
    n_k, d_v)``; keys at positions ``0 .. n_k - 1``, queries the last ``n_q``
    of them; no mask; scores scaled by ``1/sqrt(d_k)``. ``fn`` may return the
    output or ``(output, weights)``.
    """
    run_checks(
        "attention with RoPE",
        fn,
        rope_attention_cases(),
        rope_attention,
        ROPE_MISTAKES,
        postprocess=_first,
        hint=ROPE_HINT,
    )


# --- the ALiBi bias ----------------------------------------------------------


def visible_relative(bias) -> np.ndarray:
    """What attention can see of a bias ``(heads, n, n)``: each row minus its
    diagonal, at or below it.

    Softmax ignores a constant added to a row (chapter 4), and a causal mask
    hides the entries above the diagonal; so two biases that agree here give
    the same attention. A bias ``(heads, 1, n)``, the same row for every query,
    is first broadcast to ``(heads, n, n)``. Above the diagonal the result is
    0. Anything that is not ``(heads, n, n)`` is returned as is.
    """
    b = as_array(bias)
    if b.ndim == 3 and b.shape[-2] == 1 and b.dtype != bool:
        # (heads, 1, n): one row for every query, the form of the original
        # ALiBi code (slope * n)
        b = np.broadcast_to(b, b.shape[:1] + (b.shape[-1], b.shape[-1]))
    if b.ndim != 3 or b.shape[-1] != b.shape[-2] or b.dtype == bool:
        return b
    b = b.astype(np.float64)
    n = b.shape[-1]
    below = np.tril(np.ones((n, n), dtype=bool))
    with np.errstate(invalid="ignore"):
        shifted = b - np.diagonal(b, axis1=-2, axis2=-1)[..., :, None]
    return np.where(below, shifted, 0.0)


def _visible_any_layout(bias) -> np.ndarray:
    """:func:`visible_relative`, also for a bias with the heads last, ``(n, n,
    heads)``: its visible part, still heads last (so its shape stays wrong and
    the checker rejects it), which lets the mistake "heads_last" be named
    whatever the reader put above the diagonal."""
    b = as_array(bias)
    if (
        b.ndim == 3
        and 1 < b.shape[0] == b.shape[1] != b.shape[2]
        and b.dtype != bool
    ):
        return np.moveaxis(visible_relative(np.moveaxis(b, -1, 0)), 0, -1)
    return visible_relative(b)


def _distance(n):
    i = np.arange(n)
    # m - n (query minus key): >= 0 at or below the diagonal
    return i[:, None] - i[None, :]


def _geometric(h):
    return 2.0 ** (-8.0 * np.arange(1, h + 1) / h)


def _code_slopes(h, start=0):
    """The authors' rule, with the extra slopes of 2p heads taken from
    place ``start`` on, every other one (0 is the rule, 1 the slip)."""
    p = 2 ** int(np.floor(np.log2(h)))
    extra = _geometric(2 * p)[start::2][: h - p]
    return np.concatenate([_geometric(p), extra])


def _contiguous_slopes(h):
    """The slip: the first ``h - p`` slopes of ``2p`` heads, contiguous."""
    p = 2 ** int(np.floor(np.log2(h)))
    return np.concatenate([_geometric(p), _geometric(2 * p)[: h - p]])


def _split_slopes(h):
    """The slip: ``p`` the largest power of two *below* ``h`` even when ``h``
    is one (for h = 8: the 4-head slopes, then every other 8-head slope)."""
    if h == 1:
        return _geometric(1)
    p = 2 ** int(np.floor(np.log2(h - 1)))
    return np.concatenate([_geometric(p), _geometric(2 * p)[0::2][: h - p]])


#: Given when no mistake of ALIBI_MISTAKES matches: the chapter has a rule
#: and printed slopes, not a derivation, to compare with.
ALIBI_HINT = (
    "compare your slopes head by head with the rule under "
    "eq-ch6-alibi-slopes and the slopes the chapter printed for h = 8 "
    "(1/2, 1/4, ..., 1/256) and h = 12 (those of 8 heads, then 2**-0.5, "
    "2**-1.5, 2**-2.5, 2**-3.5); and the bias with -lambda_r (m - n) for "
    "query m and key n <= m"
)


ALIBI_MISTAKES = [
    Mistake(
        "sign_error",
        "the bias grows with distance instead of shrinking: distant keys are "
        "favoured",
        "the bias is -slope * (m - n) for a key n at or before the query m: a "
        "penalty, never a reward. "
        "(Using the key's position, -slope * n, is the same mistake up to a "
        "constant per row.)",
        lambda h, n: +alibi_slopes(h)[:, None, None] * _distance(n),
    ),
    Mistake(
        "slopes_reversed",
        "the slopes are in reverse order: the first head (r = 1) has the "
        "smallest slope",
        "heads are numbered r = 1 .. h: head r = 1 gets the steepest slope "
        "2**(-8/h), head r = h the "
        "gentlest 2**(-8)",
        lambda h, n: -alibi_slopes(h)[::-1, None, None] * _distance(n),
    ),
    Mistake(
        "missing_slope",
        "every head has the same bias -(m - n): the per-head slope is missing",
        "multiply each head r's distance matrix by its own slope lambda_r "
        "(the rule under eq-ch6-alibi-slopes: the exercise forbids "
        "attnbook.positional, so compute the slopes yourself)",
        lambda h, n: -np.ones((h, 1, 1)) * _distance(n),
    ),
    Mistake(
        "slopes_start_at_one",
        "the slopes start at 2**0 = 1 (exponents r = 0 .. h-1) instead of "
        "2**(-8/h)",
        "lambda_r = 2**(-8 r / h) for the heads r = 1 .. h: the first slope "
        "is 2**(-8/h), not 1",
        lambda h, n: (
            -(2.0 ** (-8.0 * np.arange(h) / h))[:, None, None] * _distance(n)
        ),
    ),
    Mistake(
        "geometric_for_any_h",
        "the paper's general formula 2**(-8 r / h) was used for a head count "
        "that is not a power of two, where the authors' code (followed by "
        "BLOOM and transformers) uses a different rule",
        "for such h, the authors' code (get_slopes) takes the slopes of the "
        "largest power of two p < h, then every "
        "other slope of 2p: for h = 12, slopes(8) + "
        "slopes(16)[0::2][:4]",
        lambda h, n: -_geometric(h)[:, None, None] * _distance(n),
    ),
    Mistake(
        "interleave_odd",
        "for a head count that is not a power of two, the extra slopes were "
        "taken from the 2p-head sequence at its odd places, [1::2]: they "
        "repeat slopes of the first p heads",
        "the extra heads take every other slope of 2p heads starting with the "
        "first, slopes(2p)[0::2] (exponents -8 r / 2p for r = 1, 3, 5, ...), "
        "the ones that fall between the p-head slopes",
        lambda h, n: -_code_slopes(h, start=1)[:, None, None] * _distance(n),
    ),
    Mistake(
        "extra_contiguous",
        "for a head count that is not a power of two, the extra slopes were "
        "the first h - p slopes of the 2p-head sequence, one after another "
        "([:h - p]); they must be every other one of them, [0::2]",
        "the extra heads take every other slope of 2p heads, starting with "
        "the first: slopes(2p)[0::2][:h - p] (for h = 12: 2**-0.5, 2**-1.5, "
        "2**-2.5, 2**-3.5), which fall between the p-head slopes; the ones "
        "you took next to them repeat p-head slopes",
        lambda h, n: -_contiguous_slopes(h)[:, None, None] * _distance(n),
    ),
    Mistake(
        "split_for_powers_of_two",
        "for a head count that is a power of two, the slopes were built from "
        "a smaller power of two p < h plus every other slope of 2p heads: "
        "the right slopes for h = 8, but in the wrong order",
        "when h is a power of two, p = h (the largest power of two not above "
        "h) and there are no extra slopes: lambda_r = 2**(-8 r / h) for r = "
        "1 .. h, steepest first (1/2, 1/4, ..., 1/256 for h = 8)",
        lambda h, n: -_split_slopes(h)[:, None, None] * _distance(n),
    ),
    Mistake(
        "slopes_sorted",
        "for a head count that is not a power of two, the slopes were sorted "
        "steepest first; the authors' code keeps the p-head slopes first and "
        "appends the extra ones",
        "head r = 1 .. p takes slope r of p heads, in order; heads p + 1 .. h "
        "take the extra slopes of 2p heads after them, unsorted (for h = 12 "
        "the last four are 2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5)",
        lambda h, n: (
            -np.sort(alibi_slopes(h))[::-1, None, None] * _distance(n)
        ),
    ),
    Mistake(
        "heads_last",
        "the head axis is last: the bias has shape (n, n, n_heads), where "
        "the exercise asks for (n_heads, n, n)",
        "put the heads first: head r's (n, n) matrix is bias[r], e.g. "
        "slopes[:, None, None] * distance[None, :, :], or np.moveaxis(bias, "
        "-1, 0) on what you built",
        lambda h, n: np.moveaxis(alibi_bias(h, n), 0, -1),
    ),
    Mistake(
        "constant_rows",
        "the bias does not change along a row (it is zero, or depends on the "
        "query only), "
        "so softmax ignores it",
        "the bias must depend on the key's distance from the query: -slope * "
        "(m - n)",
        lambda h, n: (
            -alibi_slopes(h)[:, None, None]
            * np.arange(n)[None, :, None]
            * np.ones((1, 1, n))
        ),
    ),
]


def check_alibi_bias(fn) -> None:
    """Check ``fn(n_heads, n)`` returns the ALiBi bias ``(n_heads, n, n)`` for
    a causal model.

    Only what attention can see is compared (:func:`visible_relative`): entries
    at or below the diagonal, up to a constant per row. Entries above the
    diagonal (masked) may be anything.
    """
    cases = [
        Case(f"n_heads = {h}, n = {n}", (h, n))
        for h, n in ((8, 6), (4, 5), (12, 5), (3, 4), (1, 3))
    ]
    mistakes = [
        Mistake(
            m.key,
            m.description,
            m.hint,
            lambda h, n, f=m.commit: _visible_any_layout(f(h, n)),
        )
        for m in ALIBI_MISTAKES
    ]
    run_checks(
        "ALiBi bias",
        fn,
        cases,
        lambda h, n: visible_relative(alibi_bias(h, n)),
        mistakes,
        postprocess=_visible_any_layout,
        hint=ALIBI_HINT,
    )
