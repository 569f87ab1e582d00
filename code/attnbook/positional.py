"""Positional information for attention: sinusoids, rotary embeddings (RoPE),
ALiBi.

Attention by itself ignores the order of its inputs (chapter 6 proves it), so
every transformer injects position somewhere:

* :func:`sinusoidal_positions` builds the fixed table that Vaswani et al.
  (2017) add to the token vectors; :func:`sinusoidal_shift_matrix` is the fixed
  linear map that moves a row of it ``k`` positions along.
* :func:`apply_rope` rotates pairs of query/key features by an angle
  proportional to the position (Su et al.), so that scores depend only on the
  offset between positions. Both pairings in use are supported
  (``layout="half"`` or ``"interleaved"``), and :func:`rope_layout_permutation`
  converts weights from one to the other.
* :func:`alibi_slopes` and :func:`alibi_bias` give the linear distance penalty
  of Press et al. (2022) that is added to the scores.
* :func:`shaw_relative_index` and :func:`t5_relative_position_bucket` map a
  query-key offset to the row of a learned table of relative positions: clipped
  (Shaw et al. 2018) or in logarithmic buckets (T5, Raffel et al. 2020).
* :func:`ntk_scaled_base`, :func:`yarn_frequencies` and
  :func:`yarn_logit_scale` stretch RoPE's frequencies for contexts longer than
  the training length; :func:`llama3_frequencies` is Llama 3.1's stretch.

Every frequency table here is ``pair_frequencies(d, base)``: pair ``i`` turns
at ``base ** (-2 i / d)`` radians per position. Chapter 6 (positional
encodings) derives and shows these functions; its models
(:mod:`attnbook.experiments.extrapolation`) use them.
"""

from __future__ import annotations

import math

import numpy as np

from ._validate import positive_int, queries_last

LAYOUTS = ("half", "interleaved")


def _even_dim(name: str, d) -> int:
    d = positive_int(name, d)
    if d % 2:
        raise ValueError(
            f"{name} must be even (features are rotated in pairs); got "
            f"{name}={d}"
        )
    return d


def _positive_float(name: str, value) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{name} must be a positive finite number; got {value!r}"
        )
    return value


# --- frequencies and the sinusoidal table ------------------------------------


def pair_frequencies(d: int, base: float = 10000.0) -> np.ndarray:
    """Angular frequency of each of the ``d / 2`` feature pairs: ``base ** (-2
    i / d)``.

    Returns ``(d // 2,)`` float64, in geometric progression from 1 radian per
    position (pair 0) down to ``base ** (-(d - 2) / d)`` (the last pair), which
    is close to ``1 / base`` only when ``d`` is large.
    """
    d = _even_dim("d", d)
    base = _positive_float("base", base)
    return base ** (-np.arange(0, d, 2, dtype=np.float64) / d)


def sinusoidal_positions(n: int, d: int, base: float = 10000.0) -> np.ndarray:
    """The sinusoidal position table of Vaswani et al. (2017), ``(n, d)``
    float64.

    Row ``pos`` holds ``PE[pos, 2i] = sin(pos * w_i)`` and ``PE[pos, 2i + 1] =
    cos(pos * w_i)`` with ``w_i = base ** (-2i / d)``: even columns sin, odd
    columns cos.
    """
    n = positive_int("n", n)
    # (n, d/2)
    angles = np.arange(n, dtype=np.float64)[:, None] * pair_frequencies(
        d, base
    )
    table = np.empty((n, d))
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles)
    return table


def sinusoidal_shift_matrix(
    k: float, d: int, base: float = 10000.0
) -> np.ndarray:
    """The ``(d, d)`` matrix ``M_k`` with ``PE[pos + k] = PE[pos] @ M_k`` for
    every ``pos``.

    Block-diagonal: the 2 x 2 block of pair ``i`` is ``[[cos a, -sin a], [sin
    a, cos a]]`` with ``a = k * w_i``, the angle-addition formulas written as a
    product with the row ``(sin, cos)``. It depends on ``k`` but not on
    ``pos``. ``k`` may be any real.
    """
    angles = float(k) * pair_frequencies(d, base)
    c, s = np.cos(angles), np.sin(angles)
    m = np.zeros((d, d))
    even, odd = np.arange(0, d, 2), np.arange(1, d, 2)
    m[even, even], m[even, odd] = c, -s
    m[odd, even], m[odd, odd] = s, c
    return m


