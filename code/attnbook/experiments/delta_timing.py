"""How the time of the delta rule's two forms and of softmax attention grows
with the sequence length, and what one decoded token costs, on this CPU.

Chapter 16 (the delta rule) runs :func:`time_forms` and fits its slopes with
:func:`attnbook.bench.fit_power_law`, and :func:`time_decode_step` for the
time per decoded token against the context length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import _validate
from ..bench import time_call
from ..delta.chunkwise import delta_chunkwise
from ..delta.recurrent import delta_recurrence


def _inputs(n, d, seed):
    """One head as ``(batch, heads, n, d) = (1, 1, n, d)``: with 4-D inputs
    PyTorch's ``scaled_dot_product_attention`` runs its fused (flash) CPU
    kernel; with 3-D ones it falls back to the math path, which builds the
    mask and the whole ``n x n`` score matrix."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, n, d, generator=g) for _ in range(3))
    beta = torch.rand(1, 1, n, generator=g)
    return q, F.normalize(k, dim=-1), v, beta


def time_forms(
    lengths,
    d=64,
    chunk_size=64,
    repeats=3,
    sweeps=3,
    seed=0,
    recurrent_max_n=None,
):
    """Seconds per call of one float32 head of length ``n`` for each ``n``
    in ``lengths``: the recurrence, the chunkwise form (``chunk_size``) and
    causal softmax attention (``scaled_dot_product_attention`` on 4-D inputs
    ``(1, 1, n, d)``, so that its fused kernel runs). Interleaved
    ``sweeps`` over lengths and forms, ``repeats`` each; each entry is the
    fastest of all its repeats (other programs only add time). The value
    checks are off (:func:`attnbook._validate.skip_sync_checks`). Run it with
    one torch thread. Returns ``{"recurrent": [...], "chunkwise": [...],
    "softmax": [...]}``."""
    lengths = [_validate.positive_int("n", n) for n in lengths]
    sweeps = _validate.positive_int("sweeps", sweeps)
    inputs = [_inputs(n, d, seed) for n in lengths]
    forms = {
        "recurrent": lambda q, k, v, b: delta_recurrence(q, k, v, b),
        "chunkwise": lambda q, k, v, b: delta_chunkwise(
            q, k, v, b, chunk_size=chunk_size
        ),
        "softmax": lambda q, k, v, b: F.scaled_dot_product_attention(
            q, k, v, is_causal=True
        ),
    }
    best = {name: [math.inf] * len(lengths) for name in forms}
    with torch.no_grad(), _validate.skip_sync_checks():
        for _ in range(sweeps):
            for i, n in enumerate(lengths):
                for name, form in forms.items():
                    if (
                        name == "recurrent"
                        and recurrent_max_n
                        and (n > recurrent_max_n)
                    ):
                        continue
                    timing = time_call(
                        form, *inputs[i], repeats=repeats, min_time=0.005
                    )
                    best[name][i] = min(best[name][i], timing.low)
    return {name: [t for t in ts if t < math.inf] for name, ts in best.items()}


def time_decode_step(contexts, n_heads=4, d=64, repeats=5, seed=0):
    """Seconds to decode one token in one layer of ``n_heads`` float32 heads
    (4-D inputs, ``(1, n_heads, ., d)``): a delta-rule step on a state ``(d,
    d)`` per head, the same work at every context, so timed once (fastest of
    ``repeats`` of at least 5 ms each); and attention of one query over a KV
    cache of ``context`` keys and values per head, for each context, fastest
    of ``repeats``. Returns ``{"state": seconds, "kv cache": [seconds per
    context]}``."""
    contexts = [_validate.positive_int("context", c) for c in contexts]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n_heads, 1, d, generator=g) for _ in range(3))
    k = F.normalize(k, dim=-1)
    beta = torch.rand(1, n_heads, 1, generator=g)
    state = torch.randn(1, n_heads, d, d, generator=g)
    out = {"state": None, "kv cache": []}
    with torch.no_grad(), _validate.skip_sync_checks():
        out["state"] = time_call(
            delta_recurrence,
            q,
            k,
            v,
            beta,
            initial_state=state,
            repeats=repeats,
            min_time=0.005,
        ).low
        for context in contexts:
            keys = torch.randn(1, n_heads, context, d, generator=g)
            values = torch.randn(1, n_heads, context, d, generator=g)
            read = time_call(
                F.scaled_dot_product_attention,
                q,
                keys,
                values,
                repeats=repeats,
                min_time=0.005,
            )
            out["kv cache"].append(read.low)
    return out
