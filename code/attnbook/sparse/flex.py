"""The masks of chapter 7 and of this chapter as PyTorch FlexAttention
``mask_mod`` and ``score_mod`` functions.

FlexAttention (``torch.nn.attention.flex_attention``) computes

    softmax(score_mod(q . k / sqrt(d), b, h, q_idx, kv_idx)) v

over the pairs that ``mask_mod(b, h, q_idx, kv_idx)`` allows. A
``BlockMask`` (``create_block_mask``) records, per tile of ``block_size``
queries by ``block_size`` keys, whether the tile is empty, full or partial:
the compiled kernel skips empty tiles, which is where a sparse pattern saves
work. Eager (uncompiled) FlexAttention forms every score and gives the same
result; the tests run it so.

A ``mask_mod`` is a function of four index tensors that returns True where a
query may read a key; a ``score_mod`` of the score and the same four indices
returns a new score. Both are written with tensor operations only (they are
traced). Here: :func:`causal`, :func:`padding`, :func:`sliding_window`,
:func:`document`, :func:`prefix_lm`, :func:`sink_window` (StreamingLLM's kept
first tokens) and :func:`alibi`. A learned sink (gpt-oss) adds ``exp(beta_i)``
to the softmax's denominator. No ``mask_mod`` and no ``score_mod`` over the
real keys alone can express that: their weights still sum to one. There are two
ways: :func:`flex_attend` adds the sink after the kernel from the log-sum-exp
FlexAttention returns, by the merge of attention states
(:func:`attnbook.torch_attention.merge_splits`); :func:`sinks_as_key` appends
one zero key whose score a ``score_mod`` sets to ``beta_i`` (every query reads
one key more).

Chapter 14 (sparse attention) shows :func:`sliding_window` and
:func:`block_sparse_attend`.
"""

from __future__ import annotations

import inspect
import warnings

import torch
from torch.nn.attention.flex_attention import (
    create_block_mask,
    create_mask,
    flex_attention,
)

try:
    # torch >= 2.9; before it, return_lse=True (deprecated since)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - older torch
    AuxRequest = None

from .._validate import nonnegative_int, positive_int
from ..torch_attention import merge_splits


def _check_arity(name: str, fn, arity: int, names: str) -> None:
    """Raise unless ``fn`` takes exactly ``arity`` positional arguments."""
    if not callable(fn):
        raise ValueError(f"{name} must be a function; got {fn!r}")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # a builtin: let FlexAttention judge it
    positional = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        and p.default is p.empty
    ]
    if len(positional) != arity:
        got = ", ".join(p.name for p in positional)
        raise ValueError(
            f"a {name} takes {arity} arguments ({names}); "
            f"{getattr(fn, '__name__', fn)} takes {len(positional)} ({got})"
        )


def check_mask_mod(mask_mod):
    """``mask_mod`` if it takes (b, h, q_idx, kv_idx); else a ValueError."""
    _check_arity("mask_mod", mask_mod, 4, "b, h, q_idx, kv_idx")
    return mask_mod


def check_score_mod(score_mod):
    """``score_mod`` if it takes (score, b, h, q_idx, kv_idx)."""
    _check_arity("score_mod", score_mod, 5, "score, b, h, q_idx, kv_idx")
    return score_mod


def _positive(name: str, value) -> int:
    return positive_int(name, value)


def causal(b, h, q_idx, kv_idx):
    """Causal: a query reads itself and the keys before it.

    Aligned top-left (``kv_idx <= q_idx``): right only when queries and keys
    cover the same positions (``n_q == n_k``). For ``n_q < n_k`` (decoding,
    queries the last ``n_q`` of ``n_k`` positions) it is wrong; use the
    bottom-right alignment of :func:`attnbook.causal_mask` (chapter 7),
    ``kv_idx <= q_idx + n_k - n_q``.
    """
    return kv_idx <= q_idx


def sliding_window(window: int):
    """Causal within the last ``window`` keys, the query's own included
    (:func:`attnbook.sliding_window_mask`)."""
    window = _positive("window", window)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return mask_mod


def sink_window(window: int, n_sinks: int):
    """A sliding window plus the first ``n_sinks`` keys (StreamingLLM;
    :func:`attnbook.windows.sink_window_mask`)."""
    window = _positive("window", window)
    n_sinks = nonnegative_int("n_sinks", n_sinks)

    def mask_mod(b, h, q_idx, kv_idx):
        near = (kv_idx <= q_idx) & (q_idx - kv_idx < window)
        return near | ((kv_idx < n_sinks) & (kv_idx <= q_idx))

    return mask_mod


