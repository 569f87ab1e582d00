"""How much of a KV cache holds real tokens: contiguous reservations against
blocks, over a simulated mix of requests.

A contiguous cache reserves, when a request is admitted, room for as many
positions as it might ever reach (``max_len``), or for a guess of its final
length; the reserved positions not yet written, or never written, hold no
token (*reservation* and *internal fragmentation*). A paged cache holds
``ceil(n / block_size)`` blocks for a sequence of ``n`` positions: only the
part-filled last block is waste, less than one block per sequence.

:func:`request_mix` draws prompt and output lengths; :func:`token_fraction`
follows each request from its prefill to its last token and returns the
fraction of the memory it holds that holds real tokens, summed over every
step of every request.

Chapter 15 (serving) shows :func:`token_fraction`.
"""

from __future__ import annotations

import numpy as np

from .. import _validate


def request_mix(
    n: int,
    mean_prompt: float,
    mean_output: float,
    max_len: int,
    sigma: float = 1.0,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` prompt and output lengths, each lognormal with the given mean and
    log-spread ``sigma``, rounded to at least 1, the pair cut so that prompt
    + output <= ``max_len``. Returns two int64 arrays (n,)."""
    n = _validate.positive_int("n", n)
    max_len = _validate.int_in_range("max_len", max_len, 2)
    rng = np.random.default_rng(seed)
    # a lognormal's mean is exp(mu + sigma^2 / 2)
    prompt, output = (
        rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)
        for mean in (mean_prompt, mean_output)
    )
    prompt = np.clip(np.round(prompt), 1, max_len - 1).astype(np.int64)
    output = np.clip(np.round(output), 1, max_len - prompt).astype(np.int64)
    return prompt, output


def token_fraction(
    prompt, output, policy: str, max_len: int = 2048, block_size: int = 16
) -> float:
    """Fraction of held cache memory that holds real tokens.

    A request of ``pi`` prompt and ``o`` output tokens holds ``pi + t``
    positions while it computes new token ``t + 1``, ``t = 0 .. o - 1``: its
    prompt and the ``t`` new tokens fed back so far (the last new token is
    never fed back). It reserves, at each of those steps:
    ``"max"``: ``max_len`` positions; ``"pow2"``: the vLLM paper's Orca
    (Pow2), room for the output length rounded up to a power of two, plus the
    prompt, at most ``max_len``: ``min(pi + 2 ** ceil(log2(o)), max_len)``;
    ``"oracle"``: exactly ``pi + o - 1``; ``"paged"``: ``ceil((pi + t) /
    block_size) * block_size``.
    """
    prompt = np.asarray(prompt, dtype=np.int64)
    output = np.asarray(output, dtype=np.int64)
    final = prompt + output - 1
    # tokens held, summed over steps: sum_t (pi + t) for t < o
    used = (output * prompt + output * (output - 1) // 2).sum()
    if policy == "max":
        held = (output * max_len).sum()
    elif policy == "pow2":
        # the output over-reserved by at most 2x (Kwon et al. 2023, 6.1)
        out_room = 2 ** np.ceil(np.log2(output)).astype(np.int64)
        held = (output * np.minimum(prompt + out_room, max_len)).sum()
    elif policy == "oracle":
        held = (output * final).sum()
    elif policy == "paged":
        b = _validate.positive_int("block_size", block_size)
        held = sum(
            (-(-np.arange(pi, pi + o) // b) * b).sum()
            for pi, o in zip(prompt.tolist(), output.tolist())
        )
    else:
        raise ValueError(
            "policy must be 'max', 'pow2', 'oracle' or 'paged'; got "
            f"{policy!r}"
        )
    if (final > max_len).any():
        raise ValueError(f"a request is longer than max_len={max_len}")
    return float(used / held)
