"""The attention-backward checker (chapter 4's hard exercise) rejects each
classic mistake with its diagnosis and accepts right answers written in other
ways; its reference agrees with torch's autograd.

The wrong solutions here are written independently of the checker's Mistake
functions, the way a student who half-understood eq. ch4-vjp would write them.
"""

import numpy as np
import pytest
import torch

from attnbook.exercises import ExerciseError, check_attention_backward
from attnbook.exercises.softmax_backward import (
    attention_backward_cases,
    attention_backward_reference,
)


def _weights(q, k, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    total = e.sum(axis=-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


# --- right ------------------------------------------------------------------


def backward_with_output_trick(q, k, v, d_out, mask=None):
    """The FlashAttention form: the row term sum_j P_ij dP_ij is d_out_i .
    o_i."""
    p = _weights(q, k, mask)
    o = p @ v
    d_v = np.swapaxes(p, -1, -2) @ d_out
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - (d_out * o).sum(axis=-1, keepdims=True))
    scale = 1 / np.sqrt(q.shape[-1])
    return d_s @ k * scale, np.swapaxes(d_s, -1, -2) @ q * scale, d_v


def backward_einsum(q, k, v, d_out, mask=None):
    """einsum throughout, in the inputs' dtype (float32 stays float32)."""
    scale = q.dtype.type(1 / np.sqrt(q.shape[-1]))
    s = np.einsum("...id,...jd->...ij", q, k) * scale
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m[~np.isfinite(m)] = 0
    e = np.exp(s - m)
    z = e.sum(-1, keepdims=True)
    p = e / np.where(z == 0, 1, z)
    d_p = np.einsum("...ie,...je->...ij", d_out, v)
    row = np.einsum("...ij,...ij->...i", p, d_p)[..., None]
    d_s = p * (d_p - row)
    return (
        np.einsum("...ij,...jd->...id", d_s, k) * scale,
        np.einsum("...ij,...id->...jd", d_s, q) * scale,
        np.einsum("...ij,...ie->...je", p, d_out),
    )


def backward_torch_autograd(q, k, v, d_out, mask=None):
    """torch's autograd in float64, with fully masked rows kept finite (a
    plain torch.softmax would give NaN there, and NaN gradients)."""
    q_t, k_t, v_t = (
        torch.tensor(np.asarray(a, np.float64), requires_grad=True)
        for a in (q, k, v)
    )
    s = q_t @ k_t.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        allowed = torch.as_tensor(np.broadcast_to(mask, s.shape).copy())
        none = ~allowed.any(-1, keepdim=True)
        s = s.masked_fill(~allowed, float("-inf")).masked_fill(none, 0.0)
        p = torch.softmax(s, dim=-1).masked_fill(none, 0.0)
    else:
        p = torch.softmax(s, dim=-1)
    (p @ v_t).backward(torch.from_numpy(np.asarray(d_out, np.float64)))
    return q_t.grad, k_t.grad, v_t.grad


def backward_row_loop(q, k, v, d_out, mask=None):
    """One query at a time, the 1-D formula of eq. ch4-vjp; in place on the
    caller's q (scaled first), which the checker notes."""
    q /= np.sqrt(q.shape[-1])
    batch = q.shape[:-2]
    d_q = np.zeros(q.shape)
    d_k = np.zeros(k.shape)
    d_v = np.zeros(v.shape)
    full = (
        None
        if mask is None
        else np.broadcast_to(mask, batch + (q.shape[-2], k.shape[-2]))
    )
    for b in np.ndindex(batch):
        for i in range(q.shape[-2]):
            s = k[b] @ q[b][i]
            if full is not None:
                s = np.where(full[b][i], s, -np.inf)
            if np.all(np.isneginf(s)):
                continue
            p = np.exp(s - s.max())
            p /= p.sum()
            g = v[b] @ d_out[b][i]
            d_s = p * (g - p @ g)
            d_q[b][i] = d_s @ k[b]
            d_k[b] += np.outer(d_s, q[b][i])
            d_v[b] += np.outer(p, d_out[b][i])
    return d_q / np.sqrt(q.shape[-1]), d_k, d_v


# --- wrong ------------------------------------------------------------------


def backward_full_jacobian(q, k, v, d_out, mask=None):
    """Right values, through the (n_q, n_k, n_k) Jacobian."""
    p = _weights(q, k, mask)
    jac = p[..., :, None] * np.eye(p.shape[-1]) - (
        p[..., :, None] * p[..., None, :]
    )
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = np.einsum("...ijk,...ij->...ik", jac, d_p)
    scale = 1 / np.sqrt(q.shape[-1])
    return (
        d_s @ k * scale,
        np.swapaxes(d_s, -1, -2) @ q * scale,
        np.swapaxes(p, -1, -2) @ d_out,
    )


def backward_sigmoid_style(q, k, v, d_out, mask=None):
    """ "The derivative of the softmax is p (1 - p)", as for a sigmoid."""
    p = _weights(q, k, mask)
    d_s = p * (1 - p) * (d_out @ np.swapaxes(v, -1, -2))
    c = np.sqrt(q.shape[-1])
    return (
        d_s @ k / c,
        np.swapaxes(d_s, -1, -2) @ q / c,
        (np.swapaxes(p, -1, -2) @ d_out),
    )


def backward_forgets_scale(q, k, v, d_out, mask=None):
    p = _weights(q, k, mask)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - np.sum(p * d_p, axis=-1, keepdims=True))
    return (
        d_s @ k,
        np.swapaxes(d_s, -1, -2) @ q,
        np.swapaxes(p, -1, -2) @ d_out,
    )


