"""Positional encodings: sinusoids, RoPE, ALiBi, and RoPE's frequency scalings.

The references here are written differently from the package:
element-by-element loops with ``math``, complex multiplication for the
rotations, and explicit d x d rotation matrices.
"""

import cmath
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnbook import positional as P
from attnbook import softmax


# --- sinusoidal table --------------------------------------------------------


def sinusoid_loop(n, d, base=10000.0):
    table = np.zeros((n, d))
    for pos in range(n):
        for i in range(d // 2):
            angle = pos / base ** (2 * i / d)
            table[pos, 2 * i] = math.sin(angle)
            table[pos, 2 * i + 1] = math.cos(angle)
    return table


@pytest.mark.parametrize(
    "n, d, base",
    [
        (1, 2, 10000.0),
        (7, 4, 10000.0),
        (50, 16, 10000.0),
        (9, 6, 100.0),
        (3, 128, 500000.0),
    ],
)
def test_sinusoidal_matches_the_formula(n, d, base):
    np.testing.assert_allclose(
        P.sinusoidal_positions(n, d, base),
        sinusoid_loop(n, d, base),
        atol=1e-12,
    )


def test_sinusoidal_matches_the_exp_log_form_in_torch():
    """The common implementation computes 1 / base^(2i/d) as exp(-2i ln(base) /
    d)."""
    n, d = 40, 32
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    div = torch.exp(
        torch.arange(0, d, 2, dtype=torch.float64) * (-math.log(10000.0) / d)
    )
    pe = torch.zeros(n, d, dtype=torch.float64)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    np.testing.assert_allclose(
        P.sinusoidal_positions(n, d), pe.numpy(), atol=1e-12
    )


@settings(max_examples=40, deadline=None)
@given(
    pos=st.floats(-200, 200), k=st.floats(-200, 200), half_d=st.integers(1, 12)
)
def test_shift_matrix_moves_any_row_by_k(pos, k, half_d):
    d = 2 * half_d
    w = P.pair_frequencies(d)
    row = lambda p: np.ravel(np.column_stack([np.sin(p * w), np.cos(p * w)]))  # noqa: E731
    np.testing.assert_allclose(
        row(pos) @ P.sinusoidal_shift_matrix(k, d), row(pos + k), atol=1e-9
    )


def test_shift_matrix_is_a_rotation_group():
    d = 10
    a, b = P.sinusoidal_shift_matrix(3, d), P.sinusoidal_shift_matrix(-7.5, d)
    np.testing.assert_allclose(a @ a.T, np.eye(d), atol=1e-12)
    np.testing.assert_allclose(
        a @ b, P.sinusoidal_shift_matrix(-4.5, d), atol=1e-12
    )
    np.testing.assert_allclose(
        P.sinusoidal_shift_matrix(0, d), np.eye(d), atol=0
    )
    pe = P.sinusoidal_positions(30, d)
    np.testing.assert_allclose(
        pe[:25] @ P.sinusoidal_shift_matrix(5, d), pe[5:], atol=1e-12
    )


def test_pair_frequencies():
    np.testing.assert_allclose(
        P.pair_frequencies(8, 10000.0), [1.0, 0.1, 0.01, 0.001]
    )
    assert P.pair_frequencies(2).shape == (1,)


def test_last_pair_frequency_is_base_to_the_minus_d_minus_2_over_d():
    # What the docstring states: the last pair turns at base^(-(d-2)/d), ten
    # times 1/base at d = 8 and close to 1/base only for a large d.
    base = 10000.0
    for d in (2, 8, 32, 128, 4096):
        last = P.pair_frequencies(d, base)[-1]
        assert last == pytest.approx(base ** (-(d - 2) / d), rel=1e-12)
    assert P.pair_frequencies(8, base)[-1] == pytest.approx(10 / base)
    assert P.pair_frequencies(4096, base)[-1] * base < 1.01


# --- RoPE --------------------------------------------------------------------


def rope_complex(x, positions, base=10000.0, layout="half"):
    """Reference: each pair as a complex number, multiplied by exp(i * pos *
    theta)."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    d = x.shape[-1]
    for idx in np.ndindex(x.shape[:-2]):
        for r in range(x.shape[-2]):
            for i in range(d // 2):
                a, b = (
                    (i, i + d // 2) if layout == "half" else (2 * i, 2 * i + 1)
                )
                z = complex(x[idx + (r, a)], x[idx + (r, b)])
                z *= cmath.exp(1j * positions[r] * base ** (-2 * i / d))
                out[idx + (r, a)], out[idx + (r, b)] = z.real, z.imag
    return out


def rotation_matrix(m, d, base=10000.0, layout="half"):
    """Reference: the d x d matrix R with rope(x at position m) = x @ R.T."""
    r = np.zeros((d, d))
    for i in range(d // 2):
        a, b = (i, i + d // 2) if layout == "half" else (2 * i, 2 * i + 1)
        t = m * base ** (-2 * i / d)
        r[a, a], r[a, b], r[b, a], r[b, b] = (
            math.cos(t),
            -math.sin(t),
            math.sin(t),
            math.cos(t),
        )
    return r


@pytest.mark.parametrize("layout", P.LAYOUTS)
@pytest.mark.parametrize("shape", [(1, 2), (5, 4), (3, 7, 6), (2, 2, 4, 8)])
def test_rope_matches_complex_multiplication(layout, shape, rng):
    x = rng.normal(size=shape)
    got = P.apply_rope(torch.from_numpy(x), layout=layout).numpy()
    np.testing.assert_allclose(
        got, rope_complex(x, np.arange(shape[-2]), layout=layout), atol=1e-12
    )


@pytest.mark.parametrize("layout", P.LAYOUTS)
def test_rope_matches_rotation_matrices_at_given_positions(layout, rng):
    x = rng.normal(size=(5, 12))
    positions = np.array([0.0, 3.0, 17.0, 1000.0, 2.5])
    got = P.apply_rope(
        torch.from_numpy(x), positions=positions, base=500.0, layout=layout
    ).numpy()
    for row, m in enumerate(positions):
        np.testing.assert_allclose(
            got[row],
            x[row] @ rotation_matrix(m, 12, 500.0, layout).T,
            atol=1e-10,
        )


@settings(max_examples=50, deadline=None)
@given(
    m=st.integers(0, 4000),
    n=st.integers(0, 4000),
    shift=st.integers(-3000, 3000),
    half_d=st.integers(1, 16),
    layout=st.sampled_from(P.LAYOUTS),
    seed=st.integers(0, 2**16),
)
def test_rope_scores_depend_only_on_the_offset(
    m, n, shift, half_d, layout, seed
):
    d = 2 * half_d
    g = np.random.default_rng(seed)
    q, k = (torch.from_numpy(g.normal(size=(1, d))) for _ in range(2))

    def score(pm, pn):
        return float(
            P.apply_rope(q, [pm], layout=layout)
            @ P.apply_rope(k, [pn], layout=layout).T
        )

    assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=1e-8)
    assert score(m, n) == pytest.approx(score(0, n - m), abs=1e-8)


def test_rope_preserves_norms_and_is_identity_at_zero(rng):
    x = torch.from_numpy(rng.normal(size=(3, 9, 10)))
    y = P.apply_rope(x, positions=torch.arange(100, 109))
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(P.apply_rope(x, positions=torch.zeros(9)), x)


def test_layout_permutation_converts_between_layouts(rng):
    d = 10
    perm = P.rope_layout_permutation(d)
    assert sorted(perm) == list(range(d))
    x = torch.from_numpy(rng.normal(size=(2, 6, d)))
    torch.testing.assert_close(
        P.apply_rope(x[..., perm], layout="half"),
        P.apply_rope(x, layout="interleaved")[..., perm],
    )
    # and the layouts really differ: weights trained with one give other scores
    # under the other
    assert not torch.allclose(
        P.apply_rope(x, layout="half"), P.apply_rope(x, layout="interleaved")
    )


def test_positions_offset_and_batched(rng):
    x = torch.from_numpy(rng.normal(size=(2, 5, 8)))
    long = P.apply_rope(
        torch.cat([torch.zeros(2, 3, 8, dtype=torch.float64), x], dim=1)
    )
    torch.testing.assert_close(
        P.apply_rope(x, positions=np.arange(3, 8)), long[:, 3:]
    )
    per_row = torch.tensor([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]])
    got = P.apply_rope(x, positions=per_row)
    torch.testing.assert_close(got[0], P.apply_rope(x[0]))
    torch.testing.assert_close(
        got[1], P.apply_rope(x[1], positions=range(10, 15))
    )


def test_frequencies_override(rng):
    x = torch.from_numpy(rng.normal(size=(4, 8)))
    torch.testing.assert_close(
        P.apply_rope(x, frequencies=P.pair_frequencies(8, 77.0)),
        P.apply_rope(x, base=77.0),
    )
    # position interpolation: frequencies / s is positions / s
    torch.testing.assert_close(
        P.apply_rope(
            x, frequencies=P.interpolated_frequencies(8, 10000.0, 4.0)
        ),
        P.apply_rope(x, positions=torch.arange(4) / 4.0),
    )


@pytest.mark.parametrize(
    "dtype, tol",
    [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)],
)
def test_rope_keeps_dtype(dtype, tol, rng):
    x64 = torch.from_numpy(rng.normal(size=(2, 300, 8)))
    got = P.apply_rope(x64.to(dtype), positions=torch.arange(1000, 1300))
    assert got.dtype == dtype
    expected = P.apply_rope(x64, positions=torch.arange(1000, 1300))
    assert (got.double() - expected).abs().max() < tol * 8


def test_rope_supports_autograd(rng):
    x = torch.from_numpy(rng.normal(size=(2, 4, 6))).requires_grad_()
    for layout in P.LAYOUTS:
        assert torch.autograd.gradcheck(
            lambda t: P.apply_rope(t, layout=layout), (x,)
        )
    # a rotation preserves the squared norm, so its gradient is 2x
    (P.apply_rope(x) ** 2).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: P.apply_rope(torch.zeros(3, 5)), "d .* must be even"),
        (lambda: P.apply_rope(np.zeros((3, 4))), "torch tensor"),
        (lambda: P.apply_rope(torch.zeros(4)), "at least 2 dimensions"),
        (lambda: P.apply_rope(torch.zeros(3, 4), layout="neox"), "layout"),
        (
            lambda: P.apply_rope(torch.zeros(3, 4), positions=[0, 1]),
            r"positions .*\(3,\).*got \(2,\)",
        ),
        (
            lambda: P.apply_rope(
                torch.zeros(2, 3, 4), positions=torch.zeros(5, 3)
            ),
            r"positions .*got \(5, 3\)",
        ),
        (
            lambda: P.apply_rope(torch.zeros(3, 4), frequencies=[1.0]),
            r"frequencies .*\(2,\)",
        ),
        (lambda: P.apply_rope(torch.zeros(3, 4), base=0.0), "base"),
        (lambda: P.sinusoidal_positions(4, 7), "d must be even"),
        (lambda: P.sinusoidal_positions(0, 8), "n must be a positive integer"),
        (
            lambda: P.sinusoidal_positions(4, -2),
            "d must be a positive integer",
        ),
        (lambda: P.sinusoidal_positions(4, 8, base=-1), "base"),
        (lambda: P.rope_layout_permutation(3), "d must be even"),
    ],
)
def test_bad_input_raises_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- ALiBi -------------------------------------------------------------------


def test_alibi_slopes_for_eight_heads():
    np.testing.assert_allclose(
        P.alibi_slopes(8),
        [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256],
    )


@pytest.mark.parametrize("h", [1, 2, 4, 16, 32])
def test_alibi_slopes_power_of_two_are_geometric(h):
    s = P.alibi_slopes(h)
    assert s[0] == pytest.approx(2 ** (-8 / h)) and s[-1] == pytest.approx(
        2**-8
    )
    np.testing.assert_allclose(s[1:] / s[:-1], 2 ** (-8 / h))


def test_alibi_slopes_twelve_heads_follow_the_authors_code():
    """The rule of the authors' get_slopes, not the paper's general formula
    2^(-8i/12): 8 heads' slopes, then the odd-indexed powers of 16 heads':
    2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5."""
    expected = [2.0**-e for e in (1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5)]
    np.testing.assert_allclose(P.alibi_slopes(12), expected)


@pytest.mark.parametrize("h", [3, 5, 6, 7, 12, 20, 24])
def test_alibi_slopes_other_counts_are_distinct_and_in_range(h):
    s = P.alibi_slopes(h)
    p = 2 ** int(math.log2(h))
    assert s.shape == (h,) and len(set(s)) == h
    np.testing.assert_allclose(s[:p], P.alibi_slopes(p))
    np.testing.assert_allclose(
        s[p:], P.alibi_slopes(2 * p)[0 : 2 * (h - p) : 2]
    )
    assert np.all((s > 0) & (s < 1))


@pytest.mark.parametrize(
    "h, n_q, n_k", [(1, 1, 1), (4, 5, 5), (3, 2, 7), (8, 1, 9)]
)
def test_alibi_bias_by_loops(h, n_q, n_k):
    bias = P.alibi_bias(h, n_q, n_k)
    slopes = P.alibi_slopes(h)
    assert bias.shape == (h, n_q, n_k)
    for head in range(h):
        for i in range(n_q):
            for j in range(n_k):
                assert bias[head, i, j] == -slopes[head] * abs(
                    n_k - n_q + i - j
                )


def test_alibi_bias_queries_are_the_last_rows():
    np.testing.assert_array_equal(
        P.alibi_bias(4, 3, 8), P.alibi_bias(4, 8)[:, -3:]
    )
    bias = P.alibi_bias(2, 6)
    # never positive, no -0.0 printed
    assert bias.max() == 0 and not np.signbit(bias[bias == 0]).any()


def test_alibi_causal_attention_equals_the_row_shifted_form(rng):
    """With a causal mask, -m (i - j) and the fairseq form +m j differ by a
    constant per row: same weights."""
    h, n = 4, 7
    scores = rng.normal(size=(h, n, n))
    j = np.arange(n)
    future = j[None, :] > j[:, None]
    ours = softmax(np.where(future, -np.inf, scores + P.alibi_bias(h, n)))
    shifted = softmax(
        np.where(
            future, -np.inf, scores + P.alibi_slopes(h)[:, None, None] * j
        )
    )
    np.testing.assert_allclose(ours, shifted, atol=1e-12)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: P.alibi_slopes(0), "n_heads"),
        (lambda: P.alibi_slopes(2.0), "n_heads"),
        (lambda: P.alibi_bias(4, 0), "n_q"),
        (lambda: P.alibi_bias(4, 5, 3), "n_q <= n_k"),
        (lambda: P.alibi_bias(True, 3), "n_heads"),
    ],
)
def test_alibi_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- NTK-aware scaling, position interpolation, YaRN -------------------------


@pytest.mark.parametrize("d, s", [(8, 4.0), (64, 2.0), (128, 8.0)])
def test_ntk_base_keeps_the_fastest_pair_and_interpolates_the_slowest(d, s):
    old = P.pair_frequencies(d)
    new = P.pair_frequencies(d, P.ntk_scaled_base(10000.0, s, d))
    assert new[0] == old[0] == 1.0
    assert new[-1] == pytest.approx(old[-1] / s, rel=1e-12)
    assert np.all(new <= old) and np.all(new >= old / s * (1 - 1e-12))


def test_yarn_frequencies_limits_and_ramp():
    d, base, s, length = 128, 10000.0, 4.0, 4096
    w = P.pair_frequencies(d, base)
    rotations = length * w / (2 * math.pi)
    y = P.yarn_frequencies(d, base, s, length)
    np.testing.assert_allclose(y[rotations > 32], w[rotations > 32])
    np.testing.assert_allclose(y[rotations < 1], w[rotations < 1] / s)
    between = (rotations >= 1) & (rotations <= 32)
    assert between.any()
    # from 1 down to 1/s as the pairs slow down
    ratio = y[between] / w[between]
    assert np.all(np.diff(ratio) <= 0) and np.all(
        (ratio >= 1 / s) & (ratio <= 1)
    )
    g = (rotations[between] - 1) / 31
    np.testing.assert_allclose(
        y[between], (1 - g) * w[between] / s + g * w[between]
    )


def test_yarn_logit_scale():
    assert P.yarn_logit_scale(1.0) == 1.0 and P.yarn_logit_scale(0.5) == 1.0
    assert P.yarn_logit_scale(4.0) == pytest.approx(
        (0.1 * math.log(4) + 1) ** 2
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: P.ntk_scaled_base(10000.0, 4.0, 2), "d >= 4"),
        (lambda: P.ntk_scaled_base(10000.0, -1.0, 8), "scale"),
        (
            lambda: P.yarn_frequencies(8, 10000.0, 4.0, 32, alpha=32, beta=1),
            "alpha",
        ),
        (lambda: P.yarn_frequencies(8, 10000.0, 4.0, 0), "original_length"),
        (lambda: P.interpolated_frequencies(8, 10000.0, 0.0), "scale"),
    ],
)
def test_scaling_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    "d, base, scale, length",
    [
        (128, 1e4, 4.0, 4096),
        (64, 1e4, 8.0, 2048),
        (128, 5e5, 4.0, 8192),
        (96, 1e4, 2.0, 1024),
    ],
)
def test_yarn_code_ramp_matches_transformers(d, base, scale, length):
    """ramp="code" is the frequency table that transformers builds for
    rope_type "yarn" (float32 there)."""
    # rope_parameters is transformers 5's name for the RoPE settings; the
    # minilm extra's lowest transformers (4.38) has no YaRN table to compare
    # with, so there the test is skipped.
    transformers = pytest.importorskip("transformers", minversion="5.0")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=4 * d,
        num_attention_heads=4,
        head_dim=d,
        max_position_embeddings=int(scale * length),
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": base,
            "factor": scale,
            "original_max_position_embeddings": length,
        },
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = P.yarn_frequencies(d, base, scale, length, ramp="code")
    np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=1e-6)


def test_the_two_yarn_ramps_agree_at_the_ends_and_differ_between():
    w = P.pair_frequencies(128, 1e4)
    paper, code = (
        P.yarn_frequencies(128, 1e4, 4, 4096),
        P.yarn_frequencies(128, 1e4, 4, 4096, ramp="code"),
    )
    # fastest pair kept, slowest interpolated
    for f in (paper, code):
        assert f[0] == w[0] and f[-1] == pytest.approx(w[-1] / 4)
    assert w[32] / paper[32] == pytest.approx(2.607, abs=1e-3) and w[
        32
    ] / code[32] == pytest.approx(1.529, abs=1e-3)
    with pytest.raises(ValueError, match="ramp must be one of"):
        P.yarn_frequencies(128, 1e4, 4, 4096, ramp="linear")


# --- learned relative positions, and the RoPE base in practice ---------------


def test_shaw_relative_index_by_loops():
    for n_q, n_k, k in [(4, 4, 2), (3, 7, 3), (1, 5, 1), (6, 6, 10)]:
        got = P.shaw_relative_index(n_q, n_k, k)
        assert got.shape == (n_q, n_k)
        for a in range(n_q):
            # queries are the last n_q positions
            i = n_k - n_q + a
            for j in range(n_k):
                assert got[a, j] == min(max(j - i, -k), k) + k


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(
    "num_buckets, max_distance",
    [(32, 128), (16, 64), (64, 256), (8, 20), (6, 9), (32, 1000)],
)
def test_t5_buckets_match_transformers(
    bidirectional, num_buckets, max_distance
):
    """The bucket of every offset in [-5000, 5000] is
    T5Attention._relative_position_bucket's."""
    pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = np.arange(-5000, 5001)
    theirs = T5Attention._relative_position_bucket(
        torch.from_numpy(rel), bidirectional, num_buckets, max_distance
    ).numpy()
    ours = P.t5_relative_position_bucket(
        rel, bidirectional, num_buckets, max_distance
    )
    # where a bucket boundary falls exactly on an integer distance, theirs
    # floors a float32 log that may land either side (it moves with the
    # machine's log); those ties are checked exactly below
    keep = ~np.isin(
        np.abs(rel), _t5_exact_ties(num_buckets, max_distance, bidirectional)
    )
    np.testing.assert_array_equal(ours[keep], theirs[keep])


def _t5_exact_ties(num_buckets, max_distance, bidirectional):
    """Distances d with (d/e)^L == (M/e)^k exactly, for some k."""
    per_side = num_buckets // 2 if bidirectional else num_buckets
    e, n_log = per_side // 2, per_side - per_side // 2
    return [
        d
        for d in range(e, max_distance + 1)
        for k in range(1, n_log)
        if Fraction(d, e) ** n_log == Fraction(max_distance, e) ** k
    ]


@pytest.mark.parametrize(
    "num_buckets, max_distance",
    [(32, 128), (16, 64), (64, 256), (8, 20), (6, 9), (32, 1000), (12, 64)],
)
def test_t5_bucket_starts_by_exact_arithmetic(num_buckets, max_distance):
    """Each start is the least integer d with (d/e)^L >= (M/e)^k, found by
    trying every distance in rational arithmetic."""
    e, n_log = num_buckets // 2, num_buckets - num_buckets // 2
    starts = P.t5_bucket_starts(e, max_distance, n_log)
    for k, start in enumerate(starts, 1):
        reached = [
            d
            for d in range(e, max_distance + 1)
            if Fraction(d, e) ** n_log >= Fraction(max_distance, e) ** k
        ]
        assert start == reached[0], (k, start, reached[0])


def test_t5_bucket_on_an_exact_boundary():
    """3 buckets a side, 1 exact, max 9: 1 + 2 log(d)/log(9) is exactly 2 at
    d = 3, so distance 3 opens bucket 2 (a float log once put it in 1)."""
    rel = np.array([-2, -3, -8, -9, 2, 3])
    expected = [1, 2, 2, 2, 4, 5]
    assert P.t5_relative_position_bucket(rel, True, 6, 9).tolist() == expected
    # the default T5 layout has ties too: 8 * 2^(k/2) = 16, 32, 64
    starts = P.t5_bucket_starts(8, 128, 8).tolist()
    assert starts[1] == 16 and starts[3] == 32 and starts[5] == 64


def test_t5_buckets_by_their_definition():
    """Written from the paper's description, not the code: 8 exact distances,
    then log-spaced up to 128."""
    rel = np.arange(-300, 301)
    b = P.t5_relative_position_bucket(rel, bidirectional=True)
    dist = np.abs(rel)
    assert np.array_equal(
        b[(dist < 8) & (rel <= 0)], dist[(dist < 8) & (rel <= 0)]
    )
    assert np.array_equal(
        b[(dist < 8) & (rel > 0)], 16 + dist[(dist < 8) & (rel > 0)]
    )
    assert np.all(b[rel <= -128] == 15) and np.all(b[rel >= 128] == 31)
    # distances 0, 1, ..., 300 back
    back = b[rel <= 0][::-1]
    assert np.all(np.diff(back) >= 0) and set(back) == set(range(16))
    causal = P.t5_relative_position_bucket(rel, bidirectional=False)
    assert np.all(causal[rel > 0] == 0) and causal.max() == 31


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: P.t5_relative_position_bucket(np.array([0.5])), "integers"),
        (
            lambda: P.t5_relative_position_bucket(np.arange(3), num_buckets=2),
            "at least 4",
        ),
        (
            lambda: P.t5_relative_position_bucket(
                np.arange(3), num_buckets=32, max_distance=8
            ),
            "max_distance",
        ),
        (lambda: P.shaw_relative_index(5, 3), "n_q <= n_k"),
        (lambda: P.shaw_relative_index(3, 3, 0), "max_distance"),
    ],
)
def test_relative_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _transformers_frequencies(rope_parameters, d):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(
        hidden_size=4 * d,
        num_attention_heads=4,
        head_dim=d,
        max_position_embeddings=131072,
        rope_parameters=rope_parameters,
    )
    return LlamaRotaryEmbedding(config).inv_freq.double().numpy()


