"""Checkers for the delta rule (chapter 16): a state that recalls every pair
exactly, and the backward pass of one delta-rule step.

The exact memory's mistakes are those of a state written as linear attention
writes it (the sum of outer products, exact only for orthonormal keys), by one
pass of the delta rule (exact only for the last key; with unit keys and
beta = 1, or with the raw keys and beta = 1 / ||k||^2), with the keys
normalised first (the delta rule's habit, which changes what a key reads),
transposed (``(d_v, d_k)``), solved as a square system, exact but not of
least norm (a state that recalls every pair but has a part orthogonal to
every key, as a solve of the singular normal equations ``K^T K S = K^T V``
returns, when it does not fail), right in another shape (``S[None]``), or
only close to the answer (within about 1e-2: an iteration stopped early; or
further, within half its norm, in the span of the keys: an iteration from
``S = 0`` stopped long before it converged).
The backward
step's mistakes are those of differentiating ``S' = S + beta k (v - S^T
k)^T`` with one path left out: the state's own path through the correction,
the read's path to ``k`` (or all of it), the read's part of ``d beta``, the
``beta`` of ``dv`` or of ``dk``; with a sign slipped: of the read's path to
``k``, of the state's path through the correction, or of ``d beta``; with
the read's path to ``k`` transposed (``G S^T k`` for ``S G^T k``); or the right
gradients in the wrong shapes (each is compared with the exercise's shape
before its values: ``dS (d_k, d_v)``, ``dk (d_k,)``, ``dv (d_v,)``, ``dbeta``
a number or of shape ``(1,)``). Both checkers
want a float64 answer (rtol 1e-6, atol 1e-8) and name as the float32 mistake
the right answer in float32 (every entry a float32 number, within about 1e-5
of the float64 answer; for the backward step, any one gradient so), computed
in float32 or computed in float64 and returned as float32. Inputs are float64
torch tensors; the answer may be torch tensors or numpy arrays.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ._framework import (
    Case,
    Mistake,
    as_array,
    difference,
    run_checks,
    same,
)

# --- an answer right up to float32 rounding (both exercises) -----------------

FLOAT32_DESCRIPTION = (
    "right up to float32 rounding: compute in float64, the dtype you were "
    "given"
)


class _InFloat32:
    """The right answer as a float32 computation gives it, up to that
    computation's rounding: :func:`_compare` matches it to a reader's answer
    whose entries are all float32 numbers and agree with ``value`` within
    about 1e-5 (rtol 1e-4, atol 1e-5)."""

    def __init__(self, value):
        self.value = value


def _float32_numbers(got) -> bool:
    """Whether every entry of ``got`` is a float32 number (a float32 result,
    whether or not it was cast back to float64 afterwards)."""
    try:
        a = as_array(got).astype(np.float64)
    except (TypeError, ValueError):
        return False
    return bool(np.array_equal(a, a.astype(np.float32).astype(np.float64)))


def _compare(got, expected) -> bool:
    """The checkers' comparison: float64 agreement with the answer, or, for
    the float32 mistake's stand-in, float32 agreement. An answer whose
    entries are all float32 numbers is not a float64 answer, however close
    its values: float64 computed and returned as float32 is the float32
    mistake too."""
    if isinstance(expected, _InFloat32):
        return _float32_numbers(got) and same(
            got, expected.value, rtol=1e-4, atol=1e-5
        )
    if isinstance(expected, _Reshaped):
        a, e = as_array(got), as_array(expected.value)
        return (
            a.shape != e.shape
            and a.size == e.size
            and same(a.ravel(), e.ravel(), rtol=1e-6, atol=1e-8)
        )
    if isinstance(expected, _Recalls):
        a = as_array(got)
        keys, values = as_array(expected.keys), as_array(expected.values)
        return (
            a.shape == (keys.shape[1], values.shape[1])
            and not _float32_numbers(got)
            and bool(np.all(np.isfinite(a)))
            and same(keys @ a, values, rtol=1e-6, atol=1e-8)
        )
    if isinstance(expected, _InKeySpan):
        a, e = as_array(got), as_array(expected.value)
        if a.shape != e.shape or not bool(np.all(np.isfinite(a))):
            return False
        keys = as_array(expected.keys)
        # the part of each column of a orthogonal to the span of the keys
        outside = a - keys.T @ np.linalg.lstsq(keys.T, a, rcond=None)[0]
        size = np.linalg.norm(a)
        return bool(
            np.linalg.norm(outside) <= 1e-6 * size
            and np.linalg.norm(a - e) < 0.5 * np.linalg.norm(e)
        )
    if isinstance(expected, _Near):
        a, e = as_array(got), as_array(expected.value)
        return a.shape == e.shape and same(a, e, rtol=1e-2, atol=1e-3)
    if _float32_numbers(got) and not _float32_numbers(expected):
        return False
    return same(got, expected, rtol=1e-6, atol=1e-8)


def _float32_mistake(reference) -> Mistake:
    return Mistake(
        "float32",
        FLOAT32_DESCRIPTION,
        "the inputs are float64 tensors: keep them so (no .float(), no "
        "np.float32, not even at the end); float32 keeps about 7 "
        "significant digits, and the check wants a float64 answer (every "
        "entry a float64 number) within 1e-6 of each entry's size, plus "
        "1e-8, of the right one",
        lambda *args: _InFloat32(reference(*args)),
    )


# --- a state that recalls every pair exactly ---------------------------------


def _reference_exact_memory(keys, values):
    return torch.linalg.pinv(keys) @ values


def _additive(keys, values):
    return keys.T @ values


def _one_delta_pass(keys, values):
    k = F.normalize(keys, dim=-1)
    state = keys.new_zeros(keys.shape[1], values.shape[1])
    for k_t, v_t in zip(k, values):
        state = state + torch.outer(k_t, v_t - state.T @ k_t)
    return state


def _one_scaled_delta_pass(keys, values):
    # the raw keys with beta_i = 1 / ||k_i||^2: Kaczmarz's first sweep
    state = keys.new_zeros(keys.shape[1], values.shape[1])
    for k_t, v_t in zip(keys, values):
        state = state + torch.outer(k_t, v_t - state.T @ k_t) / (k_t @ k_t)
    return state


def _normalised_keys(keys, values):
    return torch.linalg.pinv(F.normalize(keys, dim=-1)) @ values


def _transposed(keys, values):
    return (torch.linalg.pinv(keys) @ values).T


def _square_solve(keys, values):
    return torch.linalg.solve(keys, values)


class _Reshaped:
    """The right state, its entries in row-major order, in a shape other
    than ``(d_k, d_v)`` (``S[None]``, a flat vector): :func:`_compare`
    matches it to a reader's answer of the right values in another shape."""

    def __init__(self, value):
        self.value = value


