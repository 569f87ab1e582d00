"""Checker for chapter 6's hard exercise: Shaw et al.'s relative attention
without the ``(N, N, d)`` gather.

Numpy only, so that the browser's exercise notebook can run it; torch's
profiler is used only where the reader's session has imported torch.
"""

from __future__ import annotations


import numpy as np

from ._framework import (
    Case,
    ExerciseError,
    Mistake,
    as_array,
    run_checks,
    same,
)

_rng = np.random.default_rng

EXERCISE = "relative attention (Shaw et al.)"


def _softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _rows(n: int, max_distance: int, offset=None) -> np.ndarray:
    """(n, n) int: the table row of (query m, key n); by default
    ``clip(n - m, -kappa, kappa) + kappa``."""
    if offset is None:
        offset = _offsets(n)
    return np.clip(offset, -max_distance, max_distance) + max_distance


def _shaw(q, k, v, rel_k, rel_v, rows=None, scale_relative=True, rows_v=None):
    """The direct form, float64: gathers the ``(N, N, d)`` tables (the
    checker's reference, and its mistakes' base); ``rows_v``, when given,
    indexes the value table instead of ``rows``."""
    q, k, v, rel_k, rel_v = (
        np.asarray(x, dtype=np.float64) for x in (q, k, v, rel_k, rel_v)
    )
    n, d_k = q.shape[-2:]
    max_distance = (rel_k.shape[0] - 1) // 2
    if rows is None:
        rows = _rows(n, max_distance)
    # (N, N, d_k) and (N, N, d_v)
    a_k, a_v = rel_k[rows], rel_v[rows if rows_v is None else rows_v]
    content = q @ np.swapaxes(k, -1, -2)
    relative = np.einsum("...id,ijd->...ij", q, a_k)
    if scale_relative:
        scores = (content + relative) / np.sqrt(d_k)
    else:
        scores = content / np.sqrt(d_k) + relative
    w = _softmax(scores)
    return w @ v + np.einsum("...ij,ijd->...id", w, a_v)


def shaw_attention(q, k, v, rel_k, rel_v):
    """The reference: ``softmax((q k^T + q . a^K_{c(n-m)}) / sqrt(d_k))`` times
    ``v + a^V_{c(n-m)}``, with ``c`` the offset ``n - m`` clipped to ``[-kappa,
    kappa]`` (``rel_k`` has ``2 kappa + 1`` rows, row ``r`` for offset ``r -
    kappa``)."""
    return _shaw(q, k, v, rel_k, rel_v)


def _with_rows(make_rows, tables="both"):
    """A mistake that indexes the tables with ``make_rows(N, K)``: both, or
    only the ``"keys"``' or the ``"values"``' (the other one rightly)."""

    def attention(q, k, v, rel_k, rel_v):
        n = np.shape(q)[-2]
        max_distance = (np.shape(rel_k)[0] - 1) // 2
        wrong, right = make_rows(n, max_distance), _rows(n, max_distance)
        rows, rows_v = {
            "both": (wrong, wrong),
            "keys": (wrong, right),
            "values": (right, wrong),
        }[tables]
        return _shaw(q, k, v, rel_k, rel_v, rows=rows, rows_v=rows_v)

    return attention


def _unshifted(keys: str, values: str):
    """The tables read at ``clip(n - m, -kappa, kappa)``, without ``+ kappa``;
    a negative row either wraps to the end of the table (``"wrap"``) or reads
    nothing (``"drop"``), for the keys and the values separately."""

    def attention(q, k, v, rel_k, rel_v):
        n = np.shape(q)[-2]
        rel_k, rel_v = (
            np.asarray(x, dtype=np.float64) for x in (rel_k, rel_v)
        )
        m = (rel_k.shape[0] - 1) // 2
        rows = np.clip(_offsets(n), -m, m)
        wrapped = rows % (2 * m + 1)

        def read(table, how):
            out = table[wrapped]
            return (
                out
                if how == "wrap"
                else np.where(rows[..., None] < 0, 0.0, out)
            )

        q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
        scores = q @ np.swapaxes(k, -1, -2)
        scores = scores + np.einsum("...id,ijd->...ij", q, read(rel_k, keys))
        w = _softmax(scores / np.sqrt(q.shape[-1]))
        return w @ v + np.einsum("...ij,ijd->...id", w, read(rel_v, values))

    return attention


