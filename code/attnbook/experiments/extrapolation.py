"""Train short, test long: tiny causal transformers that differ only in how
they see position.

Chapter 6 trains one :class:`TinyCausalLM` per position scheme
(:data:`SCHEMES`) on sequences of a training length ``L`` and evaluates it on
sequences of ``2L`` and ``4L``. Two synthetic tasks with a known best possible
loss:

* :class:`MarkovText`: each token depends on the two before it, through a fixed
  random table; a stand-in for the local statistics of language.
* :class:`ShiftedCopy`: random tokens; the target at position ``t`` is the
  token at ``t - shift``: an exact lookup at a fixed relative offset.

Chapter 6 (positional encodings) shows :class:`PositionalAttention`, the book's
:class:`attnbook.MultiHeadAttention` with its attention step overridden, and
trains the models here.

Everything is seeded: the same arguments give the same numbers on the same
machine. On another CPU the last bits of some roundings differ, and a small
training run can amplify them into a visibly different final loss; so the
chapter trains every scheme with several seeds and states only what holds in
all of them.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .._validate import positive_int
from ..masks import sliding_window_mask
from ..multihead import MultiHeadAttention
from ..torch_attention import attend, with_causal
from ..positional import alibi_bias, apply_rope, sinusoidal_positions

#: The position schemes: none (NoPE), two added to the token vectors
#: (sinusoidal, learned), two applied inside attention (RoPE on queries and
#: keys, ALiBi on the scores).
SCHEMES = ("none", "sinusoidal", "learned", "rope", "alibi")

#: Target value for positions that carry no prediction (``F.cross_entropy``'s
#: ``ignore_index``).
IGNORE = -100

#: Held-out sequences per evaluation length and seed: 32 sequences of ``4L =
#: 128`` tokens score about 4,000 predictions, enough for the differences
#: chapter 6 states, at half the cost of 64.
EVAL_BATCH = 32


# --- the tasks ---------------------------------------------------------------


@dataclass(frozen=True)
class ShiftedCopy:
    """Uniform random tokens; the target at position ``t >= shift`` is the
    token at ``t - shift``."""

    vocab: int = 16
    shift: int = 3

    def batch(self, batch: int, n: int, generator: torch.Generator):
        """``tokens, targets``, both ``(batch, n)`` int64; the first ``shift``
        targets are :data:`IGNORE`."""
        tokens = torch.randint(self.vocab, (batch, n), generator=generator)
        targets = torch.full_like(tokens, IGNORE)
        targets[:, self.shift :] = tokens[:, : n - self.shift]
        return tokens, targets

    def best_loss(self, tokens, targets) -> float:
        """The loss of the exact rule: zero."""
        return 0.0

    def order_blind_loss(self, n: int) -> float:
        """The expected loss on sequences of ``n`` tokens of the best
        prediction that ignores the order of the tokens.

        At position ``t`` the query sees the tokens ``0..t`` and knows its own.
        The tokens are independent and uniform, so, given only which tokens
        the other ``t`` positions hold, the target (one of them) is equally
        likely to be any of them: the best order-blind prediction gives each
        token value its count among them, divided by ``t``. The target's value
        has ``1 + K`` copies there, ``K ~ Binomial(t - 1, 1 / vocab)``, so the
        expected loss at ``t`` is ``E[log t - log(1 + K)]``; this averages it
        over the scored positions ``shift..n - 1``. No model that sees only
        which tokens are present (NoPE with one layer) has a lower expected
        loss.
        """
        n = positive_int("n", n)
        if n <= self.shift:
            raise ValueError(
                f"order_blind_loss needs n > shift to score a position; got "
                f"n={n}, shift={self.shift}"
            )
        p = 1.0 / self.vocab
        per_position = []
        for t in range(self.shift, n):
            k = np.arange(t)
            pmf = np.array(
                [math.comb(t - 1, int(j)) for j in k], dtype=np.float64
            ) * (p**k * (1.0 - p) ** (t - 1 - k))
            per_position.append(float(np.sum(pmf * (np.log(t) - np.log1p(k)))))
        return float(np.mean(per_position))


@dataclass(frozen=True)
class MarkovText:
    """A second-order Markov chain: ``P(x_t | x_{t-2}, x_{t-1})`` from a fixed
    random table.

    Each row of the ``(vocab, vocab, vocab)`` table is drawn from a Dirichlet
    with parameter ``concentration`` (small: a few likely next tokens per
    context). The task is next-token prediction; the first two tokens of a
    sequence are uniform.
    """

    vocab: int = 16
    concentration: float = 0.1
    seed: int = 0
    table: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)
        table = rng.dirichlet(
            np.full(self.vocab, self.concentration),
            size=(self.vocab, self.vocab),
        )
        object.__setattr__(self, "table", torch.from_numpy(table))

    def batch(self, batch: int, n: int, generator: torch.Generator):
        """``tokens, targets`` ``(batch, n)``: ``targets[:, t] = tokens[:, t +
        1]``, last one :data:`IGNORE`."""
        if n < 3:
            raise ValueError(
                f"MarkovText needs sequences of at least 3 tokens; got n={n}"
            )
        tokens = torch.empty(batch, n, dtype=torch.long)
        tokens[:, :2] = torch.randint(
            self.vocab, (batch, 2), generator=generator
        )
        cdf = self.table.cumsum(-1)
        uniform = torch.rand(batch, n, generator=generator, dtype=cdf.dtype)
        for t in range(2, n):
            # inverse-CDF sampling from row (x_{t-2}, x_{t-1}): far faster than
            # torch.multinomial here (batch, vocab)
            below = (
                cdf[tokens[:, t - 2], tokens[:, t - 1]] < uniform[:, t, None]
            )
            tokens[:, t] = below.sum(-1).clamp(max=self.vocab - 1)
        targets = torch.full_like(tokens, IGNORE)
        targets[:, :-1] = tokens[:, 1:]
        # predicting token 1 from token 0 alone is not the rule
        targets[:, 0] = IGNORE
        return tokens, targets

    def best_loss(self, tokens, targets) -> float:
        """Cross-entropy of the true table on the scored positions: the floor a
        model can reach."""
        t = torch.arange(1, tokens.shape[1] - 1)
        # P(target | two before)
        p = self.table[tokens[:, t - 1], tokens[:, t], tokens[:, t + 1]]
        return float(-p.log().mean())


# --- the model ---------------------------------------------------------------


class PositionalAttention(MultiHeadAttention):
    """Causal multi-head self-attention that sees position through ``scheme``.

    A :class:`attnbook.MultiHeadAttention` whose attention step
    (:meth:`attention`, the hook a variant overrides) adds what the scheme
    needs: ``"rope"`` rotates each head's queries and keys with
    :func:`attnbook.apply_rope`; ``"alibi"`` passes :func:`attnbook.alibi_bias`
    to :func:`attnbook.attend` as an additive bias; the other schemes see
    positions only through their inputs (or not at all). Projections, heads and
    masks are the base class's.
    """

    def __init__(self, d_model: int, n_heads: int, scheme: str):
        super().__init__(d_model, n_heads)
        self.scheme = scheme
        # RoPE's defaults; see set_rope_frequencies
        self.frequencies, self.logit_scale = None, 1.0
        # RoPE only; see clipped_offset_bias
        self.max_offset: int | None = None

    def attention(self, q, k, v, mask=None, is_causal: bool = False):
        """q, k, v: (b, heads, n, d_head) -> (out (b, heads, n, d_head),
        weights (b, heads, n, n))."""
        n_q, n_k = q.shape[2], k.shape[2]
        scale = self.logit_scale / math.sqrt(self.d_head)
        bias = None
        if self.scheme == "rope":
            # before the rotation: it needs the unrotated q, k
            if self.max_offset is not None:
                bias = scale * clipped_offset_bias(
                    q, k, self.max_offset, self.frequencies
                )
            # one call rotates both: (2, b, heads, n, d_head); values are left
            # alone
            q, k = apply_rope(
                torch.stack((q, k)), frequencies=self.frequencies
            )
        if self.scheme == "alibi":
            # (heads, n_q, n_k)
            bias = torch.from_numpy(alibi_bias(self.n_heads, n_q, n_k)).to(
                q.dtype
            )
        mask = with_causal(mask, is_causal, n_q, n_k, q.device)
        return attend(q, k, v, mask, scale, bias, return_weights=True)


def clipped_offset_bias(q, k, max_offset: int, frequencies=None):
    """What to add to RoPE's scores so that every key more than ``max_offset``
    back scores as if it were exactly ``max_offset`` back.

    q: (..., n_q, d_head), k: (..., n_k, d_head), before rotation; the queries
    are the last ``n_q`` of the ``n_k`` positions. Returns (..., n_q, n_k),
    before the ``1/sqrt(d_head)``: 0 for a key at offset ``<= max_offset``, and
    for a farther key the difference between its score at offset ``max_offset``
    and its real score. A RoPE score depends only on the offset, so the first
    is the query rotated by ``max_offset`` against the unrotated key (position
    0). The keys all stay visible: the probe removes the offsets never seen in
    training and keeps the number of keys (a sliding window removes both).
    Chapter 6 uses it on trained models.
    """
    if max_offset < 0:
        raise ValueError(f"max_offset must be >= 0; got {max_offset}")
    n_q, n_k = q.shape[-2], k.shape[-2]
    q_positions = torch.arange(n_k - n_q, n_k)
    # (n_q, n_k)
    offset = q_positions[:, None] - torch.arange(n_k)[None, :]
    q_rot = apply_rope(q, q_positions, frequencies=frequencies)
    k_rot = apply_rope(k, frequencies=frequencies)
    # (..., n_q, n_k)
    real = q_rot @ k_rot.transpose(-2, -1)
    q_at_max = apply_rope(
        q, torch.full((n_q,), max_offset), frequencies=frequencies
    )
    # every key at offset max_offset
    clipped = q_at_max @ k.transpose(-2, -1)
    return torch.where(
        offset > max_offset, clipped - real, torch.zeros_like(real)
    )


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(LN(x))``, then ``x +
    MLP(LN(x))``.

    ``window`` (optional) lets each query see only itself and the ``window -
    1`` keys before it.
    """

    def __init__(self, d_model: int, n_heads: int, scheme: str):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = PositionalAttention(d_model, n_heads, scheme)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.ReLU(),
            nn.Linear(4 * d_model, d_model),
        )

    def forward(self, x, window: int | None = None):
        mask = (
            None
            if window is None
            else torch.from_numpy(sliding_window_mask(x.shape[1], window))
        )
        x = x + self.attn(self.ln1(x), mask=mask, is_causal=True)
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    """A small decoder: token embedding (+ position table), ``n_layers``
    blocks, logits.

    ``scheme`` is one of :data:`SCHEMES`. ``"learned"`` owns a table of
    ``train_length`` position vectors and has none for later positions: a
    longer input raises ``ValueError`` unless ``clip_positions`` is set, which
    gives every position past the table its last row. Setting ``window``
    restricts every attention layer to the last ``window`` keys (an
    evaluation-time probe). tokens ``(batch, n)`` -> logits ``(batch, n,
    vocab)``.
    """

    def __init__(
        self,
        vocab: int,
        scheme: str,
        train_length: int,
        d_model: int = 32,
        n_heads: int = 4,
        n_layers: int = 2,
    ):
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(
                f"scheme must be one of {SCHEMES}; got {scheme!r}"
            )
        self.scheme, self.train_length = (
            scheme,
            positive_int("train_length", train_length),
        )
        self.clip_positions = False
        self.window: int | None = None
        self.embed = nn.Embedding(vocab, d_model)
        if scheme == "learned":
            self.positions = nn.Embedding(train_length, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, scheme) for _ in range(n_layers)
        )
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        # (batch, n, d_model)
        x = self.embed(tokens)
        if self.scheme == "sinusoidal":
            x = x + torch.from_numpy(sinusoidal_positions(n, x.shape[-1])).to(
                x.dtype
            )
        elif self.scheme == "learned":
            if n > self.train_length and not self.clip_positions:
                raise ValueError(
                    f"learned positions exist for 0..{self.train_length - 1} "
                    "only; got a sequence "
                    f"of n={n}. Set clip_positions = True to reuse the last "
                    "row past the table."
                )
            x = x + self.positions(
                torch.arange(n).clamp(max=self.train_length - 1)
            )
        for block in self.blocks:
            x = block(x, self.window)
        return self.head(self.ln(x))