class _Near:
    """The right state up to about 1e-2: :func:`_compare` matches it to a
    reader's answer within rtol 1e-2, atol 1e-3 of ``value`` (a right answer
    too, so that the mistake is named only where the reader's answer is
    wrong: an iteration stopped early, a small error added)."""

    def __init__(self, value):
        self.value = value


class _Recalls:
    """Any state that recalls every pair, ``K S = V`` within the checkers'
    tolerance (rtol 1e-6, atol 1e-8), of shape ``(d_k, d_v)`` and in float64:
    :func:`_compare` matches it to such a reader's answer. The least-norm
    state is one of them, so the mistake is named only where the reader's
    state recalls every pair and is not that one."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values


class _InKeySpan:
    """The right state up to half its norm, with its columns in the span of
    the keys, as an iteration from ``S = 0`` keeps them (passes of the delta
    rule, gradient descent): :func:`_compare` matches it to a reader's
    answer of shape ``(d_k, d_v)`` whose part orthogonal to every key is
    below 1e-6 of its norm and whose distance from ``value`` is below half
    of ``value``'s norm (the least-norm state is one of them, so the mistake
    is named only where the reader's answer is wrong)."""

    def __init__(self, keys, value):
        self.keys, self.value = keys, value


def _is_square_error(err: Exception) -> bool:
    return isinstance(err, RuntimeError) and "square" in str(err)


def _is_singular_error(err: Exception) -> bool:
    # torch's LinAlgError is a RuntimeError, numpy's a ValueError
    return isinstance(err, (RuntimeError, ValueError)) and (
        "singular" in str(err).lower()
    )


