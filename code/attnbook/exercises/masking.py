"""Checkers for the masking chapter (chapter 7): the padding mask of a batch,
and the tiles of a packed row's mask (skipped, partial, full), as a tiled
kernel sorts them.

The causal-mask checker, :func:`attnbook.exercises.check_causal_mask`, lives in
``exercises/attention.py``.
"""

from __future__ import annotations

import numpy as np

from ..masks import packed_causal_mask
from ..padding import key_padding_mask
from ._framework import (
    ExerciseError,
    FLOAT_MASK_DESCRIPTION,
    FLOAT_MASK_HINT,
    INT_MASK_DESCRIPTION,
    INT_MASK_HINT,
    Case,
    Mistake,
    describe_mask,
    run_checks,
    same_mask,
)


def _grid(lengths, n):
    """Query index i (1, n, 1), key index j (1, 1, n) and lengths L (batch, 1,
    1)."""
    i, j = np.arange(n)[None, :, None], np.arange(n)[None, None, :]
    return i, j, np.asarray(lengths)[:, None, None]


def _full(mask, lengths, n):
    return np.broadcast_to(mask, (len(lengths), n, n)).copy()


def _reference(lengths, n):
    return _full(key_padding_mask(lengths, n), lengths, n)


def _commit(rule):
    def mistake(lengths, n):
        i, j, L = _grid(lengths, n)
        return _full(rule(i, j, L, n), lengths, n)

    return mistake


