"""The associative-recall experiment of chapter 3
(attnbook.experiments.recall)."""

import numpy as np
import pytest
import torch

from attnbook.experiments import recall


def test_recall_batch_answers_are_the_values_of_the_matching_keys():
    query, keys, values, target = recall.recall_batch(
        256, 6, 10, 5, torch.Generator().manual_seed(0)
    )
    assert query.shape == target.shape == (
        256,
    ) and keys.shape == values.shape == (256, 6)
    for b in range(256):
        assert len(set(keys[b].tolist())) == 6  # distinct keys
        (where,) = torch.nonzero(keys[b] == query[b], as_tuple=True)
        assert where.numel() == 1 and values[b, where.item()] == target[b]
    assert keys.max() < 10 and values.max() < 5
    with pytest.raises(ValueError, match="n_pairs"):
        recall.recall_batch(4, 11, 10, 5, torch.Generator())


def test_the_model_divides_its_scores_by_sqrt_d_k_only_when_scaled():
    torch.manual_seed(0)
    scaled = recall.RecallAttention(10, 5, 8, 36, scaled=True)
    unscaled = recall.RecallAttention(10, 5, 8, 36, scaled=False)
    unscaled.load_state_dict(scaled.state_dict())
    query, keys, values, _ = recall.recall_batch(
        4, 6, 10, 5, torch.Generator().manual_seed(1)
    )
    torch.testing.assert_close(
        scaled.scores(query, keys) * 6.0, unscaled.scores(query, keys)
    )
    logits, weights = scaled(query, keys, values)
    assert logits.shape == (4, 5) and weights.shape == (4, 6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(4))


def test_score_table_lookup_equals_projecting_every_token():
    # The model looks scores up in a (n_symbols, n_symbols) table; recompute
    # them the direct way: project the query token and every key token, then
    # take their dot products.
    torch.manual_seed(1)
    for scaled in (True, False):
        model = recall.RecallAttention(10, 5, 8, 36, scaled=scaled).double()
        query, keys, values, _ = recall.recall_batch(
            6, 4, 10, 5, torch.Generator().manual_seed(2)
        )
        with torch.no_grad():
            # (6, 36)
            q = model.key_embedding.weight[query] @ model.q_proj.weight.T
            # (6, 4, 36)
            k = model.key_embedding.weight[keys] @ model.k_proj.weight.T
            direct = torch.einsum("bd,bpd->bp", q, k) / (
                6.0 if scaled else 1.0
            )
            # (6, 4, 8)
            v = model.value_embedding.weight[values] @ model.v_proj.weight.T
            out = torch.einsum("bp,bpd->bd", torch.softmax(direct, -1), v)
            logits_direct = out @ model.readout.weight.T + model.readout.bias
            logits, weights = model(query, keys, values)
        torch.testing.assert_close(
            model.scores(query, keys)[:, 0], direct, rtol=1e-12, atol=1e-12
        )
        torch.testing.assert_close(
            weights, torch.softmax(direct, -1), rtol=1e-12, atol=1e-12
        )
        torch.testing.assert_close(
            logits, logits_direct, rtol=1e-12, atol=1e-12
        )


def test_nudge_parameters_moves_every_weight_by_exactly_one_ulp():
    torch.manual_seed(0)
    model = recall.RecallAttention(10, 5, 8, 12)
    before = {
        name: p.detach().numpy().copy() for name, p in model.named_parameters()
    }
    recall.nudge_parameters(model, 1)
    for name, p in model.named_parameters():
        x, y = before[name], p.detach().numpy()
        assert x.dtype == y.dtype == np.float32
        # numpy's nextafter as the reference, and the bit patterns: one step of
        # the integer code, up for positive numbers and down (towards 0) for
        # negative ones
        np.testing.assert_array_equal(y, np.nextafter(x, np.float32(np.inf)))
        step = y.view(np.int32).astype(np.int64) - x.view(np.int32).astype(
            np.int64
        )
        np.testing.assert_array_equal(step, np.where(x > 0, 1, -1))
        assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-23)
    recall.nudge_parameters(model, -1)  # one ulp back down undoes it exactly
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), before[name])
    recall.nudge_parameters(model, 3)
    np.testing.assert_array_equal(
        model.readout.bias.detach().numpy(),
        np.nextafter(
            np.nextafter(np.nextafter(before["readout.bias"], np.inf), np.inf),
            np.inf,
        ).astype(np.float32),
    )


