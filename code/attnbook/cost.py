"""What naive attention costs: the floating-point operations it performs and
the bytes it stores.

Naive attention ``softmax(q k^T / sqrt(d_k)) v`` materialises the whole ``n_q x
n_k`` score matrix, so both counts grow with ``n_q * n_k``: quadratic in the
sequence length for self-attention. The counts here are the model the softmax
chapter checks against measurements (and the FlashAttention chapter sets out to
beat). Chapter 4 (softmax) shows :func:`attention_flop_breakdown` and
:func:`attention_memory_breakdown`; chapter 5 counts multi-head layers with
them, and chapter 10 measures TFLOP/s with :func:`benchmark_flops`, the
FlashAttention papers' convention.

Conventions: a multiply-add is 2 flops (so an ``(m, k) @ (k, n)`` product is
``2 m k n``); every elementwise operation, ``exp`` included, is 1 flop; a
reduction over ``n`` entries is counted as ``n`` operations. ``batch`` is the
product of all leading dimensions (batch times heads).
"""

from __future__ import annotations

from ._validate import positive_int

#: Elementwise operations per score in a max-subtracted softmax: the running
#: max, the subtraction, exp, the running sum and the division.
SOFTMAX_FLOPS_PER_SCORE = 5


def attention_flop_breakdown(
    n_q: int, n_k: int, d_k: int, d_v: int, batch: int = 1
) -> dict[str, int]:
    """Flops of each step of naive attention.

    Shapes: ``q (batch, n_q, d_k)``, ``k (batch, n_k, d_k)``, ``v (batch, n_k,
    d_v)``.

    Returns ``{"scores": 2 n_q n_k d_k, "scale": n_q n_k, "softmax": 5 n_q n_k,
    "weighted_sum": 2 n_q n_k d_v}``, each times ``batch``.
    """
    n_q, n_k, d_k, d_v, batch = _positive(
        n_q=n_q, n_k=n_k, d_k=d_k, d_v=d_v, batch=batch
    )
    pairs = batch * n_q * n_k  # one score per (query, key) pair
    return {
        # q @ k^T: a length-d_k dot product per pair
        "scores": 2 * pairs * d_k,
        "scale": pairs,  # times 1/sqrt(d_k)
        "softmax": SOFTMAX_FLOPS_PER_SCORE * pairs,
        # weights @ v: each weight multiplies a d_v-row
        "weighted_sum": 2 * pairs * d_v,
    }


def attention_flops(
    n_q: int, n_k: int, d_k: int, d_v: int, batch: int = 1
) -> int:
    """Total flops of naive attention: ``batch * n_q * n_k * (2 d_k + 2 d_v +
    6)``, O(n^2 d)."""
    return sum(attention_flop_breakdown(n_q, n_k, d_k, d_v, batch).values())


def attention_memory_breakdown(
    n_q: int,
    n_k: int,
    d_k: int,
    d_v: int,
    batch: int = 1,
    bytes_per_element: int = 4,
) -> dict[str, int]:
    """Bytes of the arrays naive attention creates (its inputs, owned by the
    caller, excluded).

    Returns ``{"scores": n_q n_k, "weights": n_q n_k, "output": n_q d_v}``
    elements, each times ``batch * bytes_per_element``. ``d_k`` is validated
    but stores nothing new: it only sets the cost of computing the scores.
    """
    n_q, n_k, d_k, d_v, batch, size = _positive(
        n_q=n_q,
        n_k=n_k,
        d_k=d_k,
        d_v=d_v,
        batch=batch,
        bytes_per_element=bytes_per_element,
    )
    return {
        # q k^T / sqrt(d_k), the n^2 term
        "scores": batch * n_q * n_k * size,
        # softmax of the scores, another n^2
        "weights": batch * n_q * n_k * size,
        "output": batch * n_q * d_v * size,
    }


def attention_memory_bytes(
    n_q: int,
    n_k: int,
    d_k: int,
    d_v: int,
    batch: int = 1,
    bytes_per_element: int = 4,
) -> int:
    """Bytes naive attention stores beyond its inputs.

    ``batch * (2 n_q n_k + n_q d_v) * bytes_per_element``: O(n^2), whatever
    ``d``.
    """
    return sum(
        attention_memory_breakdown(
            n_q, n_k, d_k, d_v, batch, bytes_per_element
        ).values()
    )


def _positive(**values) -> list[int]:
    """Each named value as an int, or a ValueError naming the one that is not a
    positive integer."""
    return [positive_int(name, value) for name, value in values.items()]


def benchmark_flops(
    batch: int,
    heads: int,
    n: int,
    d: int,
    causal: bool = False,
    mode: str = "fwd",
) -> float:
    """Floating-point operations of attention as the FlashAttention papers
    count them for benchmarks.

    Forward: two matrix products of ``n x n x d`` per head (``S = Q K^T`` and
    ``O = P V``), each ``2 n^2 d`` FLOPs (a multiply and an add per term):
    ``4 * batch * heads * n^2 * d``. Causal attention computes half the scores:
    half of that. The backward pass does five such products (``S`` recomputed,
    ``dV``, ``dP``, ``dQ``, ``dK``): 2.5 times the forward. ``mode`` is
    ``"fwd"``, ``"bwd"`` or ``"fwd_bwd"`` (3.5 times the forward). Unlike
    :func:`attnbook.cost.attention_flops`, the softmax's few operations per
    score are not counted, so that TFLOP/s compare with published numbers.
    """
    factors = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
    if mode not in factors:
        raise ValueError(
            f"mode must be one of {sorted(factors)}; got {mode!r}"
        )
    forward = 4.0 * batch * heads * n * n * d
    if causal:
        forward /= 2
    return forward * factors[mode]
