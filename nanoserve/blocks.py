"""Which KV blocks each sequence owns (days 14-15, prefix caching days 19-20).

The KV pool is cut into blocks of `block_size` slots. A `BlockTable` is one sequence's list of
block ids and turns a token position into a slot number; a `BlockAllocator` hands blocks out
from a free list and counts references, so that sequences with a common prompt prefix can
share the blocks that hold it:

    block_size 4, table.blocks [7, 2]:  position 0 -> slot 28, position 5 -> slot 9

Prefix caching: a full block is named by a chained hash of its tokens and of every token
before it (`block_hashes`): SHA-256 of the parent block's hash and the block's token ids, so
equal names mean equal prefixes up to a 2**-256 chance. A hit is still confirmed against what
the block holds, its tokens and its parent's hash, so even a collision could not hand one
prefix's K/V to another. When a prompt arrives, its leading full blocks whose hashes are
known are reused instead of recomputed. A freed block keeps its hash on the free list and can
still be claimed by a later prompt, until it is handed out fresh (least recently freed first).

This module is bookkeeping on integers only. The K/V tensors live in `cache.py`, how many
blocks fit in memory is `pool.py`'s business, and who gets blocks when is the scheduler's.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class NoFreeBlocks(Exception):
    """An allocation asked for more blocks than are free; nothing was allocated."""


@dataclass
class BlockTable:
    """One sequence's blocks, in position order.

    >>> t = BlockTable(block_size=4, blocks=[7, 2])
    >>> t.slot(0), t.slot(3), t.slot(5)
    (28, 31, 9)
    >>> t.slots(2, 6)
    [30, 31, 8, 9]
    """

    block_size: int
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens whose K/V has a slot
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # chained hashes of the leading full blocks, kept so each step hashes only the new block
    hashes: list[bytes] = field(default_factory=list, repr=False)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    def slot(self, pos: int) -> int:
        if not 0 <= pos < self.capacity:
            raise ValueError(f"position {pos} is outside this table's {self.capacity} slots")
        return self.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, start: int, end: int) -> list[int]:
        """Slots of positions [start, end)."""
        if start < 0 or end > self.capacity:
            raise ValueError(f"positions [{start}, {end}) are outside this table's {self.capacity} slots")
        bs, blocks = self.block_size, self.blocks
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]


ROOT = bytes(32)  # the parent hash of a sequence's first block


def _chain(parent: bytes | None, block_tokens: Sequence[int]) -> bytes:
    """SHA-256 over the parent's 32-byte hash and the block's token ids as little-endian int64s.
    (Python's `hash()` of a tuple, used before, is 64 bits and not collision resistant: a
    collision would have shared K/V between two different prefixes.)"""
    data = (parent or ROOT) + struct.pack(f"<{len(block_tokens)}q", *block_tokens)
    return hashlib.sha256(data).digest()


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of token_ids; a partial last block has none.

    Block i's hash covers blocks 0..i, so equal hashes mean equal prefixes, not just equal blocks:

        block_size 2, [5, 6, 5, 6, 9] -> [h0, h1] with h0 = sha256(ROOT + (5, 6)),
                                               h1 = sha256(h0 + (5, 6)) != h0
    """
    hashes: list[bytes] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        parent = _chain(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


class BlockAllocator:
    """A free list and reference counts over `num_blocks` blocks.

    Every block is either free (ref count 0, on the free list, maybe still holding a cached
    prefix) or used (ref count = the number of tables that hold it).
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"an allocator needs 1+ blocks of 1+ tokens, not {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        # insertion order is free order: the front was freed longest ago and is handed out first
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._num_used = 0
        self._hash_of: dict[int, bytes] = {}  # block -> hash of the prefix it holds
        self._block_of: dict[bytes, int] = {}  # hash -> block, the inverse
        # block -> (parent's hash, its tokens): a hit must match both, so no collision can share
        self._contents_of: dict[int, tuple[bytes, tuple[int, ...]]] = {}
        self.usable_hits = None  # WindowBlocks.usable_hits, for a model with sliding layers
        self.on_fresh = None  # WindowBlocks.forget, told when a block is handed out fresh

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_used

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= len(self._free)

    def cached_block(self, block_hash: bytes) -> int | None:
        """The block registered under block_hash, free or used, or None."""
        return self._block_of.get(block_hash)

    # --- single blocks ----------------------------------------------------------------------

    def _take_fresh(self) -> int:
        block, _ = self._free.popitem(last=False)
        if self.on_fresh is not None:  # WindowBlocks.forget: what a sliding block kept for it is stale
            self.on_fresh(block)
        h = self._hash_of.pop(block, None)
        if h is not None:  # its old contents are about to be overwritten
            del self._block_of[h]
            del self._contents_of[block]
        self._ref[block] = 1
        self._num_used += 1
        return block

    def _share(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]
            self._num_used += 1
        self._ref[block] += 1

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free[block] = None  # to the end: reallocated last, so its prefix stays reusable longest
            self._num_used -= 1

    # --- sequences --------------------------------------------------------------------------

    def _cached_prefix(self, token_ids: Sequence[int], use_cache: bool = True) -> list[int]:
        """Blocks holding the longest cached prefix of full blocks, never the whole prompt.
        `use_cache=False` (a prompt being scored needs every position's logits) finds none."""
        if not (self.enable_prefix_caching and use_cache):
            return []
        hits = self._cached_blocks(token_ids)
        # a model with sliding layers keeps only their latest window (`WindowBlocks`)
        return hits if self.usable_hits is None else hits[: self.usable_hits(hits)]

    def _cached_blocks(self, token_ids: Sequence[int]) -> list[int]:
        bs = self.block_size
        # the last prompt token is always recomputed: its logits pick the first new token
        usable = (len(token_ids) - 1) // bs * bs
        hits, parent, h = [], ROOT, None
        # chained block by block and stopped at the first miss: a prompt whose first block is not
        # cached costs one hash here, not one per block (it is asked every step while it waits)
        for i in range(usable // bs):
            chunk = token_ids[i * bs : (i + 1) * bs]
            h = _chain(h, chunk)
            block = self._block_of.get(h)
            if block is None or self._contents_of[block] != (parent, tuple(chunk)):
                break  # not cached, or a hash collision: the block holds another prefix
            hits.append(block)
            parent = h
        return hits

    def prompt_blocks_needed(
        self, token_ids: Sequence[int], extra_tokens: int = 0, use_cache: bool = True
    ) -> int:
        """Free blocks a new prompt of token_ids would take, plus room for extra_tokens more:
        fresh blocks, and cached blocks that are free now (they leave the free list too)."""
        hits = self._cached_prefix(token_ids, use_cache)
        fresh = -(-(len(token_ids) + extra_tokens) // self.block_size) - len(hits)
        return fresh + sum(self._ref[b] == 0 for b in hits)

    def allocate_prompt(self, table: BlockTable, token_ids: Sequence[int], use_cache: bool = True) -> int:
        """Give an empty table blocks for all of token_ids; return how many tokens are cached.

        Block size 16, a 50-token prompt whose first 3 blocks are cached: the table gets those
        3 blocks (ref + 1 each) and 1 fresh one, and 48 is returned. Raises NoFreeBlocks, with
        nothing changed, when the fresh blocks are not there.
        """
        if table.blocks:
            raise ValueError("allocate_prompt needs an empty block table; free the sequence's blocks first")
        hits = self._cached_prefix(token_ids, use_cache)
        fresh = -(-len(token_ids) // self.block_size) - len(hits)
        # a cached block that is free leaves the free list too, so it cannot also be a fresh block
        if fresh > len(self._free) - sum(self._ref[b] == 0 for b in hits):
            raise NoFreeBlocks(f"{fresh} fresh blocks needed, {len(self._free)} free")
        for b in hits:
            self._share(b)
        table.blocks = hits + [self._take_fresh() for _ in range(fresh)]
        table.num_tokens = len(token_ids)
        table.num_cached_tokens = len(hits) * self.block_size
        table.hashes = [self._hash_of[b] for b in hits]
        return table.num_cached_tokens

    def blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        """New blocks table needs to cover num_tokens tokens: block size 16, 2 blocks, 40 -> 1."""
        return max(0, -(-num_tokens // self.block_size) - len(table.blocks))

    def append_slots(self, table: BlockTable, num_tokens: int) -> None:
        """Grow table to cover num_tokens tokens, all new blocks or none (NoFreeBlocks)."""
        need = self.blocks_needed(table, num_tokens)
        if need > len(self._free):
            raise NoFreeBlocks(f"{need} blocks needed, {len(self._free)} free")
        table.blocks.extend(self._take_fresh() for _ in range(need))
        table.num_tokens = max(table.num_tokens, num_tokens)

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Give back table's blocks past those num_tokens tokens need (speculative decoding: the
        blocks a rejected draft's positions took). They hold no registered prefix: only tokens
        whose K/V is kept are ever hashed (`cache_full_blocks`)."""
        keep = -(-num_tokens // self.block_size)
        while len(table.blocks) > keep:
            self._release(table.blocks.pop())
        table.num_tokens = min(table.num_tokens, num_tokens)

    def cache_full_blocks(self, table: BlockTable, token_ids: Sequence[int], upto: int | None = None) -> None:
        """Register the hashes of table's blocks that token_ids[:upto] fill, so later prompts can share them.

        Those must be tokens whose K/V is already written (a sequence's first num_computed
        tokens): a registered block may be read by another sequence's very next step. Only the
        blocks filled since the last call are hashed, and nothing is copied: a decode step's
        cost here does not grow with the context.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        n = len(token_ids) if upto is None else min(upto, len(token_ids))
        for i in range(len(table.hashes), min(n // bs, len(table.blocks))):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = table.hashes[-1] if table.hashes else ROOT
            h = _chain(parent, tokens)
            table.hashes.append(h)
            block = table.blocks[i]
            if h in self._block_of or block in self._hash_of:
                continue  # another block already holds this prefix; one copy is enough
            self._hash_of[block], self._block_of[h] = h, block
            self._contents_of[block] = (parent, tokens)

    def free(self, table: BlockTable) -> None:
        """Drop table's references and empty it. Tail first, so a shared prefix is reallocated last."""
        for b in reversed(table.blocks):
            self._release(b)
        table.blocks, table.hashes = [], []
        table.num_tokens = table.num_cached_tokens = 0

    # --- checks -----------------------------------------------------------------------------

    def check_invariants(self, tables: Iterable[BlockTable]) -> None:
        """Raise AssertionError with a sentence if the books disagree with the live tables."""
        owners = [0] * self.num_blocks
        for t in tables:
            if len(set(t.blocks)) != len(t.blocks):
                raise AssertionError(f"a block appears twice in one table: {t.blocks}")
            if t.num_tokens > t.capacity:
                raise AssertionError(f"a table covers {t.num_tokens} tokens with only {t.capacity} slots")
            for b in t.blocks:
                if not 0 <= b < self.num_blocks:
                    raise AssertionError(f"block {b} is outside the allocator's {self.num_blocks} blocks")
                owners[b] += 1
        for b, (ref, n) in enumerate(zip(self._ref, owners)):
            if ref != n:
                raise AssertionError(f"block {b} has ref count {ref} but {n} tables hold it")
            if (b in self._free) != (ref == 0):
                where = "on" if b in self._free else "off"
                raise AssertionError(f"block {b} is {where} the free list with ref count {ref}")
        if len(self._free) + self._num_used != self.num_blocks:
            raise AssertionError(
                f"{len(self._free)} free + {self._num_used} used blocks != {self.num_blocks} in total"
            )
        maps_agree = len(self._block_of) == len(self._hash_of) and all(
            self._block_of.get(h) == b for b, h in self._hash_of.items()
        )
        if not maps_agree:
            raise AssertionError("the prefix cache's hash -> block and block -> hash maps disagree")


# --- the sliding layers' blocks (phase 6, Gemma 3) ----------------------------------------------


class WindowBlocks:
    """Blocks of the layers that attend to their latest `window` positions only, kept apart from
    the other layers' so that a long context costs them no more than the window.

    vLLM's hybrid KV cache manager keeps one block table per group of layers. Here the sliding
    group's block is found through the full group's: `local_of[b]` is the sliding layers' block
    that goes with full block b (or the hole block, `num_blocks`, when none is held). The
    plans, the slot table and the captured graphs stay as they are, addressing full slots; the
    cache turns a full slot s into `local_of[s // bs] * bs + s % bs` for a sliding layer.

    Each step (`prepare`), a row takes the sliding blocks of every full block its chunk's
    queries can see, positions start - window + 1 .. end - 1, and then gives back those wholly
    before that. A full block shared by two sequences (a cached prefix) holds the same K/V for
    both, so its sliding block is shared too, counted once per sequence that holds it. A
    sliding block given back keeps its K/V on the free list (freed last, handed out first
    from the other end) until it is handed out again or its full block is (`forget`), as the
    prefix cache keeps full blocks; a prefix hit is usable as far as the sliding blocks of its
    last window are still there (`usable_hits`).

    The pool never runs out: `blocks_for` sizes it for `max_batch` rows each holding a window,
    and a step's chunks, the most the scheduler can have running at once."""

    def __init__(self, num_blocks: int, block_size: int, window: int, num_full_blocks: int):
        import torch

        self.num_blocks, self.block_size, self.window = num_blocks, block_size, window
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # full block -> sliding block; the extra last entry is the full pool's sink block, which
        # maps to the hole too. A tensor at a fixed address: captured steps read it as it changes
        self.local_of = torch.full((num_full_blocks + 1,), num_blocks, dtype=torch.long)
        self.refs: dict[int, int] = {}  # full block -> sequences holding its sliding block
        self._local: dict[int, int] = {}  # full block -> sliding block whose K/V is there: held or kept
        self._kept: dict[int, int] = {}  # free sliding block -> the full block whose K/V it still holds
        # id(seq) -> (seq, {block index: full block}) for every running row that holds any
        self.held: dict[int, tuple] = {}

    @staticmethod
    def blocks_for(max_batch: int, token_budget: int, block_size: int, window: int) -> int:
        """The most sliding blocks running rows can hold at once (`prepare` keeps to it): a row
        holds the blocks of the window - 1 positions before its next query, at most
        ceil((window - 1) / bs) + 1; a row in the step also takes its chunk's c positions, at
        most ceil(c / bs) + 1 more; the chunks of a step sum to the token budget, and at most
        max_batch rows run."""
        return max_batch * (-(-(window - 1) // block_size) + 3) + -(-token_budget // block_size)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def first_needed(self, start: int) -> int:
        """The first block index a query at position `start` (or later) can still read."""
        return max(0, start - self.window + 1) // self.block_size

    def _acquire(self, block: int) -> None:
        if self.refs.get(block, 0) == 0:
            local = self._local.get(block)
            if local is not None:  # kept on the free list with its K/V: taken back
                del self._free[local], self._kept[local]
            else:
                if not self._free:  # blocks_for rules this out; reaching it is a bookkeeping bug
                    raise RuntimeError(f"the sliding layers' {self.num_blocks} blocks are all held")
                local, _ = self._free.popitem(last=False)
                old = self._kept.pop(local, None)
                if old is not None:  # the K/V it kept for another full block is overwritten
                    del self._local[old]
                    self.local_of[old] = self.num_blocks
                self._local[block] = local
                self.local_of[block] = local
        self.refs[block] = self.refs.get(block, 0) + 1

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:  # to the free list's end, its K/V kept until handed out again
            del self.refs[block]
            local = self._local[block]
            self._free[local] = None
            self._kept[local] = block

    def forget(self, block: int) -> None:
        """Full block `block` is handed out fresh (`BlockAllocator.on_fresh`): the K/V its
        sliding block kept belongs to a prefix no longer there."""
        local = self._local.pop(block, None)
        if local is not None:
            del self._kept[local]
            self.local_of[block] = self.num_blocks

    def prepare(self, chunks) -> None:
        """Before a step over chunks (seq, start, end): every row of the step holds the sliding
        blocks its queries read and write, and no running row holds a block before what its
        next query can read (a row reads back window - 1 positions from its first uncomputed
        one, `seq.num_computed`).

        In three passes, so that nothing is freed while a row still needs it and nothing is
        taken while a block no row needs still counts: a row first shares the blocks others
        hold or the free list kept (a prefix hit admitted this step may need blocks only
        another row holds, and that row may be about to let go of them); then every running
        row gives back what lies before its window; then the step's rows take fresh blocks for
        the rest."""
        needed = []
        for seq, start, end in chunks:
            entry = self.held.setdefault(id(seq), (seq, {}))
            needed.append(
                (
                    entry[1],
                    seq.block_table.blocks,
                    range(self.first_needed(start), -(-end // self.block_size)),
                )
            )
        for mine, blocks, want in needed:  # 1: share what other rows hold or the free list kept
            for i in want:
                if i not in mine and blocks[i] in self._local:
                    mine[i] = blocks[i]
                    self._acquire(blocks[i])
        for seq, mine in self.held.values():  # 2: give back what no query of this row can read
            first = self.first_needed(seq.num_computed)
            for i in [i for i in mine if i < first]:
                self._release(mine.pop(i))
        for mine, blocks, want in needed:  # 3: fresh blocks for the rest
            for i in want:
                if i not in mine:
                    mine[i] = blocks[i]
                    self._acquire(blocks[i])

    def leave(self, seq) -> None:
        """seq left the running set (finished, aborted, preempted): its sliding blocks go back."""
        for block in self.held.pop(id(seq), (seq, {}))[1].values():
            self._release(block)

    def usable_hits(self, hits: list[int]) -> int:
        """How many leading blocks of a prefix hit can be used: as many as leave the sliding
        blocks of the window before the first computed position there, held or kept."""
        bs = self.block_size
        for h in range(len(hits), 0, -1):
            if all(hits[i] in self._local for i in range(self.first_needed(h * bs), h)):
                return h
        return 0

    def check_rows(self, chunks) -> None:
        """After `prepare`: raise AssertionError if a row of the step does not hold a sliding
        block its queries read or write (positions start - window + 1 .. end - 1)."""
        bs = self.block_size
        for seq, start, end in chunks:
            mine = self.held.get(id(seq), (seq, {}))[1]
            for i in range(max(0, start - self.window + 1) // bs, -(-end // bs)):
                if i not in mine:
                    raise AssertionError(
                        f"a row whose chunk is positions {start}..{end - 1} does not hold the sliding "
                        f"block of positions {i * bs}..{i * bs + bs - 1}, which its queries read"
                    )

    def check_invariants(self) -> None:
        """Raise AssertionError with a sentence if the counts disagree with what rows hold."""
        counts: dict[int, int] = {}
        for _, mine in self.held.values():
            for b in mine.values():
                counts[b] = counts.get(b, 0) + 1
        if counts != self.refs:
            raise AssertionError("the sliding blocks' reference counts disagree with what the rows hold")
        held = {self._local[b] for b in self.refs}
        kept = {self._local[b] for b in self._local if b not in self.refs}
        if (
            len(held) != len(self.refs)
            or held & set(self._free)
            or kept != set(self._kept)
            or not kept <= set(self._free)
            or len(held) + len(self._free) != self.num_blocks
            or any(int(self.local_of[b]) != loc for b, loc in self._local.items())
        ):
            raise AssertionError("a sliding block is both held and free, held twice, kept wrongly or lost")
