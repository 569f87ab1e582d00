"""The serving checkers reject each classic mistake and pass correct
solutions.

The wrong solutions are written here independently of the checkers' Mistake
functions, the way a reader might write them: loops, list comprehensions,
numpy, torch.
"""

import math

import numpy as np
import pytest
import torch

from attnbook.exercises.serving import check_block_slots, check_paged_decode


# --- the slots of a sequence -------------------------------------------------


def slots_loop(table, length, block_size):
    """Correct: a loop with divmod."""
    out = []
    for p in range(length):
        block, offset = divmod(p, block_size)
        out.append(table[block] * block_size + offset)
    return np.array(out, dtype=np.int64)


def slots_torch(table, length, block_size):
    """Correct: torch, block-major expansion then cut."""
    t = torch.as_tensor(table, dtype=torch.long)
    every = (t[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    return every[:length]


def slots_list(table, length, block_size):
    """Correct: a Python list of ints (an empty list indexes too)."""
    return [
        table[p // block_size] * block_size + p % block_size
        for p in range(length)
    ]


def slots_comprehension_array(table, length, block_size):
    """Wrong: np.array of an empty list is float64, so 0 positions give
    slots that cannot index."""
    return np.array(
        [
            table[p // block_size] * block_size + p % block_size
            for p in range(length)
        ]
    )


def slots_torch_tensor_of_table(table, length, block_size):
    """Wrong: torch.tensor of an empty table is float32, so the slots of
    the empty sequence cannot index."""
    p = torch.arange(length)
    return torch.tensor(table)[p // block_size] * block_size + p % block_size


def slots_no_factor(table, length, block_size):
    return np.array(
        [table[p // block_size] + p % block_size for p in range(length)],
        dtype=np.int64,
    )


def slots_identity(table, length, block_size):
    return torch.arange(length)


def slots_modulo(table, length, block_size):
    return np.array(
        [
            table[p % len(table)] * block_size + p % block_size
            for p in range(length)
        ],
        dtype=np.int64,
    )


def slots_whole_blocks(table, length, block_size):
    t = torch.as_tensor(table, dtype=torch.long)
    used = t[: math.ceil(length / block_size)]
    return (used[:, None] * block_size + torch.arange(block_size)).reshape(-1)


def slots_swapped(table, length, block_size):
    return np.array(
        [
            (p % block_size) * block_size + table[p // block_size]
            for p in range(length)
        ],
        dtype=np.int64,
    )


def slots_float(table, length, block_size):
    p = np.arange(length, dtype=np.float64)
    t = np.asarray(table, dtype=np.float64)
    return t[(p // block_size).astype(int)] * block_size + p % block_size


def slots_start_plus_position(table, length, block_size):
    """Wrong: the sequence read on from its first block, as if its blocks
    were adjacent."""
    if length == 0:
        return np.zeros(0, dtype=np.int64)
    start = table[0] * block_size
    return np.arange(start, start + length)


def slots_position_not_offset(table, length, block_size):
    out = []
    for p in range(length):
        out.append(table[p // block_size] * block_size + p)
    return np.array(out, dtype=np.int64).reshape(length)


def slots_scaled_by_table_length(table, length, block_size):
    t = torch.as_tensor(table, dtype=torch.long)
    p = torch.arange(length)
    return t[p // block_size] * len(table) + p % block_size


def slots_last_entry_ragged(table, length, block_size):
    """Wrong: every entry of the table used, the last one taken for the
    part-filled block (right only when the table has no spare entries)."""
    out = []
    for j, block in enumerate(table):
        last = j == len(table) - 1
        n = length - j * block_size if last else block_size
        out.extend(block * block_size + i for i in range(n))
    return np.array(out, dtype=np.int64)


def slots_last_entry_for_partial_block(table, length, block_size):
    """Wrong: the full blocks from table[p // block_size], the part-filled
    one from table[-1] (reading stud131415)."""
    full = length // block_size
    out = []
    for p in range(length):
        block = table[p // block_size] if p // block_size < full else table[-1]
        out.append(block * block_size + p % block_size)
    return np.array(out, dtype=np.int64)


def slots_used_blocks(table, length, block_size):
    """Correct: the blocks the sequence uses, the last of them ragged."""
    used = table[: math.ceil(length / block_size)]
    out = []
    for j, block in enumerate(used):
        n = min(block_size, length - j * block_size)
        out.extend(block * block_size + i for i in range(n))
    return np.array(out, dtype=np.int64)


# --- one decoding step through a block table ---------------------------------


def decode_gather(q, key_blocks, value_blocks, table, length):
    """Correct: gather the keys in order, then plain attention (numpy)."""
    size = key_blocks.shape[1]
    k = np.concatenate([key_blocks[b] for b in table])[:length]
    v = np.concatenate([value_blocks[b] for b in table])[:length]
    scores = np.einsum("hd,nhd->hn", q, k) / np.sqrt(q.shape[-1])
    w = np.exp(scores - scores.max(-1, keepdims=True))
    del size
    return np.einsum("hn,nhd->hd", w / w.sum(-1, keepdims=True), v)


def decode_by_blocks(q, key_blocks, value_blocks, table, length):
    """Correct: block by block in torch, states merged by log-sum-exp."""
    q, kb, vb = (torch.as_tensor(x) for x in (q, key_blocks, value_blocks))
    size = kb.shape[1]
    outs, lses = [], []
    for i in range(math.ceil(length / size)):
        n = min(size, length - i * size)
        k, v = kb[table[i], :n], vb[table[i], :n]
        s = torch.einsum("hd,nhd->hn", q, k) / math.sqrt(q.shape[-1])
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v))
    lse = torch.stack(lses)
    share = torch.exp(lse - torch.logsumexp(lse, 0))
    return (share[..., None] * torch.stack(outs)).sum(0)


def decode_masked_tail(q, key_blocks, value_blocks, table, length):
    """Correct: every slot of the table, the tail masked out of the scores
    (-inf) and of the values (zeros)."""
    k = key_blocks[table].reshape(-1, *key_blocks.shape[2:])
    v = value_blocks[table].reshape(-1, *value_blocks.shape[2:])
    v = np.where(np.arange(len(v))[:, None, None] < length, v, 0.0)
    scores = np.einsum("hd,nhd->hn", q, k) / np.sqrt(q.shape[-1])
    scores[:, length:] = -np.inf
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("hn,nhd->hd", w / w.sum(-1, keepdims=True), v)


def decode_online_torch(q, key_blocks, value_blocks, table, length):
    """Correct: torch, the tail cut, a running max and sum over blocks."""
    q, kb, vb = (torch.as_tensor(x) for x in (q, key_blocks, value_blocks))
    size = kb.shape[1]
    m = torch.full(q.shape[:1], -math.inf, dtype=q.dtype)
    total = torch.zeros(q.shape[:1], dtype=q.dtype)
    acc = torch.zeros_like(q)
    for i in range(math.ceil(length / size)):
        n = min(size, length - i * size)
        s = torch.einsum("hd,nhd->hn", q, kb[table[i], :n])
        s = s / math.sqrt(q.shape[-1])
        new = torch.maximum(m, s.max(-1).values)
        w = torch.exp(s - new[:, None])
        rescale = torch.exp(m - new)
        total = total * rescale + w.sum(-1)
        acc = acc * rescale[:, None] + torch.einsum(
            "hn,nhd->hd", w, vb[table[i], :n]
        )
        m = new
    return acc / total[:, None]


def decode_values_not_masked(q, key_blocks, value_blocks, table, length):
    """Wrong: the tail's scores set to -inf, its values kept: fine on
    finite garbage, NaN when the tail holds NaN or inf."""
    k = key_blocks[table].reshape(-1, *key_blocks.shape[2:])
    v = value_blocks[table].reshape(-1, *value_blocks.shape[2:])
    scores = np.einsum("hd,nhd->hn", q, k) / np.sqrt(q.shape[-1])
    scores[:, length:] = -np.inf
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("hn,nhd->hd", w / w.sum(-1, keepdims=True), v)


def decode_exp_without_max(q, key_blocks, value_blocks, table, length):
    """Wrong: block by block, the exponentials summed with no maximum
    subtracted (right until a score passes about 709, then inf / inf)."""
    q = np.asarray(q, dtype=float)
    size = key_blocks.shape[1]
    total, acc = np.zeros(q.shape[0]), np.zeros_like(q)
    for j in range(-(-length // size)):
        f = min(size, length - j * size)
        k, v = key_blocks[table[j], :f], value_blocks[table[j], :f]
        p = np.exp(np.einsum("hd,nhd->hn", q, k) / np.sqrt(q.shape[-1]))
        total += p.sum(1)
        acc += np.einsum("hn,nhd->hd", p, v)
    return acc / total[:, None]


def decode_torch_softmax_by_hand(q, key_blocks, value_blocks, table, length):
    """Wrong: torch, the keys gathered by their slots, the softmax written
    out as exp / sum without a maximum."""
    size = key_blocks.shape[1]
    slots = [table[p // size] * size + p % size for p in range(length)]
    k = torch.as_tensor(key_blocks).flatten(0, 1)[slots]
    v = torch.as_tensor(value_blocks).flatten(0, 1)[slots]
    s = torch.einsum("hd,nhd->hn", torch.as_tensor(q), k)
    e = torch.exp(s / math.sqrt(q.shape[-1]))
    return torch.einsum("hn,nhd->hd", e / e.sum(-1, keepdim=True), v)


def decode_last_entry_for_partial_block(
    q, key_blocks, value_blocks, table, length
):
    """Wrong: numpy, the full blocks read from the table in order, the
    part-filled one from its last entry."""
    size = key_blocks.shape[1]
    full, rest = divmod(length, size)
    blocks = [table[j] for j in range(full)]
    ks = [key_blocks[b] for b in blocks]
    vs = [value_blocks[b] for b in blocks]
    if rest:
        ks.append(key_blocks[table[-1], :rest])
        vs.append(value_blocks[table[-1], :rest])
    k, v = np.concatenate(ks), np.concatenate(vs)
    scores = np.einsum("hd,nhd->hn", q, k) / np.sqrt(q.shape[-1])
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("hn,nhd->hd", w / w.sum(-1, keepdims=True), v)


def decode_last_entry_ragged(q, key_blocks, value_blocks, table, length):
    """Wrong: torch, online softmax over every entry of the table, the last
    entry taken for the part-filled block."""
    q, kb, vb = (torch.as_tensor(x) for x in (q, key_blocks, value_blocks))
    size = kb.shape[1]
    m = torch.full(q.shape[:1], -math.inf, dtype=q.dtype)
    total = torch.zeros(q.shape[:1], dtype=q.dtype)
    acc = torch.zeros_like(q)
    for j, block in enumerate(table):
        n = size if j < len(table) - 1 else length - j * size
        if n <= 0:
            continue
        s = torch.einsum("hd,nhd->hn", q, kb[block, :n])
        s = s / math.sqrt(q.shape[-1])
        new = torch.maximum(m, s.max(-1).values)
        w = torch.exp(s - new[:, None])
        rescale = torch.exp(m - new)
        total = total * rescale + w.sum(-1)
        acc = acc * rescale[:, None] + torch.einsum(
            "hn,nhd->hd", w, vb[block, :n]
        )
        m = new
    return acc / total[:, None]


def decode_used_blocks(q, key_blocks, value_blocks, table, length):
    """Correct: numpy, the keys of the blocks the sequence uses, in table
    order, cut to length before attending."""
    used = table[: -(-length // key_blocks.shape[1])]
    k = key_blocks[used].reshape(-1, *key_blocks.shape[2:])[:length]
    v = value_blocks[used].reshape(-1, *value_blocks.shape[2:])[:length]
    s = np.einsum("hd,nhd->hn", q, k) / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hn,nhd->hd", w / w.sum(-1, keepdims=True), v)


def _plain(q, k, v, scale=True):
    s = np.einsum("hd,nhd->hn", q, k)
    if scale:
        s = s / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hn,nhd->hd", w / w.sum(-1, keepdims=True), v)


def decode_whole_blocks(q, key_blocks, value_blocks, table, length):
    k = np.concatenate([key_blocks[b] for b in table])
    v = np.concatenate([value_blocks[b] for b in table])
    return torch.from_numpy(_plain(q, k, v))


def decode_full_blocks_only(q, key_blocks, value_blocks, table, length):
    full = length // key_blocks.shape[1]
    k = np.concatenate([key_blocks[b] for b in table[:full]])
    v = np.concatenate([value_blocks[b] for b in table[:full]])
    return _plain(q, k, v)


def decode_off_by_one(q, key_blocks, value_blocks, table, length):
    k = np.concatenate([key_blocks[b] for b in table])[: length - 1]
    v = np.concatenate([value_blocks[b] for b in table])[: length - 1]
    return _plain(q, k, v)


def decode_sorted(q, key_blocks, value_blocks, table, length):
    size = key_blocks.shape[1]
    used = sorted(table[: math.ceil(length / size)])
    k = np.concatenate([key_blocks[b] for b in used])[:length]
    v = np.concatenate([value_blocks[b] for b in used])[:length]
    return _plain(q, k, v)


def decode_unscaled(q, key_blocks, value_blocks, table, length):
    k = np.concatenate([key_blocks[b] for b in table])[:length]
    v = np.concatenate([value_blocks[b] for b in table])[:length]
    return torch.from_numpy(_plain(q, k, v, scale=False))


def decode_averaged(q, key_blocks, value_blocks, table, length):
    size = key_blocks.shape[1]
    outs = []
    for i in range(math.ceil(length / size)):
        n = min(size, length - i * size)
        outs.append(
            _plain(q, key_blocks[table[i], :n], value_blocks[table[i], :n])
        )
    return sum(outs) / len(outs)


def _per_block(q, key_blocks, value_blocks, table, length):
    """Each block attended alone: its output, its scores."""
    size = key_blocks.shape[1]
    for i in range(math.ceil(length / size)):
        n = min(size, length - i * size)
        k, v = key_blocks[table[i], :n], value_blocks[table[i], :n]
        s = np.einsum("hd,nhd->hn", q, k) / np.sqrt(q.shape[-1])
        w = np.exp(s - s.max(-1, keepdims=True))
        yield np.einsum("hn,nhd->hd", w / w.sum(-1, keepdims=True), v), s


def decode_weighted_by_positions(q, key_blocks, value_blocks, table, length):
    """Wrong: a longer block counts for more, so each block's output is
    weighted by how many positions it holds."""
    total, n = 0.0, 0
    for out, s in _per_block(q, key_blocks, value_blocks, table, length):
        total = total + s.shape[-1] * out
        n += s.shape[-1]
    return total / n


def decode_all_heads_scaled(q, key_blocks, value_blocks, table, length):
    """Wrong: the divisor from the query's whole size, h * d."""
    q_t = torch.as_tensor(q)
    k = torch.as_tensor(np.concatenate([key_blocks[b] for b in table]))
    v = torch.as_tensor(np.concatenate([value_blocks[b] for b in table]))
    s = torch.einsum("hd,nhd->hn", q_t, k[:length]) / math.sqrt(q_t.numel())
    return torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v[:length])


def decode_merged_by_max(q, key_blocks, value_blocks, table, length):
    """Wrong: each block's largest score stands for its softmax mass."""
    outs, maxes = [], []
    for out, s in _per_block(q, key_blocks, value_blocks, table, length):
        outs.append(out)
        maxes.append(s.max(-1))
    m = np.stack(maxes)
    w = np.exp(m - m.max(0))
    return np.einsum("bh,bhd->hd", w / w.sum(0), np.stack(outs))


def slots_as_column(table, length, block_size):
    """Wrong: one row per position, a (length, 1) column."""
    return np.array(
        [
            [table[p // block_size] * block_size + p % block_size]
            for p in range(length)
        ],
        dtype=np.int64,
    ).reshape(length, 1)


def slots_into_bool_array(table, length, block_size):
    """Wrong: the output array made like a mask, dtype=bool."""
    out = np.zeros(length, dtype=bool)
    for p in range(length):
        out[p] = table[p // block_size] * block_size + p % block_size
    return out


CATALOGUE = {
    "check_block_slots": {
        "right": [slots_loop, slots_torch, slots_list, slots_used_blocks],
        "wrong": [
            (slots_no_factor, "no_block_factor"),
            (slots_identity, "table_ignored"),
            (slots_modulo, "cyclic_table"),
            (slots_whole_blocks, "whole_last_block"),
            (slots_swapped, "offset_and_block_swapped"),
            (slots_start_plus_position, "contiguous_from_first_block"),
            (slots_position_not_offset, "offset_not_reduced"),
            (slots_scaled_by_table_length, "table_length_factor"),
            (slots_as_column, "column_slots"),
            (slots_into_bool_array, "bool_slots"),
            (slots_float, "float_slots"),
            (slots_comprehension_array, "empty_not_integer"),
            (slots_torch_tensor_of_table, "empty_not_integer"),
            (slots_last_entry_ragged, "last_entry_ragged"),
            (slots_last_entry_for_partial_block, "last_entry_ragged"),
        ],
    },
    "check_paged_decode": {
        "right": [
            decode_gather,
            decode_by_blocks,
            decode_masked_tail,
            decode_online_torch,
            decode_used_blocks,
        ],
        "wrong": [
            (decode_whole_blocks, "unfilled_tail_read"),
            (decode_full_blocks_only, "last_block_dropped"),
            (decode_off_by_one, "newest_dropped"),
            (decode_sorted, "blocks_sorted"),
            (decode_unscaled, "no_scale"),
            (decode_averaged, "blocks_averaged"),
            (decode_weighted_by_positions, "blocks_by_count"),
            (decode_all_heads_scaled, "scale_heads_times_d"),
            (decode_merged_by_max, "blocks_by_max"),
            (decode_values_not_masked, "values_not_masked"),
            (decode_exp_without_max, "unstable_softmax"),
            (decode_torch_softmax_by_hand, "unstable_softmax"),
            (decode_last_entry_ragged, "last_entry_ragged"),
            (decode_last_entry_for_partial_block, "last_entry_ragged"),
        ],
    },
}
# The catalogue's solutions are run by tests/test_exercises_framework.py, which
# checks every right one accepted and every wrong one named, for every checker.


def test_the_first_decode_case_has_a_ragged_last_block():
    from attnbook.exercises.serving import decode_cases

    q, keys, values, table, length = decode_cases()[0].args
    assert length % keys.shape[1] != 0 and len(table) * keys.shape[1] > length


def test_a_decode_case_overflows_and_underflows_an_unshifted_exp():
    """One case's scores overflow exp (above 709) in one head and underflow
    it (all below -745) in another: a softmax without its maximum is NaN
    there."""
    from attnbook.exercises.serving import LARGE_SCORES, decode_cases

    (case,) = [c for c in decode_cases() if c.name == LARGE_SCORES]
    q, keys, values, table, length = case.args
    size = keys.shape[1]
    slots = [table[p // size] * size + p % size for p in range(length)]
    k = keys.reshape(-1, *keys.shape[2:])[slots]
    top = (np.einsum("hd,nhd->hn", q, k) / np.sqrt(q.shape[-1])).max(-1)
    assert top.max() > 709 and top.min() < -745


def test_slots_of_the_wrong_dtype_are_called_that():
    """Right values in a float array: the verdict names the dtype, not a
    difference of 0."""
    from attnbook.exercises import ExerciseError

    with pytest.raises(ExerciseError, match="not an integer one") as err:
        check_block_slots(slots_torch_tensor_of_table)
    assert "largest difference" not in str(err.value)


def test_the_stubs_are_not_attempted():
    from attnbook.exercises import NotAttemptedError

    def stub(*args):
        raise NotImplementedError

    for checker in (check_block_slots, check_paged_decode):
        with pytest.raises(NotAttemptedError):
            checker(stub)


def test_the_decode_cases_put_nan_and_inf_in_the_unfilled_tails():
    from attnbook.exercises.serving import decode_cases

    fills = set()
    for case in decode_cases():
        q, keys, values, table, length = case.args
        used = math.ceil(length / keys.shape[1])
        filled = length - (used - 1) * keys.shape[1]
        for pool in (keys, values):
            tail = pool[table[used - 1], filled:]
            if tail.size and not np.isfinite(tail).any():
                fills.add("nan" if np.isnan(tail).all() else "inf")
    assert fills == {"nan", "inf"}


def test_each_checker_has_a_table_with_spare_entries():
    """A table may be longer than the blocks its sequence uses (engines pad
    theirs); an answer that takes len(table) for the number of blocks is
    wrong, and a case must show it."""
    from attnbook.exercises.serving import decode_cases, slot_cases

    slots = [case.args for case in slot_cases()]
    assert any(len(t) > math.ceil(n / b) + 1 for t, n, b in slots)
    decode = [case.args for case in decode_cases()]
    assert any(
        len(t) > math.ceil(n / k.shape[1]) + 1 for _, k, _, t, n in decode
    )


def test_the_package_reads_a_longer_table_as_the_references_do():
    """The package's slots and decoding step, like the checkers'
    references, ignore a table's spare entries."""
    from attnbook.exercises.serving import (
        _reference_decode,
        _reference_slots,
        decode_cases,
    )
    from attnbook.serving import block_table, paged_cache

    table, length, size = [3, 0, 5, 2, 6], 7, 3
    expected = [9, 10, 11, 0, 1, 2, 15]
    assert _reference_slots(table, length, size).tolist() == expected
    assert block_table.slot_indices(table, length, size).tolist() == expected
    for case in decode_cases():
        q, keys, values, table, length = case.args
        got = paged_cache.paged_decode(
            torch.as_tensor(q)[:, None],
            torch.as_tensor(keys),
            torch.as_tensor(values),
            table,
            length,
        )[:, 0]
        want = _reference_decode(q, keys, values, table, length)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
