"""The chapter-5 checkers must pass correct solutions and reject each classic
mistake by name.

The implementations below are written independently of the checkers' own code
(torch view/permute, einsum, explicit loops over heads and tokens), the way a
reader might write them, so a checker that only recognised its own Mistake
functions would fail here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnbook.exercises._framework import ExerciseError, NotAttemptedError
from attnbook.exercises.multihead import (
    check_multihead_attention,
    check_split_qkv,
    check_strided_to_blocked,
)


# --- splitting a packed q/k/v projection -------------------------------------


def split_torch(qkv, n_heads):
    t = torch.from_numpy(qkv)
    b, n, three_d = t.shape
    d_head = three_d // 3 // n_heads
    q, k, v = t.chunk(3, dim=-1)
    return tuple(
        u.view(b, n, n_heads, d_head).transpose(1, 2) for u in (q, k, v)
    )


def split_loops(qkv, n_heads):
    b, n, three_d = qkv.shape
    d_model = three_d // 3
    d_head = d_model // n_heads
    out = np.zeros((3, b, n_heads, n, d_head))
    for part in range(3):
        for r in range(n_heads):
            for i in range(n):
                start = part * d_model + r * d_head
                out[part, :, r, i] = qkv[:, i, start : start + d_head]
    return out[0], out[1], out[2]


def split_einops_style(qkv, n_heads):
    # one reshape of the packed axis as (3, heads, d_head), then a single
    # permute
    b, n, three_d = qkv.shape
    x = qkv.reshape(b, n, 3, n_heads, three_d // 3 // n_heads).transpose(
        2, 0, 3, 1, 4
    )
    return list(x)  # a list of three is accepted as well as a tuple


SPLIT_WRONG = {
    "no_transpose": lambda qkv, h: tuple(
        u.reshape(qkv.shape[0], h, qkv.shape[1], -1)
        for u in torch.from_numpy(qkv).chunk(3, dim=-1)
    ),
    "heads_strided": lambda qkv, h: tuple(
        u.view(qkv.shape[0], qkv.shape[1], -1, h).permute(0, 3, 1, 2)
        for u in torch.from_numpy(qkv).chunk(3, dim=-1)
    ),
    "interleaved": lambda qkv, h: tuple(
        torch.from_numpy(qkv)
        .view(qkv.shape[0], qkv.shape[1], h, 3, -1)
        .permute(3, 0, 2, 1, 4)
        .unbind(0)
    ),
    "tokens_last": lambda qkv, h: tuple(
        np.einsum("bnhd->bhdn", u.reshape(u.shape[0], u.shape[1], h, -1))
        for u in (
            qkv[..., : qkv.shape[-1] // 3],
            qkv[..., qkv.shape[-1] // 3 : 2 * qkv.shape[-1] // 3],
            qkv[..., 2 * qkv.shape[-1] // 3 :],
        )
    ),
    "split_tokens": lambda qkv, h: tuple(
        u.view(qkv.shape[0], qkv.shape[1], h, -1).transpose(1, 2)
        for u in torch.from_numpy(qkv)
        .reshape(qkv.shape[0], 3 * qkv.shape[1], -1)
        .chunk(3, dim=1)
    ),
    # q, k, v read as every third feature, as an einops pattern "(d three)"
    # reads them (issue 31, student report 05)
    "packed_last": lambda qkv, h: tuple(
        np.moveaxis(qkv.reshape(*qkv.shape[:2], -1, 3), -1, 0)[i]
        .reshape(qkv.shape[0], qkv.shape[1], h, -1)
        .swapaxes(1, 2)
        for i in range(3)
    ),
    # the right split, returned in the wrong order
    "order_kqv": lambda qkv, h: (lambda q, k, v: (k, q, v))(
        *split_torch(qkv, h)
    ),
    # step 1 without step 2: heads cut but not moved in front of the tokens
    # (student report stud05b)
    "no_swap": lambda qkv, h: tuple(
        u.reshape(u.shape[0], u.shape[1], h, -1) for u in np.split(qkv, 3, -1)
    ),
    "order_qvk": lambda qkv, h: (lambda q, k, v: (q, v, k))(
        *split_loops(qkv, h)
    ),
}


# Torch-native answers: written for a tensor argument (no torch.from_numpy), as
# the exercise allows ("numpy or torch"). Such a function raises on the
# checker's numpy arrays ('numpy.ndarray' object has no attribute 'chunk'), so
# the checker gives it the cases as tensors.


def split_torch_native(qkv, n_heads):
    """Correct, in torch only: chunk into thirds, unflatten the features into
    heads, swap axes 1 and 2."""
    q, k, v = qkv.chunk(3, dim=-1)
    return tuple(
        p.unflatten(-1, (n_heads, -1)).transpose(1, 2) for p in (q, k, v)
    )


def split_torch_native_view(qkv, n_heads):
    """Correct, in torch only: the packed axis viewed as (3, heads, d_head),
    then one permute."""
    b, n, three_d = qkv.size()
    return (
        qkv.view(b, n, 3, n_heads, three_d // 3 // n_heads)
        .permute(2, 0, 3, 1, 4)
        .unbind(0)
    )


SPLIT_WRONG_TORCH_NATIVE = {
    "no_transpose": lambda qkv, h: tuple(
        u.reshape(u.size(0), h, u.size(1), -1) for u in qkv.chunk(3, dim=-1)
    ),
    "heads_strided": lambda qkv, h: tuple(
        u.unflatten(-1, (-1, h)).permute(0, 3, 1, 2)
        for u in qkv.chunk(3, dim=-1)
    ),
    "interleaved": lambda qkv, h: (
        qkv.unflatten(-1, (h, 3, -1)).permute(3, 0, 2, 1, 4).unbind(0)
    ),
    "tokens_last": lambda qkv, h: tuple(
        u.unflatten(-1, (h, -1)).permute(0, 2, 3, 1)
        for u in qkv.chunk(3, dim=-1)
    ),
    "order_kqv": lambda qkv, h: (lambda q, k, v: (k, q, v))(
        *split_torch_native(qkv, h)
    ),
    "no_swap": lambda qkv, h: tuple(
        u.unflatten(-1, (h, -1)) for u in qkv.chunk(3, dim=-1)
    ),
}


@pytest.mark.parametrize(
    "fn",
    [
        split_torch,
        split_loops,
        split_einops_style,
        split_torch_native,
        split_torch_native_view,
    ],
)
def test_split_checker_passes_correct_solutions(fn, capsys):
    check_split_qkv(fn)
    assert "Correct" in capsys.readouterr().out


def test_the_torch_native_answers_fail_on_arrays():
    """What made the old checker reject them: they do not run on the numpy
    arrays it passed."""
    qkv = np.random.default_rng(0).normal(size=(2, 5, 36))
    for fn in (
        split_torch_native,
        split_torch_native_view,
        *SPLIT_WRONG_TORCH_NATIVE.values(),
    ):
        with pytest.raises((AttributeError, TypeError)):
            fn(qkv, 3)


@pytest.mark.parametrize("key", sorted(SPLIT_WRONG_TORCH_NATIVE))
def test_split_checker_names_each_mistake_in_a_torch_native_answer(key):
    with pytest.raises(ExerciseError) as info:
        check_split_qkv(SPLIT_WRONG_TORCH_NATIVE[key])
    assert info.value.mistake == key, str(info.value)
    assert "raised" not in str(info.value)


def test_split_checker_reports_the_error_on_arrays_when_tensors_fail_too():
    def broken(qkv, n_heads):
        # fails on an array and on a tensor alike
        return qkv.reshape(7, -1, 5)

    with pytest.raises(ExerciseError) as info:
        check_split_qkv(broken)
    assert "your function raised ValueError" in str(
        info.value
    ) and "cannot reshape" in str(info.value)


def test_split_checker_notes_a_torch_native_answer_that_changes_its_input(
    capsys,
):
    def in_place(qkv, n_heads):
        q, k, v = qkv.chunk(3, dim=-1)
        out = tuple(
            p.unflatten(-1, (n_heads, -1)).transpose(1, 2).clone()
            for p in (q, k, v)
        )
        # changes the caller's tensor
        qkv.zero_()
        return out

    check_split_qkv(in_place)
    out = capsys.readouterr().out
    assert "changed its input `qkv` in place" in out and "Correct" in out


def test_split_checker_without_torch_reports_a_torch_native_answer_s_error():
    """In the browser there is no torch: the verdict is the error on the array,
    not a crash."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from attnbook.exercises import check_split_qkv\n"
        "def split_qkv(qkv, h):\n"
        "    return tuple(p.unflatten(-1, (h, -1)).transpose(1, 2) for p in "
        "qkv.chunk(3, dim=-1))\n"
        "try:\n"
        "    check_split_qkv(split_qkv)\n"
        "except AssertionError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        "AttributeError: 'numpy.ndarray' object has no attribute 'chunk'"
        in done.stdout
    )