EXACT_MEMORY_MISTAKES = [
    Mistake(
        "additive",
        "the state is linear attention's sum of outer products K^T V: each "
        "read adds the other values times k_i . k_j, so it is exact only "
        "when the keys are orthonormal",
        "solve S^T k_i = v_i for all i at once: K S = V, least norm",
        _additive,
    ),
    Mistake(
        "one_delta_pass",
        "one pass of the delta rule (beta = 1): the last key reads its value "
        "exactly, but each later write changed what the earlier keys read",
        "the delta rule reaches the exact state only after many passes: "
        "derive the state from K S = V instead (the proof of part 3), and "
        "compute it with linear solves",
        _one_delta_pass,
    ),
    Mistake(
        "one_scaled_delta_pass",
        "one pass of the delta rule on the keys as given, with beta_i = 1 / "
        "||k_i||^2 (one sweep of Kaczmarz's method): the last key reads its "
        "value exactly, but each later write changed what the earlier keys "
        "read",
        "the passes converge to the least-norm state only in the limit: "
        "derive the state from K S = V instead (the proof of part 3), and "
        "compute it with linear solves",
        _one_scaled_delta_pass,
    ),
    Mistake(
        "normalised_keys",
        "the keys were normalised first: the state recalls v_i under k_i / "
        "||k_i||, so under k_i itself it reads ||k_i|| v_i",
        "use the keys as given: S^T k_i = v_i with the k_i of the case",
        _normalised_keys,
    ),
    Mistake(
        "transposed",
        "the state is transposed, (d_v, d_k): the book's state has one row "
        "per key channel, S (d_k, d_v), read as S^T k",
        "return S of shape (d_k, d_v) with K S = V",
        _transposed,
    ),
    Mistake(
        "square_solve",
        "torch.linalg.solve(K, V) needs a square K: with fewer pairs than "
        "key channels, K (n, d_k) has no inverse and many states recall "
        "every pair",
        "the exercise wants the one of least norm: in which subspace must "
        "the columns of that state lie? Write S in that form and solve for "
        "what is left",
        _square_solve,
        raises=_is_square_error,
    ),
    _float32_mistake(_reference_exact_memory),
    Mistake(
        "not_least_norm",
        "the state recalls every pair (K S = V) but is not the one of least "
        "norm: with fewer pairs than key channels many states do, and a "
        "solve of the normal equations K^T K S = K^T V (singular then) "
        "returns an arbitrary one of them, or fails",
        "the least-norm state has no part orthogonal to every key: in "
        "which subspace must its columns lie? Write S in that form and "
        "solve for what is left",
        _Recalls,
        raises=_is_singular_error,
    ),
    Mistake(
        "wrong_shape",
        "the values are right, but the state has the wrong shape: the "
        "exercise asks for S (d_k, d_v), one row per key channel",
        "return S of shape (d_k, d_v): no [None], no reshape, no flatten",
        lambda *args: _Reshaped(_reference_exact_memory(*args)),
    ),
    Mistake(
        "approximate",
        "the state is close to the least-norm one (within about 1e-2) but "
        "not equal to it within the check's tolerance (1e-6 of each "
        "entry's size, plus 1e-8): an iteration stopped early (passes "
        "of the delta rule converge slowly, most slowly when there are as "
        "many pairs as key channels), a regulariser, or a small error "
        "added",
        "compute the exact state from a closed formula, derived from K S = "
        "V, with linear solves: no iteration, no regulariser",
        lambda *args: _Near(_reference_exact_memory(*args)),
    ),
    Mistake(
        "stopped_early",
        "the state lies in the span of the keys, as the least-norm one does, "
        "and is within half its norm of it, but does not recall every pair: "
        "an iteration from S = 0 (passes of the delta rule, gradient "
        "descent) stopped long before it converged, or a large regulariser",
        "passes of the delta rule converge to the least-norm state only in "
        "the limit: compute it from a closed formula, derived from K S = V, "
        "with linear solves",
        lambda keys, values: _InKeySpan(
            keys, _reference_exact_memory(keys, values)
        ),
    ),
]


def exact_memory_cases() -> list[Case]:
    g = torch.Generator().manual_seed(0)

    def pairs(n, d_k, d_v, spread=2.0):
        # keys of several lengths, not orthogonal
        keys = torch.randn(n, d_k, generator=g, dtype=torch.float64)
        lengths = 0.5 + spread * torch.rand(
            n, 1, generator=g, dtype=torch.float64
        )
        keys = F.normalize(keys, dim=-1) * lengths
        return keys, torch.randn(n, d_v, generator=g, dtype=torch.float64)

    return [
        Case("3 pairs, d_k = 6, d_v = 4", pairs(3, 6, 4)),
        Case(
            "6 pairs, d_k = 6 (as many pairs as key channels), d_v = 3",
            pairs(6, 6, 3),
        ),
        Case("one pair, d_k = 4, d_v = 5", pairs(1, 4, 5)),
        Case("5 pairs, d_k = 8, d_v = 8", pairs(5, 8, 8)),
    ]


