"""causal_mask, sliding_window_mask, packed and prefix-LM masks, including the
alignment against PyTorch's is_causal and the masks inside torch SDPA."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attnbook


@pytest.mark.parametrize("n_q, n_k", [(1, 1), (4, 4), (1, 6), (3, 7), (7, 7)])
def test_causal_mask_by_positions(n_q, n_k):
    mask = attnbook.causal_mask(n_q, n_k)
    assert mask.dtype == bool and mask.shape == (n_q, n_k)
    for i in range(n_q):
        position = n_k - n_q + i  # the queries are the last n_q positions
        for j in range(n_k):
            assert mask[i, j] == (j <= position)


def test_square_causal_mask_equals_torch_is_causal(rng):
    q, k, v = (torch.from_numpy(rng.normal(size=(2, 6, 4))) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.from_numpy(attnbook.causal_mask(6))
    )
    torch.testing.assert_close(got, expected)


def test_rectangular_alignment_differs_from_torch_is_causal():
    """torch's is_causal aligns queries with the first keys; KV-cache decoding
    needs the last."""
    n_q, n_k = 2, 5
    torch_alignment = torch.ones(n_q, n_k, dtype=torch.bool).tril(0).numpy()
    np.testing.assert_array_equal(
        attnbook.causal_mask(n_q, n_k),
        np.tril(np.ones((n_q, n_k), bool), n_k - n_q),
    )
    assert not np.array_equal(attnbook.causal_mask(n_q, n_k), torch_alignment)


def test_decoding_one_token_sees_everything():
    assert attnbook.causal_mask(1, 9).all()


@pytest.mark.parametrize("bad", [(0,), (-1,), (2.5,), (True,), (5, 3)])
def test_causal_mask_rejects_bad_sizes(bad):
    with pytest.raises(ValueError):
        attnbook.causal_mask(*bad)


@pytest.mark.parametrize(
    "n, window", [(1, 1), (6, 1), (6, 3), (5, 5), (4, 10)]
)
def test_sliding_window(n, window):
    mask = attnbook.sliding_window_mask(n, window)
    for i in range(n):
        assert set(np.flatnonzero(mask[i])) == set(
            range(max(0, i - window + 1), i + 1)
        )
    if window >= n:
        np.testing.assert_array_equal(mask, attnbook.causal_mask(n))


# --- packed documents and prefix language models -----------------------------


@pytest.mark.parametrize("lengths", [[5], [3, 4], [1, 6, 2, 1]])
def test_packed_attention_equals_each_document_alone(lengths, rng):
    from attnbook.masks import packed_causal_mask

    mask = packed_causal_mask(lengths)
    n = sum(lengths)
    assert mask.shape == (n, n) and mask.dtype == bool
    x = rng.normal(size=(n, 8))
    packed, _ = attnbook.scaled_dot_product_attention(x, x, x, mask=mask)
    start = 0
    # run each document on its own, with a causal mask
    for length in lengths:
        doc = x[start : start + length]
        alone, _ = attnbook.scaled_dot_product_attention(
            doc, doc, doc, mask=attnbook.causal_mask(length)
        )
        np.testing.assert_allclose(
            packed[start : start + length], alone, rtol=1e-12, atol=1e-12
        )
        # nothing of earlier documents
        assert not mask[start : start + length, :start].any()
        start += length


def test_packed_mask_rejects_empty_documents():
    from attnbook.masks import packed_causal_mask

    with pytest.raises(ValueError, match="each document length"):
        packed_causal_mask([3, 0, 2])


@pytest.mark.parametrize("n, prefix", [(6, 0), (6, 1), (6, 3), (6, 6)])
def test_prefix_lm_mask_by_rows(n, prefix):
    from attnbook.masks import prefix_lm_mask

    mask = prefix_lm_mask(n, prefix)
    for i in range(n):
        sees = set(np.flatnonzero(mask[i]))
        # the whole prefix, and the causal past
        expected = set(range(prefix)) | set(range(i + 1))
        assert sees == expected, (i, sees)
    if prefix <= 1:
        np.testing.assert_array_equal(mask, attnbook.causal_mask(n))
    with pytest.raises(
        ValueError, match=r"prefix must be an integer in \[0, n=6\]"
    ):
        prefix_lm_mask(6, 7)


@pytest.mark.parametrize("lengths", [[4], [3, 5], [2, 1, 4]])
def test_packed_mask_in_torch_sdpa_equals_is_causal_per_document(lengths):
    """PyTorch's SDPA with the packed mask gives each document what SDPA's
    is_causal gives it alone."""
    from attnbook.masks import packed_causal_mask

    torch.manual_seed(0)
    n = sum(lengths)
    # (batch, heads, n, d)
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for _ in range(3))
    packed = F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.from_numpy(packed_causal_mask(lengths))
    )
    start = 0
    for length in lengths:
        part = slice(start, start + length)
        alone = F.scaled_dot_product_attention(
            q[:, :, part], k[:, :, part], v[:, :, part], is_causal=True
        )
        torch.testing.assert_close(
            packed[:, :, part], alone, rtol=1e-12, atol=1e-12
        )
        start += length


@pytest.mark.parametrize("prefix", [0, 1, 3, 7])
def test_prefix_lm_mask_in_torch_sdpa(prefix):
    """Prefix rows equal unmasked attention over the prefix alone; later rows
    equal causal attention."""
    from attnbook.masks import prefix_lm_mask

    torch.manual_seed(1)
    n = 7
    q, k, v = (torch.randn(2, n, 8, dtype=torch.float64) for _ in range(3))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.from_numpy(prefix_lm_mask(n, prefix))
    )
    bidirectional = F.scaled_dot_product_attention(
        q[:, :prefix], k[:, :prefix], v[:, :prefix]
    )
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(
        out[:, :prefix], bidirectional, rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(
        out[:, prefix:], causal[:, prefix:], rtol=1e-12, atol=1e-12
    )
