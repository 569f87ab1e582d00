"""The MQAR experiment (attnbook.experiments.mqar): its batches, one tiny
configuration of its training run for each kind of layer, the committed grid
(attnbook/data/mqar_results.json) and the verdicts chapter 16 prints from it,
and one run of the grid retrained."""

import json
import pathlib

import pytest
import torch

from attnbook.experiments import mqar
from attnbook.experiments.mqar import mqar_batch, train_mqar


def test_batches_pair_each_query_with_its_value():
    g = torch.Generator().manual_seed(0)
    ids, targets, queries = mqar_batch(5, 20, 3, g)
    assert ids.shape == targets.shape == queries.shape == (3, 15)
    for row, target in zip(ids, targets):
        keys, values = row[0:10:2], row[1:10:2]
        assert len(set(keys.tolist())) == 5 and int(keys.max()) < 10
        assert int(values.min()) >= 10
        lookup = dict(zip(keys.tolist(), values.tolist()))
        for t in range(10, 15):
            assert target[t] == lookup[int(row[t])]
        assert (target[:10] == -100).all()
    with pytest.raises(ValueError, match="distinct keys"):
        mqar_batch(11, 20, 1, g)


@pytest.mark.parametrize(
    "layers", [("attention",), ("delta",), ("gated_delta", "attention")]
)
def test_one_tiny_configuration_trains(layers, one_torch_thread):
    accuracy = train_mqar(
        layers, n_pairs=4, seed=0, steps=3, batch=4, vocab_size=16, d_model=16
    )
    assert 0.0 <= accuracy <= 1.0


# --- the committed grid (attnbook/data/mqar_results.json) --------------------

NOTEBOOK = pathlib.Path(__file__).parents[1] / "book" / "15-delta-rule.ipynb"


@pytest.fixture(scope="module")
def results():
    return mqar.load_results()


def test_the_results_file_is_well_formed(results):
    for key in (
        "script",
        "machine",
        "torch",
        "git_commit",
        "date_utc",
        "wall_s",
        "cpu_s",
    ):
        assert results[key], key
    hp = results["hyperparameters"]
    assert set(hp) == set(mqar.HYPERPARAMETERS)
    # one learning rate for every model, chosen on a seed that is not one
    # of the grid's (mqar.LR_RULE), and recorded per model
    assert mqar.LR_SEED not in results["seeds"]
    assert results["lr_rule"] == mqar.LR_RULE
    assert results["lr_sweep"] is None
    assert hp["lr"] == {m: mqar.HYPERPARAMETERS["lr"] for m in mqar.MODELS}
    assert results["models"] == {
        name: list(layers) for name, layers in mqar.MODELS.items()
    }
    assert results["state_numbers_per_linear_layer"] == mqar.state_numbers(
        hp["d_model"], hp["n_heads"]
    )
    n_pairs, seeds = results["n_pairs"], results["seeds"]
    assert len(seeds) == 5 and len(set(seeds)) == 5
    runs = results["runs"]
    assert sorted((r["model"], r["seed"]) for r in runs) == sorted(
        (m, s) for m in mqar.MODELS for s in seeds
    )
    for run in runs:
        assert run["lr"] == hp["lr"][run["model"]]
        assert list(run["accuracy"]) == [str(n) for n in n_pairs]
        for n, a in zip(n_pairs, run["accuracy"].values()):
            # a count of right answers out of eval_batch * n queries
            hits = a * hp["eval_batch"] * n
            assert 0 <= a <= 1 and abs(hits - round(hits)) < 1e-6
        assert run["cpu_s"] > 0
    # the recorded total is the runs' sum
    assert results["cpu_s"] == pytest.approx(
        sum(r["cpu_s"] for r in runs), abs=0.5
    )
    table = mqar.accuracies(results)
    assert all(t.shape == (len(seeds), len(n_pairs)) for t in table.values())


def test_the_learning_rate_rule_takes_the_best_mean_and_the_smaller_on_a_tie():
    def run(model, lr, accuracies):
        return {
            "model": model,
            "lr": lr,
            "accuracy": {str(n): a for n, a in zip((4, 8), accuracies)},
        }

    runs = [
        run("linear", 1e-2, [0.9, 0.5]),
        run("linear", 3e-2, [1.0, 0.3]),
        run("delta", 1e-2, [0.5, 0.5]),
        run("delta", 3e-3, [0.5, 0.5]),
    ]
    assert mqar.choose_lr(runs, (4, 8)) == {"linear": 1e-2, "delta": 3e-3}


def test_the_curriculum_adds_the_pair_counts_one_by_one():
    counts = (4, 8, 16, 32)
    # no curriculum: the counts take turns from the first step
    assert [mqar.curriculum_pairs(counts, s, 100, 0.0) for s in range(8)] == [
        4,
        8,
        16,
        32,
    ] * 2
    staged = [mqar.curriculum_pairs(counts, s, 100, 0.4) for s in range(100)]
    # 40 steps in four stages of 10: first N = 4 alone, then 4 and 8, ...
    assert set(staged[:10]) == {4} and set(staged[10:20]) == {4, 8}
    assert set(staged[20:30]) == {4, 8, 16} and set(staged[40:]) == set(counts)
    assert staged[40:44] == [4, 8, 16, 32]


