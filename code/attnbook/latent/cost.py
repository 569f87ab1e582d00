"""What the two paths of multi-head latent attention cost: flops and bytes,
counted, and where the cheaper path changes.

One layer, one sequence, ``n`` new queries against ``n_k`` cached positions,
``h`` heads; the latent has ``d_latent`` numbers (``d_c``), the rotary key
``d_rope`` (``d_R``), each head's non-rotary query/key part ``d_nope`` and its
value ``d_v``. A multiply-add is two flops. The projections of the new tokens
(queries, latents, output) are the same for both paths and left out.

- The decompressed path (:meth:`attnbook.latent.mla.MultiHeadLatentAttention.
  attend_decompressed`) forms every head's key and value from every latent,
  ``2 n_k d_c h (d_nope + d_v)``, then attends with keys of ``d_nope + d_R``
  and values of ``d_v``: ``2 n n_k h (d_nope + d_R + d_v)``.
- The absorbed path (:meth:`attnbook.latent.mla.MultiHeadLatentAttention.
  attend_absorbed`) maps each query into the latent space and each output
  back, ``2 n h d_c (d_nope + d_v)``, and attends with keys of ``d_c + d_R``
  and values of ``d_c``: ``2 n n_k h (2 d_c + d_R)``.

The decompressed path pays per cached position, the absorbed one per query.
:func:`crossover_queries` is the number of queries at which they cost the
same. :func:`mla_decode_bytes` counts the bytes a decoding step moves: the
cache of every sequence of a batch, and optionally the up-projections
``W_UK`` and ``W_UV``, read once per step for the whole batch.

Chapter 13 (latent attention and shared caches) shows
:func:`mla_attention_flops` and uses :func:`crossover_queries` and
:func:`mla_decode_bytes`; ``tests/test_latent_cost.py`` checks the flop counts
against PyTorch's flop counter run on the layer, and the byte counts against
counts by hand.
"""

from __future__ import annotations

from .. import _validate


def mla_attention_flops(
    n: int,
    n_k: int,
    n_heads: int,
    d_latent: int,
    d_rope: int,
    d_nope: int,
    d_v: int,
    absorbed: bool,
) -> int:
    """Flops of the attention step of one latent-attention layer for ``n``
    queries over ``n_k`` positions (matrix products; the softmax is not
    counted)."""
    n, n_k, h, d_c, d_nope, d_v = (
        _validate.positive_int(name, value)
        for name, value in (
            ("n", n),
            ("n_k", n_k),
            ("n_heads", n_heads),
            ("d_latent", d_latent),
            ("d_nope", d_nope),
            ("d_v", d_v),
        )
    )
    d_r = _validate.nonnegative_int("d_rope", d_rope)
    if absorbed:
        # W_UK^T q and W_UV o per query and head, then scores and sums over
        # the latents
        return 2 * n * h * d_c * (d_nope + d_v) + 2 * n * n_k * h * (
            2 * d_c + d_r
        )
    # W_UK c and W_UV c per position and head, then ordinary attention
    return 2 * n_k * h * d_c * (d_nope + d_v) + 2 * n * n_k * h * (
        d_nope + d_r + d_v
    )


def crossover_queries(n_k: int, d_latent: int, d_nope: int, d_v: int) -> float:
    """The number of queries ``n`` over ``n_k`` positions at which both paths
    cost the same flops; below it the absorbed path is cheaper.

    Setting the two counts of :func:`mla_attention_flops` equal: ``n = n_k d_c
    (d_nope + d_v) / (d_c (d_nope + d_v) + n_k (2 d_c - d_nope - d_v))``,
    which tends to ``d_c (d_nope + d_v) / (2 d_c - d_nope - d_v)`` for long
    contexts. Infinite when ``2 d_c <= d_nope + d_v``: a score over latents
    then costs no more than one over keys, and the absorbed path is never
    dearer.
    """
    n_k = _validate.positive_int("n_k", n_k)
    d_c = _validate.positive_int("d_latent", d_latent)
    d_nope = _validate.positive_int("d_nope", d_nope)
    d_v = _validate.positive_int("d_v", d_v)
    per_position, per_score = d_c * (d_nope + d_v), 2 * d_c - d_nope - d_v
    if per_score <= 0:
        return float("inf")
    return n_k * per_position / (per_position + n_k * per_score)


def mla_decode_bytes(
    n_k: int,
    n_heads: int,
    d_latent: int,
    d_rope: int,
    d_nope: int,
    d_v: int,
    absorbed: bool,
    bytes_per_element: float = 2,
    batch: int = 1,
    include_weights: bool = False,
) -> float:
    """Bytes one decoding step moves through memory for the attention of
    ``batch`` sequences, each over its own ``n_k`` cached positions.

    Per sequence, absorbed: its cache is read once, ``n_k (d_c + d_R)``
    numbers. Decompressed: the cache is read, and every head's keys and
    values are written and read back, ``n_k h (d_nope + d_R + d_v)`` numbers
    each way. With ``include_weights``, add the up-projections ``W_UK`` and
    ``W_UV`` of every head, ``h d_c (d_nope + d_v)`` numbers, which either
    path must read, once per step whatever the batch. The projections of the
    new tokens (queries, latents, output), which both paths share, are left
    out, as in :func:`mla_attention_flops`.
    """
    n_k = _validate.positive_int("n_k", n_k)
    batch = _validate.positive_int("batch", batch)
    cache = n_k * (d_latent + d_rope)
    if not absorbed:
        cache += 2 * n_k * n_heads * (d_nope + d_rope + d_v)
    weights = n_heads * d_latent * (d_nope + d_v) if include_weights else 0
    return (batch * cache + weights) * bytes_per_element
