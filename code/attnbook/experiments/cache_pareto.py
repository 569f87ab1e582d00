"""Held-out loss against cache bytes per token: the tiny GPT trained from
scratch with multi-head, grouped-query, multi-query and latent attention and
with cross-layer sharing, over seeds.

Every configuration of :data:`CONFIGS` has the same width, depth, number of
query heads, training text, steps, batch and learning-rate schedule
(:data:`HYPER`); they differ only in what a token leaves in the cache. Each is
trained from scratch for every seed of :data:`SEEDS` (the seed draws the
initial weights and the training windows), then scored on the same held-out
windows of the validation text. The runs take far longer than a notebook may,
so ``python -m attnbook.experiments.cache_pareto --write`` trains them and
writes every run, with its provenance, to ``attnbook/data/cache_pareto.json``;
chapter 13 (latent attention and shared caches) loads that file
(:func:`load_results`) and computes its verdicts from it, each with a margin
(:func:`pareto_front`, :func:`front_membership`, :func:`front_by_seed`,
:func:`compare`, :func:`worse_in_every_seed`).
``tests/test_cache_pareto.py`` retrains one run and checks it against the file.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from .. import bench
from ..gpt import (
    CharTokenizer,
    GPTConfig,
    TinyGPT,
    cache_bytes_per_token,
    load_training_text,
    train_val_split,
    training_step,
    window_loss,
)
from ..latent.sharing import cla_sources
from ..seeds import TooCloseToCall
from .provenance import git_commit
from .uptrain import heldout_starts

RESULTS_FILE = "cache_pareto.json"

#: what every configuration shares: 4 layers of 4 query heads of 16 features
BASE = {"n_layers": 4, "n_heads": 4, "d_model": 64}

#: name -> what differs from BASE. Per layer and token, MHA caches 2 x 4 x 16
#: = 128 numbers, GQA 64, MQA 32; the latents match GQA and MQA; CLA2 halves
#: the layers that cache. The tiny GPT has learned absolute positions, so the
#: latent layers get no rotary key (d_rope = 0).
CONFIGS = {
    "MHA": {},
    "GQA": {"n_kv_heads": 2},
    "MQA": {"n_kv_heads": 1},
    "MLA-64": {"attention": "mla", "d_latent": 64},
    "MLA-32": {"attention": "mla", "d_latent": 32},
    "CLA2-MHA": {"kv_sources": tuple(cla_sources(4, 2))},
    "CLA2-GQA": {"n_kv_heads": 2, "kv_sources": tuple(cla_sources(4, 2))},
}

#: the training run of every configuration and seed
HYPER = {
    "steps": 300,
    "batch": 16,
    "length": 64,
    "lr": 3e-3,
    "warmup": 30,
    "min_lr_fraction": 0.1,
    "weight_decay": 0.1,
    "betas": (0.9, 0.95),
    "max_grad_norm": 1.0,
    "val_windows": 256,
    "val_seed": 0,
}

SEEDS = (0, 1, 2, 3, 4)


def corpus():
    """(tokenizer, train tokens, validation tokens) of the tiny GPT's text
    (:func:`attnbook.gpt.train_val_split`)."""
    text = load_training_text()
    tokenizer = CharTokenizer.from_text(text)
    train, val = train_val_split(torch.tensor(tokenizer.encode(text)))
    return tokenizer, train, val


def model_config(name: str, vocab_size: int, hyper=HYPER) -> GPTConfig:
    """The :class:`GPTConfig` of configuration ``name``."""
    if name not in CONFIGS:
        raise ValueError(f"name must be one of {list(CONFIGS)}; got {name!r}")
    return GPTConfig(
        vocab_size=vocab_size,
        context_length=hyper["length"],
        **BASE,
        **CONFIGS[name],
    )


def learning_rate(step: int, hyper=HYPER) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_fraction`` of
    it (the schedule of ``scripts/train_gpt.py``)."""
    lr, warmup, steps = hyper["lr"], hyper["warmup"], hyper["steps"]
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    low = hyper["min_lr_fraction"]
    return lr * (low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_run(name: str, seed: int, data=None, hyper=HYPER) -> dict:
    """Train configuration ``name`` from scratch with ``seed`` and score it.

    The seed draws the initial weights (``torch.manual_seed``) and the
    training windows (a generator of its own); the held-out windows are the
    same for every run (``val_seed``). ``data`` is :func:`corpus`'s result
    (loaded when None). Returns one row of the results file.
    """
    tokenizer, train, val = corpus() if data is None else data
    config = model_config(name, tokenizer.vocab_size, hyper)
    start = time.perf_counter()
    torch.manual_seed(seed)
    model = TinyGPT(config)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": matrices, "weight_decay": hyper["weight_decay"]},
            {"params": others, "weight_decay": 0.0},
        ],
        lr=hyper["lr"],
        betas=tuple(hyper["betas"]),
    )
    windows = torch.Generator().manual_seed(seed)
    length, last = hyper["length"], []
    for step in range(hyper["steps"]):
        starts = torch.randint(
            len(train) - length - 1, (hyper["batch"],), generator=windows
        )
        loss = training_step(
            model,
            optimizer,
            train,
            starts,
            length,
            learning_rate(step, hyper),
            hyper["max_grad_norm"],
        )
        last = (last + [loss])[-20:]
    val_starts = heldout_starts(
        val, hyper["val_windows"], length, hyper["val_seed"]
    )
    return {
        "config": name,
        "seed": seed,
        "heldout_loss": window_loss(model, val, val_starts, length, batch=64),
        "train_loss_last20": float(np.mean(last)),
        "cache_bytes_per_token": cache_bytes_per_token(config),
        "parameters": sum(p.numel() for p in model.parameters()),
        "wall_s": time.perf_counter() - start,
    }


