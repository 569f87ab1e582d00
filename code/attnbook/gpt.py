"""A tiny GPT: a decoder-only transformer built from the book's
:class:`MultiHeadAttention`.

Characters in, next-character logits out. Each block is pre-LayerNorm causal
self-attention followed by a pre-LayerNorm MLP, both added to the residual
stream (Radford et al. 2019); positions are learned absolute embeddings up to
``context_length``; the output head reuses the token embedding matrix (weight
tying, Press & Wolf 2017). The package ships weights trained by
``scripts/train_gpt.py`` on part of the King James Bible (see
``attnbook/data/README.md``); :func:`load_tiny_gpt` loads them.

Chapter 5 (multi-head attention) reads its heads; chapter 7 (masking) runs it
under other masks (``mask``, ``is_causal``); chapter 8 (the KV cache) shows
:meth:`TinyGPT.generate`; chapter 12 (grouped-query attention) converts it to
fewer key/value heads; chapter 16 (the delta rule) replaces some of its
attention layers by :class:`attnbook.delta.layer.DeltaLayer`
(``layer_types``); chapter 13 (latent attention and shared caches) trains
it with multi-head latent attention (``attention="mla"``) and with layers that
share keys and values (``kv_sources``); chapter 17 reads its attention.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from importlib import resources

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate
from .delta.layer import KINDS as DELTA_KINDS
from .delta.layer import DeltaLayer
from .kv_cache import ConcatKVCache, KVCache
from .latent import cache_size
from .latent.mla import MultiHeadLatentAttention, check_mla_sizes
from .latent.shared_attention import SharedKVAttention
from .multihead import MultiHeadAttention

WEIGHTS_FILE = "tiny_gpt.pt"
TEXT_FILE = "kjv.txt"


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`TinyGPT`. ``n_kv_heads=None`` means one key/value
    head per query head: the config then holds ``n_kv_heads = n_heads``.

    ``attention``: ``"mha"`` (:class:`MultiHeadAttention`, grouped by
    ``n_kv_heads``) or ``"mla"`` (:class:`MultiHeadLatentAttention` with a
    latent of ``d_latent`` and a rotary key of ``d_rope`` numbers per token).
    ``kv_sources``: for each layer, the layer whose keys and values it
    attends with (itself, or an earlier layer that makes its own, as in
    :func:`attnbook.latent.sharing.cla_sources`); None: every layer its own.
    """

    vocab_size: int
    context_length: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_model: int = 96
    # one entry per layer: "attention" (softmax) or a DeltaLayer kind
    # ("linear", "decay", "delta", "gated_delta", "kda"); None: all softmax
    layer_types: tuple[str, ...] | None = None
    attention: str = "mha"
    d_latent: int | None = None
    d_rope: int = 0
    kv_sources: tuple[int, ...] | None = None

    def __post_init__(self):
        for name in (
            "vocab_size",
            "context_length",
            "n_layers",
            "n_heads",
            "d_model",
        ):
            _validate.positive_int(name, getattr(self, name))
        if self.n_kv_heads is None:
            # frozen: set once, here
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            unknown = set(types) - {"attention", *DELTA_KINDS}
            if len(types) != self.n_layers or unknown:
                raise ValueError(
                    "layer_types must name one of "
                    f"{['attention', *DELTA_KINDS]}"
                    f" for each of the n_layers={self.n_layers} layers; got "
                    f"{types}"
                )
            object.__setattr__(self, "layer_types", types)
        self._check_attention()
        if self.kv_sources is not None:
            object.__setattr__(
                self, "kv_sources", check_kv_sources(self, self.kv_sources)
            )

    def _check_attention(self) -> None:
        """Raise unless ``attention``, ``d_latent`` and ``d_rope`` fit."""
        if self.attention not in ("mha", "mla"):
            raise ValueError(
                f"attention must be 'mha' or 'mla'; got {self.attention!r}"
            )
        if self.attention == "mha":
            if self.d_latent is not None or self.d_rope:
                raise ValueError(
                    "d_latent and d_rope belong to attention='mla'; got "
                    f"d_latent={self.d_latent}, d_rope={self.d_rope} with "
                    "attention='mha'"
                )
            return
        if self.n_kv_heads != self.n_heads:
            raise ValueError(
                "attention='mla' caches a latent, not key/value heads: leave "
                f"n_kv_heads None; got n_kv_heads={self.n_kv_heads}"
            )
        check_mla_sizes(
            self.d_model,
            self.n_heads,
            self.d_latent,
            self.d_rope,
            None,
            None,
            None,
        )

    @property
    def sources(self) -> tuple[int, ...]:
        """``kv_sources``, or every layer its own source when None."""
        return self.kv_sources or tuple(range(self.n_layers))


