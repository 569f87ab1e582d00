"""flash_attention_numpy against torch (float64) and attnbook's naive
attention; its memory; its backward."""

import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnbook
from attnbook.bench import peak_memory
from attnbook.flash import (
    flash_attention_backward_numpy,
    flash_attention_numpy,
    key_tiles,
    tile_schedule,
)


def visible(n_q, n_k):
    """Causal visibility by index arithmetic: query i is position i + n_k -
    n_q."""
    i = np.arange(n_q)[:, None] + (n_k - n_q)
    return np.arange(n_k)[None, :] <= i


def torch_reference(q, k, v, causal=False, scale=None):
    """float64 torch SDPA with an explicit boolean mask (torch's own is_causal
    aligns top-left)."""
    q, k, v = (torch.as_tensor(np.array(x, np.float64)) for x in (q, k, v))
    mask = (
        torch.as_tensor(visible(q.shape[-2], k.shape[-2])) if causal else None
    )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale
    ).numpy()


TOL = {np.float64: 1e-10, np.float32: 2e-5, np.float16: 4e-3}


@st.composite
def problems(draw, max_n=70):
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    causal = draw(st.booleans())
    n_q = draw(st.integers(1, max_n))
    n_k = draw(st.integers(n_q if causal else 1, max_n))
    d_k, d_v = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    dtype = draw(st.sampled_from([np.float64, np.float32, np.float16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k, v = (
        rng.normal(size=lead + s).astype(dtype)
        for s in ((n_q, d_k), (n_k, d_k), (n_k, d_v))
    )
    return q, k, v, causal, draw(st.integers(1, 40)), draw(st.integers(1, 40))


@settings(max_examples=250, deadline=None)
@given(problems())
def test_matches_torch_float64_reference(problem):
    q, k, v, causal, block_q, block_k = problem
    got = flash_attention_numpy(
        q, k, v, causal=causal, block_q=block_q, block_k=block_k
    )
    assert got.shape == q.shape[:-1] + v.shape[-1:] and got.dtype == q.dtype
    tol = TOL[q.dtype.type]
    np.testing.assert_allclose(
        got.astype(np.float64),
        torch_reference(q, k, v, causal),
        rtol=tol,
        atol=tol,
    )


@settings(max_examples=100, deadline=None)
@given(problems())
def test_agrees_with_naive_attention_and_its_causal_mask(problem):
    q, k, v, causal, block_q, block_k = problem
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    mask = attnbook.causal_mask(q.shape[-2], k.shape[-2]) if causal else None
    expected, _ = attnbook.scaled_dot_product_attention(q, k, v, mask=mask)
    got = flash_attention_numpy(
        q, k, v, causal=causal, block_q=block_q, block_k=block_k
    )
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


@settings(max_examples=80, deadline=None)
@given(problems(max_n=40))
def test_log_sum_exp_is_that_of_the_scaled_masked_scores(problem):
    q, k, v, causal, block_q, block_k = problem
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    _, lse = flash_attention_numpy(
        q,
        k,
        v,
        causal=causal,
        block_q=block_q,
        block_k=block_k,
        return_lse=True,
    )
    scores = attnbook.attention_scores(q, k)
    if causal:
        scores = np.where(visible(q.shape[-2], k.shape[-2]), scores, -np.inf)
    np.testing.assert_allclose(
        lse, attnbook.logsumexp(scores, axis=-1), rtol=1e-12, atol=1e-12
    )


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 90),
    st.integers(0, 90),
    st.integers(1, 33),
    st.integers(1, 33),
    st.booleans(),
)
def test_schedule_covers_every_visible_score_once_and_skips_only_masked_tiles(
    n_q, extra, block_q, block_k, causal
):
    n_k = n_q + extra
    seen = np.zeros((n_q, n_k), int)
    for rows, cols, partial in tile_schedule(
        n_q, n_k, block_q, block_k, causal
    ):
        tile = (
            visible(n_q, n_k)[rows, cols]
            if causal
            else np.ones(
                (rows.stop - rows.start, cols.stop - cols.start), bool
            )
        )
        assert tile.any(), "a fully masked tile was computed"
        assert partial == (not tile.all()), (
            "the partial flag must say whether the tile needs a mask"
        )
        seen[rows, cols] += 1
    assert seen.max() == 1
    expected = visible(n_q, n_k) if causal else np.ones((n_q, n_k), bool)
    assert np.all(seen[expected] == 1)


def test_causal_square_skips_the_upper_triangle_of_tiles():
    tiles = list(tile_schedule(256, 256, 64, 64, causal=True))
    assert len(tiles) == 4 * 5 // 2
    assert sum(partial for *_, partial in tiles) == 4  # the diagonal tiles
    assert len(list(tile_schedule(256, 256, 64, 64))) == 16


def test_key_tiles_of_a_single_decoding_query_see_every_key():
    cols = [
        c for c, partial in key_tiles(slice(0, 1), 1, 130, 64, causal=True)
    ]
    assert [(c.start, c.stop) for c in cols] == [
        (0, 64),
        (64, 128),
        (128, 130),
    ]


def test_never_allocates_an_n_q_by_n_k_array():
    n, d = 2048, 32
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, d), dtype=np.float32) for _ in range(3))
    # warm up any lazy allocations
    flash_attention_numpy(q[:64], k[:64], v[:64])
    tracemalloc.start()
    try:
        out = flash_attention_numpy(q, k, v, block_q=64, block_k=64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    score_matrix = n * n * 4  # 16 MiB
    assert peak < score_matrix / 16, f"peak {peak} bytes"
    # and the tiles are what they claim: (block_q, block_k) per head, plus O(n
    # d) arrays
    assert peak < 8 * (64 * 64 * 4) + 4 * (n * d * 4)
    np.testing.assert_allclose(
        out, torch_reference(q, k, v), rtol=2e-5, atol=2e-5
    )


def test_memory_does_not_grow_with_n_k():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((4, 64, 16), dtype=np.float32)
    peaks = []
    for n_k in (512, 4096):
        k, v = (
            rng.standard_normal((4, n_k, 16), dtype=np.float32)
            for _ in range(2)
        )
        _, peak = peak_memory(flash_attention_numpy, q, k, v)
        peaks.append(peak)
    assert peaks[1] <= peaks[0] * 1.1


def test_large_scores_do_not_overflow():
    rng = np.random.default_rng(2)
    q, k, v = (
        rng.normal(scale=30, size=(50, 8)),
        rng.normal(scale=30, size=(70, 8)),
        rng.normal(size=(70, 3)),
    )
    got = flash_attention_numpy(q, k, v, causal=True, block_q=16, block_k=8)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(
        got, torch_reference(q, k, v, causal=True), rtol=1e-10, atol=1e-12
    )


def test_broadcast_leading_dims_and_custom_scale():
    rng = np.random.default_rng(3)
    q = rng.normal(size=(2, 3, 10, 4))
    k, v = rng.normal(size=(3, 12, 4)), rng.normal(size=(1, 12, 5))
    got = flash_attention_numpy(q, k, v, block_q=4, block_k=5, scale=0.7)
    expected = torch_reference(
        q,
        np.broadcast_to(k, (2, 3, 12, 4)),
        np.broadcast_to(v, (2, 3, 12, 5)),
        scale=0.7,
    )
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_length_one_and_integer_inputs():
    got = flash_attention_numpy(
        np.ones((1, 2), int),
        np.ones((1, 2), int),
        np.full((1, 3), 7),
        causal=True,
    )
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, [[7.0, 7.0, 7.0]])


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape, pattern",
    [
        ((5, 4), (6, 3), (6, 2), r"d_k.*\(5, 4\).*\(6, 3\)"),
        ((5, 4), (6, 4), (7, 2), r"n_k.*\(6, 4\).*\(7, 2\)"),
        ((4,), (6, 4), (6, 2), r"q must have at least 2 dimensions.*\(4,\)"),
        ((2, 5, 4), (3, 6, 4), (3, 6, 2), r"do not broadcast"),
    ],
)
def test_bad_shapes_are_value_errors_naming_them(
    q_shape, k_shape, v_shape, pattern
):
    with pytest.raises(ValueError, match=pattern):
        flash_attention_numpy(
            np.zeros(q_shape), np.zeros(k_shape), np.zeros(v_shape)
        )


