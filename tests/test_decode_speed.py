"""Chapter 12's decoding measurements (attnbook.experiments.decode_speed): what
they count and time."""

import dataclasses

import pytest
import torch

from attnbook import kv_cache_bytes
from attnbook.experiments.decode_speed import (
    broadcast_gqa,
    bytes_allocated,
    compare_decode,
    measure_decode,
)
from attnbook.gpt import GPTConfig, TinyGPT
from attnbook.gqa import mha_to_gqa, with_grouped_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_measure_decode_counts_the_cache():
    torch.manual_seed(0)
    model = TinyGPT(
        GPTConfig(
            vocab_size=9,
            context_length=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_model=16,
        )
    ).eval()
    assert (
        measure_decode(model, batch=1, n_prompt=5, n_new=2).timing.repeats == 5
    )
    m = measure_decode(model, batch=3, n_prompt=5, n_new=4, repeats=2)
    assert m.n_kv_heads == 2 and (m.batch, m.n_prompt, m.n_new) == (3, 5, 4)
    assert m.cache_bytes == kv_cache_bytes(
        2, 2, 4, 9, batch=3, bytes_per_element=4
    )
    # the fastest run
    assert m.tokens_per_s == pytest.approx(3 * 4 / m.timing.low)
    assert m.median_tokens_per_s == pytest.approx(3 * 4 / m.timing.median)
    assert m.tokens_per_s >= m.median_tokens_per_s
    assert (
        m.timing.repeats == 2
        and m.timing.low <= m.timing.median <= m.timing.high
    )
    with pytest.raises(ValueError, match="context_length"):
        measure_decode(model, n_prompt=30, n_new=4)


def test_compare_decode_times_every_model():
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=9, context_length=32, n_layers=1, n_heads=4, d_model=16
    )
    mha = TinyGPT(config).eval()
    models = {
        "mha": mha,
        "mqa": mha_to_gqa(mha, 1),
        "mqa grouped": with_grouped_attention(mha_to_gqa(mha, 1)),
    }
    result = compare_decode(models, batch=2, n_prompt=4, n_new=3, rounds=3)
    assert list(result) == list(models)
    assert [r.n_kv_heads for r in result.values()] == [4, 1, 1]
    assert (
        result["mha"].cache_bytes
        == 4 * result["mqa"].cache_bytes
        == 2 * 1 * 2 * 4 * 7 * 4 * 4
    )
    assert all(r.timing.repeats == 3 for r in result.values())
    with pytest.raises(ValueError, match="at least one"):
        compare_decode({})
    other = TinyGPT(dataclasses.replace(config, vocab_size=5))
    with pytest.raises(ValueError, match="one vocabulary"):
        compare_decode({"a": mha, "b": other})


def test_bytes_allocated_sees_tensor_allocations():
    result, n = bytes_allocated(torch.zeros, 1000, dtype=torch.float64)
    assert result.shape == (1000,) and n >= 8000
    _, n = bytes_allocated(lambda: None)
    assert n == 0


def test_bytes_allocated_filters_only_the_profiler_cycle_warning():
    """torch 2.11's profiler warns on every use (message as it printed it,
    spaces missing); that one warning is silenced, any other warning during the
    call still reaches the caller."""
    import warnings

    def warns(message):
        def fn():
            warnings.warn(message, UserWarning)
            return torch.ones(3)

        return fn

    torch_211 = (
        "Warning: Profiler clears events at the end of each cycle.Only events "
        "from the current "
        "cycle will be reported.To keep events across cycles, set "
        "acc_events=True."
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bytes_allocated(warns(torch_211))
        bytes_allocated(warns("something else went wrong"))
    assert [str(w.message) for w in caught] == ["something else went wrong"]
    # the filter is scoped to the call: afterwards the same message is shown
    # again
    with pytest.warns(UserWarning, match="Profiler clears events"):
        warns(torch_211)()


def test_every_run_decodes_from_the_same_prefilled_state():
    """The prompt is prefilled once per model; each timed run decodes from a
    copy of that cache, so every run computes what a fresh prefill and decoding
    compute, and the prefilled cache is kept."""
    from attnbook.experiments.decode_speed import _decode_seconds, _prefill

    torch.manual_seed(0)
    model = TinyGPT(
        GPTConfig(
            vocab_size=9,
            context_length=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_model=16,
        )
    ).eval()
    prompt = torch.randint(9, (3, 5))
    prefilled = _prefill(model, prompt, n_new=4)
    assert [c.length for c in prefilled[0]] == [5, 5]
    for _ in range(2):
        seconds, nbytes = _decode_seconds(
            model, prefilled, n_prompt=5, n_new=4
        )
        assert seconds > 0 and nbytes == kv_cache_bytes(
            2, 2, 4, 9, batch=3, bytes_per_element=4
        )
        # the copy was decoded, not it
        assert [c.length for c in prefilled[0]] == [5, 5]
    # the same greedy tokens as generate(), which prefills its own cache and
    # decodes
    cache, logits = _prefill(model, prompt, n_new=4)
    ids = []
    with torch.no_grad():
        for t in range(4):
            ids.append(logits.argmax(dim=-1, keepdim=True))
            logits = model(ids[-1], cache, start_pos=5 + t)[:, -1]
    expected = model.generate(prompt, max_new_tokens=4, temperature=0)[:, 5:]
    assert torch.equal(torch.cat(ids, dim=1), expected)


def test_broadcast_gqa_is_grouped_query_attention_and_copies():
    from attnbook.gqa import grouped_query_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 3, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, 5, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, 5, 16, generator=gen, dtype=torch.float64)
    out = broadcast_gqa(q, k, v)
    assert (out - grouped_query_attention(q, k, v)).abs().max() < 1e-12
    # a decoding step: its allocations include the g = 4 copies of the keys
    q1 = torch.randn(1, 8, 1, 64, generator=gen)
    k1 = torch.randn(1, 2, 256, 64, generator=gen)
    _, allocated = bytes_allocated(broadcast_gqa, q1, k1, k1)
    assert allocated >= 4 * k1.nbytes
