"""Receptive fields of stacked windowed layers, the sink window mask, and attention shares."""
import numpy as np
import pytest
import torch

import attnbook
from attnbook.multihead import MultiHeadAttention
from attnbook.windows import key_share, receptive_field, sink_window_mask, uniform_share


def reach_by_paths(mask, n_layers):
    """Reachability by following edges one layer at a time (sets, no matrix products)."""
    n = len(mask)
    out = np.zeros((n, n), bool)
    for i in range(n):
        frontier = {i}
        for _ in range(n_layers):
            frontier = frontier | {j for p in frontier for j in range(n) if mask[p, j]}
        out[i, sorted(frontier)] = True
    return out


@pytest.mark.parametrize("n, window, layers", [(10, 3, 1), (12, 3, 2), (20, 4, 3), (9, 1, 4), (16, 5, 5), (6, 2, 9)])
def test_sliding_window_field_is_w_minus_one_times_layers_plus_one(n, window, layers):
    field = receptive_field(attnbook.sliding_window_mask(n, window), layers)
    for i in range(n):
        lowest = max(0, i - (window - 1) * layers)
        assert list(np.flatnonzero(field[i])) == list(range(lowest, i + 1))


def test_random_masks_agree_with_path_following(rng):
    for _ in range(10):
        mask = rng.random((7, 7)) < 0.25
        for layers in (1, 2, 3):
            np.testing.assert_array_equal(receptive_field(mask, layers), reach_by_paths(mask, layers))


def test_field_matches_the_jacobian_of_real_attention_layers():
    """Which outputs of a stack of windowed attention layers (with residuals) move when an input moves."""
    torch.manual_seed(0)
    n, window, layers = 11, 3, 3
    mask = torch.from_numpy(attnbook.sliding_window_mask(n, window))
    stack = [MultiHeadAttention(4, 2).double() for _ in range(layers)]

    def net(x):
        for layer in stack:
            x = x + layer(x, mask=mask)
        return x

    x = torch.randn(1, n, 4, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(net, x)[0, :, :, 0, :, :]      # (n, 4, n, 4)
    depends = jac.abs().sum(dim=(1, 3)) > 0                                # (n_out, n_in)
    np.testing.assert_array_equal(depends.numpy(), receptive_field(mask.numpy(), layers))


def test_sink_window_mask_by_entries():
    n, window, sinks = 9, 3, 2
    mask = sink_window_mask(n, window, sinks)
    for i in range(n):
        expected = {j for j in range(n) if (i - window < j <= i) or (j < sinks and j <= i)}
        assert set(np.flatnonzero(mask[i])) == expected
    np.testing.assert_array_equal(sink_window_mask(n, window, 0), attnbook.sliding_window_mask(n, window))


def test_key_share_of_uniform_attention_is_the_uniform_share():
    n = 12
    uniform = attnbook.causal_mask(n) / np.arange(1, n + 1)[:, None]
    for first in (0, 3, 11):
        assert key_share(uniform, key=0, first_query=first) == pytest.approx(uniform_share(n, first))
    weights = np.stack([uniform, np.eye(n)])
    np.testing.assert_allclose(key_share(weights, 0, 1), [uniform_share(n, 1), 0.0])


@pytest.mark.parametrize("call", [
    lambda: receptive_field(np.ones((3, 3)), 1),
    lambda: receptive_field(np.ones((3, 4), bool), 1),
    lambda: receptive_field(np.ones((3, 3), bool), 0),
    lambda: sink_window_mask(5, 2, -1),
    lambda: sink_window_mask(5, 0, 1),
    lambda: key_share(np.ones((3, 4)), 0),
    lambda: key_share(np.ones((4, 4)), 2, 1),
    lambda: uniform_share(4, 4),
])
def test_bad_input(call):
    with pytest.raises(ValueError):
        call()