@pytest.mark.parametrize("key", sorted(SPLIT_WRONG))
def test_split_checker_names_each_mistake(key):
    with pytest.raises(ExerciseError) as info:
        check_split_qkv(SPLIT_WRONG[key])
    assert info.value.mistake == key
    assert "Diagnosis" in str(info.value) and "Hint" in str(info.value)


def test_split_checker_reports_an_unknown_error_without_a_diagnosis():
    def off(qkv, h):
        q, k, v = split_torch(qkv, h)
        return q, k + 0.1, v

    with pytest.raises(ExerciseError) as info:
        check_split_qkv(off)
    assert info.value.mistake is None


def test_split_checker_rejects_a_result_that_is_not_three_tensors():
    with pytest.raises(ExerciseError, match=r"\(q, k, v\)"):
        check_split_qkv(lambda qkv, h: torch.stack(split_torch(qkv, h)))


def test_split_checker_names_the_shape_of_each_tensor_not_its_own_stack():
    with pytest.raises(ExerciseError) as info:
        check_split_qkv(
            lambda qkv, h: tuple(
                t.transpose(1, 2) for t in split_torch(qkv, h)
            )
        )
    message = str(info.value)
    assert (
        "each of q, k, v should have shape (batch, n_heads, n, d_head) = (2, "
        "3, 5, 4)" in message
    )
    assert (
        "yours have (2, 5, 3, 4)" in message
        and "(3, 2, 3, 5, 4)" not in message
    )