def check_kv_sources(config: GPTConfig, kv_sources) -> tuple[int, ...]:
    """Raise unless ``kv_sources`` names, for each layer, itself or an earlier
    layer that makes its own keys and values; return it as a tuple."""
    sources = tuple(kv_sources)
    n = config.n_layers
    if len(sources) != n or not all(
        isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= i
        for i, s in enumerate(sources)
    ):
        raise ValueError(
            f"kv_sources must give each of the n_layers={n} layers itself or "
            f"an earlier layer; got {sources}"
        )
    reused = sorted({s for s in sources if sources[s] != s})
    if reused:
        raise ValueError(
            f"kv_sources: layers {reused} share another layer's keys and "
            f"values and have none of their own to give; got {sources}"
        )
    if any(s != i for i, s in enumerate(sources)) and (
        config.attention != "mha"
        or set(config.layer_types or ("attention",)) != {"attention"}
    ):
        raise ValueError(
            "layers can share keys and values only in a model of softmax "
            "attention layers (attention='mha', no layer_types other than "
            f"'attention'); got attention={config.attention!r}, "
            f"layer_types={config.layer_types}"
        )
    return sources


def cache_layers(config: GPTConfig) -> list:
    """What each layer of a :class:`TinyGPT` of ``config`` caches per token,
    as :mod:`attnbook.latent.cache_size` counts it: keys and values of
    ``n_kv_heads`` heads, a latent and a rotary key, nothing for a layer
    that shares an earlier layer's, nothing per token for a recurrent layer
    (its state has a fixed size)."""
    types = config.layer_types or ("attention",) * config.n_layers
    d_head = config.d_model // config.n_heads
    layers = []
    for i, (kind, source) in enumerate(zip(types, config.sources)):
        if kind != "attention":
            layers.append(cache_size.LayerFootprint("state", 0))
        elif source != i:
            layers.append(cache_size.shared_layer())
        elif config.attention == "mla":
            layers.append(
                cache_size.latent_layer(config.d_latent, config.d_rope)
            )
        else:
            layers.append(cache_size.kv_layer(config.n_kv_heads, d_head))
    return layers


def cache_bytes_per_token(
    config: GPTConfig, bytes_per_element: float = 2
) -> float:
    """Bytes that one token adds to the caches of all layers of a
    :class:`TinyGPT` of ``config`` (2 bytes a number: bf16)."""
    return cache_size.bytes_per_token(cache_layers(config), bytes_per_element)


