"""Day 30's benchmark: one long prompt prefilled in chunks while other streams decode.

A prompt longer than a step's token budget (`max_num_batched_tokens`) is computed over several
steps, one chunk a step. The script runs one long prompt arriving among streams that are already
decoding, for several budgets, on the engine as of day 30 (`engine_config(30, ...)`: the
"prefill-first" schedule, where a step with prompt work in it holds nothing else, so the streams
wait out every chunk; the gather read of the pool; the model's own linears). A step that mixes
decode rows with a chunk is a later day's (57). Three CSVs:

* `day-30-steps.csv`, the tiny random-weight Llama (nothing to load): 3 streams with 6-token
  prompts from step 0, a 100-token prompt arriving at step 5. Per budget: the long
  prompt's chunks and their sizes, the streams' longest gap between two tokens in steps, their
  stream-steps with no token, the steps from the long prompt's arrival to its first token, and
  whether every request's greedy tokens equal the eager reference's (`generate.greedy_tokens`).
* `day-30-chunked.csv`, SmolLM2-135M-Instruct (fp32): 4 chat streams, a 256-token prompt
  arriving at step 6; the same facts for budgets 32, 64, 128 and 512 (the engine's default, where
  the prompt fits in one step), and the timings: the streams' gaps between tokens (p50, max), the
  long prompt's time from arrival to first token, the whole run. Each run is repeated and each
  step timed at the fastest of its repeats (the schedule is the same every time), which keeps
  most of the noise of a shared machine out.
* `day-30-trace.csv`: every step of those SmolLM2 runs: its decode rows, its chunk tokens, its ms.

Every run is also held to `check_chunks_tile`: each sequence's spans, step after step, must tile
its positions, each starting where the last ended, so no token is skipped or computed twice.

Arrivals are by step number, so which request gets what in which step is the same on every run;
only the times vary.

    python days/day30/chunkbench.py                     # writes the three CSVs next to this file
    python days/day30/chunkbench.py --prompt-len 512 --budgets 64,128,512 --threads 2
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from nanocourse import engine_config, tiny_llama, write_csv
from nanoserve.bench import cpu_line
from nanoserve.engine import Engine
from nanoserve.generate import greedy_tokens
from nanoserve.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
POLICIES = ("prefill-first",)  # the one continuous schedule of day 30
TINY_BUDGETS = (8, 16, 32, 64, 128)
QUESTIONS = ["What is a lighthouse?", "Name three rivers.", "Why is the sky blue?", "What is rain?"]


@dataclass
class Run:
    """What one workload did: per step, which positions of which request it computed and how
    long it took; per request, the step and clock of each token, and the tokens."""

    spans: list[list[tuple[str, int, int, str]]] = field(default_factory=list)  # (id, start, end, kind)
    step_s: list[float] = field(default_factory=list)
    arrived_step: dict[str, int] = field(default_factory=dict)
    arrived_at: dict[str, float] = field(default_factory=dict)
    token_step: dict[str, list[int]] = field(default_factory=dict)
    token_at: dict[str, list[float]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    prompt_len: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    def chunks(self, rid: str) -> list[tuple[int, int, int]]:
        """(step, start, end) of every prompt chunk of rid."""
        return [
            (i, a, b) for i, step in enumerate(self.spans) for r, a, b, k in step if r == rid and k == "chunk"
        ]

    def step_tokens(self) -> list[int]:
        return [sum(b - a for _, a, b, _ in step) for step in self.spans]


def run_workload(engine: Engine, requests: list[tuple[str, list[int], int, int]]) -> Run:
    """requests: (id, prompt ids, max_tokens, arrival step). Steps the engine until every request
    has finished, adding each just before the step numbered its arrival; greedy, EOS ignored."""
    run, sched = Run(), engine.scheduler
    schedule = sched.schedule

    def watched():
        batch = schedule()
        step = [(s.request_id, len(s.token_ids) - 1, len(s.token_ids), "decode") for s in batch.decode]
        step += [(s.request_id, a, b, "chunk") for s, a, b in batch.chunks]
        run.spans.append(step)
        return batch

    sched.schedule = watched
    pending = sorted(requests, key=lambda r: r[3])
    step, t_start = 0, time.perf_counter()
    try:
        while pending or engine.has_unfinished():
            while pending and pending[0][3] <= step:
                rid, ids, n, _ = pending.pop(0)
                engine.add_request(ids, SamplingParams(max_tokens=n, ignore_eos=True), request_id=rid)
                run.arrived_step[rid], run.arrived_at[rid] = step, time.perf_counter()
                run.token_step[rid], run.token_at[rid], run.tokens[rid] = [], [], []
                run.prompt_len[rid] = len(ids)
            t0 = time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            run.step_s.append(now - t0)
            for out in outs:
                run.token_step[out.request_id] += [step] * len(out.new_token_ids)
                run.token_at[out.request_id] += [now] * len(out.new_token_ids)
                run.tokens[out.request_id] += out.new_token_ids
            step += 1
    finally:
        sched.schedule = schedule
    run.wall_s = time.perf_counter() - t_start
    return run


def check_chunks_tile(run: Run) -> None:
    """Each request's spans, in step order, tile its positions: every span starts where the one
    before it ended (the first where the prefix cache left off), and the last ends one short of
    its final length, the newest token being the one never fed back. Fails on a skipped
    position or one computed twice."""
    for rid, n_prompt in run.prompt_len.items():
        spans = [(i, a, b) for i, step in enumerate(run.spans) for r, a, b, _ in step if r == rid]
        for (_, _, end), (i, start, stop) in zip(spans, spans[1:]):
            if start > end:
                raise AssertionError(
                    f"{rid}: step {i} computes positions [{start}, {stop}) but the cache holds only "
                    f"[0, {end}): position {end} is never computed"
                )
            if start < end:
                raise AssertionError(
                    f"{rid}: step {i} computes positions [{start}, {stop}) but [{start}, {end}) are "
                    "already in the cache: computed twice"
                )
        final = n_prompt + len(run.tokens[rid]) - 1
        if spans and spans[-1][2] != final:
            raise AssertionError(f"{rid}: its spans end at {spans[-1][2]}, not at {final}")


def gap_steps(run: Run, streams: list[str]) -> list[int]:
    """Steps between consecutive tokens of every stream (1: a token every step)."""
    return [b - a for r in streams for a, b in zip(run.token_step[r], run.token_step[r][1:])]


def stalls(run: Run, streams: list[str]) -> int:
    """Stream-steps between a stream's first and last token in which it got no token."""
    return sum(g - 1 for g in gap_steps(run, streams))


