"""Grouped-query attention, the MHA -> GQA conversion and their helpers,
against independent references.

References: a float64 numpy loop over query heads that looks up key/value head
j // g explicitly, torch's F.scaled_dot_product_attention(...,
enable_gqa=True), and the package's MultiHeadAttention (which repeats the keys
and values with repeat_kv).
"""

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnbook.experiments.decode_speed import bytes_allocated
from attnbook.gpt import GPTConfig, TinyGPT
from attnbook.gqa import (
    GroupedQueryAttention,
    group_size,
    grouped_query_attention,
    kv_head_of,
    mha_to_gqa,
    pool_kv_heads,
    with_grouped_attention,
)
from attnbook.multihead import MultiHeadAttention
from attnbook.torch_attention import attend, repeat_kv


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def numpy_gqa(q, k, v, mask=None):
    """Float64 numpy reference: one softmax per query head, key/value head j //
    g looked up by index."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    b, h, n_q, d = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    g = h // n_kv_heads
    full = (
        None
        if mask is None
        else np.broadcast_to(np.asarray(mask), (b, h, n_q, n_k))
    )
    out = np.zeros((b, h, n_q, v.shape[-1]))
    for bi in range(b):
        for j in range(h):
            s = q[bi, j] @ k[bi, j // g].T / math.sqrt(d)
            if full is not None:
                s = np.where(full[bi, j], s, -np.inf)
            for i in range(n_q):
                if np.all(np.isneginf(s[i])):
                    # fully masked row: zero output
                    continue
                w = np.exp(s[i] - s[i].max())
                out[bi, j, i] = (w / w.sum()) @ v[bi, j // g]
    return out


def randn(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=dtype)


# ---- grouped_query_attention ------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 2),
    n_kv_heads=st.integers(1, 3),
    g=st.integers(1, 3),
    n_q=st.integers(1, 5),
    n_k=st.integers(1, 6),
    d=st.integers(1, 5),
    d_v=st.integers(1, 4),
    masked=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_matches_numpy_reference_and_repeat_kv(
    b, n_kv_heads, g, n_q, n_k, d, d_v, masked, seed
):
    gen = torch.Generator().manual_seed(seed)
    h = n_kv_heads * g
    q, k, v = (
        randn(gen, b, h, n_q, d),
        randn(gen, b, n_kv_heads, n_k, d),
        randn(gen, b, n_kv_heads, n_k, d_v),
    )
    # rows may be fully masked
    mask = torch.rand(b, h, n_q, n_k, generator=gen) < 0.6 if masked else None
    out = grouped_query_attention(q, k, v, mask)
    assert out.shape == (b, h, n_q, d_v)
    np.testing.assert_allclose(
        out.numpy(), numpy_gqa(q, k, v, mask), rtol=1e-10, atol=1e-12
    )
    torch.testing.assert_close(
        out,
        attend(q, repeat_kv(k, g), repeat_kv(v, g), mask),
        rtol=1e-12,
        atol=1e-12,
    )


@pytest.mark.parametrize("h, n_kv_heads", [(4, 4), (6, 2), (8, 1), (6, 3)])
def test_matches_sdpa_enable_gqa(h, n_kv_heads):
    gen = torch.Generator().manual_seed(h * 10 + n_kv_heads)
    q, k, v = (
        randn(gen, 2, h, 5, 8),
        randn(gen, 2, n_kv_heads, 7, 8),
        randn(gen, 2, n_kv_heads, 7, 3),
    )
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(
        grouped_query_attention(q, k, v), expected, rtol=1e-10, atol=1e-12
    )
    mask = torch.rand(2, h, 5, 7, generator=gen) < 0.5
    # torch gives NaN for a fully masked row
    mask[..., 0] = True
    expected = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=True
    )
    torch.testing.assert_close(
        grouped_query_attention(q, k, v, mask),
        expected,
        rtol=1e-10,
        atol=1e-12,
    )
    expected = F.scaled_dot_product_attention(
        q, k, v, scale=0.3, enable_gqa=True
    )
    torch.testing.assert_close(
        grouped_query_attention(q, k, v, scale=0.3),
        expected,
        rtol=1e-10,
        atol=1e-12,
    )


@pytest.mark.parametrize(
    "mask_shape",
    [(5, 7), (1, 7), (2, 1, 5, 7), (1, 6, 1, 7), (6, 5, 7), (2, 6, 5, 7)],
)
def test_broadcast_masks(mask_shape):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        randn(gen, 2, 6, 5, 4),
        randn(gen, 2, 2, 7, 4),
        randn(gen, 2, 2, 7, 4),
    )
    mask = torch.rand(*mask_shape, generator=gen) < 0.5
    np.testing.assert_allclose(
        grouped_query_attention(q, k, v, mask).numpy(),
        numpy_gqa(q, k, v, mask),
        rtol=1e-10,
        atol=1e-12,
    )


def test_fully_masked_row_is_zero_and_has_zero_gradient():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        randn(gen, 1, 4, 3, 2).requires_grad_(),
        randn(gen, 1, 2, 3, 2).requires_grad_(),
        randn(gen, 1, 2, 3, 2).requires_grad_(),
    )
    mask = torch.ones(1, 4, 3, 3, dtype=torch.bool)
    mask[0, 1, 2] = False
    out = grouped_query_attention(q, k, v, mask)
    assert torch.equal(out[0, 1, 2], torch.zeros(2))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_gradients_match_repeat_kv():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (
        randn(gen, 2, 6, 4, 3),
        randn(gen, 2, 3, 5, 3),
        randn(gen, 2, 3, 5, 2),
    )
    torch.autograd.gradcheck(
        grouped_query_attention,
        (q.requires_grad_(), k.requires_grad_(), v.requires_grad_()),
    )
    grads = torch.autograd.grad(
        grouped_query_attention(q, k, v).square().sum(), (q, k, v)
    )
    expected = torch.autograd.grad(
        attend(q, repeat_kv(k, 2), repeat_kv(v, 2)).square().sum(), (q, k, v)
    )
    for got, exp in zip(grads, expected):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)


def test_low_precision_close_to_float32():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (
        randn(gen, 1, 8, 6, 16, dtype=torch.float32),
        randn(gen, 1, 2, 9, 16, dtype=torch.float32),
        randn(gen, 1, 2, 9, 16, dtype=torch.float32),
    )
    ref = grouped_query_attention(q, k, v)
    for dtype in (torch.bfloat16, torch.float16):
        out = grouped_query_attention(q.to(dtype), k.to(dtype), v.to(dtype))
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


def test_keys_and_values_are_never_repeated():
    q, k, v = (
        torch.randn(1, 16, 1, 32),
        torch.randn(1, 2, 2048, 32),
        torch.randn(1, 2, 2048, 32),
    )
    # keys and values at 16 heads
    repeated_bytes = 2 * repeat_kv(k, 8).nbytes
    _, direct = bytes_allocated(
        lambda: attend(q, repeat_kv(k, 8), repeat_kv(v, 8))
    )
    _, grouped = bytes_allocated(grouped_query_attention, q, k, v)
    assert direct >= repeated_bytes
    # less than one copy of the (unrepeated) keys
    assert grouped < k.nbytes


@pytest.mark.parametrize(
    "shapes, match",
    [
        (
            ((1, 4, 3, 2), (1, 3, 3, 2), (1, 3, 3, 2)),
            "n_heads=4 is not divisible by n_kv_heads=3 \\(the heads of q",
        ),
        (((1, 4, 3, 2), (1, 2, 3, 2), (1, 2, 4, 2)), "k and v must agree"),
        (((1, 4, 3, 2), (1, 2, 3, 5), (1, 2, 3, 2)), "batch and d_k"),
        (((2, 4, 3, 2), (1, 2, 3, 2), (1, 2, 3, 2)), "batch and d_k"),
        (((4, 3, 2), (1, 2, 3, 2), (1, 2, 3, 2)), "4 dimensions"),
    ],
)
def test_bad_shapes_raise(shapes, match):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        grouped_query_attention(q, k, v)


def test_bad_masks_raise():
    q, k, v = (
        torch.zeros(1, 4, 3, 2),
        torch.zeros(1, 2, 5, 2),
        torch.zeros(1, 2, 5, 2),
    )
    with pytest.raises(ValueError, match="does not broadcast"):
        grouped_query_attention(q, k, v, torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        # kv heads, not q heads
        grouped_query_attention(
            q, k, v, torch.ones(1, 2, 3, 5, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match="boolean"):
        grouped_query_attention(q, k, v, torch.ones(3, 5))


def test_group_helpers():
    assert kv_head_of(8, 2) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert kv_head_of(4, 4) == [0, 1, 2, 3] and kv_head_of(3, 1) == [0, 0, 0]
    assert group_size(71, 1) == 71
    with pytest.raises(ValueError, match="not divisible"):
        group_size(71, 8)
    with pytest.raises(ValueError, match="positive integer"):
        kv_head_of(4, 0)


# ---- the layer and the model ------------------------------------------------


def make_layer(
    d_model=12, n_heads=6, n_kv_heads=2, bias=True, seed=0, use_sdpa=False
):
    torch.manual_seed(seed)
    layer = MultiHeadAttention(
        d_model, n_heads, n_kv_heads, bias=bias, use_sdpa=use_sdpa
    ).double()
    with torch.no_grad():
        for lin in (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj):
            lin.bias.normal_()
    return layer


@pytest.mark.parametrize("n_kv_heads", [6, 3, 2, 1])
def test_grouped_layer_equals_multihead_layer(n_kv_heads):
    gen = torch.Generator().manual_seed(n_kv_heads)
    layer = make_layer(n_kv_heads=n_kv_heads)
    grouped = with_grouped_attention(layer)
    assert (
        type(grouped) is GroupedQueryAttention
        and type(layer) is MultiHeadAttention
    )
    x, ctx = randn(gen, 2, 5, 12), randn(gen, 2, 7, 12)
    mask = torch.rand(2, 6, 5, 7, generator=gen) < 0.5
    for kwargs in (
        {},
        {"is_causal": True},
        {"context": ctx},
        {"context": ctx, "mask": mask},
    ):
        torch.testing.assert_close(
            grouped(x, **kwargs), layer(x, **kwargs), rtol=1e-10, atol=1e-12
        )


def test_grouped_model_equals_model_with_and_without_cache():
    torch.manual_seed(0)
    model = (
        TinyGPT(
            GPTConfig(
                vocab_size=11,
                context_length=16,
                n_layers=2,
                n_heads=4,
                n_kv_heads=2,
                d_model=16,
            )
        )
        .double()
        .eval()
    )
    grouped = with_grouped_attention(model)
    ids = torch.randint(11, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(
            grouped(ids), model(ids), rtol=1e-10, atol=1e-12
        )
        cache, steps = grouped.new_kv_cache(2), []
        steps.append(grouped(ids[:, :5], cache))
        for t in range(5, 9):
            steps.append(grouped(ids[:, t : t + 1], cache, start_pos=t))
        torch.testing.assert_close(
            torch.cat(steps, dim=1), model(ids), rtol=1e-10, atol=1e-12
        )
        assert cache[0].keys.shape[1] == 2


# ---- pooling and conversion -------------------------------------------------


@pytest.mark.parametrize("method", ["mean", "first"])
@pytest.mark.parametrize(
    "h, n_kv_heads, trailing",
    [(4, 2, (5,)), (6, 3, (2,)), (8, 1, (3,)), (4, 4, (2,)), (6, 2, ())],
)
def test_pool_kv_heads_against_loop(method, h, n_kv_heads, trailing):
    gen = torch.Generator().manual_seed(h + n_kv_heads)
    d_head, g = 3, h // n_kv_heads
    w = randn(gen, h * d_head, *trailing)
    expected = []
    for i in range(n_kv_heads):
        members = [
            w[(i * g + m) * d_head : (i * g + m + 1) * d_head]
            for m in range(g)
        ]
        expected.append(sum(members) / g if method == "mean" else members[0])
    torch.testing.assert_close(
        pool_kv_heads(w, h, n_kv_heads, method), torch.cat(expected)
    )


def test_pool_kv_heads_errors():
    w = torch.zeros(12, 3)
    with pytest.raises(ValueError, match="method"):
        pool_kv_heads(w, 4, 2, "median")
    with pytest.raises(ValueError, match="not a multiple"):
        pool_kv_heads(torch.zeros(10, 3), 4, 2)
    with pytest.raises(ValueError, match="not divisible"):
        pool_kv_heads(w, 4, 3)


@pytest.mark.parametrize("n_kv_heads", [3, 2, 1])
def test_converted_keys_and_values_are_group_means(n_kv_heads):
    gen = torch.Generator().manual_seed(5)
    layer = make_layer(n_kv_heads=None)
    converted = mha_to_gqa(layer, n_kv_heads)
    # the input is untouched
    assert converted.n_kv_heads == n_kv_heads and layer.n_kv_heads == 6
    x = randn(gen, 2, 4, 12)
    g = 6 // n_kv_heads
    for name in ("k_proj", "v_proj"):
        # (b, n, heads, d_head)
        old = getattr(layer, name)(x).view(2, 4, 6, 2)
        new = getattr(converted, name)(x).view(2, 4, n_kv_heads, 2)
        torch.testing.assert_close(
            new, old.view(2, 4, n_kv_heads, g, 2).mean(3)
        )
    assert torch.equal(converted.q_proj.weight, layer.q_proj.weight)
    assert converted(x).shape == (2, 4, 12)


def test_conversion_is_exact_when_the_heads_of_each_group_agree():
    """If the heads of every contiguous group already share keys and values,
    pooling loses nothing; grouping the wrong heads (strided) would change the
    outputs."""
    gen = torch.Generator().manual_seed(6)
    layer = make_layer(n_kv_heads=None)
    with torch.no_grad():
        for lin in (layer.k_proj, layer.v_proj):
            heads_w, heads_b = (
                lin.weight.view(3, 2, 2, 12),
                lin.bias.view(3, 2, 2),
            )
            heads_w[:, 1] = heads_w[:, 0]
            heads_b[:, 1] = heads_b[:, 0]
    x = randn(gen, 2, 5, 12)
    for method in ("mean", "first"):
        torch.testing.assert_close(
            mha_to_gqa(layer, 3, method)(x, is_causal=True),
            layer(x, is_causal=True),
            rtol=1e-10,
            atol=1e-12,
        )
    # Pooled in the wrong order, heads i, i + n_kv_heads (reshape to (g,
    # n_kv_heads, ...)): the outputs change.
    strided = mha_to_gqa(layer, 3, "mean")
    with torch.no_grad():
        for lin, new in (
            (layer.k_proj, strided.k_proj),
            (layer.v_proj, strided.v_proj),
        ):
            new.weight.copy_(
                lin.weight.view(2, 3, 2, 12).mean(0).reshape(6, 12)
            )
            new.bias.copy_(lin.bias.view(2, 3, 2).mean(0).reshape(6))
        assert (
            strided(x, is_causal=True) - layer(x, is_causal=True)
        ).abs().max() > 1e-3


def test_convert_tiny_gpt():
    torch.manual_seed(0)
    model = (
        TinyGPT(
            GPTConfig(
                vocab_size=7,
                context_length=8,
                n_layers=2,
                n_heads=4,
                d_model=8,
            )
        )
        .double()
        .eval()
    )
    same = mha_to_gqa(model, 4)
    ids = torch.randint(7, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(
            same(ids), model(ids), rtol=1e-12, atol=1e-12
        )
    mqa = mha_to_gqa(model, 1, "first")
    assert (
        mqa.config == dataclasses.replace(model.config, n_kv_heads=1)
        and model.config.n_kv_heads == model.config.n_heads
    )
    assert all(block.attn.k_proj.out_features == 2 for block in mqa.blocks)
    assert mqa.new_kv_cache(1)[0].keys.shape == (1, 1, 8, 2)
    with torch.no_grad():
        out = mqa.generate(ids[:, :2], 4, temperature=0)
    assert out.shape == (1, 6)


def test_conversion_errors():
    with pytest.raises(ValueError, match="already has 2"):
        mha_to_gqa(make_layer(n_kv_heads=2), 1)
    with pytest.raises(ValueError, match="not divisible"):
        mha_to_gqa(make_layer(n_kv_heads=None), 4)
    with pytest.raises(ValueError, match="no MultiHeadAttention"):
        mha_to_gqa(torch.nn.Linear(2, 2), 1)
    with pytest.raises(ValueError, match="positive integer"):
        mha_to_gqa(make_layer(n_kv_heads=None), 0)


def test_the_query_reshape_is_a_view_exactly_when_the_comment_says():
    """grouped_query_attention's comment: reshaping q to (b, n_kv_heads, g *
    n_q, d) relabels a contiguous q, and a q transposed from (b, n_q, h, d)
    when n_q == 1; it copies a transposed q with n_q > 1."""
    b, h, n_kv_heads, d = 2, 8, 2, 4
    for n_q, layout, is_view in (
        (5, "contiguous", True),
        (1, "transposed", True),
        (5, "transposed", False),
    ):
        if layout == "contiguous":
            q = torch.randn(b, h, n_q, d)
        else:
            # as a projection gives it
            q = torch.randn(b, n_q, h, d).transpose(1, 2)
        rows = q.reshape(b, n_kv_heads, (h // n_kv_heads) * n_q, d)
        assert (
            rows.data_ptr() == q.data_ptr() and rows._base is not None
        ) == is_view, (n_q, layout)
        # the same numbers either way
        assert torch.equal(rows, q.contiguous().view(b, n_kv_heads, -1, d))
