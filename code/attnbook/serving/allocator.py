"""A block allocator: the memory of a KV cache cut into ``n_blocks`` blocks of
``block_size`` positions, handed out and taken back one block at a time.

Free blocks sit on a free list; every block in use has a reference count, the
number of block tables that hold it. A block shared by several sequences (a
common prompt, the prompt of parallel samples) is written only after a copy:
:meth:`BlockAllocator.copy_on_write` gives the writer a block of its own when
others still read it. Freeing a block that is already free is an error, never
a silent no-op: that is how a double free shows itself.

Chapter 15 (serving) shows :class:`BlockAllocator`.
"""

from __future__ import annotations

from collections import deque

from .. import _validate


class OutOfBlocks(RuntimeError):
    """No free block is left: the scheduler must wait or preempt."""


def blocks_needed(n_positions: int, block_size: int) -> int:
    """Blocks that hold ``n_positions`` positions: ``ceil(n_positions /
    block_size)``."""
    n = _validate.nonnegative_int("n_positions", n_positions)
    size = _validate.positive_int("block_size", block_size)
    return -(-n // size)


class BlockAllocator:
    """``n_blocks`` blocks, ids ``0 .. n_blocks - 1``: a free list (first in,
    first out) and a reference count per block."""

    def __init__(self, n_blocks: int):
        n = _validate.positive_int("n_blocks", n_blocks)
        self.free_list = deque(range(n))
        # ref_counts[b]: how many block tables hold block b (0: free)
        self.ref_counts = [0] * n

    @property
    def n_blocks(self) -> int:
        return len(self.ref_counts)

    @property
    def n_free(self) -> int:
        return len(self.free_list)

    def allocate(self) -> int:
        """A free block, now held once; :class:`OutOfBlocks` when none is
        left."""
        if not self.free_list:
            raise OutOfBlocks(f"all {self.n_blocks} blocks are in use")
        block = self.free_list.popleft()
        self.ref_counts[block] = 1
        return block

    def share(self, block) -> int:
        """One more holder of ``block`` (in use): its count goes up by 1."""
        block = self._check_in_use(block, "share")
        self.ref_counts[block] += 1
        return block

    def free(self, block) -> bool:
        """One holder fewer; the block returns to the free list when none is
        left (returns True then). Freeing a free block raises ValueError."""
        block = self._check_in_use(block, "free")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_list.append(block)
            return True
        return False

    def copy_on_write(self, block) -> tuple[int, bool]:
        """The block a holder of ``block`` may write into: ``block`` itself
        when it is the only holder, else a fresh block (the caller copies the
        contents, and holds the old block once less). Returns ``(block to
        write, whether a copy is needed)``."""
        block = self._check_in_use(block, "write")
        if self.ref_counts[block] == 1:
            return block, False
        # allocate first: if none is free, nothing has changed
        fresh = self.allocate()
        self.ref_counts[block] -= 1
        return fresh, True

    def _check_in_use(self, block, what: str) -> int:
        block = _validate.int_in_range("block", block, 0, self.n_blocks - 1)
        if self.ref_counts[block] == 0:
            raise ValueError(
                f"cannot {what} block {block}: it is free (a double free, or "
                "a block never allocated)"
            )
        return block

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(n_blocks={self.n_blocks}, n_free={self.n_free})"
        )
