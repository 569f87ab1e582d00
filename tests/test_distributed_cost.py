"""attnbook.distributed.cost against hand counts and the formulas' limits."""

import math
import re
from pathlib import Path

import pytest

from attnbook.distributed.cost import (
    LLAMA3_8B,
    RATES,
    REPORTED,
    AttentionShape,
    cost_table,
    format_cost_table,
    kv_block_bytes,
    overlap_thresholds,
    overlap_tokens,
    ring_bytes,
    ring_memory,
    ring_step_seconds,
    tokens_per_device,
    ulysses_bytes,
    ulysses_kv_heads,
    ulysses_memory,
)

BIB = Path(__file__).resolve().parents[1] / "book" / "references.bib"
MHA = AttentionShape("small MHA", 4, 4, 8, 2)
GQA = AttentionShape("small GQA", 8, 2, 16, 4)


def test_tokens_per_device_is_the_largest_share():
    assert tokens_per_device(1 << 20, 8) == 131072
    assert tokens_per_device(10, 4) == 3
    assert tokens_per_device(0, 4) == 0
    assert tokens_per_device(3, 8) == 1


def test_ring_bytes_by_hand():
    # 16 tokens on 4 devices: blocks of 4 tokens, 2 kv heads of 16 features,
    # 4 bytes: k and v are 2 * 4 * 2 * 16 * 4 = 1024 bytes
    assert kv_block_bytes(4, GQA) == 1024
    assert ring_bytes(16, 4, GQA) == 3 * 1024
    # backward: k, v again 3 times, dk, dv 4 times (home at the end)
    assert ring_bytes(16, 4, GQA, backward=True) == 3 * 1024 + 4 * 1024
    # one device sends nothing
    assert ring_bytes(16, 1, GQA) == ring_bytes(16, 1, GQA, True) == 0


def test_the_gradients_travel_at_the_width_of_the_rings_accumulators():
    import torch

    from attnbook.distributed.ring import work_dtype

    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        b = torch.empty((), dtype=dtype).element_size()
        shape = AttentionShape("s", 8, 2, 16, b)
        width = torch.empty((), dtype=work_dtype(torch.empty(1, dtype=dtype)))
        assert shape.grad_bytes == width.element_size()
    assert LLAMA3_8B.grad_bytes == 4
    # bf16 k, v 3 times (512 bytes a block), float32 dk, dv 4 times (1024)
    bf16 = AttentionShape("bf16", 8, 2, 16, 2)
    assert ring_bytes(16, 4, bf16, backward=True) == 3 * 512 + 4 * 1024
    # gradients sent at the input's width, when asked
    narrow = AttentionShape("bf16 grads", 8, 2, 16, 2, (), 2)
    assert narrow.grad_bytes == 2
    assert ring_bytes(16, 4, narrow, backward=True) == 3 * 512 + 4 * 512
    with pytest.raises(ValueError):
        AttentionShape("bad", 8, 2, 16, 2, (), 0)


def test_ring_bytes_tend_to_the_whole_kv():
    # (P - 1) / P of the whole sequence's keys and values: it grows with P
    n = 1 << 20
    whole = kv_block_bytes(n, LLAMA3_8B)
    for p in (2, 8, 64, 512):
        assert ring_bytes(n, p, LLAMA3_8B) == whole * (p - 1) // p
    assert ring_bytes(n, 512, LLAMA3_8B) < whole


def test_ulysses_bytes_by_hand():
    # 16 tokens on 4 devices, MHA of 4 heads of 8, 2 bytes: a device's shard
    # of q, k, v, o is 4 tokens x 4 tensors x 4 heads x 8 x 2 bytes = 1024,
    # of which it keeps a quarter
    assert ulysses_bytes(16, 4, MHA) == 1024 * 3 // 4
    assert ulysses_bytes(16, 4, MHA, backward=True) == 768
    assert ulysses_bytes(16, 1, MHA) == 0


