"""Day 25: what the engine's step plans hold, per kind of step, over a staggered workload.

Requests of seeded random lengths arrive a few steps apart at an engine with a small step
budget, so its steps come in all three kinds: prefill (prompt chunks only), decode (one token
per running row) and mixed (decode rows first, then prompt chunks). The script wraps the
engine's `ModelRunner.plan`, and for every plan the engine builds it records the sizes of the
plan's tensors, runs the addressing gates that apply (`check_window_intact` on every plan,
`check_plan_addressing` on decode plans, whose rows hold one token each) and times the build.

Both scheduling policies run the same requests: "budget", the default, which mixes decode rows
and prompt chunks in one step, and "prefill-first", the earlier one, whose steps are all
prefill or all decode. Per policy and kind, one row of `day-25-plans.csv`: the steps of that
kind, the tokens N and rows B per step (fewest and most), the widest window W, the plan's
bytes at the largest step split into the per-token tensors (input_ids, positions,
write_slots: 3 x N int64), the per-row ones (context_lens, logits_at: 2 x B) and the window
(B x W), the gates passed, and the mean time to build a plan (`build_us`, this machine's).
With `ignore_eos` the schedule depends on the lengths alone, never on the weights, so the
counts are the same for any model; the tiny random-weight Llama keeps the run to seconds.

    python days/day25/planbench.py           # tiny Llama -> day-25-plans.csv
    python days/day25/planbench.py --requests 32 --budget 512 --out /tmp/plans.csv
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from nanocourse import tiny_llama, write_csv
from nanoserve.bench import cpu_line
from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.models import load_model
from nanoserve.plan import check_plan_addressing, check_window_intact
from nanoserve.sampling import SamplingParams
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
CSV_PLANS = HERE / "day-25-plans.csv"
KINDS = ("prefill", "decode", "mixed")
SCHEDULES = ("budget", "prefill-first")  # the default policy (day 57's) and the one before it
INT64 = 8  # bytes: every plan tensor is torch.long


def kind_of(batch) -> str:
    return "mixed" if batch.is_mixed else "decode" if batch.is_decode else "prefill"


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
    """Wrap engine.runner.plan: every plan it builds is measured and gated as it is built."""
    log: list[dict] = []
    build = engine.runner.plan

    def measured(batch):
        t0 = time.perf_counter()
        plan = build(batch)
        seconds = time.perf_counter() - t0
        gates = 0
        check_window_intact(plan)
        gates += 1
        if plan.is_decode:
            check_plan_addressing(plan)
            gates += 1
        log.append({"kind": kind_of(batch), **sizes(plan), "gates": gates, "seconds": seconds})
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


def run(
    model, reqs, budget: int = 64, max_batch: int = 8, block_size: int = 16, schedule: str = "budget"
) -> tuple[Engine, list]:
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * block_size
    config = EngineConfig(
        schedule=schedule,
        max_batch=max_batch,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_model_len=512,
        kv_budget=512 * per_block,
        linear="plain",
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


def table(log: list[dict], schedule: str = "budget") -> list[dict]:
    rows = []
    for kind in KINDS:
        steps = [r for r in log if r["kind"] == kind]
        if not steps:
            continue
        big = max(steps, key=lambda r: r["per_token_bytes"] + r["per_row_bytes"] + r["window_bytes"])
        total = big["per_token_bytes"] + big["per_row_bytes"] + big["window_bytes"]
        rows.append(
            {
                "schedule": schedule,
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
                "gates_passed": sum(r["gates"] for r in steps),
                "build_us": round(1e6 * sum(r["seconds"] for r in steps) / len(steps), 1),
            }
        )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a model directory instead of the tiny Llama (same counts, slower)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--budget", type=int, default=64, help="max_num_batched_tokens")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(CSV_PLANS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    model = load_model(resolve_model_dir(args.model)) if args.model else tiny_llama(0)
    reqs = workload(args.requests, vocab=model.cfg.vocab_size, seed=args.seed)
    rows = []
    for schedule in SCHEDULES:
        engine, log = run(model, reqs, args.budget, args.max_batch, schedule=schedule)
        print(f"{schedule}: {len(log)} steps, step_kinds {engine.step_kinds}")
        rows += table(log, schedule)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out)}")


if __name__ == "__main__":
    main()
