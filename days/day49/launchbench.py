"""Day 49: when a decode step is launch-bound. Op time against everything else, as models shrink.

The default model (SmolLM2-135M, real weights) and smaller random-weight Llamas of the same
shape family (GQA, SwiGLU, tied head) decode `batch` requests through an `Engine`. For each
(model, batch): the step's wall time (the fastest of `steps` decode steps, profiler off), and
from one profiled decode step the aten ops it dispatches and the profiler's self time of those
ops. Everything that is not op time (the interpreter, the engine's Python, the dispatcher's own
cost around each op) is the overhead.

The op counts are deterministic: they depend on the code path and the layer count, not on the
weights, the batch or the machine's load (the thread count matters: `linear` takes its slab
path on 2 or more threads). Times are measured on whatever CPU runs this.

    python days/day49/launchbench.py                          # 4 models x batch 1, 8, 32
    python days/day49/launchbench.py --batch 1 --batch 64 --steps 10 --out /tmp/l.csv
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import record_function

from nanocourse import cpu_profile, engine_config, write_csv
from nanoserve.engine import Engine
from nanoserve.errors import GateError
from nanoserve.models import Llama, LlamaConfig
from nanoserve.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-49-launch.csv"
DEFAULT = "smollm2-135m"


def _family(hidden, inter, layers, heads, kv, head_dim, vocab) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )


# name -> config; the default model's comes from its directory. Every output width is even, so
# `linear` takes the same two-slab path on 2 threads in all of them: the same ops, less work.
SHAPES: dict[str, LlamaConfig | None] = {
    DEFAULT: None,  # hidden 576, MLP 1536, 30 layers, 9/3 heads of 64, vocab 49,152
    "h256-l30": _family(256, 768, 30, 4, 2, 64, 8192),
    "h64-l30": _family(64, 192, 30, 4, 2, 16, 512),
    "h64-l4": _family(64, 192, 4, 4, 2, 16, 512),
}
BATCHES = (1, 8, 32)
STEPS = 10  # timed decode steps per (model, batch); the fastest is reported
WARM_STEPS = 2
PROMPT_LEN = 8
MAX_MODEL_LEN = 128
BLOCK = 16


def make_model(name: str, model_dir=None, seed: int = 0) -> Llama:
    """The default model with its weights, or a random-weight Llama of the named shape."""
    if SHAPES[name] is None:
        from nanoserve.models import load_model
        from nanoserve.weights import resolve_model_dir

        return load_model(resolve_model_dir(model_dir))
    torch.manual_seed(seed)
    model = Llama(SHAPES[name], max_positions=MAX_MODEL_LEN)
    for n, p in model.named_parameters():
        if "norm" not in n:
            p.normal_(0, 0.05)
    return model.eval()


def weight_bytes(model: Llama) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def step_flops(cfg: LlamaConfig, batch: int) -> int:
    """Multiply-adds x 2 of one decode step's matrices (blocks and head) for `batch` rows; the
    attention over a short context is left out (under 2% here)."""
    hd = cfg.head_dim
    per_layer = cfg.hidden_size * (cfg.num_heads * hd + 2 * cfg.num_kv_heads * hd)  # qkv
    per_layer += cfg.num_heads * hd * cfg.hidden_size  # o
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size  # gate, up, down
    return 2 * batch * (cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size)


@dataclass(frozen=True)
class Peaks:
    """What this CPU does at best, measured: read bandwidth and fp32 matmul rate."""

    gb_s: float
    gflop_s: float

    def floor_s(self, nbytes: int, flops: int) -> float:
        """The least time a step could take: its weights read once, or its FLOPs, whichever is
        slower. Everything a step takes beyond this is overhead of one kind or another."""
        return max(nbytes / (self.gb_s * 1e9), flops / (self.gflop_s * 1e9))


def measure_peaks(mbytes: int = 256, n: int = 1024, repeats: int = 5) -> Peaks:
    from nanoserve.bench import read_bandwidth_gbs

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return Peaks(read_bandwidth_gbs(mbytes, repeats), 2 * n**3 / best / 1e9)


def build_engine(model: Llama, batch: int, prompt_len: int = PROMPT_LEN, seed: int = 0) -> Engine:
    """`batch` requests of `prompt_len` random tokens, greedy, long enough never to finish here."""
    cfg = model.cfg
    blocks = batch * (MAX_MODEL_LEN // BLOCK) + 1
    config = engine_config(
        49,  # the engine as of day 49: prefill-first, gather attention, plain linears, ops step
        max_batch=batch,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK,
        kv_budget=cfg.kv_bytes_per_token(model.dtype) * BLOCK * blocks,
    )
    engine = Engine(model, None, config)
    g = torch.Generator().manual_seed(seed)
    lo = min(100, cfg.vocab_size // 2)
    for _ in range(batch):
        prompt = torch.randint(lo, cfg.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=MAX_MODEL_LEN - prompt_len, ignore_eos=True))
    return engine


@dataclass
class OpCount:
    """One profiled engine step."""

    py_calls: int  # aten ops called from Python (not from inside another aten op), whole step
    fwd_calls: int  # of those, inside ModelRunner.execute: what a captured graph replays
    aten_calls: int  # every aten op, nested ones included
    op_s: float  # profiler self time of every aten op
    forward_ops: tuple[str, ...]  # the forward's Python-level op names, in order
    is_decode: bool


def profile_step(engine: Engine) -> OpCount:
    """Run one engine step under the profiler and count its aten ops."""
    plans = []
    execute = engine.runner.execute

    def labelled(plan):
        plans.append(plan)
        with record_function("forward"):
            return execute(plan)

    with cpu_profile():  # the first profile of a process pays the profiler's start-up
        torch.ones(1).add(1)
    engine.runner.execute = labelled
    try:
        with cpu_profile() as prof:
            engine.step()
    finally:
        engine.runner.execute = execute
    py = fwd = total = 0
    op_us = 0.0
    names = []
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        total += 1
        op_us += e.self_cpu_time_total
        parent = e.cpu_parent
        if parent is not None and parent.name.startswith("aten::"):
            continue
        py += 1
        while parent is not None and parent.name != "forward":
            parent = parent.cpu_parent
        if parent is not None:
            fwd += 1
            names.append(e.name)
    return OpCount(py, fwd, total, op_us / 1e6, tuple(names), plans[0].is_decode)


def time_steps(engine: Engine, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        out.append(time.perf_counter() - t0)
    return out


def measure(
    model: Llama,
    name: str,
    batch: int,
    peaks: Peaks,
    steps: int = STEPS,
    keep: dict | None = None,
    profiles: int = 2,
) -> dict:
    """One row: the model's shape and work, the ops of one decode step, and its times. The op
    time is the least of `profiles` profiled steps (the counts are the same in each). With
    `keep`, the step's `OpCount` is stored there under (name, batch)."""
    engine = build_engine(model, batch)
    engine.step()  # prefill
    time_steps(engine, WARM_STEPS)
    step_s = min(time_steps(engine, steps))
    ops = min((profile_step(engine) for _ in range(profiles)), key=lambda o: o.op_s)
    check_decode(ops)
    if keep is not None:
        keep[name, batch] = ops
    cfg = model.cfg
    nbytes, flops = weight_bytes(model), step_flops(cfg, batch)
    floor_s = peaks.floor_s(nbytes, flops)
    return {
        "model": name,
        "hidden": cfg.hidden_size,
        "layers": cfg.num_layers,
        "vocab": cfg.vocab_size,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "weight_mb": round(nbytes / 1e6, 2),
        "batch": batch,
        "mflop": round(flops / 1e6, 1),
        "py_calls": ops.py_calls,
        "fwd_calls": ops.fwd_calls,
        "aten_calls": ops.aten_calls,
        "step_ms": round(step_s * 1e3, 2),
        "op_ms": round(ops.op_s * 1e3, 2),
        "floor_ms": round(floor_s * 1e3, 2),
        "over_floor_pct": round(100 * max(step_s - floor_s, 0.0) / step_s, 1),
        "us_per_call": round(step_s * 1e6 / ops.py_calls, 1),
    }


