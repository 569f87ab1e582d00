"""The chapter-10 checkers reject each classic mistake and pass correct
solutions.

The wrong implementations here are written independently of the checkers' own
Mistake functions, the way a reader might write them.
"""

import math

import numpy as np
import pytest

from attnbook.exercises._framework import ExerciseError, NotAttemptedError
from attnbook.exercises.triton_flash import (
    check_benchmark_flops,
    check_key_blocks,
)

# --- causal key blocks -------------------------------------------------------


def blocks_by_loop(n_q, n_k, block_q, block_k):
    """A correct solution written differently: test every key block against
    every row."""
    offset = n_k - n_q
    counts = []
    for start in range(0, n_q, block_q):
        rows = range(start, min(start + block_q, n_q))
        counts.append(
            sum(
                1
                for j0 in range(0, n_k, block_k)
                # some row sees the block's first key
                if any(j0 <= i + offset for i in rows)
            )
        )
    return counts


def blocks_no_skipping(n_q, n_k, block_q, block_k):
    return [math.ceil(n_k / block_k)] * math.ceil(n_q / block_q)


def blocks_strictly_below(n_q, n_k, block_q, block_k):
    # counts only the blocks that the first row sees completely
    return [
        min(b * block_q + n_k - n_q + 1, n_k) // block_k
        for b in range(math.ceil(n_q / block_q))
    ]


def blocks_from_first_row(n_q, n_k, block_q, block_k):
    return [
        math.ceil((b * block_q + n_k - n_q + 1) / block_k)
        for b in range(math.ceil(n_q / block_q))
    ]


def blocks_top_left(n_q, n_k, block_q, block_k):
    return [
        math.ceil(min((b + 1) * block_q, n_k) / block_k)
        for b in range(math.ceil(n_q / block_q))
    ]


def blocks_b_plus_one(n_q, n_k, block_q, block_k):
    return list(range(1, math.ceil(n_q / block_q) + 1))


def blocks_one_too_many(n_q, n_k, block_q, block_k):
    counts = []
    for b in range(math.ceil(n_q / block_q)):
        last = (b + 1) * block_q - 1 + n_k - n_q
        # keys 0..last+1: one key too far
        counts.append(math.ceil(min(last + 2, n_k) / block_k))
    return counts


def blocks_unclamped(n_q, n_k, block_q, block_k):
    # counts the keys up to the block's last row as if every row existed: past
    # n_k on a ragged end
    return [
        math.ceil(((b + 1) * block_q + n_k - n_q) / block_k)
        for b in range(math.ceil(n_q / block_q))
    ]


def test_key_blocks_reference_style_solution_passes(capsys):
    check_key_blocks(blocks_by_loop)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "n_q, n_k, block_q, block_k",
    [
        (256, 256, 64, 64),
        (65, 65, 64, 16),
        (1, 100, 16, 32),
        (20, 77, 32, 16),
        (100, 130, 16, 64),
        (33, 33, 32, 32),
        (65, 192, 32, 64),
        (192, 192, 128, 64),
        (1, 256, 16, 64),
    ],
)
def test_the_reference_counts_the_blocks_the_kernels_load(
    n_q, n_k, block_q, block_k
):
    """The checker's reference (chapter 9's tile schedule, numpy only) against
    the kernels' own host-side bounds
    (attnbook.kernels.host.key_block_bounds)."""
    pytest.importorskip("triton")
    from attnbook.exercises.triton_flash import key_blocks_visited
    from attnbook.kernels.host import key_block_bounds

    kernels = [
        -(
            -key_block_bounds(b, n_q, n_k, block_q, block_k, causal=True)[1]
            // block_k
        )
        for b in range(-(-n_q // block_q))
    ]
    assert key_blocks_visited(n_q, n_k, block_q, block_k).tolist() == kernels


def test_the_checker_loads_without_torch():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['triton'] = "
        "None\n"
        "from attnbook.exercises import check_benchmark_flops, "
        "check_key_blocks; print('loaded')"
    )
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True
        ).stdout
        == "loaded\n"
    )


def test_key_blocks_accepts_numpy_floats():
    check_key_blocks(lambda *a: np.array(blocks_by_loop(*a), dtype=float))


@pytest.mark.parametrize(
    "wrong, key",
    [
        (blocks_no_skipping, "no_skipping"),
        (blocks_strictly_below, "diagonal_missed"),
        (blocks_from_first_row, "first_row"),
        (blocks_top_left, "top_left"),
        (blocks_b_plus_one, "equal_blocks"),
        (blocks_one_too_many, "one_past"),
        (blocks_unclamped, "no_clamp"),
    ],
)
def test_key_block_mistakes_are_diagnosed(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_key_blocks(wrong)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value) and "Hint" in str(err.value)


