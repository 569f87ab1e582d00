"""The delta-rule recurrence (attnbook.delta.recurrent) against a float64
numpy loop written in the papers' orientation, and its properties: beta = 0
keeps the state (design.md's seam), beta = 1 overwrites what a key stores,
the update is one gradient step, the named forms are their special cases, and
bad input gets a ValueError."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnbook import _validate
from attnbook.delta.inputs import KEY_NORM_TOL
from attnbook.delta.recurrent import (
    decay_recurrent,
    delta_recurrence,
    delta_rule_recurrent,
    gated_delta_recurrent,
    kda_recurrent,
    linear_recurrent,
)

B, H, N, D_K, D_V = 2, 3, 9, 5, 4


def inputs(seed=0, n=N, channel_gate=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, D_K, generator=g, dtype=torch.float64)
    k = F.normalize(
        torch.randn(B, H, n, D_K, generator=g, dtype=torch.float64), dim=-1
    )
    v = torch.randn(B, H, n, D_V, generator=g, dtype=torch.float64)
    beta = torch.rand(B, H, n, generator=g, dtype=torch.float64)
    shape = (B, H, n, D_K) if channel_gate else (B, H, n)
    gate = 0.5 + 0.5 * torch.rand(shape, generator=g, dtype=torch.float64)
    state = torch.randn(B, H, D_K, D_V, generator=g, dtype=torch.float64)
    return q, k, v, beta, gate, state


def numpy_reference(q, k, v, beta, gate, state, delta=True):
    """M_t = M_{t-1} G_t (I - b k k^T) + b v k^T with M = S^T (d_v, d_k),
    o_t = M_t q_t / sqrt(d_k), one head at a time."""
    q, k, v, beta, gate, state = (
        x.numpy() for x in (q, k, v, beta, gate, state)
    )
    out = np.zeros(v.shape)
    final = np.zeros(state.shape)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            M = state[b, h].T.copy()
            for t in range(q.shape[2]):
                kt, vt, bt = k[b, h, t], v[b, h, t], beta[b, h, t]
                G = np.diag(np.broadcast_to(gate[b, h, t], (k.shape[-1],)))
                proj = np.outer(kt, kt) if delta else 0 * np.outer(kt, kt)
                M = M @ G @ (np.eye(len(kt)) - bt * proj)
                M = M + bt * np.outer(vt, kt)
                out[b, h, t] = M @ q[b, h, t] / np.sqrt(len(kt))
            final[b, h] = M.T
    return out, final


@pytest.mark.parametrize("channel_gate", [False, True])
@pytest.mark.parametrize("delta", [False, True])
def test_recurrence_equals_the_numpy_loop(channel_gate, delta):
    q, k, v, beta, gate, state = inputs(1, channel_gate=channel_gate)
    o, S = delta_recurrence(q, k, v, beta, gate, delta, state)
    ref_o, ref_S = numpy_reference(q, k, v, beta, gate, state, delta)
    np.testing.assert_allclose(o.numpy(), ref_o, rtol=0, atol=1e-12)
    np.testing.assert_allclose(S.numpy(), ref_S, rtol=0, atol=1e-12)


def test_decay_with_a_channel_gate_is_gla():
    """decay_recurrent takes GLA's per-channel gate, Diag(a_t) S + k v^T."""
    q, k, v, beta, gate, state = inputs(3, channel_gate=True)
    o, S = decay_recurrent(q, k, v, gate, initial_state=state)
    ones = torch.ones_like(beta)
    ref_o, ref_S = numpy_reference(q, k, v, ones, gate, state, delta=False)
    np.testing.assert_allclose(o.numpy(), ref_o, rtol=0, atol=1e-12)
    np.testing.assert_allclose(S.numpy(), ref_S, rtol=0, atol=1e-12)


def test_named_forms_are_special_cases():
    q, k, v, beta, gate, state = inputs(2)
    ones = torch.ones_like(beta)
    pairs = [
        (linear_recurrent(q, k, v), delta_recurrence(q, k, v, delta=False)),
        (
            linear_recurrent(q, k, v),
            delta_recurrence(q, k, v, ones, ones, delta=False),
        ),
        (
            decay_recurrent(q, k, v, gate),
            delta_recurrence(q, k, v, None, gate, delta=False),
        ),
        (
            delta_rule_recurrent(q, k, v, beta),
            delta_recurrence(q, k, v, beta, ones),
        ),
        (
            gated_delta_recurrent(q, k, v, gate, beta),
            kda_recurrent(
                q, k, v, gate[..., None].expand(*gate.shape, D_K), beta
            ),
        ),
    ]
    for (o1, s1), (o2, s2) in pairs:
        torch.testing.assert_close(o1, o2, rtol=0, atol=1e-13)
        torch.testing.assert_close(s1, s2, rtol=0, atol=1e-13)


def test_linear_recurrence_is_causal_linear_attention():
    q, k, v, *_ = inputs(3)
    o, S = linear_recurrent(q, k, v, scale=1.0)
    scores = (q @ k.transpose(-1, -2)).tril()
    torch.testing.assert_close(o, scores @ v, rtol=0, atol=1e-12)
    torch.testing.assert_close(S, k.transpose(-1, -2) @ v, rtol=0, atol=1e-12)


def test_beta_zero_keeps_the_state():
    """design.md's seam: with beta = 0 (and no gate) nothing is written."""
    q, k, v, _, _, state = inputs(4)
    zero = torch.zeros(B, H, N, dtype=torch.float64)
    o, S = delta_rule_recurrent(q, k, v, zero, initial_state=state)
    assert torch.equal(S, state)
    torch.testing.assert_close(o, q @ state / D_K**0.5, rtol=0, atol=1e-13)