def test_split_checker_calls_the_neox_packing_a_real_layout():
    with pytest.raises(ExerciseError) as info:
        check_split_qkv(SPLIT_WRONG["interleaved"])
    assert "GPT-NeoX and BLOOM" in str(info.value)


def test_split_checker_reports_the_stub():
    def stub(qkv, n_heads):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_split_qkv(stub)


# --- multi-head attention ----------------------------------------------------


def mha_torch(x, w_q, w_k, w_v, w_o, n_heads):
    x, w_q, w_k, w_v, w_o = (
        torch.from_numpy(a) for a in (x, w_q, w_k, w_v, w_o)
    )
    b, n, d = x.shape
    q, k, v = (
        (x @ w).view(b, n, n_heads, d // n_heads).transpose(1, 2)
        for w in (w_q, w_k, w_v)
    )
    heads = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return heads.transpose(1, 2).reshape(b, n, d) @ w_o


def mha_loop(x, w_q, w_k, w_v, w_o, n_heads):
    b, n, d = x.shape
    d_head = d // n_heads
    out = np.zeros_like(x)
    for r in range(n_heads):
        cols = slice(r * d_head, (r + 1) * d_head)
        q, k, v = x @ w_q[:, cols], x @ w_k[:, cols], x @ w_v[:, cols]
        s = q @ k.transpose(0, 2, 1) / np.sqrt(d_head)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        # concat @ w_o = sum over heads of head_r @ (rows r of w_o)
        out += (p @ v) @ w_o[cols]
    return out


def mha_nn_module(x, w_q, w_k, w_v, w_o, n_heads):
    d = x.shape[-1]
    layer = torch.nn.MultiheadAttention(
        d, n_heads, bias=False, batch_first=True, dtype=torch.float64
    )
    with torch.no_grad():
        layer.in_proj_weight.copy_(
            torch.from_numpy(np.concatenate([w_q.T, w_k.T, w_v.T]))
        )
        layer.out_proj.weight.copy_(torch.from_numpy(w_o.T))
    xt = torch.from_numpy(x)
    return layer(xt, xt, xt, need_weights=False)[0].detach()


def _sdpa_heads(q, k, v, scale=None):
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, scale=scale
    )


def _wrong(
    split, merge, scale=None, out=True, weights=lambda w: w, softmax_dim=None
):
    def fn(x, w_q, w_k, w_v, w_o, n_heads):
        x, w_q, w_k, w_v, w_o = (
            torch.from_numpy(a) for a in (x, w_q, w_k, w_v, w_o)
        )
        w_q, w_k, w_v, w_o = map(weights, (w_q, w_k, w_v, w_o))
        q, k, v = (split(x @ w, n_heads) for w in (w_q, w_k, w_v))
        if softmax_dim is None:
            heads = _sdpa_heads(
                q, k, v, scale=None if scale is None else scale(x)
            )
        else:
            p = torch.softmax(
                q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=softmax_dim
            )
            heads = p @ v
        concat = merge(heads, x.shape)
        return concat @ w_o if out else concat

    return fn


