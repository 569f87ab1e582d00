"""The Triton FlashAttention kernels against PyTorch's
scaled_dot_product_attention.

Without a CUDA GPU the kernels run under Triton's interpreter
(TRITON_INTERPRET=1) on small CPU tensors; with one, the same tests run
compiled on the GPU. The reference is F.scaled_dot_product_attention evaluated
in float64, with an explicit boolean mask (attnbook.causal_mask) whenever n_q
!= n_k.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnbook
from attnbook.kernels import host, launch
from attnbook.kernels.host import (
    flash_forward,
    key_block_bounds,
    triton_flash_attention,
)
from attnbook.kernels.launch import LaunchPolicy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Tolerances against the float64 reference: float16 inputs round to ~5e-4
# relative, and the kernels' float32 accumulation adds little to that.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
}


def _triton_imported_too_early() -> bool:
    try:
        host._check_interpreter()
    except RuntimeError:
        return True
    return False


# When another test module imported triton (torch.utils.flop_counter does)
# before attnbook.kernels could set TRITON_INTERPRET=1, the kernels cannot run
# in this process: then this whole file runs again in a fresh Python
# (test_the_kernels_in_a_fresh_process), and its tests here step aside.
TOO_EARLY = _triton_imported_too_early()


@pytest.fixture(autouse=True)
def kernels_can_run(request):
    if (
        TOO_EARLY
        and request.node.name != "test_the_kernels_in_a_fresh_process"
    ):
        pytest.skip(
            "triton was imported before TRITON_INTERPRET was set in this "
            "process; "
            "test_the_kernels_in_a_fresh_process runs this test instead"
        )


@pytest.mark.skipif(not TOO_EARLY, reason="the kernels run in this process")
def test_the_kernels_in_a_fresh_process():
    env = dict(
        os.environ,
        TRITON_INTERPRET="1"
        if not torch.cuda.is_available()
        else os.environ.get("TRITON_INTERPRET", "0"),
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, (
        result.stdout[-5000:] + result.stderr[-2000:]
    )
    assert " passed" in result.stdout and "failed" not in result.stdout


def reference(q, k, v, causal, scale=None):
    """float64 SDPA; the causal mask puts the queries at the last n_q of the
    n_k positions."""
    q, k, v = (x.double() for x in (q, k, v))
    mask = (
        torch.from_numpy(attnbook.causal_mask(q.shape[2], k.shape[2])).to(
            q.device
        )
        if causal
        else None
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def random_qkv(batch, heads, n_q, n_k, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, heads, n, d, generator=gen)
        .to(DEVICE, dtype)
        .requires_grad_()
        for n in (n_q, n_k, n_k)
    ]


def check_against_reference(
    batch, heads, n_q, n_k, d, dtype, causal, **blocks
):
    q, k, v = random_qkv(batch, heads, n_q, n_k, d, dtype)
    out = triton_flash_attention(q, k, v, causal=causal, **blocks)
    assert out.shape == q.shape and out.dtype == dtype
    grad_out = torch.randn(
        out.shape, generator=torch.Generator().manual_seed(1)
    ).to(DEVICE, dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out64 = reference(q64, k64, v64, causal)
    grads64 = torch.autograd.grad(out64, (q64, k64, v64), grad_out.double())
    for name, got, want in zip(
        ("output", "dq", "dk", "dv"), (out, *grads), (out64, *grads64)
    ):
        assert got.shape == want.shape, name
        torch.testing.assert_close(
            got.double(), want, **TOL[dtype], msg=lambda m: f"{name}: {m}"
        )


# --- outputs and all three gradients -----------------------------------------

SHAPES = [  # (batch, heads, n_q, n_k, d, block sizes)
    pytest.param(1, 2, 64, 64, 32, {}, id="n=64 (whole blocks)"),
    pytest.param(2, 1, 100, 100, 64, {}, id="n=100 (ragged last block)"),
    pytest.param(1, 1, 1, 1, 16, {}, id="n=1"),
    pytest.param(1, 2, 77, 77, 48, {}, id="d=48 (head dim padded to 64)"),
    pytest.param(
        1,
        1,
        90,
        90,
        32,
        dict(block_q=16, block_k=32),
        id="block_q=16 < block_k=32",
    ),
    pytest.param(
        1,
        1,
        90,
        90,
        32,
        dict(block_q=32, block_k=16),
        id="block_q=32 > block_k=16",
    ),
    pytest.param(1, 2, 20, 77, 32, {}, id="n_q=20 < n_k=77"),
]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16], ids=["float32", "float16"]
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch, heads, n_q, n_k, d, blocks", SHAPES)
def test_output_and_gradients_match_sdpa(
    batch, heads, n_q, n_k, d, blocks, causal, dtype
):
    check_against_reference(batch, heads, n_q, n_k, d, dtype, causal, **blocks)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16], ids=["float32", "float16"]
)
def test_more_queries_than_keys_without_mask(dtype):
    check_against_reference(1, 1, 70, 20, 16, dtype, causal=False)


def test_equal_lengths_agree_with_torch_is_causal():
    q, k, v = random_qkv(1, 2, 50, 50, 32, torch.float32)
    torch.testing.assert_close(
        triton_flash_attention(q, k, v, causal=True),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
        atol=2e-5,
        rtol=2e-5,
    )


def test_fewer_queries_than_keys_use_the_books_alignment_not_torchs():
    """n_q < n_k: the queries are the LAST n_q positions (KV-cache decoding),
    unlike torch's is_causal."""
    q, k, v = random_qkv(1, 1, 8, 40, 16, torch.float32)
    ours = triton_flash_attention(q, k, v, causal=True)
    torch.testing.assert_close(
        ours.double(), reference(q, k, v, causal=True), atol=2e-5, rtol=2e-5
    )
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (ours - top_left).abs().max() > 0.1


