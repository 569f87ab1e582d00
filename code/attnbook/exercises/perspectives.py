"""Checkers for linear attention and the Nadaraya-Watson estimator (the
perspectives chapter)."""

from __future__ import annotations

import numpy as np

from ..attention import scaled_dot_product_attention
from ..kernel_smoothing import nadaraya_watson
from ..linear_attention import elu_feature_map, linear_attention
from ._framework import (
    Case,
    Mistake,
    as_array,
    # these two lived here: importable from here still
    largest_torch_allocation,  # noqa: F401
    peak_memory_with_torch,
    run_checks,
    same,
    torch_profiler_ready,  # noqa: F401
)

_rng = np.random.default_rng


def _first(out):
    """Accept either the output alone or an ``(output, weights)`` pair."""
    return out[0] if isinstance(out, tuple) else out


# --- linear attention with the elu + 1 feature map ---------------------------


def _t(x):
    return np.swapaxes(x, -1, -2)


def _weights_then(normalise):
    """A mistake that forms the n_q x n_k weights phi(q) phi(k)^T and
    normalises them wrongly."""

    def attention(q, k, v):
        w = elu_feature_map(q) @ _t(elu_feature_map(k))
        return normalise(w) @ v

    return attention


def _no_normaliser(q, k, v):
    return elu_feature_map(q) @ (_t(elu_feature_map(k)) @ v)


def _feature_map_on_values(q, k, v):
    fq, fk = elu_feature_map(q), elu_feature_map(k)
    return (fq @ (_t(fk) @ elu_feature_map(v))) / (
        fq @ fk.sum(axis=-2)[..., None]
    )


def _sum_over_queries(q, k, v):
    fq, fk = elu_feature_map(q), elu_feature_map(k)
    return (fq @ (_t(fk) @ v)) / (fq @ fq.sum(axis=-2)[..., None])


def _with_features(phi):
    def attention(q, k, v):
        fq, fk = phi(q), phi(k)
        return (fq @ (_t(fk) @ v)) / (fq @ fk.sum(axis=-2)[..., None])

    return attention


def _elu(x):
    return np.where(x > 0, x, np.expm1(np.minimum(x, 0)))


LINEAR_ATTENTION_MISTAKES = [
    Mistake(
        "no_normaliser",
        "the output is never divided by the normaliser phi(q_i) . sum_j "
        "phi(k_j)",
        "without the denominator the weights do not sum to 1 and the output "
        "grows with n_k; "
        "divide by phi(q) @ phi(k).sum(axis=-2)",
        _no_normaliser,
    ),
    Mistake(
        "feature_map_on_values",
        "the feature map is applied to the values as well",
        "phi replaces the exponential of the scores, which involve only q and "
        "k; v enters as it is",
        _feature_map_on_values,
    ),
    Mistake(
        "wrong_axis",
        "the weights are normalised over the queries instead of over the keys",
        "each query's weights phi(q_i) . phi(k_j) must sum to 1 over the keys "
        "j",
        _weights_then(lambda w: w / w.sum(axis=-2, keepdims=True)),
    ),
    Mistake(
        "sum_over_queries",
        "the normaliser sums the features of the queries instead of the keys",
        "the denominator is phi(q_i) . z with z = sum over the keys j of "
        "phi(k_j)",
        _sum_over_queries,
    ),
    Mistake(
        "elu_without_one",
        "the feature map is elu(x), without the + 1",
        "elu(x) is negative for x < 0, so weights can be negative and "
        "denominators near zero; "
        "use elu(x) + 1, which is always positive",
        _with_features(_elu),
    ),
    Mistake(
        "no_feature_map",
        "q and k are used without a feature map (phi(x) = x)",
        "apply phi(x) = elu(x) + 1 to q and to k before forming S and z",
        _with_features(lambda x: x),
    ),
    Mistake(
        "relu_plus_one",
        "the feature map is relu(x) + 1, not elu(x) + 1",
        "elu(x) + 1 is x + 1 for x > 0 and exp(x) for x <= 0; relu(x) + 1 "
        "agrees above 0 but is 1 below it",
        _with_features(lambda x: np.maximum(x, 0) + 1),
    ),
    Mistake(
        "exp_feature_map",
        "the feature map is exp(x), not elu(x) + 1",
        "elu(x) + 1 is exp(x) only for x <= 0; above 0 it is x + 1",
        _with_features(np.exp),
    ),
    Mistake(
        "softplus_feature_map",
        "the feature map is softplus(x) = log(1 + e^x), not elu(x) + 1",
        "the chapter's feature map is elu(x) + 1: x + 1 for x > 0 and exp(x) "
        "for x <= 0",
        _with_features(lambda x: np.logaddexp(0, x)),
    ),
    Mistake(
        "scaled_inputs",
        "q and k are scaled by d_k^(-1/4) before the feature map (as the "
        "1/sqrt(d_k) of softmax attention would be split between them)",
        "linear attention has no 1/sqrt(d_k): apply elu(x) + 1 to q and k as "
        "they are",
        lambda q, k, v: _with_features(
            lambda x: _elu(x / np.shape(q)[-1] ** 0.25) + 1
        )(q, k, v),
    ),
    Mistake(
        "scaled_inputs_sqrt",
        "q and k are scaled by 1/sqrt(d_k) before the feature map (the "
        "scale of softmax attention's scores, applied to each of q and k)",
        "linear attention has no 1/sqrt(d_k): the weights are phi(q) . "
        "phi(k) with phi(x) = elu(x) + 1 applied to q and k as they are",
        lambda q, k, v: _with_features(
            lambda x: _elu(x / np.sqrt(np.shape(q)[-1])) + 1
        )(q, k, v),
    ),
    Mistake(
        "normaliser_of_summed_keys",
        "the normaliser uses the features of the summed keys, phi(sum_j "
        "k_j), instead of the sum of the keys' features, sum_j phi(k_j)",
        "phi is not linear, so phi of a sum is not the sum of the phi's: "
        "z = phi(k).sum(axis=-2), the features summed over the keys",
        lambda q, k, v: (
            (elu_feature_map(q) @ (_t(elu_feature_map(k)) @ v))
            / (
                elu_feature_map(q)
                @ elu_feature_map(np.sum(k, axis=-2))[..., None]
            )
        ),
    ),
    Mistake(
        "softmax_attention",
        "this is softmax attention, not linear attention",
        "replace exp(q . k / sqrt(d)) by phi(q) . phi(k) with phi(x) = elu(x) "
        "+ 1, and use "
        "associativity: phi(q) @ (phi(k).T @ v)",
        lambda q, k, v: scaled_dot_product_attention(q, k, v)[0],
    ),
]


LINEAR_COST_MISTAKES = [
    Mistake(
        "quadratic_work",
        "the values are right, but your function computes every weight "
        "phi(q_i) . phi(k_j), n x n of them, even if it never stores them "
        "all (a loop over the queries, a three-operand einsum)",
        "compute S = phi(K)^T V (d_k x d_v) and z = sum_j phi(k_j) once, "
        "then each output row is phi(q_i) S / (phi(q_i) . z): no loop over "
        "the queries that visits every key, and no three-operand einsum, "
        "which numpy evaluates over all (i, j) pairs unless optimize=True",
        lambda q, k, v: linear_attention(q, k, v),
    ),
]


def linear_attention_cases() -> list[Case]:
    rng = _rng(12)
    n = lambda *shape, scale=1.0: rng.normal(scale=scale, size=shape)  # noqa: E731
    return [
        Case(
            "self-attention, n = 6, d_k = d_v = 4", (n(6, 4), n(6, 4), n(6, 4))
        ),
        Case(
            "cross-attention, n_q = 3, n_k = 7, d_k = 5, d_v = 2",
            (n(3, 5), n(7, 5), n(7, 2)),
        ),
        Case(
            "a batch of 2 x 3 heads, n = 5, d_k = 4, d_v = 6",
            (n(2, 3, 5, 4), n(2, 3, 5, 4), n(2, 3, 5, 6)),
        ),
        Case(
            "inputs of scale 3, n = 8, d_k = 3, d_v = 2",
            (n(8, 3, scale=3), n(8, 3, scale=3), n(8, 2)),
        ),
        Case("a single query and key (n = 1)", (n(1, 4), n(1, 4), n(1, 3))),
    ]


