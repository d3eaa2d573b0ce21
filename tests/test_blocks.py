"""Block tables, the allocator's free list and ref counts, and prefix caching (blocks.py)."""

import copy
import hashlib
import struct

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import nanoserve.blocks
from nanoserve.blocks import ROOT, BlockAllocator, BlockTable, NoFreeBlocks, block_hashes


def state(alloc: BlockAllocator):
    """Everything the allocator knows, to compare before and after a refused allocation."""
    return copy.deepcopy(vars(alloc))


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50000 for i in range(n)]


# --- slots -----------------------------------------------------------------------------------


def test_slot_arithmetic_worked_examples():
    t = BlockTable(block_size=4, blocks=[7, 2])
    assert t.capacity == 8
    assert [t.slot(p) for p in (0, 3, 4, 5, 7)] == [28, 31, 8, 9, 11]
    assert t.slots(2, 6) == [30, 31, 8, 9]
    assert t.slots(0, 8) == [t.slot(p) for p in range(8)]
    assert t.slots(3, 3) == []
    t16 = BlockTable(16, [3, 0, 5])
    assert t16.slot(40) == 5 * 16 + 8


@pytest.mark.parametrize("pos", [-1, 8, 100])
def test_slot_outside_the_table_is_refused(pos):
    t = BlockTable(4, [7, 2])
    with pytest.raises(ValueError, match="outside"):
        t.slot(pos)
    with pytest.raises(ValueError, match="outside"):
        t.slots(0, 9)


def test_block_hashes_chain_over_the_whole_prefix():
    h = block_hashes([5, 6, 5, 6, 9], 2)
    assert len(h) == 2  # the partial block [9] has no hash
    sha = lambda parent, tokens: hashlib.sha256(parent + struct.pack("<2q", *tokens)).digest()
    assert h[0] == sha(ROOT, (5, 6)) and len(h[0]) == 32
    assert h[1] == sha(h[0], (5, 6)) and h[1] != h[0]  # same tokens, different prefix
    assert block_hashes([5, 6, 5, 6], 2) == h
    other = block_hashes([1, 6, 5, 6], 2)
    assert other[0] != h[0] and other[1] != h[1]  # equal second blocks, different prefixes
    assert block_hashes([5], 2) == []


def cached(alloc: BlockAllocator, tokens: list[int]) -> BlockTable:
    """A prompt admitted and its full blocks registered, as after its prefill."""
    table = BlockTable(alloc.block_size)
    alloc.allocate_prompt(table, tokens)
    alloc.cache_full_blocks(table, tokens)
    return table


# prompts of 4-token blocks: a and b end in the same block T under different first blocks A and
# B; c starts with b's first block, so b finds its block 0 in the cache and asks about block 1
A, B, T, U = [1, 2, 3, 4], [5, 6, 3, 4], [7, 8, 9, 10], [11, 12, 13, 14]


def second_block_of_b(alloc: BlockAllocator) -> tuple[BlockTable, BlockTable, BlockTable]:
    c, a = cached(alloc, B + U + [0]), cached(alloc, A + T + [0])
    b = BlockTable(alloc.block_size)
    alloc.allocate_prompt(b, B + T + [0])
    return a, b, c


def test_equal_last_blocks_under_different_parents_never_share():
    a, b, c = second_block_of_b(BlockAllocator(16, 4))
    assert b.blocks[0] == c.blocks[0]  # the same first block is shared, as it should be
    assert b.blocks[1] != a.blocks[1] and b.num_cached_tokens == 4


def test_a_hash_collision_cannot_share_blocks(monkeypatch):
    """A planted collision: a block hash that ignores the parent gives a's and b's second
    blocks one name. A hit must still be refused, because the block was registered under a's
    first block, not b's: the allocator confirms the parent hash, not only the tokens."""
    monkeypatch.setattr(
        nanoserve.blocks, "_chain", lambda parent, tokens: hashlib.sha256(bytes(tokens)).digest()
    )
    assert block_hashes(A + T, 4)[1] == block_hashes(B + T, 4)[1]  # the collision is real
    a, b, c = second_block_of_b(BlockAllocator(16, 4))
    assert b.blocks[0] == c.blocks[0]
    assert b.blocks[1] != a.blocks[1], "b was given K/V computed after a different prefix"
    assert b.num_cached_tokens == 4


# --- allocation ------------------------------------------------------------------------------


