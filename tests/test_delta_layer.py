"""The delta layer (attnbook.delta.layer) and the tiny GPT's ``layer_types``:
the default config builds the same model as before (same parameters, same
outputs for the same seed), a hybrid runs and trains, and a delta layer
computes what the recurrence computes from its projections."""

import pytest
import torch
import torch.nn.functional as F

from attnbook.delta.layer import KINDS, DeltaLayer
from attnbook.delta.recurrent import delta_recurrence
from attnbook.gpt import GPTConfig, TinyGPT
from attnbook.multihead import MultiHeadAttention

CFG = dict(vocab_size=17, context_length=24, n_layers=4, n_heads=2, d_model=16)


def test_the_default_config_is_unchanged():
    """layer_types=None and all-"attention" build the model of before: same
    parameter names and shapes, same draws from the seed, same logits."""
    ids = torch.randint(
        0, 17, (2, 9), generator=torch.Generator().manual_seed(0)
    )
    torch.manual_seed(3)
    plain = TinyGPT(GPTConfig(**CFG))
    torch.manual_seed(3)
    named = TinyGPT(GPTConfig(**CFG, layer_types=("attention",) * 4))
    assert GPTConfig(**CFG).layer_types is None
    assert all(isinstance(b.attn, MultiHeadAttention) for b in plain.blocks)
    a, b = plain.state_dict(), named.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert torch.equal(plain(ids), named(ids))


def test_the_default_model_is_the_model_of_before():
    """Recorded from gpt.py before ``layer_types`` (commit 679f4b3), seed 3:
    the sum of the parameters and some logits. The initialisation draws are
    exact on every machine; the logits agree to rounding."""
    torch.manual_seed(3)
    model = TinyGPT(GPTConfig(**CFG))
    total = sum(p.double().sum() for p in model.parameters()).item()
    assert abs(total - 145.5489981192095) < 1e-9
    logits = model(torch.arange(9).view(1, 9))[0, :3, :3]
    before = torch.tensor(
        [
            [0.2985, -0.1153, 0.0642],
            [0.0341, 0.1583, -0.0039],
            [-0.0226, -0.0390, 0.1228],
        ]
    )
    torch.testing.assert_close(logits, before, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_hybrid_runs_and_trains_one_step(kind):
    torch.manual_seed(1)
    types = (kind, kind, kind, "attention")
    model = TinyGPT(GPTConfig(**CFG, layer_types=types))
    assert isinstance(model.blocks[0].attn, DeltaLayer)
    assert isinstance(model.blocks[3].attn, MultiHeadAttention)
    ids = torch.randint(0, 17, (3, 13))
    logits = model(ids)
    assert logits.shape == (3, 13, 17)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss.backward()
    grads = [p.grad for p in model.blocks[0].attn.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    opt.step()
    with torch.no_grad():
        after = F.cross_entropy(
            model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
        )
    assert after < loss


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_layer_is_the_recurrence_of_its_projections(kind):
    torch.manual_seed(2)
    layer = DeltaLayer(16, 2, kind, chunk_size=3).double()
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    q, k, v, beta, gate = layer.inputs(x)
    # independent of inputs(): the projections by hand
    heads = lambda t: t.view(2, 10, 2, 8).transpose(1, 2)  # noqa: E731
    k_hand = heads(x @ layer.k_proj.weight.T)
    k_hand = k_hand / k_hand.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(k, k_hand)
    if gate is not None:
        assert gate.shape == ((2, 2, 10, 8) if kind == "kda" else (2, 2, 10))
    o, _ = delta_recurrence(q, k, v, beta, gate, KINDS[kind][0])
    want = layer.out_proj(o.transpose(1, 2).reshape(2, 10, 16))
    torch.testing.assert_close(layer(x), want, rtol=0, atol=1e-12)


def test_bad_configs_and_calls_raise():
    with pytest.raises(ValueError, match="layer_types must name one of"):
        GPTConfig(**CFG, layer_types=("attention",) * 3)
    with pytest.raises(ValueError, match="layer_types must name one of"):
        GPTConfig(**CFG, layer_types=("attention",) * 3 + ("mamba",))
    with pytest.raises(ValueError, match="kind must be one of"):
        DeltaLayer(16, 2, "mamba")
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        DeltaLayer(16, 3)
    layer = DeltaLayer(16, 2)
    with pytest.raises(ValueError, match=r"x must have shape \(batch, n"):
        layer(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="no context, no mask"):
        layer(torch.randn(2, 5, 16), is_causal=False)
    model = TinyGPT(GPTConfig(**CFG, layer_types=("delta",) * 4))
    with pytest.raises(ValueError, match="not a KV cache"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 3)
    out = model.generate(
        torch.zeros(1, 2, dtype=torch.long), 3, use_cache=False
    )
    assert out.shape == (1, 5)
