"""The host side of chapter 10's kernels: validation, launches, and the
autograd Function.

:func:`triton_flash_attention` is FlashAttention in Triton, differentiable;
:func:`flash_forward`, :func:`flash_backward` and :func:`flash_decode` launch
the kernels of :mod:`attnbook.kernels.device` with the configurations
:data:`attnbook.kernels.launch.POLICY` chooses. Layout: ``q (batch, heads, n_q,
d)``, ``k`` and ``v (batch, n_kv_heads, n_k, d)`` with ``heads`` a multiple of
``n_kv_heads`` (grouped-query attention). Any dense layout whose last stride
is 1 is read in place: a (batch, n, heads, d) tensor passed as
``x.transpose(1, 2)`` is not copied; a tensor that is not dense (q, k, v
sliced from a fused QKV projection) is copied before each launch that reads
it. Without a CUDA GPU the kernels run under Triton's interpreter on
CPU tensors
(:func:`attnbook.kernels.interpreter.use_interpreter_without_cuda`).
"""

from __future__ import annotations

import math

import torch

from .. import _validate
from ..torch_attention import merge_splits
from .device import (
    backward_preprocess_kernel,
    flash_backward_dkdv_kernel,
    flash_backward_dq_kernel,
    flash_decode_split_kernel,
    flash_forward_kernel,
)
from .interpreter import tl, triton
from .launch import POLICY
from .registry import block_d

MAX_D_HEAD = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _is_interpreted(fn) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


def interpreted() -> bool:
    """True when this module's kernels run under Triton's interpreter
    (``TRITON_INTERPRET=1``)."""
    return _is_interpreted(flash_forward_kernel)


def _check_interpreter() -> None:
    """Raise when our kernels and Triton's library disagree about the
    interpreter.

    That happens when ``triton`` was imported before ``TRITON_INTERPRET`` was
    set (or unset): the library was decorated one way, our kernels the other,
    and the first ``tl.zeros`` inside a kernel would fail with an obscure
    error.
    """
    if _is_interpreted(flash_forward_kernel) != _is_interpreted(tl.zeros):
        raise RuntimeError(
            "Triton was imported before TRITON_INTERPRET was set, so its "
            "library and this module's "
            "kernels disagree about the interpreter. Restart Python and "
            "import attnbook.kernels.host "
            "before anything imports triton, or set TRITON_INTERPRET=1 in the "
            "environment first."
        )


