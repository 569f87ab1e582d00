"""Measuring attention on a GPU: TFLOP/s and memory of the Triton kernel
against PyTorch (chapter 10).

Chapter 10 (FlashAttention on a GPU) runs these benchmarks; the FLOP convention
is :func:`attnbook.cost.benchmark_flops`.

Every implementation is timed on the same inputs, in the same run, with CUDA
events. Throughput is reported in TFLOP/s with the convention of the
FlashAttention papers (:func:`attnbook.cost.benchmark_flops`), so the numbers
compare with published ones; memory is the peak that
``torch.cuda.max_memory_allocated`` sees during a forward and backward pass.

Nothing here runs without a CUDA GPU: :func:`require_cuda` raises a
``RuntimeError`` that says so, and the chapter's benchmark cells check
:func:`cuda_available` first and print that they skip.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from ..cost import benchmark_flops

#: Sequence lengths of the sweep, 512 to 16384.
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
#: The numpy algorithm of chapter 9 runs on the CPU: only the shortest lengths.
NUMPY_MAX_N = 1024


# --- the device --------------------------------------------------------------


def cuda_available() -> bool:
    """True when PyTorch sees a CUDA GPU."""
    return torch.cuda.is_available()


def require_cuda() -> None:
    """Raise a ``RuntimeError`` that names what is missing when there is no
    CUDA GPU."""
    if not cuda_available():
        raise RuntimeError(
            "the GPU benchmark needs a CUDA GPU, and PyTorch sees none "
            f"(torch {torch.__version__}, built "
            f"{'with' if torch.version.cuda else 'without'} CUDA). "
            "On Colab: Runtime > Change runtime type > T4 GPU."
        )


def bfloat16_supported() -> bool:
    """Whether the GPU has bfloat16 hardware: compute capability 8.0 (Ampere)
    or newer.

    ``torch.cuda.is_bf16_supported()`` can answer True on older GPUs (a T4 is
    7.5), where bfloat16 is emulated and slow; the capability is the honest
    test.
    """
    return cuda_available() and torch.cuda.get_device_capability() >= (8, 0)


def device_report() -> str:
    """Lines naming the GPU, its capability and memory, and the software
    versions; or why there is none."""
    lines = [f"torch {torch.__version__}, Python {platform.python_version()}"]
    try:
        import triton

        lines[0] += f", triton {triton.__version__}"
    except ImportError:
        lines[0] += ", triton not installed"
    if not cuda_available():
        lines.append(
            "no CUDA GPU: the Triton kernels run under the interpreter "
            "(TRITON_INTERPRET=1) on the CPU"
        )
        return "\n".join(lines)
    props = torch.cuda.get_device_properties(0)
    major, minor = torch.cuda.get_device_capability(0)
    lines.append(
        f"GPU: {props.name}, compute capability {major}.{minor} "
        f"(sm_{major}{minor}), "
        f"{props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} "
        "SMs"
    )
    lines.append(
        f"bfloat16 hardware: {bfloat16_supported()} "
        "(torch.cuda.is_bf16_supported() says "
        f"{torch.cuda.is_bf16_supported()})"
    )
    return "\n".join(lines)


# --- what the compiler emits for a given GPU ---------------------------------

_PTX_PROBE = r"""
import collections, json, re, sys, warnings
warnings.filterwarnings("ignore")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attnbook.kernels.registry import KERNELS

d_head, block_q, block_k, *capabilities = map(int, sys.argv[1:])
spec = KERNELS["forward"]
kernel = spec.jit()
types = spec.signature("fp16")
signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
constants = spec.constants(d_head, block_q, block_k, causal=False)
counts = {}
for capability in capabilities:
    source = ASTSource(kernel, signature, constexprs=constants)
    target = GPUTarget("cuda", capability, 32)
    options = dict(num_warps=4, num_stages=1)
    compiled = triton.compile(source, target=target, options=options)
    opcode = r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)"
    opcodes = re.findall(opcode, compiled.asm["ptx"], re.M)
    counts[capability] = collections.Counter(opcodes)
