"""scaled_dot_product_attention against torch's SDPA (float64) and a per-query
loop."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnbook


def loop_reference(q, k, v, mask=None, scale=None):
    """One query at a time, in float64, with masked keys dropped instead of set
    to -inf."""
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for i in range(q.shape[0]):
        keep = np.ones(k.shape[0], bool) if mask is None else mask[i]
        if not keep.any():
            continue
        s = np.array(
            [scale * float(np.dot(q[i], k[j])) for j in np.flatnonzero(keep)]
        )
        w = np.exp(s - s.max())
        out[i] = (w / w.sum()) @ v[keep]
    return out


shapes = st.tuples(
    st.integers(1, 9), st.integers(1, 9), st.integers(1, 8), st.integers(1, 8)
)


@settings(max_examples=150, deadline=None)
@given(shapes, st.integers(0, 2**32 - 1), st.booleans())
def test_matches_loop_reference_with_random_masks(shape, seed, use_mask):
    n_q, n_k, d_k, d_v = shape
    rng = np.random.default_rng(seed)
    q, k, v = (
        rng.normal(size=(n_q, d_k)),
        rng.normal(size=(n_k, d_k)),
        rng.normal(size=(n_k, d_v)),
    )
    mask = rng.random((n_q, n_k)) < 0.6 if use_mask else None
    out, weights = attnbook.scaled_dot_product_attention(q, k, v, mask=mask)
    assert out.shape == (n_q, d_v) and weights.shape == (n_q, n_k)
    np.testing.assert_allclose(
        out, loop_reference(q, k, v, mask), rtol=1e-10, atol=1e-12
    )
    if mask is not None:
        assert np.all(weights[~mask] == 0)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), shapes, st.integers(0, 2**32 - 1))
def test_matches_torch_sdpa_batched(batch, heads, shape, seed):
    n_q, n_k, d_k, d_v = shape
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, heads, n_q, d_k))
    k = rng.normal(size=(batch, heads, n_k, d_k))
    v = rng.normal(size=(batch, heads, n_k, d_v))
    expected = F.scaled_dot_product_attention(
        *map(torch.from_numpy, (q, k, v))
    ).numpy()
    np.testing.assert_allclose(
        attnbook.scaled_dot_product_attention(q, k, v)[0],
        expected,
        rtol=1e-10,
        atol=1e-12,
    )


def test_mask_and_scale_match_torch(rng):
    q, k, v = (
        rng.normal(size=(2, 5, 8)),
        rng.normal(size=(2, 7, 8)),
        rng.normal(size=(2, 7, 3)),
    )
    mask = rng.random((5, 7)) < 0.7
    # torch returns NaN on fully masked rows; those are tested separately
    mask[:, 0] = True
    expected = F.scaled_dot_product_attention(
        *map(torch.from_numpy, (q, k, v)),
        attn_mask=torch.from_numpy(mask),
        scale=0.3,
    ).numpy()
    got, _ = attnbook.scaled_dot_product_attention(
        q, k, v, mask=mask, scale=0.3
    )
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_fully_masked_row_gives_zero_output_and_weights(rng):
    q, k, v = (
        rng.normal(size=(3, 4)),
        rng.normal(size=(5, 4)),
        rng.normal(size=(5, 2)),
    )
    mask = np.ones((3, 5), bool)
    mask[1] = False
    out, weights = attnbook.scaled_dot_product_attention(q, k, v, mask=mask)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[1], 0)
    np.testing.assert_array_equal(weights[1], 0)
    np.testing.assert_allclose(weights[[0, 2]].sum(-1), 1)


def test_length_one(rng):
    q, k, v = (
        rng.normal(size=(1, 4)),
        rng.normal(size=(1, 4)),
        rng.normal(size=(1, 3)),
    )
    out, weights = attnbook.scaled_dot_product_attention(q, k, v)
    np.testing.assert_array_equal(weights, [[1.0]])
    np.testing.assert_allclose(out, v)


def test_float16_inputs_stay_close_to_float64(rng):
    q, k, v = (rng.normal(size=(4, 6, 16)) for _ in range(3))
    exact, _ = attnbook.scaled_dot_product_attention(q, k, v)
    half, _ = attnbook.scaled_dot_product_attention(
        *(a.astype(np.float16) for a in (q, k, v))
    )
    assert half.dtype == np.float16
    np.testing.assert_allclose(half.astype(np.float64), exact, atol=2e-2)


def test_broadcast_batch_of_keys(rng):
    """One set of keys and values shared by every head is allowed (it is what
    MQA does)."""
    q = rng.normal(size=(2, 4, 5, 8))
    k, v = rng.normal(size=(2, 1, 6, 8)), rng.normal(size=(2, 1, 6, 3))
    got, _ = attnbook.scaled_dot_product_attention(q, k, v)
    expected, _ = attnbook.scaled_dot_product_attention(
        q, np.repeat(k, 4, 1), np.repeat(v, 4, 1)
    )
    np.testing.assert_allclose(got, expected)


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape, mask_shape, words",
    [
        ((5,), (5, 4), (5, 4), None, ["q", "(5,)"]),
        ((3, 4), (5, 6), (5, 2), None, ["d_k", "(3, 4)", "(5, 6)"]),
        ((3, 4), (5, 4), (6, 2), None, ["n_k", "(5, 4)", "(6, 2)"]),
        (
            (2, 3, 4),
            (3, 5, 4),
            (3, 5, 2),
            None,
            ["batch", "(2, 3, 4)", "(3, 5, 4)"],
        ),
        ((3, 4), (5, 4), (5, 2), (5, 3), ["mask", "(5, 3)", "(3, 5)"]),
        ((3, 4), (5, 4), (5, 2), (2, 3, 5), ["mask", "(2, 3, 5)"]),
    ],
)
def test_bad_shapes_raise_value_error_naming_them(
    q_shape, k_shape, v_shape, mask_shape, words
):
    mask = None if mask_shape is None else np.ones(mask_shape, bool)
    with pytest.raises(ValueError) as err:
        attnbook.scaled_dot_product_attention(
            np.ones(q_shape), np.ones(k_shape), np.ones(v_shape), mask=mask
        )
    for word in words:
        assert word in str(err.value)


def test_non_boolean_mask_is_refused():
    with pytest.raises(ValueError, match="boolean"):
        attnbook.scaled_dot_product_attention(
            np.ones((2, 3)),
            np.ones((2, 3)),
            np.ones((2, 3)),
            mask=np.zeros((2, 2)),
        )


def test_attention_scores_is_the_scaled_product(rng):
    q, k = rng.normal(size=(3, 16)), rng.normal(size=(4, 16))
    np.testing.assert_allclose(attnbook.attention_scores(q, k), q @ k.T / 4.0)
    np.testing.assert_allclose(
        attnbook.attention_scores(q, k, scale=1.0), q @ k.T
    )