def good_split(t, h):
    b, n, d = t.shape
    return t.view(b, n, h, d // h).transpose(1, 2)


def good_merge(t, shape):
    return t.transpose(1, 2).reshape(shape)


MHA_WRONG = {
    "one_head": _wrong(lambda t, h: t.unsqueeze(1), good_merge),
    "scale_d_model": _wrong(
        good_split, good_merge, scale=lambda x: x.shape[-1] ** -0.5
    ),
    "no_transpose": _wrong(
        lambda t, h: t.reshape(t.shape[0], h, t.shape[1], -1),
        lambda t, shape: t.reshape(shape),
    ),
    "merge_no_transpose": _wrong(
        good_split, lambda t, shape: t.reshape(shape)
    ),
    "split_no_transpose": _wrong(
        lambda t, h: t.reshape(t.shape[0], h, t.shape[1], -1), good_merge
    ),
    "heads_strided": _wrong(
        lambda t, h: t.unflatten(-1, (-1, h)).permute(0, 3, 1, 2),
        lambda t, shape: t.permute(0, 2, 3, 1).flatten(2),
    ),
    "no_out_proj": _wrong(good_split, good_merge, out=False),
    "wrong_axis": _wrong(good_split, good_merge, softmax_dim=-2),
    "transposed_weights": _wrong(
        good_split, good_merge, weights=lambda w: w.T
    ),
    "no_scale": _wrong(good_split, good_merge, scale=lambda x: 1.0),
    "causal_mask": lambda x, w_q, w_k, w_v, w_o, n_heads: _causal_mha(
        x, w_q, w_k, w_v, w_o, n_heads
    ),
    "scale_d_head": lambda x, w_q, w_k, w_v, w_o, n_heads: _loop_variant(
        x, w_q, w_k, w_v, w_o, n_heads, scale=n_heads / x.shape[-1]
    ),
    "scale_sqrt_heads": lambda x, w_q, w_k, w_v, w_o, n_heads: _loop_variant(
        x, w_q, w_k, w_v, w_o, n_heads, scale=1 / np.sqrt(n_heads)
    ),
    "w_o_transposed": lambda x, w_q, w_k, w_v, w_o, n_heads: mha_loop(
        x, w_q, w_k, w_v, w_o.T, n_heads
    ),
    "softmax_heads": _wrong(good_split, good_merge, softmax_dim=1),
    "keys_with_w_q": lambda x, w_q, w_k, w_v, w_o, n_heads: mha_torch(
        x, w_q, w_q, w_v, w_o, n_heads
    ),
    "strided_split": _wrong(
        lambda t, h: t.unflatten(-1, (-1, h)).permute(0, 3, 1, 2), good_merge
    ),
    # student report stud05b: the split right, the merge strided
    "strided_merge": _wrong(
        good_split, lambda t, shape: t.permute(0, 2, 3, 1).flatten(2)
    ),
    # student report stud0506: the values projected with the query matrix
    "values_with_w_q": lambda x, w_q, w_k, w_v, w_o, n_heads: _loop_variant(
        x, w_q, w_k, w_q, w_o, n_heads, scale=np.sqrt(n_heads / x.shape[-1])
    ),
    # student report stud0506: the scores as k q^T, einsum with the indices
    # of q and k swapped
    "scores_transposed": lambda x, w_q, w_k, w_v, w_o, n_heads: (
        _scores_swapped(x, w_q, w_k, w_v, w_o, n_heads)
    ),
}


def _scores_swapped(x, w_q, w_k, w_v, w_o, n_heads):
    """Scores as k q^T, written with einsum: the key index first."""
    b, n, d = x.shape
    dh = d // n_heads
    q, k, v = ((x @ w).reshape(b, n, n_heads, dh) for w in (w_q, w_k, w_v))
    s = np.einsum("bjhe,bihe->bhji", k, q) / np.sqrt(dh)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    heads = np.einsum("bhij,bjhe->bihe", p, v)
    return heads.reshape(b, n, d) @ w_o


def _loop_variant(x, w_q, w_k, w_v, w_o, n_heads, scale):
    """mha_loop with another scale: a loop over heads, written out."""
    b, n, d = x.shape
    d_head = d // n_heads
    out = np.zeros_like(x)
    for r in range(n_heads):
        cols = slice(r * d_head, (r + 1) * d_head)
        s = (x @ w_q[:, cols]) @ (x @ w_k[:, cols]).transpose(0, 2, 1) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        out += (p / p.sum(-1, keepdims=True)) @ (x @ w_v[:, cols]) @ w_o[cols]
    return out


def _causal_mha(x, w_q, w_k, w_v, w_o, n_heads):
    """A stray is_causal=True: what a reader copying decoder code writes."""
    x, w_q, w_k, w_v, w_o = (
        torch.from_numpy(a) for a in (x, w_q, w_k, w_v, w_o)
    )
    q, k, v = (good_split(x @ w, n_heads) for w in (w_q, w_k, w_v))
    heads = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True
    )
    return good_merge(heads, x.shape) @ w_o


@pytest.mark.parametrize("fn", [mha_torch, mha_loop, mha_nn_module])
def test_mha_checker_passes_correct_solutions(fn, capsys):
    check_multihead_attention(fn)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize("key", sorted(MHA_WRONG))