def sizes(chunks: list[tuple[int, int, int]]) -> str:
    """Chunk sizes, runs folded: [13, 13, 13, 9] -> '13x3+9'."""
    out: list[list[int]] = []
    for _, a, b in chunks:
        if out and out[-1][0] == b - a:
            out[-1][1] += 1
        else:
            out.append([b - a, 1])
    return "+".join(f"{n}x{k}" if k > 1 else f"{n}" for n, k in out)


def engine_for(model, tok, policy: str, budget: int, block_size: int, kv_budget, max_model_len: int):
    """The engine as of day 30 under `policy` ("prefill-first" or "static")."""
    cfg = engine_config(
        30,
        schedule=policy,
        max_batch=8,
        max_model_len=max_model_len,
        block_size=block_size,
        kv_budget=kv_budget,
        max_num_batched_tokens=budget,
    )
    return Engine(model, tok, cfg)


def facts(run: Run, long: str, streams: list[str], same: int, policy: str, budget: int) -> dict:
    chunks = run.chunks(long)
    return {
        "policy": policy,
        "budget": budget,
        "chunks": len(chunks),
        "chunk_sizes": sizes(chunks),
        "max_gap_steps": max(gap_steps(run, streams)),
        "stalls": stalls(run, streams),
        "first_token_steps": run.token_step[long][0] - run.arrived_step[long] + 1,
        "steps": len(run.spans),
        "same_as_eager": same,
        "requests": len(run.tokens),
    }


# --- the tiny model: steps only ---------------------------------------------------------------


def tiny_model():
    return tiny_llama(0, 0.05, 512)


