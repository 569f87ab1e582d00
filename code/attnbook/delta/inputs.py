"""The checks that every form of the delta-rule family shares.

Shapes: ``q, k (..., n, d_k)``, ``v (..., n, d_v)``, ``beta (..., n)``, the
gate ``(..., n)`` (one factor per head and token) or ``(..., n, d_k)`` (one
per key channel, Kimi Linear's KDA), a state ``(..., d_k, d_v)``. Values: the
write strength ``beta`` in ``[0, 1]``, the gate in ``(0, 1]``, and, where the
form subtracts what the state predicts (the delta rule), keys of unit length
within :data:`KEY_NORM_TOL`. The value checks read the tensors, a GPU sync, so
they run only while :func:`attnbook._validate.sync_checks_enabled`.

Chapter 16 (the delta rule) uses them through every form it shows.
"""

from __future__ import annotations

import torch

from .. import _validate

# |‖k‖ - 1| allowed for a key of the delta rule: loose enough for float32
# keys normalised in float32 (error about 1e-7), tight enough that
# I - beta k k^T stays within 0.2 % of a projection.
KEY_NORM_TOL = 1e-3


def _shape(x) -> tuple[int, ...]:
    return tuple(x.shape)


def check_delta_inputs(
    q, k, v, beta=None, gate=None, initial_state=None, unit_keys=False
) -> None:
    """Raise ``ValueError`` unless the inputs of a delta-rule form fit.

    q, k: (..., n, d_k); v: (..., n, d_v); beta: (..., n) in [0, 1]; gate:
    (..., n) or (..., n, d_k) in (0, 1]; initial_state: (..., d_k, d_v);
    ``unit_keys``: every key must have length 1 (within
    :data:`KEY_NORM_TOL`).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(
                f"{name} must be a torch tensor; got {type(x).__name__}"
            )
        _validate.require_rank(name, x, 2, "(..., n, d)")
    if _shape(q) != _shape(k):
        raise ValueError(
            "q and k must have the same shape (..., n, d_k); got "
            f"q {_shape(q)}, k {_shape(k)}"
        )
    lead, d_k, d_v = _shape(k)[:-1], k.shape[-1], v.shape[-1]
    if _shape(v)[:-1] != lead:
        raise ValueError(
            f"v must have shape (..., n, d_v) with (..., n) = {lead} as k; "
            f"got v {_shape(v)}, k {_shape(k)}"
        )
    if beta is not None and _shape(beta) != lead:
        raise ValueError(
            f"beta must have shape (..., n) = {lead}; got {_shape(beta)}"
        )
    if gate is not None and _shape(gate) not in (lead, lead + (d_k,)):
        raise ValueError(
            f"gate must have shape (..., n) = {lead} or (..., n, d_k) = "
            f"{lead + (d_k,)}; got {_shape(gate)}"
        )
    if initial_state is not None:
        want = lead[:-1] + (d_k, d_v)
        if _shape(initial_state) != want:
            raise ValueError(
                f"initial_state must have shape (..., d_k, d_v) = {want}; "
                f"got {_shape(initial_state)}"
            )
    if _validate.sync_checks_enabled():
        check_values(k, beta, gate, unit_keys)


def check_values(k, beta=None, gate=None, unit_keys=False) -> None:
    """Raise unless beta lies in [0, 1], the gate in (0, 1] and (with
    ``unit_keys``) every key has length 1 within :data:`KEY_NORM_TOL`."""
    if beta is not None and beta.numel():
        low, high = float(beta.detach().min()), float(beta.detach().max())
        if not (0 <= low and high <= 1):
            raise ValueError(
                f"beta must lie in [0, 1]; got values in [{low}, {high}]"
            )
    if gate is not None and gate.numel():
        low, high = float(gate.detach().min()), float(gate.detach().max())
        if not (0 < low and high <= 1):
            raise ValueError(
                f"the gate must lie in (0, 1]; got values in [{low}, {high}]"
            )
    if unit_keys and k.numel():
        err = (torch.linalg.vector_norm(k.detach(), dim=-1) - 1).abs().max()
        if not float(err) <= KEY_NORM_TOL:
            raise ValueError(
                "the delta rule needs keys of unit length (normalise them, "
                "e.g. torch.nn.functional.normalize); the largest "
                f"|‖k‖ - 1| is {float(err):.3g} > {KEY_NORM_TOL}"
            )
