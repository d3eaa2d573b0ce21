"""Continuous batching (days 26-31): which sequences run in the next step, and with what.

A `Sequence` is one request's tokens and state. The `Scheduler` keeps a waiting queue and a
running set. Two policies choose a step (`policy`):

* "budget" (the default; vLLM's since V1): one token budget per step
  (`max_num_batched_tokens`). Every running sequence that is decoding gets its one token first
  (oldest first, preempting the newest when blocks run out, as below); what is left of the
  budget goes to prompt chunks, first of running sequences still in prefill, then of new
  sequences admitted from the queue. A step may mix decode rows and prompt chunks, so a new
  prompt costs the running streams a slower step rather than a missing one.
* "prefill-first" (the earlier policy, kept as a named variant): a step is all prefill or all
  decode, and any prompt work due goes first.
* "static" (the first policy of all, days 22 and 27): a batch is admitted only when nothing is
  running, as many waiting requests as rows and blocks allow, and it runs until its last member
  finishes; nobody joins in between. A finished member leaves (its row simply idles, no padding
  is computed), so what this costs is the rows left empty while the longest member runs on.
  Its prompts are prefilled in budget-sized chunks before any of them decodes.

Both are built from the same two passes:

  - prompt chunks: unfinished prompt chunks of running sequences, then new sequences admitted
    from the front of the queue while a row is free (`max_batch`), the step's token budget
    lasts and the allocator can give the prompt its blocks and still keep the reserve free
    (below). A prompt longer than the budget is split into chunks over several steps (chunked
    prefill); a prefix the allocator already holds is skipped (prefix caching).
  - decode rows: every running sequence past its prompt gets one token. When a sequence needs a
    new block and none is free, the newest running sequence is preempted: it returns its blocks
    and goes back to the front of the queue, to be recomputed from its prompt and the tokens it
    already generated (preemption by recompute).

The reserve (day 28's watermark): a prompt is admitted only if, after its blocks (and the block
its first generated token will need), the free list still holds a block for every running
sequence whose next token starts a new block, plus `watermark` of the pool (5% by default;
vLLM keeps 1%, but its GPU pools run to thousands of blocks, and 1% of the ~100-block pools a
CPU serves rounds to nothing: on the throughput workload over 90 blocks, 1% took preemptions
from 34 to 27, 5% to 5, for 1% more steps; measured under prefill-first, where admission runs
before decode and the reserve matters most: the budget policy hands decode rows their blocks
before it admits anything, and the reserve then counts each row's block for the step after).
Without it, a prompt could take the last free blocks and the very next decode step would
preempt it, the newest, throwing its prefill away, over and over under a tight pool. With
nothing running the reserve is 0, so a prompt as long as the pool is still admitted. Under the
budget policy the decode rows already hold their slot for this step when admission runs, so
their share of the reserve is the block of the token after it.
`watermark=None` is the earlier policy, kept as a named variant: take whatever is free.

The order (`order`, vLLM's `--scheduling-policy`): "fcfs" serves requests as they arrived;
"priority" serves them by (priority, arrival), a lower `priority` first. The waiting queue is
kept in that order (a preempted sequence goes back to its place in it, not to the front), decode
rows take their tokens in it, and the sequence preempted when blocks run out is the last in it
(the lowest priority, the newest among equals) rather than simply the newest. As in vLLM, a
waiting request never preempts a running one to get in: priority decides who goes next and who
gives way when the pool runs short, not who is evicted for a newcomer.

Finished sequences leave at once (`finish`), returning their blocks. What the step computes is
`plan.py`'s; what a token means (stop strings, text) is the engine's.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from nanoserve.blocks import BlockAllocator, BlockTable, NoFreeBlocks
from nanoserve.config import SCHEDULING_POLICIES
from nanoserve.sampling import SamplingParams


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    block_size: int
    max_tokens: int = 0  # params.max_tokens, cut to what the context leaves
    token_ids: list[int] = field(default_factory=list)  # prompt, then generated tokens
    num_computed: int = 0  # tokens whose K/V is in the cache
    arrival: int = 0  # order of admission to the scheduler: preemption picks the newest
    priority: int = 0  # under the "priority" order, lower runs first (vLLM's convention)
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    # False while the prompt is being scored (prompt_logprobs): every position's logits are
    # needed, so no prefix may be skipped through the cache
    reuse_prefix: bool = True
    prompt_lp: list = field(default_factory=list)  # scores of prompt tokens 1.., as computed
    prompt_lp_sent: bool = False  # handed out with the first output
    cumulative_logprob: float = 0.0  # of the generated tokens, when their scores are computed
    matcher: object | None = None  # structured output: the grammar's state (an llguidance LLMatcher)
    # speculative decoding (speculative.py): the tokens proposed for this step, verified with the
    # newest one in a single chunk, and the proposer's state for this sequence
    draft: list[int] = field(default_factory=list)
    spec: object | None = None

    def __post_init__(self):
        self.token_ids = list(self.prompt_ids)
        self.block_table = BlockTable(self.block_size)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def needs_prefill(self) -> bool:
        """More than the newest token is missing from the cache."""
        return self.num_computed < len(self.token_ids) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Batch:
    """The scheduler's choice for one step: (seq, start, end) chunks, or decode rows."""

    chunks: list[tuple[Sequence, int, int]] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    speculative: bool = False  # some decode row carries a draft (its chunk is 1 + len(draft) tokens)

    @property
    def is_decode(self) -> bool:
        """Only one-token decode rows: the step the bucketed and captured paths serve."""
        return bool(self.decode) and not self.chunks and not self.speculative

    @property
    def is_mixed(self) -> bool:
        return bool(self.decode) and bool(self.chunks)

    @property
    def seqs(self) -> list[Sequence]:
        return self.decode + [s for s, _, _ in self.chunks]

    def as_chunks(self) -> list[tuple[Sequence, int, int]]:
        """Every row as a chunk, decode rows first: a decode row is its newest token's chunk
        (and its draft's, when it carries one)."""
        if self.speculative:
            rows = [(s, len(s.token_ids) - 1, len(s.token_ids) + len(s.draft)) for s in self.decode]
            return rows + self.chunks
        return [(s, len(s.token_ids) - 1, len(s.token_ids)) for s in self.decode] + self.chunks


