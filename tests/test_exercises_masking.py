"""check_padding_mask passes correct masks in several forms and names each
classic mistake.

The wrong masks here are written independently of the checker's Mistake
functions, with loops and other numpy calls, the way a reader might write them.
"""

import numpy as np
import pytest
import torch

from attnbook.exercises import ExerciseError, NotAttemptedError
from attnbook.exercises.masking import check_padding_mask


def loop_mask(lengths, n, rule):
    out = np.zeros((len(lengths), n, n), dtype=bool)
    for b, length in enumerate(lengths):
        for i in range(n):
            for j in range(n):
                out[b, i, j] = rule(i, j, int(length), n)
    return out


def good(lengths, n):
    return loop_mask(lengths, n, lambda i, j, L, n: j < L)


def good_broadcast(lengths, n):
    # (batch, 1, n)
    return (np.arange(n) < np.asarray(lengths)[:, None])[:, None, :]


def good_torch_int(lengths, n):
    real = torch.arange(n)[None, :] < torch.as_tensor(lengths)[:, None]
    # 0/1 integers
    return real[:, None, :].expand(-1, n, -1).int()


@pytest.mark.parametrize("fn", [good, good_broadcast, good_torch_int])
def test_correct_masks_pass(fn, capsys):
    check_padding_mask(fn)
    assert "Correct" in capsys.readouterr().out


def rows_masked(lengths, n):
    # (batch, n)
    real = np.arange(n) < np.asarray(lengths)[:, None]
    return np.repeat(real[:, :, None], n, axis=2)


def inverted(lengths, n):
    return ~good(lengths, n)


def shows_one_pad(lengths, n):
    return loop_mask(lengths, n, lambda i, j, L, n: j < L + 1)


def hides_last(lengths, n):
    return loop_mask(lengths, n, lambda i, j, L, n: j + 1 < L)


def outer_product(lengths, n):
    real = (np.arange(n) < np.asarray(lengths)[:, None]).astype(int)
    return np.einsum("bi,bj->bij", real, real).astype(bool)


def padded_on_the_left(lengths, n):
    return loop_mask(lengths, n, lambda i, j, L, n: j >= n - L)


@pytest.mark.parametrize(
    "wrong, key",
    [
        (rows_masked, "queries_masked"),
        (inverted, "inverted"),
        (shows_one_pad, "pad_visible"),
        (hides_last, "last_token_hidden"),
        (outer_product, "queries_and_keys"),
        (padded_on_the_left, "left_padding"),
    ],
)
def test_mistakes_are_diagnosed(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_padding_mask(wrong)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value) and "Hint" in str(err.value)


def test_unknown_mistake_and_wrong_shape_are_rejected():
    with pytest.raises(ExerciseError) as err:
        check_padding_mask(
            lambda lengths, n: np.ones((len(lengths), n, n), bool)
        )
    assert err.value.mistake is None
    with pytest.raises(ExerciseError, match="shape"):
        check_padding_mask(lambda lengths, n: np.ones((n + 1, n + 1), bool))


def test_stub_and_crash():
    def stub(lengths, n):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_padding_mask(stub)
    with pytest.raises(ExerciseError, match="ZeroDivisionError"):
        check_padding_mask(lambda lengths, n: 1 / 0)


def test_an_additive_mask_is_named_and_converted():
    from attnbook.exercises.masking import check_padding_mask
    from attnbook.exercises import check_causal_mask

    # right, but in the form added to the scores
    def additive_padding(lengths, n):
        keep = np.arange(n)[None, None, :] < np.asarray(lengths)[:, None, None]
        return np.where(
            np.broadcast_to(keep, (len(lengths), n, n)), 0.0, -np.inf
        )

    with pytest.raises(
        AssertionError,
        match=r"your mask is additive.*`mask == 0`.*It is right as an "
        r"additive mask",
    ):
        check_padding_mask(additive_padding)

    # additive and hiding the diagonal
    def additive_causal_off_by_one(n):
        return np.where(np.tril(np.ones((n, n), bool), k=-1), 0.0, -np.inf)

    with pytest.raises(
        AssertionError, match=r"your mask is additive.*still wrong"
    ):
        check_causal_mask(additive_causal_off_by_one)


