"""The kernels as a family (attnbook.kernels): who sets TRITON_INTERPRET, the
constants named once, and the registry that the resource table reads."""

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import attnbook
from attnbook.kernels import registry, resources

PACKAGE = Path(attnbook.__file__).parent
#: The modules that import Triton, and so may choose its interpreter: the
#: kernels' device and host code.
TRITON_MODULES = {
    "attnbook.kernels.interpreter",
    "attnbook.kernels.device",
    "attnbook.kernels.host",
}


def test_only_the_kernels_set_triton_interpret():
    """Importing attnbook and every other module, the registry, resource table
    and time model of the kernels included, in a fresh Python leaves the
    environment without TRITON_INTERPRET. (Importing attnbook.triton_flash used
    to set it for the whole process.)"""
    modules = sorted(
        m.name
        for m in pkgutil.walk_packages([str(PACKAGE)], "attnbook.")
        if m.name not in TRITON_MODULES
    )
    assert (
        "attnbook.kernels.resources" in modules
        and "attnbook.kernel_time" in modules
    )
    code = (
        "import importlib, os, sys\nimport attnbook\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'TRITON_INTERPRET' not in os.environ, name + ' set "
        "TRITON_INTERPRET'\n"
        "print('ok', len(sys.modules))\n"
    )
    env = {
        key: value
        for key, value in os.environ.items()
        if key != "TRITON_INTERPRET"
    }
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")


def test_the_kernels_set_it_without_a_gpu():
    """The other side: the device code chooses the interpreter when torch sees
    no CUDA GPU."""
    code = (
        "import os, torch\nimport attnbook.kernels.device\n"
        "print(os.environ.get('TRITON_INTERPRET') == ('0' if "
        "torch.cuda.is_available() else '1') or "
        "torch.cuda.is_available())\n"
    )
    env = {
        key: value
        for key, value in os.environ.items()
        if key != "TRITON_INTERPRET"
    }
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0 and result.stdout.split() == ["True"], (
        result.stderr[-3000:]
    )


def test_log2e_and_ln2_are_named_once():
    """log2(e) and ln(2) appear as numbers in one place of the package, the
    device code's LOG2E and LN2 (they were written out five and two times in
    the kernels)."""
    for digits in ("1.4426950408", "0.6931471805"):
        places = [
            path.relative_to(PACKAGE).as_posix()
            for path in PACKAGE.rglob("*.py")
            for _ in range(path.read_text().count(digits))
        ]
        assert places == ["kernels/device.py"], (digits, places)
    from attnbook.kernels import device

    assert (
        abs(device.LOG2E.value - 1.4426950408889634) < 1e-16
        and abs(device.LN2.value * device.LOG2E.value - 1) < 1e-15
    )


def test_every_registered_kernel_is_a_jitted_function_of_the_device_code():
    from attnbook.kernels import device

    assert set(registry.KERNELS) == set(resources.KERNELS)
    for spec in registry.KERNELS.values():
        kernel = spec.jit()
        assert kernel is getattr(device, spec.function) and type(
            kernel
        ).__name__ in ("JITFunction", "InterpretedFunction")
        assert {name for name, _ in spec.pointers} <= set(kernel.arg_names)
        assert set(spec.constants(64, 32, 32)) <= set(kernel.arg_names)
    assert [
        registry.block_d(d) for d in (1, 16, 17, 48, 64, 65, 128, 256)
    ] == [16, 16, 32, 64, 64, 128, 128, 256]


def test_the_resource_table_reads_the_registry(monkeypatch):
    """A kernel registered under a new name enters the table with its kind's
    configurations: the resource table reads the registry, not a list of its
    own (nor triton_flash._block_d)."""
    spec = registry.KERNELS["forward"]
    extra = registry.KernelSpec(
        "forward_again", spec.function, "decode", spec.pointers
    )
    monkeypatch.setattr(
        resources, "REGISTRY", {**registry.KERNELS, "forward_again": extra}
    )
    rows = resources.shipped_rows(capabilities=(80,), d_heads=(64,))
    from attnbook.kernels.launch import gpu_configs

    added = [
        (r.block_q, r.block_k, r.num_warps, r.num_stages)
        for r in rows
        if r.kernel == "forward_again" and r.dtype == "fp16"
    ]
    assert added == gpu_configs("decode", 64, (8, 0))
    assert resources.kernel_signature("forward", "bf16")["Q"] == "*bf16"
    assert (
        resources.kernel_signature("decode_split", "fp16")["O_PART"] == "*fp32"
    )