class CharTokenizer:
    """Character-level tokenizer: token ``i`` is the character ``vocab[i]``."""

    def __init__(self, vocab: str):
        if len(set(vocab)) != len(vocab):
            raise ValueError("vocab must not repeat a character")
        self.vocab = vocab
        self._index = {ch: i for i, ch in enumerate(vocab)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """The tokenizer whose vocabulary is the sorted set of characters of
        ``text``."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - self._index.keys())
        if unknown:
            raise ValueError(
                f"characters not in the vocabulary: {''.join(unknown)!r}"
            )
        return [self._index[ch] for ch in text]

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


class Block(nn.Module):
    """One transformer block: x + attn(LN(x)), then x + mlp(LN(x)). x: (batch,
    n, d_model)."""

    def __init__(
        self,
        config: GPTConfig,
        use_sdpa: bool = True,
        layer_type: str = "attention",
        shares_kv: bool = False,
    ):
        super().__init__()
        d = config.d_model
        self.ln_1 = nn.LayerNorm(d)
        if shares_kv:  # attends with an earlier layer's keys and values
            self.attn = SharedKVAttention(
                d, config.n_heads, config.n_kv_heads, use_sdpa=use_sdpa
            )
        elif layer_type == "attention" and config.attention == "mla":
            self.attn = MultiHeadLatentAttention(
                d, config.n_heads, config.d_latent, config.d_rope
            )
        elif layer_type == "attention":
            self.attn = MultiHeadAttention(
                d, config.n_heads, config.n_kv_heads, use_sdpa=use_sdpa
            )
        else:  # a sibling layer with a recurrent state (chapter 16)
            self.attn = DeltaLayer(d, config.n_heads, layer_type)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)
        )

    def forward(
        self,
        x,
        kv_cache: KVCache | None = None,
        mask=None,
        is_causal: bool = True,
    ):
        """x: (batch, n, d_model); ``mask``, ``is_causal`` as in
        :class:`MultiHeadAttention`."""
        x = x + self.attn(
            self.ln_1(x), mask=mask, is_causal=is_causal, kv_cache=kv_cache
        )
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Decoder-only transformer over token ids: (batch, n) -> logits (batch, n,
    vocab_size)."""

    def __init__(self, config: GPTConfig, use_sdpa: bool = True):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.context_length, config.d_model)
        types = config.layer_types or ("attention",) * config.n_layers
        self.blocks = nn.ModuleList(
            Block(config, use_sdpa, layer_type, source != i)
            for i, (layer_type, source) in enumerate(
                zip(types, config.sources)
            )
        )
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # weight tying: one matrix in and out
        self.head.weight = self.tok_emb.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), residual outputs shrunk by
        1/sqrt(2 n_layers)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for layer in (block.attn.out_proj, block.mlp[2]):
                nn.init.normal_(
                    layer.weight,
                    std=0.02 / math.sqrt(2 * self.config.n_layers),
                )

    def forward(
        self,
        ids,
        kv_cache: list[KVCache] | None = None,
        start_pos: int = 0,
        mask=None,
        is_causal: bool = True,
        positions=None,
    ):
        """Next-token logits for every position of ``ids``.

        ids: (batch, n) int64 token ids in columns ``start_pos .. start_pos + n
        - 1``;
        kv_cache: one :class:`KVCache` per layer (from :meth:`new_kv_cache`)
        holding the ``start_pos`` earlier columns; the new keys and values are
        appended to it.
        mask: bool, broadcastable to (batch, n_heads, n, n_k), True = may
        attend, used in every layer; is_causal: also hide later columns (the
        default; chapter 7 turns it off to run the model under other masks).
        positions: (batch, n) or (n,) int64, the position whose embedding each
        token gets; default its column, ``start_pos + arange(n)``. Returns
        (batch, n, vocab_size).
        """
        n = self._check_forward(ids, kv_cache, start_pos, positions)
        if positions is None:
            positions = torch.arange(
                start_pos, start_pos + n, device=ids.device
            )
        # (batch, n, d_model)
        x = self.tok_emb(ids) + self.pos_emb(positions)
        for block, cache in zip(self.blocks, self.layer_caches(kv_cache)):
            x = block(x, cache, mask, is_causal)
        # (batch, n, vocab_size)
        return self.head(self.ln_f(x))

    def layer_caches(self, kv_cache) -> list:
        """The cache each layer attends with: ``kv_cache[i]``, or None without
        caches; a layer that shares keys and values (``config.kv_sources``)
        gets its source layer's, made for one pass when ``kv_cache`` is None
        (a :class:`attnbook.kv_cache.ConcatKVCache`, through which gradients
        flow)."""
        sources = self.config.sources
        if kv_cache is None:
            if sources == tuple(range(len(sources))):
                return [None] * len(sources)
            kv_cache = [ConcatKVCache() for _ in sources]
        return [kv_cache[source] for source in sources]

    def _check_forward(
        self, ids, kv_cache, start_pos: int, positions=None
    ) -> int:
        cfg = self.config
        if ids.ndim != 2 or ids.dtype != torch.long:
            raise ValueError(
                f"ids must be an int64 tensor (batch, n); got {ids.dtype} "
                f"{tuple(ids.shape)}"
            )
        n = ids.shape[1]
        start_pos = _validate.nonnegative_int("start_pos", start_pos)
        if n == 0 or start_pos + n > cfg.context_length:
            raise ValueError(
                f"positions {start_pos}..{start_pos + n - 1} do not fit "
                "context_length="
                f"{cfg.context_length} (ids of shape {tuple(ids.shape)})"
            )
        if (
            ids.numel()
            and _validate.sync_checks_enabled()
            and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size)
        ):
            raise ValueError(
                f"token ids must lie in [0, {cfg.vocab_size}); got "
                f"{int(ids.min())}..{int(ids.max())}"
            )
        if kv_cache is not None:
            if len(kv_cache) != cfg.n_layers:
                raise ValueError(
                    f"kv_cache needs one KVCache per layer ({cfg.n_layers}); "
                    f"got {len(kv_cache)}"
                )
            lengths = {c.length for c in kv_cache}
            if lengths != {start_pos}:
                raise ValueError(
                    f"start_pos={start_pos} must equal the number of cached "
                    "positions; "
                    f"the caches hold {sorted(lengths)}"
                )
        if positions is not None:
            self._check_positions(positions, ids)
        return n

    def _check_positions(self, positions, ids) -> None:
        """Raise unless ``positions`` is int64 of shape (batch, n) or (n,) with
        values in the table."""
        if (
            not isinstance(positions, torch.Tensor)
            or positions.dtype != torch.long
        ):
            raise ValueError(
                "positions must be an int64 tensor; got "
                f"{type(positions).__name__} "
                f"{getattr(positions, 'dtype', '')}"
            )
        if tuple(positions.shape) not in (tuple(ids.shape), (ids.shape[1],)):
            raise ValueError(
                f"positions must have the shape of ids {tuple(ids.shape)} or "
                f"({ids.shape[1]},); "
                f"got {tuple(positions.shape)}"
            )
        if _validate.sync_checks_enabled() and (
            int(positions.min()) < 0
            or int(positions.max()) >= self.config.context_length
        ):
            raise ValueError(
                f"positions must lie in [0, {self.config.context_length}) "
                "(context_length); "
                f"got {int(positions.min())}..{int(positions.max())}"
            )

    def _check_generate(self, ids, max_new_tokens, temperature) -> int:
        """Raise unless :meth:`generate` can run; return the length of its
        result."""
        max_new_tokens = _validate.positive_int(
            "max_new_tokens", max_new_tokens
        )
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {temperature}")
        if ids.ndim != 2:
            raise ValueError(
                f"ids must have shape (batch, n); got {tuple(ids.shape)}"
            )
        total = ids.shape[1] + max_new_tokens
        # The last new token is returned, never fed back: the model sees at
        # most total - 1 positions.
        if total - 1 > self.config.context_length:
            raise ValueError(
                f"prompt length {ids.shape[1]} + max_new_tokens "
                f"{max_new_tokens} = {total} "
                "exceeds context_length + 1 = "
                f"{self.config.context_length + 1}"
            )
        return total

    def new_kv_cache(
        self,
        batch: int = 1,
        max_len: int | None = None,
        cache_class=KVCache,
        **options,
    ) -> list:
        """Empty caches, one per layer, for ``max_len`` positions (default
        ``context_length``).

        ``cache_class`` is :class:`KVCache` or a class with its constructor and
        ``update`` (e.g. :class:`attnbook.quantized_cache.QuantizedKVCache`),
        given ``options`` too. A layer that shares keys and values gets its
        source layer's cache (the same object); a latent-attention layer a
        :class:`attnbook.latent.latent_cache.LatentCache` (``cache_class`` must
        then be :class:`KVCache`).
        """
        cfg = self.config
        max_len = (
            cfg.context_length
            if max_len is None
            else _validate.positive_int("max_len", max_len)
        )
        if max_len > cfg.context_length:
            raise ValueError(
                f"max_len={max_len} exceeds "
                f"context_length={cfg.context_length}: "
                "there are no position embeddings beyond it"
            )
        weight = self.tok_emb.weight
        if cfg.attention == "mla":
            if cache_class is not KVCache or options:
                raise ValueError(
                    "attention='mla' caches latents in a LatentCache; got "
                    f"cache_class={cache_class.__name__}, options {options}"
                )
        caches = []
        for i, (block, source) in enumerate(zip(self.blocks, cfg.sources)):
            if source != i:  # reuses an earlier layer's cache
                caches.append(caches[source])
                continue
            if isinstance(block.attn, MultiHeadLatentAttention):
                caches.append(block.attn.new_cache(batch, max_len))
                continue
            caches.append(
                cache_class(
                    batch,
                    cfg.n_kv_heads,
                    max_len,
                    cfg.d_model // cfg.n_heads,
                    dtype=weight.dtype,
                    device=weight.device,
                    **options,
                )
            )
        return caches

    @torch.no_grad()
    def generate(
        self,
        ids,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        use_cache: bool = True,
        seed: int | None = None,
    ):
        """Continue ``ids`` (batch, n) by ``max_new_tokens`` tokens; returns
        (batch, n + max_new_tokens).

        ``temperature=0`` is greedy decoding (always the most likely token);
        otherwise tokens are sampled from ``softmax(logits / temperature)``,
        restricted to the ``top_k`` most likely when given, with a generator
        seeded by ``seed``. ``use_cache=False`` recomputes the whole prefix for
        every new token; with the cache each step feeds only the newest token.
        """
        # prompt + new tokens
        total = self._check_generate(ids, max_new_tokens, temperature)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=ids.device).manual_seed(seed)
        cache = (
            self.new_kv_cache(ids.shape[0], max(total - 1, ids.shape[1]))
            if use_cache
            else None
        )
        # (batch, vocab_size)
        logits = self(ids, cache)[:, -1]
        for _ in range(max_new_tokens):
            # (batch, 1)
            next_id = _pick(logits, temperature, top_k, generator)
            ids = torch.cat([ids, next_id], dim=1)
            if ids.shape[1] == total:
                break
            # only the new token goes in; the past is in the cache
            if use_cache:
                logits = self(next_id, cache, start_pos=ids.shape[1] - 1)[
                    :, -1
                ]
            else:  # recompute everything
                logits = self(ids)[:, -1]
        return ids


