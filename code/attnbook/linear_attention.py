"""Linear attention: attention whose cost grows linearly with the sequence
length.

Softmax attention weighs value ``j`` for query ``i`` by ``exp(q_i . k_j /
sqrt(d))``, normalised over ``j``. If the similarity is instead a dot product
of *features*, ``sim(q, k) = phi(q) . phi(k)`` with ``phi: R^d -> R^m``,
associativity lets every query share one ``m x d_v`` summary of all keys and
values:

    out_i = phi(q_i)^T S / phi(q_i)^T z,
    S = sum_j phi(k_j) v_j^T,   z = sum_j phi(k_j),

which costs ``O(n m d_v)`` instead of ``O(n^2 d)`` (Katharopoulos et al. 2020).
Under a causal mask ``S`` and ``z`` become prefix sums, and attention becomes a
recurrence with a state of fixed size. Two feature maps:

- :func:`elu_feature_map`, ``elu(x) + 1`` (Katharopoulos et al. 2020): a
  different kernel from softmax's, for models trained with it;
- :func:`softmax_kernel_features` with random directions from
  :func:`draw_random_features` (Performer, Choromanski et al. 2021): positive
  random features whose dot products are unbiased estimates of ``exp(x . y)``,
  so :func:`performer_attention` approximates softmax attention itself.

Models that replace attention by such a recurrence let the state forget: RetNet
(Sun et al. 2023), gated linear attention (Yang et al. 2024) and Mamba-2 (Dao &
Gu 2024) multiply it by a decay before each update, ``S_t = gamma_t S_{t-1} +
k_t v_t^T``. :func:`decayed_linear_attention_recurrent` runs that recurrence
and :func:`decayed_linear_attention` computes the same outputs as a quadratic
form under the decay-weighted causal mask of :func:`decay_mask`.

Chapter 17 (perspectives) shows :func:`elu_feature_map`,
:func:`attention_from_features`, :func:`linear_attention_recurrent`,
:func:`performer_attention`, :func:`decay_mask`,
:func:`decayed_linear_attention_recurrent` and
:func:`decayed_linear_attention`; its timing against softmax attention is
:mod:`attnbook.experiments.linear_attention_timing`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import _validate


# --- feature maps ------------------------------------------------------------


def elu_feature_map(x) -> np.ndarray:
    """``phi(x) = elu(x) + 1`` elementwise: ``x + 1`` for ``x > 0``, ``exp(x)``
    otherwise.

    x: (..., d) -> (..., d). Every feature is positive, so ``phi(q) . phi(k) >
    0``.
    """
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    # minimum: no overflow in the unused branch
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def draw_random_features(
    d: int, n_features: int, seed=None, orthogonal: bool = True
) -> np.ndarray:
    """Random directions ``omega (n_features, d)`` whose rows are each
    distributed as N(0, I_d).

    With ``orthogonal=True`` the rows are orthogonal within each block of ``d``
    (Choromanski et al. 2021): each block is a uniformly random orthogonal
    matrix, and each row is rescaled to the length of an independent Gaussian
    vector, so that every row on its own is still N(0, I_d) while the rows of a
    block do not repeat each other's directions.
    """
    d = _validate.positive_int("d", d)
    n_features = _validate.positive_int("n_features", n_features)
    rng = np.random.default_rng(seed)
    if not orthogonal:
        return rng.standard_normal((n_features, d))
    blocks = []
    for _ in range(-(-n_features // d)):
        q, r = np.linalg.qr(rng.standard_normal((d, d)))
        # the sign fix makes q uniform (Haar)
        blocks.append((q * np.sign(np.diag(r))).T)
    # unit rows, orthogonal within a block
    directions = np.concatenate(blocks)[:n_features]
    lengths = np.linalg.norm(rng.standard_normal((n_features, d)), axis=1)
    return directions * lengths[:, None]


def _check_omega(x: np.ndarray, omega) -> np.ndarray:
    omega = np.asarray(omega)
    if omega.ndim != 2 or omega.shape[1] != x.shape[-1]:
        raise ValueError(
            f"omega must have shape (n_features, d={x.shape[-1]}) to match x "
            f"{tuple(x.shape)}; got {tuple(omega.shape)}"
        )
    return omega


def softmax_kernel_log_features(x, omega) -> np.ndarray:
    """Logarithm of :func:`softmax_kernel_features`: ``omega x - |x|^2 / 2 -
    log(m) / 2``.

    x: (..., d), omega: (m, d) -> (..., m).
    """
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    _validate.require_rank("x", x, 1, "(..., d)")
    omega = _check_omega(x, omega).astype(x.dtype)
    m = omega.shape[0]
    return (
        x @ omega.T
        - 0.5 * np.sum(x * x, axis=-1, keepdims=True)
        - 0.5 * np.log(m)
    )


def softmax_kernel_features(x, omega) -> np.ndarray:
    """Positive random features of the softmax kernel: ``exp(omega x - |x|^2 /
    2) / sqrt(m)``.

    x: (..., d), omega: (m, d) with rows drawn from N(0, I_d) -> (..., m), all
    entries > 0. For such ``omega``, ``E[phi(x) . phi(y)] = exp(x . y)`` (the
    Gaussian moment generating function), and the average over ``m`` directions
    converges at the Monte Carlo rate.
    """
    return np.exp(softmax_kernel_log_features(x, omega))


# --- attention from features -------------------------------------------------


def _check_features(phi_q, phi_k, q_shape, k_shape) -> None:
    """The feature map must keep every position, give q and k the same m, and
    be non-negative."""
    for name, phi, shape in (
        ("phi(q)", phi_q, q_shape),
        ("phi(k)", phi_k, k_shape),
    ):
        if phi.ndim != len(shape) or phi.shape[:-1] != tuple(shape[:-1]):
            raise ValueError(
                "the feature map must map (..., n, d) to (..., n, m); it "
                "turned "
                f"{tuple(shape)} into {name} of shape {tuple(phi.shape)}"
            )
    if phi_q.shape[-1] != phi_k.shape[-1]:
        raise ValueError(
            f"phi(q) and phi(k) must have the same number of features m; got "
            f"{tuple(phi_q.shape)} and {tuple(phi_k.shape)}"
        )
    if np.any(phi_q < 0) or np.any(phi_k < 0):
        raise ValueError(
            "the features must be non-negative, so that every weight phi(q) . "
            "phi(k) "
            "is >= 0 and the output is a weighted average of the values"
        )


def _float_dtype(*arrays) -> np.dtype:
    return np.result_type(*(a.dtype for a in arrays), np.float32)


def attention_from_features(
    phi_q, phi_k, v, causal: bool = False, chunk_size: int = 64
) -> np.ndarray:
    """Attention with the weights ``phi(q_i) . phi(k_j)``, normalised over the
    keys, in O(n).

    phi_q: (..., n_q, m), phi_k: (..., n_k, m), v: (..., n_k, d_v) -> (...,
    n_q, d_v). Non-causal: ``out = (phi_q @ S) / (phi_q @ z)`` with ``S =
    phi_k^T v`` (m, d_v) and ``z = sum_j phi_k[j]``. Causal: the queries are
    the last ``n_q`` of the ``n_k`` positions (as in
    :func:`attnbook.causal_mask`) and ``S``, ``z`` are prefix sums, accumulated
    ``chunk_size`` positions at a time: inside a chunk the few weights are
    formed explicitly under a causal mask, and the chunks before it enter
    through ``S`` and ``z``. Time ``O(n (m d_v + chunk_size (m + d_v)))``,
    extra memory ``O(m d_v)`` per batch entry besides one chunk.
    """
    phi_q, phi_k, v = np.asarray(phi_q), np.asarray(phi_k), np.asarray(v)
    if (
        phi_q.ndim >= 1
        and phi_k.ndim >= 1
        and phi_q.shape[-1] != phi_k.shape[-1]
    ):
        raise ValueError(
            f"phi(q) and phi(k) must have the same number of features m; got "
            f"{tuple(phi_q.shape)} and {tuple(phi_k.shape)}"
        )
    batch, n_q, n_k, m, d_v = _validate.attention_shapes(phi_q, phi_k, v)
    dtype = _float_dtype(phi_q, phi_k, v)
    phi_q, phi_k, v = (
        phi_q.astype(dtype, copy=False),
        phi_k.astype(dtype, copy=False),
        v.astype(dtype, copy=False),
    )
    if not causal:
        # (..., m, d_v): all keys and values
        s = np.swapaxes(phi_k, -1, -2) @ v
        # (..., m, 1): sum of the key features
        z = np.sum(phi_k, axis=-2)[..., :, None]
        return (phi_q @ s) / (phi_q @ z)  # (..., n_q, d_v)
    chunk_size = _validate.positive_int("chunk_size", chunk_size)
    _validate.queries_fit(
        "causal attention",
        n_q,
        n_k,
        f"phi_q {tuple(phi_q.shape)} and phi_k {tuple(phi_k.shape)}",
    )
    # keys before the first query
    offset = n_k - n_q
    # (..., m, d_v)
    s = np.swapaxes(phi_k[..., :offset, :], -1, -2) @ v[..., :offset, :]
    # (..., m, 1)
    z = np.sum(phi_k[..., :offset, :], axis=-2)[..., :, None]
    out = np.empty(batch + (n_q, d_v), dtype=dtype)
    # j <= i inside a chunk; no chunk is longer than the n_q queries
    c_max = min(chunk_size, n_q)
    below = np.tril(np.ones((c_max, c_max), dtype=dtype))
    for start in range(0, n_q, chunk_size):
        stop = min(start + chunk_size, n_q)
        c = stop - start
        # (..., c, m)
        fq = phi_q[..., start:stop, :]
        fk, vc = (
            phi_k[..., offset + start : offset + stop, :],
            v[..., offset + start : offset + stop, :],
        )
        # (..., c, c) weights in the chunk
        w = (fq @ np.swapaxes(fk, -1, -2)) * below[:c, :c]
        # earlier chunks + this one
        num = fq @ s + w @ vc
        den = fq @ z + np.sum(w, axis=-1, keepdims=True)
        out[..., start:stop, :] = num / den
        # extend the prefix sums
        s = s + np.swapaxes(fk, -1, -2) @ vc
        z = z + np.sum(fk, axis=-2)[..., :, None]
    return out


def _features(q, k, v, feature_map: Callable):
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    _validate.attention_shapes(q, k, v)
    phi_q, phi_k = np.asarray(feature_map(q)), np.asarray(feature_map(k))
    _check_features(phi_q, phi_k, q.shape, k.shape)
    return phi_q, phi_k, v


def linear_attention(
    q,
    k,
    v,
    feature_map: Callable = elu_feature_map,
    causal: bool = False,
    chunk_size: int = 64,
) -> np.ndarray:
    """Linear attention (Katharopoulos et al. 2020): ``phi(q_i)^T S /
    phi(q_i)^T z``.

    q: (..., n_q, d_k), k: (..., n_k, d_k), v: (..., n_k, d_v) -> (..., n_q,
    d_v). ``feature_map`` maps (..., n, d_k) to non-negative features (..., n,
    m); the default is ``elu(x) + 1``. ``causal`` places the queries at the
    last ``n_q`` positions and lets each see the keys at or before it. See
    :func:`attention_from_features`.
    """
    phi_q, phi_k, v = _features(q, k, v, feature_map)
    return attention_from_features(
        phi_q, phi_k, v, causal=causal, chunk_size=chunk_size
    )


def linear_attention_recurrent(
    q, k, v, feature_map: Callable = elu_feature_map
) -> np.ndarray:
    """Causal linear attention run as a recurrent network, one position at a
    time.

    q: (..., n_q, d_k), k: (..., n_k, d_k), v: (..., n_k, d_v) -> (..., n_q,
    d_v), queries at the last ``n_q`` positions. The state after position ``t``
    is ``S_t = S_{t-1} + phi(k_t) v_t^T`` (m, d_v) and ``z_t = z_{t-1} +
    phi(k_t)`` (m,): its size does not grow with ``t``, which is what makes
    generation O(1) per token. Slow in Python (a loop over positions); for
    explaining and checking, not for speed.
    """
    phi_q, phi_k, v = _features(q, k, v, feature_map)
    batch, n_q, n_k, m, d_v = _validate.attention_shapes(phi_q, phi_k, v)
    _validate.queries_fit(
        "causal attention",
        n_q,
        n_k,
        f"q {tuple(q.shape)} and k {tuple(k.shape)}",
    )
    dtype = _float_dtype(phi_q, phi_k, v)
    s, z = np.zeros(batch + (m, d_v), dtype), np.zeros(batch + (m,), dtype)
    out = np.empty(batch + (n_q, d_v), dtype)
    offset = n_k - n_q
    for t in range(n_k):
        # add the outer product phi(k_t) v_t^T
        s = s + phi_k[..., t, :, None] * v[..., t, None, :]
        z = z + phi_k[..., t, :]
        if t >= offset:
            f = phi_q[..., t - offset, :]  # (..., m)
            out[..., t - offset, :] = (
                np.einsum("...m,...md->...d", f, s)
                / np.sum(f * z, axis=-1)[..., None]
            )
    return out


def performer_attention(
    q,
    k,
    v,
    omega,
    causal: bool = False,
    scale: float | None = None,
    chunk_size: int = 64,
) -> np.ndarray:
    """Softmax attention approximated with positive random features
    (Performer).

    q: (..., n_q, d_k), k: (..., n_k, d_k), v: (..., n_k, d_v), omega: (m, d_k)
    from :func:`draw_random_features` -> (..., n_q, d_v). Since ``exp(scale
    q.k) = exp(x.y)`` with ``x = sqrt(scale) q`` and ``y = sqrt(scale) k``, the
    features of ``x`` and ``y`` estimate softmax attention's weights; ``scale``
    defaults to ``1/sqrt(d_k)``. The output converges to ``softmax(scale q k^T)
    v`` as ``m`` grows.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    _validate.attention_shapes(q, k, v)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    root = np.sqrt(scale)
    log_q = softmax_kernel_log_features(root * q, omega)  # (..., n_q, m)
    log_k = softmax_kernel_log_features(root * k, omega)  # (..., n_k, m)
    # A factor common to one query's features cancels in that query's ratio,
    # and a factor common to all keys cancels in every ratio; dividing by the
    # largest feature keeps exp() from overflowing (the same stabilisation the
    # Performer uses).
    phi_q = np.exp(log_q - np.max(log_q, axis=-1, keepdims=True))
    phi_k = np.exp(log_k - np.max(log_k, axis=(-2, -1), keepdims=True))
    return attention_from_features(
        phi_q, phi_k, v, causal=causal, chunk_size=chunk_size
    )


