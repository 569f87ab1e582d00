"""Checker for the backward pass of attention through its softmax (chapter 4,
hard exercise).

The reader writes ``attention_backward(q, k, v, d_out, mask=None)``, which
returns ``(grad_q, grad_k, grad_v)``, the gradients of a loss ``L`` with
respect to the inputs of ``softmax(q k^T / sqrt(d_k)) v`` given ``d_out =
dL/d(output)``, without forming the Jacobian of any row's softmax. The
reference goes the long way round: it forms every row's Jacobian ``diag(p) - p
p^T`` (:func:`attnbook.softmax.softmax_jacobian`) and multiplies by it, so that
it shares no shortcut with the answer it checks.
"""

from __future__ import annotations

import numpy as np

from ..attention import scaled_dot_product_attention
from ..softmax import softmax, softmax_jacobian
from .attention import is_boolean_index_error
from ._framework import (
    Case,
    ExerciseError,
    Mistake,
    as_array,
    run_checks,
    same,
)

_rng = np.random.default_rng
_EXERCISE = "attention backward"


def _t(x):
    """The last two axes swapped."""
    return np.swapaxes(x, -1, -2)


def attention_backward_reference(q, k, v, d_out, mask=None):
    """``(grad_q, grad_k, grad_v)`` in float64 through each row's full
    Jacobian, cast to the inputs' dtype (float64 unless they are all
    float32)."""
    dtype = np.result_type(q, k, v, d_out, np.float32)
    q, k, v, d_out = (np.asarray(a, np.float64) for a in (q, k, v, d_out))
    scale = 1 / np.sqrt(q.shape[-1])
    _, p = scaled_dot_product_attention(q, k, v, mask=mask)
    grad_v = _t(p) @ d_out
    d_p = d_out @ _t(v)
    # (..., n_q, n_k, n_k): J_i = diag(p_i) - p_i p_i^T, symmetric
    jac = softmax_jacobian(p)
    d_s = np.einsum("...ij,...ijk->...ik", d_p, jac)
    grad_q = d_s @ k * scale
    grad_k = _t(d_s) @ q * scale
    return tuple(g.astype(dtype, copy=False) for g in (grad_q, grad_k, grad_v))


def _grads(
    q,
    k,
    v,
    d_out,
    mask=None,
    *,
    rule="right",
    scale_q=True,
    scale_k=True,
    dv_untransposed=False,
    dk_untransposed=False,
    nan_rows=False,
    use_mask=True,
    scale_power=0.5,
    forward_power=0.5,
    dq_twice=False,
    dk_twice=False,
    fill=-np.inf,
):
    """A backward pass with one of the classic slips (``rule`` for the
    softmax's VJP, the flags for the rest); with the defaults, the right
    one."""
    q, k, v, d_out = (np.asarray(a, np.float64) for a in (q, k, v, d_out))
    scale = q.shape[-1] ** -scale_power
    s = q @ _t(k) / q.shape[-1] ** forward_power
    if mask is not None and use_mask:
        s = np.where(mask, s, fill)
    if nan_rows:
        # the max trick with no care for a row whose maximum is -inf
        e = np.exp(s - s.max(-1, keepdims=True))
        p = e / e.sum(-1, keepdims=True)
    else:
        p = softmax(s, axis=-1)
    # a forgotten transpose is committed wherever the shapes let it through
    # (square weights or scores); elsewhere a reader's code that fits the
    # shapes by some other route gets it right
    square = p.shape[-1] == p.shape[-2]
    grad_v = (p if dv_untransposed and square else _t(p)) @ d_out
    d_p = d_out @ _t(v)
    rows = -1 if rule != "row_term_over_queries" else -2
    if rule == "diagonal_only":
        d_s = p * (1 - p) * d_p
    elif rule == "no_row_term":
        d_s = p * d_p
    elif rule == "sign":
        d_s = p * ((p * d_p).sum(-1, keepdims=True) - d_p)
    elif rule == "unweighted_row_term":
        d_s = p * (d_p - d_p.sum(-1, keepdims=True))
    elif rule == "row_term_mean":
        d_s = p * (d_p - d_p.mean(-1, keepdims=True))
    elif rule == "scores_for_weights":
        s_safe = np.where(np.isfinite(s), s, 0.0)
        d_s = s_safe * (d_p - (s_safe * d_p).sum(-1, keepdims=True))
    else:
        d_s = p * (d_p - (p * d_p).sum(rows, keepdims=True))
    grad_q = (
        d_s @ k * (scale if scale_q else 1.0) * (scale if dq_twice else 1.0)
    )
    grad_k = (d_s if dk_untransposed and square else _t(d_s)) @ q
    grad_k = (
        grad_k * (scale if scale_k else 1.0) * (scale if dk_twice else 1.0)
    )
    return grad_q, grad_k, grad_v


