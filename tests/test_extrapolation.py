"""The length-extrapolation experiment: tasks, the tiny model's attention,
training and evaluation."""

import itertools
import math

import numpy as np
import pytest
import torch

from attnbook.experiments import extrapolation as E
from attnbook import positional as P


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- tasks -------------------------------------------------------------------


def test_shifted_copy_targets():
    task = E.ShiftedCopy(vocab=10, shift=3)
    tokens, targets = task.batch(4, 9, torch.Generator().manual_seed(0))
    assert tokens.shape == targets.shape == (4, 9)
    assert (targets[:, :3] == E.IGNORE).all()
    assert torch.equal(targets[:, 3:], tokens[:, :6])
    assert task.best_loss(tokens, targets) == 0.0


def test_order_blind_loss_matches_an_enumeration_of_every_sequence():
    # The best order-blind prediction at t gives each value its count among
    # tokens 0..t-1, over t; average its loss over every sequence of a small
    # vocabulary, each equally likely.
    vocab, shift, n = 3, 2, 6
    task = E.ShiftedCopy(vocab=vocab, shift=shift)
    losses = []
    for seq in itertools.product(range(vocab), repeat=n):
        for t in range(shift, n):
            count = seq[:t].count(seq[t - shift])
            losses.append(-math.log(count / t))
    assert task.order_blind_loss(n) == pytest.approx(
        np.mean(losses), rel=1e-12
    )
    # at t = shift = 1 the one visible other token is the target: zero loss
    assert E.ShiftedCopy(vocab=16, shift=1).order_blind_loss(2) == 0.0
    # it rises with the length and stays below a uniform guess
    book = E.ShiftedCopy()
    values = [book.order_blind_loss(m) for m in (32, 64, 128)]
    assert values == sorted(values)
    assert values[-1] < math.log(16)


def test_order_blind_loss_rejects_a_length_with_nothing_to_score():
    with pytest.raises(ValueError, match="n=3, shift=3"):
        E.ShiftedCopy().order_blind_loss(3)


def test_markov_text_follows_its_table():
    task = E.MarkovText(vocab=4, concentration=1.0, seed=3)
    tokens, targets = task.batch(3000, 40, torch.Generator().manual_seed(0))
    assert (
        torch.equal(targets[:, 1:-1], tokens[:, 2:])
        and (targets[:, [0, -1]] == E.IGNORE).all()
    )
    x = tokens.numpy()
    counts = np.zeros((4, 4, 4))
    np.add.at(
        counts, (x[:, :-2].ravel(), x[:, 1:-1].ravel(), x[:, 2:].ravel()), 1
    )
    empirical = counts / counts.sum(-1, keepdims=True)
    # 114000 transitions over 16 contexts: each row is estimated to within a
    # few per cent
    np.testing.assert_allclose(empirical, task.table.numpy(), atol=0.03)


def test_markov_best_loss_is_the_true_cross_entropy():
    task = E.MarkovText(vocab=5, seed=1)
    tokens, targets = task.batch(3, 6, torch.Generator().manual_seed(2))
    table = task.table.numpy()
    logs = [
        math.log(table[tokens[b, t - 2], tokens[b, t - 1], tokens[b, t]])
        for b in range(3)
        for t in range(2, 6)
    ]
    assert task.best_loss(tokens, targets) == pytest.approx(-np.mean(logs))


def test_markov_text_is_seeded_and_rejects_short_sequences():
    a = E.MarkovText(seed=5).batch(2, 8, torch.Generator().manual_seed(1))[0]
    b = E.MarkovText(seed=5).batch(2, 8, torch.Generator().manual_seed(1))[0]
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="at least 3"):
        E.MarkovText().batch(2, 2, torch.Generator())


# --- the model ---------------------------------------------------------------