class Scheduler:
    POLICIES = ("budget", "prefill-first", "static")
    ORDERS = SCHEDULING_POLICIES

    def __init__(
        self,
        allocator: BlockAllocator,
        max_batch: int,
        max_num_batched_tokens: int,
        watermark: float | None = 0.05,
        policy: str = "budget",
        order: str = "fcfs",
    ):
        if policy not in self.POLICIES:
            raise ValueError(f"the scheduling policy is one of {', '.join(self.POLICIES)}, not {policy!r}")
        if order not in self.ORDERS:
            raise ValueError(f"the request order is one of {', '.join(self.ORDERS)}, not {order!r}")
        self.policy = policy
        self.order = order
        self.allocator = allocator
        self.max_batch = max_batch
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark = watermark
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # K/V thrown away by preemption: an upper bound on what is computed again, since with
        # prefix caching a readmitted sequence may find its own full blocks still cached (day 29)
        self.recomputed_tokens = 0
        self._arrivals = itertools.count()
        self._slotted: set[int] = set()  # ids of the rows given their decode slot in this step
        self.on_leave = lambda seq: None  # told when a sequence leaves the running set

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue seq; `front` puts it ahead of everything waiting (the engine's held samples of
        a prompt just computed, so they reach its cached blocks before anything evicts them)."""
        seq.arrival = next(self._arrivals)
        self._queue(seq, front)

    def rank(self, seq: Sequence) -> tuple[int, int]:
        """Where seq stands: earlier runs first, the last is preempted first."""
        return (seq.priority, seq.arrival) if self.order == "priority" else (0, seq.arrival)

    def _queue(self, seq: Sequence, front: bool) -> None:
        """Into the waiting queue: under "fcfs" at the front or the back; under "priority" at its
        rank's place (`front`: ahead of everything of its own priority)."""
        if self.order == "fcfs":
            self.waiting.appendleft(seq) if front else self.waiting.append(seq)
            return
        if front:  # ranked just ahead of the first of its priority, so the queue stays sorted
            same = [s.arrival for s in self.waiting if s.priority == seq.priority]
            seq.arrival = min(same, default=seq.arrival + 1) - 1
        ranks = [self.rank(s) for s in self.waiting]
        self.waiting.insert(bisect.bisect_left(ranks, self.rank(seq)), seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        if self.policy == "budget":
            return self._schedule_budget()
        if self.policy == "static":
            return self._schedule_static()
        batch = self._schedule_prefill()
        if batch.chunks:
            return batch
        return self._schedule_decode()

    def _schedule_budget(self) -> Batch:
        """Decode rows first, one token each; then prompt chunks in what is left of the budget."""
        preemptions = self.num_preemptions
        decoding = [s for s in self.running if not s.needs_prefill]
        batch = self._schedule_decode(decoding, self.max_num_batched_tokens)
        # a step that had to preempt admits nothing new: the pool is short already
        admit = self.num_preemptions == preemptions
        self._slotted = {id(s) for s in batch.decode}  # their slot for this step is taken
        try:
            used = len(batch.decode)
            if batch.speculative:  # and the drafts the decode rows carry
                used += sum(len(s.draft) for s in batch.decode)
            return self._schedule_prefill(self.max_num_batched_tokens - used, batch, admit)
        finally:
            self._slotted = set()

    def _schedule_static(self) -> Batch:
        """Admit a whole batch when the last one has left; then its prompts, then its decodes."""
        if not self.running:
            while self.waiting and len(self.running) < self.max_batch and self._admit_next():
                pass
        batch = self._schedule_prefill(admit=False)
        if batch.chunks:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(
        self, budget: int | None = None, batch: Batch | None = None, admit: bool = True
    ) -> Batch:
        budget = self.max_num_batched_tokens if budget is None else budget
        batch = Batch() if batch is None else batch
        for seq in self.running:  # prompts already admitted whose later chunks are due
            if not seq.needs_prefill:
                continue
            if budget > 0:
                end = min(len(seq.token_ids), seq.num_computed + budget)
                batch.chunks.append((seq, seq.num_computed, end))
                budget -= end - seq.num_computed
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_batch:
            seq = self._admit_next()
            if seq is None:
                break
            end = min(len(seq.token_ids), seq.num_computed + budget)
            batch.chunks.append((seq, seq.num_computed, end))
            budget -= end - seq.num_computed
        return batch

    def _admit_next(self) -> Sequence | None:
        """Move the front of the queue into the running set with its prompt's blocks (what the
        prefix cache holds already counted as computed), or None if it must wait."""
        seq = self.waiting[0]
        if not self.can_admit(seq):
            return None  # admitting it now would make the next decode step preempt someone
        try:
            cached = self.allocator.allocate_prompt(seq.block_table, seq.token_ids, seq.reuse_prefix)
        except NoFreeBlocks:
            return None  # blocks come back as running sequences finish
        self.waiting.popleft()
        self.running.append(seq)
        seq.num_computed = cached
        return seq

    def reserve(self) -> int:
        """Blocks admission leaves free: one per running sequence whose next token needs a new
        block, plus the watermark's share of the pool; 0 when nothing runs."""
        if self.watermark is None or not self.running:
            return 0
        alloc = self.allocator
        # The block each running row needs for the next token it writes. A decoding row not yet
        # scheduled this step writes its newest token next; one already given its slot this step
        # (the budget policy schedules decode rows before it admits) writes the token this step
        # samples, one further on; a row still in prefill will sample one first.
        next_blocks = sum(
            alloc.blocks_needed(s.block_table, len(s.token_ids) + (s.needs_prefill or id(s) in self._slotted))
            for s in self.running
        )
        return next_blocks + int(self.watermark * alloc.num_blocks)

    def can_admit(self, seq: Sequence) -> bool:
        if self.watermark is None:
            return True  # the earlier policy: allocate_prompt alone decides
        need = self.allocator.prompt_blocks_needed(seq.token_ids, extra_tokens=1, use_cache=seq.reuse_prefix)
        return need + self.reserve() <= self.allocator.num_free

    def _schedule_decode(self, seqs: list[Sequence] | None = None, limit: int | None = None) -> Batch:
        """One token for each of seqs (default: every running sequence), oldest first, at most
        `limit` of them; a sequence that needs a block when none is free preempts the newest.

        A row carrying a draft (speculative decoding) needs 1 + len(draft) tokens: the draft gets
        what the budget has left once every row's own token is counted, and is cut, or dropped,
        before anyone is preempted for its blocks."""
        batch = Batch()
        order = sorted(self.running if seqs is None else seqs, key=self.rank)
        spare = None  # budget left for drafts, once each row that can run has its one token
        for seq in order:
            if seq not in self.running:
                continue  # preempted below while making room for an older one
            if limit is not None and len(batch.decode) >= limit:
                break
            if seq.draft:
                if spare is None:
                    rows = len(order) if limit is None else min(limit, len(order))
                    spare = (limit - rows) if limit is not None else 1 << 30
                del seq.draft[max(spare, 0) :]
            while True:
                try:
                    if seq.draft:
                        try:
                            self.allocator.append_slots(seq.block_table, len(seq.token_ids) + len(seq.draft))
                        except NoFreeBlocks:
                            seq.draft.clear()  # a draft is never worth a preemption
                            continue
                        spare -= len(seq.draft)
                        batch.speculative = True
                    else:
                        self.allocator.append_slots(seq.block_table, len(seq.token_ids))
                    batch.decode.append(seq)
                    break
                except NoFreeBlocks:
                    victim = max(self.running, key=self.rank)
                    self.preempt(victim)
                    if victim is seq:
                        break
        return batch

    def preempt(self, seq: Sequence) -> None:
        """Give back seq's blocks; it will be recomputed from all its tokens when readmitted."""
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        self.on_leave(seq)
        seq.draft.clear()
        self.recomputed_tokens += seq.num_computed
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.order == "fcfs":
            self.waiting.appendleft(seq)
        else:  # back to its place: ahead of what came later at its priority, behind higher ones
            self._queue(seq, front=False)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
            self.allocator.free(seq.block_table)
            self.on_leave(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