def test_ulysses_volume_is_that_of_the_blog_per_link():
    # the DeepSpeed analysis: 4 N h / P per link for MHA with hidden size h;
    # ours has the exact (P - 1) / P factor
    shape = AttentionShape("MHA 32 x 128", 32, 32, 128, 1)
    n, h = 1 << 16, 32 * 128
    for p in (2, 4, 8, 16, 32):
        exact = ulysses_bytes(n, p, shape)
        assert exact == 4 * n * h // p * (p - 1) // p
        assert exact <= 4 * n * h / p
    # constant when n and P grow together, but for the (P - 1) / P factor
    small, large = (
        ulysses_bytes(1 << 16, 8, shape),
        ulysses_bytes(1 << 17, 16, shape),
    )
    # (15 / 16) / (7 / 8)
    assert large * 16 * 7 == small * 15 * 8


def test_ulysses_copies_kv_heads_when_devices_outnumber_them():
    assert ulysses_kv_heads(4, LLAMA3_8B) == 8
    assert ulysses_kv_heads(8, LLAMA3_8B) == 8
    assert ulysses_kv_heads(16, LLAMA3_8B) == 16
    assert ulysses_kv_heads(32, LLAMA3_8B) == 32
    with pytest.raises(ValueError, match="must divide n_heads=32"):
        ulysses_kv_heads(64, LLAMA3_8B)
    with pytest.raises(ValueError, match="divide one another"):
        ulysses_kv_heads(4, AttentionShape("six kv", 12, 6, 8))


def test_memory_by_hand():
    mem = ring_memory(16, 4, GQA)
    # 4 tokens x (8 + 8 + 2 + 2 heads) x 16 x 4 bytes
    assert mem["local"] == 4 * 20 * 16 * 4
    assert mem["lse"] == 4 * 4 * 8
    assert mem["visiting"] == 2 * 1024
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    uly = ulysses_memory(16, 4, GQA)
    # after the all-to-all: 16 tokens of 2 query heads, 1 kv head (k, v), o
    assert uly["heads"] == 16 * (2 + 1 + 1 + 2) * 16 * 4
    assert uly["lse"] == 4 * 16 * 2
    assert uly["local"] == mem["local"]


def test_memory_falls_as_one_over_p():
    n = 1 << 20
    totals = [ring_memory(n, p, LLAMA3_8B)["total"] for p in (8, 16, 32)]
    assert totals[0] == 2 * totals[1] == 4 * totals[2]


def test_the_overlap_condition_by_hand():
    flops = RATES["H100 SXM BF16 dense"].value
    ib = RATES["InfiniBand NDR port"].value
    # c >= F H_kv b / (2 H B) = 989.4e12 * 8 * 2 / (2 * 32 * 50e9) = 4947
    assert overlap_tokens(LLAMA3_8B, flops, ib) == 4947
    assert overlap_tokens(LLAMA3_8B, flops, ib, causal=True) == 9894
    # backward: 2.5x the flops; bf16 k, v and float32 dk, dv, 3x the bytes:
    # 1.2 x 4947 = 5936.4
    assert overlap_tokens(LLAMA3_8B, flops, ib, backward=True) == 5937
    # with the gradients in bf16, 2x the bytes: 0.8 x 4947 = 3957.6
    narrow = AttentionShape("bf16 grads", 32, 8, 128, 2, (), 2)
    assert overlap_tokens(narrow, flops, ib, backward=True) == 3958
    nvlink = RATES["NVLink 4 per direction"].value
    # 989.4e12 / (4 * 450e9) = 549.67
    assert overlap_tokens(LLAMA3_8B, flops, nvlink) == 550


def test_the_overlap_condition_is_liu_et_al_for_mha_in_bf16():
    # c >= F / B with H_kv = H, b = 2
    shape = AttentionShape("MHA bf16", 16, 16, 64, 2)
    assert overlap_tokens(shape, 3e14, 2.5e10) == 12000
    assert overlap_tokens(shape, 3e14 + 1, 2.5e10) == 12001


