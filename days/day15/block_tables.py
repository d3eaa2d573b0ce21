"""Day 15: block tables, from a sequence's token positions to slots in the shared K/V pool.

A sequence's K/V lives in whole blocks of `block_size` slots wherever the allocator found them;
its `BlockTable` lists them in position order, and position p lives in slot

    slot = blocks[p // block_size] * block_size + p % block_size

Four tables, all but the last deterministic:

* `day-15-tables.csv`: four sequences sharing a pool of 12 blocks of 4 slots, allocated in an
  interleaved order (arrivals, decode steps taking turns, one sequence finishing in between),
  so no table's blocks are contiguous or even in order. Per sequence: its tokens, its blocks,
  and the slot of every position.
* `day-15-mapping.csv`: the slot mapping of the next step for those sequences, from
  `nanoserve.plan`: a decode plan for the three running sequences (one token each) and a
  prefill plan for the one that just arrived, position by position with block, offset, slot.
* `day-15-formulas.csv`: the right formula against three wrong ones over every live position:
  how many slots two different positions share, and how many positions land outside their
  sequence's own blocks.
* `day-15-window.csv`: a step's slot window (rows x width) built two ways, position by position
  with `BlockTable.slots`, and block by block with `plan.slot_window`'s broadcast, the latter
  also with torch kept to one thread; best of `--repeats`, milliseconds (this machine's).

    python days/day15/block_tables.py                     # -> the four CSVs next to this file
    python days/day15/block_tables.py --rows 16 64 256 1024 --widths 512 4096 --out-window /tmp/w.csv
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch

from nanocourse import write_csv
from nanoserve.bench import cpu_line
from nanoserve.blocks import BlockAllocator, BlockTable
from nanoserve.plan import plan_decode, plan_prefill, slot_window
from nanoserve.sampling import SamplingParams
from nanoserve.scheduler import Sequence

HERE = Path(__file__).resolve().parent
CSV_TABLES = HERE / "day-15-tables.csv"
CSV_MAPPING = HERE / "day-15-mapping.csv"
CSV_FORMULAS = HERE / "day-15-formulas.csv"
CSV_WINDOW = HERE / "day-15-window.csv"
NUM_BLOCKS, BLOCK = 12, 4
ROWS, WIDTHS, REPEATS = (16, 64, 256), (256, 2048), 5


def slot_by_hand(blocks: list[int], pos: int, block_size: int | None = None) -> int:
    """The block holding position pos, times the block size, plus pos's offset inside it
    (block_size None: the module's BLOCK)."""
    bs = block_size or BLOCK
    return blocks[pos // bs] * bs + pos % bs


# the right formula and three wrong ones, each (blocks, pos, block_size) -> slot
FORMULAS = {
    "block * block_size + offset": slot_by_hand,
    "offset * block_size + block": lambda t, p, bs: (p % bs) * bs + t[p // bs],
    "block + offset": lambda t, p, bs: t[p // bs] + p % bs,
    "position (no table)": lambda t, p, bs: p,
}


# --- the pool: four sequences, interleaved --------------------------------------------------


def build_pool():
    """(allocator, running sequences by name, the one that just arrived, a log of every step).

    A (6 tokens), B (3), D (8) and C (5) arrive in that order; all four decode three tokens
    taking turns; D finishes; A, B and C decode four more; E (6 tokens) arrives into D's old
    blocks. Every decode step grows its table first (`append_slots`), as the scheduler does.
    """
    alloc = BlockAllocator(NUM_BLOCKS, BLOCK, enable_prefix_caching=False)
    seqs: dict[str, Sequence] = {}
    log = []

    def arrive(name, n, first_id):
        s = Sequence(name, [first_id + i for i in range(n)], SamplingParams(), BLOCK)
        alloc.allocate_prompt(s.block_table, s.token_ids)
        seqs[name] = s
        log.append(f"{name} arrives, {n} tokens: blocks {s.block_table.blocks}")

    def decode(names):
        for name in names:
            s = seqs[name]
            s.token_ids.append(7000 + len(s.token_ids))  # a generated token; its value does not matter
            before = list(s.block_table.blocks)
            alloc.append_slots(s.block_table, len(s.token_ids))
            if s.block_table.blocks != before:
                log.append(f"{name} grows to {len(s.token_ids)} tokens: new block {s.block_table.blocks[-1]}")

    arrive("A", 6, 100)
    arrive("B", 3, 200)
    arrive("D", 8, 400)
    arrive("C", 5, 300)
    for _ in range(3):
        decode(["A", "B", "C", "D"])
    alloc.free(seqs.pop("D").block_table)
    log.append("D finishes")
    for _ in range(4):
        decode(["A", "B", "C"])
    running = dict(seqs)
    arrive("E", 6, 500)
    return alloc, running, seqs["E"], log


def tables_rows(seqs: dict[str, Sequence]) -> list[dict]:
    rows = []
    for name, s in seqs.items():
        t = s.block_table
        rows.append(
            {
                "seq": name,
                "tokens": len(s.token_ids),
                "blocks": " ".join(map(str, t.blocks)),
                "capacity": t.capacity,
                "slots": " ".join(map(str, t.slots(0, len(s.token_ids)))),
            }
        )
    return rows


def step_plans(running: dict[str, Sequence], arrived: Sequence):
    """The next step's addressing: decode rows for the running sequences, a prefill chunk for
    the new one (two plans, as a prefill-first step would run them)."""
    return plan_decode(list(running.values()), BLOCK), plan_prefill(
        [(arrived, 0, len(arrived.token_ids))], BLOCK
    )


def mapping_rows(decode, prefill) -> list[dict]:
    rows = []
    for kind, plan in (("decode", decode), ("prefill", prefill)):
        for i, (pos, slot) in enumerate(zip(plan.positions.tolist(), plan.write_slots.tolist())):
            r = next(r for r, (start, end, _) in enumerate(plan.row_spans) if start <= i < end)
            seq = plan.rows[r]
            table = seq.block_table
            rows.append(
                {
                    "plan": kind,
                    "row": r,
                    "seq": seq.request_id,
                    "position": pos,
                    "table_index": pos // BLOCK,
                    "block": table.blocks[pos // BLOCK],
                    "offset": pos % BLOCK,
                    "slot": slot,
                    "context_len": plan.context_lens[r].item(),
                }
            )
    return rows


# --- wrong formulas -----------------------------------------------------------------------------


def placements(seqs: dict[str, Sequence], formula) -> dict[int, list[tuple[str, int]]]:
    """slot -> every (sequence, position) the formula puts there."""
    where = defaultdict(list)
    for name, s in seqs.items():
        for pos in range(len(s.token_ids)):
            where[formula(s.block_table.blocks, pos, BLOCK)].append((name, pos))
    return where


def check_slots(seqs: dict[str, Sequence], formula) -> None:
    """Every live position has a slot of its own, inside one of its own sequence's blocks."""
    for slot, who in sorted(placements(seqs, formula).items()):
        if len(who) > 1:
            raise AssertionError(f"slot {slot} is given to {len(who)} positions: {who}")
        name, pos = who[0]
        if slot // BLOCK not in seqs[name].block_table.blocks:
            raise AssertionError(
                f"{name} position {pos} maps to slot {slot}, in block {slot // BLOCK}, not its own"
            )


def formula_rows(seqs: dict[str, Sequence]) -> list[dict]:
    rows = []
    for name, formula in FORMULAS.items():
        where = placements(seqs, formula)
        shared = {slot: who for slot, who in where.items() if len(who) > 1}
        across = {slot: who for slot, who in shared.items() if len({n for n, _ in who}) > 1}
        foreign = sum(
            slot // BLOCK not in seqs[n].block_table.blocks for slot, who in where.items() for n, _ in who
        )
        first = min(across.items()) if across else None
        rows.append(
            {
                "formula": name,
                "positions": sum(len(w) for w in where.values()),
                "distinct_slots": len(where),
                "shared_slots": len(shared),
                "shared_across_sequences": len(across),
                "outside_own_blocks": foreign,
                "first_collision": f"slot {first[0]}: " + ", ".join(f"{n}@{p}" for n, p in first[1])
                if first
                else "-",
            }
        )
    return rows


# --- a step's slot window: position by position against block by block -------------------------


def _best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 3)


def window_times(rows=ROWS, widths=WIDTHS, repeats: int = REPEATS, block_size: int = 16) -> list[dict]:
    """Build the (rows, width) slot window of a decode step whose every row holds `width` tokens,
    in blocks handed out by a real allocator (interleaved: rows grow a block at a time, taking
    turns), both ways, and check they agree."""
    out = []
    for width in widths:
        for n in rows:
            alloc = BlockAllocator(n * width // block_size, block_size, enable_prefix_caching=False)
            tables = [BlockTable(block_size) for _ in range(n)]
            for filled in range(block_size, width + 1, block_size):
                for t in tables:
                    alloc.append_slots(t, filled)
            by_position = lambda ts=tables, w=width: torch.tensor([t.slots(0, w) for t in ts])  # noqa: E731
            by_block = lambda ts=tables: slot_window([t.blocks for t in ts], block_size, "cpu")  # noqa: E731
            assert torch.equal(by_position(), by_block())
            row = {"rows": n, "width": width, "slots": n * width, "threads": torch.get_num_threads()}
            row["by_position_ms"] = _best_ms(by_position, repeats)
            row["by_block_ms"] = _best_ms(by_block, repeats)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # the broadcast again, with torch kept to one thread
            row["by_block_1_thread_ms"] = _best_ms(by_block, repeats)
            torch.set_num_threads(threads)
            row["ratio"] = round(row["by_position_ms"] / row["by_block_ms"], 1)
            out.append(row)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--out-tables", default=str(CSV_TABLES))
    p.add_argument("--out-mapping", default=str(CSV_MAPPING))
    p.add_argument("--out-formulas", default=str(CSV_FORMULAS))
    p.add_argument("--out-window", default=str(CSV_WINDOW))
    args = p.parse_args(argv)
    print(cpu_line())
    alloc, running, arrived, log = build_pool()
    print("\n".join(log))
    everyone = running | {arrived.request_id: arrived}
    decode, prefill = step_plans(running, arrived)
    for rows, out in (
        (tables_rows(everyone), args.out_tables),
        (mapping_rows(decode, prefill), args.out_mapping),
        (formula_rows(everyone), args.out_formulas),
        (window_times(args.rows, args.widths, args.repeats), args.out_window),
    ):
        for r in rows:
            print(", ".join(f"{k}={v}" for k, v in r.items()))
        print(f"wrote {write_csv(rows, out, cpu=out == args.out_window)}")


if __name__ == "__main__":
    main()