def test_custom_scale_and_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(3)
    # (batch, n, heads, d) transposed to (batch, heads, n, d): a view with
    # non-unit strides
    q, k, v = (
        torch.randn(2, 40, 2, 32, generator=gen).to(DEVICE).transpose(1, 2)
        for _ in range(3)
    )
    assert not q.is_contiguous()
    out = triton_flash_attention(q, k, v, causal=True, scale=0.3)
    torch.testing.assert_close(
        out.double(),
        reference(q, k, v, causal=True, scale=0.3),
        atol=2e-5,
        rtol=2e-5,
    )


def test_forward_saves_the_log_sum_exp_of_each_row():
    q, k, v = random_qkv(1, 2, 45, 60, 32, torch.float32)
    _, lse = flash_forward(q.detach(), k.detach(), v.detach(), causal=True)
    scores = (q.double() @ k.double().transpose(-1, -2)) / np.sqrt(32)
    visible = torch.from_numpy(attnbook.causal_mask(45, 60)).to(DEVICE)
    expected = torch.logsumexp(
        scores.masked_fill(~visible, float("-inf")), dim=-1
    )
    assert lse.shape == (1, 2, 45) and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), expected, atol=1e-5, rtol=1e-5)


def test_large_scores_do_not_overflow():
    q, k, v = random_qkv(1, 1, 40, 40, 16, torch.float32)
    with torch.no_grad():
        # scores in the hundreds: exp overflows float32 without the running
        # maximum
        q *= 30
    out = triton_flash_attention(q, k, v)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(
        out.double(), reference(q, k, v, causal=False), atol=1e-4, rtol=1e-4
    )


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    n_q=st.integers(1, 70),
    extra=st.integers(0, 40),
    d=st.sampled_from([16, 24, 32]),
    causal=st.booleans(),
)
def test_random_awkward_shapes(n_q, extra, d, causal):
    check_against_reference(1, 1, n_q, n_q + extra, d, torch.float32, causal)


# --- causal block skipping ---------------------------------------------------