PADDING_MISTAKES = [
    Mistake(
        "queries_masked",
        "the mask hides padding *queries* (rows) instead of padding *keys* "
        "(columns)",
        "entry [b, i, j] decides whether query i may look at key j: it "
        "depends on whether key j is a "
        "real token, j < lengths[b], not on i",
        _commit(lambda i, j, L, n: i < L),
    ),
    Mistake(
        "inverted",
        "True marks the padding; the book's convention is True = may attend",
        "negate your mask: real keys (j < lengths[b]) must be True",
        _commit(lambda i, j, L, n: j >= L),
    ),
    Mistake(
        "pad_visible",
        "off by one: the first padding key is still visible (j <= length)",
        "sequence b has real tokens at positions 0 .. lengths[b] - 1, so use "
        "j < lengths[b]",
        _commit(lambda i, j, L, n: j <= L),
    ),
    Mistake(
        "last_token_hidden",
        "off by one: the last real token is hidden (j < length - 1)",
        "sequence b has real tokens at positions 0 .. lengths[b] - 1, so use "
        "j < lengths[b]",
        _commit(lambda i, j, L, n: j < L - 1),
    ),
    Mistake(
        "queries_and_keys",
        "padding queries are masked too, so their rows are fully masked",
        "mask only the keys: a padding query may attend to the real keys (its "
        "output is ignored), "
        "and a fully masked row gives NaN in many implementations",
        _commit(lambda i, j, L, n: (i < L) & (j < L)),
    ),
    Mistake(
        "key_mask_2d",
        "the mask has shape (batch, n), one entry per key, without the query "
        "axis: it "
        "does not broadcast to (batch, n_q, n_k), or broadcasts along the "
        "wrong axes",
        "add the query axis: real[:, None, :] has shape (batch, 1, n) and "
        "broadcasts over the queries",
        lambda lengths, n: _broadcast_or_raw(
            np.arange(n)[None, :] < np.asarray(lengths)[:, None], lengths, n
        ),
    ),
    Mistake(
        "causal_too",
        "the mask is causal as well as key-padding (j <= i and j < "
        "lengths[b]): this exercise "
        "asks for the padding mask alone",
        "combine the two where a decoder needs both (causal_mask(n) & "
        "padding_mask); here return only "
        "j < lengths[b], for every query i",
        _commit(lambda i, j, L, n: (j <= i) & (j < L)),
    ),
    Mistake(
        "one_length",
        "every sequence got the same length (the first one's): the mask "
        "ignores "
        "lengths[b] for the other sequences",
        "compare the key index with each sequence's own length: lengths[:, "
        "None, None] broadcasts over b",
        _commit(lambda i, j, L, n: j < L.flat[0]),
    ),
    Mistake(
        "longest_length",
        "every sequence got the longest length: the mask hides only the "
        "keys that every sequence pads, so the shorter sequences still see "
        "their padding",
        "compare the key index with each sequence's own length, j < "
        "lengths[b], not with max(lengths)",
        _commit(lambda i, j, L, n: j < L.max()),
    ),
    Mistake(
        "no_mask",
        "every entry is True: no key is hidden, so the real tokens attend "
        "to the padding",
        "key j of sequence b is real when j < lengths[b]: hide the others",
        _commit(lambda i, j, L, n: j >= 0),
    ),
    Mistake(
        "query_axis_first",
        "the query axis is inserted in front of the batch axis, shape (1, "
        "batch, n): the batch axis then lines up with the queries, and the "
        "mask does not broadcast to (batch, n_q, n_k), or broadcasts along "
        "the wrong axes",
        "insert the query axis after the batch axis: real[:, None, :] has "
        "shape (batch, 1, n)",
        lambda lengths, n: _broadcast_or_raw(
            (np.arange(n)[None, :] < np.asarray(lengths)[:, None])[None],
            lengths,
            n,
        ),
    ),
    Mistake(
        "head_axis",
        "the mask has the head axis, shape (batch, 1, 1, n): the layout that "
        "broadcasts over "
        "(batch, heads, n_q, n_k) scores, but this exercise has no head axis",
        "return (batch, n, n) or (batch, 1, n): drop the head axis (mask[:, "
        "0]); add it back, "
        "mask[:, None], where the mask meets scores with a head axis",
        lambda lengths, n: (
            np.arange(n)[None, :] < np.asarray(lengths)[:, None]
        )[:, None, None, :],
    ),
    Mistake(
        "float_mask",
        FLOAT_MASK_DESCRIPTION,
        FLOAT_MASK_HINT,
        lambda lengths, n: _reference(lengths, n).astype(np.float64),
    ),
    Mistake(
        "int_mask",
        INT_MASK_DESCRIPTION,
        INT_MASK_HINT,
        lambda lengths, n: _reference(lengths, n).astype(np.int64),
    ),
    Mistake(
        "fixed_size",
        "the mask is cut from an array of a fixed size (8 keys): right for n "
        "<= 8, but for a longer batch it keeps the fixed array's shape and "
        "misses the later keys",
        "build the key index from n itself, np.arange(n), so that the mask "
        "has n keys for every n",
        lambda lengths, n: _broadcast_or_raw(
            (np.arange(8)[None, None, :] < np.asarray(lengths)[:, None, None])[
                ..., :n
            ],
            lengths,
            n,
        ),
    ),
    Mistake(
        "fixed_size",
        "the mask is cut from an array of a fixed size (1024 keys, a usual "
        "context length): right for n <= 1024, but for a longer batch it "
        "keeps the fixed array's shape and misses the later keys",
        "build the key index from n itself, np.arange(n), so that the mask "
        "has n keys for every n",
        lambda lengths, n: _broadcast_or_raw(
            (
                np.arange(1024)[None, None, :]
                < np.asarray(lengths)[:, None, None]
            )[..., :n],
            lengths,
            n,
        ),
    ),
    # the other power-of-two buffers the n = 4100 case reaches (issue 31,
    # student report 07 met 4096)
    *(
        Mistake(
            "fixed_size",
            f"the mask is cut from an array of a fixed size ({size} keys): "
            f"right for n <= {size}, but for a longer batch it keeps the "
            "fixed array's shape and misses the later keys",
            "build the key index from n itself, np.arange(n), so that the "
            "mask has n keys for every n",
            lambda lengths, n, size=size: _broadcast_or_raw(
                (
                    np.arange(size)[None, None, :]
                    < np.asarray(lengths)[:, None, None]
                )[..., :n],
                lengths,
                n,
            ),
        )
        for size in (16, 32, 64, 128, 256, 512, 2048, 4096)
    ),
    Mistake(
        "left_padding",
        "the padding is assumed at the start of each sequence (left padding)",
        "in this exercise the real tokens come first: positions 0 .. "
        "lengths[b] - 1",
        _commit(lambda i, j, L, n: j >= n - L),
    ),
]


def padding_mask_cases() -> list[Case]:
    return [
        Case("lengths [3, 5, 1], n = 5", (np.array([3, 5, 1]), 5)),
        Case(
            "lengths [13, 2900], n = 4100 (every sequence padded; longer "
            "than a fixed buffer of up to 4096 keys)",
            (np.array([13, 2900]), 4100),
        ),
        Case("lengths [4], n = 4 (no padding)", (np.array([4]), 4)),
        Case("lengths [1, 1, 2, 7], n = 7", (np.array([1, 1, 2, 7]), 7)),
    ]


def _broadcast_or_raw(out, lengths, n):
    """``out`` broadcast to (batch, n, n) where it can be, else as it is (what
    the checker compares)."""
    try:
        return _full(out, lengths, n)
    except ValueError:
        return out


