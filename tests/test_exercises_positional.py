"""The RoPE-attention and ALiBi-bias checkers reject each classic mistake and
pass correct answers.

The implementations here are written independently of the checkers' Mistake
functions (and of attnbook.positional), the way a reader might write them: RoPE
with a ``rotate_half`` helper, ALiBi with explicit loops.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnbook.exercises import ExerciseError, NotAttemptedError
from attnbook.exercises.positional import (
    ALIBI_MISTAKES,
    check_alibi_bias,
    check_rope_attention,
    visible_relative,
)


# --- RoPE, written the Hugging Face way --------------------------------------


def rotate_half(x, sign=1.0):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-sign * x2, sign * x1), dim=-1)


def my_rope(x, base=10000.0, sign=1.0, exponent_step=2, start=0):
    n, d = x.shape[-2:]
    inv_freq = 1.0 / base ** (
        torch.arange(0, d, exponent_step, dtype=torch.float64)[: d // 2] / d
    )
    angles = (
        torch.arange(start, start + n, dtype=torch.float64)[:, None] * inv_freq
    )
    # (n, d): pair i is (i, i + d/2)
    angles = torch.cat((angles, angles), dim=-1)
    return x * angles.cos() + rotate_half(x, sign) * angles.sin()


def my_rope_interleaved(x, base=10000.0, start=0):
    n, d = x.shape[-2:]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = (
        torch.arange(start, start + n, dtype=torch.float64)[:, None] * inv_freq
    )
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(
        z * torch.polar(torch.ones_like(angles), angles)
    ).flatten(-2)


def q_start(q, k):
    """The first query's position: the queries are the last of the keys'."""
    return k.shape[-2] - q.shape[-2]


def good_rope_attention(q, k, v):
    return F.scaled_dot_product_attention(
        my_rope(q, start=q_start(q, k)), my_rope(k), v
    )


def rope_queries_from_zero(q, k, v):
    """Wrong: right for n_q = n_k, but the queries rotated from position 0."""
    return F.scaled_dot_product_attention(my_rope(q), my_rope(k), v)


def good_with_weights(q, k, v):
    s = (
        my_rope(q, start=q_start(q, k))
        @ my_rope(k).transpose(-1, -2)
        / q.shape[-1] ** 0.5
    )
    w = torch.softmax(s, dim=-1)
    return w @ v, w


def test_rope_reference_passes(capsys):
    check_rope_attention(good_rope_attention)
    assert "Correct" in capsys.readouterr().out


def test_rope_output_and_weights_pair_passes():
    check_rope_attention(good_with_weights)


def test_rope_in_numpy_passes():
    def numpy_version(q, k, v):
        q, k, v = (np.asarray(t) for t in (q, k, v))
        n_q, d = q.shape[-2:]
        n_k = k.shape[-2]
        theta = 10000.0 ** (-np.arange(d // 2) * 2 / d)

        def rot(x, positions):
            ang = positions[:, None] * theta
            c, s = np.cos(ang), np.sin(ang)
            a, b = x[..., : d // 2], x[..., d // 2 :]
            return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)

        positions = np.arange(n_k)
        scores = (
            rot(q, positions[n_k - n_q :])
            @ np.swapaxes(rot(k, positions), -1, -2)
            / np.sqrt(d)
        )
        e = np.exp(scores - scores.max(-1, keepdims=True))
        return (e / e.sum(-1, keepdims=True)) @ v

    check_rope_attention(numpy_version)


ROPE_BY_HAND = [
    (
        lambda q, k, v: F.scaled_dot_product_attention(
            my_rope(q, start=q_start(q, k)), my_rope(k), my_rope(v)
        ),
        "rope_on_values",
    ),
    (
        lambda q, k, v: F.scaled_dot_product_attention(
            my_rope(q, start=q_start(q, k)), k, v
        ),
        "q_only",
    ),
    (
        lambda q, k, v: F.scaled_dot_product_attention(q, my_rope(k), v),
        "k_only",
    ),
    (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), "no_rope"),
    (
        lambda q, k, v: my_rope(
            F.scaled_dot_product_attention(q, k, v), start=q_start(q, k)
        ),
        "rope_on_output",
    ),
    (
        lambda q, k, v: F.scaled_dot_product_attention(
            my_rope_interleaved(q, start=q_start(q, k)),
            my_rope_interleaved(k),
            v,
        ),
        "interleaved_layout",
    ),
    (
        lambda q, k, v: F.scaled_dot_product_attention(
            my_rope(q, sign=-1.0, start=q_start(q, k)),
            my_rope(k, sign=-1.0),
            v,
        ),
        "reversed_rotation",
    ),
    (
        lambda q, k, v: F.scaled_dot_product_attention(
            my_rope(q, exponent_step=1, start=q_start(q, k)),
            my_rope(k, exponent_step=1),
            v,
        ),
        "frequency_exponent",
    ),
    (
        lambda q, k, v: F.scaled_dot_product_attention(
            my_rope(q, start=q_start(q, k)), my_rope(k), v, scale=1.0
        ),
        "no_scale",
    ),
    (
        lambda q, k, v: F.scaled_dot_product_attention(
            my_rope(q, start=q_start(q, k)), my_rope(k, sign=-1.0), v
        ),
        "opposite_rotations",
    ),
]


@pytest.mark.parametrize("wrong, key", ROPE_BY_HAND)
def test_rope_mistakes_are_diagnosed(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_rope_attention(wrong)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value) and "Hint" in str(err.value)


def test_rope_both_positions_reversed_is_named_in_the_diagnosis():
    """q and k both rotated at positions n - 1 .. 0 give exactly the scores of
    a sign error in the sines (R(-m) q . R(-n) k = q . R(m - n) k): the
    diagnosis must name the reversed positions too, so a reader whose formula
    is right but whose positions run backwards is not sent to the sines
    alone."""

    def both_reversed(q, k, v):
        return F.scaled_dot_product_attention(
            my_rope(q.flip(-2)).flip(-2), my_rope(k.flip(-2)).flip(-2), v
        )

    with pytest.raises(ExerciseError) as err:
        check_rope_attention(both_reversed)
    assert err.value.mistake == "reversed_rotation"
    assert "counted backwards" in str(err.value) and "both q and k" in str(
        err.value
    )


def test_rope_unknown_error_is_still_rejected():
    """Keys rotated three positions ahead of the queries: wrong, but not one of
    the listed mistakes."""
    with pytest.raises(ExerciseError) as err:
        check_rope_attention(
            lambda q, k, v: F.scaled_dot_product_attention(
                my_rope(q, start=1), my_rope(k, start=4), v
            )
        )
    assert err.value.mistake is None


def test_rope_stub_and_crash():
    def stub(q, k, v):
        raise NotImplementedError

    with pytest.raises(NotAttemptedError):
        check_rope_attention(stub)
    with pytest.raises(ExerciseError, match="RuntimeError"):
        # shapes do not multiply
        check_rope_attention(lambda q, k, v: q @ v)


# --- ALiBi, written with loops -----------------------------------------------


def loop_slopes(h):
    def powers(m):
        start = 2 ** (-8 / m)
        return [start ** (i + 1) for i in range(m)]

    p = 1
    while p * 2 <= h:
        p *= 2
    extra = powers(2 * p)[::2][: h - p] if h > p else []
    return powers(p) + extra


def loop_bias(h, n, slopes=None, sign=-1.0, distance=lambda i, j: i - j):
    slopes = loop_slopes(h) if slopes is None else slopes
    b = np.zeros((h, n, n))
    for head in range(h):
        for i in range(n):
            for j in range(n):
                b[head, i, j] = sign * slopes[head] * distance(i, j)
    return b


def test_alibi_reference_passes(capsys):
    check_alibi_bias(loop_bias)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "equivalent",
    [
        # symmetric form
        lambda h, n: loop_bias(h, n, distance=lambda i, j: abs(i - j)),
        # fairseq's +m j
        lambda h, n: loop_bias(h, n, sign=1.0, distance=lambda i, j: j),
        # mask included
        lambda h, n: np.where(
            np.triu(np.ones((n, n), bool), 1), -np.inf, loop_bias(h, n)
        ),
        # a torch tensor
        lambda h, n: torch.from_numpy(loop_bias(h, n)),
        # off by a row constant
        lambda h, n: loop_bias(h, n, distance=lambda i, j: i - j + 1),
        # (h, 1, n): the original code
        lambda h, n: loop_bias(h, n, sign=1.0, distance=lambda i, j: j)[
            :, -1:
        ],
    ],
)
def test_alibi_equivalent_forms_pass(equivalent):
    check_alibi_bias(equivalent)


@pytest.mark.parametrize(
    "wrong, key",
    [
        (lambda h, n: loop_bias(h, n, sign=1.0), "sign_error"),
        # direction wrong
        (
            lambda h, n: loop_bias(h, n, distance=lambda i, j: j - i),
            "sign_error",
        ),
        # key position
        (lambda h, n: loop_bias(h, n, distance=lambda i, j: j), "sign_error"),
        (
            lambda h, n: loop_bias(h, n, slopes=loop_slopes(h)[::-1]),
            "slopes_reversed",
        ),
        (lambda h, n: loop_bias(h, n, slopes=[1.0] * h), "missing_slope"),
        (
            lambda h, n: loop_bias(
                h, n, slopes=[2 ** (-8 * i / h) for i in range(h)]
            ),
            "slopes_start_at_one",
        ),
        (
            lambda h, n: loop_bias(
                h, n, slopes=[2 ** (-8 * (i + 1) / h) for i in range(h)]
            ),
            "geometric_for_any_h",
        ),
        (lambda h, n: np.zeros((h, n, n)), "constant_rows"),
        (
            lambda h, n: loop_bias(h, n, distance=lambda i, j: i),
            "constant_rows",
        ),
    ],
)
def test_alibi_mistakes_are_diagnosed(wrong, key):
    with pytest.raises(ExerciseError) as err:
        check_alibi_bias(wrong)
    assert err.value.mistake == key
    assert "Diagnosis" in str(err.value) and "Hint" in str(err.value)


def test_alibi_missing_slope_hint_does_not_point_to_the_forbidden_package():
    """ex-ch6-alibi forbids attnbook.positional, so the missing-slope hint
    must send the reader to the slope rule of eq-ch6-alibi-slopes, not to
    alibi_slopes; no other ALiBi hint may name that function either."""
    with pytest.raises(ExerciseError) as err:
        check_alibi_bias(lambda h, n: loop_bias(h, n, slopes=[1.0] * h))
    assert err.value.mistake == "missing_slope"
    hint = str(err.value).split("Hint: ", 1)[1]
    assert "eq-ch6-alibi-slopes" in hint
    assert "alibi_slopes" not in hint
    for mistake in ALIBI_MISTAKES:
        assert "alibi_slopes" not in mistake.hint, mistake.key


def test_alibi_reversed_slopes_message_numbers_heads_from_one():
    """The chapter numbers ALiBi heads r = 1 .. h (eq-ch6-alibi-slopes, the
    figure's 'head 1'); the reversed-slopes diagnosis and hint must use that
    numbering, not mix in a 'head 0'."""
    with pytest.raises(ExerciseError) as err:
        check_alibi_bias(
            lambda h, n: loop_bias(h, n, slopes=loop_slopes(h)[::-1])
        )
    message = str(err.value)
    assert err.value.mistake == "slopes_reversed"
    assert "head 0" not in message
    assert "r = 1" in message


def test_alibi_wrong_shape_is_reported():
    with pytest.raises(ExerciseError, match="expected shape") as err:
        check_alibi_bias(lambda h, n: loop_bias(h, n)[0])
    assert err.value.mistake is None


def test_visible_relative_ignores_row_constants_and_the_future():
    b = loop_bias(2, 4)
    shifted = (
        b + np.arange(4)[None, :, None] + np.triu(np.full((4, 4), 99.0), 1)
    )
    np.testing.assert_array_equal(
        visible_relative(b), visible_relative(shifted)
    )
    assert np.all(np.diagonal(visible_relative(b), axis1=-2, axis2=-1) == 0)


# --- the catalogue (run by tests/test_exercises_framework.py) ----------------


def my_rope_at(x, positions):
    d = x.shape[-1]
    inv_freq = 1.0 / 10000.0 ** (
        torch.arange(0, d, 2, dtype=torch.float64) / d
    )
    angles = (
        torch.as_tensor(positions, dtype=torch.float64)[:, None] * inv_freq
    )
    angles = torch.cat((angles, angles), dim=-1)
    return x * angles.cos() + rotate_half(x) * angles.sin()


def rope_with_causal_mask(q, k, v):
    """Wrong: masks the keys after each query, although the exercise says
    no mask."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    allowed = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
    return F.scaled_dot_product_attention(
        my_rope(q, start=q_start(q, k)), my_rope(k), v, attn_mask=allowed
    )


def rope_float32_in_place(q, k, v):
    """Right: rotates q and k in place (q.copy_), computes in float32."""
    q.copy_(my_rope(q, start=q_start(q, k)))
    k.copy_(my_rope(k))
    q32, k32, v32 = q.float(), k.float(), v.float()
    return (
        torch.softmax(q32 @ k32.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        @ v32
    )


ROPE_WRONG = ROPE_BY_HAND + [
    (
        lambda q, k, v: F.scaled_dot_product_attention(
            my_rope(q, start=q_start(q, k)), my_rope(k, start=1), v
        ),
        "key_positions_shifted",
    ),
    (
        lambda q, k, v: F.scaled_dot_product_attention(
            my_rope(q, start=q_start(q, k)),
            my_rope_at(k, range(k.shape[-2] - 1, -1, -1)),
            v,
        ),
        "key_positions_reversed",
    ),
    # student report stud0506: the queries counted from 1, the keys from 0
    (
        lambda q, k, v: F.scaled_dot_product_attention(
            my_rope(q, start=q_start(q, k) + 1), my_rope(k), v
        ),
        "query_positions_shifted",
    ),
    # student report stud0506: the scale taken from the values' width
    (
        lambda q, k, v: (
            torch.softmax(
                my_rope(q, start=q_start(q, k))
                @ my_rope(k).transpose(-1, -2)
                / v.shape[-1] ** 0.5,
                dim=-1,
            )
            @ v
        ),
        "scale_d_v",
    ),
    # the decoding case: the queries rotated from 0, not from n_k - n_q
    (rope_queries_from_zero, "queries_from_zero"),
    # student report stud06: a causal mask (the queries are the last n_q
    # of the keys, as in the package's causal convention)
    (rope_with_causal_mask, "causal_mask"),
]

CATALOGUE = {
    "check_rope_attention": {
        "right": [
            good_rope_attention,
            good_with_weights,
            rope_float32_in_place,
            lambda q, k, v: F.scaled_dot_product_attention(
                my_rope(q, start=7 + q_start(q, k)), my_rope(k, start=7), v
            ),
        ],
        "wrong": ROPE_WRONG,
    },
    "check_alibi_bias": {
        "right": [
            loop_bias,
            lambda h, n: loop_bias(h, n, distance=lambda i, j: abs(i - j)),
            lambda h, n: loop_bias(h, n, sign=1.0, distance=lambda i, j: j)[
                :, -1:
            ],
            lambda h, n: torch.from_numpy(loop_bias(h, n)).float(),
        ],
        "wrong": [
            (lambda h, n: loop_bias(h, n, sign=1.0), "sign_error"),
            (
                lambda h, n: loop_bias(h, n, distance=lambda i, j: j - i),
                "sign_error",
            ),
            (
                lambda h, n: loop_bias(h, n, slopes=loop_slopes(h)[::-1]),
                "slopes_reversed",
            ),
            (
                lambda h, n: loop_bias(h, n, slopes=sorted(loop_slopes(h))),
                "slopes_reversed",
            ),
            (lambda h, n: loop_bias(h, n, slopes=[1.0] * h), "missing_slope"),
            (
                lambda h, n: loop_bias(
                    h, n, slopes=[2 ** (-8 * i / h) for i in range(h)]
                ),
                "slopes_start_at_one",
            ),
            (
                lambda h, n: loop_bias(
                    h, n, slopes=[2 ** (-8 * (i + 1) / h) for i in range(h)]
                ),
                "geometric_for_any_h",
            ),
            (lambda h, n: np.zeros((h, n, n)), "constant_rows"),
            # student report stud0506: the odd places of the 2p-head slopes
            (
                lambda h, n: loop_bias(h, n, slopes=odd_place_slopes(h)),
                "interleave_odd",
            ),
            # student report stud0506: all slopes sorted steepest first
            (
                lambda h, n: loop_bias(
                    h, n, slopes=sorted(loop_slopes(h), reverse=True)
                ),
                "slopes_sorted",
            ),
            # student report stud06: the extra slopes of 2p heads taken one
            # after another, [:h - p], not every other one
            (
                lambda h, n: loop_bias(h, n, slopes=contiguous_slopes(h)),
                "extra_contiguous",
            ),
            # student report stud06: p < h even when h is a power of two
            (
                lambda h, n: loop_bias(h, n, slopes=always_split_slopes(h)),
                "split_for_powers_of_two",
            ),
            # student report stud06b: the heads on the last axis, (n, n, h)
            (
                lambda h, n: np.moveaxis(loop_bias(h, n), 0, -1),
                "heads_last",
            ),
        ],
    },
}


def contiguous_slopes(h):
    """The authors' rule with the slip [:h - p] for the extra slopes."""
    p = 2 ** (h.bit_length() - 1)
    extra = [2 ** (-8 * (i + 1) / (2 * p)) for i in range(h - p)]
    return [2 ** (-8 * (i + 1) / p) for i in range(p)] + extra


def always_split_slopes(h):
    """The authors' rule with p the largest power of two below h, also when
    h is one (for h = 8: 4 heads' slopes, then 8 heads' at even places)."""
    p = 1
    while p * 2 < h:
        p *= 2
    extra = [2 ** (-8 * (i + 1) / (2 * p)) for i in range(2 * p)][::2]
    return [2 ** (-8 * (i + 1) / p) for i in range(p)] + extra[: h - p]


def test_checker_messages_use_the_chapters_symbols():
    """Chapter 6 numbers ALiBi's heads r (slopes lambda_r) and writes m, n
    for the query's and the key's positions: no message of the two checkers
    may switch to i for a head or j for a key (issue 31, student report
    stud06). Pair i of RoPE is the chapter's own notation."""
    import re

    from attnbook.exercises import positional as ex

    alibi = [ex.ALIBI_HINT] + [
        m.description + " " + m.hint for m in ex.ALIBI_MISTAKES
    ]
    for text in alibi:
        assert not re.search(r"\b[ij]\b", text), text
    rope = [ex.ROPE_HINT] + [
        m.description + " " + m.hint for m in ex.ROPE_MISTAKES
    ]
    for text in rope:
        assert not re.search(r"\bj\b", text), text


def test_unrecognised_mistakes_get_the_exercises_conventions():
    """The fallback hint of the two checkers lists the exercise's own
    conventions, not "the chapter's derivation" (ALiBi's slopes are a rule,
    not derived; student report stud06)."""
    with pytest.raises(ExerciseError) as err:
        check_alibi_bias(
            lambda h, n: loop_bias(
                h, n, slopes=[0.3 ** (r + 1) for r in range(h)]
            )
        )
    assert err.value.mistake is None
    assert "derivation" not in str(err.value)
    assert "eq-ch6-alibi-slopes" in str(err.value)

    def base_500000(q, k, v):
        return F.scaled_dot_product_attention(
            my_rope(q, base=5e5, start=q_start(q, k)), my_rope(k, base=5e5), v
        )

    with pytest.raises(ExerciseError) as err:
        check_rope_attention(base_500000)
    assert err.value.mistake is None
    assert "derivation" not in str(err.value)
    assert "base 10000" in str(err.value)


def odd_place_slopes(h):
    """The authors' rule with the slip [1::2] for the extra slopes."""
    p = 2 ** (h.bit_length() - 1)
    extra = [2 ** (-8 * (i + 1) / (2 * p)) for i in range(2 * p)][1::2]
    return [2 ** (-8 * (i + 1) / p) for i in range(p)] + extra[: h - p]


def test_rope_dot_T_on_the_batch_gets_the_transpose_hint():
    """`.T` on the batched keys (3 axes) reverses every axis; the batched
    matmul then fails to broadcast with torch's size-mismatch message. The
    verdict must point at the transpose, not only at keepdims (no reduction
    is involved)."""
    import warnings

    def dot_T(q, k, v):
        scores = my_rope(q) @ my_rope(k).T / q.shape[-1] ** 0.5
        return torch.softmax(scores, dim=-1) @ v

    with warnings.catch_warnings():
        # torch warns that .T on more than 2 dimensions is deprecated
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(ExerciseError) as err:
            check_rope_attention(dot_T)
    message = str(err.value)
    assert "a batch of 2" in message and "RuntimeError" in message
    hint = message.split("Hint: ", 1)[1]
    assert ".T reverses every axis" in hint
    assert "k.transpose(-1, -2)" in hint
    assert hint.index("transpose the last two axes only") < hint.index(
        "keepdim"
    )


def test_alibi_paper_formula_for_twelve_heads_is_named_for_what_it_is():
    """The paper states 2^(-8 r / h) for any h (Press et al., section 3); it
    is the authors' code that uses another rule when h is not a power of
    two. The diagnosis must not call the paper's formula a power-of-two
    formula, nor credit the code's rule to the paper."""
    with pytest.raises(ExerciseError) as err:
        check_alibi_bias(
            lambda h, n: loop_bias(
                h, n, slopes=[2 ** (-8 * (r + 1) / h) for r in range(h)]
            )
        )
    message = str(err.value)
    assert err.value.mistake == "geometric_for_any_h"
    assert "the paper's general formula" in message
    assert "the authors' code" in message and "get_slopes" in message
    assert "power-of-two formula" not in message
    assert "Press et al. take" not in message
