"""How fast chapter 10's kernels could run on GPUs this machine does not have:
a model, not a measurement.

Chapter 10 (FlashAttention on a GPU) draws these predictions where a reader
without a GPU would see the benchmark's plots, and sets them beside the plots
on a GPU; chapter 9 takes the H100's rate of exponentials from it for the roof
that its roofline lacks. The model counts what each of the kernels of
:mod:`attnbook.kernels.device` does on the tiles it visits, at the launch
configuration that :func:`attnbook.kernels.launch.gpu_configs` chooses first,
and divides by published rates, one per unit of the GPU:

1. **Arithmetic.** Matrix products run on the units ``tl.dot`` compiles to: the
   tensor cores from sm_80 on, the float32 units on the T4 (chapter 10's PTX
   counts show no tensor-core instruction there). Each score also needs one
   ``exp2`` on the special-function units (16 results per SM per clock) and a
   few float32 instructions (scale, maximum, subtraction, sum), each one issue
   slot of the float32 units, as a fused multiply-add is (which counts as two
   flops).
2. **Memory.** The bytes of :func:`attnbook.memory_traffic.flash_traffic_l2`
   (Q, K, V read once) when the keys and values of the heads in flight fit in
   L2, else those of :func:`attnbook.memory_traffic.flash_traffic` (every
   re-read from HBM).
3. **Fixed costs.** Every launch costs :data:`LAUNCH_SECONDS`; every wave of
   programs (as many as the SMs hold at once, ``occupancy`` per SM) waits
   :data:`WAVE_SECONDS` for its first tiles.

How the units overlap, no count on paper knows, so the model gives a **band**,
not a number: the *bound* is the busiest unit's time (every other unit hidden
behind it, no fixed cost), which no kernel can beat; the *no-overlap* time adds
every unit's time and the fixed costs, as if each unit waited for the others. A
real kernel can be slower than either (stalls, clocks below the peak's), so
neither is a prediction of its time; the band says how much overlapping the
units could win.

Rates are the vendors' dense peaks at one clock per GPU, the clock of its
tensor-core peak; exp2 and float32 rates per SM per clock are those of the CUDA
C++ Programming Guide's throughput table. The model predicts the shape of the
measured curves (how they rise with ``n``, causal against full, d = 64 against
128, forward against backward), not their height.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._validate import positive_int
from ..cost import benchmark_flops
from ..memory_traffic import GB, GPU, GPUS, KB, TB

MiB = 1024 * KB

#: One kernel launch, seconds (a typical launch latency; it matters only at the
#: shortest lengths).
LAUNCH_SECONDS = 5e-6
#: What each wave of programs waits before its first tiles arrive from memory,
#: seconds.
WAVE_SECONDS = 1e-6


@dataclass(frozen=True)
class Hardware:
    """What the model needs to know of one GPU."""

    # HBM bandwidth, SMs, shared memory, tensor-core peak
    gpu: GPU
    capability: tuple[int, int]
    # Hz: the clock at which the peaks below are quoted
    clock: float
    # float32 multiply-adds per SM per clock (64 on 7.5 and 8.0, 128 on 9.0)
    fp32_per_sm: int
    l2_bytes: float
    max_warps_per_sm: int
    # special-function results per SM per clock, 7.5 to 9.0
    exp2_per_sm: int = 16
    registers_per_sm: int = 65536

    @property
    def fp32_flops(self) -> float:
        """float32 flop/s: a multiply-add is two operations."""
        return self.gpu.n_sm * self.fp32_per_sm * 2 * self.clock

    @property
    def fp32_instructions(self) -> float:
        """float32 instructions per second (a multiply-add is one instruction,
        and two flops)."""
        return self.gpu.n_sm * self.fp32_per_sm * self.clock

    @property
    def dot_flops(self) -> float:
        """flop/s of ``tl.dot`` as Triton compiles it: tensor cores from sm_80,
        float32 units before."""
        return (
            self.gpu.fp16_flops
            if self.capability >= (8, 0)
            else self.fp32_flops
        )

    @property
    def exp2_rate(self) -> float:
        """exp2 results per second, all SMs."""
        return self.gpu.n_sm * self.exp2_per_sm * self.clock


#: The T4 of Colab's free tier (Turing whitepaper, T4 datasheet); not in
#: chapter 9's table.
T4 = GPU(
    "T4",
    16 * GB,
    320 * GB,
    96 * KB,
    64 * KB,
    40,
    65 * TB,
    ("nvidia2018turing", "nvidia2019t4datasheet"),
    # compute capability 7.5: a block may use all 64 KiB
    shared_per_block=64 * KB,
)
_A100, _H100 = (
    next(g for g in GPUS if g.name.startswith(name))
    for name in ("A100 SXM4 80GB", "H100")
)
#: The three GPUs of the model. The clocks are those of the tensor-core peaks:
#: 65 TFLOP/s = 40 SMs x 1024 flop/clock x 1.59 GHz; 312 = 108 x 2048 x 1.41;
#: 989.4 = 132 x 4096 x 1.83.
HARDWARE = (
    Hardware(T4, (7, 5), 1.59e9, 64, 4 * MiB, 32),
    Hardware(_A100, (8, 0), 1.41e9, 64, 40 * MiB, 64),
    Hardware(_H100, (9, 0), 1.83e9, 128, 50 * MiB, 64),
)


@dataclass(frozen=True)
class PerScore:
    """What one kernel does: per score of a visited tile, and per row of its
    own blocks."""

    # n x n x d matrix products it computes (each 2 d flops per score)
    products: int
    float32_ops: int  # softmax arithmetic per score besides exp2
    # d-wide rows of its own blocks read or written once (Q and O, ...)
    resident: int
    # float32 per row of its own blocks read or written once (the LSE, ...)
    resident_vectors: int
    # float32 per row of the inner loop, read with every visited tile
    streamed_vectors: int
    # its programs own key blocks and loop over query blocks
    keys_outer: bool = False


# The forward computes S and P V: 2 products; scale, maximum, subtraction and
# sum per score; it reads Q, writes O and the LSE once. The dK, dV kernel
# recomputes S and P and computes dV, dP and
# dK: 4 products; it reads K, V and writes dK, dV once, and reads the LSE and
# delta of every query row it visits. The dQ kernel recomputes S and P and
# computes dP and dQ: 3 products; it reads Q, dO, the LSE and delta and writes
# dQ once.
KERNELS = {
    "forward": PerScore(
        products=2,
        float32_ops=4,
        resident=2,
        resident_vectors=1,
        streamed_vectors=0,
    ),
    "backward_dkdv": PerScore(
        products=4,
        float32_ops=4,
        resident=4,
        resident_vectors=0,
        streamed_vectors=2,
        keys_outer=True,
    ),
    "backward_dq": PerScore(
        products=3,
        float32_ops=4,
        resident=3,
        resident_vectors=2,
        streamed_vectors=0,
    ),
}


def tile_visits(
    n: int,
    block_outer: int,
    block_inner: int,
    causal: bool,
    keys_outer: bool = False,
) -> tuple[int, int]:
    """``(scores, rows)`` a kernel computes and streams on an ``n x n`` score
    matrix.

    Each program owns one outer block (a query block; a key block with
    ``keys_outer``) and loops over the inner blocks that share at least one
    visible score with it. ``scores`` counts whole tiles, the masked ones on a
    causal diagonal included (so more than ``n (n + 1) / 2``); ``rows`` counts
    the inner rows the programs load, summed over programs.
    """
    n, block_outer, block_inner = (
        positive_int(k, v)
        for k, v in dict(
            n=n, block_outer=block_outer, block_inner=block_inner
        ).items()
    )
    scores = rows = 0
    for start in range(0, n, block_outer):
        height = min(block_outer, n - start)
        if not causal:
            inner = n
        # queries from the block holding this key block's first key to the end
        elif keys_outer:
            inner = n - start // block_inner * block_inner
        # keys up to the block holding this query block's last query
        else:
            inner = min(n, -(-(start + height) // block_inner) * block_inner)
        scores += height * inner
        rows += inner
    return scores, rows


def occupancy(
    registers: int, num_warps: int, shared: int, hw: Hardware
) -> int:
    """Programs one SM holds at once: the fewest that registers, shared memory
    and warps allow.

    Registers are allocated per thread in multiples of 8; a kernel that fits
    none is an error.
    """
    per_program = -(-registers // 8) * 8 * 32 * num_warps
    fits = min(
        hw.registers_per_sm // per_program,
        hw.gpu.shared_per_sm // max(shared, 1),
        hw.max_warps_per_sm // num_warps,
    )
    if fits < 1:
        raise ValueError(
            f"a program of {num_warps} warps, {registers} registers per "
            f"thread and {shared} bytes "
            f"of shared memory does not fit on one SM of the {hw.gpu.name}"
        )
    return fits


def launch_configs(
    hw: Hardware, d: int, resources
) -> dict[str, tuple[int, int, int]]:
    """kernel -> (block_q, block_k, programs per SM) for the configuration that
    :func:`attnbook.kernels.launch.gpu_configs` chooses first on ``hw``, in
    float16, with the occupancy that the compiler's registers and shared memory
    allow (``resources``: the :class:`attnbook.kernels.resources.Resources` of
    :func:`attnbook.kernels.resources.compile_rows`)."""
    from .launch import gpu_configs

    capability = hw.capability[0] * 10 + hw.capability[1]
    configs = {}
    for kernel in KERNELS:
        config = gpu_configs(kernel, d, hw.capability)[0]
        found = [
            r
            for r in resources
            if (r.row.kernel, r.row.d_head, r.row.dtype, r.row.capability)
            == (kernel, d, "fp16", capability)
            and (
                r.row.block_q,
                r.row.block_k,
                r.row.num_warps,
                r.row.num_stages,
            )
            == config
        ]
        if not found:
            raise ValueError(
                f"no compiled resources for {kernel}, d = {d}, float16, "
                f"{config} on sm_{capability}"
            )
        configs[kernel] = (
            config[0],
            config[1],
            occupancy(found[0].registers, config[2], found[0].shared, hw),
        )
    return configs


@dataclass(frozen=True)
class KernelTime:
    """The model's account of one kernel launch, seconds per unit of the
    GPU."""

    kernel: str
    # matrix products, on the units tl.dot compiles to
    dot: float
    exp2: float  # exponentials, on the special-function units
    fp32: float  # the softmax's other float32 instructions
    memory: float  # HBM traffic
    fixed: float  # launch and waves
    in_l2: bool  # True when the L2 serves the repeated reads
    # True on the T4: the products share the float32 units
    dot_on_fp32_units: bool = False

    @property
    def units(self) -> dict[str, float]:
        """Busy time of each unit; on the T4 the products and the softmax share
        the float32 units."""
        if self.dot_on_fp32_units:
            return {
                "float32 units": self.dot + self.fp32,
                "special functions": self.exp2,
                "HBM": self.memory,
            }
        return {
            "tensor cores": self.dot,
            "float32 units": self.fp32,
            "special functions": self.exp2,
            "HBM": self.memory,
        }

    @property
    def bound(self) -> float:
        """The busiest unit's time: no kernel that does this work can take
        less."""
        return max(self.units.values())

    @property
    def busiest(self) -> str:
        """The unit whose time is :attr:`bound`: the one that binds this
        launch."""
        units = self.units
        return max(units, key=units.get)

    @property
    def no_overlap(self) -> float:
        """Every unit's time added, and the fixed costs: the units never
        overlap."""
        return self.fixed + sum(self.units.values())


def kernel_time(
    kernel: str,
    hw: Hardware,
    batch: int,
    heads: int,
    n: int,
    d: int,
    causal: bool,
    block_outer: int,
    block_inner: int,
    programs_per_sm: int = 1,
    bytes_per_element: int = 2,
) -> KernelTime:
    """The model's time for one launch of ``kernel`` (a key of :data:`KERNELS`)
    on ``hw``."""
    work = KERNELS[kernel]
    scores, rows = tile_visits(
        n, block_outer, block_inner, causal, work.keys_outer
    )
    scores, rows, own_rows = (
        batch * heads * scores,
        batch * heads * rows,
        batch * heads * n,
    )
    dot = work.products * 2 * d * scores / hw.dot_flops
    exp2 = scores / hw.exp2_rate
    # one issue slot each
    fp32 = work.float32_ops * scores / hw.fp32_instructions
    # Memory: the rows of the programs' own blocks once; the inner loop's two
    # d-wide tiles (K and V, or Q and dO) from HBM with every visit, unless the
    # heads in flight keep them in L2, when each comes from HBM once.
    programs_per_head = -(-n // block_outer)
    in_flight = hw.gpu.n_sm * programs_per_sm
    heads_in_flight = min(batch * heads, -(-in_flight // programs_per_head))
    in_l2 = heads_in_flight * 2 * n * d * bytes_per_element <= hw.l2_bytes
    streamed = own_rows if in_l2 else rows
    elements = work.resident * own_rows * d + 2 * streamed * d
    vectors = (
        work.resident_vectors * own_rows + work.streamed_vectors * streamed
    )
    memory = (
        elements * bytes_per_element + 4 * vectors
    ) / hw.gpu.hbm_bandwidth
    waves = math.ceil(batch * heads * programs_per_head / in_flight)
    return KernelTime(
        kernel,
        dot,
        exp2,
        fp32,
        memory,
        LAUNCH_SECONDS + waves * WAVE_SECONDS,
        in_l2,
        dot_on_fp32_units=hw.capability < (8, 0),
    )


def preprocess_time(
    hw: Hardware,
    batch: int,
    heads: int,
    n: int,
    d: int,
    bytes_per_element: int = 2,
) -> KernelTime:
    """The backward pass's first kernel, delta = rowsum(dO * O): reads O and
    dO, writes one float32 per row."""
    bytes_moved = batch * heads * n * (2 * d * bytes_per_element + 4)
    return KernelTime(
        "backward_preprocess",
        0.0,
        0.0,
        0.0,
        bytes_moved / hw.gpu.hbm_bandwidth,
        LAUNCH_SECONDS,
        False,
    )


def pass_time(
    hw: Hardware,
    batch: int,
    heads: int,
    n: int,
    d: int,
    causal: bool,
    mode: str,
    configs: dict[str, tuple[int, int, int]],
) -> list[KernelTime]:
    """Every launch of a forward (``mode="fwd"``) or forward and backward
    (``"fwd_bwd"``) pass.

    configs: kernel -> (block_q, block_k, programs per SM). The dK, dV kernel's
    programs own key blocks, so its outer block is ``block_k``.
    """
    if mode not in ("fwd", "fwd_bwd"):
        raise ValueError(f"mode must be 'fwd' or 'fwd_bwd'; got {mode!r}")
    kernels = ["forward"] + (
        ["backward_dkdv", "backward_dq"] if mode == "fwd_bwd" else []
    )
    times = []
    for kernel in kernels:
        block_q, block_k, per_sm = configs[kernel]
        outer, inner = (
            (block_k, block_q)
            if kernel == "backward_dkdv"
            else (block_q, block_k)
        )
        times.append(
            kernel_time(
                kernel, hw, batch, heads, n, d, causal, outer, inner, per_sm
            )
        )
    if mode == "fwd_bwd":
        times.append(preprocess_time(hw, batch, heads, n, d))
    return times


def predict(
    hw: Hardware,
    configs_for,
    seq_lens,
    d_heads=(64, 128),
    causal=(False, True),
    modes=("fwd", "fwd_bwd"),
    tokens: int = 16384,
    hidden: int = 2048,
) -> list[dict]:
    """The model's band over the benchmark's sweep, as rows like
    :func:`attnbook.experiments.gpu_bench.benchmark`'s.

    ``configs_for(d)`` gives the kernel -> (block_q, block_k, programs per SM)
    mapping for head size ``d``. As in the benchmark, ``batch = tokens // n``
    and ``heads = hidden // d``; TFLOP/s use the same count
    (:func:`attnbook.cost.benchmark_flops`). Two rows per point: ``impl``
    ``"model bound: <GPU>"`` (the launches' :attr:`KernelTime.bound` added: the
    most TFLOP/s the units allow) and ``"model no overlap: <GPU>"`` (their
    :attr:`KernelTime.no_overlap`); ``in_l2`` says whether every kernel's
    repeated reads were served by the L2; ``bound_by`` maps each unit that
    binds a launch (:attr:`KernelTime.busiest`) to its share of the bound's
    time, largest first.
    """
    rows = []
    for d in d_heads:
        configs = configs_for(d)
        for is_causal in causal:
            for mode in modes:
                for n in seq_lens:
                    batch, heads = max(1, tokens // n), max(1, hidden // d)
                    launches = pass_time(
                        hw, batch, heads, n, d, is_causal, mode, configs
                    )
                    flops = benchmark_flops(
                        batch, heads, n, d, is_causal, mode
                    )
                    in_l2 = all(
                        k.in_l2
                        for k in launches
                        if k.kernel != "backward_preprocess"
                    )
                    binding = {}
                    for k in launches:
                        binding[k.busiest] = (
                            binding.get(k.busiest, 0.0) + k.bound
                        )
                    bound_by = {
                        unit: t / sum(binding.values())
                        for unit, t in sorted(
                            binding.items(), key=lambda item: -item[1]
                        )
                    }
                    for label, seconds in (
                        ("bound", sum(k.bound for k in launches)),
                        ("no overlap", sum(k.no_overlap for k in launches)),
                    ):
                        rows.append(
                            dict(
                                impl=f"model {label}: {hw.gpu.name}",
                                n=n,
                                d=d,
                                causal=is_causal,
                                mode=mode,
                                batch=batch,
                                heads=heads,
                                ms=seconds * 1e3,
                                tflops=flops / seconds / 1e12,
                                in_l2=in_l2,
                                bound_by=bound_by,
                                note="model, not measured",
                            )
                        )
    return rows


def hardware_for(
    capability: tuple[int, int], total_memory: int, n_sm: int | None = None
) -> Hardware | None:
    """The :data:`HARDWARE` entry that is this GPU, or None: matched by compute
    capability and memory size
    (``torch.cuda.get_device_properties(...).total_memory``, bytes) and, when
    given, the number of SMs (``multi_processor_count``).

    A name is not enough: "H100" also names the PCIe card (114 SMs, 2.0 TB/s)
    and the NVL (94 GB). A GPU reports a little less memory than its nominal
    size, whose "GB" are GiB on these cards (an 80 GB H100 SXM5 reports about
    79.2 GiB, a 16 GB T4 about 14.7 GiB), so the reported GiB must lie within
    10 % below the nominal figure.
    """
    reported_gib = total_memory / 2**30
    for hw in HARDWARE:
        nominal = hw.gpu.hbm_bytes / GB
        if (
            tuple(capability) == hw.capability
            and 0.9 * nominal <= reported_gib <= nominal
            and (n_sm is None or n_sm == hw.gpu.n_sm)
        ):
            return hw
    return None
