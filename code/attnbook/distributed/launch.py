"""Run a function on P CPU processes that talk through ``torch.distributed``
(the gloo backend on 127.0.0.1), the way a multi-GPU job runs one process per
device; and the cross-rank checks that the ring and Ulysses start with.

Chapter 11 (attention across devices) runs its processes with :func:`launch`.
The launcher has a time limit: a rank that raises, dies or hangs makes it
raise :class:`LaunchError` naming the rank and what happened, after it has
ended every process it started.
"""

from __future__ import annotations

import pickle
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# dtypes the shape check can name (any other is compared by its name's hash)
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


class LaunchError(RuntimeError):
    """A rank raised, died or did not finish in time. ``pids``: the process
    ids of the ranks, all ended."""

    def __init__(self, message: str, pids=()):
        super().__init__(message)
        self.pids = list(pids)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank, world_size, port, fn, args, results) -> None:
    """One child process: join the group, run ``fn(rank, world_size,
    *args)``, report ``(rank, "ok", pickled result)`` or ``(rank, "error",
    traceback)``."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
        )
        result = fn(rank, world_size, *args)
        results.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def stop(processes, grace_s: float = 5.0) -> None:
    """End every process: terminate, wait a little, kill what is left."""
    processes = [p for p in processes if p.pid is not None]  # started
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()


def launch(fn, world_size: int, args=(), timeout_s: float = 120.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return
    the list of their results, by rank.

    ``fn`` must be importable by name (spawn pickles it by reference): a
    function of a module, not of a notebook. Raises :class:`LaunchError` when
    a rank raises (its traceback included), dies, or has not finished after
    ``timeout_s`` seconds; every process is ended before it returns or raises.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"world_size must be a positive int; got {world_size}"
        )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    processes = [
        ctx.Process(
            target=run_rank,
            args=(rank, world_size, port, fn, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    got, failures = {}, {}  # rank -> result, rank -> what went wrong
    deadline, settle = time.monotonic() + timeout_s, None
    try:
        for p in processes:
            p.start()
        while len(got) + len(failures) < world_size:
            now = time.monotonic()
            if settle is not None and now > settle:
                break  # the other ranks wait for the failed one: stop them
            if now > deadline:
                for rank in range(world_size):
                    if rank not in got and rank not in failures:
                        failures[rank] = (
                            f"did not finish within {timeout_s:g} s (hung?)"
                        )
                break
            try:
                rank, status, payload = results.get(timeout=0.1)
            except queue.Empty:
                for rank, p in enumerate(processes):
                    done = rank in got or rank in failures
                    # a result still in the pipe would make it non-empty
                    if not done and p.exitcode is not None and results.empty():
                        failures[rank] = (
                            f"died with exit code {p.exitcode} before "
                            "reporting a result (its stderr may say why; "
                            "spawn needs fn importable by name)"
                        )
            else:
                if status == "error":
                    failures[rank] = f"raised:\n{payload}"
                else:
                    got[rank] = pickle.loads(payload)
            if failures and settle is None:
                # a moment for the ranks that fail with it to say why
                settle = time.monotonic() + 1.0
    finally:
        stop(processes)
        results.close()
        results.join_thread()
    if failures:
        lines = [
            f"rank {rank} of {world_size} {failures[rank]}"
            for rank in sorted(failures)
        ]
        raise LaunchError(
            "\n".join(lines) + "\n(every process has been ended)",
            [p.pid for p in processes],
        )
    return [got[rank] for rank in range(world_size)]


def gather_lengths(n_local: int, group=None) -> list[int]:
    """Every rank's number of tokens, by rank (an all-gather)."""
    world_size = dist.get_world_size(group)
    mine = torch.tensor([n_local], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine, group=group)
    return [int(x) for x in every]


def dtype_code(dtype) -> int:
    if dtype in DTYPES:
        return DTYPES.index(dtype)
    return 100 + sum(map(ord, str(dtype)))


def check_same_shapes(q, k, v, group=None) -> None:
    """Raise ``ValueError`` on every rank unless all ranks' q, k, v agree in
    batch, heads, head size and dtype (their lengths may differ).

    Each rank all-gathers its (batch, heads, kv heads, d, d_v, dtypes); a
    rank that went on with a mismatch would wait forever for a transfer of
    the wrong size, or compute garbage.
    """
    names = ["batch", "heads", "kv heads", "d", "d_v"]
    names += ["q dtype", "k dtype", "v dtype"]
    mine = [q.shape[0], q.shape[1], k.shape[1], q.shape[3], v.shape[3]]
    mine += [dtype_code(x.dtype) for x in (q, k, v)]
    mine = torch.tensor(mine, dtype=torch.int64)
    world_size = dist.get_world_size(group)
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine, group=group)
    every = torch.stack(every)  # (world_size, fields)
    for i, name in enumerate(names):
        column = every[:, i]
        if bool((column != column[0]).any()):
            values = column.tolist()
            if "dtype" in name:
                values = [
                    str(DTYPES[c]) if c < len(DTYPES) else "other"
                    for c in values
                ]
            raise ValueError(
                f"ranks disagree on {name}: by rank {values} (rank "
                f"{dist.get_rank(group)} of {world_size}); every rank must "
                "hold q, k, v of the same batch, heads, head size and dtype"
            )
