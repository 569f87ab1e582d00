"""Padding masks, checked against masks built position by position and against
unpadded attention."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnbook
from attnbook.multihead import MultiHeadAttention
from attnbook.padding import (
    fully_masked_rows,
    key_padding_mask,
    pad_sequences,
    padded_causal_mask,
    padding_mask,
    query_padding_mask,
)


def real_positions(length, n, side):
    """The positions of the real tokens, written out by hand."""
    return (
        list(range(length)) if side == "right" else list(range(n - length, n))
    )


@given(
    st.lists(st.integers(0, 9), min_size=1, max_size=5),
    st.integers(0, 4),
    st.sampled_from(["right", "left"]),
)
def test_padding_mask_marks_exactly_the_real_tokens(lengths, extra, side):
    n = max(max(lengths) + extra, 1)
    mask = padding_mask(lengths, n, side)
    assert mask.dtype == bool and mask.shape == (len(lengths), n)
    for b, length in enumerate(lengths):
        assert list(np.flatnonzero(mask[b])) == real_positions(length, n, side)


@pytest.mark.parametrize("side", ["right", "left"])
def test_key_and_query_masks_by_entries(side):
    lengths, n = [3, 1, 4], 4
    keys, queries = (
        key_padding_mask(lengths, n, side),
        query_padding_mask(lengths, n, side),
    )
    assert keys.shape == (3, 1, n) and queries.shape == (3, n, 1)
    assert key_padding_mask(lengths, n, side, head_axis=True).shape == (
        3,
        1,
        1,
        n,
    )
    assert query_padding_mask(lengths, n, side, head_axis=True).shape == (
        3,
        1,
        n,
        1,
    )
    full_k = np.broadcast_to(keys, (3, n, n))
    full_q = np.broadcast_to(queries, (3, n, n))
    for b, length in enumerate(lengths):
        real = real_positions(length, n, side)
        for i in range(n):
            for j in range(n):
                assert full_k[b, i, j] == (j in real)
                assert full_q[b, i, j] == (i in real)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_causal_mask_by_entries(side):
    lengths, n = [5, 2, 3], 5
    mask = padded_causal_mask(lengths, n, side)
    assert mask.shape == (3, n, n)
    assert padded_causal_mask(lengths, n, side, head_axis=True).shape == (
        3,
        1,
        n,
        n,
    )
    for b, length in enumerate(lengths):
        real = real_positions(length, n, side)
        for i in range(n):
            for j in range(n):
                assert mask[b, i, j] == (j <= i and j in real)


def test_left_padding_with_causal_mask_leaves_padding_rows_fully_masked():
    mask = padded_causal_mask([2, 4], 4, side="left")
    np.testing.assert_array_equal(
        fully_masked_rows(mask), [[True, True, False, False], [False] * 4]
    )
    assert not fully_masked_rows(
        padded_causal_mask([2, 4], 4, side="right")
    ).any()


def test_fully_masked_rows_rejects_non_boolean():
    with pytest.raises(ValueError, match="boolean"):
        fully_masked_rows(np.ones((2, 2)))


def test_pad_sequences_round_trip(rng):
    seqs = [rng.normal(size=(length, 3)) for length in (2, 5, 1)]
    for side in ("right", "left"):
        padded, lengths = pad_sequences(seqs, n=6, side=side, value=-7.0)
        assert padded.shape == (3, 6, 3) and list(lengths) == [2, 5, 1]
        for b, s in enumerate(seqs):
            real = real_positions(len(s), 6, side)
            np.testing.assert_array_equal(padded[b, real], s)
            pads = [p for p in range(6) if p not in real]
            assert (padded[b, pads] == -7.0).all()
    padded, _ = pad_sequences([[1, 2], [3]])
    np.testing.assert_array_equal(padded, [[1, 2], [3, 0]])


@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=4),
    st.integers(0, 5),
    st.integers(0, 2**31 - 1),
)
@settings(max_examples=40, deadline=None)
def test_key_padding_makes_real_outputs_independent_of_padding(
    lengths, extra, seed
):
    """Each real token's output equals attention over its own unpadded
    sequence, whatever the padding."""
    rng = np.random.default_rng(seed)
    d = 4
    seqs = [rng.normal(size=(length, d)) for length in lengths]
    n = max(lengths) + extra
    x, _ = pad_sequences(seqs, n=n, value=0.0)
    # garbage in the padding
    x += (
        (~padding_mask(lengths, n))[..., None] * rng.normal(size=x.shape) * 100
    )
    out, weights = attnbook.scaled_dot_product_attention(
        x, x, x, mask=key_padding_mask(lengths, n)
    )
    for b, s in enumerate(seqs):
        alone, _ = attnbook.scaled_dot_product_attention(s, s, s)
        np.testing.assert_allclose(
            out[b, : len(s)], alone, rtol=1e-10, atol=1e-12
        )
        # padding keys get exactly zero weight
        assert np.all(weights[b, :, len(s) :] == 0.0)


def test_without_mask_real_outputs_change_with_padding(rng):
    s = rng.normal(size=(3, 4))
    a, _ = attnbook.scaled_dot_product_attention(
        *(pad_sequences([s], n=3)[0],) * 3
    )
    x5 = pad_sequences([s], n=5)[0]
    b, _ = attnbook.scaled_dot_product_attention(x5, x5, x5)
    assert not np.allclose(a[0], b[0, :3])


def test_multihead_cross_attention_with_source_padding_matches_unpadded():
    """Decoder queries over a padded encoder output: same as attending over the
    real source alone."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).double()
    src_lengths, n_src, n_tgt = [5, 2, 7], 7, 3
    memory = torch.randn(3, n_src, 16, dtype=torch.float64)
    target = torch.randn(3, n_tgt, 16, dtype=torch.float64)
    # (3, 1, 1, 7)
    mask = torch.from_numpy(
        key_padding_mask(src_lengths, n_src, head_axis=True)
    )
    out = mha(target, context=memory, mask=mask)
    assert out.shape == (3, n_tgt, 16)
    for b, length in enumerate(src_lengths):
        alone = mha(target[b : b + 1], context=memory[b : b + 1, :length])
        torch.testing.assert_close(out[b : b + 1], alone)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: padding_mask([2, 6], 5), "0..n=5"),
        (lambda: padding_mask([-1], 5), "0..n=5"),
        (lambda: padding_mask([[1, 2]], 5), "1-D"),
        (lambda: padding_mask([], 5), "1-D"),
        (lambda: padding_mask([1.5], 5), "integers"),
        (lambda: padding_mask([1], 0), "positive integer"),
        (lambda: padding_mask([1], 3, side="middle"), "side"),
        (lambda: key_padding_mask([4], 3), "0..n=3"),
        (lambda: pad_sequences([]), "at least one"),
        (
            lambda: pad_sequences([np.ones((2, 3)), np.ones((2, 4))]),
            "same features",
        ),
        (lambda: pad_sequences([np.ones(3)], n=2), "0..n=2"),
    ],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