def test_skipped_key_blocks_are_never_read():
    """NaN in keys/values that no query of a block may see: only the blocks
    that load them turn NaN.

    Masking alone would not do: a masked score has weight 0, but 0 * NaN = NaN.
    """
    q, k, v = (
        x.detach() for x in random_qkv(1, 1, 128, 128, 16, torch.float32)
    )
    # positions 100..127 live in key block 3 (blocks of 32)
    v[:, :, 100:] = float("nan")
    out = triton_flash_attention(q, k, v, causal=True, block_q=32, block_k=32)
    finite_rows = torch.isfinite(out[0, 0]).all(dim=-1)
    # query blocks 0-2 stop before key block 3: never load it
    assert finite_rows[:96].all()
    # query block 3 loads it (masked for rows < 100, still NaN)
    assert not finite_rows[96:].any()


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_skipped_query_blocks_are_never_read_by_the_dkdv_kernel():
    q, k, v = (
        x.detach() for x in random_qkv(1, 1, 128, 128, 16, torch.float32)
    )
    q[:, :, :20] = float("nan")  # queries 0..19, in query block 0
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    out = triton_flash_attention(q, k, v, causal=True, block_q=32, block_k=32)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    # key blocks 1-3 are invisible to query block 0, so their programs skip it
    assert (
        torch.isfinite(dk[0, 0, 32:]).all()
        and torch.isfinite(dv[0, 0, 32:]).all()
    )
    assert not torch.isfinite(dk[0, 0, :32]).all()
    assert torch.isfinite(dq[0, 0, 32:]).all()


