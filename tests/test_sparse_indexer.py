"""The lightning indexer and causal top-k (attnbook.sparse.indexer) against
transformers' ``DeepseekV32Indexer``, and sparse attention against dense
attention with the selection as a mask.

The reference is ``DeepseekV32Indexer`` of the pinned transformers, built from
a small ``DeepseekV32Config`` (default RoPE) at random initialisation in
float64. It computes its scores in float32 (``.float()``); the fixture
``float64_scores`` makes ``.float()`` keep float64 during its call, so that
the scores can be compared to 1e-12; one test runs it unpatched, to float32
rounding. Its scores are read where it hands them to ``topk``; it returns the
top-k indices, whose slots beyond a query's admissible keys point at masked
keys (score -inf): those are left out when the sets are compared.
"""

import pytest
import torch

from attnbook import attend
from attnbook.sparse.indexer import (
    LightningIndexer,
    causal_topk,
    indexer_scores,
    selection_mask,
    sparse_attention,
)

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers.models.deepseek_v32 import (  # noqa: E402
    modeling_deepseek_v32 as dsv32,
)

N, D_MODEL, Q_LATENT, HEADS, D_HEAD, D_ROPE, TOPK = 12, 24, 16, 4, 8, 4, 5


def config():
    return transformers.DeepseekV32Config(
        hidden_size=D_MODEL,
        q_lora_rank=Q_LATENT,
        index_n_heads=HEADS,
        index_head_dim=D_HEAD,
        qk_rope_head_dim=D_ROPE,
        index_topk=TOPK,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_hidden_layers=1,
        vocab_size=50,
    )


def pair(seed=0):
    torch.manual_seed(seed)
    theirs = dsv32.DeepseekV32Indexer(config(), 0).double().eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.5)
    ours = LightningIndexer(D_MODEL, Q_LATENT, HEADS, D_HEAD, D_ROPE).double()
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def rotary(n):
    inv_freq = 1.0 / 10000.0 ** (
        torch.arange(0, D_ROPE, 2, dtype=torch.float64) / D_ROPE
    )
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq
    both = torch.cat([angles, angles], dim=-1)[None]
    return both.cos(), both.sin()


def run_reference(theirs, x, q_latent, monkeypatch):
    """(scores handed to topk, indices returned) of transformers' indexer."""
    seen = []
    topk = torch.Tensor.topk

    def recording(self, *args, **kwargs):
        seen.append(self)
        return topk(self, *args, **kwargs)

    n = x.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "topk", recording)
        indices = theirs(x, q_latent, rotary(n), causal, torch.arange(n)[None])
    return seen[-1], indices.long()


@pytest.fixture
def float64_scores(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "float", lambda self: self)


def inputs(seed=1, batch=2, n=N):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, n, D_MODEL, generator=g, dtype=torch.float64),
        torch.randn(batch, n, Q_LATENT, generator=g, dtype=torch.float64),
    )


def selected_sets(indices, valid):
    return [
        [set(row[ok].tolist()) for row, ok in zip(indices[b], valid[b])]
        for b in range(indices.shape[0])
    ]


def compare_selections(scores, ours, theirs, k):
    """Each row's selected scores agree; where the k-th and (k+1)-th
    admissible scores differ (no tie at the boundary: ReLU makes exact zeros,
    which tie) the selected sets agree too. Returns the number of rows
    compared as sets."""
    n, as_sets = scores.shape[-1], 0
    for b in range(scores.shape[0]):
        for t in range(n):
            mine, other = ours[b][t], theirs[b][t]
            assert len(mine) == len(other) == min(t + 1, k)
            row = scores[b, t]
            torch.testing.assert_close(
                row[sorted(mine)].sort().values,
                row[sorted(other)].sort().values,
            )
            ranked = row[: t + 1].sort(descending=True).values
            if t + 1 <= k or ranked[k - 1] - ranked[k] > 1e-9:
                assert mine == other
                as_sets += 1
    return as_sets


