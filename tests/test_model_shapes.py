"""The published model shapes (attnbook.model_shapes): parameter counts against
the published totals, cache sizes against kv_cache_bytes, and validation."""

import dataclasses

import pytest

from attnbook.decoding import forward_flops, generation_flops
from attnbook.gpt import GPTConfig
from attnbook.kv_cache import kv_cache_bytes
from attnbook.model_shapes import (
    GPT2_SMALL,
    LLAMA2_7B,
    LLAMA2_70B,
    PUBLISHED_MODELS,
    ModelShape,
    as_multi_head,
    shape_of,
)


def test_published_parameter_counts():
    """matmul_params plus embeddings, biases and norms gives the published
    totals exactly."""
    g = GPT2_SMALL
    biases_norms = (
        g.n_layers * (3 * 768 + 768 + 3072 + 768 + 4 * 768) + 2 * 768
    )
    # GPT-2 small
    assert (
        g.matmul_params() + g.context_length * g.d_model + biases_norms
        == 124_439_808
    )
    for shape, total in (
        (LLAMA2_7B, 6_738_415_616),
        (LLAMA2_70B, 68_976_648_192),
    ):
        rms_norms = (2 * shape.n_layers + 1) * shape.d_model
        assert shape.matrix_params() + rms_norms == total
        # untied
        assert (
            shape.matrix_params()
            == shape.matmul_params() + shape.vocab_size * shape.d_model
        )
    # GPT-2 ties them
    assert g.matrix_params() == g.matmul_params()


def test_shapes_and_validation():
    assert [s.name for s in PUBLISHED_MODELS] == [
        "GPT-2 small",
        "Llama-2-7B",
        "Llama-2-70B",
        "Mistral-7B",
        "Llama-3-8B",
        "Falcon-7B",
    ]
    assert (
        LLAMA2_70B.n_kv_heads == 8
        and as_multi_head(LLAMA2_70B).n_kv_heads == 64
    )
    assert GPT2_SMALL.n_kv_heads == 12
    config = GPTConfig(
        vocab_size=73, context_length=256, n_layers=4, n_heads=4, d_model=96
    )
    assert shape_of(config) == ModelShape(
        "tiny GPT", 4, 4, 24, 96, 384, 73, 256
    )
    with pytest.raises(
        ValueError, match="n_heads=6 is not divisible by n_kv_heads=4"
    ):
        dataclasses.replace(GPT2_SMALL, n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="d_ff"):
        dataclasses.replace(GPT2_SMALL, d_ff=0)
    with pytest.raises(ValueError, match="n_new"):
        forward_flops(GPT2_SMALL, 0)
    with pytest.raises(ValueError, match="n_past"):
        forward_flops(GPT2_SMALL, 1, -1)
    with pytest.raises(ValueError, match="n_prompt"):
        generation_flops(GPT2_SMALL, 0, 3, True)


def test_published_models():
    shapes = {m.name: m for m in PUBLISHED_MODELS}
    assert [
        shapes[n].kind for n in ("GPT-2 small", "Llama-2-70B", "Falcon-7B")
    ] == ["MHA", "GQA", "MQA"]
    assert shapes["Llama-2-70B"].bytes_per_token() == 2 * 80 * 8 * 128 * 2
    assert (
        shapes["Llama-2-7B"].cache_bytes()
        == 2 * 32 * 32 * 128 * 4096 * 2
        == 2 * 2**30
    )
    assert (
        shapes["Mistral-7B"].cache_bytes(1000, batch=3, bytes_per_element=1)
        == 2 * 32 * 8 * 128 * 1000 * 3
    )


def test_a_sliding_window_caps_the_cache():
    """Mistral-7B's rolling buffer (W = 4096, Jiang et al. 2023): the cache
    grows up to the window, then stays."""
    mistral = {m.name: m for m in PUBLISHED_MODELS}["Mistral-7B"]
    assert mistral.sliding_window == 4096 and mistral.context_length == 8192
    # 0.5 GiB, not 1 GiB
    assert mistral.cache_bytes() == 2 * 32 * 8 * 128 * 4096 * 2 == 2**29
    assert (
        mistral.cache_bytes(4095)
        < mistral.cache_bytes(4096)
        == mistral.cache_bytes(131072)
    )
    assert mistral.bytes_per_token() == 2 * 32 * 8 * 128 * 2
    assert as_multi_head(mistral).cache_bytes() == 4 * mistral.cache_bytes()
    assert (
        LLAMA2_7B.sliding_window is None
        and LLAMA2_7B.cached_positions(10**6) == 10**6
    )
    with pytest.raises(ValueError, match="positive integer"):
        ModelShape(
            "bad",
            n_layers=2,
            n_heads=6,
            d_head=8,
            d_model=48,
            d_ff=96,
            vocab_size=10,
            context_length=16,
            sliding_window=0,
        )
    with pytest.raises(ValueError, match="not divisible"):
        ModelShape(
            "bad",
            n_layers=2,
            n_heads=6,
            n_kv_heads=4,
            d_head=8,
            d_model=48,
            d_ff=96,
            vocab_size=10,
            context_length=16,
        )
    with pytest.raises(ValueError, match="positive integer"):
        ModelShape(
            "bad",
            n_layers=0,
            n_heads=6,
            n_kv_heads=3,
            d_head=8,
            d_model=48,
            d_ff=96,
            vocab_size=10,
            context_length=16,
        )
    # the cache of each, against kv_cache_bytes and the model's own shape
    for m in PUBLISHED_MODELS:
        held = (
            m.context_length
            if m.sliding_window is None
            else min(m.context_length, m.sliding_window)
        )
        assert m.cache_bytes() == kv_cache_bytes(
            m.n_layers, m.n_kv_heads, m.d_head, held
        )
        assert m.n_heads * m.d_head == m.d_model
