"""Day 17: the paged write, where each new token's K and V go (slot mapping), on the CPU.

Two tables, one CSV each:

* `day-17-slots.csv`: the slot mapping of the notebook's worked example, token by token. A tiny
  Llama (block size 4, a pool of 8 blocks) runs two sequences, A with a 3-token prompt and B
  with a 6-token prompt: one prefill step for both, then two decode steps. Each row is one
  token written: the step, the sequence, its position, the block-table entry that position
  falls in (`block`, `offset`) and the slot, `block * block_size + offset`. The slots are
  `plan_prefill`'s and `plan_decode`'s `write_slots`, asserted equal to the arithmetic.
* `day-17-write.csv`: one layer's K/V write at SmolLM2-135M's shape (3 K/V heads, head dim 64,
  fp32), the paged way against the earlier one. Paged: `BatchedPagedKVCache.write`, one
  `index_put_` into the K pool and one into the V pool at the step's slots, wherever the blocks
  lie. Contiguous: Day 11's `ContiguousKVCache.write`, one slice copy per sequence, so a decode
  step of R rows is R writes into R caches. Decode steps of 1 to 64 rows (one token each), and
  a prefill of 16 to 2048 tokens of one sequence. `bytes` is what is written (a fact); the
  times are this machine's, the least of `--reps` runs taken in turn, on one thread by default:
  on a 2-core machine shared with other jobs, a write small enough to take microseconds could
  wait milliseconds at 2 threads for its second thread to be scheduled.

    python days/day17/slotwrite.py                 # -> day-17-slots.csv, day-17-write.csv
    python days/day17/slotwrite.py --reps 500 --out-write /tmp/w.csv
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from nanocourse import tiny_llama, write_csv
from nanoserve.bench import cpu_line
from nanoserve.blocks import BlockAllocator
from nanoserve.cache import BatchedPagedKVCache
from nanoserve.contiguous import ContiguousKVCache
from nanoserve.models import LlamaConfig
from nanoserve.plan import plan_decode, plan_prefill
from nanoserve.sampling import SamplingParams
from nanoserve.scheduler import Sequence

HERE = Path(__file__).resolve().parent
CSV_SLOTS = HERE / "day-17-slots.csv"
CSV_WRITE = HERE / "day-17-write.csv"

# --- the worked example ------------------------------------------------------------------------

BLOCK = 4  # small, so a block boundary is crossed within a few tokens
NUM_BLOCKS = 8
PROMPTS = {"A": 3, "B": 6}  # prompt lengths
STD = 0.3  # the tiny model's weight scale: logits spread over a few units
DECODE_STEPS = 2


def tiny_model():
    return tiny_llama(seed=0, std=STD)


def prompts(seed: int = 0) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randint(1, 256, (n,), generator=g).tolist() for name, n in PROMPTS.items()}


def slot_of(blocks: list[int], pos: int, block_size: int = BLOCK) -> tuple[int, int, int]:
    """(block, offset, slot) of a position, by hand: the table entry pos // block_size, then the
    offset inside that block."""
    block, offset = blocks[pos // block_size], pos % block_size
    return block, offset, block * block_size + offset


def new_sequences(allocator: BlockAllocator, seed: int = 0) -> dict[str, Sequence]:
    """A and B with their prompts' blocks, in that order (A gets block 0, B blocks 1 and 2)."""
    seqs = {}
    for name, ids in prompts(seed).items():
        seq = Sequence(name, ids, SamplingParams(), BLOCK)
        allocator.allocate_prompt(seq.block_table, seq.token_ids)
        seqs[name] = seq
    return seqs


def grow(allocator: BlockAllocator, seq: Sequence, token: int) -> None:
    """Append a generated token and give the table a block if its position needs a new one."""
    seq.token_ids.append(token)
    allocator.append_slots(seq.block_table, len(seq.token_ids))


def example_steps(tokens: dict[str, list[int]], seed: int = 0):
    """The example's three plans, built as the engine builds them; yields (step, plan, seqs).
    `tokens` are each sequence's greedy tokens (from its own clean run), fed back in order."""
    allocator = BlockAllocator(NUM_BLOCKS, BLOCK, enable_prefix_caching=False)
    seqs = new_sequences(allocator, seed)
    yield 0, plan_prefill([(s, 0, len(s.token_ids)) for s in seqs.values()], BLOCK), seqs
    for step in range(1, DECODE_STEPS + 1):
        for name, seq in seqs.items():
            grow(allocator, seq, tokens[name][step - 1])
        yield step, plan_decode(list(seqs.values()), BLOCK), seqs


def slot_rows(tokens: dict[str, list[int]], seed: int = 0) -> list[dict]:
    rows = []
    for step, plan, _ in example_steps(tokens, seed):
        mine = []
        # a decode plan has no chunks: each row writes its newest position
        written = plan.chunks or [(s, len(s.token_ids) - 1, len(s.token_ids)) for s in plan.rows]
        for seq, start, end in written:
            for pos in range(start, end):
                block, offset, slot = slot_of(seq.block_table.blocks, pos)
                mine.append(slot)
                rows.append(
                    {
                        "step": "prefill" if step == 0 else f"decode {step}",
                        "seq": seq.request_id,
                        "position": pos,
                        "table_entry": pos // BLOCK,
                        "block": block,
                        "offset": offset,
                        "slot": slot,
                    }
                )
        assert mine == plan.write_slots.tolist(), "the plan's write_slots disagree with the arithmetic"
    return rows