def backward_dk_unscaled(q, k, v, d_out, mask=None):
    p = _weights(q, k, mask)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - np.sum(p * d_p, axis=-1, keepdims=True))
    d_q = d_s @ k / np.sqrt(q.shape[-1])
    return d_q, np.swapaxes(d_s, -1, -2) @ q, np.swapaxes(p, -1, -2) @ d_out


def backward_dv_without_transpose(q, k, v, d_out, mask=None):
    p = _weights(q, k, mask)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - np.sum(p * d_p, axis=-1, keepdims=True))
    c = np.sqrt(q.shape[-1])
    return d_s @ k / c, np.swapaxes(d_s, -1, -2) @ q / c, p @ d_out


def backward_dk_without_transpose(q, k, v, d_out, mask=None):
    p = _weights(q, k, mask)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - np.sum(p * d_p, axis=-1, keepdims=True))
    c = np.sqrt(q.shape[-1])
    return d_s @ k / c, d_s @ q / c, np.swapaxes(p, -1, -2) @ d_out


def backward_dk_transposed_only_when_forced(q, k, v, d_out, mask=None):
    """dS @ q wherever the shapes allow it, the transpose only where they
    force it (a reader who fixed the shape error, not the formula)."""
    p = _weights(q, k, mask)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - np.sum(p * d_p, axis=-1, keepdims=True))
    c = np.sqrt(q.shape[-1])
    fits = d_s.shape[-1] == q.shape[-2]
    d_k = (d_s if fits else np.swapaxes(d_s, -1, -2)) @ q / c
    return d_s @ k / c, d_k, np.swapaxes(p, -1, -2) @ d_out


def backward_dv_transposed_only_when_forced(q, k, v, d_out, mask=None):
    """P @ d_out wherever the shapes allow it."""
    p = _weights(q, k, mask)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - np.sum(p * d_p, axis=-1, keepdims=True))
    c = np.sqrt(q.shape[-1])
    fits = p.shape[-1] == d_out.shape[-2]
    d_v = (p if fits else np.swapaxes(p, -1, -2)) @ d_out
    return d_s @ k / c, np.swapaxes(d_s, -1, -2) @ q / c, d_v


def backward_plain_sum(q, k, v, d_out, mask=None):
    """g - sum(g): the row term without the weights."""
    p = _weights(q, k, mask)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - d_p.sum(-1, keepdims=True))
    c = np.sqrt(q.shape[-1])
    return (
        d_s @ k / c,
        np.swapaxes(d_s, -1, -2) @ q / c,
        (np.swapaxes(p, -1, -2) @ d_out),
    )