@pytest.mark.parametrize(
    "n_q, n_k, block_q, block_k",
    [
        (128, 128, 32, 32),
        (100, 100, 64, 16),
        (37, 90, 16, 32),
        (1, 50, 16, 16),
        (64, 64, 64, 64),
    ],
)
def test_key_block_bounds_agree_with_the_causal_mask(
    n_q, n_k, block_q, block_k
):
    mask = attnbook.causal_mask(n_q, n_k)
    for q_block in range(-(-n_q // block_q)):
        rows = mask[q_block * block_q : (q_block + 1) * block_q]
        full_end, end = key_block_bounds(q_block, n_q, n_k, block_q, block_k)
        visible = np.flatnonzero(rows.any(axis=0))
        # tight: one past the last key that some row sees
        assert end == visible.max() + 1
        # visibility is a prefix of the keys
        seen_by_all = rows.all(axis=0).sum()
        # the whole blocks inside that prefix
        assert full_end == seen_by_all // block_k * block_k


@pytest.mark.parametrize(
    "n_q, n_k, block_q, block_k",
    [
        (256, 256, 32, 32),
        (100, 100, 32, 16),
        (37, 90, 16, 32),
        (1, 64, 16, 16),
        (96, 256, 64, 32),
    ],
)
def test_query_block_bounds_agree_with_the_causal_mask(
    n_q, n_k, block_q, block_k
):
    # (n_q, n_k), True = query sees key
    visible = attnbook.causal_mask(n_q, n_k)
    for k_block in range(-(-n_k // block_k)):
        keys = slice(k_block * block_k, min((k_block + 1) * block_k, n_k))
        start, full_start = host.query_block_bounds(
            k_block, n_q, n_k, block_q, block_k
        )
        assert (
            start % block_q == 0
            and full_start % block_q == 0
            and start <= full_start
        )
        # skipped blocks see nothing of these keys
        assert not visible[:start, keys].any()
        # unmasked blocks see all of them
        assert visible[full_start:, keys].all()
        # the first visited block sees some key
        if start < n_q:
            assert visible[start : start + block_q, keys].any()
    assert host.query_block_bounds(3, 100, 100, 32, 32, causal=False) == (0, 0)


def test_non_causal_bounds_cover_every_key():
    assert key_block_bounds(0, 100, 100, 32, 32, causal=False) == (96, 100)


# --- grouped-query attention and strided inputs, inside the kernels ----------


def check_gqa_against_reference(
    batch, heads, n_kv_heads, n_q, n_k, d, dtype, causal, layout="bhnd"
):
    """The kernels with n_kv_heads < heads against float64 SDPA on keys and
    values repeated per group."""
    gen = torch.Generator().manual_seed(3)
    shapes = [
        (batch, heads, n_q, d),
        (batch, n_kv_heads, n_k, d),
        (batch, n_kv_heads, n_k, d),
    ]
    # stored (batch, n, heads, d), seen as (batch, heads, n, d): not contiguous
    if layout == "bnhd":
        q, k, v = (
            torch.randn(b, n, h, dd, generator=gen)
            .to(DEVICE, dtype)
            .transpose(1, 2)
            .requires_grad_()
            for b, h, n, dd in shapes
        )
    else:
        q, k, v = (
            torch.randn(*s, generator=gen).to(DEVICE, dtype).requires_grad_()
            for s in shapes
        )
    out = triton_flash_attention(q, k, v, causal=causal)
    grad_out = torch.randn(
        out.shape, generator=torch.Generator().manual_seed(4)
    ).to(DEVICE, dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    group = heads // n_kv_heads
    out64 = reference(
        q64,
        k64.repeat_interleave(group, 1),
        v64.repeat_interleave(group, 1),
        causal,
    )
    # summed over each group
    grads64 = torch.autograd.grad(out64, (q64, k64, v64), grad_out.double())
    for name, got, want in zip(
        ("output", "dq", "dk", "dv"), (out, *grads), (out64, *grads64)
    ):
        assert got.shape == want.shape, name
        torch.testing.assert_close(
            got.double(), want, **TOL[dtype], msg=lambda m: f"{name}: {m}"
        )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "batch, heads, n_kv_heads, n_q, n_k, d",
    [
        pytest.param(2, 4, 2, 37, 37, 16, id="GQA 4:2, ragged"),
        pytest.param(1, 6, 2, 20, 45, 32, id="GQA 6:2, n_q < n_k"),
        pytest.param(2, 3, 1, 33, 50, 16, id="MQA 3:1"),
    ],
)
def test_grouped_query_attention_inside_the_kernels(
    batch, heads, n_kv_heads, n_q, n_k, d, causal
):
    check_gqa_against_reference(
        batch, heads, n_kv_heads, n_q, n_k, d, torch.float32, causal
    )


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16], ids=["float32", "float16"]
)
def test_batch_n_heads_d_layout_is_read_in_place(dtype):
    check_gqa_against_reference(
        2, 4, 2, 40, 40, 16, dtype, True, layout="bnhd"
    )
    # (batch, heads, n, d) view, not contiguous
    x = torch.zeros(2, 40, 4, 16).transpose(1, 2)
    assert not x.is_contiguous() and host._rows_of(x) is x  # no copy
    # last dimension has stride 40
    columns_apart = torch.zeros(2, 4, 16, 40).transpose(2, 3)
    # the one case that copies
    assert host._rows_of(columns_apart).is_contiguous()


# --- decoding with the keys split across programs (flash_decode) -------------


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16], ids=["float32", "float16"]
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "batch, heads, n_kv_heads, n_q, n_k, d, n_splits",
    [
        pytest.param(
            2, 2, 2, 1, 100, 16, None, id="one query row, default splits"
        ),
        pytest.param(1, 4, 2, 1, 257, 32, 3, id="GQA 4:2, ragged last run"),
        pytest.param(
            1,
            2,
            1,
            17,
            70,
            16,
            5,
            id="17 rows: a run holds no key some causal rows may see",
        ),
        pytest.param(
            1, 1, 1, 3, 5, 16, 8, id="more runs asked for than key blocks"
        ),
        pytest.param(1, 2, 2, 1, 1, 64, 1, id="one key"),
        pytest.param(1, 2, 2, 40, 300, 48, 2, id="two query blocks, d padded"),
    ],
)
def test_decode_with_split_keys_matches_sdpa(
    batch, heads, n_kv_heads, n_q, n_k, d, n_splits, causal, dtype
):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(batch, heads, n_q, d, generator=gen).to(DEVICE, dtype)
    k, v = (
        torch.randn(batch, n_kv_heads, n_k, d, generator=gen).to(DEVICE, dtype)
        for _ in range(2)
    )
    out, lse = host.flash_decode(q, k, v, causal, n_splits=n_splits)
    group = heads // n_kv_heads
    k64, v64 = (x.double().repeat_interleave(group, 1) for x in (k, v))
    assert (
        out.shape == q.shape
        and out.dtype == dtype
        and lse.shape == q.shape[:3]
    )
    torch.testing.assert_close(
        out.double(), reference(q, k64, v64, causal), **TOL[dtype]
    )
    scores = q.double() @ k64.transpose(-2, -1) / d**0.5
    if causal:
        scores = scores.masked_fill(
            ~torch.from_numpy(attnbook.causal_mask(n_q, n_k)).to(DEVICE),
            float("-inf"),
        )
    torch.testing.assert_close(
        lse.double(), torch.logsumexp(scores, -1), **TOL[dtype]
    )