def padding(lengths):
    """Causal, and no key at or past row ``b``'s length ``lengths[b]`` (right
    padding). lengths: (batch,) int tensor."""
    lengths = torch.as_tensor(lengths)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx < lengths[b])

    return mask_mod


def document(doc_ids):
    """Causal within each packed document (:func:`attnbook.
    packed_causal_mask`). doc_ids: (n,) or (batch, n), the document of each
    position."""
    doc_ids = torch.as_tensor(doc_ids)
    if doc_ids.ndim not in (1, 2):
        raise ValueError(
            f"doc_ids must be (n,) or (batch, n); got {tuple(doc_ids.shape)}"
        )

    def mask_mod(b, h, q_idx, kv_idx):
        row = doc_ids if doc_ids.ndim == 1 else doc_ids[b]
        same = row[q_idx] == row[kv_idx]
        return same & (kv_idx <= q_idx)

    return mask_mod


def prefix_lm(prefix: int):
    """The first ``prefix`` positions read one another; the rest is causal
    (:func:`attnbook.prefix_lm_mask`)."""
    prefix = nonnegative_int("prefix", prefix)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix)

    return mask_mod


def alibi(slopes):
    """ALiBi as a ``score_mod``: ``score - slope_h |q_idx - kv_idx|``
    (:func:`attnbook.positional.alibi_bias`, queries and keys aligned).
    slopes: (n_heads,)."""
    slopes = torch.as_tensor(slopes)

    def score_mod(score, b, h, q_idx, kv_idx):
        distance = (q_idx - kv_idx).abs()
        return score - slopes[h].to(score.dtype) * distance

    return score_mod


def block_mask(mask_mod, batch, heads, n_q: int, n_k: int, block_size=128):
    """``create_block_mask`` on the CPU, after checking the ``mask_mod``.

    ``batch`` and ``heads`` may be None (the mask is the same for every batch
    row or head). Its ``sparsity()`` is the percentage of tiles skipped."""
    check_mask_mod(mask_mod)
    n_q, n_k = _positive("n_q", n_q), _positive("n_k", n_k)
    block_size = _positive("block_size", block_size)
    return create_block_mask(
        mask_mod, batch, heads, n_q, n_k, device="cpu", BLOCK_SIZE=block_size
    )


def dense_mask(mask_mod, batch: int, heads: int, n_q: int, n_k: int):
    """The boolean mask (batch, heads, n_q, n_k) that ``mask_mod`` means."""
    check_mask_mod(mask_mod)
    return create_mask(mask_mod, batch, heads, n_q, n_k, device="cpu")


def flex_attend(
    q, k, v, mask_mod=None, score_mod=None, sinks=None, block_size=128
):
    """FlexAttention (eager unless called under ``torch.compile``) with a
    ``mask_mod``, a ``score_mod`` and learned sinks.

    q: (b, h, n_q, d), k, v: (b, h, n_k, d); sinks: (h,) or None. The sinks are
    merged in after the kernel: its output ``o`` and log-sum-exp ``lse`` are
    one run of keys, the sink an empty run of log-sum-exp ``beta_i``, and the
    merge gives ``o * sigmoid(lse - beta_i)``. Returns (b, h, n_q, d). A query
    with no key (a fully masked row) gets 0, as :func:`attnbook.attend` gives.
    """
    if score_mod is not None:
        check_score_mod(score_mod)
    b, h, n_q, _ = q.shape
    mask = None
    if mask_mod is not None:
        mask = block_mask(mask_mod, b, h, n_q, k.shape[-2], block_size)
    with warnings.catch_warnings():
        # eager mode is what the tests want: no advice to compile
        warnings.filterwarnings("ignore", "flex_attention called without")
        if AuxRequest is None:
            out, lse = flex_attention(
                q, k, v, score_mod=score_mod, block_mask=mask, return_lse=True
            )
        else:
            out, aux = flex_attention(
                q,
                k,
                v,
                score_mod=score_mod,
                block_mask=mask,
                return_aux=AuxRequest(lse=True),
            )
            lse = aux.lse
    # natural log; a row without keys has lse -inf and output 0
    lse = lse.to(out.dtype)
    if sinks is None:
        return out
    sinks = torch.as_tensor(sinks, dtype=out.dtype)
    if sinks.shape != (h,):
        raise ValueError(
            f"sinks must hold one logit per head, shape ({h},); got "
            f"{tuple(sinks.shape)}"
        )
    sink_lse = sinks[:, None].expand(h, n_q).expand_as(lse)
    merged, _ = merge_splits(
        torch.stack([out, torch.zeros_like(out)]),
        torch.stack([lse, sink_lse]),
    )
    return merged


