"""How fast a tiny GPT decodes with fewer key/value heads, and what an
attention call allocates.

Chapter 12 (grouped-query attention) measures, on the CPU of whoever runs it,
the decoding speed and cache memory of tiny GPTs with 4, 2 and 1 key/value
heads (:func:`compare_decode`), and the memory that repeating keys and values
costs inside one attention call (:func:`bytes_allocated`), among others for
:func:`broadcast_gqa`, which looks as if it avoided the copy. The chapter
describes ``broadcast_gqa`` in words and does not show its code, which is
close to the answer of its hard exercise.
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch

from .. import _validate
from ..bench import Timing


@dataclass(frozen=True)
class DecodeMeasurement:
    """Greedy decoding with a KV cache: ``n_new`` steps for ``batch`` sequences
    after a prompt."""

    n_kv_heads: int
    batch: int
    n_prompt: int
    n_new: int
    # seconds for the n_new decode steps (the prompt's prefill excluded)
    timing: Timing
    cache_bytes: int  # KVCache.nbytes summed over the layers

    @property
    def tokens_per_s(self) -> float:
        """Tokens generated per second in the fastest run: noise from other
        work on the machine only ever slows a run down, so the fastest is the
        best estimate of the decoder's speed."""
        return self.batch * self.n_new / self.timing.low

    @property
    def median_tokens_per_s(self) -> float:
        """Tokens per second of the median run (lower than :attr:`tokens_per_s`
        on a busy machine)."""
        return self.batch * self.n_new / self.timing.median


@torch.no_grad()
def _prefill(model, prompt, n_new: int):
    """A fresh cache for ``n_prompt + n_new`` positions, filled with
    ``prompt``; and the logits (batch, vocab) of the prompt's last position,
    from which decoding starts."""
    cache = model.new_kv_cache(prompt.shape[0], prompt.shape[1] + n_new)
    return cache, model(prompt, cache)[:, -1]


@torch.no_grad()
def _decode_seconds(
    model, prefilled, n_prompt: int, n_new: int
) -> tuple[float, int]:
    """Time ``n_new`` greedy steps from a copy of a prefilled cache
    (``_prefill``'s result).

    Every call decodes from the same state, so each run does the same work as a
    fresh prefill followed by decoding, without repeating the prefill, which is
    not timed (and for a batch of 64 sequences costs more than the steps).
    Returns (seconds, bytes held by the cache)."""
    cache, logits = copy.deepcopy(prefilled)
    start = time.perf_counter()
    for t in range(n_new):
        # (batch, 1)
        next_id = logits.argmax(dim=-1, keepdim=True)
        logits = model(next_id, cache, start_pos=n_prompt + t)[:, -1]
    return time.perf_counter() - start, sum(c.nbytes for c in cache)


def compare_decode(
    models: dict,
    batch: int = 1,
    n_prompt: int = 128,
    n_new: int = 16,
    rounds: int = 5,
    seed: int = 0,
) -> dict:
    """Time greedy decoding of several :class:`attnbook.gpt.TinyGPT` models on
    the same prompt.

    The prompt is ``batch`` seeded random sequences of ``n_prompt`` tokens,
    prefilled into a cache once per model (untimed; every run decodes from a
    copy of that cache). Each model is warmed up once, then every round times
    ``n_new`` decode steps of every model in turn, so that a slow spell of a
    shared machine hits all of them alike. Compare the fastest round of each
    (:attr:`DecodeMeasurement.tokens_per_s`), over at least 3 rounds. The cache
    holds exactly ``n_prompt + n_new`` positions. Returns ``{name:
    DecodeMeasurement}``.
    """
    batch, n_prompt, n_new, rounds = (
        _validate.positive_int(name, value)
        for name, value in (
            ("batch", batch),
            ("n_prompt", n_prompt),
            ("n_new", n_new),
            ("rounds", rounds),
        )
    )
    if not models:
        raise ValueError("models must name at least one model")
    vocab = {m.config.vocab_size for m in models.values()}
    if len(vocab) != 1:
        raise ValueError(
            f"the models must share one vocabulary; got sizes {sorted(vocab)}"
        )
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(vocab.pop(), (batch, n_prompt), generator=gen)
    seconds, cache_bytes = {name: [] for name in models}, {}
    # once per model
    prefilled = {
        name: _prefill(model, prompt, n_new) for name, model in models.items()
    }
    for name, model in models.items():
        # warm-up
        _, cache_bytes[name] = _decode_seconds(
            model, prefilled[name], n_prompt, n_new
        )
    for _ in range(rounds):
        for name, model in models.items():
            seconds[name].append(
                _decode_seconds(model, prefilled[name], n_prompt, n_new)[0]
            )
    return {
        name: DecodeMeasurement(
            models[name].config.n_kv_heads,
            batch,
            n_prompt,
            n_new,
            Timing(statistics.median(s), min(s), max(s), rounds, 1),
            cache_bytes[name],
        )
        for name, s in seconds.items()
    }


