"""Day 53: where a decode step's inputs live, step after step, with and without persistence.

A tiny random-weight Llama (no weights to fetch) serves a few requests that arrive two steps
apart, so the decode batch grows and shrinks across row buckets. Every decode plan is kept
alive, as a recorded graph keeps the tensors it was recorded with: two live tensors cannot share
an address, so a count of distinct addresses is a count of allocations, not of what the
allocator happened to reuse. Three engines:

    eager       plan_decode: every tensor new every step
    bucketed    plan_decode_bucketed: the slot window is a view on the slot table (day 51),
                the four per-row tensors and logits_at are new every step
    persistent  the same, through `PersistentInputs`: views on five buffers allocated once

For each it counts the distinct addresses of input_ids, positions, write_slots, context_lens,
logits_at and slot_window, runs `check_addresses_stable` from the first decode step on, counts
how many replays of a toy graph (recorded on the first decode plan of every shape, reading
input_ids and positions) saw the replaying step's numbers, and checks the tokens against the eager engine's.
The two timing columns (the median time to plan a decode step, and to run any step) are
measurements on whatever machine runs this, not facts.

    python days/day53/addresses.py                  # 4 requests x 8/32/96 tokens -> day-53-addresses.csv
    python days/day53/addresses.py --requests 8 --generated 16 64 256 --out /tmp/a.csv
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from nanocourse import engine_config, tiny_config, tiny_llama, write_csv
from nanoserve.capture import HostGraph, check_addresses_stable
from nanoserve.engine import Engine
from nanoserve.errors import GateError
from nanoserve.models import Llama
from nanoserve.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-53-addresses.csv"
BUFFERS = ("input_ids", "positions", "write_slots", "context_lens", "logits_at")  # PersistentInputs order
FIELDS = BUFFERS + ("slot_window",)
MODES = {
    "eager": {},
    "bucketed": dict(bucket_decode=True),
    "persistent": dict(bucket_decode=True, persist_inputs=True),
}
TINY = tiny_config(max_position_embeddings=512)


def tiny_model(seed: int = 0) -> Llama:
    return tiny_llama(seed, 0.05, TINY.max_position_embeddings)


def engine(model, mode: str, max_batch: int = 4, max_model_len: int = 256, **kw) -> Engine:
    per_block = model.cfg.kv_bytes_per_token(torch.float32) * 16
    config = engine_config(
        53,  # the engine as of day 53: prefill-first, gather attention, plain linears, ops step
        max_batch=max_batch,
        max_model_len=max_model_len,
        kv_budget=per_block * (max_batch * max_model_len // 16 + 1),
        width_multiple=32,
        **MODES[mode],
        **kw,
    )
    return Engine(model, None, config)


class PlanAddresses:
    """The addresses of a plan's five per-row tensors, in `PersistentInputs.buffers()` order: the
    shape `check_addresses_stable` reads, for a plan that has no persistent buffers behind it."""

    def __init__(self, plan):
        self.addresses = tuple(getattr(plan, name).data_ptr() for name in BUFFERS)


def read_inputs(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The smallest step a graph could record: read two input tensors. (2, rows)"""
    return torch.stack([ids, positions])


class DecodeLog:
    """Wraps `runner.plan`: keeps every decode plan (alive), what its tensors held when it was
    built (and, with persistent inputs, the whole [max_batch] buffers), and how long building it
    took. It also records a `HostGraph` of `read_inputs` on the first plan of each (rows, width)
    shape and replays it on every later plan of that shape: `replays_fresh` counts the replays
    that read this step's numbers rather than the recording step's."""

    def __init__(self, runner):
        self.plans, self.contents, self.buffers, self.plan_seconds = [], [], [], []
        self.graphs, self.replays, self.replays_fresh = {}, 0, 0
        inner = runner.plan

        def plan(batch):
            t0 = time.perf_counter()
            p = inner(batch)
            dt = time.perf_counter() - t0
            if p.is_decode:
                self.plans.append(p)
                self.contents.append({name: getattr(p, name).tolist() for name in BUFFERS})
                if runner.inputs is not None:
                    self.buffers.append({n: getattr(runner.inputs, n).tolist() for n in BUFFERS})
                self.plan_seconds.append(dt)
                self._replay(p)
            return p

        runner.plan = plan

    def _replay(self, p) -> None:
        shape = tuple(p.slot_window.shape)
        graph = self.graphs.get(shape)
        if graph is None:
            self.graphs[shape] = HostGraph.record(read_inputs, p.input_ids, p.positions)
            return
        self.replays += 1
        self.replays_fresh += torch.equal(graph.replay(), read_inputs(p.input_ids, p.positions))

    def addresses(self, name: str) -> list[int]:
        return [getattr(p, name).data_ptr() for p in self.plans]

    def distinct(self, name: str) -> int:
        return len(set(self.addresses(name)))

    def gate(self) -> str:
        """check_addresses_stable against the first decode step, every later step."""
        first = PlanAddresses(self.plans[0]).addresses
        for step, p in enumerate(self.plans[1:], start=2):
            try:
                check_addresses_stable(PlanAddresses(p), first)
            except GateError:
                return f"fails at step {step}"
        return "pass"


def requests(n: int, generated: int, seed: int = 53) -> list[tuple[list[int], int]]:
    """n prompts of 5..40 random tokens (seeded), each to generate `generated` tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(5, 41, (n,), generator=g).tolist()
    return [(torch.randint(1, TINY.vocab_size, (m,), generator=g).tolist(), generated) for m in lens]


def run(eng: Engine, reqs, stagger: int = 2):
    """Add one request every `stagger` steps, step to the end. (tokens per request, DecodeLog,
    seconds per step)."""
    log = DecodeLog(eng.runner)
    pending, ids, out, step_seconds, steps = list(enumerate(reqs)), {}, {}, [], 0
    while pending or eng.has_unfinished():
        if pending and steps % stagger == 0:
            i, (prompt, n) = pending.pop(0)
            ids[eng.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))] = i
        t0 = time.perf_counter()
        for o in eng.step():
            out.setdefault(ids[o.request_id], []).extend(o.new_token_ids)
        step_seconds.append(time.perf_counter() - t0)
        steps += 1
    return [out[i] for i in range(len(reqs))], log, step_seconds


def measure(model, n_requests: int = 4, generated=(8, 32, 96)) -> list[dict]:
    rows = []
    for n in generated:
        reqs = requests(n_requests, n)
        runs = {mode: run(engine(model, mode), reqs) for mode in MODES}
        eager_tokens = runs["eager"][0]
        for mode, (tokens, log, step_seconds) in runs.items():
            row = {"mode": mode, "generated": n, "decode_steps": len(log.plans)}
            row["shapes_seen"] = len({tuple(p.slot_window.shape) for p in log.plans})
            row |= {f"distinct_{name}": log.distinct(name) for name in FIELDS}
            row["check_addresses_stable"] = log.gate()
            row["replays_fresh"] = f"{log.replays_fresh}/{log.replays}"
            row["tokens_as_eager"] = "yes" if tokens == eager_tokens else "no"
            row["plan_us"] = round(1e6 * statistics.median(log.plan_seconds), 1)
            row["step_ms"] = round(1e3 * statistics.median(step_seconds), 3)
            rows.append(row)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=4, help="requests per run, arriving 2 steps apart")
    p.add_argument("--generated", type=int, nargs="+", default=[8, 32, 96], help="tokens each request makes")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the notebook uses 1)")
    p.add_argument("--out", default=str(CSV), help="CSV to write")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = measure(tiny_model(), args.requests, args.generated)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out, cpu=True)}")


if __name__ == "__main__":
    main()