def test_init_std_sets_the_projection_weights():
    torch.manual_seed(0)
    model = recall.RecallAttention(10, 5, 64, 256, init_std=0.5)
    assert abs(model.q_proj.weight.std().item() - 0.5) < 0.02
    assert abs(model.k_proj.weight.std().item() - 0.5) < 0.02


def test_additive_scores_are_w_dot_tanh_of_q_plus_k_for_every_pair():
    torch.manual_seed(4)
    model = recall.AdditiveRecallAttention(10, 5, 8, 12).double()
    query, keys, values, _ = recall.recall_batch(
        5, 4, 10, 5, torch.Generator().manual_seed(5)
    )
    # (12,)
    w = model.score_vector.weight[0]
    with torch.no_grad():
        # one pair at a time
        for b in range(5):
            # (12,)
            q = model.q_proj.weight @ model.key_embedding.weight[query[b]]
            for p in range(4):
                k = (
                    model.k_proj.weight
                    @ model.key_embedding.weight[keys[b, p]]
                )
                expected = (w * torch.tanh(q + k)).sum()
                torch.testing.assert_close(
                    model.scores(query, keys)[b, 0, p],
                    expected,
                    rtol=1e-12,
                    atol=1e-12,
                )
        logits, weights = model(query, keys, values)
    assert logits.shape == (5, 5) and weights.shape == (5, 4)
    with pytest.raises(ValueError, match="additive scores have no 1/sqrt"):
        recall.AdditiveRecallAttention(10, 5, 8, 12, scaled=True)


def test_additive_scores_start_with_a_spread_that_does_not_grow_with_d_k():
    for d_k in (16, 1024):
        torch.manual_seed(0)
        table = (
            recall.AdditiveRecallAttention(16, 16, 32, d_k)
            .score_table()
            .detach()
        )
        # var(w . tanh) <= d_k * 1/(3 d_k) = 1/3
        assert 0.1 < table.std().item() < 0.58
    run = recall.train_recall(
        256, False, steps=150, lr=5e-3, seed=0, additive=True
    )
    assert run.accuracy > 0.95 and run.score_std[0] < 0.58


def test_training_is_seeded_and_learns():
    a = recall.train_recall(16, True, steps=150, lr=1e-2, seed=3)
    b = recall.train_recall(16, True, steps=150, lr=1e-2, seed=3)
    np.testing.assert_array_equal(a.losses, b.losses)
    assert a.losses.shape == (150,)
    assert np.mean(a.losses[-20:]) < 0.25 * np.mean(a.losses[:20])
    assert a.accuracy > 0.9
    # the attention sharpens as it learns where to look
    assert a.entropy[1] < a.entropy[0]


def test_a_perturbed_start_changes_the_weights_but_not_the_data():
    base = recall.train_recall(16, True, steps=5, lr=1e-3, seed=0)
    same = recall.train_recall(
        16, True, steps=5, lr=1e-3, seed=0, perturb_ulps=0
    )
    nudged = recall.train_recall(
        16, True, steps=5, lr=1e-3, seed=0, perturb_ulps=1
    )
    np.testing.assert_array_equal(base.losses, same.losses)
    # the start moved...
    assert base.entropy[0] != nudged.entropy[0]
    # ...by a rounding error
    assert base.entropy[0] == pytest.approx(nudged.entropy[0], rel=1e-6)
    np.testing.assert_allclose(base.losses, nudged.losses, rtol=1e-5)
    assert (
        0 < base.held_out_loss
        and abs(base.held_out_loss - nudged.held_out_loss) < 1e-4
    )


def test_raw_scores_move_further_in_the_first_steps():
    # Same seed: same initial weights (up to the scale) and the same batches.
    scaled = recall.train_recall(256, True, steps=5, lr=1e-3, seed=0)
    raw = recall.train_recall(256, False, steps=5, lr=1e-3, seed=0)
    assert 0 < scaled.early_score_change < raw.early_score_change
    # at initialisation the raw scores are exactly sqrt(d_k) = 16 times the
    # scaled ones
    assert raw.score_std[0] == pytest.approx(
        16 * scaled.score_std[0], rel=1e-5
    )


def test_early_steps_must_fit_in_the_run():
    with pytest.raises(
        ValueError, match=r"early_steps must lie in \[1, steps=3\]; got 4"
    ):
        recall.train_recall(16, True, steps=3, early_steps=4)


