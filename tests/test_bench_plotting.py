"""The measurement and figure helpers every chapter uses."""

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pytest  # noqa: E402

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


def test_time_call_runs_a_slow_call_exactly_repeats_times():
    """A call longer than min_time needs no loops: the calibration's run is the
    first repeat."""
    import time

    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.003)

    t = bench.time_call(slow, repeats=5, min_time=0.001)
    assert t.loops == 1 and t.repeats == 5 and len(calls) == 5
    assert 0.0029 < t.low <= t.median <= t.high
    calls.clear()
    t = bench.time_call(slow, repeats=5, min_time=0.0)
    assert t.loops == 1 and len(calls) == 5


def test_time_call_counts_loops_of_the_calibration_once():
    calls = []
    t = bench.time_call(lambda: calls.append(1), repeats=3, min_time=0.001)
    # calibration: 1 + 2 + ... + loops calls, of which the last `loops` are the
    # first repeat
    assert len(calls) == (2 * t.loops - 1) + 2 * t.loops


def test_time_call_rejects_a_bad_repeat_count():
    import pytest

    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="repeats"):
            bench.time_call(len, "abc", repeats=bad)


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


def test_fit_power_law_recovers_an_exponent_and_trusts_a_clean_curve():
    x = np.array([512, 1024, 2048, 4096])
    fit = bench.fit_power_law(x, 3e-9 * x**2.0)
    # the same least squares
    slope, intercept = plotting.loglog_fit(x, 3e-9 * x**2.0)
    assert abs(fit.slope - 2) < 1e-9 and abs(fit.intercept - intercept) < 1e-9
    assert np.allclose(fit.local, [2, 2, 2]) and fit.reliable


def test_fit_power_law_flags_one_slow_point():
    x = np.array([512, 1024, 2048])
    y = 1e-8 * x**2.0
    # one disturbed timing: local slopes 2 - log2(3) and 2
    y[0] *= 3
    fit = bench.fit_power_law(x, y)
    assert np.allclose(fit.local, [2 - np.log2(3), 2])
    assert not fit.reliable and abs(fit.spread - np.log2(3)) < 1e-12
    assert bench.fit_power_law(x, y, max_spread=1.6).reliable


def test_fit_power_law_rejects_bad_input():
    import pytest

    with pytest.raises(ValueError, match="at least 3"):
        bench.fit_power_law([1, 2], [1, 4])
    with pytest.raises(ValueError, match="equal length"):
        bench.fit_power_law([1, 2, 4], [1, 4])
    with pytest.raises(ValueError, match="positive"):
        bench.fit_power_law([1, 2, 4], [1, 0, 16])
    with pytest.raises(ValueError, match="distinct"):
        bench.fit_power_law([1, 2, 2], [1, 4, 4])


def test_one_blas_thread_limits_the_blas_and_restores_it():
    threadpoolctl = __import__("pytest").importorskip("threadpoolctl")
    np.ones((64, 64)) @ np.ones((64, 64))  # load the BLAS
    before = [
        lib["num_threads"]
        for lib in threadpoolctl.threadpool_info()
        if lib["user_api"] == "blas"
    ]
    with bench.one_blas_thread() as threads:
        inside = [
            lib["num_threads"]
            for lib in threadpoolctl.threadpool_info()
            if lib["user_api"] == "blas"
        ]
    after = [
        lib["num_threads"]
        for lib in threadpoolctl.threadpool_info()
        if lib["user_api"] == "blas"
    ]
    assert (
        threads == "1 (threadpoolctl)"
        and inside
        and all(t == 1 for t in inside)
    )
    assert after == before


def test_machine_names_the_blas_thread_count():
    """From an expert reading of chapter 9: the machine line said how many
    threads torch used but not numpy's BLAS, so a reader could not tell that
    naive attention's products ran on one thread."""
    import pytest

    threadpoolctl = pytest.importorskip("threadpoolctl")
    for limit, words in ((1, "(BLAS: 1 thread)"), (2, "(BLAS: 2 threads)")):
        with threadpoolctl.threadpool_limits(limits=limit, user_api="blas"):
            assert bench.blas_threads() == limit
            line = bench.machine()
        assert f"numpy {np.__version__} {words}" in line, line


