"""Day 18: paged attention for decode rows, one layer, three ways, on the CPU.

A decode row has one query and attends over its first `context_len` slots, which lie wherever
its blocks are in the pools. Three ways to compute one layer of it for a few rows:

* contiguous: Day 11's `ContiguousKVCache`, one per row, each holding its row's keys side by
  side; attention reads `[0, length)` of each (one SDPA call per row);
* gather: `BatchedPagedKVCache(attention="gather")`, the package's way from this day on: every
  row's slot window is copied out of the pools, padded to the widest row, and one SDPA call
  reads the copy with a mask that hides each row's positions at or past its length;
* inplace: `inplace_read` below, in plain torch: each row walks its block table a block at a
  time, reads that block's filled slots where they lie in the pools (a slice, no copy), and
  folds them in with an online softmax (running max, running sum, rescaled accumulator).

Two tables, for 4 rows of SmolLM2-135M's head shape (9 query heads, 3 K/V heads, head dim 64,
fp32), in blocks of 16 drawn at random from the pool, at two mixes of lengths for a widest
context C: "spread", rows of C/4, C/2, 3C/4 and C, and "one long", three rows of 16 and one of C:

* `day-18-bytes.csv`: the K/V bytes each way moves for one layer (arithmetic). Contiguous and
  in place read each row's own keys and values once: 2 x sum(L) x kv_heads x head_dim x 4. The
  gather path reads R x W slots out of the pools, writes them into its copy and SDPA reads the
  copy again: 3 x 2 x R x W x kv_heads x head_dim x 4, with W the widest row's blocks in slots.
* `day-18-time.csv`: each way timed (the least of `--reps` turns, the three taken in turn, on
  one thread by default), after asserting that the three agree to 1e-5. The in-place read is a
  Python loop of small torch calls per block, so it is the slowest here; what it saves is the
  bytes, and a compiled read (day 58's kernel) is what turns them into time.

    python days/day18/pagedread.py                      # -> day-18-bytes.csv, day-18-time.csv
    python days/day18/pagedread.py --contexts 128 8192 --reps 10 --out-time /tmp/t.csv
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from nanocourse import cpu_line, write_csv
from nanoserve.cache import BatchedPagedKVCache
from nanoserve.contiguous import ContiguousKVCache
from nanoserve.models import LlamaConfig
from nanoserve.plan import slot_window

HERE = Path(__file__).resolve().parent
CSV_BYTES = HERE / "day-18-bytes.csv"
CSV_TIME = HERE / "day-18-time.csv"
BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM, FP32 = 9, 3, 64, 4  # SmolLM2-135M
CONTEXTS = (64, 256, 1024, 4096)
WAYS = ("contiguous", "gather", "inplace")
TOL = 1e-5  # fp32, sums of up to 4096 terms in different orders


MIXES = ("spread", "one long")


def row_lens(widest: int, mix: str = "spread") -> list[int]:
    """The 4 rows' contexts: "spread" 64 -> [16, 32, 48, 64]; "one long" 64 -> [16, 16, 16, 64]."""
    if mix == "spread":
        return [widest * (r + 1) // 4 for r in range(4)]
    if mix == "one long":
        return [16, 16, 16, widest]
    raise ValueError(f"mix is one of {', '.join(MIXES)}, not {mix!r}")


def width_of(lens: list[int], block_size: int = BLOCK) -> int:
    """The gather path's window width: the widest row's blocks, in slots."""
    return -(-max(lens) // block_size) * block_size


def read_bytes(lens: list[int]) -> int:
    """Contiguous and in place: each row's own K and V, once."""
    return 2 * sum(lens) * KV_HEADS * HEAD_DIM * FP32


def gather_bytes(lens: list[int]) -> int:
    """Gather: R x W slots read from the pools, written to the copy, read again by SDPA."""
    return 3 * 2 * len(lens) * width_of(lens) * KV_HEADS * HEAD_DIM * FP32


def bytes_table(contexts=CONTEXTS, mixes=MIXES) -> list[dict]:
    return [bytes_row(mix, c) for mix in mixes for c in contexts]


def bytes_row(mix: str, widest: int) -> dict:
    lens = row_lens(widest, mix)
    return {
        "mix": mix,
        "widest": widest,
        "lens": " ".join(map(str, lens)),
        "width": width_of(lens),
        "sum_len": sum(lens),
        "contiguous_kb": f"{read_bytes(lens) / 1e3:.1f}",
        "gather_kb": f"{gather_bytes(lens) / 1e3:.1f}",
        "inplace_kb": f"{read_bytes(lens) / 1e3:.1f}",
        "gather_over_inplace": f"{gather_bytes(lens) / read_bytes(lens):.2f}",
    }


def inplace_read(q, k_pool, v_pool, tables, context_lens, block_size=BLOCK, scale=None):
    """q (B, nh, hd); pools (slots, kv, hd); tables: each row's block list; context_lens (B,)
    -> (B, nh, hd). Each row walks its own blocks up to its length and reads their slots where
    they lie (a slice of the pool is a view: nothing is copied); an online softmax joins the
    blocks. The notebook builds the same loop step by step and asserts the two are equal."""
    rows, heads, hd = q.shape
    kv = k_pool.shape[1]
    scale = hd**-0.5 if scale is None else scale
    out = torch.zeros_like(q)
    for r in range(rows):
        qr = q[r].view(kv, heads // kv, hd) * scale  # (kv, group, hd): a K/V head's query heads
        m = torch.full((kv, heads // kv), float("-inf"))  # running max of the scores
        l = torch.zeros(kv, heads // kv)  # running sum of exp(score - m)  # noqa: E741
        acc = torch.zeros(kv, heads // kv, hd)  # running sum of exp(score - m) * value
        for j, block in enumerate(tables[r]):
            n = min(block_size, int(context_lens[r]) - j * block_size)  # filled slots in this block
            if n <= 0:
                break
            start = block * block_size
            k, v = k_pool[start : start + n], v_pool[start : start + n]  # (n, kv, hd): views
            s = torch.einsum("kgd,nkd->kgn", qr, k)  # (kv, group, n)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)  # < 1 where the max rose: shrink what came before
            p = torch.exp(s - m_new[..., None])  # (kv, group, n)
            l = alpha * l + p.sum(-1)  # noqa: E741
            acc = alpha[..., None] * acc + torch.einsum("kgn,nkd->kgd", p, v)
            m = m_new
        if int(context_lens[r]) > 0:
            out[r] = (acc / l[..., None]).view(heads, hd)
    return out


def one_layer(max_len: int = 8192) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32, hidden_size=HEADS * HEAD_DIM, intermediate_size=8, num_layers=1, num_heads=HEADS,
        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=max_len,
    )  # fmt: skip


def block_lists(lens: list[int], num_blocks: int, rng: random.Random) -> list[list[int]]:
    """Each row's blocks, drawn at random from the pool, no two rows sharing one."""
    need = [-(-n // BLOCK) for n in lens]
    free = rng.sample(range(num_blocks), sum(need))
    out, at = [], 0
    for k in need:
        out.append(free[at : at + k])
        at += k
    return out


def layer_setup(lens: list[int], seed: int = 0, blocks: list[list[int]] | None = None) -> dict:
    """One layer's K/V for rows of `lens`, stored both ways: in the paged pools at the rows'
    slots (a gather cache over them) and in one contiguous cache per row; a query per row; the
    rows' block lists and slot window. `blocks` gives each row's block list; by default they
    are drawn at random."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK) for n in lens) + 8
    cfg = one_layer()
    k_pool = torch.zeros(num_blocks * BLOCK + 1, KV_HEADS, HEAD_DIM)  # (slots + sink, kv, hd)
    v_pool = torch.zeros_like(k_pool)
    lists = blocks if blocks is not None else block_lists(lens, num_blocks, rng)
    window = slot_window(lists, BLOCK, "cpu")  # (R, W)
    contiguous = []
    for r, n in enumerate(lens):
        k, v = torch.randn(2, n, KV_HEADS, HEAD_DIM, generator=g)  # this row's tokens' K and V
        k_pool[window[r, :n]], v_pool[window[r, :n]] = k, v  # the paged write (Day 17)
        c = ContiguousKVCache(cfg, n)
        c.k[0][:], c.v[0][:] = k.transpose(0, 1), v.transpose(0, 1)  # (kv, n, hd)
        c.length, c.positions = n, torch.tensor([n - 1])  # as after `begin` of its decode step
        contiguous.append(c)
    gather = BatchedPagedKVCache(cfg, num_blocks * BLOCK, attention="gather")
    gather.k[0], gather.v[0] = k_pool, v_pool
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=g)  # (R, nh, hd)
    return {
        "lens": lens,
        "blocks": lists,
        "window": window,
        "context_lens": torch.tensor(lens),
        "q": q,
        "k_pool": k_pool,
        "v_pool": v_pool,
        "contiguous": contiguous,
        "gather": gather,
    }


def run(setup: dict, way: str) -> torch.Tensor:
    """(R, nh, hd): one layer's decode attention for every row, computed `way`."""
    q, window, ctx = setup["q"], setup["window"], setup["context_lens"]
    if way == "contiguous":
        return torch.cat([c.attention(0, q[r : r + 1]) for r, c in enumerate(setup["contiguous"])])
    if way == "gather":
        return setup["gather"]._one_query_rows(0, q, window, ctx)
    if way == "inplace":
        return inplace_read(q, setup["k_pool"], setup["v_pool"], setup["blocks"], ctx)
    raise ValueError(f"way is one of {', '.join(WAYS)}, not {way!r}")


def check_close(label: str, got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> float:
    """max |got - want| (absolute: the outputs are averages of unit-scale values), or AssertionError."""
    diff = (got - want).abs().max().item()
    if not diff < tol:
        raise AssertionError(f"{label}: max |difference| {diff:.2e} exceeds {tol:g}")
    return diff


def best_of(fns: dict, reps: int) -> dict:
    """The least seconds of each callable over `reps` turns, all taken in turn."""
    times = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name] = min(times[name], time.perf_counter() - t0)
    return times


def time_row(mix: str, widest: int, reps: int, seed: int = 0) -> dict:
    setup = layer_setup(row_lens(widest, mix), seed)
    with torch.inference_mode():
        want = run(setup, "contiguous")
        for way in ("gather", "inplace"):
            check_close(way, run(setup, way), want)
        t = best_of({way: (lambda way=way: run(setup, way)) for way in WAYS}, reps)
    row = {"mix": mix, "widest": widest, "threads": torch.get_num_threads(), "width": width_of(setup["lens"])}
    row |= {f"{way}_us": f"{t[way] * 1e6:.1f}" for way in WAYS}
    row["inplace_over_gather"] = f"{t['inplace'] / t['gather']:.2f}"
    row["contiguous_over_gather"] = f"{t['contiguous'] / t['gather']:.2f}"
    row["cpu"] = cpu_line()
    return row


def time_table(contexts=CONTEXTS, reps: int = 50, mixes=MIXES) -> list[dict]:
    return [time_row(mix, c, reps) for mix in mixes for c in contexts]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS), help="widest contexts C")
    p.add_argument("--reps", type=int, default=50, help="timed turns of each way")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the timed calls")
    p.add_argument("--out-bytes", default=str(CSV_BYTES), help="CSV of the bytes moved")
    p.add_argument("--out-time", default=str(CSV_TIME), help="CSV of the times")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    for name, rows, out in (
        ("bytes", bytes_table(args.contexts), args.out_bytes),
        ("time", time_table(args.contexts, args.reps), args.out_time),
    ):
        print(name)
        for r in rows:
            print("  ", ", ".join(f"{k}={v}" for k, v in r.items()))
        print(f"wrote {write_csv(rows, out)}")


if __name__ == "__main__":
    main()
