"""The registry of the kernels: what the resource table compiles, and with
which configurations.

Each entry names a ``@triton.jit`` function of :mod:`attnbook.kernels.device`,
the kind of launch whose configurations it runs with
(:func:`attnbook.kernels.launch.gpu_configs`), the types of its pointer
arguments, and the constants a launch gives it.
:mod:`attnbook.kernels.resources` reads this table, so a new kernel enters
chapter 10's resource table by one entry here. Plain Python: reading the
registry imports neither Triton nor the device code.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Integer arguments of the kernels (lengths, head counts, strides): 32-bit on
#: the device.
INT_ARGUMENTS = (
    "n_q",
    "n_k",
    "n_heads",
    "n_kv_heads",
    "group",
    "n_rows",
    "split_len",
    "n_splits",
    *(f"stride_{x}{axis}" for x in ("q", "k", "v", "do") for axis in "bhn"),
)


def block_d(d_head: int) -> int:
    """The head dimension padded to a power of two, at least 16 (tl.arange and
    tl.dot need that)."""
    return max(16, 1 << (d_head - 1).bit_length())


@dataclass(frozen=True)
class KernelSpec:
    """One kernel of the registry."""

    name: str  # its name in the resource table
    # its @triton.jit function in attnbook.kernels.device
    function: str
    # whose configurations it launches with: a kind of gpu_configs
    kind: str
    # (argument, dtype) of each pointer: "in" is the inputs' dtype
    pointers: tuple

    def jit(self):
        """The ``@triton.jit`` function (imports the device code, and with it
        Triton)."""
        from . import device

        return getattr(device, self.function)

    def signature(self, dtype: str) -> dict[str, str]:
        """Triton types of the runtime arguments for inputs of ``dtype``
        ("fp16", "bf16"); every argument not named here is a constexpr."""
        pointers = {
            name: f"*{dtype if ty == 'in' else ty}"
            for name, ty in self.pointers
        }
        return {
            **pointers,
            **{name: "i32" for name in INT_ARGUMENTS},
            "scale": "fp32",
        }

    @staticmethod
    def constants(
        d_head: int,
        block_q: int,
        block_k: int,
        causal: bool = True,
        dot_precision: str = "tf32",
    ) -> dict:
        """The constexpr arguments of a launch, as :mod:`attnbook.kernels.host`
        passes them."""
        return dict(
            CAUSAL=causal,
            BLOCK_Q=block_q,
            BLOCK_K=block_k,
            D_HEAD=d_head,
            BLOCK_D=block_d(d_head),
            DOT_PRECISION=dot_precision,
        )


_INPUTS = (("Q", "in"), ("K", "in"), ("V", "in"))
_BACKWARD = (*_INPUTS, ("DO", "in"), ("LSE", "fp32"), ("DELTA", "fp32"))

#: Every kernel that chapter 10's resource table compiles, by name.
KERNELS = {
    spec.name: spec
    for spec in (
        KernelSpec(
            "forward",
            "flash_forward_kernel",
            "forward",
            (*_INPUTS, ("O", "in"), ("LSE", "fp32")),
        ),
        KernelSpec(
            "backward_dkdv",
            "flash_backward_dkdv_kernel",
            "backward_dkdv",
            (*_BACKWARD, ("DK", "in"), ("DV", "in")),
        ),
        KernelSpec(
            "backward_dq",
            "flash_backward_dq_kernel",
            "backward_dq",
            (*_BACKWARD, ("DQ", "in")),
        ),
        KernelSpec(
            "decode_split",
            "flash_decode_split_kernel",
            "decode",
            (*_INPUTS, ("O_PART", "fp32"), ("LSE_PART", "fp32")),
        ),
    )
}
