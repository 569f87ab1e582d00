"""The time model of chapter 10's kernels: its counts against independent ones,
its rates against published peaks, and the shape it predicts."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("triton")

from attnbook import cost, memory_traffic as mt  # noqa: E402
from attnbook.kernels import time_model as kt  # noqa: E402
from attnbook.kernels.host import key_block_bounds, query_block_bounds  # noqa: E402
from attnbook.kernels.launch import gpu_configs  # noqa: E402

T4, A100, H100 = kt.HARDWARE
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)


def first_choices(hw, programs_per_sm=2):
    def configs_for(d):
        return {
            kernel: (
                *gpu_configs(kernel, d, hw.capability)[0][:2],
                programs_per_sm,
            )
            for kernel in ("forward", "backward_dkdv", "backward_dq")
        }

    return configs_for


def band(rows):
    """(d, causal, mode, n) -> (TFLOP/s at the bound, TFLOP/s with no
    overlap)."""
    out = {}
    for r in rows:
        key = (r["d"], r["causal"], r["mode"], r["n"])
        high, low = out.get(key, (None, None))
        if r["impl"].startswith("model bound: "):
            high = r["tflops"]
        elif r["impl"].startswith("model no overlap: "):
            low = r["tflops"]
        else:
            raise AssertionError(r["impl"])
        out[key] = (high, low)
    return out


def brute_force_visits(n, block_q, block_k, causal, keys_outer):
    """Scores and streamed rows from the kernels' own host-side bounds
    (attnbook.kernels.host)."""
    scores = rows = 0
    if keys_outer:
        for kb in range(-(-n // block_k)):
            width = min(block_k, n - kb * block_k)
            start = query_block_bounds(kb, n, n, block_q, block_k, causal)[0]
            scores, rows = scores + width * (n - start), rows + (n - start)
    else:
        for qb in range(-(-n // block_q)):
            height = min(block_q, n - qb * block_q)
            end = (
                key_block_bounds(qb, n, n, block_q, block_k, causal)[1]
                if causal
                else n
            )
            end = min(n, -(-end // block_k) * block_k)  # whole tiles
            scores, rows = scores + height * end, rows + end
    return scores, rows


@pytest.mark.parametrize("n", [1, 15, 16, 64, 100, 257])
@pytest.mark.parametrize("blocks", [(16, 16), (64, 32), (32, 64), (128, 64)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("keys_outer", [False, True])
def test_tile_visits_match_the_kernels_bounds(n, blocks, causal, keys_outer):
    block_q, block_k = blocks
    outer, inner = (block_k, block_q) if keys_outer else (block_q, block_k)
    assert kt.tile_visits(
        n, outer, inner, causal, keys_outer
    ) == brute_force_visits(n, block_q, block_k, causal, keys_outer)


def test_causal_tiles_cover_the_triangle_and_no_more_than_a_diagonal_band():
    for n, bq, bk in [(512, 128, 64), (1000, 64, 32)]:
        scores, _ = kt.tile_visits(n, bq, bk, causal=True)
        assert n * (n + 1) // 2 <= scores <= n * (n + 1) // 2 + n * max(bq, bk)
        assert kt.tile_visits(n, bq, bk, causal=False) == (
            n * n,
            n * -(-n // bq),
        )


@pytest.mark.parametrize("n", [100, 512, 4096])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_bytes_are_chapter_9s_traffic_models(n, causal):
    """In L2 the forward moves flash_traffic_l2's bytes; with no L2,
    flash_traffic's (independent counts)."""
    for hw, model in (
        (A100, mt.flash_traffic_l2),
        (dataclasses.replace(A100, l2_bytes=0), mt.flash_traffic),
    ):
        t = kt.kernel_time("forward", hw, 2, 3, n, 64, causal, 128, 64)
        assert t.in_l2 == (hw.l2_bytes > 0)
        expected = model(n, n, 64, 128, 64, batch=6, causal=causal).bytes
        assert t.memory * hw.gpu.hbm_bandwidth == pytest.approx(
            expected, rel=1e-12
        )


