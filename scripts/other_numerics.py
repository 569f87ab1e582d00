"""Print the environment that makes this CPU compute like another kind of CPU
(for nbval's second pass).

torch, MKL and OpenBLAS each pick kernels for the CPU they find, so the last
bits of a result differ between, say, an Intel Xeon with AVX-512 and an AMD
EPYC or an AVX2-only machine. These variables force other kernels, so that one
machine can check that the committed outputs survive both kinds:
- torch: on an AVX-512 CPU its AVX2 kernels, otherwise its default (no AVX)
  kernels;
- MKL (torch's matrix products): its "compatible"
  conditional-numerical-reproducibility code path;
- OpenBLAS (numpy's matrix products): kernels of another CPU family than the
  one it chose itself. An AVX-512 machine is not enough to tell: OpenBLAS runs
  its Haswell (AVX2) kernels on AMD Zen 4 and its SkylakeX (AVX-512) kernels on
  Intel, so the choice is made from what it actually runs.
The second pass therefore always differs from the first, in all three
libraries. Usage: env $(python scripts/other_numerics.py) CMD
"""

import os

# The first pass runs in this same environment, with whatever these variables
# already say (some machines set OPENBLAS_CORETYPE for every process), so ask
# what is in force now, not what the CPU would pick by itself, and choose
# something else.
import numpy  # noqa: E402,F401  (loads OpenBLAS, so that threadpoolctl can ask it)
import threadpoolctl  # noqa: E402
import torch  # noqa: E402

AVX512_OPENBLAS = {"skylakex", "cooperlake", "sapphirerapids"}

has_avx512 = (
    "avx512f" in open("/proc/cpuinfo").read()
    if os.path.exists("/proc/cpuinfo")
    else False
)
torch_avx512 = (
    torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512")
)
openblas = {
    info.get("architecture", "").lower()
    for info in threadpoolctl.threadpool_info()
    if info.get("internal_api") == "openblas"
}
if not has_avx512:
    other_openblas = "Sandybridge"
elif openblas & AVX512_OPENBLAS:
    other_openblas = "Haswell"
# AVX-512 hardware on which OpenBLAS runs AVX2 kernels (chosen, or forced): use
# the AVX-512 ones
else:
    other_openblas = "SkylakeX"
aten = "avx2" if torch_avx512 else "default"
print(
    f"ATEN_CPU_CAPABILITY={aten} MKL_CBWR=COMPATIBLE "
    f"OPENBLAS_CORETYPE={other_openblas}"
)