def test_machine_without_threadpoolctl_leaves_the_blas_out(monkeypatch):
    import sys

    # an import of a module set to None raises ImportError
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)
    assert bench.blas_threads() is None
    assert "BLAS" not in bench.machine()


def test_heatmap_draws_labels_and_values():
    fig, ax = plotting.figure()
    plotting.heatmap(
        ax, np.eye(2), row_labels=["a", "b"], col_labels=["c", "d"], title="t"
    )
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
    assert len(ax.texts) == 4 and ax.get_title() == "t"
    matplotlib.pyplot.close(fig)


def test_flash_data_movement_draws_the_blocks_and_checks_its_arguments():
    import matplotlib

    matplotlib.use("Agg")
    import pytest
    from matplotlib.patches import FancyArrowPatch

    from attnbook import plotting

    fig, ax = plotting.figure()
    patches = plotting.flash_data_movement(
        ax, n_blocks=5, query_block=3, key_block=0
    )
    assert {f"{m}{b}" for m in "QKVO" for b in range(5)} <= set(patches)
    assert {
        "sram Q_i",
        "sram K_j",
        "sram V_j",
        "sram S_ij",
        "sram state",
    } <= set(patches)
    # the resident query block and the streamed key block are the coloured ones
    # in HBM
    grey = patches["Q0"].get_facecolor()
    assert (
        patches["Q3"].get_facecolor() != grey
        and patches["K0"].get_facecolor() != grey
    )
    assert (
        patches["K3"].get_facecolor() == grey
        and patches["O3"].get_facecolor() != grey
    )
    assert patches["sram Q_i"].get_facecolor() == patches["Q3"].get_facecolor()
    assert sum(isinstance(p, FancyArrowPatch) for p in ax.patches) >= 4
    texts = " ".join(t.get_text() for t in ax.texts)
    assert "HBM" in texts and "SRAM" in texts and "once" in texts
    fig.canvas.draw()
    for bad in (dict(n_blocks=1), dict(query_block=4), dict(key_block=-1)):
        with pytest.raises(ValueError):
            plotting.flash_data_movement(ax, **bad)


def test_cpu_caches_reads_per_core_sizes_from_sysfs(tmp_path):
    # a fake sysfs of the machine that builds the book: 32 KiB L1d and L1i, 512
    # KiB L2, 32 MiB L3
    for i, (level, kind, size) in enumerate(
        [
            (1, "Data", "32K"),
            (1, "Instruction", "32K"),
            (2, "Unified", "512K"),
            (3, "Unified", "32768K"),
        ]
    ):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert bench.cpu_caches(str(tmp_path)) == {
        "L1": 32 * 2**10,
        "L2": 512 * 2**10,
        "L3": 32 * 2**20,
    }
    assert bench.cpu_caches(str(tmp_path / "absent")) == {}


def _fit_with_local(*local, slope=2.0):
    return bench.PowerLawFit(slope, 0.0, tuple(local), 0.5)


def test_time_verdict_names_the_fit_whose_local_slopes_disagree():
    """The chapter 9 reading: the fastest runs' local slopes (1.67, 2.12)
    agree within 0.5, the medians' did not; the old sentence printed only the
    former and said they differ by more than 0.5."""
    fastest = _fit_with_local(1.67, 2.12, slope=1.9)
    medians = _fit_with_local(1.2, 2.4)
    verdict = bench.time_verdict("naive", fastest, medians, [1024, 2048, 4096])
    assert "its medians (1.20, 2.40) differ by more than 0.5" in (verdict)
    assert "those of its fastest runs, 1.67, 2.12, agree" in verdict
    assert "no reliable exponent" in verdict
    label = bench.time_fit_label(fastest, medians)
    assert label == "slope 1.90; medians disagree, no exponent read"


def test_time_verdict_lists_both_fits_when_both_disagree():
    fastest = _fit_with_local(4.21, 2.06)
    medians = _fit_with_local(1.0, 2.4)
    verdict = bench.time_verdict("flash", fastest, medians, [1024, 2048, 4096])
    assert "fastest runs: 4.21, 2.06; medians: 1.00, 2.40" in verdict
    assert "both its fits" in verdict and "agree)" not in verdict
    assert bench.time_fit_label(fastest, medians) == "no reliable slope"


