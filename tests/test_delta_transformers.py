"""The delta-rule family (attnbook.delta) against the reference
implementations in ``transformers``: Qwen3-Next's
``torch_recurrent_gated_delta_rule`` and ``torch_chunk_gated_delta_rule``, and
Kimi Linear's ``recurrent_kimi_delta_attention`` and
``chunk_kimi_delta_attention``.

Their conventions: tensors laid out (batch, n, heads, d); the gate given as
its logarithm ``g <= 0`` (the state is multiplied by ``exp(g)``), one per head
and token (Qwen3-Next) or per key channel (Kimi); ``beta`` (batch, n, heads);
queries scaled by ``1/sqrt(d_k)``; the state (batch, heads, d_k, d_v), keys on
the rows, as ours; queries and keys l2-normalised inside only when
``use_qk_l2norm_in_kernel`` (here they are normalised before, with
``F.normalize``, and the flag is off, since their ``l2norm`` adds ``1e-6``
under the square root).

The references cast every input to float32. To compare in float64, the tests
run them with their module's ``torch`` replaced by a proxy whose ``float32``
is ``torch.float64``, and Kimi's chunkwise form, which also calls
``Tensor.float()`` on its decay mask, with that method returning float64
(nothing else changes); one test also runs them as they are and compares at
float32's tolerance.
"""

import pytest
import torch
import torch.nn.functional as F

from attnbook.delta.chunkwise import delta_chunkwise
from attnbook.delta.recurrent import (
    delta_recurrence,
    gated_delta_recurrent,
    kda_recurrent,
)

pytest.importorskip("transformers", minversion="5.0")
from transformers.models.kimi_linear import (  # noqa: E402
    modeling_kimi_linear as kimi,
)
from transformers.models.qwen3_next import (  # noqa: E402
    modeling_qwen3_next as qwen,
)

B, N, H, D_K, D_V = 2, 13, 3, 8, 6


