"""The tiny GPT with multi-head latent attention and with layers that share
keys and values (chapter 12): each against the model or layer it generalises,
decoding with caches, cache bytes per token counted by hand, and the
ValueErrors of bad configurations."""

import pytest
import torch
from torch import nn

from attnbook.gpt import (
    GPTConfig,
    TinyGPT,
    cache_bytes_per_token,
    cache_layers,
)
from attnbook.latent.latent_cache import LatentCache
from attnbook.latent.mla import MultiHeadLatentAttention
from attnbook.latent.shared_attention import SharedKVAttention
from attnbook.latent.sharing import cla_sources
from attnbook.multihead import MultiHeadAttention

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE = dict(vocab_size=13, context_length=20, n_layers=4, n_heads=4)


def gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(**(SHAPE | {"d_model": 16} | overrides))).eval()


def ids(batch=2, n=9, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, SHAPE["vocab_size"], (batch, n), generator=gen)


def by_hand(model, tokens, attention):
    """The model's forward pass written out, with ``attention(i, h)`` for
    the attention of block ``i`` on its normalised input ``h``."""
    n = tokens.shape[1]
    x = model.tok_emb(tokens) + model.pos_emb(torch.arange(n))
    for i, block in enumerate(model.blocks):
        x = x + attention(i, block.ln_1(x))
        x = x + block.mlp(block.ln_2(x))
    return model.head(model.ln_f(x))


# ---- multi-head latent attention --------------------------------------------


def test_mla_blocks_run_the_layer_alone():
    """Each block's attention is a MultiHeadLatentAttention, called causally
    on the block's normalised input, as a layer alone would be."""
    model = gpt(attention="mla", d_latent=6, d_rope=4).double()
    tokens = ids()
    alone = []
    for block in model.blocks:
        assert isinstance(block.attn, MultiHeadLatentAttention)
        layer = MultiHeadLatentAttention(16, 4, d_latent=6, d_rope=4).double()
        layer.load_state_dict(block.attn.state_dict())
        alone.append(layer)
    with torch.no_grad():
        expected = by_hand(
            model, tokens, lambda i, h: alone[i](h, is_causal=True)
        )
        torch.testing.assert_close(model(tokens), expected, rtol=0, atol=1e-12)


def test_mla_with_an_identity_latent_is_the_multi_head_model():
    """d_latent = d_model, W_DKV = I, no latent norm, no rotary key, W_UK =
    W_K and W_UV = W_V: the MLA model computes the multi-head model."""
    mha = gpt(seed=3).double()
    mla = gpt(seed=4, attention="mla", d_latent=16).double()
    shared = {k: v for k, v in mha.state_dict().items() if ".attn." not in k}
    mla.load_state_dict(shared, strict=False)
    with torch.no_grad():
        for mine, theirs in zip(mla.blocks, mha.blocks):
            layer = mine.attn
            layer.kv_norm = nn.Identity()
            layer.kv_down.weight.copy_(torch.eye(16, dtype=torch.float64))
            layer.q_proj.weight.copy_(theirs.attn.q_proj.weight)
            layer.k_up.weight.copy_(theirs.attn.k_proj.weight)
            layer.v_up.weight.copy_(theirs.attn.v_proj.weight)
            layer.out_proj.weight.copy_(theirs.attn.out_proj.weight)
        tokens = ids()
        torch.testing.assert_close(
            mla(tokens), mha(tokens), rtol=0, atol=1e-12
        )


def test_mla_model_decodes_with_latent_caches():
    model = gpt(attention="mla", d_latent=6, d_rope=4).double()
    caches = model.new_kv_cache(batch=2, max_len=12)
    assert all(isinstance(c, LatentCache) for c in caches)
    tokens = ids(n=12)
    with torch.no_grad():
        whole = model(tokens)
        steps = [model(tokens[:, :5], caches)]
        for t in range(5, 12):  # one token at a time: the absorbed path
            steps.append(model(tokens[:, t : t + 1], caches, start_pos=t))
    torch.testing.assert_close(
        torch.cat(steps, dim=1), whole, rtol=0, atol=1e-12
    )
    prompt = tokens[:, :4]
    assert torch.equal(
        model.generate(prompt, 8, temperature=0),
        model.generate(prompt, 8, temperature=0, use_cache=False),
    )


# ---- layers that share keys and values --------------------------------------


def test_every_layer_its_own_source_is_the_plain_model():
    plain, own = gpt(seed=5), gpt(seed=5, kv_sources=(0, 1, 2, 3))
    assert own.config.sources == plain.config.sources == (0, 1, 2, 3)
    for (name, p), (name_2, q) in zip(
        plain.state_dict().items(), own.state_dict().items()
    ):
        assert name == name_2 and torch.equal(p, q)
    tokens = ids()
    with torch.no_grad():
        assert torch.equal(own(tokens), plain(tokens))


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_a_sharing_layer_attends_with_its_source_layers_keys(n_kv_heads):
    """CLA2: layers 1 and 3 use the keys and values that layers 0 and 2 made
    from their own inputs; the reference is a multi-head layer with the
    sharing layer's queries and output and the source's key and value
    projections, attending to the source's input as its context."""
    model = gpt(
        n_kv_heads=n_kv_heads, kv_sources=tuple(cla_sources(4, 2))
    ).double()
    assert [type(b.attn) for b in model.blocks] == [
        MultiHeadAttention,
        SharedKVAttention,
    ] * 2
    assert not hasattr(model.blocks[1].attn, "k_proj")
    source_inputs = {}

    def attention(i, h):
        source = model.config.sources[i]
        if source == i:
            source_inputs[i] = h
            return model.blocks[i].attn(h, is_causal=True)
        ref = MultiHeadAttention(16, 4, n_kv_heads).double()
        ref.q_proj = model.blocks[i].attn.q_proj
        ref.out_proj = model.blocks[i].attn.out_proj
        ref.k_proj = model.blocks[source].attn.k_proj
        ref.v_proj = model.blocks[source].attn.v_proj
        return ref(h, context=source_inputs[source], is_causal=True)

    tokens = ids()
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens),
            by_hand(model, tokens, attention),
            rtol=0,
            atol=1e-12,
        )


