"""The delta-rule family a chunk at a time: the UT form.

Within a chunk of ``m`` tokens that starts from the state ``S_0``, let ``D_i``
be the gates multiplied up to token ``i`` (a number, or a diagonal for KDA).
Every write of the recurrence is ``k_i u_i^T`` for some vector ``u_i``, so

    S_i = D_i S_0 + sum_{j<=i} (D_i D_j^-1 k_j) u_j^T,
    u_i = beta_i (v_i - (D_i k_i)^T S_0 - sum_{j<i} A_ij u_j),
    A_ij = k_i^T D_i D_j^-1 k_j.

Stacked over the chunk, ``(I + L) U = diag(beta) (V - K~ S_0)`` with ``L`` the
strictly lower triangle of ``diag(beta) A`` and ``K~`` the rows ``(D_i
k_i)^T``. One triangular solve gives ``U = U' - W S_0`` with ``U' = T
diag(beta) V`` and ``W = T diag(beta) K~``, ``T = (I + L)^-1``: the UT
transform (Yang et al. 2024), which replaces the product of the chunk's ``(I -
beta k k^T)`` factors. The outputs and the state after the chunk are then
matrix products:

    O   = scale (Q~ S_0 + (P * causal) U),  P_ij = q_i^T D_i D_j^-1 k_j,
    S_m = D_m S_0 + sum_j (D_m D_j^-1 k_j) u_j^T.

Without the delta correction ``L`` and ``W`` vanish and ``U = diag(beta) V``.
The last chunk may be shorter than the others.

Chapter 16 (the delta rule) shows :func:`delta_chunkwise`.
"""

from __future__ import annotations

import torch

from .. import _validate
from .inputs import check_delta_inputs


def decayed_products(x, y, log_decay):
    """``x_i^T D_i D_j^-1 y_j`` for ``j <= i``, zero above the diagonal.

    x, y: (..., m, d); log_decay: None, (..., m) or (..., m, d), the gates'
    running sum of logarithms within the chunk. Returns (..., m, m).
    """
    m = x.shape[-2]
    causal = torch.ones(m, m, dtype=torch.bool, device=x.device).tril()
    if log_decay is None:
        return (x @ y.transpose(-1, -2)).masked_fill(~causal, 0)
    if log_decay.ndim == x.ndim - 1:  # one gate per token
        gap = log_decay[..., :, None] - log_decay[..., None, :]
        decay = gap.masked_fill(~causal, float("-inf")).exp()
        return (x @ y.transpose(-1, -2)) * decay
    # one gate per key channel: (..., m, m, d)
    gap = log_decay[..., :, None, :] - log_decay[..., None, :, :]
    decay = gap.masked_fill(~causal[..., None], float("-inf")).exp()
    return torch.einsum("...ic,...jc,...ijc->...ij", x, y, decay)


def delta_chunkwise(
    q,
    k,
    v,
    beta=None,
    gate=None,
    delta: bool = True,
    chunk_size: int = 64,
    initial_state=None,
    scale: float | None = None,
):
    """What :func:`attnbook.delta.recurrent.delta_recurrence` computes, a
    chunk of ``chunk_size`` tokens at a time.

    Arguments and shapes as there; returns ``(o (..., n, d_v), S (..., d_k,
    d_v))``.
    """
    check_delta_inputs(q, k, v, beta, gate, initial_state, unit_keys=delta)
    chunk_size = _validate.positive_int("chunk_size", chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    *lead, n, d_k = k.shape
    S = (
        k.new_zeros(*lead, d_k, v.shape[-1])
        if initial_state is None
        else initial_state.to(v.dtype)
    )
    scalar_gate = gate is not None and gate.ndim == k.ndim - 1
    outs = []
    for start in range(0, n, chunk_size):
        part = slice(start, min(start + chunk_size, n))
        qc, kc, vc = q[..., part, :], k[..., part, :], v[..., part, :]
        b = v.new_ones(vc.shape[:-1]) if beta is None else beta[..., part]
        # the gates' running log within the chunk: (..., m) or (..., m, d_k)
        G = None
        if scalar_gate:
            G = gate[..., part].log().cumsum(dim=-1)
        elif gate is not None:
            G = gate[..., part, :].log().cumsum(dim=-2)
        # D_i as a factor of each row: (..., m, 1) or (..., m, d_k)
        D = 1 if G is None else (G[..., None] if scalar_gate else G).exp()
        vb = b[..., None] * vc
        if delta:
            # L: strictly lower; T (b k~) and T (b v) by one solve
            A = decayed_products(kc, kc, G)
            L = (b[..., None] * A).tril(-1)
            eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
            WU = torch.linalg.solve_triangular(
                eye + L,
                torch.cat([b[..., None] * D * kc, vb], dim=-1),
                upper=False,
                unitriangular=True,
            )
            W, U = WU[..., :d_k], WU[..., d_k:]
            U = U - W @ S
        else:
            U = vb
        P = decayed_products(qc, kc, G)
        outs.append(scale * ((D * qc) @ S + P @ U))
        # the state after the chunk: decay S_0, add the chunk's writes
        if G is None:
            S = S + kc.transpose(-1, -2) @ U
        else:
            last = G[..., -1:, None] if scalar_gate else G[..., -1:, :]
            D_last = last.exp().transpose(-1, -2)  # (..., 1 or d_k, 1)
            kd = kc * (last - (G[..., None] if scalar_gate else G)).exp()
            S = D_last * S + kd.transpose(-1, -2) @ U
    o = torch.cat(outs, dim=-2) if outs else v.new_zeros(v.shape)
    return o, S
