"""The compiler's resource table for the Triton kernels (attnbook.kernel_resources, chapter 10).

Every launch configuration attnbook.triton_flash can choose must compile, on every target, with
no register spills and within the target's shared memory. No GPU is needed: Triton compiles
ahead of time and its ptxas reports the resources.
"""
import pytest

pytest.importorskip("triton")

from attnbook import kernel_resources as kr  # noqa: E402


@pytest.fixture(scope="module")
def shipped():
    return kr.compile_rows(kr.shipped_rows())


def test_the_table_covers_every_kernel_target_head_size_and_dtype(shipped):
    seen = {(r.row.kernel, r.row.capability, r.row.d_head, r.row.dtype) for r in shipped}
    for kernel in kr.KERNELS:
        for capability in kr.TARGETS:
            for d_head in (64, 128):
                assert (kernel, capability, d_head, "fp16") in seen
                assert ((kernel, capability, d_head, "bf16") in seen) == (capability >= 80)


def test_no_shipped_configuration_spills_or_overflows_shared_memory(shipped):
    bad = [r for r in shipped if not r.fits]
    assert not bad, "\n".join(f"{r.row}: {r.registers} registers, {r.spill_stores} B spilled, "
                              f"{r.shared} B shared (limit {kr.TARGETS[r.row.capability].shared_limit})"
                              for r in bad)
    assert all(0 < r.registers <= kr.MAX_REGISTERS for r in shipped)


def test_tensor_core_instructions_where_the_hardware_has_them(shipped):
    for r in shipped:
        if r.row.capability == 75:                   # Triton emits FMAs on Turing
            assert r.mma == r.wgmma == 0
        elif r.row.capability < 90:
            assert r.mma > 0 and r.wgmma == 0
        else:                                        # Hopper: warpgroup MMA for the big tiles
            assert r.mma + r.wgmma > 0


def test_a_spilling_configuration_is_reported_as_such():
    # 64 x 64 tiles on a T4 were the old default: ptxas spills thousands of bytes per thread
    (old,) = kr.compile_rows([kr.Row("forward", 64, "fp16", 64, 64, 4, 1, 75)])
    assert old.spill_stores > 1000 and not old.fits


def test_the_cache_is_keyed_by_the_row(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNBOOK_CACHE", str(tmp_path))
    row = kr.Row("forward", 64, "fp16", 16, 16, 4, 1, 80)
    (first,) = kr.compile_rows([row])
    assert (tmp_path / "kernel_resources.json").exists()
    (again,) = kr.compile_rows([row])               # from the cache, the same answer
    assert again == first
    assert kr._cache_key(row) != kr._cache_key(kr.Row("forward", 64, "fp16", 16, 16, 4, 1, 90))
