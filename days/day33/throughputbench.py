"""Day 33: throughput of static and continuous batching, and what `bench throughput` compared.

Two tables:

* `day-33-throughput.csv`: `bench.throughput_workload`'s requests, all queued at once, through
  the engine as of day 33 (`engine_config(33, ...)`: the gather read of the pool, the model's
  own linears) under the two schedules it has ("static", "prefill-first"), on the tiny
  random-weight Llama (the notebook's size) and on SmolLM2-135M-Instruct (a small run: 8
  requests, 4 rows), where transformers' `generate` also runs them in static, left-padded
  batches of as many rows (`bench.run_transformers_workload`, one run). Per way: steps by kind
  (forward passes, for transformers), preemptions, generated tokens, how many requests' tokens
  equal the prefill-first schedule's (a difference excused only at a near-tie of the eager
  reference), and this machine's wall time, tokens a second and mean milliseconds per step of
  each kind, each way the fastest of its runs, the ways taking turns.
* `day-33-replay.csv`: the scheduling of `python -m nanoserve.bench throughput` itself (64
  requests, prompts 16-256, outputs 16-128, 64 rows, a budget of 512 tokens, the default pool of
  512 MiB = 728 blocks of SmolLM2 fp32), replayed on the tiny model with a pool of the same 728
  blocks, under each schedule, and again at 16 rows, the size of the bench's transformers
  batches. Which sequence runs in which step depends only on the lengths and the blocks, never
  on the weights (end-of-sequence is ignored), so the replay's steps, preemptions and
  recomputed tokens are those of a real run with that configuration; its times are not, and
  are not kept. The benchmark itself runs the package's current engine, which later days
  build on (mixed steps, day 57; attention in place, 58; packed linears, 59); the replay runs
  day 33's schedules on its lengths.

    python days/day33/throughputbench.py                  # both tables
    python days/day33/throughputbench.py --no-smollm      # tiny model and replay only
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from nanocourse import engine_config, tiny_llama, top2_gap, write_csv
from nanoserve.bench import cpu_line, run_nanoserve_workload, run_transformers_workload, throughput_workload
from nanoserve.engine import Engine
from nanoserve.models import LlamaConfig, load_model
from nanoserve.pool import DEFAULT_CPU_BUDGET, plan_pool
from nanoserve.sampling import SamplingParams
from nanoserve.weights import fetch_default_model

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-33-throughput.csv"
CSV_REPLAY = HERE / "day-33-replay.csv"
POLICIES = ("static", "prefill-first")
TINY = {"requests": 64, "prompt": (8, 64), "new": (4, 32), "rows": 8, "budget": 64}  # the notebook's
SMOLLM = {"requests": 8, "prompt": (16, 48), "new": (8, 24), "rows": 4, "budget": 64}
BENCH = {"requests": 64, "prompt": (16, 256), "new": (16, 128), "rows": 64, "budget": 512}  # its defaults
TIE = 1e-4


def make_engine(model, schedule: str, rows: int, budget: int) -> Engine:
    """The engine as of day 33 under `schedule`, its pool roomy enough that nothing waits for
    blocks."""
    per_token = model.cfg.kv_bytes_per_token(model.dtype)
    num_blocks = rows * (-(-min(model.cfg.max_position_embeddings, 1024) // 16) + 1) + 1
    config = engine_config(
        33,
        schedule=schedule,
        max_batch=rows,
        max_model_len=min(model.cfg.max_position_embeddings, num_blocks * 16),
        kv_budget=per_token * (num_blocks * 16 + 1),  # the blocks and the pool's one spare slot
        max_num_batched_tokens=budget,
    )
    return Engine(model, None, config)


def run(engine: Engine, reqs) -> dict:
    """Every request queued, stepped to the end: tokens by request, steps by kind, preemptions,
    recomputed tokens, the seconds of the stepping and the seconds spent in each kind of step."""
    ids = {
        engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)): i
        for i, (p, n) in enumerate(reqs)
    }
    out = {i: [] for i in range(len(reqs))}
    by_kind = dict.fromkeys(engine.step_kinds, 0.0)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        before, t1 = dict(engine.step_kinds), time.perf_counter()
        for o in engine.step():
            out[ids[o.request_id]] += o.new_token_ids
        kind = next((k for k, n in engine.step_kinds.items() if n > before[k]), None)
        if kind is not None:
            by_kind[kind] += time.perf_counter() - t1
    seconds = time.perf_counter() - t0
    sched = engine.scheduler
    return {
        "tokens": [out[i] for i in range(len(reqs))],
        "kinds": dict(engine.step_kinds),
        "preemptions": sched.num_preemptions,
        "recomputed": sched.recomputed_tokens,
        "seconds": seconds,
        "kind_seconds": by_kind,
    }


def agreeing(model, reqs, ref, got) -> int:
    """Requests whose tokens equal ref's, or differ first where the eager reference's top two
    logits are within TIE (a near-tie: batch shapes round differently)."""
    n = 0
    with torch.inference_mode():
        for (p, _), a, b in zip(reqs, ref, got):
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            n += k is None or top2_gap(model, p + a[:k]) < TIE
    return n


def policy_rows(model, name: str, reqs, rows: int, budget: int, repeats: int):
    """The two schedules on one model, in turn `repeats` times, each keeping its fastest run.
    Returns the table's rows and the prefill-first schedule's tokens."""
    best = {}
    for _ in range(repeats):
        for policy in POLICIES:
            got = run(make_engine(model, policy, rows, budget), reqs)
            if policy not in best or got["seconds"] < best[policy]["seconds"]:
                best[policy] = got
    ref = best["prefill-first"]["tokens"]
    out = []
    for policy, got in best.items():
        generated = sum(len(t) for t in got["tokens"])
        assert generated == sum(n for _, n in reqs), f"{policy}: a request did not get its tokens"
        same = agreeing(model, reqs, ref, got["tokens"])
        assert same == len(reqs), f"{policy}: {len(reqs) - same} requests differ from prefill-first's"
        kinds = got["kinds"]
        out.append(
            {
                "model": name,
                "way": f"nanoserve {policy}",
                "requests": len(reqs),
                "rows": rows,
                "budget": budget,
                "steps": sum(kinds.values()),
                "prefill_steps": kinds["prefill"],
                "decode_steps": kinds["decode"],
                "preemptions": got["preemptions"],
                "generated": generated,
                "same_tokens": same,
                "seconds": round(got["seconds"], 2),
                "tok_s": round(generated / got["seconds"], 1),
            }
            | {f"ms_{k}_step": ms(got["kind_seconds"][k], kinds[k]) for k in ("prefill", "decode")}
            | {"cpu": cpu_line()}
        )
    return out, ref


def ms(seconds: float, steps: int):
    return round(1000 * seconds / steps, 1) if steps else ""


def transformers_row(model_dir, reqs, rows: int, repeats: int, ref, ours) -> dict:
    """transformers' static, left-padded batches of `rows` on the same weights, as
    `bench.run_transformers_workload` runs them; its tokens read back from `generate`."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs, calls = [], []
    generate = hf.generate

    def recorded(*args, **kw):
        out = generate(*args, **kw)
        outs.append((kw["input_ids"] if "input_ids" in kw else args[0], out))
        return out

    hook = hf.model.register_forward_hook(lambda m, a, kw, o: calls.append(1), with_kwargs=True)
    hf.generate = recorded
    best = None
    for _ in range(repeats):
        outs.clear()
        calls.clear()
        seconds, useful = run_transformers_workload(hf, reqs, rows, 2)  # pad with <|im_end|>, as the bench
        best = seconds if best is None else min(best, seconds)
    hook.remove()
    tokens = []
    for ids, out in outs:
        width = ids.shape[1]
        tokens += [out[r, width:].tolist() for r in range(ids.shape[0])]
    tokens = [t[:n] for t, (_, n) in zip(tokens, reqs)]
    return {
        "model": "SmolLM2-135M",
        "way": "transformers static batches",
        "requests": len(reqs),
        "rows": rows,
        "budget": "",
        "steps": len(calls),
        "prefill_steps": len(outs),
        "decode_steps": len(calls) - len(outs),
        "preemptions": "",
        "generated": useful,
        "same_tokens": agreeing(ours, reqs, ref, tokens),
        "seconds": round(best, 2),
        "tok_s": round(useful / best, 1),
        "ms_prefill_step": "",
        "ms_decode_step": "",
        "cpu": cpu_line(),
    }


