"""transformers' own paged cache and continuous batching
(``generate_batch``, transformers.generation.continuous_batching), on a small
random Llama on the CPU in float64: its greedy outputs equal its
one-at-a-time ``generate``, the reference attnbook.serving is held to with
the tiny GPT (tests/test_serving_engine.py)."""

import pytest
import torch

# generate_batch and ContinuousBatchingConfig are transformers 5's
transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import (  # noqa: E402
    ContinuousBatchingConfig,
)

PROMPTS = [[3, 4, 5, 6, 7], [8, 9, 10], list(range(11, 24)), [30], [40, 41]]
NEW = 7


def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return LlamaForCausalLM(cfg).double().eval()


def test_transformers_continuous_batching_equals_generate_alone():
    model = tiny_llama()
    # no end token: every request runs its NEW tokens
    gen = GenerationConfig(
        max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    # pages of 4 tokens, 12 blocks: fewer than the requests need at once
    cb = ContinuousBatchingConfig(
        page_size=4,
        num_blocks=12,
        max_batch_tokens=24,
        max_requests_per_batch=4,
        use_cuda_graph=False,
        use_async_batching=False,
    )
    out = model.generate_batch(
        inputs=PROMPTS,
        generation_config=gen,
        continuous_batching_config=cb,
        warmup=False,
    )
    got = [r.generated_tokens for r in out.values()]
    assert [r.prompt_ids for r in out.values()] == PROMPTS
    want = []
    for prompt in PROMPTS:
        ids = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        want.append(ids[0, len(prompt) :].tolist())
    assert got == want
    assert all(len(g) == NEW for g in got)