def _check_inputs(q, k, v, causal: bool) -> None:
    """Raise ValueError (or TypeError) naming the shapes/dtypes/devices at
    fault."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor; got {type(x).__name__}"
            )
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not (q.ndim == k.ndim == v.ndim == 4):
        raise ValueError(
            f"q, k and v must be 4-D (batch, heads, n, d); got {shapes}"
        )
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            "q, k and v must have the same batch size (first dimension); got "
            f"{shapes}"
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(
            "k and v must have the same number of heads (second dimension); "
            f"got {shapes}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            "the query heads must be a multiple of the key/value heads "
            "(grouped-query "
            f"attention); got {shapes}"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(
            "k and v must have the same number of positions n_k (third "
            f"dimension); got {shapes}"
        )
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError(
            "q, k and v must have the same head dimension d (last "
            f"dimension); got {shapes}"
        )
    if min(q.shape) == 0 or min(k.shape) == 0:
        raise ValueError(f"q, k and v must not be empty; got {shapes}")
    if q.shape[3] > MAX_D_HEAD:
        raise ValueError(
            f"head dimension d must be at most {MAX_D_HEAD}; got {shapes}"
        )
    if causal:
        _validate.queries_fit(
            "causal attention", q.shape[2], k.shape[2], got=shapes
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ValueError(
            "q, k and v must share one dtype among float16, bfloat16, "
            "float32; "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device; got {q.device}, {k.device}, "
            f"{v.device}"
        )
    _check_interpreter()
    if q.device.type == "cuda":
        if q.dtype == torch.bfloat16 and torch.cuda.get_device_capability(
            q.device
        ) < (8, 0):
            raise ValueError(
                f"bfloat16 needs a GPU of compute capability 8.0 or newer; "
                f"{torch.cuda.get_device_name(q.device)} has "
                f"{torch.cuda.get_device_capability(q.device)}: use float16"
            )
    elif q.device.type == "cpu":
        if not interpreted():
            raise RuntimeError(
                "CPU tensors need Triton's interpreter, but this module's "
                "kernels were compiled for a GPU. "
                "Set TRITON_INTERPRET=1 in the environment before "
                "attnbook.kernels is first imported "
                "(e.g. start Python with TRITON_INTERPRET=1), or move the "
                "tensors to the GPU."
            )
        if q.dtype == torch.bfloat16:
            raise ValueError(
                "Triton's interpreter mishandles bfloat16: use float16 or "
                "float32 on the CPU"
            )
    else:
        raise ValueError(
            "tensors must be on a CUDA GPU or (interpreted) on the CPU; got "
            f"{q.device}"
        )


def _check_backward_inputs(do, q, k, v, out, lse, causal: bool) -> None:
    """:func:`_check_inputs`, and ``do``, ``out`` shaped like ``q`` in its
    dtype and on its device, ``lse`` (batch, heads, n_q) in float32 on that
    device: raise ValueError (or TypeError) naming them."""
    _check_inputs(q, k, v, causal)
    for name, x in (("do", do), ("out", out), ("lse", lse)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor; got {type(x).__name__}"
            )
    shapes = (
        f"q {tuple(q.shape)}, do {tuple(do.shape)}, out "
        f"{tuple(out.shape)}, lse {tuple(lse.shape)}"
    )
    if do.shape != q.shape or out.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError(
            "do and out must have q's shape (batch, heads, n_q, d) and lse "
            "(batch, heads, n_q); "
            f"got {shapes}"
        )
    if (
        do.dtype != q.dtype
        or out.dtype != q.dtype
        or lse.dtype != torch.float32
    ):
        raise ValueError(
            f"do and out must have q's dtype {q.dtype} and lse float32; got "
            f"do {do.dtype}, "
            f"out {out.dtype}, lse {lse.dtype}"
        )
    if not (do.device == out.device == lse.device == q.device):
        raise ValueError(
            f"do, out and lse must be on q's device {q.device}; got "
            f"{do.device}, {out.device}, "
            f"{lse.device}"
        )


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get true float32 products ("ieee"), not the faster,
    rounder TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _rows_of(x):
    """``x`` itself when its last dimension is contiguous (the kernels index
    rows by a stride and columns by 1) and it is dense, so that a (batch, n,
    heads, d) tensor seen as (batch, heads, n, d) through ``.transpose(1, 2)``
    is read in place; a copy otherwise. ``torch.empty_like`` of the result has
    the same strides (it is dense), which the kernels rely on for O, dQ, dK and
    dV."""
    if x.stride(-1) != 1 or torch.empty_like(x).stride() != x.stride():
        return x.contiguous()
    return x


def _strides(x) -> tuple[int, int, int]:
    """(stride of batch, of head, of row) of a (batch, heads, n, d) tensor;
    columns are adjacent."""
    return x.stride(0), x.stride(1), x.stride(2)


def _validate_blocks(block_q, block_k) -> None:
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b is not None and (
            isinstance(b, bool)
            or not isinstance(b, int)
            or b < 16
            or b & (b - 1)
        ):
            raise ValueError(
                f"{name} must be a power of two >= 16 (tl.dot needs tiles of "
                f"at least 16); got {b!r}"
            )


def flash_forward(
    q,
    k,
    v,
    causal: bool = False,
    scale: float | None = None,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
):
    """Run the forward kernel: returns ``(output, lse)``.

    q: (batch, heads, n_q, d), k and v: (batch, n_kv_heads, n_k, d) with
    ``heads`` a multiple of ``n_kv_heads`` (grouped-query attention).
    output: (batch, heads, n_q, d) in the inputs' dtype; lse: (batch, heads,
    n_q) float32, the log-sum-exp of each row of scaled scores (what backward
    needs).
    """
    _check_inputs(q, k, v, causal)
    _validate_blocks(block_q, block_k)
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    # any dense layout in place; a copy if the columns are not adjacent or
    # the tensor is not dense (see _rows_of)
    q, k, v = (_rows_of(t) for t in (q, k, v))
    # q's strides (see _rows_of)
    out = torch.empty_like(q)
    lse = torch.empty(
        (batch, heads, n_q), device=q.device, dtype=torch.float32
    )

    def launch(bq, bk, num_warps, num_stages):
        grid = (triton.cdiv(n_q, bq), batch * heads)
        flash_forward_kernel[grid](
            q,
            k,
            v,
            out,
            lse,
            n_q,
            n_k,
            scale,
            heads,
            heads // k.shape[1],
            *_strides(q),
            *_strides(k),
            *_strides(v),
            CAUSAL=bool(causal),
            BLOCK_Q=bq,
            BLOCK_K=bk,
            D_HEAD=d,
            BLOCK_D=block_d(d),
            DOT_PRECISION=_dot_precision(q.dtype),
            num_warps=num_warps,
            num_stages=num_stages,
        )

    POLICY.launch(
        "forward",
        launch,
        d,
        q.dtype,
        q.device,
        block_q,
        block_k,
        shape=(batch, heads, k.shape[1], n_q, n_k, bool(causal)),
    )
    return out, lse


def flash_backward(
    do,
    q,
    k,
    v,
    out,
    lse,
    causal: bool = False,
    scale: float | None = None,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
):
    """Run the backward kernels: returns ``(dq, dk, dv)``, shaped like ``q``,
    ``k``, ``v``.

    do and out: (batch, heads, n_q, d); lse: (batch, heads, n_q) from
    :func:`flash_forward`. Three launches: delta = rowsum(dO * O); dK and dV (a
    program per key block); dQ (a program per query block). Checks its inputs
    as :func:`flash_forward` does, and that ``do``, ``out`` and ``lse`` are
    what the forward pass of these ``q``, ``k``, ``v`` returns.
    """
    _check_backward_inputs(do, q, k, v, out, lse, causal)
    _validate_blocks(block_q, block_k)
    batch, heads, n_q, d = q.shape
    n_k, n_kv_heads = k.shape[2], k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    do, q, k, v, out = (_rows_of(t) for t in (do, q, k, v, out))
    delta = torch.empty_like(lse)
    # the inputs' strides
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(D_HEAD=d, BLOCK_D=block_d(d))
    kernel_args = dict(
        CAUSAL=bool(causal), DOT_PRECISION=_dot_precision(q.dtype), **common
    )
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(do))

    bq_pre = 64 if q.device.type == "cuda" else 32
    backward_preprocess_kernel[(triton.cdiv(n_q, bq_pre), batch * heads)](
        out,
        do,
        delta,
        n_q,
        heads,
        *_strides(out),
        *_strides(do),
        BLOCK_Q=bq_pre,
        **common,
    )

    def launch_dkdv(bq, bk, num_warps, num_stages):
        # one program per key block of each key/value head: it sums over the
        # heads of its group
        flash_backward_dkdv_kernel[(triton.cdiv(n_k, bk), batch * n_kv_heads)](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dk,
            dv,
            n_q,
            n_k,
            scale,
            n_kv_heads,
            heads // n_kv_heads,
            *strides,
            BLOCK_Q=bq,
            BLOCK_K=bk,
            num_warps=num_warps,
            num_stages=num_stages,
            **kernel_args,
        )

    def launch_dq(bq, bk, num_warps, num_stages):
        flash_backward_dq_kernel[(triton.cdiv(n_q, bq), batch * heads)](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dq,
            n_q,
            n_k,
            scale,
            heads,
            heads // n_kv_heads,
            *strides,
            BLOCK_Q=bq,
            BLOCK_K=bk,
            num_warps=num_warps,
            num_stages=num_stages,
            **kernel_args,
        )

    # each kernel chooses its own tiles (and is autotuned on its own)
    shape = (batch, heads, n_kv_heads, n_q, n_k, bool(causal))
    POLICY.launch(
        "backward_dkdv",
        launch_dkdv,
        d,
        q.dtype,
        q.device,
        block_q,
        block_k,
        shape=shape,
    )
    POLICY.launch(
        "backward_dq",
        launch_dq,
        d,
        q.dtype,
        q.device,
        block_q,
        block_k,
        shape=shape,
    )
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd glue: forward saves q, k, v, the output and the log-sum-exps;
    backward runs the kernels."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_q, block_k):
        out, lse = flash_forward(
            q, k, v, causal, scale, block_q=block_q, block_k=block_k
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (causal, scale, block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, block_q, block_k = ctx.config
        dq, dk, dv = flash_backward(
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            causal,
            scale,
            block_q=block_q,
            block_k=block_k,
        )
        # no gradients for causal, scale and the block sizes
        return dq, dk, dv, None, None, None, None


def triton_flash_attention(
    q,
    k,
    v,
    causal: bool = False,
    scale: float | None = None,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
):
    """FlashAttention in Triton, differentiable: ``softmax(scale * q k^T [+
    causal mask]) v``.

    q: (batch, heads, n_q, d); k, v: (batch, n_kv_heads, n_k, d) with ``heads``
    a multiple of ``n_kv_heads`` (grouped-query attention); returns (batch,
    heads, n_q, d). ``scale`` defaults to ``1/sqrt(d)``. With ``causal``, the
    queries are the last ``n_q`` of the ``n_k`` positions (as
    :func:`attnbook.causal_mask`; PyTorch's ``is_causal`` aligns them with the
    first ``n_q`` instead, which differs when ``n_q != n_k``).
    ``block_q``/``block_k`` override the tile sizes (powers of two, at least
    16). Runs on CUDA tensors, or on CPU tensors under the interpreter.
    """
    _check_inputs(q, k, v, causal)
    _validate_blocks(block_q, block_k)
    return FlashAttentionFunction.apply(
        q, k, v, bool(causal), scale, block_q, block_k
    )


def decode_splits(
    n_k: int, block_k: int, n_programs: int, target: int
) -> tuple[int, int]:
    """``(n_splits, split_len)``: cut ``n_k`` keys into runs of whole key
    blocks so that the ``n_programs`` programs of the plain kernel become about
    ``target`` (never an empty run)."""
    blocks = -(-n_k // block_k)
    n_splits = max(1, min(blocks, -(-target // max(n_programs, 1))))
    split_len = -(-blocks // n_splits) * block_k
    return -(-n_k // split_len), split_len


def flash_decode(
    q,
    k,
    v,
    causal: bool = False,
    scale: float | None = None,
    *,
    n_splits: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
):
    """Attention with the keys split across programs (Flash-Decoding): returns
    ``(output, lse)``.

    Same inputs and results as :func:`flash_forward`, for inference (no
    autograd): q (batch, heads, n_q, d), k and v (batch, n_kv_heads, n_k, d).
    Made for few query rows and many keys (KV-cache decoding), where the plain
    forward kernel runs one program per query block and head. ``n_splits``
    defaults to enough runs for about two programs per SM (four under the
    interpreter); the runs are combined by :func:`merge_splits`.
    """
    _check_inputs(q, k, v, causal)
    _validate_blocks(block_q, block_k)
    if n_splits is not None:
        n_splits = _validate.positive_int("n_splits", n_splits)
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q, k, v = (_rows_of(t) for t in (q, k, v))
    result = {}

    def launch(bq, bk, num_warps, num_stages):
        programs = triton.cdiv(n_q, bq) * batch * heads
        target = (
            2
            * torch.cuda.get_device_properties(q.device).multi_processor_count
            if q.is_cuda
            else 4
        )
        splits, split_len = decode_splits(
            n_k,
            bk,
            programs,
            target if n_splits is None else n_splits * programs,
        )
        o_part = torch.empty(
            (splits, batch * heads, n_q, d),
            device=q.device,
            dtype=torch.float32,
        )
        lse_part = torch.empty(
            (splits, batch * heads, n_q), device=q.device, dtype=torch.float32
        )
        flash_decode_split_kernel[
            (triton.cdiv(n_q, bq) * splits, batch * heads)
        ](
            q,
            k,
            v,
            o_part,
            lse_part,
            n_q,
            n_k,
            scale,
            heads,
            heads // k.shape[1],
            batch * heads,
            split_len,
            splits,
            *_strides(q),
            *_strides(k),
            *_strides(v),
            CAUSAL=bool(causal),
            BLOCK_Q=bq,
            BLOCK_K=bk,
            D_HEAD=d,
            BLOCK_D=block_d(d),
            DOT_PRECISION=_dot_precision(q.dtype),
            num_warps=num_warps,
            num_stages=num_stages,
        )
        result["parts"] = (o_part, lse_part)

    POLICY.launch(
        "decode",
        launch,
        d,
        q.dtype,
        q.device,
        block_q,
        block_k,
        shape=(batch, heads, k.shape[1], n_q, n_k, bool(causal)),
    )
    out, lse = merge_splits(*result["parts"])
    return out.to(q.dtype).view(batch, heads, n_q, d), lse.view(
        batch, heads, n_q
    )


def key_block_bounds(
    q_block: int,
    n_q: int,
    n_k: int,
    block_q: int,
    block_k: int,
    causal: bool = True,
) -> tuple[int, int]:
    """The host-side twin of the kernels' ``key_range``: ``(full_end, end)``
    for one query block.

    Key blocks starting before ``full_end`` are visited without a mask, those
    in ``[full_end, end)`` with one, and keys from ``end`` on are skipped. Used
    to draw and count the blocks; the kernels compute the same two numbers on
    the GPU.
    """
    if causal:
        first_query = q_block * block_q + (n_k - n_q)
        return min(first_query + 1, n_k) // block_k * block_k, min(
            first_query + block_q, n_k
        )
    return n_k // block_k * block_k, n_k


def query_block_bounds(
    k_block: int,
    n_q: int,
    n_k: int,
    block_q: int,
    block_k: int,
    causal: bool = True,
) -> tuple[int, int]:
    """The host-side twin of the dK/dV kernel's bounds: ``(start, full_start)``
    for one key block.

    Query blocks starting before ``start`` see none of this block's keys and
    are skipped; those in ``[start, full_start)`` are visited with a mask;
    those from ``full_start`` to the end see every key of the block and need
    none. The transpose of :func:`key_block_bounds`, for drawing the backward
    pass's staircase.
    """
    if not causal:
        return 0, 0
    causal_offset = n_k - n_q
    first_key = k_block * block_k
    start = max(first_key - causal_offset, 0) // block_q * block_q
    full_start = (
        -(-max(first_key + block_k - 1 - causal_offset, 0) // block_q)
        * block_q
    )
    return start, min(full_start, -(-n_q // block_q) * block_q)
