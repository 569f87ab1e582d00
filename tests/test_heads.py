"""attnbook.heads against independent references.

split/merge against torch's view/transpose and an explicit index formula; the
flop count against torch.utils.flop_counter.FlopCounterMode; the recomputed
attention maps against torch.nn.MultiheadAttention's own per-head weights and
against each layer's real output; the head statistics against loops and
hand-made matrices; ablation against hooks that watch the output projection's
input.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from attnbook import heads
from attnbook.gpt import GPTConfig, TinyGPT
from attnbook.multihead import MultiHeadAttention


# --- split and merge ---------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(1, 3), max_size=2),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(0, 2**31 - 1),
)
def test_split_and_merge_match_torch_view_transpose(lead, n, h, d_head, seed):
    x = np.random.default_rng(seed).normal(size=(*lead, n, h * d_head))
    t = torch.from_numpy(x)
    expected = t.view(*lead, n, h, d_head).transpose(-3, -2)
    got = heads.split_heads(x, h)
    assert got.shape == (*lead, h, n, d_head)
    np.testing.assert_array_equal(got, expected.numpy())
    # exact round trip
    np.testing.assert_array_equal(heads.merge_heads(got), x)
    np.testing.assert_array_equal(
        heads.merge_heads(expected.numpy()),
        expected.transpose(-3, -2).reshape(*lead, n, h * d_head).numpy(),
    )


def test_split_heads_puts_each_feature_where_the_formula_says():
    b, n, h, d_head = 2, 3, 4, 5
    x = np.arange(b * n * h * d_head).reshape(b, n, h * d_head)
    out = heads.split_heads(x, h)
    for bi in range(b):
        for r in range(h):
            for i in range(n):
                for f in range(d_head):
                    assert out[bi, r, i, f] == x[bi, i, r * d_head + f]


def test_split_heads_with_one_head_adds_an_axis_only():
    x = np.random.default_rng(0).normal(size=(2, 5, 6))
    np.testing.assert_array_equal(heads.split_heads(x, 1), x[:, None])


def test_split_and_merge_errors_name_the_shapes():
    with pytest.raises(
        ValueError, match=r"d_model=10.*\(2, 3, 10\).*n_heads=4"
    ):
        heads.split_heads(np.zeros((2, 3, 10)), 4)
    with pytest.raises(ValueError, match=r"\(5,\)"):
        heads.split_heads(np.zeros(5), 1)
    with pytest.raises(ValueError, match="n_heads"):
        heads.split_heads(np.zeros((2, 4)), 0)
    with pytest.raises(ValueError, match=r"\(3, 4\)"):
        heads.merge_heads(np.zeros((3, 4)))


# --- flops -------------------------------------------------------------------


@pytest.mark.parametrize("n_heads", [1, 2, 4, 8])
@pytest.mark.parametrize("n_q,n_k", [(16, 16), (7, 19), (1, 5)])
def test_matmul_flops_match_torch_flop_counter(n_heads, n_q, n_k):
    batch, d_model = 3, 32
    # attend(): matmuls the counter sees
    mha = MultiHeadAttention(d_model, n_heads)
    x, context = (
        torch.randn(batch, n_q, d_model),
        torch.randn(batch, n_k, d_model),
    )
    with FlopCounterMode(display=False) as counter:
        mha(x, context=context)
    assert counter.get_total_flops() == heads.multihead_matmul_flops(
        n_q, d_model, n_heads, n_k, batch
    )


def test_flops_do_not_depend_on_the_number_of_heads_except_elementwise():
    n, d = 128, 64
    counts = {
        h: heads.multihead_flop_breakdown(n, d, h)
        for h in (1, 2, 4, 8, 16, 64)
    }
    for h, c in counts.items():
        assert (
            heads.multihead_matmul_flops(n, d, h)
            == 8 * n * d * d + 4 * n * n * d
        )
        assert c["scores"] == c["weighted_sum"] == 2 * n * n * d
        assert (
            c["q_proj"]
            == c["k_proj"]
            == c["v_proj"]
            == c["out_proj"]
            == 2 * n * d * d
        )
        assert (
            c["softmax"] == h * counts[1]["softmax"]
            and c["scale"] == h * n * n
        )


def test_cross_attention_flops_formula():
    c = heads.multihead_flop_breakdown(3, 8, 2, n_k=5, batch=2)
    assert c["q_proj"] == c["out_proj"] == 2 * 2 * 3 * 64
    assert c["k_proj"] == c["v_proj"] == 2 * 2 * 5 * 64
    assert c["scores"] == c["weighted_sum"] == 2 * 2 * 3 * 5 * 8


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(n_q=4, d_model=10, n_heads=4),
            r"d_model=10 is not divisible by n_heads=4",
        ),
        (dict(n_q=0, d_model=8, n_heads=2), "n_q"),
        (dict(n_q=4, d_model=8, n_heads=2, n_k=0), "n_k"),
        (dict(n_q=4, d_model=8, n_heads=2, batch=-1), "batch"),
    ],
)
def test_flop_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        heads.multihead_flop_breakdown(**kwargs)


# --- attention maps of a GPT -------------------------------------------------


def small_gpt(n_kv_heads=None, use_sdpa=True, seed=0):
    torch.manual_seed(seed)
    model = TinyGPT(
        GPTConfig(
            vocab_size=11,
            context_length=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=n_kv_heads,
            d_model=16,
        ),
        use_sdpa=use_sdpa,
    ).eval()
    # larger weights than GPT-2's init: peaked, varied maps
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8)
    return model


def layer_io(model, ids):
    """Each layer's attention input and output, recorded by hooks."""
    seen = []
    hooks = [
        b.attn.register_forward_hook(
            lambda m, args, out: seen.append((args[0], out))
        )
        for b in model.blocks
    ]
    with torch.no_grad():
        model(ids)
    for hk in hooks:
        hk.remove()
    return seen


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("use_sdpa", [True, False])
def test_attention_maps_reproduce_each_layers_output(n_kv_heads, use_sdpa):
    model = small_gpt(n_kv_heads, use_sdpa)
    ids = torch.randint(
        0, 11, (3, 9), generator=torch.Generator().manual_seed(1)
    )
    maps = heads.attention_maps(model, ids)
    assert maps.shape == (2, 3, 4, 9, 9)
    torch.testing.assert_close(maps.sum(-1), torch.ones(2, 3, 4, 9))
    assert (maps.triu(1) == 0).all()  # causal
    for w, block, (x, out) in zip(maps, model.blocks, layer_io(model, ids)):
        attn = block.attn
        v = (
            attn.v_proj(x)
            .view(3, 9, attn.n_kv_heads, attn.d_head)
            .transpose(1, 2)
        )
        # (b, h, n, d_head)
        v = v.repeat_interleave(attn.n_rep, dim=1)
        concat = (w @ v).transpose(1, 2).reshape(3, 9, -1)
        torch.testing.assert_close(
            attn.out_proj(concat), out, rtol=1e-4, atol=1e-5
        )


