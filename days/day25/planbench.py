"""Day 25: what the engine's step plans hold, per kind of step, over a staggered workload.

Requests of seeded random lengths arrive a few steps apart at the engine as of day 25
(`engine_config(25)`: static batches, attention by gather, plain linears), so its steps come in
the two kinds it has: prefill (whole prompts, packed) and decode (one token per running row).
The step budget is large enough that a static batch's prompts always fit one step. The script
wraps the engine's `ModelRunner.plan`, and for every plan the engine builds it records the
sizes of the plan's tensors, runs the day's two checks on it (`check_windows`: every row's
window is its block table's slots up to its length; `check_spans`: every row's span holds
consecutive positions ending at its context, written where its window maps them, sampled at
its last token) and times the build.

Per kind, one row of `day-25-plans.csv`: the steps of that kind, the tokens N and rows B per
step (fewest and most), the widest window W, the plan's bytes at the largest step split into
the per-token tensors (input_ids, positions, write_slots: 3 x N int64), the per-row ones
(context_lens, logits_at: 2 x B) and the window (B x W), the checks passed, and the mean time
to build a plan (`build_us`, this machine's, with its `cpu`). With `ignore_eos` the schedule
depends on the lengths alone, never on the weights, so the counts are the same for any model;
the tiny random-weight Llama keeps the run to seconds.

    python days/day25/planbench.py           # tiny Llama -> day-25-plans.csv
    python days/day25/planbench.py --requests 32 --max-batch 4 --out /tmp/plans.csv
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from nanocourse import engine_config, tiny_llama, write_csv
from nanoserve.bench import cpu_line
from nanoserve.engine import Engine
from nanoserve.models import load_model
from nanoserve.sampling import SamplingParams
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
CSV_PLANS = HERE / "day-25-plans.csv"
KINDS = ("prefill", "decode")
INT64 = 8  # bytes: every plan tensor is torch.long


def kind_of(batch) -> str:
    assert not batch.is_mixed  # the engine of day 25 gives a step prompts or decode rows, not both
    return "decode" if batch.is_decode else "prefill"


def tables_of(plan) -> list[list[int]]:
    """A copy of each row's block table as it is now (a finished sequence's table is emptied)."""
    return [list(seq.block_table.blocks) for seq in plan.rows]


def check_windows(plan, tables: list[list[int]] | None = None) -> None:
    """Every row's window holds its block table's slots at every position it attends to;
    `tables` (from `tables_of`, taken when the plan was built) default to the rows' tables now."""
    tables = tables_of(plan) if tables is None else tables
    for r, (seq, blocks) in enumerate(zip(plan.rows, tables)):
        bs, ctx = seq.block_table.block_size, plan.context_lens[r].item()
        if ctx > len(blocks) * bs:
            raise AssertionError(f"row {r} attends over {ctx} positions, its table holds {len(blocks) * bs}")
        want = [blocks[p // bs] * bs + p % bs for p in range(ctx)]
        got = plan.slot_window[r, :ctx].tolist()
        if got != want:
            p = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            raise AssertionError(f"row {r}'s window has slot {got[p]} at position {p}, its table {want[p]}")


def check_spans(plan) -> None:
    """Each row's span holds consecutive positions ending at its context, each written where the
    row's window maps it, and the row samples at its span's last token."""
    pos, writes, ctx = plan.positions.tolist(), plan.write_slots.tolist(), plan.context_lens.tolist()
    logits_at = plan.logits_at.tolist()
    for r, (start, end, c) in enumerate(plan.row_spans):
        if c != ctx[r]:
            raise AssertionError(f"row {r}'s span ends its context at {c}, but context_lens says {ctx[r]}")
        want = list(range(c - (end - start), c))
        if pos[start:end] != want:
            raise AssertionError(
                f"row {r} holds positions {pos[start:end]}, not {want[0]}..{want[-1]} in order"
            )
        for i, p in zip(range(start, end), want):
            if writes[i] != plan.slot_window[r, p].item():
                mapped = plan.slot_window[r, p].item()
                raise AssertionError(
                    f"row {r} writes position {p} to slot {writes[i]}, its window says {mapped}"
                )
        if logits_at[r] != end - 1:
            raise AssertionError(f"row {r} samples token {logits_at[r]}, not its last, {end - 1}")


CHECKS = (check_windows, check_spans)


def sizes(plan) -> dict:
    """A plan's shape and bytes, by the kind of tensor."""
    n, (b, w) = plan.num_tokens, tuple(plan.slot_window.shape)
    return {
        "tokens": n,
        "rows": b,
        "width": w,
        "per_token_bytes": 3 * n * INT64,
        "per_row_bytes": 2 * b * INT64,
        "window_bytes": b * w * INT64,
    }


def record(engine: Engine) -> list[dict]:
    """Wrap engine.runner.plan: every plan it builds is measured and checked as it is built."""
    log: list[dict] = []
    build = engine.runner.plan

    def measured(batch):
        t0 = time.perf_counter()
        plan = build(batch)
        seconds = time.perf_counter() - t0
        for check in CHECKS:
            check(plan)
        log.append({"kind": kind_of(batch), **sizes(plan), "checks": len(CHECKS), "seconds": seconds})
        return plan

    engine.runner.plan = measured
    return log


def workload(n: int, prompt=(8, 200), new=(8, 48), every: int = 3, vocab: int = 256, seed: int = 0):
    """n (arrival step, prompt ids, max_tokens): one request every `every` steps."""
    rng = random.Random(seed)
    return [
        (i * every, [rng.randrange(vocab) for _ in range(rng.randint(*prompt))], rng.randint(*new))
        for i in range(n)
    ]


def run(model, reqs, budget: int = 2048, max_batch: int = 8, block_size: int = 16) -> tuple[Engine, list]:
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * block_size
    config = engine_config(
        25,  # static batches, attention by gather, plain linears
        max_batch=max_batch,
        block_size=block_size,
        max_num_batched_tokens=budget,  # room for a whole batch's prompts: no prompt is split
        max_model_len=512,
        kv_budget=512 * per_block,
    )
    engine = Engine(model, None, config)
    log = record(engine)
    pending, step = list(reqs), 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, ids, n = pending.pop(0)
            engine.add_request(ids, SamplingParams(max_tokens=n, ignore_eos=True))
        engine.step()
        step += 1
    return engine, log


def table(log: list[dict]) -> list[dict]:
    rows = []
    for kind in KINDS:
        steps = [r for r in log if r["kind"] == kind]
        if not steps:
            continue
        big = max(steps, key=lambda r: r["per_token_bytes"] + r["per_row_bytes"] + r["window_bytes"])
        total = big["per_token_bytes"] + big["per_row_bytes"] + big["window_bytes"]
        rows.append(
            {
                "kind": kind,
                "steps": len(steps),
                "tokens_min": min(r["tokens"] for r in steps),
                "tokens_max": max(r["tokens"] for r in steps),
                "rows_min": min(r["rows"] for r in steps),
                "rows_max": max(r["rows"] for r in steps),
                "width_max": max(r["width"] for r in steps),
                "largest_tokens": big["tokens"],
                "largest_rows": big["rows"],
                "largest_width": big["width"],
                "per_token_bytes": big["per_token_bytes"],
                "per_row_bytes": big["per_row_bytes"],
                "window_bytes": big["window_bytes"],
                "window_share": round(big["window_bytes"] / total, 3),
                "checks_passed": sum(r["checks"] for r in steps),
                "build_us": round(1e6 * sum(r["seconds"] for r in steps) / len(steps), 1),
                "cpu": cpu_line(),
            }
        )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a model directory instead of the tiny Llama (same counts, slower)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(CSV_PLANS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    model = load_model(resolve_model_dir(args.model)) if args.model else tiny_llama(0)
    reqs = workload(args.requests, vocab=model.cfg.vocab_size, seed=args.seed)
    engine, log = run(model, reqs, args.budget, args.max_batch)
    print(f"{len(log)} steps, step_kinds {engine.step_kinds}")
    rows = table(log)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out)}")


if __name__ == "__main__":
    main()
