"""Day 26: the scheduler's three states, traced step by step on a small staggered workload.

Every request is in exactly one of three places at any moment: the waiting queue
(`Scheduler.waiting`), the running set (`Scheduler.running`) or finished (it has a
`finish_reason` and is in neither). `run_trace` steps an engine over a scripted workload
(requests added just before the step numbered their arrival) and records, for every step and
every request, where it is and what the step gave it:

    -  not arrived yet            W  waiting in the queue
    P  a prompt chunk this step   D  a decode row this step
    r  running, nothing this step (a prefill step under prefill-first)
    F  finished (from the step after its last token)

After every step it asserts the three invariants of the day: each arrived request is in
exactly one state; the blocks the allocator counts as used are exactly the blocks the running
sequences' tables hold (`check_invariants` too); and at the end every request has finished with
all its tokens. Two CSVs:

* `day-26-steps.csv`: per step, how many requests wait, run a chunk, decode or sit out, how
  many have finished by its end; the step's tokens; blocks used after it.
* `day-26-requests.csv`: per request, its arrival, the step it was admitted, its first and last
  token's step, steps spent waiting and running.

The engine is the one of today, `engine_config(26)`: the prefill-first schedule this day
builds, attention by gather, plain linears; the model
the tiny random-weight Llama, so the run takes seconds. Arrivals are step numbers, so every
count here is the same on every run.

    python days/day26/schedtrace.py                     # writes both CSVs next to this file
    python days/day26/schedtrace.py --requests 40 --max-batch 8 --out-dir /tmp/d26
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanocourse import engine_config, tiny_llama, write_csv
from nanoserve.engine import Engine
from nanoserve.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
BLOCK = 4
STATES = "-WPDrF"  # the order the trace's letters are listed in


def workload(n: int = 12, seed: int = 26, prompt=(4, 40), new=(3, 16), every: int = 2, vocab: int = 256):
    """n (request id, prompt ids, max_tokens, arrival step): one request every `every` steps
    on average, in seeded bursts (arrival gaps of 0 to 2 * every steps)."""
    rng = random.Random(seed)
    reqs, t = [], 0
    for i in range(n):
        ids = [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt))]
        reqs.append((f"r{i:02d}", ids, rng.randint(*new), t))
        t += rng.randint(0, 2 * every)
    return reqs


def engine_for(model, max_batch: int = 4, budget: int = 32, blocks: int = 256, **kw) -> Engine:
    """The engine as of day 26 on a pool of `blocks` blocks of 4 tokens (roomy unless told)."""
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * BLOCK
    cfg = dict(
        max_batch=max_batch,
        max_model_len=128,
        block_size=BLOCK,
        kv_budget=per_block * blocks,
        max_num_batched_tokens=budget,
    )
    cfg.update(kw)
    # today's schedule "prefill-first", attention "gather", linear "plain", no watermark yet
    return Engine(model, None, engine_config(26, **cfg))


@dataclass
class Trace:
    """What the run did. states[i][rid]: the request's letter in step i (see the module doc)."""

    states: list[dict[str, str]] = field(default_factory=list)
    chunks: list[dict[str, tuple[int, int]]] = field(default_factory=list)  # step -> rid -> (start, end)
    tokens: list[int] = field(default_factory=list)  # tokens each step carried
    blocks_used: list[int] = field(default_factory=list)  # the allocator's count, after each step
    table_blocks: list[int] = field(default_factory=list)  # blocks the running tables hold, after each step
    outputs: dict[str, list[int]] = field(default_factory=dict)  # rid -> tokens, as streamed
    finished_at: dict[str, int] = field(default_factory=dict)  # rid -> step of its last token


def check_states(engine: Engine, seqs: dict) -> None:
    """Each arrived request is in exactly one of waiting, running, finished."""
    sched = engine.scheduler
    for rid, seq in seqs.items():
        places = [seq in sched.waiting, seq in sched.running, seq.finished]
        if sum(places) != 1:
            where = [n for n, p in zip(("waiting", "running", "finished"), places) if p] or ["nowhere"]
            raise AssertionError(f"{rid} is {' and '.join(where)}")


def check_blocks(engine: Engine) -> None:
    """The allocator's used blocks are exactly the running tables' blocks."""
    tables = [s.block_table for s in engine.scheduler.running]
    engine.allocator.check_invariants(tables)
    held = set().union(*(t.blocks for t in tables)) if tables else set()
    if engine.allocator.num_used != len(held):
        raise AssertionError(f"{engine.allocator.num_used} blocks used, the running tables hold {len(held)}")


