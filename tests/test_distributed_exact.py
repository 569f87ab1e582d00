"""Ring attention and Ulysses (on every layout) on 1, 2 and 4 gloo processes:
outputs and the gradients of q, k, v equal single-process attention to 1e-10
in float64, and the ring's processes equal its single-process simulation. One
launch per world size runs every case (a process start costs seconds)."""

import pytest

from attnbook.distributed.launch import launch
from attnbook.experiments import context_parallel as cp

TOL = 1e-10
LAYOUTS = ["contiguous", "striped", "zigzag"]


def cases_for(world_size):
    cases = []
    for layout in LAYOUTS:
        for causal in (False, True):
            cases += [
                # n not divisible by the world size
                cp.case("ring", n=4 * world_size + 3, causal=causal,
                        layout=layout, seed=1),
                # GQA, two sequences
                cp.case("ring", n=2 * world_size + 1, batch=2, n_heads=4,
                        n_kv_heads=2, causal=causal, layout=layout, seed=2),
                # MQA
                cp.case("ring", n=9, n_heads=4, n_kv_heads=1, causal=causal,
                        layout=layout, seed=3),
            ]  # fmt: skip
    for causal in (False, True):
        cases += [
            cp.case("ulysses", n=4 * world_size + 1, causal=causal, seed=4),
            cp.case("ulysses", n=11, n_heads=8, n_kv_heads=world_size,
                    batch=2, causal=causal, seed=5),
        ]  # fmt: skip
        # Ulysses all-gathers the positions: any layout works
        cases += [
            cp.case("ulysses", n=4 * world_size + 3, n_heads=8,
                    n_kv_heads=world_size, causal=causal, layout=layout,
                    seed=8)
            for layout in LAYOUTS[1:]
        ]  # fmt: skip
    # bfloat16 inputs: the ring computes and accumulates in float32
    cases.append(
        cp.case("ring", n=13, n_heads=4, n_kv_heads=2, causal=True,
                layout="zigzag", seed=9, dtype="bfloat16")
    )  # fmt: skip
    # shards of length 0 and 1
    for method in ("ring", "ulysses"):
        cases.append(cp.case(method, n=world_size - 1, causal=True, seed=6))
        cases.append(cp.case(method, n=world_size, causal=True, seed=7))
    return [c for c in cases if c["n"] > 0 or c["method"] == "ring"]


@pytest.fixture(scope="module", params=[1, 2, 4])
def run(request):
    world_size = request.param
    cases = cases_for(world_size)
    results = launch(cp.run_cases, world_size, (cases,), timeout_s=120)
    return world_size, cp.case_errors(cases, world_size, results)


def test_every_case_is_exact(run):
    world_size, rows = run
    assert len(rows) >= 12
    for row in rows:
        assert "error" not in row, row
        # bfloat16 outputs and gradients are rounded to bfloat16
        tol = TOL if row["dtype"] == "float64" else 3e-2
        assert row["reference"] < tol, row
        if row["method"] == "ring":
            assert row["simulation"] < TOL, row


def test_ulysses_refuses_heads_not_divisible():
    cases = [
        cp.case("ulysses", n=6, n_heads=3, n_kv_heads=3),
        cp.case("ulysses", n=6, n_heads=4, n_kv_heads=1),
    ]
    results = launch(cp.run_cases, 2, (cases,), timeout_s=120)
    for per_rank in results:
        assert "3 heads are not divisible by world size 2" in per_rank[0]
        assert (
            "1 key/value heads are not divisible by world size 2"
            in (per_rank[1])
        )