def backward_unsafe_masked_rows(q, k, v, d_out, mask=None):
    """The max trick with nothing for a row that is entirely masked."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - (p * d_p).sum(-1, keepdims=True))
    c = np.sqrt(q.shape[-1])
    return (
        d_s @ k / c,
        np.swapaxes(d_s, -1, -2) @ q / c,
        (np.swapaxes(p, -1, -2) @ d_out),
    )


def backward_negated(q, k, v, d_out, mask=None):
    p = _weights(q, k, mask)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (np.sum(p * d_p, axis=-1, keepdims=True) - d_p)
    c = np.sqrt(q.shape[-1])
    return (
        d_s @ k / c,
        np.swapaxes(d_s, -1, -2) @ q / c,
        (np.swapaxes(p, -1, -2) @ d_out),
    )


def backward_ignores_mask(q, k, v, d_out, mask=None):
    return backward_with_output_trick(q, k, v, d_out)


def backward_scaled_by_d(q, k, v, d_out, mask=None):
    p = _weights(q, k, mask)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - np.sum(p * d_p, axis=-1, keepdims=True))
    d = q.shape[-1]
    return (
        d_s @ k / d,
        np.swapaxes(d_s, -1, -2) @ q / d,
        (np.swapaxes(p, -1, -2) @ d_out),
    )


CATALOGUE = {
    "check_attention_backward": {
        "right": [
            backward_with_output_trick,
            backward_einsum,
            backward_torch_autograd,
            backward_row_loop,
        ],
        "wrong": [
            (backward_full_jacobian, "full_jacobian"),
            (backward_sigmoid_style, "diagonal_only"),
            (backward_forgets_scale, "no_scale_in_backward"),
            (backward_dk_unscaled, "no_scale_in_dk"),
            (backward_dv_without_transpose, "dv_untransposed"),
            (backward_dk_without_transpose, "dk_untransposed"),
            (backward_plain_sum, "unweighted_row_term"),
            (backward_unsafe_masked_rows, "masked_row_nan"),
            (backward_negated, "sign"),
            (backward_ignores_mask, "mask_ignored"),
            (backward_scaled_by_d, "scale_by_dk"),
            (backward_dk_transposed_only_when_forced, "dk_untransposed"),
            (backward_dv_transposed_only_when_forced, "dv_untransposed"),
        ],
    },
}


@pytest.mark.parametrize(
    "case", attention_backward_cases(), ids=lambda c: c.name[:40]
)
def test_the_reference_agrees_with_torch_autograd(case):
    """The checker's reference (each row's full Jacobian) against torch's
    autograd in float64, on every case."""
    expected = attention_backward_reference(*case.args, **case.kwargs)
    args = [np.asarray(a, np.float64) for a in case.args]
    got = backward_torch_autograd(*args, **case.kwargs)
    for e, g in zip(expected, got):
        tol = 1e-5 if e.dtype == np.float32 else 1e-12
        np.testing.assert_allclose(e, g.numpy(), rtol=tol, atol=tol)


def test_a_fully_masked_query_has_zero_gradients_in_the_reference():
    case = attention_backward_cases()[4]
    d_q, d_k, d_v = attention_backward_reference(*case.args, **case.kwargs)
    assert np.all(d_q[0, 1] == 0) and np.all(np.isfinite(d_k))


def backward_full_jacobian_torch_to_numpy(q, k, v, d_out, mask=None):
    """Right values, through the (n_q, n_k, n_k) Jacobian built in torch,
    returned as numpy arrays: the old checker measured torch's memory only
    for returned tensors, and accepted it (issue 24)."""
    q, k, v, d_out = (
        torch.as_tensor(np.asarray(a, np.float64)) for a in (q, k, v, d_out)
    )
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        allowed = torch.as_tensor(np.broadcast_to(mask, s.shape).copy())
        s = s.masked_fill(~allowed, float("-inf"))
    # a fully masked row: NaN weights, made 0
    p = torch.nan_to_num(torch.softmax(s, dim=-1))
    jac = torch.diag_embed(p) - p[..., :, None] * p[..., None, :]
    d_s = torch.einsum("...ijk,...ij->...ik", jac, d_out @ v.transpose(-1, -2))
    scale = q.shape[-1] ** -0.5
    grads = (d_s @ k * scale, d_s.transpose(-1, -2) @ q * scale)
    return tuple(g.numpy() for g in (*grads, p.transpose(-1, -2) @ d_out))


@pytest.mark.parametrize(
    "jacobian",
    [backward_full_jacobian, backward_full_jacobian_torch_to_numpy],
)
def test_the_full_jacobian_diagnosis_names_the_memory(jacobian):
    with pytest.raises(ExerciseError) as err:
        check_attention_backward(jacobian)
    assert err.value.mistake == "full_jacobian"
    assert "(memory)" in str(err.value) and "peak memory" in str(err.value)


CATALOGUE["check_attention_backward"]["wrong"] += [
    (backward_full_jacobian_torch_to_numpy, "full_jacobian")
]


def test_the_row_loop_changes_q_and_is_still_accepted(capsys):
    check_attention_backward(backward_row_loop)
    out = capsys.readouterr().out
    assert "changed its input `q`" in out and "Correct" in out


# --- from the expert reading of chapter 4 (s6, E2): the verdict depended on
# the dtype the answer returned, not on its computation. The book's four
# steps computed in float32 were accepted when they returned float32 and
# rejected ("d_q differs (largest difference 2.6e-07)") when cast back to
# the inputs' float64; float32 inputs scaled by a float64 scalar (numpy 2
# promotes to float64) were rejected too.


def backward_float32(q, k, v, d_out, mask=None, returned=None):
    """The book's four steps in float32, the gradients cast to ``returned``
    (float32 where None)."""
    q, k, v, d_out = (np.asarray(a, np.float32) for a in (q, k, v, d_out))
    scale = np.float32(1 / np.sqrt(q.shape[-1]))
    s = q @ np.swapaxes(k, -1, -2) * scale
    if mask is not None:
        s = np.where(mask, s, np.float32(-np.inf))
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, np.float32(0)))
    z = e.sum(axis=-1, keepdims=True)
    p = np.divide(e, z, out=np.zeros_like(e), where=z > 0)
    o = p @ v
    d_v = np.swapaxes(p, -1, -2) @ d_out
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - (d_out * o).sum(axis=-1, keepdims=True))
    grads = (d_s @ k * scale, np.swapaxes(d_s, -1, -2) @ q * scale, d_v)
    return tuple(g.astype(returned or np.float32) for g in grads)


def backward_float32_cast_back(q, k, v, d_out, mask=None):
    """Right: float32 work, the gradients cast back to the inputs' dtype."""
    dtype = np.result_type(q, k, v, d_out)
    return backward_float32(q, k, v, d_out, mask, returned=dtype)