def check_linear_attention(fn) -> None:
    """Check ``fn(q, k, v)`` computes non-causal linear attention with ``phi(x)
    = elu(x) + 1``.

    q: (..., n_q, d_k), k: (..., n_k, d_k), v: (..., n_k, d_v) -> (..., n_q,
    d_v). Besides the values, the checker measures the memory of one long case
    (n = 4096): linear attention never forms the n x n matrix phi(Q) phi(K)^T,
    and an answer that does (the quadratic form, right values at quadratic
    cost) is rejected. The measurement uses :mod:`tracemalloc`, which sees
    numpy's arrays, and, where torch is imported, torch's profiler, whatever
    the answer returns (:func:`peak_memory_with_torch`). It also compares the
    work at two lengths: an answer that never stores the matrix but still
    computes it (a loop over the queries, a three-operand ``einsum``) does 16
    times the work at 4 times the length, linear work 4 times. Where the
    answer runs torch's matrix products, their flops are counted
    (:func:`flop_growth`, a count, the same on every run) on n = 512 and n =
    2048, and a growth of 10 times or more is rejected. For every answer the
    CPU time is compared too (:func:`work_growth`), from n = 256 to 1024 and
    from n = 512 to 8192, and a growth above 12 and 60 times is rejected; a
    time ratio rejects a numpy loop over the queries, but torch's overhead
    per call, itself linear in n, can hide a loop's quadratic work from it,
    which is why torch answers are counted.
    """
    __tracebackhide__ = True
    run_checks(
        "linear attention",
        fn,
        linear_attention_cases(),
        lambda q, k, v: linear_attention(q, k, v),
        LINEAR_ATTENTION_MISTAKES,
        postprocess=_first,
        # its "Correct" line waits for the cost checks
        quiet=True,
    )
    _check_linear_memory(fn)
    flops = _check_linear_flops(fn)
    _check_linear_time(fn)
    (a, b, small), (c, d, large) = LINEAR_TIME_STEPS
    counted = ""
    if flops is not None:
        f_small, f_large, _ = LINEAR_FLOP_STEP
        counted = (
            f"; the flops of its torch matrix products grew {flops:.1f} "
            f"times from n = {f_small} to n = {f_large} (linear work: "
            f"{f_large // f_small})"
        )
    print(
        "Correct: linear attention passes all "
        f"{len(linear_attention_cases())} cases; on n = 4096 it never "
        "needed the memory of an n x n matrix; its CPU time grew less than "
        f"{small:.0f} times from n = {a} to n = {b} and less than "
        f"{large:.0f} times from n = {c} to n = {d} (quadratic work: "
        f"{(b // a) ** 2} and {(d // c) ** 2}){counted}."
    )


def _check_linear_memory(fn, n: int = 4096, d: int = 8) -> None:
    """Reject an answer whose peak memory on a long sequence is that of an n x
    n matrix."""
    from ..bench import format_bytes
    from ._framework import ExerciseError

    __tracebackhide__ = True
    rng = _rng(13)
    q, k, v = (rng.normal(size=(n, d)) for _ in range(3))
    # the reference first, and the reader's function on copies: an answer
    # that changes its inputs in place is judged on its output alone
    expected = linear_attention(q, k, v)
    # numpy's arrays, and torch's allocations whatever the answer returns
    out, peak = peak_memory_with_torch(fn, q, k, v)
    case = f"n = {n}, d_k = d_v = {d} (memory)"
    # one float32 n x n matrix (float64: twice that)
    square = n * n * 4
    if peak >= square // 2:
        raise ExerciseError(
            "linear attention",
            case,
            "the values may be right, but your function's peak memory was "
            f"{format_bytes(peak)}, "
            f"about that of an n x n matrix ({format_bytes(square)}): this is "
            "the quadratic "
            "form phi(Q) phi(K)^T V, at the cost linear attention exists to "
            "avoid",
            hint="multiply the other way round: phi(K)^T V is d_k x d_v and "
            "sum_j phi(k_j) is d_k, "
            "both independent of n; then multiply phi(Q) by them",
        )
    # the outputs are small (averages of n values): a float32
    scale = float(np.abs(expected).max())
    # answer is right to ~1e-6 of them
    if not same(_first(out), expected, rtol=1e-4, atol=1e-5 * scale):
        raise ExerciseError(
            "linear attention",
            case,
            "values differ from the reference on a long sequence",
        )


def work_growth(
    fn, make_args, n_small: int, n_large: int, repeats: int = 3
) -> float:
    """How much the CPU time of ``fn(*make_args(n))`` grows from ``n_small`` to
    ``n_large``: the ratio of the fastest of up to ``repeats`` runs at each
    length (fewer once a length has used 0.5 s).

    A ratio of two process CPU times measured moments apart, not one clock
    reading: time spent waiting for the CPU on a busy machine is not counted,
    and what slows both runs alike cancels. numpy's BLAS and torch run on one
    thread meanwhile: idle threads that spin count as CPU time.
    """
    import contextlib
    import sys
    import time

    with contextlib.ExitStack() as stack:
        try:
            from threadpoolctl import threadpool_limits

            stack.enter_context(threadpool_limits(1))
        # not installed (the browser): one thread anyway
        except ImportError:
            pass
        # only where the reader's code already uses it
        torch = sys.modules.get("torch")
        if torch is not None:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            stack.callback(torch.set_num_threads, threads)
        return _growth(
            fn, make_args, n_small, n_large, repeats, time.process_time
        )


def _growth(fn, make_args, n_small, n_large, repeats, clock):

    def fastest(n):
        args, best, spent = make_args(n), float("inf"), 0.0
        for _ in range(repeats):
            start = clock()
            fn(*args)
            took = clock() - start
            best, spent = min(best, took), spent + took
            if spent > 0.5:
                break
        return best

    small = fastest(n_small)
    return fastest(n_large) / max(small, 1e-6)


def flop_growth(fn, make_args, n_small: int, n_large: int) -> float | None:
    """How much the flops of the torch matrix products in ``fn(*make_args(n))``
    grow from ``n_small`` to ``n_large``, counted by
    :class:`torch.utils.flop_counter.FlopCounterMode`; None when torch is not
    imported or ``fn`` ran no matrix product in torch at either length (a
    numpy answer: numpy's work is not counted).

    A count, not a time: the same on every run, on any machine under any
    load, and blind to the fixed cost of each call, which in torch is several
    microseconds and, in a loop over positions, can hide quadratic work from a
    time ratio.
    """
    import sys

    if "torch" not in sys.modules:
        return None
    try:
        from torch.utils.flop_counter import FlopCounterMode
    except ImportError:
        # a stand-in module named torch (the browser's, without PyTorch)
        return None

    counts = []
    for n in (n_small, n_large):
        args = make_args(n)
        with FlopCounterMode(display=False) as mode:
            fn(*args)
        counts.append(mode.get_total_flops())
    if min(counts) == 0:
        return None
    return counts[1] / counts[0]


# The lengths of the count of torch flops and the growth at which the work is
# called quadratic: at 4 times the length linear work grows 4 times and the
# weights of every (query, key) pair 16 times (a loop over the queries in
# torch: 16.0; the book's form in torch: 4.0).
LINEAR_FLOP_STEP = (512, 2048, 10.0)


# The lengths compared and the growth above which the work is called quadratic.
# The second step spans 16 times the length (512 -> 8192), so that linear work
# (about 16x, up to about 2x more where the arrays leave the cache or the
# machine is loaded) and quadratic work (256x, or more than 100x for a loop
# whose Python overhead dominates at the small length) stand far apart on
# either side of the limit. Measured here on a loaded 2-core AMD EPYC (load
# average 10-13, d_k = 64, d_v = 1, three runs each): over 512 -> 8192 the
# book's solution grew 16-19x, torch 12-29x, two-operand einsums 15-20x; a
# loop over the queries 124-165x, blocks of 256 queries 140-175x. Over 256 ->
# 1024 right answers grew 2.5-6x, a three-operand einsum 14-16x (stopped
# there, before the long one), blocks 9-12x, the loop 5-10x; one that passes
# the first step is still rejected by the second. An earlier limit of 20 over
# 1024 -> 8192 rejected a right answer under load (21x); over that step the
# runs above gave 6-16x for right answers and 32-57x for wrong ones.
LINEAR_TIME_STEPS = ((256, 1024, 12.0), (512, 8192, 60.0))
LINEAR_TIME_TRIES = 3


def _linear_inputs(d_k, d_v):
    """Inputs of every length, drawn once per length: a function of n."""
    rng = _rng(14)
    inputs = {}

    def make(n):
        if n not in inputs:
            inputs[n] = (
                rng.normal(size=(n, d_k)),
                rng.normal(size=(n, d_k)),
                rng.normal(size=(n, d_v)),
            )
        # fresh copies: an answer that changes its inputs in place does not
        # change those of the next repeat
        return tuple(a.copy() for a in inputs[n])

    return make


def _check_linear_flops(fn, d_k: int = 64, d_v: int = 1) -> float | None:
    """Reject a torch answer whose counted flops grow quadratically with the
    length; the growth, or None for an answer that runs no torch matrix
    product."""
    from ._framework import ExerciseError

    __tracebackhide__ = True
    n_small, n_large, limit = LINEAR_FLOP_STEP
    growth = flop_growth(fn, _linear_inputs(d_k, d_v), n_small, n_large)
    if growth is not None and growth >= limit:
        ratio = n_large // n_small
        raise ExerciseError(
            "linear attention",
            f"n = {n_small} and n = {n_large}, d_k = {d_k}, d_v = {d_v} "
            "(flops counted)",
            f"at {ratio} times the length your torch matrix products did "
            f"{growth:.1f} times the flops (linear work: {ratio} times; "
            f"quadratic: {ratio**2})",
            mistake=LINEAR_COST_MISTAKES[0],
        )
    return growth


