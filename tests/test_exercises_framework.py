"""The diagnosis shared by every checker: a NaN in the reader's output is not
evidence of *which* mistake made it.

``same`` counts NaN as equal to NaN, so on a case where the reader's softmax
overflows, every mistake that also overflows there matches it. These tests
build a small checker of the kind the book had (an online softmax returning
probabilities) and feed it wrong answers written here, independently of its
Mistake functions.
"""

import math

import numpy as np
import pytest

from attnbook.exercises import ExerciseError
from attnbook.exercises._framework import (
    Case,
    Mistake,
    diagnose,
    run_checks,
    same,
)
from attnbook.exercises.flash import check_online_softmax


def _softmax(x):
    x = np.asarray(x, float)
    if np.all(np.isneginf(x)):
        return np.zeros_like(x)
    e = np.exp(x - x.max())
    return e / e.sum()


MAX_NOT_UPDATED = Mistake(
    "max_not_updated",
    "the maximum stays at the first score",
    "update the maximum",
    lambda x: (lambda x: np.exp(x - x[0]) / np.sum(np.exp(x - x[0])))(
        np.asarray(x, float)
    ),
)
UNSHIFTED = Mistake(
    "unshifted",
    "no maximum is subtracted: exp(x) overflows to inf past ~710, and inf / "
    "inf is NaN",
    "subtract the running maximum",
    lambda x: (lambda e: e / e.sum())(np.exp(np.asarray(x, float))),
)


def _unguarded_recurrence(x):
    x = np.asarray(x, float)
    m, l = -np.inf, 0.0
    for v in x:
        m_new = max(m, v)
        l, m = l * np.exp(m - m_new) + np.exp(v - m_new), m_new
    return np.exp(x - m) / l


NAN_ON_MASKED_START = Mistake(
    "nan_on_masked_start",
    "a row that starts masked gives NaN",
    "guard the -inf maximum",
    _unguarded_recurrence,
)

# no case here tells an unshifted exponential from a stale maximum by finite
# values
CASES = [
    Case("a row of 8 scores", (np.random.default_rng(0).normal(size=8),)),
    Case(
        "scores growing to 3000",
        (np.array([0.0, 800.0, 1600.0, 2400.0, 3000.0]),),
    ),
    Case(
        "a row that starts masked",
        (np.array([-np.inf, -np.inf, 0.3, 1.2, -np.inf, 0.8]),),
    ),
]


def check(fn, mistakes):
    run_checks("softmax of a row", fn, CASES, _softmax, mistakes)


def reader_unshifted(x):
    """The textbook formula in a loop: exp of each score, no maximum
    anywhere."""
    terms = [math.exp(v) if v < 710 else math.inf for v in x]
    total = sum(terms)
    # inf / inf is NaN in Python too
    return np.array([t / total for t in terms])


def reader_first_score_as_max(x):
    m = x[0]
    terms = [math.exp(v - m) if v - m < 710 else math.inf for v in x]
    total = sum(terms)
    # inf / inf is NaN in Python too
    return np.array([t / total for t in terms])


def reader_unguarded(x):
    """Right, except that a row starting with -inf computes exp(-inf - (-inf))
    = NaN."""
    m, l, _acc = -math.inf, 0.0, []
    for v in x:
        m_new = max(m, v)
        scale = math.nan if m_new == -math.inf else math.exp(m - m_new)
        l = l * scale + (
            math.nan if m_new == -math.inf else math.exp(v - m_new)
        )
        m = m_new
    return np.array([math.exp(v - m) / l for v in x])


def test_a_nan_match_alone_does_not_name_a_mistake():
    # Both overflow on 'growing to 3000', so NaN == NaN made the stale maximum
    # match there. But on a row that starts masked the stale maximum (-inf)
    # gives NaN where the reader is right: it is not the reader's mistake, and
    # no mistake is named.
    with pytest.raises(ExerciseError) as err, np.errstate(all="ignore"):
        check(reader_unshifted, [MAX_NOT_UPDATED])
    assert err.value.case == "scores growing to 3000"
    assert err.value.mistake is None
    assert "NaN or inf where the answer is finite" in str(err.value)


def test_the_unshifted_exponential_is_named_as_overflow():
    with pytest.raises(ExerciseError) as err, np.errstate(all="ignore"):
        check(reader_unshifted, [MAX_NOT_UPDATED, UNSHIFTED])
    assert err.value.mistake == "unshifted"
    assert "overflows" in str(err.value)


def test_a_stale_maximum_is_still_named():
    with pytest.raises(ExerciseError) as err, np.errstate(all="ignore"):
        check(reader_first_score_as_max, [UNSHIFTED, MAX_NOT_UPDATED])
    assert err.value.mistake == "max_not_updated"


