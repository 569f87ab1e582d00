"""Uptraining and held-out loss of the tiny GPT (attnbook.experiments.uptrain,
chapter 12), and the token windows they share with training
(attnbook.gpt.text_windows, window_loss)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnbook.experiments.uptrain import (
    bootstrap_mean_interval,
    heldout_loss,
    heldout_loss_by_position,
    heldout_starts,
    heldout_window_losses,
    unigram_log_probs,
    unigram_loss,
    unigram_window_losses,
    uptrain,
    uptrain_over_seeds,
)
from attnbook.gpt import (
    GPTConfig,
    TinyGPT,
    text_windows,
    training_step,
    window_loss,
)
from attnbook.gqa import mha_to_gqa

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_windows_and_errors():
    tokens = torch.arange(20)
    x, y = text_windows(tokens, torch.tensor([0, 7]), 5)
    assert torch.equal(x[1], torch.arange(7, 12)) and torch.equal(
        y[1], torch.arange(8, 13)
    )
    with pytest.raises(ValueError, match="do not fit"):
        text_windows(tokens, torch.tensor([15]), 5)


def test_uptraining_lowers_the_loss_reproducibly():
    # a periodic text, easy to learn
    tokens = torch.tensor([0, 1, 2, 3, 2, 1] * 60)

    def run():
        torch.manual_seed(0)
        model = TinyGPT(
            GPTConfig(
                vocab_size=4,
                context_length=16,
                n_layers=1,
                n_heads=2,
                d_model=16,
            )
        )
        before = heldout_loss(model, tokens, n_windows=8, length=12)
        losses = uptrain(
            model, tokens, steps=40, batch=4, length=12, lr=1e-2, seed=3
        )
        return (
            before,
            heldout_loss(model, tokens, n_windows=8, length=12),
            losses,
        )

    before, after, losses = run()
    assert len(losses) == 40 and after < 0.5 * before
    assert run()[1:] == (after, losses)
    with pytest.raises(ValueError, match="lr"):
        uptrain(
            TinyGPT(GPTConfig(vocab_size=4, context_length=16)),
            tokens,
            1,
            lr=0.0,
        )


def test_uptrain_over_seeds_matches_single_runs():
    """Each seed's loss is what a separate uptrain + heldout_loss of a fresh
    copy gives; the derived distributions are the arithmetic of their
    definitions."""
    tokens = torch.tensor([0, 1, 2, 3, 2, 1] * 60)
    torch.manual_seed(0)
    mha = TinyGPT(
        GPTConfig(
            vocab_size=4, context_length=16, n_layers=1, n_heads=2, d_model=16
        )
    ).eval()
    models = {"mha": mha, "mqa": mha_to_gqa(mha, 1)}
    ev = dict(n_windows=4, length=12)
    kw = dict(steps=5, batch=2, length=12, lr=1e-2)
    runs = uptrain_over_seeds(
        models, tokens, tokens, seeds=(3, 7), eval_kwargs=ev, **kw
    )
    assert runs.seeds == (3, 7) and runs.reference == "mha"
    for name, start in models.items():
        assert runs.before[name] == pytest.approx(
            heldout_loss(start, tokens, **ev), rel=1e-6
        )
        assert np.array_equal(
            runs.before_windows[name],
            heldout_window_losses(start, tokens, **ev),
        )
        assert runs.after_windows[name].shape == (2, 4)
        assert runs.curves[name].shape == (2, 5)
        for i, seed in enumerate((3, 7)):
            m = copy.deepcopy(start)
            curve = uptrain(m, tokens, seed=seed, **kw)
            assert runs.curves[name][i].tolist() == curve
            assert runs.after[name].values[i] == pytest.approx(
                heldout_loss(m, tokens, **ev), rel=1e-6
            )
            assert np.array_equal(
                runs.after_windows[name][i],
                heldout_window_losses(m, tokens, **ev),
            )
    # the starting models are left untouched
    assert heldout_loss(mha, tokens, **ev) == pytest.approx(
        runs.before["mha"], rel=1e-6
    )
    gain = runs.gain("mqa")
    assert np.allclose(
        gain.values, runs.before["mqa"] - runs.after["mqa"].values
    )
    gap = runs.before["mqa"] - runs.before["mha"]
    assert np.allclose(runs.recovered("mqa").values, gain.values / gap)
    assert np.allclose(
        runs.behind("mqa").values,
        runs.after["mqa"].values - runs.before["mha"],
    )
    with pytest.raises(ValueError, match="no gap"):
        runs.recovered("mha")
    # against the control: the gap is to the reference's own loss after the
    # same uptraining, seed by seed
    control_gap = runs.before["mqa"] - runs.after["mha"].values
    assert np.allclose(
        runs.recovered_vs_control("mqa").values, gain.values / control_gap
    )
    with pytest.raises(ValueError, match="control"):
        runs.recovered_vs_control("mha")
    with pytest.raises(ValueError, match="reference"):
        uptrain_over_seeds(
            models, tokens, tokens, seeds=(0,), reference="gqa", **kw
        )
    with pytest.raises(ValueError, match="at least one"):
        uptrain_over_seeds({}, tokens, tokens, **kw)


def test_window_loss_is_the_mean_cross_entropy_of_every_token():
    """Against a direct per-window loop: the loss of each window's tokens,
    averaged over all."""
    torch.manual_seed(0)
    tokens = torch.randint(5, (200,))
    model = TinyGPT(
        GPTConfig(
            vocab_size=5, context_length=16, n_layers=1, n_heads=2, d_model=8
        )
    ).train()
    starts = torch.tensor([0, 17, 50, 120, 183])
    with torch.no_grad():
        expected = (
            torch.stack(
                [
                    F.cross_entropy(
                        model.eval()(tokens[s : s + 10][None])[0],
                        tokens[s + 1 : s + 11],
                        reduction="sum",
                    )
                    for s in starts.tolist()
                ]
            ).sum()
            / 50
        )
    model.train()
    assert window_loss(model, tokens, starts, 10, batch=2) == pytest.approx(
        expected.item(), rel=1e-6
    )
    assert model.training  # the mode is restored


def test_training_step_reports_the_loss_before_the_step_and_sets_the_learning_rate():
    torch.manual_seed(0)
    tokens = torch.randint(5, (100,))
    model = TinyGPT(
        GPTConfig(
            vocab_size=5, context_length=16, n_layers=1, n_heads=2, d_model=8
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    starts = torch.tensor([0, 40])
    x, y = text_windows(tokens, starts, 10)
    with torch.no_grad():
        before = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    weight = model.head.weight.detach().clone()
    loss = training_step(
        model, optimizer, tokens, starts, 10, lr=0.5, max_grad_norm=1e-3
    )
    assert (
        loss == pytest.approx(before, rel=1e-6)
        and optimizer.param_groups[0]["lr"] == 0.5
    )
    step = (model.head.weight.detach() - weight).norm().item()
    # SGD moves by lr times the clipped gradient
    assert 0 < step <= 0.5 * 1e-3 * (1 + 1e-5)


def test_heldout_loss_by_position_against_a_loop_over_windows_and_positions():
    """Each range's loss is the mean over windows and positions of the
    per-token cross-entropy, computed here one window at a time in float64;
    ranges that tile the window average (weighted by their lengths) to
    heldout_loss."""
    torch.manual_seed(0)
    tokens = torch.randint(6, (300,))
    model = TinyGPT(
        GPTConfig(
            vocab_size=6, context_length=32, n_layers=1, n_heads=2, d_model=8
        )
    ).train()
    ranges = [(0, 5), (5, 20), (3, 4), (0, 20)]
    got = heldout_loss_by_position(
        model, tokens, ranges, n_windows=7, length=20, batch=3, seed=4
    )
    # the mode is restored
    assert model.training
    model.eval()
    starts = heldout_starts(tokens, n_windows=7, length=20, seed=4).tolist()
    table = np.zeros((7, 20))
    with torch.no_grad():
        for w, s in enumerate(starts):
            # (20, vocab)
            logits = model(tokens[s : s + 20][None])[0].double()
            log_p = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
            for t in range(20):
                table[w, t] = -log_p[t, tokens[s + t + 1]].item()
    expected = [table[:, a:b].mean() for a, b in ranges]
    assert got.shape == (4,) and np.allclose(got, expected, rtol=1e-5)
    whole = heldout_loss(model, tokens, n_windows=7, length=20, seed=4)
    assert (5 * got[0] + 15 * got[1]) / 20 == pytest.approx(whole, rel=1e-5)
    for bad in ([], [(5, 5)], [(-1, 3)], [(0, 21)]):
        with pytest.raises(ValueError, match="ranges"):
            heldout_loss_by_position(
                model, tokens, bad, n_windows=2, length=20
            )


def test_uptrain_over_seeds_measures_position_ranges_with_the_same_windows():
    tokens = torch.tensor([0, 1, 2, 3, 2, 1] * 60)
    torch.manual_seed(0)
    mha = TinyGPT(
        GPTConfig(
            vocab_size=4, context_length=16, n_layers=1, n_heads=2, d_model=16
        )
    ).eval()
    models = {"mha": mha, "mqa": mha_to_gqa(mha, 1)}
    ev, kw, ranges = (
        dict(n_windows=4, length=12),
        dict(steps=3, batch=2, length=12, lr=1e-2),
        [(0, 6), (6, 12)],
    )
    runs = uptrain_over_seeds(
        models,
        tokens,
        tokens,
        seeds=(3, 7),
        eval_kwargs=ev,
        position_ranges=ranges,
        **kw,
    )
    assert runs.position_ranges == ((0, 6), (6, 12))
    for name, start in models.items():
        assert np.array_equal(
            runs.before_by_position[name],
            heldout_loss_by_position(start, tokens, ranges, **ev),
        )
        assert runs.after_by_position[name].shape == (2, 2)
        m = copy.deepcopy(start)
        uptrain(m, tokens, seed=7, **kw)
        assert np.array_equal(
            runs.after_by_position[name][1],
            heldout_loss_by_position(m, tokens, ranges, **ev),
        )
        assert (
            runs.after_on_range(name, 1).values.tolist()
            == runs.after_by_position[name][:, 1].tolist()
        )
    plain = uptrain_over_seeds(
        models, tokens, tokens, seeds=(3,), eval_kwargs=ev, **kw
    )
    assert plain.position_ranges == () and plain.after_by_position == {}
    with pytest.raises(ValueError, match="position ranges"):
        plain.after_on_range("mha", 0)


def test_heldout_window_losses_against_a_loop_and_their_mean_is_heldout_loss():
    torch.manual_seed(0)
    tokens = torch.randint(6, (300,))
    model = TinyGPT(
        GPTConfig(
            vocab_size=6, context_length=32, n_layers=1, n_heads=2, d_model=8
        )
    ).train()
    got = heldout_window_losses(
        model, tokens, n_windows=5, length=20, batch=2, seed=4
    )
    assert model.training and got.shape == (5,) and got.dtype == np.float64
    model.eval()
    with torch.no_grad():
        expected = [
            F.cross_entropy(
                model(tokens[s : s + 20][None])[0].double(),
                tokens[s + 1 : s + 21],
            ).item()
            for s in heldout_starts(
                tokens, n_windows=5, length=20, seed=4
            ).tolist()
        ]
    assert np.allclose(got, expected, rtol=1e-5)
    assert got.mean() == pytest.approx(
        heldout_loss(model, tokens, n_windows=5, length=20, seed=4), rel=1e-5
    )


def test_bootstrap_mean_interval():
    """Degenerate for constant samples; for a large Gaussian sample, close to
    the normal interval mean +- 1.645 sd / sqrt(n) at level 0.9; reproducible
    for a seed; errors for bad input."""
    assert bootstrap_mean_interval(np.full(10, 2.5)) == (2.5, 2.5)
    samples = np.random.default_rng(1).normal(size=400)
    low, high = bootstrap_mean_interval(
        samples, n_resamples=4000, level=0.9, seed=3
    )
    half = 1.645 * samples.std() / np.sqrt(samples.size)
    assert low < samples.mean() < high
    assert (high - low) / 2 == pytest.approx(half, rel=0.1)
    assert bootstrap_mean_interval(samples, seed=3) == bootstrap_mean_interval(
        samples, seed=3
    )
    wider = bootstrap_mean_interval(
        samples, n_resamples=4000, level=0.99, seed=3
    )
    assert wider[0] < low and wider[1] > high
    for bad, match in (
        ([1.0], "at least 2"),
        (np.ones((2, 2)), "one-dimensional"),
    ):
        with pytest.raises(ValueError, match=match):
            bootstrap_mean_interval(bad)
    with pytest.raises(ValueError, match="level"):
        bootstrap_mean_interval(samples, level=1.0)


def test_unigram_loss_against_a_hand_count():
    """Trained on "abracadabra" over the vocabulary a, b, c, d, r, z: counts
    5, 2, 1, 1, 2, 0, plus one each, out of 11 + 6 = 17."""
    vocab = "abcdrz"
    train = torch.tensor([vocab.index(c) for c in "abracadabra"])
    by_hand = np.log(np.array([6, 3, 2, 2, 3, 1]) / 17)
    assert np.allclose(unigram_log_probs(train, 6).numpy(), by_hand)
    # "zab": z unseen in training, a and b seen
    zab = torch.tensor([5, 0, 1])
    expected = -(np.log(1 / 17) + np.log(6 / 17) + np.log(3 / 17)) / 3
    assert unigram_loss(train, zab, 6) == pytest.approx(expected, rel=1e-12)
    # smoothing 0.5: counts + 0.5 out of 11 + 3
    assert unigram_loss(train, zab, 6, smoothing=0.5) == pytest.approx(
        -(np.log(0.5 / 14) + np.log(5.5 / 14) + np.log(2.5 / 14)) / 3,
        rel=1e-12,
    )
    # numpy ids work too
    assert unigram_loss(train.numpy(), zab.numpy(), 6) == pytest.approx(
        expected, rel=1e-12
    )


def test_unigram_window_losses_score_the_targets_of_the_heldout_windows():
    """The same windows and predicted characters as heldout_window_losses: a
    loop over heldout_starts, by hand."""
    gen = torch.Generator().manual_seed(0)
    train = torch.randint(5, (200,), generator=gen)
    tokens = torch.randint(7, (300,), generator=gen)
    counts = np.bincount(train.numpy(), minlength=7) + 1.0
    log_p = np.log(counts / counts.sum())
    got = unigram_window_losses(
        train, tokens, 7, n_windows=5, length=20, seed=4
    )
    assert got.shape == (5,) and got.dtype == np.float64
    expected = [
        -log_p[tokens[s + 1 : s + 21].numpy()].mean()
        for s in heldout_starts(tokens, n_windows=5, length=20, seed=4)
    ]
    assert np.allclose(got, expected, rtol=1e-12)


@pytest.mark.parametrize(
    "train, tokens, vocab_size, smoothing, match",
    [
        ([0, 1, 7], [0, 1], 5, 1.0, "train_tokens holds ids from 0 to 7"),
        ([0, 1], [-1, 1], 5, 1.0, "eval_tokens holds ids from -1"),
        ([[0, 1]], [0, 1], 5, 1.0, "train_tokens must be a non-empty 1-D"),
        ([0, 1], [], 5, 1.0, "eval_tokens must be a non-empty 1-D"),
        ([0.0, 1.0], [0, 1], 5, 1.0, "dtype torch.float"),
        ([0, 1], [0, 1], 5, 0.0, "smoothing must be positive"),
        ([0, 1], [0, 1], 0, 1.0, "vocab_size"),
    ],
)
def test_unigram_loss_errors(train, tokens, vocab_size, smoothing, match):
    with pytest.raises(ValueError, match=match):
        unigram_loss(
            torch.tensor(train), torch.tensor(tokens), vocab_size, smoothing
        )
