"""Grouped-query attention: groups of query heads share one key/value head.

With ``n_heads`` query heads and ``n_kv_heads`` key/value heads, query head ``j``
reads key/value head ``j // g``, where ``g = n_heads // n_kv_heads`` is the group
size: the groups are *contiguous* runs of query heads, the convention of
:func:`attnbook.repeat_kv` and of ``torch.nn.functional.scaled_dot_product_attention(...,
enable_gqa=True)``. ``n_kv_heads == n_heads`` is multi-head attention (MHA),
``n_kv_heads == 1`` multi-query attention (MQA, Shazeer 2019), anything between is
grouped-query attention (GQA, Ainslie et al. 2023).

This module computes grouped attention without materialising the repeated keys and
values (:func:`grouped_query_attention`, :class:`GroupedQueryAttention`), converts a
multi-head checkpoint to fewer key/value heads by pooling each group's projections
(:func:`mha_to_gqa`), measures decoding speed and cache memory (:func:`compare_decode`) and
the memory an operation allocates (:func:`bytes_allocated`), and lists the attention shapes of
published models (:data:`PUBLISHED_MODELS`).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

from . import _validate
from .bench import Timing
from .kv_cache import kv_cache_bytes
from .multihead import MultiHeadAttention


def group_size(n_heads: int, n_kv_heads: int) -> int:
    """Query heads per key/value head; raises unless ``n_kv_heads`` divides ``n_heads``."""
    n_heads = _validate.positive_int("n_heads", n_heads)
    n_kv_heads = _validate.positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}: "
                         "each key/value head must serve the same number of query heads")
    return n_heads // n_kv_heads


def kv_head_of(n_heads: int, n_kv_heads: int) -> list[int]:
    """The key/value head that each query head reads: ``[j // g for j in range(n_heads)]``."""
    g = group_size(n_heads, n_kv_heads)
    return [j // g for j in range(n_heads)]


# ---- attention that shares key/value heads -----------------------------------------------------

def grouped_query_attention(q, k, v, mask=None, scale: float | None = None):
    """Attention in which each key/value head serves a contiguous group of query heads.

    q: (batch, n_heads, n_q, d_k); k: (batch, n_kv_heads, n_k, d_k);
    v: (batch, n_kv_heads, n_k, d_v); mask: bool, broadcastable to
    (batch, n_heads, n_q, n_k), True = may attend; scale defaults to ``1/sqrt(d_k)``.
    Returns (batch, n_heads, n_q, d_v), equal to :func:`attnbook.attend` on
    ``repeat_kv(k, g)`` and ``repeat_kv(v, g)``, but the keys and values are never repeated:
    the ``g`` query heads of a group are stacked into ``g * n_q`` rows that attend to
    their one key/value head in a single batched product.
    A query whose whole row is masked gets a zero output.
    """
    b, h, h_kv, g, n_q, n_k, d_k, d_v = _grouped_shapes(q, k, v)
    if scale is None:
        scale = 1.0 / math.sqrt(d_k)
    # Heads i*g .. i*g + g - 1 are adjacent in memory, so this reshape only relabels them:
    # group i becomes g * n_q query rows facing key/value head i.
    q_rows = q.reshape(b, h_kv, g * n_q, d_k)                            # (b, h_kv, g n_q, d_k)
    scores = (q_rows @ k.transpose(-2, -1)) * scale                     # (b, h_kv, g n_q, n_k)
    scores = scores.view(b, h_kv, g, n_q, n_k)
    if mask is not None:
        mask = _grouped_mask(mask, (b, h, n_q, n_k), h_kv, g)            # broadcasts to the scores
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)                              # (b, h_kv, g, n_q, n_k)
    if mask is not None:
        weights = weights.masked_fill(~mask, 0.0)   # a fully masked row: NaN -> 0, as in attend
    out = weights.reshape(b, h_kv, g * n_q, n_k) @ v                     # (b, h_kv, g n_q, d_v)
    return out.reshape(b, h, n_q, d_v)


def _grouped_shapes(q, k, v):
    """Check the shapes of :func:`grouped_query_attention`; return b, h, h_kv, g, n_q, n_k, d_k, d_v."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, n, d); got {tuple(t.shape)}")
    (b, h, n_q, d_k), (bk, h_kv, n_k, d_kk), (bv, h_v, n_v, d_v) = q.shape, k.shape, v.shape
    if (bk, h_kv, n_k) != (bv, h_v, n_v):
        raise ValueError(f"k and v must agree on (batch, n_kv_heads, n_k); got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    if bk != b or d_kk != d_k:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and d_k")
    if h % h_kv:
        raise ValueError(f"q has {h} heads, not a multiple of the {h_kv} key/value heads of k "
                         f"{tuple(k.shape)}: each key/value head must serve the same number of query heads")
    return b, h, h_kv, h // h_kv, n_q, n_k, d_k, d_v


def _grouped_mask(mask, scores_shape, h_kv: int, g: int):
    """A mask broadcastable to (b, h, n_q, n_k), reshaped to broadcast to (b, h_kv, g, n_q, n_k)."""
    _validate.mask_shape(mask, scores_shape)
    while mask.ndim < 4:
        mask = mask.unsqueeze(0)
    mb, mh, mq, mk = mask.shape
    if mh == 1:                                    # one mask for every head
        return mask.unsqueeze(2)                   # (mb, 1, 1, mq, mk)
    return mask.reshape(mb, h_kv, g, mq, mk)       # head j -> (group j // g, member j % g)


class GroupedQueryAttention(MultiHeadAttention):
    """:class:`attnbook.MultiHeadAttention` that attends through :func:`grouped_query_attention`.

    Same parameters, same arguments, same results; the difference is that the keys
    and values (those in a KV cache included) are never repeated to ``n_heads``.
    ``use_sdpa`` has no effect: the attention always runs in :func:`grouped_query_attention`.
    """

    def forward(self, x, context=None, mask=None, is_causal: bool = False, kv_cache=None):
        """x: (batch, n, d_model) -> (batch, n, d_model); arguments as in MultiHeadAttention."""
        b, n, m = self._check_inputs(x, context)
        source = x if context is None else context
        h, h_kv, d_head = self.n_heads, self.n_kv_heads, self.d_head
        q = self.q_proj(x).view(b, n, h, d_head).transpose(1, 2)            # (b, h, n, d_head)
        k = self.k_proj(source).view(b, m, h_kv, d_head).transpose(1, 2)    # (b, h_kv, m, d_head)
        v = self.v_proj(source).view(b, m, h_kv, d_head).transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)                                    # (b, h_kv, n_k, d_head)
        mask = self._full_mask(mask, is_causal, n, k.shape[2], x.device, b)
        out = grouped_query_attention(q, k, v, mask)                        # (b, h, n, d_head)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, h * d_head))


def with_grouped_attention(model):
    """A copy of ``model`` whose :class:`MultiHeadAttention` layers are :class:`GroupedQueryAttention`.

    The weights are copied unchanged, so the copy computes the same function.
    """
    model = copy.deepcopy(model)
    for module in model.modules():
        if type(module) is MultiHeadAttention:
            module.__class__ = GroupedQueryAttention     # same attributes; only forward differs
    return model


# ---- converting a multi-head checkpoint --------------------------------------------------------

POOLING_METHODS = ("mean", "first")


def pool_kv_heads(weight, n_heads: int, n_kv_heads: int, method: str = "mean"):
    """Pool the per-head rows of a key or value projection into ``n_kv_heads`` heads.

    weight: (n_heads * d_head, ...) (an ``nn.Linear`` weight or bias, rows grouped by head).
    Returns (n_kv_heads * d_head, ...): for key/value head ``i``, the mean (``method="mean"``)
    of the rows of heads ``i*g .. i*g + g - 1``, or those of head ``i*g`` alone (``"first"``).
    """
    g = group_size(n_heads, n_kv_heads)
    if method not in POOLING_METHODS:
        raise ValueError(f"method must be one of {POOLING_METHODS}; got {method!r}")
    if weight.shape[0] % n_heads:
        raise ValueError(f"weight has {weight.shape[0]} rows, not a multiple of n_heads={n_heads}")
    d_head = weight.shape[0] // n_heads
    heads = weight.reshape(n_kv_heads, g, d_head, *weight.shape[1:])    # (h_kv, g, d_head, ...)
    pooled = heads.mean(dim=1) if method == "mean" else heads[:, 0]
    return pooled.reshape(n_kv_heads * d_head, *weight.shape[1:])


def mha_to_gqa(model_or_attention, n_kv_heads: int, method: str = "mean"):
    """Convert multi-head attention to ``n_kv_heads`` key/value heads (Ainslie et al. 2023).

    Takes a :class:`attnbook.MultiHeadAttention` or a model containing them (a
    :class:`attnbook.gpt.TinyGPT`, whose config is updated) and returns a converted
    copy; the input is left unchanged. Each group's key and value projections are
    pooled with :func:`pool_kv_heads`; queries and the output projection are kept.
    """
    n_kv_heads = _validate.positive_int("n_kv_heads", n_kv_heads)
    converted = copy.deepcopy(model_or_attention)
    layers = [m for m in converted.modules() if isinstance(m, MultiHeadAttention)]
    if not layers:
        raise ValueError(f"{type(model_or_attention).__name__} contains no MultiHeadAttention layer")
    for attn in layers:
        _convert_layer(attn, n_kv_heads, method)
    config = getattr(converted, "config", None)
    if config is not None and hasattr(config, "n_kv_heads"):
        converted.config = dataclasses.replace(config, n_kv_heads=n_kv_heads)
    return converted


def _convert_layer(attn: MultiHeadAttention, n_kv_heads: int, method: str) -> None:
    if attn.n_kv_heads != attn.n_heads:
        raise ValueError(f"the layer already has {attn.n_kv_heads} key/value heads for {attn.n_heads} "
                         "query heads; convert a multi-head checkpoint")
    group_size(attn.n_heads, n_kv_heads)
    for name in ("k_proj", "v_proj"):
        old = getattr(attn, name)
        new = nn.Linear(old.in_features, n_kv_heads * attn.d_head, bias=old.bias is not None,
                        device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(pool_kv_heads(old.weight, attn.n_heads, n_kv_heads, method))
            if old.bias is not None:
                new.bias.copy_(pool_kv_heads(old.bias, attn.n_heads, n_kv_heads, method))
        setattr(attn, name, new)
    attn.n_kv_heads, attn.n_rep = n_kv_heads, attn.n_heads // n_kv_heads


# ---- decoding speed and cache memory -----------------------------------------------------------

@dataclass(frozen=True)
class DecodeMeasurement:
    """Greedy decoding with a KV cache: ``n_new`` steps for ``batch`` sequences after a prompt."""

    n_kv_heads: int
    batch: int
    n_prompt: int
    n_new: int
    timing: Timing          # seconds for the n_new decode steps (the prompt's prefill excluded)
    cache_bytes: int        # KVCache.nbytes summed over the layers

    @property
    def tokens_per_s(self) -> float:
        """Tokens generated per second in the fastest run: noise from other work on the machine
        only ever slows a run down, so the fastest is the best estimate of the decoder's speed."""
        return self.batch * self.n_new / self.timing.low

    @property
    def median_tokens_per_s(self) -> float:
        """Tokens per second of the median run (lower than :attr:`tokens_per_s` on a busy machine)."""
        return self.batch * self.n_new / self.timing.median


@torch.no_grad()
def _decode_seconds(model, prompt, n_new: int) -> tuple[float, int]:
    """Prefill a fresh cache with ``prompt`` (untimed), then time ``n_new`` greedy steps.

    Returns (seconds, bytes held by the cache)."""
    n_prompt = prompt.shape[1]
    cache = model.new_kv_cache(prompt.shape[0], n_prompt + n_new)
    logits = model(prompt, cache)[:, -1]
    start = time.perf_counter()
    for t in range(n_new):
        next_id = logits.argmax(dim=-1, keepdim=True)                    # (batch, 1)
        logits = model(next_id, cache, start_pos=n_prompt + t)[:, -1]
    return time.perf_counter() - start, sum(c.nbytes for c in cache)


def compare_decode(models: dict, batch: int = 1, n_prompt: int = 128, n_new: int = 16,
                   rounds: int = 5, seed: int = 0) -> dict:
    """Time greedy decoding of several :class:`attnbook.gpt.TinyGPT` models on the same prompt.

    The prompt is ``batch`` seeded random sequences of ``n_prompt`` tokens; each model
    is warmed up once, then every round times ``n_new`` decode steps of every model in
    turn, so that a slow spell of a shared machine hits all of them alike. Compare the fastest
    round of each (:attr:`DecodeMeasurement.tokens_per_s`), over at least 5 rounds. The cache
    holds exactly ``n_prompt + n_new`` positions. Returns ``{name: DecodeMeasurement}``.
    """
    batch, n_prompt, n_new, rounds = (_validate.positive_int(name, value) for name, value in (
        ("batch", batch), ("n_prompt", n_prompt), ("n_new", n_new), ("rounds", rounds)))
    if not models:
        raise ValueError("models must name at least one model")
    vocab = {m.config.vocab_size for m in models.values()}
    if len(vocab) != 1:
        raise ValueError(f"the models must share one vocabulary; got sizes {sorted(vocab)}")
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(vocab.pop(), (batch, n_prompt), generator=gen)
    seconds, cache_bytes = {name: [] for name in models}, {}
    for name, model in models.items():
        _, cache_bytes[name] = _decode_seconds(model, prompt, n_new)    # warm-up
    for _ in range(rounds):
        for name, model in models.items():
            seconds[name].append(_decode_seconds(model, prompt, n_new)[0])
    return {name: DecodeMeasurement(
                models[name].config.kv_heads, batch, n_prompt, n_new,
                Timing(statistics.median(s), min(s), max(s), rounds, 1), cache_bytes[name])
            for name, s in seconds.items()}


def measure_decode(model, batch: int = 1, n_prompt: int = 128, n_new: int = 16,
                   repeats: int = 5, seed: int = 0) -> DecodeMeasurement:
    """:func:`compare_decode` for a single model: ``repeats`` timed runs after a warm-up."""
    return compare_decode({"model": model}, batch, n_prompt, n_new, repeats, seed)["model"]


def bytes_allocated(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` once; return ``(result, bytes of CPU tensor memory it allocated)``.

    Sums the allocations that torch's profiler attributes to the operations of the call,
    temporaries that are freed again included, so a copy that an operation makes
    internally counts too. (An operation that allocates and frees a buffer within its
    own code, not through a nested operation, shows only its net change.)
    """
    from torch.profiler import ProfilerActivity, profile

    with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args, **kwargs)
    # allocations appear as positive self memory of the op that allocates; frees as negative
    return result, sum(max(0, e.self_cpu_memory_usage) for e in prof.events())


@contextlib.contextmanager
def _stderr_silenced():
    """Send file descriptor 2 to /dev/null: the profiler's C++ library logs its start and stop
    there with a timestamp, which a notebook would otherwise show (and nbval compare)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:             # no file descriptor 2 to silence (a detached process)
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# ---- published models --------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionShape:
    """The attention shape of a published decoder: what sets the size of its KV cache.

    ``context`` is the longest context the model was trained for; ``source`` is the
    bibliography key of the paper that describes it.
    """

    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    context: int
    source: str

    def __post_init__(self):
        for name in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "context"):
            _validate.positive_int(name, getattr(self, name))
        group_size(self.n_heads, self.n_kv_heads)

    @property
    def kind(self) -> str:
        """"MHA", "GQA" or "MQA"."""
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"

    def cache_bytes(self, seq_len: int | None = None, batch: int = 1, bytes_per_element: float = 2):
        """:func:`attnbook.kv_cache_bytes` for this model; ``seq_len`` defaults to ``context``."""
        return kv_cache_bytes(self.n_layers, self.n_kv_heads, self.head_dim,
                              self.context if seq_len is None else seq_len, batch, bytes_per_element)

    def bytes_per_token(self, bytes_per_element: float = 2) -> int | float:
        """Cache bytes that one more token adds: 2 * n_layers * n_kv_heads * head_dim * bytes."""
        return self.cache_bytes(1, 1, bytes_per_element)


#: From each model's published configuration (the ``config.json`` or ``params.json`` released
#: with its weights). Falcon-7B: 71 query heads of 64 features (hidden size 4544), one key/value
#: head ("multi_query": true).
PUBLISHED_MODELS = (
    AttentionShape("GPT-2 small", 12, 12, 12, 64, 1024, "radford2019language"),
    AttentionShape("Llama-2-7B", 32, 32, 32, 128, 4096, "touvron2023llama"),
    AttentionShape("Llama-2-70B", 80, 64, 8, 128, 4096, "touvron2023llama"),
    AttentionShape("Mistral-7B", 32, 32, 8, 128, 8192, "jiang2023mistral"),
    AttentionShape("Llama-3-8B", 32, 32, 8, 128, 8192, "grattafiori2024llama3"),
    AttentionShape("Falcon-7B", 32, 71, 1, 64, 2048, "almazrouei2023falcon"),
)
