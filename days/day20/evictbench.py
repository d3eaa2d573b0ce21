"""Day 20: which freed blocks a pool gives away first, and what that does to prefix hits.

A finished sequence's blocks go back to the free list with their K/V and their names intact;
a later prompt with the same prefix claims them back, until the block is handed out fresh to
someone else (an eviction). The package's allocator (`nanoserve.blocks.BlockAllocator`) frees
a table tail first and hands out fresh blocks from the front of the free list, least recently
freed first, so the head of a prefix that was used a moment ago is the last thing evicted.

The workload: the tiny random-weight Llama (`nanocourse.tiny_llama`), 4-token blocks, 40
requests, each one of four shared 24-token prefixes (six blocks, the first more popular than
the last) plus a few tokens of its own, arriving one every two engine steps, 6 greedy tokens
each. It runs at several pool sizes under three allocators:

* `lrf`: the package's, least recently freed first;
* `mrf`: a variant that hands out the most recently freed block first (a stack, not a queue);
* `off`: prefix caching off, the engine through Day 18.

Two rows run at once (`max_batch=2`), so even the smallest pool holds both running sequences
and what the pool size squeezes is the room left for freed blocks. Per run the table counts
prompt tokens taken from the cache when each request is first admitted (`cached_tokens`, and
in blocks `reused_blocks`), the blocks a roomy pool of the same allocator reused but this one
had to compute again (`recomputed_blocks`), prompt tokens computed over every admission
(`computed_tokens`, preempted sequences recompute theirs), blocks evicted (a named free block
handed out fresh), preemptions and steps. Every run's tokens are asserted equal to the roomiest
`lrf` run's. All counts, no times.

    python days/day20/evictbench.py                    # -> day-20-pressure.csv
    python days/day20/evictbench.py --pools 16 32 --requests 20 --out /tmp/p.csv
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from nanocourse import engine_config, tiny_llama, write_csv
from nanoserve.blocks import BlockAllocator
from nanoserve.engine import Engine
from nanoserve.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
CSV_PRESSURE = HERE / "day-20-pressure.csv"
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
POOLS = (16, 20, 24, 28, 32, 40, 48, 64, 96)
VARIANTS = ("lrf", "mrf", "off")


class CountingAllocator(BlockAllocator):
    """The package's allocator, counting cache hits, prompt tokens computed and evictions.
    A preempted sequence is admitted again with the same table; hits count first admissions
    only, the tokens computed count every admission."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompt_tokens = self.cached_tokens = self.computed_tokens = self.evictions = 0

    def allocate_prompt(self, table, token_ids, use_cache=True):
        cached = super().allocate_prompt(table, token_ids, use_cache)
        if not getattr(table, "counted", False):  # a sequence keeps its table when preempted
            table.counted = True
            self.prompt_tokens += len(token_ids)
            self.cached_tokens += cached
        self.computed_tokens += len(token_ids) - cached
        return cached

    def next_fresh(self) -> int:
        """The block the next fresh allocation takes: the front of the free list."""
        return next(iter(self._free))

    def _take_fresh(self) -> int:
        block = self.next_fresh()
        self.evictions += block in self._hash_of  # a named block: its prefix is lost
        self._free.move_to_end(block, last=False)  # the package's _take_fresh takes the front
        return super()._take_fresh()


class MostRecentlyFreedFirst(CountingAllocator):
    """The variant: fresh blocks come from the end of the free list, the block freed last."""

    def next_fresh(self) -> int:
        return next(reversed(self._free))


def make_allocator(variant: str, num_blocks: int, block_size: int = BLOCK_SIZE) -> CountingAllocator:
    if variant not in VARIANTS:
        raise ValueError(f"variant is one of {', '.join(VARIANTS)}, not {variant!r}")
    cls = MostRecentlyFreedFirst if variant == "mrf" else CountingAllocator
    return cls(num_blocks, block_size, enable_prefix_caching=variant != "off")