def _boolean_indexed_backward(q, k, v, d_out, mask=None):
    """The right gradients, with the mask applied by boolean indexing (an
    IndexError for a mask that must broadcast)."""
    if mask is not None:
        s = np.asarray(q, np.float64) @ _t(np.asarray(k, np.float64))
        s[..., ~np.asarray(mask)] = -np.inf
    return _grads(q, k, v, d_out, mask)


def _commit(**slip):
    return lambda q, k, v, d_out, mask=None: _grads(
        q, k, v, d_out, mask, **slip
    )


ATTENTION_BACKWARD_MISTAKES = [
    Mistake(
        "dv_untransposed",
        "grad_v is P @ d_out, not P^T @ d_out: the weights must be "
        "transposed, "
        "since value j is used by every query i with weight P_ij (on a "
        "square P the shapes fit and the error is silent)",
        "output_i = sum_j P_ij v_j, so dL/dv_j = sum_i P_ij d_out_i: "
        "grad_v = swapaxes(P, -1, -2) @ d_out, shape (..., n_k, d_v)",
        _commit(dv_untransposed=True),
    ),
    Mistake(
        "dk_untransposed",
        "grad_k is dS @ q, not dS^T @ q: key j collects the gradient of "
        "column "
        "j of the scores, not of row j (on a square matrix the shapes fit "
        "and the error is silent)",
        "S_ij = q_i . k_j / sqrt(d_k), so dL/dk_j = sum_i dS_ij q_i / "
        "sqrt(d_k): grad_k = swapaxes(dS, -1, -2) @ q / sqrt(d_k)",
        _commit(dk_untransposed=True),
    ),
    Mistake(
        "diagonal_only",
        "the softmax's backward keeps only the diagonal of its Jacobian, "
        "dS = P * (1 - P) * dP: every weight depends on every score of its "
        "row (J_ij = -p_i p_j off the diagonal)",
        "J^T g = p * (g - sum(p * g)) for each row (eq. ch4-vjp): subtract "
        "each row's weighted sum (p * g).sum(-1, keepdims=True) from g "
        "before multiplying by p",
        _commit(rule="diagonal_only"),
    ),
    Mistake(
        "no_row_term",
        "dS = P * dP: the row term of the softmax's backward is missing (the "
        "weights sum to 1, so raising one lowers the others: "
        "J = diag(p) - p p^T, not diag(p))",
        "dS = P * (dP - (P * dP).sum(-1, keepdims=True)); the row term is "
        "also (d_out * output).sum(-1, keepdims=True)",
        _commit(rule="no_row_term"),
    ),
    Mistake(
        "sign",
        "dS has the wrong sign: p * (sum(p * g) - g) is -J^T g",
        "J^T g = p * (g - sum(p * g)): g minus the row term, not the row term "
        "minus g",
        _commit(rule="sign"),
    ),
    Mistake(
        "unweighted_row_term",
        "the row term subtracted from dP is its plain sum, sum_j dP_ij, not "
        "its weighted sum sum_j P_ij dP_ij",
        "(J^T g)_j = p_j (g_j - sum_i p_i g_i): the sum is weighted by the "
        "softmax's output, (P * dP).sum(-1, keepdims=True)",
        _commit(rule="unweighted_row_term"),
    ),
    Mistake(
        "row_term_mean",
        "the row term subtracted from dP is its plain mean over the keys, "
        "(1/n_k) sum_j dP_ij, not its weighted sum sum_j P_ij dP_ij: the "
        "two are equal for every dP only where a query's weights are "
        "uniform",
        "(J^T g)_j = p_j (g_j - sum_i p_i g_i): weight the sum by the "
        "softmax's output, (P * dP).sum(-1, keepdims=True), or use "
        "(d_out * output).sum(-1, keepdims=True)",
        _commit(rule="row_term_mean"),
    ),
    Mistake(
        "row_term_over_queries",
        "the row term sum(P * dP) is summed over the queries (axis -2), not "
        "over each query's keys: each row's softmax couples only that row's "
        "scores",
        "sum along the last axis, the keys: (P * dP).sum(axis=-1, "
        "keepdims=True), shape (..., n_q, 1)",
        _commit(rule="row_term_over_queries"),
    ),
    Mistake(
        "scores_for_weights",
        "the softmax's backward uses the scores S where it needs the weights "
        "P = softmax(S): the Jacobian diag(p) - p p^T is written in terms of "
        "the output of the softmax",
        "keep P from the forward pass and use it: dS = P * (dP - (P * "
        "dP).sum(-1, keepdims=True))",
        _commit(rule="scores_for_weights"),
    ),
    Mistake(
        "no_scale_in_backward",
        "grad_q and grad_k lack the factor 1/sqrt(d_k): the scores are q k^T "
        "/ "
        "sqrt(d_k), so the chain rule multiplies by 1/sqrt(d_k) on the way "
        "back too",
        "grad_q = dS @ k / sqrt(d_k) and grad_k = swapaxes(dS, -1, -2) @ q / "
        "sqrt(d_k)",
        _commit(scale_q=False, scale_k=False),
    ),
    Mistake(
        "no_scale_in_dk",
        "grad_k lacks the factor 1/sqrt(d_k) (grad_q has it): the scale "
        "multiplies "
        "the product q . k, so both factors' gradients carry it",
        "grad_k = swapaxes(dS, -1, -2) @ q / sqrt(d_k), like grad_q = dS @ k "
        "/ "
        "sqrt(d_k)",
        _commit(scale_k=False),
    ),
    Mistake(
        "no_scale_in_dq",
        "grad_q lacks the factor 1/sqrt(d_k) (grad_k has it): the scale "
        "multiplies "
        "the product q . k, so both factors' gradients carry it",
        "grad_q = dS @ k / sqrt(d_k), like grad_k = swapaxes(dS, -1, -2) @ q "
        "/ "
        "sqrt(d_k)",
        _commit(scale_q=False),
    ),
    Mistake(
        "dk_scaled_twice",
        "grad_k carries the factor 1/sqrt(d_k) twice (it is divided by d_k; "
        "grad_q is right): the scores are q k^T / sqrt(d_k), linear in k, so "
        "the chain rule brings the scale once",
        "grad_k = swapaxes(dS, -1, -2) @ q / sqrt(d_k): if dS already holds "
        "the scale, do not apply it again",
        _commit(dk_twice=True),
    ),
    Mistake(
        "dq_scaled_twice",
        "grad_q carries the factor 1/sqrt(d_k) twice (it is divided by d_k; "
        "grad_k is right): the scores are q k^T / sqrt(d_k), linear in q, so "
        "the chain rule brings the scale once",
        "grad_q = dS @ k / sqrt(d_k): if dS already holds the scale, do not "
        "apply it again",
        _commit(dq_twice=True),
    ),
    Mistake(
        "forward_scale_by_dk",
        "the scale is 1/d_k instead of 1/sqrt(d_k) in the forward pass as "
        "well as in the backward: these are the gradients of another "
        "function, attention whose scores are q k^T / d_k",
        "recompute the forward pass with S = q k^T / sqrt(d_k), as in "
        "eq. ch4-attention, and use that same scale for grad_q and grad_k",
        _commit(forward_power=1.0, scale_power=1.0),
    ),
    Mistake(
        "scale_by_dk",
        "grad_q and grad_k are divided by d_k instead of sqrt(d_k): the scale "
        "enters the chain rule once, as it entered the scores",
        "S = q k^T / sqrt(d_k) is linear in q and in k, so dS/dq carries "
        "1/sqrt(d_k) once: grad_q = dS @ k / sqrt(d_k)",
        _commit(scale_power=1.0),
    ),
    Mistake(
        "masked_row_nan",
        "a fully masked query (every key masked) gets NaN weights (its "
        "maximum is -inf, and -inf - (-inf) is NaN), and the NaN spreads: "
        "grad_k = dS^T q and grad_v = P^T d_out sum over all the queries, so "
        "every "
        "key's gradient is NaN",
        "give a fully masked row zero weights (subtract its maximum only "
        "where it is finite, as attnbook's stable_shift does): then its dS "
        "is 0 and it contributes nothing to any gradient",
        _commit(nan_rows=True),
    ),
    # the message names no fill: readers pick many
    *[
        Mistake(
            "finite_mask_fill",
            "the masked scores were set to a finite number (such as -1e9) "
            "instead of -inf: a query whose every key is masked then gets "
            "uniform weights 1/n_k instead of zeros, so it has an output and "
            "nonzero gradients, and it passes gradient to every key and value "
            "(with visible scores far below the fill, a masked key would "
            "even take weight)",
            "set the masked scores to -inf, np.where(mask, s, -np.inf), and "
            "give a fully masked row zero weights (its maximum is -inf: "
            "subtract it only where it is finite, as attnbook's stable_shift "
            "does); then its dS is 0 and it contributes to no gradient",
            _commit(fill=fill),
        )
        for fill in (-1e4, -65504.0, -1e9, -1e30, -3.4e38)
    ],
    Mistake(
        "mask_boolean_index",
        "boolean indexing s[..., ~mask] = -inf does not broadcast: the mask "
        "must have exactly the shape of the axes it indexes, so a padding "
        "mask (B, 1, 1, n_k), or a 2-D mask on a batch, raises IndexError",
        "use np.where(mask, s, -np.inf), which broadcasts the mask against "
        "the scores (..., n_q, n_k)",
        _boolean_indexed_backward,
        raises=is_boolean_index_error,
    ),
    Mistake(
        "mask_ignored",
        "the mask is not applied: the masked keys receive weight in the "
        "forward pass that the backward pass differentiates",
        "set the masked scores to -inf before the softmax, "
        "np.where(mask, s, -np.inf) (True = may attend)",
        _commit(use_mask=False),
    ),
]