def run_trace(engine: Engine, requests, check: bool = True) -> Trace:
    """Step engine over requests (id, prompt ids, max_tokens, arrival step), greedy with EOS
    ignored, recording every step's states; with `check`, the invariants after every step."""
    trace, sched, seqs = Trace(), engine.scheduler, {}
    schedule, batches = sched.schedule, []

    def watched():
        batches.append(schedule())
        return batches[-1]

    sched.schedule = watched  # the engine's own choice, seen on its way to the runner
    pending = sorted(requests, key=lambda r: r[3])
    step = 0
    try:
        while pending or engine.has_unfinished():
            while pending and pending[0][3] <= step:
                rid, ids, n, _ = pending.pop(0)
                engine.add_request(ids, SamplingParams(max_tokens=n, ignore_eos=True), request_id=rid)
                seqs[rid] = engine.requests[rid].seq
                trace.outputs[rid] = []
            outs = engine.step()
            batch = batches[-1]
            chunks = {s.request_id: (a, b) for s, a, b in batch.chunks}
            decode = {s.request_id for s in batch.decode}
            row = {}
            for rid, *_ in requests:
                if rid not in seqs:
                    row[rid] = "-"
                elif rid in chunks:
                    row[rid] = "P"
                elif rid in decode:
                    row[rid] = "D"
                elif rid in trace.finished_at:
                    row[rid] = "F"
                elif seqs[rid] in sched.running:
                    row[rid] = "r"
                else:
                    row[rid] = "W"  # still queued after this step's admissions
            for out in outs:
                trace.outputs[out.request_id] += out.new_token_ids
                if out.finished:
                    trace.finished_at[out.request_id] = step
            trace.states.append(row)
            trace.chunks.append(chunks)
            trace.tokens.append(len(batch.decode) + sum(b - a for a, b in chunks.values()))
            trace.blocks_used.append(engine.allocator.num_used)
            trace.table_blocks.append(len(set().union(*(s.block_table.blocks for s in sched.running))))
            if check:
                check_states(engine, seqs)
                check_blocks(engine)
            step += 1
    finally:
        sched.schedule = schedule
    if check:
        for rid, _, n, _ in requests:
            if len(trace.outputs[rid]) != n or not seqs[rid].finished:
                raise AssertionError(f"{rid} ended with {len(trace.outputs[rid])} of its {n} tokens")
    return trace


def step_rows(trace: Trace) -> list[dict]:
    rows = []
    for i, states in enumerate(trace.states):
        count = {c: sum(v == c for v in states.values()) for c in STATES}
        rows.append(
            {
                "step": i,
                "waiting": count["W"],
                "prefill": count["P"],
                "decode": count["D"],
                "idle": count["r"],
                "finished": sum(last <= i for last in trace.finished_at.values()),
                "tokens": trace.tokens[i],
                "blocks_used": trace.blocks_used[i],
            }
        )
    return rows


def request_rows(trace: Trace, requests) -> list[dict]:
    rows = []
    for rid, ids, n, arrive in requests:
        run = [i for i, s in enumerate(trace.states) if s[rid] in "PDr"]
        rows.append(
            {
                "request": rid,
                "prompt": len(ids),
                "max_tokens": n,
                "arrival": arrive,
                "admitted": run[0],
                "last_token": trace.finished_at[rid],
                "waited": sum(s[rid] == "W" for s in trace.states),
                "chunk_steps": sum(s[rid] == "P" for s in trace.states),
                "decode_steps": sum(s[rid] == "D" for s in trace.states),
                "idle_steps": sum(s[rid] == "r" for s in trace.states),
            }
        )
    return rows


def grid(trace: Trace, requests) -> list[str]:
    """The trace as text: a line per request, a letter per step."""
    n = len(trace.states)
    lines = ["      " + "".join(str(i // 10) if i % 10 == 0 else " " for i in range(n))]
    lines.append("      " + "".join(str(i % 10) for i in range(n)))
    for rid, *_ in requests:
        lines.append(f"{rid:>5} " + "".join(s[rid] for s in trace.states))
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-batch", type=int, default=4, help="rows: sequences running at once")
    ap.add_argument("--budget", type=int, default=32, help="max_num_batched_tokens")
    ap.add_argument("--blocks", type=int, default=256, help="KV pool blocks of 4 tokens")
    ap.add_argument("--every", type=int, default=2, help="mean steps between arrivals")
    ap.add_argument("--seed", type=int, default=26)
    ap.add_argument("--out-dir", default=str(HERE))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = tiny_llama(0, 0.05, 512)
    reqs = workload(args.requests, args.seed, every=args.every)
    engine = engine_for(model, args.max_batch, args.budget, args.blocks)
    trace = run_trace(engine, reqs)
    print("\n".join(grid(trace, reqs)))
    sched = engine.scheduler
    print(f"{len(trace.states)} steps, step_kinds {engine.step_kinds}, preemptions {sched.num_preemptions}")
    out = Path(args.out_dir)
    write_csv(step_rows(trace), out / "day-26-steps.csv")
    write_csv(request_rows(trace, reqs), out / "day-26-requests.csv")


if __name__ == "__main__":
    main()
