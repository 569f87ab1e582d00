"""The tiny GPT: shapes, causality, generation, checkpoints, the shipped
weights, multi-head latent attention and shared caches, the training
script."""

import math
import runpy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torch import nn

from attnbook.gpt import (
    CharTokenizer,
    GPTConfig,
    TinyGPT,
    cache_bytes_per_token,
    cache_layers,
    load_checkpoint,
    load_tiny_gpt,
    load_training_text,
    save_checkpoint,
    train_val_split,
)
from attnbook.latent.latent_cache import LatentCache
from attnbook.latent.mla import MultiHeadLatentAttention
from attnbook.latent.shared_attention import SharedKVAttention
from attnbook.latent.sharing import cla_sources
from attnbook.multihead import MultiHeadAttention

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "3:16 For God so loved the world"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny():
    return load_tiny_gpt()


def small_gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    config = (
        dict(
            vocab_size=17,
            context_length=24,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_model=16,
        )
        | overrides
    )
    return TinyGPT(GPTConfig(**config)).eval()


# ---- the shipped model ------------------------------------------------------


def test_load_tiny_gpt_gives_an_eval_model_and_its_tokenizer(tiny):
    model, tokenizer = tiny
    assert isinstance(model, TinyGPT) and not model.training
    assert model.config.vocab_size == tokenizer.vocab_size
    assert model.head.weight is model.tok_emb.weight
    assert tokenizer.decode(tokenizer.encode(PROMPT)) == PROMPT
    assert set(load_training_text()) == set(tokenizer.vocab)


def test_shipped_weights_are_trained(tiny):
    """Held-out text costs far fewer nats per character than the log(73) = 4.29
    of a uniform guess (the shipped weights: about 1.44 on these windows;
    halfway through training: about 1.8)."""
    model, tokenizer = tiny
    _, val = train_val_split(
        torch.tensor(tokenizer.encode(load_training_text()))
    )
    block = model.config.context_length
    # (4, block + 1)
    windows = torch.stack(
        [val[s : s + block + 1] for s in range(0, 4 * block, block)]
    )
    with torch.no_grad():
        logits = model(windows[:, :-1])
    loss = F.cross_entropy(
        logits.flatten(0, 1), windows[:, 1:].flatten()
    ).item()
    assert loss < 1.6, loss


def test_greedy_generation_is_deterministic_and_cache_independent(tiny):
    model, tokenizer = tiny
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    first = model.generate(ids, 60, temperature=0)
    assert torch.equal(first, model.generate(ids, 60, temperature=0))
    assert torch.equal(
        first, model.generate(ids, 60, temperature=0, use_cache=False)
    )
    text = tokenizer.decode(first[0].tolist())
    assert text.startswith(PROMPT) and len(text) == len(PROMPT) + 60


def test_generation_fills_the_block_and_one_more():
    """The last new token is never fed back, so prompt + new may reach
    context_length + 1."""
    model = small_gpt()
    ids = torch.zeros(1, 3, dtype=torch.long)
    n_new = model.config.context_length + 1 - 3
    cached = model.generate(ids, n_new, temperature=0)
    assert cached.shape == (1, model.config.context_length + 1)
    assert torch.equal(
        cached, model.generate(ids, n_new, temperature=0, use_cache=False)
    )
    # the last token is the argmax after the full block, as recomputation gives
    with torch.no_grad():
        assert cached[0, -1] == model(cached[:, :-1])[0, -1].argmax()


def test_sampling_is_reproducible_with_a_seed(tiny):
    model, tokenizer = tiny
    ids = torch.tensor([tokenizer.encode(PROMPT)] * 2)
    a = model.generate(ids, 40, temperature=0.8, top_k=10, seed=5)
    assert torch.equal(
        a, model.generate(ids, 40, temperature=0.8, top_k=10, seed=5)
    )
    assert torch.equal(
        a,
        model.generate(
            ids, 40, temperature=0.8, top_k=10, seed=5, use_cache=False
        ),
    )
    greedy = model.generate(ids[:1], 40, temperature=0)
    assert torch.equal(
        greedy, model.generate(ids[:1], 40, temperature=1.0, top_k=1, seed=0)
    )


