"""forward_with_mask runs TinyGPT under any mask; with the causal mask it is TinyGPT's own forward."""
import numpy as np
import pytest
import torch

import attnbook
from attnbook.gpt import GPTConfig, TinyGPT
from attnbook.masked_gpt import attention_weights, forward_with_mask


@pytest.fixture
def model():
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab_size=11, block_size=12, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16)).eval()


@pytest.fixture
def ids():
    return torch.randint(11, (3, 9), generator=torch.Generator().manual_seed(1))


def test_causal_mask_reproduces_the_model(model, ids):
    with torch.no_grad():
        expected = model(ids)
        got = forward_with_mask(model, ids, attnbook.causal_mask(9))            # numpy mask accepted
        got_t = forward_with_mask(model, ids, torch.from_numpy(attnbook.causal_mask(9)))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_t, expected)


def test_shipped_model_is_reproduced():
    gpt, tok = attnbook.gpt.load_tiny_gpt()
    x = torch.tensor([tok.encode("1:1 In the beginning God created")])
    with torch.no_grad():
        torch.testing.assert_close(forward_with_mask(gpt, x, attnbook.causal_mask(x.shape[1])), gpt(x))


def test_causal_logits_ignore_the_future_but_unmasked_ones_do_not(model, ids):
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 11
    with torch.no_grad():
        for mask, same_past in ((attnbook.causal_mask(9), True), (None, False)):
            a, b = forward_with_mask(model, ids, mask), forward_with_mask(model, changed, mask)
            assert torch.equal(a[:, :6], b[:, :6]) == same_past
            assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_weights_are_the_layers_weights(model, ids):
    """weights @ values, concatenated and projected, is what the layer outputs."""
    mask = torch.from_numpy(attnbook.sliding_window_mask(9, 3))
    with torch.no_grad():
        logits, weights = forward_with_mask(model, ids, mask, return_weights=True)
        torch.testing.assert_close(logits, forward_with_mask(model, ids, mask))
        assert weights.shape == (2, 3, 4, 9, 9)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 4, 9))
        assert torch.all(weights[:, :, :, ~mask] == 0)
        attn = model.blocks[0].attn
        h = model.blocks[0].ln_1(model.tok_emb(ids) + model.pos_emb(torch.arange(9)))
        v = attn.v_proj(h).view(3, 9, 2, 4).transpose(1, 2).repeat_interleave(2, dim=1)   # (3, 4, 9, 4)
        by_hand = attn.out_proj((weights[0] @ v).transpose(1, 2).reshape(3, 9, 16))
        torch.testing.assert_close(by_hand, attn(h, mask=mask))


def test_fully_masked_row_gets_zero_weights(model, ids):
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    mask[4] = False
    x = torch.randn(3, 9, 16)
    with torch.no_grad():
        w = attention_weights(model.blocks[0].attn, x, mask)
    assert torch.all(w[:, :, 4] == 0) and not torch.isnan(w).any()


def test_bad_input(model, ids):
    with pytest.raises(ValueError, match="int64"):
        forward_with_mask(model, ids.float())
    with pytest.raises(ValueError, match="block_size"):
        forward_with_mask(model, torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(ValueError, match="boolean"):
        forward_with_mask(model, ids, np.ones((9, 9)))
    with pytest.raises(ValueError, match="broadcast"):
        forward_with_mask(model, ids, np.ones((8, 9), bool))