def _unclipped_dropped(low: bool, high: bool):
    """The offsets clipped only where ``low`` / ``high`` say (below at
    -kappa, above at +kappa), plus kappa, and the tables read by matching rows
    with 0 .. 2 kappa (a one-hot, say): a key whose row falls outside the
    table matches none and gets no relative vector at all."""

    def attention(q, k, v, rel_k, rel_v):
        n = np.shape(q)[-2]
        rel_k, rel_v = (
            np.asarray(x, dtype=np.float64) for x in (rel_k, rel_v)
        )
        m = (rel_k.shape[0] - 1) // 2
        rows = _offsets(n)
        # np.clip with both bounds None raises in numpy 1.x
        rows = np.maximum(rows, -m) if low else rows
        rows = (np.minimum(rows, m) if high else rows) + m
        outside = (rows < 0) | (rows > 2 * m)

        def read(table):
            inside = table[np.clip(rows, 0, 2 * m)]
            return np.where(outside[..., None], 0.0, inside)

        q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
        scores = q @ np.swapaxes(k, -1, -2)
        scores = scores + np.einsum("...id,ijd->...ij", q, read(rel_k))
        w = _softmax(scores / np.sqrt(q.shape[-1]))
        return w @ v + np.einsum("...ij,ijd->...id", w, read(rel_v))

    return attention


def _offsets(n):
    i = np.arange(n)
    # n - m: key position minus query position
    return i[None, :] - i[:, None]


def _is_out_of_bounds(err: Exception) -> bool:
    return isinstance(err, IndexError) and "out of bounds" in str(err)


SHAW_MISTAKES = [
    Mistake(
        "offset_reversed",
        "the tables were indexed by m - n (query minus key) instead of n - m: "
        "a key before the query reads the vector of the key as far after it",
        "row r of the tables holds the offset r - kappa of the key from the "
        "query, n - m; a key 2 back is row kappa - 2",
        _with_rows(lambda n, m: _rows(n, m, offset=-_offsets(n))),
    ),
    # the same slip made for one table only (student report stud06)
    Mistake(
        "offset_reversed_keys",
        "the key table was indexed by m - n (query minus key) instead of n - "
        "m; the value table rightly by n - m",
        "both tables are read at the same row, clip(n - m, -kappa, kappa) + "
        "kappa for query m and key n: a key 2 back is row kappa - 2 in "
        "rel_k as in rel_v",
        _with_rows(
            lambda n, m: _rows(n, m, offset=-_offsets(n)), tables="keys"
        ),
    ),
    Mistake(
        "offset_reversed_values",
        "the value table was indexed by m - n (query minus key) instead of n "
        "- m; the key table rightly by n - m",
        "both tables are read at the same row, clip(n - m, -kappa, kappa) + "
        "kappa for query m and key n: when you group the weights by table "
        "row for rel_v, use the rows you used for rel_k",
        _with_rows(
            lambda n, m: _rows(n, m, offset=-_offsets(n)), tables="values"
        ),
    ),
    Mistake(
        "offsets_not_clipped",
        "the offsets were not clipped to [-kappa, kappa] on both sides: numpy "
        "reads a "
        "negative row index from the end of the table (or raises for one past "
        "it), so the keys more than kappa away read wrong vectors",
        "clip first, then shift: np.clip(n - m, -kappa, kappa) + kappa; every "
        "key more "
        "than kappa away shares the vector of offset -kappa or +kappa",
        _with_rows(lambda n, m: np.minimum(_offsets(n), m) + m),
        raises=_is_out_of_bounds,
    ),
    *(
        Mistake(
            "offsets_not_clipped",
            "the offsets were not clipped to [-kappa, kappa] on both sides: "
            "the "
            "keys more than kappa away on an unclipped side have a row "
            "outside "
            "the table, which your reading of the tables matches to no row, "
            "so "
            "they get no relative vector instead of the one of offset -kappa "
            "or "
            "+kappa",
            "clip first, then shift: np.clip(n - m, -kappa, kappa) + kappa; "
            "every "
            "key more than kappa away shares the vector of offset -kappa or "
            "+kappa",
            _unclipped_dropped(low, high),
        )
        for low, high in ((False, True), (True, False), (False, False))
    ),
    # the same slip in the three ways of reading the tables: by index (a
    # negative row wraps to the end), by comparing rows with 0..2K (a
    # negative row matches none), or one of each for keys and values
    *(
        Mistake(
            "index_not_shifted",
            "the clipped offset was used as the row without adding kappa: "
            "offset "
            "0 reads the row of offset -kappa, and the keys before the query "
            "read "
            "the last rows of the table (numpy's negative indices) or none",
            "row = clip(n - m, -kappa, kappa) + kappa, so that offset -kappa "
            "is row 0 and "
            "offset 0 the middle row kappa",
            _unshifted(keys, values),
        )
        for keys, values in (
            ("wrap", "wrap"),
            ("wrap", "drop"),
            ("drop", "drop"),
        )
    ),
    Mistake(
        "no_relative_values",
        "the relative value vectors a^V were left out: the output is the "
        "weighted average of v alone",
        "Shaw et al. add a^V_{c(n-m)} to each value: the output of query m "
        "gains sum_n alpha_mn a^V_{c(n-m)}, which needs only each query's "
        "weights summed per table row",
        lambda q, k, v, rel_k, rel_v: _shaw(
            q, k, v, rel_k, np.zeros_like(np.asarray(rel_v, dtype=float))
        ),
    ),
    Mistake(
        "no_relative_keys",
        "the relative key vectors a^K were left out of the scores",
        "the score of (query m, key n) is q_m . (k_n + a^K_{c(n-m)}), all "
        "over sqrt(d_k)",
        lambda q, k, v, rel_k, rel_v: _shaw(
            q, k, v, np.zeros_like(np.asarray(rel_k, dtype=float)), rel_v
        ),
    ),
    Mistake(
        "relative_scores_unscaled",
        "only the content scores q_m . k_n were divided by sqrt(d_k); the "
        "relative term q_m . a^K was added unscaled",
        "a^K is added to the key before the dot product, so the whole score "
        "q_m . (k_n + a^K) is divided by sqrt(d_k)",
        lambda q, k, v, rel_k, rel_v: _shaw(
            q, k, v, rel_k, rel_v, scale_relative=False
        ),
    ),
]