def check_exact_memory(fn) -> None:
    """Check ``fn(keys, values)`` returns the state ``S (d_k, d_v)`` of
    least norm with ``S^T k_i = v_i`` for every pair; keys: (n, d_k), n <=
    d_k, linearly independent, not of unit length; values: (n, d_v); float64
    torch tensors."""
    run_checks(
        "a state that recalls every pair exactly",
        fn,
        exact_memory_cases(),
        _reference_exact_memory,
        EXACT_MEMORY_MISTAKES,
        compare=_compare,
        hint="recall of every pair is K S = V (the proof of part 3): one "
        "solution when n = d_k, many when n < d_k, of which the exercise "
        "wants the one of least norm",
    )


# --- the backward pass of one delta-rule step --------------------------------


def _grads(
    S,
    k,
    v,
    beta,
    G,
    dk_form="right",
    state_path=True,
    read_in_beta=True,
    beta_in_dv=True,
    state_sign=-1.0,
    dbeta_sign=1.0,
):
    """The gradients of <G, S'> with S' = S + beta k (v - S^T k)^T, or a
    mistaken form of one of them."""
    error = v - S.T @ k  # (d_v,)
    dS = G + state_sign * beta * torch.outer(k, G.T @ k) if state_path else G
    # k is the written key (beta G error) and reads S in the error
    # (-beta S G^T k)
    dk = {
        "right": beta * (G @ error - S @ (G.T @ k)),
        "no_read": beta * (G @ error),
        "write_only": beta * (G @ v),
        "read_sign": beta * (G @ error + S @ (G.T @ k)),
        "read_transposed": beta * (G @ error - G @ (S.T @ k)),
        "no_beta": G @ error - S @ (G.T @ k),
        "no_written_key": -beta * (S @ (G.T @ k)),
        "written_key_twice": beta
        * (G @ error - S @ (G.T @ k) - G @ (S.T @ k)),
    }[dk_form]
    dv = (beta if beta_in_dv else 1.0) * (G.T @ k)
    dbeta = dbeta_sign * (k @ G @ (error if read_in_beta else v))
    return dS, dk, dv, dbeta


def _reference_backward(S, k, v, beta, G):
    return _grads(S, k, v, beta, G)


_GRADIENT_NAMES = ("dS", "dk", "dv", "dbeta")


def _parts(grads) -> tuple:
    """The four gradients as float64 numpy arrays, each of the shape it was
    returned in (a float32 answer keeps its float32 values); anything but
    four of them is an error."""
    if not isinstance(grads, (tuple, list)) or len(grads) != 4:
        raise TypeError(
            "return the four gradients (dS, dk, dv, dbeta) as a tuple"
        )
    return tuple(as_array(x).astype(np.float64) for x in grads)


def _flat(grads) -> np.ndarray:
    """The four gradients as one vector, each row-major. It compares values
    only: a gradient of the right values in another shape (a (1, d_k) row
    for dk) gives the same vector, so :func:`_shape_fault` compares the
    shapes first."""
    return np.concatenate([np.atleast_1d(x).ravel() for x in _parts(grads)])


def _shape_fault(got, expected) -> str | None:
    """What is wrong with the shapes of the reader's four gradients, or None:
    dS (d_k, d_v), dk (d_k,) and dv (d_v,) as the inputs S, k and v are;
    dbeta a number, a 0-d array or one of shape (1,)."""
    faults = []
    for name, g, e in zip(_GRADIENT_NAMES, _parts(got), _parts(expected)):
        allowed = {(), (1,)} if name == "dbeta" else {e.shape}
        if g.shape not in allowed:
            wanted = "a number" if name == "dbeta" else f"shape {e.shape}"
            faults.append(
                f"{name} has shape {g.shape}; the exercise asks for {wanted}"
            )
    return "; ".join(faults) or None


class _WrongShapes:
    """The right gradients, their entries in row-major order, returned in
    shapes other than the exercise's: :func:`_compare_backward` matches it
    to a reader's answer whose values are right and whose shapes are not."""

    def __init__(self, value):
        self.value = value