def _check_linear_time(fn, d_k: int = 64, d_v: int = 1) -> None:
    """Reject an answer whose work grows quadratically with the length, though
    it never stores n x n."""
    from ._framework import ExerciseError

    __tracebackhide__ = True
    make = _linear_inputs(d_k, d_v)
    for n_small, n_large, limit in LINEAR_TIME_STEPS:
        # A busy machine can slow one run of the small length: a growth above
        # the limit is measured again, up to LINEAR_TIME_TRIES times in all,
        # and only the smallest counts. Quadratic work exceeds the limit in
        # every try, so this rejects no wrong answer that one try would not.
        growth = work_growth(fn, make, n_small, n_large)
        for _ in range(LINEAR_TIME_TRIES - 1):
            if growth <= limit:
                break
            growth = min(growth, work_growth(fn, make, n_small, n_large))
        if growth > limit:
            ratio = n_large // n_small
            raise ExerciseError(
                "linear attention",
                f"n = {n_small} and n = {n_large}, d_k = {d_k}, d_v = {d_v} "
                "(time)",
                f"at {ratio} times the length your function took {growth:.0f} "
                "times the CPU time (linear "
                f"work: about {ratio} times; quadratic: {ratio**2})",
                mistake=LINEAR_COST_MISTAKES[0],
            )


# --- the Nadaraya-Watson estimator with a Gaussian kernel --------------------


def _gaussian_nw(
    log_kernel, normalise=True, axis=-1, stable=True, shift_axis="same"
):
    """A 1-D estimator built from ``log_kernel(diff, h)``, with switchable
    mistakes (``shift_axis``: the axis of the maximum subtracted for stability,
    by default the normalised one)."""

    def estimate(x_query, x_train, y_train, bandwidth):
        # (m, n)
        diff = (
            np.asarray(x_query, float)[:, None]
            - np.asarray(x_train, float)[None, :]
        )
        s = log_kernel(diff, bandwidth)
        if stable:
            s = s - s.max(
                axis=axis if shift_axis == "same" else shift_axis,
                keepdims=True,
            )
        k = np.exp(s)
        if normalise:
            k = k / k.sum(axis=axis, keepdims=True)
        return k @ np.asarray(y_train, float)

    return estimate


_gauss = lambda diff, h: -(diff**2) / (2 * h**2)  # noqa: E731


def _leave_one_out(x_query, x_train, y_train, bandwidth):
    diff = (
        np.asarray(x_query, float)[:, None]
        - np.asarray(x_train, float)[None, :]
    )
    s = np.where(diff == 0, -np.inf, _gauss(diff, bandwidth))
    k = np.exp(s - s.max(axis=-1, keepdims=True))
    return (k / k.sum(axis=-1, keepdims=True)) @ np.asarray(y_train, float)


def _nearest_fallback(x_query, x_train, y_train, bandwidth):
    """The unstable estimator with each NaN row (all kernel values underflowed)
    patched to the y of the nearest training point."""
    with np.errstate(invalid="ignore"):
        est = _gaussian_nw(_gauss, stable=False)(
            x_query, x_train, y_train, bandwidth
        )
    diff = (
        np.asarray(x_query, float)[:, None]
        - np.asarray(x_train, float)[None, :]
    )
    return np.where(
        np.isfinite(est),
        est,
        np.asarray(y_train, float)[np.argmin(np.abs(diff), axis=1)],
    )


NADARAYA_WATSON_MISTAKES = [
    Mistake(
        "not_normalised",
        "the kernel values are never divided by their sum over the training "
        "points",
        "f(x) = sum_i K(x, x_i) y_i / sum_j K(x, x_j): without the division "
        "it is not an average",
        _gaussian_nw(_gauss, normalise=False, stable=False),
    ),
    Mistake(
        "bandwidth_not_squared",
        "the kernel divides by 2 h instead of 2 h^2",
        "the Gaussian kernel is exp(-(x - x_i)^2 / (2 h^2)); h has the units "
        "of x, so it is squared",
        _gaussian_nw(lambda diff, h: -(diff**2) / (2 * h)),
    ),
    Mistake(
        "no_half",
        "the kernel is exp(-(x - x_i)^2 / h^2), without the factor 1/2",
        "with exp(-(x - x_i)^2 / (2 h^2)) the bandwidth h is the kernel's "
        "standard deviation",
        _gaussian_nw(lambda diff, h: -(diff**2) / h**2),
    ),
    Mistake(
        "wrong_axis",
        "the weights are normalised over the query points instead of the "
        "training points",
        "for each query x, the weights K(x, x_i) must sum to 1 over the "
        "training points i",
        _gaussian_nw(_gauss, axis=0),
    ),
    Mistake(
        "wrong_axis_row_shift",
        "each query's largest log-kernel value was subtracted (as in a stable "
        "softmax), "
        "but the weights are then normalised over the query points instead of "
        "the training points",
        "for each query x, the weights K(x, x_i) must sum to 1 over the "
        "training points i: sum along the "
        "same axis as the maximum (axis=-1, keepdims=True), since the shift "
        "cancels only within a query's row",
        _gaussian_nw(_gauss, axis=0, shift_axis=-1),
    ),
    Mistake(
        "underflow",
        "every kernel value underflows to 0 for a small bandwidth, giving 0 / "
        "0 = NaN",
        "subtract, for each query, the largest log-kernel value before "
        "exponentiating: the common "
        "factor cancels in the ratio (as in a stable softmax)",
        _gaussian_nw(_gauss, stable=False),
    ),
    Mistake(
        "underflow_patched",
        "every kernel value underflows to 0 for a small bandwidth, and the 0 "
        "/ 0 = NaN "
        "was patched to 0 (np.nan_to_num, or an epsilon in the denominator) "
        "instead of avoided: the estimate there is 0, not the nearest "
        "training point's y",
        "subtract, for each query, the largest log-kernel value before "
        "exponentiating: the largest kernel "
        "value is then exactly 1, the sum is at least 1, and nothing needs "
        "patching",
        lambda *args: np.nan_to_num(_gaussian_nw(_gauss, stable=False)(*args)),
    ),
    Mistake(
        "nearest_fallback",
        "every kernel value underflows to 0 for a small bandwidth, and the 0 "
        "/ 0 = NaN "
        "was replaced by the nearest training point's y: that is the limit h "
        "-> 0, not the estimate at this h, "
        "and it is wrong wherever two training points are almost equally near",
        "subtract, for each query, the largest log-kernel value before "
        "exponentiating: the kernel values "
        "that underflowed become ratios exp(s_i - max s), which keep the "
        "weight of every point that is almost "
        "as near as the nearest",
        _nearest_fallback,
    ),
    Mistake(
        "scores_clipped",
        "where every kernel value of a row underflows, that row's estimate "
        "is the plain mean of y_train: the log-kernel values clipped from "
        "below (np.maximum(s, -700) or np.clip) instead of shifted, which "
        "makes every weight of the row equal, or the 0 / 0 = NaN patched to "
        "the mean of y_train; both give these numbers",
        "subtract each query's largest log-kernel value (keepdims=True along "
        "the training points) before exponentiating: a shift keeps the "
        "differences between the values, which are what the weights depend "
        "on; a clip or a patch to the mean erases them",
        lambda *a: _gaussian_nw(
            lambda diff, h: np.maximum(_gauss(diff, h), -700.0), stable=False
        )(*a),
    ),
    Mistake(
        "global_shift",
        "the largest log-kernel value of the whole matrix is subtracted, not "
        "each query's own",
        "a query far from every training point has all its kernel values far "
        "below the global maximum, and "
        "they underflow to 0 / 0: subtract each row's maximum (keepdims=True "
        "along the training points)",
        _gaussian_nw(_gauss, shift_axis=None),
    ),
    Mistake(
        "column_shift",
        "each training point's largest log-kernel value over the queries "
        "(axis 0) is subtracted, not each query's own: the shift differs "
        "from one training point to the next, so it no longer cancels in a "
        "query's ratio",
        "a shift cancels only if it is the same for every term of one "
        "query's sum: subtract each query's maximum over the training "
        "points (axis=-1, keepdims=True), the axis you normalise over",
        _gaussian_nw(_gauss, shift_axis=0),
    ),
    Mistake(
        "leave_one_out",
        "a training point at the query's own position is left out of the "
        "sum (the leave-one-out estimate, used to choose a bandwidth), not "
        "weighted with kernel value 1",
        "the estimate at x averages every training point, the one at x "
        "included: exp(0) = 1 is its largest weight",
        _leave_one_out,
    ),
    Mistake(
        "laplace_kernel",
        "the kernel is exp(-|x - x_i| / h) (the Laplace kernel), not the "
        "Gaussian",
        "the Gaussian kernel uses the squared distance: exp(-(x - x_i)^2 / "
        "(2 h^2))",
        _gaussian_nw(lambda diff, h: -np.abs(diff) / h),
    ),
]


