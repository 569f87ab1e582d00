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

The grid of chapter 16 (the delta rule) is :func:`run_mqar_grid`: six
two-layer models (:data:`MODELS`: softmax attention, linear attention,
scalar decay, DeltaNet, Gated DeltaNet, and a hybrid of one Gated DeltaNet
layer and one softmax layer), every linear layer with the same state, five
seeds, each model trained once on the pair counts :data:`GRID_PAIRS`
(entering one by one, a curriculum, then taking turns) with one learning
rate chosen on another seed (:data:`LR_RULE`), and scored at each. Every
model is a :class:`ShiftedGPT`: the tiny GPT with the previous token's
embedding added to each input, so that MQAR measures the recall and not
how fast a model learns to bind a value to the key before it. It does not
fit the chapter's one-minute budget, so it is run once by::

    python -m attnbook.experiments.mqar --write

which writes the accuracies with their provenance to the package data file
``attnbook/data/mqar_results.json``; the chapter loads it
(:func:`load_results`) and computes its verdicts with :func:`verdicts`.
"""

from __future__ import annotations

import json
import time
from importlib import resources

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import _validate
from ..gpt import GPTConfig, TinyGPT
from . import provenance


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


# --- the grid: six models, five seeds, several pair counts -------------------

# every model has two layers; the linear ones all keep, per layer, n_heads
# states of d_head x d_head numbers
MODELS = {
    "softmax": ("attention", "attention"),
    "linear": ("linear", "linear"),
    "decay": ("decay", "decay"),
    "delta": ("delta", "delta"),
    "gated_delta": ("gated_delta", "gated_delta"),
    "hybrid": ("gated_delta", "attention"),
}
GRID_PAIRS = (4, 8, 16, 32)
GRID_SEEDS = (0, 1, 2, 3, 4)
# the learning rate was chosen on a seed of its own, not one of the grid's;
# lr_sweep runs such a choice per model (Zoology sweeps the learning rate per
# model and reports the best)
LR_SEED = 100
LR_CANDIDATES = (1e-3, 3e-3, 1e-2)
LR_RULE = (
    "one learning rate for every model: the smallest candidate of "
    "(1e-3, 3e-3, 1e-2), at which every model learned the task (accuracy "
    ">= 0.5 at the smallest N) in a pilot run on seed 100, not a grid seed, "
    "with the grid's other hyper-parameters"
)
HYPERPARAMETERS = dict(
    steps=1000,
    batch=32,
    vocab_size=128,
    d_model=64,
    n_heads=4,
    lr=1e-3,  # LR_RULE; recorded per model
    weight_decay=0.1,
    eval_batch=256,
    curriculum=0.5,
)
RESULTS_FILE = "mqar_results.json"


class ShiftedGPT(nn.Module):
    """A :class:`attnbook.gpt.TinyGPT` whose input at each position also
    holds an embedding of the previous token (a causal convolution of width
    2 over the tokens, as the short convolutions of Zoology's models and of
    DeltaNet's implementations), without position embeddings.

    A copy of ``TinyGPT.forward`` kept on purpose: the experiment changes
    only what enters the first block, so that every model gets the pair
    ``(k_i, v_i)`` at the value's position for free and MQAR measures the
    lookup, not how fast a model learns to bind a token to the one before it.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.gpt = TinyGPT(config)
        self.prev_emb = nn.Embedding(config.vocab_size, config.d_model)
        nn.init.normal_(self.prev_emb.weight, std=0.02)

    def forward(self, ids):
        """ids (batch, n) -> logits (batch, n, vocab_size), causal."""
        gpt = self.gpt
        previous = F.pad(self.prev_emb(ids), (0, 0, 1, 0))[:, :-1]
        x = gpt.tok_emb(ids) + previous
        for block in gpt.blocks:
            x = block(x)
        return gpt.head(gpt.ln_f(x))


def train_shifted(
    layer_types,
    seed: int,
    n_pairs=GRID_PAIRS,
    steps: int = 1000,
    batch: int = 32,
    vocab_size: int = 128,
    d_model: int = 64,
    n_heads: int = 4,
    lr: float = 1e-2,
    weight_decay: float = 0.1,
    eval_batch: int = 256,
    curriculum: float = 0.0,
) -> dict[int, float]:
    """Train a :class:`ShiftedGPT` with ``layer_types`` on MQAR and return its
    accuracy at each pair count of ``n_pairs``.

    Step ``s`` trains on a fresh batch of ``n_pairs[s % len(n_pairs)]``
    pairs (the counts take turns) or, with a ``curriculum`` c > 0, of
    :func:`curriculum_pairs` (the counts enter one by one over the first
    fraction c of the steps), with AdamW and a one-cycle schedule (10 %
    warm-up to ``lr``, then cosine decay). The accuracy at each count is that
    of the predicted values on ``eval_batch`` held-out sequences, drawn from
    a generator of their own. Every random choice comes from ``seed``; run it
    with one thread for results that do not depend on the core count.
    """
    layer_types, n_pairs = tuple(layer_types), tuple(n_pairs)
    steps = _validate.positive_int("steps", steps)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = ShiftedGPT(
        GPTConfig(
            vocab_size=vocab_size,
            context_length=3 * max(n_pairs),
            n_layers=len(layer_types),
            n_heads=n_heads,
            d_model=d_model,
            layer_types=layer_types,
        )
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, weight_decay=weight_decay
    )
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=steps, pct_start=0.1
    )
    for step in range(steps):
        n = curriculum_pairs(n_pairs, step, steps, curriculum)
        ids, targets, _ = mqar_batch(n, vocab_size, batch, generator)
        loss = F.cross_entropy(
            model(ids).flatten(0, 1), targets.flatten(), ignore_index=-100
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    held_out = torch.Generator().manual_seed(1000 + seed)
    accuracy = {}
    model.eval()
    with torch.no_grad():
        for n in n_pairs:
            ids, targets, queries = mqar_batch(
                n, vocab_size, eval_batch, held_out
            )
            predicted = model(ids).argmax(dim=-1)
            right = predicted[queries] == targets[queries]
            accuracy[n] = float(right.double().mean())
    return accuracy


def curriculum_pairs(n_pairs, step: int, steps: int, curriculum: float):
    """The pair count of training step ``step`` of ``steps``: the counts
    ``n_pairs`` take turns, but during the first fraction ``curriculum`` of
    the steps only the first ``j`` of them do, ``j`` growing from 1 to all
    in equal stages (0: all counts from the first step)."""
    n_pairs = tuple(n_pairs)
    if curriculum > 0:
        stage = len(n_pairs) * step // max(1, int(curriculum * steps))
        n_pairs = n_pairs[: min(len(n_pairs), stage + 1)]
    return n_pairs[step % len(n_pairs)]


def state_numbers(d_model: int, n_heads: int) -> int:
    """The numbers a linear layer of the grid keeps: ``n_heads`` states of
    ``d_head x d_head`` (the same for every kind)."""
    d_head = d_model // n_heads
    return n_heads * d_head * d_head


def cache_numbers(d_model: int, n_tokens: int) -> int:
    """The numbers a softmax layer's KV cache holds after ``n_tokens``: a key
    and a value of ``d_model`` numbers each per token."""
    return 2 * d_model * n_tokens


def one_run(job) -> dict:
    """One (model, seed) of the grid, deterministic and on one thread (the
    settings before it are restored after it); the argument is ``(model
    name, seed, n_pairs, hyper-parameters)``, whose ``lr`` is a number or a
    dictionary from model names to numbers."""
    name, seed, n_pairs, hp = job
    if isinstance(hp["lr"], dict):
        hp = {**hp, "lr": hp["lr"][name]}
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        accuracy = train_shifted(MODELS[name], seed, n_pairs, **hp)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    return {
        "model": name,
        "seed": seed,
        "lr": hp["lr"],
        "accuracy": {str(n): a for n, a in accuracy.items()},
        "wall_s": round(time.perf_counter() - wall, 1),
        "cpu_s": round(time.process_time() - cpu, 1),
    }


def run_all(order, jobs: int = 1, progress=None) -> list[dict]:
    """:func:`one_run` of every job of ``order``, in ``jobs`` processes;
    ``progress(run)`` after each."""
    runs = []
    if jobs == 1:
        for job in order:
            runs.append(one_run(job))
            if progress:
                progress(runs[-1])
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=context) as pool:
            for run in pool.map(one_run, order):
                runs.append(run)
                if progress:
                    progress(run)
    torch.set_num_threads(1)
    return runs


