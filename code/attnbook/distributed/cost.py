"""What attention across devices costs: tokens, bytes moved, memory, and when
communication hides behind compute.

One attention layer, one sequence of ``n`` tokens on ``P`` devices, a shape
of ``H`` query heads, ``H_kv`` key/value heads of ``d`` features, ``b`` bytes
per element, and ``g`` bytes per element of the gradients ``dk, dv`` that
travel in ring's backward pass (by default the width of the ring's
accumulators: float32, ``g = 4``, for 16-bit inputs;
:attr:`AttentionShape.grad_bytes`). Each device holds ``c = ceil(n / P)``
tokens (the largest share; :func:`tokens_per_device`). Counts are per device;
every device sends as much as it receives.

- **Ring attention** (Liu et al. 2023). A key-value block is ``2 c H_kv d b``
  bytes. The forward pass sends it ``P - 1`` times (after the last step no
  block needs to move). The backward pass sends the key-value blocks ``P -
  1`` times again, and with them the accumulated gradients ``dk, dv`` of the
  block, ``2 c H_kv d g`` bytes, which travel ``P`` times: the last hop
  brings them home (:func:`ring_bytes`).
- **DeepSpeed-Ulysses** (Jacobs et al. 2023). An all-to-all turns each
  device's ``c`` tokens of every head into all ``n`` tokens of ``H / P``
  heads, and a second one turns the output back. Each all-to-all keeps
  ``1 / P`` of a device's shard and sends the other ``(P - 1) / P``: ``q``,
  ``k``, ``v`` and ``o`` move once each in the forward pass, ``do``, ``dq``,
  ``dk``, ``dv`` in the backward (:func:`ulysses_bytes`). Ulysses needs ``P``
  to divide ``H``; with fewer key/value heads than devices each is copied so
  that every device gets one (``max(H_kv, P)`` heads move).
- **Memory** (:func:`ring_memory`, :func:`ulysses_memory`): the attention
  activations one device holds at once in the forward pass: its shard's
  ``q, k, v, o``, the float32 log-sum-exp the backward pass keeps, and
  ring's two visiting key-value blocks (one being used, one arriving) or
  Ulysses's full-length tensors for its heads. Weights, the rest of the
  model and the backward pass's gradients are outside the count; no
  ``n x n`` matrix is held (each block is attended as FlashAttention does).
- **Overlap** (:func:`overlap_tokens`): a ring step hides its transfer when
  computing a block takes at least as long as sending one. Forward,
  non-causal: ``4 c^2 H d / F >= 2 c H_kv d b / B``, so ``c >= F H_kv b /
  (2 H B)`` for a throughput ``F`` (flop/s) and a one-way link bandwidth
  ``B`` (bytes/s). With MHA (``H_kv = H``) and ``b = 2`` that is ``c >= F /
  B``, Liu et al.'s condition. A causal step on a balanced layout computes
  half a block: ``c`` doubles. The backward pass computes 2.5 times the
  forward's flops (chapter 10's convention) and sends ``(b + g) / b`` times
  the bytes (the block and its gradients), so its bound is ``2 (b + g) / (5
  b)`` times the forward's: 1.2 for bf16 inputs with float32 gradients, 0.8
  if the gradients travelled at the input's width.

:data:`RATES` holds the published rates, each with its source (keys of
``book/references.bib``), :data:`REPORTED` the papers' own figures as
published, :func:`overlap_thresholds` the condition at those rates, and
:func:`cost_table` the table for 1M tokens on 8 to 512 GPUs.
Numbers only, no torch. Chapter 11 (attention across devices) shows these
functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from .. import _validate


@dataclass(frozen=True)
class AttentionShape:
    """The shape of one attention layer: heads, key/value heads, features per
    head, bytes per element, and the bytes per element of the gradients dk,
    dv that ring's backward pass sends (None: those of its accumulators,
    :attr:`grad_bytes`)."""

    name: str
    n_heads: int
    n_kv_heads: int
    d_head: int
    bytes_per_element: int = 2
    sources: tuple[str, ...] = ()
    grad_bytes_per_element: int | None = None

    def __post_init__(self):
        for field in ("n_heads", "n_kv_heads", "d_head", "bytes_per_element"):
            _validate.positive_int(field, getattr(self, field))
        if self.grad_bytes_per_element is not None:
            _validate.positive_int(
                "grad_bytes_per_element", self.grad_bytes_per_element
            )
        _validate.group_size(self.n_heads, self.n_kv_heads, f" ({self.name})")

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of the dk, dv that travel: as given, or those of
        the ring's accumulators (``attnbook.distributed.ring.work_dtype``),
        float32 for 16-bit inputs: ``max(bytes_per_element, 4)``."""
        if self.grad_bytes_per_element is not None:
            return self.grad_bytes_per_element
        return max(self.bytes_per_element, 4)