def nadaraya_watson_cases() -> list[Case]:
    rng = _rng(64)
    x_train = np.sort(rng.uniform(0, 1, 8))
    y_train = np.sin(2 * np.pi * x_train) + 0.1 * rng.normal(size=8)
    x_query = np.linspace(0.05, 0.95, 5)
    grid = np.arange(0.0, 1.01, 0.1)
    return [
        Case(
            "5 queries, 8 training points, bandwidth h = 0.3",
            (x_query, x_train, y_train, 0.3),
        ),
        # two queries between training points and three on them: a solution
        # that leaves out a training point at the query's own position
        # (leave-one-out) differs only where a query sits on a point
        Case(
            "a smooth fit, h = 2.0, three queries on training points",
            (
                np.concatenate([x_query[:2], x_train[2:5]]),
                x_train,
                y_train,
                2.0,
            ),
        ),
        # off the midpoints (0.04 from one point, 0.06 from the next): no
        # near-tie that float32 inputs could flip
        Case(
            "queries between training points spaced 0.1 apart, h = 0.001 "
            "(every exp underflows)",
            (grid[:-1] + 0.04, grid, np.cos(grid), 0.001),
        ),
        Case(
            "a single training point", (x_query, x_train[:1], y_train[:1], 0.3)
        ),
        Case(
            "one query far from every training point, one close, h = 0.005 "
            "(rows at different levels)",
            (
                np.array([0.3, 0.5]),
                np.array([0.0, 0.52, 1.0]),
                np.array([1.0, 2.0, 3.0]),
                0.005,
            ),
        ),
        # log-kernels -941.9 and -943.4: both underflow, yet the farther point
        # keeps weight 1 / (1 + e^1.47) = 0.19, so the nearest point's y (the
        # limit h -> 0) is not the estimate (20.19 here, not 20). At h =
        # 0.0009, below every other case's bandwidth and below 1e-3, so that a
        # solution that returns the nearest y below some bandwidth (a threshold
        # of 1e-3 included) and the estimate above it is named as the
        # nearest-point patch (a near-tie at a larger h would be right in such
        # a solution and keep the diagnosis from being named). The inputs are
        # dyadic (0.5 -+ 5/128, + 2^-15), exact in float32; scores of -942
        # still carry a float32 rounding of about 1e-4, which moves a right
        # float32 answer by up to about 2e-5 (renormalised weights) or 6e-4
        # (weights exp(s - logsumexp(s)) used as they are, summing to about
        # 1 - 3e-5): the responses are offset to 20, so that the tolerance
        # (relative 1e-4: 2e-3 here) admits both.
        Case(
            "every exp underflows, two training points almost equally near "
            "(at 0.0390625 and 0.0390930), h = 0.0009",
            (
                np.array([0.5]),
                np.array([0.5 - 5 / 128, 0.5 + 5 / 128 + 2.0**-15]),
                np.array([20.0, 21.0]),
                0.0009,
            ),
        ),
    ]


def check_nadaraya_watson(fn) -> None:
    """Check ``fn(x_query, x_train, y_train, bandwidth)`` returns the
    Gaussian-kernel estimate.

    x_query: (n_q,), x_train: (n,), y_train: (n,) 1-D arrays -> (n_q,); the
    kernel is ``exp(-(x - x_i)^2 / (2 h^2))`` with ``h = bandwidth``.
    """

    def reference(x_query, x_train, y_train, bandwidth):
        est, _ = nadaraya_watson(
            np.asarray(x_query)[:, None],
            np.asarray(x_train)[:, None],
            np.asarray(y_train)[:, None],
            bandwidth=bandwidth,
        )
        return est[:, 0]

    run_checks(
        "Nadaraya-Watson",
        fn,
        nadaraya_watson_cases(),
        reference,
        NADARAYA_WATSON_MISTAKES,
        # relative 1e-4: a right float32 answer that does not renormalise its
        # weights (exp(s - logsumexp(s)), summing to 1 - 3e-5 when the scores
        # are -942) is off by that share of the response in the last case
        compare=lambda got, want: same(got, want, rtol=1e-4),
        postprocess=_first,
    )


# --- causal linear attention in chunks (hard) --------------------------------


def _causal_chunks(
    phi_q,
    phi_k,
    v,
    chunk_size,
    state_first=False,
    normaliser="causal",
    diagonal="inclusive",
    carry=True,
    ragged=True,
    normalise=True,
    masked_normaliser=True,
):
    """Chunked causal linear attention with switchable mistakes:
    ``state_first`` adds the chunk to the state before reading it,
    ``normaliser`` "causal" or "all" (z over every key), ``diagonal``
    "inclusive", "strict" (j < i), "next" (j <= i + 1), "upper" (j >= i,
    np.triu) or "none" (no mask inside the chunk),
    ``carry`` False resets the state per chunk, "last" keeps in it only the
    chunk before (assigned, not added), ``ragged`` False leaves a
    last, partial chunk at zero, ``masked_normaliser`` False takes the
    normaliser's chunk part from the unmasked C x C weights."""
    dtype = _result_dtype(phi_q, phi_k, v)
    phi_q, phi_k, v = (np.asarray(a, float) for a in (phi_q, phi_k, v))
    n = phi_q.shape[-2]
    out = np.zeros(phi_q.shape[:-1] + v.shape[-1:])
    s = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1], v.shape[-1]))
    z = np.zeros(phi_k.shape[:-2] + (phi_k.shape[-1],))
    offset = {"inclusive": 0, "strict": -1, "next": 1}.get(diagonal)
    upper = diagonal == "upper"
    stop = n if ragged else n - n % chunk_size
    for start in range(0, stop, chunk_size):
        sl = slice(start, min(start + chunk_size, n))
        fq, fk, vc = phi_q[..., sl, :], phi_k[..., sl, :], v[..., sl, :]
        w = full = fq @ _t(fk)
        if offset is not None:
            w = np.tril(w, offset)
        if upper:
            w = np.triu(w)
        if not carry:
            s, z = s * 0, z * 0
        if state_first:
            z = z + fk.sum(axis=-2)
        if state_first is True:
            s = s + _t(fk) @ vc
        num = w @ vc + fq @ s
        den = (w if masked_normaliser else full).sum(axis=-1)
        den = den + (fq @ z[..., None])[..., 0]
        if state_first is False:
            z = z + fk.sum(axis=-2)
        if state_first is not True:
            s = s + _t(fk) @ vc
        if carry == "last":
            # the state holds only this chunk, for the next one
            s, z = _t(fk) @ vc, fk.sum(axis=-2)
        if normaliser == "all":
            den = fq @ phi_k.sum(axis=-2)[..., :, None]
            den = den[..., 0]
        out[..., sl, :] = num / den[..., None] if normalise else num
    return out.astype(dtype)


def _result_dtype(*arrays):
    """float32 when every input is float32 (or narrower), else float64: the
    precision an answer is held to."""
    dtype = np.result_type(*(np.asarray(a) for a in arrays), np.float32)
    return np.float32 if dtype == np.float32 else np.float64


def _causal_quadratic(phi_q, phi_k, v, chunk_size=None):
    """The reference: the masked quadratic form, computed in float64 and
    returned in the inputs' precision (float32 inputs: float32), which sets
    the tolerance of the comparison (:func:`_same_loose`)."""
    dtype = _result_dtype(phi_q, phi_k, v)
    phi_q, phi_k, v = (np.asarray(a, np.float64) for a in (phi_q, phi_k, v))
    w = np.tril(phi_q @ _t(phi_k))
    return ((w @ v) / w.sum(axis=-1, keepdims=True)).astype(dtype)


def _causal_epsilon(phi_q, phi_k, v, chunk_size=None, eps=1e-6):
    """The epsilon_in_denominator mistake: the masked quadratic form with
    ``eps`` added to each denominator, as the linear-attention code of
    Katharopoulos et al. does (eps = 1e-6)."""
    dtype = _result_dtype(phi_q, phi_k, v)
    phi_q, phi_k, v = (np.asarray(a, np.float64) for a in (phi_q, phi_k, v))
    w = np.tril(phi_q @ _t(phi_k))
    return ((w @ v) / (w.sum(axis=-1, keepdims=True) + eps)).astype(dtype)


def _causal_float32(phi_q, phi_k, v, chunk_size=None):
    """The float32_arithmetic mistake: right values, computed in float32."""
    phi_q, phi_k, v = (np.asarray(a, np.float32) for a in (phi_q, phi_k, v))
    w = np.tril(phi_q @ _t(phi_k))
    return (w @ v) / w.sum(axis=-1, keepdims=True)


