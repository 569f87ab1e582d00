"""The linear-attention and Nadaraya-Watson checkers reject each classic
mistake and pass the reference.

The wrong implementations here are written independently of the checkers'
Mistake functions, the way a reader might write them (with explicit loops or
torch), and each must get its diagnosis.
"""

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnbook.exercises import ExerciseError, NotAttemptedError
from attnbook.exercises.perspectives import (
    check_linear_attention,
    check_nadaraya_watson,
)


# --- linear attention --------------------------------------------------------


def phi(x):
    return F.elu(torch.as_tensor(x)) + 1


def good_linear(q, k, v):
    fq, fk, v = phi(q), phi(k), torch.as_tensor(v)
    kv = torch.einsum("...jm,...jd->...md", fk, v)
    z = fk.sum(dim=-2)
    return (
        torch.einsum("...im,...md->...id", fq, kv)
        / torch.einsum("...im,...m->...i", fq, z)[..., None]
    )


def linear_without_denominator(q, k, v):
    fq, fk = phi(q), phi(k)
    return fq @ (fk.transpose(-1, -2) @ torch.as_tensor(v))


def linear_with_phi_of_v(q, k, v):
    fq, fk, fv = phi(q), phi(k), phi(v)
    return (fq @ (fk.transpose(-1, -2) @ fv)) / (
        fq * fk.sum(-2, keepdim=True)
    ).sum(-1, keepdim=True)


def linear_normalised_over_queries(q, k, v):
    w = phi(q) @ phi(k).transpose(-1, -2)
    return (w / w.sum(dim=-2, keepdim=True)) @ torch.as_tensor(v)


def linear_summing_queries(q, k, v):
    fq, fk = phi(q), phi(k)
    return (fq @ (fk.transpose(-1, -2) @ torch.as_tensor(v))) / (
        fq @ fq.sum(-2).unsqueeze(-1)
    )


def linear_with_elu_only(q, k, v):
    fq, fk = F.elu(torch.as_tensor(q)), F.elu(torch.as_tensor(k))
    return (fq @ (fk.transpose(-1, -2) @ torch.as_tensor(v))) / (
        fq @ fk.sum(-2).unsqueeze(-1)
    )


def linear_without_feature_map(q, k, v):
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    kt = np.swapaxes(k, -1, -2)
    return (q @ (kt @ v)) / (q @ k.sum(axis=-2)[..., None])


def plain_softmax_attention(q, k, v):
    return F.scaled_dot_product_attention(
        *(torch.as_tensor(x) for x in (q, k, v))
    )


def test_linear_reference_passes(capsys):
    check_linear_attention(good_linear)
    assert "Correct" in capsys.readouterr().out


def test_the_quadratic_form_is_rejected_by_its_memory(capsys):
    # right values, an n x n matrix of weights
    def quadratic_torch(q, k, v):
        w = phi(q) @ phi(k).transpose(-1, -2)
        return (w / w.sum(-1, keepdim=True)) @ torch.as_tensor(v), w

    def quadratic_numpy(q, k, v):
        # elu(x) + 1
        def f(x):
            return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0)))

        w = f(np.asarray(q)) @ np.swapaxes(f(np.asarray(k)), -1, -2)
        return (w / w.sum(-1, keepdims=True)) @ np.asarray(v)

    for quadratic in (quadratic_torch, quadratic_numpy):
        with pytest.raises(
            ExerciseError, match=r"n x n matrix.*quadratic form"
        ) as err:
            check_linear_attention(quadratic)
        assert "phi(K)^T V is d_k x d_v" in str(err.value)
        # no "Correct" line before the rejection
        assert "Correct" not in capsys.readouterr().out


def test_a_linear_answer_that_returns_a_pair_passes(capsys):
    check_linear_attention(lambda q, k, v: (good_linear(q, k, v), None))
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, key",
    [
        (linear_without_denominator, "no_normaliser"),
        (linear_with_phi_of_v, "feature_map_on_values"),
        (linear_normalised_over_queries, "wrong_axis"),
        (linear_summing_queries, "sum_over_queries"),
        (linear_with_elu_only, "elu_without_one"),
        (linear_without_feature_map, "no_feature_map"),
        (plain_softmax_attention, "softmax_attention"),
    ],
)
def test_linear_mistakes_are_diagnosed(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_linear_attention(wrong)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value) and "Hint" in str(err.value)


def test_unbatched_only_solution_is_rejected_with_its_exception():
    def unbatched(q, k, v):
        fq, fk = phi(q), phi(k)
        return (fq @ (fk.transpose(0, 1) @ torch.as_tensor(v))) / (
            fq @ fk.sum(0)
        )[:, None]

    with pytest.raises(
        ExerciseError,
        match="case 'a batch of 2 x 3 heads.*raised RuntimeError",
    ):
        check_linear_attention(unbatched)


def test_linear_unknown_error_and_stub():
    with pytest.raises(ExerciseError) as err:
        check_linear_attention(lambda q, k, v: 2 * good_linear(q, k, v))
    assert err.value.mistake is None

    def stub(q, k, v):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_linear_attention(stub)


# --- Nadaraya-Watson ---------------------------------------------------------


def good_nw(x_query, x_train, y_train, h):
    out = []
    for x in x_query:
        logs = [-((x - xi) ** 2) / (2 * h * h) for xi in x_train]
        top = max(logs)
        ws = [np.exp(s - top) for s in logs]
        out.append(sum(w * y for w, y in zip(ws, y_train)) / sum(ws))
    return np.array(out)


def nw_unnormalised(x_query, x_train, y_train, h):
    d = np.subtract.outer(x_query, x_train)
    return np.exp(-(d**2) / (2 * h * h)) @ y_train


def nw_h_not_squared(x_query, x_train, y_train, h):
    d = np.subtract.outer(x_query, x_train)
    s = -(d**2) / (2 * h)
    w = np.exp(s - s.max(axis=1, keepdims=True))
    return (w * y_train).sum(1) / w.sum(1)


def nw_without_half(x_query, x_train, y_train, h):
    d = torch.as_tensor(np.subtract.outer(x_query, x_train))
    return torch.softmax(-(d**2) / h**2, dim=1) @ torch.as_tensor(y_train)


def nw_over_queries(x_query, x_train, y_train, h):
    d = torch.as_tensor(np.subtract.outer(x_query, x_train))
    return torch.softmax(-(d**2) / (2 * h**2), dim=0) @ torch.as_tensor(
        y_train
    )


def nw_naive_exp(x_query, x_train, y_train, h):
    k = np.exp(-(np.subtract.outer(x_query, x_train) ** 2) / (2 * h**2))
    return k @ y_train / k.sum(axis=1)


def nw_global_max(x_query, x_train, y_train, h):
    logs = -((np.subtract.outer(x_query, x_train)) ** 2) / (2 * h * h)
    # one maximum for the whole matrix
    w = np.exp(logs - logs.max())
    return (w * y_train).sum(1) / w.sum(1)


def test_nw_reference_passes(capsys):
    check_nadaraya_watson(good_nw)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, key",
    [
        (nw_unnormalised, "not_normalised"),
        (nw_h_not_squared, "bandwidth_not_squared"),
        (nw_without_half, "no_half"),
        (nw_over_queries, "wrong_axis"),
        (nw_naive_exp, "underflow"),
        (nw_global_max, "global_shift"),
    ],
)
def test_nw_mistakes_are_diagnosed(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_nadaraya_watson(wrong)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value) and "Hint" in str(err.value)


def test_nw_unknown_error_is_rejected():
    with pytest.raises(ExerciseError) as err:
        check_nadaraya_watson(
            lambda xq, xt, yt, h: good_nw(xq, xt, yt, h) + 0.1
        )
    assert err.value.mistake is None


# --- the catalogue (run by tests/test_exercises_framework.py) ----------------


def linear_numpy_float32(q, k, v):
    """Right: numpy, float32 features, the normaliser as a sum over keys
    first."""

    def f(x):
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0))).astype(
            np.float32
        )

    fq, fk = f(np.asarray(q)), f(np.asarray(k))
    s = np.swapaxes(fk, -1, -2) @ np.asarray(v, np.float32)
    return (fq @ s) / (fq * fk.sum(-2, keepdims=True)).sum(-1, keepdims=True)


def linear_key_recurrence(q, k, v):
    """Right, and linear in n: the state S and z accumulated key by key (the
    recurrent form), in place."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)

    def f(x):
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0)))

    fk = f(k)
    s = np.zeros(k.shape[:-2] + (k.shape[-1], v.shape[-1]))
    z = np.zeros(k.shape[:-2] + (k.shape[-1],))
    for j in range(k.shape[-2]):
        s += fk[..., j, :, None] * v[..., j, None, :]
        z += fk[..., j, :]
    fq = f(q)
    return (fq @ s) / (fq @ z[..., None])


def linear_loop_over_queries(q, k, v):
    """Right values, never stores n x n, but visits every (query, key) pair:
    quadratic time."""

    def f(x):
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0)))

    fq, fk = f(np.asarray(q)), f(np.asarray(k))
    out = np.empty(fq.shape[:-1] + (np.shape(v)[-1],))
    for i in range(fq.shape[-2]):
        # (..., n_k, 1): one row of weights
        w = fk @ fq[..., i, :, None]
        out[..., i, :] = (np.swapaxes(w, -1, -2) @ v)[..., 0, :] / w.sum(-2)
    return out


def linear_three_operand_einsum(q, k, v):
    """Right values, never stores n x n, but numpy's einsum loops over every
    (i, j) pair."""

    def f(x):
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0)))

    fq, fk = f(np.asarray(q)), f(np.asarray(k))
    num = np.einsum("...id,...jd,...je->...ie", fq, fk, np.asarray(v))
    return num / np.einsum("...id,...jd->...i", fq, fk)[..., None]


def test_quadratic_time_without_quadratic_memory_is_rejected(capsys):
    for slow in (linear_loop_over_queries, linear_three_operand_einsum):
        with pytest.raises(
            ExerciseError, match=r"\(time\)': at \d+ times the length"
        ) as err:
            check_linear_attention(slow)
        assert "n x n of them, even if it never stores them all" in str(
            err.value
        )
        assert "Correct" not in capsys.readouterr().out


def nw_torch_float32(x_query, x_train, y_train, h):
    d = torch.as_tensor(
        np.subtract.outer(x_query, x_train), dtype=torch.float32
    )
    return torch.softmax(-(d**2) / (2 * h**2), dim=-1) @ torch.as_tensor(
        y_train, dtype=torch.float32
    )


def nw_logsumexp(x_query, x_train, y_train, h):
    s = -(np.subtract.outer(x_query, x_train) ** 2) / (2 * h * h)
    lse = s.max(1, keepdims=True) + np.log(
        np.exp(s - s.max(1, keepdims=True)).sum(1, keepdims=True)
    )
    return np.exp(s - lse) @ y_train


CATALOGUE = {
    "check_linear_attention": {
        "right": [good_linear, linear_numpy_float32, linear_key_recurrence],
        "wrong": [
            (linear_without_denominator, "no_normaliser"),
            (linear_with_phi_of_v, "feature_map_on_values"),
            (linear_normalised_over_queries, "wrong_axis"),
            (linear_summing_queries, "sum_over_queries"),
            (linear_with_elu_only, "elu_without_one"),
            (linear_without_feature_map, "no_feature_map"),
            (plain_softmax_attention, "softmax_attention"),
        ],
    },
    "check_nadaraya_watson": {
        "right": [good_nw, nw_logsumexp, nw_torch_float32],
        "wrong": [
            (nw_unnormalised, "not_normalised"),
            (nw_h_not_squared, "bandwidth_not_squared"),
            (nw_without_half, "no_half"),
            (nw_over_queries, "wrong_axis"),
            (nw_naive_exp, "underflow"),
            (nw_global_max, "global_shift"),
        ],
    },
}


# --- from the expert reading of chapter 13 (checker-findings) ----------------


def nw_float32_inputs(x_query, x_train, y_train, h):
    """Right, with the inputs themselves cast to float32 (so the differences
    are rounded too)."""
    xq, xt, yt = (
        np.asarray(a, np.float32) for a in (x_query, x_train, y_train)
    )
    s = -((xq[:, None] - xt[None, :]) ** 2) / np.float32(2 * h * h)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True) @ yt


def nw_torch_float32_inputs(x_query, x_train, y_train, h):
    xq, xt, yt = (
        torch.tensor(a, dtype=torch.float32)
        for a in (x_query, x_train, y_train)
    )
    return (
        torch.softmax(
            -((xq[:, None] - xt[None, :]) ** 2) / (2 * h * h), dim=-1
        )
        @ yt
    )


def nw_underflow_patched(x_query, x_train, y_train, h):
    k = np.exp(-(np.subtract.outer(x_query, x_train) ** 2) / (2 * h * h))
    with np.errstate(invalid="ignore"):
        # 0/0 patched to 0
        return np.nan_to_num(k / k.sum(axis=1, keepdims=True)) @ y_train


def linear_torch_float32(q, k, v):
    q, k, v = (torch.tensor(a, dtype=torch.float32) for a in (q, k, v))
    fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    return (fq @ (fk.transpose(-1, -2) @ v)) / (fq @ fk.sum(-2).unsqueeze(-1))


def linear_quadratic_in_row_blocks(q, k, v, block=256):
    """Right values, never holds n x n (blocks of 256 rows), but does the
    quadratic form's work."""

    def f(x):
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0)))

    fq, fk = f(np.asarray(q)), f(np.asarray(k))
    out = np.empty(fq.shape[:-1] + (np.shape(v)[-1],))
    for s in range(0, fq.shape[-2], block):
        w = fq[..., s : s + block, :] @ np.swapaxes(fk, -1, -2)
        out[..., s : s + block, :] = (w @ v) / w.sum(-1, keepdims=True)
    return out