@pytest.mark.parametrize("scheme", E.SCHEMES)
def test_model_is_causal(scheme):
    torch.manual_seed(0)
    model = E.TinyCausalLM(12, scheme, train_length=10).eval()
    tokens = torch.randint(12, (2, 10))
    changed = tokens.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 12
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 10, 12)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def reference_attention(attn, x, scheme):
    """The attention layer recomputed in float64 numpy, from its weights."""
    b, n, d = x.shape
    h = attn.n_heads
    q, k, v = (
        (x.double().numpy() @ proj.weight.detach().double().numpy().T)
        .reshape(b, n, h, d // h)
        .transpose(0, 2, 1, 3)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
    )
    if scheme == "rope":
        q, k = (P.apply_rope(torch.from_numpy(t)).numpy() for t in (q, k))
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // h)
    if scheme == "alibi":
        i = np.arange(n)
        s = s - P.alibi_slopes(h)[:, None, None] * (i[:, None] - i[None, :])
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    o = (e / e.sum(-1, keepdims=True)) @ v
    o = o.transpose(0, 2, 1, 3).reshape(b, n, d)
    return o @ attn.out_proj.weight.detach().double().numpy().T


@pytest.mark.parametrize("scheme", ["none", "rope", "alibi"])
def test_attention_layer_matches_a_numpy_reference(scheme):
    torch.manual_seed(1)
    attn = E.PositionalAttention(16, 4, scheme)
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        got = attn(x, is_causal=True).double().numpy()
    np.testing.assert_allclose(
        got, reference_attention(attn, x, scheme), atol=1e-5
    )


def test_window_restricts_attention():
    torch.manual_seed(2)
    block = E.Block(8, 2, "rope")
    attn = block.attn
    x = torch.randn(1, 6, 8)
    with torch.no_grad():
        torch.testing.assert_close(block(x, window=6), block(x))
        # window 1: each query sees itself
        h = block.ln1(x)
        after_attn = x + attn.v_proj(h) @ attn.out_proj.weight.T
        torch.testing.assert_close(
            block(x, window=1), after_attn + block.mlp(block.ln2(after_attn))
        )


def test_learned_positions_stop_at_the_table():
    torch.manual_seed(0)
    model = E.TinyCausalLM(8, "learned", train_length=6)
    with pytest.raises(
        ValueError, match="learned positions exist for 0..5 only"
    ):
        model(torch.zeros(1, 7, dtype=torch.long))
    model.clip_positions = True
    x = (
        model.embed(torch.zeros(1, 9, dtype=torch.long))
        + model.positions.weight[[0, 1, 2, 3, 4, 5, 5, 5, 5]]
    )
    assert torch.equal(
        model(torch.zeros(1, 9, dtype=torch.long)),
        model.head(model.ln(model.blocks[1](model.blocks[0](x)))),
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(scheme="relative"), "scheme must be one of"),
        (dict(scheme="rope", train_length=0), "train_length"),
        (dict(scheme="rope", d_model=30, n_heads=4), "divisible"),
    ],
)
def test_model_bad_arguments(bad, message):
    with pytest.raises(ValueError, match=message):
        E.TinyCausalLM(8, **{"train_length": 8, **bad})


# --- training and evaluation -------------------------------------------------


def test_training_is_repeatable_and_learns_the_copy_task():
    task = E.ShiftedCopy(vocab=8, shift=2)
    a = E.train_and_evaluate(task, "rope", 16, (16, 32), steps=150)
    b = E.train_and_evaluate(task, "rope", 16, (16, 32), steps=150)
    np.testing.assert_array_equal(a.losses, b.losses)
    # log(8) = 2.08 at the start
    assert a.losses[:10].mean() > 1.5 and a.losses[-10:].mean() < 0.2
    ev = a.evaluations[16]
    assert ev.accuracy > 0.9 and ev.length == 16 and ev.best_loss == 0.0
    assert (
        ev.position_accuracy.shape == (16,)
        and np.isnan(ev.position_accuracy[:2]).all()
    )
    assert a.evaluations[32].position_loss.shape == (32,)


