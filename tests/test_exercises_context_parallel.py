"""The checkers of chapter 11 (attention across devices) reject each classic
mistake and pass correct solutions.

The wrong solutions are written here independently of the checkers' Mistake
functions, the way a reader might write them: loops, list comprehensions,
numpy, torch.
"""

import math

import numpy as np
import pytest
import torch

from attnbook.exercises.context_parallel import (
    check_overlap_tokens,
    check_zigzag_positions,
    overlap_cases,
    zigzag_cases,
)

# --- the zigzag map ----------------------------------------------------------


def zigzag_array_split(n, world_size):
    """Correct (the book's solution): np.array_split into 2P chunks, chunk r
    and its mirror 2P - 1 - r."""
    chunks = np.array_split(np.arange(n), 2 * world_size)
    return [
        np.concatenate([chunks[r], chunks[2 * world_size - 1 - r]])
        for r in range(world_size)
    ]


def zigzag_bounds_torch(n, world_size):
    """Correct: chunk boundaries computed by hand, torch, the mirror chunk
    first (order inside a rank is free)."""
    q, m = divmod(n, 2 * world_size)
    starts = [j * q + min(j, m) for j in range(2 * world_size + 1)]

    def chunk(j):
        return torch.arange(starts[j], starts[j + 1], dtype=torch.int32)

    return tuple(
        torch.cat([chunk(2 * world_size - 1 - r), chunk(r)])
        for r in range(world_size)
    )


def zigzag_owner_map(n, world_size):
    """Correct: the chunk of each token, then its owner; lists of ints."""
    chunks = np.array_split(np.arange(n), 2 * world_size)
    owner = {}
    for j, chunk in enumerate(chunks):
        for t in chunk:
            owner[int(t)] = min(j, 2 * world_size - 1 - j)
    return [[t for t in range(n) if owner[t] == r] for r in range(world_size)]


def zigzag_mirror_p(n, world_size):
    # "the mirror of r is P - 1 - r"
    chunks = np.array_split(np.arange(n), 2 * world_size)
    return [
        np.concatenate([chunks[r], chunks[world_size - 1 - r]])
        for r in range(world_size)
    ]


def zigzag_shifted(n, world_size):
    # early chunk r, late chunk P + r
    chunks = np.array_split(np.arange(n), 2 * world_size)
    out = []
    for r in range(world_size):
        out.append(np.hstack((chunks[r], chunks[r + world_size])))
    return out


def zigzag_from_the_middle(n, world_size):
    # numbered outwards from the middle of the sequence
    chunks = np.array_split(np.arange(n), 2 * world_size)
    return [
        np.concatenate([chunks[world_size - 1 - r], chunks[world_size + r]])
        for r in range(world_size)
    ]


def zigzag_halves(n, world_size):
    # "the sequence in P pieces": the contiguous layout
    per = math.ceil(n / world_size)
    sizes = [len(x) for x in np.array_split(np.arange(n), world_size)]
    out, start = [], 0
    for size in sizes:
        out.append(torch.arange(start, start + size))
        start += size
    del per
    return out


def zigzag_round_robin(n, world_size):
    return [list(range(r, n, world_size)) for r in range(world_size)]


def zigzag_floor_chunks(n, world_size):
    size = n // (2 * world_size)
    out = []
    for r in range(world_size):
        first = np.arange(r * size, (r + 1) * size)
        j = 2 * world_size - 1 - r
        out.append(
            np.concatenate([first, np.arange(j * size, (j + 1) * size)])
        )
    return out


def zigzag_last_takes_the_rest(n, world_size):
    """Wrong: equal chunks of n // 2P, the last one stretched to the end
    (issue 31, student report 1112)."""
    size = n // (2 * world_size)
    starts = [j * size for j in range(2 * world_size)] + [n]
    chunks = [
        list(range(starts[j], starts[j + 1])) for j in range(2 * world_size)
    ]
    return [
        np.array(chunks[r] + chunks[2 * world_size - 1 - r], dtype=np.int64)
        for r in range(world_size)
    ]


