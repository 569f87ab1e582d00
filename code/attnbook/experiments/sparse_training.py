"""The tiny GPT trained with five attention layouts, judged on held-out text
and on a long-range retrieval probe that a window cannot solve.

Chapter 14 (sparse attention) loads the results this module's script wrote
(``python -m attnbook.experiments.sparse_training --write``) and prints
verdicts computed from them.

The variants (:data:`VARIANTS`) are one :class:`attnbook.gpt.TinyGPT` whose
blocks' ``attn`` is replaced, layer by layer, by a subclass of
:class:`attnbook.MultiHeadAttention` that overrides only the ``attention``
hook:

- ``full``: the model unchanged (causal attention in every layer);
- ``sliding``: :class:`SlidingWindowAttention`, the last ``window`` keys;
- ``sliding+sink``: :class:`attnbook.sparse.sinks.SinkAttention` with the
  same window and a learned sink logit per head;
- ``alternating``: sliding layers and full layers in turn (gpt-oss's
  pattern), the last layer full;
- ``top-k``: :class:`TopKAttention`, a small lightning indexer
  (:func:`attnbook.sparse.indexer.indexer_scores`) that scores every earlier
  key; each query reads the ``top_k`` keys :func:`causal_topk` selects.

The indexer's scores pass no gradient through the top-k, so it learns by a
loss of its own, DeepSeek's dense warm-up loss kept on for the whole run: the
KL divergence from the main attention's weights over every earlier key (summed
over the heads, normalised, detached) to the softmax of its scores, on
detached inputs (:attr:`TopKAttention.indexer_loss`). The rest of the model
learns from the language-modelling loss only.

The probe (:func:`probe_batch`): a window of held-out text in which one
*needle*, one of ``n_needles`` extra tokens, replaces the character at a
position at least ``min_distance`` before the first of the last
``n_queries`` inputs, each an extra *query* token at which the model must
predict the needle. ``L`` sliding
layers of width ``w`` reach ``L (w - 1)`` positions back (chapter 7's
receptive-field theorem, :func:`attnbook.sparse.layouts.reach`); the default
``min_distance`` is beyond that, so a model of sliding layers cannot see the
needle from the query and can only guess (accuracy ``1 / n_needles`` by
chance). Probe sequences are mixed into every training batch, so a model
whose attention can reach the needle can learn to copy it.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..gpt import (
    CharTokenizer,
    GPTConfig,
    TinyGPT,
    load_training_text,
    text_windows,
    train_val_split,
)
from ..masks import sliding_window_mask
from ..multihead import MultiHeadAttention
from ..sparse.indexer import causal_topk, indexer_scores, selection_mask
from ..sparse.layouts import reach
from ..sparse.sinks import SinkAttention
from ..torch_attention import attend, repeat_kv, with_causal
from . import provenance
from .uptrain import heldout_loss

VARIANTS = ("full", "sliding", "sliding+sink", "alternating", "top-k")
RESULTS_FILE = "sparse_training.json"
# a short run the script records beside the grid, for the test to repeat
CHECK_VARIANT, CHECK_STEPS = "full", 100


class SlidingWindowAttention(MultiHeadAttention):
    """Multi-head attention in which a query reads only the last ``window``
    keys (itself included): chapter 7's ``sliding_window_mask`` on the hook."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        window: int = 16,
        use_sdpa: bool = False,
    ):
        super().__init__(d_model, n_heads, n_kv_heads, use_sdpa=use_sdpa)
        self.window = int(window)

    def attention(self, q, k, v, mask=None, is_causal: bool = False):
        """The window mask (the last ``n_q`` of its ``n_k`` rows) and the
        caller's mask, then the inherited attention step."""
        n_q, n_k = q.shape[2], k.shape[2]
        window = torch.from_numpy(
            sliding_window_mask(n_k, self.window)[n_k - n_q :]
        ).to(q.device)
        mask = window if mask is None else mask & window
        return super().attention(q, k, v, mask, is_causal)