def test_evaluation_of_learned_positions_beyond_the_table_clips():
    run = E.train_and_evaluate(E.ShiftedCopy(), "learned", 8, (8, 16), steps=5)
    assert set(run.evaluations) == {8, 16} and not run.model.clip_positions


def test_same_data_for_every_scheme():
    task = E.MarkovText()
    a = E.held_out(task, 20, 4, seed=0)
    b = E.held_out(task, 20, 4, seed=0)
    assert torch.equal(a[0], b[0]) and not torch.equal(
        a[0], E.held_out(task, 20, 4, seed=1)[0]
    )


def test_evaluate_at_matches_the_runs_own_evaluation_and_restores_the_model():
    task = E.ShiftedCopy(vocab=8, shift=2)
    run = E.train_and_evaluate(task, "learned", 8, (8, 16), steps=20, seed=3)
    full = E.evaluate_at(run.model, task, 16, seed=3)
    # the same held-out sequences
    assert full.loss == run.evaluations[16].loss
    # window >= n: no change
    assert (
        E.evaluate_at(run.model, task, 16, seed=3, window=16).loss == full.loss
    )
    windowed = E.evaluate_at(run.model, task, 16, seed=3, window=2)
    # by hand: the same model with the window set, on the same sequences
    run.model.window, run.model.clip_positions = 2, True
    expected = E.evaluate(
        run.model, task, *E.held_out(task, 16, E.EVAL_BATCH, 3)
    )
    run.model.window, run.model.clip_positions = None, False
    assert windowed.loss == expected.loss and windowed.loss != full.loss
    E.evaluate_at(run.model, task, 16, seed=3, window=2)
    assert run.model.window is None and not run.model.clip_positions


@pytest.mark.parametrize(
    "n_q, n_k, max_offset", [(5, 5, 2), (3, 7, 1), (6, 6, 0), (4, 4, 10)]
)
def test_clipped_offset_bias_scores_far_keys_at_the_clipped_offset(
    n_q, n_k, max_offset
):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, n_q, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, n_k, 8, generator=g, dtype=torch.float64)
    got = P.apply_rope(q, torch.arange(n_k - n_q, n_k)) @ P.apply_rope(
        k
    ).transpose(-2, -1) + E.clipped_offset_bias(q, k, max_offset)
    # independently, pair by pair: rotate q and k to positions whose difference
    # is the clipped offset
    for i in range(n_q):
        for j in range(n_k):
            offset = i + n_k - n_q - j
            c = min(offset, max_offset)
            expected = (
                P.apply_rope(q[..., i : i + 1, :], torch.tensor([c + j]))
                * P.apply_rope(k[..., j : j + 1, :], torch.tensor([j]))
            ).sum(-1)[..., 0]
            torch.testing.assert_close(
                got[..., i, j], expected, rtol=1e-12, atol=1e-12
            )
    with pytest.raises(ValueError, match="max_offset must be >= 0"):
        E.clipped_offset_bias(q, k, -1)


def test_evaluate_at_with_clipped_offsets():
    task = E.ShiftedCopy(vocab=8, shift=2)
    run = E.train_and_evaluate(task, "rope", 8, (16,), steps=20, seed=3)
    full = E.evaluate_at(run.model, task, 16, seed=3)
    assert E.evaluate_at(
        run.model, task, 16, seed=3, max_offset=15
    ).loss == pytest.approx(full.loss, abs=1e-5)
    clipped = E.evaluate_at(run.model, task, 16, seed=3, max_offset=3)
    assert abs(clipped.loss - full.loss) > 1e-3
    # restored
    assert all(block.attn.max_offset is None for block in run.model.blocks)
    learned = E.train_and_evaluate(task, "learned", 8, (8,), steps=2, seed=0)
    with pytest.raises(
        ValueError,
        match="max_offset clips RoPE's offsets; this model is 'learned'",
    ):
        E.evaluate_at(learned.model, task, 16, max_offset=3)