def choose_lr(sweep_runs, n_pairs) -> dict[str, float]:
    """Per model, the learning rate whose run had the highest mean accuracy
    over ``n_pairs`` (the smaller one on a tie): :data:`LR_RULE`."""
    best = {}
    for run in sweep_runs:
        mean = float(np.mean([run["accuracy"][str(n)] for n in n_pairs]))
        name = run["model"]
        if name not in best or (mean, -run["lr"]) > best[name][:2]:
            best[name] = (mean, -run["lr"], run["lr"])
    return {name: lr for name, (_, _, lr) in best.items()}


def lr_sweep(
    models=tuple(MODELS),
    n_pairs=GRID_PAIRS,
    lr_candidates=LR_CANDIDATES,
    lr_seed: int = LR_SEED,
    jobs: int = 1,
    progress=None,
    **hyperparameters,
) -> dict:
    """One run per model of ``models`` and learning rate of
    ``lr_candidates`` on the seed ``lr_seed``, and each model's choice by
    :func:`choose_lr`: the record ``lr_sweep`` of the results file."""
    hp = {**HYPERPARAMETERS, **hyperparameters}
    n_pairs = tuple(n_pairs)
    order = [
        (m, lr_seed, n_pairs, {**hp, "lr": c})
        for c in lr_candidates
        for m in models
    ]
    start = time.perf_counter()
    runs = run_all(order, jobs, progress)
    return {
        "rule": LR_RULE,
        "seed": lr_seed,
        "candidates": list(lr_candidates),
        "chosen": choose_lr(runs, n_pairs),
        "hyperparameters": {k: v for k, v in hp.items() if k != "lr"},
        "n_pairs": list(n_pairs),
        "git_commit": provenance.git_commit(),
        "wall_s": round(time.perf_counter() - start, 1),
        "cpu_s": round(sum(r["cpu_s"] for r in runs), 1),
        "runs": runs,
    }