CHUNKED_CAUSAL_MISTAKES = [
    Mistake(
        "state_includes_chunk",
        "the chunk's own keys are added to the running state before the "
        "chunk reads it: every query sees the later keys of its chunk, and "
        "its earlier ones twice",
        "read the state S, z of the chunks before, then add this chunk's "
        "phi(K_c)^T V_c and sum of phi(K_c) to it, after its outputs",
        lambda *a: _causal_chunks(*a, state_first=True),
    ),
    Mistake(
        "normaliser_not_causal",
        "the normaliser sums the features of every key, later ones included",
        "the denominator of query i is phi(q_i) . z_i with z_i the sum of "
        "phi(k_j) over j <= i only: the state's part plus the row sum of the "
        "chunk's masked weights",
        lambda *a: _causal_chunks(*a, normaliser="all"),
    ),
    Mistake(
        "intra_chunk_not_causal",
        "inside a chunk each query sees the later keys of its own chunk: the "
        "weights phi(q_i) . phi(k_j) are not masked, or (the same values) "
        "the chunk's keys were added to the state S, z before the chunk read "
        "it, with no separate term for the chunk",
        "a query may use only the keys j <= i: read S, z of the chunks "
        "before, add the chunk's own keys through its C x C weights masked "
        "with np.tril (numerator and normaliser), and add the chunk to S, z "
        "only after its outputs",
        lambda *a: _causal_chunks(*a, diagonal="none"),
    ),
    Mistake(
        "normaliser_not_masked",
        "the numerator is masked inside the chunk, but the normaliser sums "
        "the chunk's unmasked weights: each query divides by the weights of "
        "the later keys of its chunk too",
        "apply the causal mask once, to the chunk's C x C weights w, and take "
        "both the numerator w @ V_c and the normaliser w.sum(-1) from the "
        "masked w",
        lambda *a: _causal_chunks(*a, masked_normaliser=False),
    ),
    Mistake(
        "diagonal_excluded",
        "inside a chunk the mask keeps j < i only: a query does not see its "
        "own key",
        "causal attention includes j = i: np.tril(w), not np.tril(w, -1)",
        lambda *a: _causal_chunks(*a, diagonal="strict"),
    ),
    Mistake(
        "mask_one_above_diagonal",
        "inside a chunk the mask keeps j <= i + 1: each query but a chunk's "
        "last sees the next key of its chunk",
        "causal attention keeps j <= i: np.tril(w) (offset 0), not "
        "np.tril(w, 1)",
        lambda *a: _causal_chunks(*a, diagonal="next"),
    ),
    Mistake(
        "upper_triangle_mask",
        "inside a chunk the mask keeps j >= i (np.triu): each query sees "
        "its own key and the later keys of its chunk, not the earlier ones",
        "causal attention keeps the keys at or before the query, the lower "
        "triangle of the chunk's C x C weights: np.tril(w), not np.triu(w)",
        lambda *a: _causal_chunks(*a, diagonal="upper"),
    ),
    Mistake(
        "state_reset",
        "the state is reset at every chunk: each query sees only the keys of "
        "its own chunk",
        "carry S and z from chunk to chunk: they sum over every earlier "
        "chunk, which is what makes the cost linear and the result exact",
        lambda *a: _causal_chunks(*a, carry=False),
    ),
    Mistake(
        "state_last_chunk_only",
        "the state holds only the chunk just before (S = phi(K_c)^T V_c "
        "assigned, not added): a query sees its own chunk and the one before "
        "it, not the earlier ones (right with two chunks, wrong from the "
        "third)",
        "accumulate: S = S + phi(K_c)^T V_c and z = z + phi(K_c).sum(-2), so "
        "that the state sums over every earlier chunk",
        lambda *a: _causal_chunks(*a, carry="last"),
    ),
    Mistake(
        "ragged_chunk_dropped",
        "the last chunk, shorter than chunk_size when it does not divide n, "
        "is never computed",
        "loop over range(0, n, chunk_size) and slice to min(start + "
        "chunk_size, n): the last chunk has n % chunk_size positions",
        lambda *a: _causal_chunks(*a, ragged=False),
    ),
    Mistake(
        "no_normaliser",
        "the output is never divided by the normaliser phi(q_i) . z_i",
        "divide each row by the sum of its causal weights: the masked row sum "
        "inside the chunk plus phi(q_i) . z of the chunks before",
        lambda *a: _causal_chunks(*a, normalise=False),
    ),
    Mistake(
        "normaliser_state_includes_chunk",
        "the normaliser's state z is advanced by the chunk's keys before the "
        "chunk reads it (the numerator's S only after): each denominator "
        "counts the later keys of its chunk, and its earlier ones twice",
        "read S and z of the chunks before, then add this chunk's "
        "phi(K_c)^T V_c to S and the sum of its phi(K_c) to z, both after "
        "its outputs",
        lambda *a: _causal_chunks(*a, state_first="z"),
    ),
    Mistake(
        "epsilon_in_denominator",
        "the denominators have 1e-6 added (as in Katharopoulos et al.'s "
        "code): the values differ from the exact ratio by about 1e-6 / "
        "denominator, far beyond float64's precision, which this exercise "
        "checks",
        "divide by the sum itself: with positive features every denominator "
        "is positive, so the exact ratio needs no epsilon",
        _causal_epsilon,
    ),
    Mistake(
        "float32_arithmetic",
        "the values agree with the right formula only to about float32's "
        "precision (about 1e-7 of the outputs, where float64 arithmetic "
        "agrees to about 1e-13): the usual cause is arithmetic in float32; a "
        "small number added to the denominators does the same",
        "keep the inputs' precision: do not convert float64 inputs to "
        "float32 (np.float32, torch.tensor(..., dtype=torch.float32), "
        "torch.zeros without a dtype); float32 inputs may stay float32; and "
        "divide by the exact sums, with no epsilon",
        _causal_float32,
    ),
]

CHUNKED_CAUSAL_COST_MISTAKES = [
    Mistake(
        "state_per_position",
        "the values are right, but your function's peak memory reached the "
        "size of a state per position in float64 (n x d_k x d_v numbers, "
        "what the prefix sums of phi(k_j) v_j^T for every j take): O(n d_k "
        "d_v) memory, where the chunked form needs one d_k x d_v state (or "
        "one per chunk, n / C of them)",
        "keep one running S (d_k x d_v) and z (d_k); inside a chunk use its "
        "C x C masked weights instead of per-position prefix sums",
        _causal_chunks,
    ),
    Mistake(
        "quadratic_weights",
        "the values are right, but your function formed the n x n masked "
        "weights: the quadratic form, at the cost the chunked form avoids",
        "form only the C x C weights of one chunk at a time, and carry the "
        "earlier chunks in the state S, z",
        _causal_chunks,
    ),
    Mistake(
        "chunk_size_ignored",
        "the values are right, but the chunk size is ignored: your function "
        "advances one position per step whatever chunk_size is (with chunks "
        "of 64 it still executes at least one line of Python per position), "
        "so its steps do not fall when the chunks grow",
        "form the chunk's C x C masked weights and advance the state once per "
        "chunk: with chunk_size = 64 that is one step of the loop per 64 "
        "positions",
        _causal_chunks,
    ),
    Mistake(
        "no_running_state",
        "the values are right, but your function keeps no running state: "
        "each chunk re-reads all earlier keys (a loop over the earlier "
        "chunks, or the chunk's queries against every key before them), so "
        "its work is O(n^2), although it stores only one chunk's weights at "
        "a time",
        "after a chunk's outputs, add its phi(K_c)^T V_c and the sum of its "
        "phi(K_c) to one state S (d_k x d_v) and z (d_k); the next chunk "
        "reads the whole past from S and z, in work that does not grow with "
        "n",
        _causal_chunks,
    ),
    Mistake(
        "earlier_states_resummed",
        "the values are right, but with small chunks your function's time "
        "grew with the square of the number of chunks: each chunk does work "
        "that grows with the number of chunks before it, such as keeping "
        "every earlier chunk's state and adding them all up again ((n / "
        "C)^2 additions of d_k x d_v states in all, which chunks of 64 hide "
        "and chunks of 4 do not)",
        "keep one running S (d_k x d_v) and z (d_k): add each chunk's "
        "phi(K_c)^T V_c and the sum of its phi(K_c) to them once, after the "
        "chunk's outputs, and drop the chunk's own state",
        _causal_chunks,
    ),
    Mistake(
        "chunk_size_fixed",
        "the values are right, but your function does not use chunk_size: "
        "its work or memory did not change with the chunk size asked for, so "
        "it computes with chunks of a size of its own (a chunk size written "
        "into the code, or a cap or a floor on it)",
        "take the chunks' length from the chunk_size argument; a chunk_size "
        "of n or more means one chunk of all n positions",
        _causal_chunks,
    ),
    Mistake(
        "package_function_called",
        "the values are right, but your function calls the package's "
        "causal linear attention (attnbook.linear_attention), which computes "
        "the answer: its own lines neither loop over the chunks nor form "
        "their weights, and the checker counts only the lines of Python of "
        "your own code, not the package's loop, so it cannot see the chunk "
        "size used; calling the package is not the exercise",
        "write the loop over the chunks yourself: each chunk's C x C masked "
        "weights, then its keys added to one running S (d_k x d_v) and z "
        "(d_k); the package's attention_from_features is shown after the "
        "solution",
        _causal_chunks,
    ),
]