def _pick(
    logits, temperature: float, top_k: int | None, generator
) -> torch.Tensor:
    """Next token from logits (batch, vocab): greedy at temperature 0, else
    sampled."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[
            :, -1:
        ]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


def train_val_split(tokens, chunk_len: int = 8192, val_every: int = 10):
    """Split a 1-D token tensor into (train, val): every ``val_every``-th chunk
    is held out.

    Chunks of ``chunk_len`` tokens spread the validation text over the whole
    corpus (all books), instead of holding out only its end.
    """
    chunks = torch.split(tokens, chunk_len)
    val = [c for i, c in enumerate(chunks) if i % val_every == val_every - 1]
    train = [c for i, c in enumerate(chunks) if i % val_every != val_every - 1]
    return torch.cat(train), torch.cat(val)


def text_windows(tokens, starts, length: int):
    """Inputs and next-token targets of the windows of ``tokens`` beginning at
    ``starts``.

    tokens: (n_tokens,) int64; starts: (b,) int64. Returns ``(x, y)``, each (b,
    length), where ``y[i, t] = x[i, t + 1]`` within the text.
    """
    starts = torch.as_tensor(starts)
    # (b, length + 1)
    offsets = starts[:, None] + torch.arange(length + 1)
    if int(offsets.max()) >= len(tokens) or int(starts.min()) < 0:
        raise ValueError(
            f"windows of length {length} + 1 starting at "
            f"{int(starts.min())}..{int(starts.max())} "
            f"do not fit in {len(tokens)} tokens"
        )
    chunk = tokens[offsets]
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def window_loss(model, tokens, starts, length: int, batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats per token) of ``model`` over the
    windows at ``starts``.

    The model runs in eval mode (its previous mode is restored), ``batch``
    windows at a time.
    """
    was_training = model.training
    model.eval()
    total = 0.0
    for chunk in torch.as_tensor(starts).split(
        _validate.positive_int("batch", batch)
    ):
        x, y = text_windows(tokens, chunk, length)
        total += F.cross_entropy(
            model(x).flatten(0, 1), y.flatten(), reduction="sum"
        ).item()
    model.train(was_training)
    return total / (len(starts) * length)