def backward_float32_float64_scale(q, k, v, d_out, mask=None):
    """Right: float32 inputs scaled by a float64 numpy scalar, which numpy 2
    promotes to float64 from there on (numpy 1 keeps float32)."""
    q, k, v, d_out = (np.asarray(a, np.float32) for a in (q, k, v, d_out))
    scale = 1 / np.sqrt(np.float64(q.shape[-1]))
    p = _weights(q * scale * np.sqrt(q.shape[-1]), k, mask)
    o = p @ v
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - (d_out * o).sum(axis=-1, keepdims=True)) * scale
    return (
        d_s @ k,
        np.swapaxes(d_s, -1, -2) @ q,
        np.swapaxes(p, -1, -2) @ d_out,
    )


def backward_float32_dk_untransposed_cast_back(q, k, v, d_out, mask=None):
    """Wrong (dS @ q where the shapes let it through), in float32, cast back
    to float64: the old checker compared it strictly with its own float64
    mistakes and named none."""
    dtype = np.result_type(q, k, v, d_out)
    q, k, v, d_out = (np.asarray(a, np.float32) for a in (q, k, v, d_out))
    grads = backward_dk_transposed_only_when_forced(q, k, v, d_out, mask)
    return tuple(g.astype(dtype) for g in grads)


def backward_float32_no_row_term_cast_back(q, k, v, d_out, mask=None):
    dtype = np.result_type(q, k, v, d_out)
    q, k, v, d_out = (np.asarray(a, np.float32) for a in (q, k, v, d_out))
    p = _weights(q, k, mask)
    d_s = p * (d_out @ np.swapaxes(v, -1, -2))
    c = np.float32(np.sqrt(q.shape[-1]))
    grads = (d_s @ k / c, np.swapaxes(d_s, -1, -2) @ q / c)
    return tuple(
        g.astype(dtype) for g in (*grads, np.swapaxes(p, -1, -2) @ d_out)
    )


CATALOGUE["check_attention_backward"]["right"] += [
    backward_float32,
    backward_float32_cast_back,
    backward_float32_float64_scale,
]
CATALOGUE["check_attention_backward"]["wrong"] += [
    (backward_float32_dk_untransposed_cast_back, "dk_untransposed"),
    (backward_float32_no_row_term_cast_back, "no_row_term"),
]


