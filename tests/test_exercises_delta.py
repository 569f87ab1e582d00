"""The delta-rule checkers reject each classic mistake and pass correct
solutions.

The wrong solutions are written here independently of the checkers' Mistake
functions, the way a reader might write them: loops, numpy, autograd, torch's
solvers; some return numpy arrays, some torch tensors.
"""

import re

import numpy as np
import pytest
import torch

from attnbook.exercises import ExerciseError
from attnbook.exercises.delta import (
    BACKWARD_MISTAKES,
    check_delta_step_backward,
    check_exact_memory,
)

# --- a state that recalls every pair exactly ---------------------------------


def memory_pinv(keys, values):
    """Correct: the pseudo-inverse."""
    return torch.linalg.pinv(keys) @ values


def memory_gram_numpy(keys, values):
    """Correct, in numpy: S = K^T (K K^T)^-1 V, the least-norm solution in
    the span of the keys."""
    K, V = keys.numpy(), values.numpy()
    return K.T @ np.linalg.solve(K @ K.T, V)


def memory_lstsq(keys, values):
    """Correct: LAPACK's least-norm least squares (gelsd)."""
    return torch.linalg.lstsq(keys, values, driver="gelsd").solution


def memory_outer_products_numpy(keys, values):
    """Wrong (additive), in numpy, by a loop of outer products."""
    K, V = keys.numpy(), values.numpy()
    S = np.zeros((K.shape[1], V.shape[1]))
    for k, v in zip(K, V):
        S += np.outer(k, v)
    return S


def memory_delta_once(keys, values):
    """Wrong: one pass of the delta rule (unit keys, beta = 1)."""
    S = torch.zeros(keys.shape[1], values.shape[1], dtype=keys.dtype)
    for k, v in zip(keys, values):
        k = k / k.norm()
        S += torch.outer(k, v - S.T @ k)
    return S


def memory_kaczmarz_once(keys, values):
    """Wrong: one pass of the delta rule on the raw keys, beta = 1/|k|^2."""
    S = torch.zeros(keys.shape[1], values.shape[1], dtype=keys.dtype)
    for k, v in zip(keys, values):
        S += torch.outer(k, v - S.T @ k) / k.dot(k)
    return S


def memory_pinv_float32(keys, values):
    """Wrong only by its dtype: the pseudo-inverse computed in float32."""
    return torch.linalg.pinv(keys.float()) @ values.float()


def memory_pinv_float32_numpy_cast_back(keys, values):
    """The same in numpy float32, cast back to float64 before returning."""
    K, V = keys.numpy().astype(np.float32), values.numpy().astype(np.float32)
    return (np.linalg.pinv(K) @ V).astype(np.float64)


def memory_pinv_returned_float32(keys, values):
    """Wrong only by its dtype: computed in float64, returned as float32."""
    return (torch.linalg.pinv(keys) @ values).float()


def memory_cholesky_numpy(keys, values):
    """Correct, in numpy: a Cholesky solve of K K^T, then S = K^T X."""
    K, V = keys.numpy(), values.numpy()
    L = np.linalg.cholesky(K @ K.T)
    X = np.linalg.solve(L.T, np.linalg.solve(L, V))
    return K.T @ X


def memory_unit_keys(keys, values):
    """Wrong: normalises the keys, as the delta rule wants them."""
    unit = keys / keys.norm(dim=1, keepdim=True)
    return torch.linalg.lstsq(unit, values, driver="gelsd").solution


def memory_transposed_numpy(keys, values):
    """Wrong: V^T pinv(K)^T, the state as (d_v, d_k)."""
    return values.numpy().T @ np.linalg.pinv(keys.numpy()).T


def memory_square(keys, values):
    """Wrong: solves K S = V as if K were square."""
    return torch.linalg.solve(keys, values)


def memory_batched(keys, values):
    """Wrong only by its shape: the right state with a leading batch axis,
    (1, d_k, d_v)."""
    return (keys.T @ torch.linalg.solve(keys @ keys.T, values))[None]