def _as_full_bool(fn):
    """Accept any mask that broadcasts to (batch, n, n), in its own dtype
    (:func:`same_mask` rejects a float or an integer mask)."""

    def wrapped(lengths, n):
        out = fn(np.array(lengths), n)
        if hasattr(out, "detach"):  # a torch tensor
            out = out.detach().cpu().numpy()
        out = np.asarray(out)
        try:
            return _full(out, lengths, n)
        except ValueError:
            # a shape that does not broadcast: reported as a shape error
            return out

    return wrapped


def check_padding_mask(fn) -> None:
    """Check ``fn(lengths, n)`` returns the self-attention mask of a
    right-padded batch.

    lengths: int array (batch,); n: the padded length. The answer is bool
    (batch, n, n), or anything that broadcasts to it (e.g. (batch, 1, n)), with
    entry [b, i, j] True exactly when key j is a real token of sequence b (``j
    < lengths[b]``). The mask must be boolean. A float mask of 1.0 and 0.0 is
    rejected: PyTorch's ``scaled_dot_product_attention`` would add it to the
    scores instead of masking them. So is an integer 0/1 mask: attnbook's
    attention and PyTorch reject it, and ``~`` on it is bitwise NOT.
    """
    run_checks(
        "padding mask",
        _as_full_bool(fn),
        padding_mask_cases(),
        _reference,
        PADDING_MISTAKES,
        compare=same_mask,
        describe=describe_mask,
    )


# --- the block mask of packed documents (the hard exercise) -----------------
#
# A kernel that works tile by tile (FlashAttention, FlexAttention's BlockMask,
# chapters 9 and 10) classifies each (query block, key block) tile of the mask
# before it computes anything: skipped (no pair may attend), full (every pair
# may attend: computed without the mask) or partial (the mask is applied).
# The reader classifies the tiles of a packed row (packed_causal_mask) from the
# documents' lengths, without forming the n x n mask.

SKIP, PARTIAL, FULL = 0, 1, 2


def _documents(lengths) -> np.ndarray:
    """(n,) the document of each position; zero-length documents hold
    none."""
    lengths = np.asarray(lengths)
    return np.repeat(np.arange(len(lengths)), lengths)


def _packed_dense(lengths) -> np.ndarray:
    """The packed row's (n, n) mask, zero-length documents left out."""
    lengths = np.asarray(lengths)
    return packed_causal_mask(lengths[lengths > 0])