#: Named when the values are right but the peak memory is that of an
#: ``(N, N, d)`` array: the direct gather.
SHAW_MEMORY_MISTAKES = [
    Mistake(
        "pairwise_tables",
        "the values are right, but the peak memory was that of an (N, N, d) "
        "array: the tables were gathered for every (query, key) pair",
        "the tables have only 2 kappa + 1 rows: compute q @ rel_k.T once, (N, "
        "2 kappa + 1), and pick entry [m, row(m, n)] for each pair (query m, "
        "key n); for the values, add up each query's weights per table row, "
        "(N, 2 kappa + 1), and multiply by rel_v",
        shaw_attention,
    ),
]


#: Given when no mistake of SHAW_MISTAKES matches: the formula's parts, one
#: by one.
SHAW_HINT = (
    "check each part of eq-ch6-shaw and the exercise's formula for z_m in "
    "turn: the row of (query m, key n) is clip(n - m, -kappa, kappa) + "
    "kappa, the same for rel_k and rel_v; the relative term q_m . "
    "a^K_{c(n-m)} is inside the division by sqrt(d_k); the softmax is over "
    "the keys n; and the output of query m adds sum_n alpha_mn "
    "a^V_{c(n-m)} to sum_n alpha_mn v_n"
)


def shaw_cases() -> list[Case]:
    """Clipping on both sides, a batch of heads, d_v != d_k, a table larger
    than the sequence, a single token, K = 1, float32 inputs."""

    def make(shape, n, d_k, d_v, max_distance, seed, dtype=np.float64):
        rng = _rng(seed)
        q, k = (rng.normal(size=(*shape, n, d_k)) for _ in range(2))
        v = rng.normal(size=(*shape, n, d_v))
        rows = 2 * max_distance + 1
        rel_k = rng.normal(size=(rows, d_k))
        rel_v = rng.normal(size=(rows, d_v))
        return tuple(x.astype(dtype) for x in (q, k, v, rel_k, rel_v))

    return [
        Case(
            "N = 12, kappa = 3 (offsets clipped on both sides), d_k = 8, "
            "d_v = 5",
            make((), 12, 8, 5, 3, 0),
        ),
        Case(
            "batched q, k, v (2, 3, N = 10, d_k = 4), kappa = 2",
            make((2, 3), 10, 4, 4, 2, 1),
        ),
        Case(
            "kappa = 6 larger than the sequence (N = 5): nothing is clipped",
            make((), 5, 6, 3, 6, 2),
        ),
        Case("a single token (N = 1), kappa = 2", make((), 1, 4, 4, 2, 3)),
        Case(
            "kappa = 1: three rows, most keys share the first or the last "
            "(N = 7)",
            make((), 7, 4, 3, 1, 4),
        ),
        Case(
            "float32 inputs, N = 9, kappa = 2",
            make((1,), 9, 8, 8, 2, 5, dtype=np.float32),
        ),
    ]


