"""PyTorch's context parallelism (torch.distributed.tensor.experimental) on
gloo CPU processes, against attnbook's ring on the same shards.

What runs is compared to 1e-10 in float64; what fails is asserted as it fails
with the pinned torch (2.13): the CP ring handlers are registered only for the
CUDA attention ops (flash, memory-efficient, cuDNN), and CPU SDPA calls
``aten._scaled_dot_product_flash_attention_for_cpu``, which DTensor can only
decompose. When a torch release changes that, this test fails and chapter 11's
account must be updated."""

import pytest

from attnbook.distributed.launch import launch
from attnbook.experiments import context_parallel as cp

TOL = 1e-10
NO_FORWARD = (
    "NotImplementedError: Operator "
    "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a "
    "sharding strategy registered."
)
NO_BACKWARD = NO_FORWARD.replace("cpu.default", "cpu_backward.default")
MIXED = "RuntimeError: aten.add.Tensor got mixed torch.Tensor and DTensor"


@pytest.fixture(scope="module")
def table():
    return launch(cp.torch_context_parallel_table, 2, (8,), timeout_s=180)


def test_load_balancer_deals_head_and_tail(table):
    for key in table[0]:
        assert table[0][key]["positions"] == [0, 1, 6, 7]
        assert table[1][key]["positions"] == [2, 3, 4, 5]


def test_default_backend(table):
    for report in table:
        # not causal: the forward runs (DTensor decomposes the CPU op) and
        # equals the ring; the backward has no sharding strategy
        forward = report[(None, False)]
        assert forward["forward"] < TOL
        assert forward["backward"] == NO_BACKWARD
        # causal: the forward fails already
        assert report[(None, True)]["forward"] == NO_FORWARD
        assert "backward" not in report[(None, True)]


def test_math_backend(table):
    for report in table:
        assert report[("MATH", False)]["forward"] < TOL
        assert report[("MATH", False)]["backward"] < TOL
        assert report[("MATH", True)]["forward"].startswith(MIXED)


def test_the_default_way_of_moving_the_shards_is_an_all_gather():
    """Chapter 11 says that PyTorch's context parallelism, in the pinned
    torch, gathers K and V once by default (``rotate_method``) and passes them
    rank to rank only after ``set_rotate_method("alltoall")``; dK and dV
    travel rank to rank in the backward. A release that changes the default
    fails here."""
    attention = pytest.importorskip(
        "torch.distributed.tensor.experimental._context_parallel._attention"
    )
    assert attention._cp_options.rotate_method is (
        attention._RotateMethod.ALL_GATHER
    )