CATALOGUE["check_nadaraya_watson"]["right"] += [
    nw_float32_inputs,
    nw_torch_float32_inputs,
]
CATALOGUE["check_nadaraya_watson"]["wrong"] += [
    (nw_underflow_patched, "underflow_patched")
]


# --- from the expert reading ch16d (session 9) -------------------------------


def nw_leave_one_out(x_query, x_train, y_train, h):
    """Drops the training points that sit on the query, as a student who has
    just met leave-one-out bandwidth selection might."""
    x_query, x_train = np.asarray(x_query), np.asarray(x_train)
    weights = np.exp(
        -((x_query[:, None] - x_train[None, :]) ** 2) / (2 * h**2)
    )
    weights[x_query[:, None] == x_train[None, :]] = 0.0
    return weights @ np.asarray(y_train) / weights.sum(axis=1)


CATALOGUE["check_nadaraya_watson"]["wrong"] += [
    (nw_leave_one_out, "leave_one_out")
]


def nw_nearest_below_threshold(x_query, x_train, y_train, h):
    """The nearest training point's y for a small bandwidth (h < 1e-3), the
    estimate otherwise: the h -> 0 limit taken too early (expert reading
    ps17g passed it while the near-tie case ran at exactly h = 0.001)."""
    x_query, x_train = np.asarray(x_query), np.asarray(x_train)
    diff = x_query[:, None] - x_train[None, :]
    if h < 1e-3:
        return np.asarray(y_train)[np.argmin(np.abs(diff), axis=1)]
    scores = -(diff**2) / (2 * h**2)
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    return weights @ np.asarray(y_train) / weights.sum(axis=1)


CATALOGUE["check_nadaraya_watson"]["wrong"] += [
    (nw_nearest_below_threshold, "nearest_fallback")
]
CATALOGUE["check_linear_attention"]["right"] += [linear_torch_float32]


def test_quadratic_work_in_row_blocks_is_rejected_by_the_time_check(capsys):
    with pytest.raises(
        ExerciseError, match=r"\(time\)': at \d+ times the length"
    ):
        check_linear_attention(linear_quadratic_in_row_blocks)
    assert "Correct" not in capsys.readouterr().out


def test_one_slow_measurement_does_not_reject_a_linear_answer(
    monkeypatch, capsys
):
    """A busy machine can slow one run: a growth over the limit is measured
    again, and the smallest counts."""
    from attnbook.exercises import perspectives

    # the first step: one slow try, then a fast one
    measured = iter([14.0, 3.5, 9.0])
    monkeypatch.setattr(
        perspectives, "work_growth", lambda *args: next(measured)
    )
    check_linear_attention(good_linear)
    assert "Correct" in capsys.readouterr().out


def test_growth_over_the_limit_in_every_try_is_rejected(monkeypatch):
    from attnbook.exercises import perspectives

    tries = []
    monkeypatch.setattr(
        perspectives, "work_growth", lambda *args: tries.append(1) or 70.0
    )
    with pytest.raises(ExerciseError, match="times the CPU time"):
        check_linear_attention(good_linear)
    assert len(tries) == perspectives.LINEAR_TIME_TRIES


# --- from the expert reading of chapter 13, session 3 ------------------------


def nw_nan_to_nearest(x_query, x_train, y_train, h):
    """Wrong: the unstable estimator, its NaN (every exponential underflowed)
    patched to the nearest y. Right in the limit h -> 0, wrong where two
    training points are almost equally near (the old checker accepted it: in
    its cases every underflowed row had one clearly nearest point)."""
    x_query, x_train, y_train = (
        np.asarray(a, float) for a in (x_query, x_train, y_train)
    )
    k = np.exp(-(np.subtract.outer(x_query, x_train) ** 2) / (2 * h * h))
    with np.errstate(invalid="ignore", divide="ignore"):
        est = k @ y_train / k.sum(axis=1)
    nearest = y_train[
        np.argmin(np.abs(np.subtract.outer(x_query, x_train)), axis=1)
    ]
    return np.where(np.isfinite(est), est, nearest)


def test_a_nan_patched_to_the_nearest_neighbour_is_diagnosed():
    with pytest.raises(ExerciseError, match="almost equally near") as err:
        check_nadaraya_watson(nw_nan_to_nearest)
    assert err.value.mistake == "nearest_fallback"
    assert "limit h -> 0" in str(err.value)


CATALOGUE["check_nadaraya_watson"]["wrong"] += [
    (nw_nan_to_nearest, "nearest_fallback")
]


def test_the_memory_check_of_a_torch_answer_leaves_stderr_to_the_reader(capfd):
    """torch's profiler, which measures a torch answer's allocations, logs
    'USDT: ... profiler_start' and 'profiler_stop' to the C-level stderr in
    some builds (this environment's); the checker silences its start and stop,
    not the reader's function, whose own messages still show."""
    import sys

    from attnbook.exercises.perspectives import largest_torch_allocation

    def noisy_linear(q, k, v):
        print("the reader's own message", file=sys.stderr)
        return good_linear(q, k, v)

    rng = np.random.default_rng(0)
    out, largest = largest_torch_allocation(
        noisy_linear, *(rng.normal(size=(64, 4)) for _ in range(3))
    )
    captured = capfd.readouterr()
    assert (
        "profiler_start" not in captured.err
        and "profiler_stop" not in captured.err
    )
    assert "the reader's own message" in captured.err
    assert largest > 0 and out.shape == (64, 4)


# --- from the second expert reading of chapter 13 (session 3) ----------------


def nw_row_shift_column_sum(x_query, x_train, y_train, h):
    """Shifted per query (the chapter's stable softmax), then normalised over
    the queries (axis 0)."""
    s = -(np.subtract.outer(x_query, x_train) ** 2) / (2 * h * h)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=0, keepdims=True)) @ y_train


def nw_epsilon_denominator(x_query, x_train, y_train, h):
    k = np.exp(-(np.subtract.outer(x_query, x_train) ** 2) / (2 * h * h))
    # 0/0 avoided by an epsilon: 0 where all underflow
    return (k @ y_train) / (k.sum(axis=1) + 1e-12)


def test_row_shift_then_normalised_over_queries_is_named():
    """Fails on the old checker, whose only wrong-axis mistake also shifted
    over the queries (generic hint)."""
    with pytest.raises(ExerciseError) as err:
        check_nadaraya_watson(nw_row_shift_column_sum)
    assert err.value.mistake == "wrong_axis_row_shift"
    assert "normalised over the query points" in str(err.value)


def test_epsilon_in_the_denominator_is_named_as_patched():
    with pytest.raises(ExerciseError) as err:
        check_nadaraya_watson(nw_epsilon_denominator)
    assert err.value.mistake == "underflow_patched"
    assert "epsilon" in str(err.value)


CATALOGUE["check_nadaraya_watson"]["wrong"] += [
    (nw_row_shift_column_sum, "wrong_axis_row_shift"),
    (nw_epsilon_denominator, "underflow_patched"),
]


# --- session 5: in-place answers, and the chunked causal exercise -----------


def linear_elu_in_place(q, k, v):
    """Right: elu + 1 applied to q and k in place (the old checker judged its
    long case on the changed inputs, and rejected it)."""
    for x in (q, k):
        neg = x < 0
        np.exp(x, out=x, where=neg)
        np.add(x, 1.0, out=x, where=~neg)
    s = np.swapaxes(k, -1, -2) @ v
    return (q @ s) / (q @ k.sum(axis=-2)[..., None])


def linear_v_scaled_in_place(q, k, v):
    """Right: v scaled in place, the scale undone on the output."""
    v *= 3.0
    return good_linear(q, k, v).numpy() / 3.0


def test_an_answer_that_changes_its_inputs_in_place_is_accepted(capsys):
    # fails on the old checker: "values differ from the reference on a long
    # sequence", after the Note that it was judged on its output
    for right in (linear_elu_in_place, linear_v_scaled_in_place):
        check_linear_attention(right)
        assert "Correct" in capsys.readouterr().out


CATALOGUE["check_linear_attention"]["right"] += [
    linear_elu_in_place,
    linear_v_scaled_in_place,
]


from attnbook.exercises import (  # noqa: E402
    check_chunked_causal_linear_attention,
)


def chunked_loop(phi_q, phi_k, v, chunk_size):
    """Right (the book's way): a running state, C x C masked weights."""
    n = phi_q.shape[-2]
    out = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    z = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1],))
    for a in range(0, n, chunk_size):
        fq, fk, vc = (x[..., a : a + chunk_size, :] for x in (phi_q, phi_k, v))
        w = np.tril(fq @ np.swapaxes(fk, -1, -2))
        num = w @ vc + fq @ s
        den = w.sum(-1) + (fq @ z[..., None])[..., 0]
        out[..., a : a + chunk_size, :] = num / den[..., None]
        s = s + np.swapaxes(fk, -1, -2) @ vc
        z = z + fk.sum(-2)
    return out