def sinks_as_key(q, k, v, mask_mod, sinks, block_size=128):
    """Learned sinks run by FlexAttention as one more key, the sink's
    definition: a zero key and a zero value appended at position ``n_k``,
    allowed for every query by the ``mask_mod``, its score set to ``beta_i`` by
    a ``score_mod``.

    q: (b, h, n_q, d), k, v: (b, h, n_k, d); mask_mod: for the real keys;
    sinks: (h,). Returns (b, h, n_q, d), equal to :func:`flex_attend` with
    ``sinks`` (and to :func:`attnbook.sparse.sinks.sink_attention`), at the
    price of one key column more for every query.
    """
    check_mask_mod(mask_mod)
    h, n_k = q.shape[1], k.shape[-2]
    sinks = torch.as_tensor(sinks, dtype=q.dtype)
    if sinks.shape != (h,):
        raise ValueError(
            f"sinks must hold one logit per head, shape ({h},); got "
            f"{tuple(sinks.shape)}"
        )
    k = torch.cat([k, k.new_zeros(*k.shape[:-2], 1, k.shape[-1])], dim=-2)
    v = torch.cat([v, v.new_zeros(*v.shape[:-2], 1, v.shape[-1])], dim=-2)

    def with_sink(b, h, q_idx, kv_idx):
        # the sink (n_k) always; the real keys by mask_mod, asked only about
        # indices it knows
        real = mask_mod(b, h, q_idx, kv_idx.clamp(max=n_k - 1))
        return (kv_idx == n_k) | real

    def sink_score(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx == n_k, sinks[h].to(score.dtype), score)

    return flex_attend(q, k, v, with_sink, sink_score, block_size=block_size)


def block_sparse_attend(q, k, v, mask, mask_mod, scale=None):
    """Attention that reads only the tiles a ``BlockMask`` keeps: what the
    compiled FlexAttention kernel does, written as a loop in eager torch.

    q: (b, h, n_q, d), k, v: (b, h, n_k, d); mask: a ``BlockMask`` made for
    ``mask_mod`` with ``batch`` and ``heads`` None (:func:`block_mask`). For
    each block of queries it gathers the key blocks the mask lists, full ones
    unmasked and partial ones masked by ``mask_mod``, and attends over them
    (:func:`attnbook.attend`). Work: the number of kept tiles times
    ``block_size ** 2 * d``, so a window of ``w`` costs ``O(n w d)`` where
    causal attention costs ``O(n^2 d)``. Returns (b, h, n_q, d).
    """
    from ..torch_attention import attend

    check_mask_mod(mask_mod)
    size_q, size_k = mask.BLOCK_SIZE
    n_q, n_k = q.shape[-2], k.shape[-2]
    if mask.shape[-2:] != (n_q, n_k) or mask.shape[:2] != (1, 1):
        raise ValueError(
            f"the BlockMask is for shape {tuple(mask.shape)}; need (1, 1, "
            f"{n_q}, {n_k}) (batch and heads None)"
        )
    partial_n, partial_idx = mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0]
    if mask.full_kv_num_blocks is None:
        full_n = torch.zeros_like(partial_n)
        full_idx = partial_idx[:, :0]
    else:
        full_n = mask.full_kv_num_blocks[0, 0]
        full_idx = mask.full_kv_indices[0, 0]
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    for i in range(len(partial_n)):
        rows = torch.arange(i * size_q, min((i + 1) * size_q, n_q))
        blocks = [(j, True) for j in full_idx[i, : full_n[i]].tolist()]
        blocks += [(j, False) for j in partial_idx[i, : partial_n[i]].tolist()]
        if not blocks:
            continue
        cols = [
            torch.arange(j * size_k, min((j + 1) * size_k, n_k))
            for j, _ in blocks
        ]
        keys = torch.cat(cols)
        allowed = torch.cat(
            [
                torch.ones(len(rows), len(c), dtype=torch.bool)
                if is_full
                else mask_mod(0, 0, rows[:, None], c[None, :])
                for (_, is_full), c in zip(blocks, cols)
            ],
            dim=1,
        )
        out[..., rows, :] = attend(
            q[..., rows, :],
            k[..., keys, :],
            v[..., keys, :],
            allowed,
            scale=scale,
        )
    return out
