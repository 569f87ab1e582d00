"""Comparing a cache's run with the exact one
(attnbook.experiments.cache_quality, chapter 8)."""

import numpy as np
import pytest
import torch

from attnbook.experiments.cache_quality import (
    CacheComparison,
    compare_caches,
    first_difference,
    run_with_caches,
    top2_margin,
)
from attnbook.gpt import GPTConfig, TinyGPT
from attnbook.quantized_cache import new_quantized_kv_cache
from attnbook.seeds import TooCloseToCall


@pytest.fixture
def small_model():
    torch.manual_seed(4)
    return TinyGPT(
        GPTConfig(
            vocab_size=19,
            context_length=40,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_model=32,
        )
    ).eval()


def test_top2_margin():
    logits = torch.tensor([[1.0, 3.0, 2.5], [0.0, -1.0, 0.0]])
    torch.testing.assert_close(top2_margin(logits), torch.tensor([0.5, 0.0]))


@pytest.mark.parametrize("one_pass", [True, False])
def test_run_with_caches_records_logits_and_attention(small_model, one_pass):
    ids = torch.randint(
        0, 19, (3, 12), generator=torch.Generator().manual_seed(0)
    )
    logits, attn = run_with_caches(
        small_model, ids, small_model.new_kv_cache(batch=3), one_pass
    )
    with torch.no_grad():
        torch.testing.assert_close(
            logits, small_model(ids), rtol=1e-5, atol=1e-5
        )
    assert len(attn) == 2 and all(a.shape == (3, 12, 32) for a in attn)


def test_compare_caches_against_a_numpy_reference(small_model):
    ids = torch.randint(
        0, 19, (2, 30), generator=torch.Generator().manual_seed(1)
    )
    exact = run_with_caches(
        small_model, ids, small_model.new_kv_cache(batch=2)
    )
    run = run_with_caches(
        small_model, ids, new_quantized_kv_cache(small_model, batch=2, bits=3)
    )
    c = compare_caches(run, exact)
    assert isinstance(c, CacheComparison)
    lq, le = run[0].double().numpy(), exact[0].double().numpy()
    for b in range(2):
        for layer in range(2):
            a, e = (
                run[1][layer][b].double().numpy(),
                exact[1][layer][b].double().numpy(),
            )
            assert c.attention[b, layer] == pytest.approx(
                np.linalg.norm(a - e) / np.linalg.norm(e), rel=1e-4
            )
        assert c.max_dlogit[b] == pytest.approx(
            np.abs(lq[b] - le[b]).max(), rel=1e-5
        )
        p = np.exp(le[b] - le[b].max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        q = np.exp(lq[b] - lq[b].max(-1, keepdims=True))
        q /= q.sum(-1, keepdims=True)
        assert c.kl[b] == pytest.approx(
            np.mean(np.sum(p * np.log(p / q), -1)), rel=1e-3, abs=1e-7
        )
        for t in range(30):
            top = le[b, t].argmax()
            assert c.exact_margin[b, t] == pytest.approx(
                np.sort(le[b, t])[-1] - np.sort(le[b, t])[-2], abs=1e-5
            )
            assert c.kept_margin[b, t] == pytest.approx(
                lq[b, t, top] - np.delete(lq[b, t], top).max(), abs=1e-5
            )
            assert c.same_top1[b, t] == (lq[b, t].argmax() == top)
    assert c.flips.tolist() == [int((~c.same_top1[b]).sum()) for b in range(2)]
    same = compare_caches(exact, exact)
    assert (
        same.max_dlogit.max() == 0
        and same.flips.sum() == 0
        and np.all(same.attention == 0)
    )
    with pytest.raises(ValueError, match="differ in shape"):
        compare_caches((run[0][:1], run[1]), exact)


def test_top1_kept_refuses_near_ties():
    c = CacheComparison(
        attention=np.zeros((1, 1)),
        max_dlogit=np.zeros(1),
        kl=np.zeros(1),
        exact_margin=np.array([[0.1, 0.6, 2.0]]),
        kept_margin=np.array([[-0.05, 0.3, 1.5]]),
    )
    assert c.flips.tolist() == [1]
    # the flip is at a near-tie, below the threshold
    assert c.top1_kept(0.5, margin=0.1)
    assert not c.top1_kept(0.05)
    with pytest.raises(TooCloseToCall):
        # kept margin -0.05 is within 0.1 of a flip
        c.top1_kept(0.05, margin=0.1)


def test_top1_kept_is_false_beside_a_near_tie_when_another_flip_is_clear():
    """A clear flip decides the verdict whatever the near-ties elsewhere (a
    4-bit cache has both): False, not TooCloseToCall."""
    c = CacheComparison(
        attention=np.zeros((1, 1)),
        max_dlogit=np.zeros(1),
        kl=np.zeros(1),
        exact_margin=np.array([[0.8, 0.9, 2.0]]),
        kept_margin=np.array([[0.01, -0.4, 1.5]]),
    )
    assert not c.top1_kept(0.5, margin=0.05)
    # without the clear flip, the near-tie still decides: refused
    c.kept_margin[0, 1] = 0.4
    with pytest.raises(TooCloseToCall):
        c.top1_kept(0.5, margin=0.05)
    # a flip by exactly the margin counts as clear
    c.kept_margin[0, 1] = -0.05
    assert not c.top1_kept(0.5, margin=0.05)


def test_first_difference():
    exact = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]])
    other = torch.tensor([[1, 2, 3, 9, 9], [1, 2, 3, 4, 5]])
    assert first_difference(other, exact, n_prompt=2).tolist() == [1, 3]