def run_grid(names=None, seeds=SEEDS, hyper=HYPER, log=print) -> list[dict]:
    """:func:`train_run` for every configuration and seed, seed by seed."""
    data = corpus()
    rows = []
    for seed in seeds:
        for name in names or CONFIGS:
            rows.append(train_run(name, seed, data, hyper))
            row = rows[-1]
            log(
                f"{name:9} seed {seed}: held-out {row['heldout_loss']:.4f} "
                f"({row['wall_s']:.0f} s)"
            )
    return rows


def provenance(hyper=HYPER) -> dict:
    """What the runs depend on: machine, versions, commit, settings."""
    return {
        "machine": bench.machine(),
        "torch": torch.__version__,
        "git_commit": git_commit(),
        "command": "python -m attnbook.experiments.cache_pareto --write",
        "base": BASE,
        "configs": {k: dict(v) for k, v in CONFIGS.items()},
        "hyper": dict(hyper),
        "seeds": list(SEEDS),
        "bytes_per_element": 2,
    }


def results_path() -> Path:
    """Where ``--write`` puts the results: the package's data folder."""
    return Path(__file__).resolve().parents[1] / "data" / RESULTS_FILE


def load_results() -> dict:
    """The committed results: ``{"provenance": ..., "runs": [...],
    "total_wall_s": ...}``."""
    text = (
        resources.files("attnbook")
        .joinpath("data")
        .joinpath(RESULTS_FILE)
        .read_text(encoding="utf-8")
    )
    return json.loads(text)


def losses_by_config(runs) -> dict[str, np.ndarray]:
    """Held-out losses (n_seeds,) per configuration, in seed order."""
    out = {}
    for name in dict.fromkeys(run["config"] for run in runs):
        mine = sorted(
            (run["seed"], run["heldout_loss"])
            for run in runs
            if run["config"] == name
        )
        out[name] = np.array([loss for _, loss in mine])
    return out


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """The names whose (bytes, loss) no other point beats: none has at most
    the bytes and a lower loss, or fewer bytes and at most the loss. Sorted
    by bytes."""
    front = [
        name
        for name, (b, loss) in points.items()
        if not any(
            (b2 <= b and l2 < loss) or (b2 < b and l2 <= loss)
            for other, (b2, l2) in points.items()
            if other != name
        )
    ]
    return sorted(front, key=lambda name: points[name])