def clean_run(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """One sequence alone through Day 11's contiguous cache: its greedy tokens and the logits of
    every step (prefill first), the reference a paged run must match."""
    cache = ContiguousKVCache(model.cfg, len(prompt) + steps)
    ids, pos = torch.tensor(prompt), torch.arange(len(prompt))
    tokens, logits = [], []
    for _ in range(steps + 1):
        cache.begin(pos)
        out = model(ids, pos, cache, logits_at=pos[-1:] - pos[0])[0]  # (V,)
        logits.append(out)
        tokens.append(int(out.argmax()))
        ids, pos = torch.tensor([tokens[-1]]), pos[-1:] + 1
    return tokens, torch.stack(logits)  # (steps + 1, V)


# --- the write, timed --------------------------------------------------------------------------

KV_HEADS, HEAD_DIM = 3, 64  # SmolLM2-135M
POOL_BLOCKS, POOL_BLOCK = 1024, 16
DECODE_ROWS = (1, 4, 16, 64)
PREFILL_TOKENS = (16, 128, 512, 2048)


def one_layer() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32, hidden_size=9 * HEAD_DIM, intermediate_size=8, num_layers=1, num_heads=9,
        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=4096,
    )  # fmt: skip


def scattered_slots(tokens_per_seq: list[int], rng: random.Random) -> list[list[int]]:
    """Each sequence's slots for its next tokens, in whole blocks drawn at random from the pool
    (no two sequences share one), starting at a random offset so a block boundary may fall
    inside the write."""
    need = [(n + POOL_BLOCK) // POOL_BLOCK + 1 for n in tokens_per_seq]
    free = rng.sample(range(POOL_BLOCKS), sum(need))
    out, at = [], 0
    for n, k in zip(tokens_per_seq, need):
        blocks, at = free[at : at + k], at + k
        start = rng.randrange(POOL_BLOCK)
        out.append([blocks[p // POOL_BLOCK] * POOL_BLOCK + p % POOL_BLOCK for p in range(start, start + n)])
    return out


def writers(tokens_per_seq: list[int], seed: int = 0):
    """(paged write, contiguous writes) for one layer, over the same K/V rows."""
    cfg, rng = one_layer(), random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    n = sum(tokens_per_seq)
    k, v = torch.randn(2, n, KV_HEADS, HEAD_DIM, generator=g)  # (N, kv, hd) each
    paged = BatchedPagedKVCache(cfg, POOL_BLOCKS * POOL_BLOCK, attention="gather")
    slots = torch.tensor([s for seq in scattered_slots(tokens_per_seq, rng) for s in seq])
    plan = SimpleNamespace(write_slots=slots)
    paged.write(0, k, v, plan)  # allocates the pools once, outside the timing
    caches = []
    for t in tokens_per_seq:
        c = ContiguousKVCache(cfg, 1024 + t)
        c.start = rng.randrange(1024)  # as if a step at a context of `start` tokens
        c.length = c.start + t
        caches.append(c)
    bounds = [0, *torch.tensor(tokens_per_seq).cumsum(0).tolist()]

    def write_paged():
        paged.write(0, k, v, plan)

    def write_contiguous():
        for c, a, b in zip(caches, bounds, bounds[1:]):
            c.write(0, k[a:b], v[a:b])

    return write_paged, write_contiguous, (paged, slots, caches, bounds, k, v)


def check_writes(state) -> None:
    """Both ways hold the same K and V rows afterwards (the paged pool at its slots, each
    contiguous cache at [start, length))."""
    paged, slots, caches, bounds, k, v = state
    assert torch.equal(paged.k[0][slots], k) and torch.equal(paged.v[0][slots], v)
    for c, a, b in zip(caches, bounds, bounds[1:]):
        assert torch.equal(c.k[0][:, c.start : c.length], k[a:b].transpose(0, 1))


def best_of(fns: dict, reps: int) -> dict:
    """The least seconds of each callable over `reps` turns taken in turn: on a shared machine
    the least time is the one other jobs disturbed least."""
    times = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name] = min(times[name], time.perf_counter() - t0)
    return times


def write_row(case: str, tokens_per_seq: list[int], reps: int) -> dict:
    paged, contiguous, state = writers(tokens_per_seq)
    t = best_of({"paged": paged, "contiguous": contiguous}, reps)
    check_writes(state)
    n = sum(tokens_per_seq)
    return {
        "case": case,
        "threads": torch.get_num_threads(),
        "rows": len(tokens_per_seq),
        "tokens": n,
        "bytes": 2 * n * KV_HEADS * HEAD_DIM * 4,
        "paged_us": f"{t['paged'] * 1e6:.1f}",
        "contiguous_us": f"{t['contiguous'] * 1e6:.1f}",
        "contiguous_over_paged": f"{t['contiguous'] / t['paged']:.2f}",
    }


def write_table(decode_rows=DECODE_ROWS, prefill_tokens=PREFILL_TOKENS, reps: int = 300) -> list[dict]:
    rows = [write_row("decode", [1] * r, reps) for r in decode_rows]
    rows += [write_row("prefill", [n], reps) for n in prefill_tokens]
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=300, help="timed runs of each write")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the timed writes")
    p.add_argument("--out-slots", default=str(CSV_SLOTS), help="CSV of the worked example's slots")
    p.add_argument("--out-write", default=str(CSV_WRITE), help="CSV of the write timings")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    model = tiny_model()
    tokens = {name: clean_run(model, ids, DECODE_STEPS)[0] for name, ids in prompts().items()}
    for name, rows, out in (
        ("slots", slot_rows(tokens), args.out_slots),
        ("write", write_table(reps=args.reps), args.out_write),
    ):
        print(name)
        for r in rows:
            print("  ", ", ".join(f"{k}={v}" for k, v in r.items()))
        print(f"wrote {write_csv(rows, out, cpu=name == 'write')}")


if __name__ == "__main__":
    main()
