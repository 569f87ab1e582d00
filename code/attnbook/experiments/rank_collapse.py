"""Stacked attention as a dynamical system: tokens that are averaged again and
again collapse.

A layer of pure self-attention replaces every token by a weighted average of
(projected) tokens. Averages of averages become ever more alike: stacked
without skip connections, such layers drive all tokens to one vector, and the
token matrix ``X (n, d)`` to the rank-one matrix ``1 x^T`` (Dong, Cordonnier &
Loukas 2021). The residual connection ``X + Attn(X)`` is what keeps the
differences between tokens alive. Chapter 17 (perspectives) shows
:func:`attention_stack` and measures the collapse with and without skip
connections.
"""

from __future__ import annotations

import numpy as np

from .. import _validate
from ..attention import scaled_dot_product_attention
from ..attention_graph import check_row_stochastic


def rank_one_residual(x) -> np.ndarray:
    """How far the tokens are from all being equal, relative to their size.

    x: (..., n, d) -> (...): ``||X - 1 m^T||_F / ||X||_F`` with ``m`` the mean
    token, the closest matrix with identical rows (in the Frobenius norm). It
    is 0 exactly when every token is the same vector, and scale-free:
    multiplying ``X`` changes nothing.
    """
    x = np.asarray(x, dtype=float)
    _validate.require_rank("x", x, 2, "(..., n, d)")
    centred = x - x.mean(axis=-2, keepdims=True)
    norm = np.linalg.norm(x, axis=(-2, -1))
    return np.linalg.norm(centred, axis=(-2, -1)) / np.where(
        norm > 0, norm, 1.0
    )


def token_diameter(x) -> np.ndarray:
    """The largest Euclidean distance between two tokens. x: (..., n, d) ->
    (...)."""
    x = np.asarray(x, dtype=float)
    _validate.require_rank("x", x, 2, "(..., n, d)")
    # (..., n, n, d)
    diff = x[..., :, None, :] - x[..., None, :, :]
    return np.sqrt(np.max(np.sum(diff * diff, axis=-1), axis=(-2, -1)))


def ergodicity_coefficient(a) -> np.ndarray:
    """Dobrushin's coefficient ``tau(A) = max_{i,i'} (1/2) sum_j |A_ij -
    A_i'j|`` of a row-stochastic A.

    a: (..., n, n) -> (...), in [0, 1]: 0 when all rows are equal (e.g. uniform
    attention), 1 when two rows put their weight on disjoint keys. It bounds
    how much one averaging step can keep tokens apart: ``diameter(A X) <=
    tau(A) * diameter(X)``.
    """
    a = check_row_stochastic(a)
    # (..., n, n)
    tv = 0.5 * np.sum(np.abs(a[..., :, None, :] - a[..., None, :, :]), axis=-1)
    return np.max(tv, axis=(-2, -1))


def random_attention_layers(
    n_layers: int, d: int, seed=None, qk_std: float = 1.0, v_std: float = 1.0
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``n_layers`` triples ``(W_q, W_k, W_v)`` of (d, d) Gaussian matrices.

    Entries have standard deviations ``qk_std / sqrt(d)`` and ``v_std /
    sqrt(d)``, so that ``x W`` keeps (for std 1) the size of ``x``. Small
    ``qk_std`` gives near-uniform attention.
    """
    n_layers = _validate.positive_int("n_layers", n_layers)
    d = _validate.positive_int("d", d)
    rng = np.random.default_rng(seed)
    return [
        tuple(
            rng.normal(scale=s / np.sqrt(d), size=(d, d))
            for s in (qk_std, qk_std, v_std)
        )
        for _ in range(n_layers)
    ]


def attention_stack(x, layers, skip: bool) -> np.ndarray:
    """Run ``x`` through layers of single-head self-attention; return every
    depth's tokens.

    x: (..., n, d); layers: a list of ``(W_q, W_k, W_v)``, each (d, d). Each
    layer computes ``Y = softmax(X W_q (X W_k)^T / sqrt(d)) X W_v`` and sets
    ``X <- X + Y`` when ``skip``, ``X <- Y`` otherwise (no MLP, no
    normalisation: attention alone). Returns (n_layers + 1, ..., n, d), entry 0
    being ``x`` itself.
    """
    x = np.asarray(x, dtype=float)
    _validate.require_rank("x", x, 2, "(..., n, d)")
    states = [x]
    for l, (w_q, w_k, w_v) in enumerate(layers):
        for w in (w_q, w_k, w_v):
            if np.shape(w) != (x.shape[-1], x.shape[-1]):
                raise ValueError(
                    f"layer {l}: weights must be ({x.shape[-1]}, "
                    f"{x.shape[-1]}) for x "
                    f"{x.shape}; got {np.shape(w)}"
                )
        y, _ = scaled_dot_product_attention(x @ w_q, x @ w_k, x @ w_v)
        x = x + y if skip else y
        states.append(x)
    return np.stack(states)
