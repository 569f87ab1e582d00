"""Why attention divides by ``sqrt(d_k)``: the statistics of ``q . k`` and softmax saturation.

Chapter 3 uses these functions to check the variance theorem by Monte Carlo,
to measure how sharp (low entropy) and how flat (small Jacobian) the softmax of
random scores becomes as ``d_k`` grows, to train a one-layer attention
model with and without the scale, and to show that the unscaled training runs are
chaotic: moving every initial weight by one float32 ulp (:func:`nudge_parameters`)
changes where they end, while the scaled runs end where they did.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from . import _validate
from .attention import attention_scores
from .softmax import softmax, softmax_jacobian

DISTRIBUTIONS = ("normal", "uniform", "sign")


# --- the statistics of q . k -------------------------------------------------

def sample_components(rng: np.random.Generator, shape, dist: str = "normal",
                      sigma: float = 1.0) -> np.ndarray:
    """Independent entries with mean 0 and standard deviation ``sigma``, of the given shape.

    dist: ``"normal"``; ``"uniform"`` on ``[-sqrt(3) sigma, sqrt(3) sigma]``; or ``"sign"``
    (``+sigma`` or ``-sigma`` with equal chance). All three have the same first two moments,
    which is all the variance theorem uses.
    """
    if dist == "normal":
        return rng.normal(scale=sigma, size=shape)
    if dist == "uniform":
        half_width = np.sqrt(3.0) * sigma  # the uniform on [-a, a] has variance a^2 / 3
        return rng.uniform(-half_width, half_width, size=shape)
    if dist == "sign":
        return sigma * rng.choice(np.array([-1.0, 1.0]), size=shape)
    raise ValueError(f"dist must be one of {DISTRIBUTIONS}; got {dist!r}")


def equicorrelated_cov(d: int, rho: float, sigma: float = 1.0) -> np.ndarray:
    """``(d, d)`` covariance with variance ``sigma^2`` and correlation ``rho`` between any two features.

    ``sigma^2 ((1 - rho) I + rho 1 1^T)`` is positive semidefinite only for
    ``-1/(d - 1) <= rho <= 1``; other values raise ``ValueError``.
    """
    d = _validate.positive_int("d", d)
    low = -1.0 / (d - 1) if d > 1 else -np.inf
    if not low <= rho <= 1.0:
        raise ValueError(f"rho must lie in [{low:.4g}, 1] for a valid {d} x {d} covariance; got {rho}")
    return sigma**2 * ((1.0 - rho) * np.eye(d) + rho * np.ones((d, d)))


def _gaussian_sampler(cov: np.ndarray):
    """A function ``(rng, n) -> (n, d)`` drawing from ``N(0, cov)``.

    Uses the symmetric square root from ``eigh``, which (unlike Cholesky) also
    accepts a singular covariance such as ``rho = 1``.
    """
    eigenvalues, vectors = np.linalg.eigh(cov)
    root = vectors * np.sqrt(np.clip(eigenvalues, 0.0, None))  # root @ root.T == cov
    return lambda rng, n: rng.standard_normal((n, cov.shape[0])) @ root.T


def _factor_sampler(d_k: int, dist: str, sigma: float, rho: float):
    """A function ``(rng, n) -> (n, d_k)``: components of variance ``sigma^2``, correlation ``rho``.

    The correlation comes from one shared factor added to every component,
    ``x_i = sigma (sqrt(1 - rho) z_i + sqrt(rho) z_0)``, which needs no matrix product.
    """
    def draw(rng, n):
        x = sample_components(rng, (n, d_k), dist)
        if rho:
            x = np.sqrt(1.0 - rho) * x + np.sqrt(rho) * sample_components(rng, (n, 1), dist)
        return sigma * x
    return draw


def sample_dot_products(d_k: int, n_samples: int, rng: np.random.Generator, dist: str = "normal",
                        sigma_q: float = 1.0, sigma_k: float = 1.0, rho: float = 0.0,
                        cov: np.ndarray | None = None, chunk: int = 2**20) -> np.ndarray:
    """``n_samples`` draws of ``q . k`` for independent random ``q, k`` of dimension ``d_k``.

    By default the ``2 d_k`` components are independent with mean 0 and standard deviations
    ``sigma_q`` and ``sigma_k`` (distribution ``dist``). ``rho`` in ``[0, 1]`` correlates the
    components within ``q`` (and within ``k``) with correlation ``rho`` between any two, through a
    shared factor. With ``cov (d_k, d_k)`` instead, ``q`` and ``k`` are both Gaussian ``N(0, cov)``.
    ``q`` and ``k`` are always independent of each other. Returns ``(n_samples,)``; works in
    chunks of about ``chunk`` numbers so that memory stays bounded.
    """
    d_k = _validate.positive_int("d_k", d_k)
    n_samples = _validate.positive_int("n_samples", n_samples)
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must lie in [0, 1] (a shared factor cannot anti-correlate); got {rho}")
    if cov is not None:
        if rho:
            raise ValueError("give either rho or cov, not both")
        cov = np.asarray(cov, dtype=np.float64)
        if cov.shape != (d_k, d_k):
            raise ValueError(f"cov must have shape (d_k, d_k) = {(d_k, d_k)}; got {cov.shape}")
        draw_q = draw_k = _gaussian_sampler(cov)
    else:
        draw_q = _factor_sampler(d_k, dist, sigma_q, rho)
        draw_k = _factor_sampler(d_k, dist, sigma_k, rho)
    rows = max(1, chunk // d_k)
    out = np.empty(n_samples)
    for start in range(0, n_samples, rows):
        n = min(rows, n_samples - start)
        q, k = draw_q(rng, n), draw_k(rng, n)
        out[start:start + n] = np.einsum("nd,nd->n", q, k)
    return out


def dot_product_variance(cov_q, cov_k) -> float:
    """The variance of ``q . k`` for independent zero-mean ``q, k``: ``trace(cov_q @ cov_k)``.

    cov_q, cov_k: ``(d_k, d_k)`` covariance matrices. For independent unit-variance
    components (both identities) this is ``d_k``; for ``sigma^2 I`` it is ``sigma_q^2 sigma_k^2 d_k``.
    """
    cov_q, cov_k = np.asarray(cov_q, dtype=np.float64), np.asarray(cov_k, dtype=np.float64)
    if cov_q.ndim != 2 or cov_q.shape[0] != cov_q.shape[1] or cov_q.shape != cov_k.shape:
        raise ValueError(
            f"cov_q and cov_k must be square matrices of one shape (d_k, d_k); got {cov_q.shape} and {cov_k.shape}"
        )
    # trace(A B) = sum_ij A_ij B_ji, without forming the product
    return float(np.sum(cov_q * cov_k.T))


# --- softmax saturation -------------------------------------------------------

def _check_probabilities(p: np.ndarray, axis: int) -> None:
    if p.ndim == 0:
        raise ValueError("p must have at least one dimension (..., n); got a scalar")
    if np.any(p < 0) or not np.all(np.isfinite(p)):
        raise ValueError("p must hold probabilities: finite and >= 0")
    total = p.sum(axis=axis)
    tol = 1e-3 if p.dtype == np.float16 else 1e-5
    ok = np.isclose(total, 1.0, atol=tol) | (total == 0)  # an all-zero row is a fully masked query
    if not np.all(ok):
        bad = total[~ok].ravel()[0]
        raise ValueError(f"each slice of p along axis {axis} must sum to 1 (or be all 0); one sums to {bad:.6g}")


def softmax_entropy(p, axis: int = -1) -> np.ndarray:
    """Shannon entropy ``-sum_i p_i log p_i`` (in nats) of probability vectors along ``axis``.

    p: (..., n) -> (...). ``0 log 0 = 0``, so a one-hot row has entropy 0; the uniform row
    has the maximum, ``log n``. An all-zero row (a fully masked query) gets 0.
    """
    p = np.asarray(p)
    if not np.issubdtype(p.dtype, np.floating):
        p = p.astype(np.float64)
    _check_probabilities(p, axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(p), 0.0)
    return -np.sum(terms, axis=axis)


def softmax_jacobian_norm(p, ord: str | int = "fro") -> np.ndarray:
    """Norm of the softmax Jacobian ``diag(p) - p p^T`` at each probability row of ``p``.

    p: (..., n) -> (...). ``ord="fro"`` is the Frobenius norm; ``ord=2`` the spectral norm (the
    largest factor by which a change of the scores can be amplified). Both are 0 at a one-hot
    ``p``: a saturated softmax passes no gradient back to its scores.
    """
    p = np.asarray(p, dtype=np.float64)
    _check_probabilities(p, -1)
    jac = softmax_jacobian(p)  # (..., n, n)
    if ord == "fro":
        return np.sqrt(np.sum(jac**2, axis=(-2, -1)))
    if ord == 2:
        # the Jacobian is symmetric positive semidefinite: its spectral norm is its largest eigenvalue
        return np.linalg.eigvalsh(jac)[..., -1].clip(min=0.0)
    raise ValueError(f"ord must be 'fro' or 2; got {ord!r}")


def random_attention_weights(d_k: int, n_keys: int, n_queries: int, rng: np.random.Generator,
                             scale: float | None = None, sigma: float = 1.0) -> np.ndarray:
    """Softmax weights of random queries over random keys: ``(n_queries, n_keys)``.

    Components of ``q`` and ``k`` are independent ``N(0, sigma^2)``. ``scale`` multiplies
    the scores ``q k^T`` (``None`` means ``1/sqrt(d_k)``; pass ``1.0`` for no scaling).
    """
    d_k = _validate.positive_int("d_k", d_k)
    n_keys = _validate.positive_int("n_keys", n_keys)
    n_queries = _validate.positive_int("n_queries", n_queries)
    q = rng.normal(scale=sigma, size=(n_queries, d_k))
    k = rng.normal(scale=sigma, size=(n_keys, d_k))
    return softmax(attention_scores(q, k, scale), axis=-1)


def saturation_stats(weights) -> dict[str, float]:
    """How saturated softmax rows are, averaged over rows of ``weights (..., n)``.

    Returns mean ``entropy`` (nats; uniform = ``log n``), mean ``max_weight``, and the mean
    Frobenius and spectral norms of the softmax Jacobian (``jacobian_fro``, ``jacobian_2``).
    """
    weights = np.asarray(weights, dtype=np.float64)
    return {
        "entropy": float(np.mean(softmax_entropy(weights))),
        "max_weight": float(np.mean(weights.max(axis=-1))),
        "jacobian_fro": float(np.mean(softmax_jacobian_norm(weights, "fro"))),
        "jacobian_2": float(np.mean(softmax_jacobian_norm(weights, 2))),
    }


# --- a tiny training experiment: associative recall ----------------------------

def recall_batch(batch: int, n_pairs: int, n_symbols: int, n_values: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A batch of "find the matching key" problems.

    Each problem shows ``n_pairs`` distinct key symbols (from ``n_symbols``), each paired
    with a random value (from ``n_values``), and a query that equals one of the keys. The
    answer is the value paired with that key.
    Returns ``query (batch,)``, ``keys (batch, n_pairs)``, ``values (batch, n_pairs)``,
    ``target (batch,)``, all int64.
    """
    if n_pairs > n_symbols:
        raise ValueError(f"n_pairs ({n_pairs}) distinct keys need at least as many symbols; got n_symbols={n_symbols}")
    keys = torch.argsort(torch.rand(batch, n_symbols, generator=generator), dim=-1)[:, :n_pairs]
    values = torch.randint(n_values, (batch, n_pairs), generator=generator)
    which = torch.randint(n_pairs, (batch,), generator=generator)
    rows = torch.arange(batch)
    return keys[rows, which], keys, values, values[rows, which]