def test_a_mistake_whose_signature_is_nan_is_still_named():
    with pytest.raises(ExerciseError) as err, np.errstate(all="ignore"):
        check(
            reader_unguarded, [MAX_NOT_UPDATED, UNSHIFTED, NAN_ON_MASKED_START]
        )
    assert err.value.case == "a row that starts masked"
    assert err.value.mistake == "nan_on_masked_start"


def test_wrong_finite_values_keep_a_match_strong():
    # A NaN beside wrong finite values: the finite values identify the mistake,
    # even though the mistake's function also breaks on another case where the
    # reader's does not.
    halve = Mistake(
        "halved",
        "halved",
        "do not halve",
        lambda x: (
            np.where(np.asarray(x) > 5, np.nan, np.asarray(x) / 2)
            if len(x) > 1
            else np.nan
        ),
    )
    case = Case("a row", (np.array([1.0, 2.0, 9.0]),))
    other = Case("one score", (np.array([4.0]),))
    reader = lambda x: np.where(x > 5, np.nan, x / 2)  # noqa: E731
    got = reader(*case.args)
    assert (
        diagnose(
            got,
            case,
            [halve],
            same,
            reader,
            [other],
            expected=np.array([1.0, 2.0, 9.0]),
        )
        is halve
    )


def _halving_cases():
    # halving and subtracting 1 coincide here
    first = Case("blind", (np.array([2.0, 2.0]),))
    others = [
        Case(f"other {i}", (np.array([float(i), 4.0 + i]),))
        for i in range(3, 6)
    ]
    return first, others


def test_a_match_the_other_cases_contradict_names_no_mistake():
    # One mistake matches on a case blind to the difference; every other case
    # contradicts it.
    halve = Mistake("halved", "halved", "do not halve", lambda x: x / 2)
    first, others = _halving_cases()
    reader = lambda x: x - 1  # noqa: E731
    assert (
        diagnose(
            reader(*first.args),
            first,
            [halve],
            same,
            reader,
            others,
            expected=first.args[0],
            reference=lambda x: x,
        )
        is None
    )


def test_a_match_most_other_cases_confirm_is_kept():
    # The reader halves too, except on one edge case (where it clips): still
    # the halving mistake.
    halve = Mistake("halved", "halved", "do not halve", lambda x: x / 2)
    first, others = _halving_cases()
    reader = lambda x: np.minimum(x / 2, 4.0)  # noqa: E731   differs from x / 2 on "other 5" only
    assert (
        diagnose(
            reader(*first.args),
            first,
            [halve],
            same,
            reader,
            others,
            expected=first.args[0],
            reference=lambda x: x,
        )
        is halve
    )


def test_the_online_softmax_exercise_names_an_unshifted_exponential():
    def online_exp_sum(scores):
        m, l = -math.inf, 0.0
        for v in scores:
            m = max(m, v)
            l += math.exp(v) if v < 710 else math.inf
        return m, l

    with pytest.raises(ExerciseError) as err, np.errstate(all="ignore"):
        check_online_softmax(online_exp_sum)
    assert err.value.mistake == "unshifted" and "overflows" in str(err.value)


# --- the catalogues: every checker against plausible wrong and right solutions
# ------------------------------ Each tests/test_exercises_*.py holds a
# CATALOGUE {checker name: {"wrong": [(solution, mistake key)], "right":
# [solution]}}, written as a teaching assistant would collect them: what a
# student who half-understood the section writes, independently of the
# checkers' own Mistake functions.

import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import io  # noqa: E402
import pathlib  # noqa: E402

import attnbook.exercises as exercises  # noqa: E402

TESTS = pathlib.Path(__file__).parent
MIN_WRONG, MIN_RIGHT = 5, 2