# ---- the architecture -------------------------------------------------------


def test_logits_shape_and_causality():
    model = small_gpt()
    ids = torch.randint(
        0, 17, (3, 10), generator=torch.Generator().manual_seed(0)
    )
    changed = ids.clone()
    # change the future only
    changed[:, 6:] = (changed[:, 6:] + 1) % 17
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert a.shape == (3, 10, 17)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=0)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_start_pos_shifts_the_positions():
    model = small_gpt()
    ids = torch.randint(
        0, 17, (1, 5), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = model.head(
            model.ln_f(
                _blocks(model, model.tok_emb(ids) + model.pos_emb.weight[7:12])
            )
        )
        torch.testing.assert_close(model(ids, start_pos=7), expected)


@pytest.mark.parametrize("use_sdpa", [False, True])
def test_left_padded_batch_with_positions_gives_each_sequence_its_own_logits(
    use_sdpa,
):
    """Per-sequence positions and a key-padding mask make a left-padded batch
    equal to each sequence run alone, in the prefill and in cached decode steps
    after it."""
    model = small_gpt(seed=5)
    for block in model.blocks:
        block.attn.use_sdpa = use_sdpa
    gen = torch.Generator().manual_seed(5)
    lengths, n, n_steps, pad_id = [7, 4, 1], 7, 3, 0
    prompts = [
        torch.randint(1, 17, (1, length), generator=gen) for length in lengths
    ]
    # tokens fed after the prompts
    steps = torch.randint(1, 17, (3, n_steps), generator=gen)
    ids = torch.stack(
        [
            torch.cat([torch.full((n - p.shape[1],), pad_id), p[0]])
            for p in prompts
        ]
    )
    real = ids.new_tensor(
        [[c >= n - length for c in range(n)] for length in lengths],
        dtype=torch.bool,
    )
    # 0 at each first real token
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        cache = model.new_kv_cache(batch=3)
        # (3, 1, 1, n): padding keys hidden
        keys_real = real[:, None, None, :]
        batched = [model(ids, cache, mask=keys_real, positions=positions)]
        for t in range(n_steps):
            keys_real = torch.cat(
                [keys_real, torch.ones(3, 1, 1, 1, dtype=torch.bool)], dim=-1
            )
            # (3, 1)
            step_positions = torch.tensor(lengths)[:, None] + t
            batched.append(
                model(
                    steps[:, t : t + 1],
                    cache,
                    start_pos=n + t,
                    mask=keys_real,
                    positions=step_positions,
                )
            )
        # (3, n + n_steps, vocab)
        batched = torch.cat(batched, dim=1)
        for i, (prompt, length) in enumerate(zip(prompts, lengths)):
            # (length + n_steps, vocab)
            alone = model(torch.cat([prompt, steps[i : i + 1]], dim=1))[0]
            torch.testing.assert_close(
                batched[i, n - length :], alone, rtol=1e-5, atol=1e-5
            )
        # without the positions the shorter prompts are shifted by their
        # padding, and differ
        shifted = model(ids, mask=real[:, None, None, :])
        assert (shifted[1, n - 4 :] - model(prompts[1])[0]).abs().max() > 1e-2


def test_positions_default_to_the_columns_and_may_be_shared():
    model = small_gpt()
    ids = torch.randint(
        0, 17, (2, 5), generator=torch.Generator().manual_seed(6)
    )
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, start_pos=3),
            model(ids, start_pos=3, positions=torch.arange(3, 8)),
        )
        torch.testing.assert_close(
            model(ids, positions=torch.arange(3, 8).expand(2, 5)),
            model(ids, start_pos=3),
        )


@pytest.mark.parametrize(
    "positions,match",
    [
        (torch.arange(4.0), "int64"),
        ([0, 1, 2, 3], "int64"),
        (torch.arange(5), r"shape of ids \(1, 4\) or \(4,\); got \(5,\)"),
        (torch.zeros(2, 4, dtype=torch.long), r"got \(2, 4\)"),
        (torch.tensor([0, 1, 2, 24]), r"\[0, 24\).*0\.\.24"),
        (torch.tensor([-1, 0, 1, 2]), r"\[0, 24\)"),
    ],
)
def test_bad_positions_raise_value_error(positions, match):
    with pytest.raises(ValueError, match=match):
        small_gpt()(torch.zeros(1, 4, dtype=torch.long), positions=positions)


