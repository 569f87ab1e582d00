"""Checkers for serving (chapter 15): the slots of a sequence in a paged
cache, and one decoding step of attention through a block table whose last
block is part-filled. A table may hold spare entries beyond the
``ceil(length / block_size)`` blocks the sequence uses (engines pad their
tables, and the package's ``check_table`` accepts a longer one), and one case
of each checker has two.

The slots' mistakes are those of turning a position into a block and an
offset: the block id used as a slot without the factor ``block_size``, the
table ignored (positions as slots), the table read cyclically (``p %
len(table)``), the whole last block read (its unfilled tail included), the
offset and the block swapped, the slots run on contiguously from the first
block (``table[0] * block_size + p``), the offset not reduced (``p`` added
instead of ``p % block_size``), the block scaled by ``len(table)`` instead of
``block_size``, slots returned as floats (they index), the empty array of
a sequence of no positions built as ``np.array([])``, which is float64 and
cannot index, and the table's last entry taken for the part-filled block
(``len(table)`` blocks used, the last holding ``length - (len(table) - 1) *
block_size`` positions), wrong when the table has spare entries. The decoding
step's mistakes: the unfilled tail of the last block read as if it held keys,
the last block dropped, the newest position
dropped, the blocks read in the order of their ids instead of the table's, no
``1/sqrt(d)`` scaling, or ``1/sqrt(h d)`` (the heads' features counted
together), and, for a reader who attends block by block, the blocks' outputs
averaged, weighted by their filled counts or by their largest scores instead
of merged by their shares of the softmax's mass (chapter 9's merge), and the
tail's scores masked but not its values: a zero weight times a NaN or an
infinity left in an unfilled slot is NaN (two cases fill the tails with NaN
and with infinities), the exponentials taken without subtracting a maximum
(one case has scores of thousands, which overflow, and of minus hundreds,
which underflow to 0 / 0), and the table's last entry taken for the
part-filled block, as for the slots.

Numpy only: a reader may answer with torch, and a torch tensor returned is
compared as an array.
"""

from __future__ import annotations

import numpy as np

from ._framework import (
    Case,
    Mistake,
    as_array,
    difference,
    dtype_name,
    run_checks,
    same,
)

# --- the slots of a sequence -------------------------------------------------


