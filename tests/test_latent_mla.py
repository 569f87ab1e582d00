"""Multi-head latent attention (attnbook.latent.mla) against transformers'
DeepseekV3Attention, against itself (the absorbed path against the
decompressed one), and against MultiHeadAttention, the layer it generalises.

The reference is ``DeepseekV3Attention`` of the pinned transformers, built
from a small ``DeepseekV3Config`` at random initialisation, in float64, with
the ``sdpa`` attention (its ``eager`` attention takes the softmax in float32).
Its RMSNorm also computes in float32 whatever the input: the fixture
``float64_norm`` runs the same formula without that cast, so that the two
agree to rounding in float64; one test keeps the cast and allows for it. Its
rotary cos/sin are computed here in float64 with DeepSeek's frequency formula
(``inv_freq = 1 / base ** (arange(0, d, 2) / d)``); one test checks that the
module's own (float32) rotary embedding gives the same.
"""

import pytest
import torch

# DeepSeek-V3, Gemma 3n and Gemma 4 are in transformers 5 (the minimum
# environment of `make test-minimum` has 4.38, without them)
transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek  # noqa: E402

from attnbook.kv_cache import KVCache  # noqa: E402
from attnbook.latent.latent_cache import LatentCache  # noqa: E402
from attnbook.latent.mla import MultiHeadLatentAttention, from_deepseek  # noqa: E402
from attnbook.multihead import MultiHeadAttention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D_MODEL, N_HEADS, D_LATENT, D_ROPE, D_NOPE, D_V = 32, 4, 12, 4, 6, 5
PREFILL, TOTAL = 5, 8
# float64 rounding on values of order 1
EXACT = 1e-12


def deepseek_config(q_lora_rank=16, rope_interleave=True):
    return transformers.DeepseekV3Config(
        hidden_size=D_MODEL,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=D_LATENT,
        qk_rope_head_dim=D_ROPE,
        qk_nope_head_dim=D_NOPE,
        v_head_dim=D_V,
        head_dim=D_ROPE,
        num_hidden_layers=1,
        rope_interleave=rope_interleave,
        attn_implementation="sdpa",
    )


def reference(seed=0, **config):
    """A DeepseekV3Attention in float64 with every weight random (its norms'
    scales too)."""
    torch.manual_seed(seed)
    cfg = deepseek_config(**config)
    attention = deepseek.DeepseekV3Attention(cfg, layer_idx=0).double()
    with torch.no_grad():
        for p in attention.parameters():
            p.normal_(0.0, 0.3)
    return attention


def rotary(config, positions):
    """DeepSeek's cos/sin for ``positions``, in float64: (1, n, d_rope)."""
    d, base = config.qk_rope_head_dim, config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.to(torch.float64)[:, None] * inv_freq
    both = torch.cat([angles, angles], dim=-1)[None]
    return both.cos(), both.sin()


@pytest.fixture
def float64_norm(monkeypatch):
    """DeepseekV3RMSNorm's formula, in the input's dtype."""

    def forward(self, x):
        rms = torch.rsqrt(
            x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon
        )
        return self.weight * (x * rms)

    monkeypatch.setattr(deepseek.DeepseekV3RMSNorm, "forward", forward)


def tokens(seed=1, batch=2, n=TOTAL):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, n, D_MODEL, generator=g, dtype=torch.float64)


def run_reference(attention, x):
    """Prefill of PREFILL tokens, then one token at a time, with transformers'
    cache: the outputs, (b, n, d_model) and TOTAL - PREFILL of (b, 1,
    d_model)."""
    cfg = attention.config
    cache = DynamicCache(config=cfg)
    causal = torch.ones(PREFILL, PREFILL, dtype=torch.bool).tril()[None, None]
    first, _ = attention(
        x[:, :PREFILL],
        rotary(cfg, torch.arange(PREFILL)),
        causal,
        past_key_values=cache,
    )
    steps = [
        attention(
            x[:, t : t + 1],
            rotary(cfg, torch.tensor([t])),
            None,
            past_key_values=cache,
        )[0]
        for t in range(PREFILL, TOTAL)
    ]
    return first, steps