def _blocks(model, x):
    for block in model.blocks:
        x = block(x)
    return x


def test_sdpa_and_explicit_attention_agree():
    fast, slow = small_gpt(seed=4), small_gpt(seed=4)
    for block in slow.blocks:
        block.attn.use_sdpa = False
    ids = torch.randint(
        0, 17, (2, 24), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        torch.testing.assert_close(fast(ids), slow(ids), rtol=1e-5, atol=1e-5)


def test_checkpoint_round_trip(tmp_path):
    model = small_gpt(seed=2)
    tokenizer = CharTokenizer("abcdefghijklmnopq")
    save_checkpoint(tmp_path / "m.pt", model, tokenizer, {"note": "test"})
    loaded, tok, meta = load_checkpoint(tmp_path / "m.pt")
    ids = torch.randint(
        0, 17, (2, 9), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
    assert (
        tok.vocab == tokenizer.vocab
        and meta == {"note": "test"}
        and loaded.config == model.config
    )
    assert loaded.head.weight is loaded.tok_emb.weight


def test_tokenizer():
    tok = CharTokenizer.from_text("hello world")
    assert tok.vocab == " dehlorw" and tok.encode("low") == [4, 5, 7]
    assert tok.decode(tok.encode("hello")) == "hello"
    with pytest.raises(ValueError, match="'xz'"):
        tok.encode("xyz".replace("y", ""))
    with pytest.raises(ValueError, match="repeat"):
        CharTokenizer("aa")


def test_train_val_split_partitions_the_tokens():
    tokens = torch.arange(100)
    train, val = train_val_split(tokens, chunk_len=7, val_every=3)
    assert sorted(torch.cat([train, val]).tolist()) == list(range(100))
    # the third chunk
    assert val[:7].tolist() == list(range(14, 21))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda m: m(torch.zeros(1, 4)), "int64"),
        (lambda m: m(torch.zeros(4, dtype=torch.long)), r"\(4,\)"),
        (
            lambda m: m(torch.zeros(1, 25, dtype=torch.long)),
            "context_length=24",
        ),
        (
            lambda m: m(torch.zeros(1, 4, dtype=torch.long), start_pos=21),
            "context_length=24",
        ),
        (lambda m: m(torch.full((1, 4), 17)), r"\[0, 17\)"),
        (
            lambda m: m(torch.zeros(1, 4, dtype=torch.long), start_pos=-1),
            "start_pos",
        ),
        (
            lambda m: m.generate(torch.zeros(1, 20, dtype=torch.long), 6),
            "exceeds context_length \\+ 1 = 25",
        ),
        (
            lambda m: m.generate(torch.zeros(1, 2, dtype=torch.long), 0),
            "max_new_tokens",
        ),
        (
            lambda m: m.generate(
                torch.zeros(1, 2, dtype=torch.long), 3, temperature=-1
            ),
            "temperature",
        ),
        (
            lambda m: m.new_kv_cache(max_len=25),
            "max_len=25 exceeds context_length=24",
        ),
    ],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call(small_gpt())


def test_config_errors():
    with pytest.raises(
        ValueError, match="d_model=30 is not divisible by n_heads=4"
    ):
        TinyGPT(GPTConfig(vocab_size=5, d_model=30, n_heads=4))
    with pytest.raises(ValueError, match="context_length"):
        GPTConfig(vocab_size=5, context_length=0)


# ---- latent attention and shared caches (chapter 13) ------------------------
CACHE_SHAPE = dict(vocab_size=13, context_length=20, n_layers=4, n_heads=4)


def cache_gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    return TinyGPT(
        GPTConfig(**(CACHE_SHAPE | {"d_model": 16} | overrides))
    ).eval()