def zigzag_ceil_chunks(n, world_size):
    size = math.ceil(n / (2 * world_size))
    tokens = np.arange(n)
    chunks = [tokens[j * size : (j + 1) * size] for j in range(2 * world_size)]
    return [
        np.concatenate([chunks[r], chunks[-1 - r]]) for r in range(world_size)
    ]


def zigzag_linspace(n, world_size):
    chunks = np.array_split(np.linspace(0, n - 1, n), 2 * world_size)
    return [
        np.concatenate([chunks[r], chunks[2 * world_size - 1 - r]])
        for r in range(world_size)
    ]


def zigzag_list_then_array(n, world_size):
    chunks = np.array_split(np.arange(n), 2 * world_size)
    return [
        np.array(list(chunks[r]) + list(chunks[2 * world_size - 1 - r]))
        for r in range(world_size)
    ]


def zigzag_uint8(n, world_size):
    """Wrong (student reading stud1112): positions kept in uint8 to save
    memory; they wrap around from 256 tokens on."""
    chunks = np.array_split(np.arange(n), 2 * world_size)
    return [
        np.concatenate([chunks[r], chunks[2 * world_size - 1 - r]]).astype(
            np.uint8
        )
        for r in range(world_size)
    ]


# --- the overlap condition ---------------------------------------------------


def overlap_by_times(peak_flops, link_bits, both, h, n_kv, d, b):
    """Correct: both times per token of c, solved for c."""
    link = link_bits / 8
    if both:
        link /= 2
    # compute(c) = 4 c^2 h d / F; transfer(c) = 2 c n_kv d b / link
    return (2 * n_kv * d * b / link) / (4 * h * d / peak_flops)


def overlap_intensity(peak_flops, link_bits, both, h, n_kv, d, b):
    """Correct: arithmetic intensity per byte sent against the ratio of
    rates (torch scalars)."""
    rates = torch.tensor(peak_flops, dtype=torch.float64) / (
        link_bits / 8 / (2 if both else 1)
    )
    # flops per byte of a block of c tokens: 4 c^2 h d / (2 c n_kv d b)
    per_token = torch.tensor(4 * h * d / (2 * n_kv * d * b))
    return rates / per_token


def overlap_bits(peak_flops, link_bits, both, h, n_kv, d, b):
    link = link_bits / (2 if both else 1)
    return peak_flops * 2 * n_kv * b / (4 * h * link)


def overlap_k_only(peak_flops, link_bits, both, h, n_kv, d, b):
    bandwidth = link_bits / 8 / (2 if both else 1)
    sent = n_kv * d * b  # bytes per token: the keys
    return peak_flops * sent / (4 * h * d * bandwidth)


def overlap_one_flop(peak_flops, link_bits, both, h, n_kv, d, b):
    bandwidth = link_bits / 8 / (2 if both else 1)
    return peak_flops * 2 * n_kv * d * b / (h * d * bandwidth)


def overlap_qk_only(peak_flops, link_bits, both, h, n_kv, d, b):
    bandwidth = link_bits / 8 / (2 if both else 1)
    return np.float64(peak_flops * 2 * n_kv * b / (2 * h * bandwidth))


def overlap_total(peak_flops, link_bits, both, h, n_kv, d, b):
    bandwidth = link_bits / 8
    return peak_flops * 2 * n_kv * d * b / (4 * h * d * bandwidth)


def overlap_flag_inverted(peak_flops, link_bits, both, h, n_kv, d, b):
    """Wrong: the direction flag read the wrong way round (issue 31, student
    report 1112, which got the half-the-flops diagnosis)."""
    bandwidth = link_bits / 8 / (1 if both else 2)
    return peak_flops * 2 * n_kv * d * b / (4 * h * d * bandwidth)


def overlap_mha(peak_flops, link_bits, both, h, n_kv, d, b):
    bandwidth = link_bits / 8 / (2 if both else 1)
    return peak_flops * 2 * h * d * b / (4 * h * d * bandwidth)