def test_mha_checker_names_each_mistake(key):
    with pytest.raises(ExerciseError) as info:
        check_multihead_attention(MHA_WRONG[key])
    assert info.value.mistake == key
    assert "Diagnosis" in str(info.value) and "Hint" in str(info.value)


def test_mha_checker_reports_an_unknown_error_without_a_diagnosis():
    with pytest.raises(ExerciseError) as info:
        check_multihead_attention(lambda *args: mha_loop(*args) * 1.01)
    assert info.value.mistake is None
    assert "largest difference" in str(info.value)


def test_mha_checker_reports_a_wrong_shape():
    with pytest.raises(ExerciseError, match="expected shape"):
        check_multihead_attention(lambda *args: mha_loop(*args)[:, :1])


def test_mha_checker_reports_the_stub():
    def stub(x, w_q, w_k, w_v, w_o, n_heads):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_multihead_attention(stub)


def test_the_checkers_own_head_split_agrees_with_the_library():
    """The references cut heads with reshapes of their own (independent, and
    free of torch): they agree with attnbook.heads on several shapes, and undo
    each other."""
    from attnbook import heads
    from attnbook.exercises import multihead as reference

    rng = np.random.default_rng(3)
    for shape, h in [
        ((2, 5, 12), 3),
        ((7, 8), 2),
        ((1, 1, 4), 4),
        ((2, 3, 6, 16), 4),
    ]:
        x = rng.normal(size=shape)
        split = reference.split_heads(x, h)
        np.testing.assert_array_equal(split, heads.split_heads(x, h))
        np.testing.assert_array_equal(
            reference.merge_heads(split), heads.merge_heads(split)
        )
        np.testing.assert_array_equal(reference.merge_heads(split), x)


def test_the_checkers_load_without_torch():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from attnbook.exercises import check_multihead_attention, "
        "check_split_qkv; print('loaded')"
    )
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True
        ).stdout
        == "loaded\n"
    )