@pytest.mark.parametrize(
    "kwargs",
    [dict(block_q=0), dict(block_k=-4), dict(block_q=8.0), dict(block_k=True)],
)
def test_bad_block_sizes_are_value_errors(kwargs):
    with pytest.raises(ValueError, match="block_"):
        flash_attention_numpy(
            np.zeros((3, 2)), np.zeros((3, 2)), np.zeros((3, 2)), **kwargs
        )


def test_causal_with_more_queries_than_keys_is_a_value_error():
    with pytest.raises(ValueError, match=r"n_q <= n_k.*\(5, 2\).*\(4, 2\)"):
        flash_attention_numpy(
            np.zeros((5, 2)), np.zeros((4, 2)), np.zeros((4, 2)), causal=True
        )


# --- backward ----------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(problems(max_n=40))
def test_backward_matches_torch_autograd(problem):
    q, k, v, causal, block_q, block_k = problem
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    d_out = np.random.default_rng(q.size).normal(
        size=q.shape[:-1] + v.shape[-1:]
    )
    out, lse = flash_attention_numpy(
        q,
        k,
        v,
        causal=causal,
        block_q=block_q,
        block_k=block_k,
        return_lse=True,
    )
    grads = flash_attention_backward_numpy(
        q,
        k,
        v,
        out,
        lse,
        d_out,
        causal=causal,
        block_q=block_q,
        block_k=block_k,
    )
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    mask = (
        torch.as_tensor(visible(q.shape[-2], k.shape[-2])) if causal else None
    )
    F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask).backward(
        torch.as_tensor(d_out)
    )
    for got, t in zip(grads, (tq, tk, tv)):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-9, atol=1e-11)