def chunked_recurrence(phi_q, phi_k, v, chunk_size):
    """Wrong: right values, position by position (chunk_size ignored; one
    chunk per position), in place."""
    out = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    z = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1],))
    for i in range(phi_q.shape[-2]):
        s += phi_k[..., i, :, None] * v[..., i, None, :]
        z += phi_k[..., i, :]
        fq = phi_q[..., i, :]
        out[..., i, :] = (
            np.einsum("...m,...md->...d", fq, s)
            / np.einsum("...m,...m->...", fq, z)[..., None]
        )
    return out


def chunked_torch_float32(phi_q, phi_k, v, chunk_size):
    """Wrong (float32_arithmetic): torch, float32 whatever the inputs, the
    normaliser as an extra column of ones in v."""
    fq, fk, vv = (
        torch.tensor(x, dtype=torch.float32) for x in (phi_q, phi_k, v)
    )
    vv = torch.cat([vv, torch.ones(vv.shape[:-1] + (1,))], dim=-1)
    n = fq.shape[-2]
    state = torch.zeros(fk.shape[:-2] + (fk.shape[-1], vv.shape[-1]))
    pieces = []
    for a in range(0, n, chunk_size):
        b = min(a + chunk_size, n)
        w = torch.tril(fq[..., a:b, :] @ fk[..., a:b, :].transpose(-1, -2))
        o = w @ vv[..., a:b, :] + fq[..., a:b, :] @ state
        pieces.append(o[..., :-1] / o[..., -1:])
        state = state + fk[..., a:b, :].transpose(-1, -2) @ vv[..., a:b, :]
    return torch.cat(pieces, dim=-2)


def chunked_epsilon(phi_q, phi_k, v, chunk_size):
    """Wrong (epsilon_in_denominator): the book's loop in float64, with
    Katharopoulos et al.'s eps = 1e-6 added to each denominator."""
    n = phi_q.shape[-2]
    out = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    z = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1],))
    for a in range(0, n, chunk_size):
        fq, fk, vc = (x[..., a : a + chunk_size, :] for x in (phi_q, phi_k, v))
        w = np.tril(fq @ np.swapaxes(fk, -1, -2))
        den = w.sum(-1) + (fq @ z[..., None])[..., 0] + 1e-6
        out[..., a : a + chunk_size, :] = (w @ vc + fq @ s) / den[..., None]
        s = s + np.swapaxes(fk, -1, -2) @ vc
        z = z + fk.sum(-2)
    return out


def chunked_prefix_sums_in_chunk(phi_q, phi_k, v, chunk_size):
    """Right: the inputs' dtype (float32 kept float32), prefix sums of the C
    outer products inside each chunk (C states at a time, never n)."""
    dt = np.result_type(phi_q, phi_k, v, np.float32)
    fq, fk, vv = (np.asarray(x, dt) for x in (phi_q, phi_k, v))
    out = np.empty(fq.shape[:-1] + vv.shape[-1:], dt)
    s = np.zeros(fk.shape[:-2] + (fk.shape[-1], vv.shape[-1]), dt)
    z = np.zeros(fk.shape[:-2] + (fk.shape[-1],), dt)
    for a in range(0, fq.shape[-2], chunk_size):
        b = min(a + chunk_size, fq.shape[-2])
        # (..., C, m, d_v) and (..., C, m)
        s_c = s[..., None, :, :] + np.cumsum(
            fk[..., a:b, :, None] * vv[..., a:b, None, :], axis=-3
        )
        z_c = z[..., None, :] + np.cumsum(fk[..., a:b, :], axis=-2)
        num = np.einsum("...cm,...cmd->...cd", fq[..., a:b, :], s_c)
        den = np.einsum("...cm,...cm->...c", fq[..., a:b, :], z_c)
        out[..., a:b, :] = num / den[..., None]
        s, z = s_c[..., -1, :, :], z_c[..., -1, :]
    return out


def chunked_augmented_in_place(phi_q, phi_k, v, chunk_size):
    """Right: the normaliser as a column of ones appended to v, one product
    for both; v scaled in place and scaled back."""
    v *= 2.0
    va = np.concatenate([v / 2.0, np.ones(v.shape[:-1] + (1,))], axis=-1)
    n = phi_q.shape[-2]
    out = np.empty(phi_q.shape[:-1] + va.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], va.shape[-1]))
    for a in range(0, n, chunk_size):
        fq, fk, vc = (
            x[..., a : a + chunk_size, :] for x in (phi_q, phi_k, va)
        )
        w = np.tril(fq @ np.swapaxes(fk, -1, -2))
        out[..., a : a + chunk_size, :] = w @ vc + fq @ s
        s = s + np.swapaxes(fk, -1, -2) @ vc
    return out[..., :-1] / out[..., -1:]


def chunked_numerator_masked_only(phi_q, phi_k, v, chunk_size):
    """Wrong: the mask applied to the numerator's weights, the normaliser
    from the unmasked chunk weights."""
    n = phi_q.shape[-2]
    out = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    z = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1],))
    for a in range(0, n, chunk_size):
        fq, fk, vc = (x[..., a : a + chunk_size, :] for x in (phi_q, phi_k, v))
        w = fq @ np.swapaxes(fk, -1, -2)
        num = np.tril(w) @ vc + fq @ s
        den = w.sum(-1) + (fq @ z[..., None])[..., 0]
        out[..., a : a + chunk_size, :] = num / den[..., None]
        s = s + np.swapaxes(fk, -1, -2) @ vc
        z = z + fk.sum(-2)
    return out


def chunked_state_before_read(phi_q, phi_k, v, chunk_size):
    """Wrong: the state updated with the chunk, then read by the chunk."""
    n = phi_q.shape[-2]
    out = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    z = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1],))
    for a in range(0, n, chunk_size):
        fq, fk, vc = (x[..., a : a + chunk_size, :] for x in (phi_q, phi_k, v))
        s = s + np.swapaxes(fk, -1, -2) @ vc
        z = z + fk.sum(-2)
        w = np.tril(fq @ np.swapaxes(fk, -1, -2))
        out[..., a : a + chunk_size, :] = (w @ vc + fq @ s) / (
            w.sum(-1) + (fq @ z[..., None])[..., 0]
        )[..., None]
    return out


def chunked_global_normaliser(phi_q, phi_k, v, chunk_size):
    """Wrong: the numerator causal, the denominator over all keys."""
    z_all = phi_k.sum(-2)
    num = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    for a in range(0, phi_q.shape[-2], chunk_size):
        fq, fk, vc = (x[..., a : a + chunk_size, :] for x in (phi_q, phi_k, v))
        w = np.tril(fq @ np.swapaxes(fk, -1, -2))
        num[..., a : a + chunk_size, :] = w @ vc + fq @ s
        s = s + np.swapaxes(fk, -1, -2) @ vc
    return num / (phi_q @ z_all[..., None])


def chunked_unmasked_chunk(phi_q, phi_k, v, chunk_size):
    """Wrong: the chunk's weights unmasked (a torch loop)."""
    fq, fk, vv = (
        torch.as_tensor(x, dtype=torch.float64) for x in (phi_q, phi_k, v)
    )
    s = torch.zeros(
        fk.shape[:-2] + (fk.shape[-1], vv.shape[-1]), dtype=fq.dtype
    )
    z = torch.zeros(fk.shape[:-2] + (fk.shape[-1],), dtype=fq.dtype)
    outs = []
    for c_q, c_k, c_v in zip(
        fq.split(chunk_size, -2),
        fk.split(chunk_size, -2),
        vv.split(chunk_size, -2),
    ):
        w = c_q @ c_k.transpose(-1, -2)
        outs.append(
            (w @ c_v + c_q @ s)
            / (w.sum(-1) + (c_q @ z.unsqueeze(-1))[..., 0]).unsqueeze(-1)
        )
        s = s + c_k.transpose(-1, -2) @ c_v
        z = z + c_k.sum(-2)
    return torch.cat(outs, -2)


def chunked_strict_mask(phi_q, phi_k, v, chunk_size):
    """Wrong: the diagonal masked out (j < i)."""
    n, c = phi_q.shape[-2], chunk_size
    mask = np.tri(c, k=-1)
    out = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    z = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1],))
    for a in range(0, n, c):
        b = min(a + c, n)
        fq, fk, vc = phi_q[..., a:b, :], phi_k[..., a:b, :], v[..., a:b, :]
        w = (fq @ np.swapaxes(fk, -1, -2)) * mask[: b - a, : b - a]
        out[..., a:b, :] = (w @ vc + fq @ s) / (
            w.sum(-1) + (fq @ z[..., None])[..., 0]
        )[..., None]
        s = s + np.swapaxes(fk, -1, -2) @ vc
        z = z + fk.sum(-2)
    return out


def chunked_local_only(phi_q, phi_k, v, chunk_size):
    """Wrong: each chunk attends causally within itself only."""
    outs = []
    for a in range(0, phi_q.shape[-2], chunk_size):
        fq, fk, vc = (x[..., a : a + chunk_size, :] for x in (phi_q, phi_k, v))
        w = np.tril(fq @ np.swapaxes(fk, -1, -2))
        outs.append(w @ vc / w.sum(-1, keepdims=True))
    return np.concatenate(outs, axis=-2)