def chunked_causal_cases() -> list[Case]:
    rng = _rng(1212)

    def feats(*shape):
        # elu(x) + 1 of normal scores: positive features
        return elu_feature_map(rng.normal(size=shape))

    return [
        Case(
            "n = 8, m = 4, d_v = 3, chunk_size = 4 (two full chunks)",
            (feats(8, 4), feats(8, 4), rng.normal(size=(8, 3)), 4),
        ),
        Case(
            "n = 10, chunk_size = 4 (the last chunk has 2 positions)",
            (feats(10, 3), feats(10, 3), rng.normal(size=(10, 2)), 4),
        ),
        Case(
            "n = 5, chunk_size = 8 (one chunk, shorter than chunk_size)",
            (feats(5, 4), feats(5, 4), rng.normal(size=(5, 2)), 8),
        ),
        Case(
            "n = 7, chunk_size = 1 (the recurrence, one position per chunk)",
            (feats(7, 3), feats(7, 3), rng.normal(size=(7, 2)), 1),
        ),
        Case(
            "a single position (n = 1), chunk_size = 4",
            (feats(1, 4), feats(1, 4), rng.normal(size=(1, 3)), 4),
        ),
        Case(
            "a batch of 2 x 3 heads, n = 11, m = 4, d_v = 2, chunk_size = 3",
            (
                feats(2, 3, 11, 4),
                feats(2, 3, 11, 4),
                rng.normal(size=(2, 3, 11, 2)),
                3,
            ),
        ),
        Case(
            "float32 inputs, n = 13, m = 5, d_v = 4, chunk_size = 5",
            (
                feats(13, 5).astype(np.float32),
                feats(13, 5).astype(np.float32),
                rng.normal(size=(13, 4)).astype(np.float32),
                5,
            ),
        ),
    ]


def _same_loose(got, expected):
    """Agreement to the precision of ``expected``: the reference (or a
    mistake) returns float32 on float32 inputs, where a float32 answer is
    right to ~1e-6 of the outputs, and float64 otherwise, where float64
    arithmetic agrees to ~1e-13 and float32 arithmetic (~1e-7) does not."""
    expected = as_array(expected)
    finite = np.abs(expected)
    finite = finite[np.isfinite(finite)]
    scale = max(float(finite.max(initial=0.0)), 1.0)
    if expected.dtype == np.float32:
        return same(got, expected, rtol=1e-4, atol=1e-5 * scale)
    return same(got, expected, rtol=1e-9, atol=1e-9 * scale)


def check_chunked_causal_linear_attention(fn) -> None:
    """Check ``fn(phi_q, phi_k, v, chunk_size)`` computes causal linear
    attention from features, chunk by chunk.

    phi_q, phi_k: (..., n, m) non-negative features, v: (..., n, d_v),
    chunk_size a positive int -> (..., n, d_v), row i equal to ``sum_{j <= i}
    (phi_q_i . phi_k_j) v_j / sum_{j <= i} phi_q_i . phi_k_j``. The values are
    compared with the masked quadratic form, computed in float64, on cases with
    a last chunk shorter than ``chunk_size``, one chunk longer than n, chunks
    of one, n = 1, batches and float32 inputs: to float64's precision (rtol
    1e-9) on float64 inputs, so that an answer computed in float32 is named,
    and to float32's on float32 inputs. Then the peak memory of one long case
    (n = 4096, m = d_v = 16, chunk_size = 16) is measured: a peak of at least n
    states in float64 (the prefix sums of every S_i) or of the n x n weights is
    rejected, though the values are right. The states at every chunk boundary
    (n / C of them, the chunkwise-parallel form) stay far below it, and are
    accepted. An answer without a running state, whose chunks re-read all
    earlier keys, does O(n^2) work: where the answer runs torch's matrix
    products, their flops at chunk_size = 64 are counted on n = 512 and n =
    4096 (:func:`flop_growth`, a count), and a growth of 16 times or more (a
    running state: 8) is rejected; for every answer the CPU time at chunk_size
    = 64 is compared on n = 512 and n = 8192 (a ratio of process times,
    :func:`work_growth`), and a growth above 60 times (a running state: about
    16; re-reading: up to 256) is rejected. torch's overhead per call can hide
    the quadratic part from the time ratio, which is why torch answers are
    counted. Then the lines of Python it executes on n = 1024 with
    chunk_size = 64 are counted (:func:`python_lines`; a count, the same
    under any load), at m = d_v = 16 and again at 32: an answer that advances
    one position per step (a loop, a comprehension, itertools.accumulate)
    executes at least one line per position, as many at either width, and is
    rejected; a loop over chunks, whatever it does inside a chunk, and an
    answer vectorised over the chunks execute far fewer, and an input check
    written in Python executes one line per element, twice as many at twice
    the width, and is let through (the lines that do not grow with the
    widths, 2 L(16) - L(32), are those counted per position, so a check does
    not hide a recurrence either). Then the chunk size must be used
    (:func:`_check_chunk_size_used`): from chunks of 1024 to one of 2048 the
    steps or the memory must change, and from chunks of 1 to 2 too; a size
    written into the code, a cap of at most 1024 or a floor are named, and
    an answer that calls the package's linear attention
    (:func:`package_answers_called`), whose loop runs in attnbook and is not
    counted as the reader's, is named as such.
    Last, re-summing the stored states of all
    earlier chunks at every chunk (work (n / C)^2 m d_v) is small at C = 64:
    the time step is taken again at chunk_size = 4 (``CHUNK_SMALL_SIZE``, 128
    and 2048 chunks), where such an answer grows above 60 times (a running
    state: 16-34) and is named.
    """
    __tracebackhide__ = True
    run_checks(
        "chunked causal linear attention",
        fn,
        chunked_causal_cases(),
        _causal_quadratic,
        CHUNKED_CAUSAL_MISTAKES,
        compare=_same_loose,
        postprocess=_first,
        quiet=True,
    )
    _check_chunked_memory(fn)
    flops = _check_chunked_flops(fn)
    _check_chunked_length(fn)
    _check_chunked_work(fn)
    _check_chunk_size_used(fn)
    _check_chunked_length(fn, CHUNK_SMALL_SIZE)
    n_small, n_large, limit = CHUNK_LENGTH_STEP
    counted = ""
    if flops is not None:
        f_small, f_large, _ = CHUNK_FLOP_STEP
        counted = (
            f", the flops of its torch matrix products grew {flops:.1f} "
            f"times from n = {f_small} to n = {f_large} (a running state: "
            f"{f_large // f_small})"
        )
    print(
        "Correct: chunked causal linear attention passes all "
        f"{len(chunked_causal_cases())} cases, on n = 4096 its memory "
        "held no state per position and no n x n matrix, its CPU time grew "
        f"less than {limit:.0f} times from n = {n_small} to n = {n_large}, "
        f"with chunks of {CHUNK_LENGTH_SIZE} and of {CHUNK_SMALL_SIZE} "
        f"(every chunk against all earlier keys: {(n_large // n_small) ** 2})"
        f"{counted}, with chunks of 64 it did not advance one position "
        "per step, and its steps or its memory changed with the chunk size "
        "at the sizes probed (1 against 2, and 1024 against 2048)."
    )