@pytest.mark.parametrize("d_k", [16, 256])
def test_the_scale_is_an_exact_reparametrisation(d_k):
    """A twin without the scale, W_q sqrt(d_k) smaller, trained with a
    sqrt(d_k) smaller learning rate, gives the scaled model's logits to the
    last bit; with the common learning rate it does not."""
    assert recall.reparametrisation_gap(d_k, steps=20) == 0.0
    assert recall.reparametrisation_gap(d_k, steps=20, rescale_lr=False) > 1e-3


def test_reparametrisation_needs_a_power_of_four():
    with pytest.raises(ValueError, match="power of 4"):
        recall.reparametrisation_gap(32, steps=1)


def test_query_blind_accuracy_is_the_mode_readout_of_the_values():
    # Brute force over every assignment of values: the best query-blind answer
    # is the most frequent value.
    import itertools

    for n_pairs, n_values in ((1, 3), (3, 4), (4, 3), (5, 2)):
        total = sum(
            max(c.count(v) for v in set(c))
            for c in itertools.product(range(n_values), repeat=n_pairs)
        )
        exact = total / n_values**n_pairs / n_pairs
        assert recall.query_blind_accuracy(n_pairs, n_values) == pytest.approx(
            exact, rel=1e-15
        )
    # Against sampling recall_batch itself, at the chapter's sizes: answer the
    # mode of the values.
    _, _, values, target = recall.recall_batch(
        100_000, 8, 16, 16, torch.Generator().manual_seed(3)
    )
    # (batch, 16)
    counts = torch.nn.functional.one_hot(values, 16).sum(1)
    is_mode = counts.gather(1, target[:, None])[:, 0] == counts.max(1).values
    # a mode answer is right with probability (number of pairs holding the
    # mode) / n_pairs
    sampled = (counts.max(1).values.double() / 8).mean().item()
    assert abs(sampled - recall.query_blind_accuracy(8, 16)) < 0.005
    # the target is a mode at least that often
    assert is_mode.double().mean().item() > sampled
    assert recall.query_blind_accuracy(1, 16) == 1.0
    with pytest.raises(ValueError, match="n_pairs"):
        recall.query_blind_accuracy(0, 16)


def test_attends_to_match_counts_queries_whose_largest_weight_is_on_the_matching_key():
    run = recall.train_recall(16, True, steps=150, lr=1e-2, seed=3)
    # Recompute the start value independently: the untrained model with the
    # run's seed, on the run's held-out batch (seed + 2), checking for each
    # example the key under its largest weight.
    torch.manual_seed(3)
    model = recall.RecallAttention(16, 16, 32, 16, True)
    query, keys, values, target = recall.recall_batch(
        512, 8, 16, 16, torch.Generator().manual_seed(5)
    )
    with torch.no_grad():
        _, weights = model(query, keys, values)
    hits = sum(
        int(keys[b, int(weights[b].argmax())] == query[b]) for b in range(512)
    )
    assert 0.0 <= run.attends_to_match[0] <= 1.0
    # learned: attention finds the key
    assert run.attends_to_match[1] > 0.9 and run.accuracy > 0.9
    # the start value is that of the untrained model on the run's held-out
    # batch (seed + 2)
    held_out = recall.recall_batch(
        512, 8, 16, 16, torch.Generator().manual_seed(5)
    )
    assert held_out[0].equal(query)
    assert run.attends_to_match[0] == pytest.approx(hits / 512, abs=1e-12)


def test_runs_trained_together_are_the_runs_of_train_recall():
    """Stacked training (vmap over the runs) rearranges the arithmetic of
    train_recall, nothing else: the same initial weights, batches and probes;
    scaled runs (not chaotic) end where train_recall's do."""
    together = recall.train_recall_seeds(
        16, True, seeds=[0, 3], lrs=(1e-3, 1e-2), steps=40, early_steps=4
    )
    assert set(together) == {(1e-3, 0), (1e-3, 3), (1e-2, 0), (1e-2, 3)}
    for (lr, seed), run in together.items():
        alone = recall.train_recall(
            16, True, steps=40, lr=lr, seed=seed, early_steps=4
        )
        assert run.losses.shape == (40,)
        # same start
        assert (
            run.score_std[0] == alone.score_std[0]
            and run.entropy[0] == alone.entropy[0]
        )
        assert run.attends_to_match[0] == alone.attends_to_match[0]
        # same batches, rounding apart
        np.testing.assert_allclose(run.losses, alone.losses, rtol=1e-5)
        assert run.losses[0] == pytest.approx(alone.losses[0], rel=1e-6)
        assert run.early_score_change == pytest.approx(
            alone.early_score_change, rel=1e-4
        )
        assert run.accuracy == alone.accuracy
        assert run.held_out_loss == pytest.approx(
            alone.held_out_loss, rel=1e-4
        )
        assert run.entropy[1] == pytest.approx(alone.entropy[1], rel=1e-4)
    # the two learning rates really differ, per run
    assert together[1e-2, 0].losses[-1] < 0.5 * together[1e-3, 0].losses[-1]