def test_fresh_prompt_takes_blocks_from_the_front_of_the_free_list():
    alloc = BlockAllocator(num_blocks=8, block_size=16)
    t = BlockTable(16)
    assert alloc.allocate_prompt(t, prompt(1, 40)) == 0
    assert t.blocks == [0, 1, 2] and t.num_tokens == 40 and t.num_cached_tokens == 0
    assert (alloc.num_free, alloc.num_used) == (5, 3)
    assert [alloc.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert alloc.blocks_needed(t, 48) == 0 and alloc.blocks_needed(t, 49) == 1
    assert alloc.blocks_needed(t, 10) == 0
    alloc.append_slots(t, 49)
    assert t.blocks == [0, 1, 2, 3] and t.num_tokens == 49 and t.capacity == 64
    alloc.check_invariants([t])
    with pytest.raises(ValueError, match="empty block table"):
        alloc.allocate_prompt(t, prompt(1, 5))


def test_second_prompt_reuses_three_blocks_of_a_finished_one():
    alloc = BlockAllocator(num_blocks=10, block_size=16)
    prefix = prompt(1, 48)
    first = BlockTable(16)
    alloc.allocate_prompt(first, prefix + [1, 2, 3, 4, 5])
    alloc.cache_full_blocks(first, prefix + [1, 2, 3, 4, 5])
    first_blocks = list(first.blocks)
    alloc.free(first)
    assert alloc.num_free == 10 and first.blocks == []

    second = BlockTable(16)
    assert alloc.allocate_prompt(second, prefix + [9, 9, 9]) == 48
    assert second.num_cached_tokens == 48
    assert second.blocks[:3] == first_blocks[:3]
    # only the fourth block is fresh: one never used before, not one of the cached three
    assert second.blocks[3] not in first_blocks
    assert alloc.num_used == 4
    assert [alloc.ref_count(b) for b in second.blocks] == [1, 1, 1, 1]
    alloc.check_invariants([second])


def test_sharing_with_a_running_prompt_counts_two_owners():
    alloc = BlockAllocator(num_blocks=10, block_size=16)
    prefix = prompt(2, 48)
    first, second = BlockTable(16), BlockTable(16)
    alloc.allocate_prompt(first, prefix + [1])
    alloc.cache_full_blocks(first, prefix + [1])
    assert alloc.allocate_prompt(second, prefix + [2, 3]) == 48
    shared = first.blocks[:3]
    assert second.blocks[:3] == shared
    assert [alloc.ref_count(b) for b in shared] == [2, 2, 2]
    assert alloc.num_used == 5  # 3 shared + one tail each
    alloc.check_invariants([first, second])
    alloc.free(first)
    assert [alloc.ref_count(b) for b in shared] == [1, 1, 1] and alloc.num_used == 4
    alloc.check_invariants([second])
    alloc.free(second)
    assert alloc.num_free == alloc.num_blocks
    alloc.check_invariants([])


def test_freed_blocks_are_reused_until_reallocated_least_recently_freed_first():
    alloc = BlockAllocator(num_blocks=6, block_size=4)
    a, b = prompt(1, 8), prompt(2, 8)
    ta, tb = BlockTable(4), BlockTable(4)
    for t, toks in ((ta, a), (tb, b)):
        alloc.allocate_prompt(t, toks)
        alloc.cache_full_blocks(t, toks)
    assert (ta.blocks, tb.blocks) == ([0, 1], [2, 3])
    alloc.free(ta)  # freed first: its blocks go first, tail (1) before prefix (0)
    alloc.free(tb)
    filler = BlockTable(4)
    alloc.allocate_prompt(filler, prompt(3, 12))  # 3 fresh blocks: never-used 4, 5, then a's tail 1
    assert filler.blocks == [4, 5, 1]
    ha, hb = block_hashes(a, 4), block_hashes(b, 4)
    # a's prefix block survived its tail; b's blocks, freed later, are both still cached
    assert [alloc.cached_block(h) for h in ha + hb] == [0, None, 2, 3]
    again = BlockTable(4)
    assert alloc.allocate_prompt(again, a[:4] + [0]) == 4
    assert again.blocks == [0, 3]  # the fresh block is b's tail: freed before b's prefix
    assert [alloc.cached_block(h) for h in hb] == [2, None]
    alloc.check_invariants([filler, again])


def test_reallocating_a_cached_block_forgets_its_prefix():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    a = prompt(1, 4)
    t = BlockTable(4)
    alloc.allocate_prompt(t, a)
    alloc.cache_full_blocks(t, a)
    alloc.free(t)
    other = BlockTable(4)
    alloc.allocate_prompt(other, prompt(2, 8))  # both blocks, a's included
    alloc.free(other)
    assert alloc.allocate_prompt(t, a + [0]) == 0


def test_whole_prompt_cached_still_recomputes_the_last_token():
    alloc = BlockAllocator(num_blocks=8, block_size=16)
    p = prompt(4, 48)
    t = BlockTable(16)
    alloc.allocate_prompt(t, p)
    alloc.cache_full_blocks(t, p)
    alloc.free(t)
    again = BlockTable(16)
    assert alloc.allocate_prompt(again, p) == 32  # not 48: the last token's logits are needed
    assert again.num_tokens == 48 and len(again.blocks) == 3
    alloc.free(again)
    longer = BlockTable(16)
    assert alloc.allocate_prompt(longer, p + [7]) == 48
    one = BlockTable(16)
    assert alloc.allocate_prompt(one, p[:1]) == 0


def test_generated_tokens_are_cached_too():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    seq = prompt(5, 6)
    t = BlockTable(4)
    alloc.allocate_prompt(t, seq)
    alloc.cache_full_blocks(t, seq)  # one full block
    for tok in (11, 12, 13):  # decode: the sequence reaches 9 tokens, two full blocks
        seq.append(tok)
        alloc.append_slots(t, len(seq))
        alloc.cache_full_blocks(t, seq)
    alloc.free(t)
    again = BlockTable(4)
    assert alloc.allocate_prompt(again, seq) == 8


def test_a_prefix_held_by_two_blocks_is_registered_once():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    p = prompt(6, 5)
    t1, t2 = BlockTable(4), BlockTable(4)
    alloc.allocate_prompt(t1, p)  # both arrive before either is cached: no sharing yet
    alloc.allocate_prompt(t2, p)
    alloc.cache_full_blocks(t1, p)
    alloc.cache_full_blocks(t2, p)
    alloc.check_invariants([t1, t2])
    assert alloc.cached_block(block_hashes(p, 4)[0]) == t1.blocks[0]
    t3 = BlockTable(4)
    assert alloc.allocate_prompt(t3, p) == 4 and t3.blocks[0] == t1.blocks[0]
    assert alloc.ref_count(t1.blocks[0]) == 2 and alloc.ref_count(t2.blocks[0]) == 1


def test_prefix_caching_off_never_shares():
    alloc = BlockAllocator(num_blocks=8, block_size=4, enable_prefix_caching=False)
    p = prompt(7, 9)
    t = BlockTable(4)
    alloc.allocate_prompt(t, p)
    alloc.cache_full_blocks(t, p)
    t2 = BlockTable(4)
    assert alloc.allocate_prompt(t2, p) == 0
    assert not set(t.blocks) & set(t2.blocks)


# --- atomic failure --------------------------------------------------------------------------


def test_refused_allocations_change_nothing():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    hog = BlockTable(4)
    alloc.allocate_prompt(hog, prompt(1, 12))
    before = state(alloc)
    t = BlockTable(4)
    with pytest.raises(NoFreeBlocks):
        alloc.allocate_prompt(t, prompt(2, 5))  # 2 blocks, 1 free
    assert state(alloc) == before and t.blocks == [] and t.num_tokens == 0
    with pytest.raises(NoFreeBlocks):
        alloc.append_slots(hog, 20)  # 2 more blocks, 1 free
    assert state(alloc) == before and len(hog.blocks) == 3 and hog.num_tokens == 12
    assert not alloc.can_allocate(2) and alloc.can_allocate(1)


def test_free_cached_blocks_are_not_counted_twice():
    # a's two cached blocks are free, and they are the only free ones: a + 8 more tokens needs
    # them plus 2 fresh blocks, which would have to be those same two
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    a = prompt(1, 8)
    ta = BlockTable(4)
    alloc.allocate_prompt(ta, a)
    alloc.cache_full_blocks(ta, a)
    alloc.free(ta)
    hog = BlockTable(4)
    alloc.allocate_prompt(hog, prompt(2, 8))
    before = state(alloc)
    with pytest.raises(NoFreeBlocks):
        alloc.allocate_prompt(BlockTable(4), a + prompt(3, 8))
    assert state(alloc) == before
    alloc.free(hog)
    assert alloc.allocate_prompt(ta, a + [0]) == 8  # still cached


# --- the invariant check fails on broken books -----------------------------------------------


def broken(how: str):
    alloc = BlockAllocator(num_blocks=6, block_size=4)
    t1, t2 = BlockTable(4), BlockTable(4)
    alloc.allocate_prompt(t1, prompt(1, 8))
    alloc.allocate_prompt(t2, prompt(2, 4))
    if how == "shared without incref":
        t2.blocks.append(t1.blocks[0])
    elif how == "ref bumped by hand":
        alloc._ref[t1.blocks[0]] += 1
    elif how == "twice in one table":
        t1.blocks.append(t1.blocks[0])
        alloc._ref[t1.blocks[0]] += 1
    elif how == "free block with a ref":
        alloc._ref[5] = 1
        t2.blocks.append(5)
    elif how == "table forgotten":
        return alloc, [t1]
    elif how == "used count drifts":
        alloc._num_used += 1
    return alloc, [t1, t2]


@pytest.mark.parametrize(
    "how, words",
    [
        ("shared without incref", "ref count 1 but 2 tables"),
        ("ref bumped by hand", "ref count 2 but 1 tables"),
        ("twice in one table", "twice"),
        ("free block with a ref", "on the free list with ref count 1"),
        ("table forgotten", "ref count 1 but 0 tables"),
        ("used count drifts", "free \\+ 4 used"),
    ],
)
def test_check_invariants_fails_on_broken_books(how, words):
    alloc, tables = broken(how)
    with pytest.raises(AssertionError, match=words):
        alloc.check_invariants(tables)


def test_check_invariants_passes_on_sound_books():
    alloc, tables = broken("nothing")
    alloc.check_invariants(tables)
    BlockAllocator(3).check_invariants([])  # vacuously


# --- random arrivals, growth, finishes and aborts --------------------------------------------

BASES = [[], [1, 2, 0, 1], [1, 2, 0, 1, 2, 2, 0, 1], [0, 0, 0, 0, 1]]


class AllocatorMachine(RuleBasedStateMachine):
    """Sequences come and go; a shadow of what each slot holds checks every reused prefix.

    `content[slot]` is the prefix whose last token's K/V the slot holds: K/V depends on every
    token before it, so a slot reused for a prompt must hold exactly that prompt's prefix.
    """

    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(num_blocks=12, block_size=4)
        self.live: list[tuple[BlockTable, list[int]]] = []
        self.content: dict[int, tuple[int, ...]] = {}
        self.hits = 0

    def compute(self, table: BlockTable, tokens: list[int], start: int) -> None:
        for pos in range(start, len(tokens)):
            block = table.blocks[pos // 4]
            assert self.alloc.ref_count(block) == 1, "a shared block was written to"
            self.content[table.slot(pos)] = tuple(tokens[: pos + 1])
        self.alloc.cache_full_blocks(table, tokens)

    @rule(base=st.sampled_from(BASES), tail=st.lists(st.integers(0, 2), max_size=10), pad=st.integers(0, 1))
    def arrive(self, base, tail, pad):
        tokens = base + tail + [0] * pad
        if not tokens:
            return
        table = BlockTable(4)
        before = state(self.alloc)
        try:
            cached = self.alloc.allocate_prompt(table, tokens)
        except NoFreeBlocks:
            assert state(self.alloc) == before and table.blocks == []
            return
        assert cached % 4 == 0 and cached < len(tokens) and cached == table.num_cached_tokens
        assert table.capacity >= len(tokens) > table.capacity - 4
        for pos in range(cached):
            assert self.content[table.slot(pos)] == tuple(tokens[: pos + 1]), "reused a wrong prefix"
        self.hits += cached > 0
        self.compute(table, tokens, cached)
        self.live.append((table, tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def grow(self, data, new):
        table, tokens = self.live[data.draw(st.integers(0, len(self.live) - 1))]
        before = state(self.alloc)
        try:
            self.alloc.append_slots(table, len(tokens) + len(new))
        except NoFreeBlocks:
            assert state(self.alloc) == before
            return
        start = len(tokens)
        tokens.extend(new)
        self.compute(table, tokens, start)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        table, _ = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.alloc.free(table)
        assert table.blocks == [] and table.num_tokens == 0

    @invariant()
    def books_balance(self):
        tables = [t for t, _ in self.live]
        self.alloc.check_invariants(tables)
        assert self.alloc.num_used == len({b for t in tables for b in t.blocks})

    def teardown(self):
        for table, _ in self.live:
            self.alloc.free(table)
        self.alloc.check_invariants([])
        assert self.alloc.num_free == self.alloc.num_blocks and self.alloc.num_used == 0


AllocatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_allocator_machine = AllocatorMachine.TestCase


def test_a_prompt_that_misses_costs_one_hash_not_one_per_block(monkeypatch):
    """Admission asks for a waiting prompt's cached prefix every step it waits. A 4,096-token
    prompt whose first block is not cached must cost one hash there, and a prompt whose first
    3 blocks are cached 4 (3 hits, 1 miss), not 256 each (it hashed every block up front)."""
    import nanoserve.blocks as blocks_mod

    alloc = BlockAllocator(400, 16)
    calls = []
    real = blocks_mod._chain
    monkeypatch.setattr(blocks_mod, "_chain", lambda parent, toks: calls.append(1) or real(parent, toks))
    prompt = list(range(4096))
    assert alloc.prompt_blocks_needed(prompt) == 256 and len(calls) == 1
    table = BlockTable(16)
    alloc.allocate_prompt(table, prompt[:48] + [7])
    alloc.cache_full_blocks(table, prompt[:48] + [7])
    calls.clear()
    assert alloc.prompt_blocks_needed(prompt) == 256 - 3 and len(calls) == 4