def split_two(qkv, n_heads):
    """Wrong: forgets v (returns q and k only)."""
    b, n, three_d = qkv.shape
    d = three_d // 3
    return tuple(
        qkv[..., i * d : (i + 1) * d]
        .reshape(b, n, n_heads, d // n_heads)
        .transpose(0, 2, 1, 3)
        for i in range(2)
    )


def test_split_checker_names_two_returned_tensors_without_blaming_the_reader():
    """The old checker said "your function raised ValueError: ... got tuple"
    about an error its own stacking raised."""
    with pytest.raises(ExerciseError) as info:
        check_split_qkv(split_two)
    message = str(info.value)
    assert info.value.mistake == "two_returned", message
    assert "raised" not in message
    assert "returned a tuple of 2; return the three tensors (q, k, v)" in (
        message
    )


def mha_with_weights(x, w_q, w_k, w_v, w_o, n_heads):
    """Wrong: returns (output, weights), as the book's
    scaled_dot_product_attention does."""
    b, n, d = x.shape
    d_head = d // n_heads
    q, k, v = (
        np.moveaxis((x @ w).reshape(b, n, n_heads, d_head), 2, 1)
        for w in (w_q, w_k, w_v)
    )
    s = np.einsum("bhid,bhjd->bhij", q, k) / np.sqrt(d_head)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.moveaxis(p @ v, 1, 2).reshape(b, n, d) @ w_o
    return out, p


def test_mha_checker_names_a_returned_pair_instead_of_crashing():
    """The old checker crashed inside its own comparison with numpy's
    'inhomogeneous shape' ValueError."""
    with pytest.raises(ExerciseError) as info:
        check_multihead_attention(mha_with_weights)
    message = str(info.value)
    assert info.value.mistake == "returns_weights", message
    assert "raised" not in message and "inhomogeneous" not in message
    assert "return only the output, shape (batch, n, d_model)" in message
    assert "a tuple of 2 (shapes (2, 5, 12) and (2, 3, 5, 5))" in message


def test_mha_checker_still_accepts_a_list_of_per_sequence_outputs(capsys):
    check_multihead_attention(
        lambda x, *w: [mha_loop(x[i : i + 1], *w)[0] for i in range(len(x))]
    )
    assert "Correct" in capsys.readouterr().out


# --- (hard) the weights of a strided layer in the blocked layout ------------
# Written independently of the checker's Mistake functions: permutation
# matrices built in loops, index arrays from reshapes, einsum, torch.


def _perm_matrix(d, n_heads):
    """P with (W P)[:, r d_head + a] = W[:, a h + r], built entry by entry."""
    d_head = d // n_heads
    P = np.zeros((d, d))
    for r in range(n_heads):
        for a in range(d_head):
            P[a * n_heads + r, r * d_head + a] = 1.0
    return P


def strided_by_reshape(w_q, w_k, w_v, w_o, n_heads):
    """Right: the columns read as (d_head, h), swapped to (h, d_head); W_O's
    rows likewise."""
    d = w_q.shape[0]
    d_head = d // n_heads
    cols = [
        w.reshape(d, d_head, n_heads).swapaxes(1, 2).reshape(d, d)
        for w in (w_q, w_k, w_v)
    ]
    rows = w_o.reshape(d_head, n_heads, d).swapaxes(0, 1).reshape(d, d)
    return (*cols, rows)


def strided_by_matrix_float32(w_q, w_k, w_v, w_o, n_heads):
    """Right, in float32: W P for the projections, P^T W_O for the output."""
    P = _perm_matrix(len(w_q), n_heads)
    out = [w_q @ P, w_k @ P, w_v @ P, P.T @ w_o]
    return [w.astype(np.float32) for w in out]


def strided_in_place(w_q, w_k, w_v, w_o, n_heads):
    """Right, overwriting its inputs (the checker notes it)."""
    d = len(w_q)
    pi = np.arange(d).reshape(d // n_heads, n_heads).T.ravel()
    for w in (w_q, w_k, w_v):
        w[:] = w[:, pi]
    w_o[:] = w_o[pi]
    return w_q, w_k, w_v, w_o


def strided_heads_reversed(w_q, w_k, w_v, w_o, n_heads):
    """Right, though not the permutation of the chapter: the heads land in
    reverse order (head r in block h - 1 - r); the layer's function is the
    same."""
    d = len(w_q)
    d_head = d // n_heads
    pi = np.array(
        [
            a * n_heads + (n_heads - 1 - r)
            for r in range(n_heads)
            for a in range(d_head)
        ]
    )
    return w_q[:, pi], w_k[:, pi], w_v[:, pi], w_o[pi]


def strided_rotated(w_q, w_k, w_v, w_o, n_heads):
    """Right, and no permutation at all: after the permutation, each head's
    queries are multiplied by an invertible A and its keys by A^-T (scores
    unchanged), its values by B and its W_O rows by B^-1."""
    q, k, v, o = strided_by_reshape(w_q, w_k, w_v, w_o, n_heads)
    q, k, v, o = q.copy(), k.copy(), v.copy(), o.copy()
    d_head = len(w_q) // n_heads
    rng = np.random.default_rng(0)
    for r in range(n_heads):
        block = slice(r * d_head, (r + 1) * d_head)
        a = rng.normal(size=(d_head, d_head)) + 3 * np.eye(d_head)
        b = rng.normal(size=(d_head, d_head)) + 3 * np.eye(d_head)
        q[:, block] = q[:, block] @ a
        k[:, block] = k[:, block] @ np.linalg.inv(a).T
        v[:, block] = v[:, block] @ b
        o[block] = np.linalg.inv(b) @ o[block]
    return q, k, v, o


def strided_torch(w_q, w_k, w_v, w_o, n_heads):
    """Right, in torch: index_select with the permutation."""
    d = w_q.shape[0]
    pi = torch.arange(d).view(d // n_heads, n_heads).T.flatten()
    t = [torch.from_numpy(w) for w in (w_q, w_k, w_v, w_o)]
    return (
        *(w.index_select(1, pi) for w in t[:3]),
        t[3].index_select(0, pi),
    )


def strided_wrong_reshape_order(w_q, w_k, w_v, w_o, n_heads):
    """Wrong: the index array read as (h, d_head) and transposed, which is
    the inverse permutation."""
    d = len(w_q)
    idx = np.arange(d).reshape(n_heads, d // n_heads).T.ravel()
    return w_q[:, idx], w_k[:, idx], w_v[:, idx], w_o[idx]


def strided_forgets_w_o(w_q, w_k, w_v, w_o, n_heads):
    P = _perm_matrix(len(w_q), n_heads)
    return w_q @ P, w_k @ P, w_v @ P, w_o


def strided_all_columns(w_q, w_k, w_v, w_o, n_heads):
    """Wrong: every matrix's columns moved, W_O's too, in a loop."""
    d = len(w_q)
    d_head = d // n_heads
    out = [np.empty_like(w) for w in (w_q, w_k, w_v, w_o)]
    for new, old in zip(out, (w_q, w_k, w_v, w_o)):
        for r in range(n_heads):
            for a in range(d_head):
                new[:, r * d_head + a] = old[:, a * n_heads + r]
    return tuple(out)


def strided_p_times_w_o(w_q, w_k, w_v, w_o, n_heads):
    """Wrong: P W_O where P^T W_O is needed."""
    P = _perm_matrix(len(w_q), n_heads)
    return w_q @ P, w_k @ P, w_v @ P, P @ w_o


def strided_scores_only(w_q, w_k, w_v, w_o, n_heads):
    """Wrong: only the matrices of the scores are reordered."""
    d = len(w_q)
    q, k = (
        np.einsum("iah->iha", w.reshape(d, d // n_heads, n_heads)).reshape(
            d, d
        )
        for w in (w_q, w_k)
    )
    return q, k, w_v, w_o


def strided_left_multiply(w_q, w_k, w_v, w_o, n_heads):
    """Wrong: P on the wrong side of every matrix."""
    P = _perm_matrix(len(w_q), n_heads)
    return P.T @ w_q, P.T @ w_k, P.T @ w_v, w_o @ P


def strided_split_and_unsplit(w_q, w_k, w_v, w_o, n_heads):
    """Wrong: a reshape into heads and straight back, which moves nothing."""
    d = len(w_q)
    return tuple(
        w.reshape(d, n_heads, d // n_heads).reshape(d, d)
        for w in (w_q, w_k, w_v, w_o)
    )


STRIDED_WRONG = [
    (strided_wrong_reshape_order, "inverse_permutation"),
    (strided_forgets_w_o, "w_o_unchanged"),
    (strided_all_columns, "w_o_columns"),
    (strided_p_times_w_o, "w_o_inverse"),
    (strided_scores_only, "qk_only"),
    (strided_left_multiply, "wrong_side"),
    (strided_split_and_unsplit, "unchanged"),
]
STRIDED_RIGHT = [
    strided_by_reshape,
    strided_by_matrix_float32,
    strided_in_place,
    strided_heads_reversed,
    strided_rotated,
    strided_torch,
]


@pytest.mark.parametrize(
    "fn, key", STRIDED_WRONG, ids=[k for _, k in STRIDED_WRONG]
)
def test_strided_checker_names_each_mistake(fn, key):
    with pytest.raises(ExerciseError) as info:
        check_strided_to_blocked(fn)
    assert info.value.mistake == key, str(info.value)


@pytest.mark.parametrize("fn", STRIDED_RIGHT)
def test_strided_checker_accepts_every_conversion_that_computes_the_same(
    fn, capsys
):
    check_strided_to_blocked(fn)
    assert "Correct" in capsys.readouterr().out


def strided_key_slots_swapped(w_q, w_k, w_v, w_o, n_heads):
    """Wrong, and no classic slip: the keys' first two slots of every head
    swapped, the queries' not (issue 31, student report 05)."""
    q, k, v, o = strided_by_reshape(w_q, w_k, w_v, w_o, n_heads)
    d_head = len(w_q) // n_heads
    order = np.arange(len(w_q)).reshape(n_heads, d_head)
    order[:, [0, 1]] = order[:, [1, 0]]
    return q, k[:, order.ravel()], v, o


def strided_queries_doubled(w_q, w_k, w_v, w_o, n_heads):
    """Wrong: the queries scaled, the keys not."""
    q, k, v, o = strided_by_reshape(w_q, w_k, w_v, w_o, n_heads)
    return 2 * q, k, v, o


def strided_values_tripled(w_q, w_k, w_v, w_o, n_heads):
    """Wrong: the values scaled, W_O not."""
    q, k, v, o = strided_by_reshape(w_q, w_k, w_v, w_o, n_heads)
    return q, k, 3 * v, o


def strided_values_of_other_heads(w_q, w_k, w_v, w_o, n_heads):
    """Wrong: the values and W_O rows of the heads in reverse order, the
    queries and keys in order."""
    q, k, v, o = strided_by_reshape(w_q, w_k, w_v, w_o, n_heads)
    d_head = len(w_q) // n_heads
    order = np.arange(len(w_q)).reshape(n_heads, d_head)[::-1].ravel()
    return q, k, v[:, order], o[order]


@pytest.mark.parametrize(
    "fn, heads, says",
    [
        (strided_key_slots_swapped, "[0, 1, 2]", "W_K^(r)T that is no"),
        (strided_queries_doubled, "[0, 1, 2]", "W_K^(r)T that is no"),
        (strided_values_tripled, "[0, 1, 2]", "W_O^(r), what a head adds"),
        # with three heads reversed, the middle one stays in place
        (strided_values_of_other_heads, "[0, 2]", "what another adds"),
    ],
)
def test_strided_checker_says_which_heads_product_is_wrong(fn, heads, says):
    """Where no classic slip matches, the checker names the heads whose
    W_Q W_K^T or W_V W_O is no strided head's, and its hint says to check
    them head by head, not to compare with a derivation the chapter does not
    have (issue 31, student report 05)."""
    with pytest.raises(ExerciseError) as info:
        check_strided_to_blocked(fn)
    message = str(info.value)
    assert info.value.mistake is None, message
    assert says in message and f"Head(s) {heads} " in message, message
    assert "head by head" in message and "derivation" not in message


def test_strided_checker_notes_a_conversion_in_place(capsys):
    check_strided_to_blocked(strided_in_place)
    out = capsys.readouterr().out
    assert "changed its inputs `w_q`, `w_k`, `w_v`, `w_o` in place" in out


def test_strided_checker_says_what_was_returned_when_it_is_not_four():
    with pytest.raises(ExerciseError) as info:
        check_strided_to_blocked(lambda *args: strided_by_reshape(*args)[:3])
    message = str(info.value)
    assert "returned a tuple of 3" in message and "raised" not in message


def test_strided_checker_against_the_package_layer():
    """The checker's strided reference and its conversion, checked against
    the package's torch MultiHeadAttention loaded with the converted
    weights."""
    from attnbook.exercises import multihead as reference
    from attnbook.multihead import MultiHeadAttention

    rng = np.random.default_rng(4)
    d, h = 12, 3
    w = [rng.normal(size=(d, d)) / np.sqrt(d) for _ in range(4)]
    x = rng.normal(size=(2, 6, d))
    layer = MultiHeadAttention(d, h).double()
    with torch.no_grad():
        for proj, m in zip(
            (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj),
            strided_by_reshape(*w, h),
        ):
            proj.weight.copy_(torch.from_numpy(m.T))
        got = layer(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(
        got, reference._strided_layer(x, *w, h), atol=1e-12
    )
    # and the strided layer is not the blocked one with the same weights
    assert not np.allclose(reference._mha(x, *w, h), got)


# --- the catalogue (run by tests/test_exercises_framework.py) ----------------


def split_float32_einops(qkv, n_heads):
    """Correct: float32, the three parts cut by slicing, heads by a (n_heads,
    d_head) reshape."""
    a = np.asarray(qkv, np.float32)
    b, n, three_d = a.shape
    d = three_d // 3
    return tuple(
        np.moveaxis(
            a[..., i * d : (i + 1) * d].reshape(b, n, n_heads, d // n_heads),
            2,
            1,
        )
        for i in range(3)
    )


def mha_einsum(x, w_q, w_k, w_v, w_o, n_heads):
    """Correct: the heads as an axis of the weights, everything in einsum."""
    b, n, d = x.shape
    wq, wk, wv = (w.reshape(d, n_heads, d // n_heads) for w in (w_q, w_k, w_v))
    q, k, v = (np.einsum("bnd,dhe->bhne", x, w) for w in (wq, wk, wv))
    s = np.einsum("bhie,bhje->bhij", q, k) / np.sqrt(d // n_heads)
    p = np.exp(s - s.max(-1, keepdims=True))
    heads = np.einsum("bhij,bhje->bhie", p / p.sum(-1, keepdims=True), v)
    return np.einsum(
        "bhne,hef->bnf", heads, w_o.reshape(n_heads, d // n_heads, d)
    )


CATALOGUE = {
    "check_split_qkv": {
        "right": [
            split_torch,
            split_loops,
            split_einops_style,
            split_float32_einops,
            split_torch_native,
        ],
        "wrong": [(SPLIT_WRONG[key], key) for key in sorted(SPLIT_WRONG)]
        + [
            (SPLIT_WRONG_TORCH_NATIVE[key], key)
            for key in sorted(SPLIT_WRONG_TORCH_NATIVE)
        ]
        + [(split_two, "two_returned")],
    },
    "check_multihead_attention": {
        "right": [mha_torch, mha_loop, mha_nn_module, mha_einsum],
        "wrong": [(MHA_WRONG[key], key) for key in sorted(MHA_WRONG)]
        + [(mha_with_weights, "returns_weights")],
    },
    "check_strided_to_blocked": {
        "right": STRIDED_RIGHT,
        "wrong": STRIDED_WRONG,
    },
}


def test_a_split_returned_as_a_generator_is_accepted(capsys):
    """Reader ch05-x, C1: q, k, v = fn(...) unpacks a generator as well as a
    tuple, so a right split returned as a generator is right."""

    def split_as_generator(qkv, n_heads):
        b, n, _ = qkv.shape
        parts = qkv.reshape(b, n, 3, n_heads, -1).transpose(2, 0, 3, 1, 4)
        return (part for part in parts)

    check_split_qkv(split_as_generator)
    assert "passes all" in capsys.readouterr().out


def test_a_missing_return_is_named():
    """Reader ch05-x, C1: None was reported as "got ()"."""
    with pytest.raises(ExerciseError) as err:
        check_multihead_attention(lambda *args: None)
    assert "returned None (a missing `return`?)" in str(err.value)
