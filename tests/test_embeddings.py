"""Tests of attnbook.embeddings against independent references (torch, loops,
eigh)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnbook.embeddings import (
    TOPICS,
    UNK,
    Vocabulary,
    cooccurrence_counts,
    cosine_similarity,
    embed,
    embedding_grad,
    nearest_neighbours,
    one_hot,
    pca_project,
    ppmi,
    static_word_vectors,
    svd_embeddings,
    tokenize,
    toy_corpus,
)

# --- tokenizer and vocabulary ------------------------------------------------


@pytest.mark.parametrize(
    "text, tokens",
    [
        (
            "The bank's loan, approved.",
            ["the", "bank's", "loan", ",", "approved", "."],
        ),
        ("Java  is\tan ISLAND!", ["java", "is", "an", "island", "!"]),
        ("x=3.5?", ["x", "=", "3", ".", "5", "?"]),
        ("", []),
        ("  ", []),
    ],
)
def test_tokenize_examples(text, tokens):
    assert tokenize(text) == tokens


def test_tokenize_rejects_non_strings():
    with pytest.raises(ValueError, match="string"):
        tokenize(["a", "list"])


def test_tokens_rejoin_to_the_text_without_spaces():
    text = "After the storm, the river flooded the bank (again)!"
    assert "".join(tokenize(text)) == "".join(text.lower().split())


def test_vocabulary_orders_by_frequency_then_alphabet():
    vocab = Vocabulary.from_texts(["b a b", "c a b", "d"])
    assert vocab.tokens == (UNK, "b", "a", "c", "d")
    assert len(vocab) == 5 and "a" in vocab and "z" not in vocab


def test_vocabulary_min_count_drops_rare_tokens():
    vocab = Vocabulary.from_texts(["b a b", "c a b", "d"], min_count=2)
    assert vocab.tokens == (UNK, "b", "a")


def test_encode_decode_round_trip_and_unknown_words():
    vocab = Vocabulary.from_texts(["the bank approved the loan ."])
    ids = vocab.encode("The bank refused the overdraft.")
    assert ids.dtype == np.int64 and ids.shape == (6,)
    assert vocab.decode(ids) == ["the", "bank", UNK, "the", UNK, "."]
    assert list(vocab.encode(["loan", "zebra"])) == [vocab.id("loan"), 0]


def test_vocabulary_errors_name_the_problem():
    with pytest.raises(ValueError, match="first token"):
        Vocabulary(["a", UNK])
    with pytest.raises(ValueError, match="repeated.*'a'"):
        Vocabulary([UNK, "a", "b", "a"])
    vocab = Vocabulary([UNK, "a"])
    with pytest.raises(ValueError, match="'zebra' is not in the vocabulary"):
        vocab.id("zebra")
    with pytest.raises(ValueError, match="token id 2 .* V=2"):
        vocab.decode([1, 2])


# --- one-hot and lookup ------------------------------------------------------

ids_and_table = st.integers(1, 40).flatmap(
    lambda v: st.tuples(
        st.just(v),
        st.lists(st.integers(0, v - 1), min_size=0, max_size=12),
        st.integers(1, 9),
    )
)


@settings(max_examples=60, deadline=None)
@given(ids_and_table)
def test_one_hot_matches_identity_rows(args):
    v, ids, _ = args
    h = one_hot(np.array(ids, dtype=np.int64), v)
    assert h.shape == (len(ids), v)
    np.testing.assert_array_equal(h, np.eye(v)[ids])


@settings(max_examples=60, deadline=None)
@given(ids_and_table, st.integers(0, 2**31 - 1))
def test_embed_matches_torch_and_the_one_hot_product(args, seed):
    v, ids, d = args
    table = np.random.default_rng(seed).normal(size=(v, d))
    ids = np.array(ids, dtype=np.int64)
    x = embed(ids, table)
    assert x.shape == (len(ids), d)
    expected = torch.nn.functional.embedding(
        torch.from_numpy(ids), torch.from_numpy(table)
    ).numpy()
    np.testing.assert_array_equal(x, expected)
    # a one-hot row selects a row exactly: every other product is an exact zero
    np.testing.assert_array_equal(one_hot(ids, v) @ table, x)


def test_embed_keeps_batch_dimensions_and_dtype():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    ids = np.array([[0, 3], [2, 2], [1, 0]])
    x = embed(ids, table)
    assert x.shape == (3, 2, 3) and x.dtype == np.float32
    np.testing.assert_array_equal(x[1, 0], [6, 7, 8])
    assert one_hot(ids, 4).shape == (3, 2, 4)


def test_embed_of_a_single_id_is_a_row():
    table = np.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(embed(2, table), [4.0, 5.0])


@pytest.mark.parametrize(
    "bad, pattern",
    [
        (
            [0, 1, 7],
            r"token id 7 at position \(2,\) is out of range for a vocabulary "
            r"of V=5",
        ),
        ([-1, 2], r"token id -1 at position \(0,\)"),
        ([[0, 1], [5, 0]], r"token id 5 at position \(1, 0\)"),
        (np.array([0.0, 1.0]), "must be integers; got dtype float64"),
        (np.array([True, False]), "must be integers; got dtype bool"),
    ],
)
def test_bad_ids_raise_value_errors_naming_them(bad, pattern):
    table = np.zeros((5, 3))
    with pytest.raises(ValueError, match=pattern):
        embed(bad, table)
    with pytest.raises(ValueError, match=pattern):
        one_hot(bad, 5)


def test_embed_rejects_a_table_that_is_not_2d():
    with pytest.raises(
        ValueError, match=r"2-D \(V, d_model\); got shape \(5,\)"
    ):
        embed([0], np.zeros(5))


@pytest.mark.parametrize(
    "shape", [(7,), (3, 5), (2, 2, 4), (1,), (0,), (2, 0)]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_embedding_grad_matches_torch_autograd(shape, seed):
    """Against autograd through torch.nn.functional.embedding, float64, with
    ids drawn from a small vocabulary so that tokens repeat."""
    rng = np.random.default_rng(seed)
    v, d = 5, 3
    ids = rng.integers(0, v, size=shape)
    g = rng.normal(size=(*shape, d))
    table = torch.zeros(v, d, dtype=torch.float64, requires_grad=True)
    out = torch.nn.functional.embedding(torch.from_numpy(ids), table)
    (out * torch.from_numpy(g)).sum().backward()
    expected = table.grad.numpy()
    got = embedding_grad(ids, g, v)
    assert got.shape == (v, d) and got.dtype == np.float64
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    # and the product H^T G of the chapter's equation
    h = one_hot(ids, v).reshape(-1, v)
    np.testing.assert_allclose(
        got, h.T @ g.reshape(-1, d), rtol=1e-12, atol=1e-12
    )


def test_embedding_grad_sums_repeated_tokens():
    """A token that occurs twice collects both rows (grad[ids] += g keeps
    one); float32 rows are summed in float64; an unused row is 0."""
    ids = np.array([[1, 1], [0, 1]])
    g = np.array(
        [[[1.0, 2.0], [10.0, 20.0]], [[3.0, 4.0], [100.0, 200.0]]],
        dtype=np.float32,
    )
    got = embedding_grad(ids, g, 3)
    np.testing.assert_array_equal(
        got, [[3.0, 4.0], [111.0, 222.0], [0.0, 0.0]]
    )
    assert got.dtype == np.float64


def test_embedding_grad_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"ids.shape \+ \(d_model,\)"):
        embedding_grad([0, 1], np.zeros((3, 2)), 4)
    with pytest.raises(ValueError, match=r"token id 4 at position \(1,\)"):
        embedding_grad([0, 4], np.zeros((2, 2)), 4)
    with pytest.raises(ValueError, match="vocab_size"):
        embedding_grad([0], np.zeros((1, 2)), 0)


@pytest.mark.parametrize("v", [0, -3, 2.0, True])
def test_one_hot_rejects_bad_vocab_size(v):
    with pytest.raises(ValueError, match="vocab_size"):
        one_hot([0], v)


# --- cosine similarity -------------------------------------------------------


def torch_cosine(a, b):
    """Reference: torch's pairwise cosine, broadcasting (m, 1, d) against (1,
    n, d)."""
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    return torch.nn.functional.cosine_similarity(
        ta[:, None, :], tb[None, :, :], dim=-1, eps=1e-300
    ).numpy()


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 7),
    st.integers(1, 7),
    st.integers(1, 9),
    st.integers(0, 2**31 - 1),
)
def test_cosine_matches_torch_on_random_shapes(m, n, d, seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(m, d)) * rng.uniform(0.01, 100, size=(m, 1))
    b = rng.normal(size=(n, d)) * rng.uniform(0.01, 100, size=(n, 1))
    c = cosine_similarity(a, b)
    assert c.shape == (m, n)
    np.testing.assert_allclose(c, torch_cosine(a, b), rtol=1e-12, atol=1e-12)
    assert np.all(np.abs(c) <= 1.0)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 8),
    st.floats(1e-3, 1e3),
    st.floats(1e-3, 1e3),
    st.integers(0, 2**31 - 1),
)
def test_cosine_ignores_lengths_and_is_symmetric(m, d, s, t, seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(m, d)), rng.normal(size=(m + 1, d))
    np.testing.assert_allclose(
        cosine_similarity(s * a, t * b), cosine_similarity(a, b), atol=1e-12
    )
    np.testing.assert_allclose(
        cosine_similarity(b, a), cosine_similarity(a, b).T, atol=1e-15
    )
    np.testing.assert_allclose(np.diag(cosine_similarity(a)), 1.0, atol=1e-12)
    np.testing.assert_allclose(
        cosine_similarity(a, -a).diagonal(), -1.0, atol=1e-12
    )


def test_cosine_known_values_vectors_and_zero_rows():
    assert cosine_similarity([1.0, 0.0], [1.0, 1.0]) == pytest.approx(
        1 / math.sqrt(2)
    )
    assert cosine_similarity([1.0, 2.0], [-2.0, 1.0]) == pytest.approx(0.0)
    a = np.array([[3.0, 4.0], [0.0, 0.0]])
    np.testing.assert_allclose(
        cosine_similarity(a, [[4.0, 3.0]]), [[24 / 25], [0.0]]
    )
    assert cosine_similarity(a[0], a).shape == (2,)
    assert cosine_similarity(a, a[0]).shape == (2,)
    assert np.ndim(cosine_similarity(a[0], a[0])) == 0
    assert (
        cosine_similarity(
            np.ones((3, 2), dtype=np.float16), np.ones((1, 2))
        ).dtype
        == np.float64
    )


def test_cosine_errors_name_the_shapes():
    with pytest.raises(
        ValueError, match=r"same dimension d .* a \(2, 3\) and b \(4, 5\)"
    ):
        cosine_similarity(np.ones((2, 3)), np.ones((4, 5)))
    with pytest.raises(
        ValueError, match=r"a must be .* got shape \(2, 2, 3\)"
    ):
        cosine_similarity(np.ones((2, 2, 3)), np.ones((4, 3)))


# --- co-occurrence, PPMI, SVD -----------------------------------------------


def loop_cooccurrence(sequences, v, window):
    counts = Counter()
    for seq in sequences:
        for i, w in enumerate(seq):
            for j, c in enumerate(seq):
                if i != j and abs(i - j) <= window:
                    counts[w, c] += 1
    out = np.zeros((v, v))
    for (w, c), k in counts.items():
        out[w, c] = k
    return out


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 8).flatmap(
        lambda v: st.tuples(
            st.just(v),
            st.lists(st.lists(st.integers(0, v - 1), max_size=9), max_size=5),
            st.integers(1, 5),
        )
    )
)
def test_cooccurrence_matches_a_loop_over_pairs(args):
    v, sequences, window = args
    counts = cooccurrence_counts(
        [np.array(s, dtype=np.int64) for s in sequences], v, window
    )
    np.testing.assert_array_equal(
        counts, loop_cooccurrence(sequences, v, window)
    )
    np.testing.assert_array_equal(counts, counts.T)


def test_cooccurrence_does_not_cross_sentences():
    counts = cooccurrence_counts(
        [np.array([0, 1]), np.array([2, 3])], 4, window=5
    )
    assert counts[1, 2] == 0 and counts[0, 1] == 1 and counts.sum() == 4


def test_cooccurrence_errors():
    with pytest.raises(ValueError, match="window"):
        cooccurrence_counts([np.array([0, 1])], 2, window=0)
    with pytest.raises(ValueError, match="token id 4"):
        cooccurrence_counts([np.array([0, 4])], 3)


def loop_ppmi(counts):
    total = counts.sum()
    rows, cols = counts.sum(axis=1), counts.sum(axis=0)
    out = np.zeros_like(counts, dtype=float)
    for w in range(counts.shape[0]):
        for c in range(counts.shape[1]):
            if counts[w, c] > 0:
                out[w, c] = max(
                    0.0,
                    math.log(
                        (counts[w, c] / total)
                        / ((rows[w] / total) * (cols[c] / total))
                    ),
                )
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_ppmi_matches_the_definition(v, vc, seed):
    counts = (
        np.random.default_rng(seed).integers(0, 6, size=(v, vc)).astype(float)
    )
    result = ppmi(counts)
    np.testing.assert_allclose(
        result, loop_ppmi(counts), rtol=1e-12, atol=1e-12
    )
    assert np.all(result >= 0) and np.all(np.isfinite(result))


def test_ppmi_edge_cases():
    np.testing.assert_array_equal(ppmi(np.zeros((3, 3))), np.zeros((3, 3)))
    # independent words: every ratio is exactly 1, so PMI is 0
    np.testing.assert_allclose(
        ppmi(np.outer([1, 2, 3], [2, 1])), 0.0, atol=1e-12
    )
    with pytest.raises(ValueError, match="non-negative"):
        ppmi(np.array([[1.0, -1.0]]))
    with pytest.raises(ValueError, match="2-D"):
        ppmi(np.ones(3))


@settings(max_examples=40, deadline=None)
@given(
    st.integers(2, 9), st.integers(2, 9), st.integers(0, 2**31 - 1), st.data()
)
def test_svd_embeddings_against_torch(v, vc, seed, data):
    m = np.random.default_rng(seed).normal(size=(v, vc))
    d = data.draw(st.integers(1, min(v, vc)))
    e = svd_embeddings(m, d)
    assert e.shape == (v, d)
    u, s, _ = torch.linalg.svd(torch.from_numpy(m), full_matrices=False)
    u, s = u.numpy()[:, :d], s.numpy()[:d]
    # columns are orthogonal with squared lengths equal to the singular values
    np.testing.assert_allclose(e.T @ e, np.diag(s), atol=1e-9)
    # and, up to the sign of each column, they are torch's U_d sqrt(S_d)
    ref = u * np.sqrt(s)
    signs = np.sign(np.sum(ref * e, axis=0))
    np.testing.assert_allclose(e, ref * signs, atol=1e-8)
    # the sign convention: each column's largest-magnitude entry is positive
    assert np.all(e[np.argmax(np.abs(e), axis=0), np.arange(d)] > 0)


@pytest.mark.parametrize("d", [0, 4, 2.0])
def test_svd_embeddings_rejects_bad_rank(d):
    with pytest.raises(ValueError, match=r"1\.\.3"):
        svd_embeddings(np.ones((3, 5)), d)


@settings(max_examples=30, deadline=None)
@given(st.integers(3, 10), st.integers(2, 6), st.integers(0, 2**31 - 1))
def test_pca_project_against_covariance_eigenvectors(m, d, seed):
    x = np.random.default_rng(seed).normal(size=(m, d)) * np.arange(1, d + 1)
    k = min(2, m - 1, d)
    z = pca_project(x, k)
    centred = x - x.mean(axis=0)
    evals, evecs = np.linalg.eigh(centred.T @ centred)
    top = evecs[:, ::-1][:, :k]
    gap = evals[::-1][: k + 1]
    if np.min(np.abs(np.diff(gap))) < 1e-6 * gap[0]:
        return  # (nearly) repeated eigenvalues: the axes are not unique
    ref = centred @ top
    signs = np.sign(np.sum(ref * z, axis=0))
    np.testing.assert_allclose(z, ref * signs, atol=1e-8)
    np.testing.assert_allclose(z.mean(axis=0), 0.0, atol=1e-10)


def test_pca_project_rejects_bad_k():
    with pytest.raises(ValueError, match=r"k=3"):
        pca_project(np.ones((5, 2)), 3)


# --- the corpus and the learned vectors -------------------------------------


def test_toy_corpus_is_deterministic_and_balanced():
    corpus = toy_corpus(40, seed=3)
    assert corpus == toy_corpus(40, seed=3)
    assert corpus != toy_corpus(40, seed=4)
    assert Counter(topic for topic, _ in corpus) == {t: 40 for t in TOPICS}
    for topic, text in corpus:
        tokens = tokenize(text)
        assert tokens[-1] == "." and "{" not in text
        fillers = [t for t in tokens if t in TOPICS[topic][0]]
        assert len(fillers) == len(set(fillers))  # slots get distinct words


def test_ambiguous_words_occur_in_two_senses():
    corpus = toy_corpus()

    def topics_of(w):
        return {topic for topic, text in corpus if w in tokenize(text)}

    assert topics_of("bank") == {"river", "money"}
    assert topics_of("java") == {"island", "programming"}
    assert topics_of("coffee") == {"coffee"}


@pytest.fixture(scope="module")
def learned():
    return static_word_vectors(
        [text for _, text in toy_corpus()], d=16, window=4
    )


def test_static_word_vectors_shapes(learned):
    vocab, table = learned
    assert table.shape == (len(vocab), 16)
    np.testing.assert_array_equal(table[0], 0.0)  # <unk> never occurs
    assert set(TOPICS["coffee"][0]) <= set(vocab.tokens)


def test_learned_vectors_group_topics_and_blend_ambiguous_words(learned):
    vocab, table = learned

    def centroid(topic):
        return table[
            [
                vocab.id(w)
                for w in TOPICS[topic][0]
                if w not in ("bank", "java")
            ]
        ].mean(axis=0)

    river, money, coffee = (
        centroid("river"),
        centroid("money"),
        centroid("coffee"),
    )
    bank = embed(vocab.id("bank"), table)
    # the static vector of "bank" is close to both of its senses, and to
    # neither unrelated topic
    assert (
        cosine_similarity(bank, river) > 0.3
        and cosine_similarity(bank, money) > 0.3
    )
    assert abs(cosine_similarity(bank, coffee)) < 0.2
    assert abs(cosine_similarity(embed(vocab.id("loan"), table), river)) < 0.2
    neighbours = [w for w, _ in nearest_neighbours("loan", vocab, table, k=5)]
    assert set(neighbours) <= set(TOPICS["money"][0])


def test_nearest_neighbours_sorted_and_exclusive(learned):
    vocab, table = learned
    result = nearest_neighbours("river", vocab, table, k=8)
    sims = [s for _, s in result]
    assert len(result) == 8 and sims == sorted(sims, reverse=True)
    assert "river" not in [w for w, _ in result] and UNK not in [
        w for w, _ in result
    ]


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.uint64])
def test_ids_become_the_platform_index_type(dtype):
    """np.bincount takes only np.intp: in the browser (Pyodide, wasm32) that is
    int32, and int64 ids made cooccurrence_counts fail there
    (tests/test_lite.py runs it in Pyodide itself)."""
    from attnbook.embeddings import _checked_ids

    ids = _checked_ids(np.array([[0, 2], [1, 2]], dtype=dtype), 3)
    assert ids.dtype == np.intp
    np.testing.assert_array_equal(ids, [[0, 2], [1, 2]])
    counts = cooccurrence_counts(
        [np.array([0, 1, 2], dtype=dtype)], 3, window=1
    )
    np.testing.assert_array_equal(counts, [[0, 1, 0], [1, 0, 1], [0, 1, 0]])
