"""TinyGPT under any mask (``mask``, ``is_causal``, chapter 7): with the causal
mask given as a mask it is the model's own causal forward; the weights that
heads.attention_maps keeps are the layers' own."""

import numpy as np
import pytest
import torch

import attnbook
from attnbook.gpt import GPTConfig, TinyGPT
from attnbook.heads import attention_maps, attention_weights


@pytest.fixture
def model():
    torch.manual_seed(0)
    return TinyGPT(
        GPTConfig(
            vocab_size=11,
            context_length=12,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_model=16,
        )
    ).eval()


@pytest.fixture
def ids():
    return torch.randint(
        11, (3, 9), generator=torch.Generator().manual_seed(1)
    )


def test_causal_mask_reproduces_the_model(model, ids):
    with torch.no_grad():
        expected = model(ids)
        # numpy mask accepted
        got = model(ids, mask=attnbook.causal_mask(9), is_causal=False)
        got_t = model(
            ids,
            mask=torch.from_numpy(attnbook.causal_mask(9)),
            is_causal=False,
        )
        # mask and causal: the same
        both = model(ids, mask=attnbook.causal_mask(9))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_t, expected)
    torch.testing.assert_close(both, expected)


def test_shipped_model_is_reproduced():
    gpt, tok = attnbook.gpt.load_tiny_gpt()
    x = torch.tensor([tok.encode("1:1 In the beginning God created")])
    with torch.no_grad():
        torch.testing.assert_close(
            gpt(x, mask=attnbook.causal_mask(x.shape[1]), is_causal=False),
            gpt(x),
        )


def test_causal_logits_ignore_the_future_but_unmasked_ones_do_not(model, ids):
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 11
    with torch.no_grad():
        for is_causal, same_past in ((True, True), (False, False)):
            a, b = (
                model(ids, is_causal=is_causal),
                model(changed, is_causal=is_causal),
            )
            assert torch.equal(a[:, :6], b[:, :6]) == same_past
            assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_weights_are_the_layers_weights(model, ids):
    """weights @ values, concatenated and projected, is what the layer
    outputs."""
    mask = torch.from_numpy(attnbook.sliding_window_mask(9, 3))
    with torch.no_grad():
        weights = attention_maps(model, ids, mask=mask, is_causal=False)
        assert weights.shape == (2, 3, 4, 9, 9)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 4, 9))
        assert torch.all(weights[:, :, :, ~mask] == 0)
        attn = model.blocks[0].attn
        h = model.blocks[0].ln_1(
            model.tok_emb(ids) + model.pos_emb(torch.arange(9))
        )
        # (3, 4, 9, 4)
        v = (
            attn.v_proj(h)
            .view(3, 9, 2, 4)
            .transpose(1, 2)
            .repeat_interleave(2, dim=1)
        )
        by_hand = attn.out_proj(
            (weights[0] @ v).transpose(1, 2).reshape(3, 9, 16)
        )
        torch.testing.assert_close(by_hand, attn(h, mask=mask))


def test_fully_masked_row_gets_zero_weights(model, ids):
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    mask[4] = False
    x = torch.randn(3, 9, 16)
    with torch.no_grad():
        w = attention_weights(model.blocks[0].attn, x, mask=mask)
    assert torch.all(w[:, :, 4] == 0) and not torch.isnan(w).any()


def test_bad_input(model, ids):
    with pytest.raises(ValueError, match="int64"):
        model(ids.float(), is_causal=False)
    with pytest.raises(ValueError, match="context_length"):
        model(torch.zeros(1, 13, dtype=torch.long), is_causal=False)
    with pytest.raises(ValueError, match="boolean"):
        model(ids, mask=np.ones((9, 9)), is_causal=False)
    with pytest.raises(ValueError, match="broadcast"):
        model(ids, mask=np.ones((8, 9), bool), is_causal=False)


def test_kept_weights_are_those_of_the_forward_pass(model, ids):
    """With keep_weights the layer runs attend (not torch's fused kernel) and
    keeps what it used: its output equals the fused run's, and its weights
    reproduce that output."""
    attn = model.blocks[1].attn
    x = torch.randn(3, 9, 16)
    with torch.no_grad():
        fused = attn(x, is_causal=True)
        attn.keep_weights = True
        kept = attn(x, is_causal=True)
        w = attn.weights
        attn.keep_weights, attn.weights = False, None
        v = (
            attn.v_proj(x)
            .view(3, 9, 2, 4)
            .transpose(1, 2)
            .repeat_interleave(2, dim=1)
        )
        by_hand = attn.out_proj((w @ v).transpose(1, 2).reshape(3, 9, 16))
    torch.testing.assert_close(kept, fused)
    torch.testing.assert_close(by_hand, kept)
    assert w.shape == (3, 4, 9, 9) and (w.triu(1) == 0).all()