@pytest.mark.parametrize("returned", [np.float32, np.float64])
def test_float32_work_gets_one_verdict_whatever_dtype_it_returns(
    returned, capsys
):
    check_attention_backward(
        lambda q, k, v, d_out, mask=None: backward_float32(
            q, k, v, d_out, mask, returned=returned
        )
    )
    assert capsys.readouterr().out.startswith("Correct:")


@pytest.mark.parametrize("returned", [np.float32, np.float64])
def test_a_float32_mistake_is_named_whatever_dtype_it_returns(returned):
    def wrong(q, k, v, d_out, mask=None):
        grads = backward_dk_unscaled(
            *(np.asarray(a, np.float32) for a in (q, k, v, d_out)), mask
        )
        return tuple(g.astype(returned) for g in grads)

    with pytest.raises(ExerciseError) as err:
        check_attention_backward(wrong)
    assert err.value.mistake == "no_scale_in_dk"


# --- from the expert reading of chapter 4 (s6, reader t, section 3): three
# plausible slips got the generic hint only, no diagnosis (B-W2, B-W4,
# B-W10).


def backward_row_term_mean(q, k, v, d_out, mask=None):
    """The row term taken as the mean of dP over the keys."""
    p = _weights(q, k, mask)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - d_p.mean(axis=-1, keepdims=True))
    c = np.sqrt(q.shape[-1])
    return (
        d_s @ k / c,
        np.swapaxes(d_s, -1, -2) @ q / c,
        (np.swapaxes(p, -1, -2) @ d_out),
    )


def backward_dk_scaled_twice(q, k, v, d_out, mask=None):
    """dS scaled once for d_q and d_k, then d_k scaled again."""
    c = 1 / np.sqrt(q.shape[-1])
    p = _weights(q, k, mask)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - np.sum(p * d_p, axis=-1, keepdims=True)) * c
    return (
        d_s @ k,
        np.swapaxes(d_s, -1, -2) @ q * c,
        (np.swapaxes(p, -1, -2) @ d_out),
    )


def backward_dq_scaled_twice(q, k, v, d_out, mask=None):
    c = 1 / np.sqrt(q.shape[-1])
    p = _weights(q, k, mask)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - np.sum(p * d_p, axis=-1, keepdims=True))
    return (
        d_s @ k * c / np.sqrt(q.shape[-1]),
        (np.swapaxes(d_s, -1, -2) @ q * c),
        np.swapaxes(p, -1, -2) @ d_out,
    )


def backward_scale_one_over_d_everywhere(q, k, v, d_out, mask=None):
    """1/d_k as the scale, in the forward pass and in the backward."""
    c = 1 / q.shape[-1]
    s = q @ np.swapaxes(k, -1, -2) * c
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    total = e.sum(axis=-1, keepdims=True)
    p = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    o = p @ v
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - (d_out * o).sum(axis=-1, keepdims=True))
    return (
        d_s @ k * c,
        np.swapaxes(d_s, -1, -2) @ q * c,
        (np.swapaxes(p, -1, -2) @ d_out),
    )


CATALOGUE["check_attention_backward"]["wrong"] += [
    (backward_row_term_mean, "row_term_mean"),
    (backward_dk_scaled_twice, "dk_scaled_twice"),
    (backward_dq_scaled_twice, "dq_scaled_twice"),
    (backward_scale_one_over_d_everywhere, "forward_scale_by_dk"),
]


# --- from the student reading of chapters 3 and 4 (section 5): the right
# gradients returned in another order, which the square first case lets
# through by shape ------------------------------------------------------------


def backward_values_first(q, k, v, d_out, mask=None):
    """Right gradients, returned "in the order the forward pass ends": d_v,
    d_k, d_q."""
    d_q, d_k, d_v = backward_with_output_trick(q, k, v, d_out, mask)
    return d_v, d_k, d_q


def backward_keys_first(q, k, v, d_out, mask=None):
    """Right gradients in einsum, d_k and d_q swapped."""
    d_q, d_k, d_v = backward_einsum(q, k, v, d_out, mask)
    return [d_k, d_q, d_v]


@pytest.mark.parametrize(
    "fn, named",
    [
        (backward_values_first, "(grad_v, grad_k, grad_q)"),
        (backward_keys_first, "(grad_k, grad_q, grad_v)"),
    ],
)
def test_gradients_in_the_wrong_order_are_named(fn, named):
    with pytest.raises(ExerciseError) as err:
        check_attention_backward(fn)
    assert err.value.mistake == "wrong_order", str(err.value)
    assert f"you returned {named}" in str(err.value)


