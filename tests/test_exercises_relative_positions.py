"""The checker of chapter 6's hard exercise (Shaw et al.'s relative attention
without an (n, n, d) array) rejects each classic mistake with its diagnosis
and accepts correct answers written in other ways.

The solutions here are written independently of the checker's reference and
Mistake functions (which gather the (n, n, d) tables): the way a student
writes them, with ``take_along_axis``, a one-hot einsum, or a loop over the
queries.
"""

import numpy as np
import pytest
import torch

from attnbook.exercises import (
    ExerciseError,
    NotAttemptedError,
    check_shaw_attention,
)


def _softmax(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def table_rows(n, K, reverse=False, clip="both", shift=True):
    """(n, n) rows of the tables, as a student might compute them."""
    i = np.arange(n)
    offset = i[None, :] - i[:, None]  # j - i
    if reverse:
        offset = -offset
    if clip == "both":
        offset = np.clip(offset, -K, K)
    elif clip == "above":
        offset = np.minimum(offset, K)
    return offset + K if shift else offset


def gathered(
    q,
    k,
    v,
    rel_k,
    rel_v,
    rows=table_rows,
    rel_keys=True,
    rel_values=True,
    scale_relative=True,
    rows_v=None,
):
    """take_along_axis on q @ rel_k.T for the scores; weights summed per
    table row (a loop over the 2K + 1 rows) for the values (at the rows
    ``rows_v`` gives, when it is given, instead of ``rows``)."""
    n, d_k = q.shape[-2:]
    K = (rel_k.shape[0] - 1) // 2
    idx = rows(n, K)
    idx_v = idx if rows_v is None else rows_v(n, K)
    # (..., n, 2K + 1)
    per_row = q @ rel_k.T
    relative = np.take_along_axis(
        per_row, np.broadcast_to(idx, q.shape[:-2] + (n, n)), axis=-1
    )
    if not rel_keys:
        relative = np.zeros_like(relative)
    content = q @ np.swapaxes(k, -1, -2)
    if scale_relative:
        w = _softmax((content + relative) / np.sqrt(d_k))
    else:
        w = _softmax(content / np.sqrt(d_k) + relative)
    out = w @ v
    if rel_values:
        bins = np.stack(
            [np.where(idx_v == r, w, 0.0).sum(-1) for r in range(2 * K + 1)],
            axis=-1,
        )
        out = out + bins @ rel_v
    return out


def one_hot_float32(
    q, k, v, rel_k, rel_v, shift=True, clip_below=True, clip_above=True
):
    """A boolean one-hot (n, n, 2K + 1) and einsum, in float32 throughout
    (``clip_below=False``: offsets clipped above only, so a key more than K
    before the query matches no row; an expert reading, session 12)."""
    q, k, v, rel_k, rel_v = (
        np.asarray(x, dtype=np.float32) for x in (q, k, v, rel_k, rel_v)
    )
    n, d_k = q.shape[-2:]
    K = (rel_k.shape[0] - 1) // 2
    pos = np.arange(n)
    idx = pos[None, :] - pos[:, None]
    # one bound at a time: np.clip with both None raises in numpy 1.x
    idx = np.maximum(idx, -K) if clip_below else idx
    idx = (np.minimum(idx, K) if clip_above else idx) + (K if shift else 0)
    hot = (idx[..., None] == np.arange(2 * K + 1)).astype(np.float32)
    scores = q @ np.swapaxes(k, -1, -2)
    scores += np.einsum("...ir,ijr->...ij", q @ rel_k.T, hot)
    scores /= np.float32(np.sqrt(d_k))
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return w @ v + np.einsum("...ij,ijr->...ir", w, hot) @ rel_v


def query_loop(q, k, v, rel_k, rel_v):
    """One query at a time: its (n, d) rows of the tables only."""
    n, d_k = q.shape[-2:]
    K = (len(rel_k) - 1) // 2
    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    for i in range(n):
        rows = np.clip(np.arange(n) - i, -K, K) + K
        a_k, a_v = rel_k[rows], rel_v[rows]  # (n, d_k), (n, d_v)
        qi = q[..., i, :]
        s = (np.einsum("...d,...jd->...j", qi, k) + qi @ a_k.T) / np.sqrt(d_k)
        w = _softmax(s)
        out[..., i, :] = np.einsum("...j,...jd->...d", w, v) + w @ a_v
    return out


def direct_gather(q, k, v, rel_k, rel_v):
    """Right values, but every pair's vectors gathered: (n, n, d)."""
    n, d_k = q.shape[-2:]
    idx = table_rows(n, (len(rel_k) - 1) // 2)
    a_k, a_v = rel_k[idx], rel_v[idx]
    s = (
        q @ np.swapaxes(k, -1, -2) + (q[..., :, None, :] * a_k).sum(-1)
    ) / np.sqrt(d_k)
    w = _softmax(s)
    return w @ v + (w[..., None] * a_v).sum(-2)


def direct_gather_torch(q, k, v, rel_k, rel_v):
    """The same (n, n, d) gather written in torch, returned as numpy:
    tracemalloc does not see torch's allocations (the old checker accepted
    it)."""
    q, k, v, rel_k, rel_v = (
        torch.as_tensor(np.asarray(x, dtype=np.float64))
        for x in (q, k, v, rel_k, rel_v)
    )
    n, d_k = q.shape[-2:]
    idx = torch.as_tensor(table_rows(n, (len(rel_k) - 1) // 2))
    a_k, a_v = rel_k[idx], rel_v[idx]  # (n, n, d_k), (n, n, d_v)
    s = (
        q @ k.transpose(-1, -2) + torch.einsum("...id,ijd->...ij", q, a_k)
    ) / d_k**0.5
    w = torch.softmax(s, dim=-1)
    return (w @ v + torch.einsum("...ij,ijd->...id", w, a_v)).numpy()


def gathered_torch(q, k, v, rel_k, rel_v):
    """torch.gather on q @ rel_k.T, the weights summed per table row with
    scatter_add: (n, n) and (n, 2K + 1) arrays only."""
    q, k, v, rel_k, rel_v = (
        torch.as_tensor(np.asarray(x, dtype=np.float64))
        for x in (q, k, v, rel_k, rel_v)
    )
    n, d_k = q.shape[-2:]
    rows = 2 * ((len(rel_k) - 1) // 2) + 1
    idx = torch.as_tensor(table_rows(n, (rows - 1) // 2)).expand(
        *q.shape[:-2], n, n
    )
    relative = torch.gather(q @ rel_k.T, -1, idx)
    w = torch.softmax((q @ k.transpose(-1, -2) + relative) / d_k**0.5, -1)
    bins = torch.zeros(*w.shape[:-1], rows, dtype=w.dtype)
    bins.scatter_add_(-1, idx, w)
    return w @ v + bins @ rel_v


def no_clip(n, K):
    return table_rows(n, K, clip="none")


CATALOGUE = {
    "check_shaw_attention": {
        "right": [gathered, one_hot_float32, query_loop, gathered_torch],
        "wrong": [
            (
                lambda *a: gathered(
                    *a, rows=lambda n, K: table_rows(n, K, reverse=True)
                ),
                "offset_reversed",
            ),
            # student report stud06: m - n for one of the two tables only
            (
                lambda *a: gathered(
                    *a,
                    rows=lambda n, K: table_rows(n, K, reverse=True),
                    rows_v=table_rows,
                ),
                "offset_reversed_keys",
            ),
            (
                lambda *a: gathered(
                    *a, rows_v=lambda n, K: table_rows(n, K, reverse=True)
                ),
                "offset_reversed_values",
            ),
            (lambda *a: gathered(*a, rows=no_clip), "offsets_not_clipped"),
            (
                lambda *a: gathered(
                    *a, rows=lambda n, K: table_rows(n, K, clip="above")
                ),
                "offsets_not_clipped",
            ),
            (
                lambda *a: gathered(
                    *a, rows=lambda n, K: table_rows(n, K, shift=False)
                ),
                "index_not_shifted",
            ),
            (
                lambda *a: one_hot_float32(*a, shift=False),
                "index_not_shifted",
            ),
            (
                lambda *a: one_hot_float32(*a, clip_below=False),
                "offsets_not_clipped",
            ),
            (
                lambda *a: one_hot_float32(*a, clip_above=False),
                "offsets_not_clipped",
            ),
            (
                lambda *a: one_hot_float32(
                    *a, clip_below=False, clip_above=False
                ),
                "offsets_not_clipped",
            ),
            (lambda *a: gathered(*a, rel_values=False), "no_relative_values"),
            (lambda *a: gathered(*a, rel_keys=False), "no_relative_keys"),
            (
                lambda *a: gathered(*a, scale_relative=False),
                "relative_scores_unscaled",
            ),
            (direct_gather, "pairwise_tables"),
            (direct_gather_torch, "pairwise_tables"),
        ],
    },
}


def test_reference_passes(capsys):
    check_shaw_attention(gathered)
    assert capsys.readouterr().out.startswith("Correct:")


def test_stub_is_not_attempted():
    def stub(q, k, v, rel_k, rel_v):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_shaw_attention(stub)


def test_direct_gather_is_right_on_every_case_but_named_for_its_memory():
    with pytest.raises(ExerciseError) as err:
        check_shaw_attention(direct_gather)
    assert err.value.mistake == "pairwise_tables"
    assert "(memory)" in err.value.case


def test_torch_gather_is_named_for_its_memory():
    with pytest.raises(ExerciseError) as err:
        check_shaw_attention(direct_gather_torch)
    assert err.value.mistake == "pairwise_tables"
    assert "(memory)" in err.value.case


def test_in_place_answer_is_judged_on_its_output(capsys):
    def scales_q_in_place(q, k, v, rel_k, rel_v):
        q /= np.sqrt(q.shape[-1])
        # the relative term was scaled with q already
        return gathered(q * np.sqrt(q.shape[-1]), k, v, rel_k, rel_v)

    check_shaw_attention(scales_q_in_place)
    out = capsys.readouterr().out
    assert "Correct:" in out


def test_unknown_mistake_gets_the_generic_hint():
    def softmax_over_queries(q, k, v, rel_k, rel_v):
        n, d_k = q.shape[-2:]
        idx = table_rows(n, (len(rel_k) - 1) // 2)
        rel = np.take_along_axis(
            q @ rel_k.T, np.broadcast_to(idx, q.shape[:-2] + (n, n)), -1
        )
        s = (q @ np.swapaxes(k, -1, -2) + rel) / np.sqrt(d_k)
        e = np.exp(s - s.max(-2, keepdims=True))
        w = e / e.sum(-2, keepdims=True)
        return w @ v

    with pytest.raises(ExerciseError) as err:
        check_shaw_attention(softmax_over_queries)
    assert err.value.mistake is None


def test_messages_use_the_chapters_symbols():
    """Chapter 6 writes m for the query's position and n for the key's (and N
    for the length, in the exercise): the checker's messages must not switch
    to i, j (issue 31, student report stud06)."""
    import re

    from attnbook.exercises import relative_positions as rp

    texts = [rp.SHAW_HINT] + [
        m.description + " " + m.hint
        for m in rp.SHAW_MISTAKES + rp.SHAW_MEMORY_MISTAKES
    ]
    for text in texts:
        assert not re.search(r"\b[ij]\b|_\{?[ij]|c\(j", text), text