def overlap_compute_on_kv_heads(peak_flops, link_bits, both, h, n_kv, d, b):
    """Wrong: the compute counted on the key/value heads (issue 31, expert
    report cp11e, which got a diagnosis that named only the other way of
    losing h_kv / h)."""
    bandwidth = link_bits / 8 / (2 if both else 1)
    compute = 4 * n_kv * d / peak_flops  # times m^2
    return 2 * n_kv * d * b / bandwidth / compute


def overlap_shape_one(peak_flops, link_bits, both, h, n_kv, d, b):
    """Correct: a numpy array of shape (1,)."""
    one_way = np.array([link_bits / 8]) / (2 if both else 1)
    return peak_flops * n_kv * b / (2 * h * one_way)


def overlap_elements(peak_flops, link_bits, both, h, n_kv, d, b):
    bandwidth = link_bits / 8 / (2 if both else 1)
    return peak_flops * 2 * n_kv * d / (4 * h * d * bandwidth)


def overlap_float32(peak_flops, link_bits, both, h, n_kv, d, b):
    """Correct: the same formula in float32 throughout."""
    f = np.float32
    bandwidth = f(link_bits) / f(8) / f(2 if both else 1)
    return f(peak_flops) * f(n_kv) * f(b) / (f(2) * f(h) * bandwidth)


def overlap_multiply_add_as_one(peak_flops, link_bits, both, h, n_kv, d, b):
    """Wrong: both products, but a multiply-add counted as one flop (2 m^2 h
    d flops): the same number as one product only, so the same diagnosis."""
    bandwidth = link_bits / 8 / (2 if both else 1)
    flops_per_m2 = 2 * h * d  # q k^T and P v, m^2 d multiply-adds each
    return (2 * n_kv * d * b / bandwidth) / (flops_per_m2 / peak_flops)


def overlap_causal_half(peak_flops, link_bits, both, h, n_kv, d, b):
    """Wrong: the compute halved as if the step were causal (it has no
    mask)."""
    bandwidth = link_bits / 8 / (2 if both else 1)
    compute = 0.5 * 4 * h * d / peak_flops  # times m^2
    return 2 * n_kv * d * b / bandwidth / compute


def overlap_fraction(peak_flops, link_bits, both, h, n_kv, d, b):
    """Correct: exact, as a Fraction (the float it rounds to is the
    answer)."""
    from fractions import Fraction

    one_way = Fraction(link_bits) / 8 / (2 if both else 1)
    return Fraction(peak_flops) * n_kv * b / (2 * h * one_way)


def overlap_ceil(peak_flops, link_bits, both, h, n_kv, d, b):
    """Wrong: whole tokens, as the package's cost.overlap_tokens counts."""
    bandwidth = link_bits / 8 / (2 if both else 1)
    return math.ceil(peak_flops * n_kv * b / (2 * h * bandwidth))


def overlap_round(peak_flops, link_bits, both, h, n_kv, d, b):
    """Wrong (student reading stud1112): Python's round(), to the nearest
    whole token."""
    bandwidth = link_bits / 8 / (2 if both else 1)
    return round(peak_flops * n_kv * b / (2 * h * bandwidth))


def overlap_int(peak_flops, link_bits, both, h, n_kv, d, b):
    """Wrong (student reading stud1112b): int(), which rounds down."""
    bandwidth = link_bits / 8 / (2 if both else 1)
    return int(peak_flops * n_kv * b / (2 * h * bandwidth))