@pytest.mark.parametrize("base", [1e4, 5e5, 1e6])
def test_rope_base_matches_transformers_default(base):
    """Llama 2's base 10^4, Llama 3's 500000 (ABF-style raised base), Code
    Llama's 10^6."""
    theirs = _transformers_frequencies(
        {"rope_type": "default", "rope_theta": base}, 128
    )
    np.testing.assert_allclose(
        P.pair_frequencies(128, base), theirs, rtol=1e-6
    )


@pytest.mark.parametrize(
    "d, base, scale, length, low, high",
    [
        (128, 5e5, 8.0, 8192, 1.0, 4.0),
        (64, 5e5, 32.0, 8192, 1.0, 4.0),
        (128, 1e4, 4.0, 4096, 2.0, 8.0),
    ],
)
def test_llama3_frequencies_match_transformers(
    d, base, scale, length, low, high
):
    """llama3_frequencies is ROPE_INIT_FUNCTIONS["llama3"]'s table (float32
    there)."""
    pytest.importorskip("transformers", minversion="5.0")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=4 * d,
        num_attention_heads=4,
        head_dim=d,
        max_position_embeddings=int(scale * length),
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": base,
            "factor": scale,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": length,
        },
    )
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    # no YaRN temperature
    assert attention_factor == 1.0
    np.testing.assert_allclose(
        P.llama3_frequencies(d, base, scale, length, low, high),
        theirs.double().numpy(),
        rtol=1e-6,
    )


def test_llama3_frequencies_by_wavelength():
    """From Llama 3.1's rule written by wavelength: kept below L/4, divided by
    8 above L, blended in turns."""
    w = P.pair_frequencies(128, 5e5)
    got = P.llama3_frequencies(128, 5e5, 8, 8192)
    wavelength = 2 * np.pi / w
    short, long = wavelength < 8192 / 4, wavelength > 8192
    np.testing.assert_array_equal(got[short], w[short])
    np.testing.assert_allclose(got[long], w[long] / 8, rtol=1e-15)
    mid = ~short & ~long
    g = (8192 / wavelength[mid] - 1) / 3
    np.testing.assert_allclose(
        got[mid], (1 - g) * w[mid] / 8 + g * w[mid], rtol=1e-12
    )
    assert mid.sum() > 0
