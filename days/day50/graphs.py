"""Day 50: what a recorded step binds and what it freezes (`nanoserve.capture.HostGraph`).

Two tables, both facts that hold on any machine (timings are extra columns, left out of the
journal's checked columns):

* `day-50-fields.csv`: for every field of a decode `StepPlan` (as `plan_decode` builds it),
  whether a HostGraph recorded over it keeps it *bound* (a tensor: replay reads whatever is in
  its storage now) or *frozen* (a Python value: copied at recording), its shape, and where
  `plan_decode` puts it each step.
* `day-50-replay.csv`: one row per scenario. Toy functions first (new numbers in a bound tensor,
  a frozen int, a frozen list, a rebound name, a moved storage), then a tiny random Llama's
  decode through the engine's runner: a graph recorded on the first step of each shape is
  replayed on every later step of that shape and compared with an eager run of the same plan.
  `plan_decode` builds every tensor new each step, so the harness does by hand what a graph
  needs: before a replay it copies the step's tensors into the ones the graph holds (all of
  them, or all but `positions`, or none). The engine always continues on the eager logits, so
  the three runs see the same tokens.

A HostGraph replays the same Python and the same kernels as eager: on CPU it saves nothing
(the `eager_ms`/`replay_ms` columns say so). What a CUDA graph saves is launch overhead (Day 49),
and it keeps exactly this contract.

    python days/day50/graphs.py                       # writes both CSVs next to this file
    python days/day50/graphs.py --seed 1 --out-dir /tmp/day50
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanocourse import cpu_line, engine_config, tiny_config, tiny_llama, write_csv
from nanoserve.capture import HostGraph, ReplayError
from nanoserve.engine import Engine
from nanoserve.models import Llama
from nanoserve.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
TINY = tiny_config(max_position_embeddings=128)
PROMPTS = ([3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43, 38], [27, 18, 28])
MAX_TOKENS = (10, 14, 6)  # the third finishes early: the batch drops from 3 rows to 2 mid-run


WEIGHT_STD = 0.3  # wide enough that attention is not uniform, so positions (RoPE) change the logits


def tiny_model(seed: int = 0) -> Llama:
    return tiny_llama(seed, WEIGHT_STD, TINY.max_position_embeddings)


def tiny_engine(model: Llama) -> Engine:
    """4 rows, blocks of 4 tokens, 64-token context: the engine as of day 50, whose decode plans
    come from `plan_decode` (new tensors each step, the window as wide as the longest row)."""
    per_block = TINY.kv_bytes_per_token(torch.float32) * 4
    cfg = engine_config(50, max_batch=4, block_size=4, max_model_len=64, kv_budget=per_block * 64)
    return Engine(model, None, cfg)


# --- toys ---------------------------------------------------------------------------------------


def toy_step(x: torch.Tensor, scale: int, shifts: list[int]) -> torch.Tensor:
    return x * scale + sum(shifts)


def toy_scenarios() -> list[dict]:
    """Record toy_step(x, 2, [1, 1]) over x = [1, 2, 3], change one thing, replay, compare with
    eager on what the caller now holds."""
    rows = []

    def row(scenario, changed, kind, replay, eager, outcome=None):
        same = replay is not None and torch.equal(replay, eager)
        rows.append(
            {
                "scenario": scenario,
                "what_changed": changed,
                "kind": kind,
                "replay": "-" if replay is None else str([int(v) for v in replay.tolist()]),
                "eager": str([int(v) for v in eager.tolist()]),
                "replay_equals_eager": "yes" if same else "no",
                "outcome": outcome or ("new step computed" if same else "stale value replayed"),
            }
        )

    def fresh():
        x, scale, shifts = torch.tensor([1.0, 2.0, 3.0]), 2, [1, 1]
        return x, scale, shifts, HostGraph.record(toy_step, x, scale, shifts)

    x, scale, shifts, g = fresh()
    x.copy_(torch.tensor([10.0, 20.0, 30.0]))  # new numbers into the bound storage
    row("toy: x written in place", "x.copy_([10, 20, 30])", "bound", g.replay(), toy_step(x, scale, shifts))

    x, scale, shifts, g = fresh()
    scale = 3  # the int the graph saw was 2
    row("toy: int argument changed", "scale 2 -> 3", "frozen", g.replay(), toy_step(x, scale, shifts))

    x, scale, shifts, g = fresh()
    shifts.append(5)  # the list was deep-copied at recording
    row("toy: list argument mutated", "shifts.append(5)", "frozen", g.replay(), toy_step(x, scale, shifts))

    x, scale, shifts, g = fresh()
    x = torch.tensor([10.0, 20.0, 30.0])  # a new tensor under the old name: the graph keeps the old one
    row(
        "toy: x rebound to a new tensor",
        "x = tensor([10, 20, 30])",
        "bound",
        g.replay(),
        toy_step(x, scale, shifts),
    )

    x, scale, shifts, g = fresh()
    x.set_(torch.tensor([10.0, 20.0, 30.0]))  # the same tensor object, new storage
    try:
        g.replay()
        outcome = "replayed"
    except ReplayError:
        outcome = "ReplayError"
    row("toy: x's storage moved", "x.set_(new storage)", "bound", None, toy_step(x, scale, shifts), outcome)
    return rows


# --- a real decode step -------------------------------------------------------------------------


TENSOR_FIELDS = ("input_ids", "positions", "write_slots", "context_lens", "slot_window", "logits_at")
MODES = {"copied in": (), "positions not copied": ("positions",), "nothing copied": TENSOR_FIELDS}


def copy_in(recorded, plan, skip=()) -> None:
    """Write `plan`'s tensors into the recorded plan's (the storage a graph over it is bound to),
    all but the fields in `skip`: by hand, what a graph needs before each replay."""
    for name in TENSOR_FIELDS:
        if name not in skip:
            getattr(recorded, name).copy_(getattr(plan, name))


@dataclass
class DecodeLog:
    """Every decode step of one run: the shape, whether it recorded or replayed, and for replays
    whether the replayed logits equal eager's on the same plan."""

    shapes: list[tuple[int, int]] = field(default_factory=list)
    recorded: list[bool] = field(default_factory=list)
    equal: list[bool | None] = field(default_factory=list)
    max_dlogit: list[float] = field(default_factory=list)  # 0.0 where recorded
    argmax_differs: list[int] = field(default_factory=list)  # real rows whose greedy token differs
    eager_s: list[float] = field(default_factory=list)
    replay_s: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)

    @property
    def replays(self) -> int:
        return sum(not r for r in self.recorded)


