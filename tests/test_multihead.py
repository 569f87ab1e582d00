"""MultiHeadAttention, attend and repeat_kv against torch's own
implementations.

References: torch.nn.MultiheadAttention with copied weights (its attn_mask uses
the opposite convention, True = NOT allowed), F.scaled_dot_product_attention
(with enable_gqa for grouped-query attention), repeat_interleave, and the
package's float64 numpy attention.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnbook
from attnbook.multihead import MultiHeadAttention
from attnbook.torch_attention import attend, repeat_kv


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def copy_into_torch_mha(
    ours: MultiHeadAttention,
) -> torch.nn.MultiheadAttention:
    """A torch MultiheadAttention with our weights (it stacks q, k, v in
    in_proj_weight)."""
    bias = ours.q_proj.bias is not None
    ref = torch.nn.MultiheadAttention(
        ours.d_model,
        ours.n_heads,
        bias=bias,
        batch_first=True,
        dtype=torch.float64,
    )
    with torch.no_grad():
        ref.in_proj_weight.copy_(
            torch.cat(
                [ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]
            )
        )
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        if bias:
            ref.in_proj_bias.copy_(
                torch.cat(
                    [ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]
                )
            )
            ref.out_proj.bias.copy_(ours.out_proj.bias)
    return ref


def random_mask(gen, shape, p=0.6):
    """Random boolean mask (True = may attend) with at least one visible key
    per query row."""
    mask = torch.rand(shape, generator=gen) < p
    mask[..., 0] = True
    return mask


def make_mha(
    d_model, n_heads, n_kv_heads=None, bias=False, use_sdpa=False, seed=0
):
    torch.manual_seed(seed)
    mha = MultiHeadAttention(
        d_model, n_heads, n_kv_heads, bias=bias, use_sdpa=use_sdpa
    ).double()
    # nn.Linear starts with random biases already; make them large enough to
    # matter
    if bias:
        with torch.no_grad():
            for lin in (mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj):
                lin.bias.normal_()
    return mha


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("use_sdpa", [False, True])
def test_matches_torch_multihead_attention(bias, cross, use_sdpa):
    gen = torch.Generator().manual_seed(7)
    batch, n, m, d_model, n_heads = 3, 5, (7 if cross else 5), 12, 3
    mha = make_mha(d_model, n_heads, bias=bias, use_sdpa=use_sdpa)
    ref = copy_into_torch_mha(mha)
    x = torch.randn(batch, n, d_model, generator=gen, dtype=torch.float64)
    context = (
        torch.randn(batch, m, d_model, generator=gen, dtype=torch.float64)
        if cross
        else None
    )
    kv = x if context is None else context

    expected, _ = ref(x, kv, kv, need_weights=False)
    torch.testing.assert_close(
        mha(x, context=context), expected, rtol=1e-10, atol=1e-12
    )

    # one mask for every batch and head
    mask = random_mask(gen, (n, m))
    # torch: True = NOT allowed
    expected, _ = ref(x, kv, kv, attn_mask=~mask, need_weights=False)
    torch.testing.assert_close(
        mha(x, context=context, mask=mask), expected, rtol=1e-10, atol=1e-12
    )

    # padding: a key hidden from all queries
    keep = random_mask(gen, (batch, m))
    expected, _ = ref(x, kv, kv, key_padding_mask=~keep, need_weights=False)
    torch.testing.assert_close(
        mha(x, context=context, mask=keep[:, None, None, :]),
        expected,
        rtol=1e-10,
        atol=1e-12,
    )


def test_per_head_masks_match_torch_3d_attn_mask():
    gen = torch.Generator().manual_seed(3)
    batch, n, d_model, n_heads = 2, 6, 8, 4
    mha = make_mha(d_model, n_heads, bias=True)
    ref = copy_into_torch_mha(mha)
    x = torch.randn(batch, n, d_model, generator=gen, dtype=torch.float64)
    mask = random_mask(gen, (batch, n_heads, n, n))
    # torch wants (batch * heads, n_q, n_k), batch-major
    expected, _ = ref(
        x,
        x,
        x,
        attn_mask=~mask.reshape(batch * n_heads, n, n),
        need_weights=False,
    )
    torch.testing.assert_close(
        mha(x, mask=mask), expected, rtol=1e-10, atol=1e-12
    )


def project_heads(mha, x, context=None):
    """Queries, keys and values per head, computed from the weights directly (x
    @ W^T)."""
    source = x if context is None else context
    b, n, m = x.shape[0], x.shape[1], source.shape[1]
    q = (
        (x @ mha.q_proj.weight.T)
        .reshape(b, n, mha.n_heads, -1)
        .permute(0, 2, 1, 3)
    )
    k = (
        (source @ mha.k_proj.weight.T)
        .reshape(b, m, mha.n_kv_heads, -1)
        .permute(0, 2, 1, 3)
    )
    v = (
        (source @ mha.v_proj.weight.T)
        .reshape(b, m, mha.n_kv_heads, -1)
        .permute(0, 2, 1, 3)
    )
    return q, k, v


@pytest.mark.parametrize("n_kv_heads", [1, 2, 3, 6])  # MQA, GQA, GQA, MHA
@pytest.mark.parametrize("use_sdpa", [False, True])
def test_gqa_matches_sdpa_enable_gqa(n_kv_heads, use_sdpa):
    gen = torch.Generator().manual_seed(n_kv_heads)
    batch, n, d_model, n_heads = 2, 9, 24, 6
    mha = make_mha(d_model, n_heads, n_kv_heads, use_sdpa=use_sdpa)
    assert mha.k_proj.weight.shape == (n_kv_heads * 4, d_model)
    x = torch.randn(batch, n, d_model, generator=gen, dtype=torch.float64)
    mask = random_mask(gen, (batch, 1, n, n))
    q, k, v = project_heads(mha, x)
    # (b, h, n, d_head)
    heads = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=True
    )
    expected = (
        heads.transpose(1, 2).reshape(batch, n, d_model)
        @ mha.out_proj.weight.T
    )
    torch.testing.assert_close(
        mha(x, mask=mask), expected, rtol=1e-10, atol=1e-12
    )

    heads = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    )
    expected = (
        heads.transpose(1, 2).reshape(batch, n, d_model)
        @ mha.out_proj.weight.T
    )
    torch.testing.assert_close(
        mha(x, is_causal=True), expected, rtol=1e-10, atol=1e-12
    )


def test_gqa_heads_are_grouped_contiguously():
    """Query heads 0, 1 share kv head 0, heads 2, 3 share kv head 1: zeroing kv
    head 1's value weights must silence exactly query heads 2 and 3."""
    mha = make_mha(16, 4, n_kv_heads=2)
    with torch.no_grad():
        # the rows of kv head 1
        mha.v_proj.weight[4:8] = 0
        mha.out_proj.weight.copy_(torch.eye(16, dtype=torch.float64))
    # (1, 5, 16) = 4 heads of 4 features
    out = mha(torch.randn(1, 5, 16, dtype=torch.float64))
    per_head = out.reshape(1, 5, 4, 4).abs().sum(dim=(0, 1, 3))
    assert (per_head[:2] > 0).all() and (per_head[2:] == 0).all()


