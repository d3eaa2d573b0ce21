"""Day 31's benchmark: who waits, and whether anyone waits for ever.

The scheduler admits from the front of its waiting queue, first come first served, under both
policies the engine of day 31 has ("prefill-first", "static"; `engine_config(31, ...)`, with the
gather read of the pool and the model's own linears). This script measures what that order costs
each request, and what a scheduler that reorders the queue (shortest prompt first) does to the
request it puts last. Four CSVs:

* `day-31-order.csv`, the tiny random-weight Llama: a 64-token prompt and four 6-token ones,
  all arriving before step 0, the long one first in the queue or last; 4 rows, a budget of 16
  tokens. Per order, policy and request: the steps from arrival to its first computed token
  (`queue_steps`) and to its first generated token (`first_token_steps`), and whether its greedy
  tokens equal the eager reference's (`generate.greedy_tokens`).
* `day-31-order-summary.csv`: the same, one line per order and policy: the long prompt's wait,
  the short ones' mean and longest wait, the steps in all.
* `day-31-starve.csv`, the tiny model: two short requests fill both rows, a 40-token prompt
  arrives before step 1, and then a short request every 2 steps, 20 of them. Per scheduler (the
  two policies, and `ShortestFirst` on prefill-first): the long prompt's wait, the step it
  was admitted in against the step the last short one arrived in, how many later arrivals were
  admitted before it, the short ones' longest wait.
* `day-31-ms.csv`, SmolLM2-135M-Instruct (fp32, one thread): the order workload with a
  192-token prompt and four chat questions, budget 64, 4 rows; per order, policy and request the
  waits in steps and in ms. Each run is repeated and each step timed at the fastest of its
  repeats (the schedule is the same every time).

Arrivals are by step number, so which request gets what in which step is the same on every run.

    python days/day31/fairbench.py                # writes the four CSVs next to this file
    python days/day31/fairbench.py --skip-smollm  # the tiny model's tables only, in seconds
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanocourse import engine_config, tiny_llama, write_csv
from nanoserve.bench import cpu_line
from nanoserve.engine import Engine
from nanoserve.generate import greedy_tokens
from nanoserve.sampling import SamplingParams
from nanoserve.scheduler import Scheduler

HERE = Path(__file__).resolve().parent
POLICIES = ("prefill-first", "static")
QUESTIONS = ["What is a lighthouse?", "Name three rivers.", "Why is the sky blue?", "What is rain?"]


@dataclass
class Run:
    """Per step, which requests it computed and how long it took; per request, its arrival, the
    step it was first computed in, the step and tokens it generated."""

    steps: list[list[str]] = field(default_factory=list)  # request ids computed in each step
    step_s: list[float] = field(default_factory=list)
    arrived: dict[str, int] = field(default_factory=dict)
    admitted: dict[str, int] = field(default_factory=dict)
    token_step: dict[str, list[int]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)

    def queue_steps(self, rid: str) -> int:
        """Steps from arrival until its first token was computed: 0 if admitted at once."""
        return self.admitted[rid] - self.arrived[rid]

    def first_token_steps(self, rid: str) -> int:
        """Steps from arrival to its first generated token, that step included."""
        return self.token_step[rid][0] - self.arrived[rid] + 1


def run_workload(engine: Engine, requests: list[tuple]) -> Run:
    """requests: (id, prompt ids, max_tokens, arrival step), queued in list order within a step,
    each with an optional fifth field, its priority (for an engine with `scheduling_policy`
    "priority"). Steps the engine until every request has finished; greedy, EOS ignored."""
    run, sched = Run(), engine.scheduler
    schedule = sched.schedule

    def watched():
        batch = schedule()
        ids = [s.request_id for s in batch.seqs]
        for rid in ids:
            run.admitted.setdefault(rid, len(run.steps))
        run.steps.append(ids)
        return batch

    sched.schedule = watched
    pending = sorted(enumerate(requests), key=lambda r: (r[1][3], r[0]))
    step = 0
    try:
        while pending or engine.has_unfinished():
            while pending and pending[0][1][3] <= step:
                rid, ids, n, _, *priority = pending.pop(0)[1]
                params = SamplingParams(max_tokens=n, ignore_eos=True, priority=(priority or [0])[0])
                engine.add_request(ids, params, request_id=rid)
                run.arrived[rid], run.token_step[rid], run.tokens[rid] = step, [], []
            t0 = time.perf_counter()
            outs = engine.step()
            run.step_s.append(time.perf_counter() - t0)
            for out in outs:
                run.token_step[out.request_id] += [step] * len(out.new_token_ids)
                run.tokens[out.request_id] += out.new_token_ids
            step += 1
    finally:
        sched.schedule = schedule
    return run


class ShortestFirst(Scheduler):
    """Admission by prompt length, shortest first: the queue is sorted before every prompt pass.
    It minimises the mean wait, and it never admits a long prompt while a shorter one waits."""

    def _schedule_prefill(self, budget=None, batch=None, admit=True):
        self.waiting = deque(sorted(self.waiting, key=lambda s: len(s.token_ids)))
        return super()._schedule_prefill(budget, batch, admit)


def overtaken(run: Run, rid: str) -> int:
    """How many requests that arrived after rid were admitted before it."""
    return sum(
        1
        for other, at in run.arrived.items()
        if (at, list(run.arrived).index(other)) > (run.arrived[rid], list(run.arrived).index(rid))
        and run.admitted[other] < run.admitted[rid]
    )


def check_bounded_bypass(run: Run, most: int = 0) -> None:
    """No request is overtaken by more than `most` later arrivals. First come first served is
    most=0; a starved request is overtaken by every arrival for as long as arrivals continue."""
    worst = max(run.arrived, key=lambda r: overtaken(run, r))
    if overtaken(run, worst) > most:
        raise AssertionError(
            f"{worst} arrived before step {run.arrived[worst]} and waited {run.queue_steps(worst)} "
            f"steps while {overtaken(run, worst)} later arrivals were admitted ahead of it"
        )


def engine_for(
    model, tok, policy: str, budget: int, max_batch: int, block_size: int, kv_budget, max_len: int, **kw
):
    """The engine as of day 31 under `policy` (`kw`: more of its config)."""
    cfg = engine_config(
        31,
        **kw,
        schedule=policy,
        max_batch=max_batch,
        max_model_len=max_len,
        block_size=block_size,
        kv_budget=kv_budget,
        max_num_batched_tokens=budget,
    )
    return Engine(model, tok, cfg)


# --- the tiny model ---------------------------------------------------------------------------


def tiny_model():
    return tiny_llama(0, 0.05, 512)


def tiny_prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), generator=g).tolist()


def tiny_engine(
    model, policy: str, max_batch: int = 4, budget: int = 16, scheduler=Scheduler, blocks: int = 256, **kw
) -> Engine:
    """The tiny model's engine as of day 31: `blocks` KV blocks of 4 tokens; `kw` more of
    `engine_config` (scheduling_policy="priority" for section 7)."""
    per_block = model.cfg.kv_bytes_per_token(torch.float32) * 4
    engine = engine_for(model, None, policy, budget, max_batch, 4, per_block * blocks, 256, **kw)
    engine.scheduler.__class__ = scheduler
    return engine


def order_requests(long_first: bool, long_len: int = 64):
    """A long prompt (4 tokens to generate) and four short ones (8 each), all before step 0."""
    long = [("long", tiny_prompt(99, long_len), 4, 0)]
    short = [(f"s{i}", tiny_prompt(i, 6), 8, 0) for i in range(4)]
    return long + short if long_first else short + long


def starve_requests(arrivals: int = 20, every: int = 2):
    """Two short requests fill both rows at step 0, the long prompt arrives before step 1, then a
    short request every `every` steps from step 2."""
    reqs = [
        ("s0", tiny_prompt(0, 6), 6, 0),
        ("s1", tiny_prompt(1, 6), 6, 0),
        ("long", tiny_prompt(99, 40), 4, 1),
    ]
    reqs += [(f"t{i:02d}", tiny_prompt(10 + i, 6), 6, 2 + every * i) for i in range(arrivals)]
    return reqs


def per_request(run: Run, order: str, policy: str, eager: dict, prompts: dict) -> list[dict]:
    return [
        {
            "order": order,
            "policy": policy,
            "request": rid,
            "queue_position": i,
            "prompt_tokens": prompts[rid],
            "queue_steps": run.queue_steps(rid),
            "first_token_steps": run.first_token_steps(rid),
            "same_as_eager": run.tokens[rid] == eager[rid],
        }
        for i, rid in enumerate(run.arrived)
    ]


def summary(rows: list[dict]) -> dict:
    short = [r["first_token_steps"] for r in rows if r["request"] != "long"]
    long = next(r for r in rows if r["request"] == "long")
    return {
        "order": rows[0]["order"],
        "policy": rows[0]["policy"],
        "long_first_token_steps": long["first_token_steps"],
        "short_mean_first_token_steps": f"{sum(short) / len(short):.2f}",
        "short_max_first_token_steps": max(short),
        "all_same_as_eager": all(r["same_as_eager"] for r in rows),
    }


def order_table(model=None) -> tuple[list[dict], list[dict], dict]:
    """Both orders under both policies, tokens held to the eager loop's."""
    model = model or tiny_model()
    rows, sums, runs = [], [], {}
    for long_first in (True, False):
        reqs = order_requests(long_first)
        eager = {rid: greedy_tokens(model, ids, n) for rid, ids, n, _ in reqs}
        prompts = {rid: len(ids) for rid, ids, _, _ in reqs}
        order = "long first" if long_first else "long last"
        for policy in POLICIES:
            run = run_workload(tiny_engine(model, policy), reqs)
            check_bounded_bypass(run)
            mine = per_request(run, order, policy, eager, prompts)
            assert all(r["same_as_eager"] for r in mine), f"{order}, {policy}: tokens differ"
            rows += mine
            sums.append(summary(mine) | {"steps": len(run.steps)})
            runs[order, policy] = run
    return rows, sums, runs