def memory_kaczmarz_passes(keys, values):
    """Wrong: 200 passes of the delta rule on the raw keys, beta = 1/|k|^2
    (Kaczmarz's method), stopped before it converges: exact to 6 digits on
    most cases, not where there are as many pairs as key channels."""
    S = torch.zeros(keys.shape[1], values.shape[1], dtype=keys.dtype)
    for _ in range(200):
        for k, v in zip(keys, values):
            S += torch.outer(k, v - S.T @ k) / k.dot(k)
    return S


def memory_kaczmarz_few_passes(keys, values):
    """Wrong: 20 passes of the delta rule on the raw keys, beta = 1/|k|^2
    (Kaczmarz's method), far from converged where there are as many pairs
    as key channels (entries off by about 0.1)."""
    S = torch.zeros(keys.shape[1], values.shape[1], dtype=keys.dtype)
    for _ in range(20):
        for i in range(keys.shape[0]):
            k = keys[i]
            S = S + torch.outer(k, values[i] - S.T @ k) / (k @ k)
    return S


def memory_qr(keys, values):
    """Correct: K^T = Q R, so S = Q R^-T V, by a triangular solve."""
    Q, R = torch.linalg.qr(keys.T)
    return Q @ torch.linalg.solve_triangular(R.T, values, upper=False)


def memory_normal_equations(keys, values):
    """Wrong: the normal equations K^T K S = K^T V of least squares, singular
    with fewer pairs than key channels: the solve returns some state that
    recalls every pair (or fails), not the least-norm one."""
    return torch.linalg.solve(keys.T @ keys, keys.T @ values)


def memory_plus_null_space_numpy(keys, values):
    """Wrong: an exact state plus a part that every key maps to zero (the
    projection onto the keys' null space of a fixed matrix)."""
    K, V = keys.numpy(), values.numpy()
    exact = np.linalg.pinv(K) @ V
    rng = np.random.default_rng(0)
    extra = rng.standard_normal(exact.shape)
    null = np.eye(K.shape[1]) - np.linalg.pinv(K) @ K
    return exact + null @ extra


# --- the backward pass of one delta step -------------------------------------


def backward_autograd(S, k, v, beta, G):
    """Correct: autograd through the step."""
    leaves = [x.clone().requires_grad_(True) for x in (S, k, v, beta)]
    S_, k_, v_, b_ = leaves
    new = S_ + b_ * torch.outer(k_, v_ - S_.T @ k_)
    return torch.autograd.grad((G * new).sum(), leaves)


def backward_by_hand_numpy(S, k, v, beta, G):
    """Correct, in numpy, from S' = (I - b k k^T) S + b k v^T."""
    S, k, v, G = (x.numpy() for x in (S, k, v, G))
    b = float(beta)
    P = np.eye(len(k)) - b * np.outer(k, k)
    dS = P.T @ G
    dv = b * G.T @ k
    dk = b * (G @ v - G @ S.T @ k - S @ G.T @ k)
    dbeta = k @ G @ v - k @ G @ S.T @ k
    return dS, dk, dv, np.float64(dbeta)


def backward_einsum_beta_as_vector(S, k, v, beta, G):
    """Correct, by einsum, with dbeta of shape (1,) (a number, as the
    exercise allows)."""
    beta = beta.reshape(1)
    Gk = torch.einsum("ij,i->j", G, k)
    error = v - torch.einsum("ij,i->j", S, k)
    dS = G - beta * torch.einsum("i,j->ij", k, Gk)
    dk = beta * (
        torch.einsum("ij,j->i", G, error) - torch.einsum("ij,j->i", S, Gk)
    )
    dbeta = torch.einsum("i,ij,j->", k, G, error).reshape(1)
    return dS, dk, beta * Gk, dbeta


def backward_wrong_shapes(S, k, v, beta, G):
    """Wrong only by its shapes: the right values, but dS reshaped to (d_v,
    d_k), dk as a (1, d_k) row, dv as a (d_v, 1) column, dbeta as (1, 1)
    (keepdim everywhere). Flattened, every entry is right."""
    dS, dk, dv, db = backward_autograd(S, k, v, beta, G)
    return (
        dS.reshape(S.shape[1], S.shape[0]),
        dk[None, :],
        dv[:, None],
        db.reshape(1, 1),
    )


