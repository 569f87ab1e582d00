"""The run order of conftest.py: the slowest files first, each file's items in
their own order."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest():
    spec = importlib.util.spec_from_file_location(
        "root_conftest", ROOT / "conftest.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_file_named_slowest_first_exists():
    missing = [
        p for p in _root_conftest().SLOWEST_FIRST if not (ROOT / p).is_file()
    ]
    assert not missing, (
        f"conftest.SLOWEST_FIRST names files that do not exist: {missing}"
    )


def test_slow_files_move_to_the_front_and_cells_keep_their_order():
    conftest = _root_conftest()
    slow, slower = conftest.SLOWEST_FIRST[1], conftest.SLOWEST_FIRST[0]
    ids = [
        "tests/test_a.py::x",
        f"{slow}::Cell 0",
        "tests/test_a.py::y",
        f"{slow}::Cell 1",
        f"{slower}::Cell 0",
        f"{slow}::Cell 2",
        f"{slower}::Cell 1",
        "tests/test_b.py::z",
    ]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    conftest.pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == [
        f"{slower}::Cell 0",
        f"{slower}::Cell 1",
        f"{slow}::Cell 0",
        f"{slow}::Cell 1",
        f"{slow}::Cell 2",
        "tests/test_a.py::x",
        "tests/test_a.py::y",
        "tests/test_b.py::z",
    ]
