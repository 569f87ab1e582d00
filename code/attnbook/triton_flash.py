"""FlashAttention as a Triton kernel: forward, backward, and an autograd Function (chapter 10).

The algorithm is chapter 9's: attention computed tile by tile with an online
softmax, so that the ``n_q x n_k`` score matrix never exists in memory. Here it
is written for a GPU, in Triton (Tillet et al. 2019). A Triton kernel describes
what ONE *program* does to a few tiles; the GPU runs a grid of such programs in
parallel, one per block of query rows (forward) or of key rows (backward).

Layout: ``q (batch, heads, n_q, d)``, ``k`` and ``v (batch, kv_heads, n_k, d)`` with ``heads`` a
multiple of ``kv_heads`` (grouped-query attention: query head ``h`` reads key/value head
``h // (heads // kv_heads)``, never a repeated copy). Any strides whose last one is 1 are read in
place: a (batch, n, heads, d) tensor passed as ``x.transpose(1, 2)`` is not copied.
Causal attention follows the book's convention (:func:`attnbook.causal_mask`):
the queries are the *last* ``n_q`` of the ``n_k`` positions, so query ``i``
may attend to key ``j`` exactly when ``j <= i + (n_k - n_q)``.

Without a CUDA GPU the kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``), which executes every program with numpy on CPU
tensors: the same kernel code, only slow. See :func:`use_interpreter_without_cuda`.
"""
from __future__ import annotations

import math
import os

import torch


def use_interpreter_without_cuda() -> bool:
    """Without a CUDA GPU, ask Triton to interpret its kernels on the CPU.

    Triton consults ``TRITON_INTERPRET`` each time ``@triton.jit`` turns a Python
    function into a kernel: its own library functions (``tl.zeros``, ``tl.sum``,
    ...) when ``triton`` is first imported, this module's kernels when this
    module is imported. Both must agree, so the variable has to be set before
    the first ``import triton`` in the process; this function runs before ours.
    ``setdefault`` keeps a value the user set on purpose. Returns whether the
    variable asks for the interpreter.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


use_interpreter_without_cuda()

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
except ImportError as err:  # pragma: no cover - triton ships with torch's CUDA wheels
    # (attnbook is not on PyPI, so an install hint must name a package that is: triton itself)
    raise ImportError(
        "attnbook.triton_flash needs Triton: `pip install triton` (Linux). Without a GPU its "
        "interpreter runs the kernels on the CPU, as on Colab's CPU runtime"
    ) from err


# ---------------------------------------------------------------------------
# Device-side helpers, shared by the kernels
# ---------------------------------------------------------------------------

@triton.jit
def may_attend(q_idx, k_idx, n_k, causal_offset, CAUSAL: tl.constexpr):
    """(BLOCK_Q, BLOCK_K) booleans: may query row q_idx[i] attend to key row k_idx[j]?

    A key past the end of the sequence (the ragged last block) never may; with
    CAUSAL, query i sits at absolute position i + causal_offset and sees keys
    up to and including that position.
    """
    ok = k_idx[None, :] < n_k
    if CAUSAL:
        ok = ok & (k_idx[None, :] <= q_idx[:, None] + causal_offset)
    return ok


@triton.jit
def key_range(q_block, n_q, n_k, CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """Which keys query block ``q_block`` must visit: ``(full_end, end)``.

    Keys ``[0, full_end)`` come in whole blocks that every query of the block
    may see: no mask needed. Keys ``[full_end, end)`` are visited with a mask
    (the ragged last block, the blocks that straddle the causal diagonal).
    Keys from ``end`` on are hidden from every query of the block: with CAUSAL
    the kernel never loads them (causal block skipping).
    """
    if CAUSAL:
        causal_offset = n_k - n_q
        first_query = q_block * BLOCK_Q + causal_offset      # absolute position of the block's first row
        end = tl.minimum(first_query + BLOCK_Q, n_k)          # one past the last row's last visible key
        full_end = tl.minimum(first_query + 1, n_k) // BLOCK_K * BLOCK_K
    else:
        end = n_k
        full_end = n_k // BLOCK_K * BLOCK_K
    return full_end, end


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------

@triton.jit
def forward_step(acc, row_sum, row_max, q, K, V, stride_kn, stride_vn, key_start, q_idx, d_idx, n_k,
                  causal_offset, scale2, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_K: tl.constexpr,
                  D_HEAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one block of keys into the running softmax of one block of queries.

    acc (BLOCK_Q, BLOCK_D), row_sum and row_max (BLOCK_Q,) live in registers,
    in float32; the function returns their updated values. Scores are kept in
    base-2 units: ``scale2 = scale * log2(e)``, so ``exp(scale * s) = exp2(scale2 * s)``
    and row_max is a maximum of base-2 scores.
    """
    k_idx = key_start + tl.arange(0, BLOCK_K)                       # (BLOCK_K,) key rows of this tile
    # Load mask: rows past n_k and columns past D_HEAD (the padding of the
    # head dimension up to a power of two) read 0 instead of foreign memory.
    tile_ok = (k_idx[:, None] < n_k) & (d_idx[None, :] < D_HEAD)
    # row k_idx, column d_idx of my head: rows stride_n apart, columns adjacent
    k = tl.load(K + k_idx[:, None] * stride_kn + d_idx[None, :], mask=tile_ok, other=0.0)  # (BLOCK_K, BLOCK_D)
    v = tl.load(V + k_idx[:, None] * stride_vn + d_idx[None, :], mask=tile_ok, other=0.0)  # (BLOCK_K, BLOCK_D)

    # Scores of this tile, accumulated in float32 by the matrix unit, in base-2 units: the GPU's
    # exponential unit computes 2**x, so exp(x) needs a multiply by log2(e) per entry, folded here
    # into the scale. The scaled tile is kept (the mask and the maximum read it), so each score
    # costs one multiply and, below, one subtraction: not one fused multiply-add. (Triton's
    # tutorial keeps the raw scores and scales the row maximum instead, which lets s * scale2 - m
    # fuse into one FMA.)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale2  # (BLOCK_Q, BLOCK_K)
    if MASKED:  # score mask: -inf becomes a weight of exactly 0 below
        s = tl.where(may_attend(q_idx, k_idx, n_k, causal_offset, CAUSAL), s, float("-inf"))

    # The online softmax (chapter 9). The first block visited always contains
    # a visible key for every row (key 0 is visible to every query), so
    # new_max is finite from then on and no exp(-inf - (-inf)) = NaN can occur.
    new_max = tl.maximum(row_max, tl.max(s, axis=1))                 # (BLOCK_Q,)
    correction = tl.exp2(row_max - new_max)                          # rescales the old sums; 0 at the start
    p = tl.exp2(s - new_max[:, None])                                 # (BLOCK_Q, BLOCK_K), entries in [0, 1]
    row_sum = row_sum * correction + tl.sum(p, axis=1)
    # p goes back to the input precision (float16 on the tensor cores), the sum stays float32.
    acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, row_sum, new_max