def test_lr_reaches_the_optimizer():
    task = E.ShiftedCopy(vocab=8, shift=2)
    torch.manual_seed(0)
    # train_and_evaluate's seed-0 init
    start = E.TinyCausalLM(8, "rope", 8).state_dict()
    for lr, low, high in ((1e-6, 0.0, 1e-5), (1e-2, 1e-3, math.inf)):
        # Adam moves each weight by about lr per step
        run = E.train_and_evaluate(task, "rope", 8, (8,), steps=3, lr=lr)
        moved = max(
            (run.model.state_dict()[k] - v).abs().max().item()
            for k, v in start.items()
        )
        assert low < moved < high


def test_set_rope_frequencies():
    torch.manual_seed(0)
    model = E.TinyCausalLM(8, "rope", 8, d_model=16, n_heads=2).eval()
    tokens = torch.randint(8, (2, 8))
    with torch.no_grad():
        base = model(tokens)
        # the default frequencies
        E.set_rope_frequencies(model, P.pair_frequencies(8))
        torch.testing.assert_close(model(tokens), base)
        E.set_rope_frequencies(
            model, P.interpolated_frequencies(8, 10000.0, 4.0), logit_scale=1.2
        )
        assert not torch.allclose(model(tokens), base)
        E.set_rope_frequencies(model)
        torch.testing.assert_close(model(tokens), base)
    with pytest.raises(ValueError, match="only a RoPE model"):
        E.set_rope_frequencies(E.TinyCausalLM(8, "alibi", 8), None)


def test_count_parameters():
    model = E.TinyCausalLM(
        16, "learned", 32, d_model=32, n_heads=4, n_layers=2
    )
    d, v = 32, 16
    per_block = (
        2 * 2 * d + 3 * d * d + d * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
    )
    expected = v * d + 32 * d + 2 * per_block + 2 * d + d * v + v
    assert E.count_parameters(model) == expected


def test_fine_tune_trains_a_copy_and_keeps_its_stretched_rope():
    task = E.ShiftedCopy()
    run = E.train_and_evaluate(
        task,
        "rope",
        16,
        (16,),
        steps=20,
        seed=0,
        d_model=16,
        n_heads=2,
        n_layers=1,
    )
    freqs = P.interpolated_frequencies(8, 10000.0, 2)
    E.set_rope_frequencies(run.model, freqs, 1.5)
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    tuned = E.fine_tune(run.model, task, 32, steps=5, seed=0)
    # the original is untouched; the copy moved, and rotates with the stretched
    # table
    assert all(
        torch.equal(before[k], v) for k, v in run.model.state_dict().items()
    )
    assert any(
        not torch.equal(before[k], v) for k, v in tuned.state_dict().items()
    )
    assert all(
        b.attn.frequencies is not None and b.attn.logit_scale == 1.5
        for b in tuned.blocks
    )
    # repeatable, and the data are those of length 32 for this seed (a second
    # call gives the same weights)
    again = E.fine_tune(run.model, task, 32, steps=5, seed=0)
    assert all(
        torch.equal(v, again.state_dict()[k])
        for k, v in tuned.state_dict().items()
    )
    # learned positions past the table are clipped while fine-tuning, and left
    # unclipped after
    learned = E.train_and_evaluate(
        task,
        "learned",
        16,
        (16,),
        steps=2,
        seed=0,
        d_model=16,
        n_heads=2,
        n_layers=1,
    )
    assert (
        E.fine_tune(learned.model, task, 32, steps=2).clip_positions is False
    )
    with pytest.raises(ValueError, match="steps"):
        E.fine_tune(run.model, task, 32, steps=0)


# --- several seeds trained together ------------------------------------------