def engine(model, num_blocks: int, variant: str = "lrf", block_size: int = BLOCK_SIZE, **kw) -> Engine:
    """An engine over `num_blocks` blocks whose allocator is `variant`'s."""
    per_block = model.cfg.kv_bytes_per_token(torch.float32) * block_size
    config = engine_config(
        20,
        block_size=block_size,
        max_model_len=MAX_MODEL_LEN,
        kv_budget=num_blocks * per_block + per_block // block_size,  # the blocks and the sink slot
        max_batch=2,
        max_num_batched_tokens=64,
        **kw,
    )
    eng = Engine(model, None, config)
    assert eng.pool.num_blocks == num_blocks
    eng.allocator = eng.scheduler.allocator = make_allocator(variant, num_blocks, block_size)
    return eng


def workload(n: int = 40, seed: int = 0, vocab: int = 256) -> list[tuple[list[int], int]]:
    """n (prompt, max_tokens): one of four 24-token prefixes, weighted 4:3:2:1, then 2-8 tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(24)] for _ in range(4)]
    reqs = []
    for _ in range(n):
        prefix = rng.choices(prefixes, weights=(4, 3, 2, 1))[0]
        reqs.append((prefix + [rng.randrange(vocab) for _ in range(rng.randint(2, 8))], 6))
    return reqs


def run(eng: Engine, reqs, stagger: int = 2) -> tuple[list[list[int]], int]:
    """Add one request every `stagger` steps, run to the end: tokens by request, and steps."""
    out, pending, ids, steps = {}, list(enumerate(reqs)), {}, 0
    while pending or eng.has_unfinished():
        if pending and steps % stagger == 0:
            i, (prompt, n) = pending.pop(0)
            ids[eng.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))] = i
        for o in eng.step():
            out.setdefault(ids[o.request_id], []).extend(o.new_token_ids)
        steps += 1
    assert eng.allocator.num_free == eng.allocator.num_blocks
    return [out[i] for i in range(len(reqs))], steps


def pressure_rows(model, pools=POOLS, variants=VARIANTS, n: int = 40, seed: int = 0) -> list[dict]:
    reqs = workload(n, seed, model.cfg.vocab_size)
    roomy = max(pools)
    results = {}
    for variant in variants:
        for blocks in sorted(pools, reverse=True):
            eng = engine(model, blocks, variant)
            tokens, steps = run(eng, reqs)
            results[variant, blocks] = (eng, tokens, steps)
    reference = results.get(("lrf", roomy), next(iter(results.values())))[1]
    rows = []
    for (variant, blocks), (eng, tokens, steps) in results.items():
        if tokens != reference:
            raise AssertionError(f"{variant} over {blocks} blocks gave other tokens than lrf over {roomy}")
        alloc = eng.allocator
        roomy_cached = results[variant, roomy][0].allocator.cached_tokens
        rows.append(
            {
                "variant": variant,
                "pool_blocks": blocks,
                "requests": n,
                "prompt_tokens": alloc.prompt_tokens,
                "cached_tokens": alloc.cached_tokens,
                "reused_blocks": alloc.cached_tokens // BLOCK_SIZE,
                "recomputed_blocks": (roomy_cached - alloc.cached_tokens) // BLOCK_SIZE,
                "computed_tokens": alloc.computed_tokens,
                "evictions": alloc.evictions,
                "preemptions": eng.scheduler.num_preemptions,
                "steps": steps,
                "hit_rate": round(alloc.cached_tokens / alloc.prompt_tokens, 3),
            }
        )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pools", type=int, nargs="+", default=list(POOLS), help="pool sizes in blocks")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(CSV_PRESSURE))
    args = p.parse_args(argv)
    rows = pressure_rows(tiny_llama(0), args.pools, VARIANTS, args.requests, args.seed)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out)}")


if __name__ == "__main__":
    main()
