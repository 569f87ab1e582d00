"""What generating text costs, with and without a KV cache: flops counted, time measured.

A decoder generates one token per forward pass. Without a cache, the pass for the
``t``-th token runs the whole model over all ``t`` tokens so far, recomputing keys and
values that the previous pass had already computed; with a cache it runs over the
one new token and reads the old keys and values from memory. The counts here make
the difference exact; :func:`decode_benchmark` measures it on a real model.

Flop conventions (as in :mod:`attnbook.cost`): a multiply-add is 2 flops, and only
matrix products are counted, the ones that dominate: the projections, the two
products of attention and the output head. Layer norms, the softmax, activations
and embedding look-ups are linear in the sequence length with a small constant and
are left out. Attention is counted *dense*: ``n_q x n_k`` scores per head, which is
what a plain implementation computes even where the causal mask discards them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import timeit
from dataclasses import dataclass

import torch

from . import _validate
from .bench import Timing


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a decoder-only transformer that set its flops and its KV cache.

    ``n_kv_heads=None`` means one key/value head per query head (multi-head attention);
    ``mlp_matrices`` is 2 for a GELU MLP (``d -> d_ff -> d``) and 3 for a gated one
    (SwiGLU, as in Llama); ``tied_embeddings`` says whether the output head reuses the
    token embedding matrix. ``source`` is the bibliography key of the published shape.
    """

    name: str
    n_layers: int
    n_heads: int
    head_dim: int
    d_model: int
    d_ff: int
    vocab_size: int
    n_ctx: int
    n_kv_heads: int | None = None
    mlp_matrices: int = 2
    tied_embeddings: bool = True
    source: str = ""

    def __post_init__(self):
        for field in ("n_layers", "n_heads", "head_dim", "d_model", "d_ff", "vocab_size", "n_ctx",
                      "mlp_matrices"):
            _validate.positive_int(field, getattr(self, field))
        if self.n_kv_heads is not None:
            _validate.positive_int("n_kv_heads", self.n_kv_heads)
            if self.n_heads % self.n_kv_heads:
                raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def matmul_params(self) -> int:
        """Weights of the matrix products: the projections, the MLP and the output head.

        Biases, layer norms and the (position) embeddings are not counted; the output
        head is, whether or not it shares its matrix with the token embedding.
        """
        d, attn_width, kv_width = self.d_model, self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = 2 * d * attn_width + 2 * d * kv_width + self.mlp_matrices * d * self.d_ff
        return self.n_layers * per_layer + d * self.vocab_size

    def matrix_params(self) -> int:
        """All weight matrices: :meth:`matmul_params` plus the token embedding when it is not tied."""
        return self.matmul_params() + (0 if self.tied_embeddings else self.vocab_size * self.d_model)


def shape_of(config, name: str = "tiny GPT") -> DecoderShape:
    """The :class:`DecoderShape` of a :class:`attnbook.gpt.GPTConfig` (its MLP is 4 d_model wide)."""
    return DecoderShape(name, config.n_layers, config.n_heads, config.d_model // config.n_heads,
                        config.d_model, 4 * config.d_model, config.vocab_size, config.block_size,
                        config.n_kv_heads)


#: Published shapes. GPT-2 small: Radford et al. (2019); Llama 2: Touvron et al. (2023), whose
#: 70B model has 64 query heads sharing 8 key/value heads (grouped-query attention).
GPT2_SMALL = DecoderShape("GPT-2 small", n_layers=12, n_heads=12, head_dim=64, d_model=768, d_ff=3072,
                          vocab_size=50257, n_ctx=1024, source="radford2019language")
LLAMA2_7B = DecoderShape("Llama-2-7B", n_layers=32, n_heads=32, head_dim=128, d_model=4096, d_ff=11008,
                         vocab_size=32000, n_ctx=4096, mlp_matrices=3, tied_embeddings=False,
                         source="touvron2023llama")
LLAMA2_70B = DecoderShape("Llama-2-70B", n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128, d_model=8192,
                          d_ff=28672, vocab_size=32000, n_ctx=4096, mlp_matrices=3, tied_embeddings=False,
                          source="touvron2023llama")
MODEL_SHAPES = (GPT2_SMALL, LLAMA2_7B, LLAMA2_70B)


def as_multi_head(shape: DecoderShape) -> DecoderShape:
    """The same model with one key/value head per query head: what its cache would be without GQA."""
    return dataclasses.replace(shape, name=f"{shape.name} as MHA", n_kv_heads=None)


# ---- flops -------------------------------------------------------------------------------------