# --- training and evaluation -------------------------------------------------


def train(
    model: TinyCausalLM,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    batch: int = 16,
    lr: float = 1e-2,
) -> np.ndarray:
    """One pass of Adam over ``tokens, targets (n_sequences, length)`` in
    minibatches of ``batch``.

    Returns the training loss of each step (``n_sequences // batch`` steps).
    Every scheme is trained on the same sequences in the same order, so only
    the scheme differs.
    """
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    steps = tokens.shape[0] // batch
    losses = np.empty(steps)
    model.train()
    for step in range(steps):
        rows = slice(step * batch, (step + 1) * batch)
        logits = model(tokens[rows])
        loss = F.cross_entropy(
            logits.flatten(0, 1), targets[rows].flatten(), ignore_index=IGNORE
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses[step] = loss.item()
    return losses


def train_together(
    models,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    batch: int = 16,
    lr: float = 1e-2,
) -> np.ndarray:
    """:func:`train` for several models of one architecture at once: model
    ``i`` on ``tokens[i]``.

    tokens, targets: ``(n_models, n_sequences, length)``. The models'
    parameters are stacked (``torch.func.stack_module_state``) and one ``vmap``
    of the forward pass computes every model's loss in the same batched
    operations. The training loss is their sum, and the models share no
    parameter, so each one's gradient is that of its own loss; Adam updates
    each weight from its own gradient only. So this is ``n_models`` separate
    trainings, each as :func:`train` would run it, computed together (only the
    rounding can differ): on a CPU, where a model this small spends much of a
    step on per-operation overhead, several seeds cost little more than one.
    The trained weights are copied back into ``models``. Returns the
    ``(n_models, steps)`` losses.
    """
    from torch.func import functional_call, stack_module_state, vmap

    models = list(models)
    if tokens.shape[0] != len(models) or targets.shape != tokens.shape:
        raise ValueError(
            f"tokens and targets must both be (n_models={len(models)}, "
            "n_sequences, length); "
            f"got {tuple(tokens.shape)} and {tuple(targets.shape)}"
        )
    if (
        len(
            {
                (
                    type(m),
                    m.scheme,
                    tuple((k, v.shape) for k, v in m.state_dict().items()),
                )
                for m in models
            }
        )
        != 1
    ):
        raise ValueError(
            "train_together needs models of one architecture and scheme"
        )
    # each (n_models, *shape), trainable leaves
    params, buffers = stack_module_state(models)
    # the architecture, without weights
    template = copy.deepcopy(models[0]).to("meta")
    for m in (template, *models):
        m.train()

    def loss_of_one(p, b, x, y):
        logits = functional_call(template, (p, b), (x,))
        return F.cross_entropy(
            logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE
        )

    losses_of_all = vmap(loss_of_one)
    opt = torch.optim.Adam(params.values(), lr=lr, foreach=True)
    steps = tokens.shape[1] // batch
    losses = np.empty((len(models), steps))
    for step in range(steps):
        rows = slice(step * batch, (step + 1) * batch)
        # (n_models,)
        loss = losses_of_all(
            params, buffers, tokens[:, rows], targets[:, rows]
        )
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
        losses[:, step] = loss.detach().numpy()
    with torch.no_grad():
        for i, m in enumerate(models):
            for name, value in m.named_parameters():
                value.copy_(params[name][i])
    return losses


@dataclass
class Evaluation:
    """One model on held-out sequences of one length."""

    length: int
    # mean cross-entropy over the scored positions
    loss: float
    # fraction of scored positions whose argmax is the target
    accuracy: float
    best_loss: float  # the task's floor on the same sequences
    # (length,) mean loss at each position (NaN where unscored)
    position_loss: np.ndarray
    position_accuracy: np.ndarray  # (length,)


@torch.no_grad()
def evaluate(
    model: TinyCausalLM, task, tokens: torch.Tensor, targets: torch.Tensor
) -> Evaluation:
    """Loss and accuracy of ``model`` on held-out ``tokens, targets (batch,
    length)``, overall and per position."""
    model.eval()
    batch, length = tokens.shape
    logits = model(tokens)
    loss = (
        F.cross_entropy(
            logits.flatten(0, 1),
            targets.flatten(),
            ignore_index=IGNORE,
            reduction="none",
        )
        .view(batch, length)
        .double()
    )
    scored = targets != IGNORE
    hit = ((logits.argmax(-1) == targets) & scored).double()
    per_pos = scored.sum(0).double()
    with np.errstate(invalid="ignore"):
        pos_loss = ((loss * scored).sum(0) / per_pos).numpy()
        pos_acc = (hit.sum(0) / per_pos).numpy()
    return Evaluation(
        length,
        float(loss[scored].mean()),
        float(hit.sum() / scored.sum()),
        task.best_loss(tokens, targets),
        pos_loss,
        pos_acc,
    )


@dataclass
class Run:
    """A scheme trained at ``train_length`` and evaluated at each of
    ``eval_lengths``."""

    scheme: str
    model: TinyCausalLM
    losses: np.ndarray  # (steps,) training loss
    evaluations: dict[int, Evaluation]  # keyed by length


def train_and_evaluate(
    task,
    scheme: str,
    train_length: int,
    eval_lengths,
    steps: int = 300,
    batch: int = 16,
    eval_batch: int = EVAL_BATCH,
    seed: int = 0,
    lr: float = 1e-2,
    **model_kwargs,
) -> Run:
    """Build a :class:`TinyCausalLM` (seeded), train it at ``train_length``,
    evaluate at each length.

    The training and evaluation sequences depend only on ``task`` and ``seed``,
    not on the scheme. A learned-position model is evaluated with
    ``clip_positions`` set past its table.
    """
    train_data = task.batch(
        steps * batch, train_length, torch.Generator().manual_seed(seed + 1)
    )
    torch.manual_seed(seed)
    model = TinyCausalLM(task.vocab, scheme, train_length, **model_kwargs)
    losses = train(model, *train_data, batch=batch, lr=lr)
    model.clip_positions = True
    evaluations = {
        n: evaluate(model, task, *held_out(task, n, eval_batch, seed))
        for n in eval_lengths
    }
    model.clip_positions = False
    return Run(scheme, model, losses, evaluations)


def train_and_evaluate_seeds(
    task,
    scheme: str,
    train_length: int,
    eval_lengths,
    seeds,
    steps: int = 300,
    batch: int = 16,
    eval_batch: int = EVAL_BATCH,
    lr: float = 1e-2,
    **model_kwargs,
) -> list[Run]:
    """:func:`train_and_evaluate` for each of ``seeds``, the trainings run
    together (:func:`train_together`).

    Seed ``s`` gets the initial weights and the training and held-out sequences
    that ``train_and_evaluate(..., seed=s)`` would give it. Returns one
    :class:`Run` per seed, in order.
    """
    seeds = list(seeds)
    data = [
        task.batch(
            steps * batch,
            train_length,
            torch.Generator().manual_seed(seed + 1),
        )
        for seed in seeds
    ]
    models = []
    for seed in seeds:
        torch.manual_seed(seed)
        models.append(
            TinyCausalLM(task.vocab, scheme, train_length, **model_kwargs)
        )
    losses = train_together(
        models,
        torch.stack([d[0] for d in data]),
        torch.stack([d[1] for d in data]),
        batch=batch,
        lr=lr,
    )
    runs = []
    for seed, model, seed_losses in zip(seeds, models, losses):
        model.clip_positions = True
        evaluations = {
            n: evaluate(model, task, *held_out(task, n, eval_batch, seed))
            for n in eval_lengths
        }
        model.clip_positions = False
        runs.append(Run(scheme, model, seed_losses, evaluations))
    return runs


def held_out(task, length: int, batch: int = EVAL_BATCH, seed: int = 0):
    """The evaluation sequences of one length: ``tokens, targets (batch,
    length)``, seeded apart from training."""
    return task.batch(
        batch,
        length,
        torch.Generator().manual_seed(10_000 + 97 * seed + length),
    )


def evaluate_at(
    model: TinyCausalLM,
    task,
    length: int,
    seed: int = 0,
    window: int | None = None,
    eval_batch: int = EVAL_BATCH,
    max_offset: int | None = None,
) -> Evaluation:
    """Evaluate a trained model on the held-out sequences of ``length`` for
    ``seed``.

    The sequences are those :func:`train_and_evaluate` used for the same
    ``seed``. Two probes ask which part of the context the model fails on:
    ``window`` restricts every query to itself and the ``window - 1`` keys
    before it; ``max_offset`` (RoPE only) keeps every key visible but scores
    each key farther back than ``max_offset`` as if it were ``max_offset`` back
    (:func:`clipped_offset_bias`). Learned positions are clipped past their
    table. The model's own settings are restored afterwards.
    """
    if max_offset is not None and model.scheme != "rope":
        raise ValueError(
            f"max_offset clips RoPE's offsets; this model is {model.scheme!r}"
        )
    saved = model.window, model.clip_positions
    model.window, model.clip_positions = window, True
    for block in model.blocks:
        block.attn.max_offset = max_offset
    try:
        return evaluate(model, task, *held_out(task, length, eval_batch, seed))
    finally:
        model.window, model.clip_positions = saved
        for block in model.blocks:
            block.attn.max_offset = None


def fine_tune(
    model: TinyCausalLM,
    task,
    length: int,
    steps: int,
    seed: int = 0,
    batch: int = 16,
    lr: float = 1e-3,
) -> TinyCausalLM:
    """A copy of ``model`` trained for ``steps`` more steps of Adam on
    sequences of ``length``.

    The fine-tuning sequences are seeded apart from the training and the
    held-out ones (same ``seed``, other streams). The copy keeps the model's
    RoPE frequencies and logit scale, so a stretched RoPE
    (:func:`set_rope_frequencies`) is fine-tuned as stretched; ``model`` itself
    is not changed. Learned positions are clipped past their table. Chapter 6
    fine-tunes RoPE models at ``4L`` after position interpolation or YaRN, the
    short fine-tuning those methods assume.
    """
    steps = positive_int("steps", steps)
    tuned = copy.deepcopy(model)
    data = task.batch(
        steps * batch,
        positive_int("length", length),
        torch.Generator().manual_seed(20_000 + seed),
    )
    torch.manual_seed(seed)
    tuned.clip_positions = True
    train(tuned, *data, batch=batch, lr=lr)
    tuned.clip_positions = False
    return tuned


def fine_tune_seeds(
    models,
    task,
    length: int,
    steps: int,
    seeds,
    batch: int = 16,
    lr: float = 1e-3,
) -> list[TinyCausalLM]:
    """:func:`fine_tune` for each model and its seed (``models[i]`` with
    ``seeds[i]``), trained together.

    Copies of ``models`` (one architecture, the same RoPE frequencies and logit
    scale), each trained for ``steps`` steps of Adam on the fine-tuning
    sequences :func:`fine_tune` would give its seed, with
    :func:`train_together`. The models themselves are not changed. Chapter 6
    fine-tunes the RoPE models of all its seeds at ``4L`` at once, after
    position interpolation or YaRN.
    """
    steps, length = (
        positive_int("steps", steps),
        positive_int("length", length),
    )
    models, seeds = list(models), list(seeds)
    if len(models) != len(seeds):
        raise ValueError(
            f"one seed per model: got {len(models)} models and {len(seeds)} "
            "seeds"
        )
    tuned = [copy.deepcopy(m) for m in models]
    settings = {
        (
            str(
                None
                if b.attn.frequencies is None
                else np.asarray(b.attn.frequencies).tolist()
            ),
            b.attn.logit_scale,
        )
        for m in tuned
        for b in m.blocks
    }
    if len(settings) > 1:
        raise ValueError(
            "fine_tune_seeds needs the same RoPE frequencies and logit scale "
            "in every model"
        )
    data = [
        task.batch(
            steps * batch, length, torch.Generator().manual_seed(20_000 + seed)
        )
        for seed in seeds
    ]
    for m in tuned:
        m.clip_positions = True
    train_together(
        tuned,
        torch.stack([d[0] for d in data]),
        torch.stack([d[1] for d in data]),
        batch=batch,
        lr=lr,
    )
    for m in tuned:
        m.clip_positions = False
    return tuned


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def set_rope_frequencies(
    model: TinyCausalLM, frequencies=None, logit_scale: float = 1.0
) -> None:
    """Make every attention layer of a RoPE ``model`` rotate with
    ``frequencies`` (``(d_head/2,)``).

    For trying position interpolation, NTK-aware scaling or YaRN on a trained
    model without retraining; ``logit_scale`` multiplies the scores (YaRN's
    temperature). ``frequencies=None, logit_scale=1`` restores the trained
    model.
    """
    if model.scheme != "rope":
        raise ValueError(
            "only a RoPE model has rotation frequencies; this one is "
            f"{model.scheme!r}"
        )
    for block in model.blocks:
        block.attn.frequencies, block.attn.logit_scale = (
            frequencies,
            float(logit_scale),
        )