def replay_rows(tiny) -> list[dict]:
    """`bench throughput`'s scheduling under each policy on the tiny model, with the pool the
    default 512 MiB buys SmolLM2 in fp32, through the package's own `run_nanoserve_workload`:
    at the bench's 64 rows, and at 16, the rows of its transformers batches."""
    smol_cfg = LlamaConfig.from_dir(fetch_default_model())
    blocks = plan_pool(smol_cfg, torch.float32, budget_bytes=DEFAULT_CPU_BUDGET).num_blocks
    reqs = throughput_workload(BENCH["requests"], BENCH["prompt"], BENCH["new"], tiny.cfg.vocab_size, seed=0)
    per_token = tiny.cfg.kv_bytes_per_token(torch.float32)
    out = []
    for rows, policy in [(r, p) for r in (BENCH["rows"], 16) for p in POLICIES]:
        config = engine_config(
            33,
            schedule=policy,
            max_batch=rows,
            max_num_batched_tokens=BENCH["budget"],
            max_model_len=smol_cfg.max_position_embeddings,
            kv_budget=per_token * (blocks * 16 + 1),
        )
        engines: list = []
        _, useful, preemptions = run_nanoserve_workload(tiny, None, reqs, config, engines)
        engine = engines[0]
        assert engine.pool.num_blocks == blocks
        kinds = engine.step_kinds
        steps = sum(kinds.values()) - 2  # less the warm-up request's prefill and decode step
        out.append(
            {
                "policy": policy,
                "requests": len(reqs),
                "rows": rows,
                "budget": BENCH["budget"],
                "kv_blocks": blocks,
                "steps": steps,
                "prefill_steps": kinds["prefill"] - 1,
                "decode_steps": kinds["decode"] - 1,
                "preemptions": preemptions,
                "recomputed_tokens": engine.scheduler.recomputed_tokens,
                "generated": useful,
                "tokens_per_step": round(useful / steps, 2),
            }
        )
    return out


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row's tokens a second against nanoserve static's on the same model (`vs_static`)."""
    for model in dict.fromkeys(r["model"] for r in rows):
        base = next(r for r in rows if r["model"] == model and r["way"] == "nanoserve static")
        for r in rows:
            if r["model"] == model:
                r["vs_static"] = round(r["tok_s"] / base["tok_s"], 2)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-smollm", action="store_true", help="skip the SmolLM2 run")
    p.add_argument("--no-transformers", action="store_true", help="skip transformers in the SmolLM2 run")
    p.add_argument("--repeats", type=int, default=2, help="runs of each policy on SmolLM2, in turn")
    p.add_argument("--tiny-repeats", type=int, default=5, help="runs of each policy on the tiny model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(CSV))
    p.add_argument("--out-replay", default=str(CSV_REPLAY))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    tiny = tiny_llama(0)
    t = TINY
    reqs = throughput_workload(t["requests"], t["prompt"], t["new"], tiny.cfg.vocab_size, seed=0)
    rows, _ = policy_rows(tiny, "tiny", reqs, t["rows"], t["budget"], args.tiny_repeats)
    if not args.no_smollm:
        s = SMOLLM
        model_dir = fetch_default_model()
        smol = load_model(model_dir)
        reqs = throughput_workload(s["requests"], s["prompt"], s["new"], smol.cfg.vocab_size, seed=0)
        got, ref = policy_rows(smol, "SmolLM2-135M", reqs, s["rows"], s["budget"], args.repeats)
        rows += got
        if not args.no_transformers:
            rows.append(transformers_row(model_dir, reqs, s["rows"], 1, ref, smol))  # one run: the slowest
    add_ratios(rows)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out)}")
    replay = replay_rows(tiny)
    for r in replay:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(replay, args.out_replay)}")
    for model in dict.fromkeys(r["model"] for r in rows):
        ways = {r["way"]: r for r in rows if r["model"] == model}
        b, st = ways["nanoserve prefill-first"], ways["nanoserve static"]
        print(
            f"RESULT {model} prefill-first/static={b['tok_s']}/{st['tok_s']}={b['tok_s'] / st['tok_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