print(json.dumps(counts))
"""


def ptx_instruction_counts(
    capabilities=(75, 80, 90),
    d_head: int = 32,
    block_q: int = 64,
    block_k: int = 32,
) -> dict[int, dict[str, int]]:
    """Compile the forward kernel (float16) for each ``sm_<capability>``; count
    its PTX instructions.

    No GPU is needed: Triton compiles ahead of time for any target. This runs
    in a fresh Python with ``TRITON_INTERPRET=0``, because kernels that a
    process interprets cannot be compiled there. Returns ``{capability:
    {opcode: count}}``.
    """
    env = dict(os.environ, TRITON_INTERPRET="0")
    args = [str(x) for x in (d_head, block_q, block_k, *capabilities)]
    result = subprocess.run(
        [sys.executable, "-c", _PTX_PROBE, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"compiling the kernel for {capabilities} "
            f"failed:\n{result.stderr[-2000:]}"
        )
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    return {int(capability): ops for capability, ops in counts.items()}


# --- the implementations -----------------------------------------------------


def naive_attention(q, k, v, causal: bool = False, scale: float | None = None):
    """Attention as eager torch operations, each its own kernel and its own
    pass over the (batch, heads, n_q, n_k) scores it materialises: the product
    with K, the scaling, when causal a masked_fill, the softmax and the product
    with V (in float16 about 12 bytes of traffic per score, 16 when causal).

    q: (batch, heads, n_q, d), k and v: (batch, heads, n_k, d). Causal with the
    book's convention (queries are the last n_q of the n_k positions).
    """
    # The attention step of attnbook.attend, copied on purpose: this baseline
    # is "what a plain implementation costs", so it must not pick up attend's
    # float32 scores or its masked-row care.
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(
            diagonal=n_k - n_q
        )
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _sdpa_with(backend) -> Callable:
    """F.scaled_dot_product_attention restricted to one backend (n_q == n_k in
    the sweep, so is_causal agrees)."""
    from torch.nn.attention import sdpa_kernel

    def attention(q, k, v, causal=False):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return attention


def _numpy_flash(q, k, v, causal=False):
    """Chapter 9's numpy algorithm, on the CPU, on the same inputs (forward
    only)."""
    from ..flash import flash_attention_numpy

    out = flash_attention_numpy(
        q.float().cpu().numpy(),
        k.float().cpu().numpy(),
        v.float().cpu().numpy(),
        causal=causal,
    )
    return torch.from_numpy(out)


def implementations(include_numpy: bool = True) -> dict[str, Callable]:
    """Name -> ``fn(q, k, v, causal)`` for every implementation to compare.

    Every SDPA backend is listed; one this GPU cannot run (the flash backend
    needs compute capability 8.0, for example) shows up as a missing
    measurement with the reason, rather than being silently left out.
    """
    from torch.nn.attention import SDPBackend

    from ..kernels import triton_flash_attention

    impls: dict[str, Callable] = {"triton (ch. 10)": triton_flash_attention}
    for label, name in (
        ("sdpa flash", "FLASH_ATTENTION"),
        ("sdpa efficient", "EFFICIENT_ATTENTION"),
        ("sdpa cudnn", "CUDNN_ATTENTION"),
        ("sdpa math", "MATH"),
    ):
        if hasattr(SDPBackend, name):
            impls[label] = _sdpa_with(getattr(SDPBackend, name))
    impls["naive torch"] = naive_attention
    if include_numpy:
        impls["numpy CPU (ch. 9)"] = _numpy_flash
    return impls


# --- timing ------------------------------------------------------------------


def time_cuda(
    fn: Callable, min_ms: float = 100.0, min_reps: int = 2, max_reps: int = 100
) -> float:
    """Median milliseconds per call of ``fn()``, timed with CUDA events after
    one warm-up call.

    Runs ``fn`` until ``min_ms`` have passed (at least ``min_reps`` times): the
    GPU runs asynchronously, so a wall clock would time the launch, not the
    work.
    """
    fn()
    torch.cuda.synchronize()
    times: list[float] = []
    while len(times) < max_reps and (
        len(times) < min_reps or sum(times) < min_ms
    ):
        start, stop = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def _time_cpu(fn: Callable) -> float:
    """Milliseconds of one call on the CPU (the numpy reference takes seconds:
    one run suffices)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _inputs(batch, heads, n, d, dtype, requires_grad):
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [
        torch.randn(
            batch,
            heads,
            n,
            d,
            device="cuda",
            dtype=dtype,
            generator=gen,
            requires_grad=requires_grad,
        )
        for _ in range(3)
    ]


