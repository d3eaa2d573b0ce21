"""Day 52: what bucketing costs in padding, against how many shapes it leaves to capture.

A bucketed decode step is presented as (rows, width) from a closed set (`nanoserve.buckets`):
rows round up to a power of two (or, for comparison, to 1, 2, 4 and then every multiple of 8,
or to every integer: no row padding), the
width (the longest context in the batch) rounds up to a multiple of `width_multiple`
(`width_multiple` 1 is no width padding). For a seeded, deterministic stream of decode batches
this prices the waste against the bucket rectangle the step actually computes:

    row_waste    padded rows / bucket rows        (each padded row is a whole forward of nothing)
    width_waste  width cells past the batch's longest context, over the real rows' bucket cells
    cell_waste   1 - (real rows x longest context) / (bucket rows x bucket width): everything
                 bucketing adds to the rectangle an unbucketed step would gather

and the shapes each granularity leaves, len(row set) x len(width set): what a capture list has
to record. Two regimes of batches, both on a 256-row, 8192-token engine:

    busy   batch size uniform on 1..256; a row's context is a prompt (uniform 16..1024) plus
           what it has generated (uniform 0..1024)
    light  batch size uniform on 1..16; prompt uniform 16..256 plus generated uniform 0..256

    python days/day52/padwaste.py                     # -> day-52-padwaste.csv, day-52-rowwaste.csv
    python days/day52/padwaste.py --steps 5000 --seed 1 --out-dir /tmp
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from nanocourse import write_csv
from nanoserve.buckets import bucket_up, row_buckets, width_buckets

HERE = Path(__file__).resolve().parent
MAX_BATCH, MAX_MODEL_LEN, STEPS, SEED = 256, 8192, 400, 52
WIDTH_MULTIPLES = (1, 16, 32, 64, 128, 256, 512, 1024)
# regime -> (largest batch drawn, largest prompt, largest generated so far)
REGIMES = {"busy": (256, 1024, 1024), "light": (16, 256, 256)}


def decode_batches(regime: str, steps: int = STEPS, seed: int = SEED) -> list[list[int]]:
    """`steps` decode batches, each the list of its rows' context lengths (seeded)."""
    batch, prompt, generated = REGIMES[regime]
    rng = random.Random(f"{regime}-{seed}")
    return [
        [rng.randint(16, prompt) + rng.randint(0, generated) for _ in range(rng.randint(1, batch))]
        for _ in range(steps)
    ]


ROW_KINDS = ("pow2", "x8", "every")


def row_set(kind: str, max_batch: int) -> tuple[int, ...]:
    """'pow2': nanoserve's row buckets; 'x8': 1, 2, 4, then multiples of 8; 'every': one bucket
    per batch size (no row padding)."""
    if kind == "pow2":
        return row_buckets(max_batch)
    if kind == "x8":
        small = [r for r in (1, 2, 4) if r < max_batch]
        return tuple(small + list(range(8, max_batch, 8)) + [max_batch])
    return tuple(range(1, max_batch + 1))


@dataclass
class Waste:
    regime: str
    rows: str  # pow2 | x8 | every
    width_multiple: int
    row_buckets: int
    width_buckets: int
    real_rows: int = 0
    bucket_rows: int = 0
    real_cells: int = 0  # real rows x their batch's longest context: what eager gathers
    real_bucket_cells: int = 0  # real rows x bucket width
    bucket_cells: int = 0  # bucket rows x bucket width

    @property
    def shapes(self) -> int:
        return self.row_buckets * self.width_buckets

    @property
    def row_waste(self) -> float:
        return 1 - self.real_rows / self.bucket_rows

    @property
    def width_waste(self) -> float:
        return 1 - self.real_cells / self.real_bucket_cells

    @property
    def cell_waste(self) -> float:
        return 1 - self.real_cells / self.bucket_cells


