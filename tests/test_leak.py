"""The causal-leak experiment: the unmasked model reads its targets; the masked
one cannot."""

import numpy as np
import pytest
import torch

from attnbook.experiments.leak import (
    LeakConfig,
    LeakMeasurements,
    char_data,
    greedy_text,
    lookahead_weight,
    measure,
    position_losses,
    run_leak_experiment,
    run_leak_experiments,
    train_char_model,
)
from attnbook.gpt import text_windows
from attnbook.heads import attention_maps


def test_windows_targets_are_inputs_shifted_by_one():
    tokens = torch.arange(100)
    x, y = text_windows(tokens, torch.tensor([0, 7, 50]), 5)
    assert x.shape == y.shape == (3, 5)
    assert torch.equal(x[1], torch.arange(7, 12)) and torch.equal(
        y[1], torch.arange(8, 13)
    )


def test_char_data_uses_the_first_characters():
    tok, train, val = char_data(LeakConfig(n_chars=100_000))
    assert (
        len(train) + len(val) == 100_000
        and len(val) == 8192
        and tok.vocab_size == 73
    )
    assert tok.decode(train[:3].tolist()) == "Gen"
    with pytest.raises(ValueError, match="no validation text"):
        char_data(LeakConfig(n_chars=20_000))


def test_training_is_reproducible_and_shares_the_start():
    cfg = LeakConfig(steps=3, n_chars=100_000)
    tok, train, _ = char_data(cfg)
    _, a = train_char_model(train, tok.vocab_size, causal=True, config=cfg)
    _, b = train_char_model(train, tok.vocab_size, causal=True, config=cfg)
    _, c = train_char_model(train, tok.vocab_size, causal=False, config=cfg)
    np.testing.assert_array_equal(a, b)
    # same initial weights and batch: at initialisation both predict nearly
    # uniformly
    assert abs(a[0] - c[0]) < 0.05 and abs(a[0] - np.log(tok.vocab_size)) < 0.1
    assert not np.array_equal(a, c)


@pytest.fixture(scope="module")
def result():
    threads = torch.get_num_threads()
    out = run_leak_experiment(LeakConfig())
    # the experiment runs on one thread, then restores
    assert torch.get_num_threads() == threads
    return out


def test_leaky_training_loss_falls_far_below_the_honest_one(result):
    honest, leaky = (
        result.honest_losses[-25:].mean(),
        result.leaky_losses[-25:].mean(),
    )
    assert leaky < 0.5 < 1.5 < honest


def test_the_leak_is_reading_the_next_position(result):
    """Every position but the last sees its own target; the last one cannot,
    and loses the advantage."""
    leaky = position_losses(result.leaky, result.val, causal=False)
    honest = position_losses(result.honest, result.val, causal=True)
    assert leaky.shape == honest.shape == (8,)
    assert leaky[:-1].max() < 0.3
    assert leaky[-1] > honest[-1] + 0.1
    # run as a causal decoder (nothing after t), the leaky model is worse than
    # guessing uniformly
    as_decoder = position_losses(result.leaky, result.val, causal=True)
    assert as_decoder[:-1].mean() > np.log(result.tokenizer.vocab_size)


def test_leaky_attention_looks_one_position_ahead(result):
    """lookahead_weight against the weights read off by hand, window by
    window."""
    starts = torch.arange(0, 3200, 100)
    # (layers, heads)
    ahead = lookahead_weight(result.leaky, result.val, starts)
    x, _ = text_windows(result.val, starts, 8)
    with torch.no_grad():
        # (layers, b, h, n, n)
        w = attention_maps(result.leaky, x, mask=None, is_causal=False)
    by_hand = np.array(
        [
            [
                np.mean(
                    [
                        w[l, b, h, t, t + 1].item()
                        for b in range(len(starts))
                        for t in range(7)
                    ]
                )
                for h in range(4)
            ]
            for l in range(2)
        ]
    )
    np.testing.assert_allclose(ahead, by_hand, rtol=1e-5)
    # a first-layer head reads position t + 1
    assert ahead.shape == (2, 4) and ahead[0].max() > 0.5
    # the honest model has no such head
    assert lookahead_weight(result.honest, result.val).max() < 0.5