def _measure(
    name, fn, batch, heads, n, d, causal, mode, dtype
) -> tuple[float | None, str]:
    """Milliseconds for one implementation and shape, or ``(None, reason)``."""
    numpy = name.startswith("numpy")
    if numpy and (mode != "fwd" or n > NUMPY_MAX_N):
        return None, "not run (CPU reference: forward, short sequences only)"
    try:
        q, k, v = _inputs(
            batch, heads, n, d, dtype, requires_grad=(mode == "fwd_bwd")
        )
        if numpy:
            return _time_cpu(lambda: fn(q, k, v, causal)), ""
        if mode == "fwd":
            with torch.no_grad():
                return time_cuda(lambda: fn(q, k, v, causal)), ""
        grad_out = torch.randn(batch, heads, n, d, device="cuda", dtype=dtype)

        def forward_backward():
            out = fn(q, k, v, causal)
            torch.autograd.grad(out, (q, k, v), grad_out)

        return time_cuda(forward_backward), ""
    except torch.cuda.OutOfMemoryError:
        return None, "out of memory"
    # e.g. "No available kernel" from an SDPA backend this GPU lacks
    except RuntimeError as err:
        return None, str(err).splitlines()[0][:80]
    finally:
        torch.cuda.empty_cache()


def benchmark(
    seq_lens=SEQ_LENS,
    d_heads=(64, 128),
    causal=(False, True),
    modes=("fwd", "fwd_bwd"),
    dtype=torch.float16,
    tokens: int = 16384,
    hidden: int = 2048,
    impls: dict[str, Callable] | None = None,
    verbose: bool = True,
) -> list[dict]:
    """TFLOP/s of every implementation over the sweep; a list of rows (dicts).

    As in the FlashAttention-2 paper's benchmark, the batch shrinks as the
    sequences grow (``batch = tokens // n``) and ``heads = hidden // d``, so
    every point holds the same number of tokens. Each row has ``impl, n, d,
    causal, mode, batch, heads, ms, tflops, note``; ``ms`` and ``tflops`` are
    None when the implementation could not run (``note`` says why).
    """
    require_cuda()
    impls = implementations() if impls is None else impls
    rows = []
    for d in d_heads:
        for is_causal in causal:
            for mode in modes:
                for n in seq_lens:
                    batch, heads = max(1, tokens // n), max(1, hidden // d)
                    for name, fn in impls.items():
                        ms, note = _measure(
                            name,
                            fn,
                            batch,
                            heads,
                            n,
                            d,
                            is_causal,
                            mode,
                            dtype,
                        )
                        flops = benchmark_flops(
                            batch, heads, n, d, is_causal, mode
                        )
                        rows.append(
                            dict(
                                impl=name,
                                n=n,
                                d=d,
                                causal=is_causal,
                                mode=mode,
                                batch=batch,
                                heads=heads,
                                ms=ms,
                                tflops=None
                                if ms is None
                                else flops / ms / 1e9,
                                note=note,
                            )
                        )
                if verbose:
                    print(
                        f"measured d={d}, causal={is_causal}, {mode}",
                        flush=True,
                    )
    return rows


def memory_sweep(
    seq_lens=SEQ_LENS,
    d: int = 64,
    batch: int = 1,
    heads: int = 16,
    causal: bool = False,
    dtype=torch.float16,
    impls: dict[str, Callable] | None = None,
) -> list[dict]:
    """Peak extra GPU memory of a forward and backward pass, against n; a list
    of rows.

    The peak is ``torch.cuda.max_memory_allocated`` during the pass minus what
    the inputs and the output gradient already occupied. Rows: ``impl, n, d,
    causal, peak_bytes, note`` (``peak_bytes`` None when out of memory).
    """
    require_cuda()
    impls = implementations(include_numpy=False) if impls is None else impls
    rows = []
    for n in seq_lens:
        for name, fn in impls.items():
            peak, note = None, ""
            try:
                q, k, v = _inputs(
                    batch, heads, n, d, dtype, requires_grad=True
                )
                grad_out = torch.randn_like(q)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                torch.autograd.grad(fn(q, k, v, causal), (q, k, v), grad_out)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
            except torch.cuda.OutOfMemoryError:
                note = "out of memory"
            except RuntimeError as err:
                note = str(err).splitlines()[0][:80]
            finally:
                q = k = v = grad_out = None
                torch.cuda.empty_cache()
            rows.append(
                dict(
                    impl=name,
                    n=n,
                    d=d,
                    causal=causal,
                    peak_bytes=peak,
                    note=note,
                )
            )
    return rows


# --- tables and figures ------------------------------------------------------


def tflops_table(rows: list[dict], d: int, causal: bool, mode: str) -> str:
    """A text table of TFLOP/s: one line per n, one column per implementation
    ('-' = did not run)."""
    sel = [
        r
        for r in rows
        if r["d"] == d and r["causal"] == causal and r["mode"] == mode
    ]
    impls = list(dict.fromkeys(r["impl"] for r in sel))
    ns = sorted({r["n"] for r in sel})
    width = max(8, *(len(i) for i in impls))
    lines = [
        f"TFLOP/s, {mode}, d = {d}, {'causal' if causal else 'not causal'}",
        f"{'n':>6} " + " ".join(f"{i:>{width}}" for i in impls),
    ]
    for n in ns:
        cells = []
        for impl in impls:
            r = next(r for r in sel if r["n"] == n and r["impl"] == impl)
            cells.append(
                f"{r['tflops']:>{width}.2f}"
                if r["tflops"] is not None
                else f"{'-':>{width}}"
            )
        lines.append(f"{n:>6} " + " ".join(cells))
    return "\n".join(lines)


def speedups(
    rows: list[dict], over: str, of: str = "triton (ch. 10)"
) -> list[dict]:
    """Time of ``over`` divided by time of ``of`` for every shape where both
    ran (> 1: ``of`` is faster)."""
    key = lambda r: (r["n"], r["d"], r["causal"], r["mode"])  # noqa: E731
    base = {key(r): r["ms"] for r in rows if r["impl"] == over and r["ms"]}
    return [
        dict(
            n=r["n"],
            d=r["d"],
            causal=r["causal"],
            mode=r["mode"],
            speedup=base[key(r)] / r["ms"],
        )
        for r in rows
        if r["impl"] == of and r["ms"] and key(r) in base
    ]


def plot_tflops(rows: list[dict], mode: str = "fwd", title: str | None = None):
    """A 2 x 2 grid (head dimension x causal) of TFLOP/s against n, one line
    per implementation."""
    from .. import plotting

    d_heads = sorted({r["d"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    fig, axes = plotting.figure(
        ncols=len(causals),
        nrows=len(d_heads),
        width=7.5,
        height=2.8 * len(d_heads),
        squeeze=False,
        sharex=True,
    )
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    for i, d in enumerate(d_heads):
        for j, causal in enumerate(causals):
            ax = axes[i][j]
            for c, impl in enumerate(impls):
                pts = sorted(
                    (r["n"], r["tflops"])
                    for r in rows
                    if r["impl"] == impl
                    and r["d"] == d
                    and r["causal"] == causal
                    and r["mode"] == mode
                    and r["tflops"] is not None
                )
                if pts:
                    ax.plot(
                        *zip(*pts),
                        marker="o",
                        ms=3,
                        color=plotting.COLORS[c % len(plotting.COLORS)],
                        label=impl,
                    )
            ax.set_xscale("log", base=2)
            # the CPU reference and the GPU kernels differ by orders of
            # magnitude
            ax.set_yscale("log")
            ax.set_title(f"d = {d}, {'causal' if causal else 'not causal'}")
            ax.set_xlabel("sequence length n")
            ax.set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        title
        or f"{'forward' if mode == 'fwd' else 'forward + backward'}, float16"
    )
    return fig


def plot_memory(rows: list[dict], title: str | None = None):
    """Peak extra memory (MiB) of forward + backward against n, log-log, one
    line per implementation."""
    from .. import plotting

    fig, ax = plotting.figure(width=6.4, height=3.6)
    for c, impl in enumerate(dict.fromkeys(r["impl"] for r in rows)):
        pts = sorted(
            (r["n"], r["peak_bytes"] / 2**20)
            for r in rows
            if r["impl"] == impl and r["peak_bytes"] is not None
        )
        if pts:
            ax.plot(
                *zip(*pts),
                marker="o",
                ms=3,
                color=plotting.COLORS[c % len(plotting.COLORS)],
                label=impl,
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("peak extra memory (MiB)")
    ax.set_title(title or "memory of forward + backward")
    ax.legend(fontsize=7)
    return fig