def chunked_full_chunks_only(phi_q, phi_k, v, chunk_size):
    """Wrong: n // chunk_size chunks; a ragged tail is never computed."""
    n = phi_q.shape[-2]
    out = np.zeros(phi_q.shape[:-1] + v.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    z = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1],))
    for c in range(n // chunk_size):
        sl = slice(c * chunk_size, (c + 1) * chunk_size)
        fq, fk, vc = phi_q[..., sl, :], phi_k[..., sl, :], v[..., sl, :]
        w = np.tril(fq @ np.swapaxes(fk, -1, -2))
        out[..., sl, :] = (w @ vc + fq @ s) / (
            w.sum(-1) + (fq @ z[..., None])[..., 0]
        )[..., None]
        s = s + np.swapaxes(fk, -1, -2) @ vc
        z = z + fk.sum(-2)
    return out


def chunked_prefix_sums(phi_q, phi_k, v, chunk_size):
    """Right values, but every S_i stored: cumsum of (n, m, d_v) outer
    products."""
    s_all = np.cumsum(phi_k[..., :, :, None] * v[..., :, None, :], axis=-3)
    z_all = np.cumsum(phi_k, axis=-2)
    num = np.einsum("...im,...imd->...id", phi_q, s_all)
    return num / np.einsum("...im,...im->...i", phi_q, z_all)[..., None]


def chunked_masked_quadratic(phi_q, phi_k, v, chunk_size):
    """Right values, the n x n masked weights."""
    w = np.tril(phi_q @ np.swapaxes(phi_k, -1, -2))
    return (w @ v) / w.sum(-1, keepdims=True)


def chunked_accumulate(phi_q, phi_k, v, chunk_size):
    """Wrong: the recurrence over positions, written with
    itertools.accumulate and a list comprehension (no for statement),
    chunk_size ignored (expert reading ps17j)."""
    n = phi_q.shape[-2]
    states = itertools.accumulate(
        phi_k[..., i, :, None] * v[..., i, None, :] for i in range(n)
    )
    norms = itertools.accumulate(phi_k[..., i, :] for i in range(n))
    rows = [
        np.einsum("...m,...md->...d", phi_q[..., i, :], s)
        / np.einsum("...m,...m->...", phi_q[..., i, :], z)[..., None]
        for i, (s, z) in enumerate(zip(states, norms))
    ]
    return np.stack(rows, axis=-2)


CHUNKED_WRONG = [
    (chunked_state_before_read, "state_includes_chunk"),
    (chunked_global_normaliser, "normaliser_not_causal"),
    (chunked_unmasked_chunk, "intra_chunk_not_causal"),
    (chunked_strict_mask, "diagonal_excluded"),
    (chunked_local_only, "state_reset"),
    (chunked_full_chunks_only, "ragged_chunk_dropped"),
    (chunked_prefix_sums, "state_per_position"),
    (chunked_masked_quadratic, "quadratic_weights"),
    (chunked_numerator_masked_only, "normaliser_not_masked"),
    (chunked_recurrence, "chunk_size_ignored"),
    (chunked_epsilon, "epsilon_in_denominator"),
    (chunked_accumulate, "chunk_size_ignored"),
]


def chunked_loop_checking_inputs(phi_q, phi_k, v, chunk_size):
    """Right: the book's loop after an input check that runs a generator
    expression over every entry of phi_q (one Python step per element, no
    step of the algorithm)."""
    if any(x < 0 for x in np.ravel(phi_q)):
        raise ValueError("features must be non-negative")
    return chunked_loop(phi_q, phi_k, v, chunk_size)


CHUNKED_RIGHT = [
    chunked_loop_checking_inputs,
    chunked_loop,
    chunked_prefix_sums_in_chunk,
    chunked_augmented_in_place,
]

CATALOGUE["check_chunked_causal_linear_attention"] = {
    "right": CHUNKED_RIGHT,
    "wrong": CHUNKED_WRONG,
}


@pytest.mark.parametrize("wrong, key", CHUNKED_WRONG)
def test_chunked_mistakes_are_diagnosed(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_chunked_causal_linear_attention(wrong)
    assert err.value.mistake == key, str(err.value)
    assert "Diagnosis" in str(err.value) and "Hint" in str(err.value)


@pytest.mark.parametrize("right", CHUNKED_RIGHT)
def test_chunked_right_answers_pass(right, capsys):
    check_chunked_causal_linear_attention(right)
    assert "Correct" in capsys.readouterr().out


def test_chunked_stub_is_not_attempted():
    def stub(phi_q, phi_k, v, chunk_size):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_chunked_causal_linear_attention(stub)


def test_an_answer_that_ignores_the_chunk_size_says_by_how_much():
    with pytest.raises(ExerciseError) as err:
        check_chunked_causal_linear_attention(chunked_recurrence)
    assert "m = d_v = 16 and 32, chunk_size = 64 (lines of Python" in str(
        err.value
    )
    assert "the chunk size is ignored" in str(err.value)


def nw_scores_clipped(x_query, x_train, y_train, h):
    """Wrong: the scores clipped at -700 instead of shifted by their row
    maximum."""
    s = -((x_query[:, None] - x_train[None, :]) ** 2) / (2 * h**2)
    w = np.exp(np.clip(s, -700, None))
    return (w / w.sum(axis=1, keepdims=True)) @ y_train


def test_scores_clipped_instead_of_shifted_are_named():
    with pytest.raises(ExerciseError) as err:
        check_nadaraya_watson(nw_scores_clipped)
    assert err.value.mistake == "scores_clipped", str(err.value)


CATALOGUE["check_nadaraya_watson"]["wrong"] += [
    (nw_scores_clipped, "scores_clipped")
]


# --- from the expert reading of chapter 13 (reading s, session 6) -----------


def chunked_double_loop_no_state(phi_q, phi_k, v, chunk_size):
    """Wrong: right values, only C x C weights at a time, but no running
    state: each chunk of queries loops over every earlier chunk of keys,
    O(n^2) work (accepted by the old checker)."""
    n = phi_q.shape[-2]
    out = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        num, den = 0.0, 0.0
        for t in range(0, e, chunk_size):
            f = min(t + chunk_size, n)
            w = phi_q[..., s:e, :] @ np.swapaxes(phi_k[..., t:f, :], -1, -2)
            if t == s:
                w = np.tril(w)
            num = num + w @ v[..., t:f, :]
            den = den + w.sum(-1)
        out[..., s:e, :] = num / den[..., None]
    return out


def chunked_queries_against_all_keys(phi_q, phi_k, v, chunk_size):
    """Wrong: right values, no state: each chunk's queries form their C x e
    weights against every key up to the chunk's end, O(n^2) work (the old
    checker called its C x n block a state per position)."""
    n = phi_q.shape[-2]
    out = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        w = phi_q[..., s:e, :] @ np.swapaxes(phi_k[..., :e, :], -1, -2)
        w = np.tril(w, k=s)
        out[..., s:e, :] = (w @ v[..., :e, :]) / w.sum(-1)[..., None]
    return out


def chunked_queries_against_all_keys_float32(phi_q, phi_k, v, chunk_size):
    """Wrong: the same in the inputs' dtype (float32 kept float32), the mask
    applied in place."""
    dt = np.result_type(phi_q, phi_k, v, np.float32)
    fq, fk, vv = (np.asarray(x, dt) for x in (phi_q, phi_k, v))
    n = fq.shape[-2]
    out = np.empty(fq.shape[:-1] + vv.shape[-1:], dt)
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        w = fq[..., s:e, :] @ np.swapaxes(fk[..., :e, :], -1, -2)
        # zero the keys after each query, in place: key j > query s + r
        later = np.arange(e)[None, :] > s + np.arange(e - s)[:, None]
        w[..., later] = 0.0
        out[..., s:e, :] = (w @ vv[..., :e, :]) / w.sum(-1)[..., None]
    return out


def test_a_chunked_answer_without_a_running_state_is_named():
    """Fails on the old checker, which accepted the double loop and called
    the query-chunk answer a state per position."""
    for wrong in (
        chunked_double_loop_no_state,
        chunked_queries_against_all_keys,
        chunked_queries_against_all_keys_float32,
    ):
        with pytest.raises(ExerciseError) as err:
            check_chunked_causal_linear_attention(wrong)
        assert err.value.mistake == "no_running_state", str(err.value)
        assert "chunk_size = 64 (time)" in str(err.value)
        assert "re-reads all earlier keys" in str(err.value)


def test_the_memory_case_tells_a_chunk_block_from_n_states():
    """A chunk's queries against every key (a C x n block of weights, its
    masked copy and the output) pass the memory case, whose verdict is left
    to the time check; the n states of the prefix sums are still named. The
    old memory case (chunks of 64, a threshold of half the states) called the
    block a state per position."""
    from attnbook.exercises.perspectives import _check_chunked_memory

    _check_chunked_memory(chunked_queries_against_all_keys)
    _check_chunked_memory(chunked_queries_against_all_keys_float32)
    with pytest.raises(ExerciseError) as err:
        _check_chunked_memory(chunked_prefix_sums)
    assert err.value.mistake == "state_per_position"


def test_one_slow_length_measurement_does_not_reject_a_chunked_answer(
    monkeypatch, capsys
):
    from attnbook.exercises import perspectives

    # the length step at chunks of 64: one slow try, then a fast one; then
    # the step at chunks of 4, fast (the widths are compared by counting
    # lines, not timed)
    measured = iter([90.0, 14.0, 20.0])
    monkeypatch.setattr(
        perspectives, "work_growth", lambda *a, **k: next(measured)
    )
    check_chunked_causal_linear_attention(chunked_loop)
    assert "Correct" in capsys.readouterr().out


CHUNKED_WRONG += [
    (chunked_double_loop_no_state, "no_running_state"),
    (chunked_queries_against_all_keys, "no_running_state"),
    (chunked_queries_against_all_keys_float32, "no_running_state"),
]


# --- from the expert reading of chapter 13, session 6 ------------------------


def nw_nearest_below(threshold):
    """Wrong: the nearest training point's y whenever the bandwidth is below
    ``threshold``, the stable estimate otherwise: the limit h -> 0 taken as
    the estimate at small h. The old checker accepted it at a threshold of
    0.01 (its near-tie case was at h = 0.01 exactly, and every case below
    had one clearly nearest point)."""

    def nw(x_query, x_train, y_train, h):
        x_query, x_train, y_train = (
            np.asarray(a, float) for a in (x_query, x_train, y_train)
        )
        dist = np.abs(np.subtract.outer(x_query, x_train))
        if h < threshold:
            return y_train[dist.argmin(axis=1)]
        s = -(dist**2) / (2 * h * h)
        w = np.exp(s - s.max(axis=1, keepdims=True))
        return (w / w.sum(axis=1, keepdims=True)) @ y_train

    return nw


@pytest.mark.parametrize("threshold", [0.002, 0.01, 0.1])
def test_the_nearest_point_below_a_bandwidth_is_named(threshold, capsys):
    with pytest.raises(ExerciseError) as err:
        check_nadaraya_watson(nw_nearest_below(threshold))
    assert err.value.mistake == "nearest_fallback", str(err.value)
    assert "h = 0.0009" in str(err.value)
    assert "Correct" not in capsys.readouterr().out


def test_the_near_tie_case_underflows_and_is_far_from_the_nearest_y():
    """Both kernel values of the near-tie case underflow in float64, and its
    estimate is far (beyond the tolerance) from the nearest point's y."""
    from attnbook.exercises.perspectives import nadaraya_watson_cases

    (case,) = [c for c in nadaraya_watson_cases() if "equally near" in c.name]
    x_query, x_train, y_train, h = case.args
    assert h < 0.01
    scores = -(np.subtract.outer(x_query, x_train) ** 2) / (2 * h * h)
    assert np.all(np.exp(scores) == 0)
    estimate = good_nw(x_query, x_train, y_train, h)
    nearest = y_train[np.abs(np.subtract.outer(x_query, x_train)).argmin(1)]
    # 0.187 at h = 0.0009, against a tolerance of 2e-4
    assert np.all(np.abs(estimate - nearest) > 0.15)


def nw_float32_in_place_pair(x_query, x_train, y_train, h):
    """Right: float32, the scores computed in place, returning (estimate,
    weights)."""
    xq, xt, yt = (
        np.asarray(a, np.float32) for a in (x_query, x_train, y_train)
    )
    s = xq[:, None] - xt[None, :]
    s *= s
    s /= -2 * np.float32(h) ** 2
    s -= s.max(axis=1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=1, keepdims=True)
    return s @ yt, s


def nw_torch_transposed(x_query, x_train, y_train, h):
    """Right: torch, training points along dim 0, softmax over dim 0."""
    s = -(
        (torch.as_tensor(x_train)[:, None] - torch.as_tensor(x_query)[None, :])
        ** 2
    ) / (2 * h**2)
    return (torch.softmax(s, dim=0).T @ torch.as_tensor(y_train)).numpy()


def nw_logsumexp_float32_not_renormalised(x_query, x_train, y_train, h):
    # weights exp(s - logsumexp(s)) in float32, used as they are: at scores
    # of -942 they sum to about 1 - 3e-5 (an expert reading, session 12)
    xq, xt, y = (
        np.asarray(a, np.float32) for a in (x_query, x_train, y_train)
    )
    s = -(np.subtract.outer(xq, xt) ** 2) / np.float32(2 * h * h)
    m = s.max(1, keepdims=True)
    lse = m + np.log(np.exp(s - m).sum(1, keepdims=True))
    return np.exp(s - lse) @ y


CATALOGUE["check_nadaraya_watson"]["right"] += [
    nw_float32_in_place_pair,
    nw_torch_transposed,
    nw_logsumexp_float32_not_renormalised,
]
CATALOGUE["check_nadaraya_watson"]["wrong"] += [
    (nw_nearest_below(0.01), "nearest_fallback"),
]


# --- from the expert reading ch12-v (session 7) ------------------------------


def nw_column_max(x_query, x_train, y_train, h):
    """Wrong: the maximum subtracted is each training point's over the
    queries (axis 0), not each query's over the training points."""
    s = -(np.subtract.outer(x_query, x_train) ** 2) / (2 * h * h)
    w = np.exp(s - s.max(axis=0))
    return (w * y_train).sum(1) / w.sum(1)


def chunked_mask_one_above(phi_q, phi_k, v, chunk_size):
    """Wrong: the chunk's weights masked with np.tril(w, 1): each query sees
    the next key of its chunk too."""
    n = phi_q.shape[-2]
    out = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    z = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1],))
    for a in range(0, n, chunk_size):
        b = min(a + chunk_size, n)
        fq, fk, vc = phi_q[..., a:b, :], phi_k[..., a:b, :], v[..., a:b, :]
        w = np.tril(fq @ np.swapaxes(fk, -1, -2), 1)
        out[..., a:b, :] = (w @ vc + fq @ s) / (
            w.sum(-1) + (fq @ z[..., None])[..., 0]
        )[..., None]
        s = s + np.swapaxes(fk, -1, -2) @ vc
        z = z + fk.sum(-2)
    return out