def test_at_the_overlap_bound_compute_covers_transfer():
    flops, link = 989.4e12, 50e9
    for causal in (False, True):
        c = overlap_tokens(LLAMA3_8B, flops, link, causal=causal)
        compute, transfer = ring_step_seconds(
            c, LLAMA3_8B, flops, link, causal
        )
        assert compute >= transfer
        compute, transfer = ring_step_seconds(
            c - 1, LLAMA3_8B, flops, link, causal
        )
        assert compute < transfer


def test_the_thresholds_at_the_published_rates():
    found = overlap_thresholds()
    assert found["InfiniBand NDR port", "forward"] == 4947
    assert found["InfiniBand NDR port", "forward, causal"] == 9894
    assert found["InfiniBand NDR port", "backward"] == 5937
    assert found["NVLink 4 per direction", "forward"] == 550
    assert found["NVLink 4 per direction", "backward"] == 660
    assert found["NVLink 4 per direction", "backward, causal"] == 1320
    # the chapter's ring: a forward that hides its transfer need not have a
    # backward that does (the backward needs more tokens)
    for link in ("NVLink 4 per direction", "InfiniBand NDR port"):
        assert found[link, "backward"] > found[link, "forward"]
    # the causal threshold is twice the full block's, up to the rounding
    for (link, name), tokens in found.items():
        if "causal" in name:
            plain = found[link, name.replace(", causal", "")]
            assert 2 * plain - 1 <= tokens <= 2 * plain


def test_overlap_rejects_non_positive_rates():
    with pytest.raises(ValueError, match="must be positive"):
        overlap_tokens(LLAMA3_8B, 0, 1e9)


def test_the_table_for_a_million_tokens():
    rows = cost_table()
    assert [r.world_size for r in rows] == [8, 16, 32, 64, 128, 256, 512]
    assert [r.tokens_per_device for r in rows] == [
        (1 << 20) // p for p in (8, 16, 32, 64, 128, 256, 512)
    ]
    # Ulysses splits 32 heads: not over 64 devices or more
    assert [r.ulysses_bytes is None for r in rows] == [False] * 3 + [True] * 4
    # causal, balanced: NVLink needs 1100 tokens per device, IB 9894
    assert all(r.overlaps_nvlink for r in rows)
    assert [r.overlaps_infiniband for r in rows] == [True] * 4 + [False] * 3
    # ring's bytes grow toward the whole kv, Ulysses's fall as 1 / P
    fwd = [r.ring_forward_bytes for r in rows]
    assert fwd == sorted(fwd)
    uly = [r.ulysses_bytes for r in rows[:3]]
    assert uly == sorted(uly, reverse=True)
    text = format_cost_table(rows)
    assert text.splitlines()[0].split()[0] == "GPUs"
    assert len(text.splitlines()) == 2 + len(rows)
    assert [r.ring_block_bytes for r in rows] == [
        kv_block_bytes(r.tokens_per_device, LLAMA3_8B) for r in rows
    ]
    assert text.splitlines()[2].split() == [
        "8",
        "131072",
        "512.0",
        "3584.0",
        "11776.0",
        "2240.0",
        "3600.0",
        "5136.0",
        "yes",
        "yes",
    ]
    # it fits the book's code column
    assert max(len(line) for line in text.splitlines()) <= 79


def test_every_rate_and_figure_is_cited_in_the_bibliography():
    keys = set(re.findall(r"^@\w+\{([^,\s]+),", BIB.read_text(), re.M))
    for name, rate in RATES.items():
        assert rate.sources and set(rate.sources) <= keys, name
    for figure in REPORTED:
        assert figure.source in keys, figure
    assert set(LLAMA3_8B.sources) <= keys


def test_the_rates_are_consistent():
    assert RATES["NVLink 4 per direction"].value * 2 == pytest.approx(
        RATES["NVLink 4 total"].value
    )
    # 400 Gb/s is 50 GB/s
    assert RATES["InfiniBand NDR port"].value * 8 == 400e9
    assert math.isclose(RATES["H100 SXM BF16 dense"].value, 989.4e12)