def run_mqar_grid(
    models=tuple(MODELS),
    seeds=GRID_SEEDS,
    n_pairs=GRID_PAIRS,
    jobs: int = 1,
    progress=None,
    lr=None,
    **hyperparameters,
) -> dict:
    """Train every model of ``models`` for every seed and return the
    results with their provenance (the dictionary the JSON file holds).

    ``lr``: a dictionary from model names to learning rates, or a recorded
    :func:`lr_sweep` (whose choice is taken and recorded as ``lr_sweep``);
    when None, every model gets ``hyperparameters["lr"]`` (:data:`LR_RULE`).
    ``hyperparameters`` override the rest of :data:`HYPERPARAMETERS`;
    ``jobs`` processes run the runs, each on one thread (the results do not
    depend on it); ``progress(run)`` is called after each run.
    """
    from .. import bench

    hp = {**HYPERPARAMETERS, **hyperparameters}
    if LR_SEED in seeds:
        raise ValueError(f"seed {LR_SEED} chose the learning rate")
    # the code the runs start from (a later edit does not change them)
    commit = provenance.git_commit()
    n_pairs = tuple(n_pairs)
    start = time.perf_counter()
    sweep = None
    if lr is None:
        lr = {m: hp["lr"] for m in models}
    elif "chosen" in lr:
        sweep, lr = lr, lr["chosen"]
    hp["lr"] = {m: lr[m] for m in models}
    order = [(m, s, n_pairs, hp) for s in seeds for m in models]
    runs = run_all(order, jobs, progress)
    return {
        "experiment": "MQAR (Arora et al. 2023), chapter 16",
        "script": "python -m attnbook.experiments.mqar --write",
        "machine": bench.machine(),
        "torch": torch.__version__,
        "git_commit": commit,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "jobs": jobs,
        "wall_s": round(time.perf_counter() - start, 1),
        "cpu_s": round(sum(r["cpu_s"] for r in runs), 1),
        "hyperparameters": hp,
        "lr_rule": LR_RULE if sweep is None else sweep["rule"],
        "lr_sweep": sweep,
        "models": {m: list(MODELS[m]) for m in models},
        "n_pairs": list(n_pairs),
        "seeds": list(seeds),
        "state_numbers_per_linear_layer": state_numbers(
            hp["d_model"], hp["n_heads"]
        ),
        "runs": runs,
    }