def bench(
    models: dict[str, Llama],
    peaks: Peaks,
    batches=BATCHES,
    steps: int = STEPS,
    keep: dict | None = None,
    profiles: int = 2,
) -> list[dict]:
    return [measure(m, name, b, peaks, steps, keep, profiles) for name, m in models.items() for b in batches]


# --- gates -----------------------------------------------------------------------------------


def check_decode(ops: OpCount) -> None:
    """The profiled step was a decode step (one token per row), not a prefill."""
    if not ops.is_decode:
        raise GateError("the profiled step was a prefill step; step past the prefill before counting ops")


def check_same_op_sequence(a: tuple[str, ...], b: tuple[str, ...]) -> None:
    """Two forwards dispatch the same ops in the same order: what one recorded graph (per
    shape) could replay. A forward whose op list depends on the data cannot be recorded once."""
    if a == b:
        return
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    x = a[i] if i < len(a) else "(end)"
    y = b[i] if i < len(b) else "(end)"
    raise GateError(
        f"the op sequences differ at op {i} ({x} against {y}); {len(a)} ops against {len(b)}: "
        "this forward's op list depends on its batch, so no one recording replays both"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="default model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--shape", action="append", choices=list(SHAPES), help="models (repeat; default all)")
    p.add_argument("--batch", type=int, action="append", help="rows (repeat; default 1, 8, 32)")
    p.add_argument("--steps", type=int, default=STEPS, help="timed decode steps (the fastest counts)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(CSV), help="CSV to write")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = {name: make_model(name, args.model) for name in args.shape or SHAPES}
    peaks = measure_peaks()
    print(f"this CPU: read {peaks.gb_s:.1f} GB/s, fp32 matmul {peaks.gflop_s:.0f} GFLOP/s")
    rows = bench(models, peaks, args.batch or BATCHES, args.steps)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out, cpu=True)}")
    tiny = min(rows, key=lambda r: (r["params_m"], r["batch"]))
    print(
        f"launch threads={torch.get_num_threads()} tiniest={tiny['model']} batch={tiny['batch']} "
        f"step_ms={tiny['step_ms']} py_calls={tiny['py_calls']} us_per_call={tiny['us_per_call']}"
    )


if __name__ == "__main__":
    main()