def test_a_run_trained_together_does_not_depend_on_the_other_runs_of_the_stack():
    both = recall.train_recall_seeds(
        256, False, seeds=[0, 1], lrs=(1e-3, 5e-3), steps=30
    )
    one = recall.train_recall_seeds(
        256, False, seeds=[1], lrs=[5e-3], steps=30
    )
    np.testing.assert_array_equal(both[5e-3, 1].losses, one[5e-3, 1].losses)
    assert both[5e-3, 1].accuracy == one[5e-3, 1].accuracy


def test_runs_trained_together_keep_their_options():
    nudged = recall.train_recall_seeds(
        16, True, seeds=[0], lrs=[1e-3], steps=5, perturb_ulps=1
    )[1e-3, 0]
    assert (
        nudged.entropy[0]
        == recall.train_recall(
            16, True, steps=5, lr=1e-3, seed=0, perturb_ulps=1
        ).entropy[0]
    )
    wide = recall.train_recall_seeds(
        64, True, seeds=[2], lrs=[1e-3], steps=5, init_std=32**-0.5
    )[1e-3, 2]
    assert (
        wide.score_std[0]
        == recall.train_recall(
            64, True, steps=5, lr=1e-3, seed=2, init_std=32**-0.5
        ).score_std[0]
    )
    additive = recall.train_recall_seeds(
        64, False, seeds=[1], lrs=[5e-3], steps=20, additive=True
    )[5e-3, 1]
    alone = recall.train_recall(
        64, False, steps=20, lr=5e-3, seed=1, additive=True
    )
    assert additive.score_std[0] == alone.score_std[0]
    np.testing.assert_allclose(additive.losses, alone.losses, rtol=1e-5)
    with pytest.raises(ValueError, match="without repeats"):
        recall.train_recall_seeds(16, True, seeds=[0, 0], lrs=[1e-3], steps=5)
    with pytest.raises(
        ValueError, match=r"early_steps must lie in \[1, steps=3\]; got 4"
    ):
        recall.train_recall_seeds(
            16, True, seeds=[0], lrs=[1e-3], steps=3, early_steps=4
        )


def test_scaled_and_raw_runs_trained_in_one_stack_are_those_of_separate_stacks():
    """train_recall_grid stacks both kinds of scores (their divisors are
    buffers): each run is bit for bit the run of a stack of its own kind,
    chaotic raw runs at large d_k included."""
    grid = recall.train_recall_grid(
        256, (True, False), seeds=[0, 2], lrs=(1e-3, 5e-3), steps=40
    )
    assert set(grid) == {
        (lr, scaled, seed)
        for lr in (1e-3, 5e-3)
        for scaled in (True, False)
        for seed in (0, 2)
    }
    for scaled in (True, False):
        alone = recall.train_recall_seeds(
            256, scaled, seeds=[0, 2], lrs=(1e-3, 5e-3), steps=40
        )
        for (lr, seed), run in alone.items():
            together = grid[lr, scaled, seed]
            assert together.scaled is scaled
            np.testing.assert_array_equal(together.losses, run.losses)
            assert together.accuracy == run.accuracy
            assert together.entropy == run.entropy
            assert together.early_score_change == run.early_score_change
    with pytest.raises(ValueError, match="without repeats"):
        recall.train_recall_grid(16, (True, True), seeds=[0], steps=5)
    with pytest.raises(ValueError, match="no 1/sqrt"):
        recall.train_recall_grid(
            16, (True, False), seeds=[0], steps=5, additive=True
        )


def test_the_score_divisor_is_a_buffer_outside_the_state_dict():
    model = recall.RecallAttention(16, 16, 32, 64, scaled=True)
    assert float(model.score_divisor) == 8.0
    assert "score_divisor" not in model.state_dict()
    raw = recall.RecallAttention(16, 16, 32, 64, scaled=False)
    raw.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(
            model.score_table() * 8.0, raw.score_table(), rtol=0, atol=0
        )