def test_scores_and_selection_equal_deepseek_v32(monkeypatch, float64_scores):
    ours, theirs = pair()
    x, q_latent = inputs()
    their_scores, their_indices = run_reference(
        theirs, x, q_latent, monkeypatch
    )
    with torch.no_grad():
        scores = ours(x, q_latent)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    torch.testing.assert_close(
        scores.masked_fill(~causal, float("-inf")),
        their_scores,
        rtol=1e-12,
        atol=1e-12,
    )
    indices, valid = causal_topk(scores, TOPK)
    their_valid = torch.isfinite(their_scores.gather(-1, their_indices))
    as_sets = compare_selections(
        scores,
        selected_sets(indices, valid),
        selected_sets(their_indices, their_valid),
        TOPK,
    )
    # most rows have no tie at the boundary: the sets are compared there
    assert as_sets >= 2 * N - 4
    # a query at position t < k - 1 has t + 1 keys, all selected
    assert valid.sum(-1)[0].tolist() == [min(t + 1, TOPK) for t in range(N)]


def test_unpatched_deepseek_v32_agrees_to_float32(monkeypatch):
    ours, theirs = pair(3)
    x, q_latent = inputs(4)
    their_scores, _ = run_reference(theirs, x, q_latent, monkeypatch)
    with torch.no_grad():
        scores = ours(x, q_latent)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    torch.testing.assert_close(
        scores.masked_fill(~causal, float("-inf")).float(),
        their_scores,
        rtol=1e-5,
        atol=1e-5,
    )


def test_scores_follow_the_formula():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64)
    k = torch.randn(2, 6, 5, generator=g, dtype=torch.float64)
    w = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    want = torch.zeros(2, 3, 6, dtype=torch.float64)
    for b in range(2):
        for t in range(3):
            for s in range(6):
                for j in range(4):
                    dot = 0.7 * float(q[b, t, j] @ k[b, s])
                    want[b, t, s] += w[b, t, j] * max(dot, 0.0)
    torch.testing.assert_close(indexer_scores(q, k, w, 0.7), want)
    # the head weights are named omega, the chapter's symbol (w is a window)
    torch.testing.assert_close(indexer_scores(q, k, omega=w, scale=0.7), want)


def test_the_shown_source_uses_the_chapters_symbols():
    """Chapter 14 shows indexer_scores: its head weights are omega there,
    because w is a window's width."""
    doc = indexer_scores.__doc__
    assert "omega[t, j]" in doc and "w[t, j]" not in doc


def test_causal_topk_never_selects_the_future_even_when_it_scores_best():
    n, k = 6, 3
    # the future scores highest: an unmasked top-k would pick it
    scores = torch.arange(n, dtype=torch.float64).expand(n, n).clone()
    indices, valid = causal_topk(scores, k)
    for t in range(n):
        chosen = set(indices[t][valid[t]].tolist())
        assert chosen == set(range(max(0, t - k + 1), t + 1))
    assert valid.sum(-1).tolist() == [1, 2, 3, 3, 3, 3]


def test_queries_last_of_the_keys():
    """Decoding: 2 queries at positions 4 and 5 of 6 keys."""
    scores = torch.arange(6, dtype=torch.float64).expand(2, 6).clone()
    indices, valid = causal_topk(scores, 2)
    assert valid.all()
    assert [set(r.tolist()) for r in indices] == [{3, 4}, {4, 5}]


def test_sparse_attention_is_attention_over_the_selected_keys():
    g = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64)
        for _ in range(3)
    )
    scores = torch.randn(2, 7, 7, generator=g, dtype=torch.float64)
    indices, valid = causal_topk(scores, 3)
    got = sparse_attention(q, k, v, indices, valid)
    for b in range(2):
        for t in range(7):
            keys = indices[b, t][valid[b, t]]
            want = attend(q[b, :, t : t + 1], k[b][:, keys], v[b][:, keys])
            torch.testing.assert_close(got[b, :, t : t + 1], want)
    # k = n: every earlier key, i.e. causal attention
    everything = causal_topk(scores, 7)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    torch.testing.assert_close(
        sparse_attention(q, k, v, *everything), attend(q, k, v, causal)
    )
    assert selection_mask(*everything, 7).sum().item() == 2 * 28


@pytest.mark.parametrize("k", [0, -1, 8, 2.5])
def test_a_bad_k_is_named(k):
    with pytest.raises(
        ValueError, match=rf"k must be an integer in \[1, n_k=7\]; got {k}"
    ):
        causal_topk(torch.zeros(3, 7), k)


def test_mismatched_shapes_are_named():
    with pytest.raises(ValueError, match=r"\(2, 3, 4, 5\)"):
        indexer_scores(
            torch.zeros(2, 3, 4, 5), torch.zeros(2, 6, 4), torch.zeros(2, 3, 4)
        )