def test_attention_maps_match_torch_multihead_attention_weights():
    model = small_gpt()
    ids = torch.randint(
        0, 11, (2, 7), generator=torch.Generator().manual_seed(2)
    )
    maps = heads.attention_maps(model, ids)
    for l, (block, (x, _)) in enumerate(
        zip(model.blocks, layer_io(model, ids))
    ):
        ref = torch.nn.MultiheadAttention(16, 4, bias=False, batch_first=True)
        with torch.no_grad():
            ref.in_proj_weight.copy_(
                torch.cat(
                    [
                        block.attn.q_proj.weight,
                        block.attn.k_proj.weight,
                        block.attn.v_proj.weight,
                    ]
                )
            )
            ref.out_proj.weight.copy_(block.attn.out_proj.weight)
        # torch: True = NOT allowed
        future = torch.ones(7, 7, dtype=torch.bool).triu(1)
        _, w = ref(
            x,
            x,
            x,
            attn_mask=future,
            need_weights=True,
            average_attn_weights=False,
        )
        torch.testing.assert_close(maps[l], w, rtol=1e-5, atol=1e-6)


def test_attention_maps_restore_the_layers_and_check_ids():
    model = small_gpt()
    heads.attention_maps(model, torch.zeros(1, 4, dtype=torch.long))
    assert all(
        not b.attn.keep_weights and b.attn.weights is None
        for b in model.blocks
    )
    with pytest.raises(ValueError, match=r"\(4,\)"):
        heads.attention_maps(model, torch.zeros(4, dtype=torch.long))


# --- statistics --------------------------------------------------------------


def uniform_causal(n):
    return np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]


