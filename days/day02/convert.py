"""Day 2: what the GGUF holds, by tensor type, and what it costs once dequantized.

Reads the GGUF's tensor directory (no dequantizing) and writes one row per tensor type: how
many tensors, how many parameters, their bytes in the GGUF, and their bytes once converted to
fp32 or bf16, plus a total row. Every number is read from the file, so the CSV is the same on
every machine. With `--convert DIR` it also runs the conversion (`weights.import_gguf`) and
prints the files it wrote and how long it took.

    python days/day02/convert.py                         # the default GGUF -> day-02-tensors.csv
    python days/day02/convert.py --gguf other.gguf --out /tmp/t.csv --convert /tmp/model --dtype bfloat16
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import gguf
import torch

from nanocourse import write_csv
from nanoserve.weights import default_gguf_path, import_gguf

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-02-tensors.csv"


def tensor_kind(name: str) -> str:
    """'blk.7.attn_q.weight' -> 'attn_q'; 'token_embd.weight' -> 'token_embd'."""
    return re.sub(r"^blk\.\d+\.", "", name).removesuffix(".weight")


def tensor_rows(reader) -> list[dict]:
    """One row per GGUF tensor type (most bytes first), then the total."""
    by_type: dict[str, list] = {}
    for t in reader.tensors:
        by_type.setdefault(t.tensor_type.name, []).append(t)
    rows = []
    for kind, ts in by_type.items():
        params = sum(int(t.n_elements) for t in ts)
        gguf_bytes = sum(int(t.n_bytes) for t in ts)
        rows.append(
            {
                "type": kind,
                "tensors": len(ts),
                "parameters": params,
                "gguf_bytes": gguf_bytes,
                "bits_per_weight": f"{8 * gguf_bytes / params:.2f}",
                "fp32_bytes": 4 * params,
                "bf16_bytes": 2 * params,
                "holds": " ".join(sorted({tensor_kind(t.name) for t in ts})),
            }
        )
    rows.sort(key=lambda r: -r["gguf_bytes"])
    params = sum(r["parameters"] for r in rows)
    gguf_bytes = sum(r["gguf_bytes"] for r in rows)
    rows.append(
        {
            "type": "total",
            "tensors": sum(r["tensors"] for r in rows),
            "parameters": params,
            "gguf_bytes": gguf_bytes,
            "bits_per_weight": f"{8 * gguf_bytes / params:.2f}",
            "fp32_bytes": 4 * params,
            "bf16_bytes": 2 * params,
            "holds": "",
        }
    )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None, help="GGUF file (default: the default model's)")
    p.add_argument("--out", default=str(CSV), help="CSV to write")
    p.add_argument("--convert", metavar="DIR", help="also convert into DIR (must not exist)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    path = Path(args.gguf) if args.gguf else default_gguf_path()
    rows = tensor_rows(gguf.GGUFReader(path))
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out)}")
    if args.convert:
        t0 = time.perf_counter()
        out = import_gguf(path, args.convert, dtype=getattr(torch, args.dtype))
        seconds = time.perf_counter() - t0
        for f in sorted(out.iterdir()):
            print(f"{f.name:24} {f.stat().st_size:>13,} bytes")
        print(f"converted {path.name} to {args.dtype} in {seconds:.1f} s")


if __name__ == "__main__":
    main()