def measure_decode(
    model,
    batch: int = 1,
    n_prompt: int = 128,
    n_new: int = 16,
    repeats: int = 5,
    seed: int = 0,
) -> DecodeMeasurement:
    """:func:`compare_decode` for a single model: ``repeats`` timed runs after
    a warm-up."""
    return compare_decode(
        {"model": model}, batch, n_prompt, n_new, repeats, seed
    )["model"]


# torch 2.11 warns on every use of the profiler that it "clears events at the
# end of each cycle" (pytorch/pytorch#180348; fixed later): irrelevant to a
# single profiled call, which has one cycle.
PROFILER_CYCLE_WARNING = (
    r"Warning: Profiler clears events at the end of each cycle"
)


def bytes_allocated(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` once; return ``(result, bytes of CPU tensor
    memory it allocated)``.

    With ``profile_memory=True``, torch's profiler records every allocation and
    every free that torch's CPU allocator makes during the call, each
    attributed to the operation that made it (``aten::empty``, ``aten::clone``,
    ...). The sum of the allocations, frees ignored, is the total size of all
    tensors the call created, temporaries that are freed again included, so a
    copy that an operation makes internally counts too. It is not the peak
    memory, and memory outside torch's allocator (numpy arrays, Python objects)
    is not seen. (An operation that allocates and frees a buffer within its own
    code, not through a nested operation, shows only its net change.)
    """
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=PROFILER_CYCLE_WARNING, category=UserWarning
        )
        with (
            _stderr_silenced(),
            profile(
                activities=[ProfilerActivity.CPU], profile_memory=True
            ) as prof,
        ):
            result = fn(*args, **kwargs)
    # allocations appear as positive self memory of the op that allocates;
    # frees as negative
    return result, sum(max(0, e.self_cpu_memory_usage) for e in prof.events())


def broadcast_gqa(q, k, v):
    """Grouped-query attention by broadcasting a group axis: the queries ``q``
    ``(b, h, n_q, d)`` viewed as ``(b, h_kv, g, n_q, d)``, the keys and values
    ``(b, h_kv, n_k, d)`` as ``(b, h_kv, 1, n_k, d)``, and ``matmul``
    broadcasting the axis of length 1. No mask. torch's ``matmul`` folds the
    broadcast batch axes into one before calling its batched kernel, which
    materialises the ``g`` copies of the keys and values."""
    b, h, n_q, d = q.shape
    n_kv_heads = k.shape[1]
    qg = q.view(b, n_kv_heads, h // n_kv_heads, n_q, d)
    weights = torch.softmax(
        qg @ k[:, :, None].transpose(-2, -1) / d**0.5, dim=-1
    )
    return (weights @ v[:, :, None]).reshape(b, h, n_q, -1)


@contextlib.contextmanager
def _stderr_silenced():
    """Send file descriptor 2 to /dev/null: the profiler's C++ library logs its
    start and stop there with a timestamp, which a notebook would otherwise
    show (and nbval compare)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    # no file descriptor 2 to silence (a detached process)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