# --- rotary position embedding (RoPE) ----------------------------------------


def rope_layout_permutation(d: int) -> np.ndarray:
    """Indices ``perm`` that reorder an interleaved-layout feature vector into
    the half layout.

    In the interleaved layout pair ``i`` is features ``(2i, 2i + 1)``; in the
    half layout it is ``(i, i + d/2)``. With ``perm = [0, 2, 4, ..., 1, 3, 5,
    ...]``, ``apply_rope(x[..., perm], layout="half") == apply_rope(x,
    layout="interleaved")[..., perm]``, so a checkpoint trained with one layout
    runs under the other once the output features of its query and key
    projections (per head) are permuted by ``perm``.
    """
    d = _even_dim("d", d)
    return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


def rope_angles(
    n: int, d: int, positions=None, base: float = 10000.0, frequencies=None
):
    """The rotation angles ``positions[..., m] * w_i`` of RoPE, ``(..., n,
    d/2)`` float64 (a CPU tensor).

    ``w_i`` is ``pair_frequencies(d, base)[i]``, or ``frequencies[i]`` when
    given; ``positions`` defaults to ``0, 1, ..., n-1``. The inputs are as
    :func:`check_rope_inputs` accepts them.
    """
    # here, not at the top: the numpy half of this module must not load torch
    import torch

    freqs = (
        pair_frequencies(d, base)
        if frequencies is None
        else np.asarray(frequencies, dtype=np.float64)
    )
    pos = (
        torch.arange(n, dtype=torch.float64)
        if positions is None
        else _positions_tensor(positions)
    )
    return pos[..., None] * torch.as_tensor(freqs)


def _positions_tensor(positions):
    import torch

    return (
        torch.as_tensor(positions)
        .detach()
        .to(device="cpu", dtype=torch.float64)
    )