def load_results(path=None) -> dict:
    """The committed results (``attnbook/data/mqar_results.json``), or those
    of ``path``."""
    if path is None:
        text = (
            resources.files("attnbook")
            .joinpath("data", RESULTS_FILE)
            .read_text(encoding="utf-8")
        )
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    return json.loads(text)


def accuracies(results: dict) -> dict[str, np.ndarray]:
    """Per model, the accuracies as an array (seeds, pair counts), in the
    order of ``results["seeds"]`` and ``results["n_pairs"]``."""
    table = {}
    for name in results["models"]:
        rows = []
        for seed in results["seeds"]:
            (run,) = [
                r
                for r in results["runs"]
                if r["model"] == name and r["seed"] == seed
            ]
            rows.append([run["accuracy"][str(n)] for n in results["n_pairs"]])
        table[name] = np.array(rows)
    return table


# --- verdicts: what holds in every seed -------------------------------------

SOLVED = 0.99  # an accuracy that counts as solving MQAR at a pair count
BEATS = 0.1  # a gap in accuracy that counts as one model beating another
# a run learned the task if its accuracy at the smallest N reached this (a
# guess is right with probability 1 / (vocab_size / 2))
LEARNED, LEARNED_MARGIN = 0.5, 0.05
# a value this close to a threshold is on neither side (rounding decides)
SOLVED_MARGIN, BEATS_MARGIN = 0.005, 0.02
# (better, worse): the comparisons the chapter states
COMPARISONS = (
    ("softmax", "linear"),
    ("softmax", "decay"),
    ("delta", "linear"),
    ("gated_delta", "decay"),
    ("softmax", "delta"),
    ("softmax", "gated_delta"),
    ("softmax", "hybrid"),
    ("hybrid", "gated_delta"),
)
# (first, second): the directions the chapter states at the largest pair
# count, where no comparison above holds: in how many seeds the first is
# ahead by more than BEATS_MARGIN, and in how many behind by more than it
DIRECTIONS = (("linear", "delta"),)
NAMES = {
    "softmax": "softmax attention",
    "linear": "linear attention",
    "decay": "scalar decay",
    "delta": "DeltaNet",
    "gated_delta": "Gated DeltaNet",
    "hybrid": "the hybrid",
}


