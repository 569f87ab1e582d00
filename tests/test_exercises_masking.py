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


def good_torch(lengths, n):
    real = torch.arange(n)[None, :] < torch.as_tensor(lengths)[:, None]
    return real[:, None, :].expand(-1, n, -1)


def torch_int(lengths, n):
    """Wrong: 0/1 integers (E2 of the expert reading of chapter 7)."""
    real = torch.arange(n)[None, :] < torch.as_tensor(lengths)[:, None]
    return real[:, None, :].expand(-1, n, -1).int()


def numpy_int_broadcast(lengths, n):
    """Wrong: (batch, 1, n) of 0/1 int64."""
    return (np.arange(n) < np.asarray(lengths)[:, None])[:, None, :].astype(
        int
    )


@pytest.mark.parametrize("fn", [good, good_broadcast, good_torch])
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
        # each sequence given the length of another
        check_padding_mask(
            lambda lengths, n: good(np.asarray(lengths)[::-1], n)
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
            good_torch,
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
            (torch_int, "int_mask"),
            (numpy_int_broadcast, "int_mask"),
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


def query_axis_in_front(lengths, n):
    """(1, B, n): the query axis inserted before the batch axis (issue 31,
    student report 07b: a generic shape message before)."""
    real = np.arange(n)[None, :] < np.asarray(lengths)[:, None]
    return np.expand_dims(real, 0)


CATALOGUE["check_padding_mask"]["wrong"] += [
    (query_axis_in_front, "query_axis_first"),
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


# --- the block mask of packed documents (the hard exercise) -----------------

import math  # noqa: E402

from attnbook.exercises.masking import (  # noqa: E402
    BLOCK_MASK_MISTAKES,
    block_mask_cases,
    check_packed_block_mask,
)
from attnbook.masks import packed_causal_mask  # noqa: E402


def book_block_mask(lengths, block):
    """The chapter's solution: from the documents' boundaries, never n x n."""
    lengths = np.asarray(lengths)
    n = int(lengths.sum())
    n_blocks = -(-n // block)
    document = np.repeat(np.arange(len(lengths)), lengths)
    start = (np.cumsum(lengths) - lengths)[document]
    first = np.arange(n_blocks) * block
    last = np.minimum(first + block, n) - 1
    q_first, q_last = first[:, None], last[:, None]
    k_first, k_last = first[None, :], last[None, :]
    q = np.maximum(q_first, k_first)
    some = (q <= q_last) & (start[np.minimum(q, n - 1)] <= k_last)
    every = (k_last <= q_first) & (document[k_first] == document[q_last])
    return np.where(every, 2, np.where(some, 1, 0))


def dense_tiles(lengths, block, padding_masked=False):
    """An independent reference: each tile of the dense packed mask, by
    slicing (padding of the last block ignored, or counted as masked)."""
    lengths = np.asarray(lengths)
    mask = packed_causal_mask(lengths[lengths > 0])
    n = len(mask)
    n_blocks = math.ceil(n / block)
    out = np.zeros((n_blocks, n_blocks), int)
    for a in range(n_blocks):
        for c in range(n_blocks):
            tile = mask[
                a * block : (a + 1) * block, c * block : (c + 1) * block
            ]
            full = tile.all() and (
                not padding_masked or tile.shape == (block, block)
            )
            out[a, c] = 2 if full else 1 if tile.any() else 0
    return out


def test_the_hand_worked_example():
    # documents [0, 5), [5, 8), [8, 16) in blocks of 4
    expected = np.array(
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 2, 1]]
    )
    np.testing.assert_array_equal(book_block_mask([5, 3, 8], 4), expected)
    np.testing.assert_array_equal(dense_tiles([5, 3, 8], 4), expected)


@pytest.mark.parametrize("seed", range(40))
def test_the_book_solution_matches_the_dense_tiles(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 12, size=rng.integers(1, 6))
    if lengths.sum() == 0:
        lengths[0] = 1
    block = int(rng.integers(1, 9))
    np.testing.assert_array_equal(
        book_block_mask(lengths, block), dense_tiles(lengths, block)
    )


def codes_equal(got, expected) -> bool:
    """Equal tile codes, as integers: the exercise asks for an integer array,
    so float codes differ from the reference (issue 31, report 07)."""
    got = np.asarray(got)
    return got.dtype.kind in "iu" and np.array_equal(got, expected)


def test_every_case_is_caught_by_some_mistake_and_the_first_by_most():
    """Each Mistake differs from the reference on some case (it can be
    diagnosed); the first case alone catches most of them."""
    from attnbook.exercises._framework import _mistake_output, _FAILED

    cases = block_mask_cases()
    for m in BLOCK_MASK_MISTAKES:
        if m.raises is not None:
            continue
        differs = [
            c.name
            for c in cases
            if not codes_equal(_mistake_output(m, c), dense_tiles(*c.args))
            or _mistake_output(m, c) is _FAILED
        ]
        assert differs, m.key
    first = cases[0]
    caught = [
        m.key
        for m in BLOCK_MASK_MISTAKES
        if m.raises is None
        and not codes_equal(
            _mistake_output(m, first), dense_tiles(*first.args)
        )
    ]
    assert len(caught) >= 8, caught


def test_flexattention_agrees_where_n_is_a_multiple_of_the_block():
    """torch's FlexAttention classifies the same tiles (its partial and full
    blocks) from the same mask; where the last block is ragged it pads the
    mask with False, which is the ragged_padded mistake of this exercise."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def flex_classes(lengths, block):
        document = torch.repeat_interleave(
            torch.arange(len(lengths)), torch.as_tensor(lengths)
        )
        n = len(document)

        def packed(b, h, q, k):
            return (document[q] == document[k]) & (k <= q)

        bm = flex.create_block_mask(
            packed, 1, 1, n, n, device="cpu", BLOCK_SIZE=block
        )
        n_blocks = math.ceil(n / block)
        out = np.zeros((n_blocks, n_blocks), int)
        for num, idx, code in (
            (bm.kv_num_blocks, bm.kv_indices, 1),
            (bm.full_kv_num_blocks, bm.full_kv_indices, 2),
        ):
            for a in range(n_blocks):
                out[a, idx[0, 0, a, : num[0, 0, a]].numpy()] = code
        return out

    for lengths, block in (([5, 3, 8], 4), ([3, 0, 6, 0, 3], 4), ([8], 2)):
        np.testing.assert_array_equal(
            flex_classes(lengths, block), book_block_mask(lengths, block)
        )
    ragged = ([4, 4, 4, 1], 4)
    np.testing.assert_array_equal(
        flex_classes(*ragged), dense_tiles(*ragged, padding_masked=True)
    )
    assert not np.array_equal(flex_classes(*ragged), book_block_mask(*ragged))


def test_the_book_solution_passes(capsys):
    check_packed_block_mask(book_block_mask)
    out = capsys.readouterr().out
    assert out.startswith("Correct: packed block mask passes all 8 cases")


def dense_numpy(lengths, block):
    """Right values, through the n x n mask."""
    return dense_tiles(lengths, block)


def dense_torch(lengths, block):
    """Right values, through an n x n torch mask (tracemalloc cannot see
    it)."""
    document = torch.repeat_interleave(
        torch.arange(len(lengths)), torch.as_tensor(lengths)
    )
    n = len(document)
    pos = torch.arange(n)
    mask = (document[:, None] == document[None, :]) & (
        pos[None, :] <= pos[:, None]
    )
    n_blocks = -(-n // block)
    out = torch.zeros(n_blocks, n_blocks, dtype=torch.long)
    for a in range(n_blocks):
        for c in range(n_blocks):
            tile = mask[
                a * block : (a + 1) * block, c * block : (c + 1) * block
            ]
            out[a, c] = 2 if tile.all() else 1 if tile.any() else 0
    return out


@torch.no_grad()
def dense_torch_no_grad_to_numpy(lengths, block):
    """The torch n x n mask under torch.no_grad(), returned as numpy: the
    decorator's wrapper names no torch function, and the old checker
    profiled torch only for a returned tensor or a function whose code names
    torch, so it accepted this (issue 24)."""
    return dense_torch(lengths, block).numpy()


@pytest.mark.parametrize(
    "fn", [dense_numpy, dense_torch, dense_torch_no_grad_to_numpy]
)
def test_an_answer_that_forms_the_dense_mask_is_rejected(fn):
    with pytest.raises(ExerciseError, match=r"\(memory\).*peak memory"):
        check_packed_block_mask(fn)


def test_the_block_mask_stub_is_not_attempted():
    def stub(lengths, block):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError, match="lengths \\[5, 3, 8\\]"):
        check_packed_block_mask(stub)


# the catalogue: what a student who half-understood tiles writes


def _documents_by_loop(lengths):
    labels = []
    for d, length in enumerate(lengths):
        labels += [d] * int(length)
    return np.array(labels, dtype=int)


def tiles_causal_by_block(lengths, block):
    """Key blocks up to the query block, each tile judged by documents
    only."""
    doc = _documents_by_loop(lengths)
    n_blocks = math.ceil(len(doc) / block)
    out = np.zeros((n_blocks, n_blocks), int)
    for a in range(n_blocks):
        for c in range(a + 1):
            q = doc[a * block : (a + 1) * block]
            k = doc[c * block : (c + 1) * block]
            same = q[:, None] == k[None, :]
            out[a, c] = 2 if same.all() else 1 if same.any() else 0
    return out


def tiles_documents_only(lengths, block):
    """Block-diagonal only: which documents each block overlaps."""
    ends = np.cumsum(lengths)
    n = int(ends[-1])
    n_blocks = -(-n // block)
    doc = np.searchsorted(ends, np.arange(n), side="right")
    first = np.arange(n_blocks) * block
    last = np.minimum(first + block, n) - 1
    lo, hi = doc[first], doc[last]
    some = np.maximum(lo[:, None], lo[None, :]) <= np.minimum(
        hi[:, None], hi[None, :]
    )
    every = (
        (lo[:, None] == hi[:, None])
        & (lo[None, :] == hi[None, :])
        & (lo[:, None] == lo[None, :])
    )
    return np.where(every, 2, np.where(some, 1, 0))


def tiles_any_visible(lengths, block):
    """Marks each tile that some query can see: 1, never 2."""
    n = int(sum(lengths))
    start_of, s = [], 0
    for length in lengths:
        start_of += [s] * int(length)
        s += int(length)
    n_blocks = math.ceil(n / block)
    out = np.zeros((n_blocks, n_blocks), dtype=int)
    for a in range(n_blocks):
        for q in range(a * block, min((a + 1) * block, n)):
            for c in range(start_of[q] // block, q // block + 1):
                out[a, c] = 1
    return out


def tiles_visible_as_full(lengths, block):
    cu = np.concatenate([[0], np.cumsum(lengths)])
    n = int(cu[-1])
    n_blocks = (n + block - 1) // block
    start = cu[np.repeat(np.arange(len(lengths)), lengths)]
    out = np.zeros((n_blocks, n_blocks), np.int64)
    for q in range(n):
        out[q // block, start[q] // block : q // block + 1] = 2
    return out


def tiles_codes_swapped(lengths, block):
    FULL, PARTIAL = 1, 2
    doc = np.repeat(np.arange(len(lengths)), lengths)
    n = len(doc)
    n_blocks = -(-n // block)
    pos = np.arange(n)
    out = np.zeros((n_blocks, n_blocks), int)
    for a in range(n_blocks):
        q = pos[a * block : (a + 1) * block]
        for c in range(a + 1):
            k = pos[c * block : (c + 1) * block]
            ok = (doc[q][:, None] == doc[k][None, :]) & (
                k[None, :] <= q[:, None]
            )
            out[a, c] = FULL if ok.all() else PARTIAL if ok.any() else 0
    return out


def tiles_first_document(lengths, block):
    cum = np.cumsum(lengths)
    n = int(cum[-1])
    n_blocks = math.ceil(n / block)
    doc_of_block = [
        int(np.searchsorted(cum, b * block, side="right"))
        for b in range(n_blocks)
    ]
    out = np.zeros((n_blocks, n_blocks), int)
    for a in range(n_blocks):
        for c in range(n_blocks):
            if doc_of_block[a] == doc_of_block[c]:
                out[a, c] = 2 if c < a else 1 if c == a else 0
    return out


def tiles_searchsorted_left(lengths, block):
    cum = np.cumsum(lengths)
    n = int(cum[-1])
    # side='left' by default
    doc = np.searchsorted(cum, np.arange(n))
    n_blocks = -(-n // block)
    out = np.zeros((n_blocks, n_blocks), int)
    for a in range(n_blocks):
        for c in range(a + 1):
            q = np.arange(a * block, min((a + 1) * block, n))[:, None]
            k = np.arange(c * block, min((c + 1) * block, n))[None, :]
            ok = (doc[q] == doc[k]) & (k <= q)
            out[a, c] = 2 if ok.all() else (1 if ok.any() else 0)
    return out


def tiles_padded(lengths, block):
    """The row padded to whole blocks with a label -1 that sees nothing."""
    doc = np.repeat(np.arange(len(lengths)), lengths)
    n = len(doc)
    n_blocks = -(-n // block)
    padded = np.full(n_blocks * block, -1)
    padded[:n] = doc
    pos = np.arange(n_blocks * block)
    out = np.zeros((n_blocks, n_blocks), int)
    for a in range(n_blocks):
        q = pos[a * block : (a + 1) * block, None]
        for c in range(n_blocks):
            k = pos[None, c * block : (c + 1) * block]
            ok = (padded[q] == padded[k]) & (padded[q] >= 0) & (k <= q)
            out[a, c] = 2 if ok.all() else 1 if ok.any() else 0
    return out


def tiles_floor(lengths, block):
    """Whole blocks only: n // block of them."""
    doc = np.repeat(np.arange(len(lengths)), lengths)
    n_blocks = len(doc) // block
    out = np.zeros((n_blocks, n_blocks), int)
    for a in range(n_blocks):
        q = np.arange(a * block, (a + 1) * block)
        for c in range(a + 1):
            k = np.arange(c * block, (c + 1) * block)
            ok = (doc[q, None] == doc[None, k]) & (k[None, :] <= q[:, None])
            out[a, c] = 2 if ok.all() else 1 if ok.any() else 0
    return out


def tiles_key_by_query(lengths, block):
    """The book's formulas with the roles of the axes swapped."""
    return book_block_mask(lengths, block).T


def tiles_inclusive_end(lengths, block):
    lengths = np.asarray(lengths)
    n = int(lengths.sum())
    n_blocks = -(-n // block)
    document = np.repeat(np.arange(len(lengths)), lengths)
    start = (np.cumsum(lengths) - lengths)[document]
    first = np.arange(n_blocks) * block
    # the block "ends at" first + block (clipped to the row)
    last = np.minimum(first + block, n - 1)
    q = np.maximum(first[:, None], first[None, :])
    some = (q <= last[:, None]) & (
        start[np.minimum(q, n - 1)] <= last[None, :]
    )
    every = (last[None, :] <= first[:, None]) & (
        document[first[None, :]] == document[last[:, None]]
    )
    return np.where(every, 2, np.where(some, 1, 0))


def tiles_boundary_marks(lengths, block):
    """Labels from marks at the documents' starts: a start at n (a
    zero-length document at the end) is out of range."""
    lengths = np.asarray(lengths)
    n = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    is_start = np.zeros(n, int)
    is_start[starts[1:]] = 1
    document = np.cumsum(is_start)
    first_of = np.zeros(n, int)
    first_of[starts[lengths > 0]] = starts[lengths > 0]
    start = np.maximum.accumulate(first_of)
    n_blocks = -(-n // block)
    first = np.arange(n_blocks) * block
    last = np.minimum(first + block, n) - 1
    q = np.maximum(first[:, None], first[None, :])
    some = (q <= last[:, None]) & (
        start[np.minimum(q, n - 1)] <= last[None, :]
    )
    every = (last[None, :] <= first[:, None]) & (
        document[first[None, :]] == document[last[:, None]]
    )
    return np.where(every, 2, np.where(some, 1, 0))


# right answers, written otherwise than the book's


def tiles_by_slices(lengths, block):
    """A loop over the tiles, each built as a small (block, block) mask."""
    doc = np.repeat(np.arange(len(lengths)), lengths)
    n = len(doc)
    n_blocks = -(-n // block)
    out = np.zeros((n_blocks, n_blocks), dtype=np.int8)
    for a in range(n_blocks):
        q = np.arange(a * block, min((a + 1) * block, n))
        for c in range(a + 1):
            k = np.arange(c * block, min((c + 1) * block, n))
            ok = (doc[q, None] == doc[None, k]) & (k[None, :] <= q[:, None])
            out[a, c] = 2 if ok.all() else 1 if ok.any() else 0
    return out


def tiles_by_counting(lengths, block):
    """Counts the visible pairs of each tile, query by query, and compares
    with the tile's size."""
    lengths = [int(x) for x in lengths]
    n = sum(lengths)
    n_blocks = math.ceil(n / block)
    size = [min(block, n - b * block) for b in range(n_blocks)]
    seen = np.zeros((n_blocks, n_blocks), int)
    s = 0
    for length in lengths:
        for q in range(s, s + length):
            # keys s .. q are visible to q
            for c in range(s // block, q // block + 1):
                lo, hi = max(s, c * block), min(q, (c + 1) * block - 1)
                seen[q // block, c] += hi - lo + 1
        s += length
    full = seen == np.outer(size, size)
    return np.where(full, 2, np.where(seen > 0, 1, 0))


def tiles_torch(lengths, block):
    lengths = torch.as_tensor(lengths)
    n = int(lengths.sum())
    n_blocks = -(-n // block)
    document = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    start = (torch.cumsum(lengths, 0) - lengths)[document]
    first = torch.arange(n_blocks) * block
    last = torch.clamp(first + block, max=n) - 1
    q = torch.maximum(first[:, None], first[None, :])
    some = (q <= last[:, None]) & (start[q.clamp(max=n - 1)] <= last[None, :])
    every = (last[None, :] <= first[:, None]) & (
        document[first][None, :] == document[last][:, None]
    )
    return torch.where(every, 2, torch.where(some, 1, 0))


def test_an_integer_padding_mask_is_rejected_with_its_reason():
    with pytest.raises(ExerciseError) as err:
        check_padding_mask(numpy_int_broadcast)
    assert err.value.mistake == "int_mask"
    assert "its pattern is right" in str(err.value)
    assert "bitwise NOT" in str(err.value)


# the two boundary traps of the expert reading of chapter 7 (section 3),
# rejected before with the generic hint only


def tiles_full_by_first_query(lengths, block):
    """Wrong: 'full' tested with the document of the tile's first query."""
    doc = _documents_by_loop(lengths)
    n = len(doc)
    n_blocks = -(-n // block)
    out = np.zeros((n_blocks, n_blocks), int)
    for a in range(n_blocks):
        q_lo, q_hi = a * block, min((a + 1) * block, n) - 1
        for c in range(n_blocks):
            k_lo, k_hi = c * block, min((c + 1) * block, n) - 1
            visible = any(
                doc[q] == doc[k]
                for q in range(q_lo, q_hi + 1)
                for k in range(k_lo, min(k_hi, q) + 1)
            )
            if not visible:
                continue
            full = doc[k_lo] == doc[q_lo] and k_hi <= q_lo
            out[a, c] = 2 if full else 1
    return out


def tiles_some_by_last_query(lengths, block):
    """Wrong: 'some pair visible' tested on the tile's last query only."""
    doc = _documents_by_loop(lengths)
    n = len(doc)
    n_blocks = -(-n // block)
    out = np.zeros((n_blocks, n_blocks), int)
    for a in range(n_blocks):
        q_lo, q_hi = a * block, min((a + 1) * block, n) - 1
        for c in range(n_blocks):
            k_lo, k_hi = c * block, min((c + 1) * block, n) - 1
            if doc[k_lo] == doc[q_hi] and k_hi <= q_lo:
                out[a, c] = 2
            elif any(
                doc[k] == doc[q_hi] for k in range(k_lo, min(k_hi, q_hi) + 1)
            ):
                out[a, c] = 1
    return out


@pytest.mark.parametrize(
    "wrong, key",
    [
        (tiles_full_by_first_query, "full_first_query"),
        (tiles_some_by_last_query, "some_last_query"),
    ],
)
def test_the_two_boundary_traps_are_named(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_packed_block_mask(wrong)
    assert err.value.mistake == key


CATALOGUE["check_packed_block_mask"] = {
    "right": [tiles_by_slices, tiles_by_counting, tiles_torch],
    "wrong": [
        (tiles_causal_by_block, "causal_per_block"),
        (tiles_documents_only, "no_causal"),
        (tiles_any_visible, "no_full_class"),
        (tiles_visible_as_full, "any_visible_full"),
        (tiles_codes_swapped, "full_partial_swapped"),
        (tiles_first_document, "first_position_document"),
        (tiles_searchsorted_left, "document_boundary_off_by_one"),
        (tiles_padded, "ragged_padded"),
        (tiles_floor, "floor_blocks"),
        (tiles_key_by_query, "transposed"),
        (tiles_inclusive_end, "ends_inclusive"),
        (tiles_boundary_marks, "index_at_n"),
        (tiles_full_by_first_query, "full_first_query"),
        (tiles_some_by_last_query, "some_last_query"),
    ],
}


# --- from the expert reading s of chapter 7 ----------------------------------
# padding: the two slips it found rejected with the generic hint only


def no_mask_at_all(lengths, n):
    """Wrong: every key visible, padding included."""
    return np.ones((len(lengths), n, n), dtype=bool)


def longest_for_all(lengths, n):
    """Wrong: every sequence given the longest length."""
    longest = max(int(x) for x in lengths)
    return loop_mask(lengths, n, lambda i, j, L, n: j < longest)


CATALOGUE["check_padding_mask"]["wrong"] += [
    (no_mask_at_all, "no_mask"),
    (longest_for_all, "longest_length"),
]


# the block mask: 'full' tested with a strict inequality (E3), misdiagnosed
# before as the ragged block padded; and the documents ignored


def tiles_full_strict(lengths, block):
    """Wrong: the book's solution with k_last < q_first ('the last key must
    come before the first query'): a diagonal tile of one position, whose one
    pair is visible, is called partial."""
    lengths = np.asarray(lengths)
    n = int(lengths.sum())
    n_blocks = -(-n // block)
    document = np.repeat(np.arange(len(lengths)), lengths)
    start = (np.cumsum(lengths) - lengths)[document]
    first = np.arange(n_blocks) * block
    last = np.minimum(first + block, n) - 1
    q_first, q_last = first[:, None], last[:, None]
    k_first, k_last = first[None, :], last[None, :]
    q = np.maximum(q_first, k_first)
    some = (q <= q_last) & (start[np.minimum(q, n - 1)] <= k_last)
    every = (k_last < q_first) & (document[k_first] == document[q_last])
    return np.where(every, 2, np.where(some, 1, 0))


def tiles_plain_causal(lengths, block):
    """Wrong: the documents ignored, the tiles of the causal mask of n."""
    n = int(sum(lengths))
    n_blocks = math.ceil(n / block)
    out = np.zeros((n_blocks, n_blocks), int)
    for a in range(n_blocks):
        size = min((a + 1) * block, n) - a * block
        out[a, :a] = 2
        out[a, a] = 2 if size == 1 else 1
    return out


CATALOGUE["check_packed_block_mask"]["wrong"] += [
    (tiles_full_strict, "full_strict"),
    (tiles_plain_causal, "no_documents"),
]


def test_the_strict_full_test_is_not_called_ragged_padding(monkeypatch):
    """Without full_strict in the list, the strict answer matches
    ragged_padded on the case that fails, but it is wrong on 'lengths [2,
    3], block 1', where no block is ragged and ragged_padded gives the
    reference: the checker names no mistake rather than a wrong one."""
    from attnbook.exercises import masking

    monkeypatch.setattr(
        masking,
        "BLOCK_MASK_MISTAKES",
        [m for m in BLOCK_MASK_MISTAKES if m.key != "full_strict"],
    )
    with pytest.raises(ExerciseError) as err:
        check_packed_block_mask(tiles_full_strict)
    assert err.value.mistake is None, str(err.value)
    # the padded ragged block itself is still named
    with pytest.raises(ExerciseError) as err:
        check_packed_block_mask(tiles_padded)
    assert err.value.mistake == "ragged_padded"


# --- from the expert reading of chapter 7 (reader u, C1): two other ways to
# index one past the end of an array, named by the same diagnosis, whose
# wording now covers them
def tiles_one_block_too_many(lengths, block):
    """n // block + 1 blocks, as if n were never a multiple of the block."""
    lengths = np.asarray(lengths)
    doc = np.repeat(np.arange(len(lengths)), lengths)
    n = len(doc)
    n_blocks = n // block + 1
    out = np.zeros((n_blocks, n_blocks), dtype=np.int64)
    for a in range(n_blocks):
        q_lo, q_hi = a * block, min((a + 1) * block, n) - 1
        for c in range(a + 1):
            k_lo, k_hi = c * block, min((c + 1) * block, n) - 1
            full = doc[k_lo] == doc[q_hi] and k_hi <= q_lo
            out[a, c] = 2 if full else 1
    return out


def tiles_labels_with_empty_documents(lengths, block):
    """Starts of the non-empty documents, indexed by labels that count the
    empty ones too."""
    lengths = np.asarray(lengths)
    n = int(lengths.sum())
    n_blocks = -(-n // block)
    document = np.repeat(np.arange(len(lengths)), lengths)
    kept = lengths[lengths > 0]
    starts = np.cumsum(kept) - kept
    start = starts[document]
    first = np.arange(n_blocks) * block
    last = np.minimum(first + block, n) - 1
    q = np.maximum(first[:, None], first[None, :])
    some = (q <= last[:, None]) & (
        start[np.minimum(q, n - 1)] <= last[None, :]
    )
    every = (last[None, :] <= first[:, None]) & (
        document[first[None, :]] == document[last[:, None]]
    )
    return np.where(every, 2, np.where(some, 1, 0))


@pytest.mark.parametrize(
    "wrong, cause",
    [
        (tiles_one_block_too_many, "a block count that is not ceil"),
        (tiles_labels_with_empty_documents, "labels that count the empty"),
    ],
)
def test_index_one_past_the_end_names_each_cause(wrong, cause):
    with pytest.raises(ExerciseError) as err:
        check_packed_block_mask(wrong)
    assert err.value.mistake == "index_at_n"
    assert cause in str(err.value)


CATALOGUE["check_packed_block_mask"]["wrong"] += [
    (tiles_one_block_too_many, "index_at_n"),
    (tiles_labels_with_empty_documents, "index_at_n"),
]


# --- from the student reading of chapters 7 and 8 (issue 31, report 0708) ---
# Masks cut from a fixed 8-position array passed while every case had n <= 8;
# the padding checker now has a case of n = 40. Four slips of the hard
# exercise got only the generic hint, and one some-pair test was rejected on
# the long row without a diagnosis: each is named now.


def padding_from_1024_buffer(lengths, n):
    """Wrong: the key index of a 1024-position buffer (a usual context
    length), cut to n: right for every n <= 1024."""
    keys = np.arange(1024)[None, None, :]
    return (keys < np.asarray(lengths)[:, None, None])[..., :n]


def padding_from_fixed_buffer(lengths, n):
    """Wrong: the key index of an 8-position buffer, cut to n."""
    return (np.arange(8)[None, None, :] < lengths[:, None, None])[..., :n]


def tiles_from_bounds(lengths, block, full_rule, some_rule):
    """Tiles from each block's first and last position and document; the
    full and some-pair tests passed in (the student's formulation, with the
    query block's end exclusive)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    n = int(lengths.sum())
    n_blocks = -(-n // block)
    doc = np.repeat(np.arange(len(lengths)), lengths)
    start = np.arange(n_blocks) * block
    end = np.minimum(start + block, n)
    first, last = doc[start], doc[end - 1]
    g = dict(
        qf=first[:, None],
        ql=last[:, None],
        q0=start[:, None],
        q1=end[:, None],
        kf=first[None, :],
        kl=last[None, :],
        k0=start[None, :],
        k1=end[None, :],
    )
    out = some_rule(**g).astype(np.int64)
    out[full_rule(**g)] = 2
    return out


def shares_document(qf, ql, kf, kl, **_):
    return np.maximum(qf, kf) <= np.minimum(ql, kl)


def good_some(q1, k0, **g):
    return shares_document(**g) & (k0 <= q1 - 1)


def good_full(qf, ql, kf, kl, q0, k1, **_):
    return (qf == ql) & (kf == kl) & (qf == kf) & (k1 - 1 <= q0)


def tiles_superdiagonal(lengths, block):
    """Wrong: the some-pair test with the exclusive end taken as a
    position, k0 <= q1."""
    return tiles_from_bounds(
        lengths,
        block,
        good_full,
        lambda q1, k0, **g: shares_document(**g) & (k0 <= q1),
    )


def tiles_some_by_causality(lengths, block):
    """Wrong: the documents left out of the some-pair test."""
    return tiles_from_bounds(
        lengths, block, good_full, lambda q1, k0, **g: k0 <= q1 - 1
    )


def tiles_some_first_or_last(lengths, block):
    """Wrong: blocks share a document when their first documents or their
    last documents agree."""
    return tiles_from_bounds(
        lengths,
        block,
        good_full,
        lambda qf, ql, kf, kl, q1, k0, **_: (
            ((qf == kf) | (ql == kl)) & (k0 <= q1 - 1)
        ),
    )


def tiles_full_without_causality(lengths, block):
    """Wrong: full when both blocks lie in one document, wherever the tile
    is."""
    return tiles_from_bounds(
        lengths,
        block,
        lambda qf, ql, kf, kl, **_: (qf == ql) & (kf == kl) & (qf == kf),
        good_some,
    )


def tiles_full_any_documents(lengths, block):
    """Wrong: full when each block lies in a document of its own, not
    necessarily the same one."""
    return tiles_from_bounds(
        lengths,
        block,
        lambda qf, ql, kf, kl, q0, k1, **_: (
            (qf == ql) & (kf == kl) & (k1 - 1 <= q0)
        ),
        good_some,
    )


def tiles_right_by_bounds(lengths, block):
    """Right: the student's accepted answer."""
    return tiles_from_bounds(lengths, block, good_full, good_some)


@pytest.mark.parametrize(
    "wrong, key",
    [
        (padding_from_fixed_buffer, "fixed_size"),
        (padding_from_1024_buffer, "fixed_size"),
    ],
)
def test_a_fixed_buffer_padding_mask_is_named(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_padding_mask(wrong)
    assert err.value.mistake == key
    assert "n = 4100" in str(err.value)


def test_the_block_mask_hint_does_not_point_to_a_derivation_in_the_text():
    def wrong(lengths, block):
        return np.zeros_like(tiles_right_by_bounds(lengths, block)) + 1

    with pytest.raises(ExerciseError) as err:
        check_packed_block_mask(wrong)
    assert "chapter's derivation" not in str(err.value)


def test_a_some_pair_slip_is_named_on_a_small_case_and_on_the_long_row():
    """Caught first by "lengths [9, 1, 14, 2, 4, 2], block 5" (a query
    block that begins in the document in which the key block ends); the long
    row, where the student met it, names it too."""
    from attnbook.exercises.masking import _check_block_memory

    with pytest.raises(ExerciseError) as err:
        check_packed_block_mask(tiles_some_first_or_last)
    assert err.value.mistake == "some_first_or_last_document"
    with pytest.raises(ExerciseError) as err:
        _check_block_memory(tiles_some_first_or_last)
    assert "n = 3881" in str(err.value)
    assert err.value.mistake == "some_first_or_last_document"


CATALOGUE["check_padding_mask"]["wrong"] += [
    (padding_from_fixed_buffer, "fixed_size"),
    (padding_from_1024_buffer, "fixed_size"),
]
CATALOGUE["check_packed_block_mask"]["wrong"] += [
    (tiles_superdiagonal, "some_superdiagonal"),
    (tiles_some_by_causality, "some_ignores_documents"),
    (tiles_some_first_or_last, "some_first_or_last_document"),
    (tiles_full_without_causality, "full_ignores_causal"),
    (tiles_full_any_documents, "full_ignores_documents"),
]
CATALOGUE["check_packed_block_mask"]["right"] += [tiles_right_by_bounds]


# --- from the student reading of chapter 7 (issue 31, report 07) ------------
# A padding mask cut from a 4096-key buffer got only the generic hint, and
# tile codes returned as floats were accepted although the exercise asks for
# an integer array: both are named now.

_KEYS_4096 = np.arange(4096)


def padding_from_4096_buffer(lengths, n):
    """Wrong: the student's key index of a 4096-position buffer, cut to n."""
    return (_KEYS_4096[None, :n] < np.asarray(lengths)[:, None])[:, None, :]


def tiles_as_floats(lengths, block):
    """Wrong: the right codes, as float64."""
    return tiles_right_by_bounds(lengths, block).astype(float)


def tiles_as_float_tensor(lengths, block):
    """Wrong: the right codes in a float32 torch tensor."""
    return torch.tensor(
        tiles_right_by_bounds(lengths, block), dtype=torch.float32
    )


def tiles_as_int32_tensor(lengths, block):
    """Right: the codes in an int32 torch tensor."""
    return torch.tensor(
        tiles_right_by_bounds(lengths, block), dtype=torch.int32
    )


def test_a_4096_buffer_padding_mask_is_named():
    with pytest.raises(ExerciseError) as err:
        check_padding_mask(padding_from_4096_buffer)
    assert err.value.mistake == "fixed_size"
    assert "(4096 keys)" in str(err.value)


@pytest.mark.parametrize("wrong", [tiles_as_floats, tiles_as_float_tensor])
def test_float_tile_codes_are_named(wrong):
    with pytest.raises(ExerciseError) as err:
        check_packed_block_mask(wrong)
    assert err.value.mistake == "float_codes"


CATALOGUE["check_padding_mask"]["wrong"] += [
    (padding_from_4096_buffer, "fixed_size"),
]
CATALOGUE["check_packed_block_mask"]["wrong"] += [
    (tiles_as_floats, "float_codes"),
    (tiles_as_float_tensor, "float_codes"),
]
CATALOGUE["check_packed_block_mask"]["right"] += [tiles_as_int32_tensor]