def run_ours(layer, x, absorb=None):
    cache = layer.new_cache(x.shape[0], TOTAL)
    first = layer(x[:, :PREFILL], is_causal=True, kv_cache=cache)
    steps = [
        layer(x[:, t : t + 1], kv_cache=cache, absorb=absorb)
        for t in range(PREFILL, TOTAL)
    ]
    return first, steps


@pytest.mark.parametrize("q_lora_rank", [16, None])
@pytest.mark.parametrize("rope_interleave", [True, False])
def test_prefill_and_decode_match_deepseek_v3(
    float64_norm, q_lora_rank, rope_interleave
):
    attention = reference(
        q_lora_rank=q_lora_rank, rope_interleave=rope_interleave
    )
    layer = from_deepseek(attention)
    x = tokens()
    with torch.no_grad():
        want_first, want_steps = run_reference(attention, x)
        got_first, got_steps = run_ours(layer, x)
    torch.testing.assert_close(got_first, want_first, rtol=0, atol=EXACT)
    for got, want in zip(got_steps, want_steps):
        torch.testing.assert_close(got, want, rtol=0, atol=EXACT)


def test_the_full_prompt_matches_deepseek_v3_without_a_cache(float64_norm):
    attention = reference(seed=3)
    layer = from_deepseek(attention)
    x = tokens(seed=4, n=TOTAL)
    causal = torch.ones(TOTAL, TOTAL, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        want, _ = attention(
            x, rotary(attention.config, torch.arange(TOTAL)), causal
        )
        got = layer(x, is_causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=EXACT)


def test_unpatched_deepseek_v3_agrees_to_its_float32_norm():
    """As transformers ships it, the module normalises the latents in float32
    (relative error about 6e-8), and computes its rotary table in float32."""
    attention = reference(seed=5)
    layer = from_deepseek(attention)
    x = tokens(seed=6)
    cfg = attention.config
    rope = deepseek.DeepseekV3RotaryEmbedding(cfg)
    positions = torch.arange(TOTAL)[None]
    cos, sin = rope(x, positions)
    want_cos, want_sin = rotary(cfg, torch.arange(TOTAL))
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=1e-6)
    causal = torch.ones(TOTAL, TOTAL, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        want, _ = attention(x, (cos, sin), causal)
        got = layer(x, is_causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_deepseek_caches_what_ours_caches(float64_norm):
    """transformers' cache holds the normalised latent and the rotated
    rotary key, as LatentCache does (its rotary key in the half layout:
    rope_interleave=False)."""
    attention = reference(seed=7, rope_interleave=False)
    layer = from_deepseek(attention)
    x = tokens(seed=8)
    cache = DynamicCache(config=attention.config)
    ours = layer.new_cache(2, TOTAL)
    causal = torch.ones(TOTAL, TOTAL, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        attention(
            x,
            rotary(attention.config, torch.arange(TOTAL)),
            causal,
            past_key_values=cache,
        )
        layer(x, is_causal=True, kv_cache=ours)
    latents, rope_keys = cache.layers[0].keys, cache.layers[0].values
    torch.testing.assert_close(ours.latents, latents, rtol=0, atol=EXACT)
    torch.testing.assert_close(ours.rope_keys, rope_keys, rtol=0, atol=EXACT)


@pytest.mark.parametrize("q_latent", [None, 8])
def test_absorbed_decoding_equals_decompressed(q_latent):
    torch.manual_seed(11)
    layer = MultiHeadLatentAttention(
        D_MODEL,
        N_HEADS,
        D_LATENT,
        D_ROPE,
        D_NOPE,
        D_V,
        q_latent=q_latent,
    ).double()
    x = tokens(seed=12)
    with torch.no_grad():
        _, absorbed = run_ours(layer, x, absorb=True)
        _, decompressed = run_ours(layer, x, absorb=False)
        # a whole causal prompt through either path
        whole = [layer(x, is_causal=True, absorb=a) for a in (True, False)]
    for a, d in zip(absorbed, decompressed):
        torch.testing.assert_close(a, d, rtol=0, atol=1e-10)
    torch.testing.assert_close(whole[0], whole[1], rtol=0, atol=1e-10)


def test_decoding_with_a_cache_equals_the_whole_prompt():
    torch.manual_seed(13)
    layer = MultiHeadLatentAttention(
        D_MODEL, N_HEADS, D_LATENT, D_ROPE, q_latent=8
    ).double()
    x = tokens(seed=14)
    with torch.no_grad():
        whole = layer(x, is_causal=True)
        first, steps = run_ours(layer, x)
    got = torch.cat([first] + steps, dim=1)
    torch.testing.assert_close(got, whole, rtol=0, atol=1e-10)


def mla_as_mha(mha: MultiHeadAttention) -> MultiHeadLatentAttention:
    """MLA with W_DKV = I (the latent is the token), no rotary key and no
    norm, the up-projections being MHA's key and value projections."""
    d = mha.d_model
    layer = MultiHeadLatentAttention(
        d, mha.n_heads, d_latent=d, d_rope=0, latent_norm=False
    ).double()
    with torch.no_grad():
        layer.kv_down.weight.copy_(torch.eye(d, dtype=torch.float64))
        layer.q_proj.weight.copy_(mha.q_proj.weight)
        layer.k_up.weight.copy_(mha.k_proj.weight)
        layer.v_up.weight.copy_(mha.v_proj.weight)
        layer.out_proj.weight.copy_(mha.out_proj.weight)
    return layer


@pytest.mark.parametrize("absorb", [False, True])
def test_identity_down_projection_without_rotary_key_is_mha(absorb):
    torch.manual_seed(15)
    mha = MultiHeadAttention(16, 4).double()
    layer = mla_as_mha(mha)
    x = tokens(seed=16)[..., :16]
    mask = torch.rand(2, 1, TOTAL, TOTAL) > 0.3
    mask |= torch.eye(TOTAL, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(
            layer(x, is_causal=True, absorb=absorb),
            mha(x, is_causal=True),
            rtol=0,
            atol=EXACT,
        )
        torch.testing.assert_close(
            layer(x, mask=mask, absorb=absorb),
            mha(x, mask=mask),
            rtol=0,
            atol=EXACT,
        )
        # with their caches, prompt then decoding
        kv = KVCache(2, 4, TOTAL, 4, dtype=torch.float64)
        latent = layer.new_cache(2, TOTAL)
        for chunk in (
            slice(0, PREFILL),
            *(slice(t, t + 1) for t in (5, 6, 7)),
        ):
            torch.testing.assert_close(
                layer(x[:, chunk], is_causal=True, kv_cache=latent),
                mha(x[:, chunk], is_causal=True, kv_cache=kv),
                rtol=0,
                atol=EXACT,
            )


def test_cross_attention_without_rotary_key_is_mha():
    torch.manual_seed(17)
    mha = MultiHeadAttention(16, 4).double()
    layer = mla_as_mha(mha)
    x, context = tokens(seed=18)[..., :16], tokens(seed=19, n=3)[..., :16]
    with torch.no_grad():
        torch.testing.assert_close(
            layer(x, context), mha(x, context), rtol=0, atol=EXACT
        )


@pytest.mark.parametrize(
    "arguments, named",
    [
        (
            {"d_latent": 0},
            "d_latent (d_c, the latent size) must be a positive",
        ),
        ({"d_latent": -3}, "got -3"),
        ({"d_rope": 3}, "d_rope=3"),
        ({"d_rope": -2}, "d_rope must be a non-negative integer; got -2"),
        ({"q_latent": 0}, "q_latent must be a positive integer; got 0"),
        ({"rope_layout": "pairs"}, "'pairs'"),
    ],
)
def test_bad_sizes_are_named(arguments, named):
    sizes = {"d_model": 16, "n_heads": 4, "d_latent": 8, "d_rope": 4}
    with pytest.raises(
        ValueError, match=named.replace("(", r"\(").replace(")", r"\)")
    ):
        MultiHeadLatentAttention(**(sizes | arguments))


def test_a_cache_of_another_layer_type_is_refused():
    layer = MultiHeadLatentAttention(16, 4, d_latent=8, d_rope=4)
    x = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match="must be a LatentCache.*got KVCache"):
        layer(x, kv_cache=KVCache(2, 4, 8, 4))
    wrong = LatentCache(2, 8, d_latent=6, d_rope=4)
    with pytest.raises(
        ValueError, match=r"\(2, 1, 8, 4\); got \(2, 1, 6, 4\)"
    ):
        layer(x, kv_cache=wrong)
    # nothing was appended by the refused calls
    assert wrong.length == 0


def test_a_rotary_key_refuses_a_context():
    layer = MultiHeadLatentAttention(16, 4, d_latent=8, d_rope=4)
    with pytest.raises(ValueError, match="d_rope=4"):
        layer(torch.randn(1, 2, 16), torch.randn(1, 3, 16))


def test_latent_cache_refuses_overflow_and_mismatched_shapes():
    cache = LatentCache(1, 3, d_latent=4, d_rope=2, dtype=torch.float64)
    latent, key = (
        torch.zeros(1, 1, 2, 4).double(),
        torch.zeros(1, 1, 2, 2).double(),
    )
    cache.update(latent, key)
    with pytest.raises(ValueError, match="max_len=3.*has 2.*2 more"):
        cache.update(latent, key)
    with pytest.raises(ValueError, match="rope_key must have shape"):
        cache.update(latent[:, :, :1], torch.zeros(1, 1, 1, 3).double())
    with pytest.raises(ValueError, match="same positions"):
        cache.update(latent[:, :, :1], key)
    assert cache.length == 2


def test_from_deepseek_refuses_scaled_rope():
    attention = reference(seed=21)
    attention.config.rope_parameters = dict(
        attention.config.rope_parameters, rope_type="yarn"
    )
    with pytest.raises(ValueError, match="got 'yarn'"):
        from_deepseek(attention)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_a_latent_as_wide_as_a_gqa_cache_contains_that_gqa(n_kv_heads):
    """Chapter 13's reading of its experiment: a latent of 2 * n_kv_heads *
    d_head numbers holds GQA's keys and values exactly. The down-projection
    stacks GQA's key and value projections; each head's up-projections pick
    its group's slice. Without the latent norm the two layers agree."""
    d_head = D_MODEL // N_HEADS
    group = N_HEADS // n_kv_heads
    d_latent = 2 * n_kv_heads * d_head
    with torch.random.fork_rng():
        torch.manual_seed(5)
        gqa = MultiHeadAttention(D_MODEL, N_HEADS, n_kv_heads).double()
        mla = MultiHeadLatentAttention(
            D_MODEL,
            N_HEADS,
            d_latent=d_latent,
            d_nope=d_head,
            d_v=d_head,
            latent_norm=False,
        ).double()
        x = torch.randn(2, 7, D_MODEL, dtype=torch.float64)
    # (n_heads * d_head, d_latent): head i reads key/value head i // group
    pick_k = torch.zeros(N_HEADS * d_head, d_latent, dtype=torch.float64)
    pick_v = torch.zeros_like(pick_k)
    eye = torch.eye(d_head, dtype=torch.float64)
    for i in range(N_HEADS):
        rows = slice(i * d_head, (i + 1) * d_head)
        g = i // group
        pick_k[rows, g * d_head : (g + 1) * d_head] = eye
        v0 = n_kv_heads * d_head + g * d_head
        pick_v[rows, v0 : v0 + d_head] = eye
    with torch.no_grad():
        mla.kv_down.weight.copy_(
            torch.cat([gqa.k_proj.weight, gqa.v_proj.weight])
        )
        mla.k_up.weight.copy_(pick_k)
        mla.v_up.weight.copy_(pick_v)
        mla.q_proj.weight.copy_(gqa.q_proj.weight)
        mla.out_proj.weight.copy_(gqa.out_proj.weight)
        got, want = mla(x, is_causal=True), gqa(x, is_causal=True)
    assert torch.allclose(got, want, rtol=0, atol=EXACT)
    # and the check is not vacuous: a wrong pick (each key slice moved by one
    # head) differs when there are several groups
    if n_kv_heads > 1:
        with torch.no_grad():
            mla.k_up.weight.copy_(pick_k.roll(d_head, dims=1))
            assert not torch.allclose(mla(x, is_causal=True), want, atol=1e-6)
