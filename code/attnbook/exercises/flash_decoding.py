"""Checker for chapter 10's hard exercise: Flash-Decoding's merge of the
runs' softmax states as a Triton kernel.

The reader writes the kernel; the checker launches it (one program per row)
on CPU tensors under Triton's interpreter, or on the GPU, and compares it
with :func:`attnbook.torch_attention.merge_splits` in float64.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from ..torch_attention import merge_splits
from ._framework import Case, Mistake, NotAttemptedError, run_checks, same

EXERCISE = "merge kernel"


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _device() -> str:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _joined(out, lse) -> np.ndarray:
    """(n_rows, d + 1): each row's output with its log-sum-exp appended, so
    that one comparison judges both."""
    out = np.asarray(torch.as_tensor(out).detach().cpu(), dtype=np.float64)
    lse = np.asarray(torch.as_tensor(lse).detach().cpu(), dtype=np.float64)
    if out.ndim != 2 or lse.shape != out.shape[:1]:
        raise ValueError(
            f"expected out (n_rows, d) and lse (n_rows,); got "
            f"{tuple(out.shape)} and {tuple(lse.shape)}"
        )
    return np.concatenate([out, lse[:, None]], axis=1)


def merged(o_part, lse_part) -> np.ndarray:
    """Reference: merge_splits in float64, as (n_rows, d + 1)."""
    return _joined(*merge_splits(o_part.double(), lse_part.double()))


class PastTheEnd(RuntimeError):
    """The reader's kernel loaded or stored outside the tensors it was given:
    ``kind`` is "load" or "store", ``where`` says where. ``masked``: whether
    the access's mask held some elements back (None where not known, after
    a launch on a GPU): an access that stays out of bounds although its mask
    drops elements has wrong addresses, not a missing mask."""

    def __init__(self, kind: str, where: str, masked: bool | None = None):
        self.kind = kind
        self.masked = masked
        verb = {"load": "loaded from", "store": "stored to"}[kind]
        super().__init__(f"the kernel {verb} memory {where}")


class StoreRace(RuntimeError):
    """Two programs of the reader's kernel stored to the same element of OUT
    or LSE: on a GPU the programs run in parallel, in no fixed order, and
    the element ends up with whichever store came last. ``tensor``: "OUT" or
    "LSE", the tensor of that element."""

    def __init__(self, message: str, tensor: str | None = None):
        self.tensor = tensor
        super().__init__(message)


def _ranges(named: dict) -> list[tuple[str, int, int]]:
    """(name, first byte, one past the last byte) of each tensor."""
    return [
        (name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for name, t in named.items()
    ]


def _outside(ptrs, mask, itemsize: int, ranges) -> bool:
    """Whether an address that ``mask`` lets through lies outside every
    tensor of ``ranges``."""
    addr = np.asarray(ptrs, dtype=np.uint64)
    active = np.broadcast_to(np.asarray(mask, dtype=bool), addr.shape)
    addr = addr[active].astype(np.int64)
    inside = np.zeros(addr.shape, dtype=bool)
    for _, first, end in ranges:
        inside |= (addr >= first) & (addr + itemsize <= end)
    return not inside.all()


def _locate(addr: int, named: dict) -> tuple[str, tuple[int, ...]] | None:
    """The tensor of ``named`` and the index of its element at byte address
    ``addr``, or None."""
    for name, t in named.items():
        offset = addr - t.data_ptr()
        if 0 <= offset < t.numel() * t.element_size():
            index = np.unravel_index(offset // t.element_size(), t.shape)
            return name, tuple(int(i) for i in index)
    return None


def _element(addr: int, named: dict) -> str:
    """The element of ``named``'s tensors at byte address ``addr``, as
    ``OUT[1, 0]``."""
    found = _locate(addr, named)
    if found is None:
        return f"address {addr}"
    name, index = found
    return f"{name}[{', '.join(map(str, index))}]"


class _BoundsChecked:
    """Under Triton's interpreter, refuse a masked-in load or store outside
    the given tensors before it touches memory (the interpreter reads and
    writes raw addresses, and would corrupt the heap), and record which
    program stored each element: :meth:`race` names an element that two
    programs stored (the interpreter runs the programs one after another,
    so the numbers cannot show such a race)."""

    def __init__(self, loads: dict, stores: dict):
        self.loads = _ranges({**loads, **stores})
        self.stores = _ranges(stores)
        self.load_names = ", ".join([*loads, *stores])
        self.store_names = ", ".join(stores)
        self.store_tensors = stores
        self.owner: dict[int, int] = {}
        self.clash: tuple[int, int, int] | None = None

    def _record(self, ptrs, mask, program: int) -> None:
        addr = np.asarray(ptrs, dtype=np.uint64)
        active = np.broadcast_to(np.asarray(mask, dtype=bool), addr.shape)
        for a in addr[active].astype(np.int64).ravel().tolist():
            first = self.owner.setdefault(a, program)
            if first != program and self.clash is None:
                self.clash = (a, first, program)

    def race(self) -> StoreRace | None:
        """The first element that two programs stored, as an error that says
        whose row it is and which program stored outside its own (program r
        owns row r of OUT and LSE)."""
        if self.clash is None:
            return None
        addr, first, second = self.clash
        where = _element(addr, self.store_tensors)
        tensor, index = _locate(addr, self.store_tensors)
        row = index[0]
        strays = [p for p in (first, second) if p != row]
        who = " and ".join(f"program {p}" for p in strays)
        return StoreRace(
            f"programs {first} and {second} both stored to {where}, an "
            f"element of row {row}, which program {row} owns: {who} stored "
            f"outside its own row of {tensor}",
            tensor=tensor,
        )

    def __enter__(self):
        if os.environ.get("TRITON_INTERPRET") != "1":
            self.builder = None
            return self
        try:
            from triton.runtime.interpreter import interpreter_builder

            builder = interpreter_builder
            load = builder.create_masked_load
            store = builder.create_masked_store
        except (ImportError, AttributeError):
            # another Triton's interpreter: no address check, the guards
            # after the outputs still catch a store past their end
            self.builder = None
            return self
        self.builder = builder
        checker = self

        def masked_load(ptrs, mask, other, *args, **kwargs):
            size = ptrs.get_element_ty().primitive_bitwidth // 8
            if _outside(ptrs.data, mask.data, size, checker.loads):
                raise PastTheEnd("load", f"outside {checker.load_names}")
            return load(ptrs, mask, other, *args, **kwargs)

        def masked_store(ptrs, value, mask, *args, **kwargs):
            size = ptrs.get_element_ty().primitive_bitwidth // 8
            if _outside(ptrs.data, mask.data, size, checker.stores):
                held_back = not np.all(np.asarray(mask.data, dtype=bool))
                raise PastTheEnd(
                    "store", f"outside {checker.store_names}", held_back
                )
            # inside the outputs the store is safe: let it happen, and name
            # a race after the launch (a store past the end, found later in
            # the same launch, is the mistake to name first)
            checker._record(ptrs.data, mask.data, builder.grid_idx[0])
            return store(ptrs, value, mask, *args, **kwargs)

        builder.create_masked_load = masked_load
        builder.create_masked_store = masked_store
        return self

    def __exit__(self, *exc):
        if self.builder is not None:
            del self.builder.create_masked_load
            del self.builder.create_masked_store
        return False


def launch(kernel):
    """The host side the exercise fixes: ``kernel[(n_rows,)](O_PART,
    LSE_PART, OUT, LSE, n_splits, n_rows, d_head, BLOCK_S=..., BLOCK_D=...)``
    with contiguous float32 tensors O_PART (n_splits, n_rows, d_head),
    LSE_PART (n_splits, n_rows), OUT (n_rows, d_head), LSE (n_rows,), and
    BLOCK_S, BLOCK_D the powers of two at or above n_splits and d_head. OUT
    and LSE start as NaN, so an entry the kernel never stores shows.

    Each tensor is a view of a larger buffer whose tail (the guard) is NaN:
    an unmasked load or store past the end (columns c >= d_head of the last
    row, say) reads or writes the guard, not freed memory. Under the
    interpreter such an access is refused before it happens; on a GPU a
    store into the guard is found after the launch. Either raises
    :class:`PastTheEnd`. Under the interpreter, an element of OUT or LSE
    stored by two programs (a store that reaches another row) raises
    :class:`StoreRace` after the launch; on a GPU such a race is not
    watched."""

    def merge(o_part, lse_part):
        n_splits, n_rows, d_head = o_part.shape
        block_s, block_d = _next_pow2(n_splits), _next_pow2(d_head)
        device = _device()
        nan = float("nan")
        # guards: room for every padded run and column past the end
        o_buf = torch.full(
            ((block_s + 1) * n_rows * d_head + block_d,), nan, device=device
        )
        o_view = o_buf[: o_part.numel()].view(n_splits, n_rows, d_head)
        o_view.copy_(o_part.to(device, torch.float32))
        lse_buf = torch.full(((block_s + 1) * n_rows,), nan, device=device)
        lse_view = lse_buf[: lse_part.numel()].view(n_splits, n_rows)
        lse_view.copy_(lse_part.to(device, torch.float32))
        out_buf = torch.full((n_rows + 1, d_head), nan, device=device)
        lse_out_buf = torch.full((n_rows + 1,), nan, device=device)
        out, lse = out_buf[:n_rows], lse_out_buf[:n_rows]
        checked = _BoundsChecked(
            {"O_PART": o_view, "LSE_PART": lse_view},
            {"OUT": out, "LSE": lse},
        )
        try:
            with checked:
                kernel[(n_rows,)](
                    o_view,
                    lse_view,
                    out,
                    lse,
                    n_splits,
                    n_rows,
                    d_head,
                    BLOCK_S=block_s,
                    BLOCK_D=block_d,
                )
        except Exception as err:
            # the stub's NotImplementedError, wrapped by the interpreter (or
            # the compiler): the exercise is not attempted yet
            if "NotImplementedError" in f"{err!r} {err.__cause__!r}":
                raise NotImplementedError from err
            if isinstance(err.__cause__, PastTheEnd):
                raise err.__cause__ from None
            raise
        if not (
            out_buf[n_rows:].isnan().all()
            and lse_out_buf[n_rows:].isnan().all()
        ):
            raise PastTheEnd("store", "past the end of OUT or LSE")
        race = checked.race()
        if race is not None:
            raise race
        return out.cpu(), lse.cpu()

    return merge


def _case(
    name,
    n_splits,
    n_rows,
    d_head,
    seed,
    spread=2.0,
    empty=None,
    centre=0.0,
    first_row=None,
):
    gen = torch.Generator().manual_seed(seed)
    o_part = torch.randn(n_splits, n_rows, d_head, generator=gen)
    lse_part = centre + spread * (
        2 * torch.rand(n_splits, n_rows, generator=gen) - 1
    )
    if empty is not None:
        lse_part[empty] = float("-inf")
    if first_row is not None:
        lse_part[:, 0] = torch.tensor(first_row)
    return Case(name, (o_part, lse_part))


def merge_cases() -> list[Case]:
    # empty runs: row r did not see run s (causal decoding: an early query
    # row ends before the last runs start); the last row saw no run at all (a
    # fully masked row), whose merge is output 0 and log-sum-exp -inf
    empty = torch.zeros(5, 6, dtype=torch.bool)
    empty[3:, 0] = True
    empty[2:, 1] = True
    empty[4, 2] = True
    empty[:, 5] = True
    return [
        _case("one run: n_splits = 1, 3 rows, d = 16", 1, 3, 16, 0),
        _case("four runs, 7 rows, d = 64", 4, 7, 64, 1),
        _case(
            "three runs (not a power of two), 5 rows, d = 48 (not one)",
            3,
            5,
            48,
            2,
        ),
        _case(
            "log-sum-exps far apart (uniform in -120 .. 120; the first row "
            "(100, -100, -100, -100), whose maximum lies 150 above its mean): "
            "four runs, 5 rows, d = 32",
            4,
            5,
            32,
            3,
            spread=120.0,
            first_row=(100.0, -100.0, -100.0, -100.0),
        ),
        # every run's log-sum-exp far below 0: float32's exp(lse_s - c)
        # underflows to 0 for any constant shift c >= 0 (below about -104),
        # so only the row's own maximum works as the shift
        _case(
            "log-sum-exps all far below 0 (uniform in -220 .. -120; the "
            "first row (-150, -160, -inf)): three runs, 4 rows, d = 40",
            3,
            4,
            40,
            5,
            spread=50.0,
            centre=-170.0,
            first_row=(-150.0, -160.0, float("-inf")),
        ),
        _case(
            "empty runs (log-sum-exp -inf) and a row that no run saw: five "
            "runs, 6 rows, d = 32",
            5,
            6,
            32,
            4,
            empty=empty,
        ),
    ]


# --- the classic mistakes, each as what it computes -------------------------


def _parts(o_part, lse_part):
    return o_part.double(), lse_part.double()


def _mean_of_runs(o_part, lse_part):
    o, lse = _parts(o_part, lse_part)
    return _joined(o.mean(0), torch.logsumexp(lse, 0))


def _padding_counted(o_part, lse_part):
    # padded runs loaded with other=0.0: log-sum-exp 0 and output 0
    o, lse = _parts(o_part, lse_part)
    pad = _next_pow2(o.shape[0]) - o.shape[0]
    lse = torch.cat([lse, torch.zeros(pad, *lse.shape[1:]).double()])
    o = torch.cat([o, torch.zeros(pad, *o.shape[1:]).double()])
    return _joined(*merge_splits(o, lse))


def _not_shifted(o_part, lse_part):
    # exp(lse) in float32, as the kernel computes it: overflows past 88.7
    w = torch.exp(lse_part.float())
    total = w.sum(0)
    out = (w[..., None] * o_part.float()).sum(0) / total[:, None]
    return _joined(out, torch.log(total))


def _not_shifted_guarded(o_part, lse_part):
    # the same, with the division guarded as the chapter's solution guards
    # it (tl.where(total == 0, 1, total)): a row whose weights all underflow
    # or are all exp(-inf) comes out 0 instead of NaN
    w = torch.exp(lse_part.float())
    total = w.sum(0)
    safe = torch.where(total == 0, torch.ones_like(total), total)
    out = (w[..., None] * o_part.float()).sum(0) / safe[:, None]
    return _joined(out, torch.log(total))


def _shift_clamped(guarded: bool):
    # the shift clamped to a constant, tl.maximum(m, 0.0), in float32 as the
    # kernel computes it: right while a row's largest log-sum-exp is above
    # about -87; below about -104 every weight underflows to 0, and the row
    # gets output 0 (or 0 / 0 without the guarded division) and
    # log-sum-exp -inf
    def merge(o_part, lse_part):
        lse = lse_part.float()
        shift = torch.clamp(lse.max(0).values, min=0.0)
        w = torch.exp(lse - shift)
        total = w.sum(0)
        if guarded:
            total_safe = torch.where(total == 0, torch.ones_like(total), total)
        else:
            total_safe = total
        out = (w[..., None] * o_part.float()).sum(0) / total_safe[:, None]
        return _joined(out, shift + torch.log(total))

    return merge


def _mean_shift(o_part, lse_part):
    # shifted by the mean of the row's finite log-sum-exps, in float32 as the
    # kernel computes it: right while the maximum lies less than about 88
    # above that mean; beyond, exp overflows to inf, the output is inf / inf
    # = NaN and the log-sum-exp inf
    lse = lse_part.float()
    finite = torch.isfinite(lse)
    count = finite.float().sum(0).clamp(min=1.0)
    shift = torch.where(finite, lse, torch.zeros_like(lse)).sum(0) / count
    w = torch.exp(lse - shift)
    total = w.sum(0)
    total_safe = torch.where(total == 0, torch.ones_like(total), total)
    out = (w[..., None] * o_part.float()).sum(0) / total_safe[:, None]
    return _joined(out, shift + torch.log(total))


def _unseen_row_nan(o_part, lse_part):
    ref = merged(o_part, lse_part)
    ref[torch.isneginf(lse_part).all(0).numpy()] = np.nan
    return ref


def _unseen_row_zero_total(o_part, lse_part):
    # the shift guarded, the division not: the empty row's output is 0 / 0,
    # its log-sum-exp 0 + log(0) = -inf, which is right
    ref = merged(o_part, lse_part)
    ref[torch.isneginf(lse_part).all(0).numpy(), :-1] = np.nan
    return ref


def _lse_is_max(o_part, lse_part):
    ref = merged(o_part, lse_part)
    ref[:, -1] = lse_part.double().max(0).values.numpy()
    return ref


def _lse_without_max(o_part, lse_part):
    o, lse = _parts(o_part, lse_part)
    m = lse.max(0).values
    ref = merged(o_part, lse_part)
    ref[:, -1] = ref[:, -1] - m.numpy()
    return ref


def _unnormalised(o_part, lse_part):
    o, lse = _parts(o_part, lse_part)
    m = lse.max(0).values
    w = torch.exp(lse - m)
    return _joined((w[..., None] * o).sum(0), torch.logsumexp(lse, 0))


def _exp2(o_part, lse_part):
    o, lse = _parts(o_part, lse_part)
    m = lse.max(0).values
    w = torch.exp2(lse - m)
    total = w.sum(0)
    return _joined(
        (w[..., None] * o).sum(0) / total[:, None], m + torch.log2(total)
    )


def _raises(o_part, lse_part):
    """A mistake recognised by the error it raises, not by an output."""
    raise RuntimeError("recognised by its exception")


def _past_the_end(kind: str, masked: bool | None = None):
    """Recognise a PastTheEnd of ``kind``; with ``masked`` True, only one
    whose mask held elements back, with False, any other."""

    def recognise(err: Exception) -> bool:
        if not (isinstance(err, PastTheEnd) and err.kind == kind):
            return False
        if masked is None:
            return True
        return bool(err.masked) == masked

    return recognise


def _o_part_transposed(o_part, lse_part):
    # O_PART read as if it were (n_rows, n_splits, d_head): the element of run
    # s, row r at (r * n_splits + s) * d_head instead of (s * n_rows + r) *
    # d_head (issue 31, student report 10)
    o, lse = _parts(o_part, lse_part)
    n_splits, n_rows, d_head = o.shape
    read = o.reshape(n_rows, n_splits, d_head).transpose(0, 1)
    return _joined(*merge_splits(read, lse))


def _unseen_row_lse_nan(o_part, lse_part):
    # the shift unguarded (m = -inf), the division guarded: the row no run
    # saw gets output 0 (its total is NaN, and tl.where(total > 0, ...)
    # gives 0) but log-sum-exp -inf + log(NaN) = NaN
    ref = merged(o_part, lse_part)
    ref[torch.isneginf(lse_part).all(0).numpy(), -1] = np.nan
    return ref


def _exp2_natural_log(o_part, lse_part):
    # the weights in base 2 (tl.exp2), the log-sum-exp's log natural
    o, lse = _parts(o_part, lse_part)
    m = lse.max(0).values
    w = torch.exp2(lse - m)
    total = w.sum(0)
    return _joined(
        (w[..., None] * o).sum(0) / total[:, None], m + torch.log(total)
    )


def _lse_base2(o_part, lse_part):
    # the weights right (in base 2, converted with log2(e)), the merged
    # log-sum-exp stored in base 2: log2 of the row's mass, not ln
    ref = merged(o_part, lse_part)
    ref[:, -1] = ref[:, -1] * np.log2(np.e)
    return ref


def _first_run_shift(o_part, lse_part):
    # shifted by run 0's log-sum-exp instead of the row's maximum, in float32
    # as the kernel computes it (0 in place of a -inf, the division guarded):
    # right while no run lies more than about 88 above run 0; beyond,
    # exp overflows to inf, the output is inf / inf = NaN and the
    # log-sum-exp inf
    lse = lse_part.float()
    first = lse[0]
    shift = torch.where(torch.isneginf(first), torch.zeros_like(first), first)
    w = torch.exp(lse - shift)
    total = w.sum(0)
    total_safe = torch.where(total == 0, torch.ones_like(total), total)
    out = (w[..., None] * o_part.float()).sum(0) / total_safe[:, None]
    return _joined(out, shift + torch.log(total))


def _store_race(tensor: str):
    """Recognise a StoreRace on an element of ``tensor``."""

    def recognise(err: Exception) -> bool:
        return isinstance(err, StoreRace) and err.tensor == tensor

    return recognise


def _lse_part_transposed(o_part, lse_part):
    # LSE_PART read as if it were (n_rows, n_splits): the entry of run s, row
    # r at r * n_splits + s instead of s * n_rows + r (issue 31, student
    # report s12i)
    o, lse = _parts(o_part, lse_part)
    n_splits, n_rows = lse.shape
    return _joined(*merge_splits(o, lse.reshape(n_rows, n_splits).T))


def _parts_transposed(o_part, lse_part):
    # both parts read row by row: O_PART as (n_rows, n_splits, d_head) and
    # LSE_PART as (n_rows, n_splits)
    o, lse = _parts(o_part, lse_part)
    n_splits, n_rows, d_head = o.shape
    return _joined(
        *merge_splits(
            o.reshape(n_rows, n_splits, d_head).transpose(0, 1),
            lse.reshape(n_rows, n_splits).T,
        )
    )


MERGE_MISTAKES = [
    Mistake(
        "mean_shift",
        "the log-sum-exps were shifted by their mean instead of their "
        "maximum: "
        "where a run's log-sum-exp lies more than about 88 above the mean, "
        "exp(lse_s - mean) overflows to inf in float32, and the row comes out "
        "with output NaN (inf / inf) and log-sum-exp inf",
        "shift by the row's maximum m = tl.max(lse_s, 0), so that every "
        "weight exp(lse_s - m) lies in [0, 1]; replace m by 0 only where it "
        "is -inf",
        _mean_shift,
    ),
    Mistake(
        "store_past_d_head",
        "the output was stored without the mask c < d_head: with BLOCK_D > "
        "d_head each program writes BLOCK_D - d_head values past its row, "
        "into the next row, and the last row past the end of OUT. The "
        "interpreter runs the programs one after another, so the next row "
        "overwrites them and the numbers look right; on a GPU the programs "
        "run in parallel, in no fixed order, and the stray values race with "
        "the next row's",
        "store with mask=c < d_head (and load with it too): the mask is "
        "needed for memory safety, not only for the numbers",
        _raises,
        raises=_past_the_end("store", masked=False),
    ),
    # issue 31, student report 10: a store with the mask c < d_head but a
    # row stride of BLOCK_D was named as a missing mask
    Mistake(
        "store_row_stride",
        "a masked store still ran past the end of OUT (or LSE): the mask "
        "held some columns back, so the addresses are wrong, not the mask. "
        "Row r of OUT starts at r * d_head, and a row stride of BLOCK_D (the "
        "padded width) or another number puts the last rows past the end",
        "address OUT + r * d_head + c (OUT is contiguous, d_head columns per "
        "row) with mask=c < d_head, and LSE + r",
        _raises,
        raises=_past_the_end("store", masked=True),
    ),
    Mistake(
        "store_into_other_row",
        "a store to OUT reaches another row: on a GPU the programs race. "
        "Two programs stored to the element of OUT named above; the one "
        "that does not own that row wrote outside its own: its output "
        "store has a wrong address, or a mask that lets padded columns "
        "through (a mask by the tensor's bounds, row * d_head + c < "
        "n_rows * d_head, instead of the row's, c < d_head, writes the next "
        "row's first columns). The interpreter runs the programs one after "
        "another, so the numbers can look right; on a GPU the programs run "
        "in parallel, in no fixed order, and the element keeps whichever "
        "store came last",
        "each program stores only its own row: OUT + row * d_head + c with "
        "mask=c < d_head",
        _raises,
        raises=_store_race("OUT"),
    ),
    # issue 31, student report s12i: a program that also stored into the next
    # row's LSE got the diagnosis of a masked output store
    Mistake(
        "lse_store_into_other_row",
        "a store to LSE reaches another row: on a GPU the programs race. Two "
        "programs stored to the element of LSE named above; the one that "
        "does not own that row wrote a log-sum-exp into another row's entry "
        "(a store to LSE + row + 1, say, or to a whole tile of LSE). The "
        "interpreter runs the programs one after another, so the numbers "
        "can look right; on a GPU the programs run in parallel, in no fixed "
        "order, and the element keeps whichever store came last",
        "each program owns exactly one element of LSE: store one value, to "
        "LSE + row, and nothing else into LSE",
        _raises,
        raises=_store_race("LSE"),
    ),
    Mistake(
        "load_past_d_head",
        "a load ran past the end of its tensor: O_PART loaded without the "
        "mask c < d_head reads past the last row, and a run s >= n_splits "
        "loaded unmasked reads past the last run. The read is out of "
        "bounds: on a GPU it can fault or read another allocation. Without "
        "the column mask the stray values only reach columns that are never "
        "stored; without the run mask they reach every stored column, "
        "weighted by exp(-inf) = 0, and 0 x NaN or 0 x inf is NaN, so the "
        "numbers can be wrong too",
        "load O_PART with mask=(s[:, None] < n_splits) & (c[None, :] < "
        "d_head), other=0.0: the mask is needed for memory safety, not only "
        "for the numbers",
        _raises,
        raises=_past_the_end("load"),
    ),
    Mistake(
        "padding_counted",
        "the padded runs (BLOCK_S > n_splits) count as runs of log-sum-exp 0: "
        "their load used other=0.0",
        "a padded run must weigh nothing: load LSE_PART with "
        "other=float('-inf'), so that exp(lse - m) is 0 for it",
        _padding_counted,
    ),
    Mistake(
        "not_shifted",
        "the weights exp(lse_s) were not shifted by the largest "
        "log-sum-exp: float32's exp overflows past 88.7",
        "subtract m = max_s lse_s first: the weights exp(lse_s - m) are at "
        "most 1, and the merged log-sum-exp is m + log(sum_s exp(lse_s - m))",
        _not_shifted,
    ),
    Mistake(
        "not_shifted",
        "the weights exp(lse_s) were not shifted by the largest "
        "log-sum-exp: float32's exp overflows past 88.7 (the division by "
        "the total is guarded, but the weights themselves are inf)",
        "subtract m = max_s lse_s first: the weights exp(lse_s - m) are at "
        "most 1, and the merged log-sum-exp is m + log(sum_s exp(lse_s - m))",
        _not_shifted_guarded,
    ),
    Mistake(
        "shift_clamped",
        "the shift was clamped to a constant (tl.maximum(m, 0.0)) instead "
        "of guarded: where every run's log-sum-exp lies far below the "
        "constant (below about -104 for 0), every weight exp(lse_s - c) "
        "underflows to 0 in float32, and the row comes out with output 0 and "
        "log-sum-exp -inf",
        "shift by the row's own maximum m, and replace it by 0 only where "
        "it is -inf: tl.where(m == float('-inf'), 0.0, m)",
        _shift_clamped(guarded=True),
    ),
    Mistake(
        "shift_clamped",
        "the shift was clamped to a constant (tl.maximum(m, 0.0)) instead "
        "of guarded: where every run's log-sum-exp lies far below the "
        "constant (below about -104 for 0), every weight exp(lse_s - c) "
        "underflows to 0 in float32, and the row comes out with output NaN (0 "
        "/ "
        "0) and log-sum-exp -inf",
        "shift by the row's own maximum m, and replace it by 0 only where "
        "it is -inf: tl.where(m == float('-inf'), 0.0, m)",
        _shift_clamped(guarded=False),
    ),
    Mistake(
        "unseen_row_nan",
        "a row that no run saw comes out NaN: its largest log-sum-exp is "
        "-inf, and -inf - (-inf) is NaN",
        "shift by 0 where m is -inf (tl.where): every weight is then "
        "exp(-inf) = 0, the output 0 and the log-sum-exp -inf, as "
        "merge_splits gives",
        _unseen_row_nan,
    ),
    # issue 31, student report 10: the division guarded, the shift not
    Mistake(
        "unseen_row_nan",
        "a row that no run saw has log-sum-exp NaN (its output 0 is right): "
        "its largest log-sum-exp m is -inf, so every lse_s - m is "
        "-inf - (-inf) = NaN, the total is NaN, and m + log(total) is NaN",
        "shift by 0 where m is -inf (tl.where(m == float('-inf'), 0.0, m)): "
        "every weight is then exp(-inf) = 0, the total 0 and the "
        "log-sum-exp 0 + log(0) = -inf, as merge_splits gives",
        _unseen_row_lse_nan,
    ),
    Mistake(
        "unseen_row_zero_total",
        "a row that no run saw has output NaN while its log-sum-exp, -inf, "
        "is right: a 0 / 0 or -inf - (-inf) on the output's path was not "
        "guarded. Either the shift is guarded but not the division (every "
        "weight is 0, and the output is 0 / 0), or the weights are "
        "exp(lse_s - lse) with the merged lse = -inf unguarded",
        "guard each step that sees the row's -inf or 0: divide by 1 where "
        "the total weight is 0 (tl.where(total == 0, 1, total)), and form "
        "exp(lse_s - lse) with 0 in place of lse where it is -inf; the "
        "output is then 0, as merge_splits gives",
        _unseen_row_zero_total,
    ),
    Mistake(
        "mean_of_runs",
        "the output is the plain mean of the runs' outputs: each run was "
        "normalised over its own keys, so it must be re-weighted by its "
        "share of the row's mass",
        "weight run s by exp(lse_s - lse), lse = the merged log-sum-exp; the "
        "shares sum to 1",
        _mean_of_runs,
    ),
    Mistake(
        "unnormalised",
        "the output is sum_s exp(lse_s - m) o_s, not divided by the sum of "
        "the weights",
        "the runs' shares are exp(lse_s - m) / sum_r exp(lse_r - m): divide "
        "by the sum",
        _unnormalised,
    ),
    Mistake(
        "lse_is_max",
        "the merged log-sum-exp is the largest run's, max_s lse_s: the other "
        "runs' mass is missing",
        "lse = m + log(sum_s exp(lse_s - m)), at least max_s lse_s",
        _lse_is_max,
    ),
    Mistake(
        "lse_without_max",
        "the merged log-sum-exp is log(sum_s exp(lse_s - m)): the shift m "
        "was not added back",
        "lse = m + log(sum_s exp(lse_s - m))",
        _lse_without_max,
    ),
    Mistake(
        "exp2_on_natural",
        "the weights are 2^(lse_s - m) (tl.exp2) of natural log-sum-exps",
        "LSE_PART holds natural logarithms: use tl.exp and tl.log, or "
        "multiply by log2(e) = 1.4427 before tl.exp2 and divide by it after "
        "tl.log2",
        _exp2,
    ),
    Mistake(
        "exp2_on_natural",
        "the weights are 2^(lse_s - m) (tl.exp2) of natural log-sum-exps "
        "(the log-sum-exp stored with a natural log)",
        "LSE_PART holds natural logarithms: weigh the runs with tl.exp, as "
        "the log-sum-exp's tl.log assumes (or multiply by log2(e) = 1.4427 "
        "before tl.exp2)",
        _exp2_natural_log,
    ),
    # expert reading y10gpu: the trap the solution names ("the base") had
    # only the generic hint when the weights were right and the log-sum-exp
    # was stored in base 2
    Mistake(
        "lse_base2",
        "the output is right but the merged log-sum-exp is in base 2 (log2 "
        "of the row's mass, 1.4427 times too large): the weights were "
        "computed with tl.exp2 on lse_s * log2(e), and the log-sum-exp was "
        "stored without converting back",
        "LSE holds a natural logarithm, as LSE_PART does: multiply the "
        "base-2 value by ln 2 = 0.6931 (divide by log2(e)) before storing "
        "it, or compute it with tl.log",
        _lse_base2,
    ),
    Mistake(
        "first_run_shift",
        "the log-sum-exps were shifted by run 0's instead of the row's "
        "maximum: where a run lies more than about 88 above run 0, "
        "exp(lse_s - lse_0) overflows to inf in float32, and the row comes "
        "out with output NaN (inf / inf) and log-sum-exp inf",
        "shift by the row's maximum m = tl.max(lse_s, 0), so that every "
        "weight exp(lse_s - m) lies in [0, 1]; replace m by 0 only where it "
        "is -inf",
        _first_run_shift,
    ),
    Mistake(
        "o_part_layout",
        "O_PART was read as (n_rows, n_splits, d_head): run s of row r at "
        "(r * n_splits + s) * d_head, so each row mixes other rows' outputs",
        "O_PART is (n_splits, n_rows, d_head), contiguous: run s of row r "
        "starts at (s * n_rows + r) * d_head, as LSE_PART's entry is at "
        "s * n_rows + r",
        _o_part_transposed,
    ),
    # issue 31, student report s12i: LSE_PART read row by row got the
    # generic hint
    Mistake(
        "lse_part_layout",
        "LSE_PART was read as (n_rows, n_splits): run s of row r at r * "
        "n_splits + s, so each row weighs its runs with other rows' "
        "log-sum-exps",
        "LSE_PART is (n_splits, n_rows), contiguous: run s of row r is at "
        "s * n_rows + r, as O_PART's run s of row r starts at (s * n_rows + "
        "r) * d_head",
        _lse_part_transposed,
    ),
    Mistake(
        "parts_layout",
        "O_PART and LSE_PART were both read row by row, as (n_rows, "
        "n_splits, d_head) and (n_rows, n_splits): each row mixes other "
        "rows' outputs and log-sum-exps",
        "the run index comes first: LSE_PART is (n_splits, n_rows), run s "
        "of row r at s * n_rows + r, and O_PART (n_splits, n_rows, d_head), "
        "run s of row r starting at (s * n_rows + r) * d_head",
        _parts_transposed,
    ),
]


class SetupError(RuntimeError):
    """Triton is set up so that the reader's kernel cannot run here: the
    fault is the Python session's, not the kernel's."""


def _check_setup(kernel) -> None:
    """Raise :class:`SetupError` when the kernel cannot run in this process.

    Without a CUDA GPU a kernel runs only under Triton's interpreter, and the
    interpreter must have been chosen before the first ``import triton``
    (:mod:`attnbook.kernels.interpreter` does so; importing
    :mod:`attnbook.kernels` alone does not, so a script that imports it and
    then ``triton`` gets compiled kernels and, at launch, Triton's "0 active
    drivers"). Read from the kernel's type and the loaded Triton, without
    importing Triton here (issue 31, student report 0910).
    """
    if type(kernel).__name__ not in ("InterpretedFunction", "JITFunction"):
        # not a kernel as @triton.jit returns it but an object that launches
        # one (kernel[grid](...)): its kernel's mode cannot be read from it,
        # so it is judged by what its launches do (issue 31, student report
        # 10: such a wrapper was told that Triton had compiled it)
        return
    interpreted = type(kernel).__name__ == "InterpretedFunction"
    language = sys.modules.get("triton.language")
    zeros = getattr(language, "zeros", None)
    library_interpreted = type(zeros).__name__ == "InterpretedFunction"
    advice = (
        "Restart Python and, before anything imports triton, run `import "
        "attnbook.kernels.interpreter` (it sets TRITON_INTERPRET=1 when "
        "there is no CUDA GPU; `import attnbook.kernels` alone does not), "
        "or set TRITON_INTERPRET=1 in the environment; then define the "
        "kernel again. In the chapter's notebook the setup cell does this."
    )
    if not torch.cuda.is_available() and not interpreted:
        raise SetupError(
            "this Python has no CUDA GPU, and Triton compiled your kernel "
            "instead of interpreting it: Triton was imported before "
            "TRITON_INTERPRET=1 was set, so the kernel cannot run here "
            "(Triton would report '0 active drivers'). Your kernel is not "
            "at fault. " + advice
        )
    if zeros is not None and interpreted != library_interpreted:
        raise SetupError(
            "Triton's library and your kernel disagree about the "
            "interpreter (TRITON_INTERPRET changed after triton was "
            "imported), so the first tl function inside the kernel would "
            "fail. Your kernel is not at fault. " + advice
        )


def check_merge_kernel(kernel) -> None:
    """Check a ``@triton.jit`` kernel that merges the runs of Flash-Decoding:
    per row, ``out = sum_s exp(lse_s - lse) o_s`` and ``lse = logsumexp_s
    lse_s``, with the signature and launch of :func:`launch`.

    Runs under Triton's interpreter on a CPU (``TRITON_INTERPRET=1``), or on
    a GPU. Empty runs have ``lse`` -inf; a row that no run saw gets output 0
    and ``lse`` -inf.
    """
    __tracebackhide__ = True
    if kernel is None:
        raise NotAttemptedError(
            EXERCISE,
            merge_cases()[0].name,
            "no kernel yet (merge_kernel is None)",
            hint="write a @triton.jit kernel with the signature of the "
            "exercise and pass it",
        )
    if not hasattr(kernel, "__getitem__"):
        raise TypeError(
            "check_merge_kernel takes the @triton.jit kernel itself (it "
            f"launches it); got {type(kernel).__name__}"
        )
    _check_setup(kernel)
    run_checks(
        EXERCISE,
        launch(kernel),
        merge_cases(),
        merged,
        MERGE_MISTAKES,
        compare=lambda a, b: same(a, b, rtol=1e-5, atol=1e-5),
        postprocess=lambda out: _joined(*out),
        hint="compare your kernel with merge_splits, step by step, on the "
        "failing case",
    )