def test_key_blocks_unknown_error_is_rejected_without_diagnosis():
    with pytest.raises(ExerciseError) as err:
        check_key_blocks(lambda *a: [c + 2 for c in blocks_by_loop(*a)])
    assert err.value.mistake is None


def test_key_blocks_wrong_length_names_the_shape():
    with pytest.raises(ExerciseError, match="expected shape"):
        check_key_blocks(lambda *a: blocks_by_loop(*a)[:-1])


def test_key_blocks_stub_is_not_attempted():
    def stub(n_q, n_k, block_q, block_k):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_key_blocks(stub)


# --- FLOPs -------------------------------------------------------------------


def flops_good(batch, heads, n, d, causal=False, mode="fwd"):
    per_head = 2 * (2 * n * n * d)  # two products, multiply + add
    total = batch * heads * per_head * (0.5 if causal else 1.0)
    return total * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 1.0 + 2.5}[mode]


def flops_causal_full(batch, heads, n, d, causal=False, mode="fwd"):
    return flops_good(batch, heads, n, d, False, mode)


def flops_fma_as_one(batch, heads, n, d, causal=False, mode="fwd"):
    return flops_good(batch, heads, n, d, causal, mode) / 2


def flops_backward_double(batch, heads, n, d, causal=False, mode="fwd"):
    forward = flops_good(batch, heads, n, d, causal, "fwd")
    return forward * {"fwd": 1, "bwd": 2, "fwd_bwd": 3}[mode]


def flops_forgot_forward(batch, heads, n, d, causal=False, mode="fwd"):
    return flops_good(
        batch, heads, n, d, causal, "bwd" if mode == "fwd_bwd" else mode
    )


def flops_swapped(batch, heads, n, d, causal=False, mode="fwd"):
    return flops_good(batch, heads, d, n, causal, mode)


def flops_exact_causal(batch, heads, n, d, causal=False, mode="fwd"):
    # every score on and below the diagonal, exactly
    pairs = n * (n + 1) // 2 if causal else n * n
    return (
        batch
        * heads
        * 4
        * pairs
        * d
        * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]
    )


def test_flops_good_solution_passes(capsys):
    check_benchmark_flops(flops_good)
    assert "Correct" in capsys.readouterr().out


def test_flops_integer_answer_passes():
    check_benchmark_flops(lambda *a, **kw: int(flops_good(*a, **kw)))