_GRADIENT_NAMES = ("grad_q", "grad_k", "grad_v")


def _in_order(order):
    """The right gradients, returned in ``order`` (indices into (grad_q,
    grad_k, grad_v))."""

    def commit(q, k, v, d_out, mask=None):
        grads = _grads(q, k, v, d_out, mask)
        return tuple(grads[i] for i in order)

    return commit


# the right gradients returned in another order: on the square first case
# (every gradient of shape (4, 3)) only their values tell
ATTENTION_BACKWARD_MISTAKES += [
    Mistake(
        "wrong_order",
        "the three gradients are right but returned in the wrong order: "
        "you returned ("
        + ", ".join(_GRADIENT_NAMES[i] for i in order)
        + "), the exercise asks for (grad_q, grad_k, grad_v)",
        "return the gradient of each input in the order of the arguments q, "
        "k, v: return grad_q, grad_k, grad_v",
        _in_order(order),
    )
    for order in ((0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0))
]

# what the memory check names: not a function of the values (they are right)
ATTENTION_BACKWARD_COST_MISTAKES = [
    Mistake(
        "full_jacobian",
        "the values are right, but the backward pass formed the Jacobian of "
        "the softmax, an n_k x n_k matrix per query: O(n_k^2) memory held "
        "for one query at a time (a loop over the rows), O(n_q n_k^2) for "
        "every query at once, where O(n_q n_k) suffices",
        "J^T g never needs J: for each row, p * (g - sum(p * g)) (eq. "
        "ch4-vjp), one elementwise pass over the (..., n_q, n_k) arrays",
        lambda *args, **kwargs: None,
    ),
]


