"""The chapter-10 merge-kernel checker rejects each classic mistake and passes
correct kernels.

The kernels here are written independently of the checker's Mistake
functions, the way a reader new to Triton might write them: one program per
row, the runs as a padded block or one at a time in a loop.
"""

import pytest

from attnbook.exercises import ExerciseError, NotAttemptedError
from attnbook.exercises.flash_decoding import check_merge_kernel
from attnbook.kernels.interpreter import tl, triton


# --- right kernels -----------------------------------------------------------


@triton.jit
def merge_book(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The chapter's solution: all the runs of a row as one padded block."""
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + row * d_head + c, out, mask=c < d_head)
    tl.store(LSE + row, m_safe + tl.log(total))


@triton.jit
def merge_run_by_run(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Right, written differently: chapter 9's online merge, one run at a
    time (no padded block of runs at all)."""
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_D)
    m = float("-inf")
    mass = 0.0
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s in range(0, n_splits):
        lse_s = tl.load(LSE_PART + s * n_rows + row)
        o_s = tl.load(
            O_PART + (s * n_rows + row) * d_head + c,
            mask=c < d_head,
            other=0.0,
        )
        if lse_s > float("-inf"):
            m_new = tl.maximum(m, lse_s)
            alpha = tl.exp(m - m_new)
            beta = tl.exp(lse_s - m_new)
            acc = acc * alpha + beta * o_s
            mass = mass * alpha + beta
            m = m_new
    if mass > 0.0:
        tl.store(OUT + row * d_head + c, acc / mass, mask=c < d_head)
        tl.store(LSE + row, m + tl.log(mass))
    else:
        tl.store(OUT + row * d_head + c, acc, mask=c < d_head)
        tl.store(LSE + row, float("-inf"))


@triton.jit
def merge_shares_base2(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Right, written differently: in base 2 (exp2 and log2, converted with
    log2(e)), the shares exp(lse_s - lse) formed first, the empty row caught
    by clamping the shift."""
    LOG2E: tl.constexpr = 1.4426950408889634
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse2 = (
        tl.load(
            LSE_PART + s * n_rows + row,
            mask=s < n_splits,
            other=float("-inf"),
        )
        * LOG2E
    )
    shift = tl.maximum(tl.max(lse2, 0), -1.0e30)
    merged2 = shift + tl.log2(tl.sum(tl.exp2(lse2 - shift), 0))
    share = tl.exp2(lse2 - tl.maximum(merged2, -1.0e30))
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    tl.store(
        OUT + row * d_head + c, tl.sum(share[:, None] * o, 0), mask=c < d_head
    )
    tl.store(LSE + row, merged2 / LOG2E)


# --- wrong kernels -----------------------------------------------------------


@triton.jit
def merge_padding_zero(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the usual masked load, other=0.0 for the log-sum-exps too
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(LSE_PART + s * n_rows + row, mask=s < n_splits, other=0.0)
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.max(lse_s, 0)
    w = tl.exp(lse_s - m)
    total = tl.sum(w, 0)
    tl.store(
        OUT + row * d_head + c,
        tl.sum(w[:, None] * o, 0) / total,
        mask=c < d_head,
    )
    tl.store(LSE + row, m + tl.log(total))


@triton.jit
def merge_unshifted(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the weights straight from the definition, exp(lse_s)
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    w = tl.exp(lse_s)
    total = tl.sum(w, 0)
    tl.store(
        OUT + row * d_head + c,
        tl.sum(w[:, None] * o, 0) / total,
        mask=c < d_head,
    )
    tl.store(LSE + row, tl.log(total))


@triton.jit
def merge_no_guard(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # right padding, but the empty row is not thought of
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.max(lse_s, 0)
    w = tl.exp(lse_s - m)
    total = tl.sum(w, 0)
    tl.store(
        OUT + row * d_head + c,
        tl.sum(w[:, None] * o, 0) / total,
        mask=c < d_head,
    )
    tl.store(LSE + row, m + tl.log(total))


@triton.jit
def merge_average(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # each run is already a softmax average, so average the averages
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    m = float("-inf")
    for s in range(0, n_splits):
        acc += tl.load(
            O_PART + (s * n_rows + row) * d_head + c,
            mask=c < d_head,
            other=0.0,
        )
        m = tl.maximum(m, tl.load(LSE_PART + s * n_rows + row))
    mass = 0.0
    for s in range(0, n_splits):
        mass += tl.exp(tl.load(LSE_PART + s * n_rows + row) - m)
    tl.store(OUT + row * d_head + c, acc / n_splits, mask=c < d_head)
    tl.store(LSE + row, tl.where(m == float("-inf"), m, m + tl.log(mass)))


@triton.jit
def merge_weights_not_divided(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the online softmax's accumulator, returned before the final division
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.max(lse_s, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m)
    tl.store(
        OUT + row * d_head + c, tl.sum(w[:, None] * o, 0), mask=c < d_head
    )
    tl.store(LSE + row, m + tl.log(tl.sum(w, 0)))


@triton.jit
def merge_lse_max(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the output right, the row's log-sum-exp taken as the largest run's
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)
    total = tl.sum(w, 0)
    tl.store(
        OUT + row * d_head + c,
        tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total),
        mask=c < d_head,
    )
    tl.store(LSE + row, m)


@triton.jit
def merge_exp2(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # exp2 is the fast one (the chapter's kernels use it), forgetting that
    # these log-sum-exps are natural
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse_s - m_safe)
    total = tl.sum(w, 0)
    tl.store(
        OUT + row * d_head + c,
        tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total),
        mask=c < d_head,
    )
    tl.store(LSE + row, m_safe + tl.log2(total))


@triton.jit
def merge_store_unmasked(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the chapter's solution with the store's mask dropped: the padded
    # columns are 0, so storing them looks harmless
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + row * d_head + c, out)
    tl.store(LSE + row, m_safe + tl.log(total))


@triton.jit
def merge_load_unmasked(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one run at a time, the outputs loaded whole: the extra columns are
    # never stored, so the numbers come out right
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_D)
    m = float("-inf")
    mass = 0.0
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s in range(0, n_splits):
        lse_s = tl.load(LSE_PART + s * n_rows + row)
        o_s = tl.load(O_PART + (s * n_rows + row) * d_head + c)
        if lse_s > float("-inf"):
            m_new = tl.maximum(m, lse_s)
            alpha = tl.exp(m - m_new)
            beta = tl.exp(lse_s - m_new)
            acc = acc * alpha + beta * o_s
            mass = mass * alpha + beta
            m = m_new
    if mass > 0.0:
        tl.store(OUT + row * d_head + c, acc / mass, mask=c < d_head)
        tl.store(LSE + row, m + tl.log(mass))
    else:
        tl.store(OUT + row * d_head + c, acc * 0.0, mask=c < d_head)
        tl.store(LSE + row, float("-inf"))


@triton.jit
def merge_total_unguarded(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the shift guarded against the empty row, the division forgotten
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / total
    tl.store(OUT + row * d_head + c, out, mask=c < d_head)
    tl.store(LSE + row, m_safe + tl.log(total))


@triton.jit
def merge_online_divides_by_zero(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # chapter 9's online merge, the empty runs skipped, the final division
    # done whatever the mass
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_D)
    m = float("-inf")
    mass = 0.0
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s in range(0, n_splits):
        lse_s = tl.load(LSE_PART + s * n_rows + row)
        o_s = tl.load(
            O_PART + (s * n_rows + row) * d_head + c,
            mask=c < d_head,
            other=0.0,
        )
        if lse_s > float("-inf"):
            m_new = tl.maximum(m, lse_s)
            alpha = tl.exp(m - m_new)
            beta = tl.exp(lse_s - m_new)
            acc = acc * alpha + beta * o_s
            mass = mass * alpha + beta
            m = m_new
    tl.store(OUT + row * d_head + c, acc / mass, mask=c < d_head)
    tl.store(LSE + row, m + tl.log(mass))


# --- from the expert reading of chapter 10 (snap-t2) -------------------------
# The chapter's solution, its shift dropped but its guarded division kept,
# was rejected with the generic hint: the not_shifted reference divided
# without the guard, so its unseen rows were NaN where the reader's are 0.


@triton.jit
def merge_unshifted_guarded(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    w = tl.exp(lse_s)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + row * d_head + c, out, mask=c < d_head)
    tl.store(LSE + row, tl.log(total))


# --- from the expert reading of chapter 10 (u) -------------------------------
# A shift clamped to a constant keeps -inf - (-inf) out of the empty row, but
# a row whose log-sum-exps all lie far below the constant has every weight
# underflow to 0 in float32. The old checker passed the clamps at 0 and at 30:
# no case had a row whose largest log-sum-exp was far below 0.


@triton.jit
def merge_shift_clamped_at_0(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the empty row guarded by clamping the shift at 0
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.maximum(tl.max(lse_s, 0), 0.0)
    w = tl.exp(lse_s - m)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + row * d_head + c, out, mask=c < d_head)
    tl.store(LSE + row, m + tl.log(total))


@triton.jit
def merge_mean_shift(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # shifted by the mean of the row's finite log-sum-exps (the padding and
    # the empty runs left out), not by their maximum
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    seen = lse_s > float("-inf")
    count = tl.sum(seen.to(tl.float32), 0)
    shift = tl.sum(tl.where(seen, lse_s, 0.0), 0) / tl.maximum(count, 1.0)
    w = tl.exp(lse_s - shift)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + row * d_head + c, out, mask=c < d_head)
    tl.store(LSE + row, shift + tl.log(total))


@triton.jit
def merge_shift_clamped_at_30(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the same clamp at 30 (any constant far above the row's scores)
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.maximum(tl.max(lse_s, 0), 30.0)
    w = tl.exp(lse_s - m)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + row * d_head + c, out, mask=c < d_head)
    tl.store(LSE + row, m + tl.log(total))


@triton.jit
def merge_shift_clamped_unguarded(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the clamp at 0, and the division left unguarded
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.maximum(tl.max(lse_s, 0), 0.0)
    w = tl.exp(lse_s - m)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / total
    tl.store(OUT + row * d_head + c, out, mask=c < d_head)
    tl.store(LSE + row, m + tl.log(total))


# --- from the checker review of chapter 10 (chk-ch10) ------------------------
# E1: a kernel masked by the whole tensor's bounds, not by its row's, stores
# BLOCK_D - d_head values into the next row but never past the end of OUT.
# The interpreter runs the programs in order, so the next row's program
# overwrites them, and the old checker printed "Correct"; on a GPU the two
# programs race. E2 and E4: wrong kernels the checker named, with a
# description that did not fit them.


@triton.jit
def merge_masked_by_tensor_bounds(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the reviewer's kernel: "stay inside OUT" taken for the mask
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits)
        & (row * d_head + c[None, :] < n_rows * d_head),
        other=0.0,
    )
    m = tl.max(lse_s, 0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - shift)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        OUT + row * d_head + c, out, mask=row * d_head + c < n_rows * d_head
    )
    tl.store(LSE + row, shift + tl.log(total))


@triton.jit
def merge_runs_unmasked(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the outputs loaded with the column mask only: the padded runs
    # s >= n_splits are read past the last run
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=c[None, :] < d_head,
        other=0.0,
    )
    m = tl.max(lse_s, 0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - shift)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + row * d_head + c, out, mask=c < d_head)
    tl.store(LSE + row, shift + tl.log(total))


@triton.jit
def merge_shares_unguarded(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the merged lse first (its shift guarded), then the shares
    # exp(lse_s - lse) with no division: the unseen row's lse is -inf
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.max(lse_s, 0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    lse = shift + tl.log(tl.sum(tl.exp(lse_s - shift), 0))
    w = tl.exp(lse_s - lse)
    tl.store(
        OUT + row * d_head + c, tl.sum(w[:, None] * o, 0), mask=c < d_head
    )
    tl.store(LSE + row, lse)


@triton.jit
def merge_rows_reversed(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Right: program p merges row n_rows - 1 - p. Every row is still
    stored by one program only, so nothing races."""
    row = n_rows - 1 - tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.max(lse_s, 0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - shift)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + row * d_head + c, out, mask=c < d_head)
    tl.store(LSE + row, shift + tl.log(total))


CATALOGUE = {
    "check_merge_kernel": {
        "right": [merge_run_by_run, merge_shares_base2, merge_rows_reversed],
        "wrong": [
            (merge_padding_zero, "padding_counted"),
            (merge_unshifted, "not_shifted"),
            (merge_no_guard, "unseen_row_nan"),
            (merge_average, "mean_of_runs"),
            (merge_weights_not_divided, "unnormalised"),
            (merge_lse_max, "lse_is_max"),
            (merge_exp2, "exp2_on_natural"),
            (merge_store_unmasked, "store_past_d_head"),
            (merge_load_unmasked, "load_past_d_head"),
            (merge_total_unguarded, "unseen_row_zero_total"),
            (merge_online_divides_by_zero, "unseen_row_zero_total"),
            (merge_unshifted_guarded, "not_shifted"),
            (merge_shift_clamped_at_0, "shift_clamped"),
            (merge_shift_clamped_at_30, "shift_clamped"),
            (merge_mean_shift, "mean_shift"),
            (merge_shift_clamped_unguarded, "shift_clamped"),
            (merge_masked_by_tensor_bounds, "store_into_other_row"),
            (merge_runs_unmasked, "load_past_d_head"),
            (merge_shares_unguarded, "unseen_row_zero_total"),
        ],
    },
}


# --- issue 31, student report 10 (session 11) ---------------------------------


@triton.jit
def merge_student_10(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SHIFT_GUARDED: tl.constexpr = True,
    EXP2: tl.constexpr = False,
    ROW_STRIDE_PADDED: tl.constexpr = False,
    PARTS_BY_ROW: tl.constexpr = False,
):
    """The student's kernel (right with the flags' defaults); each flag
    switches on one slip that the report ran (ex3c.py)."""
    r = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    s_ok = s < n_splits
    c_ok = c < d_head
    L = tl.load(LSE_PART + s * n_rows + r, mask=s_ok, other=float("-inf"))
    if PARTS_BY_ROW:
        first = (r * n_splits + s[:, None]) * d_head
    else:
        first = (s[:, None] * n_rows + r) * d_head
    o = tl.load(
        O_PART + first + c[None, :],
        mask=s_ok[:, None] & c_ok[None, :],
        other=0.0,
    )
    m = tl.max(L, axis=0)
    if SHIFT_GUARDED:
        m_safe = tl.where(m > float("-inf"), m, 0.0)
    else:
        m_safe = m
    if EXP2:
        w = tl.exp2(L - m_safe)
    else:
        w = tl.exp(L - m_safe)
    tot = tl.sum(w, axis=0)
    num = tl.sum(w[:, None] * o, axis=0)
    out = tl.where(tot > 0, num / tl.where(tot > 0, tot, 1.0), 0.0)
    if ROW_STRIDE_PADDED:
        tl.store(OUT + r * BLOCK_D + c, out, mask=c_ok)
    else:
        tl.store(OUT + r * d_head + c, out, mask=c_ok)
    tl.store(LSE + r, m_safe + tl.log(tot))


class StudentSlip:
    """merge_student_10 with one slip switched on, launched as the checker
    launches a kernel (kernel[grid](...)); the checker judges such a
    launcher by its launches."""

    def __init__(self, name, **flags):
        self.__name__ = name
        self.flags = flags

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return merge_student_10[grid](*args, **kwargs, **self.flags)

        return launch


merge_shift_unguarded_division_guarded = StudentSlip(
    "merge_shift_unguarded_division_guarded", SHIFT_GUARDED=False
)
merge_exp2_natural_log = StudentSlip("merge_exp2_natural_log", EXP2=True)
merge_row_stride_padded = StudentSlip(
    "merge_row_stride_padded", ROW_STRIDE_PADDED=True
)
merge_parts_by_row = StudentSlip("merge_parts_by_row", PARTS_BY_ROW=True)

CATALOGUE["check_merge_kernel"]["right"] += [merge_student_10]
STUDENT_10_WRONG = [
    (merge_shift_unguarded_division_guarded, "unseen_row_nan"),
    (merge_exp2_natural_log, "exp2_on_natural"),
    (merge_row_stride_padded, "store_row_stride"),
    (merge_parts_by_row, "o_part_layout"),
]
CATALOGUE["check_merge_kernel"]["wrong"] += STUDENT_10_WRONG


# --- issue 31, student report s12i (session 12) ------------------------------
# LSE_PART read row by row got the generic hint, and a program that also
# stored into the next row's LSE was told that its output store was masked by
# the tensor's bounds.


@triton.jit
def merge_lse_by_row(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the student's slip: LSE_PART taken for (n_rows, n_splits)
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + row * n_splits + s, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.max(lse_s, 0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - shift)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + row * d_head + c, out, mask=c < d_head)
    tl.store(LSE + row, shift + tl.log(total))


@triton.jit
def merge_everything_by_row(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # both parts read as if the row index came first
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    s_ok = s < n_splits
    lse_s = tl.load(
        LSE_PART + row * n_splits + s, mask=s_ok, other=float("-inf")
    )
    o = tl.load(
        O_PART + (row * n_splits + s[:, None]) * d_head + c[None, :],
        mask=s_ok[:, None] & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.max(lse_s, 0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - shift)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + row * d_head + c, out, mask=c < d_head)
    tl.store(LSE + row, shift + tl.log(total))


@triton.jit
def merge_clears_next_lse(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the student's race: each program also zeroes the next row's LSE
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    tl.store(LSE + row + 1, 0.0, mask=row + 1 < n_rows)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m = tl.max(lse_s, 0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - shift)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + row * d_head + c, out, mask=c < d_head)
    tl.store(LSE + row, shift + tl.log(total))


S12I_WRONG = [
    (merge_lse_by_row, "lse_part_layout"),
    (merge_everything_by_row, "parts_layout"),
    (merge_clears_next_lse, "lse_store_into_other_row"),
]
CATALOGUE["check_merge_kernel"]["wrong"] += S12I_WRONG


# --- expert reading y10gpu -----------------------------------------------------
# Two wrong kernels got only the generic hint: a log-sum-exp stored in base 2
# (the trap the solution names "the base"), and a shift by run 0's
# log-sum-exp instead of the maximum.


@triton.jit
def merge_lse_left_in_base2(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the weights in base 2, converted with log2(e) as the chapter's kernels
    # do; the merged log-sum-exp stored as it comes out of tl.log2
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse2 = 1.4426950408889634 * tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    m2 = tl.max(lse2, 0)
    m2 = tl.where(m2 == float("-inf"), 0.0, m2)
    w = tl.exp2(lse2 - m2)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + row * d_head + c, out, mask=c < d_head)
    tl.store(LSE + row, m2 + tl.log2(total))


@triton.jit
def merge_shift_by_run_0(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # any constant shift cancels in the shares, so run 0's seemed as good
    # as the maximum
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    lse_s = tl.load(
        LSE_PART + s * n_rows + row, mask=s < n_splits, other=float("-inf")
    )
    o = tl.load(
        O_PART + (s[:, None] * n_rows + row) * d_head + c[None, :],
        mask=(s[:, None] < n_splits) & (c[None, :] < d_head),
        other=0.0,
    )
    first = tl.load(LSE_PART + row)
    shift = tl.where(first == float("-inf"), 0.0, first)
    w = tl.exp(lse_s - shift)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + row * d_head + c, out, mask=c < d_head)
    tl.store(LSE + row, shift + tl.log(total))


Y10GPU_WRONG = [
    (merge_lse_left_in_base2, "lse_base2"),
    (merge_shift_by_run_0, "first_run_shift"),
]
CATALOGUE["check_merge_kernel"]["wrong"] += Y10GPU_WRONG


def test_the_chapters_solution_passes(capsys):
    check_merge_kernel(merge_book)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "right", CATALOGUE["check_merge_kernel"]["right"], ids=lambda f: f.__name__
)
def test_right_kernels_pass(right, capsys):
    check_merge_kernel(right)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, key",
    CATALOGUE["check_merge_kernel"]["wrong"],
    ids=[k for _, k in CATALOGUE["check_merge_kernel"]["wrong"]],
)
def test_wrong_kernels_are_named(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_merge_kernel(wrong)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value) and "Hint" in str(err.value)


@triton.jit
def merge_stub(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_splits,
    n_rows,
    d_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    raise NotImplementedError  # your code here


def test_the_stub_is_not_attempted():
    for stub in (None, merge_stub):
        with pytest.raises(NotAttemptedError):
            check_merge_kernel(stub)


def test_a_plain_function_is_refused_by_name():
    with pytest.raises(TypeError, match="jit"):
        check_merge_kernel(lambda o, lse: (o.sum(0), lse.max(0).values))


def test_a_store_into_the_guard_is_found_after_the_launch(monkeypatch):
    """On a GPU nothing watches the stores: the guard row after OUT catches
    the last row's unmasked columns (here the interpreter's watch is off)."""
    from attnbook.exercises import flash_decoding

    def unwatched(self):
        self.builder = None
        return self

    monkeypatch.setattr(flash_decoding._BoundsChecked, "__enter__", unwatched)
    with pytest.raises(ExerciseError) as err:
        check_merge_kernel(merge_store_unmasked)
    assert err.value.mistake == "store_past_d_head"
    assert "past the end of OUT" in str(err.value)


def test_the_watch_is_removed_after_the_launch():
    from triton.runtime.interpreter import interpreter_builder

    with pytest.raises(ExerciseError):
        check_merge_kernel(merge_load_unmasked)
    assert "create_masked_load" not in vars(interpreter_builder)
    assert "create_masked_store" not in vars(interpreter_builder)


def test_a_guarded_division_without_the_shift_is_named():
    with pytest.raises(ExerciseError) as err:
        check_merge_kernel(merge_unshifted_guarded)
    assert err.value.mistake == "not_shifted", str(err.value)


def test_a_row_far_below_zero_is_merged_by_the_book():
    """The case the clamps fail on: the chapter's guarded shift gets the first
    row, (-150, -160, -inf), right (log-sum-exp -150 + log(1 + e^-10))."""
    import math

    import torch

    from attnbook.exercises.flash_decoding import launch, merge_cases

    (case,) = [c for c in merge_cases() if "far below 0" in c.name]
    o_part, lse_part = case.args
    assert float(lse_part.max()) <= -120.0
    out, lse = launch(merge_book)(o_part, lse_part)
    assert math.isclose(
        float(lse[0]), -150.0 + math.log1p(math.exp(-10.0)), rel_tol=1e-6
    )
    assert bool(torch.isfinite(out).all()) and float(out.abs().max()) > 0


def test_a_store_into_the_next_row_is_named_a_race():
    """The reviewer's kernel never stores past the end of OUT, and its
    numbers are right under the interpreter: only the record of which
    program stored each element finds it."""
    with pytest.raises(ExerciseError) as err:
        check_merge_kernel(merge_masked_by_tensor_bounds)
    assert err.value.mistake == "store_into_other_row", str(err.value)
    assert "programs 0 and 1 both stored to OUT[1, 0]" in str(err.value)
    assert "race" in str(err.value)


def test_an_unmasked_run_is_said_to_spoil_the_numbers_too():
    with pytest.raises(ExerciseError) as err:
        check_merge_kernel(merge_runs_unmasked)
    assert err.value.mistake == "load_past_d_head"
    assert "0 x NaN" in str(err.value)
    assert "so the numbers are right" not in str(err.value)


def test_unguarded_shares_get_a_hint_that_fits_them():
    with pytest.raises(ExerciseError) as err:
        check_merge_kernel(merge_shares_unguarded)
    assert err.value.mistake == "unseen_row_zero_total"
    assert "exp(lse_s - lse)" in str(err.value)


SETUP_SCRIPT = """
import torch
import triton  # first, before anything chooses the interpreter
import triton.language as tl
import attnbook.kernels  # the package alone does not choose it
from attnbook.exercises.flash_decoding import SetupError, check_merge_kernel


@triton.jit
def merge_kernel(O_PART, LSE_PART, OUT, LSE, n_splits, n_rows, d_head,
                 BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    tl.store(LSE + row, 0.0)


try:
    check_merge_kernel(merge_kernel)
except SetupError as err:
    print("SetupError:", err)
"""


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(),
    reason="with a GPU a compiled kernel is the right one",
)
def test_a_kernel_compiled_without_a_gpu_is_a_setup_error(tmp_path):
    """From the student reading of chapters 9 and 10 (issue 31): a script that
    imports triton before attnbook.kernels.interpreter gets a compiled kernel
    on a machine without a GPU, and the checker used to report "your function
    raised RuntimeError: 0 active drivers". It now says that the setup is at
    fault, and what to import first."""
    import os
    import subprocess
    import sys

    script = tmp_path / "reader.py"
    script.write_text(SETUP_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("SetupError:"), result.stdout
    assert "import attnbook.kernels.interpreter" in result.stdout
    assert "your function raised" not in result.stdout


@pytest.mark.parametrize(
    "wrong, key", STUDENT_10_WRONG, ids=[k for _, k in STUDENT_10_WRONG]
)
def test_student_10_slips_are_named(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_merge_kernel(wrong)
    assert err.value.mistake == key


def test_a_wrapper_that_launches_a_kernel_is_judged_by_its_launches(capsys):
    """An object that launches a kernel (kernel[grid](...)) is not told that
    Triton compiled it: the checker runs it."""

    class Launcher:
        def __getitem__(self, grid):
            return merge_student_10[grid]

    check_merge_kernel(Launcher())
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, key", S12I_WRONG, ids=[k for _, k in S12I_WRONG]
)
def test_s12i_slips_are_named(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_merge_kernel(wrong)
    assert err.value.mistake == key
    assert "compare your kernel" not in str(err.value)


def test_a_race_on_lse_names_the_program_outside_its_row():
    """The verdict says whose row the element is and which program strayed,
    and the diagnosis does not guess the output's mask."""
    with pytest.raises(ExerciseError) as err:
        check_merge_kernel(merge_clears_next_lse)
    text = str(err.value)
    assert "programs 0 and 1 both stored to LSE[1]" in text
    assert "program 0 stored outside its own row of LSE" in text
    assert "c < d_head" not in text


def test_a_log_sum_exp_left_in_base_2_is_told_to_multiply_by_ln_2():
    with pytest.raises(ExerciseError) as err:
        check_merge_kernel(merge_lse_left_in_base2)
    assert err.value.mistake == "lse_base2"
    assert "ln 2" in str(err.value)


@pytest.mark.parametrize(
    "wrong, key", Y10GPU_WRONG, ids=[k for _, k in Y10GPU_WRONG]
)
def test_y10gpu_slips_are_named(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_merge_kernel(wrong)
    assert err.value.mistake == key
    assert "compare your kernel" not in str(err.value)
