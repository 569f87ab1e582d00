"""Checkers for chapter 10 (FlashAttention on a GPU): causal block counts and
FLOP counts."""

from __future__ import annotations

import numpy as np

from ..cost import benchmark_flops
from ..flash import key_tiles
from ._framework import (
    Case,
    ExerciseError,
    Mistake,
    difference,
    run_checks,
    same,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- how many key blocks does each causal query block visit? -----------------


def key_blocks_visited(
    n_q: int, n_k: int, block_q: int, block_k: int
) -> np.ndarray:
    """Reference: per query block, the number of key blocks the causal kernels
    load: the tiles of chapter 9's schedule (:func:`attnbook.flash.key_tiles`),
    which the kernels' bounds follow (tests/test_exercises_triton_flash.py
    checks the two agree). numpy only, so that the checker also runs where
    torch and Triton do not (the browser)."""
    return np.array(
        [
            sum(
                1
                for _ in key_tiles(
                    slice(q0, min(q0 + block_q, n_q)),
                    n_q,
                    n_k,
                    block_k,
                    causal=True,
                )
            )
            for q0 in range(0, n_q, block_q)
        ]
    )


def _per_block(fn):
    """Build a wrong answer from a formula for one query block (first absolute
    query position a0)."""

    def counts(n_q, n_k, block_q, block_k):
        offset = n_k - n_q
        return np.array(
            [
                fn(
                    q_block * block_q + offset,
                    q_block,
                    n_q,
                    n_k,
                    block_q,
                    block_k,
                )
                for q_block in range(_cdiv(n_q, block_q))
            ]
        )

    return counts


BLOCK_COUNT_MISTAKES = [
    Mistake(
        "no_skipping",
        "every query block visits every key block: causal blocks are masked "
        "but not skipped",
        "key blocks that start after the block's last query are hidden from "
        "all its rows: never load them",
        _per_block(lambda a0, qb, n_q, n_k, bq, bk: _cdiv(n_k, bk)),
    ),
    Mistake(
        "diagonal_missed",
        "the block on the diagonal is missing: only blocks fully visible to "
        "every row count",
        "a block that the diagonal crosses is visited too (with a mask): "
        "count up to the LAST row's "
        "last visible key, rounded up to a whole block",
        _per_block(lambda a0, qb, n_q, n_k, bq, bk: min(a0 + 1, n_k) // bk),
    ),
    Mistake(
        "diagonal_only",
        "only the blocks on the diagonal count, those the mask cuts: the "
        "blocks below it, fully visible to every row, are loaded too",
        "the kernel loads every key block from the first up to the last "
        "row's last visible key, masked or not",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: (
                _cdiv(min(a0 + bq, n_k), bk) - min(a0 + 1, n_k) // bk
            )
        ),
    ),
    Mistake(
        "first_row",
        "the count follows the block's FIRST query row, which sees the fewest "
        "keys",
        "the rows below it see further: use the last row of the block, at "
        "position a0 + block_q - 1",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: _cdiv(min(a0 + 1, n_k), bk)
        ),
    ),
    Mistake(
        "top_left",
        "the queries are aligned with the FIRST n_q keys (PyTorch's "
        "is_causal), not the last",
        "in the book's convention query i sits at position i + n_k - n_q and "
        "sees every key up to it",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: _cdiv(min((qb + 1) * bq, n_k), bk)
        ),
    ),
    Mistake(
        "divide_by_block_q",
        "the keys to cover were divided by block_q, the query block's length, "
        "instead of block_k: right only when the two are equal",
        "the count is of KEY blocks: cut the keys to cover into blocks of "
        "block_k",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: _cdiv(min(a0 + bq, n_k), bq)
        ),
    ),
    Mistake(
        "equal_blocks",
        "query block b visits b + 1 key blocks: right only when block_q == "
        "block_k and n_q == n_k",
        "convert positions, not block numbers: find the absolute position "
        "of the block's last query (the offset n_k - n_q included), then the "
        "key blocks that cover the keys up to it",
        _per_block(lambda a0, qb, n_q, n_k, bq, bk: qb + 1),
    ),
    Mistake(
        "no_clamp",
        "past the last key: the count is not clamped to the key blocks that "
        "exist",
        "the last query block can hang past n_q; its rows past the end see "
        "keys past n_k - 1, which do not "
        "exist: stop at the last key that exists",
        _per_block(lambda a0, qb, n_q, n_k, bq, bk: _cdiv(a0 + bq, bk)),
    ),
    Mistake(
        "offset_in_blocks",
        "the cache offset n_k - n_q was counted in whole key blocks (rounded "
        "down), "
        "right only when it is a multiple of block_k",
        "add the offset to the query positions first, then convert positions "
        "to blocks",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: (
                _cdiv(min((qb + 1) * bq, n_q), bk) + (n_k - n_q) // bk
            )
        ),
    ),
    # the offset moved into whole QUERY blocks before converting to key
    # blocks: right when n_k - n_q is a multiple of block_q
    Mistake(
        "offset_in_query_blocks",
        "the cache offset n_k - n_q was counted in whole query blocks "
        "(rounded down), right only when it is a multiple of block_q",
        "add the offset to the query positions first, then convert positions "
        "to blocks",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: _cdiv(
                min((qb + 1 + (n_k - n_q) // bq) * bq, n_k), bk
            )
        ),
    ),
    Mistake(
        "clamp_to_n_q",
        "the count is clamped to n_q, the number of queries, instead of n_k, "
        "the number of "
        "keys: right only without a cache (n_q = n_k)",
        "the keys to cover end at the block's last query position (offset "
        "included) or at the last key, "
        "whichever comes first",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: _cdiv(min(a0 + bq, n_q), bk)
        ),
    ),
    Mistake(
        "floor_not_ceil",
        "the keys to cover were divided by block_k rounding down: a partly "
        "covered "
        "last block is dropped",
        "a block that holds even one visible key is visited: round up",
        _per_block(lambda a0, qb, n_q, n_k, bq, bk: min(a0 + bq, n_k) // bk),
    ),
    # the same slip with the cap applied after rounding, at the key blocks
    # that exist: right on a ragged last block that the last query block runs
    # past, so the cases that tell it from offset_in_blocks are others
    Mistake(
        "floor_not_ceil",
        "the keys to cover were divided by block_k rounding down: a partly "
        "covered last block is dropped",
        "a block that holds even one visible key is visited: round up",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: min(
                (a0 + bq) // bk, _cdiv(n_k, bk)
            )
        ),
    ),
    Mistake(
        "round_not_ceil",
        "the keys to cover were divided by block_k rounding to the nearest "
        "block: a last block less than half covered is dropped",
        "a block that holds even one visible key is visited, however few: "
        "round up",
        # Python's round (half to even); no case puts the keys to cover at
        # exactly half a block, so rounding half up is diagnosed the same
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: round(min(a0 + bq, n_k) / bk)
        ),
    ),
    Mistake(
        "offset_reversed",
        "the cache offset has the wrong sign: n_q - n_k instead of n_k - n_q",
        "the queries are the LAST n_q of the n_k positions, so query i sits "
        "at i + n_k - n_q, at or after i",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: _cdiv(
                min((qb + 1) * bq + n_q - n_k, n_k), bk
            )
        ),
    ),
    Mistake(
        "one_past",
        "one key block too many where the last visible key ends a block",
        "the last visible key of the block is at a0 + block_q - 1; the keys "
        "to cover are "
        "0 .. a0 + block_q - 1, that is a0 + block_q of them, not one more",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: _cdiv(min(a0 + bq + 1, n_k), bk)
        ),
    ),
    Mistake(
        "last_position_as_count",
        "the last visible key's POSITION was divided by block_k as if it "
        "were the number of keys: one key block short whenever that "
        "position is a multiple of block_k",
        "keys 0 .. a0 + block_q - 1 are a0 + block_q keys, one more than the "
        "last one's position: round up min(a0 + block_q, n_k) / block_k",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: _cdiv(min(a0 + bq - 1, n_k), bk)
        ),
    ),
    Mistake(
        "clamp_at_n_k",
        "the last visible key was clamped at n_k instead of n_k - 1: one key "
        "block too many "
        "when the last query block hangs past the end and n_k is a multiple "
        "of block_k",
        "the last key that exists is n_k - 1, not n_k: the block's last "
        "visible key is "
        "min(a0 + block_q - 1, n_k - 1), and the blocks that hold keys 0 .. "
        "that key are counted by rounding up",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: min(a0 + bq - 1, n_k) // bk + 1
        ),
    ),
    Mistake(
        "cap_drops_ragged",
        "the count is capped at n_k // block_k, the whole key blocks: the "
        "ragged last "
        "block, which holds the last n_k % block_k keys, is dropped",
        "the key blocks that exist are cdiv(n_k, block_k), the last one "
        "possibly ragged; clamp the keys to cover, not the count of whole "
        "blocks, and the ragged block counts",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: min(_cdiv(a0 + bq, bk), n_k // bk)
        ),
    ),
    # issue 31, student report 10 (session 11): the rounding up written as
    # floor + 1, one block too many wherever the keys to cover end a block
    Mistake(
        "floor_plus_one",
        "the keys to cover were rounded up as floor(keys / block_k) + 1: one "
        "key block too many wherever the keys to cover fill a whole number of "
        "blocks",
        "floor + 1 rounds up only when keys / block_k is not a whole number; "
        "round the same count of keys up with -(-keys // block_k) (or "
        "math.ceil)",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: min(a0 + bq, n_k) // bk + 1
        ),
    ),
    # the query blocks counted as n_q // block_q: one entry short when the
    # last query block is ragged
    Mistake(
        "query_blocks_floor",
        "the list has one entry too few: the query blocks were counted as "
        "n_q // block_q, which drops a ragged last query block",
        "there are cdiv(n_q, block_q) = -(-n_q // block_q) query blocks, the "
        "last one possibly shorter than block_q: give it a count too",
        lambda n_q, n_k, bq, bk: key_blocks_visited(n_q, n_k, bq, bk)[
            : n_q // bq
        ],
    ),
    Mistake(
        "first_row_plus_width",
        "the count is the first row's key block plus block_q / block_k "
        "blocks: right "
        "only when the block's first query position is a multiple of block_k",
        "rows a0 .. a0 + block_q - 1 that start inside a key block reach one "
        "block further than "
        "block_q / block_k blocks: convert the LAST row's position",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: min(
                a0 // bk + _cdiv(bq, bk), _cdiv(n_k, bk)
            )
        ),
    ),
    # issue 31, student report s12i: the same shortcut with block_q // block_k
    # rounded down, which adds no block at all when the query block is shorter
    # than a key block; it got the generic hint
    Mistake(
        "first_row_plus_floor_width",
        "the count is the first row's key block plus block_q // block_k "
        "blocks, rounded down: 0 more when the query block is shorter than a "
        "key block, and right only when the block's first query position and "
        "block_q are both multiples of block_k",
        "rows a0 .. a0 + block_q - 1 can end in a later key block than the "
        "first row's block + block_q // block_k: convert the LAST row's "
        "position instead, and count the blocks that cover keys 0 .. "
        "min(a0 + block_q - 1, n_k - 1), rounding up",
        _per_block(
            lambda a0, qb, n_q, n_k, bq, bk: min(
                a0 // bk + bq // bk, _cdiv(n_k, bk)
            )
        ),
    ),
    # and the first row's count, a0 // block_k + 1, plus block_q // block_k
    # more, unclamped: one block too many wherever a0 starts a key block
    Mistake(
        "first_row_count_plus_width",
        "the count is the first row's count of blocks, a0 // block_k + 1, "
        "plus block_q // block_k more, not clamped to the key blocks that "
        "exist: one key block too many where a0 and block_q are both "
        "multiples of block_k, one too few where their remainders modulo "
        "block_k add up to more than block_k",
        "adding block widths to the first row's block loses track of where "
        "the last row falls inside its key block: convert the LAST row's "
        "position instead, and count the blocks that cover keys 0 .. "
        "min(a0 + block_q - 1, n_k - 1), rounding up",
        _per_block(lambda a0, qb, n_q, n_k, bq, bk: a0 // bk + 1 + bq // bk),
    ),
]


