"""The launcher of attnbook.distributed: a rank that raises, dies or hangs
fails the launch with a message naming it, within the time limit, and leaves
no process behind; ranks whose shapes disagree all get a ValueError."""

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from attnbook.distributed import ring, ulysses
from attnbook.distributed.launch import LaunchError, launch

# the functions below run in the child processes: spawn imports this module
# there by name


def report_pid(path, rank):
    with open(f"{path}.{rank}", "w") as f:
        f.write(str(os.getpid()))


def hang(rank, world_size, path):
    report_pid(path, rank)
    if rank == 1:
        time.sleep(1000)
    return rank


def crash(rank, world_size, path):
    report_pid(path, rank)
    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    dist.barrier()  # waits for rank 1, which never comes
    return rank


def die(rank, world_size, path):
    report_pid(path, rank)
    if rank == 1:
        os._exit(3)
    time.sleep(1000)


def mismatched(rank, world_size):
    """Three launches' worth of mismatches in one: each rank reports the
    message of the ValueError it got (or None)."""
    messages = []
    for field in ("d", "heads", "dtype", "batch"):
        b, h, d, dtype = 1, 4, 8, torch.float64
        if rank == 1:
            d = 6 if field == "d" else d
            h = 2 if field == "heads" else h
            b = 2 if field == "batch" else b
            dtype = torch.float32 if field == "dtype" else dtype
        q, k, v = (torch.zeros(b, h, 3, d, dtype=dtype) for _ in range(3))
        positions = torch.arange(3) + 3 * rank
        for method in (ring.ring_attention, ulysses.ulysses_attention):
            try:
                method(q, k, v, positions)
                messages.append(None)
            except ValueError as e:
                messages.append(str(e))
    return messages


def processes_gone(pids):
    """None of the children exists any more (each was also joined)."""
    assert pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(
    "fn, expected",
    [
        (hang, "rank 1 of 2 did not finish within 30 s (hung?)"),
        (crash, "rank 1 of 2 raised:"),
        (die, "rank 1 of 2 died with exit code 3"),
    ],
)
def test_failing_rank_is_named_and_cleaned_up(tmp_path, fn, expected):
    path = str(tmp_path / "pid")
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(fn, 2, (path,), timeout_s=30)
    elapsed = time.monotonic() - start
    assert expected in str(info.value)
    if fn is crash:
        assert "deliberate failure on rank 1" in str(info.value)
    # the limit, plus the settling second and the grace of terminate
    assert elapsed < 30 + 10
    processes_gone(info.value.pids)
    if fn is hang:  # both started: rank 0 finished, rank 1 was ended
        assert sorted(os.listdir(tmp_path)) == ["pid.0", "pid.1"]


def test_mismatched_shapes_raise_on_every_rank():
    per_rank = launch(mismatched, 2, timeout_s=120)
    for messages in per_rank:
        assert all(m is not None for m in messages), messages
        fields = ["d", "heads", "q dtype", "batch"]
        for i, field in enumerate(fields):
            for m in messages[2 * i : 2 * i + 2]:
                assert f"ranks disagree on {field}:" in m, m
    # the values by rank are named
    assert "by rank [8, 6]" in per_rank[0][0]
    assert "torch.float64" in per_rank[1][4]


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size"):
        launch(hang, 0)
