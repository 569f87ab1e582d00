"""What generating text costs, with and without a KV cache: flops counted, time
measured.

A decoder generates one token per forward pass. Without a cache, the pass for
the ``t``-th token runs the whole model over all ``t`` tokens so far,
recomputing keys and values that the previous pass had already computed; with a
cache it runs over the one new token and reads the old keys and values from
memory. The counts here make the difference exact;
:mod:`attnbook.experiments.cache_speed` measures it on the tiny GPT. Chapter 8
(the KV cache) shows :func:`forward_flops`, :func:`roofline_seconds` and
:func:`greedy_decode`; the shapes of published models are in
:mod:`attnbook.model_shapes`, and the caches themselves in
:mod:`attnbook.kv_cache` and :mod:`attnbook.quantized_cache`.

Time on a GPU is estimated with the roofline model: a pass takes at least its
flops over the GPU's peak flop/s and at least the bytes it must move between
memory and the chip over the memory bandwidth, whichever is larger
(:func:`roofline_seconds`). The GPU figures are the published ones of
:data:`attnbook.memory_traffic.GPUS`.

Flop conventions (as in :mod:`attnbook.cost`): a multiply-add is 2 flops, and
only matrix products are counted, the ones that dominate: the projections, the
two products of attention and the output head. Layer norms, the softmax,
activations and embedding look-ups are linear in the sequence length with a
small constant and are left out. Attention is counted *dense*: ``n_q x n_k``
scores per head, which is what a plain implementation computes even where the
causal mask discards them.
"""

from __future__ import annotations

import contextlib

import torch

from . import _validate
from .memory_traffic import GPU
from .model_shapes import ModelShape


# ---- flops ------------------------------------------------------------------


def forward_flops(
    shape: ModelShape, n_new: int, n_past: int = 0
) -> dict[str, int]:
    """Flops of one forward pass over ``n_new`` tokens that follow ``n_past``
    cached ones.

    Every new token is projected to queries, keys and values, attends to the
    ``n_past + n_new`` keys (dense count, see the module docstring), goes
    through the output projection and the MLP, and gets logits from the output
    head. Returns ``{"qkv_out": ..., "attention": ..., "mlp": ..., "head":
    ...}``; ``n_past=0`` and ``n_new=t`` is a pass without a cache over ``t``
    tokens.
    """
    n_new = _validate.positive_int("n_new", n_new)
    n_past = _validate.nonnegative_int("n_past", n_past)
    s, d = shape, shape.d_model
    n_k = n_past + n_new
    attn_width, kv_width = s.n_heads * s.d_head, s.n_kv_heads * s.d_head
    return {
        # q and the output projection are attn_width wide; k and v only
        # kv_width (GQA shrinks them)
        "qkv_out": s.n_layers
        * 2
        * n_new
        * (2 * d * attn_width + 2 * d * kv_width),
        # q k^T and weights @ v: each n_new x n_k x d_head multiply-adds per
        # query head
        "attention": s.n_layers * 2 * 2 * n_new * n_k * attn_width,
        "mlp": s.n_layers * 2 * n_new * s.mlp_matrices * d * s.d_ff,
        "head": 2 * n_new * d * s.vocab_size,
    }


def generation_flops(
    shape: ModelShape, n_prompt: int, n_new: int, use_cache: bool
) -> dict[str, int]:
    """Flops of generating ``n_new`` tokens after a prompt of ``n_prompt``,
    summed by part.

    Follows :meth:`attnbook.gpt.TinyGPT.generate`: ``n_new`` forward passes.
    Without a cache, pass ``i`` (from 0) runs over all ``n_prompt + i`` tokens.
    With one, pass 0 runs over the prompt (the *prefill*) and pass ``i > 0``
    over one token after ``n_prompt + i - 1`` cached ones (a *decode step*).
    """
    total = dict.fromkeys(("qkv_out", "attention", "mlp", "head"), 0)
    for n, past in generation_passes(n_prompt, n_new, use_cache):
        for part, flops in forward_flops(shape, n, past).items():
            total[part] += flops
    return total


def generation_passes(
    n_prompt: int, n_new: int, use_cache: bool
) -> list[tuple[int, int]]:
    """``(n_new, n_past)`` of each forward pass that generating ``n_new``
    tokens runs (see :func:`generation_flops`): ``(n_prompt + i, 0)`` without a
    cache, the prefill ``(n_prompt, 0)`` and then ``(1, n_prompt + i - 1)``
    with one."""
    n_prompt = _validate.positive_int("n_prompt", n_prompt)
    n_new = _validate.positive_int("n_new", n_new)
    if use_cache:
        return [(n_prompt, 0)] + [
            (1, n_prompt + i - 1) for i in range(1, n_new)
        ]
    return [(n_prompt + i, 0) for i in range(n_new)]


# ---- time on a GPU: the roofline --------------------------------------------


