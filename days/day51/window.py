"""Day 51: the slot window gathered from block tables each step, against a window read on the slot table.

For every (rows, width): rows sequences of `width` tokens each own width / block_size random
blocks of one pool. Two ways to hand a decode step its (rows, width) slot window:

* gather: `nanoserve.plan.slot_window(block_lists, block_size)`, what `plan_decode` does every
  step: a Python list of block ids per row -> a new (rows, width) int64 tensor. One copy, new
  storage each step.
* read: `SlotTable.read(rows, width)`, what `with_table` hands a decode plan: a slice of the
  [max_batch, max_model_len] table the rows were written into as they grew. No copy; the same
  storage every step. What the table costs instead is one entry written per row per step
  (`SlotTable.extend`) and one row copied when a middle row leaves (`release`).

The two windows must hold the same numbers. The CSV's deterministic columns are the sizes and
the copies; the `*_us` columns are medians of `--repeats` timed calls on this machine (left out
of the journal's checked columns). Also timed: the whole `plan_decode` against the whole
`plan_decode_bucketed` with `PersistentInputs` (the planner of days 52 and 53, timed ahead).

    python days/day51/window.py                                   # writes day-51-window.csv
    python days/day51/window.py --rows 1 8 64 256 --widths 512 8192 --repeats 50 --out /tmp/w.csv
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from pathlib import Path

import torch

from nanocourse import engine_config, tiny_config, tiny_llama, write_csv
from nanoserve.buckets import row_buckets, width_buckets
from nanoserve.engine import Engine
from nanoserve.inputs import PersistentInputs
from nanoserve.plan import (
    check_mapping_is_window,
    check_plan_addressing,
    check_window_intact,
    plan_decode,
    plan_decode_bucketed,
    slot_window,
)
from nanoserve.sampling import SamplingParams
from nanoserve.scheduler import Sequence
from nanoserve.slots import SlotTable

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-51-window.csv"
BLOCK_SIZE = 16
ROWS = (1, 4, 16, 64)
WIDTHS = (128, 512, 2048)
REPEATS = 30


def median_us(fn, repeats: int) -> float:
    fn()  # warm: first-call allocations are not what a running server pays
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def make_rows(rows: int, width: int, block_size: int = BLOCK_SIZE, seed: int = 0, room: int = 0):
    """rows sequences of `width` tokens over distinct random blocks of one pool, and the slot
    table holding them (with `room` spare columns to extend into). Returns (seqs, table)."""
    rng = random.Random(seed)
    per_row = width // block_size
    num_blocks = rows * per_row * 2  # a pool half full, so block ids are scattered
    blocks = rng.sample(range(num_blocks), rows * per_row)
    sink = num_blocks * block_size
    table = SlotTable(max_batch=rows, max_model_len=width + room, sink_slot=sink)
    seqs = []
    for r in range(rows):
        seq = Sequence(f"seq-{r}", [1] * width, SamplingParams(max_tokens=1), block_size)
        seq.block_table.blocks = blocks[r * per_row : (r + 1) * per_row]
        table.assign(seq, seq.block_table.slots(0, width))
        seqs.append(seq)
    return seqs, table


def window_cost(rows: int, width: int, repeats: int = REPEATS, block_size: int = BLOCK_SIZE) -> dict:
    seqs, table = make_rows(rows, width, block_size, room=repeats + 1)
    block_lists = [s.block_table.blocks for s in seqs]
    live = tuple(range(rows))
    gathered = slot_window(block_lists, block_size, "cpu")
    window = table.read(live, width)
    assert torch.equal(gathered, window), "the gathered window and the table's window disagree"
    buckets = (row_buckets(rows), width_buckets(width, block_size))
    inputs = PersistentInputs(rows, table.sink_slot)
    bucketed = plan_decode_bucketed(seqs, table, buckets, inputs)
    plain = plan_decode(seqs, block_size)
    assert torch.equal(bucketed.slot_window, plain.slot_window)
    nbytes = window.numel() * window.element_size()
    return {
        "rows": rows,
        "width": width,
        "window_bytes": nbytes,
        "gather_copies": 1,
        "gather_new_bytes": gathered.numel() * gathered.element_size(),
        "read_copies": 0 if window.data_ptr() == table.address else 1,
        "read_new_bytes": 0
        if window.untyped_storage().data_ptr() == table.table.untyped_storage().data_ptr()
        else nbytes,
        "table_writes_per_step": rows,  # one slot per row appended by SlotTable.extend
        "same_numbers": "yes",
        "gather_us": round(median_us(lambda: slot_window(block_lists, block_size, "cpu"), repeats), 1),
        "read_us": round(median_us(lambda: table.read(live, width), repeats), 1),
        # what the table costs instead: each row's newest slot written once per step (SlotTable.sync)
        "extend_us": round(median_us(lambda: [table.extend(s, [table.sink_slot]) for s in seqs], repeats), 1),
        "plan_decode_us": round(median_us(lambda: plan_decode(seqs, block_size), repeats), 1),
        "plan_bucketed_us": round(
            median_us(lambda: plan_decode_bucketed(seqs, table, buckets, inputs), repeats), 1
        ),
    }


def window_table(rows=ROWS, widths=WIDTHS, repeats: int = REPEATS) -> list[dict]:
    return [window_cost(r, w, repeats) for r in rows for w in widths]


# --- the table inside a running engine -----------------------------------------------------------

TINY = tiny_config(max_position_embeddings=128)


def tiny_engine(seed: int = 0) -> Engine:
    """A random-weight Llama behind the engine as of day 51: 4 rows, blocks of 4, a 64-token
    context; its decode plans come from `plan_decode` until `with_table` gives it a slot table."""
    model = tiny_llama(seed, 0.3, TINY.max_position_embeddings)
    per_block = TINY.kv_bytes_per_token(torch.float32) * 4
    cfg = engine_config(51, max_batch=4, block_size=4, max_model_len=64, kv_budget=per_block * 64)
    return Engine(model, None, cfg)


def with_table(eng: Engine) -> SlotTable:
    """Keep a slot table beside `eng` and read each decode plan's window from it: the batch is
    synced into the table, `plan_decode` plans it in row order, and its gathered window is
    replaced by `table.read(...)` of the same width, a view on the table."""
    table = SlotTable(eng.config.max_batch, eng.max_model_len, eng.pool.sink_slot)
    plan_fn = eng.runner.plan

    def plan(batch):
        if not batch.is_decode:
            return plan_fn(batch)
        seqs = table.sync(batch.decode)
        p = plan_decode(seqs, eng.config.block_size)
        return dataclasses.replace(p, slot_window=table.read(tuple(range(len(seqs))), p.slot_window.shape[1]))

    eng.runner.plan = plan
    return table


def requests(n: int = 8, seed: int = 5) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(TINY.vocab_size) for _ in range(rng.randint(3, 12))], rng.randint(4, 16))
        for _ in range(n)
    ]


def gated_run(eng: Engine, reqs, stagger: int = 2, table: bool = True) -> dict:
    """Run `reqs` (one joining every `stagger` steps); with `table`, every decode window is read
    from a slot table (`with_table`), the three window gates run on every decode plan and every
    row a release moves is logged. Returns the tokens, the number of plans checked, the moves
    (key, from row, to row) and each decode step's live rows and window shape."""
    runner, table = eng.runner, with_table(eng) if table else None
    out = {"checked": 0, "moves": [], "live": [], "shapes": []}
    plan_fn, release = runner.plan, table.release if table is not None else None

    def plan(batch):
        p = plan_fn(batch)
        if p.is_decode and table is not None:
            check_mapping_is_window(p, table)
            check_window_intact(p)
            check_plan_addressing(p)
            out["checked"] += 1
            out["live"].append(table.num_live)
            out["shapes"].append(tuple(p.slot_window.shape))
        return p

    def logged_release(key):
        moved = release(key)
        if moved is not None:
            out["moves"].append((moved[0].request_id, moved[1], moved[2]))
        return moved

    runner.plan = plan
    if table is not None:
        table.release = logged_release
    tokens, pending, ids, steps = {}, list(enumerate(reqs)), {}, 0
    while pending or eng.has_unfinished():
        if pending and steps % stagger == 0:
            (i, (prompt, n)), pending = pending[0], pending[1:]
            ids[eng.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))] = i
        for o in eng.step():
            tokens.setdefault(ids[o.request_id], []).extend(o.new_token_ids)
        steps += 1
    out["tokens"] = [tokens[i] for i in range(len(reqs))]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="sequences in the batch")
    p.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS), help="window widths (tokens)")
    p.add_argument("--repeats", type=int, default=REPEATS, help="timed calls per cell (median)")
    p.add_argument("--out", default=str(CSV), help="CSV to write")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = window_table(args.rows, args.widths, args.repeats)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out, cpu=True)}")
    big = rows[-1]
    print(
        f"window rows={big['rows']} width={big['width']} bytes={big['window_bytes']} "
        f"gather_us={big['gather_us']} read_us={big['read_us']}"
    )


if __name__ == "__main__":
    main()