def test_statistics_of_hand_made_heads():
    n = 6
    shift = np.eye(n, k=-1)
    # query 0 can only see itself
    shift[0, 0] = 1
    first = np.zeros((n, n))
    first[:, 0] = 1
    w = np.stack([np.eye(n), shift, first, uniform_causal(n)])
    s = heads.head_statistics(w)
    np.testing.assert_allclose(
        s["self"], [1, 1 / n, 1 / n, np.mean(1 / np.arange(1, n + 1))]
    )
    np.testing.assert_allclose(
        s["previous"], [0, 1, 1 / (n - 1), np.mean(1 / np.arange(2, n + 1))]
    )
    np.testing.assert_allclose(
        s["first"], [0, 1 / (n - 1), 1, np.mean(1 / np.arange(2, n + 1))]
    )
    np.testing.assert_allclose(
        s["distance"],
        [0, (n - 1) / n, np.mean(np.arange(n)), np.mean(np.arange(n) / 2)],
    )
    np.testing.assert_allclose(s["entropy"], [0, 0, 0, 1], atol=1e-12)


def test_statistics_against_loops_on_random_weights():
    rng = np.random.default_rng(3)
    scores = rng.normal(size=(2, 3, 7, 7)) * 2
    scores = np.where(np.tril(np.ones((7, 7), bool)), scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    s = heads.head_statistics(torch.from_numpy(w))
    assert all(v.shape == (2, 3) for v in s.values())
    for a in range(2):
        for b in range(3):
            rows = w[a, b]
            ent = [
                -sum(p * np.log(p) for p in rows[i, : i + 1] if p > 0)
                / np.log(i + 1)
                for i in range(1, 7)
            ]
            dist = [
                sum(rows[i, j] * (i - j) for j in range(7)) for i in range(7)
            ]
            assert np.isclose(s["entropy"][a, b], np.mean(ent))
            assert np.isclose(s["distance"][a, b], np.mean(dist))
            assert np.isclose(
                s["previous"][a, b],
                np.mean([rows[i, i - 1] for i in range(1, 7)]),
            )


def test_statistics_reject_non_square_weights():
    with pytest.raises(ValueError, match=r"\(3, 4\)"):
        heads.head_statistics(np.zeros((3, 4)))


def test_weight_on_against_a_loop_and_skips_minus_one():
    rng = np.random.default_rng(4)
    w = rng.random((2, 3, 5, 5))
    keys = np.array([-1, 0, 0, 2, 3])
    got = heads.weight_on(w, keys)
    expected = np.array(
        [
            [
                np.mean([w[a, b, i, keys[i]] for i in range(1, 5)])
                for b in range(3)
            ]
            for a in range(2)
        ]
    )
    np.testing.assert_allclose(got, expected)
    # (2, 1, 5)
    per_batch = np.array([[1, 0, 1, 2, 3], [-1, -1, -1, -1, -1]])[:, None, :]
    got = heads.weight_on(w, per_batch)
    np.testing.assert_allclose(
        got[0],
        np.mean([w[0, :, i, per_batch[0, 0, i]] for i in range(5)], axis=0),
    )
    # nothing chosen
    np.testing.assert_array_equal(got[1], 0)
    np.testing.assert_allclose(
        heads.weight_on(w, np.arange(5) - 1),
        heads.head_statistics(w)["previous"],
    )


def test_weight_on_errors():
    w = np.ones((2, 4, 4))
    with pytest.raises(ValueError, match="integer"):
        heads.weight_on(w, np.zeros(4))
    with pytest.raises(ValueError, match=r"\(3,\).*\(2, 4\)"):
        heads.weight_on(w, np.zeros(3, int))
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        heads.weight_on(w, np.array([0, 1, 2, 4]))


# --- ablation ----------------------------------------------------------------


def out_proj_inputs(model, ids):
    seen = []
    hooks = [
        b.attn.out_proj.register_forward_hook(
            lambda m, args, out: seen.append(args[0])
        )
        for b in model.blocks
    ]
    with torch.no_grad():
        logits = model(ids)
    for hk in hooks:
        hk.remove()
    return seen, logits


def test_ablate_heads_zeroes_exactly_the_chosen_columns_and_cleans_up():
    model = small_gpt()
    ids = torch.randint(
        0, 11, (2, 8), generator=torch.Generator().manual_seed(5)
    )
    (clean0, _), clean_logits = out_proj_inputs(model, ids)
    with heads.ablate_heads(model, [(0, 1), (0, 3)]):
        (abl0, abl1), abl_logits = out_proj_inputs(model, ids)
    # the hooks that watch out_proj run after the ablation hook, so they see
    # its result
    assert (abl0[..., 4:8] == 0).all() and (abl0[..., 12:16] == 0).all()
    torch.testing.assert_close(abl0[..., :4], clean0[..., :4], rtol=0, atol=0)
    torch.testing.assert_close(
        abl0[..., 8:12], clean0[..., 8:12], rtol=0, atol=0
    )
    assert not torch.allclose(abl_logits, clean_logits)
    _, again = out_proj_inputs(model, ids)
    # hooks removed
    torch.testing.assert_close(again, clean_logits, rtol=0, atol=0)


def test_ablate_heads_mean_mode_keeps_only_the_average():
    model = small_gpt()
    ids = torch.randint(
        0, 11, (3, 6), generator=torch.Generator().manual_seed(6)
    )
    (clean0, _), _ = out_proj_inputs(model, ids)
    with heads.ablate_heads(model, [(0, 2)], mode="mean"):
        (abl0, _), _ = out_proj_inputs(model, ids)
    expected = clean0[..., 8:12].mean(dim=(0, 1)).expand(3, 6, 4)
    torch.testing.assert_close(abl0[..., 8:12], expected)
    torch.testing.assert_close(abl0[..., :8], clean0[..., :8], rtol=0, atol=0)


def test_ablate_heads_mean_of_a_reference_input():
    model = small_gpt()
    ids = torch.randint(
        0, 11, (3, 6), generator=torch.Generator().manual_seed(6)
    )
    other = torch.randint(
        0, 11, (2, 9), generator=torch.Generator().manual_seed(7)
    )
    (clean0, _), clean_logits = out_proj_inputs(model, ids)
    (other0, _), _ = out_proj_inputs(model, other)
    with heads.ablate_heads(model, [(0, 2)], mode="mean", reference=other):
        (abl0, _), _ = out_proj_inputs(model, ids)
    # the replaced columns hold the reference's mean (computed here by hand),
    # not the input's
    expected = other0[..., 8:12].reshape(-1, 4).mean(dim=0).expand(3, 6, 4)
    torch.testing.assert_close(abl0[..., 8:12], expected)
    assert not torch.allclose(
        abl0[..., 8:12], clean0[..., 8:12].mean(dim=(0, 1)).expand(3, 6, 4)
    )
    torch.testing.assert_close(abl0[..., :8], clean0[..., :8], rtol=0, atol=0)
    # the input itself as the reference is the default mean
    with heads.ablate_heads(model, [(0, 2)], mode="mean", reference=ids):
        (same0, _), _ = out_proj_inputs(model, ids)
    torch.testing.assert_close(
        same0[..., 8:12], clean0[..., 8:12].mean(dim=(0, 1)).expand(3, 6, 4)
    )
    # hooks removed on exit
    _, logits = out_proj_inputs(model, ids)
    torch.testing.assert_close(logits, clean_logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "pairs,kwargs,match",
    [
        ([(2, 0)], {}, r"no head \(2, 0\)"),
        ([(0, 4)], {}, r"no head \(0, 4\)"),
        ([(0, 0)], {"mode": "resample"}, "mode"),
        (
            [(0, 0)],
            {"reference": torch.zeros(1, 3, dtype=torch.long)},
            "reference is used only with mode='mean'",
        ),
    ],
)
def test_ablate_heads_errors(pairs, kwargs, match):
    model = small_gpt()
    with pytest.raises(ValueError, match=match):
        with heads.ablate_heads(model, pairs, **kwargs):
            pass


# --- the toy task and one layer's weights ------------------------------------


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_attention_weights_of_one_layer_match_torch(is_causal, bias):
    torch.manual_seed(0)
    ours = MultiHeadAttention(12, 3, bias=bias).double()
    ref = torch.nn.MultiheadAttention(
        12, 3, bias=bias, batch_first=True, dtype=torch.float64
    )
    with torch.no_grad():
        ref.in_proj_weight.copy_(
            torch.cat(
                [ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]
            )
        )
        if bias:
            ref.in_proj_bias.copy_(
                torch.cat(
                    [ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]
                )
            )
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    future = torch.ones(5, 5, dtype=torch.bool).triu(1) if is_causal else None
    _, expected = ref(x, x, x, attn_mask=future, average_attn_weights=False)
    torch.testing.assert_close(
        heads.attention_weights(ours, x, is_causal=is_causal), expected
    )


def test_attention_weights_checks_the_input():
    with pytest.raises(ValueError, match=r"d_model=8.*\(2, 5, 6\)"):
        heads.attention_weights(MultiHeadAttention(8, 2), torch.zeros(2, 5, 6))