class TopKAttention(MultiHeadAttention):
    """Multi-head attention over the ``top_k`` keys a small lightning indexer
    selects for each query (DeepSeek sparse attention's selection, shared by
    the heads).

    The indexer has ``index_heads`` heads of ``index_dim`` features. Its
    queries and head weights are projected from the layer's queries (all
    heads side by side: this model's "query latent"), its one key per
    position from the layer's keys through a LayerNorm. In training mode a
    call stores the indexer's loss in :attr:`indexer_loss`: the KL divergence
    from the dense attention weights (summed over the heads, normalised,
    detached) to the softmax of the indexer's scores over the earlier keys.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        top_k: int = 16,
        index_heads: int = 2,
        index_dim: int = 16,
        use_sdpa: bool = False,
    ):
        super().__init__(d_model, n_heads, n_kv_heads, use_sdpa=use_sdpa)
        self.top_k = int(top_k)
        self.index_heads, self.index_dim = index_heads, index_dim
        d_kv = self.n_kv_heads * self.d_head
        self.index_q = nn.Linear(d_model, index_heads * index_dim, bias=False)
        self.index_k = nn.Linear(d_kv, index_dim, bias=False)
        self.index_k_norm = nn.LayerNorm(index_dim)
        self.index_weights = nn.Linear(d_model, index_heads, bias=False)
        self.indexer_loss = None

    def index_scores(self, q, k):
        """The indexer's scores (b, n_q, n_k) from the heads q (b, h, n_q,
        d_head) and k (b, n_kv_heads, n_k, d_head), both detached."""
        b, _, n_q, _ = q.shape
        # the heads side by side: (b, n, h * d_head)
        q_cat = q.detach().transpose(1, 2).flatten(2)
        k_cat = k.detach().transpose(1, 2).flatten(2)
        q_i = self.index_q(q_cat).view(
            b, n_q, self.index_heads, self.index_dim
        )
        k_i = self.index_k_norm(self.index_k(k_cat))
        omega = self.index_weights(q_cat) * self.index_heads**-0.5
        return indexer_scores(q_i, k_i, omega, scale=self.index_dim**-0.5)

    def attention(self, q, k, v, mask=None, is_causal: bool = False):
        """Score, select the top ``top_k`` earlier keys, attend over them."""
        n_q, n_k = q.shape[2], k.shape[2]
        scores = self.index_scores(q, k)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        indices, valid = causal_topk(scores, min(self.top_k, n_k))
        # (b, 1, n_q, n_k): the selection, shared by the heads
        selected = selection_mask(indices, valid, n_k)[:, None]
        mask = with_causal(mask, is_causal, n_q, n_k, q.device)
        full_mask = mask
        mask = selected if mask is None else mask & selected
        out, weights = attend(q, k, v, mask, return_weights=True)
        if self.training:
            self.indexer_loss = self._indexer_loss(q, k, scores, full_mask)
        return out, weights

    def _indexer_loss(self, q, k, scores, mask):
        """KL(dense weights || softmax(indexer scores)) over the keys each
        query may read, averaged over the queries."""
        n_q, n_k = q.shape[2], k.shape[2]
        allowed = torch.from_numpy(
            sliding_window_mask(n_k, n_k)[n_k - n_q :]
        ).to(q.device)
        if mask is not None:
            # a key any head may read: (b or 1, n_q, n_k)
            allowed = allowed & (mask if mask.ndim == 2 else mask.any(-3))
        # (b, n_q, n_k)
        allowed = allowed.expand(q.shape[0], n_q, n_k)
        with torch.no_grad():
            _, dense = attend(q, k, k, allowed[:, None], return_weights=True)
            target = dense.sum(dim=1)
            target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
        log_p = scores.masked_fill(~allowed, float("-inf")).log_softmax(-1)
        log_p = log_p.masked_fill(~allowed, 0.0)
        kl = target * (torch.log(target.clamp_min(1e-30)) - log_p)
        return kl.sum(-1).mean()


@dataclass(frozen=True)
class TrainConfig:
    """The hyper-parameters of one run (every variant and seed shares them)."""

    context: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_model: int = 64
    window: int = 8
    top_k: int = 8
    n_needles: int = 8
    min_distance: int = 32
    n_queries: int = 8
    steps: int = 800
    batch: int = 16
    probe_share: float = 0.5
    lr: float = 1e-2
    warmup: int = 50
    indexer_weight: float = 1.0
    eval_windows: int = 64
    eval_probes: int = 512


def check_reach(config: TrainConfig) -> int:
    """How far back the sliding layers reach; raise unless the probe's
    needle lies beyond it."""
    stack = reach(["sliding"] * config.n_layers, config.window)
    if config.min_distance <= stack:
        raise ValueError(
            f"min_distance={config.min_distance} must exceed the reach "
            f"{config.n_layers} x ({config.window} - 1) = {stack}"
        )
    return stack


def build_model(
    variant: str, config: TrainConfig, vocab_size: int, seed: int
) -> TinyGPT:
    """A TinyGPT whose attention layers are those of ``variant``, initialised
    from ``seed``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
    torch.manual_seed(seed)
    gpt_config = GPTConfig(
        vocab_size=vocab_size,
        context_length=config.context,
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        d_model=config.d_model,
    )
    model = TinyGPT(gpt_config)
    d, h, n_layers = config.d_model, config.n_heads, config.n_layers
    for i, block in enumerate(model.blocks):
        if variant == "sliding" or (
            variant == "alternating" and i % 2 != (n_layers - 1) % 2
        ):
            layer = SlidingWindowAttention(
                d, h, window=config.window, use_sdpa=True
            )
        elif variant == "sliding+sink":
            layer = SinkAttention(d, h, window=config.window)
        elif variant == "top-k":
            layer = TopKAttention(d, h, top_k=config.top_k)
        else:
            continue
        # the new layer gets the replaced one's initial projections
        layer.load_state_dict(block.attn.state_dict(), strict=False)
        block.attn = layer
    return model


