"""The device code of chapter 10's FlashAttention: every ``@triton.jit``
function, and the constants they read.

The algorithm is chapter 9's: attention computed tile by tile with an online
softmax, so that the ``n_q x n_k`` score matrix never exists in memory. Here it
is written for a GPU, in Triton (Tillet et al. 2019). A Triton kernel describes
what ONE *program* does to a few tiles; the GPU runs a grid of such programs in
parallel, one per block of query rows (forward) or of key rows (backward). The
host side that launches them is :mod:`attnbook.kernels.host`; the launch
configurations are :mod:`attnbook.kernels.launch`'s;
:mod:`attnbook.kernels.registry` lists the kernels for the resource table
(:mod:`attnbook.kernels.resources`), whose cache is keyed on this module's
device code (every ``@triton.jit`` function and the constants they read).

Layout: ``q (batch, heads, n_q, d)``, ``k`` and ``v (batch, n_kv_heads, n_k,
d)`` with ``heads`` a multiple of ``n_kv_heads`` (grouped-query attention:
query head ``h`` reads key/value head ``h // (heads // n_kv_heads)``, never a
repeated copy). Any strides whose last one is 1 are read in place. Causal
attention follows the book's convention (:func:`attnbook.causal_mask`): the
queries are the *last* ``n_q`` of the ``n_k`` positions, so query ``i`` may
attend to key ``j`` exactly when ``j <= i + (n_k - n_q)``.
"""

from __future__ import annotations

from .interpreter import tl, triton

#: log2(e): the kernels exponentiate in base 2 (``exp(x) = exp2(x * LOG2E)``),
#: as the GPU's unit does.
LOG2E = tl.constexpr(1.4426950408889634)
#: ln(2): a base-2 log-sum-exp times LN2 is the natural one that the kernels
#: store.
LN2 = tl.constexpr(0.6931471805599453)


# ---------------------------------------------------------------------------
# Device-side helpers, shared by the kernels
# ---------------------------------------------------------------------------


@triton.jit
def may_attend(q_idx, k_idx, n_k, causal_offset, CAUSAL: tl.constexpr):
    """(BLOCK_Q, BLOCK_K) booleans: may query row q_idx[i] attend to key row
    k_idx[j]?

    A key past the end of the sequence (the ragged last block) never may; with
    CAUSAL, query i sits at absolute position i + causal_offset and sees keys
    up to and including that position.
    """
    ok = k_idx[None, :] < n_k
    if CAUSAL:
        ok = ok & (k_idx[None, :] <= q_idx[:, None] + causal_offset)
    return ok