def attention_backward_cases() -> list[Case]:
    rng = _rng(4)

    def n(*shape, scale=1.0):
        return rng.normal(scale=scale, size=shape)

    batch_mask = np.ones((2, 3, 4), dtype=bool)
    # a fully masked query in the first batch, masked keys in the second
    batch_mask[0, 1, :] = False
    batch_mask[1, :, [0, 2]] = False
    batch_mask[1, 2, 1] = False
    square_mask = np.tril(np.ones((4, 4), dtype=bool))
    return [
        # square first: transposes forgotten fit its shapes and are named
        # by their values, not by a shape error
        Case(
            "self-attention, n_q = n_k = 4, d_k = d_v = 3",
            (n(4, 3), n(4, 3), n(4, 3), n(4, 3)),
        ),
        Case(
            "n_q = 3 queries, n_k = 5 keys, d_k = 4, d_v = 2",
            (n(3, 4), n(5, 4), n(5, 2), n(3, 2)),
        ),
        Case(
            "one key (n_k = 1: every weight is 1, so grad_q = grad_k = 0)",
            (n(3, 4), n(1, 4), n(1, 2), n(3, 2)),
        ),
        Case(
            "a causal mask, n = 4, d_k = d_v = 3",
            (n(4, 3), n(4, 3), n(4, 3), n(4, 3)),
            {"mask": square_mask},
        ),
        Case(
            "a batch (2, 3 queries, 4 keys) with masked keys and one query "
            "whose every key is masked (its gradients are 0)",
            (n(2, 3, 5), n(2, 4, 5), n(2, 4, 3), n(2, 3, 3)),
            {"mask": batch_mask},
        ),
        Case(
            "scores in the hundreds (|q . k| / sqrt(d_k) up to ~500)",
            (n(3, 4, scale=15), n(4, 4, scale=15), n(4, 2), n(3, 2)),
        ),
        Case(
            "float32 inputs, n_q = 2, n_k = 6, d_k = 8, d_v = 4",
            tuple(
                a.astype(np.float32)
                for a in (n(2, 8), n(6, 8), n(6, 4), n(2, 4))
            ),
        ),
        # last: a mask that must broadcast, as a padding mask does (one row
        # of real keys per sequence, over the heads and the queries); boolean
        # indexing s[~mask] passes every mask above, of the scores' shape
        Case(
            "a padding mask of shape (2, 1, 1, 5) for a batch of 2 "
            "sequences x 3 heads, n_q = 3, n_k = 5, d_k = 4, d_v = 2: "
            "sequence 0 has 3 real keys, sequence 1 has 4",
            (n(2, 3, 3, 4), n(2, 3, 5, 4), n(2, 3, 5, 2), n(2, 3, 3, 2)),
            {"mask": np.arange(5) < np.array([3, 4]).reshape(2, 1, 1, 1)},
        ),
    ]