# --- forgetting: decayed and gated linear attention --------------------------


def check_decayed_inputs(q, k, v, decay):
    """Validate the inputs of the decayed forms; return them as float arrays,
    decay as (..., n).

    q, k: (..., n, d_k), v: (..., n, d_v) with one ``n`` for all three (causal
    self-attention);
    decay: a number or an array broadcastable to (..., n), every entry in [0,
    1].
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    batch, n_q, n_k, _, _ = _validate.attention_shapes(q, k, v)
    if n_q != n_k:
        raise ValueError(
            "decayed linear attention is causal self-attention: q and k need "
            "the same "
            f"length n; got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    dtype = _float_dtype(q, k, v)
    decay = np.asarray(decay, dtype=dtype)
    try:
        decay = np.broadcast_to(decay, batch + (n_q,))
    except ValueError:
        raise ValueError(
            "decay must be a number or broadcast to (..., n) = "
            f"{batch + (n_q,)}; got shape "
            f"{tuple(decay.shape)}"
        ) from None
    check_decay(decay)
    return (
        q.astype(dtype, copy=False),
        k.astype(dtype, copy=False),
        v.astype(dtype, copy=False),
        decay,
    )


def check_decay(decay) -> np.ndarray:
    """Decays as a float array of rank >= 1 with every entry in [0, 1];
    ValueError otherwise."""
    decay = np.asarray(decay)
    if not np.issubdtype(decay.dtype, np.floating):
        decay = decay.astype(np.float64)
    _validate.require_rank("decay", decay, 1, "(..., n)")
    inside = (decay >= 0) & (decay <= 1)  # False for NaN too
    if not np.all(inside):
        raise ValueError(
            "every decay must lie in [0, 1] (1 keeps the state, 0 forgets "
            "it); "
            f"got {decay[~inside].ravel()[0]}"
        )
    return decay


def decay_mask(decay) -> np.ndarray:
    """The decay-weighted causal mask D (..., n, n) of decays (..., n), each in
    [0, 1].

    ``D[i, j] = decay[j + 1] * ... * decay[i]`` for ``j <= i`` (1 on the
    diagonal, an empty product) and 0 for ``j > i``: how much of key ``j`` is
    left in the state at step ``i``. ``decay[0]`` is never used. One fixed
    decay gives ``gamma ** (i - j)`` (RetNet); all ones give the causal mask; a
    0 at position ``t`` cuts every key before ``t`` off from every query from
    ``t`` on.
    """
    decay = check_decay(decay)
    with np.errstate(divide="ignore"):
        # -inf where the decay is 0
        log_decay = np.log(decay)
    n = log_decay.shape[-1]
    # [s, j]: step s comes after key j
    later = np.tril(np.ones((n, n), dtype=bool), k=-1)
    # sums[i, j] = log_decay[j+1] + ... + log_decay[i], summed down each
    # column. Differences of one running sum, cumsum[i] - cumsum[j], would give
    # the same in exact arithmetic, but lose the small sums to rounding once
    # the running sum is long, and give -inf - -inf = NaN.
    sums = np.cumsum(np.where(later, log_decay[..., :, None], 0.0), axis=-2)
    return np.where(np.tril(np.ones((n, n), dtype=bool)), np.exp(sums), 0.0)


def decayed_linear_attention_recurrent(q, k, v, decay) -> np.ndarray:
    """Linear attention with a fading state, run as a recurrent network, one
    position at a time.

    q, k: (..., n, d_k), v: (..., n, d_v), decay: a number or (..., n) in [0,
    1] -> (..., n, d_v). ``S_t = decay_t S_{t-1} + k_t v_t^T`` (d_k, d_v) and
    ``out_t = q_t^T S_t``. A fixed decay is RetNet's retention; a decay
    computed from the input at each step is a gate (GLA, Mamba-2). No feature
    map and no denominator: these models normalise the output by other means.
    """
    q, k, v, decay = check_decayed_inputs(q, k, v, decay)
    # (..., d_k, d_v)
    s = np.zeros(q.shape[:-2] + (q.shape[-1], v.shape[-1]), dtype=q.dtype)
    out = np.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
    for t in range(q.shape[-2]):
        # forget, then write
        s = (
            decay[..., t, None, None] * s
            + k[..., t, :, None] * v[..., t, None, :]
        )
        # read
        out[..., t, :] = np.einsum("...d,...de->...e", q[..., t, :], s)
    return out


def decayed_linear_attention(q, k, v, decay) -> np.ndarray:
    """The same outputs as a quadratic form: ``out = ((q k^T) *
    decay_mask(decay)) v``.

    q, k: (..., n, d_k), v: (..., n, d_v), decay: a number or (..., n) in [0,
    1] -> (..., n, d_v). Attention with the decay-weighted causal mask in place
    of the 0/1 one and no softmax: O(n^2) time and memory, but matrix products
    throughout (the "dual" form of Dao & Gu 2024).
    """
    q, k, v, decay = check_decayed_inputs(q, k, v, decay)
    return ((q @ np.swapaxes(k, -1, -2)) * decay_mask(decay)) @ v
