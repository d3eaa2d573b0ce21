"""Day 57's benchmark: running streams while long prompts arrive, per scheduling policy.

Two CSVs, both on the default model (SmolLM2-135M-Instruct, fp32):

* `day-57-mixed.csv`: `--streams` short chat prompts start decoding at step 0; `--newcomers`
  long prompts (`--prompt-len` tokens, longer than the step budget `--budget`) arrive at fixed
  step numbers. Per policy ("budget", the default, and "prefill-first", the earlier one): the
  steps of each kind, the steps in which a stream already decoding got no token (`stalls`), the
  most tokens any step carried, whether every request's greedy tokens equal the eager
  reference's (`generate.greedy_tokens`), and the timings: the streams' inter-token gap p50 /
  p99 / max, the newcomers' mean time to first token, all tokens over the run's wall time.
* `day-57-profile.csv`: `torch.profiler` over one pure decode step and one mixed step at 16
  rows (the mixed one with a prompt chunk filling the rest of the budget): the top ops by self
  CPU time.

Arrivals are by step number, not by clock, so which request gets a token in which step is the
same on every run; only the timings vary.

    python days/day57/mixedbench.py                  # writes both CSVs next to this file
    python days/day57/mixedbench.py --budget 512 --prompt-len 1200 --threads 2
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from nanocourse import cpu_profile, engine_config, write_csv
from nanoserve.bench import cpu_line
from nanoserve.engine import Engine
from nanoserve.generate import greedy_tokens
from nanoserve.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
POLICIES = ("budget", "prefill-first")
QUESTIONS = [
    "What is a lighthouse?",
    "Name three rivers.",
    "Why is the sky blue?",
    "How do bees make honey?",
    "What is rain?",
    "Say something kind.",
]


@dataclass
class Run:
    """What one workload did: per step, who got what and how long it took; per request, when
    each token came out and which tokens."""

    timeline: list[dict[str, str]] = field(default_factory=list)  # step -> {request: decode|chunk}
    step_tokens: list[int] = field(default_factory=list)  # tokens each step carried
    step_s: list[float] = field(default_factory=list)
    arrived: dict[str, float] = field(default_factory=dict)  # request -> clock at add_request
    token_at: dict[str, list[float]] = field(default_factory=dict)  # request -> clock per token
    token_step: dict[str, list[int]] = field(default_factory=dict)  # request -> step per token
    tokens: dict[str, list[int]] = field(default_factory=dict)
    wall_s: float = 0.0


def run_workload(engine: Engine, requests: list[tuple[str, list[int], int, int]]) -> Run:
    """requests: (id, prompt ids, max_tokens, arrival step). Steps the engine until all finish,
    adding each request just before the step numbered its arrival; greedy, EOS ignored."""
    run, sched = Run(), engine.scheduler
    schedule = sched.schedule

    def watched():
        batch = schedule()
        kinds = {s.request_id: "decode" for s in batch.decode}
        kinds.update({s.request_id: "chunk" for s, _, _ in batch.chunks})
        if kinds:
            run.timeline.append(kinds)
            run.step_tokens.append(len(batch.decode) + sum(e - b for _, b, e in batch.chunks))
        return batch

    sched.schedule = watched
    pending = sorted(requests, key=lambda r: r[3])
    step, t_start = 0, time.perf_counter()
    try:
        while pending or engine.has_unfinished():
            while pending and pending[0][3] <= step:
                rid, ids, n, _ = pending.pop(0)
                engine.add_request(ids, SamplingParams(max_tokens=n, ignore_eos=True), request_id=rid)
                run.arrived[rid] = time.perf_counter()
                run.token_at[rid], run.token_step[rid], run.tokens[rid] = [], [], []
            t0 = time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            if outs or engine.has_unfinished():
                run.step_s.append(now - t0)
            for out in outs:
                run.token_at[out.request_id] += [now] * len(out.new_token_ids)
                run.token_step[out.request_id] += [len(run.timeline) - 1] * len(out.new_token_ids)
                run.tokens[out.request_id] += out.new_token_ids
            step += 1
    finally:
        sched.schedule = schedule
    run.wall_s = time.perf_counter() - t_start
    return run


def stalls(run: Run, streams: list[str]) -> int:
    """Steps in which a stream that had started decoding and was not done got no token."""
    count = 0
    for rid in streams:
        steps = [i for i, kinds in enumerate(run.timeline) if kinds.get(rid) == "decode"]
        if steps:
            count += sum(1 for i in range(steps[0], steps[-1]) if rid not in run.timeline[i])
    return count


def gaps_ms(run: Run, streams: list[str]) -> np.ndarray:
    """Every stream's time between consecutive tokens, in ms."""
    return np.concatenate([np.diff(run.token_at[r]) * 1000 for r in streams])