def test_sharing_model_decodes_and_trains():
    model = gpt(n_kv_heads=2, kv_sources=(0, 0, 2, 2)).double()
    caches = model.new_kv_cache(batch=2, max_len=12)
    assert caches[1] is caches[0] and caches[3] is caches[2]
    assert caches[0] is not caches[2]
    tokens = ids(n=12)
    with torch.no_grad():
        whole = model(tokens)
        steps = [model(tokens[:, :5], caches)]
        for t in range(5, 12):
            steps.append(model(tokens[:, t : t + 1], caches, start_pos=t))
    torch.testing.assert_close(
        torch.cat(steps, dim=1), whole, rtol=0, atol=1e-12
    )
    assert caches[0].length == 12
    prompt = tokens[:, :4]
    assert torch.equal(
        model.generate(prompt, 8, temperature=0),
        model.generate(prompt, 8, temperature=0, use_cache=False),
    )
    # training: with layer 0's own attention output silenced, its key
    # projection reaches the loss only through layer 1, which shares it
    with torch.no_grad():
        model.blocks[0].attn.out_proj.weight.zero_()
    model.train()
    model(tokens)[:, :, 0].sum().backward()
    assert model.blocks[0].attn.k_proj.weight.grad.abs().sum() > 0
    plain = gpt(n_kv_heads=2).double().train()
    with torch.no_grad():
        plain.blocks[0].attn.out_proj.weight.zero_()
    plain(tokens)[:, :, 0].sum().backward()
    assert plain.blocks[0].attn.k_proj.weight.grad.abs().sum() == 0


# ---- cache bytes per token --------------------------------------------------


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # 4 layers x (key + value) x 4 heads x 16 features x 2 bytes
        ({}, 4 * 2 * 4 * 16 * 2),
        ({"n_kv_heads": 2}, 4 * 2 * 2 * 16 * 2),
        ({"n_kv_heads": 1}, 4 * 2 * 1 * 16 * 2),
        # 4 layers x (latent 32 + rotary key 8) x 2 bytes
        ({"attention": "mla", "d_latent": 32, "d_rope": 8}, 4 * 40 * 2),
        # CLA2: 2 of the 4 layers cache
        ({"kv_sources": (0, 0, 2, 2)}, 2 * 2 * 4 * 16 * 2),
        ({"n_kv_heads": 2, "kv_sources": (0, 0, 0, 0)}, 1 * 2 * 2 * 16 * 2),
        # a recurrent layer's state does not grow with the tokens
        ({"layer_types": ("attention", "delta") * 2}, 2 * 2 * 4 * 16 * 2),
    ],
)
def test_cache_bytes_per_token_counted_by_hand(overrides, expected):
    config = GPTConfig(**(SHAPE | {"d_model": 64} | overrides))
    assert cache_bytes_per_token(config) == expected
    assert cache_bytes_per_token(config, bytes_per_element=4) == 2 * expected
    assert len(cache_layers(config)) == 4


def test_cache_bytes_per_token_matches_the_caches_a_model_makes():
    """What new_kv_cache allocates, per position, in float32."""
    for overrides in (
        {"n_kv_heads": 2},
        {"kv_sources": (0, 0, 2, 2)},
        {"attention": "mla", "d_latent": 6, "d_rope": 2},
    ):
        model = gpt(**overrides)
        caches = {id(c): c for c in model.new_kv_cache(max_len=10)}
        held = sum(c.nbytes for c in caches.values()) / 10
        assert held == cache_bytes_per_token(model.config, 4), overrides


# ---- bad configurations -----------------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"attention": "gqa"}, "attention must be 'mha' or 'mla'"),
        ({"d_latent": 8}, "belong to attention='mla'"),
        ({"d_rope": 2}, "belong to attention='mla'"),
        ({"attention": "mla"}, "d_latent"),
        ({"attention": "mla", "d_latent": 0}, "d_latent"),
        ({"attention": "mla", "d_latent": 8, "d_rope": 3}, "must be even"),
        ({"attention": "mla", "d_latent": 8, "n_kv_heads": 2}, "n_kv_heads"),
        ({"kv_sources": (0, 0, 2)}, "each of the n_layers=4"),
        ({"kv_sources": (0, 2, 2, 2)}, "itself or an earlier layer"),
        ({"kv_sources": (0, -1, 2, 2)}, "itself or an earlier layer"),
        ({"kv_sources": (0, 0.0, 2, 2)}, "itself or an earlier layer"),
        ({"kv_sources": (0, 0, 1, 3)}, r"layers \[1\] share"),
        (
            {"attention": "mla", "d_latent": 8, "kv_sources": (0, 0, 2, 2)},
            "only in a model of softmax attention",
        ),
        (
            {
                "layer_types": ("attention", "delta") * 2,
                "kv_sources": (0, 0, 2, 2),
            },
            "only in a model of softmax attention",
        ),
    ],
)
def test_bad_configurations_raise_value_error(overrides, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**(SHAPE | {"d_model": 16} | overrides))


def test_mla_model_refuses_another_cache_class():
    from attnbook.quantized_cache import QuantizedKVCache

    with pytest.raises(ValueError, match="LatentCache"):
        gpt(attention="mla", d_latent=6).new_kv_cache(
            cache_class=QuantizedKVCache
        )
