"""The measurement and figure helpers every chapter uses."""
import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402

from attnbook import bench, plotting  # noqa: E402


def test_time_call_measures_a_sleep():
    import time

    t = bench.time_call(time.sleep, 0.002, repeats=3, min_time=0.004)
    assert 0.0019 < t.median < 0.05
    assert t.low <= t.median <= t.high
    assert "ms" in str(t)


def test_time_call_loops_a_fast_call_until_min_time():
    t = bench.time_call(len, "abc", repeats=2, min_time=0.001)
    assert t.loops > 100 and t.median < 1e-4


def test_peak_memory_sees_a_numpy_allocation():
    result, peak = bench.peak_memory(lambda: np.ones(1_000_000).sum())
    assert result == 1_000_000
    assert 8_000_000 <= peak < 9_000_000


def test_format_bytes_and_machine():
    assert bench.format_bytes(512) == "512 B"
    assert bench.format_bytes(3 * 2**20) == "3.0 MiB"
    assert "numpy" in bench.machine() and "cores" in bench.machine()


def test_loglog_fit_recovers_an_exponent():
    x = np.array([10, 20, 40, 80])
    slope, _ = plotting.loglog_fit(x, 3 * x**2.0)
    assert abs(slope - 2) < 1e-9


def test_heatmap_draws_labels_and_values():
    fig, ax = plotting.figure()
    plotting.heatmap(ax, np.eye(2), row_labels=["a", "b"], col_labels=["c", "d"], title="t")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
    assert len(ax.texts) == 4 and ax.get_title() == "t"
    matplotlib.pyplot.close(fig)