def watch_decode(eng: Engine, mode: str) -> DecodeLog:
    """Drive PROMPTS through `eng` greedily. Decode steps record a HostGraph over the runner's
    forward on the first plan of each (rows, width) shape; every later step of that shape
    copies its tensors into the graph's (as `mode` says: a key of MODES), replays, then runs
    eager on the same plan (which rewrites the same K/V slots with the right values) and the
    engine continues on eager's logits."""
    runner, log, graphs, skip = eng.runner, DecodeLog(), {}, MODES[mode]

    @torch.inference_mode()
    def execute(plan):
        if not plan.is_decode:
            return runner._forward(plan)
        shape, n = tuple(plan.slot_window.shape), len(plan.rows)
        log.shapes.append(shape)
        if shape not in graphs:
            graphs[shape] = HostGraph.record(runner._forward, plan)
            log.recorded.append(True)
            log.equal.append(None)
            log.max_dlogit.append(0.0)
            log.argmax_differs.append(0)
            return graphs[shape].output
        copy_in(graphs[shape].args[0], plan, skip)
        t0 = time.perf_counter()
        replayed = graphs[shape].replay()[:n].clone()
        t1 = time.perf_counter()
        eager = runner._forward(plan)
        t2 = time.perf_counter()
        log.recorded.append(False)
        log.equal.append(torch.equal(replayed, eager[:n]))
        log.max_dlogit.append((replayed - eager[:n]).abs().max().item())
        log.argmax_differs.append(int((replayed.argmax(-1) != eager[:n].argmax(-1)).sum()))
        log.replay_s.append(t1 - t0)
        log.eager_s.append(t2 - t1)
        return eager

    runner.execute = execute
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    log.tokens = [c.token_ids for c in eng.generate(list(PROMPTS), params, use_tqdm=False)]
    return log


def decode_logs(model: Llama) -> dict[str, DecodeLog]:
    return {mode: watch_decode(tiny_engine(model), mode) for mode in MODES}


DECODE_SCENARIOS = {
    "copied in": ("tiny Llama decode: inputs copied into the graph's", "every tensor copied in"),
    "positions not copied": ("tiny Llama decode: positions left out", "all but positions copied in"),
    "nothing copied": ("tiny Llama decode: plain plan_decode", "every tensor new each step"),
}


