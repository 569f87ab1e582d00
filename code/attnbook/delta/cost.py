"""What a head of the delta-rule family costs: flops to train, bytes to decode.

Conventions of :mod:`attnbook.cost`: a multiply-add is 2 flops, so an ``(m,
k) @ (k, n)`` product is ``2 m k n``. Only the products are counted (they
are the leading terms). The elementwise work is left out: ``beta`` and the
subtraction, ``O(n d)`` per head, and a gate, which in the recurrence scales
the whole state at every token, ``d_k d_v`` multiplications per token (the
same order as the products, but one multiplication per entry against their
six flops).

- :func:`recurrent_flops`: per token, the read ``S^T k`` (``2 d_k d_v``), the
  write ``k u^T`` (``2 d_k d_v``) and the output ``S^T q`` (``2 d_k d_v``);
  without the delta correction there is no read.
- :func:`chunkwise_flops`: per chunk of ``m`` tokens, ``K K^T`` and ``Q
  K^T`` (``2 m^2 d_k`` each), the triangular solve for ``[beta K~, beta V]``
  (``m (m - 1)`` per column, ``d_k + d_v`` columns), ``W S_0``, ``Q~ S_0`` and
  ``K^T U`` (``2 m d_k d_v`` each), and ``P U`` (``2 m^2 d_v``); as
  :func:`attnbook.delta.chunkwise.delta_chunkwise` computes them, full
  ``m x m`` products included.
- :func:`softmax_flops`: causal softmax attention computed as
  :func:`attnbook.cost.attention_flops` counts its products, ``2 n^2 (d_k +
  d_v)`` (the whole score matrix, the masked half included).
- :func:`decode_bytes_per_token`: what one decoded token reads per layer: a
  state of ``d_k d_v`` numbers per head, or a cache of ``2 L d`` for a
  context of ``L`` tokens; with ``write=True`` also what it writes: the
  state again (a second ``d_k d_v``), or the token's own key and value.

Chapter 16 (the delta rule) shows them.
"""

from __future__ import annotations

from .. import _validate


def recurrent_flops(n: int, d_k: int, d_v: int, delta: bool = True) -> int:
    """Flops of the recurrence over ``n`` tokens of one head:
    ``6 n d_k d_v`` with the delta correction, ``4 n d_k d_v`` without."""
    n = _validate.nonnegative_int("n", n)
    d_k = _validate.positive_int("d_k", d_k)
    d_v = _validate.positive_int("d_v", d_v)
    return (6 if delta else 4) * n * d_k * d_v


def chunkwise_flops(
    n: int, d_k: int, d_v: int, chunk_size: int, delta: bool = True
) -> int:
    """Flops of the chunkwise form over ``n`` tokens of one head, chunks of
    ``chunk_size`` tokens (the last one shorter when it does not divide
    ``n``)."""
    n = _validate.nonnegative_int("n", n)
    d_k = _validate.positive_int("d_k", d_k)
    d_v = _validate.positive_int("d_v", d_v)
    chunk_size = _validate.positive_int("chunk_size", chunk_size)
    total = 0
    for start in range(0, n, chunk_size):
        m = min(chunk_size, n - start)
        # Q K^T, P U, Q~ S_0 and the state's update K^T U
        total += 2 * m * m * d_k + 2 * m * m * d_v + 4 * m * d_k * d_v
        if delta:  # K K^T, the solve, W S_0
            total += 2 * m * m * d_k + m * (m - 1) * (d_k + d_v)
            total += 2 * m * d_k * d_v
    return total


def softmax_flops(n: int, d_k: int, d_v: int) -> int:
    """Flops of the products of causal softmax attention over ``n`` tokens of
    one head, the whole ``n x n`` score matrix computed: ``2 n^2 (d_k +
    d_v)``."""
    n = _validate.nonnegative_int("n", n)
    d_k = _validate.positive_int("d_k", d_k)
    d_v = _validate.positive_int("d_v", d_v)
    return 2 * n * n * (d_k + d_v)


def decode_bytes_per_token(
    context: int,
    n_heads: int,
    d_k: int,
    d_v: int,
    recurrent: bool,
    bytes_per_element: int = 2,
    write: bool = False,
) -> int:
    """Bytes of state one decoded token reads in one layer after ``context``
    tokens: ``n_heads d_k d_v`` numbers for a recurrent head (whatever the
    context), ``n_heads context (d_k + d_v)`` for a KV cache. With
    ``write=True``, the bytes it reads and writes: a recurrent state is
    written back whole (twice the numbers), a cache gains the token's key and
    value (``n_heads (d_k + d_v)`` more)."""
    context = _validate.nonnegative_int("context", context)
    n_heads = _validate.positive_int("n_heads", n_heads)
    d_k = _validate.positive_int("d_k", d_k)
    d_v = _validate.positive_int("d_v", d_v)
    if recurrent:
        per_head = d_k * d_v * (2 if write else 1)
    else:
        per_head = (context + (1 if write else 0)) * (d_k + d_v)
    return n_heads * per_head * bytes_per_element
