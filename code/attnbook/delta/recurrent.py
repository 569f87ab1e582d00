"""The delta-rule family as one recurrence over the tokens.

A head keeps a state ``S_t (d_k, d_v)``, stored as in ``transformers`` and in
chapter 17's linear attention (keys index the rows; papers often write the
transpose), and reads it with the query: ``o_t = scale * S_t^T q_t``, ``scale``
``1/sqrt(d_k)`` by default as in ``transformers``. Each token first forgets,
then writes:

    S'  = a_t S_{t-1}                     (gate a_t: a number, or a diagonal)
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T          (the delta rule)
    S_t = S' + beta_t k_t v_t^T                       (additive, delta=False)

so that ``S_t = (I - beta_t k_t k_t^T) a_t S_{t-1} + beta_t k_t v_t^T``: the
gated delta rule (Yang et al. 2025) with a scalar ``a_t``, Kimi Linear's KDA
with one factor per key channel, DeltaNet (Schlag et al. 2021) without a gate,
and linear attention (Katharopoulos et al. 2020) with neither gate nor
correction. :func:`delta_recurrence` runs them all; the named forms are thin
functions on it.

Chapter 16 (the delta rule) shows :func:`delta_recurrence` and the named
forms.
"""

from __future__ import annotations

import torch

from .inputs import check_delta_inputs


def delta_recurrence(
    q,
    k,
    v,
    beta=None,
    gate=None,
    delta: bool = True,
    initial_state=None,
    scale: float | None = None,
):
    """Outputs and final state of the (gated) delta rule, token by token.

    q, k: (..., n, d_k); v: (..., n, d_v); beta: (..., n) in [0, 1], default
    1; gate: (..., n) or (..., n, d_k) in (0, 1], default none (1);
    ``delta=False`` writes ``beta k v^T`` without subtracting what the state
    predicts; initial_state: (..., d_k, d_v), default zeros. With ``delta``,
    keys must have unit length. Returns ``(o (..., n, d_v), S (..., d_k,
    d_v))``.
    """
    check_delta_inputs(q, k, v, beta, gate, initial_state, unit_keys=delta)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    *lead, n, d_k = k.shape
    S = (
        k.new_zeros(*lead, d_k, v.shape[-1])
        if initial_state is None
        else initial_state.to(v.dtype)
    )
    outs = []
    for t in range(n):
        k_t, v_t = k[..., t, :], v[..., t, :]
        if gate is not None:
            # forget: the whole state, or each key channel's row
            if gate.ndim == k.ndim:
                a_t = gate[..., t, :, None]
            else:
                a_t = gate[..., t, None, None]
            S = a_t * S
        if delta:
            # (..., d_v): the error of what S recalls under k_t
            v_t = v_t - (k_t[..., None, :] @ S)[..., 0, :]
        if beta is not None:
            v_t = beta[..., t, None] * v_t
        S = S + k_t[..., :, None] * v_t[..., None, :]
        outs.append(scale * (q[..., t, None, :] @ S)[..., 0, :])
    o = torch.stack(outs, dim=-2) if n else v.new_zeros(v.shape)
    return o, S


def linear_recurrent(q, k, v, initial_state=None, scale=None):
    """Linear attention, ``S_t = S_{t-1} + k_t v_t^T``; shapes as in
    :func:`delta_recurrence`."""
    return delta_recurrence(
        q, k, v, delta=False, initial_state=initial_state, scale=scale
    )


def decay_recurrent(q, k, v, gate, initial_state=None, scale=None):
    """Decay without a correction. With gate (..., n), one number per head
    and token (RetNet's fixed gamma, Mamba-2's a_t): ``S_t = a_t S_{t-1} +
    k_t v_t^T``. With gate (..., n, d_k), one number per key channel (GLA's
    gate): ``S_t = Diag(a_t) S_{t-1} + k_t v_t^T``."""
    return delta_recurrence(
        q, k, v, None, gate, False, initial_state=initial_state, scale=scale
    )


def delta_rule_recurrent(q, k, v, beta, initial_state=None, scale=None):
    """DeltaNet, ``S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``;
    beta: (..., n)."""
    return delta_recurrence(
        q, k, v, beta, initial_state=initial_state, scale=scale
    )


def gated_delta_recurrent(q, k, v, gate, beta, initial_state=None, scale=None):
    """Gated DeltaNet, ``S_t = (I - b_t k_t k_t^T) a_t S_{t-1} + b_t k_t
    v_t^T``; gate, beta: (..., n)."""
    if gate.shape != k.shape[:-1]:
        raise ValueError(
            f"the gated delta rule takes one gate per token (..., n) = "
            f"{tuple(k.shape[:-1])}; got {tuple(gate.shape)}"
        )
    return delta_recurrence(
        q, k, v, beta, gate, initial_state=initial_state, scale=scale
    )


def kda_recurrent(q, k, v, gate, beta, initial_state=None, scale=None):
    """Kimi delta attention, ``S_t = (I - b_t k_t k_t^T) diag(a_t) S_{t-1} +
    b_t k_t v_t^T``; gate: (..., n, d_k), one factor per key channel."""
    if gate.shape != k.shape:
        raise ValueError(
            f"KDA takes one gate per key channel (..., n, d_k) = "
            f"{tuple(k.shape)}; got {tuple(gate.shape)}"
        )
    return delta_recurrence(
        q, k, v, beta, gate, initial_state=initial_state, scale=scale
    )