def backward_dk_as_row(S, k, v, beta, G):
    """Wrong only by dk's shape: k[None] @ ... gives a (1, d_k) row."""
    dS, dk, dv, db = backward_autograd(S, k, v, beta, G)
    return dS, dk.reshape(1, -1), dv, db


def backward_float32_numpy(S, k, v, beta, G):
    """Wrong only by its dtype: the right formulas in numpy float32."""
    S, k, v, G = (x.numpy().astype(np.float32) for x in (S, k, v, G))
    b = np.float32(beta)
    err = v - S.T @ k
    dS = G - b * np.outer(k, G.T @ k)
    dk = b * (G @ err - S @ (G.T @ k))
    return dS, dk, b * (G.T @ k), k @ G @ err


def backward_returned_float32(S, k, v, beta, G):
    """Wrong only by its dtype: float64 gradients cast to float32."""
    return tuple(x.float() for x in backward_autograd(S, k, v, beta, G))


def backward_dS_float32(S, k, v, beta, G):
    """Wrong only by one dtype: dS computed in float32 (G.float()), the
    other gradients in float64."""
    dS, dk, dv, db = backward_autograd(S, k, v, beta, G)
    Gf, kf = G.float(), k.float()
    dS = Gf - beta.float() * torch.outer(kf, Gf.T @ kf)
    return dS, dk, dv, db


def backward_returned_float32_numpy(S, k, v, beta, G):
    """The same as numpy float32 arrays."""
    grads = backward_autograd(S, k, v, beta, G)
    return tuple(x.numpy().astype(np.float32) for x in grads)


def backward_normalises_key(S, k, v, beta, G):
    """Wrong for a key not of unit length: normalises k first, as the
    models do before the step (autograd through the normalised step)."""
    return backward_autograd(S, k / k.norm(), v, beta, G)


def backward_no_projection(S, k, v, beta, G):
    dS, dk, dv, db = backward_autograd(S, k, v, beta, G)
    return G.clone(), dk, dv, db


def backward_k_as_written_key(S, k, v, beta, G):
    """dk from the written key alone, error held fixed (numpy)."""
    S, k, v, G = (x.numpy() for x in (S, k, v, G))
    b = float(beta)
    err = v - S.T @ k
    dS = G - b * np.outer(k, G.T @ k)
    return dS, b * G @ err, b * G.T @ k, k @ G @ err


def backward_k_constant(S, k, v, beta, G):
    dS, _, dv, db = backward_autograd(S, k, v, beta, G)
    return dS, beta * G @ v, dv, db


def backward_read_plus(S, k, v, beta, G):
    dS, _, dv, db = backward_autograd(S, k, v, beta, G)
    dk = beta * (G @ (v - S.T @ k) + S @ G.T @ k)
    return dS, dk, dv, db


def backward_beta_on_v(S, k, v, beta, G):
    dS, dk, dv, _ = backward_autograd(S, k, v, beta, G)
    return dS, dk, dv, k @ G @ v


def backward_dv_no_beta(S, k, v, beta, G):
    dS, dk, _, db = backward_autograd(S, k, v, beta, G)
    return dS, dk, G.T @ k, db


def backward_dS_plus_numpy(S, k, v, beta, G):
    """Wrong: dS with a plus, from S' = (I + b k k^T) S + ... (numpy)."""
    S, k, v, G = (x.numpy() for x in (S, k, v, G))
    b = float(beta)
    e = v - S.T @ k
    dS = G + b * np.outer(k, G.T @ k)
    return dS, b * (G @ e - S @ G.T @ k), b * G.T @ k, k @ G @ e


def backward_read_as_G_St_k(S, k, v, beta, G):
    """Wrong: the read's term in dk as G S^T k (shapes fit: (d_k, d_v) times
    (d_v,))."""
    dS, _, dv, db = backward_autograd(S, k, v, beta, G)
    dk = beta * (G @ (v - S.T @ k)) - beta * (G @ (S.T @ k))
    return dS, dk, dv, db