def cache_ids(batch=2, n=9, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(
        0, CACHE_SHAPE["vocab_size"], (batch, n), generator=gen
    )


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
    model = cache_gpt(attention="mla", d_latent=6, d_rope=4).double()
    tokens = cache_ids()
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
    mha = cache_gpt(seed=3).double()
    mla = cache_gpt(seed=4, attention="mla", d_latent=16).double()
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
        tokens = cache_ids()
        torch.testing.assert_close(
            mla(tokens), mha(tokens), rtol=0, atol=1e-12
        )


def test_mla_model_decodes_with_latent_caches():
    model = cache_gpt(attention="mla", d_latent=6, d_rope=4).double()
    caches = model.new_kv_cache(batch=2, max_len=12)
    assert all(isinstance(c, LatentCache) for c in caches)
    tokens = cache_ids(n=12)
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
    plain, own = cache_gpt(seed=5), cache_gpt(seed=5, kv_sources=(0, 1, 2, 3))
    assert own.config.sources == plain.config.sources == (0, 1, 2, 3)
    for (name, p), (name_2, q) in zip(
        plain.state_dict().items(), own.state_dict().items()
    ):
        assert name == name_2 and torch.equal(p, q)
    tokens = cache_ids()
    with torch.no_grad():
        assert torch.equal(own(tokens), plain(tokens))


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_a_sharing_layer_attends_with_its_source_layers_keys(n_kv_heads):
    """CLA2: layers 1 and 3 use the keys and values that layers 0 and 2 made
    from their own inputs; the reference is a multi-head layer with the
    sharing layer's queries and output and the source's key and value
    projections, attending to the source's input as its context."""
    model = cache_gpt(
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

    tokens = cache_ids()
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens),
            by_hand(model, tokens, attention),
            rtol=0,
            atol=1e-12,
        )


def test_sharing_model_decodes_and_trains():
    model = cache_gpt(n_kv_heads=2, kv_sources=(0, 0, 2, 2)).double()
    caches = model.new_kv_cache(batch=2, max_len=12)
    assert caches[1] is caches[0] and caches[3] is caches[2]
    assert caches[0] is not caches[2]
    tokens = cache_ids(n=12)
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
    plain = cache_gpt(n_kv_heads=2).double().train()
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
    config = GPTConfig(**(CACHE_SHAPE | {"d_model": 64} | overrides))
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
        model = cache_gpt(**overrides)
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
        GPTConfig(**(CACHE_SHAPE | {"d_model": 16} | overrides))


def test_mla_model_refuses_another_cache_class():
    from attnbook.quantized_cache import QuantizedKVCache

    with pytest.raises(ValueError, match="LatentCache"):
        cache_gpt(attention="mla", d_latent=6).new_kv_cache(
            cache_class=QuantizedKVCache
        )


# ---- the training script ----------------------------------------------------


def test_training_script_is_reproducible(tmp_path, monkeypatch, capsys):
    """Two short runs with the same seed write identical weights; the loss goes
    down."""
    args = [
        "--steps",
        "6",
        "--batch-size",
        "2",
        "--context-length",
        "32",
        "--d-model",
        "16",
        "--n-layers",
        "1",
        "--n-heads",
        "2",
        "--eval-every",
        "3",
        "--eval-batches",
        "1",
        "--warmup",
        "2",
        "--threads",
        "1",
    ]
    outputs = []
    threads, deterministic = (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
    )
    try:
        for name in ("a.pt", "b.pt"):
            monkeypatch.setattr(
                sys,
                "argv",
                ["train_gpt.py", *args, "--out", str(tmp_path / name)],
            )
            runpy.run_path(
                str(ROOT / "scripts" / "train_gpt.py"), run_name="__main__"
            )
            outputs.append(load_checkpoint(tmp_path / name))
    # the script sets these for its whole process, here the test session
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    (a, _, meta_a), (b, _, meta_b) = outputs
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    assert (
        meta_a["history"] == meta_b["history"] and len(meta_a["history"]) == 2
    )
    assert meta_a["history"][-1]["train_loss"] < math.log(a.config.vocab_size)
    assert "saved" in capsys.readouterr().out
