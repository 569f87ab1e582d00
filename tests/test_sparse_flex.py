"""FlexAttention adapters (attnbook.sparse.flex): every mask as a mask_mod or
score_mod, run by FlexAttention in eager mode on the CPU in float64, equal to
attnbook's attention with the explicit mask of chapter 7 (or the bias of
chapter 6, or the sinks of attnbook.sparse.sinks)."""

import numpy as np
import pytest
import torch

from attnbook import attend
from attnbook.masks import (
    causal_mask,
    packed_causal_mask,
    prefix_lm_mask,
    sliding_window_mask,
)
from attnbook.positional import alibi_bias, alibi_slopes
from attnbook.sparse import flex
from attnbook.sparse.sinks import sink_attention
from attnbook.windows import sink_window_mask

B, H, N, D = 2, 4, 40, 8


def heads(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
        for _ in range(3)
    ]


def as_mask(array):
    return torch.from_numpy(np.asarray(array))


LENGTHS = torch.tensor([40, 23])
DOCS = [7, 13, 20]
CASES = {
    "causal": (flex.causal, as_mask(causal_mask(N))),
    "sliding": (flex.sliding_window(9), as_mask(sliding_window_mask(N, 9))),
    "sink window": (
        flex.sink_window(9, 3),
        as_mask(sink_window_mask(N, 9, 3)),
    ),
    "document": (
        flex.document(np.repeat(np.arange(3), DOCS)),
        as_mask(packed_causal_mask(DOCS)),
    ),
    "prefix-LM": (flex.prefix_lm(12), as_mask(prefix_lm_mask(N, 12))),
    "padding": (
        flex.padding(LENGTHS),
        as_mask(causal_mask(N))
        & (torch.arange(N) < LENGTHS[:, None])[:, None, None, :],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("block_size", [16, 128])
def test_each_mask_mod_equals_attention_with_the_explicit_mask(
    name, block_size
):
    mask_mod, mask = CASES[name]
    q, k, v = heads()
    torch.testing.assert_close(
        flex.dense_mask(mask_mod, B, H, N, N), mask.expand(B, H, N, N)
    )
    got = flex.flex_attend(q, k, v, mask_mod, block_size=block_size)
    torch.testing.assert_close(got, attend(q, k, v, mask))


def test_alibi_score_mod_equals_attention_with_the_alibi_bias():
    q, k, v = heads(1)
    slopes = alibi_slopes(H)
    bias = torch.from_numpy(alibi_bias(H, N))
    mask = as_mask(causal_mask(N))
    got = flex.flex_attend(q, k, v, flex.causal, flex.alibi(slopes))
    torch.testing.assert_close(got, attend(q, k, v, mask, bias=bias))


def test_learned_sinks_merged_after_the_kernel_equal_sink_attention():
    q, k, v = heads(2)
    sinks = torch.tensor([-1.0, 0.0, 1.5, 3.0], dtype=torch.float64)
    mask = as_mask(sliding_window_mask(N, 5))
    got = flex.flex_attend(q, k, v, flex.sliding_window(5), sinks=sinks)
    torch.testing.assert_close(got, sink_attention(q, k, v, sinks, mask))


@pytest.mark.parametrize("name", ["causal", "sliding", "document"])
def test_sinks_as_one_more_key_equal_sink_attention(name):
    """The other way: a zero key at position n whose score a score_mod sets
    to s_h, in float64, equal to sink_attention (and to the merge)."""
    mask_mod, mask = CASES[name]
    q, k, v = heads(6)
    sinks = torch.tensor([-1.0, 0.0, 1.5, 3.0], dtype=torch.float64)
    want = sink_attention(q, k, v, sinks, mask)
    for block_size in (16, 128):
        got = flex.sinks_as_key(q, k, v, mask_mod, sinks, block_size)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (want - attend(q, k, v, mask)).abs().max() > 1e-2


def test_sinks_as_key_checks_its_sinks():
    with pytest.raises(ValueError, match=r"\(4,\); got \(3,\)"):
        flex.sinks_as_key(*heads(n=8), flex.causal, torch.zeros(3))


def test_sinks_are_not_a_score_mod():
    """Adding s_h to every real key's score changes nothing (softmax is
    shift-invariant): a sink must enter the denominator alone."""
    q, k, v = heads(3)
    sinks = torch.tensor([-1.0, 0.0, 1.5, 3.0], dtype=torch.float64)

    def shift(score, b, h, q_idx, kv_idx):
        return score + sinks[h]

    shifted = flex.flex_attend(q, k, v, flex.causal, shift)
    plain = flex.flex_attend(q, k, v, flex.causal)
    torch.testing.assert_close(shifted, plain)
    with_sinks = flex.flex_attend(q, k, v, flex.causal, sinks=sinks)
    assert (with_sinks - plain).abs().max() > 1e-2


def test_a_row_without_keys_gives_zero_with_and_without_sinks():
    q, k, v = heads(4)

    def skip_first(b, h, q_idx, kv_idx):
        return (q_idx > 0) & (kv_idx <= q_idx)

    sinks = torch.ones(H, dtype=torch.float64)
    for extra in ({}, {"sinks": sinks}):
        out = flex.flex_attend(q, k, v, skip_first, **extra)
        assert (out[:, :, 0] == 0).all()


def test_block_mask_sparsity_counts_skipped_tiles():
    """n = 512, tiles of 128: causal keeps 10 of 16 tiles (4 diagonal, 6
    below); a window of 128 keeps the 4 diagonal tiles and the 3 below them."""
    full = flex.block_mask(flex.causal, None, None, 512, 512, 128)
    assert full.sparsity() == pytest.approx(100 * 6 / 16)
    window = flex.block_mask(flex.sliding_window(128), None, None, 512, 512)
    assert window.sparsity() == pytest.approx(100 * 9 / 16)


def wrong_arity(b, h, q_idx):
    return q_idx >= 0


@pytest.mark.parametrize(
    "call, named",
    [
        (lambda: flex.block_mask(wrong_arity, 1, 1, 8, 8), "takes 3"),
        (lambda: flex.dense_mask(lambda b, q, k: q, 1, 1, 8, 8), "takes 3"),
        (
            lambda: flex.flex_attend(
                *heads(n=8), score_mod=lambda s, b, h, q: s
            ),
            "takes 4",
        ),
        (lambda: flex.sliding_window(0), "got 0"),
        (lambda: flex.sliding_window(-2), "got -2"),
        (lambda: flex.sink_window(4, -1), "got -1"),
        (lambda: flex.prefix_lm(-3), "got -3"),
        (
            lambda: flex.flex_attend(*heads(n=8), sinks=torch.zeros(3)),
            r"\(3,\)",
        ),
    ],
)
def test_bad_input_is_named(call, named):
    with pytest.raises(ValueError, match=named):
        call()


def test_a_window_of_n_is_causal():
    q, k, v = heads(5)
    torch.testing.assert_close(
        flex.flex_attend(q, k, v, flex.sliding_window(N)),
        flex.flex_attend(q, k, v, flex.causal),
    )


@pytest.mark.parametrize(
    "name", ["causal", "sliding", "document", "prefix-LM"]
)
def test_block_sparse_attend_reads_only_kept_tiles_and_equals_attend(name):
    """The tile loop equals dense attention with the explicit mask."""
    mask_mod, mask = CASES[name]
    q, k, v = heads(6)
    blocks = flex.block_mask(mask_mod, None, None, N, N, 16)
    got = flex.block_sparse_attend(q, k, v, blocks, mask_mod)
    torch.testing.assert_close(got, attend(q, k, v, mask))


def test_block_sparse_attend_skips_empty_tiles():
    q, k, v = heads(7, n=64)
    calls = []

    def window(b, h, q_idx, kv_idx):
        calls.append((int(q_idx.min()), int(kv_idx.min())))
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 16)

    blocks = flex.block_mask(flex.sliding_window(16), None, None, 64, 64, 16)
    flex.block_sparse_attend(q, k, v, blocks, window)
    # 4 query blocks: the diagonal tile and the one before (partial); none
    # further back
    assert all(qi - ki <= 16 for qi, ki in calls)
    assert len(calls) == 4 + 3