def _as_three(out):
    """The reader's value as three numpy arrays, or None."""
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        return None
    try:
        return [as_array(g) for g in out]
    except Exception:
        return None


# One tolerance for every case, whatever the dtype of the inputs or of the
# answer: a backward pass computed in float32 (a relative 6e-8 per operation)
# is judged by its computation, not by the dtype it is cast back to. On these
# cases float32 work differs from the reference by at most about 1.2e-6
# (largest where d_p - (d_out * o).sum(-1) cancels, on the case with scores in
# the hundreds), 8 times below atol; every catalogued mistake differs by at
# least a tenth of the gradient's scale on some case.
_RTOL, _ATOL = 1e-4, 1e-5


def _same_grads(got, expected) -> bool:
    """Three gradients, each of the reference's shape, agreeing to rtol
    1e-4, atol 1e-5, the same for float64 and float32 (a float32
    computation is accepted whatever dtype it returns)."""
    g, e = _as_three(got), _as_three(expected)
    if g is None or e is None:
        return False
    return all(same(a, b, rtol=_RTOL, atol=_ATOL) for a, b in zip(g, e))


def _describe(got, expected, case) -> str:
    """Which of grad_q, grad_k, grad_v is wrong, and how."""
    g, e = _as_three(got), _as_three(expected)
    if g is None:
        return (
            "your function should return a tuple (grad_q, grad_k, grad_v) of "
            "three "
            f"arrays; it returned {type(got).__name__}"
        )
    parts = []
    for name, a, b in zip(("grad_q", "grad_k", "grad_v"), g, e):
        if a.shape != b.shape:
            parts.append(f"{name} has shape {a.shape}, expected {b.shape}")
        elif not same(a, b, rtol=_RTOL, atol=_ATOL):
            with np.errstate(invalid="ignore"):
                gap = np.nanmax(np.abs(a.astype(float) - b.astype(float)))
            if not np.all(np.isfinite(a.astype(float))):
                parts.append(f"{name} holds NaN or inf")
            else:
                parts.append(f"{name} differs (largest difference {gap:.3g})")
        else:
            parts.append(f"{name} is right")
    return "; ".join(parts)