def test_backward_reduces_gradients_of_broadcast_inputs():
    rng = np.random.default_rng(4)
    q, k, v = (
        rng.normal(size=(2, 3, 6, 4)),
        rng.normal(size=(3, 7, 4)),
        rng.normal(size=(1, 1, 7, 2)),
    )
    d_out = rng.normal(size=(2, 3, 6, 2))
    out, lse = flash_attention_numpy(
        q, k, v, block_q=4, block_k=3, return_lse=True
    )
    dq, dk, dv = flash_attention_backward_numpy(
        q, k, v, out, lse, d_out, block_q=4, block_k=3
    )
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    F.scaled_dot_product_attention(tq, tk, tv).backward(torch.as_tensor(d_out))
    for got, t in zip((dq, dk, dv), (tq, tk, tv)):
        assert got.shape == tuple(t.shape)
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_backward_rejects_saved_tensors_of_the_wrong_shape():
    q = k = v = np.zeros((4, 2))
    with pytest.raises(ValueError, match=r"lse of shape \(4,\)"):
        flash_attention_backward_numpy(
            q, k, v, np.zeros((4, 2)), np.zeros((4, 1)), np.zeros((4, 2))
        )


def test_threads_give_bitwise_the_same_result():
    rng = np.random.default_rng(5)
    q, k, v = (
        rng.normal(size=(3, 150, 16)),
        rng.normal(size=(3, 170, 16)),
        rng.normal(size=(3, 170, 8)),
    )
    serial = flash_attention_numpy(
        q, k, v, causal=True, block_q=16, block_k=32, workers=1
    )
    threaded, lse = flash_attention_numpy(
        q,
        k,
        v,
        causal=True,
        block_q=16,
        block_k=32,
        workers=3,
        return_lse=True,
    )
    np.testing.assert_array_equal(serial, threaded)
    _, lse_serial = flash_attention_numpy(
        q,
        k,
        v,
        causal=True,
        block_q=16,
        block_k=32,
        workers=1,
        return_lse=True,
    )
    np.testing.assert_array_equal(lse, lse_serial)


@pytest.mark.parametrize("workers", [0, -1, 1.5, True])
def test_bad_workers_is_a_value_error(workers):
    with pytest.raises(ValueError, match="workers"):
        flash_attention_numpy(
            np.zeros((3, 2)),
            np.zeros((3, 2)),
            np.zeros((3, 2)),
            workers=workers,
        )


def test_in_the_browser_the_blocks_run_without_threads(monkeypatch):
    """Pyodide cannot start a thread: the query blocks run one after another
    there, with the same result, whatever `workers` asks for."""
    import attnbook.flash as flash_module

    def no_threads(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 40, 8)) for _ in range(3))
    expected = flash_module.flash_attention_numpy(q, k, v, block_q=8)
    monkeypatch.setattr(flash_module, "ThreadPoolExecutor", no_threads)
    monkeypatch.setattr(flash_module.sys, "platform", "emscripten")
    got = flash_module.flash_attention_numpy(q, k, v, block_q=8, workers=4)
    np.testing.assert_array_equal(got, expected)


def test_default_workers_are_the_cpus_the_process_may_use(monkeypatch):
    """The default thread count is the CPUs this process may run on (its
    affinity, as in a container limited to one CPU), not the machine's
    os.cpu_count(): with one CPU allowed, no thread pool starts."""
    import attnbook.flash as flash_module

    def no_pool(*args, **kwargs):
        raise AssertionError("a thread pool started on a one-CPU process")

    monkeypatch.setattr(flash_module.os, "cpu_count", lambda: 64)
    monkeypatch.delattr(flash_module.os, "process_cpu_count", raising=False)
    monkeypatch.setattr(
        flash_module.os, "sched_getaffinity", lambda pid: {0}, raising=False
    )
    assert flash_module.usable_cpus() == 1
    monkeypatch.setattr(flash_module, "ThreadPoolExecutor", no_pool)
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 40, 8)) for _ in range(3))
    got = flash_module.flash_attention_numpy(q, k, v, block_q=8)
    expected, _ = attnbook.scaled_dot_product_attention(q, k, v)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