def test_time_verdict_reads_an_exponent_only_from_agreeing_fits():
    good = _fit_with_local(1.95, 2.05, slope=2.0)
    near = _fit_with_local(1.9, 2.1, slope=2.1)
    assert "the model's 2, within 0.25" in bench.time_verdict(
        "naive", good, near, [1024, 2048, 4096]
    )
    assert bench.time_fit_label(good, near) == "slope 2.00"
    far = _fit_with_local(2.4, 2.6, slope=2.5)
    assert "more than 0.25 apart" in bench.time_verdict(
        "naive", good, far, [1024, 2048, 4096]
    )
    assert "differs" in bench.time_fit_label(good, far)


# --- chapter 9's thread verdicts: the fastest runs and the medians must agree


def _timing(low, median):
    return bench.Timing(median, low, 1.2 * median, 5, 1)


def test_compare_timings_decides_only_when_fastest_and_median_agree():
    base = _timing(10.0, 11.0)
    assert bench.compare_timings(_timing(9.0, 9.9), base)[2] == "faster"
    assert bench.compare_timings(_timing(11.0, 12.1), base)[2] == "slower"
    assert bench.compare_timings(_timing(10.2, 10.8), base)[2] == "same"
    # the committed run of chapter 9 (threads): 0.93 fastest, 1.04 median
    fastest, median, verdict = bench.compare_timings(
        _timing(4.74, 5.8), _timing(5.1, 5.6)
    )
    assert round(fastest, 2) == 0.93 and round(median, 2) == 1.04
    assert verdict is None
    assert bench.compare_timings(_timing(9.0, 12.0), base)[2] is None
    with pytest.raises(ValueError, match="positive"):
        bench.compare_timings(_timing(0.0, 1.0), base)
    with pytest.raises(ValueError, match="margin"):
        bench.compare_timings(base, base, margin=1.5)


def test_threads_verdict_says_saved_or_slower_only_when_both_agree():
    one = _timing(5.0, 5.5)
    assert bench.threads_verdict(_timing(4, 4), one, 1) == (
        "its default is one thread on this machine"
    )
    faster = bench.threads_verdict(_timing(4.0, 4.4), one, 2)
    assert "0.80 times its one-thread time in their fastest runs" in faster
    assert faster.endswith("the extra threads saved time")
    slower = bench.threads_verdict(_timing(6.0, 6.6), one, 2)
    assert "extra threads made it slower" in slower
    same = bench.threads_verdict(_timing(5.1, 5.4), one, 2)
    assert "changed its time by less than 5 %" in same
    # the committed run: fastest 0.93, median 1.04 -> no decision
    split = bench.threads_verdict(_timing(4.74, 5.8), _timing(5.1, 5.6), 2)
    assert "0.93 times" in split and "1.04 times in their medians" in split
    assert "on either side of 0.95" in split
    assert "does not decide" in split
    for verdict in (split, same):
        assert "saved time" not in verdict and "slower" not in verdict
    both = bench.threads_verdict(_timing(4.0, 6.6), one, 2)
    assert "either side of 0.95 and 1.05" in both
    assert "does not decide" in both


def test_one_thread_verdict_branches():
    naive = _timing(14.8, 15.9)
    # faster on one thread in both: a likely cause, not a measured one
    gain = bench.one_thread_verdict(
        naive, _timing(4.74, 5.8), _timing(5.1, 5.6), 2
    )
    assert "it did not need extra threads" in gain
    assert "likely cause, which this measurement does not isolate" in gain
    assert "came from" not in gain
    # one thread: fastest faster, median not -> no decision
    split = bench.one_thread_verdict(
        naive, _timing(4.0, 4.0), _timing(13.0, 16.0), 2
    )
    assert "on either side of 0.95" in split and "does not decide" in split
    assert "did not need" not in split
    # one thread about as fast, default faster in both: the threads
    threads = bench.one_thread_verdict(
        naive, _timing(7.0, 8.0), _timing(14.5, 16.0), 2
    )
    assert "about as fast as naive attention" in threads
    assert threads.endswith("came from its extra threads")
    slower = bench.one_thread_verdict(
        naive, _timing(7.0, 8.0), _timing(20.0, 22.0), 2
    )
    assert "slower than naive attention" in slower
    assert slower.endswith("came from its extra threads")
    # one thread about as fast, default split -> no decision
    undecided = bench.one_thread_verdict(
        naive, _timing(13.0, 16.0), _timing(14.5, 16.0), 2
    )
    assert "with its default 2 threads" in undecided
    assert "does not decide whether it gained time" in undecided
    # neither faster in both
    none = bench.one_thread_verdict(
        naive, _timing(15.0, 16.0), _timing(16.0, 17.0), 2
    )
    assert none.endswith("it gained no time over naive attention")
    # default one thread
    assert "only by timing noise" in bench.one_thread_verdict(
        naive, _timing(5, 5), _timing(5, 5), 1
    )