def capacity(
    results: dict, model: str, seeds=None
) -> tuple[int | None, int | None]:
    """``(solved_up_to, failed_from)`` for ``model``: the largest pair count
    up to which every seed reached :data:`SOLVED` at every count (None if
    not even the smallest), and the smallest count from which every seed
    stayed below it at every count (None if not even the largest). A value
    within :data:`SOLVED_MARGIN` of the threshold counts as neither.
    ``seeds``: only those of ``results["seeds"]`` (default all)."""
    table = accuracies(results)[model]
    if seeds is not None:
        table = table[[results["seeds"].index(s) for s in seeds]]
    solved = (table >= SOLVED + SOLVED_MARGIN).all(axis=0) | (
        table == 1.0
    ).all(axis=0)
    failed = (table < SOLVED - SOLVED_MARGIN).all(axis=0)
    n_pairs = results["n_pairs"]
    up_to = None
    for n, ok in zip(n_pairs, solved):
        if not ok:
            break
        up_to = n
    from_ = None
    for n, bad in zip(reversed(n_pairs), reversed(failed)):
        if not bad:
            break
        from_ = n
    return up_to, from_


def learned_seeds(results: dict, model: str) -> list[int]:
    """The seeds in which ``model`` learned the task: an accuracy of at least
    :data:`LEARNED` at the smallest pair count. Raises
    :class:`attnbook.seeds.TooCloseToCall` if a seed lies within
    :data:`LEARNED_MARGIN` of it."""
    from ..seeds import SeedDistribution

    first = accuracies(results)[model][:, 0]
    SeedDistribution(tuple(results["seeds"]), first).count_at_least(
        LEARNED, margin=LEARNED_MARGIN
    )
    return [s for s, a in zip(results["seeds"], first) if a >= LEARNED]


def beaten_at(results: dict, better: str, worse: str) -> list[int]:
    """The pair counts at which ``better``'s accuracy exceeds ``worse``'s by
    at least :data:`BEATS` in every seed (each seed compared with the same
    seed), with :data:`BEATS_MARGIN` to spare."""
    table = accuracies(results)
    gap = table[better] - table[worse]  # (seeds, pair counts)
    clear = (gap >= BEATS + BEATS_MARGIN).all(axis=0)
    return [n for n, ok in zip(results["n_pairs"], clear) if ok]


def direction_at_largest(
    results: dict, first: str, second: str
) -> tuple[int, int]:
    """``(ahead, behind)``: in how many seeds ``first``'s accuracy at the
    largest pair count exceeds ``second``'s (same seed) by more than
    :data:`BEATS_MARGIN`, and in how many it falls short by more than it;
    a seed whose gap lies within the margin counts as neither."""
    table = accuracies(results)
    gap = table[first][:, -1] - table[second][:, -1]
    return int((gap > BEATS_MARGIN).sum()), int((gap < -BEATS_MARGIN).sum())


def _capacity_text(up_to, from_, seeds: int) -> str:
    solved = f"N <= {up_to}" if up_to is not None else "no N"
    failed = f"N >= {from_}" if from_ is not None else "no N"
    every = "in that seed" if seeds == 1 else f"in all {seeds} seeds"
    return (
        f"accuracy >= {SOLVED + SOLVED_MARGIN:.3f} (0.99 + margin "
        f"{SOLVED_MARGIN}) {every} at {solved}; below "
        f"{SOLVED - SOLVED_MARGIN:.3f} (0.99 - margin) {every} at {failed}"
    )