@pytest.mark.parametrize("scheme", E.SCHEMES)
def test_train_together_is_separate_trainings(scheme):
    # in float64, so that the batched computation and the one-at-a-time one
    # agree to rounding
    task = E.MarkovText()
    data = [
        task.batch(6 * 4, 12, torch.Generator().manual_seed(s))
        for s in range(3)
    ]
    alone, together = [], []
    for s in range(3):
        torch.manual_seed(s)
        alone.append(
            E.TinyCausalLM(
                16, scheme, 12, d_model=16, n_heads=2, n_layers=2
            ).double()
        )
        together.append(__import__("copy").deepcopy(alone[-1]))
    losses_alone = np.stack(
        [E.train(m, *d, batch=4) for m, d in zip(alone, data)]
    )
    losses = E.train_together(
        together,
        torch.stack([d[0] for d in data]),
        torch.stack([d[1] for d in data]),
        batch=4,
    )
    assert losses.shape == (3, 6)
    np.testing.assert_allclose(losses, losses_alone, rtol=1e-10)
    # three different models
    assert losses[:, 0].std() > 1e-3
    for a, b in zip(alone, together):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-9, atol=1e-12, msg=name)


def test_train_together_rejects_mismatched_inputs():
    models = [
        E.TinyCausalLM(8, "rope", 8, d_model=16, n_heads=2) for _ in range(2)
    ]
    tokens = torch.zeros(3, 4, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"n_models=2"):
        E.train_together(models, tokens, tokens)
    with pytest.raises(ValueError, match="one architecture"):
        E.train_together(
            [models[0], E.TinyCausalLM(8, "alibi", 8, d_model=16, n_heads=2)],
            tokens[:2],
            tokens[:2],
        )


def test_train_and_evaluate_seeds_matches_one_seed_at_a_time():
    task = E.ShiftedCopy(vocab=8, shift=2)
    runs = E.train_and_evaluate_seeds(
        task, "rope", 8, (8, 16), seeds=(3, 5), steps=20, d_model=16, n_heads=2
    )
    for seed, run in zip((3, 5), runs):
        alone = E.train_and_evaluate(
            task,
            "rope",
            8,
            (8, 16),
            steps=20,
            seed=seed,
            d_model=16,
            n_heads=2,
        )
        # float32: rounding only
        np.testing.assert_allclose(run.losses, alone.losses, rtol=1e-4)
        for n in (8, 16):
            assert run.evaluations[n].loss == pytest.approx(
                alone.evaluations[n].loss, rel=1e-3
            )
            assert run.evaluations[n].length == n
        assert not run.model.clip_positions


def test_fine_tune_seeds_matches_fine_tune():
    task = E.ShiftedCopy()
    runs = E.train_and_evaluate_seeds(
        task,
        "rope",
        16,
        (16,),
        seeds=(0, 1),
        steps=10,
        d_model=16,
        n_heads=2,
        n_layers=1,
    )
    models = [r.model.double() for r in runs]
    freqs = P.interpolated_frequencies(8, 10000.0, 2)
    for m in models:
        E.set_rope_frequencies(m, freqs, 1.5)
    before = [
        {k: v.clone() for k, v in m.state_dict().items()} for m in models
    ]
    tuned = E.fine_tune_seeds(models, task, 32, steps=4, seeds=(0, 1))
    for seed, m, b, t in zip((0, 1), models, before, tuned):
        # originals untouched
        assert all(torch.equal(b[k], v) for k, v in m.state_dict().items())
        one = E.fine_tune(m, task, 32, steps=4, seed=seed)
        for k, v in one.state_dict().items():
            torch.testing.assert_close(
                t.state_dict()[k], v, rtol=1e-9, atol=1e-12
            )
        assert all(
            blk.attn.logit_scale == 1.5
            and np.array_equal(blk.attn.frequencies, freqs)
            for blk in t.blocks
        )
        assert t.clip_positions is False
    with pytest.raises(ValueError, match="one seed per model"):
        E.fine_tune_seeds(models, task, 32, steps=2, seeds=(0,))
    E.set_rope_frequencies(models[1])
    with pytest.raises(ValueError, match="same RoPE frequencies"):
        E.fine_tune_seeds(models, task, 32, steps=2, seeds=(0, 1))
