"""Checkers for grouped-query attention (chapter 12): sharing key/value heads,
pooling them.

Both exercises have one classic mistake in common: grouping the query heads in
the wrong order. Query head ``j`` must read key/value head ``j // g``
(contiguous groups, ``repeat_interleave``), not ``j % n_kv_heads`` (strided
groups, what ``repeat`` or ``torch.cat([x] * g)`` produce). Both give tensors
of the right shape, and a model converted with one convention and run with the
other is silently wrong.

Sharing is a copy, so its result keeps the input's dtype: a float32 result of
float64 keys is rejected (the next matmul with float64 queries would refuse
it). Pooling is a mean whose result is written into a layer's parameters,
which casts it to theirs: its dtype is not judged, only its values (see
:func:`check_pool_kv_heads`), so a float32 mean passes and a mean rounded to
16 bits (bfloat16, float16) fails on its values, and is named for its dtype.
"""

from __future__ import annotations

import numpy as np
import torch

from ..gqa import pool_kv_heads
from ..multihead import repeat_kv
from ._framework import (
    Case,
    Mistake,
    as_array,
    difference,
    dtype_name,
    run_checks,
    same,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- sharing key/value heads: (batch, n_kv_heads, n, d) -> (batch, n_heads, n,
# d) ----------------


def _group(x, n_heads: int) -> int:
    return n_heads // x.shape[1]


SHARE_MISTAKES = [
    Mistake(
        "wrong_order",
        "the heads are grouped in the wrong order: query head j reads "
        "key/value head j % n_kv_heads "
        "(the copies are tiled, as x.repeat(1, g, 1, 1) does) instead of j // "
        "g",
        "each key/value head serves g *consecutive* query heads: output head "
        "j is input head j // g (0, ..., 0, 1, ..., 1, ...), not j % "
        "n_kv_heads, so the copies of one head must be adjacent, not the "
        "whole stack tiled g times",
        lambda x, n_heads: x.repeat(1, _group(x, n_heads), 1, 1),
    ),
    Mistake(
        "wrong_group_size",
        "each key/value head is copied n_heads times instead of g = n_heads "
        "// n_kv_heads times",
        "the output must have n_heads heads in all: every key/value head "
        "serves g = n_heads // n_kv_heads",
        lambda x, n_heads: x.repeat_interleave(n_heads, dim=1),
    ),
    Mistake(
        "wrong_axis",
        "the positions are repeated (axis 2) instead of the heads (axis 1)",
        "x is (batch, n_kv_heads, n, d): the copies go along dim=1, and n "
        "must stay the same",
        lambda x, n_heads: x.repeat_interleave(_group(x, n_heads), dim=2),
    ),
    Mistake(
        "wrong_axis",
        "the whole sequence of positions is tiled g times (axis 2, as "
        "x.repeat(1, 1, g, 1) or expand then "
        "flatten(2, 3) do) instead of copying the heads (axis 1)",
        "x is (batch, n_kv_heads, n, d): the copies go along dim=1, and n "
        "must stay the same",
        lambda x, n_heads: x.repeat(1, 1, _group(x, n_heads), 1),
    ),
    Mistake(
        "scrambled",
        "the copies were made next to the position axis, so the final reshape "
        "mixes positions into heads",
        "copy whole heads along the head axis (dim 1), leaving positions and "
        "features where they are: output head j is all of input head j // g",
        lambda x, n_heads: (
            x[:, :, :, None]
            .expand(*x.shape[:3], _group(x, n_heads), x.shape[3])
            .reshape(x.shape[0], n_heads, x.shape[2], x.shape[3])
        ),
    ),
    Mistake(
        "scrambled_features",
        "the copies were made on the last axis (next to the features), so the "
        "final reshape mixes "
        "features and positions into heads",
        "copy whole heads along the head axis (dim 1), leaving positions and "
        "features where they are: output head j is all of input head j // g",
        lambda x, n_heads: (
            x[..., None]
            .expand(*x.shape, _group(x, n_heads))
            .reshape(x.shape[0], n_heads, x.shape[2], x.shape[3])
        ),
    ),
    Mistake(
        "first_head_only",
        "every query head reads key/value head 0: the other key/value heads "
        "are never used",
        "query head j reads key/value head j // g for every j, so that "
        "*each* key/value head is copied g times and none is left unused",
        lambda x, n_heads: x[:, :1].expand(x.shape[0], n_heads, *x.shape[2:]),
    ),
    Mistake(
        "divided_by_g",
        "the copies are divided by g: sharing copies a key/value head, it "
        "does not average or split it",
        "each query head of a group gets the key/value head itself, unscaled",
        lambda x, n_heads: (
            x.repeat_interleave(_group(x, n_heads), dim=1) / _group(x, n_heads)
        ),
    ),
    Mistake(
        "group_size_off_by_one",
        "each key/value head is copied g + 1 times instead of g = n_heads // "
        "n_kv_heads",
        "the output must have n_heads = n_kv_heads * g heads: copy each head "
        "exactly g times",
        lambda x, n_heads: x.repeat_interleave(_group(x, n_heads) + 1, dim=1),
    ),
    Mistake(
        "group_size_off_by_one",
        "each key/value head is copied g - 1 times instead of g = n_heads // "
        "n_kv_heads",
        "the output must have n_heads = n_kv_heads * g heads: copy each head "
        "exactly g times",
        lambda x, n_heads: x.repeat_interleave(_group(x, n_heads) - 1, dim=1),
    ),
    Mistake(
        "group_size_off_by_one_cut",
        "each key/value head is copied g + 1 times and the result is cut to "
        "n_heads heads: the shape is right, but query head j reads key/value "
        "head j // (g + 1) instead of j // g, and the last key/value heads "
        "lose copies (or are never read)",
        "the shape came out right only because of the cut: copy each head "
        "exactly g = n_heads // n_kv_heads times, and n_kv_heads * g = "
        "n_heads heads come out with nothing to cut",
        lambda x, n_heads: x.repeat_interleave(_group(x, n_heads) + 1, dim=1)[
            :, :n_heads
        ],
    ),
    Mistake(
        "changed_dtype",
        "the result is float32 while the input is float64 (a cast, such as "
        ".float(), or a buffer made by torch.zeros or torch.empty without a "
        "dtype): sharing copies the keys and values, so it keeps their dtype",
        "keep the input's dtype: build the result from x itself, or "
        "pass dtype=x.dtype to any buffer you make; a float32 copy of float64 "
        "keys has lost digits, and its matmul with float64 queries fails",
        lambda x, n_heads: repeat_kv(x, _group(x, n_heads)).to(torch.float32),
    ),
    Mistake(
        "changed_dtype",
        "the result is float64 while the input is float32 (a cast, such as "
        ".double(), or a buffer made in float64): sharing copies the keys "
        "and values, so it keeps their dtype",
        "keep the input's dtype: build the result from x itself, or "
        "pass dtype=x.dtype to any buffer you make; a float64 copy of float32 "
        "keys takes twice the memory, and its matmul with float32 queries "
        "fails",
        lambda x, n_heads: repeat_kv(x, _group(x, n_heads)).to(torch.float64),
    ),
    Mistake(
        "numpy_result",
        "the result is a numpy array while the input is a torch tensor (a "
        ".numpy() on the way, then numpy's repeat): the shared keys and "
        "values go straight into attend or a matmul with torch queries, "
        "which refuses a numpy array",
        "stay in torch: build the result from x itself with torch "
        "operations; the result must be a tensor like x",
        lambda x, n_heads: repeat_kv(x, _group(x, n_heads)).numpy(),
    ),
]


def same_values_and_dtype(got, expected) -> bool:
    """:func:`same`, the same dtype (a copy keeps its input's dtype) and the
    same kind of array (a torch tensor for a torch tensor)."""
    return (
        same(got, expected)
        and dtype_name(got) == dtype_name(expected)
        and isinstance(got, torch.Tensor) == isinstance(expected, torch.Tensor)
    )


def describe_share(got, expected, case: Case | None = None) -> str:
    """What differs: :func:`difference`, and first a changed dtype."""
    got_dtype, expected_dtype = dtype_name(got), dtype_name(expected)
    if isinstance(expected, torch.Tensor) and not isinstance(
        got, torch.Tensor
    ):
        kind = f"{type(got).__module__}.{type(got).__name__}"
        return f"your result is a {kind}, not a torch tensor"
    if got_dtype == expected_dtype:
        return difference(got, expected, case)
    values = (
        "its values agree with the answer to the checker's tolerance"
        if same(got, expected)
        else "its values differ too: " + difference(got, expected, case)
    )
    return (
        f"your result is {got_dtype}, the input (and so the answer) is "
        f"{expected_dtype}; {values}"
    )


def share_cases() -> list[Case]:
    def kv(seed, *shape):
        return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64)

    return [
        Case(
            "2 key/value heads for 4 query heads, batch 2, n = 3, d = 5",
            (kv(0, 2, 2, 3, 5), 4),
        ),
        Case(
            "3 key/value heads for 12 query heads (g = 4)",
            (kv(1, 1, 3, 4, 2), 12),
        ),
        Case(
            "multi-query: 1 key/value head for 4 query heads",
            (kv(2, 2, 1, 3, 4), 4),
        ),
        Case(
            "multi-head: 3 key/value heads for 3 query heads (nothing to "
            "share)",
            (kv(3, 1, 3, 2, 4), 3),
        ),
        Case(
            "a single position (n = 1), float32, 2 key/value heads for 6 "
            "query heads",
            (kv(4, 3, 2, 1, 4).to(torch.float32), 6),
        ),
    ]


def check_share_kv_heads(fn) -> None:
    """Check ``fn(x, n_heads)`` turns x (batch, n_kv_heads, n, d) into (batch,
    n_heads, n, d), query head ``j`` receiving key/value head ``j // (n_heads
    // n_kv_heads)``.

    The result must keep ``x``'s dtype (four cases are float64, one float32):
    sharing is a copy, and the copies are multiplied by queries of ``x``'s
    dtype next, which torch refuses for mixed float dtypes. A float32 result of
    float64 keys (``.float()``, or a ``torch.zeros`` buffer of the default
    dtype) is diagnosed as ``changed_dtype``, and a numpy array returned for
    a torch tensor as ``numpy_result``. The exercise's rules, no call of
    ``repeat_kv``, ``repeat_interleave`` or ``gqa.kv_head_of``, are not
    checked: the checker sees only what ``fn`` returns. No hint prints the
    answer's code.
    """
    run_checks(
        "sharing key/value heads",
        fn,
        share_cases(),
        lambda x, n_heads: repeat_kv(x, _group(x, n_heads)),
        SHARE_MISTAKES,
        compare=same_values_and_dtype,
        describe=describe_share,
    )


# --- pooling a projection's heads (Ainslie et al. 2023) ----------------------


def _heads(w, n_heads: int):
    # (h, d_head, ...)
    return w.reshape(n_heads, w.shape[0] // n_heads, *w.shape[1:])


def _lower_median(a):
    """torch.median's semantics along axis 1, in numpy: the lower of the two
    middle values for an even count."""
    return np.sort(a, axis=1)[:, (a.shape[1] - 1) // 2]


POOL_MISTAKES = [
    Mistake(
        "wrong_order",
        "the heads are grouped in the wrong order: key/value head i pools "
        "query heads i, i + n_kv_heads, "
        "i + 2 n_kv_heads, ... instead of the consecutive heads i*g .. i*g + "
        "g - 1",
        "reshape the rows to (n_kv_heads, g, d_head, ...) and average over "
        "the g axis (dim 1)",
        lambda w, h, n_kv_heads: (
            _heads(w, h)
            .reshape(h // n_kv_heads, n_kv_heads, *_heads(w, h).shape[1:])
            .mean(0)
            .reshape(-1, *w.shape[1:])
        ),
    ),
    Mistake(
        "first_head",
        "only the first head of each group is kept (the ablation of Ainslie "
        "et al.), not the mean",
        "average all g heads of the group: mean-pooling keeps information "
        "from each of them",
        lambda w, h, n_kv_heads: _heads(w, h)[:: h // n_kv_heads].reshape(
            -1, *w.shape[1:]
        ),
    ),
    Mistake(
        "last_head",
        "only the last head of each group is kept, not the mean",
        "average all g heads of the group: reshape to (n_kv_heads, g, d_head, "
        "...) and take .mean(1)",
        lambda w, h, n_kv_heads: _heads(w, h)[
            h // n_kv_heads - 1 :: h // n_kv_heads
        ].reshape(-1, *w.shape[1:]),
    ),
    Mistake(
        "median",
        "the heads of a group are pooled by their median, not their mean",
        "mean-pooling (Ainslie et al. 2023) averages the g heads: .mean(1), "
        "not np.median(..., axis=1)",
        lambda w, h, n_kv_heads: np.median(
            np.asarray(_heads(w, h)).reshape(
                n_kv_heads, h // n_kv_heads, w.shape[0] // h, *w.shape[1:]
            ),
            axis=1,
        ).reshape(-1, *w.shape[1:]),
    ),
    Mistake(
        "lower_median",
        "the heads of a group are pooled by torch's .median(1), which for an "
        "even group size takes the "
        "lower of the two middle values (at g = 2 the minimum), not their "
        "mean",
        "mean-pooling (Ainslie et al. 2023) averages the g heads: .mean(1), "
        "not .median(1)",
        lambda w, h, n_kv_heads: _lower_median(
            np.asarray(_heads(w, h)).reshape(
                n_kv_heads, h // n_kv_heads, w.shape[0] // h, *w.shape[1:]
            )
        ).reshape(-1, *w.shape[1:]),
    ),
    Mistake(
        "summed",
        "the heads of a group are summed instead of averaged (the keys come "
        "out g times too large)",
        "divide the sum by the group size g, or use .mean",
        lambda w, h, n_kv_heads: (
            _heads(w, h)
            .reshape(n_kv_heads, h // n_kv_heads, -1, *w.shape[1:])
            .sum(1)
            .reshape(-1, *w.shape[1:])
        ),
    ),
    Mistake(
        "mixed_features",
        "the rows were split as (n_kv_heads, d_head, g): features of one head "
        "are averaged with each other",
        "row r of head j is row j * d_head + r, so the head index varies "
        "slowest: reshape to "
        "(n_kv_heads, g, d_head, ...)",
        lambda w, h, n_kv_heads: (
            w.reshape(
                n_kv_heads, w.shape[0] // h, h // n_kv_heads, *w.shape[1:]
            )
            .mean(2)
            .reshape(-1, *w.shape[1:])
        ),
    ),
    Mistake(
        "trailing_axis_added",
        "the result always gets a trailing axis (a final reshape(n_kv_heads "
        "* d_head, -1), written for a matrix): a bias vector (n_heads * "
        "d_head,) comes back as a column (n_kv_heads * d_head, 1)",
        "keep the weight's trailing shape, weight.shape[1:], which is empty "
        "for a bias vector: reshape(-1, *weight.shape[1:]) at the end",
        lambda w, h, n_kv_heads: pool_kv_heads(
            w, h, n_kv_heads, "mean"
        ).reshape(n_kv_heads * (w.shape[0] // h), -1),
    ),
    Mistake(
        "global_mean",
        "all n_heads heads are averaged into one, instead of each group of g "
        "heads into its own key/value head",
        "average within each group only: reshape to (n_kv_heads, g, d_head, "
        "...) and take .mean(1)",
        lambda w, h, n_kv_heads: _heads(w, h).mean(0),
    ),
    Mistake(
        "global_mean",
        "every key/value head is the mean of all n_heads heads, instead of "
        "the mean of its own group of g",
        "average within each group only: reshape to (n_kv_heads, g, d_head, "
        "...) and take .mean(1)",
        lambda w, h, n_kv_heads: torch.cat(
            [_heads(w, h).mean(0)] * n_kv_heads
        ),
    ),
    Mistake(
        "max",
        "the heads of a group are pooled by their elementwise maximum, not "
        "their mean",
        "mean-pooling (Ainslie et al. 2023) averages the g heads: .mean(1), "
        "not .max(1) or .amax(1)",
        lambda w, h, n_kv_heads: (
            _heads(w, h)
            .reshape(n_kv_heads, h // n_kv_heads, -1, *w.shape[1:])
            .amax(1)
            .reshape(-1, *w.shape[1:])
        ),
    ),
]


# the significant bits (the implicit one included) of the 16-bit floats a
# reader may return: bfloat16 keeps float32's range with 8, float16 has 11
SIXTEEN_BIT_PRECISION = {"bfloat16": 8, "float16": 11}


def _rounded_mean(dtype):
    """The right mean, rounded to ``dtype`` (a torch dtype) at the end."""
    return lambda w, h, n_kv_heads: pool_kv_heads(w, h, n_kv_heads, "mean").to(
        dtype
    )


POOL_MISTAKES += [
    Mistake(
        "numpy_result",
        "the result is a numpy array while the weight is a torch tensor (a "
        ".numpy() on the way): mha_to_gqa copies the pooled weights into the "
        "layer's parameters with Parameter.copy_, which refuses a numpy "
        "array",
        "return a torch tensor, as the weight is: pool with torch "
        "operations, or wrap numpy's result in torch.from_numpy",
        lambda w, h, n_kv_heads: (
            pool_kv_heads(w, h, n_kv_heads, "mean").detach().numpy()
        ),
    ),
    Mistake(
        "sixteen_bit_result",
        "the mean is right but returned in bfloat16 (a .bfloat16() cast of "
        "the result, or a buffer made in bfloat16): its 8 significant bits "
        "move every value by up to 0.4 %, far more than the checker's "
        "relative 1e-5",
        "the dtype itself is not judged (float32 passes), its values are: "
        "take and return the mean in the weights' dtype (or float32), and "
        "let the layer's parameters cast it when it is copied into them",
        _rounded_mean(torch.bfloat16),
    ),
    Mistake(
        "sixteen_bit_result",
        "the mean is right but returned in float16 (a .half() cast of the "
        "result, or astype(np.float16)): its 11 significant bits move every "
        "value by up to 0.05 %, more than the checker's relative 1e-5",
        "the dtype itself is not judged (float32 passes), its values are: "
        "take and return the mean in the weights' dtype (or float32), and "
        "let the layer's parameters cast it when it is copied into them",
        _rounded_mean(torch.float16),
    ),
]


def describe_pool(got, expected, case: Case | None = None) -> str:
    """What differs: :func:`difference`, after a 16-bit result's dtype. The
    dtype is not judged, but 16 bits cannot hold the mean to the checker's
    tolerance: the reader is told whether the rounding accounts for the
    difference (values computed right, then stored in 16 bits) or not (a
    mistake besides the dtype). A result that is not a torch tensor is named
    as such first: its values may well be right (``same_values_and_kind``
    refuses it for its kind)."""
    if (
        isinstance(expected, torch.Tensor)
        and not isinstance(got, torch.Tensor)
        and got is not None
    ):
        kind = f"{type(got).__module__}.{type(got).__name__}"
        values = (
            "its values agree with the answer to the checker's tolerance"
            if same(got, expected)
            else "its values differ too: " + difference(got, expected, case)
        )
        return (
            f"your result is a {kind}, not a torch tensor (the weight is "
            f"one, and Parameter.copy_ needs one); {values}"
        )
    problem = difference(got, expected, case)
    got_dtype, expected_dtype = dtype_name(got), dtype_name(expected)
    bits = SIXTEEN_BIT_PRECISION.get(got_dtype)
    if bits is None or got_dtype == expected_dtype:
        return problem
    intro = (
        f"your result is {got_dtype}, the weights (and so the answer) are "
        f"{expected_dtype}. The dtype is not judged, but {got_dtype} keeps "
        f"{bits} significant bits"
    )
    got_a, expected_a = as_array(got), as_array(expected)
    if got_a.shape != expected_a.shape:
        return f"{intro}; {problem}"
    # rounded once or twice (the weights, then their mean), each time by at
    # most 2^-bits of a value no larger than the largest weight's
    slack = 4 * 2.0**-bits * float(np.max(np.abs(expected_a), initial=0.0))
    gap = np.abs(got_a.astype(np.float64) - expected_a.astype(np.float64))
    if bool(np.all(gap <= slack)):
        return (
            f"{intro}, so rounding to it moves a value by up to 2^-{bits} = "
            f"{2.0**-bits:.1e} of itself, beyond the checker's relative 1e-5, "
            f"and that rounding accounts for the difference: {problem}"
        )
    return (
        f"{intro}, and rounding to it does not account for this difference, "
        f"which is larger: {problem}"
    )


def pool_cases() -> list[Case]:
    def w(seed, *shape):
        return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64)

    return [
        Case(
            "4 heads of 3 features -> 2 heads, weight (12, 5)",
            (w(10, 12, 5), 4, 2),
        ),
        Case(
            "6 heads of 2 features -> 3 heads, weight (12, 4)",
            (w(11, 12, 4), 6, 3),
        ),
        Case(
            "4 heads of 2 features -> 1 head (multi-query), weight (8, 3)",
            (w(12, 8, 3), 4, 1),
        ),
        Case(
            "8 heads of 2 features -> 2 heads (g = 4), weight (16, 3)",
            (w(13, 16, 3), 8, 2),
        ),
        Case(
            "a bias vector: 4 heads of 3 features -> 2 heads, shape (12,)",
            (w(14, 12), 4, 2),
        ),
        Case(
            "4 heads -> 4 heads: nothing to pool, weight (8, 3)",
            (w(15, 8, 3), 4, 4),
        ),
    ]


def check_pool_kv_heads(fn) -> None:
    """Check ``fn(weight, n_heads, n_kv_heads)`` mean-pools the head blocks of
    a key or value projection's rows, weight (n_heads * d_head, ...) ->
    (n_kv_heads * d_head, ...).

    The result's dtype is not judged, only its values (to a relative 1e-5): a
    float32 mean of float64 weights is accepted. A 16-bit result (bfloat16,
    float16) cannot hold the mean to that tolerance: it fails on its values,
    and the verdict names its dtype (``sixteen_bit_result`` when the mean
    was right before the rounding). Pooling computes weights
    that are then written into the converted layer's parameters
    (``mha_to_gqa`` copies them with ``Parameter.copy_``, which casts to the
    parameter's dtype), so the dtype the function returns does not reach the
    model, and a mean taken in float32 is within about 1e-7 of the float64
    one, far inside the tolerance. The result must be a torch tensor, as the
    weight is: ``copy_`` refuses a numpy array (``numpy_result``). (Sharing
    is judged more strictly: its copies go straight into a matmul, see
    :func:`check_share_kv_heads`.)
    """
    run_checks(
        "mean-pooling key/value heads",
        fn,
        pool_cases(),
        lambda w, h, n_kv_heads: pool_kv_heads(w, h, n_kv_heads, "mean"),
        POOL_MISTAKES,
        compare=same_values_and_kind,
        describe=describe_pool,
    )


def same_values_and_kind(got, expected) -> bool:
    """:func:`same`, and a torch tensor where ``expected`` is one (which
    ``Parameter.copy_`` needs); the dtype is not judged. A mistake that the
    checker commits in numpy is matched by its values alone."""
    if hasattr(expected, "detach") and not hasattr(got, "detach"):
        return False
    return same(got, expected)
