"""Associative recall: train a one-layer attention model with and without the
``1/sqrt(d_k)`` scale.

Chapter 3 (the scale) trains :class:`RecallAttention` over a grid of ``d_k``,
learning rates and seeds (the runs of one ``d_k`` together, scaled and raw,
:func:`train_recall_grid`), and shows that the unscaled training runs are
chaotic: moving every initial weight by one float32 ulp
(:func:`nudge_parameters`) changes where they end, while the scaled runs end
where they did. :func:`query_blind_accuracy` is the best accuracy a model that
ignores the query can reach, the baseline its failing runs are measured
against.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
from torch import nn


def recall_batch(
    batch: int,
    n_pairs: int,
    n_symbols: int,
    n_values: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, ...]:
    """A batch of "find the matching key" problems.

    Each problem shows ``n_pairs`` distinct key symbols (from ``n_symbols``),
    each paired with a random value (from ``n_values``), and a query that
    equals one of the keys. The answer is the value paired with that key.
    Returns ``query (batch,)``, ``keys (batch, n_pairs)``, ``values (batch,
    n_pairs)``, ``target (batch,)``, all int64.
    """
    if n_pairs > n_symbols:
        raise ValueError(
            f"n_pairs ({n_pairs}) distinct keys need at least as many "
            f"symbols; got n_symbols={n_symbols}"
        )
    keys = torch.argsort(
        torch.rand(batch, n_symbols, generator=generator), dim=-1
    )[:, :n_pairs]
    values = torch.randint(n_values, (batch, n_pairs), generator=generator)
    which = torch.randint(n_pairs, (batch,), generator=generator)
    rows = torch.arange(batch)
    return keys[rows, which], keys, values, values[rows, which]


class RecallAttention(nn.Module):
    """One attention layer that answers :func:`recall_batch` problems.

    The query symbol is embedded and projected to ``q (batch, 1, d_k)``, the
    key symbols (same embedding) to ``k (batch, n_pairs, d_k)``, the value
    symbols to ``v (batch, n_pairs, d_model)``; the attention output is read
    out as logits over values. ``scaled`` chooses ``q k^T / sqrt(d_k)`` or the
    raw ``q k^T``. Every layer keeps PyTorch's default initialisation
    (``nn.Embedding``: N(0, 1); ``nn.Linear``: uniform with variance ``1 / (3
    fan_in)``), unless ``init_std`` sets the std of ``W_Q`` and ``W_K``.
    """

    def __init__(
        self,
        n_symbols: int,
        n_values: int,
        d_model: int,
        d_k: int,
        scaled: bool = True,
        init_std: float | None = None,
    ):
        super().__init__()
        self.d_k, self.scaled = d_k, scaled
        self.key_embedding = nn.Embedding(n_symbols, d_model)
        self.value_embedding = nn.Embedding(n_values, d_model)
        self.q_proj = nn.Linear(d_model, d_k, bias=False)
        self.k_proj = nn.Linear(d_model, d_k, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.readout = nn.Linear(d_model, n_values)
        if init_std is not None:
            nn.init.normal_(self.q_proj.weight, std=init_std)
            nn.init.normal_(self.k_proj.weight, std=init_std)
        # what the scores are divided by: sqrt(d_k), or 1 for raw scores. A
        # buffer, not a flag, so that scaled and raw runs can train in one
        # stack (train_recall_grid); not saved in the state_dict
        self.register_buffer(
            "score_divisor",
            torch.tensor(d_k**0.5 if scaled else 1.0),
            persistent=False,
        )

    def score_table(self) -> torch.Tensor:
        """The score of every query symbol against every key symbol,
        ``(n_symbols, n_symbols)``."""
        # (n_symbols, d_model)
        symbols = self.key_embedding.weight
        # (n_symbols, d_k) each
        q, k = self.q_proj(symbols), self.k_proj(symbols)
        return (q @ k.T) / self.score_divisor

    def scores(self, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Attention scores (the softmax's inputs) ``(batch, 1, n_pairs)``,
        scaled or not.

        A score depends only on the two symbols, and there are only
        ``n_symbols`` of them: so look each example's scores up in
        :meth:`score_table` instead of projecting every token (the same
        numbers, many times faster at large ``d_k``).
        """
        return self.score_table()[query[:, None], keys][:, None, :]

    def forward(
        self, query, keys, values
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output logits over values ``(batch, n_values)`` and attention
        weights ``(batch, n_pairs)``."""
        # The softmax and weighted sum of attnbook.attend, written out on
        # purpose: the scores are looked up in score_table() instead of
        # computed as q @ k^T, and scaled there or not. (batch, 1, n_pairs)
        weights = torch.softmax(self.scores(query, keys), dim=-1)
        # (batch, n_pairs, d_model)
        v = self.v_proj(self.value_embedding.weight)[values]
        # (batch, 1, d_model)
        out = weights @ v
        return self.readout(out[:, 0]), weights[:, 0]


class AdditiveRecallAttention(RecallAttention):
    """:class:`RecallAttention` with additive scores (Bahdanau et al. 2015)
    instead of dot products.

    The score of query symbol ``a`` against key symbol ``b`` is ``w . tanh(q_a
    + k_b)``, with ``q`` and ``k`` the same projections to ``d_k`` as the
    dot-product model and ``w (d_k,)`` a learned vector (``score_vector``).
    Every ``tanh`` lies in (-1, 1) and ``w`` starts with variance ``1 / (3
    d_k)``, so the scores start with a spread that does not grow with ``d_k``:
    there is nothing to scale, and ``scaled`` must be False. Britz et al.
    (2017) found additive attention slightly but consistently better than
    (unscaled) multiplicative attention in their sweep of translation models;
    Vaswani et al. (2017, section 3.2.1) read this as additive attention
    outperforming unscaled dot products for larger ``d_k``. Chapter 3 repeats
    the comparison. Only :meth:`score_table` changes.
    """

    def __init__(
        self,
        n_symbols: int,
        n_values: int,
        d_model: int,
        d_k: int,
        scaled: bool = False,
        init_std: float | None = None,
    ):
        if scaled:
            raise ValueError(
                "additive scores have no 1/sqrt(d_k) scale; pass scaled=False"
            )
        super().__init__(
            n_symbols, n_values, d_model, d_k, scaled=False, init_std=init_std
        )
        self.score_vector = nn.Linear(d_k, 1, bias=False)

    def score_table(self) -> torch.Tensor:
        # (n_symbols, d_model)
        symbols = self.key_embedding.weight
        # (n_symbols, d_k) each
        q, k = self.q_proj(symbols), self.k_proj(symbols)
        # (n_symbols, n_symbols, d_k)
        hidden = torch.tanh(q[:, None, :] + k[None, :, :])
        # (n_symbols, n_symbols)
        return self.score_vector(hidden)[..., 0]


def nudge_parameters(model: nn.Module, ulps: int = 1) -> None:
    """Move every parameter of ``model`` by ``ulps`` units in the last place,
    in place.

    One ulp is the gap to the next representable number (for float32, between
    2^-24 and 2^-23, about 1e-7, of the value): ``torch.nextafter`` towards
    ``+inf`` for ``ulps > 0``, towards ``-inf`` for ``ulps < 0``; ``ulps = 0``
    changes nothing. Chapter 3 uses it to ask whether a training run's outcome
    depends on the last bit of its start.
    """
    direction = float("inf") if ulps > 0 else float("-inf")
    with torch.no_grad():
        for p in model.parameters():
            target = torch.full_like(p, direction)
            for _ in range(abs(ulps)):
                p.copy_(torch.nextafter(p, target))


@dataclass
class RecallRun:
    """What :func:`train_recall` measured: per-step training loss and
    end-of-run statistics."""

    d_k: int
    scaled: bool
    losses: np.ndarray  # (steps,) training cross-entropy
    accuracy: float  # on a held-out batch after training
    # cross-entropy on that held-out batch after training
    held_out_loss: float
    # std of the attention scores (the softmax's inputs) at start and end
    score_std: tuple[float, float]
    # mean attention entropy (nats) at start and end
    entropy: tuple[float, float]
    # mean |change| of the held-out attention scores over the first
    # `early_steps` steps
    early_score_change: float
    # share of held-out queries whose largest weight is on the matching key,
    # start and end
    attends_to_match: tuple[float, float]


def train_recall(
    d_k: int,
    scaled: bool,
    steps: int = 300,
    lr: float = 3e-3,
    batch: int = 32,
    n_pairs: int = 8,
    n_symbols: int = 16,
    n_values: int = 16,
    d_model: int = 32,
    init_std: float | None = None,
    seed: int = 0,
    early_steps: int = 5,
    perturb_ulps: int = 0,
    additive: bool = False,
) -> RecallRun:
    """Train :class:`RecallAttention` with Adam on fresh random batches; fully
    seeded.

    The model and the data use their own generators seeded from ``seed``, so
    two calls with the same arguments give the same numbers on one machine
    (another CPU's kernels round differently, and an unscaled run can then end
    elsewhere). ``early_steps`` sets how many first steps the
    ``early_score_change`` measurement (how far the first steps move the
    attention scores) covers. ``perturb_ulps`` moves every initial weight by
    that many float32 ulps (:func:`nudge_parameters`) before training; the data
    stay the same. ``additive`` trains :class:`AdditiveRecallAttention` instead
    (``scaled`` must then be False).
    """
    if not 1 <= early_steps <= steps:
        raise ValueError(
            f"early_steps must lie in [1, steps={steps}]; got {early_steps}"
        )
    torch.manual_seed(seed)
    model_class = AdditiveRecallAttention if additive else RecallAttention
    model = model_class(n_symbols, n_values, d_model, d_k, scaled, init_std)
    if perturb_ulps:
        nudge_parameters(model, perturb_ulps)
    data = torch.Generator().manual_seed(seed + 1)
    held_out = recall_batch(
        512,
        n_pairs,
        n_symbols,
        n_values,
        torch.Generator().manual_seed(seed + 2),
    )
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    start = _recall_probe(model, held_out)
    with torch.no_grad():
        start_scores = model.scores(held_out[0], held_out[1])
    losses = np.empty(steps)
    for step in range(steps):
        query, keys, values, target = recall_batch(
            batch, n_pairs, n_symbols, n_values, data
        )
        logits, _ = model(query, keys, values)
        loss = nn.functional.cross_entropy(logits, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses[step] = loss.item()
        if step + 1 == early_steps:
            with torch.no_grad():
                early = (
                    (model.scores(held_out[0], held_out[1]) - start_scores)
                    .abs()
                    .mean()
                    .item()
                )
    end = _recall_probe(model, held_out)
    return RecallRun(
        d_k,
        scaled,
        losses,
        end[0],
        end[3],
        (start[1], end[1]),
        (start[2], end[2]),
        early,
        (start[4], end[4]),
    )


def train_recall_seeds(
    d_k: int,
    scaled: bool,
    seeds,
    lrs=(3e-3,),
    steps: int = 300,
    batch: int = 32,
    n_pairs: int = 8,
    n_symbols: int = 16,
    n_values: int = 16,
    d_model: int = 32,
    init_std: float | None = None,
    early_steps: int = 5,
    perturb_ulps: int = 0,
    additive: bool = False,
) -> dict[tuple[float, int], RecallRun]:
    """:func:`train_recall` for every learning rate in ``lrs`` and every seed
    in ``seeds``, all trained at once: :func:`train_recall_grid` for one kind
    of scores. Returns ``{(lr, seed): RecallRun}``."""
    runs = train_recall_grid(
        d_k,
        [scaled],
        seeds,
        lrs,
        steps=steps,
        batch=batch,
        n_pairs=n_pairs,
        n_symbols=n_symbols,
        n_values=n_values,
        d_model=d_model,
        init_std=init_std,
        early_steps=early_steps,
        perturb_ulps=perturb_ulps,
        additive=additive,
    )
    return {(lr, seed): run for (lr, _, seed), run in runs.items()}


@functools.lru_cache(maxsize=4)
def _batch_stream(
    seeds: tuple[int, ...],
    steps: int,
    batch: int,
    n_pairs: int,
    n_symbols: int,
    n_values: int,
) -> tuple[torch.Tensor, ...]:
    """The training batches of every step for every seed, drawn in
    :func:`train_recall`'s order: query, keys, values, target, ``(steps,
    n_seeds, batch[, n_pairs])`` each. Cached: a chapter trains many grids on
    the same seeds' batches (callers only read them)."""
    draws = []
    for seed in seeds:
        data = torch.Generator().manual_seed(seed + 1)
        draws.append(
            [
                recall_batch(batch, n_pairs, n_symbols, n_values, data)
                for _ in range(steps)
            ]
        )
    return tuple(
        torch.stack(
            [
                torch.stack([draws[j][step][part] for step in range(steps)])
                for j in range(len(seeds))
            ],
            dim=1,
        )
        for part in range(4)
    )