def _reference_slots(table, length, block_size):
    p = np.arange(length)
    return (
        np.asarray(table, dtype=np.int64)[p // block_size] * block_size
        + p % block_size
    )


def _no_factor(table, length, block_size):
    p = np.arange(length)
    return np.asarray(table, dtype=np.int64)[p // block_size] + p % block_size


def _positions(table, length, block_size):
    return np.arange(length)


def _cyclic(table, length, block_size):
    p = np.arange(length)
    table = np.asarray(table, dtype=np.int64)
    return table[p % len(table)] * block_size + p % block_size


def _whole_blocks(table, length, block_size):
    n = -(-length // block_size) * block_size
    return _reference_slots(table, n, block_size)


def _swapped(table, length, block_size):
    p = np.arange(length)
    table = np.asarray(table, dtype=np.int64)
    return p % block_size * block_size + table[p // block_size]


def _from_first_block(table, length, block_size):
    # no table (no positions): no slots
    start = table[0] * block_size if len(table) else 0
    return start + np.arange(length)


def _offset_not_reduced(table, length, block_size):
    p = np.arange(length)
    return np.asarray(table, dtype=np.int64)[p // block_size] * block_size + p


def _table_length_factor(table, length, block_size):
    p = np.arange(length)
    blocks = np.asarray(table, dtype=np.int64)[p // block_size]
    return blocks * len(table) + p % block_size


def _float_slots(table, length, block_size):
    return _reference_slots(table, length, block_size).astype(np.float64)


def _column_slots(table, length, block_size):
    return _reference_slots(table, length, block_size)[:, None]


def _bool_slots(table, length, block_size):
    return _reference_slots(table, length, block_size).astype(bool)


def _empty_float(table, length, block_size):
    slots = _reference_slots(table, length, block_size)
    return slots if length else np.array([])


def _last_entry_ragged(table, length, block_size):
    """Every entry of the table used, the last taken for the part-filled
    block: the blocks but the last whole, then the last one's first
    ``length - (len(table) - 1) * block_size`` slots (none when that is
    negative, as with two spare entries)."""
    table = np.asarray(table, dtype=np.int64)
    if len(table) == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.arange(block_size)
    whole = (table[:-1, None] * block_size + offsets).reshape(-1)
    filled = max(0, length - (len(table) - 1) * block_size)
    return np.concatenate([whole, table[-1] * block_size + offsets[:filled]])


def _last_entry_for_ragged_block(table, length, block_size):
    """The full blocks looked up right, table[p // block_size], but the
    table's last entry taken for a part-filled last block."""
    table = np.asarray(table, dtype=np.int64)
    p = np.arange(length)
    blocks = table[p // block_size] if length else p
    if length % block_size:
        blocks = np.where(
            p // block_size == length // block_size, table[-1], blocks
        )
    return blocks * block_size + p % block_size


def _same_slots(got, expected) -> bool:
    """Equal slots, both integers or both not. No slots at all (length 0):
    an empty list, which indexes, or an empty array of the expected kind (a
    float64 ``np.array([])`` does not index)."""
    if isinstance(got, (list, tuple)) and len(got) == 0:
        return as_array(expected).shape == (0,)
    got, expected = as_array(got), as_array(expected)
    integers = [np.issubdtype(x.dtype, np.integer) for x in (got, expected)]
    return integers[0] == integers[1] and same(got, expected)


def _describe_slots(got, expected, case=None) -> str:
    """:func:`difference`, except that slots of the right values in a dtype
    that cannot index (float, bool) are called that, not a difference of
    0."""
    if got is not None and not isinstance(got, (list, tuple)):
        try:
            a = as_array(got)
        except (TypeError, ValueError):
            a = None
        if (
            a is not None
            and a.shape == as_array(expected).shape
            and not np.issubdtype(a.dtype, np.integer)
            and same(a, expected)
        ):
            kind = dtype_name(got)
            what = (
                f"your slots are an empty {kind} array, not an integer one"
                if a.size == 0
                else f"the values are right but the slots are {kind}, not "
                "integers"
            )
            return f"{what}: slots index the cache, and {kind} cannot index"
    return difference(got, expected, case)


SLOT_MISTAKES = [
    Mistake(
        "no_block_factor",
        "the block id is used as a slot: block b starts at slot b * "
        "block_size, not at b",
        "slot = table[p // block_size] * block_size + p % block_size",
        _no_factor,
    ),
    Mistake(
        "table_ignored",
        "the positions are returned as slots: the block table is not read",
        "position p lives in block table[p // block_size]",
        _positions,
    ),
    Mistake(
        "cyclic_table",
        "the table is indexed by p % len(table): a position's block is its "
        "block NUMBER p // block_size in the table",
        "use table[p // block_size]",
        _cyclic,
    ),
    Mistake(
        "whole_last_block",
        "the whole last block is returned, its unfilled tail included: "
        "ceil(length / block_size) * block_size slots",
        "return exactly `length` slots: positions 0 .. length - 1",
        _whole_blocks,
    ),
    Mistake(
        "offset_and_block_swapped",
        "the offset is scaled and the block added: (p % block_size) * "
        "block_size + table[p // block_size]",
        "the block is scaled, the offset added",
        _swapped,
    ),
    Mistake(
        "contiguous_from_first_block",
        "the slots run on from the first block, table[0] * block_size + p: "
        "a sequence's blocks need not be adjacent, and each of its blocks "
        "is wherever the table says",
        "look each position's block up: table[p // block_size] * "
        "block_size + p % block_size",
        _from_first_block,
    ),
    Mistake(
        "offset_not_reduced",
        "the position p is added to its block's start, not its offset p % "
        "block_size within the block: from the second block on, the slots "
        "overshoot",
        "the offset within a block is p % block_size",
        _offset_not_reduced,
    ),
    Mistake(
        "table_length_factor",
        "the block id is scaled by len(table), the number of blocks of the "
        "sequence, not by block_size, the positions per block (they agree "
        "only when the two are equal)",
        "block b starts at slot b * block_size",
        _table_length_factor,
    ),
    Mistake(
        "float_slots",
        "the slots are floats: they index memory, so they must be integers",
        "build them from integer arrays (np.arange, np.asarray(table)) or "
        "cast with .astype(np.int64)",
        _float_slots,
    ),
    Mistake(
        "column_slots",
        "the slots are a column (length, 1): one slot per position, in a "
        "1-D array",
        "return shape (length,): index with a 1-D np.arange(length), or "
        "flatten with .reshape(-1)",
        _column_slots,
    ),
    Mistake(
        "bool_slots",
        "the slots are booleans (True for every slot but 0): an array "
        "made with dtype=bool, or a comparison, keeps no slot numbers",
        "build the slots as integers: np.zeros(length, dtype=np.int64), or "
        "the formula on integer arrays",
        _bool_slots,
    ),
    Mistake(
        "empty_not_integer",
        "for 0 positions the slots are an empty float array (np.array([]) "
        "is float64, torch.tensor([]) float32), which cannot index memory",
        "build the slots from np.arange(length) or torch.arange(length), or "
        "give the dtype (np.int64, torch.long)",
        _empty_float,
    ),
    Mistake(
        "last_entry_ragged",
        "the table's last entry is taken for the part-filled block: a table "
        "may hold spare entries beyond the ceil(length / block_size) blocks "
        "the sequence uses, so len(table) is not its number of blocks",
        "find each position's block from the position, table[p // "
        "block_size], for p = 0 .. length - 1; the entries past "
        "table[ceil(length / block_size) - 1] are never read",
        _last_entry_ragged,
    ),
    Mistake(
        "last_entry_ragged",
        "the table's last entry is taken for the part-filled block, the "
        "full blocks looked up right: a table may hold spare entries beyond "
        "the ceil(length / block_size) blocks the sequence uses, so its last "
        "entry need not be the sequence's last block",
        "look every position's block up the same way, table[p // "
        "block_size], the part-filled block's positions included",
        _last_entry_for_ragged_block,
    ),
]


def slot_cases() -> list[Case]:
    return [
        Case("table [3, 0, 5], 7 positions, blocks of 3", ([3, 0, 5], 7, 3)),
        Case("table [2, 1], 8 positions, blocks of 4 (full)", ([2, 1], 8, 4)),
        Case("table [4], 1 position, blocks of 16", ([4], 1, 16)),
        Case(
            "table [6, 2, 9, 1], 4 positions, blocks of 1",
            ([6, 2, 9, 1], 4, 1),
        ),
        Case(
            "table [1, 7, 0, 4, 2], 5 positions, blocks of 2 (two spare "
            "entries)",
            ([1, 7, 0, 4, 2], 5, 2),
        ),
        Case("empty table, 0 positions, blocks of 4", ([], 0, 4)),
    ]


def check_block_slots(fn) -> None:
    """Check ``fn(table, length, block_size)`` returns the int array (length,)
    of flat slots ``table[p // block_size] * block_size + p % block_size``
    of positions ``p = 0 .. length - 1``; table: a list of block ids, at
    least ``ceil(length / block_size)`` of them (any more are spare)."""
    run_checks(
        "the slots of a sequence in a paged cache",
        fn,
        slot_cases(),
        _reference_slots,
        SLOT_MISTAKES,
        compare=_same_slots,
        describe=_describe_slots,
        postprocess=lambda out: out,
    )


# --- one decoding step through a block table ---------------------------------


def _gather(blocks, table, length):
    n_blocks, size = blocks.shape[:2]
    flat = blocks.reshape(n_blocks * size, *blocks.shape[2:])
    return flat[_reference_slots(table, length, size)]


def _attend(q, k, v, scale=True):
    """q (H, d), k and v (n, H, d) -> (H, d); ``scale``: True for
    1/sqrt(d), False for none, or the divisor itself."""
    scores = np.einsum("hd,nhd->hn", q, k)
    if scale is True:
        scores = scores / np.sqrt(q.shape[-1])
    elif scale is not False:
        scores = scores / scale
    w = np.exp(scores - scores.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    return np.einsum("hn,nhd->hd", w, v)


def _reference_decode(q, key_blocks, value_blocks, table, length):
    return _attend(
        q,
        _gather(key_blocks, table, length),
        _gather(value_blocks, table, length),
    )


def _tail_read(q, key_blocks, value_blocks, table, length):
    n = -(-length // key_blocks.shape[1]) * key_blocks.shape[1]
    return _reference_decode(q, key_blocks, value_blocks, table, n)


def _last_block_dropped(q, key_blocks, value_blocks, table, length):
    n = length // key_blocks.shape[1] * key_blocks.shape[1]
    return _reference_decode(q, key_blocks, value_blocks, table, n)


def _newest_dropped(q, key_blocks, value_blocks, table, length):
    return _reference_decode(q, key_blocks, value_blocks, table, length - 1)


def _sorted_table(q, key_blocks, value_blocks, table, length):
    order = sorted(table[: -(-length // key_blocks.shape[1])])
    return _reference_decode(q, key_blocks, value_blocks, order, length)


def _no_scale(q, key_blocks, value_blocks, table, length):
    return _attend(
        q,
        _gather(key_blocks, table, length),
        _gather(value_blocks, table, length),
        scale=False,
    )


def _scale_heads_times_d(q, key_blocks, value_blocks, table, length):
    return _attend(
        q,
        _gather(key_blocks, table, length),
        _gather(value_blocks, table, length),
        scale=np.sqrt(q.size),
    )


def _block_states(q, key_blocks, value_blocks, table, length):
    """Each block's output normalised over its filled positions, its
    largest score per head and its number of filled positions."""
    size = key_blocks.shape[1]
    outs, tops, counts = [], [], []
    for i, block in enumerate(table[: -(-length // size)]):
        n = min(size, length - i * size)
        k, v = key_blocks[block, :n], value_blocks[block, :n]
        outs.append(_attend(q, k, v))
        scores = np.einsum("hd,nhd->hn", q, k) / np.sqrt(q.shape[-1])
        tops.append(scores.max(axis=-1))
        counts.append(n)
    return np.array(outs), np.array(tops), np.array(counts, dtype=float)


def _blocks_by_count(q, key_blocks, value_blocks, table, length):
    outs, _, counts = _block_states(q, key_blocks, value_blocks, table, length)
    return (counts[:, None, None] * outs).sum(axis=0) / counts.sum()


def _blocks_by_max(q, key_blocks, value_blocks, table, length):
    outs, tops, _ = _block_states(q, key_blocks, value_blocks, table, length)
    share = np.exp(tops - tops.max(axis=0))
    share /= share.sum(axis=0)
    return (share[..., None] * outs).sum(axis=0)


def _decode_last_entry_ragged(q, key_blocks, value_blocks, table, length):
    size = key_blocks.shape[1]
    slots = _last_entry_ragged(table, length, size)
    flat = (x.reshape(-1, *x.shape[2:]) for x in (key_blocks, value_blocks))
    return _attend(q, *(x[slots] for x in flat))


def _decode_last_entry_for_ragged_block(
    q, key_blocks, value_blocks, table, length
):
    size = key_blocks.shape[1]
    slots = _last_entry_for_ragged_block(table, length, size)
    flat = (x.reshape(-1, *x.shape[2:]) for x in (key_blocks, value_blocks))
    return _attend(q, *(x[slots] for x in flat))


def _values_not_masked(q, key_blocks, value_blocks, table, length):
    size = key_blocks.shape[1]
    used = table[: -(-length // size)]
    k = key_blocks[used].reshape(-1, *key_blocks.shape[2:])
    v = value_blocks[used].reshape(-1, *value_blocks.shape[2:])
    scores = np.einsum("hd,nhd->hn", q, k) / np.sqrt(q.shape[-1])
    scores[:, length:] = -np.inf
    w = np.exp(scores - scores.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    return np.einsum("hn,nhd->hd", w, v)


def _no_max(q, key_blocks, value_blocks, table, length):
    k, v = (_gather(x, table, length) for x in (key_blocks, value_blocks))
    with np.errstate(all="ignore"):
        w = np.exp(np.einsum("hd,nhd->hn", q, k) / np.sqrt(q.shape[-1]))
        return np.einsum("hn,nhd->hd", w / w.sum(-1, keepdims=True), v)


def _blocks_averaged(q, key_blocks, value_blocks, table, length):
    size = key_blocks.shape[1]
    outs = []
    for i, block in enumerate(table[: -(-length // size)]):
        n = min(size, length - i * size)
        outs.append(_attend(q, key_blocks[block, :n], value_blocks[block, :n]))
    return np.mean(outs, axis=0)


DECODE_MISTAKES = [
    Mistake(
        "unfilled_tail_read",
        "the unfilled tail of the last block is attended: its slots hold "
        "whatever was there before (here, garbage), not keys",
        "attend to exactly `length` positions: mask (or cut) the slots of "
        "the last block beyond length - 1",
        _tail_read,
    ),
    Mistake(
        "last_block_dropped",
        "only the full blocks are attended: the part-filled last block, "
        "which holds the newest positions, is left out",
        "the last block the sequence uses, table[m - 1] with m = "
        "ceil(length / block_size), holds length - (m - 1) * block_size "
        "positions",
        _last_block_dropped,
    ),
    Mistake(
        "newest_dropped",
        "length - 1 positions are attended: the newest key (the query's "
        "own) is left out",
        "the query attends to positions 0 .. length - 1, its own included",
        _newest_dropped,
    ),
    Mistake(
        "blocks_sorted",
        "the blocks are read in the order of their ids: a sequence's blocks "
        "are wherever the allocator put them, in the order of its table",
        "read table[0], table[1], ... in that order",
        _sorted_table,
    ),
    Mistake(
        "no_scale",
        "the scores are not divided by sqrt(d)",
        "scores = q . k / sqrt(d)",
        _no_scale,
    ),
    Mistake(
        "blocks_averaged",
        "the blocks' outputs are averaged: each block's output is "
        "normalised over that block only, and must be weighted by the "
        "block's share of the whole row's softmax mass",
        "keep each block's log-sum-exp and merge as in chapter 9: weights "
        "exp(lse_b - logsumexp_b lse_b)",
        _blocks_averaged,
    ),
    Mistake(
        "scale_heads_times_d",
        "the scores are divided by sqrt(h * d), the heads' features counted "
        "together: each head scores with its own d features",
        "scores = q . k / sqrt(d), d = q.shape[-1], the features of one head",
        _scale_heads_times_d,
    ),
    Mistake(
        "blocks_by_count",
        "the blocks' outputs are weighted by their numbers of filled "
        "positions: a block's share of the output is its share of the "
        "softmax's mass, sum_s exp(score_s), not of the positions",
        "keep each block's log-sum-exp and merge as in chapter 9: weights "
        "exp(lse_b - logsumexp_b lse_b)",
        _blocks_by_count,
    ),
    Mistake(
        "blocks_by_max",
        "the blocks are merged by their largest scores (weights "
        "exp(max_b - ...)): a block's softmax mass is exp of its "
        "log-sum-exp, which counts every score of the block, not only its "
        "largest",
        "keep each block's log-sum-exp, max + log(sum(exp(scores - max))), "
        "and merge with weights exp(lse_b - logsumexp_b lse_b)",
        _blocks_by_max,
    ),
    Mistake(
        "values_not_masked",
        "the tail's scores are masked but its values are used: its weights "
        "are 0, but its slots may hold NaN or infinities, and 0 * NaN = 0 * "
        "inf = NaN",
        "drop the tail's values (cut each block to its filled positions) or "
        "zero them (np.where / torch.where) before the weighted sum",
        _values_not_masked,
    ),
    Mistake(
        "unstable_softmax",
        "the exponentials are taken without subtracting a maximum: exp "
        "overflows to inf once a score passes about 709 (88 in float32) and "
        "underflows to 0 below about -745, and inf / inf or 0 / 0 is NaN",
        "subtract each head's largest score before exp; block by block, keep "
        "a running maximum and rescale the sums when it grows, or merge the "
        "blocks' log-sum-exps, as in chapter 9",
        _no_max,
    ),
    Mistake(
        "last_entry_ragged",
        "the table's last entry is taken for the part-filled block: a table "
        "may hold spare entries beyond the m = ceil(length / block_size) "
        "blocks the sequence uses, so len(table) is not its number of "
        "blocks, and the spare blocks hold garbage",
        "read table[0 .. m - 1] only; block j holds min(block_size, length "
        "- j * block_size) positions",
        _decode_last_entry_ragged,
    ),
    Mistake(
        "last_entry_ragged",
        "the table's last entry is taken for the part-filled block, the "
        "full blocks read right: a table may hold spare entries beyond the "
        "m = ceil(length / block_size) blocks the sequence uses, and the "
        "spare blocks hold garbage",
        "block j of the sequence is table[j] for every j < m, the "
        "part-filled one included",
        _decode_last_entry_for_ragged_block,
    ),
]


LARGE_SCORES = (
    "blocks of 5, table [1, 4], 8 positions, 2 heads of 6, large scores: "
    "head 0's largest is 2340, head 1's -906 (queries scaled by 300)"
)


def decode_cases() -> list[Case]:
    rng = np.random.default_rng(0)
    cases = []
    for name, (n_blocks, size, h, d, table, length) in {
        "blocks of 4, table [5, 1, 3], 10 positions (last block half "
        "filled)": (7, 4, 2, 3, [5, 1, 3], 10),
        "blocks of 3, table [2, 0], 6 positions (full)": (
            4,
            3,
            1,
            4,
            [2, 0],
            6,
        ),
        "blocks of 8, table [3], 2 positions": (5, 8, 2, 2, [3], 2),
        "blocks of 2, table [6, 4, 0, 2, 7, 1], 7 positions (two spare "
        "entries)": (8, 2, 3, 3, [6, 4, 0, 2, 7, 1], 7),
        LARGE_SCORES: (6, 5, 2, 6, [1, 4], 8),
    }.items():
        # garbage everywhere, then the sequence's keys where they belong
        keys = rng.standard_normal((n_blocks, size, h, d)) * 3 + 2
        values = rng.standard_normal((n_blocks, size, h, d)) * 3 - 4
        q = rng.standard_normal((h, d)) * 1.5
        if name == LARGE_SCORES:
            # exp overflows float64 past 709 and underflows to 0 below -745
            q = q * 300
        cases.append(Case(name, (q, keys, values, list(table), length)))
    # uninitialised memory: NaN, then infinities, in the unfilled tails
    for name, (n_blocks, size, table, length, fill) in {
        "blocks of 4, table [2, 0], 6 positions, NaN in the unfilled tail": (
            4,
            4,
            [2, 0],
            6,
            (np.nan, np.nan),
        ),
        "blocks of 3, table [1, 3, 0], 7 positions, inf in the unfilled "
        "tail": (5, 3, [1, 3, 0], 7, (np.inf, -np.inf)),
    }.items():
        keys = rng.standard_normal((n_blocks, size, 2, 3)) * 3 + 2
        values = rng.standard_normal((n_blocks, size, 2, 3)) * 3 - 4
        filled = length - (len(table) - 1) * size
        keys[table[-1], filled:] = fill[0]
        values[table[-1], filled:] = fill[1]
        q = rng.standard_normal((2, 3)) * 1.5
        cases.append(Case(name, (q, keys, values, list(table), length)))
    return cases


def check_paged_decode(fn) -> None:
    """Check ``fn(q, key_blocks, value_blocks, table, length)`` returns one
    decoding step of attention, (n_heads, d): query ``q`` (n_heads, d) over
    the ``length`` positions of a sequence whose keys and values sit in
    ``key_blocks``, ``value_blocks`` (n_blocks, block_size, n_heads, d) at the
    first ``ceil(length / block_size)`` blocks of ``table``, in order (any
    entries after them are spare); the slots past ``length`` in the last
    block, and the spare blocks, hold garbage (NaN or infinities in the
    unfilled tails of two cases)."""
    run_checks(
        "a decoding step through a block table",
        fn,
        decode_cases(),
        _reference_decode,
        DECODE_MISTAKES,
    )