def _compare_backward(got, expected) -> bool:
    """The backward checker's comparison: each gradient of the exercise's
    shape (:func:`_shape_fault`), then the values as :func:`_compare`
    compares them; for the stand-in :class:`_WrongShapes`, right values in
    wrong shapes."""
    if isinstance(expected, _WrongShapes):
        return _shape_fault(got, expected.value) is not None and _compare(
            _flat(got), _flat(expected.value)
        )
    value = expected.value if isinstance(expected, _InFloat32) else expected
    if _shape_fault(got, value) is not None:
        return False
    flat = _flat(value)
    if isinstance(expected, _InFloat32):
        # at least one gradient of float32 numbers, all values right up to
        # float32 rounding
        return any(
            _float32_numbers(g) and not _float32_numbers(e)
            for g, e in zip(_parts(got), _parts(value))
        ) and same(_flat(got), flat, rtol=1e-4, atol=1e-5)
    # each gradient a float64 answer (:func:`_compare`), then all values
    return all(
        not _float32_numbers(g) or _float32_numbers(e)
        for g, e in zip(_parts(got), _parts(value))
    ) and _compare(_flat(got), flat)


def _describe_backward(got, expected, case=None) -> str:
    """Which gradients have the wrong shape, or else which differ and by how
    much."""
    fault = _shape_fault(got, expected)
    if fault is not None:
        return fault
    parts = []
    for name, g, e in zip(_GRADIENT_NAMES, _parts(got), _parts(expected)):
        g = g.reshape(e.shape)  # dbeta of shape (1,)
        if _float32_numbers(g) and not _float32_numbers(e):
            parts.append(f"{name} holds float32 numbers, not float64 ones")
        elif not _compare(g, e):
            parts.append(f"{name}: {difference(g, e, case)}")
    return "; ".join(parts) or "values differ from the reference"


def _mistake(**left_out):
    return lambda S, k, v, beta, G: _grads(S, k, v, beta, G, **left_out)


BACKWARD_MISTAKES = [
    Mistake(
        "no_state_path",
        "dS = G: the state also enters the correction, S' = (I - beta k "
        "k^T) S + beta k v^T",
        "S appears twice in S': alone and in the read k k^T S; add the "
        "gradient through the read (move k k^T to the other side of the "
        "inner product)",
        _mistake(state_path=False),
    ),
    Mistake(
        "state_path_sign",
        "dS has the wrong sign on the state's path through the correction: "
        "S' = (I - beta k k^T) S + beta k v^T, so dS = G - beta k (G^T k)^T",
        "the read enters the correction with a minus, v - S^T k: carry it "
        "into dS",
        _mistake(state_sign=1.0),
    ),
    Mistake(
        "read_not_in_dk",
        "dk misses the read's path: k also reads the state in S^T k, "
        "inside the error v - S^T k",
        "k enters twice, as the written key and in the read: add the "
        "gradient of <G, -beta k k^T S> through its second k",
        _mistake(dk_form="no_read"),
    ),
    Mistake(
        "written_key_not_in_dk",
        "dk = -beta S G^T k misses the written key's path: k is also the "
        "key that the correction writes, beta k (v - S^T k)^T",
        "k enters twice, as the written key and in the read: add the "
        "gradient of <G, beta k e^T> in the written k, with the error e = "
        "v - S^T k held fixed",
        _mistake(dk_form="no_written_key"),
    ),
    Mistake(
        "written_key_twice",
        "dk counts the written key's path twice: the quadratic form k^T S "
        "G^T k of <G, -beta k k^T S> has the gradient (S G^T + G S^T) k, "
        "whose G S^T k is the written key's path, already inside beta G (v "
        "- S^T k)",
        "the G S^T k of the quadratic form's gradient and the -G S^T k "
        "inside beta G (v - S^T k) are the same path, the written key's: "
        "count it once",
        _mistake(dk_form="written_key_twice"),
    ),
    Mistake(
        "dk_write_only",
        "dk = beta G v: k was treated as a constant inside the correction "
        "v - S^T k, both in the written vector and in the read",
        "the error v - S^T k depends on k: differentiate the written key "
        "and the read, one k at a time",
        _mistake(dk_form="write_only"),
    ),
    Mistake(
        "read_sign",
        "the read's path to k has the wrong sign: S' = S - beta k k^T S + "
        "..., so it enters with a minus",
        "carry the minus of -beta k k^T S through to its term in dk",
        _mistake(dk_form="read_sign"),
    ),
    Mistake(
        "read_transposed",
        "the read's path to k is G S^T k, with S transposed and applied on "
        "the wrong side: <G, k k^T S> = k^T S G^T k, in which the read is "
        "the k on the left (k^T S), and the gradient of a^T M b in a is M "
        "b, so the read's path is S G^T k, (d_k, d_v) times (d_v,)",
        "write the read's term as k^T (S G^T) k and differentiate it in the "
        "k on the left, the read's k^T S (in the k on the right it is G S^T "
        "k, the written key's path, already inside beta G (v - S^T k))",
        _mistake(dk_form="read_transposed"),
    ),
    Mistake(
        "dk_without_beta",
        "dk misses the factor beta: both of k's paths lie inside the "
        "correction beta k (v - S^T k)^T",
        "keep the factor beta that multiplies the whole correction in dk",
        _mistake(dk_form="no_beta"),
    ),
    Mistake(
        "beta_without_read",
        "d beta = k^T G v: beta multiplies the whole correction v - S^T "
        "k, not v alone",
        "beta multiplies the whole correction, the read included: "
        "differentiate <G, beta k (v - S^T k)^T> in beta",
        _mistake(read_in_beta=False),
    ),
    Mistake(
        "beta_sign",
        "d beta has the wrong sign: S' = S + beta k (v - S^T k)^T, so "
        "d beta = +k^T G (v - S^T k)",
        "the correction is added to S: its derivative in beta is k (v - S^T "
        "k)^T with a plus",
        _mistake(dbeta_sign=-1.0),
    ),
    Mistake(
        "normalised_key",
        "the key was normalised before the step: S' = S + beta k (v - S^T "
        "k)^T uses k as given, of any length (the models normalise k before "
        "the step, but that is not part of it)",
        "differentiate the step with the k you were given",
        lambda S, k, v, beta, G: _grads(S, k / k.norm(), v, beta, G),
    ),
    Mistake(
        "dv_without_beta",
        "dv = G^T k: v enters the step multiplied by beta",
        "keep the factor beta that multiplies v in the step",
        _mistake(beta_in_dv=False),
    ),
    _float32_mistake(_reference_backward),
    Mistake(
        "wrong_shapes",
        "the values are right, but a gradient has the wrong shape: each "
        "gradient has the shape of what it is the gradient of",
        "return dS of shape (d_k, d_v) like S, dk (d_k,) like k, dv (d_v,) "
        "like v, and dbeta a number (a 0-d tensor, or of shape (1,)); no "
        "[:, None], no keepdim",
        lambda *args: _WrongShapes(_reference_backward(*args)),
    ),
]


