"""FlashAttention in numpy: attention computed tile by tile, never holding the
n_q x n_k matrix.

The score matrix is cut into tiles of ``block_q`` queries by ``block_k`` keys.
For each block of queries the tiles of keys are visited left to right, and the
online softmax (:mod:`attnbook.online_softmax`) keeps, per query, a running
maximum ``m``, a running sum ``l`` and an unnormalised output ``acc``; every
tile rescales the three to its new maximum. Only one tile of scores exists at a
time, so the extra memory is ``O(batch * block_q * block_k)`` on top of the
``O(batch * n * d)`` inputs and output. The backward pass recomputes the tiles
from the log-sum-exp ``lse = m + log(l)`` saved by the forward pass.

Causal attention uses :func:`attnbook.causal_mask`'s convention: the queries
are the *last* ``n_q`` of ``n_k`` positions, so query ``i`` sees keys ``j <= i
+ n_k - n_q``. Tiles that are entirely above that diagonal are skipped.

Chapter 9 (FlashAttention) shows :func:`attend_query_block`,
:func:`flash_attention_numpy`, :func:`key_tiles` and the backward pass; chapter
10 checks its Triton kernels against them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import _validate
from .softmax import float_dtype


# --- which tiles to visit --------------------------------------------------


def key_tiles(
    rows: slice, n_q: int, n_k: int, block_k: int, causal: bool = False
) -> Iterator[tuple[slice, bool]]:
    """The key blocks that the query block ``rows`` must visit, left to right.

    Yields ``(cols, partial)``; ``partial`` is True when some key of the tile
    lies after some query of the block, so the tile needs a mask. With
    ``causal``, the blocks after the last visible key are never yielded.
    """
    offset = n_k - n_q  # query i sits at absolute position i + offset
    end = min(n_k, rows.stop + offset) if causal else n_k
    for j0 in range(0, end, block_k):
        cols = slice(j0, min(j0 + block_k, n_k))
        yield cols, causal and cols.stop - 1 > rows.start + offset


def tile_schedule(
    n_q: int, n_k: int, block_q: int, block_k: int, causal: bool = False
) -> Iterator[tuple[slice, slice, bool]]:
    """Every tile ``(rows, cols, partial)`` of the score matrix that the
    algorithm computes."""
    for i0 in range(0, n_q, block_q):
        rows = slice(i0, min(i0 + block_q, n_q))
        for cols, partial in key_tiles(rows, n_q, n_k, block_k, causal):
            yield rows, cols, partial


def _tile_mask(rows: slice, cols: slice, offset: int) -> np.ndarray:
    """(len(rows), len(cols)) bool, True where key ``j`` is visible to query
    ``i``: j <= i + offset."""
    return (
        np.arange(cols.start, cols.stop)[None, :]
        <= np.arange(rows.start, rows.stop)[:, None] + offset
    )


# --- the forward pass ------------------------------------------------------


def attend_query_block(q_blk, k, v, tiles, rows: slice, offset: int):
    """Online-softmax attention of one query block over the key tiles it
    visits.

    q_blk: (B, b_q, d_k), already multiplied by the scale; k: (B, n_k, d_k);
    v: (B, n_k, d_v); ``tiles`` the ``(cols, partial)`` pairs of
    :func:`key_tiles`; ``rows`` the block's query indices and ``offset = n_k -
    n_q`` (for the causal mask). Returns ``acc / l`` (B, b_q, d_v) and ``lse``
    (B, b_q).
    """
    batch, b_q = q_blk.shape[:2]
    # running max of each query's scores
    m = np.full((batch, b_q, 1), -np.inf, q_blk.dtype)
    # running sum of exp(score - m)
    l = np.zeros((batch, b_q, 1), q_blk.dtype)
    # running sum of exp(score - m) * v
    acc = np.zeros((batch, b_q, v.shape[-1]), q_blk.dtype)
    for cols, partial in tiles:
        # (B, b_q, b_k): the only scores in memory
        s = q_blk @ k[:, cols].transpose(0, 2, 1)
        # hide the keys these queries may not see
        if partial:
            s = np.where(_tile_mask(rows, cols, offset), s, -np.inf)
        # m_new is finite: the first tile holds key 0, which every query sees
        # (n_q <= n_k when causal)
        m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
        # moves the old sums to the new max; <= 1
        alpha = np.exp(m - m_new)
        # (B, b_q, b_k), entries in [0, 1]
        p = np.exp(s - m_new)
        l = alpha * l + p.sum(axis=-1, keepdims=True)
        acc = alpha * acc + p @ v[:, cols]
        m = m_new
    # l = 0: the query saw no key, its output is 0
    seen = l != 0
    out = np.where(seen, acc / np.where(seen, l, 1), 0).astype(
        acc.dtype, copy=False
    )
    # log(0) = -inf: the lse of a row that sees no key
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[..., 0]
    return out, lse


def flash_attention_numpy(
    q,
    k,
    v,
    causal: bool = False,
    block_q: int = 64,
    block_k: int = 64,
    scale: float | None = None,
    return_lse: bool = False,
    workers: int | None = None,
):
    """Exact attention ``softmax(scale * q k^T) v``, computed in tiles of
    ``block_q x block_k``.

    q: (..., n_q, d_k), k: (..., n_k, d_k), v: (..., n_k, d_v); leading dims
    broadcast. Returns the output (..., n_q, d_v) in the inputs' dtype, and
    with ``return_lse`` also the log-sum-exp of each query's scores, (...,
    n_q), which the backward pass needs. float16 inputs are computed in
    float32. ``causal`` follows :func:`attnbook.causal_mask` (needs n_q <= n_k)
    and skips fully masked tiles. Query blocks are independent, so ``workers``
    threads (default: :func:`usable_cpus`, one per logical CPU this process
    may use) process them in parallel, as a GPU spreads them over its SMs.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    batch, n_q, n_k, d_k, d_v = _check(q, k, v, causal, block_q, block_k)
    dtype = np.result_type(q, k, v, np.float32)  # the accumulators' precision
    scale = np.asarray(1.0 / np.sqrt(d_k) if scale is None else scale, dtype)
    # (B, n, d), B = prod(batch)
    q3, k3, v3 = (_flat(x, batch, dtype) for x in (q, k, v))
    out = np.empty((q3.shape[0], n_q, d_v), dtype)
    lse = np.empty((q3.shape[0], n_q), dtype)

    def attend(rows: slice) -> None:
        # scale the b_q x d_k block once, not every tile of scores
        q_blk = q3[:, rows] * scale
        tiles = key_tiles(rows, n_q, n_k, block_k, causal)
        out[:, rows], lse[:, rows] = attend_query_block(
            q_blk, k3, v3, tiles, rows, n_k - n_q
        )

    _run_in_threads(
        attend,
        [slice(i0, min(i0 + block_q, n_q)) for i0 in range(0, n_q, block_q)],
        workers,
    )
    out = out.reshape(batch + (n_q, d_v)).astype(
        float_dtype(q, k, v), copy=False
    )
    return (out, lse.reshape(batch + (n_q,))) if return_lse else out


