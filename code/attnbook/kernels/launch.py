"""Launch policy: which tiles, warps and stages each kernel launches with, and
the memory of its choices.

A configuration is ``(BLOCK_Q, BLOCK_K, num_warps, num_stages)``.
:func:`gpu_configs` lists the candidates for a GPU, best first, from the
compiler's resource table (chapter 10). A :class:`LaunchPolicy` chooses among
them at a kernel's first launch, on a GPU by timing them (autotuning), and
remembers the choice in a cache keyed on what changes the best configuration:
the kernel, head size, dtype, device and tiles asked for, and
:func:`tuning_key` of the problem (sequence lengths, bucketed to powers of two;
causality; batch x heads). The host functions of :mod:`attnbook.kernels.host`
use :data:`POLICY`; a test or a benchmark can pass its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch


# Launch configurations (BLOCK_Q, BLOCK_K, num_warps, num_stages), chosen from
# the compiler's resource table (attnbook.kernels.resources, printed in chapter
# 10): every entry below compiles with no register spills and within the
# target's shared memory, for d_head 64 and 128, in float16 and bfloat16, in
# the causal specialisation (CAUSAL=True; the non-causal binaries are not
# compiled there); tests/test_resources.py checks that on every target. Keys:
# the GPU family (T4 = 7.x; A100 = 8.0; other 8.x, e.g. L4 = 8.9, with 99 KiB
# of shared memory; H100 = 9.x) and whether the head is padded to 64 or to 128
# features.
_BEST = {
    # T4: no tensor cores in Triton and no asynchronous copies (num_stages 1);
    # its FMA-based products need many registers, so small tiles and 8 warps
    # (more threads share the tile).
    # decode (flash_decode): 16 query rows, the fewest tl.dot takes, since a
    # decoding step has one query row per head; long key tiles and (from Ampere
    # on) two stages of prefetch, since it waits on memory far more than on
    # arithmetic. (On the T4, 4 warps spilled: 8 share the tiles.) The two
    # backward kernels get tiles of their own. Each keeps one block resident
    # and streams the other: the dQ kernel keeps BLOCK_Q query rows (as the
    # forward does), so it wants BLOCK_Q >= BLOCK_K; the dK, dV kernel keeps
    # BLOCK_K key rows and two float32 accumulators (dK and dV) for them, and
    # at d = 64 a longer key block than query block spilled there with 8 warps
    # (32 x 64 with 2 stages on sm_80 and sm_89, 64 x 128 with 1 stage on
    # sm_90; causal, chapter 10); other warp and stage counts were not tried
    # for this, so it is no general rule, but at d = 64 the shipped key block
    # stays at most its query block. The exception
    # is sm_90 at d = 128, whose dK, dV kernel ships 32 x 64 (236 registers, no
    # spill, in the committed table).
    ("sm75", 64): {
        "forward": (64, 32, 8, 1),
        "backward_dkdv": (32, 32, 8, 1),
        "backward_dq": (32, 32, 8, 1),
        "decode": (16, 64, 8, 1),
    },
    ("sm75", 128): {
        "forward": (32, 32, 8, 1),
        "backward_dkdv": (16, 16, 8, 1),
        "backward_dq": (16, 16, 8, 1),
        "decode": (16, 32, 8, 1),
    },
    ("sm80", 64): {
        "forward": (128, 64, 8, 3),
        "backward_dkdv": (64, 32, 8, 2),
        "backward_dq": (64, 32, 8, 2),
        "decode": (16, 64, 4, 2),
    },
    ("sm80", 128): {
        "forward": (128, 64, 8, 3),
        "backward_dkdv": (64, 64, 8, 1),
        "backward_dq": (64, 64, 8, 1),
        "decode": (16, 64, 4, 2),
    },
    ("sm8x", 64): {
        "forward": (128, 64, 8, 3),
        "backward_dkdv": (64, 32, 8, 2),
        "backward_dq": (64, 32, 8, 2),
        "decode": (16, 64, 4, 2),
    },
    ("sm8x", 128): {
        "forward": (128, 64, 8, 3),
        "backward_dkdv": (64, 64, 8, 1),
        "backward_dq": (64, 64, 8, 1),
        "decode": (16, 64, 4, 2),
    },
    ("sm90", 64): {
        "forward": (128, 64, 8, 3),
        "backward_dkdv": (128, 64, 8, 1),
        "backward_dq": (128, 64, 8, 1),
        "decode": (16, 64, 4, 2),
    },
    ("sm90", 128): {
        "forward": (128, 64, 8, 3),
        "backward_dkdv": (32, 64, 8, 2),
        "backward_dq": (64, 32, 8, 2),
        "decode": (16, 64, 4, 2),
    },
}
#: The kinds of launch gpu_configs knows: one per kernel ("backward" is kept as
#: the dQ kernel's).
KINDS = ("forward", "backward_dkdv", "backward_dq", "decode")
# Fallbacks, tried in order after the best one if it fails to launch; checked
# like the best.
_FALLBACKS = {
    "sm75": [(16, 16, 8, 1)],
    "other": [(32, 32, 8, 1), (16, 16, 4, 1)],
}


def _family(capability: tuple[int, int]) -> str:
    if capability < (8, 0):
        return "sm75"
    if capability == (8, 0):
        return "sm80"
    return "sm8x" if capability < (9, 0) else "sm90"


def gpu_configs(
    kind: str, d_head: int, capability: tuple[int, int]
) -> list[tuple[int, int, int, int]]:
    """Candidate ``(BLOCK_Q, BLOCK_K, num_warps, num_stages)`` for a GPU, best
    first.

    ``kind``: one of :data:`KINDS` (the two backward kernels have tiles of
    their own).

    Bigger tiles reuse each loaded tile for more products but need more
    registers and shared
    memory: a T4 (compute capability 7.5) has 64 KiB of shared memory per
    block, an A100 163 KiB, an L4 99 KiB, an H100 227 KiB. Stages > 1 let the
    compiler prefetch the next tiles while computing (asynchronous copies:
    Ampere and newer). ``d_head`` above 128 is not covered by the resource
    table and gets the smallest tiles.
    """
    if kind == "backward":
        kind = "backward_dq"
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    family = _family(capability)
    fallbacks = _FALLBACKS["sm75" if family == "sm75" else "other"]
    if d_head > 128:
        return fallbacks[-1:]
    best = _BEST[family, 64 if d_head <= 64 else 128][kind]
    return list(dict.fromkeys([best, *fallbacks]))


def user_config(
    block_q: int, block_k: int, capability: tuple[int, int]
) -> tuple[int, int, int, int]:
    """Warps and stages for tile sizes the caller chose: 8 warps from 128 x 64
    up, else 4; one stage on a T4 (no asynchronous copies), two from Ampere
    on."""
    num_warps = 8 if block_q * block_k >= 128 * 64 else 4
    return block_q, block_k, num_warps, 1 if capability < (8, 0) else 2


#: (BLOCK_Q, BLOCK_K, num_warps, num_stages) under Triton's interpreter, which
#: ignores the last two.
INTERPRETER_CONFIG = (32, 32, 4, 1)


def length_bucket(n: int) -> int:
    """``n`` rounded up to a power of two: lengths of one octave share one
    tuned configuration."""
    return 1 << max(int(n) - 1, 0).bit_length()


def tuning_key(shape) -> tuple:
    """What, besides the kernel, head size, dtype and device, changes which
    configuration is fastest: ``shape = (batch, heads, n_kv_heads, n_q, n_k,
    causal)`` reduced to causality, the numbers of (batch, head) and of (batch,
    key/value head) pairs, and each length rounded up to a power of two
    (:func:`length_bucket`, as Triton's tutorial keys its autotuning on N_CTX),
    so that a configuration timed at n = 100 does not serve n = 16384, while
    lengths of one octave share one timing."""
    batch, heads, n_kv_heads, n_q, n_k, causal = shape
    return (
        bool(causal),
        batch * heads,
        batch * n_kv_heads,
        length_bucket(n_q),
        length_bucket(n_k),
    )


def cuda_seconds(run) -> float:
    """Median time of ``run()`` over 5 calls on the GPU, after one call that
    compiles and warms up."""
    run()
    times = []
    for _ in range(5):
        start, end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


@dataclass
class LaunchPolicy:
    """Chooses a configuration at a kernel's first launch and remembers it.

    ``timer`` times one candidate (a test substitutes a fake clock);
    ``autotune`` says whether a GPU launch times the candidates (default:
    unless the environment sets ``ATTNBOOK_AUTOTUNE=0``); ``chosen`` is the
    cache, from :meth:`key` to the configuration chosen.
    """

    timer: Callable = cuda_seconds
    autotune: bool = field(
        default_factory=lambda: os.environ.get("ATTNBOOK_AUTOTUNE", "1") != "0"
    )
    chosen: dict = field(default_factory=dict)

    def autotuning(self, device) -> bool:
        """Whether the first launch of a kernel on ``device`` times every
        candidate and keeps the
        fastest: on a GPU, when ``autotune`` is on."""
        return str(device).startswith("cuda") and self.autotune

    @staticmethod
    def key(
        kind: str,
        d_head: int,
        dtype,
        device,
        block_q=None,
        block_k=None,
        shape=None,
    ) -> tuple:
        """The cache key: the kernel, head size, dtype, device, the tiles asked
        for, and :func:`tuning_key` of ``shape`` (None without one)."""
        return (
            kind,
            d_head,
            dtype,
            str(device),
            block_q,
            block_k,
            None if shape is None else tuning_key(shape),
        )

    @staticmethod
    def candidates(
        kind: str, device, d_head: int, block_q=None, block_k=None
    ) -> list[tuple[int, int, int, int]]:
        """The configurations to try, best first: :func:`gpu_configs` on a GPU,
        the interpreter's tiles on the CPU; tiles the caller chose replace the
        tiles of the best."""
        device = torch.device(device)
        if device.type == "cpu":
            candidates, capability = [INTERPRETER_CONFIG], None
        else:
            capability = torch.cuda.get_device_capability(device)
            candidates = gpu_configs(kind, d_head, capability)
        if block_q is None and block_k is None:
            return candidates
        block_q, block_k = (
            block_q or candidates[0][0],
            block_k or candidates[0][1],
        )
        # the interpreter ignores warps and stages
        if capability is None:
            return [(block_q, block_k, *INTERPRETER_CONFIG[2:])]
        return [user_config(block_q, block_k, capability)]

    def launch(
        self,
        kind: str,
        launch,
        d_head: int,
        dtype,
        device,
        block_q=None,
        block_k=None,
        shape=None,
    ):
        """Call ``launch(BLOCK_Q, BLOCK_K, num_warps, num_stages)`` with a
        configuration that fits.

        The first call for a :meth:`key` chooses and remembers the
        configuration. On a GPU (see :meth:`autotuning`) it runs every
        candidate that launches and keeps the fastest: the candidates are all
        free of spills (chapter 10's resource table), but which is fastest
        depends on the GPU. Otherwise it keeps the first that launches. Every
        launch overwrites the same outputs, so running several candidates
        changes nothing but the time.
        """
        # (here, not at the top: the resource table reads gpu_configs)
        from .interpreter import triton

        OutOfResources = triton.runtime.errors.OutOfResources

        key = self.key(kind, d_head, dtype, device, block_q, block_k, shape)
        if key in self.chosen:
            return launch(*self.chosen[key])
        configs = self.candidates(kind, device, d_head, block_q, block_k)
        if self.autotuning(device) and len(configs) > 1:
            seconds = {}
            for config in configs:
                try:
                    seconds[config] = self.timer(lambda: launch(*config))
                except OutOfResources:
                    continue
            if not seconds:
                # raises the last OutOfResources again
                return launch(*configs[-1])
            self.chosen[key] = min(seconds, key=seconds.get)
            return launch(*self.chosen[key])
        for i, config in enumerate(configs):
            try:
                result = launch(*config)
            except OutOfResources:
                if i == len(configs) - 1:
                    raise
                continue
            self.chosen[key] = config
            return result


#: The policy the host functions use unless given another.
POLICY = LaunchPolicy()