class RecallAttention(nn.Module):
    """One attention layer that answers :func:`recall_batch` problems.

    The query symbol is embedded and projected to ``q (batch, 1, d_k)``, the key symbols
    (same embedding) to ``k (batch, n_pairs, d_k)``, the value symbols to
    ``v (batch, n_pairs, d_model)``; the attention output is read out as logits over values.
    ``scaled`` chooses ``q k^T / sqrt(d_k)`` or the raw ``q k^T``. Every layer keeps
    PyTorch's default initialisation (``nn.Embedding``: N(0, 1); ``nn.Linear``: uniform with
    variance ``1 / (3 fan_in)``), unless ``init_std`` sets the std of ``W_q`` and ``W_k``.
    """

    def __init__(self, n_symbols: int, n_values: int, d_model: int, d_k: int,
                 scaled: bool = True, init_std: float | None = None):
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

    def score_table(self) -> torch.Tensor:
        """The score of every query symbol against every key symbol, ``(n_symbols, n_symbols)``."""
        symbols = self.key_embedding.weight                      # (n_symbols, d_model)
        q, k = self.q_proj(symbols), self.k_proj(symbols)        # (n_symbols, d_k) each
        s = q @ k.T
        return s / self.d_k**0.5 if self.scaled else s

    def scores(self, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Attention logits ``(batch, 1, n_pairs)``, scaled or not.

        A score depends only on the two symbols, and there are only ``n_symbols`` of them: so
        look each example's scores up in :meth:`score_table` instead of projecting every token
        (the same numbers, many times faster at large ``d_k``).
        """
        return self.score_table()[query[:, None], keys][:, None, :]

    def forward(self, query, keys, values) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits over values ``(batch, n_values)`` and attention weights ``(batch, n_pairs)``."""
        weights = torch.softmax(self.scores(query, keys), dim=-1)      # (batch, 1, n_pairs)
        v = self.v_proj(self.value_embedding.weight)[values]           # (batch, n_pairs, d_model)
        out = weights @ v                                               # (batch, 1, d_model)
        return self.readout(out[:, 0]), weights[:, 0]


def nudge_parameters(model: nn.Module, ulps: int = 1) -> None:
    """Move every parameter of ``model`` by ``ulps`` units in the last place, in place.

    One ulp is the gap to the next representable number (for float32, between 2^-24 and 2^-23,
    about 1e-7, of the value): ``torch.nextafter`` towards ``+inf`` for ``ulps > 0``, towards
    ``-inf`` for ``ulps < 0``; ``ulps = 0`` changes nothing.
    Chapter 3 uses it to ask whether a training run's outcome depends on the last bit of its start.
    """
    direction = float("inf") if ulps > 0 else float("-inf")
    with torch.no_grad():
        for p in model.parameters():
            target = torch.full_like(p, direction)
            for _ in range(abs(ulps)):
                p.copy_(torch.nextafter(p, target))


@dataclass
class RecallRun:
    """What :func:`train_recall` measured: per-step training loss and end-of-run statistics."""

    d_k: int
    scaled: bool
    losses: np.ndarray          # (steps,) training cross-entropy
    accuracy: float             # on a held-out batch after training
    held_out_loss: float        # cross-entropy on that held-out batch after training
    logit_std: tuple[float, float]  # std of the attention logits (before softmax) at start and end
    entropy: tuple[float, float]    # mean attention entropy (nats) at start and end
    early_logit_change: float       # mean |change| of the held-out logits over the first `early_steps` steps


def train_recall(d_k: int, scaled: bool, steps: int = 300, lr: float = 3e-3, batch: int = 32,
                 n_pairs: int = 8, n_symbols: int = 16, n_values: int = 16, d_model: int = 32,
                 init_std: float | None = None, seed: int = 0, early_steps: int = 5,
                 perturb_ulps: int = 0) -> RecallRun:
    """Train :class:`RecallAttention` with Adam on fresh random batches; fully seeded.

    The model and the data use their own generators seeded from ``seed``, so two calls with
    the same arguments give the same numbers on one machine (another CPU's kernels round
    differently, and an unscaled run can then end elsewhere). ``early_steps`` sets how many
    first steps the ``early_logit_change`` measurement (how far the first steps move the
    logits) covers. ``perturb_ulps`` moves every initial weight by that many float32 ulps
    (:func:`nudge_parameters`) before training; the data stay the same.
    """
    if not 1 <= early_steps <= steps:
        raise ValueError(f"early_steps must lie in [1, steps={steps}]; got {early_steps}")
    torch.manual_seed(seed)
    model = RecallAttention(n_symbols, n_values, d_model, d_k, scaled, init_std)
    if perturb_ulps:
        nudge_parameters(model, perturb_ulps)
    data = torch.Generator().manual_seed(seed + 1)
    held_out = recall_batch(512, n_pairs, n_symbols, n_values, torch.Generator().manual_seed(seed + 2))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    start = _recall_probe(model, held_out)
    with torch.no_grad():
        start_logits = model.scores(held_out[0], held_out[1])
    losses = np.empty(steps)
    for step in range(steps):
        query, keys, values, target = recall_batch(batch, n_pairs, n_symbols, n_values, data)
        logits, _ = model(query, keys, values)
        loss = nn.functional.cross_entropy(logits, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses[step] = loss.item()
        if step + 1 == early_steps:
            with torch.no_grad():
                early = (model.scores(held_out[0], held_out[1]) - start_logits).abs().mean().item()
    end = _recall_probe(model, held_out)
    return RecallRun(d_k, scaled, losses, end[0], end[3], (start[1], end[1]), (start[2], end[2]), early)


@torch.no_grad()
def _recall_probe(model: RecallAttention, batch) -> tuple[float, float, float, float]:
    """Accuracy, attention-logit std, mean attention entropy and cross-entropy of ``model`` on ``batch``."""
    query, keys, values, target = batch
    logits, weights = model(query, keys, values)
    accuracy = (logits.argmax(-1) == target).double().mean().item()
    logit_std = model.scores(query, keys).std().item()
    p = weights.double().clamp_min(1e-300)
    entropy = -(weights.double() * p.log()).sum(-1).mean().item()
    loss = nn.functional.cross_entropy(logits, target).item()
    return accuracy, logit_std, entropy, loss
