"""The grouped-query attention checkers reject each classic mistake and pass
correct solutions.

The wrong solutions are written here independently of the checkers' Mistake
functions, the way a reader might write them: index lists, loops over heads,
torch.cat, einops-style reshapes.
"""

import pytest
import torch
import numpy as np

from attnbook.exercises import ExerciseError, NotAttemptedError
from attnbook.exercises.gqa import check_pool_kv_heads, check_share_kv_heads


# --- sharing key/value heads -------------------------------------------------


def share_by_index(x, n_heads):
    """Correct: gather head j // g for each query head j."""
    g = n_heads // x.shape[1]
    return x[:, [j // g for j in range(n_heads)]]


def share_by_loop(x, n_heads):
    """Correct: concatenate g copies of each head, head by head."""
    g = n_heads // x.shape[1]
    return torch.cat(
        [x[:, i : i + 1] for i in range(x.shape[1]) for _ in range(g)], dim=1
    )


def share_tiled(x, n_heads):
    """Wrong order: the whole stack of heads g times over (query head j gets
    head j % n_kv)."""
    g = n_heads // x.shape[1]
    return torch.cat([x] * g, dim=1)


def share_modulo_index(x, n_heads):
    """Wrong order, written as an index list."""
    return x[:, [j % x.shape[1] for j in range(n_heads)]]


def share_n_heads_copies(x, n_heads):
    """Wrong group size: copies each head n_heads times."""
    return torch.cat(
        [
            x[:, i : i + 1].expand(-1, n_heads, -1, -1)
            for i in range(x.shape[1])
        ],
        dim=1,
    )


def share_positions(x, n_heads):
    """Wrong axis: every position copied g times in place."""
    g = n_heads // x.shape[1]
    return torch.stack([x] * g, dim=3).flatten(2, 3)


def share_scrambled(x, n_heads):
    """Copies inserted after the positions, then reshaped: positions leak into
    heads."""
    b, n_kv_heads, n, d = x.shape
    g = n_heads // n_kv_heads
    return torch.stack([x] * g, dim=3).reshape(b, n_heads, n, d)


def share_only_head_zero(x, n_heads):
    """Every query head gets key/value head 0."""
    return torch.cat([x[:, 0:1]] * n_heads, dim=1)


def share_divided_by_g(x, n_heads):
    """Splits each key/value head among its g query heads, as if sharing
    divided it."""
    g = n_heads // x.shape[1]
    return torch.cat(
        [x[:, i : i + 1] / g for i in range(x.shape[1]) for _ in range(g)],
        dim=1,
    )


def share_one_copy_too_many(x, n_heads):
    """Off by one: g + 1 copies of each head, from an index list."""
    g = n_heads // x.shape[1]
    return x[:, [i for i in range(x.shape[1]) for _ in range(g + 1)]]


def share_one_copy_too_few(x, n_heads):
    """Off by one: g - 1 copies of each head (range(1, g))."""
    g = n_heads // x.shape[1]
    return torch.cat(
        [x[:, i : i + 1] for i in range(x.shape[1]) for _ in range(1, g)],
        dim=1,
    )


def share_last_axis(x, n_heads):
    """Copies stacked on a new last axis, then reshaped: features and positions
    leak into heads."""
    b, n_kv_heads, n, d = x.shape
    return torch.stack([x] * (n_heads // n_kv_heads), dim=-1).reshape(
        b, n_heads, n, d
    )


def share_stub(x, n_heads):
    raise NotImplementedError


@pytest.mark.parametrize("fn", [share_by_index, share_by_loop])
def test_share_correct_solutions_pass(fn, capsys):
    check_share_kv_heads(fn)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "fn, key",
    [
        (share_tiled, "wrong_order"),
        (share_modulo_index, "wrong_order"),
        (share_n_heads_copies, "wrong_group_size"),
        (share_positions, "wrong_axis"),
        (share_scrambled, "scrambled"),
        (share_only_head_zero, "first_head_only"),
        (share_divided_by_g, "divided_by_g"),
        (share_one_copy_too_many, "group_size_off_by_one"),
        (share_one_copy_too_few, "group_size_off_by_one"),
        (share_last_axis, "scrambled_features"),
    ],
)
def test_share_mistakes_are_diagnosed(fn, key):
    with pytest.raises(ExerciseError) as err:
        check_share_kv_heads(fn)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value)


def test_share_stub_is_not_attempted():
    with pytest.raises(NotAttemptedError):
        check_share_kv_heads(share_stub)


def test_share_unknown_mistake_gets_generic_hint():
    with pytest.raises(ExerciseError) as err:
        check_share_kv_heads(lambda x, n_heads: 2 * share_by_index(x, n_heads))
    assert err.value.mistake is None


# --- pooling key/value heads -------------------------------------------------


def pool_by_loop(w, n_heads, n_kv_heads):
    """Correct: average each group's row blocks, one group at a time."""
    d_head, g = w.shape[0] // n_heads, n_heads // n_kv_heads
    blocks = []
    for i in range(n_kv_heads):
        members = [
            w[(i * g + m) * d_head : (i * g + m + 1) * d_head]
            for m in range(g)
        ]
        blocks.append(sum(members) / g)
    return torch.cat(blocks)


def pool_by_view(w, n_heads, n_kv_heads):
    """Correct: one reshape and a mean."""
    g = n_heads // n_kv_heads
    return w.view(n_kv_heads, g, -1, *w.shape[1:]).mean(1).flatten(0, 1)


def pool_strided(w, n_heads, n_kv_heads):
    """Wrong order: group i collects heads i, i + n_kv, i + 2 n_kv, ..."""
    d_head = w.shape[0] // n_heads
    heads = [w[j * d_head : (j + 1) * d_head] for j in range(n_heads)]
    return torch.cat(
        [torch.stack(heads[i::n_kv_heads]).mean(0) for i in range(n_kv_heads)]
    )


def pool_first(w, n_heads, n_kv_heads):
    """Keeps the first head of each group."""
    d_head, g = w.shape[0] // n_heads, n_heads // n_kv_heads
    return torch.cat(
        [w[i * g * d_head : (i * g + 1) * d_head] for i in range(n_kv_heads)]
    )


def pool_sum(w, n_heads, n_kv_heads):
    """Sums the group instead of averaging it."""
    d_head, g = w.shape[0] // n_heads, n_heads // n_kv_heads
    return torch.cat(
        [
            w[i * g * d_head : (i + 1) * g * d_head]
            .view(g, d_head, *w.shape[1:])
            .sum(0)
            for i in range(n_kv_heads)
        ]
    )


def pool_features_mixed(w, n_heads, n_kv_heads):
    """Averages g consecutive rows: the head and feature indices are
    confused."""
    g = n_heads // n_kv_heads
    return w.reshape(-1, g, *w.shape[1:]).mean(1)


def pool_all_heads(w, n_heads, n_kv_heads):
    """One global mean: every head of the layer averaged into one block."""
    d_head = w.shape[0] // n_heads
    return (
        sum(w[j * d_head : (j + 1) * d_head] for j in range(n_heads)) / n_heads
    )


def pool_all_heads_tiled(w, n_heads, n_kv_heads):
    """One global mean, copied to every key/value head so that the shape is
    right."""
    return pool_all_heads(w, n_heads, n_kv_heads).repeat(
        n_kv_heads, *[1] * (w.dim() - 1)
    )


def pool_max(w, n_heads, n_kv_heads):
    """Takes each group's elementwise maximum."""
    d_head, g = w.shape[0] // n_heads, n_heads // n_kv_heads
    return torch.cat(
        [
            torch.stack(
                [
                    w[(i * g + m) * d_head : (i * g + m + 1) * d_head]
                    for m in range(g)
                ]
            )
            .max(0)
            .values
            for i in range(n_kv_heads)
        ]
    )


@pytest.mark.parametrize("fn", [pool_by_loop, pool_by_view])
def test_pool_correct_solutions_pass(fn, capsys):
    check_pool_kv_heads(fn)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "fn, key",
    [
        (pool_strided, "wrong_order"),
        (pool_first, "first_head"),
        (pool_sum, "summed"),
        (pool_features_mixed, "mixed_features"),
        (pool_all_heads, "global_mean"),
        (pool_all_heads_tiled, "global_mean"),
        (pool_max, "max"),
    ],
)
def test_pool_mistakes_are_diagnosed(fn, key):
    with pytest.raises(ExerciseError) as err:
        check_pool_kv_heads(fn)
    assert err.value.mistake == key


