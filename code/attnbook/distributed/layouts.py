"""Which tokens each device holds, and how much causal work that gives it.

Context parallelism splits one sequence of ``n`` tokens over ``P`` devices
(ranks). Each rank keeps the queries of its tokens; in ring attention the keys
and values of every rank pass around the ring, and rank ``r`` computes the
scores of its queries against each visiting block. Under a causal mask only
the pairs with key position <= query position count, so how the tokens are
laid out decides how the work is shared:

- ``"contiguous"``: rank ``r`` holds the ``r``-th of ``P`` consecutive
  blocks. The last rank's queries see every key, the first rank's only its
  own block: the last does about ``2 - 1/P`` times the average work.
- ``"striped"`` (Brandon et al. 2023): token ``t`` lives on rank ``t mod P``.
  Every rank holds a sample of the whole sequence; the ranks' work differs by
  at most ``ceil(n / P) (P - 1)`` pairs.
- ``"zigzag"`` (the load balancing of Megatron-LM's and Llama 3's context
  parallelism): the sequence is cut into ``2P`` chunks and rank ``r`` holds
  chunks ``r`` and ``2P - 1 - r``, an early chunk and its mirror image. When
  ``2P`` divides ``n`` every rank does exactly the same work, ``c^2 (2P -
  1) + c (c + 1)`` pairs with chunks of ``c = n / 2P`` tokens, and at every
  ring step too; otherwise the ranks differ by at most ``2n`` pairs
  (:func:`zigzag_spread`).

When ``P`` (or ``2P``) does not divide ``n``, the blocks, stripes and chunks
have the sizes :func:`numpy.array_split` gives: the first ``n mod P`` blocks
(``n mod 2P`` chunks) have one token more. Every layout partitions
``range(n)``, each rank's positions in increasing order.

Ring attention's time is not the total work but, step by step, the slowest
rank's block (the ranks wait for one another before the next step):
:func:`step_work` gives each rank's work at each step and :func:`makespan`
the sum over the steps of the slowest.

Numpy inside; :func:`layout_positions` returns torch tensors (what a process
of ``torch.distributed`` uses to index its shard), importing torch when it is
called. Chapter 11 (attention across devices) shows these functions.
"""

from __future__ import annotations

import numpy as np

from .. import _validate

LAYOUTS = ("contiguous", "striped", "zigzag")


def check_layout(n, world_size, layout) -> tuple[int, int]:
    """``(n, world_size)`` as ints, or a ValueError naming what is wrong:
    ``n >= 0``, ``world_size >= 1``, ``layout`` one of :data:`LAYOUTS`."""
    n = _validate.nonnegative_int("n", n)
    world_size = _validate.positive_int("world_size", world_size)
    if layout not in LAYOUTS:
        raise ValueError(
            f"layout must be one of {', '.join(map(repr, LAYOUTS))}; got "
            f"{layout!r}"
        )
    return n, world_size


def positions_numpy(n: int, world_size: int, layout: str) -> list[np.ndarray]:
    """:func:`layout_positions` as int64 numpy arrays."""
    n, world_size = check_layout(n, world_size, layout)
    tokens = np.arange(n, dtype=np.int64)
    if layout == "contiguous":
        return np.array_split(tokens, world_size)
    if layout == "striped":
        return [tokens[r::world_size] for r in range(world_size)]
    # zigzag: 2P chunks; rank r holds chunk r and its mirror 2P - 1 - r
    chunks = np.array_split(tokens, 2 * world_size)
    return [
        np.concatenate([chunks[r], chunks[2 * world_size - 1 - r]])
        for r in range(world_size)
    ]


def layout_positions(n: int, world_size: int, layout: str) -> list:
    """The global positions of the tokens each rank holds: a list of
    ``world_size`` 1-D int64 torch tensors, in rank order, that partition
    ``range(n)`` (each in increasing order).

    ``layout`` is ``"contiguous"``, ``"striped"`` or ``"zigzag"`` (the module
    docstring). When ``world_size`` (``2 * world_size`` for zigzag) does not
    divide ``n``, the first ``n mod world_size`` blocks (``n mod 2
    world_size`` chunks) hold one token more, as :func:`numpy.array_split`
    cuts; ranks may hold no token when ``n < world_size``.
    """
    import torch

    return [
        torch.from_numpy(p) for p in positions_numpy(n, world_size, layout)
    ]


def pairs_below(queries: np.ndarray, keys: np.ndarray) -> int:
    """How many (query, key) pairs have key position <= query position."""
    keys = np.sort(np.asarray(keys, dtype=np.int64))
    return int(np.searchsorted(keys, queries, side="right").sum())


def causal_work(n: int, world_size: int, layout: str) -> list[int]:
    """Per rank, the (query, key) pairs with key <= query whose query the rank
    holds: the scores a causal ring must compute on that rank (a query at
    position ``t`` sees ``t + 1`` keys), the work of a kernel that skips the
    masked ones. They sum to ``n (n + 1) / 2``. (The ring of
    :mod:`attnbook.distributed.ring` computes every score of a block and
    masks the hidden ones.)"""
    return [int((p + 1).sum()) for p in positions_numpy(n, world_size, layout)]


def step_work(n: int, world_size: int, layout: str) -> np.ndarray:
    """``(world_size, world_size)`` int64: entry ``[s, r]`` is the causal
    pairs rank ``r`` computes at ring step ``s``, when it holds the key and
    value block of rank ``(r - s) mod world_size`` (each rank sends its
    block to rank ``r + 1`` after each step, so at step 0 every rank has its
    own). Each column sums to :func:`causal_work` of that rank."""
    held = positions_numpy(n, world_size, layout)
    work = np.zeros((world_size, world_size), dtype=np.int64)
    for s in range(world_size):
        for r in range(world_size):
            work[s, r] = pairs_below(held[r], held[(r - s) % world_size])
    return work


def makespan(n: int, world_size: int, layout: str) -> int:
    """The ring's causal time in pairs: the sum over its steps of the largest
    block any rank computes at that step (no rank starts step ``s + 1``
    before the slowest has finished step ``s``). At least ``ceil(n (n + 1) /
    (2 world_size))``, the work shared perfectly."""
    return int(step_work(n, world_size, layout).max(axis=1).sum())


def imbalance(work) -> float:
    """The largest share over the mean: 1.0 when every rank does the same
    work (and when there is none)."""
    work = np.asarray(work, dtype=np.float64)
    mean = work.mean()
    return float(work.max() / mean) if mean > 0 else 1.0


def zigzag_spread(n: int, world_size: int) -> int:
    """The exact difference between the largest and the smallest
    :func:`causal_work` of the zigzag layout.

    With ``n = 2 P q + m`` (``0 <= m < 2P``) and the chunks of
    :func:`numpy.array_split`: 0 when ``m = 0`` (the balance theorem);
    ``(3qm - q + m) - (qm + q + 1)`` when ``m = P``, and ``(3qm - q + m) -
    min(qm + q + 1, 2qm)`` when ``0 < m < P``; ``q (2P - 1 - m) + 2P (q + 1)``
    when ``m > P``. In every case it is at most ``2n``, so the spread relative
    to the mean work ``n (n + 1) / (2P)`` is at most ``4P / (n + 1)``.
    """
    n, p = check_layout(n, world_size, "zigzag")
    q, m = divmod(n, 2 * p)
    if m == 0:
        return 0
    if m <= p:
        low = q * m + q + 1 if m == p else min(q * m + q + 1, 2 * q * m)
        return 3 * q * m - q + m - low
    return q * (2 * p - 1 - m) + 2 * p * (q + 1)