@pytest.mark.parametrize(
    "check, wrong, key",
    [
        (check_nadaraya_watson, nw_column_max, "column_shift"),
        (
            check_chunked_causal_linear_attention,
            chunked_mask_one_above,
            "mask_one_above_diagonal",
        ),
    ],
)
def test_the_slips_the_reader_found_unnamed_are_named(check, wrong, key):
    with pytest.raises(ExerciseError) as err:
        check(wrong)
    assert err.value.mistake == key, str(err.value)
    assert "Diagnosis" in str(err.value) and "Hint" in str(err.value)


CATALOGUE["check_nadaraya_watson"]["wrong"] += [
    (nw_column_max, "column_shift"),
]
CHUNKED_WRONG += [(chunked_mask_one_above, "mask_one_above_diagonal")]


# --- torch inside, numpy out (issue 24, reader ch12-w, E1) -------------------
# The old memory checks profiled torch only when the answer returned a
# tensor: these answers, which allocate in torch and return .numpy(), passed
# the memory case and were rejected only later by a time check, with a false
# diagnosis ("even if it never stores them all", "although it stores only one
# chunk's weights", "the chunk size is ignored").


def linear_quadratic_torch_to_numpy(q, k, v):
    """Right values, the n x n weights phi(Q) phi(K)^T in torch, returned as
    numpy."""
    w = phi(q) @ phi(k).transpose(-1, -2)
    return (w @ torch.as_tensor(v) / w.sum(-1, keepdim=True)).numpy()


def chunked_masked_quadratic_torch_to_numpy(phi_q, phi_k, v, chunk_size):
    """Right values, the n x n masked weights in torch, returned as numpy."""
    fq, fk, vv = (torch.as_tensor(x) for x in (phi_q, phi_k, v))
    w = torch.tril(fq @ fk.transpose(-1, -2))
    return (w @ vv / w.sum(-1, keepdim=True)).numpy()


def chunked_prefix_sums_torch_to_numpy(phi_q, phi_k, v, chunk_size):
    """Right values, a state per position (cumsum of the n outer products) in
    torch, returned as numpy."""
    fq, fk, vv = (torch.as_tensor(x) for x in (phi_q, phi_k, v))
    s_all = torch.cumsum(fk[..., :, :, None] * vv[..., :, None, :], dim=-3)
    z_all = torch.cumsum(fk, dim=-2)
    num = torch.einsum("...im,...imd->...id", fq, s_all)
    den = torch.einsum("...im,...im->...i", fq, z_all)
    return (num / den[..., None]).numpy()


def test_the_torch_quadratic_form_returning_numpy_is_rejected_by_memory():
    with pytest.raises(
        ExerciseError, match=r"n x n matrix.*quadratic form"
    ) as err:
        check_linear_attention(linear_quadratic_torch_to_numpy)
    assert "(memory)" in err.value.case
    assert "never stores them all" not in str(err.value)


@pytest.mark.parametrize(
    "wrong, key",
    [
        (chunked_masked_quadratic_torch_to_numpy, "quadratic_weights"),
        (chunked_prefix_sums_torch_to_numpy, "state_per_position"),
    ],
)
def test_chunked_torch_answers_returning_numpy_are_named_by_memory(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_chunked_causal_linear_attention(wrong)
    assert err.value.mistake == key, str(err.value)
    assert "(memory)" in err.value.case


CHUNKED_WRONG += [
    (chunked_masked_quadratic_torch_to_numpy, "quadratic_weights"),
    (chunked_prefix_sums_torch_to_numpy, "state_per_position"),
]


# --- from the expert reading ch16a (session 9) -------------------------------
# The chunk-size check compared CPU times, t(chunk_size = 1) / t(64) >= 4:
# the reader's answer below, right and chunked, measured 3.6 and 3.9 and was
# rejected as "advances one position per step", which it does not (it
# advances the state once per chunk). The check now counts the lines of
# Python executed, which no load can change.


def chunked_cumsum_in_chunk_float64(phi_q, phi_k, v, chunk_size):
    """Right (the reader's): a running state between chunks, prefix sums of
    the chunk's outer products inside it (C states of m x d_v at a time),
    float64, the chunks' outputs concatenated."""
    n = phi_q.shape[-2]
    outs = []
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    z = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1],))
    for a in range(0, n, chunk_size):
        fq, fk, vc = (x[..., a : a + chunk_size, :] for x in (phi_q, phi_k, v))
        s_c = s[..., None, :, :] + np.cumsum(
            fk[..., :, :, None] * vc[..., :, None, :], axis=-3
        )
        z_c = z[..., None, :] + np.cumsum(fk, axis=-2)
        num = np.einsum("...cm,...cmd->...cd", fq, s_c)
        den = np.einsum("...cm,...cm->...c", fq, z_c)
        outs.append(num / den[..., None])
        s, z = s_c[..., -1, :, :], z_c[..., -1, :]
    return np.concatenate(outs, axis=-2)


def chunked_positions_inside_chunks(phi_q, phi_k, v, chunk_size):
    """Wrong: right values, a loop over chunks, but inside each chunk a loop
    over its positions: one position per step whatever the chunk size."""
    n = phi_q.shape[-2]
    out = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    z = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1],))
    for a in range(0, n, chunk_size):
        for i in range(a, min(a + chunk_size, n)):
            s = s + phi_k[..., i, :, None] * v[..., i, None, :]
            z = z + phi_k[..., i, :]
            out[..., i, :] = (phi_q[..., i, None, :] @ s)[..., 0, :] / (
                phi_q[..., i, :] * z
            ).sum(-1)[..., None]
    return out


def test_a_chunked_answer_with_prefix_sums_inside_a_chunk_is_accepted(capsys):
    """Fails on the old checker, which rejected it at a CPU-time ratio of
    3.6-3.9 against a limit of 4, saying it advanced one position per
    step."""
    check_chunked_causal_linear_attention(chunked_cumsum_in_chunk_float64)
    assert "Correct" in capsys.readouterr().out


def test_the_line_counts_are_the_same_on_every_run():
    """The chunk-size verdict rests on counts, not times: the same answer
    gives the same counts on every run, whatever the load."""
    from attnbook.exercises.perspectives import python_lines

    rng = np.random.default_rng(0)
    args = (np.abs(rng.normal(size=(256, 4))) + 0.1,) * 2
    args += (rng.normal(size=(256, 3)),)
    for fn in (
        chunked_loop,
        chunked_recurrence,
        chunked_cumsum_in_chunk_float64,
    ):
        counts = {python_lines(fn, *args, 64)[1] for _ in range(3)}
        assert len(counts) == 1, (fn.__name__, counts)
    # a loop over 4 chunks against one over 256 positions
    assert python_lines(chunked_loop, *args, 64)[1] < 64
    assert python_lines(chunked_recurrence, *args, 64)[1] >= 2 * 256
    # numpy's own Python code is not counted
    assert python_lines(np.tril, np.ones((4, 4)))[1] == 0


def test_one_position_per_step_inside_chunks_is_named():
    with pytest.raises(ExerciseError) as err:
        check_chunked_causal_linear_attention(chunked_positions_inside_chunks)
    assert err.value.mistake == "chunk_size_ignored", str(err.value)
    assert "at least one per position" in str(err.value)


CHUNKED_RIGHT += [chunked_cumsum_in_chunk_float64]
CHUNKED_WRONG += [(chunked_positions_inside_chunks, "chunk_size_ignored")]


# --- from the expert reading ch16b (session 9) -------------------------------
# The chunkwise-parallel form (all chunks at once, the states at every chunk
# boundary by an exclusive cumsum: n / C states, not n) was rejected as "a
# state per position" when it padded the inputs (peak 4.2 MiB against a limit
# of n states in float32, 4 MiB) and accepted without the padding (2.1 MiB).
# The values are now compared to float64's precision on float64 inputs, so an
# answer that reaches the memory check computes in float64, and the limit is
# n states in float64 (8 MiB): both forms pass, the prefix sums of every S_i
# (16 MiB) do not. A float32-only answer on float64 inputs passed the values
# before; it is now named float32_arithmetic.


def chunked_parallel_padded(phi_q, phi_k, v, chunk_size):
    """Right (the chunkwise-parallel form): pad to a multiple of C, every
    chunk at once, the states at all chunk boundaries by an exclusive
    cumsum (n / C states)."""
    n = phi_q.shape[-2]
    pad = (-n) % chunk_size

    def chunks(x):
        x = np.concatenate(
            [x, np.zeros(x.shape[:-2] + (pad, x.shape[-1]))], -2
        )
        return x.reshape(x.shape[:-2] + (-1, chunk_size, x.shape[-1]))

    fq, fk, vv = chunks(phi_q), chunks(phi_k), chunks(v)
    per_chunk = np.swapaxes(fk, -1, -2) @ vv
    s = np.cumsum(per_chunk, -3) - per_chunk
    z = np.cumsum(fk.sum(-2), -2) - fk.sum(-2)
    w = np.tril(fq @ np.swapaxes(fk, -1, -2))
    num = w @ vv + fq @ s
    den = w.sum(-1) + np.einsum("...cm,...m->...c", fq, z)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = num / den[..., None]
    return out.reshape(phi_q.shape[:-2] + (n + pad, v.shape[-1]))[..., :n, :]


def chunked_parallel_torch(phi_q, phi_k, v, chunk_size):
    """Right: the chunkwise-parallel form in torch, in the inputs' dtype, the
    last chunk padded with F.pad."""
    import torch.nn.functional as F

    fq, fk, vv = (torch.as_tensor(x) for x in (phi_q, phi_k, v))
    n, c = fq.shape[-2], chunk_size
    pad = (-n) % c
    fq, fk, vv = (
        F.pad(x, (0, 0, 0, pad)).unflatten(-2, (-1, c)) for x in (fq, fk, vv)
    )
    per_chunk = fk.transpose(-1, -2) @ vv
    s = per_chunk.cumsum(-3) - per_chunk
    z = (fk.sum(-2).cumsum(-2) - fk.sum(-2)).unsqueeze(-1)
    w = torch.tril(fq @ fk.transpose(-1, -2))
    out = (w @ vv + fq @ s) / (w.sum(-1, keepdim=True) + fq @ z)
    return out.flatten(-3, -2)[..., :n, :]


