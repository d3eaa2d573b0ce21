"""Day 34: the engine's API driven by hand, and the offline loop against the plain greedy loop.

Two tables, both on the tiny random-weight Llama (`nanocourse.tiny_llama`), greedy, one thread:

* `day-34-steps.csv`: one row per `Engine.step()` of a small hand-driven run. Three requests
  of different lengths are queued at once, a fourth is added after step 2 and aborted after
  step 5. Per step: what `step()` returned (the requests it named, the tokens it handed out,
  the finish reasons), then what the engine holds after it (waiting, running, KV blocks used).
* `day-34-engine.csv`: `--requests` random prompts run two ways, through `Engine.generate`
  (all queued, batched over paged rows, continuous batching) and one after the other through
  `generate.greedy_tokens` (one sequence, contiguous cache: the loop of days 8-11). Per way:
  requests, tokens, model steps (forward passes), whether every request's tokens equal the
  plain loop's, and this machine's time, the faster of `--repeats` runs taken in turn.

    python days/day34/engineapi.py                          # both CSVs next to this file
    python days/day34/engineapi.py --requests 64 --rows 16 --repeats 3
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
from nanoserve.generate import greedy_tokens
from nanoserve.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
CSV_STEPS = HERE / "day-34-steps.csv"
CSV_ENGINE = HERE / "day-34-engine.csv"
BLOCK = 4  # tokens a KV block: small, so the blocks a request holds change as it grows
# the hand-driven run: (prompt, max_tokens) queued before step 0
HAND = [([1, 2, 3, 4, 5], 3), ([9, 8, 7], 6), ([40, 41, 42, 43, 44, 45, 46, 47, 48], 4)]
LATE = ([100, 101, 102, 103, 104, 105], 20)  # added after step ADD_AT, aborted after step ABORT_AT
ADD_AT, ABORT_AT = 2, 4


def make_engine(model, rows: int = 4, blocks: int = 64, max_model_len: int = 128) -> Engine:
    """The engine of day 34 (prefill-first steps, the gather read, the model's own linears, the
    ops decode step): a paged KV pool of `blocks` blocks, `rows` sequences at once."""
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * BLOCK
    config = engine_config(
        34,
        max_batch=rows,
        block_size=BLOCK,
        kv_budget=blocks * per_block + per_block // BLOCK,  # + the sink slot
        max_model_len=max_model_len,
    )
    return Engine(model, None, config)


def hand_run(engine: Engine) -> tuple[list[dict], dict[str, list[int]], dict[str, str]]:
    """Drive `HAND` (and `LATE`) step by step. Returns one dict per step, each request's
    tokens and each request's finish reason (as `step()` reported it, or "abort")."""
    ids = {engine.add_request(p, SamplingParams(max_tokens=n)): i for i, (p, n) in enumerate(HAND)}
    tokens = {rid: [] for rid in ids}
    finish: dict[str, str] = {}
    late, rows, t = None, [], 0
    while engine.has_unfinished():
        event = ""
        if t == ADD_AT:
            late = engine.add_request(LATE[0], SamplingParams(max_tokens=LATE[1]), request_id="late")
            tokens[late], event = [], "add late"
        outs = engine.step()
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                finish[o.request_id] = o.finish_reason
        row = {
            "step": t,
            "event": event,
            "outputs": " ".join(o.request_id for o in outs),
            "new_tokens": " ".join(",".join(map(str, o.new_token_ids)) for o in outs),
            "finished": " ".join(f"{o.request_id}:{o.finish_reason}" for o in outs if o.finished),
        }
        if t == ABORT_AT:
            before = engine.allocator.num_used
            assert engine.abort(late) and not engine.abort(late)  # known once, unknown after
            finish[late] = "abort"
            row["event"] = f"abort late (blocks {before} -> {engine.allocator.num_used})"
        row |= {
            "waiting": len(engine.scheduler.waiting),
            "running": len(engine.scheduler.running),
            "blocks_used": engine.allocator.num_used,
        }
        rows.append(row)
        t += 1
    return rows, tokens, finish


def workload(n: int, vocab: int, seed: int = 0, prompt=(4, 48), new=(4, 32)):
    rng = random.Random(seed)
    return [
        ([rng.randrange(vocab) for _ in range(rng.randint(*prompt))], rng.randint(*new)) for _ in range(n)
    ]


def engine_table(model, reqs, rows: int, repeats: int = 2) -> list[dict]:
    """`Engine.generate` against `greedy_tokens` one request at a time, on the same requests."""
    best: dict[str, float] = {}
    got: dict[str, list[list[int]]] = {}
    steps: dict[str, int] = {}
    for _ in range(repeats):
        engine = make_engine(model, rows, blocks=rows * (128 // BLOCK + 1))
        t0 = time.perf_counter()
        outs = engine.generate(
            [p for p, _ in reqs], [SamplingParams(max_tokens=n) for _, n in reqs], use_tqdm=False
        )
        best["engine.generate"] = min(best.get("engine.generate", 1e9), time.perf_counter() - t0)
        got["engine.generate"] = [o.token_ids for o in outs]
        steps["engine.generate"] = sum(engine.step_kinds.values())
        t0 = time.perf_counter()
        with torch.inference_mode():
            plain = [greedy_tokens(model, p, n) for p, n in reqs]
        best["greedy_tokens"] = min(best.get("greedy_tokens", 1e9), time.perf_counter() - t0)
        got["greedy_tokens"] = plain
        steps["greedy_tokens"] = sum(len(t) for t in plain)  # one forward pass per token
    table = []
    for way in ("greedy_tokens", "engine.generate"):
        tokens = sum(len(t) for t in got[way])
        table.append(
            {
                "way": way,
                "requests": len(reqs),
                "rows": 1 if way == "greedy_tokens" else rows,
                "tokens": tokens,
                "forward_passes": steps[way],
                "same_as_greedy": sum(a == b for a, b in zip(got[way], got["greedy_tokens"])),
                "seconds": round(best[way], 3),
                "tok_s": round(tokens / best[way], 1),
                "cpu": cpu_line(),
            }
        )
    return table


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rows", type=int, default=8, help="max_batch of the engine")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-steps", default=str(CSV_STEPS))
    p.add_argument("--out", default=str(CSV_ENGINE))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(cpu_line())
    model = tiny_llama(0)
    steps, _, _ = hand_run(make_engine(model))
    for r in steps:
        print(r)
    print(f"wrote {write_csv(steps, args.out_steps)}")
    table = engine_table(
        model, workload(args.requests, model.cfg.vocab_size, args.seed), args.rows, args.repeats
    )
    for r in table:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    assert all(r["same_as_greedy"] == args.requests for r in table)
    print(f"wrote {write_csv(table, args.out)}")


if __name__ == "__main__":
    main()