def tiny_prompt(seed: int, n: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def tiny_requests(long_len: int = 100, arrive: int = 5) -> list[tuple[str, list[int], int, int]]:
    """3 streams of 6 prompt tokens and 24 to generate from step 0; the long prompt at `arrive`."""
    streams = [(f"s{i}", tiny_prompt(i, 6), 24, 0) for i in range(3)]
    return streams + [("long", tiny_prompt(99, long_len), 6, arrive)]


def tiny_engine(model, policy: str, budget: int) -> Engine:
    per_block = model.cfg.kv_bytes_per_token(torch.float32) * 4
    return engine_for(model, None, policy, budget, block_size=4, kv_budget=per_block * 256, max_model_len=256)


def step_table(model=None, budgets=TINY_BUDGETS) -> tuple[list[dict], dict]:
    """The tiny workload per policy and budget; returns the rows and the runs by (policy, budget)."""
    model = model or tiny_model()
    reqs = tiny_requests()
    eager = {rid: greedy_tokens(model, ids, n) for rid, ids, n, _ in reqs}
    streams = [r[0] for r in reqs if r[0] != "long"]
    rows, runs = [], {}
    for policy in POLICIES:
        for budget in budgets:
            run = run_workload(tiny_engine(model, policy, budget), reqs)
            check_chunks_tile(run)
            same = sum(run.tokens[r] == eager[r] for r in eager)
            assert same == len(eager), f"{policy} at budget {budget}: tokens differ from the eager path's"
            rows.append(facts(run, "long", streams, same, policy, budget))
            runs[policy, budget] = run
    return rows, runs


# --- SmolLM2: steps and milliseconds ------------------------------------------------------------


def smol_requests(tok, prompt_len: int, stream_tokens: int, arrive: int, long_tokens: int = 8):
    """4 chat streams from step 0, and one long prompt: a chat question after a repeated
    paragraph, cut to exactly prompt_len tokens."""
    reqs = [
        (f"s{i}", tok.encode_chat([{"role": "user", "content": q}]), stream_tokens, 0)
        for i, q in enumerate(QUESTIONS)
    ]
    text = " ".join(
        f"Note {i}: the ferry left at dawn, crossed the bay twice and came back before the fog."
        for i in range(200)
    )
    head = tok.encode_chat([{"role": "user", "content": "Summarise these notes in one line."}])
    reqs.append(("long", tok.encode(text)[: prompt_len - len(head)] + head, long_tokens, arrive))
    return reqs


def timed_gaps(run: Run, step_ms: list[float], streams: list[str], long: str) -> dict:
    """The streams' gaps and the long prompt's wait in ms, from per-step times: a token comes
    out at the end of its step, so a gap is the time of the steps after one token up to the
    next, and the wait runs from the start of the arrival step to the end of the first token's."""
    steps = [(a, b) for r in streams for a, b in zip(run.token_step[r], run.token_step[r][1:])]
    gaps = [sum(step_ms[a + 1 : b + 1]) for a, b in steps]
    first = run.token_step[long][0]
    return {
        "gap_p50_ms": f"{np.percentile(gaps, 50):.1f}",
        "gap_max_ms": f"{max(gaps):.1f}",
        "ttft_ms": f"{sum(step_ms[run.arrived_step[long] : first + 1]):.1f}",
        "run_s": f"{sum(step_ms) / 1000:.2f}",
    }


def smol_table(model, tok, args) -> tuple[list[dict], list[dict]]:
    """Each (policy, budget) run `args.repeats` times, round robin. The schedule is the same
    every time (asserted), so step i of one run is step i of the next, and each step's time is
    the fastest of its repeats: other jobs on the machine can slow a step, never speed it up."""
    reqs = smol_requests(tok, args.prompt_len, args.stream_tokens, args.arrive)
    eager = {rid: greedy_tokens(model, ids, n) for rid, ids, n, _ in reqs}
    streams = [r[0] for r in reqs if r[0] != "long"]
    warm = engine_for(model, tok, "prefill-first", 64, 16, "48MiB", 1024)
    run_workload(warm, [("warm", reqs[-1][1], 2, 0)])  # first-call costs out of the way
    configs = [(policy, budget) for policy in POLICIES for budget in args.budgets]
    repeats: dict[tuple[str, int], list[Run]] = {c: [] for c in configs}
    for _ in range(args.repeats):  # round robin, so a burst of load lands on different configs
        for policy, budget in configs:
            run = run_workload(engine_for(model, tok, policy, budget, 16, "48MiB", 1024), reqs)
            check_chunks_tile(run)
            first = repeats[policy, budget][:1]
            assert not first or (run.spans, run.tokens) == (first[0].spans, first[0].tokens)
            repeats[policy, budget].append(run)
    rows, trace = [], []
    for policy, budget in configs:
        runs = repeats[policy, budget]
        run = runs[0]
        step_ms = [min(r.step_s[i] for r in runs) * 1000 for i in range(len(run.step_s))]
        same = sum(run.tokens[r] == eager[r] for r in eager)
        assert same == len(eager), f"{policy} at budget {budget}: tokens differ from the eager path's"
        row = facts(run, "long", streams, same, policy, budget)
        row.update(timed_gaps(run, step_ms, streams, "long"))
        row["cpu"] = cpu_line()
        rows.append(row)
        print(row, flush=True)
        for i, (step, ms) in enumerate(zip(run.spans, step_ms)):
            trace.append(
                {
                    "policy": policy,
                    "budget": budget,
                    "step": i,
                    "decode_rows": sum(k == "decode" for *_, k in step),
                    "chunk_tokens": sum(b - a for _, a, b, k in step if k == "chunk"),
                    "step_ms": f"{ms:.1f}",
                    "cpu": cpu_line(),
                }
            )
    return rows, trace


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=256, help="the long prompt's tokens (SmolLM2)")
    ap.add_argument("--budgets", default="32,64,128,512", help="max_num_batched_tokens values (SmolLM2)")
    ap.add_argument("--stream-tokens", type=int, default=14)
    ap.add_argument("--arrive", type=int, default=6, help="step the long prompt arrives at")
    ap.add_argument(
        "--repeats", type=int, default=2, help="runs per (policy, budget); steps timed at their fastest"
    )
    ap.add_argument("--skip-smollm", action="store_true", help="only the tiny model's table")
    args = ap.parse_args(argv)
    args.budgets = [int(b) for b in args.budgets.split(",")]
    torch.set_num_threads(args.threads)
    print(cpu_line())
    t0 = time.perf_counter()
    rows, _ = step_table()
    write_csv(rows, HERE / "day-30-steps.csv")
    for row in rows:
        print("  ", row)
    if not args.skip_smollm:
        from nanoserve.models import load_model
        from nanoserve.tokenizer import Tokenizer
        from nanoserve.weights import fetch_default_model

        model_dir = fetch_default_model()
        model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
        rows, trace = smol_table(model, tok, args)
        write_csv(rows, HERE / "day-30-chunked.csv")
        write_csv(trace, HERE / "day-30-trace.csv")
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
