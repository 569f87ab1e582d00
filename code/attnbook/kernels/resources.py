"""What the compiler makes of the Triton kernels, for GPUs this machine does
not have.

Triton compiles ahead of time for any NVIDIA target, and its bundled ``ptxas
-v`` reports what each compiled kernel needs from the hardware: registers per
thread, the bytes it *spills* to slow local memory when the registers run out,
and shared memory per block. Chapter 10 prints that table for every kernel of
:data:`attnbook.kernels.registry.KERNELS` at every launch configuration
:func:`attnbook.kernels.launch.gpu_configs` can choose, on four targets, and
the tests assert that no shipped configuration spills or overflows shared
memory.

The kernels are specialised as a real launch specialises them: pointers and
lengths divisible by 16 (``tt.divisibility``), so the addresses and vector
loads match what a GPU would run. Compiling needs a process in which Triton is
*not* interpreted, so the work runs in child processes (``python -m
attnbook.kernels.resources`` reads rows as JSON on stdin); this module itself
imports neither Triton nor the device code.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from .registry import KERNELS as REGISTRY


@dataclass(frozen=True)
class Target:
    """One GPU generation: what a block may use on it."""

    name: str
    capability: int  # 75 for sm_75
    # bytes of shared memory one block may use (opt-in maximum)
    shared_limit: int
    tensor_cores_in_triton: bool


# Per-block shared memory limits: CUDA C Programming Guide, "Technical
# Specifications per Compute Capability" (64 KiB on 7.5; 163 KiB on 8.0; 99 KiB
# on 8.6/8.9; 227 KiB on 9.0).
TARGETS = {
    75: Target("T4 (Turing, sm_75)", 75, 64 * 1024, False),
    80: Target("A100 (Ampere, sm_80)", 80, 163 * 1024, True),
    89: Target("L4 (Ada, sm_89)", 89, 99 * 1024, True),
    90: Target("H100 (Hopper, sm_90)", 90, 227 * 1024, True),
}
MAX_REGISTERS = 255  # per thread, on every target above

#: The kernels of the table: every kernel of the registry.
KERNELS = tuple(REGISTRY)


@dataclass(frozen=True)
class Row:
    """One compilation: a kernel, a head size, a dtype, a launch configuration
    and a target."""

    kernel: str  # one of KERNELS (a name of the registry)
    d_head: int
    dtype: str  # "fp16" or "bf16"
    block_q: int
    block_k: int
    num_warps: int
    num_stages: int
    capability: int
    causal: bool = True


@dataclass(frozen=True)
class Resources:
    """What ``ptxas -v`` and the PTX say about one :class:`Row`."""

    row: Row
    registers: int  # per thread
    # bytes per thread written to local memory because registers ran out
    spill_stores: int
    spill_loads: int
    # bytes of shared memory per block (Triton's own count)
    shared: int
    # warp-level tensor-core instructions (mma.sync), sm_80 and newer
    mma: int
    wgmma: int  # warpgroup tensor-core instructions, sm_90
    # asynchronous global -> shared copies (cp.async / TMA bulk copies)
    cp_async: int

    @property
    def fits(self) -> bool:
        """No spills, and shared memory within the target's per-block limit."""
        return (
            self.spill_stores == 0
            and self.spill_loads == 0
            and self.shared <= TARGETS[self.row.capability].shared_limit
        )


def kernel_signature(kernel: str, dtype: str) -> dict[str, str]:
    """Triton types of the kernel's runtime arguments (every other argument is
    a constexpr)."""
    return REGISTRY[kernel].signature(dtype)


