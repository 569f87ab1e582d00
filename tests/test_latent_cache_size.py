"""Cache bytes per token (attnbook.latent.cache_size) against counts by hand,
with the shapes read from transformers' configuration classes."""

import pytest

# DeepSeek-V3, Gemma 3n and Gemma 4 are in transformers 5 (the minimum
# environment of `make test-minimum` has 4.38, without them)
transformers = pytest.importorskip("transformers", minversion="5.0")

from attnbook.latent.cache_size import (  # noqa: E402
    PUBLISHED,
    bytes_per_token,
    cache_bytes,
    kv_layer,
    latent_layer,
    layers_of,
    shared_layer,
)

K = 1024


def published(name):
    return next(m for m in PUBLISHED if m.name == name)


def test_kinds_by_hand():
    # MHA, GQA, MQA: 2 (key and value) x heads x d_head
    assert kv_layer(32, 128).elements == 8192
    assert kv_layer(8, 128).elements == 2048
    assert kv_layer(1, 128).elements == 256
    # MLA: latent + rotary key, whatever the heads
    assert latent_layer(512, 64).elements == 576
    assert shared_layer().elements == 0
    layers = [kv_layer(2, 4, window=3), latent_layer(6, 2), shared_layer()]
    # 10 tokens: the window holds 3 positions of 16, the latent 10 of 8
    assert cache_bytes(layers, 10, bytes_per_element=1) == 3 * 16 + 10 * 8
    assert bytes_per_token(layers, 2) == (16 + 8) * 2


@pytest.mark.parametrize(
    "name, per_token_bf16",
    [
        # 2 x 32 layers x 32 heads x 128 x 2 bytes
        ("Llama-2-7B", 2 * 32 * 32 * 128 * 2),
        # 2 x 32 layers x 8 heads x 128 x 2 bytes
        ("Llama-3-8B", 2 * 32 * 8 * 128 * 2),
        ("Llama-3-70B", 2 * 80 * 8 * 128 * 2),
        ("Qwen3-8B", 2 * 36 * 8 * 128 * 2),
        # 36 layers, 8 key/value heads of 64
        ("gpt-oss-120b", 2 * 36 * 8 * 64 * 2),
        ("gpt-oss-20b", 2 * 24 * 8 * 64 * 2),
        # (512 + 64) x 61 layers x 2 bytes
        ("DeepSeek-V3", (512 + 64) * 61 * 2),
    ],
)
def test_bytes_per_token_by_hand(name, per_token_bf16):
    layers = published(name).layers()
    assert bytes_per_token(layers) == per_token_bf16
    assert bytes_per_token(layers, bytes_per_element=1) == per_token_bf16 / 2


def test_long_contexts_by_hand():
    n = 128 * K
    # gpt-oss-120b: 18 full layers hold n, 18 banded ones 128 positions
    per_layer = 2 * 8 * 64 * 2
    assert cache_bytes(published("gpt-oss-120b").layers(), n) == (
        18 * n * per_layer + 18 * 128 * per_layer
    )
    # DeepSeek-V3 at 128k tokens in bf16: 8.578125 GiB
    assert cache_bytes(published("DeepSeek-V3").layers(), n) / 2**30 == (
        576 * 61 * 2 * n / 2**30
    )


def test_gemma_4_per_layer_sizes():
    """Gemma4TextConfig: 30 layers, a full layer every 6th, with head_dim 512
    (global_head_dim) against 256 on the sliding ones (window 512); 4
    key/value heads on both."""
    config = transformers.Gemma4TextConfig()
    layers = layers_of(config)
    full = [layers[i] for i in range(30) if (i + 1) % 6 == 0]
    sliding = [layers[i] for i in range(30) if (i + 1) % 6]
    assert all(l.elements == 2 * 4 * 512 and l.window is None for l in full)
    assert all(l.elements == 2 * 4 * 256 and l.window == 512 for l in sliding)
    shared = layers_of(transformers.Gemma4TextConfig(num_kv_shared_layers=20))
    assert [l.kind for l in shared[10:]] == ["shared"] * 20


def test_gemma_3n_shares_its_last_15_layers():
    layers = layers_of(transformers.Gemma3nTextConfig())
    assert [l.kind for l in layers[20:]] == ["shared"] * 15
    # 20 layers of 2 heads x 256, 4 of them full
    assert bytes_per_token(layers) == 20 * 2 * 2 * 256 * 2
    assert sum(l.window is None for l in layers[:20]) == 4


def test_every_published_model_has_a_source_in_the_bibliography():
    from pathlib import Path

    bib = (
        Path(__file__).parent.parent / "book" / "references.bib"
    ).read_text()
    for model in PUBLISHED:
        assert "{" + model.source + "," in bib, model.name


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="d_latent must be a positive"):
        latent_layer(0, 64)
    with pytest.raises(ValueError, match="window must be a positive"):
        kv_layer(8, 128, window=0)
    with pytest.raises(ValueError, match="bytes_per_element"):
        cache_bytes([kv_layer(1, 1)], 1, 0)


def test_gemma_rows_say_what_they_are():
    """Gemma4TextConfig's defaults (30 layers, no shared layer) are no
    released Gemma 4 model, and the row must say so; the Gemma 3n row is
    the E4B layout its docstring names."""
    by_config = {m.config_class: m.name for m in PUBLISHED}
    assert "not a released checkpoint" in by_config["Gemma4TextConfig"]
    assert by_config["Gemma4TextConfig"].startswith("Gemma-4-style layout")
    assert "Gemma 3n E4B" in by_config["Gemma3nTextConfig"]


def test_gemma_rows_name_their_configuration_class_as_source():
    """The Gemma rows are the defaults of transformers' configuration
    classes: the table names the class and the library's version, not a
    paper; the other rows print their bibliography key."""
    import transformers

    for model in PUBLISHED:
        label = model.source_label()
        if model.config_class.startswith("Gemma"):
            assert model.library_defaults
            assert label == (
                f"{model.config_class}, transformers "
                f"{transformers.__version__}"
            )
        else:
            assert not model.library_defaults and label == model.source