def backward_cases() -> list[Case]:
    g = torch.Generator().manual_seed(1)

    def step(d_k, d_v, beta, length=1.0):
        S = torch.randn(d_k, d_v, generator=g, dtype=torch.float64)
        k = length * F.normalize(
            torch.randn(d_k, generator=g, dtype=torch.float64), dim=0
        )
        v = torch.randn(d_v, generator=g, dtype=torch.float64)
        G = torch.randn(d_k, d_v, generator=g, dtype=torch.float64)
        return S, k, v, torch.tensor(beta, dtype=torch.float64), G

    return [
        Case("d_k = 4, d_v = 3, beta = 0.7", step(4, 3, 0.7)),
        Case("d_k = 5, d_v = 5, beta = 0.3", step(5, 5, 0.3)),
        Case("d_k = 3, d_v = 6, beta = 1", step(3, 6, 1.0)),
        Case("d_k = 6, d_v = 2, beta = 0.9", step(6, 2, 0.9)),
        # the derivation holds for a key of any length
        Case(
            "d_k = 4, d_v = 4, beta = 0.5, a key of length 1.7",
            step(4, 4, 0.5, length=1.7),
        ),
    ]


def check_delta_step_backward(fn) -> None:
    """Check ``fn(S, k, v, beta, G)`` returns ``(dS, dk, dv, dbeta)``, the
    gradients of ``<G, S'>`` for one delta-rule step ``S' = S + beta k (v -
    S^T k)^T``; S, G: (d_k, d_v), k: (d_k,) of any length (the last case's
    is not a unit vector), v: (d_v,), beta: a 0-d tensor; float64 torch
    tensors. Each gradient must have the shape of its input (dbeta: a
    number, a 0-d array or shape (1,)); a wrong shape is named before any
    value is compared."""
    run_checks(
        "the backward pass of one delta-rule step",
        fn,
        backward_cases(),
        _reference_backward,
        BACKWARD_MISTAKES,
        compare=_compare_backward,
        postprocess=_parts,
        describe=_describe_backward,
        hint="write S' = S - beta k k^T S + beta k v^T and differentiate "
        "<G, S'> term by term; check with torch.autograd",
    )
