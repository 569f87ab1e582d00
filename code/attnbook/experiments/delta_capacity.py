"""How many key-value pairs a linear-attention state holds, without training.

Write ``n_pairs`` random pairs into one head's state ``S (d_k, d_v)`` with one
of the rules of :mod:`attnbook.delta.recurrent`, read each key back (``S^T
k_i``) and count the pairs whose read is nearer, by cosine, to its own value
than to any other stored value. Keys are random unit vectors (or orthonormal),
values random unit vectors; every write has ``beta = 1``. The rules:

- ``"linear"``: the additive rule ``S += k v^T``;
- ``"decay"``: the additive rule after ``S *= gate``;
- ``"delta"``: the delta rule, ``passes`` passes over the pairs;
- ``"gated_delta"``: the delta rule after ``S *= gate``.

Everything is float64 and deterministic given the seed. Chapter 16 (the delta
rule) runs :func:`recall_accuracy` over seeds and pair counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _validate
from ..delta.recurrent import delta_recurrence

RULES = ("linear", "decay", "delta", "gated_delta")


def random_pairs(n_pairs, d_k, d_v, seed, orthogonal=False, batch=1):
    """Keys (batch, n_pairs, d_k) and values (batch, n_pairs, d_v), unit
    rows, float64; orthogonal keys need ``n_pairs <= d_k``."""
    g = torch.Generator().manual_seed(seed)
    if orthogonal:
        if n_pairs > d_k:
            raise ValueError(
                f"at most d_k={d_k} keys can be orthogonal; got n_pairs="
                f"{n_pairs}"
            )
        basis = torch.linalg.qr(
            torch.randn(batch, d_k, d_k, generator=g, dtype=torch.float64)
        ).Q
        keys = basis.transpose(-1, -2)[:, :n_pairs]
    else:
        keys = torch.randn(
            batch, n_pairs, d_k, generator=g, dtype=torch.float64
        )
    values = torch.randn(batch, n_pairs, d_v, generator=g, dtype=torch.float64)
    return F.normalize(keys, dim=-1), F.normalize(values, dim=-1)


def write_pairs(keys, values, rule, passes=1, gate=0.9):
    """The state after writing every pair ``passes`` times: (batch, d_k,
    d_v)."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}; got {rule!r}")
    passes = _validate.positive_int("passes", passes)
    gates = None
    if rule in ("decay", "gated_delta"):
        gates = torch.full(keys.shape[:-1], float(gate), dtype=keys.dtype)
    state = None
    for _ in range(passes):
        _, state = delta_recurrence(
            keys,
            keys,
            values,
            gate=gates,
            delta=rule in ("delta", "gated_delta"),
            initial_state=state,
        )
    return state


def recall_accuracy(
    n_pairs,
    d_k,
    d_v,
    rule,
    seed,
    passes=1,
    gate=0.9,
    orthogonal=False,
    batch=1,
):
    """The fraction of the ``batch * n_pairs`` pairs whose read is nearest
    to its own value, after :func:`write_pairs`."""
    keys, values = random_pairs(n_pairs, d_k, d_v, seed, orthogonal, batch)
    state = write_pairs(keys, values, rule, passes, gate)
    read = keys @ state  # (batch, n_pairs, d_v): S^T k_i for every i
    cosine = F.normalize(read, dim=-1) @ values.transpose(-1, -2)
    hits = cosine.argmax(dim=-1) == torch.arange(n_pairs)
    return float(hits.double().mean())


def recall_error(keys, values, state):
    """Mean over pairs of ``||S^T k_i - v_i||^2``: keys (batch, n, d_k),
    values (batch, n, d_v), state (batch, d_k, d_v)."""
    return float(((keys @ state - values) ** 2).sum(dim=-1).mean())


def least_squares_state(keys, values):
    """The state of least Frobenius norm among those that minimise
    ``sum_i ||S^T k_i - v_i||^2``: ``pinv(K) V``. keys (..., n, d_k), values
    (..., n, d_v) -> (..., d_k, d_v)."""
    return torch.linalg.pinv(keys) @ values
