"""Heads: splitting features into heads, what multi-head attention costs, and
what trained heads do.

Three groups of tools for chapter 5 (multi-head attention), which shows most of
them; chapter 7 (masking) and chapter 17 (perspectives) read attention maps
with them again:

- :func:`split_heads` and :func:`merge_heads` (numpy): the
  reshape-and-transpose that turns ``(batch, n, d_model)`` into ``(batch,
  n_heads, n, d_head)`` and back;
- :func:`multihead_flop_breakdown`: the flops of one multi-head attention
  layer, step by step, which do not depend on the number of heads for the
  matrix products;
- :func:`attention_weights`, :func:`attention_maps`, :func:`head_statistics`,
  :func:`weight_on`, :func:`ablate_heads`: the attention weights of every head
  of a trained :class:`attnbook.gpt.TinyGPT`, numbers that describe each head,
  and a way to switch heads off.

The chapter's two-head experiment is :mod:`attnbook.experiments.copy_previous`.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from . import _validate
from .cost import attention_flop_breakdown
from .multihead import keeping_weights


# --- split and merge ---------------------------------------------------------


def split_heads(x, n_heads: int) -> np.ndarray:
    """(batch, n, d_model) -> (batch, n_heads, n, d_head), d_head = d_model //
    n_heads.

    Head ``r`` gets the contiguous features ``r * d_head .. (r + 1) * d_head -
    1`` of every token. Any leading dimensions before ``n`` are kept.
    """
    x = np.asarray(x)
    _validate.require_rank("x", x, 2, "(..., n, d_model)")
    n_heads = _validate.positive_int("n_heads", n_heads)
    *lead, n, d_model = x.shape
    if d_model % n_heads:
        raise ValueError(
            f"d_model={d_model} (last dimension of x {tuple(x.shape)}) is not "
            "divisible "
            f"by n_heads={n_heads}"
        )
    # First cut each token's features into (n_heads, d_head) blocks; only then
    # move the head axis in front of the tokens, so that every head keeps all n
    # tokens in order. (..., n, h, d_head)
    x = x.reshape(*lead, n, n_heads, d_model // n_heads)
    # (..., h, n, d_head)
    return np.swapaxes(x, -3, -2)


def merge_heads(x) -> np.ndarray:
    """(batch, n_heads, n, d_head) -> (batch, n, n_heads * d_head): the inverse
    of :func:`split_heads`.

    Token ``i``'s row is the concatenation of its ``d_head`` features from head
    0, 1, ...
    """
    x = np.asarray(x)
    _validate.require_rank("x", x, 3, "(..., n_heads, n, d_head)")
    *lead, h, n, d_head = x.shape
    # Tokens back in front of heads first; a reshape alone would read head 0's
    # rows as tokens.
    return np.swapaxes(x, -3, -2).reshape(*lead, n, h * d_head)


# --- cost --------------------------------------------------------------------


def multihead_flop_breakdown(
    n_q: int,
    d_model: int,
    n_heads: int,
    n_k: int | None = None,
    batch: int = 1,
) -> dict[str, int]:
    """Flops of one multi-head attention layer, step by step (multiply-add = 2
    flops).

    x: (batch, n_q, d_model) attends to a source of ``n_k`` tokens (default
    ``n_q``: self-attention). Returns ``{"q_proj", "k_proj", "v_proj",
    "out_proj"}`` (each ``2 * tokens * d_model**2``), the matrix products of
    attention ``"scores"`` and ``"weighted_sum"`` (each ``2 * n_q * n_k *
    d_model``, summed over heads), and the elementwise ``"scale"`` and
    ``"softmax"`` work, which is per score and so grows with ``n_heads``. All
    times ``batch``.
    """
    d_model = _validate.positive_int("d_model", d_model)
    n_heads = _validate.positive_int("n_heads", n_heads)
    n_q = _validate.positive_int("n_q", n_q)
    n_k = n_q if n_k is None else _validate.positive_int("n_k", n_k)
    batch = _validate.positive_int("batch", batch)
    if d_model % n_heads:
        raise ValueError(
            f"d_model={d_model} is not divisible by n_heads={n_heads}"
        )
    d_head = d_model // n_heads
    # one token through a (d_model, d_model) matrix
    linear = 2 * d_model * d_model
    steps = {
        "q_proj": batch * n_q * linear,
        "k_proj": batch * n_k * linear,
        "v_proj": batch * n_k * linear,
    }
    # attention itself: n_heads independent problems of width d_head
    steps.update(
        attention_flop_breakdown(
            n_q, n_k, d_head, d_head, batch=batch * n_heads
        )
    )
    steps["out_proj"] = batch * n_q * linear
    return steps


def multihead_matmul_flops(
    n_q: int,
    d_model: int,
    n_heads: int,
    n_k: int | None = None,
    batch: int = 1,
) -> int:
    """Flops in the matrix products of a multi-head layer (what a matmul flop
    counter sees).

    ``batch * (4 (n_q + n_k) d_model^2 + 4 n_q n_k d_model)``, which for
    self-attention (``n_q = n_k = n``) is ``batch * (8 n d_model^2 + 4 n^2
    d_model)``. ``n_heads`` does not appear: it only has to divide ``d_model``.
    """
    steps = multihead_flop_breakdown(n_q, d_model, n_heads, n_k, batch)
    return sum(v for k, v in steps.items() if k not in ("scale", "softmax"))


# --- what trained heads do ---------------------------------------------------


@torch.no_grad()
def attention_weights(
    attn, x, mask=None, is_causal: bool = False
) -> torch.Tensor:
    """The weights every head of a
    :class:`attnbook.multihead.MultiHeadAttention` puts on each key.

    x: (batch, n, d_model), the layer's input (self-attention); mask,
    is_causal: as in the layer's ``forward``. Returns (batch, n_heads, n, n):
    the weights the layer itself uses, kept by
    :func:`attnbook.multihead.keeping_weights` during one forward pass.
    """
    with keeping_weights(attn):
        attn(x, mask=mask, is_causal=is_causal)
        return attn.weights


@torch.no_grad()
def attention_maps(
    model, ids, mask=None, is_causal: bool = True
) -> torch.Tensor:
    """Attention weights of every head of every layer of a
    :class:`attnbook.gpt.TinyGPT`.

    ids: (batch, n) int64; mask, is_causal: as in ``TinyGPT.forward`` (default:
    the causal mask). Returns (n_layers, batch, n_heads, n, n), entry ``[l, b,
    h, i, j]`` = how much query ``i`` of head ``h`` in layer ``l`` attends to
    key ``j``: the weights each layer used in the forward pass.
    """
    with keeping_weights(model) as layers:
        model(ids, mask=mask, is_causal=is_causal)
        return torch.stack([layer.weights for layer in layers])


def head_statistics(weights) -> dict[str, np.ndarray]:
    """Numbers that describe where each head looks, averaged over the queries.

    weights: (..., n, n) causal attention weights whose rows sum to 1, e.g. the
    (n_layers, batch, n_heads, n, n) of :func:`attention_maps`. Returns arrays
    of shape ``weights.shape[:-2]``:

    - ``"previous"``: weight on the previous token, ``w[i, i - 1]``, over
      queries ``i >= 1``;
    - ``"self"``: weight on the query's own position, ``w[i, i]``;
    - ``"first"``: weight on position 0, over queries ``i >= 1``;
    - ``"distance"``: mean distance looked back, ``sum_j w[i, j] (i - j)``;
    - ``"entropy"``: each row's entropy (nats) divided by ``log(i + 1)``, the
      entropy of the uniform distribution over the ``i + 1`` visible keys, over
      queries ``i >= 1``: 1 = spread evenly over the past, 0 = all weight on
      one key.
    """
    w = _as_numpy(weights).astype(np.float64)
    if w.ndim < 2 or w.shape[-1] != w.shape[-2] or w.shape[-1] < 2:
        raise ValueError(
            "weights must be square (..., n, n) with n >= 2; got shape "
            f"{w.shape}"
        )
    n = w.shape[-1]
    i = np.arange(n)
    # (n, n): i - j
    back = (i[:, None] - i[None, :]).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        # 0 log 0 = 0
        plogp = np.where(w > 0, w * np.log(w), 0.0)
    return {
        "previous": w[..., i[1:], i[:-1]].mean(-1),
        "self": w[..., i, i].mean(-1),
        "first": w[..., 1:, 0].mean(-1),
        "distance": (w * back).sum(-1).mean(-1),
        "entropy": (-plogp.sum(-1)[..., 1:] / np.log(i[1:] + 1)).mean(-1),
    }


def _as_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def weight_on(weights, keys) -> np.ndarray:
    """Mean weight that the queries put on one chosen key each.

    weights: (..., n, n); keys: int, broadcastable to ``weights.shape[:-1]``:
    for each query the position of the key of interest (e.g. ``i - 1``, or the
    last space before ``i``), ``-1`` to leave that query out. Returns the mean
    of ``weights[..., i, keys[i]]`` over the queries that are not left out,
    shape ``weights.shape[:-2]``.
    """
    w = _as_numpy(weights).astype(np.float64)
    keys = np.asarray(keys)
    if not np.issubdtype(keys.dtype, np.integer):
        raise ValueError(
            f"keys must be integer positions; got dtype {keys.dtype}"
        )
    try:
        keys = np.broadcast_to(keys, w.shape[:-1])
    except ValueError:
        raise ValueError(
            f"keys of shape {keys.shape} do not broadcast to the queries' "
            "shape "
            f"{w.shape[:-1]} of weights {w.shape}"
        ) from None
    if keys.max(initial=-1) >= w.shape[-1] or keys.min(initial=0) < -1:
        raise ValueError(
            f"keys must lie in [-1, {w.shape[-1]}); got "
            f"{keys.min()}..{keys.max()}"
        )
    picked = np.take_along_axis(w, np.maximum(keys, 0)[..., None], axis=-1)[
        ..., 0
    ]
    used = keys >= 0
    return np.where(used, picked, 0.0).sum(-1) / np.maximum(used.sum(-1), 1)


@contextlib.contextmanager
def ablate_heads(model, heads, mode: str = "zero", reference=None):
    """Switch off attention heads of a :class:`attnbook.gpt.TinyGPT` inside a
    ``with`` block.

    heads: iterable of ``(layer, head)`` pairs. Just before the layer's output
    projection, a switched-off head's ``d_head`` columns of the concatenated
    heads are replaced by zeros (``mode="zero"``, the masking of Michel et al.
    2019) or by their mean (``mode="mean"``: the head still adds its average
    output, but no longer anything that depends on the tokens). The mean is
    over the batch and the positions of the current input, or, when
    ``reference`` (token ids, ``(batch, n)``) is given, of that input, run
    through the intact model once on
    entry: held-out text, so that the mean carries nothing of the text being
    scored.
    """
    if mode not in ("zero", "mean"):
        raise ValueError(f"mode must be 'zero' or 'mean'; got {mode!r}")
    if reference is not None and mode != "mean":
        raise ValueError(
            f"reference is used only with mode='mean'; got mode={mode!r}"
        )
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        if (
            not 0 <= layer < len(model.blocks)
            or not 0 <= head < model.blocks[layer].attn.n_heads
        ):
            raise ValueError(
                f"no head ({layer}, {head}) in a model of {len(model.blocks)} "
                "layers "
                f"of {model.blocks[0].attn.n_heads} heads"
            )
        by_layer.setdefault(int(layer), []).append(int(head))

    # layer -> (h * d_head,) mean over the reference input
    means: dict[int, torch.Tensor] = {}
    if reference is not None:

        def record(layer):
            def hook(module, args):
                means[layer] = args[0].detach().flatten(0, -2).mean(dim=0)

            return hook

        recorders = [
            model.blocks[l].attn.out_proj.register_forward_pre_hook(record(l))
            for l in by_layer
        ]
        try:
            with torch.no_grad():
                model(reference)
        finally:
            for hook in recorders:
                hook.remove()

    def replace(layer, heads_of_layer, d_head):
        def hook(module, args):
            # (batch, n, h * d_head)
            concat = args[0].clone()
            for h in heads_of_layer:
                cols = concat[..., h * d_head : (h + 1) * d_head]
                if mode == "zero":
                    concat[..., h * d_head : (h + 1) * d_head] = 0
                elif layer in means:
                    concat[..., h * d_head : (h + 1) * d_head] = means[layer][
                        h * d_head : (h + 1) * d_head
                    ]
                else:
                    concat[..., h * d_head : (h + 1) * d_head] = cols.mean(
                        dim=tuple(range(cols.ndim - 1)), keepdim=True
                    )
            return (concat,)

        return hook

    hooks = [
        model.blocks[l].attn.out_proj.register_forward_pre_hook(
            replace(l, hs, model.blocks[l].attn.d_head)
        )
        for l, hs in by_layer.items()
    ]
    try:
        yield model
    finally:
        for hook in hooks:
            hook.remove()