def workload(
    tok, streams: int, newcomers: int, prompt_len: int, stream_tokens: int, first_at: int, every: int
):
    """The streams' chat prompts and the newcomers' long prompts (a chat prompt padded with a
    repeated paragraph to exactly prompt_len tokens), with arrival steps."""
    text = " ".join(
        f"Paragraph {i}: the keeper climbed the stairs, trimmed the wick and watched the ships."
        for i in range(200)
    )
    filler = tok.encode(text)
    reqs = []
    for i in range(streams):
        reqs.append((f"s{i}", tok.encode_chat([{"role": "user", "content": QUESTIONS[i]}]), stream_tokens, 0))
    for j in range(newcomers):
        head = tok.encode_chat([{"role": "user", "content": f"Summarise document {j}:"}])
        ids = (filler[j * 7 :] + filler)[: prompt_len - len(head)] + head
        reqs.append((f"n{j}", ids, 8, first_at + j * every))
    return reqs


def engine_for(model, tok, policy: str, budget: int, max_batch=8, max_model_len=1024) -> Engine:
    cfg = engine_config(  # the engine as of day 57: gather attention, plain linears
        57,
        schedule=policy,
        max_batch=max_batch,
        max_model_len=max_model_len,
        kv_budget="96MiB",
        max_num_batched_tokens=budget,
    )
    return Engine(model, tok, cfg)


def mixed_table(model, tok, args) -> list[dict]:
    reqs = workload(
        tok, args.streams, args.newcomers, args.prompt_len, args.stream_tokens, args.first_at, args.every
    )
    eager = {rid: greedy_tokens(model, ids, n) for rid, ids, n, _ in reqs}
    streams = [r[0] for r in reqs if r[0].startswith("s")]
    news = [r[0] for r in reqs if r[0].startswith("n")]
    rows = []
    for policy in POLICIES:
        warm = engine_for(model, tok, policy, args.budget)  # first-call costs out of the way
        run_workload(warm, [("w", reqs[0][1], 4, 0)])
        eng = engine_for(model, tok, policy, args.budget)
        run = run_workload(eng, reqs)
        gaps = gaps_ms(run, streams)
        ttft = [(run.token_at[r][0] - run.arrived[r]) * 1000 for r in news]
        n_tokens = sum(len(t) for t in run.tokens.values())
        rows.append(
            {
                "policy": policy,
                "steps": len(run.timeline),
                "prefill_steps": eng.step_kinds["prefill"],
                "decode_steps": eng.step_kinds["decode"],
                "mixed_steps": eng.step_kinds["mixed"],
                "stalls": stalls(run, streams),
                "max_step_tokens": max(run.step_tokens),
                "same_as_eager": sum(run.tokens[r] == eager[r] for r in eager),
                "requests": len(eager),
                "gap_p50_ms": f"{np.percentile(gaps, 50):.1f}",
                "gap_p99_ms": f"{np.percentile(gaps, 99):.1f}",
                "gap_max_ms": f"{gaps.max():.1f}",
                "ttft_ms": f"{np.mean(ttft):.1f}",
                "tok_s": f"{n_tokens / run.wall_s:.2f}",
                "cpu": cpu_line(),
            }
        )
        print(rows[-1], flush=True)
    return rows


def profile_table(model, tok, rows=16, budget=128, top=6) -> list[dict]:
    """One pure decode step and one mixed step of `rows` decode rows (plus a prompt chunk of
    budget - rows tokens), each under torch.profiler; the top ops by self CPU time."""
    eng = engine_for(model, tok, "budget", budget, max_batch=rows + 1)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for i in range(rows):
        eng.add_request(tok.encode_chat([{"role": "user", "content": QUESTIONS[i % 6] + " " * i}]), params)
    while eng.step_kinds["decode"] < 2:  # prefill, then decode steps until warm
        eng.step()
    out = []
    labels = {
        "decode": f"decode ({rows} rows)",
        "mixed": f"mixed ({rows} rows + {budget - rows} prompt tokens)",
    }
    for kind in ("decode", "mixed"):
        if kind == "mixed":
            eng.add_request(list(range(1000, 1000 + 4 * budget)), params)
        before = dict(eng.step_kinds)
        with cpu_profile() as prof:
            eng.step()
        assert eng.step_kinds[kind] == before[kind] + 1, f"the profiled step was not a {kind} step"
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events)
        for rank, e in enumerate(events[:top], 1):
            out.append(
                {
                    "step": labels[kind],
                    "rank": rank,
                    "op": e.key,
                    "calls": e.count,
                    "self_ms": f"{e.self_cpu_time_total / 1000:.1f}",
                    "share_pct": f"{100 * e.self_cpu_time_total / total:.1f}",
                    "step_ms": f"{total / 1000:.1f}",
                    "cpu": cpu_line(),
                }
            )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--newcomers", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=320)
    ap.add_argument("--budget", type=int, default=128, help="max_num_batched_tokens")
    ap.add_argument("--stream-tokens", type=int, default=32)
    ap.add_argument("--first-at", type=int, default=6, help="step the first newcomer arrives at")
    ap.add_argument("--every", type=int, default=10, help="steps between newcomers")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer
    from nanoserve.weights import fetch_default_model

    print(cpu_line())
    model_dir = fetch_default_model()
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    t0 = time.perf_counter()
    write_csv(mixed_table(model, tok, args), HERE / "day-57-mixed.csv")
    prof = profile_table(model, tok)
    write_csv(prof, HERE / "day-57-profile.csv")
    for row in prof:
        print("  ", row)
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
