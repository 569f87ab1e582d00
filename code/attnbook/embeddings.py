"""Token embeddings: from text to tokens, to ids, to one vector per token.

The chain a transformer's input goes through, small enough to read:

* :func:`tokenize` splits text into word and punctuation tokens, and a
  :class:`Vocabulary` numbers them (``encode`` / ``decode``);
* :func:`embed` looks each id up in an embedding table ``E (V, d_model)``,
  which is the product of one-hot rows (:func:`one_hot`) with ``E``;
* :func:`cosine_similarity` compares vectors by direction.

To give the vectors meaning without downloading anything, the module also
learns *static* word vectors from co-occurrence counts
(:func:`cooccurrence_counts`, :func:`ppmi`, :func:`svd_embeddings`, tied
together by :func:`static_word_vectors`) on a small corpus it generates itself
(:func:`toy_corpus`), in which "bank" and "java" each occur in two senses.

Chapter 1 (token embeddings) shows these functions and builds static word
vectors with them.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable, Sequence

import numpy as np

from . import _validate

UNK = "<unk>"

# A token is a run of letters/digits/underscores (keeping an inner apostrophe,
# as in "don't"), or any single character that is neither a word character nor
# space (punctuation).
_TOKEN = re.compile(r"\w+(?:'\w+)*|[^\w\s]")


# --- text -> tokens -> ids ---------------------------------------------------


def tokenize(text: str) -> list[str]:
    """Lower-case ``text`` and split it into word and punctuation tokens.

    ``tokenize("The bank's loan, approved.") == ["the", "bank's", "loan", ",",
    "approved", "."]``
    """
    if not isinstance(text, str):
        raise ValueError(
            f"tokenize expects a string; got {type(text).__name__}"
        )
    return _TOKEN.findall(text.lower())


class Vocabulary:
    """A fixed list of token strings; a token's id is its position in the list.

    Id 0 is always ``"<unk>"``, the id every token outside the vocabulary gets.
    """

    def __init__(self, tokens: Sequence[str]):
        tokens = list(tokens)
        if not tokens or tokens[0] != UNK:
            raise ValueError(
                f"a vocabulary's first token must be {UNK!r}; got {tokens[:1]}"
            )
        if len(set(tokens)) != len(tokens):
            repeated = sorted(t for t, c in Counter(tokens).items() if c > 1)
            raise ValueError(
                f"a vocabulary lists each token once; repeated: {repeated}"
            )
        self.tokens = tuple(tokens)
        self._index = {t: i for i, t in enumerate(self.tokens)}

    @classmethod
    def from_texts(
        cls, texts: Iterable[str], min_count: int = 1
    ) -> "Vocabulary":
        """Every token seen at least ``min_count`` times, most frequent first
        (ties alphabetical)."""
        counts = Counter(t for text in texts for t in tokenize(text))
        kept = sorted(
            (t for t, c in counts.items() if c >= min_count and t != UNK),
            key=lambda t: (-counts[t], t),
        )
        return cls([UNK, *kept])

    def __len__(self) -> int:
        return len(self.tokens)

    def __contains__(self, token: str) -> bool:
        return token in self._index

    def id(self, token: str) -> int:
        """The id of one token; raises ``ValueError`` for a token outside the
        vocabulary."""
        if token not in self._index:
            raise ValueError(
                f"{token!r} is not in the vocabulary of {len(self)} tokens"
            )
        return self._index[token]

    def encode(self, text_or_tokens) -> np.ndarray:
        """Ids ``(n,)`` of a text (tokenized first) or of a list of tokens;
        unknown tokens -> 0."""
        tokens = (
            tokenize(text_or_tokens)
            if isinstance(text_or_tokens, str)
            else text_or_tokens
        )
        return np.array(
            [self._index.get(t, 0) for t in tokens], dtype=np.int64
        )

    def decode(self, ids) -> list[str]:
        """The tokens of ids ``(n,)``."""
        ids = _checked_ids(ids, len(self))
        return [self.tokens[i] for i in ids.ravel()]

    def __repr__(self) -> str:
        head = ", ".join(self.tokens[:6])
        return (
            f"Vocabulary(V={len(self)}: "
            f"{head}{', ...' if len(self) > 6 else ''})"
        )


# --- ids -> vectors --------------------------------------------------------


def _checked_ids(ids, vocab_size: int) -> np.ndarray:
    """``ids`` as an array of the platform's index type, or a ValueError naming
    the first id outside ``0..V-1``.

    The index type (``np.intp``) is what ``np.bincount`` counts and what
    indexing uses; it is 32 bits wide in the browser (Pyodide, wasm32), where
    ``np.bincount`` refuses int64 arrays."""
    ids = np.asarray(ids)
    if ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer):
        if ids.size == 0 and ids.dtype != bool:
            ids = ids.astype(np.int64)
        else:
            raise ValueError(
                f"token ids must be integers; got dtype {ids.dtype}"
            )
    bad = np.flatnonzero((ids.ravel() < 0) | (ids.ravel() >= vocab_size))
    if bad.size:
        where = np.unravel_index(bad[0], ids.shape)
        raise ValueError(
            f"token id {ids.ravel()[bad[0]]} at position "
            f"{tuple(int(i) for i in where)} is out of range "
            f"for a vocabulary of V={vocab_size} (valid ids are "
            f"0..{vocab_size - 1})"
        )
    return ids.astype(np.intp, copy=False)


def one_hot(ids, vocab_size: int) -> np.ndarray:
    """One-hot rows: ids ``(...,)`` -> ``(..., V)`` float64 with a single 1 per
    row, at the id."""
    vocab_size = _validate.positive_int("vocab_size", vocab_size)
    ids = _checked_ids(ids, vocab_size)
    return (ids[..., None] == np.arange(vocab_size)).astype(np.float64)


def embed(ids, table) -> np.ndarray:
    """Look up token ids in an embedding table.

    ids: (...,) integers in ``0..V-1``; table: (V, d_model). Returns (...,
    d_model), row ``ids[i]`` of the table for each token: the same as
    ``one_hot(ids, V) @ table`` without building the (..., V) one-hot matrix.
    """
    table = np.asarray(table)
    if table.ndim != 2:
        raise ValueError(
            "the embedding table must be 2-D (V, d_model); got shape "
            f"{table.shape}"
        )
    return table[_checked_ids(ids, table.shape[0])]


def embedding_grad(ids, grad_out, vocab_size: int) -> np.ndarray:
    """The gradient of a loss with respect to the embedding table, through the
    lookup :func:`embed`.

    ids: (...,) integers in ``0..V-1``, any shape (a sentence, a batch, none);
    grad_out: (..., d_model), the gradient with respect to the lookup's output
    ``X``. Returns (V, d_model) float64: row ``v`` is the sum of the rows of
    ``grad_out`` at the positions that hold ``v``, ``H^T G`` with ``H`` the
    one-hot rows, without building ``H``. A token that occurs twice collects
    both contributions (``np.add.at`` accumulates; ``grad[ids] += g`` would
    keep only one of them).
    """
    vocab_size = _validate.positive_int("vocab_size", vocab_size)
    ids = _checked_ids(ids, vocab_size)
    grad_out = np.asarray(grad_out)
    if grad_out.ndim != ids.ndim + 1 or grad_out.shape[:-1] != ids.shape:
        raise ValueError(
            f"grad_out must have shape ids.shape + (d_model,) = "
            f"{ids.shape} + (d_model,); got {grad_out.shape}"
        )
    grad = np.zeros((vocab_size, grad_out.shape[-1]))
    np.add.at(
        grad,
        ids.ravel(),
        grad_out.reshape(-1, grad_out.shape[-1]).astype(np.float64),
    )
    return grad


def cosine_similarity(a, b=None) -> np.ndarray:
    """Cosine of the angle between every row of ``a`` and every row of ``b``.

    a: (m, d), b: (n, d) (default ``b = a``) -> (m, n) with entry ``a_i . b_j /
    (|a_i| |b_j|)``. A 1-D argument counts as a single row and its axis is
    dropped from the result (two vectors give a scalar). A zero vector has no
    direction; its cosine with anything is defined here as 0.
    """
    a = np.asarray(a, dtype=np.float64)
    b = a if b is None else np.asarray(b, dtype=np.float64)
    for name, x in (("a", a), ("b", b)):
        if x.ndim not in (1, 2):
            raise ValueError(
                f"{name} must be a vector (d,) or a matrix of rows (m, d); "
                f"got shape {x.shape}"
            )
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(
            "a and b must have the same dimension d (last axis); got a "
            f"{a.shape} and b {b.shape}"
        )
    a2, b2 = np.atleast_2d(a), np.atleast_2d(b)
    out = _unit_rows(a2) @ _unit_rows(b2).T  # (m, n)
    # rounding can step just past +-1
    out = np.clip(out, -1.0, 1.0)
    if b.ndim == 1:
        out = out[:, 0]
    if a.ndim == 1:
        out = out[0]
    return out


def _unit_rows(x: np.ndarray) -> np.ndarray:
    """Each row divided by its Euclidean length; zero rows stay zero."""
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)


# --- static word vectors from co-occurrence counts ---------------------------


def cooccurrence_counts(
    sequences: Iterable, vocab_size: int, window: int = 2
) -> np.ndarray:
    """Symmetric co-occurrence counts ``(V, V)``.

    sequences: id arrays, one per sentence. Entry ``[w, c]`` counts the pairs
    of positions ``i != j`` in one sentence with ``|i - j| <= window``, token
    ``w`` at ``i`` and token ``c`` at ``j``. Sentences do not see each other.
    """
    window = _validate.positive_int("window", window)
    vocab_size = int(vocab_size)
    words, contexts = [], []
    for seq in sequences:
        seq = _checked_ids(seq, vocab_size).ravel()
        for offset in range(1, min(window, len(seq) - 1) + 1):
            # every pair of positions at this distance, in both directions
            words += [seq[:-offset], seq[offset:]]
            contexts += [seq[offset:], seq[:-offset]]
    if not words:
        return np.zeros((vocab_size, vocab_size))
    # flat index of [w, c]
    pairs = np.concatenate(words) * vocab_size + np.concatenate(contexts)
    return (
        np.bincount(pairs, minlength=vocab_size * vocab_size)
        .reshape(vocab_size, vocab_size)
        .astype(float)
    )


def ppmi(counts) -> np.ndarray:
    """Positive pointwise mutual information of a count matrix ``(V, V_c)``.

    ``PPMI[w, c] = max(0, log(p(w, c) / (p(w) p(c))))`` with ``p(w, c) = N[w,
    c] / N`` and the marginals the row and column sums over ``N``. Pairs never
    seen (``N[w, c] = 0``, log of 0) get 0, like all pairs seen less often than
    chance.
    """
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 2:
        raise ValueError(
            f"counts must be a 2-D matrix (V, V_c); got shape {counts.shape}"
        )
    if np.any(counts < 0) or not np.all(np.isfinite(counts)):
        raise ValueError("counts must be finite and non-negative")
    total = counts.sum()
    if total == 0:
        return np.zeros_like(counts)
    # N p(w) p(c)
    expected = np.outer(counts.sum(axis=1), counts.sum(axis=0)) / total
    ratio = np.divide(
        counts, expected, out=np.zeros_like(counts), where=counts > 0
    )
    with np.errstate(divide="ignore"):
        return np.maximum(
            np.log(ratio, out=np.full_like(ratio, -np.inf), where=ratio > 0),
            0.0,
        )


def svd_embeddings(matrix, d: int) -> np.ndarray:
    """Rows of the best rank-``d`` factor of ``matrix (V, V_c)``: ``U_d
    sqrt(Sigma_d)``, shape ``(V, d)``.

    ``matrix ~ U_d Sigma_d R_d^T`` (truncated SVD, Eckart-Young); splitting
    ``Sigma_d`` evenly between the two factors is the usual choice for word
    vectors. Each column's sign is fixed (its largest-magnitude entry
    positive), so the result does not depend on the LAPACK build.
    """
    matrix = np.asarray(matrix, dtype=np.float64)
    if matrix.ndim != 2:
        raise ValueError(f"matrix must be 2-D; got shape {matrix.shape}")
    d = _validate.int_in_range(
        "d",
        d,
        1,
        min(matrix.shape),
        f"an integer in 1..{min(matrix.shape)} for a matrix of shape "
        f"{matrix.shape}",
    )
    u, s, _ = np.linalg.svd(matrix, full_matrices=False)
    u = u[:, :d]
    signs = np.sign(u[np.argmax(np.abs(u), axis=0), np.arange(d)])
    return u * signs * np.sqrt(s[:d])


def static_word_vectors(
    texts: Sequence[str], d: int = 16, window: int = 2, min_count: int = 1
) -> tuple[Vocabulary, np.ndarray]:
    """Learn one vector per word from ``texts``: counts -> PPMI -> truncated
    SVD.

    Returns ``(vocab, table)`` with ``table (V, d)``; row 0 (``<unk>``) is
    zero.
    """
    # read twice: once for the vocabulary, once for counts
    texts = list(texts)
    vocab = Vocabulary.from_texts(texts, min_count=min_count)
    counts = cooccurrence_counts(
        (vocab.encode(t) for t in texts), len(vocab), window
    )
    # <unk> stands for many words: learn nothing from it
    counts[0, :] = counts[:, 0] = 0
    return vocab, svd_embeddings(ppmi(counts), d)


def nearest_neighbours(
    word: str,
    vocab: Vocabulary,
    table,
    k: int = 5,
    exclude: Iterable[str] = (UNK,),
) -> list[tuple[str, float]]:
    """The ``k`` words whose vectors have the largest cosine with ``word``'s,
    best first.

    Returns ``(word, cosine)`` pairs, the cosines rounded to 4 decimals for
    display.
    """
    # (V,)
    sims = cosine_similarity(embed(vocab.id(word), table), table)
    skip = {vocab.id(word)} | {vocab.id(t) for t in exclude if t in vocab}
    order = [i for i in np.argsort(-sims, kind="stable") if i not in skip]
    return [(vocab.tokens[i], round(float(sims[i]), 4)) for i in order[:k]]


def pca_project(x, k: int = 2) -> np.ndarray:
    """Coordinates ``(m, k)`` of the rows of ``x (m, d)`` on their ``k``
    principal axes.

    Centre the rows, take the SVD, keep the first ``k`` right singular vectors
    (sign fixed as in :func:`svd_embeddings`).
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or not 1 <= k <= min(x.shape):
        raise ValueError(
            "pca_project needs x (m, d) and 1 <= k <= min(m, d); got x "
            f"{x.shape}, k={k}"
        )
    centred = x - x.mean(axis=0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    axes = vt[:k].T  # (d, k)
    axes = axes * np.sign(axes[np.argmax(np.abs(axes), axis=0), np.arange(k)])
    return centred @ axes


# --- a corpus with two ambiguous words --------------------------------------

#: Topic -> (words that fill the slots, sentence templates). "bank" and "java"
#: are slot words of two topics each, so each has two senses in the corpus.
TOPICS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "river": (
        (
            "bank",
            "river",
            "water",
            "boat",
            "fish",
            "shore",
            "stream",
            "reeds",
            "canoe",
            "ducks",
            "mud",
        ),
        (
            "we sat by the {} and watched the {} .",
            "the {} was tied up near the {} .",
            "after the storm the {} flooded the {} .",
            "the {} drifted slowly past the {} .",
            "children played by the {} and the {} .",
            "a heron waited between the {} and the {} .",
            "the {} smelled of the {} .",
        ),
    ),
    "money": (
        (
            "bank",
            "money",
            "loan",
            "cash",
            "account",
            "deposit",
            "savings",
            "credit",
            "mortgage",
            "teller",
            "salary",
        ),
        (
            "she moved her {} to the {} .",
            "the {} approved her {} .",
            "he took the {} out of the {} .",
            "the {} charged a fee on the {} .",
            "the {} was paid into the {} on friday .",
            "her {} grew faster than her {} .",
            "he asked the {} about the {} .",
        ),
    ),
    "island": (
        (
            "java",
            "island",
            "volcano",
            "beach",
            "jungle",
            "temple",
            "rice",
            "coast",
            "village",
            "lagoon",
            "palms",
        ),
        (
            "the {} is known for its {} .",
            "we took the ferry to the {} to see the {} .",
            "people visit the {} for the {} .",
            "we walked from the {} to the {} .",
            "the {} lies beyond the {} .",
            "the sun set over the {} and the {} .",
        ),
    ),
    "programming": (
        (
            "java",
            "code",
            "compiler",
            "program",
            "python",
            "bug",
            "software",
            "developer",
            "library",
            "function",
            "server",
        ),
        (
            "she wrote the {} in {} .",
            "the {} crashed because of the {} .",
            "the {} is written in {} .",
            "the {} runs on the {} .",
            "the {} found a {} in the {} .",
            "the {} compiles the {} .",
            "he tested the {} with the {} .",
        ),
    ),
    "coffee": (
        (
            "coffee",
            "espresso",
            "cup",
            "mug",
            "beans",
            "milk",
            "cafe",
            "barista",
            "sugar",
            "roast",
        ),
        (
            "the {} poured the {} into the {} .",
            "she drank her {} with {} .",
            "the {} sells a dark {} .",
            "he ground the {} for the {} .",
            "the {} smelled of {} .",
        ),
    ),
}


def toy_corpus(n_per_topic: int = 150, seed: int = 0) -> list[tuple[str, str]]:
    """``n_per_topic`` template sentences for each topic of :data:`TOPICS`, as
    ``(topic, text)``.

    Deterministic for a given ``seed``: each sentence picks a template of its
    topic uniformly and fills its slots with distinct words of that topic.
    """
    rng = np.random.default_rng(seed)
    corpus = []
    for topic, (words, templates) in TOPICS.items():
        for _ in range(n_per_topic):
            template = templates[rng.integers(len(templates))]
            fill = rng.choice(
                len(words), size=template.count("{}"), replace=False
            )
            corpus.append((topic, template.format(*(words[i] for i in fill))))
    return corpus