def usable_cpus() -> int:
    """The number of logical CPUs in this process's affinity mask.

    ``os.cpu_count()`` counts the machine's CPUs; a container, a CI runner or
    ``taskset`` may shrink the mask, and more threads than that only take
    turns. Python 3.13's ``os.process_cpu_count()`` answers this; before it,
    the affinity mask (``os.sched_getaffinity``, Linux), else
    ``os.cpu_count()``. A CPU quota (cgroup ``cpu.max``, ``docker --cpus``)
    leaves the mask whole, so there this counts every CPU and ``workers``
    should be set by hand.
    """
    if hasattr(os, "process_cpu_count"):
        return os.process_cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def _run_in_threads(
    fn: Callable, items: Sequence, workers: int | None
) -> None:
    """Call ``fn(item)`` for every item on up to ``workers`` threads (None:
    :func:`usable_cpus`, one per logical CPU the process may use).

    numpy releases Python's global interpreter lock inside its array
    operations, so threads that work on different blocks run on different
    cores. In the browser (Pyodide) no thread can start: the items run one
    after another there, whatever ``workers`` says.
    """
    workers = (
        usable_cpus()
        if workers is None
        else _validate.positive_int("workers", workers)
    )
    if min(workers, len(items)) <= 1 or sys.platform == "emscripten":
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(min(workers, len(items))) as pool:
        # iterating re-raises an exception from a worker
        for _ in pool.map(fn, items):
            pass


# --- the backward pass -----------------------------------------------------


