"""Prefix sharing: requests whose prompts begin alike share the cache blocks
of what they have in common.

A full block is named by a hash of its tokens *and of every token before
it*: ``h_i = hash((h_{i-1}, tokens of block i))``, as vLLM does. Two
sequences have equal hashes for block ``i`` exactly when (up to a hash
collision) their first ``(i + 1) * block_size`` tokens agree, which is what
makes the keys and values of that block equal: in a causal model they depend
on the token and on every token before it. Only full blocks are named: a
part-filled block is still being written.

:class:`PrefixIndex` maps the hashes of blocks in use to their ids; a new
request looks up its prompt's hashes in order and shares the blocks found
(the allocator's reference counts go up) instead of computing and storing
them again.

Chapter 15 (serving) shows :func:`block_hashes` and :class:`PrefixIndex`.
"""

from __future__ import annotations

from .. import _validate


def block_hashes(tokens, block_size: int) -> list[int]:
    """One hash per *full* block of ``tokens``, each of the block's tokens and
    of the hash before it (the first block's parent is ``None``)."""
    block_size = _validate.positive_int("block_size", block_size)
    tokens = [int(t) for t in tokens]
    hashes, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Hashes of full blocks in use, and the block that holds each."""

    def __init__(self):
        self.block_of: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}

    def match(self, hashes) -> list[int]:
        """The blocks of the longest run of ``hashes``, from the first, that
        the index holds."""
        found = []
        for h in hashes:
            if h not in self.block_of:
                break
            found.append(self.block_of[h])
        return found

    def add(self, h: int, block: int) -> None:
        """Name ``block`` by ``h`` (a full block, never written again); the
        first block named by a hash keeps the name."""
        if h not in self.block_of and block not in self.hash_of:
            self.block_of[h] = block
            self.hash_of[block] = h

    def forget(self, block: int) -> None:
        """Drop ``block`` (it was freed); nothing if it had no name."""
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.block_of[h]

    def __len__(self) -> int:
        return len(self.block_of)