@triton.jit
def flash_forward_kernel(Q, K, V, O, LSE, n_q, n_k, scale, n_heads, group,
                          stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                          stride_vb, stride_vh, stride_vn,
                          CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                          D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program: BLOCK_Q query rows of one (batch, head); writes their output rows and log-sum-exps.

    Q, O: (batch, n_heads, n_q, D_HEAD); K, V: (batch, n_heads // group, n_k, D_HEAD), any strides
    with adjacent columns (O has Q's strides); LSE: (batch, n_heads, n_q) float32, contiguous.
    Query head h reads key/value head h // group (grouped-query attention; group 1 is ordinary
    multi-head attention). The grid is (cdiv(n_q, BLOCK_Q), batch * n_heads).
    """
    # -- Which tile is mine? Axis 0 of the grid counts query blocks, axis 1 (batch, head) pairs.
    q_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64: offsets such as b * stride_qb can pass 2**31
    b, h = bh // n_heads, bh % n_heads
    kv_h = h // group                   # the key/value head my query head shares with its group

    # -- Pointer arithmetic. A pointer plus an integer tensor is a tensor of
    # pointers. Element (b, h, i, j) of a tensor with strides (stride_b, stride_h,
    # stride_n, 1) is at b*stride_b + h*stride_h + i*stride_n + j: move each base
    # to the first row of my head, then index rows and columns from there.
    Q += b * stride_qb + h * stride_qh
    O += b * stride_qb + h * stride_qh
    K += b * stride_kb + kv_h * stride_kh
    V += b * stride_vb + kv_h * stride_vh
    LSE += bh * n_q

    q_idx = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)   # (BLOCK_Q,) my query rows
    d_idx = tl.arange(0, BLOCK_D)                        # (BLOCK_D,) feature columns, padded to a power of 2
    q_offsets = q_idx[:, None] * stride_qn + d_idx[None, :]
    # Load mask: the last query block may hang past n_q; padded rows read 0 and are never stored.
    q_ok = (q_idx[:, None] < n_q) & (d_idx[None, :] < D_HEAD)
    q = tl.load(Q + q_offsets, mask=q_ok, other=0.0)    # (BLOCK_Q, BLOCK_D), stays in registers

    # -- The running softmax state of my rows, in float32 registers.
    row_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)

    # -- Walk over the key blocks: unmasked ones first, then the few that need
    # a mask. With CAUSAL, blocks after `end` are skipped altogether.
    causal_offset = n_k - n_q
    scale2 = scale * 1.4426950408889634                  # scale * log2(e): scores in base-2 units
    full_end, end = key_range(q_block, n_q, n_k, CAUSAL, BLOCK_Q, BLOCK_K)
    for key_start in range(0, full_end, BLOCK_K):
        acc, row_sum, row_max = forward_step(acc, row_sum, row_max, q, K, V, stride_kn, stride_vn, key_start,
                                              q_idx, d_idx, n_k, causal_offset, scale2, False, CAUSAL, BLOCK_K,
                                              D_HEAD, DOT_PRECISION)
    for key_start in range(full_end, end, BLOCK_K):
        acc, row_sum, row_max = forward_step(acc, row_sum, row_max, q, K, V, stride_kn, stride_vn, key_start,
                                              q_idx, d_idx, n_k, causal_offset, scale2, True, CAUSAL, BLOCK_K,
                                              D_HEAD, DOT_PRECISION)

    # -- Normalise once at the end, and store. The backward pass needs only the
    # log-sum-exp of each row, max + log(sum), to rebuild any probability; it is
    # stored in natural units (base 2 times ln 2), as torch.logsumexp gives it.
    out = acc / row_sum[:, None]
    tl.store(O + q_offsets, out.to(O.dtype.element_ty), mask=q_ok)
    tl.store(LSE + q_idx, (row_max + tl.log2(row_sum)) * 0.6931471805599453, mask=q_idx < n_q)


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------

@triton.jit
def backward_preprocess_kernel(O, DO, DELTA, n_q, n_heads, stride_ob, stride_oh, stride_on,
                                stride_dob, stride_doh, stride_don, BLOCK_Q: tl.constexpr,
                                D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta_i = sum_j dO_ij * O_ij for BLOCK_Q rows of one (batch, head); DELTA: (batch, n_heads, n_q)."""
    q_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // n_heads, bh % n_heads
    O += b * stride_ob + h * stride_oh
    DO += b * stride_dob + h * stride_doh
    DELTA += bh * n_q
    q_idx = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d_idx = tl.arange(0, BLOCK_D)
    ok = (q_idx[:, None] < n_q) & (d_idx[None, :] < D_HEAD)
    o = tl.load(O + q_idx[:, None] * stride_on + d_idx[None, :], mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + q_idx[:, None] * stride_don + d_idx[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(DELTA + q_idx, tl.sum(o * do, axis=1), mask=q_idx < n_q)


@triton.jit
def dkdv_step(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qn, stride_don, query_start, k_idx, d_idx, n_q, n_k,
               causal_offset, scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
               D_HEAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add one block of queries' contributions to dK and dV of one block of keys."""
    q_idx = query_start + tl.arange(0, BLOCK_Q)
    tile_ok = (q_idx[:, None] < n_q) & (d_idx[None, :] < D_HEAD)
    q = tl.load(Q + q_idx[:, None] * stride_qn + d_idx[None, :], mask=tile_ok, other=0.0)     # (BLOCK_Q, BLOCK_D)
    do = tl.load(DO + q_idx[:, None] * stride_don + d_idx[None, :], mask=tile_ok, other=0.0)  # (BLOCK_Q, BLOCK_D)
    # A padded query row (past n_q) loads q = 0, dO = 0, lse = 0 and delta = 0:
    # its p = exp(0) = 1 is finite, and it adds p * 0 to dV and
    # p * (0 - 0) = 0 to dK. So padded queries need no score mask here.
    lse = tl.load(LSE + q_idx, mask=q_idx < n_q, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + q_idx, mask=q_idx < n_q, other=0.0)

    # Recompute this tile of probabilities from the saved log-sum-exp, in base-2
    # units as in the forward pass (lse here is already times log2(e)).
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (scale * 1.4426950408889634)
    p = tl.exp2(s - lse[:, None])
    if MASKED:
        p = tl.where(may_attend(q_idx, k_idx, n_k, causal_offset, CAUSAL), p, 0.0)

    dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=DOT_PRECISION)   # dV += P^T dO
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)                   # dP = dO V^T
    ds = p * (dp - delta[:, None])                                               # dS = P * (dP - delta)
    dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT_PRECISION)    # dK += dS^T Q (times scale, later)
    return dk, dv


@triton.jit
def flash_backward_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, n_q, n_k, scale, n_kv_heads, group,
                                stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                                stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                                CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                                D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
                                DOT_PRECISION: tl.constexpr):
    """One program: dK and dV for BLOCK_K key rows of one (batch, key/value head).
    Grid (cdiv(n_k, BLOCK_K), batch * n_kv_heads).

    Each program owns its rows of dK and dV, so no two programs write the same
    memory: the sums over queries happen in registers, without atomics. With
    grouped-query attention (group > 1) the key/value head serves `group` query
    heads, and the program sums over all of them: dK and dV of a shared head are
    the sums of what each of its query heads sends back. DK and DV have K's and
    V's strides.
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
    k = tl.load(K + k_idx[:, None] * stride_kn + d_idx[None, :], mask=k_ok, other=0.0)  # stays in registers
    v = tl.load(V + k_idx[:, None] * stride_vn + d_idx[None, :], mask=k_ok, other=0.0)
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
        full_start = tl.cdiv(tl.maximum(first_key + BLOCK_K - 1 - causal_offset, 0), BLOCK_Q) * BLOCK_Q
        # (past the last query block there is nothing to read: stop there)
        full_start = tl.minimum(full_start, tl.cdiv(n_q, BLOCK_Q) * BLOCK_Q)
    else:
        start = 0
        full_start = 0
    for g in range(group):                      # the query heads that share my key/value head
        h = kv_h * group + g
        Q_h = Q + b * stride_qb + h * stride_qh
        DO_h = DO + b * stride_dob + h * stride_doh
        LSE_h = LSE + (b * n_kv_heads * group + h) * n_q
        DELTA_h = DELTA + (b * n_kv_heads * group + h) * n_q
        for query_start in range(start, full_start, BLOCK_Q):
            dk, dv = dkdv_step(dk, dv, k, v, Q_h, DO_h, LSE_h, DELTA_h, stride_qn, stride_don, query_start,
                                k_idx, d_idx, n_q, n_k, causal_offset, scale, True, CAUSAL, BLOCK_Q,
                                D_HEAD, DOT_PRECISION)
        for query_start in range(full_start, n_q, BLOCK_Q):
            dk, dv = dkdv_step(dk, dv, k, v, Q_h, DO_h, LSE_h, DELTA_h, stride_qn, stride_don, query_start,
                                k_idx, d_idx, n_q, n_k, causal_offset, scale, False, CAUSAL, BLOCK_Q,
                                D_HEAD, DOT_PRECISION)

    # S = scale * Q K^T, so dK = scale * dS^T Q: the scale is applied once, here.
    tl.store(DK + k_idx[:, None] * stride_kn + d_idx[None, :], (dk * scale).to(DK.dtype.element_ty), mask=k_ok)
    tl.store(DV + k_idx[:, None] * stride_vn + d_idx[None, :], dv.to(DV.dtype.element_ty), mask=k_ok)


@triton.jit
def dq_step(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, key_start, q_idx, d_idx, n_k, causal_offset,
             scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_K: tl.constexpr,
             D_HEAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add one block of keys' contribution to dQ of one block of queries."""
    k_idx = key_start + tl.arange(0, BLOCK_K)
    tile_ok = (k_idx[:, None] < n_k) & (d_idx[None, :] < D_HEAD)
    k = tl.load(K + k_idx[:, None] * stride_kn + d_idx[None, :], mask=tile_ok, other=0.0)
    v = tl.load(V + k_idx[:, None] * stride_vn + d_idx[None, :], mask=tile_ok, other=0.0)

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (scale * 1.4426950408889634)
    p = tl.exp2(s - lse[:, None])                                        # lse in base-2 units
    if MASKED:
        p = tl.where(may_attend(q_idx, k_idx, n_k, causal_offset, CAUSAL), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)          # dP = dO V^T
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)       # dQ += dS K (times scale, later)
    return dq


