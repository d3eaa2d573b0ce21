"""Day 27: continuous batching against static batching, the same requests, step by step.

The requests are `nanoserve.bench.throughput_workload`'s, all queued before the first step
(an offline batch job, as `bench throughput` runs it). Two engines as of day 27
(`engine_config(27)`: attention by gather, plain linears) that differ only in `schedule`:

* "static" (day 22's): a batch is admitted only into an empty engine, as many waiting requests
  as there are rows, and runs until its last member has finished; a finished member's row
  stays empty;
* "prefill-first" (day 26's, the engine's schedule from then on): continuous batching. A
  request is admitted in any step a row is free, and a finished one leaves at once; a step is
  all prefill (the prompts of those just admitted) or all decode (one token for every running
  request), prompt work first.

Per step (`day-27-occupancy.csv`): the rows the step computed, the tokens it carried and its
kind, for each policy. Per policy (`day-27-continuous.csv`): steps by kind, row-steps, mean rows and
tokens a step, the share of the engine's seats in use, the generated tokens and whether every
request's tokens equal the request run alone (`generate.greedy_tokens`); and this machine's
wall time and tokens a second, each policy the faster of `--repeats` runs taken in turn.

On the tiny random-weight Llama a step costs little more than its fixed overhead (Day 49), so
the wall time follows the number of steps; Day 33 measures SmolLM2.

    python days/day27/continuousbench.py                  # 64 requests, 16 rows -> both CSVs
    python days/day27/continuousbench.py --requests 16 --rows 4 --prompt-len 4 24 --output-len 2 24
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from nanocourse import engine_config, tiny_llama, write_csv
from nanoserve.bench import cpu_line, throughput_workload
from nanoserve.engine import Engine
from nanoserve.generate import greedy_tokens
from nanoserve.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-27-continuous.csv"
CSV_STEPS = HERE / "day-27-occupancy.csv"
POLICIES = ("static", "prefill-first")
FULL = {"requests": 64, "prompt": (16, 256), "new": (16, 128), "rows": 16, "budget": 512}  # the bench's
SMALL = {"requests": 16, "prompt": (4, 24), "new": (2, 24), "rows": 4, "budget": 512}  # the notebook's


def make_engine(model, schedule: str, rows: int, budget: int, block_size: int = 16) -> Engine:
    """An engine whose pool holds every row at the model's full context (nothing is preempted,
    no admission waits for blocks), so the two policies differ in nothing but `schedule`."""
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * block_size
    max_len = model.cfg.max_position_embeddings
    blocks = rows * (-(-max_len // block_size) + 1) + 1
    config = engine_config(
        27,  # the engine as of today: attention "gather", linear "plain", no watermark
        schedule=schedule,
        max_batch=rows,
        max_model_len=max_len,
        block_size=block_size,
        kv_budget=blocks * per_block + per_block // block_size,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,  # random prompts share nothing; keep the run about batching
    )
    return Engine(model, None, config)


def run(engine: Engine, reqs) -> dict:
    """Queue every request, step to the end. Per step: its kind, the rows it computed, the
    tokens it carried, how many sequences were running before it, how many it admitted, and
    which requests (by index in reqs) it computed."""
    sched, schedule = engine.scheduler, engine.scheduler.schedule
    steps = []

    def watched():
        before = list(sched.running)
        b = schedule()
        assert not b.is_mixed  # both policies give a step prompt work or decode rows, not both
        kind = "decode" if b.is_decode else "prefill"
        steps.append(
            {
                "kind": kind,
                "rows": len(b.seqs),
                "tokens": len(b.decode) + sum(e - s for _, s, e in b.chunks),
                "running_before": len(before),
                "admitted": sum(s not in before for s in sched.running),
                "members": sorted(ids[s.request_id] for s in b.seqs),  # request indices
            }
        )
        return b

    sched.schedule = watched
    ids = {}
    for i, (p, n) in enumerate(reqs):
        ids[engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))] = i
    out = {i: [] for i in range(len(reqs))}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            out[ids[o.request_id]] += o.new_token_ids
    seconds = time.perf_counter() - t0
    del sched.schedule
    assert engine.allocator.num_free == engine.allocator.num_blocks
    return {"steps": steps, "tokens": [out[i] for i in range(len(reqs))], "seconds": seconds}


def summary(policy: str, got: dict, rows: int, budget: int, same: int) -> dict:
    steps = got["steps"]
    row_steps = sum(s["rows"] for s in steps)
    generated = sum(len(t) for t in got["tokens"])
    return {
        "policy": policy,
        "requests": len(got["tokens"]),
        "rows": rows,
        "budget": budget,
        "steps": len(steps),
        "prefill_steps": sum(s["kind"] == "prefill" for s in steps),
        "decode_steps": sum(s["kind"] == "decode" for s in steps),
        "row_steps": row_steps,
        "mean_rows": round(row_steps / len(steps), 2),
        "seat_use": round(row_steps / (len(steps) * rows), 3),
        "mean_step_tokens": round(sum(s["tokens"] for s in steps) / len(steps), 1),
        "generated": generated,
        "same_as_alone": same,
        "seconds": round(got["seconds"], 2),
        "tok_s": round(generated / got["seconds"], 1),
        "cpu": cpu_line(),
    }


def table(model, reqs, rows: int, budget: int, repeats: int = 2) -> tuple[list[dict], list[dict], dict]:
    """Both policies on the same requests, `repeats` times in turn (each keeps its fastest run;
    every run must give the same steps and tokens); every request's tokens against it alone."""
    best = {}
    for _ in range(repeats):
        for policy in POLICIES:
            got = run(make_engine(model, policy, rows, budget), reqs)
            if policy in best:
                assert got["tokens"] == best[policy]["tokens"] and got["steps"] == best[policy]["steps"]
            if policy not in best or got["seconds"] < best[policy]["seconds"]:
                best[policy] = got
    with torch.inference_mode():
        alone = [greedy_tokens(model, p, n) for p, n in reqs]
    out = []
    for policy, got in best.items():
        same = sum(a == b for a, b in zip(got["tokens"], alone))
        bad = next((i for i, (a, b) in enumerate(zip(got["tokens"], alone)) if a != b), None)
        assert bad is None, f"{policy}: request {bad}'s tokens differ from the request run alone"
        out.append(summary(policy, got, rows, budget, same))
    n = max(len(g["steps"]) for g in best.values())
    per_step = []
    for i in range(n):
        row = {"step": i}
        for policy, got in best.items():
            s = got["steps"][i] if i < len(got["steps"]) else {"rows": "", "tokens": "", "kind": ""}
            row |= {f"{policy}_rows": s["rows"], f"{policy}_tokens": s["tokens"], f"{policy}_kind": s["kind"]}
        per_step.append(row)
    return out, per_step, best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=FULL["requests"])
    p.add_argument("--rows", type=int, default=FULL["rows"], help="max_batch of both engines")
    p.add_argument("--budget", type=int, default=FULL["budget"], help="max_num_batched_tokens")
    p.add_argument("--prompt-len", type=int, nargs=2, default=list(FULL["prompt"]), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=list(FULL["new"]), metavar=("MIN", "MAX"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(CSV))
    p.add_argument("--out-steps", default=str(CSV_STEPS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    model = tiny_llama(0)
    reqs = throughput_workload(
        args.requests, args.prompt_len, args.output_len, model.cfg.vocab_size, args.seed
    )
    rows, per_step, _ = table(model, reqs, args.rows, args.budget, args.repeats)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    static, cont = rows
    print(
        f"prefill-first / static: {static['steps'] / cont['steps']:.2f}x fewer steps, "
        f"{cont['tok_s'] / static['tok_s']:.2f}x the tokens a second (tiny model, this machine)"
    )
    print(f"wrote {write_csv(rows, args.out)}")
    print(f"wrote {write_csv(per_step, args.out_steps)}")


if __name__ == "__main__":
    main()
