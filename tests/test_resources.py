"""The compiler's resource table for the Triton kernels
(attnbook.kernels.resources, chapter 10).

Every launch configuration attnbook.kernels.launch can choose, for every kernel
of the registry, must compile, on every target, with no register spills and
within the target's shared memory. No GPU is needed: Triton compiles ahead of
time and its ptxas reports the resources.
"""

import pytest

pytest.importorskip("triton")

from attnbook.kernels import resources as kr  # noqa: E402


@pytest.fixture(scope="module")
def shipped():
    return kr.compile_rows(kr.shipped_rows())


def test_the_table_covers_every_kernel_target_head_size_and_dtype(shipped):
    seen = {
        (r.row.kernel, r.row.capability, r.row.d_head, r.row.dtype)
        for r in shipped
    }
    for kernel in kr.KERNELS:
        for capability in kr.TARGETS:
            for d_head in (64, 128):
                assert (kernel, capability, d_head, "fp16") in seen
                assert ((kernel, capability, d_head, "bf16") in seen) == (
                    capability >= 80
                )


def test_no_shipped_configuration_spills_or_overflows_shared_memory(shipped):
    bad = [r for r in shipped if not r.fits]
    assert not bad, "\n".join(
        f"{r.row}: {r.registers} registers, {r.spill_stores} B spilled, "
        f"{r.shared} B shared (limit "
        f"{kr.TARGETS[r.row.capability].shared_limit})"
        for r in bad
    )
    assert all(0 < r.registers <= kr.MAX_REGISTERS for r in shipped)


def test_tensor_core_instructions_where_the_hardware_has_them(shipped):
    for r in shipped:
        # Triton emits FMAs on Turing
        if r.row.capability == 75:
            assert r.mma == r.wgmma == 0
        elif r.row.capability < 90:
            assert r.mma > 0 and r.wgmma == 0
        # Hopper: warpgroup MMA for the big tiles
        else:
            assert r.mma + r.wgmma > 0


def test_a_spilling_configuration_is_reported_as_such():
    # 64 x 64 tiles on a T4 were the old default: ptxas spills thousands of
    # bytes per thread
    (old,) = kr.compile_rows([kr.Row("forward", 64, "fp16", 64, 64, 4, 1, 75)])
    assert old.spill_stores > 1000 and not old.fits


def test_the_cache_is_keyed_by_the_row(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNBOOK_CACHE", str(tmp_path))
    row = kr.Row("forward", 64, "fp16", 16, 16, 4, 1, 80)
    (first,) = kr.compile_rows([row])
    assert (tmp_path / "kernel_resources.json").exists()
    # from the cache, the same answer
    (again,) = kr.compile_rows([row])
    assert again == first
    assert kr._cache_key(row) != kr._cache_key(
        kr.Row("forward", 64, "fp16", 16, 16, 4, 1, 90)
    )


def test_the_committed_table_is_what_the_compiler_says_now(shipped):
    """Chapter 10 prints the committed table unless a reader asks to recompile:
    it must be today's."""
    from importlib.metadata import version

    committed, origin = kr.committed_table()
    assert origin["kernels"] == kr.kernels_source_hash(), (
        "the kernels changed since the table was committed: run "
        "kr.write_committed_table(kr.compile_rows("
        "kr.shipped_rows()))"
    )
    assert [r.row for r in committed] == [
        *kr.shipped_rows(),
        kr.OLD_T4_FORWARD,
    ]
    if origin["triton"] != version("triton"):
        pytest.skip(
            f"the table was compiled with Triton {origin['triton']}, this is "
            f"{version('triton')}"
        )
    assert committed[:-1] == shipped
    assert committed[-1] == kr.compile_rows([kr.OLD_T4_FORWARD])[0]


def test_the_resource_table_is_the_committed_one_unless_asked(monkeypatch):
    monkeypatch.delenv("ATTNBOOK_RECOMPILE_KERNELS", raising=False)
    rows, where = kr.resource_table()
    assert (
        rows == kr.committed_table()[0]
        and "committed" in where
        and "ATTNBOOK_RECOMPILE_KERNELS=1" in where
    )


def test_the_kernels_hash_ignores_host_code_only():
    import ast
    from pathlib import Path

    source = Path(kr.__file__).with_name("device.py").read_text()
    jitted = [
        node.name
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef)
        and any("jit" in ast.unparse(d) for d in node.decorator_list)
    ]
    assert {
        "flash_forward_kernel",
        "forward_step",
        "flash_backward_dkdv_kernel",
        "flash_backward_dq_kernel",
        "flash_decode_split_kernel",
        "may_attend",
        "key_range",
    } <= set(jitted)
    # the constants the kernels read are what the compiler sees too; the
    # module's docstring is not
    assert (
        kr.kernels_source_hash(source.replace("1.4426950408889634", "1.4427"))
        != kr.kernels_source_hash()
    )
    assert (
        kr.kernels_source_hash(
            source.replace("The device code", "The GPU code", 1)
        )
        == kr.kernels_source_hash()
    )


def test_a_longer_key_block_spills_in_the_dkdv_kernel():
    """Why, at d = 64, the dK, dV kernel's key block stays at most its query
    block (attnbook.kernels.launch._BEST, chapter 10): its two float32
    accumulators grow with the key block, and these longer key tiles, compiled
    at d = 64, spill. (At d = 128 the H100 ships a longer key block, 32 x 64,
    which the shipped-configuration tests check for spills like every
    other.)"""
    rows = [
        kr.Row("backward_dkdv", 64, "fp16", 32, 64, 8, 2, 80),
        kr.Row("backward_dkdv", 64, "fp16", 32, 64, 8, 2, 89),
        kr.Row("backward_dkdv", 64, "fp16", 64, 128, 8, 1, 90),
    ]
    assert all(
        r.spill_stores > 0 and not r.fits for r in kr.compile_rows(rows)
    )
