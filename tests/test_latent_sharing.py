"""Which layer reuses which layer's cache (attnbook.latent.sharing), against
the map transformers reads from Gemma 3n's and Gemma 4's configurations.

transformers marks each layer of those models with ``kv_sharing_modes``:
``"reuse"`` for a layer that attends with another layer's keys and values,
``"store"`` for the layer of each attention type whose keys and values are
kept for them, None otherwise; the modelling code gives a ``"reuse"`` layer
the stored keys and values of its own type. That map is rebuilt here from the
modes and compared with :func:`reuse_last_of_type`.
"""

import pytest

# DeepSeek-V3, Gemma 3n and Gemma 4 are in transformers 5 (the minimum
# environment of `make test-minimum` has 4.38, without them)
transformers = pytest.importorskip("transformers", minversion="5.0")

from attnbook.latent.sharing import (  # noqa: E402
    cla_sources,
    producers,
    reuse_last_of_type,
    yoco_sources,
)


def transformers_sources(config) -> list[int]:
    """Layer i's cache source as transformers' Gemma models decide it."""
    modes, types = config.kv_sharing_modes, config.layer_types
    stored = {types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    return [
        stored[types[i]] if mode == "reuse" else i
        for i, mode in enumerate(modes)
    ]


GEMMA_CONFIGS = [
    ("Gemma4TextConfig", {"num_kv_shared_layers": 0}),
    ("Gemma4TextConfig", {"num_kv_shared_layers": 10}),
    ("Gemma4TextConfig", {"num_kv_shared_layers": 20}),
    (
        "Gemma4TextConfig",
        {"num_hidden_layers": 12, "num_kv_shared_layers": 5},
    ),
    ("Gemma3nTextConfig", {}),
    ("Gemma3nTextConfig", {"num_kv_shared_layers": 4}),
]


@pytest.mark.parametrize(
    "name, overrides", GEMMA_CONFIGS, ids=lambda v: str(v)
)
def test_gemma_sharing_map_matches_transformers(name, overrides):
    config = getattr(transformers, name)(**overrides)
    ours = reuse_last_of_type(config.layer_types, config.num_kv_shared_layers)
    assert ours == transformers_sources(config)


def test_gemma_4_default_layers_with_20_shared():
    """By hand: 30 layers, full every 6th (5, 11, ...); layers 10..29 reuse,
    so the sliding ones reuse layer 9 and the full ones layer 5."""
    config = transformers.Gemma4TextConfig(num_kv_shared_layers=20)
    sources = reuse_last_of_type(config.layer_types, 20)
    assert sources[:10] == list(range(10))
    full = [i for i in range(10, 30) if (i + 1) % 6 == 0]
    assert all(sources[i] == 5 for i in full)
    assert all(sources[i] == 9 for i in range(10, 30) if i not in full)
    assert producers(sources) == list(range(10))


def test_sharing_needs_a_producer_of_each_type():
    types = ["sliding_attention"] * 4 + ["full_attention"]
    with pytest.raises(ValueError, match=r"\['full_attention'\]"):
        reuse_last_of_type(types, 1)
    with pytest.raises(ValueError, match="n_shared must be an integer in"):
        reuse_last_of_type(types, 5)


def test_cla_and_yoco_by_hand():
    assert cla_sources(6, 2) == [0, 0, 2, 2, 4, 4]
    assert cla_sources(6, 3) == [0, 0, 0, 3, 3, 3]
    assert cla_sources(4, 1) == [0, 1, 2, 3]
    assert yoco_sources(6) == [0, 1, 2, 3, 3, 3]
    assert producers(yoco_sources(6)) == [0, 1, 2, 3]