def starve_table(model=None) -> tuple[list[dict], dict]:
    model = model or tiny_model()
    reqs = starve_requests()
    eager = {rid: greedy_tokens(model, ids, n) for rid, ids, n, _ in reqs}
    last_arrival = max(r[3] for r in reqs)
    rows, runs = [], {}
    variants = [(p, Scheduler) for p in POLICIES] + [("prefill-first", ShortestFirst)]
    for policy, scheduler in variants:
        run = run_workload(tiny_engine(model, policy, max_batch=2, scheduler=scheduler), reqs)
        assert all(run.tokens[r] == eager[r] for r in eager), f"{scheduler.__name__}: tokens differ"
        name = policy if scheduler is Scheduler else f"{policy}, {scheduler.__name__}"
        rows.append(
            {
                "scheduler": name,
                "long_queue_steps": run.queue_steps("long"),
                "long_admitted_step": run.admitted["long"],
                "last_arrival_step": last_arrival,
                "long_overtaken_by": overtaken(run, "long"),
                "short_max_queue_steps": max(run.queue_steps(r) for r in run.arrived if r != "long"),
                "steps": len(run.steps),
                "same_as_eager": sum(run.tokens[r] == eager[r] for r in eager),
                "requests": len(eager),
            }
        )
        runs[name] = run
    return rows, runs


