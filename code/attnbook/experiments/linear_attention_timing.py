"""How the time of softmax and linear attention grows with the sequence length, on this CPU.

Chapter 12 (perspectives) runs :func:`time_against_softmax` in a fresh process and plots it.
"""
from __future__ import annotations

import numpy as np

from .. import _validate
from ..attention import scaled_dot_product_attention
from ..bench import time_call
from ..linear_attention import linear_attention


def time_against_softmax(lengths, d: int = 64, softmax_max_n: int = 4096, repeats: int = 5,
                         seed: int = 0) -> dict[str, list[float]]:
    """Seconds per call of softmax attention and of linear attention, for one head in float32.

    For each ``n`` in ``lengths``: q, k, v of shape (n, d) drawn from N(0, 1); the fastest of
    ``repeats`` timings (other programs can only add time) of
    ``scaled_dot_product_attention`` (only for ``n <= softmax_max_n``: it forms the n x n
    weights), of :func:`linear_attention` and of its causal form. Returns
    ``{"softmax": [...], "linear": [...], "linear, causal": [...]}`` in the order of ``lengths``.
    """
    d = _validate.positive_int("d", d)
    lengths = [_validate.positive_int("n", n) for n in lengths]
    rng = np.random.default_rng(seed)
    times: dict[str, list[float]] = {"softmax": [], "linear": [], "linear, causal": []}
    for n in lengths:
        q, k, v = (rng.standard_normal((n, d), dtype=np.float32) for _ in range(3))
        if n <= softmax_max_n:
            times["softmax"].append(time_call(scaled_dot_product_attention, q, k, v,
                                              repeats=repeats, min_time=0.01).low)
        times["linear"].append(time_call(linear_attention, q, k, v, repeats=repeats, min_time=0.01).low)
        times["linear, causal"].append(time_call(linear_attention, q, k, v, causal=True,
                                                 repeats=repeats, min_time=0.01).low)
    return times