def check_rope_inputs(
    x,
    positions=None,
    base: float = 10000.0,
    layout: str = "half",
    frequencies=None,
) -> tuple[int, int]:
    """Raise unless :func:`apply_rope` can rotate ``x`` with these arguments;
    return ``(n, d)``.

    ``x`` must be a floating torch tensor (..., n, d) with d even (an integer
    tensor would cast cos and sin to 0 or +-1: a silently wrong rotation);
    ``positions`` ``(n,)`` or broadcastable to ``x.shape[:-1]``; ``base``
    positive; ``frequencies`` of shape ``(d/2,)``.
    """
    # here, not at the top: the numpy half of this module must not load torch
    import torch

    if not isinstance(x, torch.Tensor):
        raise ValueError(
            "apply_rope expects a torch tensor (..., n, d); got "
            f"{type(x).__name__}"
        )
    if not x.is_floating_point():
        raise ValueError(
            f"apply_rope needs a floating-point tensor; got dtype {x.dtype}"
        )
    if x.ndim < 2:
        raise ValueError(
            "x must have at least 2 dimensions (..., n, d); got shape "
            f"{tuple(x.shape)}"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    n, d = x.shape[-2], _even_dim("d (the last dimension of x)", x.shape[-1])
    _positive_float("base", base)
    if frequencies is not None and tuple(np.shape(frequencies)) != (d // 2,):
        raise ValueError(
            f"frequencies must have shape (d/2,) = ({d // 2},); got "
            f"{tuple(np.shape(frequencies))}"
        )
    if positions is not None:
        leading, shape = (
            tuple(x.shape[:-2]),
            tuple(_positions_tensor(positions).shape),
        )
        try:
            ok = (
                len(shape) >= 1
                and shape[-1] == n
                and np.broadcast_shapes(shape[:-1], leading) == leading
            )
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"positions must have shape (n,) = ({n},) or broadcast to x's "
                "leading shape "
                f"{leading + (n,)}; got {shape}"
            )
    return n, d


def apply_rope(
    x,
    positions=None,
    base: float = 10000.0,
    layout: str = "half",
    frequencies=None,
):
    """Rotate the feature pairs of ``x (..., n, d)`` by angles proportional to
    position.

    Pair ``i`` of the row at position ``m`` is rotated by ``m * w_i`` radians,
    with ``w_i = base ** (-2i / d)`` (or ``frequencies[i]`` when given: a
    ``(d/2,)`` array, e.g. from :func:`yarn_frequencies`). Applied to queries
    and keys, it makes every score ``q_m . k_n`` a function of ``m - n`` alone.

    positions: ``(n,)`` or broadcastable to ``x.shape[:-1]``; default ``0, 1,
    ..., n-1``.
    layout: ``"half"`` pairs feature ``i`` with ``i + d/2`` (GPT-NeoX, Hugging
    Face Llama); ``"interleaved"`` pairs ``2i`` with ``2i + 1`` (RoFormer,
    GPT-J, Meta's Llama code). Returns a tensor of ``x``'s shape and dtype;
    differentiable with respect to ``x``.
    """
    # here, not at the top: the numpy half of this module must not load torch
    import torch

    n, d = check_rope_inputs(x, positions, base, layout, frequencies)
    # (..., n, d/2)
    angles = rope_angles(n, d, positions, base, frequencies).to(x.device)
    # float64 angles, then cast
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    if layout == "half":
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack(
        [x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1
    ).flatten(-2)


# --- ALiBi -------------------------------------------------------------------


def alibi_slopes(n_heads: int) -> np.ndarray:
    """The head slopes of Press et al. (2022), ``(n_heads,)`` float64.

    For ``h`` a power of two: ``2 ** (-8 r / h)``, ``r = 1..h`` (for ``h = 8``:
    1/2, 1/4, ..., 1/256). Otherwise the rule of the authors' code
    (``get_slopes``; the paper trains only ``2 ** a`` heads): the slopes of the
    largest power of two ``p < h``, followed by every other slope of ``2p``
    (the first ``h - p`` of them).
    """
    h = positive_int("n_heads", n_heads)
    p = 2 ** int(math.floor(math.log2(h)))

    def geometric(m: int) -> np.ndarray:
        return 2.0 ** (-8.0 * np.arange(1, m + 1) / m)

    if p == h:
        return geometric(h)
    return np.concatenate([geometric(p), geometric(2 * p)[0::2][: h - p]])


def alibi_bias(n_heads: int, n_q: int, n_k: int | None = None) -> np.ndarray:
    """The ALiBi bias ``(n_heads, n_q, n_k)`` added to the scores before the
    softmax.

    ``bias[r, row, n] = -slope_r * |m - n|``: minus head ``r``'s slope times
    the distance between the key at position ``n`` and the query, which (the
    package's causal convention, as in :func:`attnbook.causal_mask`) sits at
    absolute position ``m = row + n_k - n_q``. The bias is never positive.
    ALiBi was designed for causal models: combine it with a causal mask, which
    removes the keys after the query; without a mask, the same formula charges
    future keys by their distance too (a symmetric, bidirectional use).
    """
    n_q, n_k = queries_last("alibi_bias", n_q, n_k)
    query_pos = np.arange(n_q)[:, None] + (n_k - n_q)
    # (n_q, n_k)
    distance = np.abs(query_pos - np.arange(n_k)[None, :])
    # 0.0 - : no negative zeros
    return 0.0 - alibi_slopes(n_heads)[:, None, None] * distance


# --- learned relative positions ----------------------------------------------


def shaw_relative_index(
    n_q: int, n_k: int | None = None, max_distance: int = 16
) -> np.ndarray:
    """Shaw et al. (2018): the row of the learned relative-position tables for
    each (query, key).

    The offset ``j - i`` of key ``j`` from query ``i``, clipped to
    ``[-max_distance, max_distance]`` and shifted by ``max_distance`` so that
    it indexes a table of ``2 max_distance + 1`` rows. The queries are the last
    ``n_q`` of the ``n_k`` positions. Returns ``(n_q, n_k)`` int64.
    """
    n_q, n_k = queries_last("shaw_relative_index", n_q, n_k)
    max_distance = positive_int("max_distance", max_distance)
    # j - i
    offset = np.arange(n_k)[None, :] - np.arange(n_k - n_q, n_k)[:, None]
    return np.clip(offset, -max_distance, max_distance) + max_distance


def t5_bucket_starts(exact: int, max_distance: int, n_log: int) -> np.ndarray:
    """The first distance of each log-spaced T5 bucket ``exact + k``,
    ``k = 1 .. n_log - 1``: the least integer ``d`` with
    ``d >= exact * (max_distance / exact) ** (k / n_log)``.

    Decided in integers, ``d**n_log * exact**k >= max_distance**k *
    exact**n_log``, because a boundary can fall exactly on an integer
    (``exact = 1, max_distance = 9, n_log = 2``: distance 3 starts bucket 2),
    and there a floating-point log may land a hair below and drop a bucket.
    Returns int64 of shape ``(n_log - 1,)``, nondecreasing.
    """
    starts = []
    for k in range(1, n_log):
        # the float estimate is off by far less than 1: start just below it
        # and step up to the exact start
        estimate = exact * (max_distance / exact) ** (k / n_log)
        d = max(exact, math.floor(estimate) - 1)
        while d**n_log * exact**k < max_distance**k * exact**n_log:
            d += 1
        starts.append(d)
    return np.array(starts, dtype=np.int64)


def t5_relative_position_bucket(
    relative_position,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> np.ndarray:
    """T5's bucket (Raffel et al. 2020) for each offset ``relative_position =
    key - query``.

    With ``bidirectional`` half of the buckets hold keys after the query; a
    decoder (``bidirectional=False``) gives every later key bucket 0. Of the
    ``B`` buckets for one direction, distances ``0 .. B/2 - 1`` get a bucket
    each; larger distances share buckets whose widths grow geometrically
    (:func:`t5_bucket_starts`), and every distance ``>= max_distance`` the
    last bucket. Returns int64 of ``relative_position``'s shape, in
    ``[0, num_buckets)``.
    """
    rel = np.asarray(relative_position)
    if not np.issubdtype(rel.dtype, np.integer):
        raise ValueError(
            f"relative_position must hold integers; got dtype {rel.dtype}"
        )
    num_buckets = positive_int("num_buckets", num_buckets)
    if num_buckets < (4 if bidirectional else 2):
        raise ValueError(
            f"num_buckets must be at least {4 if bidirectional else 2} (two "
            "per direction); "
            f"got {num_buckets} with bidirectional={bidirectional}"
        )
    rel = rel.astype(np.int64)
    bucket = np.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        # keys after the query: the upper half
        bucket += (rel > 0) * num_buckets
        distance = np.abs(rel)
    else:
        # keys after the query: distance 0
        distance = np.maximum(-rel, 0)
    exact = num_buckets // 2
    if positive_int("max_distance", max_distance) <= exact:
        raise ValueError(
            f"max_distance must exceed the {exact} exact buckets; got "
            f"{max_distance}"
        )
    # exact + (how many log-spaced boundaries the distance has reached); the
    # last bucket, num_buckets - 1, also holds every distance past max_distance
    starts = t5_bucket_starts(exact, max_distance, num_buckets - exact)
    large = exact + np.searchsorted(starts, distance, side="right")
    return bucket + np.where(distance < exact, distance, large)


# --- stretching RoPE beyond the training length ------------------------------


def ntk_scaled_base(base: float, scale: float, d: int) -> float:
    """The "NTK-aware" base ``base * scale ** (d / (d - 2))`` for a context
    ``scale`` times longer.

    With it the fastest pair keeps its frequency (1 radian per position) and
    the slowest pair turns exactly ``scale`` times slower, as position
    interpolation would make it.
    """
    d = _even_dim("d", d)
    if d < 4:
        raise ValueError(
            f"NTK-aware scaling needs d >= 4 (two or more pairs); got d={d}"
        )
    return _positive_float("base", base) * _positive_float("scale", scale) ** (
        d / (d - 2)
    )


def interpolated_frequencies(d: int, base: float, scale: float) -> np.ndarray:
    """Position interpolation (Chen et al. 2023): every frequency divided by
    ``scale``, ``(d/2,)``.

    Equivalent to feeding positions ``m / scale`` to RoPE.
    """
    return pair_frequencies(d, base) / _positive_float("scale", scale)


YARN_RAMPS = ("paper", "code")


def yarn_frequencies(
    d: int,
    base: float,
    scale: float,
    original_length: int,
    alpha: float = 1.0,
    beta: float = 32.0,
    ramp: str = "paper",
) -> np.ndarray:
    """YaRN's per-pair frequencies (Peng et al. 2024), ``(d/2,)`` float64.

    Pair ``i`` turns ``r_i = original_length * w_i / (2 pi)`` times over the
    training context. Pairs that turn more than ``beta`` times keep ``w_i``;
    pairs that turn fewer than ``alpha`` times are interpolated to ``w_i /
    scale``; in between a ramp ``g`` from 0 to 1 blends them: ``(1 - g) w_i /
    scale + g w_i``. The two published ramps differ:

    - ``ramp="paper"``: linear in the rotations, ``g = (r_i - alpha) / (beta -
      alpha)``, the formula of the paper;
    - ``ramp="code"``: linear in the pair index ``i``, between the
      (real-valued) pairs that turn exactly ``beta`` and ``alpha`` times,
      rounded outwards to whole pairs: what the authors' code and
      ``transformers`` (``rope_type: yarn``) compute, so what YaRN checkpoints
      were trained with.
    """
    if not 0 < alpha < beta:
        raise ValueError(
            f"YaRN needs 0 < alpha < beta; got alpha={alpha}, beta={beta}"
        )
    if ramp not in YARN_RAMPS:
        raise ValueError(f"ramp must be one of {YARN_RAMPS}; got {ramp!r}")
    w = pair_frequencies(d, base)
    length = positive_int("original_length", original_length)
    if ramp == "paper":
        g = (length * w / (2 * np.pi) - alpha) / (beta - alpha)
    else:
        # the pair index at which a pair turns r times: w_i = base**(-2i/d) = 2
        # pi r / length
        def pair_turning(r):
            return (
                d * math.log(length / (2 * math.pi * r)) / (2 * math.log(base))
            )

        fast, slow = (
            max(math.floor(pair_turning(beta)), 0),
            min(math.ceil(pair_turning(alpha)), d - 1),
        )
        g = 1 - (np.arange(d // 2) - fast) / max(slow - fast, 1e-3)
    g = np.clip(g, 0.0, 1.0)
    return (1 - g) * w / _positive_float("scale", scale) + g * w


def llama3_frequencies(
    d: int,
    base: float,
    scale: float,
    original_length: int,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
) -> np.ndarray:
    """Llama 3.1's stretched RoPE frequencies (``rope_type: llama3``),
    ``(d/2,)`` float64.

    Pairs whose wavelength is below ``original_length / high_freq_factor`` keep
    their frequency, pairs whose wavelength exceeds ``original_length /
    low_freq_factor`` are divided by ``scale``, and in between the blend is
    linear in the number of turns over ``original_length``. That is YaRN's
    table with the paper's ramp, ``alpha = low_freq_factor`` and ``beta =
    high_freq_factor``, and without YaRN's logit scale. Llama 3.1: ``base =
    500000``, ``scale = 8``, ``original_length = 8192``, factors 1 and 4.
    """
    return yarn_frequencies(
        d,
        base,
        scale,
        original_length,
        alpha=low_freq_factor,
        beta=high_freq_factor,
        ramp="paper",
    )


def yarn_logit_scale(scale: float) -> float:
    """YaRN's attention temperature as a factor on the logits: ``(0.1 ln s + 1)
    ** 2`` (1 for s <= 1).

    The paper recommends ``sqrt(1/t) = 0.1 ln(s) + 1``; implementations
    multiply both the cosines and the sines by ``sqrt(1/t)``, so that every ``q
    . k`` is multiplied by ``1/t``.
    """
    s = _positive_float("scale", scale)
    return 1.0 if s <= 1 else (0.1 * math.log(s) + 1.0) ** 2