def chunked_torch_keeps_dtype(phi_q, phi_k, v, chunk_size):
    """Right: torch in the inputs' dtype, the normaliser as a column of
    ones."""
    fq, fk, vv = (torch.as_tensor(x) for x in (phi_q, phi_k, v))
    vv = torch.cat([vv, torch.ones_like(vv[..., :1])], dim=-1)
    state = fq.new_zeros(fk.shape[:-2] + (fk.shape[-1], vv.shape[-1]))
    pieces = []
    for c_q, c_k, c_v in zip(
        fq.split(chunk_size, -2),
        fk.split(chunk_size, -2),
        vv.split(chunk_size, -2),
    ):
        o = torch.tril(c_q @ c_k.transpose(-1, -2)) @ c_v + c_q @ state
        pieces.append(o[..., :-1] / o[..., -1:])
        state = state + c_k.transpose(-1, -2) @ c_v
    return torch.cat(pieces, dim=-2)


def chunked_float32_then_float64(phi_q, phi_k, v, chunk_size):
    """Wrong (float32_arithmetic): the book's loop on float32 copies, the
    output converted back to the inputs' dtype."""
    dt = np.result_type(phi_q, v)
    out = chunked_loop(*(np.float32(x) for x in (phi_q, phi_k, v)), chunk_size)
    return out.astype(dt)


def chunked_normaliser_state_first(phi_q, phi_k, v, chunk_size):
    """Wrong: z advanced by the chunk before the chunk reads it, S after."""
    n = phi_q.shape[-2]
    out = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    z = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1],))
    for a in range(0, n, chunk_size):
        fq, fk, vc = (x[..., a : a + chunk_size, :] for x in (phi_q, phi_k, v))
        z = z + fk.sum(-2)
        w = np.tril(fq @ np.swapaxes(fk, -1, -2))
        num = w @ vc + fq @ s
        den = w.sum(-1) + np.einsum("...cm,...m->...c", fq, z)
        out[..., a : a + chunk_size, :] = num / den[..., None]
        s = s + np.swapaxes(fk, -1, -2) @ vc
    return out


def test_the_chunkwise_parallel_form_is_accepted_padded_or_not(capsys):
    """Fails on the old checker, which called the padded form "a state per
    position" (peak 4.2 MiB against 4 MiB)."""
    from attnbook.exercises.perspectives import _check_chunked_memory

    _check_chunked_memory(chunked_parallel_padded)
    _check_chunked_memory(chunked_parallel_torch)
    check_chunked_causal_linear_attention(chunked_parallel_padded)
    assert "Correct" in capsys.readouterr().out


def test_a_state_per_position_is_named_by_its_measured_peak():
    from attnbook.exercises.perspectives import _check_chunked_memory

    with pytest.raises(ExerciseError) as err:
        _check_chunked_memory(chunked_prefix_sums)
    assert err.value.mistake == "state_per_position"
    assert "n states of d_k x d_v in float64" in str(err.value)
    assert "the states of all 256 chunks take 512.0 KiB" in str(err.value)


@pytest.mark.parametrize(
    "wrong", [chunked_torch_float32, chunked_float32_then_float64]
)
def test_float32_arithmetic_on_float64_inputs_is_named(wrong):
    """Fails on the old checker, which compared to 1e-4 whatever the
    inputs."""
    with pytest.raises(ExerciseError) as err:
        check_chunked_causal_linear_attention(wrong)
    assert err.value.mistake == "float32_arithmetic", str(err.value)


def test_the_normaliser_advanced_first_is_named():
    with pytest.raises(ExerciseError) as err:
        check_chunked_causal_linear_attention(chunked_normaliser_state_first)
    assert err.value.mistake == "normaliser_state_includes_chunk"


CHUNKED_RIGHT += [
    chunked_parallel_padded,
    chunked_parallel_torch,
    chunked_torch_keeps_dtype,
]
CHUNKED_WRONG += [
    (chunked_torch_float32, "float32_arithmetic"),
    (chunked_float32_then_float64, "float32_arithmetic"),
    (chunked_normaliser_state_first, "normaliser_state_includes_chunk"),
]


def chunked_state_first_no_chunk_term(phi_q, phi_k, v, chunk_size):
    """Wrong (student reading s12h): the whole chunk added to the state
    first, then read by the chunk, with no within-chunk term: the values of
    unmasked within-chunk weights, though no C x C weights were built."""
    n = phi_q.shape[-2]
    out = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    z = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1],))
    for a in range(0, n, chunk_size):
        fq, fk, vc = (x[..., a : a + chunk_size, :] for x in (phi_q, phi_k, v))
        s = s + np.swapaxes(fk, -1, -2) @ vc
        z = z + fk.sum(-2)
        out[..., a : a + chunk_size, :] = (fq @ s) / (fq @ z[..., None])
    return out


def test_the_state_read_after_the_whole_chunk_is_named_for_what_it_did():
    """Its values are those of unmasked weights; the verdict also names the
    state advanced before the read, which is what this code did."""
    with pytest.raises(ExerciseError) as err:
        check_chunked_causal_linear_attention(
            chunked_state_first_no_chunk_term
        )
    assert err.value.mistake == "intra_chunk_not_causal"
    assert "added to the state S, z before the chunk read it" in str(err.value)


CHUNKED_WRONG += [
    (chunked_state_first_no_chunk_term, "intra_chunk_not_causal"),
]


# --- the student reading s1516 of chapter 17 ---------------------------------


def nw_nan_to_mean(x_query, x_train, y_train, h):
    """0 / 0 patched to the mean of y_train (no clipping anywhere)."""
    k = np.exp(-((x_query[:, None] - x_train[None, :]) ** 2) / (2 * h**2))
    with np.errstate(invalid="ignore"):
        out = (k @ y_train) / k.sum(axis=1)
    return np.where(np.isfinite(out), out, np.mean(y_train))


def nw_laplace(x_query, x_train, y_train, h):
    s = -np.abs(np.subtract.outer(x_query, x_train)) / h
    w = np.exp(s - s.max(axis=1, keepdims=True))
    return (w / w.sum(axis=1, keepdims=True)) @ y_train


def test_a_nan_patched_to_the_mean_is_named_as_such():
    """The old diagnosis named only the clip, which this answer does not do."""
    with pytest.raises(ExerciseError) as err:
        check_nadaraya_watson(nw_nan_to_mean)
    assert err.value.mistake == "scores_clipped"
    assert "patched to the mean of y_train" in str(err.value)


def test_the_laplace_kernel_is_named():
    with pytest.raises(ExerciseError) as err:
        check_nadaraya_watson(nw_laplace)
    assert err.value.mistake == "laplace_kernel"


def _linear_with(feature):
    def attention(q, k, v):
        fq, fk = feature(torch.as_tensor(q)), feature(torch.as_tensor(k))
        num = torch.einsum(
            "...im,...jm,...jd->...id", fq, fk, torch.as_tensor(v)
        )
        den = torch.einsum("...im,...jm->...i", fq, fk)
        return num / den[..., None]

    return attention


linear_relu_plus_one = _linear_with(lambda x: torch.relu(x) + 1)
linear_exp_features = _linear_with(torch.exp)
linear_softplus_features = _linear_with(F.softplus)
linear_scaled_inputs = _linear_with(
    lambda x: F.elu(x / x.shape[-1] ** 0.25) + 1
)


@pytest.mark.parametrize(
    ("wrong", "key"),
    [
        (linear_relu_plus_one, "relu_plus_one"),
        (linear_exp_features, "exp_feature_map"),
        (linear_softplus_features, "softplus_feature_map"),
        (linear_scaled_inputs, "scaled_inputs"),
    ],
)
def test_other_feature_maps_are_named(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_linear_attention(wrong)
    assert err.value.mistake == key, str(err.value)


CATALOGUE["check_nadaraya_watson"]["wrong"] += [
    (nw_nan_to_mean, "scores_clipped"),
    (nw_laplace, "laplace_kernel"),
]
CATALOGUE["check_linear_attention"]["wrong"] += [
    (linear_relu_plus_one, "relu_plus_one"),
    (linear_exp_features, "exp_feature_map"),
    (linear_softplus_features, "softplus_feature_map"),
    (linear_scaled_inputs, "scaled_inputs"),
]


# --- the student reading stud17 of chapter 17 (session 10) -------------------
# Realistic slips that got only the generic hint: each now has its Mistake.


def linear_scaled_by_sqrt_d(q, k, v):
    """Wrong: softmax attention's 1/sqrt(d_k) carried over, applied to q and
    k before elu + 1."""
    scale = 1 / np.sqrt(np.shape(q)[-1])
    fq = np.where(q * scale > 0, q * scale + 1, np.exp(q * scale))
    fk = np.where(k * scale > 0, k * scale + 1, np.exp(k * scale))
    s = np.einsum("...jm,...jd->...md", fk, v)
    return (
        np.einsum("...im,...md->...id", fq, s)
        / np.einsum("...im,...m->...i", fq, fk.sum(-2))[..., None]
    )


def linear_features_of_key_sum(q, k, v):
    """Wrong: z = phi(sum_j k_j) instead of sum_j phi(k_j)."""
    fq, fk, v = phi(q), phi(k), torch.as_tensor(v)
    z = phi(torch.as_tensor(k).sum(-2))
    return (fq @ (fk.transpose(-1, -2) @ v)) / (fq @ z.unsqueeze(-1))


def chunked_state_overwritten(phi_q, phi_k, v, chunk_size):
    """Wrong: S = ... in place of S = S + ...: the state keeps only the
    previous chunk."""
    n = phi_q.shape[-2]
    out = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    z = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1],))
    for a in range(0, n, chunk_size):
        b = min(a + chunk_size, n)
        fq, fk, vc = phi_q[..., a:b, :], phi_k[..., a:b, :], v[..., a:b, :]
        w = np.tril(fq @ np.swapaxes(fk, -1, -2))
        num = w @ vc + fq @ s
        den = w.sum(-1) + (fq @ z[..., None])[..., 0]
        out[..., a:b, :] = num / den[..., None]
        s = np.swapaxes(fk, -1, -2) @ vc
        z = fk.sum(-2)
    return out


def chunked_triu(phi_q, phi_k, v, chunk_size):
    """Wrong: np.triu where np.tril was meant, in torch."""
    fq_all, fk_all, v_all = (torch.as_tensor(x) for x in (phi_q, phi_k, v))
    n = fq_all.shape[-2]
    s = fk_all.new_zeros(fk_all.shape[:-2] + (fk_all.shape[-1], v.shape[-1]))
    z = fk_all.new_zeros(fk_all.shape[:-2] + (fk_all.shape[-1],))
    outs = []
    for a in range(0, n, chunk_size):
        fq, fk, vc = (
            x[..., a : a + chunk_size, :] for x in (fq_all, fk_all, v_all)
        )
        w = torch.triu(fq @ fk.transpose(-1, -2))
        num = w @ vc + fq @ s
        den = w.sum(-1) + fq @ z
        outs.append(num / den.unsqueeze(-1))
        s = s + fk.transpose(-1, -2) @ vc
        z = z + fk.sum(-2)
    return torch.cat(outs, dim=-2).numpy()


@pytest.mark.parametrize(
    "check, wrong, key",
    [
        (
            check_linear_attention,
            linear_scaled_by_sqrt_d,
            "scaled_inputs_sqrt",
        ),
        (
            check_linear_attention,
            linear_features_of_key_sum,
            "normaliser_of_summed_keys",
        ),
        (
            check_chunked_causal_linear_attention,
            chunked_state_overwritten,
            "state_last_chunk_only",
        ),
        (
            check_chunked_causal_linear_attention,
            chunked_triu,
            "upper_triangle_mask",
        ),
    ],
)
def test_the_slips_of_stud17_are_named(check, wrong, key):
    with pytest.raises(ExerciseError) as err:
        check(wrong)
    assert err.value.mistake == key, str(err.value)
    assert "Diagnosis" in str(err.value) and "Hint" in str(err.value)


