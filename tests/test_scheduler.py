"""The admission reserve under the default policy.

Under "budget" the decode rows are given their slots before any prompt is admitted, so by the
time `reserve()` runs a row's newest token already has its block. The block it needs is the one
for the token this step samples. The reserve counted the newest token's (0 blocks) and let a
prompt take that block, and the next step preempted the prompt it had just prefilled.
"""

from nanoserve.blocks import BlockAllocator
from nanoserve.sampling import SamplingParams
from nanoserve.scheduler import Scheduler, Sequence
from tests.test_faults import simulate


def full_block_pool(watermark):
    """2 blocks of 4 tokens. `a` (3 prompt tokens) has sampled one token: it fills its block, so
    the token it samples in the next step needs the second block; `b` (3 tokens) arrives."""
    alloc = BlockAllocator(2, 4, enable_prefix_caching=False)
    sched = Scheduler(alloc, max_batch=4, max_num_batched_tokens=64, watermark=watermark, policy="budget")
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=4), 4)
    a.max_tokens = 4
    sched.add(a)
    simulate(sched, 1)  # a's prefill, one token sampled: 4 tokens, one full block
    b = Sequence("b", [7, 8, 9], SamplingParams(max_tokens=2), 4)
    b.max_tokens = 2
    sched.add(b)
    return sched, a, b


def test_the_reserve_counts_the_block_after_this_steps_slot_under_budget():
    sched, a, b = full_block_pool(watermark=0.0)  # the reserve alone, no watermark share
    assert len(a.token_ids) == 4 and sched.allocator.num_free == 1
    first = sched.schedule()
    assert first.decode == [a] and not first.chunks, "b was admitted into the block a needs next"
    simulate(sched, 20)
    assert sched.num_preemptions == 0 and a.finished and b.finished
    assert sched.allocator.num_used == 0


def test_without_the_reserve_this_pool_preempts():
    """The same pool with no reserve: b takes a's next block and is preempted a step later, so the
    pool above is one where the count matters."""
    sched, a, b = full_block_pool(watermark=None)
    simulate(sched, 20)
    assert b.num_preemptions == 1 and a.finished and b.finished