@pytest.mark.parametrize("n_q,n_k", [(1, 1), (1, 6), (4, 6), (6, 6)])
def test_is_causal_places_queries_last(n_q, n_k):
    gen = torch.Generator().manual_seed(n_q * 10 + n_k)
    mha = make_mha(8, 2, bias=True)
    x = torch.randn(2, n_q, 8, generator=gen, dtype=torch.float64)
    context = torch.randn(2, n_k, 8, generator=gen, dtype=torch.float64)
    # query i sits at absolute position i + n_k - n_q and sees keys j <= that
    # position
    allowed = torch.tensor(
        [[j <= i + n_k - n_q for j in range(n_k)] for i in range(n_q)]
    )
    torch.testing.assert_close(
        mha(x, context=context, is_causal=True),
        mha(x, context=context, mask=allowed),
    )
    if n_q == n_k:  # then it is also torch's (upper-left aligned) is_causal
        q, k, v = project_heads(mha, x, context)
        q, k, v = (
            q + mha.q_proj.bias.view(1, 2, 1, 4),
            k + mha.k_proj.bias.view(1, 2, 1, 4),
            v + mha.v_proj.bias.view(1, 2, 1, 4),
        )
        heads = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        expected = mha.out_proj(heads.transpose(1, 2).reshape(2, n_q, 8))
        torch.testing.assert_close(
            mha(x, context=context, is_causal=True), expected
        )


def test_is_causal_combines_with_a_mask():
    gen = torch.Generator().manual_seed(11)
    mha = make_mha(8, 2)
    x = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64)
    mask = random_mask(gen, (2, 1, 5, 5))
    both = mask & torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(
        mha(x, mask=mask, is_causal=True), mha(x, mask=both)
    )


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 7),
    st.integers(1, 7),
    st.integers(1, 5),
    st.integers(1, 5),
    st.integers(0, 2**31 - 1),
)
def test_attend_matches_numpy_attention(b, h, n_q, n_k, d_k, d_v, seed):
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(b, h, n_q, d_k)), rng.normal(size=(b, h, n_k, d_k))
    v = rng.normal(size=(b, h, n_k, d_v))
    # fully masked rows included
    mask = rng.random((b, 1, n_q, n_k)) < 0.5
    expected, _ = attnbook.scaled_dot_product_attention(q, k, v, mask=mask)
    out = attend(
        *map(torch.from_numpy, (q, k, v)), mask=torch.from_numpy(mask)
    )
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-10, atol=1e-12)


