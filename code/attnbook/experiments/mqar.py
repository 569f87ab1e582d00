"""Multi-query associative recall (MQAR, Arora et al. 2023, Zoology) for the
tiny GPT with softmax, delta-rule and hybrid layers.

A sequence lists ``n_pairs`` key-value pairs, ``k_1 v_1 ... k_N v_N``, then
the ``N`` keys again in a random order; at each repeated key the model must
predict the value paired with it. Keys are drawn without repetition from the
first half of the vocabulary, values (with repetition) from the second half.
:func:`train_mqar` trains a :class:`attnbook.gpt.TinyGPT` whose layers are
``layer_types`` (``"attention"`` or a kind of
:class:`attnbook.delta.layer.DeltaLayer`) on fresh batches and returns its
accuracy on a held-out batch.

Chapter 15 (the delta rule) describes this experiment as a further one: a
comparison of six models over five seeds does not fit its one-minute budget
on two CPU cores. It runs here, e.g.::

    for layers in (("attention",) * 2, ("delta",) * 2,
                   ("gated_delta", "attention")):
        print(layers, train_mqar(layers, n_pairs=16, seed=0))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _validate
from ..gpt import GPTConfig, TinyGPT


def mqar_batch(n_pairs: int, vocab_size: int, batch: int, generator):
    """Token ids (batch, 3 n_pairs), the targets (batch, 3 n_pairs) and a
    boolean mask of the query positions (batch, 3 n_pairs): the target at
    query position ``t`` is the value of the key at ``t``; elsewhere -100."""
    n_pairs = _validate.positive_int("n_pairs", n_pairs)
    half = vocab_size // 2
    if half < n_pairs:
        raise ValueError(
            f"vocab_size={vocab_size} leaves {half} keys for "
            f"n_pairs={n_pairs} distinct keys"
        )
    keys = torch.stack(
        [
            torch.randperm(half, generator=generator)[:n_pairs]
            for _ in range(batch)
        ]
    )
    values = half + torch.randint(
        0, vocab_size - half, (batch, n_pairs), generator=generator
    )
    order = torch.stack(
        [torch.randperm(n_pairs, generator=generator) for _ in range(batch)]
    )
    pairs = torch.stack([keys, values], dim=-1).flatten(1)
    queries = keys.gather(1, order)
    ids = torch.cat([pairs, queries], dim=1)
    targets = torch.full_like(ids, -100)
    targets[:, 2 * n_pairs :] = values.gather(1, order)
    return ids, targets, targets != -100


def train_mqar(
    layer_types,
    n_pairs: int,
    seed: int,
    steps: int = 300,
    batch: int = 32,
    vocab_size: int = 128,
    d_model: int = 64,
    n_heads: int = 2,
    lr: float = 3e-3,
) -> float:
    """Accuracy on a held-out batch of 256 sequences after ``steps`` AdamW
    steps of a TinyGPT with ``layer_types`` on MQAR with ``n_pairs``
    pairs."""
    layer_types = tuple(layer_types)
    steps = _validate.positive_int("steps", steps)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TinyGPT(
        GPTConfig(
            vocab_size=vocab_size,
            context_length=3 * n_pairs,
            n_layers=len(layer_types),
            n_heads=n_heads,
            d_model=d_model,
            layer_types=layer_types,
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        ids, targets, _ = mqar_batch(n_pairs, vocab_size, batch, generator)
        logits = model(ids)
        loss = F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=-100
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    ids, targets, queries = mqar_batch(n_pairs, vocab_size, 256, generator)
    with torch.no_grad():
        predicted = model.eval()(ids).argmax(dim=-1)
    return float((predicted[queries] == targets[queries]).double().mean())