def backward_dk_read_only(S, k, v, beta, G):
    """Wrong: dk from the read alone, -beta S G^T k (numpy): the written
    key's path left out."""
    S, k, v, G = (x.numpy() for x in (S, k, v, G))
    b = float(beta)
    e = v - S.T @ k
    dS = G - b * np.outer(k, G.T @ k)
    return dS, -b * (S @ (G.T @ k)), b * (G.T @ k), k @ G @ e


def backward_dk_symmetrised(S, k, v, beta, G):
    """Wrong: dk = beta (G e - (S G^T + G S^T) k): the gradient of the
    quadratic form k^T S G^T k taken in full beside beta G e, which already
    holds its G S^T k."""
    dS, _, dv, db = backward_autograd(S, k, v, beta, G)
    e = v - S.T @ k
    M = S @ G.T
    dk = beta * (G @ e - (M + M.T) @ k)
    return dS, dk, dv, db


def backward_dk_forgets_beta(S, k, v, beta, G):
    """Wrong: dk without the factor beta."""
    dS, _, dv, db = backward_autograd(S, k, v, beta, G)
    err = v - S.T @ k
    return dS, G @ err - S @ (G.T @ k), dv, db


def backward_dbeta_negated(S, k, v, beta, G):
    """Wrong: d beta with a minus, as if the correction were subtracted."""
    dS, dk, dv, _ = backward_autograd(S, k, v, beta, G)
    return dS, dk, dv, -torch.einsum("i,ij,j->", k, G, v - S.T @ k)


CATALOGUE = {
    "check_exact_memory": {
        "right": [
            memory_pinv,
            memory_gram_numpy,
            memory_lstsq,
            memory_cholesky_numpy,
            memory_qr,
        ],
        "wrong": [
            (memory_outer_products_numpy, "additive"),
            (memory_delta_once, "one_delta_pass"),
            (memory_kaczmarz_once, "one_scaled_delta_pass"),
            (memory_pinv_float32, "float32"),
            (memory_pinv_float32_numpy_cast_back, "float32"),
            (memory_pinv_returned_float32, "float32"),
            (memory_unit_keys, "normalised_keys"),
            (memory_transposed_numpy, "transposed"),
            (memory_square, "square_solve"),
            (memory_batched, "wrong_shape"),
            (memory_kaczmarz_passes, "approximate"),
            (memory_kaczmarz_few_passes, "stopped_early"),
            (memory_normal_equations, "not_least_norm"),
            (memory_plus_null_space_numpy, "not_least_norm"),
        ],
    },
    "check_delta_step_backward": {
        "right": [
            backward_autograd,
            backward_by_hand_numpy,
            backward_einsum_beta_as_vector,
        ],
        "wrong": [
            (backward_no_projection, "no_state_path"),
            (backward_k_as_written_key, "read_not_in_dk"),
            (backward_dk_read_only, "written_key_not_in_dk"),
            (backward_dk_symmetrised, "written_key_twice"),
            (backward_k_constant, "dk_write_only"),
            (backward_read_plus, "read_sign"),
            (backward_beta_on_v, "beta_without_read"),
            (backward_dv_no_beta, "dv_without_beta"),
            (backward_dS_plus_numpy, "state_path_sign"),
            (backward_read_as_G_St_k, "read_transposed"),
            (backward_dk_forgets_beta, "dk_without_beta"),
            (backward_dbeta_negated, "beta_sign"),
            (backward_float32_numpy, "float32"),
            (backward_returned_float32, "float32"),
            (backward_returned_float32_numpy, "float32"),
            (backward_dS_float32, "float32"),
            (backward_normalises_key, "normalised_key"),
            (backward_wrong_shapes, "wrong_shapes"),
            (backward_dk_as_row, "wrong_shapes"),
        ],
    },
}
# The catalogue's solutions are run by tests/test_exercises_framework.py, which
# checks every right one accepted and every wrong one named, for every checker.


def test_the_same_wrong_answer_is_caught_as_numpy_and_as_torch():
    def additive_torch(keys, values):
        return keys.T @ values

    def additive_numpy(keys, values):
        return (keys.T @ values).numpy()

    for fn in (additive_torch, additive_numpy):
        with pytest.raises(ExerciseError) as err:
            check_exact_memory(fn)
        assert err.value.mistake == "additive"

    def no_projection_numpy(S, k, v, beta, G):
        return tuple(
            np.asarray(x) for x in backward_no_projection(S, k, v, beta, G)
        )

    for fn in (backward_no_projection, no_projection_numpy):
        with pytest.raises(ExerciseError) as err:
            check_delta_step_backward(fn)
        assert err.value.mistake == "no_state_path"


