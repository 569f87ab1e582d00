"""Checkers for attention across devices (chapter 11): the zigzag layout's
positions, and the fewest tokens per device for which a ring step hides its
transfer.

The zigzag map's mistakes: the mirror chunk taken as ``P - 1 - r`` instead of
``2P - 1 - r`` (half the sequence, some of it twice), the second chunk not
mirrored (``P + r``), the ranks numbered from the other end, the plain
contiguous and striped layouts, the remainder of ``n`` dropped when ``2P`` does
not divide it (or all of it put in the last chunk), chunks of ``ceil(n / 2P)``
tokens (the last ones short or empty) instead of :func:`numpy.array_split`'s,
positions returned as floats (they index), positions in 8-bit integers that
wrap around from 256 tokens on, and a rank with no token given an empty float
array (``np.array([])``). The order of the positions inside a rank
is free: ring attention masks by global positions, not by order.

The overlap condition's mistakes are of units: a link's bits per second read as
bytes, the keys sent without the values (or the reverse), the flops
``4 m^2 h d`` counted at half or a quarter (one product of two, a multiply-add
counted as one flop, the compute halved as for a causal mask: each is a factor
of 2, so the checker names them together), a figure for both directions used
as one direction's (or the direction flag read the wrong way round), the
same number of heads for the compute and the transfer (the key/value heads
counted as query heads, or the compute counted on the key/value heads: GQA's
saving lost either way), elements counted
instead of bytes, and the threshold rounded to whole tokens (up, to the
nearest or down). The answer is
compared to a relative 1e-5, so that float32 arithmetic passes; an exact
:class:`fractions.Fraction` passes too. A nan or inf returned is explained (a
division by zero), not diagnosed.

Numpy only (no torch needed); a reader may answer with torch, and a tensor
returned is compared as an array.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from ..distributed.layouts import positions_numpy
from ._framework import Case, Mistake, as_array, run_checks

# --- the zigzag map ----------------------------------------------------------


def _reference_zigzag(n, world_size):
    return positions_numpy(n, world_size, "zigzag")


def _chunks(n, world_size):
    return np.array_split(np.arange(n, dtype=np.int64), 2 * world_size)


def _mirror_off_by_p(n, world_size):
    c = _chunks(n, world_size)
    return [
        np.concatenate([c[r], c[world_size - 1 - r]])
        for r in range(world_size)
    ]


def _not_mirrored(n, world_size):
    c = _chunks(n, world_size)
    return [
        np.concatenate([c[r], c[world_size + r]]) for r in range(world_size)
    ]


def _ranks_reversed(n, world_size):
    return _reference_zigzag(n, world_size)[::-1]


def _contiguous(n, world_size):
    return np.array_split(np.arange(n, dtype=np.int64), world_size)


def _striped(n, world_size):
    t = np.arange(n, dtype=np.int64)
    return [t[r::world_size] for r in range(world_size)]


def _remainder_dropped(n, world_size):
    q = n // (2 * world_size)
    c = [np.arange(j * q, (j + 1) * q) for j in range(2 * world_size)]
    return [
        np.concatenate([c[r], c[2 * world_size - 1 - r]])
        for r in range(world_size)
    ]


def _remainder_in_last(n, world_size):
    size = n // (2 * world_size)
    c = [
        np.arange(j * size, (j + 1) * size) for j in range(2 * world_size - 1)
    ]
    c.append(np.arange((2 * world_size - 1) * size, n))
    return [
        np.concatenate([c[r], c[2 * world_size - 1 - r]])
        for r in range(world_size)
    ]


def _ceil_chunks(n, world_size):
    size = -(-n // (2 * world_size))
    c = [
        np.arange(min(j * size, n), min((j + 1) * size, n))
        for j in range(2 * world_size)
    ]
    return [
        np.concatenate([c[r], c[2 * world_size - 1 - r]])
        for r in range(world_size)
    ]


def _float_positions(n, world_size):
    return [p.astype(np.float64) for p in _reference_zigzag(n, world_size)]


def _empty_float(n, world_size):
    return [
        p if len(p) else np.array([]) for p in _reference_zigzag(n, world_size)
    ]


def _narrow_integers(n, world_size):
    return [p.astype(np.uint8) for p in _reference_zigzag(n, world_size)]


def _parts(value):
    """The reader's ranks as a list of numpy arrays, or None when ``value`` is
    not a list, tuple or 2-D array of them. An empty list or tuple is an
    empty int64 array (it indexes)."""
    if isinstance(value, (list, tuple)):
        out = []
        for part in value:
            if isinstance(part, (list, tuple)) and len(part) == 0:
                out.append(np.zeros(0, dtype=np.int64))
                continue
            try:
                out.append(as_array(part))
            except Exception:
                return None
        return out
    try:
        a = as_array(value)
    except Exception:
        return None
    return list(a) if a.ndim == 2 else None


def _same_positions(got, expected) -> bool:
    """The same number of ranks, each 1-D and holding the same set of
    positions (in any order, none twice); integers where the expected are
    integers."""
    got, expected = _parts(got), _parts(expected)
    if got is None or expected is None or len(got) != len(expected):
        return False
    for g, e in zip(got, expected):
        if g.ndim != 1 or e.ndim != 1:
            return False
        if (g.dtype.kind in "iu") != (e.dtype.kind in "iu"):
            return False
        if not np.array_equal(np.sort(g), np.sort(e)):
            return False
    return True


def _brief(a: np.ndarray, limit: int = 12) -> str:
    a = np.sort(a)
    text = ", ".join(str(int(x)) for x in a[:limit])
    return "[" + text + (", ...]" if len(a) > limit else "]")


def _describe_positions(got, expected, case) -> str:
    if got is None:
        return "your function returned None (a missing `return`?)"
    parts, want = _parts(got), _parts(expected)
    if parts is None:
        return (
            f"expected a list of {len(want)} arrays of positions, one per "
            f"rank; got {type(got).__name__}"
        )
    if len(parts) != len(want):
        return f"expected {len(want)} ranks, got {len(parts)}"
    for r, g in enumerate(parts):
        if g.ndim != 1:
            return f"rank {r}'s positions have shape {g.shape}, not 1-D"
        if g.dtype.kind not in "iu":
            return (
                f"rank {r}'s positions are {g.dtype}, not integers: they "
                "index the sequence"
            )
    n = case.args[0]
    for r, g in enumerate(parts):
        if n > 0 and n - 1 > np.iinfo(g.dtype).max:
            return (
                f"rank {r}'s positions are {g.dtype}, which holds at most "
                f"{np.iinfo(g.dtype).max}: positions up to {n - 1} wrap around"
            )
    every = np.concatenate(parts).astype(np.int64)
    counts = np.bincount(every[(every >= 0) & (every < n)], minlength=n)
    # on how many ranks each position is (a rank that lists one twice counts
    # once here)
    ranks_holding = sum(
        np.bincount(
            np.unique(g[(g >= 0) & (g < n)]).astype(np.int64), minlength=n
        )
        for g in parts
    )
    notes = []
    missing = np.flatnonzero(counts == 0)
    across = np.flatnonzero(ranks_holding > 1)
    within = [
        (
            r,
            np.flatnonzero(
                np.bincount(g[(g >= 0) & (g < n)], minlength=n) > 1
            ),
        )
        for r, g in enumerate(p.astype(np.int64) for p in parts)
    ]
    within = [(r, w) for r, w in within if len(w)]
    outside = every[(every < 0) | (every >= n)]
    if len(missing):
        notes.append(f"positions {_brief(missing)} are on no rank")
    if len(across):
        notes.append(f"positions {_brief(across)} are on more than one rank")
    if within:
        r, w = within[0]
        notes.append(f"rank {r} lists positions {_brief(w)} twice")
    if len(outside):
        notes.append(f"positions {_brief(outside)} are outside range({n})")
    for r, (g, e) in enumerate(zip(parts, want)):
        if not np.array_equal(np.sort(g), np.sort(e)):
            notes.append(
                f"rank {r} holds {_brief(g)}; it should hold {_brief(e)}"
            )
            break
    return "; ".join(notes)


ZIGZAG_MISTAKES = [
    Mistake(
        "mirror_off_by_p",
        "rank r takes chunks r and P - 1 - r: the mirror of chunk r among 2P "
        "chunks is 2P - 1 - r, so the second half of the sequence is on no "
        "rank and some chunks are on two",
        "with 2P chunks numbered 0 .. 2P - 1, chunk r's mirror is 2P - 1 - r",
        _mirror_off_by_p,
    ),
    Mistake(
        "not_mirrored",
        "rank r takes chunks r and P + r: every rank gets an early and a late "
        "chunk, but the late ones are in the same order as the early ones, so "
        "the last rank still does the most work",
        "pair chunk r with its mirror image, 2P - 1 - r: the first with the "
        "last, the second with the second-to-last",
        _not_mirrored,
    ),
    Mistake(
        "ranks_reversed",
        "the ranks are numbered from the other end: rank 0 holds the middle "
        "chunks",
        "rank r holds chunk r (from the start) and chunk 2P - 1 - r",
        _ranks_reversed,
    ),
    Mistake(
        "contiguous",
        "this is the contiguous layout: P consecutive blocks",
        "cut the sequence into 2P chunks, not P, and give each rank two",
        _contiguous,
    ),
    Mistake(
        "striped",
        "this is the striped layout: token t on rank t mod P",
        "zigzag keeps chunks whole: rank r holds chunks r and 2P - 1 - r",
        _striped,
    ),
    Mistake(
        "remainder_dropped",
        "the chunks have n // 2P tokens each, so the last n mod 2P tokens are "
        "on no rank",
        "cut with np.array_split(np.arange(n), 2 * P): the first n mod 2P "
        "chunks get one token more",
        _remainder_dropped,
    ),
    Mistake(
        "remainder_in_last",
        "the chunks have n // 2P tokens each and the last chunk takes the "
        "remaining n mod 2P as well, so rank 0, which holds the last chunk, "
        "gets up to 2P - 1 tokens more than the others",
        "spread the remainder one token at a time: the first n mod 2P chunks "
        "get one token more (np.array_split's sizes)",
        _remainder_in_last,
    ),
    Mistake(
        "ceil_chunks",
        "the chunks have ceil(n / 2P) tokens, so the last chunks are short "
        "or empty, not the sizes the exercise asks for",
        "cut with np.array_split(np.arange(n), 2 * P): sizes differ by at "
        "most one, the longer ones first",
        _ceil_chunks,
    ),
    Mistake(
        "float_positions",
        "the positions are floats: they index the sequence, so they must be "
        "integers",
        "build them from np.arange (or torch.arange), or cast with "
        ".astype(np.int64)",
        _float_positions,
    ),
    Mistake(
        "empty_not_integer",
        "a rank with no token gets an empty float array (np.array([]) is "
        "float64), which cannot index",
        "build every rank's positions from np.arange, or give np.array([], "
        "dtype=np.int64)",
        _empty_float,
    ),
    Mistake(
        "narrow_integers",
        "the positions are 8-bit integers (uint8), which hold at most 255: "
        "from 256 tokens on the positions wrap around (the chapter's "
        "sequence has 4096)",
        "keep np.arange's int64 (or torch.arange's), or cast with "
        ".astype(np.int64)",
        _narrow_integers,
    ),
]


def zigzag_cases() -> list[Case]:
    return [
        Case("16 tokens on 2 ranks (chunks of 4)", (16, 2)),
        Case("4096 tokens on 8 ranks (chunks of 256)", (4096, 8)),
        Case("10 tokens on 3 ranks (chunks of 2, 2, 2, 2, 1, 1)", (10, 3)),
        Case("13 tokens on 2 ranks (chunks of 4, 3, 3, 3)", (13, 2)),
        Case("22 tokens on 3 ranks (chunks of 4, 4, 4, 4, 3, 3)", (22, 3)),
        Case("7 tokens on 4 ranks (seven chunks of 1, one empty)", (7, 4)),
        Case("3 tokens on 4 ranks (the last rank holds none)", (3, 4)),
        Case("5 tokens on 1 rank", (5, 1)),
    ]


def check_zigzag_positions(fn) -> None:
    """Check ``fn(n, world_size)`` returns the zigzag layout: a list of
    ``world_size`` integer arrays (numpy or torch, any integer dtype), where
    rank ``r`` holds the positions of chunks ``r`` and ``2 world_size - 1 -
    r`` of ``np.array_split(np.arange(n), 2 * world_size)``. The order inside
    a rank is free."""
    run_checks(
        "the zigzag layout",
        fn,
        zigzag_cases(),
        _reference_zigzag,
        ZIGZAG_MISTAKES,
        compare=_same_positions,
        describe=_describe_positions,
        hint="list each rank's chunks by hand for a small case (8 tokens on "
        "2 ranks: [0, 1, 6, 7] and [2, 3, 4, 5]) and compare",
    )


# --- the overlap condition ---------------------------------------------------


def _tokens(
    peak_flops,
    link_bits_per_s,
    both_directions,
    n_heads,
    n_kv_heads,
    d_head,
    bytes_per_element,
    *,
    bits=8,
    tensors=2,
    flop_factor=4,
    halve=True,
    kv_count=None,
    element_bytes=None,
):
    """The threshold ``m`` at which ``flop_factor m^2 h d / F = tensors m
    h_kv d e / W``, computed exactly; the keywords commit the mistakes."""
    bandwidth = Fraction(link_bits_per_s) / bits
    if both_directions and halve:
        bandwidth /= 2
    kv = n_kv_heads if kv_count is None else kv_count
    size = bytes_per_element if element_bytes is None else element_bytes
    m = (
        Fraction(peak_flops)
        * tensors
        * kv
        * d_head
        * size
        / (flop_factor * n_heads * d_head * bandwidth)
    )
    return float(m)


def _reference_overlap(*args):
    return _tokens(*args)


def _plain(got):
    """An exact Fraction as the float it rounds to; anything else as it is."""
    return float(got) if isinstance(got, Fraction) else got


def _same_number(got, expected) -> bool:
    """One number, equal to a relative 1e-5: float32 arithmetic passes, and
    every listed mistake, a factor of 1.07 or more, fails."""
    got = _plain(got)
    try:
        g, e = as_array(got), as_array(expected)
    except Exception:
        return False
    if g.size != 1 or g.dtype.kind not in "iuf":
        return False
    g, e = float(g.reshape(())), float(e.reshape(()))
    return abs(g - e) <= 1e-5 * abs(e)


_NON_FINITE = {
    False: "a division by zero; a factor that should be small but positive "
    "came out 0 (an integer division, //, rounds 4 h d / F down to 0); "
    "compute each time with / and print it",
    True: "not a number, from 0 / 0, inf / inf or 0 times inf; a factor "
    "came out 0 or inf (an integer division, //, rounds 4 h d / F down to "
    "0); compute each time with / and print it",
}


def _describe_number(got, expected, case) -> str:
    if got is None:
        return "your function returned None (a missing `return`?)"
    got = _plain(got)
    try:
        g = as_array(got)
    except Exception:
        return f"expected one number, got {type(got).__name__}"
    if g.size != 1 or g.dtype.kind not in "iuf":
        return (
            f"expected one number (a float), got an array of shape {g.shape} "
            f"and dtype {g.dtype}"
        )
    g, e = float(g.reshape(())), float(as_array(expected).reshape(()))
    if not math.isfinite(g):
        return (
            f"expected {e:.10g} tokens per device, got {g}: "
            + _NON_FINITE[math.isnan(g)]
        )
    text = f"expected {e:.10g} tokens per device, got {g:.10g} ({g / e:.6g}x)"
    if g == round(g) and g in (math.floor(e), math.ceil(e), round(e)):
        text += (
            ": rounded to a whole number; return the threshold itself, a "
            "float, unrounded"
        )
    return text


OVERLAP_MISTAKES = [
    Mistake(
        "bits_as_bytes",
        "the link's bits per second are used as bytes per second: the "
        "link is 8 times too fast",
        "a network's rate is in bits (400 Gb/s); divide by 8 for bytes",
        lambda *a: _tokens(*a, bits=1),
    ),
    Mistake(
        "k_or_v_only",
        "half the bytes or twice the flops: only one of the keys and the "
        "values is sent (a ring step sends both, 2 m h_kv d e bytes), or "
        "the block's flops are counted twice (8 m^2 h d, not 4 m^2 h d); "
        "each gives this number",
        "count k AND v, two tensors of m x h_kv x d elements, and the "
        "flops once, 4 m^2 h d",
        lambda *a: _tokens(*a, tensors=1),
    ),
    Mistake(
        "quarter_the_flops",
        "the block's flops are counted as m^2 h d, a quarter of 4 m^2 h d: "
        "two factors of 2 are missing, from among one product only (q k^T "
        "without the weights times v), a multiply-add counted as one flop, "
        "and the compute halved as for a causal mask",
        "q k^T is m^2 d multiply-adds per head, 2 flops each, and the "
        "weights times v as many again: 4 m^2 h d flops, all of them, since "
        "this step has no mask",
        lambda *a: _tokens(*a, flop_factor=1),
    ),
    Mistake(
        "half_the_flops",
        "the block's flops are counted as 2 m^2 h d, half of 4 m^2 h d: one "
        "product only (q k^T without the weights times v), a multiply-add "
        "counted as one flop, or the compute halved as for a causal mask; "
        "each gives this number",
        "q k^T is m^2 d multiply-adds per head, 2 flops each, and the "
        "weights times v as many again: 4 m^2 h d flops, all of them, since "
        "this step has no mask",
        lambda *a: _tokens(*a, flop_factor=2),
    ),
    Mistake(
        "total_as_one_way",
        "a bandwidth for both directions together is used for one: the ring "
        "sends one way on each link",
        "when both_directions is True, halve the figure (NVLink's 900 GB/s "
        "is 450 GB/s each way)",
        lambda *a: _tokens(*a, halve=False),
    ),
    Mistake(
        "direction_inverted",
        "the both_directions flag is read the wrong way round: a figure for "
        "both directions is used whole, and a one-way figure is halved",
        "halve the link's figure only when both_directions is True (NVLink's "
        "900 GB/s is 450 GB/s each way); a one-way figure, such as an "
        "InfiniBand port's 400 Gb/s, is already what the ring uses",
        lambda *a: _tokens(a[0], a[1], not a[2], *a[3:]),
    ),
    Mistake(
        "same_heads_both_sides",
        "the compute and the transfer are counted with the same number of "
        "heads: either the keys and values sent with the query heads h, or "
        "the compute with the key/value heads h_kv (both give this number); "
        "either way grouped-query attention's factor h_kv / h is lost",
        "the block sent has n_kv_heads heads of k and v; the compute has "
        "n_heads, since every query head attends",
        lambda *a: _tokens(*a, kv_count=a[3]),
    ),
    Mistake(
        "elements_not_bytes",
        "the block is counted in elements, not bytes: bytes_per_element is "
        "left out",
        "bytes sent = 2 m h_kv d x bytes_per_element",
        lambda *a: _tokens(*a, element_bytes=1),
    ),
    Mistake(
        "rounded_up",
        "the threshold is rounded to whole tokens (up, as math.ceil does, "
        "or to the nearest, as round() does, which gives the same number "
        "here): the exercise asks for the threshold itself",
        "return the float m at which compute and transfer take equally long, "
        "unrounded (the package's cost.overlap_tokens rounds up because it "
        "counts whole tokens)",
        lambda *a: math.ceil(_tokens(*a)),
    ),
    Mistake(
        "rounded_down",
        "the threshold is rounded down to whole tokens (as int() or "
        "math.floor does): the exercise asks for the threshold itself, and "
        "below it the transfer is no longer hidden",
        "return the float m at which compute and transfer take equally long, "
        "unrounded (whole tokens would be rounded up, as the package's "
        "cost.overlap_tokens does, never down)",
        lambda *a: math.floor(_tokens(*a)),
    ),
]


def overlap_cases() -> list[Case]:
    return [
        Case(
            "H100 (989.4 TFLOP/s), InfiniBand NDR (400 Gb/s each way); 32 "
            "heads, 4 kv heads of 128, bf16",
            (989.4e12, 400e9, False, 32, 4, 128, 2),
        ),
        Case(
            "H100, NVLink 4 (900 GB/s = 7.2 Tb/s both ways); 32 heads, 8 kv "
            "heads of 128, bf16",
            (989.4e12, 7.2e12, True, 32, 8, 128, 2),
        ),
        Case(
            "A100 (312 TFLOP/s, dense FP16), InfiniBand HDR (200 Gb/s each "
            "way); 28 heads, 4 kv heads of 64, fp16",
            (312e12, 200e9, False, 28, 4, 64, 2),
        ),
        Case(
            "A100 (156 TFLOP/s, dense TF32), NVLink 3 (600 GB/s = 4.8 Tb/s "
            "both ways); 48 heads, 8 kv heads of 128, fp32",
            (156e12, 4.8e12, True, 48, 8, 128, 4),
        ),
        Case(
            "a chip of 100 TFLOP/s, a 100 Gb/s link each way; 14 heads, 2 kv "
            "heads of 32, fp8",
            (100e12, 100e9, False, 14, 2, 32, 1),
        ),
    ]


def check_overlap_tokens(fn) -> None:
    """Check ``fn(peak_flops, link_bits_per_s, both_directions, n_heads,
    n_kv_heads, d_head, bytes_per_element)`` returns the threshold ``m`` (a
    float) of tokens per device at which one forward ring step's compute, a
    block of ``m`` queries against ``m`` keys of every head at ``peak_flops``
    flop/s (non-causal), takes as long as sending one key-value block of
    ``m`` tokens one way over the link. ``link_bits_per_s`` is in bits per
    second; ``both_directions`` says whether that figure counts both
    directions together."""
    run_checks(
        "the overlap condition",
        fn,
        overlap_cases(),
        _reference_overlap,
        OVERLAP_MISTAKES,
        compare=_same_number,
        describe=_describe_number,
        hint="write both times with units: compute 4 m^2 h d flops / "
        "(flop/s); transfer 2 m h_kv d e bytes / (bytes/s); set them equal "
        "and solve for m",
    )