def _compare(got, expected) -> bool:
    # float32 inputs may be computed in float32 throughout
    return same(got, expected, rtol=1e-4, atol=1e-5)


def check_shaw_attention(fn) -> None:
    """Check ``fn(q, k, v, rel_k, rel_v)``: Shaw et al.'s self-attention with
    relative key and value vectors, without forming an ``(N, N, d)`` array.

    q, k: ``(..., N, d_k)``, v: ``(..., N, d_v)``, rel_k: ``(2 kappa + 1,
    d_k)``, rel_v: ``(2 kappa + 1, d_v)`` (row ``r`` for the offset ``r -
    kappa`` of the key from the query, offsets clipped to ``[-kappa,
    kappa]``); no mask; returns ``(..., N, d_v)``. Besides the values on the
    cases, the checker measures the peak memory (:mod:`tracemalloc`, which
    sees numpy's arrays, and, where torch is imported, the largest allocation
    torch's profiler sees) at N = 256, d_k = d_v = 128, kappa = 4: an answer
    that gathers the tables for every pair (an (N, N, d) array, 64 MiB) is
    rejected; the answer the exercise asks for needs a few (N, N) arrays.
    """
    __tracebackhide__ = True
    cases = shaw_cases()
    run_checks(
        EXERCISE,
        fn,
        cases,
        shaw_attention,
        SHAW_MISTAKES,
        compare=_compare,
        hint=SHAW_HINT,
        # the line saying it is correct waits for the memory check
        quiet=True,
    )
    _check_shaw_memory(fn)
    print(
        f"Correct: {EXERCISE} passes all {len(cases)} cases, and on N = 256, "
        "d = 128 its peak memory stayed below a quarter of an (N, N, d) "
        "array."
    )


def _check_shaw_memory(
    fn, n: int = 256, d: int = 128, max_distance: int = 4
) -> None:
    """Reject an answer whose peak memory is a quarter of an (N, N, d) float64
    array or more."""
    from ..bench import format_bytes
    from ._framework import peak_memory_with_torch

    __tracebackhide__ = True
    rng = _rng(17)
    q, k, v = (rng.normal(size=(n, d)) for _ in range(3))
    rel_k, rel_v = (
        rng.normal(size=(2 * max_distance + 1, d)) for _ in range(2)
    )
    case = f"N = {n}, d_k = d_v = {d}, kappa = {max_distance} (memory)"
    # before the reader's function, which may change its inputs in place
    expected = shaw_attention(q, k, v, rel_k, rel_v)
    # numpy's arrays, and torch's allocations (which tracemalloc does not
    # see) whatever the answer returns
    out, peak = peak_memory_with_torch(fn, q, k, v, rel_k, rel_v)
    if not _compare(as_array(out), expected):
        raise ExerciseError(
            EXERCISE, case, "values differ from the reference on this case"
        )
    table = n * n * d * 8
    if peak >= table // 4:
        raise ExerciseError(
            EXERCISE,
            case,
            "your function's peak memory (numpy's arrays, or torch's "
            f"largest allocation) was {format_bytes(peak)}; one "
            f"(N, N, d) float64 array is {format_bytes(table)}",
            mistake=SHAW_MEMORY_MISTAKES[0],
        )