def _tile_classes(allowed, block, padding_masked=False) -> np.ndarray:
    """SKIP / PARTIAL / FULL for each (block x block) tile of a boolean (n, n)
    mask. The padding of a ragged last block holds no pair (it is ignored), or
    counts as masked pairs with ``padding_masked``."""
    n = allowed.shape[0]
    n_blocks = -(-n // block)
    size = n_blocks * block
    # -1: no pair (padding); 0: masked; 1: may attend
    tiles = np.full((size, size), 0 if padding_masked else -1, np.int8)
    tiles[:n, :n] = allowed
    tiles = tiles.reshape(n_blocks, block, n_blocks, block)
    some = (tiles == 1).any(axis=(1, 3))
    every = (tiles != 0).all(axis=(1, 3))
    return np.where(every, FULL, np.where(some, PARTIAL, SKIP))


def _block_reference(lengths, block):
    return _tile_classes(_packed_dense(lengths), block)


def _same_document_mask(document, causal) -> np.ndarray:
    """(n, n): query i and key j in one document (by the labels
    ``document``), and ``causal(i, j)``."""
    n = len(document)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return (document[:, None] == document[None, :]) & causal(i, j)


def _blocks_causal(lengths, block):
    """Causality decided block by block (key block <= query block)."""
    return _tile_classes(
        _same_document_mask(
            _documents(lengths), lambda i, j: j // block <= i // block
        ),
        block,
    )


def _no_causal(lengths, block):
    return _tile_classes(
        _same_document_mask(_documents(lengths), lambda i, j: j >= 0), block
    )


def _relabel(mapping):
    def mistake(lengths, block):
        reference = _block_reference(lengths, block)
        return np.choose(reference, mapping)

    return mistake


def _first_position_document(lengths, block):
    """Each block taken to lie in the document of its first position: a tile
    is skipped across documents, full below the diagonal, partial on it."""
    document = _documents(lengths)
    n_blocks = -(-len(document) // block)
    first = document[np.arange(n_blocks) * block]
    a, c = np.arange(n_blocks)[:, None], np.arange(n_blocks)[None, :]
    same = first[:, None] == first[None, :]
    return np.where(
        same & (c < a), FULL, np.where(same & (c == a), PARTIAL, SKIP)
    )


def _tile_bounds(lengths, block):
    """(document, start, first, last): each position's document and the
    start of that document, (n,); each block's first and last position,
    (n_blocks,)."""
    lengths = np.asarray(lengths)
    document = _documents(lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    n = len(document)
    first = np.arange(0, n, block)
    last = np.minimum(first + block, n) - 1
    return document, starts[document], first, last


def _full_first_query(lengths, block):
    """A tile called full when its first key lies in the document of the
    tile's *first* query (and no key comes after that query): a document
    that begins later in the query block is missed."""
    document, _, first, last = _tile_bounds(lengths, block)
    q0, k0, k1 = first[:, None], first[None, :], last[None, :]
    full = (document[k0] == document[q0]) & (k1 <= q0)
    reference = _block_reference(lengths, block)
    return np.where(reference == SKIP, SKIP, np.where(full, FULL, PARTIAL))


def _some_last_query(lengths, block):
    """'Some pair visible' tested on the tile's last query only: a tile is
    skipped when that query sees none of its keys, though an earlier query
    of the tile (in an earlier document) may see some."""
    document, start, first, last = _tile_bounds(lengths, block)
    q1, k0, k1 = last[:, None], first[None, :], last[None, :]
    some = np.maximum(k0, start[q1]) <= np.minimum(k1, q1)
    reference = _block_reference(lengths, block)
    return np.where(reference == FULL, FULL, np.where(some, PARTIAL, SKIP))


def _boundary_off_by_one(lengths, block):
    """The first position of each document counted in the one before it
    (``np.searchsorted(np.cumsum(lengths), positions)``, side 'left')."""
    lengths = np.asarray(lengths)
    n = int(lengths.sum())
    document = np.searchsorted(np.cumsum(lengths), np.arange(n))
    return _tile_classes(
        _same_document_mask(document, lambda i, j: j <= i), block
    )


def _full_strict(lengths, block):
    """A tile called full only when its last key comes *before* its first
    query (k_last < q_first): a diagonal tile of one position, whose one pair
    is visible, is called partial."""
    _, _, first, last = _tile_bounds(lengths, block)
    # k_last == q_first: a diagonal tile of one position
    one_position = first[:, None] == last[None, :]
    reference = _block_reference(lengths, block)
    return np.where((reference == FULL) & one_position, PARTIAL, reference)


def _no_documents(lengths, block):
    """The documents ignored: the tiles of the plain causal mask of the
    row."""
    n = int(np.sum(lengths))
    return _tile_classes(np.tril(np.ones((n, n), bool)), block)


def _ragged_padded(lengths, block):
    return _tile_classes(_packed_dense(lengths), block, padding_masked=True)


def _floor_blocks(lengths, block):
    """n // block blocks: the ragged last block dropped."""
    reference = _block_reference(lengths, block)
    kept = int(np.sum(lengths)) // block
    return reference[:kept, :kept]


def _transposed(lengths, block):
    return _block_reference(lengths, block).T


def _ends_inclusive(lengths, block):
    """Each block taken to end one position late, at the first position of
    the next block (its last position computed as (a + 1) * block instead of
    (a + 1) * block - 1)."""
    allowed = _packed_dense(lengths)
    n = allowed.shape[0]
    n_blocks = -(-n // block)
    out = np.empty((n_blocks, n_blocks), int)
    for a in range(n_blocks):
        rows = slice(a * block, min((a + 1) * block + 1, n))
        for c in range(n_blocks):
            tile = allowed[rows, c * block : min((c + 1) * block + 1, n)]
            out[a, c] = FULL if tile.all() else PARTIAL if tile.any() else SKIP
    return out


def _block_grid(lengths, block):
    """(a, c): query block and key block indices, (n_blocks, 1) and (1,
    n_blocks); and the documents of each block's first and last position,
    (n_blocks,) each."""
    document, _, first, last = _tile_bounds(lengths, block)
    n_blocks = len(first)
    a, c = np.arange(n_blocks)[:, None], np.arange(n_blocks)[None, :]
    return a, c, document[first], document[last]


def _some_superdiagonal(lengths, block):
    """'Some pair visible' tested with the query block's end taken as
    inclusive (k_first <= q_first + block): the tile just above the diagonal
    is called partial when one document runs across the two blocks."""
    reference = _block_reference(lengths, block)
    a, c, first_doc, last_doc = _block_grid(lengths, block)
    crossing = (c == a + 1) & (last_doc[:, None] == first_doc[None, :])
    return np.where(crossing, PARTIAL, reference)


def _some_ignores_documents(lengths, block):
    """'Some pair visible' tested by causality alone (key block <= query
    block): the tiles across documents that the packed mask skips are called
    partial."""
    reference = _block_reference(lengths, block)
    a, c, _, _ = _block_grid(lengths, block)
    return np.where((reference == SKIP) & (c <= a), PARTIAL, reference)


def _full_ignores_causal(lengths, block):
    """'Every pair visible' tested by the documents alone: a tile whose two
    blocks lie wholly in one document is called full, the diagonal tiles and
    the tiles above the diagonal too."""
    reference = _block_reference(lengths, block)
    _, _, first_doc, last_doc = _block_grid(lengths, block)
    one = first_doc == last_doc
    same = (
        one[:, None]
        & one[None, :]
        & (first_doc[:, None] == first_doc[None, :])
    )
    return np.where(same, FULL, reference)


def _full_ignores_documents(lengths, block):
    """'Every pair visible' tested with each block in *a* document, not the
    same one: a tile below the diagonal whose query block lies in one
    document and key block in another is called full."""
    reference = _block_reference(lengths, block)
    a, c, first_doc, last_doc = _block_grid(lengths, block)
    one = first_doc == last_doc
    return np.where(one[:, None] & one[None, :] & (c < a), FULL, reference)


def _some_first_or_last_document(lengths, block):
    """'Some pair visible' tested on the blocks' first documents and their
    last documents only: a query block that begins in a later document than
    the key block and a key block that ends in an earlier one than the query
    block still share a document between, which is missed."""
    reference = _block_reference(lengths, block)
    a, c, first_doc, last_doc = _block_grid(lengths, block)
    some = (
        (first_doc[:, None] == first_doc[None, :])
        | (last_doc[:, None] == last_doc[None, :])
    ) & (c <= a)
    return np.where(reference == FULL, FULL, np.where(some, PARTIAL, SKIP))


def _index_at_n(err: Exception) -> bool:
    """An index error at index n of an array of n entries."""
    import re

    found = re.search(
        r"index (-?\d+) is out of bounds for (?:axis|dimension) \d+ with "
        r"size (\d+)",
        str(err),
    )
    return (
        isinstance(err, IndexError)
        and found is not None
        and found[1] == found[2]
    )


def _raise_index_error(lengths, block):
    raise IndexError("the reader's function indexed one past the end")


def _same_codes(got, expected) -> bool:
    """The tile codes must be integers, as the exercise asks (a float or
    boolean array is not the answer whatever its values), and equal."""
    from ._framework import as_array, same

    a, b = as_array(got), as_array(expected)
    if (a.dtype.kind in "iu") != (b.dtype.kind in "iu"):
        return False
    return same(a, b)


def _describe_codes(got, expected, case=None) -> str:
    """:func:`difference`, which first says when the codes are not
    integers."""
    from ._framework import as_array, difference, dtype_name, same

    a, e = as_array(got), as_array(expected)
    if a.dtype.kind not in "iu" and a.shape == e.shape:
        values = (
            "its values are right"
            if same(a, e)
            else "and apart from the dtype: " + difference(a, e, case)
        )
        return f"your array is {dtype_name(got)}, not integer; {values}"
    return difference(got, expected, case)


def _float_codes(lengths, block):
    return _block_reference(lengths, block).astype(np.float64)


BLOCK_MASK_MISTAKES = [
    Mistake(
        "float_codes",
        "the codes 0, 1 and 2 are right but stored as floats: the answer is "
        "an integer array, which a kernel's scheduler indexes with",
        "build the codes as integers (np.zeros(..., dtype=np.int64), or "
        ".astype(np.int64) at the end)",
        _float_codes,
    ),
    Mistake(
        "causal_per_block",
        "the causal triangle is forgotten inside the diagonal tiles: a "
        "diagonal tile within one document is called full, though its "
        "queries may not see the keys after them (causality decided block "
        "by block, key block <= query block, not position by position)",
        "a tile is full only if its last key comes no later than its first "
        "query; a diagonal tile of more than one position is at most partial",
        _blocks_causal,
    ),
    Mistake(
        "no_causal",
        "the causal mask is forgotten: tiles above the diagonal within one "
        "document are computed, as if packing only kept documents apart",
        "the packed mask is block-diagonal *and* causal within each "
        "document: key j is visible to query i only if j <= i",
        _no_causal,
    ),
    Mistake(
        "no_documents",
        "the documents are ignored: the tiles are those of the plain causal "
        "mask of the whole row, so a query's tiles reach back into the "
        "documents before its own",
        "the packed mask is causal *and* block-diagonal: key j is visible "
        "to query i only if j <= i and both lie in one document",
        _no_documents,
    ),
    Mistake(
        "no_full_class",
        "every tile with a visible pair is marked partial (1): the full "
        "class (2), the tiles a kernel computes without the mask, is never "
        "used",
        "mark a tile 2 when every one of its (query, key) pairs may attend, "
        "1 when only some may",
        _relabel([SKIP, PARTIAL, PARTIAL]),
    ),
    Mistake(
        "any_visible_full",
        "every tile with a visible pair is marked full (2): a kernel would "
        "compute the partial tiles without the mask, letting queries see the "
        "future or other documents",
        "full needs *every* pair of the tile visible; a tile with only some "
        "visible pairs is partial (1)",
        _relabel([SKIP, FULL, FULL]),
    ),
    Mistake(
        "full_partial_swapped",
        "the codes of full and partial tiles are swapped: 1 where every pair "
        "may attend, 2 where only some may",
        "0 = skipped (no pair visible), 1 = partial (the mask is needed), "
        "2 = full (every pair visible)",
        _relabel([SKIP, FULL, PARTIAL]),
    ),
    Mistake(
        "first_position_document",
        "each block is taken to lie in the document of its first position: "
        "a block in which a document ends and the next begins is treated as "
        "one document",
        "a block can hold the end of one document and the start of the "
        "next: compare the documents of a tile's first key and *last* "
        "query (every position between lies in one document exactly when "
        "those two do), and for 'any pair visible' the document start of "
        "the tile's first query at or after its first key",
        _first_position_document,
    ),
    Mistake(
        "full_first_query",
        "a tile is called full when its first key lies in the document of "
        "the tile's *first* query: a document that begins later in the "
        "query block is missed, so its queries would see keys of the "
        "document before",
        "a tile is full only when its first key and its *last* query lie in "
        "one document (then every position between does) and its last key "
        "comes no later than its first query",
        _full_first_query,
    ),
    Mistake(
        "some_last_query",
        "'some pair visible' is tested on the tile's last query only: when "
        "a new document begins inside the query block, its last query sees "
        "none of the keys, but earlier queries of the tile, in the document "
        "before, may see some; those tiles are skipped",
        "a tile holds a visible pair when some query q of it sees some of "
        "its keys: test every document that the query block overlaps, or "
        "the earliest query at or after the first key with its document's "
        "start no later than the last key",
        _some_last_query,
    ),
    Mistake(
        "some_superdiagonal",
        "the tile just above the diagonal is called partial when a document "
        "runs across the two blocks: the 'some pair visible' test compares "
        "the key block's first position with the query block's end taken as "
        "inclusive (k_first <= q_first + block), so the key one past the last "
        "query counts as visible",
        "a key is visible to a query only if it comes no later: the tile "
        "holds a visible pair only if k_first <= q_last, the query block's "
        "*last* position, min((a + 1) * block, n) - 1",
        _some_superdiagonal,
    ),
    Mistake(
        "some_ignores_documents",
        "the 'some pair visible' test looks at causality alone (key block "
        "<= query block): a tile whose queries and keys lie in different "
        "documents is called partial, though the packed mask hides every one "
        "of its pairs (it is skipped)",
        "a tile holds a visible pair only if some document has a query in "
        "the query block and a key, no later than that query, in the key "
        "block: the two blocks must share a document",
        _some_ignores_documents,
    ),
    Mistake(
        "some_first_or_last_document",
        "the 'some pair visible' test compares only the blocks' first "
        "documents or their last documents: when the query block begins in "
        "the document in which the key block ends (or a document lies "
        "between), the two blocks share a document that the test misses",
        "two blocks share a document when their ranges of documents overlap: "
        "max(first documents) <= min(last documents)",
        _some_first_or_last_document,
    ),
    Mistake(
        "full_ignores_causal",
        "the 'every pair visible' test looks at the documents alone: a tile "
        "whose two blocks lie in one document is called full even on or "
        "above the diagonal, where a query may not see the keys after it",
        "full needs the documents *and* causality: every key of the tile no "
        "later than every query, k_last <= q_first",
        _full_ignores_causal,
    ),
    Mistake(
        "full_ignores_documents",
        "the 'every pair visible' test checks that each block lies in a "
        "single document, but not that it is the *same* document for both: "
        "a tile of a query block in one document and a key block in an "
        "earlier one is called full, though no pair of it may attend",
        "compare the documents across the tile too: the key block's first "
        "document must equal the query block's last",
        _full_ignores_documents,
    ),
    Mistake(
        "document_boundary_off_by_one",
        "off by one at the document boundaries: the first position of each "
        "document is counted in the document before it (np.searchsorted on "
        "the cumulative lengths with its default side='left')",
        "document d holds positions cum[d-1] .. cum[d] - 1 (cum the "
        "cumulative lengths): np.searchsorted(cum, p, side='right') is the "
        "document of position p, or build the labels with "
        "np.repeat(np.arange(len(lengths)), lengths)",
        _boundary_off_by_one,
    ),
    Mistake(
        "full_strict",
        "a tile is called full only if its last key comes *before* its "
        "first query (k_last < q_first): a diagonal tile of a single "
        "position (block 1, or a ragged last block of one position) has its "
        "one pair visible and is full",
        "the hardest pair is (first query, last key); it may attend when "
        "k_last <= q_first",
        _full_strict,
    ),
    Mistake(
        "ragged_padded",
        "the last, ragged block is padded to a full block and its padding "
        "counted as masked pairs, so a tile whose real pairs all attend is "
        "called partial. (FlexAttention's create_block_mask pads this way: "
        "safe, but it applies the mask where none is needed; this exercise "
        "counts real positions only)",
        "the last block holds n - (n_blocks - 1) * block positions: take "
        "its last position as min((a + 1) * block, n) - 1 (block a)",
        _ragged_padded,
    ),
    Mistake(
        "floor_blocks",
        "the last, ragged block is dropped: n // block blocks instead of "
        "ceil(n / block), so its positions belong to no tile",
        "n_blocks = -(-n // block) (ceil(n / block)); the last block may "
        "hold fewer than block positions",
        _floor_blocks,
    ),
    Mistake(
        "transposed",
        "the array is transposed: rows are key blocks and columns query "
        "blocks",
        "entry [a, c] is the tile of query block a (rows of the mask) and "
        "key block c (columns)",
        _transposed,
    ),
    Mistake(
        "ends_inclusive",
        "off by one at the block edges: each block is taken to end at the "
        "first position of the next one, (a + 1) * block, instead of "
        "(a + 1) * block - 1",
        "block a holds positions a * block .. min((a + 1) * block, n) - 1; "
        "the end (a + 1) * block is exclusive",
        _ends_inclusive,
    ),
    Mistake(
        "index_at_n",
        "an index one past the end of an array (index k of an array of k "
        "entries). Most often a document boundary used as a position: a "
        "zero-length document at the end of the row starts at n, and so does "
        "the end of the last document. It can also be an array of blocks or "
        "documents counted differently from the indices into it (a block "
        "count that is not ceil(n / block), or labels that count the empty "
        "documents used on an array of the non-empty ones)",
        "positions run from 0 to n - 1: label them with "
        "np.repeat(np.arange(len(lengths)), lengths), which skips "
        "zero-length documents, or drop those first (lengths[lengths > 0]); "
        "there are ceil(n / block) blocks, and every array indexed by a "
        "label must be built from the same list of documents",
        _raise_index_error,
        raises=_index_at_n,
    ),
]


def block_mask_cases() -> list[Case]:
    """Small cases; each catches some of the mistakes above (the first one
    most of them)."""

    def case(name, lengths, block):
        return Case(name, (np.array(lengths), block))

    return [
        case("lengths [5, 3, 8], block 4", [5, 3, 8], 4),
        case(
            "lengths [4, 4, 4, 1], block 4 (a last block of one position)",
            [4, 4, 4, 1],
            4,
        ),
        case(
            "lengths [3, 0, 6, 0], block 4 (zero-length documents)",
            [3, 0, 6, 0],
            4,
        ),
        case("lengths [7], block 3 (one document)", [7], 3),
        case("lengths [9, 1, 14, 2, 4, 2], block 5", [9, 1, 14, 2, 4, 2], 5),
        case("lengths [2, 3], block 1", [2, 3], 1),
        case("lengths [2, 3], block 8 (one block, longer than n)", [2, 3], 8),
        case("lengths [1], block 4 (n = 1)", [1], 4),
    ]


# the memory case: a row of some 4,000 positions in blocks of 128
BLOCK_MEMORY_LENGTHS = (
    300, 17, 0, 512, 129, 1, 640, 255, 384, 3, 700, 90, 0, 250, 600,
)  # fmt: skip
BLOCK_MEMORY_BLOCK = 128


def check_packed_block_mask(fn) -> None:
    """Check ``fn(lengths, block)`` classifies the tiles of a packed row's
    mask.

    lengths: int array (n_docs,) of document lengths (zero allowed: an empty
    document holds no position), packed into one row of n = sum(lengths)
    positions; the mask is that of the non-empty documents,
    ``packed_causal_mask(lengths[lengths > 0])``; block: a positive int. The
    answer is an int array (n_blocks, n_blocks), n_blocks = ceil(n / block):
    entry [a, c], for query block a and key block c, is 0 when no pair of the
    tile may attend, 2 when every pair may, 1 otherwise; in the last, ragged
    block only real positions count. Besides the values, the checker measures
    the peak memory on a row of about 4,000 positions: an answer that forms
    the n x n mask is rejected (numpy's arrays through :mod:`tracemalloc`,
    torch's through its profiler where torch is imported, whatever the answer
    returns).
    """
    __tracebackhide__ = True
    cases = block_mask_cases()
    try:
        _run_block_checks(fn, cases, BLOCK_MASK_MISTAKES)
    except ExerciseError as err:
        if err.mistake not in RAGGED_ONLY or not _wrong_without_ragged(
            fn, cases
        ):
            raise
        # a mistake of the ragged block cannot explain an answer that is
        # wrong where no block is ragged: diagnose without those mistakes
        _run_block_checks(
            fn,
            cases,
            [m for m in BLOCK_MASK_MISTAKES if m.key not in RAGGED_ONLY],
        )
    n = _check_block_memory(fn)
    print(
        f"Correct: packed block mask passes all {len(cases)} cases; on a "
        f"row of n = {n:,} in blocks of {BLOCK_MEMORY_BLOCK} it never "
        "needed the memory of the n x n mask."
    )


# mistakes that change only the last, ragged block: where every block is whole
# they give the reference's answer
RAGGED_ONLY = ("ragged_padded", "floor_blocks")


# the hint when no mistake is recognised: the exercise's own definitions (the
# derivation is in the solution, which the reader has not opened)
BLOCK_MASK_HINT = (
    "tile (a, c) has its queries q_first .. q_last and keys k_first .. "
    "k_last (q_last = min((a + 1) * block, n) - 1, k_last likewise for "
    "block c); a pair may attend when the key comes no later than the query "
    "and both lie in one document. For each kind of tile, ask which of its "
    "pairs is the hardest to make visible (for 'full') or the easiest (for "
    "'some pair visible'), and what the documents of the blocks' end "
    "positions say about the positions between them. Print your answer "
    "next to the tiles of the dense mask on a small case to find the tile "
    "that differs"
)


def _run_block_checks(fn, cases, mistakes) -> None:
    __tracebackhide__ = True
    run_checks(
        "packed block mask",
        fn,
        cases,
        _block_reference,
        mistakes,
        compare=_same_codes,
        describe=_describe_codes,
        hint=BLOCK_MASK_HINT,
        # its "Correct" line waits for the memory check
        quiet=True,
    )


def _wrong_without_ragged(fn, cases) -> bool:
    """Whether ``fn`` is wrong (or fails) on a case whose row fills whole
    blocks."""
    from ._framework import fresh

    for case in cases:
        lengths, block = case.args
        if int(np.sum(lengths)) % block:
            continue
        given = fresh(case)
        try:
            with np.errstate(all="ignore"):
                got = fn(*given.args, **given.kwargs)
            right = _same_codes(got, _block_reference(*case.args))
        except Exception:
            right = False
        if not right:
            return True
    return False


def _check_block_memory(fn) -> int:
    """Reject an answer whose peak memory on a long row is that of an n x n
    boolean mask; return n."""

    from ..bench import format_bytes
    from ._framework import (
        ExerciseError,
        peak_memory_with_torch,
    )

    __tracebackhide__ = True
    lengths = np.array(BLOCK_MEMORY_LENGTHS)
    n, block = int(lengths.sum()), BLOCK_MEMORY_BLOCK
    case = f"{len(lengths)} documents, n = {n}, block {block} (memory)"
    expected = _block_reference(lengths, block)
    # numpy's arrays, and torch's allocations (which tracemalloc does not
    # see) whatever the answer returns or names
    out, peak = peak_memory_with_torch(fn, lengths, block)
    # a quarter of the n x n boolean mask
    limit = n * n // 4
    if peak >= limit:
        raise ExerciseError(
            "packed block mask",
            case,
            "the values may be right, but your function's peak memory was "
            f"{format_bytes(peak)}, that of an n x n mask "
            f"({format_bytes(n * n)} as booleans): the tiles are to be "
            "classified from the documents' boundaries, as a kernel does "
            "before it touches the scores",
            hint="for a tile you need only its first and last query and key "
            "positions and the document (and its start) of a few of them: "
            "arrays of n or of n_blocks x n_blocks entries",
        )
    if not _same_codes(out, expected):
        # the long row as a case of its own: the mistakes and the hint of the
        # small cases (no other case to confirm a mistake: the small ones all
        # passed)
        _run_block_checks(
            fn,
            [Case(case.replace(" (memory)", ""), (lengths, block))],
            BLOCK_MASK_MISTAKES,
        )
        raise ExerciseError(
            "packed block mask",
            case,
            "values differ from the reference on a long row",
            hint=BLOCK_MASK_HINT,
        )
    return n
