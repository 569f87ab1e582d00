"""The log-sum-exp merge of attention states
(attnbook.torch_attention.merge_splits).

Flash-Decoding (chapter 10) combines its runs of keys with it, and ring
attention, attention sinks and paged decoding will: it is chapter 9's merge of
softmax states, in torch, with no Triton anywhere.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from attnbook.online_softmax import SoftmaxState, merge_softmax_states
from attnbook.torch_attention import attend, merge_splits


def test_merge_splits_is_chapter_9s_merge_of_softmax_states():
    """Each run's (output, lse) is a softmax state; folding the states with
    merge_softmax_states (numpy, chapter 9) gives the merged lse, and
    re-weighting the outputs by exp(lse_s - lse) gives the output."""
    rng = np.random.default_rng(0)
    scores, values = rng.normal(size=(3, 50)) * 3, rng.normal(size=(50, 4))
    # an empty run among them
    runs = [slice(0, 7), slice(7, 7), slice(7, 31), slice(31, 50)]
    o_part, lse_part = [], []
    for run in runs:
        s = scores[:, run]
        lse = np.log(np.exp(s).sum(-1)) if s.shape[1] else np.full(3, -np.inf)
        w = np.exp(s - lse[:, None]) if s.shape[1] else np.zeros_like(s)
        o_part.append(w @ values[run])
        lse_part.append(lse)
    out, lse = merge_splits(
        torch.tensor(np.array(o_part)), torch.tensor(np.array(lse_part))
    )
    state = SoftmaxState(np.full(3, -np.inf), np.zeros(3))
    # the state (m, l) = (lse_s, 1) has the run's mass
    for run_lse in lse_part:
        state = merge_softmax_states(
            state,
            SoftmaxState(run_lse, np.where(np.isfinite(run_lse), 1.0, 0.0)),
        )
    np.testing.assert_allclose(
        lse.numpy(), state.max + np.log(state.sum), rtol=1e-12
    )
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(
        out.numpy(),
        (weights / weights.sum(-1, keepdims=True)) @ values,
        rtol=1e-12,
    )


def _masked_lse(q, k, mask):
    """log-sum-exp of each row of masked scaled scores; -inf for a row with no
    visible key."""
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    return torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)


@pytest.mark.parametrize(
    "bounds",
    [(0, 5, 5, 20, 33), (0, 33), (0, 0, 33), (0, 1, 2, 3, 33)],
    ids=["with an empty run", "one run", "empty first run", "runs of one key"],
)
def test_merging_runs_is_attention_over_the_concatenated_keys(bounds):
    """Attend to each run of keys alone (torch's attend, its lse from the
    masked scores), merge: the same output and lse as attention over all the
    keys, fully masked rows included (output 0, lse -inf, as attend gives them;
    the old merge gave NaN there)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 6, 8, generator=gen, dtype=torch.float64)
    k, v = (
        torch.randn(2, 3, 33, 8, generator=gen, dtype=torch.float64)
        for _ in range(2)
    )
    mask = torch.rand(2, 3, 6, 33, generator=gen) < 0.6
    mask[0, 1, 2] = False  # a row that sees no key at all
    # a row that sees no key of one run
    mask[1, 0, 4, 5:20] = False
    o_part, lse_part = [], []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        run_mask = mask[..., start:stop]
        o_part.append(
            attend(q, k[..., start:stop, :], v[..., start:stop, :], run_mask)
        )
        lse_part.append(_masked_lse(q, k[..., start:stop, :], run_mask))
    out, lse = merge_splits(torch.stack(o_part), torch.stack(lse_part))
    torch.testing.assert_close(
        out, attend(q, k, v, mask), rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(
        lse, _masked_lse(q, k, mask), rtol=1e-12, atol=1e-12
    )
    assert torch.isneginf(lse[0, 1, 2]) and not out[0, 1, 2].any()


def test_the_merge_imports_no_triton():
    """It lives in the torch attention core: a fresh Python merges without
    importing Triton, and without setting TRITON_INTERPRET."""
    code = (
        "import os, sys, torch\n"
        "from attnbook.torch_attention import merge_splits\n"
        "out, lse = merge_splits(torch.zeros(2, 3, 4), torch.zeros(2, 3, "
        "dtype=torch.float64))\n"
        "print('triton' in sys.modules, 'TRITON_INTERPRET' in os.environ, "
        "float(lse[0]))\n"
    )
    env = {
        key: value
        for key, value in os.environ.items()
        if key != "TRITON_INTERPRET"
    }
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", str(float(np.log(2)))]