def _load(path):
    spec = importlib.util.spec_from_file_location(
        f"catalogue_{path.stem}", path
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# checker name -> (test file, its catalogue entry)
CATALOGUES = {}
for _path in sorted(TESTS.glob("test_exercises_*.py")):
    if _path.name == pathlib.Path(__file__).name:
        continue
    for _name, _entry in getattr(_load(_path), "CATALOGUE", {}).items():
        assert _name not in CATALOGUES, f"{_name} has two catalogues"
        CATALOGUES[_name] = (_path.name, _entry)

CHECKERS = sorted(
    name for name in exercises.__all__ if name.startswith("check_")
)


def _checker(name):
    return getattr(exercises, name)


def test_every_checker_has_a_catalogue():
    missing = [name for name in CHECKERS if name not in CATALOGUES]
    assert not missing, f"checkers without a catalogue: {missing}"
    assert not set(CATALOGUES) - set(CHECKERS), "a catalogue names no checker"
    for name, (_, entry) in CATALOGUES.items():
        assert len(entry["wrong"]) >= MIN_WRONG, (
            f"{name}: {len(entry['wrong'])} wrong solutions"
        )
        assert len(entry["right"]) >= MIN_RIGHT, (
            f"{name}: {len(entry['right'])} right solutions"
        )
        keys = {m.key for m in _mistakes_of(name)}
        unknown = {key for _, key in entry["wrong"]} - keys
        assert not unknown, f"{name}: no mistake named {unknown}"


def _mistakes_of(name):
    """The Mistakes a checker can name: those of its module whose keys its
    catalogue uses."""
    module = importlib.import_module(_checker(name).__module__)
    found = []
    for value in vars(module).values():
        if (
            isinstance(value, list)
            and value
            and all(isinstance(m, exercises.Mistake) for m in value)
        ):
            found += value
    return found


WRONG = [
    pytest.param(name, i, id=f"{name}-{key}-{i}")
    for name in sorted(CATALOGUES)
    for i, (_, key) in enumerate(CATALOGUES[name][1]["wrong"])
]
RIGHT = [
    pytest.param(name, i, id=f"{name}-{i}")
    for name in sorted(CATALOGUES)
    for i in range(len(CATALOGUES[name][1]["right"]))
]


@pytest.mark.parametrize("name, i", WRONG)
def test_each_wrong_solution_is_rejected_with_its_diagnosis(name, i):
    solution, key = CATALOGUES[name][1]["wrong"][i]
    with (
        pytest.raises(ExerciseError) as err,
        np.errstate(all="ignore"),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        _checker(name)(solution)
    assert err.value.mistake == key, str(err.value)
    assert "Diagnosis:" in str(err.value) and "Hint:" in str(err.value)


@pytest.mark.parametrize("name, i", RIGHT)
def test_each_right_solution_is_accepted(name, i, capsys):
    _checker(name)(CATALOGUES[name][1]["right"][i])
    assert capsys.readouterr().out.splitlines()[-1].startswith("Correct:")


def catalogue_table() -> str:
    """Per checker, the wrong solutions rejected with their diagnosis and the
    right ones accepted (the counts the tests above hold)."""
    rows = [
        f"| {name} | {len(entry['wrong'])} | {len(entry['right'])} |"
        for name, (_, entry) in sorted(CATALOGUES.items())
    ]
    return "\n".join(
        [
            "| checker | wrong, rejected and named | right, accepted |",
            "|---|---|---|",
            *rows,
        ]
    )


# --- the framework: pristine references, in-place changes, broadcast errors --

NUMPY_CHECKER_MODULES = (
    "attention",
    "embeddings",
    "flash",
    "kv_cache",
    "masking",
    "multihead",
    "perspectives",
    "qkv",
    "triton_flash",
)


def test_the_numpy_checkers_load_and_run_without_torch():
    """The browser's exercise notebooks load these with torch missing; the
    linear-attention time check (which limits torch's threads only where torch
    is already imported) runs there too."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        + "".join(
            f"import attnbook.exercises.{m}\n" for m in NUMPY_CHECKER_MODULES
        )
        + "import numpy as np\n"
        "from attnbook.exercises import check_linear_attention, "
        "check_softmax\n"
        "from attnbook.linear_attention import elu_feature_map\n"
        "def linear(q, k, v):\n"
        "    fq, fk = elu_feature_map(q), elu_feature_map(k)\n"
        "    return (fq @ (np.swapaxes(fk, -1, -2) @ v)) / (fq @ "
        "fk.sum(-2)[..., None])\n"
        "check_linear_attention(linear)\n"
        "check_softmax(lambda x: np.exp(x - x.max(-1, keepdims=True)) "
        "/ np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("Correct:") == 2, done.stdout


def test_a_function_that_changes_its_inputs_is_judged_on_its_output_with_one_note(
    capsys,
):
    from attnbook.exercises import check_attention, check_cross_attention
    from attnbook.exercises.scaling import check_scaled_scores

    def scores(q, k):
        q /= np.sqrt(q.shape[-1])
        return q @ np.swapaxes(k, -1, -2)

    def attention(q, k, v, mask=None):
        q /= np.sqrt(q.shape[-1])
        s = q @ np.swapaxes(k, -1, -2)
        if mask is not None:
            s = np.where(mask, s, -np.inf)
        m = s.max(-1, keepdims=True)
        e = np.exp(s - np.where(np.isfinite(m), m, 0))
        total = e.sum(-1, keepdims=True)
        return np.divide(e, total, out=np.zeros_like(e), where=total > 0) @ v

    def cross(x, context, w_q, w_k, w_v):
        q = x @ w_q
        # a fresh array: changes nothing of the caller's
        q /= np.sqrt(q.shape[-1])
        # changes x, but not its values
        x *= 1.0
        w_k /= 1.0
        s = q @ (context @ w_k).T
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True) @ (context @ w_v)

    check_scaled_scores(scores)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "Note: scaled scores: your function changed its input `q` in place "
        "(first in case "
        "'n_q = 3, n_k = 5, d_k = 16'). The checker gave it fresh copies and "
        "judged only what it "
        "returned; a caller who still needs those arrays would find them "
        "changed.",
        "Correct: scaled scores passes all 7 cases.",
    ]
    check_attention(attention)
    out = capsys.readouterr().out.splitlines()
    assert (
        len(out) == 2
        and out[0].startswith(
            "Note: scaled dot-product attention: your function changed "
            "its input `q`"
        )
        and out[1].startswith("Correct:")
    )
    check_cross_attention(cross)  # values unchanged: no note
    assert capsys.readouterr().out.splitlines() == [
        "Correct: cross-attention passes all 4 cases."
    ]


def test_the_reference_sees_pristine_inputs_even_when_the_reader_changes_them():
    calls = []

    def reference(x):
        calls.append(x.copy())
        return x * 2

    def reader(x):
        # ruins its input, returns the right answer of the original
        x += 100.0
        return (x - 100.0) * 2

    case = Case("one", (np.array([1.0, 2.0]),))
    run_checks("doubling", reader, [case], reference)
    assert np.array_equal(calls[0], [1.0, 2.0]) and np.array_equal(
        case.args[0], [1.0, 2.0]
    )


def test_a_broadcast_error_names_keepdims():
    from attnbook.exercises.attention import SOFTMAX_MISTAKES
    from attnbook.softmax import softmax

    def no_keepdims(x):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1)

    # a matrix that is not square: it raises
    with pytest.raises(ExerciseError) as err:
        run_checks(
            "softmax",
            no_keepdims,
            [Case("4 x 6", (np.zeros((4, 6)),))],
            softmax,
            SOFTMAX_MISTAKES,
        )
    assert err.value.mistake == "no_keepdims" and "raised ValueError" in str(
        err.value
    )
    assert "keepdims=True" in str(err.value)
    # no mistake to name: the hint still says it
    with pytest.raises(ExerciseError) as err:
        run_checks(
            "rows",
            lambda x: x / x.sum(axis=-1),
            [Case("4 x 6", (np.ones((4, 6)),))],
            lambda x: x / x.sum(-1, keepdims=True),
        )
    assert err.value.mistake is None and "keepdims=True" in str(err.value)


def test_a_torch_size_mismatch_names_keepdim():
    import torch

    with pytest.raises(ExerciseError, match="keepdim=True"):
        run_checks(
            "rows",
            lambda x: (lambda t: t / t.sum(-1))(torch.from_numpy(x)),
            [Case("4 x 6", (np.ones((4, 6)),))],
            lambda x: x / x.sum(-1, keepdims=True),
        )


def test_a_single_matching_mistake_is_dropped_when_it_is_wrong_where_the_reader_is_right():
    """A mistake that matches the reader's output on the failing case, but is
    wrong on a case the reader got right, is not the reader's: before, a lone
    candidate was never checked (chapter 10's reader: 'clamp to n_q' named
    'top_left', 'causal divided by 4' named 'half_forward')."""
    plus_three = Mistake("plus_three", "adds 3", "double it", lambda x: x + 3)
    cases = [
        Case("x = 5", (np.array([5.0]),)),
        Case("x = 2", (np.array([2.0]),)),
    ]
    double = lambda x: 2 * x  # noqa: E731
    # right on 'x = 5', x + 3 on 'x = 2'
    with pytest.raises(ExerciseError) as err:
        run_checks(
            "double",
            lambda x: np.where(x > 3, 2 * x, x + 3),
            cases,
            double,
            [plus_three],
        )
    assert err.value.case == "x = 2" and err.value.mistake is None
    # x + 3 everywhere: the match stands
    with pytest.raises(ExerciseError) as err:
        run_checks("double", lambda x: x + 3, cases, double, [plus_three])
    assert err.value.case == "x = 5" and err.value.mistake == "plus_three"


def test_equal_infinities_count_as_agreeing_in_the_largest_difference():
    """Two empty softmax states are (-inf, 0); an answer (-inf, 1) differs by
    1, not by inf - inf = NaN."""
    from attnbook.exercises._framework import difference

    message = difference(np.array([-np.inf, 1.0]), np.array([-np.inf, 0.0]))
    assert "largest difference 1" in message and "nan" not in message


# --- error_hint: shape errors on matrices and on batches ---------------------


def _hint(message: str) -> str:
    return message.split("Hint: ", 1)[1]


def test_a_numpy_matmul_error_on_matrices_does_not_speak_of_batches():
    """Chapter 2's reader: a missing transpose on 2-d inputs (x @ w_q @ w_k.T
    @ x) was answered with advice about batches of 3 or more axes, which sends
    the reader the wrong way. The hint now says to check which axis holds the
    features."""
    from attnbook.exercises.qkv import check_attention_scores

    with pytest.raises(ExerciseError) as err:
        check_attention_scores(lambda x, w_q, w_k: x @ w_q @ w_k.T @ x)
    hint = _hint(str(err.value))
    assert "raised ValueError: matmul" in str(err.value)
    assert "which axis" in hint and "features" in hint
    assert "batch" not in hint and "swapaxes" not in hint


def test_a_numpy_matmul_error_on_a_batch_names_the_transpose():
    q = np.random.default_rng(0).normal(size=(2, 5, 8))
    with pytest.raises(ExerciseError) as err:
        run_checks(
            "scores",
            lambda q, k: q @ k.T,
            [Case("a batch of 2", (q, q))],
            lambda q, k: q @ np.swapaxes(k, -1, -2),
        )
    hint = _hint(str(err.value))
    assert ".T reverses every axis" in hint
    assert "np.swapaxes(k, -1, -2)" in hint


@pytest.mark.filterwarnings("ignore:The use of `x.T`:UserWarning")
@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_a_size_mismatch_on_a_batch_gives_the_transpose_hint_first(library):
    """On inputs of 3 or more axes, k.T reverses every axis and the batched
    matmul fails to broadcast, with the message a reduction without keepdims
    gives (chapter 6's reader: the RoPE checker answered `.T` with the
    keepdims hint alone). The transpose hint now comes first, then keepdims."""
    import torch

    # n = d, so the matrix axes fit and only the batch axes (3 against 4)
    # clash
    x = np.random.default_rng(1).normal(size=(3, 4, 4))
    if library == "torch":
        x = torch.from_numpy(x)

    def reference(q, k):
        return q @ (
            k.transpose(-1, -2)
            if library == "torch"
            else np.swapaxes(k, -1, -2)
        )

    with pytest.raises(ExerciseError) as err:
        run_checks(
            "scores",
            lambda q, k: q @ k.T,
            [Case("a batch of 3", (x, x))],
            reference,
        )
    message = str(err.value)
    assert (
        "could not be broadcast" in message
        or "must match the size of tensor" in message
    )
    hint = _hint(message)
    assert "transpose the last two axes only" in hint
    assert "keepdim" in hint
    assert hint.index(".T reverses every axis") < hint.index("keepdim")


def test_a_size_mismatch_on_matrices_still_gets_the_keepdims_hint_alone():
    import torch

    with pytest.raises(ExerciseError) as err:
        run_checks(
            "rows",
            lambda x: (lambda t: t / t.sum(-1))(torch.from_numpy(x)),
            [Case("4 x 6", (np.ones((4, 6)),))],
            lambda x: x / x.sum(-1, keepdims=True),
        )
    hint = _hint(str(err.value))
    assert hint.startswith("a reduction along an axis") and ".T" not in hint


def test_a_transposed_2d_pair_is_named_as_operand_order_not_batches():
    """Checker reading chk-mla, E5: (h, n) + (n, h) from a product with its
    operands in the wrong order was answered with the batch and keepdims
    hints (the case had a 3-axis input). The hint now names the operand
    order; a genuine batch error keeps the batch hint (test above)."""
    rng = np.random.default_rng(3)
    q = rng.normal(size=(3, 4))
    keys = rng.normal(size=(7, 4))
    stack = rng.normal(size=(2, 4, 4))  # a 3-axis input, as in the MLA case

    def wrong(q, keys, stack):
        return q @ keys.T + keys @ q.T

    with pytest.raises(ExerciseError) as err:
        run_checks(
            "scores",
            wrong,
            [Case("3 queries, 7 keys", (q, keys, stack))],
            lambda q, keys, stack: 2 * q @ keys.T,
        )
    hint = _hint(str(err.value))
    assert "(3, 7) and (7, 3)" in hint and "wrong order" in hint
    assert "keepdims" not in hint and ".T reverses every axis" not in hint