def block_count_cases() -> list[Case]:
    return [
        Case("n_q = n_k = 256, block_q = block_k = 64", (256, 256, 64, 64)),
        Case(
            "n_q = n_k = 256, block_q = 128, block_k = 64", (256, 256, 128, 64)
        ),
        # the last query block (one row) hangs past the end while n_k is a
        # multiple of block_k: a count that clamps the last visible key at n_k
        # instead of n_k - 1 comes out one block too many; and the first rows
        # of the query blocks (offset 127) sit inside a key block, so that the
        # first row's block plus block_q / block_k more comes out one block
        # short
        Case(
            "65 new queries after 127 cached keys (the last query block hangs "
            "past the end, n_k a multiple of "
            "block_k): n_q = 65, n_k = 192, block_q = 32, block_k = 64",
            (65, 192, 32, 64),
        ),
        Case(
            "n_q = n_k = 200 (a ragged last block), block_q = block_k = 64",
            (200, 200, 64, 64),
        ),
        # an offset that is not a multiple of block_k, and n_q != n_k where
        # clamping to n_q or aligning the queries top-left give different wrong
        # counts; with an offset of 129 the last visible key of the second
        # query block is key 192, a multiple of block_k, so counting it as 192
        # keys instead of 193 comes out one block short
        Case(
            "96 new queries after 129 cached keys (not a multiple of the "
            "block): n_q = 96, n_k = 225, "
            "block_q = 32, block_k = 64",
            (96, 225, 32, 64),
        ),
        Case(
            "one query, n_k = 300, block_q = 16, block_k = 64",
            (1, 300, 16, 64),
        ),
        Case(
            "n_q = n_k = 65 (the last query block hangs past the end), "
            "block_q = 64, block_k = 16",
            (65, 65, 64, 16),
        ),
        # an offset (17) smaller than block_q but not a multiple of it:
        # rounding it down to whole query blocks drops it (4 blocks), and
        # the first row's key block plus block_q / block_k blocks gives 5;
        # the right count is 6
        Case(
            "64 new queries after 17 cached keys: n_q = 64, n_k = 81, "
            "block_q = 64, block_k = 16",
            (64, 81, 64, 16),
        ),
    ]