@triton.jit
def key_range(
    q_block,
    n_q,
    n_k,
    CAUSAL: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Which keys query block ``q_block`` must visit: ``(full_end, end)``.

    Keys ``[0, full_end)`` come in whole blocks that every query of the block
    may see: no mask needed. Keys ``[full_end, end)`` are visited with a mask
    (the ragged last block, the blocks that straddle the causal diagonal).
    Keys from ``end`` on are hidden from every query of the block: with CAUSAL
    the kernel never loads them (causal block skipping).
    """
    if CAUSAL:
        causal_offset = n_k - n_q
        # absolute position of the block's first row
        first_query = q_block * BLOCK_Q + causal_offset
        # one past the last row's last visible key
        end = tl.minimum(first_query + BLOCK_Q, n_k)
        full_end = tl.minimum(first_query + 1, n_k) // BLOCK_K * BLOCK_K
    else:
        end = n_k
        full_end = n_k // BLOCK_K * BLOCK_K
    return full_end, end


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


@triton.jit
def forward_step(
    acc,
    row_sum,
    row_max,
    q,
    K,
    V,
    stride_kn,
    stride_vn,
    key_start,
    q_idx,
    d_idx,
    n_k,
    causal_offset,
    scale2,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    D_HEAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold one block of keys into the running softmax of one block of queries.

    acc (BLOCK_Q, BLOCK_D), row_sum and row_max (BLOCK_Q,) live in registers,
    in float32; the function returns their updated values. Scores are kept in
    base-2 units: ``scale2 = scale * log2(e)``, so ``exp(scale * s) =
    exp2(scale2 * s)`` and row_max is a maximum of base-2 scores.
    """
    # (BLOCK_K,) key rows of this tile
    k_idx = key_start + tl.arange(0, BLOCK_K)
    # Load mask: rows past n_k and columns past D_HEAD (the padding of the
    # head dimension up to a power of two) read 0 instead of foreign memory.
    tile_ok = (k_idx[:, None] < n_k) & (d_idx[None, :] < D_HEAD)
    # row k_idx, column d_idx of my head: rows stride_n apart, columns adjacent
    # (BLOCK_K, BLOCK_D)
    k = tl.load(
        K + k_idx[:, None] * stride_kn + d_idx[None, :],
        mask=tile_ok,
        other=0.0,
    )
    # (BLOCK_K, BLOCK_D)
    v = tl.load(
        V + k_idx[:, None] * stride_vn + d_idx[None, :],
        mask=tile_ok,
        other=0.0,
    )

    # Scores of this tile, accumulated in float32 by the matrix unit, in base-2
    # units: the GPU's exponential unit computes 2**x, so exp(x) needs a
    # multiply by log2(e) per entry, folded here into the scale. The scaled
    # tile is kept (the mask and the maximum read it), so each score costs one
    # multiply and, below, one subtraction: not one fused multiply-add.
    # (Triton's tutorial keeps the raw scores and scales the row maximum
    # instead, which lets s * scale2 - m fuse into one FMA.) (BLOCK_Q, BLOCK_K)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale2
    if MASKED:  # score mask: -inf becomes a weight of exactly 0 below
        s = tl.where(
            may_attend(q_idx, k_idx, n_k, causal_offset, CAUSAL),
            s,
            float("-inf"),
        )

    # The online softmax (chapter 9). The first block visited always contains
    # a visible key for every row (key 0 is visible to every query), so
    # new_max is finite from then on and no exp(-inf - (-inf)) = NaN can occur.
    # (BLOCK_Q,)
    new_max = tl.maximum(row_max, tl.max(s, axis=1))
    # rescales the old sums; 0 at the start
    correction = tl.exp2(row_max - new_max)
    # (BLOCK_Q, BLOCK_K), entries in [0, 1]
    p = tl.exp2(s - new_max[:, None])
    row_sum = row_sum * correction + tl.sum(p, axis=1)
    # p goes back to the input precision (float16 on the tensor cores), the sum
    # stays float32.
    acc = acc * correction[:, None] + tl.dot(
        p.to(v.dtype), v, input_precision=DOT_PRECISION
    )
    return acc, row_sum, new_max


@triton.jit
def flash_forward_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    n_q,
    n_k,
    scale,
    n_heads,
    group,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    CAUSAL: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    D_HEAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: BLOCK_Q query rows of one (batch, head); writes their
    output rows and log-sum-exps.

    Q, O: (batch, n_heads, n_q, D_HEAD); K, V: (batch, n_heads // group, n_k,
    D_HEAD), any strides with adjacent columns (O has Q's strides); LSE:
    (batch, n_heads, n_q) float32, contiguous. Query head h reads key/value
    head h // group (grouped-query attention; group 1 is ordinary multi-head
    attention). The grid is (cdiv(n_q, BLOCK_Q), batch * n_heads).
    """
    # -- Which tile is mine? Axis 0 of the grid counts query blocks, axis 1
    # (batch, head) pairs.
    q_block = tl.program_id(0)
    # int64: offsets such as b * stride_qb can pass 2**31
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // n_heads, bh % n_heads
    # the key/value head my query head shares with its group
    kv_h = h // group

    # -- Pointer arithmetic. A pointer plus an integer tensor is a tensor of
    # pointers. Element (b, h, i, j) of a tensor with strides (stride_b,
    # stride_h, stride_n, 1) is at b*stride_b + h*stride_h + i*stride_n + j:
    # move each base to the first row of my head, then index rows and columns
    # from there.
    Q += b * stride_qb + h * stride_qh
    O += b * stride_qb + h * stride_qh
    K += b * stride_kb + kv_h * stride_kh
    V += b * stride_vb + kv_h * stride_vh
    LSE += bh * n_q

    # (BLOCK_Q,) my query rows
    q_idx = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    # (BLOCK_D,) feature columns, padded to a power of 2
    d_idx = tl.arange(0, BLOCK_D)
    q_offsets = q_idx[:, None] * stride_qn + d_idx[None, :]
    # Load mask: the last query block may hang past n_q; padded rows read 0 and
    # are never stored.
    q_ok = (q_idx[:, None] < n_q) & (d_idx[None, :] < D_HEAD)
    # (BLOCK_Q, BLOCK_D), stays in registers
    q = tl.load(Q + q_offsets, mask=q_ok, other=0.0)

    # -- The running softmax state of my rows, in float32 registers.
    row_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)

    # -- Walk over the key blocks: unmasked ones first, then the few that need
    # a mask. With CAUSAL, blocks after `end` are skipped altogether.
    causal_offset = n_k - n_q
    # scores in base-2 units
    scale2 = scale * LOG2E
    full_end, end = key_range(q_block, n_q, n_k, CAUSAL, BLOCK_Q, BLOCK_K)
    for key_start in range(0, full_end, BLOCK_K):
        acc, row_sum, row_max = forward_step(
            acc,
            row_sum,
            row_max,
            q,
            K,
            V,
            stride_kn,
            stride_vn,
            key_start,
            q_idx,
            d_idx,
            n_k,
            causal_offset,
            scale2,
            False,
            CAUSAL,
            BLOCK_K,
            D_HEAD,
            DOT_PRECISION,
        )
    for key_start in range(full_end, end, BLOCK_K):
        acc, row_sum, row_max = forward_step(
            acc,
            row_sum,
            row_max,
            q,
            K,
            V,
            stride_kn,
            stride_vn,
            key_start,
            q_idx,
            d_idx,
            n_k,
            causal_offset,
            scale2,
            True,
            CAUSAL,
            BLOCK_K,
            D_HEAD,
            DOT_PRECISION,
        )

    # -- Normalise once at the end, and store. The backward pass needs only the
    # log-sum-exp of each row, max + log(sum), to rebuild any probability; it
    # is stored in natural units (base 2 times ln 2), as torch.logsumexp gives
    # it.
    out = acc / row_sum[:, None]
    tl.store(O + q_offsets, out.to(O.dtype.element_ty), mask=q_ok)
    tl.store(LSE + q_idx, (row_max + tl.log2(row_sum)) * LN2, mask=q_idx < n_q)


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------


@triton.jit
def backward_preprocess_kernel(
    O,
    DO,
    DELTA,
    n_q,
    n_heads,
    stride_ob,
    stride_oh,
    stride_on,
    stride_dob,
    stride_doh,
    stride_don,
    BLOCK_Q: tl.constexpr,
    D_HEAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """delta_i = sum_j dO_ij * O_ij for BLOCK_Q rows of one (batch, head);
    DELTA: (batch, n_heads, n_q)."""
    q_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // n_heads, bh % n_heads
    O += b * stride_ob + h * stride_oh
    DO += b * stride_dob + h * stride_doh
    DELTA += bh * n_q
    q_idx = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d_idx = tl.arange(0, BLOCK_D)
    ok = (q_idx[:, None] < n_q) & (d_idx[None, :] < D_HEAD)
    o = tl.load(
        O + q_idx[:, None] * stride_on + d_idx[None, :], mask=ok, other=0.0
    ).to(tl.float32)
    do = tl.load(
        DO + q_idx[:, None] * stride_don + d_idx[None, :], mask=ok, other=0.0
    ).to(tl.float32)
    tl.store(DELTA + q_idx, tl.sum(o * do, axis=1), mask=q_idx < n_q)


@triton.jit
def dkdv_step(
    dk,
    dv,
    k,
    v,
    Q,
    DO,
    LSE,
    DELTA,
    stride_qn,
    stride_don,
    query_start,
    k_idx,
    d_idx,
    n_q,
    n_k,
    causal_offset,
    scale,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    D_HEAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Add one block of queries' contributions to dK and dV of one block of
    keys."""
    q_idx = query_start + tl.arange(0, BLOCK_Q)
    tile_ok = (q_idx[:, None] < n_q) & (d_idx[None, :] < D_HEAD)
    # (BLOCK_Q, BLOCK_D)
    q = tl.load(
        Q + q_idx[:, None] * stride_qn + d_idx[None, :],
        mask=tile_ok,
        other=0.0,
    )
    # (BLOCK_Q, BLOCK_D)
    do = tl.load(
        DO + q_idx[:, None] * stride_don + d_idx[None, :],
        mask=tile_ok,
        other=0.0,
    )
    # A padded query row (past n_q) loads q = 0, dO = 0, lse = 0 and delta = 0:
    # its p = exp(0) = 1 is finite, and it adds p * 0 to dV and
    # p * (0 - 0) = 0 to dK. So padded queries need no score mask here.
    lse = tl.load(LSE + q_idx, mask=q_idx < n_q, other=0.0) * LOG2E
    delta = tl.load(DELTA + q_idx, mask=q_idx < n_q, other=0.0)

    # Recompute this tile of probabilities from the saved log-sum-exp, in
    # base-2 units as in the forward pass (lse here is already times log2(e)).
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (scale * LOG2E)
    p = tl.exp2(s - lse[:, None])
    if MASKED:
        p = tl.where(
            may_attend(q_idx, k_idx, n_k, causal_offset, CAUSAL), p, 0.0
        )

    # dV += P^T dO
    dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=DOT_PRECISION)
    # dP = dO V^T
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    # dS = P * (dP - delta)
    ds = p * (dp - delta[:, None])
    # dK += dS^T Q (times scale, later)
    dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def flash_backward_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    n_q,
    n_k,
    scale,
    n_kv_heads,
    group,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_don,
    CAUSAL: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    D_HEAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: dK and dV for BLOCK_K key rows of one (batch, key/value
    head). Grid (cdiv(n_k, BLOCK_K), batch * n_kv_heads).

    Each program owns its rows of dK and dV, so no two programs write the same
    memory: the sums over queries happen in registers, without atomics. With
    grouped-query attention (group > 1) the key/value head serves `group` query
    heads, and the program sums over all of them: dK and dV of a shared head
    are the sums of what each of its query heads sends back. DK and DV have K's
    and V's strides.
    """
    k_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, kv_h = bh // n_kv_heads, bh % n_kv_heads
    K += b * stride_kb + kv_h * stride_kh
    V += b * stride_vb + kv_h * stride_vh
    DK += b * stride_kb + kv_h * stride_kh
    DV += b * stride_vb + kv_h * stride_vh

    k_idx = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    d_idx = tl.arange(0, BLOCK_D)
    k_ok = (k_idx[:, None] < n_k) & (d_idx[None, :] < D_HEAD)
    # stays in registers
    k = tl.load(
        K + k_idx[:, None] * stride_kn + d_idx[None, :], mask=k_ok, other=0.0
    )
    v = tl.load(
        V + k_idx[:, None] * stride_vn + d_idx[None, :], mask=k_ok, other=0.0
    )
    dk = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)

    # Which query blocks see my keys? Without CAUSAL, all of them, unmasked.
    # With CAUSAL, query i sees key j when i >= j - causal_offset: queries
    # before my first key's first viewer are skipped; from `full_start` on,
    # every query of a block sees all my keys; in between, a mask is needed.
    causal_offset = n_k - n_q
    if CAUSAL:
        first_key = k_block * BLOCK_K
        start = tl.maximum(first_key - causal_offset, 0) // BLOCK_Q * BLOCK_Q
        full_start = (
            tl.cdiv(
                tl.maximum(first_key + BLOCK_K - 1 - causal_offset, 0), BLOCK_Q
            )
            * BLOCK_Q
        )
        # (past the last query block there is nothing to read: stop there)
        full_start = tl.minimum(full_start, tl.cdiv(n_q, BLOCK_Q) * BLOCK_Q)
    else:
        start = 0
        full_start = 0
    # the query heads that share my key/value head
    for g in range(group):
        h = kv_h * group + g
        Q_h = Q + b * stride_qb + h * stride_qh
        DO_h = DO + b * stride_dob + h * stride_doh
        LSE_h = LSE + (b * n_kv_heads * group + h) * n_q
        DELTA_h = DELTA + (b * n_kv_heads * group + h) * n_q
        for query_start in range(start, full_start, BLOCK_Q):
            dk, dv = dkdv_step(
                dk,
                dv,
                k,
                v,
                Q_h,
                DO_h,
                LSE_h,
                DELTA_h,
                stride_qn,
                stride_don,
                query_start,
                k_idx,
                d_idx,
                n_q,
                n_k,
                causal_offset,
                scale,
                True,
                CAUSAL,
                BLOCK_Q,
                D_HEAD,
                DOT_PRECISION,
            )
        for query_start in range(full_start, n_q, BLOCK_Q):
            dk, dv = dkdv_step(
                dk,
                dv,
                k,
                v,
                Q_h,
                DO_h,
                LSE_h,
                DELTA_h,
                stride_qn,
                stride_don,
                query_start,
                k_idx,
                d_idx,
                n_q,
                n_k,
                causal_offset,
                scale,
                False,
                CAUSAL,
                BLOCK_Q,
                D_HEAD,
                DOT_PRECISION,
            )

    # S = scale * Q K^T, so dK = scale * dS^T Q: the scale is applied once,
    # here.
    tl.store(
        DK + k_idx[:, None] * stride_kn + d_idx[None, :],
        (dk * scale).to(DK.dtype.element_ty),
        mask=k_ok,
    )
    tl.store(
        DV + k_idx[:, None] * stride_vn + d_idx[None, :],
        dv.to(DV.dtype.element_ty),
        mask=k_ok,
    )


@triton.jit
def dq_step(
    dq,
    q,
    do,
    lse,
    delta,
    K,
    V,
    stride_kn,
    stride_vn,
    key_start,
    q_idx,
    d_idx,
    n_k,
    causal_offset,
    scale,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    D_HEAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Add one block of keys' contribution to dQ of one block of queries."""
    k_idx = key_start + tl.arange(0, BLOCK_K)
    tile_ok = (k_idx[:, None] < n_k) & (d_idx[None, :] < D_HEAD)
    k = tl.load(
        K + k_idx[:, None] * stride_kn + d_idx[None, :],
        mask=tile_ok,
        other=0.0,
    )
    v = tl.load(
        V + k_idx[:, None] * stride_vn + d_idx[None, :],
        mask=tile_ok,
        other=0.0,
    )

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (scale * LOG2E)
    # lse in base-2 units
    p = tl.exp2(s - lse[:, None])
    if MASKED:
        p = tl.where(
            may_attend(q_idx, k_idx, n_k, causal_offset, CAUSAL), p, 0.0
        )
    # dP = dO V^T
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    # dQ += dS K (times scale, later)
    dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def flash_backward_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    n_q,
    n_k,
    scale,
    n_heads,
    group,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_don,
    CAUSAL: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    D_HEAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: dQ for BLOCK_Q query rows of one (batch, head). Grid
    (cdiv(n_q, BLOCK_Q), batch * n_heads).

    It visits the same key blocks as the forward program of the same rows, in
    the key/value head its query head shares (h // group). DQ has Q's strides.
    """
    q_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // n_heads, bh % n_heads
    kv_h = h // group
    Q += b * stride_qb + h * stride_qh
    DQ += b * stride_qb + h * stride_qh
    DO += b * stride_dob + h * stride_doh
    K += b * stride_kb + kv_h * stride_kh
    V += b * stride_vb + kv_h * stride_vh
    LSE += bh * n_q
    DELTA += bh * n_q

    q_idx = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d_idx = tl.arange(0, BLOCK_D)
    q_offsets = q_idx[:, None] * stride_qn + d_idx[None, :]
    q_ok = (q_idx[:, None] < n_q) & (d_idx[None, :] < D_HEAD)
    q = tl.load(Q + q_offsets, mask=q_ok, other=0.0)
    do = tl.load(
        DO + q_idx[:, None] * stride_don + d_idx[None, :], mask=q_ok, other=0.0
    )
    # base-2 units, as the scores in dq_step; padded rows: finite, never stored
    lse = tl.load(LSE + q_idx, mask=q_idx < n_q, other=0.0) * LOG2E
    delta = tl.load(DELTA + q_idx, mask=q_idx < n_q, other=0.0)
    dq = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)

    causal_offset = n_k - n_q
    full_end, end = key_range(q_block, n_q, n_k, CAUSAL, BLOCK_Q, BLOCK_K)
    for key_start in range(0, full_end, BLOCK_K):
        dq = dq_step(
            dq,
            q,
            do,
            lse,
            delta,
            K,
            V,
            stride_kn,
            stride_vn,
            key_start,
            q_idx,
            d_idx,
            n_k,
            causal_offset,
            scale,
            False,
            CAUSAL,
            BLOCK_K,
            D_HEAD,
            DOT_PRECISION,
        )
    for key_start in range(full_end, end, BLOCK_K):
        dq = dq_step(
            dq,
            q,
            do,
            lse,
            delta,
            K,
            V,
            stride_kn,
            stride_vn,
            key_start,
            q_idx,
            d_idx,
            n_k,
            causal_offset,
            scale,
            True,
            CAUSAL,
            BLOCK_K,
            D_HEAD,
            DOT_PRECISION,
        )
    tl.store(DQ + q_offsets, (dq * scale).to(DQ.dtype.element_ty), mask=q_ok)


# ---------------------------------------------------------------------------
# Decoding: the keys split across programs (Flash-Decoding)
# ---------------------------------------------------------------------------


@triton.jit
def flash_decode_split_kernel(
    Q,
    K,
    V,
    O_PART,
    LSE_PART,
    n_q,
    n_k,
    scale,
    n_heads,
    group,
    n_rows,
    split_len,
    n_splits,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    CAUSAL: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    D_HEAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: one query block of one (batch, head) against ONE split of
    the keys.

    The forward kernel gives a program all the keys of its query block; when
    there are few query rows (decoding: n_q = 1) that is a handful of programs
    for a GPU with 100 SMs. Here the keys are cut into ``n_splits`` runs of
    ``split_len`` (a multiple of BLOCK_K), and each program writes the softmax
    state of its run: its output normalised over the run, O_PART (n_splits,
    n_rows, n_q, D_HEAD) float32, and the run's log-sum-exp, LSE_PART
    (n_splits, n_rows, n_q), ``n_rows = batch * n_heads``. :func:`merge_splits`
    then combines the runs with chapter 9's merge. Grid (cdiv(n_q, BLOCK_Q) *
    n_splits, batch * n_heads).
    """
    # -- Which tile is mine: a query block and a run of keys, of one (batch,
    # head).
    q_block, split = tl.program_id(0) // n_splits, tl.program_id(0) % n_splits
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // n_heads, bh % n_heads
    kv_h = h // group
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + kv_h * stride_kh
    V += b * stride_vb + kv_h * stride_vh
    # my rows of the partial results
    part = (split * n_rows + bh) * n_q
    O_PART += part * D_HEAD
    LSE_PART += part

    q_idx = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d_idx = tl.arange(0, BLOCK_D)
    q_ok = (q_idx[:, None] < n_q) & (d_idx[None, :] < D_HEAD)
    q = tl.load(
        Q + q_idx[:, None] * stride_qn + d_idx[None, :], mask=q_ok, other=0.0
    )

    # -- The running state starts at a finite, hugely negative maximum, not
    # -inf: unlike the forward's first block, a run may hold no key that a row
    # may see (causal rows before the run starts), and exp2(-inf - (-inf))
    # would be NaN. No base-2 score comes near -1e30.
    row_max = tl.full([BLOCK_Q], -1e30, tl.float32)
    row_sum = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)

    causal_offset = n_k - n_q
    scale2 = scale * LOG2E
    # causal: later keys hidden from all rows
    _, end = key_range(q_block, n_q, n_k, CAUSAL, BLOCK_Q, BLOCK_K)
    start = split * split_len
    stop = tl.minimum(start + split_len, end)
    # every tile masked: a run's first rows may see none of it, and its last
    # tile may pass n_k
    for key_start in range(start, stop, BLOCK_K):
        acc, row_sum, row_max = forward_step(
            acc,
            row_sum,
            row_max,
            q,
            K,
            V,
            stride_kn,
            stride_vn,
            key_start,
            q_idx,
            d_idx,
            n_k,
            causal_offset,
            scale2,
            True,
            CAUSAL,
            BLOCK_K,
            D_HEAD,
            DOT_PRECISION,
        )

    # -- The run's state as an output and a log-sum-exp (natural units). A row
    # that saw nothing here has the empty state: output 0 and log-sum-exp -inf,
    # a weight of exactly 0 in the merge.
    seen = row_sum > 0
    out = tl.where(
        seen[:, None], acc / tl.where(seen, row_sum, 1.0)[:, None], 0.0
    )
    lse = tl.where(
        seen,
        (row_max + tl.log2(tl.where(seen, row_sum, 1.0))) * LN2,
        float("-inf"),
    )
    tl.store(O_PART + q_idx[:, None] * D_HEAD + d_idx[None, :], out, mask=q_ok)
    tl.store(LSE_PART + q_idx, lse, mask=q_idx < n_q)