def test_a_classic_mistake_in_additive_form_is_still_named():
    """The additive mask is judged as the boolean mask it stands for, so its
    mistake gets its name."""
    from attnbook.exercises.masking import check_padding_mask
    from attnbook.exercises import check_causal_mask

    # written with loops: key j allowed for query i when j < i
    def additive_diagonal_hidden(n):
        return np.array(
            [[0.0 if j < i else -np.inf for j in range(n)] for i in range(n)]
        )

    # each query sees itself and the keys after it
    def additive_future(n):
        return np.array(
            [[0.0 if j >= i else -np.inf for j in range(n)] for i in range(n)]
        )

    def additive_first_pad_visible(lengths, n):  # one padding key too many
        return np.array(
            [
                [
                    [0.0 if j <= length else -np.inf for j in range(n)]
                    for _ in range(n)
                ]
                for length in lengths
            ]
        )

    for fn, check, key in (
        (additive_diagonal_hidden, check_causal_mask, "diagonal_hidden"),
        (additive_future, check_causal_mask, "transposed"),
        (additive_first_pad_visible, check_padding_mask, "pad_visible"),
    ):
        with pytest.raises(
            ExerciseError, match=r"your mask is additive.*still wrong"
        ) as err:
            check(fn)
        assert err.value.mistake == key, (fn.__name__, err.value.mistake)


def test_a_right_additive_mask_gets_the_conversion_as_hint():
    from attnbook.exercises import check_causal_mask

    def additive(n):
        return np.array(
            [[0.0 if j <= i else -np.inf for j in range(n)] for i in range(n)]
        )

    with pytest.raises(
        ExerciseError,
        match=r"right as an additive mask\nHint: return `mask == 0`",
    ) as err:
        check_causal_mask(additive)
    assert err.value.mistake is None


# --- the catalogue (run by tests/test_exercises_framework.py) ----------------


def key_mask_without_query_axis(lengths, n):
    # (batch, n): no query axis
    return np.arange(n)[None, :] < np.asarray(lengths)[:, None]


def key_mask_without_query_axis_torch(lengths, n):
    return torch.arange(n).expand(len(lengths), n) < torch.as_tensor(
        lengths
    ).unsqueeze(1)


CATALOGUE = {
    "check_padding_mask": {
        "right": [
            good,
            good_broadcast,
            good_torch_int,
            lambda lengths, n: np.einsum(
                "bj,i->bij",
                np.arange(n) < np.asarray(lengths)[:, None],
                np.ones(n, bool),
            ).astype(bool),
        ],
        "wrong": [
            (rows_masked, "queries_masked"),
            (inverted, "inverted"),
            (shows_one_pad, "pad_visible"),
            (hides_last, "last_token_hidden"),
            (outer_product, "queries_and_keys"),
            (padded_on_the_left, "left_padding"),
            (key_mask_without_query_axis, "key_mask_2d"),
            (key_mask_without_query_axis_torch, "key_mask_2d"),
        ],
    },
}


# --- from the expert reading of chapter 7 (checker-findings) -----------------


def float_key_mask(lengths, n):
    """(B, 1, n) float32 of 1.0 and 0.0: PyTorch's SDPA would add it to the
    scores, masking nothing."""
    return (
        np.arange(n)[None, None, :] < np.asarray(lengths)[:, None, None]
    ).astype(np.float32)


def head_axis_key_mask(lengths, n):
    """(B, 1, 1, n): the layout for (batch, heads, n, n) scores, one axis too
    many here."""
    return (torch.arange(n)[None, :] < torch.as_tensor(lengths)[:, None])[
        :, None, None, :
    ]


CATALOGUE["check_padding_mask"]["wrong"] += [
    (float_key_mask, "float_mask"),
    (head_axis_key_mask, "head_axis"),
]


def test_a_float_padding_mask_is_rejected_because_torch_adds_it():
    with pytest.raises(ExerciseError) as err:
        check_padding_mask(float_key_mask)
    assert err.value.mistake == "float_mask" and "its pattern is right" in str(
        err.value
    )


CATALOGUE["check_padding_mask"]["wrong"] += [
    (
        lambda lengths, n: (
            np.tril(np.ones((n, n), bool))
            & (np.arange(n) < np.asarray(lengths)[:, None, None])
        ),
        "causal_too",
    ),
    (
        lambda lengths, n: np.broadcast_to(
            np.arange(n) < lengths[0], (len(lengths), n, n)
        ),
        "one_length",
    ),
]