def _as_counts(out):
    if (
        not isinstance(out, np.ndarray)
        and not hasattr(out, "__len__")
        and hasattr(out, "__iter__")
    ):
        # a generator or another iterable: its values, not one object
        out = list(out)
    out = np.asarray(out)
    if out.dtype.kind == "f" and np.all(out == np.round(out)):
        out = out.astype(int)
    return out


def _describe_counts(got, expected, case=None) -> str:
    """The difference, with both lists of counts (short on every case), so
    that the reader sees which query block is off (issue 31, student report
    10)."""
    base = difference(got, expected, case)
    got_a, expected_a = np.asarray(got), np.asarray(expected)
    if got_a.ndim == 1 and expected_a.ndim == 1:
        return (
            f"{base}; your counts {got_a.tolist()}, the kernel's "
            f"{expected_a.tolist()}"
        )
    return base


def check_key_blocks(fn) -> None:
    """Check ``fn(n_q, n_k, block_q, block_k)``: the number of key blocks each
    causal query block visits.

    Returns a sequence of ``cdiv(n_q, block_q)`` integers. The queries are the
    last ``n_q`` of the ``n_k`` positions (the book's causal convention).
    """
    run_checks(
        "causal key blocks",
        fn,
        block_count_cases(),
        key_blocks_visited,
        BLOCK_COUNT_MISTAKES,
        postprocess=_as_counts,
        describe=_describe_counts,
    )