class Torch64:
    """``torch`` with ``float32`` meaning float64."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


@pytest.fixture
def float64_references(monkeypatch):
    for module in (qwen, kimi):
        monkeypatch.setattr(module, "torch", Torch64())
    monkeypatch.setattr(torch.Tensor, "float", torch.Tensor.double)


def unwrap(fn):
    """The reference function itself, under the hub-kernel decorator."""
    return getattr(fn, "__wrapped__", fn)


def inputs(seed, channel_gate=False, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, H, D_K, generator=g, dtype=dtype)
    k = F.normalize(
        torch.randn(B, N, H, D_K, generator=g, dtype=dtype), dim=-1
    )
    v = torch.randn(B, N, H, D_V, generator=g, dtype=dtype)
    gate_shape = (B, N, H, D_K) if channel_gate else (B, N, H)
    log_gate = -torch.rand(gate_shape, generator=g, dtype=dtype)
    beta = torch.rand(B, N, H, generator=g, dtype=dtype)
    state = torch.randn(B, H, D_K, D_V, generator=g, dtype=dtype)
    return q, k, v, log_gate, beta, state


def ours(q, k, v, log_gate, beta):
    """The inputs in our layout (batch, heads, n, d), the gate as a
    factor."""
    return [x.transpose(1, 2) for x in (q, k, v, beta, log_gate.exp())]


def test_the_proxy_computes_in_float64(float64_references):
    q, k, v, g, beta, _ = inputs(0)
    out, _ = qwen.torch_recurrent_gated_delta_rule(q, k, v, g, beta)
    exact, _ = unwrap(qwen.torch_recurrent_gated_delta_rule)(q, k, v, g, beta)
    assert torch.equal(out, exact)
    # and differs from the float32 run
    with pytest.MonkeyPatch.context() as m:
        m.setattr(qwen, "torch", torch)
        out32, _ = qwen.torch_recurrent_gated_delta_rule(q, k, v, g, beta)
    assert (out - out32).abs().max() > 1e-12


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gated_delta_rule_equals_qwen3_next(float64_references, seed):
    q, k, v, g, beta, state = inputs(seed)
    qo, ko, vo, bo, ao = ours(q, k, v, g, beta)
    o, S = gated_delta_recurrent(qo, ko, vo, ao, bo, initial_state=state)
    ref_o, ref_S = qwen.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True
    )
    torch.testing.assert_close(o.transpose(1, 2), ref_o, rtol=0, atol=1e-12)
    torch.testing.assert_close(S, ref_S, rtol=0, atol=1e-12)
    for chunk in (1, 4, 5, N):
        ref_o, ref_S = qwen.torch_chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            chunk_size=chunk,
            initial_state=state,
            output_final_state=True,
        )
        oc, Sc = delta_chunkwise(
            qo, ko, vo, bo, ao, chunk_size=chunk, initial_state=state
        )
        torch.testing.assert_close(
            oc.transpose(1, 2), ref_o, rtol=0, atol=1e-11
        )
        torch.testing.assert_close(Sc, ref_S, rtol=0, atol=1e-11)


def test_qwen3_next_normalising_inside_and_no_initial_state(
    float64_references,
):
    q, k, v, g, beta, _ = inputs(3)
    k = 3 * k  # the reference normalises them
    ref_o, ref_S = qwen.torch_recurrent_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    q, k = qwen.l2norm(q), qwen.l2norm(k)  # the same normalisation
    o, S = delta_recurrence(
        *ours(q, k, v, g, beta)[:3],
        beta.transpose(1, 2),
        g.exp().transpose(1, 2),
    )
    torch.testing.assert_close(o.transpose(1, 2), ref_o, rtol=0, atol=1e-12)
    torch.testing.assert_close(S, ref_S, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_kda_equals_kimi_linear(float64_references, seed):
    q, k, v, g, beta, state = inputs(seed, channel_gate=True)
    qo, ko, vo, bo, ao = ours(q, k, v, g, beta)
    o, S = kda_recurrent(qo, ko, vo, ao, bo, initial_state=state)
    ref_o, ref_S = kimi.recurrent_kimi_delta_attention(
        q, k, v, g, beta, state, True
    )
    torch.testing.assert_close(o.transpose(1, 2), ref_o, rtol=0, atol=1e-12)
    torch.testing.assert_close(S, ref_S, rtol=0, atol=1e-12)
    for chunk in (1, 3, 4, N):
        ref_o, ref_S = kimi.chunk_kimi_delta_attention(
            q,
            k,
            v,
            g,
            beta,
            chunk_size=chunk,
            initial_state=state,
            output_final_state=True,
        )
        oc, Sc = delta_chunkwise(
            qo, ko, vo, bo, ao, chunk_size=chunk, initial_state=state
        )
        torch.testing.assert_close(
            oc.transpose(1, 2), ref_o, rtol=0, atol=1e-11
        )
        torch.testing.assert_close(Sc, ref_S, rtol=0, atol=1e-11)


def test_the_references_as_shipped_agree_at_float32_tolerance():
    q, k, v, g, beta, state = inputs(4, channel_gate=True)
    o, S = kda_recurrent(
        *ours(q, k, v, g, beta)[:3],
        g.exp().transpose(1, 2),
        beta.transpose(1, 2),
        initial_state=state,
    )
    ref_o, ref_S = kimi.recurrent_kimi_delta_attention(
        q, k, v, g, beta, state, True
    )
    torch.testing.assert_close(
        o.transpose(1, 2), ref_o.double(), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(S, ref_S.double(), rtol=1e-5, atol=1e-5)


def test_a_channel_gate_is_not_a_head_gate(float64_references):
    """The per-channel gate decays the state's rows (key channels): apply
    it to the columns instead and the outputs differ."""
    q, k, v, g, beta, state = inputs(5, channel_gate=True)
    ref_o, _ = kimi.recurrent_kimi_delta_attention(
        q, k, v, g, beta, state, True
    )
    qo, ko, vo, bo, ao = ours(q, k, v, g, beta)
    mean_gate = ao.mean(dim=-1)
    o, _ = gated_delta_recurrent(qo, ko, vo, mean_gate, bo, state)
    assert (o.transpose(1, 2) - ref_o).abs().max() > 1e-3