def _printed_lines(source_marker):
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    (cell,) = [
        c
        for c in nb["cells"]
        if c["cell_type"] == "code" and source_marker in "".join(c["source"])
    ]
    text = "".join(
        "".join(o.get("text", ""))
        for o in cell["outputs"]
        if o["output_type"] == "stream"
    )
    return cell, text.splitlines()


def test_every_verdict_the_notebook_prints_is_recomputed(results):
    cell, lines = _printed_lines("mqar.verdicts(")
    assert "nbval-ignore-output" not in cell["metadata"].get("tags", [])
    expected = mqar.verdicts(results)
    printed = [line for line in lines if line in expected]
    # every verdict printed, in order, and no other line claims one
    assert printed == expected
    assert len(lines) == len(expected)


def _synthetic(tables, n_pairs=(4, 8, 16)):
    runs = [
        {
            "model": name,
            "seed": seed,
            "accuracy": {str(n): float(a) for n, a in zip(n_pairs, row)},
        }
        for name, rows in tables.items()
        for seed, row in enumerate(rows)
    ]
    return {
        "models": {name: list(mqar.MODELS[name]) for name in tables},
        "n_pairs": list(n_pairs),
        "seeds": list(range(len(next(iter(tables.values()))))),
        "runs": runs,
    }


def test_capacity_and_comparisons_hold_in_every_seed_with_a_margin():
    results = _synthetic(
        {
            "softmax": [[1.0, 1.0, 0.996]] * 4 + [[1.0, 1.0, 0.993]],
            "delta": [[1.0, 0.90, 0.40]] * 4 + [[0.999, 0.80, 0.5]],
            "linear": [[0.995, 0.5, 0.2]] * 4 + [[0.97, 0.7, 0.3]],
        }
    )
    # 0.993 lies within the margin of 0.99: N = 16 is on neither side
    assert mqar.capacity(results, "softmax") == (8, None)
    assert mqar.capacity(results, "delta") == (4, 8)
    # one seed misses N = 4: solved nowhere, failed from 8
    assert mqar.capacity(results, "linear") == (None, 8)
    # gaps: 0.4 and 0.1 (seed 4) at N = 8, 0.2 at N = 16; 0.1 < 0.1 + margin
    assert mqar.beaten_at(results, "delta", "linear") == [16]
    # the direction at the largest N: a gap of 0.2 in every seed
    assert mqar.direction_at_largest(results, "delta", "linear") == (5, 0)
    assert mqar.direction_at_largest(results, "linear", "delta") == (0, 5)
    lines = mqar.verdicts(results)
    # the printed thresholds are those the verdicts test, margins included
    assert lines[0] == (
        "softmax attention: accuracy >= 0.995 (0.99 + margin 0.005) in all "
        "5 seeds at N <= 8; below 0.985 (0.99 - margin) in all 5 seeds at "
        "no N"
    )
    assert (
        "DeltaNet beats linear attention by at least 0.12 (0.1 + margin "
        "0.02) in all 5 seeds at N = 16" in lines
    )
    assert lines[-1] == (
        "at N = 16: linear attention ahead of DeltaNet by more than 0.02 in "
        "0 of 5 seeds, behind by more than 0.02 in 5"
    )


def test_the_direction_counts_a_gap_within_the_margin_as_neither():
    results = _synthetic(
        {
            "linear": [[1.0, 0.9, 0.80]] * 3 + [[1.0, 0.9, 0.5]] * 2,
            "delta": [[1.0, 0.9, 0.79]] * 3 + [[1.0, 0.9, 0.6]] * 2,
        }
    )
    # gaps 0.01 (within 0.02) in three seeds, -0.1 in two
    assert mqar.direction_at_largest(results, "linear", "delta") == (0, 2)
    assert mqar.direction_at_largest(results, "delta", "linear") == (2, 0)


def test_the_committed_grid_puts_linear_attention_ahead_of_deltanet():
    # the chapter's sentence on the direction at N = 32: ahead by more than
    # the margin in four seeds, within it in the fifth, behind in none
    results = mqar.load_results()
    assert mqar.direction_at_largest(results, "linear", "delta") == (4, 0)
    table = mqar.accuracies(results)
    gap = table["linear"][:, -1] - table["delta"][:, -1]
    assert (gap > 0).all()


# One run of the grid, retrained: linear attention, seed 1, whose accuracy at
# N = 32 (about 0.79) is far from every threshold of the verdicts (0.99; a
# gap of 0.1 + 0.02 to softmax attention's 1.0, 0.09 away; DeltaNet's gap
# to it, below zero). Retrained on the machine that
# wrote the file it matched to every digit; with the other CPU's numerics
# (scripts/other_numerics.py) it differed by 0.0004, and the previous grid's
# retrained run by 0.008. The tolerance allows five times the larger; a
# changed model, task, curriculum or optimiser moves it by far more. About
# 20 CPU-seconds.
REPRODUCED = ("linear", 1, 32)
TOLERANCE = 0.04


def test_one_run_of_the_grid_reproduces(results, one_torch_thread):
    model, seed, n = REPRODUCED
    hp = results["hyperparameters"]
    run = mqar.one_run((model, seed, tuple(results["n_pairs"]), hp))
    (recorded,) = [
        r for r in results["runs"] if r["model"] == model and r["seed"] == seed
    ]
    got, want = run["accuracy"][str(n)], recorded["accuracy"][str(n)]
    assert abs(got - want) <= TOLERANCE, (got, want)