def train_recall_grid(
    d_k: int,
    scalings,
    seeds,
    lrs=(3e-3,),
    steps: int = 300,
    batch: int = 32,
    n_pairs: int = 8,
    n_symbols: int = 16,
    n_values: int = 16,
    d_model: int = 32,
    init_std: float | None = None,
    early_steps: int = 5,
    perturb_ulps: int = 0,
    additive: bool = False,
) -> dict[tuple[float, bool, int], RecallRun]:
    """:func:`train_recall` for every learning rate in ``lrs``, every kind of
    scores in ``scalings`` (``True`` scaled, ``False`` raw) and every seed in
    ``seeds``, all trained at once.

    Returns ``{(lr, scaled, seed): RecallRun}``. Each run is the one
    :func:`train_recall` describes, with the same arguments: its model is built
    and nudged from its own seed as there, and it trains on the same batches
    and is probed on the same held-out batch. Only the arithmetic is arranged
    differently: the runs' weights (and their score divisors, ``sqrt(d_k)`` or
    1) are stacked along a leading axis and one call of the model
    (``torch.vmap`` over :class:`RecallAttention`'s own ``forward``) computes
    every run's step, since a step of these tiny models costs mostly the
    overhead of launching its operations. The runs stay independent (the loss
    minimised is the sum of the runs' losses, whose gradient for each run's
    weights is that run's own; Adam works element by element), but the batched
    kernels round differently from the unbatched ones, as another CPU's kernels
    do, so a chaotic (unscaled, large ``d_k``) run can end elsewhere than its
    :func:`train_recall` twin; the scaled runs agree with it to rounding
    (``tests/test_recall.py``). A run's numbers do not depend on which other
    runs share the stack. Chapter 3 trains its grids so.
    """
    if not 1 <= early_steps <= steps:
        raise ValueError(
            f"early_steps must lie in [1, steps={steps}]; got {early_steps}"
        )
    seeds, lrs = [int(s) for s in seeds], [float(lr) for lr in lrs]
    scalings = [bool(s) for s in scalings]
    if (
        not seeds
        or not lrs
        or not scalings
        or len(set(seeds)) != len(seeds)
        or len(set(lrs)) != len(lrs)
        or len(set(scalings)) != len(scalings)
    ):
        raise ValueError(
            "seeds, lrs and scalings must be non-empty and without repeats; "
            f"got seeds={seeds}, lrs={lrs}, scalings={scalings}"
        )
    if additive and any(scalings):
        raise ValueError(
            "additive scores have no 1/sqrt(d_k) scale; pass scalings=[False]"
        )
    model_class = AdditiveRecallAttention if additive else RecallAttention
    # run i of the stack: lr-major, then the kind of scores, then the seed
    keys_of_runs = [
        (lr, scaled, seed)
        for lr in lrs
        for scaled in scalings
        for seed in seeds
    ]
    models = []
    # each built exactly as train_recall builds it
    for lr, scaled, seed in keys_of_runs:
        torch.manual_seed(seed)
        model = model_class(
            n_symbols, n_values, d_model, d_k, scaled, init_std
        )
        if perturb_ulps:
            nudge_parameters(model, perturb_ulps)
        models.append(model)
    n_runs, per_lr = len(models), len(scalings) * len(seeds)
    # (steps, n_runs, batch[, n_pairs]) each
    run_seed = [seeds.index(seed) for _, _, seed in keys_of_runs]
    stream = [
        part[:, run_seed]
        for part in _batch_stream(
            tuple(seeds), steps, batch, n_pairs, n_symbols, n_values
        )
    ]
    held_out = {
        seed: recall_batch(
            512,
            n_pairs,
            n_symbols,
            n_values,
            torch.Generator().manual_seed(seed + 2),
        )
        for seed in seeds
    }
    start = [
        _recall_probe(model, held_out[seed])
        for model, (_, _, seed) in zip(models, keys_of_runs)
    ]
    with torch.no_grad():
        start_scores = [
            model.scores(*held_out[seed][:2])
            for model, (_, _, seed) in zip(models, keys_of_runs)
        ]

    # one stack of weights per learning rate (an Adam parameter group each),
    # joined for the model call; the buffers (score divisors) of every run
    groups = [
        torch.func.stack_module_state(models[i * per_lr : (i + 1) * per_lr])[0]
        for i in range(len(lrs))
    ]
    buffers = torch.func.stack_module_state(models)[1]
    opt = torch.optim.Adam(
        [{"params": list(g.values()), "lr": lr} for g, lr in zip(groups, lrs)]
    )
    template = copy.deepcopy(models[0]).to("meta")
    step_all = torch.vmap(
        lambda params, buffers, q, k, v: torch.func.functional_call(
            template, (params, buffers), (q, k, v)
        )
    )

    def stacked() -> dict[str, torch.Tensor]:
        return (
            groups[0]
            if len(groups) == 1
            else {
                name: torch.cat([g[name] for g in groups])
                for name in groups[0]
            }
        )

    # copy each run's weights into its own model, to probe it with
    # train_recall's code
    def unstack() -> None:
        with torch.no_grad():
            for name, weights in stacked().items():
                for model, w in zip(models, weights):
                    model.get_parameter(name).copy_(w)

    losses = torch.empty(steps, n_runs)
    early = [0.0] * n_runs
    for step in range(steps):
        # (n_runs, batch) each
        query, keys, values, target = (part[step] for part in stream)
        # (n_runs, batch, n_values)
        logits, _ = step_all(stacked(), buffers, query, keys, values)
        loss = nn.functional.cross_entropy(
            logits.flatten(0, 1), target.flatten(), reduction="none"
        )
        # each run's own mean loss
        loss = loss.view(n_runs, batch).mean(1)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
        losses[step] = loss.detach()
        if step + 1 == early_steps:
            unstack()
            with torch.no_grad():
                early = [
                    (model.scores(*held_out[seed][:2]) - s0)
                    .abs()
                    .mean()
                    .item()
                    for model, (_, _, seed), s0 in zip(
                        models, keys_of_runs, start_scores
                    )
                ]
    unstack()
    runs = {}
    for i, (model, (lr, scaled, seed)) in enumerate(zip(models, keys_of_runs)):
        end = _recall_probe(model, held_out[seed])
        runs[lr, scaled, seed] = RecallRun(
            d_k,
            scaled,
            losses[:, i].double().numpy(),
            end[0],
            end[3],
            (start[i][1], end[1]),
            (start[i][2], end[2]),
            early[i],
            (start[i][4], end[4]),
        )
    return runs