@pytest.mark.parametrize(
    "wrong, key",
    [
        (flops_causal_full, "causal_not_halved"),
        (flops_fma_as_one, "half_forward"),
        (flops_backward_double, "backward_two"),
        (flops_forgot_forward, "fwd_bwd_without_fwd"),
        (flops_swapped, "d_squared"),
        (flops_exact_causal, "exact_causal"),
    ],
)
def test_flops_mistakes_are_diagnosed(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_benchmark_flops(wrong)
    assert err.value.mistake == key


def test_flops_unknown_error_is_rejected():
    with pytest.raises(ExerciseError) as err:
        check_benchmark_flops(lambda *a, **kw: 1.01 * flops_good(*a, **kw))
    assert err.value.mistake is None


# --- the catalogue (run by tests/test_exercises_framework.py) ----------------


def blocks_with_offset_in_blocks(n_q, n_k, block_q, block_k):
    # counts as if n_q == n_k, then adds the cache's whole blocks: the offset
    # rounded down to blocks
    return [
        math.ceil(min((b + 1) * block_q, n_q) / block_k)
        + (n_k - n_q) // block_k
        for b in range(math.ceil(n_q / block_q))
    ]


def blocks_numpy(n_q, n_k, block_q, block_k):
    """Correct, vectorised: the last row of each block, offset, clamped, in
    blocks."""
    last = (
        np.minimum(np.arange(block_q, n_q + block_q, block_q), n_q)
        - 1
        + n_k
        - n_q
    )
    return -(-(last + 1) // block_k)


def flops_halved_forward_only(batch, heads, n, d, causal=False, mode="fwd"):
    full = 4 * batch * heads * n * n * d
    if mode == "fwd":
        return full / 2 if causal else full
    # the backward "has no mask"
    return full * (2.5 if mode == "bwd" else 3.5)


def flops_by_products(batch, heads, n, d, causal=False, mode="fwd"):
    """Correct, counted product by product: 2 forward, 5 backward matmuls of 2
    n^2 d FLOPs."""
    products = {"fwd": 2, "bwd": 5, "fwd_bwd": 7}[mode]
    return batch * heads * products * 2 * n * n * d * (0.5 if causal else 1)


def blocks_divided_by_block_q(n_q, n_k, block_q, block_k):
    """The right positions, cut into blocks of the wrong length: block_q."""
    counts = []
    for b in range(math.ceil(n_q / block_q)):
        keys = min((b + 1) * block_q + n_k - n_q, n_k)
        counts.append(math.ceil(keys / block_q))
    return counts


def flops_float32(batch, heads, n, d, causal=False, mode="fwd"):
    """A right count computed in float32 throughout (rounded at every
    step)."""
    f32 = np.float32
    total = f32(4) * f32(batch) * f32(heads) * f32(n) * f32(n) * f32(d)
    if causal:
        total = total / f32(2)
    return total * f32({"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode])


CATALOGUE = {
    "check_key_blocks": {
        "right": [
            blocks_by_loop,
            blocks_numpy,
            lambda *a: [float(c) for c in blocks_by_loop(*a)],
        ],
        "wrong": [
            (blocks_no_skipping, "no_skipping"),
            (blocks_strictly_below, "diagonal_missed"),
            (blocks_from_first_row, "first_row"),
            (blocks_top_left, "top_left"),
            (blocks_b_plus_one, "equal_blocks"),
            (blocks_one_too_many, "one_past"),
            (blocks_unclamped, "no_clamp"),
            (blocks_with_offset_in_blocks, "offset_in_blocks"),
            (blocks_divided_by_block_q, "divide_by_block_q"),
        ],
    },
    "check_benchmark_flops": {
        "right": [
            flops_good,
            flops_by_products,
            lambda *a, **kw: int(flops_good(*a, **kw)),
            flops_float32,
        ],
        "wrong": [
            (flops_causal_full, "causal_not_halved"),
            (flops_fma_as_one, "half_forward"),
            (flops_backward_double, "backward_two"),
            (flops_forgot_forward, "fwd_bwd_without_fwd"),
            (flops_swapped, "d_squared"),
            (flops_exact_causal, "exact_causal"),
            (flops_halved_forward_only, "causal_forward_only"),
        ],
    },
}


# --- from the expert reading of chapter 10 (checker-findings) ----------------


def blocks_clamped_to_n_q(n_q, n_k, block_q, block_k):
    """The offset is included, but the keys are clamped at n_q instead of
    n_k."""
    offset = n_k - n_q
    return [
        -(-min(b * block_q + block_q + offset, n_q) // block_k)
        for b in range(-(-n_q // block_q))
    ]


def flops_seven_products(batch, heads, n, d, causal=False, mode="fwd"):
    """The true arithmetic of the book's backward kernels (7 products), not the
    papers' convention (5)."""
    products = {"fwd": 2, "bwd": 7, "fwd_bwd": 9}[mode]
    return batch * heads * products * 2 * n * n * d * (0.5 if causal else 1)


def flops_causal_quartered(batch, heads, n, d, causal=False, mode="fwd"):
    # "half the rows, half the columns"
    f = 4 * batch * heads * n * n * d / (4 if causal else 1)
    return f * {"fwd": 1, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


def flops_causal_halved_twice(batch, heads, n, d, causal=False, mode="fwd"):
    f = (
        4
        * batch
        * heads
        * n
        * n
        * d
        / (2 if causal else 1)
        * {"fwd": 1, "bwd": 2.5, "fwd_bwd": 3.5}[mode]
    )
    return f / 2 if causal and mode != "fwd" else f


CATALOGUE["check_key_blocks"]["wrong"] += [
    (blocks_clamped_to_n_q, "clamp_to_n_q")
]
CATALOGUE["check_benchmark_flops"]["wrong"] += [
    (flops_seven_products, "backward_seven")
]


@pytest.mark.parametrize(
    "wrong", [flops_causal_quartered, flops_causal_halved_twice]
)
def test_a_causal_slip_is_not_named_as_a_forward_that_passed(wrong):
    """Both pass the non-causal forward (case 1): 'half_forward', which fails
    it, is not their mistake."""
    with pytest.raises(ExerciseError) as err:
        check_benchmark_flops(wrong)
    assert err.value.mistake != "half_forward"


def blocks_last_position(n_q, n_k, block_q, block_k):
    """From the second expert reading of chapter 10: cdiv(min(last, n_k),
    block_k), with `last` the last visible key's position, is one block short
    whenever that position is a multiple of block_k (named since the reading
    gpu10g)."""
    offset = n_k - n_q
    last = [(b + 1) * block_q - 1 + offset for b in range(-(-n_q // block_q))]
    return np.array([-(-min(x, n_k) // block_k) for x in last])


CATALOGUE["check_key_blocks"]["wrong"] += [
    (blocks_last_position, "last_position_as_count")
]


# --- from the third expert reading of chapter 10 -----------------------------


def flops_fwd_bwd_not_halved(batch, heads, n, d, causal=False, mode="fwd"):
    """Halves causal forward and backward, but forgets it for forward +
    backward (the reader's E1)."""
    f = 4 * batch * heads * n * n * d
    if mode == "fwd":
        return f / 2 if causal else f
    if mode == "bwd":
        return 2.5 * f / 2 if causal else 2.5 * f
    return 3.5 * f


def flops_bwd_non_causal_halved(batch, heads, n, d, causal=False, mode="fwd"):
    """Right everywhere except the non-causal backward, which it halves as if
    it were causal."""
    f = flops_good(batch, heads, n, d, causal, mode)
    return f / 2 if mode == "bwd" and not causal else f


CATALOGUE["check_benchmark_flops"]["wrong"] += [
    (flops_fwd_bwd_not_halved, "fwd_bwd_not_halved")
]


def test_causal_fwd_bwd_not_halved_is_rejected_and_named():
    with pytest.raises(ExerciseError) as err:
        check_benchmark_flops(flops_fwd_bwd_not_halved)
    assert err.value.mistake == "fwd_bwd_not_halved"


def test_a_wrong_non_causal_backward_is_rejected():
    with pytest.raises(ExerciseError):
        check_benchmark_flops(flops_bwd_non_causal_halved)


def test_the_flops_cases_cover_every_mode_with_and_without_causal():
    from attnbook.exercises.triton_flash import flops_cases

    covered = {(c.kwargs["causal"], c.kwargs["mode"]) for c in flops_cases()}
    assert {(True, "fwd_bwd"), (False, "bwd")} <= covered


# wrong answers the third reading saw rejected with only the generic hint; each
# now gets its named diagnosis


def blocks_floor(n_q, n_k, block_q, block_k):
    return [
        min((b + 1) * block_q + n_k - n_q, n_k) // block_k
        for b in range(-(-n_q // block_q))
    ]


def blocks_offset_sign_flipped(n_q, n_k, block_q, block_k):
    return [
        -(-min((b + 1) * block_q - 1 + (n_q - n_k) + 1, n_k) // block_k)
        for b in range(-(-n_q // block_q))
    ]


def flops_strictly_below(batch, heads, n, d, causal=False, mode="fwd"):
    scores = n * (n - 1) / 2 if causal else n * n
    return (
        4
        * batch
        * heads
        * scores
        * d
        * {"fwd": 1, "bwd": 2.5, "fwd_bwd": 3.5}[mode]
    )


def flops_in_tflop(batch, heads, n, d, causal=False, mode="fwd"):
    return flops_good(batch, heads, n, d, causal, mode) / 1e12


CATALOGUE["check_key_blocks"]["wrong"] += [
    (blocks_floor, "floor_not_ceil"),
    (blocks_offset_sign_flipped, "offset_reversed"),
]
CATALOGUE["check_benchmark_flops"]["wrong"] += [
    (flops_strictly_below, "causal_strictly_below"),
    (flops_in_tflop, "tflops_not_flops"),
]


@pytest.mark.parametrize(
    "check, wrong, key",
    [
        (check_key_blocks, blocks_floor, "floor_not_ceil"),
        (check_key_blocks, blocks_offset_sign_flipped, "offset_reversed"),
        (check_benchmark_flops, flops_strictly_below, "causal_strictly_below"),
        (check_benchmark_flops, flops_in_tflop, "tflops_not_flops"),
    ],
)
def test_third_reading_mistakes_are_named(check, wrong, key):
    with pytest.raises(ExerciseError) as err:
        check(wrong)
    assert err.value.mistake == key


# --- from the expert reading of chapter 10, session 3 ------------------------
# The checker accepted a count that clamps the last visible key at n_k instead
# of n_k - 1: none of its cases had an overhanging last query block with n_k a
# multiple of block_k. A case that has both replaced the weakest one (n_q = n_k
# = 256, block_q = 64, block_k = 128), so the checker still runs seven.


def blocks_clamped_at_n_k(n_q, n_k, block_q, block_k):
    """The reader's wrong answer: the last visible key clamped at n_k, the key
    past the end."""
    counts = []
    for b in range(math.ceil(n_q / block_q)):
        last = (b + 1) * block_q - 1 + n_k - n_q
        counts.append(min(last, n_k) // block_k + 1)
    return counts


def blocks_capped_at_whole_blocks(n_q, n_k, block_q, block_k):
    """Caps the count at n_k // block_k: forgets the ragged last key block."""
    return [
        min(
            math.ceil(((b + 1) * block_q + n_k - n_q) / block_k),
            n_k // block_k,
        )
        for b in range(math.ceil(n_q / block_q))
    ]


def blocks_first_row_plus_width(n_q, n_k, block_q, block_k):
    """The first row's key block, plus as many blocks as the query block is
    wide."""
    total = math.ceil(n_k / block_k)
    return [
        min(
            (b * block_q + n_k - n_q) // block_k
            + math.ceil(block_q / block_k),
            total,
        )
        for b in range(math.ceil(n_q / block_q))
    ]


def blocks_offset_in_query_blocks(n_q, n_k, block_q, block_k):
    """Rounds the cache offset down to whole query blocks (reader chk-ch10's
    E3: it was named first_row_plus_width)."""
    return [
        math.ceil(
            min((b + 1 + (n_k - n_q) // block_q) * block_q, n_k) / block_k
        )
        for b in range(math.ceil(n_q / block_q))
    ]


def blocks_as_generator(n_q, n_k, block_q, block_k):
    """Correct, but returned as a generator."""
    offset = n_k - n_q
    return (
        math.ceil(min((b + 1) * block_q + offset, n_k) / block_k)
        for b in range(math.ceil(n_q / block_q))
    )


CATALOGUE["check_key_blocks"]["wrong"] += [
    (blocks_clamped_at_n_k, "clamp_at_n_k"),
    (blocks_capped_at_whole_blocks, "cap_drops_ragged"),
    (blocks_first_row_plus_width, "first_row_plus_width"),
    (blocks_offset_in_query_blocks, "offset_in_query_blocks"),
]
CATALOGUE["check_key_blocks"]["right"] += [blocks_as_generator]


@pytest.mark.parametrize(
    "n_q, n_k, block_q, block_k, right, wrong",
    [
        (1, 64, 16, 64, [1], [2]),
        (1, 256, 16, 64, [4], [5]),
        (192, 192, 128, 64, [2, 3], [2, 4]),
    ],
)
def test_clamping_at_n_k_is_one_block_too_many_where_the_reader_found_it(
    n_q, n_k, block_q, block_k, right, wrong
):
    from attnbook.exercises.triton_flash import key_blocks_visited

    assert (
        key_blocks_visited(n_q, n_k, block_q, block_k).tolist()
        == blocks_by_loop(n_q, n_k, block_q, block_k)
        == right
    )
    assert blocks_clamped_at_n_k(n_q, n_k, block_q, block_k) == wrong


@pytest.mark.parametrize(
    "wrong, key",
    [
        (blocks_clamped_at_n_k, "clamp_at_n_k"),
        (blocks_capped_at_whole_blocks, "cap_drops_ragged"),
        (blocks_first_row_plus_width, "first_row_plus_width"),
    ],
)
def test_session_3_mistakes_are_named(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_key_blocks(wrong)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value) and "Hint" in str(err.value)


def test_a_right_count_returned_as_a_generator_is_accepted(capsys):
    check_key_blocks(blocks_as_generator)
    assert capsys.readouterr().out.startswith(
        "Correct: causal key blocks passes all 8 cases."
    )


def test_a_case_hangs_past_the_end_with_n_k_a_multiple_of_block_k():
    from attnbook.exercises.triton_flash import block_count_cases

    assert any(
        -(-n_q // block_q) * block_q > n_q and n_k % block_k == 0
        for n_q, n_k, block_q, block_k in (c.args for c in block_count_cases())
    )


# --- from the expert reading of chapter 10, session 4 ------------------------
# A count rounded to the nearest block instead of up was rejected with the
# diagnosis "first_row_plus_width", which coincides with it on the failing case
# (65/192/32/64) and on case 5, though not on cases 4 and 7, where the reader
# is wrong too: now it has a mistake of its own.


def blocks_rounded(n_q, n_k, block_q, block_k):
    """The reader's wrong answer: the keys to cover rounded to the nearest
    block (Python's round)."""
    return [
        round(min((b + 1) * block_q + n_k - n_q, n_k) / block_k)
        for b in range(math.ceil(n_q / block_q))
    ]


def blocks_rounded_half_up(n_q, n_k, block_q, block_k):
    """The same, rounding half up: floor(x + 0.5)."""
    return [
        math.floor(min((b + 1) * block_q + n_k - n_q, n_k) / block_k + 0.5)
        for b in range(math.ceil(n_q / block_q))
    ]


CATALOGUE["check_key_blocks"]["wrong"] += [
    (blocks_rounded, "round_not_ceil"),
    (blocks_rounded_half_up, "round_not_ceil"),
]


@pytest.mark.parametrize("wrong", [blocks_rounded, blocks_rounded_half_up])
def test_rounding_to_the_nearest_block_is_named(wrong):
    with pytest.raises(ExerciseError) as err:
        check_key_blocks(wrong)
    assert err.value.mistake == "round_not_ceil"
    assert "nearest block" in str(err.value)


def test_no_case_puts_the_keys_to_cover_at_half_a_block():
    """Where it did, Python's round (half to even) and rounding half up would
    differ, and one of them would lose its diagnosis."""
    from attnbook.exercises.triton_flash import block_count_cases

    for n_q, n_k, block_q, block_k in (c.args for c in block_count_cases()):
        for b in range(math.ceil(n_q / block_q)):
            keys = min((b + 1) * block_q + n_k - n_q, n_k)
            assert 2 * keys % (2 * block_k) != block_k


# --- from the fifth expert reading of chapter 10 (snap-k) --------------------


def test_dividing_by_block_q_is_named_and_b_plus_one_still_is():
    """On 256/256/128/64 both give query block b b + 1 key blocks; the other
    cases tell them apart, and each is named as itself."""
    for wrong, key in (
        (blocks_divided_by_block_q, "divide_by_block_q"),
        (blocks_b_plus_one, "equal_blocks"),
    ):
        with pytest.raises(ExerciseError) as err:
            check_key_blocks(wrong)
        assert err.value.mistake == key


def test_a_right_float32_count_is_accepted_where_float32_rounds_it(capsys):
    """One case's count is not a float32 number, so the float32 answer is
    off by its rounding there; a relative tolerance of 1e-9 rejected it."""
    from attnbook.cost import benchmark_flops
    from attnbook.exercises.triton_flash import flops_cases

    inexact = [
        c
        for c in flops_cases()
        if float(flops_float32(*c.args, **c.kwargs))
        != benchmark_flops(*c.args, **c.kwargs)
    ]
    assert inexact
    check_benchmark_flops(flops_float32)
    assert "Correct" in capsys.readouterr().out


# --- from the expert reading of chapter 10 (snap-s) --------------------------
# Counting only the key blocks that the diagonal cuts (the masked ones) was
# rejected with the generic hint; now it is named.


def blocks_masked_only(n_q, n_k, block_q, block_k):
    """The reader's wrong answer: per query block, the key blocks up to the
    last row's last key, less those that every row sees whole."""
    counts = []
    for b in range(math.ceil(n_q / block_q)):
        first = b * block_q + n_k - n_q
        whole = min(first + 1, n_k) // block_k
        last = math.ceil(min(first + block_q, n_k) / block_k)
        counts.append(last - whole)
    return counts


def blocks_cut_by_the_mask(n_q, n_k, block_q, block_k):
    """The same mistake from the causal mask: a key block counts when some
    of the block's rows see some of its keys but not all of them."""
    mask = np.tril(np.ones((n_q, n_k), dtype=bool), k=n_k - n_q)
    counts = []
    for b in range(math.ceil(n_q / block_q)):
        rows = mask[b * block_q : (b + 1) * block_q]
        counts.append(
            sum(
                1
                for j in range(0, n_k, block_k)
                if rows[:, j : j + block_k].any()
                and not rows[:, j : j + block_k].all()
            )
        )
    return counts


CATALOGUE["check_key_blocks"]["wrong"] += [
    (blocks_masked_only, "diagonal_only"),
    (blocks_cut_by_the_mask, "diagonal_only"),
]


@pytest.mark.parametrize("wrong", [blocks_masked_only, blocks_cut_by_the_mask])
def test_counting_only_the_diagonal_blocks_is_named(wrong):
    with pytest.raises(ExerciseError) as err:
        check_key_blocks(wrong)
    assert err.value.mistake == "diagonal_only"
    assert "fully visible to every row" in str(err.value)


# --- from the expert reading of chapter 10 (snap-t2) -------------------------
# Rounding down and then capping the count at the key blocks that exist was
# named as the cache offset counted in whole blocks: the cap makes it right on
# the ragged cases where plain rounding down is wrong, so floor_not_ceil was
# ruled out and offset_in_blocks, which agrees there, was named. Counting the
# softmax's exponentials got only the generic hint.


def blocks_floor_capped(n_q, n_k, block_q, block_k):
    """The reader's wrong answer: the keys to cover rounded down, the count
    then capped at the number of key blocks."""
    return [
        min(
            ((b + 1) * block_q + n_k - n_q) // block_k,
            math.ceil(n_k / block_k),
        )
        for b in range(math.ceil(n_q / block_q))
    ]


def flops_with_exponentials(batch, heads, n, d, causal=False, mode="fwd"):
    """The products and one FLOP per exponential (a score each)."""
    forward = batch * heads * (4 * n * n * d + n * n)
    forward = forward * (0.5 if causal else 1.0)
    return forward * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


CATALOGUE["check_key_blocks"]["wrong"] += [
    (blocks_floor_capped, "floor_not_ceil")
]
CATALOGUE["check_benchmark_flops"]["wrong"] += [
    (flops_with_exponentials, "exponentials_counted")
]


def test_rounding_down_then_capping_is_named_as_rounding_down():
    with pytest.raises(ExerciseError) as err:
        check_key_blocks(blocks_floor_capped)
    assert err.value.mistake == "floor_not_ceil", str(err.value)
    assert "rounding down" in str(err.value)
    assert "offset" not in str(err.value).split("Diagnosis")[1]


def test_counting_the_exponentials_is_named():
    with pytest.raises(ExerciseError) as err:
        check_benchmark_flops(flops_with_exponentials)
    assert err.value.mistake == "exponentials_counted", str(err.value)


# --- from the student reading of chapters 9 and 10 (issue 31) ----------------
# A count for any mode string it did not recognise (here the forward +
# backward) passed: the checker never called a mode other than the three.


def flops_any_mode(batch, heads, n, d, causal=False, mode="fwd"):
    """The reader's gap: every unrecognised mode, a typo included, is counted
    as forward + backward."""
    f = 4 * batch * heads * n * n * d / (2 if causal else 1)
    if mode == "fwd":
        return f
    if mode == "bwd":
        return 2.5 * f
    return 3.5 * f


def flops_raising_value_error(batch, heads, n, d, causal=False, mode="fwd"):
    """Right, with an explicit ValueError for an unknown mode."""
    factors = {"fwd": 1, "bwd": 2.5, "fwd_bwd": 3.5}
    if mode not in factors:
        raise ValueError(f"unknown mode {mode!r}")
    return 4 * batch * heads * n * n * d / (1 + causal) * factors[mode]


CATALOGUE["check_benchmark_flops"]["wrong"] += [
    (flops_any_mode, "unknown_mode_accepted")
]
CATALOGUE["check_benchmark_flops"]["right"] += [flops_raising_value_error]


def test_an_unknown_mode_counted_is_rejected_and_named():
    with pytest.raises(ExerciseError) as err:
        check_benchmark_flops(flops_any_mode)
    assert err.value.mistake == "unknown_mode_accepted"
    assert "fwd+bwd" in str(err.value)


def test_the_success_line_says_an_unknown_mode_is_refused(capsys):
    check_benchmark_flops(flops_raising_value_error)
    out = capsys.readouterr().out
    assert "passes all 7 cases and refuses an unknown mode" in out


# --- issue 31, student report 10 (session 11) --------------------------------


def blocks_floor_plus_one(n_q, n_k, block_q, block_k):
    """The rounding up written as floor + 1 (the student's first try)."""
    counts = []
    for b in range(-(-n_q // block_q)):
        end = min((b + 1) * block_q + n_k - n_q, n_k)
        counts.append(end // block_k + 1)
    return counts


def blocks_whole_query_blocks_only(n_q, n_k, block_q, block_k):
    """Right counts, but for n_q // block_q query blocks: a ragged last query
    block gets no entry."""
    return [
        -(-min((b + 1) * block_q + n_k - n_q, n_k) // block_k)
        for b in range(n_q // block_q)
    ]


def flops_case_folded(batch, heads, n, d, causal=False, mode="fwd"):
    """Right for the three modes, but 'FWD' is counted too."""
    factor = {"fwd": 1, "bwd": 2.5, "fwd_bwd": 3.5}[mode.lower()]
    return 4 * batch * heads * n * n * d / (2 if causal else 1) * factor


CATALOGUE["check_key_blocks"]["wrong"] += [
    (blocks_floor_plus_one, "floor_plus_one"),
    (blocks_whole_query_blocks_only, "query_blocks_floor"),
]
CATALOGUE["check_benchmark_flops"]["wrong"] += [
    (flops_case_folded, "mode_case_folded")
]


@pytest.mark.parametrize(
    "wrong, key",
    [
        (blocks_floor_plus_one, "floor_plus_one"),
        (blocks_whole_query_blocks_only, "query_blocks_floor"),
    ],
)
def test_student_10_block_count_slips_are_named(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_key_blocks(wrong)
    assert err.value.mistake == key


def test_a_case_folded_mode_is_refused_and_named():
    with pytest.raises(ExerciseError) as err:
        check_benchmark_flops(flops_case_folded)
    assert err.value.mistake == "mode_case_folded"
    assert "FWD" in str(err.value)


# --- issue 31, student report 10b (session 11) -------------------------------


def flops_none_for_unknown_mode(batch, heads, n, d, causal=False, mode="fwd"):
    """The student's version: an unknown mode returns None, not an error."""
    factor = {"fwd": 1, "bwd": 2.5, "fwd_bwd": 3.5}.get(mode)
    if factor is None:
        return None
    return 4 * batch * heads * n * n * d * (0.5 if causal else 1) * factor


CATALOGUE["check_benchmark_flops"]["wrong"] += [
    (flops_none_for_unknown_mode, "unknown_mode_returns_none")
]


def test_an_unknown_mode_returning_none_is_named_as_such():
    with pytest.raises(ExerciseError) as err:
        check_benchmark_flops(flops_none_for_unknown_mode)
    assert err.value.mistake == "unknown_mode_returns_none"
    assert "returned None" in str(err.value)
    assert "returns a count" not in str(err.value)


# --- issue 31, student report s12i (session 12) ------------------------------
# Two shortcuts from the first row's key block got the generic hint: adding
# block_q // block_k blocks (rounded down, so nothing when block_q < block_k),
# and the first row's count plus that many, unclamped.


def blocks_first_row_plus_floor_width(n_q, n_k, block_q, block_k):
    """The student's probe: the first row's key block, plus block_q //
    block_k more, capped at the key blocks that exist."""
    total = math.ceil(n_k / block_k)
    return [
        min((b * block_q + n_k - n_q) // block_k + block_q // block_k, total)
        for b in range(math.ceil(n_q / block_q))
    ]


def blocks_first_row_count_plus_width(n_q, n_k, block_q, block_k):
    """The first row sees blocks 0 .. its own; the block adds block_q //
    block_k more."""
    counts = []
    for b in range(math.ceil(n_q / block_q)):
        first = b * block_q + n_k - n_q
        counts.append(first // block_k + 1 + block_q // block_k)
    return counts


S12I_BLOCK_SLIPS = [
    (blocks_first_row_plus_floor_width, "first_row_plus_floor_width"),
    (blocks_first_row_count_plus_width, "first_row_count_plus_width"),
]
CATALOGUE["check_key_blocks"]["wrong"] += S12I_BLOCK_SLIPS


@pytest.mark.parametrize(
    "wrong, key", S12I_BLOCK_SLIPS, ids=[k for _, k in S12I_BLOCK_SLIPS]
)
def test_s12i_first_row_shortcuts_are_named(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_key_blocks(wrong)
    assert err.value.mistake == key
    assert "compare your steps" not in str(err.value)


# --- expert reading y10gpu ---------------------------------------------------
# An integer count that floors n^2 / 2 for an odd n was rejected on the case
# n = 999 by a 0.2 % margin, with the generic hint; the odd case is now
# n = 99, where the floor is off by 1e-4, a hundred times the tolerance.


def flops_pairs_floored(batch, heads, n, d, causal=False, mode="fwd"):
    """The reader's integer count: the causal score pairs as n * n // 2."""
    products = {"fwd": 2, "bwd": 5, "fwd_bwd": 7}[mode]
    pairs = n * n // 2 if causal else n * n
    return 2 * products * batch * heads * d * pairs


def flops_integer_exact(batch, heads, n, d, causal=False, mode="fwd"):
    """Right, in integers: the whole even product halved, as FlashAttention
    2's benchmark script does."""
    forward = 4 * batch * heads * n * n * d // (2 if causal else 1)
    return {
        "fwd": forward,
        "bwd": forward * 5 // 2,
        "fwd_bwd": forward * 7 // 2,
    }[mode]


CATALOGUE["check_benchmark_flops"]["wrong"] += [
    (flops_pairs_floored, "causal_floored")
]
CATALOGUE["check_benchmark_flops"]["right"] += [flops_integer_exact]


def test_flooring_odd_n_squared_is_named_far_from_the_tolerance():
    from attnbook.cost import benchmark_flops
    from attnbook.exercises.triton_flash import flops_cases

    # the odd case tells the floor by far more than the rtol of 1e-6
    gaps = [
        abs(flops_pairs_floored(*c.args, **c.kwargs) - ref) / ref
        for c in flops_cases()
        if (ref := benchmark_flops(*c.args, **c.kwargs))
    ]
    assert max(gaps) > 50e-6
    with pytest.raises(ExerciseError) as err:
        check_benchmark_flops(flops_pairs_floored)
    assert err.value.mistake == "causal_floored", str(err.value)


# --- an expert reading (session 12): mode.strip() accepted ' fwd' ------------


def flops_stripped(batch, heads, n, d, causal=False, mode="fwd"):
    """Right for the three modes, but ' fwd' is counted too."""
    factor = {"fwd": 1, "bwd": 2.5, "fwd_bwd": 3.5}[mode.strip()]
    return 4 * batch * heads * n * n * d * (0.5 if causal else 1) * factor


CATALOGUE["check_benchmark_flops"]["wrong"] += [
    (flops_stripped, "mode_stripped")
]


def test_a_stripped_mode_is_refused_and_named():
    with pytest.raises(ExerciseError) as err:
        check_benchmark_flops(flops_stripped)
    assert err.value.mistake == "mode_stripped"
    assert "' fwd'" in str(err.value)
