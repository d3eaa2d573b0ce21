"""Day 29: preemption by recompute, traced, counted, and checked against a roomy pool.

When a running sequence needs a block for its next token and none is free, the scheduler
(`Scheduler._schedule_decode`) preempts the newest running sequence (largest `arrival`):
`Scheduler.preempt` gives its blocks back, sets `num_computed` to 0, adds what it had computed
to `recomputed_tokens`, and puts it at the front of the waiting queue with its tokens, prompt
and generated alike, intact. When it is admitted again its whole token list is one prompt
(chunked like any other), and the step that finishes it samples the next token: nothing the
client already has is sent again.

`run` drives an engine over a workload queued at once and records every preemption: the step,
the victim and whether it was the newest, what it had computed, its prompt and generated
tokens, the blocks it gave back, when it was readmitted and how many tokens its readmission
computed. It also collects every request's tokens as streamed, so a run on a pool too small for
the load can be compared with the same requests on a roomy pool.

Two CSVs:

* `day-29-preemptions.csv`: every preemption of the tiny random-weight Llama on a pool of 39
  blocks of 4 tokens (8 requests, prefix caching off so a readmission recomputes everything).
* `day-29-runs.csv`: per run (model, pool, prefix caching): blocks, preemptions, the
  scheduler's `recomputed_tokens`, the tokens readmissions actually computed, steps, how many
  requests' tokens equal the roomy pool's and how many differ only at a near-tie (the top two
  logits of the roomy run within 1e-4, the rule of `tests/test_engine.py`). The SmolLM2 rows
  run eight chat prompts with greedy decoding; their seconds are this machine's.

    python days/day29/preemptbench.py                 # writes both CSVs next to this file
    python days/day29/preemptbench.py --tiny-only --out-dir /tmp/d29
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanocourse import engine_config, tiny_llama, top2_gap, write_csv
from nanoserve.bench import cpu_line
from nanoserve.engine import Engine
from nanoserve.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
TIE = 1e-4
QUESTIONS = [
    "Why is the sky blue?",
    "How do bees make honey?",
    "What is a lighthouse for?",
    "Name three rivers in Europe.",
    "Why do cats purr?",
    "How does a bicycle stay upright?",
    "What makes bread rise?",
    "Why is the sea salty?",
]


def tiny_workload(n: int = 8, seed: int = 29, vocab: int = 256):
    """n (prompt ids, max_tokens): prompts of 8 to 24 tokens, 16 to 32 tokens to generate."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(1, vocab) for _ in range(rng.randint(8, 24))], rng.randint(16, 32)) for _ in range(n)
    ]


def engine_for(model, tok, blocks: int, block_size: int, max_model_len: int, caching: bool = False) -> Engine:
    """The engine as of day 29 (prefill-first, the gather read, the model's own linears) on a pool
    of `blocks` blocks."""
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * block_size
    cfg = engine_config(
        29,
        max_batch=8,
        block_size=block_size,
        kv_budget=per_block * blocks + per_block // 2,
        max_model_len=max_model_len,
        max_num_batched_tokens=64,
        enable_prefix_caching=caching,
    )
    return Engine(model, tok, cfg)


@dataclass
class Preemption:
    step: int
    victim: str
    victim_arrival: int
    newest_arrival: int  # the largest arrival among the running, the victim included
    running: int  # sequences running when it happened, the victim included
    computed: int  # its tokens whose K/V was in the cache: thrown away
    prompt: int
    generated: int
    blocks_returned: int
    free_before: int
    free_after: int
    readmitted: int = -1  # the step it was admitted again
    recompute_tokens: int = 0  # tokens its readmission computed, over all its chunks


@dataclass
class Run:
    preemptions: list[Preemption] = field(default_factory=list)
    streamed: list[list[int]] = field(default_factory=list)  # per request, in order
    steps: int = 0
    recomputed_tokens: int = 0  # the scheduler's counter
    seconds: float = 0.0


def run(engine: Engine, reqs) -> Run:
    """Queue every request, step the engine to the end, record each preemption."""
    out, sched = Run(), engine.scheduler
    real_preempt, real_schedule = sched.preempt, sched.schedule
    pending: dict = {}  # seq -> its open Preemption, until its readmission is computed

    def preempt(seq):
        p = Preemption(
            step=out.steps,
            victim=seq.request_id,
            victim_arrival=seq.arrival,
            newest_arrival=max(s.arrival for s in sched.running),
            running=len(sched.running),
            computed=seq.num_computed,
            prompt=len(seq.prompt_ids),
            generated=len(seq.output_ids),
            blocks_returned=len(seq.block_table.blocks),
            free_before=engine.allocator.num_free,
            free_after=-1,
        )
        real_preempt(seq)
        p.free_after = engine.allocator.num_free
        out.preemptions.append(p)
        pending[seq] = p

    def schedule():
        batch = real_schedule()
        for seq, start, end in batch.chunks:
            p = pending.get(seq)
            if p is not None:
                if p.readmitted < 0:
                    p.readmitted = out.steps
                p.recompute_tokens += end - start
                if end == len(seq.token_ids):
                    del pending[seq]
        for seq in batch.decode:  # a readmission whose chunks stopped one token short ends as a decode row
            p = pending.pop(seq, None)
            if p is not None:
                p.recompute_tokens += 1
        if batch.seqs:
            out.steps += 1
        return batch

    sched.preempt, sched.schedule = preempt, schedule
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in reqs]
    ids = [engine.add_request(p, sp) for (p, _), sp in zip(reqs, params)]
    streamed = {i: [] for i in ids}
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished():
            for o in engine.step():
                streamed[o.request_id] += o.new_token_ids
    finally:
        sched.preempt, sched.schedule = real_preempt, real_schedule
    out.seconds = time.perf_counter() - t0
    out.streamed = [streamed[i] for i in ids]
    out.recomputed_tokens = sched.recomputed_tokens
    assert engine.allocator.num_used == 0, "blocks still used after the run"
    return out


