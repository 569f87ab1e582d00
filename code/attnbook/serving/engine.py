"""Continuous batching: an iteration-level scheduler that serves many
requests with one model, its KV cache kept in blocks (Yu et al. 2022; Kwon et
al. 2023).

At every step the scheduler

1. gives every running sequence a slot for its next token (a new block when
   its last block is full, a copy when its last block is shared), preempting
   the most recently admitted sequence when no block is free;
2. admits waiting requests, oldest first, while the blocks of their prompts
   and the step's token budget allow (a prompt's first full blocks may be
   shared with a sequence already holding them: :mod:`.prefix`);
3. runs **one** forward pass of the model over the step's tokens of all
   scheduled sequences, packed into one row: a whole prompt for a newly
   admitted request, one token for a running one. Each layer writes the new
   keys and values into their slots and reads each sequence's keys and values
   through its block table; a mask lets a token see only the earlier
   positions of its own sequence;
4. appends each sequence's next token, and retires the finished ones, whose
   blocks go back to the free list at once.

``policy="static"`` is request-level scheduling for comparison: a batch is
admitted only when the previous one has wholly finished, and its finished
sequences wait for the longest one (their idle slots are counted, not
computed). A preempted sequence is recomputed: its blocks are freed, and it
waits at the head of the queue to be prefilled again, prompt and generated
tokens together. :class:`Stats` counts what that costs and what swapping its
blocks out to host memory and back would have moved instead.

Chapter 15 (serving) shows :meth:`Engine.step` and runs the tiny GPT
(:class:`attnbook.gpt.TinyGPT`) on it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .. import _validate
from .allocator import BlockAllocator, OutOfBlocks, blocks_needed
from .paged_cache import slots
from .prefix import PrefixIndex, block_hashes


@dataclass
class Request:
    """A prompt (token ids) to continue by ``max_new_tokens`` tokens, arriving
    at step ``arrival``. ``temperature=0`` is greedy; otherwise tokens are
    sampled with a generator seeded by ``seed``. ``n_samples > 1`` is parallel
    sampling: the sequence forks after its prefill into ``n_samples``
    sequences that share the prompt's blocks (sample ``j`` seeded by ``seed +
    j``)."""

    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0
    temperature: float = 0.0
    seed: int = 0
    n_samples: int = 1


@dataclass
class Sequence:
    """One sequence being served: its tokens (prompt, then generated), its
    block table, and how many of its positions are in the cache."""

    seq_id: int
    tokens: list[int]
    n_prompt: int
    request: Request
    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    n_cached: int = 0
    generator: torch.Generator | None = None
    admitted: int = -1
    first_token_step: int | None = None
    finish_step: int | None = None
    forked: bool = False

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.n_prompt :]

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.request.max_new_tokens


@dataclass
class Stats:
    """What a run cost, counted (nothing here is timed)."""

    # forward passes of the model, and tokens fed through them
    forward_passes: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    # prompt tokens whose keys and values were shared, not computed
    prefill_skipped: int = 0
    # static batching: steps x finished sequences waiting for their batch
    idle_slots: int = 0
    # blocks copied because a shared block was about to be written
    copies: int = 0
    preemptions: int = 0
    # positions prefilled again after a preemption by recompute
    recomputed_tokens: int = 0
    # blocks that swapping would have moved out and back in instead
    swapped_blocks: int = 0
    # the most blocks in use at once
    peak_blocks: int = 0


class BatchView:
    """One layer's cache for one step: the model sees the step's packed
    tokens as one sequence at position 0 with an empty cache (``length`` 0);
    :meth:`update` writes their keys and values into the pool at ``write``
    and returns the pool's ``read`` slots, every scheduled sequence's keys in
    order."""

    length = 0

    def __init__(self, keys, values, write, read):
        self.keys, self.values = keys, values
        self.write, self.read = write, read

    def update(self, k, v):
        # (1, n_kv_heads, T, d) -> (T, n_kv_heads, d)
        self.keys[self.write] = k[0].transpose(0, 1)
        self.values[self.write] = v[0].transpose(0, 1)
        # (1, n_kv_heads, K, d)
        return (
            self.keys[self.read].transpose(0, 1)[None],
            self.values[self.read].transpose(0, 1)[None],
        )


class Engine:
    """Serve :class:`Request` s with ``model`` (a :class:`TinyGPT`), its KV
    cache ``n_blocks`` blocks of ``block_size`` positions per layer.

    ``max_tokens`` caps the tokens of one forward pass (default and at most
    the model's context length: the packed row gets one position embedding
    per token); ``max_running`` caps the sequences running at once;
    ``prefix_sharing`` shares the full blocks of equal prefixes.
    """

    def __init__(
        self,
        model,
        n_blocks: int,
        block_size: int,
        max_tokens: int | None = None,
        max_running: int | None = None,
        policy: str = "continuous",
        prefix_sharing: bool = False,
    ):
        cfg = model.config
        self.model = model
        self.block_size = _validate.positive_int("block_size", block_size)
        self.allocator = BlockAllocator(n_blocks)
        self.max_tokens = _validate.int_in_range(
            "max_tokens",
            cfg.context_length if max_tokens is None else max_tokens,
            1,
            cfg.context_length,
        )
        self.max_running = (
            None
            if max_running is None
            else _validate.positive_int("max_running", max_running)
        )
        if policy not in ("continuous", "static"):
            raise ValueError(
                f"policy must be 'continuous' or 'static'; got {policy!r}"
            )
        self.policy = policy
        self.index = PrefixIndex() if prefix_sharing else None
        weight = model.tok_emb.weight
        # (n_layers, n_blocks * block_size, n_kv_heads, d_head): flat slots
        pool = (
            cfg.n_layers,
            n_blocks * block_size,
            cfg.n_kv_heads,
            cfg.d_model // cfg.n_heads,
        )
        self.keys = torch.zeros(pool, dtype=weight.dtype, device=weight.device)
        self.values = torch.zeros_like(self.keys)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.finished: dict[int, Sequence] = {}
        self.clock = 0
        self.stats = Stats()
        # times read by run(clock=...): before the first step, after each
        self.step_ends: list[float] = []
        self._next_id = 0

    # ---- requests in and out

    def add(self, request: Request) -> int:
        """Queue ``request``; returns its sequence id (its parallel samples
        get the next ids when they fork). A request that could never fit is
        refused with a ValueError."""
        prompt = [int(t) for t in request.prompt]
        n_new = _validate.positive_int(
            "max_new_tokens", request.max_new_tokens
        )
        _validate.nonnegative_int("arrival", request.arrival)
        n_samples = _validate.positive_int("n_samples", request.n_samples)
        if not prompt:
            raise ValueError("a request needs a prompt of at least 1 token")
        # the last new token is returned, never fed back
        total = len(prompt) + n_new - 1
        need = blocks_needed(total, self.block_size)
        cfg = self.model.config
        if need * n_samples > self.allocator.n_blocks:
            raise ValueError(
                f"a request of {len(prompt)} prompt + {n_new} new tokens "
                f"(x {n_samples} samples) needs {need * n_samples} blocks of "
                f"{self.block_size} positions; the whole cache has "
                f"{self.allocator.n_blocks}"
            )
        # a preempted sequence is prefilled again in one forward pass
        if total > self.max_tokens:
            raise ValueError(
                f"a request of {len(prompt)} prompt + {n_new} new tokens "
                f"needs {total} positions; one forward pass takes at most "
                f"max_tokens={self.max_tokens} "
                f"(context_length={cfg.context_length})"
            )
        seq = self._new_sequence(prompt, len(prompt), request)
        self.waiting.append(seq)
        return seq.seq_id

    def cancel(self, seq_id: int) -> None:
        """Stop a waiting or running sequence and free its blocks."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    self._release(seq)
                    return
        raise ValueError(f"no waiting or running sequence {seq_id}")

    def outputs(self) -> dict[int, list[int]]:
        """Generated tokens of every finished sequence, by id."""
        return {i: s.generated for i, s in sorted(self.finished.items())}

    def run(self, requests=(), max_steps: int = 100_000, clock=None):
        """Add ``requests`` and step until every one has finished; returns
        :meth:`outputs`. ``clock`` (e.g. ``time.perf_counter``), when given,
        is read before the first step and after each, into
        ``self.step_ends``."""
        for request in requests:
            self.add(request)
        self.step_ends = [] if clock is None else [clock()]
        while self.waiting or self.running:
            if self.clock >= max_steps:
                raise RuntimeError(f"not finished after {max_steps} steps")
            self.step()
            if clock is not None:
                self.step_ends.append(clock())
        return self.outputs()

    def latencies(self) -> dict[str, np.ndarray]:
        """Per finished sequence, in order of id: steps from arrival to the
        first token (``ttft_steps``) and to the last (``total_steps``); with
        the times :meth:`run` recorded (a fresh engine, arrivals counted from
        its first step), the same in seconds (``ttft_s``) and the time per
        output token after the first (``per_token_s``)."""
        seqs = [s for _, s in sorted(self.finished.items())]
        arrival = np.array([s.request.arrival for s in seqs])
        first = np.array([s.first_token_step for s in seqs])
        last = np.array([s.finish_step for s in seqs])
        out = {"ttft_steps": first - arrival, "total_steps": last - arrival}
        ends = np.asarray(self.step_ends)
        if len(ends) == self.clock + 1:
            # step k (1-based) runs from ends[k - 1] to ends[k]
            n_new = np.array([len(s.generated) for s in seqs])
            out["ttft_s"] = ends[first] - ends[arrival]
            out["per_token_s"] = (ends[last] - ends[first]) / np.maximum(
                n_new - 1, 1
            )
        return out

    # ---- one step

    @torch.no_grad()
    def step(self) -> list[tuple[int, int]]:
        """One iteration: schedule, one forward pass, append, retire. Returns
        the ``(seq_id, token)`` generated at this step."""
        preempted = self._reserve_decode_slots()
        if not preempted:
            self._admit()
        self.clock += 1
        # static batching: a finished sequence waits for its batch, idle
        batch = [seq for seq in self.running if not seq.done]
        self.stats.idle_slots += len(self.running) - len(batch)
        if not batch:
            self._retire()
            return []
        fed = [seq.tokens[seq.n_cached :] for seq in batch]
        emitted = self._forward(batch, fed)
        self._retire()
        return emitted

    def _reserve_decode_slots(self) -> bool:
        """A slot for the next token of every running sequence; preempt the
        latest admitted while blocks run out. Returns whether any was."""
        preempted = False
        for seq in list(self.running):
            if seq not in self.running or seq.done:
                continue  # preempted for an older one, or idle
            while True:
                try:
                    self._make_room(seq, len(seq.tokens))
                    break
                except OutOfBlocks:
                    self._preempt(self.running[-1])
                    preempted = True
                    if seq not in self.running:
                        break
        return preempted

    def _admit(self) -> None:
        if self.policy == "static" and self.running:
            return
        budget = self.max_tokens - len(self.running)
        arrived = [s for s in self.waiting if s.request.arrival <= self.clock]
        for seq in arrived:
            if self.max_running and len(self.running) >= self.max_running:
                break
            shared = self._match_prefix(seq)
            need = blocks_needed(len(seq.tokens), self.block_size) - len(
                shared
            )
            to_feed = len(seq.tokens) - len(shared) * self.block_size
            if to_feed > budget or need > self.allocator.n_free:
                break  # first come, first served: no overtaking
            for block in shared:
                seq.table.append(self.allocator.share(block))
            seq.hashes = seq.hashes[: len(shared)]
            seq.n_cached = len(shared) * self.block_size
            self.stats.prefill_skipped += seq.n_cached
            self._make_room(seq, len(seq.tokens))
            budget -= to_feed
            self.waiting.remove(seq)
            seq.admitted = self.clock
            self.running.append(seq)

    def _forward(self, batch, fed) -> list[tuple[int, int]]:
        """One forward pass over ``fed[i]``, the new tokens of ``batch[i]``;
        append each sequence's next token."""
        size = self.block_size
        ids, positions, write, read, owner_q, owner_k, pos_k = (
            [] for _ in range(7)
        )
        for i, (seq, new) in enumerate(zip(batch, fed)):
            end = len(seq.tokens)
            seq_slots = slots(seq.table, end, size).tolist()
            ids += new
            positions += range(seq.n_cached, end)
            write += seq_slots[seq.n_cached :]
            read += seq_slots
            owner_q += [i] * len(new)
            owner_k += [i] * end
            pos_k += range(end)
        q_owner, k_owner = torch.tensor(owner_q), torch.tensor(owner_k)
        q_pos, k_pos = torch.tensor(positions), torch.tensor(pos_k)
        # (1, 1, T, K): a token sees the positions of its own sequence up to
        # its own
        mask = (q_owner[:, None] == k_owner[None]) & (
            k_pos[None] <= q_pos[:, None]
        )
        write, read = torch.tensor(write), torch.tensor(read)
        views = [
            BatchView(self.keys[layer], self.values[layer], write, read)
            for layer in range(self.model.config.n_layers)
        ]
        device = self.keys.device
        logits = self.model(
            torch.tensor([ids], device=device),
            views,
            positions=q_pos[None].to(device),
            mask=mask[None, None].to(device),
            is_causal=False,
        )[0]
        self.stats.forward_passes += 1
        # the last fed token of each sequence
        last = torch.cumsum(torch.tensor([len(f) for f in fed]), 0) - 1
        emitted = []
        for seq, new, row in zip(batch, fed, logits[last]):
            if len(new) > 1 or not seq.generated:
                self.stats.prefill_tokens += len(new)
            else:
                self.stats.decode_tokens += len(new)
            seq.n_cached = len(seq.tokens)
            self._name_full_blocks(seq)
            family = [seq]
            if seq.request.n_samples > 1 and not seq.forked:
                family += self._fork(seq)
            for member in family:
                token = self._pick(member, row)
                member.tokens.append(token)
                if member.first_token_step is None:
                    member.first_token_step = self.clock
                emitted.append((member.seq_id, token))
        return emitted

    def _retire(self) -> None:
        done = [s for s in self.running if s.done]
        if self.policy == "static" and len(done) < len(self.running):
            return
        for seq in done:
            self.running.remove(seq)
            seq.finish_step = self.clock
            self._release(seq)
            self.finished[seq.seq_id] = seq

    # ---- blocks

    def _make_room(self, seq: Sequence, end: int) -> None:
        """Blocks for positions ``n_cached .. end - 1`` of ``seq``: new blocks
        past its table, and a private copy of a shared block it will write
        into. Raises :class:`OutOfBlocks`, changing nothing, when the free
        blocks do not suffice."""
        size = self.block_size
        first = seq.n_cached // size
        extra = blocks_needed(end, size) - len(seq.table)
        shared = [
            i
            for i in range(first, len(seq.table))
            if self.allocator.ref_counts[seq.table[i]] > 1
        ]
        if extra + len(shared) > self.allocator.n_free:
            raise OutOfBlocks(
                f"sequence {seq.seq_id} needs {extra + len(shared)} blocks; "
                f"{self.allocator.n_free} are free"
            )
        for i in shared:
            old = seq.table[i]
            fresh, copied = self.allocator.copy_on_write(old)
            if copied:
                self.keys[:, fresh * size : (fresh + 1) * size] = self.keys[
                    :, old * size : (old + 1) * size
                ]
                self.values[:, fresh * size : (fresh + 1) * size] = (
                    self.values[:, old * size : (old + 1) * size]
                )
                self.stats.copies += 1
                seq.table[i] = fresh
        for _ in range(extra):
            seq.table.append(self.allocator.allocate())
        used = self.allocator.n_blocks - self.allocator.n_free
        self.stats.peak_blocks = max(self.stats.peak_blocks, used)

    def _release(self, seq: Sequence) -> None:
        for block in seq.table:
            if self.allocator.free(block) and self.index is not None:
                self.index.forget(block)
        seq.table = []
        seq.hashes = []
        seq.n_cached = 0

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: free the blocks of ``seq``; it waits at the
        head of the queue, to be prefilled again."""
        self.stats.preemptions += 1
        self.stats.recomputed_tokens += seq.n_cached
        self.stats.swapped_blocks += 2 * len(seq.table)
        self.running.remove(seq)
        self._release(seq)
        self.waiting.insert(0, seq)

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Blocks of a prefix of ``seq`` already in the index: full blocks of
        its first ``len(tokens) - 1`` tokens (the last one is always fed, for
        its logits)."""
        if self.index is None:
            return []
        seq.hashes = block_hashes(seq.tokens[:-1], self.block_size)
        return self.index.match(seq.hashes)

    def _name_full_blocks(self, seq: Sequence) -> None:
        if self.index is None:
            return
        n_full = seq.n_cached // self.block_size
        if len(seq.hashes) < n_full:
            seq.hashes = block_hashes(
                seq.tokens[: n_full * self.block_size], self.block_size
            )
        for h, block in zip(seq.hashes[:n_full], seq.table):
            self.index.add(h, block)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Parallel sampling: ``n_samples - 1`` more sequences sharing every
        block of ``seq`` (copy on write when one writes a shared block)."""
        seq.forked = True
        children = []
        for j in range(1, seq.request.n_samples):
            child = self._new_sequence(
                list(seq.tokens), seq.n_prompt, seq.request, offset=j
            )
            child.table = [self.allocator.share(b) for b in seq.table]
            child.hashes = list(seq.hashes)
            child.n_cached = seq.n_cached
            child.forked = True
            child.admitted = seq.admitted
            self.running.append(child)
            children.append(child)
        return children

    def _new_sequence(self, tokens, n_prompt, request, offset=0) -> Sequence:
        seq = Sequence(self._next_id, tokens, n_prompt, request)
        self._next_id += 1
        if request.temperature > 0:
            seq.generator = torch.Generator().manual_seed(
                request.seed + offset
            )
        return seq

    @staticmethod
    def _pick(seq: Sequence, logits) -> int:
        temperature = seq.request.temperature
        if temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=seq.generator))

    # ---- invariants

    def check(self) -> None:
        """Raise AssertionError unless every block is free or held, and each
        held block's reference count is the number of tables that hold it."""
        held = [0] * self.allocator.n_blocks
        for seq in self.running + self.waiting:
            for block in seq.table:
                held[block] += 1
        free = list(self.allocator.free_list)
        assert len(free) == len(set(free)), "a block is free twice"
        assert held == self.allocator.ref_counts, (
            "reference counts differ from the block tables"
        )
        assert set(free) == {b for b, n in enumerate(held) if n == 0}, (
            "the free list is not the set of unheld blocks"
        )
        if self.index is not None:
            for h, block in self.index.block_of.items():
                assert held[block] > 0, f"the index names free block {block}"