def test_rates_reproduce_the_published_peaks():
    # T4 datasheet
    assert T4.fp32_flops == pytest.approx(8.1e12, rel=0.01)
    assert T4.gpu.fp16_flops == pytest.approx(40 * 1024 * T4.clock, rel=0.01)
    # A100 datasheet
    assert A100.fp32_flops == pytest.approx(19.5e12, rel=0.01)
    assert A100.gpu.fp16_flops == pytest.approx(
        108 * 2048 * A100.clock, rel=0.01
    )
    assert H100.gpu.fp16_flops == pytest.approx(
        132 * 4096 * H100.clock, rel=0.01
    )
    # FlashAttention-3: 3.9 TFLOPS of exponentials
    assert H100.exp2_rate == pytest.approx(3.9e12, rel=0.02)
    assert (
        T4.dot_flops == T4.fp32_flops and A100.dot_flops == A100.gpu.fp16_flops
    )


def test_occupancy():
    # 4 warps at 255 registers: two programs (chapter 10)
    assert kt.occupancy(255, 4, 0, A100) == 2
    # shared memory decides
    assert kt.occupancy(128, 8, 100 * 1024, A100) == 1
    # the T4's 32 warps per SM decide
    assert kt.occupancy(32, 4, 0, T4) == 8
    with pytest.raises(ValueError, match="does not fit"):
        kt.occupancy(255, 16, 0, A100)


def test_the_band_is_the_busiest_unit_and_the_sum_of_all():
    t = kt.kernel_time("forward", H100, 2, 16, 4096, 64, False, 128, 64)
    units = t.units
    assert set(units) == {
        "tensor cores",
        "float32 units",
        "special functions",
        "HBM",
    }
    assert t.bound == max(t.dot, t.exp2, t.fp32, t.memory)
    assert t.no_overlap == pytest.approx(
        t.fixed + t.dot + t.exp2 + t.fp32 + t.memory, rel=1e-15
    )
    # at d = 64 the exponentials take as long as the products on an H100
    # (within a few per cent)
    assert t.exp2 == pytest.approx(t.dot, rel=0.05)
    # on the T4 the products run on the float32 units, beside the softmax's
    # instructions
    t4 = kt.kernel_time("forward", T4, 2, 16, 4096, 64, False, 64, 32)
    assert (
        t4.units["float32 units"] == pytest.approx(t4.dot + t4.fp32, rel=1e-15)
        and "tensor cores" not in t4.units
    )