def test_fully_masked_rows_give_zero_output_and_finite_gradients():
    for use_sdpa in (False, True):
        mha = make_mha(8, 2, bias=True, use_sdpa=use_sdpa)
        x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
        mask = torch.ones(2, 1, 4, 4, dtype=torch.bool).tril()
        # batch 0, query 2 sees nothing
        mask[0, 0, 2] = False
        out = mha(x, mask=mask)
        # nothing attended -> zero heads -> only the output bias remains
        torch.testing.assert_close(
            out[0, 2], mha.out_proj.bias, rtol=0, atol=0
        )
        out.sum().backward()
        assert torch.isfinite(x.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in mha.parameters())


def test_attend_gradcheck_with_masked_row():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(
            2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True
        )
        for _ in range(3)
    )
    mask = torch.tensor(
        [[True, False, True], [False, False, False], [True, True, True]]
    )
    assert torch.autograd.gradcheck(
        lambda q, k, v: attend(q, k, v, mask=mask, scale=0.7), (q, k, v)
    )


def test_gradients_reach_every_projection():
    mha = make_mha(12, 4, n_kv_heads=2, bias=True)
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    mha(x, is_causal=True).pow(2).sum().backward()
    for name, p in mha.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


@pytest.mark.parametrize("n_rep", [1, 2, 3])
def test_repeat_kv_matches_repeat_interleave(n_rep):
    x = torch.randn(2, 3, 5, 4)
    torch.testing.assert_close(
        repeat_kv(x, n_rep), x.repeat_interleave(n_rep, dim=1), rtol=0, atol=0
    )


def test_repeat_kv_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\(2, 3, 4\)"):
        repeat_kv(torch.zeros(2, 3, 4), 2)
    with pytest.raises(ValueError, match="n_rep"):
        repeat_kv(torch.zeros(1, 2, 3, 4), 0)


def test_float32_default_and_output_shape():
    mha = MultiHeadAttention(16, 4)
    assert isinstance(mha.q_proj, torch.nn.Linear) and mha.q_proj.bias is None
    # a single token
    out = mha(torch.randn(3, 1, 16))
    assert out.shape == (3, 1, 16) and out.dtype == torch.float32


@pytest.mark.parametrize(
    "args,match",
    [
        ((10, 4), r"d_model=10 is not divisible by n_heads=4"),
        ((12, 4, 3), r"n_heads=4 is not divisible by n_kv_heads=3"),
        ((12, 0), r"n_heads"),
        ((12, 4, 0), r"n_kv_heads"),
    ],
)
def test_constructor_errors(args, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(*args)


def test_forward_errors_name_the_shapes():
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"\(5, 8\)"):
        # no batch dimension
        mha(torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"\(2, 5, 6\)"):
        mha(torch.randn(2, 5, 6))  # wrong width
    with pytest.raises(ValueError, match=r"context.*\(2, 7, 6\)"):
        mha(x, context=torch.randn(2, 7, 6))
    with pytest.raises(ValueError, match=r"context.*\(3, 7, 8\)"):
        # batch mismatch
        mha(x, context=torch.randn(3, 7, 8))
    with pytest.raises(ValueError, match=r"\(5, 6\).*\(2, 2, 5, 5\)"):
        # does not broadcast
        mha(x, mask=torch.ones(5, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(3, 1, 5, 5\)"):
        # would enlarge the batch
        mha(x, mask=torch.ones(3, 1, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="boolean"):
        # an additive float mask
        mha(x, mask=torch.ones(5, 5))
    with pytest.raises(ValueError, match="n_q <= n_k"):
        # more queries than keys
        mha(x, context=torch.randn(2, 3, 8), is_causal=True)


def test_attend_errors():
    with pytest.raises(ValueError, match="d_k"):
        attend(torch.zeros(2, 3), torch.zeros(4, 5), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="n_k"):
        attend(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(5, 3))


def test_accepts_the_package_numpy_masks():
    mha = make_mha(8, 2)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    torch.testing.assert_close(
        mha(x, mask=attnbook.causal_mask(6)),
        mha(x, is_causal=True),
        rtol=0,
        atol=0,
    )
    window = attnbook.sliding_window_mask(6, 2)
    torch.testing.assert_close(
        mha(x, mask=window),
        mha(x, mask=torch.from_numpy(window)),
        rtol=0,
        atol=0,
    )