CATALOGUE = {
    "check_zigzag_positions": {
        "right": [
            zigzag_array_split,
            zigzag_bounds_torch,
            zigzag_owner_map,
        ],
        "wrong": [
            (zigzag_mirror_p, "mirror_off_by_p"),
            (zigzag_shifted, "not_mirrored"),
            (zigzag_from_the_middle, "ranks_reversed"),
            (zigzag_halves, "contiguous"),
            (zigzag_round_robin, "striped"),
            (zigzag_floor_chunks, "remainder_dropped"),
            (zigzag_last_takes_the_rest, "remainder_in_last"),
            (zigzag_ceil_chunks, "ceil_chunks"),
            (zigzag_linspace, "float_positions"),
            (zigzag_list_then_array, "empty_not_integer"),
            (zigzag_uint8, "narrow_integers"),
        ],
    },
    "check_overlap_tokens": {
        "right": [
            overlap_by_times,
            overlap_intensity,
            overlap_float32,
            overlap_fraction,
            overlap_shape_one,
        ],
        "wrong": [
            (overlap_bits, "bits_as_bytes"),
            (overlap_k_only, "k_or_v_only"),
            (overlap_one_flop, "quarter_the_flops"),
            (overlap_qk_only, "half_the_flops"),
            (overlap_multiply_add_as_one, "half_the_flops"),
            (overlap_causal_half, "half_the_flops"),
            (overlap_total, "total_as_one_way"),
            (overlap_flag_inverted, "direction_inverted"),
            (overlap_mha, "same_heads_both_sides"),
            (overlap_compute_on_kv_heads, "same_heads_both_sides"),
            (overlap_elements, "elements_not_bytes"),
            (overlap_ceil, "rounded_up"),
            (overlap_round, "rounded_up"),
            (overlap_int, "rounded_down"),
        ],
    },
}
# The catalogue's solutions are run by tests/test_exercises_framework.py, which
# checks every right one accepted and every wrong one named, for every checker.


def test_the_stubs_are_not_attempted():
    from attnbook.exercises import NotAttemptedError

    def stub(*args):
        raise NotImplementedError

    for checker in (check_zigzag_positions, check_overlap_tokens):
        with pytest.raises(NotAttemptedError):
            checker(stub)


def test_the_checkers_load_from_the_package():
    import attnbook.exercises as exercises

    assert exercises.check_zigzag_positions is check_zigzag_positions
    assert exercises.check_overlap_tokens is check_overlap_tokens


def test_the_zigzag_cases_cover_the_remainders():
    # divisible, n mod 2P below, equal to and above P, and a rank with none
    kinds = set()
    for case in zigzag_cases():
        n, p = case.args
        m = n % (2 * p)
        kinds.add(
            "divisible"
            if m == 0
            else ("below" if m < p else "equal" if m == p else "above")
        )
        if n < p:
            kinds.add("empty rank")
    assert kinds >= {"divisible", "below", "above", "empty rank"}


def test_order_inside_a_rank_is_free():
    def shuffled(n, world_size):
        rng = np.random.default_rng(0)
        return [rng.permutation(p) for p in zigzag_array_split(n, world_size)]

    check_zigzag_positions(shuffled)


def test_a_duplicated_position_is_described():
    from attnbook.exercises import ExerciseError

    def twice(n, world_size):
        out = zigzag_array_split(n, world_size)
        out[0] = np.append(out[0], out[1][:1])
        return out

    with pytest.raises(ExerciseError) as err:
        check_zigzag_positions(twice)
    assert "on more than one rank" in str(err.value)
    assert err.value.mistake is None


def test_a_position_listed_twice_on_one_rank_is_described_as_such():
    # student reading stud1112: every rank listing its positions twice was
    # said to put them "on more than one rank"
    from attnbook.exercises import ExerciseError

    def doubled(n, world_size):
        return [
            np.concatenate([p, p]) for p in zigzag_array_split(n, world_size)
        ]

    with pytest.raises(ExerciseError) as err:
        check_zigzag_positions(doubled)
    assert "on more than one rank" not in str(err.value)
    assert "rank 0 lists positions [0, 1, 2" in str(err.value)
    assert err.value.mistake is None


def test_a_rounded_answer_is_not_said_to_be_rounded_up_only():
    from attnbook.exercises import ExerciseError

    with pytest.raises(ExerciseError) as err:
        check_overlap_tokens(overlap_round)
    assert "round()" in str(err.value)


