"""The traffic models count what the algorithms move, and the GPU table is
self-consistent."""

import math

import pytest

from attnbook.cost import attention_flops
from attnbook.flash import tile_schedule
from attnbook.memory_traffic import (
    GPUS,
    Traffic,
    attainable_flops,
    flash_traffic,
    naive_traffic,
)


def test_naive_traffic_by_hand():
    # n_q = 3, n_k = 5, d = 2: S, P written once and read once each (4 * 15), Q
    # and O (2 * 6), K and V (2 * 10)
    t = naive_traffic(3, 5, 2, bytes_per_element=1)
    assert t.bytes == 4 * 15 + 2 * 6 + 2 * 10
    assert t.flops == attention_flops(3, 5, 2, 2)


def test_naive_intensity_is_about_d_over_bytes_per_element_for_long_sequences():
    t = naive_traffic(65536, 65536, 64, bytes_per_element=2)
    # flops ~ (4d + 6) n^2, bytes ~ 4 n^2 * 2: intensity -> (4 * 64 + 6) / 8
    assert t.intensity == pytest.approx((4 * 64 + 6) / 8, rel=1e-2)


@pytest.mark.parametrize(
    "n_q, n_k, d, block_q",
    [(256, 256, 64, 64), (100, 130, 16, 32), (1, 77, 8, 16)],
)
def test_flash_traffic_non_causal_closed_form(n_q, n_k, d, block_q):
    t = flash_traffic(n_q, n_k, d, block_q, batch=3, bytes_per_element=2)
    passes = math.ceil(n_q / block_q)  # every query block reads all of K and V
    assert t.bytes == 3 * ((2 * n_q * d + passes * 2 * n_k * d) * 2 + 4 * n_q)
    # the same arithmetic as naive
    assert t.flops == attention_flops(n_q, n_k, d, d, batch=3)


def test_flash_causal_traffic_counts_the_scheduled_tiles():
    n, d, b = 512, 32, 64
    t = flash_traffic(n, n, d, b, causal=True, bytes_per_element=1)
    tiles = list(tile_schedule(n, n, b, b, causal=True))
    assert t.bytes == 2 * n * d + len(tiles) * 2 * b * d + 4 * n
    full = flash_traffic(n, n, d, b, bytes_per_element=1)
    assert t.flops / full.flops == pytest.approx(len(tiles) / (n // b) ** 2)


def test_flash_intensity_grows_with_the_query_block():
    small, large = (
        flash_traffic(8192, 8192, 64, b).intensity for b in (32, 128)
    )
    assert large == pytest.approx(4 * small, rel=0.05)
    # bytes: naive ~ 4 n^2, flash ~ 2 n d (n / block_q): the ratio is 2 block_q
    # / d
    ratio = (
        naive_traffic(8192, 8192, 64).bytes
        / flash_traffic(8192, 8192, 64, 128).bytes
    )
    assert ratio == pytest.approx(2 * 128 / 64, rel=0.02)


def test_gpu_table_and_roofline():
    a100_80 = next(
        g for g in GPUS if g.name.startswith("A100") and "80" in g.name
    )
    assert a100_80.ridge_point == pytest.approx(312e12 / 2.039e12)
    assert a100_80.sram_bytes == 108 * 192 * 1024
    for gpu in GPUS:
        assert gpu.shared_per_sm <= gpu.sram_per_sm
        assert attainable_flops(1.0, gpu) == gpu.hbm_bandwidth
        assert attainable_flops(10 * gpu.ridge_point, gpu) == gpu.fp16_flops
        assert attainable_flops(gpu.ridge_point, gpu) == pytest.approx(
            gpu.fp16_flops
        )


def test_shared_memory_one_block_can_use():
    """From an expert reading of chapter 9: its intensity exercise asks
    whether one thread block's tiles fit, and compared them with the SM's
    228 KiB; one block can address 227 KiB on the H100 (163 on the A100),
    since CUDA reserves 1 KiB per block (the CUDA guide's table of compute
    capabilities)."""
    from attnbook.kernels.time_model import T4

    per_block = {g.name: g.shared_per_block // 1024 for g in GPUS}
    assert per_block == {
        "A100 SXM4 40GB": 163,
        "A100 SXM4 80GB": 163,
        "H100 SXM5 80GB": 227,
    }
    for gpu in GPUS:
        assert gpu.shared_per_block == gpu.shared_per_sm - 1024
    # compute capability 7.5: no reserve, a block may use all 64 KiB
    assert T4.shared_per_block == T4.shared_per_sm == 64 * 1024


def test_traffic_intensity():
    assert Traffic(flops=10.0, bytes=4.0).intensity == 2.5


@pytest.mark.parametrize(
    "call",
    [
        lambda: naive_traffic(0, 4, 2),
        lambda: naive_traffic(4, 4, 2, bytes_per_element=0),
        lambda: flash_traffic(4, 4, 2, block_q=0),
        lambda: flash_traffic(4, 4, 2, 2, block_k=-1),
        lambda: flash_traffic(4, 4, 2.5, 2),
    ],
)
def test_bad_sizes_are_value_errors(call):
    with pytest.raises(ValueError, match="must be a positive integer"):
        call()


def test_every_gpu_source_is_in_the_bibliography():
    from pathlib import Path

    bib = (
        Path(__file__).resolve().parents[1] / "book" / "references.bib"
    ).read_text()
    # chapter 10's time model adds the T4
    from attnbook.kernel_time import T4

    for gpu in (*GPUS, T4):
        assert gpu.sources
        for key in gpu.sources:
            assert "{" + key + "," in bib, key


@pytest.mark.parametrize(
    "n_q, n_k, d, block_q",
    [(256, 256, 64, 64), (100, 300, 32, 32), (4096, 4096, 128, 128)],
)
def test_l2_aware_traffic_reads_each_input_once(n_q, n_k, d, block_q):
    from attnbook.memory_traffic import flash_traffic_l2

    l2 = flash_traffic_l2(n_q, n_k, d, block_q, batch=2, bytes_per_element=2)
    hbm = flash_traffic(n_q, n_k, d, block_q, batch=2, bytes_per_element=2)
    assert l2.flops == hbm.flops
    # Q, K, V, O once; the LSE
    assert l2.bytes == 2 * ((2 * n_q * d + 2 * n_k * d) * 2 + 4 * n_q)
    # equal with one query block
    assert l2.bytes <= hbm.bytes and (l2.bytes < hbm.bytes) == (n_q > block_q)
    # square, long: intensity about n / bytes_per_element, far above both GPUs'
    # ridge points
    if n_q == n_k >= 4096:
        assert l2.intensity > 5 * max(g.ridge_point for g in GPUS)