# --- SmolLM2: steps and milliseconds ------------------------------------------------------------


def smol_requests(tok, long_first: bool, long_len: int = 192):
    text = " ".join(
        f"Entry {i}: the bridge opened at noon, two barges passed and the traffic waited." for i in range(120)
    )
    head = tok.encode_chat([{"role": "user", "content": "Summarise this log in one line."}])
    long = [("long", tok.encode(text)[: long_len - len(head)] + head, 4, 0)]
    short = [
        (f"s{i}", tok.encode_chat([{"role": "user", "content": q}]), 8, 0) for i, q in enumerate(QUESTIONS)
    ]
    return long + short if long_first else short + long


def smol_table(model, tok, repeats: int) -> list[dict]:
    rows = []
    configs = [(lf, p) for lf in (True, False) for p in POLICIES]
    reqs = {lf: smol_requests(tok, lf) for lf in (True, False)}
    eager = {rid: greedy_tokens(model, ids, n) for rid, ids, n, _ in reqs[True]}
    prompts = {rid: len(ids) for rid, ids, _, _ in reqs[True]}
    engine_for(model, tok, "prefill-first", 64, 4, 16, "32MiB", 512).generate([[1, 2, 3]], use_tqdm=False)
    done: dict = {c: [] for c in configs}
    for _ in range(repeats):  # round robin, so a burst of load lands on different configs
        for long_first, policy in configs:
            run = run_workload(engine_for(model, tok, policy, 64, 4, 16, "32MiB", 512), reqs[long_first])
            check_bounded_bypass(run)
            first = done[long_first, policy][:1]
            assert not first or (run.steps, run.tokens) == (first[0].steps, first[0].tokens)
            done[long_first, policy].append(run)
    for long_first, policy in configs:
        runs = done[long_first, policy]
        run = runs[0]
        step_ms = [min(r.step_s[i] for r in runs) * 1000 for i in range(len(run.step_s))]
        order = "long first" if long_first else "long last"
        for row in per_request(run, order, policy, eager, prompts):
            rid = row["request"]
            assert row["same_as_eager"], f"{order}, {policy}: {rid}'s tokens differ"
            row["queue_ms"] = f"{sum(step_ms[run.arrived[rid] : run.admitted[rid]]):.1f}"
            row["first_token_ms"] = f"{sum(step_ms[run.arrived[rid] : run.token_step[rid][0] + 1]):.1f}"
            row["cpu"] = cpu_line()
            rows.append(row)
            print(row, flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--repeats", type=int, default=2, help="SmolLM2 runs per config; steps timed at their fastest"
    )
    ap.add_argument("--skip-smollm", action="store_true", help="only the tiny model's tables")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    t0 = time.perf_counter()
    rows, sums, _ = order_table()
    write_csv(rows, HERE / "day-31-order.csv")
    write_csv(sums, HERE / "day-31-order-summary.csv")
    starve, _ = starve_table()
    write_csv(starve, HERE / "day-31-starve.csv")
    for row in sums + starve:
        print("  ", row)
    if not args.skip_smollm:
        from nanoserve.models import load_model
        from nanoserve.tokenizer import Tokenizer
        from nanoserve.weights import fetch_default_model

        model_dir = fetch_default_model()
        model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
        write_csv(smol_table(model, tok, args.repeats), HERE / "day-31-ms.csv")
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