CATALOGUE["check_linear_attention"]["wrong"] += [
    (linear_scaled_by_sqrt_d, "scaled_inputs_sqrt"),
    (linear_features_of_key_sum, "normaliser_of_summed_keys"),
]
CHUNKED_WRONG += [
    (chunked_state_overwritten, "state_last_chunk_only"),
    (chunked_triu, "upper_triangle_mask"),
]


# --- from the expert reading ps17k of chapter 17 (session 10) ----------------
# Quadratic work that torch's overhead per call hid from the CPU-time ratio:
# a loop over the queries in torch, and chunks that rebuild S and z from every
# earlier key in torch, were accepted. The flops of torch's matrix products
# are now counted, a count the same on every run.


def linear_torch_loop_over_queries(q, k, v):
    """Wrong: right values, never stores n x n, but a torch loop over the
    queries visits every (query, key) pair: quadratic work, which the CPU
    time ratio missed (torch's per-einsum overhead is linear in n)."""
    q, k, v = (torch.as_tensor(np.asarray(a)) for a in (q, k, v))

    def f(x):
        return torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0)))

    pk, outs = f(k), []
    for i in range(q.shape[-2]):
        w = torch.einsum("...m,...nm->...n", f(q[..., i, :]), pk)
        outs.append(
            torch.einsum("...n,...nd->...d", w, v) / w.sum(-1, keepdim=True)
        )
    return torch.stack(outs, -2).numpy()


def chunked_torch_running_state(phi_q, phi_k, v, chunk_size):
    """Right: the running-state loop in torch, in the inputs' precision."""
    fq_all, fk_all, v_all = (torch.as_tensor(x) for x in (phi_q, phi_k, v))
    s = fk_all.new_zeros(fk_all.shape[:-2] + (fk_all.shape[-1], v.shape[-1]))
    z = fk_all.new_zeros(fk_all.shape[:-2] + (fk_all.shape[-1],))
    outs = []
    for a in range(0, fq_all.shape[-2], chunk_size):
        fq, fk, vc = (
            x[..., a : a + chunk_size, :] for x in (fq_all, fk_all, v_all)
        )
        w = torch.tril(fq @ fk.transpose(-1, -2))
        den = w.sum(-1) + (fq @ z[..., None])[..., 0]
        outs.append((w @ vc + fq @ s) / den[..., None])
        s = s + fk.transpose(-1, -2) @ vc
        z = z + fk.sum(-2)
    return torch.cat(outs, dim=-2).numpy()


def chunked_torch_reread(phi_q, phi_k, v, chunk_size):
    """Wrong: right values, one chunk's weights at a time, but no running
    state: each chunk rebuilds S and z from every earlier key, in torch,
    O(n^2) work that the CPU time ratio missed."""
    fq_all, fk_all, v_all = (torch.as_tensor(x) for x in (phi_q, phi_k, v))
    n = fq_all.shape[-2]
    out = torch.empty(fq_all.shape[:-1] + v_all.shape[-1:], dtype=v_all.dtype)
    for a in range(0, n, chunk_size):
        part = slice(a, a + chunk_size)
        fq, fk, vc = (
            fq_all[..., part, :],
            fk_all[..., part, :],
            v_all[..., part, :],
        )
        pre_k, pre_v = fk_all[..., :a, :], v_all[..., :a, :]
        s = pre_k.transpose(-1, -2) @ pre_v
        z = pre_k.sum(-2)
        w = torch.tril(fq @ fk.transpose(-1, -2))
        den = w.sum(-1) + (fq @ z[..., None])[..., 0]
        out[..., part, :] = (w @ vc + fq @ s) / den[..., None]
    return out.numpy()


def test_a_torch_loop_over_the_queries_is_rejected_by_its_flops(capsys):
    with pytest.raises(ExerciseError) as err:
        check_linear_attention(linear_torch_loop_over_queries)
    assert err.value.mistake == "quadratic_work", str(err.value)
    assert "(flops counted)': at 4 times the length" in str(err.value)
    assert "16.0 times the flops" in str(err.value)
    assert "Correct" not in capsys.readouterr().out


def test_a_torch_reread_of_earlier_keys_is_rejected_by_its_flops(capsys):
    with pytest.raises(ExerciseError) as err:
        check_chunked_causal_linear_attention(chunked_torch_reread)
    assert err.value.mistake == "no_running_state", str(err.value)
    assert "(flops counted)" in str(err.value)
    assert "Correct" not in capsys.readouterr().out


def test_a_numpy_loop_over_the_queries_names_the_quadratic_work():
    with pytest.raises(ExerciseError) as err:
        check_linear_attention(linear_loop_over_queries)
    assert err.value.mistake == "quadratic_work", str(err.value)


def test_the_success_lines_claim_what_was_measured(capsys):
    check_linear_attention(good_linear)
    out = capsys.readouterr().out
    assert "CPU time grew less than 12 times from n = 256 to n = 1024" in out
    assert "flops of its torch matrix products grew 4.0 times" in out
    check_linear_attention(linear_numpy_float32)
    out = capsys.readouterr().out
    assert "like linear work" not in out and "flops" not in out
    check_chunked_causal_linear_attention(chunked_torch_running_state)
    out = capsys.readouterr().out
    assert "grew less than 60 times from n = 512 to n = 8192" in out
    assert "flops of its torch matrix products grew 8.0 times" in out


def test_a_numpy_answer_is_not_counted():
    from attnbook.exercises.perspectives import flop_growth

    def make(n):
        return (np.ones((n, 2)), np.ones((n, 2)), np.ones((n, 1)))

    assert flop_growth(linear_numpy_float32, make, 8, 32) is None
    assert flop_growth(good_linear, make, 8, 32) == 4.0


CATALOGUE["check_linear_attention"]["wrong"] += [
    (linear_torch_loop_over_queries, "quadratic_work"),
    (linear_loop_over_queries, "quadratic_work"),
]
CHUNKED_WRONG += [(chunked_torch_reread, "no_running_state")]
CHUNKED_RIGHT += [chunked_torch_running_state]


# --- from the expert reading of chapter 17 (ps17l, session 10) --------------
# Answers that keep the state of every chunk and sum them all again at every
# chunk: right values, no running state, (n / C)^2 additions of d_k x d_v
# states. Chunks of 64 hide the extra work; chunks of 4 do not.


def chunked_resum_list(phi_q, phi_k, v, chunk_size):
    """Wrong: Python's sum over the list of earlier chunks' states."""
    n = phi_q.shape[-2]
    out = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    states, sums = [], []
    for a in range(0, n, chunk_size):
        fq, fk, vc = (x[..., a : a + chunk_size, :] for x in (phi_q, phi_k, v))
        w = np.tril(fq @ np.swapaxes(fk, -1, -2))
        num, den = w @ vc, w.sum(-1)
        if states:
            num = num + fq @ sum(states)
            den = den + (fq @ sum(sums)[..., None])[..., 0]
        out[..., a : a + chunk_size, :] = num / den[..., None]
        states.append(np.swapaxes(fk, -1, -2) @ vc)
        sums.append(fk.sum(-2))
    return out


def chunked_resum_stack(phi_q, phi_k, v, chunk_size):
    """Wrong: the earlier states stacked and summed at every chunk."""
    n, m, d_v = phi_q.shape[-2], phi_q.shape[-1], v.shape[-1]
    out = np.empty(phi_q.shape[:-1] + (d_v,))
    states = [np.zeros(phi_k.shape[:-2] + (m, d_v))]
    sums = [np.zeros(phi_k.shape[:-2] + (m,))]
    for a in range(0, n, chunk_size):
        fq, fk, vc = (x[..., a : a + chunk_size, :] for x in (phi_q, phi_k, v))
        s, z = np.stack(states).sum(0), np.stack(sums).sum(0)
        w = np.tril(fq @ np.swapaxes(fk, -1, -2))
        den = w.sum(-1) + (fq @ z[..., None])[..., 0]
        out[..., a : a + chunk_size, :] = (w @ vc + fq @ s) / den[..., None]
        states.append(np.swapaxes(fk, -1, -2) @ vc)
        sums.append(fk.sum(-2))
    return out


def chunked_resum_torch(phi_q, phi_k, v, chunk_size):
    """Wrong: the same in torch (torch.stack(...).sum(0)); the counted
    matrix products grow linearly, the additions are not counted."""
    q, k, vv = (torch.as_tensor(x) for x in (phi_q, phi_k, v))
    m, d_v = q.shape[-1], vv.shape[-1]
    states = [torch.zeros(q.shape[:-2] + (m, d_v), dtype=q.dtype)]
    sums = [torch.zeros(q.shape[:-2] + (m,), dtype=q.dtype)]
    outs = []
    for a in range(0, q.shape[-2], chunk_size):
        fq, fk, vc = (x[..., a : a + chunk_size, :] for x in (q, k, vv))
        s, z = torch.stack(states).sum(0), torch.stack(sums).sum(0)
        w = torch.tril(fq @ fk.transpose(-1, -2))
        den = w.sum(-1) + (fq @ z[..., None])[..., 0]
        outs.append((w @ vc + fq @ s) / den[..., None])
        states.append(fk.transpose(-1, -2) @ vc)
        sums.append(fk.sum(-2))
    return torch.cat(outs, dim=-2).numpy()


def chunked_resum_in_place(phi_q, phi_k, v, chunk_size):
    """Wrong: one S and z, but rebuilt in place from every stored chunk
    state at every chunk."""
    n, m, d_v = phi_q.shape[-2], phi_q.shape[-1], v.shape[-1]
    out = np.empty(phi_q.shape[:-1] + (d_v,))
    s = np.zeros(phi_k.shape[:-2] + (m, d_v))
    z = np.zeros(phi_k.shape[:-2] + (m,))
    states, sums = [], []
    for a in range(0, n, chunk_size):
        fq, fk, vc = (x[..., a : a + chunk_size, :] for x in (phi_q, phi_k, v))
        s[...], z[...] = 0.0, 0.0
        for state, total in zip(states, sums):
            s += state
            z += total
        w = np.tril(fq @ np.swapaxes(fk, -1, -2))
        den = w.sum(-1) + (fq @ z[..., None])[..., 0]
        out[..., a : a + chunk_size, :] = (w @ vc + fq @ s) / den[..., None]
        states.append(np.swapaxes(fk, -1, -2) @ vc)
        sums.append(fk.sum(-2))
    return out


CHUNKED_RESUMMED = [
    chunked_resum_list,
    chunked_resum_stack,
    chunked_resum_torch,
    chunked_resum_in_place,
]
CHUNKED_WRONG += [(f, "earlier_states_resummed") for f in CHUNKED_RESUMMED]


def test_re_summed_chunk_states_are_named_at_chunks_of_4(capsys):
    """Fails on the old checker, which timed chunks of 64 only: the
    re-summed states passed there (their (n / C)^2 additions are small at
    128 chunks), and they pass that step still."""
    from attnbook.exercises.perspectives import _check_chunked_length

    for wrong in CHUNKED_RESUMMED:
        _check_chunked_length(wrong)
        with pytest.raises(ExerciseError) as err:
            check_chunked_causal_linear_attention(wrong)
        assert err.value.mistake == "earlier_states_resummed", str(err.value)
        assert "chunk_size = 4 (time)" in str(err.value)
        assert "128 and then 2048 chunks" in str(err.value)
    assert "Correct" not in capsys.readouterr().out