def test_measure_collects_the_chapter_numbers(result):
    m = measure(result)
    assert isinstance(m, LeakMeasurements) and m.seed == result.config.seed
    assert m.leaky_train == pytest.approx(result.leaky_losses[-25:].mean())
    assert m.honest_train == pytest.approx(result.honest_losses[-25:].mean())
    np.testing.assert_array_equal(
        m.leaky_pos, position_losses(result.leaky, result.val, causal=False)
    )
    np.testing.assert_array_equal(
        m.leaky_as_decoder,
        position_losses(result.leaky, result.val, causal=True),
    )
    np.testing.assert_array_equal(
        m.lookahead, lookahead_weight(result.leaky, result.val)
    )
    assert measure(result, last=1).leaky_train == pytest.approx(
        result.leaky_losses[-1]
    )
    with pytest.raises(ValueError):
        measure(result, last=0)


def test_run_leak_experiments_replaces_the_seed():
    cfg = LeakConfig(steps=2, n_chars=100_000, seed=7)
    runs = run_leak_experiments(cfg, seeds=[0, 3])
    assert [r.config.seed for r in runs] == [0, 3]
    assert all(r.config.steps == 2 for r in runs)
    np.testing.assert_array_equal(
        runs[1].leaky_losses,
        run_leak_experiment(
            LeakConfig(steps=2, n_chars=100_000, seed=3)
        ).leaky_losses,
    )
    assert not np.array_equal(runs[0].leaky_losses, runs[1].leaky_losses)


def test_greedy_text(result):
    text = greedy_text(
        result.honest, result.tokenizer, "1:1 In the", 20, causal=True
    )
    assert len(text) == 20 and set(text) <= set(result.tokenizer.vocab)
    assert text == greedy_text(
        result.honest, result.tokenizer, "1:1 In the", 20, causal=True
    )


@pytest.mark.parametrize(
    "kwargs",
    [{"steps": 0}, {"context_length": -1}, {"lr": 0.0}, {"d_model": 2.5}],
)
def test_bad_config(kwargs):
    with pytest.raises(ValueError):
        LeakConfig(**kwargs)


def test_a_custom_mask_overrides_causal():
    cfg = LeakConfig(steps=2, n_chars=100_000)
    tok, train, val = char_data(cfg)
    n = cfg.context_length
    _, causal = train_char_model(
        train, tok.vocab_size, causal=True, config=cfg
    )
    _, same = train_char_model(
        train,
        tok.vocab_size,
        causal=False,
        config=cfg,
        mask=np.tril(np.ones((n, n), bool)),
    )
    _, ahead = train_char_model(
        train,
        tok.vocab_size,
        config=cfg,
        mask=np.tril(np.ones((n, n), bool), k=1),
    )
    np.testing.assert_allclose(same, causal, rtol=1e-6)
    assert not np.allclose(ahead, causal)
    with pytest.raises(ValueError, match="boolean"):
        train_char_model(
            train, tok.vocab_size, config=cfg, mask=np.ones((n, n))
        )
    with pytest.raises(ValueError, match=r"\(8, 8\)"):
        train_char_model(
            train, tok.vocab_size, config=cfg, mask=np.ones((n, n + 1), bool)
        )


def test_training_steps_with_the_fused_adamw(monkeypatch):
    """The optimizer is AdamW in its fused form (one kernel per step rather
    than some ten operations per parameter tensor: chapter 7 trains nine
    models within its time budget)."""
    made = []
    original = torch.optim.AdamW

    def recording(*args, **kwargs):
        made.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", recording)
    cfg = LeakConfig(steps=2, n_chars=100_000)
    tok, train, _ = char_data(cfg)
    train_char_model(train, tok.vocab_size, config=cfg)
    assert made and made[0].get("fused") is True
    assert made[0]["lr"] == cfg.lr