#: the margin (nats) of the chapter's verdicts: closer than this, rounding
#: on another machine could decide a comparison
MARGIN = 0.002

TOO_CLOSE = "too close to call"


def front_membership(
    points: dict[str, tuple[float, float]], margin: float = MARGIN
) -> dict[str, str]:
    """Whether each point lies on the Pareto front of ``points``, decided
    with a margin: "on" when its loss is below the loss of every other point
    with at most its bytes by more than ``margin``, "off" when one of those
    has a loss below its own by more than ``margin``, else "too close to
    call". "on" and "off" agree with :func:`pareto_front`."""
    status = {}
    for name, (b, loss) in points.items():
        rivals = [
            l2
            for other, (b2, l2) in points.items()
            if other != name and b2 <= b
        ]
        if any(l2 < loss - margin for l2 in rivals):
            status[name] = "off"
        elif all(l2 > loss + margin for l2 in rivals):
            status[name] = "on"
        else:
            status[name] = TOO_CLOSE
    return status


def front_by_seed(runs, margin: float = MARGIN) -> dict[str, list[str]]:
    """For each configuration, its :func:`front_membership` in each seed's
    Pareto front, in seed order."""
    names = dict.fromkeys(run["config"] for run in runs)
    out = {name: [] for name in names}
    for seed in sorted({run["seed"] for run in runs}):
        points = {
            run["config"]: (run["cache_bytes_per_token"], run["heldout_loss"])
            for run in runs
            if run["seed"] == seed
        }
        for name, status in front_membership(points, margin).items():
            out[name].append(status)
    return out


def compare(runs, a: str, b: str, margin: float = MARGIN) -> dict:
    """How ``a``'s held-out loss compares with ``b``'s, seed by seed.

    ``differences`` are a - b in the same seed (a seed pairs the runs only by
    its index: it draws different weights for different shapes, and the same
    training windows); ``spread`` is the larger of the two configurations'
    ranges over seeds. The verdict is "lower" when a is below b in every seed
    and the mean difference exceeds the spread, "higher" likewise, else
    "within the spread"; "too close to call" when rounding could decide it:
    the mean's size within ``margin`` (nats) of the spread, or, with a mean
    beyond the spread, a seed's difference within ``margin`` of zero.
    ``every_seed`` says "mixed" when a lies beyond ``margin`` above b in one
    seed and below it in another; else "too close to call" when a difference
    lies within ``margin`` of zero; else "above in every seed" or "below in
    every seed".
    """
    losses = losses_by_config(runs)
    diff = losses[a] - losses[b]
    spread = float(max(np.ptp(losses[a]), np.ptp(losses[b])))
    mean = float(diff.mean())
    same_sign = bool(np.all(diff > 0) or np.all(diff < 0))
    near_zero = bool(np.any(np.abs(diff) < margin))
    if abs(abs(mean) - spread) < margin or (abs(mean) > spread and near_zero):
        verdict = "too close to call"
    elif same_sign and abs(mean) > spread:
        verdict = "lower" if mean < 0 else "higher"
    else:
        verdict = "within the spread"
    if np.any(diff > margin) and np.any(diff < -margin):
        every_seed = "mixed"
    elif near_zero:
        every_seed = "too close to call"
    elif np.all(diff > 0):
        every_seed = "above in every seed"
    elif np.all(diff < 0):
        every_seed = "below in every seed"
    else:
        every_seed = "mixed"
    return {
        "differences": diff,
        "mean": mean,
        "spread": spread,
        "verdict": verdict,
        "every_seed": every_seed,
    }