def forward_flops(shape: DecoderShape, n_new: int, n_past: int = 0) -> dict[str, int]:
    """Flops of one forward pass over ``n_new`` tokens that follow ``n_past`` cached ones.

    Every new token is projected to queries, keys and values, attends to the
    ``n_past + n_new`` keys (dense count, see the module docstring), goes through
    the output projection and the MLP, and gets logits from the output head.
    Returns ``{"qkv_out": ..., "attention": ..., "mlp": ..., "head": ...}``;
    ``n_past=0`` and ``n_new=t`` is a pass without a cache over ``t`` tokens.
    """
    n_new = _validate.positive_int("n_new", n_new)
    if isinstance(n_past, bool) or not isinstance(n_past, int) or n_past < 0:
        raise ValueError(f"n_past must be a non-negative integer; got {n_past!r}")
    s, d = shape, shape.d_model
    n_k = n_past + n_new
    attn_width, kv_width = s.n_heads * s.head_dim, s.kv_heads * s.head_dim
    return {
        # q and the output projection are attn_width wide; k and v only kv_width (GQA shrinks them)
        "qkv_out": s.n_layers * 2 * n_new * (2 * d * attn_width + 2 * d * kv_width),
        # q k^T and weights @ v: each n_new x n_k x head_dim multiply-adds per query head
        "attention": s.n_layers * 2 * 2 * n_new * n_k * attn_width,
        "mlp": s.n_layers * 2 * n_new * s.mlp_matrices * d * s.d_ff,
        "head": 2 * n_new * d * s.vocab_size,
    }


def generation_flops(shape: DecoderShape, n_prompt: int, n_new: int, use_cache: bool) -> dict[str, int]:
    """Flops of generating ``n_new`` tokens after a prompt of ``n_prompt``, summed by part.

    Follows :meth:`attnbook.gpt.TinyGPT.generate`: ``n_new`` forward passes. Without a
    cache, pass ``i`` (from 0) runs over all ``n_prompt + i`` tokens. With one, pass 0
    runs over the prompt (the *prefill*) and pass ``i > 0`` over one token after
    ``n_prompt + i - 1`` cached ones (a *decode step*).
    """
    n_prompt = _validate.positive_int("n_prompt", n_prompt)
    n_new = _validate.positive_int("n_new", n_new)
    if use_cache:
        passes = [(n_prompt, 0)] + [(1, n_prompt + i - 1) for i in range(1, n_new)]
    else:
        passes = [(n_prompt + i, 0) for i in range(n_new)]
    total = dict.fromkeys(("qkv_out", "attention", "mlp", "head"), 0)
    for n, past in passes:
        for part, flops in forward_flops(shape, n, past).items():
            total[part] += flops
    return total


# ---- decoding that shows its work ---------------------------------------------------------------

@torch.no_grad()
def greedy_decode(model, prompt, n_new: int, caches=None):
    """Greedy decoding that also returns the logits every token was chosen from.

    prompt: (batch, n) token ids; caches: one cache per layer (a :class:`attnbook.KVCache`
    or anything with its ``update``/``length``, e.g. a quantised one), or ``None`` to
    recompute the whole sequence at every step.
    Returns ``(ids, logits)``: ids (batch, n + n_new) and logits (batch, n_new, vocab_size),
    where ``logits[:, i]`` are the logits from which token ``n + i`` was picked.
    """
    n_new = _validate.positive_int("n_new", n_new)
    ids = prompt
    logits = [model(ids, caches)[:, -1]]                       # the prefill
    for _ in range(n_new - 1):
        ids = torch.cat([ids, logits[-1].argmax(dim=-1, keepdim=True)], dim=1)
        if caches is None:
            logits.append(model(ids)[:, -1])                   # recompute everything
        else:
            logits.append(model(ids[:, -1:], caches, start_pos=ids.shape[1] - 1)[:, -1])
    ids = torch.cat([ids, logits[-1].argmax(dim=-1, keepdim=True)], dim=1)
    return ids, torch.stack(logits, dim=1)


@torch.no_grad()
def teacher_forced_logits(model, ids, caches, n_prompt: int = 1):
    """Logits at every position of ``ids`` (batch, n), fed through ``caches`` one token at a time
    after a prefill of ``n_prompt`` tokens: what decoding computes when it follows a given text.

    Returns (batch, n, vocab_size); equals ``model(ids)`` up to the cache's own error.
    """
    n_prompt = _validate.positive_int("n_prompt", n_prompt)
    steps = [model(ids[:, :n_prompt], caches)]
    steps += [model(ids[:, t:t + 1], caches, start_pos=t) for t in range(n_prompt, ids.shape[1])]
    return torch.cat(steps, dim=1)


