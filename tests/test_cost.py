"""Tests of attnbook.cost: the flop and memory model of naive attention.

The references are independent of the module: PyTorch's flop counter on the two
matrix products, the byte sizes of the arrays that attnbook's attention really
returns, and tracemalloc's measured peak.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from attnbook import attention_scores, scaled_dot_product_attention
from attnbook.bench import peak_memory
from attnbook.cost import (
    attention_flop_breakdown,
    attention_flops,
    attention_memory_breakdown,
    attention_memory_bytes,
)

sizes = st.integers(min_value=1, max_value=64)
ARGS = ("n_q", "n_k", "d_k", "d_v")


def torch_matmul_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize(
    "batch, n_q, n_k, d_k, d_v",
    [
        (1, 1, 1, 1, 1),
        (1, 7, 7, 16, 16),
        (3, 5, 9, 12, 3),
        (2, 1, 33, 8, 64),
        (4, 17, 2, 5, 11),
    ],
)
def test_matmul_terms_match_torch_flop_counter(batch, n_q, n_k, d_k, d_v):
    q, k = torch.randn(batch, n_q, d_k), torch.randn(batch, n_k, d_k)
    w, v = torch.randn(batch, n_q, n_k), torch.randn(batch, n_k, d_v)
    counts = attention_flop_breakdown(n_q, n_k, d_k, d_v, batch=batch)
    assert counts["scores"] == torch_matmul_flops(lambda: q @ k.mT)
    assert counts["weighted_sum"] == torch_matmul_flops(lambda: w @ v)


@settings(max_examples=50, deadline=None)
@given(sizes, sizes, sizes, sizes, st.integers(1, 8))
def test_total_is_the_closed_form(n_q, n_k, d_k, d_v, batch):
    # per (query, key) pair: 2 d_k for the dot product, 1 scale, 5 softmax, 2
    # d_v for weights @ v
    expected = batch * n_q * n_k * (2 * d_k + 1 + 5 + 2 * d_v)
    assert attention_flops(n_q, n_k, d_k, d_v, batch=batch) == expected
    assert (
        sum(attention_flop_breakdown(n_q, n_k, d_k, d_v, batch).values())
        == expected
    )


@settings(max_examples=50, deadline=None)
@given(sizes, sizes, sizes, sizes)
def test_flops_scale_quadratically_in_length_and_linearly_in_width(
    n_q, n_k, d_k, d_v
):
    base = attention_flops(n_q, n_k, d_k, d_v)
    assert attention_flops(2 * n_q, 2 * n_k, d_k, d_v) == 4 * base
    assert attention_flops(n_q, n_k, d_k, d_v, batch=3) == 3 * base
    assert attention_flops(n_q, n_k, d_k + 1, d_v) - base == 2 * n_q * n_k


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(
    "shape", [(1, 1, 1, 1), (5, 9, 12, 3), (16, 16, 8, 8), (1, 40, 4, 7)]
)
def test_memory_matches_the_arrays_attention_creates(shape, dtype):
    n_q, n_k, d_k, d_v = shape
    rng = np.random.default_rng(0)
    q, k, v = (
        rng.normal(size=s).astype(dtype)
        for s in ((2, n_q, d_k), (2, n_k, d_k), (2, n_k, d_v))
    )
    out, weights = scaled_dot_product_attention(q, k, v)
    scores = attention_scores(q, k)
    parts = attention_memory_breakdown(
        n_q, n_k, d_k, d_v, batch=2, bytes_per_element=np.dtype(dtype).itemsize
    )
    # the package scores float16 inputs in float32 (q . k can pass 65504):
    # twice the model's bytes
    score_bytes = attention_memory_breakdown(
        n_q, n_k, d_k, d_v, batch=2, bytes_per_element=scores.itemsize
    )["scores"]
    assert scores.itemsize == max(4, np.dtype(dtype).itemsize)
    assert parts | {"scores": score_bytes} == {
        "scores": scores.nbytes,
        "weights": weights.nbytes,
        "output": out.nbytes,
    }
    assert attention_memory_bytes(
        n_q, n_k, d_k, d_v, batch=2, bytes_per_element=np.dtype(dtype).itemsize
    ) == sum(parts.values())


@settings(max_examples=50, deadline=None)
@given(sizes, sizes, sizes, sizes)
def test_memory_does_not_depend_on_d_k_and_quadruples_with_length(
    n_q, n_k, d_k, d_v
):
    parts = attention_memory_breakdown(n_q, n_k, d_k, d_v)
    assert attention_memory_breakdown(n_q, n_k, d_k + 5, d_v) == parts
    doubled = attention_memory_breakdown(2 * n_q, 2 * n_k, d_k, d_v)
    assert (
        doubled["scores"] == 4 * parts["scores"]
        and doubled["weights"] == 4 * parts["weights"]
    )
    assert doubled["output"] == 2 * parts["output"]


@pytest.mark.parametrize("n", [256, 512])
def test_model_bounds_the_measured_peak_of_naive_attention(n):
    # The model counts the arrays that must exist together (scores, weights,
    # output); numpy's temporaries may add to that, but not a second n^2 term's
    # worth more.
    x = np.random.default_rng(1).normal(size=(n, 32))
    _, peak = peak_memory(scaled_dot_product_attention, x, x, x)
    model = attention_memory_bytes(n, n, 32, 32, bytes_per_element=8)
    assert model <= peak <= 2.5 * model


@pytest.mark.parametrize(
    "fn",
    [
        attention_flops,
        attention_flop_breakdown,
        attention_memory_bytes,
        attention_memory_breakdown,
    ],
)
@pytest.mark.parametrize("position", range(4))
@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None, "8"])
def test_bad_sizes_raise_value_error_naming_the_argument(fn, position, bad):
    args = [4, 5, 6, 7]
    args[position] = bad
    with pytest.raises(ValueError, match=ARGS[position]):
        fn(*args)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"batch": 0}, "batch"),
        ({"bytes_per_element": 0}, "bytes_per_element"),
        ({"bytes_per_element": 1.5}, "bytes_per_element"),
    ],
)
def test_bad_batch_or_element_size_raises(kwargs, name):
    with pytest.raises(ValueError, match=name):
        attention_memory_bytes(4, 4, 4, 4, **kwargs)
    if "batch" in kwargs:
        with pytest.raises(ValueError, match=name):
            attention_flops(4, 4, 4, 4, **kwargs)


def test_numpy_integers_are_accepted():
    n = np.int64(8)
    assert attention_flops(n, n, n, n) == attention_flops(8, 8, 8, 8)
    assert isinstance(attention_flops(n, n, n, n), int)