# --- FLOPs of attention ------------------------------------------------------

_MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def _flops_with(forward, factors=_MODE_FACTOR, halve=True):
    def flops(batch, heads, n, d, causal=False, mode="fwd"):
        f = forward(batch, heads, n, d)
        if causal and halve:
            f /= 2
        return f * factors[mode]

    return flops


FLOPS_MISTAKES = [
    Mistake(
        "causal_not_halved",
        "causal attention is counted as the full n x n product",
        "a causal kernel computes only the scores on and below the diagonal: "
        "about half of them",
        _flops_with(lambda b, h, n, d: 4.0 * b * h * n * n * d, halve=False),
    ),
    Mistake(
        "half_forward",
        "the forward is half of 4 B H n^2 d: a multiply-add counted as one "
        "FLOP, "
        "or only one of the two matrix products",
        "S = Q K^T and O = P V each cost n^2 d multiply-adds per head, and a "
        "multiply-add is 2 FLOPs",
        _flops_with(lambda b, h, n, d: 2.0 * b * h * n * n * d),
    ),
    Mistake(
        "backward_two",
        "the backward is counted as 2 times the forward, like an ordinary "
        "matrix product",
        "attention's backward does five n x n x d products (S recomputed, dV, "
        "dP, dQ, dK) to the "
        "forward's two: 2.5 times",
        _flops_with(
            lambda b, h, n, d: 4.0 * b * h * n * n * d,
            {"fwd": 1.0, "bwd": 2.0, "fwd_bwd": 3.0},
        ),
    ),
    Mistake(
        "fwd_bwd_without_fwd",
        "forward + backward is counted as the backward alone",
        "a training step runs both passes: 1 + 2.5 = 3.5 times the forward",
        _flops_with(
            lambda b, h, n, d: 4.0 * b * h * n * n * d,
            {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 2.5},
        ),
    ),
    Mistake(
        "d_squared",
        "n and d are swapped in the count (n d^2 instead of n^2 d)",
        "each of the n^2 scores is a dot product of length d",
        _flops_with(lambda b, h, n, d: 4.0 * b * h * n * d * d),
    ),
    Mistake(
        "causal_forward_only",
        "causal attention is halved in the forward pass only: its backward "
        "(and forward + backward) skip the same blocks, so they halve too",
        "halve the forward count when causal, then multiply by the mode's "
        "factor (1, 2.5 or 3.5)",
        lambda batch, heads, n, d, causal=False, mode="fwd": (
            4.0
            * batch
            * heads
            * n
            * n
            * d
            / (2 if causal and mode == "fwd" else 1)
            * _MODE_FACTOR[mode]
        ),
    ),
    Mistake(
        "fwd_bwd_not_halved",
        "causal forward + backward is counted as the full 3.5 x 4 B H n^2 d: "
        "the halving "
        "was applied to the forward and the backward alone, not to the two "
        "together",
        "a causal training step skips the same blocks in both passes: halve "
        "the forward count when causal, "
        "then multiply by 3.5 for forward + backward",
        lambda batch, heads, n, d, causal=False, mode="fwd": (
            4.0
            * batch
            * heads
            * n
            * n
            * d
            / (2 if causal and mode != "fwd_bwd" else 1)
            * _MODE_FACTOR[mode]
        ),
    ),
    Mistake(
        "backward_seven",
        "the backward is counted as 3.5 times the forward (seven n x n x d "
        "products instead of five), and forward + backward as 4.5 times",
        "a kernel may well perform more products than five (exercise "
        "ex-ch10-recompute counts the book's), but benchmarks count by the "
        "papers' "
        "convention: the backward's five "
        "products (S, dV, dP, dQ, dK) to the forward's two, 2.5 times the "
        "forward, and forward + backward "
        "3.5 times, whatever a kernel recomputes",
        _flops_with(
            lambda b, h, n, d: 4.0 * b * h * n * n * d,
            {"fwd": 1.0, "bwd": 3.5, "fwd_bwd": 4.5},
        ),
    ),
    Mistake(
        "causal_strictly_below",
        "causal attention is counted as n (n - 1) / 2 scores, those strictly "
        "below "
        "the diagonal",
        "each query also sees its own key (the diagonal), and benchmarks "
        "count n^2 / 2 for causal attention "
        "(the FlashAttention papers' convention): use half of the full count",
        lambda batch, heads, n, d, causal=False, mode="fwd": (
            4.0
            * batch
            * heads
            * (n * (n - 1) / 2 if causal else n * n)
            * d
            * _MODE_FACTOR[mode]
        ),
    ),
    Mistake(
        "tflops_not_flops",
        "the count is in TFLOP (divided by 10^12), not in FLOP",
        "return the number of floating-point operations itself; the benchmark "
        "divides by the time and "
        "by 10^12 later",
        lambda batch, heads, n, d, causal=False, mode="fwd": (
            benchmark_flops(batch, heads, n, d, causal, mode) / 1e12
        ),
    ),
    Mistake(
        "exact_causal",
        "causal attention is counted exactly, n (n + 1) / 2 scores, not by "
        "the papers' convention",
        "your count is the true one, but benchmarks report n^2 / 2 for causal "
        "attention (the convention "
        "of the FlashAttention papers, which the chapter's plots use), so "
        "that causal and full TFLOP/s "
        "compare; use half of the full count",
        lambda batch, heads, n, d, causal=False, mode="fwd": (
            4.0
            * batch
            * heads
            * (n * (n + 1) / 2 if causal else n * n)
            * d
            * _MODE_FACTOR[mode]
        ),
    ),
    # expert reading y10gpu: an integer count that floors n^2 / 2 for an odd
    # n was rejected with the generic hint
    Mistake(
        "causal_floored",
        "causal attention is counted as n * n // 2 scores: for an odd n the "
        "integer division drops half a score per head, so the count is "
        "short by a factor 1 / n^2",
        "halve the whole product, which is even (4 B H n^2 d // 2), or "
        "compute in floats (4 * B * H * n * n * d / 2): benchmarks count "
        "exactly n^2 / 2 for causal attention",
        lambda batch, heads, n, d, causal=False, mode="fwd": (
            4.0
            * batch
            * heads
            * (n * n // 2 if causal else n * n)
            * d
            * _MODE_FACTOR[mode]
        ),
    ),
    Mistake(
        "exponentials_counted",
        "the softmax's exponentials are counted, one FLOP per score (B H "
        "n^2 more in the forward)",
        "count only the matrix products: that is the convention the "
        "chapter states for the benchmark's FLOPs",
        _flops_with(
            lambda b, h, n, d: 4.0 * b * h * n * n * d + 1.0 * b * h * n * n
        ),
    ),
]


def flops_cases() -> list[Case]:
    return [
        Case(
            "forward, batch 2, heads 8, n = 1024, d = 64",
            (2, 8, 1024, 64),
            dict(causal=False, mode="fwd"),
        ),
        Case(
            "causal forward, batch 1, heads 16, n = 4096, d = 128",
            (1, 16, 4096, 128),
            dict(causal=True, mode="fwd"),
        ),
        Case(
            "causal backward, batch 4, heads 12, n = 2048, d = 64",
            (4, 12, 2048, 64),
            dict(causal=True, mode="bwd"),
        ),
        Case(
            "forward + backward, batch 8, heads 32, n = 512, d = 64",
            (8, 32, 512, 64),
            dict(causal=False, mode="fwd_bwd"),
        ),
        Case(
            "backward, batch 2, heads 4, n = 1024, d = 128",
            (2, 4, 1024, 128),
            dict(causal=False, mode="bwd"),
        ),
        # the forward + backward of a causal training step, the case the
        # chapter's benchmark prints; without it a count that forgets to halve
        # causal forward + backward passed every other case
        Case(
            "causal forward + backward, batch 4, heads 16, n = 1024, d = 64",
            (4, 16, 1024, 64),
            dict(causal=True, mode="fwd_bwd"),
        ),
        # a count that float32 cannot represent exactly (158776200): a right
        # answer computed in float32 must still pass; and an odd n small
        # enough that n * n // 2, which floors n^2 / 2, is off by 1 / n^2 =
        # 1.0e-4, a hundred times the tolerance (with n = 999 it was off by
        # 1.002e-6, rejected by a 0.2 % margin; expert reading y10gpu)
        Case(
            "causal backward, batch 5, heads 9, n = 99, d = 72",
            (5, 9, 99, 72),
            dict(causal=True, mode="bwd"),
        ),
    ]


# kept apart from FLOPS_MISTAKES: judged by its own call, not by the cases
MODE_MISTAKES = [
    Mistake(
        "unknown_mode_accepted",
        "a mode other than 'fwd', 'bwd' and 'fwd_bwd' returns a count (a typo "
        "such as 'fwd+bwd' would be benchmarked with a wrong FLOP count)",
        "raise an error for any other mode, e.g. look the factor up in a dict "
        "(KeyError) or end the if/elif chain with `raise ValueError(...)`",
        lambda batch, heads, n, d, causal=False, mode="fwd": benchmark_flops(
            batch, heads, n, d, causal, "fwd_bwd"
        ),
    )
]


# issue 31, student report 10 (session 11): a lookup of mode.lower()
# accepted 'FWD', a mode the exercise asks to refuse
MODE_MISTAKES.append(
    Mistake(
        "mode_case_folded",
        "a mode spelled in capitals, 'FWD', returns a count: the function "
        "folds the case (mode.lower()) or otherwise accepts a spelling other "
        "than the three modes",
        "accept exactly 'fwd', 'bwd' and 'fwd_bwd', as the benchmark does, "
        "and raise an error for any other string: look mode itself up, "
        "without .lower() or .strip()",
        lambda batch, heads, n, d, causal=False, mode="fwd": benchmark_flops(
            batch, heads, n, d, causal, mode.lower()
        ),
    )
)


# issue 31, student report 10b (session 11): an if/elif chain with no else,
# or a lookup with dict.get, returns None for an unknown mode; the diagnosis
# "returns a count" did not describe it
MODE_MISTAKES.append(
    Mistake(
        "unknown_mode_returns_none",
        "a mode other than 'fwd', 'bwd' and 'fwd_bwd' returns None: the "
        "function falls through its if/elif chain, or looks the factor up "
        "with dict.get, and says nothing (a benchmark that divides by the "
        "count would fail far from the typo)",
        "end the if/elif chain with `raise ValueError(...)`, or index the "
        "dict with m[mode] (KeyError) instead of m.get(mode)",
        lambda batch, heads, n, d, causal=False, mode="fwd": None,
    )
)


# an expert reading (session 12): a lookup of mode.strip() accepted ' fwd'
MODE_MISTAKES.append(
    Mistake(
        "mode_stripped",
        "a mode with a space in it, ' fwd', returns a count: the function "
        "strips the string (mode.strip()) or otherwise accepts a spelling "
        "other than the three modes",
        "accept exactly 'fwd', 'bwd' and 'fwd_bwd', as the benchmark does, "
        "and raise an error for any other string: look mode itself up, "
        "without .strip() or .lower()",
        lambda batch, heads, n, d, causal=False, mode="fwd": benchmark_flops(
            batch, heads, n, d, causal, mode.strip()
        ),
    )
)


def _check_unknown_mode(fn) -> None:
    """Reject a count for a mode that is none of the three."""
    __tracebackhide__ = True
    for mode, name, mistake in (
        (
            "fwd+bwd",
            "forward + backward spelled 'fwd+bwd' (an unknown mode)",
            MODE_MISTAKES[0],
        ),
        (
            "FWD",
            "the forward spelled 'FWD' (an unknown mode)",
            MODE_MISTAKES[1],
        ),
        (
            " fwd",
            "the forward spelled ' fwd', with a space (an unknown mode)",
            MODE_MISTAKES[3],
        ),
    ):
        try:
            got = fn(2, 8, 1024, 64, causal=False, mode=mode)
        except Exception:
            continue
        raise ExerciseError(
            "attention FLOPs",
            name,
            f"your function returned {got!r} instead of raising an error",
            mistake=MODE_MISTAKES[2] if got is None else mistake,
        )


def check_benchmark_flops(fn) -> None:
    """Check ``fn(batch, heads, n, d, causal=False, mode="fwd")``: attention's
    FLOPs by the papers' convention, and an error for an unknown mode."""
    run_checks(
        "attention FLOPs",
        fn,
        flops_cases(),
        benchmark_flops,
        FLOPS_MISTAKES,
        # rtol 1e-6: a count computed in float32 (24-bit significand, a
        # relative rounding of at most 6e-8) is accepted on every case, while
        # the closest wrong counts, n (n + 1) / 2 instead of n^2 / 2 for
        # causal attention (off by 1 / n) and n * n // 2 (off by 1 / n^2 on
        # the odd n = 99), differ by at least 1e-4 on the case that tells them
        compare=lambda a, b: same(
            np.float64(a), np.float64(b), rtol=1e-6, atol=0.0
        ),
        postprocess=float,
        quiet=True,
    )
    _check_unknown_mode(fn)
    print(
        f"Correct: attention FLOPs passes all {len(flops_cases())} cases "
        "and refuses an unknown mode."
    )