def _check_chunked_memory(fn, n=4096, m=16, d_v=16, chunk_size=16) -> None:
    """Reject an answer that stores n states (n m d_v numbers) or n x n
    weights.

    An answer that reaches this check has passed the values in float64's
    precision, so it computes in float64: n states take n m d_v float64
    numbers (8 MiB here), a sixth of the n x n weights in float32 (64 MiB),
    and a peak of at least that is called a state per position (storing them
    takes that much, a cumsum's temporary twice). What right answers hold
    stays far below: one input is 512 KiB in float64, one chunk's weights
    against every key (C x n) 512 KiB, and the states at all n / C chunk
    boundaries 512 KiB, so the chunkwise-parallel form (all chunks at once,
    padded copies of the inputs, the states of every chunk, several
    full-length temporaries) peaked at about 4.1 MiB. Measured here: the
    book's loop 0.5 MiB, the chunkwise-parallel forms 2.1 and 4.1 MiB (in
    torch 0.5 MiB), the prefix sums of every S_i 16 MiB, and in torch one
    allocation of exactly the limit, the n states themselves.
    """
    from ..bench import format_bytes
    from ._framework import ExerciseError

    __tracebackhide__ = True
    rng = _rng(1213)
    phi_q, phi_k = (elu_feature_map(rng.normal(size=(n, m))) for _ in "qk")
    v = rng.normal(size=(n, d_v))
    expected = _causal_quadratic_chunks(phi_q, phi_k, v, chunk_size)
    # numpy's arrays, and torch's allocations whatever the answer returns
    out, peak = peak_memory_with_torch(fn, phi_q, phi_k, v, chunk_size)
    case = f"n = {n}, m = d_v = {m}, chunk_size = {chunk_size} (memory)"
    # the n x n weights in float32, the n states in float64
    square, states = n * n * 4, n * m * d_v * 8
    mistake = None
    if peak >= square // 2:
        mistake = CHUNKED_CAUSAL_COST_MISTAKES[1]
    elif peak >= states:
        mistake = CHUNKED_CAUSAL_COST_MISTAKES[0]
    if mistake is not None:
        chunk_states = format_bytes(states // chunk_size)
        raise ExerciseError(
            "chunked causal linear attention",
            case,
            f"peak memory {format_bytes(peak)}, at least the limit of "
            f"{format_bytes(states)}: n states of d_k x d_v in float64 (n x "
            f"n in float32: {format_bytes(square)}); the states of all "
            f"{n // chunk_size} chunks take {chunk_states}",
            mistake=mistake,
        )
    if not _same_loose(_first(out), expected):
        raise ExerciseError(
            "chunked causal linear attention",
            case,
            "values differ from the reference on a long sequence",
        )


# The lengths compared at a fixed chunk size, and the growth of the CPU time
# above which the work is called quadratic: 16 times the length is 16 times
# the work of a running state (less where fixed costs weigh at the short
# length), and 256 times that of an answer whose chunks re-read all earlier
# keys. Measured here on a loaded 2-core AMD EPYC (load average 2.4-6, m =
# d_v = 16, chunk_size = 64, the fastest of five runs, three tries each): over
# 512 -> 8192 the right answers of the tests grew 9-22 times, the per-position
# recurrence 12-18, a double loop over chunks without a state 138-264, a
# chunk's queries against all earlier keys 158-273 (float64) and 162-186
# (float32). Over 1024 -> 8192 the gap was narrower: 5-13 against 30-234.
CHUNK_LENGTH_STEP = (512, 8192, 60.0)
CHUNK_LENGTH_SIZE = 64
CHUNK_LENGTH_TRIES = 3
# The same step at chunks of 4, where the chunks are many (128 and 2048):
# work per chunk that grows with the chunks before it, such as re-summing
# every earlier chunk's stored state ((n / C)^2 additions of m x d_v
# states), is small at chunks of 64 and dominates here. Measured on a quiet
# 2-core AMD EPYC (load 0.4, the fastest of five runs): the right answers of
# the tests grew 16-34 times (the chunkwise-parallel forms most, their
# cumulative sums over 2048 states leaving the cache), answers that re-sum
# the stored states 178-314 times (a Python sum over a list, np.stack,
# torch.stack, an in-place loop). At chunks of 8 the gap was narrower: 15-17
# against 79-152. Answers whose chunks re-read the earlier keys are named at
# chunks of 64 first: at chunks of 4 one run takes seconds.
CHUNK_SMALL_SIZE = 4


# The lengths of the count of torch flops at chunks of 64, and the growth at
# which the chunks are called to re-read all earlier keys: a running state
# grows 8 times at 8 times the length (in torch: 8.0), a chunk that rebuilds
# S and z from every earlier key about 26 times (in torch: 25.8; 7.8 from 512
# to 2048, too close to linear work's 4 to tell them apart).
CHUNK_FLOP_STEP = (512, 4096, 16.0)


def _chunked_prefixes(seed, n_large, m, d_v, chunk_size=None):
    """``make(n)``: fresh copies of the first n positions of one draw of
    features (n_large, m) and values (n_large, d_v), with chunks of
    ``chunk_size`` (default ``CHUNK_LENGTH_SIZE``), the arguments of an
    answer."""
    if chunk_size is None:
        chunk_size = CHUNK_LENGTH_SIZE
    rng = _rng(seed)
    phi_q, phi_k = (
        elu_feature_map(rng.normal(size=(n_large, m))) for _ in "qk"
    )
    v = rng.normal(size=(n_large, d_v))

    def make(n):
        return (
            phi_q[:n].copy(),
            phi_k[:n].copy(),
            v[:n].copy(),
            chunk_size,
        )

    return make


def _check_chunked_flops(fn, m=16, d_v=16) -> float | None:
    """Reject a torch answer whose counted flops at a fixed chunk size grow
    quadratically with n: one without a running state. The growth, or None
    for an answer that runs no torch matrix product."""
    from ._framework import ExerciseError

    __tracebackhide__ = True
    n_small, n_large, limit = CHUNK_FLOP_STEP
    make = _chunked_prefixes(1216, n_large, m, d_v)
    growth = flop_growth(fn, make, n_small, n_large)
    if growth is not None and growth >= limit:
        ratio = n_large // n_small
        raise ExerciseError(
            "chunked causal linear attention",
            f"n = {n_small} and n = {n_large}, m = d_v = {m}, "
            f"chunk_size = {CHUNK_LENGTH_SIZE} (flops counted)",
            f"at {ratio} times the length your torch matrix products did "
            f"{growth:.1f} times the flops (a running state: {ratio} times; "
            f"every chunk against all earlier keys: up to {ratio**2})",
            mistake=CHUNKED_CAUSAL_COST_MISTAKES[3],
        )
    return growth


def _check_chunked_length(
    fn, chunk_size=CHUNK_LENGTH_SIZE, m=16, d_v=16
) -> None:
    """Reject an answer whose work at a fixed chunk size grows
    quadratically with n: at chunks of 64, one whose chunks re-read all
    earlier keys; at chunks of 4 (``CHUNK_SMALL_SIZE``), one whose work per
    chunk grows with the chunks before it (the stored states re-summed)."""
    from ._framework import ExerciseError

    __tracebackhide__ = True
    n_small, n_large, limit = CHUNK_LENGTH_STEP
    make = _chunked_prefixes(1215, n_large, m, d_v, chunk_size)

    # A busy machine can slow one run of the long sequence: a growth above
    # the limit is measured again, up to CHUNK_LENGTH_TRIES times in all,
    # and only the smallest counts. Quadratic work exceeds the limit in every
    # try.
    growth = work_growth(fn, make, n_small, n_large, repeats=5)
    for _ in range(CHUNK_LENGTH_TRIES - 1):
        if growth <= limit:
            break
        growth = min(
            growth, work_growth(fn, make, n_small, n_large, repeats=5)
        )
    if growth <= limit:
        return
    ratio = n_large // n_small
    if chunk_size == CHUNK_LENGTH_SIZE:
        quadratic = f"every chunk against all earlier keys: {ratio**2}"
        mistake = CHUNKED_CAUSAL_COST_MISTAKES[3]
    else:
        quadratic = (
            f"{n_small // chunk_size} and then {n_large // chunk_size} "
            "chunks, each re-summing the states of all chunks before it: "
            f"up to {ratio**2}"
        )
        mistake = CHUNKED_CAUSAL_COST_MISTAKES[4]
    raise ExerciseError(
        "chunked causal linear attention",
        f"n = {n_small} and n = {n_large}, m = d_v = {m}, "
        f"chunk_size = {chunk_size} (time)",
        f"at {ratio} times the length your function took {growth:.0f} "
        f"times the CPU time (a running state: about {ratio} times; "
        f"{quadratic})",
        mistake=mistake,
    )


def _check_chunk_size_used(fn) -> None:
    """Reject an answer that computes with chunks of its own size, whatever
    ``chunk_size`` says: a size written into the code, a cap on it or a
    floor. The values are no guide: they do not depend on the chunk size.
    Two probes, each comparing two chunk sizes:

    - large chunks (:func:`_chunk_growth_large`): n = 2048, m = d_v = 32,
      two chunks of 1024 and then one of 2048. A loop over the chunks makes
      two steps and then one (more lines of Python at 1024), a form
      vectorised over the chunks holds their weights, n^2 / 2 and then n^2
      numbers: an answer with neither difference (its memory growing less
      than 1.5 times) uses a chunk size of its own of at most 1024;
    - small chunks (:func:`_chunk_growth_small`): n = 1024, m = d_v = 16,
      chunks of 1 and then of 2. A loop over chunks makes n and then n / 2
      steps (at least n / 2 more lines of Python), a form vectorised over
      the chunks holds n and then n / 2 states (n m d_v 4 more bytes): an
      answer with neither difference (a quarter of each is the limit) has a
      floor on the chunk size.

    A cap between 1024 and 2048 is not seen: no finite set of probes sees
    every cap. Measured here, large probe: the right loops executed more
    lines at 1024, the vectorised forms' memory grew 1.9-2.0 times; a cap
    of 1024, 512 or a size of 64 written in, neither; small probe: the
    right loops 3,000-15,000 more lines at chunks of 1 (limit 256), the
    vectorised forms 1.5-3.1 MiB more memory (limit 0.25 MiB), floors of 2,
    16 and 64 neither.
    """
    _chunk_growth_large(fn)
    _chunk_growth_small(fn)


def _chunk_growth_large(fn, n=2048, m=32, d_v=32) -> None:
    from ..bench import format_bytes
    from ._framework import ExerciseError

    __tracebackhide__ = True
    rng = _rng(1217)
    phi_q, phi_k = (elu_feature_map(rng.normal(size=(n, m))) for _ in "qk")
    v = rng.normal(size=(n, d_v))

    def fresh():
        # an answer that changes its inputs in place does not change those
        # of the next call
        return phi_q.copy(), phi_k.copy(), v.copy()

    half, whole = n // 2, n
    lines = [python_lines(fn, *fresh(), c)[1] for c in (half, whole)]
    # a loop over the chunks makes two steps, then one
    if lines[0] > lines[1]:
        return
    peaks = [peak_memory_with_torch(fn, *fresh(), c)[1] for c in (half, whole)]
    growth = peaks[1] / max(peaks[0], 1)
    # a form vectorised over the chunks holds their weights: n^2 / 2, then n^2
    if growth >= CHUNK_SIZE_GROWTH:
        return
    case = (
        f"n = {n}, m = d_v = {m}, chunk_size = {half} and {whole} (lines of "
        "Python and memory)"
    )
    _reject_a_package_call(fn, (*fresh(), half), case, lines)
    raise ExerciseError(
        "chunked causal linear attention",
        case,
        f"asked for two chunks of {half} and then for one chunk of all {n} "
        f"positions, your function executed {lines[0]} and {lines[1]} lines "
        f"of Python and its peak memory went from {format_bytes(peaks[0])} "
        f"to {format_bytes(peaks[1])} ({growth:.2f} times): a loop over the "
        "chunks makes two steps and then one, a form vectorised over them "
        "holds twice the weights in one chunk",
        mistake=CHUNKED_CAUSAL_COST_MISTAKES[5],
    )


def _chunk_growth_small(fn, n=1024, m=16, d_v=16) -> None:
    from ..bench import format_bytes
    from ._framework import ExerciseError

    __tracebackhide__ = True
    rng = _rng(1218)
    phi_q, phi_k = (elu_feature_map(rng.normal(size=(n, m))) for _ in "qk")
    v = rng.normal(size=(n, d_v))

    def fresh():
        # an answer that changes its inputs in place does not change those
        # of the next call
        return phi_q.copy(), phi_k.copy(), v.copy()

    lines = [python_lines(fn, *fresh(), c)[1] for c in (1, 2)]
    if lines[0] - lines[1] >= n // 4:
        return
    peaks = [peak_memory_with_torch(fn, *fresh(), c)[1] for c in (1, 2)]
    if peaks[0] - peaks[1] >= n * m * d_v * 8 // 8:
        return
    case = (
        f"n = {n}, m = d_v = {m}, chunk_size = 1 and 2 (lines of Python and "
        "memory)"
    )
    _reject_a_package_call(fn, (*fresh(), 1), case, lines)
    raise ExerciseError(
        "chunked causal linear attention",
        case,
        f"asked for chunks of 1 and then of 2, your function executed "
        f"{lines[0]} and {lines[1]} lines of Python and peaked at "
        f"{format_bytes(peaks[0])} and {format_bytes(peaks[1])}: a loop "
        f"over chunks makes {n} and then {n // 2} steps, a form vectorised "
        f"over the chunks holds {n} and then {n // 2} states; yours did the "
        "same work at both sizes, as if its chunks had a least size of their "
        "own",
        mistake=CHUNKED_CAUSAL_COST_MISTAKES[5],
    )


# the least growth of the peak memory from two chunks of n / 2 to one chunk
# of n, for an answer without a loop over the chunks (the chunkwise-parallel
# forms: 1.9-2.0 times)
CHUNK_SIZE_GROWTH = 1.5


def _causal_quadratic_chunks(phi_q, phi_k, v, chunk_size):
    """The reference on a long sequence, without n x n memory: the book's
    chunked causal branch."""
    from ..linear_attention import attention_from_features

    return attention_from_features(
        phi_q, phi_k, v, causal=True, chunk_size=chunk_size
    )


# The chunk size of the count and the length. The counts are of lines, not
# of seconds: the same answer gets the same counts on any machine under any
# load, so the verdict cannot flip. A loop over chunks of 64 makes 16 steps
# on n = 1024, a few lines each, far fewer than 1024 lines, whatever it does
# inside a chunk (C x C weights, or prefix sums of the chunk's states); an
# answer vectorised over the chunks executes a few lines in all. An answer
# that advances one position per step executes at least one line per
# position at any chunk size and any width.
CHUNK_STEP_SIZES = (64,)
CHUNK_STEP_N = 1024
# the share of a line per position, among the lines that do not grow with
# the widths, from which the steps are called per position: a recurrence
# over positions executes at least one per position (1 or more), a loop over
# chunks of 64 one per 64 positions and a few (under 0.1)
CHUNK_FIXED_SHARE = 0.5


def python_lines(fn, *args) -> tuple[object, int]:
    """Call ``fn(*args)`` and count the lines of Python it executes outside
    the libraries: numpy, torch and everything else installed, the standard
    library and attnbook. The reader's own code (a notebook cell, a script)
    counts, helpers, lambdas, generator expressions and comprehensions
    included; what runs in compiled code does not. Returns ``(fn(*args),
    lines)``.

    A count, not a time: it is the same on every run, on any machine.
    """
    import sys

    from ._framework import is_reader_code

    lines = 0
    verdicts: dict[str, bool] = {}

    def local(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
        return local

    def on_call(frame, event, arg):
        name = frame.f_code.co_filename
        if name not in verdicts:
            verdicts[name] = is_reader_code(name)
        return local if verdicts[name] else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        out = fn(*args)
    finally:
        sys.settrace(previous)
    return out, lines


def package_answers_called(fn, *args) -> list[str]:
    """Call ``fn(*args)``; return the names of the functions of
    :mod:`attnbook.linear_attention` (the package's own linear attention)
    that the reader's code calls directly, in the order of their first
    call. Their lines are the library's, which :func:`python_lines` does
    not count."""
    import os
    import sys

    from .. import linear_attention as package
    from ._framework import is_reader_code

    package_file = os.path.realpath(package.__file__)
    called: list[str] = []
    verdicts: dict[str, bool] = {}

    def reader(filename):
        if filename not in verdicts:
            verdicts[filename] = is_reader_code(filename)
        return verdicts[filename]

    def on_call(frame, event, arg):
        caller = frame.f_back
        if (
            caller is not None
            and reader(caller.f_code.co_filename)
            and os.path.realpath(frame.f_code.co_filename) == package_file
            and frame.f_code.co_name not in called
        ):
            called.append(frame.f_code.co_name)
        return None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        fn(*args)
    finally:
        sys.settrace(previous)
    return called


def _reject_a_package_call(fn, args, case, lines) -> None:
    """Name an answer that hands the work to the package's linear attention:
    the chunk-size probes see none of its steps (they run in attnbook), so
    they would otherwise call its chunk size one of its own."""
    from ._framework import ExerciseError

    __tracebackhide__ = True
    called = package_answers_called(fn, *args)
    if not called:
        return
    names = " and ".join(f"attnbook.linear_attention.{n}" for n in called)
    raise ExerciseError(
        "chunked causal linear attention",
        case,
        f"your function calls {names}; its own lines executed "
        f"{lines[0]} and {lines[1]} lines of Python at the two chunk sizes "
        "(the package's loop is not counted as yours)",
        mistake=CHUNKED_CAUSAL_COST_MISTAKES[6],
    )


def _check_chunked_work(fn, m=16, d_v=16) -> None:
    """Reject an answer that advances one position per step whatever
    ``chunk_size`` is: at chunks of 64, of the lines of Python it executes,
    at least one per position does not grow with the widths.

    The lines are counted at m = d_v = 16 and again at 32. An input check in
    Python (``any(x < 0 for x in phi_q.ravel())``) executes one line per
    element, twice as many at twice the widths; a recurrence over positions
    (a for loop, a comprehension, ``itertools.accumulate``) executes as many
    at any width. With ``L1`` lines at the first widths and ``L2`` at the
    second, ``2 L1 - L2`` are the lines that do not grow with the widths: the
    check's cancel, the recurrence's remain, so an answer with both is named
    too. A Python loop over every element of every position (its lines grow
    with the widths) is not told apart from a check; nobody computes this
    exercise that way after chapters of numpy.
    """
    from ._framework import ExerciseError

    __tracebackhide__ = True
    rng = _rng(1214)
    n = CHUNK_STEP_N
    (large,) = CHUNK_STEP_SIZES

    def lines(width_m, width_v, chunk_size):
        phi_q, phi_k = (
            elu_feature_map(rng.normal(size=(n, width_m))) for _ in "qk"
        )
        v = rng.normal(size=(n, width_v))
        # fresh arrays for every call: an answer that changes its inputs in
        # place does not change those of the next call
        return python_lines(fn, phi_q, phi_k, v, chunk_size)[1]

    steps = lines(m, d_v, large)
    if steps < n:
        return
    wider = lines(2 * m, 2 * d_v, large)
    fixed = 2 * steps - wider
    if fixed < CHUNK_FIXED_SHARE * n:
        return
    raise ExerciseError(
        "chunked causal linear attention",
        f"n = {n}, m = d_v = {m} and {2 * m}, chunk_size = {large} (lines of "
        "Python executed)",
        f"with chunk_size = {large} your function executed {steps} lines of "
        f"Python on {n} positions, and {wider} with features and values "
        f"twice as wide: {fixed} of them (2 x {steps} - {wider}) do not grow "
        "with the widths, at least one per position (a loop over chunks of "
        f"{large}: {n // large} steps; a check of every element: lines that "
        "double with the widths, which cancel)",
        mistake=CHUNKED_CAUSAL_COST_MISTAKES[2],
    )