def worse_in_every_seed(runs, a: str, b: str, margin: float = MARGIN) -> bool:
    """Whether ``a``'s held-out loss lies above ``b``'s in every seed by more
    than ``margin`` (nats), the runs paired by seed.

    :func:`compare`'s verdict weighs the mean difference against the spread
    over seeds, which counts what the seeds share (the training windows, the
    held-out windows) as noise; this verdict compares each seed's runs with
    each other. False when ``a`` lies below ``b`` by at least ``margin`` in
    one seed, which decides "not in every seed" whatever the other seeds
    say; else raises :class:`attnbook.seeds.TooCloseToCall` when a seed's
    difference lies within ``margin`` of zero; else True. It says what held
    in these seeds, not a test of significance.
    """
    losses = losses_by_config(runs)
    diff = losses[a] - losses[b]
    if np.any(diff <= -margin):
        return False
    seeds = sorted({run["seed"] for run in runs})
    near = [s for s, d in zip(seeds, diff) if abs(d) < margin]
    if near:
        raise TooCloseToCall(
            f"{a} - {b}: seed(s) {near} within {margin} nats of zero"
        )
    return True


def paired_verdicts(runs, margin: float = MARGIN) -> dict:
    """:func:`worse_in_every_seed` for every ordered pair of configurations:
    ``{(a, b): {"verdict": ..., "least": ...}}`` with verdict "worse in every
    seed", "not in every seed" or "too close to call", and ``least`` the
    smallest of the seeds' differences a - b."""
    losses = losses_by_config(runs)
    out = {}
    for a in losses:
        for b in losses:
            if a == b:
                continue
            try:
                worse = worse_in_every_seed(runs, a, b, margin)
                verdict = (
                    "worse in every seed" if worse else "not in every seed"
                )
            except TooCloseToCall:
                verdict = TOO_CLOSE
            least = float((losses[a] - losses[b]).min())
            out[a, b] = {"verdict": verdict, "least": least}
    return out


#: the comparisons chapter 13 prints: at equal cache bytes (MLA and CLA2
#: against GQA and MQA), then what shrinking the cache costs
PAIRS = (
    ("MLA-64", "GQA"),
    ("CLA2-MHA", "GQA"),
    ("MLA-32", "MQA"),
    ("CLA2-GQA", "MQA"),
    ("GQA", "MHA"),
    ("MQA", "MHA"),
)


def chapter_verdicts(runs, margin: float = MARGIN) -> dict:
    """Chapter 13's verdicts, each decided with ``margin``.

    ``front_by_seed``: :func:`front_by_seed`; ``front_every_seed`` and
    ``front_no_seed``: the configurations on the front in every seed, and
    off it in every seed; ``front_undecided``: for each configuration of
    which one of these would be said but for a seed too close to call, those
    seeds; ``front_of_means``: the Pareto front of the mean losses, and
    ``front_of_means_close``: the configurations whose place on or off it is
    too close to call; ``pairs``: :func:`compare` for each of
    :data:`PAIRS`; ``paired``: :func:`paired_verdicts`."""
    by_seed = front_by_seed(runs, margin)
    seeds = sorted({run["seed"] for run in runs})
    losses = losses_by_config(runs)
    size = {run["config"]: run["cache_bytes_per_token"] for run in runs}
    means = {name: (size[name], float(v.mean())) for name, v in losses.items()}
    undecided = {
        name: [seed for seed, s in zip(seeds, status) if s == TOO_CLOSE]
        for name, status in by_seed.items()
        # with a seed on and another off, neither "every" nor "no seed"
        if TOO_CLOSE in status and not {"on", "off"} <= set(status)
    }
    return {
        "front_by_seed": by_seed,
        "front_every_seed": [
            k for k, s in by_seed.items() if all(x == "on" for x in s)
        ],
        "front_no_seed": [
            k for k, s in by_seed.items() if all(x == "off" for x in s)
        ],
        "front_undecided": undecided,
        "front_of_means": pareto_front(means),
        "front_of_means_close": [
            k
            for k, s in front_membership(means, margin).items()
            if s == TOO_CLOSE
        ],
        "pairs": {(a, b): compare(runs, a, b, margin) for a, b in PAIRS},
        "paired": paired_verdicts(runs, margin),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help=f"write data/{RESULTS_FILE}"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # read before training: the commit whose code the runs use
    prov = provenance()
    start = time.perf_counter()
    runs = run_grid(log=lambda line: print(line, flush=True))
    results = {
        "provenance": prov,
        "runs": runs,
        "total_wall_s": time.perf_counter() - start,
    }
    out = args.out or (results_path() if args.write else None)
    if out is not None:
        out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