@dataclass
class Data:
    """Training and held-out tokens, and the ids of the probe's tokens."""

    train: torch.Tensor
    val: torch.Tensor
    text_vocab: int
    needles: torch.Tensor  # (n_needles,) int64
    query: int

    @property
    def vocab_size(self) -> int:
        return self.query + 1


@functools.lru_cache(maxsize=4)
def load_data(config: TrainConfig) -> Data:
    """The tiny GPT's text, split as its training split it, with
    ``n_needles`` needle ids and one query id after the characters'."""
    text = load_training_text()
    tokenizer = CharTokenizer.from_text(text)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    train, val = train_val_split(tokens)
    v = tokenizer.vocab_size
    needles = torch.arange(v, v + config.n_needles)
    return Data(train, val, v, needles, v + config.n_needles)


def probe_batch(tokens, data: Data, config: TrainConfig, n: int, generator):
    """``n`` probe sequences from ``tokens``: inputs and targets (n,
    context), and the needles (n,).

    Each is a window of text whose character at a position drawn in ``[0,
    context - n_queries - min_distance]`` is replaced by a needle drawn from
    ``data.needles``, and whose last ``n_queries`` inputs are the query token;
    the target of every query is the needle, which lies at least
    ``min_distance`` positions before the first query. The other targets are
    the text's next characters, except the one before the needle and the one
    before the first query (which the inserted tokens made unpredictable:
    ignored, -100).
    """
    c, n_q = config.context, config.n_queries
    starts = torch.randint(len(tokens) - c - 1, (n,), generator=generator)
    x, y = text_windows(tokens, starts, c)
    x, y = x.clone(), y.clone()
    last = c - n_q - config.min_distance
    where = torch.randint(last + 1, (n,), generator=generator)
    needle = data.needles[
        torch.randint(config.n_needles, (n,), generator=generator)
    ]
    rows = torch.arange(n)
    x[rows, where] = needle
    before = where > 0
    y[rows[before], where[before] - 1] = -100
    x[:, c - n_q :] = data.query
    y[:, c - n_q :] = needle[:, None]
    y[:, c - n_q - 1] = -100
    return x, y, needle


def indexer_loss(model) -> torch.Tensor | float:
    """The sum of the :class:`TopKAttention` layers' indexer losses of the
    last forward pass (0 without such layers)."""
    losses = [
        m.indexer_loss for m in model.modules() if isinstance(m, TopKAttention)
    ]
    return sum(losses) if losses else 0.0


