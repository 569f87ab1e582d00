"""Layer layouts (attnbook.sparse.layouts) of gpt-oss and Gemma 3, read from
transformers' configuration classes, against hand counts."""

import pytest

from attnbook.sparse.layouts import cost_per_token, layer_types, reach

transformers = pytest.importorskip("transformers", minversion="5.0")


def test_gpt_oss_alternates_sliding_and_full():
    kinds = layer_types(transformers.GptOssConfig())
    assert len(kinds) == 36
    assert kinds[:4] == ["sliding", "full", "sliding", "full"]
    assert kinds.count("sliding") == kinds.count("full") == 18


def test_gemma3_puts_five_sliding_layers_before_each_full_one():
    kinds = layer_types(transformers.Gemma3TextConfig(num_hidden_layers=12))
    assert kinds == (["sliding"] * 5 + ["full"]) * 2


def test_reach_by_hand():
    assert reach(["sliding"] * 3, 4) == 9  # 3 layers * 3 positions
    assert reach(["sliding"], 1) == 0  # a window of 1: itself only
    assert reach(["sliding", "full", "sliding"], 4) is None


def test_reach_equals_the_receptive_field_of_stacked_windows():
    import numpy as np

    from attnbook.masks import sliding_window_mask
    from attnbook.windows import receptive_field

    n, w, layers = 40, 5, 4
    field = receptive_field(sliding_window_mask(n, w), layers)
    assert (n - 1) - np.flatnonzero(field[n - 1]).min() == reach(
        ["sliding"] * layers, w
    )


def test_gpt_oss_cost_by_hand():
    """gpt-oss (defaults): 36 layers, 64 query heads, 8 key/value heads of
    64, window 128. At n = 1024 a sliding layer holds 128 positions, a full
    one 1024; a key and a value of 8 * 64 numbers, 2 bytes each."""
    cost = cost_per_token(transformers.GptOssConfig(), 1024)
    per_position = 2 * 8 * 64 * 2
    assert cost.cache_bytes_per_token == (
        18 * per_position * (128 + 1024) / 1024
    )
    assert cost.full_cache_bytes_per_token == 36 * per_position
    assert cost.flops == 18 * 4 * 64 * 64 * (128 + 1024)
    assert cost.full_flops == 36 * 4 * 64 * 64 * 1024


def test_a_short_context_costs_the_same_as_full():
    cost = cost_per_token(transformers.GptOssConfig(), 100)
    assert cost.flops == cost.full_flops
    assert cost.cache_bytes_per_token == cost.full_cache_bytes_per_token


@pytest.mark.parametrize(
    "call, named",
    [
        (lambda: reach(["sliding"], 0), "window"),
        (lambda: reach(["sliding"], -4), "-4"),
        (lambda: reach(["local"], 4), "local"),
        (lambda: cost_per_token(transformers.GptOssConfig(), 0), "n"),
    ],
)
def test_bad_input_is_named(call, named):
    with pytest.raises(ValueError, match=named):
        call()
