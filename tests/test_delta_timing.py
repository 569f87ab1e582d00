"""The timing helpers of the delta-rule chapter
(attnbook.experiments.delta_timing) return one positive time per length and
form; no time is compared (the machine is shared)."""

import pytest

from attnbook.experiments.delta_timing import time_decode_step, time_forms


def test_time_forms_shapes(one_torch_thread):
    times = time_forms(
        [8, 16], d=4, chunk_size=4, repeats=1, sweeps=1, recurrent_max_n=8
    )
    assert set(times) == {"recurrent", "chunkwise", "softmax"}
    assert len(times["recurrent"]) == 1 and len(times["softmax"]) == 2
    assert all(t > 0 for ts in times.values() for t in ts)


def test_time_decode_step_shapes(one_torch_thread):
    times = time_decode_step([4, 8, 16], n_heads=2, d=4, repeats=1)
    assert [len(times[k]) for k in ("state", "kv cache")] == [3, 3]
    with pytest.raises(ValueError, match="context must be a positive"):
        time_decode_step([0], d=4)
