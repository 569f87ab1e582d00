"""Shape and dtype checks shared by the package's public functions.

Every public function validates its inputs here, so that a wrong shape raises a
``ValueError`` that names the shapes at fault instead of broadcasting silently
into a wrong answer. No chapter shows this module: the book shows the
mechanism, and a shown function starts with one call here (or to a checking
function of its own module).
"""

from __future__ import annotations

import contextlib
import contextvars

import numpy as np

# Whether the checks that read a tensor's values run (see sync_checks_enabled).
_SYNC_CHECKS = contextvars.ContextVar("attnbook_sync_checks", default=True)


def sync_checks_enabled() -> bool:
    """Whether the checks that read the *values* of a tensor run (they do,
    unless turned off).

    Such a check (token ids within the vocabulary, positions within the table,
    a mask with no fully masked row) copies a number from the GPU to the host:
    a synchronisation that waits for all queued work and stalls every decoding
    step. Shape and dtype checks never sync and always run.
    """
    return _SYNC_CHECKS.get()


@contextlib.contextmanager
def skip_sync_checks():
    """Inside the ``with`` block, skip the checks that sync
    (:func:`sync_checks_enabled` is False).

    For timing code, which must not measure them: the inputs must then be right
    already, since a wrong one is no longer caught (an id out of range fails
    inside the embedding instead).
    """
    token = _SYNC_CHECKS.set(False)
    try:
        yield
    finally:
        _SYNC_CHECKS.reset(token)


def require_rank(name: str, x, min_rank: int, layout: str) -> None:
    """Raise unless ``x`` has at least ``min_rank`` dimensions."""
    if x.ndim < min_rank:
        raise ValueError(
            f"{name} must have at least {min_rank} dimensions {layout}; got "
            f"shape {tuple(x.shape)}"
        )


def attention_shapes(q, k, v) -> tuple[tuple[int, ...], int, int, int, int]:
    """Check ``q (..., n_q, d_k)``, ``k (..., n_k, d_k)``, ``v (..., n_k,
    d_v)``.

    Returns ``(batch, n_q, n_k, d_k, d_v)`` where ``batch`` is the broadcast of
    the three leading shapes. Works for numpy arrays and torch tensors alike.
    """
    require_rank("q", q, 2, "(..., n_q, d_k)")
    require_rank("k", k, 2, "(..., n_k, d_k)")
    require_rank("v", v, 2, "(..., n_k, d_v)")
    qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    if qs[-1] != ks[-1]:
        raise ValueError(
            f"q and k must share d_k (their last dimension); got q {qs} and k "
            f"{ks}"
        )
    if ks[-2] != vs[-2]:
        raise ValueError(
            "k and v must have the same number of positions n_k "
            "(second-to-last dimension); "
            f"got k {ks} and v {vs}"
        )
    try:
        batch = np.broadcast_shapes(qs[:-2], ks[:-2], vs[:-2])
    except ValueError:
        raise ValueError(
            f"the leading (batch) dimensions of q {qs}, k {ks} and v {vs} do "
            "not broadcast"
        ) from None
    return tuple(batch), qs[-2], ks[-2], qs[-1], vs[-1]


def mask_shape(mask, scores_shape: tuple[int, ...]) -> None:
    """Check that a boolean mask broadcasts to ``scores_shape`` without
    enlarging it."""
    dtype = getattr(mask, "dtype", None)
    if dtype is None or str(dtype) not in ("bool", "torch.bool"):
        raise ValueError(
            f"mask must be boolean (True = may attend); got dtype {dtype}. "
            "For an additive bias, add it to the scores instead."
        )
    ms = tuple(mask.shape)
    try:
        out = np.broadcast_shapes(ms, scores_shape)
    except ValueError:
        out = None
    if out != tuple(scores_shape):
        raise ValueError(
            f"mask of shape {ms} does not broadcast to the scores' shape "
            f"{tuple(scores_shape)} "
            "(..., n_q, n_k)"
        )