def test_decode_agrees_with_the_forward_kernel_it_splits():
    q, k, v = (
        x.detach() for x in random_qkv(1, 2, 1, 200, 32, torch.float32, seed=3)
    )
    for n_splits in (1, 2, 7):
        out, lse = host.flash_decode(q, k, v, n_splits=n_splits, block_k=16)
        want, want_lse = flash_forward(q, k, v, block_k=16)
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-6)


def test_decode_splits_cut_whole_key_blocks_and_leave_no_run_empty():
    assert host.decode_splits(1000, 64, n_programs=8, target=64) == (8, 128)
    # at most one per block
    assert host.decode_splits(100, 64, n_programs=1, target=100) == (2, 64)
    # already enough programs
    assert host.decode_splits(100, 64, n_programs=500, target=64) == (1, 128)
    for n_k in range(1, 300, 7):
        for target in (1, 5, 64):
            splits, split_len = host.decode_splits(n_k, 16, 2, target)
            assert (
                split_len % 16 == 0
                and (splits - 1) * split_len < n_k <= splits * split_len
            )


def test_decode_refuses_a_bad_number_of_splits():
    q, k, v = (x.detach() for x in random_qkv(1, 1, 1, 8, 16, torch.float32))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(
            ValueError, match="n_splits must be a positive integer"
        ):
            host.flash_decode(q, k, v, n_splits=bad)


# --- launch configurations ---------------------------------------------------


def _policy(configs, timer=None, autotune=False):
    """A LaunchPolicy of its own whose candidates are ``configs`` whatever the
    device."""
    policy = LaunchPolicy(
        autotune=autotune, **({} if timer is None else dict(timer=timer))
    )
    policy.candidates = lambda *args: list(configs)
    return policy


def test_launch_falls_back_to_smaller_tiles_when_shared_memory_runs_out():
    from triton.runtime.errors import OutOfResources

    policy = _policy([(128, 64, 8, 3), (64, 64, 4, 2), (32, 32, 4, 1)])
    tried = []

    def launch(block_q, block_k, num_warps, num_stages):
        tried.append((block_q, block_k))
        if block_q * block_k * 16 > 65536:  # pretend a 64 KiB limit
            raise OutOfResources(
                block_q * block_k * 16, 65536, "shared memory"
            )

    policy.launch("forward", launch, 64, torch.float16, "cuda:0")
    assert tried == [(128, 64), (64, 64)]
    tried.clear()
    policy.launch("forward", launch, 64, torch.float16, "cuda:0")
    # remembered: no second failed attempt
    assert tried == [(64, 64)]


def test_autotuning_keeps_the_fastest_configuration_that_launches(monkeypatch):
    from triton.runtime.errors import OutOfResources

    # (128, 64) does not fit; (64, 64) is the fastest
    seconds = {(64, 64): 2.0, (32, 32): 3.0}
    last = []

    def launch_(block_q, block_k, num_warps, num_stages):
        if (block_q, block_k) == (128, 64):
            raise OutOfResources(1 << 20, 65536, "shared memory")
        last.append((block_q, block_k))
        return seconds[block_q, block_k]

    # a fake clock: the launch's "time"
    policy = _policy(
        [(128, 64, 8, 3), (64, 64, 4, 2), (32, 32, 4, 1)],
        timer=lambda run: run(),
        autotune=True,
    )
    assert (
        policy.launch("forward", launch_, 64, torch.float16, "cuda:0") == 2.0
    )
    # the outputs come from the chosen configuration
    assert last[-1] == (64, 64)
    last.clear()
    policy.launch("forward", launch_, 64, torch.float16, "cuda:0")
    # remembered: no second round of timing
    assert last == [(64, 64)]
    assert not policy.autotuning("cpu")
    assert not LaunchPolicy(autotune=False).autotuning("cuda:0")
    monkeypatch.setenv("ATTNBOOK_AUTOTUNE", "0")
    # the environment's default, read when the policy is made
    assert not LaunchPolicy().autotuning("cuda:0")
    monkeypatch.delenv("ATTNBOOK_AUTOTUNE")
    assert LaunchPolicy().autotuning("cuda:0")