def check_attention_backward(fn) -> None:
    """Check ``fn(q, k, v, d_out, mask=None)`` returns ``(grad_q, grad_k,
    grad_v)``, the gradients of attention without the softmax's Jacobian.

    q: (..., n_q, d_k), k: (..., n_k, d_k), v: (..., n_k, d_v), d_out:
    (..., n_q, d_v); mask: bool, broadcastable to (..., n_q, n_k), True = may
    attend; a query whose every key is masked has zero weights (the book's
    convention), and so zero gradients. Every case is compared to rtol 1e-4,
    atol 1e-5, whatever the dtypes: a backward pass computed in float32 is
    accepted whether it returns float32 or casts back. After the values, one
    long case (n_q = 4, n_k = 1024) measures the peak memory
    (:mod:`tracemalloc`, and torch's profiler where torch is imported,
    whatever the answer returns): an answer
    that forms a row's n_k x n_k Jacobian is rejected.
    """
    __tracebackhide__ = True
    cases = attention_backward_cases()
    run_checks(
        _EXERCISE,
        fn,
        cases,
        attention_backward_reference,
        ATTENTION_BACKWARD_MISTAKES,
        compare=_same_grads,
        describe=_describe,
        hint="go back through the forward pass one step at a time (S = q "
        "k^T / sqrt(d_k), P = softmax(S) row by row, O = P v): each "
        "gradient has the shape of what it is the gradient of, and the "
        "softmax step is eq. ch4-vjp applied to every row",
        quiet=True,
    )
    _check_memory(fn)
    print(
        f"Correct: {_EXERCISE} passes all {len(cases)} cases, and on n_k = "
        f"{_MEMORY_N_K} keys it never needed the memory of a row's n_k x n_k "
        "Jacobian."
    )


_MEMORY_N_Q, _MEMORY_N_K, _MEMORY_D = 4, 1024, 8


def _check_memory(fn) -> None:
    """Reject an answer whose peak memory on a long row is that of an n_k x
    n_k matrix (a quarter of one in float64: 2 MiB, where the right answer
    needs a few (n_q, n_k) arrays, 32 KiB each)."""
    from ..bench import format_bytes
    from ._framework import peak_memory_with_torch

    __tracebackhide__ = True
    rng = _rng(41)
    q = rng.normal(size=(_MEMORY_N_Q, _MEMORY_D))
    k, v = (rng.normal(size=(_MEMORY_N_K, _MEMORY_D)) for _ in range(2))
    d_out = rng.normal(size=(_MEMORY_N_Q, _MEMORY_D))
    args = (q, k, v, d_out)
    # before the reader's function, which gets copies (it may change them)
    expected = attention_backward_reference(*args)
    # numpy's arrays, and torch's allocations (which tracemalloc does not
    # see) whatever the answer returns
    out, peak = peak_memory_with_torch(fn, *args)
    case = (
        f"n_q = {_MEMORY_N_Q}, n_k = {_MEMORY_N_K}, d_k = d_v = {_MEMORY_D} "
        "(memory)"
    )
    jacobian_row = _MEMORY_N_K * _MEMORY_N_K * 8
    if peak >= jacobian_row // 4:
        (mistake,) = ATTENTION_BACKWARD_COST_MISTAKES
        raise ExerciseError(
            _EXERCISE,
            case,
            f"your function's peak memory was {format_bytes(peak)}; one row's "
            f"Jacobian is {format_bytes(jacobian_row)} in float64, the "
            f"weights of all {_MEMORY_N_Q} queries "
            f"{format_bytes(_MEMORY_N_Q * _MEMORY_N_K * 8)}",
            mistake=mistake,
        )
    if not _same_grads(out, expected):
        raise ExerciseError(
            _EXERCISE,
            case,
            "values differ from the reference on a long row: "
            + _describe(out, expected, None),
        )
