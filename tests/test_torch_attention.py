"""The torch attention core (attnbook.torch_attention) and the attention hook
of MultiHeadAttention.

References: torch.nn.functional.scaled_dot_product_attention (float16
included), a float64 numpy computation written out here, and the package's own
layer run with and without the hook overridden.
"""

import inspect
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attnbook
from attnbook.gqa import grouped_query_attention
from attnbook.multihead import MultiHeadAttention, keeping_weights
from attnbook.experiments.extrapolation import SCHEMES
from attnbook.torch_attention import attend, fused_attention, with_causal
from package_classes import required_arguments, subclasses


def numpy_attention(q, k, v, mask=None, bias=None, scale=None):
    """float64 softmax(q k^T * scale + bias) v, masked rows -> 0."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ np.swapaxes(k, -1, -2) * scale
    if bias is not None:
        s = s + np.asarray(bias, dtype=np.float64)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    z = e.sum(-1, keepdims=True)
    w = np.divide(e, z, out=np.zeros_like(e), where=z > 0)
    return w @ v, w


def test_bias_is_added_to_the_scaled_scores():
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 3, 5, 4, generator=g),
        torch.randn(2, 3, 7, 4, generator=g),
        torch.randn(2, 3, 7, 6, generator=g),
    )
    # (3, 5, 7)
    bias = torch.from_numpy(attnbook.alibi_bias(3, 5, 7)).float()
    mask = torch.from_numpy(attnbook.causal_mask(5, 7))
    out, w = attend(q, k, v, mask, scale=0.3, bias=bias, return_weights=True)
    ref_out, ref_w = numpy_attention(
        q, k, v, mask.numpy(), bias.numpy(), scale=0.3
    )
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w.numpy(), ref_w, rtol=1e-5, atol=1e-7)
    sdpa = F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias.masked_fill(~mask, float("-inf")), scale=0.3
    )
    torch.testing.assert_close(out, sdpa)


def test_bias_shape_is_checked():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(
        ValueError, match=r"bias of shape \(2, 3, 5\) does not broadcast"
    ):
        attend(q, q, q, bias=torch.zeros(2, 3, 5))


def overflowing_float16(seed=0):
    """q . k about 1.3e5 > 65504 before the 1/sqrt(d_k) scale, but the scaled
    scores are fine."""
    g = torch.Generator().manual_seed(seed)
    q = (60 + torch.rand(1, 2, 4, 64, generator=g)).half()
    k = (30 + torch.rand(1, 2, 6, 64, generator=g)).half()
    # one key scores higher: the weights are not flat
    k[..., 3, :] += 1
    v = torch.randn(1, 2, 6, 64, generator=g).half()
    return q, k, v


def test_float16_scores_beyond_its_range_match_torch():
    q, k, v = overflowing_float16()
    # the naive product does overflow
    assert torch.isinf(q @ k.transpose(-1, -2)).any()
    ours = attend(q, k, v)
    assert ours.dtype == torch.float16 and torch.isfinite(ours).all()
    torch.testing.assert_close(
        ours, F.scaled_dot_product_attention(q, k, v), rtol=2e-3, atol=2e-3
    )
    ref, _ = numpy_attention(q, k, v)
    np.testing.assert_allclose(
        ours.double().numpy(), ref, rtol=2e-3, atol=2e-3
    )
    grouped = grouped_query_attention(q, k[:, :1], v[:, :1])
    torch.testing.assert_close(
        grouped,
        F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], enable_gqa=True),
        rtol=2e-3,
        atol=2e-3,
    )


@pytest.mark.parametrize("n_q, n_k", [(0, 5), (3, 0), (0, 0)])
def test_empty_queries_or_keys_match_torch(n_q, n_k):
    q, k, v = (
        torch.randn(2, n_q, 4),
        torch.randn(2, n_k, 4),
        torch.randn(2, n_k, 3),
    )
    ours, w = attend(q, k, v, return_weights=True)
    assert ours.shape == (2, n_q, 3) and w.shape == (2, n_q, n_k)
    # torch's reference gives NaN rows for n_k = 0 (0/0); attend's rule is
    # "attends to nothing: zero"
    torch.testing.assert_close(
        ours, F.scaled_dot_product_attention(q, k, v).nan_to_num(0.0)
    )
    assert (ours == 0).all() if n_k == 0 else True


def test_float64_and_float32_are_scored_in_their_own_precision():
    q = torch.randn(3, 4, dtype=torch.float64)
    out, w = attend(q, q, q, return_weights=True)
    assert out.dtype == w.dtype == torch.float64
    ref, _ = numpy_attention(q, q, q)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-12)


def test_with_causal_combines_masks():
    # (1, 4): key 1 hidden
    user = torch.tensor([[True, False, True, True]])
    both = with_causal(user, True, 2, 4)
    assert torch.equal(
        both,
        torch.tensor([[True, False, True, False], [True, False, True, True]]),
    )
    assert with_causal(user, False, 2, 4) is user
    # one new token sees every key
    assert with_causal(None, True, 1, 4) is None
    assert torch.equal(
        with_causal(None, True, 3, 3),
        torch.from_numpy(attnbook.causal_mask(3)),
    )


@pytest.mark.parametrize("n_q, n_k", [(4, 4), (2, 6), (1, 5)])
@pytest.mark.parametrize("masked_row", [False, True])
def test_fused_attention_equals_attend(n_q, n_k, masked_row):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for n in (n_q, n_k, n_k))
    mask = torch.rand(2, 1, n_q, n_k, generator=g) > 0.3
    mask[..., -1] = True
    if masked_row:
        mask[0, 0, 0] = False
    for m in (None, mask):
        expected = attend(q, k, v, with_causal(m, True, n_q, n_k))
        torch.testing.assert_close(
            fused_attention(q, k, v, m, is_causal=True), expected
        )


class ScaledByTwo(MultiHeadAttention):
    """A variant that overrides only the attention step: scores twice as
    sharp."""

    def attention(self, q, k, v, mask=None, is_causal=False):
        mask = with_causal(mask, is_causal, q.shape[2], k.shape[2])
        return attend(
            q,
            k,
            v,
            mask,
            scale=2 / math.sqrt(self.d_head),
            return_weights=True,
        )


def test_a_variant_overrides_only_the_attention_step():
    """The hook receives the projected heads and its output goes through the
    same out_proj: a layer whose hook doubles the scale equals a base layer
    whose q_proj is doubled."""
    torch.manual_seed(0)
    variant = ScaledByTwo(12, 3)
    base = MultiHeadAttention(12, 3)
    base.load_state_dict(variant.state_dict())
    with torch.no_grad():
        base.q_proj.weight.mul_(2)
    x = torch.randn(2, 5, 12)
    torch.testing.assert_close(
        variant(x, is_causal=True), base(x, is_causal=True)
    )
    with keeping_weights(variant) as layers:
        variant(x, is_causal=True)
        assert layers == [variant] and variant.weights.shape == (2, 3, 5, 5)
    assert variant.weights is None and not variant.keep_weights


# Every MultiHeadAttention of the package, found in its sources
# (tests/package_classes.py): a new variant is tested here without an edit.
# Each is built with those of LAYER_ARGUMENTS its constructor takes, once per
# combination of the values listed; a required argument not listed fails the
# test.
LAYER_ARGUMENTS = {
    "d_model": [16],
    "n_heads": [4],
    "n_kv_heads": [2],
    "use_sdpa": [False, True],
    "scheme": list(SCHEMES),
}


def layer_cases():
    cases = []
    for cls in subclasses(MultiHeadAttention):
        names = [
            name
            for name in inspect.signature(cls).parameters
            if name in LAYER_ARGUMENTS
        ]
        missing = required_arguments(cls, LAYER_ARGUMENTS)
        for values in itertools.product(
            *(LAYER_ARGUMENTS[name] for name in names)
        ):
            arguments = dict(zip(names, values))
            label = "-".join(
                [cls.__name__]
                + [
                    f"{k}={v}"
                    for k, v in arguments.items()
                    if len(LAYER_ARGUMENTS[k]) > 1
                ]
            )
            cases.append(pytest.param(cls, arguments, missing, id=label))
    return cases


@pytest.mark.parametrize("layer_class, arguments, missing", layer_cases())
def test_kept_weights_reproduce_the_output(layer_class, arguments, missing):
    assert not missing, (
        f"{layer_class.__name__} requires {missing}: list example values in "
        "LAYER_ARGUMENTS"
    )
    torch.manual_seed(1)
    attn = layer_class(**arguments)
    h, n_kv_heads = attn.n_heads, attn.n_kv_heads
    x = torch.randn(2, 6, 16)
    mask = torch.rand(2, h, 6, 6) > 0.2
    plain = attn(x, mask=mask, is_causal=True)
    attn.keep_weights = True
    kept = attn(x, mask=mask, is_causal=True)
    v = (
        attn.v_proj(x)
        .view(2, 6, n_kv_heads, 16 // h)
        .transpose(1, 2)
        .repeat_interleave(h // n_kv_heads, dim=1)
    )
    by_hand = attn.out_proj(
        (attn.weights @ v).transpose(1, 2).reshape(2, 6, 16)
    )
    torch.testing.assert_close(kept, plain)
    torch.testing.assert_close(by_hand, kept)
    assert torch.all(
        attn.weights[~(mask & torch.ones(6, 6, dtype=torch.bool).tril())] == 0
    )