def reparametrisation_gap(
    d_k: int,
    steps: int = 50,
    lr: float = 1e-3,
    batch: int = 32,
    n_pairs: int = 8,
    n_symbols: int = 16,
    n_values: int = 16,
    d_model: int = 32,
    seed: int = 0,
    rescale_lr: bool = True,
) -> float:
    """Largest difference between the held-out output logits of a scaled model
    and of its unscaled twin.

    The twin has no ``1/sqrt(d_k)``; instead its ``W_Q`` starts ``sqrt(d_k)``
    times smaller and trains with a ``sqrt(d_k)`` times smaller learning rate
    (and Adam's ``eps`` ``sqrt(d_k)`` times larger, so that Adam's step, which
    does not depend on the size of the gradient, is the same). Both train in
    float64 on the same batches. With ``sqrt(d_k)`` a power of two every one of
    these rescalings is exact in floating point, so the gap is exactly 0: the
    scale is a reparametrisation of the unscaled model, not a different model.
    d_k must be a power of 4.
    """
    root = math.isqrt(d_k)
    if root * root != d_k or root & (root - 1):
        raise ValueError(
            "d_k must be a power of 4, so that sqrt(d_k) is a power of two; "
            f"got {d_k}"
        )
    torch.manual_seed(seed)
    scaled = RecallAttention(
        n_symbols, n_values, d_model, d_k, scaled=True
    ).double()
    twin = RecallAttention(
        n_symbols, n_values, d_model, d_k, scaled=False
    ).double()
    twin.load_state_dict(scaled.state_dict())
    with torch.no_grad():
        twin.q_proj.weight /= root
    eps = 1e-8
    factor = root if rescale_lr else 1
    optimizers = [
        torch.optim.Adam(scaled.parameters(), lr=lr, eps=eps),
        torch.optim.Adam(
            [
                {
                    "params": [twin.q_proj.weight],
                    "lr": lr / factor,
                    "eps": eps * factor,
                },
                {
                    "params": [
                        p
                        for n, p in twin.named_parameters()
                        if n != "q_proj.weight"
                    ]
                },
            ],
            lr=lr,
            eps=eps,
        ),
    ]
    data = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        query, keys, values, target = recall_batch(
            batch, n_pairs, n_symbols, n_values, data
        )
        for model, opt in zip((scaled, twin), optimizers):
            loss = nn.functional.cross_entropy(
                model(query, keys, values)[0], target
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    held_out = recall_batch(
        512,
        n_pairs,
        n_symbols,
        n_values,
        torch.Generator().manual_seed(seed + 2),
    )
    with torch.no_grad():
        return (
            (scaled(*held_out[:3])[0] - twin(*held_out[:3])[0])
            .abs()
            .max()
            .item()
        )


def query_blind_accuracy(n_pairs: int = 8, n_values: int = 16) -> float:
    """The best held-out accuracy of any model that ignores the query, exactly.

    In :func:`recall_batch` the ``n_pairs`` values are independent and uniform
    over ``n_values`` and the query picks one pair uniformly, independently of
    the keys and values. A model that does not look at the query can do no
    better than answer the most frequent value of the example, which is right
    with probability ``E[max_v count(v)] / n_pairs``. (Uniform attention
    followed by a linear readout reaches it: the attended vector is ``sum_v
    count(v) u_v / n_pairs``, the average of the example's value vectors
    ``u_v``; when the ``n_values`` vectors ``u_v`` are linearly independent
    (possible when ``n_values <= d_model``, and true of almost every random
    draw), a linear readout recovers the counts, and its argmax picks the
    largest. They need not be orthogonal.) Computed in exact rational
    arithmetic: ``P(max count <= m) = n_pairs! [x^n_pairs] (sum_{j <= m} x^j /
    j!)^n_values / n_values^n_pairs``.
    """
    if n_pairs < 1 or n_values < 1:
        raise ValueError(
            f"n_pairs and n_values must be positive; got n_pairs={n_pairs}, "
            f"n_values={n_values}"
        )

    def at_most(m: int) -> Fraction:  # P(no value occurs more than m times)
        term = [
            Fraction(1, math.factorial(j)) if j <= m else Fraction(0)
            for j in range(n_pairs + 1)
        ]
        # power series, truncated at x^n_pairs
        poly = [Fraction(1)] + [Fraction(0)] * n_pairs
        for _ in range(n_values):
            poly = [
                sum(poly[i] * term[k - i] for i in range(k + 1))
                for k in range(n_pairs + 1)
            ]
        return (
            poly[n_pairs]
            * math.factorial(n_pairs)
            / Fraction(n_values) ** n_pairs
        )

    # E[max] = sum_m P(max > m)
    expected_max = sum(1 - at_most(m) for m in range(n_pairs))
    return float(expected_max / n_pairs)


@torch.no_grad()
def _recall_probe(
    model: RecallAttention, batch
) -> tuple[float, float, float, float, float]:
    """Accuracy, attention-score std, mean attention entropy, cross-entropy of
    ``model`` on ``batch``, and the share of queries whose largest attention
    weight is on the matching key."""
    query, keys, values, target = batch
    logits, weights = model(query, keys, values)
    accuracy = (logits.argmax(-1) == target).double().mean().item()
    score_std = model.scores(query, keys).std().item()
    p = weights.double().clamp_min(1e-300)
    entropy = -(weights.double() * p.log()).sum(-1).mean().item()
    loss = nn.functional.cross_entropy(logits, target).item()
    # position of the matching key
    match = (keys == query[:, None]).long().argmax(-1)
    attends_to_match = (weights.argmax(-1) == match).double().mean().item()
    return accuracy, score_std, entropy, loss, attends_to_match