def flash_attention_backward_numpy(
    q,
    k,
    v,
    out,
    lse,
    d_out,
    causal: bool = False,
    block_q: int = 64,
    block_k: int = 64,
    scale: float | None = None,
):
    """Gradients ``(dq, dk, dv)`` of a loss whose gradient with respect to the
    output is ``d_out``.

    q, k, v as in :func:`flash_attention_numpy`; ``out`` (..., n_q, d_v) and
    ``lse`` (..., n_q) are what it returned (``return_lse=True``); ``d_out``
    has the shape of ``out``. Each probability tile is recomputed as
    ``exp(scale * q k^T - lse)``, so no ``n_q x n_k`` array is stored here
    either.
    """
    q, k, v, out, lse, d_out = map(np.asarray, (q, k, v, out, lse, d_out))
    batch, n_q, n_k, d_k, d_v = _check(q, k, v, causal, block_q, block_k)
    _check_saved(out, lse, d_out, batch + (n_q, d_v))
    dtype = np.result_type(q, k, v, d_out, np.float32)
    scale = 1.0 / np.sqrt(d_k) if scale is None else scale
    q3, k3, v3, o3, do3 = (
        _flat(x, batch, dtype) for x in (q, k, v, out, d_out)
    )
    lse3 = _flat(lse[..., None], batch, dtype)  # (B, n_q, 1)
    # (B, n_q, 1): rowsum(dO * O)
    delta = np.sum(do3 * o3, axis=-1, keepdims=True)
    dq, dk, dv = np.zeros_like(q3), np.zeros_like(k3), np.zeros_like(v3)
    for rows, cols, partial in tile_schedule(
        n_q, n_k, block_q, block_k, causal
    ):
        s = scale * (q3[:, rows] @ k3[:, cols].transpose(0, 2, 1))
        # the forward pass's mask
        if partial:
            s = np.where(_tile_mask(rows, cols, n_k - n_q), s, -np.inf)
        # the forward's weights, recomputed
        p = np.exp(s - lse3[:, rows])
        dv[:, cols] += p.transpose(0, 2, 1) @ do3[:, rows]
        dp = do3[:, rows] @ v3[:, cols].transpose(0, 2, 1)
        # through the softmax
        ds = p * (dp - delta[:, rows])
        dq[:, rows] += scale * (ds @ k3[:, cols])
        dk[:, cols] += scale * (ds.transpose(0, 2, 1) @ q3[:, rows])
    grads = (dq, dk, dv)
    return tuple(
        _unbroadcast(g.reshape(batch + g.shape[1:]), x.shape).astype(
            float_dtype(q, k, v), copy=False
        )
        for g, x in zip(grads, (q, k, v))
    )


# --- shapes and dtypes -----------------------------------------------------


def _check(q, k, v, causal, block_q, block_k):
    """Validate the inputs; return ``(batch, n_q, n_k, d_k, d_v)``."""
    batch, n_q, n_k, d_k, d_v = _validate.attention_shapes(q, k, v)
    _validate.positive_int("block_q", block_q)
    _validate.positive_int("block_k", block_k)
    if causal:
        _validate.queries_fit(
            "causal attention",
            n_q,
            n_k,
            f"q {tuple(q.shape)} and k {tuple(k.shape)}",
        )
    return batch, n_q, n_k, d_k, d_v


def _check_saved(out, lse, d_out, out_shape):
    if (
        out.shape != out_shape
        or d_out.shape != out_shape
        or lse.shape != out_shape[:-1]
    ):
        raise ValueError(
            f"expected out and d_out of shape {out_shape} and lse of shape "
            f"{out_shape[:-1]}; "
            f"got out {out.shape}, d_out {d_out.shape}, lse {lse.shape}"
        )


def _flat(x, batch: tuple[int, ...], dtype) -> np.ndarray:
    """x (..., n, d) broadcast to ``batch`` and reshaped to (prod(batch), n,
    d); a view when it can be."""
    x = np.broadcast_to(x.astype(dtype, copy=False), batch + x.shape[-2:])
    # not -1: n or d may be 0
    return x.reshape((int(np.prod(batch)),) + x.shape[-2:])


def _unbroadcast(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``g`` over the axes that broadcasting added to, or stretched in, an
    array of ``shape``."""
    g = (
        g.sum(axis=tuple(range(g.ndim - len(shape))))
        if g.ndim > len(shape)
        else g
    )
    stretched = tuple(
        i for i, (a, b) in enumerate(zip(shape, g.shape)) if a == 1 and b != 1
    )
    return g.sum(axis=stretched, keepdims=True) if stretched else g