def test_autotuning_is_keyed_on_what_changes_the_best_configuration():
    """A configuration timed at n = 100 must not serve n = 16384, nor a causal
    one a full one, nor one (batch, head) pair thousands; lengths of one octave
    share a timing."""
    timed = []

    def timer(run):
        timed.append(1)
        return run()

    policy = _policy(
        [(64, 64, 4, 2), (32, 32, 4, 1)], timer=timer, autotune=True
    )

    def tune(shape, fastest):
        timed.clear()
        policy.launch(
            "forward",
            lambda *c: {fastest: 1.0}.get(c[:2], 2.0),
            64,
            torch.float16,
            "cuda:0",
            shape=shape,
        )
        return len(timed)

    # first time: both timed
    assert tune((1, 8, 8, 100, 100, False), (64, 64)) == 2
    # same octave: remembered
    assert tune((1, 8, 8, 120, 120, False), (64, 64)) == 0
    # another length: timed again
    assert tune((1, 8, 8, 16384, 16384, False), (32, 32)) == 2
    # causal: timed again
    assert tune((1, 8, 8, 100, 100, True), (32, 32)) == 2
    # more (batch, head) pairs: timed again
    assert tune((64, 8, 8, 100, 100, False), (32, 32)) == 2
    key = launch.tuning_key
    assert key((1, 8, 8, 100, 100, False)) == key((1, 8, 8, 128, 128, False))
    assert (
        key((2, 4, 4, 64, 64, True))
        == key((1, 8, 8, 64, 64, True))
        != key((1, 8, 2, 64, 64, True))
    )
    assert [
        launch.length_bucket(n) for n in (1, 2, 3, 64, 65, 100, 16384)
    ] == [1, 2, 4, 64, 128, 128, 16384]
    chosen = {k[-1]: v for k, v in policy.chosen.items()}
    assert chosen[key((1, 8, 8, 100, 100, False))] == (64, 64, 4, 2)
    assert chosen[key((1, 8, 8, 16384, 16384, False))] == (32, 32, 4, 1)


def test_the_backward_kernels_get_their_own_tiles():
    """Each keeps its own block resident: the dQ kernel's query block is at
    least its key block; the dK, dV kernel's key block is at most its query
    block only where a larger one spills (chapter 10)."""
    for capability in ((7, 5), (8, 0), (8, 9), (9, 0)):
        for d_head in (64, 128):
            dq = launch.gpu_configs("backward_dq", d_head, capability)[0]
            assert dq[0] >= dq[1]
            assert launch.gpu_configs(
                "backward", d_head, capability
            ) == launch.gpu_configs("backward_dq", d_head, capability)
    assert (
        launch.gpu_configs("backward_dq", 128, (9, 0))[0]
        != launch.gpu_configs("backward_dkdv", 128, (9, 0))[0]
    )
    with pytest.raises(ValueError, match="kind"):
        launch.gpu_configs("sideways", 64, (8, 0))


def test_the_backward_launches_each_kernel_with_its_own_configuration(
    monkeypatch,
):
    q, k, v = (x.detach() for x in random_qkv(1, 2, 40, 40, 16, torch.float32))
    out, lse = host.flash_forward(q, k, v)
    kinds = []
    real = launch.POLICY.launch

    def spy(kind, launch_, *args, **kwargs):
        kinds.append((kind, kwargs.get("shape")))
        return real(kind, launch_, *args, **kwargs)

    monkeypatch.setattr(launch.POLICY, "launch", spy)
    host.flash_backward(torch.ones_like(out), q, k, v, out, lse)
    assert [kind for kind, _ in kinds] == ["backward_dkdv", "backward_dq"]
    assert kinds[0][1] == (1, 2, 2, 40, 40, False)