def _compile(row: Row) -> Resources:
    """Compile one row for its target and read its resources (in a process that
    does not interpret)."""
    import contextlib
    import io

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = REGISTRY[row.kernel]
    kernel = spec.jit()
    types = {
        name: ty
        for name, ty in spec.signature(row.dtype).items()
        if name in kernel.arg_names
    }
    signature = {
        name: types.get(name, "constexpr") for name in kernel.arg_names
    }
    constants = spec.constants(
        row.d_head, row.block_q, row.block_k, row.causal
    )
    # what a real launch sees: every pointer, both lengths and the strides
    # divisible by 16
    divisible = [
        name
        for name, ty in types.items()
        if ty.startswith("*")
        or name in ("n_q", "n_k")
        or name.startswith("stride")
    ]
    attrs = {
        (kernel.arg_names.index(name),): [["tt.divisibility", 16]]
        for name in divisible
    }
    # Triton's own ptxas run (its flags, its ptxas for the target) prints the
    # report we read; the child's environment has TRITON_ALWAYS_COMPILE=1, so a
    # cached kernel cannot skip it.
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs=constants, attrs=attrs),
            target=GPUTarget("cuda", row.capability, 32),
            options=dict(num_warps=row.num_warps, num_stages=row.num_stages),
        )
    report, ptx = log.getvalue(), compiled.asm["ptx"]
    # never read a missing report as "0 registers, no spills"
    if "Used" not in report:
        raise RuntimeError(
            f"ptxas printed no resource report for {row}:\n{report[-2000:]}"
        )

    def number(pattern):
        return int(m.group(1)) if (m := re.search(pattern, report)) else 0

    opcodes = re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", ptx, re.M)

    def count(prefix):
        return sum(op.startswith(prefix) for op in opcodes)

    return Resources(
        row,
        registers=number(r"Used (\d+) registers"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
        shared=int(compiled.metadata.shared),
        mma=count("mma."),
        wgmma=count("wgmma.mma_async"),
        cp_async=count("cp.async"),
    )


def _cache_path() -> str:
    folder = os.environ.get(
        "ATTNBOOK_CACHE",
        os.path.join(os.path.expanduser("~"), ".cache", "attnbook"),
    )
    return os.path.join(folder, "kernel_resources.json")


def kernels_source_hash(source: str | None = None) -> str:
    """A hash of what the compiler sees of :mod:`attnbook.kernels.device`: the
    source of every ``@triton.jit`` function and of every module-level constant
    they read (``LOG2E``, ``LN2``). Host-side code (launchers, configurations,
    autotuning) lives in other modules, and the device module's docstrings and
    comments between functions are left out, so an edit there recompiles
    nothing. ``source``: another text of the device module (the tests'
    edits)."""
    import ast

    text = (
        (Path(__file__).with_name("device.py")).read_text()
        if source is None
        else source
    )
    compiled = [
        ast.get_source_segment(text, node)
        for node in ast.parse(text).body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        or (
            isinstance(node, ast.FunctionDef)
            and any("jit" in ast.unparse(d) for d in node.decorator_list)
        )
    ]
    return hashlib.sha256("\n".join(compiled).encode()).hexdigest()


def _cache_key(row: Row) -> str:
    """Changes whenever the answer could: the kernels' source, Triton's
    version, or the row."""
    from importlib.metadata import version

    text = json.dumps(
        [version("triton"), kernels_source_hash(), asdict(row)], sort_keys=True
    )
    return hashlib.sha256(text.encode()).hexdigest()


def compile_rows(
    rows, workers: int | None = None, cache: bool = True
) -> list[Resources]:
    """:class:`Resources` for every :class:`Row`, compiled in ``workers`` child
    processes.

    Compiling takes a second or two per row, so results are kept in a cache
    file (``$ATTNBOOK_CACHE`` or ``~/.cache/attnbook``) keyed by the kernels'
    source, Triton's version and the row: an edit to a kernel recompiles
    everything.
    """
    rows = list(rows)
    stored = {}
    if cache and os.path.exists(_cache_path()):
        with open(_cache_path()) as f:
            stored = json.load(f)
    keys = {row: _cache_key(row) for row in rows}
    missing = list(
        dict.fromkeys(row for row in rows if keys[row] not in stored)
    )
    if missing:
        workers = max(1, min(workers or os.cpu_count() or 1, len(missing)))
        chunks = [missing[i::workers] for i in range(workers)]
        env = dict(os.environ, TRITON_INTERPRET="0", TRITON_ALWAYS_COMPILE="1")

        def run(chunk):
            done = subprocess.run(
                [sys.executable, "-m", "attnbook.kernels.resources"],
                env=env,
                text=True,
                input=json.dumps([asdict(r) for r in chunk]),
                capture_output=True,
                timeout=3600,
            )
            if done.returncode != 0:
                raise RuntimeError(
                    f"compiling the kernels failed:\n{done.stderr[-3000:]}"
                )
            return json.loads(done.stdout.strip().splitlines()[-1])

        with ThreadPoolExecutor(workers) as pool:
            for chunk in pool.map(run, chunks):
                for result in chunk:
                    stored[keys[Row(**result["row"])]] = result
        if cache:
            os.makedirs(os.path.dirname(_cache_path()), exist_ok=True)
            with open(_cache_path() + ".tmp", "w") as f:
                json.dump(stored, f)
            # atomic: a reader never sees half a file
            os.replace(_cache_path() + ".tmp", _cache_path())
    out = []
    for row in rows:
        fields = dict(stored[keys[row]])
        fields.pop("row")
        out.append(Resources(row, **fields))
    return out


def shipped_rows(capabilities=tuple(TARGETS), d_heads=(64, 128)) -> list[Row]:
    """Every configuration :func:`attnbook.kernels.launch.gpu_configs` may
    launch each kernel of the registry with, on every target, in float16 and
    (sm_80 and newer) bfloat16: the rows chapter 10 prints and the tests
    check."""
    from .launch import gpu_configs

    rows = []
    for capability in capabilities:
        for d_head in d_heads:
            for dtype in ("fp16", "bf16") if capability >= 80 else ("fp16",):
                for spec in REGISTRY.values():
                    for block_q, block_k, num_warps, num_stages in gpu_configs(
                        spec.kind, d_head, divmod(capability, 10)
                    ):
                        rows.append(
                            Row(
                                spec.name,
                                d_head,
                                dtype,
                                block_q,
                                block_k,
                                num_warps,
                                num_stages,
                                capability,
                            )
                        )
    return rows


#: The 64 x 64 forward tile the T4 used to get: chapter 10 prints it beside the
#: table, as a kernel that spills.
OLD_T4_FORWARD = Row("forward", 64, "fp16", 64, 64, 4, 1, 75)

#: The table chapter 10 prints, as compiled when it was committed
#: (write_committed_table).
COMMITTED_TABLE = Path(__file__).parents[1] / "data" / "kernel_resources.json"


def write_committed_table(resources, path=COMMITTED_TABLE) -> None:
    """Store ``resources`` (of :func:`shipped_rows` and :data:`OLD_T4_FORWARD`)
    with Triton's version and the kernels' source hash."""
    from importlib.metadata import version

    data = dict(
        triton=version("triton"),
        kernels=kernels_source_hash(),
        rows=[asdict(r) for r in resources],
    )
    Path(path).write_text(json.dumps(data, indent=0) + "\n")


def committed_table(
    path=COMMITTED_TABLE,
) -> tuple[list[Resources], dict[str, str]]:
    """The committed table and what produced it: ``(resources, {"triton": ...,
    "kernels": ...})``."""
    data = json.loads(Path(path).read_text())
    rows = []
    for fields in data["rows"]:
        fields = dict(fields)
        rows.append(Resources(Row(**fields.pop("row")), **fields))
    return rows, {"triton": data["triton"], "kernels": data["kernels"]}


def resource_table(
    recompile: bool | None = None,
) -> tuple[list[Resources], str]:
    """Chapter 10's table: ``(resources, where they come from)``: the rows of
    :func:`shipped_rows` and, last, :data:`OLD_T4_FORWARD`.

    By default the committed table (compiling its 158 kernels takes minutes, on
    Colab too); with ``recompile`` (default: the environment variable
    ``ATTNBOOK_RECOMPILE_KERNELS=1``) the kernels are compiled here, with the
    Triton that is installed, through the cache of :func:`compile_rows`.
    """
    if recompile is None:
        recompile = os.environ.get("ATTNBOOK_RECOMPILE_KERNELS", "0") == "1"
    if recompile:
        from importlib.metadata import version

        return compile_rows(
            [*shipped_rows(), OLD_T4_FORWARD]
        ), f"compiled here with Triton {version('triton')}"
    rows, origin = committed_table()
    return rows, (
        f"the committed table, compiled with Triton {origin['triton']} "
        "(set ATTNBOOK_RECOMPILE_KERNELS=1 to compile it here)"
    )


# a child of compile_rows: rows in on stdin, resources out on stdout
if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    results = [
        asdict(_compile(Row(**r))) for r in json.loads(sys.stdin.read())
    ]
    print(json.dumps(results))