def forward_bytes(
    shape: ModelShape,
    n_new: int,
    n_past: int = 0,
    batch: int = 1,
    bytes_per_element: float = 2,
) -> dict[str, float]:
    """The least a forward pass must read from GPU memory: ``{"weights": ...,
    "kv": ...}``.

    Every weight of :meth:`ModelShape.matmul_params` once, however many tokens
    and sequences share it, and the keys and values of all ``n_past + n_new``
    positions of each of ``batch`` sequences, which attention reads.
    Activations, which a fused implementation keeps mostly on the chip, are
    left out, so the estimate is a lower bound.
    """
    n_new = _validate.positive_int("n_new", n_new)
    n_past = _validate.nonnegative_int("n_past", n_past)
    return {
        "weights": shape.matmul_params() * bytes_per_element,
        "kv": shape.cache_bytes(n_past + n_new, batch, bytes_per_element),
    }


def roofline_seconds(
    shape: ModelShape,
    gpu: GPU,
    n_new: int,
    n_past: int = 0,
    batch: int = 1,
    bytes_per_element: float = 2,
) -> float:
    """Roofline time of one forward pass of ``batch`` sequences over ``n_new``
    new tokens each.

    A GPU cannot finish sooner than its arithmetic allows (flops / peak flop/s)
    nor sooner than its memory can deliver the bytes (bytes / bandwidth);
    overlapped perfectly, the pass takes the larger of the two. Flops from
    :func:`forward_flops`, bytes from :func:`forward_bytes`.
    """
    batch = _validate.positive_int("batch", batch)
    flops = batch * sum(forward_flops(shape, n_new, n_past).values())
    moved = sum(
        forward_bytes(shape, n_new, n_past, batch, bytes_per_element).values()
    )
    return max(flops / gpu.fp16_flops, moved / gpu.hbm_bandwidth)


def generation_seconds(
    shape: ModelShape,
    gpu: GPU,
    n_prompt: int,
    n_new: int,
    use_cache: bool,
    batch: int = 1,
    bytes_per_element: float = 2,
) -> float:
    """Roofline time of generating ``n_new`` tokens: :func:`roofline_seconds`
    summed over the passes of :func:`generation_passes`."""
    return sum(
        roofline_seconds(shape, gpu, n, past, batch, bytes_per_element)
        for n, past in generation_passes(n_prompt, n_new, use_cache)
    )


# ---- decoding that shows its work -------------------------------------------


@torch.no_grad()
def greedy_decode(model, prompt, n_new: int, caches=None):
    """Greedy decoding that also returns the logits every token was chosen
    from.

    prompt: (batch, n) token ids; caches: one cache per layer (a
    :class:`attnbook.KVCache` or any cache of
    :class:`attnbook.cache_protocol.KVCacheProtocol`, e.g. a quantised one), or
    ``None`` to recompute the whole sequence at every step. Returns ``(ids,
    logits)``: ids (batch, n + n_new) and logits (batch, n_new, vocab_size),
    where ``logits[:, i]`` are the logits from which token ``n + i`` was
    picked.
    """
    n_new = _validate.positive_int("n_new", n_new)
    ids = prompt
    logits = [model(ids, caches)[:, -1]]  # the prefill
    for _ in range(n_new - 1):
        ids = torch.cat([ids, logits[-1].argmax(dim=-1, keepdim=True)], dim=1)
        if caches is None:
            # recompute everything
            logits.append(model(ids)[:, -1])
        else:
            logits.append(
                model(ids[:, -1:], caches, start_pos=ids.shape[1] - 1)[:, -1]
            )
    ids = torch.cat([ids, logits[-1].argmax(dim=-1, keepdim=True)], dim=1)
    return ids, torch.stack(logits, dim=1)


@torch.no_grad()
def teacher_forced_logits(model, ids, caches, n_prompt: int = 1):
    """Logits at every position of ``ids`` (batch, n), fed through ``caches``
    one token at a time after a prefill of ``n_prompt`` tokens: what decoding
    computes when it follows a given text.

    Returns (batch, n, vocab_size); equals ``model(ids)`` up to the cache's own
    error.
    """
    n_prompt = _validate.positive_int("n_prompt", n_prompt)
    steps = [model(ids[:, :n_prompt], caches)]
    steps += [
        model(ids[:, t : t + 1], caches, start_pos=t)
        for t in range(n_prompt, ids.shape[1])
    ]
    return torch.cat(steps, dim=1)


@contextlib.contextmanager
def recording_attention_outputs(model):
    """Inside the ``with`` block, collect each layer's attention output, pass
    after pass.

    Yields a list with one list per layer; each forward pass appends its
    (batch, n, d_model) attention output, so ``torch.cat(recorded[layer],
    dim=1)`` is the whole sequence.
    """
    recorded = [[] for _ in model.blocks]
    hooks = [
        block.attn.register_forward_hook(
            lambda module, args, out, i=i: recorded[i].append(out.detach())
        )
        for i, block in enumerate(model.blocks)
    ]
    try:
        yield recorded
    finally:
        for hook in hooks:
            hook.remove()


def append_one_by_one(cache, k, v) -> None:
    """Feed ``k, v`` (batch, n_kv_heads, n, d_head) into ``cache`` one position
    at a time."""
    for t in range(k.shape[2]):
        cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