def waste(batches, regime: str, rows: str, width_multiple: int, max_batch=MAX_BATCH, max_len=MAX_MODEL_LEN):
    """Pad every batch to its bucket and add up real against padded rows and cells."""
    rset, wset = row_set(rows, max_batch), width_buckets(max_len, width_multiple)
    w = Waste(regime, rows, width_multiple, len(rset), len(wset))
    for ctx in batches:
        n, width = len(ctx), max(ctx)
        r, wb = bucket_up(n, rset), bucket_up(width, wset)
        w.real_rows += n
        w.bucket_rows += r
        w.real_cells += n * width
        w.real_bucket_cells += n * wb
        w.bucket_cells += r * wb
    return w


def measure(steps: int = STEPS, seed: int = SEED, width_multiples=WIDTH_MULTIPLES) -> list[Waste]:
    """Every (regime, row kind, width multiple) over the same batches per regime."""
    out = []
    for regime in REGIMES:
        batches = decode_batches(regime, steps, seed)
        out += [waste(batches, regime, rows, m) for rows in ROW_KINDS for m in width_multiples]
    return out


def width_table(results: list[Waste]) -> list[dict]:
    """One row per width multiple: shapes with either row set, and each regime's waste."""
    at = {(w.regime, w.rows, w.width_multiple): w for w in results}
    rows = []
    for m in sorted({w.width_multiple for w in results}):
        row = {"width_multiple": m, "width_buckets": at["busy", "pow2", m].width_buckets}
        row |= {f"shapes_{kind}": at["busy", kind, m].shapes for kind in ROW_KINDS}
        for regime in REGIMES:
            row[f"{regime}_width_waste"] = f"{at[regime, 'pow2', m].width_waste:.4f}"
            row[f"{regime}_cell_waste"] = f"{at[regime, 'pow2', m].cell_waste:.4f}"
        rows.append(row)
    return rows


def row_table(results: list[Waste]) -> list[dict]:
    """Row padding alone (it does not depend on the width multiple)."""
    seen = {(w.regime, w.rows): w for w in results}
    return [
        {
            "regime": regime,
            "rows": kind,
            "row_buckets": w.row_buckets,
            "real_rows": w.real_rows,
            "bucket_rows": w.bucket_rows,
            "row_waste": f"{w.row_waste:.4f}",
        }
        for (regime, kind), w in seen.items()
    ]


# --- the K/V pools around one step (the notebook's "touches nothing" check) -----------------


def snapshot(cache) -> list[tuple]:
    """A copy of every layer's K and V pool, (num_slots + 1, kv_heads, head_dim) each."""
    return [(k.clone(), v.clone()) for k, v in zip(cache.k, cache.v)]


def restore(cache, snap: list[tuple]) -> None:
    with torch.inference_mode():  # the pools are inference tensors
        for (k, v), (k0, v0) in zip(zip(cache.k, cache.v), snap):
            k.copy_(k0)
            v.copy_(v0)


def changed_slots(before: list[tuple], after: list[tuple]) -> list[int]:
    """Pool entries (slots) whose K or V differs in any layer, head or channel."""
    changed = set()
    for (k0, v0), (k1, v1) in zip(before, after):
        diff = (k0 != k1).flatten(1).any(1) | (v0 != v1).flatten(1).any(1)  # (num_slots + 1,)
        changed |= set(diff.nonzero().flatten().tolist())
    return sorted(changed)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=STEPS, help="decode batches drawn per regime")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--out-dir", default=str(HERE), help="folder for the two CSVs")
    args = p.parse_args(argv)
    results = measure(args.steps, args.seed)
    for name, rows in (("padwaste", width_table(results)), ("rowwaste", row_table(results))):
        for r in rows:
            print(", ".join(f"{k}={v}" for k, v in r.items()))
        print(f"wrote {write_csv(rows, Path(args.out_dir) / f'day-52-{name}.csv')}")


if __name__ == "__main__":
    main()
