"""Bytes moved against flops: why naive attention waits on memory and tiled
attention need not.

A GPU keeps its arrays in HBM (large, slow) and computes from on-chip SRAM
(tiny, fast). A kernel whose *arithmetic intensity* (flops per byte moved to or
from HBM) is below the GPU's *ridge point* (peak flop/s over HBM bytes/s)
cannot use the arithmetic units fully: it is memory-bound. The counts here are
models of the HBM traffic of the two algorithms, in elements read or written:

- naive attention (Dao et al. 2022, Algorithm 0): read Q, K, write S; read S,
  write P; read P, V, write O. The two ``n_q x n_k`` matrices cross the
  boundary four times.
- FlashAttention: read Q once, write O (and the log-sum-exp) once, and read
  each key/value block once per query block that needs it.

Specifications of real GPUs are from NVIDIA's whitepapers and datasheets; the
``sources`` of each entry are keys in the book's bibliography.

Chapter 9 (FlashAttention) builds its roofline from these counts; chapters
12, 14 and 15 read the GPU table :data:`GPUS` (chapter 14 the H100's ridge
point, chapter 15 its peak against its host links).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._validate import positive_int
from .cost import attention_flops
from .flash import key_tiles


@dataclass(frozen=True)
class GPU:
    """One GPU's memory hierarchy and peak throughput (dense, no sparsity)."""

    name: str
    hbm_bytes: float  # capacity of the off-chip memory
    hbm_bandwidth: float  # bytes per second between HBM and the chip
    # bytes of on-chip L1/shared memory in one streaming multiprocessor
    sram_per_sm: int
    # the most of it a kernel can use as shared memory
    shared_per_sm: int
    n_sm: int  # streaming multiprocessors
    # peak float16 tensor-core flop/s (fp32 accumulate)
    fp16_flops: float
    sources: tuple[str, ...]  # bibliography keys of the figures
    # the most shared memory one thread block can use: the carve-out less
    # the 1 KiB CUDA reserves per block on compute capability 8.0 and later
    # (the CUDA programming guide, nvidia2024cudaguide)
    shared_per_block: int

    @property
    def ridge_point(self) -> float:
        """Flops per HBM byte above which a kernel is compute-bound: peak
        flop/s over bandwidth."""
        return self.fp16_flops / self.hbm_bandwidth

    @property
    def sram_bytes(self) -> int:
        """On-chip L1/shared memory summed over all SMs."""
        return self.sram_per_sm * self.n_sm


KB, GB, TB = 1024, 1e9, 1e12

#: A100 figures from the Ampere whitepaper and the A100 datasheet; H100 from
#: the Hopper ones.
GPUS = (
    GPU(
        "A100 SXM4 40GB",
        40 * GB,
        1555 * GB,
        192 * KB,
        164 * KB,
        108,
        312 * TB,
        ("nvidia2020a100", "nvidia2021a100datasheet"),
        shared_per_block=163 * KB,
    ),
    GPU(
        "A100 SXM4 80GB",
        80 * GB,
        2039 * GB,
        192 * KB,
        164 * KB,
        108,
        312 * TB,
        ("nvidia2020a100", "nvidia2021a100datasheet"),
        shared_per_block=163 * KB,
    ),
    GPU(
        "H100 SXM5 80GB",
        80 * GB,
        3350 * GB,
        256 * KB,
        228 * KB,
        132,
        989.4 * TB,
        ("nvidia2022h100", "nvidia2023h100datasheet"),
        shared_per_block=227 * KB,
    ),
)


@dataclass(frozen=True)
class Traffic:
    """Flops computed and bytes moved between HBM and the chip by one attention
    call."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: flops per byte of HBM traffic."""
        return self.flops / self.bytes


def naive_traffic(
    n_q: int, n_k: int, d: int, batch: int = 1, bytes_per_element: int = 2
) -> Traffic:
    """Standard attention, three kernels with the scores and weights stored in
    HBM.

    Elements moved per batch entry: ``4 n_q n_k + 2 n_q d + 2 n_k d`` (d_k =
    d_v = d).
    """
    n_q, n_k, d, batch, size = (
        positive_int(name, x)
        for name, x in dict(
            n_q=n_q,
            n_k=n_k,
            d=d,
            batch=batch,
            bytes_per_element=bytes_per_element,
        ).items()
    )
    # S = Q K^T: read Q, K; write S
    elements = (
        n_q * d
        + n_k * d
        + n_q * n_k
        # P = softmax(S): read S, write P
        + 2 * n_q * n_k
        # O = P V: read P, V; write O
        + n_q * n_k
        + n_k * d
        + n_q * d
    )
    return Traffic(
        attention_flops(n_q, n_k, d, d, batch), batch * elements * size
    )


def flash_traffic(
    n_q: int,
    n_k: int,
    d: int,
    block_q: int,
    block_k: int | None = None,
    batch: int = 1,
    bytes_per_element: int = 2,
    causal: bool = False,
) -> Traffic:
    """The tiled algorithm: Q read and O written once, K and V read once per
    query block.

    The tiles visited are those of :func:`attnbook.flash.key_tiles`, so
    ``causal`` counts only the tiles that are not skipped. The log-sum-exp (one
    float32 per query) is written for the backward pass.
    """
    n_q, n_k, d, block_q, batch, size = (
        positive_int(name, x)
        for name, x in dict(
            n_q=n_q,
            n_k=n_k,
            d=d,
            block_q=block_q,
            batch=batch,
            bytes_per_element=bytes_per_element,
        ).items()
    )
    block_k = block_q if block_k is None else positive_int("block_k", block_k)
    elements = 2 * n_q * d  # read Q, write O
    # the same work per visible score as naive
    flops, per_pair = 0, attention_flops(1, 1, d, d)
    for i0 in range(0, n_q, block_q):
        rows = slice(i0, min(i0 + block_q, n_q))
        for cols, _ in key_tiles(rows, n_q, n_k, block_k, causal):
            width = cols.stop - cols.start
            # this query block reads the K and V block
            elements += 2 * width * d
            flops += (rows.stop - rows.start) * width * per_pair
    return Traffic(batch * flops, batch * (elements * size + 4 * n_q))


def flash_traffic_l2(
    n_q: int,
    n_k: int,
    d: int,
    block_q: int,
    block_k: int | None = None,
    batch: int = 1,
    bytes_per_element: int = 2,
    causal: bool = False,
) -> Traffic:
    """The tiled algorithm when the L2 cache serves the repeated reads of K and
    V.

    The programs of one head run at about the same time, so after the first
    query block has read a block of K and V from HBM the others find it in L2
    (tens of MB on an A100 or H100, against ``2 n_k d`` elements per head).
    Then Q, K and V are each read from HBM once and O written once: the fewest
    bytes any algorithm can move, and so an upper bound on the intensity, where
    :func:`flash_traffic` (every re-read from HBM) is the lower bound. The
    flops are those of :func:`flash_traffic`.
    """
    tiled = flash_traffic(
        n_q, n_k, d, block_q, block_k, batch, bytes_per_element, causal
    )
    # Q, O, K, V once each
    elements = 2 * n_q * d + 2 * n_k * d
    return Traffic(
        tiled.flops, batch * (elements * bytes_per_element + 4 * n_q)
    )


def attainable_flops(intensity: float, gpu: GPU) -> float:
    """The roofline: flop/s a kernel of this intensity can reach, ``min(peak,
    intensity * bandwidth)``."""
    return min(gpu.fp16_flops, intensity * gpu.hbm_bandwidth)