#: A Llama-3-8B-like layer: 32 query heads, 8 key/value heads of 128, bf16.
LLAMA3_8B = AttentionShape(
    "Llama-3-8B-like layer (bf16)",
    32,
    8,
    128,
    2,
    ("grattafiori2024llama3", "meta2024llama3modelcard"),
)


@dataclass(frozen=True)
class Rate:
    """A published rate: its value in ``unit``, what it measures, where it is
    published (bibliography keys) and how the value was read from there."""

    value: float
    unit: str
    what: str
    sources: tuple[str, ...]
    note: str = ""


#: Published link and compute rates.
RATES: dict[str, Rate] = {
    "H100 SXM BF16 dense": Rate(
        989.4e12,
        "FLOP/s",
        "peak dense BF16 tensor-core throughput of an H100 SXM5 (FP32 "
        "accumulate)",
        ("nvidia2022h100", "nvidia2023h100datasheet"),
        "the whitepaper's 989.4 TFLOPS; the datasheet's 1,979 TFLOPS is with "
        "2:4 sparsity, twice the dense rate",
    ),
    "NVLink 4 total": Rate(
        900e9,
        "B/s",
        "NVLink bandwidth of one H100 SXM5, both directions together",
        ("nvidia2022h100", "nvidia2023h100datasheet"),
        "900 GB/s, as published",
    ),
    "NVLink 4 per direction": Rate(
        450e9,
        "B/s",
        "NVLink bandwidth of one H100 SXM5, one direction",
        ("nvidia2022h100",),
        "half of the published 900 GB/s, which counts both directions "
        "together",
    ),
    "InfiniBand NDR port": Rate(
        50e9,
        "B/s",
        "one InfiniBand NDR port of a ConnectX-7 adapter, one direction",
        ("nvidia2023connectx7",),
        "published as 400 Gb/s (bits) per port; 400 / 8 = 50 GB/s",
    ),
}


@dataclass(frozen=True)
class Reported:
    """A figure a paper reports, as published: what, on which hardware,
    where."""

    method: str
    claim: str
    hardware: str
    source: str
    where: str


#: The papers' reported figures, as published.
REPORTED: tuple[Reported, ...] = (
    Reported(
        "Ring Attention",
        "trains sequences up to device count times longer than prior "
        "memory-efficient Transformers",
        "TPUs and GPUs",
        "liu2023ring",
        "abstract",
    ),
    Reported(
        "Striped Attention",
        "up to 1.45x end-to-end throughput over Ring Attention in causal "
        "training at a sequence length of 256k",
        "A100 GPUs and TPUv4s",
        "brandon2023striped",
        "abstract",
    ),
    Reported(
        "Striped Attention",
        "1.65x speedups at sequence lengths of 786k",
        "16 TPUv4 chips",
        "brandon2023striped",
        "abstract",
    ),
    Reported(
        "DeepSpeed-Ulysses",
        "trains 2.5x faster with 4x longer sequence length than the "
        "existing method SOTA baseline",
        "A100 GPUs",
        "jacobs2023ulysses",
        "abstract",
    ),
    Reported(
        "DeepSpeed-Ulysses",
        "communication volume per link 4Nh/P (hidden size h): constant when "
        "sequence length and devices grow in proportion",
        "(analysis)",
        "jacobs2023ulysses",
        "abstract; the blog's communication analysis",
    ),
    Reported(
        "DeepSpeed-Ulysses",
        "strong scaling of sequence length up to 1 million tokens on a "
        "1.2-billion-parameter GPT model",
        "up to 64 A100 GPUs",
        "deepspeed2023ulyssesblog",
        "evaluation, sequence length scalability",
    ),
    Reported(
        "DeepSpeed-Ulysses",
        "sustained throughput of over 175 TFLOPs per GPU (over 54% of "
        "hardware peak)",
        "A100 GPUs",
        "deepspeed2023ulyssesblog",
        "introduction",
    ),
)


