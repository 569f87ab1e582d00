"""The numpy attention path at the edges: float16 beyond its range, empty axes,
infinities.

Every expected value comes from torch on the same input (torch.softmax,
torch.logsumexp, torch.nn.functional.scaled_dot_product_attention in float16
and on empty tensors) or from float64.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attnbook
from attnbook.flash import (
    flash_attention_backward_numpy,
    flash_attention_numpy,
)
from attnbook.online_softmax import online_softmax
from attnbook.softmax import stable_shift


def overflowing_float16(seed=0):
    """q . k about 1.3e5 > 65504 before the 1/sqrt(d_k) scale; the scaled
    scores are ordinary."""
    rng = np.random.default_rng(seed)
    q = (60 + rng.random((2, 4, 64))).astype(np.float16)
    k = (30 + rng.random((2, 6, 64))).astype(np.float16)
    # one key scores higher: the weights are not flat
    k[:, 3] += 1
    v = rng.standard_normal((2, 6, 64)).astype(np.float16)
    return q, k, v


def test_float16_scores_beyond_its_range_match_torch():
    q, k, v = overflowing_float16()
    with np.errstate(over="ignore"):
        # the naive float16 product overflows
        assert np.isinf(q @ np.swapaxes(k, -1, -2)).any()
    out, w = attnbook.scaled_dot_product_attention(q, k, v)
    assert out.dtype == w.dtype == np.float16 and np.isfinite(out).all()
    expected = F.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v))
    )
    np.testing.assert_allclose(out, expected.numpy(), rtol=2e-3, atol=2e-3)
    ref, _ = attnbook.scaled_dot_product_attention(
        *(a.astype(np.float64) for a in (q, k, v))
    )
    np.testing.assert_allclose(out, ref, rtol=2e-3, atol=2e-3)
    # the weights are sharp, as they should be
    assert w.max() > 0.9
    np.testing.assert_allclose(
        flash_attention_numpy(q, k, v, block_k=4), ref, rtol=2e-3, atol=2e-3
    )
    assert attnbook.attention_scores(q, k).dtype == np.float32


@pytest.mark.parametrize("n_q, n_k", [(0, 5), (3, 0), (0, 0)])
def test_no_queries_or_no_keys_match_torch(n_q, n_k):
    rng = np.random.default_rng(1)
    q, k, v = (
        rng.standard_normal((2, n_q, 4)),
        rng.standard_normal((2, n_k, 4)),
        rng.standard_normal((2, n_k, 3)),
    )
    # torch's math gives NaN for a query with no keys (0 / 0); the book's rule,
    # as for a fully masked row, is "attends to nothing: zero output"
    expected = (
        F.scaled_dot_product_attention(
            *(torch.from_numpy(a) for a in (q, k, v))
        )
        .nan_to_num(0.0)
        .numpy()
    )
    out, w = attnbook.scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, n_q, 3) and w.shape == (2, n_q, n_k)
    np.testing.assert_array_equal(out, expected)
    flash, lse = flash_attention_numpy(q, k, v, return_lse=True)
    np.testing.assert_array_equal(flash, expected)
    np.testing.assert_allclose(
        lse,
        torch.logsumexp(
            torch.from_numpy(q @ np.swapaxes(k, -1, -2)), -1
        ).numpy(),
        rtol=1e-14,
    )
    grads = flash_attention_backward_numpy(
        q, k, v, flash, lse, np.ones_like(flash)
    )
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(np.all(g == 0) for g in grads)


@pytest.mark.parametrize(
    "shape, axis", [((0,), -1), ((3, 0), -1), ((0, 4), 0), ((2, 0, 3), 1)]
)
def test_softmax_and_logsumexp_of_an_empty_axis_match_torch(shape, axis):
    x = np.zeros(shape)
    t = torch.from_numpy(x)
    np.testing.assert_array_equal(
        attnbook.softmax(x, axis=axis), torch.softmax(t, dim=axis).numpy()
    )
    np.testing.assert_array_equal(
        attnbook.logsumexp(x, axis=axis), torch.logsumexp(t, dim=axis).numpy()
    )
    np.testing.assert_array_equal(
        attnbook.log_softmax(x, axis=axis),
        torch.log_softmax(t, dim=axis).numpy(),
    )


@pytest.mark.parametrize(
    "row",
    [
        [np.inf, 0.0],
        [np.inf, np.inf],
        [-np.inf, -np.inf],
        [-np.inf, 1.0],
        [np.inf, -np.inf],
        [np.nan, 0.0],
        [1000.0, 1000.0],
        [-1000.0, 5.0],
    ],
)
def test_logsumexp_with_infinities_matches_torch(row):
    x = np.array(row)
    # allclose still requires inf and NaN exactly where torch has them
    np.testing.assert_allclose(
        attnbook.logsumexp(x),
        torch.logsumexp(torch.from_numpy(x), -1).numpy(),
        rtol=1e-15,
    )


@pytest.mark.parametrize(
    "row", [[-np.inf, -np.inf], [-np.inf, 1.0], [1000.0, 999.0]]
)
def test_softmax_of_masked_and_large_rows_matches_torch(row):
    x = np.array(row)
    # all -inf: 0, not NaN
    expected = torch.softmax(torch.from_numpy(x), -1).nan_to_num(0.0).numpy()
    np.testing.assert_allclose(attnbook.softmax(x), expected, rtol=1e-15)
    np.testing.assert_allclose(
        online_softmax(x[None]), expected[None], rtol=1e-15
    )


def test_stable_shift_replaces_only_non_finite_maxima():
    m = np.array([2.0, -np.inf, np.inf, -3.5])
    np.testing.assert_array_equal(stable_shift(m), [2.0, 0.0, 0.0, -3.5])


def test_softmax_jacobian_of_a_scalar_is_a_clear_error():
    with pytest.raises(
        ValueError,
        match=r"p must have at least 1 dimensions \(\.\.\., n\); got shape "
        r"\(\)",
    ):
        attnbook.softmax_jacobian(np.float64(1.0))
    np.testing.assert_array_equal(
        attnbook.softmax_jacobian(np.array([1.0])), [[0.0]]
    )


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_apply_rope_refuses_integer_tensors(dtype):
    with pytest.raises(
        ValueError, match=f"floating-point tensor; got dtype {dtype}"
    ):
        attnbook.apply_rope(torch.ones(3, 4, dtype=dtype))
    # the same values as floats are rotated
    x = torch.arange(12.0).view(3, 4)
    assert not torch.equal(attnbook.apply_rope(x), x)


@pytest.mark.parametrize(
    "row",
    [[np.nan, 0.0], [np.nan, -np.inf], [1.0, np.nan, 3.0], [np.nan, np.nan]],
)
def test_a_nan_makes_the_whole_softmax_row_nan_as_in_torch(row):
    # the second row is ordinary
    x = np.array([row, [0.0] * len(row)])
    t = torch.from_numpy(x)
    expected = torch.softmax(t, -1).numpy()
    # assert_allclose requires NaN exactly where torch has NaN; the finite
    # values may differ in the last bit between torch versions (log_softmax of
    # [0, 0, 0] did in torch 2.5).
    close = dict(rtol=1e-14, atol=0)
    np.testing.assert_allclose(attnbook.softmax(x), expected, **close)
    np.testing.assert_allclose(online_softmax(x), expected, **close)
    np.testing.assert_allclose(online_softmax(x, block=2), expected, **close)
    np.testing.assert_allclose(
        attnbook.log_softmax(x), torch.log_softmax(t, -1).numpy(), **close
    )


def test_a_plus_inf_score_is_never_silently_finite():
    x = np.array([np.inf, 0.0, -np.inf])
    expected = torch.softmax(torch.from_numpy(x), -1).numpy()
    # torch: the whole row is NaN
    assert np.isnan(expected).all()
    with np.errstate(invalid="ignore"):  # inf / inf
        got = attnbook.softmax(x)
    assert np.isnan(got[0]) and not np.isfinite(got).all()


def test_a_nan_query_gives_a_nan_output_row_as_in_torch():
    rng = np.random.default_rng(2)
    q, k, v = (
        rng.standard_normal((2, 5, 4)),
        rng.standard_normal((2, 7, 4)),
        rng.standard_normal((2, 7, 3)),
    )
    q[1, 2, 0] = np.nan
    mask = attnbook.causal_mask(5, 7)
    expected = F.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)),
        attn_mask=torch.from_numpy(mask),
    ).numpy()
    assert (
        np.isnan(expected[1, 2]).all()
        and np.isfinite(np.delete(expected[1], 2, axis=0)).all()
    )
    out, _ = attnbook.scaled_dot_product_attention(q, k, v, mask=mask)
    # NaNs compare equal here
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    flash = flash_attention_numpy(q, k, v, causal=True, block_q=2, block_k=3)
    np.testing.assert_allclose(flash, expected, rtol=1e-12, atol=1e-12)


def test_integer_inputs_give_float64_attention_as_torch_on_their_float64_values():
    q = np.arange(12).reshape(4, 3) % 5 - 2
    k = np.arange(15).reshape(5, 3)[::-1] % 4 - 1
    v = np.arange(10).reshape(5, 2)
    expected = F.scaled_dot_product_attention(
        *(torch.from_numpy(a.astype(np.float64)) for a in (q, k, v))
    )
    out, w = attnbook.scaled_dot_product_attention(q, k, v)
    assert out.dtype == w.dtype == np.float64
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-12)
    # not truncated to integer zeros
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(
        flash_attention_numpy(q, k, v, block_k=2), expected.numpy(), rtol=1e-12
    )


def test_softmax_jacobian_of_integers_is_the_float64_formula():
    p = np.array([2, -1, 3])
    expected = np.diag(p.astype(np.float64)) - np.outer(p, p).astype(
        np.float64
    )
    got = attnbook.softmax_jacobian(p)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, expected)
    # and at a real softmax output:
    x = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    autograd = torch.autograd.functional.jacobian(
        lambda t: torch.softmax(t, -1), x
    )
    np.testing.assert_allclose(
        attnbook.softmax_jacobian(torch.softmax(x, -1).numpy()),
        autograd.numpy(),
        rtol=1e-12,
        atol=1e-15,
    )
