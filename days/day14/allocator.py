"""Day 14: the block allocator's free list and reference counts, driven by hand and timed.

Two tables:

* `day-14-ops.csv`: a `BlockAllocator` of 10 blocks of 4 tokens, its prefix cache off (prefix
  sharing is Day 19's), driven through a fixed story (sequences arrive, grow, are refused,
  finish), with the state after every operation: the table's blocks, the free and used counts,
  every block's reference count, and the free list in the order it hands blocks out.
  Deterministic.
* `day-14-freelist.csv`: why the free list is an insertion-ordered dict and not a Python list.
  The allocator does three things to its free list: takes the block at the front (a fresh
  allocation), appends a freed block at the end, and takes a block out of the middle (from Day
  19 on, a cached prefix claimed back while it sits free). A list does the third by searching
  for the block; an ordered dict finds it by hashing. Timed for both at several pool sizes, best
  of `--repeats`; the block counts are facts, the microseconds this machine's (with its `cpu`).

    python days/day14/allocator.py                     # -> day-14-ops.csv, day-14-freelist.csv
    python days/day14/allocator.py --sizes 1000 100000 1000000 --out-freelist /tmp/f.csv
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict
from pathlib import Path

from nanocourse import write_csv
from nanoserve.bench import cpu_line
from nanoserve.blocks import BlockAllocator, BlockTable, NoFreeBlocks

HERE = Path(__file__).resolve().parent
CSV_OPS = HERE / "day-14-ops.csv"
CSV_FREELIST = HERE / "day-14-freelist.csv"
NUM_BLOCKS, BLOCK = 10, 4
SIZES = (1_000, 10_000, 100_000)
REPEATS = 5

# the story's prompts: only their lengths matter to the allocator today (no prefix cache)
PROMPTS = {
    "a": list(range(100, 110)),  # 10 tokens: 2 full blocks and 2 tokens
    "b": list(range(200, 206)),
    "c": list(range(300, 311)),
    "d": list(range(400, 420)),
    "e": list(range(500, 510)),
}


def free_list(alloc: BlockAllocator) -> list[int]:
    """The free blocks in the order the allocator hands them out (front first)."""
    return list(alloc._free)


def state(alloc: BlockAllocator) -> dict:
    return {
        "num_free": alloc.num_free,
        "num_used": alloc.num_used,
        "refs": " ".join(str(alloc.ref_count(b)) for b in range(alloc.num_blocks)),
        "free_list": " ".join(map(str, free_list(alloc))) or "-",
    }


def story() -> list[tuple[str, str, str]]:
    """(what happens, operation, sequence) in order; the operation names the allocator call."""
    return [
        ("a arrives, 10 tokens", "allocate_prompt", "a"),
        ("b arrives, 6 tokens", "allocate_prompt", "b"),
        ("c arrives, 11 tokens", "allocate_prompt", "c"),
        ("b grows to 9 tokens", "append_slots 9", "b"),
        ("a finishes", "free", "a"),
        ("d arrives, 20 tokens", "allocate_prompt", "d"),
        ("c finishes", "free", "c"),
        ("d arrives again", "allocate_prompt", "d"),
        ("b finishes", "free", "b"),
        ("e arrives, 10 tokens", "allocate_prompt", "e"),
        ("d finishes", "free", "d"),
        ("e finishes", "free", "e"),
    ]


def hand_ops(alloc: BlockAllocator | None = None, check=None) -> list[dict]:
    """Run `story()` on alloc (a fresh 10 x 4 allocator, prefix cache off, by default) and
    record the state after every step. `check(alloc, live)`, live the tables that hold blocks by
    name, runs after every step when given."""
    alloc = alloc or BlockAllocator(NUM_BLOCKS, BLOCK, enable_prefix_caching=False)
    tables: dict[str, BlockTable] = {}
    rows = []
    for i, (what, op, name) in enumerate(story(), 1):
        table = tables.setdefault(name, BlockTable(alloc.block_size))
        try:
            if op == "allocate_prompt":
                alloc.allocate_prompt(table, PROMPTS[name])
            elif op.startswith("append_slots"):
                alloc.append_slots(table, int(op.split()[1]))
            elif op == "free":
                alloc.free(table)
            result = " ".join(map(str, table.blocks)) or "-"
        except NoFreeBlocks as e:
            result = f"refused: {e}"
        if check is not None:
            check(alloc, {n: t for n, t in tables.items() if t.blocks})
        rows.append({"step": i, "what": what, "op": op, "blocks": result} | state(alloc))
    return rows


# --- the free list: a list against an ordered dict ---------------------------------------------


def _operations(kind: str, n: int, ops: int) -> dict:
    """name -> (build a free list of n blocks, run `ops` operations of that kind on it)."""
    middle = range(n // 2, n // 2 + ops)  # blocks near the middle, as a claimed cached prefix is
    if kind == "list":
        return {
            "take_front": (lambda: list(range(n)), lambda fl: [fl.pop(0) for _ in range(ops)]),
            "append": (lambda: list(range(n - ops)), lambda fl: [fl.append(n + b) for b in range(ops)]),
            "take_middle": (lambda: list(range(n)), lambda fl: [fl.remove(b) for b in middle]),
        }
    return {
        "take_front": (
            lambda: OrderedDict.fromkeys(range(n)),
            lambda fl: [fl.popitem(False) for _ in range(ops)],
        ),
        "append": (
            lambda: OrderedDict.fromkeys(range(n - ops)),
            lambda fl: [fl.setdefault(n + b) for b in range(ops)],
        ),
        "take_middle": (lambda: OrderedDict.fromkeys(range(n)), lambda fl: [fl.pop(b) for b in middle]),
    }


def _per_op_us(build, run, repeats: int, ops: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        free_list = build()
        t0 = time.perf_counter()
        run(free_list)
        best = min(best, time.perf_counter() - t0)
    return round(best / ops * 1e6, 3)


def freelist_times(sizes=SIZES, repeats: int = REPEATS, ops: int = 200) -> list[dict]:
    """Per operation, in microseconds: take the front, append at the end, and take out a block
    near the middle, on a free list of n blocks, as a list and as an OrderedDict (the
    allocator's). Each measurement runs `ops` operations on a fresh free list and keeps the
    best of `repeats`."""
    rows = []
    for n in sizes:
        for kind in ("list", "OrderedDict"):
            row = {"blocks": n, "free_list": kind}
            for name, (build, run) in _operations(kind, n, ops).items():
                row[f"{name}_us"] = _per_op_us(build, run, repeats, ops)
            rows.append(row | {"cpu": cpu_line()})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="free-list lengths to time")
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--out-ops", default=str(CSV_OPS))
    p.add_argument("--out-freelist", default=str(CSV_FREELIST))
    args = p.parse_args(argv)
    print(cpu_line())
    ops = hand_ops()
    for r in ops:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(ops, args.out_ops)}")
    times = freelist_times(args.sizes, args.repeats)
    for r in times:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(times, args.out_freelist)}")


if __name__ == "__main__":
    main()
