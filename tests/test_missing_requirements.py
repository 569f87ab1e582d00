"""attnbook.minilm.missing_requirements: what a chapter's setup cell installs
for MiniLM."""

import importlib.util

import pytest

from attnbook import minilm


def test_nothing_is_missing_where_the_extra_is_installed():
    assert minilm.missing_requirements() == []


def test_a_module_that_cannot_be_imported_is_listed_with_its_lower_bound(
    monkeypatch,
):
    real = importlib.util.find_spec
    absent = {"safetensors", "huggingface_hub"}
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in absent else real(name, *a),
    )
    missing = minilm.missing_requirements()
    assert [spec.split(">=")[0] for spec in missing] == [
        "safetensors",
        "huggingface_hub",
    ]
    # the bounds of pyproject.toml travel along
    assert all(">=" in spec for spec in missing)


def test_an_unknown_extra_is_an_error():
    with pytest.raises(ValueError, match="no extra named 'minilmx'"):
        minilm.missing_requirements("minilmx")
