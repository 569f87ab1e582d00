"""The timing helpers of the delta-rule chapter
(attnbook.experiments.delta_timing) return one positive time per length and
form; no time is compared (the machine is shared)."""

import pytest
import torch

from attnbook.experiments.delta_timing import (
    _inputs,
    time_decode_step,
    time_forms,
)


def test_time_forms_shapes(one_torch_thread):
    times = time_forms(
        [8, 16], d=4, chunk_size=4, repeats=1, sweeps=1, recurrent_max_n=8
    )
    assert set(times) == {"recurrent", "chunkwise", "softmax"}
    assert len(times["recurrent"]) == 1 and len(times["softmax"]) == 2
    assert all(t > 0 for ts in times.values() for t in ts)


def test_softmax_is_timed_on_inputs_that_select_the_fused_kernel():
    # 3-D inputs send scaled_dot_product_attention to its math path (0);
    # the 4-D inputs the timing uses select a fused kernel
    q, k, v, _ = _inputs(64, 8, 0)
    assert q.dim() == 4
    assert torch._fused_sdp_choice(q, k, v, is_causal=True) != 0
    assert torch._fused_sdp_choice(q[0], k[0], v[0], is_causal=True) == 0


def test_time_decode_step_shapes(one_torch_thread):
    times = time_decode_step([4, 8, 16], n_heads=2, d=4, repeats=1)
    # the step does the same work at every context: one time
    assert isinstance(times["state"], float) and times["state"] > 0
    assert len(times["kv cache"]) == 3
    with pytest.raises(ValueError, match="context must be a positive"):
        time_decode_step([0], d=4)