def test_beta_one_overwrites_what_an_orthonormal_key_stores():
    g = torch.Generator().manual_seed(5)
    basis, _ = torch.linalg.qr(
        torch.randn(D_K, D_K, dtype=torch.float64, generator=g)
    )
    keys = basis.T  # orthonormal rows
    state = torch.randn(D_K, D_V, dtype=torch.float64, generator=g)
    new_v = torch.randn(1, D_V, dtype=torch.float64, generator=g)
    _, S = delta_rule_recurrent(
        keys[None, 2],
        keys[None, 2],
        new_v,
        torch.ones(1, dtype=torch.float64),
        initial_state=state,
    )
    # key 2 now recalls the new value exactly; the others are untouched
    torch.testing.assert_close(keys[2] @ S, new_v[0], rtol=0, atol=1e-13)
    for i in (0, 1, 3, 4):
        torch.testing.assert_close(
            keys[i] @ S, keys[i] @ state, rtol=0, atol=1e-13
        )
    # the additive rule adds instead of replacing
    _, S_add = linear_recurrent(
        keys[None, 2], keys[None, 2], new_v, initial_state=state
    )
    assert (keys[2] @ S_add - new_v[0]).abs().max() > 1e-3


@pytest.mark.parametrize("seed", range(3))
def test_the_delta_update_is_one_gradient_step(seed):
    """S_t = S - beta * grad of 0.5 ||S^T k - v||^2 at S (torch.autograd)."""
    q, k, v, beta, _, state = inputs(seed, n=1)
    S = state.clone().requires_grad_(True)
    loss = (
        0.5 * ((k[..., 0, None, :] @ S)[..., 0, :] - v[..., 0, :]).pow(2).sum()
    )
    (grad,) = torch.autograd.grad(loss, S)
    step = state - beta[..., 0, None, None] * grad
    _, S_t = delta_rule_recurrent(q, k, v, beta, initial_state=state)
    torch.testing.assert_close(S_t, step, rtol=0, atol=1e-13)


@pytest.mark.parametrize("n", [0, 1])
def test_length_zero_and_one(n):
    q, k, v, beta, gate, state = inputs(6, n=n)
    o, S = delta_recurrence(q, k, v, beta, gate, initial_state=state)
    assert o.shape == (B, H, n, D_V)
    ref_o, ref_S = numpy_reference(q, k, v, beta, gate, state)
    np.testing.assert_allclose(o.numpy(), ref_o, rtol=0, atol=1e-12)
    np.testing.assert_allclose(S.numpy(), ref_S, rtol=0, atol=1e-12)
    if n == 0:
        assert torch.equal(S, state)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(beta=1.5), r"beta must lie in \[0, 1\]; got values in"),
        (dict(beta=-0.1), r"beta must lie in \[0, 1\]"),
        (dict(gate=0.0), r"gate must lie in \(0, 1\]; got values in"),
        (dict(gate=1.2), r"gate must lie in \(0, 1\]"),
        (dict(key_scale=1.01), r"unit length .* \|‖k‖ - 1\| is 0.01"),
    ],
)
def test_bad_values_raise(change, message):
    q, k, v, beta, gate, _ = inputs(7)
    if "beta" in change:
        beta = beta.clone()
        beta[0, 0, 3] = change["beta"]
    if "gate" in change:
        gate = gate.clone()
        gate[1, 2, 4] = change["gate"]
    if "key_scale" in change:
        k = k * change["key_scale"]
    with pytest.raises(ValueError, match=message):
        delta_recurrence(q, k, v, beta, gate)


def test_key_norm_tolerance_and_forms_that_need_no_unit_keys():
    q, k, v, beta, gate, _ = inputs(8)
    delta_recurrence(q, k * (1 + 0.9 * KEY_NORM_TOL), v, beta, gate)
    with pytest.raises(ValueError, match="unit length"):
        delta_recurrence(q, k * (1 + 1.1 * KEY_NORM_TOL), v, beta, gate)
    # linear attention and decay take keys of any length
    decay_recurrent(q, 3 * k, v, gate)
    # timing code may turn the value checks off
    with _validate.skip_sync_checks():
        delta_recurrence(q, 3 * k, v, beta, gate)


@pytest.mark.parametrize(
    "shapes, message",
    [
        (dict(k=(B, H, N, D_K + 1)), r"q and k must have the same shape"),
        (dict(v=(B, H, N + 1, D_V)), r"v must have shape \(\.\.\., n, d_v\)"),
        (dict(beta=(B, H, N + 1)), r"beta must have shape \(\.\.\., n\) = "),
        (dict(gate=(B, H, N, D_K + 1)), r"gate must have shape"),
        (dict(state=(B, H, D_V, D_K)), r"initial_state must have shape"),
        (dict(q=(N,)), r"q must have at least 2 dimensions"),
    ],
)
def test_bad_shapes_raise(shapes, message):
    q, k, v, beta, gate, state = inputs(9)

    def make(name, x):
        if name not in shapes:
            return x
        return torch.zeros(shapes[name], dtype=torch.float64) + 0.5

    with pytest.raises(ValueError, match=message):
        delta_recurrence(
            make("q", q),
            make("k", k),
            make("v", v),
            make("beta", beta),
            make("gate", gate),
            initial_state=make("state", state),
        )


def test_named_gated_forms_check_the_gate_shape():
    q, k, v, beta, gate, _ = inputs(10, channel_gate=True)
    with pytest.raises(ValueError, match="one gate per token"):
        gated_delta_recurrent(q, k, v, gate, beta)
    with pytest.raises(ValueError, match="one gate per key channel"):
        kda_recurrent(q, k, v, gate[..., 0], beta)
    with pytest.raises(ValueError, match="must be a torch tensor"):
        delta_recurrence(q.numpy(), k, v)