def test_launch_reraises_when_no_configuration_fits():
    from triton.runtime.errors import OutOfResources

    def launch_(*config):
        raise OutOfResources(1 << 20, 65536, "shared memory")

    with pytest.raises(OutOfResources):
        _policy([(64, 64, 4, 1), (32, 32, 4, 1)]).launch(
            "backward", launch_, 256, torch.float16, "cuda:0"
        )


@pytest.mark.parametrize(
    "capability", [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0)]
)
@pytest.mark.parametrize("d_head", [32, 64, 128, 256])
def test_gpu_configurations_end_with_small_tiles(capability, d_head):
    for kind in launch.KINDS:
        configs = launch.gpu_configs(kind, d_head, capability)
        assert configs[-1][:2] == (16, 16) and len(set(configs)) == len(
            configs
        )
        assert all(
            b >= 16 and b & (b - 1) == 0
            for config in configs
            for b in config[:2]
        )
        # no cp.async on a T4
        assert all(config[3] == 1 for config in configs) or capability >= (
            8,
            0,
        )


@pytest.mark.parametrize(
    "capability, expected",
    [
        ((7, 5), (64, 32, 4, 1)),
        ((8, 0), (64, 32, 4, 2)),
        ((9, 0), (128, 64, 8, 2)),
    ],
)
def test_user_tile_sizes_get_warps_and_stages_for_the_gpu(
    capability, expected
):
    assert launch.user_config(expected[0], expected[1], capability) == expected


# --- bad input ---------------------------------------------------------------


