"""Held-out loss of the tiny GPT, and a short training loop to "uptrain" a
converted model.

Ainslie et al. (2023) convert a multi-head checkpoint to grouped-query
attention and then continue its pre-training for a small fraction of the
original steps, which they call *uptraining*. :func:`uptrain` does that for
:class:`attnbook.gpt.TinyGPT` on the text it was trained on;
:func:`heldout_loss` measures the result on text it never saw, and
:func:`unigram_loss` gives the baseline of a model that ignores context (the
characters' frequencies in the training text).

The uptraining windows should be as long as the text the model is judged on:
the tiny GPT has learned absolute positions, and a window of 128 characters
never shows the converted attention at positions 128 and later, which then stay
unadapted (:func:`heldout_loss_by_position` measures the loss per range of
positions; chapter 12 shows the difference).

Which text windows a short uptraining sees changes where it ends, and a short
training run may also be chaotic in the last bits of its arithmetic (chapter
3), so :func:`uptrain_over_seeds` repeats the uptraining over several seeds and
returns a distribution per model (:class:`UptrainingRuns`), from which chapter
12 states only verdicts that hold in every seed with a margin. (Measured: this
one is not chaotic; each seed's losses agree to about 1e-7 across CPUs'
kernels. The seeds are there for the windows.)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .. import _validate
from ..gpt import text_windows, training_step, window_loss
from ..seeds import SeedDistribution


def heldout_loss(
    model,
    tokens,
    n_windows: int = 32,
    length: int = 256,
    batch: int = 16,
    seed: int = 0,
) -> float:
    """Mean next-token cross-entropy (nats per token) over ``n_windows`` seeded
    windows of ``tokens``.

    The same seed gives the same windows, so models are compared on identical
    text.
    """
    starts = heldout_starts(tokens, n_windows, length, seed)
    return window_loss(model, tokens, starts, length, batch)


def heldout_window_losses(
    model,
    tokens,
    n_windows: int = 32,
    length: int = 256,
    batch: int = 16,
    seed: int = 0,
) -> np.ndarray:
    """The loss of each of :func:`heldout_loss`'s windows: (n_windows,)
    float64, nats per token.

    Entry ``w`` is the mean cross-entropy of the ``length`` predictions of
    window ``w``; every window has the same length, so the mean of the entries
    is :func:`heldout_loss` (up to rounding). The spread of the entries is what
    the choice of windows adds to a held-out loss, which
    :func:`bootstrap_mean_interval` turns into an interval. The model runs in
    eval mode; its previous mode is restored.
    """
    return _window_losses(
        _token_losses(model, tokens, n_windows, length, batch, seed)
    )


@torch.no_grad()
def _token_losses(
    model, tokens, n_windows: int, length: int, batch: int, seed: int
) -> list:
    """The cross-entropy of every prediction in :func:`heldout_loss`'s windows,
    one forward pass.

    Returns a list of float32 tensors (b, length), one per chunk of ``batch``
    windows, in the order of the windows. The model runs in eval mode; its
    previous mode is restored.
    """
    starts = heldout_starts(tokens, n_windows, length, seed)
    was_training = model.training
    model.eval()
    losses = []
    for chunk in starts.split(_validate.positive_int("batch", batch)):
        # (b, length) each
        x, y = text_windows(tokens, chunk, length)
        # (b, length)
        losses.append(
            F.cross_entropy(model(x).transpose(1, 2), y, reduction="none")
        )
    model.train(was_training)
    return losses


def _window_losses(token_losses: list) -> np.ndarray:
    """(n_windows,) float64: the mean of each window's row of
    :func:`_token_losses`."""
    return torch.cat(
        [per_token.double().mean(dim=1) for per_token in token_losses]
    ).numpy()


def _losses_by_position(
    token_losses: list, ranges: list, length: int
) -> np.ndarray:
    """(len(ranges),): the mean over every window and position of each range,
    from :func:`_token_losses`."""
    # summed over windows
    per_position = torch.zeros(length, dtype=torch.float64)
    for losses in token_losses:
        per_position += losses.sum(dim=0).double()
    per_position /= sum(len(losses) for losses in token_losses)
    return np.array([per_position[a:b].mean().item() for a, b in ranges])


def bootstrap_mean_interval(
    samples, n_resamples: int = 2000, level: float = 0.9, seed: int = 0
) -> tuple[float, float]:
    """A percentile bootstrap interval for the mean of ``samples`` (n,), e.g.
    per-window losses.

    Resamples the ``n`` values with replacement ``n_resamples`` times and
    returns the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the
    resampled means. For a paired comparison of two models on the same windows,
    pass the per-window differences: the windows that are hard for one model
    are hard for the other, and the difference is far less noisy than either
    loss.
    """
    samples = np.asarray(samples, dtype=float)
    if samples.ndim != 1 or samples.size < 2:
        raise ValueError(
            "samples must be one-dimensional with at least 2 values; got "
            f"shape {samples.shape}"
        )
    if not 0 < level < 1:
        raise ValueError(
            f"level must lie strictly between 0 and 1; got {level!r}"
        )
    n_resamples = _validate.positive_int("n_resamples", n_resamples)
    rng = np.random.default_rng(seed)
    means = samples[
        rng.integers(0, samples.size, size=(n_resamples, samples.size))
    ].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def heldout_starts(
    tokens, n_windows: int = 32, length: int = 256, seed: int = 0
):
    """The first positions (n_windows,) of the seeded windows of
    :func:`heldout_loss`."""
    n_windows, length = (
        _validate.positive_int(name, value)
        for name, value in (("n_windows", n_windows), ("length", length))
    )
    if len(tokens) < length + 2:
        raise ValueError(
            f"windows of length {length} + 1 need more than {len(tokens)} "
            "tokens"
        )
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(len(tokens) - length - 1, (n_windows,), generator=gen)


def unigram_log_probs(train_tokens, vocab_size: int, smoothing: float = 1.0):
    """Log-probabilities (vocab_size,) float64 of a unigram model fitted on
    ``train_tokens``: a token's count plus ``smoothing``, normalised.

    With ``smoothing=1`` (add-one, or Laplace, smoothing) a token never seen
    in training still gets a finite loss. The model ignores context: it is the
    baseline that any model that reads the preceding characters has to beat.
    """
    train_tokens = _unigram_tokens("train_tokens", train_tokens, vocab_size)
    if not smoothing > 0:
        raise ValueError(f"smoothing must be positive; got {smoothing!r}")
    counts = (
        torch.bincount(train_tokens, minlength=vocab_size).double() + smoothing
    )
    return (counts / counts.sum()).log()


def unigram_loss(
    train_tokens, eval_tokens, vocab_size: int, smoothing: float = 1.0
) -> float:
    """Cross-entropy (nats per token) on ``eval_tokens`` of the unigram model
    of :func:`unigram_log_probs` fitted on ``train_tokens``."""
    log_probs = unigram_log_probs(train_tokens, vocab_size, smoothing)
    eval_tokens = _unigram_tokens("eval_tokens", eval_tokens, vocab_size)
    return -log_probs[eval_tokens].mean().item()


def unigram_window_losses(
    train_tokens,
    tokens,
    vocab_size: int,
    n_windows: int = 32,
    length: int = 256,
    seed: int = 0,
    smoothing: float = 1.0,
) -> np.ndarray:
    """The unigram model's loss on each of :func:`heldout_window_losses`'
    windows of ``tokens``: (n_windows,) float64, nats per token.

    The same arguments give the same windows, and the same ``length``
    predicted characters per window, as :func:`heldout_window_losses`, so the
    differences of the two are a paired comparison on identical text.
    """
    log_probs = unigram_log_probs(train_tokens, vocab_size, smoothing)
    tokens = _unigram_tokens("tokens", tokens, vocab_size)
    starts = heldout_starts(tokens, n_windows, length, seed)
    # (n_windows, length): the characters the windows predict
    _, targets = text_windows(tokens, starts, length)
    return (-log_probs[targets]).mean(dim=1).numpy()


def _unigram_tokens(name: str, tokens, vocab_size: int):
    """``tokens`` as a 1-D int64 tensor with ids in ``[0, vocab_size)``."""
    vocab_size = _validate.positive_int("vocab_size", vocab_size)
    tokens = torch.as_tensor(tokens)
    if tokens.ndim != 1 or tokens.numel() == 0 or tokens.is_floating_point():
        raise ValueError(
            f"{name} must be a non-empty 1-D tensor of token ids; got shape "
            f"{tuple(tokens.shape)} and dtype {tokens.dtype}"
        )
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"{name} holds ids from {low} to {high}, outside [0, "
            f"vocab_size={vocab_size})"
        )
    return tokens.long()


def heldout_loss_by_position(
    model,
    tokens,
    ranges: Sequence[tuple[int, int]],
    n_windows: int = 32,
    length: int = 256,
    batch: int = 16,
    seed: int = 0,
) -> np.ndarray:
    """The held-out loss of :func:`heldout_loss`'s windows, split by position
    within the window.

    ``ranges``: pairs ``(start, stop)`` with ``0 <= start < stop <= length``.
    Returns ``(len(ranges),)``: entry ``i`` is the mean cross-entropy (nats per
    token) of the predictions made at positions ``start .. stop - 1`` of every
    window (position ``t`` predicts character ``t + 1`` from characters ``0 ..
    t``). The model runs in eval mode; its previous mode is restored.
    """
    ranges = _check_ranges(ranges, length)
    return _losses_by_position(
        _token_losses(model, tokens, n_windows, length, batch, seed),
        ranges,
        length,
    )


def _check_ranges(ranges, length: int) -> list:
    ranges = [(int(a), int(b)) for a, b in ranges]
    bad = [(a, b) for a, b in ranges if not 0 <= a < b <= length]
    if not ranges or bad:
        raise ValueError(
            "ranges must be pairs (start, stop) with 0 <= start < stop <= "
            f"length={length}; "
            f"got {ranges}"
        )
    return ranges


def uptrain(
    model,
    tokens,
    steps: int,
    batch: int = 8,
    length: int = 256,
    lr: float = 1e-3,
    warmup: int = 5,
    seed: int = 0,
) -> list[float]:
    """Continue training ``model`` in place on random windows of ``tokens``;
    return the step losses.

    Train on windows as long as those the model is evaluated on: positions
    beyond ``length`` are never trained. AdamW (betas 0.9, 0.95, no weight
    decay: a few steps should move the weights little anyway), the learning
    rate warmed up linearly over ``warmup`` steps and then constant, gradients
    clipped to norm 1. ``seed`` fixes the windows; the model is left in eval
    mode.
    """
    steps, batch, length = (
        _validate.positive_int(name, value)
        for name, value in (
            ("steps", steps),
            ("batch", batch),
            ("length", length),
        )
    )
    if not lr > 0:
        raise ValueError(f"lr must be positive; got {lr!r}")
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    losses = []
    model.train()
    for step in range(steps):
        starts = torch.randint(
            len(tokens) - length - 1, (batch,), generator=gen
        )
        warm_lr = lr * min(1.0, (step + 1) / max(1, warmup))
        losses.append(
            training_step(model, optimizer, tokens, starts, length, warm_lr)
        )
    model.eval()
    return losses


@dataclass(frozen=True)
class UptrainingRuns:
    """Held-out losses of several models before and after uptraining, over
    several seeds.

    ``before[name]`` is one number: the starting model is fixed, so it does not
    depend on the seed. ``after[name]`` holds one loss per seed,
    ``curves[name]`` the step losses of each seed ``(n_seeds, steps)``.
    ``reference`` names the model whose starting loss is the target (the
    multi-head model), against which :meth:`recovered` measures the gap, and
    which, uptrained with the same steps, is the control of
    :meth:`recovered_vs_control`. ``before_windows[name]`` ``(n_windows,)`` and
    ``after_windows[name]`` ``(n_seeds, n_windows)`` hold the loss of each
    held-out window (:func:`heldout_window_losses`), whose means are ``before``
    and ``after``. Where ``position_ranges`` were asked for,
    ``before_by_position[name]`` holds the starting model's loss on each range
    ``(n_ranges,)`` and ``after_by_position[name]`` each seed's ``(n_seeds,
    n_ranges)`` (:func:`heldout_loss_by_position`).
    """

    seeds: tuple[int, ...]
    before: dict
    after: dict
    curves: dict
    reference: str
    position_ranges: tuple = ()
    before_by_position: dict = field(default_factory=dict)
    after_by_position: dict = field(default_factory=dict)
    before_windows: dict = field(default_factory=dict)
    after_windows: dict = field(default_factory=dict)

    def gain(self, name: str) -> SeedDistribution:
        """Held-out loss before minus after, per seed: positive when uptraining
        helped."""
        return SeedDistribution(
            self.seeds, self.before[name] - self.after[name].values
        )

    def recovered(self, name: str) -> SeedDistribution:
        """Share of the gap to the reference closed, per seed: ``(before -
        after) / (before - ref)``.

        0 means no progress, 1 means the model is back at the reference's
        starting loss."""
        gap = self.before[name] - self.before[self.reference]
        if not gap > 0:
            raise ValueError(
                f"{name} starts at {self.before[name]}, not above the "
                "reference "
                f"{self.reference} ({self.before[self.reference]}): no gap to "
                "recover"
            )
        return SeedDistribution(self.seeds, self.gain(name).values / gap)

    def recovered_vs_control(self, name: str) -> SeedDistribution:
        """Share of the gap closed, measured against the control uptrained with
        the same seed.

        Per seed: ``(before - after) / (before - control_after)``, with
        ``control_after`` the reference model's held-out loss after the same
        uptraining. Where the control's loss moves (up or down) under
        uptraining, this credits the converted model only with what the control
        did not also gain or lose.
        """
        if name == self.reference:
            raise ValueError(
                f"{name} is the control itself; name a converted model"
            )
        gap = self.before[name] - self.after[self.reference].values
        if not np.all(gap > 0):
            raise ValueError(
                f"{name} starts at {self.before[name]}, not above the control "
                f"{self.reference} after uptraining "
                f"({self.after[self.reference].values})"
            )
        return SeedDistribution(self.seeds, self.gain(name).values / gap)

    def behind(self, name: str) -> SeedDistribution:
        """How far above the reference's starting loss the model ends, per
        seed."""
        return SeedDistribution(
            self.seeds, self.after[name].values - self.before[self.reference]
        )

    def after_on_range(self, name: str, i: int) -> SeedDistribution:
        """Held-out loss after uptraining on the ``i``-th of
        ``position_ranges``, per seed."""
        if not self.position_ranges:
            raise ValueError(
                "these runs measured no position ranges (pass position_ranges)"
            )
        return SeedDistribution(self.seeds, self.after_by_position[name][:, i])


def uptrain_over_seeds(
    models: dict,
    train_tokens,
    val_tokens,
    seeds: Iterable[int] = range(5),
    reference: str | None = None,
    eval_kwargs: dict | None = None,
    position_ranges: Sequence[tuple[int, int]] = (),
    **uptrain_kwargs,
) -> UptrainingRuns:
    """Uptrain a fresh copy of every model once per seed; measure held-out
    losses before and after.

    ``models`` maps names to starting models (left unchanged); ``reference``
    (default: the first name) is the model whose starting loss defines the gap.
    Seed ``s`` fixes the training windows (``uptrain(..., seed=s)``) and is the
    same for every model, so the models of one seed see the same text.
    ``eval_kwargs`` go to :func:`heldout_window_losses` (the same windows every
    time; the losses are the means over the windows, as :func:`heldout_loss`
    computes them), ``uptrain_kwargs`` to :func:`uptrain`. With
    ``position_ranges`` the held-out loss is also measured on each range of
    positions (:func:`heldout_loss_by_position`, same windows, computed from
    the same forward pass as the window losses).
    """
    seeds = tuple(int(s) for s in seeds)
    if not models:
        raise ValueError("models must name at least one model")
    if not seeds:
        raise ValueError("seeds must hold at least one seed")
    reference = next(iter(models)) if reference is None else reference
    if reference not in models:
        raise ValueError(
            f"reference {reference!r} is not one of the models {list(models)}"
        )
    eval_kwargs = {} if eval_kwargs is None else dict(eval_kwargs)
    position_ranges = tuple((int(a), int(b)) for a, b in position_ranges)

    windows = dict(
        dict(n_windows=32, length=256, batch=16, seed=0), **eval_kwargs
    )
    if position_ranges:
        _check_ranges(position_ranges, windows["length"])

    def evaluate(m):
        """Window losses and, where asked for, losses by position, from one
        forward pass."""
        token_losses = _token_losses(m, val_tokens, **windows)
        by_position = (
            _losses_by_position(
                token_losses, position_ranges, windows["length"]
            )
            if position_ranges
            else None
        )
        return _window_losses(token_losses), by_position

    before_win, before_pos = {}, {}
    for name, m in models.items():
        before_win[name], before_pos[name] = evaluate(m)
    before = {name: float(w.mean()) for name, w in before_win.items()}
    before_pos = before_pos if position_ranges else {}
    after, after_pos, curves = (
        {name: [] for name in models} for _ in range(3)
    )
    for seed in seeds:
        for name, start in models.items():
            m = copy.deepcopy(start)
            curves[name].append(
                uptrain(m, train_tokens, seed=seed, **uptrain_kwargs)
            )
            window_losses, by_position = evaluate(m)
            after[name].append(window_losses)
            if position_ranges:
                after_pos[name].append(by_position)
    return UptrainingRuns(
        seeds,
        before,
        {
            name: SeedDistribution(seeds, np.array(v).mean(axis=1))
            for name, v in after.items()
        },
        {name: np.array(c) for name, c in curves.items()},
        reference,
        position_ranges,
        before_pos,
        {name: np.array(v) for name, v in after_pos.items() if v},
        before_win,
        {name: np.array(v) for name, v in after.items()},
    )