def compare(model, reqs, ref: list[list[int]], got: list[list[int]]) -> tuple[int, int]:
    """(requests equal, requests differing only at a near-tie); raises on a real difference."""
    equal = ties = 0
    for i, ((prompt, n), a, b) in enumerate(zip(reqs, ref, got)):
        if a == b:
            equal += 1
            continue
        if len(b) != n:
            raise AssertionError(f"request {i} streamed {len(b)} tokens for the {n} it asked for: {b}")
        k = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        gap = top2_gap(model, prompt + a[:k])
        if gap >= TIE:
            raise AssertionError(
                f"request {i}'s tokens differ from the roomy pool's at {k}, top-2 gap {gap:.2e}"
            )
        ties += 1
    return equal, ties


def run_row(name, model_name, engine, reqs, ref_run, this_run, model) -> dict:
    equal, ties = compare(model, reqs, ref_run.streamed, this_run.streamed) if ref_run else (len(reqs), 0)
    return {
        "run": name,
        "model": model_name,
        "kv_blocks": engine.allocator.num_blocks,
        "block_size": engine.allocator.block_size,
        "prefix_caching": engine.allocator.enable_prefix_caching,
        "preemptions": len(this_run.preemptions),
        "recomputed_tokens": this_run.recomputed_tokens,
        "readmission_tokens": sum(p.recompute_tokens for p in this_run.preemptions),
        "steps": this_run.steps,
        "same_as_roomy": equal,
        "near_ties": ties,
        "requests": len(reqs),
        "seconds": f"{this_run.seconds:.1f}",
        "cpu": cpu_line(),
    }


TINY = {"blocks": 39, "roomy": 399, "block_size": 4, "max_model_len": 128}
SMOL = {"blocks": 12, "roomy": 64, "block_size": 16, "max_model_len": 192, "max_tokens": 32}


def tiny_runs(model):
    """The tiny model's three runs: roomy, tight, tight with prefix caching on."""
    reqs = tiny_workload(vocab=model.cfg.vocab_size)
    runs, rows = {}, []
    for name, blocks, caching in (
        ("tiny, roomy", TINY["roomy"], False),
        ("tiny, tight", TINY["blocks"], False),
        ("tiny, tight, prefix caching", TINY["blocks"], True),
    ):
        eng = engine_for(model, None, blocks, TINY["block_size"], TINY["max_model_len"], caching)
        runs[name] = run(eng, reqs)
        rows.append(
            run_row(name, "tiny", eng, reqs, runs.get("tiny, roomy") if runs else None, runs[name], model)
        )
    return reqs, runs, rows


def smol_runs(threads: int):
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer
    from nanoserve.weights import fetch_default_model

    model_dir = fetch_default_model()
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    reqs = [(tok.encode_chat([{"role": "user", "content": q}]), SMOL["max_tokens"]) for q in QUESTIONS]
    runs, rows = {}, []
    for name, blocks in (("SmolLM2, roomy", SMOL["roomy"]), ("SmolLM2, tight", SMOL["blocks"])):
        eng = engine_for(model, tok, blocks, SMOL["block_size"], SMOL["max_model_len"])
        run(eng, reqs[:1])  # warm-up: first calls allocate and pick kernels
        runs[name] = run(eng, reqs)
        ref = runs.get("SmolLM2, roomy") if name.endswith("tight") else None
        rows.append(run_row(name, "SmolLM2-135M-Instruct", eng, reqs, ref, runs[name], model))
    return reqs, runs, rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tiny-only", action="store_true", help="skip the SmolLM2 runs")
    ap.add_argument("--out-dir", default=str(HERE))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    out = Path(args.out_dir)
    model = tiny_llama(0, 0.05, 512)
    _, runs, rows = tiny_runs(model)
    events = [vars(p) for p in runs["tiny, tight"].preemptions]
    for e in events:
        print("  ", e)
    write_csv(events, out / "day-29-preemptions.csv")
    if not args.tiny_only:
        _, _, smol = smol_runs(args.threads)
        rows += smol
    for r in rows:
        print(r)
    write_csv(rows, out / "day-29-runs.csv")


if __name__ == "__main__":
    main()