@torch.no_grad()
def probe_accuracy(model, data: Data, config: TrainConfig, seed: int = 0):
    """The share of the queries of ``config.eval_probes`` held-out probe
    sequences after which the needle is the model's most likely next
    token."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    x, _, needle = probe_batch(data.val, data, config, config.eval_probes, gen)
    hits = 0
    for chunk in range(0, len(x), 64):
        # (b, n_queries)
        logits = model(x[chunk : chunk + 64])[:, -config.n_queries :]
        guess = logits.argmax(-1)
        hits += int((guess == needle[chunk : chunk + 64, None]).sum())
    model.train(was_training)
    return hits / (len(x) * config.n_queries)


def train_run(variant: str, seed: int, config: TrainConfig = TrainConfig()):
    """Train ``variant`` from ``seed``; returns a dict of its results.

    Every random choice comes from ``seed``: the initialisation, the text
    windows and the probes of every batch. The held-out text loss and the
    probe accuracy are measured on held-out text with seed 0 (the same
    windows and probes for every run).
    """
    check_reach(config)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    data = load_data(config)
    model = build_model(variant, config, data.vocab_size, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(10_000 + seed)
    n_probe = round(config.batch * config.probe_share)
    n_text = config.batch - n_probe
    start, cpu_start = time.perf_counter(), time.process_time()
    model.train()
    for step in range(config.steps):
        lr = config.lr * min(1.0, (step + 1) / config.warmup)
        lr *= 0.5 * (1 + math.cos(math.pi * step / config.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(
            len(data.train) - config.context - 1, (n_text,), generator=gen
        )
        xt, yt = text_windows(data.train, starts, config.context)
        xp, yp, _ = probe_batch(data.train, data, config, n_probe, gen)
        x, y = torch.cat([xt, xp]), torch.cat([yt, yp])
        # the queries' targets form a term of their own, as heavy as the
        # text's: otherwise they would be 1 target in context / n_queries
        is_query = x == data.query
        logits = model(x)
        loss = F.cross_entropy(
            logits[~is_query], y[~is_query], ignore_index=-100
        )
        probe_loss = F.cross_entropy(logits[is_query], y[is_query])
        total = loss + probe_loss
        total = total + config.indexer_weight * indexer_loss(model)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    train_s = time.perf_counter() - start
    text = heldout_loss(
        model, data.val, config.eval_windows, config.context, seed=0
    )
    return {
        "variant": variant,
        "seed": seed,
        "heldout_loss": text,
        "probe_accuracy": probe_accuracy(model, data, config, seed=0),
        "final_train_loss": loss.item(),
        "train_seconds": train_s,
        "wall_seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
    }


def run_grid(
    variants=VARIANTS,
    seeds=range(5),
    config: TrainConfig = TrainConfig(),
    check: bool = True,
):
    """Every variant for every seed (and, with ``check``, the short check
    run); returns the results document."""
    from ..bench import machine

    start = time.perf_counter()
    runs = []
    for seed in seeds:
        for variant in variants:
            run = train_run(variant, seed, config)
            runs.append(run)
            print(
                f"{variant:13} seed {seed}: held-out "
                f"{run['heldout_loss']:.4f}, probe "
                f"{run['probe_accuracy']:.3f}, {run['wall_seconds']:.0f} s",
                flush=True,
            )
    results = {
        "script": "python -m attnbook.experiments.sparse_training --write",
        "machine": machine(),
        "torch": torch.__version__,
        "git_commit": provenance.git_commit(),
        "config": asdict(config),
        "reach": check_reach(config),
        "variants": list(variants),
        "seeds": [int(s) for s in seeds],
        "runs": runs,
    }
    if check:
        check_config = replace(config, steps=CHECK_STEPS)
        results["check_run"] = train_run(CHECK_VARIANT, 0, check_config)
        results["check_run"]["config"] = asdict(check_config)
    results["total_wall_seconds"] = time.perf_counter() - start
    results["processes"] = 1
    return results


def merge(parts: list[dict]) -> dict:
    """One results document from the documents of processes that ran parts
    of the grid side by side (the same code, machine and configuration).

    ``total_wall_seconds`` becomes the sum of the parts' (the time one
    process would have taken), ``processes`` their number."""
    first = parts[0]
    for part in parts[1:]:
        for key in ("machine", "torch", "git_commit", "config", "variants"):
            if part[key] != first[key]:
                raise ValueError(f"the parts differ in {key}")
    merged = dict(first)
    merged["runs"] = [r for part in parts for r in part["runs"]]
    merged["seeds"] = sorted(s for part in parts for s in part["seeds"])
    merged["total_wall_seconds"] = sum(p["total_wall_seconds"] for p in parts)
    merged["processes"] = len(parts)
    checks = [p["check_run"] for p in parts if "check_run" in p]
    if len(checks) != 1:
        raise ValueError("exactly one part must hold the check run")
    merged["check_run"] = checks[0]
    return merged


def load_results() -> dict:
    """The results document shipped in the package data."""
    return json.loads(
        resources.files("attnbook")
        .joinpath("data")
        .joinpath(RESULTS_FILE)
        .read_text(encoding="utf-8")
    )


def per_variant(results: dict, key: str) -> dict:
    """``{variant: SeedDistribution}`` of one measure (``"heldout_loss"``
    or ``"probe_accuracy"``)."""
    from ..seeds import SeedDistribution

    out = {}
    for variant in results["variants"]:
        runs = sorted(
            (r for r in results["runs"] if r["variant"] == variant),
            key=lambda r: r["seed"],
        )
        out[variant] = SeedDistribution(
            tuple(r["seed"] for r in runs),
            np.array([r[key] for r in runs], dtype=np.float64),
        )
    return out


FAILS_BELOW = 0.3  # accuracy below this fails the probe (chance: 1/8)
SOLVES_AT = 0.9  # accuracy at least this solves it
MARGIN = 0.05  # a seed within this of a threshold makes no verdict
# the verdicts chapter 14's prose states (tests/test_sparse_training.py)
CHAPTER_VERDICTS = (
    "full probe",
    "sliding probe",
    "sliding+sink probe",
    "alternating probe",
    "top-k probe",
)


def verdicts(results: dict) -> dict:
    """The chapter's verdicts, computed from the results document.

    Returns ``{name: (holds, sentence, ...)}``. ``"<variant> probe"``: holds
    when the variant fails the probe in every seed (accuracy below
    :data:`FAILS_BELOW`) or solves it in every seed (at least
    :data:`SOLVES_AT`), with :data:`MARGIN` (a seed within it of a threshold
    raises :class:`attnbook.seeds.TooCloseToCall`); then whether it fails,
    whether it solves. ``"<variant> loss"``: holds when the variant's held-out
    loss differs from the full model's in the same direction in every seed,
    each seed's difference larger than the full model's spread over seeds
    (max minus min); then whether the direction is the same in every seed,
    and which ("higher" or "lower").
    """
    from ..seeds import paired_difference

    probe = per_variant(results, "probe_accuracy")
    loss = per_variant(results, "heldout_loss")
    chance = 1 / results["config"]["n_needles"]
    out = {}
    for variant, acc in probe.items():
        fails = acc.count_at_least(FAILS_BELOW, MARGIN) == 0
        solves = acc.all_at_least(SOLVES_AT, MARGIN)
        if fails:
            text = (
                f"{variant} fails the probe {acc.in_seeds_below(FAILS_BELOW)}"
                f" (accuracy < {FAILS_BELOW}; chance {chance:.3f})"
            )
        elif solves:
            text = (
                f"{variant} solves the probe "
                f"{acc.in_seeds_at_least(SOLVES_AT)} "
                f"(accuracy >= {SOLVES_AT})"
            )
        else:
            text = (
                f"{variant}: no verdict on the probe (solves it "
                f"{acc.in_seeds_at_least(SOLVES_AT)}, fails it "
                f"{acc.in_seeds_below(FAILS_BELOW)})"
            )
        out[f"{variant} probe"] = (fails or solves, text, fails, solves)
    spread = loss["full"].max - loss["full"].min
    for variant in results["variants"]:
        if variant == "full":
            continue
        diff = paired_difference(loss[variant], loss["full"])
        low, high = np.sort(np.abs(diff.values))[[0, -1]]
        same_sign = diff.min > 0 or diff.max < 0
        word = "higher" if diff.min > 0 else "lower"
        beyond = same_sign and low > spread
        if beyond:
            text = (
                f"{variant}: held-out loss {word} than full attention's in "
                f"every seed, by {low:.3f} to {high:.3f} nats, more than "
                f"full attention's spread over seeds ({spread:.3f})"
            )
        elif same_sign:
            text = (
                f"{variant}: held-out loss {word} than full attention's in "
                f"every seed, by {low:.3f} to {high:.3f} nats, but not in "
                "every seed by more than full attention's spread over "
                f"seeds ({spread:.3f}): no verdict"
            )
        else:
            text = (
                f"{variant}: held-out loss neither higher nor lower than "
                f"full attention's in every seed (differences "
                f"{diff.min:+.3f} to {diff.max:+.3f} nats): no verdict"
            )
        out[f"{variant} loss"] = (beyond, text, same_sign, word)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--write",
        action="store_true",
        help=f"write the results to attnbook/data/{RESULTS_FILE}",
    )
    parser.add_argument("--seeds", type=int, nargs="*", default=range(5))
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--out", default=None, help="write here instead")
    parser.add_argument(
        "--merge", nargs="*", default=None, help="merge these parts"
    )
    args = parser.parse_args(argv)
    if args.merge:
        parts = [json.loads(Path(p).read_text()) for p in args.merge]
        results = merge(parts)
    else:
        results = run_grid(
            args.variants, args.seeds, TrainConfig(), not args.no_check
        )
    text = json.dumps(results, indent=1) + "\n"
    if args.write or args.out:
        path = args.out or (
            Path(__file__).parent.parent / "data" / RESULTS_FILE
        )
        Path(path).write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