CATALOGUE["check_attention_backward"]["wrong"] += [
    (backward_values_first, "wrong_order"),
    (backward_keys_first, "wrong_order"),
]


# --- from the fifth expert reading of chapter 4 (s8 reader ch04-x): a finite
# mask fill was rejected with the generic hint only ---------------------------


def backward_finite_fill(q, k, v, d_out, mask=None, fill=-1e9):
    """The masked scores set to -1e9: a fully masked query gets uniform
    weights, so it passes gradient to every key and value."""
    q, k, v, d_out = (np.asarray(a, np.float64) for a in (q, k, v, d_out))
    c = 1 / np.sqrt(q.shape[-1])
    s = q @ np.swapaxes(k, -1, -2) * c
    if mask is not None:
        s = np.where(mask, s, fill)
    e = np.exp(s - s.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - (p * d_p).sum(-1, keepdims=True))
    return (
        d_s @ k * c,
        np.swapaxes(d_s, -1, -2) @ q * c,
        (np.swapaxes(p, -1, -2) @ d_out),
    )


def backward_finite_fill_float32_min(q, k, v, d_out, mask=None):
    return backward_finite_fill(
        q, k, v, d_out, mask, fill=float(np.finfo(np.float32).min)
    )


CATALOGUE["check_attention_backward"]["wrong"] += [
    (backward_finite_fill, "finite_mask_fill"),
    (backward_finite_fill_float32_min, "finite_mask_fill"),
]


def test_finite_mask_fill_in_the_backward_is_named():
    with pytest.raises(ExerciseError) as err:
        check_attention_backward(backward_finite_fill)
    assert err.value.mistake == "finite_mask_fill"
    assert "uniform weights" in str(err.value)


# --- from the ninth expert reading of chapter 4 (s8 reader ch04-bb): a mask
# applied by boolean indexing passed every case (all masks had the scores'
# shape) ----------------------------------------------------------------------


def backward_boolean_indexed_mask(q, k, v, d_out, mask=None):
    q, k, v, d_out = (np.asarray(a, np.float64) for a in (q, k, v, d_out))
    c = 1 / np.sqrt(q.shape[-1])
    s = q @ np.swapaxes(k, -1, -2) * c
    if mask is not None:
        s[~mask] = -np.inf
    m = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    z = e.sum(-1, keepdims=True)
    p = np.divide(e, z, out=np.zeros_like(e), where=z > 0)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = p * (d_p - (p * d_p).sum(-1, keepdims=True))
    return (
        d_s @ k * c,
        np.swapaxes(d_s, -1, -2) @ q * c,
        (np.swapaxes(p, -1, -2) @ d_out),
    )


CATALOGUE["check_attention_backward"]["wrong"] += [
    (backward_boolean_indexed_mask, "mask_boolean_index"),
]


# --- from the expert reading of chapter 4 (s12 y04sm, section 3): the
# Jacobian formed one row at a time holds O(n_k^2), not O(n_q n_k^2) ---------


def backward_row_jacobian_loop(q, k, v, d_out, mask=None):
    """Right values, through each query's (n_k, n_k) Jacobian in turn."""
    p = _weights(q, k, mask)
    d_p = d_out @ np.swapaxes(v, -1, -2)
    d_s = np.empty_like(p)
    for idx in np.ndindex(p.shape[:-1]):
        row = p[idx]
        jac = np.diag(row) - np.outer(row, row)
        d_s[idx] = jac.T @ d_p[idx]
    scale = 1 / np.sqrt(q.shape[-1])
    return (
        d_s @ k * scale,
        np.swapaxes(d_s, -1, -2) @ q * scale,
        np.swapaxes(p, -1, -2) @ d_out,
    )


CATALOGUE["check_attention_backward"]["wrong"] += [
    (backward_row_jacobian_loop, "full_jacobian")
]


def test_a_row_by_row_jacobian_is_named_with_its_own_memory_order():
    with pytest.raises(ExerciseError) as err:
        check_attention_backward(backward_row_jacobian_loop)
    assert err.value.mistake == "full_jacobian"
    assert "O(n_k^2) memory held for one query at a time" in str(err.value)