def int_in_range(
    name: str,
    value,
    low: int,
    high: int | None = None,
    bounds: str | None = None,
) -> int:
    """Return ``value`` as an int, or raise unless it is an integer (not a
    bool) with ``low <= value`` (and ``value <= high``). ``bounds`` names the
    range in the message (default ``an integer in [low, high]``)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or value < low
        or (high is not None and value > high)
    ):
        bounds = bounds or (
            f"an integer >= {low}"
            if high is None
            else f"an integer in [{low}, {high}]"
        )
        raise ValueError(f"{name} must be {bounds}; got {value!r}")
    return int(value)


def positive_int(name: str, value) -> int:
    """Return ``value`` as an int, or raise if it is not a positive integer."""
    return int_in_range(name, value, 1, bounds="a positive integer")


def nonnegative_int(name: str, value) -> int:
    """Return ``value`` as an int, or raise if it is not a non-negative
    integer."""
    return int_in_range(name, value, 0, bounds="a non-negative integer")


def queries_fit(name: str, n_q: int, n_k: int, got: str | None = None) -> None:
    """Raise unless ``n_q <= n_k``: the queries of causal attention are the
    last ``n_q`` of the ``n_k`` key positions, so there cannot be more of them.
    ``got`` says where the counts come from (default ``n_q=..., n_k=...``),
    e.g. the shapes of ``q`` and ``k``."""
    if n_q > n_k:
        raise ValueError(
            f"{name} needs n_q <= n_k (queries are the last n_q of n_k "
            "positions); "
            f"got {got or f'n_q={n_q}, n_k={n_k}'}"
        )


def queries_last(name: str, n_q, n_k=None) -> tuple[int, int]:
    """Check that ``n_q`` queries can be the last of ``n_k`` positions (default
    ``n_k = n_q``): both positive integers, and :func:`queries_fit`. Returns
    ``(n_q, n_k)`` as ints."""
    n_q = positive_int("n_q", n_q)
    n_k = n_q if n_k is None else positive_int("n_k", n_k)
    queries_fit(name, n_q, n_k)
    return n_q, n_k


def attend_inputs(
    q, k, v, mask=None, bias=None
) -> tuple[tuple[int, ...], int, int, int, int]:
    """:func:`attention_shapes`, plus the mask's and the additive bias's shapes
    (torch tensors)."""
    batch, n_q, n_k, d_k, d_v = attention_shapes(q, k, v)
    scores_shape = batch + (n_q, n_k)
    if mask is not None:
        mask_shape(mask, scores_shape)
    if bias is not None:
        try:
            out = np.broadcast_shapes(tuple(bias.shape), scores_shape)
        except ValueError:
            out = None
        if out != scores_shape:
            raise ValueError(
                f"bias of shape {tuple(bias.shape)} does not broadcast to the "
                "scores' shape "
                f"{scores_shape} (..., n_q, n_k)"
            )
    return batch, n_q, n_k, d_k, d_v


def repeat_kv_inputs(x, n_rep) -> int:
    """Check ``x`` is (batch, n_kv_heads, n, d) and ``n_rep`` a positive
    integer; return n_rep."""
    if x.ndim != 4:
        raise ValueError(
            "repeat_kv expects x of shape (batch, n_kv_heads, n, d); got "
            f"{tuple(x.shape)}"
        )
    return positive_int("n_rep", n_rep)


def head_layout(
    d_model, n_heads, n_kv_heads=None
) -> tuple[int, int, int, int]:
    """``(d_model, n_kv_heads, n_rep, d_head)`` of an attention layer: raises
    unless ``n_heads`` divides ``d_model`` and ``n_kv_heads`` (default
    ``n_heads``) divides ``n_heads``; ``n_rep`` query heads share each
    key/value head."""
    d_model = positive_int("d_model", d_model)
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    n_rep = group_size(n_heads, n_kv_heads)
    if d_model % n_heads:
        raise ValueError(
            f"d_model={d_model} is not divisible by n_heads={n_heads}"
        )
    return d_model, n_kv_heads, n_rep, d_model // n_heads


def group_size(n_heads, n_kv_heads, where: str = "") -> int:
    """Query heads per key/value head; raises unless ``n_kv_heads`` divides
    ``n_heads``.

    ``where`` (e.g. the shapes the head counts come from) is added to the error
    message.
    """
    n_heads = positive_int("n_heads", n_heads)
    n_kv_heads = positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(
            f"n_heads={n_heads} is not divisible by "
            f"n_kv_heads={n_kv_heads}{where}: "
            "each key/value head must serve the same number of query heads"
        )
    return n_heads // n_kv_heads