def test_a_wrong_number_of_gradients_is_an_error():
    with pytest.raises(ExerciseError):
        check_delta_step_backward(lambda S, k, v, beta, G: (G, k, v))


def test_a_wrong_shape_is_named_with_both_shapes():
    with pytest.raises(ExerciseError) as err:
        check_delta_step_backward(backward_wrong_shapes)
    text = str(err.value)
    # the first case: d_k = 4, d_v = 3
    assert "dS has shape (3, 4); the exercise asks for shape (4, 3)" in text
    assert "dk has shape (1, 4); the exercise asks for shape (4,)" in text
    assert "dv has shape (3, 1); the exercise asks for shape (3,)" in text
    assert "dbeta has shape (1, 1); the exercise asks for a number" in text


def test_a_float64_answer_near_the_right_one_is_not_called_float32():
    """The float32 diagnosis needs float32 numbers: a ridge solution in
    float64, as close to the answer as float32 rounding, is not named so."""

    def ridge(keys, values):
        gram = keys.T @ keys + 1e-7 * torch.eye(keys.shape[1]).double()
        return torch.linalg.solve(gram, keys.T @ values)

    with pytest.raises(ExerciseError) as err:
        check_exact_memory(ridge)
    assert err.value.mistake != "float32"


def test_a_singular_solve_is_named_as_the_normal_equations():
    """Where the singular solve fails rather than returning some exact
    state, the verdict still names the mistake."""

    def normal_equations_failing(keys, values):
        if keys.shape[0] < keys.shape[1]:
            raise torch.linalg.LinAlgError(
                "torch.linalg.solve: The solver failed because the input "
                "matrix is singular."
            )
        return torch.linalg.solve(keys.T @ keys, keys.T @ values)

    with pytest.raises(ExerciseError) as err:
        check_exact_memory(normal_equations_failing)
    assert err.value.mistake == "not_least_norm"


def test_one_gradient_returned_as_float32_is_rejected():
    """Each gradient must be a float64 answer: dbeta alone cast to float32
    is rejected, and the verdict names it."""

    def dbeta_float32(S, k, v, beta, G):
        dS, dk, dv, db = backward_autograd(S, k, v, beta, G)
        return dS, dk, dv, db.float()

    with pytest.raises(ExerciseError) as err:
        check_delta_step_backward(dbeta_float32)
    assert "dbeta holds float32 numbers" in str(err.value)


def test_the_read_transposed_hint_differentiates_in_the_reads_k():
    """The hint for the transposed read names a matrix M and a side of
    k^T M k; autograd in that k gives the read's true path S G^T k, not the
    slip G S^T k that the mistake diagnoses."""
    (mistake,) = [m for m in BACKWARD_MISTAKES if m.key == "read_transposed"]
    form = re.search(r"k\^T \((S G\^T|G S\^T)\) k", mistake.hint)
    side = re.search(r"the k on the (left|right)", mistake.hint)
    assert form and side, mistake.hint
    g = torch.Generator().manual_seed(0)
    S, G = (torch.randn(5, 3, generator=g, dtype=torch.float64) for _ in "SG")
    k = torch.randn(5, generator=g, dtype=torch.float64)
    M = S @ G.T if form.group(1) == "S G^T" else G @ S.T
    left, right = (k.clone().requires_grad_() for _ in "lr")
    (left @ M @ right).backward()
    followed = left.grad if side.group(1) == "left" else right.grad
    # the read's path alone: <G, k_written (S^T k_read)^T> in k_read
    written, read = k.clone(), k.clone().requires_grad_()
    (G * torch.outer(written, S.T @ read)).sum().backward()
    assert torch.allclose(followed, read.grad)
    assert not torch.allclose(followed, G @ (S.T @ k))
    assert "the read's path is S G^T k" in mistake.description