def decode_rows(logs: dict[str, DecodeLog]) -> list[dict]:
    rows = []
    for key, log in logs.items():
        scenario, changed = DECODE_SCENARIOS[key]
        equal = sum(bool(e) for e in log.equal if e is not None)
        rows.append(
            {
                "scenario": scenario,
                "what_changed": changed,
                "kind": "bound",
                "replay": f"{log.replays} replays over {len(set(log.shapes))} shapes",
                "eager": f"{len(log.shapes)} decode steps",
                "replay_equals_eager": "yes" if equal == log.replays else f"no ({equal} of {log.replays})",
                "outcome": "new step computed"
                if equal == log.replays
                else f"stale; greedy token differs on {sum(log.argmax_differs)} row-steps",
                "eager_ms": round(1000 * statistics.median(log.eager_s), 3),
                "replay_ms": round(1000 * statistics.median(log.replay_s), 3),
            }
        )
    return rows


def replay_table(model: Llama | None = None, logs=None) -> list[dict]:
    model = model or tiny_model()
    logs = logs or decode_logs(model)
    toys = [{**r, "eager_ms": "", "replay_ms": ""} for r in toy_scenarios()]
    return [{**r, "cpu": cpu_line()} for r in toys + decode_rows(logs)]


def step_times(model: Llama, repeats: int = 30) -> tuple[list[float], list[float]]:
    """Seconds per call of eager forward and of HostGraph replay on one decode plan, interleaved
    (both rewrite the same K/V slots with the same values)."""
    eng = tiny_engine(model)
    plan = first_decode_plan(eng)
    eager, replay = [], []
    with torch.inference_mode():
        graph = HostGraph.record(eng.runner._forward, plan)
        for _ in range(repeats):
            t0 = time.perf_counter()
            eng.runner._forward(plan)
            t1 = time.perf_counter()
            graph.replay()
            t2 = time.perf_counter()
            eager.append(t1 - t0)
            replay.append(t2 - t1)
    return eager, replay


# --- bound or frozen, field by field ------------------------------------------------------------


def first_decode_batch(eng: Engine):
    """The batch of the engine's first decode step over PROMPTS (after one prefill step)."""
    for prompt, n in zip(PROMPTS, MAX_TOKENS):
        eng.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    eng.step()  # prefill all three
    return eng.scheduler.schedule()


def first_decode_plan(eng: Engine):
    """The plan of the engine's first decode step over PROMPTS."""
    return eng.runner.plan(first_decode_batch(eng))


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return str(tuple(value.shape))
    return (
        f"{type(value).__name__} of {len(value)}"
        if isinstance(value, (tuple, list))
        else type(value).__name__
    )


def field_table(model: Llama | None = None) -> list[dict]:
    """One row per StepPlan field: bound or frozen under HostGraph.record, and where the next
    step's `plan_decode` puts it (a new tensor, or a Python value the graph copied)."""
    eng = tiny_engine(model or tiny_model())
    batch = first_decode_batch(eng)
    plan, later = eng.runner.plan(batch), eng.runner.plan(batch)  # the same batch planned twice
    graph = HostGraph.record(lambda p: None, plan)  # only what record keeps matters here
    rows = []
    for f in dataclasses.fields(plan):
        kept, now = getattr(graph.args[0], f.name), getattr(later, f.name)
        bound = any(kept is t for t in graph.bound)  # the caller's tensor itself, not a copy
        moved = bound and now.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()
        where = ("new tensor" if moved else "same storage") if bound else "copied at recording"
        rows.append(
            {
                "field": f.name,
                "kind": "bound" if bound else "frozen",
                "shape": describe(kept),
                "plan_decode": where,
            }
        )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny model's random weights")
    p.add_argument("--out-dir", default=str(HERE), help="where the two CSVs go")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # one step of a tiny model: threads only add noise
    model = tiny_model(args.seed)
    out = Path(args.out_dir)
    fields = field_table(model)
    replays = replay_table(model)
    for r in fields + replays:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(fields, out / 'day-50-fields.csv')}")
    print(f"wrote {write_csv(replays, out / 'day-50-replay.csv')}")
    eager, replay = step_times(model)
    best = f"eager {min(eager) * 1e3:.3f} ms, replay {min(replay) * 1e3:.3f} ms"
    print(f"one decode step, best of {len(eager)}: {best}")
    eq = {r["scenario"]: r["replay_equals_eager"] for r in replays}
    print("graphs " + " ".join(f"[{k}]={v}" for k, v in eq.items()))


if __name__ == "__main__":
    main()