@triton.jit
def flash_backward_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, n_q, n_k, scale, n_heads, group,
                              stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                              stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                              CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                              D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
                              DOT_PRECISION: tl.constexpr):
    """One program: dQ for BLOCK_Q query rows of one (batch, head). Grid (cdiv(n_q, BLOCK_Q), batch * n_heads).

    It visits the same key blocks as the forward program of the same rows, in the
    key/value head its query head shares (h // group). DQ has Q's strides.
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
    do = tl.load(DO + q_idx[:, None] * stride_don + d_idx[None, :], mask=q_ok, other=0.0)
    # base-2 units, as the scores in dq_step; padded rows: finite, never stored
    lse = tl.load(LSE + q_idx, mask=q_idx < n_q, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + q_idx, mask=q_idx < n_q, other=0.0)
    dq = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)

    causal_offset = n_k - n_q
    full_end, end = key_range(q_block, n_q, n_k, CAUSAL, BLOCK_Q, BLOCK_K)
    for key_start in range(0, full_end, BLOCK_K):
        dq = dq_step(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, key_start, q_idx, d_idx, n_k,
                      causal_offset, scale, False, CAUSAL, BLOCK_K, D_HEAD, DOT_PRECISION)
    for key_start in range(full_end, end, BLOCK_K):
        dq = dq_step(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, key_start, q_idx, d_idx, n_k,
                      causal_offset, scale, True, CAUSAL, BLOCK_K, D_HEAD, DOT_PRECISION)
    tl.store(DQ + q_offsets, (dq * scale).to(DQ.dtype.element_ty), mask=q_ok)


# ---------------------------------------------------------------------------
# Decoding: the keys split across programs (Flash-Decoding)
# ---------------------------------------------------------------------------

@triton.jit
def flash_decode_split_kernel(Q, K, V, O_PART, LSE_PART, n_q, n_k, scale, n_heads, group, n_rows,
                               split_len, n_splits,
                               stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                               stride_vb, stride_vh, stride_vn,
                               CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                               D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program: one query block of one (batch, head) against ONE split of the keys.

    The forward kernel gives a program all the keys of its query block; when there are few query
    rows (decoding: n_q = 1) that is a handful of programs for a GPU with 100 SMs. Here the keys
    are cut into ``n_splits`` runs of ``split_len`` (a multiple of BLOCK_K), and each program
    writes the softmax state of its run: its output normalised over the run, O_PART
    (n_splits, n_rows, n_q, D_HEAD) float32, and the run's log-sum-exp, LSE_PART (n_splits,
    n_rows, n_q), ``n_rows = batch * n_heads``. :func:`merge_splits` then combines the runs with
    chapter 9's merge. Grid (cdiv(n_q, BLOCK_Q) * n_splits, batch * n_heads).
    """
    # -- Which tile is mine: a query block and a run of keys, of one (batch, head).
    q_block, split = tl.program_id(0) // n_splits, tl.program_id(0) % n_splits
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // n_heads, bh % n_heads
    kv_h = h // group
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + kv_h * stride_kh
    V += b * stride_vb + kv_h * stride_vh
    part = (split * n_rows + bh) * n_q                   # my rows of the partial results
    O_PART += part * D_HEAD
    LSE_PART += part

    q_idx = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d_idx = tl.arange(0, BLOCK_D)
    q_ok = (q_idx[:, None] < n_q) & (d_idx[None, :] < D_HEAD)
    q = tl.load(Q + q_idx[:, None] * stride_qn + d_idx[None, :], mask=q_ok, other=0.0)

    # -- The running state starts at a finite, hugely negative maximum, not -inf: unlike the
    # forward's first block, a run may hold no key that a row may see (causal rows before the
    # run starts), and exp2(-inf - (-inf)) would be NaN. No base-2 score comes near -1e30.
    row_max = tl.full([BLOCK_Q], -1e30, tl.float32)
    row_sum = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)

    causal_offset = n_k - n_q
    scale2 = scale * 1.4426950408889634
    _, end = key_range(q_block, n_q, n_k, CAUSAL, BLOCK_Q, BLOCK_K)   # causal: later keys hidden from all rows
    start = split * split_len
    stop = tl.minimum(start + split_len, end)
    # every tile masked: a run's first rows may see none of it, and its last tile may pass n_k
    for key_start in range(start, stop, BLOCK_K):
        acc, row_sum, row_max = forward_step(acc, row_sum, row_max, q, K, V, stride_kn, stride_vn, key_start,
                                              q_idx, d_idx, n_k, causal_offset, scale2, True, CAUSAL, BLOCK_K,
                                              D_HEAD, DOT_PRECISION)

    # -- The run's state as an output and a log-sum-exp (natural units). A row that saw nothing
    # here has the empty state: output 0 and log-sum-exp -inf, a weight of exactly 0 in the merge.
    seen = row_sum > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, row_sum, 1.0)[:, None], 0.0)
    lse = tl.where(seen, (row_max + tl.log2(tl.where(seen, row_sum, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(O_PART + q_idx[:, None] * D_HEAD + d_idx[None, :], out, mask=q_ok)
    tl.store(LSE_PART + q_idx, lse, mask=q_idx < n_q)


# ---------------------------------------------------------------------------
# Host side: validation, launch configuration, launchers
# ---------------------------------------------------------------------------

MAX_D_HEAD = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_INTERPRETER_CONFIG = (32, 32, 4, 1)  # (BLOCK_Q, BLOCK_K, num_warps, num_stages); the interpreter ignores the last two
_chosen: dict = {}                    # (kernel, d_head, dtype, device, blocks, tuning_key) -> the configuration chosen


# Launch configurations (BLOCK_Q, BLOCK_K, num_warps, num_stages), chosen from the compiler's
# resource table (attnbook.kernel_resources, printed in chapter 10): every entry below compiles
# with no register spills and within the target's shared memory, for d_head 64 and 128, in float16
# and bfloat16; tests/test_kernel_resources.py checks that on every target. Keys: the GPU family
# (T4 = 7.x; A100 = 8.0; other 8.x, e.g. L4 = 8.9, with 99 KiB of shared memory; H100 = 9.x) and
# whether the head is padded to 64 or to 128 features.
_BEST = {
    # T4: no tensor cores in Triton and no asynchronous copies (num_stages 1); its FMA-based
    # products need many registers, so small tiles and 8 warps (more threads share the tile).
    # decode (flash_decode): 16 query rows, the fewest tl.dot takes, since a decoding step has one
    # query row per head; long key tiles and (from Ampere on) two stages of prefetch, since it
    # waits on memory far more than on arithmetic. (On the T4, 4 warps spilled: 8 share the tiles.)
    # The two backward kernels get tiles of their own. Each keeps one block resident and streams
    # the other: the dQ kernel keeps BLOCK_Q query rows (as the forward does), so it wants
    # BLOCK_Q >= BLOCK_K; the dK, dV kernel keeps BLOCK_K key rows and two float32 accumulators
    # (dK and dV) for them, and at d = 64 a longer key block than query block spilled there
    # (32 x 64 on sm_80 and sm_89, 64 x 128 on sm_90; chapter 10, tests/test_kernel_resources.py),
    # so at d = 64 its key block stays at most its query block. The exception is sm_90 at d = 128,
    # whose dK, dV kernel ships 32 x 64 (236 registers, no spill, in the committed table).
    ("sm75", 64): {"forward": (64, 32, 8, 1), "backward_dkdv": (32, 32, 8, 1), "backward_dq": (32, 32, 8, 1),
                   "decode": (16, 64, 8, 1)},
    ("sm75", 128): {"forward": (32, 32, 8, 1), "backward_dkdv": (16, 16, 8, 1), "backward_dq": (16, 16, 8, 1),
                    "decode": (16, 32, 8, 1)},
    ("sm80", 64): {"forward": (128, 64, 8, 3), "backward_dkdv": (64, 32, 8, 2), "backward_dq": (64, 32, 8, 2),
                   "decode": (16, 64, 4, 2)},
    ("sm80", 128): {"forward": (128, 64, 8, 3), "backward_dkdv": (64, 64, 8, 1), "backward_dq": (64, 64, 8, 1),
                    "decode": (16, 64, 4, 2)},
    ("sm8x", 64): {"forward": (128, 64, 8, 3), "backward_dkdv": (64, 32, 8, 2), "backward_dq": (64, 32, 8, 2),
                   "decode": (16, 64, 4, 2)},
    ("sm8x", 128): {"forward": (128, 64, 8, 3), "backward_dkdv": (64, 64, 8, 1), "backward_dq": (64, 64, 8, 1),
                    "decode": (16, 64, 4, 2)},
    ("sm90", 64): {"forward": (128, 64, 8, 3), "backward_dkdv": (128, 64, 8, 1), "backward_dq": (128, 64, 8, 1),
                   "decode": (16, 64, 4, 2)},
    ("sm90", 128): {"forward": (128, 64, 8, 3), "backward_dkdv": (32, 64, 8, 2), "backward_dq": (64, 32, 8, 2),
                    "decode": (16, 64, 4, 2)},
}
#: The kinds of launch gpu_configs knows: one per kernel ("backward" is kept as the dQ kernel's).
KINDS = ("forward", "backward_dkdv", "backward_dq", "decode")
# Fallbacks, tried in order after the best one if it fails to launch; checked like the best.
_FALLBACKS = {"sm75": [(16, 16, 8, 1)], "other": [(32, 32, 8, 1), (16, 16, 4, 1)]}


def _family(capability: tuple[int, int]) -> str:
    if capability < (8, 0):
        return "sm75"
    if capability == (8, 0):
        return "sm80"
    return "sm8x" if capability < (9, 0) else "sm90"


def gpu_configs(kind: str, d_head: int, capability: tuple[int, int]) -> list[tuple[int, int, int, int]]:
    """Candidate ``(BLOCK_Q, BLOCK_K, num_warps, num_stages)`` for a GPU, best first.

    ``kind``: one of :data:`KINDS` (the two backward kernels have tiles of their own).

    Bigger tiles reuse each loaded tile for more products but need more registers and shared
    memory: a T4 (compute capability 7.5) has 64 KiB of shared memory per block, an A100 163 KiB,
    an L4 99 KiB, an H100 227 KiB. Stages > 1 let the compiler prefetch the next tiles while
    computing (asynchronous copies: Ampere and newer). ``d_head`` above 128 is not covered by
    the resource table and gets the smallest tiles.
    """
    if kind == "backward":
        kind = "backward_dq"
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    family = _family(capability)
    fallbacks = _FALLBACKS["sm75" if family == "sm75" else "other"]
    if d_head > 128:
        return fallbacks[-1:]
    best = _BEST[family, 64 if d_head <= 64 else 128][kind]
    return list(dict.fromkeys([best, *fallbacks]))


def user_config(block_q: int, block_k: int, capability: tuple[int, int]) -> tuple[int, int, int, int]:
    """Warps and stages for tile sizes the caller chose: 8 warps from 128 x 64 up, else 4; one
    stage on a T4 (no asynchronous copies), two from Ampere on."""
    num_warps = 8 if block_q * block_k >= 128 * 64 else 4
    return block_q, block_k, num_warps, 1 if capability < (8, 0) else 2


def _is_interpreted(fn) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


def interpreted() -> bool:
    """True when this module's kernels run under Triton's interpreter (``TRITON_INTERPRET=1``)."""
    return _is_interpreted(flash_forward_kernel)


def _check_interpreter() -> None:
    """Raise when our kernels and Triton's library disagree about the interpreter.

    That happens when ``triton`` was imported before ``TRITON_INTERPRET`` was set
    (or unset): the library was decorated one way, our kernels the other, and
    the first ``tl.zeros`` inside a kernel would fail with an obscure error.
    """
    if _is_interpreted(flash_forward_kernel) != _is_interpreted(tl.zeros):
        raise RuntimeError(
            "Triton was imported before TRITON_INTERPRET was set, so its library and this module's "
            "kernels disagree about the interpreter. Restart Python and import attnbook.triton_flash "
            "before anything imports triton, or set TRITON_INTERPRET=1 in the environment first.")


def _check_inputs(q, k, v, causal: bool) -> None:
    """Raise ValueError (or TypeError) naming the shapes/dtypes/devices at fault."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not (q.ndim == k.ndim == v.ndim == 4):
        raise ValueError(f"q, k and v must be 4-D (batch, heads, n, d); got {shapes}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k and v must have the same batch size (first dimension); got {shapes}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of heads (second dimension); got {shapes}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"the query heads must be a multiple of the key/value heads (grouped-query "
                         f"attention); got {shapes}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same number of positions n_k (third dimension); got {shapes}")
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError(f"q, k and v must have the same head dimension d (last dimension); got {shapes}")
    if min(q.shape) == 0 or min(k.shape) == 0:
        raise ValueError(f"q, k and v must not be empty; got {shapes}")
    if q.shape[3] > MAX_D_HEAD:
        raise ValueError(f"head dimension d must be at most {MAX_D_HEAD}; got {shapes}")
    if causal and q.shape[2] > k.shape[2]:
        raise ValueError(
            f"causal attention needs n_q <= n_k (the queries are the last n_q of the n_k positions); "
            f"got {shapes}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ValueError(f"q, k and v must share one dtype among float16, bfloat16, float32; "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    _check_interpreter()
    if q.device.type == "cuda":
        if q.dtype == torch.bfloat16 and torch.cuda.get_device_capability(q.device) < (8, 0):
            raise ValueError(f"bfloat16 needs a GPU of compute capability 8.0 or newer; "
                             f"{torch.cuda.get_device_name(q.device)} has "
                             f"{torch.cuda.get_device_capability(q.device)}: use float16")
    elif q.device.type == "cpu":
        if not interpreted():
            raise RuntimeError(
                "CPU tensors need Triton's interpreter, but this module's kernels were compiled for a GPU. "
                "Set TRITON_INTERPRET=1 in the environment before attnbook.triton_flash is first imported "
                "(e.g. start Python with TRITON_INTERPRET=1), or move the tensors to the GPU.")
        if q.dtype == torch.bfloat16:
            raise ValueError("Triton's interpreter mishandles bfloat16: use float16 or float32 on the CPU")
    else:
        raise ValueError(f"tensors must be on a CUDA GPU or (interpreted) on the CPU; got {q.device}")


def _block_d(d_head: int) -> int:
    """The head dimension padded to a power of two, at least 16 (tl.arange and tl.dot need that)."""
    return max(16, triton.next_power_of_2(d_head))


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get true float32 products ("ieee"), not the faster, rounder TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _configs(kind: str, device: torch.device, d_head: int, block_q, block_k):
    if device.type == "cpu":
        candidates, capability = [_INTERPRETER_CONFIG], None
    else:
        capability = torch.cuda.get_device_capability(device)
        candidates = gpu_configs(kind, d_head, capability)
    if block_q is None and block_k is None:
        return candidates
    block_q, block_k = block_q or candidates[0][0], block_k or candidates[0][1]
    if capability is None:                                   # the interpreter ignores warps and stages
        return [(block_q, block_k, *_INTERPRETER_CONFIG[2:])]
    return [user_config(block_q, block_k, capability)]


def _cuda_seconds(run) -> float:
    """Median time of ``run()`` over 5 calls on the GPU, after one call that compiles and warms up."""
    run()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


_timer = _cuda_seconds      # how _launch times a candidate (a test substitutes a fake clock)


def autotuning(device) -> bool:
    """Whether the first launch of a kernel times every candidate configuration and keeps the
    fastest: on a GPU, unless the environment sets ``ATTNBOOK_AUTOTUNE=0``."""
    return str(device).startswith("cuda") and os.environ.get("ATTNBOOK_AUTOTUNE", "1") != "0"


def tuning_key(shape) -> tuple:
    """What, besides the kernel, head size, dtype and device, changes which configuration is fastest:
    ``shape = (batch, heads, kv_heads, n_q, n_k, causal)`` reduced to causality, the numbers of
    (batch, head) and of (batch, key/value head) pairs, and each length rounded up to a power of two
    (as Triton's tutorial keys its autotuning on N_CTX), so that a configuration timed at n = 100
    does not serve n = 16384, while lengths of one octave share one timing."""
    batch, heads, kv_heads, n_q, n_k, causal = shape
    return (bool(causal), batch * heads, batch * kv_heads, triton.next_power_of_2(n_q), triton.next_power_of_2(n_k))


def _launch(kind: str, launch, d_head: int, dtype, device, block_q=None, block_k=None, shape=None):
    """Call ``launch(BLOCK_Q, BLOCK_K, num_warps, num_stages)`` with a configuration that fits.

    The first call for a (kernel, head size, dtype, device, tiles, :func:`tuning_key` of ``shape``)
    key chooses and remembers the configuration. On a GPU (see :func:`autotuning`) it runs every candidate that launches and
    keeps the fastest: the candidates are all free of spills (chapter 10's resource table), but
    which is fastest depends on the GPU. Otherwise it keeps the first that launches. Every launch
    overwrites the same outputs, so running several candidates changes nothing but the time.
    """
    key = (kind, d_head, dtype, str(device), block_q, block_k, None if shape is None else tuning_key(shape))
    if key in _chosen:
        return launch(*_chosen[key])
    configs = _configs(kind, device, d_head, block_q, block_k)
    if autotuning(device) and len(configs) > 1:
        seconds = {}
        for config in configs:
            try:
                seconds[config] = _timer(lambda: launch(*config))
            except OutOfResources:
                continue
        if not seconds:
            return launch(*configs[-1])             # raises the last OutOfResources again
        _chosen[key] = min(seconds, key=seconds.get)
        return launch(*_chosen[key])
    for i, config in enumerate(configs):
        try:
            result = launch(*config)
        except OutOfResources:
            if i == len(configs) - 1:
                raise
            continue
        _chosen[key] = config
        return result


def _rows_of(x):
    """``x`` itself when its last dimension is contiguous (the kernels index rows by a stride and
    columns by 1), so that a (batch, n, heads, d) tensor seen as (batch, heads, n, d) through
    ``.transpose(1, 2)`` is read in place; a copy only otherwise. ``torch.empty_like`` of the
    result has the same strides (it is dense), which the kernels rely on for O, dQ, dK and dV."""
    if x.stride(-1) != 1 or torch.empty_like(x).stride() != x.stride():
        return x.contiguous()
    return x


def _strides(x) -> tuple[int, int, int]:
    """(stride of batch, of head, of row) of a (batch, heads, n, d) tensor; columns are adjacent."""
    return x.stride(0), x.stride(1), x.stride(2)


def _validate_blocks(block_q, block_k) -> None:
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 16 or b & (b - 1)):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot needs tiles of at least 16); got {b!r}")


def flash_forward(q, k, v, causal: bool = False, scale: float | None = None, *,
                  block_q: int | None = None, block_k: int | None = None):
    """Run the forward kernel: returns ``(output, lse)``.

    q: (batch, heads, n_q, d), k and v: (batch, kv_heads, n_k, d) with ``heads`` a multiple of
    ``kv_heads`` (grouped-query attention).
    output: (batch, heads, n_q, d) in the inputs' dtype; lse: (batch, heads, n_q)
    float32, the log-sum-exp of each row of scaled scores (what backward needs).
    """
    _check_inputs(q, k, v, causal)
    _validate_blocks(block_q, block_k)
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q, k, v = (_rows_of(t) for t in (q, k, v))       # any strides; a copy only if columns are not adjacent
    out = torch.empty_like(q)                        # q's strides (see _rows_of)
    lse = torch.empty((batch, heads, n_q), device=q.device, dtype=torch.float32)

    def launch(bq, bk, num_warps, num_stages):
        grid = (triton.cdiv(n_q, bq), batch * heads)
        flash_forward_kernel[grid](
            q, k, v, out, lse, n_q, n_k, scale, heads, heads // k.shape[1],
            *_strides(q), *_strides(k), *_strides(v),
            CAUSAL=bool(causal), BLOCK_Q=bq, BLOCK_K=bk, D_HEAD=d, BLOCK_D=_block_d(d),
            DOT_PRECISION=_dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages)

    _launch("forward", launch, d, q.dtype, q.device, block_q, block_k,
            shape=(batch, heads, k.shape[1], n_q, n_k, bool(causal)))
    return out, lse


def flash_backward(do, q, k, v, out, lse, causal: bool = False, scale: float | None = None, *,
                   block_q: int | None = None, block_k: int | None = None):
    """Run the backward kernels: returns ``(dq, dk, dv)``, shaped like ``q``, ``k``, ``v``.

    do and out: (batch, heads, n_q, d); lse: (batch, heads, n_q) from :func:`flash_forward`.
    Three launches: delta = rowsum(dO * O); dK and dV (a program per key block);
    dQ (a program per query block).
    """
    batch, heads, n_q, d = q.shape
    n_k, kv_heads = k.shape[2], k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    do, q, k, v, out = (_rows_of(t) for t in (do, q, k, v, out))
    delta = torch.empty_like(lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)   # the inputs' strides
    common = dict(D_HEAD=d, BLOCK_D=_block_d(d))
    kernel_args = dict(CAUSAL=bool(causal), DOT_PRECISION=_dot_precision(q.dtype), **common)
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(do))

    bq_pre = 64 if q.device.type == "cuda" else 32
    backward_preprocess_kernel[(triton.cdiv(n_q, bq_pre), batch * heads)](
        out, do, delta, n_q, heads, *_strides(out), *_strides(do), BLOCK_Q=bq_pre, **common)

    def launch_dkdv(bq, bk, num_warps, num_stages):
        # one program per key block of each key/value head: it sums over the heads of its group
        flash_backward_dkdv_kernel[(triton.cdiv(n_k, bk), batch * kv_heads)](
            q, k, v, do, lse, delta, dk, dv, n_q, n_k, scale, kv_heads, heads // kv_heads, *strides,
            BLOCK_Q=bq, BLOCK_K=bk, num_warps=num_warps, num_stages=num_stages, **kernel_args)

    def launch_dq(bq, bk, num_warps, num_stages):
        flash_backward_dq_kernel[(triton.cdiv(n_q, bq), batch * heads)](
            q, k, v, do, lse, delta, dq, n_q, n_k, scale, heads, heads // kv_heads, *strides,
            BLOCK_Q=bq, BLOCK_K=bk, num_warps=num_warps, num_stages=num_stages, **kernel_args)

    # each kernel chooses its own tiles (and is autotuned on its own)
    shape = (batch, heads, kv_heads, n_q, n_k, bool(causal))
    _launch("backward_dkdv", launch_dkdv, d, q.dtype, q.device, block_q, block_k, shape=shape)
    _launch("backward_dq", launch_dq, d, q.dtype, q.device, block_q, block_k, shape=shape)
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd glue: forward saves q, k, v, the output and the log-sum-exps; backward runs the kernels."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_q, block_k):
        out, lse = flash_forward(q, k, v, causal, scale, block_q=block_q, block_k=block_k)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (causal, scale, block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, block_q, block_k = ctx.config
        dq, dk, dv = flash_backward(grad_out, q, k, v, out, lse, causal, scale,
                                    block_q=block_q, block_k=block_k)
        return dq, dk, dv, None, None, None, None  # no gradients for causal, scale and the block sizes


def triton_flash_attention(q, k, v, causal: bool = False, scale: float | None = None, *,
                           block_q: int | None = None, block_k: int | None = None):
    """FlashAttention in Triton, differentiable: ``softmax(scale * q k^T [+ causal mask]) v``.

    q: (batch, heads, n_q, d); k, v: (batch, kv_heads, n_k, d) with ``heads`` a multiple of
    ``kv_heads`` (grouped-query attention); returns (batch, heads, n_q, d). ``scale`` defaults to ``1/sqrt(d)``. With ``causal``, the queries are the last
    ``n_q`` of the ``n_k`` positions (as :func:`attnbook.causal_mask`; PyTorch's
    ``is_causal`` aligns them with the first ``n_q`` instead, which differs when
    ``n_q != n_k``). ``block_q``/``block_k`` override the tile sizes (powers of
    two, at least 16). Runs on CUDA tensors, or on CPU tensors under the interpreter.
    """
    _check_inputs(q, k, v, causal)
    _validate_blocks(block_q, block_k)
    return FlashAttentionFunction.apply(q, k, v, bool(causal), scale, block_q, block_k)


def merge_splits(o_part, lse_part):
    """Combine the runs of keys of :func:`flash_decode`: chapter 9's merge of softmax states, for S at once.

    o_part: (S, ..., d) the output of each run normalised over that run, lse_part: (S, ...) each
    run's log-sum-exp. A run's state ``(m, l)`` has ``lse = m + log l``, so the merge
    ``l = sum_s l_s exp(m_s - m)`` is ``lse = logsumexp_s lse_s``, and the output, which each run
    normalised by its own ``l_s``, is re-weighted by the run's share of the row's mass,
    ``exp(lse_s - lse)``. Returns ``(out, lse)``: (..., d) and (...).
    """
    lse = torch.logsumexp(lse_part, dim=0)                  # (...)
    share = torch.exp(lse_part - lse)                       # (S, ...): sums to 1 over the runs
    return (share[..., None] * o_part).sum(dim=0), lse


def decode_splits(n_k: int, block_k: int, n_programs: int, target: int) -> tuple[int, int]:
    """``(n_splits, split_len)``: cut ``n_k`` keys into runs of whole key blocks so that the
    ``n_programs`` programs of the plain kernel become about ``target`` (never an empty run)."""
    blocks = -(-n_k // block_k)
    n_splits = max(1, min(blocks, -(-target // max(n_programs, 1))))
    split_len = -(-blocks // n_splits) * block_k
    return -(-n_k // split_len), split_len


def flash_decode(q, k, v, causal: bool = False, scale: float | None = None, *, n_splits: int | None = None,
                 block_q: int | None = None, block_k: int | None = None):
    """Attention with the keys split across programs (Flash-Decoding): returns ``(output, lse)``.

    Same inputs and results as :func:`flash_forward`, for inference (no autograd): q (batch, heads,
    n_q, d), k and v (batch, kv_heads, n_k, d). Made for few query rows and many keys (KV-cache
    decoding), where the plain forward kernel runs one program per query block and head. ``n_splits``
    defaults to enough runs for about two programs per SM (four under the interpreter); the runs
    are combined by :func:`merge_splits`.
    """
    _check_inputs(q, k, v, causal)
    _validate_blocks(block_q, block_k)
    if n_splits is not None and (isinstance(n_splits, bool) or not isinstance(n_splits, int) or n_splits < 1):
        raise ValueError(f"n_splits must be a positive integer; got {n_splits!r}")
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q, k, v = (_rows_of(t) for t in (q, k, v))
    result = {}

    def launch(bq, bk, num_warps, num_stages):
        programs = triton.cdiv(n_q, bq) * batch * heads
        target = 2 * torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        splits, split_len = decode_splits(n_k, bk, programs, target if n_splits is None else n_splits * programs)
        o_part = torch.empty((splits, batch * heads, n_q, d), device=q.device, dtype=torch.float32)
        lse_part = torch.empty((splits, batch * heads, n_q), device=q.device, dtype=torch.float32)
        flash_decode_split_kernel[(triton.cdiv(n_q, bq) * splits, batch * heads)](
            q, k, v, o_part, lse_part, n_q, n_k, scale, heads, heads // k.shape[1], batch * heads,
            split_len, splits, *_strides(q), *_strides(k), *_strides(v),
            CAUSAL=bool(causal), BLOCK_Q=bq, BLOCK_K=bk, D_HEAD=d, BLOCK_D=_block_d(d),
            DOT_PRECISION=_dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages)
        result["parts"] = (o_part, lse_part)

    _launch("decode", launch, d, q.dtype, q.device, block_q, block_k,
            shape=(batch, heads, k.shape[1], n_q, n_k, bool(causal)))
    out, lse = merge_splits(*result["parts"])
    return out.to(q.dtype).view(batch, heads, n_q, d), lse.view(batch, heads, n_q)


def key_block_bounds(q_block: int, n_q: int, n_k: int, block_q: int, block_k: int,
                     causal: bool = True) -> tuple[int, int]:
    """The host-side twin of the kernels' ``key_range``: ``(full_end, end)`` for one query block.

    Key blocks starting before ``full_end`` are visited without a mask, those in
    ``[full_end, end)`` with one, and keys from ``end`` on are skipped. Used to
    draw and count the blocks; the kernels compute the same two numbers on the GPU.
    """
    if causal:
        first_query = q_block * block_q + (n_k - n_q)
        return min(first_query + 1, n_k) // block_k * block_k, min(first_query + block_q, n_k)
    return n_k // block_k * block_k, n_k


def query_block_bounds(k_block: int, n_q: int, n_k: int, block_q: int, block_k: int,
                       causal: bool = True) -> tuple[int, int]:
    """The host-side twin of the dK/dV kernel's bounds: ``(start, full_start)`` for one key block.

    Query blocks starting before ``start`` see none of this block's keys and are skipped; those in
    ``[start, full_start)`` are visited with a mask; those from ``full_start`` to the end see every
    key of the block and need none. The transpose of :func:`key_block_bounds`, for drawing the
    backward pass's staircase.
    """
    if not causal:
        return 0, 0
    causal_offset = n_k - n_q
    first_key = k_block * block_k
    start = max(first_key - causal_offset, 0) // block_q * block_q
    full_start = -(-max(first_key + block_k - 1 - causal_offset, 0) // block_q) * block_q
    return start, min(full_start, -(-n_q // block_q) * block_q)

