"""The GPU benchmark's pieces that do not need a GPU: FLOP counts, the naive
reference, tables, plots, the errors raised without CUDA, and what Triton
compiles for each GPU generation."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attnbook  # noqa: E402
from attnbook.kernels import host  # noqa: E402,F401  (before the next import: it imports triton)
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from attnbook.cost import benchmark_flops  # noqa: E402
from attnbook.experiments import gpu_bench  # noqa: E402

no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the behaviour without a CUDA GPU"
)


# --- FLOPs -------------------------------------------------------------------


def counted_flops(batch, heads, n, d):
    """Forward and backward FLOPs of naive attention as PyTorch's
    FlopCounterMode counts its products."""
    q, k, v = (
        torch.randn(batch, heads, n, d, requires_grad=True) for _ in range(3)
    )
    with FlopCounterMode(display=False) as forward:
        out = gpu_bench.naive_attention(q, k, v)
    with FlopCounterMode(display=False) as backward:
        out.backward(torch.ones_like(out))
    return forward.get_total_flops(), backward.get_total_flops()


@pytest.mark.parametrize(
    "batch, heads, n, d", [(1, 1, 8, 4), (2, 3, 16, 8), (1, 2, 32, 16)]
)
def test_forward_flops_match_pytorchs_flop_counter(batch, heads, n, d):
    fwd, _ = counted_flops(batch, heads, n, d)
    assert benchmark_flops(batch, heads, n, d) == fwd


@pytest.mark.parametrize("batch, heads, n, d", [(1, 1, 8, 4), (2, 3, 16, 8)])
def test_backward_is_naives_four_products_plus_the_recomputed_scores(
    batch, heads, n, d
):
    fwd, bwd = counted_flops(batch, heads, n, d)
    # FlashAttention recomputes S = Q K^T: one more product
    recompute_scores = fwd / 2
    assert (
        benchmark_flops(batch, heads, n, d, mode="bwd")
        == bwd + recompute_scores
    )
    assert (
        benchmark_flops(batch, heads, n, d, mode="fwd_bwd")
        == fwd + bwd + recompute_scores
    )


def test_causal_halves_every_mode():
    for mode in ("fwd", "bwd", "fwd_bwd"):
        full = benchmark_flops(2, 4, 1024, 64, mode=mode)
        assert (
            benchmark_flops(2, 4, 1024, 64, causal=True, mode=mode) == full / 2
        )


def test_unknown_mode_raises():
    with pytest.raises(ValueError, match="mode must be one of"):
        benchmark_flops(1, 1, 8, 8, mode="backward")


# --- the naive reference -----------------------------------------------------


@pytest.mark.parametrize("n_q, n_k", [(7, 7), (3, 11)])
def test_naive_attention_matches_sdpa_with_the_books_causal_mask(n_q, n_k):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, n_q, 8, generator=gen, dtype=torch.float64)
    k, v = (
        torch.randn(2, 3, n_k, 8, generator=gen, dtype=torch.float64)
        for _ in range(2)
    )
    mask = torch.from_numpy(attnbook.causal_mask(n_q, n_k))
    torch.testing.assert_close(
        gpu_bench.naive_attention(q, k, v, causal=True),
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    )
    torch.testing.assert_close(
        gpu_bench.naive_attention(q, k, v, scale=0.2),
        F.scaled_dot_product_attention(q, k, v, scale=0.2),
    )


def score_traffic_per_score(causal):
    """Bytes per score that naive attention's eager operations read and write
    in tensors of the scores' size, float16, counted op by op as they run
    (each eager operation reads its inputs and writes its output once)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    batch, heads, n, d = 2, 3, 16, 8
    scores = batch * heads * n * n

    class Traffic(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # views (the reshapes around the batched products) move nothing
            if func.is_view or func is torch.ops.aten._unsafe_view.default:
                return out
            flat = [*args, *(kwargs or {}).values()]
            outs = out if isinstance(out, (tuple, list)) else [out]
            for t in [*flat, *outs]:
                if isinstance(t, torch.Tensor) and t.numel() == scores:
                    Traffic.nbytes += t.numel() * t.element_size()
            return out

    q, k, v = (
        torch.randn(batch, heads, n, d).to(torch.float16) for _ in range(3)
    )
    with Traffic():
        gpu_bench.naive_attention(q, k, v, causal=causal)
    return Traffic.nbytes / scores


def test_naive_attention_moves_12_bytes_per_score_16_causal():
    """Chapter 10's T4 exercise: the product with K writes the scores (2
    bytes), the scaling reads and writes them (4), the softmax too (4), the
    product with V reads them (2); a causal masked_fill adds 4. The boolean
    mask, (n_q, n_k) and shared by every batch and head, is left out."""
    assert score_traffic_per_score(causal=False) == 12
    assert score_traffic_per_score(causal=True) == 16


def test_every_sdpa_backend_and_the_naive_one_are_listed():
    names = gpu_bench.implementations(include_numpy=False)
    assert (
        "triton (ch. 10)" in names
        and "naive torch" in names
        and "sdpa math" in names
    )
    assert {"sdpa flash", "sdpa efficient"} <= set(names)


# --- without a GPU -----------------------------------------------------------


@no_cuda
def test_without_cuda_the_benchmark_says_it_needs_a_gpu():
    assert (
        not gpu_bench.cuda_available() and not gpu_bench.bfloat16_supported()
    )
    for run in (
        gpu_bench.require_cuda,
        gpu_bench.benchmark,
        gpu_bench.memory_sweep,
    ):
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            run()
    assert "no CUDA GPU" in gpu_bench.device_report()


# --- tables and plots from rows ----------------------------------------------


def fake_rows():
    rows = []
    for impl, speed in (("triton (ch. 10)", 2.0), ("naive torch", 1.0)):
        for n in (512, 1024):
            ms = None if (impl == "naive torch" and n == 1024) else n / speed
            rows.append(
                dict(
                    impl=impl,
                    n=n,
                    d=64,
                    causal=False,
                    mode="fwd",
                    batch=1,
                    heads=1,
                    ms=ms,
                    tflops=None if ms is None else speed,
                    note="" if ms else "out of memory",
                )
            )
    return rows


def test_table_has_a_column_per_implementation_and_a_dash_for_gaps():
    table = gpu_bench.tflops_table(
        fake_rows(), d=64, causal=False, mode="fwd"
    ).splitlines()
    assert "triton (ch. 10)" in table[1] and "naive torch" in table[1]
    assert table[2].split()[1:] == ["2.00", "1.00"]
    assert table[3].split()[1:] == ["2.00", "-"]


def test_speedups_are_time_ratios_where_both_ran():
    ratios = gpu_bench.speedups(fake_rows(), over="naive torch")
    assert [(r["n"], r["speedup"]) for r in ratios] == [(512, 2.0)]


def test_plots_draw_one_line_per_implementation():
    fig = gpu_bench.plot_tflops(fake_rows(), "fwd")
    assert len(fig.axes[0].lines) == 2
    memory = [
        dict(
            impl=i,
            n=n,
            d=64,
            causal=False,
            peak_bytes=n * (n if i == "naive" else 1),
            note="",
        )
        for i in ("naive", "tiled")
        for n in (512, 1024, 2048)
    ]
    fig2 = gpu_bench.plot_memory(memory)
    assert len(fig2.axes[0].lines) == 2
    plt.close("all")


# --- what Triton compiles for each generation --------------------------------


def test_triton_uses_tensor_cores_on_ampere_and_hopper_but_not_on_turing():
    counts = gpu_bench.ptx_instruction_counts((75, 80, 90))
    assert (
        not any("mma" in op for op in counts[75])
        and counts[75]["fma.rn.f32"] > 1000
    )
    assert any(op.startswith("mma.sync") for op in counts[80])
    assert any(op.startswith("wgmma.mma_async") for op in counts[90])