def _t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (
            (_t(2, 8, 16), _t(2, 8, 16), _t(2, 8, 16)),
            {},
            r"4-D .*q \(2, 8, 16\)",
        ),
        (
            (_t(1, 2, 8, 16), _t(1, 2, 8, 32), _t(1, 2, 8, 32)),
            {},
            r"head dimension.*q \(1, 2, 8, 16\), k \(1, 2, 8, 32\)",
        ),
        (
            (_t(1, 2, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 9, 16)),
            {},
            r"n_k.*k \(1, 2, 8, 16\), v \(1, 2, 9, 16\)",
        ),
        (
            (_t(1, 2, 8, 16), _t(2, 2, 8, 16), _t(2, 2, 8, 16)),
            {},
            r"batch size.*k \(2, 2, 8, 16\)",
        ),
        (
            (_t(1, 4, 8, 16), _t(1, 2, 8, 16), _t(1, 1, 8, 16)),
            {},
            r"k and v must have the same number of heads",
        ),
        (
            (_t(1, 3, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 16)),
            {},
            r"multiple of the key/value heads.*q \(1, 3, 8, 16\)",
        ),
        (
            (_t(1, 1, 9, 16), _t(1, 1, 8, 16), _t(1, 1, 8, 16)),
            dict(causal=True),
            r"n_q <= n_k.*q \(1, 1, 9, 16\)",
        ),
        (
            (_t(1, 1, 0, 16), _t(1, 1, 8, 16), _t(1, 1, 8, 16)),
            {},
            r"empty.*q \(1, 1, 0, 16\)",
        ),
        (
            (_t(1, 1, 8, 512), _t(1, 1, 8, 512), _t(1, 1, 8, 512)),
            {},
            r"at most 256.*q \(1, 1, 8, 512\)",
        ),
        (
            (
                _t(1, 1, 8, 16),
                _t(1, 1, 8, 16, dtype=torch.float16),
                _t(1, 1, 8, 16),
            ),
            {},
            r"one dtype.*float16",
        ),
        (
            (_t(1, 1, 8, 16, dtype=torch.float64),) * 3,
            {},
            r"one dtype.*float64",
        ),
        (
            (_t(1, 1, 8, 16),) * 3,
            dict(block_q=24),
            r"block_q must be a power of two",
        ),
        (
            (_t(1, 1, 8, 16),) * 3,
            dict(block_k=8),
            r"block_k must be a power of two",
        ),
    ],
)
def test_bad_input_raises_value_error_naming_it(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        triton_flash_attention(*args, **kwargs)


def test_bfloat16_is_refused_where_it_cannot_work():
    x = _t(1, 1, 8, 16, dtype=torch.bfloat16)
    if DEVICE == "cpu":
        with pytest.raises(
            ValueError, match="interpreter mishandles bfloat16"
        ):
            triton_flash_attention(x, x, x)
    elif torch.cuda.get_device_capability() < (8, 0):
        with pytest.raises(ValueError, match="compute capability 8.0"):
            triton_flash_attention(x, x, x)


def test_non_tensor_raises_type_error():
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        triton_flash_attention(
            np.zeros((1, 1, 4, 16)), _t(1, 1, 4, 16), _t(1, 1, 4, 16)
        )


def _backward_inputs(**change):
    """(do, q, k, v, out, lse) of a small forward pass, with the named ones
    replaced."""
    q, k, v = (x.detach() for x in random_qkv(1, 2, 8, 8, 16, torch.float32))
    out, lse = flash_forward(q, k, v)
    args = dict(do=torch.ones_like(out), q=q, k=k, v=v, out=out, lse=lse)
    return {**args, **{name: f(args) for name, f in change.items()}}


@pytest.mark.parametrize(
    "change, kwargs, match",
    [
        (
            dict(do=lambda a: a["do"][:, :, :5]),
            {},
            r"do and out must have q's shape.*do \(1, 2, 5, 16\)",
        ),
        (
            dict(out=lambda a: a["out"].transpose(2, 3)),
            {},
            r"q's shape.*out \(1, 2, 16, 8\)",
        ),
        (
            dict(lse=lambda a: a["lse"][..., None]),
            {},
            r"lse \(batch, heads, n_q\).*lse \(1, 2, 8, 1\)",
        ),
        (
            dict(do=lambda a: a["do"].half()),
            {},
            r"q's dtype torch.float32.*do torch.float16",
        ),
        (
            dict(lse=lambda a: a["lse"].double()),
            {},
            r"lse float32.*lse torch.float64",
        ),
        (
            dict(k=lambda a: a["k"][..., :8]),
            {},
            r"head dimension.*k \(1, 2, 8, 8\)",
        ),
        (
            dict(
                q=lambda a: torch.cat([a["q"]] * 2, 2),
                do=lambda a: torch.cat([a["do"]] * 2, 2),
                out=lambda a: torch.cat([a["out"]] * 2, 2),
                lse=lambda a: torch.cat([a["lse"]] * 2, 2),
            ),
            dict(causal=True),
            r"n_q <= n_k",
        ),
        ({}, dict(block_k=24), r"block_k must be a power of two"),
    ],
)
def test_flash_backward_validates_its_inputs(change, kwargs, match):
    """flash_backward checked nothing: a dO or an lse of the wrong shape or
    dtype reached the kernels."""
    with pytest.raises(ValueError, match=match):
        host.flash_backward(**_backward_inputs(**change), **kwargs)


def test_flash_backward_refuses_a_non_tensor():
    with pytest.raises(TypeError, match="lse must be a torch.Tensor"):
        host.flash_backward(
            **_backward_inputs(lse=lambda a: a["lse"].tolist())
        )


# --- the interpreter must be chosen before triton is imported ----------------


def _run_fresh_python(code: str) -> subprocess.CompletedProcess:
    env = {
        key: value
        for key, value in os.environ.items()
        if key != "TRITON_INTERPRET"
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="with a GPU the kernels are compiled, not interpreted",
)
def test_importing_the_module_first_selects_the_interpreter():
    result = _run_fresh_python("""
        import torch
        from attnbook.kernels import interpreted, triton_flash_attention
        q = torch.randn(1, 1, 20, 16)
        out = triton_flash_attention(q, q, q, causal=True)
        ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        print(interpreted(), bool(torch.allclose(out, ref, atol=1e-5)))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="with a GPU the kernels are compiled, not interpreted",
)
def test_importing_triton_too_early_gives_a_clear_error():
    result = _run_fresh_python("""
        import triton  # decorates Triton's own library before TRITON_INTERPRET is set
        import torch
        from attnbook.kernels import triton_flash_attention
        q = torch.randn(1, 1, 8, 16)
        triton_flash_attention(q, q, q)
    """)
    assert result.returncode != 0
    assert (
        "Triton was imported before TRITON_INTERPRET was set" in result.stderr
    )