def test_the_unavoidable_traffic_binds_the_h100_at_the_shortest_lengths():
    """Chapter 10: on the H100 at n = 512 (and n = 1024 causal) the bound is
    HBM, not the tensor cores. Counted independently: a forward must read Q, K,
    V and write O once (and the float32 LSE), over the sweep's 16,384 tokens x
    2048 features; the products are 4 d flops per score of whole tiles."""
    tokens, hidden, d = 16384, 2048, 64
    rows = {
        (r["causal"], r["n"]): r
        for r in kt.predict(
            H100,
            first_choices(H100),
            (512, 1024, 2048),
            d_heads=(d,),
            modes=("fwd",),
        )
        if r["impl"].startswith("model bound")
    }
    traffic = 4 * tokens * hidden * 2 + tokens * (hidden // d) * 4
    assert 268e6 < 4 * tokens * hidden * 2 < 269e6
    t_mem = traffic / H100.gpu.hbm_bandwidth
    # n = 512, full: every tile
    t_dot = 4 * d * tokens * (hidden // d) * 512 / H100.dot_flops
    assert (
        t_mem == pytest.approx(80.8e-6, rel=1e-3)
        and t_dot == pytest.approx(69.5e-6, rel=1e-3)
        and t_mem > t_dot
    )
    full, causal = rows[False, 512], rows[True, 512]
    assert full["bound_by"] == {"HBM": 1.0} and causal["bound_by"] == {
        "HBM": 1.0
    }
    assert full["ms"] == pytest.approx(t_mem * 1e3, rel=1e-12)
    # same bytes, half the counted flops
    assert causal["tflops"] == pytest.approx(full["tflops"] / 2, rel=1e-12)
    assert rows[True, 1024]["bound_by"] == {"HBM": 1.0} and rows[False, 1024][
        "bound_by"
    ] == {"tensor cores": 1.0}
    assert (
        rows[False, 2048]["bound_by"]
        == rows[True, 2048]["bound_by"]
        == {"tensor cores": 1.0}
    )
    # the A100's tensor cores bind every forward point of the sweep
    a100 = kt.predict(A100, first_choices(A100), SEQ_LENS, modes=("fwd",))
    assert all(r["bound_by"] == {"tensor cores": 1.0} for r in a100)
    # forward and backward: the shares of the bound add to 1, and the
    # preprocess kernel is memory
    both = kt.predict(
        H100,
        first_choices(H100),
        (4096,),
        d_heads=(d,),
        causal=(False,),
        modes=("fwd_bwd",),
    )[0]
    assert list(both["bound_by"]) == ["tensor cores", "HBM"] and sum(
        both["bound_by"].values()
    ) == pytest.approx(1)


def test_float32_instructions_are_issue_slots_not_flops():
    """A fused multiply-add is two flops but one instruction: the softmax's 4
    instructions per score take 4 issue slots, so at the float32 flop rate they
    would be counted at half their cost."""
    assert A100.fp32_instructions * 2 == A100.fp32_flops
    scores = kt.tile_visits(1024, 128, 64, False)[0] * 2 * 16
    t = kt.kernel_time("forward", A100, 2, 16, 1024, 64, False, 128, 64)
    assert t.fp32 == pytest.approx(
        4 * scores / (108 * 64 * A100.clock), rel=1e-12
    )


@pytest.mark.parametrize("hw", kt.HARDWARE, ids=lambda hw: hw.gpu.name)
def test_the_shape_of_the_predicted_band(hw):
    rows = kt.predict(hw, first_choices(hw), SEQ_LENS)
    tf = band(rows)
    in_l2 = {
        (r["d"], r["causal"], r["mode"], r["n"]): r["in_l2"] for r in rows
    }
    for key, (high, low) in tf.items():
        assert 0 < low < high
    for d in (64, 128):
        for mode in ("fwd", "fwd_bwd"):
            for side in (0, 1):
                # rising with n, as long as the L2 holds the keys and values of
                # the heads in flight
                for c in (False, True):
                    curve = [
                        tf[d, c, mode, n][side]
                        for n in SEQ_LENS
                        if in_l2[d, c, mode, n]
                    ]
                    assert len(curve) >= 5 and curve == sorted(curve)
                full = [tf[d, False, mode, n][side] for n in SEQ_LENS]
                causal = [tf[d, True, mode, n][side] for n in SEQ_LENS]
                # the diagonal matters less and less
                assert causal[0] < full[0] and causal[-1] > 0.96 * full[-1]
        for causal_ in (False, True):
            for n in SEQ_LENS:
                assert (
                    tf[d, causal_, "fwd_bwd", n][1]
                    < tf[d, causal_, "fwd", n][1]
                )
                # never above the units the products run on; the backward
                # recomputes S and dP, so 9 products run where 7 are counted
                assert tf[d, causal_, "fwd", n][0] <= hw.dot_flops / 1e12 * (
                    1 + 1e-12
                )
                assert tf[d, causal_, "fwd_bwd", n][
                    0
                ] <= hw.dot_flops * 7 / 9 / 1e12 * (1 + 1e-12)
    # tensor cores: exp2 costs relatively less with more d per score
    if hw.capability >= (8, 0):
        assert all(
            tf[128, c, m, n][1] > tf[64, c, m, n][1]
            for c in (False, True)
            for m in ("fwd", "fwd_bwd")
            for n in SEQ_LENS
        )


def test_hardware_is_matched_by_capability_memory_and_sms_not_by_name():
    gib = 2**30
    # H100 SXM5 80GB
    assert kt.hardware_for((9, 0), int(79.2 * gib), 132) is H100
    # H100 PCIe: 114 SMs
    assert kt.hardware_for((9, 0), int(79.2 * gib), 114) is None
    # H100 NVL, 94 GB
    assert kt.hardware_for((9, 0), int(93.1 * gib)) is None
    assert kt.hardware_for((8, 0), int(79.2 * gib), 108) is A100
    # A100 40GB: not the model's A100
    assert kt.hardware_for((8, 0), int(39.4 * gib), 108) is None
    assert kt.hardware_for((7, 5), int(14.7 * gib), 40) is T4
    assert kt.hardware_for((8, 9), int(22.0 * gib), 58) is None  # L4


def test_the_t4s_l2_stops_holding_a_head_at_d_128_and_n_16384():
    """K and V of one head at n = 16384, d = 128 are 8 MiB against the T4's 4
    MiB of L2; the backward's 16-row tiles then re-read them from memory, and
    its dQ kernel waits on memory, not arithmetic."""
    configs = first_choices(T4)(128)
    launches = kt.pass_time(T4, 1, 16, 16384, 128, False, "fwd_bwd", configs)
    assert not any(k.in_l2 for k in launches)
    dq = next(k for k in launches if k.kernel == "backward_dq")
    assert dq.bound == dq.memory
    assert all(
        k.in_l2
        for k in kt.pass_time(T4, 2, 16, 8192, 128, False, "fwd_bwd", configs)[
            :3
        ]
    )


def test_time_grows_linearly_with_n_at_fixed_tokens():
    """batch * n is fixed, so the work is proportional to n: twice the length,
    about twice the time."""
    rows = kt.predict(
        H100,
        first_choices(H100),
        (8192, 16384),
        d_heads=(64,),
        causal=(False,),
        modes=("fwd",),
    )
    for label in ("bound", "no overlap"):
        ms = [
            r["ms"]
            for r in rows
            if r["impl"] == f"model {label}: {H100.gpu.name}"
        ]
        assert ms[1] / ms[0] == pytest.approx(2.0, rel=0.03)
    assert cost.benchmark_flops(1, 32, 16384, 64) == 2 * cost.benchmark_flops(
        2, 32, 8192, 64
    )


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="mode"):
        kt.pass_time(A100, 1, 1, 64, 64, False, "bwd", {})
    with pytest.raises(ValueError, match="n"):
        kt.tile_visits(0, 64, 64, False)


def test_launch_configs_take_the_first_choice_and_its_occupancy():
    from attnbook.kernels.resources import Resources, Row

    def resources(kernel, config, registers, shared):
        return Resources(
            Row(kernel, 64, "fp16", *config, 80),
            registers,
            0,
            0,
            shared,
            0,
            0,
            0,
        )

    fwd, bwd, dq = (
        gpu_configs(kind, 64, (8, 0))[0]
        for kind in ("forward", "backward_dkdv", "backward_dq")
    )
    table = [
        resources("forward", fwd, 128, 48 * 1024),
        resources("backward_dkdv", bwd, 200, 30 * 1024),
        resources("backward_dq", dq, 120, 24 * 1024),
        # a fallback: not the first choice
        resources("forward", (16, 16, 4, 1), 32, 1024),
    ]
    configs = kt.launch_configs(A100, 64, table)
    assert configs["forward"] == (
        fwd[0],
        fwd[1],
        kt.occupancy(128, fwd[2], 48 * 1024, A100),
    )
    assert configs["backward_dkdv"] == (
        bwd[0],
        bwd[1],
        kt.occupancy(200, bwd[2], 30 * 1024, A100),
    )
    with pytest.raises(
        ValueError, match="no compiled resources for backward_dq"
    ):
        kt.launch_configs(A100, 64, table[:2])