def training_step(
    model,
    optimizer,
    tokens,
    starts,
    length: int,
    lr: float,
    max_grad_norm: float = 1.0,
) -> float:
    """One optimiser step of next-token prediction on the windows of ``tokens``
    at ``starts``.

    Sets every parameter group's learning rate to ``lr``, clips the gradients
    to norm ``max_grad_norm``, and returns the step's mean cross-entropy (nats
    per token).
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    x, y = text_windows(tokens, starts, length)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


def load_training_text() -> str:
    """The text the tiny GPT was trained on (see
    ``attnbook/data/README.md``)."""
    return (
        resources.files("attnbook")
        .joinpath("data")
        .joinpath(TEXT_FILE)
        .read_text(encoding="utf-8")
    )


def save_checkpoint(
    path, model: TinyGPT, tokenizer: CharTokenizer, meta: dict | None = None
) -> None:
    """Write config, vocabulary, float32 weights and training notes to ``path``
    (torch.save)."""
    state = {
        k: v.detach().to("cpu", torch.float32).clone()
        for k, v in model.state_dict().items()
        # tied to tok_emb.weight: stored once
        if k != "head.weight"
    }
    torch.save(
        {
            "config": asdict(model.config),
            "vocab": tokenizer.vocab,
            "state_dict": state,
            "meta": dict(meta or {}),
        },
        path,
    )


def load_checkpoint(
    file, use_sdpa: bool = True
) -> tuple[TinyGPT, CharTokenizer, dict]:
    """Read what :func:`save_checkpoint` wrote; returns ``(model in eval mode,
    tokenizer, meta)``."""
    ckpt = torch.load(file, map_location="cpu", weights_only=True)
    model = TinyGPT(GPTConfig(**ckpt["config"]), use_sdpa=use_sdpa)
    missing, unexpected = model.load_state_dict(
        ckpt["state_dict"], strict=False
    )
    if unexpected or set(missing) != {"head.weight"}:
        raise ValueError(
            f"checkpoint does not match the model: missing {missing}, "
            f"unexpected {unexpected}"
        )
    return model.eval(), CharTokenizer(ckpt["vocab"]), ckpt["meta"]


def load_tiny_gpt(use_sdpa: bool = True) -> tuple[TinyGPT, CharTokenizer]:
    """The book's trained tiny GPT and its tokenizer, from the package data, in
    eval mode."""
    with (
        resources.files("attnbook")
        .joinpath("data")
        .joinpath(WEIGHTS_FILE)
        .open("rb") as f
    ):
        model, tokenizer, _ = load_checkpoint(f, use_sdpa=use_sdpa)
    return model, tokenizer