def test_no_overlap_case_sits_on_a_whole_number():
    # the answer is a threshold, compared to a relative 1e-5: in every case
    # its rounding is told apart from it, and every mistake of a factor
    # changes every case it can change by far more than that
    from attnbook.exercises.context_parallel import (
        OVERLAP_MISTAKES,
        _reference_overlap,
        _same_number,
    )

    for case in overlap_cases():
        right = _reference_overlap(*case.args)
        assert abs(math.ceil(right) / right - 1) > 2e-5
        assert _same_number(np.float32(right), right)
        for mistake in OVERLAP_MISTAKES:
            wrong = mistake.commit(*case.args)
            if mistake.key in ("rounded_up", "rounded_down"):
                assert not _same_number(wrong, right)
                continue
            assert wrong == right or abs(wrong / right - 1) > 0.01


def test_a_rounded_answer_is_told_to_stay_a_float():
    from attnbook.exercises import ExerciseError

    def rounded_down(peak_flops, link_bits, both, h, n_kv, d, b):
        return math.floor(
            overlap_by_times(peak_flops, link_bits, both, h, n_kv, d, b)
        )

    with pytest.raises(ExerciseError) as err:
        check_overlap_tokens(rounded_down)
    assert "unrounded" in str(err.value)
    # int() rounds down too: named, with a diagnosis line like round()'s and
    # math.ceil's (issue 31, student report stud1112b)
    assert err.value.mistake == "rounded_down"
    assert "Diagnosis" in str(err.value)
    with pytest.raises(ExerciseError) as err:
        check_overlap_tokens(overlap_ceil)
    assert err.value.mistake == "rounded_up"


def test_the_first_overlap_case_is_the_h100_over_infiniband():
    from attnbook.distributed.cost import AttentionShape, overlap_tokens

    args = overlap_cases()[0].args
    shape = AttentionShape("case", args[3], args[4], args[5], args[6])
    exact = overlap_by_times(*args)
    assert overlap_tokens(shape, args[0], args[1] / 8) == math.ceil(exact)


def test_half_the_flops_names_every_cause_of_that_number():
    # one product only, a multiply-add counted as one flop and a causal
    # halving all give 2 m^2 h d: the diagnosis must fit each of them
    from attnbook.exercises import ExerciseError

    for wrong in (
        overlap_qk_only,
        overlap_multiply_add_as_one,
        overlap_causal_half,
    ):
        with pytest.raises(ExerciseError) as err:
            check_overlap_tokens(wrong)
        assert err.value.mistake == "half_the_flops"
        text = str(err.value)
        for cause in ("one product", "multiply-add", "causal"):
            assert cause in text, (wrong.__name__, cause)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_nan_or_inf_answer_is_explained(value):
    # before: the checker itself crashed on round(nan) or round(inf) (issue
    # 31, expert report cp11e)
    from attnbook.exercises import ExerciseError

    def broken(peak_flops, link_bits, both, h, n_kv, d, b):
        return np.float64(value)

    with pytest.raises(ExerciseError) as err:
        check_overlap_tokens(broken)
    assert err.value.mistake is None
    assert f"got {value}" in str(err.value)


def test_an_integer_division_that_gives_inf_is_explained():
    from attnbook.exercises import ExerciseError

    def floored(peak_flops, link_bits, both, h, n_kv, d, b):
        one_way = link_bits / 8 / (2 if both else 1)
        compute = 4 * h * d // peak_flops  # 0: integer division
        with np.errstate(divide="ignore"):
            return np.float64(2 * n_kv * d * b / one_way) / compute

    with pytest.raises(ExerciseError) as err:
        check_overlap_tokens(floored)
    assert "division by zero" in str(err.value)


def test_the_same_head_count_names_both_ways_of_losing_grouping():
    from attnbook.exercises import ExerciseError

    for wrong in (overlap_mha, overlap_compute_on_kv_heads):
        with pytest.raises(ExerciseError) as err:
            check_overlap_tokens(wrong)
        assert err.value.mistake == "same_heads_both_sides"
        text = str(err.value)
        assert "sent with the query heads" in text
        assert "compute with the key/value heads" in text