@contextlib.contextmanager
def recording_attention_outputs(model):
    """Inside the ``with`` block, collect each layer's attention output, pass after pass.

    Yields a list with one list per layer; each forward pass appends its (batch, n, d_model)
    attention output, so ``torch.cat(recorded[layer], dim=1)`` is the whole sequence.
    """
    recorded = [[] for _ in model.blocks]
    hooks = [block.attn.register_forward_hook(lambda module, args, out, i=i: recorded[i].append(out.detach()))
             for i, block in enumerate(model.blocks)]
    try:
        yield recorded
    finally:
        for hook in hooks:
            hook.remove()


# ---- time --------------------------------------------------------------------------------------

def time_generation(model, prompt, n_new: int, use_cache: bool, repeats: int = 3) -> Timing:
    """Seconds that ``model.generate`` takes for ``n_new`` greedy tokens after ``prompt`` (batch, n).

    Runs under ``torch.inference_mode()``, as a deployed model would: no autograd bookkeeping.
    """
    repeats = _validate.positive_int("repeats", repeats)

    def generate():
        with torch.inference_mode():
            model.generate(prompt, n_new, temperature=0, use_cache=use_cache)

    seconds = timeit.Timer(generate).repeat(repeat=repeats, number=1)
    return Timing(statistics.median(seconds), min(seconds), max(seconds), repeats, 1)


@dataclass(frozen=True)
class DecodeSpeed:
    """Generation speed at one length, with and without the cache, measured in one run.

    Speeds and the speedup use the *fastest* repeat of each mode (``Timing.low``): on a
    shared machine the slower repeats also measure whatever else was running.
    """

    n_new: int
    cached: Timing
    uncached: Timing

    @property
    def cached_tokens_per_s(self) -> float:
        return self.n_new / self.cached.low

    @property
    def uncached_tokens_per_s(self) -> float:
        return self.n_new / self.uncached.low

    @property
    def speedup(self) -> float:
        """How many times faster the cache generates (ratio of the fastest times)."""
        return self.uncached.low / self.cached.low


def decode_benchmark(model, prompt, lengths, repeats=3) -> list[DecodeSpeed]:
    """Greedy generation speed with and without the cache at each of ``lengths`` new tokens.

    ``repeats`` is one count for every length or a list, one per length (fewer for the
    long, slow ones). Each length runs once untimed (warm-up, and a check that both
    modes give the same tokens: greedy decoding is deterministic); then the cached and
    uncached runs alternate, so that a slow spell of a shared machine hits both alike.
    """
    lengths = [_validate.positive_int("length", n) for n in lengths]
    counts = [repeats] * len(lengths) if isinstance(repeats, int) else list(repeats)
    if len(counts) != len(lengths):
        raise ValueError(f"repeats needs one count per length ({len(lengths)}); got {len(counts)}")
    results = []
    for n_new, count in zip(lengths, counts):
        with torch.inference_mode():
            with_cache = model.generate(prompt, n_new, temperature=0, use_cache=True)
            without = model.generate(prompt, n_new, temperature=0, use_cache=False)
        if not torch.equal(with_cache, without):
            raise AssertionError(f"cached and uncached greedy decoding disagree at n_new={n_new}")
        times = {True: [], False: []}
        for _ in range(_validate.positive_int("repeats", count)):
            for use_cache in (True, False):
                times[use_cache].append(time_generation(model, prompt, n_new, use_cache, repeats=1).low)
        cached, uncached = (Timing(statistics.median(t), min(t), max(t), len(t), 1)
                            for t in (times[True], times[False]))
        results.append(DecodeSpeed(n_new, cached, uncached))
    return results


# ---- a cache that grows by concatenation -------------------------------------------------------

class ConcatKVCache:
    """A KV cache that grows by ``torch.cat``: what :class:`attnbook.KVCache` avoids.

    Same interface as :class:`attnbook.KVCache` (``update``, ``length``, ``reset``), so a
    model can use either. Each update allocates a new tensor one step longer and copies
    the whole cache into it; ``bytes_copied`` counts the bytes written by those copies.
    """

    def __init__(self):
        self.keys = self.values = None
        self.bytes_copied = 0

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Memory held by the keys and values (exactly the positions stored, no spare room)."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def update(self, k, v):
        """Append k, v: (batch, n_kv_heads, n_new, head_dim); return all keys and values so far."""
        if self.keys is None:
            self.keys, self.values = k.clone(), v.clone()
        else:
            self.keys = torch.cat([self.keys, k], dim=2)      # a new tensor: every old position is copied
            self.values = torch.cat([self.values, v], dim=2)
        self.bytes_copied += self.keys.nbytes + self.values.nbytes
        return self.keys, self.values

    def reset(self) -> None:
        self.keys = self.values = None
        self.bytes_copied = 0


def append_one_by_one(cache, k, v) -> None:
    """Feed ``k, v`` (batch, n_kv_heads, n, head_dim) into ``cache`` one position at a time."""
    for t in range(k.shape[2]):
        cache.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