def tokens_per_device(n: int, world_size: int) -> int:
    """``ceil(n / world_size)``: the most tokens a device holds when ``n`` are
    shared as evenly as whole tokens allow."""
    n = _validate.nonnegative_int("n", n)
    world_size = _validate.positive_int("world_size", world_size)
    return -(-n // world_size)


def kv_block_bytes(tokens: int, shape: AttentionShape) -> int:
    """Bytes of the keys and values of ``tokens`` tokens: ``2 tokens H_kv d
    b``."""
    return (
        2 * tokens * shape.n_kv_heads * shape.d_head * shape.bytes_per_element
    )


def kv_grad_bytes(tokens: int, shape: AttentionShape) -> int:
    """Bytes of the gradients dk, dv of ``tokens`` tokens as ring's backward
    pass sends them: ``2 tokens H_kv d g``."""
    return 2 * tokens * shape.n_kv_heads * shape.d_head * shape.grad_bytes


def ring_bytes(
    n: int, world_size: int, shape: AttentionShape, backward: bool = False
) -> int:
    """Bytes one device sends in one attention layer's ring pass (forward, or
    backward with ``backward=True``): the key-value block ``P - 1`` times; in
    the backward pass also the block's ``dk, dv`` (at ``shape.grad_bytes``
    per element), ``P`` times (none when ``P = 1``)."""
    p = _validate.positive_int("world_size", world_size)
    c = tokens_per_device(n, p)
    if p == 1:
        return 0
    grads = p * kv_grad_bytes(c, shape) if backward else 0
    return (p - 1) * kv_block_bytes(c, shape) + grads


def ulysses_kv_heads(world_size: int, shape: AttentionShape) -> int:
    """The key/value heads an all-to-all moves: ``H_kv``, or ``P`` when there
    are fewer (each head copied to the devices of its query heads). Raises
    ValueError unless ``P`` divides ``H`` and ``P`` and ``H_kv`` divide one
    another."""
    p = _validate.positive_int("world_size", world_size)
    h, n_kv_heads = shape.n_heads, shape.n_kv_heads
    if h % p:
        raise ValueError(
            f"Ulysses splits the heads over the devices: world_size={p} must "
            f"divide n_heads={h}"
        )
    if (n_kv_heads % p) if p <= n_kv_heads else (p % n_kv_heads):
        raise ValueError(
            f"Ulysses needs world_size={p} and n_kv_heads={n_kv_heads} to "
            "divide one another"
        )
    return max(n_kv_heads, p)


def ulysses_bytes(
    n: int, world_size: int, shape: AttentionShape, backward: bool = False
) -> int:
    """Bytes one device sends in one attention layer's all-to-alls (the same
    forward and backward): ``(P - 1) / P`` of its shard of ``q``, ``k``, ``v``
    and ``o``, that is ``(P - 1) c d b (2H + 2 max(H_kv, P)) / P``."""
    p = _validate.positive_int("world_size", world_size)
    heads = 2 * shape.n_heads + 2 * ulysses_kv_heads(p, shape)
    c = tokens_per_device(n, p)
    del backward  # do, dq, dk, dv: the same volume
    return (p - 1) * c * shape.d_head * shape.bytes_per_element * heads // p


def ring_memory(
    n: int, world_size: int, shape: AttentionShape
) -> dict[str, int]:
    """Bytes of attention activations one device holds during a ring forward
    pass: ``{"local": q, k, v, o of its c tokens, "lse": the float32
    log-sum-exp of its queries, "visiting": two key-value blocks, "total"}``.
    """
    c = tokens_per_device(n, world_size)
    local = (
        c
        * shape.d_head
        * shape.bytes_per_element
        * (2 * shape.n_heads + 2 * shape.n_kv_heads)
    )
    lse = 4 * c * shape.n_heads
    visiting = 2 * kv_block_bytes(c, shape)
    return {
        "local": local,
        "lse": lse,
        "visiting": visiting,
        "total": local + lse + visiting,
    }


def ulysses_memory(
    n: int, world_size: int, shape: AttentionShape
) -> dict[str, int]:
    """Bytes of attention activations one device holds during a Ulysses
    forward pass: ``{"local": its shard of q, k, v, o, "heads": q, k, v, o of
    all n tokens for its heads after the all-to-all, "lse", "total"}``."""
    p = _validate.positive_int("world_size", world_size)
    kv = ulysses_kv_heads(p, shape)
    c = tokens_per_device(n, p)
    n = _validate.nonnegative_int("n", n)
    per_token = shape.d_head * shape.bytes_per_element
    local = c * per_token * (2 * shape.n_heads + 2 * shape.n_kv_heads)
    heads = n * per_token * (2 * shape.n_heads + 2 * kv) // p
    lse = 4 * n * shape.n_heads // p
    return {
        "local": local,
        "heads": heads,
        "lse": lse,
        "total": local + heads + lse,
    }


def overlap_tokens(
    shape: AttentionShape,
    flops_per_s: float,
    bytes_per_s: float,
    causal: bool = False,
    backward: bool = False,
) -> int:
    """The fewest tokens per device ``c`` for which a ring step's compute
    takes at least as long as its transfer over a link of ``bytes_per_s``
    one way, at ``flops_per_s``:

    ``ceil(F H_kv b / (2 H B))`` forward and non-causal; twice that when
    causal (a balanced step computes half a block); ``2 (b + g) / (5 b)``
    times it in the backward pass (2.5 times the flops; the block and its
    gradients, ``g = shape.grad_bytes`` bytes per element, travel): 1.2 times
    for bf16 with float32 gradients. ``d`` cancels.
    Computed exactly (fractions), so a whole-number bound is not pushed up
    by rounding."""
    if not (flops_per_s > 0 and bytes_per_s > 0):
        raise ValueError(
            "flops_per_s and bytes_per_s must be positive; got "
            f"{flops_per_s!r} and {bytes_per_s!r}"
        )
    tokens = (
        Fraction(flops_per_s)
        * shape.n_kv_heads
        * shape.bytes_per_element
        / (2 * shape.n_heads * Fraction(bytes_per_s))
    )
    if causal:
        tokens *= 2
    if backward:
        b, g = shape.bytes_per_element, shape.grad_bytes
        tokens *= Fraction(2 * (b + g), 5 * b)
    return math.ceil(tokens)


def ring_step_seconds(
    tokens: int,
    shape: AttentionShape,
    flops_per_s: float,
    bytes_per_s: float,
    causal: bool = False,
) -> tuple[float, float]:
    """``(compute, transfer)`` seconds of one forward ring step with
    ``tokens`` tokens per device: ``4 c^2 H d / F`` (halved when causal, a
    balanced step) and ``2 c H_kv d b / B``."""
    c = _validate.nonnegative_int("tokens", tokens)
    flops = 4 * c * c * shape.n_heads * shape.d_head / (2 if causal else 1)
    return flops / flops_per_s, kv_block_bytes(c, shape) / bytes_per_s


def overlap_thresholds(
    shape: AttentionShape = LLAMA3_8B,
    flops: str = "H100 SXM BF16 dense",
    links=("NVLink 4 per direction", "InfiniBand NDR port"),
) -> dict[tuple[str, str], int]:
    """:func:`overlap_tokens` at the published rates of :data:`RATES`, for
    each link and each pass: ``{(link, pass): tokens per device}`` with pass
    ``"forward"``, ``"forward, causal"``, ``"backward"`` and ``"backward,
    causal"``."""
    out = {}
    for link in links:
        for name, causal, backward in (
            ("forward", False, False),
            ("forward, causal", True, False),
            ("backward", False, True),
            ("backward, causal", True, True),
        ):
            out[link, name] = overlap_tokens(
                shape,
                RATES[flops].value,
                RATES[link].value,
                causal=causal,
                backward=backward,
            )
    return out


@dataclass(frozen=True)
class CostRow:
    """One line of :func:`cost_table`."""

    world_size: int
    tokens_per_device: int
    ring_block_bytes: int  # one key-value block: what one ring step sends
    ring_forward_bytes: int
    ring_backward_bytes: int
    ulysses_bytes: int | None  # None: Ulysses cannot split the heads
    ring_memory_bytes: int
    ulysses_memory_bytes: int | None
    # ring's forward over NVLink / InfiniBand hides the transfer
    overlaps_nvlink: bool
    overlaps_infiniband: bool


#: The device counts of the table.
WORLD_SIZES = (8, 16, 32, 64, 128, 256, 512)


def cost_table(
    n: int = 1 << 20,
    shape: AttentionShape = LLAMA3_8B,
    world_sizes=WORLD_SIZES,
    causal: bool = True,
) -> list[CostRow]:
    """Per device, for one attention layer of ``shape`` and ``n`` tokens
    (default 2^20, "1M"), on each device count: tokens, bytes sent by ring
    (forward, backward) and Ulysses (each pass), memory, and whether ring's
    forward step (causal by default, on a balanced layout) hides its
    transfer at the H100's peak BF16 throughput over NVLink (per direction)
    and over one InfiniBand NDR port."""
    flops = RATES["H100 SXM BF16 dense"].value
    need = {
        link: overlap_tokens(shape, flops, RATES[link].value, causal=causal)
        for link in ("NVLink 4 per direction", "InfiniBand NDR port")
    }
    rows = []
    for p in world_sizes:
        c = tokens_per_device(n, p)
        try:
            ulysses = ulysses_bytes(n, p, shape)
            ulysses_mem = ulysses_memory(n, p, shape)["total"]
        except ValueError:
            ulysses = ulysses_mem = None
        rows.append(
            CostRow(
                p,
                c,
                kv_block_bytes(c, shape),
                ring_bytes(n, p, shape),
                ring_bytes(n, p, shape, backward=True),
                ulysses,
                ring_memory(n, p, shape)["total"],
                ulysses_mem,
                c >= need["NVLink 4 per direction"],
                c >= need["InfiniBand NDR port"],
            )
        )
    return rows


def format_cost_table(rows: list[CostRow]) -> str:
    """:func:`cost_table` as aligned text, 79 characters at most: MiB for
    bytes, "-" where Ulysses cannot split the heads; NVL and IB say whether
    ring's forward step hides its transfer over NVLink and InfiniBand."""

    def mib(x):
        return "-" if x is None else f"{x / 2**20:.1f}"

    def yes(flag):
        return "yes" if flag else "no"

    lines = [
        f"{'GPUs':>4} {'tokens':>7} {'block':>6} {'ring fwd':>8} "
        f"{'ring bwd':>8} {'Ulysses':>7} {'ring mem':>8} {'Uly mem':>7} "
        f"{'NVL':>3} {'IB':>3}",
        f"{'':>13}(MiB sent per layer and device)  (MiB held)",
    ]
    for r in rows:
        lines.append(
            f"{r.world_size:>4} {r.tokens_per_device:>7} "
            f"{mib(r.ring_block_bytes):>6} {mib(r.ring_forward_bytes):>8} "
            f"{mib(r.ring_backward_bytes):>8} {mib(r.ulysses_bytes):>7} "
            f"{mib(r.ring_memory_bytes):>8} {mib(r.ulysses_memory_bytes):>7} "
            f"{yes(r.overlaps_nvlink):>3} {yes(r.overlaps_infiniband):>3}"
        )
    return "\n".join(lines)
