"""Tests of attnbook.projections against independent references (torch, float64
loops)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnbook.projections import project_qkv, single_head_attention


def _rand(rng, *shape):
    return rng.normal(size=shape)


def _loop_attention(x, context, w_q, w_k, w_v, scale):
    """Per-query float64 reference written with explicit sums, no matrix
    products."""
    n_q, n_k = x.shape[0], context.shape[0]
    q = np.array(
        [
            [
                sum(x[i, a] * w_q[a, c] for a in range(x.shape[1]))
                for c in range(w_q.shape[1])
            ]
            for i in range(n_q)
        ]
    )
    k = np.array(
        [
            [
                sum(context[j, a] * w_k[a, c] for a in range(context.shape[1]))
                for c in range(w_k.shape[1])
            ]
            for j in range(n_k)
        ]
    )
    v = np.array(
        [
            [
                sum(context[j, a] * w_v[a, c] for a in range(context.shape[1]))
                for c in range(w_v.shape[1])
            ]
            for j in range(n_k)
        ]
    )
    out = np.zeros((n_q, w_v.shape[1]))
    weights = np.zeros((n_q, n_k))
    for i in range(n_q):
        s = np.array([scale * float(np.dot(q[i], k[j])) for j in range(n_k)])
        e = np.exp(s - s.max())
        weights[i] = e / e.sum()
        for j in range(n_k):
            out[i] += weights[i, j] * v[j]
    return out, weights


# --- project_qkv -----------------------------------------------------------


@pytest.mark.parametrize("batch", [(), (3,), (2, 1)])
@pytest.mark.parametrize(
    "n, d_model, d_k, d_v", [(5, 8, 4, 3), (1, 3, 1, 7), (7, 2, 6, 2)]
)
def test_project_qkv_matches_torch_linear(batch, n, d_model, d_k, d_v):
    rng = np.random.default_rng(n * 100 + d_k)
    x = _rand(rng, *batch, n, d_model)
    w_q, w_k, w_v = (
        _rand(rng, d_model, d_k),
        _rand(rng, d_model, d_k),
        _rand(rng, d_model, d_v),
    )
    q, k, v = project_qkv(x, w_q, w_k, w_v)
    xt = torch.from_numpy(x)
    # torch.nn.functional.linear takes the (d_out, d_in) layout, hence the
    # transposes.
    for got, w in ((q, w_q), (k, w_k), (v, w_v)):
        want = torch.nn.functional.linear(
            xt, torch.from_numpy(w.T.copy())
        ).numpy()
        assert got.shape == batch + (n, w.shape[1])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_project_qkv_cross_attention_uses_context_for_keys_and_values():
    rng = np.random.default_rng(0)
    x, context = _rand(rng, 3, 6), _rand(rng, 5, 4)
    w_q, w_k, w_v = _rand(rng, 6, 2), _rand(rng, 4, 2), _rand(rng, 4, 7)
    q, k, v = project_qkv(x, w_q, w_k, w_v, context=context)
    assert (q.shape, k.shape, v.shape) == ((3, 2), (5, 2), (5, 7))
    np.testing.assert_allclose(q, np.einsum("ia,ac->ic", x, w_q))
    np.testing.assert_allclose(k, np.einsum("ja,ac->jc", context, w_k))
    np.testing.assert_allclose(v, np.einsum("ja,ac->jc", context, w_v))


def test_project_qkv_keeps_float32():
    rng = np.random.default_rng(1)
    x = _rand(rng, 4, 6).astype(np.float32)
    ws = [_rand(rng, 6, 3).astype(np.float32) for _ in range(3)]
    assert all(a.dtype == np.float32 for a in project_qkv(x, *ws))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    d_model=st.integers(1, 6),
    d_k=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_swapping_w_q_and_w_k_transposes_the_scores(n, d_model, d_k, seed):
    rng = np.random.default_rng(seed)
    x, w_q, w_k = (
        _rand(rng, n, d_model),
        _rand(rng, d_model, d_k),
        _rand(rng, d_model, d_k),
    )
    q, k, _ = project_qkv(x, w_q, w_k, w_k)
    q2, k2, _ = project_qkv(x, w_k, w_q, w_q)
    np.testing.assert_allclose(q2 @ k2.T, (q @ k.T).T, rtol=1e-10, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 7),
    d_model=st.integers(1, 6),
    d_k=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_tied_weights_give_symmetric_positive_semidefinite_scores(
    n, d_model, d_k, seed
):
    rng = np.random.default_rng(seed)
    x, w = _rand(rng, n, d_model), _rand(rng, d_model, d_k)
    q, k, _ = project_qkv(x, w, w, w)
    s = q @ k.T
    np.testing.assert_allclose(s, s.T, rtol=1e-12, atol=1e-12)
    assert np.linalg.eigvalsh(s).min() >= -1e-9 * max(1.0, np.abs(s).max())
    # Cauchy-Schwarz: an off-diagonal score never exceeds the mean of the two
    # diagonal ones.
    assert np.all(s <= (np.diag(s)[:, None] + np.diag(s)[None, :]) / 2 + 1e-9)


# --- single_head_attention -------------------------------------------------


@pytest.mark.parametrize(
    "n_q, n_k, d_model, d_context, d_k, d_v",
    [
        (4, 4, 6, 6, 3, 2),
        (3, 5, 6, 4, 2, 7),
        (1, 1, 2, 2, 1, 1),
        (1, 6, 3, 5, 4, 3),
        (6, 1, 3, 3, 2, 2),
    ],
)
def test_single_head_attention_matches_a_loop(
    n_q, n_k, d_model, d_context, d_k, d_v
):
    rng = np.random.default_rng(n_q * 10 + n_k)
    x, context = _rand(rng, n_q, d_model), _rand(rng, n_k, d_context)
    w_q, w_k, w_v = (
        _rand(rng, d_model, d_k),
        _rand(rng, d_context, d_k),
        _rand(rng, d_context, d_v),
    )
    out, weights = single_head_attention(x, w_q, w_k, w_v, context=context)
    want_out, want_weights = _loop_attention(
        x, context, w_q, w_k, w_v, 1 / np.sqrt(d_k)
    )
    assert out.shape == (n_q, d_v) and weights.shape == (n_q, n_k)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scale", [None, 1.0, 0.3])
@pytest.mark.parametrize("causal", [False, True])
def test_single_head_attention_matches_torch(scale, causal):
    rng = np.random.default_rng(7)
    x = _rand(rng, 2, 5, 8)
    w_q, w_k, w_v = _rand(rng, 8, 4), _rand(rng, 8, 4), _rand(rng, 8, 3)
    mask = np.tril(np.ones((5, 5), bool)) if causal else None
    out, _ = single_head_attention(x, w_q, w_k, w_v, mask=mask, scale=scale)
    xt = torch.from_numpy(x)
    q, k, v = (xt @ torch.from_numpy(w) for w in (w_q, w_k, w_v))
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale
    )
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-10, atol=1e-12)


def test_single_head_self_attention_equals_cross_attention_with_itself():
    rng = np.random.default_rng(8)
    x = _rand(rng, 5, 6)
    ws = (_rand(rng, 6, 3), _rand(rng, 6, 3), _rand(rng, 6, 4))
    a = single_head_attention(x, *ws)
    b = single_head_attention(x, *ws, context=x)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


# --- errors ------------------------------------------------------------------


def _weights(rng, d_in=6, d_k=3, d_v=2):
    return _rand(rng, d_in, d_k), _rand(rng, d_in, d_k), _rand(rng, d_in, d_v)


def test_vector_x_is_rejected():
    rng = np.random.default_rng(0)
    with pytest.raises(
        ValueError, match=r"x must have at least 2 dimensions.*\(6,\)"
    ):
        project_qkv(_rand(rng, 6), *_weights(rng))


def test_weight_that_is_not_a_matrix_is_rejected():
    rng = np.random.default_rng(0)
    w_q, w_k, w_v = _weights(rng)
    with pytest.raises(ValueError, match=r"w_v must be a matrix.*\(1, 6, 2\)"):
        project_qkv(_rand(rng, 4, 6), w_q, w_k, w_v[None])


def test_transposed_weight_is_named_with_a_hint():
    rng = np.random.default_rng(0)
    w_q, w_k, w_v = _weights(rng)
    with pytest.raises(
        ValueError,
        match=r"w_q of shape \(3, 6\) cannot project x of shape \(4, "
        r"6\).*transposed",
    ):
        project_qkv(_rand(rng, 4, 6), w_q.T, w_k, w_v)


def test_weight_with_wrong_rows_has_no_transpose_hint():
    rng = np.random.default_rng(0)
    w_q, _, w_v = _weights(rng)
    with pytest.raises(
        ValueError, match=r"w_k of shape \(5, 3\) cannot project x"
    ) as info:
        project_qkv(_rand(rng, 4, 6), w_q, _rand(rng, 5, 3), w_v)
    assert "transposed" not in str(info.value)


def test_context_width_is_checked_against_w_k_and_w_v():
    rng = np.random.default_rng(0)
    w_q, w_k, w_v = _weights(rng)
    with pytest.raises(
        ValueError,
        match=r"w_k of shape \(6, 3\) cannot project context of shape \(5, "
        r"4\)",
    ):
        project_qkv(_rand(rng, 2, 6), w_q, w_k, w_v, context=_rand(rng, 5, 4))
    with pytest.raises(
        ValueError,
        match=r"w_v of shape \(6, 2\) cannot project context of shape \(5, "
        r"4\)",
    ):
        project_qkv(
            _rand(rng, 2, 6),
            w_q,
            _rand(rng, 4, 3),
            w_v,
            context=_rand(rng, 5, 4),
        )


def test_queries_and_keys_must_share_d_k():
    rng = np.random.default_rng(0)
    w_q, _, w_v = _weights(rng)
    with pytest.raises(
        ValueError, match=r"w_q \(6, 3\) and w_k \(6, 4\).*same width d_k"
    ):
        project_qkv(_rand(rng, 4, 6), w_q, _rand(rng, 6, 4), w_v)


def test_batch_dimensions_must_broadcast():
    rng = np.random.default_rng(0)
    with pytest.raises(
        ValueError,
        match=r"x \(2, 4, 6\) and context \(3, 5, 6\) do not broadcast",
    ):
        project_qkv(
            _rand(rng, 2, 4, 6), *_weights(rng), context=_rand(rng, 3, 5, 6)
        )


def test_single_head_attention_rejects_a_bad_mask():
    rng = np.random.default_rng(0)
    with pytest.raises(
        ValueError, match=r"mask of shape \(4, 3\) does not broadcast"
    ):
        single_head_attention(
            _rand(rng, 4, 6), *_weights(rng), mask=np.ones((4, 3), bool)
        )
