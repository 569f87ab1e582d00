"""Learned attention sinks (attnbook.sparse.sinks) against transformers'
``GptOssAttention`` and against their closed form.

The reference is ``GptOssAttention`` of the pinned transformers, built from a
small ``GptOssConfig`` (default RoPE instead of YaRN) at random initialisation
in float64, with its own eager attention and its own masks
(``create_causal_mask``, ``create_sliding_window_causal_mask``); its rotary
cos/sin are computed here in float64. Layer 0 of the config is a sliding
layer, layer 1 a full one.
"""

import math

import pytest
import torch

from attnbook import attend
from attnbook.sparse.sinks import (
    SinkAttention,
    from_gpt_oss,
    sink_attention,
    sink_scale,
)
from attnbook.torch_attention import merge_splits

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import masking_utils  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss  # noqa: E402

N, D_MODEL, HEADS, KV_HEADS, D_HEAD, WINDOW = 11, 32, 4, 2, 8, 4


def config():
    cfg = transformers.GptOssConfig(
        hidden_size=D_MODEL,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=D_HEAD,
        num_hidden_layers=2,
        sliding_window=WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_local_experts=2,
        intermediate_size=16,
        vocab_size=50,
        attention_bias=True,
    )
    cfg._attn_implementation = "eager"
    return cfg


def reference(layer_idx, seed=0):
    torch.manual_seed(seed)
    attention = gpt_oss.GptOssAttention(config(), layer_idx).double().eval()
    with torch.no_grad():
        for p in attention.parameters():
            p.normal_(0.0, 0.5)
    return attention


def rotary(n):
    inv_freq = 1.0 / 10000.0 ** (
        torch.arange(0, D_HEAD, 2, dtype=torch.float64) / D_HEAD
    )
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq
    # gpt-oss rotates the two halves with the same (n, d/2) table
    return angles[None].cos(), angles[None].sin()


def reference_output(attention, x):
    cfg = attention.config
    make = (
        masking_utils.create_sliding_window_causal_mask
        if attention.sliding_window
        else masking_utils.create_causal_mask
    )
    mask = make(
        config=cfg,
        inputs_embeds=x,
        attention_mask=None,
        past_key_values=None,
        position_ids=torch.arange(x.shape[1])[None],
        allow_is_causal_skip=False,
    )
    with torch.no_grad():
        out, _ = attention(x, rotary(x.shape[1]), mask)
    return out


@pytest.mark.parametrize("layer_idx, kind", [(0, "sliding"), (1, "full")])
def test_gpt_oss_attention_equals_ours_with_the_same_weights(layer_idx, kind):
    theirs = reference(layer_idx)
    assert (theirs.sliding_window is not None) == (kind == "sliding")
    ours = from_gpt_oss(theirs)
    assert ours.window == (WINDOW if kind == "sliding" else None)
    x = torch.randn(2, N, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        got = ours(x, is_causal=True)
    torch.testing.assert_close(
        got, reference_output(theirs, x), rtol=1e-12, atol=1e-12
    )


def test_the_window_and_the_sinks_each_matter():
    """Dropping either the sinks or the window moves the output: the
    comparison above can tell them apart."""
    theirs = reference(0)
    x = torch.randn(1, N, D_MODEL, dtype=torch.float64)
    want = reference_output(theirs, x)
    no_window = from_gpt_oss(theirs)
    no_window.window = None
    no_sink = from_gpt_oss(theirs)
    with torch.no_grad():
        no_sink.sinks.fill_(-1e9)
        for layer in (no_window, no_sink):
            assert (layer(x, is_causal=True) - want).abs().max() > 1e-3


def random_heads(seed=0, n_q=5, n_k=7, d=4):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(2, 3, m, d, generator=g, dtype=torch.float64)
        for m in (n_q, n_k, n_k)
    )
    sinks = torch.randn(3, generator=g, dtype=torch.float64) * 2
    return q, k, v, sinks


def test_weights_sum_to_one_minus_the_sink_share():
    """Theorem: a_j = exp(z_j) / (exp(s) + sum exp(z)), so the row sums to
    sigmoid(logsumexp(z) - s), computed here from its definition."""
    q, k, v, sinks = random_heads()
    _, weights = sink_attention(q, k, v, sinks, return_weights=True)
    z = q @ k.transpose(-2, -1) / 2.0  # d = 4
    lse = torch.logsumexp(z, dim=-1)
    kept = torch.exp(lse) / (torch.exp(lse) + torch.exp(sinks)[:, None])
    torch.testing.assert_close(weights.sum(-1), kept)
    torch.testing.assert_close(sink_scale(z, sinks), kept)
    assert (kept < 1).all() and (kept > 0).all()


