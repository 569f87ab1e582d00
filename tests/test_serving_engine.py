"""attnbook.serving.engine: continuous batching over the tiny GPT gives, token
for token, what decoding each request alone gives; blocks are never leaked or
freed twice; prefix sharing and parallel sampling share blocks and copy on
write; transformers' own continuous batching is checked against its
one-at-a-time ``generate``."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnbook.gpt import GPTConfig, TinyGPT, load_tiny_gpt
from attnbook.serving.engine import Engine, Request
from attnbook.serving.prefix import PrefixIndex, block_hashes

VOCAB = 13


def small_model(seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(
        vocab_size=VOCAB, context_length=48, n_layers=2, n_heads=2, d_model=8
    )
    return TinyGPT(cfg).double().eval()


def workload(n, seed, vocab=VOCAB, max_prompt=14, max_new=10, spread=3):
    g = torch.Generator().manual_seed(seed)

    def draw(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=g))

    return [
        Request(
            torch.randint(
                0, vocab, (draw(1, max_prompt),), generator=g
            ).tolist(),
            draw(1, max_new),
            arrival=draw(0, spread * n),
        )
        for _ in range(n)
    ]


def alone(model, request):
    """Greedy decoding of one request by itself (the model's own cache)."""
    ids = torch.tensor([request.prompt])
    out = model.generate(ids, request.max_new_tokens, temperature=0)
    return out[0, len(request.prompt) :].tolist()


@pytest.mark.parametrize(
    "options",
    [
        dict(n_blocks=40, block_size=4),
        dict(n_blocks=40, block_size=1, max_tokens=20),
        # few blocks: sequences are preempted and recomputed
        dict(n_blocks=7, block_size=4),
        dict(n_blocks=40, block_size=4, policy="static", max_running=3),
        dict(n_blocks=40, block_size=2, prefix_sharing=True),
    ],
    ids=["paged", "block-1", "preempting", "static", "prefix"],
)
def test_outputs_equal_decoding_each_request_alone(options):
    model = small_model()
    requests = workload(10, seed=1)
    engine = Engine(model, **options)
    got = engine.run(requests)
    assert got == {i: alone(model, r) for i, r in enumerate(requests)}
    engine.check()
    assert engine.allocator.n_free == engine.allocator.n_blocks
    if options["n_blocks"] == 7:
        assert engine.stats.preemptions > 0
        assert engine.stats.recomputed_tokens > 0


def test_the_trained_tiny_gpt_batched_equals_alone():
    model, tok = load_tiny_gpt()
    model = model.double()
    prompts = ["In the beginning", "And God said", "Blessed are the"]
    requests = [
        Request(tok.encode(p), 12, arrival=i) for i, p in enumerate(prompts)
    ]
    got = Engine(model, n_blocks=32, block_size=8).run(requests)
    assert got == {i: alone(model, r) for i, r in enumerate(requests)}


def test_a_request_longer_than_the_cache_is_refused():
    engine = Engine(small_model(), n_blocks=3, block_size=4)
    with pytest.raises(ValueError, match="needs 4 blocks.*has 3"):
        engine.add(Request([1] * 10, 4))
    with pytest.raises(ValueError, match="max_tokens=48"):
        Engine(small_model(), n_blocks=99, block_size=4).add(
            Request([1] * 40, 10)
        )
    assert engine.waiting == []


def test_a_cancelled_request_frees_its_blocks():
    engine = Engine(small_model(), n_blocks=20, block_size=2)
    keep = engine.add(Request([1, 2, 3, 4, 5], 8))
    drop = engine.add(Request([6, 7, 8, 9, 10, 11, 12], 8))
    engine.step()
    engine.step()
    held = engine.allocator.n_blocks - engine.allocator.n_free
    engine.cancel(drop)
    engine.check()
    # 7 + 1 positions of the cancelled one: 4 blocks back
    assert engine.allocator.n_blocks - engine.allocator.n_free == held - 4
    out = engine.run()
    assert list(out) == [keep]
    assert engine.allocator.n_free == engine.allocator.n_blocks
    with pytest.raises(ValueError, match="no waiting or running"):
        engine.cancel(drop)


def test_a_shared_prompt_is_stored_once_and_prefilled_once():
    model = small_model()
    system = list(range(12))
    requests = [Request(system + [i], 4, arrival=0) for i in range(5)]
    shared = Engine(model, n_blocks=30, block_size=4, prefix_sharing=True)
    plain = Engine(model, n_blocks=30, block_size=4)
    # one at a time, so that the first holds the prefix when the next comes
    for i, r in enumerate(requests):
        r.arrival = i
    assert shared.run(requests) == plain.run(requests)
    # each later request shares the 3 full blocks of the system prompt
    assert shared.stats.prefill_skipped == 4 * 12
    assert plain.stats.prefill_tokens - shared.stats.prefill_tokens == 4 * 12
    assert shared.stats.peak_blocks < plain.stats.peak_blocks


def test_block_hashes_name_a_block_with_its_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    b = block_hashes([9, 9, 3, 4, 5, 6], 2)
    assert len(a) == 3 and len(b) == 3
    # the same tokens after a different prefix: different names
    assert a[0] != b[0] and a[1] != b[1]
    assert block_hashes([1, 2, 3, 4, 8, 8], 2)[:2] == a[:2]
    index = PrefixIndex()
    for h, block in zip(a, (5, 6, 7)):
        index.add(h, block)
    assert index.match(block_hashes([1, 2, 3, 4, 0, 0], 2)) == [5, 6]
    index.forget(6)
    assert index.match(a) == [5]


def test_parallel_samples_share_the_prompt_and_copy_on_write():
    model = small_model()
    prompt = [1, 2, 3, 4, 5, 6]
    forked = Engine(model, n_blocks=40, block_size=4)
    out = forked.run(
        [Request(prompt, 6, temperature=1.0, seed=10, n_samples=3)]
    )
    # each sample equals the same request sampled alone with its seed
    for j in range(3):
        single = Engine(model, n_blocks=40, block_size=4).run(
            [Request(prompt, 6, temperature=1.0, seed=10 + j)]
        )
        assert out[j] == single[0]
    assert len({tuple(o) for o in out.values()}) > 1
    # the part-filled block of the prompt was copied by two of the three
    assert forked.stats.copies == 2
    forked.check()
    # a prompt of whole blocks leaves no block part-filled: nothing copied
    whole = Engine(model, n_blocks=40, block_size=4)
    whole.run([Request(prompt + [7, 8], 6, seed=10, n_samples=3)])
    assert whole.stats.copies == 0
    whole.check()


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 10_000),
    n_blocks=st.integers(6, 24),
    block_size=st.sampled_from([1, 2, 4]),
    share=st.booleans(),
    actions=st.lists(st.integers(0, 9), min_size=5, max_size=40),
)
def test_no_block_is_leaked_or_freed_twice(
    seed, n_blocks, block_size, share, actions
):
    """A random workload (arrivals, forks, cancellations, preemptions): after
    every step each block is free exactly once or held, with its reference
    count the number of tables that hold it; at the end every block is
    free."""
    model = small_model()
    engine = Engine(
        model,
        n_blocks=n_blocks,
        block_size=block_size,
        max_tokens=24,
        prefix_sharing=share,
    )
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, VOCAB, (6,), generator=g).tolist()
    for action in actions:
        if action < 5:
            prompt = (
                system[: action + 1]
                + torch.randint(0, VOCAB, (action + 1,), generator=g).tolist()
            )
            request = Request(
                prompt,
                1 + action,
                arrival=engine.clock,
                temperature=1.0 * (action % 2),
                seed=action,
                n_samples=1 + (action == 3),
            )
            try:
                engine.add(request)
            except ValueError:
                pass  # larger than this cache
        elif action == 5 and (engine.running or engine.waiting):
            engine.cancel((engine.running + engine.waiting)[0].seq_id)
        else:
            engine.step()
        engine.check()
    engine.run()
    engine.check()
    assert engine.allocator.n_free == engine.allocator.n_blocks
    assert len(set(engine.allocator.free_list)) == n_blocks


def test_latencies_count_steps_from_arrival():
    model = small_model()
    requests = [
        Request([1, 2, 3], 4, arrival=0),
        Request([4, 5], 3, arrival=2),
    ]
    engine = Engine(model, n_blocks=10, block_size=2)
    ticks = iter(range(100))
    engine.run(requests, clock=lambda: float(next(ticks)))
    lat = engine.latencies()
    # admitted at once: the first token comes out of the step they arrive
    # in; the second request's 3 tokens come out of steps 3, 4, 5
    assert lat["ttft_steps"].tolist() == [1, 1]
    assert lat["total_steps"].tolist() == [4, 3]
    # one tick per step
    assert lat["ttft_s"].tolist() == [1.0, 1.0]
    assert lat["per_token_s"].tolist() == [1.0, 1.0]
    static = Engine(model, n_blocks=10, block_size=2, policy="static")
    static.run(requests)
    # the second waits for the first batch (steps 1-4) to finish
    assert static.latencies()["ttft_steps"].tolist() == [1, 3]
