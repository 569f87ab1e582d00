"""Held-out loss of the tiny GPT, and a short training loop to "uptrain" a converted model.

Ainslie et al. (2023) convert a multi-head checkpoint to grouped-query attention and then
continue its pre-training for a small fraction of the original steps, which they call
*uptraining*. :func:`uptrain` does that for :class:`attnbook.gpt.TinyGPT` on the text it
was trained on; :func:`heldout_loss` measures the result on text it never saw.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _validate


def windows(tokens, starts, length: int):
    """Inputs and next-token targets of the windows of ``tokens`` beginning at ``starts``.

    tokens: (n_tokens,) int64; starts: (b,) int64. Returns ``(x, y)``, each (b, length),
    where ``y[i, t] = x[i, t + 1]`` within the text.
    """
    offsets = starts[:, None] + torch.arange(length + 1)                 # (b, length + 1)
    if int(offsets.max()) >= len(tokens) or int(starts.min()) < 0:
        raise ValueError(f"windows of length {length} + 1 starting at {starts.min()}..{starts.max()} "
                         f"do not fit in {len(tokens)} tokens")
    chunk = tokens[offsets]
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def heldout_loss(model, tokens, n_windows: int = 32, length: int = 256, batch: int = 16,
                 seed: int = 0) -> float:
    """Mean next-token cross-entropy (nats per token) over ``n_windows`` seeded windows of ``tokens``.

    The same seed gives the same windows, so models are compared on identical text.
    """
    n_windows, length, batch = (_validate.positive_int(name, value) for name, value in (
        ("n_windows", n_windows), ("length", length), ("batch", batch)))
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(tokens) - length - 1, (n_windows,), generator=gen)
    was_training = model.training
    model.eval()
    total = 0.0
    for chunk in starts.split(batch):
        x, y = windows(tokens, chunk, length)
        total += F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
    model.train(was_training)
    return total / (n_windows * length)


def uptrain(model, tokens, steps: int, batch: int = 8, length: int = 128, lr: float = 1e-3,
            warmup: int = 5, seed: int = 0) -> list[float]:
    """Continue training ``model`` in place on random windows of ``tokens``; return the step losses.

    AdamW (betas 0.9, 0.95, no weight decay: a few steps should move the weights little
    anyway), the learning rate warmed up linearly over ``warmup`` steps and then
    constant, gradients clipped to norm 1. ``seed`` fixes the windows; the model is
    left in eval mode.
    """
    steps, batch, length = (_validate.positive_int(name, value) for name, value in (
        ("steps", steps), ("batch", batch), ("length", length)))
    if not lr > 0:
        raise ValueError(f"lr must be positive; got {lr!r}")
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / max(1, warmup))
        starts = torch.randint(len(tokens) - length - 1, (batch,), generator=gen)
        x, y = windows(tokens, starts, length)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses
