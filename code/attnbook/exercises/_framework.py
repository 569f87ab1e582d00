"""The machinery every exercise checker shares.

A checker runs the reader's function on a list of :class:`Case` s and compares
each result with a reference solution. When they differ it also runs a list of
:class:`Mistake` s (each a deliberately wrong implementation of a classic
error) on the same inputs: if the reader's output matches one of them, the
verdict names that mistake and gives its hint. Diagnosing by *behaviour* means
a checker recognises a mistake however the reader happened to write it.

Every chapter's checker runs on it; no chapter shows it.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

# the library's; re-exported here
from ..verdicts import ExerciseError, NotAttemptedError


@dataclass(frozen=True)
class Case:
    """One set of inputs for the reader's function, with a name the verdict can
    cite."""

    name: str
    args: tuple
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Mistake:
    """A classic error: a key, what it is, a hint, and a function that commits
    it.

    ``raises``, when given, recognises the mistake by the exception it makes
    the reader's code
    raise (a broadcast error where ``keepdims`` was forgotten): ``raises(err)``
    is True for it.
    """

    key: str
    description: str
    hint: str
    commit: Callable
    raises: Callable[[Exception], bool] | None = None


def pristine(value):
    """A copy of a case's argument that no function can change under the
    checker: arrays and tensors are copied (tuples, lists and dicts of them
    too); anything else is passed as it is."""
    if isinstance(value, np.ndarray):
        return value.copy()
    # a torch tensor
    if hasattr(value, "detach") and hasattr(value, "clone"):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(pristine(v) for v in value)
    if isinstance(value, list):
        return [pristine(v) for v in value]
    if isinstance(value, dict):
        return {k: pristine(v) for k, v in value.items()}
    return value


def fresh(case: "Case") -> "Case":
    """``case`` with copies of its arguments (:func:`pristine`)."""
    return Case(case.name, pristine(case.args), pristine(case.kwargs))


# --- memory: numpy's arrays and torch's allocations --------------------------


def peak_memory_with_torch(fn, *args, **kwargs) -> tuple[object, int]:
    """Run the reader's ``fn`` on copies of ``args`` and ``kwargs``
    (:func:`pristine`); return ``(its result, its peak memory in bytes)``.

    The peak is the larger of two measurements, whatever type ``fn``
    returns: :mod:`tracemalloc`'s peak (numpy's arrays, Python's objects),
    and, when torch has been imported (:func:`torch_profiler_ready`), the
    largest single allocation torch's profiler saw in a second call on fresh
    copies (:func:`largest_torch_allocation`): tracemalloc does not see
    torch's allocator, so an answer that computes in torch and returns a
    numpy array would otherwise pass for one that allocates nothing. Without
    torch (the browser) the peak is tracemalloc's alone. The result is the
    first call's."""
    from ..bench import peak_memory

    out, peak = peak_memory(fn, *pristine(args), **pristine(kwargs))
    if torch_profiler_ready():
        _, largest = largest_torch_allocation(
            fn, *pristine(args), **pristine(kwargs)
        )
        peak = max(peak, largest)
    return out, peak


def is_reader_code(filename: str) -> bool:
    """Whether code from ``filename`` is the reader's own (a notebook cell, a
    script, the reader's module) rather than a library's: numpy, torch and
    everything else installed, the standard library and attnbook are
    libraries."""
    import os

    if filename.startswith(("<frozen", "<__array_function__")):
        # numpy before 1.25 runs its dispatch wrappers from a pseudo-file
        # "<__array_function__ internals>": library code too
        return False
    return not os.path.realpath(filename).startswith(_library_paths())


def _library_paths() -> tuple[str, ...]:
    import os
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple(
        os.path.realpath(paths[key]) + os.sep
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if key in paths
    ) + (
        os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep,
    )


# a line's excursion below this is not counted as copying: a few rows of
# numbers, a Python object or two, what the tracing itself allocates
SMALL_EXCURSION = 64 * 1024


def allocation_volume(fn, *args) -> tuple[object, int]:
    """Call ``fn(*args)``; return ``(its result, the bytes it allocated line
    by line)``: the sum, over the lines of the reader's own code that run
    (:func:`is_reader_code`, helpers, lambdas and generator expressions
    included), of how far :mod:`tracemalloc`'s traced memory rose above its
    value at the start of the line, counting only rises of at least
    ``SMALL_EXCURSION`` (64 KiB). What a call into a library allocates
    counts within the reader's line that made it; a function with no lines
    of the reader's (a library function passed as the answer) counts as one
    line.

    Unlike a peak, which a copy made one piece at a time stays under, this
    adds up the pieces: ``g`` copies of a cache made one group at a time
    count as ``g`` copies. It sees numpy's arrays (and Python's objects),
    not torch's allocator (:func:`torch_allocation_total`). A count of bytes,
    not a time, so load does not move it; two runs can differ by a few small
    Python objects (tens of bytes: a dictionary resized, an integer boxed),
    a thousandth of the 64 KiB excursions it adds up."""
    import gc
    import sys
    import tracemalloc

    total = 0
    start = 0

    def close_line():
        # the excursion of the line that ran since the last event
        nonlocal total, start
        now, peak = tracemalloc.get_traced_memory()
        if peak - start >= SMALL_EXCURSION:
            total += peak - start
        tracemalloc.reset_peak()
        start = now

    def local(frame, event, arg):
        if event == "line":
            close_line()
        return local

    verdicts: dict[str, bool] = {}

    def on_call(frame, event, arg):
        name = frame.f_code.co_filename
        if name not in verdicts:
            verdicts[name] = is_reader_code(name)
        return local if verdicts[name] else None

    gc.collect()
    tracemalloc.start()
    previous = sys.gettrace()
    try:
        tracemalloc.reset_peak()
        start, _ = tracemalloc.get_traced_memory()
        sys.settrace(on_call)
        try:
            out = fn(*args)
        finally:
            sys.settrace(previous)
        close_line()
    finally:
        tracemalloc.stop()
    return out, total


def torch_allocation_total(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), the bytes torch allocated during the call, all
    its allocations added up)``, by its profiler, as
    :func:`largest_torch_allocation` measures their largest (0 when the
    answer uses numpy only)."""
    out, prof = _torch_profile(fn, *args, **kwargs)
    records = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if records is None:
        # no raw records in this torch: the operators' net allocations
        sizes = [
            e.self_cpu_memory_usage
            for e in prof.events()
            if e.self_cpu_memory_usage > 0
        ]
        return out, sum(sizes)
    from torch.autograd import DeviceType

    # every allocation on the CPU (a free is a record of negative size)
    total = sum(
        r.nbytes()
        for r in records.events()
        if r.name() == "[memory]"
        and r.nbytes() > 0
        and r.device_type() == DeviceType.CPU
    )
    return out, total


def torch_profiler_ready() -> bool:
    """Whether the reader's session has imported torch, and it is a real
    torch with a profiler (in the browser a stand-in module blocks it): only
    then can an answer have allocated with torch, and
    :func:`largest_torch_allocation` measure it."""
    import sys

    if "torch" not in sys.modules:
        return False
    try:
        import torch.profiler  # noqa: F401
    except ImportError:
        return False
    return True


def largest_torch_allocation(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), the largest single allocation torch made during
    the call)``: tracemalloc does not see torch's CPU allocator, its profiler
    does (0 when the answer uses numpy only). Its first start in a session
    takes seconds."""
    out, prof = _torch_profile(fn, *args, **kwargs)
    sizes = [
        e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0
    ]
    return out, max(sizes, default=0)


def _torch_profile(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), torch's profiler, memory profiled, that ran
    during the call)``."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        # the profiler's own notices, not the reader's
        warnings.simplefilter("ignore")
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        # some builds log "profiler_start" to the C stderr
        with _quiet_stderr():
            prof.__enter__()
        try:
            # the reader's own messages still show
            out = fn(*args, **kwargs)
        finally:
            # ... and "profiler_stop"
            with _quiet_stderr():
                prof.__exit__(None, None, None)
    return out, prof


class _quiet_stderr:
    """Silence file descriptor 2 (what C++ code writes to stderr) for the
    duration of the block; where there is no such descriptor (the browser), do
    nothing."""

    def __enter__(self):
        import os
        import sys

        self._saved = None
        try:
            sys.stderr.flush()
            self._saved = os.dup(2)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)
        except (OSError, AttributeError, ValueError):
            if self._saved is not None:
                os.close(self._saved)
            self._saved = None
        return self

    def __exit__(self, *exc):
        import os

        if self._saved is not None:
            os.dup2(self._saved, 2)
            os.close(self._saved)
        return False


def _unchanged(before, after) -> bool:
    """Whether an argument holds what it held before the reader's function
    ran."""
    if (
        isinstance(before, (tuple, list))
        and isinstance(after, (tuple, list))
        and len(before) == len(after)
    ):
        return all(_unchanged(b, a) for b, a in zip(before, after))
    if isinstance(before, np.ndarray) or hasattr(before, "detach"):
        a, b = as_array(after), as_array(before)
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    return True


def _argument_names(fn: Callable, n: int) -> list[str]:
    """The names of ``fn``'s first ``n`` positional parameters, where they can
    be read."""
    try:
        params = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    return [
        params[i] if i < len(params) else f"argument {i + 1}" for i in range(n)
    ]


def changed_inputs(fn: Callable, case: "Case", given: "Case") -> list[str]:
    """The names of the arguments of ``case`` that ``fn``, called with
    ``given`` (copies), changed."""
    names = _argument_names(fn, len(case.args))
    changed = [
        name
        for name, b, a in zip(names, case.args, given.args)
        if not _unchanged(b, a)
    ]
    changed += [
        k
        for k in case.kwargs
        if not _unchanged(case.kwargs[k], given.kwargs.get(k))
    ]
    return changed


def in_place_note(exercise: str, case: "Case", names: Sequence[str]) -> str:
    """The one note a checker prints when the reader's function changed its
    inputs in place."""
    which = ", ".join(f"`{n}`" for n in names)
    return (
        f"Note: {exercise}: your function changed its "
        f"input{'s' if len(names) > 1 else ''} {which} in "
        f"place (first in case '{case.name}'). The checker gave it fresh "
        "copies and judged only what it "
        "returned; a caller who still needs those arrays would find them "
        "changed."
    )


def as_array(x) -> np.ndarray:
    """A reader's value (numpy array, torch tensor, list) as a numpy array; a
    bfloat16 tensor, which numpy cannot hold, as float32 (exact)."""
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    return np.asarray(x)


def dtype_name(x) -> str:
    """The dtype of a reader's value as they would write it: ``bfloat16`` for
    a bfloat16 tensor (which :func:`as_array` widens to float32)."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None and str(dtype) == "torch.bfloat16":
        return "bfloat16"
    return str(as_array(x).dtype)


def same(a, b, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """True when ``a`` and ``b`` have one shape and agree, NaN counting as
    equal to NaN."""
    a, b = as_array(a), as_array(b)
    if a.shape != b.shape:
        return False
    if a.dtype == bool or b.dtype == bool:
        return bool(np.array_equal(a, b))
    return bool(
        np.allclose(
            a.astype(np.float64),
            b.astype(np.float64),
            rtol=rtol,
            atol=atol,
            equal_nan=True,
        )
    )


FLOAT_MASK_DESCRIPTION = (
    "the mask is a float array of 1.0 and 0.0 (np.ones, torch.ones): a "
    "boolean mask's "
    "pattern, in the dtype of an ADDITIVE mask. PyTorch's "
    "scaled_dot_product_attention adds a "
    "float mask to the scores (+1 or +0), so it masks nothing"
)
FLOAT_MASK_HINT = (
    "make it boolean: build it with dtype=bool (np.ones((n, n), dtype=bool), "
    "torch.ones(n, n, "
    "dtype=torch.bool)) or compare (mask == 1); True = may attend"
)
INT_MASK_DESCRIPTION = (
    "the mask is an integer array of 1 and 0: a boolean mask's pattern in "
    "an integer dtype. attnbook's attention and PyTorch's "
    "scaled_dot_product_attention reject an integer mask, and ~ on it is "
    "bitwise NOT (~1 = -2, ~0 = -1), so weights[~mask] indexes rows "
    "instead of masking"
)
INT_MASK_HINT = (
    "make it boolean: return mask.astype(bool) (mask.bool() for a torch "
    "tensor) or build it with dtype=bool; True = may attend"
)


def same_mask(a, b) -> bool:
    """:func:`same` for masks, except that a float array never equals a boolean
    one: a float 0/1 mask is read as additive by PyTorch, so it is not the
    boolean mask whatever its values. Nor does an integer 0/1 array: attnbook
    and PyTorch reject integer masks, and ``~`` on one is bitwise NOT."""
    a, b = as_array(a), as_array(b)
    if (a.dtype == bool) != (b.dtype == bool):
        return False
    if (a.dtype.kind == "f") != (b.dtype.kind == "f"):
        return False
    return same(a, b)


def describe_mask(got, expected, case: "Case | None" = None) -> str:
    """:func:`difference`, which also says when a float mask has the right
    pattern of 1.0 and 0.0."""
    a, e = as_array(got), as_array(expected)
    if (
        a.dtype.kind == "f"
        and e.dtype == bool
        and a.shape == e.shape
        and np.isin(a, (0.0, 1.0)).all()
    ):
        right = np.array_equal(a == 1, e)
        return (
            f"your mask is float ({a.dtype}), not boolean; read as True = 1.0 "
            "its pattern is "
            + ("right" if right else "also wrong: " + difference(a == 1, e))
        )
    if (
        a.dtype.kind in "iu"
        and e.dtype == bool
        and a.shape == e.shape
        and np.isin(a, (0, 1)).all()
    ):
        right = np.array_equal(a == 1, e)
        return (
            f"your mask is an integer array ({a.dtype}), not boolean; read "
            "as True = 1 its pattern is "
            + ("right" if right else "also wrong: " + difference(a == 1, e))
        )
    return difference(got, expected, case)


def diagnose(
    got,
    case: Case,
    mistakes: Sequence[Mistake],
    compare,
    fn: Callable | None = None,
    others: Sequence[Case] = (),
    postprocess: Callable = lambda out: out,
    expected=None,
    reference: Callable | None = None,
) -> Mistake | None:
    """The mistake whose output on ``case`` matches the reader's, or None.

    A case can be blind to a difference (with ``d_model = d_k`` dividing by
    either square root gives the same scores), so one match on ``case`` is not
    enough: the reader's ``fn`` is also run on the ``others`` cases, and a
    mistake is named only if those cases (where both run and neither output
    breaks to NaN or inf) confirm it at least as often as they contradict it.
    When none survives, no mistake is named (the verdict gives the generic hint
    rather than a wrong diagnosis); when several do, the first wins, preferring
    those that also match on the other cases.

    A match through NaN or inf is weak evidence: ``compare`` counts NaN as
    equal to NaN, so on a case where the reader's output breaks, *every*
    mistake that breaks the same entries matches, whatever its cause (an
    exponential that was never shifted and a maximum that was never updated
    both overflow to NaN on large scores). So when the reader's output is wrong
    only by NaN or inf (right wherever it is finite, compared with
    ``expected``, the reference's output on ``case``), a mistake is named only
    if it also agrees with the reader's function on every other case where both
    run: a mistake that breaks elsewhere, or not where the reader's function
    does, is not the reader's.

    Whatever the evidence, a mistake is named only if it is also right wherever
    the reader's function is right: on each other case where the reader's
    output agrees with ``reference`` (when given), the mistake must give that
    output too. A mistake that matches by chance on the failing case (two wrong
    formulas that coincide there) but is wrong on a case the reader got right
    is not the reader's.
    """
    candidates = [m for m in mistakes if _commits(m, case, got, compare)]
    outputs = _ReaderOutputs(fn, postprocess)
    if candidates and reference is not None:
        for other in others:
            theirs = outputs(other)
            if theirs is _FAILED:
                continue
            with np.errstate(all="ignore"):
                right = reference(
                    *pristine(other.args), **pristine(other.kwargs)
                )
            if compare(theirs, right):
                candidates = [
                    m
                    for m in candidates
                    if _commits(m, other, theirs, compare)
                ]
    if candidates and expected is not None and _breaks_only(got, expected):
        candidates = [
            m
            for m in candidates
            if all(_agrees(m, other, outputs, compare) for other in others)
        ]
    elif (
        candidates
        and expected is not None
        and _all_zero(got)
        and not _all_zero(expected)
    ):
        # an all-zero output is weak evidence too: every mistake that zeroes
        # the case matches it (a PPMI whose ratio never exceeds 1 is clipped to
        # zeros, however it went wrong)
        candidates = [
            m
            for m in candidates
            if all(_agrees_where_finite(m, other, outputs) for other in others)
        ]
    elif candidates:
        # a case can be blind to a difference (with d_model = d_k, dividing by
        # d_model and by d_k coincide), so a match on ``case`` alone is not
        # enough: a mistake is kept only if the other cases, where both it and
        # the reader's function run, confirm it at least as often as they
        # contradict it. (Not every one must agree: a reader who divides by
        # k.shape[0] commits "sqrt(n_k)" on every case but a batched one.)
        candidates = [
            m for m in candidates if _confirmed(m, others, outputs, compare)
        ]
    for other in others:
        if len(candidates) <= 1:
            break
        theirs = outputs(other)
        # the reader's function fails here: this case cannot tell them apart
        if theirs is _FAILED:
            continue
        narrowed = [
            m for m in candidates if _commits(m, other, theirs, compare)
        ]
        candidates = narrowed or candidates
    return candidates[0] if candidates else None


_FAILED = object()  # a function that raised (or no function to run)


class _ReaderOutputs:
    """The reader's (postprocessed) output on a case, computed once;
    ``_FAILED`` if it raises."""

    def __init__(self, fn: Callable | None, postprocess: Callable):
        self.fn, self.postprocess, self.cache = fn, postprocess, {}

    def __call__(self, case: Case):
        if id(case) not in self.cache:
            self.cache[id(case)] = self._run(case)
        return self.cache[id(case)]

    def _run(self, case: Case):
        if self.fn is None:
            return _FAILED
        case = fresh(case)
        try:
            with np.errstate(all="ignore"):
                return self.postprocess(self.fn(*case.args, **case.kwargs))
        except Exception:
            return _FAILED


def _commits(mistake: Mistake, case: Case, got, compare) -> bool:
    """Whether ``mistake`` gives ``got`` on ``case``; False when the mistake
    cannot run there."""
    wrong = _mistake_output(mistake, case)
    return wrong is not _FAILED and bool(compare(got, wrong))


def _agrees(
    mistake: Mistake, case: Case, outputs: _ReaderOutputs, compare
) -> bool:
    """False only when both the mistake and the reader's function run on
    ``case`` and differ."""
    theirs, wrong = outputs(case), _mistake_output(mistake, case)
    return (
        theirs is _FAILED or wrong is _FAILED or bool(compare(theirs, wrong))
    )


def _confirmed(
    mistake: Mistake, others: Sequence[Case], outputs: _ReaderOutputs, compare
) -> bool:
    """Whether the cases of ``others`` confirm ``mistake`` at least as often as
    they contradict it (a tie keeps it: a case that tells two readings apart
    may still hit an edge, such as a zero row, where a reader's version of the
    mistake and the checker's differ). A case counts only where both the
    mistake and the reader's function run and neither output holds NaN or inf
    (a formula that breaks on an input is another symptom, not evidence either
    way)."""
    confirm = contradict = 0
    for case in others:
        theirs, wrong = outputs(case), _mistake_output(mistake, case)
        if (
            theirs is _FAILED
            or wrong is _FAILED
            or _non_finite(theirs)
            or _non_finite(wrong)
        ):
            continue
        if compare(theirs, wrong):
            confirm += 1
        else:
            contradict += 1
    return confirm >= contradict


def _non_finite(x) -> bool:
    """Whether ``x`` (an array, a tensor or a tuple of them) holds a NaN or an
    inf."""
    if isinstance(x, (tuple, list)):
        return any(_non_finite(part) for part in x)
    try:
        a = as_array(x)
        return a.dtype.kind in "fc" and not bool(np.all(np.isfinite(a)))
    except Exception:
        return False


def _all_zero(x) -> bool:
    """Whether ``x`` is one numeric array (or tensor) of zeros."""
    try:
        a = as_array(x)
    except Exception:
        return False
    return a.dtype.kind in "fiu" and a.size > 0 and not bool(np.any(a))


def _agrees_where_finite(
    mistake: Mistake, case: Case, outputs: _ReaderOutputs
) -> bool:
    """Like :func:`_agrees`, comparing only the entries finite in both outputs
    (a NaN the reader's code leaves where the mistake's gives 0 is another
    slip, not evidence against the mistake)."""
    theirs, wrong = outputs(case), _mistake_output(mistake, case)
    if theirs is _FAILED or wrong is _FAILED:
        return True
    try:
        a, w = (
            as_array(theirs).astype(np.float64),
            as_array(wrong).astype(np.float64),
        )
    except (TypeError, ValueError):
        return True
    if a.shape != w.shape:
        return False
    both = np.isfinite(a) & np.isfinite(w)
    return bool(np.allclose(a[both], w[both], rtol=1e-5, atol=1e-6))


def _mistake_output(mistake: Mistake, case: Case):
    case = fresh(case)
    try:
        with np.errstate(all="ignore"):
            return mistake.commit(*case.args, **case.kwargs)
    except Exception:
        return _FAILED


def _breaks_only(got, expected) -> bool:
    """Whether the reader's output is wrong only by NaN or inf: it holds one
    where ``expected`` is finite, and agrees with ``expected`` wherever it is
    finite itself. Then matching a mistake says only *that* the output broke
    there. (False when the two cannot be compared entry by entry.)"""
    parts = (
        isinstance(got, (tuple, list))
        and isinstance(expected, (tuple, list))
        and len(got) == len(expected)
    )
    verdicts = (
        [_entry_verdict(a, e) for a, e in zip(got, expected)]
        if parts
        else [_entry_verdict(got, expected)]
    )
    return (
        None not in verdicts
        and "wrong" not in verdicts
        and "broken" in verdicts
    )


def _entry_verdict(got, expected) -> str | None:
    """'broken' (NaN/inf where the answer is finite, right elsewhere), 'wrong'
    (a finite entry differs), 'right', or None (not comparable)."""
    try:
        a, e = as_array(got), as_array(expected)
    except Exception:
        return None
    if a.shape != e.shape or a.dtype.kind != "f" or e.dtype.kind != "f":
        return None
    a, e = a.astype(np.float64), e.astype(np.float64)
    finite = np.isfinite(a)
    with np.errstate(invalid="ignore"):
        right = np.isclose(a, e, rtol=1e-5, atol=1e-6, equal_nan=True)
    if not right[finite].all():
        return "wrong"
    return "broken" if bool((~finite & np.isfinite(e)).any()) else "right"


_KEEPDIMS_HINT = (
    "a reduction along an axis (max, sum, norm) drops that axis unless you "
    "keep it: an (n, d) "
    "array and the (n,) result of x.max(axis=-1) broadcast along the wrong "
    "axis, or not at all. "
    "Pass keepdims=True (keepdim=True in torch), or index the result with "
    "[..., None]"
)


def is_broadcast_error(err: Exception) -> bool:
    """Whether ``err`` is numpy's or torch's complaint that two shapes do not
    broadcast."""
    text = str(err)
    return (
        isinstance(err, ValueError) and "could not be broadcast" in text
    ) or (
        isinstance(err, RuntimeError)
        and "must match the size of tensor" in text
    )


def _transposed_pair(text: str) -> tuple[tuple, tuple] | None:
    """The two shapes of numpy's broadcast error when they are 2-D and each
    is the other reversed ((3, 7) against (7, 3)), else None: a product whose
    operands came in the wrong order, not a batch or a lost axis."""
    found = re.findall(r"\((\d+),\s*(\d+)\)", text.split("shapes", 1)[-1])
    if len(found) != 2:
        return None
    a, b = (tuple(int(v) for v in pair) for pair in found)
    return (a, b) if a == b[::-1] and a != b else None


_TRANSPOSE_HINT = (
    "on a batch of matrices (3 or more axes), .T reverses every axis; "
    "transpose the last two axes only: k.transpose(-1, -2) in torch, "
    "np.swapaxes(k, -1, -2) in numpy"
)


def most_axes(inputs) -> int:
    """The largest number of axes among the arrays and tensors in ``inputs``
    (tuples, lists and dict values of them searched too); 0 when there are
    none."""
    if isinstance(inputs, dict):
        inputs = list(inputs.values())
    if isinstance(inputs, (tuple, list)):
        return max((most_axes(x) for x in inputs), default=0)
    if isinstance(inputs, np.ndarray) or hasattr(inputs, "detach"):
        return inputs.ndim
    return 0


def error_hint(err: Exception, inputs=()) -> str | None:
    """A hint for an error that readers' code commonly raises, or None.

    ``inputs`` are the arguments the reader's function was called with: when
    one of them has 3 or more axes, a shape error is most often ``.T`` on a
    batch (it reverses every axis), so the hint says so first; on matrices it
    does not speak of batches.
    """
    text = str(err)
    batched = most_axes(inputs) >= 3
    if isinstance(err, ValueError) and "matmul" in text:
        if batched:
            return "the shapes do not fit a matrix product: " + _TRANSPOSE_HINT
        return (
            "the shapes do not fit a matrix product: check which axis of "
            "each operand holds the features (q @ k.T multiplies each "
            "query's features by each key's); an (n, d) array times another "
            "(n, d) needs one of them transposed"
        )
    if isinstance(err, RuntimeError) and (
        "cannot be multiplied" in text or "Expected size for first two" in text
    ):
        if batched:
            return (
                "the shapes do not fit a matrix product: "
                + _TRANSPOSE_HINT
                + "; and check which axis each operand's features are on"
            )
        return (
            "the shapes do not fit a matrix product: check which axis each "
            "operand's features are on (an (n, d) tensor times another "
            "(n, d) needs one of them transposed)"
        )
    if is_broadcast_error(err):
        swapped = _transposed_pair(text)
        if swapped:
            return (
                f"arrays of shapes {swapped[0]} and {swapped[1]} were "
                "combined elementwise: one is the transpose of the other, so "
                "one product has its operands in the wrong order (y @ x.T "
                "where x @ y.T was meant) or lacks a transpose"
            )
        if batched:
            # a batched matmul after k.T fails on its batch axes, with the
            # same message as a reduction that lost its axis
            return (
                "two shapes do not match. If you used .T: "
                + _TRANSPOSE_HINT
                + ". Otherwise: "
                + _KEEPDIMS_HINT
            )
        return _KEEPDIMS_HINT
    if "cannot reshape" in text or (
        "shape '" in text and "is invalid for input of size" in text
    ):
        return (
            "a reshape asked for a shape whose size differs from the array's: "
            "take every size from the "
            "input's own shape (x.shape), not from a case you tried by hand"
        )
    return None


def scrub_freed_memory(like) -> None:
    """Fill with NaN the memory freed blocks of ``like``'s size may hold.

    numpy takes an output made with ``np.empty`` from memory freed before:
    blocks the size of the last case's reference output (its temporaries,
    whose values can equal the next case's, on the same inputs with another
    chunk size) are taken, filled with NaN and freed again, so that an
    unwritten row reads NaN, not a right value left over. ``like`` may be
    any value; nothing is done unless it is an array.
    """
    if not isinstance(like, np.ndarray) or like.nbytes == 0:
        return
    blocks = []
    # several blocks of each size: the allocator may hold several freed
    # ones; twice the size too, a float64 temporary of a float32 output
    for size in (like.nbytes, 2 * like.nbytes):
        for _ in range(8):
            block = np.empty(size, np.uint8)
            # all bits set: NaN in every float format, -1 in every integer
            block.fill(0xFF)
            blocks.append(block)
    del blocks


def run_checks(
    exercise: str,
    fn: Callable,
    cases: Sequence[Case],
    reference: Callable,
    mistakes: Sequence[Mistake] = (),
    compare: Callable = same,
    postprocess: Callable = lambda out: out,
    describe: Callable | None = None,
    hint: str = "compare your steps with the chapter's derivation",
    quiet: bool = False,
) -> None:
    """Run ``fn`` on every case; raise :class:`ExerciseError` at the first
    wrong one.

    ``fn`` runs first, on copies of the case's arguments, then the
    reference, on its own: a function that changes its inputs in place (``q
    /= np.sqrt(d_k)``) is judged on what it returns, and a note says once
    that it changed them. The answer runs before the reference, and on
    memory the earlier cases left scrubbed (:func:`scrub_freed_memory`), so
    that an output made with ``np.empty`` and left partly unwritten cannot
    find the right values in memory a reference has just freed.
    ``postprocess`` adapts the reader's return value (e.g. keeps the output of
    an ``(output, weights)`` pair); an exception it raises is reported as the
    reader's. ``describe(got, expected, case)`` says what is wrong (default
    :func:`difference`); ``hint`` is given when no mistake is recognised. An
    exception raised by ``fn`` is named as a mistake whose ``raises``
    recognises it, or gets :func:`error_hint`'s hint. On success prints one
    line (unless ``quiet``: a checker with more to check prints its own).
    """
    # IPython and pytest show the verdict, not the checker's internals
    __tracebackhide__ = True
    noted = False
    expected = None
    for case in cases:
        given = fresh(case)
        scrub_freed_memory(expected)
        try:
            # overflow is diagnosed below, not warned about
            with np.errstate(all="ignore"):
                got = postprocess(fn(*given.args, **given.kwargs))
        except NotImplementedError:
            raise NotAttemptedError(
                exercise,
                case.name,
                "the function is still the stub",
                hint="replace `raise NotImplementedError` with your code",
            ) from None
        except Exception as err:
            named = next(
                (
                    m
                    for m in mistakes
                    if m.raises is not None and m.raises(err)
                ),
                None,
            )
            raise ExerciseError(
                exercise,
                case.name,
                f"your function raised {type(err).__name__}: {err}",
                mistake=named,
                hint=None
                if named
                else error_hint(err, (case.args, case.kwargs)),
            ) from err
        with np.errstate(all="ignore"):
            expected = reference(*pristine(case.args), **pristine(case.kwargs))
        if not noted:
            changed = changed_inputs(fn, case, given)
            if changed:
                print(in_place_note(exercise, case, changed))
                noted = True
        if compare(got, expected):
            continue
        others = [c for c in cases if c is not case]
        if (
            _is_array(expected)
            and _is_array(got)
            and as_array(expected).dtype == bool
            and _is_additive_mask(as_array(got))
        ):
            # judge the mask the reader meant (0 = may attend), so that a
            # classic mistake made in the additive form is still named as that
            # mistake
            mistake = diagnose(
                as_array(got) == 0,
                case,
                mistakes,
                compare,
                fn,
                others,
                lambda out: _additive_as_bool(postprocess(out)),
                expected,
                reference,
            )
            hint = "return `mask == 0`, the boolean form of your additive mask"
        else:
            mistake = diagnose(
                got,
                case,
                mistakes,
                compare,
                fn,
                others,
                postprocess,
                expected,
                reference,
            )
        problem = (describe or difference)(got, expected, case)
        raise ExerciseError(
            exercise,
            case.name,
            problem,
            mistake=mistake,
            hint=None if mistake else hint,
        )
    if not quiet:
        print(f"Correct: {exercise} passes all {len(cases)} cases.")


def _is_additive_mask(a: np.ndarray) -> bool:
    """A float array of 0s and -infs (or a large negative stand-in for -inf,
    such as -1e9), with at least one of the latter: an additive mask."""
    if a.dtype.kind != "f" or a.size == 0:
        return False
    with np.errstate(invalid="ignore"):
        blocked = a <= -1e4
    return bool(np.all((a == 0) | blocked)) and bool(np.any(blocked))


def _is_array(x) -> bool:
    """Whether ``x`` is one array (or tensor), not a tuple of several
    results."""
    return isinstance(x, np.ndarray) or hasattr(x, "detach")


def _additive_as_bool(out) -> np.ndarray:
    """A float mask read as additive (0 = may attend); anything else
    unchanged."""
    a = as_array(out)
    return a == 0 if a.dtype.kind == "f" else a


def difference(got, expected, case: Case | None = None) -> str:
    """What differs between two arrays: the shape, non-finite values, or the
    largest difference."""
    if got is None:
        return "your function returned None (a missing `return`?)"
    if inspect.isgenerator(got):
        return (
            "your function returned a generator, not the values: build "
            "them with a list or a tuple, e.g. tuple(... for ...)"
        )
    got_a, expected_a = as_array(got), as_array(expected)
    if got_a.shape != expected_a.shape:
        return f"expected shape {expected_a.shape}, got {got_a.shape}"
    if expected_a.dtype == bool and _is_additive_mask(got_a):
        as_bool = got_a == 0
        verdict = (
            "it is right as an additive mask"
            if np.array_equal(as_bool, expected_a)
            else "read as a boolean mask (mask == 0) it is still wrong: "
            + difference(as_bool, expected_a)
        )
        return (
            "your mask is additive (0 where attention is allowed, -inf or a "
            "large negative number where it is "
            "not), the form that is "
            "added to the scores; this exercise wants the boolean form, True "
            "= may attend, which "
            f"`mask == 0` gives. {verdict[0].upper() + verdict[1:]}"
        )
    if (
        got_a.dtype != bool
        and not np.all(np.isfinite(got_a.astype(float)))
        and np.all(np.isfinite(expected_a.astype(float)))
    ):
        return "your output contains NaN or inf where the answer is finite"
    problem = "values differ from the reference"
    if got_a.dtype != bool:
        got_f, expected_f = got_a.astype(float), expected_a.astype(float)
        with np.errstate(invalid="ignore"):  # inf - inf where both overflow
            gap = np.abs(got_f - expected_f)
        # equal infinities (both -inf: an empty softmax state) agree: count
        # them as 0, not inf - inf = NaN
        gap = np.where(got_f == expected_f, 0.0, gap)
        err = np.max(gap) if gap.size else 0.0
        problem += f" (largest difference {err:.3g})"
    return problem