def test_thread_verdict_ratios_never_print_as_a_threshold_they_are_not():
    """The rerun of chapter 9 printed "1.06 times ... and 1.05 times in their
    medians; the two fall on either side of 1.05": the median ratio was
    below 1.05 but rounded to it. Such a ratio gets the digits that show its
    side."""
    one = _timing(6.0, 6.0)
    verdict = bench.threads_verdict(_timing(6.36, 6.282), one, 2)
    assert "1.06 times its one-thread time" in verdict
    assert "1.047 times in their medians" in verdict
    assert "either side of 1.05" in verdict
    # exactly on the threshold, and far from it: two decimals
    assert bench._ratio_text(1.05, 0.05) == "1.05"
    assert bench._ratio_text(0.93, 0.05) == "0.93"
    assert bench._ratio_text(0.9501, 0.05) == "0.9501"


def _rounds(*triples):
    return [dict(zip((16, 32, 64), t)) for t in triples]


def test_saving_ratios_give_none_where_the_first_doubling_saved_nothing():
    ratios = bench.saving_ratios(_rounds((4.0, 2.0, 1.5), (1.0, 1.2, 0.5)))
    assert ratios == [0.25, None]


def test_tile_saving_verdict_every_case_has_its_own_words():
    """Reading fl09e, E1: the committed run's fastest runs showed no saving
    from the first doubling while the medians did, and the verdict said
    without qualification that the first doubling saved no time, with a
    "nan" ratio in the prose. Every case now has its words and no NaN."""
    verdict = bench.tile_saving_verdict
    none = verdict(_rounds((1.0, 1.2, 0.5), (1.0, 1.0, 0.5)))
    assert none.startswith("in all 2 rounds the 32 x 32 tiles took no less")
    assert "no ratio to read" in none
    some = verdict(_rounds((1.0, 1.2, 0.5), (4.0, 2.0, 1.0)))
    assert some.startswith("in 1 of the 2 rounds")
    assert "does not decide" in some
    between = verdict(_rounds((4.0, 2.0, 1.2), (4.0, 2.0, 1.3)))
    assert between.startswith(
        "in all 2 rounds the ratio of the second doubling's saving to the "
        "first's ran from 0.35 to 0.40: between"
    )
    above = verdict(_rounds((4.0, 2.0, 0.5)))
    assert above.startswith("in the one round") and "was 0.75" in above
    assert "more than either cost" in above
    below = verdict(_rounds((4.0, 2.0, 1.9), (4.0, 2.0, 2.2)))
    assert "from -0.10 to 0.05" in below and "less than either" in below
    near = verdict(_rounds((4.0, 2.0, 1.2), (4.0, 2.0, 1.45)))
    assert "from 0.28 to 0.40, and in 1 of 2 it lies within 0.05" in near
    assert "does not decide" in near
    mixed = verdict(_rounds((4.0, 2.0, 1.3), (4.0, 2.0, 0.5)))
    assert "different bands" in mixed and "does not decide" in mixed
    for text in (none, some, between, above, below, near, mixed):
        assert "nan" not in text.lower().split()
    with pytest.raises(ValueError):
        verdict([])


def test_saving_band_margin_is_on_both_sides_of_each_bound():
    assert bench.saving_band(0.21) == "margin"
    assert bench.saving_band(0.29) == "margin"
    assert bench.saving_band(0.46) == "margin"
    assert bench.saving_band(0.54) == "margin"
    assert bench.saving_band(0.19) == "below"
    assert bench.saving_band(0.31) == "between"
    assert bench.saving_band(0.56) == "above"