def test_output_is_plain_attention_scaled_and_its_norm_shrinks():
    """Theorem: out_sink = (1 - sigma) out_plain, so its norm is (1 - sigma)
    times the plain norm; and it is the merge of the keys' state with an empty
    run of log-sum-exp s (value 0)."""
    q, k, v, sinks = random_heads(1)
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[:, 0] = True
    got = sink_attention(q, k, v, sinks, mask)
    plain = attend(q, k, v, mask)
    z = q @ k.transpose(-2, -1) / 2.0
    kept = sink_scale(z, sinks, mask)
    torch.testing.assert_close(got, kept[..., None] * plain)
    torch.testing.assert_close(got.norm(dim=-1), kept * plain.norm(dim=-1))
    lse = torch.logsumexp(z.masked_fill(~mask, -math.inf), dim=-1)
    merged, _ = merge_splits(
        torch.stack([plain, torch.zeros_like(plain)]),
        torch.stack([lse, sinks[:, None].expand_as(lse)]),
    )
    torch.testing.assert_close(got, merged)


def test_a_sink_of_minus_infinity_is_plain_attention():
    q, k, v, _ = random_heads(2)
    sinks = torch.full((3,), -math.inf, dtype=torch.float64)
    torch.testing.assert_close(sink_attention(q, k, v, sinks), attend(q, k, v))


def test_a_fully_masked_row_gives_zero():
    q, k, v, sinks = random_heads(4)
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[2] = False
    out, weights = sink_attention(q, k, v, sinks, mask, return_weights=True)
    assert (out[..., 2, :] == 0).all() and (weights[..., 2, :] == 0).all()


def test_the_layer_without_sinks_window_or_rope_learns_gradients():
    layer = SinkAttention(16, 4, window=3).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    layer(x, is_causal=True).sum().backward()
    assert layer.sinks.grad is not None and layer.sinks.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "call, named",
    [
        (lambda: SinkAttention(16, 4, window=0), "window"),
        (lambda: SinkAttention(16, 4, window=-3), "-3"),
        (
            lambda: sink_attention(*random_heads()[:3], torch.zeros(2)),
            "(3,)",
        ),
    ],
)
def test_bad_input_is_named(call, named):
    with pytest.raises(
        ValueError, match=named.replace("(", r"\(").replace(")", r"\)")
    ):
        call()


def test_without_sinks_or_window_the_layer_is_multi_head_attention():
    """The layer it generalises: sinks at -inf, no window, no RoPE."""
    from attnbook import MultiHeadAttention

    torch.manual_seed(0)
    plain = MultiHeadAttention(16, 4, 2).double()
    ours = SinkAttention(16, 4, 2).double()
    ours.load_state_dict({**plain.state_dict(), "sinks": ours.sinks})
    with torch.no_grad():
        ours.sinks.fill_(-math.inf)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(x, is_causal=True), plain(x, is_causal=True)
        )


def test_a_released_gpt_oss_layer_is_refused_by_name():
    """gpt-oss-120b's configuration ships YaRN and an attention of 64 x 64 =
    4096 features on a model width of 2880: from_gpt_oss names each."""
    released = transformers.GptOssConfig()
    with torch.device("meta"):
        layer = gpt_oss.GptOssAttention(released, 0)
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        from_gpt_oss(layer)
    released.rope_parameters = {"rope_type": "default", "rope_theta": 1e4}
    with torch.device("meta"):
        layer = gpt_oss.GptOssAttention(released, 0)
    with pytest.raises(ValueError, match="64 \\* 64 must equal hidden_size"):
        from_gpt_oss(layer)


@pytest.mark.parametrize("function", [sink_attention, sink_scale])
def test_the_shown_docstrings_write_the_sink_logit_as_beta(function):
    """Chapter 14 writes head i's sink logit beta_i (s is a key's position);
    the docstrings it shows use the same symbol."""
    assert "beta_i" in function.__doc__
    assert "s_h" not in function.__doc__
