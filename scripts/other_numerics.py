"""Print the environment that makes this CPU compute like another kind of CPU (for nbval's second pass).

torch, MKL and OpenBLAS each pick kernels for the CPU they find, so the last bits of a result differ
between an AVX-512 machine and an AVX2-only one. These variables force the kernels of the other
kind, so that one machine can check that the committed outputs survive both:
- on an AVX-512 CPU: torch's AVX2 kernels, MKL's conditional-numerical-reproducibility "compatible"
  code path, OpenBLAS's Haswell (AVX2) kernels;
- on anything less: torch's default (no AVX) kernels, MKL's compatible path, OpenBLAS's Sandybridge
  kernels.
Either way the second pass differs from the first. Usage: env $(python scripts/other_numerics.py) CMD
"""
import os

for name in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OPENBLAS_CORETYPE"):
    os.environ.pop(name, None)  # ask what this CPU does by itself

import torch  # noqa: E402

native = torch.backends.cpu.get_cpu_capability()
if native.upper().startswith("AVX512"):
    print("ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE OPENBLAS_CORETYPE=Haswell")
else:
    print("ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE OPENBLAS_CORETYPE=Sandybridge")