def test_both_chunk_sizes_are_timed_and_one_slow_try_is_forgiven(
    monkeypatch, capsys
):
    """The step at chunks of 4 retries like the one at 64: one slow
    measurement does not reject a right answer, and each step is taken at
    its own chunk size."""
    from attnbook.exercises import perspectives

    sizes = []
    measured = iter([14.0, 90.0, 20.0])

    def growth(fn, make, *args, **kwargs):
        sizes.append(make(8)[3])
        return next(measured)

    monkeypatch.setattr(perspectives, "work_growth", growth)
    check_chunked_causal_linear_attention(chunked_loop)
    assert "with chunks of 64 and of 4" in capsys.readouterr().out
    assert sizes == [64, 4, 4]


# --- from the expert reading of chapter 17 (ps17m, session 11) --------------


def chunked_positions_with_input_check(phi_q, phi_k, v, chunk_size):
    """Wrong: a recurrence over positions (chunk_size ignored), behind an
    input check in Python that executes one line per element (accepted by
    the old checker, whose width test took the check's lines for the
    answer's)."""
    assert all(x >= 0 for x in phi_q.flat) and all(x >= 0 for x in phi_k.flat)
    out = np.empty(phi_q.shape[:-1] + v.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    z = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1],))
    for i in range(phi_q.shape[-2]):
        s += phi_k[..., i, :, None] * v[..., i, None, :]
        z += phi_k[..., i, :]
        num = phi_q[..., i, None, :] @ s
        out[..., i, :] = (
            num[..., 0, :] / (phi_q[..., i, :] * z).sum(-1)[..., None]
        )
    return out


def chunked_fixed_64(phi_q, phi_k, v, chunk_size):
    """Wrong: right values, but chunks of 64 whatever chunk_size is (the
    default of attention_from_features; accepted by the old checker)."""
    chunk_size = 64
    return chunked_loop(phi_q, phi_k, v, chunk_size)


def chunked_torch_fixed_64(phi_q, phi_k, v, chunk_size):
    """Wrong: the same in torch."""
    return chunked_torch_running_state(phi_q, phi_k, v, 64)


def chunked_loop_with_input_check(phi_q, phi_k, v, chunk_size):
    """Right: the book's loop behind a check of every element in Python."""
    if not all(x >= 0 for x in phi_q.flat):
        raise ValueError("phi_q must be non-negative")
    if not all(x >= 0 for x in phi_k.flat):
        raise ValueError("phi_k must be non-negative")
    return chunked_loop(phi_q, phi_k, v, chunk_size)


def chunked_parallel_with_input_check(phi_q, phi_k, v, chunk_size):
    """Right: the chunkwise-parallel form (no loop over chunks) behind the
    same check."""
    assert all(x >= 0 for x in phi_q.flat) and all(x >= 0 for x in phi_k.flat)
    return chunked_parallel_padded(phi_q, phi_k, v, chunk_size)


def test_a_recurrence_behind_an_input_check_is_named():
    """The lines that do not grow with the widths are counted: the check's
    cancel, the recurrence's one per position remain."""
    with pytest.raises(ExerciseError) as err:
        check_chunked_causal_linear_attention(
            chunked_positions_with_input_check
        )
    assert err.value.mistake == "chunk_size_ignored", str(err.value)
    assert "do not grow with the widths" in str(err.value)


def test_a_chunk_size_written_into_the_code_is_named(capsys):
    for wrong in (chunked_fixed_64, chunked_torch_fixed_64):
        with pytest.raises(ExerciseError) as err:
            check_chunked_causal_linear_attention(wrong)
        assert err.value.mistake == "chunk_size_fixed", str(err.value)
        assert "chunk_size = 1024 and 2048 (lines of Python and memory)" in (
            str(err.value)
        )
    assert "Correct" not in capsys.readouterr().out


def test_checks_of_every_element_do_not_hide_or_condemn_an_answer(capsys):
    from attnbook.exercises.perspectives import _check_chunked_work

    for right in (
        chunked_loop_with_input_check,
        chunked_parallel_with_input_check,
    ):
        _check_chunked_work(right)
    check_chunked_causal_linear_attention(chunked_parallel_with_input_check)
    assert "Correct" in capsys.readouterr().out


CHUNKED_WRONG += [
    (chunked_positions_with_input_check, "chunk_size_ignored"),
    (chunked_fixed_64, "chunk_size_fixed"),
    (chunked_torch_fixed_64, "chunk_size_fixed"),
]
CHUNKED_RIGHT += [
    chunked_loop_with_input_check,
    chunked_parallel_with_input_check,
]


# --- from the expert reading of chapter 17 (ps17n, session 11) --------------


def _chunked_capped(cap):
    def capped(phi_q, phi_k, v, chunk_size):
        """Wrong: a cap on the chunk size (accepted by the checker of
        session 11's first fixes: readings ps17n, ps17o)."""
        return chunked_loop(phi_q, phi_k, v, min(chunk_size, cap))

    capped.__name__ = f"chunked_capped_{cap}"
    return capped


def _chunked_floored(floor, form):
    def floored(phi_q, phi_k, v, chunk_size):
        """Wrong: a floor on the chunk size (never probed before)."""
        return form(phi_q, phi_k, v, max(chunk_size, floor))

    floored.__name__ = f"chunked_floored_{floor}_{form.__name__}"
    return floored


CHUNKED_SIZE_OF_ITS_OWN = [
    _chunked_capped(1024),
    _chunked_capped(512),
    _chunked_capped(256),
    _chunked_floored(16, chunked_loop),
    _chunked_floored(2, chunked_loop),
    _chunked_floored(64, chunked_parallel_padded),
]


@pytest.mark.parametrize(
    "wrong", CHUNKED_SIZE_OF_ITS_OWN, ids=lambda f: f.__name__
)
def test_a_cap_or_a_floor_on_the_chunk_size_is_named(wrong):
    from attnbook.exercises.perspectives import _check_chunk_size_used

    with pytest.raises(ExerciseError) as err:
        _check_chunk_size_used(wrong)
    assert err.value.mistake == "chunk_size_fixed", str(err.value)


def test_the_chunk_size_probes_pass_every_right_answer():
    """Both probes, on every right answer of the catalogue (loops, the
    chunkwise-parallel forms, prefix sums inside a chunk, torch), with and
    without input checks: counts of lines and bytes, not times."""
    from attnbook.exercises.perspectives import _check_chunk_size_used

    for right in CHUNKED_RIGHT:
        _check_chunk_size_used(right)


CHUNKED_WRONG += [
    (_chunked_capped(512), "chunk_size_fixed"),
    (_chunked_floored(16, chunked_loop), "chunk_size_fixed"),
]


def _chunked_vectorised_capped(cap):
    def capped(phi_q, phi_k, v, chunk_size):
        """Wrong: the chunkwise-parallel form with a cap on the chunk
        size (no loop over the chunks: only its memory tells)."""
        return chunked_parallel_padded(phi_q, phi_k, v, min(chunk_size, cap))

    capped.__name__ = f"chunked_vectorised_capped_{cap}"
    return capped


def test_a_cap_in_a_vectorised_answer_is_named():
    from attnbook.exercises.perspectives import _check_chunk_size_used

    with pytest.raises(ExerciseError) as err:
        _check_chunk_size_used(_chunked_vectorised_capped(1024))
    assert err.value.mistake == "chunk_size_fixed", str(err.value)


CHUNKED_WRONG += [(_chunked_capped(1024), "chunk_size_fixed")]


# --- from the expert reading of chapter 17 (ps17p, session 11) --------------


def chunked_empty_for_one_chunk(phi_q, phi_k, v, chunk_size):
    """Wrong: computes nothing when chunk_size exceeds n, returning
    np.empty's memory (accepted when the reference ran first and freed a
    temporary holding the right values, which np.empty got back)."""
    n = phi_q.shape[-2]
    if chunk_size > n:
        shape = phi_q.shape[:-1] + v.shape[-1:]
        return np.empty(shape, np.result_type(phi_q, phi_k, v))
    return chunked_loop(phi_q, phi_k, v, chunk_size)


def chunked_last_chunk_unwritten(phi_q, phi_k, v, chunk_size):
    """Wrong: the last, short chunk is never computed and its rows are
    np.empty's memory (hidden by the same leftover values)."""
    n = phi_q.shape[-2]
    shape = phi_q.shape[:-1] + v.shape[-1:]
    out = np.empty(shape, np.result_type(phi_q, phi_k, v))
    full = n - n % chunk_size
    if full:
        out[..., :full, :] = chunked_loop(
            phi_q[..., :full, :],
            phi_k[..., :full, :],
            v[..., :full, :],
            chunk_size,
        )
    return out


def test_unwritten_rows_of_np_empty_are_not_taken_for_right_values():
    """The answer runs before the reference, on scrubbed memory: rows it
    never writes cannot pick up the values a reference just freed."""
    for wrong, case in (
        (chunked_empty_for_one_chunk, "one chunk, shorter than chunk_size"),
        (chunked_last_chunk_unwritten, "the last chunk has 2 positions"),
    ):
        for _ in range(2):
            with pytest.raises(ExerciseError) as err:
                check_chunked_causal_linear_attention(wrong)
            assert case in str(err.value), str(err.value)


# --- from the expert reading of chapter 17 (y17pp, session 12) --------------


def chunked_package_call(phi_q, phi_k, v, chunk_size):
    """Wrong: the package's causal branch called (rejected with the
    diagnosis 'a chunk size of its own' before: its loop runs in attnbook,
    whose lines the checker does not count)."""
    from attnbook.linear_attention import attention_from_features

    return attention_from_features(
        phi_q, phi_k, v, causal=True, chunk_size=chunk_size
    )


def chunked_package_linear_attention(phi_q, phi_k, v, chunk_size):
    """Wrong: linear_attention with the identity as feature map."""
    from attnbook.linear_attention import linear_attention

    return linear_attention(
        phi_q,
        phi_k,
        v,
        feature_map=lambda x: x,
        causal=True,
        chunk_size=chunk_size,
    )


def test_a_call_of_the_package_is_named_as_such(capsys):
    for wrong, name in (
        (chunked_package_call, "attention_from_features"),
        (chunked_package_linear_attention, "linear_attention"),
    ):
        with pytest.raises(ExerciseError) as err:
            check_chunked_causal_linear_attention(wrong)
        assert err.value.mistake == "package_function_called", str(err.value)
        assert f"calls attnbook.linear_attention.{name};" in str(err.value)
        assert "a size of its own" not in str(err.value)
    assert "Correct" not in capsys.readouterr().out


def test_a_right_answer_calls_no_package_answer():
    from attnbook.exercises.perspectives import package_answers_called

    rng = np.random.default_rng(0)
    phi_q, phi_k = np.exp(rng.normal(size=(2, 16, 4)))
    v = rng.normal(size=(16, 3))
    for right in CHUNKED_RIGHT:
        assert package_answers_called(right, phi_q, phi_k, v, 4) == []
    assert package_answers_called(
        chunked_package_call, phi_q, phi_k, v, 4
    ) == ["attention_from_features"]


CHUNKED_WRONG += [
    (chunked_package_call, "package_function_called"),
    (chunked_package_linear_attention, "package_function_called"),
]
