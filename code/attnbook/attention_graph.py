"""Attention as a weighted directed graph over tokens, and attention rollout
across layers.

A matrix of attention weights ``A`` (rows = queries, each summing to 1) is the
adjacency matrix of a weighted directed graph: an edge from token ``j`` to
token ``i`` with weight ``A[i, j]`` says how much of ``j``'s value flows into
``i``'s output. Stacking layers composes the graphs, and products of the
matrices ``A_L ... A_1`` follow information through all of them (attention
rollout, Abnar & Zuidema 2020).

Chapter 17 (perspectives) draws attention graphs of the tiny GPT and rolls
attention out across its layers.
"""

from __future__ import annotations

import numpy as np

from . import _validate


def check_row_stochastic(
    a, name: str = "weights", atol: float = 1e-6
) -> np.ndarray:
    """Return ``a`` as an array after checking that it is row-stochastic.

    a: (..., n, n), non-negative, every row summing to 1 within ``atol``.
    """
    a = np.asarray(a, dtype=float)
    _validate.require_rank(name, a, 2, "(..., n, n)")
    if a.shape[-1] != a.shape[-2]:
        raise ValueError(
            f"{name} must be square in its last two dimensions (..., n, n); "
            f"got {a.shape}"
        )
    if np.any(a < 0):
        raise ValueError(
            f"{name} must be non-negative; its smallest entry is {a.min():.3g}"
        )
    sums = a.sum(axis=-1)
    if not np.allclose(sums, 1.0, atol=atol):
        worst = sums.flat[np.argmax(np.abs(sums - 1.0))]
        raise ValueError(
            f"every row of {name} must sum to 1 (attention weights); one sums "
            f"to {worst:.6g}"
        )
    return a


def attention_rollout(
    weights, residual: float = 0.5, cumulative: bool = False
) -> np.ndarray:
    """Attention rollout: ``R = B_L ... B_2 B_1`` with ``B_l = (1 - residual)
    A_l + residual I``.

    weights: (n_layers, ..., n, n), layer 0 first; each ``A_l`` row-stochastic
    (average the heads of a layer first, as Abnar & Zuidema 2020 do).
    ``residual`` is the weight of the skip connection, 0.5 in the paper: a
    token's output is half its own input and half the attention output. Returns
    ``R (..., n, n)``, row ``i`` = how much each input token contributes to
    token ``i`` at the top; with ``cumulative=True``, all partial products
    ``(n_layers, ..., n, n)``, entry ``l`` = the rollout of layers ``0..l``.
    """
    weights = check_row_stochastic(weights)
    if weights.ndim < 3:
        raise ValueError(
            "weights must have shape (n_layers, ..., n, n); got "
            f"{weights.shape}"
        )
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual must lie in [0, 1]; got {residual!r}")
    eye = np.eye(weights.shape[-1])
    rollout, partial = None, []
    for a in weights:
        b = (1.0 - residual) * a + residual * eye
        # the new layer acts after the earlier ones
        rollout = b if rollout is None else b @ rollout
        partial.append(rollout)
    return np.stack(partial) if cumulative else rollout


def reachable(mask, n_layers: int) -> np.ndarray:
    """Which input tokens can influence which outputs after ``n_layers``
    attention layers.

    mask: bool (n, n), True = may attend, with a True diagonal (every token
    sees itself). Returns bool (n, n): entry ``[i, j]`` is True when a path ``j
    -> ... -> i`` of length ``n_layers`` exists in the graph of the mask.
    Softmax gives every allowed edge a positive weight, so this is exactly
    where ``A_L ... A_1`` is non-zero.
    """
    mask = np.asarray(mask)
    if mask.dtype != bool or mask.ndim != 2 or mask.shape[0] != mask.shape[1]:
        raise ValueError(
            f"mask must be a square boolean matrix (n, n); got {mask.dtype} "
            f"{mask.shape}"
        )
    if not mask.diagonal().all():
        raise ValueError(
            "mask must let every token attend to itself (a True diagonal)"
        )
    n_layers = _validate.positive_int("n_layers", n_layers)
    reach = mask.copy()
    step = mask.astype(np.int64)
    for _ in range(n_layers - 1):
        # one more edge in front of every path
        reach = (step @ reach.astype(np.int64)) > 0
    return reach


def draw_attention_graph(
    ax, weights, labels=None, threshold: float = 0.05, color: str = "#0072B2"
):
    """Draw row-stochastic ``weights`` (n, n) as arcs between tokens placed on
    a line.

    An arc from key ``j`` to query ``i`` (above the line when ``j < i``, below
    otherwise) has a width and opacity proportional to ``weights[i, j]``; the
    self-loop weight ``weights[i, i]`` is the size of the dot at ``i``. Edges
    below ``threshold`` are left out.
    """
    a = check_row_stochastic(weights)
    if a.ndim != 2:
        raise ValueError(f"weights must be one matrix (n, n); got {a.shape}")
    n = a.shape[0]
    t = np.linspace(0.0, np.pi, 40)
    for i in range(n):
        for j in range(n):
            w = a[i, j]
            if i == j or w < threshold:
                continue
            centre, radius = (i + j) / 2, abs(i - j) / 2
            # arcs of earlier keys above
            height = np.sin(t) * radius * (1 if j < i else -1)
            ax.plot(
                centre + radius * np.cos(t) * np.sign(j - i),
                height * 0.9,
                color=color,
                lw=0.5 + 3.5 * w,
                alpha=min(1.0, 0.15 + 0.85 * w),
                solid_capstyle="round",
            )
    ax.scatter(
        np.arange(n),
        np.zeros(n),
        s=15 + 150 * np.diag(a),
        color=color,
        zorder=3,
    )
    ax.set_xticks(range(n), labels=labels if labels is not None else range(n))
    ax.set_yticks([])
    ax.grid(False)
    for side in ("left", "top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_xlim(-0.7, n - 0.3)