def test_pool_stub_is_not_attempted():
    def stub(w, n_heads, n_kv_heads):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_pool_kv_heads(stub)


# --- the catalogue (run by tests/test_exercises_framework.py) ----------------


def share_einsum_style(x, n_heads):
    """Correct: a one-hot (n_heads, n_kv_heads) matrix picks head j // g for
    query head j."""
    g = n_heads // x.shape[1]
    pick = torch.zeros(n_heads, x.shape[1], dtype=x.dtype)
    pick[torch.arange(n_heads), torch.arange(n_heads) // g] = 1
    return torch.einsum("hk,bknd->bhnd", pick, x)


def share_through_numpy(x, n_heads):
    """Copies each head with numpy's repeat and returns the numpy array."""
    return x.numpy().repeat(n_heads // x.shape[1], axis=1)


def share_by_repeat_interleave(x, n_heads):
    """Correct: torch's repeat_interleave along the head axis."""
    return x.repeat_interleave(n_heads // x.shape[1], dim=1)


def pool_float32(w, n_heads, n_kv_heads):
    """Correct, in float32 and through numpy, back in torch at the end."""
    import numpy as np

    a = w.numpy().astype(np.float32)
    g = n_heads // n_kv_heads
    return torch.from_numpy(
        a.reshape(n_kv_heads, g, a.shape[0] // n_heads, *a.shape[1:])
        .mean(axis=1)
        .reshape(-1, *a.shape[1:])
    )


def pool_numpy_result(w, n_heads, n_kv_heads):
    """Wrong (numpy_result): the right mean, left as a numpy array, which
    Parameter.copy_ refuses (expert reading gqa12e)."""
    a = w.numpy()
    g = n_heads // n_kv_heads
    return (
        a.reshape(n_kv_heads, g, a.shape[0] // n_heads, *a.shape[1:])
        .mean(axis=1)
        .reshape(-1, *a.shape[1:])
    )


def pool_no_division(w, n_heads, n_kv_heads):
    """Sums by a loop, forgetting to divide."""
    d = w.shape[0] // n_heads
    g = n_heads // n_kv_heads
    return torch.cat(
        [
            sum(w[(i * g + r) * d : (i * g + r + 1) * d] for r in range(g))
            for i in range(n_kv_heads)
        ]
    )


CATALOGUE = {
    "check_share_kv_heads": {
        "right": [
            share_by_index,
            share_by_loop,
            share_einsum_style,
            share_by_repeat_interleave,
        ],
        "wrong": [
            (share_tiled, "wrong_order"),
            (share_modulo_index, "wrong_order"),
            (share_n_heads_copies, "wrong_group_size"),
            (share_positions, "wrong_axis"),
            (share_scrambled, "scrambled"),
            (share_only_head_zero, "first_head_only"),
            (share_divided_by_g, "divided_by_g"),
            (share_one_copy_too_many, "group_size_off_by_one"),
            (share_one_copy_too_few, "group_size_off_by_one"),
            (share_last_axis, "scrambled_features"),
            (share_through_numpy, "numpy_result"),
        ],
    },
    "check_pool_kv_heads": {
        "right": [pool_by_loop, pool_by_view, pool_float32],
        "wrong": [
            (pool_strided, "wrong_order"),
            (pool_first, "first_head"),
            (pool_sum, "summed"),
            (pool_features_mixed, "mixed_features"),
            (pool_no_division, "summed"),
            (pool_all_heads, "global_mean"),
            (pool_all_heads_tiled, "global_mean"),
            (pool_max, "max"),
            (pool_numpy_result, "numpy_result"),
        ],
    },
}


# --- from the expert reading of chapter 12 (checker-findings) ----------------


def pool_last(weight, n_heads, n_kv_heads):
    g, d_head = n_heads // n_kv_heads, weight.shape[0] // n_heads
    return weight.reshape(n_kv_heads, g, d_head, *weight.shape[1:])[
        :, -1
    ].reshape(-1, *weight.shape[1:])


def pool_median(weight, n_heads, n_kv_heads):
    g, d_head = n_heads // n_kv_heads, weight.shape[0] // n_heads
    grouped = weight.reshape(n_kv_heads, g, d_head, *weight.shape[1:]).numpy()
    return np.median(grouped, axis=1).reshape(-1, *weight.shape[1:])


def pool_in_place_division(weight, n_heads, n_kv_heads):
    """Right values, and divides the caller's weight in place."""
    g, d_head = n_heads // n_kv_heads, weight.shape[0] // n_heads
    weight /= g
    return (
        weight.reshape(n_kv_heads, g, d_head, *weight.shape[1:])
        .sum(1)
        .reshape(-1, *weight.shape[1:])
    )


def pool_first_overwriting_input(weight, n_heads, n_kv_heads):
    """Wrong (the first head), and overwrites the input so that each group's
    heads equal the first."""
    g, d_head = n_heads // n_kv_heads, weight.shape[0] // n_heads
    grouped = weight.view(n_kv_heads, g, d_head, *weight.shape[1:])
    grouped[:, 1:] = grouped[:, :1]
    return grouped.mean(1).reshape(-1, *weight.shape[1:])


CATALOGUE["check_pool_kv_heads"]["wrong"] += [
    (pool_last, "last_head"),
    (pool_median, "median"),
    (pool_first_overwriting_input, "first_head"),
]
CATALOGUE["check_pool_kv_heads"]["right"] += [pool_in_place_division]


# --- from the third reading of chapter 12 (session 3) ------------------------


def share_tiled_positions(x, n_heads):
    """Wrong axis, tiled: the whole sequence of positions g times over
    (x.repeat along dim 2)."""
    return x.repeat(1, 1, n_heads // x.shape[1], 1)


def share_expand_flatten_positions(x, n_heads):
    """Wrong axis, tiled: the new axis inserted before the positions, then
    merged with them."""
    b, n_kv_heads, n, d = x.shape
    return (
        x[:, :, None]
        .expand(b, n_kv_heads, n_heads // n_kv_heads, n, d)
        .flatten(2, 3)
    )


def pool_torch_median(weight, n_heads, n_kv_heads):
    """torch's .median(1): for an even group size the lower of the two middle
    values (the minimum at g = 2)."""
    g, d_head = n_heads // n_kv_heads, weight.shape[0] // n_heads
    return (
        weight.reshape(n_kv_heads, g, d_head, *weight.shape[1:])
        .median(1)
        .values.reshape(-1, *weight.shape[1:])
    )


CATALOGUE["check_share_kv_heads"]["wrong"] += [
    (share_tiled_positions, "wrong_axis"),
    (share_expand_flatten_positions, "wrong_axis"),
]
CATALOGUE["check_pool_kv_heads"]["wrong"] += [
    (pool_torch_median, "lower_median")
]


# --- from the expert reading s of chapter 12 (session 6) ---------------------


def share_into_default_buffer(x, n_heads):
    """Right heads, in a torch.zeros buffer of the default dtype: a float32
    result of float64 keys."""
    b, n_kv_heads, n, d = x.shape
    g = n_heads // n_kv_heads
    out = torch.zeros(b, n_heads, n, d)
    for j in range(n_heads):
        out[:, j] = x[:, j // g]
    return out


def share_cast_to_float(x, n_heads):
    """Right heads, then .float(): the reading's downcast copy."""
    return x.float().repeat_interleave(n_heads // x.shape[1], dim=1)


def share_always_double(x, n_heads):
    """Right heads, cast to float64 whatever the input: wrong on float32
    keys."""
    g = n_heads // x.shape[1]
    return x.double()[:, [j // g for j in range(n_heads)]]


def share_one_extra_copy_cut(x, n_heads):
    """Off by one, hidden by a cut: g + 1 copies of each head, then the first
    n_heads heads kept, so that the shape comes out right."""
    g = n_heads // x.shape[1]
    return torch.cat(
        [x[:, i : i + 1].expand(-1, g + 1, -1, -1) for i in range(x.shape[1])],
        dim=1,
    )[:, :n_heads]


def share_repeat_interleave_cut(x, n_heads):
    """The reading's version: repeat_interleave(g + 1), sliced to n_heads."""
    g = n_heads // x.shape[1]
    return x.repeat_interleave(g + 1, dim=1)[:, :n_heads]


def share_numpy_same_dtype(x, n_heads):
    """Correct: numpy's repeat, which keeps the dtype, back to torch."""
    g = n_heads // x.shape[1]
    return torch.from_numpy(np.repeat(x.numpy(), g, axis=1))


def share_buffer_with_dtype(x, n_heads):
    """Correct: a buffer made with the input's dtype, filled head by head."""
    b, n_kv_heads, n, d = x.shape
    g = n_heads // n_kv_heads
    out = torch.empty(b, n_heads, n, d, dtype=x.dtype)
    for j in range(n_heads):
        out[:, j] = x[:, j // g]
    return out


@pytest.mark.parametrize(
    "fn, key",
    [
        (share_into_default_buffer, "changed_dtype"),
        (share_cast_to_float, "changed_dtype"),
        (share_always_double, "changed_dtype"),
        (share_one_extra_copy_cut, "group_size_off_by_one_cut"),
        (share_repeat_interleave_cut, "group_size_off_by_one_cut"),
    ],
)
def test_share_new_mistakes_are_diagnosed(fn, key):
    with pytest.raises(ExerciseError) as err:
        check_share_kv_heads(fn)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value)


def test_share_changed_dtype_is_said_in_the_problem():
    with pytest.raises(ExerciseError) as err:
        check_share_kv_heads(share_cast_to_float)
    assert "your result is float32, the input (and so the answer) is " in (
        str(err.value)
    )
    assert "float64" in err.value.problem


@pytest.mark.parametrize(
    "fn", [share_numpy_same_dtype, share_buffer_with_dtype]
)
def test_share_same_dtype_solutions_pass(fn, capsys):
    check_share_kv_heads(fn)
    assert "Correct" in capsys.readouterr().out


def pool_float32_torch(w, n_heads, n_kv_heads):
    """Right values, returned in float32 for float64 weights: accepted, the
    pooled weights are copied into the layer's parameters (see the checker's
    docstring)."""
    g = n_heads // n_kv_heads
    return (
        w.float()
        .reshape(n_kv_heads, g, -1, *w.shape[1:])
        .mean(1)
        .flatten(0, 1)
    )


def test_pool_float32_result_of_float64_weights_is_accepted(capsys):
    check_pool_kv_heads(pool_float32_torch)
    assert "Correct" in capsys.readouterr().out


CATALOGUE["check_share_kv_heads"]["wrong"] += [
    (share_into_default_buffer, "changed_dtype"),
    (share_cast_to_float, "changed_dtype"),
    (share_always_double, "changed_dtype"),
    (share_one_extra_copy_cut, "group_size_off_by_one_cut"),
    (share_repeat_interleave_cut, "group_size_off_by_one_cut"),
]
CATALOGUE["check_share_kv_heads"]["right"] += [
    share_numpy_same_dtype,
    share_buffer_with_dtype,
]
CATALOGUE["check_pool_kv_heads"]["right"] += [pool_float32_torch]


# --- from the expert reading ch11-y (session 8): a bfloat16 result crashed
# both checkers with numpy's "unsupported ScalarType BFloat16" --------------


def share_bfloat16(x, n_heads):
    group = n_heads // x.shape[1]
    return x.repeat_interleave(group, dim=1).bfloat16()


def pool_bfloat16(weight, n_heads, n_kv_heads):
    """The right mean, cast to bfloat16. (This helper first took (x,
    n_kv_heads), so the checker's call with three arguments raised a
    TypeError and the test passed without ever returning a bfloat16.)"""
    g = n_heads // n_kv_heads
    return (
        weight.reshape(n_kv_heads, g, -1, *weight.shape[1:])
        .mean(1)
        .flatten(0, 1)
        .bfloat16()
    )


def test_a_bfloat16_share_is_named_by_its_dtype():
    with pytest.raises(ExerciseError) as err:
        check_share_kv_heads(share_bfloat16)
    assert "your result is bfloat16" in str(err.value)


def test_a_bfloat16_pool_is_rejected_without_a_crash():
    with pytest.raises(ExerciseError):
        check_pool_kv_heads(pool_bfloat16)


# --- expert reading ch11-y (session 8, fix): the pool checker does not judge
# the dtype, so a 16-bit result, rejected on its values, is named for its
# dtype rather than left with "values differ" --------------------------------


def pool_mean_then_half(weight, n_heads, n_kv_heads):
    """The right mean, then .half(): float16's 11 bits miss the tolerance."""
    d_head = weight.shape[0] // n_heads
    g = n_heads // n_kv_heads
    blocks = [
        sum(
            weight[(i * g + m) * d_head : (i * g + m + 1) * d_head]
            for m in range(g)
        )
        / g
        for i in range(n_kv_heads)
    ]
    return torch.cat(blocks).half()


def pool_numpy_float16(weight, n_heads, n_kv_heads):
    """The right mean in numpy, stored with astype(np.float16), handed back
    as a torch tensor."""
    a = weight.numpy()
    g = n_heads // n_kv_heads
    pooled = a.reshape(n_kv_heads, g, -1, *a.shape[1:]).mean(axis=1)
    return torch.from_numpy(
        pooled.reshape(-1, *a.shape[1:]).astype(np.float16)
    )


def pool_into_bfloat16_buffer(weight, n_heads, n_kv_heads):
    """The right mean, written into a buffer made in bfloat16."""
    g = n_heads // n_kv_heads
    d_head = weight.shape[0] // n_heads
    out = torch.empty(
        n_kv_heads * d_head, *weight.shape[1:], dtype=torch.bfloat16
    )
    for i in range(n_kv_heads):
        out[i * d_head : (i + 1) * d_head] = (
            weight[i * g * d_head : (i + 1) * g * d_head]
            .reshape(g, d_head, *weight.shape[1:])
            .mean(0)
        )
    return out


def pool_averaged_in_bfloat16(weight, n_heads, n_kv_heads):
    """Cast to bfloat16 first, then averaged there: rounded twice, so it is
    not the right mean rounded once, and no mistake is named; the problem
    still says the dtype."""
    g = n_heads // n_kv_heads
    return (
        weight.bfloat16()
        .reshape(n_kv_heads, g, -1, *weight.shape[1:])
        .mean(1)
        .flatten(0, 1)
    )


def pool_sum_in_half(weight, n_heads, n_kv_heads):
    """Two faults: summed instead of averaged, and then .half(): the sum is
    named (the dtype does not explain values g times too large)."""
    g = n_heads // n_kv_heads
    return (
        weight.reshape(n_kv_heads, g, -1, *weight.shape[1:])
        .sum(1)
        .flatten(0, 1)
        .half()
    )


@pytest.mark.parametrize(
    "fn",
    [
        pool_bfloat16,
        pool_mean_then_half,
        pool_numpy_float16,
        pool_into_bfloat16_buffer,
    ],
)
def test_a_sixteen_bit_pool_is_named_by_its_dtype(fn):
    with pytest.raises(ExerciseError) as err:
        check_pool_kv_heads(fn)
    assert err.value.mistake == "sixteen_bit_result"
    assert "The dtype is not judged" in err.value.problem
    assert "the weights (and so the answer) are float64" in err.value.problem
    assert "accounts for the difference" in err.value.problem


def test_a_pool_averaged_in_bfloat16_says_its_dtype():
    with pytest.raises(ExerciseError) as err:
        check_pool_kv_heads(pool_averaged_in_bfloat16)
    assert err.value.problem.startswith("your result is bfloat16")


def test_a_summed_half_pool_is_not_blamed_on_its_dtype():
    with pytest.raises(ExerciseError) as err:
        check_pool_kv_heads(pool_sum_in_half)
    assert err.value.mistake != "sixteen_bit_result"
    assert "does not account for this difference" in err.value.problem


def test_a_float32_pool_is_still_accepted_without_a_dtype_note(capsys):
    check_pool_kv_heads(pool_float32_torch)
    check_pool_kv_heads(pool_float32)
    out = capsys.readouterr().out
    assert out.count("Correct") == 2 and "dtype" not in out


CATALOGUE["check_pool_kv_heads"]["wrong"] += [
    (pool_bfloat16, "sixteen_bit_result"),
    (pool_mean_then_half, "sixteen_bit_result"),
    (pool_numpy_float16, "sixteen_bit_result"),
    (pool_into_bfloat16_buffer, "sixteen_bit_result"),
]


# --- from the expert reading ch11b (session 9) -------------------------------
# The exercise rules out the expand and reshape of repeat_kv and
# repeat_interleave: the hints of the share checker must not point there.


def share_by_index_select(x, n_heads):
    """Correct: index_select on the head axis, then a clone."""
    g = n_heads // x.shape[1]
    heads = torch.arange(n_heads) // g
    return x.index_select(1, heads).clone()


def share_by_tensor_index(x, n_heads):
    """Correct: advanced indexing with a tensor of head numbers (a copy that
    keeps the dtype)."""
    return x[:, torch.arange(n_heads) // (n_heads // x.shape[1])]


def test_share_hints_point_to_indexing_not_to_the_ruled_out_methods():
    # Since the student reading 1112 (issue 31) the exercise no longer names
    # the method, and no hint prints the answer's code (the index expression
    # torch.arange(n_heads) // g): the hints of the head-order mistakes state
    # the rule, output head j is input head j // g, and leave the code to the
    # reader.
    from attnbook.exercises.gqa import SHARE_MISTAKES

    for mistake in SHARE_MISTAKES:
        assert "expand(" not in mistake.hint, mistake.key
        assert "repeat_interleave(" not in mistake.hint, mistake.key
        assert "expand and reshape" not in mistake.hint, mistake.key
        assert "torch.arange(n_heads)" not in mistake.hint, mistake.key
        assert "x[:, " not in mistake.hint, mistake.key
    for key in ("wrong_order", "scrambled", "scrambled_features"):
        hints = [m.hint for m in SHARE_MISTAKES if m.key == key]
        assert all("head j // g" in h for h in hints), key


@pytest.mark.parametrize("fn", [share_by_index_select, share_by_tensor_index])
def test_share_by_a_tensor_of_head_numbers_passes(fn, capsys):
    check_share_kv_heads(fn)
    assert "Correct" in capsys.readouterr().out


CATALOGUE["check_share_kv_heads"]["right"] += [
    share_by_index_select,
    share_by_tensor_index,
]


# --- student reading 1112 (issue 31): a pool written for matrices only -------


def pool_matrix_only(weight, n_heads, n_kv_heads):
    """Wrong: right for a matrix, but the final reshape adds a trailing axis
    to a bias vector, (6,) -> (6, 1)."""
    g = n_heads // n_kv_heads
    d_head = weight.shape[0] // n_heads
    return (
        weight.reshape(n_kv_heads, g, d_head, -1)
        .mean(1)
        .reshape(n_kv_heads * d_head, -1)
    )


CATALOGUE["check_pool_kv_heads"]["wrong"] += [
    (pool_matrix_only, "trailing_axis_added")
]


def test_a_numpy_pool_result_is_not_said_to_differ_by_0():
    # before: "values differ from the reference (largest difference 0)" when
    # only the kind was wrong (issue 31, student report stud1112b)
    from attnbook.exercises import ExerciseError

    with pytest.raises(ExerciseError) as err:
        check_pool_kv_heads(pool_numpy_result)
    text = str(err.value)
    assert err.value.mistake == "numpy_result"
    assert "largest difference 0" not in text
    assert "not a torch tensor" in text
    assert "values agree with the answer" in text