def verdicts(results: dict) -> list[str]:
    """The lines the chapter prints: where each model's capacity ends, and
    which model beats which, each holding in every seed of ``results``;
    then, for each pair of :data:`DIRECTIONS`, in how many seeds one is
    ahead of the other at the largest pair count. Each line states the
    threshold it tests, margin included."""
    seeds = len(results["seeds"])
    lines = []
    for model in results["models"]:
        up_to, from_ = capacity(results, model)
        lines.append(f"{NAMES[model]}: {_capacity_text(up_to, from_, seeds)}")
    for model in results["models"]:
        learned = learned_seeds(results, model)
        line = (
            f"{NAMES[model]} learned the task (accuracy >= {LEARNED} at N = "
            f"{results['n_pairs'][0]}, no seed within {LEARNED_MARGIN} of "
            f"it) in {len(learned)} of {seeds} seeds"
        )
        if 0 < len(learned) < seeds:
            up_to, from_ = capacity(results, model, learned)
            line += f"; in those: {_capacity_text(up_to, from_, len(learned))}"
        lines.append(line)
    for better, worse in COMPARISONS:
        if better in results["models"] and worse in results["models"]:
            at = beaten_at(results, better, worse)
            where = f"N = {', '.join(map(str, at))}" if at else "no N"
            lines.append(
                f"{NAMES[better]} beats {NAMES[worse]} by at least "
                f"{BEATS + BEATS_MARGIN:.2f} ({BEATS} + margin "
                f"{BEATS_MARGIN}) in all {seeds} seeds at {where}"
            )
    largest = results["n_pairs"][-1]
    for first, second in DIRECTIONS:
        if first in results["models"] and second in results["models"]:
            ahead, behind = direction_at_largest(results, first, second)
            lines.append(
                f"at N = {largest}: {NAMES[first]} ahead of "
                f"{NAMES[second]} by more than {BEATS_MARGIN} in {ahead} of "
                f"{seeds} seeds, behind by more than {BEATS_MARGIN} in "
                f"{behind}"
            )
    return lines


def main(argv=None) -> None:
    import argparse
    import pathlib

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--write", action="store_true", help="write the package data file"
    )
    parser.add_argument("--out", help="write the results here instead")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--seeds", type=int, nargs="*", default=GRID_SEEDS)
    parser.add_argument("--models", nargs="*", default=tuple(MODELS))
    parser.add_argument("--n-pairs", type=int, nargs="*", default=GRID_PAIRS)
    for name in ("steps", "batch", "vocab_size", "d_model", "n_heads"):
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=HYPERPARAMETERS[name],
        )
    parser.add_argument(
        "--curriculum", type=float, default=HYPERPARAMETERS["curriculum"]
    )
    parser.add_argument(
        "--lr",
        nargs="*",
        metavar="MODEL=LR",
        help="each model's learning rate (default: chosen by the sweep)",
    )
    parser.add_argument(
        "--lr-candidates", type=float, nargs="*", default=LR_CANDIDATES
    )
    parser.add_argument("--lr-seed", type=int, default=LR_SEED)
    parser.add_argument(
        "--sweep-only",
        action="store_true",
        help="run only the learning-rate sweep and write it to --out",
    )
    parser.add_argument(
        "--lr-sweep", help="take the learning rates from this recorded sweep"
    )
    args = parser.parse_args(argv)

    def progress(run):
        cells = " ".join(f"{a:.3f}" for a in run["accuracy"].values())
        print(
            f"{run['model']:>12} seed {run['seed']} lr {run['lr']:g}: "
            f"{cells} ({run['cpu_s']:.0f} CPU-s)",
            flush=True,
        )

    lr = None
    if args.lr:
        lr = {m: float(v) for m, v in (a.split("=") for a in args.lr)}
    if args.lr_sweep:
        lr = load_results(args.lr_sweep)
    hp = dict(
        steps=args.steps,
        batch=args.batch,
        vocab_size=args.vocab_size,
        d_model=args.d_model,
        n_heads=args.n_heads,
        curriculum=args.curriculum,
    )
    if args.sweep_only:
        sweep = lr_sweep(
            args.models,
            tuple(args.n_pairs),
            tuple(args.lr_candidates),
            args.lr_seed,
            args.jobs,
            progress,
            **hp,
        )
        print(f"chosen: {sweep['chosen']}; CPU {sweep['cpu_s']:.0f} s")
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(sweep, f, indent=1)
            f.write("\n")
        return
    results = run_mqar_grid(
        args.models,
        tuple(args.seeds),
        tuple(args.n_pairs),
        jobs=args.jobs,
        progress=progress,
        lr=lr,
        **hp,
    )
    print(f"wall {results['wall_s']:.0f} s, CPU {results['cpu_s']:.0f} s")
    out = args.out
    if args.write:
        out = (
            pathlib.Path(__file__).resolve().parents[1] / "data" / RESULTS_FILE
        )
    if out:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
